/* SPDX-License-Identifier: MIT */
/*
 * segments.c — where attention reads each page: the KV segments of one KV
 * head (sink, selected pages or their slots, window, tail) and the spill
 * tier's pins on pool pages read in place, held until the step's attention
 * is done.
 *
 * Threads: the engine's thread (the decode step and prefill attention).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "../layouts/base/fault.h"
#include "sched_impl.h"

/* Spill tier: pin a pool page attention reads in place until the step's
 * attention is done (unpin_step). Engine thread. */
int kvr_sched_pin_in_place(struct kvr_sched *s, uint32_t id)
{
	int err = kvr_pool_pin(s->pool, &id, 1);
	if (!err && (err = kvr_sched_hold_pin(s, id)))
		kvr_pool_unpin_live(s->pool, &id, 1);
	return err;
}

/* Keep a pin the caller took on page `id` until the step's attention is
 * done (the device append's page, which the device writes). */
int kvr_sched_hold_pin(struct kvr_sched *s, uint32_t id)
{
	if (s->eng.n_step_pins == s->eng.step_pins_cap) {
		const size_t cap = s->eng.step_pins_cap ? 2 * s->eng.step_pins_cap : 256;
		uint32_t *grown = kvr_realloc(s->eng.step_pins, cap * sizeof(*grown));
		if (!grown)
			return -ENOMEM;
		s->eng.step_pins = grown;
		s->eng.step_pins_cap = cap;
	}
	s->eng.step_pins[s->eng.n_step_pins++] = id;
	return 0;
}

/* Drop the pins of pages read in place from `mark` on (their attention has
 * run, or their sequence failed before it). A page freed since (its
 * sequence freed or truncated while the step was open) is skipped. */
void kvr_sched_unpin_from(struct kvr_sched *s, size_t mark)
{
	if (s->eng.n_step_pins > mark)
		kvr_pool_unpin_live(s->pool, s->eng.step_pins + mark, (uint32_t)(s->eng.n_step_pins - mark));
	s->eng.n_step_pins = mark;
}

void kvr_sched_unpin_step(struct kvr_sched *s)
{
	kvr_sched_unpin_from(s, 0);
}

/* One KV head's run of pool page `logical` as an attention segment: the
 * lane's device copy when `resident` (resident.c), else the
 * pool page in place. With a spill tier the page is pinned (read back from
 * the file when it is there); a failure sets *err and gives an empty segment. */
struct kvr_kv_segment kvr_sched_pool_segment(struct kvr_sched *s, struct kvr_lane *lane,
					     uint32_t logical, uint32_t m, int resident, int *err)
{
	uint32_t id = 0;
	kvr_pool_lookup(s->pool, lane->seq, lane->layer, logical, &id);
	if (s->spill && !*err && !s->eng.suppress_segment_pins) {
		*err = kvr_sched_pin_in_place(s, id);
		if (*err)
			snprintf(s->last_error, sizeof(s->last_error), "page %u: %s", logical,
				 kvr_pool_last_error(s->pool));
	}
	if (*err)
		return (struct kvr_kv_segment){ 0 };
	const unsigned char *page = NULL;
	if (resident)
		page = kvr_resident_page(s, lane, logical, id);
	if (!page)
		page = kvr_pool_page_data(s->pool, id);
	const uint32_t p = s->c.page_tokens, d = s->c.head_dim, eb = s->eb;
	if (s->kv_format) /* the head's quantised run (kernels.h), in the page's format */
		return (struct kvr_kv_segment){ page + (uint64_t)m * s->head_bytes, NULL, p, { 0 },
						(uint32_t)s->head_bytes,
						s->kv_format == KVR_KV_MIXED ? kvr_pool_page_format(s->pool, id)
									     : s->kv_format };
	if (s->pool_layout == KVR_POOL_LAYOUT_NHD) {
		/* [2][p][n_kv][d] */
		const unsigned char *k = page + (uint64_t)m * d * eb;
		return (struct kvr_kv_segment){ k, k + (uint64_t)p * s->c.n_kv_heads * d * eb, p,
						{ s->c.n_kv_heads * d }, 0, 0 };
	}
	const unsigned char *run = page + (uint64_t)m * s->head_bytes;
	return (struct kvr_kv_segment){ run, run + (uint64_t)p * d * eb, p, { d }, 0, 0 };
}

/* Sorts (page, slot) pairs by page; k is small. */
static void sort_pairs(int32_t *page, uint32_t *slot, uint32_t n)
{
	for (uint32_t i = 1; i < n; i++) {
		const int32_t pg = page[i];
		const uint32_t sl = slot[i];
		uint32_t j = i;
		for (; j > 0 && page[j - 1] > pg; j--) {
			page[j] = page[j - 1];
			slot[j] = slot[j - 1];
		}
		page[j] = pg;
		slot[j] = sl;
	}
}

