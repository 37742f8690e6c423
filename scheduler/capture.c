/* SPDX-License-Identifier: MIT */
/*
 * capture.c — a decode step that a CUDA graph can hold
 * (docs/architecture.md, "Capturing a step in a CUDA graph"): the layer
 * calls made while the engine's stream is captured record each layer's
 * device work in a fixed shape and store nothing; a replayed step has its
 * host part done here for every layer at once (kvr_sched_replay_step), then
 * the engine launches its graph, then the step ends as any other.
 *
 * A graph repeats the device work exactly as captured: the same kernels
 * with the same item counts, the same uploads of the same sizes from the
 * same host addresses. So the shape is fixed when the capture is made, for
 * `batch` sequences with at most `seg_cap` segments per KV head
 * (kvr_sched_capture_reserve sizes the buffers first: a capture may not
 * allocate), and each replay rewrites, in place in the layer's scratch
 * (mapped memory the graph's upload reads at launch), every entry's items:
 *   uploaded: append [batch], similarity [batch], this step's score items
 *     [batch], the next step's [batch], plan [batch][n_kv], attention
 *     [batch][n_kv], segments [batch][n_kv][seg_cap]; streamed, the
 *     prefetch's plan items [batch][n_kv] and a selection of no page [k];
 *   read in place: the correction flags [batch][n_kv], cosines, and the
 *     flags of the similarity items nobody reads; streamed, the plans' and
 *     the prefetch's recall counts [batch][n_kv][2];
 *   the kernels' own (streamed): the plans' and the prefetch's scatter
 *     items [batch][n_kv][k] each, and spare slot tables [batch][n_kv][k].
 * Every entry has all of them every step, each able to do nothing, since
 * which entries are dense, checked (freekv), selecting afresh (blocking, a
 * lane's first sparse step) or failed changes from step to step:
 *  - append: a failed entry's row is past the page (the kernel skips it);
 *  - similarity: an entry not checked compares q with itself into flags
 *    nobody reads; the host writes its correction flags itself (all 1 where
 *    every head selects afresh, else 0);
 *  - score and select, this step's: gated by the correction flags (a
 *    checked entry), always (every head afresh), or an item without
 *    candidates (nothing to select); the next step's (speculative and
 *    freekv, on the fork stream after the layer's attention, as the
 *    controller does uncaptured): every sparse entry, with the query the
 *    plan kernel kept;
 *  - plan: a dense entry's item takes no page (k = 0) and keeps the
 *    segments the host built (every page); a failed entry's has none, and
 *    its attention items then write zeros;
 *  - streamed, the scatters after this step's plan and after the prefetch's
 *    run over every entry's k items per head: an entry that recalls nothing
 *    has plan items that select no page into a spare slot table (all k
 *    scatter items skip) and leave its attention item's count, the host's,
 *    as it is; the prefetch (the next step's pages into the slots, on the
 *    fork after the next step's selection, as the controller does
 *    uncaptured: recall.c) has the same for an entry that did not select.
 * An entry past the replayed batch (a replay may run fewer sequences than
 * it captured) is a failed one.
 *
 * What can be captured: mode dense on a device with memory of its own and
 * the device append (an HND pool of plain or K8V4/K4V2 pages), and the
 * sparse modes on the device plan (zero-copy recall, or streamed of plain
 * pages) with a window of at least a page (the next step's candidates then
 * never include the page a step completes, whose summary the graph writes
 * after the host part ran); no spill tier.
 *
 * Device copies the host part queues before the graph, on the compute
 * stream, which the launch stream waits for: a layer's resident pages not
 * held yet (resident.c) and its pages' key summaries not copied yet; only
 * the page the step's own token completes is read from the pinned pool at
 * that step (the graph's append writes it after those copies ran).
 *
 * Threads: the engine's thread (one step at a time per context), as step.c.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "sched_impl.h"

/* What step_end tallies of a replayed entry (its correction flags, and
 * streamed its plans' recall counts). */
struct fixed_tally {
	uint32_t seq;
	uint8_t checked;       /* freekv: the similarity kernel flagged its heads */
	uint8_t planned;       /* streamed: this step's plan planned its slots */
	uint8_t all_corrected; /* ... for every head (a selection afresh) */
	uint8_t prefetched;    /* streamed: the fork prefetched its next selection */
};

/* Byte offsets of a layer scratch's fixed-shape regions. */
struct fixed_regions {
	size_t appends, sims, now, next, plans, items, segs;
	size_t prefetch, no_pages; /* streamed */
	size_t upload; /* bytes from 0 the graph uploads */
	size_t corr, cosine, unread, tally;
	/* streamed: the plans' counts (read in place), then what only the
	 * kernels read and write: the misses' scatter items, spare slot tables */
	size_t plan_counts, prefetch_counts, plan_scatter, prefetch_scatter, spare_slots;
	size_t total;
};

static size_t region(size_t *at, size_t bytes)
{
	const size_t here = *at;
	*at += (bytes + 63) & ~(size_t)63;
	return here;
}

