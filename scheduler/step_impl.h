/* SPDX-License-Identifier: MIT */
/*
 * step_impl.h — what the decode step's files share: a layer call's state
 * (struct layer_call, one batch entry's struct entry) and the helpers each
 * phase calls in another. step.c holds the layer call and the host path,
 * step_append.c the device append of the tokens, step_device.c the device
 * plan (similarity, score, select and plan on the device, then attention).
 *
 * Threads: the engine's thread (one step at a time per context).
 */
#ifndef KVR_SCHEDULER_STEP_IMPL_H
#define KVR_SCHEDULER_STEP_IMPL_H

#include "sched_impl.h"

enum seq_kind {
	SEQ_FAILED = 0,
	SEQ_DENSE,     /* dense path */
	SEQ_SPARSE,    /* sparse, nothing corrected */
	SEQ_CORRECTED, /* sparse, some heads corrected */
};

/* The engine's view of one batch entry during a layer call. */
struct entry {
	uint32_t kind;
	uint32_t any_corrected;
	uint64_t n_tokens;
	uint32_t seq;
	uint32_t checked; /* device plan: the device flagged its heads (step_end tallies) */
	uint32_t first_plan; /* device plan, streamed: its first plan item (recall counts) */
	uint32_t planned;    /* ... it has n_kv plan items */
	uint32_t all_corrected; /* device plan: every head selected with q_i */
};

/* One layer call of a batch: its inputs, its scratch carved into the
 * kernels' items, and what each phase leaves for the next. */
struct layer_call {
	struct kvr_sched *s;
	uint32_t layer, batch;
	const uint32_t *seqs;
	const uint64_t *positions;
	void *out;
	int32_t *status;
	struct kvr_trace *tr;
	uint64_t t_enter;
	uint32_t n_kv, kk;
	uint64_t q_row, kv_row, head_q_bytes;
	/* q_dev feeds kernels; q_host, k_host, v_host the host's own work
	 * (NULL with a device append) */
	const unsigned char *q_dev, *k_dev, *v_dev, *q_host, *k_host, *v_host;
	/* the device appends the tokens (append_on_device), the host never
	 * reads q, k, v */
	int device_append;
	uint32_t max_pages; /* full pages of the longest sequence after the append */
	/* the layer's scratch (kvr_sched.scratch[layer]) carved by layer_scratch */
	struct layer_scratch *ls;
	struct kvr_attention_item *items;
	struct kvr_kv_segment *segs;
	struct entry *e;
	float *cosine;
	uint8_t *corrected;        /* [batch][n_kv] */
	struct kvr_lane **att_lanes; /* lanes whose attention is queued */
	struct kvr_append_item *appends; /* [batch] device append: the tokens, pages they complete */
	/* the device plan's kernel items */
	struct kvr_similarity_item *sims;   /* [batch] */
	struct kvr_score_item *score_items; /* [batch] */
	struct kvr_plan_item *plans;        /* [batch][n_kv] */
	uint32_t n_plans;
	struct kvr_scatter_item *plan_scatter; /* [batch][n_kv][k] streamed: the misses' moves */
	uint32_t *recall_counts;            /* [batch][n_kv][2] streamed: misses, hits */
	uint32_t n_items, n_segs, n_att, n_appends, n_filled;
	int append_error; /* queue_appends could not queue its kernel */
};

/* step.c */
void kvr_step_fail_sequence(struct kvr_sched *s, uint32_t seq, uint32_t layer, uint64_t position, int err,
			    const char *reason, unsigned char *out);
void kvr_step_zero_output(struct kvr_sched *s, void *out_row);
/* The entry's kind (enum seq_kind) for this layer, with what it selects. */
uint32_t kvr_step_start_entry(struct layer_call *lc, uint32_t i, struct kvr_lane *lane, int *select_all,
			      int *check);
int kvr_step_run_attention(struct kvr_sched *s, uint32_t layer, struct layer_scratch *ls,
			   const struct kvr_attention_item *items, uint32_t n_items,
			   const struct kvr_kv_segment *segs, uint32_t seg_begin, uint32_t n_segs,
			   struct kvr_lane **lanes, uint32_t n_lanes, int uploaded);
int kvr_step_queue_items(struct layer_call *lc, uint32_t i, struct kvr_lane *lane, int dense, int slots,
			 const int32_t *now_sel, const uint8_t *corr, int first_err);

/* step_append.c: step 1's append of every entry's token */
void kvr_step_layer_append(struct layer_call *lc);

/* step_device.c: steps 2-4 on the device plan, and their tally at the
 * step's end */
int kvr_step_attend_on_device(struct layer_call *lc);
void kvr_step_tally_plans(struct kvr_sched *s);

#endif /* KVR_SCHEDULER_STEP_IMPL_H */
