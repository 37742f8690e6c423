/* SPDX-License-Identifier: MIT */
/*
 * test_config.c — config defaults and validation: every invalid field is
 * rejected with its own error code and a message naming the field and the rule;
 * the boundary values just inside each rule are accepted.
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <errno.h>
#include <stddef.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kvrecall.h"

/* A valid base: Llama-3.1-8B-like shapes with the documented defaults. */
static struct kvr_config base(void)
{
	struct kvr_config c;
	cr_assert_eq(kvr_config_init(&c), 0);
	c.n_layers = 32;
	c.n_qo_heads = 32;
	c.n_kv_heads = 8;
	return c;
}

Test(config, defaults_are_documented_values)
{
	struct kvr_config c;
	memset(&c, 0xab, sizeof(c));
	cr_assert_eq(kvr_config_init(&c), 0);
	cr_expect_eq(c.size, sizeof(c));
	cr_expect_eq(c.head_dim, 128);
	cr_expect_eq(c.dtype, KVR_DTYPE_F16);
	cr_expect_eq(c.page_tokens, 32);
	cr_expect_eq(c.budget_tokens, 2048);
	cr_expect_eq(c.sink_tokens, KVR_TOKENS_AUTO);
	cr_expect_eq(c.window_tokens, KVR_TOKENS_AUTO);
	cr_expect_float_eq(c.tau, 0.9f, 1e-7);
	cr_expect_eq(c.mode, KVR_MODE_AUTO);
	cr_expect_eq(c.backend, KVR_BACKEND_AUTO);
	cr_expect_eq(c.recall_buffers, 2);
	cr_expect_eq(c.dense_layers[0], 1u);
	cr_expect_eq(c.dense_layers[1] | c.dense_layers[2] | c.dense_layers[3], 0u);
	cr_expect_eq(c.max_sequences, 64);
	cr_expect_eq(c.max_batch, 16);
	cr_expect_eq(c.pool_bytes, 0);
	cr_expect_eq(c.device_bytes, 0);
	cr_expect_eq(c.numa_node, KVR_NUMA_NODE_AUTO);
	cr_expect_eq(c.threads, KVR_THREADS_AUTO);
	cr_expect_eq(c.recall_chunk_pages, 8);
	cr_expect_eq(c.log_level, KVR_LOG_WARN);
	cr_expect_null(c.log_fn);
	/* Shape has no default: the initialised config alone is not valid. */
	char msg[256];
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), -EINVAL);
	cr_expect(strstr(msg, "n_layers") != NULL, "message: %s", msg);
	cr_expect_eq(kvr_config_init(NULL), -EINVAL);
}

Test(config, base_is_valid_and_clears_message)
{
	struct kvr_config c = base();
	char msg[64] = "stale";
	cr_assert_eq(kvr_config_validate(&c, msg, sizeof(msg)), 0, "%s", msg);
	cr_expect_str_empty(msg);
	cr_expect_eq(kvr_config_validate(&c, NULL, 0), 0);
}

/* ---- one row per rule: mutate a valid config, expect code + words ---- */

struct bad_case {
	const char *name;
	void (*mutate)(struct kvr_config *c);
	int err;
	const char *field; /* must appear in the message */
	const char *rule;  /* must appear in the message too */
};

#define MUT(fn, body) \
	static void fn(struct kvr_config *c) { body; }

MUT(size_zero, c->size = 0)
MUT(size_short, c->size = offsetof(struct kvr_config, recall) - 8) /* below 0.1 */
MUT(layers_zero, c->n_layers = 0)
MUT(layers_many, c->n_layers = KVR_MAX_LAYERS + 1)
MUT(kv_zero, c->n_kv_heads = 0)
MUT(kv_many, c->n_kv_heads = KVR_MAX_KV_HEADS + 1; c->n_qo_heads = 2 * c->n_kv_heads)
MUT(qo_zero, c->n_qo_heads = 0)
MUT(qo_not_multiple, c->n_qo_heads = 10; c->n_kv_heads = 3)
MUT(group_too_big, c->n_qo_heads = 65; c->n_kv_heads = 1)
MUT(dim_zero, c->head_dim = 0)
MUT(dim_odd, c->head_dim = 72)
MUT(dim_big, c->head_dim = 288)
MUT(dtype_bad, c->dtype = 9)
MUT(page_not_pow2, c->page_tokens = 48)
MUT(page_small, c->page_tokens = 4; c->sink_tokens = 0; c->window_tokens = 0;
    c->budget_tokens = 64)
