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
#include <stdatomic.h>

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
	/* Both written under seq_lock and read without it (plain seq_cst atomics:
	 * a reader asking about one id needs no lock against writers of others). */
	_Atomic int alive;
	_Atomic int in_step; /* named by the open decode step: calls that change its
	                        tokens or free it are refused (-EBUSY) */
	unsigned char *tails; /* per layer: the partial tail page's NHD K tile then V tile,
	                         host-addressable (kvr_tile_alloc) */
};

/* The open decode step (decode.c; the engine's thread). */
struct kvr_step_state {
	int open;
	uint32_t batch;
	uint32_t *seqs;        /* max_batch */
	uint64_t *positions;   /* max_batch */
	uint8_t *layer_done;   /* n_layers: decode_layer ran for it in this step */
	int captured;          /* its layers were captured into a graph: nothing stored */
	int replayed;          /* kvr_decode_replay did every layer's host part */
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

	/* Last error, behind a pointer so that calls taking a const context
	 * (getters) record their failures without casting const away: the
	 * message is not part of the context's logical state. */
	struct kvr_error_slot *error;
};

/* A context's last error. Written by whichever thread fails a call on the
 * context and read by kvr_last_error() from any thread: the mutex keeps a
 * message from being torn; readers get a copy. */
struct kvr_error_slot {
	pthread_mutex_t lock;
	char message[KVR_ERROR_MESSAGE_BYTES];
};

/* Record `err` with a formatted message against ctx (or the thread when ctx is
 * NULL), log it, and return err. */
int kvr_fail(const struct kvr_context *ctx, int err, const char *fmt, ...)
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
/* kvr_decode_layer and kvr_decode_replay with the engine's stream already
 * wrapped (NULL: none), which the tests call with a stream of their own on
 * backends without native streams (cudaemu-strict), to capture a step. */
int kvr_decode_layer_on(struct kvr_context *ctx, uint32_t layer, const void *q, const void *k, const void *v,
			void *out, int32_t *status, struct kvr_stream *engine_stream);
int kvr_decode_replay_on(struct kvr_context *ctx, int32_t *status, struct kvr_stream *launch_stream);

/* Create a context with test hooks and an explicit device kind (tests:
 * cudaemu, injected delays). Not exported from the shared library. */
int kvr_context_create_internal(const struct kvr_config *cfg, uint32_t dev_kind,
				const struct kvr_sched_hooks *hooks, struct kvr_context **out);

/* Free every sequence's device memory (context teardown). */
void kvr_sequences_destroy(struct kvr_context *ctx);

/* The most a newer library's kvr_config may have grown past ours: a larger
 * size is no config at all, and scanning it would read past the caller's. */
#define KVR_CONFIG_MAX_GROWTH 4096u

/* The recall kind a config resolves to (auto: config.c says which). */
uint32_t kvr_config_recall(const struct kvr_config *c);

/* Replace sink_tokens and window_tokens left at KVR_TOKENS_AUTO by what the
 * context uses (config.c). Every path that reads them after import calls it. */
void kvr_config_resolve_tokens(struct kvr_config *c);

/* Device bytes a context of config c needs: its fixed share (staging) and
 * each admitted sequence's (tail tiles, page cache), for recall kind
 * `recall`. Pure: kvr_config_validate and creation agree. */
void kvr_config_device_bytes(const struct kvr_config *c, uint32_t recall, uint64_t *fixed,
			     uint64_t *per_seq);

/* Bytes of one element of a kvr_dtype, or 0 for an unknown dtype. */
uint32_t kvr_dtype_bytes(uint32_t dtype);

/* Copy a caller's config of any known size over defaults (older callers pass a
 * smaller size). Returns 0 or -EINVAL with message. */
int kvr_config_import(const struct kvr_config *in, struct kvr_config *out, char *message,
		      size_t message_bytes);

#endif /* KVR_RUNTIME_INTERNAL_H */
