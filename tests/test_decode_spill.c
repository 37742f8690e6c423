/* SPDX-License-Identifier: MIT */
/*
 * test_decode_spill.c — decoding with the spill tier (pool_ram_bytes far
 * below the context's KV): two sequences of 400 tokens on two layers in a
 * pool whose RAM holds 12 of their 100 pages give outputs bit-identical to a
 * context without a spill tier, in every sparse mode and page format, while
 * most pages live in the spill file and recall reads them from it. Then a
 * sequence whose pages were corrupted in the file behind the pool's back
 * fails its steps with -EBADMSG and a message saying so, while the other
 * sequence in the same batches decodes exactly what it decodes alone. And
 * prefill attention reads (and streams) spilled pages.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../host/pool.h"
#include "../host/spill.h"
#include "internal.h"
#include "kvrecall.h"
#define TH_SMALL_SHAPE
#include "helpers.h"

#define LAYERS 2
#define PREFILL 400
#define STEPS 24

static uint64_t rng_state;
static float frand(void)
{
	return th_lcg_milli(&rng_state);
}

/* ram_pages 0: no spill tier (streamed recall all the same). */
static struct kvr_context *make_ctx(uint32_t mode, uint32_t kv_format, uint32_t ram_pages)
{
	struct kvr_config c;
	th_config(&c, LAYERS, N_QO, N_KV, D, KVR_DTYPE_F32, P, 16, 16, 64);
	c.mode = mode;
	c.kv_format = kv_format;
	th_config_sparse(&c, 4);
	c.recall = KVR_RECALL_STREAMED;
	const uint64_t f32_page = 2ull * P * D * N_KV * 4;
	/* a K8V4 run at p = 16, d = 32: 512 B of key codes, 256 of value codes,
	 * 64 + 64 of f16 (scale, zero point) pairs; two runs a page */
	const uint64_t page = kv_format == KVR_KV_FORMAT_K8V4 || kv_format == KVR_KV_FORMAT_MIXED ? 2 * 896 : f32_page;
	c.pool_bytes = 256 * f32_page;
	c.pool_ram_bytes = ram_pages * page;
	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(&c, &ctx), 0, "%s", kvr_last_error(NULL));
	return ctx;
}

struct run {
	float out[STEPS][2][LAYERS][Q_ROW];
	int32_t status[STEPS][2][LAYERS];
};

/* Two sequences of PREFILL tokens on every layer, random K/V from `seed`
 * (rng_state goes on from there). */
static void prefill_two(struct kvr_context *ctx, uint64_t seed, uint32_t *seqs)
{
	rng_state = seed;
	float *k = malloc(PREFILL * KV_ROW * sizeof(float)), *v = malloc(PREFILL * KV_ROW * sizeof(float));
	for (int s = 0; s < 2; s++) {
		cr_assert_eq(kvr_seq_create(ctx, &seqs[s]), 0);
		for (uint32_t i = 0; i < PREFILL * KV_ROW; i++)
			k[i] = frand(), v[i] = frand();
		for (uint32_t l = 0; l < LAYERS; l++)
			cr_assert_eq(kvr_prefill(ctx, seqs[s], l, 0, PREFILL, k, v), 0, "%s", kvr_last_error(ctx));
	}
	free(k), free(v);
}

/* Two sequences, the same K/V and queries for a given seed; a step's batch
 * holds both. */
