/* SPDX-License-Identifier: MIT */
/*
 * trace.h — a fixed-capacity recorder of timed spans, exported as Chrome
 * trace-event JSON (opens in Perfetto and chrome://tracing), one track per
 * thread or stream: the engine's thread, the controller thread, the compute,
 * copy and convert streams.
 *
 * Recording is lock-free: a span reserves its slot with one atomic increment
 * and fills it; spans that do not fit are counted and dropped. Stream spans
 * are filled by host functions that run in stream order, so they show when
 * the stream actually ran the work.
 *
 * Threads: any thread records; export runs when no recording is in progress
 * (the runtime detaches the recorder and quiesces the scheduler first).
 */
#ifndef KVR_SCHEDULER_TRACE_H
#define KVR_SCHEDULER_TRACE_H

#include <stdatomic.h>
#include <stdint.h>

enum kvr_trace_track {
	KVR_TRACK_ENGINE = 0,
	KVR_TRACK_CONTROLLER = 1,
	KVR_TRACK_COMPUTE = 2,
	KVR_TRACK_COPY = 3,
	KVR_TRACK_CONVERT = 4,
	KVR_TRACK_COUNT
};

struct kvr_trace_span {
	const char *name;  /* static string */
	uint32_t track;    /* enum kvr_trace_track */
	uint32_t seq;      /* sequence, or UINT32_MAX */
	uint32_t layer;    /* layer, or UINT32_MAX */
	uint32_t count;    /* pages, heads or items, by span */
	_Atomic uint64_t begin_ns; /* 0 until set; relaxed: read after quiesce */
	_Atomic uint64_t end_ns;
};

struct kvr_trace {
	struct kvr_trace_span *spans;
	uint32_t capacity;
	_Atomic uint32_t next;    /* relaxed: only a slot counter; the slot is owned after */
	_Atomic uint32_t dropped; /* relaxed statistic */
	uint64_t origin_ns;       /* timestamps are exported relative to this */
};

/* Monotonic clock in nanoseconds. */
uint64_t kvr_now_ns(void);

int kvr_trace_create(uint32_t capacity, struct kvr_trace **out);
void kvr_trace_destroy(struct kvr_trace *t);
/* A slot for one span, or NULL when the recorder is full (counted). */
struct kvr_trace_span *kvr_trace_reserve(struct kvr_trace *t, const char *name, uint32_t track,
					 uint32_t seq, uint32_t layer, uint32_t count);
/* Record a complete span from the calling thread. */
void kvr_trace_span(struct kvr_trace *t, const char *name, uint32_t track, uint32_t seq,
		    uint32_t layer, uint32_t count, uint64_t begin_ns, uint64_t end_ns);
/* Write every complete span as Chrome trace-event JSON. Returns 0 or -errno. */
int kvr_trace_write_json(const struct kvr_trace *t, const char *path);

#endif /* KVR_SCHEDULER_TRACE_H */