MUT(page_big, c->page_tokens = 512; c->sink_tokens = 0; c->window_tokens = 0;
    c->budget_tokens = 1024)
MUT(page_zero, c->page_tokens = 0)
MUT(sink_not_multiple, c->sink_tokens = 100)
MUT(window_not_multiple, c->window_tokens = 33)
MUT(budget_zero, c->budget_tokens = 0)
MUT(budget_not_multiple, c->budget_tokens = 2050)
MUT(budget_below_sink_window, c->budget_tokens = 1024; c->window_tokens = 1024)
/* an explicit sink beside an automatic window (min(512, B/4) = 256) */
MUT(budget_below_auto_window, c->budget_tokens = 1024; c->sink_tokens = 960)
MUT(tau_high, c->tau = 1.5f)
MUT(tau_low, c->tau = -1.01f)
MUT(tau_nan, c->tau = NAN)
MUT(mode_bad, c->mode = 9)
MUT(backend_bad, c->backend = 7)
MUT(buffers_zero, c->recall_buffers = 0)
MUT(buffers_three, c->recall_buffers = 3)
MUT(dense_beyond_layers, c->dense_layers[0] |= 1ull << 40)
MUT(dense_far_beyond, c->n_layers = 100; c->dense_layers[3] = 1)
MUT(seqs_zero, c->max_sequences = 0)
MUT(batch_zero, c->max_batch = 0)
MUT(batch_over_seqs, c->max_sequences = 4; c->max_batch = 5)
MUT(chunk_zero, c->recall_chunk_pages = 0)
MUT(chunk_many, c->recall_chunk_pages = 5000)
MUT(numa_negative, c->numa_node = -2)
MUT(threads_many, c->threads = 5000)
MUT(log_level_bad, c->log_level = 4)
MUT(recall_bad, c->recall = 3)
MUT(pool_layout_bad, c->pool_layout = 2)
MUT(controller_bad, c->controller = 3)
MUT(kv_format_bad, c->kv_format = 4)
MUT(kv_format_nhd, c->kv_format = KVR_KV_FORMAT_K8V4; c->pool_layout = KVR_POOL_NHD)
MUT(cache_overflow, c->budget_tokens = 0x7fffffe0u; c->max_sequences = 1u << 20;
    c->max_batch = 1u << 20; c->n_layers = 256; c->n_kv_heads = 256; c->n_qo_heads = 256;
    c->head_dim = 256; c->dtype = KVR_DTYPE_F32)
MUT(pool_overflow, c->pool_bytes = UINT64_MAX)
MUT(pool_too_small, c->pool_bytes = 4096)
MUT(device_overflow, c->device_bytes = UINT64_MAX - 1)

