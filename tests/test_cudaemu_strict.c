/* SPDX-License-Identifier: MIT */
/*
 * test_cudaemu_strict.c — the cudaemu-strict device (KVR_DEV_CUDAEMU_STRICT,
 * gpu/cudaemu/backend.c): cudaemu held to a GPU's memory rules, so that code
 * written for a real GPU can be checked on a machine without one.
 *  - identity: kind, name, device memory not host-visible;
 *  - attention with items and segments in device memory runs and gives
 *    plain cudaemu's output bit for bit; with the item array in malloc'd
 *    memory, a segment in malloc'd memory, a segment running past its
 *    allocation, a segment in freed memory, or an item's segment range past
 *    the call's list, the enqueue fails with -EFAULT naming the field, is
 *    counted, and runs nothing (the output keeps its sentinel);
 *  - registered host memory is accepted as kernel data, never as an item
 *    array;
 *  - every other kernel with every buffer allocated to exactly the extent
 *    the validator computes (multiples of 64 bytes, so under ASan a kernel
 *    reading past it would be caught: the extent is not too small) passes,
 *    and one element less fails naming that field (not too large); pointers
 *    a kernel does not touch may be NULL;
 *  - copies: the device side in one device allocation, the host side outside
 *    device memory, per descriptor for batches;
 *  - allocations through an engine's allocator are tracked, and their frees;
 *  - worker streams: item contents are checked when the worker runs the
 *    kernel (an H2D copy queued ahead of it fills them), a violation found
 *    then is counted and skips the kernel.
 *
 * One device per test (Criterion runs each test in its own process, so the
 * process-wide violation counter starts at 0). Shapes are small: n_qo 4,
 * n_kv 2, d 64, p 16, f32.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cudaemu.h"

#define NQO 4
#define NKV 2
#define D 64
#define P 16
#define EB 4 /* f32 */
#define ROW (NKV * D) /* elements of one NHD row */

static const struct kvr_shape shape = { .n_qo_heads = NQO, .n_kv_heads = NKV, .head_dim = D,
					.page_tokens = P, .elem_type = KVR_ELEM_F32,
					.scale = 0.125f, .tau = 0.9f };

/* ------------------------------------------------------------------ devices */

#define MAX_BUFS 64

struct tdev {
	struct kvr_dev *dev;
	struct kvr_stream *s; /* inline */
	struct kvr_stream *w; /* worker */
	void *bufs[MAX_BUFS]; /* device memory freed at close */
	unsigned n_bufs;
};

static struct tdev T; /* the test's strict device */

static void tdev_open(struct tdev *t, uint32_t kind, const struct kvr_dev_params *base)
{
	struct kvr_dev_params params = base ? *base : (struct kvr_dev_params){ 0 };
	params.kind = kind;
	params.threads = 1;
	char err[256] = "";
	const int rc = kvr_dev_create(&params, &t->dev, err, sizeof(err));
	cr_assert_eq(rc, 0, "kvr_dev_create(kind %u): %d: %s", kind, rc, err);
	cr_assert_eq(kvr_dev_stream_create(t->dev, KVR_STREAM_INLINE, &t->s), 0);
	cr_assert_eq(kvr_dev_stream_create(t->dev, KVR_STREAM_WORKER, &t->w), 0);
}

static void tdev_close(struct tdev *t)
{
	if (!t->dev)
		return;
	kvr_dev_stream_synchronize(t->dev, t->w);
	for (unsigned i = 0; i < t->n_bufs; i++)
		kvr_dev_free(t->dev, t->bufs[i]);
	kvr_dev_stream_destroy(t->dev, t->s);
	kvr_dev_stream_destroy(t->dev, t->w);
	kvr_dev_destroy(t->dev);
	memset(t, 0, sizeof(*t));
}

static void open_strict(void)
{
	tdev_open(&T, KVR_DEV_CUDAEMU_STRICT, NULL);
}

static void close_strict(void)
{
	tdev_close(&T);
}

TestSuite(cudaemu_strict, .init = open_strict, .fini = close_strict);

/* Device memory that lives until the test ends. */
static void *dalloc(struct tdev *t, size_t bytes)
{
	cr_assert_lt(t->n_bufs, MAX_BUFS, "too many device buffers (test bug)");
	void *p = NULL;
	const int rc = kvr_dev_alloc(t->dev, bytes, &p);
	cr_assert_eq(rc, 0, "alloc %zu bytes: %d: %s", bytes, rc, kvr_dev_last_error(t->dev));
	t->bufs[t->n_bufs++] = p;
	return p;
}

static void h2d(struct tdev *t, void *dst, const void *src, size_t bytes)
{
	const int rc = kvr_dev_memcpy_async(t->dev, dst, src, bytes, KVR_COPY_H2D, t->s);
	cr_assert_eq(rc, 0, "H2D: %d: %s", rc, kvr_dev_last_error(t->dev));
}

static void d2h(struct tdev *t, void *dst, const void *src, size_t bytes)
{
	const int rc = kvr_dev_memcpy_async(t->dev, dst, src, bytes, KVR_COPY_D2H, t->s);
	cr_assert_eq(rc, 0, "D2H: %d: %s", rc, kvr_dev_last_error(t->dev));
	cr_assert_eq(kvr_dev_stream_synchronize(t->dev, t->s), 0);
}

/* Device memory holding a copy of host bytes. */
static void *dput(struct tdev *t, const void *host, size_t bytes)
{
	void *p = dalloc(t, bytes);
	h2d(t, p, host, bytes);
	return p;
}

/* Deterministic floats in [-1, 1) (bytes / 4 of them) into host memory. */
static void fill(void *dst, size_t bytes, uint32_t seed)
{
	float *f = dst;
	uint32_t x = seed * 2654435761u + 1;
	for (size_t i = 0; i < bytes / 4; i++) {
		x = x * 1664525u + 1013904223u;
		f[i] = (float)(x >> 8) * 0x1p-23f - 1.0f;
	}
}

/* Device memory of `bytes` holding fill(seed). */
static void *drand(struct tdev *t, size_t bytes, uint32_t seed)
{
	void *h = malloc(bytes);
	cr_assert_not_null(h);
	fill(h, bytes, seed);
	void *p = dput(t, h, bytes);
	free(h);
	return p;
}

static unsigned violations(void)
{
	return kvr_cudaemu_strict_violations();
}

/* rc is -EFAULT, the message holds every needle, one more violation was
 * counted and the counter's message is the enqueue's. */
