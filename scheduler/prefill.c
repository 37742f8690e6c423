/* SPDX-License-Identifier: MIT */
/*
 * prefill.c — prefill attention: the queries of a chunk of new tokens attend
 * causally over every stored token of their sequence (pool pages and the
 * tail), through the attention kernel's segments, in blocks of queries
 * that share each page read (KVR_SHAPE_CAUSAL) on every backend.
 *
 * Threads: the engine's thread, outside an open decode step.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "sched_impl.h"

/* The pages of the prefix up to position `last` for KV head m, in token order
 * from token 0 (pool pages, the page holding `last` cut after it, or the
 * tail), appended to segs. */
static uint32_t prefix_segments(struct kvr_sched *s, struct kvr_lane *plane, uint32_t seq, uint32_t layer,
				uint64_t last, uint32_t n_full, uint32_t m, struct kvr_kv_segment *segs, int *pin_err)
{
	const uint32_t p = s->c.page_tokens, n_kv = s->c.n_kv_heads, d = s->c.head_dim;
	const uint32_t whole = (uint32_t)((last + 1) / p), rest = (uint32_t)((last + 1) % p);
	uint32_t n = 0;
	for (uint32_t j = 0; j < whole; j++)
		segs[n++] = kvr_sched_pool_segment(s, plane, j, m, 0, pin_err);
	if (rest && whole < n_full) {
		/* the page holding last is already in the pool: its first rows */
		segs[n] = kvr_sched_pool_segment(s, plane, whole, m, 0, pin_err);
		segs[n++].n_tokens = rest;
	} else if (rest) {
		const unsigned char *kt = s->tails[seq] + (uint64_t)layer * 2 * s->tile_bytes + (uint64_t)m * d * s->eb;
		segs[n++] = (struct kvr_kv_segment){ kt, kt + s->tile_bytes, rest, { n_kv * d }, 0, 0 };
	}
	return n;
}

/* Pins (spill tier) every page up to position `last`, which must then fit in
 * RAM together; the segments built after it do not pin again. */
static int pin_prefix(struct kvr_sched *s, uint32_t seq, uint32_t layer, uint64_t last, uint32_t n_full)
{
	const uint32_t p = s->c.page_tokens;
	const uint32_t need = (uint32_t)((last + 1) / p) + ((last + 1) % p && (last + 1) / p < n_full);
	for (uint32_t j = 0; j < need; j++) {
		uint32_t id = 0;
		kvr_pool_lookup(s->pool, seq, layer, j, &id);
		const int err = kvr_sched_pin_in_place(s, id);
		if (err) {
			snprintf(s->last_error, sizeof(s->last_error),
				 "prefill attention of sequence %u layer %u: page %u of %u: %s", seq, layer, j, need,
				 kvr_pool_last_error(s->pool));
			kvr_sched_unpin_step(s);
			return err;
		}
	}
	s->eng.suppress_segment_pins = 1;
	return 0;
}

/* The items and segments to the device (the layer's mirror), then the
 * attention kernel on them, queued on st. */
static int mirror_and_attend(struct kvr_sched *s, struct layer_scratch *ls, const struct kvr_shape *shape,
			     const struct kvr_attention_item *items, uint32_t n_items,
			     const struct kvr_kv_segment *segs, uint32_t n_segs, struct kvr_stream *st)
{
	int err = kvr_mirror_to_device(s->dev, &ls->m, items, n_items * sizeof(*items), st);
	if (!err)
		err = kvr_mirror_to_device(s->dev, &ls->m, segs, n_segs * sizeof(*segs), st);
	if (!err)
		err = kvr_dev_attention(s->dev, shape, kvr_mirror_dev_at(&ls->m, items), n_items,
					kvr_mirror_dev_at(&ls->m, segs), n_segs, st);
	return err;
}

/*
 * Blocks of query tokens (at most KVR_MAX_GROUP / G, a multiple of 8 from 16
 * up, so the cpu kernel's vectors of heads are whole), one item per (block,
 * KV head) whose n_q·G query heads (the block's queries, gathered head by
 * head) attend causally (KVR_SHAPE_CAUSAL) over the prefix's pages. Each page
 * is read once per block instead of once per query: the O(L²) bytes of
 * per-query items become O(L²/block), and on the cpu the kernel runs from
 * cache. Up to PREFILL_BLOCKS_PER_CALL whole blocks share a call
 * (causal_items_per_block), so a call has items enough for every cpu thread
 * (and GPU blocks enough) without splitting an item. The rows are gathered on
 * the host and reach the kernels through the device's stages (nothing to copy
 * where the device addresses host memory).
 */
#define PREFILL_BLOCKS_PER_CALL 4u

