/* SPDX-License-Identifier: MIT */
/*
 * device.c — the entry points of backend.h: argument checks common to every
 * backend, then dispatch through the backend's ops table. Backends that are
 * not compiled in resolve to constructors returning -ENODEV (cuda_absent.c,
 * and a weak cudaemu constructor that the test build overrides).
 *
 * Threads: any; see backend.h.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_impl.h"
#include "../layouts/base/fault.h"

/* The calling thread's latest device failure (any device: it is read right
 * after the failing call, by the same thread). */
static _Thread_local char thread_dev_error[KVR_DEV_MESSAGE_BYTES];

int kvr_dev_fail(struct kvr_dev *dev, int err, const char *fmt, ...)
{
	(void)dev;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(thread_dev_error, sizeof(thread_dev_error), fmt, ap);
	va_end(ap);
	return err;
}

/* cudaemu (and cudaemu-strict, the same backend) lives in the test build (it
 * executes the .cu kernels through a shim); the library itself only knows
 * that it may be linked in. */
__attribute__((weak)) int kvr_cudaemu_dev_init(struct kvr_dev *dev,
					       const struct kvr_dev_params *params, char *err,
					       size_t err_bytes)
{
	(void)dev;
	(void)params;
	snprintf(err, err_bytes, "cudaemu backend not linked (it exists in test builds only)");
	return -ENODEV;
}

int kvr_dev_create(const struct kvr_dev_params *params, struct kvr_dev **out, char *err,
		   size_t err_bytes)
{
	if (!params || !out) {
		snprintf(err, err_bytes, "device: params or out is NULL");
		return -EINVAL;
	}
	struct kvr_dev *dev = calloc(1, sizeof(*dev));
	if (!dev) {
		snprintf(err, err_bytes, "device: out of memory");
		return -ENOMEM;
	}
	dev->kind = params->kind;
	dev->alloc_fn = params->alloc_fn;
	dev->free_fn = params->free_fn;
	dev->alloc_user = params->alloc_user;
	int ret;
	switch (params->kind) {
	case KVR_DEV_CPU:
		ret = kvr_cpu_dev_init(dev, params, err, err_bytes);
		break;
	case KVR_DEV_CUDA:
		ret = kvr_cuda_dev_init(dev, params, err, err_bytes);
		break;
	case KVR_DEV_CUDAEMU:
	case KVR_DEV_CUDAEMU_STRICT: /* the same backend; it reads params->kind */
		ret = kvr_cudaemu_dev_init(dev, params, err, err_bytes);
		break;
	default:
		snprintf(err, err_bytes, "device: unknown kind %u", params->kind);
		ret = -EINVAL;
		break;
	}
	if (ret) {
		free(dev);
		return ret;
	}
	*out = dev;
	return 0;
}

void kvr_dev_destroy(struct kvr_dev *dev)
{
	if (!dev)
		return;
	dev->ops->destroy(dev);
	free(dev);
}

const char *kvr_dev_name(const struct kvr_dev *dev)
{
	return dev->ops->name;
}

uint32_t kvr_dev_kind_of(const struct kvr_dev *dev)
{
	return dev->kind;
}

const char *kvr_dev_last_error(const struct kvr_dev *dev)
{
	(void)dev;
	return thread_dev_error;
}

int kvr_dev_host_visible(const struct kvr_dev *dev)
{
	return dev->host_visible;
}