static void expect_fault(struct tdev *t, int rc, unsigned before, const char *n1, const char *n2)
{
	const char *msg = kvr_dev_last_error(t->dev);
	cr_assert_eq(rc, -EFAULT, "expected -EFAULT, got %d (%s)", rc, msg);
	cr_assert_not_null(strstr(msg, n1), "message lacks \"%s\": %s", n1, msg);
	if (n2)
		cr_assert_not_null(strstr(msg, n2), "message lacks \"%s\": %s", n2, msg);
	cr_assert_eq(violations(), before + 1, "violations %u, expected %u", violations(), before + 1);
	char last[256];
	kvr_cudaemu_strict_last_violation(last, sizeof(last));
	cr_assert_str_eq(last, msg);
}

static void expect_ok(struct tdev *t, int rc, const char *what)
{
	cr_assert_eq(rc, 0, "%s: %d: %s", what, rc, kvr_dev_last_error(t->dev));
}

/* ------------------------------------------------------------------ identity */

Test(cudaemu_strict, kind_name_and_visibility)
{
	cr_assert_eq(kvr_dev_kind_of(T.dev), KVR_DEV_CUDAEMU_STRICT);
	cr_assert_str_eq(kvr_dev_name(T.dev), "cudaemu-strict");
	cr_assert_eq(kvr_dev_host_visible(T.dev), 0);
	struct tdev plain = { 0 };
	tdev_open(&plain, KVR_DEV_CUDAEMU, NULL);
	cr_assert_eq(kvr_dev_kind_of(plain.dev), KVR_DEV_CUDAEMU);
	cr_assert_str_eq(kvr_dev_name(plain.dev), "cudaemu");
	cr_assert_eq(kvr_dev_host_visible(plain.dev), 1);
	tdev_close(&plain);
}

Test(cudaemu_strict, alloc_and_free)
{
	void *p = NULL;
	expect_ok(&T, kvr_dev_alloc(T.dev, 1000, &p), "alloc");
	cr_assert_eq((uintptr_t)p % 64, 0);
	char h[1000];
	fill(h, sizeof(h), 1);
	expect_ok(&T, kvr_dev_memcpy_async(T.dev, p, h, sizeof(h), KVR_COPY_H2D, T.s), "H2D");
	kvr_dev_free(T.dev, p);
	cr_assert_eq(violations(), 0);
	/* the freed range is no longer device memory */
	const int rc = kvr_dev_memcpy_async(T.dev, p, h, sizeof(h), KVR_COPY_H2D, T.s);
	expect_fault(&T, rc, 0, "dst", "freed device memory");
	/* freeing it again is a violation, not a double free */
	kvr_dev_free(T.dev, p);
	cr_assert_eq(violations(), 2);
	char last[256];
	kvr_cudaemu_strict_last_violation(last, sizeof(last));
	cr_assert_not_null(strstr(last, "not a device allocation"), "%s", last);
}

/* ------------------------------------------------------------------ attention */

/*
 * Two items over five segments: item 0 takes segments 0 and 1 (tokens 0..23
 * and 24..39 of buffer A), item 1 segments 2..4 (tokens 0..9 of buffer B, an
 * empty segment with NULL pointers, tokens 10..31 of B, which ends exactly
 * at B's end). NHD rows: row_stride n_kv·d, head_stride d.
 */
#define A_TOKENS 40
#define B_TOKENS 32
#define N_ITEMS 2
#define N_SEGS 5
#define Q_BYTES ((size_t)N_ITEMS * NQO * D * EB)
#define SENTINEL 0x5a

struct att {
	void *q, *out, *ka, *va, *kb, *vb;
	struct kvr_attention_item items[N_ITEMS]; /* host copies, device pointers */
	struct kvr_kv_segment segs[N_SEGS];
};

static struct kvr_kv_segment seg(const void *k, const void *v, uint32_t first, uint32_t n)
{
	const size_t at = (size_t)first * ROW * EB;
	return (struct kvr_kv_segment){ k ? (const char *)k + at : NULL,
					v ? (const char *)v + at : NULL, n, { ROW }, D, 0 };
}

static void att_setup(struct tdev *t, struct att *a)
{
	a->q = drand(t, Q_BYTES, 11);
	a->out = dalloc(t, Q_BYTES);
	a->ka = drand(t, (size_t)A_TOKENS * ROW * EB, 12);
	a->va = drand(t, (size_t)A_TOKENS * ROW * EB, 13);
	a->kb = drand(t, (size_t)B_TOKENS * ROW * EB, 14);
	a->vb = drand(t, (size_t)B_TOKENS * ROW * EB, 15);
	for (uint32_t i = 0; i < N_ITEMS; i++)
		a->items[i] = (struct kvr_attention_item){
			(const char *)a->q + (size_t)i * NQO * D * EB,
			(char *)a->out + (size_t)i * NQO * D * EB, NULL, i ? 2 : 0, i ? 3 : 2 };
	a->segs[0] = seg(a->ka, a->va, 0, 24);
	a->segs[1] = seg(a->ka, a->va, 24, 16);
	a->segs[2] = seg(a->kb, a->vb, 0, 10);
	a->segs[3] = seg(NULL, NULL, 0, 0);
	a->segs[4] = seg(a->kb, a->vb, 10, 22);
}

/* Fill the output with the sentinel, then launch with items and segments
 * copied to fresh device memory; returns the enqueue's result. */
static int att_launch(struct tdev *t, struct att *a, struct kvr_stream *s)
{
	unsigned char fillb[Q_BYTES];
	memset(fillb, SENTINEL, sizeof(fillb));
	h2d(t, a->out, fillb, sizeof(fillb));
	void *items = dput(t, a->items, sizeof(a->items));
	void *segs = dput(t, a->segs, sizeof(a->segs));
	cr_assert_eq(kvr_dev_stream_synchronize(t->dev, t->s), 0);
	return kvr_dev_attention(t->dev, &shape, items, N_ITEMS, segs, N_SEGS, s);
}

static void att_output(struct tdev *t, struct att *a, unsigned char *out)
{
	cr_assert_eq(kvr_dev_stream_synchronize(t->dev, t->w), 0);
	d2h(t, out, a->out, Q_BYTES);
}

/* A fresh attention setup and its correct output in ref: what a test
 * changes is then compared against it. */
static void att_good_run(struct tdev *t, struct att *a, unsigned char *ref)
{
	att_setup(t, a);
	expect_ok(t, att_launch(t, a, t->s), "attention");
	att_output(t, a, ref);
}

static void expect_untouched(const unsigned char *out)
{
	for (size_t i = 0; i < Q_BYTES; i++)
		cr_assert_eq(out[i], SENTINEL, "output byte %zu was written: the kernel ran", i);
}

