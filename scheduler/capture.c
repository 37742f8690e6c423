/* SPDX-License-Identifier: MIT */
/*
 * capture.c — a decode step that a CUDA graph can hold (issue 23, item 5;
 * docs/architecture.md, "Capturing a step in a CUDA graph"): the layer
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
 * (mapped memory the graph's upload reads at launch):
 *   [append items: batch] [attention items: batch][n_kv] [segments: batch][n_kv][seg_cap]
 * A sequence not in the replayed batch (a replay may run fewer than it
 * captured), or failed, has an append item past the page (the kernel skips
 * it) and attention items without segments (which write zeros: kernels.h).
 *
 * What can be captured in this version: mode dense on a device with memory
 * of its own and the device append (an HND pool of plain or K8V4/K4V2
 * pages), without a spill tier: every layer attends every page, so a step
 * is the append kernel and one attention per layer, with no selection and
 * no controller work. The sparse modes also select for the next step on the
 * controller's streams and decide per step which heads to correct; making
 * those fixed-shape (the selections as graph nodes on a forked stream) is
 * the next part of the work.
 * The device copies of a dense layer's pages (resident.c) are not the
 * graph's: a replay's host part queues the copies of those not held yet on
 * the compute stream, which the launch stream waits for, so the graph reads
 * them from device memory; only the page the step's own token completes is
 * read from the pinned pool at that step.
 *
 * Threads: the engine's thread (one step at a time per context), as step.c.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "sched_impl.h"

/* Byte offsets of a layer scratch's fixed-shape regions; returns the size. */
static size_t fixed_layout(const struct kvr_sched *s, uint32_t batch, uint32_t seg_cap, size_t *items_at,
			   size_t *segs_at)
{
	const uint64_t n_items = (uint64_t)batch * s->c.n_kv_heads;
	size_t at = ((size_t)batch * sizeof(struct kvr_append_item) + 63) & ~(size_t)63;
	*items_at = at;
	at += (n_items * sizeof(struct kvr_attention_item) + 63) & ~(size_t)63;
	*segs_at = at;
	return at + n_items * seg_cap * sizeof(struct kvr_kv_segment);
}

