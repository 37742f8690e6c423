/* SPDX-License-Identifier: MIT */
/*
 * helpers.h — what the suites share: the pseudo-random generators behind
 * their seeded inputs, and small float helpers. Each generator is one
 * function of an explicit state, so a suite keeps its own seed (and thus the
 * exact inputs its recorded results came from) while the arithmetic lives
 * here once.
 *
 * Header-only (static inline): suites are separate programs. Threads: any;
 * a state belongs to its caller.
 */
#ifndef KVR_TESTS_HELPERS_H
#define KVR_TESTS_HELPERS_H

#include <stdint.h>
#include <string.h>

/* Marsaglia's xorshift64 (13, 7, 17). */
static inline uint64_t th_xorshift64(uint64_t *state)
{
	uint64_t x = *state;
	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return *state = x;
}

/* xorshift64* (12, 25, 27 and Vigna's multiplier): better low bits. */
static inline uint64_t th_xorshift64star(uint64_t *state)
{
	uint64_t x = *state;
	x ^= x >> 12;
	x ^= x << 25;
	x ^= x >> 27;
	*state = x;
	return x * 2685821657736338717ull;
}

/* splitmix64: any seed, including 0, gives a full-period sequence. */
static inline uint64_t th_splitmix64(uint64_t *state)
{
	uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Knuth's MMIX linear congruential step (the state itself is the output). */
static inline uint64_t th_lcg64(uint64_t *state)
{
	return *state = *state * 6364136223846793005ull + 1442695040888963407ull;
}

/* A float in [lo, hi) from the top 24 bits of `bits`. */
static inline float th_uniform(uint64_t bits, float lo, float hi)
{
	return lo + (hi - lo) * (float)(bits >> 40) * 0x1p-24f;
}

/* Bit-for-bit equality of two floats (NaNs with the same payload equal). */
static inline int th_same_bits(float a, float b)
{
	return !memcmp(&a, &b, sizeof(a));
}

#endif