/* The attention's output, read back, as the sentinels left it. */
static void expect_output_untouched(struct tdev *t, struct att *a)
{
	unsigned char out[Q_BYTES];
	att_output(t, a, out);
	expect_untouched(out);
}

static void expect_ran(const unsigned char *out)
{
	size_t same = 0;
	for (size_t i = 0; i < Q_BYTES; i++)
		same += out[i] == SENTINEL;
	cr_assert_lt(same, Q_BYTES / 8, "the output looks unwritten");
}

/* The attention output of a fresh device of `kind`. */
static void att_reference(uint32_t kind, unsigned char *out)
{
	struct tdev t = { 0 };
	tdev_open(&t, kind, NULL);
	struct att a;
	att_setup(&t, &a);
	expect_ok(&t, att_launch(&t, &a, t.s), "attention");
	att_output(&t, &a, out);
	cr_assert_eq(kvr_cudaemu_failed_launches(), 0);
	tdev_close(&t);
}

Test(cudaemu_strict, attention_in_device_memory_matches_cudaemu)
{
	static unsigned char strict_out[Q_BYTES], plain_out[Q_BYTES];
	att_reference(KVR_DEV_CUDAEMU_STRICT, strict_out);
	att_reference(KVR_DEV_CUDAEMU, plain_out);
	expect_ran(strict_out);
	cr_assert_eq(memcmp(strict_out, plain_out, Q_BYTES), 0,
		     "cudaemu-strict and cudaemu attention outputs differ");
	cr_assert_eq(violations(), 0);
}

Test(cudaemu_strict, attention_item_array_in_host_memory)
{
	struct att a;
	att_setup(&T, &a);
	expect_ok(&T, att_launch(&T, &a, T.s), "attention"); /* the good one first */
	unsigned char out[Q_BYTES];
	memset(out, SENTINEL, sizeof(out));
	h2d(&T, a.out, out, sizeof(out));
	void *segs = dput(&T, a.segs, sizeof(a.segs));
	struct kvr_attention_item *items = malloc(sizeof(a.items));
	cr_assert_not_null(items);
	memcpy(items, a.items, sizeof(a.items));
	const int rc = kvr_dev_attention(T.dev, &shape, items, N_ITEMS, segs, N_SEGS, T.s);
	expect_fault(&T, rc, 0, "attention: items", "not device memory");
	att_output(&T, &a, out);
	expect_untouched(out);
	/* the segment array too */
	void *items_d = dput(&T, a.items, sizeof(a.items));
	const int rc2 = kvr_dev_attention(T.dev, &shape, items_d, N_ITEMS, a.segs, N_SEGS, T.s);
	expect_fault(&T, rc2, 1, "attention: segments", "not device memory");
	free(items);
}

Test(cudaemu_strict, attention_segment_k_in_host_memory)
{
	struct att a;
	att_setup(&T, &a);
	float *host_k = aligned_alloc(64, (size_t)A_TOKENS * ROW * EB);
	cr_assert_not_null(host_k);
	fill(host_k, (size_t)A_TOKENS * ROW * EB, 12);
	a.segs[1].k = host_k + (size_t)24 * ROW;
	const int rc = att_launch(&T, &a, T.s);
	expect_fault(&T, rc, 0, "attention: segment 1 k",
		     "is neither device memory nor registered host memory");
	expect_output_untouched(&T, &a);
	free(host_k);
}

Test(cudaemu_strict, attention_segment_past_its_allocation)
{
	struct att a;
	att_setup(&T, &a);
	a.segs[4].n_tokens++; /* one row past the end of B */
	const int rc = att_launch(&T, &a, T.s);
	expect_fault(&T, rc, 0, "attention: segment 4 k",
		     "runs past the end of its device allocation");
	expect_output_untouched(&T, &a);
	/* V alone past its end */
	att_setup(&T, &a);
	a.segs[4].v = (const char *)a.segs[4].v + EB;
	expect_fault(&T, att_launch(&T, &a, T.s), 1, "attention: segment 4 v", "runs past the end");
}

Test(cudaemu_strict, attention_segment_in_freed_memory)
{
	struct att a;
	att_setup(&T, &a);
	void *kc = NULL;
	expect_ok(&T, kvr_dev_alloc(T.dev, (size_t)B_TOKENS * ROW * EB, &kc), "alloc");
	a.segs[2].k = kc;
	kvr_dev_free(T.dev, kc);
	const int rc = att_launch(&T, &a, T.s);
	expect_fault(&T, rc, 0, "attention: segment 2 k", "freed device memory");
	expect_output_untouched(&T, &a);
}

Test(cudaemu_strict, attention_item_segments_past_the_list)
{
	struct att a;
	att_setup(&T, &a);
	a.items[1].n_segments = 4; /* segments 2..5 of 5 */
	expect_fault(&T, att_launch(&T, &a, T.s), 0, "attention: item 1 segments [2, 6)",
		     "the call's 5 segments");
	/* an item without segments reads none, whatever first_segment says */
	att_setup(&T, &a);
	a.items[1].first_segment = 1000;
	a.items[1].n_segments = 0;
	expect_ok(&T, att_launch(&T, &a, T.s), "attention with an empty item");
}

Test(cudaemu_strict, attention_item_array_too_short)
{
	struct att a;
	att_setup(&T, &a);
	void *items = dput(&T, a.items, sizeof(a.items[0])); /* room for one item of two */
	void *segs = dput(&T, a.segs, sizeof(a.segs));
	const int rc = kvr_dev_attention(T.dev, &shape, items, N_ITEMS, segs, N_SEGS, T.s);
	expect_fault(&T, rc, 0, "attention: items", "runs past the end");
}

