/* SPDX-License-Identifier: MIT */
/*
 * kvrecall.h — the public C API of kvrecall, a long-context KV-cache runtime.
 *
 * kvrecall keeps the full KV cache of LLM decoding in a page pool in pinned,
 * NUMA-placed host memory and keeps on the device only a page cache of the pages
 * each decode step attends to (FreeKV's speculative retrieval). This header is
 * the only one an engine includes; it is plain C11, has no CUDA types, and every
 * symbol it declares carries KVR_API.
 *
 * Conventions (docs/api.md has the long form):
 *  - Fallible calls return 0 on success or a negative errno (-EINVAL, -ENOMEM,
 *    -ENODEV, -EOVERFLOW, ...). kvr_strerror() names a code; kvr_last_error()
 *    gives the message of the most recent failure, naming the field or id at
 *    fault. Out-parameters are written only on success.
 *  - The library never writes to stdout/stderr and never aborts on bad input:
 *    messages go to the log callback of the config, if one is set.
 *  - Configs start with their own size (`size`) and are filled with documented
 *    defaults by kvr_config_init(); later versions only append fields.
 *  - Handles are opaque; *_destroy(NULL) is a no-op.
 */
#ifndef KVRECALL_H
#define KVRECALL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(KVR_BUILDING_LIBRARY) && defined(__GNUC__)
#define KVR_API __attribute__((visibility("default")))
#else
#define KVR_API
#endif

/* ---------------------------------------------------------------------------
 * Version
 * ------------------------------------------------------------------------- */

#define KVR_VERSION_MAJOR 0
#define KVR_VERSION_MINOR 9
#define KVR_VERSION_PATCH 0
/* One integer, comparable: major * 10000 + minor * 100 + patch. */
#define KVR_VERSION_NUMBER \
	(KVR_VERSION_MAJOR * 10000 + KVR_VERSION_MINOR * 100 + KVR_VERSION_PATCH)

/* The version of the library actually loaded (may differ from the header's). */
KVR_API uint32_t kvr_version_number(void);
/* "MAJOR.MINOR.PATCH"; static storage. */
KVR_API const char *kvr_version_string(void);

/* ---------------------------------------------------------------------------
 * Errors and logging
 * ------------------------------------------------------------------------- */

/*
 * A short description of a negative errno returned by kvrecall (e.g. -EINVAL ->
 * "invalid argument"). Accepts positive values too. Never NULL; static storage.
 * Thread-safe.
 */
KVR_API const char *kvr_strerror(int err);

enum kvr_log_level {
	KVR_LOG_ERROR = 0, /* a call failed; the message says why */
	KVR_LOG_WARN = 1,  /* degraded but working (e.g. memory could not be locked) */
	KVR_LOG_INFO = 2,  /* one-off facts: chosen backend, NUMA node, sizes */
	KVR_LOG_DEBUG = 3, /* per-call detail; noisy */
};

/*
 * Log callback. Called from whichever kvrecall thread has something to say (the
 * caller's thread, the controller thread or a backend worker), so it must be
 * thread-safe and should be quick. `message` has no trailing newline and is valid
 * only during the call.
 */
typedef void (*kvr_log_fn)(void *user, enum kvr_log_level level, const char *message);

/* ---------------------------------------------------------------------------
 * Configuration
 * ------------------------------------------------------------------------- */

/* Element type of the q/k/v tensors handed in and of unquantised KV pages. */
enum kvr_dtype {
	KVR_DTYPE_F16 = 0,
	KVR_DTYPE_BF16 = 1,
	KVR_DTYPE_F32 = 2,
};

/* How each decode step chooses the pages it attends to (docs/design.md,
 * "The decode step"). */
enum kvr_mode {
	KVR_MODE_AUTO = 0,        /* the backend's default, chosen by benchmark */
	KVR_MODE_DENSE = 1,       /* attend to every token; the reference */
	KVR_MODE_BLOCKING = 2,    /* select with q_i and recall on the critical path */
	KVR_MODE_SPECULATIVE = 3, /* attend with the pages selected by q_{i-1}; no correction */
	KVR_MODE_FREEKV = 4,      /* speculative plus per-head correction below tau */
};

/* How the pages a step attends to reach attention (docs/design.md, "Recall"). */
enum kvr_recall {
	KVR_RECALL_AUTO = 0,      /* the backend's default, chosen by benchmark: zero-copy on cpu;
	                             on cuda streamed for plain pages of an HND pool in a
	                             sparse mode with 1 <= k <= 1024 selected pages per KV
	                             head, else zero-copy; streamed with a spill tier */
	KVR_RECALL_ZERO_COPY = 1, /* attention reads the selected pages where they live in the
	                             host pool (natural on the cpu backend) */
	KVR_RECALL_STREAMED = 2,  /* a device page cache of k slots per KV head, filled by
	                             double-buffered streamed recall of the misses */
};

/* Where the controller's jobs (the next step's selection and, streamed, its
 * recall) run. */
enum kvr_controller {
	KVR_CONTROLLER_AUTO = 0,   /* inline on the cpu backend when its threads take
	                              every core (the caller's and `threads` workers),
	                              thread otherwise (docs/benchmarks.md) */
	KVR_CONTROLLER_THREAD = 1, /* the context's controller thread, beside the engine */
	KVR_CONTROLLER_INLINE = 2, /* on the engine's thread, right after the layer's
	                              attention: no second thread (for engines that want
	                              none, or cores the engine's attention already fills);
	                              outputs identical to thread */
};

/* Layout of the host pool's pages. */
enum kvr_pool_layout_kind {
	KVR_POOL_HND = 0, /* [n_kv][2][p][d]: one KV head's page is one contiguous run */
	KVR_POOL_NHD = 1, /* [2][p][n_kv][d]: 2·p row copies per recalled page (ablation) */
};

