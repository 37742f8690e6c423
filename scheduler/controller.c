/* SPDX-License-Identifier: MIT */
/*
 * controller.c — the controller thread: one per context, it takes lane jobs
 * from two FIFO queues (urgent first: the recall of corrected heads that an
 * engine's attention is waiting for; then normal: the speculative selection
 * for the next step and the deferred recall of the other heads) and runs
 * them: selection on its own inline stream, then, for streamed recall, the
 * plan and the issue of copies and conversions on the recall streams. On the
 * device plan (a GPU) it reads nothing back, and runs the selection jobs
 * queued together as one batch (run_select_batch): the selections, and
 * streamed the prefetch of their pages, are issued on its stream and marked
 * by each lane's sel_done, which the next step's plan waits for on the
 * device.
 *
 * Handoff: the engine fills a lane's job fields, sets in_flight and queues
 * the lane under `lock`; the controller clears in_flight with a release store
 * when the job is issued, then wakes the engine if it sleeps on `done`. The
 * engine spins briefly on in_flight before sleeping, because a condvar
 * handoff costs tens of microseconds on a small machine.
 *
 * Threads: kvr_controller_post, kvr_controller_post_many and
 * kvr_lane_acquire on the engine's thread; controller_main (run_job,
 * run_select_batch) on the controller thread, or on the engine's with
 * jobs inline.
 */
#include <stdio.h>

#include "../layouts/base/fault.h"
#include "sched_impl.h"

#define ACQUIRE_SPINS 2000 /* pauses before the engine sleeps on a lane */

void kvr_sched_record_async_error(struct kvr_sched *s, int err, const char *what)
{
	pthread_mutex_lock(&s->error_lock);
	if (!s->async_error) {
		s->async_error = err;
		snprintf(s->async_message, sizeof(s->async_message), "%s", what);
	}
	pthread_mutex_unlock(&s->error_lock);
	if (s->log_fn)
		s->log_fn(s->log_user, KVR_LOG_ERROR, what);
}

static void run_job(struct kvr_sched *s, struct kvr_lane *lane)
{
	if (s->hooks.delay)
		s->hooks.delay(s->hooks.user, KVR_HOOK_CONTROLLER_JOB);
	const uint64_t t0 = kvr_now_ns();
	int err = 0;
	/* the host's planning: the device plan's selections run in batches
	 * (run_select_batch), its jobs are all selections */
	if (lane->job == LANE_JOB_SELECT) {
		/* prev_q may still be on its way (the device append copies it on
		 * the compute stream, then records attn_done): a stream wait */
		err = kvr_dev_stream_wait_event(s->dev, s->rec.ctl_sel.stream, lane->attn_done);
		if (!err)
			err = kvr_select_pages(s, lane, lane->prev_q, lane->job_n_tokens, 1, lane->selected,
					       &s->rec.ctl_sel);
		if (err) {
			char what[224];
			snprintf(what, sizeof(what), "controller: selection of sequence %u layer %u: %s",
				 lane->seq, lane->layer, kvr_dev_last_error(s->dev));
			kvr_sched_record_async_error(s, err, what);
		} else {
			count(s, lane->seq, KVR_C_SELECTIONS, 1);
		}
		const uint64_t t1 = kvr_now_ns();
		struct kvr_trace *tr = trace_of(s);
		if (tr)
			kvr_trace_span(tr, "select (next step)", KVR_TRACK_CONTROLLER, lane->seq,
				       lane->layer, s->c.n_kv_heads, t0, t1);
	}
	if (!err && s->recall == KVR_RECALL_STREAMED) {
		const uint64_t t1 = kvr_now_ns();
		err = kvr_recall_issue(s, lane, lane->job_heads);
		count(s, lane->seq, KVR_C_CTL_RECALL_NS, kvr_now_ns() - t1);
		if (err && lane->job_urgent) {
			/* the engine waits to attend over this recall: its sequence's
			 * step fails with the error (a status, not an asynchronous
			 * error); the lane recalls afresh at its next step */
			const int spill = lane->recall_error != 0; /* read_chunk left it */
			lane->recall_error = err;
			snprintf(s->urgent_message, sizeof(s->urgent_message), "recall: %s",
				 spill ? kvr_pool_last_error(s->pool) : kvr_dev_last_error(s->dev));
		} else if (err && lane->recall_error) {
			/* a page could not be read from the spill file: the lane's next
			 * step fails its sequence with the status; the context goes on */
			if (s->log_fn) {
				char what[224];
				snprintf(what, sizeof(what), "controller: recall of sequence %u layer %u: %s",
					 lane->seq, lane->layer, kvr_pool_last_error(s->pool));
				s->log_fn(s->log_user, KVR_LOG_ERROR, what);
			}
		} else if (err) {
			char what[224];
			snprintf(what, sizeof(what), "controller: recall of sequence %u layer %u: %s",
				 lane->seq, lane->layer, kvr_dev_last_error(s->dev));
			kvr_sched_record_async_error(s, err, what);
		}
		struct kvr_trace *tr = trace_of(s);
		if (tr)
			kvr_trace_span(tr, lane->job_urgent ? "plan + issue recall (urgent)"
							    : "plan + issue recall",
				       KVR_TRACK_CONTROLLER, lane->seq, lane->layer, 0, t1, kvr_now_ns());
	}
	if (err) {
		/* the lane's selection or slots are not what its next attention would
		 * expect: forget them, so the next step selects afresh with its own
		 * query (a full correction) and recalls every page it needs (once
		 * what the device was given for them has run) */
		lane->has_prev = 0;
		if (lane->slot_page)
			for (uint32_t i = 0; i < s->c.n_kv_heads * s->k; i++)
				lane->slot_page[i] = -1;
	}
	count(s, lane->seq, KVR_C_CONTROLLER_NS, kvr_now_ns() - t0);
	count(s, lane->seq, KVR_C_CONTROLLER_JOBS, 1);
}

