/* SPDX-License-Identifier: MIT */
/*
 * quant.c — ggml's element types for the real-model runner (quant.h): block
 * layouts, dequantisation, llama.cpp's activation quantisation and the
 * matrix-vector products, with the choice of instruction-set path.
 *
 * Sources checked (ggml-org/llama.cpp, via the code search, 2025 tree):
 *  - ggml/src/ggml-common.h: block_q4_0 {d; qs[16]}, block_q4_1 {d, m;
 *    qs[16]}, block_q5_0 {d; qh[4]; qs[16]}, block_q5_1 {d, m; qh[4];
 *    qs[16]}, block_q8_0 {d; qs[32]}, block_q8_1 {d, s = d·Σqs; qs[32]},
 *    block_q4_K {d, dmin; scales[12]; qs[128]}, block_q5_K {d, dmin;
 *    scales[12]; qh[32]; qs[128]}, block_q6_K {ql[128]; qh[64]; int8
 *    scales[16]; d} (d last), QK_K = 256; all f16 fields little-endian.
 *  - ggml/src/ggml-quants.c: dequantize_row_{q4_0,q4_1,q5_0,q5_1,q8_0,q4_K,
 *    q5_K,q6_K} (nibble j of qs is element j, its high nibble element j+16;
 *    Q5's fifth bit of element j is bit j of qh read as a little-endian
 *    uint32), get_scale_min_k4 (m of sub-block j >= 4 takes its top bits from
 *    scales[j], not scales[j-4]), quantize_row_q8_{0,1}_ref (x·(1/d), roundf).
 *  - ggml/src/ggml-cpu/arch/x86/quants.c: quantize_row_q8_0 / q8_1 under
 *    __AVX2__ (d = amax/127.f, id = 127.f/amax, _mm256_round_ps nearest even,
 *    s = f16(d · Σq)), which is what llama.cpp runs on the machines we compare
 *    against, and ggml_vec_dot_q4_1_q8_1 (d_w·d_x·Σq_w·q_x + m_w·s_x).
 *  - ggml/include/ggml.h: enum ggml_type ids (F32 0 ... BF16 30).
 *
 * The scalar functions here are the reference: the vector paths (AVX2,
 * AVX-512BW, AVX-512 VNNI, bodies in quant_isa.h) are tested to give their
 * bits exactly (tests/test_quant.c).
 *
 * Threads: all functions are pure over their arguments (any thread) but for
 * the path choice, an atomic read on every call and written by kq_isa_force.
 */
#include <errno.h>
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "../../layouts/half.h"
#include "../../layouts/kmath.h"
#include "quant.h"

#if !defined(__x86_64__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "quant.c reads GGUF blocks in place: x86-64 (little-endian) only"
#endif

/* f16 field at p (unaligned), widened exactly */
static inline float kq_h(const uint8_t *p)
{
	uint16_t h;
	memcpy(&h, p, sizeof(h));
	return kvr_f16_to_f32(h);
}

static inline void kq_put_h(uint8_t *p, float f)
{
	const uint16_t h = kvr_f32_to_f16(f);
	memcpy(p, &h, sizeof(h));
}

/* ------------------------------------------------------------ type table */

struct kq_traits {
	uint32_t elems, bytes;
	const char *name;
};

static const struct kq_traits *traits(uint32_t type)
{
	static const struct kq_traits t[] = {
		[KQ_TYPE_F32] = { 1, 4, "f32" },
		[KQ_TYPE_F16] = { 1, 2, "f16" },
		[KQ_TYPE_Q4_0] = { KQ_QK, KQ_Q4_0_BYTES, "q4_0" },
		[KQ_TYPE_Q4_1] = { KQ_QK, KQ_Q4_1_BYTES, "q4_1" },
		[KQ_TYPE_Q5_0] = { KQ_QK, KQ_Q5_0_BYTES, "q5_0" },
		[KQ_TYPE_Q5_1] = { KQ_QK, KQ_Q5_1_BYTES, "q5_1" },
		[KQ_TYPE_Q8_0] = { KQ_QK, KQ_Q8_0_BYTES, "q8_0" },
		[KQ_TYPE_Q8_1] = { KQ_QK, KQ_Q8_1_BYTES, "q8_1" },
		[KQ_TYPE_Q4_K] = { KQ_QK_K, KQ_Q4_K_BYTES, "q4_K" },
		[KQ_TYPE_Q5_K] = { KQ_QK_K, KQ_Q5_K_BYTES, "q5_K" },
		[KQ_TYPE_Q6_K] = { KQ_QK_K, KQ_Q6_K_BYTES, "q6_K" },
		[KQ_TYPE_Q8_K] = { KQ_QK_K, KQ_Q8_K_BYTES, "q8_K" },
		[KQ_TYPE_BF16] = { 1, 2, "bf16" },
	};
	if (type >= sizeof(t) / sizeof(t[0]) || !t[type].elems)
		return NULL;
	return &t[type];
}

uint32_t kq_block_elems(uint32_t type)
{
	const struct kq_traits *t = traits(type);
	return t ? t->elems : 0;
}

uint32_t kq_block_bytes(uint32_t type)
{
	const struct kq_traits *t = traits(type);
	return t ? t->bytes : 0;
}

const char *kq_type_name(uint32_t type)
{
	const struct kq_traits *t = traits(type);
	return t ? t->name : "?";
}

int kq_row_bytes(uint32_t type, uint64_t n, uint64_t *bytes)
{
	const struct kq_traits *t = traits(type);
	if (!t)
		return -ENOTSUP;
	if (n % t->elems || n / t->elems > UINT64_MAX / t->bytes)
		return -EINVAL;
	*bytes = n / t->elems * t->bytes;
	return 0;
}

/* ----------------------------------------------- scalar dequantisation */

/* Each function: nb blocks from src into dst (nb·block_elems floats). The
 * expressions are ggml's; the products in them are exact (quant.h). */

static void deq_q4_0(const uint8_t *s, float *y, uint64_t nb)
{
	for (uint64_t b = 0; b < nb; b++, s += KQ_Q4_0_BYTES, y += KQ_QK) {
		const float d = kq_h(s);
		for (int j = 0; j < 16; j++) {
			y[j] = (float)((s[2 + j] & 0x0f) - 8) * d;
			y[j + 16] = (float)((s[2 + j] >> 4) - 8) * d;
		}
	}
}

static void deq_q4_1(const uint8_t *s, float *y, uint64_t nb)
{
	for (uint64_t b = 0; b < nb; b++, s += KQ_Q4_1_BYTES, y += KQ_QK) {
		const float d = kq_h(s), m = kq_h(s + 2);
		for (int j = 0; j < 16; j++) {
			y[j] = (float)(s[4 + j] & 0x0f) * d + m;
			y[j + 16] = (float)(s[4 + j] >> 4) * d + m;
		}
	}
}

