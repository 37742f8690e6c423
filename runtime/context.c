/* SPDX-License-Identifier: MIT */
/*
 * context.c — context lifecycle: validation of the caller's config, resolution
 * of its automatic fields against the machine (backend, mode, threads, sizes,
 * NUMA node), and teardown.
 *
 * Threads: create/destroy run on the caller's thread; a context's calls are not
 * concurrent with its destroy.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../gpu/backend.h"
#include "../layouts/base/fault.h"
#include "../gpu/gpu.h"
#include "../host/pool.h"
#include "../host/topology.h"
#include "../layouts/kvquant.h"
#include "../layouts/page.h"
#include "../scheduler/scheduler.h"
#include "../scheduler/trace.h"
#include "internal.h"

KVR_STATIC_ASSERT((int)KVR_ELEM_F16 == (int)KVR_DTYPE_F16 &&
			  (int)KVR_ELEM_BF16 == (int)KVR_DTYPE_BF16 &&
			  (int)KVR_ELEM_F32 == (int)KVR_DTYPE_F32,
		  "layouts/ element types mirror enum kvr_dtype");
KVR_STATIC_ASSERT((int)KVR_KV_PLAIN == (int)KVR_KV_FORMAT_PLAIN &&
			  (int)KVR_KV_K8V4 == (int)KVR_KV_FORMAT_K8V4 &&
			  (int)KVR_KV_K4V2 == (int)KVR_KV_FORMAT_K4V2 &&
			  (int)KVR_KV_MIXED == (int)KVR_KV_FORMAT_MIXED,
		  "layouts/ page formats mirror enum kvr_kv_format_kind");

KVR_API int kvr_device_bytes_needed(const struct kvr_config *cfg, uint64_t *fixed_bytes,
				    uint64_t *per_sequence_bytes)
{
	char message[KVR_ERROR_MESSAGE_BYTES];
	struct kvr_config c;
	int err = kvr_config_import(cfg, &c, message, sizeof(message));
	if (!err)
		err = kvr_config_validate(&c, message, sizeof(message));
	if (err)
		return kvr_fail_config(cfg, err, "%s", message);
	kvr_config_resolve_tokens(&c);
	uint64_t fixed, per_seq;
	kvr_config_device_bytes(&c, kvr_config_recall(&c), &fixed, &per_seq);
	if (fixed_bytes)
		*fixed_bytes = fixed;
	if (per_sequence_bytes)
		*per_sequence_bytes = per_seq;
	return 0;
}

/* The pool's warnings (memory not locked) go to the context's log. */
static void pool_log(void *user, int level, const char *message)
{
	kvr_log((const struct kvr_context *)user, (enum kvr_log_level)level, "%s", message);
}

/* Pool memory registered with a separate-memory device. */
static int pool_register(void *user, void *ptr, size_t bytes)
{
	return kvr_dev_host_register(user, ptr, bytes);
}

static void pool_unregister(void *user, void *ptr)
{
	kvr_dev_host_unregister(user, ptr);
}

/* The scheduler's messages (asynchronous failures) go to the context's log. */
static void sched_log(void *user, int level, const char *message)
{
	kvr_log((const struct kvr_context *)user, (enum kvr_log_level)level, "%s", message);
}

/* A sparse mode whose budget the sink and window fill selects no page
 * (k = 0): valid, a sink-plus-window ablation, but more likely a budget set
 * without its sink and window, so it is said once. */
static void warn_no_pages(const struct kvr_context *ctx)
{
	const struct kvr_config *c = &ctx->config;
	uint32_t sparse = 0;
	for (uint32_t l = 0; l < c->n_layers; l++)
		sparse += !(c->dense_layers[l / 64] >> (l % 64) & 1);
	if (c->mode == KVR_MODE_DENSE || !sparse ||
	    (uint64_t)c->budget_tokens - c->sink_tokens - c->window_tokens >= c->page_tokens)
		return;
	kvr_log(ctx, KVR_LOG_WARN,
		"config: budget_tokens %u leaves no page beyond sink_tokens %u and window_tokens %u: "
		"mode %s selects no pages (k = 0) and attends to the sink and window alone; raise "
		"budget_tokens or leave sink_tokens and window_tokens at KVR_TOKENS_AUTO",
		c->budget_tokens, c->sink_tokens, c->window_tokens, kvr_mode_name(c->mode));
}

