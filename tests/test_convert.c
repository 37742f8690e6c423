/* SPDX-License-Identifier: MIT */
/*
 * test_convert.c — element conversions and page summaries, against references
 * written here independently of layouts/: f16 through the compiler's _Float16
 * (libgcc's soft-float routines), bf16 by choosing the nearer of the two
 * neighbouring bf16 values in double precision, summaries by a plain double
 * fold. Every instruction-set path the CPU has is checked (scalar, AVX2+F16C,
 * AVX-512), on lengths that leave vector tails.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "helpers.h"
#include "half.h"
#include "page.h"
#include "summary.h"

static const enum kvr_convert_isa all_isas[] = { KVR_CONVERT_SCALAR, KVR_CONVERT_AVX2,
						 KVR_CONVERT_AVX512 };

static uint32_t rng_state = 12345;
static uint32_t rng(void)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 17;
	rng_state ^= rng_state << 5;
	return rng_state;
}

/* ---- independent references ---- */

static uint16_t ref_f32_to_f16(float x)
{
	const _Float16 h = (_Float16)x; /* libgcc __truncsfhf2: round to nearest even */
	uint16_t u;
	memcpy(&u, &h, sizeof(u));
	return u;
}

static float ref_f16_to_f32(uint16_t u)
{
	_Float16 h;
	memcpy(&h, &u, 2);
	return (float)h;
}

static uint16_t ref_f32_to_bf16(float x)
{
	const uint32_t u = th_f32_bits(x);
	if (isnan(x))
		return 0; /* callers check NaN-ness only */
	const uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
	const double dl = th_bits_f32(lo), dh = th_bits_f32(hi), dx = x;
	if (isinf(x))
		return (uint16_t)(u >> 16);
	const double el = fabs(dx - dl), eh = isinf(dh) ? INFINITY : fabs(dh - dx);
	/* dh may be infinite when rounding up overflows: compare against the
	 * midpoint instead (as round-to-nearest does) */
	if (isinf(dh)) {
		const double mid = fabs((double)th_bits_f32(lo)) + ldexp(1.0, ilogb(th_bits_f32(lo)) - 8);
		return (uint16_t)((fabs(dx) >= fabs(mid) && !(fabs(dx) == fabs(mid) && !((lo >> 16) & 1)))
					  ? hi >> 16
					  : lo >> 16);
	}
	if (el < eh)
		return (uint16_t)(lo >> 16);
	if (eh < el)
		return (uint16_t)(hi >> 16);
	return (uint16_t)(((lo >> 16) & 1) ? hi >> 16 : lo >> 16);
}

/* ---- scalar half.h against the references ---- */

/* The ISA names KVR_CPU_ISA and kernels_bench --isa accept: each path's own
 * name round-trips; anything else is refused without touching *isa. */
Test(convert, isa_names_parse)
{
	static const enum kvr_convert_isa all[] = { KVR_CONVERT_SCALAR, KVR_CONVERT_AVX2, KVR_CONVERT_AVX512 };
	for (unsigned i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
		enum kvr_convert_isa got = (enum kvr_convert_isa)-1;
		cr_assert_eq(kvr_convert_isa_parse(kvr_convert_isa_name(all[i]), &got), 0);
		cr_assert_eq(got, all[i], "%s parsed as %d", kvr_convert_isa_name(all[i]), (int)got);
	}
	static const char *const bad[] = { "AVX2", "avx", "avx2 ", "", "neon", "avx512bw" };
	for (unsigned i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		enum kvr_convert_isa got = KVR_CONVERT_AVX2;
		cr_assert_eq(kvr_convert_isa_parse(bad[i], &got), -EINVAL, "\"%s\" accepted", bad[i]);
		cr_assert_eq(got, KVR_CONVERT_AVX2);
	}
	enum kvr_convert_isa got = KVR_CONVERT_AVX2;
	cr_assert_eq(kvr_convert_isa_parse(NULL, &got), -EINVAL);
}

