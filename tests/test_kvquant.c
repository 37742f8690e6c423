/* SPDX-License-Identifier: MIT */
/*
 * test_kvquant.c — the quantised page formats of layouts/kvquant.h:
 * every element dequantises to within half a quantisation step of its input
 * (plus the f16 rounding of the zero point, which only the clamp at either end
 * can add, and the float rounding of s·Q − z), for keys and values of K8V4
 * and K4V2 over vectors of very different shapes; packing round-trips every
 * code; the run geometry is what the header says; and quantising a KV head's
 * NHD rows fills exactly its run.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kvquant.h"
#include "helpers.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double urand(void) /* [0, 1) */
{
	return (double)(th_xorshift64(&rng_state) >> 11) * 0x1p-53;
}

/* Vectors the quantiser must handle: ordinary, heavy-tailed (one outlier
 * channel, as LLM keys have), all negative, far from zero with a tiny range,
 * constant, two values, and subnormal-small. */
static void fill(float *x, uint32_t d, int kind)
{
	for (uint32_t i = 0; i < d; i++) {
		const double u = 2 * urand() - 1;
		switch (kind) {
		case 0: x[i] = (float)u; break;
		case 1: x[i] = (float)(u * (i == 7 ? 40.0 : 1.0)); break;
		case 2: x[i] = (float)(-3.0 - 2 * urand()); break;
		case 3: x[i] = (float)(1000.2 + 0.01 * u); break;
		case 4: x[i] = 0.75f; break;
		case 5: x[i] = i % 2 ? 2.5f : -1.25f; break;
		default: x[i] = (float)(u * 1e-6); break;
		}
	}
}

/* The bound of the header comment for one element, with the float rounding
 * of s·Q − z (a few ulp of the larger term) added. */
static double bound(const uint16_t *sz, float x, float min_x, uint32_t bits)
{
	const double s = kvr_f16_to_f32(sz[0]), z16 = kvr_f16_to_f32(sz[1]);
	const double zero_rounding = fabs(-(double)min_x - z16);
	const double fp = 0x1p-21 * (fabs((double)x) + fabs(z16) + s * ((1u << bits) - 1));
	return s / 2 + zero_rounding + fp;
}

Test(kvquant, dequantised_within_half_a_step)
{
	enum { D = 128 };
	static const uint32_t bits_of[] = { 8, 4, 2 };
	float x[D], y[D];
	uint8_t row[D];
	uint16_t sz[2];
	double worst_steps[3] = { 0 };
	for (int b = 0; b < 3; b++) {
		const uint32_t bits = bits_of[b];
		for (int kind = 0; kind < 7; kind++)
			for (int rep = 0; rep < 200; rep++) {
				fill(x, D, kind);
				memset(row, 0xff, sizeof(row));
				kvr_quant_row(x, D, 1, bits, row, sz);
				kvr_dequant_row(row, D, bits, sz, y);
				float min_x = x[0];
				for (uint32_t i = 1; i < D; i++)
					min_x = x[i] < min_x ? x[i] : min_x;
				const double s = kvr_f16_to_f32(sz[0]);
				for (uint32_t i = 0; i < D; i++) {
					const double err = fabs((double)y[i] - x[i]);
					cr_assert(err <= bound(sz, x[i], min_x, bits),
						  "%u bits, vector kind %d, element %u: %.9g dequantised to %.9g "
						  "(s %.6g, z %.6g): error %.3g over the bound %.3g",
						  bits, kind, i, x[i], y[i], s, kvr_f16_to_f32(sz[1]), err,
						  bound(sz, x[i], min_x, bits));
					/* in steps, beyond what the zero point's rounding explains */
					const double zr = fabs(-(double)min_x - kvr_f16_to_f32(sz[1]));
					if (s > 0 && (err - zr) / s > worst_steps[b])
						worst_steps[b] = (err - zr) / s;
				}
			}
	}
	/* the codes use the whole range: the worst error is close to half a
	 * step, not far below it (a quantiser using fewer levels would pass the
	 * bound trivially at a coarser s, but s is checked next) */
	for (int b = 0; b < 3; b++)
		cr_expect(worst_steps[b] > 0.4 && worst_steps[b] <= 0.5 + 1e-3, "%u bits: worst error %.3f steps",
			  bits_of[b], worst_steps[b]);
}

