/* SPDX-License-Identifier: MIT */
/*
 * pool_bench.c — host page pool throughput, as ratios to memcpy measured in the
 * same run (the machines are shared and noisy; absolute numbers across runs
 * mean little):
 *
 *   gather   random KV-head runs (one HND page of one KV head: 2·p·d elements,
 *            8 KiB at d=64, 16 KiB at d=128, f16) copied from a pool whose
 *            working set is at least 4x the last-level cache into a staging
 *            area, the next run prefetched while the current one is copied —
 *            what recall does on the host side;
 *   offload  NHD rows -> HND pool pages with their key summaries
 *            (kvr_pool_write_page) — what prefill and decode offload do;
 *
 * each divided by a bulk memcpy of the same bytes with the same thread count,
 * alternating the two measurements rep by rep.
 *
 * This driver measures internals (host/pool.h), so it links the static library
 * rather than only the public API as the `kvrecall` command does.
 *
 * Threads: the main thread is worker 0; workers 1.. are pthreads that meet it
 * at a barrier before and after every timed rep.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "kvrecall.h"
#include "../bench_common.h"
#include "../../host/pool.h"
#include "../../host/topology.h"
#include "../../layouts/convert.h"

#define MAX_THREADS 16

struct options {
	uint64_t working_set_bytes; /* pool size */
	uint64_t rep_bytes;         /* bytes moved per timed rep (all threads) */
	uint32_t reps;
	uint32_t threads[4], n_threads;
	uint32_t head_dims[4], n_head_dims;
	uint32_t prefetch;          /* 1: kvr_pool_gather_runs; 0: a plain memcpy per run */
	uint32_t compare_plain;     /* also measure the plain memcpy-per-run gather */
	const char *json_path;
};

enum op { OP_MEMCPY, OP_GATHER, OP_OFFLOAD };

struct worker {
	pthread_t thread;
	uint32_t index;
	struct bench *b;
};

struct bench {
	struct options *opt;
	struct kvr_pool *pool;
	struct kvr_page_geometry g;
	uint32_t n_threads;
	uint32_t n_pages;
	/* gather: per thread a list of (page, head) and a staging area */
	uint32_t *unit_page[MAX_THREADS];
	uint32_t *unit_head[MAX_THREADS];
	uint32_t units_per_thread;
	unsigned char *staging[MAX_THREADS];
	/* offload: per thread source rows and the logical pages it writes */
	unsigned char *rows[MAX_THREADS];
	uint32_t pages_per_thread;
	uint32_t offload_base[MAX_THREADS];
	/* memcpy: per thread a contiguous source inside the pool */
	unsigned char *memcpy_src[MAX_THREADS];
	uint64_t memcpy_bytes;

	enum op op;
	int quit;
	pthread_barrier_t start, done;
	struct worker workers[MAX_THREADS];
};


static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static uint32_t rng(void)
{
	rng_state ^= rng_state >> 12;
	rng_state ^= rng_state << 25;
	rng_state ^= rng_state >> 27;
	return (uint32_t)((rng_state * 0x2545f4914f6cdd1dull) >> 32);
}

static void run_op(struct bench *b, uint32_t t)
{
	const uint64_t hb = b->g.head_bytes;
	switch (b->op) {
	case OP_MEMCPY:
		memcpy(b->staging[t], b->memcpy_src[t], b->memcpy_bytes);
		break;
	case OP_GATHER: {
		const uint32_t n = b->units_per_thread;
		const uint32_t *pg = b->unit_page[t], *hd = b->unit_head[t];
		unsigned char *dst = b->staging[t];
		if (!b->opt->prefetch) { /* the baseline: one plain memcpy per run */
			for (uint32_t i = 0; i < n; i++)
				memcpy(dst + (uint64_t)i * hb,
				       (const unsigned char *)kvr_pool_page_data(b->pool, pg[i]) + hd[i] * hb,
				       hb);
			break;
		}
		kvr_pool_gather_runs(b->pool, pg, hd, n, dst);
		break;
	}
	case OP_OFFLOAD: {
		const uint64_t row = (uint64_t)b->g.n_kv_heads * b->g.head_dim;
		const uint64_t page_rows_bytes = row * b->g.page_tokens * b->g.elem_bytes;
		for (uint32_t i = 0; i < b->pages_per_thread; i++) {
			const unsigned char *k = b->rows[t] + (uint64_t)i * 2 * page_rows_bytes;
			int err = kvr_pool_write_page(b->pool, t, 0, b->offload_base[t] + i, k,
						      k + page_rows_bytes, row);
			if (err) {
				fprintf(stderr, "pool_bench: write_page: %s\n",
					kvr_pool_last_error(b->pool));
				exit(1);
			}
		}
		break;
	}
	}
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	struct bench *b = w->b;
	for (;;) {
		pthread_barrier_wait(&b->start);
		if (b->quit)
			return NULL;
		run_op(b, w->index);
		pthread_barrier_wait(&b->done);
	}
}

