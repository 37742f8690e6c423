/* SPDX-License-Identifier: MIT */
/*
 * config.c — the context configuration: documented defaults, import of configs
 * from callers built against other header versions, and validation of every
 * field with a message naming the field and its rule.
 *
 * Everything here is pure (no allocation, no machine probing) and thread-safe;
 * facts that need the machine (does NUMA node 3 exist? is there a GPU?) are
 * checked by kvr_context_create. Every rule that needs only the config is
 * here, so kvr_config_validate accepts exactly what creation can accept.
 */
#include <errno.h>
#include <stddef.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "../host/pool.h"
#include "../layouts/kvquant.h"
#include "../scheduler/scheduler.h"
#include "internal.h"

uint32_t kvr_dtype_bytes(uint32_t dtype)
{
	switch (dtype) {
	case KVR_DTYPE_F16:
	case KVR_DTYPE_BF16:
		return 2;
	case KVR_DTYPE_F32:
		return 4;
	default:
		return 0;
	}
}

KVR_API int kvr_config_init(struct kvr_config *cfg)
{
	if (!cfg)
		return kvr_fail(NULL, -EINVAL, "config_init: cfg is NULL");
	memset(cfg, 0, sizeof(*cfg));
	cfg->size = sizeof(*cfg);
	cfg->head_dim = 128;
	cfg->dtype = KVR_DTYPE_F16;
	cfg->page_tokens = 32;
	cfg->budget_tokens = 2048;
	cfg->sink_tokens = KVR_TOKENS_AUTO;
	cfg->window_tokens = KVR_TOKENS_AUTO;
	cfg->tau = 0.9f;
	cfg->mode = KVR_MODE_AUTO;
	cfg->backend = KVR_BACKEND_AUTO;
	cfg->recall_buffers = 2;
	cfg->dense_layers[0] = 1; /* layer 0 */
	cfg->max_sequences = 64;
	cfg->max_batch = 16;
	cfg->numa_node = KVR_NUMA_NODE_AUTO;
	cfg->threads = KVR_THREADS_AUTO;
	cfg->recall_chunk_pages = 8;
	cfg->log_level = KVR_LOG_WARN;
	return 0;
}

/* The sink and window a config leaves to the library (KVR_TOKENS_AUTO):
 * min(512, budget_tokens / 4), rounded down to whole pages, each. A quarter
 * of B each leaves at least half of it to the selected pages, so the sparse
 * modes always select some (k >= 1). Pure: validation, the device-bytes
 * estimate and context creation all see the same values. A page_tokens of
 * 0 leaves them unresolved (validation then names page_tokens). */
void kvr_config_resolve_tokens(struct kvr_config *c)
{
	const uint32_t p = c->page_tokens;
	if (!p)
		return;
	const uint32_t quarter = c->budget_tokens / 4 < 512 ? c->budget_tokens / 4 : 512;
	if (c->sink_tokens == KVR_TOKENS_AUTO)
		c->sink_tokens = quarter / p * p;
	if (c->window_tokens == KVR_TOKENS_AUTO)
		c->window_tokens = quarter / p * p;
}

/* Device bytes of one admitted sequence (tail tiles of every layer plus its
 * page cache) and the context's fixed share (staging). */
void kvr_config_device_bytes(const struct kvr_config *c, uint32_t recall, uint64_t *fixed,
			     uint64_t *per_seq)
{
	const uint64_t tile = (uint64_t)c->page_tokens * c->n_kv_heads * c->head_dim *
			      kvr_dtype_bytes(c->dtype);
	*fixed = kvr_sched_fixed_device_bytes(c, recall);
	*per_seq = kvr_sched_seq_device_bytes(c, recall);
	if (c->backend != KVR_BACKEND_CUDA) {
		*per_seq += 2 * tile * c->n_layers;
	} else {
		/* the tail tiles are pinned host memory (gpu/memory.h); each
		 * sparse layer keeps its sink and window pages on the device
		 * (resident.c). A dense layer's resident pages grow with the
		 * sequence and are not budgeted in this version. */
		uint32_t sparse = 0;
		for (uint32_t l = 0; l < c->n_layers; l++)
			sparse += !(c->dense_layers[l / 64] >> (l % 64) & 1);
		if (c->mode != KVR_MODE_DENSE)
			*per_seq += sparse * kvr_resident_lane_bytes(c);
	}
}

