/* SPDX-License-Identifier: MIT */
/*
 * scheduler.h — the decode-step scheduler: per (sequence, layer) state
 * machine of speculative retrieval, the controller thread that runs selection
 * and recall planning off the engine's critical path, and the device page
 * cache filled by double-buffered streamed recall. runtime/ drives it; it uses
 * host/ (the pool) and gpu/ (the device interface) and makes no system or
 * CUDA call of its own besides threads and clocks.
 *
 * Ownership of one (sequence, layer) "lane" alternates: the engine's thread
 * owns it from kvr_sched_* entry (after waiting for the lane's controller job,
 * if one is in flight) until it posts the next job; the controller owns it
 * while the job runs. Every runtime call that touches a sequence's pool pages
 * (prefill, truncate, fork, free) first waits for that sequence's jobs
 * (kvr_sched_seq_quiesce), so the controller never reads summaries the engine
 * is reallocating.
 *
 * Threads: the engine's thread calls everything here, one decode step at a
 * time per context (kvrecall.h); the controller thread is internal.
 */
#ifndef KVR_SCHEDULER_H
#define KVR_SCHEDULER_H

#include <stddef.h>
#include <stdint.h>

#include "../runtime/kvrecall.h"

struct kvr_pool;
struct kvr_dev;
struct kvr_sched;
struct kvr_trace;

/* Counters, one array per context and one per sequence (kvr_stats). */
enum kvr_counter {
	KVR_C_LAYER_DECODES,
	KVR_C_DENSE_DECODES,
	KVR_C_SELECTIONS,
	KVR_C_CORRECTED_HEADS,
	KVR_C_CHECKED_HEADS,
	KVR_C_FAILED_DECODES,
	KVR_C_CORRECTION_WAITS,
	KVR_C_CORRECTION_WAIT_NS,
	KVR_C_CONTROLLER_WAITS,
	KVR_C_CONTROLLER_WAIT_NS,
	KVR_C_RECALL_WAITS,
	KVR_C_RECALL_WAIT_NS,
	KVR_C_PAGES_RECALLED,
	KVR_C_PAGES_HIT,
	KVR_C_BYTES_RECALLED,
	KVR_C_CRITICAL_NS,
	KVR_C_CONTROLLER_NS,
	KVR_C_CONTROLLER_JOBS,
	KVR_C_PAGES_JUDGED,
	KVR_C_PAGES_DEMOTED,
	KVR_C_UNITS_TAKEN,    /* quantised pages: device page cache units taken by slots */
	KVR_C_UNITS_RELEASED, /* mixed pages: of which given back while the sequence lives */
	KVR_C_HOST_WAITS,     /* the engine thread's waits for the device in layer calls (waits.c) */
	KVR_C_HOST_WAIT_NS,
	/* the controller's time by part (controller.c, select.c) */
	KVR_C_CTL_HANDOFF_NS, /* from a job's post to the controller taking it */
	KVR_C_CTL_PREPARE_NS, /* its selections: candidates, summaries, the score item */
	KVR_C_CTL_SCORE_NS,   /* its selections: the score kernel */
	KVR_C_CTL_TOPK_NS,    /* its selections: top-k and group consistency (the select kernel) */
	KVR_C_CTL_RECALL_NS,  /* streamed: the recall it plans and issues */
	KVR_C_COUNT
};

/* Test hooks (tests/test_scheduler.c): delays injected into the controller
 * and the recall streams, and an asynchronous compute stream, so that a slot
 * write racing an attention would change outputs. */
struct kvr_stream;

struct kvr_sched_hooks {
	void (*delay)(void *user, uint32_t where); /* where: enum kvr_hook_site */
	void *user;
	uint32_t async_compute; /* 1: attention runs on a worker stream */
	uint32_t host_step;     /* 1: no device append or plan (the host reads q, k, v
	                           and selections), to compare the two paths */
};

