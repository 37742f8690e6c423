/* SPDX-License-Identifier: MIT */
/*
 * test_info.c — kvr_system_query and `kvrecall info` tell the truth: build
 * features match how this build was configured, the GPU line gives the exact
 * reason when there is none, and CPU/topology facts match the OS's. Then the
 * command as a program: its benchmarks' JSON, and its command line (help on
 * stdout, --version, errors that name their command, option and range, exit
 * statuses).
 */
#include <criterion/criterion.h>
#include <stddef.h>
#include <stdarg.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvrecall.h"

#ifndef KVR_EXE_PATH
#error "KVR_EXE_PATH must name the built kvrecall command"
#endif

Test(info, system_query_is_truthful)
{
	struct kvr_system_info s = { .size = sizeof(s) };
	cr_assert_eq(kvr_system_query(&s), 0, "%s", kvr_last_error(NULL));
	cr_expect_eq(s.version_number, KVR_VERSION_NUMBER);
#ifdef KVR_TEST_HAVE_CUDA
	cr_expect_eq(s.cuda_compiled, 1);
	cr_expect_gt(s.cuda_runtime_version, 0);
	cr_expect_str_neq(s.gpu_archs, "");
#else
	cr_expect_eq(s.cuda_compiled, 0);
	cr_expect(strstr(s.gpu_reason, "not compiled") != NULL, "%s", s.gpu_reason);
#endif
	if (s.n_gpus == 0)
		cr_expect_str_neq(s.gpu_reason, "", "no GPU but no reason");
	else
		cr_expect_str_neq(s.gpu_name, "");
	cr_expect_geq(s.n_numa_nodes, 1);
	cr_expect_geq(s.n_pus, s.n_cores);
	cr_expect_eq(s.n_pus, (uint32_t)sysconf(_SC_NPROCESSORS_ONLN));
	cr_expect_eq(s.memory_bytes,
		     (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE));
	cr_expect(s.cpu_avx512 == 0 || s.cpu_avx2 == 1, "AVX-512 without AVX2");
#ifdef __AVX2__
	cr_expect_eq(s.cpu_avx2, 1);
#endif
	cr_expect_eq(s.liburing_compiled, KVR_TEST_HAVE_LIBURING);
	if (!s.io_uring_available)
		cr_expect_str_neq(s.io_uring_reason, "");
}

Test(info, system_query_rejects_bad_size)
{
	struct kvr_system_info s = { .size = 4 };
	cr_expect_eq(kvr_system_query(&s), -EINVAL);
	cr_expect(strstr(kvr_last_error(NULL), "size") != NULL);
	cr_expect_eq(kvr_system_query(NULL), -EINVAL);
}

/* The spill directory's report: an O_DIRECT claim is true (a file there
 * really takes an aligned O_DIRECT write), and a missing directory is an
 * error that names it. */
Test(info, spill_dir_query)
{
	struct kvr_spill_dir_info d = { .size = sizeof(d) };
	cr_assert_eq(kvr_spill_dir_query(NULL, &d), 0, "%s", kvr_last_error(NULL));
	cr_expect_str_neq(d.dir, "");
	cr_expect_str_neq(d.fs_type, "");
	cr_expect_gt(d.free_bytes, 0);
	if (d.direct_io) {
		cr_expect(d.dio_align >= 512 && !(d.dio_align & (d.dio_align - 1)), "%u", d.dio_align);
		char path[512];
		snprintf(path, sizeof(path), "%s/kvr-info-XXXXXX", d.dir);
		int fd = mkstemp(path);
		cr_assert_geq(fd, 0);
		unlink(path);
		cr_assert_eq(fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_DIRECT), 0);
		void *block = NULL;
		cr_assert_eq(posix_memalign(&block, 4096, 4096), 0);
		memset(block, 7, 4096);
		cr_expect_eq(pwrite(fd, block, d.dio_align, 0), (ssize_t)d.dio_align, "%s", strerror(errno));
		free(block);
		close(fd);
	} else {
		cr_expect_str_neq(d.reason, "");
	}
	cr_expect_eq(kvr_spill_dir_query("/nonexistent-kvrecall-dir", &d), -ENOENT);
	cr_expect(strstr(d.reason, "/nonexistent-kvrecall-dir") != NULL, "%s", d.reason);
	cr_expect(strstr(kvr_last_error(NULL), "/nonexistent-kvrecall-dir") != NULL);
	struct kvr_spill_dir_info small = { .size = 8 };
	cr_expect_eq(kvr_spill_dir_query(NULL, &small), -EINVAL);
	cr_expect_eq(kvr_spill_dir_query(NULL, NULL), -EINVAL);
}

static size_t run(const char *args, char *out, size_t out_bytes, int *status)
{
	char cmd[1024];
	snprintf(cmd, sizeof(cmd), "'%s' %s 2>&1", KVR_EXE_PATH, args);
	FILE *f = popen(cmd, "r");
	cr_assert_not_null(f);
	size_t n = fread(out, 1, out_bytes - 1, f);
	out[n] = '\0';
	*status = pclose(f);
	return n;
}

/* KVR_CPU_ISA picks the cpu kernels' path: honoured by the
 * library (kvr_system_query in this process, set before first use) and by
 * `kvrecall info`, with the request reported; a name that is no path is
 * ignored, saying so. A 0.6 caller's smaller struct is still filled, and the
 * newer fields past its end are left alone. */
