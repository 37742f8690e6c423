/* SPDX-License-Identifier: MIT */
/*
 * test_model.c — the Llama forward pass through kvrecall (bench/model/model.c)
 * on the real SmolLM2-135M-Instruct file: a known completion, freekv equal to
 * dense bit for bit while the context fits the budget, and a long prompt with
 * a small budget that exercises selection. Skipped, with the reason, when the
 * model is not in the cache (bench/model/fetch_model.sh).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf.h"
#include "kvrecall.h"
#include "model.h"
#include "runner.h"
#include "tokenizer.h"

static struct model *m;
static struct tok *t;

static void open_model(void)
{
	char path[4096], err[512];
	if (gguf_default_model_path(path, sizeof(path)))
		cr_skip_test("the model is not in the cache: run bench/model/fetch_model.sh");
	cr_assert_eq(model_open(path, 1, &m, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(runner_tokenizer(model_gguf(m), &t, err, sizeof(err)), 0, "%s", err);
}

static void close_model(void)
{
	tok_destroy(t);
	model_close(m);
}

static struct kvr_context *context(uint32_t mode, uint32_t budget, uint32_t sink, uint32_t window)
{
	struct kvr_config c;
	kvr_config_init(&c);
	model_kvr_config(m, &c);
	c.backend = KVR_BACKEND_CPU;
	c.mode = mode;
	c.budget_tokens = budget;
	c.sink_tokens = sink;
	c.window_tokens = window;
	c.max_sequences = c.max_batch = 1;
	c.threads = 1;
	c.pool_bytes = 64ull << 20;
	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(&c, &ctx), 0, "%s", kvr_last_error(NULL));
	return ctx;
}

static size_t encode(const char *text, int32_t *ids, size_t max)
{
	size_t n = 0;
	cr_assert_eq(tok_encode(t, text, strlen(text), 1, ids, max, &n), 0);
	return n;
}

/* Greedy generation of n tokens; logits of every step into all (n x vocab). */
static void greedy(struct kvr_context *ctx, const int32_t *prompt, size_t n_prompt, uint32_t n,
		   int32_t *out, float *all)
{
	const uint32_t vocab = model_hparams(m)->n_vocab;
	char err[512];
	uint32_t seq;
	cr_assert_eq(kvr_seq_create(ctx, &seq), 0);
	cr_assert_eq(model_prefill(m, ctx, seq, prompt, (uint32_t)n_prompt, 0, all, err, sizeof(err)), 0,
		     "%s", err);
	for (uint32_t i = 0; i < n; i++) {
		const float *l = all + (size_t)i * vocab;
		uint32_t best = 0;
		for (uint32_t v = 1; v < vocab; v++)
			if (l[v] > l[best])
				best = v;
		out[i] = (int32_t)best;
		if (i + 1 < n)
			cr_assert_eq(model_decode(m, ctx, seq, out[i], n_prompt + i, all + (size_t)(i + 1) * vocab,
						  err, sizeof(err)),
				     0, "%s", err);
	}
}

Test(model, completes_the_capital_of_france, .init = open_model, .fini = close_model, .timeout = 120)
{
	int32_t prompt[16], out[4];
	const size_t n = encode("The capital of France is", prompt, 16);
	float *logits = malloc(4ull * model_hparams(m)->n_vocab * sizeof(float));
	struct kvr_context *ctx = context(KVR_MODE_DENSE, 2048, 512, 512);
	greedy(ctx, prompt, n, 4, out, logits);
	char text[256];
	size_t len = 0;
	cr_assert_eq(tok_decode(t, out, 4, text, sizeof(text) - 1, &len), 0);
	text[len] = 0;
	cr_expect(!strncmp(text, " Paris", 6), "greedy continuation: \"%s\"", text);
	kvr_context_destroy(ctx);
	free(logits);
}

/* docs/design.md, "The decode step": while a sequence holds at most B
 * tokens attention is dense, so every mode gives dense's logits exactly. */
