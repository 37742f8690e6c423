/* SPDX-License-Identifier: MIT */
/*
 * selftest.h — `kvrecall selftest` (selftest.c): the checks it runs and the
 * report they fill. selftest_backend is also run by tests/test_selftest.c on
 * the test-only backends (cudaemu). Main thread.
 */
#ifndef KVR_BENCH_SELFTEST_H
#define KVR_BENCH_SELFTEST_H

#include <stdint.h>

#define SELFTEST_MAX_CHECKS 32

struct selftest_check {
	char backend[16];
	char name[32];
	int ok;
	double seconds;
	char detail[512];
};

struct selftest_report {
	struct selftest_check checks[SELFTEST_MAX_CHECKS];
	uint32_t n_checks, failed;
};

/* Copies, kernels against the reference and (cpu, cuda) the public decode in
 * every mode, on device kind `dev_kind` (enum kvr_dev_kind); each check is
 * appended to *r. 0, or a negative errno when the device cannot be opened
 * (recorded as a failed "open" check). */
int selftest_backend(uint32_t dev_kind, const char *backend_name, struct selftest_report *r);

/* The command: every backend present, recall through `self bench recall`, and
 * compute-sanitizer on a GPU. `self` is the path of the kvrecall executable. */
int selftest_main(int argc, char **argv, const char *self);

#endif /* KVR_BENCH_SELFTEST_H */
