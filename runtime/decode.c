/* SPDX-License-Identifier: MIT */
/*
 * decode.c — the decode, statistics and tracing calls of kvrecall.h: argument
 * checks and the open step's bookkeeping. The step itself — appending each
 * sequence's K/V, the correction check, selection, recall and attention — is
 * the scheduler's (scheduler/step.c), with the controller thread running the
 * next step's selection and recall beside the engine.
 *
 * Threads: the engine's thread for decode calls (one step at a time per
 * context); statistics may be read from any thread.
 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../gpu/backend.h"
#include "../layouts/base/fault.h"
#include "../scheduler/scheduler.h"
#include "../scheduler/trace.h"
#include "internal.h"

void kvr_decode_teardown(struct kvr_context *ctx)
{
	if (ctx->dev)
		kvr_dev_stream_destroy(ctx->dev, ctx->engine_stream);
	ctx->engine_stream = NULL;
	free(ctx->step.seqs);
	free(ctx->step.positions);
	free(ctx->step.layer_done);
	memset(&ctx->step, 0, sizeof(ctx->step));
}

/* Mark the step's sequences as in (or out of) the open step: calls that would
 * change their tokens under it are refused (sequence.c). */
static void step_members(struct kvr_context *ctx, int in_step)
{
	pthread_mutex_lock(&ctx->seq_lock);
	for (uint32_t i = 0; i < ctx->step.batch; i++)
		ctx->seqs[ctx->step.seqs[i]].in_step = in_step;
	pthread_mutex_unlock(&ctx->seq_lock);
}

KVR_API int kvr_decode_begin(struct kvr_context *ctx, const uint32_t *seqs,
			     const uint64_t *positions, uint32_t batch)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "decode_begin: ctx is NULL");
	if (ctx->step.open)
		return kvr_fail(ctx, -EBUSY, "decode_begin: a step is already open (call kvr_decode_end)");
	if (!batch || batch > ctx->config.max_batch)
		return kvr_fail(ctx, -EINVAL, "decode_begin: batch of %u sequences (must be 1..max_batch %u)",
				batch, ctx->config.max_batch);
	if (!seqs || !positions)
		return kvr_fail(ctx, -EINVAL, "decode_begin: seqs or positions is NULL");
	for (uint32_t i = 0; i < batch; i++) {
		pthread_mutex_lock(&ctx->seq_lock);
		const int alive = seqs[i] < ctx->config.max_sequences && ctx->seqs[seqs[i]].alive;
		pthread_mutex_unlock(&ctx->seq_lock);
		if (!alive)
			return kvr_fail(ctx, -EINVAL, "decode_begin: sequence %u (batch entry %u) does not exist",
					seqs[i], i);
		for (uint32_t j = 0; j < i; j++)
			if (seqs[j] == seqs[i])
				return kvr_fail(ctx, -EINVAL, "decode_begin: sequence %u appears twice", seqs[i]);
	}
	if (!ctx->step.seqs) {
		ctx->step.seqs = kvr_malloc(ctx->config.max_batch * sizeof(*ctx->step.seqs));
		ctx->step.positions = kvr_malloc(ctx->config.max_batch * sizeof(*ctx->step.positions));
		ctx->step.layer_done = kvr_malloc(ctx->config.n_layers);
		if (!ctx->step.seqs || !ctx->step.positions || !ctx->step.layer_done) {
			kvr_decode_teardown(ctx);
			return kvr_fail(ctx, -ENOMEM, "decode_begin: out of memory");
		}
	}
	memcpy(ctx->step.seqs, seqs, batch * sizeof(*seqs));
	memcpy(ctx->step.positions, positions, batch * sizeof(*positions));
	memset(ctx->step.layer_done, 0, ctx->config.n_layers);
	ctx->step.captured = ctx->step.replayed = 0;
	ctx->step.batch = batch;
	ctx->step.open = 1;
	step_members(ctx, 1);
	return 0;
}

