/* SPDX-License-Identifier: MIT */
/*
 * test_units.c — the device page cache of quantised pages (scheduler/units.c)
 * against the ordering rule of DESIGN.md: a device slot is rewritten only
 * after the last attention that reads it. Units are shared by every lane, so
 * the rule reaches across lanes: a unit one lane gives back (a mixed-pool
 * slot going from K8V4, two half-units, to K4V2, one) must not reach another
 * lane's allocation round, whose copy is ordered after that other lane's
 * attention only, while the first lane's attention may still read it.
 *
 * White-box: the test drives kvr_units_fill and kvr_units_release on lanes of
 * a real scheduler (cpu device, attention on an asynchronous compute
 * stream), holds the first lane's "attention" on the compute stream behind a
 * gate, and checks that the freed unit reaches the other lane only once the
 * gate has opened. The test thread plays the engine and a second thread the
 * controller, as in a decode step.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "../scheduler/sched_impl.h"
#include "cudaemu.h"
#include "internal.h"
#include "kvrecall.h"
#include "helpers.h"

enum { NL = 2, N_KV = 2, D = 64, P = 16, K_PAGES = 4 };

/* The compute stream's stand-in for the lane's attention: it blocks until the
 * test thread opens the gate. */
struct gate {
	pthread_mutex_t lock;
	pthread_cond_t cond;
	int open;          /* guarded by lock */
	_Atomic int opened; /* set (release) before the gate opens; read (acquire)
			       by the controller thread after its allocation */
};

static void gate_wait(void *arg)
{
	struct gate *g = arg;
	pthread_mutex_lock(&g->lock);
	while (!g->open)
		pthread_cond_wait(&g->cond, &g->lock);
	pthread_mutex_unlock(&g->lock);
}

static void gate_open(struct gate *g)
{
	atomic_store_explicit(&g->opened, 1, memory_order_release);
	pthread_mutex_lock(&g->lock);
	g->open = 1;
	pthread_cond_broadcast(&g->cond);
	pthread_mutex_unlock(&g->lock);
}

static struct kvr_context *open_mixed(int dev_kind)
{
	struct kvr_config c;
	th_config(&c, NL, N_KV, N_KV, D, KVR_DTYPE_F16, P, P, P, (2 + K_PAGES) * P); /* k = 4 pages per KV head */
	th_config_sparse(&c, 2);
	c.recall = KVR_RECALL_STREAMED;
	c.kv_format = KVR_KV_MIXED;
	c.pool_bytes = 64ull << 20;
	/* attention on a worker stream, as on a GPU: the engine does not wait for it */
	const struct kvr_sched_hooks hooks = { NULL, NULL, 1, 0 };
	struct kvr_context *ctx = NULL;
	const int r = kvr_context_create_internal(&c, dev_kind, &hooks, &ctx);
	cr_assert_eq(r, 0, "context: %d: %s", r, kvr_last_error(NULL));
	return ctx;
}

/* The controller's side of a step: lane `from` gives back one unit (its slot
 * 0 of KV head 0 went K8V4 -> K4V2), then lane `to` takes one for its slot 0
 * of KV head 0. Records the unit it got and whether the attention gate had
 * opened by then. */
struct handover {
	struct kvr_sched *s;
	struct kvr_lane *from, *to;
	struct gate *gate;
	int release_err, fill_err;
	int32_t unit_taken;
	int gate_was_open;
};

static void *controller(void *arg)
{
	struct handover *h = arg;
	const uint32_t release[N_KV] = { 1, 0 }, need[N_KV] = { 1, 0 }, slot0[1] = { 0 };
	h->release_err = kvr_units_release(h->s, h->from, release, slot0);
	h->fill_err = kvr_units_fill(h->s, h->to, need, slot0);
	h->gate_was_open = atomic_load_explicit(&h->gate->opened, memory_order_acquire);
	h->unit_taken = h->to->slot_unit[0];
	return NULL;
}

