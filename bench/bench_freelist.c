/* SPDX-License-Identifier: MIT */
/*
 * bench_freelist.c — `kvrecall bench freelist`: how long one allocation round
 * and one free round of LeanKV's circular free-page list (layouts/freelist.h)
 * take against the number of units (KV heads × sequences × layers asking at
 * once), on the host: the exclusive scan over the units' counts, every unit's
 * slice copy, one counter update. This is the serial reference the device
 * kernels will be measured against (issue 9).
 *
 * Each round every unit asks for 0, 1 or 2 pages (random, fixed seed) from a
 * list of 8 pages per unit; the free round returns them. Reported per unit
 * count: µs per round (median of --reps) and ns per unit.
 *
 * Threads: the caller's.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrecall.h"
#include "bench_cmd.h"
#include "bench_common.h"
#include "../layouts/freelist.h"

int bench_freelist(int argc, char **argv)
{
	const char *json_path = NULL;
	uint32_t units_list[8] = { 32, 256, 2048, 16384, 131072 }, n_units = 5, reps = 15;
	for (int i = 0; i < argc; i++) {
		if (!strcmp(argv[i], "--json") && i + 1 < argc)
			json_path = argv[++i];
		else if (!strcmp(argv[i], "--units") && i + 1 < argc) {
			if (bench_parse_list(argv[++i], units_list, 8, &n_units))
				goto usage;
		} else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
			reps = (uint32_t)strtoul(argv[++i], NULL, 10);
		else if (!strcmp(argv[i], "--quick"))
			reps = 3, n_units = 2;
		else
			goto usage;
	}
	if (reps < 1 || reps > 63) {
		fprintf(stderr, "kvrecall bench freelist: --reps must be 1 to 63\n");
		return 2;
	}
	for (uint32_t i = 0; i < n_units; i++)
		if (units_list[i] > (1u << 22)) {
			fprintf(stderr, "kvrecall bench freelist: at most %u units\n", 1u << 22);
			return 2;
		}
	double alloc_us[8], free_us[8];
	uint64_t rng = 0x9e3779b97f4a7c15ull;
	for (uint32_t ui = 0; ui < n_units; ui++) {
		const uint32_t units = units_list[ui], capacity = units * 8;
		uint32_t *ids = malloc((size_t)capacity * sizeof(uint32_t));
		uint32_t *counts = malloc((size_t)units * sizeof(uint32_t));
		uint64_t *offsets = malloc((size_t)units * sizeof(uint64_t));
		uint32_t *slots = malloc((size_t)units * 2 * sizeof(uint32_t));
		uint32_t **out = malloc((size_t)units * sizeof(uint32_t *));
		if (!ids || !counts || !offsets || !slots || !out) {
			fprintf(stderr, "kvrecall bench freelist: out of memory\n");
			free(ids), free(counts), free(offsets), free(slots), free(out);
			return 1;
		}
		struct kvr_freelist l;
		kvr_freelist_init(&l, ids, capacity);
		for (uint32_t u = 0; u < units; u++) {
			counts[u] = (uint32_t)(bench_xorshift(&rng) >> 62) % 3;
			out[u] = slots + 2 * u;
		}
		double ta[64], tf[64];
		for (uint32_t r = 0; r <= reps; r++) { /* round 0 warms up */
			bench_progress("freelist", ui * (reps + 1) + r, n_units * (reps + 1));
			double t0 = bench_now_s();
			const int a = kvr_freelist_alloc_round(&l, counts, units, offsets, out);
			const double t1 = bench_now_s();
			const int f = kvr_freelist_free_round(&l, counts, units, offsets, (const uint32_t *const *)out);
			const double t2 = bench_now_s();
			if (a || f) {
				fprintf(stderr, "kvrecall bench freelist: a round was refused (%d, %d)\n", a, f);
				return 1;
			}
			if (r)
				ta[r - 1] = t1 - t0, tf[r - 1] = t2 - t1;
		}
		alloc_us[ui] = bench_median(ta, reps) * 1e6;
		free_us[ui] = bench_median(tf, reps) * 1e6;
		free(ids), free(counts), free(offsets), free(slots), free(out);
	}
	bench_progress("freelist", 1, 1);
	fprintf(stderr, "kvrecall bench freelist: one round on the host (scan + slice copies + one counter), "
			"median of %u\n%10s %14s %14s %12s\n",
		reps, "units", "alloc us", "free us", "ns/unit");
	for (uint32_t i = 0; i < n_units; i++)
		fprintf(stderr, "%10u %14.2f %14.2f %12.2f\n", units_list[i], alloc_us[i], free_us[i],
			(alloc_us[i] + free_us[i]) * 1e3 / 2 / units_list[i]);
	FILE *f = json_path ? fopen(json_path, "w") : stdout;
	if (!f) {
		fprintf(stderr, "kvrecall bench freelist: cannot write %s: %s\n", json_path, strerror(errno));
		return 1;
	}
	bench_json_open(f, "freelist", "cpu", argc, argv);
	fprintf(f, "  \"params\": {\"reps\": %u, \"pages_per_unit\": 8, \"ask\": \"0-2 pages per unit\"},\n"
		   "  \"results\": [\n",
		reps);
	for (uint32_t i = 0; i < n_units; i++)
		fprintf(f, "    {\"units\": %u, \"alloc_round_us\": %.3f, \"free_round_us\": %.3f, \"ns_per_unit\": %.3f}%s\n",
			units_list[i], alloc_us[i], free_us[i], (alloc_us[i] + free_us[i]) * 1e3 / 2 / units_list[i],
			i + 1 < n_units ? "," : "");
	fprintf(f, "  ]\n");
	bench_json_close(f);
	if (f != stdout)
		fclose(f);
	return 0;
usage:
	fprintf(stderr, "usage: kvrecall bench freelist [--units 32,256,2048,16384,131072] [--reps 15] [--quick] "
			"[--json FILE]\n");
	return 2;
}