Test(info, cpu_isa_override_is_honoured_and_reported)
{
	setenv("KVR_CPU_ISA", "scalar", 1);
	struct kvr_system_info s = { .size = sizeof(s) };
	cr_assert_eq(kvr_system_query(&s), 0, "%s", kvr_last_error(NULL));
	cr_expect_str_eq(s.cpu_kernels, "scalar");
	cr_expect_str_eq(s.cpu_kernels_note, "KVR_CPU_ISA=scalar");
	char out[8192];
	int status;
	setenv("KVR_CPU_ISA", "avx2", 1);
	run("info --json", out, sizeof(out), &status);
	cr_expect_eq(status, 0, "%s", out);
	cr_expect(strstr(out, s.cpu_avx2 && s.cpu_f16c ? "\"cpu_kernels\": \"avx2\"" : "\"cpu_kernels\": \"scalar\""),
		  "%s", out);
	cr_expect(strstr(out, "\"cpu_kernels_note\": \"KVR_CPU_ISA=avx2"), "%s", out);
	setenv("KVR_CPU_ISA", "avx9", 1);
	run("info", out, sizeof(out), &status);
	cr_expect_eq(status, 0, "%s", out);
	const char *best = s.cpu_avx512 && s.cpu_f16c ? "avx512" : s.cpu_avx2 && s.cpu_f16c ? "avx2" : "scalar";
	/* "avx512" also heads "avx512vnni", the best path where the CPU has VNNI */
	char want[128];
	snprintf(want, sizeof(want), "kernels %s", best);
	cr_expect(strstr(out, want), "missing '%s' in:\n%s", want, out);
	cr_expect(strstr(out, " (KVR_CPU_ISA=avx9 names no path"), "%s", out);
	unsetenv("KVR_CPU_ISA");

	struct kvr_system_info old;
	memset(&old, 0x5a, sizeof(old));
	old.size = (uint32_t)offsetof(struct kvr_system_info, cpu_kernels);
	cr_assert_eq(kvr_system_query(&old), 0, "%s", kvr_last_error(NULL));
	cr_expect_eq(old.size, offsetof(struct kvr_system_info, cpu_kernels));
	cr_expect_eq(old.n_cores, s.n_cores);
	cr_expect_eq((unsigned char)old.cpu_kernels[0], 0x5a, "a field past a 0.6 caller's struct was written");
}

Test(info, command_reports_gpu_truthfully)
{
	struct kvr_system_info s = { .size = sizeof(s) };
	kvr_system_query(&s);
	char out[8192];
	int status;
	run("info", out, sizeof(out), &status);
	cr_expect_eq(status, 0, "%s", out);
	char want[512];
	if (s.n_gpus == 0) {
		snprintf(want, sizeof(want), "CUDA backend %s; no GPU: %s",
			 s.cuda_compiled ? "compiled" : "not compiled", s.gpu_reason);
		cr_expect(strstr(out, want) != NULL, "missing '%s' in:\n%s", want, out);
	}
	cr_expect(strstr(out, kvr_version_string()) != NULL, "%s", out);
	cr_expect(strstr(out, "NUMA node") != NULL, "%s", out);
	cr_expect(strstr(out, "io_uring") != NULL, "%s", out);
	cr_expect(strstr(out, "  spill     ") != NULL, "%s", out);
	cr_expect(strstr(out, s.cpu_avx512 ? "AVX-512 yes" : "AVX-512 no") != NULL, "%s", out);
}

Test(info, command_json_and_errors)
{
	char out[8192];
	int status;
	run("info --json", out, sizeof(out), &status);
	cr_expect_eq(status, 0, "%s", out);
	cr_expect(out[0] == '{' && strstr(out, "\"cuda_compiled\": ") && strstr(out, "\"numa_nodes\": ") &&
			  strstr(out, "\"gpu_reason\": ") && strstr(out, "\"spill_direct_io\": "),
		  "%s", out);
	run("info --spill-dir /nonexistent-kvrecall-dir", out, sizeof(out), &status);
	cr_expect_eq(status, 0, "%s", out);
	cr_expect(strstr(out, "/nonexistent-kvrecall-dir: unusable") != NULL, "%s", out);
	run("info --bogus", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "unknown option") != NULL, "%s", out);
	run("frobnicate", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "unknown command") != NULL, "%s", out);
}

/* ------------------------------------------------------------------ kvrecall bench */

/* Run `kvrecall <args> <flag> FILE`, then the Python program check_fmt's with
 * FILE parsed as d (Python's json module is an independent parser) and FILE
 * as sys.argv[1]; it prints "ok" or fails with why. Skips without python3. */
static void __attribute__((format(printf, 3, 4)))
output_check(const char *args, const char *flag, const char *check_fmt, ...)
{
	char check[3072];
	va_list ap;
	va_start(ap, check_fmt);
	vsnprintf(check, sizeof(check), check_fmt, ap);
	va_end(ap);
	if (system("python3 -c 'import json' > /dev/null 2>&1") != 0)
		cr_skip_test("python3 is not installed: cannot parse the JSON independently");
	char path[] = "/tmp/kvr_bench_out_XXXXXX";
	const int fd = mkstemp(path);
	cr_assert_geq(fd, 0);
	close(fd);
	char cmd[1024], out[16384];
	int status;
	snprintf(cmd, sizeof(cmd), "%s %s %s", args, flag, path);
	run(cmd, out, sizeof(out), &status);
	cr_assert_eq(status, 0, "%s:\n%s", cmd, out);
	char script[4096];
	/* the output file's JSON as d, then the check */
	snprintf(script, sizeof(script),
		 "python3 - '%s' 2>&1 <<'PY'\nimport json, sys, itertools\nd = json.load(open(sys.argv[1]))\n"
		 "%s\nprint('ok')\nPY",
		 path, check);
	FILE *f = popen(script, "r");
	cr_assert_not_null(f);
	char verdict[2048];
	const size_t n = fread(verdict, 1, sizeof(verdict) - 1, f);
	verdict[n] = 0;
	const int rc = pclose(f);
	unlink(path);
	cr_expect(rc == 0 && !strncmp(verdict, "ok", 2), "%s: the %s output is not what it should be:\n%s", cmd, flag,
		  verdict);
}

/* The JSON envelope every benchmark shares (schema kvrecall-bench/1), then
 * the benchmark's own `python_check`. */
static const char envelope_check[] =
	"assert d['schema'] == 'kvrecall-bench/1', d['schema']\n"
	"prefix = 'kvrecall ' + ('' if d['benchmark'] == 'selftest' else 'bench ') + d['benchmark']\n"
	"assert d['command'].startswith(prefix), d['command']\n"
	"assert d['machine']['cores'] >= 1 and d['machine']['memory_bytes'] > 0\n"
	"assert d['build']['version'] and d['build']['git_revision'] and d['build']['build_type']\n"
	"assert d['machine']['cpu_kernels'] in ('scalar', 'avx2', 'avx512', 'avx512vnni'), d['machine']\n"
	"%s";

static void bench_json_check(const char *args, const char *python_check)
{
	output_check(args, "--json", envelope_check, python_check);
}

/* `kvrecall bench copy`: the documented envelope (docs/benchmarks.md, schema
 * kvrecall-bench/1), one row for every size x direction x memory x call kind,
 * and a peak equal to the best pinned host->device row. */
