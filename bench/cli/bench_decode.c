/* SPDX-License-Identifier: MIT */
/*
 * bench_decode.c — `kvrecall bench decode`: decode step time per mode through
 * the public API, the way an engine drives kvrecall. A model shape (preset or
 * flags; 4 layers unless --layers says otherwise, since every layer costs the
 * same), B = 2048, S = W = 512, contexts 8K up to --max-context, one or more
 * batch sizes, and synthetic queries with realistic dynamics: each step's
 * query strongly correlated with the previous one (q_i = 0.97·q_{i-1} +
 * 0.25·noise, renormalised), and every 16th step a jump to a fresh direction
 * for a quarter of the heads.
 *
 * Reported per batch, mode and context: the step time per layer (the whole
 * batch's step ÷ layers; median of --steps), its ratio to attention over the B
 * tokens alone (dense at L = B, measured in the same run) and to the design's
 * budget (1 + L/(p·B)) of it; the critical path's time per layer (the engine's
 * own time inside decode_layer) and its share beside the controller's;
 * corrections, correction waits, hit rate and bytes recalled; the engine
 * thread's host waits for the device per layer (kvr_stats.host_waits).
 *
 * --rounds N repeats attention over B and every row N times, in turn, so that
 * a shared machine's slow spells fall on both sides of each ratio; a row then
 * reports its median round (by the ratio to the budget; every field from that
 * one run), the ratio's range over the rounds, and the ratio of the fastest
 * step to the budget of the fastest attention over B (each side at its least
 * disturbed, the usual estimate on a machine shared with others).
 *
 * --kv-format F1,F2,... measures each format in every round, each with its
 * own attention over B, so that formats compare within one run: each row
 * also carries its speed over the first format's same row, the median over
 * the rounds of the two steps' ratio in the same round (a slow spell moves
 * both sides, where medians taken apart let it fall on one side only).
 *
 * --backend cuda runs the same steps on a GPU: q, k, v and out then live in
 * device memory, as an engine's would. They are allocated through the
 * library's device layer (gpu/backend.h), standing in for the engine's own
 * cudaMalloc; everything else goes through the public API. Each step's time
 * ends with a synchronise of the engine's stream (the legacy default stream),
 * so it covers the GPU work, not just its launch.
 *
 * --capture (cuda) adds, after each row, the same steps replayed from a CUDA
 * graph captured once (kvr_decode_reserve, kvr_decode_replay; docs/api.md,
 * "Decode steps in a CUDA graph"), on a stream of the engine's own: rows
 * with "captured": true. A configuration that cannot be captured (quantised
 * pages with streamed recall, say) gets none, with the reason on stderr.
 *
 * --trace FILE traces 4 steps at --trace-context tokens (Chrome trace-event
 * JSON, kvr_trace_write) and exits.
 *
 * Threads: the caller plus the context's workers (config threads = auto) and
 * its controller thread.
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
#include "../../gpu/backend.h"
#include "../../layouts/kvquant.h"
#include "../../layouts/half.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float frand(void) /* uniform in [-1, 1) */
{
	return (float)(int32_t)(bench_xorshift(&rng_state) >> 32) / 2147483648.0f;
}

/* The run's settings (main thread only). */
static struct {
	struct bench_shape sh;
	uint32_t recall, buffers, pool_layout, chunk_pages, controller, backend;
	uint32_t kv_format;           /* the format contexts are made with now */
	uint32_t kv_formats[8], n_kv_formats; /* --kv-format's list; [0] f16 unless given */
	uint32_t budget, sink, window;
	int32_t spilled_pct;          /* the spill tier: % of the KV in the file; -1 = no tier */
	const char *spill_dir;
	uint32_t resolved_controller; /* what the contexts resolved `controller` to */
	uint32_t resolved_recall;     /* ... and `recall`, for the last context made (its mode's) */
	const char *backend_name;
	int capture; /* --capture: each row once more, captured into a CUDA graph and replayed */
	/* --estimate off|on|both: the sparse rows without the estimate of the
	 * pages not retrieved, with it, or each without then with it (its cost:
	 * the "estimate_cost_ratio" of the second row) */
	int estimate_off, estimate_on;
	uint32_t estimate; /* the context being made: config estimate */
} g = {
	.estimate_off = 1,
	.recall = KVR_RECALL_AUTO, /* the library's choice per backend and mode */
	.buffers = 2,
	.pool_layout = KVR_POOL_HND,
	.chunk_pages = 8,
	.controller = KVR_CONTROLLER_AUTO,
	.backend = KVR_BACKEND_CPU,
	.budget = 2048,
	.sink = 512,
	.window = 512,
	.resolved_controller = KVR_CONTROLLER_AUTO,
	.backend_name = "cpu",
	.spilled_pct = -1,
};

/* --backend cuda: the engine's side of a step on the GPU — its device buffers
 * for the batch's q, k, v and out and its stream (the legacy default one). */
static struct {
	struct kvr_dev *dev;
	struct kvr_stream *stream;
	struct kvr_stream *capture_stream; /* --capture: a stream of its own (the legacy one cannot capture) */
	void *q, *k, *v, *out;
	uint32_t batch; /* sized for */
} engine;

static void die(const char *what, const char *why)
{
	fprintf(stderr, "kvrecall bench decode: %s: %s\n", what, why);
	exit(1);
}