/* The recall kind AUTO means for a configuration. On the cpu backend
 * zero-copy: attention reads the pool in place, so copying pages only costs
 * bandwidth. On cuda streamed where the device plan covers it (plain pages
 * of an HND pool, a sparse mode): on an H100 with the device plan
 * (docs/benchmarks.md, "The GPU path": 2026-11-26) streamed recall took less
 * time than zero-copy in every sparse row, 8K-32K, batch 1 and 8, since
 * attention then reads slots in device memory instead of pages over PCIe
 * and only misses move. Quantised pages stay zero-copy there: with
 * streamed recall their slots keep the host's planning, which waits on the
 * device per layer, as does a k (selected pages per KV head) outside what
 * the device plan takes (kvr_sched_k_plannable). A spill tier needs
 * streamed (a page in the file cannot be read in place). `backend` AUTO is
 * the cpu backend (context.c). */
uint32_t kvr_config_recall(const struct kvr_config *c)
{
	if (c->recall != KVR_RECALL_AUTO)
		return c->recall;
	if (c->pool_ram_bytes)
		return KVR_RECALL_STREAMED;
	if (c->backend == KVR_BACKEND_CUDA && c->kv_format == KVR_KV_FORMAT_PLAIN &&
	    c->pool_layout == KVR_POOL_HND && c->mode != KVR_MODE_DENSE && kvr_sched_k_plannable(c))
		return KVR_RECALL_STREAMED;
	return KVR_RECALL_ZERO_COPY;
}

/* snprintf into an optional buffer; returns err so callers can `return say(...)`. */
static int __attribute__((format(printf, 4, 5)))
say(char *message, size_t message_bytes, int err, const char *fmt, ...)
{
	if (message && message_bytes) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(message, message_bytes, fmt, ap);
		va_end(ap);
	}
	return err;
}

int kvr_config_import(const struct kvr_config *in, struct kvr_config *out, char *message,
		      size_t message_bytes)
{
	/* The first version of the struct (0.1, up to log_user) is the smallest
	 * one accepted; later fields of an older caller take their defaults. */
	const size_t min_size = offsetof(struct kvr_config, recall);

	if (!in)
		return say(message, message_bytes, -EINVAL, "config: is NULL");
	if (in->size < min_size)
		return say(message, message_bytes, -EINVAL,
			   "size: must be sizeof(struct kvr_config) = %zu as set by kvr_config_init() "
			   "(got %u: config not initialised?)",
			   sizeof(struct kvr_config), in->size);
	if (in->size > sizeof(struct kvr_config) + KVR_CONFIG_MAX_GROWTH)
		return say(message, message_bytes, -EINVAL,
			   "size: %u bytes is not the size of any kvr_config (this library's is %zu; "
			   "a newer one may add at most %u bytes): config not initialised?",
			   in->size, sizeof(struct kvr_config), KVR_CONFIG_MAX_GROWTH);
	if (in->size > sizeof(struct kvr_config)) {
		/* A newer caller: fine as long as it sets none of the fields we lack
		 * (the bound above keeps the scan inside what a real struct can be). */
		const unsigned char *extra = (const unsigned char *)in + sizeof(struct kvr_config);
		for (size_t i = 0; i < in->size - sizeof(struct kvr_config); i++)
			if (extra[i])
				return say(message, message_bytes, -EINVAL,
					   "size: config of %u bytes is from a newer kvrecall and sets "
					   "fields this library (%zu bytes) does not know",
					   in->size, sizeof(struct kvr_config));
	}
	kvr_config_init(out);
	memcpy(out, in, in->size < sizeof(*out) ? in->size : sizeof(*out));
	out->size = sizeof(*out);
	return 0;
}

static bool is_power_of_two(uint32_t x)
{
	return x && !(x & (x - 1));
}

/* a *= b, false on 64-bit overflow. */
static bool mul_ok(uint64_t *a, uint64_t b)
{
	return !__builtin_mul_overflow(*a, b, a);
}

