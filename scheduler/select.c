/* SPDX-License-Identifier: MIT */
/*
 * select.c — step 5 of docs/design.md ("The decode step") for one lane: the
 * candidates of the step a selection serves, each head's softmax domain, the
 * summaries on the device, then the score and select kernels. Called by the engine (a correction, a
 * lane's first sparse step, blocking mode: step.c) and by the controller (the
 * speculative selection for the next step: controller.c), so it lives apart
 * from both.
 *
 * Threads: whichever thread holds the lane (the engine, or the controller
 * while the lane's job is in flight); `stream` is that thread's stream. An
 * asynchronous selector is the controller's alone.
 */
#include <errno.h>

#include "sched_impl.h"

int kvr_select_item(struct kvr_sched *s, struct kvr_lane *lane, const void *q, uint64_t n_tokens,
		    int next, int32_t *selected, float *scores, size_t scores_cap, size_t *scores_need,
		    struct kvr_stream *stream, struct kvr_score_item *item)
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
	 * (docs/history.md, "Group consistency"). The page the newest token
	 * completed is left out: its summary may still be on its way (the rule
	 * kvr_window_first applies with W = 0). */
	const uint32_t with_summary = n_tokens ? (uint32_t)((n_tokens - 1) / s->c.page_tokens) : 0;
	const uint32_t norm_end = with_summary > cand_end ? with_summary : cand_end;
	*scores_need = (size_t)s->c.n_kv_heads * (cand_end - cand_begin + 1);
	if (*scores_need > scores_cap)
		return -ENOSPC;
	const void *summaries = kvr_resident_summaries(s, lane, norm_end, stream);
	if (!summaries && kvr_pool_summary(s->pool, lane->seq, lane->layer, 0))
		return -ENOMEM; /* the pool has summaries: no device memory for their copy */
	if (!summaries)
		return -ENODATA;
	*item = (struct kvr_score_item){ .q = q,
					 .summaries = summaries,
					 .scores = scores,
					 .selected = selected,
					 .cand_begin = cand_begin,
					 .cand_end = cand_end,
					 .k = s->k,
					 .norm_end = norm_end };
	return 0;
}

int kvr_select_pages(struct kvr_sched *s, struct kvr_lane *lane, const void *q, uint64_t n_tokens,
		     int next, int32_t *selected, struct kvr_selector *sel)
{
	struct kvr_stream *stream = sel->stream;
	struct kvr_score_item *item = sel->item.host;
	if (sel->n_ring)
		return -EINVAL; /* an asynchronous selector selects in batches (kvr_select_pages_batch) */
	/* the controller's selections are timed by part (kvr_stats) */
	const int timed = sel == &s->rec.ctl_sel;
	const uint64_t t0 = timed ? kvr_now_ns() : 0;
	size_t need = 0;
	int err = kvr_select_item(s, lane, q, n_tokens, next, selected, sel->scores, sel->scores_bytes / sizeof(float),
			      &need, stream, item);
	if (err == -ENOSPC) {
		if (kvr_scratch_grow(s->dev, (void **)&sel->scores, &sel->scores_bytes,
				     kvr_grown_bytes(sel->scores_bytes, need * sizeof(float))))
			return -ENOMEM;
		err = kvr_select_item(s, lane, q, n_tokens, next, selected, sel->scores,
				      sel->scores_bytes / sizeof(float), &need, stream, item);
	}
	if (err == -ENODATA) {
		/* the host writes `selected` */
		for (uint32_t i = 0; i < s->c.n_kv_heads * s->k; i++)
			selected[i] = -1;
		return 0;
	}
	const struct kvr_score_item *item_dev = kvr_mirror_dev_at(&sel->item, item);
	if (!err)
		err = kvr_mirror_to_device(s->dev, &sel->item, item, sizeof(*item), stream);
	const uint64_t t1 = timed ? kvr_now_ns() : 0;
	if (!err)
		err = kvr_dev_score(s->dev, &s->shape, item_dev, 1, stream);
	const uint64_t t2 = timed ? kvr_now_ns() : 0;
	if (!err)
		err = kvr_dev_select(s->dev, &s->shape, item_dev, 1, stream);
	/* the host plans with `selected` (and reuses the item and the scores);
	 * the inline streams of host-addressable devices have run it already */
	if (!err)
		err = kvr_sched_wait_stream(s, stream, lane->seq, lane->layer, "wait selection");
	if (timed) {
		/* on an inline stream each kernel ran inside its call; elsewhere the
		 * kernels' time shows in the wait, counted with the select kernel */
		const uint64_t t3 = kvr_now_ns();
		count(s, lane->seq, KVR_C_CTL_PREPARE_NS, t1 - t0);
		count(s, lane->seq, KVR_C_CTL_SCORE_NS, t2 - t1);
		count(s, lane->seq, KVR_C_CTL_TOPK_NS, t3 - t2);
	}
	return err;
}

