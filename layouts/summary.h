/* SPDX-License-Identifier: MIT */
/*
 * summary.h — page summaries: for each KV head of a page, the element-wise min
 * and max of its p keys (Quest's bound, FreeKV's selection input). The summary
 * of one page is [n_kv][2][d] elements of the page's element type (min then
 * max), so reading all summaries costs 1/p of reading all keys and values.
 *
 * The scalar per-element step here is shared by the cpu summariser (convert.c)
 * and the CUDA kernel. NaN propagates: a NaN key makes both bounds NaN for that
 * dimension, so a corrupt page is visible rather than silently ignored.
 */
#ifndef KVR_LAYOUTS_SUMMARY_H
#define KVR_LAYOUTS_SUMMARY_H

#include <stdint.h>

#include "half.h"
#include "page.h"

/* Element index of (KV head, min=0 / max=1, dim) inside one page's summary. */
static inline KVR_HD uint64_t kvr_summary_index(const struct kvr_page_geometry *g,
						uint32_t kv_head, uint32_t which, uint32_t dim)
{
	return ((uint64_t)kv_head * 2u + which) * g->head_dim + dim;
}

/* Bytes of one page's summary (all KV heads). */
static inline KVR_HD uint64_t kvr_summary_bytes(const struct kvr_page_geometry *g)
{
	return 2ull * g->n_kv_heads * g->head_dim * g->elem_bytes;
}

/* One step of the min/max fold, NaN-propagating. */
static inline KVR_HD void kvr_minmax_step(float x, float *mn, float *mx)
{
	if (x != x) {
		*mn = x;
		*mx = x;
		return;
	}
	if (x < *mn)
		*mn = x;
	if (x > *mx)
		*mx = x;
}

#endif /* KVR_LAYOUTS_SUMMARY_H */