Test(convert, f16_to_f32_all_values)
{
	for (uint32_t u = 0; u < 65536; u++) {
		const float got = kvr_f16_to_f32((uint16_t)u), want = ref_f16_to_f32((uint16_t)u);
		if (isnan(want)) {
			cr_assert(isnan(got), "0x%04x: NaN expected", u);
			continue;
		}
		cr_assert_eq(th_f32_bits(got), th_f32_bits(want), "0x%04x: got %a want %a", u, (double)got,
			     (double)want);
		/* round trip is exact for every non-NaN value */
		cr_assert_eq(kvr_f32_to_f16(got), u, "0x%04x does not round-trip", u);
	}
}

static float interesting_f32(uint32_t i)
{
	switch (i % 8) {
	case 0: /* exact f16 ties: x.5 ulp */
		return kvr_f16_to_f32((uint16_t)(rng() & 0x7bff)) *
		       (1.0f + 1.0f / 2048.0f) * ((rng() & 1) ? -1.0f : 1.0f);
	case 1: /* f16 subnormal range */
		return ldexpf((float)(rng() % 4096), -36) * ((rng() & 1) ? -1.0f : 1.0f);
	case 2: /* near overflow */
		return 65504.0f + (float)(rng() % 64) - 32.0f;
	default:
		return th_bits_f32(rng());
	}
}

Test(convert, f32_to_f16_matches_reference)
{
	for (uint32_t i = 0; i < 2000000; i++) {
		const float x = interesting_f32(i);
		const uint16_t got = kvr_f32_to_f16(x), want = ref_f32_to_f16(x);
		if (isnan(x)) {
			cr_assert((got & 0x7c00) == 0x7c00 && (got & 0x3ff), "NaN -> 0x%04x", got);
			continue;
		}
		cr_assert_eq(got, want, "%a: got 0x%04x want 0x%04x", (double)x, got, want);
	}
}

Test(convert, bf16_matches_reference)
{
	for (uint32_t u = 0; u < 65536; u++) {
		const float x = kvr_bf16_to_f32((uint16_t)u);
		cr_assert_eq(th_f32_bits(x), u << 16);
		if (!isnan(x))
			cr_assert_eq(kvr_f32_to_bf16(x), u);
	}
	for (uint32_t i = 0; i < 2000000; i++) {
		const float x = interesting_f32(i);
		const uint16_t got = kvr_f32_to_bf16(x);
		if (isnan(x)) {
			cr_assert(isnan(kvr_bf16_to_f32(got)), "NaN lost: %a -> 0x%04x", (double)x, got);
			continue;
		}
		cr_assert_eq(got, ref_f32_to_bf16(x), "%a: got 0x%04x want 0x%04x", (double)x, got,
			     ref_f32_to_bf16(x));
	}
}

/* ---- every vector path equals the scalar one, tails included ---- */

Test(convert, vector_paths_bit_identical)
{
	const size_t n = 4099; /* not a multiple of 8 or 16 */
	uint16_t *h = malloc(n * 2), *back_ref = malloc(n * 2), *back = malloc(n * 2);
	float *f = malloc(n * 4), *ref = malloc(n * 4), *got = malloc(n * 4);
	for (size_t i = 0; i < n; i++)
		f[i] = interesting_f32((uint32_t)i);
	for (uint32_t t = KVR_ELEM_F16; t <= KVR_ELEM_BF16; t++) {
		for (size_t i = 0; i < n; i++)
			h[i] = (uint16_t)rng();
		kvr_convert_isa_force(KVR_CONVERT_SCALAR);
		kvr_convert_to_f32(ref, h, t, n);
		kvr_convert_from_f32(back_ref, f, t, n);
		for (size_t k = 0; k < 3; k++) {
			if (kvr_convert_isa_force(all_isas[k]) != all_isas[k])
				continue; /* not on this CPU */
			kvr_convert_to_f32(got, h, t, n);
			kvr_convert_from_f32(back, f, t, n);
			for (size_t i = 0; i < n; i++) {
				cr_assert_eq(th_f32_bits(got[i]), th_f32_bits(ref[i]),
					     "%s %s to_f32[%zu] of 0x%04x", kvr_convert_isa_name(all_isas[k]),
					     t ? "bf16" : "f16", i, h[i]);
				cr_assert_eq(back[i], back_ref[i], "%s %s from_f32[%zu] of %a",
					     kvr_convert_isa_name(all_isas[k]), t ? "bf16" : "f16", i,
					     (double)f[i]);
			}
		}
	}
	free(h), free(back_ref), free(back), free(f), free(ref), free(got);
}

