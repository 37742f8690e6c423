/* SPDX-License-Identifier: MIT */
/*
 * step.c — docs/design.md, "The decode step", per (sequence, layer), on the
 * engine's thread: one layer call for a batch and its host path, failed
 * sequences' bookkeeping, and the step's end. The append of the tokens is
 * step_append.c, the device plan step_device.c (what they share with this
 * file: step_impl.h). Selection is select.c, the segments attention reads
 * segments.c, lanes' lifecycle lanes.c, prefill attention prefill.c, the
 * scheduler's own lifecycle sched.c.
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
 * Which pages attention reads (segments.c): with zero-copy recall (the cpu backend's
 * default) the selected pages straight from the pool; with streamed recall
 * the lane's device slots, in ascending page order, so both give identical
 * results. Sink, window and tail are read where they live (pool pages and the
 * tail tile); the dense path (L ≤ B, dense layers, mode dense) reads every
 * page of the pool.
 *
 * The device path (a device with memory of its own, an HND pool of plain,
 * K8V4 or K4V2 pages):
 * the host never waits for the device inside a layer call (waits.c
 * counts the waits that remain). The device append writes the token
 * into the tail tile and converts a completed page on the compute stream
 * (the host does the pool's bookkeeping only). The device plan (zero-copy,
 * or streamed without a spill tier) replaces 2-4: the similarity kernel
 * flags heads, score and select run gated by the flags, the plan kernel
 * builds the selected pages' segments (streamed: plans the slots and moves
 * the misses straight from the pinned pool with one scatter), attention;
 * the flags and recall counts are tallied at the step's end. The host does
 * not know which heads were corrected, so every freekv and speculative lane
 * posts a selection job: after a correction the controller selects again
 * with the same query, the same pages. hooks.host_step turns both off. The
 * cpu backend keeps the host path: its host reads device memory in place.
 *
 * Threads: the engine's thread (one step at a time per context).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "step_impl.h"

/* The step of `seq` failed at `layer` for `reason`: its later layers fail
 * too, and step_end takes back what its earlier layers appended. The reason
 * is kept as one sentence, "sequence S layer L: ...", the subject said once
 * even when the reason (a pool message) already names it. */