/* 1 where a layer's captured step recalls through the slots: a sparse layer
 * with streamed recall (the regions and kernels marked streamed). */
static int streamed_layer(const struct kvr_sched *s, uint32_t layer)
{
	return s->recall == KVR_RECALL_STREAMED && !kvr_layer_dense(s, layer);
}

static void fixed_layout(const struct kvr_sched *s, uint32_t layer, uint32_t batch, uint32_t seg_cap,
			 struct fixed_regions *r)
{
	const uint64_t n_items = (uint64_t)batch * s->c.n_kv_heads;
	size_t at = 0;
	r->appends = region(&at, batch * sizeof(struct kvr_append_item));
	r->sims = region(&at, batch * sizeof(struct kvr_similarity_item));
	r->now = region(&at, batch * sizeof(struct kvr_score_item));
	r->next = region(&at, batch * sizeof(struct kvr_score_item));
	r->plans = region(&at, n_items * sizeof(struct kvr_plan_item));
	r->items = region(&at, n_items * sizeof(struct kvr_attention_item));
	r->segs = region(&at, n_items * seg_cap * sizeof(struct kvr_kv_segment));
	const uint64_t streamed = (uint64_t)streamed_layer(s, layer), slots = streamed * n_items * s->k;
	r->prefetch = region(&at, streamed * n_items * sizeof(struct kvr_plan_item));
	r->no_pages = region(&at, streamed * s->k * sizeof(int32_t));
	r->upload = at;
	r->corr = region(&at, n_items);
	r->cosine = region(&at, n_items * sizeof(float));
	r->unread = region(&at, n_items);
	r->tally = region(&at, batch * sizeof(struct fixed_tally));
	r->plan_counts = region(&at, streamed * n_items * 2 * sizeof(uint32_t));
	r->prefetch_counts = region(&at, streamed * n_items * 2 * sizeof(uint32_t));
	r->plan_scatter = region(&at, slots * sizeof(struct kvr_scatter_item));
	r->prefetch_scatter = region(&at, slots * sizeof(struct kvr_scatter_item));
	r->spare_slots = region(&at, slots * sizeof(int32_t));
	r->total = at;
}

/* Segments an attention item of `layer` may need within the reservation:
 * every page and the tail where the layer is dense; else the most of a
 * dense entry (L <= B) and of a planned one (sinks, k pages, window, tail). */
static uint32_t seg_cap_of(const struct kvr_sched *s, uint32_t layer, uint64_t max_tokens)
{
	const uint64_t all = max_tokens / s->c.page_tokens + 1;
	if (kvr_layer_dense(s, layer))
		return (uint32_t)all;
	const uint64_t sparse = s->c.budget_tokens / s->c.page_tokens + 2;
	return (uint32_t)(sparse < all ? sparse : all);
}

int kvr_sched_capturable(const struct kvr_sched *s, const char **why)
{
	*why = NULL;
	if (!s->device_append)
		*why = kvr_dev_host_visible(s->dev)
			       ? "the backend runs the step on the host (no graph to capture into)"
			       : "the step appends on the host (NHD pool, mixed pages or the host-step hook)";
	else if (s->spill)
		*why = "a spill tier pins the pages a step reads, which a replay cannot repeat";
	else if (s->c.mode == KVR_MODE_DENSE)
		return 0;
	else if (s->estimates)
		*why = "the estimate (config estimate) builds its segments on the host, around the "
		       "selection it reads: turn it off to capture a sparse mode";
	else if (!s->device_plan)
		*why = s->recall == KVR_RECALL_STREAMED && s->kv_format
			       ? "streamed recall of quantised pages is planned on the host: use zero-copy "
				 "recall, or f16, bf16 or f32 pages"
			       : "this configuration plans recall on the host (budget, sink and window leave "
				 "no page to select, or more than the device plan takes)";
	else if (s->c.window_tokens < s->c.page_tokens)
		*why = "a window shorter than a page lets the next step select the page a step "
		       "completes, whose summary a replay cannot copy in time";
	return *why ? -ENOTSUP : 0;
}

/* 1 where the mode selects the next step's pages after each layer (on the
 * controller uncaptured, on the fork in a graph). */
static int selects_next(const struct kvr_sched *s)
{
	return s->c.mode == KVR_MODE_SPECULATIVE || s->c.mode == KVR_MODE_FREEKV;
}

/* The stream the next step's selections fork to in a graph, its events. */
static int fork_open(struct kvr_sched *s)
{
	if (s->eng.fixed.fork)
		return 0;
	int err = kvr_dev_event_create(s->dev, &s->eng.fixed.fork_ready);
	if (!err)
		err = kvr_dev_event_create(s->dev, &s->eng.fixed.fork_done);
	if (!err)
		err = kvr_dev_stream_create(s->dev, 0, &s->eng.fixed.fork);
	return err;
}

void kvr_sched_capture_free(struct kvr_sched *s)
{
	kvr_dev_stream_destroy(s->dev, s->eng.fixed.fork);
	kvr_dev_event_destroy(s->dev, s->eng.fixed.fork_ready);
	kvr_dev_event_destroy(s->dev, s->eng.fixed.fork_done);
	kvr_scratch_free(s->dev, s->eng.fixed.scores_now);
	kvr_scratch_free(s->dev, s->eng.fixed.scores_next);
}

