/* SPDX-License-Identifier: MIT */
/*
 * test_decode.c — the decode step through the public API on the cpu backend:
 * dense decode against a double-precision reference over every token; with
 * B ≥ L every mode's output is bit-identical to dense; the sparse modes attend
 * exactly sink + k pages + window (checked against a reference over the pages
 * the mode must have picked); freekv corrects exactly the KV heads whose query
 * moved; bad input is refused and a failing sequence leaves the others intact.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrecall.h"
#define TH_SMALL_SHAPE
#include "helpers.h"


static uint64_t rng_state = 0x1234567887654321ull;
static float frand(void)
{
	return th_lcg_milli(&rng_state);
}

static struct kvr_context *make_ctx(uint32_t mode, uint32_t budget, uint32_t sink, uint32_t window,
				    uint64_t pool_pages, float tau)
{
	struct kvr_config c;
	th_config(&c, 2, N_QO, N_KV, D, KVR_DTYPE_F32, P, sink, window, budget);
	c.mode = mode;
	c.tau = tau;
	th_config_sparse(&c, 4);
	if (getenv("KVR_TEST_RECALL")) /* meson runs the suite once per recall kind */
		c.recall = (uint32_t)atoi(getenv("KVR_TEST_RECALL"));
	c.pool_bytes = pool_pages * 2ull * P * D * N_KV * 4;
	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(&c, &ctx), 0, "%s", kvr_last_error(NULL));
	return ctx;
}

struct history {
	uint64_t n;
	float *k, *v; /* n x KV_ROW */
};

static void history_prefill(struct kvr_context *ctx, uint32_t seq, struct history *h, uint64_t n)
{
	h->n = n;
	h->k = malloc(4096 * KV_ROW * sizeof(float));
	h->v = malloc(4096 * KV_ROW * sizeof(float));
	for (uint64_t i = 0; i < n * KV_ROW; i++) {
		h->k[i] = frand();
		h->v[i] = frand();
	}
	for (uint32_t l = 0; l < 2; l++)
		cr_assert_eq(kvr_prefill(ctx, seq, l, 0, (uint32_t)n, h->k, h->v), 0, "%s",
			     kvr_last_error(ctx));
}

/* Attention of query row q over the given tokens of h, in double. */
static void reference(const struct history *h, const float *q, const uint8_t *use, float *out)
{
	for (uint32_t hq = 0; hq < N_QO; hq++) {
		const uint32_t m = hq / (N_QO / N_KV);
		double mx = -INFINITY, sum = 0, acc[D] = { 0 };
		double *s = malloc(h->n * sizeof(double));
		for (uint64_t t = 0; t < h->n; t++) {
			if (use && !use[t])
				continue;
			double dot = 0;
			for (uint32_t c = 0; c < D; c++)
				dot += (double)q[hq * D + c] * h->k[t * KV_ROW + m * D + c];
			s[t] = dot / sqrt((double)D);
			mx = s[t] > mx ? s[t] : mx;
		}
		for (uint64_t t = 0; t < h->n; t++) {
			if (use && !use[t])
				continue;
			const double w = exp(s[t] - mx);
			sum += w;
			for (uint32_t c = 0; c < D; c++)
				acc[c] += w * h->v[t * KV_ROW + m * D + c];
		}
		for (uint32_t c = 0; c < D; c++)
			out[hq * D + c] = (float)(acc[c] / sum);
		free(s);
	}
}

/* A dense context (B = 64) with one sequence holding n random tokens in both
 * layers (h keeps them; history_done frees them and the context). */
static struct kvr_context *dense_with_history(uint32_t *seq, struct history *h, uint64_t n)
{
	struct kvr_context *ctx = make_ctx(KVR_MODE_DENSE, 64, 16, 16, 64, 0.9f);
	cr_assert_eq(kvr_seq_create(ctx, seq), 0);
	history_prefill(ctx, *seq, h, n);
	return ctx;
}

/* The end of a test on dense_with_history: the history freed, the context
 * destroyed. */
static void history_done(struct history *h, struct kvr_context *ctx)
{
	free(h->k), free(h->v);
	kvr_context_destroy(ctx);
}