int kvr_dev_alloc(struct kvr_dev *dev, size_t bytes, void **ptr)
{
	if (!ptr)
		return kvr_dev_fail(dev, -EINVAL, "alloc: ptr is NULL");
	if (!bytes)
		return kvr_dev_fail(dev, -EINVAL, "alloc: zero bytes");
	if (kvr_fault_hit(KVR_FAULT_DEV_ALLOC))
		return kvr_dev_fail(dev, -ENOMEM, "alloc: %zu bytes: out of device memory (injected fault)",
				    bytes);
	if (dev->alloc_fn) {
		void *p = NULL;
		int err = dev->alloc_fn(dev->alloc_user, bytes, &p);
		if (err || !p)
			return kvr_dev_fail(dev, err < 0 ? err : -ENOMEM,
					    "alloc: the engine's allocator failed for %zu bytes (%d)", bytes,
					    err);
		if ((uintptr_t)p % 64) {
			dev->free_fn(dev->alloc_user, p);
			return kvr_dev_fail(dev, -EINVAL,
					    "alloc: the engine's allocator returned %p, not 64-byte aligned",
					    p);
		}
		/* a checking device must know this memory is device memory */
		if (dev->ops->track_alloc && (err = dev->ops->track_alloc(dev, p, bytes))) {
			dev->free_fn(dev->alloc_user, p);
			return err;
		}
		*ptr = p;
		return 0;
	}
	return dev->ops->alloc(dev, bytes, ptr);
}

void kvr_dev_free(struct kvr_dev *dev, void *ptr)
{
	if (ptr && dev->free_fn) {
		if (dev->ops->track_free)
			dev->ops->track_free(dev, ptr);
		dev->free_fn(dev->alloc_user, ptr);
	} else if (ptr) {
		dev->ops->free(dev, ptr);
	}
}

int kvr_dev_host_register(struct kvr_dev *dev, void *ptr, size_t bytes)
{
	if (!ptr || !bytes)
		return kvr_dev_fail(dev, -EINVAL, "host_register: empty range");
	return dev->ops->host_register(dev, ptr, bytes);
}

int kvr_dev_host_unregister(struct kvr_dev *dev, void *ptr)
{
	if (!ptr)
		return kvr_dev_fail(dev, -EINVAL, "host_unregister: ptr is NULL");
	return dev->ops->host_unregister(dev, ptr);
}

int kvr_dev_stream_create(struct kvr_dev *dev, uint32_t flags, struct kvr_stream **out)
{
	if (!out)
		return kvr_dev_fail(dev, -EINVAL, "stream_create: out is NULL");
	if (flags & ~(uint32_t)KVR_STREAM_WORKER)
		return kvr_dev_fail(dev, -EINVAL, "stream_create: unknown flags 0x%x", flags);
	if (kvr_fault_hit(KVR_FAULT_STREAM))
		return kvr_dev_fail(dev, -ENOMEM, "stream_create: out of resources (injected fault)");
	return dev->ops->stream_create(dev, flags, out);
}

void kvr_dev_stream_destroy(struct kvr_dev *dev, struct kvr_stream *stream)
{
	if (stream)
		dev->ops->stream_destroy(dev, stream);
}

void *kvr_dev_stream_native(struct kvr_dev *dev, struct kvr_stream *stream)
{
	return stream && dev->ops->stream_native ? dev->ops->stream_native(dev, stream) : NULL;
}

int kvr_dev_stream_wrap(struct kvr_dev *dev, void *native, struct kvr_stream **out)
{
	if (!out)
		return kvr_dev_fail(dev, -EINVAL, "stream_wrap: out is NULL");
	*out = NULL;
	if (dev->ops->stream_wrap)
		return dev->ops->stream_wrap(dev, native, out);
	if (native)
		return kvr_dev_fail(dev, -EINVAL,
				    "stream_wrap: the %s backend has no native streams (pass NULL)",
				    dev->ops->name);
	return 0;
}

int kvr_dev_stream_capturing(struct kvr_dev *dev, struct kvr_stream *stream)
{
	if (!stream)
		return kvr_dev_fail(dev, -EINVAL, "stream_capturing: stream is NULL");
	return dev->ops->stream_capturing ? dev->ops->stream_capturing(dev, stream) : 0;
}

int kvr_dev_stream_begin_capture(struct kvr_dev *dev, struct kvr_stream *stream)
{
	if (!stream)
		return kvr_dev_fail(dev, -EINVAL, "begin_capture: stream is NULL");
	if (!dev->ops->stream_begin_capture)
		return kvr_dev_fail(dev, -ENOTSUP, "begin_capture: the %s backend has no graphs", dev->ops->name);
	return dev->ops->stream_begin_capture(dev, stream);
}

