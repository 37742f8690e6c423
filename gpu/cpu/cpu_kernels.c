/* SPDX-License-Identifier: MIT */
/*
 * cpu_kernels.c — the cpu backend's kernels (kernels.h has what each
 * computes). They run synchronously inside a stream operation, split into
 * tasks over the device's workers: per item for the page kernels, per
 * (item, KV head) for score, select and similarity, per (item, KV head,
 * part of 2,048 tokens) for decode attention, per 4096 units for a
 * free-list round's slice copies.
 *
 * The hot kernels (score, attention) come from cpu_kernels_isa.h, compiled
 * here for AVX-512, AVX2+FMA+F16C and baseline x86-64, and chosen at run time
 * with the same choice as the conversions (layouts/convert.c). Attention over
 * quantised pages takes its keys by integer dot products (kvquant.h's
 * contract), written here per ISA: AVX-512 VNNI, AVX2 (which AVX-512
 * without VNNI borrows whole for quantised pages: attention_head) and
 * portable C. Values are float multiply-adds on the unpacked codes, except for 4- and
 * 2-bit values at d a multiple of 64 on AVX-512 VNNI, where they are integer
 * sums with the weights rounded to 16 bits (pv_dots_avx512vnni: the dense
 * step over K4V2 pages 1.7x faster at 32K, K8V4 1.2x; the same with
 * vpdpwssd over token pairs was measured no faster), and for 2-bit values
 * at such d on AVX2, where they are byte sums with the weights rounded to 8 bits
 * (pv_dots_avx2: word products were slower than the floats there, byte
 * ones are not; docs/history.md). AVX2's 4-bit values stay float
 * multiply-adds, but through the same pv path, in an order that unpacks
 * each row with one widening (pv4_heads_avx2). Selection
 * and similarity follow kmath.h's canonical orders, so all ISAs and the CUDA
 * kernels agree bit for bit on which pages are selected.
 *
 * Threads: called on the thread running the stream operation; tasks run on
 * it and on the workers, each writing only its own item's outputs.
 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "../../layouts/convert.h"
#include "../../layouts/freelist.h"
#include "../../layouts/kmath.h"
#include "../../layouts/summary.h"
#include "../../layouts/transpose.h"
#include "cpu_backend.h"

#define KVR_MAX_GROUP_CPU 64

/* The cpu backend's own shape flag (beside kernels.h's): attention over a
 * part of an item's tokens writes, instead of out, G rows of head_dim + 1
 * floats, each head's output in f32 then its log-sum-exp (kvr_cpu_attention
 * merges the parts). */
#define KVR_CPU_SHAPE_PART (1u << 31)

/* 64-byte vectors pass between static functions of this file only, so the
 * build turns GCC's psABI note about them off (meson.build). */

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

/* mask ? a : b, lane by lane (mask lanes are 0 or -1) */
static inline __attribute__((always_inline)) vf blend(vi mask, vf a, vf b)
{
	return (vf)((mask & (vi)a) | (~mask & (vi)b));
}

#define hsum4_generic(a, b, c, d, out, hsum) \
	do {                                      \
		(out)[0] = hsum(a);               \
		(out)[1] = hsum(b);               \
		(out)[2] = hsum(c);               \
		(out)[3] = hsum(d);               \
	} while (0)

/* call(g, n) over a group's G query heads: blocks of four, then the one to
 * three left with n a constant too, so that each instance of a head-blocked
 * kernel keeps its accumulators in registers (SmolLM2: G = 3). */
#define HEADS_BY_FOUR(G, call)                   \
	do {                                     \
		uint32_t g_ = 0;                 \
		for (; g_ + 4 <= (G); g_ += 4)   \
			call(g_, 4);             \
		switch ((G) - g_) {              \
		case 1: call(g_, 1); break;      \
		case 2: call(g_, 2); break;      \
		case 3: call(g_, 3); break;      \
		default: break;                  \
		}                                \
	} while (0)

static inline __attribute__((always_inline)) float hmax16_generic(vf v)
{
	float m = v[0];
	for (int l = 1; l < 16; l++)
		m = v[l] > m ? v[l] : m;
	return m;
}

/* 16 packed codes (layouts/kvquant.h) spread one per byte, with SSE2 (the
 * x86-64 baseline): 16 bytes at 8 bits; 8 bytes at 4 bits, low and high
 * nibbles interleaved; 4 bytes at 2 bits, the four crumbs of each byte
 * interleaved. GCC's generic vector shuffles and conversions of byte vectors
 * compile element by element; these are a handful of instructions. */
static inline __attribute__((always_inline)) __m128i codes_bytes16(const uint8_t *row, uint32_t bits, uint32_t c)
{
	if (bits == 8)
		return _mm_loadu_si128((const __m128i *)(row + c * 16u));
	if (bits == 4) {
		const __m128i b = _mm_loadl_epi64((const __m128i *)(row + c * 8u)), m = _mm_set1_epi8(0x0f);
		return _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
	}
	int32_t w;
	memcpy(&w, row + c * 4u, 4);
	const __m128i b = _mm_cvtsi32_si128(w), m = _mm_set1_epi8(0x03);
	const __m128i x0 = _mm_and_si128(b, m), x1 = _mm_and_si128(_mm_srli_epi16(b, 2), m);
	const __m128i x2 = _mm_and_si128(_mm_srli_epi16(b, 4), m), x3 = _mm_and_si128(_mm_srli_epi16(b, 6), m);
	return _mm_unpacklo_epi16(_mm_unpacklo_epi8(x0, x1), _mm_unpacklo_epi8(x2, x3));
}

/* ------------------------------------------------------------------ integer key dots */

/*
 * Quantised keys are read as integer dot products (kvquant.h's contract):
 * each query row of the group is rounded to 8 bits once per attention call
 * (qk8_prepare, per ISA), and a block's dots Σ_c q8_c·Q_c come from the ISA's
 * byte or word multiply-adds (qk_dots_*), exact integers. The query codes
 * are kept in the orders the key rows are read in:
 *   q8:  natural order (8-bit keys: byte c is element c);
 *   q8n: a 4-bit row's nibble order, the even elements then the odd ones
 *        (byte j holds elements 2j and 2j + 1 in its low and high nibble);
 *   q16: q8 widened, for the paths that multiply words (vpmaddwd).
 * Every row is zero past d, so whole-vector loads of the codes may run over.
 */
struct kvr_qk8 {
	/* rows of the group's heads (the caller's arrays, sized for the group:
	 * a decode step's four heads take 4 KiB of its stack, not 64) */
	int8_t (*q8)[256];
	int8_t (*q8n)[256];
	int16_t (*q16)[256];
	float *scale;      /* s_q of each row */
	float *code_sum_f; /* Σ_c q8_c, exact as a float */
};

/* The logits s[g][b] = s_q·(s_b·Σ_c q8[g][c]·Q_b[c] − z_b·Σ_c q8[g][c]) of
 * query heads 0..G−1 against a block of nb ≤ 16 key code rows krow +
 * b·kstride of `bits` (8 or 4) bits, whose (s, z) pairs are sz[2b], sz[2b + 1]
 * (f16). s[g][nb..15] may be written too (with anything). */
typedef void (*qk_dots_fn)(const struct kvr_qk8 *qq, uint32_t G, uint32_t d, const unsigned char *krow,
			   uint64_t kstride, uint32_t bits, uint32_t nb, const uint16_t *sz, float (*s)[16]);

/*
 * Quantised values may be read as integer dot products too (the contract
 * for values, docs/api.md): a block's weights w_b = p_b·s_b of each query
 * head (p the softmax weight, s the token's value scale) are rounded to 16
 * bits against the block's largest, r_b = round(65535·w_b / max w), and
 * Σ_b w_b·Q_b becomes (max w / 65535)·Σ_b r_b·Q_b, exact integers (8 bits
 * and 255 for AVX2's 2-bit values, pv_dots_avx2). The sums of `bits`-bit
 * value codes land in vacc[g] in the ISA's own channel order for that
 * width (PV_CHANNEL maps it back, in attention_impl). Only where the ISA
 * has such a path and the value rows suit it (PV_FITS); elsewhere values
 * are float multiply-adds (value_dots). AVX2's pv takes its 4-bit values
 * by float multiply-adds too, uncentred, only in an order of its own
 * (pv4_heads_avx2).
 */
typedef void (*pv_dots_fn)(uint32_t G, uint32_t d, uint32_t bits, const unsigned char *vrow, uint64_t vstride,
			   uint32_t nb, const float (*w)[16], float (*vacc)[256]);

/* 4- and 2-bit value rows of whole 64-channel sub-pieces (d = 64, 128,
 * 192, 256). */
static inline int pv_fits(uint32_t value_bits, uint32_t d)
{
	return (value_bits == 4 || value_bits == 2) && d % 64u == 0 && d <= 256u;
}

/* The channel of vacc's element i for `bits`-bit codes
 * (pv_dots_avx512vnni's order): per sub-piece of 64 channels, vector k of
 * 16 lanes, lane 4L + j holds byte lane β = 16L + 4k + j, which is plane
 * β / n of the sub-piece's byte β mod n (n its bytes: 32 at 4 bits, 16 at
 * 2; plane: the nibble or crumb, low first). */
static inline uint32_t pv_channel(uint32_t i, uint32_t bits)
{
	const uint32_t sub = i / 64u, k = i / 16u % 4u, lane = i % 16u;
	const uint32_t beta = 16u * (lane / 4u) + 4u * k + lane % 4u;
	const uint32_t n = 8u * bits, planes = 8u / bits;
	return planes * (sub * n + beta % n) + beta / n;
}

/* From the integer dots in s to the logits (the scalar paths). */
static inline __attribute__((always_inline)) void qk_logits_scalar(const struct kvr_qk8 *qq, uint32_t G, uint32_t nb,
								   const uint16_t *sz, float (*s)[16])
{
	for (uint32_t b = 0; b < nb; b++) {
		const float ks = kvr_f16_to_f32(sz[2 * b]), kz = kvr_f16_to_f32(sz[2 * b + 1]);
		for (uint32_t g = 0; g < G; g++)
			s[g][b] = qq->scale[g] * (ks * s[g][b] - kz * qq->code_sum_f[g]);
	}
}


/* The portable path: plain integer loops (SSE2 by the compiler at best). */
static void qk_dots_base(const struct kvr_qk8 *qq, uint32_t G, uint32_t d, const unsigned char *krow,
			 uint64_t kstride, uint32_t bits, uint32_t nb, const uint16_t *sz, float (*s)[16])
{
	for (uint32_t b = 0; b < nb; b++) {
		const unsigned char *row = krow + b * kstride;
		for (uint32_t g = 0; g < G; g++) {
			int32_t acc = 0;
			if (bits == 8)
				for (uint32_t c = 0; c < d; c++)
					acc += (int32_t)qq->q8[g][c] * row[c];
			else
				for (uint32_t j = 0; j < d / 2; j++)
					acc += (int32_t)qq->q8n[g][j] * (row[j] & 15) +
					       (int32_t)qq->q8n[g][d / 2 + j] * (row[j] >> 4);
			s[g][b] = (float)acc;
		}
	}
	qk_logits_scalar(qq, G, nb, sz, s);
}

/* 1 when any of the segments holds quantised codes (attention_impl, and
 * attention_head's choice of kernels). */
static int segments_quantised(const struct kvr_kv_segment *segs, uint32_t n_segs)
{
	for (uint32_t i = 0; i < n_segs; i++)
		if (kvr_segment_quantised(segs[i].format))
			return 1;
	return 0;
}

/* 1 where attention prefetches a quantised page's next run into L2, not
 * L1: on AMD CPUs. Measured on one of each (a Sapphire Rapids and a Zen 4
 * VM, 2 cores, docs/history.md): L1 was 6% faster on the first for K8V4
 * from DRAM, L2 1.10-1.14x faster on the second. Any thread: reads the
 * vendor that libgcc's start-up detection recorded. */
static inline int kvr_cpu_runs_to_l2(void)
{
	return __builtin_cpu_is("amd");
}

/* ------------------------------------------------------------------ AVX-512 */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
static inline __attribute__((always_inline)) vf load16_avx512(const void *row, uint32_t t, uint64_t i)
{
	if (t == KVR_ELEM_F16)
		return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)));
	if (t == KVR_ELEM_BF16)
		return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(
			_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i))),
			16));
	return (vf)_mm512_loadu_ps((const float *)row + i);
}
static inline float fold16_avx512(vf v)
{
	const __m512 x = (__m512)v;
	const __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
	const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
	const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
	return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
}
/* Four horizontal sums at once: fold the four vectors together half by half so
 * each shuffle serves all of them. */
static inline void hsum4_avx512(vf a, vf b, vf c, vf d, float *out)
{
	const __m512 A = (__m512)a, B = (__m512)b, C = (__m512)c, D = (__m512)d;
	/* 128-bit blocks: [a0+a2, a1+a3, b0+b2, b1+b3] (blocks of 4 lanes) */
	const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(A, B, 0x44), _mm512_shuffle_f32x4(A, B, 0xee));
	const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(C, D, 0x44), _mm512_shuffle_f32x4(C, D, 0xee));
	/* blocks: [a, b, c, d], four partial sums each */
	__m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
	x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4e));
	x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xb1));
	const __m128i idx = _mm_setr_epi32(0, 4, 8, 12);
	_mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_castsi128_si512(idx), x)));
}
/* Sixteen canonical folds at once (the score kernel's 16 pages per batch):
 * each step w = 8, 4, 2, 1 adds lane l + w to lane l of every vector's
 * remaining lanes (kmath.h's order), two vectors' halves per add, so the 16
 * folds take 15 adds and 31 shuffles instead of 64 adds and 64 shuffles. The
 * pairings leave page 4i + b in lane 4b + i; one permute puts page p in lane p. */