static int resolve(struct kvr_config *c, char *gpu_reason, size_t gpu_reason_bytes)
{
	struct kvr_gpu_probe probe;
	kvr_gpu_probe(&probe);
	snprintf(gpu_reason, gpu_reason_bytes, "%s", probe.reason);

	if (c->backend == KVR_BACKEND_CUDA && probe.n_devices == 0)
		return kvr_fail_config(c, -ENODEV, "backend: cuda requested but no GPU is usable: %s",
				       probe.reason);
	/* Auto is the cpu backend, GPU or not: the backend decides whether the
	 * engine's q, k, v and out are host or device memory and what `stream`
	 * is, so a GPU appearing must not change what the engine's pointers
	 * mean. An engine on a GPU asks for cuda. */
	if (c->backend == KVR_BACKEND_AUTO)
		c->backend = KVR_BACKEND_CPU;

	/* FreeKV on a GPU. On the cpu backend the engine's attention and the
	 * controller's selection share the same cores, so overlapping them gains
	 * nothing on a small machine, and blocking — which also selects with the
	 * current query, the most accurate choice — costs within about 5% of
	 * the overlapped modes there (docs/benchmarks.md, "The decode step per
	 * mode"). */
	if (c->mode == KVR_MODE_AUTO)
		c->mode = c->backend == KVR_BACKEND_CUDA ? KVR_MODE_FREEKV : KVR_MODE_BLOCKING;

	if (c->threads == KVR_THREADS_AUTO) {
		long n = sysconf(_SC_NPROCESSORS_ONLN);
		c->threads = n > 1 ? (uint32_t)(n - 1) : 0;
	}

	/* The pool's node: as configured, else nearest the GPU, else ours. */
	char why[256];
	int node = kvr_topology_choose_node(NULL, c->numa_node, probe.pci_bus_id,
					    kvr_numa_current_node(), why, sizeof(why));
	if (node < 0)
		return kvr_fail_config(c, node, "%s (this machine has nodes 0..%d)", why,
				       kvr_numa_max_node());
	if (node > kvr_numa_max_node()) /* hwloc and libnuma disagree: trust libnuma */
		node = 0;
	c->numa_node = node;
	kvr_log_config(c, KVR_LOG_INFO, "host pool on NUMA node %s", why);

	if (c->pool_bytes == 0) {
		long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
		c->pool_bytes = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page / 2 : 0;
	}

	c->recall = kvr_config_recall(c);
	/* Inline where the cpu backend's threads take every core: the engine's
	 * attention then fills the cores, and a controller thread's selection
	 * waited 0.3-1.1 ms per job for a core and ran on one, where inline it
	 * runs on all of them right after the attention. Measured on 2 cores
	 * (docs/history.md, "The freekv step on two cores"): the step at
	 * 1.00-1.20x its budget inline against 1.18-1.45x with the thread.
	 * Elsewhere (a GPU computes, or cores are left over) the thread
	 * overlaps the selection with the step. */
	if (c->controller == KVR_CONTROLLER_AUTO) {
		const long cores = sysconf(_SC_NPROCESSORS_ONLN);
		const int cores_full = c->backend == KVR_BACKEND_CPU && (cores <= 1 || (long)c->threads + 1 >= cores);
		c->controller = cores_full ? KVR_CONTROLLER_INLINE : KVR_CONTROLLER_THREAD;
	}
	uint64_t fixed, per_seq;
	kvr_config_device_bytes(c, c->recall, &fixed, &per_seq);
	if (c->device_bytes == 0)
		c->device_bytes = fixed + per_seq * c->max_sequences;
	else if (c->device_bytes < fixed + per_seq)
		return kvr_fail_config(c, -ENOMEM,
				       "device_bytes: %llu bytes cannot hold one sequence: %llu bytes "
				       "of staging plus %llu per sequence (tail pages and, streamed, "
				       "the page cache of k slots per KV head and sparse layer)",
				       (unsigned long long)c->device_bytes, (unsigned long long)fixed,
				       (unsigned long long)per_seq);
	return 0;
}

KVR_API int kvr_context_create(const struct kvr_config *cfg, struct kvr_context **out)
{
	return kvr_context_create_internal(cfg, 0, NULL, out);
}