/* How KV pages are stored in the pool and the device page cache. The tail
 * page being filled, and prefill's own tokens, stay in the dtype. */
enum kvr_kv_format_kind {
	KVR_KV_FORMAT_PLAIN = 0, /* the dtype (f16 by default), unquantised */
	KVR_KV_FORMAT_K8V4 = 1,  /* keys 8-bit, values 4-bit, f16 scale and zero point per
	                            token and KV head (LeanKV): 0.39x an f16 page at p = 32, d = 128 */
	KVR_KV_FORMAT_K4V2 = 2,  /* keys 4-bit, values 2-bit: 0.20x an f16 page (p = 32, d = 128) */
	KVR_KV_FORMAT_MIXED = 3, /* K8V4, and pages that received little attention while in
	                            the window as K4V2 (opt-in; docs/architecture.md) */
};

/* Where attention runs. The backend also decides what the engine hands to
 * kvr_decode_layer: host memory and no stream on cpu, device memory and a
 * cudaStream_t on cuda. So AUTO never switches to cuda when a GPU appears,
 * which would change what the engine's pointers mean: an engine on a GPU
 * chooses KVR_BACKEND_CUDA explicitly. */
enum kvr_backend {
	KVR_BACKEND_AUTO = 0, /* the cpu backend, with or without a GPU: the embedded default */
	KVR_BACKEND_CPU = 1,  /* vectorised C on the host; always available */
	KVR_BACKEND_CUDA = 2, /* an NVIDIA GPU; -ENODEV when none is usable */
};

#define KVR_MAX_LAYERS 256u       /* bound on n_layers (size of the dense_layers set) */
#define KVR_MAX_KV_HEADS 256u     /* bound on n_kv_heads */
#define KVR_MAX_GROUP 64u         /* bound on n_qo_heads / n_kv_heads */
#define KVR_THREADS_AUTO UINT32_MAX /* threads: one worker per core beyond the caller's */
/* sink_tokens, window_tokens: each min(512, budget_tokens / 4) rounded down
 * to whole pages, resolved at context creation (kvr_context_get_config
 * reports the value) and by kvr_config_validate and kvr_device_bytes_needed
 * alike; it leaves at least half the budget to selected pages. */
#define KVR_TOKENS_AUTO UINT32_MAX
#define KVR_NUMA_NODE_AUTO (-1)   /* numa_node: nearest the GPU, else the caller's node */

/*
 * An engine-supplied device allocator (optional): every device buffer of a
 * context (tail tiles, page-cache slots, staging) comes from it. alloc returns
 * 0 and a pointer aligned to at least 64 bytes, or a negative errno; on the
 * cpu backend the memory must be ordinary host memory. Called from the
 * engine's thread (sequence creation) and at context creation; free may also
 * run at context destruction.
 */
typedef int (*kvr_device_alloc_fn)(void *user, size_t bytes, void **ptr);
typedef void (*kvr_device_free_fn)(void *user, void *ptr);

/* A parallel-for: run task(arg, i) for every i in [0, n), in any order and on
 * any threads, and return only when all have run. kvrecall calls a
 * configured one (kvr_config.parallel_for) from the engine's thread and from
 * its controller thread, possibly at the same time: it must allow that (run
 * a second caller's tasks on that caller, as kvr_thread_pool_parallel_for
 * does, or on other workers). */
typedef void (*kvr_task_fn)(void *arg, uint32_t index);
typedef void (*kvr_parallel_for_fn)(void *user, kvr_task_fn task, void *arg, uint32_t n);

/*
 * Context configuration. Always start from kvr_config_init(), then change the
 * fields you need. Every field has a fixed width; units are in the comments.
 * `size` lets a library built from a newer header accept a config from an older
 * one (missing trailing fields take their defaults).
 */
struct kvr_config {
	uint32_t size; /* bytes: sizeof(struct kvr_config) as the caller compiled it */

	/* Model shape. */
	uint32_t n_layers;    /* transformer layers, 1..KVR_MAX_LAYERS. No default (0). */
	uint32_t n_qo_heads;  /* query heads per layer; a multiple of n_kv_heads. No default. */
	uint32_t n_kv_heads;  /* KV heads per layer, 1..KVR_MAX_KV_HEADS. No default. */
	uint32_t head_dim;    /* d, elements: a multiple of 32 in 32..256. Default 128. */
	uint32_t dtype;       /* enum kvr_dtype of q/k/v and of KV pages. Default F16. */

	/* Paging and selection (docs/design.md, "Glossary"). S + W + k·p = B, where k
	 * is the pages the sparse modes select per KV head and step. */
	uint32_t page_tokens;   /* p: tokens per page, a power of two in 8..256. Default 32. */
	uint32_t budget_tokens; /* B: tokens attended per KV head per step, a multiple of p,
	                           >= S + W. Default 2048. */
	uint32_t sink_tokens;   /* S: first tokens always attended, a multiple of p, or
	                           KVR_TOKENS_AUTO. Default AUTO (512 at B = 2048). */
	uint32_t window_tokens; /* W: newest tokens always attended, a multiple of p, or
	                           KVR_TOKENS_AUTO. Default AUTO (512 at B = 2048). Set
	                           explicitly so that S + W = B, a sparse mode selects no
	                           pages (k = 0): allowed, as a sink-plus-window ablation,
	                           and logged as a warning at context creation. */
	float tau;              /* correction threshold on the group-mean cosine, [-1, 1]. Default 0.9. */
	uint32_t mode;          /* enum kvr_mode. Default AUTO. */
	uint32_t backend;       /* enum kvr_backend. Default AUTO. */
	uint32_t recall_buffers; /* staging buffers of streamed recall: 2 overlaps copies with
	                            the HND->NHD conversion; 1 is kept for ablation. Default 2. */
	/* Layers never sparsified (their KV stays on the device): bit l of word l/64.
	 * Default: layer 0 only. Bits at or above n_layers must be clear. */
	uint64_t dense_layers[KVR_MAX_LAYERS / 64];