static void decode(struct kvr_context *ctx, uint64_t seed, struct run *r, void (*after_prefill)(struct kvr_context *, const uint32_t *))
{
	uint32_t seqs[2];
	prefill_two(ctx, seed, seqs);
	if (after_prefill)
		after_prefill(ctx, seqs);
	uint64_t pos[2] = { PREFILL, PREFILL };
	for (int t = 0; t < STEPS; t++) {
		float q[2][Q_ROW], kk[2][KV_ROW], vv[2][KV_ROW];
		for (int s = 0; s < 2; s++) {
			for (uint32_t i = 0; i < Q_ROW; i++)
				q[s][i] = 3.0f * frand();
			for (uint32_t i = 0; i < KV_ROW; i++)
				kk[s][i] = frand(), vv[s][i] = frand();
		}
		cr_assert_eq(kvr_decode_begin(ctx, seqs, pos, 2), 0, "%s", kvr_last_error(ctx));
		for (uint32_t l = 0; l < LAYERS; l++) {
			float out[2][Q_ROW];
			int32_t status[2] = { 99, 99 };
			cr_assert_eq(kvr_decode_layer(ctx, l, q, kk, vv, out, status, NULL), 0, "%s",
				     kvr_last_error(ctx));
			for (int s = 0; s < 2; s++) {
				memcpy(r->out[t][s][l], out[s], sizeof(out[s]));
				r->status[t][s][l] = status[s];
			}
		}
		cr_assert_eq(kvr_decode_end(ctx), 0);
		/* a failed sequence appended nothing: it retries its position */
		for (int s = 0; s < 2; s++) {
			int ok = 1;
			for (uint32_t l = 0; l < LAYERS; l++)
				ok &= r->status[t][s][l] == 0;
			pos[s] += ok;
		}
	}
}

Test(decode_spill, outputs_identical_to_a_pool_in_ram, .timeout = 240)
{
	static const uint32_t modes[] = { KVR_MODE_BLOCKING, KVR_MODE_SPECULATIVE, KVR_MODE_FREEKV };
	static const uint32_t formats[] = { KVR_KV_FORMAT_PLAIN, KVR_KV_FORMAT_K8V4, KVR_KV_FORMAT_MIXED };
	struct run *want = malloc(sizeof(*want)), *got = malloc(sizeof(*got));
	for (int f = 0; f < 3; f++)
		for (int mi = 0; mi < 3; mi++) {
			struct kvr_context *a = make_ctx(modes[mi], formats[f], 0);
			decode(a, 77 + mi, want, NULL);
			kvr_context_destroy(a);
			struct kvr_context *b = make_ctx(modes[mi], formats[f], 12);
			decode(b, 77 + mi, got, NULL);
			struct kvr_pool_stats st;
			kvr_pool_get_stats(b->pool, &st);
			cr_expect(st.spill_enabled && st.frames == 12, "frames %u", st.frames);
			cr_expect_gt(st.spilled_pages, 50, "only %llu of ~100 pages spilled",
				     (unsigned long long)st.spilled_pages);
			cr_expect_gt(st.runs_read_through, 0, "recall never read the file");
			cr_expect_eq(st.spill_errors, 0);
			cr_expect_eq(kvr_pool_validate(b->pool, NULL), 0, "%s", kvr_pool_last_error(b->pool));
			kvr_context_destroy(b);
			for (int t = 0; t < STEPS; t++)
				for (int s = 0; s < 2; s++)
					for (int l = 0; l < LAYERS; l++) {
						cr_assert_eq(want->status[t][s][l], 0);
						cr_assert_eq(got->status[t][s][l], 0, "format %u mode %u step %d seq %d",
							     formats[f], modes[mi], t, s);
						cr_assert_eq(memcmp(got->out[t][s][l], want->out[t][s][l],
								    sizeof(want->out[t][s][l])),
							     0, "format %u mode %u step %d seq %d layer %d differs",
							     formats[f], modes[mi], t, s, l);
					}
		}
	free(want), free(got);
}

/* Prefill attention over one sequence of two prefilled in ctx (the same K,
 * V and queries for a given seed), chunks of 64 queries from position `from`. */
