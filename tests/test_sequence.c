/* SPDX-License-Identifier: MIT */
/*
 * test_sequence.c — sequences and prefill through the public API: ids and
 * their limits, ingestion in chunks of any size with the data landing in pool
 * pages and tail tiles, forks that diverge without touching each other,
 * truncation (including back into an offloaded page), and every bad input
 * refused with a message while the other sequences stay intact. The stored
 * bytes are read back through the context's internals (this suite links the
 * static library).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "../host/pool.h"
#include "internal.h"
#include "kvrecall.h"
#include "helpers.h"

#define P 16
#define N_KV 2
#define D 32
#define ROW (N_KV * D) /* elements per token row */

static uint32_t pool_layout = KVR_POOL_HND; /* make_ctx's pool layout */

static struct kvr_context *make_ctx(uint32_t max_seqs, uint64_t pool_pages)
{
	struct kvr_config c;
	th_config(&c, 2, 4, N_KV, D, KVR_DTYPE_F32, P, 32, 32, 128);
	c.pool_layout = pool_layout;
	c.max_sequences = max_seqs;
	c.max_batch = 1;
	c.threads = 0;
	c.pool_bytes = pool_pages * 2ull * P * D * N_KV * 4;
	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(&c, &ctx), 0, "%s", kvr_last_error(NULL));
	return ctx;
}

/* Token t's K row is t + 0.001·i, its V row the negation: every value says
 * which token it belongs to. */
static float *rows(uint64_t first, uint32_t n, int values)
{
	float *r = malloc((size_t)n * ROW * sizeof(float));
	for (uint32_t t = 0; t < n; t++)
		for (uint32_t i = 0; i < ROW; i++)
			r[(size_t)t * ROW + i] = (values ? -1.0f : 1.0f) * ((float)(first + t) + 0.001f * (float)i);
	return r;
}

static void prefill(struct kvr_context *ctx, uint32_t seq, uint32_t layer, uint64_t first, uint32_t n)
{
	float *k = rows(first, n, 0), *v = rows(first, n, 1);
	cr_assert_eq(kvr_prefill(ctx, seq, layer, first, n, k, v), 0, "%s", kvr_last_error(ctx));
	free(k), free(v);
}

/* Token t of (seq, layer), read back from the pool page or the tail tile. */
static float stored(struct kvr_context *ctx, uint32_t seq, uint32_t layer, uint64_t t, int values,
		    uint32_t h, uint32_t dim)
{
	uint64_t len;
	kvr_pool_n_tokens(ctx->pool, seq, layer, &len);
	const uint64_t full = len / P * P;
	if (t < full) {
		uint32_t id;
		cr_assert_eq(kvr_pool_lookup(ctx->pool, seq, layer, (uint32_t)(t / P), &id), 0);
		float run[2 * P * D]; /* the head's keys then values, whatever the layout */
		kvr_pool_gather_head(ctx->pool, id, h, run);
		return run[((uint32_t)values * P + t % P) * D + dim];
	}
	const float *tile = (const float *)(ctx->seqs[seq].tails +
					    ((uint64_t)layer * 2 + (uint64_t)values) * ctx->tile_bytes);
	return tile[(t % P) * ROW + h * D + dim];
}

static void expect_tokens(struct kvr_context *ctx, uint32_t seq, uint32_t layer, uint64_t n,
			  float offset)
{
	uint64_t len;
	cr_assert_eq(kvr_seq_length(ctx, seq, layer, &len), 0);
	cr_assert_eq(len, n, "seq %u layer %u has %llu tokens, want %llu", seq, layer,
		     (unsigned long long)len, (unsigned long long)n);
	for (uint64_t t = 0; t < n; t++)
		for (uint32_t h = 0; h < N_KV; h++) {
			const float want = (float)t + offset + 0.001f * (float)(h * D + 5);
			cr_assert_float_eq(stored(ctx, seq, layer, t, 0, h, 5), want, 1e-6,
					   "seq %u layer %u token %llu head %u K", seq, layer,
					   (unsigned long long)t, h);
			cr_assert_float_eq(stored(ctx, seq, layer, t, 1, h, 5), -want, 1e-6, "V");
		}
}

