/* SPDX-License-Identifier: MIT */
/*
 * test_units.c — the device page cache of quantised pages (scheduler/units.c)
 * against the ordering rule of docs/design.md ("The decode step", step 6): a
 * device slot is rewritten only after the last attention that reads it. Units
 * are shared by every lane, so the rule reaches across lanes: a unit one lane
 * gives back (a mixed-pool slot going from K8V4, two half-units, to K4V2, one)
 * must not reach another lane's allocation round, whose copy is ordered after
 * that other lane's attention only, while the first lane's attention may still
 * read it. And rounds are few (LeanKV runs memory management once per step): a
 * sequence's first fill takes unit 0 of every slot of all its sparse lanes in
 * one round, a lane's given-back units serve its own next fill with no round,
 * and the rest go back in one round at the step's end.
 *
 * White-box: the test drives kvr_units_fill and kvr_units_release on lanes of
 * a real scheduler (cpu device, attention on an asynchronous compute
 * stream), holds the first lane's "attention" on the compute stream behind a
 * gate, and checks that the freed unit reaches the ring only once the gate
 * has opened. The test thread plays the engine and a second thread the
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
 * 0 of KV head 0 went K8V4 -> K4V2), lane `to` (another sequence) takes one
 * for its slot 0 of KV head 0, then `from` takes one back for the same slot
 * (its page went back to K8V4) and gives it back again. */
struct handover {
	struct kvr_sched *s;
	struct kvr_lane *from, *to;
	int release_err, fill_err, refill_err, release2_err;
	int32_t unit_taken, unit_refilled;
	uint64_t alloc_before_refill, alloc_after_refill;
	uint64_t free_rounds_before, free_rounds_after; /* around the releases */
};

static void *controller(void *arg)
{
	struct handover *h = arg;
	uint64_t frees, allocs;
	const uint32_t one[N_KV] = { 1, 0 }, half0[1] = { 1 }, unit0[1] = { 0 };
	kvr_units_rounds(h->s, &allocs, &h->free_rounds_before);
	h->release_err = kvr_units_release(h->s, h->from, one, half0);
	h->fill_err = kvr_units_fill(h->s, h->to, one, unit0);
	h->unit_taken = h->to->slot_unit[0];
	kvr_units_rounds(h->s, &h->alloc_before_refill, &frees);
	h->refill_err = kvr_units_fill(h->s, h->from, one, half0);
	kvr_units_rounds(h->s, &h->alloc_after_refill, &frees);
	h->unit_refilled = h->from->slot_unit[1];
	h->release2_err = kvr_units_release(h->s, h->from, one, half0);
	kvr_units_rounds(h->s, &allocs, &h->free_rounds_after);
	return NULL;
}

/* The attention's end, late: what the ring held just before it. */
struct opener {
	struct kvr_sched *s;
	struct gate *gate;
	uint64_t free_at_open;
};

