/* SPDX-License-Identifier: MIT */
/*
 * page.h — page formats and the index arithmetic of the two KV layouts.
 *
 * HND (host pool): one layer's page is [n_kv][2][p][d]: per KV head its p keys
 * then its p values, one contiguous run of 2·p·d elements, so recalling one KV
 * head's page is one copy. NHD (device): [p][n_kv][d] for K and for V, the layout
 * the QKV projection produces; a *slot* is one KV head's column of an NHD tile,
 * rows strided by n_kv·d.
 *
 * The structs here are shared by C and CUDA code: their size and field offsets
 * are checked to be equal under both compilers (tests/test_layout_abi.c), so
 * they use fixed-width fields only and explicit padding.
 */
#ifndef KVR_LAYOUTS_PAGE_H
#define KVR_LAYOUTS_PAGE_H

#include <stdint.h>

#include "hd.h"

/* Element types; the values equal enum kvr_dtype of the public header. */
enum kvr_elem_type {
	KVR_ELEM_F16 = 0,
	KVR_ELEM_BF16 = 1,
	KVR_ELEM_F32 = 2,
};

/* Which half of a KV head's HND run. */
enum kvr_kv_half {
	KVR_KEYS = 0,
	KVR_VALUES = 1,
};

/* Geometry of one layer's page; everything the index functions need. */
struct kvr_page_geometry {
	uint32_t page_tokens; /* p, tokens per page */
	uint32_t head_dim;    /* d, elements per head vector */
	uint32_t n_kv_heads;  /* KV heads per layer */
	uint32_t elem_type;   /* enum kvr_elem_type */
	uint32_t elem_bytes;  /* bytes per element */
	uint32_t reserved;    /* zero; keeps the 64-bit fields aligned in both languages */
	uint64_t head_bytes;  /* bytes of one KV head's K+V in HND: 2·p·d·elem_bytes */
	uint64_t page_bytes;  /* bytes of the whole HND page: n_kv_heads·head_bytes */
};

/* One entry of a batched copy: bytes from src_base + src_offset to dst_base + dst_offset. */
struct kvr_copy_desc {
	uint64_t src_offset; /* bytes */
	uint64_t dst_offset; /* bytes */
	uint64_t bytes;      /* bytes to copy */
};

static inline KVR_HD uint32_t kvr_elem_bytes(uint32_t elem_type)
{
	return elem_type == KVR_ELEM_F32 ? 4u : (elem_type <= KVR_ELEM_BF16 ? 2u : 0u);
}

/* Fill *g; returns 0, or -1 for an unknown element type or a zero dimension. */
static inline KVR_HD int kvr_page_geometry_init(struct kvr_page_geometry *g, uint32_t page_tokens,
						uint32_t head_dim, uint32_t n_kv_heads,
						uint32_t elem_type)
{
	const struct kvr_page_geometry zero = { 0, 0, 0, 0, 0, 0, 0, 0 };
	const uint32_t eb = kvr_elem_bytes(elem_type);
	*g = zero; /* fully written even on failure */
	if (!eb || !page_tokens || !head_dim || !n_kv_heads)
		return -1;
	g->page_tokens = page_tokens;
	g->head_dim = head_dim;
	g->n_kv_heads = n_kv_heads;
	g->elem_type = elem_type;
	g->elem_bytes = eb;
	g->reserved = 0;
	g->head_bytes = 2ull * page_tokens * head_dim * eb;
	g->page_bytes = g->head_bytes * n_kv_heads;
	return 0;
}

/* Element index inside an HND page of (KV head, K or V, token, dim). */
static inline KVR_HD uint64_t kvr_hnd_index(const struct kvr_page_geometry *g, uint32_t kv_head,
					    uint32_t half, uint32_t token, uint32_t dim)
{
	return (((uint64_t)kv_head * 2u + half) * g->page_tokens + token) * g->head_dim + dim;
}

/* Element index inside an NHD tile (of K or of V) of (token, KV head, dim). */
static inline KVR_HD uint64_t kvr_nhd_index(const struct kvr_page_geometry *g, uint32_t token,
					    uint32_t kv_head, uint32_t dim)
{
	return ((uint64_t)token * g->n_kv_heads + kv_head) * g->head_dim + dim;
}

#endif /* KVR_LAYOUTS_PAGE_H */