/* One timed rep of the current op on all threads; seconds. */
static double timed_rep(struct bench *b, enum op op)
{
	b->op = op;
	pthread_barrier_wait(&b->start);
	const double t0 = bench_now_s();
	run_op(b, 0);
	pthread_barrier_wait(&b->done);
	return bench_now_s() - t0;
}



struct result {
	const char *op;
	uint64_t unit_bytes;
	uint32_t threads;
	uint64_t bytes;
	double op_gbps, memcpy_gbps, ratio;
};

/* Alternate memcpy and `op` reps; ratio of median throughputs. */
static struct result measure(struct bench *b, enum op op, const char *name, uint64_t bytes,
			     uint64_t unit_bytes)
{
	double *t_op = calloc(b->opt->reps, sizeof(double)), *t_mc = calloc(b->opt->reps, sizeof(double));
	timed_rep(b, OP_MEMCPY); /* warm-up */
	timed_rep(b, op);
	for (uint32_t r = 0; r < b->opt->reps; r++) {
		t_mc[r] = timed_rep(b, OP_MEMCPY);
		t_op[r] = timed_rep(b, op);
	}
	struct result res = { name, unit_bytes, b->n_threads, bytes, 0, 0, 0 };
	res.op_gbps = (double)bytes / bench_median(t_op, b->opt->reps) / 1e9;
	res.memcpy_gbps = (double)bytes / bench_median(t_mc, b->opt->reps) / 1e9;
	res.ratio = res.op_gbps / res.memcpy_gbps;
	free(t_op);
	free(t_mc);
	return res;
}


static void usage(void)
{
	fprintf(stderr,
		"usage: pool_bench [--threads 1,2] [--head-dims 64,128] [--working-set-mib N]\n"
		"                  [--rep-mib N] [--reps N] [--no-prefetch] [--compare-plain] [--json FILE]\n"
		"  head dim 64 gives 8 KiB KV-head runs, 128 gives 16 KiB (p=32, f16, 8 KV heads)\n");
}

static int run_config(struct options *opt, uint32_t threads, uint32_t head_dim,
		      struct result *out, uint32_t *n_out, FILE *log)
{
	struct bench *b = calloc(1, sizeof(*b));
	b->opt = opt;
	b->n_threads = threads;
	kvr_page_geometry_init(&b->g, 32, head_dim, 8, KVR_ELEM_F16);
	struct kvr_pool_params pp = {
		.geometry = b->g,
		.n_layers = 1,
		.max_sequences = MAX_THREADS,
		.layout = KVR_POOL_LAYOUT_HND,
		.numa_node = kvr_numa_current_node(),
		.capacity_bytes = opt->working_set_bytes,
		.keep_summaries = 1,
	};
	char err[256];
	if (kvr_pool_create(&pp, &b->pool, err, sizeof(err))) {
		fprintf(stderr, "pool_bench: %s\n", err);
		return -1;
	}
	b->n_pages = (uint32_t)(opt->working_set_bytes / b->g.page_bytes);
	/* Each thread owns a sequence holding its share of the pool's pages. */
	const uint32_t per_seq = b->n_pages / threads;
	for (uint32_t t = 0; t < threads; t++) {
		if (kvr_pool_seq_open(b->pool, t) || kvr_pool_reserve(b->pool, t, 0, per_seq)) {
			fprintf(stderr, "pool_bench: %s\n", kvr_pool_last_error(b->pool));
			return -1;
		}
		for (uint32_t i = 0; i < per_seq; i++) { /* touch every page */
			uint32_t id;
			kvr_pool_lookup(b->pool, t, 0, i, &id);
			memset(kvr_pool_page_data(b->pool, id), (int)(i & 0x3f), b->g.page_bytes);
		}
	}