static int prefill_attend(struct kvr_context *ctx, uint64_t seed, uint32_t from, float *out)
{
	uint32_t seqs[2];
	prefill_two(ctx, seed, seqs);
	float *q = malloc(PREFILL * Q_ROW * sizeof(float));
	for (uint32_t i = 0; i < PREFILL * Q_ROW; i++)
		q[i] = frand();
	int rc = 0;
	for (uint32_t at = from; !rc && at < PREFILL; at += 64) {
		const uint32_t n = PREFILL - at < 64 ? PREFILL - at : 64;
		rc = kvr_prefill_attention(ctx, seqs[0], 1, at, n, q + (size_t)at * Q_ROW, out + (size_t)at * Q_ROW);
	}
	free(q);
	return rc;
}

/* Prefill attention with the spill tier: the sequence's pages come
 * back from the file as each call needs them. A call whose prefix fits in
 * half the RAM frames reads it in place: outputs bit-identical to a pool in
 * RAM. A longer one streams the pages before its queries through in windows
 * of that many and merges their outputs by log-sum-exp: the same attention
 * to f32 rounding, with only a window's pages in RAM at once. (A call's own
 * pages, from its first query's, must fit in RAM: at most 5 of the 8 frames
 * a spill tier takes at least, for 64 queries of pages of 16.) */
Test(decode_spill, prefill_attention_streams_spilled_pages, .timeout = 120)
{
	float *want = calloc(PREFILL * Q_ROW, sizeof(float)), *got = calloc(PREFILL * Q_ROW, sizeof(float));
	struct kvr_context *a = make_ctx(KVR_MODE_FREEKV, KVR_KV_FORMAT_PLAIN, 0);
	cr_assert_eq(prefill_attend(a, 91, 0, want), 0, "%s", kvr_last_error(a));
	kvr_context_destroy(a);
	/* 60 frames for 100 pages: a prefix of up to 30 pages in place */
	struct kvr_context *b = make_ctx(KVR_MODE_FREEKV, KVR_KV_FORMAT_PLAIN, 60);
	cr_assert_eq(prefill_attend(b, 91, 0, got), 0, "%s", kvr_last_error(b));
	struct kvr_pool_stats st;
	kvr_pool_get_stats(b->pool, &st);
	cr_expect_gt(st.spilled_pages, 30, "only %llu pages spilled", (unsigned long long)st.spilled_pages);
	cr_expect_eq(st.spill_errors, 0);
	cr_expect_eq(kvr_pool_validate(b->pool, NULL), 0, "%s", kvr_pool_last_error(b->pool));
	kvr_context_destroy(b);
	cr_assert_eq(memcmp(got, want, PREFILL * Q_ROW * sizeof(float)), 0, "outputs differ with the spill tier");
	/* 8 frames (the least a spill tier takes): calls past 64 tokens stream
	 * their prefix in windows of 4 pages */
	struct kvr_context *c = make_ctx(KVR_MODE_FREEKV, KVR_KV_FORMAT_PLAIN, 8);
	memset(got, 0, PREFILL * Q_ROW * sizeof(float));
	cr_assert_eq(prefill_attend(c, 91, 0, got), 0, "%s", kvr_last_error(c));
	kvr_pool_get_stats(c->pool, &st);
	cr_expect_gt(st.spilled_pages, 80, "only %llu pages spilled", (unsigned long long)st.spilled_pages);
	cr_expect_eq(kvr_pool_validate(c->pool, NULL), 0, "%s", kvr_pool_last_error(c->pool));
	kvr_context_destroy(c);
	for (uint32_t i = 0; i < PREFILL * Q_ROW; i++)
		cr_assert_float_eq(got[i], want[i], 2e-5, "query %u element %u: %g, in RAM %g", i / Q_ROW, i % Q_ROW,
				   (double)got[i], (double)want[i]);
	free(want), free(got);
}

