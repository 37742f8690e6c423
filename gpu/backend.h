/* SPDX-License-Identifier: MIT */
/*
 * backend.h — the device interface the runtime drives: memory, streams,
 * events, copies and the kernels of kernels.h. Three implementations sit
 * behind it: `cpu` (gpu/cpu/: device memory is host memory, kernels are
 * vectorised C), `cuda` (the cuda_ .cu files) and `cudaemu` (tests: the CUDA kernel
 * bodies executed on the CPU, also as the checking `cudaemu-strict` device).
 * Valid C11; no CUDA types cross it.
 *
 * Conventions: every call returns 0 or a negative errno with a message in
 * kvr_dev_last_error(); enqueueing calls (copies, kernels, event record and
 * wait) are stream-ordered and return once the work is queued — on the cpu
 * backend an inline stream runs it on the calling thread before returning.
 * Pointers passed to kernels and copies are device pointers (from
 * kvr_dev_alloc) except where a copy's kind says host; item arrays live in
 * device memory and must stay valid until the work completes.
 *
 * Threads: one device may be used from several threads; a stream from one
 * thread at a time. Events may be recorded on one thread and waited for on
 * another.
 */
#ifndef KVR_GPU_BACKEND_H
#define KVR_GPU_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

enum kvr_dev_kind {
	KVR_DEV_CPU = 1,
	KVR_DEV_CUDA = 2,
	KVR_DEV_CUDAEMU = 3,
	/* Tests only (gpu/cudaemu/backend.c): cudaemu whose device memory counts
	 * as not host-visible (kvr_dev_host_visible() is 0), so runtime code takes
	 * its GPU paths, and which checks, when work is enqueued, that every
	 * kernel's item arrays lie in device memory and every pointer in them in
	 * device memory or kvr_dev_host_register'ed host memory for the whole
	 * extent the kernel touches, and that copies go in the direction their
	 * kind says. A violation fails the call with -EFAULT and runs nothing
	 * (gpu/cudaemu/cudaemu.h counts them), where a GPU would fault. */
	KVR_DEV_CUDAEMU_STRICT = 4,
};

enum kvr_copy_kind {
	KVR_COPY_H2D = 0,
	KVR_COPY_D2H = 1,
	KVR_COPY_D2D = 2,
};

enum kvr_stream_flags {
	/* cpu: run each operation on the enqueueing thread (the default: the
	 * critical path stays on the caller's thread, no handoff). */
	KVR_STREAM_INLINE = 0,
	/* cpu: a worker thread drains the stream's FIFO, so enqueueing returns
	 * at once (copies that should overlap the caller's work). Ignored by cuda,
	 * whose streams are always asynchronous. */
	KVR_STREAM_WORKER = 1u << 0,
};

/* A parallel-for an engine may supply: run task(arg, i) for i in [0, n), may
 * return only when all are done. The same two typedefs as the public header's
 * (kvrecall.h, kvr_config.parallel_for; C11 allows the identical repeat):
 * gpu/ does not include the public header. */
typedef void (*kvr_task_fn)(void *arg, uint32_t index);
typedef void (*kvr_parallel_for_fn)(void *user, kvr_task_fn task, void *arg, uint32_t n);

struct kvr_dev_params {
	uint32_t kind;                    /* enum kvr_dev_kind */
	uint32_t threads;                 /* cpu: workers besides the caller (0 = none) */
	kvr_parallel_for_fn parallel_for; /* cpu: engine's parallel-for, or NULL */
	void *parallel_user;
	int32_t device;                   /* cuda: device ordinal */
	uint32_t reserved;
	/* An engine's allocator for kvr_dev_alloc/kvr_dev_free, or NULL. */
	int (*alloc_fn)(void *user, size_t bytes, void **ptr);
	void (*free_fn)(void *user, void *ptr);
	void *alloc_user;
};

struct kvr_dev;
struct kvr_stream;
struct kvr_event;

/* -ENODEV when the kind is not available (cuda without GPU, cudaemu or
 * cudaemu-strict in a build without it), with the reason in err. */
int kvr_dev_create(const struct kvr_dev_params *params, struct kvr_dev **out, char *err,
		   size_t err_bytes);
