/* SPDX-License-Identifier: MIT */
/*
 * sched_impl.h — what the scheduler's files share: the lane (one sequence's
 * one layer: its speculative state, its device slots and its controller job),
 * the scheduler object, and the functions step.c, controller.c and recall.c
 * call across.
 *
 * Lane ownership (see scheduler.h): `in_flight` is 1 from the moment the
 * engine posts a job until the controller has finished issuing it. While it
 * is 1 the controller owns every other field of the lane; while it is 0 the
 * engine does.
 */
#ifndef KVR_SCHEDULER_IMPL_H
#define KVR_SCHEDULER_IMPL_H

#include <pthread.h>
#include <stdatomic.h>

#include "../gpu/backend.h"
#include "../gpu/memory.h"
#include "../host/pool.h"
#include "../layouts/summary.h"
#include "scheduler.h"
#include "trace.h"

enum lane_job {
	LANE_JOB_SELECT = 1, /* select with prev_q for the next step, then recall (streamed) */
	LANE_JOB_RECALL = 2, /* recall `job_heads` to `selected` (urgent: corrected heads;
	                        deferred: the others after a correction) */
};

struct kvr_lane {
	_Atomic uint32_t in_flight; /* release by the controller when done, acquire by the
	                               engine in lane_acquire; the engine sets it before
	                               queueing (the queue mutex publishes the job) */
	uint32_t seq, layer;
	uint64_t posted_ns;       /* when the engine queued the lane's job (the queue
	                             mutex publishes it with the job) */
	uint32_t has_prev;        /* prev_q and selected are valid */
	unsigned char *prev_q;    /* [n_qo][d]: the query of the lane's latest step (mapped;
				     device memory under the device append) */
	int32_t *selected;        /* [n_kv][k]: pages the next step attends (ascending, -1 =
	                             none; mapped: the select kernel writes it) */
	/* streamed recall: the lane's device slots and what they hold */
	unsigned char *slot_k;    /* k slot tiles, device memory: NHD tiles of keys (p rows
	                             of n_kv·d), or of n_kv quantised runs each */
	unsigned char *slot_v;    /* k NHD tiles of values (plain pages only) */
	int32_t *slot_page;       /* [n_kv][k]: logical page in slot (m, j), -1 = empty */
	uint8_t *slot_fmt;        /* mixed pages: [n_kv][k] the format slot (m, j) holds */
	int32_t *slot_unit;       /* quantised pages: [n_kv][k][units_per_slot] the device
	                             page cache units slot (m, j) holds (units.c), -1 =
	                             none; mixed: two for a K8V4 page (its halves), one
	                             for a K4V2 page */
	/* mixed pages: units the lane's slots gave back (a K8V4 page gave way
	 * to a K4V2 one), kept for the lane's own next fills, whose copies wait
	 * for the lane's attention, and returned to the ring by one round at
	 * the step's end (units.c); all three under the units' lock */
	int32_t *spare_unit;      /* [n_kv · k · units_per_slot] */
	uint32_t n_spare;
	uint32_t holds_units;     /* the lane's slots took units since its sequence opened */
	struct lane_importance *imp; /* mixed pages: attention received (importance.c) */
	struct kvr_mirror recall_items; /* [n_kv][k] kvr_scatter_item: the lane's recall */
	struct kvr_event *recall_done; /* recorded on the convert stream after the lane's recall */
	struct kvr_event *attn_done;   /* recorded on the compute stream after the lane's attention */
	struct kvr_event *sel_done;    /* recorded on the controller's stream once per job, after a
					* selection it did not wait for (an asynchronous selector:
					* controller.c) or after the prefetch that follows it
					* (recall.c) */
	uint32_t sel_unwaited;        /* engine thread: a selection job was posted whose sel_done
					* the compute stream has not waited for yet (step.c) */
	/* the device plan with streamed recall: the controller's prefetch
	 * (recall.c), its counts; counts not yet tallied */
	uint32_t *prefetch_counts;    /* [n_kv][2] misses, hits (mapped: the plan kernel writes them) */
	uint32_t prefetch_pending;
	/* a device with memory of its own: device copies of the pages every
	 * step attends (resident.c); engine-owned */
	unsigned char **res_chunks;
	int32_t *res_held;        /* [res_cap_chunks * chunk pages]: logical page per slot */
	uint32_t res_n_chunks, res_cap_chunks;
	void *sum_dev;            /* [sum_cap] pages' key summaries on the device */
	uint32_t sum_valid, sum_cap; /* leading pages copied; capacity in pages */
	/* the device plan (step.c): each logical page's pool memory, as the plan
	 * kernel reads it (mapped); entries below addr_valid are current */
	uint64_t *page_addr;
	uint32_t addr_valid, addr_cap;
	/* the posted job */
	uint32_t job;             /* enum lane_job */
	uint32_t job_urgent;
	uint64_t job_n_tokens;    /* tokens after the step's append */
	uint8_t *job_heads;       /* [n_kv]: heads the job recalls */
	int32_t recall_error;     /* a recall the lane's next attention depends on failed:
	                             a spill read (-EIO, -EBADMSG), or any error of an
	                             urgent recall; written by the controller before it
	                             releases the lane (in_flight), read and cleared by the
	                             engine after acquiring it; that attention fails its
	                             sequence with it */
	uint64_t appended_step;   /* engine: the step (kvr_sched.step_serial) that last
	                             appended a token to this layer; a failed step takes
	                             back only what it appended */
	struct kvr_lane *next;    /* queue link, guarded by the queue mutex */
};

