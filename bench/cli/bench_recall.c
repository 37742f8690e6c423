/* SPDX-License-Identifier: MIT */
/*
 * bench_recall.c — `kvrecall bench recall`: how long one layer's recall takes
 * on this machine, for a model shape, budget, batch size and miss rate,
 * measured on the scheduler's own recall code (scheduler/recall.c).
 *
 * For each pool format (f16 pages in HND, the NHD-pool ablation, K8V4, K4V2)
 * a one-layer context is made with `batch` sequences, streamed recall and the
 * largest budget asked for, and every sequence is prefilled with distinct
 * random keys and values until the pool holds --pool-mib (beyond any
 * last-level cache). Then, for each budget B (k = (B − S − W)/p pages a head),
 * staging-buffer count and chunk size, the bench writes each lane's selection
 * as the controller's select kernel would (k ascending pages per KV head) and
 * calls kvr_recall_issue on every lane, as the controller does: it plans hits
 * and misses against the lane's slot table, then moves the misses in chunks
 * through the staging buffers (copy stream) into their slots (convert stream),
 * or for quantised pages straight into the device page cache's units. A timed
 * round first swaps round(k · miss rate) of each head's pages for pages it
 * does not hold, so misses = batch · KV heads · that; the time runs from the
 * first issue to the last lane's recall_done event.
 *
 * Before anything is timed, every variant recalls a fresh selection and then
 * one round of misses, and after each every slot is read back and compared
 * byte for byte with its page in the pool; a mismatch fails the command.
 * Reported: the median of --reps rounds, its bandwidth, and that bandwidth ÷
 * the peak pinned host->device copy rate measured in the same run (as
 * `bench copy` measures it).
 *
 * --trace FILE: the scheduler's own trace (kvr_trace_start) of one more round
 * of the two-buffer HND variant at the first budget and chunk size: each
 * chunk's copy and scatter on its stream.
 *
 * Threads: the caller's, which plays the controller (no decode step runs, so
 * it owns every lane); the copy and convert streams are the scheduler's
 * worker streams, so they overlap on the cpu backend too.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrecall.h"
#include "bench_cmd.h"
#include "../bench_common.h"
#include "../bench_shape.h"
#include "../cli_args.h"
#include "../../gpu/backend.h"
#include "../../host/pool.h"
#include "../../layouts/half.h"
#include "../../layouts/kvquant.h"
#include "../../runtime/internal.h"
#include "../../scheduler/sched_impl.h"

#define RECALL_CMD "kvrecall bench recall"

enum { POOL_HND, POOL_NHD, POOL_K8V4, POOL_K4V2, N_POOLS };

static const char *const pool_names[N_POOLS] = { "hnd", "nhd", "k8v4", "k4v2" };

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static uint64_t rng(void)
{
	return bench_xorshift(&rng_state);
}

/* One pool format's context, its sequences prefilled; the caller's thread
 * plays the controller on its lanes. */
struct format_env {
	uint32_t pool;
	struct kvr_context *ctx;
	struct kvr_sched *s;
	uint32_t batch, n_pages; /* sequences, full pages in each */
	uint8_t *all_heads;      /* [n_kv] all 1: recall every head */
	unsigned char *back;     /* a slot or unit read back */
};

static int sched_fail(const struct format_env *f, const char *what, int err)
{
	const char *why = f->s->last_error[0] ? f->s->last_error : kvr_dev_last_error(f->s->dev);
	fprintf(stderr, "kvrecall bench recall: %s pool: %s: %s (%d)\n", pool_names[f->pool], what,
		why[0] ? why : "failed", err);
	return err ? err : -EIO;
}

/* Distinct random f16 values in [-1, 1], two per row stamped with the token's
 * position so that no two rows of a sequence are alike. */
static void fill_rows(uint16_t *rows, uint64_t first_pos, uint32_t n_tokens, uint32_t row_elems,
		      uint32_t salt)
{
	for (uint32_t t = 0; t < n_tokens; t++) {
		uint16_t *r = rows + (uint64_t)t * row_elems;
		for (uint32_t i = 0; i < row_elems; i++)
			r[i] = kvr_f32_to_f16((float)(int32_t)(rng() % 2001 - 1000) / 1000.0f);
		const uint64_t pos = first_pos + t;
		r[0] = kvr_f32_to_f16((float)(pos & 1023));
		r[1] = kvr_f32_to_f16((float)((pos >> 10 & 1023) ^ salt));
	}
}