/* A job the device plan's batches take: a speculative selection with the
 * asynchronous selector (every job on the device plan). */
static int batchable(const struct kvr_sched *s, const struct kvr_lane *lane)
{
	return s->device_plan && s->rec.ctl_sel.n_ring && lane->job == LANE_JOB_SELECT;
}

/*
 * The device plan's SELECT jobs of n lanes together (n >= 1): the
 * selections in one launch of score and select (select.c), streamed the
 * prefetches in one plan and one scatter (recall.c), then each lane's
 * sel_done. One lane at a time, a layer's jobs at batch 8 enqueued about ten
 * operations per lane on this thread (uploads, three score kernels, select,
 * plan, scatter, events), which on an H100 kept speculative and freekv well
 * behind blocking, whose engine selects the batch at once (docs/history.md).
 * Each lane is counted, traced and, on failure, forgotten as run_job does.
 */
static void run_select_batch(struct kvr_sched *s, struct kvr_lane *const *lanes, uint32_t n)
{
	struct kvr_selector *sel = &s->rec.ctl_sel;
	const int prefetch = s->recall == KVR_RECALL_STREAMED;
	for (uint32_t i = 0; i < n && s->hooks.delay; i++)
		s->hooks.delay(s->hooks.user, KVR_HOOK_CONTROLLER_JOB);
	const uint64_t t0 = kvr_now_ns();
	int err = 0;
	for (uint32_t i = 0; i < n && !err; i++) {
		if (prefetch) /* the previous one's counts, before sel_done is recorded again */
			kvr_recall_prefetch_settle(s, lanes[i]);
		/* prev_q may still be on its way (the plan kernel keeps it on the
		 * compute stream, then attn_done is recorded): a stream wait */
		err = kvr_dev_stream_wait_event(s->dev, sel->stream, lanes[i]->attn_done);
	}
	uint32_t slot = 0;
	if (!err)
		err = kvr_select_pages_batch(s, lanes, n, sel, &slot);
	if (!err && prefetch)
		err = kvr_recall_prefetch_batch(s, lanes, n, sel, slot);
	if (!err) /* the slot's items may be rewritten once this has passed */
		err = kvr_dev_event_record(s->dev, sel->ring_done[slot], sel->stream);
	for (uint32_t i = 0; i < n && !err; i++) /* the next step's plan waits for it on the device */
		err = kvr_dev_event_record(s->dev, lanes[i]->sel_done, sel->stream);
	const uint64_t t1 = kvr_now_ns();
	if (err) {
		char what[224];
		snprintf(what, sizeof(what), "controller: selection of %u sequences' layers (sequence %u layer %u first): %s",
			 n, lanes[0]->seq, lanes[0]->layer, kvr_dev_last_error(s->dev));
		kvr_sched_record_async_error(s, err, what);
		/* as run_job: the lanes select afresh at their next step */
		kvr_dev_stream_synchronize(s->dev, sel->stream);
	}
	struct kvr_trace *tr = trace_of(s);
	if (tr)
		kvr_trace_span(tr, "select (next step)", KVR_TRACK_CONTROLLER, lanes[0]->seq, lanes[0]->layer, n,
			       t0, t1);
	for (uint32_t i = 0; i < n; i++) {
		struct kvr_lane *lane = lanes[i];
		if (err) {
			lane->prefetch_pending = 0;
			lane->has_prev = 0;
			if (lane->slot_page)
				for (uint32_t x = 0; x < s->c.n_kv_heads * s->k; x++)
					lane->slot_page[x] = -1;
		} else {
			count(s, lane->seq, KVR_C_SELECTIONS, 1);
		}
		count(s, lane->seq, KVR_C_CONTROLLER_NS, (t1 - t0) / n);
		count(s, lane->seq, KVR_C_CONTROLLER_JOBS, 1);
	}
}