void kvr_dev_destroy(struct kvr_dev *dev);
const char *kvr_dev_name(const struct kvr_dev *dev);
uint32_t kvr_dev_kind_of(const struct kvr_dev *dev);
/* The message of the calling thread's latest failed device call. Per thread,
 * since the engine and the controller share one device: a failure is read by
 * the thread that saw it, never torn by another's. */
const char *kvr_dev_last_error(const struct kvr_dev *dev);
/* 1 when device memory is host-addressable (cpu, cudaemu); 0 for cuda and
 * cudaemu-strict. */
int kvr_dev_host_visible(const struct kvr_dev *dev);

/* ---- memory ---- */
int kvr_dev_alloc(struct kvr_dev *dev, size_t bytes, void **ptr);
void kvr_dev_free(struct kvr_dev *dev, void *ptr);
/* Pin host memory for asynchronous copies. cpu: a no-op. */
int kvr_dev_host_register(struct kvr_dev *dev, void *ptr, size_t bytes);
int kvr_dev_host_unregister(struct kvr_dev *dev, void *ptr);

/* ---- streams and events ---- */
int kvr_dev_stream_create(struct kvr_dev *dev, uint32_t flags, struct kvr_stream **out);
void kvr_dev_stream_destroy(struct kvr_dev *dev, struct kvr_stream *stream);
/* An engine's native stream (cuda: a cudaStream_t; NULL = the legacy default
 * stream) as a kvr_stream the runtime may record events on and make wait;
 * destroying it releases the wrapper only. On backends without native streams
 * (cpu, cudaemu) a NULL handle wraps to *out = NULL and anything else is
 * -EINVAL. */
int kvr_dev_stream_wrap(struct kvr_dev *dev, void *native, struct kvr_stream **out);
/* The native handle of a stream, as an engine would pass it to the public
 * API (cuda: its cudaStream_t); NULL on backends without native streams. */
void *kvr_dev_stream_native(struct kvr_dev *dev, struct kvr_stream *stream);
/* 1 while the stream is being captured into a CUDA graph, 0 otherwise, or a
 * negative errno. */
int kvr_dev_stream_capturing(struct kvr_dev *dev, struct kvr_stream *stream);
/* Capture into a graph, with CUDA graphs' rules (CUDA's own on cuda, in
 * thread-local mode; emulated on cpu and cudaemu: see cpu_backend.c): from begin to end, what is enqueued on the stream, and on
 * streams that wait on events recorded in the capture (whose work the
 * origin must wait on before the end), is recorded, not run; a synchronize,
 * a query, an allocation inside it is refused and invalidates it. The end
 * returns the graph; a launch enqueues it on a stream, as often as wanted,
 * each node reading its arguments' memory when it runs. All calls of one
 * capture on the thread that began it. */
struct kvr_graph;
int kvr_dev_stream_begin_capture(struct kvr_dev *dev, struct kvr_stream *stream);
int kvr_dev_stream_end_capture(struct kvr_dev *dev, struct kvr_stream *stream, struct kvr_graph **out);
int kvr_dev_graph_launch(struct kvr_dev *dev, struct kvr_graph *graph, struct kvr_stream *stream);
void kvr_dev_graph_destroy(struct kvr_dev *dev, struct kvr_graph *graph);
/* Block until everything enqueued on the stream has run. */
int kvr_dev_stream_synchronize(struct kvr_dev *dev, struct kvr_stream *stream);
int kvr_dev_event_create(struct kvr_dev *dev, struct kvr_event **out);
void kvr_dev_event_destroy(struct kvr_dev *dev, struct kvr_event *event);
/* The event completes when the stream reaches this point. */
int kvr_dev_event_record(struct kvr_dev *dev, struct kvr_event *event, struct kvr_stream *stream);
/* Work enqueued on `stream` after this waits for the event's latest record
 * (as of this call); an event never recorded is complete. */
int kvr_dev_stream_wait_event(struct kvr_dev *dev, struct kvr_stream *stream,
			      struct kvr_event *event);
/* 0 when complete, -EAGAIN when not yet. */
int kvr_dev_event_query(struct kvr_dev *dev, struct kvr_event *event);
/* Block (spin briefly, then sleep) until complete. */
int kvr_dev_event_synchronize(struct kvr_dev *dev, struct kvr_event *event);

/* ---- copies ---- */
int kvr_dev_memcpy_async(struct kvr_dev *dev, void *dst, const void *src, size_t bytes,
			 uint32_t kind, struct kvr_stream *stream);