static void format_close(struct format_env *f)
{
	kvr_context_destroy(f->ctx);
	free(f->all_heads);
	free(f->back);
	memset(f, 0, sizeof(*f));
}

/* The context of pool format f->pool, its sequences prefilled with n_pages
 * full pages each. */
static int format_open(struct format_env *f, const char *backend, const struct bench_shape *sh,
		       uint32_t batch, uint32_t budget, uint32_t sink, uint32_t window, uint32_t n_pages)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_layers = 1, c.n_qo_heads = sh->n_qo_heads, c.n_kv_heads = sh->n_kv_heads;
	c.head_dim = sh->head_dim, c.page_tokens = sh->page_tokens, c.dtype = KVR_DTYPE_F16;
	c.budget_tokens = budget, c.sink_tokens = sink, c.window_tokens = window;
	c.mode = KVR_MODE_BLOCKING, c.recall = KVR_RECALL_STREAMED;
	c.max_sequences = c.max_batch = batch;
	c.pool_layout = f->pool == POOL_NHD ? KVR_POOL_NHD : KVR_POOL_HND;
	c.kv_format = f->pool == POOL_K8V4   ? KVR_KV_FORMAT_K8V4
		      : f->pool == POOL_K4V2 ? KVR_KV_FORMAT_K4V2
					     : KVR_KV_FORMAT_PLAIN;
	c.dense_layers[0] = 0; /* the one layer is sparse: it has a page cache */
	c.backend = !strcmp(backend, "cpu") ? KVR_BACKEND_CPU : !strcmp(backend, "cuda") ? KVR_BACKEND_CUDA : KVR_BACKEND_AUTO;
	if (c.backend == KVR_BACKEND_AUTO && strcmp(backend, "auto")) {
		cli_bad_choice(RECALL_CMD, "--backend", backend, cli_backend_names);
		return -EINVAL;
	}
	const uint64_t token_bytes = 2ull * sh->n_kv_heads * sh->head_dim * 2;
	c.pool_bytes = (uint64_t)batch * (n_pages + 2) * sh->page_tokens * token_bytes;
	int err = kvr_context_create(&c, &f->ctx);
	if (err) {
		fprintf(stderr, "kvrecall bench recall: %s pool: %s\n", pool_names[f->pool], kvr_last_error(NULL));
		return err;
	}
	f->s = f->ctx->sched;
	f->batch = batch, f->n_pages = n_pages;
	f->all_heads = malloc(sh->n_kv_heads);
	f->back = malloc(f->s->tile_bytes > f->s->head_bytes ? f->s->tile_bytes : f->s->head_bytes);
	if (!f->all_heads || !f->back)
		return -ENOMEM;
	memset(f->all_heads, 1, sh->n_kv_heads);
	const uint32_t row_elems = sh->n_kv_heads * sh->head_dim, chunk = 4 * sh->page_tokens;
	uint16_t *k = malloc((size_t)chunk * row_elems * 2), *v = malloc((size_t)chunk * row_elems * 2);
	if (!k || !v)
		err = -ENOMEM;
	for (uint32_t q = 0; !err && q < batch; q++) {
		uint32_t seq;
		if ((err = kvr_seq_create(f->ctx, &seq)))
			break;
		const uint64_t tokens = (uint64_t)n_pages * sh->page_tokens;
		for (uint64_t at = 0; !err && at < tokens; at += chunk) {
			const uint32_t n = (uint32_t)(tokens - at < chunk ? tokens - at : chunk);
			fill_rows(k, at, n, row_elems, 2 * q);
			fill_rows(v, at, n, row_elems, 2 * q + 1);
			err = kvr_prefill(f->ctx, seq, 0, at, n, k, v);
		}
	}
	free(k), free(v);
	if (err)
		fprintf(stderr, "kvrecall bench recall: %s pool: prefill: %s\n", pool_names[f->pool],
			kvr_last_error(f->ctx));
	return err;
}

