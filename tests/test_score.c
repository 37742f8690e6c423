/* SPDX-License-Identifier: MIT */
/*
 * test_score.c — the cpu backend's score and select kernels, bit for bit,
 * against a plain scalar transcription of kernels.h's definitions written
 * here (kmath.h's quest term, kvr_fold_lanes and kvr_expf, loops in the
 * canonical orders, nothing vectorised, nothing reordered).
 *
 * The CUDA kernels compute the same canonical orders, so the pages the cpu
 * backend selects must not depend on how its kernels are vectorised: any
 * change to the vector code that moves one rounding shows up here as a
 * differing bit, on every instruction set the CPU has (scalar, AVX2+F16C,
 * AVX-512), for group sizes 1, 4, 8, head dims 32 to 256, f16, bf16 and f32,
 * and candidate counts that leave partial 16-page batches and wrap the
 * 256-lane page sum. Beyond random finite inputs: zeros of both signs,
 * products that overflow or underflow, summaries with min > max, NaN or
 * infinite summaries, and non-finite queries (there only NaN-ness must
 * match: a NaN's payload is not part of the contract).
 *
 * Select is checked against a sort of the 64-bit keys (ordered score, then
 * the lower page) on scores with many ties.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "convert.h"
#include "../gpu/cpu/cpu_backend.h"
#include "half.h"
#include "kmath.h"
#include "helpers.h"

static const enum kvr_convert_isa all_isas[] = { KVR_CONVERT_SCALAR, KVR_CONVERT_AVX2,
						 KVR_CONVERT_AVX512 };
static const uint32_t all_types[] = { KVR_ELEM_F16, KVR_ELEM_BF16, KVR_ELEM_F32 };
static const char *const type_names[] = { "f16", "bf16", "f32" };

/* xorshift64*: the same sequence everywhere for a seed */
static uint64_t rng_state;
static uint64_t rng(void)
{
	return th_xorshift64star(&rng_state);
}

static float uniform(float lo, float hi)
{
	return lo + (hi - lo) * (float)(rng() >> 40) * 0x1p-24f;
}

static struct kvr_dev *cpu_dev(void)
{
	/* one worker besides the caller: heads are scored on two threads */
	struct kvr_dev_params p = { .kind = KVR_DEV_CPU, .threads = 1 };
	struct kvr_dev *dev = NULL;
	char err[256];
	cr_assert_eq(kvr_dev_create(&p, &dev, err, sizeof(err)), 0, "cpu device: %s", err);
	return dev;
}

/* ------------------------------------------------------------------ reference */

/* kernels.h "score", literally: per KV head m and query head h of its group,
 * s_hj = scale · Σ_c q_hc·(q_hc's sign bit set ? min_jc : max_jc), each term
 * added by one fused multiply-add, in 16 lanes folded by
 * halves for every page j of the softmax domain; softmax over the domain
 * (max, kvr_expf, 256 lanes folded from its first page); group mean for each
 * candidate. The domain is written out here rather than taken from
 * kvr_score_domain, so a wrong helper fails the test. */
static void ref_score(const struct kvr_shape *sh, const struct kvr_score_item *it, float *out)
{
	const uint32_t n_kv = sh->n_kv_heads, G = sh->n_qo_heads / n_kv, d = sh->head_dim;
	const uint32_t t = sh->elem_type, n = it->cand_end - it->cand_begin;
	const uint32_t first = it->norm_end ? 0 : it->cand_begin;
	const uint32_t last = it->norm_end > it->cand_end ? it->norm_end : it->cand_end;
	const uint32_t n_dom = last - first, off = it->cand_begin - first;
	float *s = malloc(n_dom * sizeof(*s));
	cr_assert(s);
	for (uint32_t m = 0; m < n_kv; m++) {
		float *o = out + (uint64_t)m * n;
		for (uint32_t j = 0; j < n; j++)
			o[j] = 0.0f;
		for (uint32_t g = 0; g < G; g++) {
			const uint64_t qh = (uint64_t)(m * G + g) * d;
			for (uint32_t j = 0; j < n_dom; j++) {
				const uint64_t base = ((uint64_t)(first + j) * n_kv + m) * 2 * d;
				float lanes[KVR_DOT_LANES] = { 0 };
				for (uint32_t c = 0; c < d; c++) {
					const float q = kvr_load_f32(it->q, t, qh + c);
					const float lo = kvr_load_f32(it->summaries, t, base + c);
					const float hi = kvr_load_f32(it->summaries, t, base + d + c);
					lanes[c % KVR_DOT_LANES] = fmaf(q, signbit(q) ? lo : hi, lanes[c % KVR_DOT_LANES]);
				}
				s[j] = sh->scale * kvr_fold_lanes(lanes, KVR_DOT_LANES);
			}
			float mx = -INFINITY;
			for (uint32_t j = 0; j < n_dom; j++)
				if (s[j] > mx)
					mx = s[j];
			float lanes[KVR_SUM_LANES] = { 0 };
			for (uint32_t j = 0; j < n_dom; j++) {
				s[j] = kvr_expf(s[j] - mx);
				lanes[j % KVR_SUM_LANES] = lanes[j % KVR_SUM_LANES] + s[j];
			}
			const float inv = 1.0f / kvr_fold_lanes(lanes, KVR_SUM_LANES);
			for (uint32_t j = 0; j < n; j++)
				o[j] = o[j] + s[off + j] * inv;
		}
		const float inv_g = 1.0f / (float)G;
		for (uint32_t j = 0; j < n; j++)
			o[j] = o[j] * inv_g;
	}
	free(s);
}

