/* SPDX-License-Identifier: MIT */
/*
 * bench_spill.c — `kvrecall bench spill`: the spill tier's file (host/spill.h)
 * against the storage under it. Per run size (one KV head's run of a page;
 * pages of --runs-per-page runs) and per queue depth:
 *   - spill: pages written through kvr_spill_write_pages (packing, CRC32C,
 *     io_uring writes) in batches of --batch pages, GB/s of page bytes;
 *   - recall: every run read back once in random order through
 *     kvr_spill_read_runs in batches of --batch runs (a recall's worth):
 *     io_uring reads into staging, CRC32C check, copy out; GB/s of run bytes;
 *   - raw: the same reads of the same file at the same offsets and queue
 *     depth with a bare io_uring loop (O_DIRECT, no checksum, no copy), so
 *     recall ÷ raw is what the tier costs over the device;
 * and once per run size, the device's sequential O_DIRECT read rate (1 MiB
 * reads, queue depth 16) over the same file, the ceiling. "sync" in the
 * queue-depth column is the pread/pwrite fallback (KVR_SPILL_SYNC).
 *
 * Then the pool with a RAM budget (host/pool.h's spill tier): one layer of
 * --pool-context tokens in a pool whose RAM holds 100%, 50% or 10% of it
 * (--spilled 0,50,90), and per step the runs a recall of budget B reads —
 * B/p random pages per KV head, through kvr_pool_read_runs (RAM copies for
 * resident pages, reads straight from the file for spilled ones): µs per
 * recall, the decode step's recall share as the spill tier stands today
 * (the scheduler does not drive it yet).
 *
 * Threads: the caller's only.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef KVR_HAVE_LIBURING
#include <liburing.h>
#endif

#include "kvrecall.h"
#include "bench_cmd.h"
#include "../bench_common.h"
#include "../cli_args.h"
#include "../../host/pool.h"
#include "../../host/spill.h"

#define MAX_SIZES 8
#define MAX_DEPTHS 8
#define RAW_DEPTH_CEILING 16u
#define RAW_CEILING_BYTES (1u << 20)

struct point {
	uint32_t run_kib, depth; /* depth 0: sync */
	double spill_gbs, recall_gbs, raw_gbs;
	uint32_t direct, io_uring, registered;
};

/* Read `n` extents of `len` bytes at offsets[i] with queue depth `qd` on a
 * bare ring; seconds, or a negative value on failure. */
static double raw_reads(int fd, const uint64_t *offsets, uint32_t n, uint32_t len, uint32_t qd, void *buf,
			uint64_t buf_bytes)
{
#ifdef KVR_HAVE_LIBURING
	struct io_uring ring;
	if (io_uring_queue_init(qd, &ring, 0) < 0)
		return -1;
	const uint32_t slots = (uint32_t)(buf_bytes / len);
	uint32_t next = 0, done = 0, inflight = 0;
	int failed = 0;
	const double t0 = bench_now_s();
	while (done < n && !failed) {
		while (next < n && inflight < qd) {
			struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
			if (!sqe)
				break;
			io_uring_prep_read(sqe, fd, (char *)buf + (uint64_t)(next % slots) * len, len, offsets[next]);
			next++, inflight++;
		}
		io_uring_submit(&ring);
		struct io_uring_cqe *cqe;
		if (io_uring_wait_cqe(&ring, &cqe) < 0) {
			failed = 1;
			break;
		}
		unsigned head, seen = 0;
		io_uring_for_each_cqe(&ring, head, cqe) {
			if (cqe->res != (int)len)
				failed = 1;
			seen++;
		}
		io_uring_cq_advance(&ring, seen);
		inflight -= seen;
		done += seen;
	}
	const double t = bench_now_s() - t0;
	while (inflight) { /* a failure leaves some in flight */
		struct io_uring_cqe *cqe;
		if (io_uring_wait_cqe(&ring, &cqe) < 0)
			break;
		io_uring_cqe_seen(&ring, cqe);
		inflight--;
	}
	io_uring_queue_exit(&ring);
	return failed ? -1 : t;
#else
	(void)fd, (void)offsets, (void)n, (void)len, (void)qd, (void)buf, (void)buf_bytes;
	return -1;
#endif
}