/* ------------------------------------------------------------------ selections */

static int has_page(const int32_t *sel, uint32_t k, int32_t page)
{
	for (uint32_t j = 0; j < k; j++)
		if (sel[j] == page)
			return 1;
	return 0;
}

static int by_page(const void *a, const void *b)
{
	const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
	return (x > y) - (x < y);
}

/* Each lane's selection as the select kernel writes it: k_b distinct pages a
 * KV head, ascending, then -1 up to s->k. fresh: all new; otherwise n_swap
 * of the held pages swapped for pages not held. */
static void write_selections(struct format_env *f, uint32_t k_b, uint32_t n_swap, int fresh)
{
	const uint32_t n_kv = f->s->c.n_kv_heads, k = f->s->k;
	for (uint32_t q = 0; q < f->batch; q++) {
		struct kvr_lane *lane = lane_of(f->s, q, 0);
		for (uint32_t m = 0; m < n_kv; m++) {
			int32_t *sel = lane->selected + (uint64_t)m * k;
			if (fresh)
				for (uint32_t j = 0; j < k; j++)
					sel[j] = -1;
			for (uint32_t i = 0; i < (fresh ? k_b : n_swap); i++) {
				int32_t page;
				do
					page = (int32_t)(rng() % f->n_pages);
				while (has_page(sel, k_b, page));
				sel[fresh ? i : (uint32_t)(rng() % k_b)] = page;
			}
			qsort(sel, k_b, sizeof(*sel), by_page);
		}
	}
}

/* Every lane's recall issued as the controller issues it, then waited for:
 * the seconds from the first issue to the last recall_done. */
static int recall_round(struct format_env *f, double *seconds)
{
	const double t0 = bench_now_s();
	for (uint32_t q = 0; q < f->batch; q++) {
		const int err = kvr_recall_issue(f->s, lane_of(f->s, q, 0), f->all_heads);
		if (err)
			return sched_fail(f, "recall", err);
	}
	for (uint32_t q = 0; q < f->batch; q++) {
		const int err = kvr_dev_event_synchronize(f->s->dev, lane_of(f->s, q, 0)->recall_done);
		if (err)
			return sched_fail(f, "recall_done", err);
	}
	if (seconds)
		*seconds = bench_now_s() - t0;
	return 0;
}

/* ------------------------------------------------------------------ checks */

/* len bytes of device memory at src into f->back. */
static int read_back(struct format_env *f, const void *src, size_t len)
{
	int err = kvr_dev_memcpy_async(f->s->dev, f->back, src, len, KVR_COPY_D2H, f->s->convert);
	if (!err)
		err = kvr_dev_stream_synchronize(f->s->dev, f->s->convert);
	return err ? sched_fail(f, "reading a slot back", err) : 0;
}

/* Row r (< 2p: keys, then values) of KV head m in a pool page. */
static const unsigned char *pool_row(const struct format_env *f, const unsigned char *page, uint32_t m,
				     uint32_t r)
{
	const struct kvr_sched *s = f->s;
	const uint64_t row = (uint64_t)s->c.head_dim * s->eb;
	if (f->pool == POOL_NHD) /* token-major: key rows of every head, then value rows */
		return page + ((uint64_t)r * s->c.n_kv_heads + m) * row;
	return page + (uint64_t)m * s->head_bytes + (uint64_t)r * row;
}

/* Slot j of head m of one lane holds its page: tiles (plain pages: head m's
 * column of the key and value tiles) or the unit's run (quantised). */
