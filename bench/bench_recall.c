/* SPDX-License-Identifier: MIT */
/*
 * bench_recall.c — `kvrecall bench recall`: how long one layer's recall takes
 * on this machine, for a model shape, budget, batch size and miss rate.
 *
 * One layer's recall moves, for each of `batch` sequences and each KV head,
 * the missed pages among the k = (B − S − W)/p it selected: misses =
 * batch · n_kv · k · miss_rate HND runs of 2·p·d elements, from random pages
 * of a pinned host pool several times the last-level cache into random slots
 * of the device page cache (NHD tiles). It is done the way the scheduler does
 * it (scheduler/recall.c): chunks of `chunk` runs are copied into a staging
 * buffer on the copy stream (one batched copy per chunk; with the NHD pool
 * layout 2·p row copies per run) and scattered into their slots on the
 * convert stream; with two buffers the copy of chunk c+1 overlaps the scatter
 * of chunk c, ordered by `staged`/`drained` events. Zero-copy (HND pool only)
 * scatters straight from the pool, with no staging and no copy call.
 * Quantised pools (K8V4, K4V2: layouts/kvquant.h) recall as the scheduler
 * does them: each chunk's runs copied straight into their slots (no staging,
 * nothing to convert), so their time shows what the smaller runs buy.
 *
 * Every variant is first run once into scribbled slots and every recalled
 * row is compared byte for byte with the pool; a mismatch fails the command
 * before anything is timed. Then: the latency of one layer's recall (enqueue
 * all chunks, synchronise the convert stream), the median of --reps runs,
 * its bandwidth, and that bandwidth ÷ the peak pinned host->device copy rate
 * measured in the same run (as `bench copy` measures it).
 *
 * --trace FILE: after timing, each variant's layer runs once more with host
 * functions stamping every chunk's copy and scatter on their streams; the
 * spans go to a Chrome trace-event file, one "process" per variant.
 *
 * Threads: the caller's; the cpu backend's copy and convert streams are
 * worker streams (as in the scheduler), so they overlap there too; --trace's
 * stamps run on whichever thread runs each stream's host functions.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kvrecall.h"
#include "bench_cmd.h"
#include "bench_common.h"
#include "bench_shape.h"
#include "../gpu/backend.h"

enum { POOL_HND, POOL_NHD, POOL_ZERO_COPY, POOL_K8V4, POOL_K4V2 };

static int layout_quantised(uint32_t l)
{
	return l == POOL_K8V4 || l == POOL_K4V2;
}

struct recall_env {
	struct kvr_dev *dev;
	struct bench_shape sh;
	struct kvr_shape kshape;
	uint64_t run_bytes, page_bytes, tile_bytes, row_bytes;
	unsigned char *pool[2]; /* [POOL_HND], [POOL_NHD]: the same pages in each layout */
	uint64_t pool_pages;
	/* quantised pools ([0] K8V4, [1] K4V2; pool_pages pages of random bytes:
	 * recall moves bytes, so their values do not matter) and run sizes */
	unsigned char *qpool[2];
	uint64_t qrun_bytes[2];
	unsigned char *slots;   /* device: n_tiles K/V tile pairs */
	uint32_t n_tiles;
	unsigned char *staging[2];
	struct kvr_stream *copy, *convert;
	struct kvr_event *staged[2], *drained[2];
	/* this budget's misses: pool page, head and slot tile of each */
	uint32_t n_miss, *miss_page, *miss_head, *miss_tile;
	struct kvr_copy_desc *descs;       /* host, one chunk's */
	struct kvr_scatter_item *items;    /* host, every miss's item */
	struct kvr_scatter_item *items_dev; /* device twin, per variant */
	uint32_t reps;
	struct span *spans;     /* --trace: this layer's chunk spans, or NULL */
	uint32_t n_spans, max_spans;
};

/* --trace: one copy or scatter chunk as its stream ran it, stamped by host
 * functions the stream runs before and after it (as the scheduler's own
 * trace does). The stamps are written on the stream's host-function thread
 * and read after the stream is synchronised, which orders them. */
struct span {
	const char *name;
	uint32_t track; /* 0 copy stream, 1 convert stream */
	uint32_t count; /* runs */
	_Atomic double begin, end;
};

static void stamp_begin(void *arg)
{
	/* relaxed: read after a stream synchronise (see struct span) */
	atomic_store_explicit(&((struct span *)arg)->begin, bench_now_s(), memory_order_relaxed);
}

static void stamp_end(void *arg)
{
	atomic_store_explicit(&((struct span *)arg)->end, bench_now_s(), memory_order_relaxed);
}

