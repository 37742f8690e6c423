/* SPDX-License-Identifier: MIT */
/*
 * bench_cache.c — `kvrecall bench cache`: what the shared device page cache
 * of quantised pages (scheduler/units.c) holds for a serving mix, against
 * what per-sequence slot tiles would hold. A context with --sequences
 * sequences, --long-share of them at --long-context tokens (sparse: L > B)
 * and the rest at --short-context (attended densely: L <= B), decodes
 * --steps steps of the whole batch; then every sequence is closed and the
 * same mix opened again (the cache must not grow). Per format: the device
 * bytes the cache holds (kvr_stats device_units × one run's bytes) and, for
 * comparison, open sequences × one sequence's slots (what slot tiles
 * allocated at sequence open hold, as plain pages still do and quantised
 * pages did before the shared cache).
 *
 * Threads: the caller's, plus the library's.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrecall.h"
#include "bench_cmd.h"
#include "../bench_common.h"
#include "../bench_shape.h"
#include "../cli_args.h"
#include "../../layouts/half.h"
#include "../../layouts/kvquant.h"

struct cache_opts {
	struct bench_shape sh;
	uint32_t budget, sink, window, sequences, steps;
	uint64_t short_context, long_context;
	double long_share;
};

struct cache_row {
	uint32_t kv_format;
	uint64_t per_seq_bytes;   /* kvr_device_bytes_needed's per-sequence bytes */
	uint64_t unit_bytes;      /* one KV head's run (quantised) */
	uint64_t units, units_used, units_reopened;
	uint64_t seq_units;       /* units reserved for one sequence */
	uint64_t cache_bytes;     /* what the device page cache holds */
	uint64_t tiles_bytes;     /* open sequences × per_seq_bytes */
	double step_ms;           /* median decode step of the batch */
};

static uint64_t rng_state = 0x853c49e6748fea9bull;
static float frand(void)
{
	return (float)((bench_xorshift(&rng_state) >> 40) * 0x1p-24) - 0.5f;
}

static int fail(const char *what, const char *why)
{
	fprintf(stderr, "kvrecall bench cache: %s: %s\n", what, why);
	return 1;
}

/* Open the mix's sequences in ctx and prefill them with random keys and values. */
static int open_mix(struct kvr_context *ctx, const struct cache_opts *o, uint32_t n_long, uint32_t *seqs,
		    uint64_t *lens, uint16_t *k, uint16_t *v, uint32_t chunk)
{
	const size_t row = (size_t)o->sh.n_kv_heads * o->sh.head_dim;
	for (uint32_t b = 0; b < o->sequences; b++) {
		if (kvr_seq_create(ctx, &seqs[b]))
			return fail("sequence", kvr_last_error(ctx));
		lens[b] = b < n_long ? o->long_context : o->short_context;
		for (uint64_t at = 0; at < lens[b]; at += chunk) {
			const uint32_t n = lens[b] - at < chunk ? (uint32_t)(lens[b] - at) : chunk;
			for (size_t i = 0; i < n * row; i++) {
				k[i] = kvr_f32_to_f16(frand());
				v[i] = kvr_f32_to_f16(frand());
			}
			for (uint32_t l = 0; l < o->sh.n_layers; l++)
				if (kvr_prefill(ctx, seqs[b], l, at, n, k, v))
					return fail("prefill", kvr_last_error(ctx));
		}
	}
	return 0;
}