/* One decode step of one sequence on both layers; appends to h. */
static void step(struct kvr_context *ctx, uint32_t seq, struct history *h, const float *q,
		 float out[2][Q_ROW])
{
	float k[KV_ROW], v[KV_ROW];
	for (uint32_t i = 0; i < KV_ROW; i++) {
		k[i] = frand();
		v[i] = frand();
	}
	memcpy(h->k + h->n * KV_ROW, k, sizeof(k));
	memcpy(h->v + h->n * KV_ROW, v, sizeof(v));
	const uint64_t pos = h->n++;
	cr_assert_eq(kvr_decode_begin(ctx, &seq, &pos, 1), 0, "%s", kvr_last_error(ctx));
	for (uint32_t l = 0; l < 2; l++) {
		int32_t status = 99;
		cr_assert_eq(kvr_decode_layer(ctx, l, q, k, v, out[l], &status, NULL), 0, "%s",
			     kvr_last_error(ctx));
		cr_assert_eq(status, 0, "%s", kvr_last_error(ctx));
	}
	cr_assert_eq(kvr_decode_end(ctx), 0);
}

static void random_q(float *q)
{
	for (uint32_t i = 0; i < Q_ROW; i++)
		q[i] = 3.0f * frand();
}

Test(decode, dense_matches_reference)
{
	uint32_t seq;
	struct history h;
	struct kvr_context *ctx = dense_with_history(&seq, &h, 100);
	for (int i = 0; i < 20; i++) { /* crosses a page boundary */
		float q[Q_ROW], out[2][Q_ROW], want[Q_ROW];
		random_q(q);
		step(ctx, seq, &h, q, out);
		reference(&h, q, NULL, want);
		for (uint32_t j = 0; j < Q_ROW; j++) {
			cr_assert_float_eq(out[0][j], want[j], 2e-5, "step %d elem %u", i, j);
			cr_assert_float_eq(out[1][j], want[j], 2e-5, "layer 1");
		}
	}
	history_done(&h, ctx);
}

/* With B >= L every mode attends to everything: outputs identical to dense. */
Test(decode, every_mode_equals_dense_when_budget_covers_context)
{
	static const uint32_t modes[] = { KVR_MODE_BLOCKING, KVR_MODE_SPECULATIVE, KVR_MODE_FREEKV };
	float q[20][Q_ROW];
	for (int i = 0; i < 20; i++)
		random_q(q[i]);
	float dense_out[20][2][Q_ROW];
	for (int mode_i = -1; mode_i < 3; mode_i++) {
		rng_state = 42; /* the same K/V history for every mode */
		struct kvr_context *ctx = make_ctx(mode_i < 0 ? KVR_MODE_DENSE : modes[mode_i], 256, 32,
						   32, 64, 0.9f);
		uint32_t seq;
		cr_assert_eq(kvr_seq_create(ctx, &seq), 0);
		struct history h;
		history_prefill(ctx, seq, &h, 200);
		for (int i = 0; i < 20; i++) {
			float out[2][Q_ROW];
			step(ctx, seq, &h, q[i], out);
			if (mode_i < 0)
				memcpy(dense_out[i], out, sizeof(out));
			else
				cr_assert_eq(memcmp(out, dense_out[i], sizeof(out)), 0, "mode %u step %d",
					     modes[mode_i], i);
		}
		history_done(&h, ctx);
	}
}

/* A sparse mode attends to exactly sink + its k pages + window: its output
 * equals the reference over some such set, and differs from dense. */
Test(decode, sparse_modes_attend_sink_pages_and_window)
{
	static const uint32_t modes[] = { KVR_MODE_BLOCKING, KVR_MODE_SPECULATIVE, KVR_MODE_FREEKV };
	for (int mode_i = 0; mode_i < 3; mode_i++) {
		rng_state = 7;
		/* B = 64: sink 16 + 2 pages + window 16; context ~400 */
		struct kvr_context *ctx = make_ctx(modes[mode_i], 64, 16, 16, 64, 0.9f);
		uint32_t seq;
		cr_assert_eq(kvr_seq_create(ctx, &seq), 0);
		struct history h;
		history_prefill(ctx, seq, &h, 400);
		float q[Q_ROW], out[2][Q_ROW], dense[Q_ROW];
		random_q(q);
		step(ctx, seq, &h, q, out);
		reference(&h, q, NULL, dense);
		double diff = 0;
		for (uint32_t j = 0; j < Q_ROW; j++)
			diff += fabs(out[0][j] - dense[j]);
		cr_expect_gt(diff, 1e-3, "mode %u attended densely", modes[mode_i]);
		for (uint32_t j = 0; j < Q_ROW; j++)
			cr_assert(isfinite(out[0][j]) && isfinite(out[1][j]));
		/* the first step after prefill selects with its own query: the output
		 * is the reference over sink + the best-scoring pages + window for some
		 * 2 pages per KV head; check the sink/window part by trying every pair
		 * of candidate pages for KV head 0 (candidates: pages 1..23) */
		const uint64_t n = h.n, n_full = n / P;
		int matched = 0;
		for (uint64_t a = 1; a + 1 < n_full && !matched; a++)
			for (uint64_t b = a + 1; b + 1 < n_full && !matched; b++) {
				uint8_t *use = calloc(n, 1);
				for (uint64_t t = 0; t < n; t++) {
					const uint64_t pg = t / P;
					use[t] = pg == 0 || pg == a || pg == b || pg >= n_full - 1;
				}
				float want[Q_ROW];
				reference(&h, q, use, want);
				int ok = 1;
				for (uint32_t j = 0; j < (N_QO / N_KV) * D && ok; j++) /* KV head 0's queries */
					ok = fabsf(want[j] - out[0][j]) < 2e-5f;
				matched = ok;
				free(use);
			}
		cr_expect(matched, "mode %u: output matches no sink + 2 pages + window set", modes[mode_i]);
		history_done(&h, ctx);
	}
}