static inline __attribute__((always_inline)) vf fold16x16_avx512(const vf *v)
{
	__m512 h[8];
	_Pragma("GCC unroll 8")
	for (int k = 0; k < 8; k++) { /* w = 8: [v0 lanes 0-7 | v1 lanes 0-7] */
		const __m512 a = (__m512)v[2 * k], b = (__m512)v[2 * k + 1];
		h[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
	}
	_Pragma("GCC unroll 4")
	for (int k = 0; k < 4; k++) { /* w = 4: one 128-bit block per page */
		const __m512 a = h[2 * k], b = h[2 * k + 1];
		h[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd));
	}
	_Pragma("GCC unroll 2")
	for (int k = 0; k < 2; k++) { /* w = 2: two lanes per page */
		const __m512 a = h[2 * k], b = h[2 * k + 1];
		h[k] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xee));
	}
	/* w = 1 */
	const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(h[0], h[1], 0x88), _mm512_shuffle_ps(h[0], h[1], 0xdd));
	const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
	return (vf)_mm512_permutexvar_ps(idx, r);
}
static inline __attribute__((always_inline)) vf codes16_avx512(const uint8_t *row, uint32_t bits, uint32_t c)
{
	return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes_bytes16(row, bits, c)));
}
/* Four bytes at p in every 32-bit lane: a load-port broadcast, which the
 * multiply-adds may take as their {1to16} operand. */
static inline __attribute__((always_inline)) __m512i bcast32_avx512(const void *p)
{
	return _mm512_broadcastd_epi32(_mm_loadu_si32(p));
}

/* Attention's exp (ATT_EXPA): kvr_expf's reduction and polynomial, its
 * power of two applied by one vscalefps instead of two multiplies and the
 * range blends, so equal to kvr_expf wherever the result is normal (a
 * subnormal one is rounded once, not twice). maxps keeps its second operand
 * when either is NaN, so a NaN stays NaN; below −110 (−inf too) the
 * result is exactly 0. */
static inline __attribute__((always_inline)) vf exp16_scalef_avx512(vf xv)
{
	const __m512 x = _mm512_max_ps(_mm512_set1_ps(-110.0f), (__m512)xv);
	const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(KVR_EXP_LOG2E)),
					      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
	__m512 r, p;
	KVR_EXP_POLY(_mm512_fmadd_ps, _mm512_fnmadd_ps, _mm512_set1_ps, n, x, r, p);
	return (vf)_mm512_scalef_ps(p, n);
}

/* VALUE_SZ16 in vectors: the pairs by one masked load, deinterleaved */
static inline __attribute__((always_inline)) void value_sz16_avx512(const uint16_t *sz, uint32_t nb, float centre,
								    float *vs, float *vz)
{
	const __m512i pairs = _mm512_maskz_loadu_epi16(nb >= 16 ? 0xffffffffu : (1u << (2 * nb)) - 1u, sz);
	const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(pairs));
	const __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(pairs, 1));
	const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
	const __m512 s = _mm512_permutex2var_ps(lo, even, hi);
	const __m512 z = _mm512_permutex2var_ps(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi);
	_mm512_storeu_ps(vs, s);
	_mm512_storeu_ps(vz, _mm512_sub_ps(z, _mm512_mul_ps(_mm512_set1_ps(centre), s)));
}

#define ISA avx512
#define CODES16(row, bits, c) codes16_avx512(row, bits, c)
#define VALUE_SZ16(sz, nb, centre, vs, vz) value_sz16_avx512(sz, nb, centre, vs, vz)
#define F16TOF32(h) _cvtsh_ss(h)
#define LOAD16(row, t, i) load16_avx512(row, t, i)
#define MAX16(a, b) ((vf)_mm512_max_ps((__m512)(a), (__m512)(b)))
#define FOLD16X16(v) fold16x16_avx512(v)
/* the score: 4 pages x 4 query heads, 16 accumulators of 32 registers */
#define SCORE_PAGE_BLOCK 4u
#define SCORE_HEAD_BLOCK 4u
#define QMASK_T __mmask16
#define QMASK_MAKE(q) _mm512_movepi32_mask(_mm512_castps_si512((__m512)(q)))
#define QMASK_GET(masks, i, q) ((masks)[i])
#define QSELECT(k, a, b) ((vf)_mm512_mask_blend_ps((k), (__m512)(b), (__m512)(a)))
#define FMA16(a, b, c) ((vf)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#define HSUM16(v) _mm512_reduce_add_ps((__m512)(v))
#define SPLAT16(x) ((vf)_mm512_set1_ps(x))
#define FOLD16(v) fold16_avx512(v)
#define HSUM4(a, b, c, d, out) hsum4_avx512(a, b, c, d, out)
#define HMAX16(v) _mm512_reduce_max_ps((__m512)(v))
#define ANYGTA(a, b) (_mm512_cmp_ps_mask((__m512)(a), (__m512)(b), _CMP_GT_OQ) != 0)
#define ATT_EXPA(x) exp16_scalef_avx512(x)
#include "cpu_kernels_isa.h" /* undefines ISA and the primitives */
#pragma GCC pop_options

/* ------------------------------------------------------------------ AVX-512 VNNI */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
/* The 16 x 16 dword transpose of x in place: row r's dword j becomes lane
 * r of x[j]. Two rounds within 128-bit lanes (4 x 4 blocks), two across. */
static inline __attribute__((always_inline)) void transpose16_epi32(__m512i *x)
{
	__m512i a[16], b[16];
	_Pragma("GCC unroll 8")
	for (int k = 0; k < 8; k++) {
		a[2 * k] = _mm512_unpacklo_epi32(x[2 * k], x[2 * k + 1]);
		a[2 * k + 1] = _mm512_unpackhi_epi32(x[2 * k], x[2 * k + 1]);
	}
	/* b[4k + i], lane L: rows 4k..4k + 3 of dword 4L + i */
	_Pragma("GCC unroll 4")
	for (int k = 0; k < 4; k++) {
		b[4 * k + 0] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
		b[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
		b[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
		b[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
	}
	_Pragma("GCC unroll 4")
	for (int i = 0; i < 4; i++) {
		/* lanes [quad 0 L0, quad 0 L2, quad 1 L0, quad 1 L2] and the L1/L3 twin */
		const __m512i e01 = _mm512_shuffle_i32x4(b[i], b[4 + i], 0x88);
		const __m512i o01 = _mm512_shuffle_i32x4(b[i], b[4 + i], 0xdd);
		const __m512i e23 = _mm512_shuffle_i32x4(b[8 + i], b[12 + i], 0x88);
		const __m512i o23 = _mm512_shuffle_i32x4(b[8 + i], b[12 + i], 0xdd);
		x[i] = _mm512_shuffle_i32x4(e01, e23, 0x88);      /* dword i */
		x[8 + i] = _mm512_shuffle_i32x4(e01, e23, 0xdd);  /* dword 8 + i */
		x[4 + i] = _mm512_shuffle_i32x4(o01, o23, 0x88);  /* dword 4 + i */
		x[12 + i] = _mm512_shuffle_i32x4(o01, o23, 0xdd); /* dword 12 + i */
	}
}

/*
 * Integer key dots with vpdpbusd (unsigned code bytes times signed query
 * bytes, four products a lane, into 32 bits), with the block's tokens in
 * the lanes: each 64-byte column of the 16 code rows is transposed (row b's
 * dword j into lane b of column j), and column j meets query dword j
 * broadcast, for every head of a block of eight whose accumulators stay in
 * registers. No horizontal sums: a head's 16 dots come out as one vector,
 * and its logits (kvr_qk8) are formed on 16 tokens at once. 4-bit columns
 * split into their low nibbles (the even elements, against q8n's first
 * half) and high ones (the odd, against its second).
 */
static void qk_dots_avx512vnni(const struct kvr_qk8 *qq, uint32_t G, uint32_t d, const unsigned char *krow,
			       uint64_t kstride, uint32_t bits, uint32_t nb, const uint16_t *sz, float (*s)[16])
{
	enum { HB = 8 }; /* heads a pass */
	const uint32_t row_bytes = d * bits / 8;
	const __m512i low4 = _mm512_set1_epi8(0x0f);
	/* the block's (s, z): 16 pairs of f16, deinterleaved */
	const __m512i pairs = _mm512_maskz_loadu_epi16(nb >= 16 ? 0xffffffffu : (1u << (2 * nb)) - 1u, sz);
	const __m512 sz_lo = _mm512_cvtph_ps(_mm512_castsi512_si256(pairs));
	const __m512 sz_hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(pairs, 1));
	const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
	const __m512 ks = _mm512_permutex2var_ps(sz_lo, even, sz_hi);
	const __m512 kz = _mm512_permutex2var_ps(sz_lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), sz_hi);
	for (uint32_t g0 = 0; g0 < G; g0 += HB) {
		const uint32_t nh = G - g0 < HB ? G - g0 : HB;
		__m512i acc[HB];
		_Pragma("GCC unroll 8")
		for (uint32_t h = 0; h < HB; h++)
			acc[h] = _mm512_setzero_si512();
		for (uint32_t o = 0; o < row_bytes; o += 64) {
			const __mmask64 m = row_bytes - o >= 64 ? ~0ull : (1ull << (row_bytes - o)) - 1u;
			const uint32_t cols = row_bytes - o >= 64 ? 16u : (row_bytes - o) / 4u;
			__m512i x[16];
			_Pragma("GCC unroll 16")
			for (uint32_t b = 0; b < 16; b++)
				x[b] = b < nb ? _mm512_maskz_loadu_epi8(m, krow + b * kstride + o) : _mm512_setzero_si512();
			transpose16_epi32(x);
			for (uint32_t j = 0; j < cols; j++) {
				if (bits == 8) {
					_Pragma("GCC unroll 8")
					for (uint32_t h = 0; h < HB; h++)
						if (h < nh) {
							acc[h] = _mm512_dpbusd_epi32(acc[h], x[j],
										     bcast32_avx512(qq->q8[g0 + h] + o + 4 * j));
						}
				} else {
					const __m512i lo = _mm512_and_si512(x[j], low4);
					const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(x[j], 4), low4);
					_Pragma("GCC unroll 8")
					for (uint32_t h = 0; h < HB; h++)
						if (h < nh) {
							acc[h] = _mm512_dpbusd_epi32(acc[h], lo,
										     bcast32_avx512(qq->q8n[g0 + h] + o + 4 * j));
							acc[h] = _mm512_dpbusd_epi32(
								acc[h], hi, bcast32_avx512(qq->q8n[g0 + h] + d / 2 + o + 4 * j));
						}
				}
			}
		}
		_Pragma("GCC unroll 8")
		for (uint32_t h = 0; h < HB; h++)
			if (h < nh) {
				const __m512 dots = _mm512_cvtepi32_ps(acc[h]);
				const __m512 t = _mm512_sub_ps(_mm512_mul_ps(ks, dots),
							       _mm512_mul_ps(kz, _mm512_set1_ps(qq->code_sum_f[g0 + h])));
				_mm512_storeu_ps(s[g0 + h], _mm512_mul_ps(_mm512_set1_ps(qq->scale[g0 + h]), t));
			}
	}
}

/*
 * Integer value dots with vpdpbusd (pv_dots_fn): the codes of four tokens
 * interleaved in each dword (byte t of the dword is token t's code of one
 * channel) meet the four tokens' weights broadcast, so one instruction does
 * four tokens' multiply-adds for 16 channels. The row is taken 64 channels
 * at a time (a sub-piece: 32 bytes of 4-bit codes or 16 of 2-bit ones),
 * broadcast to every 256- or 128-bit lane and shifted per lane so that each
 * lane holds one nibble or crumb plane of it (pv_channel's order); the
 * block's 16 interleaved vectors are built once and serve every head.
 * A weight has 16 bits, taken as its high and its low byte (vpdpbusd
 * multiplies unsigned bytes, the weights', by signed ones, the codes'): the
 * high bytes' sums first, shifted left by 8, then the low bytes' added in
 * the same accumulator, exact since 16 tokens · 65535 · 8 < 2^24 (also
 * exactly a float). The codes are taken centred, Q − 2^(bits−1) (−8..7,
 * −2..1), and attention_impl moves the zero point to match (z − c·s):
 * Σ p·s·Q and Σ p·z nearly cancel for values near the middle of their
 * range, so the weights' rounding, relative to the first, was a large share
 * of their difference (uncentred, K8V4's perplexity on SmolLM2 was 0.4–0.5%
 * above float value sums; centred, 0.1–0.2%: docs/history.md). Rows past nb
 * read as zeros: centred, they are −c, but their weights are 0 (and the run
 * may end there).
 */
