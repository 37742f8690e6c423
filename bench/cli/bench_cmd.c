/* SPDX-License-Identifier: MIT */
/*
 * bench_cmd.c — `kvrecall bench`: the benchmarks users run on their own
 * hardware before integrating kvrecall. This file owns the command's
 * shared parts — option parsing, the backend device, the JSON envelope that
 * records the machine and the build beside every result, the progress line —
 * and the `copy` benchmark, whose peak every other figure is divided by.
 *
 *   kvrecall bench copy [--backend auto|cpu|cuda] [--json FILE] [--quick] [--reps N]
 *
 * copy: raw transfer bandwidth against transfer size (256 B to 4 MiB), one
 * call per transfer against one batched call for all of them, pinned against
 * pageable host memory, host->device and device->host. On cuda this is the
 * PCIe (or NVLink-C2C) link; on the cpu backend, where "device" memory is host
 * memory, it is memcpy through the backend's copy path (pinned = registered
 * and locked; both kinds are touched before timing, so page faults are not
 * measured).
 *
 * Like the other drivers of internals (cuda_bench, pool_bench) it reaches the
 * device layer (gpu/backend.h), so the command links the static library.
 * Threads: the caller's; the cpu backend's batched copies also use its
 * workers (one per core beyond the caller's).
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "kvrecall.h"
#include "bench_cmd.h"
#include "../bench_common.h"
#include "../cli_args.h"
#include "../../gpu/backend.h"
#include "git_revision.h"

#ifndef KVR_BUILD_TYPE
#define KVR_BUILD_TYPE "unknown"
#endif

/* ------------------------------------------------------------------ shared */

/* Open the device for --backend (auto: cuda when a GPU is usable). */
int bench_open_device(const char *cmd, const char *backend, struct kvr_dev **dev, const char **name)
{
	char err[256] = "";
	const int want_cuda = !strcmp(backend, "cuda"), auto_pick = !strcmp(backend, "auto");
	if (!want_cuda && !auto_pick && strcmp(backend, "cpu")) {
		cli_bad_choice(cmd, "--backend", backend, cli_backend_names);
		return -EINVAL;
	}
	if (want_cuda || auto_pick) {
		const struct kvr_dev_params p = { .kind = KVR_DEV_CUDA };
		const int r = kvr_dev_create(&p, dev, err, sizeof(err));
		if (!r) {
			*name = "cuda";
			return 0;
		}
		if (want_cuda) {
			fprintf(stderr, "%s: --backend cuda: %s\n", cmd, err);
			return r;
		}
	}
	const long cores = sysconf(_SC_NPROCESSORS_ONLN);
	const struct kvr_dev_params p = { .kind = KVR_DEV_CPU, .threads = cores > 1 ? (uint32_t)cores - 1 : 0 };
	const int r = kvr_dev_create(&p, dev, err, sizeof(err));
	if (r)
		fprintf(stderr, "%s: cpu backend: %s\n", cmd, err);
	*name = "cpu";
	return r;
}

void bench_json_string(FILE *f, const char *s)
{
	fputc('"', f);
	for (; *s; s++) {
		if (*s == '"' || *s == '\\')
			fprintf(f, "\\%c", *s);
		else if ((unsigned char)*s < 0x20)
			fprintf(f, "\\u%04x", *s);
		else
			fputc(*s, f);
	}
	fputc('"', f);
}

/* A sysfs attribute of a PCI device, e.g. current_link_speed: "" when absent. */
static void pci_attribute(const char *bus_id, const char *attr, char *out, size_t bytes)
{
	char path[256], lower[64];
	size_t i = 0;
	for (; bus_id[i] && i + 1 < sizeof(lower); i++)
		lower[i] = (char)(bus_id[i] >= 'A' && bus_id[i] <= 'F' ? bus_id[i] + 32 : bus_id[i]);
	lower[i] = 0;
	snprintf(path, sizeof(path), "/sys/bus/pci/devices/%s/%s", lower, attr);
	out[0] = 0;
	FILE *f = fopen(path, "r");
	if (!f)
		return;
	if (fgets(out, (int)bytes, f))
		out[strcspn(out, "\n")] = 0;
	fclose(f);
}