int kvr_sched_capture_reserve(struct kvr_sched *s, uint32_t batch, uint64_t max_tokens)
{
	const char *why;
	if (kvr_sched_capturable(s, &why)) {
		snprintf(s->last_error, sizeof(s->last_error), "%s", why);
		return -ENOTSUP;
	}
	if (!batch || batch > s->c.max_batch || !max_tokens) {
		snprintf(s->last_error, sizeof(s->last_error),
			 "reserve: batch %u (1..max_batch %u) and max_tokens %llu (> 0)", batch, s->c.max_batch,
			 (unsigned long long)max_tokens);
		return -EINVAL;
	}
	const uint64_t pages = max_tokens / s->c.page_tokens + 1;
	if (pages > UINT32_MAX / ((uint64_t)batch * s->c.n_kv_heads)) {
		snprintf(s->last_error, sizeof(s->last_error), "reserve: %llu tokens per sequence is too many",
			 (unsigned long long)max_tokens);
		return -EINVAL;
	}
	/* the graphs captured before hold the old buffers: stale from here */
	for (uint32_t l = 0; l < s->c.n_layers; l++)
		s->eng.fixed.layers[l].batch = 0;
	s->eng.fixed.batch = 0;
	int err = 0;
	for (uint32_t l = 0; l < s->c.n_layers && !err; l++) {
		const uint32_t seg_cap = seg_cap_of(s, l, max_tokens);
		struct fixed_regions r;
		fixed_layout(s, l, batch, seg_cap, &r);
		/* and for uncaptured steps within the reservation, which would
		 * otherwise regrow the buffers under the graph */
		const size_t uncaptured = kvr_sched_layer_scratch_bytes(s, batch, (uint32_t)(pages - 1));
		err = kvr_mirror_grow(s->dev, &s->eng.scratch[l].m, uncaptured > r.total ? uncaptured : r.total);
		s->eng.fixed.layers[l].seg_cap = seg_cap;
		if (!err && streamed_layer(s, l)) {
			/* the spare slot tables are read before any write (their
			 * values do not matter: no page is selected into them); set
			 * once, so a device's initcheck finds nothing uninitialised */
			unsigned char *spare = (unsigned char *)s->eng.scratch[l].m.host + r.spare_slots;
			const size_t bytes = (size_t)batch * s->c.n_kv_heads * s->k * sizeof(int32_t);
			memset(spare, 0xff, bytes);
			err = kvr_mirror_to_device(s->dev, &s->eng.scratch[l].m, spare, bytes, s->compute);
		}
	}
	if (err) {
		snprintf(s->last_error, sizeof(s->last_error), "reserve: out of memory for the step's buffers");
		return err;
	}
	if (s->c.mode != KVR_MODE_DENSE) {
		const size_t scores = (size_t)batch * s->c.n_kv_heads * (pages + 1) * sizeof(float);
		err = kvr_scratch_grow(s->dev, (void **)&s->eng.fixed.scores_now, &s->eng.fixed.scores_now_bytes, scores);
		if (!err)
			err = kvr_scratch_grow(s->dev, (void **)&s->eng.fixed.scores_next,
					       &s->eng.fixed.scores_next_bytes, scores);
		if (!err)
			err = fork_open(s);
		if (err) {
			snprintf(s->last_error, sizeof(s->last_error), "reserve: the selections' scratch: %s",
				 err == -ENOMEM ? "out of memory" : kvr_dev_last_error(s->dev));
			return err;
		}
	}
	/* the kernels' scratch too (attention's split partials, score's page
	 * cache), which a captured launch may not allocate: compute runs
	 * attention and this step's selections, the fork the next step's */
	const int sparse = s->c.mode != KVR_MODE_DENSE;
	err = kvr_dev_capture_reserve(s->dev, s->compute, &s->head_shape, batch * s->c.n_kv_heads,
				      sparse ? &s->shape : NULL, batch);
	if (!err && sparse && selects_next(s))
		err = kvr_dev_capture_reserve(s->dev, s->eng.fixed.fork, NULL, 0, &s->shape, batch);
	if (err) {
		snprintf(s->last_error, sizeof(s->last_error), "reserve: the attention's scratch: %s",
			 kvr_dev_last_error(s->dev));
		return err;
	}
	s->eng.fixed.batch = batch;
	s->eng.fixed.max_tokens = max_tokens;
	return 0;
}