	/* Capacity. */
	uint32_t max_sequences; /* sequences alive at once, >= 1. Default 64. */
	uint32_t max_batch;     /* sequences in one decode step, 1..max_sequences. Default 16. */
	uint64_t pool_bytes;    /* hard capacity of the host page pool, bytes; 0 = half of
	                           physical memory. Default 0. */
	uint64_t device_bytes;  /* budget for the device page cache and its metadata, bytes;
	                           0 = what max_sequences sequences need (kvr_device_bytes_needed).
	                           Default 0. */

	/* Placement and threads. */
	int32_t numa_node;  /* host pool's NUMA node, or KVR_NUMA_NODE_AUTO. Default AUTO. */
	uint32_t threads;   /* cpu backend workers besides the caller's thread; 0 = the
	                       caller's thread only; KVR_THREADS_AUTO = one per core - 1. */
	uint32_t recall_chunk_pages; /* pages per staging buffer in streamed recall, >= 1. Default 8. */

	/* Logging. */
	uint32_t log_level; /* enum kvr_log_level: messages above it are dropped. Default WARN. */
	kvr_log_fn log_fn;  /* NULL = discard messages. Default NULL. */
	void *log_user;     /* passed back to log_fn untouched. */

	/* Added in 0.2 (a 0.1 config, without them, takes their defaults). */
	uint32_t recall;      /* enum kvr_recall. Default AUTO. */
	uint32_t pool_layout; /* enum kvr_pool_layout_kind. Default HND. */
	kvr_device_alloc_fn device_alloc; /* NULL = the backend's own. Set with device_free. */
	kvr_device_free_fn device_free;
	void *device_alloc_user;          /* passed back to both untouched */

	/* Added in 0.3 (a 0.2 config, without it, takes its default). */
	uint32_t controller; /* enum kvr_controller. Default AUTO. */

	/* Added in 0.4 (an older config, without it, takes its default). */
	uint32_t kv_format; /* enum kvr_kv_format_kind: quantised pages need pool_layout HND.
	                       Default PLAIN. */

	/* Added in 0.5 (an older config, without them, takes their defaults):
	 * the spill tier, pages beyond host RAM in a file on local storage. */
	uint32_t spill_queue_depth; /* spill-file I/Os in flight, 0..4096; 0 = 32. */
	uint32_t spill_reserved;    /* must be 0 */
	uint64_t pool_ram_bytes;    /* RAM for pool pages: 0 = all of pool_bytes (no spill
	                               tier). Below pool_bytes, the rest of the pool lives in
	                               an unlinked file in spill_dir; needs pool_layout HND and
	                               streamed recall (auto resolves to it). Default 0. */
	char spill_dir[256];        /* directory of the spill file, NUL-terminated; "" =
	                               $TMPDIR, else /var/tmp. */

	/* Added in 0.6 (an older config, without them, takes their defaults):
	 * the engine's own workers for the cpu backend's kernels, so that an
	 * engine and kvrecall share one pool of threads instead of each
	 * starting cores − 1 (kvr_thread_pool below is one such pool). Set, the
	 * cpu backend starts no threads and runs every parallel loop through
	 * it; `threads` then says how many threads it runs tasks on besides the
	 * caller's (it sizes the work split). Ignored by the cuda backend. */
	kvr_parallel_for_fn parallel_for; /* NULL = the backend's own workers. Default NULL. */
	void *parallel_user;              /* passed back to parallel_for untouched */

	/* Added in 0.7 (an older config, without them, takes their defaults):
	 * the estimate of the pages not retrieved. With estimate = 1 every
	 * full page also keeps its mean key and mean value per KV head (beside
	 * its key bounds: twice the summary memory, 2/p of the KV instead of
	 * 1/p), and the sparse modes (blocking, speculative, freekv) add to
	 * attention, for each candidate page they did not select, that page's
	 * p tokens estimated as its mean key and value: p·exp(scale·q·k̄) in
	 * the softmax's denominator and that times v̄ in its numerator
	 * (docs/architecture.md, "Estimating the pages not retrieved"). Not
	 * with mixed pages. Default 0 (off). */
	uint32_t estimate;
	uint32_t estimate_reserved; /* must be 0 */
};

/*
 * Fill `cfg` with the defaults documented above and set cfg->size. The shape
 * fields without a default (n_layers, n_qo_heads, n_kv_heads) are left 0 and must
 * be set before use. Returns 0, or -EINVAL when cfg is NULL.
 */
KVR_API int kvr_config_init(struct kvr_config *cfg);

/*
 * Check every field of `cfg` without creating anything. On failure returns a
 * negative errno (-EINVAL for a field outside its rule, -EOVERFLOW for sizes that
 * overflow 64 bits, -ENOTSUP for a shape the kernels do not support) and, when
 * `message` is not NULL, writes a NUL-terminated message naming the first field at
 * fault and its rule, truncated to message_bytes. Thread-safe; does not block.
 */
KVR_API int kvr_config_validate(const struct kvr_config *cfg, char *message, size_t message_bytes);