/* s is the smallest f16 step that covers the range: not coarser than it needs. */
Test(kvquant, scale_is_the_range_over_the_levels)
{
	enum { D = 64 };
	float x[D];
	uint16_t sz[2];
	for (uint32_t bits = 2; bits <= 8; bits *= 2)
		for (int rep = 0; rep < 500; rep++) {
			fill(x, D, rep % 3);
			kvr_quant_params(x, D, 1, bits, sz);
			float lo = x[0], hi = x[0];
			for (uint32_t i = 1; i < D; i++)
				lo = x[i] < lo ? x[i] : lo, hi = x[i] > hi ? x[i] : hi;
			const double levels = (double)((1u << bits) - 1);
			const double s = kvr_f16_to_f32(sz[0]), want = ((double)hi + kvr_f16_to_f32(sz[1])) / levels;
			cr_assert(s >= want * (1 - 1e-6) && s <= want * (1 + 0x1p-9), "%u bits: s %.9g for range/levels %.9g",
				  bits, s, want);
		}
}

Test(kvquant, constant_and_degenerate_vectors)
{
	enum { D = 32 };
	float x[D], y[D];
	uint8_t row[D];
	uint16_t sz[2];
	fill(x, D, 4);
	kvr_quant_row(x, D, 1, 4, row, sz);
	cr_expect_eq(sz[0], 0, "a constant vector needs no scale");
	kvr_dequant_row(row, D, 4, sz, y);
	for (uint32_t i = 0; i < D; i++)
		cr_expect_eq(y[i], 0.75f, "0.75 is exact in f16: %.9g", y[i]);
	/* strided input: every other element of a longer array */
	float wide[2 * D];
	for (uint32_t i = 0; i < 2 * D; i++)
		wide[i] = i % 2 ? 1e6f : (float)i / 8;
	kvr_quant_row(wide, D, 2, 8, row, sz);
	kvr_dequant_row(row, D, 8, sz, y);
	for (uint32_t i = 0; i < D; i++)
		cr_expect(fabs(y[i] - wide[2 * i]) <= kvr_f16_to_f32(sz[0]) / 2 + 1e-6, "strided element %u", i);
}

Test(kvquant, packing_round_trips_every_code)
{
	uint8_t row[64];
	for (uint32_t bits = 2; bits <= 8; bits *= 2) {
		const uint32_t n = 64 * 8 / bits, mask = (1u << bits) - 1;
		uint32_t want[512];
		memset(row, 0, sizeof(row));
		for (uint32_t i = 0; i < n; i++) {
			want[i] = (i * 2654435761u >> 7) & mask;
			kvr_quant_put(row, i, bits, want[i]);
		}
		for (uint32_t i = 0; i < n; i++)
			cr_assert_eq(kvr_quant_get(row, i, bits), want[i], "%u bits, element %u", bits, i);
		/* little-endian within a byte: element 0 in the low bits */
		cr_expect_eq(row[0] & mask, want[0]);
		/* rewriting one element leaves its neighbours alone */
		kvr_quant_put(row, 5, bits, mask - want[5]);
		for (uint32_t i = 0; i < n; i++)
			cr_assert_eq(kvr_quant_get(row, i, bits), i == 5 ? mask - want[5] : want[i]);
	}
}