static void *controller_main(void *arg)
{
	struct kvr_sched *s = arg;
	pthread_mutex_lock(&s->queue.lock);
	for (;;) {
		while (!s->queue.urgent_head && !s->queue.normal_head && !s->queue.quit)
			pthread_cond_wait(&s->queue.work, &s->queue.lock);
		struct kvr_lane *lane = s->queue.urgent_head;
		if (lane) {
			s->queue.urgent_head = lane->next;
			if (!s->queue.urgent_head)
				s->queue.urgent_tail = NULL;
		} else if ((lane = s->queue.normal_head)) {
			s->queue.normal_head = lane->next;
			if (!s->queue.normal_head)
				s->queue.normal_tail = NULL;
		} else {
			break; /* quit with empty queues */
		}
		/* the device plan: the selections queued behind it, together (no
		 * urgent job waits behind them: the device plan posts none) */
		struct kvr_lane **batch = s->queue.batch;
		uint32_t n = 1;
		batch[0] = lane;
		if (batchable(s, lane))
			while (n < s->rec.ctl_sel.batch_cap && s->queue.normal_head && !s->queue.urgent_head &&
			       batchable(s, s->queue.normal_head)) {
				batch[n++] = s->queue.normal_head;
				s->queue.normal_head = s->queue.normal_head->next;
				if (!s->queue.normal_head)
					s->queue.normal_tail = NULL;
			}
		pthread_mutex_unlock(&s->queue.lock);
		const uint64_t taken = kvr_now_ns();
		for (uint32_t i = 0; i < n; i++) /* posted_ns: published by the queue mutex */
			count(s, batch[i]->seq, KVR_C_CTL_HANDOFF_NS,
			      taken > batch[i]->posted_ns ? taken - batch[i]->posted_ns : 0);
		if (batchable(s, lane))
			run_select_batch(s, batch, n);
		else
			run_job(s, lane);
		/* release pairs with the acquire loads in kvr_lane_acquire: the
		 * engine sees the jobs' results (selected, slot_page, events) */
		for (uint32_t i = 0; i < n; i++)
			atomic_store_explicit(&batch[i]->in_flight, 0, memory_order_release);
		pthread_mutex_lock(&s->queue.lock);
		if (s->queue.engine_waiting)
			pthread_cond_broadcast(&s->queue.done);
	}
	pthread_mutex_unlock(&s->queue.lock);
	return NULL;
}

