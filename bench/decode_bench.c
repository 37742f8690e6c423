/* SPDX-License-Identifier: MIT */
/*
 * decode_bench.c — decode step time per mode through the public API, the way
 * an engine drives kvrecall: Llama-3.1-8B attention shapes (8 KV heads, 32
 * query heads, d = 128, f16, p = 32), a few layers, B = 2048, S = W = 512,
 * contexts 8K to 128K tokens, queries with realistic dynamics (each step's
 * query strongly correlated with the previous one, with occasional jumps).
 *
 * Reported per mode and context: step time per layer, its ratio to attention
 * over the B tokens alone (the same kvrecall dense decode at L = B, measured in
 * the same run) and to the budget (1 + L/(p·B)) of it, selections and
 * freekv's correction rate. Output: a table on stderr and JSON.
 *
 * --backend cuda runs the same steps on a GPU: q, k, v and out then live in
 * device memory, as an engine's would. The bench allocates them through the
 * library's internal device layer (gpu/backend.h), standing in for the
 * engine's own cudaMalloc, so it links the static library; everything else
 * goes through the public API. The step's time then ends with a synchronise
 * of the engine's stream (the legacy default stream here), so it covers the
 * GPU work, not just its launch.
 *
 * Threads: the caller plus the context's workers (config threads = auto).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrecall.h"
#include "bench_common.h"
#include "../gpu/backend.h"

#define N_KV 8
#define N_QO 32
#define D 128
#define LAYERS 4

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float frand(void) /* uniform in [-1, 1) */
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return (float)(int32_t)(rng_state >> 32) / 2147483648.0f;
}

/* f32 -> f16 bits, round to nearest even (normal range only: inputs are small) */
static uint16_t f16(float x)
{
	uint32_t u;
	memcpy(&u, &x, 4);
	const uint32_t sign = (u >> 16) & 0x8000u;
	int32_t e = (int32_t)((u >> 23) & 0xff) - 127 + 15;
	uint32_t mant = u & 0x7fffffu;
	if (e <= 0)
		return (uint16_t)sign;
	uint32_t r = (uint32_t)e << 10 | mant >> 13;
	const uint32_t rem = mant & 0x1fffu;
	if (rem > 0x1000u || (rem == 0x1000u && (r & 1u)))
		r++;
	return (uint16_t)(sign | r);
}

static uint32_t recall_kind = KVR_RECALL_ZERO_COPY;
static uint32_t recall_buffers = 2, pool_layout = KVR_POOL_HND, chunk_pages = 8;
static uint32_t controller = KVR_CONTROLLER_AUTO;
static uint32_t resolved_controller = KVR_CONTROLLER_AUTO; /* what the contexts resolved it to */
static const uint32_t *only_mode; /* --mode: one mode instead of all four */
static uint32_t backend = KVR_BACKEND_CPU;

/* --backend cuda: the engine's side of a step on the GPU — its device buffers
 * for q, k, v and out and its stream (the legacy default one). */
static struct {
	struct kvr_dev *dev;
	struct kvr_stream *stream;
	void *q, *k, *v, *out;
} engine;

static void engine_fail(const char *what)
{
	fprintf(stderr, "decode_bench: %s: %s\n", what, kvr_dev_last_error(engine.dev));
	exit(1);
}

static void engine_open(void)
{
	const struct kvr_dev_params params = { .kind = KVR_DEV_CUDA };
	char err[256] = "";
	if (kvr_dev_create(&params, &engine.dev, err, sizeof(err))) {
		fprintf(stderr, "decode_bench: --backend cuda: %s\n", err);
		exit(1);
	}
	if (kvr_dev_stream_wrap(engine.dev, NULL, &engine.stream) ||
	    kvr_dev_alloc(engine.dev, N_QO * D * 2, &engine.q) ||
	    kvr_dev_alloc(engine.dev, N_KV * D * 2, &engine.k) ||
	    kvr_dev_alloc(engine.dev, N_KV * D * 2, &engine.v) ||
	    kvr_dev_alloc(engine.dev, N_QO * D * 2, &engine.out))
		engine_fail("device buffers");
}