/* Many copies in one call: descs (a host array, read before the call returns,
 * so it may be reused at once) give byte offsets from the two bases. cuda uses cudaMemcpyBatchAsync where the toolkit has it; cpu
 * splits the list across its workers. */
int kvr_dev_memcpy_batch_async(struct kvr_dev *dev, void *dst_base, const void *src_base,
			       const struct kvr_copy_desc *descs, size_t n, uint32_t kind,
			       struct kvr_stream *stream);

/* ---- kernels (kernels.h) ---- */
int kvr_dev_scatter(struct kvr_dev *dev, const struct kvr_shape *shape,
		    const struct kvr_scatter_item *items, uint32_t n, struct kvr_stream *stream);
int kvr_dev_offload(struct kvr_dev *dev, const struct kvr_shape *shape,
		    const struct kvr_page_item *items, uint32_t n, struct kvr_stream *stream);
int kvr_dev_summarize(struct kvr_dev *dev, const struct kvr_shape *shape,
		      const struct kvr_page_item *items, uint32_t n, struct kvr_stream *stream);
int kvr_dev_score(struct kvr_dev *dev, const struct kvr_shape *shape,
		  const struct kvr_score_item *items, uint32_t n, struct kvr_stream *stream);
int kvr_dev_select(struct kvr_dev *dev, const struct kvr_shape *shape,
		   const struct kvr_score_item *items, uint32_t n, struct kvr_stream *stream);
int kvr_dev_similarity(struct kvr_dev *dev, const struct kvr_shape *shape,
		       const struct kvr_similarity_item *items, uint32_t n,
		       struct kvr_stream *stream);
/* Allocate now the kernel scratch that attention over n_att items and
 * score over n_score items captured on `stream` use (cuda: split partials,
 * page-score cache), which a captured kernel cannot allocate; a shape may
 * be NULL (none of that kernel). 0 where there is none. Not inside a
 * capture. Graphs captured before on the stream may hold the old scratch:
 * capture them again. */
int kvr_dev_capture_reserve(struct kvr_dev *dev, struct kvr_stream *stream, const struct kvr_shape *att_shape,
			    uint32_t n_att, const struct kvr_shape *score_shape, uint32_t n_score);
int kvr_dev_attention(struct kvr_dev *dev, const struct kvr_shape *shape,
		      const struct kvr_attention_item *items, uint32_t n,
		      const struct kvr_kv_segment *segments, uint32_t n_segments,
		      struct kvr_stream *stream);
int kvr_dev_dense(struct kvr_dev *dev, const struct kvr_shape *shape,
		  const struct kvr_dense_item *items, uint32_t n, struct kvr_stream *stream);
/* The selected pages' attention segments (kernels.h, plan); the shape is
 * only checked (the items carry what the segments need). */
int kvr_dev_plan(struct kvr_dev *dev, const struct kvr_shape *shape,
		 const struct kvr_plan_item *items, uint32_t n, struct kvr_stream *stream);
/* Tokens' rows into their tail tiles, and the pages they complete offloaded
 * and summarized (kernels.h, append). */
int kvr_dev_append(struct kvr_dev *dev, const struct kvr_shape *shape,
		   const struct kvr_append_item *items, uint32_t n, struct kvr_stream *stream);
/* Rounds of circular free-page lists (kernels.h, freelist); no shape. */
int kvr_dev_freelist(struct kvr_dev *dev, const struct kvr_freelist_item *items, uint32_t n,
		     struct kvr_stream *stream);

/*
 * Run fn(arg) on a host thread when the stream reaches this point; later work
 * on the stream waits for it to return. fn must not call back into the
 * device. Used for trace markers and for the scheduler's test hooks (injected
 * delays). -ENOTSUP on a backend without host functions.
 */
int kvr_dev_host_fn(struct kvr_dev *dev, struct kvr_stream *stream, void (*fn)(void *arg),
		    void *arg);

/*
 * The cpu backend's item arrays are read when the work runs; the host-side
 * arrays handed to a CUDA kernel must already be in device memory. A caller
 * that fills item arrays on the host copies them with kvr_dev_memcpy_async
 * first (device.c's helpers do that for the runtime).
 */

#ifdef __cplusplus
}
#endif

#endif /* KVR_GPU_BACKEND_H */