static inline uint32_t le32(const uint8_t *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void deq_q5_0(const uint8_t *s, float *y, uint64_t nb)
{
	for (uint64_t b = 0; b < nb; b++, s += KQ_Q5_0_BYTES, y += KQ_QK) {
		const float d = kq_h(s);
		const uint32_t qh = le32(s + 2);
		for (int j = 0; j < 16; j++) {
			const int lo = (s[6 + j] & 0x0f) | (int)((qh >> j) & 1u) << 4;
			const int hi = (s[6 + j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4;
			y[j] = (float)(lo - 16) * d;
			y[j + 16] = (float)(hi - 16) * d;
		}
	}
}

static void deq_q5_1(const uint8_t *s, float *y, uint64_t nb)
{
	for (uint64_t b = 0; b < nb; b++, s += KQ_Q5_1_BYTES, y += KQ_QK) {
		const float d = kq_h(s), m = kq_h(s + 2);
		const uint32_t qh = le32(s + 4);
		for (int j = 0; j < 16; j++) {
			const int lo = (s[8 + j] & 0x0f) | (int)((qh >> j) & 1u) << 4;
			const int hi = (s[8 + j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4;
			y[j] = (float)lo * d + m;
			y[j + 16] = (float)hi * d + m;
		}
	}
}

static void deq_q8_0(const uint8_t *s, float *y, uint64_t nb)
{
	for (uint64_t b = 0; b < nb; b++, s += KQ_Q8_0_BYTES, y += KQ_QK) {
		const float d = kq_h(s);
		for (int j = 0; j < 32; j++)
			y[j] = (float)(int8_t)s[2 + j] * d;
	}
}

static void deq_q8_1(const uint8_t *s, float *y, uint64_t nb)
{
	for (uint64_t b = 0; b < nb; b++, s += KQ_Q8_1_BYTES, y += KQ_QK) {
		const float d = kq_h(s); /* s (bytes 2-3) is only for the dot products */
		for (int j = 0; j < 32; j++)
			y[j] = (float)(int8_t)s[4 + j] * d;
	}
}

/* ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j (0..7)
 * packed in the 12 scale bytes of a Q4_K / Q5_K super-block. */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m)
{
	if (j < 4) {
		*sc = q[j] & 63;
		*m = q[j + 4] & 63;
	} else {
		*sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
		*m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
	}
}

static void deq_q4_k(const uint8_t *s, float *y, uint64_t nb)
{
	for (uint64_t b = 0; b < nb; b++, s += KQ_Q4_K_BYTES) {
		const float d = kq_h(s), dmin = kq_h(s + 2);
		const uint8_t *sc = s + 4, *q = s + 16;
		for (int g = 0; g < 4; g++, q += 32) { /* 64 elements: two sub-blocks */
			int s1, m1, s2, m2;
			scale_min_k4(2 * g, sc, &s1, &m1);
			scale_min_k4(2 * g + 1, sc, &s2, &m2);
			const float d1 = d * (float)s1, mm1 = dmin * (float)m1;
			const float d2 = d * (float)s2, mm2 = dmin * (float)m2;
			for (int l = 0; l < 32; l++)
				*y++ = d1 * (float)(q[l] & 0x0f) - mm1;
			for (int l = 0; l < 32; l++)
				*y++ = d2 * (float)(q[l] >> 4) - mm2;
		}
	}
}

static void deq_q5_k(const uint8_t *s, float *y, uint64_t nb)
{
	for (uint64_t b = 0; b < nb; b++, s += KQ_Q5_K_BYTES) {
		const float d = kq_h(s), dmin = kq_h(s + 2);
		const uint8_t *sc = s + 4, *qh = s + 16, *ql = s + 48;
		for (int g = 0; g < 4; g++, ql += 32) {
			int s1, m1, s2, m2;
			scale_min_k4(2 * g, sc, &s1, &m1);
			scale_min_k4(2 * g + 1, sc, &s2, &m2);
			const float d1 = d * (float)s1, mm1 = dmin * (float)m1;
			const float d2 = d * (float)s2, mm2 = dmin * (float)m2;
			const uint8_t u1 = (uint8_t)(1u << (2 * g)), u2 = (uint8_t)(2u << (2 * g));
			for (int l = 0; l < 32; l++)
				*y++ = d1 * (float)((ql[l] & 0x0f) + (qh[l] & u1 ? 16 : 0)) - mm1;
			for (int l = 0; l < 32; l++)
				*y++ = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - mm2;
		}
	}
}

static void deq_q6_k(const uint8_t *s, float *y, uint64_t nb)
{
	for (uint64_t b = 0; b < nb; b++, s += KQ_Q6_K_BYTES) {
		const uint8_t *ql = s, *qh = s + 128;
		const int8_t *sc = (const int8_t *)(s + 192);
		const float d = kq_h(s + 208);
		for (int half = 0; half < 2; half++, y += 128, ql += 64, qh += 32, sc += 8) {
			for (int l = 0; l < 32; l++) {
				const int is = l / 16;
				const int q1 = ((ql[l] & 0x0f) | ((qh[l] >> 0) & 3) << 4) - 32;
				const int q2 = ((ql[l + 32] & 0x0f) | ((qh[l] >> 2) & 3) << 4) - 32;
				const int q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
				const int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
				/* (d·sc)·q as ggml writes it: exact, 11+7+6 bits */
				y[l] = d * (float)sc[is] * (float)q1;
				y[l + 32] = d * (float)sc[is + 2] * (float)q2;
				y[l + 64] = d * (float)sc[is + 4] * (float)q3;
				y[l + 96] = d * (float)sc[is + 6] * (float)q4;
			}
		}
	}
}

static void deq_q8_k(const uint8_t *s, float *y, uint64_t nb)
{
	for (uint64_t b = 0; b < nb; b++, s += KQ_Q8_K_BYTES) {
		float d;
		memcpy(&d, s, sizeof(d));
		for (int j = 0; j < 256; j++)
			*y++ = d * (float)(int8_t)s[4 + j];
	}
}

static void deq_f16(const uint8_t *s, float *y, uint64_t n)
{
	for (uint64_t i = 0; i < n; i++)
		y[i] = kq_h(s + 2 * i);
}

static void deq_bf16(const uint8_t *s, float *y, uint64_t n)
{
	for (uint64_t i = 0; i < n; i++) {
		uint16_t h;
		memcpy(&h, s + 2 * i, sizeof(h));
		y[i] = kvr_bf16_to_f32(h);
	}
}

/* -------------------------------------------------- scalar block dots */

/* Exact integer dots of one block (the values fit int32 with room). */
static inline int32_t isum_q4_1(const uint8_t *w, const uint8_t *x)
{
	int32_t p = 0;
	for (int j = 0; j < 16; j++)
		p += (w[4 + j] & 0x0f) * (int8_t)x[4 + j] + (w[4 + j] >> 4) * (int8_t)x[4 + 16 + j];
	return p;
}

static inline int32_t isum_q8_0(const uint8_t *w, const uint8_t *x)
{
	int32_t p = 0;
	for (int j = 0; j < 32; j++)
		p += (int8_t)w[2 + j] * (int8_t)x[2 + j];
	return p;
}

/* quant.h's reference definitions, rows [r0, r1) of a Q4_1 or Q8_0 matrix,
 * continuing acc (16 lanes a row) over one chunk of nb blocks (chunks start
 * at multiples of 16). */
static void rows_scalar(uint32_t type, const uint8_t *w, uint64_t row_bytes, const uint8_t *x,
			uint64_t nb, float *acc, uint64_t r0, uint64_t r1)
{
	const bool q4_1 = type == KQ_TYPE_Q4_1;
	const uint32_t wbytes = q4_1 ? KQ_Q4_1_BYTES : KQ_Q8_0_BYTES;
	const uint32_t xbytes = q4_1 ? KQ_Q8_1_BYTES : KQ_Q8_0_BYTES;
	for (uint64_t r = r0; r < r1; r++) {
		const uint8_t *wr = w + r * row_bytes;
		float *a = acc + (r - r0) * 16;
		for (uint64_t b = 0; b < nb; b++) {
			const uint8_t *wb = wr + b * wbytes, *xb = x + b * xbytes;
			if (q4_1)
				a[b % 16] += fmaf(kq_h(wb) * kq_h(xb), (float)isum_q4_1(wb, xb),
						  kq_h(wb + 2) * kq_h(xb + 2));
			else
				a[b % 16] = fmaf(kq_h(wb) * kq_h(xb), (float)isum_q8_0(wb, xb), a[b % 16]);
		}
	}
}

/* ------------------------------------------------------- vector paths */

/*
 * The activation, prepared once per call (per chunk of KQ_ACT_CHUNK blocks)
 * since every row meets it: block scales widened to f32, and the quants laid
 * out to match how the vector paths unpack weights, so that the row loops
 * load them without shuffles: per group of 4 blocks (128 bytes), the first 16
 * quants of blocks 0-3, then their last 16 (a Q4_1 block's low nibbles are
 * its first 16 elements, its high nibbles the last 16; Q8_0 weights are
 * split the same way). Blocks past the end, up to a multiple of 16, are zero.
 */
#define KQ_ACT_CHUNK 256u
struct kq_act {
	_Alignas(64) int8_t q[KQ_ACT_CHUNK * KQ_QK];
	_Alignas(64) float d[KQ_ACT_CHUNK];
	_Alignas(64) float s[KQ_ACT_CHUNK];
};

/* ---------------------------------------------------------------- AVX2 */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

static inline float h_f16c(const uint8_t *p)
{
	uint16_t h;
	memcpy(&h, p, sizeof(h));
	return _cvtsh_ss(h); /* exact, the same value as kvr_f16_to_f32 */
}

/* Called on the vector paths only, so compiled with their F16C. */
static void act_prepare(uint32_t wtype, const uint8_t *x, uint64_t nb, struct kq_act *a)
{
	const uint64_t padded = (nb + 15) & ~(uint64_t)15;
	const uint32_t xbytes = wtype == KQ_TYPE_Q4_1 ? KQ_Q8_1_BYTES : KQ_Q8_0_BYTES;
	const uint32_t qoff = wtype == KQ_TYPE_Q4_1 ? 4 : 2;
	for (uint64_t b = 0; b < padded; b++) {
		int8_t *q = a->q + b / 4 * 128 + b % 4 * 16;
		if (b < nb) {
			const uint8_t *xb = x + b * xbytes;
			a->d[b] = h_f16c(xb);
			a->s[b] = wtype == KQ_TYPE_Q4_1 ? h_f16c(xb + 2) : 0.0f;
			memcpy(q, xb + qoff, 16);
			memcpy(q + 64, xb + qoff + 16, 16);
		} else {
			a->d[b] = a->s[b] = 0.0f;
			memset(q, 0, 16);
			memset(q + 64, 0, 16);
		}
	}
}

/* Two Q4_1 blocks (a at w, b at w + 20) against their prepared quants:
 * 8 int32, four partial sums of block a in the low 128 bits, of b in the
 * high. maddubs takes the unsigned nibbles first; a pair of products is at
 * most 2·15·128, and the low and high halves' sum at most 7680: no int16
 * saturation, whatever the activation. */
static inline __m256i pair_q4_1_avx2(const uint8_t *w, const int8_t *xl, const int8_t *xh)
{
	const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(w + 4))),
						  _mm_loadu_si128((const __m128i *)(w + KQ_Q4_1_BYTES + 4)), 1);
	const __m256i m = _mm256_set1_epi8(0x0f);
	const __m256i lo = _mm256_and_si256(q, m), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m);
	const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_load_si256((const __m256i *)xl)),
					     _mm256_maddubs_epi16(hi, _mm256_load_si256((const __m256i *)xh)));
	return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
}

