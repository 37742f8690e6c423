/* SPDX-License-Identifier: MIT */
/*
 * test_quant.c — bench/model/quant.h: ggml's block layouts, dequantisation,
 * llama.cpp's activation quantisation and the matrix-vector products,
 * against transcriptions written here independently of quant.c.
 *
 *  - dequantisation: hand-built blocks with values worked out by hand (d = 0,
 *    negative m, nibble and 5/6-bit extremes, Q6_K's signed scales, Q4_K /
 *    Q5_K's packed 6-bit scales), then random blocks against an
 *    element-by-element transcription of ggml's formulas, on every path;
 *  - Q8_0 / Q8_1 quantisation against a transcription of llama.cpp's x86
 *    code, with exact ties (round half to even, not roundf's away from zero);
 *  - Q4_1·Q8_1 and Q8_0·Q8_0 products bit for bit against a transcription of
 *    quant.h's definition (16 lanes, fmaf per block, canonical fold) on every
 *    instruction-set path the CPU has, and within a derived bound of the
 *    exact (double) value; the other types bit for bit against a double dot
 *    of the transcribed dequantisation;
 *  - shapes: 1 to 130 rows (tiles of 4 rows and of 64), 32 to 1536 columns
 *    (partial 4- and 16-block groups), column counts past the activation
 *    chunk (256 blocks), padded rows, sub-ranges of rows (rows outside
 *    untouched), errors;
 *  - the real model's Q4_1 and Q8_0 tensors when the file is there.
 *
 * The speed of each path is bench/micro/quant_bench.c's to measure.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "half.h"
#include "quant.h"
#include "helpers.h"

/* xorshift64*: the same sequence everywhere for a seed */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng(void)
{
	return th_xorshift64star(&rng_state);
}

static float uniform(float lo, float hi)
{
	return lo + (hi - lo) * (float)(rng() >> 40) * 0x1p-24f;
}

static uint16_t h16(float f)
{
	return kvr_f32_to_f16(f);
}

static float f16at(const uint8_t *p)
{
	uint16_t h;
	memcpy(&h, p, 2);
	return kvr_f16_to_f32(h);
}

static void put16(uint8_t *p, uint16_t v)
{
	p[0] = (uint8_t)v;
	p[1] = (uint8_t)(v >> 8);
}

static int isa_list(enum kq_isa *out)
{
	int n = 0;
	for (int i = 0; i < KQ_ISA_COUNT; i++)
		if (kq_isa_supported((enum kq_isa)i))
			out[n++] = (enum kq_isa)i;
	return n;
}

static void *xmalloc(size_t n)
{
	void *p = malloc(n ? n : 1);
	cr_assert_not_null(p);
	return p;
}

/* ---------------------------------------------------- transcriptions */

struct tinfo {
	uint32_t type, elems, bytes;
};
static const struct tinfo all_types[] = {
	{ KQ_TYPE_F32, 1, 4 },	     { KQ_TYPE_F16, 1, 2 },	  { KQ_TYPE_BF16, 1, 2 },
	{ KQ_TYPE_Q4_0, 32, 18 },    { KQ_TYPE_Q4_1, 32, 20 },	  { KQ_TYPE_Q5_0, 32, 22 },
	{ KQ_TYPE_Q5_1, 32, 24 },    { KQ_TYPE_Q8_0, 32, 34 },	  { KQ_TYPE_Q8_1, 32, 36 },
	{ KQ_TYPE_Q4_K, 256, 144 },  { KQ_TYPE_Q5_K, 256, 176 }, { KQ_TYPE_Q6_K, 256, 210 },
};
#define N_TYPES (sizeof(all_types) / sizeof(all_types[0]))

/* ggml's get_scale_min_k4, from its description: scales 0-3 and mins 0-3 are
 * the low 6 bits of bytes 0-3 and 4-7; 4-7 take their low 4 bits from the
 * nibbles of bytes 8-11 and their top 2 bits from the top of bytes 0-3
 * (scales) and 4-7 (mins). */
static void k4_scale_min(const uint8_t *s, int j, int *sc, int *mn)
{
	if (j < 4) {
		*sc = s[j] & 63;
		*mn = s[4 + j] & 63;
	} else {
		*sc = (s[8 + j - 4] & 15) | (s[j - 4] >> 6) << 4;
		*mn = (s[8 + j - 4] >> 4) | (s[4 + j - 4] >> 6) << 4;
	}
}

/* Element i of the block at b, one element at a time. */
static float ref_elem(uint32_t type, const uint8_t *b, int i)
{
	switch (type) {
	case KQ_TYPE_F32: {
		float f;
		memcpy(&f, b, 4);
		return f;
	}
	case KQ_TYPE_F16:
		return f16at(b);
	case KQ_TYPE_BF16: {
		const uint32_t u = (uint32_t)(b[0] | b[1] << 8) << 16;
		float f;
		memcpy(&f, &u, 4);
		return f;
	}
	case KQ_TYPE_Q4_0: {
		const int nib = i < 16 ? b[2 + i] & 15 : b[2 + i - 16] >> 4;
		return (float)(nib - 8) * f16at(b);
	}
	case KQ_TYPE_Q4_1: {
		const int nib = i < 16 ? b[4 + i] & 15 : b[4 + i - 16] >> 4;
		return (float)nib * f16at(b) + f16at(b + 2);
	}
	case KQ_TYPE_Q5_0: {
		const int nib = i < 16 ? b[6 + i] & 15 : b[6 + i - 16] >> 4;
		const int hb = (b[2 + i / 8] >> (i % 8)) & 1;
		return (float)((nib | hb << 4) - 16) * f16at(b);
	}
	case KQ_TYPE_Q5_1: {
		const int nib = i < 16 ? b[8 + i] & 15 : b[8 + i - 16] >> 4;
		const int hb = (b[4 + i / 8] >> (i % 8)) & 1;
		return (float)(nib | hb << 4) * f16at(b) + f16at(b + 2);
	}
	case KQ_TYPE_Q8_0:
		return (float)(int8_t)b[2 + i] * f16at(b);
	case KQ_TYPE_Q8_1:
		return (float)(int8_t)b[4 + i] * f16at(b);
	case KQ_TYPE_Q4_K:
	case KQ_TYPE_Q5_K: {
		/* 4 groups of 64: 32 low nibbles (sub-block 2g), 32 high (2g+1) */
		const int g = i / 64, hi = (i % 64) >= 32, l = i % 32;
		const uint8_t *qs = b + (type == KQ_TYPE_Q4_K ? 16 : 48);
		int q = hi ? qs[32 * g + l] >> 4 : qs[32 * g + l] & 15;
		if (type == KQ_TYPE_Q5_K)
			q += ((b[16 + l] >> (2 * g + hi)) & 1) * 16;
		int sc, mn;
		k4_scale_min(b + 4, 2 * g + hi, &sc, &mn);
		return f16at(b) * (float)sc * (float)q - f16at(b + 2) * (float)mn;
	}
	case KQ_TYPE_Q6_K: {
		/* two halves of 128: quarter k of a half uses ql[l] (k even) or
		 * ql[32 + l] (k odd), low nibble for k < 2, and qh bits 2k..2k+1 */
		const int h = i / 128, k = (i % 128) / 32, l = i % 32;
		const uint8_t qlb = b[64 * h + (k & 1) * 32 + l];
		const int low = k < 2 ? qlb & 15 : qlb >> 4;
		const int high = (b[128 + 32 * h + l] >> (2 * k)) & 3;
		const int sc = (int8_t)b[192 + 8 * h + l / 16 + 2 * k];
		return f16at(b + 208) * (float)sc * (float)((low | high << 4) - 32);
	}
	}
	cr_assert_fail("type %u", type);
	return 0;
}

static void ref_row(uint32_t type, const uint8_t *src, float *dst, uint64_t n)
{
	uint32_t e = kq_block_elems(type), bb = kq_block_bytes(type);
	for (uint64_t i = 0; i < n; i++)
		dst[i] = ref_elem(type, src + i / e * bb, (int)(i % e));
}

/* llama.cpp x86 quantize_row_q8_0 / q8_1 (arch/x86/quants.c, __AVX2__) */
static void ref_quant_q8(const float *x, uint64_t n, uint8_t *dst, int with_s)
{
	const uint32_t bb = with_s ? 36 : 34, off = with_s ? 4 : 2;
	for (uint64_t b = 0; b < n / 32; b++) {
		const float *v = x + 32 * b;
		uint8_t *o = dst + b * bb;
		float amax = 0;
		for (int j = 0; j < 32; j++)
			amax = fmaxf(amax, fabsf(v[j]));
		const float d = amax / 127.f;
		const float id = amax != 0.0f ? 127.f / amax : 0.0f;
		int sum = 0;
		for (int j = 0; j < 32; j++) {
			const int q = (int)rintf(v[j] * id);
			o[off + j] = (uint8_t)(int8_t)q;
			sum += q;
		}
		put16(o, h16(d));
		if (with_s)
			put16(o + 2, h16(d * (float)sum));
	}
}