/* One recall chunk's staging buffer (streamed recall). */
struct staging {
	unsigned char *runs;                /* chunk_pages HND runs, device memory */
	struct kvr_event *staged;           /* copy stream: runs are in */
	struct kvr_event *drained;          /* convert stream: runs were scattered */
};

/* The engine's scratch for one layer call (a mirror: attention reads its
 * items), kept per layer so that an asynchronous attention may still read the
 * previous layer's items. */
struct layer_scratch {
	struct kvr_mirror m;
};

/* What one thread (the engine, the controller) selects with: its inline
 * stream, its score item (a mirror: the kernels read it) and its score
 * buffer (kernel scratch, grown as needed).
 *
 * An asynchronous selector (n_ring > 0: the controller's on the device
 * plan, where the host never reads its selections) selects several lanes
 * at once (kvr_select_pages_batch) and does not wait for them: the
 * controller records each lane's sel_done after the batch (and its
 * prefetch), which the next step's plan waits for on the device. Its
 * batches take turns in a ring of slots, a slot's host half rewritten only
 * once the event recorded after its last batch has completed. */
#define KVR_SELECT_RING 16
struct kvr_selector {
	struct kvr_stream *stream;
	struct kvr_mirror item; /* one struct kvr_score_item, or n_ring slots of batch_cap */
	float *scores;
	size_t scores_bytes;
	uint32_t n_ring, next_slot;
	uint32_t batch_cap;     /* asynchronous: lanes one slot (a batch) holds */
	struct kvr_event *ring_done[KVR_SELECT_RING];
	/* asynchronous, with streamed recall: each slot's prefetch plan items
	 * ([batch_cap][n_kv]) and the batch's scatter items (device memory,
	 * [batch_cap][n_kv][k]: one stream runs the batches in order) */
	struct kvr_mirror prefetch;
	struct kvr_scatter_item *prefetch_scatter;
};

struct kvr_sched {
	struct kvr_config c;
	struct kvr_pool *pool;
	struct kvr_dev *dev;
	uint32_t pool_layout, recall;
	int jobs_inline;             /* controller jobs run on the posting thread */
	uint32_t k, G, eb;
	uint32_t kv_format;          /* enum kvr_kv_format of the pool's pages */
	uint32_t units_per_slot;     /* quantised: device page cache units a slot may hold */
	uint64_t q_row, kv_row, tile_bytes, head_bytes;
	struct kvr_shape shape;      /* the whole layer (similarity, score, select, scatter) */
	struct kvr_shape head_shape; /* one KV head with its G query heads (attention) */
	struct kvr_shape lse_shape;  /* head_shape asking for segment_lse (mixed pages) */
	struct kvr_sched_hooks hooks;
	kvr_sched_log_fn log_fn;
	void *log_user;

	/* streams: created at start, then used by the thread named */
	struct kvr_stream *engine_inline; /* engine: its host-synchronous kernels */
	struct kvr_stream *compute;       /* engine queues attention: inline, or a worker (test hook) */
	/* decode appends tokens on the device (step.c append_on_device): a
	 * device with memory of its own, an HND pool of plain, K8V4 or K4V2
	 * pages (not mixed: demotion is host work) */
	int device_append;
	/* ... and the host does not read selections either: the plan kernel
	 * builds the selected pages' segments, corrections are flagged and
	 * selected on the device (zero-copy recall; streamed with plain pages
	 * and no spill tier) */
	int device_plan;
	/* the pages keep estimate rows, and sparse attention adds the
	 * unselected candidates' estimate (c.estimate; segments.c) */
	int estimates;
	int compute_host_sync;            /* compute runs its work as it is queued (cpu, cudaemu
	                                     inline): a stream wait there blocks the engine */
	struct kvr_stream *ctl_inline;    /* controller: its kernels */
	struct kvr_stream *copy;          /* controller queues: streamed recall, pool -> staging */
	struct kvr_stream *convert;       /* controller queues: streamed recall, staging -> slots */
	/* spill tier (the pool has a spill file): recall reads runs through the
	 * pool (RAM or file) into a host bounce, then copies it to the device;
	 * fixed at start */
	int spill;
	int spill_direct;                /* plain pages, host-visible device: no bounce */
	struct kvr_units *units;         /* quantised pages: the shared device page cache
	                                    (units.c, its own lock) */
	struct hook_arg {
		struct kvr_sched *s;
		uint32_t where;
	} hook_args[4];                  /* fixed at start; read by stream workers */
	struct kvr_lane *lanes;          /* [max_sequences][n_layers]; each lane owned as
	                                    scheduler.h says (in_flight) */
	unsigned char **tails;           /* [max_sequences]: the runtime's tail tiles */

