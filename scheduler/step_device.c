/* SPDX-License-Identifier: MIT */
/*
 * step_device.c — steps 2-4 of a layer call on the device plan (a device
 * with memory of its own, zero-copy recall or streamed without a spill
 * tier): the similarity kernel flags the heads to correct, score and select
 * run gated by the flags, the plan kernel builds the selected pages'
 * segments (streamed: plans the slots and moves the misses with one
 * scatter), then attention; the host reads none of it back inside the layer.
 * The flags and recall counts are tallied at the step's end
 * (kvr_step_tally_plans).
 *
 * Threads: the engine's thread (one step at a time per context).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "step_impl.h"

/* The device plan's scores scratch holds `floats`; a smaller one is replaced
 * (the old one may still be read by an earlier layer's kernels: freed at the
 * step's end). */
static int plan_scores_fit(struct kvr_sched *s, size_t floats)
{
	if (s->eng.plan_scores_bytes >= floats * sizeof(float))
		return 0;
	void *old = s->eng.plan_scores;
	const size_t grown = kvr_grown_bytes(s->eng.plan_scores_bytes, floats * sizeof(float));
	s->eng.plan_scores = NULL;
	s->eng.plan_scores_bytes = 0;
	int err = kvr_scratch_grow(s->dev, (void **)&s->eng.plan_scores, &s->eng.plan_scores_bytes, grown);
	if (old)
		kvr_sched_defer_free(s, old, 0);
	return err;
}

struct kvr_plan_item kvr_sched_plan_item(const struct kvr_sched *s, const struct kvr_lane *lane, uint32_t m,
					 uint64_t n_tokens, struct kvr_attention_item *attention,
					 struct kvr_kv_segment *segments, uint32_t n_head, uint32_t n_tail,
					 const int32_t *now, const uint8_t *corr, const uint64_t *addrs,
					 uint32_t n_addrs, const unsigned char *q_head)
{
	const uint32_t kk = s->k, p = s->c.page_tokens;
	const uint32_t sink = s->c.sink_tokens / p, win_first = kvr_window_first(&s->c, n_tokens);
	const uint64_t run = (uint64_t)m * s->head_bytes, head_q = (uint64_t)s->G * s->c.head_dim * s->eb;
	return (struct kvr_plan_item){
		.attention = attention,
		.segments = segments,
		.selected = lane->selected + (uint64_t)m * kk,
		.corrected_sel = now ? now + (uint64_t)m * kk : NULL,
		.corrected = corr ? corr + m : NULL,
		.page_addr = addrs,
		.addr_end = addrs ? n_addrs : 0,
		.k_offset = run,
		/* quantised: one run from k (kernels.h, attention) */
		.v_offset = s->kv_format ? UINT64_MAX : run + (uint64_t)p * s->c.head_dim * s->eb,
		.n_head = n_head,
		.n_tail = n_tail,
		.k = kk,
		.sel_begin = sink,
		.sel_end = win_first > sink ? win_first : sink,
		.seg_tokens = p,
		.seg_row = s->kv_format ? 0 : s->c.head_dim, /* quantised: first_row */
		.seg_head_stride = s->kv_format ? (uint32_t)s->head_bytes : 0,
		.seg_format = s->kv_format,
		.q_from = q_head,
		.q_to = q_head ? (unsigned char *)lane->prev_q + m * head_q : NULL,
		.q_bytes = (uint32_t)head_q,
	};
}

void kvr_sched_plan_item_slots(const struct kvr_sched *s, const struct kvr_lane *lane, uint32_t m,
			       struct kvr_plan_item *pl, struct kvr_scatter_item *scatter, uint32_t *counts)
{
	pl->seg_row = s->c.n_kv_heads * s->c.head_dim;
	pl->v_offset = UINT64_MAX; /* the run's keys and values: the scatter's */
	pl->slot_col = m * s->c.head_dim * s->eb;
	pl->slot_page = lane->slot_page + (uint64_t)m * s->k;
	pl->scatter = scatter;
	pl->recall_count = counts;
	pl->slot_k = lane->slot_k;
	pl->slot_v = lane->slot_v;
	pl->tile_bytes = s->tile_bytes;
	pl->kv_head = m;
}

