/* SPDX-License-Identifier: MIT */
/*
 * cpu_kernels_isa.h — the cpu backend's hot kernels (score, attention), written
 * once over 16-float vectors (GCC vector extensions) and compiled three times
 * by cpu_kernels.c: for AVX-512, for AVX2+FMA+F16C, and for baseline x86-64.
 * The including file defines ISA (a name suffix) and the primitives:
 *   LOAD16(row, type, i)  16 elements from element i of a row, as floats
 *   FMA16(a, b, c)        a*b + c with a single rounding per lane
 *   HSUM16(v)             the sum of the 16 lanes (any order: attention only)
 *   HSUM4(a, b, c, d, out) the four lane sums into out[0..3] (attention only)
 *   HMAX16(v)             the largest lane (attention only; NaN lanes ignored)
 *   FOLD16(v)             the sum of the 16 lanes in kmath.h's canonical order
 *                         (halves added lane-wise: 8, then 4, 2, 1)
 *   SPLAT16(x)            x in every lane (a broadcast: building the vector
 *                         from scalars goes through memory and stalls)
 * and, before the first inclusion, vf/vi (16 x float/int32) and blend.
 *
 * Scores follow kmath.h's canonical orders exactly (a vector's lane l is the
 * canonical lane l), so every ISA — and the CUDA kernels — produce the same
 * bits and select the same pages. Attention is accurate, not bit-exact.
 */

#define KVR_ISA_FN2(name, isa) name##_##isa
#define KVR_ISA_FN1(name, isa) KVR_ISA_FN2(name, isa)
#define ISA_FN(name) KVR_ISA_FN1(name, ISA)

/* kvr_expf on 16 lanes, bit-identical to the scalar function: the same
 * operations in the same order (rint by the 1.5·2^23 trick, which is exact
 * round-to-nearest-even for |t| < 2^22; out-of-range lanes are clamped for the
 * arithmetic and replaced at the end, as the scalar early returns do). */
static inline __attribute__((always_inline)) vf ISA_FN(exp16)(vf x)
{
	const vi is_nan = x != x;
	const vi big = x > 88.7228317f;
	const vi small = x < -103.972084f;
	const vf xc = blend(big | small | is_nan, SPLAT16(0.0f), x);
	const vf t = xc * 1.44269502f;
	const vf n = (t + 12582912.0f) - 12582912.0f;
	vf r = FMA16(-n, SPLAT16(0.693145752f), xc);
	r = FMA16(-n, SPLAT16(1.42860677e-06f), r);
	vf p = SPLAT16(1.38888894e-03f);
	p = FMA16(p, r, SPLAT16(8.33333377e-03f));
	p = FMA16(p, r, SPLAT16(4.16666679e-02f));
	p = FMA16(p, r, SPLAT16(1.66666672e-01f));
	p = FMA16(p, r, SPLAT16(0.5f));
	p = FMA16(p, r, SPLAT16(1.0f));
	p = FMA16(p, r, SPLAT16(1.0f));
	const vi e = __builtin_convertvector(n, vi);
	const vi lo = e < -126, hi = e > 127;
	const vi e1 = (lo & -126) | (hi & 127) | (~(lo | hi) & e);
	p = p * (vf)((e1 + 127) << 23);
	p = p * (vf)((e - e1 + 127) << 23); /* 2^0 = 1.0 exactly when e fits */
	p = blend(small, SPLAT16(0.0f), p);
	p = blend(big, SPLAT16(INFINITY), p);
	return blend(is_nan, x, p);
}

/* ------------------------------------------------------------------ score */

/* Scores of KV head m of one item (kernels.h, "score"). tmp: G x n_cand.
 * `chunks` (d / 16) is a compile-time constant in every caller, as in
 * attention, so the page's min/max rows stay in registers. */
