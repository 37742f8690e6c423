/* SPDX-License-Identifier: MIT */
/*
 * backend.c — the cudaemu device: the cpu backend's memory, streams, events
 * and copies, with every kernel replaced by the CUDA kernel bodies of
 * gpu/cuda_kernels.cu compiled for the CPU against the SIMT shim
 * (gpu/cudaemu/kernels.cc). Tests only: it is the way the CUDA kernels execute
 * on machines without a GPU, so the conformance suite can check them.
 *
 * A launch runs synchronously inside the stream operation, on whichever thread
 * runs the operation (the shim keeps its state per OS thread). A launch that
 * fails (a deadlocked barrier, a bad configuration) cannot fail the enqueue
 * that already returned: it is counted and its message kept for
 * kvr_cudaemu_failed_launches() / kvr_cudaemu_last_failure(), and its outputs
 * are whatever the kernel left, which the conformance checks then reject.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "../cpu_backend.h"
#include "cudaemu.h"

/* The emulated launchers (cuda_kernels.cu built with -DKVR_CUDAEMU). */
int kvr_emu_launch_scatter(const struct kvr_shape *, const struct kvr_scatter_item *, uint32_t, void *);
int kvr_emu_launch_offload(const struct kvr_shape *, const struct kvr_page_item *, uint32_t, void *);
int kvr_emu_launch_summarize(const struct kvr_shape *, const struct kvr_page_item *, uint32_t, void *);
int kvr_emu_launch_score(const struct kvr_shape *, const struct kvr_score_item *, uint32_t, void *);
int kvr_emu_launch_select(const struct kvr_shape *, const struct kvr_score_item *, uint32_t, void *);
int kvr_emu_launch_similarity(const struct kvr_shape *, const struct kvr_similarity_item *, uint32_t,
			      void *);
int kvr_emu_launch_attention(const struct kvr_shape *, const struct kvr_attention_item *, uint32_t,
			     const struct kvr_kv_segment *, uint32_t, void *);
int kvr_emu_launch_dense(const struct kvr_shape *, const struct kvr_dense_item *, uint32_t, void *);
const char *kvr_emu_last_message(void);

enum emu_kernel { EMU_SCATTER, EMU_OFFLOAD, EMU_SUMMARIZE, EMU_SCORE, EMU_SELECT, EMU_SIMILARITY,
		  EMU_ATTENTION, EMU_DENSE };

struct emu_op {
	struct kvr_shape shape;
	const void *items;
	uint32_t n;
	enum emu_kernel kernel;
	const struct kvr_kv_segment *segments;
	uint32_t n_segments;
};

static _Atomic unsigned failed_launches; /* relaxed: a statistic read by tests */
static pthread_mutex_t failure_lock = PTHREAD_MUTEX_INITIALIZER;
static char failure_message[256];

unsigned kvr_cudaemu_failed_launches(void)
{
	return atomic_load_explicit(&failed_launches, memory_order_relaxed);
}

void kvr_cudaemu_last_failure(char *buf, size_t bytes)
{
	pthread_mutex_lock(&failure_lock);
	snprintf(buf, bytes, "%s", failure_message);
	pthread_mutex_unlock(&failure_lock);
}

static void run_emu(struct kvr_dev *dev, void *ctx)
{
	(void)dev;
	const struct emu_op *op = ctx;
	const struct kvr_shape *sh = &op->shape;
	int rc = 0;
	switch (op->kernel) {
	case EMU_SCATTER:
		rc = kvr_emu_launch_scatter(sh, op->items, op->n, NULL);
		break;
	case EMU_OFFLOAD:
		rc = kvr_emu_launch_offload(sh, op->items, op->n, NULL);
		break;
	case EMU_SUMMARIZE:
		rc = kvr_emu_launch_summarize(sh, op->items, op->n, NULL);
		break;
	case EMU_SCORE:
		rc = kvr_emu_launch_score(sh, op->items, op->n, NULL);
		break;
	case EMU_SELECT:
		rc = kvr_emu_launch_select(sh, op->items, op->n, NULL);
		break;
	case EMU_SIMILARITY:
		rc = kvr_emu_launch_similarity(sh, op->items, op->n, NULL);
		break;
	case EMU_ATTENTION:
		rc = kvr_emu_launch_attention(sh, op->items, op->n, op->segments, op->n_segments, NULL);
		break;
	case EMU_DENSE:
		rc = kvr_emu_launch_dense(sh, op->items, op->n, NULL);
		break;
	}
	if (rc) {
		atomic_fetch_add_explicit(&failed_launches, 1, memory_order_relaxed);
		pthread_mutex_lock(&failure_lock);
		snprintf(failure_message, sizeof(failure_message), "kernel %d: %s (%d)", op->kernel,
			 kvr_emu_last_message(), rc);
		pthread_mutex_unlock(&failure_lock);
	}
}

static int enqueue(struct kvr_dev *dev, struct kvr_stream *s, const struct kvr_shape *shape,
		   const void *items, uint32_t n, enum emu_kernel kernel,
		   const struct kvr_kv_segment *segments, uint32_t n_segments)
{
	const struct emu_op op = { *shape, items, n, kernel, segments, n_segments };
	return kvr_cpu_enqueue(dev, s, run_emu, &op, sizeof(op));
}

#define EMU_KERNEL(name, item_type, id)                                                         \
	static int emu_##name(struct kvr_dev *dev, const struct kvr_shape *shape,               \
			      const item_type *items, uint32_t n, struct kvr_stream *s)          \
	{                                                                                       \
		return enqueue(dev, s, shape, items, n, id, NULL, 0);                           \
	}

EMU_KERNEL(scatter, struct kvr_scatter_item, EMU_SCATTER)
EMU_KERNEL(offload, struct kvr_page_item, EMU_OFFLOAD)
EMU_KERNEL(summarize, struct kvr_page_item, EMU_SUMMARIZE)
EMU_KERNEL(score, struct kvr_score_item, EMU_SCORE)
EMU_KERNEL(select, struct kvr_score_item, EMU_SELECT)
EMU_KERNEL(similarity, struct kvr_similarity_item, EMU_SIMILARITY)
EMU_KERNEL(dense, struct kvr_dense_item, EMU_DENSE)

static int emu_attention(struct kvr_dev *dev, const struct kvr_shape *shape,
			 const struct kvr_attention_item *items, uint32_t n,
			 const struct kvr_kv_segment *segments, uint32_t n_segments,
			 struct kvr_stream *s)
{
	return enqueue(dev, s, shape, items, n, EMU_ATTENTION, segments, n_segments);
}

static struct kvr_dev_ops emu_ops;
static pthread_once_t emu_ops_once = PTHREAD_ONCE_INIT;

static void emu_ops_init(void)
{
	emu_ops = *kvr_cpu_ops();
	emu_ops.name = "cudaemu";
	emu_ops.scatter = emu_scatter;
	emu_ops.offload = emu_offload;
	emu_ops.summarize = emu_summarize;
	emu_ops.score = emu_score;
	emu_ops.select = emu_select;
	emu_ops.similarity = emu_similarity;
	emu_ops.attention = emu_attention;
	emu_ops.dense = emu_dense;
}

/* Overrides the library's weak constructor when this file is linked. */
int kvr_cudaemu_dev_init(struct kvr_dev *dev, const struct kvr_dev_params *params, char *err,
			 size_t err_bytes)
{
	int ret = kvr_cpu_dev_init(dev, params, err, err_bytes);
	if (ret)
		return ret;
	pthread_once(&emu_ops_once, emu_ops_init);
	dev->ops = &emu_ops;
	return 0;
}
