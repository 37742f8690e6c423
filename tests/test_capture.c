/* SPDX-License-Identifier: MIT */
/*
 * test_capture.c — capturing stream work into a graph and launching it
 * (gpu/backend.h: kvr_dev_stream_begin_capture ... kvr_dev_graph_launch) on
 * the cpu backend and cudaemu-strict, which emulate CUDA graphs with CUDA's
 * rules (gpu/cpu/cpu_backend.c; the cuda backend's graph ops come with a
 * capturable step, when a GPU can check them):
 *  - nothing captured runs at capture; each launch runs the copies and the
 *    kernel again, reading host memory and item arrays as they are at the
 *    launch (three launches, three inputs, three outputs);
 *  - a stream waiting on an event recorded in the capture joins it, and its
 *    work must be waited on by the origin, directly or through another
 *    joined stream, before the end; unjoined work fails the end and leaves
 *    every stream usable;
 *  - a launch runs a forked stream's work as late as the waits allow, so
 *    the origin reading it without a wait sees stale data (as a GPU may);
 *  - a synchronize, an event query, a wait on an event recorded outside the
 *    capture, an allocation and a batched copy are refused on the capturing
 *    thread and invalidate the capture; destroying a joined stream does too;
 *  - cudaemu-strict checks a captured kernel's items when a launch runs it
 *    (an item made to point at malloc'd memory after the capture is a
 *    violation then, and the kernel is skipped), and wants a captured
 *    copy's host side pinned.
 * These are the rules a captured decode step will be held to (docs/
 * architecture.md, "Capturing a step in a CUDA graph").
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cudaemu.h"

#define NQO 4
#define NKV 2
#define D 64
#define P 16
#define ROW (NKV * D)
#define RUN_BYTES (2 * P * D * sizeof(float))
#define TILE_BYTES (P * ROW * sizeof(float))

static const struct kvr_shape shape = { .n_qo_heads = NQO, .n_kv_heads = NKV, .head_dim = D,
					.page_tokens = P, .elem_type = KVR_ELEM_F32,
					.scale = 0.125f, .tau = 0.9f };

struct rig {
	struct kvr_dev *dev;
	struct kvr_stream *s, *fork; /* the capture's origin; a stream to fork to */
	float *run, *k_tile, *v_tile;  /* device */
	struct kvr_scatter_item *items; /* device */
	float *host_run, *host_out;     /* pinned (registered): CUDA captures no pageable copy */
	struct kvr_scatter_item *item;  /* host, pinned: copied to `items` in the graph */
};

static void rig_open(struct rig *r, uint32_t kind)
{
	memset(r, 0, sizeof(*r));
	struct kvr_dev_params params = { .kind = kind, .threads = 1 };
	char err[256] = "";
	const int rc = kvr_dev_create(&params, &r->dev, err, sizeof(err));
	cr_assert_eq(rc, 0, "kvr_dev_create(kind %u): %d: %s", kind, rc, err);
	cr_assert_eq(posix_memalign((void **)&r->host_run, 4096, RUN_BYTES), 0);
	cr_assert_eq(posix_memalign((void **)&r->host_out, 4096, TILE_BYTES), 0);
	cr_assert_eq(kvr_dev_host_register(r->dev, r->host_run, RUN_BYTES), 0, "%s", kvr_dev_last_error(r->dev));
	cr_assert_eq(kvr_dev_host_register(r->dev, r->host_out, TILE_BYTES), 0, "%s", kvr_dev_last_error(r->dev));
	cr_assert_eq(posix_memalign((void **)&r->item, 4096, 4096), 0);
	cr_assert_eq(kvr_dev_host_register(r->dev, r->item, 4096), 0, "%s", kvr_dev_last_error(r->dev));
	cr_assert_eq(kvr_dev_stream_create(r->dev, KVR_STREAM_INLINE, &r->s), 0);
	cr_assert_eq(kvr_dev_stream_create(r->dev, KVR_STREAM_INLINE, &r->fork), 0);
	cr_assert_eq(kvr_dev_alloc(r->dev, RUN_BYTES, (void **)&r->run), 0);
	cr_assert_eq(kvr_dev_alloc(r->dev, TILE_BYTES, (void **)&r->k_tile), 0);
	cr_assert_eq(kvr_dev_alloc(r->dev, TILE_BYTES, (void **)&r->v_tile), 0);
	cr_assert_eq(kvr_dev_alloc(r->dev, sizeof(*r->item), (void **)&r->items), 0);
	*r->item = (struct kvr_scatter_item){ r->run, r->k_tile, r->v_tile, 1, 0 };
}