/* Entry i's attention items on the device plan, one per KV head: the
 * segments around the selected pages built here, the selected pages' by the
 * plan kernel from the lane's selection, or from `now` (this step's) where
 * `corr` flags the head, or for every head when `corr` is NULL and `now` is
 * not. */
static void queue_planned(struct layer_call *lc, uint32_t i, struct kvr_lane *lane, const int32_t *now,
			  const uint8_t *corr, const uint64_t *addrs, uint32_t n_addrs)
{
	struct kvr_sched *s = lc->s;
	const uint32_t kk = lc->kk;
	const uint64_t n_tokens = lc->e[i].n_tokens;
	const unsigned char *qi = lc->q_dev + i * lc->q_row;
	unsigned char *out_row = (unsigned char *)lc->out + i * lc->q_row;
	const int streamed = s->recall == KVR_RECALL_STREAMED;
	lc->e[i].first_plan = lc->n_plans;
	lc->e[i].planned = 1;
	for (uint32_t m = 0; m < lc->n_kv; m++) {
		int seg_err = 0; /* no spill tier here: nothing to pin */
		uint32_t n_head = 0, n_tail = 0;
		const uint32_t first = lc->n_segs;
		lc->n_segs += kvr_sched_build_planned(s, lane, m, n_tokens, lc->segs + first, &n_head, &n_tail,
						      &seg_err);
		struct kvr_attention_item *item = &lc->items[lc->n_items++];
		*item = (struct kvr_attention_item){ qi + m * lc->head_q_bytes, out_row + m * lc->head_q_bytes,
						     NULL, first, n_head + n_tail };
		/* the lane keeps q_i for the next step (post_next_step) */
		lc->plans[lc->n_plans++] = kvr_sched_plan_item(
			s, lane, m, n_tokens, kvr_mirror_dev_at(&lc->ls->m, item),
			kvr_mirror_dev_at(&lc->ls->m, lc->segs + first), n_head, n_tail, now, corr, addrs, n_addrs,
			kk && lc->device_append ? qi + m * lc->head_q_bytes : NULL);
		if (streamed) { /* the slots: planned, and the misses moved, on the device */
			const uint64_t at = (uint64_t)(lc->n_plans - 1);
			kvr_sched_plan_item_slots(s, lane, m, &lc->plans[at],
						  kvr_mirror_dev_at(&lc->ls->m, lc->plan_scatter + at * kk),
						  lc->recall_counts + 2 * at);
		}
	}
	lc->att_lanes[lc->n_att++] = lane;
	count(s, lc->seqs[i], KVR_C_LAYER_DECODES, 1);
}

/*
 * 2-4 on the device plan (s->device_plan: a device with memory of its own,
 * zero-copy recall, or streamed with plain pages and no spill tier): the
 * host decides only what it knows
 * without reading the device — dense or sparse, and which sparse entries
 * select with q_i on every head (blocking, a lane's first sparse step) or
 * check first (freekv). Then, on the compute stream in one pass for the
 * batch: the similarity kernel flags each checked head; score and select
 * with q_i (gated by those flags: they run only where a head was flagged)
 * into now_sel; the plan kernel builds each item's selected-page segments
 * from now_sel where flagged, else from the lane's selection; attention.
 * Nothing is read back: step_end tallies the flags once the step is done.
 * Outputs equal the host path's bit for bit where the attention calls group
 * the same items (the host path attends corrected sequences in a second
 * call).
 */