Test(bench, copy_writes_schema_json, .timeout = 120)
{
	bench_json_check(
		"bench copy --backend cpu --quick --reps 1",
		"assert d['benchmark'] == 'copy' and d['backend'] == 'cpu'\n"
		"rows = d['results']\n"
		"sizes = [256 * 4 ** i for i in range(8)]\n"
		"want = set(itertools.product(['h2d', 'd2h'], ['pinned', 'pageable'], ['single', 'batched'], sizes))\n"
		"got = set((r['direction'], r['host_memory'], r['calls'], r['transfer_bytes']) for r in rows)\n"
		"assert got == want and len(rows) == len(want), (len(rows), want - got)\n"
		"assert all(r['gbps'] > 0 and r['us_per_transfer'] > 0 and r['transfers'] >= 16 for r in rows)\n"
		"peak = max(r['gbps'] for r in rows if r['direction'] == 'h2d' and r['host_memory'] == 'pinned')\n"
		"assert abs(d['summary']['peak_h2d_pinned_gbps'] - peak) <= 1e-3 * peak, (d['summary'], peak)");
}

/* `kvrecall bench recall`: every variant (HND and NHD pool with one and two
 * buffers, K8V4 and K4V2 runs) recalled by the scheduler's own code byte-exact
 * (the command fails otherwise) and timed; misses follow batch x KV heads x
 * round(k x miss rate). */
Test(bench, recall_writes_schema_json, .timeout = 120)
{
	bench_json_check(
		"bench recall --backend cpu --preset smollm2-135m --budget 512,1024 --sink 128 --window 128 "
		"--batch 2 --miss-rate 0.5 --chunk-pages 4 --reps 1 --pool-mib 4",
		"assert d['benchmark'] == 'recall' and d['shape']['n_kv_heads'] == 3 and d['shape']['head_dim'] == 64\n"
		"assert d['params']['byte_exact'] is True and d['params']['code'] == 'scheduler/recall.c'\n"
		"rows = d['results']\n"
		"want = {(b, pl, bu) for b in (512, 1024) for pl, bu in (('hnd', 1), ('hnd', 2), ('nhd', 1), ('nhd', 2), ('k8v4', 0), ('k4v2', 0))}\n"
		"got = {(r['budget_tokens'], r['pool'], r['buffers']) for r in rows}\n"
		"assert got == want and len(rows) == len(want), (len(rows), want ^ got)\n"
		"for r in rows:\n"
		"    k = (r['budget_tokens'] - 256) // 32\n"
		"    assert r['misses'] == 2 * 3 * round(k * 0.5), r\n"
		"    # a K8V4 run: 8-bit keys, 4-bit values, f16 (s, z) per token for each; K4V2 half the codes\n"
		"    assert r['run_bytes'] == {'k8v4': 32 * (64 + 32 + 8), 'k4v2': 32 * (32 + 16 + 8)}.get(r['pool'], 2 * 32 * 64 * 2), r\n"
		"    assert r['bytes'] == r['misses'] * r['run_bytes'] and r['us_per_layer'] > 0 and r['gbps'] > 0, r\n"
		"    assert abs(r['ratio_to_copy_peak'] - r['gbps'] / d['summary']['peak_h2d_pinned_gbps']) < 1e-3 * r['ratio_to_copy_peak'] + 1e-4, r\n"
		"cache = {(c['budget_tokens'], c['kv_format']): c['per_sequence_bytes'] for c in d['device_cache']}\n"
		"assert set(cache) == {(b, f) for b in (512, 1024) for f in ('f16', 'k8v4', 'k4v2')}, cache\n"
		"for b in (512, 1024):\n"
		"    assert cache[(b, 'f16')] > cache[(b, 'k8v4')] > cache[(b, 'k4v2')] > 0, cache");
}

/* `kvrecall bench decode`: one row per mode and context with the fields the
 * schema names, each mode's step timed, and the ratios consistent with the
 * attention-over-B baseline measured in the same run. */
Test(bench, decode_writes_schema_json, .timeout = 300)
{
	bench_json_check(
		"bench decode --backend cpu --preset smollm2-135m --budget 512 --sink 128 --window 128 "
		"--max-context 8192 --steps 3",
		"assert d['benchmark'] == 'decode' and d['shape']['preset'] == 'smollm2-135m' and d['shape']['layers'] == 4\n"
		"assert d['params']['budget_tokens'] == 512 and d['params']['steps'] == 3\n"
		"rows = d['results']\n"
		"assert sorted(r['mode'] for r in rows) == ['blocking', 'dense', 'freekv', 'speculative'], rows\n"
		"for r in rows:\n"
		"    assert r['batch'] == 1 and r['context_tokens'] == 8192 and r['us_per_layer'] > 0, r\n"
		"    assert abs(r['ratio_to_attention_over_budget'] * r['attention_over_budget_us'] - r['us_per_layer']) < 0.01 * r['us_per_layer'] + 0.01, r\n"
		"    assert 0 < r['critical_share'] <= 1 and 0 <= r['hit_rate'] <= 1, r\n"
		"    assert (r['selections'] > 0) == (r['mode'] != 'dense'), r");
}

/* `kvrecall bench decode --kv-format A,B`: every row once per format, each
 * format with its own attention over B, and each row's speed over the first
 * format's same row (1 for the first format's own rows). */
Test(bench, decode_compares_kv_formats_in_one_run, .timeout = 300)
{
	bench_json_check(
		"bench decode --backend cpu --preset smollm2-135m --budget 512 --sink 128 --window 128 "
		"--max-context 8192 --steps 3 --mode dense --rounds 3 --kv-format f16,k8v4",
		"assert d['params']['kv_formats'] == ['f16', 'k8v4'] and d['params']['kv_format'] == 'f16', d['params']\n"
		"rows = d['results']\n"
		"assert [r['kv_format'] for r in rows] == ['f16', 'k8v4'], rows\n"
		"assert rows[0]['speed_over_first_kv_format'] == 1.0, rows[0]\n"
		"assert 0.1 < rows[1]['speed_over_first_kv_format'] < 10, rows[1]\n"
		"assert rows[0]['attention_over_budget_us'] != rows[1]['attention_over_budget_us'], rows\n"
		"for r in rows:\n"
		"    assert r['mode'] == 'dense' and r['context_tokens'] == 8192 and r['rounds'] == 3, r");
}

/* `kvrecall bench decode --rounds`: every row measured that many times in
 * turn with its own attention over B; the row is its median round, so its
 * ratio lies in the range reported and its fields agree with one another,
 * and the fastest of each side is no slower than that round's. */
