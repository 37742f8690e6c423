/* SPDX-License-Identifier: MIT */
/*
 * convert.c — vectorised bulk conversions (f16/bf16 <-> f32) and key
 * summaries, dispatched at run time to AVX-512, AVX2+F16C or scalar code.
 *
 * Every path is bit-identical to the scalar reference (half.h, summary.h): the
 * hardware conversions round to nearest even like kvr_f32_to_f16, bf16 uses the
 * same integer rounding, and min/max use the operand order of MINPS/MAXPS that
 * matches `x < mn ? x : mn`, with NaN tracked separately so it propagates.
 *
 * Threads: any. The dispatch choice is a relaxed atomic written once at first
 * use (the best path the CPU has, or the one KVR_CPU_ISA names; or by
 * kvr_convert_isa_force in tests) and read on every call.
 */
#include <errno.h>
#include <immintrin.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "half.h"
#include "base/isa.h"
#include "summary.h"

/* -1 = not chosen yet. Relaxed: the value is self-contained (no data published
 * with it), and racing first calls pick the same value. */
static _Atomic int isa_choice = -1;

static enum kvr_convert_isa isa_best(void)
{
	const struct kvr_isa *isa = kvr_isa_get();
	if (isa->avx512 && isa->f16c)
		return isa->avx512_vnni ? KVR_CONVERT_AVX512_VNNI : KVR_CONVERT_AVX512;
	if (isa->avx2 && isa->f16c)
		return KVR_CONVERT_AVX2;
	return KVR_CONVERT_SCALAR;
}

/* KVR_CPU_ISA's request: the path named, clamped to what the CPU has; the
 * best path when it is unset or names none (kvr_convert_isa_request says
 * which, for `kvrecall info`). */
static enum kvr_convert_isa isa_initial(void)
{
	enum kvr_convert_isa want;
	if (kvr_convert_isa_request(&want, NULL, 0) <= 0)
		return isa_best();
	return want < isa_best() ? want : isa_best();
}

int kvr_convert_isa_request(enum kvr_convert_isa *isa, char *why, size_t why_bytes)
{
	const char *env = getenv("KVR_CPU_ISA");
	if (why && why_bytes)
		why[0] = '\0';
	if (!env || !*env)
		return 0;
	if (kvr_convert_isa_parse(env, isa) == 0) {
		if (why && why_bytes)
			snprintf(why, why_bytes, "KVR_CPU_ISA=%s%s", env, *isa > isa_best() ? ": this CPU lacks it" : "");
		return 1;
	}
	if (why && why_bytes)
		snprintf(why, why_bytes, "KVR_CPU_ISA=%.32s names no path (scalar, avx2, avx512, avx512vnni): ignored",
			 env);
	return -1;
}

enum kvr_convert_isa kvr_convert_isa_active(void)
{
	int v = atomic_load_explicit(&isa_choice, memory_order_relaxed);
	if (v < 0) {
		v = (int)isa_initial();
		atomic_store_explicit(&isa_choice, v, memory_order_relaxed);
	}
	return (enum kvr_convert_isa)v;
}

enum kvr_convert_isa kvr_convert_isa_force(enum kvr_convert_isa want)
{
	enum kvr_convert_isa best = isa_best();
	if (want > best)
		want = best;
	atomic_store_explicit(&isa_choice, (int)want, memory_order_relaxed);
	return want;
}

static const char *const isa_names[] = { [KVR_CONVERT_SCALAR] = "scalar", [KVR_CONVERT_AVX2] = "avx2",
					 [KVR_CONVERT_AVX512] = "avx512", [KVR_CONVERT_AVX512_VNNI] = "avx512vnni" };

const char *kvr_convert_isa_name(enum kvr_convert_isa isa)
{
	return (unsigned)isa < sizeof(isa_names) / sizeof(isa_names[0]) ? isa_names[isa] : "scalar";
}

int kvr_convert_isa_parse(const char *name, enum kvr_convert_isa *isa)
{
	for (unsigned i = 0; i < sizeof(isa_names) / sizeof(isa_names[0]); i++)
		if (name && !strcmp(name, isa_names[i])) {
			*isa = (enum kvr_convert_isa)i;
			return 0;
		}
	return -EINVAL;
}

/* ------------------------------------------------------------------ scalar */

static void to_f32_scalar(float *dst, const void *src, uint32_t t, size_t i, size_t n)
{
	for (; i < n; i++)
		dst[i] = kvr_load_f32(src, t, i);
}

static void from_f32_scalar(void *dst, const float *src, uint32_t t, size_t i, size_t n)
{
	for (; i < n; i++)
		kvr_store_f32(dst, t, i, src[i]);
}

/* ------------------------------------------------------------------ AVX2 */

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

static AVX2_TARGET inline __m256 load8_avx2(const void *src, uint32_t t, size_t i)
{
	if (t == KVR_ELEM_F16)
		return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i)));
	if (t == KVR_ELEM_BF16)
		return _mm256_castsi256_ps(_mm256_slli_epi32(
			_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i))),
			16));
	return _mm256_loadu_ps((const float *)src + i);
}