static void shuffle(uint32_t *v, uint32_t n, uint64_t *rng)
{
	for (uint32_t i = n; i > 1; i--) {
		uint32_t j = (uint32_t)(bench_xorshift(rng) % i);
		uint32_t t = v[i - 1];
		v[i - 1] = v[j];
		v[j] = t;
	}
}

/* One (run size, depth) point; 0 or 1 after a message. */
static int measure(const char *dir, uint32_t run_kib, uint32_t rpp, uint32_t depth, uint64_t file_bytes,
		   uint32_t batch, uint32_t staging_mib, struct point *pt, double *ceiling_gbs)
{
	const uint64_t run_bytes = (uint64_t)run_kib << 10, page_bytes = run_bytes * rpp;
	const uint32_t n_pages = (uint32_t)(file_bytes / page_bytes ? file_bytes / page_bytes : 1);
	const uint32_t n_runs = n_pages * rpp;
	struct kvr_spill_params sp_params = {
		.dir = dir,
		.run_bytes = run_bytes,
		.runs_per_page = rpp,
		.queue_depth = depth ? depth : 1,
		.staging_bytes = (uint64_t)staging_mib << 20,
		.flags = depth ? 0 : KVR_SPILL_SYNC,
	};
	struct kvr_spill *sp = NULL;
	char err[256];
	int e = kvr_spill_create(&sp_params, &sp, err, sizeof(err));
	if (e) {
		fprintf(stderr, "kvrecall bench spill: %s\n", err);
		return 1;
	}
	unsigned char *pages = bench_huge_alloc("spill pages", (size_t)page_bytes * batch);
	unsigned char *dst = bench_huge_alloc("spill recall", (size_t)run_bytes * batch);
	uint32_t *slots = malloc((size_t)n_pages * sizeof(*slots));
	uint32_t *order = malloc((size_t)n_runs * sizeof(*order));
	struct kvr_spill_run *runs = malloc((size_t)batch * sizeof(*runs));
	uint64_t *offsets = malloc((size_t)n_runs * sizeof(*offsets));
	const void **page_ptrs = malloc((size_t)batch * sizeof(*page_ptrs));
	int rc = 1;
	if (!pages || !dst || !slots || !order || !runs || !offsets || !page_ptrs) {
		fprintf(stderr, "kvrecall bench spill: out of memory\n");
		goto out;
	}
	uint64_t rng = 0x9e3779b97f4a7c15ull ^ run_kib;
	for (uint64_t i = 0; i < page_bytes * batch / 8; i++)
		((uint64_t *)pages)[i] = bench_xorshift(&rng);
	for (uint32_t b = 0; b < batch; b++)
		page_ptrs[b] = pages + (uint64_t)b * page_bytes;
	/* spill */
	double t0 = bench_now_s();
	for (uint32_t at = 0; at < n_pages; at += batch) {
		const uint32_t n = n_pages - at < batch ? n_pages - at : batch;
		if (kvr_spill_write_pages(sp, page_ptrs, n, slots + at)) {
			fprintf(stderr, "kvrecall bench spill: %s\n", kvr_spill_last_error(sp));
			goto out;
		}
	}
	const double t_spill = bench_now_s() - t0;
	/* recall: every run once, in random order */
	for (uint32_t i = 0; i < n_runs; i++)
		order[i] = i;
	shuffle(order, n_runs, &rng);
	struct kvr_spill_stats st;
	kvr_spill_get_stats(sp, &st);
	t0 = bench_now_s();
	for (uint32_t at = 0; at < n_runs; at += batch) {
		const uint32_t n = n_runs - at < batch ? n_runs - at : batch;
		for (uint32_t i = 0; i < n; i++)
			runs[i] = (struct kvr_spill_run){ slots[order[at + i] / rpp], order[at + i] % rpp };
		if (kvr_spill_read_runs(sp, runs, n, dst, run_bytes, NULL)) {
			fprintf(stderr, "kvrecall bench spill: %s\n", kvr_spill_last_error(sp));
			goto out;
		}
	}
	const double t_recall = bench_now_s() - t0;
	/* raw: the same offsets on the same file */
	for (uint32_t i = 0; i < n_runs; i++)
		offsets[i] = kvr_spill_slot_offset(sp, slots[order[i] / rpp]) + (uint64_t)(order[i] % rpp) * st.run_stride;
	const double t_raw = depth ? raw_reads(kvr_spill_fd(sp), offsets, n_runs, (uint32_t)st.run_stride, depth,
					       pages, page_bytes * batch)
				   : -1;
	if (ceiling_gbs && *ceiling_gbs == 0 && st.direct_io) {
		const uint64_t used = (uint64_t)n_pages * st.slot_bytes;
		const uint32_t n_big = (uint32_t)(used / RAW_CEILING_BYTES);
		for (uint32_t i = 0; i < n_big; i++)
			offsets[i] = (uint64_t)i * RAW_CEILING_BYTES;
		double t = n_big && page_bytes * batch >= RAW_CEILING_BYTES
				   ? raw_reads(kvr_spill_fd(sp), offsets, n_big, RAW_CEILING_BYTES, RAW_DEPTH_CEILING,
					       pages, page_bytes * batch)
				   : -1;
		*ceiling_gbs = t > 0 ? (double)n_big * RAW_CEILING_BYTES / t / 1e9 : -1;
	}
	*pt = (struct point){ .run_kib = run_kib,
			      .depth = depth,
			      .spill_gbs = (double)n_pages * page_bytes / t_spill / 1e9,
			      .recall_gbs = (double)n_runs * run_bytes / t_recall / 1e9,
			      .raw_gbs = t_raw > 0 ? (double)n_runs * run_bytes / t_raw / 1e9 : 0,
			      .direct = st.direct_io,
			      .io_uring = st.io_uring,
			      .registered = st.registered };
	rc = 0;
out:
	free(pages), free(dst), free(slots), free(order), free(runs), free(offsets), free(page_ptrs);
	kvr_spill_destroy(sp);
	return rc;
}