	/* The engine thread's own state: the open step and its layer calls. */
	struct kvr_sched_engine {
		/* pool pages attention reads in place this step, pinned until the
		 * step's attention is done (kvr_sched_step_end) */
		uint32_t *step_pins;
		size_t n_step_pins, step_pins_cap;
		int suppress_segment_pins;   /* prefill attention pinned its pages already */
		/* sequences whose step failed in some layer this step: the later
		 * layers fail them too, and step_end takes back the token the
		 * earlier layers appended, so every layer keeps one length */
		int32_t *step_fail;          /* [max_sequences] the error, 0 = none */
		uint64_t *step_fail_pos;     /* [max_sequences] the step's position */
		uint32_t *step_fail_layer;   /* [max_sequences] the layer it failed at */
		char *step_fail_message;     /* [max_sequences][KVR_SCHED_MESSAGE] its reason,
		                                "sequence S layer L: ..." */
		uint32_t *step_failed;       /* the sequences with step_fail set */
		uint32_t n_step_failed;
		uint64_t step_serial;        /* the open step's number, from 1 (a lane's
		                                appended_step 0 = never) */
		struct layer_scratch *scratch; /* [n_layers] */
		int32_t *now_sel;            /* [max_batch][n_kv][k]: the step's selections (mapped) */
		int32_t *seg_pages;          /* [k] one head's slots' pages, sorted (segments) */
		uint32_t *seg_slots;         /* [k] the slots beside them */
		struct kvr_lane **post_lanes; /* [max_batch] a layer's jobs, posted together */
		struct kvr_selector engine_sel;
		struct kvr_mirror similarity; /* the similarity item */
		/* the layer's q, k, v as the host reads them where it cannot
		 * address device memory ([batch] rows each; mapped;
		 * kvr_host_view), the events ordering a layer against the
		 * engine's stream, a row of zeros for failed sequences' outputs,
		 * prefill attention's staging of its rows */
		unsigned char *inputs_stage;
		size_t inputs_stage_bytes;
		struct kvr_event *engine_ready; /* recorded on the engine's stream at a layer's start */
		struct kvr_event *layer_done;   /* recorded on compute after a layer's attention */
		struct kvr_event *appended;     /* recorded on compute after a layer's completed pages */
		void *zero_row;
		void *prefill_q, *prefill_out; /* device stages of a query block's rows */
		size_t prefill_q_bytes, prefill_out_bytes;
		void *prefill_rows; /* mapped: the block's gathered query rows, then its output rows */
		size_t prefill_rows_bytes;
		void *prefill_lse; /* mapped: the spill windows' segment log-sum-exps */
		size_t prefill_lse_bytes;
		/* the device plan: one layer's selections' scores (device
		 * scratch), and per layer what step_end tallies once the step's
		 * work is done (the flags the device wrote) */
		float *plan_scores;
		size_t plan_scores_bytes;
		struct plan_tally {
			const struct entry *e; /* [batch] the layer call's entries */
			const uint8_t *corrected; /* [batch][n_kv], host view */
			const uint32_t *recall_counts; /* streamed: [plan item][2] misses, hits */
			uint32_t batch;        /* 0: nothing to tally */
		} *tally;                      /* [n_layers] */
		/* memory a queued kernel may still read, freed at the step's end */
		struct deferred_free {
			void *ptr;
			int mapped; /* kvr_mapped_free, else kvr_dev_free */
		} *deferred;
		uint32_t n_deferred, deferred_cap;
		/* a step in fixed shape, which a CUDA graph holds (capture.c):
		 * the reservation, and per layer what its capture was given */
		struct fixed_shape {
			uint32_t batch;       /* reserved sequences per step; 0: none */
			uint64_t max_tokens;  /* reserved tokens per sequence */
			struct fixed_layer {
				const void *q, *k, *v;
				void *out;
				const void *scratch_host; /* the layer scratch the graph uploads from */
				const void *scratch_dev;  /* ... and its kernels read */
				uint32_t batch;           /* the captured batch; 0: not captured */
				uint32_t seg_cap;         /* reserved segments per attention item */
			} *layers;            /* [n_layers] */
			/* the sparse modes: the selections' scores (device scratch;
			 * this step's on compute, the next step's on `fork`, each
			 * [batch][n_kv][pages + 1]), the stream the next step's
			 * selections fork to inside the graph and its events */
			float *scores_now, *scores_next;
			size_t scores_now_bytes, scores_next_bytes;
			struct kvr_stream *fork;
			struct kvr_event *fork_ready, *fork_done;
			int fork_used;        /* the capture forked to it (joined at its last layer) */
			int replayed;         /* the open step was replayed (step_end tallies it) */
			/* the open step was replayed: its graph runs on this stream
			 * (step_end waits for it there) */
			struct kvr_stream *replay_stream;
			struct kvr_event *replay_done;
			/* the replay's resident copies (queued on compute before the
			 * graph) are ready: the launch stream waits for it */
			struct kvr_event *replay_ready;
			/* a replay's host part: pages from this one on have no
			 * resident copy made (the graph's append writes the entry's
			 * page after the copies would run); UINT32_MAX otherwise */
			uint32_t unwritten_from;
		} fixed;
	} eng;