/* Integer dot of block b of a weight row and an activation (the quants by
 * ref_elem's extraction, with unit scales) */
static int32_t ref_isum(uint32_t type, const uint8_t *wb, const uint8_t *xb)
{
	int32_t p = 0;
	for (int j = 0; j < 32; j++) {
		const int qw = type == KQ_TYPE_Q4_1 ? (j < 16 ? wb[4 + j] & 15 : wb[4 + j - 16] >> 4)
						    : (int8_t)wb[2 + j];
		const int qx = type == KQ_TYPE_Q4_1 ? (int8_t)xb[4 + j] : (int8_t)xb[2 + j];
		p += qw * qx;
	}
	return p;
}

/* quant.h's definition of one row of a Q4_1 / Q8_0 product */
static float ref_dot_int(uint32_t type, const uint8_t *w, const uint8_t *x, uint64_t nb)
{
	const uint32_t wbb = type == KQ_TYPE_Q4_1 ? 20 : 34, xbb = type == KQ_TYPE_Q4_1 ? 36 : 34;
	float A[16] = { 0 };
	for (uint64_t b = 0; b < nb; b++) {
		const uint8_t *wb = w + b * wbb, *xb = x + b * xbb;
		const float P = (float)ref_isum(type, wb, xb);
		const float D = f16at(wb) * f16at(xb);
		if (type == KQ_TYPE_Q4_1)
			A[b % 16] = A[b % 16] + fmaf(D, P, f16at(wb + 2) * f16at(xb + 2));
		else
			A[b % 16] = fmaf(D, P, A[b % 16]);
	}
	for (int w2 = 8; w2 >= 1; w2 /= 2)
		for (int l = 0; l < w2; l++)
			A[l] = A[l] + A[l + w2];
	return A[0];
}

/* The same in double, with |terms| summed: the bound of the float result's
 * error is (nb/16 + 5)·2^-24·Σ|terms| (one rounding per block value, at most
 * nb/16 lane additions, 4 fold levels, each at most 2^-24 relative). */
static double ref_dot_exact(uint32_t type, const uint8_t *w, const uint8_t *x, uint64_t nb, double *abs_sum)
{
	const uint32_t wbb = type == KQ_TYPE_Q4_1 ? 20 : 34, xbb = type == KQ_TYPE_Q4_1 ? 36 : 34;
	double s = 0, a = 0;
	for (uint64_t b = 0; b < nb; b++) {
		const uint8_t *wb = w + b * wbb, *xb = x + b * xbb;
		double t = (double)f16at(wb) * f16at(xb) * ref_isum(type, wb, xb);
		a += fabs(t);
		s += t;
		if (type == KQ_TYPE_Q4_1) {
			t = (double)f16at(wb + 2) * f16at(xb + 2);
			a += fabs(t);
			s += t;
		}
	}
	*abs_sum = a;
	return s;
}

/* ------------------------------------------------------ random blocks */

static float rand_scale(void)
{
	switch (rng() % 16) {
	case 0:
		return 0.0f;
	case 1:
		return -uniform(1e-3f, 0.05f);
	default:
		return uniform(1e-4f, 0.05f);
	}
}

/* n random elements of `type` at dst: random quant bytes, f16 scales in a
 * sane range (so the dot products stay finite). */
static void rand_row(uint32_t type, uint8_t *dst, uint64_t n)
{
	uint64_t bytes;
	cr_assert_eq(kq_row_bytes(type, n, &bytes), 0);
	for (uint64_t i = 0; i < bytes; i++)
		dst[i] = (uint8_t)rng();
	const uint32_t e = kq_block_elems(type), bb = kq_block_bytes(type);
	for (uint64_t b = 0; b < n / e; b++) {
		uint8_t *p = dst + b * bb;
		switch (type) {
		case KQ_TYPE_F32:
			for (uint32_t i = 0; i < e; i++) {
				const float f = uniform(-2, 2);
				memcpy(p + 4 * i, &f, 4);
			}
			break;
		case KQ_TYPE_F16:
			put16(p, h16(uniform(-2, 2)));
			break;
		case KQ_TYPE_BF16:
			put16(p, kvr_f32_to_bf16(uniform(-2, 2)));
			break;
		case KQ_TYPE_Q4_1:
		case KQ_TYPE_Q5_1:
		case KQ_TYPE_Q4_K:
		case KQ_TYPE_Q5_K:
			put16(p, h16(rand_scale()));
			put16(p + 2, h16(uniform(-0.1f, 0.1f)));
			break;
		case KQ_TYPE_Q6_K:
			put16(p + 208, h16(rand_scale()));
			break;
		case KQ_TYPE_Q8_1:
			put16(p, h16(rand_scale()));
			put16(p + 2, h16(uniform(-1, 1)));
			break;
		default: /* Q4_0, Q5_0, Q8_0 */
			put16(p, h16(rand_scale()));
			break;
		}
	}
}

#define same_bits th_same_bits

/* ------------------------------------------------- dequantisation */


/* A zeroed Q4_K/Q5_K block of 256 elements with the header the K-quant test
 * reads: d = 1, dmin = 0.5, sub-block 0 scale 5 min 3, sub-block 5 scale 63
 * min 33 (the 6-bit scales split across bytes 1, 5 and 9). */
static void k_quant_header(uint8_t *b)
{
	memset(b, 0, 256);
	put16(b, 0x3c00);
	put16(b + 2, 0x3800);
	b[4 + 0] = 5;
	b[4 + 4] = 3;
	b[4 + 9] = 0x1f;
	b[4 + 1] = 0xc0;
	b[4 + 5] = 0x80;
}