/* The envelope's opening: schema, benchmark, command line, time, machine,
 * build and backend; the caller writes "results" and ends with
 * bench_json_close, which closes f unless it is stdout. */
void bench_json_open(FILE *f, const char *benchmark, const char *backend, int argc, char **argv)
{
	struct kvr_system_info s = { .size = sizeof(s) };
	kvr_system_query(&s);
	char when[64];
	const time_t now = time(NULL);
	struct tm tm;
	gmtime_r(&now, &tm);
	strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", &tm);
	fprintf(f, "{\n  \"schema\": \"kvrecall-bench/1\",\n  \"benchmark\": ");
	bench_json_string(f, benchmark);
	fprintf(f, ",\n  \"created\": \"%s\",\n  \"command\": \"kvrecall %s%s", when,
		strcmp(benchmark, "selftest") ? "bench " : "", benchmark);
	for (int i = 0; i < argc; i++) {
		fputc(' ', f);
		/* the quotes of bench_json_string would end the string: escape inline */
		for (const char *c = argv[i]; *c; c++) {
			if (*c == '"' || *c == '\\')
				fprintf(f, "\\%c", *c);
			else if ((unsigned char)*c >= 0x20)
				fputc(*c, f);
		}
	}
	fprintf(f, "\",\n  \"machine\": {\"cpu_model\": ");
	bench_json_string(f, s.cpu_model);
	fprintf(f, ", \"cores\": %u, \"hardware_threads\": %u, \"numa_nodes\": %u, \"memory_bytes\": %llu, "
		   "\"last_level_cache_bytes\": %llu, \"avx2\": %s, \"avx512\": %s, \"gpu\": ",
		s.n_cores, s.n_pus, s.n_numa_nodes, (unsigned long long)s.memory_bytes,
		(unsigned long long)s.l3_bytes, s.cpu_avx2 ? "true" : "false", s.cpu_avx512 ? "true" : "false");
	if (s.n_gpus) {
		char speed[64], width[64];
		pci_attribute(s.gpu_pci_bus_id, "current_link_speed", speed, sizeof(speed));
		pci_attribute(s.gpu_pci_bus_id, "current_link_width", width, sizeof(width));
		fprintf(f, "{\"name\": ");
		bench_json_string(f, s.gpu_name);
		fprintf(f, ", \"count\": %u, \"pci_bus_id\": ", s.n_gpus);
		bench_json_string(f, s.gpu_pci_bus_id);
		fprintf(f, ", \"link_speed\": ");
		bench_json_string(f, speed);
		fprintf(f, ", \"link_width\": ");
		bench_json_string(f, width);
		fprintf(f, "}");
	} else {
		fprintf(f, "null");
	}
	fprintf(f, ", \"gpu_reason\": ");
	bench_json_string(f, s.gpu_reason);
	/* the cpu kernels' path (KVR_CPU_ISA may force one below the best), so
	 * that results from several paths on one machine tell themselves apart */
	fprintf(f, ", \"cpu_kernels\": ");
	bench_json_string(f, s.cpu_kernels);
	fprintf(f, "},\n  \"build\": {\"version\": ");
	bench_json_string(f, kvr_version_string());
	fprintf(f, ", \"git_revision\": ");
	bench_json_string(f, KVR_GIT_REVISION);
	fprintf(f, ", \"build_type\": ");
	bench_json_string(f, KVR_BUILD_TYPE);
	fprintf(f, ", \"compiler\": ");
#if defined(__GNUC__) && !defined(__clang__)
	bench_json_string(f, "gcc " __VERSION__);
#else
	bench_json_string(f, __VERSION__);
#endif
	fprintf(f, ", \"cuda_compiled\": %s, \"cuda_runtime_version\": %u, \"gpu_archs\": ",
		s.cuda_compiled ? "true" : "false", s.cuda_runtime_version);
	bench_json_string(f, s.gpu_archs);
	fprintf(f, "},\n  \"backend\": ");
	bench_json_string(f, backend);
	fprintf(f, ",\n");
}