static void engine_put(void *dst, const void *src, size_t bytes)
{
	if (kvr_dev_memcpy_async(engine.dev, dst, src, bytes, KVR_COPY_H2D, engine.stream))
		engine_fail("copy to the device");
}

static struct kvr_context *make_ctx(uint32_t mode, uint32_t budget, uint64_t max_tokens)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_layers = LAYERS;
	c.n_qo_heads = N_QO;
	c.n_kv_heads = N_KV;
	c.head_dim = D;
	c.dtype = KVR_DTYPE_F16;
	c.budget_tokens = budget;
	c.sink_tokens = budget >= 2048 ? 512 : 0;
	c.window_tokens = budget >= 2048 ? 512 : 0;
	c.mode = mode;
	c.tau = 0.9f;
	c.dense_layers[0] = 0;
	c.max_sequences = 1;
	c.max_batch = 1;
	c.recall = recall_kind;
	c.recall_buffers = recall_buffers;
	c.pool_layout = pool_layout;
	c.recall_chunk_pages = chunk_pages;
	c.controller = controller;
	c.backend = backend;
	c.pool_bytes = (max_tokens / 32 + 64) * LAYERS * 2ull * 32 * D * N_KV * 2;
	struct kvr_context *ctx;
	if (kvr_context_create(&c, &ctx)) {
		fprintf(stderr, "decode_bench: %s\n", kvr_last_error(NULL));
		exit(1);
	}
	struct kvr_config got;
	kvr_config_init(&got);
	if (!kvr_context_get_config(ctx, &got))
		resolved_controller = got.controller;
	return ctx;
}

struct result {
	double us_per_layer;
	double corrected_rate;
	uint64_t selections;
	double correction_waits_per_layer; /* (sequence, layer) decodes that waited for q_i's pages */
	double correction_wait_share;      /* of the engine's time inside decode_layer */
	double controller_wait_share;
	double recall_wait_share;
	double critical_share;             /* engine time / (engine + controller time) */
	double controller_us_per_layer;    /* controller time per layer (overlapped) */
	double hit_rate;                   /* streamed: hits / (hits + misses) */
	double recalled_kib_per_layer;
};

/* Prefill L tokens, then time `steps` decode steps (tracing the last few into
 * trace_path when it is set). */
