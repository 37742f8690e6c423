/* SPDX-License-Identifier: MIT */
/* The required ops of kvr_dev_ops, by group: X(name) for each, so a backend
 * sets a whole group in one line (and cannot forget one). The memory ops,
 * the stream, event and copy ops, and the kernel ops. */
#define KVR_DEV_MEMORY_OPS(X) X(alloc) X(free) X(host_register) X(host_unregister)
#define KVR_DEV_STREAM_OPS(X)                                                                     \
	X(stream_create) X(stream_destroy) X(stream_synchronize) X(event_create) X(event_destroy) \
	X(event_record) X(stream_wait_event) X(event_query) X(event_synchronize) X(memcpy_async) \
	X(memcpy_batch_async) X(host_fn)
/* Optional (NULL: capture refused with -ENOTSUP): graphs. */
#define KVR_DEV_GRAPH_OPS(X) \
	X(stream_begin_capture) X(stream_end_capture) X(stream_capturing) X(graph_launch) X(graph_destroy)
#define KVR_DEV_KERNEL_OPS(X) \
	X(scatter) X(offload) X(summarize) X(score) X(select) X(similarity) X(attention) X(dense) \
	X(freelist) X(plan) X(append)

/*
 * backend_impl.h — how a backend plugs into backend.h: a table of operations
 * and the common part of a device. device.c validates arguments and
 * dispatches; each backend fills the table. Internal to gpu/.
 */
#ifndef KVR_GPU_BACKEND_IMPL_H
#define KVR_GPU_BACKEND_IMPL_H