int kvr_dev_stream_end_capture(struct kvr_dev *dev, struct kvr_stream *stream, struct kvr_graph **out)
{
	if (!stream || !out)
		return kvr_dev_fail(dev, -EINVAL, "end_capture: %s is NULL", stream ? "out" : "stream");
	*out = NULL;
	if (!dev->ops->stream_end_capture)
		return kvr_dev_fail(dev, -ENOTSUP, "end_capture: the %s backend has no graphs", dev->ops->name);
	return dev->ops->stream_end_capture(dev, stream, out);
}

int kvr_dev_graph_launch(struct kvr_dev *dev, struct kvr_graph *graph, struct kvr_stream *stream)
{
	if (!graph || !stream)
		return kvr_dev_fail(dev, -EINVAL, "graph_launch: %s is NULL", graph ? "stream" : "graph");
	if (!dev->ops->graph_launch)
		return kvr_dev_fail(dev, -ENOTSUP, "graph_launch: the %s backend has no graphs", dev->ops->name);
	return dev->ops->graph_launch(dev, graph, stream);
}

void kvr_dev_graph_destroy(struct kvr_dev *dev, struct kvr_graph *graph)
{
	if (graph && dev->ops->graph_destroy)
		dev->ops->graph_destroy(dev, graph);
}

#define NEED(cond, what)                                                 \
	do {                                                             \
		if (!(cond))                                             \
			return kvr_dev_fail(dev, -EINVAL, "%s: %s", __func__, what); \
	} while (0)

int kvr_dev_stream_synchronize(struct kvr_dev *dev, struct kvr_stream *stream)
{
	NEED(stream, "stream is NULL");
	return dev->ops->stream_synchronize(dev, stream);
}

int kvr_dev_event_create(struct kvr_dev *dev, struct kvr_event **out)
{
	NEED(out, "out is NULL");
	if (kvr_fault_hit(KVR_FAULT_STREAM))
		return kvr_dev_fail(dev, -ENOMEM, "event_create: out of resources (injected fault)");
	return dev->ops->event_create(dev, out);
}

void kvr_dev_event_destroy(struct kvr_dev *dev, struct kvr_event *event)
{
	if (event)
		dev->ops->event_destroy(dev, event);
}

int kvr_dev_event_record(struct kvr_dev *dev, struct kvr_event *event, struct kvr_stream *stream)
{
	NEED(event && stream, "event or stream is NULL");
	return dev->ops->event_record(dev, event, stream);
}

int kvr_dev_stream_wait_event(struct kvr_dev *dev, struct kvr_stream *stream,
			      struct kvr_event *event)
{
	NEED(event && stream, "event or stream is NULL");
	return dev->ops->stream_wait_event(dev, stream, event);
}

int kvr_dev_event_query(struct kvr_dev *dev, struct kvr_event *event)
{
	NEED(event, "event is NULL");
	return dev->ops->event_query(dev, event);
}

int kvr_dev_event_synchronize(struct kvr_dev *dev, struct kvr_event *event)
{
	NEED(event, "event is NULL");
	return dev->ops->event_synchronize(dev, event);
}

int kvr_dev_memcpy_async(struct kvr_dev *dev, void *dst, const void *src, size_t bytes,
			 uint32_t kind, struct kvr_stream *stream)
{
	NEED(stream, "stream is NULL");
	NEED(kind <= KVR_COPY_D2D, "unknown copy kind");
	if (!bytes)
		return 0;
	NEED(dst && src, "dst or src is NULL");
	if (kvr_fault_hit(KVR_FAULT_COPY))
		return kvr_dev_fail(dev, -EIO, "memcpy_async: %zu bytes: copy failed (injected fault)",
				    bytes);
	return dev->ops->memcpy_async(dev, dst, src, bytes, kind, stream);
}

