/* SPDX-License-Identifier: MIT */
/*
 * test_selftest.c — `kvrecall selftest`'s checks (bench/cli/selftest.c) pass on
 * the cpu backend and on cudaemu and cudaemu-strict, where the CUDA kernel
 * bodies run on the CPU (the strict one holding them to a GPU's memory
 * rules: every item and buffer the checks hand a kernel must be device
 * memory). The command itself is tested in test_info.c.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "backend.h"
#include "cudaemu.h"
#include "../bench/cli/selftest.h"

static void expect_all_ok(const struct selftest_report *r, const char *backend, uint32_t want_checks)
{
	uint32_t n = 0;
	for (uint32_t i = 0; i < r->n_checks; i++) {
		if (strcmp(r->checks[i].backend, backend))
			continue;
		n++;
		cr_expect(r->checks[i].ok, "%s %s: %s", backend, r->checks[i].name, r->checks[i].detail);
	}
	cr_expect_eq(n, want_checks, "%s ran %u checks, not %u", backend, n, want_checks);
}

Test(selftest, passes_on_cpu, .timeout = 120)
{
	static struct selftest_report r;
	cr_assert_eq(selftest_backend(KVR_DEV_CPU, "cpu", &r), 0);
	expect_all_ok(&r, "cpu", 3); /* copies, kernels, decode */
	cr_expect_eq(r.failed, 0);
}

Test(selftest, passes_on_cudaemu, .timeout = 300)
{
	static struct selftest_report r;
	cr_assert_eq(selftest_backend(KVR_DEV_CUDAEMU, "cudaemu", &r), 0);
	cr_assert_eq(selftest_backend(KVR_DEV_CUDAEMU_STRICT, "cudaemu-strict", &r), 0);
	expect_all_ok(&r, "cudaemu", 2); /* copies, kernels: decode is for public backends */
	expect_all_ok(&r, "cudaemu-strict", 2);
	cr_expect_eq(kvr_cudaemu_failed_launches(), 0, "a cudaemu kernel launch failed");
	char why[256];
	kvr_cudaemu_strict_last_violation(why, sizeof(why));
	cr_expect_eq(kvr_cudaemu_strict_violations(), 0, "cudaemu-strict: %s", why);
}
