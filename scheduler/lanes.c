/* SPDX-License-Identifier: MIT */
/*
 * lanes.c — a sequence's lanes over their life: opened with the sequence
 * (recall slots, importance and residency state), quiesced before anything
 * changes its pool tables, forgotten after a truncate or a failed step (the
 * next sparse step selects afresh), released when the sequence closes.
 *
 * Threads: the engine's thread; a lane whose controller job is in flight is
 * waited for first (kvr_sched_seq_quiesce).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../layouts/base/fault.h"
#include "sched_impl.h"

void kvr_sched_lane_forget(struct kvr_sched *s, struct kvr_lane *lane)
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
	if (s->device_append)
		kvr_dev_free(s->dev, lane->prev_q);
	else
		kvr_mapped_free(s->dev, lane->prev_q);
	kvr_mapped_free(s->dev, lane->selected);
	kvr_mapped_free(s->dev, lane->slot_page);
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
		/* the lane's recall may still be running on the streams, and
		 * an asynchronous selection (select.c) writing `selected` */
		if (lane->recall_done)
			kvr_dev_event_synchronize(s->dev, lane->recall_done);
		if (lane->sel_done)
			kvr_dev_event_synchronize(s->dev, lane->sel_done);
		kvr_recall_prefetch_settle(s, lane); /* its counts, now that it has run */
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
		/* the device append keeps q on the device, where the kernels that
		 * read it (similarity, the controller's score) find it nearby */
		int err = s->device_append ? kvr_dev_alloc(s->dev, s->q_row, (void **)&lane->prev_q)
					   : kvr_mapped_alloc(s->dev, s->q_row, (void **)&lane->prev_q);
		if (!err)
			err = kvr_mapped_alloc(s->dev, n_sel * sizeof(int32_t), (void **)&lane->selected);
		lane->job_heads = kvr_malloc(s->c.n_kv_heads);
		if (!err && !lane->job_heads)
			err = -ENOMEM;
		/* mapped: the device plan plans slots on the device (step.c) */
		if (!err && s->recall == KVR_RECALL_STREAMED && !kvr_layer_dense(s, l))
			err = kvr_mapped_alloc(s->dev, n_sel * sizeof(int32_t), (void **)&lane->slot_page);
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
		kvr_sched_lane_forget(s, lane);
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
		kvr_sched_lane_forget(s, lane_of(s, seq, l));
}