/* Bracket the work enqueued between span_open and span_close on `stream`. */
static struct span *span_open(struct recall_env *e, struct kvr_stream *stream, const char *name, uint32_t track,
			      uint32_t count)
{
	if (!e->spans || e->n_spans == e->max_spans)
		return NULL;
	struct span *sp = &e->spans[e->n_spans++];
	sp->name = name, sp->track = track, sp->count = count;
	atomic_store_explicit(&sp->begin, 0.0, memory_order_relaxed);
	atomic_store_explicit(&sp->end, 0.0, memory_order_relaxed);
	return kvr_dev_host_fn(e->dev, stream, stamp_begin, sp) ? NULL : sp;
}

static void span_close(struct recall_env *e, struct kvr_stream *stream, struct span *sp)
{
	if (sp)
		kvr_dev_host_fn(e->dev, stream, stamp_end, sp);
}

static int fail(struct recall_env *e, const char *what)
{
	fprintf(stderr, "kvrecall bench recall: %s: %s\n", what, kvr_dev_last_error(e->dev));
	return -EIO;
}

/* Enqueue one layer's recall in `layout`, `buffers` and `chunk`; the caller
 * synchronises the convert stream. */
static int recall_layer(struct recall_env *e, uint32_t layout, uint32_t buffers, uint32_t chunk)
{
	const uint32_t p = e->sh.page_tokens, n_kv = e->sh.n_kv_heads;
	if (layout_quantised(layout)) {
		/* as scheduler/recall.c's recall_quantised: runs straight into their
		 * slots (tile j holds n_kv runs), one batched copy per chunk on the
		 * copy stream; the convert stream waits for it so that callers
		 * synchronise one stream for every variant */
		const uint32_t q = layout == POOL_K4V2;
		const uint64_t rb = e->qrun_bytes[q];
		/* the slots' last user is the convert stream (as a lane's last
		 * attention is for the scheduler): the copies wait for it */
		if (kvr_dev_event_record(e->dev, e->drained[0], e->convert) ||
		    kvr_dev_stream_wait_event(e->dev, e->copy, e->drained[0]))
			return fail(e, "quantised recall's event");
		for (uint32_t at = 0; at < e->n_miss; at += chunk) {
			const uint32_t n = e->n_miss - at < chunk ? e->n_miss - at : chunk;
			for (uint32_t i = 0; i < n; i++)
				e->descs[i] = (struct kvr_copy_desc){
					(e->miss_page[at + i] * n_kv + e->miss_head[at + i]) * rb,
					((uint64_t)e->miss_tile[at + i] * n_kv + e->miss_head[at + i]) * rb, rb };
			struct span *sp = span_open(e, e->copy, "copy chunk", 0, n);
			const int err = kvr_dev_memcpy_batch_async(e->dev, e->slots, e->qpool[q], e->descs, n,
								   KVR_COPY_H2D, e->copy);
			span_close(e, e->copy, sp);
			if (err)
				return fail(e, "quantised copy");
		}
		if (kvr_dev_event_record(e->dev, e->staged[0], e->copy) ||
		    kvr_dev_stream_wait_event(e->dev, e->convert, e->staged[0]))
			return fail(e, "quantised recall's event");
		return 0;
	}
	/* the items: from staging (chunk-relative) or, zero-copy, the pool */
	for (uint32_t i = 0; i < e->n_miss; i++) {
		const unsigned char *run =
			layout == POOL_ZERO_COPY
				? e->pool[POOL_HND] + e->miss_page[i] * e->page_bytes + e->miss_head[i] * e->run_bytes
				: e->staging[(i / chunk) % buffers] + (uint64_t)(i % chunk) * e->run_bytes;
		unsigned char *tile = e->slots + (uint64_t)e->miss_tile[i] * 2 * e->tile_bytes;
		e->items[i] = (struct kvr_scatter_item){ run, tile, tile + e->tile_bytes, e->miss_head[i], 0 };
	}
	if (kvr_dev_memcpy_async(e->dev, e->items_dev, e->items, e->n_miss * sizeof(*e->items), KVR_COPY_H2D,
				 e->convert))
		return fail(e, "item upload");
	if (layout == POOL_ZERO_COPY) {
		struct span *sp = span_open(e, e->convert, "zero-copy scatter", 1, e->n_miss);
		const int err = kvr_dev_scatter(e->dev, &e->kshape, e->items_dev, e->n_miss, e->convert);
		span_close(e, e->convert, sp);
		return err ? fail(e, "scatter") : 0;
	}
	for (uint32_t at = 0, c = 0; at < e->n_miss; at += chunk, c++) {
		const uint32_t n = e->n_miss - at < chunk ? e->n_miss - at : chunk, b = c % buffers;
		int err = kvr_dev_stream_wait_event(e->dev, e->copy, e->drained[b]);
		struct span *sp = err ? NULL : span_open(e, e->copy, "copy chunk", 0, n);
		if (!err && layout == POOL_HND) {
			for (uint32_t i = 0; i < n; i++)
				e->descs[i] = (struct kvr_copy_desc){
					e->miss_page[at + i] * e->page_bytes + e->miss_head[at + i] * e->run_bytes,
					(uint64_t)i * e->run_bytes, e->run_bytes };
			err = kvr_dev_memcpy_batch_async(e->dev, e->staging[b], e->pool[POOL_HND], e->descs, n,
							 KVR_COPY_H2D, e->copy);
		} else if (!err) { /* token-major pages: 2·p rows per run */
			for (uint32_t i = 0; i < n && !err; i++) {
				const unsigned char *page = e->pool[POOL_NHD] + e->miss_page[at + i] * e->page_bytes;
				for (uint32_t r = 0; r < 2 * p && !err; r++)
					err = kvr_dev_memcpy_async(e->dev, e->staging[b] + i * e->run_bytes + r * e->row_bytes,
								   page + ((uint64_t)r * n_kv + e->miss_head[at + i]) * e->row_bytes,
								   e->row_bytes, KVR_COPY_H2D, e->copy);
			}
		}
		span_close(e, e->copy, sp);
		if (!err)
			err = kvr_dev_event_record(e->dev, e->staged[b], e->copy);
		if (!err)
			err = kvr_dev_stream_wait_event(e->dev, e->convert, e->staged[b]);
		sp = err ? NULL : span_open(e, e->convert, "scatter chunk", 1, n);
		if (!err)
			err = kvr_dev_scatter(e->dev, &e->kshape, e->items_dev + at, n, e->convert);
		span_close(e, e->convert, sp);
		if (!err)
			err = kvr_dev_event_record(e->dev, e->drained[b], e->convert);
		if (err)
			return fail(e, "recall chunk");
	}
	return 0;
}