Test(cudaemu_strict, registered_host_memory_is_kernel_data_not_items)
{
	static unsigned char dev_out[Q_BYTES], host_out[Q_BYTES];
	struct att a;
	att_good_run(&T, &a, dev_out);

	/* B's keys and values from pinned, mapped host memory */
	const size_t b_bytes = (size_t)B_TOKENS * ROW * EB;
	unsigned char *hb = aligned_alloc(64, 2 * b_bytes);
	cr_assert_not_null(hb);
	fill(hb, b_bytes, 14);
	fill(hb + b_bytes, b_bytes, 15);
	expect_ok(&T, kvr_dev_host_register(T.dev, hb, 2 * b_bytes), "host_register");
	a.segs[2] = seg(hb, hb + b_bytes, 0, 10);
	a.segs[4] = seg(hb, hb + b_bytes, 10, 22);
	expect_ok(&T, att_launch(&T, &a, T.s), "attention over registered host memory");
	att_output(&T, &a, host_out);
	cr_assert_eq(memcmp(dev_out, host_out, Q_BYTES), 0);

	/* registering twice, or device memory, fails as cudaHostRegister does */
	cr_assert_eq(kvr_dev_host_register(T.dev, hb + 64, 64), -EEXIST);
	cr_assert_eq(kvr_dev_host_register(T.dev, a.ka, 64), -EINVAL);

	/* an item array there is not device memory */
	struct kvr_attention_item *items = (struct kvr_attention_item *)(hb + b_bytes);
	void *segs = dput(&T, a.segs, sizeof(a.segs));
	memcpy(items, a.items, sizeof(a.items));
	int rc = kvr_dev_attention(T.dev, &shape, items, N_ITEMS, segs, N_SEGS, T.s);
	expect_fault(&T, rc, 0, "attention: items", "registered host memory, not device memory");

	/* unregistered, the same segments fail */
	expect_ok(&T, kvr_dev_host_unregister(T.dev, hb), "host_unregister");
	cr_assert_eq(kvr_dev_host_unregister(T.dev, hb), -EINVAL);
	fill(hb + b_bytes, b_bytes, 15);
	expect_fault(&T, att_launch(&T, &a, T.s), 1, "attention: segment 2 k", "neither");
	free(hb);
}

/* ------------------------------------------------------------------ worker streams */

/* The item array is filled by an H2D copy queued on the worker stream behind
 * a stall: at enqueue it still holds garbage, so only a check made when the
 * worker runs the kernel can pass. */
Test(cudaemu_strict, worker_stream_checks_items_when_run)
{
	static unsigned char ref[Q_BYTES], out[Q_BYTES];
	struct att a;
	att_good_run(&T, &a, ref);

	const size_t stall = (size_t)16 << 20;
	void *s0 = dalloc(&T, stall), *s1 = dalloc(&T, stall);
	void *items = dalloc(&T, sizeof(a.items)), *segs = dalloc(&T, sizeof(a.segs));
	unsigned char junk[sizeof(a.segs)];
	memset(junk, 0xa5, sizeof(junk));
	h2d(&T, items, junk, sizeof(a.items));
	h2d(&T, segs, junk, sizeof(a.segs));
	memset(out, SENTINEL, sizeof(out));
	h2d(&T, a.out, out, sizeof(out));
	cr_assert_eq(kvr_dev_stream_synchronize(T.dev, T.s), 0);
	for (int i = 0; i < 4; i++)
		expect_ok(&T, kvr_dev_memcpy_async(T.dev, i & 1 ? s0 : s1, i & 1 ? s1 : s0, stall,
						   KVR_COPY_D2D, T.w), "stall");
	expect_ok(&T, kvr_dev_memcpy_async(T.dev, items, a.items, sizeof(a.items), KVR_COPY_H2D, T.w),
		  "items H2D");
	expect_ok(&T, kvr_dev_memcpy_async(T.dev, segs, a.segs, sizeof(a.segs), KVR_COPY_H2D, T.w),
		  "segments H2D");
	expect_ok(&T, kvr_dev_attention(T.dev, &shape, items, N_ITEMS, segs, N_SEGS, T.w),
		  "attention on the worker stream");
	att_output(&T, &a, out);
	cr_assert_eq(memcmp(out, ref, Q_BYTES), 0, "the worker stream's output differs");
	cr_assert_eq(violations(), 0);

	/* a bad segment there: the enqueue succeeds, the kernel is skipped */
	float *host_k = aligned_alloc(64, (size_t)A_TOKENS * ROW * EB);
	cr_assert_not_null(host_k);
	a.segs[1].k = host_k;
	memset(out, SENTINEL, sizeof(out));
	h2d(&T, a.out, out, sizeof(out));
	cr_assert_eq(kvr_dev_stream_synchronize(T.dev, T.s), 0);
	expect_ok(&T, kvr_dev_memcpy_async(T.dev, segs, a.segs, sizeof(a.segs), KVR_COPY_H2D, T.w),
		  "segments H2D");
	expect_ok(&T, kvr_dev_attention(T.dev, &shape, items, N_ITEMS, segs, N_SEGS, T.w),
		  "attention on the worker stream");
	att_output(&T, &a, out);
	expect_untouched(out);
	cr_assert_eq(violations(), 1);
	char last[256];
	kvr_cudaemu_strict_last_violation(last, sizeof(last));
	cr_assert_not_null(strstr(last, "attention: segment 1 k"), "%s", last);
	cr_assert_not_null(strstr(last, "worker stream"), "%s", last);

	/* the item array's place is known at enqueue: refused there */
	const int rc = kvr_dev_attention(T.dev, &shape, a.items, N_ITEMS, segs, N_SEGS, T.w);
	expect_fault(&T, rc, 1, "attention: items", "not device memory");
	free(host_k);
}

/* ------------------------------------------------------------------ the other kernels */

/*
 * Each kernel with every buffer exactly the extent the validator computes:
 * it passes (and, under ASan, the kernel touches nothing beyond); then one
 * buffer one element short fails naming it. Items and pointers the kernel
 * does not touch are NULL.
 */

static void *items_of(const void *host, size_t bytes)
{
	return dput(&T, host, bytes);
}

static void sync_clean(void)
{
	cr_assert_eq(kvr_dev_stream_synchronize(T.dev, T.s), 0);
	cr_assert_eq(kvr_cudaemu_failed_launches(), 0);
}

Test(cudaemu_strict, scatter_extents)
{
	const size_t run = 2ull * P * D * EB, tile = (size_t)P * ROW * EB;
	void *r0 = drand(&T, run, 1), *r1 = drand(&T, run, 2);
	void *kt = dalloc(&T, tile), *vt = dalloc(&T, tile);
	struct kvr_scatter_item it[3] = {
		{ r0, kt, vt, 0, 0 },
		{ r1, kt, vt, NKV - 1, 0 }, /* the last column: ends at the tile's end */
		{ NULL, NULL, NULL, NKV, 0 }, /* out of range: the kernel skips it */
	};
	expect_ok(&T, kvr_dev_scatter(T.dev, &shape, items_of(it, sizeof(it)), 3, T.s), "scatter");
	sync_clean();
	it[1].v_tile = dalloc(&T, tile - EB);
	const int rc = kvr_dev_scatter(T.dev, &shape, items_of(it, sizeof(it)), 3, T.s);
	expect_fault(&T, rc, 0, "scatter: item 1 v_tile", "runs past the end");
}