/* The estimate (c.estimate) of KV head m's candidate pages [first, end) that
 * attention does not read exactly (`attended`: n_attended pages, ascending,
 * all in range): one KVR_KV_ESTIMATE segment per run of consecutive such
 * pages, whose rows are the pages' mean keys and values in the pool's
 * summaries (summary.h; mapped host memory, which every backend reads in
 * place, as zero-copy recall reads pages), each standing for a page's p
 * tokens (kernels.h). At most one segment per unattended page, so a list
 * still holds at most one segment per full page plus the tail. */
static uint32_t estimate_segments(struct kvr_sched *s, const struct kvr_lane *lane, uint32_t m,
				  uint32_t first, uint32_t end, const int32_t *attended,
				  uint32_t n_attended, struct kvr_kv_segment *out)
{
	const unsigned char *sum = kvr_pool_summary(s->pool, lane->seq, lane->layer, 0);
	if (!sum || first >= end)
		return 0;
	struct kvr_page_geometry g;
	kvr_page_geometry_init(&g, s->c.page_tokens, s->c.head_dim, s->c.n_kv_heads, s->c.dtype);
	const uint64_t page_elems = kvr_summary_page_elems(s->c.n_kv_heads, s->c.head_dim, 1);
	const uint64_t k_at = kvr_summary_index(&g, m, KVR_SUMMARY_KEY_MEAN, 0) * s->eb;
	const uint64_t v_at = kvr_summary_index(&g, m, KVR_SUMMARY_VALUE_MEAN, 0) * s->eb;
	uint32_t n = 0, run = first, i = 0;
	for (;;) {
		/* the next attended page at or after `run`, or end */
		while (i < n_attended && (uint32_t)attended[i] < run)
			i++;
		const uint32_t stop = i < n_attended && (uint32_t)attended[i] < end ? (uint32_t)attended[i] : end;
		if (stop > run) {
			const unsigned char *rows = sum + (uint64_t)run * page_elems * s->eb;
			out[n++] = (struct kvr_kv_segment){ rows + k_at, rows + v_at, stop - run,
							    { (uint32_t)page_elems }, 0, KVR_KV_ESTIMATE };
		}
		if (stop >= end)
			return n;
		run = stop + 1;
	}
}

/* Segments of KV head m of one sequence (n_tokens after the append): sink
 * pages, the selected pages (`sel`: zero-copy; or the lane's slots), window
 * pages, the tail. Dense: every full page, then the tail. */
