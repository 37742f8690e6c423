/* SPDX-License-Identifier: MIT */
/*
 * model_probe.c — a thin driver of the real-model runner's pieces
 * (bench/model/) for tests/python/test_arch.py, which compares what it prints
 * with llama.cpp's answers for the same synthetic GGUFs:
 *
 *   model_probe logits FILE ID...   every position's logits, token by token
 *                                   (prefill of the first, then decode steps),
 *                                   then the last position's from one prefill
 *                                   of the whole prompt;
 *   model_probe greedy FILE N ID... N greedy tokens after the prompt (dense);
 *   model_probe tokenize FILE CORPUS the ids of every corpus line ("SPECIAL
 *                                   TEXT_HEX"), one line of ids each.
 *
 * Output is plain text on stdout; errors go to stderr with exit status 1.
 * Threads: the main thread only (the model runs with no extra workers).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "kvrecall.h"
#include "model.h"
#include "runner.h"
#include "tokenizer.h"

static int die(const char *what, const char *msg)
{
	fprintf(stderr, "model_probe: %s: %s\n", what, msg);
	return 1;
}

static struct kvr_context *context(const struct model *m, uint32_t tokens)
{
	struct kvr_config c;
	kvr_config_init(&c);
	model_kvr_config(m, &c);
	c.backend = KVR_BACKEND_CPU;
	c.mode = KVR_MODE_DENSE;
	c.max_sequences = 2; /* logits runs the prompt twice */
	c.max_batch = 1;
	c.threads = 1;
	c.budget_tokens = 1024;
	c.sink_tokens = c.window_tokens = 256;
	const uint64_t page_bytes = 2ull * c.page_tokens * c.head_dim * c.n_kv_heads * 2;
	c.pool_bytes = ((uint64_t)tokens / c.page_tokens + 8) * c.n_layers * page_bytes * 2;
	struct kvr_context *ctx = NULL;
	if (kvr_context_create(&c, &ctx)) {
		die("kvr_context_create", kvr_last_error(NULL));
		return NULL;
	}
	return ctx;
}

static void print_logits(const char *tag, uint32_t pos, const float *l, uint32_t n)
{
	printf("%s %u", tag, pos);
	for (uint32_t i = 0; i < n; i++)
		printf(" %.6g", (double)l[i]);
	printf("\n");
}

static uint32_t argmax(const float *l, uint32_t n)
{
	uint32_t best = 0;
	for (uint32_t i = 1; i < n; i++)
		if (l[i] > l[best])
			best = i;
	return best;
}

static int run_model(const char *cmd, const char *path, int argc, char **argv)
{
	char err[512];
	struct model *m;
	if (model_open(path, 0, &m, err, sizeof(err)))
		return die(path, err);
	const uint32_t vocab = model_hparams(m)->n_vocab;
	uint32_t n_gen = 0;
	if (!strcmp(cmd, "greedy")) {
		if (argc < 1)
			return die(cmd, "needs N");
		n_gen = (uint32_t)strtoul(argv[0], NULL, 10);
		argc--, argv++;
	}
	const uint32_t n = (uint32_t)argc;
	int32_t *ids = malloc((n + n_gen + 1) * sizeof(*ids));
	float *logits = malloc(vocab * sizeof(float));
	if (!ids || !logits || !n)
		return die(cmd, "no prompt, or out of memory");
	for (uint32_t i = 0; i < n; i++)
		ids[i] = (int32_t)strtol(argv[i], NULL, 10);
	struct kvr_context *ctx = context(m, n + n_gen + 64);
	uint32_t seq;
	int rc = !ctx || kvr_seq_create(ctx, &seq);
	if (!rc && !strcmp(cmd, "logits")) {
		rc = model_prefill(m, ctx, seq, ids, 1, 0, logits, err, sizeof(err));
		if (!rc)
			print_logits("pos", 0, logits, vocab);
		for (uint32_t p = 1; p < n && !rc; p++) {
			rc = model_decode(m, ctx, seq, ids[p], p, logits, err, sizeof(err));
			if (!rc)
				print_logits("pos", p, logits, vocab);
		}
		/* the same prompt in one prefill: chunks, biases and norms over many rows */
		uint32_t seq2;
		if (!rc && (rc = kvr_seq_create(ctx, &seq2)))
			snprintf(err, sizeof(err), "%s", kvr_last_error(ctx));
		if (!rc)
			rc = model_prefill(m, ctx, seq2, ids, n, 0, logits, err, sizeof(err));
		if (!rc)
			print_logits("prefill", n - 1, logits, vocab);
	} else if (!rc) {
		rc = model_prefill(m, ctx, seq, ids, n, 0, logits, err, sizeof(err));
		printf("greedy");
		for (uint32_t g = 0; g < n_gen && !rc; g++) {
			const int32_t next = (int32_t)argmax(logits, vocab);
			printf(" %d", next);
			if (g + 1 < n_gen)
				rc = model_decode(m, ctx, seq, next, n + g, logits, err, sizeof(err));
		}
		printf("\n");
	}
	if (rc && ctx)
		die(cmd, err);
	kvr_context_destroy(ctx);
	free(ids);
	free(logits);
	model_close(m);
	return rc ? 1 : 0;
}

static int hexval(int c)
{
	return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

static int run_tokenize(const char *path, const char *corpus)
{
	char err[512];
	struct gguf *g;
	struct tok *t;
	if (gguf_open(path, &g, err, sizeof(err)))
		return die(path, err);
	if (runner_tokenizer(g, &t, err, sizeof(err)))
		return die(path, err);
	FILE *f = fopen(corpus, "r");
	if (!f)
		return die(corpus, strerror(errno));
	size_t cap = 1 << 16;
	char *line = malloc(cap), *text = malloc(cap);
	int32_t *ids = malloc(cap * sizeof(*ids));
	int rc = 0;
	while (!rc && line && text && ids && fgets(line, (int)cap, f)) {
		const int special = line[0] == '1';
		size_t len = 0;
		for (const char *p = line + 2; hexval(p[0]) >= 0 && hexval(p[1]) >= 0; p += 2)
			text[len++] = (char)(hexval(p[0]) << 4 | hexval(p[1]));
		size_t n = 0;
		rc = tok_encode(t, text, len, special, ids, cap, &n);
		for (size_t i = 0; i < n && !rc; i++)
			printf(i ? " %d" : "%d", ids[i]);
		printf("\n");
	}
	fclose(f);
	free(line), free(text), free(ids);
	tok_destroy(t);
	gguf_close(g);
	return rc ? die("tok_encode", strerror(-rc)) : 0;
}

int main(int argc, char **argv)
{
	if (argc >= 4 && !strcmp(argv[1], "tokenize"))
		return run_tokenize(argv[2], argv[3]);
	if (argc >= 4 && (!strcmp(argv[1], "logits") || !strcmp(argv[1], "greedy")))
		return run_model(argv[1], argv[2], argc - 3, argv + 3);
	fprintf(stderr, "usage: model_probe logits FILE ID... | greedy FILE N ID... | tokenize FILE CORPUS\n");
	return 2;
}