static void pv_dots_avx512vnni(uint32_t G, uint32_t d, uint32_t bits, const unsigned char *vrow, uint64_t vstride,
			       uint32_t nb, const float (*w)[16], float (*vacc)[256])
{
	static const unsigned char zero_row[128] __attribute__((aligned(64))); /* a 4-bit row at d = 256 */
	/* each head's 16 weights as high and low bytes (a dword per four
	 * tokens), and the scale back: max w / 65535 */
	uint32_t whi[KVR_MAX_GROUP_CPU][4], wlo[KVR_MAX_GROUP_CPU][4];
	float wscale[KVR_MAX_GROUP_CPU];
	for (uint32_t g = 0; g < G; g++) {
		const __m512 x = _mm512_loadu_ps(w[g]);
		const float mx = _mm512_reduce_max_ps(x);
		const int live = mx > 0.0f && mx <= 3.4e38f; /* all zero (or not finite: run_sum says NaN) */
		wscale[g] = live ? mx / 65535.0f : 0.0f;
		const __m512i r = _mm512_min_epi32(
			_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(live ? 65535.0f / mx : 0.0f))),
					 _mm512_setzero_si512()),
			_mm512_set1_epi32(65535));
		_mm_storeu_si128((__m128i *)whi[g], _mm512_cvtepi32_epi8(_mm512_srli_epi32(r, 8)));
		_mm_storeu_si128((__m128i *)wlo[g], _mm512_cvtepi32_epi8(r));
	}
	const unsigned char *rowp[16];
	for (uint32_t b = 0; b < 16; b++)
		rowp[b] = b < nb ? vrow + b * vstride : zero_row;
	/* per 16-bit lane, the shift that brings each 256-bit (4-bit codes) or
	 * 128-bit (2-bit) lane's plane down to its low bits */
	const __m512i shift = bits == 4 ? _mm512_setr_epi64(0, 0, 0, 0, 0x0004000400040004ll, 0x0004000400040004ll,
							      0x0004000400040004ll, 0x0004000400040004ll)
					: _mm512_setr_epi64(0, 0, 0x0002000200020002ll, 0x0002000200020002ll,
							    0x0004000400040004ll, 0x0004000400040004ll,
							    0x0006000600060006ll, 0x0006000600060006ll);
	const __m512i mask = _mm512_set1_epi8((char)((1u << bits) - 1u));
	const __m512i centre = _mm512_set1_epi8((char)(1u << (bits - 1u)));
	const uint32_t sub_bytes = 8u * bits; /* a sub-piece's 64 codes */
	for (uint32_t s = 0; s < d / 64u; s++) {
		__m512i x[4][4]; /* [tokens 4i..4i+3][channel vector k] */
		_Pragma("GCC unroll 4")
		for (uint32_t i = 0; i < 4; i++) {
			__m512i c[4];
			_Pragma("GCC unroll 4")
			for (uint32_t t = 0; t < 4; t++) {
				const unsigned char *p = rowp[4 * i + t] + s * sub_bytes;
				const __m512i r = bits == 4 ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p))
							    : _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p));
				c[t] = _mm512_sub_epi8(_mm512_and_si512(_mm512_srlv_epi16(r, shift), mask), centre);
			}
			const __m512i a0 = _mm512_unpacklo_epi8(c[0], c[1]), a1 = _mm512_unpackhi_epi8(c[0], c[1]);
			const __m512i b0 = _mm512_unpacklo_epi8(c[2], c[3]), b1 = _mm512_unpackhi_epi8(c[2], c[3]);
			x[i][0] = _mm512_unpacklo_epi16(a0, b0);
			x[i][1] = _mm512_unpackhi_epi16(a0, b0);
			x[i][2] = _mm512_unpacklo_epi16(a1, b1);
			x[i][3] = _mm512_unpackhi_epi16(a1, b1);
		}
		for (uint32_t g = 0; g < G; g++) {
			__m512i acc[4];
			_Pragma("GCC unroll 4")
			for (uint32_t k = 0; k < 4; k++)
				acc[k] = _mm512_setzero_si512();
			_Pragma("GCC unroll 2")
			for (uint32_t pass = 0; pass < 2; pass++) { /* high bytes, then low */
				if (pass) {
					_Pragma("GCC unroll 4")
					for (uint32_t k = 0; k < 4; k++)
						acc[k] = _mm512_slli_epi32(acc[k], 8);
				}
				_Pragma("GCC unroll 4")
				for (uint32_t i = 0; i < 4; i++) {
					const __m512i wb = _mm512_set1_epi32((int)(pass ? wlo[g][i] : whi[g][i]));
					_Pragma("GCC unroll 4")
					for (uint32_t k = 0; k < 4; k++)
						acc[k] = _mm512_dpbusd_epi32(acc[k], wb, x[i][k]);
				}
			}
			const __m512 sc = _mm512_set1_ps(wscale[g]);
			float *dst = vacc[g] + 64u * s;
			_Pragma("GCC unroll 4")
			for (uint32_t k = 0; k < 4; k++)
				_mm512_storeu_ps(dst + 16u * k, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[k]), sc,
										_mm512_loadu_ps(dst + 16u * k)));
		}
	}
}
#pragma GCC pop_options

/* ------------------------------------------------------------------ AVX2 */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
union v16_halves {
	vf v;
	__m256 h[2];
};

static inline __m256 load8_avx2(const void *row, uint32_t t, uint64_t i)
{
	if (t == KVR_ELEM_F16)
		return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
	if (t == KVR_ELEM_BF16)
		return _mm256_castsi256_ps(_mm256_slli_epi32(
			_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i))),
			16));
	return _mm256_loadu_ps((const float *)row + i);
}

static inline __attribute__((always_inline)) vf splat16_avx2(float x)
{
	union v16_halves u;
	u.h[0] = u.h[1] = _mm256_set1_ps(x);
	return u.v;
}

/* The 8 lanes' sum in kmath.h's canonical order: each step adds the upper
 * half to the lower (4, 2, 1). */
static inline __attribute__((always_inline)) float hsum8_avx2(__m256 s)
{
	__m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
	h = _mm_add_ps(h, _mm_movehl_ps(h, h));
	h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
	return _mm_cvtss_f32(h);
}
/* kmath.h's canonical fold of 16 lanes: the halves added, then as above. */
static inline float fold16_avx2(vf v)
{
	union v16_halves u = { v };
	return hsum8_avx2(_mm256_add_ps(u.h[0], u.h[1]));
}

static inline __attribute__((always_inline)) vf max16_avx2(vf a, vf b)
{
	union v16_halves x = { a }, y = { b }, r;
	r.h[0] = _mm256_max_ps(x.h[0], y.h[0]);
	r.h[1] = _mm256_max_ps(x.h[1], y.h[1]);
	return r.v;
}

/* Sixteen canonical folds at once, as fold16x16_avx512 does with 8-lane
 * halves: w = 8 adds a page's halves; w = 4 pairs two pages' 128-bit halves;
 * w = 2 and w = 1 add within 128-bit lanes, two pages per shuffle. The
 * pairings leave pages 8i + {0, 2, 4, 6 | 1, 3, 5, 7} in result i's lanes;
 * one permute each restores page order. */
static inline __attribute__((always_inline)) vf fold16x16_avx2(const vf *v)
{
	__m256 h[16];
	_Pragma("GCC unroll 16")
	for (int p = 0; p < 16; p++) { /* w = 8 */
		union v16_halves u = { v[p] };
		h[p] = _mm256_add_ps(u.h[0], u.h[1]);
	}
	_Pragma("GCC unroll 8")
	for (int k = 0; k < 8; k++) /* w = 4: [page 2k | page 2k+1], 4 lanes each */
		h[k] = _mm256_add_ps(_mm256_permute2f128_ps(h[2 * k], h[2 * k + 1], 0x20),
				     _mm256_permute2f128_ps(h[2 * k], h[2 * k + 1], 0x31));
	_Pragma("GCC unroll 4")
	for (int k = 0; k < 4; k++) /* w = 2: two lanes per page */
		h[k] = _mm256_add_ps(_mm256_shuffle_ps(h[2 * k], h[2 * k + 1], 0x44),
				     _mm256_shuffle_ps(h[2 * k], h[2 * k + 1], 0xee));
	const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
	union v16_halves r;
	_Pragma("GCC unroll 2")
	for (int k = 0; k < 2; k++) /* w = 1 */
		r.h[k] = _mm256_permutevar8x32_ps(_mm256_add_ps(_mm256_shuffle_ps(h[2 * k], h[2 * k + 1], 0x88),
								_mm256_shuffle_ps(h[2 * k], h[2 * k + 1], 0xdd)),
						  order);
	return r.v;
}
/* Four horizontal sums at once: pairwise hadds serve all four vectors. */
static inline __attribute__((always_inline)) void hsum4x8_avx2(__m256 a, __m256 b, __m256 c, __m256 d,
								float *out)
{
	const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
	const __m256 abcd = _mm256_hadd_ps(ab, cd); /* per 128-bit half: a b c d partials */
	_mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}
/* The largest lane (no lane is NaN: MAXA passed NaN over). */
static inline __attribute__((always_inline)) float hmax8_avx2(__m256 v)
{
	__m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
	h = _mm_max_ps(h, _mm_movehl_ps(h, h));
	h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
	return _mm_cvtss_f32(h);
}
/* exp16's formula (kvr_expf's) on 8 lanes, in intrinsics: the same formula
 * written once in generic vector operations over both widths doubled the
 * attention kernel's stack traffic on AVX2 (GCC spilled around the generic
 * compares and blends) and cost it 0.7-0.8x of its speed, so it stays here. */
static inline __attribute__((always_inline)) __m256 exp8_avx2(__m256 x)
{
	const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
	const __m256 big = _mm256_cmp_ps(x, _mm256_set1_ps(88.7228317f), _CMP_GT_OQ);
	const __m256 small = _mm256_cmp_ps(x, _mm256_set1_ps(-103.972084f), _CMP_LT_OQ);
	const __m256 xc = _mm256_blendv_ps(x, _mm256_setzero_ps(), _mm256_or_ps(_mm256_or_ps(big, small), is_nan));
	const __m256 t = _mm256_mul_ps(xc, _mm256_set1_ps(KVR_EXP_LOG2E));
	const __m256 n = _mm256_sub_ps(_mm256_add_ps(t, _mm256_set1_ps(12582912.0f)), _mm256_set1_ps(12582912.0f));
	__m256 r, p;
	KVR_EXP_POLY(_mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_set1_ps, n, xc, r, p);
	const __m256i e = _mm256_cvttps_epi32(n);
	const __m256i e1 = _mm256_min_epi32(_mm256_max_epi32(e, _mm256_set1_epi32(-126)), _mm256_set1_epi32(127));
	const __m256i bias = _mm256_set1_epi32(127);
	p = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, bias), 23)));
	p = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(e, e1), bias), 23)));
	p = _mm256_blendv_ps(p, _mm256_setzero_ps(), small);
	p = _mm256_blendv_ps(p, _mm256_set1_ps(INFINITY), big);
	return _mm256_blendv_ps(p, x, is_nan);
}
/* Attention's exp on 8 lanes (ATT_EXPA): exp8_avx2's reduction and
 * polynomial with the argument clamped to [−87, 88], where 2^n is one
 * normal power of two, and 0 below −87 (the weights there are under 2^−125
 * of the largest; a segment whose scores all lie that far below the
 * running max gets log-sum-exp −inf), in place of the range blends. min
 * and max keep their second operand when either is NaN, so a NaN stays
 * NaN. */
static inline __attribute__((always_inline)) __m256 exp8_att_avx2(__m256 x)
{
	const __m256 below = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
	const __m256 xc = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
	const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(KVR_EXP_LOG2E)),
					 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
	__m256 r, p;
	KVR_EXP_POLY(_mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_set1_ps, n, xc, r, p);
	const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
	p = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
	return _mm256_andnot_ps(below, p);
}
/* Codes 16c..16c+15 of a packed quantised row as two 8-float vectors, each
 * group of 16 unpacked once. */
static inline __attribute__((always_inline)) void codes16x2_avx2(const uint8_t *row, uint32_t bits, uint32_t c,
								 __m256 *out)
{
	const __m128i b = codes_bytes16(row, bits, c);
	out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
	out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
}
/* Integer key dots on AVX2: 8-bit codes widened to words against q16
 * (vpmaddwd), 4-bit codes as bytes against q8n (vpmaddubsw, no saturation
 * at 15·127·2), 32, 16 or 8 code bytes a load; at d = 64 and 128 two
 * tokens at a time (qk_pair_heads_avx2), otherwise four query heads at a
 * time (a group's last block repeats its last head and drops the copies).
 * They also serve the AVX-512 path without VNNI (attention_head). */
static inline __attribute__((always_inline)) __m256i codes_bytes32_avx2(const unsigned char *p, uint32_t left)
{
	if (left >= 32)
		return _mm256_loadu_si256((const __m256i *)p);
	if (left >= 16)
		return _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p));
	return _mm256_zextsi128_si256(_mm_loadl_epi64((const __m128i *)p));
}
/* qk_logits_scalar's arithmetic on 8 tokens a vector: the scalar form, a
 * software f16 conversion and four operations per token and head, was a
 * tenth of the 8-bit key dots' instructions. Lanes past nb compute on
 * whatever s holds there; attention_impl overwrites them. */
static inline __attribute__((always_inline)) void qk_logits_avx2(const struct kvr_qk8 *qq, uint32_t G, uint32_t nb,
								 const uint16_t *sz, float (*s)[16])
{
	float ks[16] __attribute__((aligned(32))), kz[16] __attribute__((aligned(32)));
	for (uint32_t b = 0; b < 16; b++) {
		ks[b] = b < nb ? _cvtsh_ss(sz[2 * b]) : 0.0f;
		kz[b] = b < nb ? _cvtsh_ss(sz[2 * b + 1]) : 0.0f;
	}
	const uint32_t halves = nb > 8 ? 2u : 1u;
	for (uint32_t g = 0; g < G; g++) {
		const __m256 cs = _mm256_set1_ps(qq->code_sum_f[g]), sc = _mm256_set1_ps(qq->scale[g]);
		for (uint32_t h = 0; h < halves; h++) {
			const __m256 dots = _mm256_loadu_ps(s[g] + 8 * h);
			const __m256 t = _mm256_sub_ps(_mm256_mul_ps(_mm256_load_ps(ks + 8 * h), dots),
						       _mm256_mul_ps(_mm256_load_ps(kz + 8 * h), cs));
			_mm256_storeu_ps(s[g] + 8 * h, _mm256_mul_ps(sc, t));
		}
	}
}
/*
 * Key dots two tokens at a time (8-bit codes as words against q16, 4-bit
 * ones as bytes against q8n, as below): each query vector loaded serves
 * both tokens, and the 2·n accumulators fold into one vector (vphaddd,
 * exact) whose lanes are [token b: heads 0..3 | token b + 1: heads 0..3],
 * one conversion for eight dots. Token by token the fold, four conversions
 * and the scalar stores had taken as long as the multiply-adds at d = 128.
 * bits, d (64, 128) and n ≤ 4 heads from g are constants.
 */