/* Flip a byte in every slot of the first sequence's spilled pages, on disk. */
static void corrupt_first(struct kvr_context *ctx, const uint32_t *seqs)
{
	struct kvr_spill *sp = kvr_pool_spill_file(ctx->pool);
	cr_assert_not_null(sp);
	struct kvr_spill_stats ss;
	kvr_spill_get_stats(sp, &ss);
	const int fd = kvr_spill_fd(sp);
	void *block = NULL;
	cr_assert_eq(posix_memalign(&block, 4096, ss.dio_align), 0);
	uint32_t n_corrupted = 0;
	for (uint32_t l = 0; l < LAYERS; l++) {
		uint32_t n_pages = 0;
		kvr_pool_n_pages(ctx->pool, seqs[0], l, &n_pages);
		for (uint32_t j = 0; j < n_pages; j++) {
			uint32_t id;
			cr_assert_eq(kvr_pool_lookup(ctx->pool, seqs[0], l, j, &id), 0);
			const uint32_t slot = kvr_pool_page_slot(ctx->pool, id);
			if (slot == KVR_SPILL_NO_SLOT)
				continue;
			for (uint32_t h = 0; h < N_KV; h++) { /* every run of the page */
				const off_t at = (off_t)(kvr_spill_slot_offset(sp, slot) + h * ss.run_stride);
				cr_assert_eq(pread(fd, block, ss.dio_align, at), (ssize_t)ss.dio_align);
				((unsigned char *)block)[7] ^= 0x40;
				cr_assert_eq(pwrite(fd, block, ss.dio_align, at), (ssize_t)ss.dio_align);
			}
			n_corrupted++;
		}
	}
	free(block);
	cr_assert_gt(n_corrupted, 10, "only %u of the first sequence's pages were spilled", n_corrupted);
}

Test(decode_spill, a_corrupted_sequence_fails_and_the_other_goes_on, .timeout = 120)
{
	struct run *want = malloc(sizeof(*want)), *got = malloc(sizeof(*got));
	struct kvr_context *a = make_ctx(KVR_MODE_FREEKV, KVR_KV_FORMAT_PLAIN, 0);
	decode(a, 5, want, NULL);
	kvr_context_destroy(a);
	struct kvr_context *b = make_ctx(KVR_MODE_FREEKV, KVR_KV_FORMAT_PLAIN, 12);
	decode(b, 5, got, corrupt_first);
	uint32_t failures = 0;
	for (int t = 0; t < STEPS; t++)
		for (int l = 0; l < LAYERS; l++) {
			/* the second sequence: as if the first were not there */
			cr_assert_eq(got->status[t][1][l], 0, "step %d layer %d: %d", t, l, got->status[t][1][l]);
			cr_assert_eq(memcmp(got->out[t][1][l], want->out[t][1][l], sizeof(want->out[t][1][l])), 0,
				     "step %d layer %d: the healthy sequence's output changed", t, l);
			const int32_t st = got->status[t][0][l];
			cr_assert(st == 0 || st == -EBADMSG, "step %d layer %d: status %d", t, l, st);
			if (st) {
				failures++;
				for (uint32_t i = 0; i < Q_ROW; i++)
					cr_assert_eq(got->out[t][0][l][i], 0.0f, "a failed sequence's output is zeros");
			}
		}
	cr_expect_gt(failures, 0, "the corrupted sequence never failed");
	struct kvr_pool_stats st;
	kvr_pool_get_stats(b->pool, &st);
	cr_expect_gt(st.spill_errors, 0);
	cr_expect_eq(kvr_pool_validate(b->pool, NULL), 0, "%s", kvr_pool_last_error(b->pool));
	kvr_context_destroy(b);
	free(want), free(got);
}