static void *open_later(void *arg)
{
	struct opener *o = arg;
	/* long enough for an unordered return to finish many times over */
	nanosleep(&(struct timespec){ 0, 200 * 1000 * 1000 }, NULL);
	uint64_t held, per_seq;
	kvr_sched_units(o->s, &held, &o->free_at_open, &per_seq);
	gate_open(o->gate);
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
	 * free region is empty. Lane (a, 0)'s first fill also gives lane
	 * (a, 1) unit 0 of each slot, in the same round; (a, 1)'s own fill then
	 * takes only the second units. */
	const uint32_t per_head = K_PAGES * s->units_per_slot;
	uint32_t need[N_KV], slots[N_KV * K_PAGES * 2];
	for (uint32_t m = 0; m < N_KV; m++) {
		need[m] = per_head;
		for (uint32_t j = 0; j < per_head; j++)
			slots[m * per_head + j] = j;
	}
	uint64_t alloc_rounds, free_rounds;
	cr_assert_eq(kvr_units_fill(s, lane_of(s, a, 0), need, slots), 0, "%s", s->last_error);
	kvr_units_rounds(s, &alloc_rounds, &free_rounds);
	cr_assert_eq(alloc_rounds, 1);
	for (uint32_t m = 0; m < N_KV; m++)
		for (uint32_t j = 0; j < K_PAGES; j++) {
			const int32_t *e = lane_of(s, a, 1)->slot_unit + (m * K_PAGES + j) * s->units_per_slot;
			cr_assert(e[0] >= 0 && e[1] == -1,
				  "lane (a, 1) head %u slot %u holds units %d, %d after the sequence's first "
				  "fill: unit 0 of every slot, nothing else",
				  m, j, e[0], e[1]);
		}
	cr_assert_eq(kvr_units_fill(s, lane_of(s, a, 1), need, slots), 0, "%s", s->last_error);
	kvr_units_rounds(s, &alloc_rounds, &free_rounds);
	cr_assert_eq(alloc_rounds, 2, "%llu allocation rounds", (unsigned long long)alloc_rounds);
	uint64_t held, free_units, per_seq;
	kvr_sched_units(s, &held, &free_units, &per_seq);
	cr_assert_eq(free_units, 0, "sequence a holds the whole chunk (%llu of %llu free)",
		     (unsigned long long)free_units, (unsigned long long)held);

	/* lane (a, 0)'s attention: still running on the compute stream */
	struct gate gate = { .lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER };
	struct kvr_lane *from = lane_of(s, a, 0), *to = lane_of(s, b, 0);
	const int32_t unit_freed = from->slot_unit[1];
	cr_assert_geq(unit_freed, 0);
	cr_assert_eq(kvr_dev_host_fn(s->dev, s->compute, gate_wait, &gate), 0);
	cr_assert_eq(kvr_dev_event_record(s->dev, from->attn_done, s->compute), 0);

	struct handover h = { s, from, to, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0 };
	pthread_t thread;
	cr_assert_eq(pthread_create(&thread, NULL, controller, &h), 0);
	pthread_join(thread, NULL);
	cr_assert_eq(h.release_err, 0, "%s", s->last_error);
	cr_assert_eq(h.fill_err, 0, "%s", s->last_error);
	cr_assert_eq(h.refill_err, 0, "%s", s->last_error);
	cr_assert_eq(h.release2_err, 0, "%s", s->last_error);
	cr_assert_geq(h.unit_taken, 0);
	cr_expect_neq(h.unit_taken, unit_freed,
		      "unit %d reached another lane's allocation while the attention that reads it was still "
		      "running: that lane's copy could rewrite it under the attention",
		      unit_freed);
	cr_expect_eq(h.unit_refilled, unit_freed, "the lane's own fill took unit %d, not its spare %d",
		     h.unit_refilled, unit_freed);
	cr_expect_eq(h.alloc_after_refill, h.alloc_before_refill, "a fill its spares cover ran a round");
	cr_expect_eq(h.free_rounds_after, h.free_rounds_before + 1,
		     "%llu free rounds during the releases and fills: only the new sequence's chunk (one) expected",
		     (unsigned long long)(h.free_rounds_after - h.free_rounds_before));
	cr_expect_eq(from->slot_unit[1], -1, "the released slot holds no second unit");
	uint64_t free_before;
	kvr_sched_units(s, &held, &free_before, &per_seq);
	kvr_units_rounds(s, &alloc_rounds, &free_rounds);

	/* the step's end: its one free round returns the spare, after the gate */
	struct opener op = { s, &gate, 0 };
	pthread_t opener;
	cr_assert_eq(pthread_create(&opener, NULL, open_later, &op), 0);
	cr_assert_eq(kvr_sched_step_end(s), 0, "%s", s->last_error);
	pthread_join(opener, NULL);
	cr_expect_eq(op.free_at_open, free_before,
		     "the step's end returned %lld units while the attention that reads them was still running",
		     (long long)(op.free_at_open - free_before));
	uint64_t free_after, alloc_after, free_rounds_after;
	kvr_sched_units(s, &held, &free_after, &per_seq);
	kvr_units_rounds(s, &alloc_after, &free_rounds_after);
	cr_expect_eq(free_after, free_before + 1, "the step's end returned %lld units, not the one spare",
		     (long long)(free_after - free_before));
	cr_expect_eq(free_rounds_after, free_rounds + 1, "%llu free rounds at the step's end, not one",
		     (unsigned long long)(free_rounds_after - free_rounds));
	cr_expect_eq(from->n_spare, 0, "lane (a, 0) kept %u spares past the step's end", from->n_spare);

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