static int check_slot(struct format_env *f, struct kvr_lane *lane, uint32_t m, uint32_t j)
{
	struct kvr_sched *s = f->s;
	const int32_t logical = lane->slot_page[(uint64_t)m * s->k + j];
	uint32_t id;
	if (logical < 0)
		return 0;
	if (kvr_pool_lookup(s->pool, lane->seq, 0, (uint32_t)logical, &id))
		return sched_fail(f, "a slot holds a page the sequence does not have", -EINVAL);
	const unsigned char *page = kvr_pool_page_data(s->pool, id);
	int err = 0;
	if (s->kv_format) {
		const int32_t unit = lane->slot_unit[((uint64_t)m * s->k + j) * s->units_per_slot];
		const uint64_t run = kvr_kv_run_bytes(s->kv_format, s->c.page_tokens, s->c.head_dim, s->eb);
		if (unit < 0)
			return sched_fail(f, "a held page has no unit", -EINVAL);
		if (!(err = read_back(f, kvr_units_addr(s, (uint32_t)unit), run)) &&
		    memcmp(f->back, page + (uint64_t)m * run, run))
			err = -EBADMSG;
	} else {
		const uint64_t row = (uint64_t)s->c.head_dim * s->eb, p = s->c.page_tokens;
		for (uint32_t half = 0; !err && half < 2; half++) {
			const unsigned char *tile = (half ? lane->slot_v : lane->slot_k) + (uint64_t)j * s->tile_bytes;
			if ((err = read_back(f, tile, s->tile_bytes)))
				break;
			for (uint32_t t = 0; t < p && !err; t++)
				if (memcmp(f->back + ((uint64_t)t * s->c.n_kv_heads + m) * row,
					   pool_row(f, page, m, half * (uint32_t)p + t), row))
					err = -EBADMSG;
		}
	}
	if (err == -EBADMSG)
		fprintf(stderr, "kvrecall bench recall: %s pool: sequence %u head %u slot %u does not hold "
				"page %d as the pool has it\n",
			pool_names[f->pool], lane->seq, m, j, logical);
	return err;
}

/* Every slot of every lane against the pool, and the selection held whole. */
static int check_slots(struct format_env *f, uint32_t k_b)
{
	struct kvr_sched *s = f->s;
	for (uint32_t q = 0; q < f->batch; q++) {
		struct kvr_lane *lane = lane_of(s, q, 0);
		for (uint32_t m = 0; m < s->c.n_kv_heads; m++) {
			const int32_t *sel = lane->selected + (uint64_t)m * s->k;
			for (uint32_t w = 0; w < k_b; w++)
				if (!has_page(lane->slot_page + (uint64_t)m * s->k, s->k, sel[w]))
					return sched_fail(f, "a selected page was not recalled", -EINVAL);
			for (uint32_t j = 0; j < s->k; j++) {
				const int err = check_slot(f, lane, m, j);
				if (err)
					return err;
			}
		}
	}
	return 0;
}

/* ------------------------------------------------------------------ peak copy */

/* The peak pinned host->device rate in this run: batched copies of 16 KiB to
 * 4 MiB transfers out of 256 MiB of registered memory, as `bench copy`
 * measures it. *chosen becomes the backend --backend resolved to ("cpu" or
 * "cuda"), so that the recall rows run on the device the peak was taken on. */
static double copy_peak_gbps(const char *backend, uint32_t reps, const char **chosen)
{
	struct kvr_dev *dev;
	const char *name;
	if (bench_open_device(RECALL_CMD, backend, &dev, &name))
		return 0;
	*chosen = name;
	const uint64_t src_bytes = 256ull << 20, dst_bytes = 64ull << 20;
	unsigned char *src = bench_huge_alloc("kvrecall bench recall", src_bytes), *dst = NULL;
	struct kvr_stream *stream = NULL;
	struct kvr_copy_desc *descs = calloc(dst_bytes / 16384, sizeof(*descs));
	double best = 0;
	if (src && descs && !kvr_dev_host_register(dev, src, src_bytes) &&
	    !kvr_dev_alloc(dev, dst_bytes, (void **)&dst) && !kvr_dev_stream_create(dev, 0, &stream)) {
		memset(src, 0x5a, src_bytes);
		for (uint64_t size = 16384; size <= (4u << 20); size *= 4) {
			const uint32_t n = (uint32_t)(dst_bytes / size);
			double t[32];
			for (uint32_t i = 0; i < n; i++)
				descs[i] = (struct kvr_copy_desc){ (uint64_t)i * size * 3 % (src_bytes - size),
								   (uint64_t)i * size, size };
			for (uint32_t r = 0; r <= reps; r++) {
				const double t0 = bench_now_s();
				if (kvr_dev_memcpy_batch_async(dev, dst, src, descs, n, KVR_COPY_H2D, stream) ||
				    kvr_dev_stream_synchronize(dev, stream))
					goto out;
				if (r)
					t[r - 1] = bench_now_s() - t0;
			}
			const double gbps = (double)n * (double)size / bench_median(t, reps) / 1e9;
			best = gbps > best ? gbps : best;
		}
	}
out:
	if (stream)
		kvr_dev_stream_destroy(dev, stream);
	if (dst)
		kvr_dev_free(dev, dst);
	if (src) {
		kvr_dev_host_unregister(dev, src);
		free(src);
	}
	free(descs);
	kvr_dev_destroy(dev);
	return best;
}