static const struct bad_case bad_cases[] = {
	{ "size_zero", size_zero, -EINVAL, "size", "kvr_config_init" },
	{ "size_short", size_short, -EINVAL, "size", "sizeof(struct kvr_config)" },
	{ "layers_zero", layers_zero, -EINVAL, "n_layers", "at least 1" },
	{ "layers_many", layers_many, -EINVAL, "n_layers", "at most 256" },
	{ "kv_zero", kv_zero, -EINVAL, "n_kv_heads", "at least 1" },
	{ "kv_many", kv_many, -EINVAL, "n_kv_heads", "at most 256" },
	{ "qo_zero", qo_zero, -EINVAL, "n_qo_heads", "at least 1" },
	{ "qo_not_multiple", qo_not_multiple, -EINVAL, "n_qo_heads", "multiple of n_kv_heads" },
	{ "group_too_big", group_too_big, -ENOTSUP, "n_qo_heads", "group size" },
	{ "dim_zero", dim_zero, -EINVAL, "head_dim", "at least 1" },
	{ "dim_odd", dim_odd, -ENOTSUP, "head_dim", "multiples of 32" },
	{ "dim_big", dim_big, -ENOTSUP, "head_dim", "to 256" },
	{ "dtype_bad", dtype_bad, -ENOTSUP, "dtype", "f16" },
	{ "page_not_pow2", page_not_pow2, -EINVAL, "page_tokens", "power of two from 8 to 256" },
	{ "page_small", page_small, -EINVAL, "page_tokens", "power of two from 8 to 256" },
	{ "page_big", page_big, -EINVAL, "page_tokens", "power of two from 8 to 256" },
	{ "page_zero", page_zero, -EINVAL, "page_tokens", "power of two" },
	{ "sink_not_multiple", sink_not_multiple, -EINVAL, "sink_tokens", "multiple of page_tokens" },
	{ "window_not_multiple", window_not_multiple, -EINVAL, "window_tokens",
	  "multiple of page_tokens" },
	{ "budget_zero", budget_zero, -EINVAL, "budget_tokens", "at least page_tokens" },
	{ "budget_not_multiple", budget_not_multiple, -EINVAL, "budget_tokens",
	  "multiple of page_tokens" },
	{ "budget_below_sink_window", budget_below_sink_window, -EINVAL, "budget_tokens",
	  "sink_tokens + window_tokens" },
	{ "budget_below_auto_window", budget_below_auto_window, -EINVAL, "budget_tokens",
	  "KVR_TOKENS_AUTO is min(512, budget_tokens / 4)" },
	{ "tau_high", tau_high, -EINVAL, "tau", "[-1, 1]" },
	{ "tau_low", tau_low, -EINVAL, "tau", "[-1, 1]" },
	{ "tau_nan", tau_nan, -EINVAL, "tau", "[-1, 1]" },
	{ "mode_bad", mode_bad, -EINVAL, "mode", "freekv" },
	{ "backend_bad", backend_bad, -EINVAL, "backend", "cuda" },
	{ "buffers_zero", buffers_zero, -EINVAL, "recall_buffers", "1 (single buffer) or 2" },
	{ "buffers_three", buffers_three, -EINVAL, "recall_buffers", "1 (single buffer) or 2" },
	{ "dense_beyond_layers", dense_beyond_layers, -EINVAL, "dense_layers", "layer 40" },
	{ "dense_far_beyond", dense_far_beyond, -EINVAL, "dense_layers", "layer 192" },
	{ "seqs_zero", seqs_zero, -EINVAL, "max_sequences", "at least 1" },
	{ "batch_zero", batch_zero, -EINVAL, "max_batch", "at least 1" },
	{ "batch_over_seqs", batch_over_seqs, -EINVAL, "max_batch", "at most max_sequences" },
	{ "chunk_zero", chunk_zero, -EINVAL, "recall_chunk_pages", "at least 1" },
	{ "chunk_many", chunk_many, -EINVAL, "recall_chunk_pages", "at most 4096" },
	{ "numa_negative", numa_negative, -EINVAL, "numa_node", "KVR_NUMA_NODE_AUTO" },
	{ "threads_many", threads_many, -EINVAL, "threads", "at most 1024" },
	{ "log_level_bad", log_level_bad, -EINVAL, "log_level", "debug" },
	{ "recall_bad", recall_bad, -EINVAL, "recall", "streamed" },
	{ "pool_layout_bad", pool_layout_bad, -EINVAL, "pool_layout", "NHD" },
	{ "controller_bad", controller_bad, -EINVAL, "controller", "2 (inline)" },
	{ "kv_format_bad", kv_format_bad, -EINVAL, "kv_format", "2 (k4v2)" },
	{ "kv_format_nhd", kv_format_nhd, -EINVAL, "kv_format", "pool_layout HND" },
	{ "cache_overflow", cache_overflow, -EOVERFLOW, "budget_tokens", "overflows 64 bits" },
	{ "pool_overflow", pool_overflow, -EOVERFLOW, "pool_bytes", "overflows" },
	{ "pool_too_small", pool_too_small, -EINVAL, "pool_bytes", "one page per layer" },
	{ "device_overflow", device_overflow, -EOVERFLOW, "device_bytes", "overflows" },
};

#define N_BAD_CASES (sizeof(bad_cases) / sizeof(bad_cases[0]))

/* Criterion re-executes the test binary for each test, so parameters must not
 * hold pointers (the child's addresses differ): pass the row's index. */
ParameterizedTestParameters(config, invalid_field_rejected)
{
	static size_t rows[N_BAD_CASES];
	for (size_t i = 0; i < N_BAD_CASES; i++)
		rows[i] = i;
	return cr_make_param_array(size_t, rows, N_BAD_CASES);
}