static inline __attribute__((always_inline)) void qk_pair_heads_avx2(const struct kvr_qk8 *qq, uint32_t g,
								      const uint32_t n, const uint32_t d,
								      const uint32_t bits, const unsigned char *krow,
								      uint64_t kstride, uint32_t nb, float (*s)[16])
{
	const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
	for (uint32_t b = 0; b < nb; b += 2) {
		/* an odd last token pairs with itself; its copy is not stored */
		const unsigned char *r0 = krow + b * kstride, *r1 = b + 1 < nb ? r0 + kstride : r0;
		__m256i a0[4], a1[4];
		_Pragma("GCC unroll 4")
		for (uint32_t h = 0; h < 4; h++)
			a0[h] = a1[h] = _mm256_setzero_si256();
		if (bits == 8) {
			_Pragma("GCC unroll 1") /* unrolled, GCC hoisted all of q16 and spilled it */
			for (uint32_t o = 0; o < d; o += 16) {
				const __m256i x0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(r0 + o)));
				const __m256i x1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(r1 + o)));
				_Pragma("GCC unroll 4")
				for (uint32_t h = 0; h < n; h++) {
					const __m256i qv = _mm256_loadu_si256((const __m256i *)(qq->q16[g + h] + o));
					a0[h] = _mm256_add_epi32(a0[h], _mm256_madd_epi16(x0, qv));
					a1[h] = _mm256_add_epi32(a1[h], _mm256_madd_epi16(x1, qv));
				}
			}
		} else {
			_Pragma("GCC unroll 1")
			for (uint32_t o = 0; o < d / 2u; o += 32) {
				const __m256i x0 = _mm256_loadu_si256((const __m256i *)(r0 + o));
				const __m256i x1 = _mm256_loadu_si256((const __m256i *)(r1 + o));
				const __m256i lo0 = _mm256_and_si256(x0, low4);
				const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(x0, 4), low4);
				const __m256i lo1 = _mm256_and_si256(x1, low4);
				const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(x1, 4), low4);
				_Pragma("GCC unroll 4")
				for (uint32_t h = 0; h < n; h++) {
					const __m256i qe = _mm256_loadu_si256((const __m256i *)(qq->q8n[g + h] + o));
					const __m256i qo = _mm256_loadu_si256((const __m256i *)(qq->q8n[g + h] + d / 2u + o));
					a0[h] = _mm256_add_epi32(a0[h], _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo0, qe),
													   _mm256_maddubs_epi16(hi0, qo)),
											  ones));
					a1[h] = _mm256_add_epi32(a1[h], _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo1, qe),
													   _mm256_maddubs_epi16(hi1, qo)),
											  ones));
				}
			}
		}
		/* lanes: per 128-bit half, the partial sums of heads 0..3 */
		const __m256i f0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a0[0], a0[1]), _mm256_hadd_epi32(a0[2], a0[3]));
		const __m256i f1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a1[0], a1[1]), _mm256_hadd_epi32(a1[2], a1[3]));
		const __m256i sum = _mm256_add_epi32(_mm256_permute2x128_si256(f0, f1, 0x20),
						     _mm256_permute2x128_si256(f0, f1, 0x31));
		float dots[8] __attribute__((aligned(32)));
		_mm256_store_ps(dots, _mm256_cvtepi32_ps(sum));
		_Pragma("GCC unroll 4")
		for (uint32_t h = 0; h < n; h++) {
			s[g + h][b] = dots[h];
			s[g + h][b + 1] = dots[4 + h]; /* b + 1 = nb ≤ 15: a lane attention_impl overwrites */
		}
	}
}
static inline __attribute__((always_inline)) void qk_pair_dots_avx2(const struct kvr_qk8 *qq, uint32_t G,
								     const uint32_t d, const uint32_t bits,
								     const unsigned char *krow, uint64_t kstride,
								     uint32_t nb, float (*s)[16])
{
#define QK_PAIR_HEADS(g, n) qk_pair_heads_avx2(qq, g, n, d, bits, krow, kstride, nb, s)
	HEADS_BY_FOUR(G, QK_PAIR_HEADS);
#undef QK_PAIR_HEADS
}
static void qk_dots_avx2(const struct kvr_qk8 *qq, uint32_t G, uint32_t d, const unsigned char *krow,
			 uint64_t kstride, uint32_t bits, uint32_t nb, const uint16_t *sz, float (*s)[16])
{
	if (d == 128 || d == 64) {
		if (bits == 8 && d == 128)
			qk_pair_dots_avx2(qq, G, 128, 8, krow, kstride, nb, s);
		else if (bits == 8)
			qk_pair_dots_avx2(qq, G, 64, 8, krow, kstride, nb, s);
		else if (d == 128)
			qk_pair_dots_avx2(qq, G, 128, 4, krow, kstride, nb, s);
		else
			qk_pair_dots_avx2(qq, G, 64, 4, krow, kstride, nb, s);
		qk_logits_avx2(qq, G, nb, sz, s);
		return;
	}
	const uint32_t row_bytes = d * bits / 8;
	const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
	for (uint32_t b = 0; b < nb; b++) {
		const unsigned char *row = krow + b * kstride;
		for (uint32_t g = 0; g < G; g += 4) {
			uint32_t hs[4];
			_Pragma("GCC unroll 4")
			for (uint32_t h = 0; h < 4; h++)
				hs[h] = g + h < G ? g + h : G - 1;
			__m256i acc[4];
			_Pragma("GCC unroll 4")
			for (uint32_t h = 0; h < 4; h++)
				acc[h] = _mm256_setzero_si256();
			if (bits == 8)
				for (uint32_t o = 0; o < row_bytes; o += 16) {
					const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + o)));
					_Pragma("GCC unroll 4")
					for (uint32_t h = 0; h < 4; h++)
						acc[h] = _mm256_add_epi32(acc[h], _mm256_madd_epi16(x, _mm256_loadu_si256(
												     (const __m256i *)(qq->q16[hs[h]] + o))));
				}
			else
				for (uint32_t o = 0; o < row_bytes; o += 32) {
					const __m256i x = codes_bytes32_avx2(row + o, row_bytes - o);
					const __m256i lo = _mm256_and_si256(x, low4);
					const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), low4);
					_Pragma("GCC unroll 4")
					for (uint32_t h = 0; h < 4; h++) {
						const __m256i p = _mm256_add_epi16(
							_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(qq->q8n[hs[h]] + o))),
							_mm256_maddubs_epi16(hi, _mm256_loadu_si256(
											 (const __m256i *)(qq->q8n[hs[h]] + d / 2 + o))));
						acc[h] = _mm256_add_epi32(acc[h], _mm256_madd_epi16(p, ones));
					}
				}
			float four[4];
			hsum4x8_avx2(_mm256_cvtepi32_ps(acc[0]), _mm256_cvtepi32_ps(acc[1]), _mm256_cvtepi32_ps(acc[2]),
				     _mm256_cvtepi32_ps(acc[3]), four);
			for (uint32_t h = 0; h < 4 && g + h < G; h++)
				s[g + h][b] = four[h];
		}
	}
	qk_logits_avx2(qq, G, nb, sz, s);
}
/*
 * Value sums on AVX2 (pv_dots_fn): float ones for 4-bit values
 * (pv4_heads_avx2, above), integer ones for 2-bit values, with
 * vpmaddubsw: unsigned bytes (the weights) times signed bytes (the codes,
 * centred as on VNNI: Q − 2), adjacent pairs summed into 16 bits. The codes
 * of two tokens are interleaved byte by byte, so one instruction does two
 * tokens' products for 16 channels, and a block's eight token pairs add up
 * in 16 bits without overflow: twice the multiply-adds of a float FMA per
 * instruction, where the float path also pays a conversion per code. AVX2
 * has no byte product that takes 16-bit weights in one pass (vpmaddwd over
 * token pairs was measured slower than the floats: docs/history.md), so a
 * head's weights are rounded to 8 bits against the block's largest, r =
 * round(255·w / max w): an error of up to max w / 510 per token (the
 * contract's bound for this path: docs/api.md, gpu/reference/reference.h). Only
 * for K4V2's 2-bit values, whose own rounding (up to half a step, a
 * sixth of their range) dwarfs it; on K8V4's 4-bit values the same sums put the model's
 * perplexity 0.4–0.5% above float value sums, so those stay float here
 * (docs/history.md). vacc's order (pv_channel_avx2): 2-bit, per sub-piece
 * of 64 channels, crumb plane k's 16 words split into the even words (8
 * lanes) and the odd ones; 4-bit, per 16 channels, the 8 even then the 8
 * odd.
 */
static inline int pv_fits_avx2(uint32_t value_bits, uint32_t d)
{
	return (value_bits == 2 && pv_fits(value_bits, d)) || (value_bits == 4 && d % 16u == 0 && d <= 256u);
}
/* The 4-bit sums take the codes uncentred (pv4_heads_avx2: float sums lose
 * nothing to the zero point); the 2-bit byte sums centred. */
#define PV_CENTRE(bits) ((bits) == 2 ? 2.0f : 0.0f)
static inline uint32_t pv_channel_avx2(uint32_t i, uint32_t bits)
{
	if (bits == 4) /* per 16 channels: the 8 even ones, then the 8 odd */
		return 16u * (i / 16u) + 2u * (i % 8u) + i / 8u % 2u;
	const uint32_t s = i / 64u, k = i / 16u % 4u, e = i / 8u % 2u, l = i % 8u;
	const uint32_t w = 2u * l + e; /* the word of plane k's accumulator */
	const uint32_t L = w / 8u, kk = w % 8u; /* its 128-bit lane, and its word there */
	return 64u * s + 4u * (8u * L + kk) + k; /* crumb k of the sub-piece's byte 8L + kk */
}
/*
 * 4-bit value sums on AVX2 (K8V4's values), still float multiply-adds on
 * the exact codes, so under the float contract: what changes is the
 * unpacking. In channel order a row's 16 codes took five shuffles and two
 * masks per token (codes_bytes16, two widenings, a byte shift); here one
 * widening of the row's 8 bytes gives their low nibbles (the even channels)
 * by a mask and their high nibbles (the odd ones) by a shift, so vacc holds
 * each 16 channels as [8 even | 8 odd] (pv_channel_avx2) and pv_flush puts
 * them back in order once per run, not per token. Heads g..g+n−1 (n ≤ 4, a
 * constant): each converted code vector feeds n multiply-adds, and the 2n
 * accumulators stay in registers over the block.
 */
