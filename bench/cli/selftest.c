/* SPDX-License-Identifier: MIT */
/*
 * selftest.c — `kvrecall selftest`: does kvrecall work on this machine? One
 * command, one JSON verdict a user can attach to a report.
 *
 * On every backend present (cpu always; cuda when a GPU is usable) it runs:
 *   copies      host->device, device->device and batched device->host copies
 *               come back byte-exact;
 *   kernels     the conformance suite's checks against its scalar reference
 *               (gpu/reference/reference.c, compiled in): offload (NHD rows -> HND
 *               page) and scatter (HND run -> NHD slot) byte-exact, key
 *               summaries exact, attention over HND pages within
 *               reference.h's bound, scores within its tolerance and the
 *               selected pages identical to the reference's;
 *   recall      `bench recall --quick`: every recall variant byte-exact;
 *   decode      a short decode through the public API in every mode: with
 *               the budget holding the whole context each mode's output
 *               equals dense's bit for bit; beyond it every step succeeds
 *               with finite outputs (their distance from dense is reported).
 * On a GPU, when compute-sanitizer is installed, it runs itself again under
 * memcheck (--backend cuda --no-sanitizer) and records that verdict.
 *
 * selftest_backend() is also what tests/test_selftest.c runs on cudaemu.
 * Threads: the caller's (plus the contexts' controller threads in decode).
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvrecall.h"
#include "bench_cmd.h"
#include "../bench_common.h"
#include "../cli_args.h"
#include "selftest.h"
#include "../../gpu/backend.h"
#include "../../layouts/half.h"
#include "../../gpu/reference/reference.h"

/* ------------------------------------------------------------------ report */

static void add(struct selftest_report *r, const char *backend, const char *name, int ok, double seconds,
		const char *fmt, ...)
{
	if (r->n_checks == SELFTEST_MAX_CHECKS)
		return;
	struct selftest_check *c = &r->checks[r->n_checks++];
	snprintf(c->backend, sizeof(c->backend), "%s", backend);
	snprintf(c->name, sizeof(c->name), "%s", name);
	c->ok = ok;
	c->seconds = seconds;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(c->detail, sizeof(c->detail), fmt, ap);
	va_end(ap);
	r->failed += !ok;
}

/* ------------------------------------------------------------------ device buffers */

/* A host buffer with a device twin (the same pointer on host-visible devices). */
struct twin {
	unsigned char *host, *dev;
	size_t bytes;
};

struct env {
	struct kvr_dev *dev;
	struct kvr_stream *s;
	int visible;
	char why[512];
	struct twin bufs[32];
	uint32_t n_bufs;
};

static uint64_t rng_state = 0x853c49e6748fea9bull;
static uint64_t rng(void)
{
	return bench_xorshift(&rng_state);
}

static float frand(void)
{
	return (float)((int64_t)(rng() >> 40) - (1 << 23)) / (float)(1 << 23); /* [-1, 1) */
}

static struct twin *twin_new(struct env *e, size_t bytes)
{
	if (e->n_bufs == sizeof(e->bufs) / sizeof(e->bufs[0]))
		return NULL;
	struct twin *t = &e->bufs[e->n_bufs];
	t->bytes = bytes;
	t->host = calloc(1, bytes);
	if (!t->host)
		return NULL;
	if (e->visible) {
		t->dev = t->host;
	} else if (kvr_dev_alloc(e->dev, bytes, (void **)&t->dev)) {
		free(t->host);
		return NULL;
	}
	e->n_bufs++;
	return t;
}

static void twins_free(struct env *e)
{
	for (uint32_t i = 0; i < e->n_bufs; i++) {
		if (!e->visible)
			kvr_dev_free(e->dev, e->bufs[i].dev);
		free(e->bufs[i].host);
	}
	e->n_bufs = 0;
}

static int up(struct env *e, struct twin *t)
{
	if (e->visible)
		return 0;
	return kvr_dev_memcpy_async(e->dev, t->dev, t->host, t->bytes, KVR_COPY_H2D, e->s) ||
	       kvr_dev_stream_synchronize(e->dev, e->s);
}