static void rig_close(struct rig *r)
{
	kvr_dev_stream_synchronize(r->dev, r->s);
	kvr_dev_free(r->dev, r->run);
	kvr_dev_free(r->dev, r->k_tile);
	kvr_dev_free(r->dev, r->v_tile);
	kvr_dev_free(r->dev, r->items);
	kvr_dev_stream_destroy(r->dev, r->s);
	kvr_dev_stream_destroy(r->dev, r->fork);
	kvr_dev_host_unregister(r->dev, r->host_run);
	kvr_dev_host_unregister(r->dev, r->host_out);
	free(r->host_run);
	free(r->host_out);
	kvr_dev_host_unregister(r->dev, r->item);
	free(r->item);
	kvr_dev_destroy(r->dev);
}

/* The captured work: the run and the item up, the scatter (the run's keys
 * into KV head 1's column of the key tile), the key tile down. */
static void enqueue_scatter(struct rig *r)
{
	cr_assert_eq(kvr_dev_memcpy_async(r->dev, r->run, r->host_run, RUN_BYTES, KVR_COPY_H2D, r->s),
		     0, "%s", kvr_dev_last_error(r->dev));
	cr_assert_eq(kvr_dev_memcpy_async(r->dev, r->items, r->item, sizeof(*r->item), KVR_COPY_H2D, r->s), 0);
	cr_assert_eq(kvr_dev_scatter(r->dev, &shape, r->items, 1, r->s), 0, "%s", kvr_dev_last_error(r->dev));
	cr_assert_eq(kvr_dev_memcpy_async(r->dev, r->host_out, r->k_tile, TILE_BYTES, KVR_COPY_D2H, r->s),
		     0);
}

static void fill_run(struct rig *r, uint32_t round)
{
	for (uint32_t i = 0; i < 2 * P * D; i++)
		r->host_run[i] = (float)(round * 10000 + i);
}

static void expect_keys(const struct rig *r, uint32_t round)
{
	for (uint32_t t = 0; t < P; t++)
		for (uint32_t i = 0; i < D; i++) {
			const float want = (float)(round * 10000 + t * D + i), got = r->host_out[t * ROW + D + i];
			cr_assert_eq(got, want, "launch %u: token %u element %u is %g, not %g", round, t, i, got, want);
		}
}

static void replay_on(uint32_t kind)
{
	struct rig r;
	rig_open(&r, kind);
	for (uint32_t i = 0; i < P * ROW; i++)
		r.host_out[i] = -1.0f;
	fill_run(&r, 7);
	struct kvr_graph *g = NULL;
	cr_assert_eq(kvr_dev_stream_begin_capture(r.dev, r.s), 0, "%s", kvr_dev_last_error(r.dev));
	cr_assert_eq(kvr_dev_stream_capturing(r.dev, r.s), 1);
	enqueue_scatter(&r);
	cr_assert_eq(kvr_dev_stream_end_capture(r.dev, r.s, &g), 0, "%s", kvr_dev_last_error(r.dev));
	cr_assert_not_null(g);
	cr_assert_eq(kvr_dev_stream_capturing(r.dev, r.s), 0);
	cr_assert_eq(r.host_out[D], -1.0f, "captured work ran at capture");
	for (uint32_t round = 1; round <= 3; round++) {
		fill_run(&r, round); /* read by the launch, not the capture */
		cr_assert_eq(kvr_dev_graph_launch(r.dev, g, r.s), 0, "%s", kvr_dev_last_error(r.dev));
		cr_assert_eq(kvr_dev_stream_synchronize(r.dev, r.s), 0);
		expect_keys(&r, round);
	}
	kvr_dev_graph_destroy(r.dev, g);
	rig_close(&r);
}

Test(capture, replay_reads_memory_at_launch_cpu)
{
	replay_on(KVR_DEV_CPU);
}