static void engine_fit(uint32_t batch)
{
	if (engine.batch >= batch)
		return;
	if (!engine.dev) {
		const struct kvr_dev_params params = { .kind = KVR_DEV_CUDA };
		char err[256] = "";
		if (kvr_dev_create(&params, &engine.dev, err, sizeof(err)))
			die("--backend cuda", err);
		if (kvr_dev_stream_wrap(engine.dev, NULL, &engine.stream))
			die("engine stream", kvr_dev_last_error(engine.dev));
		if (g.capture && kvr_dev_stream_create(engine.dev, 0, &engine.capture_stream))
			die("engine stream", kvr_dev_last_error(engine.dev));
	} else {
		kvr_dev_free(engine.dev, engine.q), kvr_dev_free(engine.dev, engine.k);
		kvr_dev_free(engine.dev, engine.v), kvr_dev_free(engine.dev, engine.out);
	}
	const size_t q_bytes = (size_t)batch * g.sh.n_qo_heads * g.sh.head_dim * 2;
	const size_t kv_bytes = (size_t)batch * g.sh.n_kv_heads * g.sh.head_dim * 2;
	if (kvr_dev_alloc(engine.dev, q_bytes, &engine.q) || kvr_dev_alloc(engine.dev, kv_bytes, &engine.k) ||
	    kvr_dev_alloc(engine.dev, kv_bytes, &engine.v) || kvr_dev_alloc(engine.dev, q_bytes, &engine.out))
		die("engine device buffers", kvr_dev_last_error(engine.dev));
	engine.batch = batch;
}

static void engine_put(void *dst, const void *src, size_t bytes)
{
	if (kvr_dev_memcpy_async(engine.dev, dst, src, bytes, KVR_COPY_H2D, engine.stream))
		die("copy to the device", kvr_dev_last_error(engine.dev));
}

static struct kvr_context *make_ctx(uint32_t mode, uint32_t batch, uint64_t max_tokens)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_layers = g.sh.n_layers;
	c.n_qo_heads = g.sh.n_qo_heads;
	c.n_kv_heads = g.sh.n_kv_heads;
	c.head_dim = g.sh.head_dim;
	c.page_tokens = g.sh.page_tokens;
	c.dtype = KVR_DTYPE_F16;
	c.budget_tokens = g.budget;
	c.sink_tokens = g.sink;
	c.window_tokens = g.window;
	c.mode = mode;
	c.tau = 0.9f;
	c.estimate = mode == KVR_MODE_DENSE ? 0 : g.estimate;
	c.dense_layers[0] = 0;
	c.max_sequences = batch;
	c.max_batch = batch;
	c.recall = g.recall;
	c.recall_buffers = g.buffers;
	c.pool_layout = g.pool_layout;
	c.kv_format = g.kv_format;
	c.recall_chunk_pages = g.chunk_pages;
	c.controller = g.controller;
	c.backend = g.backend;
	const uint64_t page_bytes = 2ull * g.sh.page_tokens * g.sh.head_dim * g.sh.n_kv_heads * 2;
	c.pool_bytes = (max_tokens / g.sh.page_tokens + 64) * g.sh.n_layers * page_bytes * batch;
	if (g.spilled_pct >= 0 && mode != KVR_MODE_DENSE) {
		/* RAM for (100 - pct)% of the context's pages (0%: the tier is on
		 * and everything fits); the rest lives in the spill file. Dense
		 * contexts (the attention-over-B baseline) read every page in
		 * place and keep theirs in RAM. */
		const uint64_t pages = (max_tokens / g.sh.page_tokens + 1) * g.sh.n_layers * batch;
		const uint64_t ram_pages = pages * (uint64_t)(100 - g.spilled_pct) / 100;
		const uint64_t stored = g.kv_format ? kvr_kv_run_bytes(g.kv_format == KVR_KV_FORMAT_MIXED
									       ? KVR_KV_FORMAT_K8V4
									       : g.kv_format,
								       g.sh.page_tokens, g.sh.head_dim, 2) *
							      g.sh.n_kv_heads
						    : page_bytes;
		c.pool_ram_bytes = (ram_pages < 8 ? 8 : ram_pages) * stored;
		if (g.spill_dir)
			snprintf(c.spill_dir, sizeof(c.spill_dir), "%s", g.spill_dir);
	}
	struct kvr_context *ctx;
	if (kvr_context_create(&c, &ctx))
		die("context", kvr_last_error(NULL));
	struct kvr_config got;
	kvr_config_init(&got);
	if (!kvr_context_get_config(ctx, &got)) {
		g.resolved_controller = got.controller;
		g.resolved_recall = got.recall;
	}
	return ctx;
}

struct result {
	int not_capturable;                /* --capture: the configuration refuses capture (no row) */
	double us_per_layer;               /* the batch's step ÷ layers, median */
	double mean_us_per_layer;          /* the same, mean (the counters below are sums) */
	double critical_us_per_layer;      /* the engine's time inside decode_layer, mean */
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
	double host_waits_per_layer;       /* the engine's waits for the device per (step, layer) */
	double host_wait_share;            /* their time, of the engine's inside decode_layer */
	/* the controller's time per layer by part (kvr_stats' controller_*_ns) */
	double ctl_handoff_us, ctl_prepare_us, ctl_score_us, ctl_topk_us, ctl_recall_us;
};

/* The engine's capture of one step of the batch at positions `pos`
 * (recorded, nothing stored: docs/api.md, "Decode steps in a CUDA graph"),
 * on its capture stream. */