static inline __attribute__((always_inline)) void
ISA_FN(score_impl)(const struct kvr_shape *sh, const struct kvr_score_item *it, uint32_t m,
		   float *tmp, const uint32_t chunks)
{
	const uint32_t G = sh->n_qo_heads / sh->n_kv_heads, d = sh->head_dim, t = sh->elem_type;
	const uint32_t n_cand = it->cand_end - it->cand_begin;
	const uint64_t eb = kvr_elem_bytes(t), page_elems = (uint64_t)sh->n_kv_heads * 2 * d;
	vf q[KVR_MAX_GROUP_CPU][16];
	for (uint32_t g = 0; g < G; g++)
		_Pragma("GCC unroll 16")
		for (uint32_t c = 0; c < chunks; c++)
			q[g][c] = LOAD16(it->q, t, (uint64_t)(m * G + g) * d + c * 16);

	const uint64_t head_bytes = 2ull * d * eb; /* this head's min and max rows */
	for (uint32_t j = 0; j < n_cand; j++) {
		const unsigned char *sum = (const unsigned char *)it->summaries +
					   ((it->cand_begin + j) * page_elems + (uint64_t)m * 2 * d) * eb;
		/* One head's rows of consecutive pages are page_elems apart: too far
		 * for the hardware prefetcher. Fetch a few pages ahead. */
		if (j + 4 < n_cand)
			for (uint64_t l = 0; l < head_bytes; l += 64)
				__builtin_prefetch(sum + 4 * page_elems * eb + l, 0, 3);
		vf mn[16], mx[16];
		_Pragma("GCC unroll 16")
		for (uint32_t c = 0; c < chunks; c++) {
			mn[c] = LOAD16(sum, t, c * 16);
			mx[c] = LOAD16(sum, t, d + c * 16);
		}
		for (uint32_t g = 0; g < G; g++) {
			vf acc = SPLAT16(0.0f);
			_Pragma("GCC unroll 16")
			for (uint32_t c = 0; c < chunks; c++) {
				const vf a = q[g][c] * mn[c], b = q[g][c] * mx[c];
				acc = acc + blend(a > b, a, b); /* kvr_quest_term per lane */
			}
			tmp[(uint64_t)g * n_cand + j] = sh->scale * FOLD16(acc);
		}
	}

	float *out = it->scores + (uint64_t)m * n_cand;
	for (uint32_t j = 0; j < n_cand; j++)
		out[j] = 0.0f;
	for (uint32_t g = 0; g < G; g++) {
		float *s = tmp + (uint64_t)g * n_cand;
		float mxs = -INFINITY;
		for (uint32_t j = 0; j < n_cand; j++)
			if (s[j] > mxs)
				mxs = s[j];
		float lanes[KVR_SUM_LANES] = { 0 };
		uint32_t j = 0;
		for (; j + 16 <= n_cand; j += 16) {
			vf x;
			memcpy(&x, s + j, sizeof(x));
			x = ISA_FN(exp16)(x - mxs);
			memcpy(s + j, &x, sizeof(x));
			vf l;
			memcpy(&l, lanes + j % KVR_SUM_LANES, sizeof(l));
			l = l + x;
			memcpy(lanes + j % KVR_SUM_LANES, &l, sizeof(l));
		}
		for (; j < n_cand; j++) {
			s[j] = kvr_expf(s[j] - mxs);
			lanes[j % KVR_SUM_LANES] = lanes[j % KVR_SUM_LANES] + s[j];
		}
		const float inv = 1.0f / kvr_fold_lanes(lanes, KVR_SUM_LANES);
		for (j = 0; j < n_cand; j++)
			out[j] = out[j] + s[j] * inv;
	}
	const float inv_g = 1.0f / (float)G;
	for (uint32_t j = 0; j < n_cand; j++)
		out[j] = out[j] * inv_g;
}

static void ISA_FN(score_head)(const struct kvr_shape *sh, const struct kvr_score_item *it,
			       uint32_t m, float *tmp)
{
	switch (sh->head_dim / 16) { /* d is a multiple of 32 up to 256 */
	case 2: ISA_FN(score_impl)(sh, it, m, tmp, 2); break;
	case 4: ISA_FN(score_impl)(sh, it, m, tmp, 4); break;
	case 6: ISA_FN(score_impl)(sh, it, m, tmp, 6); break;
	case 8: ISA_FN(score_impl)(sh, it, m, tmp, 8); break;
	case 10: ISA_FN(score_impl)(sh, it, m, tmp, 10); break;
	case 12: ISA_FN(score_impl)(sh, it, m, tmp, 12); break;
	case 14: ISA_FN(score_impl)(sh, it, m, tmp, 14); break;
	default: ISA_FN(score_impl)(sh, it, m, tmp, 16); break;
	}
}

/* ------------------------------------------------------------------ attention */

/* Attention of KV head m of one item over its segments (kernels.h).
 * `chunks` (d / 16) is a compile-time constant in every caller (see
 * attention_head below), so the per-head vectors — q, the accumulators — stay
 * in registers: with a run-time count they lived in memory and every FMA was
 * a load and a store. */