/* One Q4_1 block's integer dot (the tail of a row). */
static inline int32_t one_q4_1_avx2(const uint8_t *w, const int8_t *xl, const int8_t *xh)
{
	const __m128i q = _mm_loadu_si128((const __m128i *)(w + 4)), m = _mm_set1_epi8(0x0f);
	const __m128i s16 = _mm_add_epi16(_mm_maddubs_epi16(_mm_and_si128(q, m), _mm_load_si128((const __m128i *)xl)),
					  _mm_maddubs_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), m),
							    _mm_load_si128((const __m128i *)xh)));
	__m128i s = _mm_madd_epi16(s16, _mm_set1_epi16(1));
	s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
	return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

/* Two Q8_0 blocks (a at w, b at w + 34) against their prepared quants, as
 * pair_q4_1_avx2: |w| (128 for -128, read unsigned) times x with w's sign;
 * the int16 pair sums stay below 2^15 as long as x != -128 (quant.h), so
 * each half goes through its own madd. */
static inline __m256i pair_q8_0_avx2(const uint8_t *w, const int8_t *xl, const int8_t *xh)
{
	const uint8_t *wb = w + KQ_Q8_0_BYTES;
	const __m256i one = _mm256_set1_epi16(1);
	const __m256i w1 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(w + 2))),
						   _mm_loadu_si128((const __m128i *)(wb + 2)), 1);
	const __m256i w2 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(w + 18))),
						   _mm_loadu_si128((const __m128i *)(wb + 18)), 1);
	const __m256i x1 = _mm256_load_si256((const __m256i *)xl), x2 = _mm256_load_si256((const __m256i *)xh);
	const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1)), one);
	const __m256i p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w2, w2), _mm256_sign_epi8(x2, w2)), one);
	return _mm256_add_epi32(p1, p2);
}

/* One Q8_0 block (the tail of a row), in 128-bit halves. */
static inline int32_t one_q8_0_avx2(const uint8_t *w, const int8_t *xl, const int8_t *xh)
{
	const __m128i one = _mm_set1_epi16(1);
	const __m128i w1 = _mm_loadu_si128((const __m128i *)(w + 2)), w2 = _mm_loadu_si128((const __m128i *)(w + 18));
	const __m128i x1 = _mm_load_si128((const __m128i *)xl), x2 = _mm_load_si128((const __m128i *)xh);
	__m128i s = _mm_add_epi32(_mm_madd_epi16(_mm_maddubs_epi16(_mm_sign_epi8(w1, w1), _mm_sign_epi8(x1, w1)), one),
				  _mm_madd_epi16(_mm_maddubs_epi16(_mm_sign_epi8(w2, w2), _mm_sign_epi8(x2, w2)), one));
	s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
	return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

/* The f16 d (low half) and m (high half) of 8 Q4_1 blocks, from 4 loads
 * holding two blocks' (d, m) dwords each (no gathers: they are slow on the
 * machines we run on). */
static inline void dm8_q4_1_avx2(const uint8_t *w, __m256 *d, __m256 *m)
{
	/* blocks 2k, 2k+1: dwords 0 and 5 of the load at 40k */
	const __m256i idx = _mm256_setr_epi32(0, 5, 0, 5, 0, 5, 0, 5);
	const __m256i t0 = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)w), idx);
	const __m256i t1 = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(w + 40)), idx);
	const __m256i t2 = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(w + 80)), idx);
	const __m256i t3 = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(w + 120)), idx);
	const __m256i dm = _mm256_blend_epi32(_mm256_blend_epi32(t0, t1, 0x0c), _mm256_blend_epi32(t2, t3, 0xc0), 0xf0);
	const __m256i lo = _mm256_blend_epi16(dm, _mm256_setzero_si256(), 0xaa);
	const __m256i pk = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, _mm256_srli_epi32(dm, 16)), 0xd8);
	*d = _mm256_cvtph_ps(_mm256_castsi256_si128(pk));
	*m = _mm256_cvtph_ps(_mm256_extracti128_si256(pk, 1));
}

/* kmath.h's canonical fold of 16 lanes: each step adds the upper half. */
static inline float fold16_avx2(const float *a)
{
	const __m256 h8 = _mm256_add_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(a + 8));
	const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
	const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
	return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
}

/* One row's 16 lanes at a, over the chunk's nb blocks of the row at wr
 * (the blocks in 8s, then one at a time); q4_1 a constant where it is
 * inlined, so each type gets its own loop. */
static inline __attribute__((always_inline)) void row_avx2(const bool q4_1, const uint8_t *wr,
							 const struct kq_act *xa, uint64_t nb, float *a)
{
	const uint32_t wbytes = q4_1 ? KQ_Q4_1_BYTES : KQ_Q8_0_BYTES;
	const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
	uint64_t b = 0;
	for (; b + 8 <= nb; b += 8) {
		const uint8_t *wb = wr + b * wbytes;
		const int8_t *xq = xa->q + b * KQ_QK; /* two groups of 4 */
		__m256i p[4];
		uint16_t dh[8]; /* Q8_0: the blocks' scales */
		_Pragma("GCC unroll 4")
		for (int k = 0; k < 4; k++) {
			const int8_t *x0 = xq + k / 2 * 128 + k % 2 * 32;
			if (q4_1) {
				p[k] = pair_q4_1_avx2(wb + 2 * k * KQ_Q4_1_BYTES, x0, x0 + 64);
			} else {
				p[k] = pair_q8_0_avx2(wb + 2 * k * KQ_Q8_0_BYTES, x0, x0 + 64);
				memcpy(&dh[2 * k], wb + 2 * k * KQ_Q8_0_BYTES, 2);
				memcpy(&dh[2 * k + 1], wb + (2 * k + 1) * KQ_Q8_0_BYTES, 2);
			}
		}
		/* per 128-bit half: the sums of blocks (0,2,4,6) | (1,3,5,7) */
		const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
		const __m256 pf = _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(s, perm));
		float *al = a + b % 16;
		if (q4_1) {
			__m256 dw, mw;
			dm8_q4_1_avx2(wb, &dw, &mw);
			const __m256 dd = _mm256_mul_ps(dw, _mm256_load_ps(xa->d + b));
			const __m256 ms = _mm256_mul_ps(mw, _mm256_load_ps(xa->s + b));
			_mm256_storeu_ps(al, _mm256_add_ps(_mm256_loadu_ps(al), _mm256_fmadd_ps(dd, pf, ms)));
		} else {
			const __m256 dd = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh)),
							_mm256_load_ps(xa->d + b));
			_mm256_storeu_ps(al, _mm256_fmadd_ps(dd, pf, _mm256_loadu_ps(al)));
		}
	}
	for (; b < nb; b++) {
		const uint8_t *wb = wr + b * wbytes;
		const int8_t *xq = xa->q + b / 4 * 128 + b % 4 * 16;
		if (q4_1)
			a[b % 16] += fmaf(h_f16c(wb) * xa->d[b], (float)one_q4_1_avx2(wb, xq, xq + 64),
					  h_f16c(wb + 2) * xa->s[b]);
		else
			a[b % 16] = fmaf(h_f16c(wb) * xa->d[b], (float)one_q8_0_avx2(wb, xq, xq + 64), a[b % 16]);
	}
}

/* The row functions' contract (matvec_int): rows [0, nrows) at w over the
 * chunk's nb blocks; row r's 16 lanes at acc + 16r start at +0 (first) or
 * continue, and are folded into y[r] at the end when y is not NULL (the
 * last chunk). */
#define ROWS_AVX2(name, q4_1)                                                                    \
	static void name(const uint8_t *w, uint64_t row_bytes, const struct kq_act *xa, uint64_t nb, \
			 float *acc, uint64_t nrows, bool first, float *y)                           \
	{                                                                                        \
		for (uint64_t r = 0; r < nrows; r++) {                                           \
			float *a = acc + r * 16;                                                 \
			if (first)                                                               \
				memset(a, 0, 16 * sizeof(float));                                \
			row_avx2(q4_1, w + r * row_bytes, xa, nb, a);                            \
			if (y)                                                                   \
				y[r] = fold16_avx2(a);                                           \
		}                                                                                \
	}