uint32_t kvr_sched_build_segments(struct kvr_sched *s, struct kvr_lane *lane, uint32_t m,
				  uint64_t n_tokens, int dense, const int32_t *sel, int from_slots,
				  struct kvr_kv_segment *out, int *err)
{
	const uint32_t p = s->c.page_tokens, d = s->c.head_dim;
	const uint32_t n_full = (uint32_t)(n_tokens / p), tail = (uint32_t)(n_tokens % p);
	const uint32_t seq = lane->seq, layer = lane->layer;
	const uint32_t sink = s->c.sink_tokens / p, window = s->c.window_tokens / p;
	const uint32_t win_first = kvr_window_first(&s->c, n_tokens);
	const int res = kvr_resident_enabled(s);
	uint32_t n = 0;
	if (dense) {
		/* a dense layer keeps every page resident; the dense path of a
		 * sparse layer (L <= B) its sink and window pages */
		const int all = kvr_layer_dense(s, layer);
		for (uint32_t j = 0; j < n_full; j++)
			out[n++] = kvr_sched_pool_segment(
				s, lane, j, m, res && (all || j < sink || (window && j >= win_first)),
				err);
	} else {
		for (uint32_t j = 0; j < sink && j < win_first; j++)
			out[n++] = kvr_sched_pool_segment(s, lane, j, m, res, err);
		if (from_slots) {
			/* every slot of the head (k of them), in page order */
			int32_t *pages = s->eng.seg_pages;
			uint32_t *slots = s->eng.seg_slots, n_sel = 0;
			const int32_t *sp = lane->slot_page + (uint64_t)m * s->k;
			for (uint32_t j = 0; j < s->k; j++)
				if (sp[j] >= 0 && (uint32_t)sp[j] >= sink && (uint32_t)sp[j] < win_first) {
					pages[n_sel] = sp[j];
					slots[n_sel++] = j;
				}
			sort_pairs(pages, slots, n_sel);
			if (s->estimates)
				n += estimate_segments(s, lane, m, sink, win_first, pages, n_sel, out + n);
			const uint64_t row = (uint64_t)s->c.n_kv_heads * d;
			for (uint32_t i = 0; i < n_sel; i++) {
				if (s->kv_format) { /* one run in the slot's unit, or two halves */
					const uint64_t slot = (uint64_t)m * s->k + slots[i];
					const uint32_t fmt = lane->slot_fmt ? lane->slot_fmt[slot] : s->kv_format;
					const int32_t *units = lane->slot_unit + slot * s->units_per_slot;
					const uint32_t unit_bytes = (uint32_t)kvr_units_unit_bytes(&s->c);
					if (s->units_per_slot > 1 && fmt == KVR_KV_K8V4) {
						for (uint32_t h = 0; h < 2; h++)
							out[n++] = (struct kvr_kv_segment){
								kvr_units_addr(s, (uint32_t)units[h]), NULL, p / 2,
								{ 0 }, unit_bytes, KVR_KV_K8V4_HALF };
						continue;
					}
					out[n++] = (struct kvr_kv_segment){ kvr_units_addr(s, (uint32_t)units[0]), NULL, p,
									    { 0 }, unit_bytes, fmt };
					continue;
				}
				const uint64_t off = (uint64_t)slots[i] * s->tile_bytes + (uint64_t)m * d * s->eb;
				out[n++] = (struct kvr_kv_segment){ lane->slot_k + off, lane->slot_v + off, p,
								    { (uint32_t)row }, 0, 0 };
			}
		} else {
			for (uint32_t i = 0; i < s->k; i++) {
				if (sel[i] < 0 || (uint32_t)sel[i] < sink || (uint32_t)sel[i] >= win_first)
					continue;
				const struct kvr_kv_segment seg = kvr_sched_pool_segment(s, lane, (uint32_t)sel[i], m, 0, err);
				if (s->units_per_slot > 1 && seg.format == KVR_KV_K8V4) {
					/* mixed: read as the halves the streamed slots hold, so
					 * that both attend the same segments, bit for bit */
					for (uint32_t h = 0; h < 2; h++) {
						out[n] = seg;
						out[n].n_tokens = p / 2;
						out[n++].first_row = h * (p / 2);
					}
					continue;
				}
				out[n++] = seg;
			}
			if (s->estimates) { /* the attended pages, ascending */
				int32_t *pages = s->eng.seg_pages;
				uint32_t n_sel = 0;
				for (uint32_t i = 0; i < s->k; i++)
					if (sel[i] >= 0 && (uint32_t)sel[i] >= sink && (uint32_t)sel[i] < win_first)
						pages[n_sel++] = sel[i];
				sort_pairs(pages, s->eng.seg_slots, n_sel);
				n += estimate_segments(s, lane, m, sink, win_first, pages, n_sel, out + n);
			}
		}
		for (uint32_t j = win_first > sink ? win_first : sink; j < n_full; j++)
			out[n++] = kvr_sched_pool_segment(s, lane, j, m, res, err);
	}
	if (tail) {
		const unsigned char *kt = s->tails[seq] + (uint64_t)layer * 2 * s->tile_bytes +
					  (uint64_t)m * d * s->eb;
		out[n++] = (struct kvr_kv_segment){ kt, kt + s->tile_bytes, tail,
						    { s->c.n_kv_heads * d }, 0, 0 };
	}
	return n;
}

/* The device plan's list for KV head m (n_tokens after the append): sink
 * pages (*n_head of them), k empty slots the plan kernel fills with the
 * selected pages, then window pages and the tail (*n_tail): the segments
 * kvr_sched_build_segments writes around the selected pages. Returns how
 * many were written (n_head + k + n_tail). */
uint32_t kvr_sched_build_planned(struct kvr_sched *s, struct kvr_lane *lane, uint32_t m, uint64_t n_tokens,
				 struct kvr_kv_segment *out, uint32_t *n_head, uint32_t *n_tail, int *err)
{
	const uint32_t p = s->c.page_tokens, d = s->c.head_dim;
	const uint32_t n_full = (uint32_t)(n_tokens / p), tail = (uint32_t)(n_tokens % p);
	const uint32_t sink = s->c.sink_tokens / p;
	const uint32_t win_first = kvr_window_first(&s->c, n_tokens);
	const int res = kvr_resident_enabled(s);
	uint32_t n = 0;
	for (uint32_t j = 0; j < sink && j < win_first; j++)
		out[n++] = kvr_sched_pool_segment(s, lane, j, m, res, err);
	*n_head = n;
	memset(out + n, 0, s->k * sizeof(*out));
	n += s->k;
	for (uint32_t j = win_first > sink ? win_first : sink; j < n_full; j++)
		out[n++] = kvr_sched_pool_segment(s, lane, j, m, res, err);
	if (tail) {
		const unsigned char *kt = s->tails[lane->seq] + (uint64_t)lane->layer * 2 * s->tile_bytes +
					  (uint64_t)m * d * s->eb;
		out[n++] = (struct kvr_kv_segment){ kt, kt + s->tile_bytes, tail,
						    { s->c.n_kv_heads * d }, 0, 0 };
	}
	*n_tail = n - *n_head - s->k;
	return n;
}
