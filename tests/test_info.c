/* SPDX-License-Identifier: MIT */
/*
 * test_info.c — kvr_system_query and `kvrecall info` tell the truth: build
 * features match how this build was configured, the GPU line gives the exact
 * reason when there is none, and CPU/topology facts match the OS's.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
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
	cr_expect(strstr(out, s.cpu_avx512 ? "AVX-512 yes" : "AVX-512 no") != NULL, "%s", out);
}

Test(info, command_json_and_errors)
{
	char out[8192];
	int status;
	run("info --json", out, sizeof(out), &status);
	cr_expect_eq(status, 0, "%s", out);
	cr_expect(out[0] == '{' && strstr(out, "\"cuda_compiled\": ") && strstr(out, "\"numa_nodes\": ") &&
			  strstr(out, "\"gpu_reason\": "),
		  "%s", out);
	run("info --bogus", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "unknown option") != NULL, "%s", out);
	run("frobnicate", out, sizeof(out), &status);
	cr_expect_neq(status, 0);
	cr_expect(strstr(out, "unknown command") != NULL, "%s", out);
}