ROWS_AVX2(rows_q4_1_avx2, true)
ROWS_AVX2(rows_q8_0_avx2, false)
#undef ROWS_AVX2

/*
 * Many activation rows at once (kq_matmul): a row of weights is unpacked once
 * into the layout the activations were prepared in (per pair of blocks, the
 * 32 first-half quants of both blocks, then the 32 last-half ones; Q4_1's
 * nibbles split, Q8_0's bytes as they are) with its scales widened to f32,
 * and then meets every activation row of the call from L1. The per-token
 * work left is the integer dots, one horizontal sum per 8 blocks and the
 * block scaling; unpacking, scale conversion and the row's tail handling are
 * paid once per weight row instead of once per token. Blocks are padded to
 * a multiple of 8 with zero quants and zero scales, whose block values are
 * +0: every group takes the 8-wide route, and a lane, which can never be -0
 * (it starts at +0 and round-to-nearest sums are -0 only from two -0), is
 * unchanged by them. So the bits are kq_matvec's.
 */
#define KQ_MM_GROUP 8u /* blocks per horizontal sum */

/* Row wr's nb blocks, unpacked into wq (nbp/2 pairs of 64 bytes), dw and mw
 * (nbp floats); blocks nb..nbp zero. */
static void mm_unpack_row_avx2(bool q4_1, const uint8_t *wr, uint64_t nb, uint64_t nbp, uint8_t *wq,
			       float *dw, float *mw)
{
	const uint32_t wbytes = q4_1 ? KQ_Q4_1_BYTES : KQ_Q8_0_BYTES;
	const __m256i m = _mm256_set1_epi8(0x0f);
	for (uint64_t b = 0; b < nbp; b += 2) {
		__m128i a1 = _mm_setzero_si128(), a2 = a1, b1 = a1, b2 = a1;
		const uint8_t *wa = wr + b * wbytes, *wb = wa + wbytes;
		if (b < nb) {
			a1 = _mm_loadu_si128((const __m128i *)(wa + (q4_1 ? 4 : 2)));
			a2 = q4_1 ? a1 : _mm_loadu_si128((const __m128i *)(wa + 18));
		}
		if (b + 1 < nb) {
			b1 = _mm_loadu_si128((const __m128i *)(wb + (q4_1 ? 4 : 2)));
			b2 = q4_1 ? b1 : _mm_loadu_si128((const __m128i *)(wb + 18));
		}
		__m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(a1), b1, 1);
		__m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(a2), b2, 1);
		if (q4_1) {
			hi = _mm256_and_si256(_mm256_srli_epi16(lo, 4), m);
			lo = _mm256_and_si256(lo, m);
		}
		_mm256_store_si256((__m256i *)(wq + b * 32), lo);
		_mm256_store_si256((__m256i *)(wq + b * 32 + 32), hi);
		for (uint64_t k = b; k < b + 2; k++) {
			const uint8_t *wk = wr + k * wbytes;
			dw[k] = k < nb ? h_f16c(wk) : 0.0f;
			mw[k] = k < nb && q4_1 ? h_f16c(wk + 2) : 0.0f;
		}
	}
}

/* Activation row x (nb blocks of Q8_1 or Q8_0) into the kq_act layout over
 * nbp blocks: quants at q, scales at d, Q8_1 sums at s; padding zero. */
static void mm_prepare_act_avx2(bool q4_1, const uint8_t *x, uint64_t nb, uint64_t nbp, int8_t *q,
				float *d, float *s)
{
	const uint32_t xbytes = q4_1 ? KQ_Q8_1_BYTES : KQ_Q8_0_BYTES;
	const uint32_t qoff = q4_1 ? 4 : 2;
	for (uint64_t b = 0; b < nbp; b++) {
		int8_t *qb = q + b / 4 * 128 + b % 4 * 16;
		if (b < nb) {
			const uint8_t *xb = x + b * xbytes;
			d[b] = h_f16c(xb);
			s[b] = q4_1 ? h_f16c(xb + 2) : 0.0f;
			memcpy(qb, xb + qoff, 16);
			memcpy(qb + 64, xb + qoff + 16, 16);
		} else {
			d[b] = s[b] = 0.0f;
			memset(qb, 0, 16);
			memset(qb + 64, 0, 16);
		}
	}
}

/* The exact block dots of one group of 8 blocks for one activation row (xq:
 * the group's 256 prepared quants), in block order, as f32; only the first
 * np pairs are computed (the rest are padding, whose dots are 0). */
static inline __attribute__((always_inline)) __m256 mm_group_dots_avx2(bool q4_1, const uint8_t *wg,
									 const int8_t *xq, int np)
{
	const __m256i one = _mm256_set1_epi16(1);
	__m256i p[4];
	_Pragma("GCC unroll 4")
	for (int k = 0; k < 4; k++) {
		if (k >= np) {
			p[k] = _mm256_setzero_si256();
			continue;
		}
		const __m256i w1 = _mm256_load_si256((const __m256i *)(wg + 64 * k));
		const __m256i w2 = _mm256_load_si256((const __m256i *)(wg + 64 * k + 32));
		const int8_t *x0 = xq + k / 2 * 128 + k % 2 * 32;
		const __m256i x1 = _mm256_load_si256((const __m256i *)x0);
		const __m256i x2 = _mm256_load_si256((const __m256i *)(x0 + 64));
		if (q4_1)
			p[k] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w1, x1),
								  _mm256_maddubs_epi16(w2, x2)), one);
		else
			p[k] = _mm256_add_epi32(
				_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1)), one),
				_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w2, w2), _mm256_sign_epi8(x2, w2)), one));
	}
	const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
	const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
	return _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(s, perm));
}

/* One activation row's view in the workspace */
struct mm_xrow {
	const int8_t *q;
	const float *d, *s;
};

/* acc (8 lanes) += the block values of the group at block b, of np pairs */
static inline __attribute__((always_inline)) __m256 mm_group_avx2(bool q4_1, const uint8_t *wq, const float *dw,
								  const float *mw, uint64_t b, int np,
								  const struct mm_xrow *x, __m256 acc)
{
	const __m256 p = mm_group_dots_avx2(q4_1, wq + b * 32, x->q + b * 32, np);
	const __m256 dd = _mm256_mul_ps(_mm256_load_ps(dw + b), _mm256_load_ps(x->d + b));
	if (q4_1)
		return _mm256_add_ps(acc, _mm256_fmadd_ps(dd, p, _mm256_mul_ps(_mm256_load_ps(mw + b),
									       _mm256_load_ps(x->s + b))));
	return _mm256_fmadd_ps(dd, p, acc);
}

static inline float mm_fold_avx2(__m256 lo, __m256 hi)
{
	_Alignas(32) float l[16];
	_mm256_store_ps(l, lo);
	_mm256_store_ps(l + 8, hi);
	return fold16_avx2(l);
}

/* One unpacked weight row (nb blocks) against activation rows x0 (and x1
 * when two): the 16 lanes of each stay in two registers for the whole row
 * (groups alternate between the low and the high 8), then fold. */
static inline __attribute__((always_inline)) void mm_row_avx2(bool q4_1, bool two, const uint8_t *wq,
							      const float *dw, const float *mw, uint64_t nb,
							      const struct mm_xrow *x0, const struct mm_xrow *x1,
							      float *y0, float *y1)
{
	__m256 a0l = _mm256_setzero_ps(), a0h = a0l, a1l = a0l, a1h = a0l;
	uint64_t b = 0;
	for (; b + 2 * KQ_MM_GROUP <= nb; b += 2 * KQ_MM_GROUP) {
		a0l = mm_group_avx2(q4_1, wq, dw, mw, b, 4, x0, a0l);
		if (two)
			a1l = mm_group_avx2(q4_1, wq, dw, mw, b, 4, x1, a1l);
		a0h = mm_group_avx2(q4_1, wq, dw, mw, b + KQ_MM_GROUP, 4, x0, a0h);
		if (two)
			a1h = mm_group_avx2(q4_1, wq, dw, mw, b + KQ_MM_GROUP, 4, x1, a1h);
	}
	if (b < nb) { /* one group, maybe partial, in the low lanes */
		const int np = nb - b >= KQ_MM_GROUP ? 4 : (int)((nb - b + 1) / 2);
		a0l = mm_group_avx2(q4_1, wq, dw, mw, b, np, x0, a0l);
		if (two)
			a1l = mm_group_avx2(q4_1, wq, dw, mw, b, np, x1, a1l);
		b += KQ_MM_GROUP;
	}
	if (b < nb) { /* then a partial one in the high lanes */
		const int np = (int)((nb - b + 1) / 2);
		a0h = mm_group_avx2(q4_1, wq, dw, mw, b, np, x0, a0h);
		if (two)
			a1h = mm_group_avx2(q4_1, wq, dw, mw, b, np, x1, a1h);
	}
	*y0 = mm_fold_avx2(a0l, a0h);
	if (two)
		*y1 = mm_fold_avx2(a1l, a1h);
}