static inline __attribute__((always_inline)) void pv4_heads_avx2(uint32_t g, const uint32_t n, uint32_t d,
								  const unsigned char *vrow, uint64_t vstride,
								  uint32_t nb, const float (*w)[16], float (*vacc)[256])
{
	const __m256i low4 = _mm256_set1_epi32(0x0f);
	for (uint32_t j = 0; j < d / 16u; j++) {
		__m256 a[4][2];
		_Pragma("GCC unroll 4")
		for (uint32_t h = 0; h < n; h++) {
			a[h][0] = _mm256_loadu_ps(vacc[g + h] + 16u * j);
			a[h][1] = _mm256_loadu_ps(vacc[g + h] + 16u * j + 8u);
		}
		const unsigned char *row = vrow + 8u * j;
		for (uint32_t b = 0; b < nb; b++, row += vstride) {
			const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)row));
			const __m256 ev = _mm256_cvtepi32_ps(_mm256_and_si256(x, low4));
			const __m256 od = _mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4));
			_Pragma("GCC unroll 4")
			for (uint32_t h = 0; h < n; h++) {
				const __m256 wv = _mm256_broadcast_ss(&w[g + h][b]);
				a[h][0] = _mm256_fmadd_ps(wv, ev, a[h][0]);
				a[h][1] = _mm256_fmadd_ps(wv, od, a[h][1]);
			}
		}
		_Pragma("GCC unroll 4")
		for (uint32_t h = 0; h < n; h++) {
			_mm256_storeu_ps(vacc[g + h] + 16u * j, a[h][0]);
			_mm256_storeu_ps(vacc[g + h] + 16u * j + 8u, a[h][1]);
		}
	}
}
static void pv_dots_avx2(uint32_t G, uint32_t d, uint32_t bits, const unsigned char *vrow, uint64_t vstride,
			 uint32_t nb, const float (*w)[16], float (*vacc)[256])
{
	if (bits == 4) {
#define PV4_HEADS(g, n) pv4_heads_avx2(g, n, d, vrow, vstride, nb, w, vacc)
		HEADS_BY_FOUR(G, PV4_HEADS);
#undef PV4_HEADS
		return;
	}
	static const unsigned char zero_row[64] __attribute__((aligned(64))); /* a 2-bit row at d = 256 */
	/* each head's weights as byte pairs (token 2i low, 2i + 1 high), and
	 * the scale back: max w / 255 */
	uint16_t wpair[KVR_MAX_GROUP_CPU][8];
	float wscale[KVR_MAX_GROUP_CPU];
	for (uint32_t g = 0; g < G; g++) {
		const __m256 a = _mm256_loadu_ps(w[g]), b = _mm256_loadu_ps(w[g] + 8);
		const float mx = hmax8_avx2(_mm256_max_ps(a, b)); /* a NaN lane may win: not live */
		const int live = mx > 0.0f && mx <= 3.4e38f; /* all zero (or not finite: run_sum says NaN) */
		wscale[g] = live ? mx / 255.0f : 0.0f;
		const __m256 f = _mm256_set1_ps(live ? 255.0f / mx : 0.0f);
		/* clamped to 255 (a lane above it: max w was not the largest,
		 * a NaN lane having won), then the saturating packs clamp below
		 * at 0 (a NaN converts to INT_MIN) and leave the 16 bytes in
		 * token order, token 2i the low byte of pair i, once the dwords
		 * are put back in order */
		const __m256i top = _mm256_set1_epi32(255);
		const __m256i r16 = _mm256_packus_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(a, f)), top),
							_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(b, f)), top));
		const __m256i r8 = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(r16, r16),
							       _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5));
		_mm_storeu_si128((__m128i *)wpair[g], _mm256_castsi256_si128(r8));
	}
	const uint32_t pairs = (nb + 1u) / 2u;
	const unsigned char *rowp[16];
	for (uint32_t b = 0; b < 16; b++)
		rowp[b] = b < nb ? vrow + b * vstride : zero_row;
	const __m256i low2 = _mm256_set1_epi8(0x03), centre = _mm256_set1_epi8(2);
	const __m256i even = _mm256_set1_epi32(1), odd = _mm256_set1_epi32(0x10000);
	for (uint32_t s = 0; s < d / 64u; s++) {
		/* [token pair][crumb plane]: the pair's 16 code bytes of the
		 * sub-piece interleaved (byte j of each in word j), one plane a
		 * vector, centred; rows past nb read as zeros (weight 0) */
		__m256i x[8][4];
		for (uint32_t pr = 0; pr < pairs; pr++) {
			const __m128i a = _mm_loadu_si128((const __m128i *)(rowp[2 * pr] + 16u * s));
			const __m128i b = _mm_loadu_si128((const __m128i *)(rowp[2 * pr + 1] + 16u * s));
			const __m256i y = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(a, b)),
								  _mm_unpackhi_epi8(a, b), 1);
			x[pr][0] = _mm256_sub_epi8(_mm256_and_si256(y, low2), centre);
			x[pr][1] = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(y, 2), low2), centre);
			x[pr][2] = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(y, 4), low2), centre);
			x[pr][3] = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(y, 6), low2), centre);
		}
		for (uint32_t g = 0; g < G; g++) {
			/* |pair sum| ≤ 2·255·2: 8 pairs stay far inside 16 bits */
			__m256i acc[4];
			_Pragma("GCC unroll 4")
			for (uint32_t k = 0; k < 4; k++)
				acc[k] = _mm256_setzero_si256();
			for (uint32_t pr = 0; pr < pairs; pr++) {
				const __m256i wv = _mm256_set1_epi16((short)wpair[g][pr]);
				_Pragma("GCC unroll 4")
				for (uint32_t k = 0; k < 4; k++)
					acc[k] = _mm256_add_epi16(acc[k], _mm256_maddubs_epi16(wv, x[pr][k]));
			}
			const __m256 sc = _mm256_set1_ps(wscale[g]);
			float *dst = vacc[g] + 64u * s;
			_Pragma("GCC unroll 4")
			for (uint32_t k = 0; k < 4; k++) {
				const __m256 ev = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[k], even));
				const __m256 od = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[k], odd));
				_mm256_storeu_ps(dst + 16u * k, _mm256_fmadd_ps(ev, sc, _mm256_loadu_ps(dst + 16u * k)));
				_mm256_storeu_ps(dst + 16u * k + 8u,
						 _mm256_fmadd_ps(od, sc, _mm256_loadu_ps(dst + 16u * k + 8u)));
			}
		}
	}
}
/* VALUE_SZ16 in vectors: eight pairs a masked load (vpmaskmovd does not
 * touch the lanes it skips), the s and z halves packed apart */
static inline __attribute__((always_inline)) void value_sz16_avx2(const uint16_t *sz, uint32_t nb, float centre,
								  float *vs, float *vz)
{
	const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
	const __m256i n = _mm256_set1_epi32((int)nb);
	const __m256i a = _mm256_maskload_epi32((const int *)sz, _mm256_cmpgt_epi32(n, lane));
	const __m256i b = _mm256_maskload_epi32((const int *)sz + 8,
						_mm256_cmpgt_epi32(n, _mm256_add_epi32(lane, _mm256_set1_epi32(8))));
	const __m256i low = _mm256_set1_epi32(0xffff);
	/* packus interleaves the 128-bit halves: [a0-3 b0-3 | a4-7 b4-7] */
	const __m256i s16 = _mm256_permute4x64_epi64(
		_mm256_packus_epi32(_mm256_and_si256(a, low), _mm256_and_si256(b, low)), 0xd8);
	const __m256i z16 = _mm256_permute4x64_epi64(
		_mm256_packus_epi32(_mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16)), 0xd8);
	const __m256 c = _mm256_set1_ps(centre);
	_Pragma("GCC unroll 2")
	for (int h = 0; h < 2; h++) {
		const __m256 sv = _mm256_cvtph_ps(h ? _mm256_extracti128_si256(s16, 1) : _mm256_castsi256_si128(s16));
		const __m256 zv = _mm256_cvtph_ps(h ? _mm256_extracti128_si256(z16, 1) : _mm256_castsi256_si128(z16));
		_mm256_storeu_ps(vs + 8 * h, sv);
		_mm256_storeu_ps(vz + 8 * h, _mm256_sub_ps(zv, _mm256_mul_ps(c, sv)));
	}
}

#define PV_CHANNEL(i, bits) pv_channel_avx2(i, bits)
#define PV_FITS(bits, d) pv_fits_avx2(bits, d)
#define ISA avx2
#define F16TOF32(h) _cvtsh_ss(h)
#define MAX16(a, b) max16_avx2(a, b)
#define FOLD16X16(v) fold16x16_avx2(v)
/* the score: 2 pages x 2 query heads x 2 halves, 8 accumulators of 16
 * registers (4 x 4 spilled) */
#define SCORE_PAGE_BLOCK 2u
#define SCORE_HEAD_BLOCK 2u
#define QMASK_T unsigned char /* unused: vblendvps reads the query's sign bits */
#define QMASK_MAKE(q) 0
#define QMASK_GET(masks, i, q) ((void)(masks), (q))
#define QSELECT(k, a, b) _mm256_blendv_ps((b), (a), (k))
#define SPLAT16(x) splat16_avx2(x)
#define FOLD16(v) fold16_avx2(v)
/* attention on native 8-float vectors */
#define VA_T __m256
#define VA_LANES 8
#define VA_MAX_CHUNKS 32
#define VA_V_STRIP 2
#define LOADA(row, t, i) load8_avx2(row, t, i)
#define FMAA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SPLATA(x) _mm256_set1_ps(x)
#define HSUMA(v) hsum8_avx2(v)
#define HSUM4A(a, b, c, d, out) hsum4x8_avx2(a, b, c, d, out)
#define CODES16A(row, bits, c, out) codes16x2_avx2(row, bits, c, out)
#define MAXA(a, b) _mm256_max_ps(a, b)
#define HMAXA(v) hmax8_avx2(v)
#define EXPA(x) exp8_avx2(x)
#define ATT_EXPA(x) exp8_att_avx2(x)
#define ANYGTA(a, b) (_mm256_movemask_ps(_mm256_cmp_ps((a), (b), _CMP_GT_OQ)) != 0)
#define VALUE_SZ16(sz, nb, centre, vs, vz) value_sz16_avx2(sz, nb, centre, vs, vz)
#include "cpu_kernels_isa.h" /* undefines ISA and the primitives */
#pragma GCC pop_options

/* ------------------------------------------------------------------ baseline */
static inline __attribute__((always_inline)) vf load16_base(const void *row, uint32_t t, uint64_t i)
{
	vf v;
	for (int l = 0; l < 16; l++)
		v[l] = kvr_load_f32(row, t, i + (uint64_t)l);
	return v;
}

static inline __attribute__((always_inline)) vf fma16_base(vf a, vf b, vf c)
{
	vf r;
	for (int l = 0; l < 16; l++)
		r[l] = fmaf(a[l], b[l], c[l]);
	return r;
}

static inline __attribute__((always_inline)) float fold16_base(vf v)
{
	float lanes[16];
	memcpy(lanes, &v, sizeof(lanes));
	return kvr_fold_lanes(lanes, 16);
}

static inline __attribute__((always_inline)) float hsum16_base(vf v)
{
	float s = 0.0f;
	for (int l = 0; l < 16; l++)
		s += v[l];
	return s;
}
static inline __attribute__((always_inline)) vf max16_base(vf a, vf b)
{
	return blend(a > b, a, b);
}

static inline __attribute__((always_inline)) vf fold16x16_base(const vf *v)
{
	vf r;
	for (int p = 0; p < 16; p++)
		r[p] = fold16_base(v[p]);
	return r;
}
static inline __attribute__((always_inline)) vf codes16_base(const uint8_t *row, uint32_t bits, uint32_t c)
{
	uint8_t b[16];
	_mm_storeu_si128((__m128i *)b, codes_bytes16(row, bits, c));
	vf v;
	for (int l = 0; l < 16; l++)
		v[l] = (float)b[l];
	return v;
}
#define ISA base
#define CODES16(row, bits, c) codes16_base(row, bits, c)
#define F16TOF32(h) kvr_f16_to_f32(h)
#define LOAD16(row, t, i) load16_base(row, t, i)
#define MAX16(a, b) max16_base(a, b)
#define FOLD16X16(v) fold16x16_base(v)
#define QMASK_T unsigned char /* unused: the blend compares the query's bits */
#define QMASK_MAKE(q) 0
#define QMASK_GET(masks, i, q) ((void)(masks), (vi)(q) < 0)
#define QSELECT(k, a, b) blend((k), (a), (b))
#define FMA16(a, b, c) fma16_base(a, b, c)
#define HSUM16(v) hsum16_base(v)
#define SPLAT16(x) ((vf){ 0 } + (x)) /* lane-wise x + 0: fine here, -0 never reaches it */
#define FOLD16(v) fold16_base(v)
#define HSUM4(a, b, c, d, out) hsum4_generic(a, b, c, d, out, hsum16_base)
#define SCORE_PAGE_BLOCK 1u
#define SCORE_HEAD_BLOCK 4u
#define HMAX16(v) hmax16_generic(v)
#include "cpu_kernels_isa.h" /* undefines ISA and the primitives */

/* ------------------------------------------------------------------ page kernels */

struct page_job {
	const struct kvr_shape *shape;
	struct kvr_page_geometry g;
	const void *items;
};

static void scatter_task(void *arg, uint32_t i)
{
	const struct page_job *job = arg;
	const struct kvr_scatter_item *it = (const struct kvr_scatter_item *)job->items + i;
	kvr_hnd_run_to_nhd_slot(&job->g, it->run, it->k_tile, it->v_tile, it->kv_head);
}

static void offload_page(const struct kvr_page_geometry *g, const struct kvr_page_item *it)
{
	if (!it->format) {
		kvr_nhd_rows_to_hnd_page(g, it->k_rows, it->v_rows, it->row_stride, it->hnd_page);
		return;
	}
	struct kvr_quant_geometry q;
	if (g->head_dim > KVR_QUANT_MAX_DIM ||
	    kvr_quant_geometry_init(&q, g->page_tokens, g->head_dim, 1, it->format))
		return; /* not a quantised page this shape can hold: nothing written */
	float scratch[KVR_QUANT_MAX_DIM];
	for (uint32_t h = 0; h < g->n_kv_heads; h++)
		kvr_quant_run_from_nhd(&q, it->k_rows, it->v_rows, it->row_stride, g->elem_type, h,
				       g->page_tokens, (unsigned char *)it->hnd_page + h * q.head_bytes,
				       scratch);
}

/* The page's key bounds and, with KVR_SHAPE_ESTIMATES, its estimate rows
 * (summary.h), from the unquantised rows. */
static void summarize_page(const struct kvr_shape *shape, const struct kvr_page_geometry *g,
			   const struct kvr_page_item *it)
{
	const uint64_t eb = g->elem_bytes;
	unsigned char *out = it->summary;
	for (uint32_t h = 0; h < g->n_kv_heads; h++) {
		const uint64_t col = (uint64_t)h * g->head_dim * eb;
		kvr_summarize_keys(g, (const unsigned char *)it->k_rows + col, it->row_stride,
				   out + kvr_summary_index(g, h, KVR_SUMMARY_MIN, 0) * eb,
				   out + kvr_summary_index(g, h, KVR_SUMMARY_MAX, 0) * eb);
		if (shape->flags & KVR_SHAPE_ESTIMATES)
			kvr_summarize_means(g, (const unsigned char *)it->k_rows + col,
					    (const unsigned char *)it->v_rows + col, it->row_stride,
					    out + kvr_summary_index(g, h, KVR_SUMMARY_KEY_MEAN, 0) * eb,
					    out + kvr_summary_index(g, h, KVR_SUMMARY_VALUE_MEAN, 0) * eb);
	}
}

static void offload_task(void *arg, uint32_t i)
{
	const struct page_job *job = arg;
	offload_page(&job->g, (const struct kvr_page_item *)job->items + i);
}

static void summarize_task(void *arg, uint32_t i)
{
	const struct page_job *job = arg;
	summarize_page(job->shape, &job->g, (const struct kvr_page_item *)job->items + i);
}

/* The token's n_kv·d keys and values into its row of the tile; a page it
 * completes, offloaded and summarized from the tile (kernels.h, append). */
