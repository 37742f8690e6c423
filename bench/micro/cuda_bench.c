/* SPDX-License-Identifier: MIT */
/*
 * cuda_bench.c — the cuda backend on a GPU, timed through gpu/backend.h with
 * Llama-3.1-8B shapes (8 KV heads, 32 query heads, d = 128, f16, p = 32,
 * B = 2048 tokens per KV head, a batch of 8 sequences per call):
 *
 *   ceilings   a device-to-device copy (bytes read + written per second) and
 *              one large pinned host-to-device copy, measured in the same run;
 *   attention  kvr_dev_attention over B tokens per KV head for the batch, from
 *              NHD slot tiles (the device page cache's layout) and from HND
 *              pages, spread over a device pool several times the L2 cache,
 *              rotating among page lists so repeated calls do not hit in L2;
 *              checked against the cpu backend;
 *   selection  kvr_dev_score + kvr_dev_select for the batch at contexts of 8K
 *              to 128K tokens, beside attention; selected pages checked to be
 *              identical to the cpu backend's (the design's bit-identity);
 *   recall     host pool pages (pinned, registered) -> device staging with
 *              kvr_dev_memcpy_batch_async (one 16 KiB HND run per KV-head page:
 *              2·p·d·2 bytes), then kvr_dev_scatter into NHD slots: one stream,
 *              and two staging buffers on two streams (copy n+1 while
 *              scattering n), against one plain pinned H2D copy of the same
 *              bytes; also the copies as one kvr_dev_memcpy_async per run
 *              (the batch API's fallback), and a zero-copy scatter that reads
 *              the mapped pinned pool directly (no staging); both paths
 *              checked bit for bit once.
 *
 * Times: host clock around `iters` operations enqueued back to back, then a
 * stream synchronise, divided by iters (the throughput of a stream of such
 * calls, launch costs included); the median of --reps such runs after a
 * warm-up. "latency" is one operation enqueued and synchronised.
 *
 * Without a usable GPU (no driver, no device, or a build without the CUDA
 * backend) it prints "skipped: no GPU" with the reason and exits 0, so CI can
 * build and run it anywhere. Like kernels_bench it drives internals, so it
 * links the static library. Output: a table on stderr and JSON (--json FILE
 * or stdout). Threads: one.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrecall.h"
#include "../bench_common.h"
#include "../../gpu/backend.h"
#include "../../gpu/gpu.h"
#include "../../layouts/half.h"

/* ------------------------------------------------------------------ set-up */

static struct kvr_dev *g_dev;

static void die(const char *what)
{
	fprintf(stderr, "cuda_bench: %s failed: %s\n", what, g_dev ? kvr_dev_last_error(g_dev) : "");
	exit(1);
}

#define CK(call)                 \
	do {                     \
		if ((call) != 0) \
			die(#call); \
	} while (0)

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng(void)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return rng_state;
}

/* f16 values in [-1, 1) in steps of 1/1024, from a table (fast to fill GiBs). */
static uint16_t f16_table[2048];
static void fill_f16(uint16_t *p, uint64_t n)
{
	for (uint64_t i = 0; i < n; i += 4) {
		const uint64_t r = rng();
		for (uint64_t j = 0; j < 4 && i + j < n; j++)
			p[i + j] = f16_table[(r >> (16 * j)) & 2047];
	}
}

static void *dalloc(size_t bytes)
{
	void *p = NULL;
	CK(kvr_dev_alloc(g_dev, bytes, &p));
	return p;
}

static void upload(void *dst, const void *src, size_t bytes, struct kvr_stream *s)
{
	CK(kvr_dev_memcpy_async(g_dev, dst, src, bytes, KVR_COPY_H2D, s));
	CK(kvr_dev_stream_synchronize(g_dev, s));
}

static void download(void *dst, const void *src, size_t bytes, struct kvr_stream *s)
{
	CK(kvr_dev_memcpy_async(g_dev, dst, src, bytes, KVR_COPY_D2H, s));
	CK(kvr_dev_stream_synchronize(g_dev, s));
}

/* ------------------------------------------------------------------ timing */

typedef void (*op_fn)(void *ctx, uint32_t iter);

struct timing {
	double per_op_s;       /* median over reps of (iters back to back + sync) / iters */
	double latency_s;      /* median of one op + kvr_dev_stream_synchronize */
	double latency_spin_s; /* median of one op + an event polled with event_query */
};

static struct kvr_event *g_poll; /* time_op's polled event */
static int g_quick;              /* --quick: two operations per timed run */

static void sync_all(struct kvr_stream *const *streams, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++)
		CK(kvr_dev_stream_synchronize(g_dev, streams[i]));
}