static int validate(const struct kvr_config *in, char *m, size_t mb)
{
	/* the rules below hold for the sink and window the context would use */
	struct kvr_config resolved = *in;
	kvr_config_resolve_tokens(&resolved);
	const struct kvr_config *c = &resolved;

	/* Shape. */
	if (c->n_layers == 0)
		return say(m, mb, -EINVAL, "n_layers: must be at least 1 (got 0)");
	if (c->n_layers > KVR_MAX_LAYERS)
		return say(m, mb, -EINVAL, "n_layers: must be at most %u (got %u)", KVR_MAX_LAYERS,
			   c->n_layers);
	if (c->n_kv_heads == 0)
		return say(m, mb, -EINVAL, "n_kv_heads: must be at least 1 (got 0)");
	if (c->n_kv_heads > KVR_MAX_KV_HEADS)
		return say(m, mb, -EINVAL, "n_kv_heads: must be at most %u (got %u)",
			   KVR_MAX_KV_HEADS, c->n_kv_heads);
	if (c->n_qo_heads == 0)
		return say(m, mb, -EINVAL, "n_qo_heads: must be at least 1 (got 0)");
	if (c->n_qo_heads % c->n_kv_heads)
		return say(m, mb, -EINVAL,
			   "n_qo_heads: must be a multiple of n_kv_heads (got %u query heads for %u "
			   "KV heads)",
			   c->n_qo_heads, c->n_kv_heads);
	if (c->n_qo_heads / c->n_kv_heads > KVR_MAX_GROUP)
		return say(m, mb, -ENOTSUP,
			   "n_qo_heads: group size n_qo_heads / n_kv_heads must be at most %u (got %u)",
			   KVR_MAX_GROUP, c->n_qo_heads / c->n_kv_heads);
	if (c->head_dim == 0)
		return say(m, mb, -EINVAL, "head_dim: must be at least 1 (got 0)");
	if (c->head_dim % 32 || c->head_dim > 256)
		return say(m, mb, -ENOTSUP,
			   "head_dim: unsupported (got %u); supported: multiples of 32 from 32 to 256",
			   c->head_dim);
	if (kvr_dtype_bytes(c->dtype) == 0)
		return say(m, mb, -ENOTSUP,
			   "dtype: unsupported (got %u); supported: f16 (%d), bf16 (%d), f32 (%d)",
			   c->dtype, KVR_DTYPE_F16, KVR_DTYPE_BF16, KVR_DTYPE_F32);

	/* Paging and selection. */
	const uint32_t p = c->page_tokens;
	if (!is_power_of_two(p) || p < 8 || p > 256)
		return say(m, mb, -EINVAL,
			   "page_tokens: must be a power of two from 8 to 256 (got %u)", p);
	if (c->sink_tokens % p)
		return say(m, mb, -EINVAL,
			   "sink_tokens: must be a multiple of page_tokens %u (got %u)", p,
			   c->sink_tokens);
	if (c->window_tokens % p)
		return say(m, mb, -EINVAL,
			   "window_tokens: must be a multiple of page_tokens %u (got %u)", p,
			   c->window_tokens);
	if (c->budget_tokens == 0)
		return say(m, mb, -EINVAL, "budget_tokens: must be at least page_tokens (got 0)");
	if (c->budget_tokens % p)
		return say(m, mb, -EINVAL,
			   "budget_tokens: must be a multiple of page_tokens %u (got %u)", p,
			   c->budget_tokens);
	if ((uint64_t)c->budget_tokens < (uint64_t)c->sink_tokens + c->window_tokens)
		return say(m, mb, -EINVAL,
			   "budget_tokens: must be at least sink_tokens + window_tokens = %llu (got %u)%s",
			   (unsigned long long)c->sink_tokens + c->window_tokens, c->budget_tokens,
			   in->sink_tokens == KVR_TOKENS_AUTO || in->window_tokens == KVR_TOKENS_AUTO
				   ? " (KVR_TOKENS_AUTO is min(512, budget_tokens / 4) in whole pages)"
				   : "");
	if (!(c->tau >= -1.0f && c->tau <= 1.0f)) /* also rejects NaN */
		return say(m, mb, -EINVAL, "tau: must be in [-1, 1] (got %g)", (double)c->tau);
	if (c->mode > KVR_MODE_FREEKV)
		return say(m, mb, -EINVAL,
			   "mode: unknown (got %u); known: auto, dense, blocking, speculative, freekv",
			   c->mode);
	if (c->backend > KVR_BACKEND_CUDA)
		return say(m, mb, -EINVAL, "backend: unknown (got %u); known: auto, cpu, cuda",
			   c->backend);
	if (c->recall_buffers < 1 || c->recall_buffers > 2)
		return say(m, mb, -EINVAL,
			   "recall_buffers: must be 1 (single buffer) or 2 (double buffer) (got %u)",
			   c->recall_buffers);
	for (uint32_t l = c->n_layers; l < KVR_MAX_LAYERS; l++)
		if (c->dense_layers[l / 64] >> (l % 64) & 1)
			return say(m, mb, -EINVAL,
				   "dense_layers: layer %u is marked dense but n_layers is %u", l,
				   c->n_layers);

	/* Capacity. */
	if (c->max_sequences == 0)
		return say(m, mb, -EINVAL, "max_sequences: must be at least 1 (got 0)");
	if (c->max_batch == 0)
		return say(m, mb, -EINVAL, "max_batch: must be at least 1 (got 0)");
	if (c->max_batch > c->max_sequences)
		return say(m, mb, -EINVAL,
			   "max_batch: must be at most max_sequences %u (got %u)", c->max_sequences,
			   c->max_batch);
	if (c->recall_chunk_pages == 0)
		return say(m, mb, -EINVAL, "recall_chunk_pages: must be at least 1 (got 0)");
	if (c->recall_chunk_pages > 4096)
		return say(m, mb, -EINVAL, "recall_chunk_pages: must be at most 4096 (got %u)",
			   c->recall_chunk_pages);
	if (c->numa_node < KVR_NUMA_NODE_AUTO)
		return say(m, mb, -EINVAL,
			   "numa_node: must be a node id >= 0 or KVR_NUMA_NODE_AUTO (-1) (got %d)",
			   c->numa_node);
	if (c->threads != KVR_THREADS_AUTO && c->threads > 1024)
		return say(m, mb, -EINVAL,
			   "threads: must be at most 1024 or KVR_THREADS_AUTO (got %u)", c->threads);
	if (c->recall > KVR_RECALL_STREAMED)
		return say(m, mb, -EINVAL,
			   "recall: must be 0 (auto), 1 (zero-copy) or 2 (streamed) (got %u)", c->recall);
	if (c->controller > KVR_CONTROLLER_INLINE)
		return say(m, mb, -EINVAL,
			   "controller: must be 0 (auto), 1 (thread) or 2 (inline) (got %u)",
			   c->controller);
	if (c->pool_layout > KVR_POOL_NHD)
		return say(m, mb, -EINVAL, "pool_layout: must be 0 (HND) or 1 (NHD) (got %u)",
			   c->pool_layout);
	if (c->kv_format > KVR_KV_FORMAT_MIXED)
		return say(m, mb, -EINVAL,
			   "kv_format: must be 0 (plain), 1 (k8v4), 2 (k4v2) or 3 (mixed) (got %u)",
			   c->kv_format);
	if (c->kv_format != KVR_KV_FORMAT_PLAIN && c->pool_layout != KVR_POOL_HND)
		return say(m, mb, -EINVAL,
			   "kv_format: quantised pages (%s) need pool_layout HND (0): a quantised "
			   "KV head is one run with its scales (got pool_layout %u)",
			   kvr_kv_format_name(c->kv_format), c->pool_layout);
	if (c->spill_queue_depth > 4096)
		return say(m, mb, -EINVAL, "spill_queue_depth: must be at most 4096 (got %u)",
			   c->spill_queue_depth);
	if (c->spill_reserved)
		return say(m, mb, -EINVAL, "spill_reserved: must be 0 (got %u)", c->spill_reserved);
	if (c->estimate > 1)
		return say(m, mb, -EINVAL, "estimate: must be 0 (off) or 1 (on) (got %u)", c->estimate);
	if (c->estimate_reserved)
		return say(m, mb, -EINVAL, "estimate_reserved: must be 0 (got %u)", c->estimate_reserved);
	if (c->estimate && c->kv_format == KVR_KV_FORMAT_MIXED)
		return say(m, mb, -ENOTSUP,
			   "estimate: not with kv_format mixed (3): mixed pages rank pages by the "
			   "attention share of their segments, which the estimate's segments would "
			   "join; use plain, k8v4 or k4v2 pages");
	if (!memchr(c->spill_dir, '\0', sizeof(c->spill_dir)))
		return say(m, mb, -EINVAL, "spill_dir: must be NUL-terminated within %zu bytes",
			   sizeof(c->spill_dir));
	if (c->pool_ram_bytes && c->pool_layout != KVR_POOL_HND)
		return say(m, mb, -EINVAL,
			   "pool_ram_bytes: the spill tier reads pages run by run: it needs pool_layout "
			   "HND (0) (got %u)",
			   c->pool_layout);
	if (c->pool_ram_bytes && c->recall == KVR_RECALL_ZERO_COPY)
		return say(m, mb, -EINVAL,
			   "pool_ram_bytes: zero-copy recall reads pool pages in place, which a page in "
			   "the spill file cannot serve: use recall streamed (2) or auto (0)");
	if (!c->device_alloc != !c->device_free)
		return say(m, mb, -EINVAL,
			   "device_alloc: device_alloc and device_free must be set together");
	if (c->log_level > KVR_LOG_DEBUG)
		return say(m, mb, -EINVAL, "log_level: must be 0 (error) to 3 (debug) (got %u)",
			   c->log_level);

	/* Byte sizes: everything derived later from these fields must fit 64 bits. */
	uint64_t page_bytes = 2;
	if (!mul_ok(&page_bytes, p) || !mul_ok(&page_bytes, c->head_dim) ||
	    !mul_ok(&page_bytes, kvr_dtype_bytes(c->dtype)) || !mul_ok(&page_bytes, c->n_kv_heads))
		return say(m, mb, -EOVERFLOW, "page_tokens: page size overflows 64 bits");
	uint64_t cache_bytes = page_bytes;
	if (!mul_ok(&cache_bytes, c->budget_tokens / p) || !mul_ok(&cache_bytes, c->n_layers) ||
	    !mul_ok(&cache_bytes, c->max_batch))
		return say(m, mb, -EOVERFLOW,
			   "budget_tokens: device cache size max_batch x n_layers x budget_tokens x "
			   "n_kv_heads x head_dim x 2 x element bytes overflows 64 bits");
	/* The pool is carved from 2 MiB chunks: rounding up must not wrap. */
	if (c->pool_bytes > UINT64_MAX - (2u << 20))
		return say(m, mb, -EOVERFLOW,
			   "pool_bytes: %llu overflows when rounded up to whole 2 MiB chunks",
			   (unsigned long long)c->pool_bytes);
	if (c->pool_bytes && c->pool_bytes < page_bytes * c->n_layers)
		return say(m, mb, -EINVAL,
			   "pool_bytes: must be 0 (auto) or at least one page per layer = %llu bytes "
			   "(got %llu)",
			   (unsigned long long)(page_bytes * c->n_layers),
			   (unsigned long long)c->pool_bytes);
	if (c->device_bytes > UINT64_MAX - (2u << 20))
		return say(m, mb, -EOVERFLOW,
			   "device_bytes: %llu overflows when rounded up to whole 2 MiB chunks",
			   (unsigned long long)c->device_bytes);
	if (c->device_bytes) {
		uint64_t fixed, per_seq;
		kvr_config_device_bytes(c, kvr_config_recall(c), &fixed, &per_seq);
		if (c->device_bytes < fixed + per_seq)
			return say(m, mb, -ENOMEM,
				   "device_bytes: %llu bytes cannot hold one sequence: %llu bytes of "
				   "staging plus %llu per sequence (tail pages and, streamed, the page "
				   "cache of k slots per KV head and sparse layer)",
				   (unsigned long long)c->device_bytes, (unsigned long long)fixed,
				   (unsigned long long)per_seq);
	}
	/* the spill tier (RAM below the pool's capacity) needs a few frames */
	const uint64_t pool_page = (uint64_t)c->n_kv_heads *
				   kvr_kv_run_bytes(c->kv_format, p, c->head_dim, kvr_dtype_bytes(c->dtype));
	const int spills = c->pool_ram_bytes && pool_page &&
			   (!c->pool_bytes || c->pool_ram_bytes / pool_page < c->pool_bytes / pool_page);
	if (spills && c->pool_ram_bytes / pool_page < KVR_POOL_MIN_FRAMES)
		return say(m, mb, -EINVAL,
			   "pool_ram_bytes: %llu bytes hold %llu pages of %llu bytes; the spill tier "
			   "needs RAM for at least %u (or 0: no spill tier)",
			   (unsigned long long)c->pool_ram_bytes,
			   (unsigned long long)(c->pool_ram_bytes / pool_page),
			   (unsigned long long)pool_page, KVR_POOL_MIN_FRAMES);
	return 0;
}