int kvr_dev_memcpy_batch_async(struct kvr_dev *dev, void *dst_base, const void *src_base,
			       const struct kvr_copy_desc *descs, size_t n, uint32_t kind,
			       struct kvr_stream *stream)
{
	NEED(stream, "stream is NULL");
	NEED(kind <= KVR_COPY_D2D, "unknown copy kind");
	if (!n)
		return 0;
	NEED(dst_base && src_base && descs, "a base or the descriptor list is NULL");
	if (kvr_fault_hit(KVR_FAULT_COPY))
		return kvr_dev_fail(dev, -EIO, "memcpy_batch_async: %zu copies failed (injected fault)", n);
	return dev->ops->memcpy_batch_async(dev, dst_base, src_base, descs, n, kind, stream);
}

/* Checks shared by the kernels: a shape the kernels support. */
static int check_shape(struct kvr_dev *dev, const char *op, const struct kvr_shape *s)
{
	if (!s)
		return kvr_dev_fail(dev, -EINVAL, "%s: shape is NULL", op);
	if (!s->n_kv_heads || !s->n_qo_heads || s->n_qo_heads % s->n_kv_heads ||
	    s->n_qo_heads / s->n_kv_heads > 64)
		return kvr_dev_fail(dev, -EINVAL, "%s: %u query heads for %u KV heads", op,
				    s->n_qo_heads, s->n_kv_heads);
	if (!s->head_dim || s->head_dim % 32 || s->head_dim > 256)
		return kvr_dev_fail(dev, -EINVAL, "%s: head_dim %u unsupported", op, s->head_dim);
	if (s->elem_type > KVR_ELEM_F32)
		return kvr_dev_fail(dev, -EINVAL, "%s: element type %u unknown", op, s->elem_type);
	return 0;
}

#define KERNEL_PROLOGUE(op, items, n, stream)                                       \
	do {                                                                        \
		int err_ = check_shape(dev, op, shape);                             \
		if (err_)                                                           \
			return err_;                                                \
		if (!(stream))                                                      \
			return kvr_dev_fail(dev, -EINVAL, "%s: stream is NULL", op); \
		if (!(n))                                                           \
			return 0;                                                   \
		if (!(items))                                                       \
			return kvr_dev_fail(dev, -EINVAL, "%s: items is NULL", op);  \
	} while (0)

static int check_pages(struct kvr_dev *dev, const char *op, const struct kvr_shape *s)
{
	if (!s->page_tokens || s->page_tokens > 256 || (s->page_tokens & (s->page_tokens - 1)))
		return kvr_dev_fail(dev, -EINVAL, "%s: page_tokens %u unsupported", op,
				    s->page_tokens);
	return 0;
}

int kvr_dev_scatter(struct kvr_dev *dev, const struct kvr_shape *shape,
		    const struct kvr_scatter_item *items, uint32_t n, struct kvr_stream *stream)
{
	KERNEL_PROLOGUE("scatter", items, n, stream);
	int err = check_pages(dev, "scatter", shape);
	return err ? err : dev->ops->scatter(dev, shape, items, n, stream);
}

int kvr_dev_offload(struct kvr_dev *dev, const struct kvr_shape *shape,
		    const struct kvr_page_item *items, uint32_t n, struct kvr_stream *stream)
{
	KERNEL_PROLOGUE("offload", items, n, stream);
	int err = check_pages(dev, "offload", shape);
	return err ? err : dev->ops->offload(dev, shape, items, n, stream);
}

int kvr_dev_summarize(struct kvr_dev *dev, const struct kvr_shape *shape,
		      const struct kvr_page_item *items, uint32_t n, struct kvr_stream *stream)
{
	KERNEL_PROLOGUE("summarize", items, n, stream);
	int err = check_pages(dev, "summarize", shape);
	return err ? err : dev->ops->summarize(dev, shape, items, n, stream);
}

int kvr_dev_score(struct kvr_dev *dev, const struct kvr_shape *shape,
		  const struct kvr_score_item *items, uint32_t n, struct kvr_stream *stream)
{
	KERNEL_PROLOGUE("score", items, n, stream);
	return dev->ops->score(dev, shape, items, n, stream);
}

int kvr_dev_select(struct kvr_dev *dev, const struct kvr_shape *shape,
		   const struct kvr_score_item *items, uint32_t n, struct kvr_stream *stream)
{
	KERNEL_PROLOGUE("select", items, n, stream);
	return dev->ops->select(dev, shape, items, n, stream);
}

