/* SPDX-License-Identifier: MIT */
/*
 * prefill.c — prefill attention: the queries of a chunk of new tokens attend
 * causally over every stored token of their sequence (pool pages and the
 * tail), through the attention kernel's segments: on the cpu backend in
 * blocks of queries that share each page read (KVR_SHAPE_CAUSAL), elsewhere
 * one item per query.
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
 * The cpu backend: blocks of up to KVR_MAX_GROUP / G query tokens, one item
 * per KV head whose n_q·G query heads (the block's queries, gathered head by
 * head) attend causally (KVR_SHAPE_CAUSAL) over the prefix's pages. Each page
 * is read once per block instead of once per query: the O(L²) bytes of the
 * per-query items become O(L²/block), and the kernel runs from cache.
 */
static int prefill_query_blocks(struct kvr_sched *s, uint32_t seq, uint32_t layer, uint64_t first_position,
				uint32_t n_tokens, const void *q, void *out)
{
	const uint32_t p = s->c.page_tokens, n_kv = s->c.n_kv_heads, G = s->G;
	uint64_t have = 0;
	kvr_pool_n_tokens(s->pool, seq, layer, &have);
	const uint32_t n_full = (uint32_t)(have / p);
	const uint32_t block = KVR_MAX_GROUP / G;
	const uint64_t group_bytes = (uint64_t)G * s->c.head_dim * s->eb; /* one token's heads of one KV head */
	const uint64_t head_block_bytes = block * group_bytes;
	const uint64_t max_segs = (first_position + n_tokens) / p + 1;
	struct layer_scratch *ls = &s->eng.scratch[layer];
	struct kvr_lane *plane = lane_of(s, seq, layer);
	const size_t items_bytes = ((size_t)n_kv * sizeof(struct kvr_attention_item) + 63) & ~(size_t)63;
	const size_t scratch_bytes = items_bytes + (size_t)n_kv * max_segs * sizeof(struct kvr_kv_segment);
	if (kvr_mirror_grow(s->dev, &ls->m, scratch_bytes) ||
	    kvr_scratch_grow(s->dev, &s->eng.prefill_q, &s->eng.prefill_q_bytes, n_kv * head_block_bytes) ||
	    kvr_scratch_grow(s->dev, &s->eng.prefill_out, &s->eng.prefill_out_bytes, n_kv * head_block_bytes)) {
		snprintf(s->last_error, sizeof(s->last_error), "out of memory for prefill attention");
		return -ENOMEM;
	}
	/* the gathered rows, in the stages (allocated even where the device is
	 * host-visible: cpu device memory is host memory, and freed as stages) */
	unsigned char *qg = s->eng.prefill_q, *og = s->eng.prefill_out;
	struct kvr_attention_item *items = ls->m.host;
	struct kvr_kv_segment *segs = (void *)((unsigned char *)ls->m.host + items_bytes);
	struct kvr_stream *st = s->engine_inline;
	for (uint32_t at = 0; at < n_tokens; at += block) {
		const uint32_t n_q = n_tokens - at < block ? n_tokens - at : block;
		const uint64_t last = first_position + at + n_q - 1;
		for (uint32_t t = 0; t < n_q; t++)
			for (uint32_t m = 0; m < n_kv; m++)
				memcpy(qg + m * head_block_bytes + t * group_bytes,
				       (const unsigned char *)q + (uint64_t)(at + t) * s->q_row + m * group_bytes,
				       group_bytes);
		int pin_err = s->spill ? pin_prefix(s, seq, layer, last, n_full) : 0;
		if (pin_err)
			return pin_err;
		uint32_t n_segs = 0;
		for (uint32_t m = 0; m < n_kv; m++) {
			const uint32_t first = n_segs;
			n_segs += prefix_segments(s, plane, seq, layer, last, n_full, m, segs + n_segs, &pin_err);
			items[m] = (struct kvr_attention_item){ qg + m * head_block_bytes, og + m * head_block_bytes,
								NULL, first, n_segs - first };
		}
		s->eng.suppress_segment_pins = 0;
		struct kvr_shape shape = s->head_shape;
		shape.n_qo_heads = n_q * G;
		shape.flags = KVR_SHAPE_CAUSAL;
		shape.causal_heads_per_query = G;
		shape.causal_first_position = first_position + at;
		int err = mirror_and_attend(s, ls, &shape, items, n_kv, segs, n_segs, st);
		if (!err)
			err = kvr_dev_stream_synchronize(s->dev, st);
		kvr_sched_unpin_step(s);
		if (err) {
			snprintf(s->last_error, sizeof(s->last_error), "%s", kvr_dev_last_error(s->dev));
			return err;
		}
		for (uint32_t t = 0; t < n_q; t++)
			for (uint32_t m = 0; m < n_kv; m++)
				memcpy((unsigned char *)out + (uint64_t)(at + t) * s->q_row + m * group_bytes,
				       og + m * head_block_bytes + t * group_bytes, group_bytes);
	}
	return 0;
}