	const uint64_t per_thread = opt->rep_bytes / threads;
	b->units_per_thread = (uint32_t)(per_thread / b->g.head_bytes);
	b->memcpy_bytes = (uint64_t)b->units_per_thread * b->g.head_bytes;
	const uint64_t page_rows_bytes = b->g.page_bytes / 2;
	b->pages_per_thread = (uint32_t)(per_thread / b->g.page_bytes);
	for (uint32_t t = 0; t < threads; t++) {
		b->unit_page[t] = malloc(b->units_per_thread * sizeof(uint32_t));
		b->unit_head[t] = malloc(b->units_per_thread * sizeof(uint32_t));
		for (uint32_t i = 0; i < b->units_per_thread; i++) {
			uint32_t seq = rng() % threads, logical = rng() % per_seq;
			kvr_pool_lookup(b->pool, seq, 0, logical, &b->unit_page[t][i]);
			b->unit_head[t][i] = rng() % b->g.n_kv_heads;
		}
		b->staging[t] = aligned_alloc(2u << 20, (b->memcpy_bytes + (2u << 20)) & ~((2ull << 20) - 1));
		madvise(b->staging[t], b->memcpy_bytes, MADV_HUGEPAGE);
		memset(b->staging[t], 1, b->memcpy_bytes);
		/* The memcpy source: its own huge-page-backed buffer, as large as the
		 * bytes moved (pool chunks are separate mappings, so a run of pages
		 * is not one contiguous range). */
		b->memcpy_src[t] = aligned_alloc(2u << 20, (b->memcpy_bytes + (2u << 20)) & ~((2ull << 20) - 1));
		madvise(b->memcpy_src[t], b->memcpy_bytes, MADV_HUGEPAGE);
		memset(b->memcpy_src[t], 5, b->memcpy_bytes);
		b->rows[t] = aligned_alloc(4096, (uint64_t)b->pages_per_thread * b->g.page_bytes + 4096);
		memset(b->rows[t], 3, (uint64_t)b->pages_per_thread * b->g.page_bytes);
		b->offload_base[t] = rng() % (per_seq - b->pages_per_thread + 1);
	}
	(void)page_rows_bytes;

	pthread_barrier_init(&b->start, NULL, threads);
	pthread_barrier_init(&b->done, NULL, threads);
	for (uint32_t t = 1; t < threads; t++) {
		b->workers[t] = (struct worker){ 0, t, b };
		pthread_create(&b->workers[t].thread, NULL, worker_main, &b->workers[t]);
	}

	uint32_t n = 0;
	out[n++] = measure(b, OP_GATHER, "gather", b->memcpy_bytes * threads, b->g.head_bytes);
	if (opt->compare_plain) {
		opt->prefetch = 0;
		out[n++] = measure(b, OP_GATHER, "gather_plain_memcpy", b->memcpy_bytes * threads,
				   b->g.head_bytes);
		opt->prefetch = 1;
	}
	/* offload moves pages_per_thread whole pages per thread */
	const uint64_t saved = b->memcpy_bytes;
	b->memcpy_bytes = (uint64_t)b->pages_per_thread * b->g.page_bytes;
	out[n++] = measure(b, OP_OFFLOAD, "offload", b->memcpy_bytes * threads, b->g.page_bytes);
	b->memcpy_bytes = saved;
	for (uint32_t i = 0; i < n; i++)
		fprintf(log, "%-8s %6llu-byte units, %u thread%s: %6.2f GB/s, memcpy %6.2f GB/s, ratio %.3f\n",
			out[i].op, (unsigned long long)out[i].unit_bytes, threads, threads > 1 ? "s" : " ",
			out[i].op_gbps, out[i].memcpy_gbps, out[i].ratio);
	*n_out = n;

	b->quit = 1;
	pthread_barrier_wait(&b->start);
	for (uint32_t t = 1; t < threads; t++)
		pthread_join(b->workers[t].thread, NULL);
	pthread_barrier_destroy(&b->start);
	pthread_barrier_destroy(&b->done);
	for (uint32_t t = 0; t < threads; t++) {
		free(b->unit_page[t]), free(b->unit_head[t]), free(b->staging[t]), free(b->rows[t]);
		free(b->memcpy_src[t]);
	}
	kvr_pool_destroy(b->pool);
	free(b);
	return 0;
}