static uint64_t select_key(float score, uint32_t j)
{
	const uint32_t u = kvr_f32_to_bits(score);
	const uint32_t ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
	return (uint64_t)ordered << 32 | (0xffffffffu - j);
}

static int by_key_desc(const void *a, const void *b)
{
	const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? 1 : (x > y ? -1 : 0);
}

/* kernels.h "select", by sorting every candidate's key */
static void ref_select(const struct kvr_shape *sh, const struct kvr_score_item *it, int32_t *out)
{
	const uint32_t n = it->cand_end > it->cand_begin ? it->cand_end - it->cand_begin : 0;
	const uint32_t take = it->k < n ? it->k : n;
	uint64_t *keys = malloc((n ? n : 1) * sizeof(*keys));
	uint8_t *chosen = malloc(n ? n : 1);
	cr_assert(keys && chosen);
	for (uint32_t m = 0; m < sh->n_kv_heads; m++) {
		for (uint32_t j = 0; j < n; j++)
			keys[j] = select_key(it->scores[(uint64_t)m * n + j], j);
		qsort(keys, n, sizeof(*keys), by_key_desc);
		memset(chosen, 0, n ? n : 1);
		for (uint32_t r = 0; r < take; r++)
			chosen[0xffffffffu - (uint32_t)keys[r]] = 1;
		uint32_t w = 0;
		for (uint32_t j = 0; j < n; j++)
			if (chosen[j])
				out[(uint64_t)m * it->k + w++] = (int32_t)(it->cand_begin + j);
		for (; w < it->k; w++)
			out[(uint64_t)m * it->k + w] = -1;
	}
	free(keys);
	free(chosen);
}

/* ------------------------------------------------------------------ inputs */

enum input_kind {
	INPUT_RANDOM,   /* finite, min <= max */
	INPUT_EDGES,    /* finite: signed zeros, min == max, overflow, underflow */
	INPUT_BAD_PAGE, /* finite q; pages with min > max, NaN or infinite bounds */
	INPUT_BAD_Q,    /* one query head with an infinity, another with a NaN */
	N_INPUT_KINDS
};
static const char *const kind_names[] = { "random", "edges", "bad pages", "non-finite q" };

static float edge_value(uint32_t type)
{
	/* large enough that a product overflows (f32 only: f16/bf16 round them
	 * to infinity, which INPUT_BAD_PAGE covers), small enough to underflow */
	static const float f32_vals[] = { 0.0f, -0.0f, 1e30f, -1e30f, 3e-30f, -3e-30f, 1.0f, -1.0f, 0.5f };
	static const float half_vals[] = { 0.0f, -0.0f, 6e-5f, -6e-5f, 1.0f, -1.0f, 0.5f, 2.0f, 3e4f };
	const float *v = type == KVR_ELEM_F32 ? f32_vals : half_vals;
	return v[rng() % 9];
}

