/* SPDX-License-Identifier: MIT */
/*
 * prefill.c — prefill attention: the queries of a chunk of new tokens attend
 * causally over every stored token of their sequence (pool pages and the
 * tail), through the attention kernel's segments.
 *
 * Threads: the engine's thread, outside an open decode step.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../gpu/fault.h"
#include "sched_impl.h"

int kvr_sched_prefill_attention(struct kvr_sched *s, uint32_t seq, uint32_t layer,
				uint64_t first_position, uint32_t n_tokens, const void *q, void *out)
{
	const uint32_t p = s->c.page_tokens, n_kv = s->c.n_kv_heads, d = s->c.head_dim;
	uint64_t have = 0;
	kvr_pool_n_tokens(s->pool, seq, layer, &have);
	const uint32_t n_full = (uint32_t)(have / p);
	const uint64_t head_q_bytes = (uint64_t)s->G * d * s->eb;
	/* queries in groups, so the segment lists stay a few MiB at long contexts */
	const uint32_t group = 32;
	const uint64_t max_segs = (first_position + n_tokens) / p + 1;
	struct layer_scratch *ls = &s->scratch[layer];
	struct kvr_lane *plane = lane_of(s, seq, layer);
	const size_t items_bytes = ((size_t)group * n_kv * sizeof(struct kvr_attention_item) + 63) & ~(size_t)63;
	const size_t rows_bytes = (size_t)group * s->q_row;
	const size_t scratch_bytes = items_bytes + (size_t)group * n_kv * max_segs * sizeof(struct kvr_kv_segment);
	if (kvr_sched_mapped_grow(s, &ls->mem, &ls->bytes, scratch_bytes) ||
	    (s->separate && kvr_sched_device_grow(s, &ls->dev, &ls->dev_bytes, scratch_bytes)) ||
	    (s->separate && (kvr_sched_device_grow(s, &s->prefill_q, &s->prefill_q_bytes, rows_bytes) ||
			     kvr_sched_device_grow(s, &s->prefill_out, &s->prefill_out_bytes, rows_bytes)))) {
		snprintf(s->last_error, sizeof(s->last_error), "out of memory for prefill attention");
		return -ENOMEM;
	}
	struct kvr_attention_item *items = ls->mem;
	struct kvr_kv_segment *segs = (void *)((unsigned char *)ls->mem + items_bytes);
	struct kvr_stream *st = s->engine_inline;
	for (uint32_t at = 0; at < n_tokens; at += group) {
		const uint32_t n_q = n_tokens - at < group ? n_tokens - at : group;
		/* q and out are host arrays: on a separate-memory device the group's
		 * rows go through device buffers */
		const unsigned char *q_rows = (const unsigned char *)q + (uint64_t)at * s->q_row;
		unsigned char *out_rows = (unsigned char *)out + (uint64_t)at * s->q_row;
		int err = 0;
		if (s->separate) {
			err = kvr_dev_memcpy_async(s->dev, s->prefill_q, q_rows, n_q * s->q_row,
						   KVR_COPY_H2D, st);
			q_rows = s->prefill_q;
			out_rows = s->prefill_out;
		}
		uint32_t n_items = 0, n_segs = 0;
		int pin_err = 0; /* spill tier: a page that could not be pinned (message set) */
		if (s->spill) {
			/* the group's pages, each pinned once (the segments below do not
			 * pin again): every page up to the last query's, which with a
			 * spill tier must fit in RAM together */
			const uint64_t last = first_position + at + n_q - 1;
			const uint32_t need = (uint32_t)((last + 1) / p) + ((last + 1) % p && (last + 1) / p < n_full);
			for (uint32_t j = 0; j < need && !pin_err; j++) {
				uint32_t id = 0;
				kvr_pool_lookup(s->pool, seq, layer, j, &id);
				pin_err = kvr_sched_pin_in_place(s, id);
				if (pin_err)
					snprintf(s->last_error, sizeof(s->last_error),
						 "prefill attention of sequence %u layer %u: page %u of %u: %s", seq,
						 layer, j, need, kvr_pool_last_error(s->pool));
			}
			if (pin_err) {
				kvr_sched_unpin_step(s);
				return pin_err;
			}
			s->suppress_segment_pins = 1;
		}
		for (uint32_t t = 0; t < n_q; t++) {
			const uint64_t pos = first_position + at + t; /* attends tokens 0..pos */
			const uint32_t whole = (uint32_t)((pos + 1) / p), rest = (uint32_t)((pos + 1) % p);
			for (uint32_t m = 0; m < n_kv; m++) {
				const uint32_t first = n_segs;
				for (uint32_t j = 0; j < whole; j++)
					segs[n_segs++] = kvr_sched_pool_segment(s, plane, j, m, 0, &pin_err);
				if (rest && whole < n_full) {
					/* the page holding pos is already in the pool: its first rows */
					segs[n_segs] = kvr_sched_pool_segment(s, plane, whole, m, 0, &pin_err);
					segs[n_segs++].n_tokens = rest;
				} else if (rest) {
					const unsigned char *kt = s->tails[seq] +
								  (uint64_t)layer * 2 * s->tile_bytes +
								  (uint64_t)m * d * s->eb;
					segs[n_segs++] = (struct kvr_kv_segment){ kt, kt + s->tile_bytes, rest,
										  { n_kv * d }, 0, 0 };
				}
				const uint64_t row = (uint64_t)t * s->q_row + m * head_q_bytes;
				items[n_items++] = (struct kvr_attention_item){ q_rows + row, out_rows + row,
										NULL, first, n_segs - first };
			}
		}
		s->suppress_segment_pins = 0;
		const struct kvr_attention_item *items_k = items;
		const struct kvr_kv_segment *segs_k = segs;
		if (!err && s->separate) {
			err = kvr_sched_items_to_device(s, st, ls->dev, items, n_items * sizeof(*items));
			if (!err)
				err = kvr_sched_items_to_device(s, st, (unsigned char *)ls->dev + items_bytes,
								segs, n_segs * sizeof(*segs));
			items_k = ls->dev;
			segs_k = (const void *)((unsigned char *)ls->dev + items_bytes);
		}
		if (!err)
			err = kvr_dev_attention(s->dev, &s->head_shape, items_k, n_items, segs_k, n_segs, st);
		if (!err && s->separate)
			err = kvr_dev_memcpy_async(s->dev, (unsigned char *)out + (uint64_t)at * s->q_row,
						   s->prefill_out, n_q * s->q_row, KVR_COPY_D2H, st);
		/* the next group rewrites the items (and, separate, the rows);
		 * with a spill tier, the pages it pinned are released after it */
		if (!err && (s->separate || s->spill))
			err = kvr_dev_stream_synchronize(s->dev, st);
		kvr_sched_unpin_step(s);
		if (err) {
			snprintf(s->last_error, sizeof(s->last_error), "%s", kvr_dev_last_error(s->dev));
			return err;
		}
	}
	return 0;
}