Test(dequant, hand_built_blocks)
{
	uint8_t b[256];
	float y[256];

	/* Q4_0: d = 0.5; byte j holds j (element j) and 15-j (element j+16) */
	memset(b, 0, sizeof(b));
	put16(b, 0x3800);
	for (int j = 0; j < 16; j++)
		b[2 + j] = (uint8_t)(j | (15 - j) << 4);
	cr_assert_eq(kq_dequantize_row(KQ_TYPE_Q4_0, b, y, 32), 0);
	cr_expect_eq(y[0], -4.0f);  /* nibble 0 */
	cr_expect_eq(y[15], 3.5f);  /* nibble 15 */
	cr_expect_eq(y[16], 3.5f);  /* high nibble of byte 0: 15 */
	cr_expect_eq(y[31], -4.0f); /* high nibble of byte 15: 0 */
	cr_expect_eq(y[8], 0.0f);

	/* Q4_1: d = 0.25, m = -2 (negative min); then d = 0: every element is m */
	memset(b, 0, sizeof(b));
	put16(b, 0x3400);
	put16(b + 2, 0xc000);
	b[4] = 0xf0;  /* element 0: 0, element 16: 15 */
	b[19] = 0x0f; /* element 15: 15, element 31: 0 */
	cr_assert_eq(kq_dequantize_row(KQ_TYPE_Q4_1, b, y, 32), 0);
	cr_expect_eq(y[0], -2.0f);
	cr_expect_eq(y[16], 1.75f);
	cr_expect_eq(y[15], 1.75f);
	cr_expect_eq(y[31], -2.0f);
	cr_expect_eq(y[5], -2.0f);
	put16(b, 0x0000);
	put16(b + 2, 0x3e00); /* m = 1.5 */
	cr_assert_eq(kq_dequantize_row(KQ_TYPE_Q4_1, b, y, 32), 0);
	for (int i = 0; i < 32; i++)
		cr_expect_eq(y[i], 1.5f, "d = 0, element %d", i);

	/* Q5_0: d = 2; element 0: nibble 15 + bit 0 of qh -> 31 -> 15·2; element
	 * 16: nibble 0, bit 16 clear -> 0 -> -16·2; element 17: bit 17 set,
	 * nibble 0 -> 16 -> 0; element 31: bit 31 set, nibble 15 -> 30 */
	memset(b, 0, sizeof(b));
	put16(b, 0x4000);
	b[2] = 0x01;	     /* qh bit 0 */
	b[4] = 0x02;	     /* qh bit 17 */
	b[5] = 0x80;	     /* qh bit 31 */
	b[6 + 0] = 0x0f;     /* element 0: 15, element 16: 0 */
	b[6 + 15] = 0xf0;    /* element 15: 0, element 31: 15 */
	cr_assert_eq(kq_dequantize_row(KQ_TYPE_Q5_0, b, y, 32), 0);
	cr_expect_eq(y[0], 30.0f);
	cr_expect_eq(y[16], -32.0f);
	cr_expect_eq(y[17], 0.0f);
	cr_expect_eq(y[31], 30.0f);
	cr_expect_eq(y[15], -32.0f);

	/* Q5_1: d = 1, m = -16 -> values q - 16 (the Q5_0 pattern shifted) */
	memset(b, 0, sizeof(b));
	put16(b, 0x3c00);
	put16(b + 2, 0xcc00);
	b[4] = 0x01;
	b[7] = 0x80;
	b[8 + 0] = 0x0f;
	b[8 + 15] = 0xf0;
	cr_assert_eq(kq_dequantize_row(KQ_TYPE_Q5_1, b, y, 32), 0);
	cr_expect_eq(y[0], 15.0f);
	cr_expect_eq(y[16], -16.0f);
	cr_expect_eq(y[31], 15.0f);

	/* Q8_0: d = 0.125; -128, 127, -1 */
	memset(b, 0, sizeof(b));
	put16(b, 0x3000);
	b[2] = 0x80;
	b[3] = 0x7f;
	b[33] = 0xff;
	cr_assert_eq(kq_dequantize_row(KQ_TYPE_Q8_0, b, y, 32), 0);
	cr_expect_eq(y[0], -16.0f);
	cr_expect_eq(y[1], 15.875f);
	cr_expect_eq(y[31], -0.125f);
	cr_expect_eq(y[2], 0.0f);

	/* Q8_1: the quants at offset 4; s does not enter dequantisation */
	memset(b, 0, sizeof(b));
	put16(b, 0x4000);
	put16(b + 2, 0x7bff);
	b[4] = 0x80;
	b[35] = 3;
	cr_assert_eq(kq_dequantize_row(KQ_TYPE_Q8_1, b, y, 32), 0);
	cr_expect_eq(y[0], -256.0f);
	cr_expect_eq(y[31], 6.0f);

	/* Q6_K: d at the end (1.0); scale 0 = -3 (signed), scale 15 = 127.
	 * element 0: ql low 0, qh bits 0-1 = 0 -> q = -32 -> 1·(-3)·(-32) = 96;
	 * element 1: ql low 15, qh 3 -> 31 -> -93;
	 * element 255 (half 1, quarter 3, l 31; scale 8 + 1 + 6 = 15): ql[64+32+31]
	 * high nibble 15, qh[32+31] bits 6-7 = 3 -> 31 -> 127·31 */
	memset(b, 0, sizeof(b));
	put16(b + 208, 0x3c00);
	b[192 + 0] = (uint8_t)-3;
	b[192 + 15] = 127;
	b[1] = 0x0f;
	b[128 + 1] = 0x03;
	b[64 + 32 + 31] = 0xf0;
	b[128 + 32 + 31] = 0xc0;
	cr_assert_eq(kq_dequantize_row(KQ_TYPE_Q6_K, b, y, 256), 0);
	cr_expect_eq(y[0], 96.0f);
	cr_expect_eq(y[1], -93.0f);
	cr_expect_eq(y[255], 3937.0f);
	cr_expect_eq(y[16], 0.0f); /* scale 1 = 0 */

	/* Q4_K: d = 1, dmin = 0.5. Sub-block 0: scale 5, min 3 (bytes 0, 4);
	 * sub-block 5: scale 63 = 0xf | 3<<4 (byte 9 low nibble, byte 1 top
	 * bits), min 33 = 1 | 2<<4 (byte 9 high nibble, byte 5 top bits).
	 * element 0 = nibble 15 -> 5·15 - 1.5; element 160 is sub-block 5's
	 * first (group 2, high nibbles of qs[64..]) with nibble 2 -> 63·2 - 16.5 */
	k_quant_header(b);
	b[16 + 0] = 0x0f;
	b[16 + 64] = 0x20;
	cr_assert_eq(kq_dequantize_row(KQ_TYPE_Q4_K, b, y, 256), 0);
	cr_expect_eq(y[0], 73.5f);
	cr_expect_eq(y[160], 109.5f);
	cr_expect_eq(y[1], -1.5f);	/* nibble 0 */
	cr_expect_eq(y[32], 0.0f);	/* sub-block 1: scale 0, min 0 */

	/* Q5_K: the same scales; qh[0] bit 0 adds 16 to element 0, qh[0] bit 5
	 * adds 16 to element 160 */
	k_quant_header(b);
	b[16 + 0] = 0x21;
	b[48 + 0] = 0x0f;
	b[48 + 64] = 0x20;
	cr_assert_eq(kq_dequantize_row(KQ_TYPE_Q5_K, b, y, 256), 0);
	cr_expect_eq(y[0], 5.0f * 31 - 1.5f);
	cr_expect_eq(y[160], 63.0f * 18 - 16.5f);

	/* F16 (normal, max, subnormal, signed zero), BF16, F32 */
	const uint16_t hv[5] = { 0x3c00, 0xc000, 0x7bff, 0x0001, 0x8000 };
	cr_assert_eq(kq_dequantize_row(KQ_TYPE_F16, hv, y, 5), 0);
	cr_expect_eq(y[0], 1.0f);
	cr_expect_eq(y[1], -2.0f);
	cr_expect_eq(y[2], 65504.0f);
	cr_expect_eq(y[3], 0x1p-24f);
	cr_expect(y[4] == 0.0f && signbit(y[4]));
	const uint16_t bv[2] = { 0x3f80, 0xc0a0 };
	cr_assert_eq(kq_dequantize_row(KQ_TYPE_BF16, bv, y, 2), 0);
	cr_expect_eq(y[0], 1.0f);
	cr_expect_eq(y[1], -5.0f);
	const float fv[2] = { 3.25f, -0.0f };
	cr_assert_eq(kq_dequantize_row(KQ_TYPE_F32, fv, y, 2), 0);
	cr_expect(same_bits(y[0], 3.25f) && same_bits(y[1], -0.0f));
}

Test(dequant, random_blocks_every_path)
{
	enum kq_isa isas[KQ_ISA_COUNT];
	const int n_isa = isa_list(isas);
	const uint64_t n = 4096;
	uint8_t *src = xmalloc(n * 4);
	float *got = xmalloc(n * sizeof(float)), *want = xmalloc(n * sizeof(float));
	for (size_t t = 0; t < N_TYPES; t++) {
		const uint32_t type = all_types[t].type;
		for (int rep = 0; rep < 4; rep++) {
			rand_row(type, src, n);
			ref_row(type, src, want, n);
			for (int k = 0; k < n_isa; k++) {
				cr_assert_eq(kq_isa_force(isas[k]), 0);
				memset(got, 0xa5, n * sizeof(float));
				cr_assert_eq(kq_dequantize_row(type, src, got, n), 0);
				for (uint64_t i = 0; i < n; i++)
					cr_assert(same_bits(got[i], want[i]), "%s on %s: element %lu: %a, want %a",
						  kq_type_name(type), kq_isa_name(isas[k]), (unsigned long)i,
						  (double)got[i], (double)want[i]);
			}
		}
	}
	free(src);
	free(got);
	free(want);
}

Test(dequant, sizes_and_errors)
{
	for (size_t t = 0; t < N_TYPES; t++) {
		const struct tinfo *ti = &all_types[t];
		cr_expect_eq(kq_block_elems(ti->type), ti->elems, "%s", kq_type_name(ti->type));
		cr_expect_eq(kq_block_bytes(ti->type), ti->bytes, "%s", kq_type_name(ti->type));
		uint64_t bytes = 0;
		cr_expect_eq(kq_row_bytes(ti->type, 576ull * ti->elems, &bytes), 0);
		cr_expect_eq(bytes, 576ull * ti->bytes);
		if (ti->elems > 1) {
			float y[1];
			cr_expect_eq(kq_row_bytes(ti->type, ti->elems + 1, &bytes), -EINVAL);
			cr_expect_eq(kq_dequantize_row(ti->type, y, y, ti->elems - 1), -EINVAL);
		}
	}
	cr_expect_str_eq(kq_type_name(KQ_TYPE_Q4_1), "q4_1");
	cr_expect_str_eq(kq_type_name(KQ_TYPE_Q6_K), "q6_K");
	/* Q8_K: an activation type, with a layout but no matrix of its own */
	cr_expect_eq(kq_block_elems(KQ_TYPE_Q8_K), 256u);
	cr_expect_eq(kq_block_bytes(KQ_TYPE_Q8_K), 292u);
	cr_expect_str_eq(kq_type_name(KQ_TYPE_Q8_K), "q8_K");
	/* unsupported: removed ids 4/5, Q2_K, Q3_K, IQ types, out of range */
	const uint32_t bad[] = { 4, 5, 10, 11, 16, 20, 23, 24, 28, 29, 31, 34, 39, 1000, UINT32_MAX };
	float y[256] = { 0 };
	uint8_t w[256] = { 0 };
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		uint64_t bytes;
		cr_expect_eq(kq_block_elems(bad[i]), 0u);
		cr_expect_eq(kq_row_bytes(bad[i], 256, &bytes), -ENOTSUP);
		cr_expect_eq(kq_dequantize_row(bad[i], w, y, 256), -ENOTSUP, "type %u", bad[i]);
		cr_expect_eq(kq_matvec_act_type(bad[i]), -ENOTSUP);
		cr_expect_eq(kq_matvec(bad[i], w, 256, 1, 256, w, y, y, 0, 1), -ENOTSUP);
		cr_expect_str_eq(kq_type_name(bad[i]), "?");
	}
	cr_expect_eq(kq_dequantize_row(KQ_TYPE_Q4_1, NULL, y, 32), -EINVAL);
	cr_expect_eq(kq_dequantize_row(KQ_TYPE_Q4_1, w, NULL, 32), -EINVAL);
	cr_expect_eq(kq_dequantize_row(KQ_TYPE_Q4_1, NULL, NULL, 0), 0);
	uint64_t bytes;
	cr_expect_eq(kq_row_bytes(KQ_TYPE_F32, UINT64_MAX, &bytes), -EINVAL); /* overflow */
}