int kvr_sched_capture_layer(struct kvr_sched *s, uint32_t layer, uint32_t batch, int first, const void *q,
			    const void *k, const void *v, void *out, struct kvr_stream *engine_stream)
{
	const char *why;
	if (kvr_sched_capturable(s, &why)) {
		snprintf(s->last_error, sizeof(s->last_error), "%s", why);
		return -ENOTSUP;
	}
	struct layer_scratch *ls = &s->eng.scratch[layer];
	struct fixed_layer *fl = &s->eng.fixed.layers[layer];
	struct fixed_regions r;
	fixed_layout(s, layer, batch, fl->seg_cap, &r);
	if (!s->eng.fixed.batch || batch > s->eng.fixed.batch || ls->m.bytes < r.total) {
		snprintf(s->last_error, sizeof(s->last_error),
			 "a capture allocates nothing: reserve the step's buffers for %u sequences first "
			 "(kvr_decode_reserve; reserved: %u)",
			 batch, s->eng.fixed.batch);
		return -EINVAL;
	}
	if (first) { /* a new capture: the graphs captured before cannot be replayed */
		for (uint32_t l = 0; l < s->c.n_layers; l++)
			s->eng.fixed.layers[l].batch = 0;
		s->eng.fixed.fork_used = 0;
	}
	const int sparse = !kvr_layer_dense(s, layer), streamed = streamed_layer(s, layer);
	const uint32_t n_items = batch * s->c.n_kv_heads;
	unsigned char *dev = ls->m.dev;
	const struct kvr_score_item *now = (const void *)(dev + r.now), *next = (const void *)(dev + r.next);
	/* the layer after what the engine queued; the engine's later work after
	 * the attention (the compute stream joins the capture, and is joined
	 * back by the engine's wait) */
	int err = kvr_dev_event_record(s->dev, s->eng.engine_ready, engine_stream);
	if (!err)
		err = kvr_dev_stream_wait_event(s->dev, s->compute, s->eng.engine_ready);
	if (!err)
		err = kvr_mirror_to_device(s->dev, &ls->m, ls->m.host, r.upload, s->compute);
	if (!err)
		err = kvr_dev_append(s->dev, &s->shape, (const struct kvr_append_item *)(dev + r.appends), batch,
				     s->compute);
	if (!err && sparse && s->c.mode == KVR_MODE_FREEKV)
		err = kvr_dev_similarity(s->dev, &s->shape, (const struct kvr_similarity_item *)(dev + r.sims), batch,
					 s->compute);
	if (!err && sparse)
		err = kvr_dev_score(s->dev, &s->shape, now, batch, s->compute);
	if (!err && sparse)
		err = kvr_dev_select(s->dev, &s->shape, now, batch, s->compute);
	if (!err && sparse)
		err = kvr_dev_plan(s->dev, &s->shape, (const struct kvr_plan_item *)(dev + r.plans), n_items,
				   s->compute);
	if (!err && sparse && streamed) /* this step's misses (corrected heads, first steps), pool -> slots */
		err = kvr_dev_scatter(s->dev, &s->shape, (const struct kvr_scatter_item *)(dev + r.plan_scatter),
				      n_items * s->k, s->compute);
	if (!err)
		err = kvr_dev_attention(s->dev, &s->head_shape, (const struct kvr_attention_item *)(dev + r.items),
					n_items, (const struct kvr_kv_segment *)(dev + r.segs), n_items * fl->seg_cap,
					s->compute);
	if (!err && sparse && selects_next(s)) {
		/* the next step's selections beside the next layers, from the
		 * query the plan kernel kept; joined at the step's end */
		err = kvr_dev_event_record(s->dev, s->eng.fixed.fork_ready, s->compute);
		if (!err)
			err = kvr_dev_stream_wait_event(s->dev, s->eng.fixed.fork, s->eng.fixed.fork_ready);
		s->eng.fixed.fork_used = 1;
		if (!err)
			err = kvr_dev_score(s->dev, &s->shape, next, batch, s->eng.fixed.fork);
		if (!err)
			err = kvr_dev_select(s->dev, &s->shape, next, batch, s->eng.fixed.fork);
		/* streamed: the prefetch of what it selected into the slots,
		 * which the controller does uncaptured (recall.c) */
		if (!err && streamed)
			err = kvr_dev_plan(s->dev, &s->shape, (const struct kvr_plan_item *)(dev + r.prefetch),
					   n_items, s->eng.fixed.fork);
		if (!err && streamed)
			err = kvr_dev_scatter(s->dev, &s->shape,
					      (const struct kvr_scatter_item *)(dev + r.prefetch_scatter),
					      n_items * s->k, s->eng.fixed.fork);
	}
	if (!err)
		err = kvr_dev_event_record(s->dev, s->eng.layer_done, s->compute);
	if (!err)
		err = kvr_dev_stream_wait_event(s->dev, engine_stream, s->eng.layer_done);
	if (!err && layer == s->c.n_layers - 1 && s->eng.fixed.fork_used) {
		s->eng.fixed.fork_used = 0;
		err = kvr_dev_event_record(s->dev, s->eng.fixed.fork_done, s->eng.fixed.fork);
		if (!err)
			err = kvr_dev_stream_wait_event(s->dev, engine_stream, s->eng.fixed.fork_done);
	}
	if (err) {
		snprintf(s->last_error, sizeof(s->last_error), "capturing layer %u: %s", layer,
			 kvr_dev_last_error(s->dev));
		return err;
	}
	fl->q = q, fl->k = k, fl->v = v, fl->out = out;
	fl->scratch_host = ls->m.host;
	fl->scratch_dev = ls->m.dev;
	fl->batch = batch;
	return 0;
}