KVR_API int kvr_decode_end(struct kvr_context *ctx)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "decode_end: ctx is NULL");
	if (!ctx->step.open)
		return kvr_fail(ctx, -EINVAL, "decode_end: no step is open");
	/* Once a layer was decoded, every layer must be: a layer left out would
	 * leave the sequences one token short there, with no position valid for
	 * all layers. Such a step is taken back in every layer instead. A step
	 * with no layer decoded stored nothing: ending it cancels it. */
	uint32_t missing = ctx->config.n_layers, any = 0;
	for (uint32_t l = 0; l < ctx->config.n_layers; l++) {
		any |= ctx->step.layer_done[l];
		if (!ctx->step.layer_done[l] && missing == ctx->config.n_layers)
			missing = l;
	}
	if (!any)
		missing = ctx->config.n_layers;
	if (ctx->step.captured) {
		/* recorded into the engine's graph, not decoded: nothing was stored,
		 * and nothing waits (the capture may still be open) */
		ctx->step.open = 0;
		step_members(ctx, 0);
		if (missing < ctx->config.n_layers)
			return kvr_fail(ctx, -EINVAL,
					"decode_end: layer %u was not captured in this step: a replay needs every "
					"layer captured (capture the whole step again)",
					missing);
		return 0;
	}
	if (missing < ctx->config.n_layers)
		kvr_sched_step_abandon(ctx->sched, ctx->step.batch, ctx->step.seqs, ctx->step.positions,
				       missing, -EINVAL, "not decoded in this step");
	ctx->step.open = 0;
	step_members(ctx, 0);
	int err = kvr_sched_step_end(ctx->sched);
	if (err)
		return kvr_fail(ctx, err, "decode_end: %s", kvr_dev_last_error(ctx->dev));
	if (missing < ctx->config.n_layers)
		return kvr_fail(ctx, -EINVAL,
				"decode_end: layer %u was not decoded in this step (every layer must be): "
				"the step is taken back, every sequence's layers are at its positions again",
				missing);
	ctx->steps++;
	return 0;
}

/* The engine's stream wrapped for the device (kept while the engine passes the
 * same handle); *out NULL on backends without native streams. */
static int engine_stream_of(struct kvr_context *ctx, void *native, const char *what, struct kvr_stream **out)
{
	if (kvr_dev_host_visible(ctx->dev)) {
		if (native)
			return kvr_fail(ctx, -EINVAL, "%s: the %s backend takes no stream (pass NULL)", what,
					kvr_dev_name(ctx->dev));
		*out = NULL;
		return 0;
	}
	if (!ctx->engine_stream || ctx->engine_stream_native != native) {
		kvr_dev_stream_destroy(ctx->dev, ctx->engine_stream);
		ctx->engine_stream = NULL;
		int err = kvr_dev_stream_wrap(ctx->dev, native, &ctx->engine_stream);
		if (err)
			return kvr_fail(ctx, err, "%s: the engine's stream: %s", what, kvr_dev_last_error(ctx->dev));
		ctx->engine_stream_native = native;
	}
	*out = ctx->engine_stream;
	return 0;
}

/* Layer `layer` of the open step recorded into the graph the engine's
 * stream is being captured into (scheduler/capture.c): stores nothing. */
static int capture_layer(struct kvr_context *ctx, uint32_t layer, const void *q, const void *k, const void *v,
			 void *out, int32_t *status, struct kvr_stream *engine_stream, int first)
{
	const uint32_t batch = ctx->step.batch;
	int err = kvr_sched_capture_layer(ctx->sched, layer, batch, first, q, k, v, out, engine_stream);
	if (err)
		return kvr_fail(ctx, err, "decode_layer: capturing layer %u: %s", layer,
				kvr_sched_last_error(ctx->sched));
	ctx->step.layer_done[layer] = 1;
	ctx->step.captured = 1;
	for (uint32_t i = 0; i < batch; i++)
		status[i] = 0;
	return 0;
}

KVR_API int kvr_decode_layer(struct kvr_context *ctx, uint32_t layer, const void *q,
			     const void *k, const void *v, void *out, int32_t *status, void *stream)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "decode_layer: ctx is NULL");
	struct kvr_stream *engine_stream = NULL;
	if (ctx->step.open && layer < ctx->config.n_layers && q && k && v && out && status) {
		int err = engine_stream_of(ctx, stream, "decode_layer", &engine_stream);
		if (err)
			return err;
	}
	return kvr_decode_layer_on(ctx, layer, q, k, v, out, status, engine_stream);
}

