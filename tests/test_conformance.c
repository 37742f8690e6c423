/* SPDX-License-Identifier: MIT */
/*
 * test_conformance.c — the conformance suite: every operation of
 * gpu/backend.h, on randomised inputs from fixed seeds, against the scalar
 * reference of reference.c, on every backend: cpu, cuda and cudaemu (the
 * latter under two thread orders). A backend whose kvr_dev_create returns
 * -ENODEV is skipped with the reason, never passed.
 *
 * Each test runs through the device contract only: inputs are copied to
 * kvr_dev_alloc memory with kvr_dev_memcpy_async, item arrays (and every
 * pointer inside them) live in device memory, results come back D2H after a
 * synchronise. So the same test body runs on a real GPU. Host buffers are
 * "mirrored" into a device context, and items are built once with host
 * pointers (which the reference uses as they are) and translated to device
 * pointers for the kernel.
 *
 * Copies and selection are compared bit for bit; scores against the
 * reference within a tiny tolerance and, bit for bit, against the cpu backend
 * (and across the cpu backend's instruction sets), because which pages get
 * selected depends on the exact bits; attention within the per-dtype
 * tolerances stated in reference.h. Criterion runs each test in its own
 * process, so test parameters are indices into static tables, never pointers.
 *
 * KVR_CONFORMANCE_VERBOSE=1 logs the largest attention error per dtype as a
 * fraction of its bound (how the tolerances in reference.h were chosen).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "convert.h" /* kvr_convert_isa_force: the cpu score must match across ISAs */
#include "freelist.h"
#include "half.h"
#include "../gpu/reference/reference.h"
#include "helpers.h"

/* cudaemu's test hooks (gpu/cudaemu/cudaemu.h), weak so that the suite links
 * without cudaemu: its thread-order knob, and its count of launches that
 * failed inside the shim (a launch runs after its enqueue returned, so a
 * deadlocked barrier cannot surface as an error code). */
__attribute__((weak)) void kvr_emu_set_order_seed(uint64_t seed);
__attribute__((weak)) unsigned kvr_cudaemu_failed_launches(void);
__attribute__((weak)) void kvr_cudaemu_last_failure(char *buf, size_t bytes);
__attribute__((weak)) unsigned kvr_cudaemu_strict_violations(void);
__attribute__((weak)) void kvr_cudaemu_strict_last_violation(char *buf, size_t bytes);
/* cuda_backend.cu's hook into cuda_topk.cu's CUB path (absent without CUDA). */
__attribute__((weak)) int kvr_cuda_dev_select_cub(struct kvr_dev *dev, const struct kvr_shape *shape,
						  const struct kvr_score_item *items,
						  const struct kvr_score_item *items_host, uint32_t n,
						  struct kvr_stream *stream);

/* ------------------------------------------------------------------ backends */

struct backend_case {
	const char *name;
	uint32_t kind;       /* enum kvr_dev_kind */
	uint64_t order_seed; /* cudaemu: the order of its emulated threads */
};

enum { CASE_CPU, CASE_CUDA, CASE_EMU_ORDER0, CASE_EMU_ORDER1 };

static const struct backend_case backend_cases[] = {
	[CASE_CPU] = { "cpu", KVR_DEV_CPU, 0 },
	[CASE_CUDA] = { "cuda", KVR_DEV_CUDA, 0 },
	/* strict: also held to a GPU's memory rules (items and data in device
	 * memory, copy directions), as the CUDA kernels will be */
	[CASE_EMU_ORDER0] = { "cudaemu-strict (order 0)", KVR_DEV_CUDAEMU_STRICT, 0 },
	/* a second order: races and order-dependent reductions show as a
	 * difference between the two runs' results and the reference */
	[CASE_EMU_ORDER1] = { "cudaemu (shuffled order)", KVR_DEV_CUDAEMU, 0x243f6a8885a308d3ull },
};

static const char *const type_names[] = { "f16", "bf16", "f32" };
static const uint32_t all_types[] = { KVR_ELEM_F16, KVR_ELEM_BF16, KVR_ELEM_F32 };
#define N_TYPES 3u

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* ------------------------------------------------------------------ random numbers */

/* splitmix64: small, fast, and the same sequence everywhere for a seed. */
struct rng {
	uint64_t s;
};

static uint64_t rng_next(struct rng *r)
{
	return th_splitmix64(&r->s);
}

static double rng_uniform(struct rng *r, double lo, double hi)
{
	return lo + (hi - lo) * (double)(rng_next(r) >> 11) * 0x1p-53;
}

static uint32_t rng_below(struct rng *r, uint32_t n)
{
	return (uint32_t)(rng_next(r) % n);
}

/* Each case of a test draws from its own seed, so a case's inputs do not
 * depend on which cases ran before it (the *_on_worker_stream tests rerun
 * single cases). */
static struct rng case_rng(uint64_t seed, uint32_t config, uint32_t type_index)
{
	return (struct rng){ seed * 1000003u + config * 16u + type_index };
}

/* The start of a case function (e, ci, ti) over shapes[ci] and
 * all_types[ti]: the main device c, the case's rng r, the element type and
 * the shape sh. */
#define CASE_SETUP(shapes, seed)                                                                \
	struct dctx *c = &e->main;                                                              \
	struct rng r = case_rng(seed, ci, ti);                                                  \
	const uint32_t type = all_types[ti];                                                    \
	struct kvr_shape sh = make_shape(&(shapes)[ci], type)

/* ------------------------------------------------------------------ device contexts */

/* A device with an inline and a worker stream, and the host buffers mirrored
 * into its memory (so items built with host pointers can be translated). */
#define MAX_MIRRORS 96

struct mirror {
	const unsigned char *host;
	unsigned char *dev;
	size_t bytes;
};

struct dctx {
	const char *name;
	struct kvr_dev *dev;
	struct kvr_stream *inline_s, *worker_s;
	struct kvr_stream *s; /* the stream this test enqueues on now */
	struct mirror mirrors[MAX_MIRRORS];
	uint32_t n_mirrors;
	void *stall[2]; /* scratch of stall_stream() */
	int poison;     /* put() fills new device memory with 0xa5 first */
};

#define MAX_HOST 256

struct env {
	const struct backend_case *bc;
	struct dctx main;
	struct dctx cpu; /* the cpu backend beside another one: bit identity of scores */
	int cpu_open;
	void *host[MAX_HOST]; /* every host buffer, freed at the end */
	uint32_t n_host;
};

static struct env g_env;

/* Every device call must succeed; say which backend, which stream and why not. */
#define DEV_OK(c, call)                                                                   \
	do {                                                                              \
		const int r_ = (call);                                                    \
		cr_assert_eq(r_, 0, "%s (%s stream): %s returned %d: %s", (c)->name,      \
			     (c)->s == (c)->worker_s ? "worker" : "inline", #call, r_,    \
			     kvr_dev_last_error((c)->dev));                               \
	} while (0)

static int dctx_open_threads(struct dctx *c, const char *name, uint32_t kind, uint32_t threads, char *err,
			     size_t err_bytes)
{
	memset(c, 0, sizeof(*c));
	c->name = name;
	const struct kvr_dev_params params = { .kind = kind, .threads = threads };
	const int r = kvr_dev_create(&params, &c->dev, err, err_bytes);
	if (r)
		return r;
	DEV_OK(c, kvr_dev_stream_create(c->dev, KVR_STREAM_INLINE, &c->inline_s));
	DEV_OK(c, kvr_dev_stream_create(c->dev, KVR_STREAM_WORKER, &c->worker_s));
	c->s = c->inline_s;
	return 0;
}

/* one worker besides the caller: kernels split across threads, as in use */
static int dctx_open(struct dctx *c, const char *name, uint32_t kind, char *err, size_t err_bytes)
{
	return dctx_open_threads(c, name, kind, 1, err, err_bytes);
}

static void dctx_close(struct dctx *c)
{
	if (!c->dev)
		return;
	kvr_dev_stream_synchronize(c->dev, c->inline_s);
	kvr_dev_stream_synchronize(c->dev, c->worker_s);
	for (uint32_t i = 0; i < c->n_mirrors; i++)
		kvr_dev_free(c->dev, c->mirrors[i].dev);
	kvr_dev_stream_destroy(c->dev, c->inline_s);
	kvr_dev_stream_destroy(c->dev, c->worker_s);
	kvr_dev_destroy(c->dev);
	memset(c, 0, sizeof(*c));
}

/* Host memory that lives until the test ends, so a mirror's host address is
 * never reused by another buffer (the translation relies on it). */
static void *halloc(size_t bytes)
{
	cr_assert_lt(g_env.n_host, MAX_HOST, "too many host buffers");
	void *p = calloc(1, bytes ? bytes : 1);
	cr_assert_not_null(p, "out of host memory (%zu bytes)", bytes);
	g_env.host[g_env.n_host++] = p;
	return p;
}

/* Copy a host buffer to new device memory (on c->s) and remember the pair. */
static void *put(struct dctx *c, const void *host, size_t bytes)
{
	if (!bytes)
		return NULL;
	cr_assert_lt(c->n_mirrors, MAX_MIRRORS, "too many device buffers");
	void *dev = NULL;
	DEV_OK(c, kvr_dev_alloc(c->dev, bytes, &dev));
	if (c->poison) {
		/* Make the memory's content before the queued upload recognisable
		 * garbage, for certain: a copy on the inline stream, completed. */
		void *junk = halloc(bytes);
		memset(junk, 0xa5, bytes);
		DEV_OK(c, kvr_dev_memcpy_async(c->dev, dev, junk, bytes, KVR_COPY_H2D, c->inline_s));
		DEV_OK(c, kvr_dev_stream_synchronize(c->dev, c->inline_s));
	}
	DEV_OK(c, kvr_dev_memcpy_async(c->dev, dev, host, bytes, KVR_COPY_H2D, c->s));
	c->mirrors[c->n_mirrors++] = (struct mirror){ host, dev, bytes };
	return dev;
}

/* The device address of a host address inside a mirrored buffer (one past
 * the end included: an empty segment may point there). */
static void *dev_of(const struct dctx *c, const void *host)
{
	if (!host)
		return NULL;
	const unsigned char *h = host;
	for (int end_ok = 0; end_ok <= 1; end_ok++) /* inside first, then one past */
		for (uint32_t i = 0; i < c->n_mirrors; i++) {
			const struct mirror *m = &c->mirrors[i];
			const unsigned char *end = m->host + m->bytes;
			if (h >= m->host && (h < end || (end_ok && h == end)))
				return m->dev + (h - m->host);
		}
	cr_assert_fail("%s: host pointer %p is in no mirrored buffer (test bug)", c->name, host);
	return NULL;
}

/* cudaemu: no launch may have failed in the shim so far. */
static void expect_no_failed_launch(const struct dctx *c)
{
	if (kvr_dev_kind_of(c->dev) == KVR_DEV_CUDAEMU_STRICT && kvr_cudaemu_strict_violations &&
	    kvr_cudaemu_strict_violations()) {
		char why[256] = "(no message)";
		if (kvr_cudaemu_strict_last_violation)
			kvr_cudaemu_strict_last_violation(why, sizeof(why));
		cr_assert_fail("%s: %u strict-memory violation(s); last: %s", c->name,
			       kvr_cudaemu_strict_violations(), why);
	}
	if ((kvr_dev_kind_of(c->dev) != KVR_DEV_CUDAEMU &&
	     kvr_dev_kind_of(c->dev) != KVR_DEV_CUDAEMU_STRICT) ||
	    !kvr_cudaemu_failed_launches)
		return;
	const unsigned failed = kvr_cudaemu_failed_launches();
	if (!failed)
		return;
	char why[256] = "(no message)";
	if (kvr_cudaemu_last_failure)
		kvr_cudaemu_last_failure(why, sizeof(why));
	cr_assert_fail("%s: %u kernel launch(es) failed in the emulator; last: %s", c->name, failed,
		       why);
}

/* Copy the device side of a mirrored host range into dst, then synchronise. */
static void get(struct dctx *c, void *dst, const void *host_range, size_t bytes)
{
	DEV_OK(c, kvr_dev_memcpy_async(c->dev, dst, dev_of(c, host_range), bytes, KVR_COPY_D2H,
				       c->s));
	DEV_OK(c, kvr_dev_stream_synchronize(c->dev, c->s));
	expect_no_failed_launch(c);
}

/* Free a context's device buffers (after its work is done). */
static void dctx_release(struct dctx *c)
{
	if (!c->dev)
		return;
	DEV_OK(c, kvr_dev_stream_synchronize(c->dev, c->inline_s));
	DEV_OK(c, kvr_dev_stream_synchronize(c->dev, c->worker_s));
	for (uint32_t i = 0; i < c->n_mirrors; i++)
		kvr_dev_free(c->dev, c->mirrors[i].dev);
	c->n_mirrors = 0;
	for (uint32_t i = 0; i < 2; i++) {
		kvr_dev_free(c->dev, c->stall[i]);
		c->stall[i] = NULL;
	}
}

/* Keep c->s busy for a while (milliseconds on a CPU: 128 MiB of D2D copies),
 * so that what is enqueued next is still queued, not run, when the enqueueing
 * call returns — on a stream that is asynchronous at all. */
#define STALL_BYTES ((size_t)32 << 20)
static void stall_stream(struct dctx *c)
{
	for (uint32_t i = 0; i < 2; i++)
		if (!c->stall[i])
			DEV_OK(c, kvr_dev_alloc(c->dev, STALL_BYTES, &c->stall[i]));
	for (uint32_t i = 0; i < 4; i++)
		DEV_OK(c, kvr_dev_memcpy_async(c->dev, c->stall[i & 1], c->stall[!(i & 1)],
					       STALL_BYTES, KVR_COPY_D2D, c->s));
}

/* Start a new case inside a test: every device and host buffer of the last
 * one is released (together, so no host address is reused while mirrored). */
static void fresh(struct env *e)
{
	dctx_release(&e->main);
	dctx_release(&e->cpu);
	for (uint32_t i = 0; i < e->n_host; i++)
		free(e->host[i]);
	e->n_host = 0;
}

/* Run `body` on backend case `idx`: open the device (skip on -ENODEV), set
 * cudaemu's thread order, close everything afterwards. */
static void run_case(unsigned idx, void (*body)(struct env *e))
{
	struct env *e = &g_env;
	memset(e, 0, sizeof(*e));
	e->bc = &backend_cases[idx];
	char err[256] = "";
	const int r = dctx_open(&e->main, e->bc->name, e->bc->kind, err, sizeof(err));
	if (r == -ENODEV)
		cr_skip_test("%s: backend not available: %s", e->bc->name, err);
	cr_assert_eq(r, 0, "%s: kvr_dev_create returned %d: %s", e->bc->name, r, err);
	if (e->bc->kind == KVR_DEV_CUDAEMU || e->bc->kind == KVR_DEV_CUDAEMU_STRICT) {
		if (kvr_emu_set_order_seed) {
			kvr_emu_set_order_seed(e->bc->order_seed);
		} else if (e->bc->order_seed) {
			dctx_close(&e->main);
			cr_skip_test("%s: kvr_emu_set_order_seed is not linked: only one thread order "
				     "can run", e->bc->name);
		}
	}
	/* quantised values' weights: 8 bits for 2-bit values where the cpu
	 * backend runs AVX2's byte multiply-adds (its AVX2 path, and AVX-512
	 * without VNNI, which borrows AVX2's kernels for quantised pages), 16
	 * elsewhere (reference.h) */
	const enum kvr_convert_isa isa = kvr_convert_isa_active();
	const int byte_sums = e->bc->kind == KVR_DEV_CPU && (isa == KVR_CONVERT_AVX2 || isa == KVR_CONVERT_AVX512);
	ref_set_value_weight_bits(2, byte_sums ? 8 : 16);
	body(e);
	fresh(e);
	dctx_close(&e->main);
	dctx_close(&e->cpu);
}

/* The cpu backend beside a non-cpu one, opened on first use. */
static struct dctx *cpu_ctx(struct env *e)
{
	if (!e->cpu_open) {
		char err[256] = "";
		const int r = dctx_open(&e->cpu, "cpu (bit-identity reference)", KVR_DEV_CPU, err,
					sizeof(err));
		cr_assert_eq(r, 0, "cannot open the cpu backend: %s", err);
		e->cpu_open = 1;
	}
	return &e->cpu;
}