/* Name of a mode ("dense", "blocking", "speculative", "freekv", "auto"); "?" if unknown. */
KVR_API const char *kvr_mode_name(uint32_t mode);
/* Parse a mode name into *mode. Returns 0 or -EINVAL. */
KVR_API int kvr_mode_parse(const char *name, uint32_t *mode);
/* Name of a dtype ("f16", "bf16", "f32"); "?" if unknown. */
KVR_API const char *kvr_dtype_name(uint32_t dtype);
/* Name of a backend ("auto", "cpu", "cuda"); "?" if unknown. */
KVR_API const char *kvr_backend_name(uint32_t backend);
/* Name of a recall kind ("auto", "zero-copy", "streamed"); "?" if unknown. */
KVR_API const char *kvr_recall_name(uint32_t recall);
/* Name of a controller placement ("auto", "thread", "inline"); "?" if unknown. */
KVR_API const char *kvr_controller_name(uint32_t controller);
/* Name of a KV format ("plain", "k8v4", "k4v2", "mixed"); "?" if unknown. */
KVR_API const char *kvr_kv_format_name(uint32_t kv_format);
/* Parse a KV format name into *kv_format: the names above, and "f16", "bf16"
 * or "f32" for plain (the dtype itself is cfg->dtype). Returns 0 or -EINVAL. */
KVR_API int kvr_kv_format_parse(const char *name, uint32_t *kv_format);

/*
 * Device bytes a context created from `cfg` needs before any sequence
 * (staging buffers: *fixed_bytes) and per sequence admitted (its page cache:
 * k slots per KV head in every sparse layer, plus the tail tiles:
 * *per_sequence_bytes). A sequence is admitted while fixed + n x per-sequence
 * fits device_bytes. Either pointer may be NULL. Returns 0 or the errors of
 * kvr_config_validate. Thread-safe; does not block.
 */
KVR_API int kvr_device_bytes_needed(const struct kvr_config *cfg, uint64_t *fixed_bytes,
				    uint64_t *per_sequence_bytes);

/* ---------------------------------------------------------------------------
 * Contexts
 * ------------------------------------------------------------------------- */

struct kvr_context;

/*
 * Validate `cfg`, resolve its automatic fields (backend, mode, recall,
 * controller, sink and window, threads, pool and device sizes, NUMA node) and
 * create a context. On success *out is set. On failure nothing is left
 * allocated, *out is untouched, the message is sent to cfg->log_fn and is
 * readable from the calling thread with kvr_last_error(NULL). A sparse mode
 * whose explicit sink and window fill the budget (k = 0) is created, with a
 * warning to cfg->log_fn that it selects no pages.
 * Errors: -EINVAL / -EOVERFLOW / -ENOTSUP (config, see kvr_config_validate),
 * -ENODEV (backend CUDA asked for but no usable GPU), -ENOMEM.
 * Blocks while memory is set up; thread-safe (contexts are independent).
 */
KVR_API int kvr_context_create(const struct kvr_config *cfg, struct kvr_context **out);

/* Destroy a context and everything it owns. NULL is a no-op. Not concurrent with
 * any other call on the same context. */
KVR_API void kvr_context_destroy(struct kvr_context *ctx);

/*
 * Copy the context's resolved configuration (automatic fields replaced by what was
 * chosen) into *cfg. cfg->size must be set by the caller (kvr_config_init does);
 * at most that many bytes are written. Returns 0 or -EINVAL (NULL, or a size
 * below the first fields), with a message.
 */
KVR_API int kvr_context_get_config(const struct kvr_context *ctx, struct kvr_config *cfg);

/*
 * The message of the most recent failed call on `ctx`, or "" if none: one
 * sentence, "<call>: <what>: <why>" (a config at fault: "<field>: <rule>").
 * With ctx == NULL: the most recent failure on the calling thread of a call
 * that had no context (kvr_context_create, kvr_config_validate,
 * kvr_config_init, kvr_device_bytes_needed, kvr_mode_parse,
 * kvr_kv_format_parse, kvr_system_query, kvr_spill_dir_query,
 * kvr_thread_pool_create, or any call given ctx == NULL). Safe from any
 * thread while others use the context: the result is a copy in the calling
 * thread's own buffer, valid until that thread's next kvr_last_error call.
 */
KVR_API const char *kvr_last_error(const struct kvr_context *ctx);

/* ---------------------------------------------------------------------------
 * Sequences and prefill
 *
 * A sequence is one request's KV cache: per layer, its tokens' keys and values
 * in the host page pool plus the partial tail page on the device side. Ids are
 * small integers below max_sequences. Calls on one sequence must not run
 * concurrently; different sequences may be used from different threads.
 * -------------------------------------------------------------------------
 */

/*
 * Create an empty sequence and write its id to *seq. Its device page cache is
 * admitted against device_bytes (kvr_device_bytes_needed). Errors: -EINVAL
 * (NULL argument), -ENOSPC (max_sequences sequences are alive, or the device
 * budget cannot hold one more sequence), -ENOMEM.
 */
KVR_API int kvr_seq_create(struct kvr_context *ctx, uint32_t *seq);

/* Free a sequence and every page only it references. -EINVAL for an unknown id,
 * -EBUSY while the open decode step names it. */
KVR_API int kvr_seq_free(struct kvr_context *ctx, uint32_t seq);

/*
 * Fork `src` into a new sequence *dst holding the same tokens: full pages are
 * shared (copied on the first write), the partial tail is copied. Errors:
 * -EINVAL, -ENOSPC, -ENOMEM, -EBUSY (src is in the open decode step); on
 * failure nothing is created and src is intact.
 */
KVR_API int kvr_seq_fork(struct kvr_context *ctx, uint32_t src, uint32_t *dst);

/*
 * Keep the first n_tokens tokens of every layer of `seq`, dropping the rest
 * (e.g. to roll back a speculative draft). Errors: -EINVAL (unknown id, or
 * n_tokens beyond a layer's length), -EBUSY (the open decode step names it).
 */
KVR_API int kvr_seq_truncate(struct kvr_context *ctx, uint32_t seq, uint64_t n_tokens);

/* Tokens stored for (seq, layer). -EINVAL for unknown ids. */
KVR_API int kvr_seq_length(const struct kvr_context *ctx, uint32_t seq, uint32_t layer,
			   uint64_t *n_tokens);

