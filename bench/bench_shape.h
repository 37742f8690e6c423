/* SPDX-License-Identifier: MIT */
/*
 * bench_shape.h — model presets and shape flags shared by `kvrecall bench`
 * recall and decode: the attention shape of a model (KV heads, query heads,
 * head size, layers) and the page size. Header-only; main thread.
 */
#ifndef KVR_BENCH_SHAPE_H
#define KVR_BENCH_SHAPE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct bench_shape {
	const char *preset;  /* the preset's name, or "custom" */
	uint32_t n_kv_heads, n_qo_heads, head_dim, n_layers, page_tokens;
};

/* Attention shapes from each model's config: KV heads, query heads, head
 * size, layers. SmolLM2-135M is the README demo's model. */
static const struct bench_shape bench_presets[] = {
	{ "llama-3.1-8b", 8, 32, 128, 32, 32 },
	{ "qwen-2.5-7b", 4, 28, 128, 28, 32 },
	{ "smollm2-135m", 3, 9, 64, 30, 32 },
};

static inline int bench_shape_preset(const char *name, struct bench_shape *out)
{
	for (size_t i = 0; i < sizeof(bench_presets) / sizeof(bench_presets[0]); i++)
		if (!strcmp(name, bench_presets[i].preset)) {
			*out = bench_presets[i];
			return 0;
		}
	fprintf(stderr, "kvrecall bench: unknown preset '%s' (llama-3.1-8b, qwen-2.5-7b, smollm2-135m)\n", name);
	return -1;
}

/* Consume argv[*i] when it is a shape flag (--preset, --kv-heads, --qo-heads,
 * --head-dim, --layers, --page-tokens); 1 when consumed, 0 when not a shape
 * flag, -1 on a bad value (after a message). */
static inline int bench_shape_flag(int argc, char **argv, int *i, struct bench_shape *s)
{
	const char *a = argv[*i];
	if (*i + 1 >= argc)
		return 0;
	if (!strcmp(a, "--preset")) {
		++*i;
		return bench_shape_preset(argv[*i], s) ? -1 : 1;
	}
	uint32_t *field = !strcmp(a, "--kv-heads")      ? &s->n_kv_heads
			  : !strcmp(a, "--qo-heads")    ? &s->n_qo_heads
			  : !strcmp(a, "--head-dim")    ? &s->head_dim
			  : !strcmp(a, "--layers")      ? &s->n_layers
			  : !strcmp(a, "--page-tokens") ? &s->page_tokens
							: NULL;
	if (!field)
		return 0;
	char *end;
	const unsigned long v = strtoul(argv[++*i], &end, 10);
	if (*end || v == 0 || v > 65536) {
		fprintf(stderr, "kvrecall bench: %s takes a positive integer, not '%s'\n", a, argv[*i]);
		return -1;
	}
	*field = (uint32_t)v;
	s->preset = "custom";
	return 1;
}

/* In a command's argument loop: a shape flag is consumed (continue), a bad
 * one ends the command (return 2). */
#define BENCH_TAKE_SHAPE_FLAG(argc, argv, i, shape)                                            \
	{                                                                                    \
		const int taken = bench_shape_flag(argc, argv, &(i), shape);                 \
		if (taken < 0)                                                               \
			return 2;                                                            \
		if (taken)                                                                   \
			continue;                                                            \
	}

static inline void bench_shape_json(FILE *f, const struct bench_shape *s)
{
	fprintf(f, "{\"preset\": \"%s\", \"n_kv_heads\": %u, \"n_qo_heads\": %u, \"head_dim\": %u, "
		   "\"layers\": %u, \"page_tokens\": %u, \"dtype\": \"f16\"}",
		s->preset, s->n_kv_heads, s->n_qo_heads, s->head_dim, s->n_layers, s->page_tokens);
}

#endif /* KVR_BENCH_SHAPE_H */