/* The workspace's parts (kq_matmul_workspace_bytes): the n prepared
 * activation rows, then the unpacked weights of one tile of rows. */
#define KQ_MM_ROWS 8u
struct mm_space {
	int8_t *xq;    /* n rows of nbp*32 quants */
	float *xd, *xs; /* n rows of nbp */
	uint8_t *wq;   /* KQ_MM_ROWS rows of nbp*32 */
	float *dw, *mw; /* KQ_MM_ROWS rows of nbp */
};

static inline __attribute__((always_inline)) void
mm_rows_avx2(bool q4_1, const uint8_t *w, uint64_t row_bytes, uint64_t nb, uint64_t nbp, const struct mm_space *sp,
	     uint32_t n, float *y, size_t y_stride, uint64_t r0, uint64_t r1)
{
	for (uint64_t t0 = r0; t0 < r1; t0 += KQ_MM_ROWS) {
		const uint64_t nr = r1 - t0 < KQ_MM_ROWS ? r1 - t0 : KQ_MM_ROWS;
		for (uint64_t r = 0; r < nr; r++)
			mm_unpack_row_avx2(q4_1, w + (t0 + r) * row_bytes, nb, nbp, sp->wq + r * nbp * 32,
					   sp->dw + r * nbp, sp->mw + r * nbp);
		for (uint32_t t = 0; t < n; t += 2) {
			const bool two = t + 1 < n;
			const struct mm_xrow x0 = { sp->xq + (size_t)t * nbp * 32, sp->xd + (size_t)t * nbp,
						    sp->xs + (size_t)t * nbp };
			const struct mm_xrow x1 = two ? (struct mm_xrow){ x0.q + nbp * 32, x0.d + nbp, x0.s + nbp } : x0;
			for (uint64_t r = 0; r < nr; r++) {
				const uint8_t *wq = sp->wq + r * nbp * 32;
				const float *dw = sp->dw + r * nbp, *mw = sp->mw + r * nbp;
				float *y0 = y + t * y_stride + t0 + r;
				if (two)
					mm_row_avx2(q4_1, true, wq, dw, mw, nb, &x0, &x1, y0, y0 + y_stride);
				else
					mm_row_avx2(q4_1, false, wq, dw, mw, nb, &x0, &x0, y0, NULL);
			}
		}
	}
}

static void matmul_avx2(uint32_t type, const uint8_t *w, uint64_t row_bytes, uint64_t nb, const uint8_t *x,
			size_t x_stride, uint32_t n, float *y, size_t y_stride, uint64_t r0, uint64_t r1,
			const struct mm_space *sp)
{
	const bool q4_1 = type == KQ_TYPE_Q4_1;
	const uint64_t nbp = (nb + KQ_MM_GROUP - 1) / KQ_MM_GROUP * KQ_MM_GROUP;
	for (uint32_t t = 0; t < n; t++)
		mm_prepare_act_avx2(q4_1, x + t * x_stride, nb, nbp, sp->xq + (size_t)t * nbp * 32,
				    sp->xd + (size_t)t * nbp, sp->xs + (size_t)t * nbp);
	if (q4_1)
		mm_rows_avx2(true, w, row_bytes, nb, nbp, sp, n, y, y_stride, r0, r1);
	else
		mm_rows_avx2(false, w, row_bytes, nb, nbp, sp, n, y, y_stride, r0, r1);
}

/* quantize_block_q8 (below) on 8 lanes, with the same result bits: the
 * maximum skips NaN the same way (max_ps returns its second operand when
 * either is NaN), round_ps is nearbyintf's nearest-even, and a NaN product
 * gives quant 0. */
static int32_t quantize_block_q8_avx2(const float *x, float *d_out, int8_t *q)
{
	const __m256 sign = _mm256_set1_ps(-0.0f);
	__m256 v[4], amax = _mm256_setzero_ps();
	for (int k = 0; k < 4; k++) {
		v[k] = _mm256_loadu_ps(x + 8 * k);
		amax = _mm256_max_ps(_mm256_andnot_ps(sign, v[k]), amax);
	}
	__m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
	m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
	m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
	const float am = _mm_cvtss_f32(m4);
	const float d = am / 127.0f;
	const __m256 id = _mm256_set1_ps(am != 0.0f ? 127.0f / am : 0.0f);
	__m256i qi[4];
	for (int k = 0; k < 4; k++) {
		__m256 r = _mm256_round_ps(_mm256_mul_ps(v[k], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
		const __m256 ordered = _mm256_cmp_ps(r, r, _CMP_ORD_Q);
		r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
		qi[k] = _mm256_and_si256(_mm256_cvtps_epi32(r), _mm256_castps_si256(ordered));
	}
	const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
	__m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
	s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
	s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
	/* packs work per 128-bit half: the dword order comes back with one permute */
	const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
	const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
	_mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
	*d_out = d;
	return _mm_cvtsi128_si32(s4);
}

static void dequant_q4_1_avx2(const uint8_t *s, float *y, uint64_t nb)
{
	for (uint64_t b = 0; b < nb; b++, s += KQ_Q4_1_BYTES, y += KQ_QK) {
		const __m256 d = _mm256_set1_ps(h_f16c(s)), m = _mm256_set1_ps(h_f16c(s + 2));
		const __m128i q = _mm_loadu_si128((const __m128i *)(s + 4));
		const __m256i q8 = _mm256_and_si256(
			_mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1),
			_mm256_set1_epi8(0x0f)); /* 32 bytes, element order */
		for (int k = 0; k < 4; k++) {
			const __m128i h = k < 2 ? _mm256_castsi256_si128(q8) : _mm256_extracti128_si256(q8, 1);
			const __m256i v = _mm256_cvtepu8_epi32(k & 1 ? _mm_srli_si128(h, 8) : h);
			/* q·d is exact, so the fused and the unfused forms agree */
			_mm256_storeu_ps(y + 8 * k, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), d, m));
		}
	}
}

static void dequant_q8_0_avx2(const uint8_t *s, float *y, uint64_t nb)
{
	for (uint64_t b = 0; b < nb; b++, s += KQ_Q8_0_BYTES, y += KQ_QK) {
		const __m256 d = _mm256_set1_ps(h_f16c(s));
		for (int k = 0; k < 4; k++) {
			const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(s + 2 + 8 * k)));
			_mm256_storeu_ps(y + 8 * k, _mm256_mul_ps(_mm256_cvtepi32_ps(v), d));
		}
	}
}
#pragma GCC pop_options

/* ------------------------------------------------------------ AVX-512 */
/* quant_isa.h twice: with maddubs/madd (AVX-512BW) and with vpdpbusd. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define ISA avx512bw
/* Σ of 4 adjacent u8·s8 products per int32 lane, plus acc: exact while
 * maddubs' int16 pair sums do not saturate, as for the operands it gets here
 * (Q8_0: |w| <= 128, |x| <= 127, at most 32512). */
#define DOT4(acc, u, s) \
	_mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)))
/* nibbles (<= 15) times int8: the two halves' int16 sums add up to at most
 * 2·2·15·128 = 7680, so they are added before the one madd */
#define DOT_LOHI(u1, s1, u2, s2)                                                              \
	_mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(u1, s1), _mm512_maddubs_epi16(u2, s2)), \
			  _mm512_set1_epi16(1))
#include "quant_isa.h"
#undef DOT_LOHI
#undef DOT4
#undef ISA
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#define ISA avx512vnni
#define DOT4(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define DOT_LOHI(u1, s1, u2, s2) _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u1, s1), u2, s2)
#include "quant_isa.h"
#undef DOT_LOHI
#undef DOT4
#undef ISA
#pragma GCC pop_options

/* ------------------------------------------------------- path choice */

static bool isa_cpu_has(enum kq_isa isa)
{
	__builtin_cpu_init(); /* idempotent; needed if called from a constructor */
	const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
			  __builtin_cpu_supports("f16c");
	const bool bw = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
			__builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
	switch (isa) {
	case KQ_ISA_SCALAR:
		return true;
	case KQ_ISA_AVX2:
		return avx2;
	case KQ_ISA_AVX512BW:
		return bw;
	case KQ_ISA_AVX512VNNI:
		return bw && __builtin_cpu_supports("avx512vnni");
	default:
		return false;
	}
}

int kq_isa_supported(enum kq_isa isa)
{
	return isa_cpu_has(isa);
}

const char *kq_isa_name(enum kq_isa isa)
{
	static const char *const names[KQ_ISA_COUNT] = { "scalar", "avx2", "avx512bw", "avx512vnni" };
	return (unsigned)isa < KQ_ISA_COUNT ? names[isa] : "?";
}

static enum kq_isa isa_best(void)
{
	for (int i = KQ_ISA_COUNT - 1; i > 0; i--)
		if (isa_cpu_has((enum kq_isa)i))
			return (enum kq_isa)i;
	return KQ_ISA_SCALAR;
}