static int run_format(const struct cache_opts *o, uint32_t kv_format, struct cache_row *r)
{
	const uint32_t n_kv = o->sh.n_kv_heads, n_qo = o->sh.n_qo_heads, d = o->sh.head_dim;
	const uint32_t n_long = (uint32_t)lround(o->long_share * o->sequences), batch = o->sequences;
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_layers = o->sh.n_layers, c.n_qo_heads = n_qo, c.n_kv_heads = n_kv, c.head_dim = d;
	c.page_tokens = o->sh.page_tokens, c.dtype = KVR_DTYPE_F16;
	c.budget_tokens = o->budget, c.sink_tokens = o->sink, c.window_tokens = o->window;
	c.mode = KVR_MODE_FREEKV, c.recall = KVR_RECALL_STREAMED, c.backend = KVR_BACKEND_CPU;
	c.dense_layers[0] = 0;
	c.max_sequences = c.max_batch = batch;
	c.kv_format = kv_format;
	const uint64_t page_bytes = 2ull * o->sh.page_tokens * d * n_kv * 2;
	c.pool_bytes = ((o->long_context + o->steps) / o->sh.page_tokens + 64) * o->sh.n_layers * page_bytes * batch;
	memset(r, 0, sizeof(*r));
	r->kv_format = kv_format;
	uint64_t fixed = 0;
	if (kvr_device_bytes_needed(&c, &fixed, &r->per_seq_bytes))
		return fail("configuration", "kvr_device_bytes_needed refused it");
	r->unit_bytes = kv_format ? kvr_kv_run_bytes(kv_format, o->sh.page_tokens, d, 2) : 0;
	struct kvr_context *ctx;
	if (kvr_context_create(&c, &ctx))
		return fail("context", kvr_last_error(NULL));
	const uint32_t chunk = 2048;
	uint32_t *seqs = calloc(batch, sizeof(*seqs));
	uint64_t *lens = calloc(batch, sizeof(*lens));
	uint16_t *k = malloc((size_t)chunk * n_kv * d * 2), *v = malloc((size_t)chunk * n_kv * d * 2);
	uint16_t *q = malloc((size_t)batch * n_qo * d * 2), *out = malloc((size_t)batch * n_qo * d * 2);
	uint16_t *kn = malloc((size_t)batch * n_kv * d * 2), *vn = malloc((size_t)batch * n_kv * d * 2);
	int32_t *status = calloc(batch, sizeof(*status));
	double times[64];
	int err = !seqs || !lens || !k || !v || !q || !out || !kn || !vn || !status ? fail("memory", "out of memory") : 0;
	for (uint32_t round = 0; round < 2 && !err; round++) {
		if ((err = open_mix(ctx, o, n_long, seqs, lens, k, v, chunk)))
			break;
		for (uint32_t s = 0; s < o->steps && !err; s++) {
			for (size_t i = 0; i < (size_t)batch * n_qo * d; i++)
				q[i] = kvr_f32_to_f16(4.0f * frand());
			for (size_t i = 0; i < (size_t)batch * n_kv * d; i++)
				kn[i] = kvr_f32_to_f16(frand()), vn[i] = kvr_f32_to_f16(frand());
			const double t0 = bench_now_s();
			if (kvr_decode_begin(ctx, seqs, lens, batch)) {
				err = fail("decode_begin", kvr_last_error(ctx));
				break;
			}
			for (uint32_t l = 0; l < o->sh.n_layers && !err; l++) {
				if (kvr_decode_layer(ctx, l, q, kn, vn, out, status, NULL))
					err = fail("decode_layer", kvr_last_error(ctx));
				for (uint32_t b = 0; b < batch && !err; b++)
					if (status[b])
						err = fail("decode_layer", kvr_strerror(status[b]));
			}
			kvr_decode_end(ctx);
			times[s] = bench_now_s() - t0;
			for (uint32_t b = 0; b < batch; b++)
				lens[b]++;
		}
		struct kvr_stats st = { .size = sizeof(st) };
		kvr_get_stats(ctx, &st);
		if (round == 0) {
			struct kvr_stats ss = { .size = sizeof(ss) };
			kvr_seq_get_stats(ctx, seqs[0], &ss);
			r->seq_units = ss.device_units;
			r->units = st.device_units, r->units_used = st.device_units_used;
			r->step_ms = bench_median(times, o->steps) * 1e3;
		} else {
			r->units_reopened = st.device_units;
		}
		for (uint32_t b = 0; b < batch && !err; b++)
			if (kvr_seq_free(ctx, seqs[b]))
				err = fail("sequence", kvr_last_error(ctx));
	}
	r->cache_bytes = r->units * r->unit_bytes;
	/* slot tiles: per sequence, its slots' bytes (plain: kvr_device_bytes_needed's
	 * per-sequence bytes, which are its tiles and scatter items) */
	r->tiles_bytes = (uint64_t)batch * (kv_format ? r->seq_units * r->unit_bytes : r->per_seq_bytes);
	kvr_context_destroy(ctx);
	free(seqs), free(lens), free(k), free(v), free(q), free(out), free(kn), free(vn), free(status);
	return err;
}

