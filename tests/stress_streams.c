/* SPDX-License-Identifier: MIT */
/*
 * stress_streams.c — the cpu backend's concurrency under load, as a plain
 * program so it also runs under ThreadSanitizer (Criterion's forking runner
 * cannot host TSan):
 *  - a producer thread copies numbered blocks on a worker stream and records
 *    an event after each; a consumer thread makes its inline stream wait for
 *    the event and checks the block arrived whole (the controller/engine
 *    hand-off of the decode step);
 *  - two threads call parallel_for on one device at once (one of them runs
 *    inline, by design) while a third enqueues kernels on a worker stream:
 *    summaries, and decode attention long enough to run in parts that the
 *    last one to finish merges.
 * Exit 0 on success; prints "N passed, N failed".
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "../gpu/cpu/cpu_backend.h"

#define BLOCKS 400
#define BLOCK_BYTES 4096

struct handoff {
	struct kvr_dev *dev;
	struct kvr_stream *copy_stream;  /* worker: the producer's */
	struct kvr_event *ready[BLOCKS]; /* recorded after block i's copy */
	_Atomic int recorded;            /* blocks whose event was recorded; release/acquire */
	unsigned char *src, *dst;        /* BLOCKS x BLOCK_BYTES */
	int failures;
};

static void *producer(void *arg)
{
	struct handoff *h = arg;
	for (int i = 0; i < BLOCKS; i++) {
		memset(h->src + (size_t)i * BLOCK_BYTES, i & 0xff, BLOCK_BYTES);
		if (kvr_dev_memcpy_async(h->dev, h->dst + (size_t)i * BLOCK_BYTES,
					 h->src + (size_t)i * BLOCK_BYTES, BLOCK_BYTES, KVR_COPY_H2D,
					 h->copy_stream) ||
		    kvr_dev_event_record(h->dev, h->ready[i], h->copy_stream))
			h->failures++;
		/* pairs with the consumer's acquire: the record happened before */
		atomic_store_explicit(&h->recorded, i + 1, memory_order_release);
	}
	return NULL;
}

static void *consumer(void *arg)
{
	struct handoff *h = arg;
	struct kvr_stream *inline_stream;
	if (kvr_dev_stream_create(h->dev, 0, &inline_stream)) {
		h->failures++;
		return NULL;
	}
	for (int i = 0; i < BLOCKS; i++) {
		while (atomic_load_explicit(&h->recorded, memory_order_acquire) <= i)
			;
		if (kvr_dev_stream_wait_event(h->dev, inline_stream, h->ready[i])) {
			h->failures++;
			continue;
		}
		const unsigned char *b = h->dst + (size_t)i * BLOCK_BYTES;
		for (int j = 0; j < BLOCK_BYTES; j++)
			if (b[j] != (unsigned char)(i & 0xff)) {
				h->failures++;
				break;
			}
	}
	kvr_dev_stream_destroy(h->dev, inline_stream);
	return NULL;
}

struct sum_job {
	const uint32_t *values;
	_Atomic uint64_t total; /* relaxed: summed, read after parallel_for returns */
};

static void sum_task(void *arg, uint32_t i)
{
	struct sum_job *job = arg;
	atomic_fetch_add_explicit(&job->total, job->values[i], memory_order_relaxed);
}

struct pf_worker {
	struct kvr_dev *dev;
	int failures;
};

static void *parallel_user(void *arg)
{
	struct pf_worker *w = arg;
	uint32_t values[1000];
	for (uint32_t i = 0; i < 1000; i++)
		values[i] = i;
	for (int round = 0; round < 300; round++) {
		struct sum_job job = { values, 0 };
		kvr_cpu_parallel_for(w->dev, sum_task, &job, 1000);
		if (atomic_load_explicit(&job.total, memory_order_relaxed) != 999ull * 1000 / 2)
			w->failures++;
	}
	return NULL;
}

