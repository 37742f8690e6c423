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

#include "cli_args.h"

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

/* The presets' names, for errors that list them. */
static const char *const bench_preset_names[] = { "llama-3.1-8b", "qwen-2.5-7b", "smollm2-135m", NULL };

static inline int bench_shape_preset(const char *cmd, const char *name, struct bench_shape *out)
{
	uint32_t i;
	if (cli_parse_choice(cmd, "--preset", name, bench_preset_names, &i))
		return -1;
	*out = bench_presets[i];
	return 0;
}

/* Consume argv[*i] when it is a shape flag (--preset, --kv-heads, --qo-heads,
 * --head-dim, --layers, --page-tokens); 1 when consumed, 0 when not a shape
 * flag, -1 on a missing or bad value (after a message naming cmd). */
static inline int bench_shape_flag(const char *cmd, int argc, char **argv, int *i, struct bench_shape *s)
{
	const char *a = argv[*i];
	if (!strcmp(a, "--preset")) {
		const char *v = cli_value_of(cmd, argc, argv, i);
		return v && !bench_shape_preset(cmd, v, s) ? 1 : -1;
	}
	uint32_t *field = !strcmp(a, "--kv-heads")      ? &s->n_kv_heads
			  : !strcmp(a, "--qo-heads")    ? &s->n_qo_heads
			  : !strcmp(a, "--head-dim")    ? &s->head_dim
			  : !strcmp(a, "--layers")      ? &s->n_layers
			  : !strcmp(a, "--page-tokens") ? &s->page_tokens
							: NULL;
	if (!field)
		return 0;
	const int taken = cli_opt_u32(cmd, argc, argv, i, a, 1, 65536, field);
	if (taken > 0)
		s->preset = "custom";
	return taken;
}

/* In a command's argument loop: a shape flag is consumed (continue), a bad
 * one ends the command (return CLI_EXIT_USAGE). */
#define BENCH_TAKE_SHAPE_FLAG(cmd, argc, argv, i, shape) CLI_TAKE(bench_shape_flag(cmd, argc, argv, &(i), shape))

static inline void bench_shape_json(FILE *f, const struct bench_shape *s)
{
	fprintf(f, "{\"preset\": \"%s\", \"n_kv_heads\": %u, \"n_qo_heads\": %u, \"head_dim\": %u, "
		   "\"layers\": %u, \"page_tokens\": %u, \"dtype\": \"f16\"}",
		s->preset, s->n_kv_heads, s->n_qo_heads, s->head_dim, s->n_layers, s->page_tokens);
}

#endif /* KVR_BENCH_SHAPE_H */