int kvr_dev_similarity(struct kvr_dev *dev, const struct kvr_shape *shape,
		       const struct kvr_similarity_item *items, uint32_t n,
		       struct kvr_stream *stream)
{
	KERNEL_PROLOGUE("similarity", items, n, stream);
	return dev->ops->similarity(dev, shape, items, n, stream);
}

int kvr_dev_capture_reserve(struct kvr_dev *dev, struct kvr_stream *stream, const struct kvr_shape *att_shape,
			    uint32_t n_att, const struct kvr_shape *score_shape, uint32_t n_score)
{
	if (!stream)
		return kvr_dev_fail(dev, -EINVAL, "capture_reserve: stream is NULL");
	return dev->ops->capture_reserve ? dev->ops->capture_reserve(dev, stream, att_shape, n_att, score_shape,
								     n_score)
					 : 0;
}

int kvr_dev_attention(struct kvr_dev *dev, const struct kvr_shape *shape,
		      const struct kvr_attention_item *items, uint32_t n,
		      const struct kvr_kv_segment *segments, uint32_t n_segments,
		      struct kvr_stream *stream)
{
	KERNEL_PROLOGUE("attention", items, n, stream);
	if (n_segments && !segments)
		return kvr_dev_fail(dev, -EINVAL, "attention: segments is NULL");
	if (shape->flags & KVR_SHAPE_CAUSAL) {
		const uint32_t hq = shape->causal_heads_per_query;
		if (!hq || !shape->n_kv_heads || (shape->n_qo_heads / shape->n_kv_heads) % hq)
			return kvr_dev_fail(dev, -EINVAL,
					    "attention: causal_heads_per_query %u does not divide the group of %u query heads",
					    hq, shape->n_kv_heads ? shape->n_qo_heads / shape->n_kv_heads : 0);
	}
	return dev->ops->attention(dev, shape, items, n, segments, n_segments, stream);
}

int kvr_dev_dense(struct kvr_dev *dev, const struct kvr_shape *shape,
		  const struct kvr_dense_item *items, uint32_t n, struct kvr_stream *stream)
{
	KERNEL_PROLOGUE("dense", items, n, stream);
	if (shape->flags & KVR_SHAPE_CAUSAL)
		return kvr_dev_fail(dev, -EINVAL, "dense: KVR_SHAPE_CAUSAL is an attention flag (query blocks over segments)");
	return dev->ops->dense(dev, shape, items, n, stream);
}

int kvr_dev_plan(struct kvr_dev *dev, const struct kvr_shape *shape,
		 const struct kvr_plan_item *items, uint32_t n, struct kvr_stream *stream)
{
	KERNEL_PROLOGUE("plan", items, n, stream);
	return dev->ops->plan(dev, shape, items, n, stream);
}

int kvr_dev_append(struct kvr_dev *dev, const struct kvr_shape *shape,
		   const struct kvr_append_item *items, uint32_t n, struct kvr_stream *stream)
{
	KERNEL_PROLOGUE("append", items, n, stream);
	int err = check_pages(dev, "append", shape);
	return err ? err : dev->ops->append(dev, shape, items, n, stream);
}

int kvr_dev_freelist(struct kvr_dev *dev, const struct kvr_freelist_item *items, uint32_t n,
		     struct kvr_stream *stream)
{
	if (!stream)
		return kvr_dev_fail(dev, -EINVAL, "freelist: stream is NULL");
	if (!n)
		return 0;
	if (!items)
		return kvr_dev_fail(dev, -EINVAL, "freelist: items is NULL");
	return dev->ops->freelist(dev, items, n, stream);
}

int kvr_dev_host_fn(struct kvr_dev *dev, struct kvr_stream *stream, void (*fn)(void *arg),
		    void *arg)
{
	NEED(stream && fn, "stream or fn is NULL");
	if (!dev->ops->host_fn)
		return kvr_dev_fail(dev, -ENOTSUP, "host_fn: the %s backend has no host functions",
				    dev->ops->name);
	return dev->ops->host_fn(dev, stream, fn, arg);
}