Test(decode, freekv_corrects_exactly_the_heads_that_moved)
{
	/* freekv and, beside it, blocking on the same history and queries: a
	 * corrected head selects with this step's query, so its output equals
	 * blocking's bit for bit. */
	struct kvr_context *ctx[2];
	uint32_t seq[2];
	struct history h[2];
	for (int c = 0; c < 2; c++) {
		rng_state = 99;
		ctx[c] = make_ctx(c ? KVR_MODE_BLOCKING : KVR_MODE_FREEKV, 64, 16, 16, 128, 0.9f);
		cr_assert_eq(kvr_seq_create(ctx[c], &seq[c]), 0);
		history_prefill(ctx[c], seq[c], &h[c], 300);
	}
	float q[Q_ROW], out[2][2][Q_ROW];
	rng_state = 5;
	random_q(q);
	struct kvr_stats st[3];
	for (int i = 0; i < 3; i++) {
		if (i == 2) /* flip the queries of KV head 1's group only: cosine -1 */
			for (uint32_t j = (N_QO / N_KV) * D; j < Q_ROW; j++)
				q[j] = -q[j];
		for (int c = 0; c < 2; c++) {
			rng_state = 1000 + (uint64_t)i; /* the same new K/V in both */
			step(ctx[c], seq[c], &h[c], q, out[c]);
		}
		st[i].size = sizeof(st[i]);
		cr_assert_eq(kvr_get_stats(ctx[0], &st[i]), 0);
	}
	/* step 0: no previous query, nothing checked; step 1: same query, checked,
	 * none corrected; step 2: head 1 corrected in both layers */
	cr_expect_eq(st[0].checked_heads, 0);
	cr_expect_eq(st[1].checked_heads, 2 * N_KV);
	cr_expect_eq(st[1].corrected_heads, 0);
	cr_expect_eq(st[2].corrected_heads, 2, "one head in each of 2 layers");
	cr_expect_eq(st[2].steps, 3);
	cr_expect_eq(st[2].layer_decodes, 6);
	/* the controller's time by part: its speculative selections were timed,
	 * within its total; blocking's engine selects itself, so its controller
	 * scores nothing (streamed, it still recalls) */
	cr_expect_gt(st[2].controller_jobs, 0);
	cr_expect_gt(st[2].controller_score_ns, 0);
	cr_expect_gt(st[2].controller_topk_ns, 0);
	cr_expect_leq(st[2].controller_prepare_ns + st[2].controller_score_ns + st[2].controller_topk_ns,
		      st[2].controller_ns);
	if (st[2].pages_recalled + st[2].pages_hit) /* streamed recall (KVR_TEST_RECALL=2) */
		cr_expect_gt(st[2].controller_recall_ns, 0);
	else
		cr_expect_eq(st[2].controller_recall_ns, 0, "zero-copy: the controller recalls nothing");
	struct kvr_stats blk = { .size = sizeof(blk) };
	cr_assert_eq(kvr_get_stats(ctx[1], &blk), 0);
	cr_expect_eq(blk.controller_score_ns + blk.controller_topk_ns, 0);
	const size_t group = (N_QO / N_KV) * D;
	for (int l = 0; l < 2; l++)
		cr_expect_eq(memcmp(out[0][l] + group, out[1][l] + group, group * sizeof(float)), 0,
			     "layer %d: the corrected head did not select with this step's query", l);
	for (int c = 0; c < 2; c++) {
		free(h[c].k), free(h[c].v);
		kvr_context_destroy(ctx[c]);
	}
}