Test(decode_spill, config_rules)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_layers = 2, c.n_qo_heads = N_QO, c.n_kv_heads = N_KV, c.head_dim = D;
	c.page_tokens = P, c.sink_tokens = 16, c.window_tokens = 16, c.budget_tokens = 64;
	c.pool_ram_bytes = 1 << 20;
	char msg[512];
	c.recall = KVR_RECALL_ZERO_COPY;
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), -EINVAL);
	cr_expect(strstr(msg, "pool_ram_bytes") && strstr(msg, "streamed"), "%s", msg);
	c.recall = KVR_RECALL_AUTO;
	c.pool_layout = KVR_POOL_NHD;
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), -EINVAL);
	cr_expect(strstr(msg, "HND") != NULL, "%s", msg);
	c.pool_layout = KVR_POOL_HND;
	c.spill_queue_depth = 5000;
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), -EINVAL);
	c.spill_queue_depth = 0;
	memset(c.spill_dir, 'x', sizeof(c.spill_dir));
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), -EINVAL);
	cr_expect(strstr(msg, "spill_dir") != NULL, "%s", msg);
	snprintf(c.spill_dir, sizeof(c.spill_dir), "/nonexistent-kvrecall-dir");
	cr_expect_eq(kvr_config_validate(&c, msg, sizeof(msg)), 0, "%s", msg);
	/* a spill directory that does not exist: the context says which */
	struct kvr_context *ctx = NULL;
	c.threads = 1;
	c.pool_bytes = 64 << 20;
	cr_expect_eq(kvr_context_create(&c, &ctx), -ENOENT, "%s", kvr_last_error(NULL));
	cr_expect(strstr(kvr_last_error(NULL), "/nonexistent-kvrecall-dir") != NULL, "%s", kvr_last_error(NULL));
	/* auto recall resolves to streamed with a spill tier */
	c.spill_dir[0] = '\0';
	cr_assert_eq(kvr_context_create(&c, &ctx), 0, "%s", kvr_last_error(NULL));
	struct kvr_config back;
	back.size = sizeof(back);
	cr_assert_eq(kvr_context_get_config(ctx, &back), 0);
	cr_expect_eq(back.recall, KVR_RECALL_STREAMED);
	kvr_context_destroy(ctx);
}

/* ---- failures leave everything as it was (review regressions) ---- */

static uint32_t prefilled(struct kvr_context *ctx, float **k_out)
{
	uint32_t seq;
	cr_assert_eq(kvr_seq_create(ctx, &seq), 0);
	float *k = malloc(PREFILL * KV_ROW * sizeof(float)), *v = malloc(PREFILL * KV_ROW * sizeof(float));
	rng_state = 3;
	for (uint32_t i = 0; i < PREFILL * KV_ROW; i++)
		k[i] = frand(), v[i] = frand();
	for (uint32_t l = 0; l < LAYERS; l++)
		cr_assert_eq(kvr_prefill(ctx, seq, l, 0, PREFILL, k, v), 0, "%s", kvr_last_error(ctx));
	free(v);
	*k_out = k;
	return seq;
}

static void inject(struct kvr_context *ctx, uint32_t kind)
{
	const struct kvr_spill_fault f = { kind, KVR_SPILL_NO_SLOT, 0, 0 };
	kvr_spill_inject(kvr_pool_spill_file(ctx->pool), &f);
}

/* A prefill whose pages cannot be spilled (a full disk) fails and leaves
 * the sequence as it was: a later, smaller prefill works. */
Test(decode_spill, failed_prefill_changes_nothing, .timeout = 120)
{
	struct kvr_context *ctx = make_ctx(KVR_MODE_FREEKV, KVR_KV_FORMAT_PLAIN, 12);
	uint32_t seq;
	cr_assert_eq(kvr_seq_create(ctx, &seq), 0);
	float *k = calloc(PREFILL * KV_ROW, sizeof(float)), *v = calloc(PREFILL * KV_ROW, sizeof(float));
	inject(ctx, KVR_SPILL_FAULT_NOSPC);
	cr_expect_eq(kvr_prefill(ctx, seq, 0, 0, PREFILL, k, v), -ENOSPC, "%s", kvr_last_error(ctx));
	uint32_t n_pages = 99;
	uint64_t n_tokens = 99;
	kvr_pool_n_pages(ctx->pool, seq, 0, &n_pages);
	kvr_pool_n_tokens(ctx->pool, seq, 0, &n_tokens);
	cr_expect(n_pages == 0 && n_tokens == 0, "%u pages, %llu tokens left", n_pages, (unsigned long long)n_tokens);
	inject(ctx, KVR_SPILL_FAULT_NONE);
	cr_expect_eq(kvr_prefill(ctx, seq, 0, 0, 16, k, v), 0, "%s", kvr_last_error(ctx));
	cr_expect_eq(kvr_pool_validate(ctx->pool, NULL), 0, "%s", kvr_pool_last_error(ctx->pool));
	free(k), free(v);
	kvr_context_destroy(ctx);
}