int kvr_decode_layer_on(struct kvr_context *ctx, uint32_t layer, const void *q, const void *k, const void *v,
			void *out, int32_t *status, struct kvr_stream *engine_stream)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "decode_layer: ctx is NULL");
	const struct kvr_config *c = &ctx->config;
	if (!ctx->step.open)
		return kvr_fail(ctx, -EINVAL, "decode_layer: no step is open (call kvr_decode_begin)");
	if (layer >= c->n_layers)
		return kvr_fail(ctx, -EINVAL, "decode_layer: layer %u out of range (n_layers %u)", layer,
				c->n_layers);
	if (!q || !k || !v || !out || !status)
		return kvr_fail(ctx, -EINVAL, "decode_layer: q, k, v, out or status is NULL");
	if (ctx->step.replayed)
		return kvr_fail(ctx, -EINVAL,
				"decode_layer: this step is replayed (kvr_decode_replay did every layer's part): "
				"launch the graph and call kvr_decode_end");
	if (ctx->step.layer_done[layer])
		return kvr_fail(ctx, -EINVAL,
				"decode_layer: layer %u was already decoded in this step (its tokens are "
				"stored); the step is unchanged", layer);
	const int capturing = engine_stream ? kvr_dev_stream_capturing(ctx->dev, engine_stream) : 0;
	if (capturing < 0)
		return kvr_fail(ctx, capturing, "decode_layer: the engine's stream: %s", kvr_dev_last_error(ctx->dev));
	int any = 0;
	for (uint32_t l = 0; l < c->n_layers; l++)
		any |= ctx->step.layer_done[l];
	if (any && capturing != ctx->step.captured)
		return kvr_fail(ctx, -EINVAL,
				"decode_layer: layer %u %s captured and this step's earlier layers %s: a step's "
				"layers are captured all or none; the step is unchanged",
				layer, capturing ? "is being" : "is not", capturing ? "were not" : "were");
	if (capturing)
		return capture_layer(ctx, layer, q, k, v, out, status, engine_stream, !any);
	const uint32_t batch = ctx->step.batch;
	int err = kvr_sched_decode_layer(ctx->sched, layer, batch, ctx->step.seqs, ctx->step.positions,
					 q, k, v, out, status, engine_stream);
	ctx->step.layer_done[layer] = 1; /* what it appended is stored or taken back */
	if (err) {
		/* the layer may have appended some tokens and not others: fail the
		 * step of every sequence, which kvr_decode_end takes back */
		char why[KVR_ERROR_MESSAGE_BYTES];
		snprintf(why, sizeof(why), "%s", kvr_sched_last_error(ctx->sched));
		kvr_sched_step_abandon(ctx->sched, batch, ctx->step.seqs, ctx->step.positions, layer, err,
				       why);
		for (uint32_t i = 0; i < batch; i++)
			status[i] = err;
		return kvr_fail(ctx, err, "decode_layer: layer %u: %s", layer, why);
	}
	/* one message per failure: the layer it happened at reports it, later
	 * layers (which fail the sequence too) keep it */
	for (uint32_t i = 0; i < batch; i++) {
		uint32_t at;
		const char *why;
		if (status[i] && kvr_sched_step_failure(ctx->sched, ctx->step.seqs[i], &at, &why) &&
		    at == layer)
			kvr_fail(ctx, status[i], "decode_layer: %s", why);
	}
	return 0;
}

/* Failures of a replayed step, one message each (decode_layer's rule). */
static void report_failures(struct kvr_context *ctx, const int32_t *status)
{
	for (uint32_t i = 0; i < ctx->step.batch; i++) {
		uint32_t at;
		const char *why;
		if (status[i] && kvr_sched_step_failure(ctx->sched, ctx->step.seqs[i], &at, &why))
			kvr_fail(ctx, status[i], "decode_replay: %s", why);
	}
}

KVR_API int kvr_decode_replay(struct kvr_context *ctx, int32_t *status, void *stream)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "decode_replay: ctx is NULL");
	struct kvr_stream *launch_stream = NULL;
	if (ctx->step.open && status) {
		int err = engine_stream_of(ctx, stream, "decode_replay", &launch_stream);
		if (err)
			return err;
	}
	return kvr_decode_replay_on(ctx, status, launch_stream);
}

int kvr_decode_replay_on(struct kvr_context *ctx, int32_t *status, struct kvr_stream *launch_stream)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "decode_replay: ctx is NULL");
	if (!ctx->step.open)
		return kvr_fail(ctx, -EINVAL, "decode_replay: no step is open (call kvr_decode_begin)");
	if (!status)
		return kvr_fail(ctx, -EINVAL, "decode_replay: status is NULL");
	for (uint32_t l = 0; l < ctx->config.n_layers; l++)
		if (ctx->step.layer_done[l] || ctx->step.replayed)
			return kvr_fail(ctx, -EINVAL,
					"decode_replay: this step's layers were decoded, captured or replayed "
					"already: a replay does every layer");
	int err = kvr_sched_replay_step(ctx->sched, ctx->step.batch, ctx->step.seqs, ctx->step.positions, status,
					launch_stream);
	if (err)
		return kvr_fail(ctx, err, "decode_replay: %s (the step is unchanged)", kvr_sched_last_error(ctx->sched));
	memset(ctx->step.layer_done, 1, ctx->config.n_layers);
	ctx->step.replayed = 1;
	report_failures(ctx, status);
	return 0;
}

