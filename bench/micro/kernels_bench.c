/* SPDX-License-Identifier: MIT */
/*
 * kernels_bench.c — the cpu backend's decode kernels against the memory system,
 * as ratios measured in the same run:
 *
 *   attention  sparse decode attention over B tokens per KV head gathered from
 *              HND pages scattered over a pool of at least 128 MiB (Llama-3.1-8B
 *              shapes: 8 KV heads, 32 query heads, d = 128, f16, p = 32), a batch
 *              of sequences per call (by default at least 8 and enough that the K
 *              and V read per call span twice the last-level cache: a decode
 *              step's layers read different pages, so the kernel meets DRAM,
 *              not cache); bytes of K and V read per second divided by
 *              (a) a read-only pass over the same page list ("gather-read") and
 *              (b) a read-only pass over one contiguous buffer of the same size
 *              ("sequential read"), each with the same number of threads;
 *   selection  score + top-k time per layer against the number of pages, for
 *              contexts of 2K to 1M tokens, beside attention over the B tokens,
 *              and per byte: summary bytes read per second divided by
 *              attention's K+V bytes per second with the same threads.
 *
 * Like pool_bench it drives internals (gpu/backend.h), so it links the static
 * library. Output: a table on stderr and JSON (--json FILE or stdout).
 *
 * Threads: the calling thread plus the device's workers (--threads).
 */
#include <errno.h>
#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "kvrecall.h"
#include "../bench_common.h"
#include "../bench_shape.h"
#include "../../gpu/backend.h"
#include "../../gpu/cpu/cpu_backend.h"
#include "../../layouts/convert.h"
#include "../../layouts/half.h"


static uint64_t rng_state = 0x853c49e6748fea9bull;
static uint32_t rng(void)
{
	rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
	return (uint32_t)(rng_state >> 33);
}




/* ------------------------------------------------------------------ read passes */

struct read_job {
	const unsigned char *const *runs; /* run addresses */
	uint32_t n_runs;
	uint64_t run_bytes;
	uint32_t tasks;
	float sink[64];
};

/* Read every byte once with wide loads, no stores: the bandwidth a kernel that
 * reads the same bytes could at best have. */
__attribute__((target("avx2"))) static float read_bytes(const unsigned char *p, uint64_t n)
{
	__m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
	for (uint64_t i = 0; i + 64 <= n; i += 64) {
		a = _mm256_add_ps(a, _mm256_load_ps((const float *)(p + i)));
		b = _mm256_add_ps(b, _mm256_load_ps((const float *)(p + i + 32)));
	}
	a = _mm256_add_ps(a, b);
	float out[8];
	_mm256_storeu_ps(out, a);
	return out[0] + out[7];
}

static void read_task(void *arg, uint32_t t)
{
	struct read_job *job = arg;
	const uint32_t per = (job->n_runs + job->tasks - 1) / job->tasks;
	const uint32_t first = t * per, last = first + per < job->n_runs ? first + per : job->n_runs;
	float s = 0.0f;
	for (uint32_t i = first; i < last; i++) {
		if (i + 1 < last)
			for (uint64_t l = 0; l < 1024; l += 64)
				__builtin_prefetch(job->runs[i + 1] + l, 0, 0);
		s += read_bytes(job->runs[i], job->run_bytes);
	}
	job->sink[t % 64] = s;
}

/* ------------------------------------------------------------------ FMA peak */

/* The machine's fused multiply-add rate with 16-float vectors: attention does
 * 2·G·d multiply-adds per token and KV head, so this bounds what any kernel
 * can reach when compute, not memory, is the limit. 10 independent chains
 * cover the FMA latency. */
#define FMA_CHAINS 10

struct fma_job {
	uint64_t iterations;
	float sink[64];
};

/* One chain kernel per vector width. The chains are unrolled so they live in
 * registers: a loop over an array would go through memory and measure store
 * forwarding instead. The result only keeps the work alive. */
