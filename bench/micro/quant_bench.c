/* SPDX-License-Identifier: MIT */
/*
 * quant_bench.c — single-thread GB/s (weight bytes per second) of the real-
 * model runner's quantised matrix-vector products (bench/model/quant.h) on
 * SmolLM2's and Qwen3-0.6B's matrix shapes, on every instruction-set path
 * the CPU has.
 * (It used to be a skipped test in tests/test_quant.c; a benchmark asserts
 * nothing, so it lives here. tests/test_quant.c checks that every path gives
 * the same bits.)
 *
 *   quant_bench [--rounds 8] [--json FILE]
 *
 * Rounds go over paths and shapes interleaved, so a busy neighbour hits them
 * alike; each timing is ~20 ms of thread CPU time, and the best of the
 * rounds is reported. Single-threaded.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../layouts/half.h"
#include "../model/quant.h"

/* xorshift64*: the same weights on every run */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng(void)
{
	rng_state ^= rng_state >> 12;
	rng_state ^= rng_state << 25;
	rng_state ^= rng_state >> 27;
	return rng_state * 2685821657736338717ull;
}

static float uniform(float lo, float hi)
{
	return lo + (hi - lo) * (float)(rng() >> 40) * 0x1p-24f;
}

/* Thread CPU time: the build machines are shared, and time spent descheduled
 * is not the kernel's. */
static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
	return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *xmalloc(size_t n)
{
	void *p = malloc(n ? n : 1);
	if (!p) {
		fprintf(stderr, "quant_bench: out of memory\n");
		exit(1);
	}
	return p;
}

static void put_f16(uint8_t *p, float f)
{
	const uint16_t h = kvr_f32_to_f16(f);
	memcpy(p, &h, 2);
}

/* Random blocks with finite scales (random bytes elsewhere): Q4_1 carries a
 * scale and a minimum, Q8_0 a scale. */
static void rand_row(uint32_t type, uint8_t *dst, uint64_t n)
{
	uint64_t bytes;
	kq_row_bytes(type, n, &bytes);
	for (uint64_t i = 0; i < bytes; i++)
		dst[i] = (uint8_t)rng();
	const uint32_t e = kq_block_elems(type), bb = kq_block_bytes(type);
	for (uint64_t b = 0; b < n / e; b++) {
		put_f16(dst + b * bb, uniform(0.001f, 0.05f));
		if (type == KQ_TYPE_Q4_1)
			put_f16(dst + b * bb + 2, uniform(-0.1f, 0.1f));
	}
}

struct bench_case {
	uint32_t type;
	uint64_t rows, cols, wrow;
	const char *what;
	uint8_t *w, *xq;
	float *y;
	double best[KQ_ISA_COUNT];
};

static void bench_setup(struct bench_case *c)
{
	uint64_t xbytes;
	kq_row_bytes(c->type, c->cols, &c->wrow);
	kq_row_bytes((uint32_t)kq_matvec_act_type(c->type), c->cols, &xbytes);
	c->w = xmalloc(c->rows * c->wrow);
	c->xq = xmalloc(xbytes);
	c->y = xmalloc(c->rows * 4);
	float *x = xmalloc(c->cols * 4);
	for (uint64_t r = 0; r < c->rows; r++)
		rand_row(c->type, c->w + r * c->wrow, c->cols);
	for (uint64_t i = 0; i < c->cols; i++)
		x[i] = uniform(-1, 1);
	if (c->type == KQ_TYPE_Q4_1)
		kq_quantize_row_q8_1(x, c->xq, c->cols);
	else if (c->type == KQ_TYPE_Q8_0)
		kq_quantize_row_q8_0(x, c->xq, c->cols);
	else
		kq_quantize_row_q8_k(x, c->xq, c->cols);
	free(x);
	for (int k = 0; k < KQ_ISA_COUNT; k++)
		c->best[k] = 1e30;
}