	/* The controller thread's recall state (and what it queues on the copy
	 * and convert streams, ordered there by the staging buffers' events). */
	struct kvr_sched_recall {
		struct staging staging[2];
		uint32_t n_staging, chunk_pages;
		uint32_t next_buffer;        /* the staging buffer of the next chunk */
		void *recall_misses;         /* [k] misses of one head; quantised pages:
		                                [n_kv][k], every head's */
		uint32_t *recall_need;       /* quantised: [n_kv] units to take */
		uint32_t *recall_unit_slots; /* quantised: [n_kv·k·2] their slot entries */
		uint32_t *recall_release;    /* mixed: [n_kv] units to give back */
		uint32_t *recall_release_slots; /* mixed: [n_kv·k] their slot entries */
		uint8_t *recall_flags;       /* [2k] plan flags */
		struct kvr_copy_desc *recall_descs; /* [chunk_pages] */
		unsigned char *bounce[2];    /* spill: chunk_pages runs each, host memory (registered) */
		struct kvr_event *bounce_done[2]; /* copy stream: the copy out of bounce[b] is done */
		uint32_t next_bounce;
		uint32_t *bounce_pages, *bounce_heads; /* [chunk_pages] */
		struct kvr_selector ctl_sel;
	} rec;

	/* The controller's queues, shared by the engine and the controller
	 * under `lock`. */
	struct kvr_sched_queue {
		pthread_t thread;
		int thread_started;
		pthread_mutex_t lock;        /* guards the queues, quit, busy */
		pthread_cond_t work;         /* controller waits for jobs */
		pthread_cond_t done;         /* the engine waits for a lane */
		struct kvr_lane *urgent_head, *urgent_tail;
		struct kvr_lane *normal_head, *normal_tail;
		uint32_t engine_waiting;     /* someone sleeps on `done` */
		int quit;
		struct kvr_lane **batch;     /* [max_batch] controller thread: the jobs it runs together */
	} queue;

	_Atomic(struct kvr_trace *) trace; /* acquire by recorders, release by the runtime */

	/* counters: relaxed atomics, written by the engine and the controller,
	 * read by kvr_get_stats (statistics, no ordering needed) */
	_Atomic uint64_t counters[KVR_C_COUNT];
	_Atomic uint64_t *seq_counters;    /* [max_sequences][KVR_C_COUNT] */
	_Atomic uint64_t *head_corrections; /* [max_sequences][n_kv] */

	/* the first asynchronous failure (controller, streams) */
	pthread_mutex_t error_lock;
	int async_error;
	char async_message[256];
	/* why the urgent recall failed (lane->recall_error): written by the
	 * controller before it releases the lane, read by the engine, which
	 * waits for that lane, after acquiring it (one urgent job at a time) */
	char urgent_message[224];
	char last_error[256];
};

/* step.c: the step of `seq` failed at `layer` for `reason` (kept as the
 * sequence's message; its later layers fail too, step_end takes back what
 * the earlier ones appended). Engine thread. */
void kvr_sched_mark_failed(struct kvr_sched *s, uint32_t seq, uint32_t layer, uint64_t position, int err,
			   const char *reason);

/* capture.c (engine thread): its streams and buffers freed (the
 * scheduler's teardown); a replayed step's corrections counted once its
 * graph has run (step_end). */
void kvr_sched_capture_free(struct kvr_sched *s);
void kvr_sched_replay_tally(struct kvr_sched *s);

