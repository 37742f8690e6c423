/* SPDX-License-Identifier: MIT */
/*
 * internal.h — what runtime/ files share and the rest of the library may use:
 * the context object, error recording and logging.
 *
 * Errors: every failing internal path calls kvr_fail(ctx, -E..., fmt, ...), which
 * records the message in the context (or, with ctx == NULL, in the calling
 * thread's slot), logs it at ERROR level and returns the code, so a caller can
 * write `return kvr_fail(...)`.
 */
#ifndef KVR_RUNTIME_INTERNAL_H
#define KVR_RUNTIME_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>

#include "kvrecall.h"

struct kvr_pool;
struct kvr_dev;
struct kvr_stream;

struct kvr_sched;
struct kvr_trace;
struct kvr_sched_hooks;

/* One sequence's device-side state (sequence.c); its per-layer speculative
 * state and page cache are the scheduler's lanes (scheduler/). */
struct kvr_sequence {
	int alive;
	unsigned char *tails; /* per layer: the partial tail page's NHD K tile then V tile,
	                         host-addressable (kvr_sched_tile_alloc) */
};

/* The open decode step (decode.c). */
struct kvr_step_state {
	int open;
	uint32_t batch;
	uint32_t *seqs;        /* max_batch */
	uint64_t *positions;   /* max_batch */
};

#define KVR_ERROR_MESSAGE_BYTES 512

struct kvr_context {
	struct kvr_config config; /* resolved: no automatic values left */
	char gpu_reason[256];     /* why the cuda backend was not chosen, for info/logs */
	struct kvr_pool *pool;    /* the host page pool (host/pool.h) */
	struct kvr_dev *dev;      /* the device (gpu/backend.h) */
	struct kvr_sched *sched;  /* decode-step scheduler and controller thread (scheduler/) */
	struct kvr_trace *trace;  /* recording trace, or NULL */
	uint64_t tile_bytes;      /* one NHD tile: page_tokens x n_kv_heads x head_dim elements */
	/* Device budget: fixed bytes (staging) + per admitted sequence; guarded by seq_lock. */
	uint64_t device_fixed_bytes, device_seq_bytes, device_used_bytes;

	/* Sequences. seq_lock guards the alive flags (create/free/fork may come
	 * from different threads); a sequence's own data is used by one thread at
	 * a time (kvrecall.h). */
	pthread_mutex_t seq_lock;
	struct kvr_sequence *seqs; /* max_sequences */
	struct kvr_step_state step;
	uint64_t steps;            /* kvr_decode_end calls; the engine's thread writes */
	/* cuda: the engine's stream as the device sees it, wrapped on first use
	 * and kept while the engine passes the same handle (engine's thread) */
	struct kvr_stream *engine_stream;
	void *engine_stream_native;

	/* Last error. Written by whichever thread fails a call on this context, read
	 * by kvr_last_error(); the mutex keeps a message from being torn. */
	pthread_mutex_t error_lock;
	char last_error[KVR_ERROR_MESSAGE_BYTES];
};

/* Record `err` with a formatted message against ctx (or the thread when ctx is
 * NULL), log it, and return err. */
int kvr_fail(struct kvr_context *ctx, int err, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* Same, for configs not yet owned by a context: the log goes to cfg's callback. */
int kvr_fail_config(const struct kvr_config *cfg, int err, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* Log through ctx's callback when level is enabled. */
void kvr_log(const struct kvr_context *ctx, enum kvr_log_level level, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* Log through a config's callback (before a context exists). */
void kvr_log_config(const struct kvr_config *cfg, enum kvr_log_level level, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* Free the step state (context teardown). */
void kvr_decode_teardown(struct kvr_context *ctx);

/* Create a context with test hooks and an explicit device kind (tests:
 * cudaemu, injected delays). Not exported from the shared library. */
int kvr_context_create_internal(const struct kvr_config *cfg, uint32_t dev_kind,
				const struct kvr_sched_hooks *hooks, struct kvr_context **out);

/* Free every sequence's device memory (context teardown). */
void kvr_sequences_destroy(struct kvr_context *ctx);

/* Bytes of one element of a kvr_dtype, or 0 for an unknown dtype. */
uint32_t kvr_dtype_bytes(uint32_t dtype);

/* Copy a caller's config of any known size over defaults (older callers pass a
 * smaller size). Returns 0 or -EINVAL with message. */
int kvr_config_import(const struct kvr_config *in, struct kvr_config *out, char *message,
		      size_t message_bytes);

#endif /* KVR_RUNTIME_INTERNAL_H */