int main(int argc, char **argv)
{
	int rounds = 8;
	const char *json_path = NULL;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--rounds") && i + 1 < argc && atoi(argv[i + 1]) > 0) {
			rounds = atoi(argv[++i]);
		} else if (!strcmp(argv[i], "--json") && i + 1 < argc) {
			json_path = argv[++i];
		} else {
			fprintf(stderr, "usage: quant_bench [--rounds 8] [--json FILE]\n");
			return 2;
		}
	}
	struct bench_case cs[] = {
		{ .type = KQ_TYPE_Q4_1, .rows = 1536, .cols = 576, .what = "q4_1 576x1536 (ffn_gate/up, L2)" },
		{ .type = KQ_TYPE_Q4_1, .rows = 576, .cols = 1536, .what = "q4_1 1536x576 (ffn_down, L2)" },
		{ .type = KQ_TYPE_Q8_0, .rows = 49152, .cols = 576, .what = "q8_0 576x49152 (logits, 30 MB)" },
		{ .type = KQ_TYPE_Q8_0, .rows = 1024, .cols = 576, .what = "q8_0 576x1024 (L2)" },
		/* Qwen3-0.6B Q4_K_M's feed-forward (one path: the K-quants are not vectorised by hand) */
		{ .type = KQ_TYPE_Q4_K, .rows = 3072, .cols = 1024, .what = "q4_K 1024x3072 (ffn_up, Qwen3-0.6B)" },
		{ .type = KQ_TYPE_Q6_K, .rows = 1024, .cols = 3072, .what = "q6_K 3072x1024 (ffn_down)" },
	};
	const int n_cases = (int)(sizeof(cs) / sizeof(cs[0]));
	for (int k = 0; k < n_cases; k++)
		bench_setup(&cs[k]);
	enum kq_isa isas[KQ_ISA_COUNT];
	int n_isa = 0;
	for (int i = 0; i < KQ_ISA_COUNT; i++)
		if (kq_isa_supported((enum kq_isa)i))
			isas[n_isa++] = (enum kq_isa)i;
	for (int round = 0; round < rounds; round++)
		for (int i = 0; i < n_isa; i++) {
			kq_isa_force(isas[i]);
			for (int k = 0; k < n_cases; k++) {
				struct bench_case *c = &cs[k];
				const double t0 = now_s();
				int reps = 0;
				do { /* ~20 ms */
					kq_matvec(c->type, c->w, c->wrow, c->rows, c->cols, c->xq, NULL, c->y, 0, c->rows);
					reps++;
				} while (now_s() - t0 < 0.02);
				const double dt = (now_s() - t0) / reps;
				c->best[isas[i]] = dt < c->best[isas[i]] ? dt : c->best[isas[i]];
			}
		}
	FILE *json = json_path ? fopen(json_path, "w") : NULL;
	if (json_path && !json) {
		fprintf(stderr, "quant_bench: cannot write %s\n", json_path);
		return 1;
	}
	if (json)
		fprintf(json, "{\n  \"benchmark\": \"quant\",\n  \"rounds\": %d,\n  \"cases\": [\n", rounds);
	for (int k = 0; k < n_cases; k++) {
		struct bench_case *c = &cs[k];
		printf("quant bench %-32s", c->what);
		if (json)
			fprintf(json, "    {\"matrix\": \"%s\", \"gbps\": {", c->what);
		for (int i = 0; i < n_isa; i++) {
			const double gbps = (double)(c->rows * c->wrow) / c->best[isas[i]] * 1e-9;
			printf("  %s %6.2f GB/s", kq_isa_name(isas[i]), gbps);
			if (json)
				fprintf(json, "%s\"%s\": %.3f", i ? ", " : "", kq_isa_name(isas[i]), gbps);
		}
		printf("\n");
		if (json)
			fprintf(json, "}}%s\n", k + 1 < n_cases ? "," : "");
		free(c->w);
		free(c->xq);
		free(c->y);
	}
	if (json) {
		fprintf(json, "  ]\n}\n");
		fclose(json);
	}
	return 0;
}