static AVX2_TARGET inline __m128i f32_to_bf16_avx2(__m256 v)
{
	const __m256i u = _mm256_castps_si256(v);
	const __m256i hi = _mm256_srli_epi32(u, 16);
	const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
	__m256i r = _mm256_srli_epi32(
		_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
	const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
					       _mm256_set1_epi32(0x7f800000));
	r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
	/* 8 x u32 (each <= 0xffff) -> 8 x u16 */
	const __m256i packed = _mm256_packus_epi32(r, r);
	return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

static AVX2_TARGET inline void store8_avx2(void *dst, uint32_t t, size_t i, __m256 v)
{
	if (t == KVR_ELEM_F16)
		_mm_storeu_si128((__m128i *)((uint16_t *)dst + i),
				 _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
	else if (t == KVR_ELEM_BF16)
		_mm_storeu_si128((__m128i *)((uint16_t *)dst + i), f32_to_bf16_avx2(v));
	else
		_mm256_storeu_ps((float *)dst + i, v);
}

static AVX2_TARGET void to_f32_avx2(float *dst, const void *src, uint32_t t, size_t n)
{
	size_t i = 0;
	for (; i + 8 <= n; i += 8)
		_mm256_storeu_ps(dst + i, load8_avx2(src, t, i));
	to_f32_scalar(dst, src, t, i, n);
}

static AVX2_TARGET void from_f32_avx2(void *dst, const float *src, uint32_t t, size_t n)
{
	size_t i = 0;
	for (; i + 8 <= n; i += 8)
		store8_avx2(dst, t, i, _mm256_loadu_ps(src + i));
	from_f32_scalar(dst, src, t, i, n);
}

/* ------------------------------------------------------------------ AVX-512 */

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

static AVX512_TARGET inline __m512 load16_avx512(const void *src, uint32_t t, size_t i)
{
	if (t == KVR_ELEM_F16)
		return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i)));
	if (t == KVR_ELEM_BF16)
		return _mm512_castsi512_ps(_mm512_slli_epi32(
			_mm512_cvtepu16_epi32(
				_mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i))),
			16));
	return _mm512_loadu_ps((const float *)src + i);
}

