/* SPDX-License-Identifier: MIT */
/*
 * bench_common.h — what the benchmark drivers share: a monotonic clock, the
 * median of repeated timings, 2 MiB-aligned huge-page buffers, parsing of
 * comma-separated number lists from the command line, the xorshift
 * generator their synthetic data comes from, and a KV format's name in
 * reports (command-line values: cli_args.h). Header-only, host-only.
 */
#ifndef KVR_BENCH_COMMON_H
#define KVR_BENCH_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "kvrecall.h"
#include "cli_args.h"

/* A KV format's name in reports: plain pages are the benchmarks' dtype, f16 */
static inline const char *bench_kv_format_label(uint32_t kv_format)
{
	return kv_format ? kvr_kv_format_name(kv_format) : "f16";
}

static inline double bench_now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* xorshift64: fast, reproducible synthetic data (each driver its own seed). */
static inline uint64_t bench_xorshift(uint64_t *state)
{
	*state ^= *state << 13;
	*state ^= *state >> 7;
	*state ^= *state << 17;
	return *state;
}

static inline int bench_cmp_double(const void *a, const void *b)
{
	const double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

/* Median of n timings (sorts v). Medians, not means: the hosts are shared. */
static inline double bench_median(double *v, uint32_t n)
{
	qsort(v, n, sizeof(*v), bench_cmp_double);
	return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* A buffer backed by transparent huge pages (advised before first touch);
 * exits with a message when memory runs out — drivers only, never the library. */
static inline void *bench_huge_alloc(const char *who, size_t bytes)
{
	const size_t align = 2u << 20;
	void *p = aligned_alloc(align, (bytes + align - 1) & ~(align - 1));
	if (!p) {
		fprintf(stderr, "%s: out of memory for %zu bytes\n", who, bytes);
		exit(1);
	}
	madvise(p, bytes, MADV_HUGEPAGE);
	return p;
}

/* "1,2,4" -> out[0..n); each value from 1 to 2^32 - 1, at most max of them.
 * Returns 0, or -1 when malformed, without a message: the micro-benchmarks
 * print their usage (the command's benchmarks use cli_parse_u32_list,
 * which says what is wrong). */
static inline int bench_parse_list(const char *s, uint32_t *out, uint32_t max, uint32_t *n)
{
	char item[32];
	const char *at = s;
	*n = 0;
	for (int r; (r = cli_list_next(&at, item, sizeof(item)));) {
		uint64_t v = 0;
		if (r < 0 || *n == max || cli_u64_whole(item, &v) || v == 0 || v > UINT32_MAX)
			return -1;
		out[(*n)++] = (uint32_t)v;
	}
	return *n ? 0 : -1;
}

#endif /* KVR_BENCH_COMMON_H */