Test(capture, replay_reads_memory_at_launch_cudaemu_strict)
{
	replay_on(KVR_DEV_CUDAEMU_STRICT);
	cr_expect_eq(kvr_cudaemu_strict_violations(), 0);
}

/* Fork to a second stream and join back. join 0: the fork is never waited
 * on: the end fails, and both streams work uncaptured afterwards. join 2:
 * through a third stream (transitively). join 3: a third stream waits on
 * the fork but the origin never waits on the third: unjoined. */
static void fork_join_on(uint32_t kind, int join)
{
	struct rig r;
	rig_open(&r, kind);
	struct kvr_stream *third;
	cr_assert_eq(kvr_dev_stream_create(r.dev, KVR_STREAM_INLINE, &third), 0);
	struct kvr_event *forked, *joined, *relayed;
	cr_assert_eq(kvr_dev_event_create(r.dev, &forked), 0);
	cr_assert_eq(kvr_dev_event_create(r.dev, &joined), 0);
	cr_assert_eq(kvr_dev_event_create(r.dev, &relayed), 0);
	fill_run(&r, 5);
	struct kvr_graph *g = NULL;
	cr_assert_eq(kvr_dev_stream_begin_capture(r.dev, r.s), 0);
	cr_assert_eq(kvr_dev_event_record(r.dev, forked, r.s), 0);
	cr_assert_eq(kvr_dev_stream_wait_event(r.dev, r.fork, forked), 0, "%s", kvr_dev_last_error(r.dev));
	cr_assert_eq(kvr_dev_stream_capturing(r.dev, r.fork), 1, "a stream waiting on a captured event joins");
	/* the run goes up on the fork, the rest on the origin after the join */
	cr_assert_eq(kvr_dev_memcpy_async(r.dev, r.run, r.host_run, RUN_BYTES, KVR_COPY_H2D, r.fork), 0);
	cr_assert_eq(kvr_dev_event_record(r.dev, joined, r.fork), 0);
	if (join == 1) {
		cr_assert_eq(kvr_dev_stream_wait_event(r.dev, r.s, joined), 0);
	} else if (join >= 2) {
		cr_assert_eq(kvr_dev_stream_wait_event(r.dev, third, joined), 0);
		cr_assert_eq(kvr_dev_event_record(r.dev, relayed, third), 0);
		if (join == 2)
			cr_assert_eq(kvr_dev_stream_wait_event(r.dev, r.s, relayed), 0);
		else /* the third's one operation: the origin never waits on it */
			cr_assert_eq(kvr_dev_memcpy_async(r.dev, r.v_tile, r.host_run, RUN_BYTES, KVR_COPY_H2D, third),
				     0);
	}
	cr_assert_eq(kvr_dev_memcpy_async(r.dev, r.items, r.item, sizeof(*r.item), KVR_COPY_H2D, r.s), 0);
	cr_assert_eq(kvr_dev_scatter(r.dev, &shape, r.items, 1, r.s), 0);
	cr_assert_eq(kvr_dev_memcpy_async(r.dev, r.host_out, r.k_tile, TILE_BYTES, KVR_COPY_D2H, r.s), 0);
	const int rc = kvr_dev_stream_end_capture(r.dev, r.s, &g);
	cr_assert_eq(kvr_dev_stream_capturing(r.dev, r.s), 0);
	cr_assert_eq(kvr_dev_stream_capturing(r.dev, r.fork), 0, "the fork still captures after the end");
	cr_assert_eq(kvr_dev_stream_capturing(r.dev, third), 0);
	if (join == 0 || join == 3) {
		cr_assert_eq(rc, -EINVAL, "a capture with unjoined work ended: %d", rc);
		cr_assert(strstr(kvr_dev_last_error(r.dev), "unjoined"), "%s", kvr_dev_last_error(r.dev));
		cr_assert_null(g);
		/* both streams run work again */
		enqueue_scatter(&r);
		cr_assert_eq(kvr_dev_memcpy_async(r.dev, r.run, r.host_run, RUN_BYTES, KVR_COPY_H2D, r.fork), 0,
			     "%s", kvr_dev_last_error(r.dev));
		cr_assert_eq(kvr_dev_stream_synchronize(r.dev, r.fork), 0);
		cr_assert_eq(kvr_dev_stream_synchronize(r.dev, r.s), 0);
		expect_keys(&r, 5);
	} else {
		cr_assert_eq(rc, 0, "%s", kvr_dev_last_error(r.dev));
		for (uint32_t round = 1; round <= 2; round++) {
			fill_run(&r, round);
			cr_assert_eq(kvr_dev_graph_launch(r.dev, g, r.s), 0, "%s", kvr_dev_last_error(r.dev));
			cr_assert_eq(kvr_dev_stream_synchronize(r.dev, r.s), 0, "%s", kvr_dev_last_error(r.dev));
			expect_keys(&r, round);
		}
		kvr_dev_graph_destroy(r.dev, g);
	}
	kvr_dev_event_destroy(r.dev, forked);
	kvr_dev_event_destroy(r.dev, joined);
	kvr_dev_event_destroy(r.dev, relayed);
	kvr_dev_stream_destroy(r.dev, third);
	rig_close(&r);
}