Test(kvquant, geometry)
{
	struct kvr_quant_geometry g;
	cr_assert_eq(kvr_quant_geometry_init(&g, 32, 128, 8, KVR_KV_K8V4), 0);
	cr_expect_eq(g.key_bits, 8);
	cr_expect_eq(g.value_bits, 4);
	cr_expect_eq(g.key_row_bytes, 128);
	cr_expect_eq(g.value_row_bytes, 64);
	cr_expect_eq(g.value_codes_offset, 32 * 128);
	cr_expect_eq(g.key_meta_offset, 32 * 128 + 32 * 64);
	cr_expect_eq(g.value_meta_offset, g.key_meta_offset + 32 * 4);
	cr_expect_eq(g.head_bytes, 32 * (128 + 64 + 8));
	cr_expect_eq(g.page_bytes, 8 * g.head_bytes);
	/* bytes per token and head: K8V4 200 against f16's 512, K4V2 104 */
	cr_assert_eq(kvr_quant_geometry_init(&g, 32, 128, 8, KVR_KV_K4V2), 0);
	cr_expect_eq(g.head_bytes, 32 * (64 + 32 + 8));
	/* every segment 16-byte aligned even for odd page sizes */
	cr_assert_eq(kvr_quant_geometry_init(&g, 3, 16, 2, KVR_KV_K4V2), 0);
	cr_expect_eq(g.value_codes_offset % 16, 0);
	cr_expect_eq(g.key_meta_offset % 16, 0);
	cr_expect_eq(g.value_meta_offset % 16, 0);
	cr_expect_eq(g.head_bytes % 16, 0);
	cr_expect_geq(g.value_codes_offset, 3 * 8);
	/* refused: plain, unknown, zero sizes, d not a multiple of 16 */
	cr_expect_eq(kvr_quant_geometry_init(&g, 32, 128, 8, KVR_KV_PLAIN), -1);
	cr_expect_eq(kvr_quant_geometry_init(&g, 32, 128, 8, 7), -1);
	cr_expect_eq(kvr_quant_geometry_init(&g, 0, 128, 8, KVR_KV_K8V4), -1);
	cr_expect_eq(kvr_quant_geometry_init(&g, 32, 72, 8, KVR_KV_K8V4), -1);
	cr_expect_eq(g.page_bytes, 0, "a refused init leaves the geometry zeroed");
}

/* Quantising head m of NHD rows (f16 source, a partly filled page) writes its
 * run and nothing else, and dequantises within the bound. */
Test(kvquant, run_from_nhd_rows)
{
	enum { P = 16, D = 64, NKV = 3, FILLED = 11 };
	static uint16_t k[P * NKV * D], v[P * NKV * D];
	for (uint32_t i = 0; i < P * NKV * D; i++) {
		k[i] = kvr_f32_to_f16((float)(4 * urand() - 2));
		v[i] = kvr_f32_to_f16((float)(urand() - 0.5));
	}
	for (uint32_t format = KVR_KV_K8V4; format <= KVR_KV_K4V2; format++) {
		struct kvr_quant_geometry g;
		cr_assert_eq(kvr_quant_geometry_init(&g, P, D, NKV, format), 0);
		static uint8_t page[1 << 16];
		cr_assert_leq(g.page_bytes + 64, sizeof(page));
		memset(page, 0xcd, sizeof(page));
		float scratch[D], y[D], x[D];
		const uint32_t m = 1;
		uint8_t *run = page + m * g.head_bytes;
		kvr_quant_run_from_nhd(&g, k, v, NKV * D, KVR_ELEM_F16, m, FILLED, run, scratch);
		for (uint64_t b = 0; b < sizeof(page); b++)
			if (b < m * g.head_bytes || b >= (m + 1) * g.head_bytes)
				cr_assert_eq(page[b], 0xcd, "byte %llu outside head %u's run was written",
					     (unsigned long long)b, m);
		for (uint32_t t = 0; t < P; t++)
			for (int half = 0; half < 2; half++) {
				const uint32_t bits = half ? g.value_bits : g.key_bits;
				const uint8_t *row = half ? kvr_quant_value_row(&g, run, t) : kvr_quant_key_row(&g, run, t);
				const uint16_t *sz = half ? kvr_quant_value_sz(&g, run, t) : kvr_quant_key_sz(&g, run, t);
				kvr_dequant_row(row, D, bits, sz, y);
				const uint16_t *src = (half ? v : k) + (uint64_t)t * NKV * D + m * D;
				float lo = 0;
				for (uint32_t c = 0; c < D; c++) {
					x[c] = t < FILLED ? kvr_f16_to_f32(src[c]) : 0.0f;
					lo = c == 0 || x[c] < lo ? x[c] : lo;
				}
				for (uint32_t c = 0; c < D; c++)
					cr_assert(fabs(y[c] - x[c]) <= bound(sz, x[c], lo, bits),
						  "format %u token %u %s element %u: %.6g for %.6g", format, t,
						  half ? "value" : "key", c, y[c], x[c]);
			}
	}
}