static void append_task(void *arg, uint32_t i)
{
	const struct page_job *job = arg;
	const struct kvr_append_item *it = (const struct kvr_append_item *)job->items + i;
	const struct kvr_page_geometry *g = &job->g;
	if (it->row >= g->page_tokens)
		return; /* as the CUDA kernel: nothing written */
	const uint64_t at = (uint64_t)it->row * it->row_stride * g->elem_bytes;
	const size_t row_bytes = (size_t)g->n_kv_heads * g->head_dim * g->elem_bytes;
	memcpy((unsigned char *)it->k_tile + at, it->k_row, row_bytes);
	memcpy((unsigned char *)it->v_tile + at, it->v_row, row_bytes);
	if (!it->hnd_page)
		return;
	const struct kvr_page_item page = kvr_append_page_item(it);
	offload_page(g, &page);
	if (page.summary)
		summarize_page(job->shape, g, &page);
}

static void run_page_job(struct kvr_dev *dev, const struct kvr_shape *shape, const void *items,
			 uint32_t n, kvr_task_fn task)
{
	struct page_job job = { shape, { 0 }, items };
	kvr_page_geometry_init(&job.g, shape->page_tokens, shape->head_dim, shape->n_kv_heads,
			       shape->elem_type);
	kvr_cpu_parallel_for(dev, task, &job, n);
}

void kvr_cpu_scatter(struct kvr_dev *dev, const struct kvr_shape *shape,
		     const struct kvr_scatter_item *items, uint32_t n)
{
	run_page_job(dev, shape, items, n, scatter_task);
}

void kvr_cpu_offload(struct kvr_dev *dev, const struct kvr_shape *shape,
		     const struct kvr_page_item *items, uint32_t n)
{
	run_page_job(dev, shape, items, n, offload_task);
}

void kvr_cpu_summarize(struct kvr_dev *dev, const struct kvr_shape *shape,
		       const struct kvr_page_item *items, uint32_t n)
{
	run_page_job(dev, shape, items, n, summarize_task);
}

void kvr_cpu_append(struct kvr_dev *dev, const struct kvr_shape *shape,
		    const struct kvr_append_item *items, uint32_t n)
{
	run_page_job(dev, shape, items, n, append_task);
}

static void plan_task(void *arg, uint32_t i)
{
	kvr_plan_item_run((const struct kvr_plan_item *)arg + i);
}

void kvr_cpu_plan(struct kvr_dev *dev, const struct kvr_shape *shape,
		  const struct kvr_plan_item *items, uint32_t n)
{
	(void)shape;
	/* a few dozen items of a few dozen segments: not worth the workers */
	for (uint32_t i = 0; i < n; i++)
		plan_task((void *)(uintptr_t)items, i);
	(void)dev;
}

/* ------------------------------------------------------------------ per-head jobs */

struct head_job {
	const struct kvr_shape *shape;
	const void *items;
	const struct kvr_kv_segment *segments;
	uint32_t n_segments;
	enum kvr_convert_isa isa;
	uint32_t parts; /* attention: tasks per (item, KV head); see kvr_cpu_attention */
	/* attention split over tokens (kvr_cpu_attention): parts > 1 and
	 * part_rows set; a part's rows at part_rows + ((item·n_kv + m)·parts +
	 * part)·G·(d + 1), parts_done[item·n_kv + m] counts its finished parts */
	float *part_rows;
	_Atomic uint32_t *parts_done;
};

/* The two phases of a score launch (cpu_kernels_isa.h, "score"): A over
 * (item, run of pages) tasks, B over (item, KV head) tasks. raw holds every
 * item's raw scores, item i's rows from raw_at[i]; a_first[i] is item i's
 * first phase-A task (a_first[n] their number), run_pages the pages of a run
 * (a multiple of 16). */
struct score_job {
	const struct kvr_shape *shape;
	const struct kvr_score_item *items;
	enum kvr_convert_isa isa;
	float *raw;
	const uint64_t *raw_at;
	const uint32_t *a_first;
	uint32_t run_pages;
};

/* 1 when phase A and B skip the item: nothing to score. */
static int score_skips(const struct kvr_shape *sh, const struct kvr_score_item *it)
{
	return it->cand_end <= it->cand_begin || kvr_score_gated_off(it, sh->n_kv_heads);
}

static void score_pages_task(void *arg, uint32_t index)
{
	const struct score_job *job = arg;
	const struct kvr_shape *sh = job->shape;
	uint32_t i = 0;
	while (job->a_first[i + 1] <= index)
		i++;
	const struct kvr_score_item *it = job->items + i;
	uint32_t dom_begin, dom_end;
	kvr_score_domain(it, &dom_begin, &dom_end);
	const uint32_t j_begin = (index - job->a_first[i]) * job->run_pages;
	const uint32_t j_end = dom_end - dom_begin - j_begin < job->run_pages ? dom_end - dom_begin
									     : j_begin + job->run_pages;
	/* scratch: G x 16 parked accumulators (one KV head's group at a time),
	 * the queries as floats, their sign masks (at most a byte per element) */
	const size_t park_bytes = (size_t)(sh->n_qo_heads / sh->n_kv_heads) * 16 * sizeof(vf);
	const size_t q_bytes = ((size_t)sh->n_qo_heads * sh->head_dim * sizeof(float) + 63) & ~(size_t)63;
	const size_t m_bytes = ((size_t)sh->n_qo_heads * sh->head_dim + 63) & ~(size_t)63;
	unsigned char *tmp = aligned_alloc(64, park_bytes + q_bytes + m_bytes);
	float *raw = job->raw + job->raw_at[i];
	if (!tmp) { /* cannot score: rank the run's pages equal */
		const uint32_t n_pad = (dom_end - dom_begin + 15u) & ~15u;
		for (uint32_t h = 0; h < sh->n_qo_heads; h++)
			for (uint32_t j = j_begin; j < ((j_end + 15u) & ~15u); j++)
				raw[(uint64_t)h * n_pad + j] = j < j_end ? 0.0f : -INFINITY;
		return;
	}
	vf *park = (vf *)(void *)tmp;
	void *qbuf = tmp + park_bytes, *qm = tmp + park_bytes + q_bytes;
	switch (job->isa) {
	case KVR_CONVERT_AVX512_VNNI:
	case KVR_CONVERT_AVX512:
		score_pages_avx512(sh, it, j_begin, j_end, raw, park, qbuf, qm);
		break;
	case KVR_CONVERT_AVX2:
		score_pages_avx2(sh, it, j_begin, j_end, raw, park, qbuf, qm);
		break;
	default:
		score_pages_base(sh, it, j_begin, j_end, raw, park, qbuf, qm);
		break;
	}
	free(tmp);
}

static void score_finish_task(void *arg, uint32_t index)
{
	const struct score_job *job = arg;
	const struct kvr_shape *sh = job->shape;
	const uint32_t i = index / sh->n_kv_heads, m = index % sh->n_kv_heads;
	const struct kvr_score_item *it = job->items + i;
	if (score_skips(sh, it))
		return;
	float *raw = job->raw + job->raw_at[i];
	switch (job->isa) {
	case KVR_CONVERT_AVX512_VNNI:
	case KVR_CONVERT_AVX512:
		score_finish_avx512(sh, it, m, raw);
		break;
	case KVR_CONVERT_AVX2:
		score_finish_avx2(sh, it, m, raw);
		break;
	default:
		score_finish_base(sh, it, m, raw);
		break;
	}
}

/* Pages per phase-A task: about four tasks per thread, so that the threads
 * finish together, but no fewer than 64 pages, so that a task's prefetch
 * runs ahead of it for most of its pages. */
static uint32_t score_run_pages(uint32_t n_dom, uint32_t threads)
{
	const uint32_t tasks = 4 * (threads ? threads : 1);
	uint32_t run = (n_dom + tasks - 1) / tasks;
	run = (run + 15u) & ~15u;
	return run < 64 ? 64 : run;
}

void kvr_cpu_score(struct kvr_dev *dev, const struct kvr_shape *shape,
		   const struct kvr_score_item *items, uint32_t n)
{
	if (!n)
		return;
	uint64_t *raw_at = malloc((size_t)n * sizeof(*raw_at) + (size_t)(n + 1) * sizeof(uint32_t));
	if (!raw_at)
		goto unscored;
	uint32_t *a_first = (uint32_t *)(void *)(raw_at + n);
	/* one run length for the launch, from its longest domain */
	uint32_t longest = 0;
	for (uint32_t i = 0; i < n; i++) {
		uint32_t b, e;
		kvr_score_domain(&items[i], &b, &e);
		if (!score_skips(shape, &items[i]) && e - b > longest)
			longest = e - b;
	}
	const uint32_t run = score_run_pages(longest, kvr_cpu_threads(dev));
	uint64_t floats = 0;
	a_first[0] = 0;
	for (uint32_t i = 0; i < n; i++) {
		uint32_t b, e;
		kvr_score_domain(&items[i], &b, &e);
		const uint32_t n_dom = score_skips(shape, &items[i]) ? 0 : e - b;
		raw_at[i] = floats;
		floats += (uint64_t)shape->n_qo_heads * ((n_dom + 15u) & ~15u);
		a_first[i + 1] = a_first[i] + (n_dom + run - 1) / run;
	}
	float *raw = aligned_alloc(64, ((floats ? floats : 1) * sizeof(float) + 63) & ~(size_t)63);
	if (!raw) {
		free(raw_at);
		goto unscored;
	}
	struct score_job job = { shape, items, kvr_convert_isa_active(), raw, raw_at, a_first, run };
	kvr_cpu_parallel_for(dev, score_pages_task, &job, a_first[n]);
	kvr_cpu_parallel_for(dev, score_finish_task, &job, n * shape->n_kv_heads);
	free(raw);
	free(raw_at);
	return;
unscored: /* out of memory: rank every candidate equal (the lowest pages win) */
	for (uint32_t i = 0; i < n; i++) {
		const struct kvr_score_item *it = &items[i];
		if (score_skips(shape, it))
			continue;
		const uint64_t cells = (uint64_t)shape->n_kv_heads * (it->cand_end - it->cand_begin);
		for (uint64_t c = 0; c < cells; c++)
			it->scores[c] = 0.0f;
	}
}

/* Order-preserving map of a float's bits (kernels.h, "select"). */
static inline uint32_t ordered_bits(float x)
{
	const uint32_t u = kvr_f32_to_bits(x);
	return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Bit l set where ordered_bits(scores[l]) < floor, l < 16 (SSE2: the
 * ordered bits with the top bit flipped compare as signed integers). */
static inline uint32_t below_mask16(const float *scores, uint32_t floor)
{
	const __m128i f = _mm_set1_epi32((int32_t)(floor ^ 0x80000000u));
	uint32_t mask = 0;
	for (int v = 0; v < 4; v++) {
		const __m128i u = _mm_castps_si128(_mm_loadu_ps(scores + 4 * v));
		/* negative: u ^ 0x7fffffff (= ~u with the top bit flipped); else u */
		const __m128i sgn = _mm_srli_epi32(_mm_srai_epi32(u, 31), 1);
		const __m128i key = _mm_xor_si128(u, sgn);
		mask |= (uint32_t)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(f, key))) << (4 * v);
	}
	return mask;
}

static int cmp_u32(const void *a, const void *b)
{
	const uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
	return x < y ? -1 : x > y;
}

static int cmp_u64_desc(const void *a, const void *b)
{
	const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x > y ? -1 : x < y;
}

/*
 * Reorder the n unique keys of a so that a[0..k) are the k largest (in no
 * particular order): quickselect with a median-of-three pivot and a
 * branch-free partition (which side a key falls on is a coin toss, so a
 * branch would mispredict every other key). After 64 rounds, which only
 * contrived inputs reach, what is left is sorted instead.
 */
static void largest_first(uint64_t *a, uint32_t n, uint32_t k)
{
	uint32_t lo = 0, hi = n;
	for (int round = 0; lo < k && k < hi; round++) {
		if (hi - lo <= 16 || round == 64) {
			qsort(a + lo, hi - lo, sizeof(*a), cmp_u64_desc);
			return;
		}
		const uint64_t x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi - 1];
		const uint64_t mn = x < y ? x : y, mx = x < y ? y : x;
		const uint64_t pivot = z < mn ? mn : (z > mx ? mx : z);
		uint32_t w = lo; /* [lo, w): keys above the pivot */
		for (uint32_t i = lo; i < hi; i++) {
			const uint64_t v = a[i], u = a[w];
			const int above = v > pivot;
			a[i] = above ? u : v;
			a[w] = above ? v : u;
			w += (uint32_t)above;
		}
		if (w >= k) {
			hi = w;
		} else { /* [lo, w) are all in; the pivot, the largest of the rest, next */
			uint32_t at = w;
			while (a[at] != pivot)
				at++;
			a[at] = a[w];
			a[w] = pivot;
			lo = w + 1;
		}
	}
}

/*
 * The `take` largest of n scores, ties to the lower index (kernels.h,
 * "select"), written ascending to idx. Each candidate's key is its ordered
 * score above its inverted index, so keys are unique and the take largest
 * keys are the answer.
 *
 * A first pass bounds the answer from below: split the scores into `take`
 * interleaved columns (candidate j in column j % take) and take each column's
 * largest; those are take distinct candidates, so the take-th largest score
 * is at least the smallest of them. The pass is take running maxima over
 * rows, which vectorises, and interleaving keeps the bound tight both for
 * scores in no order and for scores rising page after page (each column's
 * largest is then in the last row).
 *
 * The second pass keeps only the keys at or above the bound in buf (cap >
 * take entries); when buf fills, a quickselect raises the threshold to its
 * take-th largest key and drops the rest. It goes 16 candidates at a time:
 * one vector compare finds those whose score reaches the threshold's, and only
 * they are looked at; with the bound they are few.
 */