Test(capture, fork_join_cpu)
{
	fork_join_on(KVR_DEV_CPU, 1);
}

Test(capture, fork_join_cudaemu_strict)
{
	fork_join_on(KVR_DEV_CUDAEMU_STRICT, 1);
}

Test(capture, join_through_another_stream)
{
	fork_join_on(KVR_DEV_CPU, 2);
}

Test(capture, unjoined_work_fails_the_end)
{
	fork_join_on(KVR_DEV_CPU, 0);
	fork_join_on(KVR_DEV_CPU, 3);
}

/* The origin reads the fork's copy without waiting for it (the join comes
 * after the read): a launch runs the fork's work as late as the waits
 * allow, so the scatter reads the run as it was before — the race a GPU
 * may lose, here lost every time. */
Test(capture, a_missing_wait_reads_stale_data)
{
	struct rig r;
	rig_open(&r, KVR_DEV_CPU);
	fill_run(&r, 4); /* on the device before the capture */
	cr_assert_eq(kvr_dev_memcpy_async(r.dev, r.run, r.host_run, RUN_BYTES, KVR_COPY_H2D, r.s), 0);
	struct kvr_event *forked, *joined;
	cr_assert_eq(kvr_dev_event_create(r.dev, &forked), 0);
	cr_assert_eq(kvr_dev_event_create(r.dev, &joined), 0);
	struct kvr_graph *g = NULL;
	cr_assert_eq(kvr_dev_stream_begin_capture(r.dev, r.s), 0);
	cr_assert_eq(kvr_dev_event_record(r.dev, forked, r.s), 0);
	cr_assert_eq(kvr_dev_stream_wait_event(r.dev, r.fork, forked), 0);
	cr_assert_eq(kvr_dev_memcpy_async(r.dev, r.run, r.host_run, RUN_BYTES, KVR_COPY_H2D, r.fork), 0);
	cr_assert_eq(kvr_dev_event_record(r.dev, joined, r.fork), 0);
	cr_assert_eq(kvr_dev_memcpy_async(r.dev, r.items, r.item, sizeof(*r.item), KVR_COPY_H2D, r.s), 0);
	cr_assert_eq(kvr_dev_scatter(r.dev, &shape, r.items, 1, r.s), 0); /* no wait: a race */
	cr_assert_eq(kvr_dev_memcpy_async(r.dev, r.host_out, r.k_tile, TILE_BYTES, KVR_COPY_D2H, r.s), 0);
	cr_assert_eq(kvr_dev_stream_wait_event(r.dev, r.s, joined), 0); /* joined, too late */
	cr_assert_eq(kvr_dev_stream_end_capture(r.dev, r.s, &g), 0, "%s", kvr_dev_last_error(r.dev));
	fill_run(&r, 1);
	cr_assert_eq(kvr_dev_graph_launch(r.dev, g, r.s), 0);
	cr_assert_eq(kvr_dev_stream_synchronize(r.dev, r.s), 0);
	expect_keys(&r, 4); /* the run before the fork's copy */
	kvr_dev_graph_destroy(r.dev, g);
	kvr_dev_event_destroy(r.dev, forked);
	kvr_dev_event_destroy(r.dev, joined);
	rig_close(&r);
}


/* What a capture cannot hold: each refused, the capture invalidated (its
 * end fails naming why), the stream usable afterwards. */
