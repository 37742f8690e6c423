/* SPDX-License-Identifier: MIT */
/*
 * bench_freelist.c — `kvrecall bench freelist`: how long one allocation round
 * and one free round of LeanKV's circular free-page list take against the
 * number of units (KV heads × sequences × layers asking at once): on one host
 * thread with layouts/freelist.h (the serial reference), and as the device
 * kernel (gpu/kernels.h, freelist) on --backend: the cpu backend splits the
 * slice copies over its workers, cuda runs a block per list. Device rounds
 * are timed from enqueue to the end of a stream synchronisation, as a caller
 * waiting for the page ids would see them.
 *
 * Each round every unit asks for 0, 1 or 2 pages (random, fixed seed) from a
 * list of 8 pages per unit; the free round returns them. Reported per unit
 * count: µs per round (median of --reps) and ns per unit.
 *
 * Threads: the caller's, plus the backend's workers.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrecall.h"
#include "bench_cmd.h"
#include "../bench_common.h"
#include "../cli_args.h"
#include "../../gpu/backend.h"
#include "../../layouts/freelist.h"

/* The device side of one unit count: the list, the counts and the packed
 * page ids in device memory, and the two items (alloc, free). */
struct dev_round {
	uint32_t *ids, *counts, *pages;
	uint64_t *counters, *offsets;
	int32_t *status;
	struct kvr_freelist_item *items; /* [2]: alloc, free */
};

static void dev_round_free(struct kvr_dev *dev, struct dev_round *d)
{
	kvr_dev_free(dev, d->ids), kvr_dev_free(dev, d->counts), kvr_dev_free(dev, d->pages);
	kvr_dev_free(dev, d->counters), kvr_dev_free(dev, d->offsets), kvr_dev_free(dev, d->status);
	kvr_dev_free(dev, d->items);
}

/* Time reps alloc+free round pairs on the device; 0, or an error with a
 * message on stderr. */
static int time_device(struct kvr_dev *dev, struct kvr_stream *st, const uint32_t *ids, const uint32_t *counts,
		       uint32_t units, uint32_t capacity, uint64_t total, uint32_t reps, double *alloc_us,
		       double *free_us)
{
	struct dev_round d = { 0 };
	int err = kvr_dev_alloc(dev, (size_t)capacity * 4, (void **)&d.ids);
	if (!err)
		err = kvr_dev_alloc(dev, (size_t)units * 4, (void **)&d.counts);
	if (!err)
		err = kvr_dev_alloc(dev, (size_t)total * 4 + 4, (void **)&d.pages);
	if (!err)
		err = kvr_dev_alloc(dev, 16, (void **)&d.counters);
	if (!err)
		err = kvr_dev_alloc(dev, (size_t)units * 8, (void **)&d.offsets);
	if (!err)
		err = kvr_dev_alloc(dev, 4, (void **)&d.status);
	if (!err)
		err = kvr_dev_alloc(dev, 2 * sizeof(struct kvr_freelist_item), (void **)&d.items);
	const uint64_t counters[2] = { 0, capacity };
	const struct kvr_freelist_item items[2] = {
		{ d.ids, d.counters, d.counts, d.offsets, d.pages, d.status, capacity, units, KVR_FREELIST_ALLOC,
		  (uint32_t)total },
		{ d.ids, d.counters, d.counts, d.offsets, d.pages, d.status, capacity, units, KVR_FREELIST_FREE,
		  (uint32_t)total },
	};
	if (!err)
		err = kvr_dev_memcpy_async(dev, d.ids, ids, (size_t)capacity * 4, KVR_COPY_H2D, st);
	if (!err)
		err = kvr_dev_memcpy_async(dev, d.counts, counts, (size_t)units * 4, KVR_COPY_H2D, st);
	if (!err)
		err = kvr_dev_memcpy_async(dev, d.counters, counters, 16, KVR_COPY_H2D, st);
	if (!err)
		err = kvr_dev_memcpy_async(dev, d.items, items, sizeof(items), KVR_COPY_H2D, st);
	if (!err)
		err = kvr_dev_stream_synchronize(dev, st);
	double ta[64], tf[64];
	for (uint32_t r = 0; r <= reps && !err; r++) { /* round 0 warms up */
		const double t0 = bench_now_s();
		err = kvr_dev_freelist(dev, d.items, 1, st);
		if (!err)
			err = kvr_dev_stream_synchronize(dev, st);
		const double t1 = bench_now_s();
		if (!err)
			err = kvr_dev_freelist(dev, d.items + 1, 1, st);
		if (!err)
			err = kvr_dev_stream_synchronize(dev, st);
		const double t2 = bench_now_s();
		if (r)
			ta[r - 1] = t1 - t0, tf[r - 1] = t2 - t1;
	}
	int32_t status = -3;
	uint64_t back[2] = { 1, 1 };
	if (!err)
		err = kvr_dev_memcpy_async(dev, &status, d.status, 4, KVR_COPY_D2H, st);
	if (!err)
		err = kvr_dev_memcpy_async(dev, back, d.counters, 16, KVR_COPY_D2H, st);
	if (!err)
		err = kvr_dev_stream_synchronize(dev, st);
	if (err)
		fprintf(stderr, "kvrecall bench freelist: device: %s\n", kvr_dev_last_error(dev));
	else if (status || back[0] != (uint64_t)(reps + 1) * total || back[1] != capacity + back[0]) {
		fprintf(stderr, "kvrecall bench freelist: device rounds went wrong (status %d)\n", status);
		err = -EIO;
	}
	if (!err) {
		*alloc_us = bench_median(ta, reps) * 1e6;
		*free_us = bench_median(tf, reps) * 1e6;
	}
	dev_round_free(dev, &d);
	return err;
}