static void *kernel_user(void *arg)
{
	struct pf_worker *w = arg;
	struct kvr_stream *s;
	if (kvr_dev_stream_create(w->dev, KVR_STREAM_WORKER, &s)) {
		w->failures++;
		return NULL;
	}
	/* summaries of a constant page: min = max = the constant */
	const struct kvr_shape shape = { 4, 2, 64, 16, KVR_ELEM_F32, 0.125f, 0.9f, 0, 0, 0, 0 };
	float *rows = malloc(16 * 2 * 64 * sizeof(float)), *summary = malloc(2 * 2 * 64 * sizeof(float));
	for (int i = 0; i < 16 * 2 * 64; i++)
		rows[i] = 3.0f;
	struct kvr_page_item item = { rows, NULL, NULL, summary, 2 * 64, 0 };
	for (int round = 0; round < 200; round++) {
		memset(summary, 0, 2 * 2 * 64 * sizeof(float));
		if (kvr_dev_summarize(w->dev, &shape, &item, 1, s) || kvr_dev_stream_synchronize(w->dev, s)) {
			w->failures++;
			continue;
		}
		for (int i = 0; i < 2 * 2 * 64; i++)
			if (summary[i] != 3.0f) {
				w->failures++;
				break;
			}
	}
	/* decode attention over more tokens than one part (2,048): its parts
	 * run as tasks on the workers, the last to finish merging them; values
	 * all 3 make every output 3, whatever the keys' weights */
	enum { T = 5000, ROW = 2 * 64 };
	float *keys = malloc((size_t)T * ROW * sizeof(float)), *vals = malloc((size_t)T * ROW * sizeof(float));
	float *q = malloc(4 * 64 * sizeof(float)), *out = malloc(4 * 64 * sizeof(float));
	for (int i = 0; i < T * ROW; i++) {
		keys[i] = (float)(((uint32_t)i * 7919u) % 211u) / 50.0f - 2.0f;
		vals[i] = 3.0f;
	}
	for (int i = 0; i < 4 * 64; i++)
		q[i] = (float)(i % 13) / 6.0f - 1.0f;
	const struct kvr_kv_segment seg = { keys, vals, T, { ROW }, 64, 0 };
	const struct kvr_attention_item att = { q, out, NULL, 0, 1 };
	for (int round = 0; round < 50; round++) {
		memset(out, 0, 4 * 64 * sizeof(float));
		if (kvr_dev_attention(w->dev, &shape, &att, 1, &seg, 1, s) || kvr_dev_stream_synchronize(w->dev, s)) {
			w->failures++;
			continue;
		}
		for (int i = 0; i < 4 * 64; i++)
			if (!(out[i] > 2.9999f && out[i] < 3.0001f)) {
				w->failures++;
				break;
			}
	}
	kvr_dev_stream_destroy(w->dev, s);
	free(rows);
	free(summary);
	free(keys), free(vals), free(q), free(out);
	return NULL;
}

int main(void)
{
	struct kvr_dev_params params = { .kind = KVR_DEV_CPU, .threads = 2 };
	struct kvr_dev *dev;
	char err[256];
	if (kvr_dev_create(&params, &dev, err, sizeof(err))) {
		fprintf(stderr, "stress_streams: %s\n", err);
		return 1;
	}
	int failed = 0;

	/* 1. producer/consumer hand-off through events */
	struct handoff *h = calloc(1, sizeof(*h));
	h->dev = dev;
	h->src = malloc((size_t)BLOCKS * BLOCK_BYTES);
	h->dst = calloc(BLOCKS, BLOCK_BYTES);
	int setup = kvr_dev_stream_create(dev, KVR_STREAM_WORKER, &h->copy_stream);
	for (int i = 0; i < BLOCKS && !setup; i++)
		setup = kvr_dev_event_create(dev, &h->ready[i]);
	if (setup) {
		fprintf(stderr, "stress_streams: setup: %s\n", kvr_dev_last_error(dev));
		return 1;
	}
	pthread_t p, c;
	pthread_create(&p, NULL, producer, h);
	pthread_create(&c, NULL, consumer, h);
	pthread_join(p, NULL);
	pthread_join(c, NULL);
	kvr_dev_stream_synchronize(dev, h->copy_stream);
	if (h->failures) {
		fprintf(stderr, "stress_streams: hand-off: %d failures\n", h->failures);
		failed++;
	}
	for (int i = 0; i < BLOCKS; i++)
		kvr_dev_event_destroy(dev, h->ready[i]);
	kvr_dev_stream_destroy(dev, h->copy_stream);
	free(h->src), free(h->dst), free(h);

	/* 2. parallel_for from two threads while kernels run on a worker stream */
	struct pf_worker w[3] = { { dev, 0 }, { dev, 0 }, { dev, 0 } };
	pthread_t t[3];
	pthread_create(&t[0], NULL, parallel_user, &w[0]);
	pthread_create(&t[1], NULL, parallel_user, &w[1]);
	pthread_create(&t[2], NULL, kernel_user, &w[2]);
	for (int i = 0; i < 3; i++)
		pthread_join(t[i], NULL);
	if (w[0].failures + w[1].failures + w[2].failures) {
		fprintf(stderr, "stress_streams: parallel_for/kernels: %d/%d/%d failures\n", w[0].failures,
			w[1].failures, w[2].failures);
		failed++;
	}
	kvr_dev_destroy(dev);
	printf("%d passed, %d failed\n", 2 - failed, failed);
	return failed ? 1 : 0;
}