static void fill_inputs(enum input_kind kind, uint32_t type, const struct kvr_shape *sh,
			uint32_t n_pages, void *q, void *summ)
{
	const uint32_t d = sh->head_dim, n_kv = sh->n_kv_heads;
	for (uint64_t i = 0; i < (uint64_t)sh->n_qo_heads * d; i++) {
		float x = uniform(-2.0f, 2.0f);
		if (kind == INPUT_EDGES && rng() % 3 == 0)
			x = type == KVR_ELEM_F32 ? (rng() % 2 ? 1e10f : -1e-10f) * x : (rng() % 2 ? 0.0f : -0.0f);
		if (kind == INPUT_BAD_PAGE && rng() % 4 == 0) /* 0 · inf = NaN: which product wins */
			x = rng() % 2 ? 0.0f : -0.0f;
		kvr_store_f32(q, type, i, x);
	}
	if (kind == INPUT_BAD_Q) {
		/* -inf against a min of 0 on every other page below: -inf · 0 is
		 * NaN where -inf · max is -inf, a score that softmax turns into 0 */
		kvr_store_f32(q, type, 5, -INFINITY);
		if (sh->n_kv_heads > 1) /* a NaN in the next KV head's group, not this one's */
			kvr_store_f32(q, type, (uint64_t)(sh->n_qo_heads / sh->n_kv_heads) * d + 7, NAN);
	}
	for (uint32_t j = 0; j < n_pages; j++)
		for (uint32_t m = 0; m < n_kv; m++) {
			const uint64_t base = ((uint64_t)j * n_kv + m) * 2 * d;
			const uint32_t page_bad = kind == INPUT_BAD_PAGE ? (uint32_t)(rng() % 6) : 0;
			for (uint32_t c = 0; c < d; c++) {
				float a = uniform(-1.5f, 1.5f), b = uniform(-1.5f, 1.5f);
				if (kind == INPUT_EDGES && rng() % 4 == 0)
					a = edge_value(type), b = rng() % 2 ? a : edge_value(type);
				float lo = a < b ? a : b, hi = a < b ? b : a;
				if (page_bad == 1 && c == d / 2) /* min > max */
					lo = hi + 0.25f;
				if (page_bad == 2 && c == 3)
					lo = NAN;
				if (page_bad == 3 && c == d - 1)
					hi = NAN;
				if (page_bad == 4 && c == 1)
					lo = -INFINITY, hi = INFINITY;
				if (page_bad == 5 && c == 2) /* ordered, one bound infinite */
					lo = -INFINITY;
				if (kind == INPUT_BAD_Q && m == 0 && c == 5) /* +inf or NaN vs 0 */
					lo = j % 2 ? 0.0f : -0.5f, hi = 0.5f;
				kvr_store_f32(summ, type, base + c, lo);
				kvr_store_f32(summ, type, base + d + c, hi);
			}
		}
}

/* Equal bits, or both NaN. */
static int same_float(float a, float b)
{
	return kvr_f32_to_bits(a) == kvr_f32_to_bits(b) || (isnan(a) && isnan(b));
}

/* ------------------------------------------------------------------ tests */

/* norm_end as in kvr_score_item (0: softmax over the candidates); the
 * summaries hold every page up to the larger of it and the candidates' end */