int kvr_controller_start(struct kvr_sched *s)
{
	int err = kvr_pthread_create(&s->queue.thread, NULL, controller_main, s);
	if (err)
		return -err;
	s->queue.thread_started = 1;
	return 0;
}

void kvr_controller_stop(struct kvr_sched *s)
{
	if (!s->queue.thread_started)
		return;
	pthread_mutex_lock(&s->queue.lock);
	s->queue.quit = 1;
	pthread_cond_signal(&s->queue.work);
	pthread_mutex_unlock(&s->queue.lock);
	pthread_join(s->queue.thread, NULL);
	s->queue.thread_started = 0;
}

int kvr_sched_jobs_inline(const struct kvr_sched *s)
{
	return s->jobs_inline;
}

void kvr_controller_post(struct kvr_sched *s, struct kvr_lane *lane, int urgent)
{
	if (s->jobs_inline) {
		lane->job_urgent = (uint32_t)urgent;
		run_job(s, lane);
		return;
	}
	/* relaxed: the queue mutex below publishes the store with the job */
	atomic_store_explicit(&lane->in_flight, 1, memory_order_relaxed);
	lane->job_urgent = (uint32_t)urgent;
	lane->posted_ns = kvr_now_ns();
	lane->next = NULL;
	pthread_mutex_lock(&s->queue.lock);
	struct kvr_lane **head = urgent ? &s->queue.urgent_head : &s->queue.normal_head;
	struct kvr_lane **tail = urgent ? &s->queue.urgent_tail : &s->queue.normal_tail;
	if (*tail)
		(*tail)->next = lane;
	else
		*head = lane;
	*tail = lane;
	pthread_cond_signal(&s->queue.work);
	pthread_mutex_unlock(&s->queue.lock);
}

void kvr_controller_post_many(struct kvr_sched *s, struct kvr_lane *const *lanes, uint32_t n)
{
	if (!n)
		return;
	if (s->jobs_inline) {
		uint32_t all = 1;
		for (uint32_t i = 0; i < n; i++)
			all &= (uint32_t)batchable(s, lanes[i]);
		if (all) {
			run_select_batch(s, lanes, n);
			return;
		}
		for (uint32_t i = 0; i < n; i++) {
			lanes[i]->job_urgent = 0;
			run_job(s, lanes[i]);
		}
		return;
	}
	const uint64_t now = kvr_now_ns();
	for (uint32_t i = 0; i < n; i++) {
		/* relaxed: the queue mutex below publishes the stores with the jobs */
		atomic_store_explicit(&lanes[i]->in_flight, 1, memory_order_relaxed);
		lanes[i]->job_urgent = 0;
		lanes[i]->posted_ns = now;
		lanes[i]->next = i + 1 < n ? lanes[i + 1] : NULL;
	}
	pthread_mutex_lock(&s->queue.lock);
	if (s->queue.normal_tail)
		s->queue.normal_tail->next = lanes[0];
	else
		s->queue.normal_head = lanes[0];
	s->queue.normal_tail = lanes[n - 1];
	pthread_cond_signal(&s->queue.work);
	pthread_mutex_unlock(&s->queue.lock);
}

uint64_t kvr_lane_acquire(struct kvr_sched *s, struct kvr_lane *lane)
{
	/* acquire pairs with the controller's release store of in_flight */
	if (!atomic_load_explicit(&lane->in_flight, memory_order_acquire))
		return 0;
	const uint64_t t0 = kvr_now_ns();
	for (int i = 0; i < ACQUIRE_SPINS; i++) {
		if (!atomic_load_explicit(&lane->in_flight, memory_order_acquire))
			return kvr_now_ns() - t0;
#if defined(__x86_64__) || defined(__i386__)
		__builtin_ia32_pause();
#endif
	}
	pthread_mutex_lock(&s->queue.lock);
	s->queue.engine_waiting++;
	while (atomic_load_explicit(&lane->in_flight, memory_order_acquire))
		pthread_cond_wait(&s->queue.done, &s->queue.lock);
	s->queue.engine_waiting--;
	pthread_mutex_unlock(&s->queue.lock);
	return kvr_now_ns() - t0;
}