int kvr_step_attend_on_device(struct layer_call *lc)
{
	struct kvr_sched *s = lc->s;
	const struct kvr_config *c = &s->c;
	const uint32_t n_kv = lc->n_kv, kk = lc->kk, layer = lc->layer;
	uint32_t n_sims = 0, n_scores = 0;
	size_t scores_used = 0;
	int err = plan_scores_fit(s, (size_t)lc->batch * n_kv * (lc->max_pages + 1));
	if (err) {
		snprintf(s->last_error, sizeof(s->last_error), "out of device memory for the selections' scores");
		return err;
	}
	lc->n_plans = 0;
	for (uint32_t i = 0; i < lc->batch; i++) {
		struct entry *e = &lc->e[i];
		const uint32_t seq = lc->seqs[i];
		struct kvr_lane *lane = lane_of(s, seq, layer);
		int all, check;
		const uint32_t kind = kvr_step_start_entry(lc, i, lane, &all, &check);
		if (kind == SEQ_FAILED)
			continue;
		if (kind == SEQ_DENSE) {
			const int seg_err = kvr_step_queue_items(lc, i, lane, 1, 0, NULL, NULL, 0);
			if (seg_err)
				kvr_step_fail_sequence(s, seq, layer, lc->positions[i], seg_err, s->last_error,
						       (unsigned char *)lc->out + i * lc->q_row);
			else
				count(s, seq, KVR_C_DENSE_DECODES, 1);
			continue;
		}
		const unsigned char *qi = lc->q_dev + i * lc->q_row;
		uint8_t *corr = lc->corrected + (uint64_t)i * n_kv; /* mapped: the device writes it */
		int32_t *now = (all || check) ? s->eng.now_sel + (uint64_t)i * n_kv * kk : NULL;
		if (check) {
			lc->sims[n_sims++] = (struct kvr_similarity_item){
				qi, lane->prev_q, lc->cosine + (uint64_t)i * n_kv, corr };
			e->checked = 1;
			count(s, seq, KVR_C_CHECKED_HEADS, n_kv);
		}
		if (now) {
			size_t need = 0;
			struct kvr_score_item *si = &lc->score_items[n_scores];
			err = kvr_select_item(s, lane, qi, e->n_tokens, c->mode != KVR_MODE_BLOCKING, now,
					      s->eng.plan_scores + scores_used,
					      s->eng.plan_scores_bytes / sizeof(float) - scores_used, &need,
					      s->compute, si);
			if (err == -ENODATA) { /* no summaries: nothing selected */
				for (uint32_t x = 0; x < n_kv * kk; x++)
					now[x] = -1;
				err = 0;
			} else if (!err) {
				si->gate = check ? corr : NULL;
				scores_used += need;
				n_scores++;
			} else {
				snprintf(s->last_error, sizeof(s->last_error), "selection: %s",
					 err == -ENOMEM ? "out of device memory for the summaries"
							: "scores scratch too small (bug)");
				return err;
			}
			if (all) { /* it runs: counted now (a checked one at step_end) */
				count(s, seq, KVR_C_SELECTIONS, 1);
				count(s, seq, KVR_C_CORRECTION_WAITS, 1);
			}
		}
		/* every page a selection may name: the correction's serves step
		 * i+1, whose candidates reach one page further (streamed recalls
		 * whatever is selected) */
		const uint32_t n_addrs = kvr_window_first(c, e->n_tokens + 1);
		const uint64_t *addrs = kvr_resident_page_addrs(s, lane, n_addrs);
		if (!addrs && n_addrs) {
			snprintf(s->last_error, sizeof(s->last_error), "out of memory for the page table");
			return -ENOMEM;
		}
		/* streamed: the lane's latest recall (the controller's) lands
		 * before the plan reads its slot table (a stream wait) */
		if (s->recall == KVR_RECALL_STREAMED && (err = kvr_step_wait_recall(s, lane, 0))) {
			snprintf(s->last_error, sizeof(s->last_error), "ordering the lane's recall: %s",
				 kvr_dev_last_error(s->dev));
			return err;
		}
		/* the lane's selection for this step, which the controller issued
		 * without waiting for it (on the device plan its selector is
		 * asynchronous, sched.c): a stream wait. Also where this step
		 * selects afresh (`all`) after an older job no step waited for
		 * (the lane went dense between): that selection reads prev_q and,
		 * streamed, its prefetch writes the slots, both of which this
		 * layer's plan rewrites */
		if (!all || lane->sel_unwaited) {
			if ((err = kvr_dev_stream_wait_event(s->dev, s->compute, lane->sel_done))) {
				snprintf(s->last_error, sizeof(s->last_error), "ordering the lane's selection: %s",
					 kvr_dev_last_error(s->dev));
				return err;
			}
			lane->sel_unwaited = 0;
		}
		e->all_corrected = (uint32_t)all;
		queue_planned(lc, i, lane, now, check ? corr : NULL, addrs, n_addrs);
	}
	/* everything the kernels read, in one copy (layer_scratch lays it out
	 * as one run, sims to the last segment), then the kernels, in order on
	 * compute */
	if (!err)
		err = kvr_mirror_to_device(s->dev, &lc->ls->m, lc->sims,
					   (size_t)((const unsigned char *)(lc->segs + lc->n_segs) -
						    (const unsigned char *)lc->sims),
					   s->compute);
	if (!err && n_sims)
		err = kvr_dev_similarity(s->dev, &s->shape, kvr_mirror_dev_at(&lc->ls->m, lc->sims), n_sims,
					 s->compute);
	const struct kvr_score_item *score_dev = kvr_mirror_dev_at(&lc->ls->m, lc->score_items);
	if (!err && n_scores)
		err = kvr_dev_score(s->dev, &s->shape, score_dev, n_scores, s->compute);
	if (!err && n_scores)
		err = kvr_dev_select(s->dev, &s->shape, score_dev, n_scores, s->compute);
	if (!err && lc->n_plans)
		err = kvr_dev_plan(s->dev, &s->shape, kvr_mirror_dev_at(&lc->ls->m, lc->plans), lc->n_plans,
				   s->compute);
	if (!err && lc->n_plans && s->recall == KVR_RECALL_STREAMED) /* the misses, pool -> slots */
		err = kvr_dev_scatter(s->dev, &s->shape, kvr_mirror_dev_at(&lc->ls->m, lc->plan_scatter),
				      lc->n_plans * kk, s->compute);
	if (err) {
		snprintf(s->last_error, sizeof(s->last_error), "the layer's selections: %s",
			 kvr_dev_last_error(s->dev));
		return err;
	}
	err = kvr_step_run_attention(s, layer, lc->ls, lc->items, lc->n_items, lc->segs, 0, lc->n_segs, lc->att_lanes,
				     lc->n_att, 1);
	if (!err && lc->n_plans) /* the flags and recall counts, once the step is done */
		s->eng.tally[layer] = (struct plan_tally){ lc->e, lc->corrected, lc->recall_counts, lc->batch };
	return err;
}