/* A truncation whose kept tail page cannot be read back refuses, with
 * nothing changed; once it can, the tail rows come back exactly. */
Test(decode_spill, failed_truncate_changes_nothing, .timeout = 120)
{
	struct kvr_context *ctx = make_ctx(KVR_MODE_FREEKV, KVR_KV_FORMAT_PLAIN, 12);
	float *k;
	const uint32_t seq = prefilled(ctx, &k);
	cr_assert_geq(kvr_pool_spill_all(ctx->pool), 0);
	inject(ctx, KVR_SPILL_FAULT_READ_EIO);
	cr_expect_eq(kvr_seq_truncate(ctx, seq, 100), -EIO, "%s", kvr_last_error(ctx));
	uint64_t len = 0;
	kvr_seq_length(ctx, seq, 0, &len);
	cr_expect_eq(len, PREFILL, "a refused truncation kept %llu tokens", (unsigned long long)len);
	inject(ctx, KVR_SPILL_FAULT_NONE);
	cr_assert_eq(kvr_seq_truncate(ctx, seq, 100), 0, "%s", kvr_last_error(ctx));
	const float *tail_keys = (const float *)ctx->seqs[seq].tails; /* layer 0's keys, NHD rows */
	cr_expect_eq(memcmp(tail_keys, k + 96 * KV_ROW, 4 * KV_ROW * sizeof(float)), 0,
		     "the tail rows 96..99 were not restored");
	free(k);
	kvr_context_destroy(ctx);
}

/* Only layer 1's pages are corrupt: its failure takes back what layer 0
 * appended at the end of the step, so both layers keep one length and the
 * sequence retries its position. */
