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
#include "../gpu/gpu.h"
#include "../host/pool.h"
#include "../host/topology.h"
#include "../layouts/page.h"
#include "internal.h"

KVR_STATIC_ASSERT((int)KVR_ELEM_F16 == (int)KVR_DTYPE_F16 &&
			  (int)KVR_ELEM_BF16 == (int)KVR_DTYPE_BF16 &&
			  (int)KVR_ELEM_F32 == (int)KVR_DTYPE_F32,
		  "layouts/ element types mirror enum kvr_dtype");

/* Bytes of device slots max_batch sequences need: budget pages for every sparse
 * layer, every token for dense layers is not bounded by config and is admitted
 * per sequence later. Validation has already ruled out overflow. */
static uint64_t device_slot_bytes(const struct kvr_config *c)
{
	struct kvr_page_geometry g;
	if (kvr_page_geometry_init(&g, c->page_tokens, c->head_dim, c->n_kv_heads, c->dtype))
		return 0;
	return g.page_bytes * (c->budget_tokens / c->page_tokens) * c->n_layers * c->max_batch;
}

/* The pool's warnings (memory not locked) go to the context's log. */
static void pool_log(void *user, int level, const char *message)
{
	kvr_log((const struct kvr_context *)user, (enum kvr_log_level)level, "%s", message);
}

static int resolve(struct kvr_config *c, char *gpu_reason, size_t gpu_reason_bytes)
{
	struct kvr_gpu_probe probe;
	kvr_gpu_probe(&probe);
	snprintf(gpu_reason, gpu_reason_bytes, "%s", probe.reason);

	if (c->backend == KVR_BACKEND_CUDA && probe.n_devices == 0)
		return kvr_fail_config(c, -ENODEV, "backend: cuda requested but no GPU is usable: %s",
				       probe.reason);
	/* The cuda backend's decode runtime is not wired in yet (docs/architecture.md,
	 * "Status"), so auto means cpu even with a GPU present. */
	if (c->backend == KVR_BACKEND_AUTO)
		c->backend = KVR_BACKEND_CPU;
	if (c->backend == KVR_BACKEND_CUDA)
		return kvr_fail_config(c, -ENOTSUP,
				       "backend: the cuda backend's runtime is not implemented in "
				       "this version; use backend cpu");

	/* FreeKV on a GPU; on the cpu backend the same until the decode benchmark
	 * (docs/benchmarks.md) says otherwise. */
	if (c->mode == KVR_MODE_AUTO)
		c->mode = KVR_MODE_FREEKV;

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

	const uint64_t need = device_slot_bytes(c);
	if (c->device_bytes == 0)
		c->device_bytes = need;
	else if (c->device_bytes < need / c->max_batch)
		return kvr_fail_config(c, -ENOMEM,
				       "device_bytes: %llu bytes cannot hold one sequence's page "
				       "cache (%llu bytes for budget_tokens x n_layers)",
				       (unsigned long long)c->device_bytes,
				       (unsigned long long)(need / c->max_batch));
	return 0;
}

KVR_API int kvr_context_create(const struct kvr_config *cfg, struct kvr_context **out)
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

	struct kvr_context *ctx = calloc(1, sizeof(*ctx));
	if (!ctx)
		return kvr_fail_config(&c, -ENOMEM, "context: out of memory");
	err = resolve(&c, ctx->gpu_reason, sizeof(ctx->gpu_reason));
	if (err) {
		free(ctx);
		return err;
	}
	ctx->config = c;
	pthread_mutex_init(&ctx->error_lock, NULL);

	struct kvr_pool_params pp = {
		.n_layers = c.n_layers,
		.max_sequences = c.max_sequences,
		.layout = KVR_POOL_LAYOUT_HND,
		.numa_node = c.numa_node,
		.capacity_bytes = c.pool_bytes,
		.keep_summaries = 1,
		.log_fn = pool_log,
		.log_user = ctx,
	};
	kvr_page_geometry_init(&pp.geometry, c.page_tokens, c.head_dim, c.n_kv_heads, c.dtype);
	err = kvr_pool_create(&pp, &ctx->pool, message, sizeof(message));
	if (!err) {
		/* the cuda backend was refused above: the device is the cpu */
		const struct kvr_dev_params dp = { .kind = KVR_DEV_CPU, .threads = c.threads };
		err = kvr_dev_create(&dp, &ctx->dev, message, sizeof(message));
		if (!err && (err = kvr_dev_stream_create(ctx->dev, 0, &ctx->inline_stream)))
			snprintf(message, sizeof(message), "context: %s", kvr_dev_last_error(ctx->dev));
	}
	if (!err) {
		ctx->tile_bytes = (uint64_t)c.page_tokens * c.n_kv_heads * c.head_dim *
				  kvr_dtype_bytes(c.dtype);
		pthread_mutex_init(&ctx->seq_lock, NULL);
		ctx->seqs = calloc(c.max_sequences, sizeof(*ctx->seqs));
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
		"context: backend %s, mode %s, %u layers, %u/%u heads, d=%u, %s, p=%u, B=%u "
		"(S=%u, W=%u), tau=%.2f, %u worker threads, NUMA node %d",
		kvr_backend_name(c.backend), kvr_mode_name(c.mode), c.n_layers, c.n_qo_heads,
		c.n_kv_heads, c.head_dim, kvr_dtype_name(c.dtype), c.page_tokens, c.budget_tokens,
		c.sink_tokens, c.window_tokens, (double)c.tau, c.threads, c.numa_node);
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
	if (ctx->dev)
		kvr_dev_stream_destroy(ctx->dev, ctx->inline_stream);
	kvr_dev_destroy(ctx->dev);
	kvr_pool_destroy(ctx->pool);
	pthread_mutex_destroy(&ctx->error_lock);
	free(ctx);
}

KVR_API int kvr_context_get_config(const struct kvr_context *ctx, struct kvr_config *cfg)
{
	if (!ctx || !cfg)
		return -EINVAL;
	uint32_t size = cfg->size;
	if (size < offsetof(struct kvr_config, n_layers))
		return -EINVAL;
	if (size > sizeof(*cfg))
		size = sizeof(*cfg);
	memcpy(cfg, &ctx->config, size);
	cfg->size = size;
	return 0;
}