/* ---------------------------------------------- activation quantisation */

Test(quantize, matches_llama_cpp_x86)
{
	const uint64_t n = 32 * 200;
	float *x = xmalloc(n * sizeof(float));
	for (uint64_t i = 0; i < n; i++) {
		const uint64_t b = i / 32;
		x[i] = b % 7 == 0 ? uniform(-1e-3f, 1e-3f) : uniform(-8, 8) * (float)(b % 5 + 1);
	}
	for (int j = 0; j < 32; j++) /* a block of zeros: d = 0, s = 0 */
		x[32 * 3 + j] = 0.0f;
	uint8_t *g0 = xmalloc(n / 32 * 34), *w0 = xmalloc(n / 32 * 34);
	uint8_t *g1 = xmalloc(n / 32 * 36), *w1 = xmalloc(n / 32 * 36);
	enum kq_isa isas[KQ_ISA_COUNT];
	const int n_isa = isa_list(isas);
	for (int k = 0; k < n_isa; k++) { /* the scalar block quantiser and AVX2's */
		cr_assert_eq(kq_isa_force(isas[k]), 0);
		cr_assert_eq(kq_quantize_row_q8_0(x, g0, n), 0);
		cr_assert_eq(kq_quantize_row_q8_1(x, g1, n), 0);
		ref_quant_q8(x, n, w0, 0);
		ref_quant_q8(x, n, w1, 1);
		cr_assert_eq(memcmp(g0, w0, n / 32 * 34), 0);
		cr_assert_eq(memcmp(g1, w1, n / 32 * 36), 0);
		for (int j = 0; j < 36; j++)
			cr_expect_eq(g1[3 * 36 + j], 0);
		/* every quant within ±127 */
		for (uint64_t b = 0; b < n / 32; b++)
			for (int j = 0; j < 32; j++)
				cr_assert_neq((int8_t)g1[b * 36 + 4 + j], -128);
	}
	free(x);
	free(g0);
	free(w0);
	free(g1);
	free(w1);
}

Test(quantize, ties_round_half_to_even)
{
	/* amax = 127 gives id = 127/127 = 1 exactly: x·id are the x themselves.
	 * llama.cpp's x86 path rounds with _mm256_round_ps(_MM_ROUND_NEAREST):
	 * ties to even (2.5 -> 2, -3.5 -> -4, 0.5 -> 0, 1.5 -> 2); its portable
	 * quantize_row_q8_1_ref uses roundf (2.5 -> 3, 0.5 -> 1). */
	float x[32] = { 127.0f, 2.5f, -3.5f, 0.5f, -0.5f, 1.5f, -2.5f, 126.5f };
	const int want[8] = { 127, 2, -4, 0, 0, 2, -2, 126 };
	uint8_t q1[36], q0[34];
	enum kq_isa isas[KQ_ISA_COUNT];
	const int n_isa = isa_list(isas);
	for (int k = 0; k < n_isa; k++) {
		cr_assert_eq(kq_isa_force(isas[k]), 0);
		cr_assert_eq(kq_quantize_row_q8_1(x, q1, 32), 0);
		cr_assert_eq(kq_quantize_row_q8_0(x, q0, 32), 0);
		for (int j = 0; j < 8; j++) {
			cr_expect_eq((int8_t)q1[4 + j], want[j], "x = %g", (double)x[j]);
			cr_expect_eq((int8_t)q0[2 + j], want[j], "x = %g", (double)x[j]);
		}
		cr_expect_eq(f16at(q1), 1.0f);
		cr_expect_eq(f16at(q1 + 2), 127.0f + 2 - 4 + 0 + 0 + 2 - 2 + 126);
		/* negative amax element: d from |x| */
		float y[32] = { 0 };
		y[5] = -63.5f;
		cr_assert_eq(kq_quantize_row_q8_1(y, q1, 32), 0);
		cr_expect_eq((int8_t)q1[4 + 5], -127);
		cr_expect_eq(f16at(q1), kvr_f16_to_f32(h16(63.5f / 127.0f)));
	}
}

Test(quantize, errors_and_non_finite)
{
	float x[64] = { 0 };
	uint8_t q[72];
	cr_expect_eq(kq_quantize_row_q8_0(x, q, 33), -EINVAL);
	cr_expect_eq(kq_quantize_row_q8_1(x, q, 31), -EINVAL);
	cr_expect_eq(kq_quantize_row_q8_1(NULL, q, 32), -EINVAL);
	cr_expect_eq(kq_quantize_row_q8_0(x, NULL, 32), -EINVAL);
	cr_expect_eq(kq_quantize_row_q8_0(NULL, NULL, 0), 0);
	/* non-finite input: defined (UBSan-clean) garbage, quants in range */
	x[0] = NAN;
	x[1] = 1.0f;
	x[32] = INFINITY;
	x[33] = -2.0f;
	enum kq_isa isas[KQ_ISA_COUNT];
	const int n_isa = isa_list(isas);
	uint8_t first[72];
	for (int k = 0; k < n_isa; k++) {
		cr_assert_eq(kq_isa_force(isas[k]), 0);
		cr_assert_eq(kq_quantize_row_q8_1(x, q, 64), 0);
		for (int b = 0; b < 2; b++)
			for (int j = 0; j < 32; j++)
				cr_expect_neq((int8_t)q[36 * b + 4 + j], -128);
		if (k == 0)
			memcpy(first, q, sizeof(q));
		else /* the same garbage on every path */
			cr_expect_eq(memcmp(first, q, sizeof(q)), 0, "%s", kq_isa_name(isas[k]));
	}
}

/* --------------------------------------------------- matrix-vector */

static const uint64_t shape_cols[] = { 32, 64, 96, 128, 160, 480, 512, 544, 576, 1024, 1536 };
static const uint64_t shape_rows[] = { 1, 3, 17, 64, 65, 130 };

/* One Q4_1 or Q8_0 matrix: every path bit-identical to ref_dot_int, and that
 * within its bound of the exact value; rows outside [r0, r1) untouched. */
static void check_int_matvec(uint32_t type, uint64_t rows, uint64_t cols, uint64_t pad, int raw_act)
{
	enum kq_isa isas[KQ_ISA_COUNT];
	const int n_isa = isa_list(isas);
	const uint32_t act = (uint32_t)kq_matvec_act_type(type);
	uint64_t wrow, xbytes;
	cr_assert_eq(kq_row_bytes(type, cols, &wrow), 0);
	cr_assert_eq(kq_row_bytes(act, cols, &xbytes), 0);
	const uint64_t row_bytes = wrow + pad, nb = cols / 32;
	uint8_t *w = xmalloc(rows * row_bytes), *xq = xmalloc(xbytes);
	float *x = xmalloc(cols * sizeof(float)), *y = xmalloc(rows * sizeof(float));
	float *want = xmalloc(rows * sizeof(float));
	for (uint64_t r = 0; r < rows; r++) {
		rand_row(type, w + r * row_bytes, cols);
		memset(w + r * row_bytes + wrow, 0xee, pad);
	}
	if (raw_act && type == KQ_TYPE_Q4_1) {
		rand_row(act, xq, cols); /* any int8 quants, -128 included */
	} else if (raw_act) {
		rand_row(act, xq, cols);
		for (uint64_t i = 0; i < xbytes; i++) /* Q8_0 activations stay within ±127 */
			if (i % 34 >= 2 && xq[i] == 0x80)
				xq[i] = 0x81;
	} else {
		for (uint64_t i = 0; i < cols; i++)
			x[i] = uniform(-3, 3);
		cr_assert_eq(act == KQ_TYPE_Q8_1 ? kq_quantize_row_q8_1(x, xq, cols)
						 : kq_quantize_row_q8_0(x, xq, cols), 0);
	}
	for (uint64_t r = 0; r < rows; r++) {
		want[r] = ref_dot_int(type, w + r * row_bytes, xq, nb);
		double abs_sum;
		const double exact = ref_dot_exact(type, w + r * row_bytes, xq, nb, &abs_sum);
		const double bound = ((double)nb / 16 + 5) * 0x1p-24 * abs_sum + 1e-30;
		cr_assert_leq(fabs((double)want[r] - exact), bound, "%s row %lu: %a vs %a", kq_type_name(type),
			      (unsigned long)r, (double)want[r], exact);
	}
	const uint64_t ranges[][2] = { { 0, rows }, { rows / 3, rows - rows / 4 }, { rows - 1, rows } };
	for (int k = 0; k < n_isa; k++) {
		cr_assert_eq(kq_isa_force(isas[k]), 0);
		cr_assert_eq(kq_isa_active(), isas[k]);
		for (int g = 0; g < 3; g++) {
			const uint64_t r0 = ranges[g][0], r1 = ranges[g][1];
			for (uint64_t r = 0; r < rows; r++)
				y[r] = -7.0f;
			cr_assert_eq(kq_matvec(type, w, row_bytes, rows, cols, xq, NULL, y, r0, r1), 0);
			for (uint64_t r = 0; r < rows; r++) {
				if (r < r0 || r >= r1)
					cr_assert_eq(y[r], -7.0f, "row %lu outside the range written", (unsigned long)r);
				else
					cr_assert(same_bits(y[r], want[r]),
						  "%s %s %lux%lu (pad %lu) row %lu: %a, want %a", kq_type_name(type),
						  kq_isa_name(isas[k]), (unsigned long)rows, (unsigned long)cols,
						  (unsigned long)pad, (unsigned long)r, (double)y[r], (double)want[r]);
			}
		}
	}
	free(w);
	free(xq);
	free(x);
	free(y);
	free(want);
}

