/* SPDX-License-Identifier: MIT */
/*
 * step_append.c — step 1 of a layer call: each entry's token appended to its
 * sequence. On the host path the host writes the token into the tail tile
 * (kvr_sched_append); with a device append (a device with memory of its
 * own) the host keeps only the pool's bookkeeping and queues one append
 * kernel that copies the rows from the engine's k and v and converts the
 * pages they complete, so it waits for nothing.
 *
 * Threads: the engine's thread (one step at a time per context).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "step_impl.h"

/* The device append of entry i's token (lc->device_append): the pool's
 * bookkeeping on the host, and an append item (queue_appends) that copies
 * the rows from the engine's k and v into the tail tile and converts a page
 * the token completes. The host touches no data, so it waits for nothing.
 * On failure *why says why and nothing of the entry was queued. */
static int append_on_device(struct layer_call *lc, uint32_t i, const struct kvr_tail_tile *tail,
			    const char **why)
{
	struct kvr_sched *s = lc->s;
	const uint32_t seq = lc->seqs[i];
	struct kvr_pool_fill fill;
	int err = kvr_pool_append_token(s->pool, seq, lc->layer, lc->positions[i], &fill);
	if (err) {
		*why = kvr_pool_last_error(s->pool);
		return err;
	}
	if (fill.page && s->spill) { /* pinned by the pool until the device has written it */
		err = kvr_sched_hold_pin(s, fill.id);
		if (err) {
			kvr_pool_unpin_live(s->pool, &fill.id, 1);
			kvr_pool_truncate(s->pool, seq, lc->layer, lc->positions[i]);
			*why = "out of memory for the step's pins";
			return err;
		}
	}
	lc->appends[lc->n_appends++] = (struct kvr_append_item){
		.k_row = lc->k_dev + i * lc->kv_row,
		.v_row = lc->v_dev + i * lc->kv_row,
		.k_tile = tail->keys,
		.v_tile = tail->values,
		.hnd_page = fill.page,
		.summary = fill.page ? fill.summary : NULL,
		.row = (uint32_t)(lc->positions[i] % s->c.page_tokens),
		.row_stride = s->c.n_kv_heads * s->c.head_dim,
		.format = s->kv_format,
	};
	lc->n_filled += fill.page != NULL;
	return 0;
}

/* The layer's tokens into their tail tiles and the pages they complete into
 * the pool (HND page and key summary: kvr_pool_write_page's work, on the
 * device), one kernel on the compute stream before any attention reads
 * them. A failure here is the device's: the layer fails (the pool's counts
 * go back with the step, step_end). */
static void queue_appends(struct layer_call *lc)
{
	struct kvr_sched *s = lc->s;
	const size_t bytes = lc->n_appends * sizeof(*lc->appends);
	int err = kvr_mirror_to_device(s->dev, &lc->ls->m, lc->appends, bytes, s->compute);
	if (!err)
		err = kvr_dev_append(s->dev, &s->shape, kvr_mirror_dev_at(&lc->ls->m, lc->appends), lc->n_appends,
				     s->compute);
	/* the engine's own stream (the host path's corrections select on it)
	 * reads the new pages' summaries: it waits for them on the device */
	if (!err && lc->n_filled)
		err = kvr_dev_event_record(s->dev, s->eng.appended, s->compute);
	if (!err && lc->n_filled)
		err = kvr_dev_stream_wait_event(s->dev, s->engine_inline, s->eng.appended);
	if (err)
		lc->append_error = err;
}

/* 1. Acquire the lanes, append the tokens; a sequence that fails here gets
 * its status, zeros, and no further work this layer. */
void kvr_step_layer_append(struct layer_call *lc)
{
	struct kvr_sched *s = lc->s;
	const uint32_t layer = lc->layer;
	for (uint32_t i = 0; i < lc->batch; i++) {
		const uint32_t seq = lc->seqs[i];
		unsigned char *out_row = (unsigned char *)lc->out + i * lc->q_row;
		struct kvr_lane *lane = lane_of(s, seq, layer);
		const uint64_t waited = kvr_lane_acquire(s, lane);
		if (waited) {
			count(s, seq, KVR_C_CONTROLLER_WAITS, 1);
			count(s, seq, KVR_C_CONTROLLER_WAIT_NS, waited);
			if (lc->tr)
				kvr_trace_span(lc->tr, "wait controller", KVR_TRACK_ENGINE, seq, layer, 0,
					       kvr_now_ns() - waited, kvr_now_ns());
		}
		kvr_importance_harvest(s, lane); /* before this step overwrites its lse */
		if (s->eng.step_fail[seq]) { /* an earlier layer of this step failed it */
			lc->status[i] = s->eng.step_fail[seq];
			kvr_step_zero_output(s, out_row);
			count(s, seq, KVR_C_FAILED_DECODES, 1);
			continue;
		}
		if (lane->recall_error) {
			/* the recall this step would attend over could not read its pages
			 * from the spill file: fail this sequence's step, append nothing;
			 * the lane recalls afresh at its next step */
			lc->status[i] = lane->recall_error;
			lane->recall_error = 0;
			kvr_step_fail_sequence(s, seq, layer, lc->positions[i], lc->status[i], NULL, out_row);
			continue;
		}
		struct kvr_tail_tile tail = { s->tails[seq] + (uint64_t)layer * 2 * s->tile_bytes,
					      s->tails[seq] + ((uint64_t)layer * 2 + 1) * s->tile_bytes };
		const char *why = NULL;
		if (lc->device_append) {
			lc->status[i] = append_on_device(lc, i, &tail, &why);
		} else {
			lc->status[i] = kvr_pool_ingest(s->pool, seq, layer, lc->positions[i], 1,
							lc->k_host + i * lc->kv_row,
							lc->v_host + i * lc->kv_row, &tail);
			why = kvr_pool_last_error(s->pool);
		}
		if (lc->status[i]) {
			kvr_step_zero_output(s, out_row);
			count(s, seq, KVR_C_FAILED_DECODES, 1);
			kvr_sched_mark_failed(s, seq, layer, lc->positions[i], lc->status[i], why);
			continue;
		}
		lane->appended_step = s->eng.step_serial;
	}
	if (lc->n_appends)
		queue_appends(lc);
}