struct pool_point {
	uint32_t spilled_pct;
	double recall_us, gbs;
	uint64_t resident, spilled, read_through;
};

/* One layer of `context` tokens (llama-3.1-8b's KV shape: 8 KV heads, d
 * 128, p 32, f16) in a pool holding (100 - pct)% of it in RAM; `steps`
 * recalls of B/p random pages per KV head. 0 or 1 after a message. */
static int measure_pool(const char *dir, uint32_t pct, uint32_t context, uint32_t budget, uint32_t steps,
			struct pool_point *pt)
{
	const uint32_t p = 32, d = 128, n_kv = 8;
	struct kvr_pool_params pp = { .n_layers = 1,
				      .max_sequences = 1,
				      .layout = KVR_POOL_LAYOUT_HND,
				      .numa_node = -1,
				      .flags = KVR_POOL_NO_HUGEPAGES,
				      .keep_summaries = 1,
				      .spill_dir = dir };
	kvr_page_geometry_init(&pp.geometry, p, d, n_kv, KVR_ELEM_F16);
	const uint32_t n_pages = context / p, k = budget / p;
	const uint64_t pb = pp.geometry.page_bytes;
	pp.capacity_bytes = (uint64_t)n_pages * pb;
	uint64_t frames = (uint64_t)n_pages * (100 - pct) / 100;
	if (pct && frames < KVR_POOL_MIN_FRAMES)
		frames = KVR_POOL_MIN_FRAMES;
	pp.ram_bytes = pct ? frames * pb : 0;
	struct kvr_pool *pool = NULL;
	char err[256];
	if (kvr_pool_create(&pp, &pool, err, sizeof(err))) {
		fprintf(stderr, "kvrecall bench spill: %s\n", err);
		return 1;
	}
	const uint32_t row = n_kv * d;
	uint16_t *rows = malloc((size_t)2 * p * row * sizeof(uint16_t));
	uint32_t *ids = malloc((size_t)n_pages * sizeof(*ids));
	uint32_t *pages = malloc((size_t)k * n_kv * sizeof(*pages)), *heads = malloc((size_t)k * n_kv * sizeof(*heads));
	unsigned char *dst = bench_huge_alloc("pool recall", (size_t)k * n_kv * kvr_pool_head_bytes(pool));
	double *times = malloc((size_t)steps * sizeof(double));
	int rc = 1;
	uint64_t rng = 0x2545f4914f6cdd1dull + pct;
	if (!rows || !ids || !pages || !heads || !times || kvr_pool_seq_open(pool, 0) ||
	    kvr_pool_reserve(pool, 0, 0, n_pages)) {
		fprintf(stderr, "kvrecall bench spill: pool: %s\n", kvr_pool_last_error(pool));
		goto out;
	}
	for (uint32_t i = 0; i < n_pages; i++) {
		for (uint32_t j = 0; j < 2 * p * row; j++)
			rows[j] = (uint16_t)(bench_xorshift(&rng) & 0x3bff); /* finite f16 */
		if (kvr_pool_write_page(pool, 0, 0, i, rows, rows + (size_t)p * row, row) ||
		    kvr_pool_lookup(pool, 0, 0, i, &ids[i])) {
			fprintf(stderr, "kvrecall bench spill: pool: %s\n", kvr_pool_last_error(pool));
			goto out;
		}
	}
	for (uint32_t s = 0; s <= steps; s++) { /* step 0 warms up */
		for (uint32_t m = 0; m < n_kv; m++)
			for (uint32_t j = 0; j < k; j++) {
				pages[m * k + j] = ids[bench_xorshift(&rng) % n_pages];
				heads[m * k + j] = m;
			}
		const double t0 = bench_now_s();
		if (kvr_pool_read_runs(pool, pages, heads, k * n_kv, dst, NULL)) {
			fprintf(stderr, "kvrecall bench spill: pool: %s\n", kvr_pool_last_error(pool));
			goto out;
		}
		if (s)
			times[s - 1] = bench_now_s() - t0;
	}
	struct kvr_pool_stats st;
	kvr_pool_get_stats(pool, &st);
	const double med = bench_median(times, steps);
	*pt = (struct pool_point){ .spilled_pct = pct,
				   .recall_us = med * 1e6,
				   .gbs = (double)k * n_kv * kvr_pool_head_bytes(pool) / med / 1e9,
				   .resident = st.spill_enabled ? st.resident_pages : n_pages,
				   .spilled = st.spilled_pages,
				   .read_through = st.runs_read_through };
	rc = 0;
out:
	free(rows), free(ids), free(pages), free(heads), free(dst), free(times);
	kvr_pool_destroy(pool);
	return rc;
}