Test(matvec, q4_1_every_path_bit_identical)
{
	for (size_t c = 0; c < sizeof(shape_cols) / sizeof(shape_cols[0]); c++)
		for (size_t r = 0; r < sizeof(shape_rows) / sizeof(shape_rows[0]); r++)
			check_int_matvec(KQ_TYPE_Q4_1, shape_rows[r], shape_cols[c], (r % 2) * 12, (int)(c % 2));
}

Test(matvec, q8_0_every_path_bit_identical)
{
	for (size_t c = 0; c < sizeof(shape_cols) / sizeof(shape_cols[0]); c++)
		for (size_t r = 0; r < sizeof(shape_rows) / sizeof(shape_rows[0]); r++)
			check_int_matvec(KQ_TYPE_Q8_0, shape_rows[r], shape_cols[c], (r % 2) * 6, (int)(c % 2));
}

Test(matvec, columns_past_the_activation_chunk)
{
	/* the vector paths prepare the activation 256 blocks at a time: 1043
	 * blocks are 4 chunks and a partial one (partial quad included) */
	check_int_matvec(KQ_TYPE_Q4_1, 7, 1043 * 32, 0, 0);
	check_int_matvec(KQ_TYPE_Q8_0, 7, 1043 * 32, 4, 1);
	check_int_matvec(KQ_TYPE_Q4_1, 2, 512 * 32, 0, 1); /* exactly two chunks */
}

/* kq_matmul over n activation rows: each output row bit-identical to
 * kq_matvec of that activation row alone, on every path; rows outside the
 * range and the padding between output rows untouched. */
static void check_int_matmul(uint32_t type, uint64_t rows, uint64_t cols, uint32_t n, uint64_t pad)
{
	enum kq_isa isas[KQ_ISA_COUNT];
	const int n_isa = isa_list(isas);
	const uint32_t act = (uint32_t)kq_matvec_act_type(type);
	uint64_t wrow, xbytes;
	cr_assert_eq(kq_row_bytes(type, cols, &wrow), 0);
	cr_assert_eq(kq_row_bytes(act, cols, &xbytes), 0);
	const uint64_t row_bytes = wrow + pad;
	const size_t x_stride = xbytes + 8, y_stride = rows + 3;
	uint8_t *w = xmalloc(rows * row_bytes), *xq = xmalloc(n * x_stride);
	float *x = xmalloc(cols * sizeof(float)), *y = xmalloc(n * y_stride * sizeof(float));
	float *want = xmalloc(n * rows * sizeof(float));
	const size_t space_bytes = kq_matmul_workspace_bytes(type, cols, n);
	cr_assert_gt(space_bytes, 0);
	unsigned char *space = xmalloc(space_bytes + 1);
	for (uint64_t r = 0; r < rows; r++)
		rand_row(type, w + r * row_bytes, cols);
	for (uint32_t t = 0; t < n; t++) {
		for (uint64_t i = 0; i < cols; i++)
			x[i] = uniform(-3, 3) * (float)(t + 1);
		cr_assert_eq(act == KQ_TYPE_Q8_1 ? kq_quantize_row_q8_1(x, xq + t * x_stride, cols)
						 : kq_quantize_row_q8_0(x, xq + t * x_stride, cols), 0);
	}
	const uint64_t ranges[][2] = { { 0, rows }, { rows / 3, rows - rows / 4 }, { rows - 1, rows } };
	for (int k = 0; k < n_isa; k++) {
		cr_assert_eq(kq_isa_force(isas[k]), 0);
		for (uint32_t t = 0; t < n; t++)
			cr_assert_eq(kq_matvec(type, w, row_bytes, rows, cols, xq + t * x_stride, NULL, want + t * rows,
					       0, rows), 0);
		for (int g = 0; g < 3; g++) {
			const uint64_t r0 = ranges[g][0], r1 = ranges[g][1];
			for (size_t i = 0; i < n * y_stride; i++)
				y[i] = -7.0f;
			/* an odd workspace address: any alignment is accepted */
			cr_assert_eq(kq_matmul(type, w, row_bytes, rows, cols, xq, x_stride, NULL, 0, n, y, y_stride, r0,
					       r1, space + 1, space_bytes), 0);
			for (uint32_t t = 0; t < n; t++)
				for (uint64_t r = 0; r < y_stride; r++) {
					const float got = y[t * y_stride + r];
					if (r < r0 || r >= r1)
						cr_assert_eq(got, -7.0f, "row %lu outside the range written", (unsigned long)r);
					else
						cr_assert(same_bits(got, want[t * rows + r]),
							  "%s %s %lux%lu n=%u token %u row %lu: %a, want %a",
							  kq_type_name(type), kq_isa_name(isas[k]), (unsigned long)rows,
							  (unsigned long)cols, n, t, (unsigned long)r, (double)got,
							  (double)want[t * rows + r]);
				}
		}
	}
	free(w);
	free(xq);
	free(x);
	free(y);
	free(want);
	free(space);
}

Test(matmul, every_path_bit_identical_to_matvec)
{
	/* odd and even token counts (the kernel pairs tokens), row counts around
	 * its tile of 8, block counts around its groups of 8 and 16 (partial
	 * pairs, partial groups in either half of the lanes) */
	static const uint64_t cols[] = { 32, 64, 96, 256, 288, 512, 544, 576, 800, 1536, 4128 };
	static const uint64_t rows[] = { 1, 7, 8, 9, 33 };
	static const uint32_t tokens[] = { 2, 3, 32 };
	for (size_t c = 0; c < sizeof(cols) / sizeof(cols[0]); c++)
		for (size_t r = 0; r < sizeof(rows) / sizeof(rows[0]); r++)
			for (size_t t = 0; t < sizeof(tokens) / sizeof(tokens[0]); t++) {
				check_int_matmul(KQ_TYPE_Q4_1, rows[r], cols[c], tokens[t], (r % 2) * 12);
				check_int_matmul(KQ_TYPE_Q8_0, rows[r], cols[c], tokens[t], (c % 2) * 6);
			}
	kq_isa_force(KQ_ISA_SCALAR); /* leave a known path; other tests force their own */
}