/* step.c: head m's plan item of a lane holding n_tokens, zero-copy (the
 * streamed fields are the caller's): the selected pages are `now`'s where
 * `corr` flags the head (every head when corr is NULL and now is not),
 * else the lane's selection; their memory from addrs; attention and
 * segments the kernels' views of its attention item and segment list
 * (n_head leading, then k slots, then n_tail); q_head (or NULL) the head's
 * query rows, which the kernel keeps in the lane's prev_q. */
struct kvr_plan_item kvr_sched_plan_item(const struct kvr_sched *s, const struct kvr_lane *lane, uint32_t m,
					 uint64_t n_tokens, struct kvr_attention_item *attention,
					 struct kvr_kv_segment *segments, uint32_t n_head, uint32_t n_tail,
					 const int32_t *now, const uint8_t *corr, const uint64_t *addrs,
					 uint32_t n_addrs, const unsigned char *q_head);

/* step.c: streamed, the compute stream after the lane's latest recall
 * (a host wait first where compute runs on the host: counted as a recall
 * wait unless `correction`); engine thread, uncaptured or in a replay's
 * host part. */
int kvr_step_wait_recall(struct kvr_sched *s, struct kvr_lane *lane, int correction);

/* step_device.c: the streamed fields of head m's plan item `pl` (from
 * kvr_sched_plan_item): its segments read the lane's slot tiles, the kernel
 * plans the lane's slots and writes the misses' k scatter items to
 * `scatter` (the kernels' view) and [misses, hits] to `counts`. */
void kvr_sched_plan_item_slots(const struct kvr_sched *s, const struct kvr_lane *lane, uint32_t m,
			       struct kvr_plan_item *pl, struct kvr_scatter_item *scatter, uint32_t *counts);

/* step_device.c: one entry's statistics on the device plan once its step's
 * work is done, alike for uncaptured steps (kvr_step_tally_plans) and
 * replayed ones (capture.c). Streamed: plan_counts ([n_kv][2] misses, hits
 * of this step's plan, or NULL) count every head's misses and the hits of
 * the heads it recalled for (every head where all_corrected, else those
 * `corr` flags); prefetch_counts (the prefetch's, or NULL) count all.
 * checked (freekv): the corrections `corr` ([n_kv]) flags. */
void kvr_sched_tally_entry(struct kvr_sched *s, uint32_t seq, const uint32_t *plan_counts,
			   const uint32_t *prefetch_counts, const uint8_t *corr, int checked, int all_corrected);

/* step.c: the bytes of a layer scratch for an (uncaptured) layer call of
 * `batch` sequences of up to max_pages full pages each. */
size_t kvr_sched_layer_scratch_bytes(const struct kvr_sched *s, uint32_t batch, uint32_t max_pages);

/* One sequence's failure message (step_fail_message). */
#define KVR_SCHED_MESSAGE 256

static inline struct kvr_lane *lane_of(struct kvr_sched *s, uint32_t seq, uint32_t layer)
{
	return &s->lanes[(uint64_t)seq * s->c.n_layers + layer];
}

static inline void count(struct kvr_sched *s, uint32_t seq, enum kvr_counter c, uint64_t v)
{
	atomic_fetch_add_explicit(&s->counters[c], v, memory_order_relaxed);
	atomic_fetch_add_explicit(&s->seq_counters[(uint64_t)seq * KVR_C_COUNT + c], v,
				  memory_order_relaxed);
}

/*
 * The first page of the window of a layer that holds n_tokens
 * (docs/design.md, "Glossary": the W/p newest full pages plus the partial
 * tail). With W = 0 the page the newest token completed is the window's
 * (its "partial tail" just filled): it has no summary before this step, so
 * no selection can have named it, and without this it would be attended by
 * nobody at the step completing it.
 * For W >= p this is n_full - W/p (or 0), which never exceeds that page.
 * Pages below it and at or above sink are what selection must cover.
 */
static inline uint32_t kvr_window_first(const struct kvr_config *c, uint64_t n_tokens)
{
	const uint32_t p = c->page_tokens, window = c->window_tokens / p;
	const uint32_t n_full = (uint32_t)(n_tokens / p);
	if (!window)
		return n_tokens && n_tokens % p == 0 ? n_full - 1 : n_full;
	return n_full > window ? n_full - window : 0;
}

static inline struct kvr_trace *trace_of(struct kvr_sched *s)
{
	/* acquire pairs with kvr_sched_set_trace's release store */
	return atomic_load_explicit(&s->trace, memory_order_acquire);
}

/* controller.c */
int kvr_controller_start(struct kvr_sched *s);
void kvr_controller_stop(struct kvr_sched *s);
/* Queue the lane's job (the engine has filled it; in_flight is set here). */
void kvr_controller_post(struct kvr_sched *s, struct kvr_lane *lane, int urgent);
/* Normal jobs of n lanes in one handoff, so that the controller can run
 * the device plan's selections together (controller.c); engine thread. */