/* A replayed layer's view of its scratch. */
struct fixed_view {
	const struct fixed_layer *fl;
	uint32_t layer, seg_cap, n_kv;
	struct kvr_append_item *appends;
	struct kvr_similarity_item *sims;
	struct kvr_score_item *now, *next;
	struct kvr_plan_item *plans;
	struct kvr_attention_item *items;
	struct kvr_kv_segment *segs;
	uint8_t *corr, *unread;
	float *cosine;
	struct fixed_tally *tally;
	/* streamed (host views; the kernels' through dev_at) */
	struct kvr_plan_item *prefetch;
	int32_t *no_pages, *spare_slots;
	uint32_t *plan_counts, *prefetch_counts;
	struct kvr_scatter_item *plan_scatter, *prefetch_scatter;
};

/* The kernels' view of a pointer into a replayed layer's scratch. */
static void *dev_at(struct kvr_sched *s, const struct fixed_view *fv, const void *host)
{
	return kvr_mirror_dev_at(&s->eng.scratch[fv->layer].m, host);
}

/* Streamed: item j's plan item (this step's, or `for_next` the prefetch's)
 * that selects no page: it plans a spare slot table, so its k scatter items
 * all skip, and the scatter that follows over every entry's items moves
 * nothing of it. No segments: the attention item keeps the host's count. */
static struct kvr_plan_item plan_no_page(struct kvr_sched *s, const struct fixed_view *fv, uint64_t j, int for_next)
{
	const uint32_t kk = s->k;
	return (struct kvr_plan_item){
		.selected = dev_at(s, fv, fv->no_pages),
		.k = kk,
		.seg_tokens = s->c.page_tokens,
		.slot_page = dev_at(s, fv, fv->spare_slots + j * kk),
		.scatter = dev_at(s, fv, (for_next ? fv->prefetch_scatter : fv->plan_scatter) + j * kk),
		.recall_count = (for_next ? fv->prefetch_counts : fv->plan_counts) + 2 * j,
		.kv_head = UINT32_MAX,
	};
}

/* Entry i doing nothing (failed, or past the replayed batch): its append
 * skipped, its similarity unread, no selection, its items without segments
 * (they write zeros). */
static void entry_empty(struct kvr_sched *s, const struct fixed_view *fv, uint32_t i)
{
	const uint32_t n_kv = fv->n_kv;
	const uint64_t head_q = (uint64_t)s->G * s->c.head_dim * s->eb;
	const unsigned char *q = (const unsigned char *)fv->fl->q + i * s->q_row;
	unsigned char *out = (unsigned char *)fv->fl->out + i * s->q_row;
	fv->appends[i] = (struct kvr_append_item){ .row = UINT32_MAX };
	fv->sims[i] = (struct kvr_similarity_item){ q, q, fv->cosine + (uint64_t)i * n_kv,
						    fv->unread + (uint64_t)i * n_kv };
	fv->now[i] = (struct kvr_score_item){ 0 };
	fv->next[i] = (struct kvr_score_item){ 0 };
	memset(fv->corr + (uint64_t)i * n_kv, 0, n_kv);
	fv->tally[i] = (struct fixed_tally){ 0 };
	const int streamed = streamed_layer(s, fv->layer);
	for (uint32_t m = 0; m < n_kv; m++) {
		const uint64_t j = (uint64_t)i * n_kv + m;
		fv->items[j] = (struct kvr_attention_item){ q + m * head_q, out + m * head_q, NULL,
							    (uint32_t)(j * fv->seg_cap), 0 };
		if (streamed) { /* n_segments stays the host's (0; a dense entry's, all) */
			fv->plans[j] = plan_no_page(s, fv, j, 0);
			fv->prefetch[j] = plan_no_page(s, fv, j, 1);
			continue;
		}
		/* k = 0: takes no page; n_segments = n_head + n_tail = 0 */
		fv->plans[j] = (struct kvr_plan_item){ .attention = dev_at(s, fv, &fv->items[j]),
						       .segments = dev_at(s, fv, fv->segs + j * fv->seg_cap),
						       .selected = NULL,
						       .seg_tokens = s->c.page_tokens };
	}
}

/* A score item of entry i: this step's (`for_next` 0: with q_i into
 * now_sel, among step i+1's candidates unless blocking, as uncaptured) or
 * the next step's (into the lane's selection, from the query the plan
 * kernel keeps); an item without candidates where the pool keeps no
 * summaries. */