/* Device bytes one sequence's page cache takes in a cuda context of this
 * shape with streamed recall (kvr_device_bytes_needed: slots of every sparse
 * layer, resident sink and window pages, tail tiles), per page format: what
 * quantised slots buy in sequences (or budget) per byte of device memory. */
static uint64_t cache_bytes(const struct bench_shape *sh, uint32_t budget, uint32_t sink, uint32_t window,
			    uint32_t kv_format)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_layers = sh->n_layers, c.n_qo_heads = sh->n_qo_heads, c.n_kv_heads = sh->n_kv_heads;
	c.head_dim = sh->head_dim, c.page_tokens = sh->page_tokens, c.budget_tokens = budget;
	c.sink_tokens = sink, c.window_tokens = window, c.backend = KVR_BACKEND_CUDA;
	c.recall = KVR_RECALL_STREAMED, c.kv_format = kv_format, c.max_sequences = c.max_batch = 1;
	uint64_t per_seq = 0;
	return kvr_device_bytes_needed(&c, NULL, &per_seq) ? 0 : per_seq;
}

/* ------------------------------------------------------------------ the command */

struct recall_row {
	uint32_t budget, pool, buffers, chunk, misses;
	uint64_t run_bytes;
	double us, gbps;
};

struct recall_opts {
	const char *backend, *json_path, *trace_path;
	struct bench_shape sh;
	uint32_t budgets[8], n_budgets, chunks[8], n_chunks;
	uint32_t batch, reps, sink, window, pool_mib;
	double miss_rate;
};

/* Every (budget, buffers, chunk) variant of one pool format into rows. */
static int run_format(struct format_env *f, const struct recall_opts *o, struct recall_row *rows,
		      uint32_t *n_rows, uint32_t total, int *traced)
{
	struct kvr_sched *s = f->s;
	const uint32_t p = o->sh.page_tokens;
	const uint64_t run_bytes = s->kv_format ? kvr_kv_run_bytes(s->kv_format, p, o->sh.head_dim, s->eb)
						: s->head_bytes;
	for (uint32_t bi = 0; bi < o->n_budgets; bi++) {
		const uint32_t k_b = (o->budgets[bi] - o->sink - o->window) / p;
		uint32_t n_swap = (uint32_t)((double)k_b * o->miss_rate + 0.5);
		n_swap = n_swap ? n_swap : 1;
		/* quantised runs go straight into units: no staging, "buffers" 0 */
		for (uint32_t buffers = s->kv_format ? 0u : 1u; buffers <= (s->kv_format ? 0u : 2u); buffers++)
			for (uint32_t ci = 0; ci < o->n_chunks; ci++) {
				bench_progress("recall", *n_rows, total);
				char why[256] = "";
				int err = kvr_recall_reconfigure(s, buffers ? buffers : 1, o->chunks[ci], why,
								 sizeof(why));
				if (err) {
					fprintf(stderr, "kvrecall bench recall: %s\n", why);
					return err;
				}
				/* byte-exact after a fresh selection and after a round of misses */
				write_selections(f, k_b, 0, 1);
				if ((err = recall_round(f, NULL)) || (err = check_slots(f, k_b)))
					return err;
				write_selections(f, k_b, n_swap, 0);
				if ((err = recall_round(f, NULL)) || (err = check_slots(f, k_b)))
					return err;
				double t[32];
				for (uint32_t r = 0; r < o->reps; r++) {
					write_selections(f, k_b, n_swap, 0);
					if ((err = recall_round(f, &t[r])))
						return err;
				}
				const double sec = bench_median(t, o->reps);
				const uint32_t misses = f->batch * s->c.n_kv_heads * n_swap;
				rows[(*n_rows)++] = (struct recall_row){ o->budgets[bi], f->pool, buffers,
									 o->chunks[ci], misses, run_bytes, sec * 1e6,
									 (double)misses * (double)run_bytes / sec / 1e9 };
				if (o->trace_path && !*traced && f->pool == POOL_HND && buffers == 2) {
					write_selections(f, k_b, n_swap, 0);
					if ((err = kvr_trace_start(f->ctx, 1u << 14)) || (err = recall_round(f, NULL)) ||
					    (err = kvr_trace_write(f->ctx, o->trace_path))) {
						fprintf(stderr, "kvrecall bench recall: trace: %s\n", kvr_last_error(f->ctx));
						return err;
					}
					*traced = 1;
				}
			}
	}
	return 0;
}