void kvr_controller_post_many(struct kvr_sched *s, struct kvr_lane *const *lanes, uint32_t n);
/* Wait until the lane has no job in flight; returns the nanoseconds waited
 * (0 when it had none). */
uint64_t kvr_lane_acquire(struct kvr_sched *s, struct kvr_lane *lane);
void kvr_sched_record_async_error(struct kvr_sched *s, int err, const char *what);

/* recall.c */
int kvr_recall_setup(struct kvr_sched *s, char *err, size_t err_bytes);
void kvr_recall_teardown(struct kvr_sched *s);
/* bench recall's variants: streamed recall's staging buffers and chunk size
 * changed between recalls, on a context with no decode step and no
 * controller job in flight (the caller's thread owns every lane). Its
 * device memory is not admitted against device_bytes. */
int kvr_recall_reconfigure(struct kvr_sched *s, uint32_t buffers, uint32_t chunk_pages, char *err,
			   size_t err_bytes);
int kvr_recall_lane_alloc(struct kvr_sched *s, struct kvr_lane *lane);
void kvr_recall_lane_free(struct kvr_sched *s, struct kvr_lane *lane);
/* Plan and issue the recall of heads[m] != 0 so that their slots hold
 * lane->selected; controller thread. */
int kvr_recall_issue(struct kvr_sched *s, struct kvr_lane *lane, const uint8_t *heads);
/* The device plan with streamed recall: plan and move the selections of
 * the lanes kvr_select_pages_batch selected into their slots, on the
 * selector's stream (the controller's), in one plan and one scatter launch
 * with the ring slot's plan items; the host waits for nothing. Records
 * nothing: the caller records the slot's and the lanes' events. Controller
 * thread, holding the lanes. */
int kvr_recall_prefetch_batch(struct kvr_sched *s, struct kvr_lane *const *lanes, uint32_t n,
			      struct kvr_selector *sel, uint32_t slot);
/* Head m's prefetch plan item of a lane whose next selection is in
 * lane->selected (its step held lane->job_n_tokens): the plan kernel plans
 * its slots (no segments) and writes the misses' k scatter items to
 * `scatter` and its [misses, hits] to `counts`. The controller's batches
 * and a captured step's fork (capture.c) build theirs with it. */
struct kvr_plan_item kvr_recall_prefetch_item(const struct kvr_sched *s, const struct kvr_lane *lane, uint32_t m,
					      struct kvr_scatter_item *scatter, uint32_t *counts);
/* Tally the lane's last prefetch's counts (waiting for it, rare); whoever
 * holds the lane. */
void kvr_recall_prefetch_settle(struct kvr_sched *s, struct kvr_lane *lane);
/* units.c: the device page cache of quantised pages (see there) */
int kvr_units_setup(struct kvr_sched *s, char *err, size_t err_bytes);
void kvr_units_teardown(struct kvr_sched *s);
/* Units one sequence may hold (every sparse layer × n_kv × k), and the ring's
 * device bytes beside the units. */
uint64_t kvr_units_seq_count(const struct kvr_config *c);
uint64_t kvr_units_fixed_bytes(const struct kvr_config *c);
/* Engine thread: reserve a sequence's worth (units come with its recalls,
 * the cache growing when a round finds too few free) / return every unit the
 * sequence's lanes hold in one free round. */
int kvr_units_seq_open(struct kvr_sched *s);
void kvr_units_seq_close(struct kvr_sched *s, uint32_t seq);
/* Fill a lane's empty unit entries: head m's entries are
 * slots[o_m .. o_m + need[m]), o_m = need[0] + ... + need[m-1]; an entry is
 * j·units_per_slot + h for unit h of slot j. Entries already holding a unit
 * are skipped. Units come from the lane's spares first, then from one
 * allocation round, which, when the lane has never held units, also fills
 * unit 0 of every slot of every other such sparse lane of the sequence: a
 * sequence turning sparse takes its units in one round, not one per layer.
 * 0 or a negative errno (recorded as the scheduler's asynchronous error). */
int kvr_units_fill(struct kvr_sched *s, struct kvr_lane *lane, const uint32_t *need, const uint32_t *slots);
/* Head m gives back the units of its entries slots[o_m .. o_m + release[m])
 * (mixed pages: a slot whose K8V4 page gave way to a K4V2 one). They become
 * the lane's spares (no round); kvr_units_step_end returns them. */
int kvr_units_release(struct kvr_sched *s, struct kvr_lane *lane, const uint32_t *release,
		      const uint32_t *slots);
/* The same, with the units' lock held by the caller (kvr_units_lock): recall
 * plans a lane's entries under it, since another lane's fill may write them. */