/* Scribble the slots, recall once, read every recalled row back and compare
 * it with the pool. 0 when byte-exact. */
static int check_layer(struct recall_env *e, uint32_t layout, uint32_t buffers, uint32_t chunk)
{
	const uint64_t slot_bytes = (uint64_t)e->n_tiles * 2 * e->tile_bytes;
	unsigned char *back = malloc(slot_bytes);
	if (!back)
		return -ENOMEM;
	memset(back, 0xa5, slot_bytes);
	int err = kvr_dev_memcpy_async(e->dev, e->slots, back, slot_bytes, KVR_COPY_H2D, e->convert) ? fail(e, "scribble") : 0;
	if (!err)
		err = recall_layer(e, layout, buffers, chunk);
	if (!err && kvr_dev_memcpy_async(e->dev, back, e->slots, slot_bytes, KVR_COPY_D2H, e->convert))
		err = fail(e, "read-back");
	if (!err && kvr_dev_stream_synchronize(e->dev, e->convert))
		err = fail(e, "synchronise");
	const uint32_t p = e->sh.page_tokens, n_kv = e->sh.n_kv_heads;
	for (uint32_t i = 0; !err && layout_quantised(layout) && i < e->n_miss; i++) {
		const uint32_t q = layout == POOL_K4V2;
		const uint64_t rb = e->qrun_bytes[q];
		if (memcmp(e->qpool[q] + (e->miss_page[i] * n_kv + e->miss_head[i]) * rb,
			   back + ((uint64_t)e->miss_tile[i] * n_kv + e->miss_head[i]) * rb, rb)) {
			fprintf(stderr, "kvrecall bench recall: recalled %s run %u (page %u, head %u) differs from "
					"the pool\n", layout == POOL_K4V2 ? "K4V2" : "K8V4", i, e->miss_page[i],
				e->miss_head[i]);
			err = -EIO;
		}
	}
	for (uint32_t i = 0; !err && !layout_quantised(layout) && i < e->n_miss; i++) {
		/* HND source: run = keys rows then values rows of this head */
		const unsigned char *run = e->pool[POOL_HND] + e->miss_page[i] * e->page_bytes + e->miss_head[i] * e->run_bytes;
		const unsigned char *tile = back + (uint64_t)e->miss_tile[i] * 2 * e->tile_bytes;
		for (uint32_t r = 0; r < 2 * p; r++) {
			const unsigned char *got = tile + (r >= p ? e->tile_bytes : 0) +
						   ((uint64_t)(r % p) * n_kv + e->miss_head[i]) * e->row_bytes;
			if (memcmp(run + r * e->row_bytes, got, e->row_bytes)) {
				fprintf(stderr, "kvrecall bench recall: recalled bytes differ from the pool: run %u "
						"(page %u, head %u), row %u\n",
					i, e->miss_page[i], e->miss_head[i], r);
				err = -EIO;
				break;
			}
		}
	}
	free(back);
	return err;
}

