/* SPDX-License-Identifier: MIT */
/*
 * test_faults.c — the fault-injection sweep (layouts/base/fault.h). A decode workload
 * (context creation, three sequences, chunked prefill, decode steps, a fork,
 * a truncate, a free) runs once clean, counting each class's operations (host
 * allocations, device allocations, copies, stream/event creations, thread
 * starts, spill I/Os); then, for every class and every n up to that count,
 * it runs again with the n-th operation of that class failing. Each variant
 * of the context (mode, recall kind, spill tier, backend) is one test.
 *
 * What a failing run must show:
 *  - the call that made the failing operation returns a negative errno and
 *    kvr_last_error() gives a non-empty message (kvr_context_create: the
 *    thread's; others: the context's); a per-sequence failure of
 *    kvr_decode_layer has a negative status for that sequence and the
 *    message of the layer it happened at; a failure on the controller thread
 *    shows in kvr_async_error() with a message;
 *  - the context stays usable: the test retries the call that failed (the
 *    hook fails one operation), and a failed decode step is decoded again for
 *    the sequences it failed, in a batch of their own, after kvr_decode_end
 *    took it back (each of their layers holds its step's position again);
 *  - outputs: every (step, sequence, layer) output equals the clean run's
 *    bit for bit, except those "affected" by the failure:
 *      * freekv: a re-decoded step of a failed sequence, in every layer (the
 *        step end forgets the sequence's speculative state, so the redo
 *        selects afresh with its own query, as a correction);
 *      * freekv: the output of the (sequence, layer) named by an
 *        asynchronous error, at the step it was seen and the next (the
 *        failed job's lane selects afresh at its next step);
 *    the steps after those must match again, and so must every output in
 *    blocking mode (which selects with the step's own query every step);
 *  - nothing crashes, hangs or leaks (the suite also runs under ASan).
 *
 * Counts are process-wide and include the controller's and the streams'
 * operations, whose order between threads may change from run to run: a
 * run whose armed operation never came (kvr_fault_fired() == 0) must equal
 * the clean run exactly.
 *
 * Run alone: meson test -C build faults (it is -j1: the counters are
 * process-wide, and one test at a time keeps them to one workload).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../layouts/base/fault.h"
#include "../scheduler/scheduler.h"
#include "backend.h"
#include "internal.h"
#include "kvrecall.h"
#define TH_SMALL_SHAPE
#include "helpers.h"

#define NL 2
#define NSEQ 3   /* logical sequences: A, B, and C forked from A */
#define NSTEP 7  /* decode steps of the script */
#define CHUNK 100 /* prefill chunk, tokens */

struct variant {
	const char *name;
	uint32_t dev_kind;
	uint32_t mode, recall;
	uint32_t spill; /* 1: pool RAM far below the KV (spill tier) */
};

/* One run of the script. */
struct run {
	const struct variant *v;
	struct kvr_context *ctx;
	uint32_t id[NSEQ];
	int alive[NSEQ];
	uint64_t len[NSEQ]; /* tokens in every layer */
	float out[NSTEP][NSEQ][NL][Q_ROW];
	uint8_t have[NSTEP][NSEQ];
	uint8_t may_differ[NSTEP][NSEQ][NL];
	uint32_t failures;     /* calls that reported a failure */
	uint32_t async_errors; /* asynchronous errors seen */
	char first_failure[300];
	char label[128]; /* the variant, and the operation made to fail */
};

/* ------------------------------------------------------------------ data */

/* Token `pos` of logical sequence s in layer l. C continues A's history, so
 * its tokens past the fork point differ by seed. */
static void token_kv(uint32_t s, uint32_t l, uint64_t pos, float *k, float *v)
{
	for (uint32_t c = 0; c < KV_ROW; c++) {
		k[c] = th_grid_value(100 + s, 2 * l, pos * KV_ROW + c);
		v[c] = th_grid_value(100 + s, 2 * l + 1, pos * KV_ROW + c);
	}
}

/* The query: a per-(sequence, layer) direction plus noise, large every third
 * position (corrections in freekv) and small otherwise (speculation). */