Test(decode, bad_input_and_per_sequence_failure)
{
	struct kvr_context *ctx = make_ctx(KVR_MODE_DENSE, 64, 16, 16, 4, 0.9f); /* 4 pages */
	uint32_t a, b;
	cr_assert_eq(kvr_seq_create(ctx, &a), 0);
	cr_assert_eq(kvr_seq_create(ctx, &b), 0);
	struct history ha, hb;
	history_prefill(ctx, a, &ha, 16); /* 1 page per layer */
	history_prefill(ctx, b, &hb, 15);  /* 1 page per layer, 15 in it */
	const uint32_t both[2] = { a, b }, twice[2] = { a, a }, unknown = 3;
	const uint64_t pos[2] = { 16, 15 };
	float q[2][Q_ROW], k[2][KV_ROW], v[2][KV_ROW], out[2][Q_ROW];
	int32_t status[2];
	for (uint32_t i = 0; i < 2 * Q_ROW; i++)
		((float *)q)[i] = frand();
	for (uint32_t i = 0; i < 2 * KV_ROW; i++)
		((float *)k)[i] = ((float *)v)[i] = frand();

	cr_expect_eq(kvr_decode_layer(ctx, 0, q, k, v, out, status, NULL), -EINVAL, "no step open");
	cr_expect_eq(kvr_decode_end(ctx), -EINVAL);
	cr_expect_eq(kvr_decode_begin(ctx, twice, pos, 2), -EINVAL);
	cr_expect(strstr(kvr_last_error(ctx), "appears twice") != NULL);
	cr_expect_eq(kvr_decode_begin(ctx, &unknown, pos, 1), -EINVAL);
	cr_expect_eq(kvr_decode_begin(ctx, both, pos, 5), -EINVAL, "larger than max_batch");
	cr_assert_eq(kvr_decode_begin(ctx, both, pos, 2), 0);
	cr_expect_eq(kvr_decode_begin(ctx, both, pos, 2), -EBUSY);
	cr_expect_eq(kvr_decode_layer(ctx, 2, q, k, v, out, status, NULL), -EINVAL);
	cr_expect_eq(kvr_decode_layer(ctx, 0, q, NULL, v, out, status, NULL), -EINVAL);

	/* pool: a has 2 pages, b has 2 pages: full. a's token starts a new page
	 * (position 16) and cannot get one; b's fits in its partial page. */
	cr_assert_eq(kvr_decode_layer(ctx, 0, q, k, v, out, status, NULL), 0);
	cr_expect_eq(status[0], -ENOMEM);
	cr_expect_eq(status[1], 0);
	for (uint32_t j = 0; j < Q_ROW; j++)
		cr_expect_eq(out[0][j], 0.0f, "a failed sequence outputs zeros");
	memcpy(hb.k + 15 * KV_ROW, k[1], sizeof(k[1]));
	memcpy(hb.v + 15 * KV_ROW, v[1], sizeof(v[1]));
	hb.n = 16;
	float want[Q_ROW];
	reference(&hb, q[1], NULL, want);
	for (uint32_t j = 0; j < Q_ROW; j++)
		cr_expect_float_eq(out[1][j], want[j], 2e-5, "the other sequence is unaffected");
	/* every layer is decoded before the step ends; a fails there too */
	cr_assert_eq(kvr_decode_layer(ctx, 1, q, k, v, out, status, NULL), 0);
	cr_expect_eq(status[0], -ENOMEM);
	cr_expect_eq(status[1], 0);
	cr_assert_eq(kvr_decode_end(ctx), 0, "%s", kvr_last_error(ctx));
	uint64_t len;
	kvr_seq_length(ctx, a, 0, &len);
	cr_expect_eq(len, 16, "the failed token was not stored");
	free(ha.k), free(ha.v), free(hb.k), free(hb.v);
	kvr_context_destroy(ctx);
}

/* Output row t of prefill attention (out) is query t's attention over
 * tokens 0..t of h, for each of the n queries. */
static void assert_causal_outputs(const struct history *h, const float *q, const float *out, uint64_t n)
{
	for (uint64_t t = 0; t < n; t++) {
		struct history upto = *h;
		upto.n = t + 1;
		float ref[Q_ROW];
		reference(&upto, q + t * Q_ROW, NULL, ref);
		for (uint32_t i = 0; i < Q_ROW; i++)
			cr_assert_float_eq(out[t * Q_ROW + i], ref[i], 1e-4, "length %llu query %llu element %u",
					   (unsigned long long)n, (unsigned long long)t, i);
	}
}

/* Prefill attention at the edges of a page and long: 1, p − 1, p, p + 1 and
 * 3,000 tokens, in chunks of 37 (odd: the cpu backend's blocks of 64 / G
 * queries end inside pages and inside chunks), every query against the
 * double reference. */