static inline __attribute__((always_inline)) void
ISA_FN(attention_impl)(const struct kvr_shape *sh, const void *q_rows, void *out_rows,
		       const struct kvr_kv_segment *segs, uint32_t n_segs, uint32_t m,
		       const uint32_t chunks)
{
	enum { BLOCK = 16 };
	const uint32_t G = sh->n_qo_heads / sh->n_kv_heads, d = sh->head_dim, t = sh->elem_type;
	const uint64_t eb = kvr_elem_bytes(t);
	vf q[KVR_MAX_GROUP_CPU][16], acc[KVR_MAX_GROUP_CPU][16];
	float run_max[KVR_MAX_GROUP_CPU], run_sum[KVR_MAX_GROUP_CPU];
	for (uint32_t g = 0; g < G; g++) {
		_Pragma("GCC unroll 16")
		for (uint32_t c = 0; c < chunks; c++) {
			q[g][c] = LOAD16(q_rows, t, (uint64_t)(m * G + g) * d + c * 16) * sh->scale;
			acc[g][c] = SPLAT16(0.0f);
		}
		run_max[g] = -INFINITY;
		run_sum[g] = 0.0f;
	}

	const uint64_t row_bytes = (uint64_t)d * eb;
	for (uint32_t si = 0; si < n_segs; si++) {
		const struct kvr_kv_segment *seg = &segs[si];
		const unsigned char *kb = (const unsigned char *)seg->k + (uint64_t)m * seg->head_stride * eb;
		const unsigned char *vb = (const unsigned char *)seg->v + (uint64_t)m * seg->head_stride * eb;
		const uint64_t row = (uint64_t)seg->row_stride * eb;
		/* Segments are scattered pages: no hardware prefetcher follows the jump
		 * to the next one. Prefetch its row t while using our row t, keeping
		 * one segment of loads in flight. */
		const struct kvr_kv_segment *next = si + 1 < n_segs ? &segs[si + 1] : NULL;
		const unsigned char *nkb = next ? (const unsigned char *)next->k + (uint64_t)m * next->head_stride * eb : NULL;
		const unsigned char *nvb = next ? (const unsigned char *)next->v + (uint64_t)m * next->head_stride * eb : NULL;
		const uint64_t nrow = next ? (uint64_t)next->row_stride * eb : 0;
		const uint32_t n_next = next ? next->n_tokens : 0;
		for (uint32_t t0 = 0; t0 < seg->n_tokens; t0 += BLOCK) {
			const uint32_t nb = seg->n_tokens - t0 < BLOCK ? seg->n_tokens - t0 : BLOCK;
			float s[KVR_MAX_GROUP_CPU][BLOCK];
			/* K: per token, convert the row once into registers and score it
			 * against every query head of the group, four heads per combined
			 * horizontal sum (prefetching the next segment's rows as we go). */
			for (uint32_t b = 0; b < nb; b++) {
				const unsigned char *krow = kb + (t0 + b) * row;
				if (t0 + b < n_next)
					for (uint64_t l = 0; l < row_bytes; l += 64) {
						__builtin_prefetch(nkb + (t0 + b) * nrow + l, 0, 2);
						__builtin_prefetch(nvb + (t0 + b) * nrow + l, 0, 2);
					}
				vf k[16];
				_Pragma("GCC unroll 16")
				for (uint32_t c = 0; c < chunks; c++)
					k[c] = LOAD16(krow, t, c * 16);
				uint32_t g = 0;
				for (; g + 4 <= G; g += 4) {
					vf d0 = q[g][0] * k[0], d1 = q[g + 1][0] * k[0];
					vf d2 = q[g + 2][0] * k[0], d3 = q[g + 3][0] * k[0];
					_Pragma("GCC unroll 16")
					for (uint32_t c = 1; c < chunks; c++) {
						d0 = FMA16(q[g][c], k[c], d0);
						d1 = FMA16(q[g + 1][c], k[c], d1);
						d2 = FMA16(q[g + 2][c], k[c], d2);
						d3 = FMA16(q[g + 3][c], k[c], d3);
					}
					float four[4];
					HSUM4(d0, d1, d2, d3, four);
					s[g][b] = four[0];
					s[g + 1][b] = four[1];
					s[g + 2][b] = four[2];
					s[g + 3][b] = four[3];
				}
				for (; g < G; g++) {
					vf d0 = q[g][0] * k[0];
					_Pragma("GCC unroll 16")
					for (uint32_t c = 1; c < chunks; c++)
						d0 = FMA16(q[g][c], k[c], d0);
					s[g][b] = HSUM16(d0);
				}
			}
			for (uint32_t g = 0; g < G; g++) {
				vf x = SPLAT16(-INFINITY);
				memcpy(&x, s[g], nb * sizeof(float));
				const float bmax = HMAX16(x); /* NaN: see below */
				const float new_max = bmax > run_max[g] ? bmax : run_max[g];
				x = ISA_FN(exp16)(x - new_max);
				memcpy(s[g], &x, nb * sizeof(float));
				/* padded lanes are exp(-inf) = 0; a NaN score stays NaN here */
				const float psum = HSUM16(x);
				const float alpha = kvr_softmax_rescale(run_max[g], new_max);
				if (alpha != 1.0f)
					_Pragma("GCC unroll 16")
					for (uint32_t c = 0; c < chunks; c++)
						acc[g][c] = acc[g][c] * alpha;
				run_sum[g] = run_sum[g] * alpha + psum;
				run_max[g] = new_max;
			}
			/* V: convert the block once, then per (g, c) accumulate over its tokens
			 * in registers (two chains), touching acc once per block. */
			vf vs[BLOCK][16];
			for (uint32_t b = 0; b < nb; b++) {
				const unsigned char *vrow = vb + (t0 + b) * row;
				_Pragma("GCC unroll 16")
				for (uint32_t c = 0; c < chunks; c++)
					vs[b][c] = LOAD16(vrow, t, c * 16);
			}
			for (uint32_t g = 0; g < G; g++) {
				vf a[16];
				_Pragma("GCC unroll 16")
				for (uint32_t c = 0; c < chunks; c++)
					a[c] = acc[g][c];
				for (uint32_t b = 0; b < nb; b++) {
					const vf p = SPLAT16(s[g][b]);
					_Pragma("GCC unroll 16")
					for (uint32_t c = 0; c < chunks; c++)
						a[c] = FMA16(p, vs[b][c], a[c]);
				}
				_Pragma("GCC unroll 16")
				for (uint32_t c = 0; c < chunks; c++)
					acc[g][c] = a[c];
			}
		}
	}

	for (uint32_t g = 0; g < G; g++) {
		/* No tokens: zeros. A NaN anywhere made run_sum NaN: it propagates. */
		float row[256];
		const float inv = run_sum[g] == 0.0f ? 0.0f : 1.0f / run_sum[g];
		_Pragma("GCC unroll 16")
		for (uint32_t c = 0; c < chunks; c++) {
			const vf o = acc[g][c] * inv;
			memcpy(row + c * 16, &o, sizeof(o));
		}
		kvr_convert_from_f32((unsigned char *)out_rows + (uint64_t)(m * G + g) * d * eb, row, t, d);
	}
}