/* ---- summaries ---- */

static void fill_random(void *dst, uint32_t t, size_t n)
{
	for (size_t i = 0; i < n; i++)
		kvr_store_f32(dst, t, i, ((float)(int32_t)rng() / 2147483648.0f) * 4.0f);
}

static double ref_load(const void *row, uint32_t t, size_t i)
{
	if (t == KVR_ELEM_F32)
		return ((const float *)row)[i];
	const uint16_t u = ((const uint16_t *)row)[i];
	return t == KVR_ELEM_F16 ? (double)ref_f16_to_f32(u) : (double)th_bits_f32((uint32_t)u << 16);
}

Test(convert, summaries_match_reference)
{
	static const uint32_t ps[] = { 16, 32, 64 }, ds[] = { 64, 128 }, hs[] = { 1, 3, 8 };
	for (uint32_t t = KVR_ELEM_F16; t <= KVR_ELEM_F32; t++)
		for (size_t a = 0; a < 3; a++)
			for (size_t b = 0; b < 2; b++)
				for (size_t c = 0; c < 3; c++) {
					struct kvr_page_geometry g;
					cr_assert_eq(kvr_page_geometry_init(&g, ps[a], ds[b], hs[c], t), 0);
					const uint64_t stride = (uint64_t)g.n_kv_heads * g.head_dim;
					const size_t n = g.page_tokens * stride;
					unsigned char *rows = malloc(n * g.elem_bytes);
					unsigned char *mn = malloc(g.head_dim * 4), *mx = malloc(g.head_dim * 4);
					fill_random(rows, t, n);
					for (size_t k = 0; k < 3; k++) {
						if (kvr_convert_isa_force(all_isas[k]) != all_isas[k])
							continue;
						for (uint32_t h = 0; h < g.n_kv_heads; h++) {
							const unsigned char *keys =
								rows + (uint64_t)h * g.head_dim * g.elem_bytes;
							kvr_summarize_keys(&g, keys, stride, mn, mx);
							for (uint32_t d = 0; d < g.head_dim; d++) {
								double rmn = INFINITY, rmx = -INFINITY;
								for (uint32_t p = 0; p < g.page_tokens; p++) {
									double x = ref_load(keys, t, p * stride + d);
									rmn = x < rmn ? x : rmn;
									rmx = x > rmx ? x : rmx;
								}
								cr_assert_eq(ref_load(mn, t, d), rmn,
									     "%s t=%u p=%u d=%u h=%u dim %u min",
									     kvr_convert_isa_name(all_isas[k]), t,
									     g.page_tokens, g.head_dim, h, d);
								cr_assert_eq(ref_load(mx, t, d), rmx, "max");
							}
						}
					}
					free(rows), free(mn), free(mx);
				}
}

Test(convert, summaries_propagate_nan)
{
	struct kvr_page_geometry g;
	cr_assert_eq(kvr_page_geometry_init(&g, 32, 64, 1, KVR_ELEM_F16), 0);
	uint16_t keys[32 * 64], mn[64], mx[64];
	fill_random(keys, KVR_ELEM_F16, 32 * 64);
	keys[7 * 64 + 5] = 0x7e00;   /* NaN in dim 5 */
	keys[31 * 64 + 63] = 0xfc00; /* -inf in dim 63: an ordinary value */
	for (size_t k = 0; k < 3; k++) {
		if (kvr_convert_isa_force(all_isas[k]) != all_isas[k])
			continue;
		kvr_summarize_keys(&g, keys, 64, mn, mx);
		cr_expect(isnan(kvr_f16_to_f32(mn[5])) && isnan(kvr_f16_to_f32(mx[5])), "%s",
			  kvr_convert_isa_name(all_isas[k]));
		cr_expect_eq(mn[63], 0xfc00);
		cr_expect(!isnan(kvr_f16_to_f32(mn[4])) && !isnan(kvr_f16_to_f32(mx[6])));
	}
}