static struct timing time_op(op_fn fn, void *ctx, struct kvr_stream *const *streams,
			     uint32_t n_streams, uint32_t iters, uint32_t reps)
{
	double *v = calloc(reps, sizeof(double));
	uint32_t it = 0;
	if (g_quick)
		iters = 2;
	for (uint32_t w = 0; w < 2 * iters; w++)
		fn(ctx, it++);
	sync_all(streams, n_streams);
	for (uint32_t r = 0; r < reps; r++) {
		const double t0 = bench_now_s();
		for (uint32_t i = 0; i < iters; i++)
			fn(ctx, it++);
		sync_all(streams, n_streams);
		v[r] = (bench_now_s() - t0) / iters;
	}
	struct timing t = { bench_median(v, reps), 0, 0 };
	for (uint32_t r = 0; r < reps; r++) {
		const double t0 = bench_now_s();
		fn(ctx, it++);
		sync_all(streams, n_streams);
		v[r] = bench_now_s() - t0;
	}
	t.latency_s = bench_median(v, reps);
	/* the same with a busy poll: the difference is the cost of the blocking
	 * wait's wake-up (stream_synchronize spins only briefly, then sleeps) */
	for (uint32_t r = 0; r < reps; r++) {
		const double t0 = bench_now_s();
		fn(ctx, it++);
		CK(kvr_dev_event_record(g_dev, g_poll, streams[n_streams - 1]));
		int q;
		while ((q = kvr_dev_event_query(g_dev, g_poll)) == -EAGAIN)
			;
		if (q)
			die("kvr_dev_event_query");
		v[r] = bench_now_s() - t0;
	}
	t.latency_spin_s = bench_median(v, reps);
	sync_all(streams, n_streams);
	free(v);
	return t;
}

/* ------------------------------------------------------------------ ops */

struct copy_ctx {
	void *dst;
	const unsigned char *src;
	size_t bytes;
	uint64_t src_span; /* rotate the source over this many bytes (0: fixed) */
	uint32_t kind;
	struct kvr_stream *s;
};

static void copy_op(void *p, uint32_t iter)
{
	struct copy_ctx *c = p;
	const uint64_t slots = c->src_span ? c->src_span / c->bytes : 1;
	CK(kvr_dev_memcpy_async(g_dev, c->dst, c->src + (iter % slots) * c->bytes, c->bytes, c->kind,
				c->s));
}

struct att_ctx {
	const struct kvr_shape *shape;
	struct kvr_attention_item *const *items; /* per page-list set, device */
	struct kvr_kv_segment *const *segs;      /* per set, device */
	uint32_t n_sets, batch, n_segs;
	struct kvr_stream *s;
};

static void att_op(void *p, uint32_t iter)
{
	struct att_ctx *c = p;
	const uint32_t set = iter % c->n_sets;
	CK(kvr_dev_attention(g_dev, c->shape, c->items[set], c->batch, c->segs[set], c->n_segs, c->s));
}

struct sel_ctx {
	const struct kvr_shape *shape;
	const struct kvr_score_item *items; /* device */
	uint32_t n;
	int score, select;
	struct kvr_stream *s;
};

static void sel_op(void *p, uint32_t iter)
{
	(void)iter;
	struct sel_ctx *c = p;
	if (c->score)
		CK(kvr_dev_score(g_dev, c->shape, c->items, c->n, c->s));
	if (c->select)
		CK(kvr_dev_select(g_dev, c->shape, c->items, c->n, c->s));
}

#define RECALL_SETS 8

/* One recall chunk size: `runs` KV-head runs per chunk, RECALL_SETS random
 * chunks rotated. */
struct recall_ctx {
	const struct kvr_shape *shape;
	uint32_t runs;
	const unsigned char *pool; /* host, registered */
	unsigned char *staging[2]; /* device, runs · run_bytes each */
	struct kvr_copy_desc *descs[RECALL_SETS];         /* host */
	struct kvr_scatter_item *items[RECALL_SETS][2]; /* device: from staging[b] */
	struct kvr_scatter_item *zc_items[RECALL_SETS]; /* device: from the host pool */
	struct kvr_stream *copy_s, *scatter_s;
	struct kvr_event *copied[2], *freed[2];
	int do_copy, do_scatter, pipelined, zero_copy, copy_loop;
};

static void recall_op(void *p, uint32_t iter)
{
	struct recall_ctx *c = p;
	const uint32_t set = iter % RECALL_SETS;
	if (c->zero_copy) { /* the scatter kernel reads the mapped pinned pool itself */
		CK(kvr_dev_scatter(g_dev, c->shape, c->zc_items[set], c->runs, c->copy_s));
		return;
	}
	if (c->copy_loop) { /* one kvr_dev_memcpy_async per run: the batch API's fallback */
		for (uint32_t i = 0; i < c->runs; i++)
			CK(kvr_dev_memcpy_async(g_dev, c->staging[0] + c->descs[set][i].dst_offset,
						c->pool + c->descs[set][i].src_offset,
						c->descs[set][i].bytes, KVR_COPY_H2D, c->copy_s));
		return;
	}
	if (!c->pipelined) {
		if (c->do_copy)
			CK(kvr_dev_memcpy_batch_async(g_dev, c->staging[0], c->pool, c->descs[set], c->runs,
						      KVR_COPY_H2D, c->copy_s));
		if (c->do_scatter)
			CK(kvr_dev_scatter(g_dev, c->shape, c->items[set][0], c->runs, c->copy_s));
		return;
	}
	/* two staging buffers: the copy into b waits for the scatter that last
	 * read b; the scatter from b waits for its copy */
	const uint32_t b = iter & 1;
	CK(kvr_dev_stream_wait_event(g_dev, c->copy_s, c->freed[b]));
	CK(kvr_dev_memcpy_batch_async(g_dev, c->staging[b], c->pool, c->descs[set], c->runs,
				      KVR_COPY_H2D, c->copy_s));
	CK(kvr_dev_event_record(g_dev, c->copied[b], c->copy_s));
	CK(kvr_dev_stream_wait_event(g_dev, c->scatter_s, c->copied[b]));
	CK(kvr_dev_scatter(g_dev, c->shape, c->items[set][b], c->runs, c->scatter_s));
	CK(kvr_dev_event_record(g_dev, c->freed[b], c->scatter_s));
}