Test(bench, decode_rounds_report_the_median_round, .timeout = 300)
{
	bench_json_check(
		"bench decode --backend cpu --preset smollm2-135m --budget 512 --sink 128 --window 128 "
		"--max-context 16384 --steps 3 --mode freekv --rounds 3",
		"assert d['params']['rounds'] == 3, d['params']\n"
		"rows = d['results']\n"
		"assert [r['context_tokens'] for r in rows] == [8192, 16384], rows\n"
		"for r in rows:\n"
		"    assert r['mode'] == 'freekv' and r['rounds'] == 3, r\n"
		"    lo, mid, hi = r['ratio_to_target_budget_min'], r['ratio_to_target_budget'], r['ratio_to_target_budget_max']\n"
		"    assert 0 < lo <= mid <= hi, r\n"
		"    budget = (1 + r['context_tokens'] / (32 * 512)) * r['attention_over_budget_us']\n"
		"    assert abs(r['us_per_layer'] / budget - mid) < 1e-3 * mid, r\n"
		"    # the fastest of each side, whichever rounds they came from\n"
		"    assert 0 < r['fastest_us_per_layer'] <= r['us_per_layer'], r\n"
		"    assert 0 < r['fastest_attention_over_budget_us'] <= r['attention_over_budget_us'], r\n"
		"    f = r['fastest_us_per_layer'] / ((1 + r['context_tokens'] / (32 * 512)) * r['fastest_attention_over_budget_us'])\n"
		"    assert abs(r['ratio_of_fastest_to_target_budget'] - f) < 1e-3 * f, r");
}

/* `kvrecall bench decode --spilled`: the spill tier on, streamed recall, and
 * the rows decoded (a step that failed would have stopped the bench). */
Test(bench, decode_spilled_writes_schema_json, .timeout = 300)
{
	bench_json_check("bench decode --quick --mode freekv --spilled 50",
			 "assert d['params']['spilled_pct'] == 50 and d['params']['recall'] == 'streamed', d['params']\n"
			 "rows = d['results']\n"
			 "assert rows and all(r['mode'] == 'freekv' and r['us_per_layer'] > 0 for r in rows), rows\n"
			 "assert all(r['recalled_kib_per_layer'] > 0 for r in rows), rows");
	char out[4096];
	int status;
	run("bench decode --spilled 100", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "--spilled '100': expected an integer from 0 to 99") != NULL, "%s", out);
}

/* `kvrecall bench freelist`: one row per unit count, host and device rounds
 * timed (the device rounds are checked for their result by the bench). */
Test(bench, freelist_writes_schema_json, .timeout = 120)
{
	bench_json_check("bench freelist --units 32,4096,9000 --reps 3",
			 "assert d['benchmark'] == 'freelist' and d['params']['pages_per_unit'] == 8\n"
			 "assert d['backend'] == 'cpu', d['backend']\n"
			 "rows = d['results']\n"
			 "assert [r['units'] for r in rows] == [32, 4096, 9000], rows\n"
			 "keys = ['alloc_round_us', 'free_round_us', 'ns_per_unit', 'device_alloc_round_us', 'device_free_round_us', 'device_ns_per_unit']\n"
			 "assert all(r[k] > 0 for r in rows for k in keys), rows");
}

/* The JSON names the cpu kernels' path that ran, KVR_CPU_ISA's where it
 * forces one, so that one machine's results per path tell themselves apart. */
Test(bench, json_names_the_forced_cpu_kernels, .timeout = 120)
{
	cr_assert_eq(setenv("KVR_CPU_ISA", "scalar", 1), 0);
	bench_json_check("bench freelist --units 32 --reps 1",
			 "assert d['machine']['cpu_kernels'] == 'scalar', d['machine']");
}

/* `kvrecall bench cache`: the shared cache of quantised pages holds the
 * sparse sequences' units only, and reopening the mix does not grow it. */
Test(bench, cache_writes_schema_json, .timeout = 120)
{
	bench_json_check("bench cache --quick",
			 "assert d['benchmark'] == 'cache' and d['params']['sequences'] == 4 and d['params']['long_sequences'] == 1\n"
			 "rows = {r['kv_format']: r for r in d['results']}\n"
			 "assert sorted(rows) == ['k4v2', 'k8v4', 'plain'], rows\n"
			 "assert not rows['plain']['shared_cache'] and rows['plain']['held_over_tiles'] == 1, rows\n"
			 "for f in ('k8v4', 'k4v2'):\n"
			 "    r = rows[f]\n"
			 "    assert r['shared_cache'] and r['units'] == r['units_used'] == r['units_after_reopen'] > 0, r\n"
			 "    assert r['device_bytes_held'] == r['units'] * r['unit_bytes'], r\n"
			 "    assert abs(r['held_over_tiles'] - 0.25) < 1e-3, r  # 1 sparse sequence of 4\n"
			 "assert rows['k4v2']['unit_bytes'] < rows['k8v4']['unit_bytes'], rows");
}

/* `kvrecall bench spill`: a row per (run size, queue depth) and one for the
 * pread fallback; the raw reads ran beside every io_uring row. */
Test(bench, spill_writes_schema_json, .timeout = 120)
{
	bench_json_check("bench spill --quick --run-kib 4,16 --queue-depths 1,8",
			 "assert d['benchmark'] == 'spill' and d['params']['runs_per_page'] == 8\n"
			 "rows = d['results']\n"
			 "assert [(r['run_kib'], r['queue_depth']) for r in rows] == [(4, 1), (4, 8), (4, 0), (16, 1), (16, 8), (16, 0)], rows\n"
			 "for r in rows:\n"
			 "    assert r['spill_gbs'] > 0 and r['recall_gbs'] > 0, r\n"
			 "    if r['queue_depth'] == 0:\n"
			 "        assert r['engine'] == 'pread' and r['raw_gbs'] == 0, r\n"
			 "    elif r['engine'] == 'io_uring':\n"
			 "        assert r['raw_gbs'] > 0, r\n"
			 "p = d['pool']['results']\n"
			 "assert [r['spilled_pct'] for r in p] == [0, 50, 90], p\n"
			 "assert p[0]['spilled_pages'] == 0 and p[0]['runs_read_through'] == 0, p\n"
			 "assert 0 < p[1]['spilled_pages'] < p[2]['spilled_pages'], p\n"
			 "assert all(r['runs_read_through'] > 0 and r['recall_us'] > 0 for r in p[1:]), p");
}