void kvr_units_lock(struct kvr_sched *s);
void kvr_units_unlock(struct kvr_sched *s);
int kvr_units_fill_locked(struct kvr_sched *s, struct kvr_lane *lane, const uint32_t *need,
			  const uint32_t *slots);
int kvr_units_release_locked(struct kvr_sched *s, struct kvr_lane *lane, const uint32_t *release,
			     const uint32_t *slots);
/* Engine thread, at the step's end once the compute stream is idle: every
 * lane's spares go back to the ring in one free round. */
void kvr_units_step_end(struct kvr_sched *s);
uint32_t kvr_units_per_slot(const struct kvr_config *c);
uint64_t kvr_units_unit_bytes(const struct kvr_config *c);
unsigned char *kvr_units_addr(const struct kvr_sched *s, uint32_t id);

/* Stream-order host function inserting a test delay (no-op without hooks). */
void kvr_sched_hook_on_stream(struct kvr_sched *s, struct kvr_stream *stream, uint32_t where);
/* Begin/end of a span that runs on a stream (host functions; no-op untraced). */
struct kvr_trace_span *kvr_stream_span_begin(struct kvr_sched *s, struct kvr_stream *stream,
					     const char *name, uint32_t track, uint32_t seq,
					     uint32_t layer, uint32_t count);
void kvr_stream_span_end(struct kvr_sched *s, struct kvr_stream *stream,
			 struct kvr_trace_span *span);

/* importance.c (kv_format mixed; everything a no-op for other lanes) */
int kvr_importance_enabled(const struct kvr_sched *s, uint32_t layer);
int kvr_importance_lane_open(struct kvr_sched *s, struct kvr_lane *lane);
void kvr_importance_lane_free(struct kvr_sched *s, struct kvr_lane *lane);
void kvr_importance_lane_forget(struct kvr_sched *s, struct kvr_lane *lane);
/* The segment_lse array for KV head m's item of n_segs segments over
 * n_tokens tokens (recording where its window pages are), or NULL. */
float *kvr_importance_item(struct kvr_sched *s, struct kvr_lane *lane, uint32_t m, uint64_t n_tokens,
			   uint32_t n_segs);
/* Add the lane's latest attention's window shares to its pages. */
void kvr_importance_harvest(struct kvr_sched *s, struct kvr_lane *lane);
/* After the step's attention (n_tokens after the append): judge, and demote
 * or keep, the pages that leave the window at the next step. */
void kvr_importance_judge(struct kvr_sched *s, struct kvr_lane *lane, uint64_t n_tokens);

/* resident.c */
int kvr_resident_enabled(const struct kvr_sched *s);
int kvr_resident_lane_open(struct kvr_sched *s, struct kvr_lane *lane);
void kvr_resident_lane_free(struct kvr_sched *s, struct kvr_lane *lane);
void kvr_resident_lane_forget(struct kvr_lane *lane);
/* The device copy of the lane's logical page (pool page page_id), queued for
 * copying on the compute stream when not held; NULL when the page has no slot
 * or device memory ran out (the caller reads the pool page in place). */
const unsigned char *kvr_resident_page(struct kvr_sched *s, struct kvr_lane *lane, uint32_t logical,
				       uint32_t page_id);

/* The lane's key summaries for its first n_pages pages where the kernels
 * read them: the pool's array (host-addressable devices) or the lane's device
 * copy, extended on `stream` (the holder's selection stream). NULL when the
 * pool keeps none or device memory ran out. */
const void *kvr_resident_summaries(struct kvr_sched *s, struct kvr_lane *lane, uint32_t n_pages,
				   struct kvr_stream *stream);
/* The lane's table of its first n_pages pages' pool memory (the plan
 * kernel's page_addr), brought up to date; NULL when out of memory. Engine
 * thread. */
const uint64_t *kvr_resident_page_addrs(struct kvr_sched *s, struct kvr_lane *lane, uint32_t n_pages);

/* select.c: selection of one lane with query q (device-readable) against the
 * window of a layer holding n_tokens tokens at the next step (next = 1) or now
 * (next = 0), into `selected` (mapped), with the calling thread's selector.
 * `selected` is readable by the host on return. Not for an asynchronous
 * selector (-EINVAL): that one selects in batches. */
int kvr_select_pages(struct kvr_sched *s, struct kvr_lane *lane, const void *q, uint64_t n_tokens,
		     int next, int32_t *selected, struct kvr_selector *sel);
/* Make `sel` asynchronous (above): its ring of items and their events. */
int kvr_selector_make_async(struct kvr_sched *s, struct kvr_selector *sel);
/* The controller's speculative selections of several lanes (jobs with the
 * lanes' prev_q and job_n_tokens) with an asynchronous selector, in one
 * launch of each kernel: their items in the ring's next slot, which is
 * returned in *slot for the caller to record ring_done[*slot] once it has
 * queued everything that reads the slot (kvr_recall_prefetch_batch). A lane
 * with nothing to select gets -1 pages. Controller thread, holding the
 * lanes. */