Test(cudaemu_strict, offload_and_summarize_extents)
{
	const uint32_t rs = 3 * D; /* rows wider than n_kv·d */
	const size_t rows = ((size_t)(P - 1) * rs + ROW) * EB;
	const size_t page = 2ull * NKV * P * D * EB, summary = 2ull * NKV * D * EB;
	struct kvr_page_item it = { drand(&T, rows, 1), drand(&T, rows, 2), dalloc(&T, page), NULL,
				    rs, 0 };
	struct kvr_page_item sit = { it.k_rows, NULL, NULL, dalloc(&T, summary), rs, 0 };
#define OFFLOAD(item) kvr_dev_offload(T.dev, &shape, items_of(&(item), sizeof(item)), 1, T.s)
#define SUMMARIZE(item) kvr_dev_summarize(T.dev, &shape, items_of(&(item), sizeof(item)), 1, T.s)
	expect_ok(&T, OFFLOAD(it), "offload");
	expect_ok(&T, SUMMARIZE(sit), "summarize");
	sync_clean();

	/* each buffer one element short, in turn */
	it.hnd_page = dalloc(&T, page - EB);
	expect_fault(&T, OFFLOAD(it), 0, "offload: item 0 hnd_page", "runs past the end");
	it.hnd_page = dalloc(&T, page);
	it.v_rows = dalloc(&T, rows - EB);
	expect_fault(&T, OFFLOAD(it), 1, "offload: item 0 v_rows", "runs past the end");
	sit.summary = dalloc(&T, summary - EB);
	expect_fault(&T, SUMMARIZE(sit), 2, "summarize: item 0 summary", "runs past the end");
	sit.summary = dalloc(&T, summary);
	sit.k_rows = dalloc(&T, rows - EB);
	expect_fault(&T, SUMMARIZE(sit), 3, "summarize: item 0 k_rows", "runs past the end");
#undef OFFLOAD
#undef SUMMARIZE
}

/* A plan item over a list of n_head + k + n_tail segments, pages [0, 4)
 * takeable (page_addr: 4 entries), the correction's selection used: every
 * pointer in device memory, each exactly as long as the validator says. */
static struct kvr_plan_item plan_item(uint32_t n_head, uint32_t n_tail, uint32_t k)
{
	const uint64_t addr[4] = { 0, 0, 0, 0 };
	int32_t sel[8], now[8];
	for (uint32_t j = 0; j < k; j++)
		sel[j] = (int32_t)j, now[j] = (int32_t)(3 - j);
	const uint8_t flag = 1;
	struct kvr_attention_item at = { 0 };
	return (struct kvr_plan_item){ .attention = dput(&T, &at, sizeof(at)),
				       .segments = dalloc(&T, (n_head + k + n_tail) * sizeof(struct kvr_kv_segment)),
				       .selected = dput(&T, sel, k * sizeof(int32_t)),
				       .corrected_sel = dput(&T, now, k * sizeof(int32_t)),
				       .corrected = dput(&T, &flag, 1),
				       .page_addr = dput(&T, addr, sizeof(addr)),
				       .v_offset = UINT64_MAX,
				       .n_head = n_head, .n_tail = n_tail, .k = k,
				       .sel_begin = 1, .sel_end = 4, .addr_end = 4, .seg_tokens = P };
}

Test(cudaemu_strict, plan_extents)
{
#define PLAN(item) kvr_dev_plan(T.dev, &shape, items_of(&(item), sizeof(item)), 1, T.s)
	struct kvr_plan_item it = plan_item(2, 3, 2);
	expect_ok(&T, PLAN(it), "plan");
	sync_clean();
	/* the correction's pages 3 and 2, behind the 2 head segments, then the
	 * 3 tail segments moved up: 7 in all */
	struct kvr_attention_item at;
	d2h(&T, &at, it.attention, sizeof(at));
	cr_assert_eq(at.n_segments, 7);
	struct kvr_plan_item bad = it;
	bad.segments = dalloc(&T, 7 * sizeof(struct kvr_kv_segment) - 1);
	expect_fault(&T, PLAN(bad), 0, "plan: item 0 segments", "runs past the end");
	bad = it;
	bad.page_addr = dalloc(&T, 4 * 8 - 1);
	expect_fault(&T, PLAN(bad), 1, "plan: item 0 page_addr", "runs past the end");
	bad = it;
	bad.corrected_sel = dalloc(&T, 2 * 4 - 1);
	expect_fault(&T, PLAN(bad), 2, "plan: item 0 corrected_sel", "runs past the end");
	bad = it;
	bad.attention = dalloc(&T, sizeof(struct kvr_attention_item) - 1);
	expect_fault(&T, PLAN(bad), 3, "plan: item 0 attention", "runs past the end");
	/* selections in host memory: not kernel data */
	int32_t host_sel[2] = { 1, 2 };
	bad = it;
	bad.selected = host_sel;
	expect_fault(&T, PLAN(bad), 4, "plan: item 0 selected", "neither device memory");
#undef PLAN
}

/* append reads the token's row and writes it into its row of the tile; a
 * token that completes the page also reads the whole tile and writes the
 * page and its summary. */
Test(cudaemu_strict, append_extents)
{
#define APPEND(item) kvr_dev_append(T.dev, &shape, items_of(&(item), sizeof(item)), 1, T.s)
	const size_t row = (size_t)ROW * EB, page = 2ull * NKV * P * D * EB;
	/* row 3 of a tile that holds 4 rows: enough while no page completes */
	struct kvr_append_item it = { drand(&T, row, 1), drand(&T, row, 2), dalloc(&T, 4 * row),
				      dalloc(&T, 4 * row), NULL, NULL, 3, ROW, 0, 0 };
	expect_ok(&T, APPEND(it), "append");
	struct kvr_append_item bad = it;
	bad.row = 4;
	expect_fault(&T, APPEND(bad), 0, "append: item 0 k_tile", "runs past the end");
	/* the last row completes the page: the whole tile, the page, the summary */
	struct kvr_append_item full = { it.k_row, it.v_row, dalloc(&T, P * row), dalloc(&T, P * row),
					dalloc(&T, page), dalloc(&T, 2ull * NKV * D * EB), P - 1, ROW, 0, 0 };
	expect_ok(&T, APPEND(full), "append (a page completes)");
	bad = full;
	bad.v_tile = dalloc(&T, P * row - 1);
	expect_fault(&T, APPEND(bad), 1, "append: item 0 v_tile", "runs past the end");
	bad = full;
	bad.hnd_page = dalloc(&T, page - 1);
	expect_fault(&T, APPEND(bad), 2, "append: item 0 hnd_page", "runs past the end");
	bad = full;
	bad.summary = dalloc(&T, 2ull * NKV * D * EB - 1);
	expect_fault(&T, APPEND(bad), 3, "append: item 0 summary", "runs past the end");
	/* the engine's k in host memory: not kernel data */
	float host_k[ROW] = { 0 };
	bad = it;
	bad.k_row = host_k;
	expect_fault(&T, APPEND(bad), 4, "append: item 0 k_row", "neither device memory");
	/* a row past the page: the kernel skips the item, nothing is checked */
	bad = it;
	bad.row = P;
	bad.k_tile = host_k;
	expect_ok(&T, APPEND(bad), "append (row past the page)");
#undef APPEND
}

