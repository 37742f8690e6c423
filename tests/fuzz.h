/* SPDX-License-Identifier: MIT */
/*
 * fuzz.h — what a fuzz harness (tests/fuzz_gguf.c, tests/fuzz_tokenizer.c)
 * gives the two programs that drive it: libFuzzer (tests/fuzz_libfuzzer.c,
 * clang only, coverage-guided) and the seeded mutation driver
 * (tests/fuzz_driver.c, any compiler, run by `meson test`).
 *
 * A harness runs one input through the reader of untrusted bytes it covers,
 * checks what the headers promise about the result, and calls fuzz_fail on
 * the first broken promise. Crashes, sanitizer reports, hangs and huge
 * allocations are caught by the driver, not the harness. Harness state
 * (a vocabulary built once, say) must not change what an input does, so a
 * failure replays from the input alone.
 */
#ifndef KVR_TESTS_FUZZ_H
#define KVR_TESTS_FUZZ_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* A fixed-width integer in an input that the driver sets to boundary values
 * (0, 1, all ones, the input's size, 2^32...): GGUF's counts and lengths. */
struct fuzz_field {
	size_t at;
	uint8_t width; /* 1, 2, 4 or 8 bytes, little-endian */
};

struct fuzz_target {
	const char *name;
	/* Run one input. Returns 1 when it went deep (a GGUF that opened), which
	 * makes the mutation driver keep it as a base for further mutants. */
	int (*one)(const uint8_t *data, size_t size);
	/* Hand each seed input to add(); the seeds are built in code. */
	void (*seeds)(void (*add)(void *ctx, const uint8_t *p, size_t n), void *ctx);
	/* Where the integer fields of an input are (at most max); may be NULL. */
	size_t (*fields)(const uint8_t *p, size_t n, struct fuzz_field *out, size_t max);
	/* Byte strings worth inserting (key names, special tokens), NULL-ended. */
	const char *const *dict;
};

extern const struct fuzz_target fuzz_target;

/* Report a broken promise (msg) for the input being run and end the process:
 * the mutation driver keeps the input in a file, libFuzzer saves it as a
 * crash. Each driver has its own. */
_Noreturn void fuzz_fail(const char *msg);

static inline _Noreturn __attribute__((format(printf, 4, 5))) void
fuzz_check_failed(const char *file, int line, const char *cond, const char *fmt, ...)
{
	char msg[1024];
	int n = snprintf(msg, sizeof(msg), "%s:%d: (%s) ", file, line, cond);
	if (n < 0 || (size_t)n >= sizeof(msg))
		n = 0;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg + n, sizeof(msg) - (size_t)n, fmt, ap);
	va_end(ap);
	fuzz_fail(msg);
}

/* FUZZ_CHECK(cond, fmt, ...): fmt says what was being checked, with values. */
#define FUZZ_CHECK(cond, ...)                                                            \
	do {                                                                             \
		if (!(cond))                                                             \
			fuzz_check_failed(__FILE__, __LINE__, #cond, __VA_ARGS__);       \
	} while (0)

/* GPT-2's byte-level character for byte c, as UTF-8 in out; returns its
 * length. Written from the scheme's rule (printable Latin-1 bytes map to
 * themselves, the others to U+0100 on, in byte order), not from the
 * tokenizer under test. */
static inline size_t fuzz_byte_char(unsigned c, char *out)
{
	unsigned next = 0x100, cp = 0;
	for (unsigned b = 0; b <= c; b++) {
		const int printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
		cp = printable ? b : next++;
	}
	if (cp < 0x80) {
		out[0] = (char)cp;
		return 1;
	}
	out[0] = (char)(0xc0 | cp >> 6);
	out[1] = (char)(0x80 | (cp & 0x3f));
	return 2;
}

#endif /* KVR_TESTS_FUZZ_H */
