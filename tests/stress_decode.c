/* SPDX-License-Identifier: MIT */
/*
 * stress_decode.c — the decode step under random use, as a plain program so it
 * also runs under ThreadSanitizer (Criterion's forking runner cannot host
 * TSan): each round creates a context with a random mode (speculative,
 * freekv, blocking), recall kind (zero-copy, streamed), dtype, pool layout,
 * staging buffers and chunk size, the spill tier (a RAM budget below what the
 * sequences hold), and test hooks (asynchronous compute, small
 * random delays in the controller and on the streams), the cpu backend on
 * its own workers or on a public kvr_thread_pool shared by every round's
 * context (kvr_config.parallel_for: the engine's and the controller's
 * threads then call into one pool at once), or (third argument "strict")
 * cudaemu-strict, a device with memory of its own and an HND pool, so the
 * device path runs: the controller's selections and prefetches issued
 * without waiting, the engine's plan waiting for them on the device, q, k,
 * v and out in device memory. Then it decodes random
 * batches of sequences of random lengths —
 * some at most B tokens (dense path), some beyond — while sequences are
 * forked, truncated, freed and created between steps. Every status must be
 * 0, every output finite, and no asynchronous error may be left.
 *
 * Usage: stress_decode [seed] [rounds] [strict]. Exit 0 on success; prints
 * "N passed, N failed".
 */
#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../scheduler/scheduler.h"
#include "backend.h"
#include "cudaemu.h"
#include "half.h"
#include "internal.h"
#include "kvrecall.h"
#define TH_SMALL_SHAPE
#include "helpers.h"

#define NL 2
#define MAX_SEQS 6
#define MAX_BATCH 4
#define STEPS 36
#define MAX_PREFILL 420

static int passed, failed;

#define CHECK(cond, ...)                                                            \
	do {                                                                        \
		if (cond) {                                                         \
			passed++;                                                   \
		} else {                                                            \
			failed++;                                                   \
			if (failed <= 20) {                                         \
				fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
				fprintf(stderr, __VA_ARGS__);                       \
				fprintf(stderr, "\n");                              \
			}                                                           \
		}                                                                   \
	} while (0)

static uint64_t rng_state;
static uint32_t urand(uint32_t n) /* [0, n) */
{
	return (uint32_t)(th_mix64(rng_state++) % n);
}
static float frand(void) /* [-1, 1] */
{
	return (float)((int)urand(2001) - 1000) / 1000.0f;
}

/* Small random delays from every hook site (thread-safe, seeded). */
static _Atomic uint64_t delay_counter;
static void delay(void *user, uint32_t where)
{
	(void)user;
	(void)where;
	usleep((useconds_t)(th_mix64(atomic_fetch_add(&delay_counter, 1) ^ 0xd1ce) % 60));
}

static void fill(void *dst, size_t n, uint32_t dtype, float scale)
{
	for (size_t i = 0; i < n; i++)
		kvr_store_f32(dst, dtype, i, scale * frand());
}

struct sseq {
	int alive;
	uint32_t id;
	uint64_t n;
};

static void prefill(struct kvr_context *ctx, struct sseq *s, uint32_t dtype, uint64_t n)
{
	static unsigned char k[MAX_PREFILL * KV_ROW * 4], v[MAX_PREFILL * KV_ROW * 4];
	for (uint32_t l = 0; l < NL; l++) {
		fill(k, n * KV_ROW, dtype, 1.0f);
		fill(v, n * KV_ROW, dtype, 1.0f);
		const int r = kvr_prefill(ctx, s->id, l, 0, (uint32_t)n, k, v);
		CHECK(r == 0, "prefill %llu tokens: %d %s", (unsigned long long)n, r, kvr_last_error(ctx));
	}
	s->n = n;
}