static void freed_unit_waits(int dev_kind)
{
	struct kvr_context *ctx = open_mixed(dev_kind);
	struct kvr_sched *s = ctx->sched;
	cr_assert_not_null(s->units, "a mixed streamed context has a shared unit cache");
	uint32_t a, b;
	cr_assert_eq(kvr_seq_create(ctx, &a), 0, "%s", kvr_last_error(ctx));
	cr_assert_eq(kvr_seq_create(ctx, &b), 0, "%s", kvr_last_error(ctx));

	/* Sequence a's lanes take every unit of the one chunk, so the ring's
	 * free region is empty and the next allocation can only get a unit
	 * that was given back (the ring is first in, first out). */
	const uint32_t per_head = K_PAGES * s->units_per_slot;
	uint32_t need[N_KV], slots[N_KV * K_PAGES * 2];
	for (uint32_t m = 0; m < N_KV; m++) {
		need[m] = per_head;
		for (uint32_t j = 0; j < per_head; j++)
			slots[m * per_head + j] = j;
	}
	for (uint32_t l = 0; l < NL; l++)
		cr_assert_eq(kvr_units_fill(s, lane_of(s, a, l), need, slots), 0, "%s", s->last_error);
	uint64_t held, free_units, per_seq;
	kvr_sched_units(s, &held, &free_units, &per_seq);
	cr_assert_eq(free_units, 0, "sequence a holds the whole chunk (%llu of %llu free)",
		     (unsigned long long)free_units, (unsigned long long)held);

	/* lane (a, 0)'s attention: still running on the compute stream */
	struct gate gate = { .lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER };
	struct kvr_lane *from = lane_of(s, a, 0), *to = lane_of(s, b, 0);
	const int32_t unit_freed = from->slot_unit[0];
	cr_assert_geq(unit_freed, 0);
	cr_assert_eq(kvr_dev_host_fn(s->dev, s->compute, gate_wait, &gate), 0);
	cr_assert_eq(kvr_dev_event_record(s->dev, from->attn_done, s->compute), 0);

	struct handover h = { s, from, to, &gate, -1, -1, -1, 0 };
	pthread_t thread;
	cr_assert_eq(pthread_create(&thread, NULL, controller, &h), 0);
	/* long enough for an unordered hand-over to finish many times over */
	nanosleep(&(struct timespec){ 0, 200 * 1000 * 1000 }, NULL);
	gate_open(&gate);
	pthread_join(thread, NULL);

	cr_assert_eq(h.release_err, 0, "%s", s->last_error);
	cr_assert_eq(h.fill_err, 0, "%s", s->last_error);
	cr_expect_eq(from->slot_unit[0], -1, "the released slot holds no unit");
	cr_assert_eq(h.unit_taken, unit_freed,
		     "lane (b, 0) got unit %d, not the freed unit %d: the test did not reach the hand-over",
		     h.unit_taken, unit_freed);
	cr_expect(h.gate_was_open,
		  "unit %d reached another lane's allocation while the attention that reads it was still "
		  "running: that lane's copy could rewrite it under the attention",
		  unit_freed);

	kvr_dev_stream_synchronize(s->dev, s->compute);
	const char *msg = NULL;
	cr_expect_eq(kvr_async_error(ctx, &msg), 0, "%s", msg ? msg : "");
	kvr_seq_free(ctx, a);
	kvr_seq_free(ctx, b);
	kvr_context_destroy(ctx);
}

Test(units, freed_unit_waits_for_the_lanes_attention_cpu)
{
	freed_unit_waits(KVR_DEV_CPU);
}

/* the CUDA kernels (the free-list rounds) under cudaemu, device memory kept
 * apart from host memory as on a GPU */
Test(units, freed_unit_waits_for_the_lanes_attention_cudaemu_strict)
{
	freed_unit_waits(KVR_DEV_CUDAEMU_STRICT);
	cr_expect_eq(kvr_cudaemu_failed_launches(), 0, "a cudaemu kernel launch failed");
	char why[256] = "";
	kvr_cudaemu_strict_last_violation(why, sizeof(why));
	cr_expect_eq(kvr_cudaemu_strict_violations(), 0, "cudaemu-strict: %s", why);
}
