/* SPDX-License-Identifier: MIT */
/*
 * summary.h — page summaries. For each KV head of a page: the element-wise
 * min and max of its p keys (the key bounds: Quest's bound, FreeKV's
 * selection input) and, where the context keeps estimates, the mean key and
 * the mean value (the estimate rows: the attention of a page not retrieved
 * is estimated as p tokens of that key and value, RetroInfer's idea on
 * kvrecall's pages). One page's summary, in the page's element type:
 *
 *   [n_kv][2][d] key bounds (min row, then max row, per KV head)
 *   [n_kv][2][d] estimate rows (mean key, then mean value), only with
 *                estimates
 *
 * so the bounds sit where they sit without estimates, and a page's summary
 * is 1/p (2/p with estimates) of its keys and values. Selection reads the
 * bounds block; attention's estimate reads the estimate rows of the pages
 * it did not select (kernels.h, KVR_KV_ESTIMATE), one KV head's rows
 * kvr_summary_page_elems apart from page to page.
 *
 * The scalar per-element steps here are shared by the cpu summariser
 * (convert.c) and the CUDA kernel. NaN propagates: a NaN key makes both
 * bounds (and its mean) NaN for that dimension, so a corrupt page is visible
 * rather than silently ignored. Means are summed in fp32 in token order from
 * token 0's value (not from 0.0, so a column of -0.0 stays -0.0), then
 * divided by p: the cpu and CUDA summarisers write the same bits.
 */
#ifndef KVR_LAYOUTS_SUMMARY_H
#define KVR_LAYOUTS_SUMMARY_H

#include <stdint.h>

#include "half.h"
#include "page.h"

/* Rows of a KV head's summary (kvr_summary_index's `which`). */
enum kvr_summary_row {
	KVR_SUMMARY_MIN = 0,
	KVR_SUMMARY_MAX = 1,
	KVR_SUMMARY_KEY_MEAN = 2,   /* with estimates only */
	KVR_SUMMARY_VALUE_MEAN = 3, /* with estimates only */
};

/* Element index of (KV head, row, dim) inside one page's summary. */
static inline KVR_HD uint64_t kvr_summary_index(const struct kvr_page_geometry *g,
						uint32_t kv_head, uint32_t which, uint32_t dim)
{
	const uint64_t block = which >= KVR_SUMMARY_KEY_MEAN ? (uint64_t)g->n_kv_heads * 2u * g->head_dim : 0;
	return block + ((uint64_t)kv_head * 2u + (which & 1u)) * g->head_dim + dim;
}

/* Elements of one page's summary (all KV heads): the distance between two
 * pages' rows in a table of summaries. */
static inline KVR_HD uint64_t kvr_summary_page_elems(uint32_t n_kv_heads, uint32_t head_dim,
						     int estimates)
{
	return (estimates ? 4ull : 2ull) * n_kv_heads * head_dim;
}

/* Bytes of one page's summary (all KV heads). */
static inline KVR_HD uint64_t kvr_summary_bytes(const struct kvr_page_geometry *g, int estimates)
{
	return kvr_summary_page_elems(g->n_kv_heads, g->head_dim, estimates) * g->elem_bytes;
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

/* The mean of a column summed in token order (sum starts at token 0's
 * value): p is a power of two, so the division is exact scaling. */
static inline KVR_HD float kvr_summary_mean(float sum, uint32_t page_tokens)
{
	return sum / (float)page_tokens;
}

#endif /* KVR_LAYOUTS_SUMMARY_H */