Test(cudaemu_strict, score_and_select_extents)
{
	/* candidates [3, 19): the summaries from page 3 to the end of page 18 */
	const uint32_t begin = 3, end = 19, n_cand = end - begin, k = 4;
	const size_t page = 2ull * NKV * D * EB;
	void *q = drand(&T, (size_t)NQO * D * EB, 1);
	void *sums = drand(&T, end * page, 2);
	float *scores = dalloc(&T, (size_t)NKV * n_cand * sizeof(float));
	int32_t *sel = dalloc(&T, (size_t)NKV * k * sizeof(int32_t));
	int32_t *sel2 = dalloc(&T, (size_t)NKV * 2 * sizeof(int32_t));
	struct kvr_score_item it[3] = {
		{ q, sums, scores, NULL, begin, end, k, 0, NULL },
		{ NULL, NULL, NULL, NULL, 7, 7, 0, 0, NULL },  /* no candidates, k = 0: nothing */
		{ NULL, NULL, NULL, sel2, 5, 5, 2, 0, NULL }, /* no candidates, k = 2: -1s only */
	};
	expect_ok(&T, kvr_dev_score(T.dev, &shape, items_of(it, sizeof(it)), 3, T.s), "score");
	it[0].q = NULL; /* select reads neither q nor summaries */
	it[0].summaries = NULL;
	it[0].selected = sel;
	expect_ok(&T, kvr_dev_select(T.dev, &shape, items_of(it, sizeof(it)), 3, T.s), "select");
	sync_clean();
	int32_t picked[NKV * 2];
	d2h(&T, picked, sel2, sizeof(picked));
	for (int i = 0; i < NKV * 2; i++)
		cr_assert_eq(picked[i], -1);

	it[0].selected = dalloc(&T, (size_t)NKV * k * sizeof(int32_t) - 4);
	expect_fault(&T, kvr_dev_select(T.dev, &shape, items_of(it, sizeof(it)), 3, T.s), 0,
		     "select: item 0 selected", "runs past the end");
	it[0].q = q;
	it[0].summaries = dalloc(&T, end * page - EB);
	expect_fault(&T, kvr_dev_score(T.dev, &shape, items_of(it, sizeof(it)), 3, T.s), 1,
		     "score: item 0 summaries", "runs past the end");
	it[0].summaries = sums;
	it[0].scores = dalloc(&T, (size_t)NKV * n_cand * sizeof(float) - 4);
	expect_fault(&T, kvr_dev_score(T.dev, &shape, items_of(it, sizeof(it)), 3, T.s), 2,
		     "score: item 0 scores", "runs past the end");
	/* a softmax over every page up to norm_end reads the summaries from page
	 * 0 to there, past the candidates */
	it[0].scores = scores;
	it[0].norm_end = end + 2;
	expect_fault(&T, kvr_dev_score(T.dev, &shape, items_of(it, sizeof(it)), 3, T.s), 3,
		     "score: item 0 summaries", "runs past the end");
	it[0].summaries = drand(&T, (end + 2) * page, 3);
	expect_ok(&T, kvr_dev_score(T.dev, &shape, items_of(it, sizeof(it)), 3, T.s),
		  "score over every page");
}

Test(cudaemu_strict, similarity_extents)
{
	const size_t qb = (size_t)NQO * D * EB;
	struct kvr_similarity_item it = { drand(&T, qb, 1), drand(&T, qb, 2),
					  dalloc(&T, NKV * sizeof(float)), dalloc(&T, NKV) };
	expect_ok(&T, kvr_dev_similarity(T.dev, &shape, items_of(&it, sizeof(it)), 1, T.s),
		  "similarity");
	sync_clean();
	it.corrected = dalloc(&T, NKV - 1);
	expect_fault(&T, kvr_dev_similarity(T.dev, &shape, items_of(&it, sizeof(it)), 1, T.s), 0,
		     "similarity: item 0 corrected", "runs past the end");
	it.corrected = NULL;
	expect_fault(&T, kvr_dev_similarity(T.dev, &shape, items_of(&it, sizeof(it)), 1, T.s), 1,
		     "similarity: item 0 corrected", "neither");
}

Test(cudaemu_strict, dense_extents)
{
	const uint32_t n_tokens = 20;
	const size_t qb = (size_t)NQO * D * EB, kv = (size_t)n_tokens * ROW * EB;
	struct kvr_dense_item it[2] = {
		{ drand(&T, qb, 1), drand(&T, kv, 2), drand(&T, kv, 3), dalloc(&T, qb), n_tokens, ROW },
		{ drand(&T, qb, 4), NULL, NULL, dalloc(&T, qb), 0, ROW }, /* no tokens: zeros */
	};
	expect_ok(&T, kvr_dev_dense(T.dev, &shape, items_of(it, sizeof(it)), 2, T.s), "dense");
	sync_clean();
	it[0].v = dalloc(&T, kv - EB);
	expect_fault(&T, kvr_dev_dense(T.dev, &shape, items_of(it, sizeof(it)), 2, T.s), 0,
		     "dense: item 0 v", "runs past the end");
	it[0].v = it[0].k;
	it[1].out = dalloc(&T, qb - EB);
	expect_fault(&T, kvr_dev_dense(T.dev, &shape, items_of(it, sizeof(it)), 2, T.s), 1,
		     "dense: item 1 out", "runs past the end");
}

/* ------------------------------------------------------------------ coverage */

/*
 * One legal call of every kernel, each reaching every check its items have
 * (a scatter item in range, candidates to score, tokens to attend, segment
 * LSEs asked for): afterwards every item pointer field gpu/kernels.h lists
 * must have been named by an extent check. A field added there without a
 * check in gpu/cudaemu/backend.c fails here.
 */