static void check_shape_norm(struct kvr_dev *dev, uint32_t type_index, uint32_t G, uint32_t d,
			     uint32_t n_cand, uint32_t norm_end, enum input_kind kind, uint64_t seed)
{
	const uint32_t type = all_types[type_index], n_kv = 2, begin = 3, k = 7;
	const uint32_t n_pages = norm_end > begin + n_cand ? norm_end : begin + n_cand;
	const struct kvr_shape sh = { G * n_kv, n_kv, d, 32, type, 1.0f / sqrtf((float)d), 0.9f, 0, 0, 0, 0 };
	const size_t eb = kvr_elem_bytes(type);
	rng_state = seed;
	void *q = malloc((size_t)sh.n_qo_heads * d * eb);
	void *summ = malloc((size_t)n_pages * n_kv * 2 * d * eb);
	float *want = malloc((size_t)n_kv * n_cand * sizeof(float));
	float *got = malloc((size_t)n_kv * n_cand * sizeof(float));
	int32_t *want_sel = malloc((size_t)n_kv * k * sizeof(int32_t));
	int32_t *got_sel = malloc((size_t)n_kv * k * sizeof(int32_t));
	cr_assert(q && summ && want && got && want_sel && got_sel);
	fill_inputs(kind, type, &sh, n_pages, q, summ);

	struct kvr_score_item it = { q, summ, want, want_sel, begin, begin + n_cand, k, norm_end, NULL };
	ref_score(&sh, &it, want);
	ref_select(&sh, &it, want_sel);

	const enum kvr_convert_isa active = kvr_convert_isa_active();
	for (uint32_t i = 0; i < sizeof(all_isas) / sizeof(all_isas[0]); i++) {
		if (kvr_convert_isa_force(all_isas[i]) != all_isas[i])
			continue; /* the CPU lacks it */
		memset(got, 0xa5, (size_t)n_kv * n_cand * sizeof(float));
		it.scores = got;
		it.selected = got_sel;
		kvr_cpu_score(dev, &sh, &it, 1);
		for (uint32_t x = 0; x < n_kv * n_cand; x++)
			cr_assert(same_float(got[x], want[x]),
				  "score %s, %s, %s inputs, G=%u d=%u n_cand=%u: KV head %u candidate %u: "
				  "got %.9g (0x%08x), want %.9g (0x%08x) (norm_end %u)",
				  kvr_convert_isa_name(all_isas[i]), type_names[type_index], kind_names[kind],
				  G, d, n_cand, x / n_cand, x % n_cand, got[x], kvr_f32_to_bits(got[x]),
				  want[x], kvr_f32_to_bits(want[x]), norm_end);
		/* select over the reference's scores: the same bits in any case */
		it.scores = want;
		kvr_cpu_select(dev, &sh, &it, 1);
		cr_assert(!memcmp(got_sel, want_sel, (size_t)n_kv * k * sizeof(int32_t)),
			  "select %s, %s, %s inputs, G=%u d=%u n_cand=%u: selection differs",
			  kvr_convert_isa_name(all_isas[i]), type_names[type_index], kind_names[kind], G,
			  d, n_cand);
	}
	kvr_convert_isa_force(active);
	free(q), free(summ), free(want), free(got), free(want_sel), free(got_sel);
}

static void check_shape(struct kvr_dev *dev, uint32_t type_index, uint32_t G, uint32_t d,
			uint32_t n_cand, enum input_kind kind, uint64_t seed)
{
	check_shape_norm(dev, type_index, G, d, n_cand, 0, kind, seed);
}

/* candidate counts: below, at and past one vector and one 16-page batch, past
 * the 256 lanes of the page sum, and a long odd run */
static const uint32_t cand_counts[] = { 1, 15, 16, 17, 255, 257, 300, 1027 };
#define N_CAND_COUNTS (sizeof(cand_counts) / sizeof(cand_counts[0]))

static void check_group(uint32_t G, uint32_t d)
{
	struct kvr_dev *dev = cpu_dev();
	for (uint32_t ti = 0; ti < 3; ti++)
		for (uint32_t ni = 0; ni < N_CAND_COUNTS; ni++)
			for (uint32_t kind = 0; kind < N_INPUT_KINDS; kind++)
				check_shape(dev, ti, G, d, cand_counts[ni], kind,
					    0x5c0e + 1000003ull * (G * 1000 + d) + 101 * ni + 7 * kind + ti);
	kvr_dev_destroy(dev);
}

Test(score, mha_d64) { check_group(1, 64); }
Test(score, mha_d128) { check_group(1, 128); }
Test(score, gqa4_d64) { check_group(4, 64); }
Test(score, gqa4_d128) { check_group(4, 128); }
Test(score, gqa8_d64) { check_group(8, 64); }
Test(score, gqa8_d128) { check_group(8, 128); }

/* Odd group sizes, as the models have them (SmolLM2 G=3, d=64; Qwen-2.5-7B
 * G=7): the kernels score the group in blocks of up to four heads, so every
 * remainder (G mod 4 = 1, 2, 3) is a path of its own. */
Test(score, gqa3_d64) { check_group(3, 64); }
Test(score, gqa7_d128) { check_group(7, 128); }
Test(score, gqa5_gqa6)
{
	struct kvr_dev *dev = cpu_dev();
	for (uint32_t G = 5; G <= 6; G++)
		for (uint32_t ti = 0; ti < 3; ti++)
			for (uint32_t kind = 0; kind < N_INPUT_KINDS; kind++)
				check_shape(dev, ti, G, G == 5 ? 128 : 64, 37, kind, 0x9a5 + 17 * G + 7 * kind + ti);
	kvr_dev_destroy(dev);
}