static void token_q(uint32_t s, uint32_t l, uint64_t pos, float *q)
{
	const float eps = pos % 3 == 0 ? 1.0f : 0.125f;
	for (uint32_t c = 0; c < Q_ROW; c++)
		q[c] = 2.0f * th_grid_value(7 + s, l, c) + eps * th_grid_value(9 + s, l, pos * Q_ROW + c);
}

/* ------------------------------------------------------------------ checks */

static void note(struct run *r, const char *what, int rc, const char *msg)
{
	if (!r->first_failure[0])
		snprintf(r->first_failure, sizeof(r->first_failure), "%s: %d: %s", what, rc, msg);
}

/* A call's result: 0, or a failure with a negative errno and a message. */
static int failed(struct run *r, int rc, const char *what)
{
	if (!rc)
		return 0;
	const char *msg = kvr_last_error(r->ctx);
	cr_assert_lt(rc, 0, "%s: %s returned %d", r->label, what, rc);
	cr_assert(msg && msg[0], "%s: %s failed (%d) without a message", r->label, what, rc);
	note(r, what, rc, msg);
	r->failures++;
	return 1;
}

static void check_lengths(struct run *r, uint32_t s, const char *when)
{
	for (uint32_t l = 0; l < NL; l++) {
		uint64_t n = 0;
		cr_assert_eq(kvr_seq_length(r->ctx, r->id[s], l, &n), 0);
		cr_assert_eq(n, r->len[s], "%s: %s: sequence %u layer %u holds %llu tokens, not %llu",
			     r->label, when, s, l, (unsigned long long)n, (unsigned long long)r->len[s]);
	}
}

/* An asynchronous error since the last poll: with a message; in freekv its
 * (sequence, layer) may differ at this step and the next. */
static void poll_async(struct run *r, uint32_t step)
{
	const char *msg = NULL;
	const int e = kvr_async_error(r->ctx, &msg);
	if (!e)
		return;
	cr_assert_lt(e, 0, "%s: async error %d", r->label, e);
	cr_assert(msg && msg[0], "%s: async error %d without a message", r->label, e);
	note(r, "async", e, msg);
	r->async_errors++;
	unsigned seq = 0, layer = 0;
	const char *at = strstr(msg, "sequence ");
	cr_assert(at && sscanf(at, "sequence %u layer %u", &seq, &layer) == 2,
		  "%s: async error names no sequence and layer: %s", r->label, msg);
	for (uint32_t s = 0; s < NSEQ; s++)
		if (r->alive[s] && r->id[s] == seq && layer < NL)
			for (uint32_t t = step; t < NSTEP && t <= step + 1; t++)
				r->may_differ[t][s][layer] |= r->v->mode == KVR_MODE_FREEKV;
}

/* ------------------------------------------------------------------ the script */

static void context_open(struct run *r)
{
	struct kvr_config c;
	th_config(&c, NL, N_QO, N_KV, D, KVR_DTYPE_F32, P, 32, 32, 128); /* k = 4 pages per KV head */
	c.mode = r->v->mode;
	c.recall = r->v->recall;
	th_config_sparse(&c, 4);
	c.recall_chunk_pages = 2; /* several chunks per recall */
	c.controller = KVR_CONTROLLER_THREAD;
	const uint64_t page = 2ull * P * N_KV * D * 4;
	c.pool_bytes = 256 * page;
	if (r->v->spill)
		c.pool_ram_bytes = 16 * page;
	for (int tries = 0;; tries++) {
		r->ctx = NULL;
		const int rc = kvr_context_create_internal(&c, r->v->dev_kind, NULL, &r->ctx);
		if (!rc)
			break;
		const char *msg = kvr_last_error(NULL);
		cr_assert_lt(rc, 0, "%s: context_create returned %d", r->label, rc);
		cr_assert(msg && msg[0], "%s: context_create failed (%d) without a message", r->label, rc);
		cr_assert_null(r->ctx, "%s: a failed context_create set *out", r->label);
		note(r, "context_create", rc, msg);
		r->failures++;
		cr_assert_lt(tries, 2, "%s: context_create keeps failing: %s", r->label, msg);
	}
}