KVR_API int kvr_config_validate(const struct kvr_config *cfg, char *message, size_t message_bytes)
{
	/* the reason goes to `message` and, like every call without a context's,
	 * to kvr_last_error(NULL) */
	struct kvr_config c;
	char why[KVR_ERROR_MESSAGE_BYTES] = "";
	int err = kvr_config_import(cfg, &c, why, sizeof(why));
	if (!err)
		err = validate(&c, why, sizeof(why));
	if (err)
		kvr_fail(NULL, err, "%s", why);
	if (message && message_bytes)
		snprintf(message, message_bytes, "%s", err ? why : "");
	return err;
}

/* The enums' names: names[v], or "?" for a value without one. */
#define NAMES_LEN(names) (sizeof(names) / sizeof((names)[0]))
static const char *name_in(const char *const *names, size_t n, uint32_t v)
{
	return v < n && names[v] ? names[v] : "?";
}

static const char *const mode_names[] = {
	[KVR_MODE_AUTO] = "auto",
	[KVR_MODE_DENSE] = "dense",
	[KVR_MODE_BLOCKING] = "blocking",
	[KVR_MODE_SPECULATIVE] = "speculative",
	[KVR_MODE_FREEKV] = "freekv",
};

KVR_API const char *kvr_mode_name(uint32_t mode)
{
	return name_in(mode_names, NAMES_LEN(mode_names), mode);
}