Test(matmul, other_types_and_errors)
{
	enum { ROWS = 4, COLS = 256, N = 3 };
	uint8_t w[ROWS * 210] = { 0 }, xq[N * 36 * 8] = { 0 }, xk[N * 292];
	float x[N * COLS], y[N * ROWS], want[ROWS];
	unsigned char space[64];
	for (int i = 0; i < N * COLS; i++)
		x[i] = uniform(-1, 1);
	for (int t = 0; t < N; t++)
		cr_assert_eq(kq_quantize_row_q8_k(x + t * COLS, xk + t * 292, COLS), 0);
	for (int r = 0; r < ROWS; r++)
		rand_row(KQ_TYPE_Q6_K, w + r * 210, COLS);
	/* a type without the batched route: per row through kq_matvec, no workspace */
	cr_assert_eq(kq_matmul_workspace_bytes(KQ_TYPE_Q6_K, COLS, N), 0);
	cr_assert_eq(kq_matmul(KQ_TYPE_Q6_K, w, 210, ROWS, COLS, xk, 292, NULL, 0, N, y, ROWS, 0, ROWS, NULL, 0), 0);
	for (int t = 0; t < N; t++) {
		cr_assert_eq(kq_matvec(KQ_TYPE_Q6_K, w, 210, ROWS, COLS, xk + t * 292, NULL, want, 0, ROWS), 0);
		for (int r = 0; r < ROWS; r++)
			cr_assert(same_bits(y[t * ROWS + r], want[r]));
	}
	enum kq_isa isas[KQ_ISA_COUNT];
	const int n_isa = isa_list(isas);
	cr_assert_eq(kq_isa_force(isas[n_isa - 1]), 0); /* the fastest path checks first */
	const size_t need = kq_matmul_workspace_bytes(KQ_TYPE_Q4_1, COLS, N);
	unsigned char *big = xmalloc(need);
	for (int i = 0; i < N * ROWS; i++)
		y[i] = -7.0f;
	cr_expect_eq(kq_matmul(KQ_TYPE_Q4_1, w, 160, ROWS, COLS, xq, 288, NULL, 0, N, y, ROWS, 0, ROWS, space,
			       sizeof(space)), isas[n_isa - 1] == KQ_ISA_SCALAR ? 0 : -EINVAL); /* short workspace */
	for (int i = 0; i < N * ROWS && isas[n_isa - 1] != KQ_ISA_SCALAR; i++)
		cr_expect_eq(y[i], -7.0f, "nothing written on error");
	cr_expect_eq(kq_matmul(KQ_TYPE_Q4_1, w, 160, ROWS, COLS, NULL, 288, NULL, 0, N, y, ROWS, 0, ROWS, big, need),
		     -EINVAL); /* needs x_q */
	cr_expect_eq(kq_matmul(KQ_TYPE_Q4_1, w, 160, ROWS, COLS - 1, xq, 288, NULL, 0, N, y, ROWS, 0, ROWS, big, need),
		     -EINVAL); /* cols */
	cr_expect_eq(kq_matmul(KQ_TYPE_Q4_1, w, 160, ROWS, COLS, xq, 288, NULL, 0, N, y, ROWS, 2, 1, big, need),
		     -EINVAL); /* range */
	cr_expect_eq(kq_matmul(KQ_TYPE_Q4_1, w, 159, ROWS, COLS, xq, 288, NULL, 0, N, y, ROWS, 0, ROWS, big, need),
		     -EINVAL); /* row_bytes */
	cr_expect_eq(kq_matmul(99, w, 160, ROWS, COLS, xq, 288, NULL, 0, N, y, ROWS, 0, ROWS, big, need), -ENOTSUP);
	free(big);
	kq_isa_force(KQ_ISA_SCALAR);
}

Test(matvec, q8_0_weight_minus_128)
{
	/* -128 weights against ±127 activations: |w| = 128 read unsigned */
	const uint64_t cols = 576, rows = 4;
	uint8_t w[4 * 18 * 34], xq[18 * 34];
	for (uint64_t b = 0; b < rows * 18; b++) {
		put16(w + b * 34, h16(0.5f));
		for (int j = 0; j < 32; j++)
			w[b * 34 + 2 + j] = (uint8_t)(b % 3 == 0 ? 0x80 : rng());
	}
	for (uint64_t b = 0; b < 18; b++) {
		put16(xq + b * 34, h16(0.25f));
		for (int j = 0; j < 32; j++)
			xq[b * 34 + 2 + j] = (uint8_t)(j % 2 ? 127 : -127);
	}
	enum kq_isa isas[KQ_ISA_COUNT];
	const int n_isa = isa_list(isas);
	for (int k = 0; k < n_isa; k++) {
		kq_isa_force(isas[k]);
		float y[4];
		cr_assert_eq(kq_matvec(KQ_TYPE_Q8_0, w, 18 * 34, rows, cols, xq, NULL, y, 0, rows), 0);
		for (uint64_t r = 0; r < rows; r++)
			cr_assert(same_bits(y[r], ref_dot_int(KQ_TYPE_Q8_0, w + r * 18 * 34, xq, 18)), "%s row %lu",
				  kq_isa_name(isas[k]), (unsigned long)r);
	}
}

Test(matvec, quantisation_error_against_f32)
{
	/* What the integer route costs against an f32 activation: per element
	 * |x - q·d_x| <= d_x/2 (rounding) + 127·|d - f16(d)| <= 0.56·d_x, and for
	 * Q4_1 the f16 rounding of s adds |m_w|·|s_x|·2^-11 per block. */
	const uint64_t rows = 64;
	const uint64_t cols[2] = { 576, 1536 };
	for (int ti = 0; ti < 2; ti++) {
		const uint32_t type = ti ? KQ_TYPE_Q8_0 : KQ_TYPE_Q4_1;
		for (int c = 0; c < 2; c++) {
			const uint64_t n = cols[c], nb = n / 32;
			uint64_t wrow, xbytes;
			kq_row_bytes(type, n, &wrow);
			kq_row_bytes((uint32_t)kq_matvec_act_type(type), n, &xbytes);
			uint8_t *w = xmalloc(rows * wrow), *xq = xmalloc(xbytes);
			float *x = xmalloc(n * 4), *wd = xmalloc(n * 4), y[64];
			for (uint64_t r = 0; r < rows; r++)
				rand_row(type, w + r * wrow, n);
			for (uint64_t i = 0; i < n; i++)
				x[i] = uniform(-1, 1) * (i % 97 == 0 ? 20.0f : 1.0f);
			if (type == KQ_TYPE_Q4_1)
				kq_quantize_row_q8_1(x, xq, n);
			else
				kq_quantize_row_q8_0(x, xq, n);
			cr_assert_eq(kq_matvec(type, w, wrow, rows, n, xq, NULL, y, 0, rows), 0);
			for (uint64_t r = 0; r < rows; r++) {
				ref_row(type, w + r * wrow, wd, n);
				double exact = 0, bound = 0, mag = 0;
				for (uint64_t i = 0; i < n; i++) {
					exact += (double)wd[i] * x[i];
					mag += fabs((double)wd[i] * x[i]);
				}
				for (uint64_t b = 0; b < nb; b++) {
					const uint8_t *xb = xq + b * (xbytes / nb);
					double aw = 0;
					for (int j = 0; j < 32; j++)
						aw += fabs((double)wd[32 * b + j]);
					bound += aw * 0.56 * f16at(xb);
					if (type == KQ_TYPE_Q4_1)
						bound += fabs(f16at(w + r * wrow + b * 20 + 2) * f16at(xb + 2)) * 0x1p-11;
				}
				bound += 1e-5 * mag + 1e-30;
				cr_assert_leq(fabs(y[r] - exact), bound, "%s %lu cols row %lu: %g vs %g (bound %g)",
					      kq_type_name(type), (unsigned long)n, (unsigned long)r, (double)y[r], exact,
					      bound);
			}
			free(w);
			free(xq);
			free(x);
			free(wd);
		}
	}
}

Test(matvec, other_types_double_dot)
{
	/* y = (float)Σ (double)w_j·(double)x_j with j increasing: products of
	 * floats are exact in double, so the transcription's bits must match */
	const uint64_t rows = 9;
	const uint64_t colsv[3] = { 256, 768, 1536 };
	for (size_t t = 0; t < N_TYPES; t++) {
		const uint32_t type = all_types[t].type;
		if (type == KQ_TYPE_Q4_1 || type == KQ_TYPE_Q8_0 || type == KQ_TYPE_Q8_1 || type == KQ_TYPE_Q4_K ||
		    type == KQ_TYPE_Q5_K || type == KQ_TYPE_Q6_K)
			continue; /* the integer routes */
		cr_assert_eq(kq_matvec_act_type(type), KQ_TYPE_F32);
		for (int c = 0; c < 3; c++) {
			const uint64_t n = colsv[c];
			uint64_t wrow;
			cr_assert_eq(kq_row_bytes(type, n, &wrow), 0);
			const uint64_t row_bytes = wrow + 8;
			uint8_t *w = xmalloc(rows * row_bytes);
			float *x = xmalloc(n * 4), *wd = xmalloc(n * 4), y[9];
			for (uint64_t r = 0; r < rows; r++)
				rand_row(type, w + r * row_bytes, n);
			for (uint64_t i = 0; i < n; i++)
				x[i] = uniform(-2, 2);
			for (uint64_t r = 0; r < rows; r++)
				y[r] = -7.0f;
			cr_assert_eq(kq_matvec(type, w, row_bytes, rows, n, NULL, x, y, 2, rows), 0);
			cr_expect_eq(y[0], -7.0f);
			cr_expect_eq(y[1], -7.0f);
			for (uint64_t r = 2; r < rows; r++) {
				ref_row(type, w + r * row_bytes, wd, n);
				double s = 0;
				for (uint64_t i = 0; i < n; i++)
					s += (double)wd[i] * (double)x[i];
				cr_assert(same_bits(y[r], (float)s), "%s %lu cols row %lu: %a vs %a",
					  kq_type_name(type), (unsigned long)n, (unsigned long)r, (double)y[r], s);
			}
			free(w);
			free(x);
			free(wd);
		}
	}
}