Test(decode_spill, a_step_failing_in_one_layer_keeps_the_layers_equal, .timeout = 120)
{
	struct kvr_context *ctx = make_ctx(KVR_MODE_FREEKV, KVR_KV_FORMAT_PLAIN, 12);
	float *k;
	uint32_t seq = prefilled(ctx, &k);
	free(k);
	cr_assert_geq(kvr_pool_spill_all(ctx->pool), 0);
	struct kvr_spill *sp = kvr_pool_spill_file(ctx->pool);
	struct kvr_spill_stats ss;
	kvr_spill_get_stats(sp, &ss);
	void *block = NULL;
	cr_assert_eq(posix_memalign(&block, 4096, ss.dio_align), 0);
	uint32_t n_pages = 0;
	kvr_pool_n_pages(ctx->pool, seq, 1, &n_pages);
	for (uint32_t j = 0; j < n_pages; j++) {
		uint32_t id;
		kvr_pool_lookup(ctx->pool, seq, 1, j, &id);
		const uint32_t slot = kvr_pool_page_slot(ctx->pool, id);
		for (uint32_t h = 0; slot != KVR_SPILL_NO_SLOT && h < N_KV; h++) {
			const off_t at = (off_t)(kvr_spill_slot_offset(sp, slot) + h * ss.run_stride);
			cr_assert_eq(pread(kvr_spill_fd(sp), block, ss.dio_align, at), (ssize_t)ss.dio_align);
			((unsigned char *)block)[7] ^= 0x40;
			cr_assert_eq(pwrite(kvr_spill_fd(sp), block, ss.dio_align, at), (ssize_t)ss.dio_align);
		}
	}
	free(block);
	uint64_t pos = PREFILL;
	int failed_steps = 0;
	for (int t = 0; t < 4; t++) {
		float q[Q_ROW], kk[KV_ROW], vv[KV_ROW], out[Q_ROW];
		for (uint32_t i = 0; i < Q_ROW; i++)
			q[i] = frand();
		for (uint32_t i = 0; i < KV_ROW; i++)
			kk[i] = frand(), vv[i] = frand();
		cr_assert_eq(kvr_decode_begin(ctx, &seq, &pos, 1), 0, "%s", kvr_last_error(ctx));
		int ok = 1;
		for (uint32_t l = 0; l < LAYERS; l++) {
			int32_t st = 99;
			cr_assert_eq(kvr_decode_layer(ctx, l, q, kk, vv, out, &st, NULL), 0, "%s", kvr_last_error(ctx));
			ok &= st == 0;
		}
		cr_assert_eq(kvr_decode_end(ctx), 0);
		failed_steps += !ok;
		pos += ok;
		uint64_t len0 = 0, len1 = 0;
		kvr_seq_length(ctx, seq, 0, &len0);
		kvr_seq_length(ctx, seq, 1, &len1);
		cr_assert(len0 == pos && len1 == pos, "step %d: layers hold %llu and %llu tokens, position %llu", t,
			  (unsigned long long)len0, (unsigned long long)len1, (unsigned long long)pos);
	}
	cr_expect_gt(failed_steps, 0, "layer 1's corrupt pages never failed a step");
	kvr_context_destroy(ctx);
}

/* Mixed pages still demote with a spill tier: the step's own pins on its
 * window pages are gone before the pages are judged. */
static uint64_t demoted_in(uint32_t ram_pages, uint64_t *judged)
{
	struct kvr_context *ctx = make_ctx(KVR_MODE_FREEKV, KVR_KV_FORMAT_MIXED, ram_pages);
	float *k;
	uint32_t seq = prefilled(ctx, &k);
	free(k);
	uint64_t pos = PREFILL;
	for (int t = 0; t < 200; t++) {
		float q[Q_ROW], kk[KV_ROW], vv[KV_ROW], out[Q_ROW];
		for (uint32_t i = 0; i < Q_ROW; i++)
			q[i] = 3.0f * frand();
		for (uint32_t i = 0; i < KV_ROW; i++)
			kk[i] = frand(), vv[i] = frand();
		cr_assert_eq(kvr_decode_begin(ctx, &seq, &pos, 1), 0, "%s", kvr_last_error(ctx));
		for (uint32_t l = 0; l < LAYERS; l++) {
			int32_t st = 99;
			cr_assert_eq(kvr_decode_layer(ctx, l, q, kk, vv, out, &st, NULL), 0, "%s", kvr_last_error(ctx));
			cr_assert_eq(st, 0, "%s", kvr_last_error(ctx));
		}
		cr_assert_eq(kvr_decode_end(ctx), 0);
		pos++;
	}
	struct kvr_stats st = { .size = sizeof(st) };
	cr_assert_eq(kvr_get_stats(ctx, &st), 0);
	kvr_context_destroy(ctx);
	*judged = st.pages_judged;
	return st.pages_demoted;
}

Test(decode_spill, mixed_pages_demote_with_a_spill_tier, .timeout = 240)
{
	uint64_t judged_ram, judged_spill;
	const uint64_t in_ram = demoted_in(0, &judged_ram), spilled = demoted_in(12, &judged_spill);
	cr_assert_gt(in_ram, 0, "the reference demoted nothing (%llu judged)", (unsigned long long)judged_ram);
	cr_expect_gt(spilled, 0, "%llu judged, none demoted (%llu of %llu in RAM)", (unsigned long long)judged_spill,
		     (unsigned long long)in_ram, (unsigned long long)judged_ram);
}