int main(int argc, char **argv)
{
	struct options opt = {
		.working_set_bytes = 0, .rep_bytes = 64ull << 20, .reps = 15, .prefetch = 1,
	};
	opt.threads[0] = 1, opt.threads[1] = 2, opt.n_threads = 2;
	opt.head_dims[0] = 64, opt.head_dims[1] = 128, opt.n_head_dims = 2;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(a, "--threads") && v) {
			if (bench_parse_list(v, opt.threads, 4, &opt.n_threads))
				return usage(), 2;
			for (uint32_t t = 0; t < opt.n_threads; t++)
				if (opt.threads[t] > MAX_THREADS)
					return usage(), 2;
			i++;
		} else if (!strcmp(a, "--head-dims") && v) {
			if (bench_parse_list(v, opt.head_dims, 4, &opt.n_head_dims))
				return usage(), 2;
			i++;
		} else if (!strcmp(a, "--working-set-mib") && v) {
			opt.working_set_bytes = strtoull(v, NULL, 10) << 20;
			i++;
		} else if (!strcmp(a, "--rep-mib") && v) {
			opt.rep_bytes = strtoull(v, NULL, 10) << 20;
			i++;
		} else if (!strcmp(a, "--reps") && v) {
			opt.reps = (uint32_t)strtoul(v, NULL, 10);
			i++;
		} else if (!strcmp(a, "--no-prefetch")) {
			opt.prefetch = 0;
		} else if (!strcmp(a, "--compare-plain")) {
			opt.compare_plain = 1;
		} else if (!strcmp(a, "--json") && v) {
			opt.json_path = v;
			i++;
		} else {
			usage();
			return 2;
		}
	}
	struct kvr_system_info sys = { .size = sizeof(sys) };
	kvr_system_query(&sys);
	const uint64_t llc = sys.l3_bytes ? sys.l3_bytes : (32ull << 20);
	if (!opt.working_set_bytes)
		opt.working_set_bytes = 16 * llc > (512ull << 20) ? 16 * llc : (512ull << 20);
	if (opt.working_set_bytes < 4 * llc)
		fprintf(stderr, "pool_bench: warning: working set %llu MiB is under 4x the LLC (%llu MiB)\n",
			(unsigned long long)(opt.working_set_bytes >> 20),
			(unsigned long long)(llc >> 20));
	if (opt.reps < 3)
		opt.reps = 3;
	fprintf(stderr, "pool_bench: %s, %u cores, LLC %llu MiB, working set %llu MiB, %llu MiB per rep, "
			"%u reps, conversions %s%s\n",
		sys.cpu_model, sys.n_cores, (unsigned long long)(llc >> 20),
		(unsigned long long)(opt.working_set_bytes >> 20),
		(unsigned long long)(opt.rep_bytes >> 20), opt.reps,
		kvr_convert_isa_name(kvr_convert_isa_active()), opt.prefetch ? "" : ", no prefetch");

	struct result results[32];
	uint32_t n_results = 0;
	for (uint32_t d = 0; d < opt.n_head_dims; d++)
		for (uint32_t t = 0; t < opt.n_threads; t++) {
			uint32_t n = 0;
			if (run_config(&opt, opt.threads[t], opt.head_dims[d], results + n_results, &n,
				       stderr))
				return 1;
			n_results += n;
		}

	FILE *json = opt.json_path ? fopen(opt.json_path, "w") : stdout;
	if (!json) {
		fprintf(stderr, "pool_bench: cannot write %s: %s\n", opt.json_path, strerror(errno));
		return 1;
	}
	fprintf(json, "{\n  \"benchmark\": \"pool\",\n  \"kvrecall_version\": \"%s\",\n",
		kvr_version_string());
	fprintf(json, "  \"machine\": {\"cpu\": \"%s\", \"cores\": %u, \"numa_nodes\": %u, "
		      "\"llc_bytes\": %llu, \"memory_bytes\": %llu, \"avx512\": %s},\n",
		sys.cpu_model, sys.n_cores, sys.n_numa_nodes, (unsigned long long)llc,
		(unsigned long long)sys.memory_bytes, sys.cpu_avx512 ? "true" : "false");
	fprintf(json, "  \"working_set_bytes\": %llu,\n  \"rep_bytes\": %llu,\n  \"reps\": %u,\n"
		      "  \"prefetch\": %s,\n  \"results\": [\n",
		(unsigned long long)opt.working_set_bytes, (unsigned long long)opt.rep_bytes, opt.reps,
		opt.prefetch ? "true" : "false");
	for (uint32_t i = 0; i < n_results; i++)
		fprintf(json,
			"    {\"op\": \"%s\", \"unit_bytes\": %llu, \"threads\": %u, \"bytes\": %llu, "
			"\"gbps\": %.3f, \"memcpy_gbps\": %.3f, \"ratio\": %.4f}%s\n",
			results[i].op, (unsigned long long)results[i].unit_bytes, results[i].threads,
			(unsigned long long)results[i].bytes, results[i].op_gbps, results[i].memcpy_gbps,
			results[i].ratio, i + 1 < n_results ? "," : "");
	fprintf(json, "  ]\n}\n");
	if (json != stdout)
		fclose(json);
	return 0;
}