int kvr_selector_make_async(struct kvr_sched *s, struct kvr_selector *sel)
{
	const uint32_t cap = s->c.max_batch;
	int err = kvr_mirror_grow(s->dev, &sel->item, (size_t)KVR_SELECT_RING * cap * sizeof(struct kvr_score_item));
	if (!err && s->recall == KVR_RECALL_STREAMED) {
		const size_t n_plans = (size_t)cap * s->c.n_kv_heads;
		err = kvr_mirror_grow(s->dev, &sel->prefetch, KVR_SELECT_RING * n_plans * sizeof(struct kvr_plan_item));
		if (!err)
			err = kvr_dev_alloc(s->dev, n_plans * s->k * sizeof(struct kvr_scatter_item),
					    (void **)&sel->prefetch_scatter);
	}
	for (uint32_t i = 0; i < KVR_SELECT_RING && !err; i++)
		err = kvr_dev_event_create(s->dev, &sel->ring_done[i]);
	if (!err) {
		sel->n_ring = KVR_SELECT_RING;
		sel->batch_cap = cap;
	}
	return err;
}

int kvr_select_pages_batch(struct kvr_sched *s, struct kvr_lane *const *lanes, uint32_t n,
			   struct kvr_selector *sel, uint32_t *slot_out)
{
	struct kvr_stream *stream = sel->stream;
	/* the slot's items were last copied KVR_SELECT_RING batches ago (see
	 * kvr_select_pages) */
	const uint32_t slot = sel->next_slot++ % sel->n_ring;
	struct kvr_score_item *items = (struct kvr_score_item *)sel->item.host + (size_t)slot * sel->batch_cap;
	*slot_out = slot;
	int err = kvr_dev_event_synchronize(s->dev, sel->ring_done[slot]);
	if (err)
		return err;
	/* every lane's share of the scores, then one buffer for all of them
	 * (grown with the stream idle: selections still queued read the old
	 * one) */
	size_t total = 0;
	for (uint32_t i = 0; i < n; i++) {
		size_t need = 0;
		struct kvr_score_item probe;
		if (kvr_select_item(s, lanes[i], lanes[i]->prev_q, lanes[i]->job_n_tokens, 1, lanes[i]->selected,
				    NULL, 0, &need, stream, &probe) == -ENOSPC)
			total += need;
	}
	if (total * sizeof(float) > sel->scores_bytes) {
		if ((err = kvr_dev_stream_synchronize(s->dev, stream)))
			return err;
		if (kvr_scratch_grow(s->dev, (void **)&sel->scores, &sel->scores_bytes,
				     kvr_grown_bytes(sel->scores_bytes, total * sizeof(float))))
			return -ENOMEM;
	}
	uint32_t n_items = 0;
	size_t used = 0;
	for (uint32_t i = 0; i < n; i++) {
		struct kvr_lane *lane = lanes[i];
		size_t need = 0;
		err = kvr_select_item(s, lane, lane->prev_q, lane->job_n_tokens, 1, lane->selected, sel->scores + used,
				      sel->scores_bytes / sizeof(float) - used, &need, stream, &items[n_items]);
		if (err == -ENODATA) {
			/* the host writes `selected`: the lane's selection still
			 * queued (none where the pool keeps no summaries) has run */
			if ((err = kvr_dev_event_synchronize(s->dev, lane->sel_done)))
				return err;
			for (uint32_t x = 0; x < s->c.n_kv_heads * s->k; x++)
				lane->selected[x] = -1;
			continue;
		}
		if (err)
			return err;
		used += need;
		n_items++;
	}
	if (!n_items)
		return 0;
	const struct kvr_score_item *items_dev = kvr_mirror_dev_at(&sel->item, items);
	err = kvr_mirror_to_device(s->dev, &sel->item, items, n_items * sizeof(*items), stream);
	if (!err)
		err = kvr_dev_score(s->dev, &s->shape, items_dev, n_items, stream);
	if (!err)
		err = kvr_dev_select(s->dev, &s->shape, items_dev, n_items, stream);
	return err;
}

void kvr_selector_free(struct kvr_sched *s, struct kvr_selector *sel)
{
	kvr_mirror_free(s->dev, &sel->item);
	kvr_mirror_free(s->dev, &sel->prefetch);
	kvr_dev_free(s->dev, sel->prefetch_scatter);
	sel->prefetch_scatter = NULL;
	for (uint32_t i = 0; i < KVR_SELECT_RING; i++) {
		kvr_dev_event_destroy(s->dev, sel->ring_done[i]);
		sel->ring_done[i] = NULL;
	}
	sel->n_ring = sel->next_slot = 0;
}