/*
 * Prefill ingestion: append n_tokens tokens of one layer at positions
 * first_position, first_position+1, ... (which must continue the layer's
 * tokens: first_position == kvr_seq_length). k and v are host arrays of
 * n_tokens rows of n_kv_heads·head_dim elements of the config's dtype (the
 * layout the QKV projection produces, keys already rotated). Any n_tokens
 * works, in chunks of any size: full pages go to the host pool as they
 * complete, the partial tail stays on the device side. A pool page is
 * reserved when a tail page starts, all or nothing: -ENOMEM (pool capacity)
 * leaves the sequence exactly as it was. Blocks until the data is stored.
 * Errors: -EINVAL (unknown ids, positions out of order, NULL data), -ENOMEM,
 * -EBUSY (the open decode step names the sequence).
 */
KVR_API int kvr_prefill(struct kvr_context *ctx, uint32_t seq, uint32_t layer,
			uint64_t first_position, uint32_t n_tokens, const void *k, const void *v);

/*
 * Prefill attention, for engines that want kvrecall to compute it: causal
 * attention of n_tokens queries at positions first_position,
 * first_position+1, ... of (seq, layer), query t attending to every token
 * 0..first_position+t, dense, read where the tokens live (offloaded pool pages
 * and the tail), so prompts larger than device memory work. Call it after
 * kvr_prefill has stored those positions (first_position + n_tokens must not
 * exceed kvr_seq_length). q and out are [n_tokens][n_qo][d] host arrays of the
 * config's dtype, queries rotated. The softmax scale is 1/sqrt(head_dim), as
 * in decode: a model with another scale multiplies q by scale·sqrt(head_dim).
 * Blocks until out is written.
 * Errors: -EINVAL (unknown ids, positions beyond the stored tokens, NULL
 * buffers), -EBUSY (a decode step is open), -ENOMEM.
 */
KVR_API int kvr_prefill_attention(struct kvr_context *ctx, uint32_t seq, uint32_t layer,
				  uint64_t first_position, uint32_t n_tokens, const void *q,
				  void *out);

/* ---------------------------------------------------------------------------
 * Decode
 *
 * One decode step for a batch: kvr_decode_begin names the sequences and the
 * position of each one's new token; then, layer by layer, kvr_decode_layer
 * takes that layer's q, k, v for the whole batch, stores k and v, and writes
 * the attention output; kvr_decode_end closes the step. Which tokens each query
 * attends to follows the context's mode (docs/design.md, "The decode step"):
 *   dense        every token;
 *   blocking     sink + the k pages selected with this step's query + window;
 *   speculative  the pages selected with the previous step's query (the first
 *                step after prefill selects with its own query);
 *   freekv       speculative, except KV heads whose group-mean cosine between
 *                this and the previous query falls below tau: they use pages
 *                selected with this step's query.
 * A sequence whose layer holds at most budget_tokens tokens, and every layer in
 * dense_layers, attends densely (identical results to `dense`).
 *
 * Layouts (host memory on the cpu backend, device memory on cuda): q and out
 * are [batch][n_qo][d], k and v are [batch][n_kv][d], rows of the config's
 * dtype, queries and keys already rotated. status[i] receives 0 or a negative
 * errno for sequence i: a sequence that fails (e.g. its pool page cannot be
 * reserved) gets zeros for its output and leaves the others' outputs and state
 * intact.
 *
 * Attention's softmax scale is 1/sqrt(head_dim), fixed, in decode and
 * prefill attention alike. A model whose attention uses another scale
 * folds it into q: multiply q by scale·sqrt(head_dim) before the call.
 * -------------------------------------------------------------------------
 */

/* Begin a step. positions[i] must equal sequence seqs[i]'s length in every layer
 * when that layer is decoded. Until kvr_decode_end, the step's sequences cannot
 * be freed, forked, truncated or prefilled (-EBUSY). Errors: -EINVAL (unknown or
 * repeated sequence, batch larger than max_batch), -EBUSY (a step is already
 * open). */
KVR_API int kvr_decode_begin(struct kvr_context *ctx, const uint32_t *seqs,
			     const uint64_t *positions, uint32_t batch);

/* Decode one layer of the open step (see above; the softmax scale is
 * 1/sqrt(head_dim)). `stream` is the engine's stream handle: NULL on the cpu
 * backend (work runs on the calling thread and `out` is complete when the
 * call returns); on cuda the engine's cudaStream_t
 * (NULL: the legacy default stream), q, k, v and out are device memory, the
 * layer starts after the work the engine queued on the stream, and the
 * engine's later work on it waits for `out` (the call may return first;
 * kvr_decode_end waits for the step). A stream being captured into a CUDA
 * graph records the layer instead of decoding it (kvr_decode_reserve below),
 * where the context's configuration can be captured, and is refused with
 * -ENOTSUP elsewhere.
 *
 * What blocks: the calling thread runs the layer's critical path (append,
 * correction check, attention). It waits for the context's controller thread
 * only (a) when a sequence's heads are corrected (freekv), in blocking mode,
 * and at a sequence's first sparse step: attention needs pages selected with
 * this step's query (counted in kvr_stats.correction_waits), and (b) in the
 * rare case the controller has not finished the previous step's selection for
 * this (sequence, layer) (controller_waits). Sequences without corrected heads
 * are attended before those with, so one sequence's correction does not hold
 * back the others. After attention the layer's speculative selection for the
 * next step (and, with streamed recall, the recall of its missing pages) is
 * queued to the controller and overlaps the engine's next layers.
 * On cuda with an HND pool (plain pages, or K8V4/K4V2 with zero-copy recall;
 * streamed recall without a spill tier), 1..1024 pages to select per KV head
 * and no estimate, the layer does not wait at all:
 * append, correction check, the correction's selection and recall, and
 * attention are all queued on the device, and (a) becomes a wait of the
 * device's, not the thread's (kvr_stats.host_waits counts what remains;
 * docs/architecture.md, "The device path").
 *
 * Returns 0 when the call itself was valid (per-sequence failures are in
 * status; a sequence that failed in one layer fails in the step's later layers
 * too, and kvr_decode_end takes back what its earlier layers stored), or
 * -EINVAL (no open step, layer out of range, NULL buffers, a stream on the cpu
 * backend, a layer already decoded in this step, a replayed step; on a
 * capturing stream also no reservation for the step's batch, or a step
 * whose earlier layers were not captured, or the reverse: refused alone, the
 * step unchanged), -ENOTSUP (a capturing stream where the configuration
 * cannot be captured: "Decode steps in a CUDA graph" below). A call that
 * fails as a whole after checking its arguments (-ENOMEM, a device error)
 * fails the step of every sequence in the batch. */