static int down(struct env *e, struct twin *t)
{
	if (e->visible)
		return kvr_dev_stream_synchronize(e->dev, e->s);
	return kvr_dev_memcpy_async(e->dev, t->host, t->dev, t->bytes, KVR_COPY_D2H, e->s) ||
	       kvr_dev_stream_synchronize(e->dev, e->s);
}

/* A device pointer's host-side counterpart inside a twin (for the reference). */
static void *host_of(struct env *e, const void *dev_ptr)
{
	for (uint32_t i = 0; i < e->n_bufs; i++) {
		const unsigned char *d = e->bufs[i].dev;
		if ((const unsigned char *)dev_ptr >= d && (const unsigned char *)dev_ptr < d + e->bufs[i].bytes)
			return e->bufs[i].host + ((const unsigned char *)dev_ptr - d);
	}
	return NULL;
}

static void fill_f16(struct twin *t)
{
	uint16_t *h = (uint16_t *)t->host;
	for (size_t i = 0; i < t->bytes / 2; i++)
		h[i] = kvr_f32_to_f16(frand());
}

/* ------------------------------------------------------------------ checks */

#define FAIL(...)                                                     \
	do {                                                          \
		snprintf(e->why, sizeof(e->why), __VA_ARGS__);        \
		return -1;                                            \
	} while (0)