Test(decode, prefill_attention_edge_and_long_lengths, .timeout = 300)
{
	static const uint64_t lengths[] = { 1, P - 1, P, P + 1, 3000 };
	for (uint32_t li = 0; li < sizeof(lengths) / sizeof(lengths[0]); li++) {
		const uint64_t n = lengths[li];
		struct kvr_context *ctx = make_ctx(KVR_MODE_FREEKV, 64, 16, 16, 512, 0.9f); /* 2 layers of 188 pages */
		uint32_t seq;
		cr_assert_eq(kvr_seq_create(ctx, &seq), 0);
		struct history h;
		history_prefill(ctx, seq, &h, n);
		float *q = malloc(n * Q_ROW * sizeof(float)), *out = malloc(n * Q_ROW * sizeof(float));
		for (uint64_t i = 0; i < n * Q_ROW; i++)
			q[i] = frand();
		for (uint64_t at = 0; at < n; at += 37) {
			const uint32_t c = n - at < 37 ? (uint32_t)(n - at) : 37;
			cr_assert_eq(kvr_prefill_attention(ctx, seq, 1, at, c, q + at * Q_ROW, out + at * Q_ROW), 0,
				     "%s", kvr_last_error(ctx));
		}
		assert_causal_outputs(&h, q, out, n);
		free(q), free(out), free(h.k), free(h.v);
		kvr_context_destroy(ctx);
	}
}

/* Prefill attention: each query attends causally to tokens 0..its position,
 * reading offloaded pages, pages partly needed (the query sits inside a page
 * already in the pool) and the tail tile; chunks of any size. */
Test(decode, prefill_attention_is_causal_dense_attention)
{
	struct kvr_context *ctx = make_ctx(KVR_MODE_FREEKV, 64, 16, 16, 256, 0.9f);
	uint32_t seq;
	cr_assert_eq(kvr_seq_create(ctx, &seq), 0);
	struct history h;
	const uint64_t n = 77; /* 4 full pages of 16 and a tail of 13 */
	history_prefill(ctx, seq, &h, n);
	float *q = malloc(n * Q_ROW * sizeof(float)), *out = malloc(n * Q_ROW * sizeof(float));
	for (uint64_t i = 0; i < n * Q_ROW; i++)
		q[i] = frand();
	const uint32_t chunks[] = { 5, 16, 30, 26 }; /* 77 tokens */
	uint64_t at = 0;
	for (uint32_t c = 0; c < 4; c++) {
		cr_assert_eq(kvr_prefill_attention(ctx, seq, 1, at, chunks[c], q + at * Q_ROW,
						   out + at * Q_ROW),
			     0, "%s", kvr_last_error(ctx));
		at += chunks[c];
	}
	assert_causal_outputs(&h, q, out, n);
	/* positions not stored yet, and a step in progress, are refused */
	cr_expect_eq(kvr_prefill_attention(ctx, seq, 1, 70, 8, q, out), -EINVAL);
	cr_expect(strstr(kvr_last_error(ctx), "kvr_prefill first") != NULL, "%s", kvr_last_error(ctx));
	const uint64_t pos = n;
	cr_assert_eq(kvr_decode_begin(ctx, &seq, &pos, 1), 0);
	cr_expect_eq(kvr_prefill_attention(ctx, seq, 1, 0, 4, q, out), -EBUSY);
	kvr_decode_end(ctx);
	free(q), free(out);
	history_done(&h, ctx);
}

/* The open step guards its sequences: a sequence named by the step
 * cannot be freed, forked, truncated or prefilled until kvr_decode_end (-EBUSY,
 * nothing changed); a layer decoded twice is refused alone and leaves the step
 * intact; a step ended with a layer never decoded is refused and taken back
 * in every layer, so the sequence stays usable. */