static int time_layer(struct recall_env *e, uint32_t layout, uint32_t buffers, uint32_t chunk, double *seconds)
{
	double t[32];
	for (uint32_t r = 0; r <= e->reps; r++) {
		const double t0 = bench_now_s();
		int err = recall_layer(e, layout, buffers, chunk);
		if (!err && kvr_dev_stream_synchronize(e->dev, e->convert))
			err = fail(e, "synchronise");
		if (err)
			return err;
		if (r)
			t[r - 1] = bench_now_s() - t0;
	}
	*seconds = bench_median(t, e->reps);
	return 0;
}

/* The peak pinned host->device rate in this run: batched copies of 16 KiB to
 * 4 MiB transfers over the pool, as `bench copy` measures it. */
static double copy_peak_gbps(struct recall_env *e, unsigned char *dst, uint64_t dst_bytes)
{
	double best = 0;
	for (uint64_t size = 16384; size <= (4u << 20) && size <= dst_bytes; size *= 4) {
		const uint32_t n = (uint32_t)(dst_bytes / size);
		double t[32];
		for (uint32_t r = 0; r <= e->reps; r++) {
			for (uint32_t i = 0; i < n; i++)
				e->descs[i] = (struct kvr_copy_desc){ (uint64_t)i * size * 3 % (e->pool_pages * e->page_bytes - size),
								      (uint64_t)i * size, size };
			const double t0 = bench_now_s();
			if (kvr_dev_memcpy_batch_async(e->dev, dst, e->pool[POOL_HND], e->descs, n, KVR_COPY_H2D, e->copy) ||
			    kvr_dev_stream_synchronize(e->dev, e->copy))
				return 0;
			if (r)
				t[r - 1] = bench_now_s() - t0;
		}
		const double gbps = (double)n * (double)size / bench_median(t, e->reps) / 1e9;
		best = gbps > best ? gbps : best;
	}
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

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static uint64_t rng(void)
{
	return bench_xorshift(&rng_state);
}

static const char *layout_name(uint32_t l)
{
	return l == POOL_HND ? "hnd" : l == POOL_NHD ? "nhd" : l == POOL_ZERO_COPY ? "zero-copy" : l == POOL_K8V4 ? "k8v4" : "k4v2";
}

struct recall_row {
	uint32_t budget, layout, buffers, chunk, misses;
	uint64_t run_bytes;
	double us, gbps;
};

int bench_recall(int argc, char **argv)
{
	const char *backend = "auto", *json_path = NULL, *trace_path = NULL;
	struct bench_shape sh = bench_presets[0];
	uint32_t budgets[8] = { 1024, 2048, 4096 }, n_budgets = 3, chunks[8] = { 8, 32 }, n_chunks = 2;
	uint32_t batch = 1, reps = 7, sink = 0, window = 0;
	double miss_rate = 0.25;
	for (int i = 0; i < argc; i++) {
		const int shape_flag = bench_shape_flag(argc, argv, &i, &sh);
		if (shape_flag < 0)
			return 2;
		if (shape_flag)
			continue;
		if (!strcmp(argv[i], "--backend") && i + 1 < argc)
			backend = argv[++i];
		else if (!strcmp(argv[i], "--json") && i + 1 < argc)
			json_path = argv[++i];
		else if (!strcmp(argv[i], "--trace") && i + 1 < argc)
			trace_path = argv[++i];
		else if (!strcmp(argv[i], "--budget") && i + 1 < argc) {
			if (bench_parse_list(argv[++i], budgets, 8, &n_budgets))
				goto usage;
		} else if (!strcmp(argv[i], "--chunk-pages") && i + 1 < argc) {
			if (bench_parse_list(argv[++i], chunks, 8, &n_chunks))
				goto usage;
		} else if (!strcmp(argv[i], "--batch") && i + 1 < argc)
			batch = (uint32_t)strtoul(argv[++i], NULL, 10);
		else if (!strcmp(argv[i], "--miss-rate") && i + 1 < argc)
			miss_rate = strtod(argv[++i], NULL);
		else if (!strcmp(argv[i], "--sink") && i + 1 < argc)
			sink = (uint32_t)strtoul(argv[++i], NULL, 10);
		else if (!strcmp(argv[i], "--window") && i + 1 < argc)
			window = (uint32_t)strtoul(argv[++i], NULL, 10);
		else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
			reps = (uint32_t)strtoul(argv[++i], NULL, 10);
		else if (!strcmp(argv[i], "--quick"))
			reps = 3, n_chunks = 1, chunks[0] = 8, n_budgets = 1, budgets[0] = 1024;
		else
			goto usage;
	}
	if (batch < 1 || batch > 256 || reps < 1 || reps > 31 || !(miss_rate > 0 && miss_rate <= 1)) {
		fprintf(stderr, "kvrecall bench recall: need 1 <= --batch <= 256, 1 <= --reps <= 31, "
				"0 < --miss-rate <= 1\n");
		return 2;
	}
	const uint32_t p = sh.page_tokens;
	for (uint32_t b = 0; b < n_budgets; b++)
		if (budgets[b] % p || budgets[b] < sink + window + p) {
			fprintf(stderr, "kvrecall bench recall: budget %u must be a multiple of p = %u and hold "
					"sink + window + one page\n", budgets[b], p);
			return 2;
		}

	struct recall_env e = { .sh = sh, .reps = reps };
	const char *backend_name;
	if (bench_open_device(backend, &e.dev, &backend_name))
		return 1;
	e.kshape = (struct kvr_shape){ sh.n_qo_heads, sh.n_kv_heads, sh.head_dim, p, 0, 1.0f, 0.9f, 0 };
	e.row_bytes = (uint64_t)sh.head_dim * 2;
	e.run_bytes = 2ull * p * e.row_bytes;
	e.page_bytes = e.run_bytes * sh.n_kv_heads;
	e.tile_bytes = (uint64_t)p * sh.n_kv_heads * e.row_bytes;
	e.qrun_bytes[0] = kvr_kv_run_bytes(KVR_KV_K8V4, p, sh.head_dim, 2);
	e.qrun_bytes[1] = kvr_kv_run_bytes(KVR_KV_K4V2, p, sh.head_dim, 2);
	if (!e.qrun_bytes[0]) {
		fprintf(stderr, "kvrecall bench recall: quantised pages need a head dim that is a multiple of 16\n");
		kvr_dev_destroy(e.dev);
		return 2;
	}
	uint32_t max_budget = 0, max_chunk = 0;
	for (uint32_t b = 0; b < n_budgets; b++)
		max_budget = budgets[b] > max_budget ? budgets[b] : max_budget;
	for (uint32_t c = 0; c < n_chunks; c++)
		max_chunk = chunks[c] > max_chunk ? chunks[c] : max_chunk;
	const uint32_t max_k = (max_budget - sink - window) / p;
	const uint32_t max_miss = (uint32_t)((double)batch * sh.n_kv_heads * max_k * miss_rate + 0.5);
	/* a pool of at least 512 MiB (beyond any last-level cache) and 4x the misses */
	e.pool_pages = ((512ull << 20) + e.page_bytes - 1) / e.page_bytes;
	if (e.pool_pages < 4ull * max_miss)
		e.pool_pages = 4ull * max_miss;
	const uint64_t pool_bytes = e.pool_pages * e.page_bytes;
	e.n_tiles = batch * max_k;
	int rc = 0;
	for (int l = 0; !rc && l < 2; l++) {
		e.pool[l] = bench_huge_alloc("kvrecall bench recall", pool_bytes);
		rc = kvr_dev_host_register(e.dev, e.pool[l], pool_bytes) ? fail(&e, "registering the pool") : 0;
	}
	for (int q = 0; !rc && q < 2; q++) {
		const uint64_t bytes = e.pool_pages * sh.n_kv_heads * e.qrun_bytes[q];
		e.qpool[q] = bench_huge_alloc("kvrecall bench recall", bytes);
		rc = kvr_dev_host_register(e.dev, e.qpool[q], bytes) ? fail(&e, "registering a quantised pool") : 0;
		for (uint64_t i = 0; !rc && i < bytes / 8; i++)
			((uint64_t *)e.qpool[q])[i] = rng();
	}
	if (!rc) { /* random bytes in HND, the same elements token-major in NHD */
		uint64_t *w = (uint64_t *)e.pool[POOL_HND];
		for (uint64_t i = 0; i < pool_bytes / 8; i++)
			w[i] = rng();
		const uint32_t rows = 2 * p;
		for (uint64_t pg = 0; pg < e.pool_pages; pg++)
			for (uint32_t h = 0; h < sh.n_kv_heads; h++)
				for (uint32_t r = 0; r < rows; r++)
					memcpy(e.pool[POOL_NHD] + pg * e.page_bytes + ((uint64_t)r * sh.n_kv_heads + h) * e.row_bytes,
					       e.pool[POOL_HND] + pg * e.page_bytes + h * e.run_bytes + r * e.row_bytes,
					       e.row_bytes);
	}
	if (!rc && (kvr_dev_alloc(e.dev, (uint64_t)e.n_tiles * 2 * e.tile_bytes, (void **)&e.slots) ||
		    kvr_dev_alloc(e.dev, (uint64_t)max_chunk * e.run_bytes, (void **)&e.staging[0]) ||
		    kvr_dev_alloc(e.dev, (uint64_t)max_chunk * e.run_bytes, (void **)&e.staging[1]) ||
		    kvr_dev_alloc(e.dev, (max_miss + 1) * sizeof(*e.items), (void **)&e.items_dev) ||
		    kvr_dev_stream_create(e.dev, KVR_STREAM_WORKER, &e.copy) ||
		    kvr_dev_stream_create(e.dev, KVR_STREAM_WORKER, &e.convert)))
		rc = fail(&e, "device buffers and streams");
	for (int b = 0; !rc && b < 2; b++)
		if (kvr_dev_event_create(e.dev, &e.staged[b]) || kvr_dev_event_create(e.dev, &e.drained[b]))
			rc = fail(&e, "events");
	e.miss_page = calloc(max_miss + 1, sizeof(uint32_t));
	e.miss_head = calloc(max_miss + 1, sizeof(uint32_t));
	e.miss_tile = calloc(max_miss + 1, sizeof(uint32_t));
	e.items = calloc(max_miss + 1, sizeof(*e.items));
	const uint64_t peak_bytes = 64ull << 20;
	e.descs = calloc((peak_bytes / 16384 > max_chunk ? peak_bytes / 16384 : max_chunk), sizeof(*e.descs));
	unsigned char *peak_dst = NULL;
	if (!rc && (!e.miss_page || !e.miss_head || !e.miss_tile || !e.items || !e.descs))
		rc = -ENOMEM;
	if (!rc && kvr_dev_alloc(e.dev, peak_bytes, (void **)&peak_dst))
		rc = fail(&e, "peak copy buffer");
	const double peak = rc ? 0 : copy_peak_gbps(&e, peak_dst, peak_bytes);
	if (peak_dst)
		kvr_dev_free(e.dev, peak_dst);
	struct recall_row rows[8 * 11];
	uint32_t n_rows = 0, total = n_budgets * (2 * 2 * n_chunks + 1 + 2 * n_chunks);
	/* --trace: each variant's layer once more, its chunks stamped on the
	 * streams, one Chrome trace "process" per variant */
	FILE *trace = NULL;
	const double trace_t0 = bench_now_s();
	int trace_events = 0;
	if (!rc && trace_path) {
		e.max_spans = 2 * (max_miss + 1);
		e.spans = calloc(e.max_spans, sizeof(*e.spans));
		trace = e.spans ? fopen(trace_path, "w") : NULL;
		if (!trace) {
			fprintf(stderr, "kvrecall bench recall: cannot write %s: %s\n", trace_path, strerror(errno));
			rc = -EIO;
		} else {
			fprintf(trace, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
		}
	}
	for (uint32_t bi = 0; !rc && bi < n_budgets; bi++) {
		const uint32_t k = (budgets[bi] - sink - window) / p;
		e.n_miss = (uint32_t)((double)batch * sh.n_kv_heads * k * miss_rate + 0.5);
		if (!e.n_miss)
			e.n_miss = 1;
		/* distinct slots: miss i goes to (tile, head) pairs in a shuffled order */
		for (uint32_t i = 0; i < e.n_miss; i++) {
			e.miss_page[i] = (uint32_t)(rng() % e.pool_pages);
			e.miss_head[i] = i % sh.n_kv_heads;
			e.miss_tile[i] = i / sh.n_kv_heads;
		}
		for (uint32_t i = e.n_miss - 1; i > 0; i--) { /* shuffle which (tile, head) each run takes */
			const uint32_t j = (uint32_t)(rng() % (i + 1)), h = e.miss_head[i], t = e.miss_tile[i];
			e.miss_head[i] = e.miss_head[j], e.miss_tile[i] = e.miss_tile[j];
			e.miss_head[j] = h, e.miss_tile[j] = t;
		}
		for (uint32_t layout = POOL_HND; !rc && layout <= POOL_K4V2; layout++)
			/* quantised runs need no staging: "buffers" 0 */
			for (uint32_t buffers = layout_quantised(layout) ? 0u : 1u;
			     !rc && buffers <= (layout >= POOL_ZERO_COPY ? (layout_quantised(layout) ? 0u : 1u) : 2u);
			     buffers++)
				for (uint32_t ci = 0; !rc && ci < (layout == POOL_ZERO_COPY ? 1 : n_chunks); ci++) {
					const uint32_t chunk = layout == POOL_ZERO_COPY ? e.n_miss : chunks[ci];
					bench_progress("recall", n_rows, total);
					if ((rc = check_layer(&e, layout, buffers, chunk)))
						break;
					double s;
					if ((rc = time_layer(&e, layout, buffers, chunk, &s)))
						break;
					const uint64_t rb = layout_quantised(layout) ? e.qrun_bytes[layout == POOL_K4V2]
										     : e.run_bytes;
					rows[n_rows++] = (struct recall_row){ budgets[bi], layout, buffers,
									      layout == POOL_ZERO_COPY ? 0 : chunk, e.n_miss, rb,
									      s * 1e6, (double)e.n_miss * (double)rb / s / 1e9 };
					if (trace) {
						struct span *keep = e.spans;
						e.n_spans = 0;
						rc = recall_layer(&e, layout, buffers, chunk);
						if (!rc && kvr_dev_stream_synchronize(e.dev, e.convert))
							rc = fail(&e, "synchronise");
						if (!rc && kvr_dev_stream_synchronize(e.dev, e.copy))
							rc = fail(&e, "synchronise");
						const uint32_t pid = n_rows;
						fprintf(trace, "%s{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": %u, "
							       "\"args\": {\"name\": \"B=%u %s, %u buffer%s, chunks of %u\"}}",
							trace_events++ ? ",\n" : "", pid, budgets[bi], layout_name(layout), buffers,
							buffers > 1 ? "s" : "", chunk);
						for (uint32_t t = 0; t < 2; t++)
							fprintf(trace, ",\n{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": %u, "
								       "\"tid\": %u, \"args\": {\"name\": \"%s stream\"}}",
								pid, t, t ? "convert" : "copy");
						for (uint32_t k = 0; k < e.n_spans; k++) {
							const double b0 = atomic_load_explicit(&keep[k].begin, memory_order_relaxed);
							const double b1 = atomic_load_explicit(&keep[k].end, memory_order_relaxed);
							if (b0 <= 0 || b1 < b0)
								continue;
							fprintf(trace, ",\n{\"ph\": \"X\", \"name\": \"%s\", \"pid\": %u, \"tid\": %u, "
								       "\"ts\": %.3f, \"dur\": %.3f, \"args\": {\"runs\": %u}}",
								keep[k].name, pid, keep[k].track, (b0 - trace_t0) * 1e6, (b1 - b0) * 1e6,
								keep[k].count);
						}
					}
				}
	}
	bench_progress("recall", total, total);
	if (trace) {
		fprintf(trace, "\n]}\n");
		fclose(trace);
		if (!rc)
			fprintf(stderr, "kvrecall bench recall: trace of every variant's layer in %s\n", trace_path);
	}
	free(e.spans);
	e.spans = NULL;
	if (!rc) {
		fprintf(stderr, "kvrecall bench recall: %s backend (%s); %s shape (%u KV heads, d = %u, p = %u), "
				"batch %u, miss rate %.2f, S = %u, W = %u; peak pinned H2D copy %.2f GB/s; all "
				"variants byte-exact\n",
			backend_name, kvr_dev_name(e.dev), sh.preset, sh.n_kv_heads, sh.head_dim, p, batch,
			miss_rate, sink, window, peak);
		for (uint32_t bi = 0; bi < n_budgets; bi++)
			fprintf(stderr, "B = %u: one sequence's device page cache (cuda, streamed): f16 %.1f MiB, "
					"K8V4 %.1f MiB, K4V2 %.1f MiB\n",
				budgets[bi], cache_bytes(&sh, budgets[bi], sink, window, 0) / 1048576.0,
				cache_bytes(&sh, budgets[bi], sink, window, 1) / 1048576.0,
				cache_bytes(&sh, budgets[bi], sink, window, 2) / 1048576.0);
		fprintf(stderr, "%-7s %-7s %-10s %-8s %-6s %9s %10s %8s %8s\n", "budget", "misses", "pool", "buffers",
			"chunk", "B/run", "us/layer", "GB/s", "÷ peak");
		for (uint32_t i = 0; i < n_rows; i++)
			fprintf(stderr, "%-7u %-7u %-10s %-8u %-6u %9llu %10.1f %8.2f %8.3f\n", rows[i].budget,
				rows[i].misses, layout_name(rows[i].layout), rows[i].buffers, rows[i].chunk,
				(unsigned long long)rows[i].run_bytes, rows[i].us, rows[i].gbps,
				peak > 0 ? rows[i].gbps / peak : 0);
		FILE *f = json_path ? fopen(json_path, "w") : stdout;
		if (!f) {
			fprintf(stderr, "kvrecall bench recall: cannot write %s: %s\n", json_path, strerror(errno));
			rc = -errno;
		} else {
			bench_json_open(f, "recall", backend_name, argc, argv);
			fprintf(f, "  \"shape\": ");
			bench_shape_json(f, &sh);
			fprintf(f, ",\n  \"params\": {\"batch\": %u, \"miss_rate\": %.4f, \"sink_tokens\": %u, "
				   "\"window_tokens\": %u, \"reps\": %u, \"run_bytes\": %llu, \"pool_bytes\": %llu, "
				   "\"byte_exact\": true},\n",
				batch, miss_rate, sink, window, reps, (unsigned long long)e.run_bytes,
				(unsigned long long)pool_bytes);
			fprintf(f, "  \"results\": [\n");
			for (uint32_t i = 0; i < n_rows; i++)
				fprintf(f, "    {\"budget_tokens\": %u, \"misses\": %u, \"run_bytes\": %llu, \"bytes\": %llu, "
					   "\"pool\": \"%s\", "
					   "\"buffers\": %u, \"chunk_pages\": %u, \"us_per_layer\": %.3f, \"gbps\": %.4f, "
					   "\"ratio_to_copy_peak\": %.4f}%s\n",
					rows[i].budget, rows[i].misses, (unsigned long long)rows[i].run_bytes,
					(unsigned long long)rows[i].misses * rows[i].run_bytes,
					layout_name(rows[i].layout), rows[i].buffers, rows[i].chunk, rows[i].us, rows[i].gbps,
					peak > 0 ? rows[i].gbps / peak : 0, i + 1 < n_rows ? "," : "");
			fprintf(f, "  ],\n  \"device_cache\": [\n");
			for (uint32_t bi = 0; bi < n_budgets; bi++)
				for (uint32_t fmt = KVR_KV_FORMAT_PLAIN; fmt <= KVR_KV_FORMAT_K4V2; fmt++)
					fprintf(f, "    {\"budget_tokens\": %u, \"kv_format\": \"%s\", "
						   "\"per_sequence_bytes\": %llu}%s\n",
						budgets[bi], fmt ? kvr_kv_format_name(fmt) : "f16",
						(unsigned long long)cache_bytes(&sh, budgets[bi], sink, window, fmt),
						bi + 1 < n_budgets || fmt < KVR_KV_FORMAT_K4V2 ? "," : "");
			fprintf(f, "  ],\n  \"summary\": {\"peak_h2d_pinned_gbps\": %.4f}\n", peak);
			bench_json_close(f);
		}
	}
	for (int b = 0; b < 2; b++) {
		if (e.staged[b])
			kvr_dev_event_destroy(e.dev, e.staged[b]);
		if (e.drained[b])
			kvr_dev_event_destroy(e.dev, e.drained[b]);
		if (e.staging[b])
			kvr_dev_free(e.dev, e.staging[b]);
	}
	if (e.copy)
		kvr_dev_stream_destroy(e.dev, e.copy);
	if (e.convert)
		kvr_dev_stream_destroy(e.dev, e.convert);
	if (e.slots)
		kvr_dev_free(e.dev, e.slots);
	if (e.items_dev)
		kvr_dev_free(e.dev, e.items_dev);
	for (int l = 0; l < 2; l++) {
		if (e.pool[l]) {
			kvr_dev_host_unregister(e.dev, e.pool[l]);
			free(e.pool[l]);
		}
		if (e.qpool[l]) {
			kvr_dev_host_unregister(e.dev, e.qpool[l]);
			free(e.qpool[l]);
		}
	}
	free(e.miss_page), free(e.miss_head), free(e.miss_tile), free(e.items), free(e.descs);
	kvr_dev_destroy(e.dev);
	return rc ? 1 : 0;
usage:
	fprintf(stderr,
		"usage: kvrecall bench recall [--backend auto|cpu|cuda] [--preset llama-3.1-8b|qwen-2.5-7b|smollm2-135m]\n"
		"         [--kv-heads N --qo-heads N --head-dim D --layers N --page-tokens P]\n"
		"         [--budget 1024,2048,4096] [--sink S] [--window W] [--batch 1] [--miss-rate 0.25]\n"
		"         [--chunk-pages 8,32] [--reps 7] [--quick] [--json FILE] [--trace FILE]\n");
	return 2;
}