Test(cudaemu_strict, every_item_pointer_field_has_an_extent_check)
{
	const size_t run = 2ull * P * D * EB, tile = (size_t)P * ROW * EB, qb = (size_t)NQO * D * EB;
	struct kvr_scatter_item sc = { drand(&T, run, 1), dalloc(&T, tile), dalloc(&T, tile), 0, 0 };
	expect_ok(&T, kvr_dev_scatter(T.dev, &shape, items_of(&sc, sizeof(sc)), 1, T.s), "scatter");

	const size_t rows = (size_t)P * ROW * EB, page = 2ull * NKV * P * D * EB;
	struct kvr_page_item pg = { drand(&T, rows, 2), drand(&T, rows, 3), dalloc(&T, page),
				    dalloc(&T, 2ull * NKV * D * EB), ROW, 0 };
	expect_ok(&T, kvr_dev_offload(T.dev, &shape, items_of(&pg, sizeof(pg)), 1, T.s), "offload");
	expect_ok(&T, kvr_dev_summarize(T.dev, &shape, items_of(&pg, sizeof(pg)), 1, T.s), "summarize");
	/* the last row: the page completes (every field read) */
	struct kvr_append_item ap = { drand(&T, (size_t)ROW * EB, 12), drand(&T, (size_t)ROW * EB, 13),
				      dalloc(&T, rows), dalloc(&T, rows), dalloc(&T, page),
				      dalloc(&T, 2ull * NKV * D * EB), P - 1, ROW, 0, 0 };
	expect_ok(&T, kvr_dev_append(T.dev, &shape, items_of(&ap, sizeof(ap)), 1, T.s), "append");

	const uint32_t n_pages = 8, k = 2;
	struct kvr_score_item so = { drand(&T, qb, 4), drand(&T, n_pages * 2ull * NKV * D * EB, 5),
				     dalloc(&T, (size_t)NKV * n_pages * sizeof(float)),
				     dalloc(&T, (size_t)NKV * k * sizeof(int32_t)), 0, n_pages, k, 0, NULL };
	expect_ok(&T, kvr_dev_score(T.dev, &shape, items_of(&so, sizeof(so)), 1, T.s), "score");
	expect_ok(&T, kvr_dev_select(T.dev, &shape, items_of(&so, sizeof(so)), 1, T.s), "select");

	struct kvr_similarity_item si = { drand(&T, qb, 6), drand(&T, qb, 7),
					  dalloc(&T, NKV * sizeof(float)), dalloc(&T, NKV) };
	expect_ok(&T, kvr_dev_similarity(T.dev, &shape, items_of(&si, sizeof(si)), 1, T.s),
		  "similarity");

	struct kvr_shape lse_shape = shape;
	lse_shape.flags |= KVR_SHAPE_SEGMENT_LSE;
	const uint32_t n_tokens = 20;
	const size_t kv = (size_t)n_tokens * ROW * EB;
	struct kvr_kv_segment sg = { drand(&T, kv, 8), drand(&T, kv, 9), n_tokens, { ROW }, D, 0 };
	struct kvr_attention_item at = { drand(&T, qb, 10), dalloc(&T, qb), dalloc(&T, NQO * sizeof(float)),
					 0, 1 };
	expect_ok(&T, kvr_dev_attention(T.dev, &lse_shape, items_of(&at, sizeof(at)), 1,
					items_of(&sg, sizeof(sg)), 1, T.s),
		  "attention");

	struct kvr_dense_item de = { drand(&T, qb, 11), drand(&T, kv, 12), drand(&T, kv, 13), dalloc(&T, qb),
				     n_tokens, ROW };
	expect_ok(&T, kvr_dev_dense(T.dev, &shape, items_of(&de, sizeof(de)), 1, T.s), "dense");

	/* a free round of one unit returning nothing, on an empty list of 4 ids */
	const uint64_t counters[2] = { 0, 0 };
	const uint32_t count0 = 0;
	struct kvr_freelist_item fl = { dalloc(&T, 4 * sizeof(uint32_t)), dput(&T, counters, sizeof(counters)),
					dput(&T, &count0, sizeof(count0)), dalloc(&T, sizeof(uint64_t)),
					dalloc(&T, 4 * sizeof(uint32_t)), dalloc(&T, sizeof(int32_t)),
					4, 1, KVR_FREELIST_FREE, 4 };
	expect_ok(&T, kvr_dev_freelist(T.dev, items_of(&fl, sizeof(fl)), 1, T.s), "freelist");

	/* a gated score and select (one head flagged) */
	const uint8_t flags[NKV] = { 0, 1 };
	so.gate = dput(&T, flags, sizeof(flags));
	expect_ok(&T, kvr_dev_score(T.dev, &shape, items_of(&so, sizeof(so)), 1, T.s), "gated score");
	expect_ok(&T, kvr_dev_select(T.dev, &shape, items_of(&so, sizeof(so)), 1, T.s), "gated select");

	/* a plan taking one of two pages, the correction's */
	struct kvr_plan_item pl = plan_item(1, 1, 2);
	expect_ok(&T, kvr_dev_plan(T.dev, &shape, items_of(&pl, sizeof(pl)), 1, T.s), "plan");
	sync_clean();
	cr_assert_eq(violations(), 0);

	char unchecked[512];
	const uint32_t n = kvr_cudaemu_strict_unchecked_fields(unchecked, sizeof(unchecked));
	cr_assert_eq(n, 0, "item pointer fields no extent check names: %s", unchecked);
}

/* ------------------------------------------------------------------ copies */