void bench_json_close(FILE *f)
{
	fprintf(f, "}\n");
	if (f != stdout)
		fclose(f);
}

/* A progress line on stderr when it is a terminal: "label [#####.....] 42%". */
/* 1 when stderr is a terminal: progress bars only there (in a file their
 * carriage returns would land as they are) */
static int stderr_tty(void)
{
	static int tty = -1;
	if (tty < 0)
		tty = isatty(STDERR_FILENO);
	return tty;
}

void bench_progress_clear(void)
{
	if (stderr_tty())
		fprintf(stderr, "\r%*s\r", 50, "");
}

void bench_progress(const char *label, uint32_t done, uint32_t total)
{
	if (!stderr_tty() || !total)
		return;
	const uint32_t width = 30, filled = done * width / total;
	char bar[32];
	for (uint32_t i = 0; i < width; i++)
		bar[i] = i < filled ? '#' : '.';
	bar[width] = 0;
	fprintf(stderr, "\r%-10s [%s] %3u%%", label, bar, done * 100 / total);
	if (done == total)
		fprintf(stderr, "\r%*s\r", 50, "");
	fflush(stderr);
}

/* ------------------------------------------------------------------ copy */

enum { DIR_H2D, DIR_D2H };
enum { MEM_PINNED, MEM_PAGEABLE };
enum { CALL_SINGLE, CALL_BATCHED };

struct copy_row {
	uint32_t dir, mem, call;
	uint64_t transfer_bytes, transfers;
	double us_per_transfer, gbps;
};

struct copy_env {
	struct kvr_dev *dev;
	struct kvr_stream *stream;
	unsigned char *host[2]; /* [MEM_PINNED], [MEM_PAGEABLE] */
	unsigned char *device;
	uint64_t bytes;         /* of each buffer */
	struct kvr_copy_desc *descs;
	uint32_t reps;
};

/* Seconds to move n transfers of `size` bytes (distinct offsets), enqueued
 * back to back and then synchronised; the median of env->reps runs. */
static int time_copies(struct copy_env *e, uint32_t dir, uint32_t mem, uint32_t call, uint64_t size,
		       uint64_t n, double *seconds)
{
	unsigned char *host = e->host[mem];
	const uint32_t kind = dir == DIR_H2D ? KVR_COPY_H2D : KVR_COPY_D2H;
	double t[16];
	/* spread over the whole buffers, larger than the last-level cache, so
	 * small transfers are not served from it (as page gathers are not) */
	const uint64_t stride = e->bytes / n / 64 * 64;
	for (uint32_t i = 0; i < n; i++) {
		e->descs[i].src_offset = e->descs[i].dst_offset = i * stride;
		e->descs[i].bytes = size;
	}
	for (uint32_t r = 0; r <= e->reps; r++) { /* run 0 warms up */
		const double t0 = bench_now_s();
		int err = 0;
		if (call == CALL_BATCHED) {
			err = dir == DIR_H2D
				      ? kvr_dev_memcpy_batch_async(e->dev, e->device, host, e->descs, n, kind, e->stream)
				      : kvr_dev_memcpy_batch_async(e->dev, host, e->device, e->descs, n, kind, e->stream);
		} else {
			for (uint64_t i = 0; !err && i < n; i++)
				err = dir == DIR_H2D ? kvr_dev_memcpy_async(e->dev, e->device + i * stride,
									    host + i * stride, size, kind, e->stream)
						     : kvr_dev_memcpy_async(e->dev, host + i * stride,
									    e->device + i * stride, size, kind, e->stream);
		}
		if (!err)
			err = kvr_dev_stream_synchronize(e->dev, e->stream);
		if (err) {
			fprintf(stderr, "kvrecall bench copy: %s\n", kvr_dev_last_error(e->dev));
			return err;
		}
		if (r)
			t[r - 1] = bench_now_s() - t0;
	}
	*seconds = bench_median(t, e->reps);
	return 0;
}