ParameterizedTest(size_t *row, config, invalid_field_rejected)
{
	const struct bad_case *bc = &bad_cases[*row];
	struct kvr_config c = base();
	bc->mutate(&c);
	char msg[512];
	int err = kvr_config_validate(&c, msg, sizeof(msg));
	cr_assert_eq(err, bc->err, "%s: got %d (%s), want %d; message: %s", bc->name, err,
		     kvr_strerror(err), bc->err, msg);
	/* The message starts with the field at fault and states the rule. */
	cr_expect_eq(strncmp(msg, bc->field, strlen(bc->field)), 0, "%s: message '%s' should "
		     "start with '%s'", bc->name, msg, bc->field);
	cr_expect(strstr(msg, bc->rule) != NULL, "%s: message '%s' lacks '%s'", bc->name, msg,
		  bc->rule);

	/* Creating a context from it fails the same way and leaves nothing behind. */
	struct kvr_context *ctx = (struct kvr_context *)0x1;
	cr_expect_eq(kvr_context_create(&c, &ctx), bc->err, "%s", bc->name);
	cr_expect_eq(ctx, (struct kvr_context *)0x1, "out-parameter written on failure");
	cr_expect_str_eq(kvr_last_error(NULL), msg);
}

/* ---- the values just inside each rule are accepted ---- */

Test(config, boundaries_accepted)
{
	struct kvr_config c = base();
	char msg[256];

	c.sink_tokens = c.window_tokens = 512;
	c.budget_tokens = c.sink_tokens + c.window_tokens; /* k = 0: sink and window only */
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), 0, "%s", msg);
	c = base();
	c.sink_tokens = 0;
	c.window_tokens = 0;
	c.budget_tokens = 32;
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), 0, "%s", msg);

	c = base();
	c.tau = -1.0f;
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), 0, "%s", msg);
	c.tau = 1.0f;
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), 0, "%s", msg);

	static const uint32_t pages[] = { 8, 16, 32, 64, 128, 256 };
	for (size_t i = 0; i < sizeof(pages) / sizeof(pages[0]); i++) {
		c = base();
		c.page_tokens = pages[i];
		c.sink_tokens = c.window_tokens = 512;
		c.budget_tokens = 2048;
		cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), 0, "p=%u: %s", pages[i], msg);
	}
	for (uint32_t d = 32; d <= 256; d += 32) {
		c = base();
		c.head_dim = d;
		cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), 0, "d=%u: %s", d, msg);
	}
	for (uint32_t t = KVR_DTYPE_F16; t <= KVR_DTYPE_F32; t++) {
		c = base();
		c.dtype = t;
		cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), 0, "%s", msg);
	}
	c = base();
	c.n_layers = KVR_MAX_LAYERS;
	c.dense_layers[3] = 1ull << 63; /* layer 255 */
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), 0, "%s", msg);
	c = base();
	c.n_qo_heads = 9; /* SmolLM2: G = 3 */
	c.n_kv_heads = 3;
	c.head_dim = 64;
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), 0, "%s", msg);
	c.n_qo_heads = 64; /* G = 64 */
	c.n_kv_heads = 1;
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), 0, "%s", msg);
}

/* A caller built against a newer header may pass a larger struct, as long as
 * it sets none of the fields this library lacks. */
Test(config, newer_larger_struct)
{
	struct {
		struct kvr_config c;
		uint64_t newer_field;
	} big;
	big.c = base();
	big.newer_field = 0;
	big.c.size = sizeof(big);
	char msg[256];
	cr_expect_eq(kvr_config_validate(&big.c, msg, sizeof(msg)), 0, "%s", msg);
	big.newer_field = 7;
	cr_expect_eq(kvr_config_validate(&big.c, msg, sizeof(msg)), -EINVAL);
	cr_expect(strstr(msg, "newer kvrecall") != NULL, "%s", msg);
}

Test(config, null_and_truncated_message)
{
	char msg[8];
	cr_expect_eq(kvr_config_validate(NULL, msg, sizeof(msg)), -EINVAL);
	cr_expect_str_eq(msg, "config:"); /* truncated, still terminated */
	struct kvr_config c = base();
	c.n_layers = 0;
	cr_expect_eq(kvr_config_validate(&c, msg, 1), -EINVAL);
	cr_expect_str_empty(msg);
}