/* Run `kvrecall <args> --trace FILE` and check FILE is Chrome trace-event
 * JSON with complete ("X") events named `want`. */
static const char trace_events_check[] =
	"ev = d['traceEvents'] if isinstance(d, dict) else d\n"
	"x = [e for e in ev if e['ph'] == 'X']\n"
	"assert x and all(e['dur'] >= 0 and e['ts'] >= 0 for e in x), len(x)\n"
	"assert '%s' in {e['name'] for e in x}, sorted({e['name'] for e in x})";

static void trace_check(const char *args, const char *want)
{
	output_check(args, "--trace", trace_events_check, want);
}

/* --trace writes Chrome trace events: decode's engine and controller spans,
 * recall's copy and scatter chunks on their streams. */
Test(bench, traces_are_chrome_json, .timeout = 300)
{
	trace_check("bench decode --preset smollm2-135m --budget 512 --sink 128 --window 128 --steps 6 "
		    "--trace-context 4096",
		    "attention");
	trace_check("bench recall --backend cpu --quick --reps 1 --pool-mib 8 --json /dev/null", "scatter chunk");
}

/* `kvrecall selftest`: passes on this machine's cpu backend with one JSON
 * verdict naming every check; asking for a GPU that is absent fails the
 * verdict (exit 1) with the reason, rather than passing silently. */
Test(selftest, command_verdict, .timeout = 300)
{
	bench_json_check(
		"selftest --backend cpu",
		"assert d['benchmark'] == 'selftest' and d['verdict'] == 'pass', d['verdict']\n"
		"names = [c['check'] for c in d['checks'] if c['backend'] == 'cpu']\n"
		"assert names == ['copies', 'kernels', 'decode', 'recall'], names\n"
		"assert all(c['ok'] and c['detail'] for c in d['checks']), d['checks']");
	struct kvr_system_info s = { .size = sizeof(s) };
	kvr_system_query(&s);
	if (s.n_gpus == 0) {
		char out[16384];
		int status;
		run("selftest --backend cuda --json /dev/null", out, sizeof(out), &status);
		cr_expect_neq(status, 0, "%s", out);
		cr_expect(strstr(out, "FAIL") && strstr(out, s.gpu_reason), "%s", out);
	}
}

Test(bench, bad_arguments_are_refused_clearly)
{
	char out[8192];
	int status;
	run("bench copy --reps 0", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "--reps '0': expected an integer from 1 to 15") != NULL, "%s", out);
	run("bench copy --backend tpu", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "--backend 'tpu': expected one of auto, cpu, cuda") != NULL, "%s", out);
	run("bench copy --frobnicate", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "unknown option '--frobnicate'") != NULL, "%s", out);
	run("bench recall --miss-rate 0", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "--miss-rate '0': expected a number above 0 and at most 1") != NULL, "%s", out);
	run("bench recall --budget 1000", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "must be a multiple of p = 32") != NULL, "%s", out);
	run("bench recall --preset gpt-5", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "--preset 'gpt-5': expected one of llama-3.1-8b,") != NULL, "%s", out);
	run("bench recall --head-dim x", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "--head-dim 'x': expected an integer from 1 to 65536") != NULL, "%s", out);
	run("bench decode --budget 100", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "budget") != NULL, "%s", out);
	run("bench decode --backend tpu", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "--backend 'tpu': expected one of cpu, cuda") != NULL, "%s", out);
	run("bench decode --rounds 0", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "--rounds '0': expected an integer from 1 to 99") != NULL, "%s", out);
	run("bench decode --rounds 3x", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "--rounds '3x': expected an integer from 1 to 99") != NULL, "%s", out);
	run("bench freelist --reps 0", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "--reps '0': expected an integer from 1 to 63") != NULL, "%s", out);
	run("bench cache --short-context 4096", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "--short-context must be <= --budget") != NULL, "%s", out);
	run("bench spill --queue-depths 5000", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "--queue-depths '5000': expected comma-separated integers from 1 to 4096") != NULL,
		  "%s", out);
	run("bench spill --dir /nonexistent-kvrecall-dir --quick", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "/nonexistent-kvrecall-dir") != NULL, "%s", out);
	run("bench nosuch", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "unknown benchmark 'nosuch'") != NULL, "%s", out);
	struct kvr_system_info s = { .size = sizeof(s) };
	kvr_system_query(&s);
	if (s.n_gpus == 0) { /* asking for a GPU that is not there names the reason */
		run("bench copy --backend cuda --quick", out, sizeof(out), &status);
		cr_expect_neq(status, 0);
		cr_expect(strstr(out, "--backend cuda: ") != NULL, "%s", out);
	}
}

/* ------------------------------------------------------------------ the command line */

/* Runs `kvrecall <args>` with stdout and stderr kept apart (stderr through a
 * temporary file); returns its exit status, or -1 when it did not exit. */