#define FMA_CHAINS_FN(name, target_isa, vec, set1, fmadd, add, first_lane)                  \
	__attribute__((target(target_isa))) static float name(uint64_t n)                   \
	{                                                                                   \
		vec a[FMA_CHAINS];                                                          \
		for (int i = 0; i < FMA_CHAINS; i++)                                        \
			a[i] = set1(1.0f + (float)i * 1e-7f);                               \
		const vec b = set1(0.9999999f), c = set1(1e-7f);                            \
		for (uint64_t i = 0; i < n; i++) {                                          \
			_Pragma("GCC unroll 16") for (int j = 0; j < FMA_CHAINS; j++)       \
				a[j] = fmadd(a[j], b, c);                                   \
		}                                                                           \
		vec r = a[0];                                                               \
		for (int j = 1; j < FMA_CHAINS; j++)                                        \
			r = add(r, a[j]);                                                   \
		return first_lane(r);                                                       \
	}
FMA_CHAINS_FN(fma_chains_avx512, "avx512f", __m512, _mm512_set1_ps, _mm512_fmadd_ps,
	      _mm512_add_ps, _mm512_cvtss_f32)
FMA_CHAINS_FN(fma_chains_avx2, "avx2,fma", __m256, _mm256_set1_ps, _mm256_fmadd_ps,
	      _mm256_add_ps, _mm256_cvtss_f32)
#undef FMA_CHAINS_FN

static void fma_task(void *arg, uint32_t t)
{
	struct fma_job *job = arg;
	job->sink[t % 64] = kvr_convert_isa_active() >= KVR_CONVERT_AVX512 ? fma_chains_avx512(job->iterations)
									     : fma_chains_avx2(job->iterations);
}

/* Scalar multiply-adds per second across `threads` threads (16 per zmm FMA;
 * the AVX2 path counts 8 per ymm FMA, i.e. the same 16 per pair). */
static double fma_peak(struct kvr_dev *dev, uint32_t threads)
{
	struct fma_job job = { 20000000, { 0 } };
	const double t0 = bench_now_s();
	kvr_cpu_parallel_for(dev, fma_task, &job, threads);
	const double s = bench_now_s() - t0;
	const double per_iter = FMA_CHAINS * (kvr_convert_isa_active() >= KVR_CONVERT_AVX512 ? 16.0 : 8.0);
	return (double)job.iterations * per_iter * threads / s;
}

/* ------------------------------------------------------------------ main */

struct options {
	uint32_t threads[4], n_threads;
	uint32_t budget_tokens;
	uint32_t batch;
	uint64_t pool_bytes;
	uint32_t reps;
	uint32_t skip_selection;
	uint32_t softmax_candidates; /* 1: each head's softmax over the candidates only */
	int isa;                     /* -1: the best the CPU has */
	uint32_t kv_format;          /* the attention pages' format (kvquant.h): 0 plain f16 */
	struct bench_shape sh;       /* --preset or the shape flags (bench_shape.h) */
	const char *json_path;
};

static void usage(void)
{
	fprintf(stderr, "usage: kernels_bench [--preset llama-3.1-8b|qwen-2.5-7b|smollm2-135m] "
			"[--kv-heads N --qo-heads N --head-dim D --page-tokens P] [--threads 1,2] "
			"[--budget 2048] [--batch N (default: 8, or more to span 2x the LLC)] [--pool-mib 256] [--reps 9] [--skip-selection] "
			"[--isa scalar|avx2|avx512|avx512vnni] [--kv-format f16|k8v4|k4v2] [--softmax all|candidates] "
			"[--json FILE]\n");
}


/* A cpu device running its kernels on `threads` threads (the caller's and
 * threads - 1 workers), with one stream; nonzero after a message. */