static int create(struct kvr_context *ctx, struct sseq *seqs, uint32_t dtype)
{
	for (int i = 0; i < MAX_SEQS; i++)
		if (!seqs[i].alive) {
			const int r = kvr_seq_create(ctx, &seqs[i].id);
			CHECK(r == 0, "seq_create: %d %s", r, kvr_last_error(ctx));
			if (r)
				return -1;
			seqs[i].alive = 1;
			/* some at most B (dense path), some beyond; some cross B during the run */
			prefill(ctx, &seqs[i], dtype, 1 + urand(MAX_PREFILL - 1));
			return i;
		}
	return -1;
}

/* The engine's pool the rounds may hand to their contexts (main creates it). */
static struct kvr_thread_pool *shared_pool;

/* KVR_DEV_CPU, or KVR_DEV_CUDAEMU_STRICT for every round (main's third argument) */
static uint32_t dev_kind = KVR_DEV_CPU;

static void run_round(uint32_t round)
{
	static const uint32_t modes[] = { KVR_MODE_SPECULATIVE, KVR_MODE_FREEKV, KVR_MODE_BLOCKING };
	const uint32_t mode = modes[round % 3];
	/* strict runs few rounds: streamed from the second on */
	const uint32_t recall = (dev_kind == KVR_DEV_CPU ? (round / 3) % 2 : round % 2) ? KVR_RECALL_STREAMED
										     : KVR_RECALL_ZERO_COPY;
	const uint32_t dtype = urand(2) ? KVR_DTYPE_F16 : KVR_DTYPE_F32;
	const uint32_t eb = dtype == KVR_DTYPE_F32 ? 4 : 2;

	struct kvr_config c;
	th_config(&c, NL, N_QO, N_KV, D, dtype, P, 32, 32, 128);
	c.mode = mode;
	c.recall = recall;
	c.tau = 0.9f;
	c.dense_layers[0] = urand(2); /* layer 0 dense or sparse */
	c.max_sequences = MAX_SEQS;
	c.max_batch = MAX_BATCH;
	c.threads = 1;
	c.recall_chunk_pages = 1 + urand(4);
	c.recall_buffers = 1 + urand(2);
	c.pool_layout = urand(4) ? KVR_POOL_HND : KVR_POOL_NHD; /* NHD: the ablation's row copies */
	if (dev_kind != KVR_DEV_CPU) /* the device path: an HND pool */
		c.pool_layout = KVR_POOL_HND;
	/* quantised pages (HND only): direct copies into slots, mixed's demotion */
	if (c.pool_layout == KVR_POOL_HND)
		c.kv_format = urand(4); /* plain, k8v4, k4v2, mixed */
	/* strict: the controller's device path (speculative, freekv) on plain
	 * pages, where streamed recall is its prefetch */
	const int device_controller = dev_kind != KVR_DEV_CPU && mode != KVR_MODE_BLOCKING;
	if (device_controller)
		c.kv_format = 0;
	c.pool_bytes = 4096ull * 2 * P * KV_ROW * eb;
	/* the spill tier (streamed recall, HND): RAM for 96 plain pages of the
	 * ~360 the sequences hold, so recall reads the file while the engine
	 * evicts; layer 0 sparse, since a dense layer reads every page in place */
	const int spill = recall == KVR_RECALL_STREAMED && c.pool_layout == KVR_POOL_HND && !device_controller &&
			  urand(2);
	if (spill) {
		c.pool_ram_bytes = 96ull * 2 * P * KV_ROW * eb;
		c.dense_layers[0] = 0;
	}
	const int shared = urand(2);
	if (shared) {
		c.parallel_for = kvr_thread_pool_parallel_for;
		c.parallel_user = shared_pool;
		c.threads = kvr_thread_pool_threads(shared_pool);
	}
	const struct kvr_sched_hooks hooks = { urand(2) ? delay : NULL, NULL, urand(2), 0 };
	/* the estimate of the pages not retrieved (not with mixed pages), drawn
	 * last so the rounds' other draws stay what they were */
	c.estimate = urand(2) && c.kv_format != KVR_KV_FORMAT_MIXED;
	struct kvr_context *ctx = NULL;
	int r = kvr_context_create_internal(&c, dev_kind == KVR_DEV_CPU ? 0 : dev_kind, &hooks, &ctx);
	CHECK(r == 0, "context: %d %s", r, kvr_last_error(NULL));
	if (r)
		return;
	/* a device with memory of its own: the decode calls' buffers there */
	const int staged = !kvr_dev_host_visible(ctx->dev);
	struct kvr_stream *stage = NULL;
	void *dq[NL] = { 0 }, *dk[NL] = { 0 }, *dv[NL] = { 0 }, *dout[NL] = { 0 };
	if (staged) {
		r = kvr_dev_stream_create(ctx->dev, 0, &stage);
		for (uint32_t l = 0; !r && l < NL; l++)
			if ((r = kvr_dev_alloc(ctx->dev, MAX_BATCH * Q_ROW * 4, &dq[l])) ||
			    (r = kvr_dev_alloc(ctx->dev, MAX_BATCH * KV_ROW * 4, &dk[l])) ||
			    (r = kvr_dev_alloc(ctx->dev, MAX_BATCH * KV_ROW * 4, &dv[l])))
				break;
			else
				r = kvr_dev_alloc(ctx->dev, MAX_BATCH * Q_ROW * 4, &dout[l]);
		CHECK(r == 0, "device buffers: %d %s", r, kvr_dev_last_error(ctx->dev));
		if (r) {
			kvr_context_destroy(ctx);
			return;
		}
	}
	printf("round %u: %s, %s, %s, %s, %s pool, %s pages, dense layer 0 %d, chunk %u, buffers %u, async %u, "
	       "delays %d, spill %d, shared pool %d, estimate %u\n",
	       round, staged ? "cudaemu-strict" : "cpu", kvr_mode_name(mode), kvr_recall_name(recall),
	       kvr_dtype_name(dtype),
	       c.pool_layout == KVR_POOL_NHD ? "NHD" : "HND", kvr_kv_format_name(c.kv_format), (int)c.dense_layers[0],
	       c.recall_chunk_pages, c.recall_buffers, hooks.async_compute, hooks.delay != NULL, spill, shared,
	       c.estimate);

	struct sseq seqs[MAX_SEQS];
	memset(seqs, 0, sizeof(seqs));
	for (int i = 0; i < 3; i++)
		create(ctx, seqs, dtype);
	/* per layer: with asynchronous compute a layer's buffers stay in use
	 * until kvr_decode_end */
	static unsigned char qs[NL][MAX_BATCH * Q_ROW * 4], ks[NL][MAX_BATCH * KV_ROW * 4],
		vs[NL][MAX_BATCH * KV_ROW * 4], outs[NL][MAX_BATCH * Q_ROW * 4];
	uint64_t decoded = 0;
	for (uint32_t step = 0; step < STEPS; step++) {
		int alive[MAX_SEQS], n_alive = 0;
		for (int i = 0; i < MAX_SEQS; i++)
			if (seqs[i].alive)
				alive[n_alive++] = i;
		/* one random event between steps */
		const uint32_t ev = urand(100);
		if (ev < 12 && n_alive) { /* fork */
			int dst = -1;
			for (int i = 0; i < MAX_SEQS && dst < 0; i++)
				if (!seqs[i].alive)
					dst = i;
			const int src = alive[urand((uint32_t)n_alive)];
			if (dst >= 0 && seqs[src].n < 1000) {
				r = kvr_seq_fork(ctx, seqs[src].id, &seqs[dst].id);
				CHECK(r == 0, "fork: %d %s", r, kvr_last_error(ctx));
				if (!r) {
					seqs[dst].alive = 1;
					seqs[dst].n = seqs[src].n;
				}
			}
		} else if (ev < 22 && n_alive) { /* truncate */
			struct sseq *s = &seqs[alive[urand((uint32_t)n_alive)]];
			const uint64_t keep = s->n / 2 + urand((uint32_t)(s->n - s->n / 2 + 1));
			r = kvr_seq_truncate(ctx, s->id, keep);
			CHECK(r == 0, "truncate %llu -> %llu: %d %s", (unsigned long long)s->n,
			      (unsigned long long)keep, r, kvr_last_error(ctx));
			if (!r)
				s->n = keep;
		} else if (ev < 28 && n_alive > 1) { /* free */
			struct sseq *s = &seqs[alive[urand((uint32_t)n_alive)]];
			r = kvr_seq_free(ctx, s->id);
			CHECK(r == 0, "free: %d %s", r, kvr_last_error(ctx));
			s->alive = 0;
		} else if (ev < 36) { /* create */
			create(ctx, seqs, dtype);
		}
		/* a random batch of the living, in random order */
		n_alive = 0;
		for (int i = 0; i < MAX_SEQS; i++)
			if (seqs[i].alive)
				alive[n_alive++] = i;
		if (!n_alive)
			continue;
		for (int i = n_alive - 1; i > 0; i--) {
			const int j = (int)urand((uint32_t)i + 1), t = alive[i];
			alive[i] = alive[j];
			alive[j] = t;
		}
		const uint32_t batch = 1 + urand((uint32_t)(n_alive < MAX_BATCH ? n_alive : MAX_BATCH));
		uint32_t ids[MAX_BATCH];
		uint64_t pos[MAX_BATCH];
		for (uint32_t i = 0; i < batch; i++) {
			ids[i] = seqs[alive[i]].id;
			pos[i] = seqs[alive[i]].n;
		}
		r = kvr_decode_begin(ctx, ids, pos, batch);
		CHECK(r == 0, "decode_begin: %d %s", r, kvr_last_error(ctx));
		if (r)
			continue;
		int ok = 1;
		for (uint32_t l = 0; l < NL; l++) {
			unsigned char *q = qs[l], *k = ks[l], *v = vs[l], *out = outs[l];
			fill(q, (size_t)batch * Q_ROW, dtype, 3.0f);
			fill(k, (size_t)batch * KV_ROW, dtype, 1.0f);
			fill(v, (size_t)batch * KV_ROW, dtype, 1.0f);
			int32_t status[MAX_BATCH];
			if (staged) { /* the inputs to the device; outputs read after decode_end */
				r = kvr_dev_memcpy_async(ctx->dev, dq[l], q, (size_t)batch * Q_ROW * eb, KVR_COPY_H2D, stage);
				if (!r)
					r = kvr_dev_memcpy_async(ctx->dev, dk[l], k, (size_t)batch * KV_ROW * eb,
								 KVR_COPY_H2D, stage);
				if (!r)
					r = kvr_dev_memcpy_async(ctx->dev, dv[l], v, (size_t)batch * KV_ROW * eb,
								 KVR_COPY_H2D, stage);
				if (!r)
					r = kvr_dev_stream_synchronize(ctx->dev, stage);
				CHECK(r == 0, "staging the inputs: %d %s", r, kvr_dev_last_error(ctx->dev));
				q = dq[l], k = dk[l], v = dv[l], out = dout[l];
			}
			r = kvr_decode_layer(ctx, l, q, k, v, out, status, NULL);
			CHECK(r == 0, "decode_layer: %d %s", r, kvr_last_error(ctx));
			for (uint32_t i = 0; !r && i < batch; i++) {
				CHECK(status[i] == 0, "step %u layer %u sequence %u (%llu tokens): status %d %s",
				      step, l, ids[i], (unsigned long long)pos[i], status[i],
				      kvr_last_error(ctx));
				ok &= status[i] == 0;
			}
			if (hooks.async_compute || staged)
				continue; /* outputs complete at decode_end (or on the device): checked below */
			for (uint32_t i = 0; i < batch * Q_ROW; i++)
				if (!isfinite(kvr_load_f32(out, dtype, i))) {
					CHECK(0, "step %u layer %u: output %u not finite", step, l, i);
					break;
				}
		}
		r = kvr_decode_end(ctx);
		CHECK(r == 0, "decode_end: %d %s", r, kvr_last_error(ctx));
		for (uint32_t l = 0; staged && l < NL; l++) {
			r = kvr_dev_memcpy_async(ctx->dev, outs[l], dout[l], (size_t)batch * Q_ROW * eb, KVR_COPY_D2H,
						 stage);
			if (!r)
				r = kvr_dev_stream_synchronize(ctx->dev, stage);
			CHECK(r == 0, "reading the outputs: %d %s", r, kvr_dev_last_error(ctx->dev));
		}
		for (uint32_t l = 0; (hooks.async_compute || staged) && l < NL; l++)
			for (uint32_t i = 0; i < batch * Q_ROW; i++)
				if (!isfinite(kvr_load_f32(outs[l], dtype, i))) {
					CHECK(0, "step %u layer %u: output %u not finite", step, l, i);
					break;
				}
		if (ok)
			for (uint32_t i = 0; i < batch; i++)
				seqs[alive[i]].n++;
		decoded += batch;
	}
	for (int i = 0; i < MAX_SEQS; i++)
		if (seqs[i].alive) {
			kvr_sched_seq_quiesce(ctx->sched, seqs[i].id);
			for (uint32_t l = 0; l < NL; l++) {
				uint64_t len = 0;
				kvr_seq_length(ctx, seqs[i].id, l, &len);
				CHECK(len == seqs[i].n, "sequence %u layer %u: %llu tokens, expected %llu",
				      seqs[i].id, l, (unsigned long long)len, (unsigned long long)seqs[i].n);
			}
		}
	struct kvr_stats st;
	memset(&st, 0, sizeof(st));
	st.size = sizeof(st);
	CHECK(kvr_get_stats(ctx, &st) == 0, "get_stats");
	CHECK(st.failed_decodes == 0, "%llu failed decodes", (unsigned long long)st.failed_decodes);
	CHECK(st.steps > 0 && decoded > 0, "nothing decoded");
	const char *msg = NULL;
	r = kvr_async_error(ctx, &msg);
	CHECK(r == 0, "asynchronous error %d: %s", r, msg ? msg : "");
	if (staged) {
		char why[256] = "";
		kvr_cudaemu_strict_last_violation(why, sizeof(why));
		CHECK(kvr_cudaemu_strict_violations() == 0, "cudaemu-strict: %s", why);
		CHECK(kvr_cudaemu_failed_launches() == 0, "a cudaemu kernel launch failed");
		for (uint32_t l = 0; l < NL; l++) {
			kvr_dev_free(ctx->dev, dq[l]);
			kvr_dev_free(ctx->dev, dk[l]);
			kvr_dev_free(ctx->dev, dv[l]);
			kvr_dev_free(ctx->dev, dout[l]);
		}
		kvr_dev_stream_destroy(ctx->dev, stage);
	}
	kvr_context_destroy(ctx);
}

int main(int argc, char **argv)
{
	const uint64_t seed = argc > 1 ? strtoull(argv[1], NULL, 0) : 20240611;
	const uint32_t rounds = argc > 2 ? (uint32_t)strtoul(argv[2], NULL, 0) : 12;
	if (argc > 3 && !strcmp(argv[3], "strict"))
		dev_kind = KVR_DEV_CUDAEMU_STRICT;
	rng_state = th_mix64(seed);
	printf("stress_decode: seed %llu, %u rounds\n", (unsigned long long)seed, rounds);
	if (kvr_thread_pool_create(1, &shared_pool)) {
		printf("thread pool: %s\n", kvr_last_error(NULL));
		return 1;
	}
	for (uint32_t r = 0; r < rounds; r++)
		run_round(r);
	kvr_thread_pool_destroy(shared_pool);
	printf("%d passed, %d failed\n", passed, failed);
	return failed ? 1 : 0;
}