int kvr_sched_prefill_attention(struct kvr_sched *s, uint32_t seq, uint32_t layer,
				uint64_t first_position, uint32_t n_tokens, const void *q, void *out)
{
	if (kvr_dev_kind_of(s->dev) == KVR_DEV_CPU)
		return prefill_query_blocks(s, seq, layer, first_position, n_tokens, q, out);

	const uint32_t p = s->c.page_tokens, n_kv = s->c.n_kv_heads, d = s->c.head_dim;
	uint64_t have = 0;
	kvr_pool_n_tokens(s->pool, seq, layer, &have);
	const uint32_t n_full = (uint32_t)(have / p);
	const uint64_t head_q_bytes = (uint64_t)s->G * d * s->eb;
	/* queries in groups, so the segment lists stay a few MiB at long contexts */
	const uint32_t group = 32;
	const uint64_t max_segs = (first_position + n_tokens) / p + 1;
	struct layer_scratch *ls = &s->eng.scratch[layer];
	struct kvr_lane *plane = lane_of(s, seq, layer);
	const size_t items_bytes = ((size_t)group * n_kv * sizeof(struct kvr_attention_item) + 63) & ~(size_t)63;
	const size_t rows_bytes = (size_t)group * s->q_row;
	const size_t scratch_bytes = items_bytes + (size_t)group * n_kv * max_segs * sizeof(struct kvr_kv_segment);
	if (kvr_mirror_grow(s->dev, &ls->m, scratch_bytes) ||
	    kvr_stage_grow(s->dev, &s->eng.prefill_q, &s->eng.prefill_q_bytes, rows_bytes) ||
	    kvr_stage_grow(s->dev, &s->eng.prefill_out, &s->eng.prefill_out_bytes, rows_bytes)) {
		snprintf(s->last_error, sizeof(s->last_error), "out of memory for prefill attention");
		return -ENOMEM;
	}
	struct kvr_attention_item *items = ls->m.host;
	struct kvr_kv_segment *segs = (void *)((unsigned char *)ls->m.host + items_bytes);
	struct kvr_stream *st = s->engine_inline;
	for (uint32_t at = 0; at < n_tokens; at += group) {
		const uint32_t n_q = n_tokens - at < group ? n_tokens - at : group;
		/* q and out are host arrays: the group's rows as the kernels see
		 * them (through device stages where the device has its own memory) */
		const void *q_view = NULL;
		unsigned char *out_host = (unsigned char *)out + (uint64_t)at * s->q_row;
		int err = kvr_stage_in(s->dev, s->eng.prefill_q, (const unsigned char *)q + (uint64_t)at * s->q_row,
				       n_q * s->q_row, st, &q_view);
		const unsigned char *q_rows = q_view;
		unsigned char *out_rows = kvr_stage_out_view(s->dev, s->eng.prefill_out, out_host);
		uint32_t n_items = 0, n_segs = 0;
		/* spill tier: the group's pages, each pinned once */
		int pin_err = s->spill ? pin_prefix(s, seq, layer, first_position + at + n_q - 1, n_full) : 0;
		if (pin_err)
			return pin_err;
		for (uint32_t t = 0; t < n_q; t++) /* query t attends tokens 0..its position */
			for (uint32_t m = 0; m < n_kv; m++) {
				const uint32_t first = n_segs;
				n_segs += prefix_segments(s, plane, seq, layer, first_position + at + t, n_full, m,
							  segs + n_segs, &pin_err);
				const uint64_t row = (uint64_t)t * s->q_row + m * head_q_bytes;
				items[n_items++] = (struct kvr_attention_item){ q_rows + row, out_rows + row,
										NULL, first, n_segs - first };
			}
		s->eng.suppress_segment_pins = 0;
		if (!err)
			err = mirror_and_attend(s, ls, &s->head_shape, items, n_items, segs, n_segs, st);
		if (!err)
			err = kvr_stage_out(s->dev, out_host, out_rows, n_q * s->q_row, st);
		/* the next group rewrites the items (and the stages); with a spill
		 * tier, the pages it pinned are released after it (nothing to wait
		 * for on an inline stream) */
		if (!err)
			err = kvr_dev_stream_synchronize(s->dev, st);
		kvr_sched_unpin_step(s);
		if (err) {
			snprintf(s->last_error, sizeof(s->last_error), "%s", kvr_dev_last_error(s->dev));
			return err;
		}
	}
	return 0;
}