/* KQ_ISA from the environment when it names a supported path; else the best. */
static enum kq_isa isa_initial(void)
{
	const char *e = getenv("KQ_ISA");
	if (e) {
		if (!strcmp(e, "avx512")) {
			if (isa_cpu_has(KQ_ISA_AVX512VNNI))
				return KQ_ISA_AVX512VNNI;
			if (isa_cpu_has(KQ_ISA_AVX512BW))
				return KQ_ISA_AVX512BW;
		}
		for (int i = 0; i < KQ_ISA_COUNT; i++)
			if (!strcmp(e, kq_isa_name((enum kq_isa)i)) && isa_cpu_has((enum kq_isa)i))
				return (enum kq_isa)i;
	}
	return isa_best();
}

/* -1 until first use; racing first uses compute the same value. */
static _Atomic int isa_choice = -1;

enum kq_isa kq_isa_active(void)
{
	int v = atomic_load_explicit(&isa_choice, memory_order_relaxed);
	if (v < 0) {
		v = (int)isa_initial();
		atomic_store_explicit(&isa_choice, v, memory_order_relaxed);
	}
	return (enum kq_isa)v;
}

int kq_isa_force(enum kq_isa isa)
{
	if ((unsigned)isa >= KQ_ISA_COUNT || !isa_cpu_has(isa))
		return -ENOTSUP;
	atomic_store_explicit(&isa_choice, (int)isa, memory_order_relaxed);
	return 0;
}

/* ------------------------------------------------------ dequantisation */

/* nb blocks (elements for f32/f16/bf16) from s into y */
typedef void dequant_fn(const uint8_t *s, float *y, uint64_t nb);

static void deq_f32(const uint8_t *s, float *y, uint64_t n)
{
	memcpy(y, s, n * sizeof(float));
}

/* The active path's dequantiser: SIMD for the two weight types the model
 * runner dequantises in bulk (Q4_1, Q8_0), the scalar reference otherwise. */
static dequant_fn *dequantizer(uint32_t type)
{
	static dequant_fn *const simd[][KQ_ISA_COUNT] = {
		{ NULL, dequant_q4_1_avx2, dequant_q4_1_avx512bw, dequant_q4_1_avx512vnni },
		{ NULL, dequant_q8_0_avx2, dequant_q8_0_avx512bw, dequant_q8_0_avx512vnni },
	};
	static dequant_fn *const scalar[] = {
		[KQ_TYPE_F32] = deq_f32,   [KQ_TYPE_F16] = deq_f16,   [KQ_TYPE_BF16] = deq_bf16,
		[KQ_TYPE_Q4_0] = deq_q4_0, [KQ_TYPE_Q4_1] = deq_q4_1, [KQ_TYPE_Q5_0] = deq_q5_0,
		[KQ_TYPE_Q5_1] = deq_q5_1, [KQ_TYPE_Q8_0] = deq_q8_0, [KQ_TYPE_Q8_1] = deq_q8_1,
		[KQ_TYPE_Q4_K] = deq_q4_k, [KQ_TYPE_Q5_K] = deq_q5_k, [KQ_TYPE_Q6_K] = deq_q6_k,
		[KQ_TYPE_Q8_K] = deq_q8_k,
	};
	dequant_fn *fast = NULL;
	if (type == KQ_TYPE_Q4_1 || type == KQ_TYPE_Q8_0)
		fast = simd[type == KQ_TYPE_Q8_0][kq_isa_active()];
	if (fast)
		return fast;
	return type < sizeof(scalar) / sizeof(scalar[0]) ? scalar[type] : NULL;
}

int kq_dequantize_row(uint32_t type, const void *src, float *dst, uint64_t n)
{
	uint64_t bytes;
	const int rc = kq_row_bytes(type, n, &bytes);
	if (rc)
		return rc;
	if (!n)
		return 0;
	if (!src || !dst)
		return -EINVAL;
	dequant_fn *const fn = dequantizer(type);
	if (!fn)
		return -ENOTSUP;
	fn(src, dst, n / kq_block_elems(type));
	return 0;
}

/* ---------------------------------------------- activation quantisation */

/* One block of 32: the scale d and the quants; returns Σq. x86 llama.cpp:
 * d = amax/127 (the f32 value, used for s too), q = round-half-even(x·id)
 * with id = 127/amax. Quants are clamped to ±127 and NaN products give 0, so
 * that non-finite input stays defined behaviour (llama.cpp's are garbage). */
static int32_t quantize_block_q8(const float *x, float *d_out, int8_t *q)
{
	float amax = 0.0f;
	for (int j = 0; j < 32; j++) {
		const float a = fabsf(x[j]);
		amax = a > amax ? a : amax;
	}
	const float d = amax / 127.0f;
	const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
	int32_t sum = 0;
	for (int j = 0; j < 32; j++) {
		float v = nearbyintf(x[j] * id); /* default mode: nearest, ties to even */
		v = v > 127.0f ? 127.0f : v;
		v = v < -127.0f ? -127.0f : v;
		q[j] = v == v ? (int8_t)v : 0;
		sum += q[j];
	}
	*d_out = d;
	return sum;
}

/* The active path's block quantiser (the vector paths share AVX2's) */
typedef int32_t quantize_block_fn(const float *x, float *d_out, int8_t *q);
static quantize_block_fn *block_quantiser(void)
{
	return kq_isa_active() == KQ_ISA_SCALAR ? quantize_block_q8 : quantize_block_q8_avx2;
}

int kq_quantize_row_q8_0(const float *x, void *dst, uint64_t n)
{
	if (n % KQ_QK || (n && (!x || !dst)))
		return -EINVAL;
	quantize_block_fn *const quantize_block = block_quantiser();
	uint8_t *o = dst;
	for (uint64_t b = 0; b < n / KQ_QK; b++, o += KQ_Q8_0_BYTES) {
		float d;
		quantize_block(x + b * KQ_QK, &d, (int8_t *)(o + 2));
		kq_put_h(o, d);
	}
	return 0;
}

int kq_quantize_row_q8_1(const float *x, void *dst, uint64_t n)
{
	if (n % KQ_QK || (n && (!x || !dst)))
		return -EINVAL;
	quantize_block_fn *const quantize_block = block_quantiser();
	uint8_t *o = dst;
	for (uint64_t b = 0; b < n / KQ_QK; b++, o += KQ_Q8_1_BYTES) {
		float d;
		const int32_t sum = quantize_block(x + b * KQ_QK, &d, (int8_t *)(o + 4));
		kq_put_h(o, d);
		kq_put_h(o + 2, d * (float)sum); /* |sum| <= 4064: exact in f32 */
	}
	return 0;
}

/* llama.cpp's nearest_int: round half to even through the float's mantissa
 * (|v| < 2^22; the caller's values are within ±127.5) */
static inline int nearest_int(float v)
{
	const float f = v + 12582912.0f;
	int32_t i;
	memcpy(&i, &f, sizeof(i));
	return (i & 0x007fffff) - 0x00400000;
}

int kq_quantize_row_q8_k(const float *x, void *dst, uint64_t n)
{
	if (n % KQ_QK_K || (n && (!x || !dst)))
		return -EINVAL;
	uint8_t *o = dst;
	for (uint64_t b = 0; b < n / KQ_QK_K; b++, o += KQ_Q8_K_BYTES, x += KQ_QK_K) {
		float amax = 0.0f, max = 0.0f;
		for (int j = 0; j < 256; j++) {
			const float a = fabsf(x[j]);
			if (a > amax) {
				amax = a;
				max = x[j];
			}
		}
		int8_t *q = (int8_t *)(o + 4);
		int16_t bsums[16];
		float d = 0.0f;
		if (amax > 0.0f && amax <= FLT_MAX) {
			const float iscale = -127.0f / max;
			for (int j = 0; j < 256; j++) {
				const float v = iscale * x[j];
				/* NaN and out-of-range products (a NaN in the block) give 0 */
				const int qi = v == v && fabsf(v) < 128.0f ? nearest_int(v) : 0;
				q[j] = (int8_t)(qi > 127 ? 127 : qi);
			}
			d = 1.0f / iscale;
		} else {
			memset(q, 0, 256);
		}
		for (int g = 0; g < 16; g++) {
			int s = 0;
			for (int j = 0; j < 16; j++)
				s += q[16 * g + j];
			bsums[g] = (int16_t)s;
		}
		memcpy(o, &d, sizeof(d));
		memcpy(o + 260, bsums, sizeof(bsums));
	}
	return 0;
}

/* ----------------------------------------------------- matrix-vector */

int kq_matvec_act_type(uint32_t type)
{
	if (!traits(type) || type == KQ_TYPE_Q8_1 || type == KQ_TYPE_Q8_K)
		return -ENOTSUP;
	if (type == KQ_TYPE_Q4_1)
		return KQ_TYPE_Q8_1;
	if (type == KQ_TYPE_Q8_0)
		return KQ_TYPE_Q8_0;
	if (type == KQ_TYPE_Q4_K || type == KQ_TYPE_Q5_K || type == KQ_TYPE_Q6_K)
		return KQ_TYPE_Q8_K;
	return KQ_TYPE_F32;
}