Test(decode, open_step_refuses_calls_that_change_its_sequences)
{
	struct kvr_context *ctx = make_ctx(KVR_MODE_DENSE, 64, 16, 16, 64, 0.9f);
	uint32_t a, other, fork;
	cr_assert_eq(kvr_seq_create(ctx, &a), 0);
	cr_assert_eq(kvr_seq_create(ctx, &other), 0);
	struct history h;
	history_prefill(ctx, a, &h, 20);
	float q[Q_ROW], k[KV_ROW], v[KV_ROW], out[Q_ROW];
	for (uint32_t i = 0; i < Q_ROW; i++)
		q[i] = frand();
	for (uint32_t i = 0; i < KV_ROW; i++)
		k[i] = v[i] = frand();
	const uint64_t pos = 20;
	cr_assert_eq(kvr_decode_begin(ctx, &a, &pos, 1), 0);
	int32_t status = 1;
	cr_assert_eq(kvr_decode_layer(ctx, 0, q, k, v, out, &status, NULL), 0, "%s", kvr_last_error(ctx));
	cr_assert_eq(status, 0);

	cr_expect_eq(kvr_seq_free(ctx, a), -EBUSY);
	cr_expect(strstr(kvr_last_error(ctx), "open decode step") != NULL, "%s", kvr_last_error(ctx));
	cr_expect_eq(kvr_seq_truncate(ctx, a, 5), -EBUSY);
	cr_expect_eq(kvr_seq_fork(ctx, a, &fork), -EBUSY);
	cr_expect_eq(kvr_prefill(ctx, a, 1, 20, 1, k, v), -EBUSY);
	/* a sequence outside the step is not held up */
	cr_expect_eq(kvr_prefill(ctx, other, 0, 0, 1, k, v), 0, "%s", kvr_last_error(ctx));

	/* layer 0 again: refused alone */
	status = 1;
	cr_expect_eq(kvr_decode_layer(ctx, 0, q, k, v, out, &status, NULL), -EINVAL);
	cr_expect(strstr(kvr_last_error(ctx), "already decoded") != NULL, "%s", kvr_last_error(ctx));
	cr_assert_eq(kvr_decode_layer(ctx, 1, q, k, v, out, &status, NULL), 0, "%s", kvr_last_error(ctx));
	cr_expect_eq(status, 0, "the repeat did not harm the step: %s", kvr_last_error(ctx));
	cr_assert_eq(kvr_decode_end(ctx), 0, "%s", kvr_last_error(ctx));
	for (uint32_t l = 0; l < 2; l++) {
		uint64_t len = 0;
		cr_assert_eq(kvr_seq_length(ctx, a, l, &len), 0);
		cr_expect_eq(len, 21, "layer %u holds the step's token once", l);
	}
	/* after the step, the same calls work */
	cr_expect_eq(kvr_seq_truncate(ctx, a, 21), 0, "%s", kvr_last_error(ctx));

	/* a step that decodes layer 1 only: decode_end refuses it, every layer
	 * is back at 21 tokens, and the next step at position 21 works */
	const uint64_t pos2 = 21;
	cr_assert_eq(kvr_decode_begin(ctx, &a, &pos2, 1), 0);
	cr_assert_eq(kvr_decode_layer(ctx, 1, q, k, v, out, &status, NULL), 0, "%s", kvr_last_error(ctx));
	cr_expect_eq(kvr_decode_end(ctx), -EINVAL);
	cr_expect(strstr(kvr_last_error(ctx), "layer 0 was not decoded") != NULL, "%s",
		  kvr_last_error(ctx));
	for (uint32_t l = 0; l < 2; l++) {
		uint64_t len = 0;
		cr_assert_eq(kvr_seq_length(ctx, a, l, &len), 0);
		cr_expect_eq(len, 21, "layer %u was taken back to the step's position", l);
	}
	cr_assert_eq(kvr_decode_begin(ctx, &a, &pos2, 1), 0, "%s", kvr_last_error(ctx));
	for (uint32_t l = 0; l < 2; l++) {
		cr_assert_eq(kvr_decode_layer(ctx, l, q, k, v, out, &status, NULL), 0, "%s",
			     kvr_last_error(ctx));
		cr_expect_eq(status, 0, "%s", kvr_last_error(ctx));
	}
	cr_assert_eq(kvr_decode_end(ctx), 0, "%s", kvr_last_error(ctx));
	/* freeing with the step closed works, and the id is reusable */
	cr_expect_eq(kvr_seq_free(ctx, a), 0);
	history_done(&h, ctx);
}

/* A failure reads as one sentence: the call, the subject once, the reason. A
 * sequence failing in layer 0 keeps layer 0's message through layer 1. */
Test(decode, a_failure_is_one_sentence)
{
	uint32_t a;
	struct history h;
	struct kvr_context *ctx = dense_with_history(&a, &h, 20);
	float q[Q_ROW] = { 0 }, k[KV_ROW] = { 0 }, v[KV_ROW] = { 0 }, out[Q_ROW];
	const uint64_t wrong = 21; /* the layers hold 20 tokens */
	cr_assert_eq(kvr_decode_begin(ctx, &a, &wrong, 1), 0);
	int32_t status = 0;
	cr_assert_eq(kvr_decode_layer(ctx, 0, q, k, v, out, &status, NULL), 0);
	cr_expect_eq(status, -EINVAL);
	char first[512];
	snprintf(first, sizeof(first), "%s", kvr_last_error(ctx));
	cr_assert_eq(kvr_decode_layer(ctx, 1, q, k, v, out, &status, NULL), 0);
	cr_expect_eq(status, -EINVAL);
	cr_expect_str_eq(kvr_last_error(ctx), first, "layer 1 kept the failure's own message");
	cr_expect_str_eq(first,
			 "decode_layer: sequence 0 layer 0: tokens must arrive in order: expected "
			 "position 20, got 21");
	cr_assert_eq(kvr_decode_end(ctx), 0);
	history_done(&h, ctx);
}

