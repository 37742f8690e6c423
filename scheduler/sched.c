/* SPDX-License-Identifier: MIT */
/*
 * sched.c — the scheduler's lifecycle (create: geometry, streams, staging,
 * recall and units setup, the controller thread; destroy in reverse) and its
 * read-only getters (errors, counters, per-head corrections, the trace).
 *
 * Threads: create and destroy on the engine's thread with no step open; the
 * getters from any thread (counters and the trace pointer are atomics).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../layouts/base/fault.h"
#include "sched_impl.h"

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
				       c->dtype, scale, c->tau, c->estimate ? KVR_SHAPE_ESTIMATES : 0u, 0, 0, 0 };
	s->estimates = c->estimate != 0;
	s->head_shape = (struct kvr_shape){ s->G, 1, c->head_dim, c->page_tokens, c->dtype, scale,
					    c->tau, 0, 0, 0, 0 };
	s->lse_shape = s->head_shape;
	s->lse_shape.flags = KVR_SHAPE_SEGMENT_LSE;
	for (uint32_t w = 0; w < 4; w++)
		s->hook_args[w] = (struct hook_arg){ s, w };
	pthread_mutex_init(&s->queue.lock, NULL);
	pthread_cond_init(&s->queue.work, NULL);
	pthread_cond_init(&s->queue.done, NULL);
	pthread_mutex_init(&s->error_lock, NULL);

	int ret = 0;
	const size_t n_lanes = (size_t)c->max_sequences * c->n_layers;
	s->lanes = kvr_calloc(n_lanes, sizeof(*s->lanes));
	s->tails = kvr_calloc(c->max_sequences, sizeof(*s->tails));
	s->eng.scratch = kvr_calloc(c->n_layers, sizeof(*s->eng.scratch));
	s->eng.tally = kvr_calloc(c->n_layers, sizeof(*s->eng.tally));
	s->seq_counters = kvr_calloc((size_t)c->max_sequences * KVR_C_COUNT, sizeof(*s->seq_counters));
	s->head_corrections = kvr_calloc((size_t)c->max_sequences * c->n_kv_heads,
				     sizeof(*s->head_corrections));
	s->eng.step_fail = kvr_calloc(c->max_sequences, sizeof(*s->eng.step_fail));
	s->eng.step_fail_pos = kvr_calloc(c->max_sequences, sizeof(*s->eng.step_fail_pos));
	s->eng.step_serial = 1; /* lanes start at appended_step 0: never */
	s->eng.step_failed = kvr_calloc(c->max_sequences, sizeof(*s->eng.step_failed));
	s->eng.step_fail_layer = kvr_calloc(c->max_sequences, sizeof(*s->eng.step_fail_layer));
	s->eng.step_fail_message = kvr_calloc(c->max_sequences, KVR_SCHED_MESSAGE);
	if (!s->lanes || !s->tails || !s->eng.scratch || !s->eng.tally || !s->seq_counters || !s->head_corrections ||
	    !s->eng.step_fail || !s->eng.step_fail_pos || !s->eng.step_failed || !s->eng.step_fail_layer ||
	    !s->eng.step_fail_message) {
		snprintf(err, err_bytes, "scheduler: out of memory");
		ret = -ENOMEM;
	}
	if (!ret && (!(s->eng.seg_pages = kvr_malloc((s->k ? s->k : 1) * sizeof(*s->eng.seg_pages))) ||
		     !(s->eng.seg_slots = kvr_malloc((s->k ? s->k : 1) * sizeof(*s->eng.seg_slots))) ||
		     !(s->eng.post_lanes = kvr_malloc(c->max_batch * sizeof(*s->eng.post_lanes))) ||
		     !(s->queue.batch = kvr_malloc(c->max_batch * sizeof(*s->queue.batch))))) {
		snprintf(err, err_bytes, "scheduler: out of memory");
		ret = -ENOMEM;
	}
	if (!ret)
		ret = kvr_mapped_alloc(s->dev, (size_t)c->max_batch * c->n_kv_heads * (s->k ? s->k : 1) *
							sizeof(int32_t), (void **)&s->eng.now_sel);
	if (!ret)
		ret = kvr_mirror_grow(s->dev, &s->eng.engine_sel.item, sizeof(struct kvr_score_item));
	if (!ret)
		ret = kvr_mirror_grow(s->dev, &s->rec.ctl_sel.item, sizeof(struct kvr_score_item));
	if (!ret)
		ret = kvr_mirror_grow(s->dev, &s->eng.similarity, sizeof(struct kvr_similarity_item));
	if (!ret && !(s->eng.zero_row = kvr_calloc(1, s->q_row)))
		ret = -ENOMEM;
	if (!ret && !(s->eng.fixed.layers = kvr_calloc(c->n_layers, sizeof(*s->eng.fixed.layers))))
		ret = -ENOMEM;
	if (!ret)
		ret = kvr_dev_event_create(s->dev, &s->eng.engine_ready);
	if (!ret)
		ret = kvr_dev_event_create(s->dev, &s->eng.layer_done);
	if (!ret)
		ret = kvr_dev_event_create(s->dev, &s->eng.appended);
	if (!ret)
		ret = kvr_dev_event_create(s->dev, &s->eng.fixed.replay_done);
	if (!ret)
		ret = kvr_dev_event_create(s->dev, &s->eng.fixed.replay_ready);
	s->eng.fixed.unwritten_from = UINT32_MAX;
	if (ret && !err[0])
		snprintf(err, err_bytes, "scheduler: %s",
			 ret == -ENOMEM ? "out of memory" : kvr_dev_last_error(s->dev));
	if (!ret && (ret = kvr_dev_stream_create(s->dev, 0, &s->engine_inline)) == 0 &&
	    (ret = kvr_dev_stream_create(s->dev, s->hooks.async_compute ? KVR_STREAM_WORKER : 0,
					 &s->compute)) == 0)
		ret = kvr_dev_stream_create(s->dev, 0, &s->ctl_inline);
	/* cuda's streams are asynchronous whatever their flags (backend.h) */
	s->compute_host_sync = kvr_dev_kind_of(s->dev) != KVR_DEV_CUDA && !s->hooks.async_compute;
	s->device_append = !kvr_dev_host_visible(s->dev) && s->kv_format != KVR_KV_MIXED &&
			   s->pool_layout == KVR_POOL_LAYOUT_HND && !s->hooks.host_step;
	/* streamed: the plan kernel moves misses straight from the pinned pool,
	 * which a spill tier cannot promise holds them */
	/* the estimate's segments (segments.c) are built on the host, around
	 * the selection it reads: no device plan with it in this version */
	s->device_plan = s->device_append && kvr_sched_k_plannable(c) && !c->estimate &&
			 (s->recall == KVR_RECALL_ZERO_COPY ||
			  (s->recall == KVR_RECALL_STREAMED && !s->kv_format && !kvr_pool_spill_file(s->pool)));
	s->eng.engine_sel.stream = s->engine_inline;
	s->rec.ctl_sel.stream = s->ctl_inline;
	/* the device plan reads the controller's selections only on the
	 * device (streamed: its prefetch too): issued, not waited for */
	if (!ret && s->device_plan && (ret = kvr_selector_make_async(s, &s->rec.ctl_sel)))
		snprintf(err, err_bytes, "scheduler: %s",
			 ret == -ENOMEM ? "out of memory" : kvr_dev_last_error(s->dev));
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
	kvr_sched_unpin_step(s);
	free(s->eng.step_pins);
	kvr_dev_stream_destroy(s->dev, s->engine_inline);
	kvr_dev_stream_destroy(s->dev, s->compute);
	kvr_dev_stream_destroy(s->dev, s->ctl_inline);
	if (s->eng.scratch)
		for (uint32_t l = 0; l < s->c.n_layers; l++)
			kvr_mirror_free(s->dev, &s->eng.scratch[l].m);
	free(s->eng.scratch);
	free(s->eng.tally);
	kvr_sched_free_deferred(s); /* the streams were synchronised above */
	free(s->eng.deferred);
	kvr_scratch_free(s->dev, s->eng.plan_scores);
	free(s->lanes);
	free(s->tails);
	free(s->eng.step_fail);
	free(s->eng.step_fail_pos);
	free(s->eng.step_failed);
	free(s->eng.step_fail_layer);
	free(s->eng.step_fail_message);
	free(s->eng.seg_pages);
	free(s->eng.seg_slots);
	free(s->eng.post_lanes);
	free(s->queue.batch);
	kvr_mapped_free(s->dev, s->eng.now_sel);
	kvr_selector_free(s, &s->eng.engine_sel);
	kvr_selector_free(s, &s->rec.ctl_sel);
	kvr_mirror_free(s->dev, &s->eng.similarity);
	kvr_mapped_free(s->dev, s->eng.inputs_stage);
	kvr_scratch_free(s->dev, s->eng.engine_sel.scores);
	kvr_scratch_free(s->dev, s->rec.ctl_sel.scores);
	kvr_stage_free(s->dev, s->eng.prefill_q);
	kvr_stage_free(s->dev, s->eng.prefill_out);
	kvr_mapped_free(s->dev, s->eng.prefill_rows);
	kvr_mapped_free(s->dev, s->eng.prefill_lse);
	free(s->eng.zero_row);
	kvr_dev_event_destroy(s->dev, s->eng.engine_ready);
	kvr_dev_event_destroy(s->dev, s->eng.layer_done);
	kvr_dev_event_destroy(s->dev, s->eng.appended);
	kvr_dev_event_destroy(s->dev, s->eng.fixed.replay_done);
	kvr_dev_event_destroy(s->dev, s->eng.fixed.replay_ready);
	kvr_sched_capture_free(s);
	free(s->eng.fixed.layers);
	free((void *)s->seq_counters);
	free((void *)s->head_corrections);
	pthread_mutex_destroy(&s->queue.lock);
	pthread_cond_destroy(&s->queue.work);
	pthread_cond_destroy(&s->queue.done);
	pthread_mutex_destroy(&s->error_lock);
	free(s);
}

