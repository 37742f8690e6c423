/* SPDX-License-Identifier: MIT */
/*
 * trace.c — the span recorder of trace.h and its Chrome trace-event export.
 * Each span becomes one complete ("X") event on the track's thread id, with
 * the sequence, layer and count as args; metadata events name the tracks.
 *
 * Threads: see trace.h.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "../layouts/base/fault.h"
#include "trace.h"

uint64_t kvr_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int kvr_trace_create(uint32_t capacity, struct kvr_trace **out)
{
	struct kvr_trace *t = kvr_calloc(1, sizeof(*t));
	if (!t)
		return -ENOMEM;
	t->spans = kvr_calloc(capacity ? capacity : 1, sizeof(*t->spans));
	if (!t->spans) {
		free(t);
		return -ENOMEM;
	}
	t->capacity = capacity;
	t->origin_ns = kvr_now_ns();
	*out = t;
	return 0;
}

void kvr_trace_destroy(struct kvr_trace *t)
{
	if (!t)
		return;
	free(t->spans);
	free(t);
}

struct kvr_trace_span *kvr_trace_reserve(struct kvr_trace *t, const char *name, uint32_t track,
					 uint32_t seq, uint32_t layer, uint32_t count)
{
	/* relaxed: the counter only hands out slots; the exporter reads after the
	 * runtime quiesced every recording thread (a happens-before through its
	 * joins and stream synchronisation) */
	const uint32_t i = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed);
	if (i >= t->capacity) {
		atomic_fetch_add_explicit(&t->dropped, 1, memory_order_relaxed);
		return NULL;
	}
	struct kvr_trace_span *sp = &t->spans[i];
	sp->name = name;
	sp->track = track;
	sp->seq = seq;
	sp->layer = layer;
	sp->count = count;
	return sp;
}

void kvr_trace_span(struct kvr_trace *t, const char *name, uint32_t track, uint32_t seq,
		    uint32_t layer, uint32_t count, uint64_t begin_ns, uint64_t end_ns)
{
	struct kvr_trace_span *sp = kvr_trace_reserve(t, name, track, seq, layer, count);
	if (!sp)
		return;
	atomic_store_explicit(&sp->begin_ns, begin_ns, memory_order_relaxed);
	atomic_store_explicit(&sp->end_ns, end_ns, memory_order_relaxed);
}

static const char *const track_names[KVR_TRACK_COUNT] = {
	[KVR_TRACK_ENGINE] = "engine thread (critical path)",
	[KVR_TRACK_CONTROLLER] = "controller thread",
	[KVR_TRACK_COMPUTE] = "compute stream (attention)",
	[KVR_TRACK_COPY] = "copy stream (pool -> staging)",
	[KVR_TRACK_CONVERT] = "convert stream (staging -> slots)",
};

int kvr_trace_write_json(const struct kvr_trace *t, const char *path)
{
	FILE *f = fopen(path, "w");
	if (!f)
		return -errno;
	fprintf(f, "{\"displayTimeUnit\": \"ns\", \"traceEvents\": [\n");
	for (uint32_t k = 0; k < KVR_TRACK_COUNT; k++)
		fprintf(f,
			"{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": 1, \"tid\": %u, "
			"\"args\": {\"name\": \"%s\"}},\n"
			"{\"ph\": \"M\", \"name\": \"thread_sort_index\", \"pid\": 1, \"tid\": %u, "
			"\"args\": {\"sort_index\": %u}},\n",
			k, track_names[k], k, k);
	fprintf(f, "{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": 1, "
		   "\"args\": {\"name\": \"kvrecall\"}}");
	uint32_t n = atomic_load_explicit(&t->next, memory_order_relaxed);
	if (n > t->capacity)
		n = t->capacity;
	for (uint32_t i = 0; i < n; i++) {
		const struct kvr_trace_span *sp = &t->spans[i];
		const uint64_t b = atomic_load_explicit(&sp->begin_ns, memory_order_relaxed);
		const uint64_t e = atomic_load_explicit(&sp->end_ns, memory_order_relaxed);
		if (!b || !e || e < b || b < t->origin_ns)
			continue; /* never ran (e.g. recorded while detaching) */
		fprintf(f,
			",\n{\"ph\": \"X\", \"name\": \"%s\", \"pid\": 1, \"tid\": %u, \"ts\": %.3f, "
			"\"dur\": %.3f, \"args\": {",
			sp->name, sp->track, (double)(b - t->origin_ns) / 1e3, (double)(e - b) / 1e3);
		int comma = 0;
		if (sp->seq != UINT32_MAX)
			comma = fprintf(f, "\"seq\": %u", sp->seq) > 0;
		if (sp->layer != UINT32_MAX)
			comma = fprintf(f, "%s\"layer\": %u", comma ? ", " : "", sp->layer) > 0;
		fprintf(f, "%s\"count\": %u}}", comma ? ", " : "", sp->count);
	}
	fprintf(f, "\n], \"otherData\": {\"dropped_spans\": %u}}\n",
		atomic_load_explicit(&t->dropped, memory_order_relaxed));
	const int bad = ferror(f);
	if (fclose(f) || bad)
		return -EIO;
	return 0;
}