/*
 * K-quant super-blocks against a Q8_K activation block: the integer part of
 * each (exact in int32: |Σ| <= 256·63·63·128 < 2^31) and its float value.
 * The quants are unpacked into int8 rows first so that the dots are plain
 * loops the compiler vectorises.
 */
static inline int32_t dot32_u8_i8(const uint8_t *a, const int8_t *b)
{
	int32_t s = 0;
	for (int l = 0; l < 32; l++)
		s += (int32_t)a[l] * b[l];
	return s;
}

static inline int32_t dot16_i8_i8(const int8_t *a, const int8_t *b)
{
	int32_t s = 0;
	for (int l = 0; l < 16; l++)
		s += (int32_t)a[l] * b[l];
	return s;
}

static float block_q4_k_q8_k(const uint8_t *w, const uint8_t *x, bool five)
{
	const uint8_t *sc = w + 4, *qh = w + 16, *ql = w + (five ? 48 : 16);
	const int8_t *q8 = (const int8_t *)(x + 4);
	int16_t bsums[16];
	memcpy(bsums, x + 260, sizeof(bsums));
	uint8_t u[256];
	for (int g = 0; g < 4; g++, ql += 32)
		for (int l = 0; l < 32; l++) {
			u[64 * g + l] = ql[l] & 0x0f;
			u[64 * g + 32 + l] = ql[l] >> 4;
			if (five) {
				u[64 * g + l] += (qh[l] >> (2 * g) & 1) << 4;
				u[64 * g + 32 + l] += (qh[l] >> (2 * g + 1) & 1) << 4;
			}
		}
	int32_t isum = 0, msum = 0;
	for (int j = 0; j < 8; j++) {
		int s, m;
		scale_min_k4(j, sc, &s, &m);
		isum += s * dot32_u8_i8(u + 32 * j, q8 + 32 * j);
		msum += m * (bsums[2 * j] + bsums[2 * j + 1]);
	}
	float dx;
	memcpy(&dx, x, sizeof(dx));
	return kq_h(w) * dx * (float)isum - kq_h(w + 2) * dx * (float)msum;
}

static float block_q6_k_q8_k(const uint8_t *w, const uint8_t *x)
{
	const uint8_t *ql = w, *qh = w + 128;
	const int8_t *sc = (const int8_t *)(w + 192), *q8 = (const int8_t *)(x + 4);
	int8_t q[256];
	for (int half = 0; half < 2; half++, ql += 64, qh += 32) {
		int8_t *o = q + 128 * half;
		for (int l = 0; l < 32; l++) {
			o[l] = (int8_t)(((ql[l] & 0x0f) | ((qh[l] >> 0) & 3) << 4) - 32);
			o[l + 32] = (int8_t)(((ql[l + 32] & 0x0f) | ((qh[l] >> 2) & 3) << 4) - 32);
			o[l + 64] = (int8_t)(((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32);
			o[l + 96] = (int8_t)(((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32);
		}
	}
	int32_t isum = 0;
	for (int j = 0; j < 16; j++)
		isum += sc[j] * dot16_i8_i8(q + 16 * j, q8 + 16 * j);
	float dx;
	memcpy(&dx, x, sizeof(dx));
	return kq_h(w + 208) * dx * (float)isum;
}

/* The same super-block values on the vector paths (AVX2 serves the AVX-512
 * ones): the integer sums are exact either way, and the float expression is
 * the scalar one, so every path gives the same bits. maddubs takes the
 * unsigned quants first: a pair of products is at most 2·63·127 < 2^15. */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
static inline int32_t hsum_i32_avx2(__m256i v)
{
	__m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
	s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
	s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
	return _mm_cvtsi128_si32(s);
}

static float block_q4_k_q8_k_avx2(const uint8_t *w, const uint8_t *x, bool five)
{
	const uint8_t *sc = w + 4, *ql = w + (five ? 48 : 16);
	const int8_t *q8 = (const int8_t *)(x + 4);
	const __m256i m4 = _mm256_set1_epi8(0x0f), one8 = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
	const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
	int16_t bsums[16];
	memcpy(bsums, x + 260, sizeof(bsums));
	__m256i acc = _mm256_setzero_si256();
	int32_t msum = 0;
	for (int g = 0; g < 4; g++) {
		const __m256i q = _mm256_loadu_si256((const __m256i *)(ql + 32 * g));
		__m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
		if (five) { /* bit 2g (low half) and 2g+1 (high half) of qh add 16 */
			lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), one8), 4));
			hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g + 1), one8), 4));
		}
		int s1, m1, s2, m2;
		scale_min_k4(2 * g, sc, &s1, &m1);
		scale_min_k4(2 * g + 1, sc, &s2, &m2);
		const __m256i plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(q8 + 64 * g))), ones);
		const __m256i phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q8 + 64 * g + 32))), ones);
		acc = _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_mullo_epi32(plo, _mm256_set1_epi32(s1)),
							     _mm256_mullo_epi32(phi, _mm256_set1_epi32(s2))));
		msum += m1 * (bsums[4 * g] + bsums[4 * g + 1]) + m2 * (bsums[4 * g + 2] + bsums[4 * g + 3]);
	}
	const int32_t isum = hsum_i32_avx2(acc);
	float dx;
	memcpy(&dx, x, sizeof(dx));
	return kq_h(w) * dx * (float)isum - kq_h(w + 2) * dx * (float)msum;
}

static float block_q6_k_q8_k_avx2(const uint8_t *w, const uint8_t *x)
{
	const int8_t *sc = (const int8_t *)(w + 192), *q8 = (const int8_t *)(x + 4);
	const __m256i m4 = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(3);
	int16_t bsums[16];
	memcpy(bsums, x + 260, sizeof(bsums));
	__m256i acc = _mm256_setzero_si256();
	for (int half = 0; half < 2; half++) {
		const uint8_t *ql = w + 64 * half, *qh = w + 128 + 32 * half;
		const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
		const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
		/* the quants + 32, unsigned (0..63), of elements 32k.. of this half */
		const __m256i u[4] = {
			_mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4)),
			_mm256_or_si256(_mm256_and_si256(l1, m4),
					_mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4)),
			_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
					_mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4)),
			_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
					_mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4)),
		};
		for (int k = 0; k < 4; k++) {
			const int j = 8 * half + 2 * k; /* sub-blocks j, j+1 of 16 */
			const __m256i p = _mm256_maddubs_epi16(u[k], _mm256_loadu_si256((const __m256i *)(q8 + 128 * half + 32 * k)));
			const __m256i sv = _mm256_set_m128i(_mm_set1_epi16(sc[j + 1]), _mm_set1_epi16(sc[j]));
			acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, sv));
		}
	}
	int32_t offset = 0; /* the +32 taken back: 32·Σ sc_j·Σq8 over sub-block j */
	for (int j = 0; j < 16; j++)
		offset += sc[j] * bsums[j];
	const int32_t isum = hsum_i32_avx2(acc) - 32 * offset;
	float dx;
	memcpy(&dx, x, sizeof(dx));
	return kq_h(w + 208) * dx * (float)isum;
}
#pragma GCC pop_options

/* Rows [r0, r1) of a K-quant matrix: per row, super-block values summed in
 * increasing order into one f32. */
static void matvec_k(uint32_t type, const uint8_t *w, uint64_t row_bytes, uint64_t nb, const uint8_t *x,
		     float *y, uint64_t r0, uint64_t r1)
{
	const uint32_t wbytes = kq_block_bytes(type);
	const bool vec = kq_isa_active() != KQ_ISA_SCALAR, q6 = type == KQ_TYPE_Q6_K, five = type == KQ_TYPE_Q5_K;
	for (uint64_t r = r0; r < r1; r++) {
		const uint8_t *wr = w + r * row_bytes;
		float acc = 0.0f;
		for (uint64_t b = 0; b < nb; b++) {
			const uint8_t *wb = wr + b * wbytes, *xb = x + b * KQ_Q8_K_BYTES;
			if (vec)
				acc += q6 ? block_q6_k_q8_k_avx2(wb, xb) : block_q4_k_q8_k_avx2(wb, xb, five);
			else
				acc += q6 ? block_q6_k_q8_k(wb, xb) : block_q4_k_q8_k(wb, xb, five);
		}
		y[r] = acc;
	}
}

/* Rows [r0, r1) of a Q4_1 or Q8_0 matrix against its quantised activation.
 * Rows are taken in tiles whose 16-lane accumulators live on the stack; the
 * activation is prepared (vector paths) once per chunk of KQ_ACT_CHUNK
 * blocks, a multiple of 16, so block b keeps lane b mod 16 across chunks. */