/* Prefill attention at positions that would wrap around 2^64 is refused. */
Test(decode, prefill_attention_positions_do_not_wrap)
{
	uint32_t a;
	struct history h;
	struct kvr_context *ctx = dense_with_history(&a, &h, 20);
	float q[2 * Q_ROW] = { 0 }, out[2 * Q_ROW];
	for (uint32_t i = 0; i < 2 * Q_ROW; i++)
		out[i] = 7.0f;
	cr_expect_eq(kvr_prefill_attention(ctx, a, 0, UINT64_MAX, 2, q, out), -EINVAL);
	cr_expect(strstr(kvr_last_error(ctx), "not stored") != NULL, "%s", kvr_last_error(ctx));
	cr_expect_eq(kvr_prefill_attention(ctx, a, 0, UINT64_MAX - 5, 10, q, out), -EINVAL);
	for (uint32_t i = 0; i < 2 * Q_ROW; i++)
		cr_expect_eq(out[i], 7.0f, "nothing written");
	history_done(&h, ctx);
}

/* A step at a position a layer is not at fails the sequence there and takes
 * back only what the step stored: layer 0 (18 tokens) appends at 18, layer 1
 * (19 tokens, one prefilled ahead) refuses position 18 — and must still hold
 * its 19 tokens after the step, not be cut to the step's position (found by
 * tests/api_sequence.c). A position below every layer's length changes
 * nothing either. */
Test(decode, a_bad_position_takes_back_only_what_the_step_stored)
{
	uint32_t s;
	struct history h;
	struct kvr_context *ctx = dense_with_history(&s, &h, 18);
	cr_assert_eq(kvr_prefill(ctx, s, 1, 18, 1, h.k, h.v), 0, "%s", kvr_last_error(ctx));
	float q[Q_ROW], k[KV_ROW], v[KV_ROW], out[Q_ROW];
	random_q(q);
	for (uint32_t i = 0; i < KV_ROW; i++)
		k[i] = v[i] = frand();
	const uint64_t positions[] = { 18, 5 };
	for (uint32_t round = 0; round < 2; round++) {
		cr_assert_eq(kvr_decode_begin(ctx, &s, &positions[round], 1), 0, "%s", kvr_last_error(ctx));
		int32_t status[2] = { 99, 99 };
		for (uint32_t l = 0; l < 2; l++)
			cr_assert_eq(kvr_decode_layer(ctx, l, q, k, v, out, &status[l], NULL), 0, "%s",
				     kvr_last_error(ctx));
		cr_expect_eq(status[0], round ? -EINVAL : 0, "round %u layer 0: status %d", round, status[0]);
		cr_expect_eq(status[1], -EINVAL, "round %u layer 1: status %d", round, status[1]);
		cr_assert_eq(kvr_decode_end(ctx), 0, "%s", kvr_last_error(ctx));
		uint64_t len[2];
		for (uint32_t l = 0; l < 2; l++)
			cr_assert_eq(kvr_seq_length(ctx, s, l, &len[l]), 0);
		cr_expect_eq(len[0], 18, "round %u: layer 0 holds %llu tokens, held 18", round,
			     (unsigned long long)len[0]);
		cr_expect_eq(len[1], 19, "round %u: layer 1 holds %llu tokens, held 19", round,
			     (unsigned long long)len[1]);
	}
	history_done(&h, ctx);
}

/* ------------------------------------------------- the engine's parallel-for */

/* A kvr_parallel_for_fn that counts its calls, then runs them on a public
 * thread pool (an engine's pool shared with kvrecall). */
struct counted_pool {
	struct kvr_thread_pool *pool;
	_Atomic uint64_t calls; /* relaxed: read after the context's calls returned */
};

static void counted_parallel_for(void *user, kvr_task_fn task, void *arg, uint32_t n)
{
	struct counted_pool *cp = user;
	atomic_fetch_add_explicit(&cp->calls, 1, memory_order_relaxed);
	kvr_thread_pool_parallel_for(cp->pool, task, arg, n);
}