int kvr_sched_k_plannable(const struct kvr_config *c)
{
	if (!c->page_tokens || c->budget_tokens < c->sink_tokens + c->window_tokens)
		return 0;
	const uint32_t k = (c->budget_tokens - c->sink_tokens - c->window_tokens) / c->page_tokens;
	return k >= 1 && k <= KVR_PLAN_MAX_K;
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

void kvr_sched_defer_free(struct kvr_sched *s, void *ptr, int mapped)
{
	if (s->eng.n_deferred == s->eng.deferred_cap) {
		const uint32_t cap = s->eng.deferred_cap ? 2 * s->eng.deferred_cap : 16;
		struct deferred_free *grown = kvr_realloc(s->eng.deferred, cap * sizeof(*grown));
		if (!grown) { /* cannot keep it for later: wait for the device, free now */
			kvr_dev_stream_synchronize(s->dev, s->compute);
			kvr_dev_stream_synchronize(s->dev, s->engine_inline);
			if (mapped)
				kvr_mapped_free(s->dev, ptr);
			else
				kvr_dev_free(s->dev, ptr);
			return;
		}
		s->eng.deferred = grown;
		s->eng.deferred_cap = cap;
	}
	s->eng.deferred[s->eng.n_deferred++] = (struct deferred_free){ ptr, mapped };
}

void kvr_sched_free_deferred(struct kvr_sched *s)
{
	for (uint32_t i = 0; i < s->eng.n_deferred; i++) {
		if (s->eng.deferred[i].mapped)
			kvr_mapped_free(s->dev, s->eng.deferred[i].ptr);
		else
			kvr_dev_free(s->dev, s->eng.deferred[i].ptr);
	}
	s->eng.n_deferred = 0;
}
