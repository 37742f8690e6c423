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
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../layouts/convert.h"
#include "sched_impl.h"

/* The pages of the prefix from page `from` up to position `last` for KV head
 * m, in token order (pool pages, the page holding `last` cut after it, or
 * the tail), appended to segs. */
static uint32_t prefix_segments(struct kvr_sched *s, struct kvr_lane *plane, uint32_t seq, uint32_t layer,
				uint32_t from, uint64_t last, uint32_t n_full, uint32_t m, struct kvr_kv_segment *segs,
				int *pin_err)
{
	const uint32_t p = s->c.page_tokens, n_kv = s->c.n_kv_heads, d = s->c.head_dim;
	const uint32_t whole = (uint32_t)((last + 1) / p), rest = (uint32_t)((last + 1) % p);
	uint32_t n = 0;
	for (uint32_t j = from; j < whole; j++)
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

/* Pins (spill tier) every page from page `from` up to position `last`, which
 * must then fit in RAM together; the segments built after it do not pin
 * again. */
static int pin_prefix(struct kvr_sched *s, uint32_t seq, uint32_t layer, uint32_t from, uint64_t last,
		      uint32_t n_full)
{
	const uint32_t p = s->c.page_tokens;
	const uint32_t need = (uint32_t)((last + 1) / p) + ((last + 1) % p && (last + 1) / p < n_full);
	for (uint32_t j = from; j < need; j++) {
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

/* A call's geometry: n_blocks blocks of n_q query tokens from position
 * `first`, item k·n_kv + m (block k, KV head m) at (k·n_kv + m)·hbb of the
 * staged rows q_view / o_view (og: the outputs' host copy), its token t's G
 * heads at t·group_bytes; the items and segments are built in the layer's
 * mirror. */
struct prefill_call {
	uint32_t seq, layer, n_full, n_blocks, n_q;
	uint64_t first, hbb, group_bytes;
	const unsigned char *q_view;
	unsigned char *o_view, *og;
	struct kvr_lane *plane;
	struct layer_scratch *ls;
	struct kvr_attention_item *items;
	struct kvr_kv_segment *segs;
};

/* The call's rows between the caller's arrays (q_row bytes a token) and the
 * gathered layout (items' rows, head by head): gather (to_items) or scatter. */
static void move_rows(const struct kvr_sched *s, const struct prefill_call *c, unsigned char *rows, unsigned char *items,
		      int to_items)
{
	const uint32_t n_kv = s->c.n_kv_heads;
	const uint64_t group_bytes = c->group_bytes;
	for (uint32_t k = 0; k < c->n_blocks; k++)
		for (uint32_t t = 0; t < c->n_q; t++)
			for (uint32_t m = 0; m < n_kv; m++) {
				unsigned char *a = rows + (uint64_t)(k * c->n_q + t) * s->q_row + m * group_bytes;
				unsigned char *b = items + (k * n_kv + m) * c->hbb + t * group_bytes;
				memcpy(to_items ? b : a, to_items ? a : b, group_bytes);
			}
}

/*
 * One kernel call over pool pages from `from`: to > from, pages [from, to)
 * for every item, all before the call's first query (no mask); to = 0, up to
 * each block's last query under the causal mask, positions counted from page
 * `from`. lse (mapped, lse_stride floats an item) gets each segment's
 * log-sum-exp, and n_segs_of[x] item x's segment count. The outputs reach og;
 * the call's pins are released.
 */
static int attend_pages(struct kvr_sched *s, const struct prefill_call *c, uint32_t from, uint32_t to, float *lse,
			uint64_t lse_stride, uint32_t *n_segs_of)
{
	const uint32_t p = s->c.page_tokens, n_kv = s->c.n_kv_heads, G = s->G;
	const uint32_t n_items = c->n_blocks * n_kv;
	const uint64_t last_all = to ? (uint64_t)to * p - 1 : c->first + (uint64_t)c->n_blocks * c->n_q - 1;
	struct kvr_attention_item *items = c->items;
	struct kvr_kv_segment *segs = c->segs;
	struct kvr_stream *st = s->engine_inline;
	int pin_err = s->spill ? pin_prefix(s, c->seq, c->layer, from, last_all, c->n_full) : 0;
	if (pin_err)
		return pin_err;
	uint32_t n_segs = 0;
	for (uint32_t k = 0; k < c->n_blocks; k++) {
		const uint64_t last = to ? last_all : c->first + (uint64_t)(k + 1) * c->n_q - 1; /* the block's last query */
		for (uint32_t m = 0; m < n_kv; m++) {
			const uint32_t first = n_segs, x = k * n_kv + m;
			n_segs += prefix_segments(s, c->plane, c->seq, c->layer, from, last, c->n_full, m, segs + n_segs,
						  &pin_err);
			items[x] = (struct kvr_attention_item){ c->q_view + x * c->hbb, c->o_view + x * c->hbb,
								lse ? lse + x * lse_stride : NULL, first, n_segs - first };
			if (n_segs_of)
				n_segs_of[x] = n_segs - first;
		}
	}
	s->eng.suppress_segment_pins = 0;
	struct kvr_shape shape = s->head_shape;
	shape.n_qo_heads = c->n_q * G;
	shape.flags = (lse ? KVR_SHAPE_SEGMENT_LSE : 0) | (to ? 0 : KVR_SHAPE_CAUSAL);
	shape.causal_heads_per_query = to ? 0 : G;
	shape.causal_items_per_block = to ? 0 : n_kv;
	shape.causal_first_position = to ? 0 : c->first - (uint64_t)from * p;
	const size_t call_bytes = (size_t)n_items * c->hbb;
	int err = mirror_and_attend(s, c->ls, &shape, items, n_items, segs, n_segs, st);
	if (!err)
		err = kvr_stage_out(s->dev, c->og, c->o_view, call_bytes, st);
	/* the next call rewrites the items (and the stages); with a spill
	 * tier, the pages it pinned are released after it */
	if (!err)
		err = kvr_dev_stream_synchronize(s->dev, st);
	kvr_sched_unpin_step(s);
	if (err)
		snprintf(s->last_error, sizeof(s->last_error), "%s", kvr_dev_last_error(s->dev));
	return err;
}

/*
 * Spill tier, a call whose prefix needs more pages than half the RAM frames:
 * the pages before the call's first query stream through in windows of that
 * many, each one call whose outputs and per-segment log-sum-exps merge on the
 * host (out = Σ_w e^(lse_w − M)·out_w / Σ_w e^(lse_w − M), in f32), then the
 * causal window from the first query's page. Only the windows' pages are in
 * RAM at once; the outputs are the same attention to f32 and element-type
 * rounding (each window's output is rounded once before the merge).
 */
static int prefill_windows(struct kvr_sched *s, const struct prefill_call *c, uint32_t window)
{
	const uint32_t p = s->c.page_tokens, n_kv = s->c.n_kv_heads, G = s->G, d = s->c.head_dim;
	const uint32_t n_items = c->n_blocks * n_kv, n_qo = c->n_q * G, before = (uint32_t)(c->first / p);
	const uint32_t causal_pages = (uint32_t)((c->first + (uint64_t)c->n_blocks * c->n_q - 1) / p) - before + 1;
	const uint64_t lse_stride = (uint64_t)n_qo * (window > causal_pages ? window : causal_pages);
	const size_t rows = (size_t)n_items * n_qo;
	float *acc = calloc(rows * d, sizeof(float)), *row = malloc(d * sizeof(float));
	float *mx = malloc(rows * sizeof(float)), *sum = calloc(rows, sizeof(float));
	uint32_t n_segs_of[PREFILL_BLOCKS_PER_CALL * KVR_MAX_KV_HEADS];
	int err = acc && row && mx && sum ? 0 : -ENOMEM;
	if (!err && kvr_mapped_grow(s->dev, &s->eng.prefill_lse, &s->eng.prefill_lse_bytes,
				    n_items * lse_stride * sizeof(float)))
		err = -ENOMEM;
	if (err)
		snprintf(s->last_error, sizeof(s->last_error), "out of memory for prefill attention");
	for (size_t r = 0; !err && r < rows; r++)
		mx[r] = -INFINITY;
	float *lse = s->eng.prefill_lse;
	for (uint32_t w0 = 0; !err;) {
		const int causal = w0 >= before; /* the last call: from the first query's page */
		const uint32_t to = causal ? 0 : (w0 + window < before ? w0 + window : before);
		if ((err = attend_pages(s, c, causal ? before : w0, to, lse, lse_stride, n_segs_of)))
			break;
		for (uint32_t x = 0; x < n_items; x++)
			for (uint32_t h = 0; h < n_qo; h++) {
				/* the window's log-sum-exp: its segments' combined */
				const float *l = lse + x * lse_stride + (uint64_t)h * n_segs_of[x];
				float lw = -INFINITY;
				for (uint32_t si = 0; si < n_segs_of[x]; si++)
					if (l[si] > lw)
						lw = l[si];
				if (lw == -INFINITY)
					continue; /* no token of this window for the head */
				float e = 0.0f;
				for (uint32_t si = 0; si < n_segs_of[x]; si++)
					e += expf(l[si] - lw);
				lw += logf(e);
				const size_t r = (size_t)x * n_qo + h;
				const float m_new = lw > mx[r] ? lw : mx[r];
				const float keep = mx[r] == -INFINITY ? 0.0f : expf(mx[r] - m_new), add = expf(lw - m_new);
				kvr_convert_to_f32(row, c->og + x * c->hbb + (uint64_t)h * d * s->eb, s->head_shape.elem_type, d);
				for (uint32_t j = 0; j < d; j++)
					acc[r * d + j] = acc[r * d + j] * keep + row[j] * add;
				sum[r] = sum[r] * keep + add;
				mx[r] = m_new;
			}
		if (causal)
			break;
		w0 = to;
	}
	for (size_t r = 0; !err && r < rows; r++) {
		const float inv = sum[r] == 0.0f ? 0.0f : 1.0f / sum[r];
		for (uint32_t j = 0; j < d; j++)
			row[j] = acc[r * d + j] * inv;
		kvr_convert_from_f32(c->og + (r / n_qo) * c->hbb + (uint64_t)(r % n_qo) * d * s->eb, row, s->head_shape.elem_type, d);
	}
	free(acc), free(row), free(mx), free(sum);
	return err;
}

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
	const size_t items_bytes = ((size_t)max_items * sizeof(struct kvr_attention_item) + 63) & ~(size_t)63;
	const size_t scratch_bytes = items_bytes + (size_t)max_items * max_segs * sizeof(struct kvr_kv_segment);
	if (kvr_mirror_grow(s->dev, &ls->m, scratch_bytes) ||
	    kvr_mapped_grow(s->dev, &s->eng.prefill_rows, &s->eng.prefill_rows_bytes, 2 * rows_bytes) ||
	    kvr_stage_grow(s->dev, &s->eng.prefill_q, &s->eng.prefill_q_bytes, rows_bytes) ||
	    kvr_stage_grow(s->dev, &s->eng.prefill_out, &s->eng.prefill_out_bytes, rows_bytes)) {
		snprintf(s->last_error, sizeof(s->last_error), "out of memory for prefill attention");
		return -ENOMEM;
	}
	/* spill tier: a call's prefix beyond half the RAM frames streams through
	 * in windows (prefill_windows) */
	uint32_t window = UINT32_MAX;
	if (s->spill) {
		struct kvr_pool_stats ps;
		kvr_pool_get_stats(s->pool, &ps);
		window = ps.frames / 2 ? ps.frames / 2 : 1;
	}
	/* the gathered rows on the host: queries, then outputs; the items and
	 * segments in the layer's mirror */
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
		struct prefill_call c = { seq, layer, n_full, n_blocks, n_q, first_position + at, head_block_bytes,
					  group_bytes, NULL, kvr_stage_out_view(s->dev, s->eng.prefill_out, og), og,
					  lane_of(s, seq, layer), ls, items, segs };
		move_rows(s, &c, (unsigned char *)(uintptr_t)q + (uint64_t)at * s->q_row, qg, 1);
		const void *q_view = NULL;
		int err = kvr_stage_in(s->dev, s->eng.prefill_q, qg, (size_t)n_blocks * n_kv * head_block_bytes, st,
				       &q_view);
		c.q_view = q_view;
		const uint64_t call_last = c.first + (uint64_t)n_blocks * n_q - 1;
		const uint32_t pages = (uint32_t)(call_last / p) + 1;
		if (err)
			snprintf(s->last_error, sizeof(s->last_error), "%s", kvr_dev_last_error(s->dev));
		else if (pages > window && c.first / p > 0)
			err = prefill_windows(s, &c, window);
		else
			err = attend_pages(s, &c, 0, 0, NULL, 0, NULL);
		if (err)
			return err;
		move_rows(s, &c, (unsigned char *)out + (uint64_t)at * s->q_row, og, 0);
		at += n_blocks * n_q;
	}
	return 0;
}