KVR_API int kvr_decode_layer(struct kvr_context *ctx, uint32_t layer, const void *q,
			     const void *k, const void *v, void *out, int32_t *status, void *stream);

/* Close the step. Every layer must have been decoded: if some were and one was
 * not, the step is taken back in every layer of every sequence (each holds what
 * it held before kvr_decode_begin) and -EINVAL names the layer. A step with no
 * layer decoded stored nothing, and ending it cancels it (0). -EINVAL when no
 * step is open. */
KVR_API int kvr_decode_end(struct kvr_context *ctx);

/*
 * Decode steps in a CUDA graph (added in 0.7). An engine that captures its
 * decode step into a graph captures kvrecall's part with it, and replays
 * the graph at later steps:
 *
 *   kvr_decode_reserve(ctx, batch, max_tokens);      once, before capturing
 *   kvr_decode_begin(ctx, seqs, positions, batch);
 *   cudaStreamBeginCapture(stream, ...);
 *   ... per layer: the engine's kernels, kvr_decode_layer(..., stream) ...
 *   cudaStreamEndCapture(stream, &graph); kvr_decode_end(ctx);
 *   then at each step:
 *   kvr_decode_begin(ctx, seqs, positions, n);       n <= the captured batch
 *   kvr_decode_replay(ctx, status, stream);         every layer's host part
 *   cudaGraphLaunch(graph_exec, stream);
 *   kvr_decode_end(ctx);                             waits for the graph
 *
 * The captured step is recorded, not decoded: its layer calls store nothing
 * (status 0) and kvr_decode_end ends it as if cancelled, so the engine
 * decodes that step's tokens by replaying too. A replay reads q, k, v and
 * writes out at the addresses the capture was given, one layer's at a time
 * as captured; entry i of the step is row i of them. The sequences and
 * positions may change from step to step; a sequence that fails gets zeros
 * and its status, as with kvr_decode_layer.
 *
 * What can be captured: on the cuda backend, with pool layout HND,
 * kv_format plain, K8V4 or K4V2 and no spill tier,
 *  - dense mode, with either recall;
 *  - the sparse modes (blocking, speculative, freekv) with zero-copy
 *    recall, or with streamed recall of plain pages (f16, bf16, f32),
 *    where window_tokens >= page_tokens and the budget leaves 1..1024
 *    pages to select per KV head. A captured sparse step selects the next
 *    step's pages inside the graph (and, streamed, prefetches them into
 *    the device page cache there), not on the controller thread.
 * Refused, each with -ENOTSUP and a message saying why, by
 * kvr_decode_reserve, by kvr_decode_layer on a capturing stream and by
 * kvr_decode_replay: the cpu backend, the NHD pool, mixed pages, a spill
 * tier, and in the sparse modes streamed recall of quantised pages (K8V4,
 * K4V2: planned on the host), the estimate, k = 0 or k > 1024, and a
 * window shorter than a page (docs/architecture.md, "Capturing a step in
 * a CUDA graph").
 */
/* Size the step's buffers for steps of up to `batch` sequences of up to
 * max_tokens tokens each, which a capture needs (it may not allocate);
 * earlier captures cannot be replayed afterwards. Errors: -EINVAL (batch 0
 * or above max_batch, max_tokens 0), -EBUSY (a step is open), -ENOTSUP (the
 * configuration cannot be captured), -ENOMEM. */
KVR_API int kvr_decode_reserve(struct kvr_context *ctx, uint32_t batch, uint64_t max_tokens);
/* Do the host part of every layer of the open step, whose graph the engine
 * launches next on `stream` (its cudaStream_t; kvr_decode_end waits for it
 * there). The tokens count as stored from here: a step ended without its
 * graph's launch holds undefined K/V at their positions. status[i]
 * receives sequence i's result for the whole step. Refused
 * as a whole, the step unchanged: -EINVAL (no step open, status NULL, a
 * layer already decoded, no whole step captured since the last reservation,
 * more sequences than the capture), -ESTALE (an uncaptured step outgrew the
 * reservation since the capture: its buffers moved), -ERANGE (a sequence
 * would pass max_tokens), -ENOTSUP (the configuration cannot be captured). */
KVR_API int kvr_decode_replay(struct kvr_context *ctx, int32_t *status, void *stream);

/*
 * Counters since the context's creation (kvr_get_stats) or the sequence's
 * (kvr_seq_get_stats). Times are nanoseconds of the monotonic clock.
 * "Critical path" is the engine's time inside kvr_decode_layer; the
 * controller's time runs beside it (overlapped), except where the engine
 * waits for it, which the *_waits counters count.
 */