int kvr_sched_capturable(const struct kvr_sched *s, const char **why)
{
	*why = NULL;
	if (!s->device_append)
		*why = kvr_dev_host_visible(s->dev)
			       ? "the backend runs the step on the host (no graph to capture into)"
			       : "the step appends on the host (NHD pool, mixed pages or the host-step hook)";
	else if (s->c.mode != KVR_MODE_DENSE)
		*why = "only mode dense can be captured in this version: the sparse modes' selections "
		       "for the next step run on the controller's streams, outside any graph";
	else if (s->spill)
		*why = "a spill tier pins the pages a step reads, which a replay cannot repeat";
	return *why ? -ENOTSUP : 0;
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
	/* dense: every full page, then the tail */
	const uint64_t seg_cap = max_tokens / s->c.page_tokens + 1;
	if (seg_cap > UINT32_MAX / ((uint64_t)batch * s->c.n_kv_heads)) {
		snprintf(s->last_error, sizeof(s->last_error), "reserve: %llu tokens per sequence is too many",
			 (unsigned long long)max_tokens);
		return -EINVAL;
	}
	size_t items_at, segs_at;
	size_t need = fixed_layout(s, batch, (uint32_t)seg_cap, &items_at, &segs_at);
	/* and for uncaptured steps within the reservation, which would
	 * otherwise regrow the buffers under the graph */
	const size_t uncaptured = kvr_sched_layer_scratch_bytes(s, batch, (uint32_t)(max_tokens / s->c.page_tokens));
	need = uncaptured > need ? uncaptured : need;
	for (uint32_t l = 0; l < s->c.n_layers; l++) {
		int err = kvr_mirror_grow(s->dev, &s->eng.scratch[l].m, need);
		if (err) {
			snprintf(s->last_error, sizeof(s->last_error),
				 "reserve: out of memory for the step's buffers (%zu bytes per layer)", need);
			return err;
		}
	}
	/* the attention's kernel scratch too, which a captured launch may not
	 * allocate (it would run unsplit) */
	int err = kvr_dev_attention_reserve(s->dev, &s->head_shape, batch * s->c.n_kv_heads, s->compute);
	if (err) {
		snprintf(s->last_error, sizeof(s->last_error), "reserve: the attention's scratch: %s",
			 kvr_dev_last_error(s->dev));
		return err;
	}
	s->eng.fixed.batch = batch;
	s->eng.fixed.seg_cap = (uint32_t)seg_cap;
	s->eng.fixed.max_tokens = max_tokens;
	/* the layers' buffers may have moved: what was captured before is stale */
	for (uint32_t l = 0; l < s->c.n_layers; l++)
		s->eng.fixed.layers[l].batch = 0;
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
	size_t items_at, segs_at;
	const size_t need = fixed_layout(s, batch, s->eng.fixed.seg_cap, &items_at, &segs_at);
	if (!s->eng.fixed.batch || batch > s->eng.fixed.batch || ls->m.bytes < need) {
		snprintf(s->last_error, sizeof(s->last_error),
			 "a capture allocates nothing: reserve the step's buffers for %u sequences first "
			 "(kvr_decode_reserve; reserved: %u)",
			 batch, s->eng.fixed.batch);
		return -EINVAL;
	}
	if (first) /* a new capture: the graphs captured before cannot be replayed */
		for (uint32_t l = 0; l < s->c.n_layers; l++)
			s->eng.fixed.layers[l].batch = 0;
	const uint32_t n_items = batch * s->c.n_kv_heads;
	unsigned char *dev = ls->m.dev;
	/* the layer after what the engine queued; the engine's later work after
	 * the attention (the compute stream joins the capture, and is joined
	 * back by the engine's wait) */
	int err = kvr_dev_event_record(s->dev, s->eng.engine_ready, engine_stream);
	if (!err)
		err = kvr_dev_stream_wait_event(s->dev, s->compute, s->eng.engine_ready);
	if (!err)
		err = kvr_mirror_to_device(s->dev, &ls->m, ls->m.host, need, s->compute);
	if (!err)
		err = kvr_dev_append(s->dev, &s->shape, (const struct kvr_append_item *)dev, batch, s->compute);
	if (!err)
		err = kvr_dev_attention(s->dev, &s->head_shape, (const struct kvr_attention_item *)(dev + items_at),
					n_items, (const struct kvr_kv_segment *)(dev + segs_at),
					n_items * s->eng.fixed.seg_cap, s->compute);
	if (!err)
		err = kvr_dev_event_record(s->dev, s->eng.layer_done, s->compute);
	if (!err)
		err = kvr_dev_stream_wait_event(s->dev, engine_stream, s->eng.layer_done);
	if (err) {
		snprintf(s->last_error, sizeof(s->last_error), "capturing layer %u: %s", layer,
			 kvr_dev_last_error(s->dev));
		return err;
	}
	s->eng.fixed.layers[layer] = (struct fixed_layer){ q, k, v, out, ls->m.host, ls->m.dev, batch };
	return 0;
}

/* Entry i of layer `layer` as a replay without it (past the replayed batch,
 * or failed): an append the kernel skips, attention items writing zeros. */
static void fixed_entry_empty(struct kvr_sched *s, const struct fixed_layer *fl, uint32_t i,
			      struct kvr_append_item *appends, struct kvr_attention_item *items,
			      uint32_t seg_cap)
{
	const uint32_t n_kv = s->c.n_kv_heads;
	const uint64_t head_q = (uint64_t)s->G * s->c.head_dim * s->eb;
	appends[i] = (struct kvr_append_item){ .row = UINT32_MAX };
	for (uint32_t m = 0; m < n_kv; m++) {
		const uint64_t j = (uint64_t)i * n_kv + m;
		items[j] = (struct kvr_attention_item){ (const unsigned char *)fl->q + i * s->q_row + m * head_q,
							(unsigned char *)fl->out + i * s->q_row + m * head_q, NULL,
							(uint32_t)(j * seg_cap), 0 };
	}
}