static void seq_create(struct run *r, uint32_t s)
{
	for (int tries = 0; failed(r, kvr_seq_create(r->ctx, &r->id[s]), "seq_create"); tries++)
		cr_assert_lt(tries, 2, "%s: seq_create keeps failing", r->label);
	r->alive[s] = 1;
	r->len[s] = 0;
}

static void prefill(struct run *r, uint32_t s, uint64_t n)
{
	float *k = malloc(CHUNK * KV_ROW * sizeof(float)), *v = malloc(CHUNK * KV_ROW * sizeof(float));
	cr_assert(k && v);
	for (uint64_t first = r->len[s]; first < n; first += CHUNK) {
		const uint32_t m = (uint32_t)(n - first < CHUNK ? n - first : CHUNK);
		for (uint32_t l = 0; l < NL; l++) {
			for (uint32_t i = 0; i < m; i++)
				token_kv(s, l, first + i, k + i * KV_ROW, v + i * KV_ROW);
			for (int tries = 0;
			     failed(r, kvr_prefill(r->ctx, r->id[s], l, first, m, k, v), "prefill"); tries++) {
				/* all or nothing: the layer holds what it held */
				uint64_t have = 0;
				cr_assert_eq(kvr_seq_length(r->ctx, r->id[s], l, &have), 0);
				cr_assert_eq(have, first, "%s: a failed prefill left layer %u at %llu tokens, not %llu",
					     r->label, l, (unsigned long long)have, (unsigned long long)first);
				cr_assert_lt(tries, 2, "%s: prefill keeps failing", r->label);
			}
		}
	}
	r->len[s] = n;
	free(k), free(v);
}

/* Decode step `t` for the logical sequences in `set` (redo: the re-decode of
 * a failed step). Sequences whose step failed are decoded again, alone. */
static void decode_step(struct run *r, uint32_t t, const uint32_t *set, uint32_t n, int redo)
{
	uint32_t ids[NSEQ];
	uint64_t pos[NSEQ];
	for (uint32_t i = 0; i < n; i++)
		ids[i] = r->id[set[i]], pos[i] = r->len[set[i]];
	for (int tries = 0; failed(r, kvr_decode_begin(r->ctx, ids, pos, n), "decode_begin"); tries++)
		cr_assert_lt(tries, 2, "%s: decode_begin keeps failing", r->label);
	int step_failed[NSEQ] = { 0 };
	static float q[NSEQ][Q_ROW], k[NSEQ][KV_ROW], v[NSEQ][KV_ROW], out[NSEQ][Q_ROW];
	for (uint32_t l = 0; l < NL; l++) {
		for (uint32_t i = 0; i < n; i++) {
			token_q(set[i], l, pos[i], q[i]);
			token_kv(set[i], l, pos[i], k[i], v[i]);
		}
		int32_t status[NSEQ];
		for (uint32_t i = 0; i < NSEQ; i++)
			status[i] = 99;
		const int rc = kvr_decode_layer(r->ctx, l, q, k, v, out, status, NULL);
		if (failed(r, rc, "decode_layer")) {
			/* a whole-call failure fails every sequence's step */
			for (uint32_t i = 0; i < n; i++) {
				cr_assert_eq(status[i], rc, "%s: decode_layer %d, status[%u] %d", r->label,
					     rc, i, status[i]);
				step_failed[i] = 1;
			}
			continue;
		}
		for (uint32_t i = 0; i < n; i++) {
			cr_assert_neq(status[i], 99, "%s: status[%u] not written", r->label, i);
			if (status[i]) {
				cr_assert_lt(status[i], 0, "%s: status %d", r->label, status[i]);
				if (!step_failed[i]) { /* the layer it failed at says why */
					const char *msg = kvr_last_error(r->ctx);
					cr_assert(msg && msg[0], "%s: sequence failed (%d) without a message",
						  r->label, status[i]);
					note(r, "decode_layer status", status[i], msg);
					r->failures++;
				}
				step_failed[i] = 1;
				continue;
			}
			cr_assert(!step_failed[i], "%s: a failed sequence's later layer succeeded",
				  r->label);
			memcpy(r->out[t][set[i]][l], out[i], sizeof(out[i]));
		}
	}
	const int end = kvr_decode_end(r->ctx);
	failed(r, end, "decode_end");
	cr_assert_eq(end, 0, "%s: decode_end failed: %s", r->label, kvr_last_error(r->ctx));
	uint32_t again[NSEQ], n_again = 0;
	for (uint32_t i = 0; i < n; i++) {
		const uint32_t s = set[i];
		if (step_failed[i]) {
			check_lengths(r, s, "after a failed step"); /* taken back */
			again[n_again++] = s;
			continue;
		}
		r->len[s]++;
		r->have[t][s] = 1;
		check_lengths(r, s, "after a step");
		if (redo && r->v->mode == KVR_MODE_FREEKV)
			for (uint32_t l = 0; l < NL; l++)
				r->may_differ[t][s][l] = 1;
	}
	poll_async(r, t);
	if (n_again) {
		cr_assert(!redo || n_again < n, "%s: the re-decode of step %u failed again", r->label, t);
		decode_step(r, t, again, n_again, 1);
	}
}

