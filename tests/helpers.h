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

/* splitmix64's output function of x: a stateless hash of a counter. */
static inline uint64_t th_mix64(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

/* splitmix64: any seed, including 0, gives a full-period sequence. */
static inline uint64_t th_splitmix64(uint64_t *state)
{
	const uint64_t z = th_mix64(*state);
	*state += 0x9e3779b97f4a7c15ull;
	return z;
}

/* A value in [-1, 1] on a grid of 1/256, a pure function of its arguments
 * (exact in every dtype, so expected outputs can be recomputed anywhere). */
static inline float th_grid_value(uint64_t a, uint64_t b, uint64_t c)
{
	const uint64_t x = th_mix64(a ^ th_mix64(b * 0x100000001b3ull ^ th_mix64(c)));
	return (float)((int64_t)(x % 513) - 256) / 256.0f;
}

/* Knuth's MMIX linear congruential step (the state itself is the output). */
static inline uint64_t th_lcg64(uint64_t *state)
{
	return *state = *state * 6364136223846793005ull + 1442695040888963407ull;
}

/* A value in [-1, 1) on a grid of 1/1000 from th_lcg64's high bits: the
 * inputs of the decode suites. */
static inline float th_lcg_milli(uint64_t *state)
{
	return (float)((int32_t)(th_lcg64(state) >> 33) % 2000 - 1000) / 1000.0f;
}

/* A float in [lo, hi) from the top 24 bits of `bits`. */
static inline float th_uniform(uint64_t bits, float lo, float hi)
{
	return lo + (hi - lo) * (float)(bits >> 40) * 0x1p-24f;
}

/* The bits of a float, and the float of given bits. */
static inline uint32_t th_f32_bits(float f)
{
	uint32_t u;
	memcpy(&u, &f, sizeof(u));
	return u;
}

static inline float th_bits_f32(uint32_t u)
{
	float f;
	memcpy(&f, &u, sizeof(f));
	return f;
}

/* Bit-for-bit equality of two floats (NaNs with the same payload equal). */
static inline int th_same_bits(float a, float b)
{
	return !memcmp(&a, &b, sizeof(a));
}

/* The small shape the decode suites share (pages of 16 tokens, 2 KV heads,
 * 4 query heads, d 32): a suite defines TH_SMALL_SHAPE before including
 * this header. */
#ifdef TH_SMALL_SHAPE
#define P 16
#define N_KV 2
#define N_QO 4
#define D 32
#define KV_ROW (N_KV * D)
#define Q_ROW (N_QO * D)
#endif

#ifdef KVRECALL_H
/* kvr_config_init's defaults with the given shape and selection sizes: the
 * block every decode suite starts its config with (include kvrecall.h
 * first). */
static inline void th_config(struct kvr_config *c, uint32_t n_layers, uint32_t n_qo_heads,
			     uint32_t n_kv_heads, uint32_t head_dim, uint32_t dtype, uint32_t page_tokens,
			     uint32_t sink_tokens, uint32_t window_tokens, uint32_t budget_tokens)
{
	kvr_config_init(c);
	c->n_layers = n_layers;
	c->n_qo_heads = n_qo_heads;
	c->n_kv_heads = n_kv_heads;
	c->head_dim = head_dim;
	c->dtype = dtype;
	c->page_tokens = page_tokens;
	c->sink_tokens = sink_tokens;
	c->window_tokens = window_tokens;
	c->budget_tokens = budget_tokens;
}

/* Every layer sparse, n_seqs sequences that may all decode in one batch, one
 * cpu thread: the run most decode tests ask for. */
static inline void th_config_sparse(struct kvr_config *c, uint32_t n_seqs)
{
	c->dense_layers[0] = 0;
	c->max_sequences = c->max_batch = n_seqs;
	c->threads = 1;
}
#endif

#ifdef CRITERION_H_
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <unistd.h>

/* The running test's spill directory, for the suite's .fini (th_test_dir_fini)
 * to remove when a failed assertion ends the test early: the spill files in
 * it are unlinked by then, so it is empty. */
static char th_test_dir[PATH_MAX] __attribute__((unused));

static inline void th_test_dir_fini(void)
{
	if (th_test_dir[0])
		rmdir(th_test_dir);
	th_test_dir[0] = '\0';
}

/* A fresh directory <parent>/<prefix>XXXXXX (under /tmp when parent refuses). */
static inline void th_dir_make(char *path, size_t bytes, const char *parent, const char *prefix)
{
	snprintf(path, bytes, "%s/%sXXXXXX", parent, prefix);
	if (!mkdtemp(path)) {
		snprintf(path, bytes, "/tmp/%sXXXXXX", prefix);
		cr_assert_not_null(mkdtemp(path), "mkdtemp %s: %s", path, strerror(errno));
	}
	snprintf(th_test_dir, sizeof(th_test_dir), "%s", path);
}

/* rmdir fails (ENOTEMPTY) when a spill file was left behind. */
static inline void th_dir_remove(const char *path)
{
	cr_assert_eq(rmdir(path), 0, "rmdir %s: %s (a spill file left behind?)", path,
		     strerror(errno));
	th_test_dir[0] = '\0';
}
#endif

#endif