void kvr_sched_tally_entry(struct kvr_sched *s, uint32_t seq, const uint32_t *plan_counts,
			   const uint32_t *prefetch_counts, const uint8_t *corr, int checked, int all_corrected)
{
	const uint32_t n_kv = s->c.n_kv_heads;
	if (plan_counts || prefetch_counts) {
		/* this step's hits only of the heads it recalled for: the others
		 * re-plan what the prefetch moved and counted already */
		uint64_t misses = 0, hits = 0;
		for (uint32_t m = 0; m < n_kv; m++) {
			if (plan_counts) {
				misses += plan_counts[2 * m];
				if (all_corrected || (checked && corr[m]))
					hits += plan_counts[2 * m + 1];
			}
			if (prefetch_counts) {
				misses += prefetch_counts[2 * m];
				hits += prefetch_counts[2 * m + 1];
			}
		}
		count(s, seq, KVR_C_PAGES_RECALLED, misses);
		count(s, seq, KVR_C_PAGES_HIT, hits);
		count(s, seq, KVR_C_BYTES_RECALLED, misses * s->head_bytes);
	}
	if (!checked)
		return;
	uint32_t n_corr = 0;
	for (uint32_t m = 0; m < n_kv; m++) {
		n_corr += corr[m] != 0;
		if (corr[m]) /* a statistic read by kvr_get_head_corrections: relaxed */
			atomic_fetch_add_explicit(&s->head_corrections[(uint64_t)seq * n_kv + m], 1,
						  memory_order_relaxed);
	}
	count(s, seq, KVR_C_CORRECTED_HEADS, n_corr);
	if (n_corr) {
		count(s, seq, KVR_C_SELECTIONS, 1);
		count(s, seq, KVR_C_CORRECTION_WAITS, 1);
	}
}

/* The device plan's flags of every layer of the step, now that its work is
 * done: the corrections' statistics the host path counts as it goes. */
void kvr_step_tally_plans(struct kvr_sched *s)
{
	const uint32_t n_kv = s->c.n_kv_heads;
	const int streamed = s->recall == KVR_RECALL_STREAMED;
	for (uint32_t l = 0; l < s->c.n_layers; l++) {
		struct plan_tally *t = &s->eng.tally[l];
		for (uint32_t i = 0; i < t->batch; i++) {
			const struct entry *e = &t->e[i];
			kvr_sched_tally_entry(s, e->seq,
					      e->planned && streamed ? t->recall_counts + 2 * (uint64_t)e->first_plan
								     : NULL,
					      NULL, t->corrected + (uint64_t)i * n_kv, e->checked, e->all_corrected);
		}
		t->batch = 0;
	}
}