static int run_apart(const char *args, char *out, size_t out_bytes, char *err, size_t err_bytes)
{
	char err_path[] = "/tmp/kvr_cli_err_XXXXXX";
	const int fd = mkstemp(err_path);
	cr_assert_geq(fd, 0);
	char cmd[2048];
	snprintf(cmd, sizeof(cmd), "'%s' %s 2>'%s'", KVR_EXE_PATH, args, err_path);
	FILE *f = popen(cmd, "r");
	cr_assert_not_null(f);
	const size_t n = fread(out, 1, out_bytes - 1, f);
	out[n] = '\0';
	const int status = pclose(f);
	const ssize_t e = read(fd, err, err_bytes - 1);
	err[e > 0 ? e : 0] = '\0';
	close(fd);
	unlink(err_path);
	return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* A refused command line: exit status 2, nothing on stdout, and exactly
 * `want` on stderr. */
static void expect_usage_error(const char *args, const char *want)
{
	char out[16384], err[4096];
	const int rc = run_apart(args, out, sizeof(out), err, sizeof(err));
	cr_expect_eq(rc, 2, "kvrecall %s: exit status %d, not 2\nstderr: %s", args, rc, err);
	cr_expect_str_empty(out, "kvrecall %s: wrote to stdout:\n%s", args, out);
	cr_expect_str_eq(err, want, "kvrecall %s:\nstderr:\n%s\nwanted:\n%s", args, err, want);
}

/* --help and -h on the command, every command and every benchmark print the
 * usage on stdout, nothing on stderr, and exit 0 — also after other options,
 * without running anything. */
Test(cli, help_goes_to_stdout_and_exits_0)
{
	static const struct {
		const char *args, *usage;
	} cases[] = {
		{ "--help", "usage: kvrecall <command>" },
		{ "-h", "usage: kvrecall <command>" },
		{ "help", "usage: kvrecall <command>" },
		{ "info --help", "usage: kvrecall info" },
		{ "info -h", "usage: kvrecall info" },
		{ "version --help", "usage: kvrecall version" },
		{ "generate --help", "usage: kvrecall generate" },
		{ "generate -h", "usage: kvrecall generate" },
		{ "generate --prompt hi --mode dense --help", "usage: kvrecall generate" },
		{ "eval --help", "usage: kvrecall eval" },
		{ "eval --context 4096 -h", "usage: kvrecall eval" },
		{ "bench --help", "usage: kvrecall bench <benchmark>" },
		{ "bench -h", "usage: kvrecall bench <benchmark>" },
		{ "bench copy --help", "usage: kvrecall bench copy" },
		{ "bench recall --help", "usage: kvrecall bench recall" },
		{ "bench decode --help", "usage: kvrecall bench decode" },
		{ "bench decode --quick -h", "usage: kvrecall bench decode" },
		{ "bench freelist --help", "usage: kvrecall bench freelist" },
		{ "bench cache --help", "usage: kvrecall bench cache" },
		{ "bench spill --help", "usage: kvrecall bench spill" },
		{ "selftest --help", "usage: kvrecall selftest" },
		{ "help generate", "usage: kvrecall generate" },
		{ "help bench", "usage: kvrecall bench <benchmark>" },
	};
	char out[16384], err[4096];
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		const int rc = run_apart(cases[c].args, out, sizeof(out), err, sizeof(err));
		cr_expect_eq(rc, 0, "kvrecall %s: exit status %d\nstderr: %s", cases[c].args, rc, err);
		cr_expect(!strncmp(out, cases[c].usage, strlen(cases[c].usage)), "kvrecall %s: stdout is not '%s...':\n%s",
			  cases[c].args, cases[c].usage, out);
		cr_expect_str_empty(err, "kvrecall %s: wrote to stderr:\n%s", cases[c].args, err);
	}
	/* the command's usage says what the exit statuses mean */
	run_apart("--help", out, sizeof(out), err, sizeof(err));
	cr_expect(strstr(out, "Exit status: 0 success; 1 a failure while running") &&
			  strstr(out, "2 a wrong command line"),
		  "%s", out);
	/* without a command: the usage, on stderr, as a wrong command line */
	cr_expect_eq(run_apart("", out, sizeof(out), err, sizeof(err)), 2);
	cr_expect_str_empty(out);
	cr_expect(!strncmp(err, "usage: kvrecall <command>", 25), "%s", err);
}

/* --version, -V and `version`: one line on stdout naming the program, the
 * library version, the git revision and the build type; exit 0. */
Test(cli, version_is_one_line_on_stdout)
{
	static const char *const spellings[] = { "--version", "-V", "version" };
	char out[4096], err[4096], want[256];
	snprintf(want, sizeof(want), "kvrecall %s (git ", kvr_version_string());
	for (size_t s = 0; s < sizeof(spellings) / sizeof(spellings[0]); s++) {
		const int rc = run_apart(spellings[s], out, sizeof(out), err, sizeof(err));
		cr_expect_eq(rc, 0, "%s: exit status %d: %s", spellings[s], rc, err);
		cr_expect_str_empty(err, "%s: %s", spellings[s], err);
		cr_expect(!strncmp(out, want, strlen(want)), "%s: '%s' is not '%s...'", spellings[s], out, want);
		const char *revision = out + strlen(want), *comma = strchr(revision, ',');
		cr_expect(comma && comma > revision, "%s: no git revision in '%s'", spellings[s], out);
		char tail[128];
		snprintf(tail, sizeof(tail), ", %s build)\n", KVR_TEST_BUILD_TYPE);
		cr_expect(comma && !strcmp(comma, tail), "%s: '%s' does not end with '%s'", spellings[s], out, tail);
	}
	cr_expect_eq(run_apart("version --bogus", out, sizeof(out), err, sizeof(err)), 2);
}

/* Every error names the command it comes from (eval's are eval's, not the
 * generate it shares options with); the command line's errors exit 2, a
 * failure while running exits 1. */
Test(cli, errors_name_their_command_and_exit_status_says_which_kind)
{
	static const struct {
		const char *args, *prefix;
		int status;
	} cases[] = {
		{ "eval", "kvrecall eval: --file is required\n", 2 },
		{ "eval --budget 12x --file /dev/null", "kvrecall eval: --budget '12x'", 2 },
		{ "eval --model /nonexistent-kvrecall.gguf --file /dev/null", "kvrecall eval: ", 1 },
		{ "generate", "kvrecall generate: give --prompt, --chat or --file\n", 2 },
		{ "generate --model /nonexistent-kvrecall.gguf --prompt hi", "kvrecall generate: ", 1 },
		{ "info --spill-dir", "kvrecall info: ", 2 },
		{ "version extra", "kvrecall version: ", 2 },
		{ "selftest --json", "kvrecall selftest: ", 2 },
		{ "bench", "usage: kvrecall bench <benchmark>", 2 },
		{ "bench nosuch", "kvrecall bench: ", 2 },
		{ "bench copy --reps 0", "kvrecall bench copy: ", 2 },
		{ "bench recall --batch 0", "kvrecall bench recall: ", 2 },
		{ "bench recall --budget 1000", "kvrecall bench recall: --budget 1000 must be", 2 },
		{ "bench decode --steps x", "kvrecall bench decode: ", 2 },
		{ "bench freelist --units x", "kvrecall bench freelist: ", 2 },
		{ "bench cache --preset x", "kvrecall bench cache: ", 2 },
		{ "bench spill --batch 0", "kvrecall bench spill: ", 2 },
		{ "bench spill --dir /nonexistent-kvrecall-dir --quick", "kvrecall bench spill: ", 1 },
		{ "frobnicate", "kvrecall: unknown command 'frobnicate'\n", 2 },
	};
	char out[16384], err[4096];
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		const int rc = run_apart(cases[c].args, out, sizeof(out), err, sizeof(err));
		cr_expect_eq(rc, cases[c].status, "kvrecall %s: exit status %d, not %d\nstderr: %s", cases[c].args, rc,
			     cases[c].status, err);
		cr_expect(!strncmp(err, cases[c].prefix, strlen(cases[c].prefix)),
			  "kvrecall %s: stderr does not start with '%s':\n%s", cases[c].args, cases[c].prefix, err);
		cr_expect(!strstr(cases[c].args, "eval") || !strstr(err, "generate"), "kvrecall %s:\n%s", cases[c].args,
			  err);
		cr_expect(rc != 2 || !out[0], "kvrecall %s: a refused command line wrote to stdout:\n%s", cases[c].args,
			  out);
	}
}

