/* SPDX-License-Identifier: MIT */
/*
 * unicode.h — the little Unicode the tokenizer needs: UTF-8 decoding that
 * never fails (a byte that does not start a valid sequence is a unit of its
 * own), the pre-tokenizer's code point classes (\p{L}, \p{N}, \s, other) and
 * how much of a byte string's tail is an unfinished UTF-8 sequence (for
 * streaming output). The class table is generated (gen_unicode.py,
 * unicode_table.h). Pure functions over constant data: any thread.
 */
#ifndef KVR_MODEL_UNICODE_H
#define KVR_MODEL_UNICODE_H

#include <stddef.h>
#include <stdint.h>

/* The classes the GPT-2 pre-tokenizer regex distinguishes. */
enum uni_class {
	UNI_OTHER = 0,  /* [^\s\p{L}\p{N}], also every invalid byte */
	UNI_LETTER = 1, /* \p{L}: general category L* */
	UNI_NUMBER = 2, /* \p{N}: general category N* */
	UNI_SPACE = 3,  /* \s: the White_Space property */
};

/* What uni_utf8_decode stores for a byte that starts no valid sequence. It is
 * above U+10FFFF, so no table holds it, and its class is UNI_OTHER: the class
 * llama.cpp gives the U+FFFD it substitutes for such a byte. */
#define UNI_INVALID 0xFFFFFFFFu

/* The Unicode version the class table was generated from ("15.1.0"). */
const char *uni_version(void);

/* Class of a code point (UNI_OTHER for UNI_INVALID and anything unassigned). */
enum uni_class uni_class_of(uint32_t cp);

/* Decode the UTF-8 sequence starting at s (n >= 1 bytes available). Returns its
 * length, 1 to 4, and stores the code point in *cp. Overlong forms, surrogates,
 * code points above U+10FFFF, stray continuation bytes and sequences cut short
 * by n or by a non-continuation byte are invalid: then 1 is returned and *cp is
 * UNI_INVALID, so the caller moves on by one byte and every byte string
 * decodes to units that cover it exactly. */
size_t uni_utf8_decode(const unsigned char *s, size_t n, uint32_t *cp);

/* How many of the last bytes of s[0..n) (0 to 3) are the start of a valid
 * UTF-8 sequence that more bytes could still complete. A streaming writer
 * holds those back until the next piece arrives. */
size_t uni_utf8_incomplete_tail(const unsigned char *s, size_t n);

#endif /* KVR_MODEL_UNICODE_H */