#define DEV(call)                                                                           \
	do {                                                                                \
		if ((call))                                                                 \
			FAIL("%s: %s", #call, kvr_dev_last_error(e->dev));                  \
	} while (0)

static int check_copies(struct env *e)
{
	const size_t bytes = 1u << 20, chunk = bytes / 64;
	struct twin *a = twin_new(e, bytes), *b = twin_new(e, bytes);
	unsigned char *src = malloc(bytes), *back = malloc(bytes);
	struct kvr_copy_desc descs[64];
	int rc = -1;
	if (!a || !b || !src || !back) {
		snprintf(e->why, sizeof(e->why), "out of memory");
		goto out;
	}
	for (size_t i = 0; i < bytes; i++)
		src[i] = (unsigned char)rng();
	/* H2D into a, D2D a -> b, then batched D2H of b's chunks in reverse order */
	for (uint32_t i = 0; i < 64; i++)
		descs[i] = (struct kvr_copy_desc){ (uint64_t)(63 - i) * chunk, (uint64_t)i * chunk, chunk };
	if (kvr_dev_memcpy_async(e->dev, a->dev, src, bytes, KVR_COPY_H2D, e->s) ||
	    kvr_dev_memcpy_async(e->dev, b->dev, a->dev, bytes, KVR_COPY_D2D, e->s) ||
	    kvr_dev_memcpy_batch_async(e->dev, back, b->dev, descs, 64, KVR_COPY_D2H, e->s) ||
	    kvr_dev_stream_synchronize(e->dev, e->s)) {
		snprintf(e->why, sizeof(e->why), "%s", kvr_dev_last_error(e->dev));
		goto out;
	}
	for (uint32_t i = 0; i < 64; i++)
		if (memcmp(back + i * chunk, src + (63 - i) * chunk, chunk)) {
			snprintf(e->why, sizeof(e->why), "chunk %u differs after H2D, D2D and batched D2H", i);
			goto out;
		}
	snprintf(e->why, sizeof(e->why), "1 MiB H2D, D2D, 64 batched D2H copies byte-exact");
	rc = 0;
out:
	free(src), free(back);
	twins_free(e);
	return rc;
}

/* The shape the kernel checks use: GQA-4, d = 64, p = 16, f16. */
enum { N_KV = 4, N_QO = 16, D = 64, P = 16, PAGES = 24, K_SEL = 6 };

static int check_kernels(struct env *e)
{
	const struct kvr_shape sh = { N_QO, N_KV, D, P, KVR_ELEM_F16, 0.125f, 0.9f, 0, 0, 0, 0 };
	const size_t row = (size_t)N_KV * D * 2, run = 2ull * P * D * 2, page = run * N_KV;
	struct twin *rows_k = twin_new(e, PAGES * P * row), *rows_v = twin_new(e, PAGES * P * row);
	struct twin *pages = twin_new(e, PAGES * page), *sums = twin_new(e, PAGES * 2 * row);
	struct twin *items = twin_new(e, PAGES * sizeof(struct kvr_page_item));
	struct twin *tiles = twin_new(e, 2 * (size_t)P * row);
	struct twin *sitems = twin_new(e, N_KV * sizeof(struct kvr_scatter_item));
	if (!rows_k || !rows_v || !pages || !sums || !items || !tiles || !sitems)
		FAIL("out of device or host memory");
	fill_f16(rows_k), fill_f16(rows_v);
	DEV(up(e, rows_k) || up(e, rows_v));
	/* offload + summarize every page on the device */
	struct kvr_page_item *pi = (struct kvr_page_item *)items->host;
	for (uint32_t j = 0; j < PAGES; j++)
		pi[j] = (struct kvr_page_item){ rows_k->dev + j * P * row, rows_v->dev + j * P * row,
						pages->dev + j * page, sums->dev + j * 2 * row, N_KV * D, 0 };
	DEV(up(e, items));
	DEV(kvr_dev_offload(e->dev, &sh, (const struct kvr_page_item *)items->dev, PAGES, e->s));
	DEV(kvr_dev_summarize(e->dev, &sh, (const struct kvr_page_item *)items->dev, PAGES, e->s));
	DEV(down(e, pages) || down(e, sums));
	/* the reference, through host pointers, into scratch */
	unsigned char *want_pages = malloc(PAGES * page), *want_sums = malloc(PAGES * 2 * row);
	if (!want_pages || !want_sums) {
		free(want_pages), free(want_sums);
		FAIL("out of memory");
	}
	struct kvr_page_item hpi[PAGES];
	for (uint32_t j = 0; j < PAGES; j++)
		hpi[j] = (struct kvr_page_item){ rows_k->host + j * P * row, rows_v->host + j * P * row,
						 want_pages + j * page, want_sums + j * 2 * row, N_KV * D, 0 };
	ref_offload(&sh, hpi, PAGES);
	ref_summarize(&sh, hpi, PAGES);
	const int pages_ok = !memcmp(want_pages, pages->host, PAGES * page);
	const int sums_ok = !memcmp(want_sums, sums->host, PAGES * 2 * row);
	free(want_pages), free(want_sums);
	if (!pages_ok)
		FAIL("offload: HND pages differ from the reference");
	if (!sums_ok)
		FAIL("summarize: key summaries differ from the reference");

	/* scatter page 5's runs into one NHD tile pair, then compare with the reference */
	struct kvr_scatter_item *si = (struct kvr_scatter_item *)sitems->host;
	for (uint32_t m = 0; m < N_KV; m++)
		si[m] = (struct kvr_scatter_item){ pages->dev + 5 * page + m * run, tiles->dev,
						   tiles->dev + (size_t)P * row, m, 0 };
	DEV(up(e, sitems));
	DEV(kvr_dev_scatter(e->dev, &sh, (const struct kvr_scatter_item *)sitems->dev, N_KV, e->s));
	DEV(down(e, tiles));
	unsigned char *want_tiles = calloc(2, (size_t)P * row);
	if (!want_tiles)
		FAIL("out of memory");
	struct kvr_scatter_item hsi[N_KV];
	for (uint32_t m = 0; m < N_KV; m++)
		hsi[m] = (struct kvr_scatter_item){ pages->host + 5 * page + m * run, want_tiles,
						    want_tiles + (size_t)P * row, m, 0 };
	ref_scatter(&sh, hsi, N_KV);
	const int tiles_ok = !memcmp(want_tiles, tiles->host, 2 * (size_t)P * row);
	free(want_tiles);
	if (!tiles_ok)
		FAIL("scatter: NHD slots differ from the reference");

	/* attention: per KV head, its G query heads over every page (HND segments) */
	const uint32_t G = N_QO / N_KV;
	const struct kvr_shape hs = { G, 1, D, P, KVR_ELEM_F16, 0.125f, 0.9f, 0, 0, 0, 0 };
	struct twin *q = twin_new(e, (size_t)N_QO * D * 2), *out = twin_new(e, (size_t)N_QO * D * 2);
	struct twin *segs = twin_new(e, (size_t)N_KV * PAGES * sizeof(struct kvr_kv_segment));
	struct twin *aitems = twin_new(e, N_KV * sizeof(struct kvr_attention_item));
	if (!q || !out || !segs || !aitems)
		FAIL("out of device or host memory");
	fill_f16(q);
	struct kvr_kv_segment *sg = (struct kvr_kv_segment *)segs->host;
	struct kvr_attention_item *ai = (struct kvr_attention_item *)aitems->host;
	for (uint32_t m = 0; m < N_KV; m++) {
		for (uint32_t j = 0; j < PAGES; j++) {
			const unsigned char *r = pages->dev + j * page + m * run;
			/* the last page half full, as a sequence's tail is */
			sg[m * PAGES + j] = (struct kvr_kv_segment){ r, r + (size_t)P * D * 2,
								     j + 1 == PAGES ? P / 2 : P, { D }, 0, 0 };
		}
		ai[m] = (struct kvr_attention_item){ q->dev + (size_t)m * G * D * 2, out->dev + (size_t)m * G * D * 2,
						     NULL, m * PAGES, PAGES };
	}
	DEV(up(e, q) || up(e, segs) || up(e, aitems));
	DEV(kvr_dev_attention(e->dev, &hs, (const struct kvr_attention_item *)aitems->dev, N_KV,
			      (const struct kvr_kv_segment *)segs->dev, N_KV * PAGES, e->s));
	DEV(down(e, out));
	/* the reference reads host memory: the same segments with host pointers */
	struct kvr_kv_segment hsg[N_KV * PAGES];
	for (uint32_t i = 0; i < N_KV * PAGES; i++) {
		hsg[i] = sg[i];
		hsg[i].k = host_of(e, sg[i].k);
		hsg[i].v = host_of(e, sg[i].v);
	}
	double worst = 0;
	for (uint32_t m = 0; m < N_KV; m++) {
		struct kvr_attention_item hai = { q->host + (size_t)m * G * D * 2, NULL, NULL, m * PAGES, PAGES };
		double ref[N_QO / N_KV * D];
		struct ref_head_scale scale[N_QO / N_KV];
		ref_attention(&hs, &hai, hsg, ref, scale);
		for (uint32_t h = 0; h < G; h++) {
			const double bound = ref_attention_bound(KVR_ELEM_F16, &scale[h]);
			for (uint32_t c = 0; c < D; c++) {
				const double got = ref_load(out->host, KVR_ELEM_F16, ((uint64_t)m * G + h) * D + c);
				const double err = fabs(got - ref[h * D + c]);
				if (!(err <= bound))
					FAIL("attention: KV head %u, query head %u, element %u: %.6g against the "
					     "reference's %.6g (bound %.3g)",
					     m, h, c, got, ref[h * D + c], bound);
				worst = err / bound > worst ? err / bound : worst;
			}
		}
	}

	/* score + select: k pages of the candidates per KV head, each head's
	 * softmax over every page as the scheduler does */
	struct twin *scores = twin_new(e, (size_t)N_KV * PAGES * sizeof(float));
	struct twin *sel = twin_new(e, (size_t)N_KV * K_SEL * sizeof(int32_t));
	struct twin *scitem = twin_new(e, sizeof(struct kvr_score_item));
	if (!scores || !sel || !scitem)
		FAIL("out of device or host memory");
	*(struct kvr_score_item *)scitem->host = (struct kvr_score_item){
		q->dev, sums->dev, (float *)scores->dev, (int32_t *)sel->dev, 1, PAGES - 1, K_SEL, PAGES, NULL };
	DEV(up(e, scitem));
	DEV(kvr_dev_score(e->dev, &sh, (const struct kvr_score_item *)scitem->dev, 1, e->s));
	DEV(kvr_dev_select(e->dev, &sh, (const struct kvr_score_item *)scitem->dev, 1, e->s));
	DEV(down(e, scores) || down(e, sel));
	const uint32_t n_cand = PAGES - 2;
	double ref_scores[N_KV * PAGES];
	struct kvr_score_item hitem = { q->host, sums->host, (float *)scores->host, NULL, 1, PAGES - 1, K_SEL, PAGES, NULL };
	ref_score(&sh, &hitem, ref_scores);
	for (uint32_t i = 0; i < N_KV * n_cand; i++) {
		const double got = ((const float *)scores->host)[i], want = ref_scores[i];
		if (fabs(want) > REF_SCORE_ABS_TOL && !(fabs(got - want) <= REF_SCORE_REL_TOL * fabs(want)))
			FAIL("score: candidate %u: %.9g against the reference's %.9g", i, got, want);
	}
	/* selection on the backend's own scores must be what the reference selects from them */
	int32_t want_sel[N_KV * K_SEL];
	hitem.selected = want_sel;
	ref_select(&sh, &hitem, 1);
	if (memcmp(want_sel, sel->host, sizeof(want_sel)))
		FAIL("select: the selected pages differ from the reference's");
	snprintf(e->why, sizeof(e->why),
		 "offload, summarize, scatter byte-exact; attention within %.2f of reference.h's bound; "
		 "scores within %.0e; selection identical",
		 worst, REF_SCORE_REL_TOL);
	twins_free(e);
	return 0;
}

/* A short decode through the public API in every mode (see the header). */
static int check_decode(uint32_t backend, struct kvr_dev *io_dev, char *why, size_t why_bytes)
{
	enum { L = 4, NQ = 8, NK = 2, HD = 64, PT = 16, CONTEXT = 256, STEPS = 6 };
	static const uint32_t modes[] = { KVR_MODE_DENSE, KVR_MODE_BLOCKING, KVR_MODE_SPECULATIVE, KVR_MODE_FREEKV };
	const size_t q_bytes = NQ * HD * 2, kv_bytes = NK * HD * 2;
	uint16_t *k = malloc((size_t)CONTEXT * kv_bytes), *v = malloc((size_t)CONTEXT * kv_bytes);
	uint16_t *q = malloc((size_t)STEPS * q_bytes), *ks = malloc((size_t)STEPS * kv_bytes);
	uint16_t *out[2][4];
	void *dq = NULL, *dk = NULL, *dv = NULL, *dout = NULL;
	struct kvr_stream *io_s = NULL;
	int rc = -1;
	memset(out, 0, sizeof(out));
	for (int b = 0; b < 2; b++)
		for (int m = 0; m < 4; m++)
			out[b][m] = malloc((size_t)STEPS * L * q_bytes);
	for (size_t i = 0; i < (size_t)CONTEXT * NK * HD; i++)
		k[i] = kvr_f32_to_f16(frand()), v[i] = kvr_f32_to_f16(frand());
	for (size_t i = 0; i < (size_t)STEPS * NQ * HD; i++)
		q[i] = kvr_f32_to_f16(2 * frand());
	for (size_t i = 0; i < (size_t)STEPS * NK * HD; i++)
		ks[i] = kvr_f32_to_f16(frand());
	if (io_dev && (kvr_dev_stream_wrap(io_dev, NULL, &io_s) || kvr_dev_alloc(io_dev, q_bytes, &dq) ||
		       kvr_dev_alloc(io_dev, kv_bytes, &dk) || kvr_dev_alloc(io_dev, kv_bytes, &dv) ||
		       kvr_dev_alloc(io_dev, q_bytes, &dout))) {
		snprintf(why, why_bytes, "engine buffers: %s", kvr_dev_last_error(io_dev));
		goto out;
	}
	/* budget 0: holds everything (B = 512 >= 262 tokens); 1: B = 64 (sparse) */
	double max_rel[4] = { 0 };
	for (int b = 0; b < 2; b++)
		for (int mi = 0; mi < 4; mi++) {
			struct kvr_config c;
			kvr_config_init(&c);
			c.n_layers = L, c.n_qo_heads = NQ, c.n_kv_heads = NK, c.head_dim = HD, c.page_tokens = PT;
			c.budget_tokens = b ? 64 : 512, c.sink_tokens = b ? 16 : 0, c.window_tokens = b ? 16 : 0;
			c.mode = modes[mi], c.backend = backend, c.threads = 0;
			c.max_sequences = 1, c.max_batch = 1, c.pool_bytes = 4u << 20;
			c.dense_layers[0] = 0;
			struct kvr_context *ctx;
			if (kvr_context_create(&c, &ctx)) {
				snprintf(why, why_bytes, "%s: %s", kvr_mode_name(modes[mi]), kvr_last_error(NULL));
				goto out;
			}
			uint32_t seq;
			int err = kvr_seq_create(ctx, &seq);
			for (uint32_t l = 0; !err && l < L; l++)
				err = kvr_prefill(ctx, seq, l, 0, CONTEXT, k, v);
			for (uint32_t s = 0; !err && s < STEPS; s++) {
				const uint64_t pos = CONTEXT + s;
				err = kvr_decode_begin(ctx, &seq, &pos, 1);
				for (uint32_t l = 0; !err && l < L; l++) {
					int32_t status = 0;
					const void *lq = q + (size_t)s * NQ * HD, *lk = ks + (size_t)s * NK * HD;
					void *lout = out[b][mi] + ((size_t)s * L + l) * NQ * HD;
					if (io_dev) {
						err = kvr_dev_memcpy_async(io_dev, dq, lq, q_bytes, KVR_COPY_H2D, io_s) ||
						      kvr_dev_memcpy_async(io_dev, dk, lk, kv_bytes, KVR_COPY_H2D, io_s) ||
						      kvr_dev_memcpy_async(io_dev, dv, lk, kv_bytes, KVR_COPY_H2D, io_s);
						if (!err)
							err = kvr_decode_layer(ctx, l, dq, dk, dv, dout, &status, NULL);
						if (!err)
							err = kvr_dev_memcpy_async(io_dev, lout, dout, q_bytes, KVR_COPY_D2H, io_s) ||
							      kvr_dev_stream_synchronize(io_dev, io_s);
					} else {
						err = kvr_decode_layer(ctx, l, lq, lk, lk, lout, &status, NULL);
					}
					err = err ? err : status;
				}
				if (!err)
					err = kvr_decode_end(ctx);
			}
			if (err)
				snprintf(why, why_bytes, "%s, B = %u: %s (%s)", kvr_mode_name(modes[mi]), c.budget_tokens,
					 kvr_last_error(ctx), kvr_strerror(err));
			kvr_context_destroy(ctx);
			if (err)
				goto out;
		}
	for (int mi = 1; mi < 4; mi++) {
		if (memcmp(out[0][mi], out[0][0], (size_t)STEPS * L * q_bytes)) {
			snprintf(why, why_bytes, "%s differs from dense with the whole context inside the budget",
				 kvr_mode_name(modes[mi]));
			goto out;
		}
		for (size_t i = 0; i < (size_t)STEPS * L * NQ * HD; i++) {
			const double got = kvr_f16_to_f32(out[1][mi][i]), ref = kvr_f16_to_f32(out[1][0][i]);
			if (!isfinite(got)) {
				snprintf(why, why_bytes, "%s, B = 64: output %zu is not finite", kvr_mode_name(modes[mi]), i);
				goto out;
			}
			const double rel = fabs(got - ref) / (fabs(ref) + 0.05);
			max_rel[mi] = rel > max_rel[mi] ? rel : max_rel[mi];
		}
	}
	snprintf(why, why_bytes,
		 "B >= context: blocking, speculative and freekv equal dense bit for bit; B = 64 of 262 "
		 "tokens: finite, largest difference from dense %.2f / %.2f / %.2f (of |dense| + 0.05)",
		 max_rel[1], max_rel[2], max_rel[3]);
	rc = 0;
out:
	if (io_dev) {
		kvr_dev_free(io_dev, dq), kvr_dev_free(io_dev, dk), kvr_dev_free(io_dev, dv), kvr_dev_free(io_dev, dout);
		if (io_s)
			kvr_dev_stream_destroy(io_dev, io_s);
	}
	for (int b = 0; b < 2; b++)
		for (int m = 0; m < 4; m++)
			free(out[b][m]);
	free(k), free(v), free(q), free(ks);
	return rc;
}

int selftest_backend(uint32_t dev_kind, const char *backend_name, struct selftest_report *r)
{
	const struct kvr_dev_params params = { .kind = dev_kind, .threads = 1 };
	struct env e = { 0 };
	char err[256] = "";
	double t0 = bench_now_s();
	int rc = kvr_dev_create(&params, &e.dev, err, sizeof(err));
	if (rc) {
		add(r, backend_name, "open", 0, bench_now_s() - t0, "%s", err);
		return rc;
	}
	e.visible = kvr_dev_host_visible(e.dev);
	if (kvr_dev_stream_create(e.dev, KVR_STREAM_INLINE, &e.s)) {
		add(r, backend_name, "open", 0, bench_now_s() - t0, "stream: %s", kvr_dev_last_error(e.dev));
		kvr_dev_destroy(e.dev);
		return -EIO;
	}
	t0 = bench_now_s();
	int ok = !check_copies(&e);
	add(r, backend_name, "copies", ok, bench_now_s() - t0, "%s", e.why);
	twins_free(&e);
	t0 = bench_now_s();
	ok = !check_kernels(&e);
	add(r, backend_name, "kernels", ok, bench_now_s() - t0, "%s", e.why);
	twins_free(&e);
	kvr_dev_stream_destroy(e.dev, e.s);
	kvr_dev_destroy(e.dev);
	/* decode through the public API: cpu and cuda are public backends */
	if (dev_kind == KVR_DEV_CPU || dev_kind == KVR_DEV_CUDA) {
		struct kvr_dev *io = NULL;
		char why[512] = "";
		if (dev_kind == KVR_DEV_CUDA) {
			const struct kvr_dev_params io_params = { .kind = KVR_DEV_CUDA };
			kvr_dev_create(&io_params, &io, why, sizeof(why));
		}
		t0 = bench_now_s();
		ok = (dev_kind == KVR_DEV_CPU || io) &&
		     !check_decode(dev_kind == KVR_DEV_CUDA ? KVR_BACKEND_CUDA : KVR_BACKEND_CPU, io, why, sizeof(why));
		add(r, backend_name, "decode", ok, bench_now_s() - t0, "%s", why);
		if (io)
			kvr_dev_destroy(io);
	}
	return 0;
}

/* ------------------------------------------------------------------ the command */

static int run_quiet(const char *self, const char *args, char *tail, size_t tail_bytes)
{
	char cmd[1024];
	snprintf(cmd, sizeof(cmd), "'%s' %s 2>&1", self, args);
	FILE *f = popen(cmd, "r");
	if (!f)
		return -1;
	size_t n = 0;
	char line[512];
	tail[0] = 0;
	while (fgets(line, sizeof(line), f)) { /* keep the last lines */
		const size_t l = strlen(line);
		if (n + l + 1 > tail_bytes)
			n = 0;
		memcpy(tail + n, line, l + 1);
		n += l;
	}
	return pclose(f);
}

#define SELFTEST_CMD "kvrecall selftest"

static void selftest_usage(FILE *f)
{
	fprintf(f, "usage: kvrecall selftest [--backend cpu|cuda] [--no-sanitizer] [--json FILE]\n"
		   "  Does kvrecall work here? Every backend present (or only --backend's) is\n"
		   "  checked: copies, kernels, decode and recall, and on cuda compute-sanitizer's\n"
		   "  memcheck unless --no-sanitizer. One verdict; exit status 1 when a check fails.\n"
		   "  --json FILE   the verdict and every check as JSON (default: stdout)\n");
}

int selftest_main(int argc, char **argv, const char *self)
{
	static const char *const backend_names[] = { "cpu", "cuda", NULL };
	const char *json_path = NULL, *only = NULL;
	int sanitizer = 1;
	uint32_t backend_index = 0;
	for (int i = 0; i < argc; i++) {
		if (cli_is_help(argv[i])) {
			selftest_usage(stdout);
			return CLI_EXIT_OK;
		}
		if (!strcmp(argv[i], "--no-sanitizer")) {
			sanitizer = 0;
			continue;
		}
		CLI_TAKE(cli_opt_str(SELFTEST_CMD, argc, argv, &i, "--json", &json_path))
		const int taken = cli_opt_choice(SELFTEST_CMD, argc, argv, &i, "--backend", backend_names, &backend_index);
		if (taken > 0)
			only = backend_names[backend_index];
		CLI_TAKE(taken)
		return cli_usage_error(SELFTEST_CMD, "unknown option '%s'", argv[i]);
	}
	static struct selftest_report r;
	memset(&r, 0, sizeof(r));
	struct kvr_system_info s = { .size = sizeof(s) };
	kvr_system_query(&s);
	const int want_cpu = !only || !strcmp(only, "cpu"), want_cuda = !only ? s.n_gpus > 0 : !strcmp(only, "cuda");
	for (int b = 0; b < 2; b++) {
		const int cuda = b == 1;
		if (!(cuda ? want_cuda : want_cpu))
			continue;
		const char *name = cuda ? "cuda" : "cpu";
		fprintf(stderr, "kvrecall selftest: %s backend...\n", name);
		if (selftest_backend(cuda ? KVR_DEV_CUDA : KVR_DEV_CPU, name, &r))
			continue; /* it could not be opened: recorded, nothing more to run */
		/* recall: every variant byte-exact (bench recall fails otherwise) */
		char args[256], tail[2048];
		char tmp[] = "/tmp/kvr_selftest_XXXXXX";
		const int fd = mkstemp(tmp);
		if (fd >= 0)
			close(fd);
		snprintf(args, sizeof(args), "bench recall --backend %s --quick --reps 1 --json %s", name, tmp);
		double t0 = bench_now_s();
		const int rrc = fd >= 0 ? run_quiet(self, args, tail, sizeof(tail)) : -1;
		tail[strcspn(tail, "\n")] = 0;
		add(&r, name, "recall", rrc == 0, bench_now_s() - t0, "%s",
		    rrc == 0 ? "every variant (HND, NHD, 1 and 2 buffers, zero-copy) byte-exact" : tail);
		if (fd >= 0)
			unlink(tmp);
		if (cuda && sanitizer) {
			const int have = system("command -v compute-sanitizer > /dev/null 2>&1") == 0;
			if (!have) {
				add(&r, name, "compute-sanitizer", 1, 0, "skipped: compute-sanitizer is not installed");
			} else {
				char cmd[1024];
				snprintf(cmd, sizeof(cmd),
					 "compute-sanitizer --tool memcheck --error-exitcode 9 '%s' selftest --backend cuda "
					 "--no-sanitizer 2>&1",
					 self);
				t0 = bench_now_s();
				FILE *f = popen(cmd, "r");
				char line[512], summary[512] = "";
				while (f && fgets(line, sizeof(line), f))
					if (strstr(line, "ERROR SUMMARY"))
						snprintf(summary, sizeof(summary), "%s", line);
				const int src = f ? pclose(f) : -1;
				summary[strcspn(summary, "\n")] = 0;
				add(&r, name, "compute-sanitizer", src == 0, bench_now_s() - t0, "memcheck: %s",
				    summary[0] ? summary : "no summary");
			}
		}
	}
	if (!want_cuda && !only)
		add(&r, "cuda", "present", 1, 0, "skipped: %s", s.n_gpus ? "" : s.gpu_reason);
	for (uint32_t i = 0; i < r.n_checks; i++)
		fprintf(stderr, "  %-5s %-18s %s  %s\n", r.checks[i].backend, r.checks[i].name,
			r.checks[i].ok ? "ok  " : "FAIL", r.checks[i].detail);
	fprintf(stderr, "kvrecall selftest: %s (%u checks, %u failed)\n", r.failed ? "FAILED" : "passed", r.n_checks,
		r.failed);
	FILE *f = json_path ? fopen(json_path, "w") : stdout;
	if (!f) {
		fprintf(stderr, "kvrecall selftest: cannot write %s: %s\n", json_path, strerror(errno));
		return 1;
	}
	bench_json_open(f, "selftest", only ? only : (want_cuda ? "cpu,cuda" : "cpu"), argc, argv);
	fprintf(f, "  \"verdict\": \"%s\",\n  \"checks\": [\n", r.failed ? "fail" : "pass");
	for (uint32_t i = 0; i < r.n_checks; i++) {
		fprintf(f, "    {\"backend\": \"%s\", \"check\": \"%s\", \"ok\": %s, \"seconds\": %.3f, \"detail\": ",
			r.checks[i].backend, r.checks[i].name, r.checks[i].ok ? "true" : "false", r.checks[i].seconds);
		bench_json_string(f, r.checks[i].detail);
		fprintf(f, "}%s\n", i + 1 < r.n_checks ? "," : "");
	}
	fprintf(f, "  ]\n");
	bench_json_close(f);
	return r.failed ? 1 : 0;
}