static struct kvr_graph *capture_step(struct kvr_context *ctx, const uint32_t *seqs, const uint64_t *pos,
				      uint32_t batch, uint64_t max_tokens, int32_t *status)
{
	void *native = kvr_dev_stream_native(engine.dev, engine.capture_stream);
	struct kvr_graph *graph = NULL;
	const int rc = kvr_decode_reserve(ctx, batch, max_tokens);
	if (rc == -ENOTSUP) {
		bench_progress_clear();
		fprintf(stderr, "not captured: %s\n", kvr_last_error(ctx));
		return NULL;
	}
	if (rc)
		die("decode_reserve", kvr_last_error(ctx));
	if (kvr_decode_begin(ctx, seqs, pos, batch))
		die("decode_begin", kvr_last_error(ctx));
	if (kvr_dev_stream_begin_capture(engine.dev, engine.capture_stream))
		die("begin capture", kvr_dev_last_error(engine.dev));
	for (uint32_t l = 0; l < g.sh.n_layers; l++)
		if (kvr_decode_layer(ctx, l, engine.q, engine.k, engine.v, engine.out, status, native))
			die("decode_layer (captured)", kvr_last_error(ctx));
	if (kvr_dev_stream_end_capture(engine.dev, engine.capture_stream, &graph))
		die("end capture", kvr_dev_last_error(engine.dev));
	if (kvr_decode_end(ctx))
		die("decode_end (captured)", kvr_last_error(ctx));
	return graph;
}

/* Prefill L tokens into each of `batch` sequences, then time `steps` decode
 * steps of the batch (tracing the last 4 into trace_path when it is set);
 * `captured`: the steps replay one captured step (cuda; where the
 * configuration refuses, no steps and .not_capturable). */
static struct result run(uint32_t mode, uint32_t batch, uint64_t L, uint32_t steps, const char *trace_path,
			 int captured)
{
	const uint32_t n_kv = g.sh.n_kv_heads, n_qo = g.sh.n_qo_heads, d = g.sh.head_dim, layers = g.sh.n_layers;
	struct kvr_context *ctx = make_ctx(mode, batch, L + steps);
	uint32_t *seqs = calloc(batch, sizeof(*seqs));
	uint64_t *pos = calloc(batch, sizeof(*pos));
	const uint32_t chunk = 4096;
	uint16_t *k = malloc((size_t)chunk * n_kv * d * 2), *v = malloc((size_t)chunk * n_kv * d * 2);
	float *qf = malloc((size_t)batch * n_qo * d * sizeof(float));
	uint16_t *q = malloc((size_t)batch * n_qo * d * 2), *out = malloc((size_t)batch * n_qo * d * 2);
	int32_t *status = calloc(batch, sizeof(*status));
	double *times = calloc(steps, sizeof(double));
	if (!seqs || !pos || !k || !v || !qf || !q || !out || !status || !times)
		die("memory", "out of memory");
	for (uint32_t b = 0; b < batch; b++) {
		if (kvr_seq_create(ctx, &seqs[b]))
			die("sequence", kvr_last_error(ctx));
		for (uint64_t at = 0; at < L; at += chunk) {
			const uint32_t n = L - at < chunk ? (uint32_t)(L - at) : chunk;
			for (size_t i = 0; i < (size_t)n * n_kv * d; i++) {
				k[i] = kvr_f32_to_f16(frand());
				v[i] = kvr_f32_to_f16(frand());
			}
			for (uint32_t l = 0; l < layers; l++)
				if (kvr_prefill(ctx, seqs[b], l, at, n, k, v))
					die("prefill", kvr_last_error(ctx));
		}
	}
	for (size_t i = 0; i < (size_t)batch * n_qo * d; i++)
		qf[i] = frand();
	struct kvr_graph *graph = NULL;
	if (captured) {
		for (uint32_t b = 0; b < batch; b++)
			pos[b] = L;
		graph = capture_step(ctx, seqs, pos, batch, L + steps, status);
		if (!graph) {
			free(times), free(k), free(v), free(qf), free(q), free(out), free(status), free(seqs), free(pos);
			kvr_context_destroy(ctx);
			return (struct result){ .not_capturable = 1 };
		}
	}
	struct kvr_stats st0 = { .size = sizeof(st0) }, st1 = { .size = sizeof(st1) };
	kvr_get_stats(ctx, &st0);
	for (uint32_t s = 0; s < steps; s++) {
		for (uint32_t h = 0; h < batch * n_qo; h++) {
			const int jump = s % 16 == 15 && h % 4 == 0;
			double norm = 0;
			for (uint32_t c = 0; c < d; c++) {
				float *x = &qf[(size_t)h * d + c];
				*x = jump ? frand() : 0.97f * *x + 0.25f * frand();
				norm += (double)*x * *x;
			}
			const float scale = (float)(4.0 / sqrt(norm)); /* |q| = 4: peaked softmax */
			for (uint32_t c = 0; c < d; c++)
				q[(size_t)h * d + c] = kvr_f32_to_f16(qf[(size_t)h * d + c] * scale);
		}
		for (size_t i = 0; i < (size_t)batch * n_kv * d; i++) {
			k[i] = kvr_f32_to_f16(frand());
			v[i] = kvr_f32_to_f16(frand());
		}
		for (uint32_t b = 0; b < batch; b++)
			pos[b] = L + s;
		if (trace_path && s + 4 == steps && kvr_trace_start(ctx, 1u << 16))
			die("trace", kvr_last_error(ctx));
		const void *lq = q, *lk = k, *lv = v;
		void *lout = out;
		if (engine.dev) { /* the engine's inputs are on the device before the step */
			engine_put(engine.q, q, (size_t)batch * n_qo * d * 2);
			engine_put(engine.k, k, (size_t)batch * n_kv * d * 2);
			engine_put(engine.v, v, (size_t)batch * n_kv * d * 2);
			if (kvr_dev_stream_synchronize(engine.dev, engine.stream))
				die("synchronise", kvr_dev_last_error(engine.dev));
			lq = engine.q, lk = engine.k, lv = engine.v, lout = engine.out;
		}
		const double t0 = bench_now_s();
		if (kvr_decode_begin(ctx, seqs, pos, batch))
			die("decode_begin", kvr_last_error(ctx));
		if (graph) { /* the host part, then the graph, on the capture stream */
			if (kvr_decode_replay(ctx, status, kvr_dev_stream_native(engine.dev, engine.capture_stream)))
				die("decode_replay", kvr_last_error(ctx));
			for (uint32_t b = 0; b < batch; b++)
				if (status[b])
					die(kvr_strerror(status[b]), kvr_last_error(ctx));
			if (kvr_dev_graph_launch(engine.dev, graph, engine.capture_stream))
				die("graph launch", kvr_dev_last_error(engine.dev));
			if (kvr_decode_end(ctx))
				die("decode_end", kvr_last_error(ctx));
			times[s] = bench_now_s() - t0;
			continue;
		}
		for (uint32_t l = 0; l < layers; l++) {
			if (kvr_decode_layer(ctx, l, lq, lk, lv, lout, status, NULL))
				die("decode_layer", kvr_last_error(ctx));
			for (uint32_t b = 0; b < batch; b++)
				if (status[b])
					die(kvr_strerror(status[b]), kvr_last_error(ctx));
		}
		kvr_decode_end(ctx);
		if (engine.dev && kvr_dev_stream_synchronize(engine.dev, engine.stream))
			die("synchronise", kvr_dev_last_error(engine.dev));
		times[s] = bench_now_s() - t0;
	}
	if (trace_path && kvr_trace_write(ctx, trace_path))
		die("trace", kvr_last_error(ctx));
	kvr_get_stats(ctx, &st1);
	const double crit = (double)(st1.critical_ns - st0.critical_ns);
	const double ctl = (double)(st1.controller_ns - st0.controller_ns);
	const double n_layers = (double)steps * layers;
	const uint64_t hits = st1.pages_hit - st0.pages_hit, miss = st1.pages_recalled - st0.pages_recalled;
	double sum = 0;
	for (uint32_t s = 0; s < steps; s++)
		sum += times[s];
	struct result r = {
		0,
		bench_median(times, steps) / layers * 1e6,
		sum / n_layers * 1e6,
		crit / n_layers / 1e3,
		st1.checked_heads > st0.checked_heads
			? (double)(st1.corrected_heads - st0.corrected_heads) /
				  (double)(st1.checked_heads - st0.checked_heads)
			: 0.0,
		st1.selections - st0.selections,
		(double)(st1.correction_waits - st0.correction_waits) / n_layers,
		crit > 0 ? (double)(st1.correction_wait_ns - st0.correction_wait_ns) / crit : 0,
		crit > 0 ? (double)(st1.controller_wait_ns - st0.controller_wait_ns) / crit : 0,
		crit > 0 ? (double)(st1.recall_wait_ns - st0.recall_wait_ns) / crit : 0,
		crit + ctl > 0 ? crit / (crit + ctl) : 1,
		ctl / n_layers / 1e3,
		hits + miss ? (double)hits / (double)(hits + miss) : 0,
		(double)(st1.bytes_recalled - st0.bytes_recalled) / n_layers / 1024.0,
		(double)(st1.host_waits - st0.host_waits) / n_layers,
		crit > 0 ? (double)(st1.host_wait_ns - st0.host_wait_ns) / crit : 0,
		(double)(st1.controller_handoff_ns - st0.controller_handoff_ns) / n_layers / 1e3,
		(double)(st1.controller_prepare_ns - st0.controller_prepare_ns) / n_layers / 1e3,
		(double)(st1.controller_score_ns - st0.controller_score_ns) / n_layers / 1e3,
		(double)(st1.controller_topk_ns - st0.controller_topk_ns) / n_layers / 1e3,
		(double)(st1.controller_recall_ns - st0.controller_recall_ns) / n_layers / 1e3,
	};
	free(times), free(k), free(v), free(qf), free(q), free(out), free(status), free(seqs), free(pos);
	if (graph)
		kvr_dev_graph_destroy(engine.dev, graph);
	kvr_context_destroy(ctx);
	return r;
}

