/* SPDX-License-Identifier: MIT */
/*
 * waits.c — every place the scheduler makes a host thread wait for the
 * device (a stream or event synchronise, the synchronise that completes a
 * blocking device-to-host copy) goes through here, so that the engine
 * thread's waits inside a layer call can be counted (kvr_stats.host_waits,
 * bench decode's host_waits_per_layer) and traced.
 *
 * What counts: the scheduler's own waits, the ones a GPU would make the host
 * sit through, whether or not this backend had anything left to run (an
 * inline stream has always run its work already; counting the call keeps the
 * figure the same on cpu, cudaemu and cuda). Not counted: a stream-ordered
 * wait (kvr_dev_stream_wait_event: the device waits, the host goes on, even
 * though a host-synchronous stream honours it by blocking), waits outside a
 * layer call (the step's end, prefill, teardown), and the controller
 * thread's waits. The engine's waits for a controller job appear as
 * controller waits, and for an urgent recall as a host wait
 * (kvr_sched_count_host_wait): planning that a correction cannot go on
 * without.
 *
 * Threads: any; the counting is keyed by a thread-local mark that the engine
 * sets for the span of one layer call (kvr_sched_layer_enter/leave), so a
 * controller thread never counts, and a controller job run inline on the
 * engine's thread inside a layer call does.
 */
#include "sched_impl.h"

/* The scheduler whose layer call the calling thread is inside, or NULL. */
static _Thread_local const struct kvr_sched *layer_owner;

void kvr_sched_layer_enter(struct kvr_sched *s)
{
	layer_owner = s;
}

void kvr_sched_layer_leave(struct kvr_sched *s)
{
	(void)s;
	layer_owner = NULL;
}

static int counting(const struct kvr_sched *s)
{
	return layer_owner == s;
}

int kvr_sched_in_layer(const struct kvr_sched *s)
{
	return counting(s);
}

void kvr_sched_count_host_wait(struct kvr_sched *s, uint32_t seq, uint32_t layer, const char *what,
			       uint64_t t0, uint64_t t1)
{
	if (!counting(s))
		return;
	if (seq == UINT32_MAX) { /* the batch's wait: the context's count only */
		atomic_fetch_add_explicit(&s->counters[KVR_C_HOST_WAITS], 1, memory_order_relaxed);
		atomic_fetch_add_explicit(&s->counters[KVR_C_HOST_WAIT_NS], t1 - t0, memory_order_relaxed);
	} else {
		count(s, seq, KVR_C_HOST_WAITS, 1);
		count(s, seq, KVR_C_HOST_WAIT_NS, t1 - t0);
	}
	struct kvr_trace *tr = trace_of(s);
	if (tr)
		kvr_trace_span(tr, what, KVR_TRACK_ENGINE, seq, layer, 0, t0, t1);
}

int kvr_sched_wait_stream(struct kvr_sched *s, struct kvr_stream *stream, uint32_t seq, uint32_t layer,
			  const char *what)
{
	const uint64_t t0 = counting(s) ? kvr_now_ns() : 0;
	const int err = kvr_dev_stream_synchronize(s->dev, stream);
	if (counting(s))
		kvr_sched_count_host_wait(s, seq, layer, what, t0, kvr_now_ns());
	return err;
}

int kvr_sched_wait_event(struct kvr_sched *s, struct kvr_event *event, uint32_t seq, uint32_t layer,
			 const char *what)
{
	const uint64_t t0 = counting(s) ? kvr_now_ns() : 0;
	const int err = kvr_dev_event_synchronize(s->dev, event);
	if (counting(s))
		kvr_sched_count_host_wait(s, seq, layer, what, t0, kvr_now_ns());
	return err;
}