#include <stdarg.h>

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kvr_dev_ops {
	const char *name;
	void (*destroy)(struct kvr_dev *dev);

	int (*alloc)(struct kvr_dev *dev, size_t bytes, void **ptr);
	void (*free)(struct kvr_dev *dev, void *ptr);
	int (*host_register)(struct kvr_dev *dev, void *ptr, size_t bytes);
	int (*host_unregister)(struct kvr_dev *dev, void *ptr);

	int (*stream_create)(struct kvr_dev *dev, uint32_t flags, struct kvr_stream **out);
	void (*stream_destroy)(struct kvr_dev *dev, struct kvr_stream *stream);
	/* Optional (NULL: only a NULL native handle, wrapped as NULL): an
	 * engine's stream as a kvr_stream; capture status of a stream. */
	int (*stream_wrap)(struct kvr_dev *dev, void *native, struct kvr_stream **out);
	void *(*stream_native)(struct kvr_dev *dev, struct kvr_stream *stream);
	/* Optional (NULL: nothing to reserve): the kernel scratch a captured
	 * attention and score on the stream want, allocated now. */
	int (*capture_reserve)(struct kvr_dev *dev, struct kvr_stream *stream, const struct kvr_shape *att_shape,
			       uint32_t n_att, const struct kvr_shape *score_shape, uint32_t n_score);
	int (*stream_capturing)(struct kvr_dev *dev, struct kvr_stream *stream);
	int (*stream_begin_capture)(struct kvr_dev *dev, struct kvr_stream *stream);
	int (*stream_end_capture)(struct kvr_dev *dev, struct kvr_stream *stream, struct kvr_graph **out);
	int (*graph_launch)(struct kvr_dev *dev, struct kvr_graph *graph, struct kvr_stream *stream);
	void (*graph_destroy)(struct kvr_dev *dev, struct kvr_graph *graph);
	int (*stream_synchronize)(struct kvr_dev *dev, struct kvr_stream *stream);
	int (*event_create)(struct kvr_dev *dev, struct kvr_event **out);
	void (*event_destroy)(struct kvr_dev *dev, struct kvr_event *event);
	int (*event_record)(struct kvr_dev *dev, struct kvr_event *event, struct kvr_stream *stream);
	int (*stream_wait_event)(struct kvr_dev *dev, struct kvr_stream *stream,
				 struct kvr_event *event);
	int (*event_query)(struct kvr_dev *dev, struct kvr_event *event);
	int (*event_synchronize)(struct kvr_dev *dev, struct kvr_event *event);

	int (*memcpy_async)(struct kvr_dev *dev, void *dst, const void *src, size_t bytes,
			    uint32_t kind, struct kvr_stream *stream);
	int (*memcpy_batch_async)(struct kvr_dev *dev, void *dst_base, const void *src_base,
				  const struct kvr_copy_desc *descs, size_t n, uint32_t kind,
				  struct kvr_stream *stream);

	int (*scatter)(struct kvr_dev *dev, const struct kvr_shape *shape,
		       const struct kvr_scatter_item *items, uint32_t n, struct kvr_stream *stream);
	int (*offload)(struct kvr_dev *dev, const struct kvr_shape *shape,
		       const struct kvr_page_item *items, uint32_t n, struct kvr_stream *stream);
	int (*summarize)(struct kvr_dev *dev, const struct kvr_shape *shape,
			 const struct kvr_page_item *items, uint32_t n, struct kvr_stream *stream);
	int (*score)(struct kvr_dev *dev, const struct kvr_shape *shape,
		     const struct kvr_score_item *items, uint32_t n, struct kvr_stream *stream);
	int (*select)(struct kvr_dev *dev, const struct kvr_shape *shape,
		      const struct kvr_score_item *items, uint32_t n, struct kvr_stream *stream);
	int (*similarity)(struct kvr_dev *dev, const struct kvr_shape *shape,
			  const struct kvr_similarity_item *items, uint32_t n,
			  struct kvr_stream *stream);
	int (*attention)(struct kvr_dev *dev, const struct kvr_shape *shape,
			 const struct kvr_attention_item *items, uint32_t n,
			 const struct kvr_kv_segment *segments, uint32_t n_segments,
			 struct kvr_stream *stream);
	int (*dense)(struct kvr_dev *dev, const struct kvr_shape *shape,
		     const struct kvr_dense_item *items, uint32_t n, struct kvr_stream *stream);
	int (*freelist)(struct kvr_dev *dev, const struct kvr_freelist_item *items, uint32_t n,
			struct kvr_stream *stream);
	int (*plan)(struct kvr_dev *dev, const struct kvr_shape *shape,
		    const struct kvr_plan_item *items, uint32_t n, struct kvr_stream *stream);
	int (*append)(struct kvr_dev *dev, const struct kvr_shape *shape,
		      const struct kvr_append_item *items, uint32_t n, struct kvr_stream *stream);
	/* Optional (NULL: -ENOTSUP): run fn(arg) on the host in stream order. */
	int (*host_fn)(struct kvr_dev *dev, struct kvr_stream *stream, void (*fn)(void *arg),
		       void *arg);
	/* Optional (NULL on every device but cudaemu-strict, which keeps a map of
	 * device memory): kvr_dev_alloc and kvr_dev_free call these for memory
	 * the engine's allocator (alloc_fn/free_fn) hands out and takes back,
	 * which never passes through alloc/free above. track_free runs before
	 * free_fn, so the address cannot be handed out again while still mapped.
	 * A failing track_alloc fails the allocation. Any thread. */
	int (*track_alloc)(struct kvr_dev *dev, void *ptr, size_t bytes);
	void (*track_free)(struct kvr_dev *dev, void *ptr);
};

struct kvr_dev {
	const struct kvr_dev_ops *ops;
	uint32_t kind;          /* enum kvr_dev_kind */
	int host_visible;       /* device memory is host-addressable */
	void *impl;             /* the backend's own state */
	void *strict;           /* cudaemu-strict's map of device memory; NULL otherwise */
	int (*alloc_fn)(void *user, size_t bytes, void **ptr); /* the engine's, or NULL */
	void (*free_fn)(void *user, void *ptr);
	void *alloc_user;
};

/* Bytes of a device failure message (kvr_dev_last_error). */
#define KVR_DEV_MESSAGE_BYTES 256

/* Record a message in the calling thread's slot and return err (backends'
 * error path). */
int kvr_dev_fail(struct kvr_dev *dev, int err, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* Backend constructors: fill dev->ops/impl or return -ENODEV with a reason. */
int kvr_cpu_dev_init(struct kvr_dev *dev, const struct kvr_dev_params *params, char *err,
		     size_t err_bytes);
int kvr_cuda_dev_init(struct kvr_dev *dev, const struct kvr_dev_params *params, char *err,
		      size_t err_bytes);
int kvr_cudaemu_dev_init(struct kvr_dev *dev, const struct kvr_dev_params *params, char *err,
			 size_t err_bytes);

#ifdef __cplusplus
}
#endif

#endif /* KVR_GPU_BACKEND_IMPL_H */