Test(config, names_round_trip)
{
	for (uint32_t m = KVR_MODE_AUTO; m <= KVR_MODE_FREEKV; m++) {
		uint32_t back = 99;
		cr_expect_eq(kvr_mode_parse(kvr_mode_name(m), &back), 0);
		cr_expect_eq(back, m);
	}
	uint32_t m = 5;
	cr_expect_eq(kvr_mode_parse("sparse", &m), -EINVAL);
	cr_expect_eq(m, 5, "out-parameter written on failure");
	cr_expect_str_eq(kvr_mode_name(99), "?");
	cr_expect_str_eq(kvr_dtype_name(KVR_DTYPE_BF16), "bf16");
	cr_expect_str_eq(kvr_dtype_name(17), "?");
	cr_expect_str_eq(kvr_backend_name(KVR_BACKEND_CUDA), "cuda");
	cr_expect_str_eq(kvr_backend_name(3), "?");
	for (uint32_t f = KVR_KV_FORMAT_PLAIN; f <= KVR_KV_FORMAT_MIXED; f++) {
		uint32_t back = 99;
		cr_expect_eq(kvr_kv_format_parse(kvr_kv_format_name(f), &back), 0);
		cr_expect_eq(back, f);
	}
	uint32_t f = 7;
	cr_expect_eq(kvr_kv_format_parse("f16", &f), 0);
	cr_expect_eq(f, KVR_KV_FORMAT_PLAIN);
	f = 7;
	cr_expect_eq(kvr_kv_format_parse("k8v8", &f), -EINVAL);
	cr_expect_eq(f, 7, "out-parameter written on failure");
	cr_expect_str_eq(kvr_kv_format_name(4), "?");
}

/* A size no config can have (e.g. an uninitialised UINT32_MAX) is refused
 * without scanning gigabytes past the caller's struct (ASan checks that). */
Test(config, absurd_size_refused_without_reading_past_the_struct)
{
	struct kvr_config c = base();
	c.size = UINT32_MAX;
	char msg[256];
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), -EINVAL);
	cr_expect(strstr(msg, "size") == msg, "%s", msg);
	struct kvr_context *ctx = NULL;
	cr_expect_eq(kvr_context_create(&c, &ctx), -EINVAL);
	cr_expect_null(ctx);
}

/* Rules that need only the config are validate's, so validate and create
 * agree: a device budget below one sequence, RAM for too few spill frames. */
Test(config, validate_knows_what_create_would_refuse)
{
	struct kvr_config c = base();
	char msg[512];
	c.device_bytes = 1;
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), -ENOMEM);
	cr_expect(strstr(msg, "device_bytes") == msg, "%s", msg);
	uint64_t fixed = 0, per_seq = 0;
	c.device_bytes = 0;
	cr_assert_eq(kvr_device_bytes_needed(&c, &fixed, &per_seq), 0);
	c.device_bytes = fixed + per_seq;
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), 0, "%s", msg);
	c.device_bytes = fixed + per_seq - 1;
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), -ENOMEM);
	c.device_bytes = 0;

	const uint64_t page = 2ull * c.page_tokens * c.head_dim * 2 * c.n_kv_heads; /* f16 */
	c.pool_ram_bytes = 7 * page;
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), -EINVAL);
	cr_expect(strstr(msg, "pool_ram_bytes") == msg, "%s", msg);
	c.pool_ram_bytes = 8 * page;
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), 0, "%s", msg);
	/* RAM for the whole pool: no spill tier, no minimum */
	c.pool_bytes = c.pool_ram_bytes = (uint64_t)c.n_layers * page;
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), 0, "%s", msg);
}

/* recall = auto is what the backend measured best (runtime/config.c,
 * kvr_config_recall): the device budget a cuda config reports includes the
 * streamed page cache for plain pages in a sparse mode, and not for
 * quantised pages, the NHD pool, mode dense or the cpu backend (zero-copy
 * there); an explicit choice is kept. Needs no GPU: only the config. */
/* Device bytes per sequence of `c` with `backend` and `recall`. */
static uint64_t per_sequence_needed(struct kvr_config c, uint32_t backend, uint32_t recall)
{
	c.backend = backend;
	c.recall = recall;
	uint64_t per = 0;
	cr_assert_eq(kvr_device_bytes_needed(&c, NULL, &per), 0, "%s", kvr_last_error(NULL));
	return per;
}