Test(sequence, ids_and_limits)
{
	struct kvr_context *ctx = make_ctx(3, 64);
	uint32_t a, b, c, d;
	cr_assert_eq(kvr_seq_create(ctx, &a), 0);
	cr_assert_eq(kvr_seq_create(ctx, &b), 0);
	cr_assert_eq(kvr_seq_create(ctx, &c), 0);
	cr_expect(a != b && b != c && a != c);
	cr_expect_eq(kvr_seq_create(ctx, &d), -ENOSPC);
	cr_expect(strstr(kvr_last_error(ctx), "all 3 sequences are in use") != NULL, "%s",
		  kvr_last_error(ctx));
	cr_assert_eq(kvr_seq_free(ctx, b), 0);
	cr_expect_eq(kvr_seq_free(ctx, b), -EINVAL, "double free");
	cr_expect(strstr(kvr_last_error(ctx), "does not exist") != NULL);
	cr_assert_eq(kvr_seq_create(ctx, &d), 0, "a freed id is reusable");
	cr_expect_eq(d, b);
	cr_expect_eq(kvr_seq_free(ctx, 99), -EINVAL);
	cr_expect(strstr(kvr_last_error(ctx), "out of range") != NULL);
	cr_expect_eq(kvr_seq_create(ctx, NULL), -EINVAL);
	cr_expect_eq(kvr_seq_create(NULL, &d), -EINVAL);
	kvr_context_destroy(ctx); /* frees the live sequences too */
}

Test(sequence, prefill_in_chunks_of_any_size)
{
	struct kvr_context *ctx = make_ctx(2, 64);
	uint32_t s;
	cr_assert_eq(kvr_seq_create(ctx, &s), 0);
	static const uint32_t chunks[] = { 1, 7, 16, 9, 40, 3 };
	uint64_t pos = 0;
	for (size_t i = 0; i < sizeof(chunks) / sizeof(chunks[0]); i++) {
		prefill(ctx, s, 1, pos, chunks[i]);
		pos += chunks[i];
		expect_tokens(ctx, s, 1, pos, 0.0f);
	}
	expect_tokens(ctx, s, 0, 0, 0.0f); /* the other layer is untouched */
	kvr_context_destroy(ctx);
}

Test(sequence, bad_input_refused_and_harmless)
{
	struct kvr_context *ctx = make_ctx(2, 64);
	uint32_t s, other;
	cr_assert_eq(kvr_seq_create(ctx, &s), 0);
	cr_assert_eq(kvr_seq_create(ctx, &other), 0);
	prefill(ctx, s, 0, 0, 20);
	prefill(ctx, other, 0, 0, 5);
	float *k = rows(20, 4, 0), *v = rows(20, 4, 1);
	cr_expect_eq(kvr_prefill(ctx, s, 0, 19, 4, k, v), -EINVAL);
	cr_expect(strstr(kvr_last_error(ctx), "expected position 20, got 19") != NULL, "%s",
		  kvr_last_error(ctx));
	cr_expect_eq(kvr_prefill(ctx, s, 0, 24, 4, k, v), -EINVAL, "a gap");
	cr_expect_eq(kvr_prefill(ctx, s, 2, 0, 4, k, v), -EINVAL);
	cr_expect(strstr(kvr_last_error(ctx), "layer 2 out of range") != NULL);
	cr_expect_eq(kvr_prefill(ctx, 7, 0, 0, 4, k, v), -EINVAL);
	cr_expect_eq(kvr_prefill(ctx, s, 0, 20, 4, NULL, v), -EINVAL);
	cr_expect_eq(kvr_prefill(ctx, s, 0, 20, 0, NULL, NULL), 0, "nothing to store");
	cr_expect_eq(kvr_seq_truncate(ctx, s, 21), -EINVAL, "longer than stored");
	expect_tokens(ctx, s, 0, 20, 0.0f);
	expect_tokens(ctx, other, 0, 5, 0.0f);
	free(k), free(v);
	kvr_context_destroy(ctx);
}

Test(sequence, pool_exhaustion_is_all_or_nothing)
{
	struct kvr_context *ctx = make_ctx(2, 3); /* three pages */
	uint32_t s;
	cr_assert_eq(kvr_seq_create(ctx, &s), 0);
	prefill(ctx, s, 0, 0, 40); /* 3 pages (the last one partial) */
	float *k = rows(40, 10, 0), *v = rows(40, 10, 1);
	cr_expect_eq(kvr_prefill(ctx, s, 0, 40, 10, k, v), -ENOMEM, "needs a fourth page");
	cr_expect(strstr(kvr_last_error(ctx), "capacity") != NULL, "%s", kvr_last_error(ctx));
	expect_tokens(ctx, s, 0, 40, 0.0f);
	cr_expect_eq(kvr_prefill(ctx, s, 0, 40, 8, k, v), 0, "fits in the partial page");
	expect_tokens(ctx, s, 0, 48, 0.0f);
	free(k), free(v);
	kvr_context_destroy(ctx);
}