Test(model, freekv_equals_dense_within_budget, .init = open_model, .fini = close_model,
     .timeout = 240)
{
	int32_t prompt[256], dense[24], fk[24];
	const size_t n = encode("<|im_start|>user\nName three colours of the rainbow.<|im_end|>\n"
				"<|im_start|>assistant\n",
				prompt, 256);
	const size_t vocab = model_hparams(m)->n_vocab;
	float *a = malloc(24 * vocab * sizeof(float)), *b = malloc(24 * vocab * sizeof(float));
	struct kvr_context *ctx = context(KVR_MODE_DENSE, 2048, 512, 512);
	greedy(ctx, prompt, n, 24, dense, a);
	kvr_context_destroy(ctx);
	ctx = context(KVR_MODE_FREEKV, 2048, 512, 512);
	greedy(ctx, prompt, n, 24, fk, b);
	kvr_context_destroy(ctx);
	cr_expect_eq(memcmp(dense, fk, sizeof(dense)), 0, "freekv chose other tokens than dense");
	cr_expect_eq(memcmp(a, b, 24 * vocab * sizeof(float)), 0, "freekv's logits differ from dense's");
	free(a), free(b);
}

/* A prompt of ~700 tokens with B = 256 (S = W = 64): selection, correction and
 * the sparse path all run; the logits stay finite and the step is counted. */
Test(model, small_budget_long_prompt, .init = open_model, .fini = close_model, .timeout = 300)
{
	FILE *f = fopen("/usr/share/common-licenses/GPL-3", "rb");
	if (!f)
		cr_skip_test("/usr/share/common-licenses/GPL-3 is missing (Debian's base-files)");
	static char text[3200];
	const size_t got = fread(text, 1, sizeof(text) - 1, f);
	fclose(f);
	text[got] = 0;
	static int32_t prompt[2048];
	const size_t n = encode(text, prompt, 2048);
	cr_assert_gt(n, 600);
	const size_t vocab = model_hparams(m)->n_vocab;
	float *l = malloc(8 * vocab * sizeof(float));
	int32_t out[8];
	struct kvr_context *ctx = context(KVR_MODE_FREEKV, 256, 64, 64);
	greedy(ctx, prompt, n, 8, out, l);
	for (size_t i = 0; i < 8 * vocab; i++)
		cr_assert(isfinite(l[i]), "logit %zu is %g", i, (double)l[i]);
	struct kvr_stats st = { .size = sizeof(st) };
	cr_assert_eq(kvr_get_stats(ctx, &st), 0);
	cr_expect_gt(st.checked_heads + st.selections, 0, "the sparse path never ran");
	cr_expect_gt(st.layer_decodes, st.dense_decodes, "every decode was dense");
	kvr_context_destroy(ctx);
	free(l);
}

/* ------------------------------------------------------------------ llama.cpp */

/*
 * Teacher-forced logits against llama.cpp on the same file
 * (tests/data/model/llama_cpp_logits.txt, made by make_logits.py there with
 * llama-cpp-python 0.3.36): at every position of four prompts the same top-1
 * token — except where llama.cpp's own top two are within 0.25, which is
 * inside the two implementations' disagreement (llama.cpp accumulates V in
 * f16 and orders its sums differently; such positions are counted, not
 * asserted) — and the largest relative difference of the eight logits
 * recorded per position, stated in the output and bounded.
 */