KVR_API int kvr_decode_reserve(struct kvr_context *ctx, uint32_t batch, uint64_t max_tokens)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "decode_reserve: ctx is NULL");
	if (ctx->step.open)
		return kvr_fail(ctx, -EBUSY, "decode_reserve: a decode step is open");
	int err = kvr_sched_capture_reserve(ctx->sched, batch, max_tokens);
	if (err)
		return kvr_fail(ctx, err, "decode_reserve: %s", kvr_sched_last_error(ctx->sched));
	return 0;
}

/* ------------------------------------------------------------------ statistics */

static void fill_stats(const uint64_t cnt[KVR_C_COUNT], uint64_t steps, uint64_t units,
		       uint64_t units_used, struct kvr_stats *out)
{
	struct kvr_stats st;
	memset(&st, 0, sizeof(st));
	st.size = sizeof(st);
	st.steps = steps;
	st.layer_decodes = cnt[KVR_C_LAYER_DECODES];
	st.dense_decodes = cnt[KVR_C_DENSE_DECODES];
	st.selections = cnt[KVR_C_SELECTIONS];
	st.corrected_heads = cnt[KVR_C_CORRECTED_HEADS];
	st.checked_heads = cnt[KVR_C_CHECKED_HEADS];
	st.failed_decodes = cnt[KVR_C_FAILED_DECODES];
	st.correction_waits = cnt[KVR_C_CORRECTION_WAITS];
	st.correction_wait_ns = cnt[KVR_C_CORRECTION_WAIT_NS];
	st.controller_waits = cnt[KVR_C_CONTROLLER_WAITS];
	st.controller_wait_ns = cnt[KVR_C_CONTROLLER_WAIT_NS];
	st.recall_waits = cnt[KVR_C_RECALL_WAITS];
	st.recall_wait_ns = cnt[KVR_C_RECALL_WAIT_NS];
	st.pages_recalled = cnt[KVR_C_PAGES_RECALLED];
	st.pages_hit = cnt[KVR_C_PAGES_HIT];
	st.bytes_recalled = cnt[KVR_C_BYTES_RECALLED];
	st.critical_ns = cnt[KVR_C_CRITICAL_NS];
	st.controller_ns = cnt[KVR_C_CONTROLLER_NS];
	st.controller_jobs = cnt[KVR_C_CONTROLLER_JOBS];
	st.pages_judged = cnt[KVR_C_PAGES_JUDGED];
	st.pages_demoted = cnt[KVR_C_PAGES_DEMOTED];
	st.device_units = units;
	st.device_units_used = units_used;
	st.host_waits = cnt[KVR_C_HOST_WAITS];
	st.host_wait_ns = cnt[KVR_C_HOST_WAIT_NS];
	st.controller_handoff_ns = cnt[KVR_C_CTL_HANDOFF_NS];
	st.controller_prepare_ns = cnt[KVR_C_CTL_PREPARE_NS];
	st.controller_score_ns = cnt[KVR_C_CTL_SCORE_NS];
	st.controller_topk_ns = cnt[KVR_C_CTL_TOPK_NS];
	st.controller_recall_ns = cnt[KVR_C_CTL_RECALL_NS];
	const uint32_t size = out->size < sizeof(st) ? out->size : (uint32_t)sizeof(st);
	memcpy(out, &st, size);
	out->size = size;
}

/* The smallest kvr_stats accepted: the 0.1 struct, up to failed_decodes. */
#define STATS_MIN_SIZE (offsetof(struct kvr_stats, failed_decodes) + sizeof(uint64_t))

KVR_API int kvr_get_stats(const struct kvr_context *ctx, struct kvr_stats *stats)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "get_stats: ctx is NULL");
	if (!stats || stats->size < STATS_MIN_SIZE)
		return kvr_fail(ctx, -EINVAL,
				"get_stats: stats is NULL or its size is below %zu (set stats.size = "
				"sizeof(struct kvr_stats))", (size_t)STATS_MIN_SIZE);
	uint64_t cnt[KVR_C_COUNT], held, free_units, per_seq;
	kvr_sched_counters(ctx->sched, UINT32_MAX, cnt);
	kvr_sched_units(ctx->sched, &held, &free_units, &per_seq);
	fill_stats(cnt, ctx->steps, held, held - free_units, stats);
	return 0;
}