/* ------------------------------------------------------------------ main */

struct options {
	uint32_t batch, budget_tokens, reps;
	uint64_t pool_bytes;
	uint32_t chunks[8], n_chunks;
	int32_t device;
	uint32_t kind; /* KVR_DEV_CUDA; --cpu checks the driver itself on the cpu backend */
	uint32_t max_context;
	const char *json_path;
};

static void usage(void)
{
	fprintf(stderr, "usage: cuda_bench [--batch 8] [--budget 2048] [--pool-mib 1024] "
			"[--chunks 8,64,512] [--reps 15] [--device 0] [--json FILE] [--cpu] [--quick]\n"
			"  --quick: few repetitions, a 64 MiB pool and contexts up to 16K (for "
			"compute-sanitizer runs; not a benchmark)\n"
			"  --cpu: run everything on the cpu backend instead (checks this program "
			"without a GPU; not a benchmark)\n");
}

static double gbps(double bytes, double s)
{
	return s > 0 ? bytes / s / 1e9 : 0.0;
}

int main(int argc, char **argv)
{
	struct options opt = { .batch = 8, .budget_tokens = 2048, .reps = 15,
			       .pool_bytes = 1024ull << 20, .chunks = { 8, 64, 512 }, .n_chunks = 3,
			       .kind = KVR_DEV_CUDA, .max_context = 131072 };
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(a, "--batch") && v) {
			opt.batch = (uint32_t)atoi(v), i++;
		} else if (!strcmp(a, "--budget") && v) {
			opt.budget_tokens = (uint32_t)atoi(v), i++;
		} else if (!strcmp(a, "--pool-mib") && v) {
			opt.pool_bytes = strtoull(v, NULL, 10) << 20, i++;
		} else if (!strcmp(a, "--chunks") && v) {
			if (bench_parse_list(v, opt.chunks, 8, &opt.n_chunks))
				return usage(), 2;
			i++;
		} else if (!strcmp(a, "--reps") && v) {
			opt.reps = (uint32_t)atoi(v), i++;
		} else if (!strcmp(a, "--device") && v) {
			opt.device = atoi(v), i++;
		} else if (!strcmp(a, "--json") && v) {
			opt.json_path = v, i++;
		} else if (!strcmp(a, "--cpu")) {
			opt.kind = KVR_DEV_CPU;
		} else if (!strcmp(a, "--quick")) {
			g_quick = 1;
			opt.reps = 3, opt.pool_bytes = 64ull << 20, opt.max_context = 16384;
		} else {
			return usage(), 2;
		}
	}
	if (opt.reps < 3)
		opt.reps = 3;
	if (opt.batch == 0 || opt.budget_tokens < 32 || opt.budget_tokens % 32)
		return usage(), 2;

	FILE *json = opt.json_path ? fopen(opt.json_path, "w") : stdout;
	if (!json) {
		fprintf(stderr, "cuda_bench: cannot write %s: %s\n", opt.json_path, strerror(errno));
		return 1;
	}

	char err[256] = "";
	const struct kvr_dev_params dp = { .kind = opt.kind, .device = opt.device };
	const int rc = kvr_dev_create(&dp, &g_dev, err, sizeof(err));
	if (rc == -ENODEV) {
		fprintf(stderr, "cuda_bench: skipped: no GPU (%s)\n", err);
		fprintf(json, "{\n  \"benchmark\": \"cuda\",\n  \"kvrecall_version\": \"%s\",\n"
			      "  \"skipped\": \"no GPU\"\n}\n",
			kvr_version_string());
		if (json != stdout)
			fclose(json);
		return 0;
	}
	if (rc) {
		fprintf(stderr, "cuda_bench: kvr_dev_create: %s\n", err);
		return 1;
	}
	struct kvr_gpu_probe probe;
	kvr_gpu_probe(&probe);

	const uint32_t n_kv = 8, n_qo = 32, d = 128, p = 32, t = KVR_ELEM_F16;
	const uint32_t B = opt.budget_tokens, batch = opt.batch, pages_per_seq = B / p;
	const uint64_t run_bytes = 2ull * p * d * 2;          /* one KV head's HND run */
	const uint64_t page_bytes = run_bytes * n_kv;         /* HND page = K tile + V tile */
	const uint64_t tile_bytes = (uint64_t)p * n_kv * d * 2; /* one NHD tile */
	const uint32_t n_pages = (uint32_t)(opt.pool_bytes / page_bytes);
	const struct kvr_shape shape = { n_qo, n_kv, d, p, t, 1.0f / sqrtf((float)d), 0.9f, 0, 0, 0, 0 };
	for (uint32_t i = 0; i < 2048; i++)
		f16_table[i] = kvr_f32_to_f16((float)((int32_t)i - 1024) / 1024.0f);

	fprintf(stderr, "cuda_bench: %s, pool %u pages of %llu KiB (%llu MiB), B=%u, batch %u\n",
		opt.kind == KVR_DEV_CUDA ? probe.name : "cpu backend (--cpu)", n_pages,
		(unsigned long long)(page_bytes >> 10), (unsigned long long)(opt.pool_bytes >> 20), B, batch);
	fprintf(json, "{\n  \"benchmark\": \"cuda\",\n  \"kvrecall_version\": \"%s\",\n",
		kvr_version_string());
	fprintf(json, "  \"device\": {\"name\": \"%s\", \"pci_bus_id\": \"%s\", \"cuda_runtime\": %d, "
		      "\"archs\": \"%s\"},\n",
		opt.kind == KVR_DEV_CUDA ? probe.name : "cpu backend (--cpu)", probe.pci_bus_id,
		probe.runtime_version, kvr_gpu_compiled_archs());
	fprintf(json, "  \"shape\": {\"n_kv_heads\": %u, \"n_qo_heads\": %u, \"head_dim\": %u, "
		      "\"page_tokens\": %u, \"dtype\": \"f16\", \"budget_tokens\": %u, \"batch\": %u, "
		      "\"pool_bytes\": %llu, \"reps\": %u},\n",
		n_kv, n_qo, d, p, B, batch, (unsigned long long)opt.pool_bytes, opt.reps);

	struct kvr_stream *s0, *s1;
	CK(kvr_dev_stream_create(g_dev, KVR_STREAM_WORKER, &s0));
	CK(kvr_dev_stream_create(g_dev, KVR_STREAM_WORKER, &s1));
	CK(kvr_dev_event_create(g_dev, &g_poll));

	/* The pool: random f16 pages, on the host (pinned: the recall source) and
	 * on the device (attention reads it as NHD tile pairs or HND pages). */
	unsigned char *hpool = bench_huge_alloc("cuda_bench", (size_t)n_pages * page_bytes);
	fill_f16((uint16_t *)hpool, (uint64_t)n_pages * page_bytes / 2);
	CK(kvr_dev_host_register(g_dev, hpool, (size_t)n_pages * page_bytes));
	unsigned char *dpool = dalloc((size_t)n_pages * page_bytes);
	upload(dpool, hpool, (size_t)n_pages * page_bytes, s0);

	/* ---- ceilings ---- */
	const size_t big = 256u << 20;
	unsigned char *dbig = dalloc(2 * big);
	struct copy_ctx d2d = { dbig + big, dbig, big, 0, KVR_COPY_D2D, s0 };
	const struct timing t_d2d = time_op(copy_op, &d2d, &s0, 1, 4, opt.reps);
	const size_t h2d_bytes = 64u << 20;
	struct copy_ctx h2d = { dbig, hpool, h2d_bytes, (uint64_t)n_pages * page_bytes, KVR_COPY_H2D,
				s0 };
	const struct timing t_h2d = time_op(copy_op, &h2d, &s0, 1, 4, opt.reps);
	const double d2d_gbps = gbps(2.0 * big, t_d2d.per_op_s), h2d_gbps = gbps(h2d_bytes, t_h2d.per_op_s);
	fprintf(stderr, "ceilings: D2D copy %.0f GB/s (read + write, %zu MiB); pinned H2D %.1f GB/s "
			"(%zu MiB)\n",
		d2d_gbps, big >> 20, h2d_gbps, h2d_bytes >> 20);
	fprintf(json, "  \"ceilings\": {\"d2d_copy_gbps_read_plus_write\": %.2f, \"d2d_bytes\": %zu, "
		      "\"h2d_pinned_gbps\": %.3f, \"h2d_bytes\": %zu},\n",
		d2d_gbps, big, h2d_gbps, h2d_bytes);

	/* ---- attention ---- */
	enum { SETS = 4 };
	const uint32_t n_segs = batch * pages_per_seq;
	const uint64_t qo_elems = (uint64_t)batch * n_qo * d;
	uint16_t *hq = calloc(qo_elems, 2), *hout = calloc(qo_elems, 2), *ref_out = calloc(qo_elems, 2);
	fill_f16(hq, qo_elems);
	uint16_t *dq = dalloc(qo_elems * 2), *dout = dalloc(qo_elems * 2);
	upload(dq, hq, qo_elems * 2, s0);
	uint32_t *page_of = calloc((size_t)SETS * n_segs, sizeof(uint32_t));
	for (uint32_t i = 0; i < SETS * n_segs; i++)
		page_of[i] = (uint32_t)(rng() % n_pages);
	const uint64_t kv_bytes = (uint64_t)n_segs * n_kv * run_bytes;
	struct kvr_cpu_ref {
		struct kvr_dev *dev;
		struct kvr_stream *s;
	} cpu = { 0 };
	{
		const struct kvr_dev_params cp = { .kind = KVR_DEV_CPU };
		char e2[256];
		if (kvr_dev_create(&cp, &cpu.dev, e2, sizeof(e2)) ||
		    kvr_dev_stream_create(cpu.dev, KVR_STREAM_INLINE, &cpu.s)) {
			fprintf(stderr, "cuda_bench: cpu backend: %s\n", e2);
			return 1;
		}
	}
	fprintf(json, "  \"attention\": [\n");
	double att_nhd_s = 0;
	for (uint32_t layout = 0; layout < 2; layout++) { /* 0: NHD slot tiles, 1: HND pages */
		struct kvr_attention_item *items_d[SETS];
		struct kvr_kv_segment *segs_d[SETS];
		struct kvr_kv_segment *hsegs = calloc(n_segs, sizeof(*hsegs));
		struct kvr_attention_item *hitems = calloc(batch, sizeof(*hitems));
		for (uint32_t set = 0; set < SETS; set++) {
			for (int host = 1; host >= 0; host--) {
				/* host: the cpu reference's view (set 0); device: the kernel's */
				unsigned char *base = host ? hpool : dpool;
				for (uint32_t i = 0; i < n_segs; i++) {
					unsigned char *pg = base + (uint64_t)page_of[set * n_segs + i] * page_bytes;
					hsegs[i] = layout == 0
							   ? (struct kvr_kv_segment){ pg, pg + tile_bytes, p, { n_kv * d }, d, 0 }
							   : (struct kvr_kv_segment){ pg, pg + (uint64_t)p * d * 2, p, { d },
										      2 * p * d, 0 };
				}
				for (uint32_t s = 0; s < batch; s++)
					hitems[s] = (struct kvr_attention_item){
						(host ? hq : dq) + (uint64_t)s * n_qo * d,
						(host ? ref_out : dout) + (uint64_t)s * n_qo * d,
						NULL, s * pages_per_seq, pages_per_seq };
				if (host && set == 0) {
					CK(kvr_dev_attention(cpu.dev, &shape, hitems, batch, hsegs, n_segs, cpu.s));
					CK(kvr_dev_stream_synchronize(cpu.dev, cpu.s));
				}
			}
			segs_d[set] = dalloc(n_segs * sizeof(*hsegs));
			items_d[set] = dalloc(batch * sizeof(*hitems));
			upload(segs_d[set], hsegs, n_segs * sizeof(*hsegs), s0);
			upload(items_d[set], hitems, batch * sizeof(*hitems), s0);
		}
		/* correctness: set 0 against the cpu backend */
		CK(kvr_dev_attention(g_dev, &shape, items_d[0], batch, segs_d[0], n_segs, s0));
		download(hout, dout, qo_elems * 2, s0);
		double max_err = 0;
		for (uint64_t i = 0; i < qo_elems; i++) {
			const double e = fabs((double)kvr_f16_to_f32(hout[i]) - kvr_f16_to_f32(ref_out[i]));
			if (!(e <= max_err))
				max_err = e;
		}
		struct att_ctx ac = { &shape, items_d, segs_d, SETS, batch, n_segs, s0 };
		const struct timing ta = time_op(att_op, &ac, &s0, 1, 20, opt.reps);
		if (layout == 0)
			att_nhd_s = ta.per_op_s;
		const char *name = layout == 0 ? "nhd_slots" : "hnd_pages";
		fprintf(stderr, "attention %-9s: %7.1f us per call (%u sequences x %u KV heads x %u tokens), "
				"%6.0f GB/s of K+V = %.3f of the D2D copy rate; latency %.1f us (polled %.1f us); "
				"max |err| vs cpu %.2g\n",
			name, ta.per_op_s * 1e6, batch, n_kv, B, gbps(kv_bytes, ta.per_op_s),
			gbps(kv_bytes, ta.per_op_s) / d2d_gbps, ta.latency_s * 1e6, ta.latency_spin_s * 1e6,
			max_err);
		fprintf(json, "    {\"layout\": \"%s\", \"kv_bytes\": %llu, \"us_per_call\": %.2f, "
			      "\"us_per_sequence_layer\": %.3f, \"gbps\": %.2f, \"ratio_to_d2d_copy\": %.4f, "
			      "\"latency_us\": %.2f, \"latency_polled_us\": %.2f, \"max_abs_err_vs_cpu\": %.3g}%s\n",
			name, (unsigned long long)kv_bytes, ta.per_op_s * 1e6, ta.per_op_s * 1e6 / batch,
			gbps(kv_bytes, ta.per_op_s), gbps(kv_bytes, ta.per_op_s) / d2d_gbps,
			ta.latency_s * 1e6, ta.latency_spin_s * 1e6, max_err, layout == 0 ? "," : "");
		for (uint32_t set = 0; set < SETS; set++) {
			kvr_dev_free(g_dev, segs_d[set]);
			kvr_dev_free(g_dev, items_d[set]);
		}
		free(hsegs), free(hitems);
	}
	fprintf(json, "  ],\n  \"selection\": [\n");

	/* ---- selection: score + select, batch sequences, contexts 8K..128K ---- */
	static const uint32_t contexts[] = { 8192, 16384, 32768, 65536, 131072 };
	uint32_t n_ctx = sizeof(contexts) / sizeof(contexts[0]);
	while (n_ctx > 1 && contexts[n_ctx - 1] > opt.max_context)
		n_ctx--;
	const uint32_t max_pages = contexts[n_ctx - 1] / p;
	const uint32_t sink_pages = 512 / p, window_pages = 512 / p;
	const uint32_t k = B > 1024 ? (B - 1024) / p : 0;
	const uint64_t sum_elems = (uint64_t)batch * max_pages * n_kv * 2 * d;
	uint16_t *hsum = bench_huge_alloc("cuda_bench", sum_elems * 2);
	for (uint64_t i = 0; i < sum_elems; i += 2 * d) /* per (page, head): min row, max row */
		for (uint32_t c = 0; c < d; c++) {
			const uint16_t a = f16_table[rng() & 2047], b2 = f16_table[rng() & 2047];
			const int lo = kvr_f16_to_f32(a) <= kvr_f16_to_f32(b2);
			hsum[i + c] = lo ? a : b2;
			hsum[i + d + c] = lo ? b2 : a;
		}
	uint16_t *dsum = dalloc(sum_elems * 2);
	upload(dsum, hsum, sum_elems * 2, s0);
	const uint64_t score_elems = (uint64_t)batch * n_kv * max_pages;
	float *dscores = dalloc(score_elems * 4), *hscores = calloc(score_elems, 4);
	int32_t *dsel = dalloc((size_t)batch * n_kv * (k ? k : 1) * 4);
	int32_t *hsel = calloc((size_t)batch * n_kv * (k ? k : 1), 4);
	int32_t *gsel = calloc((size_t)batch * n_kv * (k ? k : 1), 4);
	struct kvr_score_item *sitems = calloc(batch, sizeof(*sitems));
	struct kvr_score_item *sitems_d = dalloc(batch * sizeof(*sitems));
	for (uint32_t c = 0; c < n_ctx; c++) {
		const uint32_t pages = contexts[c] / p;
		const uint32_t cand_end = pages > window_pages + sink_pages ? pages - window_pages : sink_pages;
		/* the cpu reference on host copies, then the device items */
		for (int host = 1; host >= 0; host--) {
			for (uint32_t s = 0; s < batch; s++)
				sitems[s] = (struct kvr_score_item){
					(host ? hq : dq) + (uint64_t)s * n_qo * d,
					(host ? hsum : dsum) + (uint64_t)s * max_pages * n_kv * 2 * d,
					(host ? hscores : dscores) + (uint64_t)s * n_kv * max_pages,
					(host ? hsel : dsel) + (uint64_t)s * n_kv * k, sink_pages, cand_end, k,
					pages /* softmax over every page, as the scheduler */, NULL };
			if (host) {
				CK(kvr_dev_score(cpu.dev, &shape, sitems, batch, cpu.s));
				CK(kvr_dev_select(cpu.dev, &shape, sitems, batch, cpu.s));
				CK(kvr_dev_stream_synchronize(cpu.dev, cpu.s));
			}
		}
		upload(sitems_d, sitems, batch * sizeof(*sitems), s0);
		CK(kvr_dev_score(g_dev, &shape, sitems_d, batch, s0));
		CK(kvr_dev_select(g_dev, &shape, sitems_d, batch, s0));
		download(gsel, dsel, (size_t)batch * n_kv * k * 4, s0);
		const int same = !memcmp(gsel, hsel, (size_t)batch * n_kv * k * 4);
		struct sel_ctx sc = { &shape, sitems_d, batch, 1, 0, s0 };
		const struct timing t_score = time_op(sel_op, &sc, &s0, 1, 20, opt.reps);
		sc = (struct sel_ctx){ &shape, sitems_d, batch, 0, 1, s0 };
		const struct timing t_select = time_op(sel_op, &sc, &s0, 1, 20, opt.reps);
		sc = (struct sel_ctx){ &shape, sitems_d, batch, 1, 1, s0 };
		const struct timing t_both = time_op(sel_op, &sc, &s0, 1, 20, opt.reps);
		const uint32_t cand = cand_end - sink_pages;
		const double sum_bytes = (double)batch * cand * n_kv * 2 * d * 2;
		fprintf(stderr, "selection L=%6u (%4u candidate pages x %u seqs): score %6.1f us, select %6.1f "
				"us, both %6.1f us (latency %6.1f, polled %6.1f us) = %.2f x attention; summaries "
				"%5.0f GB/s (1 pass); selection %s the cpu backend's\n",
			contexts[c], cand, batch, t_score.per_op_s * 1e6, t_select.per_op_s * 1e6,
			t_both.per_op_s * 1e6, t_both.latency_s * 1e6, t_both.latency_spin_s * 1e6,
			att_nhd_s > 0 ? t_both.per_op_s / att_nhd_s : 0.0, gbps(sum_bytes, t_score.per_op_s),
			same ? "identical to" : "DIFFERS from");
		fprintf(json, "    {\"context_tokens\": %u, \"candidate_pages\": %u, \"batch\": %u, \"k\": %u, "
			      "\"score_us\": %.2f, \"select_us\": %.2f, \"score_select_us\": %.2f, "
			      "\"score_select_latency_us\": %.2f, \"score_select_latency_polled_us\": %.2f, "
			      "\"ratio_to_attention\": %.4f, \"same_selection_as_cpu\": %s}%s\n",
			contexts[c], cand, batch, k, t_score.per_op_s * 1e6, t_select.per_op_s * 1e6,
			t_both.per_op_s * 1e6, t_both.latency_s * 1e6, t_both.latency_spin_s * 1e6,
			att_nhd_s > 0 ? t_both.per_op_s / att_nhd_s : 0.0, same ? "true" : "false",
			c + 1 < n_ctx ? "," : "");
	}
	fprintf(json, "  ],\n  \"recall\": [\n");

	/* ---- recall: pinned pool runs -> staging (batched copy) -> NHD slots ---- */
	uint32_t max_runs = 0;
	for (uint32_t i = 0; i < opt.n_chunks; i++)
		max_runs = opt.chunks[i] > max_runs ? opt.chunks[i] : max_runs;
	unsigned char *staging[2] = { dalloc((size_t)max_runs * run_bytes),
				      dalloc((size_t)max_runs * run_bytes) };
	const uint32_t n_tiles = n_pages; /* the slot tiles: dpool as K/V tile pairs */
	unsigned char *tile_back = malloc(2 * tile_bytes);
	for (uint32_t ci = 0; ci < opt.n_chunks; ci++) {
		const uint32_t runs = opt.chunks[ci];
		struct recall_ctx rc2 = { .shape = &shape, .runs = runs, .pool = hpool,
					  .staging = { staging[0], staging[1] }, .copy_s = s0, .scatter_s = s1 };
		struct kvr_scatter_item *hit = calloc(runs, sizeof(*hit));
		struct kvr_scatter_item *check_items = calloc(runs, sizeof(*hit)); /* set 0 */
		for (uint32_t set = 0; set < RECALL_SETS; set++) {
			rc2.descs[set] = calloc(runs, sizeof(struct kvr_copy_desc));
			const uint32_t tile0 = (uint32_t)(rng() % n_tiles);
			for (uint32_t i = 0; i < runs; i++) {
				const uint64_t pg = rng() % n_pages, head = rng() % n_kv;
				rc2.descs[set][i] = (struct kvr_copy_desc){ pg * page_bytes + head * run_bytes,
									    (uint64_t)i * run_bytes, run_bytes };
			}
			for (uint32_t b = 0; b < 3; b++) { /* staging 0, staging 1, zero-copy */
				for (uint32_t i = 0; i < runs; i++) {
					/* distinct (tile, head) slots within a chunk */
					unsigned char *tile =
						dpool + (uint64_t)((tile0 + (i / n_kv) * 7919u) % n_tiles) * page_bytes;
					const unsigned char *src = b < 2 ? staging[b] + (uint64_t)i * run_bytes
									 : hpool + rc2.descs[set][i].src_offset;
					hit[i] = (struct kvr_scatter_item){ src, tile, tile + tile_bytes, i % n_kv, 0 };
				}
				if (set == 0 && b == 0)
					memcpy(check_items, hit, runs * sizeof(*hit));
				struct kvr_scatter_item *dst = dalloc(runs * sizeof(*hit));
				upload(dst, hit, runs * sizeof(*hit), s0);
				if (b < 2)
					rc2.items[set][b] = dst;
				else
					rc2.zc_items[set] = dst;
			}
		}
		for (uint32_t b = 0; b < 2; b++) {
			CK(kvr_dev_event_create(g_dev, &rc2.copied[b]));
			CK(kvr_dev_event_create(g_dev, &rc2.freed[b]));
		}
		/* correctness of both paths, once: set 0 through staging, then
		 * through zero-copy, each followed by a read-back of slot rows
		 * compared with the pool's runs (the slots are scribbled on first) */
		int recall_ok[2] = { 1, 1 };
		for (uint32_t path = 0; path < 2; path++) {
			memset(tile_back, 0x5a, 2 * tile_bytes);
			for (uint32_t i = 0; i < runs; i++) {
				upload(check_items[i].k_tile, tile_back, tile_bytes, s0);
				upload(check_items[i].v_tile, tile_back, tile_bytes, s0);
			}
			rc2.do_copy = rc2.do_scatter = 1, rc2.zero_copy = (int)path;
			recall_op(&rc2, 0);
			CK(kvr_dev_stream_synchronize(g_dev, s0));
			for (uint32_t i = 0; i < runs && recall_ok[path]; i += runs > 16 ? runs / 16 : 1) {
				const struct kvr_scatter_item *it = &check_items[i];
				download(tile_back, it->k_tile, tile_bytes, s0);
				download(tile_back + tile_bytes, it->v_tile, tile_bytes, s0);
				const unsigned char *run = hpool + rc2.descs[0][i].src_offset;
				for (uint32_t r = 0; r < 2 * p && recall_ok[path]; r++) {
					const unsigned char *want = run + (uint64_t)r * d * 2;
					const unsigned char *got = tile_back + (r >= p ? tile_bytes : 0) +
								   (uint64_t)(r % p) * n_kv * d * 2 +
								   (uint64_t)it->kv_head * d * 2;
					recall_ok[path] = !memcmp(want, got, d * 2);
				}
			}
		}
		rc2.zero_copy = 0;
		const uint64_t bytes = (uint64_t)runs * run_bytes;
		const uint32_t iters = (uint32_t)((64ull << 20) / bytes) < 4 ? 4 : (uint32_t)((64ull << 20) / bytes);
		struct copy_ctx single = { staging[0], hpool, bytes, (uint64_t)n_pages * page_bytes,
					   KVR_COPY_H2D, s0 };
		const struct timing t_single = time_op(copy_op, &single, &s0, 1, iters, opt.reps);
		rc2.do_copy = 1, rc2.do_scatter = 0;
		const struct timing t_batch = time_op(recall_op, &rc2, &s0, 1, iters, opt.reps);
		rc2.copy_loop = 1;
		const struct timing t_loop = time_op(recall_op, &rc2, &s0, 1, iters, opt.reps);
		rc2.copy_loop = 0;
		rc2.do_copy = 0, rc2.do_scatter = 1;
		const struct timing t_scatter = time_op(recall_op, &rc2, &s0, 1, iters, opt.reps);
		rc2.do_copy = 1, rc2.do_scatter = 1;
		const struct timing t_serial = time_op(recall_op, &rc2, &s0, 1, iters, opt.reps);
		rc2.pipelined = 1;
		struct kvr_stream *both[2] = { s0, s1 };
		const struct timing t_pipe = time_op(recall_op, &rc2, both, 2, iters, opt.reps);
		rc2.pipelined = 0, rc2.zero_copy = 1;
		const struct timing t_zc = time_op(recall_op, &rc2, &s0, 1, iters, opt.reps);
		const double per64 = 64.0 / runs;
		fprintf(stderr, "recall %4u runs (%5.2f MiB), us per chunk [GB/s]: single H2D %6.1f [%4.1f] | "
				"batch copy %6.1f [%4.1f] | copy loop %6.1f [%4.1f] | scatter %5.1f | "
				"copy+scatter %6.1f [%4.1f] | two buffers %6.1f [%4.1f] = %.2f of the single copy | zero-copy scatter %6.1f [%4.1f] | per 64 "
				"runs: two buffers %.1f us, zero-copy %.1f us, single H2D %.1f us | check %s/%s\n",
			runs, bytes / 1048576.0, t_single.per_op_s * 1e6, gbps(bytes, t_single.per_op_s),
			t_batch.per_op_s * 1e6, gbps(bytes, t_batch.per_op_s), t_loop.per_op_s * 1e6,
			gbps(bytes, t_loop.per_op_s), t_scatter.per_op_s * 1e6, t_serial.per_op_s * 1e6,
			gbps(bytes, t_serial.per_op_s), t_pipe.per_op_s * 1e6,
			gbps(bytes, t_pipe.per_op_s), t_single.per_op_s / t_pipe.per_op_s,
			t_zc.per_op_s * 1e6, gbps(bytes, t_zc.per_op_s), t_pipe.per_op_s * per64 * 1e6,
			t_zc.per_op_s * per64 * 1e6, t_single.per_op_s * per64 * 1e6,
			recall_ok[0] ? "ok" : "FAILED", recall_ok[1] ? "ok" : "FAILED");
		fprintf(stderr, "        latency (one chunk + stream_synchronize / + polled event), us: single "
				"H2D %.1f / %.1f, batch copy %.1f / %.1f, copy+scatter %.1f / %.1f, two buffers "
				"%.1f / %.1f, zero-copy %.1f / %.1f\n",
			t_single.latency_s * 1e6, t_single.latency_spin_s * 1e6, t_batch.latency_s * 1e6,
			t_batch.latency_spin_s * 1e6, t_serial.latency_s * 1e6, t_serial.latency_spin_s * 1e6,
			t_pipe.latency_s * 1e6, t_pipe.latency_spin_s * 1e6, t_zc.latency_s * 1e6,
			t_zc.latency_spin_s * 1e6);
		const struct {
			const char *name;
			const struct timing *t;
		} rows[] = { { "single_h2d", &t_single }, { "batch_copy", &t_batch },
			     { "copy_loop", &t_loop },
			     { "scatter", &t_scatter },   { "copy_scatter", &t_serial },
			     { "two_buffer", &t_pipe },   { "zero_copy_scatter", &t_zc } };
		fprintf(json, "    {\"runs\": %u, \"run_bytes\": %llu, \"bytes\": %llu, \"check_ok\": %s, "
			      "\"zero_copy_check_ok\": %s, \"two_buffer_ratio_to_single_copy\": %.4f",
			runs, (unsigned long long)run_bytes, (unsigned long long)bytes,
			recall_ok[0] ? "true" : "false", recall_ok[1] ? "true" : "false",
			t_single.per_op_s / t_pipe.per_op_s);
		for (uint32_t r = 0; r < sizeof(rows) / sizeof(rows[0]); r++)
			fprintf(json, ",\n     \"%s\": {\"us\": %.2f, \"gbps\": %.3f, \"us_per_64_runs\": %.2f, "
				      "\"latency_us\": %.2f, \"latency_polled_us\": %.2f}",
				rows[r].name, rows[r].t->per_op_s * 1e6, gbps(bytes, rows[r].t->per_op_s),
				rows[r].t->per_op_s * per64 * 1e6, rows[r].t->latency_s * 1e6,
				rows[r].t->latency_spin_s * 1e6);
		fprintf(json, "}%s\n", ci + 1 < opt.n_chunks ? "," : "");
		for (uint32_t b = 0; b < 2; b++) {
			kvr_dev_event_destroy(g_dev, rc2.copied[b]);
			kvr_dev_event_destroy(g_dev, rc2.freed[b]);
		}
		for (uint32_t set = 0; set < RECALL_SETS; set++) {
			free(rc2.descs[set]);
			kvr_dev_free(g_dev, rc2.items[set][0]);
			kvr_dev_free(g_dev, rc2.items[set][1]);
			kvr_dev_free(g_dev, rc2.zc_items[set]);
		}
		free(hit), free(check_items);
	}
	free(tile_back);
	fprintf(json, "  ]\n}\n");
	if (json != stdout)
		fclose(json);

	kvr_dev_free(g_dev, staging[0]);
	kvr_dev_free(g_dev, staging[1]);
	kvr_dev_free(g_dev, sitems_d);
	kvr_dev_free(g_dev, dsel);
	kvr_dev_free(g_dev, dscores);
	kvr_dev_free(g_dev, dsum);
	kvr_dev_free(g_dev, dq);
	kvr_dev_free(g_dev, dout);
	kvr_dev_free(g_dev, dbig);
	kvr_dev_free(g_dev, dpool);
	CK(kvr_dev_host_unregister(g_dev, hpool));
	kvr_dev_stream_destroy(g_dev, s0);
	kvr_dev_stream_destroy(g_dev, s1);
	kvr_dev_stream_destroy(cpu.dev, cpu.s);
	kvr_dev_destroy(cpu.dev);
	kvr_dev_event_destroy(g_dev, g_poll);
	kvr_dev_destroy(g_dev);
	free(hpool), free(hq), free(hout), free(ref_out), free(page_of), free(hsum), free(hscores);
	free(hsel), free(gsel), free(sitems);
	return 0;
}
