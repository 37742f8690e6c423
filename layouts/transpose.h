/* SPDX-License-Identifier: MIT */
/*
 * transpose.h — the two layout conversions of a page, as row copies:
 *  - offload: NHD rows (what the QKV projection produces, [p][n_kv][d] for K and
 *    for V) -> one HND page ([n_kv][2][p][d]);
 *  - recall: one KV head's HND run (2·p·d contiguous elements) -> that head's
 *    slot in an NHD tile pair (rows strided by n_kv·d).
 * Also the NHD-layout pool's page format ([2][p][n_kv][d]), kept for the
 * ablation that shows what HND buys: gathering one head from it takes 2·p row
 * copies instead of one.
 *
 * Byte copies only, so every element type (and the quantised formats' packed
 * rows) go through the same code. The CUDA kernels use the per-element index
 * functions of page.h instead of these loops.
 */
#ifndef KVR_LAYOUTS_TRANSPOSE_H
#define KVR_LAYOUTS_TRANSPOSE_H

#include <stdint.h>
#include <string.h>

#include "page.h"

/* Offload. k_rows/v_rows: p rows, row t starting row_stride elements after row
 * t-1 (n_kv·d for a dense NHD tile), each row holding n_kv heads of d elements. */
static inline void kvr_nhd_rows_to_hnd_page(const struct kvr_page_geometry *g, const void *k_rows,
					    const void *v_rows, uint64_t row_stride, void *hnd_page)
{
	const uint64_t eb = g->elem_bytes, row_bytes = (uint64_t)g->head_dim * eb;
	unsigned char *dst = (unsigned char *)hnd_page;
	for (uint32_t h = 0; h < g->n_kv_heads; h++)
		for (uint32_t half = 0; half < 2; half++) {
			const unsigned char *src = (const unsigned char *)(half ? v_rows : k_rows) +
						   (uint64_t)h * g->head_dim * eb;
			for (uint32_t t = 0; t < g->page_tokens; t++, dst += row_bytes)
				memcpy(dst, src + t * row_stride * eb, row_bytes);
		}
}

/* Recall. hnd_run: one KV head's K then V (2·p·d elements). k_tile/v_tile: NHD
 * tiles of p rows of n_kv·d elements; writes column kv_head only. */
static inline void kvr_hnd_run_to_nhd_slot(const struct kvr_page_geometry *g, const void *hnd_run,
					   void *k_tile, void *v_tile, uint32_t kv_head)
{
	const uint64_t eb = g->elem_bytes, row_bytes = (uint64_t)g->head_dim * eb;
	const uint64_t tile_row = (uint64_t)g->n_kv_heads * row_bytes;
	const unsigned char *src = (const unsigned char *)hnd_run;
	for (uint32_t half = 0; half < 2; half++) {
		unsigned char *dst = (unsigned char *)(half ? v_tile : k_tile) + kv_head * row_bytes;
		for (uint32_t t = 0; t < g->page_tokens; t++, src += row_bytes)
			memcpy(dst + t * tile_row, src, row_bytes);
	}
}

/* Reverse of the recall: a slot of an NHD tile pair -> an HND run (tests and
 * the device-side offload of a full tail page use it). */
static inline void kvr_nhd_slot_to_hnd_run(const struct kvr_page_geometry *g, const void *k_tile,
					   const void *v_tile, uint32_t kv_head, void *hnd_run)
{
	const uint64_t eb = g->elem_bytes, row_bytes = (uint64_t)g->head_dim * eb;
	const uint64_t tile_row = (uint64_t)g->n_kv_heads * row_bytes;
	unsigned char *dst = (unsigned char *)hnd_run;
	for (uint32_t half = 0; half < 2; half++) {
		const unsigned char *src =
			(const unsigned char *)(half ? v_tile : k_tile) + kv_head * row_bytes;
		for (uint32_t t = 0; t < g->page_tokens; t++, dst += row_bytes)
			memcpy(dst, src + t * tile_row, row_bytes);
	}
}

/* NHD-layout pool page: the K tile then the V tile, [2][p][n_kv][d]. */
static inline void kvr_nhd_rows_to_nhd_page(const struct kvr_page_geometry *g, const void *k_rows,
					    const void *v_rows, uint64_t row_stride, void *nhd_page)
{
	const uint64_t eb = g->elem_bytes, tile_row = (uint64_t)g->n_kv_heads * g->head_dim * eb;
	unsigned char *dst = (unsigned char *)nhd_page;
	for (uint32_t half = 0; half < 2; half++) {
		const unsigned char *src = (const unsigned char *)(half ? v_rows : k_rows);
		for (uint32_t t = 0; t < g->page_tokens; t++, dst += tile_row)
			memcpy(dst, src + t * row_stride * eb, tile_row);
	}
}

/* Gather one KV head from an NHD-layout pool page into an HND run: 2·p copies
 * of d elements (the "fragmented" transfer FreeKV's HND layout removes). */
static inline void kvr_nhd_page_head_to_hnd_run(const struct kvr_page_geometry *g,
						const void *nhd_page, uint32_t kv_head, void *hnd_run)
{
	const uint64_t tile_bytes = g->page_bytes / 2;
	kvr_nhd_slot_to_hnd_run(g, nhd_page, (const unsigned char *)nhd_page + tile_bytes, kv_head,
				hnd_run);
}

#endif /* KVR_LAYOUTS_TRANSPOSE_H */