static void script(struct run *r)
{
	enum { A = 0, B = 1, C = 2 };
	context_open(r);
	seq_create(r, A);
	seq_create(r, B);
	prefill(r, A, 256);
	prefill(r, B, 190);
	const uint32_t ab[] = { A, B }, abc[] = { A, B, C };
	uint32_t t = 0;
	decode_step(r, t++, ab, 2, 0);
	decode_step(r, t++, ab, 2, 0);
	/* fork A into C: full pages shared, the tail copied */
	for (int tries = 0; failed(r, kvr_seq_fork(r->ctx, r->id[A], &r->id[C]), "seq_fork"); tries++) {
		check_lengths(r, A, "after a failed fork");
		cr_assert_lt(tries, 2, "%s: seq_fork keeps failing", r->label);
	}
	r->alive[C] = 1;
	r->len[C] = r->len[A];
	decode_step(r, t++, abc, 3, 0);
	decode_step(r, t++, abc, 3, 0);
	/* B drops its last 40 tokens (some full pages), then grows again */
	for (int tries = 0; failed(r, kvr_seq_truncate(r->ctx, r->id[B], r->len[B] - 40), "seq_truncate");
	     tries++) {
		check_lengths(r, B, "after a failed truncate");
		cr_assert_lt(tries, 2, "%s: seq_truncate keeps failing", r->label);
	}
	r->len[B] -= 40;
	decode_step(r, t++, abc, 3, 0);
	decode_step(r, t++, abc, 3, 0);
	cr_assert_eq(kvr_seq_free(r->ctx, r->id[C]), 0, "%s: %s", r->label, kvr_last_error(r->ctx));
	r->alive[C] = 0;
	decode_step(r, t++, ab, 2, 0);
	cr_assert_eq(t, NSTEP);
	poll_async(r, NSTEP - 1);
	kvr_context_destroy(r->ctx);
	r->ctx = NULL;
}

/* ------------------------------------------------------------------ the sweep */

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Compare a faulty run with the clean one. */
static void compare(const struct run *clean, const struct run *r, const char *label)
{
	for (uint32_t t = 0; t < NSTEP; t++)
		for (uint32_t s = 0; s < NSEQ; s++) {
			cr_assert_eq(r->have[t][s], clean->have[t][s], "%s: step %u sequence %u %s", label, t,
				     s, r->have[t][s] ? "decoded, not in the clean run" : "never decoded");
			if (!clean->have[t][s])
				continue;
			for (uint32_t l = 0; l < NL; l++) {
				if (r->may_differ[t][s][l])
					continue;
				if (memcmp(r->out[t][s][l], clean->out[t][s][l], sizeof(r->out[t][s][l]))) {
					uint32_t c = 0;
					while (r->out[t][s][l][c] == clean->out[t][s][l][c])
						c++;
					cr_assert_fail("%s: step %u sequence %u layer %u differs from the clean "
						       "run (element %u: %.9g, clean %.9g); first failure: %s",
						       label, t, s, l, c, (double)r->out[t][s][l][c],
						       (double)clean->out[t][s][l][c], r->first_failure);
				}
			}
		}
}