/* Prefill 100 tokens into one sequence, then 20 decode steps; the outputs. */
static void decode_run(struct kvr_config *c, float *outs /* [20][2][Q_ROW] */)
{
	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(c, &ctx), 0, "%s", kvr_last_error(NULL));
	uint32_t seq;
	cr_assert_eq(kvr_seq_create(ctx, &seq), 0);
	rng_state = 0x5eed;
	struct history h;
	history_prefill(ctx, seq, &h, 100);
	for (uint32_t step = 0; step < 20; step++) {
		float q[Q_ROW], k[KV_ROW], v[KV_ROW];
		for (int i = 0; i < Q_ROW; i++)
			q[i] = frand();
		for (int i = 0; i < KV_ROW; i++)
			k[i] = frand(), v[i] = frand();
		const uint64_t pos = 100 + step;
		int32_t status = -1;
		cr_assert_eq(kvr_decode_begin(ctx, &seq, &pos, 1), 0, "%s", kvr_last_error(ctx));
		for (uint32_t l = 0; l < 2; l++) {
			cr_assert_eq(kvr_decode_layer(ctx, l, q, k, v, outs + ((size_t)step * 2 + l) * Q_ROW,
						      &status, NULL),
				     0, "%s", kvr_last_error(ctx));
			cr_assert_eq(status, 0);
		}
		cr_assert_eq(kvr_decode_end(ctx), 0);
	}
	free(h.k);
	free(h.v);
	kvr_context_destroy(ctx);
}

/* kvr_config.parallel_for: the cpu backend runs its kernels through the
 * engine's parallel-for (and starts no workers of its own), with the same
 * outputs bit for bit as on its own workers. */
Test(decode, engine_parallel_for_runs_the_kernels)
{
	struct counted_pool cp = { NULL, 0 };
	cr_assert_eq(kvr_thread_pool_create(1, &cp.pool), 0, "%s", kvr_last_error(NULL));
	cr_assert_eq(kvr_thread_pool_threads(cp.pool), 1);
	struct kvr_config c;
	th_config(&c, 2, N_QO, N_KV, D, KVR_DTYPE_F32, P, P, P, 4 * P);
	c.mode = KVR_MODE_FREEKV;
	th_config_sparse(&c, 1);
	c.pool_bytes = 256 * 2ull * P * D * N_KV * 4;
	static float own[20 * 2 * Q_ROW], engine[20 * 2 * Q_ROW];
	decode_run(&c, own);
	c.parallel_for = counted_parallel_for;
	c.parallel_user = &cp;
	c.threads = kvr_thread_pool_threads(cp.pool);
	decode_run(&c, engine);
	cr_expect_gt(atomic_load_explicit(&cp.calls, memory_order_relaxed), 0,
		     "the cpu backend never called the engine's parallel-for");
	cr_expect_eq(memcmp(own, engine, sizeof(own)), 0, "outputs differ with the engine's workers");
	kvr_thread_pool_destroy(cp.pool);
}

/* The public pool runs every task exactly once, with 0 to 3 workers, and
 * while another thread's call holds the workers (that call's tasks then run
 * on its caller). */
struct pool_count {
	_Atomic uint32_t *hits;
};

static void hit(void *arg, uint32_t index)
{
	struct pool_count *pc = arg;
	atomic_fetch_add_explicit(&pc->hits[index], 1, memory_order_relaxed);
}

struct pool_caller {
	struct kvr_thread_pool *pool;
	_Atomic uint32_t hits[257];
};

static void *pool_call_many(void *arg)
{
	struct pool_caller *pc = arg;
	struct pool_count count = { pc->hits };
	for (int r = 0; r < 200; r++)
		kvr_thread_pool_parallel_for(pc->pool, hit, &count, 257);
	return NULL;
}

Test(decode, thread_pool_runs_every_task_once)
{
	for (uint32_t threads = 0; threads <= 3; threads++) {
		struct kvr_thread_pool *pool = NULL;
		cr_assert_eq(kvr_thread_pool_create(threads, &pool), 0, "%s", kvr_last_error(NULL));
		cr_assert_eq(kvr_thread_pool_threads(pool), threads);
		static struct pool_caller callers[2];
		pthread_t t[2];
		for (int i = 0; i < 2; i++) {
			callers[i].pool = pool;
			for (int j = 0; j < 257; j++)
				atomic_store(&callers[i].hits[j], 0);
			cr_assert_eq(pthread_create(&t[i], NULL, pool_call_many, &callers[i]), 0);
		}
		for (int i = 0; i < 2; i++)
			pthread_join(t[i], NULL);
		for (int i = 0; i < 2; i++)
			for (int j = 0; j < 257; j++)
				cr_assert_eq(atomic_load(&callers[i].hits[j]), 200, "threads %u caller %d task %d",
					     threads, i, j);
		kvr_thread_pool_destroy(pool);
	}
	struct kvr_thread_pool *pool = NULL;
	cr_expect_eq(kvr_thread_pool_create(2000, &pool), -EINVAL);
	cr_expect(strstr(kvr_last_error(NULL), "threads") != NULL, "%s", kvr_last_error(NULL));
	cr_expect_eq(kvr_thread_pool_create(1, NULL), -EINVAL);
	kvr_thread_pool_destroy(NULL); /* NULL-safe */
}