KVR_API int kvr_seq_get_stats(const struct kvr_context *ctx, uint32_t seq, struct kvr_stats *stats)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "seq_get_stats: ctx is NULL");
	if (!stats || stats->size < STATS_MIN_SIZE)
		return kvr_fail(ctx, -EINVAL, "seq_get_stats: stats is NULL or its size is too small");
	if (seq >= ctx->config.max_sequences || !ctx->seqs[seq].alive)
		return kvr_fail(ctx, -EINVAL, "seq_get_stats: sequence %u does not exist", seq);
	uint64_t cnt[KVR_C_COUNT], held, free_units, per_seq;
	kvr_sched_counters(ctx->sched, seq, cnt);
	kvr_sched_units(ctx->sched, &held, &free_units, &per_seq);
	fill_stats(cnt, 0, per_seq, cnt[KVR_C_UNITS_TAKEN] - cnt[KVR_C_UNITS_RELEASED], stats);
	return 0;
}

KVR_API int kvr_get_head_corrections(const struct kvr_context *ctx, uint32_t seq, uint64_t *counts,
				     uint32_t n)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "get_head_corrections: ctx is NULL");
	if (!counts || !n || n > ctx->config.n_kv_heads)
		return kvr_fail(ctx, -EINVAL, "get_head_corrections: counts is NULL or n (%u) is not "
				"1..n_kv_heads %u", n, ctx->config.n_kv_heads);
	if (seq != UINT32_MAX && (seq >= ctx->config.max_sequences || !ctx->seqs[seq].alive))
		return kvr_fail(ctx, -EINVAL, "get_head_corrections: sequence %u does not exist", seq);
	uint64_t all[KVR_MAX_KV_HEADS];
	kvr_sched_head_corrections(ctx->sched, seq, all, ctx->config.n_kv_heads);
	memcpy(counts, all, n * sizeof(*counts));
	return 0;
}

KVR_API int kvr_async_error(struct kvr_context *ctx, const char **message)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "async_error: ctx is NULL");
	return kvr_sched_async_error(ctx->sched, message);
}

/* ------------------------------------------------------------------ tracing */

KVR_API int kvr_trace_start(struct kvr_context *ctx, uint32_t max_spans)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "trace_start: ctx is NULL");
	if (ctx->step.open)
		return kvr_fail(ctx, -EBUSY, "trace_start: a decode step is open");
	if (!max_spans)
		return kvr_fail(ctx, -EINVAL, "trace_start: max_spans must be at least 1");
	struct kvr_trace *t;
	if (kvr_trace_create(max_spans, &t))
		return kvr_fail(ctx, -ENOMEM, "trace_start: out of memory for %u spans", max_spans);
	kvr_sched_set_trace(ctx->sched, NULL);
	for (uint32_t seq = 0; seq < ctx->config.max_sequences; seq++)
		if (ctx->seqs[seq].alive)
			kvr_sched_seq_quiesce(ctx->sched, seq);
	kvr_trace_destroy(ctx->trace);
	ctx->trace = t;
	kvr_sched_set_trace(ctx->sched, t);
	return 0;
}

KVR_API int kvr_trace_write(struct kvr_context *ctx, const char *path)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "trace_write: ctx is NULL");
	if (!ctx->trace)
		return kvr_fail(ctx, -EINVAL, "trace_write: no trace was started (kvr_trace_start)");
	if (ctx->step.open)
		return kvr_fail(ctx, -EBUSY, "trace_write: a decode step is open");
	if (!path)
		return kvr_fail(ctx, -EINVAL, "trace_write: path is NULL");
	/* detach, then let every job and stream that may still record finish */
	kvr_sched_set_trace(ctx->sched, NULL);
	for (uint32_t seq = 0; seq < ctx->config.max_sequences; seq++)
		if (ctx->seqs[seq].alive)
			kvr_sched_seq_quiesce(ctx->sched, seq);
	int err = kvr_trace_write_json(ctx->trace, path);
	if (err) {
		/* the spans are kept and recording goes on: the caller may retry
		 * with another path */
		kvr_sched_set_trace(ctx->sched, ctx->trace);
		return kvr_fail(ctx, err, "trace_write: %s: %s (the trace is kept)", path, strerror(-err));
	}
	kvr_trace_destroy(ctx->trace);
	ctx->trace = NULL;
	return 0;
}