KVR_API int kvr_mode_parse(const char *name, uint32_t *mode)
{
	if (!name || !mode)
		return kvr_fail(NULL, -EINVAL, "mode_parse: %s is NULL", name ? "mode" : "name");
	for (uint32_t i = 0; i < sizeof(mode_names) / sizeof(mode_names[0]); i++)
		if (!strcmp(name, mode_names[i])) {
			*mode = i;
			return 0;
		}
	return kvr_fail(NULL, -EINVAL,
			"mode_parse: \"%.64s\" is not a mode (auto, dense, blocking, speculative, freekv)",
			name);
}

static const char *const dtype_names[] = {
	[KVR_DTYPE_F16] = "f16",
	[KVR_DTYPE_BF16] = "bf16",
	[KVR_DTYPE_F32] = "f32",
};

KVR_API const char *kvr_dtype_name(uint32_t dtype)
{
	return name_in(dtype_names, NAMES_LEN(dtype_names), dtype);
}

static const char *const recall_names[] = {
	[KVR_RECALL_AUTO] = "auto",
	[KVR_RECALL_ZERO_COPY] = "zero-copy",
	[KVR_RECALL_STREAMED] = "streamed",
};

KVR_API const char *kvr_recall_name(uint32_t recall)
{
	return name_in(recall_names, NAMES_LEN(recall_names), recall);
}

