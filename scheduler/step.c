/* SPDX-License-Identifier: MIT */
/*
 * step.c — the decode step of DESIGN.md per (sequence, layer), on the
 * engine's thread, and the scheduler's lifecycle.
 *
 * One layer call, for a batch:
 *  1. Acquire each sequence's lane (wait for its controller job, counted as a
 *     controller wait) and append its token (a pool page is reserved when a
 *     tail page starts; a full tail page is offloaded with its summary).
 *  2. Decide which KV heads are corrected: none (speculative), all (blocking,
 *     and the first sparse step of a lane), or those whose group-mean cosine
 *     between q_i and q_{i−1} is below tau (freekv).
 *  3. Attention for the sequences without corrected heads runs first, so a
 *     correction in one sequence does not hold back the others.
 *  4. Each sequence with corrected heads: select now with q_i (all heads,
 *     among step i+1's candidates: the selection serves that step too),
 *     recall the corrected heads' misses (streamed: an urgent controller job
 *     the engine waits for), then attention. These waits are the correction
 *     waits.
 *  5. Post each sparse lane's job for the next step: a speculative selection
 *     with q_i against the window as it will be at step i+1 (plus its
 *     recall), or, after a correction, the deferred recall of the
 *     non-corrected heads to the selection just made (no second selection).
 *
 * Which pages attention reads: with zero-copy recall (the cpu backend's
 * default) the selected pages straight from the pool; with streamed recall
 * the lane's device slots, in ascending page order, so both give identical
 * results. Sink, window and tail are read where they live (pool pages and the
 * tail tile); the dense path (L ≤ B, dense layers, mode dense) reads every
 * page of the pool.
 *
 * Threads: the engine's thread (one step at a time per context).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../gpu/fault.h"
#include "sched_impl.h"

static int layer_dense(const struct kvr_sched *s, uint32_t layer)
{
	return s->c.mode == KVR_MODE_DENSE || (s->c.dense_layers[layer / 64] >> (layer % 64) & 1);
}

/* ------------------------------------------------------------------ selection */

int kvr_select_pages(struct kvr_sched *s, struct kvr_lane *lane, const void *q,
		     uint64_t n_tokens, int next, int32_t *selected, struct kvr_stream *stream,
		     struct kvr_score_item *item, struct kvr_score_item *item_dev, float **scores,
		     size_t *scores_bytes)
{
	const uint32_t sink = s->c.sink_tokens / s->c.page_tokens;
	/* the window as it will be at step i+1 (one more token) when the
	 * selection serves that step, so a page leaving the window is a
	 * candidate the step it leaves; it never reaches the page being filled,
	 * which has no summary yet (kvr_window_first) */
	const uint32_t win_first = kvr_window_first(&s->c, n_tokens + (next ? 1 : 0));
	const uint32_t cand_begin = sink, cand_end = win_first > sink ? win_first : sink;
	/* Each head's softmax spans every page with a summary (FreeKV's P^h over
	 * all pages, not only the candidates): a head whose attention sits in the
	 * sink or the window then weighs less in its group's mean than one
	 * spread over the candidates. Measured: lower perplexity gaps where
	 * sink and window are a sizeable share of the pages, neutral at 8K
	 * (docs/benchmarks.md, "Group consistency"). The page the newest token
	 * completed is left out: its summary may still be on its way (the rule
	 * kvr_window_first applies with W = 0). */
	const uint32_t with_summary = n_tokens ? (uint32_t)((n_tokens - 1) / s->c.page_tokens) : 0;
	const uint32_t norm_end = with_summary > cand_end ? with_summary : cand_end;
	const size_t need = (size_t)s->c.n_kv_heads * (cand_end - cand_begin + 1) * sizeof(float);
	if (kvr_sched_device_grow(s, (void **)scores, scores_bytes, need))
		return -ENOMEM;
	const void *summaries = kvr_resident_summaries(s, lane, norm_end, stream);
	if (!summaries && s->separate && kvr_pool_summary(s->pool, lane->seq, lane->layer, 0))
		return -ENOMEM; /* no device memory for the summaries */
	if (!summaries) {
		for (uint32_t i = 0; i < s->c.n_kv_heads * s->k; i++)
			selected[i] = -1;
		return 0;
	}
	*item = (struct kvr_score_item){ .q = q,
					 .summaries = summaries,
					 .scores = *scores,
					 .selected = selected,
					 .cand_begin = cand_begin,
					 .cand_end = cand_end,
					 .k = s->k,
					 .norm_end = norm_end };
	int err = kvr_sched_items_to_device(s, stream, item_dev, item, sizeof(*item));
	if (!err)
		err = kvr_dev_score(s->dev, &s->shape, item_dev, 1, stream);
	if (!err)
		err = kvr_dev_select(s->dev, &s->shape, item_dev, 1, stream);
	/* the host plans with `selected` (and reuses the item and the scores) */
	if (!err && s->separate)
		err = kvr_dev_stream_synchronize(s->dev, stream);
	return err;
}

/* ------------------------------------------------------------------ segments */

/* Spill tier: pin a pool page attention reads in place until the step's
 * attention is done (unpin_step). Engine thread. */
static int pin_in_place(struct kvr_sched *s, uint32_t id)
{
	if (s->n_step_pins == s->step_pins_cap) {
		const size_t cap = s->step_pins_cap ? 2 * s->step_pins_cap : 256;
		uint32_t *grown = kvr_realloc(s->step_pins, cap * sizeof(*grown));
		if (!grown)
			return -ENOMEM;
		s->step_pins = grown;
		s->step_pins_cap = cap;
	}
	int err = kvr_pool_pin(s->pool, &id, 1);
	if (!err)
		s->step_pins[s->n_step_pins++] = id;
	return err;
}

/* Drop the pins of pages read in place from `mark` on (their attention has
 * run, or their sequence failed before it). A page freed since (its
 * sequence freed or truncated while the step was open) is skipped. */
static void unpin_from(struct kvr_sched *s, size_t mark)
{
	if (s->n_step_pins > mark)
		kvr_pool_unpin_live(s->pool, s->step_pins + mark, (uint32_t)(s->n_step_pins - mark));
	s->n_step_pins = mark;
}

static void unpin_step(struct kvr_sched *s)
{
	unpin_from(s, 0);
}

/* One KV head's run of pool page `logical` as an attention segment: the
 * lane's device copy when `resident` (separate memory, resident.c), else the
 * pool page in place. With a spill tier the page is pinned (read back from
 * the file when it is there); a failure sets *err and gives an empty segment. */