int kvr_select_pages_batch(struct kvr_sched *s, struct kvr_lane *const *lanes, uint32_t n,
			   struct kvr_selector *sel, uint32_t *slot);
/* The selector's items and events (scores are the caller's to free). */
void kvr_selector_free(struct kvr_sched *s, struct kvr_selector *sel);
/* The score item of that selection, its summaries brought to the device on
 * `stream`, scores into `scores` (*scores_need floats are needed: the call
 * fails with -ENOSPC, nothing queued, when scores_cap is less); nothing
 * launched. -ENOMEM without device memory for the summaries; -ENODATA when
 * the pool keeps no summaries (select nothing). */
int kvr_select_item(struct kvr_sched *s, struct kvr_lane *lane, const void *q, uint64_t n_tokens,
		    int next, int32_t *selected, float *scores, size_t scores_cap, size_t *scores_need,
		    struct kvr_stream *stream, struct kvr_score_item *item);

/* Dense path for this layer: mode dense, or a layer the config keeps dense. */
static inline int kvr_layer_dense(const struct kvr_sched *s, uint32_t layer)
{
	return s->c.mode == KVR_MODE_DENSE || (s->c.dense_layers[layer / 64] >> (layer % 64) & 1);
}

/* segments.c (engine thread). Spill tier: pin pool page `id`, read in place
 * by this step's attention, until kvr_sched_unpin_step (or unpin_from(mark)
 * for the pins taken after `mark`, n_step_pins when it was taken). */
int kvr_sched_pin_in_place(struct kvr_sched *s, uint32_t id);
int kvr_sched_hold_pin(struct kvr_sched *s, uint32_t id);
void kvr_sched_unpin_from(struct kvr_sched *s, size_t mark);
void kvr_sched_unpin_step(struct kvr_sched *s);
/* The segment of KV head m over the lane's logical page, read where it lives
 * (its resident device copy when `resident` and held, else the pool page,
 * pinned with a spill tier); *err on failure. */
struct kvr_kv_segment kvr_sched_pool_segment(struct kvr_sched *s, struct kvr_lane *lane,
					     uint32_t logical, uint32_t m, int resident, int *err);
/* KV head m's segments for a layer of n_tokens: every page (dense) or sink,
 * the selected pages `sel` (or the lane's slots holding them, from_slots) in
 * ascending page order, window and tail; returns how many were written to
 * out, *err on failure. */
uint32_t kvr_sched_build_segments(struct kvr_sched *s, struct kvr_lane *lane, uint32_t m,
				  uint64_t n_tokens, int dense, const int32_t *sel, int from_slots,
				  struct kvr_kv_segment *out, int *err);

/* sched.c: free ptr at the step's end, after the work queued before has run
 * (engine thread; on failure to record it, waits and frees at once). */
void kvr_sched_defer_free(struct kvr_sched *s, void *ptr, int mapped);
void kvr_sched_free_deferred(struct kvr_sched *s);

/* waits.c: host waits for the device, counted (kvr_stats.host_waits) when
 * the engine thread makes them inside a layer call. seq UINT32_MAX: the
 * batch's wait (counted for the context only). */
void kvr_sched_layer_enter(struct kvr_sched *s);
void kvr_sched_layer_leave(struct kvr_sched *s);
int kvr_sched_wait_stream(struct kvr_sched *s, struct kvr_stream *stream, uint32_t seq, uint32_t layer,
			  const char *what);
int kvr_sched_wait_event(struct kvr_sched *s, struct kvr_event *event, uint32_t seq, uint32_t layer,
			 const char *what);
/* A wait of the engine's from t0 to t1 that is not a device call (an urgent
 * controller job), counted and traced as one. */
void kvr_sched_count_host_wait(struct kvr_sched *s, uint32_t seq, uint32_t layer, const char *what,
			       uint64_t t0, uint64_t t1);
/* 1 on the engine's thread inside a layer call of s. */
int kvr_sched_in_layer(const struct kvr_sched *s);

uint32_t kvr_sched_build_planned(struct kvr_sched *s, struct kvr_lane *lane, uint32_t m, uint64_t n_tokens,
				 struct kvr_kv_segment *out, uint32_t *n_head, uint32_t *n_tail, int *err);

/* lanes.c (engine thread): the lane's speculative state dropped, so its next
 * sparse step selects afresh (after a truncate or a failed step). */
void kvr_sched_lane_forget(struct kvr_sched *s, struct kvr_lane *lane);

#endif /* KVR_SCHEDULER_IMPL_H */