static void top_scores(const float *scores, uint32_t n, uint32_t take, uint64_t *buf, uint32_t cap,
		       uint32_t *idx)
{
	uint64_t threshold = 0; /* every key is above it: its low half is 0xffffffff - j > 0 */
	if (take && n >= 2 * take) {
		/* the column maxima, in buf's first take words as 32-bit lanes */
		uint32_t *col = (uint32_t *)(void *)buf;
		for (uint32_t c = 0; c < take; c++)
			col[c] = ordered_bits(scores[c]);
		for (uint32_t r = take; r + take <= n; r += take)
			for (uint32_t c = 0; c < take; c++) {
				const uint32_t v = ordered_bits(scores[r + c]);
				col[c] = v > col[c] ? v : col[c];
			}
		uint32_t bound = col[0];
		for (uint32_t c = 1; c < take; c++)
			bound = col[c] < bound ? col[c] : bound;
		/* keys with ordered score >= bound are above (bound << 32) - 1 */
		threshold = bound ? ((uint64_t)bound << 32) - 1 : 0;
	}
	uint32_t held = 0;
	for (uint32_t j0 = 0; j0 < n; j0 += 16) {
		const uint32_t j_end = n - j0 < 16 ? n : j0 + 16;
		uint32_t mask = 0xffffu;
		if (j_end - j0 == 16) { /* the candidates whose score reaches the threshold's */
			const uint32_t floor = (uint32_t)(threshold >> 32);
			mask = ~below_mask16(scores + j0, floor) & 0xffffu;
		}
		for (; mask; mask &= mask - 1) {
			const uint32_t j = j0 + (uint32_t)__builtin_ctz(mask);
			if (j >= j_end)
				break;
			const uint64_t key = (uint64_t)ordered_bits(scores[j]) << 32 | (0xffffffffu - j);
			if (key > threshold) {
				buf[held++] = key;
				if (held == cap) {
					largest_first(buf, held, take);
					held = take;
					threshold = buf[0];
					for (uint32_t i = 1; i < take; i++)
						threshold = buf[i] < threshold ? buf[i] : threshold;
				}
			}
		}
	}
	largest_first(buf, held, take);
	if (take > 64) {
		for (uint32_t i = 0; i < take; i++)
			idx[i] = 0xffffffffu - (uint32_t)buf[i];
		qsort(idx, take, sizeof(*idx), cmp_u32);
		return;
	}
	for (uint32_t i = 0; i < take; i++) { /* ascending: an insertion sort beats qsort's calls */
		const uint32_t v = 0xffffffffu - (uint32_t)buf[i];
		uint32_t at = i;
		for (; at > 0 && idx[at - 1] > v; at--)
			idx[at] = idx[at - 1];
		idx[at] = v;
	}
}

static void select_task(void *arg, uint32_t index)
{
	const struct head_job *job = arg;
	const struct kvr_shape *sh = job->shape;
	const struct kvr_score_item *it = (const struct kvr_score_item *)job->items + index / sh->n_kv_heads;
	const uint32_t m = index % sh->n_kv_heads;
	if (!it->k || kvr_score_gated_off(it, sh->n_kv_heads))
		return;
	const uint32_t n_cand = it->cand_end > it->cand_begin ? it->cand_end - it->cand_begin : 0;
	const uint32_t take = it->k < n_cand ? it->k : n_cand;
	int32_t *out = it->selected + (uint64_t)m * it->k;
	const float *scores = it->scores + (uint64_t)m * n_cand;
	uint32_t w = 0;
	if (take == n_cand) {
		for (uint32_t j = 0; j < n_cand; j++)
			out[w++] = (int32_t)(it->cand_begin + j);
	} else {
		const uint32_t cap = 4 * take + 64;
		uint64_t *buf = malloc((size_t)cap * sizeof(*buf) + (size_t)take * sizeof(uint32_t));
		if (buf) {
			uint32_t *idx = (uint32_t *)(void *)(buf + cap);
			top_scores(scores, n_cand, take, buf, cap, idx);
			for (uint32_t i = 0; i < take; i++)
				out[w++] = (int32_t)(it->cand_begin + idx[i]);
			free(buf);
		} else { /* out of memory: the most recent candidates, a sane fallback */
			for (uint32_t j = n_cand - take; j < n_cand; j++)
				out[w++] = (int32_t)(it->cand_begin + j);
		}
	}
	for (; w < it->k; w++)
		out[w] = -1;
}

void kvr_cpu_select(struct kvr_dev *dev, const struct kvr_shape *shape,
		    const struct kvr_score_item *items, uint32_t n)
{
	struct head_job job = { shape, items, NULL, 0, kvr_convert_isa_active(), 1, NULL, NULL };
	kvr_cpu_parallel_for(dev, select_task, &job, n * shape->n_kv_heads);
}

/* Query elements (query heads x d) up to which a launch of one item runs on
 * the calling thread (Llama-3.1-8B's 32 x 128 is 4,096). */
#define SIMILARITY_INLINE_ELEMS 16384u

/* The cosine of each query head with its previous query, mean over the group.
 * The rows are converted in bulk first (kvr_convert_to_f32: the vector path,
 * bit-identical to kvr_load_f32) and the lanes then run down the columns,
 * dimension c into lane c % KVR_DOT_LANES in ascending c, the canonical order
 * (kmath.h) the other backends sum in; converting element by element cost
 * more than the sums. */
static void similarity_task(void *arg, uint32_t index)
{
	const struct head_job *job = arg;
	const struct kvr_shape *sh = job->shape;
	const struct kvr_similarity_item *it =
		(const struct kvr_similarity_item *)job->items + index / sh->n_kv_heads;
	const uint32_t m = index % sh->n_kv_heads, G = sh->n_qo_heads / sh->n_kv_heads, d = sh->head_dim;
	const uint64_t eb = kvr_elem_bytes(sh->elem_type);
	float a[256] __attribute__((aligned(64))), b[256] __attribute__((aligned(64)));
	float mean = 0.0f;
	for (uint32_t g = 0; g < G; g++) {
		const uint64_t base = (uint64_t)(m * G + g) * d;
		kvr_convert_to_f32(a, (const unsigned char *)it->q + base * eb, sh->elem_type, d);
		kvr_convert_to_f32(b, (const unsigned char *)it->q_prev + base * eb, sh->elem_type, d);
		float dot[KVR_DOT_LANES] = { 0 }, na[KVR_DOT_LANES] = { 0 }, nb[KVR_DOT_LANES] = { 0 };
		for (uint32_t c = 0; c < d; c += KVR_DOT_LANES)
			for (uint32_t l = 0; l < KVR_DOT_LANES; l++) {
				dot[l] = dot[l] + a[c + l] * b[c + l];
				na[l] = na[l] + a[c + l] * a[c + l];
				nb[l] = nb[l] + b[c + l] * b[c + l];
			}
		const float sd = kvr_fold_lanes(dot, KVR_DOT_LANES);
		const float sa = kvr_fold_lanes(na, KVR_DOT_LANES), sb = kvr_fold_lanes(nb, KVR_DOT_LANES);
		const float cosine = (sa == 0.0f || sb == 0.0f) ? 0.0f : sd / sqrtf(sa * sb);
		mean = mean + cosine;
	}
	mean = mean * (1.0f / (float)G);
	it->cosine[m] = mean;
	it->corrected[m] = !(mean >= sh->tau);
}

void kvr_cpu_similarity(struct kvr_dev *dev, const struct kvr_shape *shape,
			const struct kvr_similarity_item *items, uint32_t n)
{
	struct head_job job = { shape, items, NULL, 0, kvr_convert_isa_active(), 1, NULL, NULL };
	const uint32_t tasks = n * shape->n_kv_heads;
	/* One item is a few thousand multiply-adds: handing them to a worker
	 * (waking it, when it has gone to sleep, costs the caller a system call)
	 * took longer than doing them (a decode step at batch 1: 10.8 -> 8.1 µs
	 * per layer), so it runs on the caller. */
	if (n == 1 && (uint64_t)shape->n_qo_heads * shape->head_dim <= SIMILARITY_INLINE_ELEMS) {
		for (uint32_t i = 0; i < tasks; i++)
			similarity_task(&job, i);
		return;
	}
	kvr_cpu_parallel_for(dev, similarity_task, &job, tasks);
}

/* 1: quantised keys are read with float dots (no query rounding), the
 * comparison KVR_QUANT_DOTS=float asks for; 0: integer dots (the default);
 * -1: not read yet. Relaxed: a self-contained value, written once at first
 * use (racing first calls write the same) or by kvr_cpu_quant_dots_force. */
static _Atomic int quant_float_dots = -1;

int kvr_cpu_quant_float_dots(void)
{
	int v = atomic_load_explicit(&quant_float_dots, memory_order_relaxed);
	if (v < 0) {
		const char *env = getenv("KVR_QUANT_DOTS");
		v = env && !strcmp(env, "float");
		atomic_store_explicit(&quant_float_dots, v, memory_order_relaxed);
	}
	return v;
}

void kvr_cpu_quant_dots_force(int float_dots)
{
	atomic_store_explicit(&quant_float_dots, float_dots ? 1 : 0, memory_order_relaxed);
}

static void attention_head(enum kvr_convert_isa isa, const struct kvr_shape *sh, const void *q,
			   void *out, const struct kvr_kv_segment *segs, uint32_t n_segs, uint32_t m,
			   float *lse)
{
	const int float_dots = kvr_cpu_quant_float_dots();
	switch (isa) {
	case KVR_CONVERT_AVX512_VNNI:
		attention_head_avx512(sh, q, out, segs, n_segs, m, lse, float_dots ? NULL : qk_dots_avx512vnni,
				      float_dots ? NULL : pv_dots_avx512vnni);
		break;
	case KVR_CONVERT_AVX512:
		/* Quantised pages without VNNI take the AVX2 kernels: their byte
		 * sums of 2-bit values and key logits on 8 tokens a vector beat
		 * this path's own 512-bit float values and scalar logits (its
		 * attention over K4V2 1.32–1.41× faster that way, K8V4
		 * 1.13–1.20×: docs/history.md), so for quantised pages this
		 * path computes what AVX2's does. Plain pages keep the wider
		 * loads. */
		if (!float_dots && segments_quantised(segs, n_segs))
			attention_head_avx2(sh, q, out, segs, n_segs, m, lse, qk_dots_avx2, pv_dots_avx2);
		else
			attention_head_avx512(sh, q, out, segs, n_segs, m, lse, NULL, NULL);
		break;
	case KVR_CONVERT_AVX2:
		attention_head_avx2(sh, q, out, segs, n_segs, m, lse, float_dots ? NULL : qk_dots_avx2,
				    float_dots ? NULL : pv_dots_avx2);
		break;
	default:
		attention_head_base(sh, q, out, segs, n_segs, m, lse, float_dots ? NULL : qk_dots_base, NULL);
		break;
	}
}

/*
 * Tokens per part of a split item: a part boundary falls only at a multiple
 * of it, counted over the item's segments, so a page (p divides it) is never
 * cut and a part of a long plain segment keeps the segment's 16-token blocks.
 * An item of T tokens is cut into parts of kvr_attention_part_size(T) tokens:
 * a function of T alone, so that the result depends on neither the thread
 * count nor the batch, and at most KVR_ATTENTION_MAX_PARTS of them. Smaller
 * parts cost more than they balance on few cores: each part starts on a page
 * nobody prefetched and prepares its queries again (SmolLM2's dense step at
 * 8K on one core: 654 µs unsplit, 637 with parts of 1,024, 781 of 512 and
 * 896 of 256; on two cores parts of 2,048 were the fastest).
 */
#define KVR_ATTENTION_PART_TOKENS 2048u
#define KVR_ATTENTION_MAX_PARTS 256u

static uint64_t kvr_attention_part_size(uint64_t tokens)
{
	const uint64_t unit = KVR_ATTENTION_PART_TOKENS;
	const uint64_t per = (tokens + KVR_ATTENTION_MAX_PARTS - 1) / KVR_ATTENTION_MAX_PARTS;
	return per <= unit ? unit : (per + unit - 1) / unit * unit;
}

static uint64_t attention_item_tokens(const struct kvr_kv_segment *segs, uint32_t n)
{
	uint64_t total = 0;
	for (uint32_t i = 0; i < n; i++)
		total += segs[i].n_tokens;
	return total;
}

/* Segments [*first, *first + *count) of an item's n that part `part`
 * attends: those that start inside its token range. A single plain segment
 * is cut inside instead, into *one. Returns the segment list to use. */
static const struct kvr_kv_segment *attention_part_segments(const struct kvr_kv_segment *segs, uint32_t n,
							    uint32_t part, uint32_t *count,
							    struct kvr_kv_segment *one, uint64_t eb)
{
	const uint64_t total = attention_item_tokens(segs, n), size = kvr_attention_part_size(total);
	const uint64_t lo = (uint64_t)part * size, hi = lo + size;
	*count = 0;
	if (n == 1 && !kvr_segment_quantised(segs[0].format)) {
		if (lo >= total)
			return segs;
		*one = segs[0];
		one->n_tokens = (uint32_t)((hi < total ? hi : total) - lo);
		const uint64_t skip = lo * segs[0].row_stride * eb;
		one->k = (const unsigned char *)segs[0].k + skip;
		one->v = (const unsigned char *)segs[0].v + skip;
		*count = 1;
		return one;
	}
	uint64_t at = 0;
	uint32_t first = n;
	for (uint32_t i = 0; i < n; i++) {
		if (at >= lo && at < hi) {
			if (first == n)
				first = i;
			++*count;
		}
		at += segs[i].n_tokens;
	}
	return segs + (first == n ? 0 : first);
}

/* The parts of (item, KV head m) into its out rows: each head's rows
 * weighted by exp(lse − max lse), in part order, so the sum does not depend
 * on which thread finished last. No weight anywhere (no tokens): zeros; a
 * NaN part: NaN, as an unsplit item would give. */