#define SPILL_CMD "kvrecall bench spill"

static void spill_usage(FILE *f)
{
	fprintf(f, "usage: kvrecall bench spill [--dir DIR] [--run-kib 4,16,64] [--queue-depths 1,4,16,64] "
		   "[--runs-per-page 8] [--batch 256] [--staging-mib 4] [--file-mib 256] [--no-sync] [--spilled 0,50,90] "
		   "[--pool-context 32768] [--quick] [--json FILE]\n"
		   "  --run-kib LIST       up to %d run sizes, 1 to 1024 KiB\n"
		   "  --queue-depths LIST  up to %d depths, 1 to 4096\n"
		   "  --runs-per-page 1 to 64; --batch 1 to 4096; --staging-mib 1 to 1024;\n"
		   "  --file-mib 1 to 1048576; --spilled up to 4 percentages, 0 to 99;\n"
		   "  --pool-context a multiple of 32 from twice the pool's budget to 2^24\n",
		MAX_SIZES, MAX_DEPTHS);
}

int bench_spill(int argc, char **argv)
{
	const char *json_path = NULL, *dir = NULL;
	uint32_t sizes[MAX_SIZES] = { 4, 16, 64 }, n_sizes = 3;
	uint32_t depths[MAX_DEPTHS] = { 1, 4, 16, 64 }, n_depths = 4;
	uint32_t rpp = 8, batch = 256, file_mib = 256, with_sync = 1, staging_mib = 4;
	uint32_t spilled[4] = { 0, 50, 90 }, n_spilled = 3, pool_context = 32768, pool_budget = 2048,
		 pool_steps = 30;
	for (int i = 0; i < argc; i++) {
		const char *a = argv[i];
		if (cli_is_help(a)) {
			spill_usage(stdout);
			return CLI_EXIT_OK;
		}
		if (!strcmp(a, "--no-sync")) {
			with_sync = 0;
			continue;
		}
		if (!strcmp(a, "--quick")) {
			file_mib = 16, pool_context = 4096, pool_budget = 1024, pool_steps = 5;
			n_sizes = n_sizes < 2 ? n_sizes : 2, n_depths = n_depths < 2 ? n_depths : 2;
			continue;
		}
		CLI_TAKE(cli_opt_str(SPILL_CMD, argc, argv, &i, "--json", &json_path))
		CLI_TAKE(cli_opt_str(SPILL_CMD, argc, argv, &i, "--dir", &dir))
		CLI_TAKE(cli_opt_u32_list(SPILL_CMD, argc, argv, &i, "--run-kib", 1, 1024, sizes, MAX_SIZES, &n_sizes))
		CLI_TAKE(cli_opt_u32_list(SPILL_CMD, argc, argv, &i, "--queue-depths", 1, 4096, depths, MAX_DEPTHS,
					  &n_depths))
		CLI_TAKE(cli_opt_u32_list(SPILL_CMD, argc, argv, &i, "--spilled", 0, 99, spilled, 4, &n_spilled))
		CLI_TAKE(cli_opt_u32(SPILL_CMD, argc, argv, &i, "--runs-per-page", 1, 64, &rpp))
		CLI_TAKE(cli_opt_u32(SPILL_CMD, argc, argv, &i, "--batch", 1, 4096, &batch))
		CLI_TAKE(cli_opt_u32(SPILL_CMD, argc, argv, &i, "--staging-mib", 1, 1024, &staging_mib))
		CLI_TAKE(cli_opt_u32(SPILL_CMD, argc, argv, &i, "--file-mib", 1, 1u << 20, &file_mib))
		CLI_TAKE(cli_opt_u32(SPILL_CMD, argc, argv, &i, "--pool-context", 1, 1u << 24, &pool_context))
		return cli_usage_error(SPILL_CMD, "unknown option '%s'", a);
	}
	if (pool_context < 2 * pool_budget || pool_context % 32 || pool_context > (1u << 24)) {
		fprintf(stderr, "%s: --pool-context '%u': expected a multiple of 32 from %u to %u\n", SPILL_CMD,
			pool_context, 2 * pool_budget, 1u << 24);
		return CLI_EXIT_USAGE;
	}
	struct kvr_spill_dir_info di = { .size = sizeof(di) };
	if (kvr_spill_dir_query(dir, &di)) {
		fprintf(stderr, "kvrecall bench spill: %s\n", di.reason);
		return 1;
	}
	struct point pts[MAX_SIZES * (MAX_DEPTHS + 1)];
	double ceiling[MAX_SIZES] = { 0 };
	uint32_t n_pts = 0;
	const uint32_t per_size = n_depths + with_sync;
	for (uint32_t s = 0; s < n_sizes; s++)
		for (uint32_t d = 0; d < per_size; d++) {
			bench_progress("spill", s * per_size + d, n_sizes * per_size);
			const uint32_t depth = d < n_depths ? depths[d] : 0;
			if (measure(dir, sizes[s], rpp, depth, (uint64_t)file_mib << 20, batch, staging_mib, &pts[n_pts],
				    &ceiling[s]))
				return 1;
			n_pts++;
		}
	struct pool_point pool_pts[4];
	for (uint32_t i = 0; i < n_spilled; i++) {
		bench_progress("spill (pool)", i, n_spilled);
		if (measure_pool(dir, spilled[i], pool_context, pool_budget, pool_steps, &pool_pts[i]))
			return 1;
	}
	bench_progress("spill", 1, 1);
	fprintf(stderr,
		"kvrecall bench spill: %s (%s, %s), %u MiB per point, pages of %u runs, batches of %u, "
		"staging 2 x %u MiB\n"
		"%8s %6s %12s %12s %12s %8s %12s\n",
		di.dir, di.fs_type, di.direct_io ? "O_DIRECT" : "buffered", file_mib, rpp, batch, staging_mib, "run KiB", "depth",
		"spill GB/s", "recall GB/s", "raw GB/s", "÷ raw", "ceiling GB/s");
	for (uint32_t i = 0; i < n_pts; i++) {
		char depth[16];
		snprintf(depth, sizeof(depth), pts[i].depth ? "%u" : "sync", pts[i].depth);
		fprintf(stderr, "%8u %6s %12.3f %12.3f %12.3f %8.2f %12.3f\n", pts[i].run_kib, depth,
			pts[i].spill_gbs, pts[i].recall_gbs, pts[i].raw_gbs,
			pts[i].raw_gbs > 0 ? pts[i].recall_gbs / pts[i].raw_gbs : 0, ceiling[i / per_size]);
	}
	fprintf(stderr,
		"pool with a RAM budget: one layer of %u tokens (8 KV heads, d 128, p 32, f16), recall of B = %u\n"
		"%10s %12s %10s %10s %10s\n",
		pool_context, pool_budget, "spilled %", "recall µs", "GB/s", "resident", "spilled");
	for (uint32_t i = 0; i < n_spilled; i++)
		fprintf(stderr, "%10u %12.1f %10.3f %10llu %10llu\n", pool_pts[i].spilled_pct, pool_pts[i].recall_us,
			pool_pts[i].gbs, (unsigned long long)pool_pts[i].resident,
			(unsigned long long)pool_pts[i].spilled);
	FILE *f = json_path ? fopen(json_path, "w") : stdout;
	if (!f) {
		fprintf(stderr, "kvrecall bench spill: cannot write %s: %s\n", json_path, strerror(errno));
		return 1;
	}
	bench_json_open(f, "spill", "host", argc, argv);
	fprintf(f, "  \"params\": {\"dir\": ");
	bench_json_string(f, di.dir);
	fprintf(f, ", \"fs_type\": ");
	bench_json_string(f, di.fs_type);
	fprintf(f,
		", \"direct_io\": %s, \"dio_align\": %u, \"file_mib\": %u, \"runs_per_page\": %u, \"batch\": %u, "
		"\"staging_mib\": %u},\n"
		"  \"results\": [\n",
		di.direct_io ? "true" : "false", di.dio_align, file_mib, rpp, batch, staging_mib);
	for (uint32_t i = 0; i < n_pts; i++)
		fprintf(f,
			"    {\"run_kib\": %u, \"queue_depth\": %u, \"engine\": \"%s\", \"registered\": %s, "
			"\"spill_gbs\": %.4f, \"recall_gbs\": %.4f, \"raw_gbs\": %.4f, \"ceiling_gbs\": %.4f}%s\n",
			pts[i].run_kib, pts[i].depth, pts[i].io_uring ? "io_uring" : "pread",
			pts[i].registered ? "true" : "false", pts[i].spill_gbs, pts[i].recall_gbs, pts[i].raw_gbs,
			ceiling[i / per_size], i + 1 < n_pts ? "," : "");
	fprintf(f, "  ],\n  \"pool\": {\"context_tokens\": %u, \"budget_tokens\": %u, \"steps\": %u, "
		   "\"shape\": \"8 KV heads, d 128, p 32, f16\", \"results\": [\n",
		pool_context, pool_budget, pool_steps);
	for (uint32_t i = 0; i < n_spilled; i++)
		fprintf(f,
			"    {\"spilled_pct\": %u, \"recall_us\": %.2f, \"gbs\": %.4f, \"resident_pages\": %llu, "
			"\"spilled_pages\": %llu, \"runs_read_through\": %llu}%s\n",
			pool_pts[i].spilled_pct, pool_pts[i].recall_us, pool_pts[i].gbs,
			(unsigned long long)pool_pts[i].resident, (unsigned long long)pool_pts[i].spilled,
			(unsigned long long)pool_pts[i].read_through, i + 1 < n_spilled ? "," : "");
	fprintf(f, "  ]}\n");
	bench_json_close(f);
	return 0;
}