static int open_cpu(uint32_t threads, struct kvr_dev **dev, struct kvr_stream **stream)
{
	struct kvr_dev_params dp = { .kind = KVR_DEV_CPU, .threads = threads ? threads - 1 : 0 };
	char err[256] = "out of memory";
	if (kvr_dev_create(&dp, dev, err, sizeof(err)) == 0) {
		if (kvr_dev_stream_create(*dev, 0, stream) == 0)
			return 0;
		snprintf(err, sizeof(err), "%s", kvr_dev_last_error(*dev));
		kvr_dev_destroy(*dev);
	}
	fprintf(stderr, "kernels_bench: %s\n", err);
	return 1;
}

int main(int argc, char **argv)
{
	struct options opt = { .budget_tokens = 2048, .batch = 0, .pool_bytes = 256ull << 20, .reps = 9,
			       .isa = -1, .sh = bench_presets[0] };
	opt.threads[0] = 1, opt.threads[1] = 2, opt.n_threads = 2;
	for (int i = 1; i < argc; i++) {
		const int shape_flag = bench_shape_flag("kernels_bench", argc, argv, &i, &opt.sh);
		if (shape_flag < 0)
			return usage(), 2;
		if (shape_flag)
			continue;
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(a, "--threads") && v) {
			if (bench_parse_list(v, opt.threads, 4, &opt.n_threads))
				return usage(), 2;
			i++;
		} else if (!strcmp(a, "--budget") && v) {
			opt.budget_tokens = (uint32_t)atoi(v), i++;
		} else if (!strcmp(a, "--batch") && v) {
			opt.batch = (uint32_t)atoi(v), i++;
		} else if (!strcmp(a, "--pool-mib") && v) {
			opt.pool_bytes = strtoull(v, NULL, 10) << 20, i++;
		} else if (!strcmp(a, "--reps") && v) {
			opt.reps = (uint32_t)atoi(v), i++;
		} else if (!strcmp(a, "--skip-selection")) {
			opt.skip_selection = 1;
		} else if (!strcmp(a, "--isa") && v) {
			/* every kernel path, not only the best this CPU has */
			enum kvr_convert_isa isa;
			if (kvr_convert_isa_parse(v, &isa))
				return usage(), 2;
			opt.isa = (int)isa, i++;
		} else if (!strcmp(a, "--kv-format") && v) {
			if (!strcmp(v, "f16"))
				opt.kv_format = KVR_KV_PLAIN;
			else if (!strcmp(v, "k8v4"))
				opt.kv_format = KVR_KV_K8V4;
			else if (!strcmp(v, "k4v2"))
				opt.kv_format = KVR_KV_K4V2;
			else
				return usage(), 2;
			i++;
		} else if (!strcmp(a, "--softmax") && v) {
			/* the group-consistency domain: every page
			 * (what the scheduler does) or the candidates only */
			if (strcmp(v, "all") && strcmp(v, "candidates"))
				return usage(), 2;
			opt.softmax_candidates = !strcmp(v, "candidates"), i++;
		} else if (!strcmp(a, "--json") && v) {
			opt.json_path = v, i++;
		} else {
			return usage(), 2;
		}
	}
	if (opt.reps < 3)
		opt.reps = 3;
	if (opt.isa >= 0 && kvr_convert_isa_force((enum kvr_convert_isa)opt.isa) != (enum kvr_convert_isa)opt.isa) {
		fprintf(stderr, "kernels_bench: this CPU lacks %s\n",
			kvr_convert_isa_name((enum kvr_convert_isa)opt.isa));
		return 1;
	}
	const uint32_t n_kv = opt.sh.n_kv_heads, n_qo = opt.sh.n_qo_heads, d = opt.sh.head_dim;
	const uint32_t p = opt.sh.page_tokens;
	if (!n_kv || n_qo % n_kv || n_qo / n_kv > KVR_MAX_GROUP || d % 32 || d > 256 || !p ||
	    opt.budget_tokens < 1024 + p || opt.budget_tokens % p) {
		fprintf(stderr, "kernels_bench: shape %u/%u heads, d %u, p %u with B %u: need groups of at most "
				"%u, d a multiple of 32 up to 256, and B a multiple of p above 1024\n",
			n_qo, n_kv, d, p, opt.budget_tokens, KVR_MAX_GROUP);
		return 2;
	}
	const uint32_t t = KVR_ELEM_F16;
	/* a page's KV head run: plain f16 rows, or a quantised run (kvquant.h) */
	struct kvr_quant_geometry qg = { 0 };
	if (opt.kv_format && kvr_quant_geometry_init(&qg, p, d, n_kv, opt.kv_format)) {
		fprintf(stderr, "kernels_bench: d %u cannot be quantised (a multiple of 16)\n", d);
		return 2;
	}
	const uint64_t head_bytes = opt.kv_format ? qg.head_bytes : 2ull * p * d * 2, page_bytes = head_bytes * n_kv;
	const uint32_t n_pages = (uint32_t)(opt.pool_bytes / page_bytes);
	const uint32_t pages_per_seq = opt.budget_tokens / p;

	struct kvr_system_info sys = { .size = sizeof(sys) };
	kvr_system_query(&sys);
	if (!opt.batch) { /* small shapes (SmolLM2: 1.5 MiB per sequence) would sit in the LLC */
		const uint64_t seq_bytes = (uint64_t)pages_per_seq * n_kv * head_bytes;
		const uint64_t llc = sys.l3_bytes ? sys.l3_bytes : 32ull << 20;
		opt.batch = (uint32_t)((2 * llc + seq_bytes - 1) / seq_bytes);
		if (opt.batch < 8)
			opt.batch = 8;
	}
	fprintf(stderr, "kernels_bench: %s, %u cores, pool %llu MiB (%u pages of %llu KiB), B=%u, batch %u, "
			"kernels %s\n",
		sys.cpu_model, sys.n_cores, (unsigned long long)(opt.pool_bytes >> 20), n_pages,
		(unsigned long long)(page_bytes >> 10), opt.budget_tokens, opt.batch,
		kvr_convert_isa_name(kvr_convert_isa_active()));

	/* The pool: HND pages of random f16 values in [-1, 1). */
	unsigned char *pool = bench_huge_alloc("kernels_bench", (size_t)n_pages * page_bytes);
	for (uint64_t i = 0; i < (uint64_t)n_pages * page_bytes / 2; i++)
		((uint16_t *)pool)[i] = kvr_f32_to_f16((float)((int32_t)(rng() % 2048) - 1024) / 1024.0f);
	/* quantised: those bytes are the codes; every (s, z) as [-1, 1] gives */
	for (uint64_t r = 0; opt.kv_format && r < (uint64_t)n_pages * n_kv; r++)
		for (uint32_t tok = 0; tok < p; tok++) {
			uint16_t *ksz = kvr_quant_key_sz(&qg, pool + r * head_bytes, tok);
			uint16_t *vsz = kvr_quant_value_sz(&qg, pool + r * head_bytes, tok);
			ksz[0] = kvr_f32_to_f16(2.0f / (float)((1u << qg.key_bits) - 1u)), ksz[1] = kvr_f32_to_f16(1.0f);
			vsz[0] = kvr_f32_to_f16(2.0f / (float)((1u << qg.value_bits) - 1u)), vsz[1] = kvr_f32_to_f16(1.0f);
		}
	unsigned char *seq_buf = bench_huge_alloc("kernels_bench", (size_t)opt.batch * pages_per_seq * n_kv * head_bytes);
	memset(seq_buf, 1, (size_t)opt.batch * pages_per_seq * n_kv * head_bytes);

	/* Per sequence: B/p random pages, as segments (HND: row stride d, head stride 2pd). */
	const uint32_t n_segs = opt.batch * pages_per_seq;
	struct kvr_kv_segment *segs = calloc(n_segs, sizeof(*segs));
	struct kvr_attention_item *items = calloc(opt.batch, sizeof(*items));
	const unsigned char **runs = calloc((size_t)n_segs * n_kv, sizeof(*runs));
	uint16_t *q = bench_huge_alloc("kernels_bench", (size_t)opt.batch * n_qo * d * 2), *out = bench_huge_alloc("kernels_bench", (size_t)opt.batch * n_qo * d * 2);
	for (uint64_t i = 0; i < (uint64_t)opt.batch * n_qo * d; i++)
		q[i] = kvr_f32_to_f16((float)((int32_t)(rng() % 2048) - 1024) / 1024.0f);
	for (uint32_t s = 0; s < opt.batch; s++) {
		items[s] = (struct kvr_attention_item){ q + (uint64_t)s * n_qo * d, out + (uint64_t)s * n_qo * d,
							NULL, s * pages_per_seq, pages_per_seq };
		for (uint32_t j = 0; j < pages_per_seq; j++) {
			const unsigned char *page = pool + (uint64_t)(rng() % n_pages) * page_bytes;
			segs[s * pages_per_seq + j] = (struct kvr_kv_segment){ page, page + (uint64_t)p * d * 2, p, { d },
									      2 * p * d, 0 };
			if (opt.kv_format)
				segs[s * pages_per_seq + j] = (struct kvr_kv_segment){
					.k = page, .n_tokens = p, .head_stride = (uint32_t)head_bytes, .format = opt.kv_format };
			for (uint32_t m = 0; m < n_kv; m++)
				runs[((uint64_t)s * pages_per_seq + j) * n_kv + m] = page + m * head_bytes;
		}
	}
	const uint64_t kv_bytes = (uint64_t)n_segs * n_kv * head_bytes;
	const struct kvr_shape shape = { n_qo, n_kv, d, p, t, 1.0f / sqrtf((float)d), 0.9f, 0, 0, 0, 0 };

	FILE *json = opt.json_path ? fopen(opt.json_path, "w") : stdout;
	if (!json) {
		fprintf(stderr, "kernels_bench: cannot write %s: %s\n", opt.json_path, strerror(errno));
		return 1;
	}
	fprintf(json, "{\n  \"benchmark\": \"kernels\",\n  \"kvrecall_version\": \"%s\",\n", kvr_version_string());
	fprintf(json, "  \"machine\": {\"cpu\": \"%s\", \"cores\": %u, \"llc_bytes\": %llu, \"isa\": \"%s\"},\n",
		sys.cpu_model, sys.n_cores, (unsigned long long)sys.l3_bytes,
		kvr_convert_isa_name(kvr_convert_isa_active()));
	fprintf(json, "  \"shape\": {\"preset\": \"%s\", \"n_kv_heads\": %u, \"n_qo_heads\": %u, \"head_dim\": %u, "
		      "\"page_tokens\": %u, \"dtype\": \"f16\", \"kv_format\": \"%s\", \"quant_dots\": \"%s\", "
		      "\"budget_tokens\": %u, \"batch\": %u, \"pool_bytes\": %llu, \"softmax\": \"%s\"},\n",
		opt.sh.preset, n_kv, n_qo, d, p,
		opt.kv_format == KVR_KV_K8V4 ? "k8v4" : opt.kv_format == KVR_KV_K4V2 ? "k4v2" : "f16",
		kvr_cpu_quant_float_dots() ? "float" : "integer", opt.budget_tokens, opt.batch,
		(unsigned long long)opt.pool_bytes, opt.softmax_candidates ? "candidates" : "all");
	fprintf(json, "  \"attention\": [\n");

	double attention_1t_s = 0;
	double attention_last_gbps = 0; /* with the thread count selection runs with */
	for (uint32_t ti = 0; ti < opt.n_threads; ti++) {
		const uint32_t threads = opt.threads[ti];
		struct kvr_dev *dev;
		struct kvr_stream *stream;
		if (open_cpu(threads, &dev, &stream))
			return 1;
		struct read_job gather = { runs, n_segs * n_kv, head_bytes, threads, { 0 } };
		const unsigned char *seq_runs[1] = { seq_buf };
		struct read_job seq = { seq_runs, 1, kv_bytes, 1, { 0 } };
		/* sequential: split the one buffer into `threads` runs */
		const unsigned char **seq_split = calloc(threads, sizeof(*seq_split));
		for (uint32_t i = 0; i < threads; i++)
			seq_split[i] = seq_buf + (uint64_t)i * (kv_bytes / threads);
		seq = (struct read_job){ seq_split, threads, kv_bytes / threads, threads, { 0 } };

		double *ta = calloc(opt.reps, sizeof(double)), *tg = calloc(opt.reps, sizeof(double));
		double *ts = calloc(opt.reps, sizeof(double));
		for (int warm = 0; warm < 2; warm++) {
			kvr_dev_attention(dev, &shape, items, opt.batch, segs, n_segs, stream);
			kvr_cpu_parallel_for(dev, read_task, &gather, threads);
		}
		for (uint32_t r = 0; r < opt.reps; r++) {
			double t0 = bench_now_s();
			kvr_cpu_parallel_for(dev, read_task, &gather, threads);
			tg[r] = bench_now_s() - t0;
			t0 = bench_now_s();
			kvr_dev_attention(dev, &shape, items, opt.batch, segs, n_segs, stream);
			ta[r] = bench_now_s() - t0;
			t0 = bench_now_s();
			kvr_cpu_parallel_for(dev, read_task, &seq, threads);
			ts[r] = bench_now_s() - t0;
		}
		const double a = bench_median(ta, opt.reps), g = bench_median(tg, opt.reps), s = bench_median(ts, opt.reps);
		if (threads == 1)
			attention_1t_s = a / opt.batch;
		attention_last_gbps = kv_bytes / a / 1e9;
		/* Compute bound: 2·G·d multiply-adds per token and KV head. */
		const double peak = fma_peak(dev, threads);
		const double fmas = 2.0 * (n_qo / n_kv) * d * ((double)n_segs * n_kv * p); /* per token */
		const double ceiling_gbps = kv_bytes / (fmas / peak) / 1e9;
		fprintf(stderr, "attention %u thread%s: %7.2f GB/s of K+V; gather-read %7.2f GB/s (ratio %.3f); "
				"sequential read %7.2f GB/s (ratio %.3f); %.1f us per sequence-layer; "
				"%.2f of the FMA peak (compute ceiling %.2f GB/s = %.2f of gather-read)\n",
			threads, threads > 1 ? "s" : " ", kv_bytes / a / 1e9, kv_bytes / g / 1e9, g / a,
			kv_bytes / s / 1e9, s / a, a / opt.batch * 1e6, (fmas / a) / peak, ceiling_gbps,
			ceiling_gbps / (kv_bytes / g / 1e9));
		fprintf(json, "    {\"threads\": %u, \"kv_bytes\": %llu, \"attention_gbps\": %.3f, \"gather_read_gbps\": %.3f, "
			      "\"ratio_to_gather_read\": %.4f, \"sequential_read_gbps\": %.3f, \"ratio_to_sequential_read\": %.4f, "
			      "\"us_per_sequence_layer\": %.2f, \"fma_peak_per_s\": %.4g, \"fraction_of_fma_peak\": %.4f, "
			      "\"compute_ceiling_gbps\": %.3f}%s\n",
			threads, (unsigned long long)kv_bytes, kv_bytes / a / 1e9, kv_bytes / g / 1e9, g / a,
			kv_bytes / s / 1e9, s / a, a / opt.batch * 1e6, peak, (fmas / a) / peak, ceiling_gbps,
			ti + 1 < opt.n_threads ? "," : "");
		free(ta), free(tg), free(ts), free(seq_split);
		kvr_dev_stream_destroy(dev, stream);
		kvr_dev_destroy(dev);
	}
	fprintf(json, "  ],\n  \"selection\": [\n");

	/* Selection: one sequence, all 8 KV heads, contexts 2K..1M tokens. */
	struct kvr_dev *dev;
	struct kvr_stream *stream;
	if (open_cpu(opt.threads[opt.n_threads - 1], &dev, &stream))
		return 1;
	const uint32_t sink_pages = 512 / p, window_pages = 512 / p, k = (opt.budget_tokens - 1024) / p;
	static const uint32_t contexts[] = { 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576 };
	const uint32_t n_ctx = sizeof(contexts) / sizeof(contexts[0]);
	const uint32_t max_pages = contexts[n_ctx - 1] / p;
	uint16_t *summaries = bench_huge_alloc("kernels_bench", (size_t)max_pages * n_kv * 2 * d * 2);
	for (uint64_t i = 0; i < (uint64_t)max_pages * n_kv * 2 * d; i++)
		summaries[i] = kvr_f32_to_f16((float)((int32_t)(rng() % 2048) - 1024) / 1024.0f);
	float *scores = bench_huge_alloc("kernels_bench", (size_t)n_kv * max_pages * sizeof(float));
	int32_t *selected = calloc((size_t)n_kv * (k ? k : 1), sizeof(int32_t));
	for (uint32_t c = 0; c < (opt.skip_selection ? 0 : n_ctx); c++) {
		const uint32_t pages = contexts[c] / p;
		/* as the scheduler scores: each head's softmax over every page
		 * (norm_end = 0: over the candidates, the alternative) */
		struct kvr_score_item it = { q, summaries, scores, selected, sink_pages,
					     pages > window_pages ? pages - window_pages : sink_pages, k,
					     opt.softmax_candidates ? 0 : pages, NULL };
		if (it.cand_end < it.cand_begin)
			it.cand_end = it.cand_begin;
		double *tsc = calloc(opt.reps, sizeof(double)), *tse = calloc(opt.reps, sizeof(double));
		for (uint32_t r = 0; r < opt.reps; r++) {
			double t0 = bench_now_s();
			kvr_dev_score(dev, &shape, &it, 1, stream);
			tsc[r] = bench_now_s() - t0;
			t0 = bench_now_s();
			kvr_dev_select(dev, &shape, &it, 1, stream);
			tse[r] = bench_now_s() - t0;
		}
		const double sc = bench_median(tsc, opt.reps), se = bench_median(tse, opt.reps);
		const uint32_t cand = it.cand_end - it.cand_begin;
		/* Per byte against attention (same run, same threads): selection
		 * reads every candidate's summary, 2·d f16 elements per KV head. */
		const double sel_gbps = (double)cand * n_kv * 2 * d * 2 / (sc + se) / 1e9;
		const double per_byte = attention_last_gbps > 0 ? sel_gbps / attention_last_gbps : 0.0;
		fprintf(stderr, "selection L=%7u (%5u candidate pages): score %9.1f us, top-%u %8.1f us, %.1f ns/page; "
				"%.2f GB/s of summaries = %.2f x attention's; x %.2f of 1-thread attention over B\n",
			contexts[c], cand, sc * 1e6, k, se * 1e6, cand ? (sc + se) / cand / n_kv * 1e9 : 0.0,
			sel_gbps, per_byte, attention_1t_s > 0 ? (sc + se) / attention_1t_s : 0.0);
		fprintf(json, "    {\"context_tokens\": %u, \"candidate_pages\": %u, \"threads\": %u, \"score_us\": %.2f, "
			      "\"select_us\": %.2f, \"ns_per_page_head\": %.2f, \"summary_gbps\": %.3f, "
			      "\"per_byte_vs_attention\": %.4f}%s\n",
			contexts[c], cand, opt.threads[opt.n_threads - 1], sc * 1e6, se * 1e6,
			cand ? (sc + se) / cand / n_kv * 1e9 : 0.0, sel_gbps, per_byte, c + 1 < n_ctx ? "," : "");
		free(tsc), free(tse);
	}
	fprintf(json, "  ]\n}\n");
	if (json != stdout)
		fclose(json);
	kvr_dev_stream_destroy(dev, stream);
	kvr_dev_destroy(dev);
	free(segs), free(items), free(runs), free(selected);
	free(pool), free(seq_buf), free(q), free(out), free(summaries), free(scores);
	return 0;
}