enum kvr_hook_site {
	KVR_HOOK_CONTROLLER_JOB = 0, /* controller thread, before each job */
	KVR_HOOK_COPY = 1,           /* copy stream, before a chunk's copies */
	KVR_HOOK_CONVERT = 2,        /* convert stream, before a chunk's scatter */
	KVR_HOOK_COMPUTE = 3,        /* compute stream, before attention */
};

typedef void (*kvr_sched_log_fn)(void *user, int level, const char *message);

struct kvr_sched_params {
	const struct kvr_config *config; /* resolved; copied */
	struct kvr_pool *pool;
	struct kvr_dev *dev;
	uint32_t pool_layout;            /* enum kvr_pool_layout */
	uint32_t recall;                 /* enum kvr_recall, resolved (not AUTO) */
	const struct kvr_sched_hooks *hooks; /* NULL: none */
	kvr_sched_log_fn log_fn;
	void *log_user;
};

/* Create the scheduler and start the controller thread. -ENOMEM, or the
 * device's error (message in err). */
int kvr_sched_create(const struct kvr_sched_params *params, struct kvr_sched **out, char *err,
		     size_t err_bytes);
/* Stop the controller (after its queued jobs) and free everything. NULL-safe. */
void kvr_sched_destroy(struct kvr_sched *s);
/* The message of the scheduler's most recent failure. */
const char *kvr_sched_last_error(const struct kvr_sched *s);

/* Device bytes one sequence's page cache takes (slots of every sparse layer),
 * and the context's fixed device bytes (staging buffers). */
uint64_t kvr_sched_seq_device_bytes(const struct kvr_config *c, uint32_t recall);
uint64_t kvr_sched_fixed_device_bytes(const struct kvr_config *c, uint32_t recall);
/* 1 when the config's k (selected pages per KV head) is one the device
 * plan takes (1..KVR_PLAN_MAX_K); recall = auto asks (config.c). */
int kvr_sched_k_plannable(const struct kvr_config *c);
/* Device bytes of one sparse lane's resident sink and window pages (cuda). */
uint64_t kvr_resident_lane_bytes(const struct kvr_config *c);

/* A sequence's lanes: open with its tail tiles (per layer, the NHD K tile then
 * the V tile, tile_bytes each); close waits for its jobs and frees its slots. */
int kvr_sched_seq_open(struct kvr_sched *s, uint32_t seq, unsigned char *tails);
void kvr_sched_seq_close(struct kvr_sched *s, uint32_t seq);
/* Wait until no controller job of `seq` is queued or running. */
void kvr_sched_seq_quiesce(struct kvr_sched *s, uint32_t seq);
/* Forget the previous query, the selection and the resident pages of every
 * layer of `seq` (after truncate, or for a fork's new sequence). */
void kvr_sched_seq_reset(struct kvr_sched *s, uint32_t seq);

/* One layer of a decode step (kvr_decode_layer's work after its argument
 * checks). status[i] gets 0 or a negative errno per sequence. q, k, v and out
 * are device memory; engine_stream is the engine's stream wrapped
 * (kvr_dev_stream_wrap), NULL when it has none: the layer's work starts after
 * what the engine queued there and the engine's later work waits for `out`. */
int kvr_sched_decode_layer(struct kvr_sched *s, uint32_t layer, uint32_t batch,
			   const uint32_t *seqs, const uint64_t *positions, const void *q,
			   const void *k, const void *v, void *out, int32_t *status,
			   struct kvr_stream *engine_stream);