/* One Criterion test per backend case for each test body. */
#define TEST_TIMEOUT_S 240
#define CONFORMANCE_TEST(name)                                                              \
	static void t_##name(struct env *e);                                               \
	Test(cpu, name, .timeout = TEST_TIMEOUT_S) { run_case(CASE_CPU, t_##name); }       \
	Test(cuda, name, .timeout = TEST_TIMEOUT_S) { run_case(CASE_CUDA, t_##name); }     \
	Test(cudaemu_order0, name, .timeout = TEST_TIMEOUT_S)                               \
	{                                                                                  \
		run_case(CASE_EMU_ORDER0, t_##name);                                       \
	}                                                                                  \
	Test(cudaemu_order1, name, .timeout = TEST_TIMEOUT_S)                               \
	{                                                                                  \
		run_case(CASE_EMU_ORDER1, t_##name);                                       \
	}                                                                                  \
	static void t_##name(struct env *e)

/* A test over cases: name##_case(e, config, type index) for every
 * configuration and element type, each with fresh buffers, on the inline
 * stream (the *_on_worker_stream tests rerun one case of each on a worker
 * stream). */
#define CONFORMANCE_CASES(name, n_configs)                                                  \
	CONFORMANCE_TEST(name)                                                              \
	{                                                                                  \
		for (uint32_t ci = 0; ci < (n_configs); ci++)                              \
			for (uint32_t ti = 0; ti < N_TYPES; ti++) {                        \
				fresh(e);                                                  \
				name##_case(e, ci, ti);                                    \
			}                                                                  \
		log_worst(e, #name);                                                       \
	}

/* ------------------------------------------------------------------ data helpers */

static size_t ebytes(uint32_t type)
{
	return kvr_elem_bytes(type);
}

/* Element i of a typed buffer, as a byte pointer (for item fields). */
static void *elem_ptr(void *base, uint32_t type, uint64_t i)
{
	return (unsigned char *)base + i * ebytes(type);
}

static void fill_uniform(struct rng *r, void *buf, uint32_t type, uint64_t n, double lo,
			 double hi)
{
	for (uint64_t i = 0; i < n; i++)
		ref_store(buf, type, i, rng_uniform(r, lo, hi));
}

static void fill_bytes(struct rng *r, void *buf, size_t bytes)
{
	unsigned char *p = buf;
	for (size_t i = 0; i < bytes; i++)
		p[i] = (unsigned char)rng_next(r);
}

/* A NaN of the element type, as a quiet NaN with a plain payload. */
static void store_nan(void *buf, uint32_t type, uint64_t i)
{
	ref_store(buf, type, i, NAN);
}

struct shape_cfg {
	uint32_t n_qo, n_kv, d, p;
	float scale; /* 0: 1/sqrt(d) */
};

static struct kvr_shape make_shape(const struct shape_cfg *s, uint32_t type)
{
	const struct kvr_shape sh = {
		.n_qo_heads = s->n_qo,
		.n_kv_heads = s->n_kv,
		.head_dim = s->d,
		.page_tokens = s->p,
		.elem_type = type,
		.scale = s->scale != 0.0f ? s->scale : 1.0f / sqrtf((float)s->d),
		.tau = 0.9f,
	};
	return sh;
}

/* Byte-for-byte equality of two buffers of elements, naming the first
 * difference by element index. */
static void expect_same_bits(const char *what, const void *got, const void *want, size_t bytes,
			     size_t elem)
{
	if (!memcmp(got, want, bytes))
		return;
	const unsigned char *g = got, *w = want;
	size_t i = 0;
	while (i < bytes && g[i] == w[i])
		i++;
	const size_t e = i / elem;
	uint32_t gb = 0, wb = 0;
	memcpy(&gb, g + e * elem, elem);
	memcpy(&wb, w + e * elem, elem);
	cr_assert_fail("%s: element %zu differs: got bits 0x%0*x, want 0x%0*x", what, e,
		       (int)(2 * elem), gb, (int)(2 * elem), wb);
}

/* ------------------------------------------------------------------ item translation */

/* Copies of host item arrays with every pointer translated to device memory,
 * themselves copied to the device: what the kernels take. Generated from
 * gpu/kernels.h's list of item pointer fields, so a field added there is
 * translated here. */
#define TRANSLATE_FIELD(f) d[i].f = dev_of(c, it[i].f);
#define DEV_ITEMS(name, T)                                                                         \
	static const void *name(struct dctx *c, const struct T *it, uint32_t n)                   \
	{                                                                                          \
		struct T *d = halloc(n * sizeof(*d));                                              \
		for (uint32_t i = 0; i < n; i++) {                                                 \
			d[i] = it[i];                                                              \
			KVR_ITEM_POINTERS_##T(TRANSLATE_FIELD)                                     \
		}                                                                                  \
		return put(c, d, n * sizeof(*d));                                                  \
	}
DEV_ITEMS(dev_scatter_items, kvr_scatter_item)
DEV_ITEMS(dev_page_items, kvr_page_item)
DEV_ITEMS(dev_score_items, kvr_score_item)
DEV_ITEMS(dev_similarity_items, kvr_similarity_item)
DEV_ITEMS(dev_attention_items, kvr_attention_item)
DEV_ITEMS(dev_segments, kvr_kv_segment)
DEV_ITEMS(dev_dense_items, kvr_dense_item)
DEV_ITEMS(dev_plan_items, kvr_plan_item)
DEV_ITEMS(dev_append_items, kvr_append_item)
#undef DEV_ITEMS
#undef TRANSLATE_FIELD

/* ------------------------------------------------------------------ attention checks */

/* Largest error seen per dtype, as a fraction of its bound (verbose mode). */
static double g_worst[N_TYPES];

static void note_worst(uint32_t type, double rel)
{
	if (rel > g_worst[type])
		g_worst[type] = rel;
}

static void log_worst(const struct env *e, const char *what)
{
	if (!getenv("KVR_CONFORMANCE_VERBOSE") || !(g_worst[0] + g_worst[1] + g_worst[2] > 0.0))
		return;
	for (uint32_t t = 0; t < N_TYPES; t++)
		cr_log_info("%s: %s %s: worst error %.3g of its bound", e->bc->name, what,
			    type_names[t], g_worst[t]);
}

/*
 * Outputs of one item ([n_qo][d] of the element type) against the reference:
 * where the reference is non-finite (NaN or Inf in the inputs) the output
 * must be non-finite too; elsewhere finite and within ref_attention_bound; a
 * head that attends to nothing must output exact zeros.
 */
static void check_heads(const struct env *e, const char *what, const struct kvr_shape *sh,
			const void *got, const double *ref, const struct ref_head_scale *scale)
{
	const uint32_t type = sh->elem_type, d = sh->head_dim;
	for (uint32_t h = 0; h < sh->n_qo_heads; h++) {
		const double bound = ref_attention_bound(type, &scale[h]);
		for (uint32_t c = 0; c < d; c++) {
			const double g = ref_load(got, type, (uint64_t)h * d + c);
			const double r = ref[(uint64_t)h * d + c];
			if (!isfinite(r)) {
				cr_assert(!isfinite(g),
					  "%s: %s %s: head %u dim %u: got %g, want non-finite "
					  "(NaN/Inf must propagate)",
					  e->bc->name, what, type_names[type], h, c, g);
				continue;
			}
			cr_assert(isfinite(g), "%s: %s %s: head %u dim %u: got %g, want %.9g",
				  e->bc->name, what, type_names[type], h, c, g, r);
			if (scale[h].v_mag == 0.0) {
				cr_assert(g == 0.0,
					  "%s: %s %s: head %u attends to no token: dim %u is %g, "
					  "want 0",
					  e->bc->name, what, type_names[type], h, c, g);
				continue;
			}
			const double err = fabs(g - r);
			note_worst(type, err / bound);
			cr_assert(err <= bound,
				  "%s: %s %s: head %u dim %u: got %.9g, want %.9g: error %.3g > "
				  "bound %.3g (V scale %.3g, logit scale %.3g)",
				  e->bc->name, what, type_names[type], h, c, g, r, err, bound,
				  scale[h].v_mag, scale[h].logit_mag);
		}
	}
}

/* ------------------------------------------------------------------ shapes */

/* The shapes the numeric kernels run over: G = 1, 8 and an odd 3; d = 64 and
 * 128, and 32 and 256 once; a scale that is not 1/sqrt(d) (the kernels must
 * take it from the shape). Small, so cudaemu stays quick. */
static const struct shape_cfg numeric_shapes[] = {
	{ 2, 2, 64, 16, 0 },      /* G = 1 */
	{ 8, 1, 128, 16, 0 },     /* G = 8 */
	{ 6, 2, 64, 8, 0 },       /* G = 3 */
	{ 4, 2, 32, 16, 0 },      /* d = 32 */
	{ 2, 1, 256, 8, 0 },      /* d = 256 */
	{ 4, 2, 128, 16, 0.21f }, /* explicit scale */
};

/* The shapes of the layout kernels: page sizes 4..32, one to three KV heads,
 * d from 32 to 256; pad adds elements between NHD rows (row_stride > n_kv·d). */
struct page_cfg {
	uint32_t p, d, n_kv, pad;
};

static const struct page_cfg page_shapes[] = {
	{ 16, 64, 3, 0 },
	{ 8, 128, 2, 32 },
	{ 32, 32, 1, 0 },
	{ 4, 256, 2, 64 },
};

static struct kvr_shape page_shape(const struct page_cfg *pc, uint32_t type)
{
	const struct shape_cfg s = { pc->n_kv, pc->n_kv, pc->d, pc->p, 0 };
	return make_shape(&s, type);
}

/* ================================================================== scatter */

/* The same for the page kernels' cases over page_shapes[ci]: pc, and sh
 * from it. */
#define PAGE_CASE_SETUP(seed)                                                                   \
	struct dctx *c = &e->main;                                                              \
	struct rng r = case_rng(seed, ci, ti);                                                  \
	const struct page_cfg *pc = &page_shapes[ci];                                           \
	const uint32_t type = all_types[ti];                                                    \
	const struct kvr_shape sh = page_shape(pc, type)

/* Several HND runs into two NHD tile pairs, heads in reverse item order:
 * every column of tile 0, all but column 0 of tile 1 (which must keep its old
 * bits); bit-exact, on random bit patterns (NaN payloads included). */
static void scatter_case(struct env *e, uint32_t ci, uint32_t ti)
{
	PAGE_CASE_SETUP(0x5ca7);
	const uint64_t run = 2ull * pc->p * pc->d, tile = (uint64_t)pc->p * pc->n_kv * pc->d;
	const size_t eb = ebytes(type);
	const uint32_t n = 2 * pc->n_kv - (pc->n_kv > 1 ? 1 : 0);

	void *runs = halloc(n * run * eb), *kt = halloc(2 * tile * eb),
	     *vt = halloc(2 * tile * eb);
	fill_bytes(&r, runs, n * run * eb); /* any bits: a copy keeps them all */
	fill_bytes(&r, kt, 2 * tile * eb);
	fill_bytes(&r, vt, 2 * tile * eb);
	struct kvr_scatter_item *items = halloc(n * sizeof(*items));
	for (uint32_t i = 0; i < n; i++) {
		const uint32_t t = i / pc->n_kv;
		/* heads in reverse order, so the item index is not the head */
		items[i] = (struct kvr_scatter_item){
			.run = elem_ptr(runs, type, i * run),
			.k_tile = elem_ptr(kt, type, t * tile),
			.v_tile = elem_ptr(vt, type, t * tile),
			.kv_head = pc->n_kv - 1 - i % pc->n_kv,
		};
	}
	put(c, runs, n * run * eb);
	put(c, kt, 2 * tile * eb);
	put(c, vt, 2 * tile * eb);
	DEV_OK(c, kvr_dev_scatter(c->dev, &sh, dev_scatter_items(c, items, n), n, c->s));
	void *got_k = halloc(2 * tile * eb), *got_v = halloc(2 * tile * eb);
	get(c, got_k, kt, 2 * tile * eb);
	get(c, got_v, vt, 2 * tile * eb);

	ref_scatter(&sh, items, n);
	char what[96];
	snprintf(what, sizeof(what), "%s: scatter %s config %u K tiles", c->name,
		 type_names[ti], ci);
	expect_same_bits(what, got_k, kt, 2 * tile * eb, eb);
	snprintf(what, sizeof(what), "%s: scatter %s config %u V tiles", c->name,
		 type_names[ti], ci);
	expect_same_bits(what, got_v, vt, 2 * tile * eb, eb);
}

CONFORMANCE_CASES(scatter, ARRAY_LEN(page_shapes))

/* ================================================================== offload */

/* Three pages of NHD rows (keys and values from different buffers, padded
 * rows in some shapes) into HND pages, bit-exact. */
static void offload_case(struct env *e, uint32_t ci, uint32_t ti)
{
	PAGE_CASE_SETUP(0x0ff1);
	enum { PAGES = 3 };
	const uint32_t stride = pc->n_kv * pc->d + pc->pad;
	const uint64_t rows = (uint64_t)PAGES * pc->p * stride;
	const uint64_t page = 2ull * pc->n_kv * pc->p * pc->d;
	const size_t eb = ebytes(type);

	void *k = halloc(rows * eb), *v = halloc(rows * eb), *pages = halloc(PAGES * page * eb);
	fill_bytes(&r, k, rows * eb);
	fill_bytes(&r, v, rows * eb);
	fill_bytes(&r, pages, PAGES * page * eb);
	struct kvr_page_item items[PAGES];
	for (uint32_t i = 0; i < PAGES; i++) {
		/* page i from rows of page (i + 1) % PAGES: items need not be in order */
		const uint64_t row0 = (uint64_t)((i + 1) % PAGES) * pc->p * stride;
		items[i] = (struct kvr_page_item){
			.k_rows = elem_ptr(k, type, row0),
			.v_rows = elem_ptr(v, type, row0),
			.hnd_page = elem_ptr(pages, type, i * page),
			.summary = NULL, /* offload writes no summary */
			.row_stride = stride,
		};
	}
	put(c, k, rows * eb);
	put(c, v, rows * eb);
	put(c, pages, PAGES * page * eb);
	DEV_OK(c, kvr_dev_offload(c->dev, &sh, dev_page_items(c, items, PAGES), PAGES, c->s));
	void *got = halloc(PAGES * page * eb);
	get(c, got, pages, PAGES * page * eb);

	ref_offload(&sh, items, PAGES);
	char what[96];
	snprintf(what, sizeof(what), "%s: offload %s config %u", c->name, type_names[ti], ci);
	expect_same_bits(what, got, pages, PAGES * page * eb, eb);
}

CONFORMANCE_CASES(offload, ARRAY_LEN(page_shapes))

/* Offload with a quantised format (the device append of K8V4 and K4V2
 * pages): two pages of NHD rows, each KV head's run quantised, bit for bit
 * the runs the host pool writes (kvr_quant_run_from_nhd); K8V4 in even
 * configurations, K4V2 in odd ones. */
static void offload_quantised_case(struct env *e, uint32_t ci, uint32_t ti)
{
	PAGE_CASE_SETUP(0x0ff2);
	enum { PAGES = 2 };
	const uint32_t format = ci % 2 ? KVR_KV_K4V2 : KVR_KV_K8V4;
	struct kvr_quant_geometry q;
	cr_assert_eq(kvr_quant_geometry_init(&q, pc->p, pc->d, 1, format), 0);
	const uint32_t stride = pc->n_kv * pc->d + pc->pad;
	const uint64_t rows = (uint64_t)PAGES * pc->p * stride, page = q.head_bytes * pc->n_kv;
	const size_t eb = ebytes(type);
	void *k = halloc(rows * eb), *v = halloc(rows * eb);
	unsigned char *pages = halloc(PAGES * page), *want = halloc(PAGES * page);
	fill_uniform(&r, k, type, rows, -3.0, 3.0);
	fill_uniform(&r, v, type, rows, -3.0, 3.0);
	fill_bytes(&r, pages, PAGES * page);
	struct kvr_page_item items[PAGES];
	float scratch[KVR_QUANT_MAX_DIM];
	for (uint32_t i = 0; i < PAGES; i++) {
		const uint64_t row0 = (uint64_t)((i + 1) % PAGES) * pc->p * stride;
		items[i] = (struct kvr_page_item){ .k_rows = elem_ptr(k, type, row0), .v_rows = elem_ptr(v, type, row0),
						   .hnd_page = pages + i * page, .row_stride = stride, .format = format };
		for (uint32_t m = 0; m < pc->n_kv; m++)
			kvr_quant_run_from_nhd(&q, items[i].k_rows, items[i].v_rows, stride, type, m, pc->p,
					       want + i * page + m * q.head_bytes, scratch);
	}
	put(c, k, rows * eb);
	put(c, v, rows * eb);
	put(c, pages, PAGES * page);
	DEV_OK(c, kvr_dev_offload(c->dev, &sh, dev_page_items(c, items, PAGES), PAGES, c->s));
	unsigned char *got = halloc(PAGES * page);
	get(c, got, pages, PAGES * page);
	char what[96];
	snprintf(what, sizeof(what), "%s: offload %s %s config %u", c->name, format == KVR_KV_K4V2 ? "K4V2" : "K8V4",
		 type_names[ti], ci);
	expect_same_bits(what, got, want, PAGES * page, 1);
}

CONFORMANCE_CASES(offload_quantised, ARRAY_LEN(page_shapes))

/* ================================================================== append */

/*
 * append: five tokens, one per tile (a layer's sequences, each its own
 * tile): the first completes its page, plain, with the key summary; the
 * second and third land mid-page and at row 0; the fourth completes a
 * quantised page (K8V4 in even configurations, K4V2 in odd ones) without a
 * summary; the fifth's row is past the page and writes nothing. Tiles
 * (padded rows in some shapes), pages and summary bit for bit against the
 * reference: the rows copied, then offload's and summarize's references
 * and the pool's quantiser.
 */
static void append_case(struct env *e, uint32_t ci, uint32_t ti)
{
	PAGE_CASE_SETUP(0xa99e);
	enum { N = 5 };
	const uint32_t format = ci % 2 ? KVR_KV_K4V2 : KVR_KV_K8V4;
	struct kvr_quant_geometry q;
	cr_assert_eq(kvr_quant_geometry_init(&q, pc->p, pc->d, 1, format), 0);
	const uint32_t stride = pc->n_kv * pc->d + pc->pad, p = pc->p;
	const uint64_t row = (uint64_t)pc->n_kv * pc->d, tile = (uint64_t)p * stride;
	const uint64_t page = 2ull * pc->n_kv * p * pc->d, qpage = (uint64_t)q.head_bytes * pc->n_kv;
	const uint64_t sum = 2ull * pc->n_kv * pc->d;
	const size_t eb = ebytes(type);
	void *k = halloc(N * row * eb), *v = halloc(N * row * eb);
	void *kt = halloc(N * tile * eb), *vt = halloc(N * tile * eb);
	void *pg = halloc(page * eb), *summ = halloc(sum * eb);
	unsigned char *qpg = halloc(qpage);
	fill_uniform(&r, k, type, N * row, -3.0, 3.0);
	fill_uniform(&r, v, type, N * row, -3.0, 3.0);
	fill_uniform(&r, kt, type, N * tile, -3.0, 3.0);
	fill_uniform(&r, vt, type, N * tile, -3.0, 3.0);
	fill_bytes(&r, pg, page * eb);
	fill_bytes(&r, summ, sum * eb);
	fill_bytes(&r, qpg, qpage);
	const uint32_t rows_at[N] = { p - 1, p / 2, 0, p - 1, p };
	struct kvr_append_item items[N];
	for (uint32_t i = 0; i < N; i++)
		items[i] = (struct kvr_append_item){
			.k_row = elem_ptr(k, type, i * row),
			.v_row = elem_ptr(v, type, i * row),
			.k_tile = elem_ptr(kt, type, i * tile),
			.v_tile = elem_ptr(vt, type, i * tile),
			.hnd_page = i == 0 ? pg : i == 3 ? (void *)qpg : NULL,
			.summary = i == 0 ? summ : NULL,
			.row = rows_at[i],
			.row_stride = stride,
			.format = i == 3 ? format : 0,
		};
	put(c, k, N * row * eb);
	put(c, v, N * row * eb);
	put(c, kt, N * tile * eb);
	put(c, vt, N * tile * eb);
	put(c, pg, page * eb);
	put(c, summ, sum * eb);
	put(c, qpg, qpage);
	DEV_OK(c, kvr_dev_append(c->dev, &sh, dev_append_items(c, items, N), N, c->s));
	void *got_kt = halloc(N * tile * eb), *got_vt = halloc(N * tile * eb);
	void *got_pg = halloc(page * eb), *got_summ = halloc(sum * eb);
	unsigned char *got_qpg = halloc(qpage);
	get(c, got_kt, kt, N * tile * eb);
	get(c, got_vt, vt, N * tile * eb);
	get(c, got_pg, pg, page * eb);
	get(c, got_summ, summ, sum * eb);
	get(c, got_qpg, qpg, qpage);

	for (uint32_t i = 0; i < N; i++) {
		if (rows_at[i] >= p)
			continue;
		memcpy(elem_ptr(kt, type, i * tile + (uint64_t)rows_at[i] * stride), items[i].k_row, row * eb);
		memcpy(elem_ptr(vt, type, i * tile + (uint64_t)rows_at[i] * stride), items[i].v_row, row * eb);
	}
	const struct kvr_page_item full = kvr_append_page_item(&items[0]);
	ref_offload(&sh, &full, 1);
	ref_summarize(&sh, &full, 1);
	float scratch[KVR_QUANT_MAX_DIM];
	for (uint32_t m = 0; m < pc->n_kv; m++)
		kvr_quant_run_from_nhd(&q, items[3].k_tile, items[3].v_tile, stride, type, m, p,
				       qpg + m * q.head_bytes, scratch);
	char what[96];
	snprintf(what, sizeof(what), "%s: append %s config %u: K tiles", c->name, type_names[ti], ci);
	expect_same_bits(what, got_kt, kt, N * tile * eb, eb);
	snprintf(what, sizeof(what), "%s: append %s config %u: V tiles", c->name, type_names[ti], ci);
	expect_same_bits(what, got_vt, vt, N * tile * eb, eb);
	snprintf(what, sizeof(what), "%s: append %s config %u: the page", c->name, type_names[ti], ci);
	expect_same_bits(what, got_pg, pg, page * eb, eb);
	snprintf(what, sizeof(what), "%s: append %s config %u: its summary", c->name, type_names[ti], ci);
	expect_same_bits(what, got_summ, summ, sum * eb, eb);
	snprintf(what, sizeof(what), "%s: append %s config %u: the %s page", c->name, type_names[ti], ci,
		 format == KVR_KV_K4V2 ? "K4V2" : "K8V4");
	expect_same_bits(what, got_qpg, qpg, qpage, 1);
}

CONFORMANCE_CASES(append, ARRAY_LEN(page_shapes))

/* ================================================================== summarize */

/*
 * Key summaries of three pages. Besides random keys: a dimension of signed
 * zeros only (the fold keeps the first of equal values, summary.h), one with
 * +Inf and -Inf, and NaN in one dimension (both bounds must be NaN). Bit-exact
 * except NaN payloads, which only need to stay NaN.
 */
static void summarize_case(struct env *e, uint32_t ci, uint32_t ti)
{
	PAGE_CASE_SETUP(0x5e33);
	enum { PAGES = 3 };
	const uint32_t d = pc->d, n_kv = pc->n_kv;
	const uint32_t stride = n_kv * d + pc->pad;
	const uint64_t rows = (uint64_t)PAGES * pc->p * stride, sum = 2ull * n_kv * d;
	const size_t eb = ebytes(type);

	void *k = halloc(rows * eb), *summ = halloc(PAGES * sum * eb);
	fill_uniform(&r, k, type, rows, -4.0, 4.0);
	fill_bytes(&r, summ, PAGES * sum * eb);
	/* page 1, last KV head: dims 1..4 get the special values */
	const uint64_t base = (uint64_t)pc->p * stride + (uint64_t)(n_kv - 1) * d;
	for (uint32_t t = 0; t < pc->p; t++) {
		const uint64_t row = base + (uint64_t)t * stride;
		ref_store(k, type, row + 1, rng_below(&r, 2) ? 0.0 : -0.0);
		if (t == 1)
			ref_store(k, type, row + 2, INFINITY);
		if (t == pc->p - 1)
			ref_store(k, type, row + 2, -INFINITY);
		if (t == pc->p / 2)
			store_nan(k, type, row + 3);
	}
	ref_store(k, type, base + 4, NAN); /* NaN as the very first key */
	struct kvr_page_item items[PAGES];
	for (uint32_t i = 0; i < PAGES; i++)
		items[i] = (struct kvr_page_item){
			.k_rows = elem_ptr(k, type, (uint64_t)i * pc->p * stride),
			.v_rows = NULL, /* summarize reads keys only */
			.hnd_page = NULL,
			.summary = elem_ptr(summ, type, i * sum),
			.row_stride = stride,
		};
	put(c, k, rows * eb);
	put(c, summ, PAGES * sum * eb);
	DEV_OK(c, kvr_dev_summarize(c->dev, &sh, dev_page_items(c, items, PAGES), PAGES,
				    c->s));
	void *got = halloc(PAGES * sum * eb);
	get(c, got, summ, PAGES * sum * eb);

	ref_summarize(&sh, items, PAGES);
	for (uint64_t i = 0; i < PAGES * sum; i++) {
		const double want = ref_load(summ, type, i), g = ref_load(got, type, i);
		const uint64_t pg = i / sum, m = i % sum / (2 * d), w = i % (2 * d) / d,
			       dim = i % d;
		if (isnan(want)) {
			cr_assert(isnan(g),
				  "%s: summarize %s config %u: page %lu head %lu %s dim "
				  "%lu: got %g, want NaN (NaN propagates)",
				  c->name, type_names[ti], ci, (unsigned long)pg,
				  (unsigned long)m, w ? "max" : "min", (unsigned long)dim, g);
			continue;
		}
		cr_assert(!memcmp(elem_ptr(got, type, i), elem_ptr(summ, type, i), eb),
			  "%s: summarize %s config %u: page %lu head %lu %s dim %lu: "
			  "got %g, want %g (bit-exact, signed zeros included)",
			  c->name, type_names[ti], ci, (unsigned long)pg, (unsigned long)m,
			  w ? "max" : "min", (unsigned long)dim, g, want);
	}
}

CONFORMANCE_CASES(summarize, ARRAY_LEN(page_shapes))

/*
 * Summaries with estimate rows (KVR_SHAPE_ESTIMATES, the estimate of the pages not retrieved): the key
 * bounds where they are without them, then each head's mean key and mean
 * value (fp32 sums in token order from token 0, over p): bit-exact on every
 * backend, from rows with a padded stride, a column of signed zeros (a
 * mean of -0.0 stays -0.0) and large values whose sums would round
 * differently in another order.
 */
static void summarize_estimates_case(struct env *e, uint32_t ci, uint32_t ti)
{
	PAGE_CASE_SETUP(0xe571);
	enum { PAGES = 3 };
	struct kvr_shape shx = sh;
	shx.flags |= KVR_SHAPE_ESTIMATES;
	const uint32_t d = pc->d, n_kv = pc->n_kv;
	const uint32_t stride = n_kv * d + pc->pad;
	const uint64_t rows = (uint64_t)PAGES * pc->p * stride, sum = 4ull * n_kv * d;
	const size_t eb = ebytes(type);

	void *k = halloc(rows * eb), *v = halloc(rows * eb), *summ = halloc(PAGES * sum * eb);
	fill_uniform(&r, k, type, rows, -4.0, 4.0);
	fill_uniform(&r, v, type, rows, -300.0, 300.0);
	fill_bytes(&r, summ, PAGES * sum * eb);
	for (uint32_t t = 0; t < pc->p; t++) { /* page 0, head 0, dim 0: -0.0 only */
		ref_store(k, type, (uint64_t)t * stride, -0.0);
		ref_store(v, type, (uint64_t)t * stride, -0.0);
	}
	struct kvr_page_item items[PAGES];
	for (uint32_t i = 0; i < PAGES; i++)
		items[i] = (struct kvr_page_item){
			.k_rows = elem_ptr(k, type, (uint64_t)i * pc->p * stride),
			.v_rows = elem_ptr(v, type, (uint64_t)i * pc->p * stride),
			.summary = elem_ptr(summ, type, i * sum),
			.row_stride = stride,
		};
	put(c, k, rows * eb);
	put(c, v, rows * eb);
	put(c, summ, PAGES * sum * eb);
	DEV_OK(c, kvr_dev_summarize(c->dev, &shx, dev_page_items(c, items, PAGES), PAGES, c->s));
	void *got = halloc(PAGES * sum * eb);
	get(c, got, summ, PAGES * sum * eb);

	ref_summarize(&shx, items, PAGES);
	static const char *const row_names[] = { "min", "max", "mean key", "mean value" };
	for (uint64_t i = 0; i < PAGES * sum; i++) {
		const uint64_t pg = i / sum, in = i % sum, block = in / (2 * n_kv * d);
		const uint64_t m = in % (2 * n_kv * d) / (2 * d), w = in % (2 * d) / d, dim = i % d;
		cr_assert(!memcmp(elem_ptr(got, type, i), elem_ptr(summ, type, i), eb),
			  "%s: summarize (estimates) %s config %u: page %lu head %lu %s dim %lu: "
			  "got %g, want %g (bit-exact)",
			  c->name, type_names[ti], ci, (unsigned long)pg, (unsigned long)m,
			  row_names[block * 2 + w], (unsigned long)dim, ref_load(got, type, i),
			  ref_load(summ, type, i));
	}
	cr_assert(signbit(ref_load(got, type, 2ull * n_kv * d)) && signbit(ref_load(got, type, 2ull * n_kv * d + d)),
		  "%s: summarize (estimates): the mean of -0.0 keys and values is -0.0", c->name);
}

CONFORMANCE_CASES(summarize_estimates, ARRAY_LEN(page_shapes))

/* ================================================================== score + select */

/* One score test case: items over a q buffer, a summaries buffer per item
 * (pages below cand_begin are NaN when the softmax spans the candidates only:
 * reading them shows; the buffer ends at the domain's end), one scores buffer and
 * one selected buffer shared by all items at offsets. */
#define SEL_GUARD 2 /* sentinel entries after each item's selection */
#define SEL_SENTINEL 0x5a5a5a5a

struct score_case {
	struct kvr_score_item items[5];
	uint32_t n;
	void *q, *summ[5];
	size_t q_bytes, summ_bytes[5];
	float *scores;
	size_t scores_len;
	int32_t *selected;
	size_t selected_len;
};

static void put_score_case(struct dctx *c, const struct score_case *sc)
{
	put(c, sc->q, sc->q_bytes);
	for (uint32_t i = 0; i < sc->n; i++)
		put(c, sc->summ[i], sc->summ_bytes[i]);
	put(c, sc->scores, sc->scores_len * sizeof(float));
	put(c, sc->selected, sc->selected_len * sizeof(int32_t));
}

/* Score every item on c, return the scores buffer (all items). */
static float *device_scores(struct dctx *c, const struct kvr_shape *sh, const struct score_case *sc)
{
	DEV_OK(c, kvr_dev_score(c->dev, sh, dev_score_items(c, sc->items, sc->n), sc->n, c->s));
	float *got = halloc(sc->scores_len * sizeof(float));
	get(c, got, sc->scores, sc->scores_len * sizeof(float));
	return got;
}

static void build_score_case(struct rng *r, const struct kvr_shape *sh, struct score_case *sc,
			     int with_long)
{
	/* candidates [begin, end), k and norm_end: a range past the vector width
	 * with a tail, its softmax over every page (sink before, window after);
	 * a single candidate with k > 1, softmax over the candidates; an empty
	 * range (its domain non-empty); and, once, more candidates than the
	 * canonical 256 lanes of the page sum, softmax over the candidates, and
	 * fewer candidates than that in a domain of more (the cuda backend's
	 * uncached path either way) */
	static const uint32_t spec[5][4] = { { 3, 43, 5, 51 },
					     { 0, 1, 3, 0 },
					     { 5, 5, 2, 9 },
					     { 2, 302, 17, 0 },
					     { 4, 200, 9, 420 } };
	const uint32_t type = sh->elem_type, d = sh->head_dim, n_kv = sh->n_kv_heads;
	const size_t eb = ebytes(type);
	memset(sc, 0, sizeof(*sc));
	sc->n = with_long ? 5 : 3;
	sc->q_bytes = (size_t)sh->n_qo_heads * d * eb;
	sc->q = halloc(sc->q_bytes);
	fill_uniform(r, sc->q, type, (uint64_t)sh->n_qo_heads * d, -2.0, 2.0);
	size_t scores_at[5], sel_at[5];
	for (uint32_t i = 0; i < sc->n; i++) {
		const uint32_t begin = spec[i][0], end = spec[i][1], n_cand = end - begin;
		const uint32_t norm_end = spec[i][3], first = norm_end ? 0 : begin;
		const uint32_t last = norm_end > end ? norm_end : end;
		/* with KVR_SHAPE_ESTIMATES a page's summary carries estimate
		 * rows after its bounds: NaN here, which score must not read */
		const int est = (sh->flags & KVR_SHAPE_ESTIMATES) != 0;
		const uint64_t page = (est ? 4ull : 2ull) * n_kv * d;
		sc->summ_bytes[i] = (last ? last : 1) * page * eb;
		sc->summ[i] = halloc(sc->summ_bytes[i]);
		for (uint64_t x = 0; x < (uint64_t)first * page; x++)
			store_nan(sc->summ[i], type, x);
		for (uint32_t j = first; est && j < last; j++)
			for (uint64_t x = 2ull * n_kv * d; x < page; x++)
				store_nan(sc->summ[i], type, (uint64_t)j * page + x);
		for (uint32_t j = first; j < last; j++)
			for (uint32_t m = 0; m < n_kv; m++)
				for (uint32_t cc = 0; cc < d; cc++) {
					/* min <= max, as a page's summary is */
					const double a = rng_uniform(r, -1.5, 1.5);
					const double b = rng_uniform(r, -1.5, 1.5);
					const uint64_t at = (uint64_t)j * page + 2ull * m * d + cc;
					ref_store(sc->summ[i], type, at, a < b ? a : b);
					ref_store(sc->summ[i], type, at + d, a < b ? b : a);
				}
		scores_at[i] = sc->scores_len;
		sc->scores_len += n_cand ? (size_t)n_kv * n_cand : 4; /* 4 sentinels if empty */
		sel_at[i] = sc->selected_len;
		sc->selected_len += (size_t)n_kv * spec[i][2] + SEL_GUARD;
		sc->items[i] = (struct kvr_score_item){ .q = sc->q, .summaries = sc->summ[i],
							.cand_begin = begin, .cand_end = end,
							.k = spec[i][2], .norm_end = norm_end };
	}
	sc->scores = halloc(sc->scores_len * sizeof(float));
	memset(sc->scores, 0xff, sc->scores_len * sizeof(float)); /* NaN: unwritten shows */
	sc->selected = halloc(sc->selected_len * sizeof(int32_t));
	for (size_t i = 0; i < sc->selected_len; i++)
		sc->selected[i] = SEL_SENTINEL;
	for (uint32_t i = 0; i < sc->n; i++) {
		sc->items[i].scores = sc->scores + scores_at[i];
		sc->items[i].selected = sc->selected + sel_at[i];
	}
}

/* Force a cpu instruction set; returns 0 when the CPU lacks it. */
static int force_isa(enum kvr_convert_isa isa)
{
	return kvr_convert_isa_force(isa) == isa;
}

/*
 * score: against the reference within REF_SCORE_*; bit-identical to the cpu
 * backend (other backends) or across the cpu backend's instruction sets
 * (cpu); then select over the device's own scores, exactly as the reference
 * selects from those same bits.
 */
static void score_select_case(struct env *e, uint32_t ci, uint32_t ti)
{
	CASE_SETUP(numeric_shapes, 0x5c03e);
	if (ci % 2) /* summaries with estimate rows: the bounds a page's summary apart */
		sh.flags |= KVR_SHAPE_ESTIMATES;
	const uint32_t n_kv = sh.n_kv_heads;
	struct score_case sc;
	build_score_case(&r, &sh, &sc, ci == 2);
	put_score_case(c, &sc);
	const float *got = device_scores(c, &sh, &sc);

	/* against the reference */
	for (uint32_t i = 0; i < sc.n; i++) {
		const struct kvr_score_item *it = &sc.items[i];
		const uint32_t n_cand = it->cand_end - it->cand_begin;
		const size_t at = (size_t)(it->scores - sc.scores);
		if (!n_cand) { /* nothing to write: the sentinels stay */
			expect_same_bits("score: empty candidate range must write nothing",
					 got + at, sc.scores + at, 4 * sizeof(float), 4);
			continue;
		}
		double *want = halloc((size_t)n_kv * n_cand * sizeof(double));
		ref_score(&sh, it, want);
		for (uint32_t x = 0; x < n_kv * n_cand; x++) {
			const double g = got[at + x], w = want[x];
			cr_assert(fabs(g - w) <= REF_SCORE_REL_TOL * w + REF_SCORE_ABS_TOL,
				  "%s: score %s config %u item %u: KV head %u page %u: "
				  "got %.9g, want %.9g",
				  c->name, type_names[ti], ci, i, x / n_cand,
				  it->cand_begin + x % n_cand, g, w);
		}
	}

	/* bit identity: selection must not depend on the backend or ISA */
	if (e->bc->kind == KVR_DEV_CPU) {
		const enum kvr_convert_isa active = kvr_convert_isa_active();
		static const enum kvr_convert_isa isas[] = {
			KVR_CONVERT_SCALAR, KVR_CONVERT_AVX2, KVR_CONVERT_AVX512 };
		for (uint32_t k = 0; k < ARRAY_LEN(isas); k++) {
			if (!force_isa(isas[k]))
				continue;
			const float *again = device_scores(c, &sh, &sc);
			char what[128];
			snprintf(what, sizeof(what),
				 "cpu: score %s config %u: %s scores differ from %s",
				 type_names[ti], ci, kvr_convert_isa_name(isas[k]),
				 kvr_convert_isa_name(active));
			expect_same_bits(what, again, got, sc.scores_len * sizeof(float), 4);
		}
		kvr_convert_isa_force(active);
	} else {
		struct dctx *cpu = cpu_ctx(e);
		put_score_case(cpu, &sc);
		const float *ref_bits = device_scores(cpu, &sh, &sc);
		char what[128];
		snprintf(what, sizeof(what),
			 "%s: score %s config %u: scores differ from the cpu backend's",
			 c->name, type_names[ti], ci);
		expect_same_bits(what, got, ref_bits, sc.scores_len * sizeof(float), 4);
	}

	/* select over the scores the device wrote (still in its memory) */
	DEV_OK(c, kvr_dev_select(c->dev, &sh, dev_score_items(c, sc.items, sc.n), sc.n,
				 c->s));
	int32_t *sel = halloc(sc.selected_len * sizeof(int32_t));
	get(c, sel, sc.selected, sc.selected_len * sizeof(int32_t));
	struct kvr_score_item host[5];
	memcpy(host, sc.items, sizeof(host));
	for (uint32_t i = 0; i < sc.n; i++) /* the reference reads the same bits */
		host[i].scores = (float *)got + (sc.items[i].scores - sc.scores);
	ref_select(&sh, host, sc.n);
	char what[128];
	snprintf(what, sizeof(what), "%s: select after score %s config %u", c->name,
		 type_names[ti], ci);
	expect_same_bits(what, sel, sc.selected, sc.selected_len * sizeof(int32_t), 4);
}

CONFORMANCE_CASES(score_select, ARRAY_LEN(numeric_shapes))

/*
 * score and select with gates (a correction's flags): an item whose gate is
 * all zeros writes nothing (its scores stay NaN, its selection sentinels), an
 * item with one flag, or with no gate, writes what it writes ungated, bit for
 * bit. One shape and type: the gate is a branch, not arithmetic.
 */
CONFORMANCE_TEST(score_gate)
{
	const uint32_t ci = 0, ti = 0;
	fresh(e);
	CASE_SETUP(numeric_shapes, 0x6a7e);
	const uint32_t n_kv = sh.n_kv_heads;
	struct score_case sc;
	build_score_case(&r, &sh, &sc, 0);
	put_score_case(c, &sc);
	const float *open_scores = device_scores(c, &sh, &sc);
	DEV_OK(c, kvr_dev_select(c->dev, &sh, dev_score_items(c, sc.items, sc.n), sc.n, c->s));
	int32_t *open_sel = halloc(sc.selected_len * sizeof(int32_t));
	get(c, open_sel, sc.selected, sc.selected_len * sizeof(int32_t));

	/* again into fresh buffers: item 0 closed, item 1 one head open, item 2 none */
	uint8_t *closed = halloc(n_kv), *one = halloc(n_kv);
	one[n_kv - 1] = 1;
	struct score_case gc = sc;
	gc.scores = halloc(sc.scores_len * sizeof(float));
	memset(gc.scores, 0xff, sc.scores_len * sizeof(float));
	gc.selected = halloc(sc.selected_len * sizeof(int32_t));
	for (size_t x = 0; x < sc.selected_len; x++)
		gc.selected[x] = SEL_SENTINEL;
	for (uint32_t i = 0; i < gc.n; i++) {
		gc.items[i].scores = gc.scores + (sc.items[i].scores - sc.scores);
		gc.items[i].selected = gc.selected + (sc.items[i].selected - sc.selected);
	}
	gc.items[0].gate = closed, gc.items[1].gate = one;
	put(c, closed, n_kv);
	put(c, one, n_kv);
	put(c, gc.scores, gc.scores_len * sizeof(float));
	put(c, gc.selected, gc.selected_len * sizeof(int32_t));
	const void *items = dev_score_items(c, gc.items, gc.n);
	DEV_OK(c, kvr_dev_score(c->dev, &sh, items, gc.n, c->s));
	DEV_OK(c, kvr_dev_select(c->dev, &sh, items, gc.n, c->s));
	float *got = halloc(sc.scores_len * sizeof(float));
	int32_t *sel = halloc(sc.selected_len * sizeof(int32_t));
	get(c, got, gc.scores, sc.scores_len * sizeof(float));
	get(c, sel, gc.selected, sc.selected_len * sizeof(int32_t));
	for (uint32_t i = 0; i < gc.n; i++) {
		const size_t s_at = (size_t)(sc.items[i].scores - sc.scores);
		const size_t s_end = i + 1 < gc.n ? (size_t)(sc.items[i + 1].scores - sc.scores) : sc.scores_len;
		const size_t k_at = (size_t)(sc.items[i].selected - sc.selected);
		const size_t k_n = (size_t)n_kv * sc.items[i].k;
		char what[128];
		snprintf(what, sizeof(what), "%s: gated score, item %u (%s)", c->name, i,
			 i == 0 ? "closed: must write nothing" : "open: as ungated");
		expect_same_bits(what, got + s_at, i == 0 ? gc.scores + s_at : open_scores + s_at,
				 (s_end - s_at) * sizeof(float), 4);
		snprintf(what, sizeof(what), "%s: gated select, item %u", c->name, i);
		expect_same_bits(what, sel + k_at, i == 0 ? gc.selected + k_at : open_sel + k_at,
				 k_n * sizeof(int32_t), 4);
	}
	/* the reference's select honours the gate the same way */
	struct kvr_score_item host[5];
	memcpy(host, gc.items, sizeof(host));
	int32_t *ref_sel = halloc(sc.selected_len * sizeof(int32_t));
	memcpy(ref_sel, gc.selected, sc.selected_len * sizeof(int32_t));
	for (uint32_t i = 0; i < gc.n; i++) {
		host[i].scores = got + (sc.items[i].scores - sc.scores);
		host[i].selected = ref_sel + (sc.items[i].selected - sc.selected);
	}
	ref_select(&sh, host, gc.n);
	expect_same_bits("gated select against the reference", sel, ref_sel,
			 sc.selected_len * sizeof(int32_t), 4);
}

/* ================================================================== plan */

/*
 * plan: items with and without head and tail segments, k from 0 to 6,
 * pages below, inside and past [sel_begin, sel_end) and -1, the correction's
 * pages taken with its flag set, the speculative ones with it clear, and with
 * no flag at all; plain and quantised segment fields. Each item's list (its
 * first n_segments entries) and n_segments equal the reference's bit for bit,
 * and the attention items' other fields are untouched. page_addr holds
 * made-up addresses: the kernel computes with them and never dereferences.
 */
CONFORMANCE_TEST(plan)
{
	fresh(e);
	struct dctx *c = &e->main;
	struct rng r = case_rng(0x91a4, 0, 0);
	enum { N = 7, PAGES = 40 };
	static const uint32_t spec[N][4] = { /* n_head, k, n_tail, flag: 0 clear, 1 set, 2 none, 3 no correction */
		{ 2, 4, 3, 1 }, { 0, 4, 0, 0 }, { 3, 6, 5, 2 }, { 1, 0, 2, 1 },
		{ 0, 1, 1, 3 }, { 4, 5, 33, 0 }, { 2, 6, 1, 1 } };
	uint64_t *addr = halloc(PAGES * sizeof(uint64_t));
	for (uint32_t j = 0; j < PAGES; j++)
		addr[j] = 0x100000ull * (j + 1) + (rng_next(&r) & 0xfff0);
	struct kvr_plan_item items[N];
	uint32_t list_at[N + 1] = { 0 };
	for (uint32_t i = 0; i < N; i++)
		list_at[i + 1] = list_at[i] + spec[i][0] + spec[i][1] + spec[i][2];
	struct kvr_kv_segment *list = halloc(list_at[N] * sizeof(*list));
	fill_bytes(&r, list, list_at[N] * sizeof(*list));
	struct kvr_attention_item *att = halloc(N * sizeof(*att));
	fill_bytes(&r, att, N * sizeof(*att));
	int32_t *sel = halloc(N * 8 * sizeof(int32_t)), *now = halloc(N * 8 * sizeof(int32_t));
	uint8_t *flags = halloc(N);
	/* even items also keep their query rows (q_from to q_to, as the device
	 * plan keeps a lane's previous query); odd ones leave q_to alone */
	enum { QB = 256 };
	unsigned char *q_from = halloc(N * QB), *q_to = halloc(N * QB);
	fill_bytes(&r, q_from, N * QB);
	fill_bytes(&r, q_to, N * QB);
	for (uint32_t i = 0; i < N; i++) {
		for (uint32_t j = 0; j < 8; j++) {
			sel[i * 8 + j] = (int32_t)rng_below(&r, PAGES + 1) - 1;
			now[i * 8 + j] = (int32_t)rng_below(&r, PAGES + 1) - 1;
		}
		flags[i] = spec[i][3] == 1;
		const int quant = i % 2;
		items[i] = (struct kvr_plan_item){
			.attention = &att[i],
			.segments = list + list_at[i],
			.selected = sel + i * 8,
			.corrected_sel = spec[i][3] == 3 ? NULL : now + i * 8,
			.corrected = spec[i][3] >= 2 ? NULL : flags + i,
			.page_addr = addr,
			.k_offset = 64 * i,
			.v_offset = quant ? UINT64_MAX : 64 * i + 4096,
			.n_head = spec[i][0], .n_tail = spec[i][2], .k = spec[i][1],
			.sel_begin = 2 + i, .sel_end = PAGES - 3 * i, .addr_end = PAGES,
			.seg_tokens = 16, .seg_row = quant ? 0 : 128, .seg_head_stride = quant ? 1088 : 0,
			.seg_format = quant ? KVR_KV_K8V4 : 0,
			.q_from = i % 2 ? NULL : q_from + i * QB, .q_to = i % 2 ? NULL : q_to + i * QB,
			.q_bytes = i % 4 ? QB : 96 };
	}
	put(c, q_from, N * QB);
	put(c, q_to, N * QB);
	put(c, addr, PAGES * sizeof(uint64_t));
	put(c, list, list_at[N] * sizeof(*list));
	put(c, att, N * sizeof(*att));
	put(c, sel, N * 8 * sizeof(int32_t));
	put(c, now, N * 8 * sizeof(int32_t));
	put(c, flags, N);
	const struct kvr_shape sh = make_shape(&numeric_shapes[0], KVR_ELEM_F32);
	DEV_OK(c, kvr_dev_plan(c->dev, &sh, dev_plan_items(c, items, N), N, c->s));
	struct kvr_kv_segment *got = halloc(list_at[N] * sizeof(*got));
	struct kvr_attention_item *got_att = halloc(N * sizeof(*got_att));
	get(c, got, list, list_at[N] * sizeof(*got));
	get(c, got_att, att, N * sizeof(*got_att));
	unsigned char *got_q = halloc(N * QB);
	get(c, got_q, q_to, N * QB);
	for (uint32_t i = 0; i < N; i++) {
		const uint32_t copied = i % 2 ? 0 : items[i].q_bytes;
		char what[96];
		snprintf(what, sizeof(what), "%s: plan item %u: the query rows kept", c->name, i);
		expect_same_bits(what, got_q + i * QB, q_from + i * QB, copied, 1);
		snprintf(what, sizeof(what), "%s: plan item %u: the bytes past them", c->name, i);
		expect_same_bits(what, got_q + i * QB + copied, q_to + i * QB + copied, QB - copied, 1);
	}
	struct kvr_attention_item *want_att = halloc(N * sizeof(*want_att));
	memcpy(want_att, att, N * sizeof(*att));
	for (uint32_t i = 0; i < N; i++)
		items[i].attention = &want_att[i];
	ref_plan(items, N); /* rewrites the host list in place */
	for (uint32_t i = 0; i < N; i++) {
		char what[96];
		snprintf(what, sizeof(what), "%s: plan item %u: the attention item", c->name, i);
		expect_same_bits(what, &got_att[i], &want_att[i], sizeof(*got_att), 4);
		cr_assert_leq(want_att[i].n_segments, list_at[i + 1] - list_at[i]);
		snprintf(what, sizeof(what), "%s: plan item %u: its %u segments", c->name, i,
			 want_att[i].n_segments);
		expect_same_bits(what, got + list_at[i], list + list_at[i],
				 want_att[i].n_segments * sizeof(*got), 8);
	}
	/* the cases cover what they claim: some pages taken, some skipped */
	uint32_t taken = 0, offered = 0;
	for (uint32_t i = 0; i < N; i++) {
		taken += want_att[i].n_segments - spec[i][0] - spec[i][2];
		offered += spec[i][1];
	}
	cr_assert(taken > 0 && taken < offered, "%u of %u pages taken", taken, offered);
	expect_no_failed_launch(c);
}

/* k distinct pages of [0, pages) in ascending order, the last `unused`
 * entries -1 (a selection). */
static void ascending_pages(struct rng *r, int32_t *out, uint32_t k, uint32_t unused, uint32_t pages)
{
	uint32_t n = 0;
	for (uint32_t p = 0; p < pages && n < k - unused; p++)
		if (rng_below(r, pages - p) < k - unused - n)
			out[n++] = (int32_t)p;
	for (; n < k; n++)
		out[n] = -1;
}

/*
 * plan with slots (streamed recall): each head's slot table is planned as
 * recall.c plans it on the host (hits kept, misses into the lowest free
 * slots in entry order, the rest emptied), the misses' scatter items and
 * the counts written, and each taken page's segment reads its slot; against
 * the reference bit for bit: slot tables, scatter items, counts, segments.
 * The slot tables hold some of the pages wanted, some others, empties and
 * (item 4) one wanted page in several slots; item 4 has more entries and
 * tail segments than the CUDA kernel's block has threads, and item 5's
 * selection names a page twice (the kernel's sequential path).
 */
CONFORMANCE_TEST(plan_slots)
{
	fresh(e);
	struct dctx *c = &e->main;
	struct rng r = case_rng(0x5107, 0, 0);
	enum { N = 6, PAGES = 600, KMAX = 300 };
	static const uint32_t spec[N][4] = { /* k, unused entries, n_head, n_tail */
		{ 6, 0, 1, 2 }, { 8, 3, 0, 1 }, { 3, 0, 2, 0 }, { 12, 1, 1, 4 }, { 300, 20, 1, 150 },
		{ 10, 2, 1, 3 } };
	uint64_t *addr = halloc(PAGES * sizeof(uint64_t));
	for (uint32_t j = 0; j < PAGES; j++)
		addr[j] = 0x200000ull * (j + 1);
	uint32_t list_at[N + 1] = { 0 };
	for (uint32_t i = 0; i < N; i++)
		list_at[i + 1] = list_at[i] + spec[i][2] + spec[i][0] + spec[i][3];
	struct kvr_kv_segment *list = halloc(list_at[N] * sizeof(*list));
	fill_bytes(&r, list, list_at[N] * sizeof(*list));
	struct kvr_attention_item *att = halloc(N * sizeof(*att));
	int32_t *sel = halloc(N * KMAX * sizeof(int32_t)), *slots = halloc(N * KMAX * sizeof(int32_t));
	struct kvr_scatter_item *scatter = halloc(N * KMAX * sizeof(*scatter));
	uint32_t *counts = halloc(N * 2 * sizeof(uint32_t));
	const uint64_t tile = 4096;
	unsigned char *slot_k = halloc(KMAX * tile), *slot_v = halloc(KMAX * tile);
	for (uint32_t i = 0; i < N; i++) {
		const uint32_t k = spec[i][0];
		ascending_pages(&r, sel + i * KMAX, k, spec[i][1], PAGES);
		if (i == 5)
			sel[i * KMAX + 4] = sel[i * KMAX + 1];
		/* slots: a wanted page (reversed order), another page, or empty;
		 * item 4 also the first wanted page again */
		for (uint32_t j = 0; j < k; j++) {
			const uint32_t pick = rng_below(&r, i == 4 ? 4 : 3);
			const int32_t want = sel[i * KMAX + (k - 1 - j)];
			slots[i * KMAX + j] = pick == 0   ? want
					      : pick == 1 ? (int32_t)(PAGES + j)
					      : pick == 2 ? -1
							  : sel[i * KMAX];
		}
	}
	put(c, addr, PAGES * sizeof(uint64_t));
	put(c, list, list_at[N] * sizeof(*list));
	put(c, att, N * sizeof(*att));
	put(c, sel, N * KMAX * sizeof(int32_t));
	put(c, slots, N * KMAX * sizeof(int32_t));
	put(c, scatter, N * KMAX * sizeof(*scatter));
	put(c, counts, N * 2 * sizeof(uint32_t));
	put(c, slot_k, KMAX * tile);
	put(c, slot_v, KMAX * tile);
	struct kvr_plan_item items[N];
	for (uint32_t i = 0; i < N; i++)
		items[i] = (struct kvr_plan_item){
			.attention = &att[i], .segments = list + list_at[i], .selected = sel + i * KMAX,
			.page_addr = addr, .k_offset = 1088 * i, .v_offset = UINT64_MAX,
			.n_head = spec[i][2], .n_tail = spec[i][3], .k = spec[i][0],
			.sel_begin = 3, .sel_end = PAGES - 2, .addr_end = PAGES - 1 - 2 * i, .seg_tokens = 16, .seg_row = 256,
			.slot_col = 64 * i, .slot_page = slots + i * KMAX, .scatter = scatter + i * KMAX,
			.recall_count = counts + 2 * i, .slot_k = slot_k, .slot_v = slot_v, .tile_bytes = tile,
			.kv_head = i };
	/* the sequential path (item 5) and a parallel one (item 4) keep query rows too */
	unsigned char *q_from = halloc(2 * 128), *q_to = halloc(2 * 128);
	fill_bytes(&r, q_from, 2 * 128);
	for (uint32_t i = 4; i < 6; i++) {
		items[i].q_from = q_from + (i - 4) * 128;
		items[i].q_to = q_to + (i - 4) * 128;
		items[i].q_bytes = 128;
	}
	put(c, q_from, 2 * 128);
	put(c, q_to, 2 * 128);
	const struct kvr_shape sh = make_shape(&numeric_shapes[0], KVR_ELEM_F32);
	DEV_OK(c, kvr_dev_plan(c->dev, &sh, dev_plan_items(c, items, N), N, c->s));
	struct kvr_kv_segment *got = halloc(list_at[N] * sizeof(*got));
	struct kvr_attention_item *got_att = halloc(N * sizeof(*got_att));
	int32_t *got_slots = halloc(N * KMAX * sizeof(int32_t));
	struct kvr_scatter_item *got_sc = halloc(N * KMAX * sizeof(*got_sc));
	uint32_t *got_counts = halloc(N * 2 * sizeof(uint32_t));
	get(c, got, list, list_at[N] * sizeof(*got));
	get(c, got_att, att, N * sizeof(*got_att));
	get(c, got_slots, slots, N * KMAX * sizeof(int32_t));
	get(c, got_sc, scatter, N * KMAX * sizeof(*got_sc));
	get(c, got_counts, counts, N * 2 * sizeof(uint32_t));
	unsigned char *got_q = halloc(2 * 128);
	get(c, got_q, q_to, 2 * 128);
	expect_same_bits("plan (slots): query rows kept", got_q, q_from, 2 * 128, 1);
	/* the reference, on the host copies, computing with the device's slot tiles */
	for (uint32_t i = 0; i < N; i++) {
		items[i].slot_k = dev_of(c, slot_k);
		items[i].slot_v = dev_of(c, slot_v);
	}
	ref_plan(items, N);
	uint32_t misses = 0, hits = 0;
	for (uint32_t i = 0; i < N; i++) {
		const uint32_t k = spec[i][0];
		char what[96];
		snprintf(what, sizeof(what), "%s: plan (slots) item %u: slot table", c->name, i);
		expect_same_bits(what, got_slots + i * KMAX, slots + i * KMAX, k * sizeof(int32_t), 4);
		snprintf(what, sizeof(what), "%s: plan (slots) item %u: counts", c->name, i);
		expect_same_bits(what, got_counts + 2 * i, counts + 2 * i, 2 * sizeof(uint32_t), 4);
		snprintf(what, sizeof(what), "%s: plan (slots) item %u: scatter items", c->name, i);
		expect_same_bits(what, got_sc + i * KMAX, scatter + i * KMAX, k * sizeof(*got_sc), 8);
		snprintf(what, sizeof(what), "%s: plan (slots) item %u: n_segments", c->name, i);
		expect_same_bits(what, &got_att[i].n_segments, &att[i].n_segments, 4, 4);
		snprintf(what, sizeof(what), "%s: plan (slots) item %u: segments", c->name, i);
		expect_same_bits(what, got + list_at[i], list + list_at[i], att[i].n_segments * sizeof(*got), 8);
		misses += counts[2 * i], hits += counts[2 * i + 1];
	}
	cr_assert(misses > 0 && hits > 0, "%u misses, %u hits: the case must have both", misses, hits);
	expect_no_failed_launch(c);
}

/* ================================================================== select */

/* Run select on c over host scores/selected buffers (mirrored here) and
 * return what the device wrote into `selected`. */
static int32_t *device_select(struct dctx *c, const struct kvr_shape *sh,
			      const struct kvr_score_item *items, uint32_t n, const float *scores,
			      size_t n_scores, const int32_t *selected, size_t n_selected)
{
	put(c, scores, n_scores * sizeof(float));
	put(c, selected, n_selected * sizeof(int32_t));
	DEV_OK(c, kvr_dev_select(c->dev, sh, dev_score_items(c, items, n), n, c->s));
	int32_t *got = halloc(n_selected * sizeof(int32_t));
	get(c, got, selected, n_selected * sizeof(int32_t));
	return got;
}

/* One select item of the tie tests: candidates [begin, begin + n_cand), k. */
struct select_case {
	/* mode 0: few values; 1: all equal; 2: distinct; 3: rising page after
	 * page, three pages per value (ties); 4: every 7th page high, the rest
	 * few values (one column of the lower bound's far above the others) */
	uint32_t begin, n_cand, k, mode;
};

/* The items of a select_case list for n_kv heads, over one scores buffer and
 * one selected buffer (each item's k·n_kv entries then SEL_GUARD sentinels). */
struct select_set {
	const struct select_case *spec;
	uint32_t n, n_kv;
	struct kvr_score_item *items;
	float *scores;
	int32_t *sel;
	size_t n_scores, n_sel, *k_at;
};

/* Scores drawn from a few tie-prone values (signed zeros included), all
 * equal (mode 1) or distinct in [lo, hi) (mode 2); `selected` all sentinels. */
static struct select_set select_set_build(struct rng *r, const struct select_case *spec,
					  uint32_t n, uint32_t n_kv, double lo, double hi)
{
	static const float few[] = { -1.5f, -0.0f, 0.0f, 0.25f, 1.0f, 3.0f, 1e-3f };
	struct select_set set = { .spec = spec, .n = n, .n_kv = n_kv };
	set.items = halloc(n * sizeof(*set.items));
	set.k_at = halloc(n * sizeof(*set.k_at));
	size_t *s_at = halloc(n * sizeof(*s_at));
	for (uint32_t i = 0; i < n; i++) {
		s_at[i] = set.n_scores;
		set.k_at[i] = set.n_sel;
		set.n_scores += (size_t)n_kv * spec[i].n_cand;
		set.n_sel += (size_t)n_kv * spec[i].k + SEL_GUARD;
	}
	set.n_scores++; /* never empty */
	set.scores = halloc(set.n_scores * sizeof(float));
	set.sel = halloc(set.n_sel * sizeof(int32_t));
	for (size_t x = 0; x < set.n_sel; x++)
		set.sel[x] = SEL_SENTINEL;
	for (uint32_t i = 0; i < n; i++) {
		for (size_t x = 0; x < (size_t)n_kv * spec[i].n_cand; x++) {
			float v = few[rng_below(r, ARRAY_LEN(few))];
			if (spec[i].mode == 1)
				v = 0.5f;
			else if (spec[i].mode == 2)
				v = (float)rng_uniform(r, lo, hi);
			else if (spec[i].mode == 3)
				v = (float)((x % spec[i].n_cand) / 3) * 0.125f - 4.0f;
			else if (spec[i].mode == 4 && (x % spec[i].n_cand) % 7 == 0)
				v = 100.0f + (float)rng_below(r, 4);
			set.scores[s_at[i] + x] = v;
		}
		set.items[i] = (struct kvr_score_item){
			.scores = set.scores + s_at[i], .selected = set.sel + set.k_at[i],
			.cand_begin = spec[i].begin, .cand_end = spec[i].begin + spec[i].n_cand,
			.k = spec[i].k };
	}
	return set;
}

/* got (a device's output over set->sel) against set->sel, which ref_select
 * has filled, item by item with its guard entries. */
static void select_set_expect(const struct select_set *set, const int32_t *got, const char *label)
{
	for (uint32_t i = 0; i < set->n; i++) {
		const struct select_case *sc = &set->spec[i];
		char what[200];
		snprintf(what, sizeof(what),
			 "%s n_kv %u item %u (pages %u..%u, k %u; then %u guard entries)", label,
			 set->n_kv, i, sc->begin, sc->begin + sc->n_cand, sc->k, SEL_GUARD);
		expect_same_bits(what, got + set->k_at[i], set->sel + set->k_at[i],
				 ((size_t)set->n_kv * sc->k + SEL_GUARD) * sizeof(int32_t), 4);
	}
}

/*
 * Random scores full of ties (drawn from a few values, signed zeros
 * included), all-equal scores, distinct ones, scores rising page after page
 * and spikes every 7th page (the cpu select's lower bound at its tightest and
 * its loosest); k from 0 past n_cand, an
 * empty candidate range, ranges that do not start at page 0, over 256
 * candidates. Exact: ties to the lower page, ascending output, -1 padding,
 * k = 0 writes nothing (the guard entries after every item must survive).
 */
CONFORMANCE_TEST(select_ties_and_k)
{
	struct dctx *c = &e->main;
	struct rng r = { 0x5e1ec7 };
	static const struct select_case spec[] = {
		{ 0, 1, 1, 0 },    { 2, 7, 3, 0 },   { 1, 40, 1, 0 },    { 4, 40, 39, 0 },
		{ 0, 40, 40, 0 },  { 7, 40, 45, 0 }, { 0, 300, 17, 2 },  { 3, 300, 0, 0 },
		{ 9, 0, 3, 0 },    { 0, 12, 5, 1 },  { 6, 33, 16, 0 },   { 0, 260, 250, 0 },
		{ 0, 1000, 32, 3 }, { 5, 999, 32, 4 }, { 0, 640, 64, 3 }, { 2, 1000, 32, 0 },
		{ 0, 2000, 100, 4 }, { 1, 700, 32, 1 },
	};
	for (uint32_t n_kv = 1; n_kv <= 3; n_kv += 2) {
		const struct shape_cfg cfg = { n_kv, n_kv, 64, 16, 0 };
		const struct kvr_shape sh = make_shape(&cfg, KVR_ELEM_F32);
		const struct select_set set =
			select_set_build(&r, spec, ARRAY_LEN(spec), n_kv, 0.0, 1.0);
		int32_t *got = device_select(c, &sh, set.items, set.n, set.scores, set.n_scores,
					     set.sel, set.n_sel);
		ref_select(&sh, set.items, set.n);
		char label[64];
		snprintf(label, sizeof(label), "%s: select", c->name);
		select_set_expect(&set, got, label);
	}
}

/*
 * The CUB twin of select (cuda_topk.cu), which the backend's select op never
 * runs (it has no host-side item sizes): through cuda_backend.cu's test hook,
 * on ties, k from 0 past n_cand, empty ranges, all-equal scores, and segments
 * large enough for several radix passes and a multi-word bitmap (70000
 * candidates: 17 index bits), against the reference; the same items through
 * kvr_dev_select must agree. cuda only (it skips elsewhere).
 */
static void t_select_cub_path(struct env *e)
{
	struct dctx *c = &e->main;
	if (!kvr_cuda_dev_select_cub)
		cr_skip_test("%s: kvr_cuda_dev_select_cub is not linked (no CUDA backend)", c->name);
	struct rng r = { 0xc0b5e1 };
	static const struct select_case spec[] = {
		{ 0, 1, 1, 0 },     { 2, 7, 3, 0 },       { 1, 40, 1, 0 },    { 4, 40, 39, 0 },
		{ 0, 40, 40, 0 },   { 7, 40, 45, 0 },     { 0, 300, 17, 2 },  { 3, 300, 0, 0 },
		{ 9, 0, 3, 0 },     { 0, 12, 5, 1 },      { 6, 33, 16, 0 },   { 0, 260, 250, 0 },
		{ 16, 4064, 32, 2 }, { 5, 5000, 700, 0 }, { 0, 70000, 33, 2 }, { 1, 9000, 64, 1 },
	};
	for (uint32_t n_kv = 1; n_kv <= 3; n_kv += 2) {
		fresh(e);
		const struct shape_cfg cfg = { n_kv, n_kv, 64, 16, 0 };
		const struct kvr_shape sh = make_shape(&cfg, KVR_ELEM_F32);
		const struct select_set set =
			select_set_build(&r, spec, ARRAY_LEN(spec), n_kv, -4.0, 4.0);
		put(c, set.scores, set.n_scores * sizeof(float));
		put(c, set.sel, set.n_sel * sizeof(int32_t));
		const void *dev_items = dev_score_items(c, set.items, set.n);
		DEV_OK(c, kvr_cuda_dev_select_cub(c->dev, &sh, dev_items, set.items, set.n, c->s));
		int32_t *got = halloc(set.n_sel * sizeof(int32_t));
		get(c, got, set.sel, set.n_sel * sizeof(int32_t));
		/* the twin, into a second copy of the sentinels */
		int32_t *sel2 = halloc(set.n_sel * sizeof(int32_t));
		for (size_t x = 0; x < set.n_sel; x++)
			sel2[x] = SEL_SENTINEL;
		struct kvr_score_item *items2 = halloc(set.n * sizeof(*items2));
		for (uint32_t i = 0; i < set.n; i++) {
			items2[i] = set.items[i];
			items2[i].selected = sel2 + set.k_at[i];
		}
		int32_t *got2 = device_select(c, &sh, items2, set.n, set.scores, set.n_scores, sel2,
					      set.n_sel);
		ref_select(&sh, set.items, set.n);
		char label[64];
		snprintf(label, sizeof(label), "%s: CUB select", c->name);
		select_set_expect(&set, got, label);
		snprintf(label, sizeof(label), "%s: select (twin)", c->name);
		select_set_expect(&set, got2, label);
	}
}

Test(cuda, select_cub_path, .timeout = TEST_TIMEOUT_S)
{
	run_case(CASE_CUDA, t_select_cub_path);
}

/*
 * The ordering rule on special values, against a ranking written out by hand
 * (so the reference's reading of kernels.h is checked too): +NaN above +inf,
 * -NaN below -inf, +0 above -0, a subnormal above +0, ties to the lower page.
 */
CONFORMANCE_TEST(select_special_values)
{
	struct dctx *c = &e->main;
	const float pos_nan = kvr_bits_to_f32(0x7fc00000u), neg_nan = kvr_bits_to_f32(0xffc00000u);
	const float scores[11] = { 1.0f,  pos_nan, -INFINITY, INFINITY, neg_nan, 0.5f,
				   1.0f,  -0.0f,   0.0f,      -2.0f,    1e-45f };
	/* candidate indices from highest to lowest */
	static const uint32_t rank[11] = { 1, 3, 0, 6, 5, 10, 8, 7, 9, 2, 4 };
	enum { BEGIN = 10, N_CAND = 11, N_K = 13 };
	const struct shape_cfg cfg = { 1, 1, 64, 16, 0 };
	const struct kvr_shape sh = make_shape(&cfg, KVR_ELEM_F32);
	/* one item per k = 1..13, all over the same scores */
	struct kvr_score_item items[N_K];
	const size_t n_sel = (size_t)N_K * (N_K + 1) / 2;
	int32_t *sel = halloc(n_sel * sizeof(int32_t));
	float *s = halloc(sizeof(scores));
	memcpy(s, scores, sizeof(scores));
	size_t at = 0;
	for (uint32_t k = 1; k <= N_K; k++, at += k - 1) {
		items[k - 1] = (struct kvr_score_item){ .scores = s, .selected = sel + at,
							.cand_begin = BEGIN,
							.cand_end = BEGIN + N_CAND, .k = k };
	}
	int32_t *got = device_select(c, &sh, items, N_K, s, N_CAND, sel, n_sel);
	int32_t *via_ref = halloc(n_sel * sizeof(int32_t));
	for (uint32_t k = 1; k <= N_K; k++) {
		const int32_t *g = got + (items[k - 1].selected - sel);
		/* expected: the top k of the ranking, ascending, then -1 */
		int32_t want[N_K];
		uint32_t taken = 0;
		for (uint32_t j = 0; j < N_CAND; j++)
			for (uint32_t x = 0; x < k && x < N_CAND; x++)
				if (rank[x] == j)
					want[taken++] = (int32_t)(BEGIN + j);
		for (uint32_t x = taken; x < k; x++)
			want[x] = -1;
		for (uint32_t x = 0; x < k; x++)
			cr_assert_eq(g[x], want[x],
				     "%s: select special values, k = %u: entry %u is %d, want %d",
				     c->name, k, x, g[x], want[x]);
		items[k - 1].selected = via_ref + (items[k - 1].selected - sel);
	}
	ref_select(&sh, items, N_K); /* the reference must agree with the hand ranking */
	expect_same_bits("reference select vs hand ranking (test bug)", via_ref, got,
			 n_sel * sizeof(int32_t), 4);
}

/* ================================================================== similarity */

/*
 * q_prev uniform in [-1, 1]^d, and q at cosine `target` to it (before the
 * rounding to the element type): q = |q_prev|·(target·u + sqrt(1-target²)·w)
 * with u = q_prev/|q_prev| and w a unit vector orthogonal to u, then scaled by
 * a random factor (the cosine must not depend on the norms).
 */
static void query_pair(struct rng *r, uint32_t d, double target, double *q, double *q_prev)
{
	double nu = 0.0, dot = 0.0, nw = 0.0;
	double *w = q; /* q's storage holds w until the end */
	for (uint32_t c = 0; c < d; c++) {
		q_prev[c] = rng_uniform(r, -1.0, 1.0);
		w[c] = rng_uniform(r, -1.0, 1.0);
		nu += q_prev[c] * q_prev[c];
	}
	nu = sqrt(nu);
	for (uint32_t c = 0; c < d; c++)
		dot += w[c] * q_prev[c] / nu;
	for (uint32_t c = 0; c < d; c++) {
		w[c] -= dot * q_prev[c] / nu;
		nw += w[c] * w[c];
	}
	nw = sqrt(nw);
	const double f = rng_uniform(r, 0.5, 2.0), sn = sqrt(1.0 - target * target);
	for (uint32_t c = 0; c < d; c++)
		q[c] = f * (target * q_prev[c] + sn * nu * w[c] / nw);
}

struct sim_case {
	struct kvr_similarity_item items[3];
	void *q, *q_prev;
	size_t q_bytes;
	float *cosine;
	uint8_t *corrected;
};

/*
 * Item 0: group cosines at 0.9 ± 2e-3 (either side of tau = 0.9), 0.99, 0.3
 * and -0.5, the G heads of a group spread around the target. Item 1: the
 * first query head of each group has a zero vector (its cosine is 0, the
 * group's mean includes it). Item 2: a NaN in the last query head's q (that
 * group's cosine is NaN and it is corrected).
 */
static void build_sim_case(struct rng *r, const struct kvr_shape *sh, struct sim_case *sc)
{
	static const double targets[] = { 0.902, 0.898, 0.99, 0.3, -0.5 };
	const uint32_t type = sh->elem_type, d = sh->head_dim, n_qo = sh->n_qo_heads;
	const uint32_t G = n_qo / sh->n_kv_heads, n_kv = sh->n_kv_heads;
	const size_t eb = ebytes(type);
	sc->q_bytes = 3ull * n_qo * d * eb;
	sc->q = halloc(sc->q_bytes);
	sc->q_prev = halloc(sc->q_bytes);
	sc->cosine = halloc(3 * n_kv * sizeof(float));
	memset(sc->cosine, 0xff, 3 * n_kv * sizeof(float));
	sc->corrected = halloc(3 * n_kv);
	memset(sc->corrected, 0x77, 3 * n_kv);
	double *a = halloc(d * sizeof(double)), *b = halloc(d * sizeof(double));
	for (uint32_t i = 0; i < 3; i++) {
		for (uint32_t h = 0; h < n_qo; h++) {
			const uint32_t m = h / G, g = h % G;
			const double t = i == 0 ? targets[(m + 2 * i) % ARRAY_LEN(targets)] +
							  (g - (G - 1) / 2.0) * 1e-3
						: 0.95;
			query_pair(r, d, t, a, b);
			if (i == 1 && g == 0)
				for (uint32_t c = 0; c < d; c++)
					((h & 1) ? b : a)[c] = 0.0; /* q or q_prev zero */
			const uint64_t at = ((uint64_t)i * n_qo + h) * d;
			for (uint32_t c = 0; c < d; c++) {
				ref_store(sc->q, type, at + c, a[c]);
				ref_store(sc->q_prev, type, at + c, b[c]);
			}
			if (i == 2 && h == n_qo - 1)
				store_nan(sc->q, type, at + 3);
		}
		sc->items[i] = (struct kvr_similarity_item){
			.q = elem_ptr(sc->q, type, (uint64_t)i * n_qo * d),
			.q_prev = elem_ptr(sc->q_prev, type, (uint64_t)i * n_qo * d),
			.cosine = sc->cosine + i * n_kv,
			.corrected = sc->corrected + i * n_kv,
		};
	}
}

/* Check one call's cosines and flags (items [0, n)) against the reference. */
static void check_similarity(const struct env *e, const char *what, const struct kvr_shape *sh,
			     const struct sim_case *sc, uint32_t n, const float *cos_got,
			     const uint8_t *flag_got)
{
	const uint32_t n_kv = sh->n_kv_heads;
	double want[64];
	for (uint32_t i = 0; i < n; i++) {
		ref_similarity(sh, &sc->items[i], want);
		for (uint32_t m = 0; m < n_kv; m++) {
			const float g = cos_got[i * n_kv + m];
			const uint8_t f = flag_got[i * n_kv + m];
			if (isnan(want[m])) {
				cr_assert(isnan(g) && f == 1,
					  "%s: %s item %u KV head %u: got cosine %g corrected %u, "
					  "want NaN and corrected",
					  e->bc->name, what, i, m, g, f);
				continue;
			}
			cr_assert(fabs(g - want[m]) <= REF_COSINE_TOL,
				  "%s: %s item %u KV head %u: cosine %.9g, want %.9g", e->bc->name,
				  what, i, m, g, want[m]);
			cr_assert(f <= 1, "%s: %s item %u KV head %u: corrected is %u, not 0 or 1",
				  e->bc->name, what, i, m, f);
			if (fabs(want[m] - sh->tau) > REF_COSINE_TOL)
				cr_assert_eq(f, !(want[m] >= sh->tau),
					     "%s: %s item %u KV head %u: cosine %.9g vs tau %.9g: "
					     "corrected %u",
					     e->bc->name, what, i, m, want[m], sh->tau, f);
		}
	}
}

/*
 * similarity: cosines within REF_COSINE_TOL and flags exact, first with
 * tau = 0.9 (item 0's groups sit 2e-3 either side of it), then, for every
 * group of item 0, with tau 1.5e-5 above and below its reference cosine (just
 * outside the band where flags are not checked): the flag must flip there.
 */
static void similarity_case(struct env *e, uint32_t ci, uint32_t ti)
{
	CASE_SETUP(numeric_shapes, 0xc051);
	const uint32_t n_kv = sh.n_kv_heads;
	struct sim_case sc;
	build_sim_case(&r, &sh, &sc);
	put(c, sc.q, sc.q_bytes);
	put(c, sc.q_prev, sc.q_bytes);
	put(c, sc.cosine, 3 * n_kv * sizeof(float));
	put(c, sc.corrected, 3 * n_kv);
	const void *items = dev_similarity_items(c, sc.items, 3);
	float *cos_got = halloc(3 * n_kv * sizeof(float));
	uint8_t *flag_got = halloc(3 * n_kv);
	char what[96];
	snprintf(what, sizeof(what), "similarity %s config %u", type_names[ti], ci);
	DEV_OK(c, kvr_dev_similarity(c->dev, &sh, items, 3, c->s));
	get(c, cos_got, sc.cosine, 3 * n_kv * sizeof(float));
	get(c, flag_got, sc.corrected, 3 * n_kv);
	check_similarity(e, what, &sh, &sc, 3, cos_got, flag_got);

	double want[64];
	ref_similarity(&sh, &sc.items[0], want);
	for (uint32_t m = 0; m < n_kv; m++)
		for (int side = -1; side <= 1; side += 2) {
			sh.tau = (float)(want[m] - side * 1.5 * REF_COSINE_TOL);
			DEV_OK(c, kvr_dev_similarity(c->dev, &sh, items, 1, c->s));
			get(c, cos_got, sc.cosine, n_kv * sizeof(float));
			get(c, flag_got, sc.corrected, n_kv);
			snprintf(what, sizeof(what),
				 "similarity %s config %u, cosine just %s tau", type_names[ti],
				 ci, side > 0 ? "above" : "below");
			cr_assert_eq(flag_got[m], side < 0,
				     "%s: %s: KV head %u: cosine %.9g, tau %.9g: corrected "
				     "%u",
				     c->name, what, m, want[m], sh.tau, flag_got[m]);
			check_similarity(e, what, &sh, &sc, 1, cos_got, flag_got);
		}
}

CONFORMANCE_CASES(similarity, ARRAY_LEN(numeric_shapes))

/* ================================================================== attention */

/* Segment builders: one HND page of a pool ([n_kv][2][p][d] per page: head m
 * at m·2pd, values p·d after keys) and rows of an NHD tile pair ([p][n_kv][d]). */
static struct kvr_kv_segment hnd_segment(const struct kvr_shape *sh, void *pool, uint32_t page,
					 uint32_t n_tokens)
{
	const uint32_t type = sh->elem_type, p = sh->page_tokens, d = sh->head_dim;
	const uint64_t at = (uint64_t)page * sh->n_kv_heads * 2 * p * d;
	return (struct kvr_kv_segment){ .k = elem_ptr(pool, type, at),
					.v = elem_ptr(pool, type, at + (uint64_t)p * d),
					.n_tokens = n_tokens,
					.row_stride = d,
					.head_stride = 2 * p * d };
}

static struct kvr_kv_segment nhd_segment(const struct kvr_shape *sh, void *k_tiles, void *v_tiles,
					 uint32_t tile, uint32_t row0, uint32_t n_tokens)
{
	const uint32_t type = sh->elem_type, row = sh->n_kv_heads * sh->head_dim;
	const uint64_t at = ((uint64_t)tile * sh->page_tokens + row0) * row;
	return (struct kvr_kv_segment){ .k = elem_ptr(k_tiles, type, at),
					.v = elem_ptr(v_tiles, type, at),
					.n_tokens = n_tokens,
					.row_stride = row,
					.head_stride = sh->head_dim };
}

/* A q buffer for n items and an output buffer prefilled with all-ones bytes
 * (NaN in every type: an output the kernel forgets to write shows). */
static void *new_queries(struct rng *r, const struct kvr_shape *sh, uint32_t n, double mag)
{
	const uint64_t len = (uint64_t)n * sh->n_qo_heads * sh->head_dim;
	void *q = halloc(len * ebytes(sh->elem_type));
	fill_uniform(r, q, sh->elem_type, len, -mag, mag);
	return q;
}

static void *new_outputs(const struct kvr_shape *sh, uint32_t n)
{
	const size_t bytes = (size_t)n * sh->n_qo_heads * sh->head_dim * ebytes(sh->elem_type);
	void *o = halloc(bytes);
	memset(o, 0xff, bytes);
	return o;
}

/* An item's segment_lse array (n_qo heads by n_segments), on c and NaN-filled
 * so an entry the kernel forgets to write shows. */
static float *new_lse(struct dctx *c, const struct kvr_shape *sh, uint32_t n_segments)
{
	const size_t bytes = (size_t)sh->n_qo_heads * (n_segments ? n_segments : 1) * sizeof(float);
	float *lse = halloc(bytes);
	memset(lse, 0xff, bytes);
	put(c, lse, bytes);
	return lse;
}

/* Query `to` (of per elements) becomes query `from` times factor: large
 * logits, which an unsafe softmax would overflow. */
static void scaled_query(void *q, uint32_t type, uint64_t per, uint32_t to, uint32_t from,
			 double factor)
{
	for (uint64_t x = 0; x < per; x++)
		ref_store(q, type, to * per + x, factor * ref_load(q, type, from * per + x));
}

/* Item i: query and output i of q and out (per elements each), over
 * segments [first[i], first[i] + count[i]). */
static void attention_items(struct kvr_attention_item *items, uint32_t n, void *q, void *out,
			    uint32_t type, uint64_t per, const uint32_t *first, const uint32_t *count)
{
	for (uint32_t i = 0; i < n; i++)
		items[i] = (struct kvr_attention_item){
			.q = elem_ptr(q, type, i * per), .out = elem_ptr(out, type, i * per),
			.first_segment = first[i], .n_segments = count[i] };
}

/* Run attention (att, over segs) or dense attention (dense) on c, and
 * compare every item's output with the reference. */
static void run_and_check(struct env *e, struct dctx *c, const char *what,
			  const struct kvr_shape *sh, uint32_t n, void *q, void *out,
			  const struct kvr_attention_item *att, const struct kvr_kv_segment *segs,
			  uint32_t n_segs, const struct kvr_dense_item *dense)
{
	const size_t per = (size_t)sh->n_qo_heads * sh->head_dim, eb = ebytes(sh->elem_type);
	put(c, q, n * per * eb);
	put(c, out, n * per * eb);
	if (att)
		DEV_OK(c, kvr_dev_attention(c->dev, sh, dev_attention_items(c, att, n), n,
					    dev_segments(c, segs, n_segs), n_segs, c->s));
	else
		DEV_OK(c, kvr_dev_dense(c->dev, sh, dev_dense_items(c, dense, n), n, c->s));
	void *got = halloc(n * per * eb);
	get(c, got, out, n * per * eb);
	double *ref = halloc(per * sizeof(double));
	struct ref_head_scale *scale = halloc(sh->n_qo_heads * sizeof(*scale));
	for (uint32_t i = 0; i < n; i++) {
		char w[128];
		snprintf(w, sizeof(w), "%s item %u", what, i);
		if (att)
			ref_attention_at(sh, att, i, segs, ref, scale);
		else
			ref_dense(sh, &dense[i], ref, scale);
		check_heads(e, w, sh, (unsigned char *)got + i * per * eb, ref, scale);
	}
}

static void attention_and_check(struct env *e, struct dctx *c, const char *what,
				const struct kvr_shape *sh, const struct kvr_attention_item *items,
				uint32_t n, const struct kvr_kv_segment *segs, uint32_t n_segs,
				void *q, void *out)
{
	run_and_check(e, c, what, sh, n, q, out, items, segs, n_segs, NULL);
}

/* n_items items over segments [first[i], first[i] + count[i]) with random
 * queries (item `to`'s: item `from`'s x40, logits in the hundreds), run
 * and checked against the reference. */
static void attend_listed(struct env *e, struct dctx *c, struct rng *r, const struct kvr_shape *sh,
			  const struct kvr_kv_segment *segs, uint32_t n_segs, const uint32_t *first,
			  const uint32_t *count, uint32_t n_items, uint32_t to, uint32_t from, const char *what)
{
	struct kvr_attention_item items[8];
	cr_assert(n_items <= 8);
	void *q = new_queries(r, sh, n_items, 2.0), *out = new_outputs(sh, n_items);
	const uint64_t per = (uint64_t)sh->n_qo_heads * sh->head_dim;
	scaled_query(q, sh->elem_type, per, to, from, 40.0);
	attention_items(items, n_items, q, out, sh->elem_type, per, first, count);
	attention_and_check(e, c, what, sh, items, n_items, segs, n_segs, q, out);
}

/*
 * Items of different lengths in one call over HND pages and NHD tiles mixed
 * in one item: no segments at all (zeros); exactly one page; pages and full
 * and partial tiles with an empty segment among them; a tile read from its
 * third row; a lone empty segment (zeros); item 2 again with queries 40x
 * larger (logits in the hundreds: the softmax must subtract its running max);
 * and one NHD segment of 2p + 3 rows running across three contiguous tiles
 * (a window-like run longer than any kernel's token block) before a page.
 */
static void attention_case(struct env *e, uint32_t ci, uint32_t ti)
{
	CASE_SETUP(numeric_shapes, 0xa77e);
	enum { PAGES = 5, TILES = 3, ITEMS = 7 };
	const uint32_t p = sh.page_tokens;
	const uint64_t page = 2ull * sh.n_kv_heads * p * sh.head_dim,
		       tile = (uint64_t)p * sh.n_kv_heads * sh.head_dim;
	const size_t eb = ebytes(type);
	void *pool = halloc(PAGES * page * eb), *kt = halloc(TILES * tile * eb),
	     *vt = halloc(TILES * tile * eb);
	fill_uniform(&r, pool, type, PAGES * page, -1.0, 1.0);
	fill_uniform(&r, kt, type, TILES * tile, -1.0, 1.0);
	fill_uniform(&r, vt, type, TILES * tile, -1.0, 1.0);
	put(c, pool, PAGES * page * eb);
	put(c, kt, TILES * tile * eb);
	put(c, vt, TILES * tile * eb);

	const struct kvr_kv_segment segs[] = {
		/* item 1: one page */
		hnd_segment(&sh, pool, 0, p),
		/* item 2 (and 5) */
		hnd_segment(&sh, pool, 1, p),
		nhd_segment(&sh, kt, vt, 0, 0, p),
		hnd_segment(&sh, pool, 2, p),
		nhd_segment(&sh, kt, vt, 1, 0, 0),
		nhd_segment(&sh, kt, vt, 1, 0, 5),
		/* item 3 */
		nhd_segment(&sh, kt, vt, 2, 2, p - 2),
		hnd_segment(&sh, pool, 3, p),
		hnd_segment(&sh, pool, 4, p - 1),
		/* item 4 */
		nhd_segment(&sh, kt, vt, 2, 0, 0),
		/* item 6 */
		nhd_segment(&sh, kt, vt, 0, 1, 2 * p + 3),
		hnd_segment(&sh, pool, 0, p),
	};
	static const uint32_t first[ITEMS] = { 0, 0, 1, 6, 9, 1, 10 };
	static const uint32_t count[ITEMS] = { 0, 1, 5, 3, 1, 5, 2 };
	char what[96];
	snprintf(what, sizeof(what), "attention config %u", ci);
	/* item 5: item 2's query x40 */
	attend_listed(e, c, &r, &sh, segs, ARRAY_LEN(segs), first, count, ITEMS, 5, 2, what);
}

CONFORMANCE_CASES(attention, ARRAY_LEN(numeric_shapes))

/*
 * Estimate segments (KVR_KV_ESTIMATE) beside pages, as the sparse
 * modes' estimate builds them: rows of mean keys and values in a table of
 * summaries with estimate rows (row_stride: a page's summary), each
 * standing for p tokens (ln p on its logit). Items: one estimate row alone
 * (its output is the mean value, whatever the weight); a page, an estimate
 * run of three pages and a tile; the same with queries 40x larger (the
 * estimate holds the running maximum); two estimate runs around a page
 * (the order of segments does not matter to the result).
 */
static void attention_estimate_case(struct env *e, uint32_t ci, uint32_t ti)
{
	CASE_SETUP(numeric_shapes, 0xe57a);
	enum { PAGES = 2, SUMS = 6, ITEMS = 4 };
	const uint32_t p = sh.page_tokens, d = sh.head_dim, n_kv = sh.n_kv_heads;
	const uint64_t page = 2ull * n_kv * p * d, tile = (uint64_t)p * n_kv * d, sum = 4ull * n_kv * d;
	const size_t eb = ebytes(type);
	void *pool = halloc(PAGES * page * eb), *kt = halloc(tile * eb), *vt = halloc(tile * eb);
	void *summ = halloc(SUMS * sum * eb);
	fill_uniform(&r, pool, type, PAGES * page, -1.0, 1.0);
	fill_uniform(&r, kt, type, tile, -1.0, 1.0);
	fill_uniform(&r, vt, type, tile, -1.0, 1.0);
	fill_uniform(&r, summ, type, SUMS * sum, -1.0, 1.0);
	put(c, pool, PAGES * page * eb);
	put(c, kt, tile * eb);
	put(c, vt, tile * eb);
	put(c, summ, SUMS * sum * eb);
	/* KV head m's mean key of summary j at j·sum + (2·n_kv + 2m)·d; the
	 * items are whole layers here, so head_stride steps 2d between heads */
	const struct kvr_kv_segment est[] = {
		{ .k = elem_ptr(summ, type, 2ull * n_kv * d), .v = elem_ptr(summ, type, 2ull * n_kv * d + d),
		  .n_tokens = 1, .row_stride = (uint32_t)sum, .head_stride = 2 * d, .format = KVR_KV_ESTIMATE },
		{ .k = elem_ptr(summ, type, 1 * sum + 2ull * n_kv * d),
		  .v = elem_ptr(summ, type, 1 * sum + 2ull * n_kv * d + d), .n_tokens = 3,
		  .row_stride = (uint32_t)sum, .head_stride = 2 * d, .format = KVR_KV_ESTIMATE },
		{ .k = elem_ptr(summ, type, 4 * sum + 2ull * n_kv * d),
		  .v = elem_ptr(summ, type, 4 * sum + 2ull * n_kv * d + d), .n_tokens = 2,
		  .row_stride = (uint32_t)sum, .head_stride = 2 * d, .format = KVR_KV_ESTIMATE },
	};
	const struct kvr_kv_segment segs[] = {
		est[0],                                            /* item 0 */
		hnd_segment(&sh, pool, 0, p), est[1],              /* items 1, 2 */
		nhd_segment(&sh, kt, vt, 0, 0, p),
		est[2], hnd_segment(&sh, pool, 1, p), est[1],      /* item 3 */
	};
	static const uint32_t first[ITEMS] = { 0, 1, 1, 4 };
	static const uint32_t count[ITEMS] = { 1, 3, 3, 3 };
	char what[96];
	snprintf(what, sizeof(what), "attention (estimates) config %u", ci);
	/* item 2: item 1's query x40 */
	attend_listed(e, c, &r, &sh, segs, ARRAY_LEN(segs), first, count, ITEMS, 2, 1, what);
}

CONFORMANCE_CASES(attention_estimate, ARRAY_LEN(numeric_shapes))

/*
 * Causal query blocks (KVR_SHAPE_CAUSAL, the prefill): each KV head's group
 * holds NQ query tokens of the shape's G query heads each, at positions
 * pos0, pos0 + 1, ..., and a query sees the item's tokens up to its own,
 * counted over the segments. Items: HND pages and NHD tile rows with an empty
 * segment among them (3p + 4 tokens); three whole pages; no segments
 * (zeros); and a quantised prefix (a K8V4 page, tile rows, a partial K4V2
 * page). pos0 puts the diagonal at the very first token (each query sees 1 to
 * NQ tokens), inside a page and across a segment boundary, on the last tokens
 * (part of the block sees past every segment) and past them all; one block's
 * queries are 40x larger (logits in the hundreds); then three blocks in one
 * call, each item at its block's position.
 */
static void attention_causal_case(struct env *e, uint32_t ci, uint32_t ti)
{
	CASE_SETUP(numeric_shapes, 0xca5a);
	enum { PAGES = 6, ITEMS = 4 };
	const uint32_t p = sh.page_tokens, n_kv = sh.n_kv_heads, hq = sh.n_qo_heads / n_kv;
	const uint32_t NQ = 64 / hq < 5 ? 64 / hq : 5; /* at most 64 query heads per KV head */
	sh.n_qo_heads *= NQ;
	sh.flags = KVR_SHAPE_CAUSAL;
	sh.causal_heads_per_query = hq;
	const uint32_t row = n_kv * sh.head_dim;
	const uint64_t page = 2ull * n_kv * p * sh.head_dim, tile = (uint64_t)p * row;
	const size_t eb = ebytes(type);
	void *pool = halloc(PAGES * page * eb), *kt = halloc(tile * eb), *vt = halloc(tile * eb);
	fill_uniform(&r, pool, type, PAGES * page, -1.0, 1.0);
	fill_uniform(&r, kt, type, tile, -1.0, 1.0);
	fill_uniform(&r, vt, type, tile, -1.0, 1.0);
	put(c, pool, PAGES * page * eb);
	put(c, kt, tile * eb);
	put(c, vt, tile * eb);
	/* quantised pages, from random NHD rows as offload makes them */
	struct kvr_quant_geometry g8, g4;
	cr_assert_eq(kvr_quant_geometry_init(&g8, p, sh.head_dim, n_kv, KVR_KV_K8V4), 0);
	cr_assert_eq(kvr_quant_geometry_init(&g4, p, sh.head_dim, n_kv, KVR_KV_K4V2), 0);
	const struct kvr_quant_geometry *qg[2] = { &g8, &g4 };
	unsigned char *qpages[2];
	void *rows_k = halloc(tile * eb), *rows_v = halloc(tile * eb);
	float *scratch = halloc(sh.head_dim * sizeof(float));
	for (uint32_t i = 0; i < 2; i++) {
		fill_uniform(&r, rows_k, type, tile, -1.0, 1.0);
		fill_uniform(&r, rows_v, type, tile, -1.0, 1.0);
		qpages[i] = halloc(qg[i]->page_bytes);
		for (uint32_t m = 0; m < n_kv; m++)
			kvr_quant_run_from_nhd(qg[i], rows_k, rows_v, row, type, m, i ? p - 3 : p,
					       qpages[i] + (uint64_t)m * qg[i]->head_bytes, scratch);
		put(c, qpages[i], qg[i]->page_bytes);
	}
	const struct kvr_kv_segment segs[] = {
		/* item 0: 3p + 4 tokens */
		hnd_segment(&sh, pool, 0, p),
		nhd_segment(&sh, kt, vt, 0, 1, p - 1),
		hnd_segment(&sh, pool, 1, p),
		nhd_segment(&sh, kt, vt, 0, 0, 0),
		hnd_segment(&sh, pool, 2, 5),
		/* item 1: three pages */
		hnd_segment(&sh, pool, 3, p),
		hnd_segment(&sh, pool, 4, p),
		hnd_segment(&sh, pool, 5, p),
		/* item 3: quantised, 3p - 4 tokens */
		{ .k = qpages[0], .n_tokens = p, .head_stride = (uint32_t)g8.head_bytes, .format = KVR_KV_K8V4 },
		nhd_segment(&sh, kt, vt, 0, 2, p - 2),
		{ .k = qpages[1], .n_tokens = p - 3, .head_stride = (uint32_t)g4.head_bytes, .format = KVR_KV_K4V2 },
	};
	static const uint32_t first[ITEMS] = { 0, 5, 8, 8 };
	static const uint32_t count[ITEMS] = { 5, 3, 0, 3 };
	const uint64_t positions[] = { 0, p - 2, 2 * p - 1, 3 * p + 4 - NQ / 2, 3 * p + 10 };
	const uint64_t per = (uint64_t)sh.n_qo_heads * sh.head_dim;
	for (uint32_t k = 0; k < ARRAY_LEN(positions); k++) {
		sh.causal_first_position = positions[k];
		/* odd positions also ask each segment's log-sum-exp (over the tokens
		 * each head sees), as the spill tier's windows do */
		const int with_lse = k % 2;
		sh.flags = KVR_SHAPE_CAUSAL | (with_lse ? KVR_SHAPE_SEGMENT_LSE : 0);
		void *q = new_queries(&r, &sh, ITEMS, k == 2 ? 80.0 : 2.0), *out = new_outputs(&sh, ITEMS);
		struct kvr_attention_item items[ITEMS];
		attention_items(items, ITEMS, q, out, type, per, first, count);
		float *lse[ITEMS];
		for (uint32_t i = 0; i < ITEMS; i++) {
			lse[i] = new_lse(c, &sh, count[i]);
			items[i].segment_lse = with_lse ? lse[i] : NULL;
		}
		char what[96];
		snprintf(what, sizeof(what), "causal attention config %u from position %llu", ci,
			 (unsigned long long)positions[k]);
		attention_and_check(e, c, what, &sh, items, ITEMS, segs, ARRAY_LEN(segs), q, out);
		for (uint32_t i = 0; with_lse && i < ITEMS; i++) {
			const uint32_t n = sh.n_qo_heads * count[i];
			float *got = halloc((n ? n : 1) * sizeof(float));
			double *want = halloc((n ? n : 1) * sizeof(double));
			get(c, got, lse[i], n * sizeof(float));
			ref_attention_lse(&sh, &items[i], segs, want);
			for (uint32_t x = 0; x < n; x++) {
				const int both_inf = isinf(got[x]) && got[x] < 0 && isinf(want[x]) && want[x] < 0;
				cr_assert(both_inf || fabs(got[x] - want[x]) <= 1e-3 * (1.0 + fabs(want[x])),
					  "%s: %s item %u head %u segment %u: log-sum-exp %.7g, want %.7g", c->name, what,
					  i, x / count[i], x % count[i], (double)got[x], want[x]);
			}
		}
	}
	sh.flags = KVR_SHAPE_CAUSAL;
	/* three consecutive blocks in one call (causal_items_per_block): block
	 * b's queries from position p − 2 + b·NQ, over the same items' segments */
	enum { BLOCKS = 3 };
	sh.causal_first_position = p - 2;
	sh.causal_items_per_block = ITEMS;
	void *q = new_queries(&r, &sh, BLOCKS * ITEMS, 2.0), *out = new_outputs(&sh, BLOCKS * ITEMS);
	struct kvr_attention_item items[BLOCKS * ITEMS];
	for (uint32_t b = 0; b < BLOCKS; b++)
		attention_items(items + b * ITEMS, ITEMS, elem_ptr(q, type, b * ITEMS * per),
				elem_ptr(out, type, b * ITEMS * per), type, per, first, count);
	char what[96];
	snprintf(what, sizeof(what), "causal attention config %u, %u blocks in one call", ci, BLOCKS);
	attention_and_check(e, c, what, &sh, items, BLOCKS * ITEMS, segs, ARRAY_LEN(segs), q, out);
}

CONFORMANCE_CASES(attention_causal, ARRAY_LEN(numeric_shapes))

/*
 * Causal query blocks several thousand tokens long (a prefill's late
 * blocks): one item of 3,001 NHD rows as one run, one the same rows as pages
 * of p (the last partial), with the block's queries at positions 1,499.. and
 * 2,996.. (the diagonal inside the last page). G = 3 and d = 64 (SmolLM2's
 * group), f16 and f32.
 */
static void attention_causal_long_case(struct env *e, uint32_t ci, uint32_t ti)
{
	CASE_SETUP(numeric_shapes, 0xca5c);
	if (ci != 2 || all_types[ti] == KVR_ELEM_BF16)
		return; /* one shape; the long lengths are what is checked */
	enum { T = 3001, NQ = 5, ITEMS = 2 };
	const uint32_t p = sh.page_tokens, n_kv = sh.n_kv_heads, hq = sh.n_qo_heads / n_kv;
	sh.n_qo_heads *= NQ;
	sh.flags = KVR_SHAPE_CAUSAL;
	sh.causal_heads_per_query = hq;
	const uint32_t row = n_kv * sh.head_dim;
	const size_t eb = ebytes(type);
	void *kt = halloc((size_t)T * row * eb), *vt = halloc((size_t)T * row * eb);
	fill_uniform(&r, kt, type, (uint64_t)T * row, -1.0, 1.0);
	fill_uniform(&r, vt, type, (uint64_t)T * row, -1.0, 1.0);
	put(c, kt, (size_t)T * row * eb);
	put(c, vt, (size_t)T * row * eb);
	const uint32_t n_pages = (T + p - 1) / p;
	struct kvr_kv_segment *segs = halloc((1 + n_pages) * sizeof(*segs));
	segs[0] = (struct kvr_kv_segment){ .k = kt, .v = vt, .n_tokens = T, .row_stride = row,
					   .head_stride = sh.head_dim };
	for (uint32_t j = 0; j < n_pages; j++)
		segs[1 + j] = nhd_segment(&sh, kt, vt, 0, j * p, j + 1 < n_pages ? p : T - j * p);
	const uint32_t first[ITEMS] = { 0, 1 }, count[ITEMS] = { 1, n_pages };
	const uint64_t per = (uint64_t)sh.n_qo_heads * sh.head_dim;
	const uint64_t positions[] = { 1499, T - 5 };
	for (uint32_t k = 0; k < ARRAY_LEN(positions); k++) {
		sh.causal_first_position = positions[k];
		void *q = new_queries(&r, &sh, ITEMS, 2.0), *out = new_outputs(&sh, ITEMS);
		struct kvr_attention_item items[ITEMS];
		attention_items(items, ITEMS, q, out, type, per, first, count);
		char what[96];
		snprintf(what, sizeof(what), "causal attention over %u tokens from position %llu", T,
			 (unsigned long long)positions[k]);
		attention_and_check(e, c, what, &sh, items, ITEMS, segs, 1 + n_pages, q, out);
	}
}

CONFORMANCE_CASES(attention_causal_long, ARRAY_LEN(numeric_shapes))

/*
 * Decode attention over more tokens than one part of the cpu backend's
 * split (an item's tokens cut at multiples of 2,048 and the parts merged by
 * their log-sum-exps, gpu/cpu/cpu_kernels.c): 5,000 NHD rows as one segment and
 * as pages of p (the last partial), the same query, batched with an item
 * of no segment and one of the first page alone. Each is within its
 * bound of the reference; on the cpu backend the two are equal bit for bit
 * where p ≥ 16, the kernel's softmax block (no cut falls inside a page), and
 * equal bit for bit what a device with no
 * worker and one with three give (the cut does not depend on the threads).
 * A NaN key in the last part makes its KV head's outputs NaN, and only
 * those. Shapes with G = 1 and G = 3.
 */
static void attention_split_case(struct env *e, uint32_t ci, uint32_t ti)
{
	CASE_SETUP(numeric_shapes, 0x5b117);
	if (ci != 0 && ci != 2)
		return; /* two KV heads each; the lengths are what is checked */
	/* items: the rows as one segment, as pages, no segment at all, and the
	 * first page alone (short items batched with split ones) */
	enum { T = 5000, ITEMS = 4, NAN_ITEMS = 2, NAN_TOKEN = 4500 };
	const uint32_t p = sh.page_tokens, d = sh.head_dim, row = sh.n_kv_heads * d;
	const uint32_t G = sh.n_qo_heads / sh.n_kv_heads, n_pages = (T + p - 1) / p;
	const size_t eb = ebytes(type), kv_bytes = (size_t)T * row * eb;
	void *kt = halloc(kv_bytes), *vt = halloc(kv_bytes), *kn = halloc(kv_bytes);
	fill_uniform(&r, kt, type, (uint64_t)T * row, -1.0, 1.0);
	fill_uniform(&r, vt, type, (uint64_t)T * row, -1.0, 1.0);
	memcpy(kn, kt, kv_bytes);
	store_nan(kn, type, (uint64_t)NAN_TOKEN * row + d + 1); /* KV head 1 */
	put(c, kt, kv_bytes);
	put(c, vt, kv_bytes);
	put(c, kn, kv_bytes);
	/* [0]: the rows as one segment; [1 ..]: as pages; then the same two
	 * over kn */
	const uint32_t n_segs = 2 * (1 + n_pages);
	struct kvr_kv_segment *segs = halloc(n_segs * sizeof(*segs));
	for (uint32_t h = 0; h < 2; h++) {
		void *k = h ? kn : kt;
		struct kvr_kv_segment *sg = segs + h * (1 + n_pages);
		sg[0] = (struct kvr_kv_segment){ .k = k, .v = vt, .n_tokens = T, .row_stride = row, .head_stride = d };
		for (uint32_t j = 0; j < n_pages; j++)
			sg[1 + j] = nhd_segment(&sh, k, vt, 0, j * p, j + 1 < n_pages ? p : T - j * p);
	}
	const uint64_t per = (uint64_t)sh.n_qo_heads * d;
	void *q = new_queries(&r, &sh, ITEMS, 2.0), *out = new_outputs(&sh, ITEMS);
	memcpy(elem_ptr(q, type, per), q, per * eb);
	const uint32_t first[ITEMS] = { 0, 1, 0, 1 }, count[ITEMS] = { 1, n_pages, 0, 1 };
	struct kvr_attention_item items[ITEMS];
	attention_items(items, ITEMS, q, out, type, per, first, count);
	char what[96];
	snprintf(what, sizeof(what), "attention over %u tokens, one segment and pages of %u", T, p);
	attention_and_check(e, c, what, &sh, items, ITEMS, segs, n_segs, q, out);
	void *got = halloc(ITEMS * per * eb);
	get(c, got, out, ITEMS * per * eb);
	if (e->bc->kind == KVR_DEV_CPU) {
		/* (pages of 8 tokens are softmax blocks of 8, not 16: equal within
		 * the bound only) */
		cr_assert(p < 16 || !memcmp(got, elem_ptr(got, type, per), per * eb),
			  "%s: %s %s config %u: one segment and its pages differ", c->name, what, type_names[ti], ci);
		static const uint32_t threads[] = { 0, 3 };
		for (uint32_t k = 0; k < ARRAY_LEN(threads); k++) {
			struct dctx other;
			char err[256];
			cr_assert_eq(dctx_open_threads(&other, "cpu (other threads)", KVR_DEV_CPU, threads[k], err,
						       sizeof(err)), 0, "%s", err);
			put(&other, kt, kv_bytes);
			put(&other, vt, kv_bytes);
			put(&other, kn, kv_bytes);
			put(&other, q, ITEMS * per * eb);
			void *out2 = new_outputs(&sh, ITEMS), *got2 = halloc(ITEMS * per * eb);
			put(&other, out2, ITEMS * per * eb);
			struct kvr_attention_item items2[ITEMS];
			attention_items(items2, ITEMS, q, out2, type, per, first, count);
			DEV_OK(&other, kvr_dev_attention(other.dev, &sh, dev_attention_items(&other, items2, ITEMS), ITEMS,
							 dev_segments(&other, segs, n_segs), n_segs, other.s));
			get(&other, got2, out2, ITEMS * per * eb);
			cr_assert(!memcmp(got, got2, ITEMS * per * eb), "%s: %s %s config %u: %u workers differ from 1",
				  c->name, what, type_names[ti], ci, threads[k]);
			dctx_close(&other);
		}
	}
	/* the same over the rows with a NaN key */
	void *nout = new_outputs(&sh, NAN_ITEMS), *ngot = halloc(NAN_ITEMS * per * eb);
	put(c, q, NAN_ITEMS * per * eb);
	put(c, nout, NAN_ITEMS * per * eb);
	const uint32_t nfirst[NAN_ITEMS] = { 1 + n_pages, 2 + n_pages }, ncount[NAN_ITEMS] = { 1, n_pages };
	attention_items(items, NAN_ITEMS, q, nout, type, per, nfirst, ncount);
	DEV_OK(c, kvr_dev_attention(c->dev, &sh, dev_attention_items(c, items, NAN_ITEMS), NAN_ITEMS,
				    dev_segments(c, segs, n_segs), n_segs, c->s));
	get(c, ngot, nout, NAN_ITEMS * per * eb);
	for (uint32_t i = 0; i < NAN_ITEMS; i++)
		for (uint32_t h = 0; h < sh.n_qo_heads; h++)
			for (uint32_t x = 0; x < d; x++)
				cr_assert(isfinite(ref_load(ngot, type, i * per + h * d + x)) == (h / G != 1),
					  "%s: NaN key at token %u of %u, %s config %u item %u: head %u dim %u: "
					  "exactly KV head 1's heads must be non-finite",
					  c->name, NAN_TOKEN, T, type_names[ti], ci, i, h, x);
}

CONFORMANCE_CASES(attention_split, ARRAY_LEN(numeric_shapes))

/*
 * Decode attention's running max over logits that climb and fall: the cpu
 * kernel moves its max only when a block's scores exceed it by more than
 * 8, so between moves the weights grow above 1, and at a move every sum and
 * output rescales. Each item is one segment of T rows whose keys are the
 * item's head-0 query times c_t (plus noise), so head 0's logits follow a
 * profile and the group's other heads some multiple of it: a slow climb
 * (+4 a block of 16: moves every two or three blocks), a steep one (+48 a block:
 * every block), a fall (the max stays at the first token), a saw that
 * jumps by just under 8 every other block, and a flat run with one spike
 * of +30 at its last token. Each within its bound of the reference.
 */
static void attention_ramp_case(struct env *e, uint32_t ci, uint32_t ti)
{
	CASE_SETUP(numeric_shapes, 0x4a3b);
	if (ci != 1 && ci != 2)
		return; /* G = 8 and G = 3: the profiles are what is checked */
	enum { T = 300, ITEMS = 5 };
	const uint32_t d = sh.head_dim, row = sh.n_kv_heads * d;
	const uint64_t per = (uint64_t)sh.n_qo_heads * d;
	const size_t eb = ebytes(type), kv_bytes = (size_t)T * row * eb;
	void *q = new_queries(&r, &sh, ITEMS, 1.0), *out = new_outputs(&sh, ITEMS);
	struct kvr_kv_segment segs[ITEMS];
	uint32_t first[ITEMS], count[ITEMS];
	for (uint32_t i = 0; i < ITEMS; i++) {
		void *k = halloc(kv_bytes), *v = halloc(kv_bytes);
		fill_uniform(&r, k, type, (uint64_t)T * row, -0.05, 0.05);
		fill_uniform(&r, v, type, (uint64_t)T * row, -1.0, 1.0);
		for (uint32_t m = 0; m < sh.n_kv_heads; m++) {
			/* head 0 of KV head m's group: logit_t = c_t·scale·|q|² */
			const uint64_t q0 = i * per + (uint64_t)m * (sh.n_qo_heads / sh.n_kv_heads) * d;
			double qq = 0.0;
			for (uint32_t x = 0; x < d; x++)
				qq += ref_load(q, type, q0 + x) * ref_load(q, type, q0 + x);
			const double unit = 1.0 / (sh.scale * qq); /* c_t of logit 1 */
			for (uint32_t t = 0; t < T; t++) {
				double logit;
				switch (i) {
				case 0: logit = 0.25 * t; break;
				case 1: logit = 3.0 * t; break;
				case 2: logit = 40.0 - 0.5 * t; break;
				case 3: logit = 7.9 * (double)((t / 16u) % 2u); break;
				default: logit = t + 1 == T ? 30.0 : 0.0; break;
				}
				for (uint32_t x = 0; x < d; x++) {
					const uint64_t at = (uint64_t)t * row + (uint64_t)m * d + x;
					ref_store(k, type, at,
						  ref_load(k, type, at) + logit * unit * ref_load(q, type, q0 + x));
				}
			}
		}
		put(c, k, kv_bytes);
		put(c, v, kv_bytes);
		segs[i] = (struct kvr_kv_segment){ .k = k, .v = v, .n_tokens = T, .row_stride = row, .head_stride = d };
		first[i] = i;
		count[i] = 1;
	}
	struct kvr_attention_item items[ITEMS];
	attention_items(items, ITEMS, q, out, type, per, first, count);
	char what[96];
	snprintf(what, sizeof(what), "attention over logits that climb and fall, config %u", ci);
	attention_and_check(e, c, what, &sh, items, ITEMS, segs, ITEMS, q, out);
}

CONFORMANCE_CASES(attention_ramp, ARRAY_LEN(numeric_shapes))

/* The flag's refusals: a group that is no whole number of query tokens, and
 * dense attention; each names its reason and leaves the device usable. */
static void attention_causal_errors_case(struct env *e, uint32_t ci, uint32_t ti)
{
	CASE_SETUP(numeric_shapes, 0xca5b);
	if (ci > 1 || ti)
		return; /* the checks are about the shape's flags, not its numbers */
	sh.n_qo_heads *= 2;
	sh.flags = KVR_SHAPE_CAUSAL;
	sh.causal_heads_per_query = sh.n_qo_heads / sh.n_kv_heads / 2;
	void *q = new_queries(&r, &sh, 1, 1.0), *out = new_outputs(&sh, 1);
	put(c, q, (size_t)sh.n_qo_heads * sh.head_dim * ebytes(type));
	put(c, out, (size_t)sh.n_qo_heads * sh.head_dim * ebytes(type));
	const struct kvr_attention_item it = { .q = q, .out = out, .first_segment = 0, .n_segments = 0 };
	struct kvr_shape bad = sh;
	bad.causal_heads_per_query = sh.n_qo_heads / sh.n_kv_heads + 1; /* divides nothing */
	cr_expect_eq(kvr_dev_attention(c->dev, &bad, dev_attention_items(c, &it, 1), 1, NULL, 0, c->s), -EINVAL,
		     "%s: causal_heads_per_query %u", c->name, bad.causal_heads_per_query);
	bad.causal_heads_per_query = 0;
	cr_expect_eq(kvr_dev_attention(c->dev, &bad, dev_attention_items(c, &it, 1), 1, NULL, 0, c->s), -EINVAL,
		     "%s: causal_heads_per_query 0", c->name);
	const struct kvr_dense_item dense = { .q = q, .out = out, .k = q, .v = q, .n_tokens = 0, .row_stride = 0 };
	cr_expect_eq(kvr_dev_dense(c->dev, &sh, dev_dense_items(c, &dense, 1), 1, c->s), -EINVAL,
		     "%s: causal dense", c->name);
	cr_expect(strstr(kvr_dev_last_error(c->dev), "attention flag"), "%s", kvr_dev_last_error(c->dev));
	/* still usable: the valid call runs (no tokens: zeros) */
	DEV_OK(c, kvr_dev_attention(c->dev, &sh, dev_attention_items(c, &it, 1), 1, NULL, 0, c->s));
	DEV_OK(c, kvr_dev_stream_synchronize(c->dev, c->s));
}

CONFORMANCE_CASES(attention_causal_errors, ARRAY_LEN(numeric_shapes))

/*
 * Attention over quantised pages (K8V4 and K4V2, kvquant.h) mixed with plain
 * NHD tiles in one item, against the reference over the same codes: a K8V4
 * page alone; K8V4 page, tile rows, a partial K4V2 page (p − 3 tokens), a
 * K4V2 page whose vectors are constant (s = 0: every element is −z), an
 * empty quantised segment; the same item with 40x queries; K4V2 only; the
 * K8V4 page as its two halves (K8V4_HALF runs built with
 * kvr_quant_half_piece, as the device page cache of mixed pages holds it);
 * halves mixed with a K4V2 page, one of them partial; pages read from a row
 * in (first_row: a K8V4 page's halves in place); and a quantised segment
 * of unknown format, or a half longer than p/2, which must not pass
 * (cpu backends: NaN outputs; checked apart from the reference).
 */
static void attention_quant_case(struct env *e, uint32_t ci, uint32_t ti)
{
	CASE_SETUP(numeric_shapes, 0x9a7e);
	enum { ITEMS = 7 };
	sh.flags = KVR_SHAPE_SEGMENT_LSE; /* and check each segment's log-sum-exp */
	const uint32_t p = sh.page_tokens, n_kv = sh.n_kv_heads, row = n_kv * sh.head_dim;
	const size_t eb = ebytes(type);
	struct kvr_quant_geometry g8, g4;
	cr_assert_eq(kvr_quant_geometry_init(&g8, p, sh.head_dim, n_kv, KVR_KV_K8V4), 0);
	cr_assert_eq(kvr_quant_geometry_init(&g4, p, sh.head_dim, n_kv, KVR_KV_K4V2), 0);
	/* pages: K8V4, K4V2 partial, K4V2 constant, K4V2 full; quantised from
	 * random NHD rows as offload does */
	const struct kvr_quant_geometry *pg[4] = { &g8, &g4, &g4, &g4 };
	const uint32_t filled[4] = { p, p - 3, p, p };
	unsigned char *pages[4];
	void *rows_k = halloc((size_t)p * row * eb), *rows_v = halloc((size_t)p * row * eb);
	float *scratch = halloc(sh.head_dim * sizeof(float));
	for (uint32_t i = 0; i < 4; i++) {
		if (i == 2) { /* constant vectors: each token's head is one value */
			for (uint64_t x = 0; x < (uint64_t)p * row; x++) {
				const double v = 0.25 * (double)(x / sh.head_dim % 7) - 0.75;
				ref_store(rows_k, type, x, v);
				ref_store(rows_v, type, x, -v);
			}
		} else {
			fill_uniform(&r, rows_k, type, (uint64_t)p * row, -1.0, 1.0);
			fill_uniform(&r, rows_v, type, (uint64_t)p * row, -1.0, 1.0);
		}
		pages[i] = halloc(pg[i]->page_bytes);
		for (uint32_t m = 0; m < n_kv; m++)
			kvr_quant_run_from_nhd(pg[i], rows_k, rows_v, row, type, m, filled[i],
					       pages[i] + (uint64_t)m * pg[i]->head_bytes, scratch);
		put(c, pages[i], pg[i]->page_bytes);
	}
	/* page 0's halves, each n_kv K8V4_HALF runs */
	struct kvr_quant_geometry gh;
	cr_assert_eq(kvr_quant_geometry_init(&gh, p, sh.head_dim, n_kv, KVR_KV_K8V4_HALF), 0);
	unsigned char *halves[2];
	for (uint32_t h = 0; h < 2; h++) {
		halves[h] = halloc(gh.page_bytes);
		for (uint32_t m = 0; m < n_kv; m++)
			for (uint32_t piece = 0; piece < 4; piece++) {
				uint64_t src, dst, bytes;
				kvr_quant_half_piece(&g8, &gh, h, piece, &src, &dst, &bytes);
				memcpy(halves[h] + (uint64_t)m * gh.head_bytes + dst,
				       pages[0] + (uint64_t)m * g8.head_bytes + src, bytes);
			}
		put(c, halves[h], gh.page_bytes);
	}
	const uint64_t tile = (uint64_t)p * row;
	void *kt = halloc(tile * eb), *vt = halloc(tile * eb);
	fill_uniform(&r, kt, type, tile, -1.0, 1.0);
	fill_uniform(&r, vt, type, tile, -1.0, 1.0);
	put(c, kt, tile * eb);
	put(c, vt, tile * eb);
#define QROW(i, row, n) ((struct kvr_kv_segment){ .k = pages[i], .n_tokens = (n), .first_row = (row), \
						  .head_stride = (uint32_t)pg[i]->head_bytes, \
						  .format = pg[i]->format })
#define HALF(h, n) ((struct kvr_kv_segment){ .k = halves[h], .n_tokens = (n), \
					     .head_stride = (uint32_t)gh.head_bytes, \
					     .format = KVR_KV_K8V4_HALF })
#define QSEG(i, n) ((struct kvr_kv_segment){ .k = pages[i], .n_tokens = (n), \
					     .head_stride = (uint32_t)pg[i]->head_bytes, \
					     .format = pg[i]->format })
	const struct kvr_kv_segment segs[] = {
		QSEG(0, p),                         /* item 0 */
		QSEG(0, p),                         /* item 1 (and 2) */
		nhd_segment(&sh, kt, vt, 0, 1, p - 1),
		QSEG(1, p - 3),
		QSEG(2, p),
		QSEG(3, 0),
		QSEG(1, p - 3),                     /* item 3 */
		QSEG(3, p),
		HALF(0, p / 2),                     /* item 4: page 0 as its halves */
		HALF(1, p / 2),
		HALF(1, p / 2 - 1),                 /* item 5 */
		QSEG(3, p),
		HALF(0, p / 2),
		QROW(0, p / 2, p / 2),              /* item 6: page 0's halves in place */
		QROW(0, 0, p / 2),
		QROW(1, 1, p - 4),
	};
#undef QSEG
#undef HALF
#undef QROW
	static const uint32_t first[ITEMS] = { 0, 1, 1, 6, 8, 10, 13 };
	static const uint32_t count[ITEMS] = { 1, 5, 5, 2, 2, 3, 3 };
	void *q = new_queries(&r, &sh, ITEMS, 2.0), *out = new_outputs(&sh, ITEMS);
	const uint64_t per = (uint64_t)sh.n_qo_heads * sh.head_dim;
	scaled_query(q, type, per, 2, 1, 40.0); /* item 2: item 1's query x40 */
	struct kvr_attention_item items[ITEMS];
	float *lse[ITEMS];
	for (uint32_t i = 0; i < ITEMS; i++) {
		lse[i] = new_lse(c, &sh, count[i]);
		items[i] = (struct kvr_attention_item){
			.q = elem_ptr(q, type, i * per), .out = elem_ptr(out, type, i * per),
			.segment_lse = i == 3 ? NULL : lse[i], /* item 3: none asked for */
			.first_segment = first[i], .n_segments = count[i] };
	}
	char what[96];
	snprintf(what, sizeof(what), "quantised attention config %u", ci);
	attention_and_check(e, c, what, &sh, items, ITEMS, segs, ARRAY_LEN(segs), q, out);
	for (uint32_t i = 0; i < ITEMS; i++) {
		if (i == 3)
			continue; /* no log-sum-exp asked for */
		const uint32_t n = sh.n_qo_heads * count[i];
		float *got = halloc(n * sizeof(float));
		double *want = halloc(n * sizeof(double));
		get(c, got, lse[i], n * sizeof(float));
		ref_attention_lse(&sh, &items[i], segs, want);
		for (uint32_t x = 0; x < n; x++) {
			/* a segment whose share of the head's attention underflows fp32
			 * against the running maximum may read −inf, or lose precision
			 * in subnormals (kernels.h): below e^-80 only its smallness counts */
			const uint32_t h = x / count[i];
			double total = -INFINITY;
			for (uint32_t sg = 0; sg < count[i]; sg++) {
				const double l = want[h * count[i] + sg];
				total = l > total ? l + log1p(exp(total - l)) : total + log1p(exp(l - total));
			}
			const int neg_inf = isinf(got[x]) && got[x] < 0;
			const int both_inf = neg_inf && isinf(want[x]) && want[x] < 0;
			const int negligible = want[x] - total < -80.0 && (neg_inf || got[x] - total < -70.0);
			cr_assert(both_inf || negligible || fabs(got[x] - want[x]) <= 1e-3 * (1.0 + fabs(want[x])),
				  "%s: %s item %u head %u segment %u: log-sum-exp %.7g, want %.7g", c->name,
				  what, i, x / count[i], x % count[i], (double)got[x], want[x]);
		}
	}

	/* an unknown format: the cpu backends poison the item (cuda reads NaN
	 * into its tile; strict cudaemu refuses the call) */
	const uint32_t kind = kvr_dev_kind_of(c->dev);
	if (kind == KVR_DEV_CUDAEMU_STRICT)
		return;
	for (uint32_t b = 0; b < 2; b++) {
		struct kvr_kv_segment bad = segs[b ? 8 : 0];
		if (b)
			bad.n_tokens = p / 2 + 1; /* a half holds p/2 tokens */
		else
			bad.format = 7;
		void *out2 = new_outputs(&sh, 1);
		put(c, out2, per * eb);
		const struct kvr_attention_item it2 = { .q = q, .out = out2, .first_segment = 0, .n_segments = 1 };
		DEV_OK(c, kvr_dev_attention(c->dev, &sh, dev_attention_items(c, &it2, 1), 1,
					    dev_segments(c, &bad, 1), 1, c->s));
		void *got = halloc(per * eb);
		get(c, got, out2, per * eb);
		for (uint64_t x = 0; x < per; x++)
			cr_assert(isnan(ref_load(got, type, x)),
				  "%s: %s: %s gave output %g at %llu, not NaN", c->name, what,
				  b ? "a half segment longer than p/2" : "a segment of unknown format",
				  ref_load(got, type, x), (unsigned long long)x);
	}
}

CONFORMANCE_CASES(attention_quant, ARRAY_LEN(numeric_shapes))

/* The worst error over an item's outputs in units of the contract's bound
 * (> 1: the check would fail). */
static double worst_of_bound(const struct kvr_shape *sh, const void *got, const double *ref,
			     const struct ref_head_scale *scale)
{
	double worst = 0.0;
	for (uint32_t h = 0; h < sh->n_qo_heads; h++)
		for (uint32_t c = 0; c < sh->head_dim; c++) {
			const double g = ref_load(got, sh->elem_type, (uint64_t)h * sh->head_dim + c);
			const double err = fabs(g - ref[(uint64_t)h * sh->head_dim + c]);
			const double ratio = err / ref_attention_bound(sh->elem_type, &scale[h]);
			worst = ratio > worst ? ratio : worst;
		}
	return worst;
}

/*
 * The quantised pages' bound is tight enough to see one code step: attention
 * over the first two tokens of a K8V4 and of a K4V2 page (equal keys, so
 * equal weights) passes, and the same outputs against a reference whose
 * page has one key code moved by one step (token 0, KV head 0, at query
 * head 0's largest element), or one value code, fail.
 * f32 only: f16 and bf16 outputs round off more than a code step moves.
 */
static void attention_quant_planted_case(struct env *e, uint32_t ci, uint32_t ti)
{
	if (all_types[ti] != KVR_ELEM_F32)
		return;
	CASE_SETUP(numeric_shapes, 0x91a7);
	const uint32_t p = sh.page_tokens, row = sh.n_kv_heads * sh.head_dim, d = sh.head_dim;
	const size_t eb = ebytes(type);
	void *rows_k = halloc((size_t)p * row * eb), *rows_v = halloc((size_t)p * row * eb);
	float *scratch = halloc(d * sizeof(float));
	fill_uniform(&r, rows_k, type, (uint64_t)p * row, -1.0, 1.0);
	fill_uniform(&r, rows_v, type, (uint64_t)p * row, -1.0, 1.0);
	/* token 1's keys are token 0's: equal logits, weights of 1/2 each, where
	 * a logit's change moves the outputs most */
	memcpy((unsigned char *)rows_k + row * eb, rows_k, row * eb);
	static const uint32_t formats[2] = { KVR_KV_K8V4, KVR_KV_K4V2 };
	for (uint32_t f = 0; f < 2; f++) {
		struct kvr_quant_geometry g;
		cr_assert_eq(kvr_quant_geometry_init(&g, p, d, sh.n_kv_heads, formats[f]), 0);
		unsigned char *page = halloc(g.page_bytes);
		for (uint32_t m = 0; m < sh.n_kv_heads; m++)
			kvr_quant_run_from_nhd(&g, rows_k, rows_v, row, type, m, p, page + (uint64_t)m * g.head_bytes,
					       scratch);
		put(c, page, g.page_bytes);
		const struct kvr_kv_segment seg = { .k = page, .n_tokens = 2, .head_stride = (uint32_t)g.head_bytes,
						    .format = formats[f] };
		void *q = new_queries(&r, &sh, 1, 8.0), *out = new_outputs(&sh, 1);
		const size_t per = (size_t)sh.n_qo_heads * d;
		const struct kvr_attention_item item = { .q = q, .out = out, .first_segment = 0, .n_segments = 1 };
		put(c, q, per * eb);
		put(c, out, per * eb);
		DEV_OK(c, kvr_dev_attention(c->dev, &sh, dev_attention_items(c, &item, 1), 1,
					    dev_segments(c, &seg, 1), 1, c->s));
		void *got = halloc(per * eb);
		get(c, got, out, per * eb);
		double *ref = halloc(per * sizeof(double));
		struct ref_head_scale *scale = halloc(sh.n_qo_heads * sizeof(*scale));
		ref_attention(&sh, &item, &seg, ref, scale);
		const double clean = worst_of_bound(&sh, got, ref, scale);
		cr_assert(clean <= 1.0, "%s: %s config %u: %.3g of the bound without a planted error", e->bc->name,
			  f ? "K4V2" : "K8V4", ci, clean);
		uint32_t at = 0; /* query head 0's largest element */
		for (uint32_t x = 1; x < d; x++)
			if (fabs(ref_load(q, type, x)) > fabs(ref_load(q, type, at)))
				at = x;
		uint8_t *krow = kvr_quant_key_row(&g, page, 0);
		const uint32_t code = kvr_quant_get(krow, at, g.key_bits);
		kvr_quant_put(krow, at, g.key_bits, code ? code - 1u : 1u);
		ref_attention(&sh, &item, &seg, ref, scale);
		const double planted = worst_of_bound(&sh, got, ref, scale);
		cr_assert(planted > 1.0, "%s: %s config %u: a key code one step off stays inside the bound (%.3g of it)",
			  e->bc->name, f ? "K4V2" : "K8V4", ci, planted);
		kvr_quant_put(krow, at, g.key_bits, code);
		/* and a value code one step off (token 0, element 0) */
		uint8_t *vrow = kvr_quant_value_row(&g, page, 0);
		const uint32_t vcode = kvr_quant_get(vrow, 0, g.value_bits);
		kvr_quant_put(vrow, 0, g.value_bits, vcode ? vcode - 1u : 1u);
		ref_attention(&sh, &item, &seg, ref, scale);
		const double planted_v = worst_of_bound(&sh, got, ref, scale);
		cr_assert(planted_v > 1.0,
			  "%s: %s config %u: a value code one step off stays inside the bound (%.3g of it)",
			  e->bc->name, f ? "K4V2" : "K8V4", ci, planted_v);
	}
}
CONFORMANCE_CASES(attention_quant_planted, ARRAY_LEN(numeric_shapes))

/* Dense items over NHD rows: 0, 1, p, 37 and 1500 tokens, rows contiguous or padded. */
static void dense_and_check(struct env *e, struct dctx *c, const char *what,
			    const struct kvr_shape *sh, const struct kvr_dense_item *items,
			    uint32_t n, void *q, void *out)
{
	run_and_check(e, c, what, sh, n, q, out, NULL, NULL, 0, items);
}

static void dense_case(struct env *e, uint32_t ci, uint32_t ti)
{
	CASE_SETUP(numeric_shapes, 0xde05e);
	enum { ITEMS = 5 };
	const uint32_t row = sh.n_kv_heads * sh.head_dim;
	/* the last: a long context, so the running max and sum are rescaled
	 * over many blocks */
	const uint32_t tokens[ITEMS] = { 0, 1, sh.page_tokens, 37, 1500 };
	const uint32_t pad[ITEMS] = { 0, 16, 0, 48, 0 };
	const size_t eb = ebytes(type);
	void *q = new_queries(&r, &sh, ITEMS, 2.0), *out = new_outputs(&sh, ITEMS);
	const uint64_t per = (uint64_t)sh.n_qo_heads * sh.head_dim;
	struct kvr_dense_item items[ITEMS];
	for (uint32_t i = 0; i < ITEMS; i++) {
		const uint64_t len = (uint64_t)(tokens[i] ? tokens[i] : 1) * (row + pad[i]);
		void *k = halloc(len * eb), *v = halloc(len * eb);
		fill_uniform(&r, k, type, len, -1.0, 1.0);
		fill_uniform(&r, v, type, len, -1.0, 1.0);
		put(c, k, len * eb);
		put(c, v, len * eb);
		items[i] = (struct kvr_dense_item){
			.q = elem_ptr(q, type, i * per), .k = k, .v = v,
			.out = elem_ptr(out, type, i * per), .n_tokens = tokens[i],
			.row_stride = row + pad[i] };
	}
	char what[96];
	snprintf(what, sizeof(what), "dense config %u", ci);
	dense_and_check(e, c, what, &sh, items, ITEMS, q, out);
}

CONFORMANCE_CASES(dense, ARRAY_LEN(numeric_shapes))

/*
 * Sparse attention over all of a sequence's pages equals dense attention over
 * the same tokens: L = 4 pages + 5 tokens as NHD rows; the pages offloaded to
 * HND (by the reference) and listed once in order and once shuffled, the
 * tail as an NHD segment. Each output is within its bound of the reference;
 * sparse and dense within twice the bound of each other.
 */
static const struct shape_cfg sparse_shapes[] = { { 8, 2, 64, 16, 0 }, { 3, 1, 128, 8, 0 } };

static void sparse_equals_dense_case(struct env *e, uint32_t ci, uint32_t ti)
{
	CASE_SETUP(sparse_shapes, 0x5a45e);
	enum { FULL = 4, TAIL = 5 };
	const uint32_t p = sh.page_tokens, row = sh.n_kv_heads * sh.head_dim;
	const uint32_t L = FULL * p + TAIL;
	const uint64_t page = 2ull * row * p, per = (uint64_t)sh.n_qo_heads * sh.head_dim;
	const size_t eb = ebytes(type);
	void *k = halloc((uint64_t)L * row * eb), *v = halloc((uint64_t)L * row * eb);
	fill_uniform(&r, k, type, (uint64_t)L * row, -1.0, 1.0);
	fill_uniform(&r, v, type, (uint64_t)L * row, -1.0, 1.0);
	void *pool = halloc(FULL * page * eb);
	struct kvr_page_item off[FULL];
	for (uint32_t j = 0; j < FULL; j++)
		off[j] = (struct kvr_page_item){
			.k_rows = elem_ptr(k, type, (uint64_t)j * p * row),
			.v_rows = elem_ptr(v, type, (uint64_t)j * p * row),
			.hnd_page = elem_ptr(pool, type, j * page),
			.row_stride = row };
	ref_offload(&sh, off, FULL);
	put(c, k, (uint64_t)L * row * eb);
	put(c, v, (uint64_t)L * row * eb);
	put(c, pool, FULL * page * eb);

	static const uint32_t order[2][FULL] = { { 0, 1, 2, 3 }, { 2, 0, 3, 1 } };
	struct kvr_kv_segment segs[2 * (FULL + 1)];
	for (uint32_t o = 0; o < 2; o++) {
		for (uint32_t j = 0; j < FULL; j++)
			segs[o * (FULL + 1) + j] = hnd_segment(&sh, pool, order[o][j], p);
		segs[o * (FULL + 1) + FULL] = (struct kvr_kv_segment){
			.k = elem_ptr(k, type, (uint64_t)FULL * p * row),
			.v = elem_ptr(v, type, (uint64_t)FULL * p * row),
			.n_tokens = TAIL, .row_stride = row, .head_stride = sh.head_dim };
	}
	/* the same query for the two sparse items and the dense one */
	void *q = new_queries(&r, &sh, 1, 2.0), *q2 = halloc(2 * per * eb);
	for (uint32_t i = 0; i < 2; i++)
		memcpy((unsigned char *)q2 + i * per * eb, q, per * eb);
	void *sparse_out = new_outputs(&sh, 2), *dense_out = new_outputs(&sh, 1);
	const struct kvr_attention_item items[2] = {
		{ .q = q2, .out = sparse_out, .first_segment = 0, .n_segments = FULL + 1 },
		{ .q = elem_ptr(q2, type, per), .out = elem_ptr(sparse_out, type, per),
		  .first_segment = FULL + 1, .n_segments = FULL + 1 },
	};
	const struct kvr_dense_item dense = { .q = q, .k = k, .v = v, .out = dense_out,
					      .n_tokens = L, .row_stride = row };
	char what[96];
	snprintf(what, sizeof(what), "sparse-vs-dense config %u: sparse", ci);
	attention_and_check(e, c, what, &sh, items, 2, segs, ARRAY_LEN(segs), q2, sparse_out);
	snprintf(what, sizeof(what), "sparse-vs-dense config %u: dense", ci);
	put(c, q, per * eb);
	put(c, dense_out, per * eb);
	DEV_OK(c, kvr_dev_dense(c->dev, &sh, dev_dense_items(c, &dense, 1), 1, c->s));
	void *gs = halloc(2 * per * eb), *gd = halloc(per * eb);
	get(c, gs, sparse_out, 2 * per * eb);
	get(c, gd, dense_out, per * eb);
	double *ref = halloc(per * sizeof(double));
	struct ref_head_scale *scale = halloc(sh.n_qo_heads * sizeof(*scale));
	ref_dense(&sh, &dense, ref, scale);
	check_heads(e, what, &sh, gd, ref, scale);
	for (uint32_t o = 0; o < 2; o++)
		for (uint64_t x = 0; x < per; x++) {
			const double a = ref_load(gs, type, o * per + x), b = ref_load(gd, type, x);
			const uint32_t h = (uint32_t)(x / sh.head_dim);
			/* each is within one bound of the reference */
			cr_assert(fabs(a - b) <= 2.0 * ref_attention_bound(type, &scale[h]),
				  "%s: sparse (%s pages) vs dense %s config %u: head %u dim "
				  "%lu: %.9g vs %.9g",
				  c->name, o ? "shuffled" : "ordered", type_names[ti], ci, h,
				  (unsigned long)(x % sh.head_dim), a, b);
		}
}

CONFORMANCE_CASES(sparse_equals_dense, ARRAY_LEN(sparse_shapes))

/*
 * NaN and Inf propagate to the affected heads and nowhere else (kernels.h):
 * item 0 has a NaN key in KV head m = 1 (an HND page), so all of m's query
 * heads are non-finite, entirely; item 1 shares item 0's NHD tile and is
 * clean; item 2 has +Inf in one query head's q (only that head); item 3 has
 * +Inf in one value of KV head 0 (that dimension of its heads). Every other
 * output must be finite and match the reference. Dense: the same with a NaN
 * key in one item and a clean second item.
 */
static const struct shape_cfg nonfinite_shapes[] = { { 8, 2, 64, 16, 0 }, { 3, 3, 32, 8, 0 } };

static void nonfinite_propagation_case(struct env *e, uint32_t ci, uint32_t ti)
{
	CASE_SETUP(nonfinite_shapes, 0x4a4e);
	enum { PAGES = 4, ITEMS = 4 };
	const uint32_t p = sh.page_tokens, d = sh.head_dim, G = sh.n_qo_heads / sh.n_kv_heads;
	const uint64_t page = 2ull * sh.n_kv_heads * p * d, tile = (uint64_t)p * sh.n_kv_heads * d;
	const uint64_t per = (uint64_t)sh.n_qo_heads * d;
	const size_t eb = ebytes(type);
	void *pool = halloc(PAGES * page * eb), *kt = halloc(2 * tile * eb),
	     *vt = halloc(2 * tile * eb);
	fill_uniform(&r, pool, type, PAGES * page, -1.0, 1.0);
	fill_uniform(&r, kt, type, 2 * tile, -1.0, 1.0);
	fill_uniform(&r, vt, type, 2 * tile, -1.0, 1.0);
	/* NaN: page 0, KV head 1, key of token 3, dim 0 */
	store_nan(pool, type, (1ull * 2 * p + 3) * d);
	/* +Inf: tile 1, token 2, KV head 0, value dim 7 */
	ref_store(vt, type, tile + 2ull * sh.n_kv_heads * d + 7, INFINITY);
	put(c, pool, PAGES * page * eb);
	put(c, kt, 2 * tile * eb);
	put(c, vt, 2 * tile * eb);
	const struct kvr_kv_segment segs[] = {
		hnd_segment(&sh, pool, 0, p), nhd_segment(&sh, kt, vt, 0, 0, p), /* 0 */
		hnd_segment(&sh, pool, 1, p), nhd_segment(&sh, kt, vt, 0, 0, p), /* 1 */
		hnd_segment(&sh, pool, 2, p),                                      /* 2 */
		hnd_segment(&sh, pool, 3, p), nhd_segment(&sh, kt, vt, 1, 0, 6),   /* 3 */
	};
	static const uint32_t first[ITEMS] = { 0, 2, 4, 5 }, count[ITEMS] = { 2, 2, 1, 2 };
	void *q = new_queries(&r, &sh, ITEMS, 2.0), *out = new_outputs(&sh, ITEMS);
	const uint32_t inf_head = G > 1 ? 1 : 0;
	ref_store(q, type, 2 * per + (uint64_t)inf_head * d + 5, INFINITY);
	struct kvr_attention_item items[ITEMS];
	attention_items(items, ITEMS, q, out, type, per, first, count);
	char what[96];
	snprintf(what, sizeof(what), "non-finite attention config %u", ci);
	attention_and_check(e, c, what, &sh, items, ITEMS, segs, ARRAY_LEN(segs), q, out);

	/* what the reference comparison implies, stated independently of it */
	void *got = halloc(ITEMS * per * eb);
	get(c, got, out, ITEMS * per * eb);
	for (uint32_t h = 0; h < sh.n_qo_heads; h++)
		for (uint32_t x = 0; x < d; x++) {
			const int nan_group = h / G == 1;
			cr_assert(isfinite(ref_load(got, type, h * d + x)) == !nan_group,
				  "%s: %s %s: item 0 head %u dim %u: NaN key in KV head 1 "
				  "must make exactly its heads non-finite",
				  c->name, what, type_names[ti], h, x);
			cr_assert(isfinite(ref_load(got, type, 2 * per + h * d + x)) ==
					  (h != inf_head),
				  "%s: %s %s: item 2 head %u dim %u: +Inf in q of head %u "
				  "must make exactly that head non-finite",
				  c->name, what, type_names[ti], h, x, inf_head);
			cr_assert(isfinite(ref_load(got, type, 3 * per + h * d + x)) ==
					  !(h / G == 0 && x == 7),
				  "%s: %s %s: item 3 head %u dim %u: +Inf in dim 7 of a value "
				  "of KV head 0 must make exactly that dim of its heads "
				  "non-finite",
				  c->name, what, type_names[ti], h, x);
		}

	/* dense: a NaN key (token 4, KV head 1, dim 2) in item 0 only */
	const uint32_t row = sh.n_kv_heads * d, n_tok = 2 * p;
	void *dk = halloc(2ull * n_tok * row * eb), *dv = halloc(2ull * n_tok * row * eb);
	fill_uniform(&r, dk, type, 2ull * n_tok * row, -1.0, 1.0);
	fill_uniform(&r, dv, type, 2ull * n_tok * row, -1.0, 1.0);
	store_nan(dk, type, 4ull * row + d + 2);
	put(c, dk, 2ull * n_tok * row * eb);
	put(c, dv, 2ull * n_tok * row * eb);
	void *dq = new_queries(&r, &sh, 2, 2.0), *dout = new_outputs(&sh, 2);
	const struct kvr_dense_item ditems[2] = {
		{ .q = dq, .k = dk, .v = dv, .out = dout, .n_tokens = n_tok, .row_stride = row },
		{ .q = elem_ptr(dq, type, per), .k = elem_ptr(dk, type, (uint64_t)n_tok * row),
		  .v = elem_ptr(dv, type, (uint64_t)n_tok * row), .out = elem_ptr(dout, type, per),
		  .n_tokens = n_tok, .row_stride = row },
	};
	snprintf(what, sizeof(what), "non-finite dense config %u", ci);
	dense_and_check(e, c, what, &sh, ditems, 2, dq, dout);
	void *dgot = halloc(2 * per * eb);
	get(c, dgot, dout, 2 * per * eb);
	for (uint32_t h = 0; h < sh.n_qo_heads; h++)
		for (uint32_t x = 0; x < d; x++)
			cr_assert(isfinite(ref_load(dgot, type, h * d + x)) == (h / G != 1),
				  "%s: %s %s: head %u dim %u: NaN key in KV head 1 must make "
				  "exactly its heads non-finite",
				  c->name, what, type_names[ti], h, x);
}

CONFORMANCE_CASES(nonfinite_propagation, ARRAY_LEN(nonfinite_shapes))

/* ================================================================== worker streams */

/*
 * Stream ordering: one case of every kernel with everything — the inputs'
 * copies, the item arrays' copies, the kernel and the copies back — enqueued
 * on a worker stream behind a long copy (stall_stream), synchronised only to
 * read results, with every device buffer holding 0xa5 bytes until its queued
 * upload runs. A backend that reads an item array (or any device memory) when
 * a kernel is enqueued rather than when it runs sees that garbage.
 */
#define WORKER_STREAM_TEST(name, type_index)                                                \
	CONFORMANCE_TEST(name##_on_worker_stream)                                          \
	{                                                                                  \
		e->main.s = e->main.worker_s;                                              \
		e->main.poison = 1;                                                        \
		stall_stream(&e->main);                                                    \
		name##_case(e, 1, type_index);                                             \
	}

WORKER_STREAM_TEST(scatter, 0)
WORKER_STREAM_TEST(offload, 1)
WORKER_STREAM_TEST(summarize, 2)
WORKER_STREAM_TEST(score_select, 0)
WORKER_STREAM_TEST(similarity, 1)
WORKER_STREAM_TEST(attention, 2)
WORKER_STREAM_TEST(dense, 0)
WORKER_STREAM_TEST(sparse_equals_dense, 1)
WORKER_STREAM_TEST(nonfinite_propagation, 2)

/* ================================================================== copies */

/*
 * Batched copies: H2D from a host base into non-overlapping device ranges
 * of random sizes (odd ones included), D2D between device buffers, D2H back
 * to a host base; the bytes outside the ranges must keep their old values.
 * The descriptor array is overwritten as soon as each call returns: it is a
 * host array, taken by the call (as cudaMemcpyBatchAsync takes its lists).
 * Run on the inline and the worker stream; n = 0 is a no-op.
 */
static void batch_descs(struct rng *r, struct kvr_copy_desc *d, uint32_t n, size_t slot,
			size_t src_bytes)
{
	/* destination slot i holds copy perm[i]; sizes 1..slot bytes */
	uint32_t perm[64];
	for (uint32_t i = 0; i < n; i++)
		perm[i] = i;
	for (uint32_t i = n - 1; i > 0; i--) {
		const uint32_t j = rng_below(r, i + 1), t = perm[i];
		perm[i] = perm[j];
		perm[j] = t;
	}
	for (uint32_t i = 0; i < n; i++) {
		const size_t bytes = 1 + rng_below(r, (uint32_t)slot);
		d[i] = (struct kvr_copy_desc){
			.src_offset = rng_below(r, (uint32_t)(src_bytes - bytes + 1)),
			.dst_offset = perm[i] * slot + rng_below(r, (uint32_t)(slot - bytes + 1)),
			.bytes = bytes };
	}
}

static void apply_descs(unsigned char *dst, const unsigned char *src,
			const struct kvr_copy_desc *d, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++)
		memcpy(dst + d[i].dst_offset, src + d[i].src_offset, d[i].bytes);
}

CONFORMANCE_TEST(memcpy_batch)
{
	struct dctx *c = &e->main;
	struct rng r = { 0xba7c4 };
	enum { N = 48, SLOT = 1500, BYTES = N * SLOT };
	for (uint32_t si = 0; si < 2; si++) {
		c->s = si ? c->worker_s : c->inline_s;
		unsigned char *src = halloc(BYTES), *a = halloc(BYTES), *b = halloc(BYTES),
			      *back = halloc(BYTES);
		fill_bytes(&r, src, BYTES);
		fill_bytes(&r, a, BYTES);
		fill_bytes(&r, b, BYTES);
		fill_bytes(&r, back, BYTES);
		void *da = put(c, a, BYTES), *db = put(c, b, BYTES);
		unsigned char *want_a = halloc(BYTES), *want_b = halloc(BYTES);
		unsigned char *want_back = halloc(BYTES);
		memcpy(want_a, a, BYTES);
		memcpy(want_b, b, BYTES);
		memcpy(want_back, back, BYTES);

		struct kvr_copy_desc d[N], scratch[N];
		batch_descs(&r, d, N, SLOT, BYTES);
		memcpy(scratch, d, sizeof(d));
		DEV_OK(c, kvr_dev_memcpy_batch_async(c->dev, da, src, scratch, N, KVR_COPY_H2D, c->s));
		memset(scratch, 0xee, sizeof(scratch)); /* the call took the list */
		apply_descs(want_a, src, d, N);

		batch_descs(&r, d, N, SLOT, BYTES);
		memcpy(scratch, d, sizeof(d));
		DEV_OK(c, kvr_dev_memcpy_batch_async(c->dev, db, da, scratch, N, KVR_COPY_D2D, c->s));
		memset(scratch, 0xee, sizeof(scratch));
		apply_descs(want_b, want_a, d, N);

		batch_descs(&r, d, N, SLOT, BYTES);
		memcpy(scratch, d, sizeof(d));
		DEV_OK(c, kvr_dev_memcpy_batch_async(c->dev, back, db, scratch, N, KVR_COPY_D2H, c->s));
		memset(scratch, 0xee, sizeof(scratch));
		apply_descs(want_back, want_b, d, N);

		DEV_OK(c, kvr_dev_memcpy_batch_async(c->dev, db, da, NULL, 0, KVR_COPY_D2D, c->s));
		DEV_OK(c, kvr_dev_stream_synchronize(c->dev, c->s));
		char what[96];
		snprintf(what, sizeof(what), "%s: batched H2D, D2D, D2H (%s stream)", c->name,
			 si ? "worker" : "inline");
		expect_same_bits(what, back, want_back, BYTES, 1);
		unsigned char *got = halloc(BYTES);
		get(c, got, a, BYTES);
		expect_same_bits(what, got, want_a, BYTES, 1);
		get(c, got, b, BYTES);
		expect_same_bits(what, got, want_b, BYTES, 1);
	}
}

/* ================================================================== host functions */

struct host_fn_state {
	const unsigned char *landed; /* filled by the D2H copy queued before fn */
	const unsigned char *expect;
	unsigned char *mid;          /* fn writes it; the H2D copy queued after reads it */
	size_t bytes;
	int calls, saw_copy;
};

static void host_fn_probe(void *arg)
{
	struct host_fn_state *st = arg;
	st->calls++;
	st->saw_copy = !memcmp(st->landed, st->expect, st->bytes);
	memset(st->mid, 0x3c, st->bytes);
}

/*
 * kvr_dev_host_fn in stream order, on the worker stream behind a long copy:
 * fn runs once, after the D2H copy queued before it has landed, and the H2D
 * copy queued after it reads what fn wrote. A backend without host functions
 * (-ENOTSUP) is skipped.
 */
CONFORMANCE_TEST(host_fn_order)
{
	struct dctx *c = &e->main;
	struct rng r = { 0x4f57fe };
	enum { BYTES = 1 << 20 };
	c->s = c->worker_s;
	stall_stream(c);
	unsigned char *src = halloc(BYTES), *landed = halloc(BYTES), *mid = halloc(BYTES),
		      *back = halloc(BYTES), *want = halloc(BYTES);
	fill_bytes(&r, src, BYTES);
	memset(want, 0x3c, BYTES);
	void *x = put(c, src, BYTES);
	struct host_fn_state st = { landed, src, mid, BYTES, 0, 0 };
	DEV_OK(c, kvr_dev_memcpy_async(c->dev, landed, x, BYTES, KVR_COPY_D2H, c->s));
	const int rc = kvr_dev_host_fn(c->dev, c->s, host_fn_probe, &st);
	if (rc == -ENOTSUP) {
		DEV_OK(c, kvr_dev_stream_synchronize(c->dev, c->s));
		cr_skip_test("%s: no host functions: %s", c->name, kvr_dev_last_error(c->dev));
	}
	cr_assert_eq(rc, 0, "%s: kvr_dev_host_fn returned %d: %s", c->name, rc,
		     kvr_dev_last_error(c->dev));
	DEV_OK(c, kvr_dev_memcpy_async(c->dev, x, mid, BYTES, KVR_COPY_H2D, c->s));
	DEV_OK(c, kvr_dev_memcpy_async(c->dev, back, x, BYTES, KVR_COPY_D2H, c->s));
	DEV_OK(c, kvr_dev_stream_synchronize(c->dev, c->s));
	cr_assert_eq(st.calls, 1, "%s: the host function ran %d times", c->name, st.calls);
	cr_assert(st.saw_copy, "%s: the host function ran before the copy queued ahead of it",
		  c->name);
	expect_same_bits("host_fn: the copy queued after the host function", back, want, BYTES, 1);
}

/* ================================================================== streams and events */

/*
 * An event never recorded is complete (query, synchronize, and a stream
 * waiting for it runs on). An event recorded on a worker stream after a copy,
 * waited for by an inline stream: the data is there for the inline stream's
 * next copy; query gives -EAGAIN while the copy runs (asserted where a worker
 * stream is asynchronous by contract: cpu) and 0 after synchronize. A
 * re-recorded event waits for its latest record.
 */
CONFORMANCE_TEST(events_and_streams)
{
	struct dctx *c = &e->main;
	struct rng r = { 0xe7e47 };
	struct kvr_event *ev = NULL;
	DEV_OK(c, kvr_dev_event_create(c->dev, &ev));
	cr_assert_eq(kvr_dev_event_query(c->dev, ev), 0, "%s: a new event must be complete", c->name);
	DEV_OK(c, kvr_dev_event_synchronize(c->dev, ev));
	DEV_OK(c, kvr_dev_stream_wait_event(c->dev, c->inline_s, ev));
	DEV_OK(c, kvr_dev_stream_wait_event(c->dev, c->worker_s, ev));
	DEV_OK(c, kvr_dev_stream_synchronize(c->dev, c->worker_s));

	int saw_pending = 0;
	for (uint32_t round = 0; round < 4; round++) {
		const size_t bytes = (size_t)8 << 20 << round; /* 8..64 MiB */
		unsigned char *host = calloc(1, bytes), *back = calloc(1, bytes);
		cr_assert(host && back, "out of memory");
		for (size_t i = 0; i < bytes; i += 4096)
			host[i] = (unsigned char)rng_next(&r);
		host[bytes - 1] = 0x42;
		void *a = NULL, *b = NULL;
		DEV_OK(c, kvr_dev_alloc(c->dev, bytes, &a));
		DEV_OK(c, kvr_dev_alloc(c->dev, bytes, &b));
		/* worker: H2D then a D2D twice over (a long tail of work), then record */
		DEV_OK(c, kvr_dev_memcpy_async(c->dev, a, host, bytes, KVR_COPY_H2D, c->worker_s));
		DEV_OK(c, kvr_dev_memcpy_async(c->dev, b, a, bytes, KVR_COPY_D2D, c->worker_s));
		DEV_OK(c, kvr_dev_memcpy_async(c->dev, b, a, bytes, KVR_COPY_D2D, c->worker_s));
		DEV_OK(c, kvr_dev_event_record(c->dev, ev, c->worker_s));
		const int q0 = kvr_dev_event_query(c->dev, ev);
		cr_assert(q0 == 0 || q0 == -EAGAIN, "%s: event_query returned %d", c->name, q0);
		saw_pending |= q0 == -EAGAIN;
		/* inline: wait, then read what the worker wrote */
		DEV_OK(c, kvr_dev_stream_wait_event(c->dev, c->inline_s, ev));
		DEV_OK(c, kvr_dev_memcpy_async(c->dev, back, b, bytes, KVR_COPY_D2H, c->inline_s));
		DEV_OK(c, kvr_dev_stream_synchronize(c->dev, c->inline_s));
		cr_assert(!memcmp(back, host, bytes),
			  "%s: round %u: the inline stream read data before the event it waited "
			  "for completed",
			  c->name, round);
		DEV_OK(c, kvr_dev_event_synchronize(c->dev, ev));
		cr_assert_eq(kvr_dev_event_query(c->dev, ev), 0,
			     "%s: event not complete after event_synchronize", c->name);

		/* re-record after a new copy: a wait now means the new record */
		for (size_t i = 0; i < bytes; i += 4096)
			host[i] ^= 0xff;
		host[bytes - 1] = 0x24;
		DEV_OK(c, kvr_dev_memcpy_async(c->dev, a, host, bytes, KVR_COPY_H2D, c->worker_s));
		DEV_OK(c, kvr_dev_event_record(c->dev, ev, c->worker_s));
		DEV_OK(c, kvr_dev_stream_wait_event(c->dev, c->inline_s, ev));
		DEV_OK(c, kvr_dev_memcpy_async(c->dev, back, a, bytes, KVR_COPY_D2H, c->inline_s));
		DEV_OK(c, kvr_dev_stream_synchronize(c->dev, c->inline_s));
		cr_assert(!memcmp(back, host, bytes),
			  "%s: round %u: a wait did not cover the event's latest record", c->name,
			  round);
		DEV_OK(c, kvr_dev_stream_synchronize(c->dev, c->worker_s));
		cr_assert_eq(kvr_dev_event_query(c->dev, ev), 0,
			     "%s: event not complete after its stream was synchronised", c->name);
		kvr_dev_free(c->dev, a);
		kvr_dev_free(c->dev, b);
		free(host);
		free(back);
		if (saw_pending)
			break;
	}
	if (e->bc->kind == KVR_DEV_CPU)
		cr_assert(saw_pending,
			  "%s: event_query never returned -EAGAIN while a worker stream was still "
			  "copying up to 64 MiB",
			  c->name);
	kvr_dev_event_destroy(c->dev, ev);
}

/* ------------------------------------------------------------------ freelist */

/*
 * The freelist kernel under long random rounds on three lists at once (one
 * call, three items): each round every list draws alloc or free, each unit a
 * count (frees: a random part of the pages it owns, from anywhere in its
 * table); the device round must equal layouts/freelist.h's serial round bit
 * for bit — status, counters, the whole ids array, offsets and the units'
 * pages — and a shadow of who owns each page checks what the header promises:
 * no page lost or owned twice, the free region exactly the unowned pages. The
 * lists' unit counts cross the block scan's 256 and the cpu backend's 4096
 * units per task; capacities are tight enough that rounds are refused and
 * the counters wrap. Then malformed items: refused as BAD, nothing changed.
 */
#define FL_LISTS 3u

struct fl_list {
	uint32_t capacity, units, max_ask;
	/* host reference and shadow */
	struct kvr_freelist ref;
	uint32_t *ref_ids, *owner, *n_owned, **owned;
	uint32_t *counts, *pages, *ref_pages, *ids_back;
	uint64_t *offsets, *offsets_back, counters_back[2];
	int32_t status_back;
	/* device */
	uint32_t *d_ids, *d_counts, *d_pages;
	uint64_t *d_counters, *d_offsets;
	int32_t *d_status;
};

#define FL_NOBODY UINT32_MAX

static void fl_open(struct dctx *c, struct fl_list *l, uint32_t capacity, uint32_t units, uint32_t max_ask)
{
	memset(l, 0, sizeof(*l));
	l->capacity = capacity, l->units = units, l->max_ask = max_ask;
	l->ref_ids = calloc(capacity, 4), l->owner = calloc(capacity, 4), l->ids_back = calloc(capacity, 4);
	l->n_owned = calloc(units, 4), l->owned = calloc(units, sizeof(uint32_t *));
	l->counts = calloc(units, 4), l->offsets = calloc(units, 8), l->offsets_back = calloc(units, 8);
	l->pages = calloc(capacity, 4), l->ref_pages = calloc(capacity, 4);
	cr_assert(l->ref_ids && l->owner && l->ids_back && l->n_owned && l->owned && l->counts && l->offsets &&
		  l->offsets_back && l->pages && l->ref_pages, "out of memory");
	for (uint32_t u = 0; u < units; u++)
		cr_assert_not_null(l->owned[u] = calloc(capacity, 4));
	kvr_freelist_init(&l->ref, l->ref_ids, capacity);
	for (uint32_t i = 0; i < capacity; i++)
		l->owner[i] = FL_NOBODY;
	DEV_OK(c, kvr_dev_alloc(c->dev, (size_t)capacity * 4, (void **)&l->d_ids));
	DEV_OK(c, kvr_dev_alloc(c->dev, (size_t)capacity * 4, (void **)&l->d_pages));
	DEV_OK(c, kvr_dev_alloc(c->dev, (size_t)units * 4, (void **)&l->d_counts));
	DEV_OK(c, kvr_dev_alloc(c->dev, (size_t)units * 8, (void **)&l->d_offsets));
	DEV_OK(c, kvr_dev_alloc(c->dev, 16, (void **)&l->d_counters));
	DEV_OK(c, kvr_dev_alloc(c->dev, 4, (void **)&l->d_status));
	const uint64_t counters[2] = { l->ref.start, l->ref.end };
	DEV_OK(c, kvr_dev_memcpy_async(c->dev, l->d_ids, l->ref_ids, (size_t)capacity * 4, KVR_COPY_H2D, c->s));
	DEV_OK(c, kvr_dev_memcpy_async(c->dev, l->d_counters, counters, 16, KVR_COPY_H2D, c->s));
	DEV_OK(c, kvr_dev_stream_synchronize(c->dev, c->s));
}

static void fl_close(struct dctx *c, struct fl_list *l)
{
	kvr_dev_free(c->dev, l->d_ids), kvr_dev_free(c->dev, l->d_pages), kvr_dev_free(c->dev, l->d_counts);
	kvr_dev_free(c->dev, l->d_offsets), kvr_dev_free(c->dev, l->d_counters), kvr_dev_free(c->dev, l->d_status);
	for (uint32_t u = 0; u < l->units; u++)
		free(l->owned[u]);
	free(l->owned), free(l->n_owned), free(l->ref_ids), free(l->owner), free(l->ids_back);
	free(l->counts), free(l->offsets), free(l->offsets_back), free(l->pages), free(l->ref_pages);
}

/* Draw a round for list l: its op, counts, and (frees) the pages packed in
 * unit order; the shadow is updated only once the round is known to pass. */
static uint32_t fl_draw(struct rng *r, struct fl_list *l)
{
	const uint32_t op = rng_below(r, 2) ? KVR_FREELIST_ALLOC : KVR_FREELIST_FREE;
	uint64_t at = 0;
	for (uint32_t u = 0; u < l->units; u++) {
		if (op == KVR_FREELIST_ALLOC) {
			l->counts[u] = rng_below(r, l->max_ask + 1);
			continue;
		}
		l->counts[u] = l->n_owned[u] ? rng_below(r, l->n_owned[u] + 1) : 0;
		for (uint32_t k = 0; k < l->counts[u]; k++) {
			const uint32_t i = rng_below(r, l->n_owned[u]);
			l->pages[at++] = l->owned[u][i];
			l->owned[u][i] = l->owned[u][--l->n_owned[u]];
		}
	}
	return op;
}

/* Check the device's round against the reference's, then the shadow. */
static void fl_check(struct dctx *c, struct fl_list *l, uint32_t op, const char *when)
{
	/* the reference round, on the same counts and packed pages */
	uint32_t **bufs = malloc(l->units * sizeof(uint32_t *));
	cr_assert_not_null(bufs);
	const uint64_t total = kvr_freelist_scan(l->counts, l->units, l->offsets);
	for (uint32_t u = 0; u < l->units; u++)
		bufs[u] = (op == KVR_FREELIST_ALLOC ? l->ref_pages : l->pages) + l->offsets[u];
	const int rc = op == KVR_FREELIST_ALLOC
			       ? kvr_freelist_alloc_round(&l->ref, l->counts, l->units, l->offsets, bufs)
			       : kvr_freelist_free_round(&l->ref, l->counts, l->units, l->offsets,
							 (const uint32_t *const *)bufs);
	free(bufs);
	cr_assert_eq(l->status_back, rc, "%s: %s: status %d, the reference %d", c->name, when, l->status_back, rc);
	cr_assert(l->counters_back[0] == l->ref.start && l->counters_back[1] == l->ref.end,
		  "%s: %s: counters [%llu, %llu), the reference [%llu, %llu)", c->name, when,
		  (unsigned long long)l->counters_back[0], (unsigned long long)l->counters_back[1],
		  (unsigned long long)l->ref.start, (unsigned long long)l->ref.end);
	cr_assert(!memcmp(l->offsets_back, l->offsets, (size_t)l->units * 8), "%s: %s: offsets differ", c->name,
		  when);
	cr_assert(!memcmp(l->ids_back, l->ref_ids, (size_t)l->capacity * 4), "%s: %s: the list's ids differ",
		  c->name, when);
	if (op == KVR_FREELIST_ALLOC && !rc)
		cr_assert(!memcmp(l->pages, l->ref_pages, total * 4), "%s: %s: allocated pages differ", c->name,
			  when);
	/* the shadow: a refused free gives its pages back to their units; a
	 * refused allocation handed out nothing */
	for (uint32_t u = 0; u < l->units && !(op == KVR_FREELIST_ALLOC && rc); u++)
		for (uint32_t k = 0; k < l->counts[u]; k++) {
			const uint32_t id = l->pages[l->offsets[u] + k];
			cr_assert_lt(id, l->capacity);
			if (op == KVR_FREELIST_FREE && rc) {
				l->owned[u][l->n_owned[u]++] = id;
			} else if (op == KVR_FREELIST_FREE) {
				cr_assert_eq(l->owner[id], u);
				l->owner[id] = FL_NOBODY;
			} else {
				cr_assert_eq(l->owner[id], FL_NOBODY, "%s: %s: unit %u got page %u owned by %u", c->name,
					     when, u, id, l->owner[id]);
				l->owner[id] = u;
				l->owned[u][l->n_owned[u]++] = id;
			}
		}
	uint64_t n_owned = 0;
	for (uint32_t u = 0; u < l->units; u++)
		n_owned += l->n_owned[u];
	cr_assert_eq(l->ref.end - l->ref.start + n_owned, l->capacity, "%s: %s: a page was lost", c->name, when);
	for (uint64_t i = l->ref.start; i < l->ref.end; i++)
		cr_assert_eq(l->owner[l->ref_ids[i % l->capacity]], FL_NOBODY, "%s: %s: an owned page is free",
			     c->name, when);
}

static void fl_round(struct dctx *c, struct fl_list *lists, struct kvr_freelist_item *d_items,
		     const uint32_t *ops, const uint32_t *pages_caps)
{
	struct kvr_freelist_item items[FL_LISTS];
	for (uint32_t i = 0; i < FL_LISTS; i++) {
		struct fl_list *l = &lists[i];
		items[i] = (struct kvr_freelist_item){ l->d_ids, l->d_counters, l->d_counts, l->d_offsets,
						       l->d_pages, l->d_status, l->capacity, l->units, ops[i],
						       pages_caps[i] };
		DEV_OK(c, kvr_dev_memcpy_async(c->dev, l->d_counts, l->counts, (size_t)l->units * 4, KVR_COPY_H2D,
					       c->s));
		DEV_OK(c, kvr_dev_memcpy_async(c->dev, l->d_pages, l->pages, (size_t)l->capacity * 4, KVR_COPY_H2D,
					       c->s));
	}
	DEV_OK(c, kvr_dev_memcpy_async(c->dev, d_items, items, sizeof(items), KVR_COPY_H2D, c->s));
	DEV_OK(c, kvr_dev_freelist(c->dev, d_items, FL_LISTS, c->s));
	for (uint32_t i = 0; i < FL_LISTS; i++) {
		struct fl_list *l = &lists[i];
		DEV_OK(c, kvr_dev_memcpy_async(c->dev, &l->status_back, l->d_status, 4, KVR_COPY_D2H, c->s));
		DEV_OK(c, kvr_dev_memcpy_async(c->dev, l->counters_back, l->d_counters, 16, KVR_COPY_D2H, c->s));
		DEV_OK(c, kvr_dev_memcpy_async(c->dev, l->offsets_back, l->d_offsets, (size_t)l->units * 8,
					       KVR_COPY_D2H, c->s));
		DEV_OK(c, kvr_dev_memcpy_async(c->dev, l->ids_back, l->d_ids, (size_t)l->capacity * 4, KVR_COPY_D2H,
					       c->s));
		if (ops[i] == KVR_FREELIST_ALLOC)
			DEV_OK(c, kvr_dev_memcpy_async(c->dev, l->pages, l->d_pages, (size_t)l->capacity * 4,
						       KVR_COPY_D2H, c->s));
	}
	DEV_OK(c, kvr_dev_stream_synchronize(c->dev, c->s));
	expect_no_failed_launch(c);
}

CONFORMANCE_TEST(freelist_rounds)
{
	struct dctx *c = &e->main;
	const int emu = e->bc->kind == KVR_DEV_CUDAEMU || e->bc->kind == KVR_DEV_CUDAEMU_STRICT;
	struct rng r = { 0x5eed0f1ee7ull };
	struct fl_list lists[FL_LISTS];
	/* units cross one block-scan chunk (256) and, on the cpu, one task (4096) */
	fl_open(c, &lists[0], 41, 7, 9);
	fl_open(c, &lists[1], 1500, 700, 3);
	fl_open(c, &lists[2], 12000, 5000, 3);
	struct kvr_freelist_item *d_items = NULL;
	DEV_OK(c, kvr_dev_alloc(c->dev, sizeof(struct kvr_freelist_item) * FL_LISTS, (void **)&d_items));
	const uint32_t rounds = emu ? 160 : 1200;
	uint32_t refused = 0;
	for (uint32_t round = 0; round < rounds; round++) {
		uint32_t ops[FL_LISTS], caps[FL_LISTS];
		for (uint32_t i = 0; i < FL_LISTS; i++) {
			ops[i] = fl_draw(&r, &lists[i]);
			caps[i] = lists[i].capacity;
		}
		c->s = round % 7 == 3 ? c->worker_s : c->inline_s; /* some rounds on the worker stream */
		fl_round(c, lists, d_items, ops, caps);
		c->s = c->inline_s;
		for (uint32_t i = 0; i < FL_LISTS; i++) {
			char when[64];
			snprintf(when, sizeof(when), "round %u list %u (%s)", round, i,
				 ops[i] == KVR_FREELIST_ALLOC ? "alloc" : "free");
			refused += lists[i].status_back != 0;
			fl_check(c, &lists[i], ops[i], when);
		}
	}
	cr_expect_gt(refused, 0, "%s: no round was refused: exhaustion untested", c->name);
	cr_expect_gt(lists[0].ref.start / lists[0].capacity, 5, "%s: the small list's counters did not wrap",
		     c->name);

	/* malformed items: an unknown op, a page buffer too small for the
	 * round; both refused as BAD, the lists unchanged */
	for (uint32_t bad = 0; bad < 2; bad++) {
		uint32_t ops[FL_LISTS], caps[FL_LISTS];
		for (uint32_t i = 0; i < FL_LISTS; i++) {
			struct fl_list *l = &lists[i];
			ops[i] = KVR_FREELIST_ALLOC, caps[i] = l->capacity;
			for (uint32_t u = 0; u < l->units; u++)
				l->counts[u] = u == 0; /* one page: fits every list that has one free */
		}
		if (bad == 0)
			ops[1] = 7;
		else
			caps[1] = 0;
		const uint64_t s0 = lists[1].ref.start, e0 = lists[1].ref.end;
		fl_round(c, lists, d_items, ops, caps);
		cr_assert_eq(lists[1].status_back, KVR_FREELIST_BAD, "%s: malformed item %u: status %d", c->name,
			     bad, lists[1].status_back);
		cr_assert(lists[1].counters_back[0] == s0 && lists[1].counters_back[1] == e0 &&
				  !memcmp(lists[1].ids_back, lists[1].ref_ids, (size_t)lists[1].capacity * 4),
			  "%s: a malformed item changed its list", c->name);
		for (uint32_t i = 0; i < FL_LISTS; i += 2) /* the well-formed neighbours still ran */
			fl_check(c, &lists[i], KVR_FREELIST_ALLOC, "beside a malformed item");
	}
	kvr_dev_free(c->dev, d_items);
	for (uint32_t i = 0; i < FL_LISTS; i++)
		fl_close(c, &lists[i]);
}