static const char *dir_name(uint32_t d)
{
	return d == DIR_H2D ? "h2d" : "d2h";
}

#define COPY_CMD "kvrecall bench copy"

static void copy_usage(FILE *f)
{
	fprintf(f, "usage: kvrecall bench copy [--backend auto|cpu|cuda] [--json FILE] [--quick] [--reps N]\n"
		   "  --backend B   the device (default auto: cuda when a GPU is usable, else cpu)\n"
		   "  --reps N      timed runs per figure, 1 to 15 (default 5; --quick: at most 3)\n"
		   "  --quick       fewer and smaller transfers\n"
		   "  --json FILE   the results as JSON (default: stdout)\n");
}

int bench_copy(int argc, char **argv)
{
	const char *json_path = NULL;
	uint32_t reps = 5, quick = 0, backend_index = 0; /* auto */
	for (int i = 0; i < argc; i++) {
		if (cli_is_help(argv[i])) {
			copy_usage(stdout);
			return CLI_EXIT_OK;
		}
		if (!strcmp(argv[i], "--quick")) {
			quick = 1;
			continue;
		}
		CLI_TAKE(cli_opt_choice(COPY_CMD, argc, argv, &i, "--backend", cli_backend_names, &backend_index))
		CLI_TAKE(cli_opt_str(COPY_CMD, argc, argv, &i, "--json", &json_path))
		CLI_TAKE(cli_opt_u32(COPY_CMD, argc, argv, &i, "--reps", 1, 15, &reps))
		return cli_usage_error(COPY_CMD, "unknown option '%s'", argv[i]);
	}
	const char *backend = cli_backend_names[backend_index];
	if (quick)
		reps = reps < 3 ? reps : 3;
	struct copy_env e = { .reps = reps };
	const char *backend_name;
	if (bench_open_device(COPY_CMD, backend, &e.dev, &backend_name))
		return 1;
	/* Each timed run moves `floor` bytes, in 16 to max_transfers transfers
	 * (small sizes: fewer bytes, since one call per transfer is then what is
	 * measured), spread over buffers of e.bytes. */
	const uint64_t floor = quick ? 16ull << 20 : 128ull << 20, max_size = 4ull << 20;
	const uint64_t max_transfers = quick ? 4096 : 65536;
	e.bytes = floor > 16 * max_size ? floor : 16 * max_size;
	int rc = kvr_dev_stream_create(e.dev, KVR_STREAM_INLINE, &e.stream);
	for (int m = 0; !rc && m < 2; m++) {
		e.host[m] = aligned_alloc(4096, e.bytes);
		if (!e.host[m]) {
			rc = -ENOMEM;
			break;
		}
		memset(e.host[m], m + 1, e.bytes); /* touched: no first-use faults in the timings */
	}
	if (!rc && (rc = kvr_dev_alloc(e.dev, e.bytes, (void **)&e.device)))
		fprintf(stderr, "kvrecall bench copy: %s\n", kvr_dev_last_error(e.dev));
	int pinned_locked = 0;
	if (!rc) {
		/* pinned: registered with the device (cuda: page-locked and mapped);
		 * on the cpu backend registering is a no-op, so lock it here */
		pinned_locked = !mlock(e.host[MEM_PINNED], e.bytes);
		if ((rc = kvr_dev_host_register(e.dev, e.host[MEM_PINNED], e.bytes)))
			fprintf(stderr, "kvrecall bench copy: %s\n", kvr_dev_last_error(e.dev));
	}
	e.descs = calloc(max_transfers, sizeof(*e.descs));
	if (!rc && !e.descs)
		rc = -ENOMEM;
	struct copy_row rows[2 * 2 * 2 * 8];
	uint32_t n_rows = 0;
	const uint32_t n_sizes = 8, total = 2 * 2 * 2 * n_sizes;
	for (uint64_t size = 256; !rc && size <= max_size; size *= 4)
		for (uint32_t dir = 0; !rc && dir < 2; dir++)
			for (uint32_t mem = 0; !rc && mem < 2; mem++)
				for (uint32_t call = 0; !rc && call < 2; call++) {
					bench_progress("copy", n_rows, total);
					uint64_t n = floor / size;
					n = n < 16 ? 16 : n > max_transfers ? max_transfers : n;
					double s = 0;
					rc = time_copies(&e, dir, mem, call, size, n, &s);
					rows[n_rows++] = (struct copy_row){ dir, mem, call, size, n, s / (double)n * 1e6,
									    (double)(n * size) / s / 1e9 };
				}
	bench_progress("copy", total, total);
	double peak = 0;
	uint64_t peak_size = 0;
	for (uint32_t i = 0; i < n_rows; i++)
		if (rows[i].dir == DIR_H2D && rows[i].mem == MEM_PINNED && rows[i].gbps > peak)
			peak = rows[i].gbps, peak_size = rows[i].transfer_bytes;
	if (!rc) {
		fprintf(stderr, "kvrecall bench copy: %s backend (%s), %u runs per figure (median)\n",
			backend_name, kvr_dev_name(e.dev), reps);
		fprintf(stderr, "GB/s per transfer size; single = one call per transfer, batched = one call\n");
		fprintf(stderr, "%-9s", "size");
		for (uint32_t dir = 0; dir < 2; dir++)
			for (uint32_t mem = 0; mem < 2; mem++)
				for (uint32_t call = 0; call < 2; call++)
					fprintf(stderr, " %3s %-8s %-7s", dir_name(dir), mem ? "pageable" : "pinned",
						call ? "batched" : "single");
		fprintf(stderr, "\n");
		for (uint32_t i = 0; i < n_rows; i += 8) {
			const uint64_t sz = rows[i].transfer_bytes;
			char label[32];
			if (sz >= 1 << 20)
				snprintf(label, sizeof(label), "%llu MiB", (unsigned long long)(sz >> 20));
			else if (sz >= 1024)
				snprintf(label, sizeof(label), "%llu KiB", (unsigned long long)(sz >> 10));
			else
				snprintf(label, sizeof(label), "%llu B", (unsigned long long)sz);
			fprintf(stderr, "%-9s", label);
			for (uint32_t j = 0; j < 8; j++)
				fprintf(stderr, " %20.2f", rows[i + j].gbps);
			fprintf(stderr, "\n");
		}
		fprintf(stderr, "peak host->device (pinned): %.2f GB/s at %llu-byte transfers%s\n", peak,
			(unsigned long long)peak_size, pinned_locked ? "" : " (mlock refused: pinned = registered only)");
		FILE *f = json_path ? fopen(json_path, "w") : stdout;
		if (!f) {
			fprintf(stderr, "kvrecall bench copy: cannot write %s: %s\n", json_path, strerror(errno));
			rc = -errno;
		} else {
			bench_json_open(f, "copy", backend_name, argc, argv);
			fprintf(f, "  \"params\": {\"reps\": %u, \"bytes_per_run_min\": %llu, \"pinned_locked\": %s},\n",
				reps, (unsigned long long)floor, pinned_locked ? "true" : "false");
			fprintf(f, "  \"results\": [\n");
			for (uint32_t i = 0; i < n_rows; i++)
				fprintf(f,
					"    {\"direction\": \"%s\", \"host_memory\": \"%s\", \"calls\": \"%s\", "
					"\"transfer_bytes\": %llu, \"transfers\": %llu, \"us_per_transfer\": %.4f, "
					"\"gbps\": %.4f}%s\n",
					dir_name(rows[i].dir), rows[i].mem ? "pageable" : "pinned",
					rows[i].call ? "batched" : "single", (unsigned long long)rows[i].transfer_bytes,
					(unsigned long long)rows[i].transfers, rows[i].us_per_transfer, rows[i].gbps,
					i + 1 < n_rows ? "," : "");
			fprintf(f, "  ],\n  \"summary\": {\"peak_h2d_pinned_gbps\": %.4f, \"peak_transfer_bytes\": %llu}\n",
				peak, (unsigned long long)peak_size);
			bench_json_close(f);
		}
	}
	if (e.host[MEM_PINNED] && !rc)
		kvr_dev_host_unregister(e.dev, e.host[MEM_PINNED]);
	if (e.device)
		kvr_dev_free(e.dev, e.device);
	if (e.stream)
		kvr_dev_stream_destroy(e.dev, e.stream);
	if (pinned_locked)
		munlock(e.host[MEM_PINNED], e.bytes);
	free(e.host[0]), free(e.host[1]), free(e.descs);
	kvr_dev_destroy(e.dev);
	return rc ? 1 : 0;
}

