/* SPDX-License-Identifier: MIT */
/*
 * cpu_backend.h — what the cpu backend shares with its kernels (cpu_kernels.c)
 * and with cudaemu, which reuses its memory, streams, events and copies and
 * replaces only the kernels.
 */
#ifndef KVR_GPU_CPU_BACKEND_H
#define KVR_GPU_CPU_BACKEND_H

#include <stddef.h>

#include "../backend_impl.h"

/* The cpu ops table (cudaemu copies it and swaps the kernel entries). */
const struct kvr_dev_ops *kvr_cpu_ops(void);

/* Enqueue run(dev, ctx) on a stream: executed now on the caller for an inline
 * stream, by the stream's worker otherwise. ctx (ctx_bytes, at most
 * KVR_CPU_OP_CTX_BYTES) is copied. */
#define KVR_CPU_OP_CTX_BYTES 192
typedef void (*kvr_cpu_op_fn)(struct kvr_dev *dev, void *ctx);
int kvr_cpu_enqueue(struct kvr_dev *dev, struct kvr_stream *stream, kvr_cpu_op_fn run,
		    const void *ctx, size_t ctx_bytes);

/* 1 when an operation enqueued now runs after the call returns: a worker
 * stream, or a stream being captured (it runs at each launch of the graph).
 * cudaemu-strict then checks item contents when the operation runs, not
 * when it is enqueued. */
int kvr_cpu_stream_runs_later(const struct kvr_stream *stream);

/* A kernel enqueued on a stream being captured: refused (-ENOTSUP, the
 * capture left valid) unless `capturable` (kernels.h, KVR_CAPTURABLE_*),
 * as the cuda backend refuses it; 0 on a stream not captured. The cpu
 * backend's kernel ops and cudaemu's call it. */
int kvr_cpu_capture_refuses(struct kvr_dev *dev, struct kvr_stream *stream, const char *op, int capturable);

/* Run task over [0, n) with the device's workers (or the engine's
 * parallel-for). Called from inside an op. */
void kvr_cpu_parallel_for(struct kvr_dev *dev, kvr_task_fn task, void *arg, uint32_t n);
/* Workers available besides the caller (to size task splits). */
uint32_t kvr_cpu_threads(const struct kvr_dev *dev);

/* The kernels (cpu_kernels.c): run synchronously, on the calling thread plus
 * the device's workers. */
void kvr_cpu_scatter(struct kvr_dev *dev, const struct kvr_shape *shape,
		     const struct kvr_scatter_item *items, uint32_t n);
void kvr_cpu_offload(struct kvr_dev *dev, const struct kvr_shape *shape,
		     const struct kvr_page_item *items, uint32_t n);
void kvr_cpu_summarize(struct kvr_dev *dev, const struct kvr_shape *shape,
		       const struct kvr_page_item *items, uint32_t n);
void kvr_cpu_score(struct kvr_dev *dev, const struct kvr_shape *shape,
		   const struct kvr_score_item *items, uint32_t n);
void kvr_cpu_select(struct kvr_dev *dev, const struct kvr_shape *shape,
		    const struct kvr_score_item *items, uint32_t n);
void kvr_cpu_similarity(struct kvr_dev *dev, const struct kvr_shape *shape,
			const struct kvr_similarity_item *items, uint32_t n);
void kvr_cpu_plan(struct kvr_dev *dev, const struct kvr_shape *shape,
		  const struct kvr_plan_item *items, uint32_t n);
void kvr_cpu_append(struct kvr_dev *dev, const struct kvr_shape *shape,
		    const struct kvr_append_item *items, uint32_t n);
void kvr_cpu_attention(struct kvr_dev *dev, const struct kvr_shape *shape,
		       const struct kvr_attention_item *items, uint32_t n,
		       const struct kvr_kv_segment *segments, uint32_t n_segments);
void kvr_cpu_dense(struct kvr_dev *dev, const struct kvr_shape *shape,
		   const struct kvr_dense_item *items, uint32_t n);
void kvr_cpu_freelist(struct kvr_dev *dev, const struct kvr_freelist_item *items, uint32_t n);

/* How attention reads quantised keys: 0, integer dots against the query
 * rounded to 8 bits (kvquant.h's contract, the default); 1, float dots on
 * the unrounded query, when the environment has KVR_QUANT_DOTS=float (read
 * at first use: a comparison for accuracy studies). Any thread. */
int kvr_cpu_quant_float_dots(void);
/* Tests: choose either way; call it before starting work. */
void kvr_cpu_quant_dots_force(int float_dots);

#endif /* KVR_GPU_CPU_BACKEND_H */
