/* SPDX-License-Identifier: MIT */
/*
 * test_scheduler.c — the decode-step scheduler (scheduler/) through the public
 * API plus the internal context constructor, on the cpu backend and on
 * cudaemu (the CUDA kernel bodies run on the CPU):
 *  - ordering: random delays injected at every hook site (controller jobs, copy
 *    and convert streams, an asynchronous compute stream) change no output bit,
 *    so no slot write races an attention and no attention reads a partial
 *    recall; streamed recall equals zero-copy bit for bit;
 *  - each mode attends to what docs/design.md ("The decode step") says, checked
 *    against an independent model of the state machine with a scalar Quest
 *    score, softmax-mean and top-k and a double-precision attention:
 *    speculative uses exactly step i−1's page sets (selected against step i's
 *    window), blocking selects with q_i, freekv corrects exactly the KV heads
 *    whose group-mean cosine is below tau, and a page leaving the window is a
 *    candidate the step it leaves;
 *  - streamed recall moves only misses (hits + misses = selected pages);
 *  - batches: each sequence's output equals the sequence decoded alone, a
 *    failing sequence leaves the others intact, fork and truncate mid-run;
 *  - the device budget admits sequences, traces export valid JSON, and no
 *    asynchronous error is left after a normal run.
 *
 * Shapes are small (n_kv 2, n_qo 4, d 32, p 16, 2 layers, S = W = 32,
 * B = 128 so k = 4) so that everything runs in seconds, also under cudaemu.
 * Keys and values lie on a grid of 1/256 in [-1, 1] (exact in f32, f16 and
 * bf16), so the reference sees exactly what the kernels see.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../host/pool.h"
#include "../scheduler/scheduler.h"
#include "backend.h"
#include "cudaemu.h"
#include "half.h"
#include "internal.h"
#include "kvrecall.h"
#include "helpers.h"

#define P 16
#define N_KV 2
#define N_QO 4
#define G (N_QO / N_KV)
#define D 32
#define NL 2 /* layers */
#define SINK 32
#define K_SEL 4 /* pages per KV head */
/* window and budget of the model's contexts: W = 32 (two pages) or, for the
 * W = 0 tests, none; B keeps k = K_SEL either way */
static uint32_t model_win = 32;
#define WIN model_win
#define BUDGET (SINK + WIN + K_SEL * P)
#define KV_ROW (N_KV * D)
#define Q_ROW (N_QO * D)
#define CAP 1200 /* tokens of history a test sequence may hold */
#define MAXB 6   /* sequences in one test batch */
#define MAX_PAGES (CAP / P)

/* ------------------------------------------------------------------ randomness */

struct rng {
	uint64_t s;
};