Test(model, logits_match_llama_cpp, .init = open_model, .fini = close_model, .timeout = 300)
{
	char path[4096];
	snprintf(path, sizeof(path), "%s/model/llama_cpp_logits.txt", KVR_TEST_DATA);
	FILE *f = fopen(path, "r");
	cr_assert(f, "cannot open %s", path);
	const uint32_t vocab = model_hparams(m)->n_vocab;
	float *logits = malloc(vocab * sizeof(float));
	char line[4096], err[512];
	int32_t ids[512];
	uint32_t n_ids = 0, seq = 0, compared = 0, near_ties = 0, positions = 0;
	double max_rel = 0.0;
	struct kvr_context *ctx = NULL;
	while (fgets(line, sizeof(line), f)) {
		if (!strncmp(line, "prompt ", 7)) {
			if (ctx)
				kvr_context_destroy(ctx);
			ctx = context(KVR_MODE_DENSE, 2048, 512, 512);
			cr_assert_eq(kvr_seq_create(ctx, &seq), 0);
			char *p = line + 7;
			strtoul(p, &p, 10);
			n_ids = (uint32_t)strtoul(p, &p, 10);
			cr_assert(n_ids > 0 && n_ids <= 512);
			for (uint32_t i = 0; i < n_ids; i++)
				ids[i] = (int32_t)strtol(p, &p, 10);
			continue;
		}
		if (strncmp(line, "pos ", 4))
			continue;
		char *p = line + 4;
		strtoul(p, &p, 10);
		const uint32_t pos = (uint32_t)strtoul(p, &p, 10);
		cr_assert(ctx && pos < n_ids, "fixture out of order");
		/* our logits after the token at `pos` */
		if (pos == 0)
			cr_assert_eq(model_prefill(m, ctx, seq, ids, 1, 0, logits, err, sizeof(err)), 0, "%s", err);
		else
			cr_assert_eq(model_decode(m, ctx, seq, ids[pos], pos, logits, err, sizeof(err)), 0, "%s",
				     err);
		int32_t top[8];
		float ref[8];
		for (int k = 0; k < 8; k++) {
			top[k] = (int32_t)strtol(p, &p, 10);
			cr_assert_eq(*p, ':');
			ref[k] = strtof(p + 1, &p);
		}
		uint32_t best = 0;
		for (uint32_t v = 1; v < vocab; v++)
			if (logits[v] > logits[best])
				best = v;
		positions++;
		if (ref[0] - ref[1] < 0.25f) {
			near_ties += (int32_t)best != top[0];
		} else {
			cr_expect_eq((int32_t)best, top[0],
				     "position %u: our top-1 is %u (%.4f), llama.cpp's %d (%.4f; ours %.4f)", pos,
				     best, (double)logits[best], top[0], (double)ref[0], (double)logits[top[0]]);
			compared++;
		}
		for (int k = 0; k < 8; k++) {
			const double d = fabs((double)logits[top[k]] - ref[k]);
			const double rel = d / (fabs(ref[k]) > 1.0 ? fabs(ref[k]) : 1.0);
			max_rel = rel > max_rel ? rel : max_rel;
		}
	}
	fclose(f);
	if (ctx)
		kvr_context_destroy(ctx);
	free(logits);
	fprintf(stderr, "[model] against llama.cpp: %u positions, top-1 asserted at %u (%u near-ties "
			"differ), max relative logit difference %.4f\n",
		positions, compared, near_ties, max_rel);
	cr_assert_gt(positions, 40);
	cr_expect_lt(max_rel, 0.08, "logits differ from llama.cpp's by up to %.4f (relative)", max_rel);
}

/* The eval tests' text (skip without Debian's GPL-3) and an empty temporary
 * file for their JSON, named from the template `json`. */
static void eval_prepare(char *json)
{
	if (access("/usr/share/common-licenses/GPL-3", R_OK))
		cr_skip_test("/usr/share/common-licenses/GPL-3 is missing (Debian's base-files)");
	const int fd = mkstemp(json);
	cr_assert_geq(fd, 0);
	close(fd);
}

/* runner_eval(argv), whose last argument is the JSON file eval_prepare made;
 * the JSON it wrote, in buf (the file removed). */
static void eval_json(int argc, char **argv, char *buf, size_t cap)
{
	const char *json = argv[argc - 1];
	cr_assert_eq(runner_eval(argc, argv), 0);
	FILE *f = fopen(json, "r");
	cr_assert(f, "%s: %s", json, strerror(errno));
	const size_t got = fread(buf, 1, cap - 1, f);
	fclose(f);
	unlink(json);
	buf[got] = 0;
}

/* `kvrecall eval` end to end on a short window of the GPL-3: dense agrees
 * with itself everywhere, every mode's perplexity is finite and close to
 * dense's, and the JSON names every mode requested. */
Test(model, eval_reports_every_mode, .init = open_model, .fini = close_model, .timeout = 300)
{
	char json[] = "/tmp/kvr-eval-XXXXXX";
	eval_prepare(json);
	char modes[] = "blocking,speculative,freekv";
	char *argv[] = { "--file",   "/usr/share/common-licenses/GPL-3", "--context", "384", "--prefill",
			 "256",      "--budget", "256", "--sink", "64", "--window", "64", "--modes", modes,
			 "--threads", "1", "--quiet", "--json", json };
	char buf[4096];
	eval_json((int)(sizeof(argv) / sizeof(argv[0])), argv, buf, sizeof(buf));
	for (const char *md = "dense\0blocking\0speculative\0freekv\0"; *md; md += strlen(md) + 1) {
		char key[64];
		snprintf(key, sizeof(key), "\"mode\": \"%s\", \"kv_format\": \"f16\", \"perplexity\": ", md);
		const char *p = strstr(buf, key);
		cr_assert(p, "no result for %s in %s", md, buf);
		const double ppl = strtod(p + strlen(key), NULL);
		cr_expect(isfinite(ppl) && ppl > 1.0 && ppl < 200.0, "%s: perplexity %g", md, ppl);
	}
	cr_expect(strstr(buf, "\"mode\": \"dense\", \"kv_format\": \"f16\", \"perplexity\"") &&
		  strstr(strstr(buf, "\"mode\": \"dense\""), "\"top1_agreement\": 1.000000"),
		  "dense does not agree with itself: %s", buf);
}