/* A name outside an option's set is refused with the set listed. */
Test(cli, enum_errors_list_the_valid_values)
{
	static const struct {
		const char *args, *err;
	} cases[] = {
		{ "generate --prompt hi --mode fast",
		  "kvrecall generate: --mode 'fast': expected one of dense, blocking, speculative, freekv\n" },
		{ "generate --prompt hi --mode auto",
		  "kvrecall generate: --mode 'auto': expected one of dense, blocking, speculative, freekv\n" },
		{ "generate --prompt hi --kv-format q8",
		  "kvrecall generate: --kv-format 'q8': expected one of f16, k8v4, k4v2, mixed\n" },
		{ "generate --prompt hi --recall sometimes",
		  "kvrecall generate: --recall 'sometimes': expected one of auto, zero-copy, streamed\n" },
		{ "generate --prompt hi --think maybe", "kvrecall generate: --think 'maybe': expected one of off, on\n" },
		{ "generate --prompt hi --estimate yes", "kvrecall generate: --estimate 'yes': expected one of off, on\n" },
		{ "generate --prompt hi --compare dense,fast",
		  "kvrecall generate: --compare 'dense,fast': expected a comma-separated list of dense, blocking, "
		  "speculative, freekv (not 'fast')\n" },
		{ "eval --file /dev/null --modes freekv,fast",
		  "kvrecall eval: --modes 'freekv,fast': expected a comma-separated list of dense, blocking, "
		  "speculative, freekv (not 'fast')\n" },
		{ "eval --file /dev/null --kv-formats k8v4,q4",
		  "kvrecall eval: --kv-formats 'k8v4,q4': expected a comma-separated list of f16, k8v4, k4v2, mixed "
		  "(not 'q4')\n" },
		{ "eval --file /dev/null --estimate sometimes",
		  "kvrecall eval: --estimate 'sometimes': expected one of off, on, both\n" },
		{ "eval --file /dev/null --recall x", "kvrecall eval: --recall 'x': expected one of auto, zero-copy, streamed\n" },
		{ "bench decode --mode fast",
		  "kvrecall bench decode: --mode 'fast': expected one of dense, blocking, speculative, freekv\n" },
		{ "bench decode --trace-mode fast",
		  "kvrecall bench decode: --trace-mode 'fast': expected one of auto, dense, blocking, speculative, freekv\n" },
		{ "bench decode --recall x", "kvrecall bench decode: --recall 'x': expected one of auto, zero-copy, streamed\n" },
		{ "bench decode --controller x", "kvrecall bench decode: --controller 'x': expected one of auto, thread, inline\n" },
		{ "bench decode --pool-layout x", "kvrecall bench decode: --pool-layout 'x': expected one of hnd, nhd\n" },
		{ "bench decode --estimate x", "kvrecall bench decode: --estimate 'x': expected one of off, on, both\n" },
		{ "bench decode --backend tpu", "kvrecall bench decode: --backend 'tpu': expected one of cpu, cuda\n" },
		{ "bench decode --kv-format f16,q8",
		  "kvrecall bench decode: --kv-format 'f16,q8': expected a comma-separated list of f16, k8v4, k4v2, mixed "
		  "(not 'q8')\n" },
		{ "bench copy --backend tpu", "kvrecall bench copy: --backend 'tpu': expected one of auto, cpu, cuda\n" },
		{ "bench recall --backend tpu", "kvrecall bench recall: --backend 'tpu': expected one of auto, cpu, cuda\n" },
		{ "bench freelist --backend tpu", "kvrecall bench freelist: --backend 'tpu': expected one of auto, cpu, cuda\n" },
		{ "bench recall --preset gpt-5",
		  "kvrecall bench recall: --preset 'gpt-5': expected one of llama-3.1-8b, qwen-2.5-7b, smollm2-135m\n" },
		{ "selftest --backend tpu", "kvrecall selftest: --backend 'tpu': expected one of cpu, cuda\n" },
	};
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++)
		expect_usage_error(cases[c].args, cases[c].err);
}

/* Numbers are parsed whole: trailing junk, empty strings, signs where none
 * belongs, hexadecimal, nan, overflow and values out of range are refused,
 * naming the option and its range; lists check each element. */