static int entry_selection(struct kvr_sched *s, const struct fixed_view *fv, uint32_t i, struct kvr_lane *lane,
			   uint64_t n_tokens, int for_next, struct kvr_score_item *item)
{
	const uint32_t n_kv = fv->n_kv, kk = s->k;
	const uint64_t pages = s->eng.fixed.max_tokens / s->c.page_tokens + 2;
	float *scores = (for_next ? s->eng.fixed.scores_next : s->eng.fixed.scores_now) + (uint64_t)i * n_kv * pages;
	int32_t *selected = for_next ? lane->selected : s->eng.now_sel + (uint64_t)i * n_kv * kk;
	const void *q = for_next ? (const void *)lane->prev_q : (const unsigned char *)fv->fl->q + i * s->q_row;
	const int next_candidates = for_next || s->c.mode != KVR_MODE_BLOCKING;
	size_t need = 0;
	int err = kvr_select_item(s, lane, q, n_tokens, next_candidates, selected, scores, (size_t)n_kv * pages,
				  &need, s->compute, item);
	if (err == -ENODATA) { /* no summaries: nothing selected */
		for (uint32_t x = 0; x < n_kv * kk; x++)
			selected[x] = -1;
		*item = (struct kvr_score_item){ 0 };
		return 0;
	}
	return err;
}

/* Entry i's token into the layer (the pool's bookkeeping; the graph's
 * append kernel writes it), and its items; where that fails, the
 * sequence's step fails and the entry does nothing. */
static void entry_fill(struct kvr_sched *s, const struct fixed_view *fv, uint32_t i, uint32_t seq,
		       uint64_t position)
{
	const uint32_t n_kv = fv->n_kv, layer = fv->layer, kk = s->k, p = s->c.page_tokens;
	const uint64_t head_q = (uint64_t)s->G * s->c.head_dim * s->eb;
	const int streamed = streamed_layer(s, layer);
	struct kvr_lane *lane = lane_of(s, seq, layer);
	entry_empty(s, fv, i);
	const uint64_t waited = kvr_lane_acquire(s, lane);
	if (waited) {
		count(s, seq, KVR_C_CONTROLLER_WAITS, 1);
		count(s, seq, KVR_C_CONTROLLER_WAIT_NS, waited);
	}
	if (s->eng.step_fail[seq]) { /* an earlier layer of this step failed it */
		count(s, seq, KVR_C_FAILED_DECODES, 1);
		return;
	}
	struct kvr_pool_fill fill;
	int err = kvr_pool_append_token(s->pool, seq, layer, position, &fill);
	if (err) {
		kvr_sched_mark_failed(s, seq, layer, position, err, kvr_pool_last_error(s->pool));
		count(s, seq, KVR_C_FAILED_DECODES, 1);
		return;
	}
	lane->appended_step = s->eng.step_serial;
	unsigned char *tail = s->tails[seq] + (uint64_t)layer * 2 * s->tile_bytes;
	fv->appends[i] = (struct kvr_append_item){
		.k_row = (const unsigned char *)fv->fl->k + i * s->kv_row,
		.v_row = (const unsigned char *)fv->fl->v + i * s->kv_row,
		.k_tile = tail,
		.v_tile = tail + s->tile_bytes,
		.hnd_page = fill.page,
		.summary = fill.page ? fill.summary : NULL,
		.row = (uint32_t)(position % p),
		.row_stride = n_kv * s->c.head_dim,
		.format = s->kv_format,
	};
	const uint64_t n_tokens = position + 1;
	const int dense = kvr_layer_dense(s, layer) || n_tokens <= s->c.budget_tokens;
	const unsigned char *qi = (const unsigned char *)fv->fl->q + i * s->q_row;
	uint8_t *corr = fv->corr + (uint64_t)i * n_kv;
	/* every page before the token's is in the pool: resident copies of
	 * those not held yet are queued on compute, before the graph; the
	 * token's own page, if it completes it, is read from the pool */
	s->eng.fixed.unwritten_from = (uint32_t)(position / p);
	int all = 0, check = 0;
	if (dense) {
		lane->has_prev = 0; /* its first sparse step selects afresh */
		for (uint32_t m = 0; m < n_kv; m++) {
			const uint64_t j = (uint64_t)i * n_kv + m;
			int seg_err = 0; /* no spill tier: nothing to pin, nothing to fail */
			const uint32_t n = kvr_sched_build_segments(s, lane, m, n_tokens, 1, NULL, 0,
								    fv->segs + j * fv->seg_cap, &seg_err);
			fv->items[j].n_segments = n;
			fv->plans[j].n_head = n; /* the plan (sparse layers) keeps them: k = 0 */
		}
		count(s, seq, KVR_C_DENSE_DECODES, 1);
	} else { /* the device plan: k >= 1 (kvr_sched_capturable) */
		all = s->c.mode == KVR_MODE_BLOCKING || !lane->has_prev;
		check = !all && s->c.mode == KVR_MODE_FREEKV;

		memset(corr, all, n_kv); /* a checked entry's: the similarity kernel's */
		fv->tally[i] = (struct fixed_tally){ .seq = seq, .checked = (uint8_t)check, .planned = streamed,
						     .all_corrected = (uint8_t)all };
		if (check) {
			fv->sims[i] = (struct kvr_similarity_item){ qi, lane->prev_q, fv->cosine + (uint64_t)i * n_kv, corr };
			count(s, seq, KVR_C_CHECKED_HEADS, n_kv);
		}
		if (all || check) {
			err = entry_selection(s, fv, i, lane, n_tokens, 0, &fv->now[i]);
			fv->now[i].gate = check ? corr : NULL;
			if (all) {
				count(s, seq, KVR_C_SELECTIONS, 1);
				count(s, seq, KVR_C_CORRECTION_WAITS, 1);
			}
		}
		const uint32_t n_addrs = kvr_window_first(&s->c, n_tokens + 1);
		const uint64_t *addrs = kvr_resident_page_addrs(s, lane, n_addrs);
		if (!err && !addrs && n_addrs)
			err = -ENOMEM;
		if (!err && lane->sel_unwaited) {
			/* an uncaptured step's controller job wrote the selection this
			 * step attends (streamed: and prefetched it into the slots):
			 * the graph's launch waits for it */
			err = kvr_dev_stream_wait_event(s->dev, s->compute, lane->sel_done);
			lane->sel_unwaited = 0;
		}
		if (!err && streamed) /* any recall of the lane's slots, as uncaptured */
			err = kvr_step_wait_recall(s, lane, 0);
		if (err) {
			kvr_sched_mark_failed(s, seq, layer, position, err,
					      err == -ENOMEM ? "out of memory for the selection or its page table"
							     : kvr_dev_last_error(s->dev));
			count(s, seq, KVR_C_FAILED_DECODES, 1);
			s->eng.fixed.unwritten_from = UINT32_MAX;
			entry_empty(s, fv, i);
			return;
		}
		const int32_t *now = (all || check) ? s->eng.now_sel + (uint64_t)i * n_kv * kk : NULL;
		for (uint32_t m = 0; m < n_kv; m++) {
			const uint64_t j = (uint64_t)i * n_kv + m;
			int seg_err = 0;
			uint32_t n_head = 0, n_tail = 0;
			kvr_sched_build_planned(s, lane, m, n_tokens, fv->segs + j * fv->seg_cap, &n_head, &n_tail,
						&seg_err);
			struct kvr_plan_item *pl = &fv->plans[j];
			/* the lane keeps q_i for the next step */
			/* streamed: no_page left attention and segments out */
			struct kvr_attention_item *att = dev_at(s, fv, &fv->items[j]);
			struct kvr_kv_segment *segs = dev_at(s, fv, fv->segs + j * fv->seg_cap);
			*pl = kvr_sched_plan_item(s, lane, m, n_tokens, att, segs, n_head, n_tail, now,
						  check ? corr : NULL, addrs, n_addrs, qi + m * head_q);
			if (streamed)
				kvr_sched_plan_item_slots(s, lane, m, pl, dev_at(s, fv, fv->plan_scatter + j * kk),
							  fv->plan_counts + 2 * j);
		}
		lane->has_prev = 1;
		if (selects_next(s)) { /* from the query the plan kernel keeps */
			err = entry_selection(s, fv, i, lane, n_tokens, 1, &fv->next[i]);
			if (!err)
				count(s, seq, KVR_C_SELECTIONS, 1);
			else /* its next step selects afresh */
				lane->has_prev = 0;
			if (!err && streamed) { /* ... and the prefetch of its pages */
				lane->job_n_tokens = n_tokens;
				for (uint32_t m = 0; m < n_kv; m++) {
					const uint64_t j = (uint64_t)i * n_kv + m;
					fv->prefetch[j] = kvr_recall_prefetch_item(
						s, lane, m, dev_at(s, fv, fv->prefetch_scatter + j * kk),
						fv->prefetch_counts + 2 * j);
				}
				fv->tally[i].prefetched = 1;
			}
		}
	}
	s->eng.fixed.unwritten_from = UINT32_MAX;
	count(s, seq, KVR_C_LAYER_DECODES, 1);
}