struct split_job {
	uint32_t type;
	const uint8_t *w, *xq;
	uint64_t row_bytes, rows, cols, r0, r1;
	float *y;
	int rc;
};

static void *split_worker(void *arg)
{
	struct split_job *j = arg;
	j->rc = kq_matvec(j->type, j->w, j->row_bytes, j->rows, j->cols, j->xq, NULL, j->y, j->r0, j->r1);
	return NULL;
}

Test(matvec, threads_splitting_rows)
{
	/* what the runner does: threads take row ranges of one product, one y */
	const uint64_t rows = 1000, cols = 576;
	for (int t = 0; t < 2; t++) {
		const uint32_t type = t ? KQ_TYPE_Q8_0 : KQ_TYPE_Q4_1;
		uint64_t wrow, xbytes;
		kq_row_bytes(type, cols, &wrow);
		kq_row_bytes((uint32_t)kq_matvec_act_type(type), cols, &xbytes);
		uint8_t *w = xmalloc(rows * wrow), *xq = xmalloc(xbytes);
		float *x = xmalloc(cols * 4), *y1 = xmalloc(rows * 4), *y4 = xmalloc(rows * 4);
		for (uint64_t r = 0; r < rows; r++)
			rand_row(type, w + r * wrow, cols);
		for (uint64_t i = 0; i < cols; i++)
			x[i] = uniform(-1, 1);
		if (type == KQ_TYPE_Q4_1)
			kq_quantize_row_q8_1(x, xq, cols);
		else
			kq_quantize_row_q8_0(x, xq, cols);
		cr_assert_eq(kq_matvec(type, w, wrow, rows, cols, xq, NULL, y1, 0, rows), 0);
		pthread_t th[4];
		struct split_job jobs[4];
		const uint64_t cut[5] = { 0, 333, 334, 701, rows }; /* uneven, one of a single row */
		for (int k = 0; k < 4; k++) {
			jobs[k] = (struct split_job){ type, w, xq, wrow, rows, cols, cut[k], cut[k + 1], y4, -1 };
			cr_assert_eq(pthread_create(&th[k], NULL, split_worker, &jobs[k]), 0);
		}
		for (int k = 0; k < 4; k++) {
			pthread_join(th[k], NULL);
			cr_assert_eq(jobs[k].rc, 0);
		}
		cr_assert_eq(memcmp(y1, y4, rows * 4), 0, "%s: split rows differ", kq_type_name(type));
		free(w);
		free(xq);
		free(x);
		free(y1);
		free(y4);
	}
}

/* Q8_K as llama.cpp's quantize_row_q8_K_ref: the value of largest magnitude
 * sets d = max/-127 and maps to -127·sign; the rest round half to even. */
Test(quantize, q8_k_reference)
{
	float x[256] = { 0 };
	uint8_t q[292];
	x[0] = 1.0f;  /* 1·63.5 = 63.5: a tie, to 64 (even) and negated with the scale's sign */
	x[1] = -2.0f; /* the largest: -127·(-2)/(-2)... = 127 */
	x[2] = 0.5f;  /* 31.75 -> 32 */
	x[3] = 3.0f / 127.0f; /* 1.5 -> 2 */
	for (int j = 16; j < 32; j++)
		x[j] = 0.25f;
	cr_assert_eq(kq_quantize_row_q8_k(x, q, 256), 0);
	float d;
	memcpy(&d, q, 4);
	const int8_t *qs = (const int8_t *)(q + 4);
	cr_expect(same_bits(d, 1.0f / (-127.0f / -2.0f)), "d = %a", (double)d);
	cr_expect_eq(qs[0], 64);
	cr_expect_eq(qs[1], -127);
	cr_expect_eq(qs[2], 32);
	cr_expect_eq(qs[3], 2);
	int16_t bsums[16];
	memcpy(bsums, q + 260, sizeof(bsums));
	cr_expect_eq(bsums[0], 64 - 127 + 32 + 2);
	cr_expect_eq(bsums[1], 16 * 16); /* 0.25·63.5 = 15.875 -> 16 */
	memset(x, 0, sizeof(x));
	cr_assert_eq(kq_quantize_row_q8_k(x, q, 256), 0);
	memcpy(&d, q, 4);
	cr_expect_eq(d, 0.0f);
	cr_expect_eq(kq_quantize_row_q8_k(x, q, 128), -EINVAL);
}

/* Q4_K, Q5_K and Q6_K against Q8_K: the integer route equals the exact dot
 * of the dequantised weights and activation to f32 rounding of the block
 * sums, and the f32 activation's dot to the activation's rounding. */
Test(matvec, k_quants_against_exact)
{
	const uint32_t types[3] = { KQ_TYPE_Q4_K, KQ_TYPE_Q5_K, KQ_TYPE_Q6_K };
	const uint64_t rows = 17, cols = 1024, nb = cols / 256;
	for (int ti = 0; ti < 3; ti++) {
		const uint32_t type = types[ti];
		uint64_t wrow;
		cr_assert_eq(kq_row_bytes(type, cols, &wrow), 0);
		uint8_t *w = xmalloc(rows * wrow), *xq = xmalloc(nb * 292);
		float *x = xmalloc(cols * 4), *xd = xmalloc(cols * 4), *wd = xmalloc(cols * 4), y[17];
		for (uint64_t r = 0; r < rows; r++)
			rand_row(type, w + r * wrow, cols);
		for (uint64_t i = 0; i < cols; i++)
			x[i] = uniform(-1, 1) * (i % 61 == 0 ? 8.0f : 1.0f);
		cr_assert_eq(kq_quantize_row_q8_k(x, xq, cols), 0);
		cr_assert_eq(kq_dequantize_row(KQ_TYPE_Q8_K, xq, xd, cols), 0);
		cr_assert_eq(kq_matvec(type, w, wrow, rows, cols, xq, NULL, y, 0, rows), 0);
		for (uint64_t r = 0; r < rows; r++) {
			ref_row(type, w + r * wrow, wd, cols);
			double exact_q = 0, exact_x = 0, mag = 0, wabs = 0;
			for (uint64_t i = 0; i < cols; i++) {
				exact_q += (double)wd[i] * xd[i];
				exact_x += (double)wd[i] * x[i];
				mag += fabs((double)wd[i] * xd[i]);
				wabs += fabs((double)wd[i]);
			}
			float dx;
			memcpy(&dx, xq, 4);
			/* block values (4 products, a subtraction) and their sum: a few ulp of the magnitudes */
			const double bound_q = (double)(nb + 8) * 0x1p-23 * mag + 1e-30;
			cr_assert_leq(fabs(y[r] - exact_q), bound_q, "%s row %lu: %a vs %a", kq_type_name(type),
				      (unsigned long)r, (double)y[r], exact_q);
			/* each activation within half a step of its quant */
			const double bound_x = bound_q + wabs * 0.5 * fabs((double)dx) * 1.001;
			cr_assert_leq(fabs(y[r] - exact_x), bound_x, "%s row %lu against f32", kq_type_name(type),
				      (unsigned long)r);
		}
		/* every instruction-set path: the same bits */
		enum kq_isa isas[KQ_ISA_COUNT];
		const int n_isa = isa_list(isas);
		for (int k = 0; k < n_isa; k++) {
			float yk[17];
			cr_assert_eq(kq_isa_force(isas[k]), 0);
			cr_assert_eq(kq_matvec(type, w, wrow, rows, cols, xq, NULL, yk, 0, rows), 0);
			for (uint64_t r = 0; r < rows; r++)
				cr_assert(same_bits(yk[r], y[r]), "%s on %s, row %lu: %a vs %a", kq_type_name(type),
					  kq_isa_name(isas[k]), (unsigned long)r, (double)yk[r], (double)y[r]);
		}
		/* a planted error of one quant step in the activation moves the result */
		const float before = y[0];
		xq[4 + 5] = (uint8_t)((int8_t)xq[4 + 5] + ((int8_t)xq[4 + 5] < 100 ? 1 : -1));
		cr_assert_eq(kq_matvec(type, w, wrow, rows, cols, xq, NULL, y, 0, 1), 0);
		ref_row(type, w, wd, cols);
		if (wd[5] != 0.0f)
			cr_expect_neq(y[0], before, "%s ignores activation quant 5", kq_type_name(type));
		free(w), free(xq), free(x), free(xd), free(wd);
	}
}