#define DECODE_CMD "kvrecall bench decode"

static void decode_usage(FILE *f)
{
	fprintf(f,
		"usage: kvrecall bench decode [--backend cpu|cuda] [--preset llama-3.1-8b|qwen-2.5-7b|smollm2-135m]\n"
		"         [--kv-heads N --qo-heads N --head-dim D --layers N (default 4) --page-tokens P]\n"
		"         [--budget 2048] [--sink 512] [--window 512] [--batch 1[,4,...]] [--steps 24] [--rounds 1]\n"
		"         [--max-context 131072] [--mode M] [--recall auto|zero-copy|streamed] [--buffers 1|2]\n"
		"         [--chunk-pages 8] [--pool-layout hnd|nhd] [--controller auto|thread|inline]\n"
		"         [--kv-format f16|k8v4|k4v2|mixed[,...]] [--spilled PCT [--spill-dir DIR]]\n"
		"         [--quick] [--capture] [--estimate off|on|both] [--json FILE]\n"
		"         [--trace FILE [--trace-context 32768] [--trace-mode freekv]]\n"
		"  --mode M: dense, blocking, speculative or freekv (default: each in turn)\n"
		"  --batch LIST: up to 8 batch sizes, 1 to 4096; --steps 3 to 100000; --rounds 1 to 99\n"
		"  --max-context L: contexts 8192, 16384, ... up to L (8192 to 2^30 tokens)\n"
		"  --chunk-pages 1 to 4096; --spilled 0 to 99 (percent of the KV in the spill file)\n"
		"  --trace: only trace 4 steps at --trace-context tokens (1 to 2^30) and exit\n"
		"  --estimate: the sparse modes without (off, the default) or with (on) the estimate of\n"
		"             the pages not retrieved, or each row without then with it (both: the second\n"
		"             row's estimate_cost_ratio is its time over the first's)\n"
		"  --kv-format A,B,...: every row for each format, in every round; each row's\n"
		"             speed_over_first_kv_format is the median over the rounds of the first\n"
		"             format's step over its own, both from the same round\n"
		"  --rounds N: attention over B and every row N times in turn; each row reports the round\n"
		"             whose ratio to the budget is the median, the range over the rounds, and the\n"
		"             fastest step over the budget of the fastest attention over B\n"
		"  --capture (cuda): each row once more, its steps replayed from a CUDA graph (where the\n"
		"             configuration can be captured: not quantised pages with streamed recall,\n"
		"             nor the estimate or a spill tier)\n");
}