/* the other head dims the cpu kernels accept */
Test(score, other_head_dims)
{
	static const uint32_t dims[] = { 32, 96, 160, 192, 224, 256 };
	struct kvr_dev *dev = cpu_dev();
	for (uint32_t i = 0; i < sizeof(dims) / sizeof(dims[0]); i++)
		for (uint32_t ti = 0; ti < 3; ti++)
			for (uint32_t kind = 0; kind < N_INPUT_KINDS; kind++)
				check_shape(dev, ti, 2, dims[i], 37, kind, 0xd1e + 31 * i + 7 * kind + ti);
	kvr_dev_destroy(dev);
}

/* The softmax over every page (norm_end set, as the scheduler does): the
 * sink pages before the candidates and the window's pages after them enter
 * each head's max and sum but are not written; domains below, at and past a
 * 16-page batch and the 256 sum lanes, with the candidates starting inside a
 * batch. A norm_end short of the candidates' end still spans them all. */
Test(score, softmax_over_every_page)
{
	static const uint32_t shapes[][2] = { /* n_cand, pages after the candidates */
					      { 1, 1 }, { 5, 12 }, { 13, 4 }, { 40, 260 },
					      { 300, 9 }, { 250, 0 }, { 17, 2000 } };
	struct kvr_dev *dev = cpu_dev();
	for (uint32_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
		for (uint32_t ti = 0; ti < 3; ti++)
			for (uint32_t kind = 0; kind < N_INPUT_KINDS; kind++) {
				const uint32_t n_cand = shapes[i][0], end = 3 + n_cand + shapes[i][1];
				check_shape_norm(dev, ti, 4, 64, n_cand, end, kind,
						 0xa11 + 131 * i + 7 * kind + ti);
				check_shape_norm(dev, ti, 1, 128, n_cand, end, kind,
						 0xb11 + 131 * i + 7 * kind + ti);
			}
	check_shape_norm(dev, 0, 2, 64, 30, 2, INPUT_RANDOM, 0xc11); /* norm_end < cand_end */
	kvr_dev_destroy(dev);
}

/* Select alone, over scores drawn from a few values (signed zeros, NaNs of
 * both signs, infinities): ties everywhere; distinct values; scores rising
 * and falling with the page (every candidate beats the ones before it, or
 * none does); k from 1 past n. */
Test(score, select_ties)
{
	static const float pool[] = { 0.0f, -0.0f, 1.0f, 0.5f, 0.25f, -1.0f, INFINITY, -INFINITY, NAN, -NAN };
	static const uint32_t ns[] = { 1, 5, 64, 300, 2049, 5000 }, ks[] = { 1, 3, 32, 299, 6000 };
	struct kvr_dev *dev = cpu_dev();
	rng_state = 0x7135;
	for (uint32_t a = 0; a < sizeof(ns) / sizeof(ns[0]); a++)
		for (uint32_t b = 0; b < sizeof(ks) / sizeof(ks[0]); b++)
			for (uint32_t spread = 2; spread <= 18; spread += 4) {
				const uint32_t n = ns[a], k = ks[b], n_kv = 3;
				const struct kvr_shape sh = { n_kv, n_kv, 64, 32, KVR_ELEM_F32, 0.125f, 0.9f, 0, 0, 0, 0 };
				float *scores = malloc((size_t)n_kv * n * sizeof(float));
				int32_t *want = malloc((size_t)n_kv * k * sizeof(int32_t));
				int32_t *got = malloc((size_t)n_kv * k * sizeof(int32_t));
				cr_assert(scores && want && got);
				for (uint32_t x = 0; x < n_kv * n; x++) {
					if (spread == 14 || spread == 18) /* rising, falling */
						scores[x] = (float)(spread == 14 ? x % n : n - x % n) * 0.25f;
					else /* spread 10: also distinct values */
						scores[x] = spread == 10 && rng() % 2 ? uniform(0.0f, 1.0f) : pool[rng() % spread];
				}
				struct kvr_score_item it = { NULL, NULL, scores, want, 11, 11 + n, k, 0, NULL };
				ref_select(&sh, &it, want);
				it.selected = got;
				kvr_cpu_select(dev, &sh, &it, 1);
				cr_assert(!memcmp(got, want, (size_t)n_kv * k * sizeof(int32_t)),
					  "select: n=%u k=%u spread %u: selection differs", n, k, spread);
				free(scores), free(want), free(got);
			}
	kvr_dev_destroy(dev);
}