static struct kvr_kv_segment pool_segment(struct kvr_sched *s, struct kvr_lane *lane, uint32_t logical,
					  uint32_t m, int resident, int *err)
{
	uint32_t id = 0;
	kvr_pool_lookup(s->pool, lane->seq, lane->layer, logical, &id);
	if (s->spill && !*err && !s->suppress_segment_pins) {
		*err = pin_in_place(s, id);
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

/* Segments of KV head m of one sequence (n_tokens after the append): sink
 * pages, the selected pages (`sel`: zero-copy; or the lane's slots), window
 * pages, the tail. Dense: every full page, then the tail. */
static uint32_t build_segments(struct kvr_sched *s, struct kvr_lane *lane, uint32_t m,
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
		const int all = layer_dense(s, layer);
		for (uint32_t j = 0; j < n_full; j++)
			out[n++] = pool_segment(s, lane, j, m,
						res && (all || j < sink || (window && j >= win_first)), err);
	} else {
		for (uint32_t j = 0; j < sink && j < win_first; j++)
			out[n++] = pool_segment(s, lane, j, m, res, err);
		if (from_slots) {
			/* every slot of the head (k of them), in page order */
			int32_t *pages = s->seg_pages;
			uint32_t *slots = s->seg_slots, n_sel = 0;
			const int32_t *sp = lane->slot_page + (uint64_t)m * s->k;
			for (uint32_t j = 0; j < s->k; j++)
				if (sp[j] >= 0 && (uint32_t)sp[j] >= sink && (uint32_t)sp[j] < win_first) {
					pages[n_sel] = sp[j];
					slots[n_sel++] = j;
				}
			sort_pairs(pages, slots, n_sel);
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
				const struct kvr_kv_segment seg = pool_segment(s, lane, (uint32_t)sel[i], m, 0, err);
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
		}
		for (uint32_t j = win_first > sink ? win_first : sink; j < n_full; j++)
			out[n++] = pool_segment(s, lane, j, m, res, err);
	}
	if (tail) {
		const unsigned char *kt = s->tails[seq] + (uint64_t)layer * 2 * s->tile_bytes +
					  (uint64_t)m * d * s->eb;
		out[n++] = (struct kvr_kv_segment){ kt, kt + s->tile_bytes, tail,
						    { s->c.n_kv_heads * d }, 0, 0 };
	}
	return n;
}

static void zero_output(struct kvr_sched *s, void *out_row);

/* The step of `seq` failed at `layer` for `reason`: its later layers fail
 * too, and step_end takes back what its earlier layers appended. The reason
 * is kept as one sentence, "sequence S layer L: ...", the subject said once
 * even when the reason (a pool message) already names it. */
static void mark_failed(struct kvr_sched *s, uint32_t seq, uint32_t layer, uint64_t position, int err,
			const char *reason)
{
	if (s->step_fail[seq])
		return;
	s->step_fail[seq] = err;
	s->step_fail_pos[seq] = position;
	s->step_fail_layer[seq] = layer;
	s->step_failed[s->n_step_failed++] = seq;
	char subject[48];
	snprintf(subject, sizeof(subject), "sequence %u layer %u: ", seq, layer);
	char *message = s->step_fail_message + (size_t)seq * KVR_SCHED_MESSAGE;
	if (!strncmp(reason, subject, strlen(subject)))
		snprintf(message, KVR_SCHED_MESSAGE, "%s", reason);
	else
		snprintf(message, KVR_SCHED_MESSAGE, "%s%s", subject, reason);
	if (s->log_fn)
		s->log_fn(s->log_user, KVR_LOG_ERROR, message);
}

/* A sequence's step failed after the lanes were acquired: zeros for its
 * output, the reason kept (mark_failed) and counted, its lane to start
 * afresh. `reason` NULL: the spill tier's read error `err`. */
static void fail_sequence(struct kvr_sched *s, uint32_t seq, uint32_t layer, uint64_t position, int err,
			  const char *reason, unsigned char *out)
{
	struct kvr_lane *lane = lane_of(s, seq, layer);
	if (!reason)
		reason = err == -EBADMSG ? "a page read back from the spill file failed its checksum"
			 : err == -EIO	 ? "reading a page from the spill file failed"
					 : kvr_strerror(err);
	mark_failed(s, seq, layer, position, err, reason);
	zero_output(s, out);
	count(s, seq, KVR_C_FAILED_DECODES, 1);
	lane->has_prev = 0;
	if (lane->slot_page)
		for (uint32_t j = 0; j < s->c.n_kv_heads * s->k; j++)
			lane->slot_page[j] = -1;
}

static void lane_forget(struct kvr_sched *s, struct kvr_lane *lane);

/* Step end: every layer of a failed sequence back at its step's position. */
static void settle_failed(struct kvr_sched *s)
{
	for (uint32_t i = 0; i < s->n_step_failed; i++) {
		const uint32_t seq = s->step_failed[i];
		/* Only the layers this step appended to are taken back: a layer the
		 * step failed at (a position below its length, say) keeps what it
		 * held before the step. */
		int appended = 0;
		for (uint32_t l = 0; l < s->c.n_layers; l++)
			appended |= lane_of(s, seq, l)->appended_step == s->step_serial;
		if (appended) {
			/* the layers that did decode posted their next step's work */
			kvr_sched_seq_quiesce(s, seq);
			for (uint32_t l = 0; l < s->c.n_layers; l++) {
				struct kvr_lane *lane = lane_of(s, seq, l);
				if (lane->appended_step == s->step_serial) {
					kvr_pool_truncate(s->pool, seq, l, s->step_fail_pos[seq]);
					lane->appended_step = 0;
				}
				lane_forget(s, lane);
			}
		}
		s->step_fail[seq] = 0;
	}
	s->n_step_failed = 0;
}

/* ------------------------------------------------------------------ one layer */

enum seq_kind {
	SEQ_FAILED = 0,
	SEQ_DENSE,     /* dense path */
	SEQ_SPARSE,    /* sparse, nothing corrected */
	SEQ_CORRECTED, /* sparse, some heads corrected */
};

/* The engine's view of one batch entry during a layer call. */
struct entry {
	uint32_t kind;
	uint32_t any_corrected;
	uint64_t n_tokens;
};

/* Wait (streamed recall) until the lane's latest recall is complete before
 * attention reads its slots: a stream wait on the compute stream, which on a
 * host-synchronous compute stream blocks the engine — counted. */
static int wait_recall(struct kvr_sched *s, struct kvr_lane *lane, int correction)
{
	if (s->recall != KVR_RECALL_STREAMED)
		return 0;
	if (!s->hooks.async_compute && kvr_dev_event_query(s->dev, lane->recall_done) == -EAGAIN) {
		const uint64_t t0 = kvr_now_ns();
		kvr_dev_event_synchronize(s->dev, lane->recall_done);
		const uint64_t t1 = kvr_now_ns();
		if (!correction) {
			count(s, lane->seq, KVR_C_RECALL_WAITS, 1);
			count(s, lane->seq, KVR_C_RECALL_WAIT_NS, t1 - t0);
		}
		struct kvr_trace *tr = trace_of(s);
		if (tr)
			kvr_trace_span(tr, "wait recall", KVR_TRACK_ENGINE, lane->seq, lane->layer, 0,
				       t0, t1);
	}
	return kvr_dev_stream_wait_event(s->dev, s->compute, lane->recall_done);
}

/* Attention over `n_items` items, then record attn_done of each listed lane.
 * The items and segments sit in the layer's scratch `ls`; segments from
 * seg_begin on are this call's (on a separate-memory device they are copied to
 * the scratch's device twin first). */
static int run_attention(struct kvr_sched *s, uint32_t layer, struct layer_scratch *ls,
			 const struct kvr_attention_item *items, uint32_t n_items,
			 const struct kvr_kv_segment *segs, uint32_t seg_begin, uint32_t n_segs,
			 struct kvr_lane **lanes, uint32_t n_lanes)
{
	if (!n_items)
		return 0;
	const uint64_t t0 = kvr_now_ns();
	int err = 0;
	if (s->separate) {
		unsigned char *dev = ls->dev;
		const size_t item_off = (size_t)((const unsigned char *)items - (unsigned char *)ls->mem);
		const size_t seg_off = (size_t)((const unsigned char *)segs - (unsigned char *)ls->mem);
		err = kvr_sched_items_to_device(s, s->compute, dev + item_off, items,
						n_items * sizeof(*items));
		if (!err)
			err = kvr_sched_items_to_device(s, s->compute, dev + seg_off + seg_begin * sizeof(*segs),
							segs + seg_begin,
							(n_segs - seg_begin) * sizeof(*segs));
		items = (const void *)(dev + item_off);
		segs = (const void *)(dev + seg_off);
	}
	kvr_sched_hook_on_stream(s, s->compute, KVR_HOOK_COMPUTE);
	struct kvr_trace_span *sp = NULL;
	if (s->hooks.async_compute)
		sp = kvr_stream_span_begin(s, s->compute, "attention", KVR_TRACK_COMPUTE, UINT32_MAX,
					   layer, n_items);
	if (!err)
		err = kvr_dev_attention(s->dev, s->kv_format == KVR_KV_MIXED ? &s->lse_shape : &s->head_shape,
					items, n_items, segs, n_segs, s->compute);
	kvr_stream_span_end(s, s->compute, sp);
	for (uint32_t i = 0; !err && i < n_lanes; i++)
		err = kvr_dev_event_record(s->dev, lanes[i]->attn_done, s->compute);
	struct kvr_trace *tr = trace_of(s);
	if (tr && !s->hooks.async_compute)
		kvr_trace_span(tr, "attention", KVR_TRACK_ENGINE, n_lanes == 1 ? lanes[0]->seq : UINT32_MAX,
			       layer, n_items, t0, kvr_now_ns());
	return err;
}

/* Separate memory: order the layer's work after the engine's stream and bring
 * q, k, v to the host (the append and the previous query are host work). */
static int fetch_inputs(struct kvr_sched *s, uint32_t batch, const void *q, const void *k,
			const void *v, struct kvr_stream *engine_stream)
{
	const size_t q_bytes = (size_t)batch * s->q_row, kv_bytes = (size_t)batch * s->kv_row;
	int err = kvr_sched_mapped_grow(s, (void **)&s->mirror, &s->mirror_bytes,
					(size_t)s->c.max_batch * (s->q_row + 2 * s->kv_row));
	if (err)
		return err;
	if (engine_stream) {
		err = kvr_dev_event_record(s->dev, s->engine_ready, engine_stream);
		if (!err)
			err = kvr_dev_stream_wait_event(s->dev, s->engine_inline, s->engine_ready);
		if (!err)
			err = kvr_dev_stream_wait_event(s->dev, s->compute, s->engine_ready);
		if (err)
			return err;
	}
	err = kvr_dev_memcpy_async(s->dev, s->mirror, q, q_bytes, KVR_COPY_D2H, s->engine_inline);
	if (!err)
		err = kvr_dev_memcpy_async(s->dev, s->mirror + q_bytes, k, kv_bytes, KVR_COPY_D2H,
					   s->engine_inline);
	if (!err)
		err = kvr_dev_memcpy_async(s->dev, s->mirror + q_bytes + kv_bytes, v, kv_bytes,
					   KVR_COPY_D2H, s->engine_inline);
	if (!err)
		err = kvr_dev_stream_synchronize(s->dev, s->engine_inline);
	return err;
}

/* A failed sequence's output rows: zeros. */
static void zero_output(struct kvr_sched *s, void *out_row)
{
	if (!s->separate)
		memset(out_row, 0, s->q_row);
	else
		kvr_dev_memcpy_async(s->dev, out_row, s->zero_row, s->q_row, KVR_COPY_H2D, s->compute);
}

int kvr_sched_decode_layer(struct kvr_sched *s, uint32_t layer, uint32_t batch,
			   const uint32_t *seqs, const uint64_t *positions, const void *q,
			   const void *k, const void *v, void *out, int32_t *status,
			   struct kvr_stream *engine_stream)
{
	const uint64_t t_enter = kvr_now_ns();
	const struct kvr_config *c = &s->c;
	const uint32_t n_kv = c->n_kv_heads, p = c->page_tokens, kk = s->k;
	const uint64_t q_row = s->q_row, kv_row = s->kv_row;
	const uint64_t head_q_bytes = (uint64_t)s->G * c->head_dim * s->eb;
	const int dense_layer = layer_dense(s, layer);
	struct kvr_trace *tr = trace_of(s);
	/* q_dev feeds kernels; q_host, k_host, v_host the host's own work */
	const unsigned char *q_dev = q, *q_host = q, *k_host = k, *v_host = v;
	if (s->separate) {
		int err = fetch_inputs(s, batch, q, k, v, engine_stream);
		if (err) {
			snprintf(s->last_error, sizeof(s->last_error), "reading the layer's q, k, v: %s",
				 kvr_dev_last_error(s->dev));
			return err;
		}
		q_host = s->mirror;
		k_host = s->mirror + (size_t)batch * q_row;
		v_host = k_host + (size_t)batch * kv_row;
	}

	/* 1. Acquire the lanes, append the tokens. */
	uint32_t max_pages = 0;
	for (uint32_t i = 0; i < batch; i++) {
		const uint32_t seq = seqs[i];
		struct kvr_lane *lane = lane_of(s, seq, layer);
		const uint64_t waited = kvr_lane_acquire(s, lane);
		if (waited) {
			count(s, seq, KVR_C_CONTROLLER_WAITS, 1);
			count(s, seq, KVR_C_CONTROLLER_WAIT_NS, waited);
			if (tr)
				kvr_trace_span(tr, "wait controller", KVR_TRACK_ENGINE, seq, layer, 0,
					       kvr_now_ns() - waited, kvr_now_ns());
		}
		kvr_importance_harvest(s, lane); /* before this step overwrites its lse */
		if (s->step_fail[seq]) { /* an earlier layer of this step failed it */
			status[i] = s->step_fail[seq];
			zero_output(s, (unsigned char *)out + i * q_row);
			count(s, seq, KVR_C_FAILED_DECODES, 1);
			continue;
		}
		if (lane->recall_error) {
			/* the recall this step would attend over could not read its pages
			 * from the spill file: fail this sequence's step, append nothing;
			 * the lane recalls afresh at its next step */
			status[i] = lane->recall_error;
			lane->recall_error = 0;
			fail_sequence(s, seq, layer, positions[i], status[i], NULL,
				      (unsigned char *)out + i * q_row);
			continue;
		}
		struct kvr_tail_tile tail = { s->tails[seq] + (uint64_t)layer * 2 * s->tile_bytes,
					      s->tails[seq] + ((uint64_t)layer * 2 + 1) * s->tile_bytes };
		status[i] = kvr_pool_ingest(s->pool, seq, layer, positions[i], 1, k_host + i * kv_row,
					    v_host + i * kv_row, &tail);
		if (status[i]) {
			zero_output(s, (unsigned char *)out + i * q_row);
			count(s, seq, KVR_C_FAILED_DECODES, 1);
			mark_failed(s, seq, layer, positions[i], status[i], kvr_pool_last_error(s->pool));
			continue;
		}
		lane->appended_step = s->step_serial;
		const uint32_t pages = (uint32_t)((positions[i] + 1) / p);
		max_pages = pages > max_pages ? pages : max_pages;
	}

	/* Scratch of this layer (kept per layer: an asynchronous attention may
	 * still read the previous layer's items). */
	/* mixed pages: a selected K8V4 page is two segments (its halves) */
	const uint32_t max_segs = max_pages + 1 + (s->units_per_slot > 1 ? s->k : 0);
	size_t off[6], need = 0;
	const size_t sizes[6] = {
		(size_t)batch * n_kv * sizeof(struct kvr_attention_item),
		(size_t)batch * n_kv * max_segs * sizeof(struct kvr_kv_segment),
		(size_t)batch * sizeof(struct entry),
		(size_t)batch * n_kv * sizeof(float),
		(size_t)batch * n_kv,
		(size_t)batch * sizeof(struct kvr_lane *),
	};
	for (int i = 0; i < 6; i++) {
		off[i] = need;
		need += (sizes[i] + 63) & ~(size_t)63;
	}
	struct layer_scratch *ls = &s->scratch[layer];
	if (kvr_sched_mapped_grow(s, &ls->mem, &ls->bytes, need) ||
	    (s->separate && kvr_sched_device_grow(s, &ls->dev, &ls->dev_bytes, need))) {
		snprintf(s->last_error, sizeof(s->last_error), "out of memory for the step's scratch");
		return -ENOMEM;
	}
	unsigned char *mem = ls->mem;
	struct kvr_attention_item *items = (void *)(mem + off[0]);
	struct kvr_kv_segment *segs = (void *)(mem + off[1]);
	struct entry *e = (void *)(mem + off[2]);
	float *cosine = (void *)(mem + off[3]);
	uint8_t *corrected = mem + off[4];
	struct kvr_lane **att_lanes = (void *)(mem + off[5]);

	/* 2. Dense or sparse; which heads are corrected. */
	for (uint32_t i = 0; i < batch; i++) {
		e[i] = (struct entry){ SEQ_FAILED, 0, positions[i] + 1 };
		if (status[i])
			continue;
		const uint32_t seq = seqs[i];
		struct kvr_lane *lane = lane_of(s, seq, layer);
		uint8_t *corr = corrected + (uint64_t)i * n_kv;
		memset(corr, 0, n_kv);
		if (dense_layer || e[i].n_tokens <= c->budget_tokens) {
			e[i].kind = SEQ_DENSE;
			lane->has_prev = 0; /* the first sparse step selects afresh */
			continue;
		}
		e[i].kind = SEQ_SPARSE;
		if (!kk)
			continue; /* sink + window only: nothing to select */
		if (c->mode == KVR_MODE_BLOCKING || !lane->has_prev) {
			memset(corr, 1, n_kv);
		} else if (c->mode == KVR_MODE_FREEKV) {
			const uint64_t t0 = kvr_now_ns();
			struct kvr_similarity_item *si = &s->engine_items->similarity;
			*si = (struct kvr_similarity_item){ q_dev + i * q_row, lane->prev_q,
							    cosine + (uint64_t)i * n_kv, corr };
			int err = kvr_sched_items_to_device(s, s->engine_inline,
							    &s->engine_items_dev->similarity, si,
							    sizeof(*si));
			if (!err)
				err = kvr_dev_similarity(s->dev, &s->shape,
							 &s->engine_items_dev->similarity, 1,
							 s->engine_inline);
			if (!err && s->separate) /* the host reads corr */
				err = kvr_dev_stream_synchronize(s->dev, s->engine_inline);
			if (err) {
				snprintf(s->last_error, sizeof(s->last_error), "similarity: %s",
					 kvr_dev_last_error(s->dev));
				return err;
			}
			uint32_t n_corr = 0;
			for (uint32_t m = 0; m < n_kv; m++) {
				n_corr += corr[m];
				if (corr[m])
					atomic_fetch_add_explicit(
						&s->head_corrections[(uint64_t)seq * n_kv + m], 1,
						memory_order_relaxed);
			}
			count(s, seq, KVR_C_CHECKED_HEADS, n_kv);
			count(s, seq, KVR_C_CORRECTED_HEADS, n_corr);
			if (tr)
				kvr_trace_span(tr, "correction check", KVR_TRACK_ENGINE, seq, layer, n_corr,
					       t0, kvr_now_ns());
		}
		for (uint32_t m = 0; m < n_kv; m++)
			e[i].any_corrected |= corr[m];
		if (e[i].any_corrected)
			e[i].kind = SEQ_CORRECTED;
	}

	/* 3. Attention for the sequences with nothing to correct, first. */
	uint32_t n_items = 0, n_segs = 0, n_att = 0;
	int err = 0;
	for (uint32_t i = 0; i < batch && !err; i++) {
		if (e[i].kind != SEQ_DENSE && e[i].kind != SEQ_SPARSE)
			continue;
		struct kvr_lane *lane = lane_of(s, seqs[i], layer);
		const int dense = e[i].kind == SEQ_DENSE;
		const int slots = !dense && kk && s->recall == KVR_RECALL_STREAMED;
		if (slots)
			err = wait_recall(s, lane, 0);
		const uint32_t items_before = n_items, segs_before = n_segs;
		const size_t pins_before = s->n_step_pins;
		int seg_err = 0;
		for (uint32_t m = 0; m < n_kv && !seg_err; m++) {
			const uint32_t n = build_segments(s, lane, m, e[i].n_tokens, dense,
							  lane->selected + (uint64_t)m * kk, slots,
							  segs + n_segs, &seg_err);
			items[n_items++] = (struct kvr_attention_item){
				q_dev + i * q_row + m * head_q_bytes,
				(unsigned char *)out + i * q_row + m * head_q_bytes,
				kvr_importance_item(s, lane, m, e[i].n_tokens, n), n_segs, n };
			n_segs += n;
		}
		if (seg_err) { /* spill tier: a page it reads in place did not fit in RAM */
			n_items = items_before, n_segs = segs_before;
			unpin_from(s, pins_before); /* its pins must not fail the others */
			status[i] = seg_err;
			e[i].kind = SEQ_FAILED;
			fail_sequence(s, seqs[i], layer, positions[i], seg_err, s->last_error,
				      (unsigned char *)out + i * q_row);
			continue;
		}
		att_lanes[n_att++] = lane;
		count(s, seqs[i], KVR_C_LAYER_DECODES, 1);
		count(s, seqs[i], KVR_C_DENSE_DECODES, (uint64_t)dense);
	}
	if (!err)
		err = run_attention(s, layer, ls, items, n_items, segs, 0, n_segs, att_lanes, n_att);

	/* 4. Sequences with corrected heads: select now, recall, attend. */
	const uint32_t first_item = n_items, first_att = n_att, first_seg = n_segs;
	for (uint32_t i = 0; i < batch && !err; i++) {
		if (e[i].kind != SEQ_CORRECTED)
			continue;
		const uint32_t seq = seqs[i];
		struct kvr_lane *lane = lane_of(s, seq, layer);
		const unsigned char *qi = q_dev + i * q_row;
		const uint8_t *corr = corrected + (uint64_t)i * n_kv;
		int32_t *now_sel = s->now_sel + (uint64_t)i * n_kv * kk;
		const uint64_t t0 = kvr_now_ns();
		/* the selection serves step i+1 too (but in blocking mode, which
		 * selects again): its candidates are those of step i+1, a superset
		 * of step i's, so a page leaving the window stays covered */
		err = kvr_select_pages(s, lane, q_dev + i * q_row, e[i].n_tokens,
				       c->mode != KVR_MODE_BLOCKING, now_sel,
				       s->engine_inline, &s->engine_items->score,
				       &s->engine_items_dev->score, &s->engine_scores,
				       &s->engine_scores_bytes);
		if (err) {
			snprintf(s->last_error, sizeof(s->last_error), "selection: %s",
				 kvr_dev_last_error(s->dev));
			break;
		}
		count(s, seq, KVR_C_SELECTIONS, 1);
		const uint64_t t1 = kvr_now_ns();
		if (tr)
			kvr_trace_span(tr, "select now (correction)", KVR_TRACK_ENGINE, seq, layer, n_kv,
				       t0, t1);
		if (s->recall == KVR_RECALL_STREAMED) {
			/* the corrected heads' misses, before attention: an urgent job */
			memcpy(lane->selected, now_sel, (size_t)n_kv * kk * sizeof(int32_t));
			memcpy(lane->job_heads, corr, n_kv);
			lane->job = LANE_JOB_RECALL;
			kvr_controller_post(s, lane, 1);
			kvr_lane_acquire(s, lane);
			err = wait_recall(s, lane, 1);
			if (tr)
				kvr_trace_span(tr, "wait urgent recall", KVR_TRACK_ENGINE, seq, layer, 0, t1,
					       kvr_now_ns());
		}
		count(s, seq, KVR_C_CORRECTION_WAITS, 1);
		count(s, seq, KVR_C_CORRECTION_WAIT_NS, kvr_now_ns() - t0);
		const uint32_t items_before = n_items, segs_before = n_segs;
		const size_t pins_before = s->n_step_pins;
		const int recall_err = lane->recall_error; /* the urgent recall failed */
		int seg_err = recall_err;
		lane->recall_error = 0;
		for (uint32_t m = 0; m < n_kv && !seg_err; m++) {
			const int32_t *sel = corr[m] ? now_sel + (uint64_t)m * kk
						     : lane->selected + (uint64_t)m * kk;
			const uint32_t n = build_segments(s, lane, m, e[i].n_tokens, 0, sel,
							  s->recall == KVR_RECALL_STREAMED, segs + n_segs,
							  &seg_err);
			items[n_items++] = (struct kvr_attention_item){
				qi + m * head_q_bytes, (unsigned char *)out + i * q_row + m * head_q_bytes,
				kvr_importance_item(s, lane, m, e[i].n_tokens, n), n_segs, n };
			n_segs += n;
		}
		if (seg_err) {
			n_items = items_before, n_segs = segs_before;
			unpin_from(s, pins_before);
			status[i] = seg_err;
			e[i].kind = SEQ_FAILED;
			fail_sequence(s, seq, layer, positions[i], seg_err,
				      recall_err ? s->urgent_message : s->last_error,
				      (unsigned char *)out + i * q_row);
			continue;
		}
		att_lanes[n_att++] = lane;
		count(s, seq, KVR_C_LAYER_DECODES, 1);
	}
	if (!err)
		err = run_attention(s, layer, ls, items + first_item, n_items - first_item, segs,
				    first_seg, n_segs, att_lanes + first_att, n_att - first_att);
	/* the attention has run when it is synchronous: its pages may leave RAM
	 * (and mixed pages' window pages be demoted below) */
	if (!s->hooks.async_compute && !s->separate)
		unpin_step(s);
	if (err) {
		if (!s->last_error[0])
			snprintf(s->last_error, sizeof(s->last_error), "%s", kvr_dev_last_error(s->dev));
		return err;
	}

	/* 5. Keep q_i; post the next step's work (mixed pages: judge those the
	 * next selection may name for the first time, before it can). */
	for (uint32_t i = 0; i < batch; i++) {
		if (e[i].kind == SEQ_FAILED)
			continue;
		const uint32_t seq = seqs[i];
		struct kvr_lane *lane = lane_of(s, seq, layer);
		kvr_importance_judge(s, lane, e[i].n_tokens);
		if ((e[i].kind != SEQ_SPARSE && e[i].kind != SEQ_CORRECTED) || !kk)
			continue;
		memcpy(lane->prev_q, q_host + i * q_row, q_row);
		lane->has_prev = 1;
		if (c->mode == KVR_MODE_BLOCKING)
			continue; /* selects again at the next step */
		lane->job_n_tokens = e[i].n_tokens;
		if (e[i].kind == SEQ_CORRECTED) {
			/* one selection per step: the corrected one serves the next step */
			const int32_t *now_sel = s->now_sel + (uint64_t)i * n_kv * kk;
			memcpy(lane->selected, now_sel, (size_t)n_kv * kk * sizeof(int32_t));
			if (s->recall != KVR_RECALL_STREAMED)
				continue;
			const uint8_t *corr = corrected + (uint64_t)i * n_kv;
			uint32_t rest = 0;
			for (uint32_t m = 0; m < n_kv; m++)
				rest += (lane->job_heads[m] = !corr[m]);
			if (!rest)
				continue;
			lane->job = LANE_JOB_RECALL; /* deferred: after this attention */
		} else {
			memset(lane->job_heads, 1, n_kv);
			lane->job = LANE_JOB_SELECT;
		}
		kvr_controller_post(s, lane, 0);
	}
	if (engine_stream) {
		/* the engine's next kernels read `out` */
		int err2 = kvr_dev_event_record(s->dev, s->layer_done, s->compute);
		if (!err2)
			err2 = kvr_dev_stream_wait_event(s->dev, engine_stream, s->layer_done);
		if (err2) {
			snprintf(s->last_error, sizeof(s->last_error), "ordering the engine's stream: %s",
				 kvr_dev_last_error(s->dev));
			return err2;
		}
	}
	const uint64_t t_leave = kvr_now_ns();
	for (uint32_t i = 0; i < batch; i++)
		atomic_fetch_add_explicit(&s->seq_counters[(uint64_t)seqs[i] * KVR_C_COUNT + KVR_C_CRITICAL_NS],
					  (t_leave - t_enter) / batch, memory_order_relaxed);
	atomic_fetch_add_explicit(&s->counters[KVR_C_CRITICAL_NS], t_leave - t_enter,
				  memory_order_relaxed);
	if (tr)
		kvr_trace_span(tr, "decode layer", KVR_TRACK_ENGINE, batch == 1 ? seqs[0] : UINT32_MAX,
			       layer, batch, t_enter, t_leave);
	return 0;
}

void kvr_sched_step_abandon(struct kvr_sched *s, uint32_t batch, const uint32_t *seqs,
			    const uint64_t *positions, uint32_t layer, int err, const char *why)
{
	for (uint32_t i = 0; i < batch; i++)
		mark_failed(s, seqs[i], layer, positions[i], err, why);
}

int kvr_sched_step_failure(const struct kvr_sched *s, uint32_t seq, uint32_t *layer,
			   const char **message)
{
	*layer = s->step_fail_layer[seq];
	*message = s->step_fail_message + (size_t)seq * KVR_SCHED_MESSAGE;
	return s->step_fail[seq];
}

int kvr_sched_step_end(struct kvr_sched *s)
{
	/* the next step rewrites the layers' mapped scratch the attention reads */
	int err = 0;
	if (s->hooks.async_compute || s->separate)
		err = kvr_dev_stream_synchronize(s->dev, s->compute);
	unpin_step(s); /* the step's attention has read its pages */
	settle_failed(s);
	s->step_serial++;
	return err;
}

/* ------------------------------------------------------------------ sequences */

static void lane_forget(struct kvr_sched *s, struct kvr_lane *lane)
{
	lane->has_prev = 0;
	lane->recall_error = 0; /* it was about pages that are gone or re-selected */
	kvr_resident_lane_forget(lane);
	kvr_importance_lane_forget(s, lane);
	for (uint32_t i = 0; i < s->c.n_kv_heads * s->k; i++)
		lane->selected[i] = -1;
	if (lane->slot_page)
		for (uint32_t i = 0; i < s->c.n_kv_heads * s->k; i++)
			lane->slot_page[i] = -1;
}

static void lane_release(struct kvr_sched *s, struct kvr_lane *lane)
{
	kvr_recall_lane_free(s, lane);
	kvr_resident_lane_free(s, lane);
	kvr_importance_lane_free(s, lane);
	free(lane->slot_fmt);
	lane->slot_fmt = NULL;
	kvr_sched_mapped_free(s, lane->prev_q);
	kvr_sched_mapped_free(s, lane->selected);
	free(lane->slot_page);
	free(lane->job_heads);
	lane->prev_q = NULL;
	lane->selected = NULL;
	lane->slot_page = NULL;
	lane->job_heads = NULL;
}

void kvr_sched_seq_quiesce(struct kvr_sched *s, uint32_t seq)
{
	for (uint32_t l = 0; l < s->c.n_layers; l++) {
		struct kvr_lane *lane = lane_of(s, seq, l);
		kvr_lane_acquire(s, lane);
		/* the lane's recall may still be running on the streams */
		if (lane->recall_done)
			kvr_dev_event_synchronize(s->dev, lane->recall_done);
	}
}

int kvr_sched_seq_open(struct kvr_sched *s, uint32_t seq, unsigned char *tails)
{
	const size_t n_sel = (size_t)s->c.n_kv_heads * (s->k ? s->k : 1);
	int units_err = kvr_units_seq_open(s); /* quantised pages: a sequence's units */
	if (units_err)
		return units_err; /* its message in last_error */
	for (uint32_t l = 0; l < s->c.n_layers; l++) {
		struct kvr_lane *lane = lane_of(s, seq, l);
		memset(lane, 0, sizeof(*lane));
		lane->seq = seq;
		lane->layer = l;
		int err = kvr_sched_mapped_alloc(s, s->q_row, (void **)&lane->prev_q);
		if (!err)
			err = kvr_sched_mapped_alloc(s, n_sel * sizeof(int32_t), (void **)&lane->selected);
		lane->job_heads = kvr_malloc(s->c.n_kv_heads);
		if (!err && !lane->job_heads)
			err = -ENOMEM;
		if (!err && s->recall == KVR_RECALL_STREAMED && !layer_dense(s, l) &&
		    !(lane->slot_page = kvr_malloc(n_sel * sizeof(int32_t))))
			err = -ENOMEM;
		if (!err && lane->slot_page && s->kv_format == KVR_KV_MIXED &&
		    !(lane->slot_fmt = kvr_calloc(n_sel, 1)))
			err = -ENOMEM;
		if (!err)
			err = kvr_importance_lane_open(s, lane);
		if (!err)
			err = kvr_recall_lane_alloc(s, lane); /* events; slots when it has a slot table */
		if (!err)
			err = kvr_resident_lane_open(s, lane);
		if (err) {
			snprintf(s->last_error, sizeof(s->last_error),
				 "device memory for sequence %u's page cache (layer %u): %s", seq, l,
				 err == -ENOMEM ? "out of memory" : kvr_dev_last_error(s->dev));
			for (uint32_t j = 0; j <= l; j++)
				lane_release(s, lane_of(s, seq, j));
			kvr_units_seq_close(s, seq); /* nothing taken yet: the reservation only */
			return err;
		}
		lane_forget(s, lane);
	}
	s->tails[seq] = tails;
	for (uint32_t i = 0; i < KVR_C_COUNT; i++)
		atomic_store_explicit(&s->seq_counters[(uint64_t)seq * KVR_C_COUNT + i], 0,
				      memory_order_relaxed);
	for (uint32_t m = 0; m < s->c.n_kv_heads; m++)
		atomic_store_explicit(&s->head_corrections[(uint64_t)seq * s->c.n_kv_heads + m], 0,
				      memory_order_relaxed);
	return 0;
}

void kvr_sched_seq_close(struct kvr_sched *s, uint32_t seq)
{
	kvr_sched_seq_quiesce(s, seq);
	/* A stream may still be inside the operation that completed one of the
	 * lane's events (waking waiters after publishing completion): drain the
	 * streams that record them before the events are destroyed. */
	if (s->copy)
		kvr_dev_stream_synchronize(s->dev, s->copy);
	if (s->convert)
		kvr_dev_stream_synchronize(s->dev, s->convert);
	kvr_dev_stream_synchronize(s->dev, s->compute);
	kvr_units_seq_close(s, seq); /* no stream reads the units any more */
	for (uint32_t l = 0; l < s->c.n_layers; l++)
		lane_release(s, lane_of(s, seq, l));
	s->tails[seq] = NULL;
}

void kvr_sched_seq_reset(struct kvr_sched *s, uint32_t seq)
{
	kvr_sched_seq_quiesce(s, seq);
	for (uint32_t l = 0; l < s->c.n_layers; l++)
		lane_forget(s, lane_of(s, seq, l));
}

/* ------------------------------------------------------------------ lifecycle */

int kvr_sched_create(const struct kvr_sched_params *params, struct kvr_sched **out, char *err,
		     size_t err_bytes)
{
	struct kvr_sched *s = kvr_calloc(1, sizeof(*s));
	if (!s) {
		snprintf(err, err_bytes, "scheduler: out of memory");
		return -ENOMEM;
	}
	const struct kvr_config *c = params->config;
	s->c = *c;
	s->pool = params->pool;
	s->dev = params->dev;
	s->pool_layout = params->pool_layout;
	s->recall = params->recall;
	s->separate = !kvr_dev_host_visible(s->dev);
	s->jobs_inline = c->controller == KVR_CONTROLLER_INLINE;
	if (params->hooks)
		s->hooks = *params->hooks;
	s->log_fn = params->log_fn;
	s->log_user = params->log_user;
	s->k = (c->budget_tokens - c->sink_tokens - c->window_tokens) / c->page_tokens;
	s->G = c->n_qo_heads / c->n_kv_heads;
	s->eb = kvr_elem_bytes(c->dtype);
	s->q_row = (uint64_t)c->n_qo_heads * c->head_dim * s->eb;
	s->kv_row = (uint64_t)c->n_kv_heads * c->head_dim * s->eb;
	s->tile_bytes = (uint64_t)c->page_tokens * s->kv_row;
	s->kv_format = c->kv_format;
	s->head_bytes = kvr_kv_run_bytes(c->kv_format, c->page_tokens, c->head_dim, s->eb);
	s->units_per_slot = c->kv_format ? kvr_units_per_slot(c) : 0;
	const float scale = 1.0f / sqrtf((float)c->head_dim);
	s->shape = (struct kvr_shape){ c->n_qo_heads, c->n_kv_heads, c->head_dim, c->page_tokens,
				       c->dtype, scale, c->tau, 0 };
	s->head_shape = (struct kvr_shape){ s->G, 1, c->head_dim, c->page_tokens, c->dtype, scale,
					    c->tau, 0 };
	s->lse_shape = s->head_shape;
	s->lse_shape.flags = KVR_SHAPE_SEGMENT_LSE;
	for (uint32_t w = 0; w < 4; w++)
		s->hook_args[w] = (struct hook_arg){ s, w };
	pthread_mutex_init(&s->lock, NULL);
	pthread_cond_init(&s->work, NULL);
	pthread_cond_init(&s->done, NULL);
	pthread_mutex_init(&s->error_lock, NULL);

	int ret = 0;
	const size_t n_lanes = (size_t)c->max_sequences * c->n_layers;
	s->lanes = kvr_calloc(n_lanes, sizeof(*s->lanes));
	s->tails = kvr_calloc(c->max_sequences, sizeof(*s->tails));
	s->scratch = kvr_calloc(c->n_layers, sizeof(*s->scratch));
	s->seq_counters = kvr_calloc((size_t)c->max_sequences * KVR_C_COUNT, sizeof(*s->seq_counters));
	s->head_corrections = kvr_calloc((size_t)c->max_sequences * c->n_kv_heads,
				     sizeof(*s->head_corrections));
	s->step_fail = kvr_calloc(c->max_sequences, sizeof(*s->step_fail));
	s->step_fail_pos = kvr_calloc(c->max_sequences, sizeof(*s->step_fail_pos));
	s->step_serial = 1; /* lanes start at appended_step 0: never */
	s->step_failed = kvr_calloc(c->max_sequences, sizeof(*s->step_failed));
	s->step_fail_layer = kvr_calloc(c->max_sequences, sizeof(*s->step_fail_layer));
	s->step_fail_message = kvr_calloc(c->max_sequences, KVR_SCHED_MESSAGE);
	if (!s->lanes || !s->tails || !s->scratch || !s->seq_counters || !s->head_corrections ||
	    !s->step_fail || !s->step_fail_pos || !s->step_failed || !s->step_fail_layer ||
	    !s->step_fail_message) {
		snprintf(err, err_bytes, "scheduler: out of memory");
		ret = -ENOMEM;
	}
	if (!ret && (!(s->seg_pages = kvr_malloc((s->k ? s->k : 1) * sizeof(*s->seg_pages))) ||
		     !(s->seg_slots = kvr_malloc((s->k ? s->k : 1) * sizeof(*s->seg_slots))))) {
		snprintf(err, err_bytes, "scheduler: out of memory");
		ret = -ENOMEM;
	}
	if (!ret)
		ret = kvr_sched_mapped_alloc(s, (size_t)c->max_batch * c->n_kv_heads * (s->k ? s->k : 1) *
							sizeof(int32_t), (void **)&s->now_sel);
	if (!ret)
		ret = kvr_sched_mapped_alloc(s, sizeof(*s->engine_items), (void **)&s->engine_items);
	if (!ret)
		ret = kvr_sched_mapped_alloc(s, sizeof(*s->ctl_items), (void **)&s->ctl_items);
	s->engine_items_dev = s->engine_items;
	s->ctl_items_dev = s->ctl_items;
	if (!ret && s->separate) {
		s->engine_items_dev = NULL;
		s->ctl_items_dev = NULL;
		ret = kvr_dev_alloc(s->dev, sizeof(*s->engine_items_dev), (void **)&s->engine_items_dev);
		if (!ret)
			ret = kvr_dev_alloc(s->dev, sizeof(*s->ctl_items_dev), (void **)&s->ctl_items_dev);
	}
	if (!ret && s->separate) {
		if (!(s->zero_row = kvr_calloc(1, s->q_row)))
			ret = -ENOMEM;
		if (!ret)
			ret = kvr_dev_event_create(s->dev, &s->engine_ready);
		if (!ret)
			ret = kvr_dev_event_create(s->dev, &s->layer_done);
	}
	if (ret && !err[0])
		snprintf(err, err_bytes, "scheduler: %s",
			 ret == -ENOMEM ? "out of memory" : kvr_dev_last_error(s->dev));
	if (!ret && (ret = kvr_dev_stream_create(s->dev, 0, &s->engine_inline)) == 0 &&
	    (ret = kvr_dev_stream_create(s->dev, s->hooks.async_compute ? KVR_STREAM_WORKER : 0,
					 &s->compute)) == 0)
		ret = kvr_dev_stream_create(s->dev, 0, &s->ctl_inline);
	if (ret && !err[0])
		snprintf(err, err_bytes, "scheduler: %s", kvr_dev_last_error(s->dev));
	if (!ret)
		ret = kvr_recall_setup(s, err, err_bytes);
	if (!ret)
		ret = kvr_units_setup(s, err, err_bytes);
	if (!ret && (ret = kvr_controller_start(s)))
		snprintf(err, err_bytes, "scheduler: cannot start the controller thread: %s",
			 strerror(-ret));
	if (ret) {
		kvr_sched_destroy(s);
		return ret;
	}
	*out = s;
	return 0;
}

void kvr_sched_destroy(struct kvr_sched *s)
{
	if (!s)
		return;
	kvr_controller_stop(s);
	if (s->lanes)
		for (uint32_t seq = 0; seq < s->c.max_sequences; seq++)
			if (s->tails && s->tails[seq])
				kvr_sched_seq_close(s, seq);
	kvr_recall_teardown(s);
	kvr_units_teardown(s);
	if (s->compute)
		kvr_dev_stream_synchronize(s->dev, s->compute);
	unpin_step(s);
	free(s->step_pins);
	kvr_dev_stream_destroy(s->dev, s->engine_inline);
	kvr_dev_stream_destroy(s->dev, s->compute);
	kvr_dev_stream_destroy(s->dev, s->ctl_inline);
	if (s->scratch)
		for (uint32_t l = 0; l < s->c.n_layers; l++) {
			kvr_sched_mapped_free(s, s->scratch[l].mem);
			kvr_sched_device_free(s, s->scratch[l].dev);
		}
	if (s->separate) {
		kvr_dev_free(s->dev, s->engine_items_dev);
		kvr_dev_free(s->dev, s->ctl_items_dev);
	}
	free(s->scratch);
	free(s->lanes);
	free(s->tails);
	free(s->step_fail);
	free(s->step_fail_pos);
	free(s->step_failed);
	free(s->step_fail_layer);
	free(s->step_fail_message);
	free(s->seg_pages);
	free(s->seg_slots);
	kvr_sched_mapped_free(s, s->now_sel);
	kvr_sched_mapped_free(s, s->engine_items);
	kvr_sched_mapped_free(s, s->ctl_items);
	kvr_sched_mapped_free(s, s->mirror);
	kvr_sched_device_free(s, s->engine_scores);
	kvr_sched_device_free(s, s->ctl_scores);
	kvr_sched_device_free(s, s->prefill_q);
	kvr_sched_device_free(s, s->prefill_out);
	free(s->zero_row);
	kvr_dev_event_destroy(s->dev, s->engine_ready);
	kvr_dev_event_destroy(s->dev, s->layer_done);
	free((void *)s->seq_counters);
	free((void *)s->head_corrections);
	pthread_mutex_destroy(&s->lock);
	pthread_cond_destroy(&s->work);
	pthread_cond_destroy(&s->done);
	pthread_mutex_destroy(&s->error_lock);
	free(s);
}

const char *kvr_sched_last_error(const struct kvr_sched *s)
{
	return s->last_error;
}

void kvr_sched_counters(const struct kvr_sched *s, uint32_t seq, uint64_t out[KVR_C_COUNT])
{
	struct kvr_sched *ms = (struct kvr_sched *)s;
	for (uint32_t i = 0; i < KVR_C_COUNT; i++)
		out[i] = seq == UINT32_MAX
				 ? atomic_load_explicit(&ms->counters[i], memory_order_relaxed)
				 : atomic_load_explicit(&ms->seq_counters[(uint64_t)seq * KVR_C_COUNT + i],
							memory_order_relaxed);
}

void kvr_sched_head_corrections(const struct kvr_sched *s, uint32_t seq, uint64_t *out,
				uint32_t n_kv)
{
	struct kvr_sched *ms = (struct kvr_sched *)s;
	for (uint32_t m = 0; m < n_kv; m++) {
		out[m] = 0;
		for (uint32_t q = 0; q < s->c.max_sequences; q++)
			if (seq == UINT32_MAX || q == seq)
				out[m] += atomic_load_explicit(&ms->head_corrections[(uint64_t)q * n_kv + m],
							       memory_order_relaxed);
	}
}

int kvr_sched_async_error(struct kvr_sched *s, const char **message)
{
	pthread_mutex_lock(&s->error_lock);
	const int err = s->async_error;
	s->async_error = 0;
	pthread_mutex_unlock(&s->error_lock);
	if (message)
		*message = s->async_message;
	return err;
}

void kvr_sched_set_trace(struct kvr_sched *s, struct kvr_trace *trace)
{
	/* release pairs with trace_of's acquire in the recording threads */
	atomic_store_explicit(&s->trace, trace, memory_order_release);
}

/* ------------------------------------------------------------------ prefill attention */

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
				pin_err = pin_in_place(s, id);
				if (pin_err)
					snprintf(s->last_error, sizeof(s->last_error),
						 "prefill attention of sequence %u layer %u: page %u of %u: %s", seq,
						 layer, j, need, kvr_pool_last_error(s->pool));
			}
			if (pin_err) {
				unpin_step(s);
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
					segs[n_segs++] = pool_segment(s, plane, j, m, 0, &pin_err);
				if (rest && whole < n_full) {
					/* the page holding pos is already in the pool: its first rows */
					segs[n_segs] = pool_segment(s, plane, whole, m, 0, &pin_err);
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
		unpin_step(s);
		if (err) {
			snprintf(s->last_error, sizeof(s->last_error), "%s", kvr_dev_last_error(s->dev));
			return err;
		}
	}
	return 0;
}