/* Uniform in [-1, 1). */
static float rnd(struct rng *r)
{
	return (float)(th_mix64(r->s++) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

/* ------------------------------------------------------------------ hooks */

/* Random delays (0–300 µs, seeded, thread-safe) at every hook site. */
static _Atomic uint64_t hook_calls[4];
static _Atomic uint64_t hook_counter;
static uint64_t hook_seed = 0x5eed;

static void hook_delay(void *user, uint32_t where)
{
	(void)user;
	if (where < 4)
		atomic_fetch_add_explicit(&hook_calls[where], 1, memory_order_relaxed);
	const uint64_t x =
		th_mix64(hook_seed ^ atomic_fetch_add_explicit(&hook_counter, 1, memory_order_relaxed));
	usleep((useconds_t)(x % 301));
}

static void hooks_reset(uint64_t seed)
{
	for (int i = 0; i < 4; i++)
		atomic_store(&hook_calls[i], 0);
	atomic_store(&hook_counter, 0);
	hook_seed = seed;
}

/* ------------------------------------------------------------------ contexts */

struct opts {
	uint32_t dev_kind; /* KVR_DEV_CPU, KVR_DEV_CUDAEMU or KVR_DEV_CUDAEMU_STRICT */
	uint32_t mode, recall, dtype;
	int hooks; /* random delays at every site and asynchronous compute */
	uint32_t chunk_pages, buffers, pool_layout;
	float tau;
	uint64_t pool_pages;   /* 0: plenty */
	uint64_t device_bytes; /* 0: the default */
	uint32_t max_seqs;
	uint32_t controller; /* KVR_CONTROLLER_*: the thread unless a test says otherwise */
	uint32_t kv_format;  /* KVR_KV_FORMAT_*: plain unless a test says otherwise */
	uint64_t ram_pages;  /* > 0: a spill tier with this many pages in RAM */
	int host_step;       /* the host reads q, k, v and selections (hooks.host_step) */
	int estimate;        /* config estimate: unselected candidates' estimate */
};

/* The page format the model attends over (set by run_drift from its opts):
 * tokens of offloaded pages are what attention reads of them, their
 * quantised values; selection still uses the raw keys' summaries. */
static uint32_t model_kv_format;
/* The model adds the estimate of the candidate pages not selected (config
 * estimate; set by run_drift): each such page as one token of its mean key
 * and mean value (fp32 sums in token order over P, in the dtype) whose
 * logit gets ln P, i.e. P·exp(q·k̄/√d) and that times v̄ (kernels.h). */
static int model_estimate;
static uint32_t model_dtype;

static struct opts opts_default(uint32_t dev_kind, uint32_t mode, uint32_t recall, uint32_t dtype)
{
	return (struct opts){ .dev_kind = dev_kind, .mode = mode, .recall = recall, .dtype = dtype,
			      .chunk_pages = 8, .buffers = 2, .pool_layout = KVR_POOL_HND,
			      .tau = 0.9f, .max_seqs = 8, .controller = KVR_CONTROLLER_THREAD };
}

static uint32_t ebytes(uint32_t dtype)
{
	return dtype == KVR_DTYPE_F32 ? 4 : 2;
}

static uint64_t page_bytes(uint32_t dtype)
{
	return 2ull * P * N_KV * D * ebytes(dtype);
}

static const char *dev_name(uint32_t kind)
{
	return kind == KVR_DEV_CUDAEMU	      ? "cudaemu"
	       : kind == KVR_DEV_CUDAEMU_STRICT ? "cudaemu-strict"
	       : kind == KVR_DEV_CUDA	      ? "cuda"
					      : "cpu";
}

static void config_of(const struct opts *o, struct kvr_config *c)
{
	th_config(c, NL, N_QO, N_KV, D, o->dtype, P, SINK, WIN, BUDGET);
	c->mode = o->mode;
	c->recall = o->recall;
	c->tau = o->tau;
	c->dense_layers[0] = 0; /* both layers may be sparse */
	c->max_sequences = o->max_seqs;
	c->max_batch = MAXB;
	c->threads = 1;
	c->recall_chunk_pages = o->chunk_pages;
	c->recall_buffers = o->buffers;
	c->pool_layout = o->pool_layout;
	c->pool_bytes = (o->pool_pages ? o->pool_pages : 2048) * page_bytes(o->dtype);
	c->device_bytes = o->device_bytes;
	c->controller = o->controller;
	c->kv_format = o->kv_format;
	c->pool_ram_bytes = o->ram_pages * page_bytes(o->dtype);
	c->estimate = (uint32_t)o->estimate;
}

/* Device buffers for the decode calls of a context on a separate-memory
 * device (cudaemu-strict), where q, k, v and out must be device memory; one
 * record per open context (tests open a second context beside the first). */
struct dstage {
	struct kvr_context *ctx;
	struct kvr_dev *dev;
	struct kvr_stream *stream;
	void *q[NL], *k[NL], *v[NL], *o[NL];
};
static struct dstage dstages[4];

static void dstage_put(struct dstage *d, void *dst, const void *src, size_t bytes)
{
	cr_assert_eq(kvr_dev_memcpy_async(d->dev, dst, src, bytes, KVR_COPY_H2D, d->stream), 0, "%s",
		     kvr_dev_last_error(d->dev));
	cr_assert_eq(kvr_dev_stream_synchronize(d->dev, d->stream), 0);
}

static void dstage_get(struct dstage *d, void *dst, const void *src, size_t bytes)
{
	cr_assert_eq(kvr_dev_memcpy_async(d->dev, dst, src, bytes, KVR_COPY_D2H, d->stream), 0, "%s",
		     kvr_dev_last_error(d->dev));
	cr_assert_eq(kvr_dev_stream_synchronize(d->dev, d->stream), 0);
}

/* The context's record, or NULL when its device is host-addressable. */
static struct dstage *dstage_of(const struct kvr_context *ctx)
{
	for (int i = 0; i < 4; i++)
		if (dstages[i].ctx == ctx)
			return &dstages[i];
	return NULL;
}

static void dstage_open(struct kvr_context *ctx)
{
	if (kvr_dev_host_visible(ctx->dev))
		return;
	struct dstage *d = dstage_of(NULL);
	cr_assert(d, "too many contexts open");
	d->ctx = ctx;
	d->dev = ctx->dev;
	cr_assert_eq(kvr_dev_stream_create(d->dev, 0, &d->stream), 0);
	for (int l = 0; l < NL; l++) {
		cr_assert_eq(kvr_dev_alloc(d->dev, MAXB * Q_ROW * 4, &d->q[l]), 0);
		cr_assert_eq(kvr_dev_alloc(d->dev, MAXB * KV_ROW * 4, &d->k[l]), 0);
		cr_assert_eq(kvr_dev_alloc(d->dev, MAXB * KV_ROW * 4, &d->v[l]), 0);
		cr_assert_eq(kvr_dev_alloc(d->dev, MAXB * Q_ROW * 4, &d->o[l]), 0);
	}
}

static void dstage_close(struct kvr_context *ctx)
{
	struct dstage *d = dstage_of(ctx);
	if (!d)
		return;
	for (int l = 0; l < NL; l++) {
		kvr_dev_free(d->dev, d->q[l]);
		kvr_dev_free(d->dev, d->k[l]);
		kvr_dev_free(d->dev, d->v[l]);
		kvr_dev_free(d->dev, d->o[l]);
	}
	kvr_dev_stream_destroy(d->dev, d->stream);
	memset(d, 0, sizeof(*d));
}

static struct kvr_context *ctx_open(const struct opts *o)
{
	struct kvr_config c;
	config_of(o, &c);
	const struct kvr_sched_hooks h = { o->hooks ? hook_delay : NULL, NULL, (uint32_t)o->hooks,
					   (uint32_t)o->host_step };
	struct kvr_context *ctx = NULL;
	const int r = kvr_context_create_internal(&c, o->dev_kind, o->hooks || o->host_step ? &h : NULL, &ctx);
	cr_assert_eq(r, 0, "context (%s): %d: %s", dev_name(o->dev_kind), r, kvr_last_error(NULL));
	dstage_open(ctx);
	return ctx;
}

/* Every context ends without an asynchronous error and, on cudaemu, without a
 * failed kernel launch. */
static void ctx_close(struct kvr_context *ctx, const struct opts *o)
{
	const char *msg = NULL;
	const int e = kvr_async_error(ctx, &msg);
	cr_expect_eq(e, 0, "asynchronous error %d: %s", e, msg ? msg : "");
	if (o->dev_kind == KVR_DEV_CUDAEMU || o->dev_kind == KVR_DEV_CUDAEMU_STRICT)
		cr_expect_eq(kvr_cudaemu_failed_launches(), 0, "a cudaemu kernel launch failed");
	if (o->dev_kind == KVR_DEV_CUDAEMU_STRICT) {
		char why[256] = "";
		kvr_cudaemu_strict_last_violation(why, sizeof(why));
		cr_expect_eq(kvr_cudaemu_strict_violations(), 0, "cudaemu-strict: %s", why);
	}
	dstage_close(ctx);
	kvr_context_destroy(ctx);
}

/* ------------------------------------------------------------------ test sequences */

/* One sequence as the test sees it: its history (every layer's keys and
 * values, as floats exact in the dtype) and the reference model of the
 * scheduler's per-layer speculative state. */
struct tseq {
	uint32_t id;
	uint64_t n;   /* tokens in every layer */
	uint64_t gen; /* seed of its new tokens */
	/* tokens at positions >= anti_from get keys opposite to anti_q's group
	 * (lowest scores for that query) */
	uint64_t anti_from;
	const float *anti_q; /* [NL][Q_ROW] or NULL */
	float *k[NL], *v[NL];
	/* model */
	int has_prev[NL];
	float prev_q[NL][Q_ROW];
	uint64_t prev_n[NL];
	int prev_next[NL];
	int prev_corrected[NL];
};

static void tseq_init(struct tseq *t, uint64_t gen)
{
	memset(t, 0, sizeof(*t));
	t->gen = gen;
	t->anti_from = UINT64_MAX;
	for (int l = 0; l < NL; l++) {
		t->k[l] = calloc((size_t)CAP * KV_ROW, sizeof(float));
		t->v[l] = calloc((size_t)CAP * KV_ROW, sizeof(float));
		cr_assert(t->k[l] && t->v[l]);
	}
}

static void tseq_fini(struct tseq *t)
{
	for (int l = 0; l < NL; l++)
		free(t->k[l]), free(t->v[l]);
}

/* The sequence's token at `pos` of layer l (a pure function of gen). */
static void token_kv(const struct tseq *t, uint32_t l, uint64_t pos, float *k, float *v)
{
	for (uint32_t c = 0; c < KV_ROW; c++) {
		k[c] = th_grid_value(t->gen, 2 * l, pos * KV_ROW + c);
		v[c] = th_grid_value(t->gen, 2 * l + 1, pos * KV_ROW + c);
	}
	if (t->anti_q && pos >= t->anti_from)
		for (uint32_t m = 0; m < N_KV; m++)
			for (uint32_t c = 0; c < D; c++) {
				const float qc = t->anti_q[l * Q_ROW + m * G * D + c];
				const float mag = 0.5f + 0.5f * fabsf(k[m * D + c]);
				k[m * D + c] = qc >= 0 ? -mag : mag; /* on the 1/512 grid: exact in f16 */
			}
}

/* A copy of src's first n tokens with a fresh model (for replays). */
static void tseq_copy(struct tseq *dst, const struct tseq *src, uint64_t n, uint64_t gen)
{
	tseq_init(dst, gen);
	for (int l = 0; l < NL; l++) {
		memcpy(dst->k[l], src->k[l], n * KV_ROW * sizeof(float));
		memcpy(dst->v[l], src->v[l], n * KV_ROW * sizeof(float));
	}
	dst->n = n;
}

static void to_dtype(void *dst, const float *src, size_t n, uint32_t dtype)
{
	for (size_t i = 0; i < n; i++)
		kvr_store_f32(dst, dtype, i, src[i]);
}

static void from_dtype(float *dst, const void *src, size_t n, uint32_t dtype)
{
	for (size_t i = 0; i < n; i++)
		dst[i] = kvr_load_f32(src, dtype, i);
}

/* Round through the dtype, so the model sees what the kernels see. */
static void round_dtype(float *x, size_t n, uint32_t dtype)
{
	unsigned char tmp[4 * 2 * Q_ROW];
	cr_assert(n <= 2 * Q_ROW);
	to_dtype(tmp, x, n, dtype);
	from_dtype(x, tmp, n, dtype);
}

/* Create the sequence in ctx and prefill its history's first t->n tokens
 * (in two chunks). */
static void tseq_ingest(struct kvr_context *ctx, uint32_t dtype, struct tseq *t)
{
	cr_assert_eq(kvr_seq_create(ctx, &t->id), 0, "%s", kvr_last_error(ctx));
	const uint64_t n = t->n, half = n / 2 + 3 > n ? n : n / 2 + 3;
	unsigned char *kb = malloc(n * KV_ROW * 4 + 4), *vb = malloc(n * KV_ROW * 4 + 4);
	cr_assert(kb && vb);
	for (uint32_t l = 0; l < NL; l++) {
		to_dtype(kb, t->k[l], n * KV_ROW, dtype);
		to_dtype(vb, t->v[l], n * KV_ROW, dtype);
		const uint64_t eb = ebytes(dtype);
		cr_assert_eq(kvr_prefill(ctx, t->id, l, 0, (uint32_t)half, kb, vb), 0, "%s",
			     kvr_last_error(ctx));
		cr_assert_eq(kvr_prefill(ctx, t->id, l, half, (uint32_t)(n - half),
					 kb + half * KV_ROW * eb, vb + half * KV_ROW * eb),
			     0, "%s", kvr_last_error(ctx));
	}
	free(kb), free(vb);
}

/* Generate n0 tokens and prefill them into a new sequence of ctx. */
static void tseq_prefill(struct kvr_context *ctx, uint32_t dtype, struct tseq *t, uint64_t n0)
{
	cr_assert(n0 < CAP);
	for (uint32_t l = 0; l < NL; l++)
		for (uint64_t pos = 0; pos < n0; pos++)
			token_kv(t, l, pos, t->k[l] + pos * KV_ROW, t->v[l] + pos * KV_ROW);
	t->n = n0;
	tseq_ingest(ctx, dtype, t);
}

/* One decode step of a batch: q[i][l] per entry; writes out[i][l] and
 * status[i][l]. Each entry's new token comes from its generator; it joins the
 * history when every layer succeeded (a failure must fail every layer here). */
static void step_batch(struct kvr_context *ctx, uint32_t dtype, struct tseq **ts, uint32_t nb,
		       const float (*q)[NL][Q_ROW], float (*out)[NL][Q_ROW], int32_t (*status)[NL])
{
	uint32_t ids[MAXB];
	uint64_t pos[MAXB];
	cr_assert(nb <= MAXB);
	for (uint32_t i = 0; i < nb; i++) {
		ids[i] = ts[i]->id;
		pos[i] = ts[i]->n;
		cr_assert(pos[i] < CAP);
		for (uint32_t l = 0; l < NL; l++)
			token_kv(ts[i], l, pos[i], ts[i]->k[l] + pos[i] * KV_ROW,
				 ts[i]->v[l] + pos[i] * KV_ROW);
	}
	cr_assert_eq(kvr_decode_begin(ctx, ids, pos, nb), 0, "%s", kvr_last_error(ctx));
	const uint32_t eb = ebytes(dtype);
	struct dstage *ds = dstage_of(ctx);
	/* per layer: with asynchronous compute the inputs and outputs of every
	 * layer stay in use until kvr_decode_end */
	static unsigned char qb[NL][MAXB * Q_ROW * 4], kb[NL][MAXB * KV_ROW * 4],
		vb[NL][MAXB * KV_ROW * 4], ob[NL][MAXB * Q_ROW * 4];
	for (uint32_t l = 0; l < NL; l++) {
		for (uint32_t i = 0; i < nb; i++) {
			to_dtype(qb[l] + (size_t)i * Q_ROW * eb, q[i][l], Q_ROW, dtype);
			to_dtype(kb[l] + (size_t)i * KV_ROW * eb, ts[i]->k[l] + pos[i] * KV_ROW, KV_ROW, dtype);
			to_dtype(vb[l] + (size_t)i * KV_ROW * eb, ts[i]->v[l] + pos[i] * KV_ROW, KV_ROW, dtype);
		}
		memset(ob[l], 0xa5, sizeof(ob[l])); /* a failed entry's zeros must be written */
		int32_t st[MAXB];
		for (uint32_t i = 0; i < nb; i++)
			st[i] = 12345;
		void *in_q = qb[l], *in_k = kb[l], *in_v = vb[l], *out_o = ob[l];
		if (ds) {
			/* a separate-memory device: q, k, v and out are device memory */
			dstage_put(ds, ds->q[l], qb[l], sizeof(qb[l]));
			dstage_put(ds, ds->k[l], kb[l], sizeof(kb[l]));
			dstage_put(ds, ds->v[l], vb[l], sizeof(vb[l]));
			dstage_put(ds, ds->o[l], ob[l], sizeof(ob[l]));
			in_q = ds->q[l], in_k = ds->k[l], in_v = ds->v[l], out_o = ds->o[l];
		}
		cr_assert_eq(kvr_decode_layer(ctx, l, in_q, in_k, in_v, out_o, st, NULL), 0, "%s",
			     kvr_last_error(ctx));
		for (uint32_t i = 0; i < nb; i++)
			status[i][l] = st[i];
	}
	cr_assert_eq(kvr_decode_end(ctx), 0, "%s", kvr_last_error(ctx));
	if (ds)
		for (uint32_t l = 0; l < NL; l++)
			dstage_get(ds, ob[l], ds->o[l], sizeof(ob[l]));
	for (uint32_t l = 0; l < NL; l++)
		for (uint32_t i = 0; i < nb; i++)
			from_dtype(out[i][l], ob[l] + (size_t)i * Q_ROW * eb, Q_ROW, dtype);
	for (uint32_t i = 0; i < nb; i++) {
		cr_assert_eq(status[i][0] == 0, status[i][1] == 0,
			     "sequence %u failed in one layer only (%d, %d)", ids[i], status[i][0],
			     status[i][1]);
		if (!status[i][0])
			ts[i]->n++;
	}
}

/* Single-sequence convenience. */
static void step_one(struct kvr_context *ctx, uint32_t dtype, struct tseq *t,
		     const float q[NL][Q_ROW], float out[NL][Q_ROW])
{
	int32_t status[1][NL];
	step_batch(ctx, dtype, &t, 1, (const float(*)[NL][Q_ROW])q, (float(*)[NL][Q_ROW])out, status);
	cr_assert_eq(status[0][0], 0, "%s", kvr_last_error(ctx));
}

/* ------------------------------------------------------------------ queries */

/* Queries that drift step to step, with an occasional jump of one KV head's
 * group (so that selections change, and freekv corrects now and then). */
struct qgen {
	struct rng r;
	uint32_t step;
	float q[NL][Q_ROW];
};

static void qgen_init(struct qgen *g, uint64_t seed)
{
	g->r.s = seed;
	g->step = 0;
}

static void qgen_next(struct qgen *g, uint32_t dtype, float q[NL][Q_ROW])
{
	const uint32_t s = g->step++;
	for (uint32_t l = 0; l < NL; l++)
		for (uint32_t m = 0; m < N_KV; m++) {
			const int jump = s == 0 || (s % 6 == 5 && (s / 6 + l) % N_KV == m);
			for (uint32_t i = m * G * D; i < (m + 1) * G * D; i++)
				g->q[l][i] = jump ? 3.0f * rnd(&g->r) : g->q[l][i] + 1.0f * rnd(&g->r);
		}
	for (uint32_t l = 0; l < NL; l++)
		round_dtype(g->q[l], Q_ROW, dtype);
	memcpy(q, g->q, sizeof(g->q));
}

/* ------------------------------------------------------------------ reference */

static void page_summary(const struct tseq *t, uint32_t l, uint32_t pg, uint32_t m, double *mn,
			 double *mx)
{
	for (uint32_t c = 0; c < D; c++) {
		mn[c] = INFINITY;
		mx[c] = -INFINITY;
		for (uint32_t r = 0; r < P; r++) {
			const double x = t->k[l][((uint64_t)pg * P + r) * KV_ROW + m * D + c];
			mn[c] = x < mn[c] ? x : mn[c];
			mx[c] = x > mx[c] ? x : mx[c];
		}
	}
}

/* The window of a layer holding n tokens (docs/design.md, "Glossary"): the
 * W/P newest full pages and the partial tail. With W = 0 the tail page the
 * newest token just completed is still the window's: nothing else can cover
 * it (it had no summary when the serving selection was made). */
static uint32_t win_first_of(uint64_t n)
{
	const uint32_t n_full = (uint32_t)(n / P), window = WIN / P;
	if (!window)
		return n && n % P == 0 ? n_full - 1 : n_full;
	return n_full > window ? n_full - window : 0;
}

/* The candidates [SINK/P, *cand_end) of a selection made when a layer holds
 * n tokens, for the step it is made at (next = 0) or for the next one (next
 * = 1): every full page outside sink and that step's window. */
static uint32_t cand_end_of(uint64_t n, int next)
{
	const uint32_t n_full = (uint32_t)(n / P), sink = SINK / P;
	uint32_t end = win_first_of(n + (next ? 1 : 0));
	end = end > n_full ? n_full : end; /* only full pages have summaries */
	return end > sink ? end : sink;
}

/* The pages each head's softmax spans at that selection: every page whose
 * summary is certainly written — all full pages but the one the newest token
 * completed (docs/design.md, "The decode step", step 5: FreeKV's P^h over
 * all pages). */
static uint32_t norm_end_of(uint64_t n, uint32_t cand_end)
{
	const uint32_t with_summary = n ? (uint32_t)((n - 1) / P) : 0;
	return with_summary > cand_end ? with_summary : cand_end;
}

/*
 * Step 5 of docs/design.md ("The decode step"), independently: for KV head
 * m, the Quest bound of every page with a summary per query head, softmax
 * over those pages per query head, mean over the group for each candidate,
 * top-k with ties to the lower page. Writes the pages in ascending order (-1
 * after the last), returns how many; *ambiguous is set when the k-th and
 * (k+1)-th scores are too close for float to call.
 */
static uint32_t ref_select(const struct tseq *t, uint32_t l, const float *q, uint64_t n, int next,
			   uint32_t m, int32_t sel[K_SEL], int *ambiguous, double *scores_out)
{
	const uint32_t cb = SINK / P, ce = cand_end_of(n, next), nc = ce - cb;
	const uint32_t ne = norm_end_of(n, ce);
	double score[MAX_PAGES] = { 0 }, s[MAX_PAGES], mn[D], mx[D];
	double bound[MAX_PAGES][G]; /* page j of [0, ne) */
	for (uint32_t j = 0; j < ne; j++) {
		page_summary(t, l, j, m, mn, mx);
		for (uint32_t g = 0; g < G; g++) {
			const float *qh = q + (m * G + g) * D;
			double acc = 0;
			for (uint32_t c = 0; c < D; c++) {
				const double lo = qh[c] * mn[c], hi = qh[c] * mx[c];
				acc += lo > hi ? lo : hi;
			}
			bound[j][g] = acc / sqrt((double)D);
		}
	}
	for (uint32_t g = 0; g < G; g++) {
		double smax = -INFINITY, sum = 0;
		for (uint32_t j = 0; j < ne; j++)
			smax = bound[j][g] > smax ? bound[j][g] : smax;
		for (uint32_t j = 0; j < ne; j++)
			sum += (s[j] = exp(bound[j][g] - smax));
		for (uint32_t j = 0; j < nc; j++)
			score[j] += s[cb + j] / sum / G;
	}
	if (scores_out)
		memcpy(scores_out, score, nc * sizeof(double));
	uint8_t taken[MAX_PAGES] = { 0 };
	const uint32_t take = nc < K_SEL ? nc : K_SEL;
	double kth = 0;
	for (uint32_t w = 0; w < take; w++) {
		int32_t best = -1;
		for (uint32_t j = 0; j < nc; j++)
			if (!taken[j] && (best < 0 || score[j] > score[best]))
				best = (int32_t)j;
		taken[best] = 1;
		kth = score[best];
	}
	*ambiguous = 0;
	for (uint32_t j = 0; j < nc; j++)
		if (!taken[j] && kth - score[j] <= 1e-5 * kth)
			*ambiguous = 1;
	uint32_t w = 0;
	for (uint32_t j = 0; j < nc; j++)
		if (taken[j])
			sel[w++] = (int32_t)(cb + j);
	for (uint32_t i = w; i < K_SEL; i++)
		sel[i] = -1;
	return w;
}

/* Attention of KV head m's G query heads over the tokens a layer of n tokens
 * attends: every token (dense), or sink + the selected pages + window + tail;
 * in double. */
static void ref_attend(const struct tseq *t, uint32_t l, uint64_t n, const float *q, uint32_t m,
		       int dense, const int32_t *sel, double out[G * D])
{
	const uint32_t n_full = (uint32_t)(n / P), sink = SINK / P;
	const uint32_t win_first = win_first_of(n);
	static uint8_t use[CAP];
	for (uint64_t tok = 0; tok < n; tok++) {
		const uint32_t pg = (uint32_t)(tok / P);
		int u = dense || pg >= n_full || pg < sink || pg >= win_first;
		for (uint32_t i = 0; !u && sel && i < K_SEL; i++)
			u = sel[i] == (int32_t)pg;
		use[tok] = (uint8_t)u;
	}
	/* head m's keys and values as attention reads them: offloaded pages
	 * through their format's quantisation (kvquant.h), the tail as is */
	static float kq[CAP][D], vq[CAP][D];
	struct kvr_quant_geometry gq;
	const int quant = !kvr_quant_geometry_init(&gq, P, D, 1, model_kv_format);
	for (uint64_t tok = 0; tok < n; tok++) {
		const float *kr = &t->k[l][tok * KV_ROW + m * D], *vr = &t->v[l][tok * KV_ROW + m * D];
		if (!use[tok])
			continue;
		if (!quant || tok >= (uint64_t)n_full * P) {
			memcpy(kq[tok], kr, sizeof(kq[tok]));
			memcpy(vq[tok], vr, sizeof(vq[tok]));
			continue;
		}
		uint8_t codes[D];
		uint16_t sz[2];
		kvr_quant_row(kr, D, 1, gq.key_bits, codes, sz);
		kvr_dequant_row(codes, D, gq.key_bits, sz, kq[tok]);
		kvr_quant_row(vr, D, 1, gq.value_bits, codes, sz);
		kvr_dequant_row(codes, D, gq.value_bits, sz, vq[tok]);
	}
	/* the estimate: every full candidate page [sink, win_first) not
	 * attended, from its raw (unquantised) keys and values */
	static float km[MAX_PAGES][D], vm[MAX_PAGES][D];
	uint32_t n_est = 0;
	for (uint32_t pg = sink; model_estimate && !dense && pg < win_first && pg < n_full; pg++) {
		if (use[(uint64_t)pg * P])
			continue;
		for (uint32_t c = 0; c < D; c++) {
			float sk = 0, sv = 0;
			for (uint32_t r = 0; r < P; r++) {
				sk += t->k[l][((uint64_t)pg * P + r) * KV_ROW + m * D + c];
				sv += t->v[l][((uint64_t)pg * P + r) * KV_ROW + m * D + c];
			}
			km[n_est][c] = sk / P;
			vm[n_est][c] = sv / P;
		}
		round_dtype(km[n_est], D, model_dtype);
		round_dtype(vm[n_est], D, model_dtype);
		n_est++;
	}
	static double logit[CAP], est_logit[MAX_PAGES];
	for (uint32_t g = 0; g < G; g++) {
		const float *qh = q + (m * G + g) * D;
		double mxl = -INFINITY, sum = 0, acc[D] = { 0 };
		/* quantised pages meet the query rounded to 8 bits per row
		 * (kvquant.h's contract): the logit is s_q·Σ q8·k */
		float xs[D];
		int8_t q8[D];
		int32_t q8_sum;
		for (uint32_t c = 0; c < D; c++)
			xs[c] = qh[c] * (1.0f / sqrtf((float)D));
		const double s_q = kvr_quant_query_row(xs, D, q8, &q8_sum);
		for (uint64_t tok = 0; tok < n; tok++) {
			if (!use[tok])
				continue;
			const int rounded = quant && tok < (uint64_t)n_full * P;
			double dot = 0;
			for (uint32_t c = 0; c < D; c++)
				dot += (rounded ? (double)q8[c] : (double)qh[c]) * kq[tok][c];
			logit[tok] = rounded ? s_q * dot : dot / sqrt((double)D);
			mxl = logit[tok] > mxl ? logit[tok] : mxl;
		}
		for (uint32_t e = 0; e < n_est; e++) {
			double dot = 0;
			for (uint32_t c = 0; c < D; c++)
				dot += (double)qh[c] * km[e][c];
			est_logit[e] = dot / sqrt((double)D) + log((double)P);
			mxl = est_logit[e] > mxl ? est_logit[e] : mxl;
		}
		for (uint64_t tok = 0; tok < n; tok++) {
			if (!use[tok])
				continue;
			const double w = exp(logit[tok] - mxl);
			sum += w;
			for (uint32_t c = 0; c < D; c++)
				acc[c] += w * vq[tok][c];
		}
		for (uint32_t e = 0; e < n_est; e++) {
			const double w = exp(est_logit[e] - mxl);
			sum += w;
			for (uint32_t c = 0; c < D; c++)
				acc[c] += w * vm[e][c];
		}
		for (uint32_t c = 0; c < D; c++)
			out[g * D + c] = acc[c] / sum;
	}
}

/* Group-mean cosine of KV head m between two queries, in double. */
static double ref_cosine(const float *a, const float *b, uint32_t m)
{
	double mean = 0;
	for (uint32_t g = 0; g < G; g++) {
		const float *x = a + (m * G + g) * D, *y = b + (m * G + g) * D;
		double dot = 0, nx = 0, ny = 0;
		for (uint32_t c = 0; c < D; c++) {
			dot += (double)x[c] * y[c];
			nx += (double)x[c] * x[c];
			ny += (double)y[c] * y[c];
		}
		mean += (nx == 0 || ny == 0) ? 0 : dot / sqrt(nx * ny);
	}
	return mean / G;
}

static double max_diff(const float *got, const double *want, uint32_t n)
{
	double d = 0;
	for (uint32_t i = 0; i < n; i++) {
		const double e = fabs((double)got[i] - want[i]);
		d = e > d || isnan(e) ? e : d;
	}
	return d;
}

/* What the model saw over a run. */
struct check {
	uint32_t compared, ambiguous, dense;
	uint32_t checked_heads, corrected_heads; /* freekv checks (not the first step) */
	uint32_t correction_waits;               /* (sequence, layer) steps with a head corrected */
	uint32_t crossings;                      /* steps whose window moved since the previous */
	uint32_t crossings_after_correction;     /* ... right after a corrected step */
	uint64_t head_corr[N_KV];
	double max_err;  /* against the model */
	double alt_diff; /* against the other choice (now vs previous selection) */
	uint8_t last_corr[NL][N_KV];
	int32_t last_sel[NL][N_KV][K_SEL];
	struct kvr_stats stats; /* the context's, at the end of a drift run */
	uint64_t alloc_rounds, free_rounds; /* quantised streamed: the unit cache's (units.c) */
	uint64_t pool_evictions;            /* spill tier: pages that left RAM */
};

static struct kvr_stats ctx_stats(struct kvr_context *ctx);

/*
 * The model of one (sequence, layer) decode step (docs/design.md, "The
 * decode step"), t->n already counting the new token: which heads are
 * corrected, which pages each head attends; compares `out` with the
 * reference attention over them within tol, then updates the model's
 * speculative state.
 */
static void model_step(struct tseq *t, uint32_t l, const float *q, const float *out, uint32_t mode,
		       float tau, double tol, struct check *ck, const char *what, uint32_t step)
{
	const uint64_t n = t->n;
	double want[G * D];
	if (n <= BUDGET) {
		for (uint32_t m = 0; m < N_KV; m++) {
			ref_attend(t, l, n, q, m, 1, NULL, want);
			const double e = max_diff(out + m * G * D, want, G * D);
			cr_assert(e <= tol, "%s step %u layer %u head %u (dense, n %llu): error %g", what,
				  step, l, m, (unsigned long long)n, e);
			ck->max_err = e > ck->max_err ? e : ck->max_err;
		}
		ck->dense++;
		t->has_prev[l] = 0;
		return;
	}
	uint8_t corr[N_KV] = { 0 };
	int cos_amb[N_KV] = { 0 };
	if (mode == KVR_MODE_BLOCKING || !t->has_prev[l]) {
		memset(corr, 1, sizeof(corr));
	} else if (mode == KVR_MODE_FREEKV) {
		for (uint32_t m = 0; m < N_KV; m++) {
			const double cs = ref_cosine(q, t->prev_q[l], m);
			corr[m] = !(cs >= tau);
			cos_amb[m] = fabs(cs - tau) < 1e-4;
			ck->corrected_heads += corr[m];
			ck->head_corr[m] += corr[m];
		}
		ck->checked_heads += N_KV;
	}
	int any = 0;
	for (uint32_t m = 0; m < N_KV; m++)
		any |= corr[m];
	ck->correction_waits += (uint32_t)any;
	/* a selection made now serves the next step as well (but in blocking
	 * mode, which selects every step): its candidates are the next step's */
	const int next_now = mode != KVR_MODE_BLOCKING;
	/* the window moved since the selection serving the uncorrected heads */
	const int crossed = t->has_prev[l] && win_first_of(n) != win_first_of(t->prev_n[l]);
	ck->crossings += (uint32_t)crossed;
	ck->crossings_after_correction += (uint32_t)(crossed && t->prev_corrected[l]);
	for (uint32_t m = 0; m < N_KV; m++) {
		int32_t now[K_SEL], prev[K_SEL];
		int amb_now = 0, amb_prev = 0;
		/* The invariant (docs/design.md, "The decode step"): every page
		 * outside sink and window(i) was a candidate of the selection that
		 * serves step i */
		const uint64_t serving_n = corr[m] ? n : t->prev_n[l];
		const int serving_next = corr[m] ? next_now : t->prev_next[l];
		if (corr[m] || t->has_prev[l]) {
			const uint32_t need = win_first_of(n) > SINK / P ? win_first_of(n) : SINK / P;
			cr_assert_geq(cand_end_of(serving_n, serving_next), need,
				      "%s step %u sequence %u layer %u KV head %u (n %llu): pages %u..%u lie "
				      "outside sink and window but the selection serving this step "
				      "(made at n %llu) had candidates only below page %u",
				      what, step, t->id, l, m, (unsigned long long)n,
				      cand_end_of(serving_n, serving_next), need - 1,
				      (unsigned long long)serving_n, cand_end_of(serving_n, serving_next));
		}
		ref_select(t, l, q, n, next_now, m, now, &amb_now, NULL);
		if (t->has_prev[l])
			ref_select(t, l, t->prev_q[l], t->prev_n[l], t->prev_next[l], m, prev, &amb_prev,
				   NULL);
		const int32_t *sel = corr[m] ? now : prev;
		const int amb = cos_amb[m] || (corr[m] ? amb_now : amb_prev);
		memcpy(ck->last_sel[l][m], sel, sizeof(now));
		ck->last_corr[l][m] = corr[m];
		ref_attend(t, l, n, q, m, 0, sel, want);
		const double e = max_diff(out + m * G * D, want, G * D);
		if (amb) {
			ck->ambiguous++;
		} else {
			cr_assert(e <= tol,
				  "%s step %u sequence %u layer %u KV head %u (n %llu, %s): error %g "
				  "against the reference over pages %d %d %d %d",
				  what, step, t->id, l, m, (unsigned long long)n,
				  corr[m] ? "selected now" : "previous selection", e, sel[0], sel[1],
				  sel[2], sel[3]);
			ck->compared++;
			ck->max_err = e > ck->max_err ? e : ck->max_err;
		}
		if (t->has_prev[l]) {
			ref_attend(t, l, n, q, m, 0, corr[m] ? prev : now, want);
			const double a = max_diff(out + m * G * D, want, G * D);
			ck->alt_diff = a > ck->alt_diff ? a : ck->alt_diff;
		}
	}
	memcpy(t->prev_q[l], q, Q_ROW * sizeof(float));
	t->prev_n[l] = n;
	t->prev_next[l] = any ? next_now : 1; /* a correction's selection serves the next step */
	t->prev_corrected[l] = any;
	t->has_prev[l] = 1;
}

static double tol_of(uint32_t dtype)
{
	return dtype == KVR_DTYPE_F32 ? 1e-4 : 2e-3;
}

/* ------------------------------------------------------------------ drift runs */

#define DRIFT_MAX_SEQS 2
static const uint64_t drift_n0[DRIFT_MAX_SEQS] = { 300, 419 };

/* A drift run: n_seqs sequences (300 and 419 tokens) decoded together for
 * n_steps with drifting queries. */
struct drift {
	uint32_t n_seqs, n_steps;
	float *outs; /* [step][seq][layer][Q_ROW] */
};

static size_t drift_floats(const struct drift *r)
{
	return (size_t)r->n_steps * r->n_seqs * NL * Q_ROW;
}

static void drift_alloc(struct drift *r, uint32_t n_seqs, uint32_t n_steps)
{
	r->n_seqs = n_seqs;
	r->n_steps = n_steps;
	r->outs = malloc(drift_floats(r) * sizeof(float));
	cr_assert(r->outs);
}

/* Run it in a context of `o`; every output is checked against the model as
 * well (ck). */
static void run_drift(const struct opts *o, struct drift *r, struct check *ck)
{
	hooks_reset(0x5eed + o->mode * 7 + o->recall);
	model_kv_format = o->kv_format;
	model_estimate = o->estimate;
	model_dtype = o->dtype;
	struct kvr_context *ctx = ctx_open(o);
	struct tseq t[DRIFT_MAX_SEQS], *tp[DRIFT_MAX_SEQS];
	struct qgen qg[DRIFT_MAX_SEQS];
	const uint32_t ns = r->n_seqs;
	cr_assert(ns <= DRIFT_MAX_SEQS);
	memset(ck, 0, sizeof(*ck));
	for (uint32_t s = 0; s < ns; s++) {
		tseq_init(&t[s], 100 + (uint64_t)s);
		tseq_prefill(ctx, o->dtype, &t[s], drift_n0[s]);
		qgen_init(&qg[s], 1000 + (uint64_t)s);
		tp[s] = &t[s];
	}
	char what[128];
	snprintf(what, sizeof(what), "%s %s %s %s %s%s%s, %u buffer(s), %u-page chunks", dev_name(o->dev_kind),
		 kvr_mode_name(o->mode), kvr_recall_name(o->recall), kvr_dtype_name(o->dtype),
		 kvr_kv_format_name(o->kv_format),
		 o->pool_layout == KVR_POOL_NHD ? " NHD pool" : "", o->hooks ? " delayed" : "",
		 o->buffers, o->chunk_pages);
	for (uint32_t i = 0; i < r->n_steps; i++) {
		float q[DRIFT_MAX_SEQS][NL][Q_ROW], out[DRIFT_MAX_SEQS][NL][Q_ROW];
		int32_t status[DRIFT_MAX_SEQS][NL];
		for (uint32_t s = 0; s < ns; s++)
			qgen_next(&qg[s], o->dtype, q[s]);
		step_batch(ctx, o->dtype, tp, ns, (const float(*)[NL][Q_ROW])q, out, status);
		for (uint32_t s = 0; s < ns; s++)
			for (uint32_t l = 0; l < NL; l++) {
				cr_assert_eq(status[s][l], 0, "%s step %u: %s", what, i, kvr_last_error(ctx));
				if (o->kv_format == KVR_KV_FORMAT_MIXED) { /* which pages are K4V2 is the runtime's call */
					for (uint32_t x = 0; x < Q_ROW; x++)
						cr_assert(isfinite(out[s][l][x]), "%s step %u: output %u", what, i, x);
					continue;
				}
				model_step(&t[s], l, q[s][l], out[s][l], o->mode, o->tau, tol_of(o->dtype), ck,
					   what, i);
			}
		memcpy(r->outs + (size_t)i * ns * NL * Q_ROW, out, (size_t)ns * NL * Q_ROW * sizeof(float));
	}
	if (o->hooks) {
		/* the delays really ran where they should (blocking with zero-copy
		 * posts no controller job: it selects on the engine's thread; on
		 * the device path blocking posts none either, and its recall is
		 * the compute stream's) */
		const int device_plan = (o->dev_kind == KVR_DEV_CUDAEMU_STRICT || o->dev_kind == KVR_DEV_CUDA) && !o->host_step && !o->kv_format &&
					o->pool_layout == KVR_POOL_HND && !o->ram_pages;
		const int blocking_on_device = o->mode == KVR_MODE_BLOCKING && device_plan;
		if ((o->mode != KVR_MODE_BLOCKING || o->recall == KVR_RECALL_STREAMED) && !blocking_on_device)
			cr_assert_gt(atomic_load(&hook_calls[KVR_HOOK_CONTROLLER_JOB]), 0, "%s", what);
		cr_assert_gt(atomic_load(&hook_calls[KVR_HOOK_COMPUTE]), 0, "%s", what);
		if (o->recall == KVR_RECALL_STREAMED && !blocking_on_device) {
			cr_assert_gt(atomic_load(&hook_calls[KVR_HOOK_COPY]), 0, "%s", what);
			if (!o->kv_format) /* quantised pages are copied, not converted */
				cr_assert_gt(atomic_load(&hook_calls[KVR_HOOK_CONVERT]), 0, "%s", what);
		}
	}
	/* the last step's controller jobs counted too: statistics that do not
	 * depend on when they are read */
	for (uint32_t s = 0; s < ns; s++)
		kvr_sched_seq_quiesce(ctx->sched, t[s].id);
	ck->stats = ctx_stats(ctx);
	kvr_units_rounds(ctx->sched, &ck->alloc_rounds, &ck->free_rounds);
	struct kvr_pool_stats ps;
	kvr_pool_get_stats(ctx->pool, &ps);
	ck->pool_evictions = ps.evictions;
	ctx_close(ctx, o);
	for (uint32_t s = 0; s < ns; s++)
		tseq_fini(&t[s]);
}

/* The first output that differs between two runs of the same shape. */
static void first_difference(const struct drift *a, const struct drift *b, const char *what)
{
	const size_t n = drift_floats(a), per_step = (size_t)a->n_seqs * NL * Q_ROW;
	for (size_t i = 0; i < n; i++)
		if (memcmp(&a->outs[i], &b->outs[i], sizeof(float))) {
			const size_t r = i % per_step;
			cr_assert_fail("%s: step %zu sequence %zu layer %zu element %zu: %a vs %a", what,
				       i / per_step, r / (NL * Q_ROW), r / Q_ROW % NL, r % Q_ROW,
				       (double)a->outs[i], (double)b->outs[i]);
		}
}

/* A test running fn(dev_kind, n_seqs, n_steps): one per device kind. */
#define ON_DEVICE(test, fn, dev_kind, n_seqs, n_steps, timeout_s)                               \
	Test(scheduler, test, .timeout = timeout_s)                                             \
	{                                                                                       \
		fn(dev_kind, n_seqs, n_steps);                                                  \
	}

/*
 * Tests 1 and 2 on one device: per mode (speculative, freekv, blocking) and
 * recall kind (zero-copy, streamed), a run without hooks and one with random
 * delays at every hook site plus asynchronous compute give the same output
 * bits; streamed gives the same bits as zero-copy. Every run is also checked
 * against the model. cudaemu runs its CUDA kernel bodies in fibers, ~100x
 * slower than the cpu kernels: one sequence and a few steps there.
 */
static void ordering_on(uint32_t dev_kind, uint32_t n_seqs, uint32_t n_steps)
{
	static const uint32_t modes[] = { KVR_MODE_SPECULATIVE, KVR_MODE_FREEKV, KVR_MODE_BLOCKING };
	static const uint32_t recalls[] = { KVR_RECALL_ZERO_COPY, KVR_RECALL_STREAMED };
	struct drift plain, delayed, zc;
	drift_alloc(&plain, n_seqs, n_steps);
	drift_alloc(&delayed, n_seqs, n_steps);
	drift_alloc(&zc, n_seqs, n_steps);
	uint32_t corrections = 0;
	for (int mi = 0; mi < 3; mi++) {
		/* f32 and f16 alternate over the modes */
		const uint32_t dtype = (mi + (dev_kind != KVR_DEV_CPU)) % 2 ? KVR_DTYPE_F16 : KVR_DTYPE_F32;
		for (int ri = 0; ri < 2; ri++) {
			struct opts o = opts_default(dev_kind, modes[mi], recalls[ri], dtype);
			o.chunk_pages = 3; /* heads' misses split into chunks: both buffers in use */
			struct check ck;
			run_drift(&o, &plain, &ck);
			cr_assert_geq(ck.compared, n_steps, "the model compared too few outputs");
			if (modes[mi] == KVR_MODE_FREEKV)
				corrections += ck.corrected_heads;
			o.hooks = 1;
			run_drift(&o, &delayed, &ck);
			char what[128];
			snprintf(what, sizeof(what), "%s %s %s: the delayed run differs", dev_name(dev_kind),
				 kvr_mode_name(o.mode), kvr_recall_name(o.recall));
			first_difference(&plain, &delayed, what);
			if (ri == 0) {
				memcpy(zc.outs, plain.outs, drift_floats(&zc) * sizeof(float));
			} else {
				snprintf(what, sizeof(what), "%s %s: streamed differs from zero-copy",
					 dev_name(dev_kind), kvr_mode_name(o.mode));
				first_difference(&zc, &plain, what);
			}
		}
	}
	cr_expect_gt(corrections, 0, "the drifting queries never made freekv correct a head");
	free(plain.outs), free(delayed.outs), free(zc.outs);
}

ON_DEVICE(ordering_under_random_delays_cpu, ordering_on, KVR_DEV_CPU, 2, 40, 120)
ON_DEVICE(ordering_under_random_delays_cudaemu, ordering_on, KVR_DEV_CUDAEMU, 1, 6, 240)

/* The same on a device whose memory the host cannot address (the cuda
 * backend's situation): every kernel's items and buffers, and every copy's
 * direction, are checked by cudaemu-strict; any host pointer handed to a
 * kernel fails the launch. */
ON_DEVICE(ordering_under_random_delays_cudaemu_strict, ordering_on, KVR_DEV_CUDAEMU_STRICT, 1, 6,
	  240)

/* The cuda backend on a GPU: skipped, with the reason, without one (CI has
 * none); on a GPU the same checks as cudaemu-strict run on real streams. */
static void cuda_or_skip(void)
{
	const struct kvr_dev_params params = { .kind = KVR_DEV_CUDA };
	struct kvr_dev *dev = NULL;
	char err[256] = "";
	const int r = kvr_dev_create(&params, &dev, err, sizeof(err));
	if (r == -ENODEV)
		cr_skip_test("cuda: no GPU: %s", err);
	cr_assert_eq(r, 0, "cuda: kvr_dev_create: %d: %s", r, err);
	kvr_dev_destroy(dev);
}

Test(scheduler, ordering_under_random_delays_cuda, .timeout = 240)
{
	cuda_or_skip();
	ordering_on(KVR_DEV_CUDA, 2, 24);
}

/* Test 2 beyond the default settings: one staging buffer, one page per chunk,
 * and the NHD pool layout (row-by-row copies): streamed still equals zero-copy
 * bit for bit. */
Test(scheduler, streamed_equals_zero_copy_variants, .timeout = 120)
{
	struct drift zc, st;
	drift_alloc(&zc, 2, 24);
	drift_alloc(&st, 2, 24);
	struct check ck;
	for (uint32_t layout = KVR_POOL_HND; layout <= KVR_POOL_NHD; layout++) {
		struct opts o = opts_default(KVR_DEV_CPU, KVR_MODE_FREEKV, KVR_RECALL_ZERO_COPY,
					     KVR_DTYPE_F16);
		o.pool_layout = layout;
		run_drift(&o, &zc, &ck);
		o.recall = KVR_RECALL_STREAMED;
		o.chunk_pages = 1;
		o.buffers = layout == KVR_POOL_HND ? 1 : 2;
		run_drift(&o, &st, &ck);
		first_difference(&zc, &st,
				 layout == KVR_POOL_HND ? "streamed (1 buffer, 1-page chunks)"
							: "streamed (NHD pool)");
	}
	free(zc.outs), free(st.outs);
}

/*
 * Quantised pages (K8V4, K4V2) through the whole step: every output within
 * the tolerance of the model attending over the quantised tokens of the
 * pages it selected with the raw keys' summaries; streamed recall (pages
 * copied quantised into the device slots, random delays at every hook
 * site) equal to zero-copy bit for bit; and the pages really are smaller.
 */
static void quantised_on(uint32_t dev_kind, uint32_t n_seqs, uint32_t n_steps)
{
	static const uint32_t formats[] = { KVR_KV_FORMAT_K8V4, KVR_KV_FORMAT_K4V2 };
	struct drift zc, st;
	drift_alloc(&zc, n_seqs, n_steps);
	drift_alloc(&st, n_seqs, n_steps);
	for (uint32_t fi = 0; fi < 2; fi++) {
		struct check ck;
		struct opts o = opts_default(dev_kind, KVR_MODE_FREEKV, KVR_RECALL_ZERO_COPY,
					     fi ? KVR_DTYPE_F32 : KVR_DTYPE_F16);
		o.kv_format = formats[fi];
		run_drift(&o, &zc, &ck);
		cr_assert_geq(ck.compared, n_steps, "the model compared too few outputs");
		o.recall = KVR_RECALL_STREAMED;
		o.chunk_pages = 3;
		o.hooks = 1;
		run_drift(&o, &st, &ck);
		char what[96];
		snprintf(what, sizeof(what), "%s %s: streamed differs from zero-copy", dev_name(dev_kind),
			 kvr_kv_format_name(o.kv_format));
		first_difference(&zc, &st, what);
		/* one allocation round per sequence, when it turns sparse, for
		 * all its layers and heads (LeanKV: once per step), never one per
		 * layer or per recall */
		cr_assert_eq(ck.alloc_rounds, n_seqs, "%s %s: %llu allocation rounds for %u sequences x %u layers",
			     dev_name(dev_kind), kvr_kv_format_name(o.kv_format),
			     (unsigned long long)ck.alloc_rounds, n_seqs, NL);
		/* the device cache holds quantised runs and needs no staging: its
		 * fixed bytes are the units' ring, an id for every unit any
		 * sequence may hold, and the ring's counters and item */
		struct kvr_config c;
		uint64_t fixed = 1, per_q = 0, per_plain = 0;
		config_of(&o, &c);
		cr_assert_eq(kvr_device_bytes_needed(&c, &fixed, &per_q), 0);
		uint64_t sparse_layers = 0;
		for (uint32_t l = 0; l < c.n_layers; l++)
			sparse_layers += !(c.dense_layers[l / 64] >> (l % 64) & 1);
		const uint64_t k = (c.budget_tokens - c.sink_tokens - c.window_tokens) / c.page_tokens;
		const uint64_t ring = sparse_layers * c.n_kv_heads * k * c.max_sequences * 4 + 16 +
				      sizeof(struct kvr_freelist_item);
		c.kv_format = KVR_KV_FORMAT_PLAIN;
		cr_assert_eq(kvr_device_bytes_needed(&c, NULL, &per_plain), 0);
		cr_assert_eq(fixed, ring, "%s: fixed bytes %llu for quantised pages, the ring is %llu", what,
			     (unsigned long long)fixed, (unsigned long long)ring);
		cr_assert_lt(per_q, per_plain, "%s: per-sequence device bytes %llu, plain %llu", what,
			     (unsigned long long)per_q, (unsigned long long)per_plain);
	}
	free(zc.outs), free(st.outs);
}

/*
 * Mixed pages: every page starts K8V4; pages that got less than the median
 * share of attention during their window residence become K4V2 in place
 * before any selection can name them. Streamed recall (a K4V2 page moving
 * only its own bytes into one unit, a K8V4 page as two halves into two)
 * equals zero-copy (which reads selected K8V4 pages as the same halves) bit
 * for bit under random delays, some pages were judged and some of those
 * demoted, demoted pages moved fewer bytes, and the slots hold fewer units
 * than all-K8V4 pages would.
 */
static void mixed_on(uint32_t dev_kind, uint32_t n_seqs, uint32_t n_steps)
{
	struct drift zc, st;
	drift_alloc(&zc, n_seqs, n_steps);
	drift_alloc(&st, n_seqs, n_steps);
	struct check ck;
	struct opts o = opts_default(dev_kind, KVR_MODE_FREEKV, KVR_RECALL_ZERO_COPY, KVR_DTYPE_F16);
	o.kv_format = KVR_KV_FORMAT_MIXED;
	run_drift(&o, &zc, &ck);
	const struct kvr_stats zs = ck.stats;
	cr_assert_gt(zs.pages_judged, 0, "%s: no page was judged", dev_name(dev_kind));
	cr_assert_gt(zs.pages_demoted, 0, "%s: %llu pages judged, none demoted", dev_name(dev_kind),
		     (unsigned long long)zs.pages_judged);
	cr_assert_lt(zs.pages_demoted, zs.pages_judged, "%s: every judged page was demoted",
		     dev_name(dev_kind));
	o.recall = KVR_RECALL_STREAMED;
	o.chunk_pages = 3;
	o.hooks = 1;
	run_drift(&o, &st, &ck);
	first_difference(&zc, &st, "mixed pages: streamed differs from zero-copy");
	cr_assert_eq(ck.stats.pages_demoted, zs.pages_demoted, "the delays changed the demotions");
	struct kvr_quant_geometry g8;
	kvr_quant_geometry_init(&g8, P, D, 1, KVR_KV_K8V4);
	cr_assert_lt(ck.stats.bytes_recalled, ck.stats.pages_recalled * g8.head_bytes,
		     "no recalled page moved fewer bytes than a K8V4 run");
	/* the device page cache: a K8V4 page in two K4V2-sized units (its
	 * halves), a K4V2 page in one, so the slots hold fewer units than if
	 * every page were K8V4 */
	const uint64_t all_k8v4 = (uint64_t)n_seqs * NL * N_KV * K_SEL * 2;
	cr_assert_gt(ck.stats.device_units_used, all_k8v4 / 2, "%s: %llu units in use", dev_name(dev_kind),
		     (unsigned long long)ck.stats.device_units_used);
	cr_assert_lt(ck.stats.device_units_used, all_k8v4,
		     "%s: %llu units in use, as many as if every selected page were K8V4", dev_name(dev_kind),
		     (unsigned long long)ck.stats.device_units_used);
	/* rounds (LeanKV: once per step): demoted halves go back at the step's
	 * end (test_units.c checks a release runs none); allocations beyond
	 * the sequences' first are halves their lane's spares did not cover */
	cr_log_info("%s: mixed pages, %u sequences x %u steps x %u layers: %llu allocation rounds, %llu free "
		    "rounds",
		    dev_name(dev_kind), n_seqs, n_steps, NL, (unsigned long long)ck.alloc_rounds,
		    (unsigned long long)ck.free_rounds);
	free(zc.outs), free(st.outs);
}

ON_DEVICE(mixed_pages_cpu, mixed_on, KVR_DEV_CPU, 2, 200, 120)
ON_DEVICE(mixed_pages_cudaemu_strict, mixed_on, KVR_DEV_CUDAEMU_STRICT, 1, 120, 300)
ON_DEVICE(quantised_pages_cpu, quantised_on, KVR_DEV_CPU, 2, 40, 120)
ON_DEVICE(quantised_pages_cudaemu_strict, quantised_on, KVR_DEV_CUDAEMU_STRICT, 1, 6, 240)

Test(scheduler, quantised_pages_cuda, .timeout = 240)
{
	cuda_or_skip();
	quantised_on(KVR_DEV_CUDA, 2, 24);
}

/*
 * Quantised pages' device page cache is one set of units shared by every
 * sequence (scheduler/units.c). A sequence attended densely (L <= B) holds no
 * unit and costs the cache nothing; once sparse, exactly k per KV head per
 * sparse layer. The cache grows a sequence's worth when a recall finds too
 * few free units, and reuses the units of closed sequences without growing. A sequence whose
 * units held another sequence's pages computes exactly what it computes
 * alone in a fresh context.
 */
static void seq_units(struct kvr_context *ctx, uint32_t seq, uint64_t *reserved, uint64_t *used)
{
	struct kvr_stats st = { .size = sizeof(st) };
	cr_assert_eq(kvr_seq_get_stats(ctx, seq, &st), 0, "%s", kvr_last_error(ctx));
	*reserved = st.device_units, *used = st.device_units_used;
}

static void ctx_units(struct kvr_context *ctx, uint64_t *held, uint64_t *used)
{
	struct kvr_stats st = { .size = sizeof(st) };
	cr_assert_eq(kvr_get_stats(ctx, &st), 0);
	*held = st.device_units, *used = st.device_units_used;
}

static void run_steps(struct kvr_context *ctx, const struct opts *o, struct tseq *t, uint64_t qseed,
		      uint32_t n, float (*outs)[NL][Q_ROW])
{
	struct qgen qg;
	qgen_init(&qg, qseed);
	for (uint32_t i = 0; i < n; i++) {
		float q[NL][Q_ROW];
		qgen_next(&qg, o->dtype, q);
		step_one(ctx, o->dtype, t, (const float(*)[Q_ROW])q, outs[i]);
	}
}

static void units_shared_on(uint32_t dev_kind)
{
	enum { STEPS = 4 };
	const uint64_t per_seq = (uint64_t)NL * N_KV * K_SEL;
	struct opts o = opts_default(dev_kind, KVR_MODE_FREEKV, KVR_RECALL_STREAMED, KVR_DTYPE_F16);
	o.kv_format = KVR_KV_FORMAT_K8V4;
	o.max_seqs = MAXB; /* room for more sequences than the test opens */
	static float outs[STEPS][NL][Q_ROW], alone[STEPS][NL][Q_ROW];
	uint64_t held, used, reserved, seq_used;

	struct kvr_context *ctx = ctx_open(&o);
	ctx_units(ctx, &held, &used);
	cr_assert_eq(held, 0, "an empty context holds %llu units", (unsigned long long)held);
	struct tseq a, b, c;
	tseq_init(&a, 11), tseq_init(&b, 12), tseq_init(&c, 13);
	tseq_prefill(ctx, o.dtype, &a, BUDGET - 2 * P); /* dense: L <= B */
	run_steps(ctx, &o, &a, 1, STEPS, outs);
	seq_units(ctx, a.id, &reserved, &seq_used);
	cr_assert_eq(reserved, per_seq);
	cr_assert_eq(seq_used, 0, "a sequence attended densely holds %llu units", (unsigned long long)seq_used);
	ctx_units(ctx, &held, &used);
	cr_assert(held == 0 && used == 0, "a dense sequence grew the cache: held %llu used %llu",
		  (unsigned long long)held, (unsigned long long)used);

	tseq_prefill(ctx, o.dtype, &b, 400); /* sparse from its first step */
	run_steps(ctx, &o, &b, 2, STEPS, outs);
	seq_units(ctx, b.id, &reserved, &seq_used);
	cr_assert_eq(seq_used, per_seq, "a sparse sequence holds %llu units, not k per KV head per layer (%llu)",
		     (unsigned long long)seq_used, (unsigned long long)per_seq);
	ctx_units(ctx, &held, &used);
	cr_assert(held == per_seq && used == per_seq, "one sparse sequence: held %llu used %llu",
		  (unsigned long long)held, (unsigned long long)used);
	uint64_t alloc_rounds, free_rounds;
	kvr_units_rounds(ctx->sched, &alloc_rounds, &free_rounds);
	cr_assert(alloc_rounds == 1 && free_rounds == 1,
		  "one sequence turned sparse over %u layers: %llu allocation rounds (not one), %llu free "
		  "rounds (not the chunk's one)",
		  NL, (unsigned long long)alloc_rounds, (unsigned long long)free_rounds);

	/* b's units go back; c takes them (a fresh chunk is not needed) */
	cr_assert_eq(kvr_seq_free(ctx, b.id), 0);
	ctx_units(ctx, &held, &used);
	cr_assert(held == per_seq && used == 0, "after a close: held %llu used %llu",
		  (unsigned long long)held, (unsigned long long)used);
	tseq_prefill(ctx, o.dtype, &c, 400);
	run_steps(ctx, &o, &c, 3, STEPS, outs);
	ctx_units(ctx, &held, &used);
	cr_assert(held == per_seq && used == per_seq, "reuse grew the cache: held %llu used %llu",
		  (unsigned long long)held, (unsigned long long)used);
	/* a second sparse sequence at the same time: one more chunk */
	struct tseq d;
	tseq_init(&d, 14);
	tseq_prefill(ctx, o.dtype, &d, 300);
	run_steps(ctx, &o, &d, 4, STEPS, alone); /* alone is overwritten below */
	ctx_units(ctx, &held, &used);
	cr_assert(held == 2 * per_seq && used == 2 * per_seq, "two sparse sequences: held %llu used %llu",
		  (unsigned long long)held, (unsigned long long)used);
	ctx_close(ctx, &o);
	tseq_fini(&d);

	/* c alone, in a context that never held another sequence's pages */
	struct tseq c2;
	tseq_init(&c2, 13);
	ctx = ctx_open(&o);
	tseq_prefill(ctx, o.dtype, &c2, 400);
	run_steps(ctx, &o, &c2, 3, STEPS, alone);
	ctx_close(ctx, &o);
	cr_assert_eq(memcmp(outs, alone, sizeof(outs)), 0,
		     "%s: a sequence in reused units differs from the same sequence alone", dev_name(dev_kind));
	tseq_fini(&a), tseq_fini(&b), tseq_fini(&c), tseq_fini(&c2);
}

Test(scheduler, quantised_units_shared_cpu, .timeout = 120)
{
	units_shared_on(KVR_DEV_CPU);
}

Test(scheduler, quantised_units_shared_cudaemu_strict, .timeout = 240)
{
	units_shared_on(KVR_DEV_CUDAEMU_STRICT);
}

/* The controller's jobs run inline on the engine's thread (the cpu default
 * when the engine's kernels fill every core): outputs bit-identical to the
 * controller thread's, in every sparse mode and both recall kinds, with
 * random delays at every hook site. */
Test(scheduler, inline_controller_equals_thread, .timeout = 120)
{
	static const uint32_t modes[] = { KVR_MODE_SPECULATIVE, KVR_MODE_FREEKV, KVR_MODE_BLOCKING };
	for (uint32_t placement = KVR_CONTROLLER_THREAD; placement <= KVR_CONTROLLER_INLINE; placement++) {
		struct opts o = opts_default(KVR_DEV_CPU, KVR_MODE_FREEKV, KVR_RECALL_ZERO_COPY, KVR_DTYPE_F16);
		o.controller = placement;
		struct kvr_context *ctx = ctx_open(&o);
		cr_assert_eq(kvr_sched_jobs_inline(ctx->sched), placement == KVR_CONTROLLER_INLINE);
		ctx_close(ctx, &o);
	}
	struct drift thread, inl;
	drift_alloc(&thread, 2, 24);
	drift_alloc(&inl, 2, 24);
	struct check ck;
	for (int mi = 0; mi < 3; mi++)
		for (uint32_t recall = KVR_RECALL_ZERO_COPY; recall <= KVR_RECALL_STREAMED; recall++) {
			struct opts o = opts_default(KVR_DEV_CPU, modes[mi], recall, KVR_DTYPE_F16);
			o.chunk_pages = 3;
			run_drift(&o, &thread, &ck);
			o.controller = KVR_CONTROLLER_INLINE;
			o.hooks = mi == 1;
			run_drift(&o, &inl, &ck);
			char what[128];
			snprintf(what, sizeof(what), "%s %s: inline differs from the thread",
				 kvr_mode_name(o.mode), kvr_recall_name(recall));
			first_difference(&thread, &inl, what);
		}
	free(thread.outs), free(inl.outs);
}

/* ------------------------------------------------------------------ model checks */

/* Tests 4 and 5: the output of every step equals the model's prediction,
 * and the model's alternative (the other selection) is measurably different,
 * so that the comparison could fail. */
static void model_run(uint32_t dev_kind, uint32_t mode, uint32_t recall, uint32_t n_seqs,
		      uint32_t n_steps, struct check *ck)
{
	struct opts o = opts_default(dev_kind, mode, recall, KVR_DTYPE_F32);
	struct drift r;
	drift_alloc(&r, n_seqs, n_steps);
	run_drift(&o, &r, ck);
	free(r.outs);
	cr_assert_gt(ck->compared, n_seqs * NL * n_steps * N_KV * 3 / 4, "%u compared, %u ambiguous",
		     ck->compared, ck->ambiguous);
	cr_assert_lt(ck->max_err, 1e-4);
	cr_assert_gt(ck->alt_diff, 1e-2,
		     "%s: selecting with the other query would have given the same outputs: the "
		     "test cannot tell them apart",
		     kvr_mode_name(mode));
}

Test(scheduler, speculative_uses_previous_steps_pages, .timeout = 120)
{
	for (uint32_t recall = KVR_RECALL_ZERO_COPY; recall <= KVR_RECALL_STREAMED; recall++) {
		struct check ck;
		model_run(KVR_DEV_CPU, KVR_MODE_SPECULATIVE, recall, 2, 40, &ck);
		cr_expect_eq(ck.correction_waits, 2 * NL, "only the first step selects with its own query");
	}
	struct check ck;
	model_run(KVR_DEV_CUDAEMU, KVR_MODE_SPECULATIVE, KVR_RECALL_STREAMED, 1, 8, &ck);
	model_run(KVR_DEV_CUDAEMU_STRICT, KVR_MODE_SPECULATIVE, KVR_RECALL_STREAMED, 1, 8, &ck);
	model_run(KVR_DEV_CUDAEMU_STRICT, KVR_MODE_SPECULATIVE, KVR_RECALL_ZERO_COPY, 1, 8, &ck);
}

Test(scheduler, speculative_uses_previous_steps_pages_cuda, .timeout = 120)
{
	cuda_or_skip();
	for (uint32_t recall = KVR_RECALL_ZERO_COPY; recall <= KVR_RECALL_STREAMED; recall++) {
		struct check ck;
		model_run(KVR_DEV_CUDA, KVR_MODE_SPECULATIVE, recall, 2, 24, &ck);
		cr_expect_eq(ck.correction_waits, 2 * NL, "only the first step selects with its own query");
	}
}

/*
 * The invariant of every decode step (docs/design.md, "The decode step"):
 * attended = sink ∪ window(i) ∪ selected, every page outside sink and
 * window(i) a candidate of the selection serving step i. model_step asserts it
 * (and the outputs match the model); these runs make sure windows cross pages
 * right after corrected steps as well as uncorrected ones, in every mode and
 * recall kind, with a window of two pages and with none (W = 0: the page a
 * token completes is the window's at that step).
 */
Test(scheduler, attended_set_invariant_across_window_moves, .timeout = 240)
{
	static const uint32_t modes[] = { KVR_MODE_SPECULATIVE, KVR_MODE_FREEKV, KVR_MODE_BLOCKING };
	static const uint32_t wins[] = { 32, 0 };
	for (uint32_t wi = 0; wi < 2; wi++)
		for (uint32_t mi = 0; mi < 3; mi++)
			for (uint32_t recall = KVR_RECALL_ZERO_COPY; recall <= KVR_RECALL_STREAMED; recall++) {
				model_win = wins[wi];
				struct check ck;
				model_run(KVR_DEV_CPU, modes[mi], recall, 2, 40, &ck);
				cr_assert_gt(ck.crossings, 4, "W %u %s: the window moved %u times", model_win,
					     kvr_mode_name(modes[mi]), ck.crossings);
				if (modes[mi] != KVR_MODE_SPECULATIVE)
					cr_assert_gt(ck.crossings_after_correction, 0,
						     "W %u %s: no window move right after a corrected step",
						     model_win, kvr_mode_name(modes[mi]));
			}
	model_win = 32;
	struct check ck;
	model_run(KVR_DEV_CUDAEMU_STRICT, KVR_MODE_FREEKV, KVR_RECALL_STREAMED, 1, 8, &ck);
}

/*
 * A budget of 32768 tokens (S = W = 512, p = 32: k = 992 pages per KV head)
 * over a 34K-token context: streamed recall attends every selected page, as
 * zero-copy does, bit for bit — it used to stop at 512 slots per head. The
 * outputs also differ from attention over sink + window alone, so a dropped
 * page would show.
 */
static void big_budget_run_as(uint32_t mode, uint32_t estimate, uint32_t recall, uint32_t budget, float *outs,
			      uint32_t n_steps)
{
	enum { BP = 32, BD = 32, BKV = 1, BQO = 2, BN = 34 * 1024 };
	struct kvr_config c;
	th_config(&c, 1, BQO, BKV, BD, KVR_DTYPE_F32, BP, 512, 512, budget);
	c.mode = mode;
	c.estimate = estimate;
	c.recall = recall;
	th_config_sparse(&c, 1);
	c.backend = KVR_BACKEND_CPU;
	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(&c, &ctx), 0, "%s", kvr_last_error(NULL));
	uint32_t seq;
	cr_assert_eq(kvr_seq_create(ctx, &seq), 0, "%s", kvr_last_error(ctx));
	float *k = malloc((size_t)BN * BKV * BD * sizeof(float));
	float *v = malloc((size_t)BN * BKV * BD * sizeof(float));
	cr_assert(k && v);
	struct rng r = { 4242 };
	for (size_t i = 0; i < (size_t)BN * BKV * BD; i++)
		k[i] = rnd(&r), v[i] = rnd(&r);
	cr_assert_eq(kvr_prefill(ctx, seq, 0, 0, BN - 8, k, v), 0, "%s", kvr_last_error(ctx));
	float q[BQO * BD];
	for (uint32_t i = 0; i < n_steps; i++) {
		const uint64_t pos = BN - 8 + i;
		for (uint32_t x = 0; x < BQO * BD; x++)
			q[x] = 4.0f * rnd(&r);
		int32_t status = -1;
		cr_assert_eq(kvr_decode_begin(ctx, &seq, &pos, 1), 0, "%s", kvr_last_error(ctx));
		cr_assert_eq(kvr_decode_layer(ctx, 0, q, k + pos * BKV * BD, v + pos * BKV * BD,
					      outs + (size_t)i * BQO * BD, &status, NULL),
			     0, "%s", kvr_last_error(ctx));
		cr_assert_eq(status, 0, "%s", kvr_last_error(ctx));
		cr_assert_eq(kvr_decode_end(ctx), 0, "%s", kvr_last_error(ctx));
	}
	free(k), free(v);
	kvr_context_destroy(ctx);
}

static void big_budget_run(uint32_t recall, uint32_t budget, float *outs, uint32_t n_steps)
{
	big_budget_run_as(KVR_MODE_FREEKV, 0, recall, budget, outs, n_steps);
}

Test(scheduler, streamed_equals_zero_copy_at_budget_32768, .timeout = 240)
{
	enum { STEPS = 4, ROW = 64 };
	static float zc[STEPS * ROW], st[STEPS * ROW], small[STEPS * ROW];
	big_budget_run(KVR_RECALL_ZERO_COPY, 32768, zc, STEPS);
	big_budget_run(KVR_RECALL_STREAMED, 32768, st, STEPS);
	for (uint32_t i = 0; i < STEPS * ROW; i++)
		cr_assert(!memcmp(&zc[i], &st[i], sizeof(float)),
			  "step %u element %u: streamed %a, zero-copy %a", i / ROW, i % ROW, (double)st[i],
			  (double)zc[i]);
	/* 992 selected pages matter: sink + window + 511 pages gives other outputs */
	big_budget_run(KVR_RECALL_ZERO_COPY, 512 + 512 + 511 * 32, small, STEPS);
	double diff = 0;
	for (uint32_t i = 0; i < STEPS * ROW; i++)
		diff = fmax(diff, fabs((double)small[i] - zc[i]));
	cr_assert_gt(diff, 1e-5, "the pages past 511 made no difference: the test cannot see a cap");
}

/*
 * The estimate of the pages not retrieved: with a budget holding
 * the whole context there is no unselected candidate, the estimate adds
 * nothing, and freekv with it equals dense without it bit for bit; with a
 * budget of sink + window + 8 pages it changes the outputs (so the equality
 * above could fail).
 */
Test(scheduler, estimate_with_whole_context_budget_equals_dense, .timeout = 240)
{
	enum { STEPS = 3, ROW = 64 };
	static float dense[STEPS * ROW], est[STEPS * ROW], small[STEPS * ROW], small_off[STEPS * ROW];
	big_budget_run_as(KVR_MODE_DENSE, 0, KVR_RECALL_ZERO_COPY, 36 * 1024, dense, STEPS);
	for (uint32_t recall = KVR_RECALL_ZERO_COPY; recall <= KVR_RECALL_STREAMED; recall++) {
		big_budget_run_as(KVR_MODE_FREEKV, 1, recall, 36 * 1024, est, STEPS);
		for (uint32_t i = 0; i < STEPS * ROW; i++)
			cr_assert(!memcmp(&dense[i], &est[i], sizeof(float)),
				  "%s step %u element %u: freekv with the estimate %a, dense %a",
				  kvr_recall_name(recall), i / ROW, i % ROW, (double)est[i], (double)dense[i]);
	}
	big_budget_run_as(KVR_MODE_FREEKV, 1, KVR_RECALL_ZERO_COPY, 512 + 512 + 8 * 32, small, STEPS);
	big_budget_run_as(KVR_MODE_FREEKV, 0, KVR_RECALL_ZERO_COPY, 512 + 512 + 8 * 32, small_off, STEPS);
	double diff = 0;
	for (uint32_t i = 0; i < STEPS * ROW; i++)
		diff = fmax(diff, fabs((double)small[i] - small_off[i]));
	cr_assert_gt(diff, 1e-4, "the estimate of ~1000 unselected pages changed nothing");
}

/*
 * The estimate: in every sparse mode, both recalls, every step's output equals
 * the model's attention over sink + selected pages + window + tail exactly
 * plus each other candidate page as P tokens of its mean key and mean value
 * (ref_attend; the kernels' formula, kernels.h KVR_KV_ESTIMATE), and differs
 * from the same run without the estimate. Quantised pages: the estimate
 * comes from the unquantised rows.
 */
static void estimate_on(uint32_t dev_kind, uint32_t n_seqs, uint32_t n_steps)
{
	static const uint32_t modes[] = { KVR_MODE_BLOCKING, KVR_MODE_SPECULATIVE, KVR_MODE_FREEKV };
	struct drift with, without;
	drift_alloc(&with, n_seqs, n_steps);
	drift_alloc(&without, n_seqs, n_steps);
	for (uint32_t mi = 0; mi < sizeof(modes) / sizeof(modes[0]); mi++)
		for (uint32_t recall = KVR_RECALL_ZERO_COPY; recall <= KVR_RECALL_STREAMED; recall++) {
			struct check ck;
			struct opts o = opts_default(dev_kind, modes[mi], recall, KVR_DTYPE_F32);
			o.estimate = 1;
			run_drift(&o, &with, &ck);
			cr_assert_gt(ck.compared, n_seqs * NL * n_steps * N_KV / 2, "%s: %u compared, %u ambiguous",
				     kvr_mode_name(modes[mi]), ck.compared, ck.ambiguous);
			o.estimate = 0;
			run_drift(&o, &without, &ck);
			double diff = 0;
			for (size_t i = 0; i < drift_floats(&with); i++)
				diff = fmax(diff, fabs((double)with.outs[i] - without.outs[i]));
			cr_assert_gt(diff, 1e-3, "%s %s: the estimate changed no output", dev_name(dev_kind),
				     kvr_mode_name(modes[mi]));
		}
	/* quantised pages, f16 (the means rounded to it) */
	struct check ck;
	struct opts o = opts_default(dev_kind, KVR_MODE_FREEKV, KVR_RECALL_ZERO_COPY, KVR_DTYPE_F16);
	o.kv_format = KVR_KV_FORMAT_K8V4;
	o.estimate = 1;
	run_drift(&o, &with, &ck);
	cr_assert_gt(ck.compared, n_steps, "the model compared too few outputs");
	/* a spill tier: pages in the file, their estimate rows in RAM (the
	 * summaries are never spilled), with random delays */
	o = opts_default(dev_kind, KVR_MODE_FREEKV, KVR_RECALL_STREAMED, KVR_DTYPE_F32);
	o.estimate = 1;
	o.ram_pages = 24ull * n_seqs; /* of ~46 pages per sequence */
	o.hooks = 1;
	run_drift(&o, &with, &ck);
	cr_assert_gt(ck.compared, n_steps, "the model compared too few outputs (spill tier)");
	cr_assert_gt(ck.pool_evictions, 0, "no page left RAM: the case tests no spill tier");
	free(with.outs);
	free(without.outs);
}

ON_DEVICE(estimate_matches_the_model_cpu, estimate_on, KVR_DEV_CPU, 2, 24, 240)
ON_DEVICE(estimate_matches_the_model_cudaemu_strict, estimate_on, KVR_DEV_CUDAEMU_STRICT, 1, 6, 400)

Test(scheduler, blocking_selects_with_current_query, .timeout = 120)
{
	for (uint32_t recall = KVR_RECALL_ZERO_COPY; recall <= KVR_RECALL_STREAMED; recall++) {
		struct check ck;
		model_run(KVR_DEV_CPU, KVR_MODE_BLOCKING, recall, 2, 40, &ck);
		cr_expect_eq(ck.correction_waits, 2 * NL * 40);
	}
}

/* Per-step counter snapshot of one sequence after its controller jobs ran. */
static struct kvr_stats seq_stats(struct kvr_context *ctx, uint32_t seq)
{
	kvr_sched_seq_quiesce(ctx->sched, seq);
	struct kvr_stats st;
	memset(&st, 0, sizeof(st));
	st.size = sizeof(st);
	cr_assert_eq(kvr_seq_get_stats(ctx, seq, &st), 0, "%s", kvr_last_error(ctx));
	return st;
}

static struct kvr_stats ctx_stats(struct kvr_context *ctx)
{
	struct kvr_stats st;
	memset(&st, 0, sizeof(st));
	st.size = sizeof(st);
	cr_assert_eq(kvr_get_stats(ctx, &st), 0);
	return st;
}

/*
 * Test 6: queries built so that each KV head's group-mean cosine with the
 * previous query is a chosen value on either side of tau — including groups
 * where one query head is unchanged and the other moved enough to pull the
 * mean below tau, and the reverse — so corrections must follow the group
 * mean, not a single head.
 */
Test(scheduler, freekv_corrects_exactly_heads_below_tau, .timeout = 120)
{
	for (uint32_t recall = KVR_RECALL_ZERO_COPY; recall <= KVR_RECALL_STREAMED; recall++) {
		struct opts o = opts_default(KVR_DEV_CPU, KVR_MODE_FREEKV, recall, KVR_DTYPE_F32);
		struct kvr_context *ctx = ctx_open(&o);
		struct tseq t;
		tseq_init(&t, 7);
		tseq_prefill(ctx, o.dtype, &t, 333);
		struct rng r = { 99 };
		float q[NL][Q_ROW], out[NL][Q_ROW];
		for (uint32_t i = 0; i < NL * Q_ROW; i++)
			q[i / Q_ROW][i % Q_ROW] = 3.0f * rnd(&r);
		/* per query head: the cosine with its previous query (pairs per group) */
		static const double plans[][N_KV][G] = {
			{ { 1.0, 1.0 }, { -1.0, -1.0 } },  /* head 1 flips */
			{ { 1.0, 0.75 }, { 1.0, 1.0 } },   /* head 0: mean 0.875 < tau */
			{ { 1.0, 0.86 }, { 0.95, 0.95 } }, /* head 0: mean 0.93 > tau though one is below */
			{ { 0.2, 0.3 }, { 0.5, 0.1 } },    /* both */
			{ { 0.92, 0.94 }, { 0.86, 0.88 } }, /* near tau on either side */
			{ { 0.91, 0.90 }, { 0.89, 0.90 } }, /* means 0.905 and 0.895: tau itself */
			{ { 1.0, 1.0 }, { 1.0, 1.0 } },    /* none */
		};
		const uint32_t n_plans = sizeof(plans) / sizeof(plans[0]);
		struct check ck;
		memset(&ck, 0, sizeof(ck));
		uint64_t hc_prev[N_KV] = { 0 };
		struct kvr_stats prev = seq_stats(ctx, t.id);
		for (uint32_t i = 0; i < 3 * n_plans + 1; i++) {
			const double(*plan)[G] = plans[(i + n_plans - 1) % n_plans];
			if (i > 0)
				for (uint32_t l = 0; l < NL; l++)
					for (uint32_t h = 0; h < N_QO; h++) {
						/* q' = cos·q + sin·u, u ⟂ q with |u| = |q| */
						float *x = q[l] + h * D, u[D];
						double dot = 0, nq = 0, nu = 0;
						for (uint32_t c = 0; c < D; c++)
							u[c] = 3.0f * rnd(&r), nq += (double)x[c] * x[c];
						for (uint32_t c = 0; c < D; c++)
							dot += (double)u[c] * x[c];
						for (uint32_t c = 0; c < D; c++)
							u[c] -= (float)(dot / nq) * x[c], nu += (double)u[c] * u[c];
						const double cs = plan[h / G][h % G], sn = sqrt(1 - cs * cs);
						const double su = sqrt(nq / nu);
						for (uint32_t c = 0; c < D; c++)
							x[c] = (float)(cs * x[c] + sn * su * u[c]);
					}
			step_one(ctx, o.dtype, &t, (const float(*)[Q_ROW])q, out);
			struct check before = ck;
			for (uint32_t l = 0; l < NL; l++)
				model_step(&t, l, q[l], out[l], o.mode, o.tau, 1e-4, &ck, "freekv", i);
			struct kvr_stats st = seq_stats(ctx, t.id);
			uint64_t hc[N_KV];
			cr_assert_eq(kvr_get_head_corrections(ctx, t.id, hc, N_KV), 0);
			for (uint32_t m = 0; m < N_KV; m++) {
				const uint64_t want = ck.head_corr[m] - before.head_corr[m];
				cr_assert_eq(hc[m] - hc_prev[m], want,
					     "%s step %u KV head %u: %llu corrections, the group-mean cosine "
					     "says %llu",
					     kvr_recall_name(recall), i, m,
					     (unsigned long long)(hc[m] - hc_prev[m]),
					     (unsigned long long)want);
				hc_prev[m] = hc[m];
			}
			cr_assert_eq(st.corrected_heads - prev.corrected_heads,
				     ck.corrected_heads - before.corrected_heads, "step %u", i);
			cr_assert_eq(st.checked_heads - prev.checked_heads, ck.checked_heads - before.checked_heads,
				     "step %u", i);
			cr_assert_eq(st.correction_waits - prev.correction_waits,
				     ck.correction_waits - before.correction_waits, "step %u", i);
			prev = st;
		}
		/* the plans really did both: corrected and left alone, per head */
		cr_assert_gt(ck.corrected_heads, 0);
		cr_assert_lt(ck.corrected_heads, ck.checked_heads);
		cr_assert_eq(ck.ambiguous, 0, "cosines too close to tau for a clean test");
		struct kvr_stats all = ctx_stats(ctx);
		cr_expect_eq(all.corrected_heads, ck.corrected_heads);
		cr_expect_eq(all.correction_waits, ck.correction_waits);
		uint64_t hc_all[N_KV];
		cr_assert_eq(kvr_get_head_corrections(ctx, UINT32_MAX, hc_all, N_KV), 0);
		for (uint32_t m = 0; m < N_KV; m++)
			cr_expect_eq(hc_all[m], ck.head_corr[m]);
		ctx_close(ctx, &o);
		tseq_fini(&t);
	}
}

/*
 * Test 3: streamed recall, speculative (and freekv): after each step (and its
 * controller job), hits + misses = the selected pages of the step's
 * selection, k per KV head per sparse layer; bytes = misses × one head's run.
 * Then a constant query over tokens whose keys oppose it (so no page leaving
 * the window ever beats a selected one): every page is a hit.
 */
Test(scheduler, recall_moves_only_misses, .timeout = 120)
{
	static const uint32_t modes[] = { KVR_MODE_SPECULATIVE, KVR_MODE_FREEKV };
	for (int mi = 0; mi < 2; mi++) {
		struct opts o = opts_default(KVR_DEV_CPU, modes[mi], KVR_RECALL_STREAMED, KVR_DTYPE_F16);
		struct kvr_context *ctx = ctx_open(&o);
		struct qgen qg;
		qgen_init(&qg, 31);
		float qc[NL][Q_ROW]; /* the constant query: equal heads within a group */
		struct rng r = { 5 };
		for (uint32_t l = 0; l < NL; l++)
			for (uint32_t m = 0; m < N_KV; m++)
				for (uint32_t c = 0; c < D; c++) {
					const float x = 3.0f * rnd(&r);
					for (uint32_t g = 0; g < G; g++)
						qc[l][(m * G + g) * D + c] = x;
				}
		for (uint32_t l = 0; l < NL; l++)
			round_dtype(qc[l], Q_ROW, o.dtype);
		struct tseq t;
		tseq_init(&t, 11);
		t.anti_q = &qc[0][0];
		t.anti_from = 256; /* pages 16.. (those that leave the window in this run) */
		tseq_prefill(ctx, o.dtype, &t, 300);
		struct kvr_stats prev = seq_stats(ctx, t.id);
		uint64_t recalled_drift = 0;
		const uint64_t per_step = (uint64_t)K_SEL * N_KV * NL;
		const uint64_t run_bytes = 2ull * P * D * ebytes(o.dtype);
		struct check ck;
		memset(&ck, 0, sizeof(ck));
		for (uint32_t i = 0; i < 44; i++) {
			float q[NL][Q_ROW], out[NL][Q_ROW];
			const int constant = i >= 16;
			if (constant)
				memcpy(q, qc, sizeof(q));
			else
				qgen_next(&qg, o.dtype, q);
			step_one(ctx, o.dtype, &t, (const float(*)[Q_ROW])q, out);
			for (uint32_t l = 0; l < NL; l++)
				model_step(&t, l, q[l], out[l], o.mode, o.tau, tol_of(o.dtype), &ck, "recall", i);
			const struct kvr_stats st = seq_stats(ctx, t.id);
			const uint64_t rec = st.pages_recalled - prev.pages_recalled;
			const uint64_t hit = st.pages_hit - prev.pages_hit;
			cr_assert_eq(rec + hit, per_step,
				     "%s step %u: %llu recalled + %llu hits, %llu pages selected",
				     kvr_mode_name(o.mode), i, (unsigned long long)rec,
				     (unsigned long long)hit, (unsigned long long)per_step);
			cr_assert_eq(st.bytes_recalled - prev.bytes_recalled, rec * run_bytes, "step %u", i);
			if (i == 0)
				cr_assert_eq(rec, per_step, "the first step recalls every selected page");
			if (!constant)
				recalled_drift += rec;
			if (i >= 18)
				cr_assert_eq(rec, 0, "%s step %u: the query did not change, yet %llu pages moved",
					     kvr_mode_name(o.mode), i, (unsigned long long)rec);
			prev = st;
		}
		cr_assert_gt(recalled_drift, per_step, "the drifting queries recalled nothing after step 0");
		cr_assert_lt(recalled_drift, 16 * per_step, "hits were recalled again");
		const struct kvr_stats all = ctx_stats(ctx);
		cr_expect_eq(all.pages_recalled, prev.pages_recalled);
		cr_expect_eq(all.pages_hit, prev.pages_hit);
		cr_expect_eq(all.bytes_recalled, prev.bytes_recalled);
		ctx_close(ctx, &o);
		tseq_fini(&t);
	}
}

/*
 * Test 7: the page that leaves the window at step i is a candidate of the
 * selection made at step i−1 for step i. Page 16 (tokens 256..271) gets keys
 * aligned with the queries, far above every other page; with 300 tokens
 * prefilled it leaves the window at step 3 (the token at position 303
 * completes page 18). Speculative mode must attend to it at step 3.
 */
Test(scheduler, page_leaving_window_is_candidate, .timeout = 60)
{
	for (uint32_t recall = KVR_RECALL_ZERO_COPY; recall <= KVR_RECALL_STREAMED; recall++) {
		struct opts o = opts_default(KVR_DEV_CPU, KVR_MODE_SPECULATIVE, recall, KVR_DTYPE_F32);
		struct kvr_context *ctx = ctx_open(&o);
		float q[NL][Q_ROW], out[NL][Q_ROW];
		struct rng r = { 17 };
		for (uint32_t l = 0; l < NL; l++)
			for (uint32_t i = 0; i < Q_ROW; i++)
				q[l][i] = 2.0f * rnd(&r);
		struct tseq t;
		tseq_init(&t, 23);
		for (uint32_t l = 0; l < NL; l++)
			for (uint64_t pos = 0; pos < 300; pos++) {
				float *k = t.k[l] + pos * KV_ROW, *v = t.v[l] + pos * KV_ROW;
				token_kv(&t, l, pos, k, v);
				if (pos / P == 16) /* keys along the group's first query, large */
					for (uint32_t m = 0; m < N_KV; m++)
						for (uint32_t c = 0; c < D; c++)
							k[m * D + c] = q[l][m * G * D + c] >= 0 ? 4.0f : -4.0f;
			}
		t.n = 300;
		tseq_ingest(ctx, o.dtype, &t);
		struct check ck;
		memset(&ck, 0, sizeof(ck));
		for (uint32_t i = 0; i < 5; i++) {
			step_one(ctx, o.dtype, &t, (const float(*)[Q_ROW])q, out);
			for (uint32_t l = 0; l < NL; l++) {
				model_step(&t, l, q[l], out[l], o.mode, o.tau, 1e-4, &ck, "leaving", i);
				for (uint32_t m = 0; m < N_KV; m++) {
					int has16 = 0;
					for (uint32_t j = 0; j < K_SEL; j++)
						has16 |= ck.last_sel[l][m][j] == 16;
					if (i == 3)
						cr_assert(has16, "the model does not pick page 16 at step 3 (test bug)");
					if (i < 3)
						cr_assert(t.n / P < 19, "test bug: page 16 left too early");
				}
				if (i == 3) {
					/* without page 16 the output would be far off */
					double want[G * D];
					const int32_t none[K_SEL] = { -1, -1, -1, -1 };
					ref_attend(&t, l, t.n, q[l], 0, 0, none, want);
					cr_assert_gt(max_diff(out[l], want, G * D), 0.05,
						     "page 16 barely matters (test bug)");
				}
			}
		}
		cr_assert_eq(ck.ambiguous, 0);
		ctx_close(ctx, &o);
		tseq_fini(&t);
	}
}

/* ------------------------------------------------------------------ batches */

/* Decode `nb` sequences (given initial lengths and generators) together for
 * n_steps in ctx; outputs to outs[step][i][layer]. Queries from qgen seeded
 * by the generator, so a sequence gets the same queries alone or batched. */
static void batch_run(const struct opts *o, const uint64_t *n0, const uint64_t *gens, uint32_t nb,
		      uint32_t n_steps, float (*outs)[MAXB][NL][Q_ROW])
{
	struct kvr_context *ctx = ctx_open(o);
	struct tseq t[MAXB], *tp[MAXB];
	struct qgen qg[MAXB];
	struct check ck;
	memset(&ck, 0, sizeof(ck));
	for (uint32_t i = 0; i < nb; i++) {
		tseq_init(&t[i], gens[i]);
		tseq_prefill(ctx, o->dtype, &t[i], n0[i]);
		qgen_init(&qg[i], gens[i] * 31);
		tp[i] = &t[i];
	}
	for (uint32_t s = 0; s < n_steps; s++) {
		float q[MAXB][NL][Q_ROW];
		int32_t status[MAXB][NL];
		for (uint32_t i = 0; i < nb; i++)
			qgen_next(&qg[i], o->dtype, q[i]);
		step_batch(ctx, o->dtype, tp, nb, (const float(*)[NL][Q_ROW])q, outs[s], status);
		for (uint32_t i = 0; i < nb; i++)
			for (uint32_t l = 0; l < NL; l++) {
				cr_assert_eq(status[i][l], 0, "%s", kvr_last_error(ctx));
				model_step(&t[i], l, q[i][l], outs[s][i][l], o->mode, o->tau, tol_of(o->dtype),
					   &ck, "batch", s);
			}
	}
	ctx_close(ctx, o);
	for (uint32_t i = 0; i < nb; i++)
		tseq_fini(&t[i]);
}

/* Test 8a: sequences of different lengths — one dense throughout, one that
 * crosses B during the run, two long ones — in one call; each output equals
 * the sequence decoded alone. */
Test(scheduler, batch_equals_each_sequence_alone, .timeout = 120)
{
	static const uint64_t n0[4] = { 40, 120, 300, 517 }, gens[4] = { 1, 2, 3, 4 };
	enum { STEPS = 24 };
	static float together[STEPS][MAXB][NL][Q_ROW], alone[STEPS][MAXB][NL][Q_ROW];
	for (uint32_t recall = KVR_RECALL_ZERO_COPY; recall <= KVR_RECALL_STREAMED; recall++) {
		struct opts o = opts_default(KVR_DEV_CPU, KVR_MODE_FREEKV, recall, KVR_DTYPE_F32);
		batch_run(&o, n0, gens, 4, STEPS, together);
		for (uint32_t i = 0; i < 4; i++) {
			batch_run(&o, &n0[i], &gens[i], 1, STEPS, alone);
			for (uint32_t s = 0; s < STEPS; s++)
				cr_assert_eq(memcmp(together[s][i], alone[s][0], sizeof(alone[s][0])), 0,
					     "%s: sequence %u (%llu tokens) step %u differs from its "
					     "decode alone",
					     kvr_recall_name(recall), i, (unsigned long long)n0[i], s);
		}
	}
}

/* Both recall kinds on the cpu backend, and streamed recall on cudaemu-strict
 * (the cuda backend's memory rules). */
static const struct {
	uint32_t dev, recall;
} runs_cpu_strict[3] = { { KVR_DEV_CPU, KVR_RECALL_ZERO_COPY },
			 { KVR_DEV_CPU, KVR_RECALL_STREAMED },
			 { KVR_DEV_CUDAEMU_STRICT, KVR_RECALL_STREAMED } };

/*
 * Test 8b: the pool holds exactly the prefilled pages. Sequence F (288
 * tokens: its next token starts a page) cannot reserve one and fails with a
 * negative status and zeros; A (dense), B and C (sparse) have room in their
 * tail pages and decode as if F were not there. After C is freed, F decodes
 * like a fresh sequence.
 */
Test(scheduler, failing_sequence_leaves_others_intact, .timeout = 120)
{
	static const uint64_t n0[4] = { 97, 305, 288, 401 }, gens[4] = { 10, 11, 12, 13 };
	enum { STEPS = 12, F = 2 };
	static float with[STEPS][MAXB][NL][Q_ROW], without[STEPS][MAXB][NL][Q_ROW];
	for (uint32_t ri = 0; ri < 3; ri++) {
		const uint32_t recall = runs_cpu_strict[ri].recall;
		uint64_t pages = 0;
		for (int i = 0; i < 4; i++)
			pages += NL * ((n0[i] + P - 1) / P);
		struct opts o = opts_default(runs_cpu_strict[ri].dev, KVR_MODE_FREEKV, recall, KVR_DTYPE_F32);
		o.pool_pages = pages;
		struct kvr_context *ctx = ctx_open(&o);
		struct tseq t[4], *tp[4];
		struct qgen qg[4];
		struct check ck;
		memset(&ck, 0, sizeof(ck));
		for (uint32_t i = 0; i < 4; i++) {
			tseq_init(&t[i], gens[i]);
			tseq_prefill(ctx, o.dtype, &t[i], n0[i]);
			qgen_init(&qg[i], gens[i] * 31);
			tp[i] = &t[i];
		}
		for (uint32_t s = 0; s < STEPS; s++) {
			float q[4][NL][Q_ROW];
			int32_t status[4][NL];
			for (uint32_t i = 0; i < 4; i++)
				qgen_next(&qg[i], o.dtype, q[i]);
			step_batch(ctx, o.dtype, tp, 4, (const float(*)[NL][Q_ROW])q, with[s], status);
			for (uint32_t i = 0; i < 4; i++)
				for (uint32_t l = 0; l < NL; l++) {
					if (i == F) {
						cr_assert_eq(status[i][l], -ENOMEM, "step %u layer %u: %d", s, l,
							     status[i][l]);
						for (uint32_t j = 0; j < Q_ROW; j++)
							cr_assert_eq(with[s][i][l][j], 0.0f, "failed output not zero");
						continue;
					}
					cr_assert_eq(status[i][l], 0, "%s", kvr_last_error(ctx));
					model_step(&t[i], l, q[i][l], with[s][i][l], o.mode, o.tau, 1e-4, &ck,
						   "with F", s);
				}
		}
		uint64_t len;
		cr_assert_eq(kvr_seq_length(ctx, t[F].id, 0, &len), 0);
		cr_assert_eq(len, n0[F], "the failed tokens were stored");
		struct kvr_stats sf = seq_stats(ctx, t[F].id);
		cr_expect_eq(sf.failed_decodes, STEPS * NL);

		/* the same batch without F, in a context with room */
		o.pool_pages = 0;
		static const uint64_t n3[3] = { 97, 305, 401 }, g3[3] = { 10, 11, 13 };
		batch_run(&o, n3, g3, 3, STEPS, without);
		for (uint32_t s = 0; s < STEPS; s++)
			for (uint32_t i = 0, j = 0; i < 4; i++) {
				if (i == F)
					continue;
				cr_assert_eq(memcmp(with[s][i], without[s][j], sizeof(without[s][j])), 0,
					     "%s: sequence %u step %u changed by the failing one",
					     kvr_recall_name(recall), i, s);
				j++;
			}

		/* free C: F gets pages and decodes like a fresh sequence */
		cr_assert_eq(kvr_seq_free(ctx, t[3].id), 0);
		struct qgen fresh;
		qgen_init(&fresh, gens[F] * 31 + 1000);
		for (uint32_t s = 0; s < 4; s++) {
			float q[1][NL][Q_ROW], out[1][NL][Q_ROW];
			int32_t status[1][NL];
			qgen_next(&fresh, o.dtype, q[0]);
			step_batch(ctx, o.dtype, &tp[F], 1, (const float(*)[NL][Q_ROW])q, out, status);
			cr_assert_eq(status[0][0], 0, "%s", kvr_last_error(ctx));
			for (uint32_t l = 0; l < NL; l++)
				model_step(&t[F], l, q[0][l], out[0][l], o.mode, o.tau, 1e-4, &ck, "F after free",
					   s);
		}
		ctx_close(ctx, &o);
		for (int i = 0; i < 4; i++)
			tseq_fini(&t[i]);
	}
}

/*
 * Test 8c: fork and truncate in the middle of a run. B is forked at step 8
 * into B2 (which then gets its own tokens and queries) and C is truncated at
 * step 16. Expected: B's outputs are those of B decoded without the fork; B2's
 * equal a fresh sequence prefilled with B's tokens at the fork; C's after the
 * truncate equal a fresh sequence prefilled with the kept tokens; and the
 * step after the truncate waits for a full correction in every sparse layer.
 */
Test(scheduler, fork_and_truncate_mid_run, .timeout = 120)
{
	enum { STEPS = 26, FORK_AT = 8, TRUNC_AT = 16 };
	/* cpu only: cudaemu-strict's truncate path is truncate_rewrites_resident_pages */
	for (uint32_t ri = 0; ri < 2; ri++) {
		const uint32_t recall = runs_cpu_strict[ri].recall;
		struct opts o = opts_default(runs_cpu_strict[ri].dev, KVR_MODE_SPECULATIVE, recall, KVR_DTYPE_F32);
		struct kvr_context *ctx = ctx_open(&o);
		struct tseq b, b2, c, b_at_fork, c_at_trunc;
		struct qgen qb, qb2, qc;
		tseq_init(&b, 21);
		tseq_init(&c, 22);
		tseq_prefill(ctx, o.dtype, &b, 310);
		tseq_prefill(ctx, o.dtype, &c, 450);
		qgen_init(&qb, 1), qgen_init(&qb2, 2), qgen_init(&qc, 3);
		static float outs_b[STEPS][NL][Q_ROW], outs_b2[STEPS][NL][Q_ROW], outs_c[STEPS][NL][Q_ROW];
		static float qs_b2[STEPS][NL][Q_ROW], qs_c[STEPS][NL][Q_ROW];
		uint64_t trunc_to = 0;
		struct kvr_stats before_trunc = { 0 };
		struct check ck;
		memset(&ck, 0, sizeof(ck));
		for (uint32_t s = 0; s < STEPS; s++) {
			if (s == FORK_AT) {
				tseq_copy(&b2, &b, b.n, 77); /* B2's own new tokens */
				tseq_copy(&b_at_fork, &b, b.n, 77);
				cr_assert_eq(kvr_seq_fork(ctx, b.id, &b2.id), 0, "%s", kvr_last_error(ctx));
			}
			if (s == TRUNC_AT) {
				trunc_to = c.n - 37;
				cr_assert_eq(kvr_seq_truncate(ctx, c.id, trunc_to), 0, "%s", kvr_last_error(ctx));
				c.n = trunc_to;
				c.has_prev[0] = c.has_prev[1] = 0;
				c.gen = 99; /* new tokens unlike the dropped ones */
				tseq_copy(&c_at_trunc, &c, trunc_to, c.gen);
				before_trunc = seq_stats(ctx, c.id);
			}
			struct tseq *tp[3] = { &b, &c, &b2 };
			const uint32_t nb = s >= FORK_AT ? 3 : 2;
			float q[3][NL][Q_ROW], out[3][NL][Q_ROW];
			int32_t status[3][NL];
			qgen_next(&qb, o.dtype, q[0]);
			qgen_next(&qc, o.dtype, q[1]);
			if (nb == 3)
				qgen_next(&qb2, o.dtype, q[2]);
			step_batch(ctx, o.dtype, tp, nb, (const float(*)[NL][Q_ROW])q, out, status);
			for (uint32_t i = 0; i < nb; i++)
				for (uint32_t l = 0; l < NL; l++) {
					cr_assert_eq(status[i][l], 0, "%s", kvr_last_error(ctx));
					model_step(tp[i], l, q[i][l], out[i][l], o.mode, o.tau, 1e-4, &ck, "fork/trunc",
						   s);
				}
			memcpy(outs_b[s], out[0], sizeof(out[0]));
			memcpy(outs_c[s], out[1], sizeof(out[1]));
			memcpy(qs_c[s], q[1], sizeof(q[1]));
			if (nb == 3) {
				memcpy(outs_b2[s], out[2], sizeof(out[2]));
				memcpy(qs_b2[s], q[2], sizeof(q[2]));
			}
			if (s == TRUNC_AT) {
				const struct kvr_stats st = seq_stats(ctx, c.id);
				cr_assert_eq(st.correction_waits - before_trunc.correction_waits, NL,
					     "the step after truncate is not fully corrected");
			}
		}
		ctx_close(ctx, &o);

		/* replays, each in a fresh context */
		struct kvr_context *r = ctx_open(&o);
		struct tseq rb;
		tseq_init(&rb, 21);
		tseq_prefill(r, o.dtype, &rb, 310);
		struct qgen q1;
		qgen_init(&q1, 1);
		for (uint32_t s = 0; s < STEPS; s++) {
			float q[NL][Q_ROW], out[NL][Q_ROW];
			qgen_next(&q1, o.dtype, q);
			step_one(r, o.dtype, &rb, (const float(*)[Q_ROW])q, out);
			cr_assert_eq(memcmp(out, outs_b[s], sizeof(out)), 0,
				     "%s: the fork source changed at step %u", kvr_recall_name(recall), s);
		}
		tseq_ingest(r, o.dtype, &b_at_fork);
		for (uint32_t s = FORK_AT; s < STEPS; s++) {
			float out[NL][Q_ROW];
			step_one(r, o.dtype, &b_at_fork, (const float(*)[Q_ROW])qs_b2[s], out);
			cr_assert_eq(memcmp(out, outs_b2[s], sizeof(out)), 0,
				     "%s: the fork differs from a fresh copy at step %u", kvr_recall_name(recall),
				     s);
		}
		tseq_ingest(r, o.dtype, &c_at_trunc);
		for (uint32_t s = TRUNC_AT; s < STEPS; s++) {
			float out[NL][Q_ROW];
			step_one(r, o.dtype, &c_at_trunc, (const float(*)[Q_ROW])qs_c[s], out);
			cr_assert_eq(memcmp(out, outs_c[s], sizeof(out)), 0,
				     "%s: the truncated sequence differs from a fresh one at step %u",
				     kvr_recall_name(recall), s);
		}
		ctx_close(r, &o);
		tseq_fini(&b), tseq_fini(&b2), tseq_fini(&c), tseq_fini(&b_at_fork);
		tseq_fini(&c_at_trunc), tseq_fini(&rb);
	}
}

/* ------------------------------------------------------------------ budget, trace, errors */

/* Test 9: device_bytes for exactly two sequences. */
Test(scheduler, device_budget_admits_exactly, .timeout = 60)
{
	for (uint32_t recall = KVR_RECALL_ZERO_COPY; recall <= KVR_RECALL_STREAMED; recall++) {
		struct opts o = opts_default(KVR_DEV_CPU, KVR_MODE_FREEKV, recall, KVR_DTYPE_F32);
		struct kvr_config c;
		config_of(&o, &c);
		uint64_t fixed = 0, per = 0;
		cr_assert_eq(kvr_device_bytes_needed(&c, &fixed, &per), 0);
		cr_assert_gt(per, 0);
		if (recall == KVR_RECALL_STREAMED) {
			/* k slots per KV head in both sparse layers, keys and values */
			cr_expect_geq(per, 2ull * NL * K_SEL * P * KV_ROW * 4);
			cr_expect_gt(fixed, 0, "staging buffers");
		}
		o.device_bytes = fixed + 2 * per;
		struct kvr_context *ctx = ctx_open(&o);
		uint32_t a, b, x;
		cr_assert_eq(kvr_seq_create(ctx, &a), 0, "%s", kvr_last_error(ctx));
		cr_assert_eq(kvr_seq_create(ctx, &b), 0, "%s", kvr_last_error(ctx));
		cr_assert_eq(kvr_seq_create(ctx, &x), -ENOSPC);
		cr_assert(strstr(kvr_last_error(ctx), "device_bytes") != NULL, "message: %s",
			  kvr_last_error(ctx));
		cr_assert_eq(kvr_seq_fork(ctx, a, &x), -ENOSPC);
		cr_assert_eq(kvr_seq_free(ctx, a), 0);
		struct tseq t;
		tseq_init(&t, 5);
		tseq_prefill(ctx, o.dtype, &t, 200); /* the freed share admits another */
		cr_assert_eq(kvr_seq_create(ctx, &x), -ENOSPC);
		float q[NL][Q_ROW], out[NL][Q_ROW];
		struct qgen qg;
		qgen_init(&qg, 3);
		for (int s = 0; s < 3; s++) {
			qgen_next(&qg, o.dtype, q);
			step_one(ctx, o.dtype, &t, (const float(*)[Q_ROW])q, out);
		}
		ctx_close(ctx, &o);
		tseq_fini(&t);
	}
}

/* A minimal JSON validator (RFC 8259 grammar, no semantics). */
struct json {
	const char *p;
	int depth;
};

static void jws(struct json *j)
{
	while (*j->p == ' ' || *j->p == '\n' || *j->p == '\r' || *j->p == '\t')
		j->p++;
}

static int jvalue(struct json *j);

static int jstring(struct json *j)
{
	if (*j->p != '"')
		return 0;
	j->p++;
	while (*j->p && *j->p != '"') {
		if ((unsigned char)*j->p < 0x20)
			return 0;
		if (*j->p == '\\') {
			j->p++;
			if (!*j->p || !strchr("\"\\/bfnrtu", *j->p))
				return 0;
		}
		j->p++;
	}
	if (*j->p != '"')
		return 0;
	j->p++;
	return 1;
}

static int jdigits(struct json *j)
{
	const char *s = j->p;
	while (*j->p >= '0' && *j->p <= '9')
		j->p++;
	return j->p > s;
}

static int jnumber(struct json *j)
{
	if (*j->p == '-')
		j->p++;
	if (!jdigits(j))
		return 0;
	if (*j->p == '.') {
		j->p++;
		if (!jdigits(j))
			return 0;
	}
	if (*j->p == 'e' || *j->p == 'E') {
		j->p++;
		if (*j->p == '+' || *j->p == '-')
			j->p++;
		if (!jdigits(j))
			return 0;
	}
	return 1;
}

static int jseq(struct json *j, char close, int members)
{
	if (++j->depth > 64)
		return 0;
	j->p++;
	jws(j);
	if (*j->p == close) {
		j->p++;
		j->depth--;
		return 1;
	}
	for (;;) {
		jws(j);
		if (members) {
			if (!jstring(j))
				return 0;
			jws(j);
			if (*j->p++ != ':')
				return 0;
			jws(j);
		}
		if (!jvalue(j))
			return 0;
		jws(j);
		if (*j->p == ',') {
			j->p++;
			continue;
		}
		if (*j->p != close)
			return 0;
		j->p++;
		j->depth--;
		return 1;
	}
}

static int jvalue(struct json *j)
{
	switch (*j->p) {
	case '{':
		return jseq(j, '}', 1);
	case '[':
		return jseq(j, ']', 0);
	case '"':
		return jstring(j);
	case 't':
		return strncmp(j->p, "true", 4) ? 0 : (j->p += 4, 1);
	case 'f':
		return strncmp(j->p, "false", 5) ? 0 : (j->p += 5, 1);
	case 'n':
		return strncmp(j->p, "null", 4) ? 0 : (j->p += 4, 1);
	default:
		return jnumber(j);
	}
}

static int json_valid(const char *text)
{
	struct json j = { text, 0 };
	jws(&j);
	if (!jvalue(&j))
		return 0;
	jws(&j);
	return *j.p == 0;
}

Test(scheduler, json_validator_rejects_bad_json)
{
	cr_assert(json_valid("{\"a\": [1, 2.5e-3, \"x\\\"y\", true, null, {}]}"));
	cr_assert(!json_valid("{\"a\": [1, 2,]}"));
	cr_assert(!json_valid("{\"a\": 1"));
	cr_assert(!json_valid("{\"a\": 1}}"));
	cr_assert(!json_valid("{a: 1}"));
}

/* Test 10: a trace of a few streamed steps is valid JSON with the spans of
 * every track; writes are refused without a trace and during a step. */
Test(scheduler, trace_export, .timeout = 60)
{
	struct opts o = opts_default(KVR_DEV_CPU, KVR_MODE_FREEKV, KVR_RECALL_STREAMED, KVR_DTYPE_F32);
	struct kvr_context *ctx = ctx_open(&o);
	char path[] = "/tmp/kvr_trace_XXXXXX";
	const int fd = mkstemp(path);
	cr_assert_geq(fd, 0);
	close(fd);
	cr_assert_eq(kvr_trace_write(ctx, path), -EINVAL, "no trace was started");
	struct tseq t;
	tseq_init(&t, 9);
	tseq_prefill(ctx, o.dtype, &t, 300);
	cr_assert_eq(kvr_trace_start(ctx, 0), -EINVAL);
	cr_assert_eq(kvr_trace_start(ctx, 100000), 0, "%s", kvr_last_error(ctx));
	struct qgen qg;
	qgen_init(&qg, 8);
	float q[NL][Q_ROW], out[NL][Q_ROW];
	for (int s = 0; s < 8; s++) {
		qgen_next(&qg, o.dtype, q);
		step_one(ctx, o.dtype, &t, (const float(*)[Q_ROW])q, out);
	}
	/* a step open: refused, and the trace survives */
	const uint64_t pos = t.n;
	cr_assert_eq(kvr_decode_begin(ctx, &t.id, &pos, 1), 0);
	cr_assert_eq(kvr_trace_write(ctx, path), -EBUSY);
	cr_assert_eq(kvr_trace_start(ctx, 10), -EBUSY);
	cr_assert_eq(kvr_decode_end(ctx), 0);
	/* a path that cannot be written: refused, and the trace is kept */
	cr_assert_eq(kvr_trace_write(ctx, "/nonexistent-dir/trace.json"), -ENOENT);
	cr_expect(strstr(kvr_last_error(ctx), "the trace is kept"), "%s", kvr_last_error(ctx));
	cr_assert_eq(kvr_trace_write(ctx, NULL), -EINVAL);
	qgen_next(&qg, o.dtype, q);
	step_one(ctx, o.dtype, &t, (const float(*)[Q_ROW])q, out); /* still recording */
	cr_assert_eq(kvr_trace_write(ctx, path), 0, "%s", kvr_last_error(ctx));
	cr_assert_eq(kvr_trace_write(ctx, path), -EINVAL, "the trace was written already");

	FILE *f = fopen(path, "rb");
	cr_assert(f);
	fseek(f, 0, SEEK_END);
	const long size = ftell(f);
	fseek(f, 0, SEEK_SET);
	char *text = malloc((size_t)size + 1);
	cr_assert_eq(fread(text, 1, (size_t)size, f), (size_t)size);
	text[size] = 0;
	fclose(f);
	unlink(path);
	cr_assert_eq(strncmp(text, "{\"displayTimeUnit\"", 18), 0, "starts with: %.40s", text);
	cr_assert(strstr(text, "\"traceEvents\"") != NULL);
	cr_assert(json_valid(text), "the trace is not valid JSON");
	static const char *const spans[] = { "select (next step)", "copy chunk", "scatter chunk",
					     "attention" };
	for (int i = 0; i < 4; i++) {
		char needle[64];
		snprintf(needle, sizeof(needle), "\"name\": \"%s\"", spans[i]);
		cr_assert(strstr(text, needle) != NULL, "no span named %s", spans[i]);
	}
	free(text);
	ctx_close(ctx, &o);
	tseq_fini(&t);
}

/* Test 11: a normal run leaves no asynchronous error (ctx_close checks it
 * after every test; here on its own, streamed, and the query is idempotent). */
Test(scheduler, async_error_clear_after_run, .timeout = 60)
{
	struct opts o = opts_default(KVR_DEV_CPU, KVR_MODE_FREEKV, KVR_RECALL_STREAMED, KVR_DTYPE_F16);
	struct kvr_context *ctx = ctx_open(&o);
	cr_assert_eq(kvr_async_error(ctx, NULL), 0);
	struct tseq t;
	tseq_init(&t, 3);
	tseq_prefill(ctx, o.dtype, &t, 260);
	struct qgen qg;
	qgen_init(&qg, 4);
	float q[NL][Q_ROW], out[NL][Q_ROW];
	for (int s = 0; s < 10; s++) {
		qgen_next(&qg, o.dtype, q);
		step_one(ctx, o.dtype, &t, (const float(*)[Q_ROW])q, out);
	}
	kvr_sched_seq_quiesce(ctx->sched, t.id);
	const char *msg = "unset";
	cr_assert_eq(kvr_async_error(ctx, &msg), 0, "%s", msg);
	cr_assert_eq(kvr_async_error(ctx, NULL), 0);
	cr_assert_eq(kvr_async_error(NULL, NULL), -EINVAL);
	ctx_close(ctx, &o);
	tseq_fini(&t);
}

/* Prefill attention on cudaemu-strict (host q and out staged through device
 * buffers, items copied to device memory, pool pages and the tail read in
 * place) equals the cpu backend's, query by query. */
Test(scheduler, prefill_attention_on_strict_device, .timeout = 120)
{
	enum { N = 150, FIRST = 37 };
	static float out_cpu[NL][N][Q_ROW], out_strict[NL][N][Q_ROW];
	static float qf[N][Q_ROW];
	struct rng r = { 5 };
	for (uint32_t t = 0; t < N; t++)
		for (uint32_t c = 0; c < Q_ROW; c++)
			qf[t][c] = rnd(&r);
	const uint32_t kinds[2] = { KVR_DEV_CPU, KVR_DEV_CUDAEMU_STRICT };
	float(*outs[2])[N][Q_ROW] = { out_cpu, out_strict };
	for (int ki = 0; ki < 2; ki++) {
		struct opts o = opts_default(kinds[ki], KVR_MODE_FREEKV, KVR_RECALL_STREAMED, KVR_DTYPE_F32);
		struct kvr_context *ctx = ctx_open(&o);
		struct tseq t;
		tseq_init(&t, 41);
		tseq_prefill(ctx, o.dtype, &t, N); /* 4 full pages and a partial tail */
		for (uint32_t l = 0; l < NL; l++) {
			/* a first call over the first FIRST queries, then the rest */
			cr_assert_eq(kvr_prefill_attention(ctx, t.id, l, 0, FIRST, qf, outs[ki][l]), 0, "%s: %s",
				     dev_name(o.dev_kind), kvr_last_error(ctx));
			cr_assert_eq(kvr_prefill_attention(ctx, t.id, l, FIRST, N - FIRST, qf[FIRST],
							   outs[ki][l][FIRST]),
				     0, "%s: %s", dev_name(o.dev_kind), kvr_last_error(ctx));
			if (ki == 1)
				cr_assert(out_strict[l][N - 1][0] != 0.0f && out_cpu[l][0][0] != 0.0f,
					  "no output was written");
			if (ki == 1)
				for (uint32_t i = 0; i < N; i++)
					for (uint32_t c = 0; c < Q_ROW; c++)
						cr_assert(fabsf(out_cpu[l][i][c] - out_strict[l][i][c]) <= 1e-4f,
							  "layer %u query %u element %u: cpu %g, strict %g", l, i,
							  c, (double)out_cpu[l][i][c], (double)out_strict[l][i][c]);
		}
		ctx_close(ctx, &o);
		tseq_fini(&t);
	}
}

/* Truncate in the middle of a resident page: on cudaemu-strict every page of a
 * dense lane has a device copy (resident.c); the page the truncate reopens is
 * rewritten with other tokens, and attention must read the new ones. Mode
 * dense, short sequences: every output is the model's dense attention. */
Test(scheduler, truncate_rewrites_resident_pages, .timeout = 120)
{
	const uint32_t kinds[2] = { KVR_DEV_CPU, KVR_DEV_CUDAEMU_STRICT };
	for (int ki = 0; ki < 2; ki++) {
		struct opts o = opts_default(kinds[ki], KVR_MODE_DENSE, KVR_RECALL_STREAMED, KVR_DTYPE_F32);
		struct kvr_context *ctx = ctx_open(&o);
		struct tseq c;
		struct qgen qg;
		struct check ck;
		memset(&ck, 0, sizeof(ck));
		tseq_init(&c, 61);
		tseq_prefill(ctx, o.dtype, &c, 100);
		qgen_init(&qg, 62);
		for (uint32_t s = 0; s < 24; s++) {
			if (s == 4) {
				/* 104 tokens -> 90: page 5 (tokens 80..95) is partial again */
				cr_assert_eq(kvr_seq_truncate(ctx, c.id, 90), 0, "%s", kvr_last_error(ctx));
				c.n = 90;
				c.has_prev[0] = c.has_prev[1] = 0;
				c.gen = 99; /* new tokens unlike the dropped ones */
			}
			float q[1][NL][Q_ROW], out[1][NL][Q_ROW];
			qgen_next(&qg, o.dtype, q[0]);
			step_one(ctx, o.dtype, &c, q[0], out[0]);
			for (uint32_t l = 0; l < NL; l++)
				model_step(&c, l, q[0][l], out[0][l], o.mode, o.tau, 1e-4, &ck, dev_name(o.dev_kind),
					   s);
		}
		cr_assert_eq(c.n, 110);
		ctx_close(ctx, &o);
		tseq_fini(&c);
	}
}

/*
 * The device path's promise, measured: the engine thread's host waits for the device per
 * (step, layer) on cudaemu-strict (a device with memory of its own, so the
 * GPU paths run), per mode and recall kind, counted by kvr_stats.host_waits.
 * The table is printed; each count is asserted exactly, so a wait added
 * anywhere on the decode path fails here, and the expectations move to 0 as
 * the step moves onto the device.
 */
static void host_waits_on(uint32_t dev_kind, const double want[3][2])
{
	static const uint32_t modes[] = { KVR_MODE_SPECULATIVE, KVR_MODE_FREEKV, KVR_MODE_BLOCKING };
	const uint32_t n_steps = 6;
	for (int mi = 0; mi < 3; mi++)
		for (uint32_t recall = KVR_RECALL_ZERO_COPY; recall <= KVR_RECALL_STREAMED; recall++) {
			struct opts o = opts_default(dev_kind, modes[mi], recall, KVR_DTYPE_F32);
			struct drift r;
			struct check ck;
			drift_alloc(&r, 1, n_steps);
			run_drift(&o, &r, &ck);
			free(r.outs);
			const double per_layer = (double)ck.stats.host_waits / (n_steps * NL);
			fprintf(stderr, "host waits per layer, %s %s %s: %.3f (%llu in %u layer calls, %.0f us)\n",
				dev_name(dev_kind), kvr_mode_name(modes[mi]), kvr_recall_name(recall), per_layer,
				(unsigned long long)ck.stats.host_waits, n_steps * NL,
				(double)ck.stats.host_wait_ns / 1e3);
			if (want)
				cr_expect_float_eq(per_layer, want[mi][recall - KVR_RECALL_ZERO_COPY], 1e-9,
						   "%s %s %s: %.3f host waits per layer", dev_name(dev_kind),
						   kvr_mode_name(modes[mi]), kvr_recall_name(recall), per_layer);
		}
}

Test(scheduler, host_waits_per_layer, .timeout = 240)
{
	/* 6 steps x 2 layers, the first step selecting afresh: none, the step's
	 * end aside (the device append and the device plan; before them 1.3 to
	 * 3.2 per layer, docs/history.md). */
	static const double strict[3][2] = { { 0, 0 }, { 0, 0 }, { 0, 0 } };
	host_waits_on(KVR_DEV_CUDAEMU_STRICT, strict);
	host_waits_on(KVR_DEV_CPU, NULL); /* printed beside: the host-visible path */
}

/*
 * The device append (a device with memory of its own: the token's rows
 * copied into the tail tile and a completed page converted and summarised on
 * the compute stream) under a spill tier: the page the device writes stays
 * pinned until the step's attention is done, so eviction never writes out a
 * page still being filled. With 8 pages of RAM (the least a tier takes) for about 40, outputs equal a
 * pool held in RAM bit for bit, over steps that complete pages (freekv and
 * speculative, streamed recall: what a spill tier takes), with the spilled
 * run's compute stream asynchronous and delayed at random.
 */
Test(scheduler, device_append_under_spill_tier, .timeout = 240)
{
	/* a spill tier takes streamed recall (zero-copy reads pages in place) */
	static const uint32_t modes[] = { KVR_MODE_FREEKV, KVR_MODE_SPECULATIVE };
	for (int mi = 0; mi < 2; mi++) {
		struct opts o = opts_default(KVR_DEV_CUDAEMU_STRICT, modes[mi], KVR_RECALL_STREAMED,
					     KVR_DTYPE_F32);
		struct drift ram, spilled;
		struct check ck;
		drift_alloc(&ram, 1, 20);
		drift_alloc(&spilled, 1, 20);
		run_drift(&o, &ram, &ck);
		o.ram_pages = 8;
		o.hooks = 1; /* asynchronous compute, delayed: the device writes late */
		run_drift(&o, &spilled, &ck);
		first_difference(&ram, &spilled, kvr_mode_name(modes[mi]));
		free(ram.outs), free(spilled.outs);
	}
}

/*
 * The device path (device append, device plan: gated selection, plan
 * kernel, streamed: slots planned and misses moved on the device) against
 * the host path it replaces (hooks.host_step), on cudaemu-strict: one
 * sequence, every mode, zero-copy and streamed, the same output bits at
 * every step, and the same pages recalled; K8V4 and K4V2 pages (quantised
 * on the device, zero-copy) likewise; and a batch of two checked against the model
 * (there the host path makes a second attention call for corrected
 * sequences, so the CUDA kernels' split may round differently). The
 * corrections' statistics, tallied at the step's end on the device path,
 * equal the host path's.
 */
/* `o` on the device path, then on the host path (host_step): the same output
 * bits at every one of n_steps steps, no host wait on the device path; each
 * run's statistics in *dev and *host. */
static void device_against_host(struct opts o, uint32_t n_steps, const char *what, struct check *dev,
				struct check *host)
{
	struct drift d, h;
	drift_alloc(&d, 1, n_steps);
	drift_alloc(&h, 1, n_steps);
	o.host_step = 0;
	run_drift(&o, &d, dev);
	o.host_step = 1;
	run_drift(&o, &h, host);
	first_difference(&d, &h, what);
	cr_assert_eq(dev->stats.host_waits, 0, "%s: %llu host waits", what,
		     (unsigned long long)dev->stats.host_waits);
	free(d.outs), free(h.outs);
}

Test(scheduler, device_plan_equals_host_path, .timeout = 400)
{
	static const uint32_t modes[] = { KVR_MODE_SPECULATIVE, KVR_MODE_FREEKV, KVR_MODE_BLOCKING };
	for (int x = 0; x < 6; x++) {
		const int mi = x % 3;
		const uint32_t recall = x < 3 ? KVR_RECALL_ZERO_COPY : KVR_RECALL_STREAMED;
		const char *what = kvr_mode_name(modes[mi]);
		struct check ck_dev, ck_host;
		device_against_host(opts_default(KVR_DEV_CUDAEMU_STRICT, modes[mi], recall, KVR_DTYPE_F32), 16, what,
				    &ck_dev, &ck_host);
		cr_assert_eq(ck_dev.stats.corrected_heads, ck_host.stats.corrected_heads, "%s", what);
		cr_assert_eq(ck_dev.stats.checked_heads, ck_host.stats.checked_heads);
		/* after a correction (and a lane's first sparse step) the host path
		 * keeps the selection for the next step; the device path, which
		 * does not know there was one, has the controller select again with
		 * the same query, the same pages: one more each */
		const uint64_t again = modes[mi] == KVR_MODE_BLOCKING ? 0 : ck_dev.stats.correction_waits;
		cr_assert_eq(ck_dev.stats.selections, ck_host.stats.selections + again,
			     "%s: %llu selections, the host path %llu, corrections %llu", what,
			     (unsigned long long)ck_dev.stats.selections, (unsigned long long)ck_host.stats.selections,
			     (unsigned long long)ck_dev.stats.correction_waits);
		cr_assert_eq(ck_dev.stats.correction_waits, ck_host.stats.correction_waits);
		if (recall == KVR_RECALL_STREAMED) {
			/* the same pages move; hits differ (the device plans every
			 * head of a lane at every step: a head the controller already
			 * recalled counts its pages again, as hits) */
			cr_assert_gt(ck_dev.stats.pages_recalled, 0);
			cr_assert_eq(ck_dev.stats.pages_recalled, ck_host.stats.pages_recalled,
				     "%s streamed: %llu pages recalled, the host path %llu", what,
				     (unsigned long long)ck_dev.stats.pages_recalled,
				     (unsigned long long)ck_host.stats.pages_recalled);
		}
		if (modes[mi] == KVR_MODE_FREEKV)
			cr_assert_gt(ck_dev.stats.corrected_heads, 0, "no correction: the test cannot tell");
	}
	/* quantised pages: quantised on the device as they complete, read in
	 * place by the plan's segments (zero-copy) */
	static const uint32_t formats[] = { KVR_KV_FORMAT_K8V4, KVR_KV_FORMAT_K4V2 };
	for (int fi = 0; fi < 2; fi++) {
		struct opts o = opts_default(KVR_DEV_CUDAEMU_STRICT, KVR_MODE_FREEKV, KVR_RECALL_ZERO_COPY,
					     KVR_DTYPE_F32);
		o.kv_format = formats[fi];
		struct check ck_dev, ck_host;
		device_against_host(o, 12, kvr_kv_format_name(formats[fi]), &ck_dev, &ck_host);
		cr_assert_eq(ck_dev.stats.corrected_heads, ck_host.stats.corrected_heads);
	}
	/* no window (W = 0): the correction's pages reach the page this step
	 * completed, which the streamed plan must find in its page table */
	model_win = 0;
	for (uint32_t recall = KVR_RECALL_ZERO_COPY; recall <= KVR_RECALL_STREAMED; recall++) {
		struct check ck_dev, ck_host;
		device_against_host(opts_default(KVR_DEV_CUDAEMU_STRICT, KVR_MODE_FREEKV, recall, KVR_DTYPE_F32), 20,
				    recall == KVR_RECALL_STREAMED ? "W = 0, streamed" : "W = 0, zero-copy", &ck_dev,
				    &ck_host);
		cr_assert_eq(ck_dev.stats.pages_recalled, ck_host.stats.pages_recalled);
	}
	model_win = 32;
	struct check ck;
	model_run(KVR_DEV_CUDAEMU_STRICT, KVR_MODE_FREEKV, KVR_RECALL_ZERO_COPY, 2, 12, &ck);
}

/* ------------------------------------------------------------------ capture */

/* The step of batch ts[0..nb) captured on `es` (being captured from here
 * to the graph's end) with the context's dstage buffers as q, k, v and out:
 * recorded, nothing stored. */
static struct kvr_graph *capture_step(struct kvr_context *ctx, struct tseq **ts, uint32_t nb, struct kvr_stream *es)
{
	uint32_t ids[MAXB];
	uint64_t pos[MAXB], before[MAXB];
	struct dstage *ds = dstage_of(ctx);
	cr_assert(ds);
	for (uint32_t i = 0; i < nb; i++) {
		ids[i] = ts[i]->id, pos[i] = ts[i]->n;
		cr_assert_eq(kvr_seq_length(ctx, ids[i], 0, &before[i]), 0);
	}
	cr_assert_eq(kvr_decode_begin(ctx, ids, pos, nb), 0, "%s", kvr_last_error(ctx));
	cr_assert_eq(kvr_dev_stream_begin_capture(ctx->dev, es), 0, "%s", kvr_dev_last_error(ctx->dev));
	for (uint32_t l = 0; l < NL; l++) {
		int32_t st[MAXB];
		for (uint32_t i = 0; i < nb; i++)
			st[i] = 12345;
		cr_assert_eq(kvr_decode_layer_on(ctx, l, ds->q[l], ds->k[l], ds->v[l], ds->o[l], st, es), 0, "%s",
			     kvr_last_error(ctx));
		for (uint32_t i = 0; i < nb; i++)
			cr_assert_eq(st[i], 0);
	}
	struct kvr_graph *g = NULL;
	cr_assert_eq(kvr_dev_stream_end_capture(ctx->dev, es, &g), 0, "%s", kvr_dev_last_error(ctx->dev));
	cr_assert_eq(kvr_decode_end(ctx), 0, "%s", kvr_last_error(ctx));
	for (uint32_t i = 0; i < nb; i++) {
		uint64_t n;
		cr_assert_eq(kvr_seq_length(ctx, ids[i], NL - 1, &n), 0);
		cr_assert_eq(n, before[i], "a captured step stored a token (sequence %u: %llu, was %llu)", ids[i],
			     (unsigned long long)n, (unsigned long long)before[i]);
	}
	return g;
}

/* step_batch's step, replayed: the inputs written where the capture read
 * them, the host part (kvr_decode_replay), the graph launched on es. */
static int replay_batch(struct kvr_context *ctx, uint32_t dtype, struct tseq **ts, uint32_t nb,
			const float (*q)[NL][Q_ROW], float (*out)[NL][Q_ROW], int32_t *status, struct kvr_stream *es,
			struct kvr_graph *g)
{
	uint32_t ids[MAXB];
	uint64_t pos[MAXB];
	struct dstage *ds = dstage_of(ctx);
	const uint32_t eb = ebytes(dtype);
	static unsigned char qb[MAXB * Q_ROW * 4], kb[MAXB * KV_ROW * 4], vb[MAXB * KV_ROW * 4],
		ob[MAXB * Q_ROW * 4];
	for (uint32_t i = 0; i < nb; i++) {
		ids[i] = ts[i]->id, pos[i] = ts[i]->n;
		cr_assert(pos[i] < CAP);
		for (uint32_t l = 0; l < NL; l++)
			token_kv(ts[i], l, pos[i], ts[i]->k[l] + pos[i] * KV_ROW, ts[i]->v[l] + pos[i] * KV_ROW);
	}
	for (uint32_t l = 0; l < NL; l++) {
		for (uint32_t i = 0; i < nb; i++) {
			to_dtype(qb + (size_t)i * Q_ROW * eb, q[i][l], Q_ROW, dtype);
			to_dtype(kb + (size_t)i * KV_ROW * eb, ts[i]->k[l] + pos[i] * KV_ROW, KV_ROW, dtype);
			to_dtype(vb + (size_t)i * KV_ROW * eb, ts[i]->v[l] + pos[i] * KV_ROW, KV_ROW, dtype);
		}
		memset(ob, 0xa5, sizeof(ob));
		dstage_put(ds, ds->q[l], qb, sizeof(qb));
		dstage_put(ds, ds->k[l], kb, sizeof(kb));
		dstage_put(ds, ds->v[l], vb, sizeof(vb));
		dstage_put(ds, ds->o[l], ob, sizeof(ob));
	}
	cr_assert_eq(kvr_decode_begin(ctx, ids, pos, nb), 0, "%s", kvr_last_error(ctx));
	for (uint32_t i = 0; i < nb; i++)
		status[i] = 12345;
	const int rc = kvr_decode_replay_on(ctx, status, es);
	if (rc) { /* refused: the step is unchanged, and ending it cancels it */
		cr_assert_eq(kvr_decode_end(ctx), 0, "%s", kvr_last_error(ctx));
		return rc;
	}
	cr_assert_eq(kvr_dev_graph_launch(ctx->dev, g, es), 0, "%s", kvr_dev_last_error(ctx->dev));
	cr_assert_eq(kvr_decode_end(ctx), 0, "%s", kvr_last_error(ctx));
	for (uint32_t l = 0; l < NL; l++) {
		dstage_get(ds, ob, ds->o[l], sizeof(ob));
		for (uint32_t i = 0; i < nb; i++)
			from_dtype(out[i][l], ob + (size_t)i * Q_ROW * eb, Q_ROW, dtype);
	}
	for (uint32_t i = 0; i < nb; i++)
		if (!status[i])
			ts[i]->n++;
	return 0;
}

/* On options `o`'s device (cudaemu-strict, or cuda): two sequences
 * prefilled to n0[0] and n0[1] tokens, a step captured once and replayed at
 * each of `steps` steps (pages completing, the batch shrinking for a step)
 * give the outputs of the same steps decoded uncaptured, bit for bit, with no host
 * wait; the tokens the replays stored read back the same in an uncaptured
 * step; the statistics agree. */
static void capture_matches(struct opts o, const uint64_t n0[2], uint32_t steps, const char *what,
			    struct kvr_stats *stats)
{
	const uint32_t dtype = o.dtype;
	struct kvr_context *ref = ctx_open(&o), *cap = ctx_open(&o);
	struct tseq a[2], b[2];
	struct tseq *as[2] = { &a[0], &a[1] }, *bs[2] = { &b[0], &b[1] };
	for (int i = 0; i < 2; i++) {
		tseq_init(&a[i], 40 + i), tseq_init(&b[i], 40 + i);
		tseq_prefill(ref, dtype, &a[i], n0[i]);
		tseq_prefill(cap, dtype, &b[i], n0[i]);
	}
	cr_assert_eq(kvr_decode_reserve(cap, 2, CAP), 0, "%s: %s", what, kvr_last_error(cap));
	struct kvr_stream *es = NULL;
	cr_assert_eq(kvr_dev_stream_create(cap->dev, 0, &es), 0);
	struct qgen qg[2];
	qgen_init(&qg[0], 7), qgen_init(&qg[1], 8);
	static float q[2][NL][Q_ROW], out_ref[2][NL][Q_ROW], out_cap[2][NL][Q_ROW];
	/* an uncaptured step first, so that the first replay follows the
	 * controller's job for it (its selection and, streamed, its prefetch,
	 * which the replay must wait for on the device) */
	{
		int32_t st0[2][NL];
		for (uint32_t i = 0; i < 2; i++)
			qgen_next(&qg[i], dtype, q[i]);
		step_batch(ref, dtype, as, 2, (const float(*)[NL][Q_ROW])q, out_ref, st0);
		step_batch(cap, dtype, bs, 2, (const float(*)[NL][Q_ROW])q, out_cap, st0);
		cr_assert(!memcmp(out_ref, out_cap, sizeof(out_ref)), "%s: the first uncaptured step differs", what);
	}
	struct kvr_graph *g = capture_step(cap, bs, 2, es);
	for (uint32_t step = 0; step < steps; step++) {
		const uint32_t nb = step == 5 ? 1 : 2; /* fewer sequences than captured */
		for (uint32_t i = 0; i < nb; i++)
			qgen_next(&qg[i], dtype, q[i]);
		int32_t st_ref[2][NL], st_cap[2];
		step_batch(ref, dtype, as, nb, (const float(*)[NL][Q_ROW])q, out_ref, st_ref);
		cr_assert_eq(replay_batch(cap, dtype, bs, nb, (const float(*)[NL][Q_ROW])q, out_cap, st_cap, es, g), 0,
			     "%s step %u: %s", what, step, kvr_last_error(cap));
		for (uint32_t i = 0; i < nb; i++) {
			cr_assert_eq(st_ref[i][0], 0);
			cr_assert_eq(st_cap[i], 0, "%s step %u: %s", what, step, kvr_last_error(cap));
			for (uint32_t l = 0; l < NL; l++)
				cr_assert(!memcmp(out_ref[i][l], out_cap[i][l], sizeof(out_ref[i][l])),
					  "%s step %u sequence %u layer %u: the replay differs from the uncaptured step",
					  what, step, i, l);
		}
	}
	for (int i = 0; i < 2; i++)
		cr_assert_eq(a[i].n, b[i].n);
	/* what the replays stored (and, sparse, selected), read by an
	 * uncaptured step */
	for (uint32_t i = 0; i < 2; i++)
		qgen_next(&qg[i], dtype, q[i]);
	int32_t st[2][NL];
	step_batch(ref, dtype, as, 2, (const float(*)[NL][Q_ROW])q, out_ref, st);
	step_batch(cap, dtype, bs, 2, (const float(*)[NL][Q_ROW])q, out_cap, st);
	cr_assert(!memcmp(out_ref, out_cap, sizeof(out_ref)), "%s: an uncaptured step after the replays differs",
		  what);
	for (int i = 0; i < 2; i++) /* the last step's controller jobs counted */
		kvr_sched_seq_quiesce(ref->sched, a[i].id), kvr_sched_seq_quiesce(cap->sched, b[i].id);
	struct kvr_stats sr = { .size = sizeof(sr) }, sc = { .size = sizeof(sc) };
	kvr_get_stats(ref, &sr), kvr_get_stats(cap, &sc);
	cr_assert_eq(sc.layer_decodes, sr.layer_decodes, "%s", what);
	cr_assert_eq(sc.dense_decodes, sr.dense_decodes, "%s", what);
	cr_assert_eq(sc.checked_heads, sr.checked_heads, "%s", what);
	cr_assert_eq(sc.corrected_heads, sr.corrected_heads, "%s", what);
	cr_assert_eq(sc.correction_waits, sr.correction_waits, "%s", what);
	cr_assert_eq(sc.selections, sr.selections, "%s: %llu selections, uncaptured %llu", what,
		     (unsigned long long)sc.selections, (unsigned long long)sr.selections);
	cr_assert_eq(sc.steps, sr.steps, "%s: the captured step counted (%llu steps, %llu uncaptured)", what,
		     (unsigned long long)sc.steps, (unsigned long long)sr.steps);
	/* streamed: the same pages moved, and as many of them ahead of their
	 * step (the prefetch's hits: a graph that left the prefetch out moves
	 * the same pages at the step, with fewer hits) */
	cr_assert_eq(sc.pages_recalled, sr.pages_recalled, "%s: %llu pages recalled, uncaptured %llu", what,
		     (unsigned long long)sc.pages_recalled, (unsigned long long)sr.pages_recalled);
	cr_assert_eq(sc.pages_hit, sr.pages_hit, "%s: %llu pages hit, uncaptured %llu", what,
		     (unsigned long long)sc.pages_hit, (unsigned long long)sr.pages_hit);
	cr_assert_eq(sc.bytes_recalled, sr.bytes_recalled, "%s", what);
	cr_assert_eq(sc.host_waits, 0, "%s", what);
	*stats = sc;
	kvr_dev_graph_destroy(cap->dev, g);
	kvr_dev_stream_destroy(cap->dev, es);
	ctx_close(ref, &o), ctx_close(cap, &o);
	for (int i = 0; i < 2; i++)
		tseq_fini(&a[i]), tseq_fini(&b[i]);
}

Test(scheduler, captured_dense_step_replays_bit_exact, .timeout = 300)
{
	static const uint32_t dtypes[] = { KVR_DTYPE_F32, KVR_DTYPE_F16 };
	const uint64_t n0[2] = { 3 * P + 5, P - 3 };
	for (int di = 0; di < 2; di++) {
		struct kvr_stats st;
		capture_matches(opts_default(KVR_DEV_CUDAEMU_STRICT, KVR_MODE_DENSE, KVR_RECALL_ZERO_COPY, dtypes[di]),
				n0, 2 * P + 3, kvr_dtype_name(dtypes[di]), &st);
	}
}

/* The sparse modes with zero-copy recall: one sequence turning sparse
 * during the replays (its first sparse step selects afresh), one sparse
 * from the first, a page completing in each, freekv correcting heads now
 * and then; the next step's selection runs inside the graph. */
Test(scheduler, captured_sparse_steps_replay_bit_exact, .timeout = 900)
{
	static const uint32_t modes[] = { KVR_MODE_SPECULATIVE, KVR_MODE_FREEKV, KVR_MODE_BLOCKING };
	const uint64_t n0[2] = { BUDGET - 3, BUDGET + 2 * P };
	for (int mi = 0; mi < 3; mi++) {
		struct kvr_stats st;
		capture_matches(opts_default(KVR_DEV_CUDAEMU_STRICT, modes[mi], KVR_RECALL_ZERO_COPY, KVR_DTYPE_F32),
				n0, P + 3, kvr_mode_name(modes[mi]), &st);
		cr_assert_gt(st.selections, 0, "%s: nothing selected: the test cannot tell", kvr_mode_name(modes[mi]));
		if (modes[mi] == KVR_MODE_FREEKV)
			cr_assert_gt(st.corrected_heads, 0, "no correction: the test cannot tell");
	}
	/* quantised pages, read in place */
	struct opts o = opts_default(KVR_DEV_CUDAEMU_STRICT, KVR_MODE_FREEKV, KVR_RECALL_ZERO_COPY, KVR_DTYPE_F16);
	o.kv_format = KVR_KV_FORMAT_K8V4;
	struct kvr_stats st;
	capture_matches(o, n0, P + 3, "freekv k8v4", &st);
}

/* The same with streamed recall: this step's misses (corrected heads, a
 * lane's first sparse step) planned and scattered into the slots in the
 * graph, and the next step's selection prefetched on the fork, as the
 * controller does uncaptured; the recall statistics agree too. */
Test(scheduler, captured_streamed_steps_replay_bit_exact, .timeout = 900)
{
	/* speculative's prefetch is freekv's without corrections: not again */
	static const uint32_t modes[] = { KVR_MODE_FREEKV, KVR_MODE_BLOCKING };
	static const uint32_t dtypes[] = { KVR_DTYPE_F16, KVR_DTYPE_F32 };
	const uint64_t n0[2] = { BUDGET - 3, BUDGET + 2 * P };
	for (int mi = 0; mi < 2; mi++) {
		struct kvr_stats st;
		char what[64];
		snprintf(what, sizeof(what), "streamed %s %s", kvr_mode_name(modes[mi]), kvr_dtype_name(dtypes[mi]));
		capture_matches(opts_default(KVR_DEV_CUDAEMU_STRICT, modes[mi], KVR_RECALL_STREAMED, dtypes[mi]), n0,
				P + 3, what, &st);
		cr_assert_gt(st.pages_recalled, 0, "%s: nothing recalled: the test cannot tell", what);
		if (modes[mi] != KVR_MODE_BLOCKING)
			cr_assert_gt(st.pages_hit, 0, "%s: no hit: the test cannot tell", what);
		if (modes[mi] == KVR_MODE_FREEKV)
			cr_assert_gt(st.corrected_heads, 0, "%s: no correction: the test cannot tell", what);
	}
}

/* The same on a GPU (skipped without one, as in CI): CUDA's own capture
 * and graphs, the kernels' reserved scratch, the fork stream. */
Test(scheduler, captured_steps_replay_bit_exact_cuda, .timeout = 400)
{
	cuda_or_skip();
	const uint64_t dense_n0[2] = { 3 * P + 5, P - 3 }, sparse_n0[2] = { BUDGET - 3, BUDGET + 2 * P };
	struct kvr_stats st;
	capture_matches(opts_default(KVR_DEV_CUDA, KVR_MODE_DENSE, KVR_RECALL_ZERO_COPY, KVR_DTYPE_F16), dense_n0,
			2 * P + 3, "cuda dense", &st);
	static const uint32_t modes[] = { KVR_MODE_SPECULATIVE, KVR_MODE_FREEKV, KVR_MODE_BLOCKING };
	for (int mi = 0; mi < 3; mi++)
		capture_matches(opts_default(KVR_DEV_CUDA, modes[mi], KVR_RECALL_ZERO_COPY, KVR_DTYPE_F16), sparse_n0,
				2 * P + 3, kvr_mode_name(modes[mi]), &st);
	for (int mi = 0; mi < 3; mi++) {
		char what[64];
		snprintf(what, sizeof(what), "cuda streamed %s", kvr_mode_name(modes[mi]));
		capture_matches(opts_default(KVR_DEV_CUDA, modes[mi], KVR_RECALL_STREAMED, KVR_DTYPE_F16), sparse_n0,
				2 * P + 3, what, &st);
	}
}

/* Every refusal of capture and replay says why and leaves the context
 * usable: nothing stored, the next uncaptured step as if none happened. */
Test(scheduler, capture_refusals_leave_the_context_usable, .timeout = 200)
{
	const uint32_t dtype = KVR_DTYPE_F32;
	struct opts o = opts_default(KVR_DEV_CUDAEMU_STRICT, KVR_MODE_DENSE, KVR_RECALL_ZERO_COPY, dtype);
	struct kvr_context *ctx = ctx_open(&o);
	struct dstage *ds = dstage_of(ctx);
	struct tseq t[2];
	struct tseq *ts[2] = { &t[0], &t[1] };
	tseq_init(&t[0], 50), tseq_init(&t[1], 51);
	tseq_prefill(ctx, dtype, &t[0], 2 * P + 1);
	tseq_prefill(ctx, dtype, &t[1], P + 2);
	struct kvr_stream *es = NULL;
	cr_assert_eq(kvr_dev_stream_create(ctx->dev, 0, &es), 0);
	static float q[2][NL][Q_ROW], out[2][NL][Q_ROW];
	int32_t st[MAXB];
	struct qgen qg;
	qgen_init(&qg, 3);
	qgen_next(&qg, dtype, q[0]);
	memcpy(q[1], q[0], sizeof(q[0]));

	/* a replay with nothing captured */
	cr_assert_eq(replay_batch(ctx, dtype, ts, 2, (const float(*)[NL][Q_ROW])q, out, st, es, NULL), -EINVAL);
	cr_assert(strstr(kvr_last_error(ctx), "not captured"), "%s", kvr_last_error(ctx));
	/* a capture before any reservation: refused before it records anything */
	uint32_t ids[2] = { t[0].id, t[1].id };
	uint64_t pos[2] = { t[0].n, t[1].n };
	cr_assert_eq(kvr_decode_begin(ctx, ids, pos, 2), 0);
	cr_assert_eq(kvr_dev_stream_begin_capture(ctx->dev, es), 0);
	cr_assert_eq(kvr_decode_layer_on(ctx, 0, ds->q[0], ds->k[0], ds->v[0], ds->o[0], st, es), -EINVAL);
	cr_assert(strstr(kvr_last_error(ctx), "kvr_decode_reserve"), "%s", kvr_last_error(ctx));
	struct kvr_graph *g = NULL;
	cr_assert_eq(kvr_dev_stream_end_capture(ctx->dev, es, &g), 0, "%s", kvr_dev_last_error(ctx->dev));
	kvr_dev_graph_destroy(ctx->dev, g);
	cr_assert_eq(kvr_decode_end(ctx), 0, "%s", kvr_last_error(ctx)); /* nothing decoded: cancelled */
	/* reservations out of range, or with a step open */
	cr_assert_eq(kvr_decode_reserve(ctx, 0, CAP), -EINVAL);
	cr_assert_eq(kvr_decode_reserve(ctx, MAXB + 100, CAP), -EINVAL);
	cr_assert_eq(kvr_decode_reserve(ctx, 2, 0), -EINVAL);
	cr_assert_eq(kvr_decode_begin(ctx, ids, pos, 2), 0);
	cr_assert_eq(kvr_decode_reserve(ctx, 2, CAP), -EBUSY);
	cr_assert_eq(kvr_decode_end(ctx), 0);
	/* a batch larger than reserved */
	cr_assert_eq(kvr_decode_reserve(ctx, 1, 3 * P), 0, "%s", kvr_last_error(ctx));
	cr_assert_eq(kvr_decode_begin(ctx, ids, pos, 2), 0);
	cr_assert_eq(kvr_dev_stream_begin_capture(ctx->dev, es), 0);
	cr_assert_eq(kvr_decode_layer_on(ctx, 0, ds->q[0], ds->k[0], ds->v[0], ds->o[0], st, es), -EINVAL);
	cr_assert_eq(kvr_dev_stream_end_capture(ctx->dev, es, &g), 0, "%s", kvr_dev_last_error(ctx->dev));
	kvr_dev_graph_destroy(ctx->dev, g);
	cr_assert_eq(kvr_decode_end(ctx), 0);
	/* a step's layers captured all or none */
	cr_assert_eq(kvr_decode_reserve(ctx, 2, 3 * P), 0, "%s", kvr_last_error(ctx));
	cr_assert_eq(kvr_decode_begin(ctx, ids, pos, 2), 0);
	cr_assert_eq(kvr_dev_stream_begin_capture(ctx->dev, es), 0);
	cr_assert_eq(kvr_decode_layer_on(ctx, 0, ds->q[0], ds->k[0], ds->v[0], ds->o[0], st, es), 0, "%s",
		     kvr_last_error(ctx));
	cr_assert_eq(kvr_dev_stream_end_capture(ctx->dev, es, &g), 0, "%s", kvr_dev_last_error(ctx->dev));
	kvr_dev_graph_destroy(ctx->dev, g);
	cr_assert_eq(kvr_decode_layer_on(ctx, 1, ds->q[1], ds->k[1], ds->v[1], ds->o[1], st, NULL), -EINVAL);
	cr_assert(strstr(kvr_last_error(ctx), "captured all or none"), "%s", kvr_last_error(ctx));
	/* ... and a half-captured step cannot be replayed */
	cr_assert_eq(kvr_decode_end(ctx), -EINVAL);
	cr_assert_eq(replay_batch(ctx, dtype, ts, 2, (const float(*)[NL][Q_ROW])q, out, st, es, NULL), -EINVAL);
	/* a whole capture, replayed until a sequence passes the reservation */
	g = capture_step(ctx, ts, 2, es);
	int rc = 0;
	uint32_t replays = 0;
	while (!(rc = replay_batch(ctx, dtype, ts, 2, (const float(*)[NL][Q_ROW])q, out, st, es, g)))
		replays++;
	cr_assert_eq(rc, -ERANGE, "%s", kvr_last_error(ctx));
	cr_assert_eq(t[0].n, 3 * P, "replays stopped at %llu tokens", (unsigned long long)t[0].n);
	cr_assert_eq(replays, P - 1);
	uint64_t n;
	cr_assert_eq(kvr_seq_length(ctx, t[0].id, 1, &n), 0);
	cr_assert_eq(n, t[0].n, "a refused replay stored a token");
	/* an uncaptured step past the reservation moves the buffers: stale */
	int32_t st2[2][NL];
	for (uint32_t i = 0; i < P; i++) { /* to 4 full pages: past the 3 reserved */
		step_batch(ctx, dtype, ts, 2, (const float(*)[NL][Q_ROW])q, out, st2);
		cr_assert_eq(st2[0][0], 0);
	}
	cr_assert_eq(replay_batch(ctx, dtype, ts, 2, (const float(*)[NL][Q_ROW])q, out, st, es, g), -ESTALE);
	step_batch(ctx, dtype, ts, 2, (const float(*)[NL][Q_ROW])q, out, st2);
	cr_assert_eq(st2[0][0], 0, "the context is unusable after the refusals");
	kvr_dev_graph_destroy(ctx->dev, g);
	kvr_dev_stream_destroy(ctx->dev, es);
	ctx_close(ctx, &o);

	/* configurations that cannot be captured say why */
	o = opts_default(KVR_DEV_CUDAEMU_STRICT, KVR_MODE_FREEKV, KVR_RECALL_STREAMED, KVR_DTYPE_F16);
	o.kv_format = KVR_KV_FORMAT_K8V4;
	ctx = ctx_open(&o);
	cr_assert_eq(kvr_decode_reserve(ctx, 1, CAP), -ENOTSUP);
	cr_assert(strstr(kvr_last_error(ctx), "streamed recall of quantised pages"), "%s", kvr_last_error(ctx));
	ctx_close(ctx, &o);
	o = opts_default(KVR_DEV_CPU, KVR_MODE_DENSE, KVR_RECALL_ZERO_COPY, dtype);
	ctx = ctx_open(&o);
	cr_assert_eq(kvr_decode_reserve(ctx, 1, CAP), -ENOTSUP);
	cr_assert_eq(kvr_decode_replay(ctx, st, NULL), -EINVAL); /* no step open */
	ctx_close(ctx, &o);
	for (int i = 0; i < 2; i++)
		tseq_fini(&t[i]);
}