int kvr_context_create_internal(const struct kvr_config *cfg, uint32_t dev_kind,
				const struct kvr_sched_hooks *hooks, struct kvr_context **out)
{
	char message[KVR_ERROR_MESSAGE_BYTES];
	struct kvr_config c;
	int err;

	if (!out)
		return kvr_fail_config(cfg, -EINVAL, "out: is NULL");
	err = kvr_config_import(cfg, &c, message, sizeof(message));
	if (!err)
		err = kvr_config_validate(&c, message, sizeof(message));
	if (err)
		return kvr_fail_config(cfg, err, "%s", message);
	kvr_config_resolve_tokens(&c);

	struct kvr_context *ctx = kvr_calloc(1, sizeof(*ctx));
	if (!ctx)
		return kvr_fail_config(&c, -ENOMEM, "context: out of memory");
	err = resolve(&c, ctx->gpu_reason, sizeof(ctx->gpu_reason));
	if (err) {
		free(ctx);
		return err;
	}
	ctx->config = c;
	if (!(ctx->error = kvr_calloc(1, sizeof(*ctx->error)))) {
		free(ctx);
		return kvr_fail_config(&c, -ENOMEM, "context: out of memory");
	}
	pthread_mutex_init(&ctx->error->lock, NULL);

	/* The device first: on a separate-memory device (cuda) the pool registers
	 * its pages and summaries with it, so kernels read them in place. */
	const uint32_t kind = dev_kind ? dev_kind
			      : c.backend == KVR_BACKEND_CUDA ? KVR_DEV_CUDA : KVR_DEV_CPU;
	const struct kvr_dev_params dp = { .kind = kind,
					   .threads = c.threads,
					   .parallel_for = c.parallel_for,
					   .parallel_user = c.parallel_user,
					   .alloc_fn = c.device_alloc,
					   .free_fn = c.device_free,
					   .alloc_user = c.device_alloc_user };
	err = kvr_dev_create(&dp, &ctx->dev, message, sizeof(message));
	struct kvr_pool_params pp = {
		.n_layers = c.n_layers,
		.max_sequences = c.max_sequences,
		.layout = c.pool_layout == KVR_POOL_NHD ? KVR_POOL_LAYOUT_NHD : KVR_POOL_LAYOUT_HND,
		.numa_node = c.numa_node,
		.capacity_bytes = c.pool_bytes,
		.keep_summaries = c.estimate ? KVR_POOL_SUMMARIES_ESTIMATES : KVR_POOL_SUMMARIES_BOUNDS,
		.log_fn = pool_log,
		.log_user = ctx,
		.kv_format = c.kv_format,
		.ram_bytes = c.pool_ram_bytes,
		.spill_dir = c.spill_dir[0] ? c.spill_dir : NULL,
		.spill_queue_depth = c.spill_queue_depth,
	};
	if (!err && !kvr_dev_host_visible(ctx->dev)) {
		pp.register_fn = pool_register;
		pp.unregister_fn = pool_unregister;
		pp.register_user = ctx->dev;
	}
	kvr_page_geometry_init(&pp.geometry, c.page_tokens, c.head_dim, c.n_kv_heads, c.dtype);
	if (!err)
		err = kvr_pool_create(&pp, &ctx->pool, message, sizeof(message));
	if (!err) {
		uint64_t fixed, per_seq;
		kvr_config_device_bytes(&c, c.recall, &fixed, &per_seq);
		ctx->device_fixed_bytes = fixed;
		ctx->device_seq_bytes = per_seq;
		ctx->device_used_bytes = fixed;
		const struct kvr_sched_params sp = {
			.config = &c,
			.pool = ctx->pool,
			.dev = ctx->dev,
			.pool_layout = pp.layout,
			.recall = c.recall,
			.hooks = hooks,
			.log_fn = sched_log,
			.log_user = ctx,
		};
		err = kvr_sched_create(&sp, &ctx->sched, message, sizeof(message));
	}
	if (!err) {
		ctx->tile_bytes = (uint64_t)c.page_tokens * c.n_kv_heads * c.head_dim *
				  kvr_dtype_bytes(c.dtype);
		pthread_mutex_init(&ctx->seq_lock, NULL);
		ctx->seqs = kvr_calloc(c.max_sequences, sizeof(*ctx->seqs));
		if (!ctx->seqs) {
			err = -ENOMEM;
			snprintf(message, sizeof(message), "context: out of memory for %u sequences",
				 c.max_sequences);
		}
	}
	if (err) {
		kvr_fail_config(&c, err, "%s", message);
		kvr_context_destroy(ctx);
		return err;
	}
	kvr_log(ctx, KVR_LOG_INFO,
		"context: backend %s, mode %s, recall %s, controller %s, %u layers, %u/%u heads, d=%u, %s, pages %s, p=%u, B=%u "
		"(S=%u, W=%u), tau=%.2f, %u worker threads, NUMA node %d",
		kvr_backend_name(c.backend), kvr_mode_name(c.mode), kvr_recall_name(c.recall), kvr_controller_name(c.controller), c.n_layers, c.n_qo_heads,
		c.n_kv_heads, c.head_dim, kvr_dtype_name(c.dtype), kvr_kv_format_name(c.kv_format), c.page_tokens, c.budget_tokens,
		c.sink_tokens, c.window_tokens, (double)c.tau, c.threads, c.numa_node);
	warn_no_pages(ctx);
	*out = ctx;
	return 0;
}

KVR_API void kvr_context_destroy(struct kvr_context *ctx)
{
	if (!ctx)
		return;
	kvr_decode_teardown(ctx);
	if (ctx->seqs) {
		kvr_sequences_destroy(ctx);
		pthread_mutex_destroy(&ctx->seq_lock);
		free(ctx->seqs);
	}
	kvr_sched_destroy(ctx->sched);
	kvr_trace_destroy(ctx->trace);
	kvr_pool_destroy(ctx->pool); /* it may unregister memory with the device */
	kvr_dev_destroy(ctx->dev);
	if (ctx->error)
		pthread_mutex_destroy(&ctx->error->lock);
	free(ctx->error);
	free(ctx);
}

KVR_API int kvr_context_get_config(const struct kvr_context *ctx, struct kvr_config *cfg)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "context_get_config: ctx is NULL");
	if (!cfg)
		return kvr_fail(ctx, -EINVAL, "context_get_config: cfg is NULL");
	uint32_t size = cfg->size;
	if (size < offsetof(struct kvr_config, n_layers))
		return kvr_fail(ctx, -EINVAL,
				"context_get_config: cfg->size %u is too small (set it with "
				"kvr_config_init)", size);
	if (size > sizeof(*cfg))
		size = sizeof(*cfg);
	memcpy(cfg, &ctx->config, size);
	cfg->size = size;
	return 0;
}