/* Entry i's token into layer `layer` (the pool's bookkeeping; the graph's
 * append kernel writes it) and its attention items over every page. On
 * failure the entry is empty and the sequence's step failed. */
static void fixed_entry(struct kvr_sched *s, const struct fixed_layer *fl, uint32_t layer, uint32_t i,
			uint32_t seq, uint64_t position, struct kvr_append_item *appends,
			struct kvr_attention_item *items, struct kvr_kv_segment *segs, uint32_t seg_cap)
{
	const uint32_t n_kv = s->c.n_kv_heads;
	struct kvr_lane *lane = lane_of(s, seq, layer);
	fixed_entry_empty(s, fl, i, appends, items, seg_cap);
	/* dense mode posts no jobs: nothing to wait for, but the lane is the
	 * engine's only once acquired */
	kvr_lane_acquire(s, lane);
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
	appends[i] = (struct kvr_append_item){
		.k_row = (const unsigned char *)fl->k + i * s->kv_row,
		.v_row = (const unsigned char *)fl->v + i * s->kv_row,
		.k_tile = tail,
		.v_tile = tail + s->tile_bytes,
		.hnd_page = fill.page,
		.summary = fill.page ? fill.summary : NULL,
		.row = (uint32_t)(position % s->c.page_tokens),
		.row_stride = n_kv * s->c.head_dim,
		.format = s->kv_format,
	};
	/* every page before the token's is in the pool: resident copies of
	 * those not held yet are queued on compute, before the graph (the
	 * launch stream waits for them); the token's own page, if it completes
	 * it, is read from the pool this step */
	s->eng.fixed.unwritten_from = (uint32_t)(position / s->c.page_tokens);
	for (uint32_t m = 0; m < n_kv; m++) {
		struct kvr_attention_item *it = &items[(uint64_t)i * n_kv + m];
		int seg_err = 0; /* no spill tier: nothing to pin, nothing to fail */
		it->n_segments = kvr_sched_build_segments(s, lane, m, position + 1, 1, NULL, 0,
							  segs + it->first_segment, &seg_err);
	}
	s->eng.fixed.unwritten_from = UINT32_MAX;
	count(s, seq, KVR_C_LAYER_DECODES, 1);
	count(s, seq, KVR_C_DENSE_DECODES, 1);
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
	const uint32_t seg_cap = s->eng.fixed.seg_cap;
	for (uint32_t l = 0; l < s->c.n_layers; l++) {
		const struct fixed_layer *fl = &s->eng.fixed.layers[l];
		size_t items_at, segs_at;
		fixed_layout(s, captured, seg_cap, &items_at, &segs_at);
		unsigned char *host = s->eng.scratch[l].m.host;
		struct kvr_append_item *appends = (void *)host;
		struct kvr_attention_item *items = (void *)(host + items_at);
		struct kvr_kv_segment *segs = (void *)(host + segs_at);
		for (uint32_t i = 0; i < captured; i++) {
			if (i < batch)
				fixed_entry(s, fl, l, i, seqs[i], positions[i], appends, items, segs, seg_cap);
			else
				fixed_entry_empty(s, fl, i, appends, items, seg_cap);
		}
	}
	/* the graph after the resident copies the host part queued */
	int err = kvr_dev_event_record(s->dev, s->eng.fixed.replay_ready, s->compute);
	if (!err && launch_stream)
		err = kvr_dev_stream_wait_event(s->dev, launch_stream, s->eng.fixed.replay_ready);
	if (err) { /* the tokens' bookkeeping is done: the step fails as a whole */
		snprintf(s->last_error, sizeof(s->last_error), "ordering the replay: %s", kvr_dev_last_error(s->dev));
		kvr_sched_step_abandon(s, batch, seqs, positions, 0, err, s->last_error);
	}
	for (uint32_t i = 0; i < batch; i++)
		status[i] = s->eng.step_fail[seqs[i]];
	s->eng.fixed.replay_stream = launch_stream;
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