static void refusals_on(uint32_t kind)
{
	struct rig r;
	rig_open(&r, kind);
	struct kvr_event *outside, *inside;
	cr_assert_eq(kvr_dev_event_create(r.dev, &outside), 0);
	cr_assert_eq(kvr_dev_event_create(r.dev, &inside), 0);
	cr_assert_eq(kvr_dev_event_record(r.dev, outside, r.fork), 0);
	for (int what = 0; what < 6; what++) {
		struct kvr_graph *g = NULL;
		cr_assert_eq(kvr_dev_stream_begin_capture(r.dev, r.s), 0);
		cr_assert_eq(kvr_dev_stream_begin_capture(r.dev, r.s), -EINVAL, "a second begin on one stream");
		cr_assert_eq(kvr_dev_event_record(r.dev, inside, r.s), 0);
		int rc = -EINVAL;
		void *p = NULL;
		const struct kvr_copy_desc desc = { 0, 0, 64 };
		struct kvr_stream *joiner = NULL;
		if (what == 0) {
			rc = kvr_dev_stream_synchronize(r.dev, r.s);
		} else if (what == 1) {
			rc = kvr_dev_event_query(r.dev, inside);
		} else if (what == 2) {
			rc = kvr_dev_stream_wait_event(r.dev, r.s, outside);
		} else if (what == 3) {
			rc = kvr_dev_alloc(r.dev, 64, &p);
		} else if (what == 4) {
			rc = kvr_dev_memcpy_batch_async(r.dev, r.run, r.host_run, &desc, 1, KVR_COPY_H2D, r.s);
		} else { /* a joined stream destroyed before the end */
			cr_assert_eq(kvr_dev_stream_create(r.dev, KVR_STREAM_INLINE, &joiner), 0);
			cr_assert_eq(kvr_dev_stream_wait_event(r.dev, joiner, inside), 0);
			kvr_dev_stream_destroy(r.dev, joiner);
		}
		cr_assert_eq(rc, -EINVAL, "refusal %d: %d", what, rc);
		cr_assert_null(p);
		cr_assert_eq(kvr_dev_stream_end_capture(r.dev, r.s, &g), -EINVAL, "an invalidated capture ended");
		cr_assert(strstr(kvr_dev_last_error(r.dev), "invalidated"), "%s", kvr_dev_last_error(r.dev));
		cr_assert_null(g);
		cr_assert_eq(kvr_dev_event_query(r.dev, inside), 0, "the event is plain again after the end");
	}
	/* a kernel no captured step launches (kernels.h, KVR_CAPTURABLE_*):
	 * refused as CUDA refuses it, before anything is recorded, so the
	 * capture stays valid */
	{
		struct kvr_graph *g = NULL;
		const struct kvr_page_item page = { 0 };
		cr_assert_eq(kvr_dev_stream_begin_capture(r.dev, r.s), 0);
		cr_assert_eq(kvr_dev_offload(r.dev, &shape, &page, 1, r.s), -ENOTSUP);
		cr_assert(strstr(kvr_dev_last_error(r.dev), "offload: cannot be captured"), "%s",
			  kvr_dev_last_error(r.dev));
		fill_run(&r, 3);
		enqueue_scatter(&r); /* the capture goes on */
		cr_assert_eq(kvr_dev_stream_end_capture(r.dev, r.s, &g), 0, "%s", kvr_dev_last_error(r.dev));
		cr_assert_eq(kvr_dev_graph_launch(r.dev, g, r.s), 0, "%s", kvr_dev_last_error(r.dev));
		cr_assert_eq(kvr_dev_stream_synchronize(r.dev, r.s), 0);
		expect_keys(&r, 3);
		kvr_dev_graph_destroy(r.dev, g);
	}
	/* destroying an event recorded in a capture, before its end */
	struct kvr_event *gone;
	struct kvr_graph *g2 = NULL;
	cr_assert_eq(kvr_dev_event_create(r.dev, &gone), 0);
	cr_assert_eq(kvr_dev_stream_begin_capture(r.dev, r.s), 0);
	cr_assert_eq(kvr_dev_event_record(r.dev, gone, r.s), 0);
	kvr_dev_event_destroy(r.dev, gone);
	cr_assert_eq(kvr_dev_stream_end_capture(r.dev, r.s, &g2), 0, "%s", kvr_dev_last_error(r.dev));
	cr_assert_eq(kvr_dev_graph_launch(r.dev, g2, r.s), 0);
	kvr_dev_graph_destroy(r.dev, g2);
	fill_run(&r, 2);
	enqueue_scatter(&r);
	cr_assert_eq(kvr_dev_stream_synchronize(r.dev, r.s), 0);
	expect_keys(&r, 2);
	struct kvr_graph *g = NULL;
	cr_assert_eq(kvr_dev_stream_end_capture(r.dev, r.s, &g), -EINVAL, "an end without a begin");
	kvr_dev_event_destroy(r.dev, outside);
	kvr_dev_event_destroy(r.dev, inside);
	rig_close(&r);
}

