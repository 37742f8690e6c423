/* SPDX-License-Identifier: MIT */
/*
 * fuzz_libfuzzer.c — libFuzzer's entry point for a fuzz harness (fuzz.h),
 * linked with one of fuzz_gguf.c or fuzz_tokenizer.c into
 * fuzz_<name>_libfuzzer by clang (-Dfuzz, tests/meson.build).
 * libFuzzer owns the loop, the coverage feedback, the corpus and the crash
 * files; a broken check ends the run through abort(), which libFuzzer
 * reports as a crash and saves the input for. Seeds and a dictionary come
 * from the mutation driver (--write-seeds, --write-dict).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "fuzz.h"

_Noreturn void fuzz_fail(const char *msg)
{
	fprintf(stderr, "fuzz %s: check failed: %s\n", fuzz_target.name, msg);
	abort();
}

#ifdef KVR_FUZZ_LINK_CHECK
/* meson's check that clang links a libFuzzer program here (tests/meson.build) */
static int nothing(const uint8_t *data, size_t size)
{
	(void)data;
	(void)size;
	return 0;
}
const struct fuzz_target fuzz_target = { "check", nothing, NULL, NULL, NULL };
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	fuzz_target.one(data, size);
	return 0;
}