Test(cudaemu_strict, copy_directions)
{
	const size_t n = 4096;
	unsigned char *h = malloc(n), *h2 = malloc(n);
	cr_assert(h && h2);
	fill(h, n, 3);
	void *d = dalloc(&T, n), *d2 = dalloc(&T, n);
	expect_ok(&T, kvr_dev_memcpy_async(T.dev, d, h, n, KVR_COPY_H2D, T.s), "H2D");
	expect_ok(&T, kvr_dev_memcpy_async(T.dev, d2, d, n, KVR_COPY_D2D, T.s), "D2D");
	expect_ok(&T, kvr_dev_memcpy_async(T.dev, h2, d2, n, KVR_COPY_D2H, T.s), "D2H");
	cr_assert_eq(memcmp(h, h2, n), 0);
	cr_assert_eq(violations(), 0);

	unsigned v = 0;
	expect_fault(&T, kvr_dev_memcpy_async(T.dev, h2, h, n, KVR_COPY_H2D, T.s), v++,
		     "memcpy_async (H2D): dst", "not device memory");
	expect_fault(&T, kvr_dev_memcpy_async(T.dev, d, d2, n, KVR_COPY_H2D, T.s), v++,
		     "memcpy_async (H2D): src", "is device memory");
	expect_fault(&T, kvr_dev_memcpy_async(T.dev, (char *)d + 64, h, n, KVR_COPY_H2D, T.s), v++,
		     "memcpy_async (H2D): dst", "runs past the end");
	expect_fault(&T, kvr_dev_memcpy_async(T.dev, h2, h, n, KVR_COPY_D2H, T.s), v++,
		     "memcpy_async (D2H): src", "not device memory");
	expect_fault(&T, kvr_dev_memcpy_async(T.dev, d2, d, n, KVR_COPY_D2H, T.s), v++,
		     "memcpy_async (D2H): dst", "is device memory");
	expect_fault(&T, kvr_dev_memcpy_async(T.dev, d, h, n, KVR_COPY_D2D, T.s), v++,
		     "memcpy_async (D2D): src", "not device memory");
	expect_fault(&T, kvr_dev_memcpy_async(T.dev, h2, d, n, KVR_COPY_D2D, T.s), v++,
		     "memcpy_async (D2D): dst", "not device memory");
	/* a host range that only ends inside device memory still overlaps it */
	expect_fault(&T, kvr_dev_memcpy_async(T.dev, d2, (char *)d - 16, 32, KVR_COPY_H2D, T.s), v++,
		     "memcpy_async (H2D): src", "is device memory");

	/* registered host memory is host memory: a source, never a device side */
	expect_ok(&T, kvr_dev_host_register(T.dev, h, n), "host_register");
	expect_ok(&T, kvr_dev_memcpy_async(T.dev, d, h, n, KVR_COPY_H2D, T.s), "H2D from pinned");
	expect_ok(&T, kvr_dev_memcpy_async(T.dev, h, d, n, KVR_COPY_D2H, T.s), "D2H to pinned");
	expect_fault(&T, kvr_dev_memcpy_async(T.dev, h, h2, n, KVR_COPY_H2D, T.s), v++,
		     "memcpy_async (H2D): dst", "registered host memory, not device memory");
	expect_ok(&T, kvr_dev_host_unregister(T.dev, h), "host_unregister");

	/* the copies that failed wrote nothing */
	cr_assert_eq(kvr_dev_stream_synchronize(T.dev, T.s), 0);
	cr_assert_eq(memcmp(h, h2, n), 0);
	free(h);
	free(h2);
}

Test(cudaemu_strict, batch_copy_descriptors)
{
	const size_t n = 4096;
	unsigned char *h = malloc(n);
	cr_assert_not_null(h);
	fill(h, n, 4);
	void *d = dalloc(&T, n);
	struct kvr_copy_desc descs[4] = {
		{ 0, 0, 1024 },
		{ 1024, 1024, 1024 },
		{ 2048, 2048, 2048 },          /* ends exactly at the end */
		{ 2 * n, 2 * n, 0 },           /* empty: touches nothing */
	};
	expect_ok(&T, kvr_dev_memcpy_batch_async(T.dev, d, h, descs, 4, KVR_COPY_H2D, T.s), "batch");
	descs[2].dst_offset = 2112; /* 64 bytes past the end */
	expect_fault(&T, kvr_dev_memcpy_batch_async(T.dev, d, h, descs, 4, KVR_COPY_H2D, T.s), 0,
		     "memcpy_batch_async (H2D): descriptor 2 dst", "runs past the end");
	descs[2].dst_offset = 2048;
	unsigned char *back = malloc(n);
	cr_assert_not_null(back);
	expect_ok(&T, kvr_dev_memcpy_batch_async(T.dev, back, d, descs, 4, KVR_COPY_D2H, T.s),
		  "batch D2H");
	cr_assert_eq(kvr_dev_stream_synchronize(T.dev, T.s), 0);
	cr_assert_eq(memcmp(h, back, n), 0);
	expect_fault(&T, kvr_dev_memcpy_batch_async(T.dev, back, h, descs, 4, KVR_COPY_D2H, T.s), 1,
		     "memcpy_batch_async (D2H): descriptor 0 src", "not device memory");
	free(h);
	free(back);
}

/* ------------------------------------------------------------------ engine allocator */

struct engine_alloc {
	unsigned allocs, frees;
};

static int engine_alloc_fn(void *user, size_t bytes, void **ptr)
{
	struct engine_alloc *e = user;
	*ptr = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
	e->allocs += *ptr != NULL;
	return *ptr ? 0 : -ENOMEM;
}

static void engine_free_fn(void *user, void *ptr)
{
	struct engine_alloc *e = user;
	e->frees++;
	free(ptr);
}

Test(cudaemu_strict, engine_allocator_is_tracked)
{
	struct engine_alloc e = { 0, 0 };
	const struct kvr_dev_params params = { .alloc_fn = engine_alloc_fn, .free_fn = engine_free_fn,
					       .alloc_user = &e };
	struct tdev t = { 0 };
	tdev_open(&t, KVR_DEV_CUDAEMU_STRICT, &params);

	/* attention entirely in the engine's memory */
	struct att a;
	att_setup(&t, &a);
	cr_assert_eq(e.allocs, 6);
	expect_ok(&t, att_launch(&t, &a, t.s), "attention in engine memory");
	unsigned char out[Q_BYTES];
	att_output(&t, &a, out);
	expect_ran(out);

	/* memory from the same allocator, not through kvr_dev_alloc, is not
	 * device memory */
	void *side = NULL;
	cr_assert_eq(engine_alloc_fn(&e, 4096, &side), 0);
	unsigned char h[4096] = { 0 };
	expect_fault(&t, kvr_dev_memcpy_async(t.dev, side, h, sizeof(h), KVR_COPY_H2D, t.s), 0,
		     "memcpy_async (H2D): dst", "not device memory");
	engine_free_fn(&e, side);

	/* freed through kvr_dev_free: the engine's free ran, the range is gone */
	void *p = NULL;
	expect_ok(&t, kvr_dev_alloc(t.dev, 4096, &p), "alloc");
	expect_ok(&t, kvr_dev_memcpy_async(t.dev, p, h, sizeof(h), KVR_COPY_H2D, t.s), "H2D");
	const unsigned frees = e.frees;
	kvr_dev_free(t.dev, p);
	cr_assert_eq(e.frees, frees + 1);
	expect_fault(&t, kvr_dev_memcpy_async(t.dev, p, h, sizeof(h), KVR_COPY_H2D, t.s), 1,
		     "memcpy_async (H2D): dst", "freed device memory");
	cr_assert_eq(violations(), 2);
	tdev_close(&t);
	cr_assert_eq(e.frees, e.allocs, "every engine allocation was freed");
}