Test(sequence, forks_diverge_independently)
{
	struct kvr_context *ctx = make_ctx(3, 64);
	uint32_t a, b;
	cr_assert_eq(kvr_seq_create(ctx, &a), 0);
	for (uint32_t l = 0; l < 2; l++)
		prefill(ctx, a, l, 0, 21); /* 1 full page + 5 in the tail */
	cr_assert_eq(kvr_seq_fork(ctx, a, &b), 0, "%s", kvr_last_error(ctx));
	expect_tokens(ctx, b, 1, 21, 0.0f);
	/* the fork continues with other tokens (offset 1000) */
	float *k = malloc(30 * ROW * sizeof(float)), *v = malloc(30 * ROW * sizeof(float));
	for (uint32_t t = 0; t < 30; t++)
		for (uint32_t i = 0; i < ROW; i++) {
			k[t * ROW + i] = (float)(21 + t) + 1000.0f + 0.001f * (float)i;
			v[t * ROW + i] = -k[t * ROW + i];
		}
	cr_assert_eq(kvr_prefill(ctx, b, 1, 21, 30, k, v), 0, "%s", kvr_last_error(ctx));
	prefill(ctx, a, 1, 21, 30); /* the original with its own */
	expect_tokens(ctx, a, 1, 51, 0.0f);
	for (uint64_t t = 0; t < 51; t++) {
		const float want = (float)t + (t >= 21 ? 1000.0f : 0.0f) + 0.001f * 5;
		cr_assert_float_eq(stored(ctx, b, 1, t, 0, 0, 5), want, 1e-3, "fork token %llu",
				   (unsigned long long)t);
	}
	cr_assert_eq(kvr_seq_free(ctx, a), 0);
	cr_assert_eq(kvr_pool_validate(ctx->pool, NULL), 0, "%s", kvr_pool_last_error(ctx->pool));
	free(k), free(v);
	kvr_context_destroy(ctx);
}

static void truncate_back_into_an_offloaded_page(void)
{
	struct kvr_context *ctx = make_ctx(2, 64);
	uint32_t s;
	cr_assert_eq(kvr_seq_create(ctx, &s), 0);
	for (uint32_t l = 0; l < 2; l++)
		prefill(ctx, s, l, 0, 50); /* 3 full pages + 2 */
	cr_assert_eq(kvr_seq_truncate(ctx, s, 37), 0, "%s", kvr_last_error(ctx));
	expect_tokens(ctx, s, 0, 37, 0.0f); /* tokens 32..36 came back to the tail */
	prefill(ctx, s, 0, 37, 20);
	expect_tokens(ctx, s, 0, 57, 0.0f);
	/* layer 1 has 37 tokens: keeping 40 is refused, and layer 0 keeps its 57 */
	cr_assert_eq(kvr_seq_truncate(ctx, s, 40), -EINVAL);
	cr_expect(strstr(kvr_last_error(ctx), "layer 1 has 37 tokens") != NULL, "%s", kvr_last_error(ctx));
	expect_tokens(ctx, s, 0, 57, 0.0f);
	cr_assert_eq(kvr_seq_truncate(ctx, s, 0), 0);
	expect_tokens(ctx, s, 0, 0, 0.0f);
	expect_tokens(ctx, s, 1, 0, 0.0f);
	cr_assert_eq(kvr_pool_validate(ctx->pool, NULL), 0, "%s", kvr_pool_last_error(ctx->pool));
	kvr_context_destroy(ctx);
}

Test(sequence, truncate_back_into_an_offloaded_page)
{
	truncate_back_into_an_offloaded_page();
}

/* An NHD pool interleaves a page's heads token by token: the rows that go
 * back to the tail tile are gathered per head, not read as an HND run
 * (found by tests/api_sequence.c: the tail came back garbled). */
Test(sequence, truncate_back_into_an_offloaded_page_of_an_nhd_pool)
{
	pool_layout = KVR_POOL_NHD;
	truncate_back_into_an_offloaded_page();
}
