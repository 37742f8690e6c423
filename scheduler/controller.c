/* SPDX-License-Identifier: MIT */
/*
 * controller.c — the controller thread: one per context, it takes lane jobs
 * from two FIFO queues (urgent first: the recall of corrected heads that an
 * engine's attention is waiting for; then normal: the speculative selection
 * for the next step and the deferred recall of the other heads) and runs
 * them: selection on its own inline stream, then, for streamed recall, the
 * plan and the issue of copies and conversions on the recall streams. On the
 * device plan (a GPU) it reads nothing back: the selection, and streamed the
 * prefetch of its pages, are issued on its stream and marked by the lane's
 * sel_done, which the next step's plan waits for on the device.
 *
 * Handoff: the engine fills a lane's job fields, sets in_flight and queues
 * the lane under `lock`; the controller clears in_flight with a release store
 * when the job is issued, then wakes the engine if it sleeps on `done`. The
 * engine spins briefly on in_flight before sleeping, because a condvar
 * handoff costs tens of microseconds on a small machine.
 *
 * Threads: kvr_controller_post and kvr_lane_acquire on the engine's thread;
 * controller_main on the controller thread.
 */
#include <stdio.h>

#include "../gpu/fault.h"
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
	/* the device plan with streamed recall: the recall is a prefetch on
	 * the device after the selection (recall.c), not the staged path */
	const int prefetch = s->device_plan && s->recall == KVR_RECALL_STREAMED;
	if (lane->job == LANE_JOB_SELECT) {
		if (prefetch) /* the previous one's counts, before sel_done is recorded again */
			kvr_recall_prefetch_settle(s, lane);
		/* prev_q may still be on its way (the device append copies it on
		 * the compute stream, then records attn_done): a stream wait */
		err = kvr_dev_stream_wait_event(s->dev, s->rec.ctl_sel.stream, lane->attn_done);
		if (!err)
			err = kvr_select_pages(s, lane, lane->prev_q, lane->job_n_tokens, 1, lane->selected,
					       &s->rec.ctl_sel);
		if (!err && prefetch)
			err = kvr_recall_prefetch(s, lane, s->rec.ctl_sel.stream); /* records sel_done */
		else if (!err && s->rec.ctl_sel.n_ring) /* the next step's plan waits for it on the device */
			err = kvr_dev_event_record(s->dev, lane->sel_done, s->rec.ctl_sel.stream);
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
	if (!err && s->recall == KVR_RECALL_STREAMED && !prefetch) {
		const uint64_t t1 = kvr_now_ns();
		err = kvr_recall_issue(s, lane, lane->job_heads);
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
		if (s->rec.ctl_sel.n_ring)
			kvr_dev_stream_synchronize(s->dev, s->rec.ctl_sel.stream);
		lane->prefetch_pending = 0;
		lane->has_prev = 0;
		if (lane->slot_page)
			for (uint32_t i = 0; i < s->c.n_kv_heads * s->k; i++)
				lane->slot_page[i] = -1;
	}
	count(s, lane->seq, KVR_C_CONTROLLER_NS, kvr_now_ns() - t0);
	count(s, lane->seq, KVR_C_CONTROLLER_JOBS, 1);
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
		pthread_mutex_unlock(&s->queue.lock);
		run_job(s, lane);
		/* release pairs with the acquire loads in kvr_lane_acquire: the
		 * engine sees the job's results (selected, slot_page, events) */
		atomic_store_explicit(&lane->in_flight, 0, memory_order_release);
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