Test(config, recall_auto_is_per_backend)
{
	struct kvr_config c = base();
	c.sink_tokens = c.window_tokens = 512; /* explicit: k follows the budget below */
	enum { AUTO = KVR_RECALL_AUTO, ZC = KVR_RECALL_ZERO_COPY, ST = KVR_RECALL_STREAMED };
	const uint32_t cpu = KVR_BACKEND_CPU, cuda = KVR_BACKEND_CUDA;
	cr_assert_gt(per_sequence_needed(c, cuda, ST), per_sequence_needed(c, cuda, ZC),
		     "the page cache costs device memory");
	cr_assert_gt(per_sequence_needed(c, cpu, ST), per_sequence_needed(c, cpu, ZC));
	cr_expect_eq(per_sequence_needed(c, cpu, AUTO), per_sequence_needed(c, cpu, ZC),
		     "cpu, auto: zero-copy");
	cr_expect_eq(per_sequence_needed(c, KVR_BACKEND_AUTO, AUTO), per_sequence_needed(c, cpu, ZC),
		     "backend auto (the cpu backend), recall auto: zero-copy");
	cr_expect_eq(per_sequence_needed(c, cuda, AUTO), per_sequence_needed(c, cuda, ST),
		     "cuda, auto, plain pages: streamed");
	struct kvr_config other = c;
	other.pool_layout = KVR_POOL_NHD;
	cr_expect_eq(per_sequence_needed(other, cuda, AUTO), per_sequence_needed(other, cuda, ZC),
		     "cuda, NHD pool: zero-copy");
	other = c;
	other.kv_format = KVR_KV_FORMAT_K8V4;
	cr_expect_eq(per_sequence_needed(other, cuda, AUTO), per_sequence_needed(other, cuda, ZC),
		     "cuda, quantised pages: zero-copy");
	cr_expect_neq(per_sequence_needed(other, cuda, ST), per_sequence_needed(other, cuda, ZC));
	other = c;
	other.mode = KVR_MODE_SPECULATIVE;
	cr_expect_eq(per_sequence_needed(other, cuda, AUTO), per_sequence_needed(other, cuda, ST),
		     "cuda, speculative: streamed");
	other.mode = KVR_MODE_DENSE;
	cr_expect_eq(per_sequence_needed(other, cuda, AUTO), per_sequence_needed(other, cuda, ZC),
		     "cuda, mode dense: zero-copy");
	/* a k the device plan does not take: its streamed recall would plan on
	 * the host, with waits */
	other = c;
	other.budget_tokens = other.sink_tokens + other.window_tokens + 1025 * other.page_tokens;
	cr_expect_eq(per_sequence_needed(other, cuda, AUTO), per_sequence_needed(other, cuda, ZC),
		     "cuda, k = 1025: zero-copy");
	other.budget_tokens -= other.page_tokens;
	cr_expect_eq(per_sequence_needed(other, cuda, AUTO), per_sequence_needed(other, cuda, ST),
		     "cuda, k = 1024: streamed");
	other.budget_tokens = other.sink_tokens + other.window_tokens;
	cr_expect_eq(per_sequence_needed(other, cuda, AUTO), per_sequence_needed(other, cuda, ZC),
		     "cuda, k = 0: zero-copy");
}

/* ---- sink and window left to the library follow the budget ---- */

/* What KVR_TOKENS_AUTO stands for, written out: a quarter of the budget, at
 * most 512, rounded down to whole pages. */
static uint32_t auto_tokens(uint32_t budget, uint32_t page)
{
	const uint32_t quarter = budget / 4 < 512 ? budget / 4 : 512;
	return quarter - quarter % page;
}

/* A small config that creates quickly (a few MiB of pool, one thread). */
static struct kvr_config small(uint32_t page, uint32_t budget)
{
	struct kvr_config c;
	cr_assert_eq(kvr_config_init(&c), 0);
	c.n_layers = 2;
	c.n_qo_heads = 4;
	c.n_kv_heads = 2;
	c.head_dim = 32;
	c.page_tokens = page;
	c.budget_tokens = budget;
	c.max_sequences = c.max_batch = 1;
	c.threads = 0;
	c.pool_bytes = 8u << 20;
	c.backend = KVR_BACKEND_CPU;
	return c;
}