/*
 * Attention over quantised pages against an fp64 reference on the original
 * (unquantised) keys and values. The stated bound, per query head:
 *   keys: element error ≤ β_k(t) = s_k/2 + |z − z16| (+ float), so a logit
 *     moves by at most L = scale·Σ_c |q_c|·max_t β_k(t);
 *   logits each off by ≤ L change every softmax weight by a factor within
 *     [e^−2L, e^2L], so the weights move by at most e^2L − 1 in total;
 *   values: element error ≤ β_v = max_t (s_v/2 + |z − z16|);
 *   |out − ref| ≤ (e^2L − 1)·v_mag + β_v, plus 1e-5·v_mag of float rounding,
 * with v_mag the largest |v|. The quantised side is computed as the kernels
 * will: kvr_quant_dot (Σq once per query) and kvr_quant_axpy.
 */
Test(kvquant, attention_over_quantised_pages_within_bound)
{
	enum { P = 32, D = 64, NKV = 2, G = 4, PAGES = 8, T = P * PAGES };
	static float k[T * NKV * D], v[T * NKV * D], q[G * D];
	for (uint32_t t = 0; t < T; t++)
		for (uint32_t c = 0; c < NKV * D; c++) {
			/* keys with an outlier channel (as LLM keys have), values plain */
			k[t * NKV * D + c] = (float)((2 * urand() - 1) * (c % D == 5 ? 8.0 : 1.0));
			v[t * NKV * D + c] = (float)(2 * urand() - 1);
		}
	for (uint32_t i = 0; i < G * D; i++)
		q[i] = (float)(2 * urand() - 1);
	const float scale = 0.125f; /* 1/sqrt(64) */
	const uint32_t m = 1;      /* the KV head attended */
	for (uint32_t format = KVR_KV_K8V4; format <= KVR_KV_K4V2; format++) {
		struct kvr_quant_geometry g;
		cr_assert_eq(kvr_quant_geometry_init(&g, P, D, NKV, format), 0);
		static uint8_t runs[PAGES][1 << 14];
		cr_assert_leq(g.head_bytes, sizeof(runs[0]));
		float scratch[D];
		double beta_k = 0, beta_v = 0, v_mag = 0;
		for (uint32_t j = 0; j < PAGES; j++) {
			kvr_quant_run_from_nhd(&g, k + (size_t)j * P * NKV * D, v + (size_t)j * P * NKV * D, NKV * D,
					       KVR_ELEM_F32, m, P, runs[j], scratch);
			for (uint32_t t = 0; t < P; t++) {
				const float *kr = k + ((size_t)(j * P + t) * NKV + m) * D;
				const float *vr = v + ((size_t)(j * P + t) * NKV + m) * D;
				float klo = kr[0], vlo = vr[0];
				for (uint32_t c = 1; c < D; c++)
					klo = kr[c] < klo ? kr[c] : klo, vlo = vr[c] < vlo ? vr[c] : vlo;
				for (uint32_t c = 0; c < D; c++)
					v_mag = fabs(vr[c]) > v_mag ? fabs(vr[c]) : v_mag;
				const uint16_t *ksz = kvr_quant_key_sz(&g, runs[j], t), *vsz = kvr_quant_value_sz(&g, runs[j], t);
				const double bk = kvr_f16_to_f32(ksz[0]) / 2 + fabs(-(double)klo - kvr_f16_to_f32(ksz[1]));
				const double bv = kvr_f16_to_f32(vsz[0]) / 2 + fabs(-(double)vlo - kvr_f16_to_f32(vsz[1]));
				beta_k = bk > beta_k ? bk : beta_k;
				beta_v = bv > beta_v ? bv : beta_v;
			}
		}
		double worst_ratio = 0, worst_err = 0;
		for (uint32_t h = 0; h < G; h++) {
			const float *qh = q + h * D;
			float q_sum = 0;
			double q_abs = 0;
			for (uint32_t c = 0; c < D; c++)
				q_sum += qh[c], q_abs += fabs(qh[c]);
			/* quantised: logits, softmax, weighted values, in float */
			static float logit[T];
			float mx = -INFINITY;
			for (uint32_t j = 0; j < PAGES; j++)
				for (uint32_t t = 0; t < P; t++) {
					const float l = scale * kvr_quant_dot(kvr_quant_key_row(&g, runs[j], t), D, g.key_bits,
									      kvr_quant_key_sz(&g, runs[j], t), qh, q_sum);
					logit[j * P + t] = l;
					mx = l > mx ? l : mx;
				}
			float sum = 0, acc[D] = { 0 };
			for (uint32_t i = 0; i < T; i++)
				sum += (logit[i] = expf(logit[i] - mx));
			for (uint32_t j = 0; j < PAGES; j++)
				for (uint32_t t = 0; t < P; t++)
					kvr_quant_axpy(kvr_quant_value_row(&g, runs[j], t), D, g.value_bits,
						       kvr_quant_value_sz(&g, runs[j], t), logit[j * P + t] / sum, acc);
			/* reference: fp64 on the original rows */
			static double rl[T];
			double rmx = -INFINITY, rsum = 0, ref[D] = { 0 };
			for (uint32_t i = 0; i < T; i++) {
				double dot = 0;
				for (uint32_t c = 0; c < D; c++)
					dot += (double)qh[c] * k[((size_t)i * NKV + m) * D + c];
				rl[i] = scale * dot;
				rmx = rl[i] > rmx ? rl[i] : rmx;
			}
			for (uint32_t i = 0; i < T; i++)
				rsum += (rl[i] = exp(rl[i] - rmx));
			for (uint32_t i = 0; i < T; i++)
				for (uint32_t c = 0; c < D; c++)
					ref[c] += rl[i] / rsum * v[((size_t)i * NKV + m) * D + c];
			/* the same attention in fp64 over the dequantised rows: the
			 * on-the-fly dot and axpy must agree with it to float accuracy
			 * (the worst-case bound below is loose; this one is tight) */
			double dl[T], dmx = -INFINITY, dsum = 0, deq_ref[D] = { 0 };
			float row[D];
			for (uint32_t j = 0; j < PAGES; j++)
				for (uint32_t t = 0; t < P; t++) {
					kvr_dequant_row(kvr_quant_key_row(&g, runs[j], t), D, g.key_bits,
							kvr_quant_key_sz(&g, runs[j], t), row);
					double dot = 0;
					for (uint32_t c = 0; c < D; c++)
						dot += (double)qh[c] * row[c];
					dl[j * P + t] = scale * dot;
					dmx = dl[j * P + t] > dmx ? dl[j * P + t] : dmx;
				}
			for (uint32_t i = 0; i < T; i++)
				dsum += (dl[i] = exp(dl[i] - dmx));
			for (uint32_t j = 0; j < PAGES; j++)
				for (uint32_t t = 0; t < P; t++) {
					kvr_dequant_row(kvr_quant_value_row(&g, runs[j], t), D, g.value_bits,
							kvr_quant_value_sz(&g, runs[j], t), row);
					for (uint32_t c = 0; c < D; c++)
						deq_ref[c] += dl[j * P + t] / dsum * row[c];
				}
			for (uint32_t c = 0; c < D; c++)
				cr_assert(fabs(acc[c] - deq_ref[c]) <= 2e-4 * v_mag,
					  "format %u head %u element %u: on the fly %.7g, dequantised first %.7g", format, h,
					  c, acc[c], deq_ref[c]);
			const double L = scale * q_abs * beta_k;
			const double bnd = (exp(2 * L) - 1) * v_mag + beta_v + 1e-5 * v_mag;
			for (uint32_t c = 0; c < D; c++) {
				const double err = fabs(acc[c] - ref[c]);
				cr_assert(err <= bnd, "format %u head %u element %u: %.6g against %.6g, error %.3g over the bound %.3g",
					  format, h, c, acc[c], ref[c], err, bnd);
				worst_ratio = err / bnd > worst_ratio ? err / bnd : worst_ratio;
				worst_err = err > worst_err ? err : worst_err;
			}
		}
		cr_log_info("format %s: worst attention error %.3g (%.2f of the bound; v_mag %.2f)",
			    format == KVR_KV_K8V4 ? "K8V4" : "K4V2", worst_err, worst_ratio, v_mag);
		/* the outputs are not trivially close: quantisation moved them */
		cr_expect_gt(worst_err, 1e-5, "no error at all: the quantised path read the originals?");
	}
}