static AVX512_TARGET inline void store16_avx512(void *dst, uint32_t t, size_t i, __m512 v)
{
	if (t == KVR_ELEM_F16) {
		_mm256_storeu_si256((__m256i *)((uint16_t *)dst + i),
				    _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
	} else if (t == KVR_ELEM_BF16) {
		const __m512i u = _mm512_castps_si512(v);
		const __m512i hi = _mm512_srli_epi32(u, 16);
		const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
		__m512i r = _mm512_srli_epi32(
			_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
		const __mmask16 nan = _mm512_cmpgt_epu32_mask(
			_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
		r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
		_mm256_storeu_si256((__m256i *)((uint16_t *)dst + i), _mm512_cvtepi32_epi16(r));
	} else {
		_mm512_storeu_ps((float *)dst + i, v);
	}
}

static AVX512_TARGET void to_f32_avx512(float *dst, const void *src, uint32_t t, size_t n)
{
	size_t i = 0;
	for (; i + 16 <= n; i += 16)
		_mm512_storeu_ps(dst + i, load16_avx512(src, t, i));
	to_f32_scalar(dst, src, t, i, n);
}

static AVX512_TARGET void from_f32_avx512(void *dst, const float *src, uint32_t t, size_t n)
{
	size_t i = 0;
	for (; i + 16 <= n; i += 16)
		store16_avx512(dst, t, i, _mm512_loadu_ps(src + i));
	from_f32_scalar(dst, src, t, i, n);
}

/* ------------------------------------------------------------------ dispatch */

void kvr_convert_to_f32(float *dst, const void *src, uint32_t elem_type, size_t n)
{
	if (elem_type == KVR_ELEM_F32) {
		memmove(dst, src, n * sizeof(float));
		return;
	}
	switch (kvr_convert_isa_active()) {
	case KVR_CONVERT_AVX512_VNNI:
	case KVR_CONVERT_AVX512:
		to_f32_avx512(dst, src, elem_type, n);
		break;
	case KVR_CONVERT_AVX2:
		to_f32_avx2(dst, src, elem_type, n);
		break;
	default:
		to_f32_scalar(dst, src, elem_type, 0, n);
		break;
	}
}

void kvr_convert_from_f32(void *dst, const float *src, uint32_t elem_type, size_t n)
{
	if (elem_type == KVR_ELEM_F32) {
		memmove(dst, src, n * sizeof(float));
		return;
	}
	switch (kvr_convert_isa_active()) {
	case KVR_CONVERT_AVX512_VNNI:
	case KVR_CONVERT_AVX512:
		from_f32_avx512(dst, src, elem_type, n);
		break;
	case KVR_CONVERT_AVX2:
		from_f32_avx2(dst, src, elem_type, n);
		break;
	default:
		from_f32_scalar(dst, src, elem_type, 0, n);
		break;
	}
}

/* ------------------------------------------------------------------ summaries */

static void summarize_scalar(const struct kvr_page_geometry *g, const void *keys,
			     uint64_t stride, void *min_out, void *max_out, uint32_t d0)
{
	const uint32_t t = g->elem_type;
	for (uint32_t d = d0; d < g->head_dim; d++) {
		float mn = kvr_load_f32(keys, t, d), mx = mn;
		for (uint32_t p = 1; p < g->page_tokens; p++)
			kvr_minmax_step(kvr_load_f32(keys, t, p * stride + d), &mn, &mx);
		kvr_store_f32(min_out, t, d, mn);
		kvr_store_f32(max_out, t, d, mx);
	}
}

static AVX2_TARGET void summarize_avx2(const struct kvr_page_geometry *g, const void *keys,
				       uint64_t stride, void *min_out, void *max_out)
{
	const uint32_t t = g->elem_type;
	uint32_t d = 0;
	for (; d + 8 <= g->head_dim; d += 8) {
		__m256 mn = load8_avx2(keys, t, d), mx = mn;
		__m256 isnan = _mm256_cmp_ps(mn, mn, _CMP_UNORD_Q), lastnan = mn;
		for (uint32_t p = 1; p < g->page_tokens; p++) {
			const __m256 x = load8_avx2(keys, t, p * stride + d);
			const __m256 xnan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
			mn = _mm256_min_ps(x, mn); /* (x < mn) ? x : mn */
			mx = _mm256_max_ps(x, mx); /* (x > mx) ? x : mx */
			lastnan = _mm256_blendv_ps(lastnan, x, xnan);
			isnan = _mm256_or_ps(isnan, xnan);
		}
		store8_avx2(min_out, t, d, _mm256_blendv_ps(mn, lastnan, isnan));
		store8_avx2(max_out, t, d, _mm256_blendv_ps(mx, lastnan, isnan));
	}
	summarize_scalar(g, keys, stride, min_out, max_out, d);
}

static AVX512_TARGET void summarize_avx512(const struct kvr_page_geometry *g, const void *keys,
					   uint64_t stride, void *min_out, void *max_out)
{
	const uint32_t t = g->elem_type;
	uint32_t d = 0;
	for (; d + 16 <= g->head_dim; d += 16) {
		__m512 mn = load16_avx512(keys, t, d), mx = mn, lastnan = mn;
		__mmask16 isnan = _mm512_cmp_ps_mask(mn, mn, _CMP_UNORD_Q);
		for (uint32_t p = 1; p < g->page_tokens; p++) {
			const __m512 x = load16_avx512(keys, t, p * stride + d);
			const __mmask16 xnan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
			mn = _mm512_min_ps(x, mn);
			mx = _mm512_max_ps(x, mx);
			lastnan = _mm512_mask_mov_ps(lastnan, xnan, x);
			isnan |= xnan;
		}
		store16_avx512(min_out, t, d, _mm512_mask_mov_ps(mn, isnan, lastnan));
		store16_avx512(max_out, t, d, _mm512_mask_mov_ps(mx, isnan, lastnan));
	}
	summarize_scalar(g, keys, stride, min_out, max_out, d);
}

/* The same sum on every ISA: rows widened to f32 (exact), then added column
 * by column in token order, which the compiler vectorises across columns
 * without reordering any one column's additions. */
static void sum_rows(const struct kvr_page_geometry *g, const void *rows, uint64_t stride,
		     float *sum, float *row)
{
	const uint32_t d = g->head_dim;
	const uint64_t eb = g->elem_bytes;
	kvr_convert_to_f32(sum, rows, g->elem_type, d);
	for (uint32_t p = 1; p < g->page_tokens; p++) {
		kvr_convert_to_f32(row, (const unsigned char *)rows + p * stride * eb, g->elem_type, d);
		for (uint32_t c = 0; c < d; c++)
			sum[c] += row[c];
	}
}

void kvr_summarize_means(const struct kvr_page_geometry *g, const void *keys, const void *values,
			 uint64_t stride, void *key_mean_out, void *value_mean_out)
{
	float sum[256], row[256]; /* head_dim <= 256 (config.c) */
	if (g->head_dim > 256)
		return;
	sum_rows(g, keys, stride, sum, row);
	for (uint32_t c = 0; c < g->head_dim; c++)
		kvr_store_f32(key_mean_out, g->elem_type, c, kvr_summary_mean(sum[c], g->page_tokens));
	sum_rows(g, values, stride, sum, row);
	for (uint32_t c = 0; c < g->head_dim; c++)
		kvr_store_f32(value_mean_out, g->elem_type, c, kvr_summary_mean(sum[c], g->page_tokens));
}

void kvr_summarize_keys(const struct kvr_page_geometry *g, const void *keys, uint64_t key_stride,
			void *min_out, void *max_out)
{
	switch (kvr_convert_isa_active()) {
	case KVR_CONVERT_AVX512_VNNI:
	case KVR_CONVERT_AVX512:
		summarize_avx512(g, keys, key_stride, min_out, max_out);
		break;
	case KVR_CONVERT_AVX2:
		summarize_avx2(g, keys, key_stride, min_out, max_out);
		break;
	default:
		summarize_scalar(g, keys, key_stride, min_out, max_out, 0);
		break;
	}
}