/* --mode (not auto) and --trace-mode (auto too): a mode by its name. The
 * cli_opt_* convention: 1 taken, 0 another option, -1 after a message. */
static int opt_mode(int argc, char **argv, int *i, const char *name, int allow_auto, uint32_t *mode)
{
	static const char *const with_auto[] = { "auto", "dense", "blocking", "speculative", "freekv", NULL };
	if (strcmp(argv[*i], name))
		return 0;
	const char *v = cli_value_of(DECODE_CMD, argc, argv, i);
	if (!v)
		return -1;
	if (allow_auto ? kvr_mode_parse(v, mode) : cli_mode_parse(v, mode))
		return cli_bad_choice(DECODE_CMD, name, v, allow_auto ? with_auto : cli_mode_names);
	return 1;
}

/* --kv-format A,B,...: up to 8 page formats into g.kv_formats (the same
 * convention). */
static int opt_kv_formats(int argc, char **argv, int *i)
{
	if (strcmp(argv[*i], "--kv-format"))
		return 0;
	const char *v = cli_value_of(DECODE_CMD, argc, argv, i);
	if (!v || cli_parse_name_list(DECODE_CMD, "--kv-format", v, kvr_kv_format_parse, cli_kv_format_names,
				      g.kv_formats, sizeof(g.kv_formats) / sizeof(g.kv_formats[0]), &g.n_kv_formats))
		return -1;
	g.kv_format = g.kv_formats[0];
	return 1;
}