/* Quantised pages through `kvrecall eval`: every (mode, format) pair is
 * reported; K8V4 stays close to f16 (LeanKV: keys need the bits), and K4V2,
 * with 2-bit values, is measurably worse than K8V4 — the formats really
 * reach attention. */
static double eval_ppl(const char *buf, const char *mode, const char *format)
{
	char key[96];
	snprintf(key, sizeof(key), "\"mode\": \"%s\", \"kv_format\": \"%s\", \"perplexity\": ", mode,
		 format);
	const char *p = strstr(buf, key);
	cr_assert(p, "no result for %s over %s pages in %s", mode, format, buf);
	return strtod(p + strlen(key), NULL);
}

/* 8 teacher-forced passes of 384 tokens: about 2 minutes in a release build,
 * 5 or more under ASan+UBSan on 2 busy cores (CI) */
Test(model, eval_quantised_pages, .init = open_model, .fini = close_model, .timeout = 900)
{
	char json[] = "/tmp/kvr-eval-XXXXXX";
	eval_prepare(json);
	char modes[] = "freekv", formats[] = "k8v4,k4v2,mixed";
	char *argv[] = { "--file",   "/usr/share/common-licenses/GPL-3", "--context", "640", "--prefill",
			 "256",      "--budget", "256", "--sink", "64", "--window", "64", "--modes", modes,
			 "--kv-formats", formats, "--threads", "1", "--quiet", "--json", json };
	char buf[8192];
	eval_json((int)(sizeof(argv) / sizeof(argv[0])), argv, buf, sizeof(buf));
	const double f16 = eval_ppl(buf, "dense", "f16"), k8 = eval_ppl(buf, "dense", "k8v4");
	const double k4 = eval_ppl(buf, "dense", "k4v2");
	const double fk8 = eval_ppl(buf, "freekv", "k8v4"), fk4 = eval_ppl(buf, "freekv", "k4v2");
	const double mx = eval_ppl(buf, "dense", "mixed");
	/* mixed demotes about half of the pages decoding saw in the window
	 * (384 decoded tokens: a dozen pages): near K8V4, far from K4V2 */
	cr_expect(mx > 0.98 * k8 && mx < k4, "dense over mixed pages: perplexity %g, K8V4 %g, K4V2 %g", mx, k8, k4);
	const char *dm = strstr(buf, "\"mode\": \"dense\", \"kv_format\": \"mixed\"");
	cr_assert(dm && strstr(dm, "\"pages_demoted\": "), "%s", buf);
	cr_expect_gt(strtoull(strstr(dm, "\"pages_demoted\": ") + 17, NULL, 10), 0, "mixed demoted no page: %s", buf);
	cr_expect(k8 > 0.95 * f16 && k8 < 1.05 * f16, "dense over K8V4 pages: perplexity %g, f16 %g", k8, f16);
	/* over 384 tokens K4V2's perplexity swings with the arithmetic (2-bit
	 * values flip with any rounding, and the model's activations after
	 * them): 1.24x K8V4's with float dots, 1.38x on AVX-512 VNNI, 1.13x on
	 * AVX2 (1.18x before its byte sums); a format that did not reach
	 * attention would be within a percent */
	cr_expect(k4 > 1.1 * k8, "dense over K4V2 pages: perplexity %g, not worse than K8V4's %g", k4, k8);
	cr_expect(isfinite(fk8) && fk8 < 1.2 * f16 && isfinite(fk4), "freekv: K8V4 %g, K4V2 %g, f16 dense %g",
		  fk8, fk4, f16);
}