int kvr_sched_replay_step(struct kvr_sched *s, uint32_t batch, const uint32_t *seqs, const uint64_t *positions,
			  int32_t *status, struct kvr_stream *launch_stream)
{
	const char *why;
	if (kvr_sched_capturable(s, &why)) {
		snprintf(s->last_error, sizeof(s->last_error), "%s", why);
		return -ENOTSUP;
	}
	/* refused as a whole, before anything changes */
	const uint32_t captured = s->eng.fixed.layers[0].batch;
	for (uint32_t l = 0; l < s->c.n_layers; l++) {
		const struct fixed_layer *fl = &s->eng.fixed.layers[l];
		if (!fl->batch || fl->batch != captured) {
			snprintf(s->last_error, sizeof(s->last_error),
				 "layer %u was not captured since the last reservation: capture a whole step "
				 "(every layer, one batch) first", l);
			return -EINVAL;
		}
		if (fl->scratch_host != s->eng.scratch[l].m.host || fl->scratch_dev != s->eng.scratch[l].m.dev) {
			snprintf(s->last_error, sizeof(s->last_error),
				 "layer %u's buffers were reallocated since the capture (an uncaptured step "
				 "outgrew the reservation): reserve and capture again", l);
			return -ESTALE;
		}
	}
	if (batch > captured) {
		snprintf(s->last_error, sizeof(s->last_error),
			 "the step has %u sequences; the captured graph holds %u", batch, captured);
		return -EINVAL;
	}
	for (uint32_t i = 0; i < batch; i++)
		if (positions[i] + 1 > s->eng.fixed.max_tokens) {
			snprintf(s->last_error, sizeof(s->last_error),
				 "sequence %u reaches %llu tokens; the capture was reserved for %llu: reserve "
				 "more and capture again",
				 seqs[i], (unsigned long long)(positions[i] + 1),
				 (unsigned long long)s->eng.fixed.max_tokens);
			return -ERANGE;
		}
	const uint64_t t0 = kvr_now_ns();
	kvr_sched_layer_enter(s); /* its waits counted, its frees deferred to the step's end */
	for (uint32_t l = 0; l < s->c.n_layers; l++) {
		const struct fixed_layer *fl = &s->eng.fixed.layers[l];
		struct fixed_regions r;
		fixed_layout(s, l, captured, fl->seg_cap, &r);
		unsigned char *host = s->eng.scratch[l].m.host;
		const struct fixed_view fv = {
			fl, l, fl->seg_cap, s->c.n_kv_heads,
			(void *)(host + r.appends), (void *)(host + r.sims), (void *)(host + r.now),
			(void *)(host + r.next), (void *)(host + r.plans), (void *)(host + r.items),
			(void *)(host + r.segs), host + r.corr, host + r.unread, (void *)(host + r.cosine),
			(void *)(host + r.tally), (void *)(host + r.prefetch), (void *)(host + r.no_pages),
			(void *)(host + r.spare_slots), (void *)(host + r.plan_counts),
			(void *)(host + r.prefetch_counts), (void *)(host + r.plan_scatter),
			(void *)(host + r.prefetch_scatter),
		};
		if (streamed_layer(s, l))
			for (uint32_t x = 0; x < s->k; x++)
				fv.no_pages[x] = -1;
		for (uint32_t i = 0; i < captured; i++) {
			if (i < batch)
				entry_fill(s, &fv, i, seqs[i], positions[i]);
			else
				entry_empty(s, &fv, i);
		}
	}
	/* the graph after what the host part queued (resident pages and
	 * summaries, waits for an uncaptured step's selections) */
	int err = kvr_dev_event_record(s->dev, s->eng.fixed.replay_ready, s->compute);
	if (!err && launch_stream)
		err = kvr_dev_stream_wait_event(s->dev, launch_stream, s->eng.fixed.replay_ready);
	kvr_sched_layer_leave(s);
	if (err) { /* the tokens' bookkeeping is done: the step fails as a whole */
		snprintf(s->last_error, sizeof(s->last_error), "ordering the replay: %s", kvr_dev_last_error(s->dev));
		kvr_sched_step_abandon(s, batch, seqs, positions, 0, err, s->last_error);
	}
	for (uint32_t i = 0; i < batch; i++)
		status[i] = s->eng.step_fail[seqs[i]];
	s->eng.fixed.replay_stream = launch_stream;
	s->eng.fixed.replayed = 1;
	const uint64_t spent = kvr_now_ns() - t0;
	/* statistics read by kvr_get_stats: relaxed */
	for (uint32_t i = 0; i < batch; i++)
		atomic_fetch_add_explicit(&s->seq_counters[(uint64_t)seqs[i] * KVR_C_COUNT + KVR_C_CRITICAL_NS],
					  spent / batch, memory_order_relaxed);
	atomic_fetch_add_explicit(&s->counters[KVR_C_CRITICAL_NS], spent, memory_order_relaxed);
	struct kvr_trace *tr = trace_of(s);
	if (tr)
		kvr_trace_span(tr, "replay (host part)", KVR_TRACK_ENGINE, batch == 1 ? seqs[0] : UINT32_MAX,
			       UINT32_MAX, batch, t0, t0 + spent);
	return 0;
}

void kvr_sched_replay_tally(struct kvr_sched *s)
{
	if (!s->eng.fixed.replayed)
		return;
	s->eng.fixed.replayed = 0;

	const uint32_t n_kv = s->c.n_kv_heads, batch = s->eng.fixed.layers[0].batch;
	for (uint32_t l = 0; l < s->c.n_layers; l++) {
		struct fixed_regions r;
		fixed_layout(s, l, batch, s->eng.fixed.layers[l].seg_cap, &r);
		const unsigned char *host = s->eng.scratch[l].m.host;
		const struct fixed_tally *t = (const void *)(host + r.tally);
		const uint32_t *plan_counts = (const void *)(host + r.plan_counts);
		const uint32_t *prefetch_counts = (const void *)(host + r.prefetch_counts);
		for (uint32_t i = 0; i < batch; i++) /* as uncaptured steps count */
			kvr_sched_tally_entry(s, t[i].seq, t[i].planned ? plan_counts + 2 * (uint64_t)i * n_kv : NULL,
					      t[i].prefetched ? prefetch_counts + 2 * (uint64_t)i * n_kv : NULL,
					      host + r.corr + (uint64_t)i * n_kv, t[i].checked, t[i].all_corrected);
	}
}