Test(matvec, act_types_and_errors)
{
	cr_expect_eq(kq_matvec_act_type(KQ_TYPE_Q4_1), KQ_TYPE_Q8_1);
	cr_expect_eq(kq_matvec_act_type(KQ_TYPE_Q8_0), KQ_TYPE_Q8_0);
	cr_expect_eq(kq_matvec_act_type(KQ_TYPE_Q4_K), KQ_TYPE_Q8_K);
	cr_expect_eq(kq_matvec_act_type(KQ_TYPE_Q6_K), KQ_TYPE_Q8_K);
	cr_expect_eq(kq_matvec_act_type(KQ_TYPE_F16), KQ_TYPE_F32);
	cr_expect_eq(kq_matvec_act_type(KQ_TYPE_Q8_1), -ENOTSUP); /* an activation type */
	cr_expect_eq(kq_matvec_act_type(KQ_TYPE_Q8_K), -ENOTSUP);
	uint8_t w[2 * 20 * 2] = { 0 }, xq[2 * 36] = { 0 };
	float x[64] = { 0 }, y[2] = { -7.0f, -7.0f };
	cr_expect_eq(kq_matvec(KQ_TYPE_Q4_1, w, 40, 2, 64, NULL, x, y, 0, 2), -EINVAL); /* needs x_q */
	cr_expect_eq(kq_matvec(KQ_TYPE_F16, w, 512, 2, 256, xq, NULL, y, 0, 2), -EINVAL); /* needs x_f32 */
	cr_expect_eq(kq_matvec(KQ_TYPE_Q6_K, w, 210, 2, 256, NULL, x, y, 0, 2), -EINVAL); /* needs x_q */
	cr_expect_eq(kq_matvec(KQ_TYPE_Q4_1, w, 40, 2, 63, xq, NULL, y, 0, 2), -EINVAL); /* cols */
	cr_expect_eq(kq_matvec(KQ_TYPE_Q4_1, w, 39, 2, 64, xq, NULL, y, 0, 2), -EINVAL); /* row_bytes */
	cr_expect_eq(kq_matvec(KQ_TYPE_Q4_1, w, 40, 2, 64, xq, NULL, y, 1, 3), -EINVAL); /* row_end */
	cr_expect_eq(kq_matvec(KQ_TYPE_Q4_1, w, 40, 2, 64, xq, NULL, y, 2, 1), -EINVAL); /* range */
	cr_expect_eq(kq_matvec(KQ_TYPE_Q4_1, NULL, 40, 2, 64, xq, NULL, y, 0, 2), -EINVAL);
	cr_expect_eq(kq_matvec(KQ_TYPE_Q4_1, w, 40, 2, 64, xq, NULL, NULL, 0, 2), -EINVAL);
	cr_expect(y[0] == -7.0f && y[1] == -7.0f, "y untouched on error");
	cr_expect_eq(kq_matvec(KQ_TYPE_Q4_1, w, 40, 2, 64, xq, NULL, y, 1, 1), 0); /* empty range */
	cr_expect_eq(kq_matvec(KQ_TYPE_Q4_1, NULL, 0, 2, 0, NULL, NULL, y, 0, 2), 0); /* no columns */
	cr_expect(y[0] == 0.0f && y[1] == 0.0f);
}

Test(isa, names_force_and_env)
{
	cr_expect_str_eq(kq_isa_name(KQ_ISA_SCALAR), "scalar");
	cr_expect_str_eq(kq_isa_name(KQ_ISA_AVX512VNNI), "avx512vnni");
	cr_expect_str_eq(kq_isa_name((enum kq_isa)9), "?");
	cr_expect(kq_isa_supported(KQ_ISA_SCALAR));
	cr_expect_eq(kq_isa_force((enum kq_isa)9), -ENOTSUP);
	for (int i = 0; i < KQ_ISA_COUNT; i++) {
		if (kq_isa_supported((enum kq_isa)i)) {
			cr_expect_eq(kq_isa_force((enum kq_isa)i), 0);
			cr_expect_eq(kq_isa_active(), (enum kq_isa)i);
		} else {
			cr_expect_eq(kq_isa_force((enum kq_isa)i), -ENOTSUP);
		}
	}
	/* the first kq_isa_active in a process honours KQ_ISA; Criterion runs
	 * each test in its own process, so a child shows it */
	const char *env = getenv("KQ_ISA");
	cr_log_info("KQ_ISA=%s; paths: scalar avx2=%d avx512bw=%d avx512vnni=%d", env ? env : "(unset)",
		    kq_isa_supported(KQ_ISA_AVX2), kq_isa_supported(KQ_ISA_AVX512BW),
		    kq_isa_supported(KQ_ISA_AVX512VNNI));
}

Test(isa, env_scalar_is_honoured)
{
	/* A fresh process (this test's) has not chosen yet: set KQ_ISA first */
	setenv("KQ_ISA", "scalar", 1);
	cr_expect_eq(kq_isa_active(), KQ_ISA_SCALAR);
}

Test(isa, env_avx512_picks_best_avx512)
{
	setenv("KQ_ISA", "avx512", 1);
	const enum kq_isa a = kq_isa_active();
	if (kq_isa_supported(KQ_ISA_AVX512VNNI))
		cr_expect_eq(a, KQ_ISA_AVX512VNNI);
	else if (kq_isa_supported(KQ_ISA_AVX512BW))
		cr_expect_eq(a, KQ_ISA_AVX512BW);
}

/* ------------------------------------------------------ the real model */

Test(model, real_q4_1_and_q8_0_tensors)
{
	char path[4096];
	if (gguf_default_model_path(path, sizeof(path)) != 0)
		cr_skip_test("model file absent (KVR_MODEL_PATH or ~/.cache/kvrecall/%s); "
			     "bench/model/fetch_model.sh fetches it", GGUF_MODEL_NAME);
	struct gguf *g = NULL;
	char err[512];
	cr_assert_eq(gguf_open(path, &g, err, sizeof(err)), 0, "%s", err);
	const char *names[3] = { "blk.0.ffn_down.weight", "blk.29.attn_k.weight", "token_embd.weight" };
	const uint32_t types[3] = { KQ_TYPE_Q4_1, KQ_TYPE_Q4_1, KQ_TYPE_Q8_0 };
	for (int k = 0; k < 3; k++) {
		const struct gguf_tensor *t = gguf_find_tensor(g, names[k]);
		cr_assert_not_null(t, "%s", names[k]);
		cr_assert_eq(t->type, types[k], "%s is %s", names[k], gguf_type_name(t->type));
		const uint64_t cols = t->ne[0], rows = t->ne[1];
		uint64_t wrow, xbytes;
		cr_assert_eq(kq_row_bytes(t->type, cols, &wrow), 0);
		cr_assert_eq(wrow * rows, t->bytes);
		/* every row dequantises to finite values; Q8_0 quants of -128? */
		float *wd = xmalloc(cols * 4), *x = xmalloc(cols * 4);
		uint64_t minus128 = 0;
		const uint64_t check_rows = rows < 2048 ? rows : 2048;
		for (uint64_t r = 0; r < check_rows; r++) {
			const uint8_t *row = (const uint8_t *)t->data + r * wrow;
			cr_assert_eq(kq_dequantize_row(t->type, row, wd, cols), 0);
			for (uint64_t i = 0; i < cols; i++)
				cr_assert(isfinite(wd[i]) && fabsf(wd[i]) < 100.0f, "%s[%lu][%lu] = %g", names[k],
					  (unsigned long)r, (unsigned long)i, (double)wd[i]);
			if (t->type == KQ_TYPE_Q8_0)
				for (uint64_t b = 0; b < cols / 32; b++)
					for (int j = 0; j < 32; j++)
						minus128 += row[b * 34 + 2 + j] == 0x80;
		}
		/* the product on every path, bit for bit with the transcription */
		const uint32_t act = (uint32_t)kq_matvec_act_type(t->type);
		cr_assert_eq(kq_row_bytes(act, cols, &xbytes), 0);
		uint8_t *xq = xmalloc(xbytes);
		for (uint64_t i = 0; i < cols; i++)
			x[i] = uniform(-2, 2);
		if (act == KQ_TYPE_Q8_1)
			kq_quantize_row_q8_1(x, xq, cols);
		else
			kq_quantize_row_q8_0(x, xq, cols);
		float *y = xmalloc(check_rows * 4);
		enum kq_isa isas[KQ_ISA_COUNT];
		const int n_isa = isa_list(isas);
		for (int s = 0; s < n_isa; s++) {
			kq_isa_force(isas[s]);
			cr_assert_eq(kq_matvec(t->type, t->data, wrow, rows, cols, xq, NULL, y, 0, check_rows), 0);
			for (uint64_t r = 0; r < check_rows; r++) {
				const float want = ref_dot_int(t->type, (const uint8_t *)t->data + r * wrow, xq, cols / 32);
				cr_assert(same_bits(y[r], want), "%s %s row %lu: %a vs %a", names[k],
					  kq_isa_name(isas[s]), (unsigned long)r, (double)y[r], (double)want);
			}
		}
		cr_log_info("%s: %s %lux%lu, %lu rows checked on %d paths%s%lu", names[k], kq_type_name(t->type),
			    (unsigned long)cols, (unsigned long)rows, (unsigned long)check_rows, n_isa,
			    t->type == KQ_TYPE_Q8_0 ? ", weight quants of -128: " : "", (unsigned long)minus128);
		free(wd);
		free(x);
		free(xq);
		free(y);
	}
	gguf_close(g);
}