/* Runs per class at most: a class with more operations is swept with a
 * stride, every `stride`-th n (always including 1 and the last). */
#define MAX_RUNS_PER_CLASS 400

static void sweep(const struct variant *v)
{
	static struct run clean, r;
	memset(&clean, 0, sizeof(clean));
	clean.v = v;
	snprintf(clean.label, sizeof(clean.label), "%s, clean run", v->name);
	kvr_fault_arm(KVR_FAULT_HOST_ALLOC, 0); /* count only */
	script(&clean);
	kvr_fault_reset();
	cr_assert_eq(clean.failures, 0, "%s: the clean run failed: %s", v->name, clean.first_failure);
	cr_assert_eq(clean.async_errors, 0, "%s: the clean run had an asynchronous error: %s", v->name,
		     clean.first_failure);
	uint64_t counts[KVR_FAULT_CLASSES];
	for (int c = 0; c < KVR_FAULT_CLASSES; c++)
		counts[c] = kvr_fault_count((enum kvr_fault_class)c);
	for (int c = 0; c < KVR_FAULT_CLASSES; c++) {
		const double t0 = now_s();
		const uint64_t total = counts[c];
		const uint64_t stride = total > MAX_RUNS_PER_CLASS ? (total + MAX_RUNS_PER_CLASS - 1) / MAX_RUNS_PER_CLASS : 1;
		uint64_t runs = 0, fired = 0, fails = 0;
		for (uint64_t n = 1; n <= total; n += (n + stride > total && n < total) ? total - n : stride) {
			memset(&r, 0, sizeof(r));
			r.v = v;
			snprintf(r.label, sizeof(r.label), "%s, %s #%llu of %llu", v->name,
				 kvr_fault_class_name((enum kvr_fault_class)c), (unsigned long long)n,
				 (unsigned long long)total);
			const char *label = r.label;
			kvr_fault_arm((enum kvr_fault_class)c, n);
			script(&r);
			const uint64_t hit = kvr_fault_fired();
			kvr_fault_reset();
			if (!hit)
				cr_assert_eq(r.failures + r.async_errors, 0, "%s: nothing injected, yet %s", label,
					     r.first_failure);
			compare(&clean, &r, label);
			runs++;
			fired += hit;
			fails += r.failures + r.async_errors ? 1 : 0;
		}
		cr_log_info("%s: %-12s %5llu operations, %4llu runs (stride %llu), %4llu injected, %4llu "
			    "reported, %.1f s",
			    v->name, kvr_fault_class_name((enum kvr_fault_class)c), (unsigned long long)total,
			    (unsigned long long)runs, (unsigned long long)stride, (unsigned long long)fired,
			    (unsigned long long)fails, now_s() - t0);
	}
}

TestSuite(faults, .timeout = 1200);

/* One test per variant: the sweep over every fault class. */
#define FAULT_SWEEP(test, label, dev_kind, mode, recall, spill)                                 \
	Test(faults, test)                                                                      \
	{                                                                                       \
		static const struct variant v = { label, dev_kind, mode, recall, spill };       \
		sweep(&v);                                                                      \
	}
FAULT_SWEEP(cpu_freekv_zero_copy, "cpu freekv zero-copy", KVR_DEV_CPU, KVR_MODE_FREEKV,
	    KVR_RECALL_ZERO_COPY, 0)
FAULT_SWEEP(cpu_freekv_streamed, "cpu freekv streamed", KVR_DEV_CPU, KVR_MODE_FREEKV,
	    KVR_RECALL_STREAMED, 0)
FAULT_SWEEP(cpu_blocking_streamed, "cpu blocking streamed", KVR_DEV_CPU, KVR_MODE_BLOCKING,
	    KVR_RECALL_STREAMED, 0)
FAULT_SWEEP(cpu_blocking_zero_copy, "cpu blocking zero-copy", KVR_DEV_CPU, KVR_MODE_BLOCKING,
	    KVR_RECALL_ZERO_COPY, 0)
FAULT_SWEEP(cpu_freekv_spill, "cpu freekv streamed spill", KVR_DEV_CPU, KVR_MODE_FREEKV,
	    KVR_RECALL_STREAMED, 1)