/*
 * A step a CUDA graph holds (capture.c; docs/architecture.md, "Capturing a
 * step in a CUDA graph"). Engine's thread.
 *
 * kvr_sched_capturable: 0 where this scheduler's steps can be captured,
 * else -ENOTSUP with *why.
 * kvr_sched_capture_reserve: size every layer's step buffers for steps of
 * up to `batch` sequences of up to max_tokens tokens each (a capture may
 * not allocate); what was captured before is stale. Outside a step.
 * kvr_sched_capture_layer: record layer `layer`'s device work for a step of
 * `batch` sequences on engine_stream, which is being captured; stores
 * nothing (the replays store their tokens). `first`: the step's first
 * captured layer, which makes every earlier capture stale. q, k, v and out are where every
 * replay reads and writes them.
 * kvr_sched_replay_step: the host part of every layer of the open step,
 * whose graph the engine launches next on launch_stream (step_end waits
 * for it there); status[i] is sequence i's step. Refused as a whole, the
 * step unchanged: -EINVAL (no whole capture, or more sequences than it
 * holds), -ESTALE (the buffers moved since), -ERANGE (a sequence past the
 * reservation).
 */
int kvr_sched_capturable(const struct kvr_sched *s, const char **why);
int kvr_sched_capture_reserve(struct kvr_sched *s, uint32_t batch, uint64_t max_tokens);
int kvr_sched_capture_layer(struct kvr_sched *s, uint32_t layer, uint32_t batch, int first, const void *q,
			    const void *k, const void *v, void *out, struct kvr_stream *engine_stream);
int kvr_sched_replay_step(struct kvr_sched *s, uint32_t batch, const uint32_t *seqs, const uint64_t *positions,
			  int32_t *status, struct kvr_stream *launch_stream);
/* 1 when controller jobs run on the engine's thread (config controller). */
int kvr_sched_jobs_inline(const struct kvr_sched *s);
/* Causal attention of n_tokens queries at positions first_position.. over
 * the layer's tokens 0..position each, reading pool pages and the tail tile;
 * the tokens must be ingested already. Engine's thread, synchronous. */
int kvr_sched_prefill_attention(struct kvr_sched *s, uint32_t seq, uint32_t layer,
				uint64_t first_position, uint32_t n_tokens, const void *q, void *out);

/* End of a step: wait for the step's attention (asynchronous compute), then
 * take back every layer's token of each sequence whose step failed. */
int kvr_sched_step_end(struct kvr_sched *s);
/* Fail the open step of every sequence of the batch (a layer call that failed
 * as a whole, a layer never decoded): their later layers report `err`, and
 * step_end takes back what any layer appended. `why` is the reason, for the
 * sequences that had not failed yet. Engine's thread. */
void kvr_sched_step_abandon(struct kvr_sched *s, uint32_t batch, const uint32_t *seqs,
			    const uint64_t *positions, uint32_t layer, int err, const char *why);
/* The open step's failure of `seq`: 0, or its error with *layer the layer it
 * failed at and *message the reason ("sequence S layer L: ..."). */
int kvr_sched_step_failure(const struct kvr_sched *s, uint32_t seq, uint32_t *layer,
			   const char **message);

/* Counters: of the context (seq == UINT32_MAX) or of one sequence. */
void kvr_sched_counters(const struct kvr_sched *s, uint32_t seq, uint64_t out[KVR_C_COUNT]);
/* Quantised streamed pages: the unit cache's rounds so far (tests): allocation
 * rounds and free rounds (units.c). */
void kvr_units_rounds(const struct kvr_sched *s, uint64_t *alloc_rounds, uint64_t *free_rounds);
/* Quantised pages' shared device page cache: units it holds, how many are
 * free, and one sequence's reservation (all 0 without one). */
void kvr_sched_units(const struct kvr_sched *s, uint64_t *held, uint64_t *free_units,
		     uint64_t *per_seq);
/* Corrections per KV head, summed over layers, of the context or one sequence. */
void kvr_sched_head_corrections(const struct kvr_sched *s, uint32_t seq, uint64_t *out,
				uint32_t n_kv);
/* First failure inside the controller or the streams since the last call
 * (0 if none); the message goes to *message (static to the scheduler). */
int kvr_sched_async_error(struct kvr_sched *s, const char **message);

/* Trace: the scheduler records spans into `trace` when it is set. */
void kvr_sched_set_trace(struct kvr_sched *s, struct kvr_trace *trace);

#endif /* KVR_SCHEDULER_H */