#define CACHE_CMD "kvrecall bench cache"

static void cache_usage(FILE *f)
{
	fprintf(f,
		"usage: kvrecall bench cache [--preset smollm2-135m|llama-3.1-8b|qwen-2.5-7b] [--layers N]\n"
		"         [--budget 2048] [--sink 128] [--window 128] [--sequences 16] [--long-share 0.25]\n"
		"         [--short-context 1024] [--long-context 8192] [--steps 4] [--quick] [--json FILE]\n"
		"  --sequences 1 to 256; --long-share 0 to 1 (the sparse sequences' share); --steps 1 to 64\n"
		"  --short-context at most --budget (dense); --long-context above it (sparse), up to 2^30\n");
}

int bench_cache(int argc, char **argv)
{
	const char *json_path = NULL;
	struct cache_opts o = { .budget = 2048, .sink = 128, .window = 128, .sequences = 16, .steps = 4,
				.short_context = 1024, .long_context = 8192, .long_share = 0.25 };
	if (bench_shape_preset(CACHE_CMD, "smollm2-135m", &o.sh))
		return CLI_EXIT_FAILURE;
	for (int i = 0; i < argc; i++) {
		const char *a = argv[i];
		if (cli_is_help(a)) {
			cache_usage(stdout);
			return CLI_EXIT_OK;
		}
		if (!strcmp(a, "--quick")) {
			o.sequences = 4, o.long_context = 4096, o.short_context = 512, o.steps = 2, o.sh.n_layers = 4;
			continue;
		}
		BENCH_TAKE_SHAPE_FLAG(CACHE_CMD, argc, argv, i, &o.sh)
		CLI_TAKE(cli_opt_str(CACHE_CMD, argc, argv, &i, "--json", &json_path))
		CLI_TAKE(cli_opt_u32(CACHE_CMD, argc, argv, &i, "--budget", 1, UINT32_MAX, &o.budget))
		CLI_TAKE(cli_opt_u32(CACHE_CMD, argc, argv, &i, "--sink", 0, UINT32_MAX - 1, &o.sink))
		CLI_TAKE(cli_opt_u32(CACHE_CMD, argc, argv, &i, "--window", 0, UINT32_MAX - 1, &o.window))
		CLI_TAKE(cli_opt_u32(CACHE_CMD, argc, argv, &i, "--sequences", 1, 256, &o.sequences))
		CLI_TAKE(cli_opt_double(CACHE_CMD, argc, argv, &i, "--long-share", 0, 1, 0, &o.long_share))
		CLI_TAKE(cli_opt_u64(CACHE_CMD, argc, argv, &i, "--short-context", 1, 1u << 30, &o.short_context))
		CLI_TAKE(cli_opt_u64(CACHE_CMD, argc, argv, &i, "--long-context", 1, 1u << 30, &o.long_context))
		CLI_TAKE(cli_opt_u32(CACHE_CMD, argc, argv, &i, "--steps", 1, 64, &o.steps))
		return cli_usage_error(CACHE_CMD, "unknown option '%s'", a);
	}
	if (o.short_context > o.budget || o.long_context <= o.budget) {
		fprintf(stderr, "kvrecall bench cache: --short-context must be <= --budget (dense) and "
				"--long-context > --budget (sparse)\n");
		return CLI_EXIT_USAGE;
	}
	static const uint32_t formats[] = { KVR_KV_FORMAT_PLAIN, KVR_KV_FORMAT_K8V4, KVR_KV_FORMAT_K4V2 };
	struct cache_row rows[3];
	for (uint32_t f = 0; f < 3; f++) {
		bench_progress("cache", f, 3);
		if (run_format(&o, formats[f], &rows[f]))
			return 1;
	}
	bench_progress("cache", 3, 3);
	const uint32_t n_long = (uint32_t)lround(o.long_share * o.sequences);
	fprintf(stderr,
		"kvrecall bench cache: %s, %u layers, B = %u; %u sequences, %u at %llu tokens (sparse), %u at %llu "
		"(dense)\n%8s %14s %16s %14s %10s %10s %9s\n",
		o.sh.preset, o.sh.n_layers, o.budget, o.sequences, n_long, (unsigned long long)o.long_context,
		o.sequences - n_long, (unsigned long long)o.short_context, "format", "per-seq MiB", "per-seq tiles MiB",
		"cache MiB", "units", "used", "reopened");
	for (uint32_t f = 0; f < 3; f++) {
		const struct cache_row *r = &rows[f];
		fprintf(stderr, "%8s %14.1f %16.1f %14.1f %10llu %10llu %9llu\n", kvr_kv_format_name(r->kv_format),
			r->per_seq_bytes / 1048576.0, r->tiles_bytes / 1048576.0,
			r->kv_format ? r->cache_bytes / 1048576.0 : r->tiles_bytes / 1048576.0,
			(unsigned long long)r->units, (unsigned long long)r->units_used,
			(unsigned long long)r->units_reopened);
	}
	FILE *f = json_path ? fopen(json_path, "w") : stdout;
	if (!f) {
		fprintf(stderr, "kvrecall bench cache: cannot write %s: %s\n", json_path, strerror(errno));
		return 1;
	}
	bench_json_open(f, "cache", "cpu", argc, argv);
	fprintf(f,
		"  \"shape\": {\"preset\": \"%s\", \"n_layers\": %u, \"n_kv_heads\": %u, \"n_qo_heads\": %u, "
		"\"head_dim\": %u, \"page_tokens\": %u},\n"
		"  \"params\": {\"budget_tokens\": %u, \"sink_tokens\": %u, \"window_tokens\": %u, \"sequences\": %u, "
		"\"long_sequences\": %u, \"long_context\": %llu, \"short_context\": %llu, \"steps\": %u},\n"
		"  \"results\": [\n",
		o.sh.preset, o.sh.n_layers, o.sh.n_kv_heads, o.sh.n_qo_heads, o.sh.head_dim, o.sh.page_tokens,
		o.budget, o.sink, o.window, o.sequences, n_long, (unsigned long long)o.long_context,
		(unsigned long long)o.short_context, o.steps);
	for (uint32_t i = 0; i < 3; i++) {
		const struct cache_row *r = &rows[i];
		const uint64_t held = r->kv_format ? r->cache_bytes : r->tiles_bytes;
		fprintf(f,
			"    {\"kv_format\": \"%s\", \"shared_cache\": %s, \"per_sequence_bytes\": %llu, "
			"\"unit_bytes\": %llu, \"units\": %llu, \"units_used\": %llu, \"units_after_reopen\": %llu, "
			"\"device_bytes_held\": %llu, \"per_sequence_tiles_bytes\": %llu, \"held_over_tiles\": %.4f, "
			"\"step_ms\": %.3f}%s\n",
			kvr_kv_format_name(r->kv_format), r->kv_format ? "true" : "false",
			(unsigned long long)r->per_seq_bytes, (unsigned long long)r->unit_bytes,
			(unsigned long long)r->units, (unsigned long long)r->units_used,
			(unsigned long long)r->units_reopened, (unsigned long long)held,
			(unsigned long long)r->tiles_bytes, r->tiles_bytes ? (double)held / r->tiles_bytes : 0.0,
			r->step_ms, i + 1 < 3 ? "," : "");
	}
	fprintf(f, "  ]\n");
	bench_json_close(f);
	return 0;
}