static void write_json(FILE *f, const struct recall_opts *o, const char *backend_name, int argc, char **argv,
		       const struct recall_row *rows, uint32_t n_rows, uint64_t pool_bytes, double peak)
{
	bench_json_open(f, "recall", backend_name, argc, argv);
	fprintf(f, "  \"shape\": ");
	bench_shape_json(f, &o->sh);
	fprintf(f, ",\n  \"params\": {\"batch\": %u, \"miss_rate\": %.4f, \"sink_tokens\": %u, "
		   "\"window_tokens\": %u, \"reps\": %u, \"pool_bytes\": %llu, \"code\": \"scheduler/recall.c\", "
		   "\"byte_exact\": true},\n",
		o->batch, o->miss_rate, o->sink, o->window, o->reps, (unsigned long long)pool_bytes);
	fprintf(f, "  \"results\": [\n");
	for (uint32_t i = 0; i < n_rows; i++)
		fprintf(f, "    {\"budget_tokens\": %u, \"misses\": %u, \"run_bytes\": %llu, \"bytes\": %llu, "
			   "\"pool\": \"%s\", \"buffers\": %u, \"chunk_pages\": %u, \"us_per_layer\": %.3f, "
			   "\"gbps\": %.4f, \"ratio_to_copy_peak\": %.4f}%s\n",
			rows[i].budget, rows[i].misses, (unsigned long long)rows[i].run_bytes,
			(unsigned long long)rows[i].misses * rows[i].run_bytes, pool_names[rows[i].pool],
			rows[i].buffers, rows[i].chunk, rows[i].us, rows[i].gbps, peak > 0 ? rows[i].gbps / peak : 0,
			i + 1 < n_rows ? "," : "");
	fprintf(f, "  ],\n  \"device_cache\": [\n");
	for (uint32_t bi = 0; bi < o->n_budgets; bi++)
		for (uint32_t fmt = KVR_KV_FORMAT_PLAIN; fmt <= KVR_KV_FORMAT_K4V2; fmt++)
			fprintf(f, "    {\"budget_tokens\": %u, \"kv_format\": \"%s\", \"per_sequence_bytes\": %llu}%s\n",
				o->budgets[bi], bench_kv_format_label(fmt),
				(unsigned long long)cache_bytes(&o->sh, o->budgets[bi], o->sink, o->window, fmt),
				bi + 1 < o->n_budgets || fmt < KVR_KV_FORMAT_K4V2 ? "," : "");
	fprintf(f, "  ],\n  \"summary\": {\"peak_h2d_pinned_gbps\": %.4f}\n", peak);
	bench_json_close(f);
}

static void recall_usage(FILE *f)
{
	fprintf(f,
		"usage: kvrecall bench recall [--backend auto|cpu|cuda] [--preset llama-3.1-8b|qwen-2.5-7b|smollm2-135m]\n"
		"         [--kv-heads N --qo-heads N --head-dim D --layers N --page-tokens P]\n"
		"         [--budget 1024,2048,4096] [--sink S] [--window W] [--batch 1] [--miss-rate 0.25]\n"
		"         [--chunk-pages 8,32] [--pool-mib 512] [--reps 7] [--quick] [--json FILE] [--trace FILE]\n"
		"  --budget LIST       up to 8 budgets, each a multiple of the page size that\n"
		"                      holds sink + window + one page\n"
		"  --batch N           sequences, 1 to 256\n"
		"  --miss-rate R       the share of each selection recalled, above 0 and at most 1\n"
		"  --chunk-pages LIST  up to 8 chunk sizes, 1 to 4096 pages\n"
		"  --pool-mib N        the pool's size, 1 to 1048576\n"
		"  --reps N            timed rounds per variant, 1 to 31\n"
		"  --kv-heads ... --page-tokens   the shape, each 1 to 65536\n");
}