struct kvr_stats {
	uint32_t size;              /* bytes: set by the caller */
	uint32_t reserved;
	uint64_t steps;             /* kvr_decode_end calls (context only) */
	uint64_t layer_decodes;     /* (sequence, layer) pairs decoded */
	uint64_t dense_decodes;     /* of which attended densely (short or dense layer/mode) */
	uint64_t selections;        /* (sequence, layer) page selections run */
	uint64_t corrected_heads;   /* freekv: KV heads corrected */
	uint64_t checked_heads;     /* freekv: KV heads checked for correction */
	uint64_t failed_decodes;    /* (sequence, layer) pairs that got a non-zero status */
	/* Added in 0.2. */
	uint64_t correction_waits;   /* (sequence, layer) steps whose attention waited for a
	                                selection (and, streamed, a recall) with this step's query:
	                                corrections, blocking mode, the first sparse step */
	uint64_t correction_wait_ns; /* time the engine spent in those waits */
	uint64_t controller_waits;   /* times the engine found a lane's previous job unfinished */
	uint64_t controller_wait_ns;
	uint64_t recall_waits;       /* streamed: speculative recalls not complete when attention
	                                needed them */
	uint64_t recall_wait_ns;
	uint64_t pages_recalled;     /* streamed: KV-head pages moved into slots (misses) */
	uint64_t pages_hit;          /* streamed: selected pages already resident (hits) */
	uint64_t bytes_recalled;     /* streamed: bytes copied host -> device for recall */
	uint64_t critical_ns;        /* engine time inside kvr_decode_layer */
	uint64_t controller_ns;      /* controller time on jobs (overlapped with the engine) */
	uint64_t controller_jobs;    /* jobs the controller ran */
	/* Added in 0.4. */
	uint64_t pages_judged;       /* kv_format mixed: pages whose window attention was judged */
	uint64_t pages_demoted;      /* of which demoted to K4V2 */
	/* Quantised pages' device page cache (gauges: what holds now). The
	 * context: units (one KV head's page each) the cache holds, and of those
	 * the ones slots hold. A sequence: the units reserved for it (every
	 * sparse layer × n_kv × k), and the ones its slots hold: none while it
	 * is attended densely (L <= B), all of them once sparse. 0 for plain
	 * pages. */
	uint64_t device_units;
	uint64_t device_units_used;
	/* Added in 0.7. Times the engine's thread waited for the device inside
	 * kvr_decode_layer (a stream or event synchronise, a blocking copy to the
	 * host, an urgent recall a correction needs), whether or not the backend
	 * had work left: the waits a GPU would make it sit through. The step's end
	 * (kvr_decode_end) is not counted. A sequence's stats count the waits made
	 * for it alone; a layer's wait for its whole batch counts in the
	 * context's. */
	uint64_t host_waits;
	uint64_t host_wait_ns;
	/* Added in 0.8. The controller's time (controller_ns, plus the wait for
	 * it to take a job) by part: from a job's post to the controller taking
	 * it (waking the thread, and the jobs queued before it); in its
	 * selections, preparing them (candidates, summaries, the score item), the
	 * score kernel, and top-k with group consistency (the select kernel, and
	 * on a GPU the wait for both kernels); streamed, planning and issuing the
	 * recall. The device plan's batched selections are not split (0). */
	uint64_t controller_handoff_ns;
	uint64_t controller_prepare_ns;
	uint64_t controller_score_ns;
	uint64_t controller_topk_ns;
	uint64_t controller_recall_ns;
};

/* Copy the context's counters into *stats. stats->size must be set; at most
 * that many bytes are written (older callers get the fields they know).
 * Returns 0 or -EINVAL. Thread-safe with a running step (values are
 * statistics, each read atomically). */
KVR_API int kvr_get_stats(const struct kvr_context *ctx, struct kvr_stats *stats);
/* The same counters for one sequence since its creation (steps is 0).
 * -EINVAL for an unknown sequence. */
KVR_API int kvr_seq_get_stats(const struct kvr_context *ctx, uint32_t seq, struct kvr_stats *stats);
/* Corrections per KV head, summed over layers: counts[m] for m < n (n at most
 * n_kv_heads), over every live sequence (seq == UINT32_MAX) or one. */
KVR_API int kvr_get_head_corrections(const struct kvr_context *ctx, uint32_t seq, uint64_t *counts,
				     uint32_t n);

/*
 * The first failure inside the context's controller thread or streams since
 * the previous call (0 if none), as a negative errno; *message (optional)
 * points at its description, valid until the next call. When the
 * controller's selection or recall for a (sequence, layer) fails, that
 * layer's next step of that sequence selects afresh with its own query and
 * recalls every page it needs (as a correction), so outputs stay correct.
 * Thread-safe.
 */
KVR_API int kvr_async_error(struct kvr_context *ctx, const char **message);

/* ---------------------------------------------------------------------------
 * Tracing: spans of the engine's thread, the controller thread and the
 * streams, exported as Chrome trace-event JSON (open it in Perfetto or
 * chrome://tracing). Call between steps (no step open).
 * ------------------------------------------------------------------------- */

/* Start recording up to max_spans spans (older ones are kept, later ones
 * dropped and counted). Replaces a trace in progress. -EBUSY during a step,
 * -EINVAL for 0 spans, -ENOMEM. */
KVR_API int kvr_trace_start(struct kvr_context *ctx, uint32_t max_spans);
/* Stop recording, wait for the work in flight, and write the trace to `path`.
 * -EINVAL (no trace started, path NULL), -EBUSY (step open), or the file's
 * -errno. On any failure the trace is kept and goes on recording, so the call
 * can be retried (with another path). */
KVR_API int kvr_trace_write(struct kvr_context *ctx, const char *path);

/* ---------------------------------------------------------------------------
 * System report (what `kvrecall info` prints)
 * ------------------------------------------------------------------------- */