/* A K8V4 page split into two K8V4_HALF runs (the device page cache's units
 * under mixed pages): each half's geometry is K8V4's for p/2 tokens and fits
 * the room of a K4V2 run of the whole page, and the four pieces a half
 * (kvr_quant_half_piece) carry exactly the half's tokens: dequantised from
 * the half run they equal the full run's, bit for bit. */
Test(kvquant, k8v4_halves)
{
	enum { NKV = 2 };
	static const uint32_t shapes[][2] = { { 16, 32 }, { 32, 64 }, { 32, 128 }, { 64, 256 }, { 8, 16 } };
	for (uint32_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
		const uint32_t P = shapes[si][0], D = shapes[si][1];
		struct kvr_quant_geometry full, half, k4;
		cr_assert_eq(kvr_quant_geometry_init(&full, P, D, 1, KVR_KV_K8V4), 0);
		cr_assert_eq(kvr_quant_geometry_init(&half, P, D, 1, KVR_KV_K8V4_HALF), 0);
		cr_assert_eq(kvr_quant_geometry_init(&k4, P, D, 1, KVR_KV_K4V2), 0);
		cr_expect_eq(half.page_tokens, P / 2);
		cr_expect_eq(half.key_bits, 8);
		cr_expect_eq(half.value_bits, 4);
		cr_expect_eq(half.format, KVR_KV_K8V4_HALF);
		cr_expect_leq(half.head_bytes, k4.head_bytes, "p %u d %u: a half (%llu B) outgrows a K4V2 run (%llu B)",
			      P, D, (unsigned long long)half.head_bytes, (unsigned long long)k4.head_bytes);
		cr_expect_eq(kvr_kv_run_bytes(KVR_KV_K8V4_HALF, P, D, 2), half.head_bytes);
		static uint16_t k[64 * NKV * 256], v[64 * NKV * 256];
		for (uint32_t i = 0; i < P * NKV * D; i++) {
			k[i] = kvr_f32_to_f16((float)(4 * urand() - 2));
			v[i] = kvr_f32_to_f16((float)(urand() - 0.5));
		}
		static uint8_t run[1 << 15], halves[2][1 << 14];
		float scratch[256];
		kvr_quant_run_from_nhd(&full, k, v, NKV * D, KVR_ELEM_F16, 1, P, run, scratch);
		static float want_k[64 * 256], want_v[64 * 256], got_k[32 * 256], got_v[32 * 256];
		kvr_quant_run_to_nhd(&full, run, P, want_k, want_v, D, KVR_ELEM_F32, 0);
		for (uint32_t h = 0; h < 2; h++) {
			memset(halves[h], 0xcd, sizeof(halves[h]));
			for (uint32_t piece = 0; piece < 4; piece++) {
				uint64_t src, dst, bytes;
				kvr_quant_half_piece(&full, &half, h, piece, &src, &dst, &bytes);
				cr_assert_leq(src + bytes, full.head_bytes);
				cr_assert_leq(dst + bytes, half.head_bytes);
				memcpy(halves[h] + dst, run + src, bytes);
			}
			kvr_quant_run_to_nhd(&half, halves[h], P / 2, got_k, got_v, D, KVR_ELEM_F32, 0);
			cr_assert(!memcmp(got_k, want_k + (uint64_t)h * (P / 2) * D, (size_t)(P / 2) * D * 4),
				  "p %u d %u: half %u's keys differ from the page's", P, D, h);
			cr_assert(!memcmp(got_v, want_v + (uint64_t)h * (P / 2) * D, (size_t)(P / 2) * D * 4),
				  "p %u d %u: half %u's values differ from the page's", P, D, h);
		}
	}
	struct kvr_quant_geometry g;
	cr_expect_eq(kvr_quant_geometry_init(&g, 7, 32, 1, KVR_KV_K8V4_HALF), -1, "an odd page has no halves");
}
