/* SPDX-License-Identifier: MIT */
/*
 * test_layouts.c — page geometry and the HND/NHD index arithmetic: every
 * (head, K/V, token, dim) maps to a distinct index inside the page, one KV
 * head's K+V is one contiguous run, and a slot's rows are strided by n_kv·d.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "page.h"

Test(layouts, geometry_sizes)
{
	struct kvr_page_geometry g;
	cr_assert_eq(kvr_page_geometry_init(&g, 32, 128, 8, KVR_ELEM_F16), 0);
	cr_expect_eq(g.head_bytes, 16384u, "docs/design.md, Glossary: 16 KiB at p=32, d=128, f16");
	cr_expect_eq(g.page_bytes, 8u * 16384u);
	cr_assert_eq(kvr_page_geometry_init(&g, 32, 64, 3, KVR_ELEM_BF16), 0);
	cr_expect_eq(g.head_bytes, 8192u, "8 KiB for d=64");
	cr_assert_eq(kvr_page_geometry_init(&g, 16, 64, 1, KVR_ELEM_F32), 0);
	cr_expect_eq(g.elem_bytes, 4u);
	cr_expect_eq(kvr_page_geometry_init(&g, 16, 64, 1, 7), -1);
	cr_expect_eq(kvr_page_geometry_init(&g, 0, 64, 1, KVR_ELEM_F16), -1);
}

Test(layouts, hnd_and_nhd_are_bijections)
{
	static const uint32_t ps[] = { 16, 32 }, ds[] = { 64, 128 }, hs[] = { 1, 3, 8 };
	for (size_t a = 0; a < 2; a++)
		for (size_t b = 0; b < 2; b++)
			for (size_t c = 0; c < 3; c++) {
				struct kvr_page_geometry g;
				cr_assert_eq(kvr_page_geometry_init(&g, ps[a], ds[b], hs[c],
								     KVR_ELEM_F16),
					     0);
				const uint64_t n = (uint64_t)2 * g.page_tokens * g.head_dim * g.n_kv_heads;
				unsigned char *seen_hnd = calloc(n, 1), *seen_nhd = calloc(n, 1);
				for (uint32_t h = 0; h < g.n_kv_heads; h++)
					for (uint32_t kv = 0; kv < 2; kv++)
						for (uint32_t t = 0; t < g.page_tokens; t++)
							for (uint32_t d = 0; d < g.head_dim; d++) {
								uint64_t i = kvr_hnd_index(&g, h, kv, t, d);
								cr_assert_lt(i, n);
								cr_assert_eq(seen_hnd[i], 0);
								seen_hnd[i] = 1;
								/* K and V tiles are separate in NHD */
								uint64_t j = kv * (n / 2) +
									     kvr_nhd_index(&g, t, h, d);
								cr_assert_lt(j, n);
								cr_assert_eq(seen_nhd[j], 0);
								seen_nhd[j] = 1;
							}
				free(seen_hnd);
				free(seen_nhd);
			}
}

Test(layouts, hnd_head_is_contiguous_and_slot_is_strided)
{
	struct kvr_page_geometry g;
	cr_assert_eq(kvr_page_geometry_init(&g, 32, 128, 8, KVR_ELEM_F16), 0);
	for (uint32_t h = 0; h < g.n_kv_heads; h++) {
		uint64_t first = kvr_hnd_index(&g, h, KVR_KEYS, 0, 0);
		uint64_t last = kvr_hnd_index(&g, h, KVR_VALUES, g.page_tokens - 1, g.head_dim - 1);
		cr_expect_eq(first * g.elem_bytes, h * g.head_bytes);
		cr_expect_eq((last + 1 - first) * g.elem_bytes, g.head_bytes);
		cr_expect_eq(kvr_nhd_index(&g, 1, h, 0) - kvr_nhd_index(&g, 0, h, 0),
			     (uint64_t)g.n_kv_heads * g.head_dim);
	}
}