static const char *const controller_names[] = {
	[KVR_CONTROLLER_AUTO] = "auto",
	[KVR_CONTROLLER_THREAD] = "thread",
	[KVR_CONTROLLER_INLINE] = "inline",
};

KVR_API const char *kvr_controller_name(uint32_t controller)
{
	return name_in(controller_names, NAMES_LEN(controller_names), controller);
}

static const char *const kv_format_names[] = {
	[KVR_KV_FORMAT_PLAIN] = "plain",
	[KVR_KV_FORMAT_K8V4] = "k8v4",
	[KVR_KV_FORMAT_K4V2] = "k4v2",
	[KVR_KV_FORMAT_MIXED] = "mixed",
};

KVR_API const char *kvr_kv_format_name(uint32_t kv_format)
{
	return name_in(kv_format_names, NAMES_LEN(kv_format_names), kv_format);
}

KVR_API int kvr_kv_format_parse(const char *name, uint32_t *kv_format)
{
	if (!name || !kv_format)
		return kvr_fail(NULL, -EINVAL, "kv_format_parse: %s is NULL", name ? "kv_format" : "name");
	if (!strcmp(name, "f16") || !strcmp(name, "bf16") || !strcmp(name, "f32")) {
		*kv_format = KVR_KV_FORMAT_PLAIN;
		return 0;
	}
	for (uint32_t i = 0; i < sizeof(kv_format_names) / sizeof(kv_format_names[0]); i++)
		if (!strcmp(name, kv_format_names[i])) {
			*kv_format = i;
			return 0;
		}
	return kvr_fail(NULL, -EINVAL,
			"kv_format_parse: \"%.64s\" is not a page format (plain, f16, bf16, f32, k8v4, "
			"k4v2, mixed)",
			name);
}

static const char *const backend_names[] = {
	[KVR_BACKEND_AUTO] = "auto",
	[KVR_BACKEND_CPU] = "cpu",
	[KVR_BACKEND_CUDA] = "cuda",
};

KVR_API const char *kvr_backend_name(uint32_t backend)
{
	return name_in(backend_names, NAMES_LEN(backend_names), backend);
}