int bench_recall(int argc, char **argv)
{
	struct recall_opts o = { .backend = "auto", .sh = bench_presets[0], .budgets = { 1024, 2048, 4096 },
				 .n_budgets = 3, .chunks = { 8, 32 }, .n_chunks = 2, .batch = 1, .reps = 7,
				 .pool_mib = 512, .miss_rate = 0.25 };
	uint32_t backend_index = 0; /* auto */
	for (int i = 0; i < argc; i++) {
		if (cli_is_help(argv[i])) {
			recall_usage(stdout);
			return CLI_EXIT_OK;
		}
		if (!strcmp(argv[i], "--quick")) {
			o.reps = 3, o.n_chunks = 1, o.chunks[0] = 8, o.n_budgets = 1, o.budgets[0] = 1024,
			o.pool_mib = 64;
			continue;
		}
		BENCH_TAKE_SHAPE_FLAG(RECALL_CMD, argc, argv, i, &o.sh)
		CLI_TAKE(cli_opt_choice(RECALL_CMD, argc, argv, &i, "--backend", cli_backend_names, &backend_index))
		CLI_TAKE(cli_opt_str(RECALL_CMD, argc, argv, &i, "--json", &o.json_path))
		CLI_TAKE(cli_opt_str(RECALL_CMD, argc, argv, &i, "--trace", &o.trace_path))
		CLI_TAKE(cli_opt_u32_list(RECALL_CMD, argc, argv, &i, "--budget", 1, UINT32_MAX, o.budgets, 8,
					  &o.n_budgets))
		CLI_TAKE(cli_opt_u32_list(RECALL_CMD, argc, argv, &i, "--chunk-pages", 1, 4096, o.chunks, 8,
					  &o.n_chunks))
		CLI_TAKE(cli_opt_u32(RECALL_CMD, argc, argv, &i, "--batch", 1, 256, &o.batch))
		CLI_TAKE(cli_opt_double(RECALL_CMD, argc, argv, &i, "--miss-rate", 0, 1, 1, &o.miss_rate))
		CLI_TAKE(cli_opt_u32(RECALL_CMD, argc, argv, &i, "--sink", 0, UINT32_MAX - 1, &o.sink))
		CLI_TAKE(cli_opt_u32(RECALL_CMD, argc, argv, &i, "--window", 0, UINT32_MAX - 1, &o.window))
		CLI_TAKE(cli_opt_u32(RECALL_CMD, argc, argv, &i, "--reps", 1, 31, &o.reps))
		CLI_TAKE(cli_opt_u32(RECALL_CMD, argc, argv, &i, "--pool-mib", 1, 1u << 20, &o.pool_mib))
		return cli_usage_error(RECALL_CMD, "unknown option '%s'", argv[i]);
	}
	o.backend = cli_backend_names[backend_index];
	const uint32_t p = o.sh.page_tokens;
	uint32_t max_budget = 0;
	for (uint32_t b = 0; b < o.n_budgets; b++) {
		if (o.budgets[b] % p || o.budgets[b] < (uint64_t)o.sink + o.window + p) {
			fprintf(stderr, "kvrecall bench recall: --budget %u must be a multiple of p = %u and hold "
					"sink + window + one page\n", o.budgets[b], p);
			return 2;
		}
		max_budget = o.budgets[b] > max_budget ? o.budgets[b] : max_budget;
	}
	if (!kvr_kv_run_bytes(KVR_KV_K8V4, p, o.sh.head_dim, 2)) {
		fprintf(stderr, "kvrecall bench recall: quantised pages need a head dim that is a multiple of 16\n");
		return 2;
	}
	/* pages a sequence: --pool-mib of f16 pages over the batch, and room for
	 * the largest selection to swap in pages it does not hold */
	const uint64_t page_bytes = 2ull * p * o.sh.n_kv_heads * o.sh.head_dim * 2;
	const uint32_t max_k = (max_budget - o.sink - o.window) / p;
	uint64_t n_pages = ((uint64_t)o.pool_mib << 20) / page_bytes / o.batch;
	if (n_pages < 2ull * max_k + 2)
		n_pages = 2ull * max_k + 2;
	if (n_pages > UINT32_MAX / p) {
		fprintf(stderr, "kvrecall bench recall: --pool-mib is too large for this batch\n");
		return 2;
	}
	const uint64_t pool_bytes = n_pages * o.batch * page_bytes;
	const char *run_backend = o.backend; /* auto resolved as the peak's device */
	const double peak = copy_peak_gbps(o.backend, o.reps, &run_backend);
	struct recall_row rows[N_POOLS * 8 * 8 * 2];
	uint32_t n_rows = 0;
	const uint32_t total = o.n_budgets * o.n_chunks * (2 * 2 + 2);
	int rc = 0, traced = 0;
	const char *device_name = "?"; /* "cpu", "cuda" */
	for (uint32_t pool = 0; !rc && pool < N_POOLS; pool++) {
		struct format_env f = { .pool = pool };
		rc = format_open(&f, run_backend, &o.sh, o.batch, max_budget, o.sink, o.window, (uint32_t)n_pages);
		if (!rc) {
			device_name = kvr_dev_name(f.s->dev);
			rc = run_format(&f, &o, rows, &n_rows, total, &traced);
		}
		format_close(&f);
	}
	bench_progress("recall", total, total);
	if (rc)
		return 1;
	if (o.trace_path)
		fprintf(stderr, "kvrecall bench recall: trace of one HND two-buffer layer in %s\n", o.trace_path);
	fprintf(stderr, "kvrecall bench recall: scheduler/recall.c on the %s device; %s shape (%u KV heads, "
			"d = %u, p = %u), batch %u, miss rate %.2f, S = %u, W = %u, pool %.0f MiB; peak pinned H2D "
			"copy %.2f GB/s; every slot byte-exact\n",
		device_name, o.sh.preset, o.sh.n_kv_heads, o.sh.head_dim, p, o.batch, o.miss_rate,
		o.sink, o.window, pool_bytes / 1048576.0, peak);
	for (uint32_t bi = 0; bi < o.n_budgets; bi++)
		fprintf(stderr, "B = %u: one sequence's device page cache (cuda, streamed): f16 %.1f MiB, "
				"K8V4 %.1f MiB, K4V2 %.1f MiB\n",
			o.budgets[bi], cache_bytes(&o.sh, o.budgets[bi], o.sink, o.window, 0) / 1048576.0,
			cache_bytes(&o.sh, o.budgets[bi], o.sink, o.window, 1) / 1048576.0,
			cache_bytes(&o.sh, o.budgets[bi], o.sink, o.window, 2) / 1048576.0);
	fprintf(stderr, "%-7s %-7s %-6s %-8s %-6s %9s %10s %8s %8s\n", "budget", "misses", "pool", "buffers",
		"chunk", "B/run", "us/layer", "GB/s", "÷ peak");
	for (uint32_t i = 0; i < n_rows; i++)
		fprintf(stderr, "%-7u %-7u %-6s %-8u %-6u %9llu %10.1f %8.2f %8.3f\n", rows[i].budget, rows[i].misses,
			pool_names[rows[i].pool], rows[i].buffers, rows[i].chunk,
			(unsigned long long)rows[i].run_bytes, rows[i].us, rows[i].gbps,
			peak > 0 ? rows[i].gbps / peak : 0);
	FILE *f = o.json_path ? fopen(o.json_path, "w") : stdout;
	if (!f) {
		fprintf(stderr, "kvrecall bench recall: cannot write %s: %s\n", o.json_path, strerror(errno));
		return 1;
	}
	write_json(f, &o, device_name, argc, argv, rows, n_rows, pool_bytes, peak);
	return 0;
}