struct kvr_system_info {
	uint32_t size; /* bytes: set by the caller to sizeof(struct kvr_system_info) */

	/* Build. */
	uint32_t version_number;  /* as kvr_version_number() */
	uint32_t cuda_compiled;   /* 1 when the CUDA backend was compiled in */
	uint32_t cuda_runtime_version; /* CUDART_VERSION compiled against (e.g. 13000), or 0 */
	uint32_t liburing_compiled; /* 1 when built with liburing */
	char gpu_archs[64];       /* SM architectures compiled, e.g. "80,90"; "" without CUDA */

	/* GPU. */
	uint32_t n_gpus;          /* usable CUDA devices; 0 when none */
	char gpu_name[128];       /* device 0's name, or "" */
	char gpu_pci_bus_id[32];  /* device 0's PCI bus id ("0000:17:00.0"), or "" */
	char gpu_reason[256];     /* why n_gpus is 0 (exact CUDA error or "not compiled"), or "" */

	/* CPU. */
	char cpu_model[128];      /* processor brand string */
	uint32_t cpu_avx2;        /* 1 when AVX2 and FMA are usable (CPU and OS) */
	uint32_t cpu_avx512;      /* 1 when AVX-512 F/BW/VL are usable */
	uint32_t cpu_f16c;        /* 1 when F16C is usable */
	uint32_t n_numa_nodes;    /* NUMA nodes with memory (hwloc) */
	uint32_t n_cores;         /* physical cores (hwloc) */
	uint32_t n_pus;           /* hardware threads (hwloc) */
	uint64_t memory_bytes;    /* physical memory, bytes */
	uint64_t l3_bytes;        /* largest last-level cache, bytes (hwloc), or 0 */

	/* I/O. */
	uint32_t io_uring_available; /* 1 when an io_uring instance could be created */
	char io_uring_reason[128];   /* why not, or "" */

	/* Since 0.7.0 (a 0.6 caller's smaller size is accepted; these are not
	 * written then). */
	char cpu_kernels[16];        /* the cpu kernels' path in use: "avx512vnni", "avx512", "avx2", "scalar" */
	char cpu_kernels_note[96];   /* why not the best the CPU has (KVR_CPU_ISA), or "" */
};

/*
 * Fill *info with facts about this build and machine. info->size must be set
 * (sizeof, or 0.6's size, which leaves the newer fields out).
 * Probes the GPU (which may take a second on a machine with a driver) and the
 * kernel's io_uring support. Returns 0, -EINVAL (info NULL or size too small), or
 * -EIO when hwloc cannot read the topology (the other fields are still filled).
 */
KVR_API int kvr_system_query(struct kvr_system_info *info);

/* What a directory offers the spill tier (pages beyond the pool's RAM on
 * local storage, through io_uring): `kvrecall info --spill-dir DIR`. */
struct kvr_spill_dir_info {
	uint32_t size;          /* bytes: set by the caller to sizeof(struct kvr_spill_dir_info) */
	uint32_t direct_io;     /* 1 when a file there takes O_DIRECT writes and reads */
	uint32_t dio_align;     /* their alignment (offsets, lengths, buffers) in bytes; 0 without */
	uint32_t io_uring_available; /* as kvr_system_info's */
	uint64_t free_bytes;    /* bytes free to an unprivileged writer */
	char dir[256];          /* the directory probed */
	char fs_type[32];       /* "ext4", "xfs", "tmpfs", "overlay", ... or "other" */
	char reason[200];       /* why direct_io is 0, or why the probe failed; "" otherwise */
};

/*
 * Probe `dir` (NULL or "": the spill tier's default, $TMPDIR, else /var/tmp)
 * by creating an unlinked file there and trying an O_DIRECT write and read.
 * Returns 0 (direct_io says whether O_DIRECT works; reason says why not),
 * -EINVAL (info NULL or size too small), or the negative errno of a
 * directory that cannot be used (-ENOENT, -EACCES, ...), with info->reason
 * and kvr_last_error(NULL) saying which.
 */
KVR_API int kvr_spill_dir_query(const char *dir, struct kvr_spill_dir_info *info);

/* ---------------------------------------------------------------------------
 * Thread pool: the cpu backend's fork-join workers, for an engine to share
 * (kvr_config.parallel_for = kvr_thread_pool_parallel_for, parallel_user =
 * the pool, threads = kvr_thread_pool_threads(pool)). Workers spin briefly
 * for the next job before they sleep, so back-to-back small jobs (a decode
 * step's) find them awake.
 * ------------------------------------------------------------------------ */

struct kvr_thread_pool;

/* Start `threads` workers besides the caller's thread (0: none, every task
 * runs on the caller; KVR_THREADS_AUTO: one per online core − 1). Returns 0,
 * -EINVAL (out NULL, threads over 1024), -ENOMEM or -EAGAIN (a thread could
 * not start), with kvr_last_error(NULL) saying which. */
KVR_API int kvr_thread_pool_create(uint32_t threads, struct kvr_thread_pool **out);
/* Stop and join the workers. No call may be running on the pool. NULL-safe. */
KVR_API void kvr_thread_pool_destroy(struct kvr_thread_pool *pool);
/* Its workers besides the caller's thread. */
KVR_API uint32_t kvr_thread_pool_threads(const struct kvr_thread_pool *pool);
/* A kvr_parallel_for_fn over `pool` (a struct kvr_thread_pool *): task(arg,
 * i) for i in [0, n) on the caller and the workers. Any thread may call it;
 * while another call is running, this one runs its tasks on its caller alone
 * (no nesting, no waiting). A NULL pool runs them on the caller. */
KVR_API void kvr_thread_pool_parallel_for(void *pool, kvr_task_fn task, void *arg, uint32_t n);

#ifdef __cplusplus
}
#endif

#endif /* KVRECALL_H */