#define KQ_ROW_TILE 64u
typedef void rows_fn(const uint8_t *w, uint64_t row_bytes, const struct kq_act *xa, uint64_t nb,
		     float *acc, uint64_t nrows, bool first, float *y);
static void matvec_int(uint32_t type, const uint8_t *w, uint64_t row_bytes, uint64_t nb,
		       const uint8_t *x, float *y, uint64_t r0, uint64_t r1)
{
	const enum kq_isa isa = kq_isa_active();
	/* the vector paths' row functions, [isa][type is Q8_0] */
	static rows_fn *const vector_rows[KQ_ISA_COUNT][2] = {
		[KQ_ISA_AVX2] = { rows_q4_1_avx2, rows_q8_0_avx2 },
		[KQ_ISA_AVX512BW] = { rows_q4_1_avx512bw, rows_q8_0_avx512bw },
		[KQ_ISA_AVX512VNNI] = { rows_q4_1_avx512vnni, rows_q8_0_avx512vnni },
	};
	rows_fn *const rows = vector_rows[isa][type == KQ_TYPE_Q8_0];
	const uint32_t wbytes = type == KQ_TYPE_Q4_1 ? KQ_Q4_1_BYTES : KQ_Q8_0_BYTES;
	const uint32_t xbytes = type == KQ_TYPE_Q4_1 ? KQ_Q8_1_BYTES : KQ_Q8_0_BYTES;
	float acc[KQ_ROW_TILE * 16];
	struct kq_act act; /* 10 KiB */
	const bool one_chunk = nb <= KQ_ACT_CHUNK;
	if (one_chunk && isa != KQ_ISA_SCALAR)
		act_prepare(type, x, nb, &act);
	for (uint64_t t0 = r0; t0 < r1; t0 += KQ_ROW_TILE) {
		const uint64_t n = r1 - t0 < KQ_ROW_TILE ? r1 - t0 : KQ_ROW_TILE;
		if (isa == KQ_ISA_SCALAR) {
			memset(acc, 0, n * 16 * sizeof(float)); /* +0 in every lane */
			for (uint64_t c0 = 0; c0 < nb; c0 += KQ_ACT_CHUNK) {
				const uint64_t cn = nb - c0 < KQ_ACT_CHUNK ? nb - c0 : KQ_ACT_CHUNK;
				const uint8_t *wt = w + t0 * row_bytes + c0 * wbytes;
				rows_scalar(type, wt, row_bytes, x + c0 * xbytes, cn, acc, 0, n);
			}
			for (uint64_t r = 0; r < n; r++)
				y[t0 + r] = kvr_fold_lanes(acc + r * 16, 16);
			continue;
		}
		for (uint64_t c0 = 0; c0 < nb; c0 += KQ_ACT_CHUNK) {
			const uint64_t cn = nb - c0 < KQ_ACT_CHUNK ? nb - c0 : KQ_ACT_CHUNK;
			const uint8_t *wt = w + t0 * row_bytes + c0 * wbytes; /* the tile's rows, this chunk */
			const bool first = c0 == 0;
			float *yt = c0 + cn == nb ? y + t0 : NULL; /* the last chunk folds into y */
			if (!one_chunk)
				act_prepare(type, x + c0 * xbytes, cn, &act);
			rows(wt, row_bytes, &act, cn, acc, n, first, yt);
		}
	}
}

/* Other types: dequantise a piece of the row, dot in double, j increasing. */
#define KQ_GENERIC_PIECE 256u
static void matvec_generic(uint32_t type, const uint8_t *w, uint64_t row_bytes, uint64_t cols,
			   const float *x, float *y, uint64_t r0, uint64_t r1)
{
	const struct kq_traits *t = traits(type);
	float buf[KQ_GENERIC_PIECE];
	for (uint64_t r = r0; r < r1; r++) {
		double s = 0.0;
		for (uint64_t c0 = 0; c0 < cols; c0 += KQ_GENERIC_PIECE) {
			const uint64_t n = cols - c0 < KQ_GENERIC_PIECE ? cols - c0 : KQ_GENERIC_PIECE;
			kq_dequantize_row(type, w + r * row_bytes + c0 / t->elems * t->bytes, buf, n);
			for (uint64_t j = 0; j < n; j++)
				s += (double)buf[j] * (double)x[c0 + j];
		}
		y[r] = (float)s;
	}
}

int kq_matvec(uint32_t type, const void *w, uint64_t row_bytes, uint64_t rows, uint64_t cols,
	      const void *x_q, const float *x_f32, float *y, uint64_t row_begin, uint64_t row_end)
{
	const int act = kq_matvec_act_type(type);
	if (act < 0)
		return act;
	uint64_t packed;
	const int rc = kq_row_bytes(type, cols, &packed);
	if (rc)
		return rc;
	if (row_begin > row_end || row_end > rows || row_bytes < packed)
		return -EINVAL;
	if (row_begin == row_end)
		return 0;
	if (!y)
		return -EINVAL;
	if (!cols) { /* an empty sum */
		for (uint64_t r = row_begin; r < row_end; r++)
			y[r] = 0.0f;
		return 0;
	}
	if (!w || (act == KQ_TYPE_F32 ? !x_f32 : !x_q) || rows - 1 > UINT64_MAX / row_bytes)
		return -EINVAL;
	if (act == KQ_TYPE_F32)
		matvec_generic(type, w, row_bytes, cols, x_f32, y, row_begin, row_end);
	else if (act == KQ_TYPE_Q8_K)
		matvec_k(type, w, row_bytes, cols / KQ_QK_K, x_q, y, row_begin, row_end);
	else
		matvec_int(type, w, row_bytes, cols / KQ_QK, x_q, y, row_begin, row_end);
	return 0;
}

/* ----------------------------------------------------- matrix-matrix */

/* Blocks of a row padded for the matmul path, and the workspace it needs. */
static uint64_t mm_padded_blocks(uint64_t cols)
{
	return (cols / KQ_QK + KQ_MM_GROUP - 1) / KQ_MM_GROUP * KQ_MM_GROUP;
}

size_t kq_matmul_workspace_bytes(uint32_t type, uint64_t cols, uint32_t n)
{
	if (type != KQ_TYPE_Q4_1 && type != KQ_TYPE_Q8_0)
		return 0;
	const uint64_t nbp = mm_padded_blocks(cols);
	/* quants, then two floats per block, per activation row and per tile row */
	return (size_t)(((uint64_t)n + KQ_MM_ROWS) * nbp * (32 + 2 * sizeof(float)) + 64);
}

int kq_matmul(uint32_t type, const void *w, uint64_t row_bytes, uint64_t rows, uint64_t cols,
	      const void *x_q, size_t x_q_stride, const float *x_f32, size_t x_f32_stride, uint32_t n,
	      float *y, size_t y_stride, uint64_t row_begin, uint64_t row_end, void *workspace,
	      size_t workspace_bytes)
{
	const int act = kq_matvec_act_type(type);
	if (act < 0)
		return act;
	const enum kq_isa isa = kq_isa_active();
	const bool fast = (type == KQ_TYPE_Q4_1 || type == KQ_TYPE_Q8_0) && isa != KQ_ISA_SCALAR && n > 1 &&
			  cols > 0;
	if (fast) {
		/* the same checks as kq_matvec's, before anything is written */
		uint64_t packed;
		const int rc = kq_row_bytes(type, cols, &packed);
		if (rc)
			return rc;
		if (row_begin > row_end || row_end > rows || row_bytes < packed || !w || !x_q || !y ||
		    rows - 1 > UINT64_MAX / row_bytes || y_stride < row_end)
			return -EINVAL;
		if (!workspace || workspace_bytes < kq_matmul_workspace_bytes(type, cols, n))
			return -EINVAL;
		if (row_begin == row_end)
			return 0;
		const uint64_t nbp = mm_padded_blocks(cols);
		uint8_t *base = (uint8_t *)(((uintptr_t)workspace + 63) & ~(uintptr_t)63);
		struct mm_space sp;
		sp.xq = (int8_t *)base;
		base += (size_t)n * nbp * 32;
		sp.wq = base;
		base += (size_t)KQ_MM_ROWS * nbp * 32;
		sp.xd = (float *)base;
		sp.xs = sp.xd + (size_t)n * nbp;
		sp.dw = sp.xs + (size_t)n * nbp;
		sp.mw = sp.dw + (size_t)KQ_MM_ROWS * nbp;
		matmul_avx2(type, w, row_bytes, cols / KQ_QK, x_q, x_q_stride, n, y, y_stride, row_begin, row_end,
			    &sp);
		return 0;
	}
	for (uint32_t t = 0; t < n; t++) {
		const int rc = kq_matvec(type, w, row_bytes, rows, cols,
					 x_q ? (const uint8_t *)x_q + t * x_q_stride : NULL,
					 x_f32 ? x_f32 + t * x_f32_stride : NULL, y + t * y_stride, row_begin,
					 row_end);
		if (rc)
			return rc;
	}
	return 0;
}