static struct result run(uint32_t mode, uint32_t budget, uint64_t L, uint32_t steps,
			 const char *trace_path)
{
	struct kvr_context *ctx = make_ctx(mode, budget, L + steps);
	uint32_t seq;
	if (kvr_seq_create(ctx, &seq)) {
		fprintf(stderr, "decode_bench: %s\n", kvr_last_error(ctx));
		exit(1);
	}
	const uint32_t chunk = 4096;
	uint16_t *k = malloc((size_t)chunk * N_KV * D * 2), *v = malloc((size_t)chunk * N_KV * D * 2);
	for (uint64_t pos = 0; pos < L; pos += chunk) {
		const uint32_t n = L - pos < chunk ? (uint32_t)(L - pos) : chunk;
		for (size_t i = 0; i < (size_t)n * N_KV * D; i++) {
			k[i] = f16(frand());
			v[i] = f16(frand());
		}
		for (uint32_t l = 0; l < LAYERS; l++)
			if (kvr_prefill(ctx, seq, l, pos, n, k, v)) {
				fprintf(stderr, "decode_bench: %s\n", kvr_last_error(ctx));
				exit(1);
			}
	}
	/* queries: q_i = 0.97·q_{i-1} + 0.25·noise, renormalised; every 16th
	 * step a jump to a fresh direction for a quarter of the heads */
	float qf[N_QO * D];
	uint16_t q[N_QO * D], out[N_QO * D];
	for (int i = 0; i < N_QO * D; i++)
		qf[i] = frand();
	double *times = calloc(steps, sizeof(double));
	struct kvr_stats st0 = { .size = sizeof(st0) }, st1 = { .size = sizeof(st1) };
	kvr_get_stats(ctx, &st0);
	for (uint32_t s = 0; s < steps; s++) {
		for (int h = 0; h < N_QO; h++) {
			const int jump = s % 16 == 15 && h % 4 == 0;
			double norm = 0;
			for (int c = 0; c < D; c++) {
				float *x = &qf[h * D + c];
				*x = jump ? frand() : 0.97f * *x + 0.25f * frand();
				norm += (double)*x * *x;
			}
			const float scale = (float)(4.0 / sqrt(norm)); /* |q| = 4: peaked softmax */
			for (int c = 0; c < D; c++)
				q[h * D + c] = f16(qf[h * D + c] * scale);
		}
		for (size_t i = 0; i < N_KV * D; i++) {
			k[i] = f16(frand());
			v[i] = f16(frand());
		}
		const uint64_t pos = L + s;
		if (trace_path && s + 4 == steps && kvr_trace_start(ctx, 1u << 16)) {
			fprintf(stderr, "decode_bench: %s\n", kvr_last_error(ctx));
			exit(1);
		}
		const void *lq = q, *lk = k, *lv = v;
		void *lout = out;
		if (engine.dev) { /* the engine's inputs are on the device before the step */
			engine_put(engine.q, q, sizeof(q));
			engine_put(engine.k, k, N_KV * D * 2);
			engine_put(engine.v, v, N_KV * D * 2);
			if (kvr_dev_stream_synchronize(engine.dev, engine.stream))
				engine_fail("synchronise");
			lq = engine.q, lk = engine.k, lv = engine.v, lout = engine.out;
		}
		const double t0 = bench_now_s();
		kvr_decode_begin(ctx, &seq, &pos, 1);
		for (uint32_t l = 0; l < LAYERS; l++) {
			int32_t status;
			if (kvr_decode_layer(ctx, l, lq, lk, lv, lout, &status, NULL) || status) {
				fprintf(stderr, "decode_bench: %s\n", kvr_last_error(ctx));
				exit(1);
			}
		}
		kvr_decode_end(ctx);
		if (engine.dev && kvr_dev_stream_synchronize(engine.dev, engine.stream))
			engine_fail("synchronise");
		times[s] = bench_now_s() - t0;
	}
	if (trace_path && kvr_trace_write(ctx, trace_path)) {
		fprintf(stderr, "decode_bench: %s\n", kvr_last_error(ctx));
		exit(1);
	}
	kvr_get_stats(ctx, &st1);
	const double crit = (double)(st1.critical_ns - st0.critical_ns);
	const double ctl = (double)(st1.controller_ns - st0.controller_ns);
	const double layers = (double)steps * LAYERS;
	const uint64_t hits = st1.pages_hit - st0.pages_hit, miss = st1.pages_recalled - st0.pages_recalled;
	struct result r = {
		bench_median(times, steps) / LAYERS * 1e6,
		st1.checked_heads > st0.checked_heads
			? (double)(st1.corrected_heads - st0.corrected_heads) /
				  (double)(st1.checked_heads - st0.checked_heads)
			: 0.0,
		st1.selections - st0.selections,
		(double)(st1.correction_waits - st0.correction_waits) / layers,
		crit > 0 ? (double)(st1.correction_wait_ns - st0.correction_wait_ns) / crit : 0,
		crit > 0 ? (double)(st1.controller_wait_ns - st0.controller_wait_ns) / crit : 0,
		crit > 0 ? (double)(st1.recall_wait_ns - st0.recall_wait_ns) / crit : 0,
		crit + ctl > 0 ? crit / (crit + ctl) : 1,
		ctl / layers / 1e3,
		hits + miss ? (double)hits / (double)(hits + miss) : 0,
		(double)(st1.bytes_recalled - st0.bytes_recalled) / layers / 1024.0,
	};
	free(times), free(k), free(v);
	kvr_context_destroy(ctx);
	return r;
}