/* The context's resolved config. */
static struct kvr_config created(const struct kvr_config *in)
{
	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(in, &ctx), 0, "p=%u B=%u: %s", in->page_tokens, in->budget_tokens,
		     kvr_last_error(NULL));
	struct kvr_config out;
	kvr_config_init(&out);
	cr_assert_eq(kvr_context_get_config(ctx, &out), 0);
	kvr_context_destroy(ctx);
	return out;
}

Test(config, unset_sink_and_window_follow_the_budget)
{
	/* (page, budget): B/4 above 512, at 512, below it, not a page multiple
	 * (1040/4 = 260 at p 16, 1216/4 = 304 at p 64, 160/4 = 40 at p 32),
	 * smaller than a page (96/4 = 24 at p 32: no sink or window at all) */
	static const uint32_t cases[][2] = {
		{ 32, 4096 }, { 32, 2048 }, { 32, 1024 }, { 16, 1040 }, { 64, 1216 }, { 32, 160 },
		{ 32, 96 },   { 8, 40 },    { 256, 256 }, { 256, 4096 }, { 128, 640 }, { 32, 32 },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		const uint32_t p = cases[i][0], b = cases[i][1], want = auto_tokens(b, p);
		struct kvr_config in = small(p, b);
		cr_assert_eq(in.sink_tokens, KVR_TOKENS_AUTO);
		cr_assert_eq(in.window_tokens, KVR_TOKENS_AUTO);
		char msg[256];
		cr_assert_eq(kvr_config_validate(&in, msg, sizeof(msg)), 0, "p=%u B=%u: %s", p, b, msg);
		const struct kvr_config out = created(&in);
		cr_expect_eq(out.sink_tokens, want, "p=%u B=%u: sink %u, want %u", p, b, out.sink_tokens, want);
		cr_expect_eq(out.window_tokens, want, "p=%u B=%u: window %u, want %u", p, b, out.window_tokens,
			     want);
		/* leaving them unset always leaves pages to select */
		cr_expect_geq((b - out.sink_tokens - out.window_tokens) / p, 1, "p=%u B=%u", p, b);
		/* the estimate of device bytes resolves them the same way */
		struct kvr_config expl = in;
		expl.sink_tokens = expl.window_tokens = want;
		uint64_t fa = 0, pa = 0, fe = 1, pe = 1;
		cr_assert_eq(kvr_device_bytes_needed(&in, &fa, &pa), 0, "%s", kvr_last_error(NULL));
		cr_assert_eq(kvr_device_bytes_needed(&expl, &fe, &pe), 0, "%s", kvr_last_error(NULL));
		cr_expect(fa == fe && pa == pe, "p=%u B=%u: device bytes differ from the explicit values'", p, b);
	}
	/* one left unset, the other explicit: each on its own */
	struct kvr_config in = small(32, 1024);
	in.sink_tokens = 64;
	struct kvr_config out = created(&in);
	cr_expect_eq(out.sink_tokens, 64);
	cr_expect_eq(out.window_tokens, 256);
	in = small(32, 1024);
	in.window_tokens = 0;
	out = created(&in);
	cr_expect_eq(out.sink_tokens, 256);
	cr_expect_eq(out.window_tokens, 0);
	/* dense mode resolves them alike */
	in = small(16, 1040);
	in.mode = KVR_MODE_DENSE;
	out = created(&in);
	cr_expect_eq(out.sink_tokens, 256);
	cr_expect_eq(out.window_tokens, 256);
}

Test(config, explicit_sink_and_window_are_kept)
{
	static const uint32_t values[][3] = { /* page, sink, window; budget 1024 */
		{ 32, 512, 512 }, { 32, 0, 0 }, { 32, 32, 96 }, { 16, 496, 16 }, { 64, 0, 1024 },
	};
	for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); i++) {
		struct kvr_config in = small(values[i][0], 1024);
		in.sink_tokens = values[i][1];
		in.window_tokens = values[i][2];
		const struct kvr_config out = created(&in);
		cr_expect_eq(out.sink_tokens, values[i][1], "case %zu: sink %u", i, out.sink_tokens);
		cr_expect_eq(out.window_tokens, values[i][2], "case %zu: window %u", i, out.window_tokens);
	}
}

/* The log callback's warnings, joined. */
static char warnings[4096];