/* ------------------------------------------------------------------ dispatch */

static void bench_usage(FILE *f)
{
	fprintf(f, "usage: kvrecall bench <benchmark> [options]\n"
		   "\n"
		   "benchmarks:\n"
		   "  copy     transfer bandwidth against transfer size: single and batched calls,\n"
		   "           pinned and pageable memory, host->device and device->host\n"
		   "  recall   one layer's recall latency for a model shape, budget, batch and miss\n"
		   "           rate: HND and NHD pool, one and two staging buffers, chunk sizes,\n"
		   "           zero-copy; bandwidth and its ratio to the copy peak\n"
		   "  decode   synthetic decode steps per mode and context: step time, critical\n"
		   "           path, corrections, hit rate (--trace FILE: a Chrome trace)\n"
		   "  freelist one allocation and one free round of the device page cache's\n"
		   "           free-page list against the number of heads x sequences\n"
		   "  cache    device bytes the shared page cache of quantised pages holds for a\n"
		   "           mix of dense and sparse sequences, against per-sequence slot tiles\n"
		   "  spill    the spill tier's file: spill and recall throughput against queue depth\n"
		   "           and run size, beside raw O_DIRECT reads of the same file\n"
		   "\n"
		   "\n"
		   "Each writes a table to stderr and JSON (schema kvrecall-bench/1, with the\n"
		   "machine and build) to --json FILE or stdout. 'kvrecall bench <benchmark> --help'\n"
		   "lists a benchmark's options; docs/benchmarks.md describes the results.\n");
}

int bench_main(int argc, char **argv)
{
	static const struct {
		const char *name;
		int (*run)(int argc, char **argv);
	} benchmarks[] = {
		{ "copy", bench_copy },     { "recall", bench_recall }, { "decode", bench_decode },
		{ "freelist", bench_freelist }, { "cache", bench_cache },   { "spill", bench_spill },
	};
	if (argc < 1) {
		bench_usage(stderr);
		return CLI_EXIT_USAGE;
	}
	if (cli_is_help(argv[0]) || !strcmp(argv[0], "help")) {
		bench_usage(stdout);
		return CLI_EXIT_OK;
	}
	for (size_t b = 0; b < sizeof(benchmarks) / sizeof(benchmarks[0]); b++)
		if (!strcmp(argv[0], benchmarks[b].name))
			return benchmarks[b].run(argc - 1, argv + 1);
	if (argv[0][0] == '-')
		return cli_usage_error("kvrecall bench", "unknown option '%s'", argv[0]);
	return cli_usage_error("kvrecall bench",
			       "unknown benchmark '%s' (copy, recall, decode, freelist, cache, spill)", argv[0]);
}