#define FREELIST_CMD "kvrecall bench freelist"

static void freelist_usage(FILE *f)
{
	fprintf(f, "usage: kvrecall bench freelist [--backend cpu|cuda|auto] [--units 32,256,2048,16384,131072] "
		   "[--reps 15] [--quick] [--json FILE]\n"
		   "  --backend B   the device of the device rounds (default cpu)\n"
		   "  --units LIST  up to 8 unit counts, 1 to 4194304\n"
		   "  --reps N      timed rounds per figure, 1 to 63\n");
}

int bench_freelist(int argc, char **argv)
{
	const char *json_path = NULL;
	uint32_t units_list[8] = { 32, 256, 2048, 16384, 131072 }, n_units = 5, reps = 15;
	uint32_t backend_index = 1; /* cpu */
	for (int i = 0; i < argc; i++) {
		if (cli_is_help(argv[i])) {
			freelist_usage(stdout);
			return CLI_EXIT_OK;
		}
		if (!strcmp(argv[i], "--quick")) {
			reps = 3, n_units = n_units < 2 ? n_units : 2;
			continue;
		}
		CLI_TAKE(cli_opt_choice(FREELIST_CMD, argc, argv, &i, "--backend", cli_backend_names, &backend_index))
		CLI_TAKE(cli_opt_str(FREELIST_CMD, argc, argv, &i, "--json", &json_path))
		CLI_TAKE(cli_opt_u32_list(FREELIST_CMD, argc, argv, &i, "--units", 1, 1u << 22, units_list, 8, &n_units))
		CLI_TAKE(cli_opt_u32(FREELIST_CMD, argc, argv, &i, "--reps", 1, 63, &reps))
		return cli_usage_error(FREELIST_CMD, "unknown option '%s'", argv[i]);
	}
	const char *backend = cli_backend_names[backend_index];
	struct kvr_dev *dev = NULL;
	struct kvr_stream *st = NULL;
	const char *dev_name = "";
	if (bench_open_device(FREELIST_CMD, backend, &dev, &dev_name))
		return 1;
	if (kvr_dev_stream_create(dev, KVR_STREAM_INLINE, &st)) {
		fprintf(stderr, "kvrecall bench freelist: %s\n", kvr_dev_last_error(dev));
		kvr_dev_destroy(dev);
		return 1;
	}
	double alloc_us[8], free_us[8], dev_alloc_us[8], dev_free_us[8];
	uint64_t rng = 0x9e3779b97f4a7c15ull;
	int failed = 0;
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
			failed = 1;
			break;
		}
		struct kvr_freelist l;
		kvr_freelist_init(&l, ids, capacity);
		uint64_t total = 0;
		for (uint32_t u = 0; u < units; u++) {
			counts[u] = (uint32_t)(bench_xorshift(&rng) >> 62) % 3;
			out[u] = slots + 2 * u;
			total += counts[u];
		}
		/* the device starts from the same list */
		if (time_device(dev, st, ids, counts, units, capacity, total, reps, &dev_alloc_us[ui],
				&dev_free_us[ui])) {
			free(ids), free(counts), free(offsets), free(slots), free(out);
			failed = 1;
			break;
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
				failed = 1;
				break;
			}
			if (r)
				ta[r - 1] = t1 - t0, tf[r - 1] = t2 - t1;
		}
		if (failed) {
			free(ids), free(counts), free(offsets), free(slots), free(out);
			break;
		}
		alloc_us[ui] = bench_median(ta, reps) * 1e6;
		free_us[ui] = bench_median(tf, reps) * 1e6;
		free(ids), free(counts), free(offsets), free(slots), free(out);
	}
	kvr_dev_stream_destroy(dev, st);
	kvr_dev_destroy(dev);
	if (failed)
		return 1;
	bench_progress("freelist", 1, 1);
	fprintf(stderr, "kvrecall bench freelist: one round (scan + slice copies + one counter), median of %u;\n"
			"host = layouts/freelist.h on one thread, %s = the freelist kernel, enqueue to synchronised\n"
			"%10s %12s %12s %12s %12s %12s\n",
		reps, dev_name, "units", "host alloc", "host free", "dev alloc", "dev free", "dev ns/unit");
	for (uint32_t i = 0; i < n_units; i++)
		fprintf(stderr, "%10u %12.2f %12.2f %12.2f %12.2f %12.2f\n", units_list[i], alloc_us[i], free_us[i],
			dev_alloc_us[i], dev_free_us[i], (dev_alloc_us[i] + dev_free_us[i]) * 1e3 / 2 / units_list[i]);
	FILE *f = json_path ? fopen(json_path, "w") : stdout;
	if (!f) {
		fprintf(stderr, "kvrecall bench freelist: cannot write %s: %s\n", json_path, strerror(errno));
		return 1;
	}
	bench_json_open(f, "freelist", dev_name, argc, argv);
	fprintf(f, "  \"params\": {\"reps\": %u, \"pages_per_unit\": 8, \"ask\": \"0-2 pages per unit\"},\n"
		   "  \"results\": [\n",
		reps);
	for (uint32_t i = 0; i < n_units; i++)
		fprintf(f,
			"    {\"units\": %u, \"alloc_round_us\": %.3f, \"free_round_us\": %.3f, \"ns_per_unit\": %.3f, "
			"\"device_alloc_round_us\": %.3f, \"device_free_round_us\": %.3f, \"device_ns_per_unit\": %.3f}%s\n",
			units_list[i], alloc_us[i], free_us[i], (alloc_us[i] + free_us[i]) * 1e3 / 2 / units_list[i],
			dev_alloc_us[i], dev_free_us[i], (dev_alloc_us[i] + dev_free_us[i]) * 1e3 / 2 / units_list[i],
			i + 1 < n_units ? "," : "");
	fprintf(f, "  ]\n");
	bench_json_close(f);
	return 0;
}