static void keep_warnings(void *user, enum kvr_log_level level, const char *message)
{
	(void)user;
	if (level == KVR_LOG_WARN && strlen(warnings) + strlen(message) + 2 < sizeof(warnings)) {
		strcat(warnings, message);
		strcat(warnings, "\n");
	}
}

/* Warned at creation: "selects no pages", or nothing. */
static int warned_no_pages(struct kvr_config c)
{
	warnings[0] = '\0';
	c.log_fn = keep_warnings;
	c.log_level = KVR_LOG_WARN;
	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(&c, &ctx), 0, "%s", kvr_last_error(NULL));
	kvr_context_destroy(ctx);
	return strstr(warnings, "selects no pages") != NULL;
}

Test(config, explicit_sink_and_window_that_fill_the_budget_warn)
{
	/* k = (B - S - W) / p = 0 in a sparse mode: valid, and said */
	static const uint32_t modes[] = { KVR_MODE_AUTO, KVR_MODE_BLOCKING, KVR_MODE_SPECULATIVE,
					  KVR_MODE_FREEKV };
	for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++) {
		struct kvr_config c = small(32, 1024);
		c.mode = modes[i];
		c.sink_tokens = c.window_tokens = 512;
		char msg[256];
		cr_assert_eq(kvr_config_validate(&c, msg, sizeof(msg)), 0, "%s", msg);
		cr_expect(warned_no_pages(c), "mode %s: no warning in: %s", kvr_mode_name(modes[i]), warnings);
		cr_expect(strstr(warnings, "budget_tokens 1024") != NULL, "%s", warnings);
	}
	/* one page left over (k = 1) is not warned; none is, at any page size */
	struct kvr_config c = small(32, 1024);
	c.mode = KVR_MODE_FREEKV;
	c.sink_tokens = 512;
	c.window_tokens = 480;
	cr_expect(!warned_no_pages(c), "k = 1 warned: %s", warnings);
	c.budget_tokens = 1008;
	c.page_tokens = 16;
	c.window_tokens = 496;
	cr_expect(warned_no_pages(c), "k = 0 at p 16 not warned: %s", warnings);
	/* not warned: left unset (k >= 1), dense mode, every layer dense */
	c = small(32, 1024);
	c.mode = KVR_MODE_FREEKV;
	cr_expect(!warned_no_pages(c), "%s", warnings);
	c.sink_tokens = c.window_tokens = 512;
	c.mode = KVR_MODE_DENSE;
	cr_expect(!warned_no_pages(c), "%s", warnings);
	c.mode = KVR_MODE_FREEKV;
	c.dense_layers[0] = 3;
	cr_expect(!warned_no_pages(c), "%s", warnings);
}

/* Calls without a context leave their reason in kvr_last_error(NULL) too:
 * the parsers name what they were given and what they accept, validate's
 * reason is there whether or not a message buffer was passed. */
Test(config, calls_without_a_context_leave_a_message)
{
	uint32_t out = 99;
	cr_expect_eq(kvr_mode_parse("sparse", &out), -EINVAL);
	cr_expect_eq(out, 99, "a refused parse writes nothing");
	cr_expect(strstr(kvr_last_error(NULL), "\"sparse\" is not a mode") &&
		  strstr(kvr_last_error(NULL), "freekv"), "%s", kvr_last_error(NULL));
	cr_expect_eq(kvr_kv_format_parse("k2v1", &out), -EINVAL);
	cr_expect(strstr(kvr_last_error(NULL), "\"k2v1\" is not a page format"), "%s", kvr_last_error(NULL));
	cr_expect_eq(kvr_mode_parse(NULL, &out), -EINVAL);
	cr_expect(strstr(kvr_last_error(NULL), "mode_parse: name is NULL"), "%s", kvr_last_error(NULL));
	cr_expect_eq(kvr_config_init(NULL), -EINVAL);
	cr_expect(strstr(kvr_last_error(NULL), "config_init"), "%s", kvr_last_error(NULL));
	struct kvr_config c = base();
	c.page_tokens = 0;
	cr_expect_lt(kvr_config_validate(&c, NULL, 0), 0);
	cr_expect(strstr(kvr_last_error(NULL), "page_tokens"), "%s", kvr_last_error(NULL));
	cr_expect_eq(kvr_mode_parse("freekv", &out), 0);
	cr_expect_eq(out, KVR_MODE_FREEKV);
}