int bench_decode(int argc, char **argv)
{
	static const char *const controller_names[] = { "auto", "thread", "inline", NULL };
	static const char *const pool_layout_names[] = { "hnd", "nhd", NULL }; /* KVR_POOL_HND, _NHD */
	static const char *const estimate_names[] = { "off", "on", "both", NULL };
	static const char *const backend_names[] = { "cpu", "cuda", NULL };
	const char *json_path = NULL, *trace_path = NULL;
	uint64_t trace_context = 32768, max_context = 131072;
	uint32_t trace_mode = KVR_MODE_FREEKV, steps = 24, only_mode = KVR_MODE_AUTO, layers_given = 0;
	uint32_t rounds = 1; /* --rounds: the whole set of rows that many times, alternating */
	uint32_t batches[8] = { 1 }, n_batches = 1;
	uint32_t estimate = 0, backend = 0, spilled = UINT32_MAX; /* off, cpu, no spill tier */
	g.sh = bench_presets[0];
	for (int i = 0; i < argc; i++) {
		const char *a = argv[i];
		if (cli_is_help(a)) {
			decode_usage(stdout);
			return CLI_EXIT_OK;
		}
		if (!strcmp(a, "--quick")) {
			steps = 8, max_context = 16384;
			continue;
		}
		if (!strcmp(a, "--capture")) {
			g.capture = 1;
			continue;
		}
		if (!strcmp(a, "--layers"))
			layers_given = 1;
		BENCH_TAKE_SHAPE_FLAG(DECODE_CMD, argc, argv, i, &g.sh)
		CLI_TAKE(cli_opt_str(DECODE_CMD, argc, argv, &i, "--json", &json_path))
		CLI_TAKE(cli_opt_str(DECODE_CMD, argc, argv, &i, "--trace", &trace_path))
		CLI_TAKE(cli_opt_str(DECODE_CMD, argc, argv, &i, "--spill-dir", &g.spill_dir))
		CLI_TAKE(cli_opt_u32(DECODE_CMD, argc, argv, &i, "--steps", 3, 100000, &steps))
		CLI_TAKE(cli_opt_u32(DECODE_CMD, argc, argv, &i, "--rounds", 1, 99, &rounds))
		CLI_TAKE(cli_opt_u64(DECODE_CMD, argc, argv, &i, "--max-context", 8192, 1u << 30, &max_context))
		CLI_TAKE(cli_opt_u64(DECODE_CMD, argc, argv, &i, "--trace-context", 1, 1u << 30, &trace_context))
		CLI_TAKE(cli_opt_u32(DECODE_CMD, argc, argv, &i, "--budget", 1, UINT32_MAX, &g.budget))
		CLI_TAKE(cli_opt_u32(DECODE_CMD, argc, argv, &i, "--sink", 0, UINT32_MAX - 1, &g.sink))
		CLI_TAKE(cli_opt_u32(DECODE_CMD, argc, argv, &i, "--window", 0, UINT32_MAX - 1, &g.window))
		CLI_TAKE(cli_opt_u32_list(DECODE_CMD, argc, argv, &i, "--batch", 1, 4096, batches, 8, &n_batches))
		CLI_TAKE(cli_opt_u32(DECODE_CMD, argc, argv, &i, "--buffers", 1, 2, &g.buffers))
		CLI_TAKE(cli_opt_u32(DECODE_CMD, argc, argv, &i, "--chunk-pages", 1, 4096, &g.chunk_pages))
		CLI_TAKE(cli_opt_u32(DECODE_CMD, argc, argv, &i, "--spilled", 0, 99, &spilled))
		CLI_TAKE(cli_opt_choice(DECODE_CMD, argc, argv, &i, "--recall", cli_recall_names, &g.recall))
		CLI_TAKE(cli_opt_choice(DECODE_CMD, argc, argv, &i, "--controller", controller_names, &g.controller))
		CLI_TAKE(cli_opt_choice(DECODE_CMD, argc, argv, &i, "--pool-layout", pool_layout_names,
					&g.pool_layout))
		CLI_TAKE(cli_opt_choice(DECODE_CMD, argc, argv, &i, "--estimate", estimate_names, &estimate))
		CLI_TAKE(cli_opt_choice(DECODE_CMD, argc, argv, &i, "--backend", backend_names, &backend))
		CLI_TAKE(opt_kv_formats(argc, argv, &i))
		CLI_TAKE(opt_mode(argc, argv, &i, "--mode", 0, &only_mode))
		CLI_TAKE(opt_mode(argc, argv, &i, "--trace-mode", 1, &trace_mode))
		return cli_usage_error(DECODE_CMD, "unknown option '%s'", a);
	}
	const uint32_t have_mode = only_mode != KVR_MODE_AUTO;
	g.estimate_off = estimate != 1, g.estimate_on = estimate != 0;
	g.backend = backend ? KVR_BACKEND_CUDA : KVR_BACKEND_CPU, g.backend_name = backend_names[backend];
	if (spilled != UINT32_MAX) /* the spill tier reads pages back through streamed recall */
		g.spilled_pct = (int32_t)spilled, g.recall = KVR_RECALL_STREAMED;
	if (!layers_given)
		g.sh.n_layers = 4;
	const uint32_t B = g.budget, p = g.sh.page_tokens;
	/* the configuration is checked by the library; a bad one stops here */
	{
		struct kvr_config c;
		kvr_config_init(&c);
		c.n_layers = g.sh.n_layers, c.n_qo_heads = g.sh.n_qo_heads, c.n_kv_heads = g.sh.n_kv_heads;
		c.head_dim = g.sh.head_dim, c.page_tokens = p, c.budget_tokens = B;
		c.sink_tokens = g.sink, c.window_tokens = g.window, c.max_batch = c.max_sequences = batches[0];
		char why[512];
		if (kvr_config_validate(&c, why, sizeof(why))) {
			fprintf(stderr, "kvrecall bench decode: %s\n", why);
			return 2;
		}
	}
	if (g.capture && g.backend != KVR_BACKEND_CUDA) {
		fprintf(stderr, "kvrecall bench decode: --capture needs --backend cuda (CUDA graphs)\n");
		return 2;
	}
	if (!g.n_kv_formats)
		g.kv_formats[g.n_kv_formats++] = g.kv_format;
	const uint32_t n_fmt = g.n_kv_formats;
	uint32_t max_batch = 0;
	for (uint32_t bi = 0; bi < n_batches; bi++)
		max_batch = batches[bi] > max_batch ? batches[bi] : max_batch;
	if (g.backend == KVR_BACKEND_CUDA)
		engine_fit(max_batch);
	if (trace_path) {
		run(trace_mode, batches[0], trace_context, steps, trace_path, 0);
		fprintf(stderr, "kvrecall bench decode: trace of %s at %llu tokens (%s recall) in %s\n",
			kvr_mode_name(trace_mode), (unsigned long long)trace_context,
			kvr_recall_name(g.resolved_recall), trace_path);
		return 0;
	}
	FILE *json = json_path ? fopen(json_path, "w") : stdout;
	if (!json) {
		fprintf(stderr, "kvrecall bench decode: cannot write %s: %s\n", json_path, strerror(errno));
		return 1;
	}
	static const uint32_t modes[] = { KVR_MODE_DENSE, KVR_MODE_BLOCKING, KVR_MODE_SPECULATIVE, KVR_MODE_FREEKV };
	/* The rows of one batch, in order: each context, then each mode, then
	 * (--capture) its captured replay, then (--estimate) without and with. */
	struct row_key {
		uint64_t L;
		uint32_t mode;
		int captured;
		uint32_t estimate;
	} *keys = NULL;
	uint32_t n_keys = 0, n_contexts = 0;
	for (uint64_t L = 8192; L <= max_context && L; L *= 2)
		n_contexts++;
	keys = calloc((size_t)n_contexts * 16 + 1, sizeof(*keys));
	if (!keys) {
		fprintf(stderr, "kvrecall bench decode: out of memory\n");
		return 1;
	}
	for (uint64_t L = 8192; L <= max_context && L; L *= 2)
		for (size_t x = 0; x < 16; x++) {
			const size_t mi = x / 4;
			const int captured = x / 2 % 2;
			const uint32_t estimate = x % 2, mode = modes[mi];
			if ((have_mode && mode != only_mode) || (captured && !g.capture) ||
			    (estimate ? !g.estimate_on : !g.estimate_off))
				continue;
			if (estimate && mode == KVR_MODE_DENSE)
				continue; /* dense attends every page: nothing to estimate */
			keys[n_keys++] = (struct row_key){ L, mode, captured, estimate };
		}
	const uint32_t total = n_batches * rounds * n_fmt * (1 + n_keys);
	/* per format, row and round (RES); bases: attention over B per format
	 * and round (BASE) */
	struct result *res = calloc((size_t)n_fmt * n_keys * rounds, sizeof(*res));
	struct result *bases = calloc((size_t)n_fmt * rounds, sizeof(*bases));
	double *ratios = calloc(rounds, sizeof(double)), *sorted = calloc(rounds, sizeof(double));
#define RES(f, i, rd) res[((size_t)(f) * n_keys + (i)) * rounds + (rd)]
#define BASE(f, rd) bases[(size_t)(f) * rounds + (rd)]
	if (!res || !bases || !ratios || !sorted) {
		fprintf(stderr, "kvrecall bench decode: out of memory\n");
		return 1;
	}
	uint32_t done = 0;
	bench_json_open(json, "decode", g.backend_name, argc, argv);
	fprintf(json, "  \"shape\": ");
	bench_shape_json(json, &g.sh);
	fprintf(json, ",\n  \"params\": {\"budget_tokens\": %u, \"sink_tokens\": %u, \"window_tokens\": %u, "
		      "\"steps\": %u, \"rounds\": %u, \"tau\": 0.9, \"recall\": \"%s\", \"recall_buffers\": %u, "
		      "\"chunk_pages\": %u, \"pool_layout\": \"%s\", \"kv_format\": \"%s\", \"spilled_pct\": %d, "
		      "\"kv_formats\": [",
		B, g.sink, g.window, steps, rounds, kvr_recall_name(g.recall), g.buffers, g.chunk_pages,
		g.pool_layout == KVR_POOL_NHD ? "nhd" : "hnd", bench_kv_format_label(g.kv_formats[0]), g.spilled_pct);
	for (uint32_t f = 0; f < n_fmt; f++)
		fprintf(json, "%s\"%s\"", f ? ", " : "", bench_kv_format_label(g.kv_formats[f]));
	fprintf(json, "]},\n  \"results\": [\n");
	int first = 1;
	for (uint32_t bi = 0; bi < n_batches; bi++) {
		const uint32_t batch = batches[bi];
		/* Each round: attention over the B tokens alone (a dense decode at
		 * L = B), then every row; a row's ratio in a round is to that
		 * round's attention, so a machine that slows down for a while
		 * moves both sides of it. */
		for (uint32_t rd = 0; rd < rounds; rd++)
			for (uint32_t f = 0; f < n_fmt; f++) {
				g.kv_format = g.kv_formats[f];
				bench_progress("decode", done++, total);
				BASE(f, rd) = run(KVR_MODE_DENSE, batch, B - 1, steps, NULL, 0);
				for (uint32_t i = 0; i < n_keys; i++) {
					bench_progress("decode", done++, total);
					g.estimate = keys[i].estimate;
					RES(f, i, rd) = run(keys[i].mode, batch, keys[i].L, steps, NULL, keys[i].captured);
				}
			}
		bench_progress_clear();
		for (uint32_t f = 0; f < n_fmt; f++) {
			const char *fmt_name = bench_kv_format_label(g.kv_formats[f]);
			for (uint32_t rd = 0; rd < rounds; rd++)
				ratios[rd] = BASE(f, rd).us_per_layer;
			/* the lower middle of an even count, as the rows take theirs */
			qsort(ratios, rounds, sizeof(double), bench_cmp_double);
			fprintf(stderr, "batch %u, %s: attention over B = %u tokens: %.1f us per layer (%u layers, %u steps%s)\n",
				batch, fmt_name, B, ratios[(rounds - 1) / 2], g.sh.n_layers, steps,
				rounds > 1 ? "; the median of the rounds" : "");
			uint32_t without = 0; /* the row an estimate row is priced against */
			for (uint32_t i = 0; i < n_keys; i++) {
				const struct row_key *k = &keys[i];
				const double budget_factor = 1.0 + (double)k->L / ((double)p * B);
				/* The row's round: the one whose ratio to the budget is the
				 * median (the lower one of an even count), so every field of
				 * the row comes from one run and they agree with each other. */
				uint32_t rep = 0, n_ok = 0;
				double lo = 0, hi = 0, fastest = 0, fastest_base = 0;
				for (uint32_t rd = 0; rd < rounds; rd++) {
					const struct result *r = &RES(f, i, rd);
					if (r->not_capturable)
						continue;
					const double x = r->us_per_layer / (budget_factor * BASE(f, rd).us_per_layer);
					ratios[n_ok++] = x;
					lo = n_ok == 1 || x < lo ? x : lo;
					hi = n_ok == 1 || x > hi ? x : hi;
					/* each side at its least disturbed, whichever round */
					fastest = n_ok == 1 || r->us_per_layer < fastest ? r->us_per_layer : fastest;
					fastest_base = n_ok == 1 || BASE(f, rd).us_per_layer < fastest_base ? BASE(f, rd).us_per_layer
													    : fastest_base;
				}
				if (!n_ok)
					continue; /* the configuration refuses capture */
				memcpy(sorted, ratios, n_ok * sizeof(double));
				qsort(sorted, n_ok, sizeof(double), bench_cmp_double);
				const double sorted_mid = sorted[(n_ok - 1) / 2];
				for (uint32_t rd = 0, j = 0; rd < rounds; rd++) {
					if (RES(f, i, rd).not_capturable)
						continue;
					if (ratios[j++] == sorted_mid) {
						rep = rd;
						break;
					}
				}
				const struct result *r = &RES(f, i, rep);
				const struct result *base = &BASE(f, rep);
				if (!k->estimate)
					without = i;
				/* the estimate's cost: this row over the same row without it */
				const double cost = k->estimate && g.estimate_off
							    ? r->us_per_layer / RES(f, without, rep).us_per_layer
							    : 0.0;
				/* over the first format: per round, its step over this
				 * one, both of that round; the median of those (ratios is
				 * free again: the row's round is chosen) */
				uint32_t n_pair = 0;
				for (uint32_t rd = 0; rd < rounds; rd++)
					if (!RES(f, i, rd).not_capturable && !RES(0, i, rd).not_capturable)
						sorted[n_pair++] = RES(0, i, rd).us_per_layer / RES(f, i, rd).us_per_layer;
				qsort(sorted, n_pair, sizeof(double), bench_cmp_double);
				const double speed_over_first = n_pair ? sorted[(n_pair - 1) / 2] : 0.0;
				const double budget = budget_factor * base->us_per_layer;
				if (n_fmt > 1)
					fprintf(stderr, "%s: ", fmt_name);
				fprintf(stderr, "L=%7llu %-11s%s%s %9.1f us/layer = %5.2f x attention-over-B, %5.2f x (1+L/(pB)) "
						"budget%s; mean %.1f, critical path %.1f us/layer; corrected %.1f%% of heads; correction "
						"waits %.2f/layer (%.0f%% of engine time); controller %.0f us/layer beside, "
						"critical share %.2f (handoff %.0f, prepare %.0f, score %.0f, top-k %.0f, recall %.0f us); "
						"hit rate %.2f, %.0f KiB recalled/layer; %.2f host waits/layer\n",
					(unsigned long long)k->L, kvr_mode_name(k->mode), k->captured ? " (captured)" : "",
					k->estimate ? " +estimate" : "", r->us_per_layer, r->us_per_layer / base->us_per_layer,
					r->us_per_layer / budget, rounds > 1 ? " (the median round)" : "", r->mean_us_per_layer,
					r->critical_us_per_layer, 100 * r->corrected_rate, r->correction_waits_per_layer,
					100 * r->correction_wait_share, r->controller_us_per_layer, r->critical_share,
					r->ctl_handoff_us, r->ctl_prepare_us, r->ctl_score_us, r->ctl_topk_us, r->ctl_recall_us,
					r->hit_rate, r->recalled_kib_per_layer, r->host_waits_per_layer);
				const double of_minima = fastest / (budget_factor * fastest_base);
				if (rounds > 1)
					fprintf(stderr, "          over %u rounds: %.2f to %.2f x the budget; fastest step %.1f us/layer, "
							"%.2f x the budget from the fastest attention over B\n",
						n_ok, lo, hi, fastest, of_minima);
				if (f)
					fprintf(stderr, "          %.2f x %s's speed (the median over %u rounds of the same round's ratio)\n",
						speed_over_first, bench_kv_format_label(g.kv_formats[0]), n_pair);
				fprintf(json,
					"%s    {\"batch\": %u, \"context_tokens\": %llu, \"mode\": \"%s\", \"captured\": %s, \"recall\": \"%s\", "
					"\"controller\": \"%s\", \"us_per_layer\": %.2f, \"attention_over_budget_us\": %.2f, "
					"\"ratio_to_attention_over_budget\": %.4f, \"ratio_to_target_budget\": %.4f, "
					"\"rounds\": %u, \"ratio_to_target_budget_min\": %.4f, \"ratio_to_target_budget_max\": %.4f, "
					"\"fastest_us_per_layer\": %.2f, \"fastest_attention_over_budget_us\": %.2f, "
					"\"ratio_of_fastest_to_target_budget\": %.4f, "
					"\"mean_us_per_layer\": %.2f, \"critical_us_per_layer\": %.2f, "
					"\"corrected_head_rate\": %.4f, \"selections\": %llu, "
					"\"correction_waits_per_layer\": %.4f, \"correction_wait_share\": %.4f, "
					"\"controller_wait_share\": %.4f, \"recall_wait_share\": %.4f, "
					"\"critical_share\": %.4f, \"controller_us_per_layer\": %.2f, "
					"\"hit_rate\": %.4f, \"recalled_kib_per_layer\": %.2f, "
					"\"host_waits_per_layer\": %.4f, \"host_wait_share\": %.4f, "
					"\"controller_split_us_per_layer\": {\"handoff\": %.2f, \"prepare\": %.2f, "
					"\"score\": %.2f, \"topk\": %.2f, \"recall\": %.2f}, "
					"\"estimate\": %s, \"estimate_cost_ratio\": %.4f, \"kv_format\": \"%s\", "
					"\"speed_over_first_kv_format\": %.4f}",
					first ? "" : ",\n", batch, (unsigned long long)k->L, kvr_mode_name(k->mode),
					k->captured ? "true" : "false", kvr_recall_name(g.resolved_recall),
					kvr_controller_name(g.resolved_controller), r->us_per_layer, base->us_per_layer,
					r->us_per_layer / base->us_per_layer, r->us_per_layer / budget, n_ok, lo, hi, fastest,
					fastest_base, of_minima,
					r->mean_us_per_layer, r->critical_us_per_layer, r->corrected_rate,
					(unsigned long long)r->selections, r->correction_waits_per_layer, r->correction_wait_share,
					r->controller_wait_share, r->recall_wait_share, r->critical_share, r->controller_us_per_layer,
					r->hit_rate, r->recalled_kib_per_layer, r->host_waits_per_layer, r->host_wait_share,
					r->ctl_handoff_us, r->ctl_prepare_us, r->ctl_score_us, r->ctl_topk_us, r->ctl_recall_us,
					k->estimate ? "true" : "false", cost, fmt_name, speed_over_first);
				first = 0;
			}
		}
	}
#undef RES
#undef BASE
	free(res), free(bases), free(ratios), free(sorted), free(keys);
	bench_progress("decode", total, total);
	fprintf(json, "\n  ]\n");
	bench_json_close(json);
	return 0;
}