/* ---- streaming copies ---- */

#include "copy.h"

Test(convert, streaming_copy_is_exact)
{
	static const size_t sizes[] = { 0, 64, 256, 1000, 1024, 4096, 8192, 16384, 16384 + 256, 65536 };
	unsigned char *src = aligned_alloc(64, 70016), *dst = aligned_alloc(64, 70016);
	for (size_t i = 0; i < 70000; i++)
		src[i] = (unsigned char)rng();
	for (size_t k = 0; k < 3; k++) {
		if (kvr_convert_isa_force(all_isas[k]) != all_isas[k])
			continue;
		for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++)
			for (size_t mis = 0; mis < 2; mis++) { /* aligned, and 1-byte misaligned */
				memset(dst, 0xee, 70000);
				kvr_copy_stream(dst + mis, src + mis, sizes[s], src + 4096);
				cr_assert_eq(memcmp(dst + mis, src + mis, sizes[s]), 0, "%s size %zu +%zu",
					     kvr_convert_isa_name(all_isas[k]), sizes[s], mis);
				cr_assert_eq(dst[mis + sizes[s]], 0xee, "wrote past the end");
				if (mis)
					cr_assert_eq(dst[0], 0xee, "wrote before the start");
			}
		const void *srcs[5] = { src + 16384, src, src + 49152, src + 8192, src + 32768 };
		kvr_copy_stream_gather(dst, srcs, 5, 8192);
		for (size_t i = 0; i < 5; i++)
			cr_assert_eq(memcmp(dst + i * 8192, srcs[i], 8192), 0, "run %zu", i);
	}
	free(src), free(dst);
}

/* Signed zeros and NaNs are where min/max operand order shows: every ISA must
 * give the scalar path's bits exactly (the test above compares values, for
 * which -0 == +0). */
Test(convert, summaries_bitwise_across_isas)
{
	struct kvr_page_geometry g;
	static const uint16_t specials[] = { 0x0000, 0x8000, 0x7e00, 0x7c00, 0xfc00, 0x3c00, 0xbc00 };
	for (uint32_t t = KVR_ELEM_F16; t <= KVR_ELEM_F32; t++) {
		cr_assert_eq(kvr_page_geometry_init(&g, 16, 64, 1, t), 0);
		unsigned char keys[16 * 64 * 4], ref_mn[64 * 4], ref_mx[64 * 4], mn[64 * 4], mx[64 * 4];
		for (int trial = 0; trial < 200; trial++) {
			for (size_t i = 0; i < 16 * 64; i++) {
				/* zeros only, zeros and NaN, or everything */
				const uint32_t n_specials = trial % 3 == 0 ? 2 : trial % 3 == 1 ? 3 : 7;
				const float x = kvr_f16_to_f32(specials[rng() % n_specials]);
				kvr_store_f32(keys, t, i, x);
			}
			kvr_convert_isa_force(KVR_CONVERT_SCALAR);
			kvr_summarize_keys(&g, keys, 64, ref_mn, ref_mx);
			for (size_t k = 1; k < 3; k++) {
				if (kvr_convert_isa_force(all_isas[k]) != all_isas[k])
					continue;
				kvr_summarize_keys(&g, keys, 64, mn, mx);
				cr_assert_eq(memcmp(mn, ref_mn, 64 * g.elem_bytes), 0, "%s min, type %u",
					     kvr_convert_isa_name(all_isas[k]), t);
				cr_assert_eq(memcmp(mx, ref_mx, 64 * g.elem_bytes), 0, "%s max, type %u",
					     kvr_convert_isa_name(all_isas[k]), t);
			}
		}
	}
}