Test(capture, refusals_cpu)
{
	refusals_on(KVR_DEV_CPU);
}

Test(capture, refusals_cudaemu_strict)
{
	refusals_on(KVR_DEV_CUDAEMU_STRICT);
}

/* cudaemu-strict: a captured copy's host side must be pinned (registered):
 * a GPU stages a pageable copy through the host when it is enqueued, which
 * a replay cannot repeat. */
Test(capture, strict_wants_pinned_host_memory)
{
	struct rig r;
	rig_open(&r, KVR_DEV_CUDAEMU_STRICT);
	float *pageable = calloc(2 * P * D, sizeof(float));
	cr_assert_not_null(pageable);
	cr_assert_eq(kvr_dev_memcpy_async(r.dev, r.run, pageable, RUN_BYTES, KVR_COPY_H2D, r.s), 0,
		     "uncaptured, a pageable source is fine");
	struct kvr_graph *g = NULL;
	cr_assert_eq(kvr_dev_stream_begin_capture(r.dev, r.s), 0);
	cr_assert_eq(kvr_dev_memcpy_async(r.dev, r.run, pageable, RUN_BYTES, KVR_COPY_H2D, r.s), -EFAULT);
	cr_assert(strstr(kvr_dev_last_error(r.dev), "registered host memory"), "%s", kvr_dev_last_error(r.dev));
	cr_assert_eq(kvr_dev_memcpy_async(r.dev, r.run, r.host_run, RUN_BYTES, KVR_COPY_H2D, r.s), 0,
		     "%s", kvr_dev_last_error(r.dev));
	cr_assert_eq(kvr_dev_stream_end_capture(r.dev, r.s, &g), 0, "%s", kvr_dev_last_error(r.dev));
	kvr_dev_graph_destroy(r.dev, g);
	free(pageable);
	rig_close(&r);
}

/* cudaemu-strict reads a captured kernel's items when a launch runs it, as
 * it does on a worker stream: here the item points at malloc'd memory by the
 * second launch, a violation then, and the kernel does not run. */
Test(capture, strict_checks_items_at_launch)
{
	struct rig r;
	rig_open(&r, KVR_DEV_CUDAEMU_STRICT);
	struct kvr_graph *g = NULL;
	cr_assert_eq(kvr_dev_stream_begin_capture(r.dev, r.s), 0);
	enqueue_scatter(&r);
	cr_assert_eq(kvr_dev_stream_end_capture(r.dev, r.s, &g), 0, "%s", kvr_dev_last_error(r.dev));
	fill_run(&r, 1);
	cr_assert_eq(kvr_dev_graph_launch(r.dev, g, r.s), 0);
	expect_keys(&r, 1);
	cr_assert_eq(kvr_cudaemu_strict_violations(), 0);
	float *stray = calloc(2 * P * D, sizeof(float));
	cr_assert_not_null(stray);
	r.item->run = stray; /* host memory a GPU kernel cannot read */
	fill_run(&r, 2);
	cr_assert_eq(kvr_dev_graph_launch(r.dev, g, r.s), 0);
	cr_assert_eq(kvr_cudaemu_strict_violations(), 1, "the launch's kernel read malloc'd memory unchecked");
	expect_keys(&r, 1); /* skipped: the tile holds the first launch's keys */
	free(stray);
	kvr_dev_graph_destroy(r.dev, g);
	rig_close(&r);
}