int kvr_sched_prefill_attention(struct kvr_sched *s, uint32_t seq, uint32_t layer,
				uint64_t first_position, uint32_t n_tokens, const void *q, void *out)
{
	const uint32_t p = s->c.page_tokens, n_kv = s->c.n_kv_heads, G = s->G;
	uint64_t have = 0;
	kvr_pool_n_tokens(s->pool, seq, layer, &have);
	const uint32_t n_full = (uint32_t)(have / p);
	const uint32_t most = KVR_MAX_GROUP / G, block = most >= 16 ? most / 8 * 8 : most;
	const uint32_t max_items = PREFILL_BLOCKS_PER_CALL * n_kv;
	const uint64_t group_bytes = (uint64_t)G * s->c.head_dim * s->eb; /* one token's heads of one KV head */
	const uint64_t head_block_bytes = block * group_bytes;
	const size_t rows_bytes = (size_t)max_items * head_block_bytes;
	const uint64_t max_segs = (first_position + n_tokens) / p + 1;
	struct layer_scratch *ls = &s->eng.scratch[layer];
	struct kvr_lane *plane = lane_of(s, seq, layer);
	const size_t items_bytes = ((size_t)max_items * sizeof(struct kvr_attention_item) + 63) & ~(size_t)63;
	const size_t scratch_bytes = items_bytes + (size_t)max_items * max_segs * sizeof(struct kvr_kv_segment);
	if (kvr_mirror_grow(s->dev, &ls->m, scratch_bytes) ||
	    kvr_mapped_grow(s->dev, &s->eng.prefill_rows, &s->eng.prefill_rows_bytes, 2 * rows_bytes) ||
	    kvr_stage_grow(s->dev, &s->eng.prefill_q, &s->eng.prefill_q_bytes, rows_bytes) ||
	    kvr_stage_grow(s->dev, &s->eng.prefill_out, &s->eng.prefill_out_bytes, rows_bytes)) {
		snprintf(s->last_error, sizeof(s->last_error), "out of memory for prefill attention");
		return -ENOMEM;
	}
	/* the gathered rows on the host: queries, then outputs; item k·n_kv + m
	 * (block k, KV head m) at (k·n_kv + m)·head_block_bytes */
	unsigned char *qg = s->eng.prefill_rows, *og = qg + rows_bytes;
	struct kvr_attention_item *items = ls->m.host;
	struct kvr_kv_segment *segs = (void *)((unsigned char *)ls->m.host + items_bytes);
	struct kvr_stream *st = s->engine_inline;
	for (uint32_t at = 0; at < n_tokens;) {
		/* whole blocks, several per call; a last partial one alone (a call's
		 * items have one size) */
		const uint32_t whole = (n_tokens - at) / block;
		const uint32_t n_blocks = whole ? (whole < PREFILL_BLOCKS_PER_CALL ? whole : PREFILL_BLOCKS_PER_CALL) : 1;
		const uint32_t n_q = whole ? block : n_tokens - at;
		const uint32_t n_items = n_blocks * n_kv;
		for (uint32_t k = 0; k < n_blocks; k++)
			for (uint32_t t = 0; t < n_q; t++)
				for (uint32_t m = 0; m < n_kv; m++)
					memcpy(qg + (k * n_kv + m) * head_block_bytes + t * group_bytes,
					       (const unsigned char *)q + (uint64_t)(at + k * n_q + t) * s->q_row +
						       m * group_bytes,
					       group_bytes);
		const size_t call_bytes = (size_t)n_items * head_block_bytes;
		const void *q_view = NULL;
		int err = kvr_stage_in(s->dev, s->eng.prefill_q, qg, call_bytes, st, &q_view);
		unsigned char *o_view = kvr_stage_out_view(s->dev, s->eng.prefill_out, og);
		/* spill tier: the call's pages, each pinned once */
		int pin_err = !err && s->spill
				      ? pin_prefix(s, seq, layer, first_position + at + n_blocks * n_q - 1, n_full)
				      : 0;
		if (pin_err)
			return pin_err;
		uint32_t n_segs = 0;
		for (uint32_t k = 0; !err && k < n_blocks; k++) {
			const uint64_t last = first_position + at + (k + 1) * n_q - 1; /* the block's last query */
			for (uint32_t m = 0; m < n_kv; m++) {
				const uint32_t first = n_segs, x = k * n_kv + m;
				n_segs += prefix_segments(s, plane, seq, layer, last, n_full, m, segs + n_segs, &pin_err);
				items[x] = (struct kvr_attention_item){ (const unsigned char *)q_view + x * head_block_bytes,
									o_view + x * head_block_bytes, NULL, first,
									n_segs - first };
			}
		}
		s->eng.suppress_segment_pins = 0;
		struct kvr_shape shape = s->head_shape;
		shape.n_qo_heads = n_q * G;
		shape.flags = KVR_SHAPE_CAUSAL;
		shape.causal_heads_per_query = G;
		shape.causal_items_per_block = n_kv;
		shape.causal_first_position = first_position + at;
		if (!err)
			err = mirror_and_attend(s, ls, &shape, items, n_items, segs, n_segs, st);
		if (!err)
			err = kvr_stage_out(s->dev, og, o_view, call_bytes, st);
		/* the next call rewrites the items (and the stages); with a spill
		 * tier, the pages it pinned are released after it */
		if (!err)
			err = kvr_dev_stream_synchronize(s->dev, st);
		kvr_sched_unpin_step(s);
		if (err) {
			snprintf(s->last_error, sizeof(s->last_error), "%s", kvr_dev_last_error(s->dev));
			return err;
		}
		for (uint32_t k = 0; k < n_blocks; k++)
			for (uint32_t t = 0; t < n_q; t++)
				for (uint32_t m = 0; m < n_kv; m++)
					memcpy((unsigned char *)out + (uint64_t)(at + k * n_q + t) * s->q_row +
						       m * group_bytes,
					       og + (k * n_kv + m) * head_block_bytes + t * group_bytes, group_bytes);
		at += n_blocks * n_q;
	}
	return 0;
}