void kvr_sched_mark_failed(struct kvr_sched *s, uint32_t seq, uint32_t layer, uint64_t position, int err,
			   const char *reason)
{
	if (s->eng.step_fail[seq])
		return;
	s->eng.step_fail[seq] = err;
	s->eng.step_fail_pos[seq] = position;
	s->eng.step_fail_layer[seq] = layer;
	s->eng.step_failed[s->eng.n_step_failed++] = seq;
	char subject[48];
	snprintf(subject, sizeof(subject), "sequence %u layer %u: ", seq, layer);
	char *message = s->eng.step_fail_message + (size_t)seq * KVR_SCHED_MESSAGE;
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
void kvr_step_fail_sequence(struct kvr_sched *s, uint32_t seq, uint32_t layer, uint64_t position, int err,
			    const char *reason, unsigned char *out)
{
	struct kvr_lane *lane = lane_of(s, seq, layer);
	if (!reason)
		reason = err == -EBADMSG ? "a page read back from the spill file failed its checksum"
			 : err == -EIO	 ? "reading a page from the spill file failed"
					 : kvr_strerror(err);
	kvr_sched_mark_failed(s, seq, layer, position, err, reason);
	kvr_step_zero_output(s, out);
	count(s, seq, KVR_C_FAILED_DECODES, 1);
	lane->has_prev = 0;
	if (lane->slot_page)
		for (uint32_t j = 0; j < s->c.n_kv_heads * s->k; j++)
			lane->slot_page[j] = -1;
}

/* Step end: every layer of a failed sequence back at its step's position. */
static void settle_failed(struct kvr_sched *s)
{
	for (uint32_t i = 0; i < s->eng.n_step_failed; i++) {
		const uint32_t seq = s->eng.step_failed[i];
		/* Only the layers this step appended to are taken back: a layer the
		 * step failed at (a position below its length, say) keeps what it
		 * held before the step. */
		int appended = 0;
		for (uint32_t l = 0; l < s->c.n_layers; l++)
			appended |= lane_of(s, seq, l)->appended_step == s->eng.step_serial;
		if (appended) {
			/* the layers that did decode posted their next step's work */
			kvr_sched_seq_quiesce(s, seq);
			for (uint32_t l = 0; l < s->c.n_layers; l++) {
				struct kvr_lane *lane = lane_of(s, seq, l);
				if (lane->appended_step == s->eng.step_serial) {
					kvr_pool_truncate(s->pool, seq, l, s->eng.step_fail_pos[seq]);
					lane->appended_step = 0;
				}
				kvr_sched_lane_forget(s, lane);
			}
		}
		s->eng.step_fail[seq] = 0;
	}
	s->eng.n_step_failed = 0;
}

/* ------------------------------------------------------------------ one layer */

/* Wait (streamed recall) until the lane's latest recall is complete before
 * attention reads its slots: a stream wait on the compute stream. A GPU
 * honours it on the device; a host-synchronous compute stream (cpu, cudaemu)
 * by blocking the engine, which is measured here as a recall wait. That block
 * emulates the device's order and is no host wait of the scheduler's
 * (waits.c). */
int kvr_step_wait_recall(struct kvr_sched *s, struct kvr_lane *lane, int correction)
{
	if (s->recall != KVR_RECALL_STREAMED)
		return 0;
	if (s->compute_host_sync && kvr_dev_event_query(s->dev, lane->recall_done) == -EAGAIN) {
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
 * The items and segments sit in the host view of the layer's scratch `ls`;
 * segments from seg_begin on are this call's (they reach the kernels' view
 * first). */
int kvr_step_run_attention(struct kvr_sched *s, uint32_t layer, struct layer_scratch *ls,
			   const struct kvr_attention_item *items, uint32_t n_items,
			   const struct kvr_kv_segment *segs, uint32_t seg_begin, uint32_t n_segs,
			   struct kvr_lane **lanes, uint32_t n_lanes, int uploaded)
{
	if (!n_items)
		return 0;
	const uint64_t t0 = kvr_now_ns();
	int err = 0;
	if (!uploaded) /* the device plan uploaded them before its plan kernel */
		err = kvr_mirror_to_device(s->dev, &ls->m, items, n_items * sizeof(*items), s->compute);
	if (!err && !uploaded)
		err = kvr_mirror_to_device(s->dev, &ls->m, segs + seg_begin, (n_segs - seg_begin) * sizeof(*segs),
					   s->compute);
	items = kvr_mirror_dev_at(&ls->m, items);
	segs = kvr_mirror_dev_at(&ls->m, segs);
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

/* A failed sequence's output rows: zeros, after the attention queued before. */
void kvr_step_zero_output(struct kvr_sched *s, void *out_row)
{
	kvr_dev_memcpy_async(s->dev, out_row, s->eng.zero_row, s->q_row, KVR_COPY_H2D, s->compute);
}

/* One layer call's state, shared by its phases (engine thread). */

/* Order the layer's work after the engine's stream and give the host its
 * view of q, k, v (the append and the previous query are host work). */
static int layer_inputs(struct layer_call *lc, const void *q, const void *k, const void *v,
			struct kvr_stream *engine_stream)
{
	struct kvr_sched *s = lc->s;
	const size_t q_bytes = (size_t)lc->batch * s->q_row, kv_bytes = (size_t)lc->batch * s->kv_row;
	lc->q_dev = q;
	int err = kvr_host_stage_grow(s->dev, (void **)&s->eng.inputs_stage, &s->eng.inputs_stage_bytes,
				      (size_t)s->c.max_batch * (s->q_row + 2 * s->kv_row));
	if (err) {
		snprintf(s->last_error, sizeof(s->last_error), "reading the layer's q, k, v: out of memory");
		return err;
	}
	if (engine_stream) {
		err = kvr_dev_event_record(s->dev, s->eng.engine_ready, engine_stream);
		if (!err)
			err = kvr_dev_stream_wait_event(s->dev, s->engine_inline, s->eng.engine_ready);
		if (!err)
			err = kvr_dev_stream_wait_event(s->dev, s->compute, s->eng.engine_ready);
		if (err)
			goto fail;
	}
	lc->k_dev = k, lc->v_dev = v;
	if (lc->device_append)
		return 0; /* the host reads none of them */
	const void *view = NULL;
	void *stage = s->eng.inputs_stage; /* NULL where the host reads q, k, v in place */
	/* in place: this call's q, k, v are the engine's, ready when it calls */
	err = kvr_host_view(s->dev, stage, 0, q, q_bytes, s->engine_inline, &view);
	lc->q_host = view;
	if (!err)
		err = kvr_host_view(s->dev, stage, q_bytes, k, kv_bytes, s->engine_inline, &view);
	lc->k_host = view;
	if (!err)
		err = kvr_host_view(s->dev, stage, q_bytes + kv_bytes, v, kv_bytes, s->engine_inline, &view);
	lc->v_host = view;
	if (!err && stage)
		err = kvr_sched_wait_stream(s, s->engine_inline, UINT32_MAX, lc->layer,
					    "wait inputs (q, k, v to the host)");
	if (!err)
		return 0;
fail:
	snprintf(s->last_error, sizeof(s->last_error), "reading the layer's q, k, v: %s", kvr_dev_last_error(s->dev));
	return err;
}

/* The layer scratch's regions for a layer call of `batch` sequences of up
 * to max_pages full pages: offsets into off[], the total returned. What the
 * device plan's kernels read comes first and in one run (appends, sims,
 * score items, plans, items, segments), so that one copy uploads it
 * (kvr_step_attend_on_device); then what only the host reads or the kernels write. */
enum { APPENDS, SIMS, SCORE_ITEMS, PLANS, ITEMS, SEGS, ENTRIES, COSINE, CORRECTED, ATT_LANES, PLAN_SCATTER,
       RECALL_COUNTS, N_REGIONS };
static size_t scratch_layout(const struct kvr_sched *s, uint32_t batch, uint32_t max_pages, size_t off[N_REGIONS])
{
	const uint32_t n_kv = s->c.n_kv_heads;
	/* mixed pages: a selected K8V4 page is two segments (its halves) */
	const uint32_t max_segs = max_pages + 1 + (s->units_per_slot > 1 ? s->k : 0);
	const int planned_streamed = s->device_plan && s->recall == KVR_RECALL_STREAMED;
	const size_t sizes[N_REGIONS] = {
		[APPENDS] = (size_t)batch * sizeof(struct kvr_append_item),
		[SIMS] = (size_t)batch * sizeof(struct kvr_similarity_item),
		[SCORE_ITEMS] = (size_t)batch * sizeof(struct kvr_score_item),
		[PLANS] = (size_t)batch * n_kv * sizeof(struct kvr_plan_item),
		[ITEMS] = (size_t)batch * n_kv * sizeof(struct kvr_attention_item),
		[SEGS] = (size_t)batch * n_kv * max_segs * sizeof(struct kvr_kv_segment),
		[ENTRIES] = (size_t)batch * sizeof(struct entry),
		[COSINE] = (size_t)batch * n_kv * sizeof(float),
		[CORRECTED] = (size_t)batch * n_kv,
		[ATT_LANES] = (size_t)batch * sizeof(struct kvr_lane *),
		[PLAN_SCATTER] = planned_streamed ? (size_t)batch * n_kv * s->k * sizeof(struct kvr_scatter_item) : 0,
		[RECALL_COUNTS] = planned_streamed ? (size_t)batch * n_kv * 2 * sizeof(uint32_t) : 0,
	};
	size_t need = 0;
	for (int i = 0; i < N_REGIONS; i++) {
		off[i] = need;
		need += (sizes[i] + 63) & ~(size_t)63;
	}
	return need;
}

size_t kvr_sched_layer_scratch_bytes(const struct kvr_sched *s, uint32_t batch, uint32_t max_pages)
{
	size_t off[N_REGIONS];
	return scratch_layout(s, batch, max_pages, off);
}

/* The layer's scratch: kept per layer, since an asynchronous attention may
 * still read the previous layer's items. Sized before the append, for every
 * entry's position. */
static int layer_scratch(struct layer_call *lc)
{
	struct kvr_sched *s = lc->s;
	size_t off[N_REGIONS];
	const size_t need = scratch_layout(s, lc->batch, lc->max_pages, off);
	struct layer_scratch *ls = &s->eng.scratch[lc->layer];
	if (kvr_mirror_grow(s->dev, &ls->m, need)) {
		snprintf(s->last_error, sizeof(s->last_error), "out of memory for the step's scratch");
		return -ENOMEM;
	}
	unsigned char *mem = ls->m.host;
	lc->ls = ls;
	lc->items = (void *)(mem + off[ITEMS]);
	lc->segs = (void *)(mem + off[SEGS]);
	lc->e = (void *)(mem + off[ENTRIES]);
	lc->cosine = (void *)(mem + off[COSINE]);
	lc->corrected = mem + off[CORRECTED];
	lc->att_lanes = (void *)(mem + off[ATT_LANES]);
	lc->appends = (void *)(mem + off[APPENDS]);
	lc->sims = (void *)(mem + off[SIMS]);
	lc->score_items = (void *)(mem + off[SCORE_ITEMS]);
	lc->plans = (void *)(mem + off[PLANS]);
	lc->plan_scatter = (void *)(mem + off[PLAN_SCATTER]);
	lc->recall_counts = (void *)(mem + off[RECALL_COUNTS]);
	return 0;
}

/* freekv: which of entry i's KV heads moved below tau since the lane's
 * previous query (the similarity kernel on the engine's inline stream). */
static int check_similarity(struct layer_call *lc, uint32_t i, struct kvr_lane *lane,
			    uint8_t *corr)
{
	struct kvr_sched *s = lc->s;
	const uint32_t seq = lc->seqs[i], n_kv = lc->n_kv;
	const uint64_t t0 = kvr_now_ns();
	struct kvr_similarity_item *si = s->eng.similarity.host;
	*si = (struct kvr_similarity_item){ lc->q_dev + i * lc->q_row, lane->prev_q,
					    lc->cosine + (uint64_t)i * n_kv, corr };
	int err = kvr_mirror_to_device(s->dev, &s->eng.similarity, si, sizeof(*si), s->engine_inline);
	if (!err)
		err = kvr_dev_similarity(s->dev, &s->shape, s->eng.similarity.dev, 1, s->engine_inline);
	if (!err) /* the host reads corr (an inline stream has run it already) */
		err = kvr_sched_wait_stream(s, s->engine_inline, seq, lc->layer, "wait correction check");
	if (err) {
		snprintf(s->last_error, sizeof(s->last_error), "similarity: %s",
			 kvr_dev_last_error(s->dev));
		return err;
	}
	uint32_t n_corr = 0;
	for (uint32_t m = 0; m < n_kv; m++) {
		n_corr += corr[m];
		if (corr[m]) /* a statistic read by kvr_get_head_corrections: relaxed */
			atomic_fetch_add_explicit(&s->head_corrections[(uint64_t)seq * n_kv + m], 1,
						  memory_order_relaxed);
	}
	count(s, seq, KVR_C_CHECKED_HEADS, n_kv);
	count(s, seq, KVR_C_CORRECTED_HEADS, n_corr);
	if (lc->tr)
		kvr_trace_span(lc->tr, "correction check", KVR_TRACK_ENGINE, seq, lc->layer, n_corr,
			       t0, kvr_now_ns());
	return 0;
}

/* Entry i's start, shared by both paths (the host's and the device plan):
 * failed where the engine's status says so, else dense (a dense layer, or
 * L <= B: the lane forgets its previous query, so its first sparse step
 * selects afresh), else sparse, with `*select_all` set where every head
 * selects with q_i (blocking, a lane's first sparse step) and `*check` where
 * freekv checks the heads first. Neither is set with nothing to select
 * (k = 0: sinks and window only). */
uint32_t kvr_step_start_entry(struct layer_call *lc, uint32_t i, struct kvr_lane *lane, int *select_all,
			      int *check)
{
	const struct kvr_config *c = &lc->s->c;
	struct entry *e = &lc->e[i];
	*e = (struct entry){ SEQ_FAILED, 0, lc->positions[i] + 1, lc->seqs[i], 0, 0, 0, 0 };
	*select_all = *check = 0;
	memset(lc->corrected + (uint64_t)i * lc->n_kv, 0, lc->n_kv);
	if (lc->status[i])
		return e->kind;
	if (kvr_layer_dense(lc->s, lc->layer) || e->n_tokens <= c->budget_tokens) {
		lane->has_prev = 0;
		return e->kind = SEQ_DENSE;
	}
	if (lc->kk) {
		*select_all = c->mode == KVR_MODE_BLOCKING || !lane->has_prev;
		*check = !*select_all && c->mode == KVR_MODE_FREEKV;
	}
	return e->kind = SEQ_SPARSE;
}

/* 2. Dense or sparse; which heads are corrected. */
static int layer_corrections(struct layer_call *lc)
{
	struct kvr_sched *s = lc->s;
	for (uint32_t i = 0; i < lc->batch; i++) {
		struct entry *e = &lc->e[i];
		struct kvr_lane *lane = lane_of(s, lc->seqs[i], lc->layer);
		uint8_t *corr = lc->corrected + (uint64_t)i * lc->n_kv;
		int all, check;
		if (kvr_step_start_entry(lc, i, lane, &all, &check) != SEQ_SPARSE)
			continue;
		if (all) {
			memset(corr, 1, lc->n_kv);
		} else if (check) {
			int err = check_similarity(lc, i, lane, corr);
			if (err)
				return err;
		}
		for (uint32_t m = 0; m < lc->n_kv; m++)
			e->any_corrected |= corr[m];
		if (e->any_corrected)
			e->kind = SEQ_CORRECTED;
	}
	return 0;
}

/* Entry i's attention items, one per KV head, over the segments each head
 * reads: head m's pages are now_sel's when corr[m] (a correction), else the
 * lane's selection; `first_err` (an urgent recall's failure) fails it at
 * once. On failure nothing of entry i stays queued (items, segments, pins)
 * and the error is returned for the caller to fail the sequence. */
int kvr_step_queue_items(struct layer_call *lc, uint32_t i, struct kvr_lane *lane, int dense,
			 int slots, const int32_t *now_sel, const uint8_t *corr, int first_err)
{
	struct kvr_sched *s = lc->s;
	const uint32_t items_before = lc->n_items, segs_before = lc->n_segs, kk = lc->kk;
	const size_t pins_before = s->eng.n_step_pins;
	const unsigned char *qi = lc->q_dev + i * lc->q_row;
	unsigned char *out_row = (unsigned char *)lc->out + i * lc->q_row;
	const uint64_t n_tokens = lc->e[i].n_tokens;
	int seg_err = first_err;
	for (uint32_t m = 0; m < lc->n_kv && !seg_err; m++) {
		const int32_t *sel = now_sel && corr[m] ? now_sel + (uint64_t)m * kk
							: lane->selected + (uint64_t)m * kk;
		const uint32_t n = kvr_sched_build_segments(s, lane, m, n_tokens, dense, sel, slots,
							    lc->segs + lc->n_segs, &seg_err);
		lc->items[lc->n_items++] = (struct kvr_attention_item){
			qi + m * lc->head_q_bytes, out_row + m * lc->head_q_bytes,
			kvr_importance_item(s, lane, m, n_tokens, n), lc->n_segs, n };
		lc->n_segs += n;
	}
	if (seg_err) { /* spill tier: a page it reads in place did not fit in RAM */
		lc->n_items = items_before, lc->n_segs = segs_before;
		kvr_sched_unpin_from(s, pins_before); /* its pins must not fail the others */
		lc->status[i] = seg_err;
		lc->e[i].kind = SEQ_FAILED;
		return seg_err;
	}
	lc->att_lanes[lc->n_att++] = lane;
	count(s, lc->seqs[i], KVR_C_LAYER_DECODES, 1);
	return 0;
}

/* 3. Attention for the sequences with nothing to correct, first, so a
 * correction in one sequence does not hold back the others. */
static int attend_uncorrected(struct layer_call *lc)
{
	struct kvr_sched *s = lc->s;
	int err = 0;
	for (uint32_t i = 0; i < lc->batch && !err; i++) {
		if (lc->e[i].kind != SEQ_DENSE && lc->e[i].kind != SEQ_SPARSE)
			continue;
		struct kvr_lane *lane = lane_of(s, lc->seqs[i], lc->layer);
		const int dense = lc->e[i].kind == SEQ_DENSE;
		const int slots = !dense && lc->kk && s->recall == KVR_RECALL_STREAMED;
		if (slots)
			err = kvr_step_wait_recall(s, lane, 0);
		const int seg_err = kvr_step_queue_items(lc, i, lane, dense, slots, NULL, NULL, 0);
		if (seg_err)
			kvr_step_fail_sequence(s, lc->seqs[i], lc->layer, lc->positions[i], seg_err,
					       s->last_error, (unsigned char *)lc->out + i * lc->q_row);
		else
			count(s, lc->seqs[i], KVR_C_DENSE_DECODES, (uint64_t)dense);
	}
	if (!err)
		err = kvr_step_run_attention(s, lc->layer, lc->ls, lc->items, lc->n_items, lc->segs, 0,
					     lc->n_segs, lc->att_lanes, lc->n_att, 0);
	return err;
}

/* 4. Sequences with corrected heads: select now with q_i, recall the
 * corrected heads' misses (streamed: an urgent controller job the engine
 * waits for), attend. */
static int attend_corrected(struct layer_call *lc)
{
	struct kvr_sched *s = lc->s;
	const uint32_t layer = lc->layer, n_kv = lc->n_kv, kk = lc->kk;
	const uint32_t first_item = lc->n_items, first_att = lc->n_att, first_seg = lc->n_segs;
	int err = 0;
	for (uint32_t i = 0; i < lc->batch && !err; i++) {
		if (lc->e[i].kind != SEQ_CORRECTED)
			continue;
		const uint32_t seq = lc->seqs[i];
		struct kvr_lane *lane = lane_of(s, seq, layer);
		const uint8_t *corr = lc->corrected + (uint64_t)i * n_kv;
		int32_t *now_sel = s->eng.now_sel + (uint64_t)i * n_kv * kk;
		const uint64_t t0 = kvr_now_ns();
		/* the selection serves step i+1 too (but in blocking mode, which
		 * selects again): its candidates are those of step i+1, a superset
		 * of step i's, so a page leaving the window stays covered */
		err = kvr_select_pages(s, lane, lc->q_dev + i * lc->q_row, lc->e[i].n_tokens,
				       s->c.mode != KVR_MODE_BLOCKING, now_sel, &s->eng.engine_sel);
		if (err) {
			snprintf(s->last_error, sizeof(s->last_error), "selection: %s",
				 kvr_dev_last_error(s->dev));
			break;
		}
		count(s, seq, KVR_C_SELECTIONS, 1);
		const uint64_t t1 = kvr_now_ns();
		if (lc->tr)
			kvr_trace_span(lc->tr, "select now (correction)", KVR_TRACK_ENGINE, seq, layer,
				       n_kv, t0, t1);
		if (s->recall == KVR_RECALL_STREAMED) {
			/* the corrected heads' misses, before attention: an urgent job */
			memcpy(lane->selected, now_sel, (size_t)n_kv * kk * sizeof(int32_t));
			memcpy(lane->job_heads, corr, n_kv);
			lane->job = LANE_JOB_RECALL;
			kvr_controller_post(s, lane, 1);
			kvr_lane_acquire(s, lane);
			err = kvr_step_wait_recall(s, lane, 1);
			kvr_sched_count_host_wait(s, seq, layer, "wait urgent recall planning", t1,
						  kvr_now_ns());
			if (lc->tr)
				kvr_trace_span(lc->tr, "wait urgent recall", KVR_TRACK_ENGINE, seq, layer,
					       0, t1, kvr_now_ns());
		}
		count(s, seq, KVR_C_CORRECTION_WAITS, 1);
		count(s, seq, KVR_C_CORRECTION_WAIT_NS, kvr_now_ns() - t0);
		const int recall_err = lane->recall_error; /* the urgent recall failed */
		lane->recall_error = 0;
		const int seg_err = kvr_step_queue_items(lc, i, lane, 0, s->recall == KVR_RECALL_STREAMED,
							 now_sel, corr, recall_err);
		if (seg_err)
			kvr_step_fail_sequence(s, seq, layer, lc->positions[i], seg_err,
					       recall_err ? s->urgent_message : s->last_error,
					       (unsigned char *)lc->out + i * lc->q_row);
	}
	if (!err)
		err = kvr_step_run_attention(s, layer, lc->ls, lc->items + first_item,
					     lc->n_items - first_item, lc->segs, first_seg, lc->n_segs,
					     lc->att_lanes + first_att, lc->n_att - first_att, 0);
	return err;
}

/* 5. Keep q_i; post the next step's work (mixed pages: judge those the next
 * selection may name for the first time, before it can). */
static void post_next_step(struct layer_call *lc)
{
	struct kvr_sched *s = lc->s;
	const uint32_t n_kv = lc->n_kv, kk = lc->kk;
	uint32_t n_post = 0; /* the device plan's jobs, handed over together */
	for (uint32_t i = 0; i < lc->batch; i++) {
		const struct entry *e = &lc->e[i];
		if (e->kind == SEQ_FAILED)
			continue;
		struct kvr_lane *lane = lane_of(s, lc->seqs[i], lc->layer);
		kvr_importance_judge(s, lane, e->n_tokens);
		if ((e->kind != SEQ_SPARSE && e->kind != SEQ_CORRECTED) || !kk)
			continue;
		if (lc->device_append) {
			/* on the compute stream, after this layer's similarity check
			 * read the old one (the device plan's plan kernel has copied
			 * it already: queue_planned); the controller's selection,
			 * which reads it, waits for attn_done recorded after it */
			int err = e->planned ? 0
					     : kvr_dev_memcpy_async(s->dev, lane->prev_q, lc->q_dev + i * lc->q_row,
								    lc->q_row, KVR_COPY_D2D, s->compute);
			if (!err)
				err = kvr_dev_event_record(s->dev, lane->attn_done, s->compute);
			if (err) { /* no previous query: the next step selects afresh */
				lane->has_prev = 0;
				continue;
			}
		} else {
			memcpy(lane->prev_q, lc->q_host + i * lc->q_row, lc->q_row);
		}
		lane->has_prev = 1;
		if (s->c.mode == KVR_MODE_BLOCKING)
			continue; /* selects again at the next step */
		lane->job_n_tokens = e->n_tokens;
		if (e->kind == SEQ_CORRECTED) {
			/* one selection per step: the corrected one serves the next step */
			const int32_t *now_sel = s->eng.now_sel + (uint64_t)i * n_kv * kk;
			memcpy(lane->selected, now_sel, (size_t)n_kv * kk * sizeof(int32_t));
			if (s->recall != KVR_RECALL_STREAMED)
				continue;
			const uint8_t *corr = lc->corrected + (uint64_t)i * n_kv;
			uint32_t rest = 0;
			for (uint32_t m = 0; m < n_kv; m++)
				rest += (lane->job_heads[m] = !corr[m]);
			if (!rest)
				continue;
			lane->job = LANE_JOB_RECALL; /* deferred: after this attention */
		} else {
			memset(lane->job_heads, 1, n_kv);
			lane->job = LANE_JOB_SELECT;
			lane->sel_unwaited = 1;
		}
		if (s->device_plan)
			s->eng.post_lanes[n_post++] = lane;
		else
			kvr_controller_post(s, lane, 0);
	}
	kvr_controller_post_many(s, s->eng.post_lanes, n_post);
}

/* The engine's stream after the layer's attention; the critical-path time. */
static int layer_finish(struct layer_call *lc, struct kvr_stream *engine_stream)
{
	struct kvr_sched *s = lc->s;
	if (engine_stream) {
		/* the engine's next kernels read `out` (layer_done: recorded after
		 * the attention, the compute stream's last work of the layer) */
		int err = kvr_dev_stream_wait_event(s->dev, engine_stream, s->eng.layer_done);
		if (err) {
			snprintf(s->last_error, sizeof(s->last_error), "ordering the engine's stream: %s",
				 kvr_dev_last_error(s->dev));
			return err;
		}
	}
	const uint64_t t_leave = kvr_now_ns(), spent = t_leave - lc->t_enter;
	/* statistics read by kvr_get_stats: relaxed */
	for (uint32_t i = 0; i < lc->batch; i++)
		atomic_fetch_add_explicit(
			&s->seq_counters[(uint64_t)lc->seqs[i] * KVR_C_COUNT + KVR_C_CRITICAL_NS],
			spent / lc->batch, memory_order_relaxed);
	atomic_fetch_add_explicit(&s->counters[KVR_C_CRITICAL_NS], spent, memory_order_relaxed);
	if (lc->tr)
		kvr_trace_span(lc->tr, "decode layer", KVR_TRACK_ENGINE,
			       lc->batch == 1 ? lc->seqs[0] : UINT32_MAX, lc->layer, lc->batch,
			       lc->t_enter, t_leave);
	return 0;
}

static int layer_call(struct layer_call *lc, const void *q, const void *k, const void *v,
		      struct kvr_stream *engine_stream);

int kvr_sched_decode_layer(struct kvr_sched *s, uint32_t layer, uint32_t batch,
			   const uint32_t *seqs, const uint64_t *positions, const void *q,
			   const void *k, const void *v, void *out, int32_t *status,
			   struct kvr_stream *engine_stream)
{
	struct layer_call lc = {
		.s = s,
		.layer = layer,
		.batch = batch,
		.seqs = seqs,
		.positions = positions,
		.out = out,
		.status = status,
		.tr = trace_of(s),
		.t_enter = kvr_now_ns(),
		.n_kv = s->c.n_kv_heads,
		.kk = s->k,
		.q_row = s->q_row,
		.kv_row = s->kv_row,
		.head_q_bytes = (uint64_t)s->G * s->c.head_dim * s->eb,
		.device_append = s->device_append,
	};
	kvr_sched_layer_enter(s);
	int err = layer_call(&lc, q, k, v, engine_stream);
	kvr_sched_layer_leave(s);
	return err;
}

static int layer_call(struct layer_call *lc, const void *q, const void *k, const void *v,
		      struct kvr_stream *engine_stream)
{
	struct kvr_sched *s = lc->s;
	for (uint32_t i = 0; i < lc->batch; i++) {
		const uint32_t pages = (uint32_t)((lc->positions[i] + 1) / s->c.page_tokens);
		lc->max_pages = pages > lc->max_pages ? pages : lc->max_pages;
	}
	int err = layer_inputs(lc, q, k, v, engine_stream);
	if (!err)
		err = layer_scratch(lc);
	if (err)
		return err;
	kvr_step_layer_append(lc);
	if (lc->append_error) {
		snprintf(s->last_error, sizeof(s->last_error), "appending the tokens: %s",
			 kvr_dev_last_error(s->dev));
		return lc->append_error;
	}
	if (s->device_plan) {
		err = kvr_step_attend_on_device(lc);
	} else {
		if ((err = layer_corrections(lc)))
			return err;
		err = attend_uncorrected(lc);
		if (!err)
			err = attend_corrected(lc);
	}
	/* layer_done marks the layer's attention on the compute stream; where it
	 * has run already (an inline stream) its pages may leave RAM now (and
	 * mixed pages' window pages be demoted below), else at the step's end */
	if (!err)
		err = kvr_dev_event_record(s->dev, s->eng.layer_done, s->compute);
	if (!err && kvr_dev_event_query(s->dev, s->eng.layer_done) == 0)
		kvr_sched_unpin_step(s);
	if (err) {
		if (!s->last_error[0])
			snprintf(s->last_error, sizeof(s->last_error), "%s", kvr_dev_last_error(s->dev));
		return err;
	}
	post_next_step(lc);
	/* the device append's prev_q copies read the engine's q after the
	 * attention: the engine's stream waits for them too (layer_finish) */
	if (lc->device_append && (err = kvr_dev_event_record(s->dev, s->eng.layer_done, s->compute))) {
		snprintf(s->last_error, sizeof(s->last_error), "%s", kvr_dev_last_error(s->dev));
		return err;
	}
	return layer_finish(lc, engine_stream);
}

void kvr_sched_step_abandon(struct kvr_sched *s, uint32_t batch, const uint32_t *seqs,
			    const uint64_t *positions, uint32_t layer, int err, const char *why)
{
	for (uint32_t i = 0; i < batch; i++)
		kvr_sched_mark_failed(s, seqs[i], layer, positions[i], err, why);
}

int kvr_sched_step_failure(const struct kvr_sched *s, uint32_t seq, uint32_t *layer,
			   const char **message)
{
	*layer = s->eng.step_fail_layer[seq];
	*message = s->eng.step_fail_message + (size_t)seq * KVR_SCHED_MESSAGE;
	return s->eng.step_fail[seq];
}

int kvr_sched_step_end(struct kvr_sched *s)
{
	/* the next step rewrites the layers' mapped scratch the attention reads */
	int err = kvr_dev_stream_synchronize(s->dev, s->compute); /* nothing on an inline stream */
	struct kvr_stream *replayed = s->eng.fixed.replay_stream;
	s->eng.fixed.replay_stream = NULL;
	if (!err && replayed) { /* a replayed step's work is the graph launched there */
		err = kvr_dev_event_record(s->dev, s->eng.fixed.replay_done, replayed);
		if (!err)
			err = kvr_dev_event_synchronize(s->dev, s->eng.fixed.replay_done);
	}
	kvr_sched_unpin_step(s); /* the step's attention has read its pages */
	if (!err) /* ... and its units: the slots' spares go back (not when the
		   * device failed: an attention may still read them) */
		kvr_units_step_end(s);
	kvr_step_tally_plans(s);
	kvr_sched_replay_tally(s);
	kvr_sched_free_deferred(s);
	settle_failed(s);
	s->eng.step_serial++;
	return err;
}