static void attention_merge(const struct kvr_shape *sh, const float *rows, uint32_t parts, uint32_t m, void *out)
{
	const uint32_t G = sh->n_qo_heads / sh->n_kv_heads, d = sh->head_dim;
	const uint64_t stride = (uint64_t)G * (d + 1u); /* one part's rows */
	for (uint32_t g = 0; g < G; g++) {
		float top = -INFINITY, acc[256], w_sum = 0.0f;
		int nan = 0;
		for (uint32_t i = 0; i < parts; i++) {
			const float l = rows[i * stride + (uint64_t)g * (d + 1u) + d];
			nan |= l != l;
			top = l > top ? l : top;
		}
		for (uint32_t c = 0; c < d; c++)
			acc[c] = nan ? NAN : 0.0f;
		if (!nan) {
			for (uint32_t i = 0; i < parts; i++) {
				const float *r = rows + i * stride + (uint64_t)g * (d + 1u);
				if (r[d] == -INFINITY) {
					/* no weight: its row is zeros, or NaN where a
					 * weight of 0 met an infinite value, which an
					 * unsplit item would give too */
					for (uint32_t c = 0; c < d; c++)
						if (r[c] != r[c])
							acc[c] = NAN;
					continue;
				}
				const float w = kvr_expf(r[d] - top);
				w_sum += w;
				for (uint32_t c = 0; c < d; c++)
					acc[c] += w * r[c];
			}
			const float inv = w_sum > 0.0f ? 1.0f / w_sum : 0.0f;
			for (uint32_t c = 0; c < d; c++)
				acc[c] *= inv;
		}
		kvr_convert_from_f32((unsigned char *)out + (uint64_t)(m * G + g) * d * kvr_elem_bytes(sh->elem_type), acc,
				     sh->elem_type, d);
	}
}

static void attention_task(void *arg, uint32_t index)
{
	const struct head_job *job = arg;
	const struct kvr_shape *sh = job->shape;
	const uint32_t item = index / job->parts / sh->n_kv_heads;
	const struct kvr_attention_item *it = (const struct kvr_attention_item *)job->items + item;
	const uint32_t m = index / job->parts % sh->n_kv_heads;
	/* a causal item's first position: its block's (kernels.h); a part of a
	 * causal item (n_kv_heads 1): its query tokens t0..t1 − 1 as an item of
	 * their own, positions shifted */
	struct kvr_shape part = *sh;
	if (sh->flags & KVR_SHAPE_CAUSAL)
		part.causal_first_position = kvr_causal_item_position(sh, item);
	const void *q = it->q;
	void *out = it->out;
	float *lse = sh->flags & KVR_SHAPE_SEGMENT_LSE ? it->segment_lse : NULL;
	const int token_parts = job->part_rows != NULL;
	float *part_out = NULL;
	if (token_parts) {
		part.flags |= KVR_CPU_SHAPE_PART;
		const uint32_t G = sh->n_qo_heads / sh->n_kv_heads;
		part_out = job->part_rows + (uint64_t)index * G * (sh->head_dim + 1u);
		out = part_out;
	} else if (job->parts > 1) {
		const uint32_t hq = sh->causal_heads_per_query, n_tok = sh->n_qo_heads / hq;
		const uint32_t per = (n_tok + job->parts - 1) / job->parts, t0 = index % job->parts * per;
		const uint32_t t1 = t0 + per < n_tok ? t0 + per : n_tok;
		if (t0 >= t1)
			return;
		const uint64_t skip = (uint64_t)t0 * hq * sh->head_dim * kvr_elem_bytes(sh->elem_type);
		part.n_qo_heads = (t1 - t0) * hq;
		part.causal_first_position += t0;
		q = (const unsigned char *)q + skip;
		out = (unsigned char *)out + skip;
		if (lse) /* [head][segment]: the part's heads */
			lse += (uint64_t)t0 * hq * it->n_segments;
	}
	/* Items are device memory, written by work queued before this kernel, so
	 * their ranges can only be checked now. A bad range poisons the item's
	 * outputs (NaN) rather than reading outside the segment list, and so does
	 * a segment of an unknown format or a quantised one longer than its run. */
	int bad = (uint64_t)it->first_segment + it->n_segments > job->n_segments;
	for (uint32_t i = 0; !bad && i < it->n_segments; i++) {
		const struct kvr_kv_segment *sg = &job->segments[it->first_segment + i];
		bad = kvr_segment_quantised(sg->format) && (uint64_t)sg->first_row + sg->n_tokens >
					    kvr_kv_segment_rows(sg->format, sh->page_tokens);
	}
	if (bad) {
		const uint32_t G = part.n_qo_heads / part.n_kv_heads;
		float nan_row[257];
		for (uint32_t c = 0; c <= sh->head_dim; c++)
			nan_row[c] = NAN;
		for (uint32_t g = 0; g < G; g++) {
			if (token_parts) /* the row and its lse: the merge makes the output NaN */
				memcpy(part_out + (uint64_t)g * (sh->head_dim + 1u), nan_row,
				       (sh->head_dim + 1u) * sizeof(float));
			else
				kvr_convert_from_f32((unsigned char *)out + (uint64_t)(m * G + g) * sh->head_dim *
										kvr_elem_bytes(sh->elem_type),
						     nan_row, sh->elem_type, sh->head_dim);
			for (uint32_t si = 0; (sh->flags & KVR_SHAPE_SEGMENT_LSE) && it->segment_lse &&
					      si < it->n_segments; si++)
				lse[(uint64_t)(m * G + g) * it->n_segments + si] = NAN;
		}
	} else if (token_parts) {
		struct kvr_kv_segment one;
		uint32_t count;
		const struct kvr_kv_segment *segs =
			attention_part_segments(job->segments + it->first_segment, it->n_segments, index % job->parts,
						&count, &one, kvr_elem_bytes(sh->elem_type));
		attention_head(job->isa, &part, q, out, segs, count, m, NULL);
	} else {
		attention_head(job->isa, &part, q, out, job->segments + it->first_segment, it->n_segments, m, lse);
		return;
	}
	if (!token_parts)
		return;
	/* The last part of (item, m) to finish merges them: acq_rel pairs each
	 * part's release of its rows with the merger's acquire. */
	const uint32_t head = index / job->parts;
	if (atomic_fetch_add_explicit(&job->parts_done[head], 1, memory_order_acq_rel) + 1 == job->parts)
		attention_merge(sh, job->part_rows + (uint64_t)head * job->parts * (sh->n_qo_heads / sh->n_kv_heads) *
							      (sh->head_dim + 1u),
				job->parts, m, it->out);
}

/* Items per call of a split attention: as many as their part rows fit in
 * this, and at least one (whose rows may take more). */
#define KVR_ATTENTION_PART_BYTES (4u << 20)

void kvr_cpu_attention(struct kvr_dev *dev, const struct kvr_shape *shape,
		       const struct kvr_attention_item *items, uint32_t n,
		       const struct kvr_kv_segment *segments, uint32_t n_segments)
{
	/* the part flag is this file's own: a caller's stray bit 31 must not
	 * make the kernel write f32 rows into its outputs */
	struct kvr_shape own = *shape;
	own.flags &= ~KVR_CPU_SHAPE_PART;
	shape = &own;
	struct head_job job = { shape, items, segments, n_segments, kvr_convert_isa_active(), 1, NULL, NULL };
	/* Causal query blocks (the scheduler's prefill: one KV head per item, as
	 * many items as the model has KV heads, SmolLM2 3): each item's query
	 * tokens in parts, about two tasks per thread, so the threads share the
	 * work evenly; a part rereads the pages, from the cache its siblings
	 * have just filled. A call of several blocks (causal_items_per_block)
	 * has tasks enough without parts. */
	if ((shape->flags & KVR_SHAPE_CAUSAL) && shape->n_kv_heads == 1) {
		const uint32_t n_tok = shape->n_qo_heads / shape->causal_heads_per_query;
		const uint32_t want = (2 * (kvr_cpu_threads(dev) + 1) + n - 1) / n;
		job.parts = want < n_tok ? want : n_tok;
		if (!job.parts)
			job.parts = 1;
	}
	/* Decode: an item's tokens in parts (kvr_attention_part_size), merged
	 * by their log-sum-exps — FlashDecoding's split — so that a batch of
	 * one keeps every thread busy, not one per KV head (SmolLM2's 3 KV heads
	 * on 2 threads: one thread did two heads, the other one; Llama's 8 on
	 * 16 cores: half of them idle). Tasks: the most parts any item has,
	 * the others' surplus parts empty. Items in runs whose part rows fit
	 * in KVR_ATTENTION_PART_BYTES; without the memory, unsplit. */
	uint32_t parts = 1;
	for (uint32_t i = 0; !(shape->flags & (KVR_SHAPE_CAUSAL | KVR_SHAPE_SEGMENT_LSE)) && i < n; i++) {
		if ((uint64_t)items[i].first_segment + items[i].n_segments > n_segments)
			continue; /* its tasks poison it */
		const uint64_t t = attention_item_tokens(segments + items[i].first_segment, items[i].n_segments);
		const uint64_t k = (t + kvr_attention_part_size(t) - 1) / kvr_attention_part_size(t);
		parts = k > parts ? (uint32_t)k : parts;
	}
	if (parts > 1) {
		const uint64_t G = shape->n_qo_heads / shape->n_kv_heads;
		const uint64_t item_bytes = (uint64_t)shape->n_kv_heads * parts * G * (shape->head_dim + 1u) * sizeof(float);
		const uint32_t run = item_bytes >= KVR_ATTENTION_PART_BYTES ? 1u
				     : (uint32_t)(KVR_ATTENTION_PART_BYTES / item_bytes) < n
					     ? (uint32_t)(KVR_ATTENTION_PART_BYTES / item_bytes)
					     : n;
		float *rows = malloc((size_t)(item_bytes * run));
		_Atomic uint32_t *done = calloc((size_t)run * shape->n_kv_heads, sizeof(*done));
		if (rows && done) {
			job.parts = parts;
			job.part_rows = rows;
			job.parts_done = done;
			for (uint32_t i0 = 0; i0 < n; i0 += run) {
				const uint32_t k = n - i0 < run ? n - i0 : run;
				job.items = items + i0;
				for (uint32_t h = 0; h < k * shape->n_kv_heads; h++)
					atomic_store_explicit(&done[h], 0, memory_order_relaxed);
				kvr_cpu_parallel_for(dev, attention_task, &job, k * shape->n_kv_heads * parts);
			}
			free(rows);
			free(done);
			return;
		}
		free(rows);
		free(done);
	}
	kvr_cpu_parallel_for(dev, attention_task, &job, n * shape->n_kv_heads * job.parts);
}

static void dense_task(void *arg, uint32_t index)
{
	const struct head_job *job = arg;
	const struct kvr_shape *sh = job->shape;
	const struct kvr_dense_item *it = (const struct kvr_dense_item *)job->items + index / sh->n_kv_heads;
	const struct kvr_kv_segment seg = { it->k, it->v, it->n_tokens, { it->row_stride }, sh->head_dim, 0 };
	attention_head(job->isa, sh, it->q, it->out, &seg, 1, index % sh->n_kv_heads, NULL);
}

void kvr_cpu_dense(struct kvr_dev *dev, const struct kvr_shape *shape,
		   const struct kvr_dense_item *items, uint32_t n)
{
	struct head_job job = { shape, items, NULL, 0, kvr_convert_isa_active(), 1, NULL, NULL };
	kvr_cpu_parallel_for(dev, dense_task, &job, n * shape->n_kv_heads);
}

/* ------------------------------------------------------------------ freelist */

/* Units per task of a round's slice copies: a task is a few µs of copying,
 * and a round with fewer units than one task runs on the caller alone. */
#define FREELIST_UNITS_PER_TASK 4096u

struct freelist_job {
	const struct kvr_freelist_item *it;
	struct kvr_freelist list; /* the counters as the round found them */
};

static void freelist_task(void *arg, uint32_t index)
{
	struct freelist_job *job = arg; /* tasks write disjoint ids; list's counters are read only */
	const struct kvr_freelist_item *it = job->it;
	const uint32_t first = index * FREELIST_UNITS_PER_TASK;
	const uint32_t last = it->n_units - first < FREELIST_UNITS_PER_TASK ? it->n_units
									     : first + FREELIST_UNITS_PER_TASK;
	struct kvr_freelist *l = &job->list;
	for (uint32_t u = first; u < last; u++) {
		const uint64_t off = it->offsets[u];
		if (it->op == KVR_FREELIST_ALLOC)
			kvr_freelist_take(l, off, it->counts[u], it->pages + off);
		else
			kvr_freelist_give(l, off, it->counts[u], it->pages + off);
	}
}

void kvr_cpu_freelist(struct kvr_dev *dev, const struct kvr_freelist_item *items, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++) {
		const struct kvr_freelist_item *it = &items[i];
		/* the scan is serial: one add per unit, faster than splitting it */
		const uint64_t total = kvr_freelist_scan(it->counts, it->n_units, it->offsets);
		struct freelist_job job = { it, { it->ids, it->capacity, 0, it->counters[0], it->counters[1] } };
		const int verdict = kvr_freelist_verdict(it->op, job.list.start, job.list.end, it->capacity,
							 total, it->pages_capacity);
		*it->status = verdict;
		if (verdict)
			continue;
		const uint32_t tasks = (it->n_units + FREELIST_UNITS_PER_TASK - 1) / FREELIST_UNITS_PER_TASK;
		if (tasks > 1)
			kvr_cpu_parallel_for(dev, freelist_task, &job, tasks);
		else
			freelist_task(&job, 0);
		it->counters[it->op == KVR_FREELIST_ALLOC ? 0 : 1] += total;
	}
}