Test(cli, numbers_are_parsed_whole_and_in_range)
{
	static const struct {
		const char *args, *err;
	} cases[] = {
		{ "generate --prompt hi --tau abc", "kvrecall generate: --tau 'abc': expected a number from -1 to 1\n" },
		{ "generate --prompt hi --tau 0.5x", "kvrecall generate: --tau '0.5x': expected a number from -1 to 1\n" },
		{ "generate --prompt hi --tau 1.5", "kvrecall generate: --tau '1.5': expected a number from -1 to 1\n" },
		{ "generate --prompt hi --tau nan", "kvrecall generate: --tau 'nan': expected a number from -1 to 1\n" },
		{ "generate --prompt hi --max-tokens 12x",
		  "kvrecall generate: --max-tokens '12x': expected an integer from 1 to 4294967295\n" },
		{ "generate --prompt hi --max-tokens ''",
		  "kvrecall generate: --max-tokens '': expected an integer from 1 to 4294967295\n" },
		{ "generate --prompt hi --max-tokens 0",
		  "kvrecall generate: --max-tokens '0': expected an integer from 1 to 4294967295\n" },
		{ "generate --prompt hi --budget 4294967296",
		  "kvrecall generate: --budget '4294967296': expected an integer from 1 to 4294967295\n" },
		{ "generate --prompt hi --seed 18446744073709551616",
		  "kvrecall generate: --seed '18446744073709551616': expected an integer from 0 to 18446744073709551615\n" },
		{ "generate --prompt hi --threads -1", "kvrecall generate: --threads '-1': expected an integer from 0 to 1024\n" },
		{ "generate --prompt hi --threads ' 2'", "kvrecall generate: --threads ' 2': expected an integer from 0 to 1024\n" },
		{ "generate --prompt hi --top-p 0",
		  "kvrecall generate: --top-p '0': expected a number above 0 and at most 1\n" },
		{ "generate --prompt hi --top-k 5x",
		  "kvrecall generate: --top-k '5x': expected an integer from 0 to 4294967295\n" },
		{ "generate --prompt hi --temperature -0.5",
		  "kvrecall generate: --temperature '-0.5': expected a number of at least 0\n" },
		{ "generate --prompt hi --temperature 1e39",
		  "kvrecall generate: --temperature '1e39': expected a number of at least 0\n" },
		{ "generate --prompt hi --top-p 1e-320",
		  "kvrecall generate: --top-p '1e-320': expected a number above 0 and at most 1\n" },
		{ "generate --prompt hi --sink 4294967295",
		  "kvrecall generate: --sink '4294967295': expected an integer from 0 to 4294967294\n" },
		{ "generate --prompt hi --temperature 0x10",
		  "kvrecall generate: --temperature '0x10': expected a number of at least 0\n" },
		{ "eval --file /dev/null --context 8k", "kvrecall eval: --context '8k': expected an integer from 2 to 4294967295\n" },
		{ "eval --file /dev/null --prefill ''", "kvrecall eval: --prefill '': expected an integer from 1 to 4294967294\n" },
		{ "eval --file /dev/null --sink 1e3", "kvrecall eval: --sink '1e3': expected an integer from 0 to 4294967294\n" },
		{ "bench decode --budget 12x", "kvrecall bench decode: --budget '12x': expected an integer from 1 to 4294967295\n" },
		{ "bench decode --steps 2", "kvrecall bench decode: --steps '2': expected an integer from 3 to 100000\n" },
		{ "bench decode --max-context 8192,16384",
		  "kvrecall bench decode: --max-context '8192,16384': expected an integer from 8192 to 1073741824\n" },
		{ "bench decode --batch 1,,4",
		  "kvrecall bench decode: --batch '1,,4': expected comma-separated integers from 1 to 4096 (not '')\n" },
		{ "bench decode --batch 1,2,3,4,5,6,7,8,9",
		  "kvrecall bench decode: --batch '1,2,3,4,5,6,7,8,9': expected at most 8 values\n" },
		{ "bench decode --buffers 3", "kvrecall bench decode: --buffers '3': expected an integer from 1 to 2\n" },
		{ "bench recall --budget 1024,2048x",
		  "kvrecall bench recall: --budget '1024,2048x': expected comma-separated integers from 1 to 4294967295 "
		  "(not '2048x')\n" },
		{ "bench recall --kv-heads 65537", "kvrecall bench recall: --kv-heads '65537': expected an integer from 1 to 65536\n" },
		{ "bench cache --long-share 1.01",
		  "kvrecall bench cache: --long-share '1.01': expected a number from 0 to 1\n" },
		{ "bench spill --run-kib 4,99999999999999999999",
		  "kvrecall bench spill: --run-kib '4,99999999999999999999': expected comma-separated integers from 1 to "
		  "1024 (not '99999999999999999999')\n" },
		{ "bench spill --spilled 50,100",
		  "kvrecall bench spill: --spilled '50,100': expected comma-separated integers from 0 to 99 (not '100')\n" },
		{ "bench freelist --units 0",
		  "kvrecall bench freelist: --units '0': expected comma-separated integers from 1 to 4194304 (not '0')\n" },
		{ "bench copy --reps 16", "kvrecall bench copy: --reps '16': expected an integer from 1 to 15\n" },
	};
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++)
		expect_usage_error(cases[c].args, cases[c].err);
	/* the ends of each range are accepted (--help after them: nothing runs) */
	static const char *const edges[] = {
		"generate --prompt hi --tau -1 --temperature 0 --top-p 1 --top-k 0 --seed 18446744073709551615 --threads 0 "
		"--max-tokens 4294967295 --budget 4294967295 --sink 0 --help",
		"eval --file /dev/null --context 2 --prefill 1 --tau 1 --threads 1024 --help",
		"bench decode --steps 3 --batch 1,2,3,4,5,6,7,8 --max-context 1073741824 --buffers 1 --help",
		"bench recall --miss-rate 1 --batch 256 --reps 31 --kv-heads 65536 --help",
		"bench spill --spilled 0,99 --run-kib 1,1024 --help",
		"bench copy --reps 15 --help",
	};
	char out[16384], err[4096];
	for (size_t e = 0; e < sizeof(edges) / sizeof(edges[0]); e++)
		cr_expect_eq(run_apart(edges[e], out, sizeof(out), err, sizeof(err)), 0, "kvrecall %s:\n%s", edges[e], err);
}

/* An unknown option or a missing value is named in one line that points to
 * the command's --help, without the whole usage. */
Test(cli, unknown_options_are_named_with_a_pointer_to_help)
{
	static const char *const commands[] = {
		"info", "version", "generate", "eval", "selftest", "bench copy", "bench recall", "bench decode",
		"bench freelist", "bench cache", "bench spill",
	};
	char args[256], want[512];
	for (size_t c = 0; c < sizeof(commands) / sizeof(commands[0]); c++) {
		snprintf(args, sizeof(args), "%s --foo", commands[c]);
		snprintf(want, sizeof(want), "kvrecall %s: unknown option '--foo'\nTry 'kvrecall %s --help'.\n", commands[c],
			 commands[c]);
		expect_usage_error(args, want);
	}
	expect_usage_error("bench decode --budget", "kvrecall bench decode: option '--budget' needs a value\n"
						  "Try 'kvrecall bench decode --help'.\n");
	expect_usage_error("generate --prompt", "kvrecall generate: option '--prompt' needs a value\n"
					       "Try 'kvrecall generate --help'.\n");
	expect_usage_error("eval --file", "kvrecall eval: option '--file' needs a value\nTry 'kvrecall eval --help'.\n");
	expect_usage_error("bench nosuch", "kvrecall bench: unknown benchmark 'nosuch' (copy, recall, decode, freelist, "
					   "cache, spill)\nTry 'kvrecall bench --help'.\n");
	expect_usage_error("--frobnicate", "kvrecall: unknown option '--frobnicate'\nTry 'kvrecall --help'.\n");
}