int main(int argc, char **argv)
{
	const char *json_path = NULL, *trace_path = NULL;
	uint64_t trace_context = 32768;
	uint32_t trace_mode = KVR_MODE_FREEKV;
	uint32_t steps = 24;
	uint64_t max_context = 131072;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--json") && i + 1 < argc)
			json_path = argv[++i];
		else if (!strcmp(argv[i], "--steps") && i + 1 < argc)
			steps = (uint32_t)atoi(argv[++i]);
		else if (!strcmp(argv[i], "--max-context") && i + 1 < argc)
			max_context = strtoull(argv[++i], NULL, 10);
		else if (!strcmp(argv[i], "--recall") && i + 1 < argc) {
			const char *r = argv[++i];
			recall_kind = !strcmp(r, "streamed") ? KVR_RECALL_STREAMED
				    : !strcmp(r, "zero-copy") ? KVR_RECALL_ZERO_COPY : 0;
			if (!recall_kind) {
				fprintf(stderr, "decode_bench: --recall zero-copy|streamed\n");
				return 2;
			}
		} else if (!strcmp(argv[i], "--controller") && i + 1 < argc) {
			const char *w = argv[++i];
			controller = !strcmp(w, "thread")   ? KVR_CONTROLLER_THREAD
				     : !strcmp(w, "inline") ? KVR_CONTROLLER_INLINE
							    : KVR_CONTROLLER_AUTO;
			if (controller == KVR_CONTROLLER_AUTO && strcmp(w, "auto")) {
				fprintf(stderr, "decode_bench: --controller auto|thread|inline\n");
				return 2;
			}
		} else if (!strcmp(argv[i], "--backend") && i + 1 < argc) {
			const char *b = argv[++i];
			backend = !strcmp(b, "cuda") ? KVR_BACKEND_CUDA : !strcmp(b, "cpu") ? KVR_BACKEND_CPU : 0;
			if (!backend) {
				fprintf(stderr, "decode_bench: --backend cpu|cuda\n");
				return 2;
			}
		} else if (!strcmp(argv[i], "--buffers") && i + 1 < argc)
			recall_buffers = (uint32_t)atoi(argv[++i]);
		else if (!strcmp(argv[i], "--chunk-pages") && i + 1 < argc)
			chunk_pages = (uint32_t)atoi(argv[++i]);
		else if (!strcmp(argv[i], "--pool-layout") && i + 1 < argc)
			pool_layout = !strcmp(argv[++i], "nhd") ? KVR_POOL_NHD : KVR_POOL_HND;
		else if (!strcmp(argv[i], "--mode") && i + 1 < argc) {
			static uint32_t m;
			if (kvr_mode_parse(argv[++i], &m)) {
				fprintf(stderr, "decode_bench: unknown mode %s\n", argv[i]);
				return 2;
			}
			only_mode = &m;
		} else if (!strcmp(argv[i], "--trace") && i + 1 < argc)
			trace_path = argv[++i];
		else if (!strcmp(argv[i], "--trace-context") && i + 1 < argc)
			trace_context = strtoull(argv[++i], NULL, 10);
		else if (!strcmp(argv[i], "--trace-mode") && i + 1 < argc) {
			if (kvr_mode_parse(argv[++i], &trace_mode)) {
				fprintf(stderr, "decode_bench: unknown mode %s\n", argv[i]);
				return 2;
			}
		} else {
			fprintf(stderr, "usage: decode_bench [--steps 24] [--max-context 131072] [--json FILE]\n"
					"                    [--recall zero-copy|streamed] [--trace FILE "
					"[--trace-context 32768] [--trace-mode freekv]]\n"
					"                    [--mode M] [--buffers 1|2] [--chunk-pages 8] "
					"[--pool-layout hnd|nhd]\n"
					"                    [--controller auto|thread|inline] [--backend cpu|cuda]\n"
					"  --trace: only trace 4 steps at --trace-context tokens and exit\n");
			return 2;
		}
	}
	if (steps < 3)
		steps = 3;
	const uint32_t B = 2048, p = 32;
	if (backend == KVR_BACKEND_CUDA)
		engine_open();
	if (trace_path) {
		run(trace_mode, B, trace_context, steps, trace_path);
		fprintf(stderr, "decode_bench: trace of %s at %llu tokens (%s recall) in %s\n",
			kvr_mode_name(trace_mode), (unsigned long long)trace_context,
			kvr_recall_name(recall_kind), trace_path);
		return 0;
	}
	/* attention over the B tokens alone: a dense decode at L = B */
	const struct result base = run(KVR_MODE_DENSE, B, B - 1, steps, NULL);
	fprintf(stderr, "decode_bench: attention over B = %u tokens: %.1f us per layer (%d layers, %u steps)\n",
		B, base.us_per_layer, LAYERS, steps);
	FILE *json = json_path ? fopen(json_path, "w") : stdout;
	if (!json) {
		fprintf(stderr, "decode_bench: cannot write %s: %s\n", json_path, strerror(errno));
		return 1;
	}
	fprintf(json, "{\n  \"benchmark\": \"decode\",\n  \"kvrecall_version\": \"%s\",\n  \"backend\": \"%s\",\n",
		kvr_version_string(), backend == KVR_BACKEND_CUDA ? "cuda" : "cpu");
	fprintf(json, "  \"shape\": {\"n_kv_heads\": %d, \"n_qo_heads\": %d, \"head_dim\": %d, \"dtype\": \"f16\", "
		      "\"page_tokens\": %u, \"budget_tokens\": %u, \"sink_tokens\": 512, \"window_tokens\": 512, "
		      "\"layers\": %d},\n",
		N_KV, N_QO, D, p, B, LAYERS);
	fprintf(json, "  \"attention_over_budget_us\": %.2f,\n  \"results\": [\n", base.us_per_layer);
	static const uint32_t modes[] = { KVR_MODE_DENSE, KVR_MODE_BLOCKING, KVR_MODE_SPECULATIVE, KVR_MODE_FREEKV };
	int first = 1;
	for (uint64_t L = 8192; L <= max_context; L *= 2)
		for (size_t mi = 0; mi < 4; mi++) {
			if (only_mode && modes[mi] != *only_mode)
				continue;
			const struct result r = run(modes[mi], B, L, steps, NULL);
			const double budget = (1.0 + (double)L / (p * B)) * base.us_per_layer;
			fprintf(stderr, "L=%7llu %-11s %9.1f us/layer = %5.2f x attention-over-B, %5.2f x (1+L/(pB)) "
					"budget; corrected %.1f%% of heads; correction waits %.2f/layer (%.0f%% of "
					"engine time); controller %.0f us/layer beside, critical share %.2f; "
					"hit rate %.2f, %.0f KiB recalled/layer\n",
				(unsigned long long)L, kvr_mode_name(modes[mi]), r.us_per_layer,
				r.us_per_layer / base.us_per_layer, r.us_per_layer / budget, 100 * r.corrected_rate,
				r.correction_waits_per_layer, 100 * r.correction_wait_share,
				r.controller_us_per_layer, r.critical_share, r.hit_rate, r.recalled_kib_per_layer);
			fprintf(json, "%s    {\"context_tokens\": %llu, \"mode\": \"%s\", \"recall\": \"%s\", "
				      "\"controller\": \"%s\", "
				      "\"us_per_layer\": %.2f, "
				      "\"ratio_to_attention_over_budget\": %.4f, \"ratio_to_target_budget\": %.4f, "
				      "\"corrected_head_rate\": %.4f, \"selections\": %llu, "
				      "\"correction_waits_per_layer\": %.4f, \"correction_wait_share\": %.4f, "
				      "\"controller_wait_share\": %.4f, \"recall_wait_share\": %.4f, "
				      "\"critical_share\": %.4f, \"controller_us_per_layer\": %.2f, "
				      "\"hit_rate\": %.4f, \"recalled_kib_per_layer\": %.2f}",
				first ? "" : ",\n", (unsigned long long)L, kvr_mode_name(modes[mi]),
				kvr_recall_name(recall_kind), kvr_controller_name(resolved_controller),
				r.us_per_layer,
				r.us_per_layer / base.us_per_layer, r.us_per_layer / budget, r.corrected_rate,
				(unsigned long long)r.selections, r.correction_waits_per_layer,
				r.correction_wait_share, r.controller_wait_share, r.recall_wait_share,
				r.critical_share, r.controller_us_per_layer, r.hit_rate, r.recalled_kib_per_layer);
			first = 0;
		}
	fprintf(json, "\n  ]\n}\n");
	if (json != stdout)
		fclose(json);
	return 0;
}