static void ISA_FN(attention_head)(const struct kvr_shape *sh, const void *q_rows, void *out_rows,
				   const struct kvr_kv_segment *segs, uint32_t n_segs, uint32_t m)
{
	switch (sh->head_dim / 16) { /* d is a multiple of 32 up to 256 */
	case 2: ISA_FN(attention_impl)(sh, q_rows, out_rows, segs, n_segs, m, 2); break;
	case 4: ISA_FN(attention_impl)(sh, q_rows, out_rows, segs, n_segs, m, 4); break;
	case 6: ISA_FN(attention_impl)(sh, q_rows, out_rows, segs, n_segs, m, 6); break;
	case 8: ISA_FN(attention_impl)(sh, q_rows, out_rows, segs, n_segs, m, 8); break;
	case 10: ISA_FN(attention_impl)(sh, q_rows, out_rows, segs, n_segs, m, 10); break;
	case 12: ISA_FN(attention_impl)(sh, q_rows, out_rows, segs, n_segs, m, 12); break;
	case 14: ISA_FN(attention_impl)(sh, q_rows, out_rows, segs, n_segs, m, 14); break;
	default: ISA_FN(attention_impl)(sh, q_rows, out_rows, segs, n_segs, m, 16); break;
	}
}

#undef ISA_FN
#undef KVR_ISA_FN1
#undef KVR_ISA_FN2
