/* SPDX-License-Identifier: MIT */
/*
 * pretok_bench.c — the runner's hand-written pre-tokenizers (tokenizer.c,
 * transcriptions of llama.cpp's splitters) against the same regexes run by
 * PCRE2 10.x with its JIT, on a document (by default the demo's, Debian's
 * GPL-3): speed of the split alone and of the whole encode, and whether the
 * two splits agree piece for piece. It measures the choice tokenizer.c makes;
 * built only where libpcre2-8 is found (Debian: libpcre2-dev).
 *
 *   pretok_bench [--file PATH] [--reps N] [--json FILE]
 *
 * Threads: the main thread only.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <errno.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tokenizer.h"

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The three regexes, as llama.cpp's llama-vocab.cpp gives them (smollm runs
 * the GPT-2 one after splitting off every digit; here the GPT-2 regex alone). */
static const struct {
	const char *pre, *regex;
} cases[] = {
	{ "gpt2", "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+" },
	{ "llama-bpe", "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
		       "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+" },
	{ "qwen2", "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
		   "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+" },
};

/* A byte-level vocabulary of the 256 bytes and no merges: enough for the
 * pre-tokenizer, which is all that differs between the two. */
static struct tok *byte_vocab(const char *pre)
{
	static char text[256][3];
	static struct tok_str toks[256];
	unsigned next = 0x100;
	for (unsigned b = 0; b < 256; b++) {
		const int printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
		const unsigned cp = printable ? b : next++;
		if (cp < 0x80) {
			text[b][0] = (char)cp;
			toks[b] = (struct tok_str){ text[b], 1 };
		} else {
			text[b][0] = (char)(0xC0 | cp >> 6);
			text[b][1] = (char)(0x80 | (cp & 0x3F));
			toks[b] = (struct tok_str){ text[b], 2 };
		}
	}
	struct tok_vocab v = { .model = "gpt2", .pre = pre, .n_tokens = 256, .tokens = toks,
			       .bos_id = -1, .eos_id = -1, .unk_id = -1 };
	struct tok *t = NULL;
	char err[256];
	if (tok_create(&v, &t, err, sizeof(err)))
		fprintf(stderr, "pretok_bench: %s\n", err);
	return t;
}

/* PCRE2's split: every match is a piece (the regexes leave no gaps). */
static size_t pcre_split(pcre2_code *re, pcre2_match_data *md, const char *s, size_t n, uint32_t *ends, size_t cap)
{
	size_t at = 0, k = 0;
	while (at < n) {
		const int rc = pcre2_jit_match(re, (PCRE2_SPTR)s, n, at, 0, md, NULL);
		if (rc < 0)
			break;
		const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
		if (ov[1] == at) { /* cannot happen with these regexes: move on */
			at++;
			continue;
		}
		if (ov[0] != at && k < cap)
			ends[k++] = (uint32_t)ov[0]; /* an unmatched gap is a piece */
		if (k < cap)
			ends[k++] = (uint32_t)ov[1];
		at = ov[1];
	}
	return k;
}

int main(int argc, char **argv)
{
	const char *path = "/usr/share/common-licenses/GPL-3", *json = NULL;
	int reps = 20;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--file") && i + 1 < argc)
			path = argv[++i];
		else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
			reps = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--json") && i + 1 < argc)
			json = argv[++i];
		else {
			fprintf(stderr, "usage: pretok_bench [--file PATH] [--reps N] [--json FILE]\n");
			return 2;
		}
	}
	FILE *f = fopen(path, "rb");
	if (!f) {
		fprintf(stderr, "pretok_bench: %s: %s\n", path, strerror(errno));
		return 1;
	}
	fseek(f, 0, SEEK_END);
	const size_t n = (size_t)ftell(f);
	fseek(f, 0, SEEK_SET);
	char *text = malloc(n + 1);
	if (!text || fread(text, 1, n, f) != n) {
		fprintf(stderr, "pretok_bench: cannot read %s\n", path);
		return 1;
	}
	fclose(f);
	uint32_t *a = malloc((n + 1) * sizeof(*a)), *b = malloc((n + 1) * sizeof(*b));
	int32_t *ids = malloc((n + 1) * sizeof(*ids));
	FILE *out = json ? fopen(json, "w") : NULL;
	if (out)
		fprintf(out, "{\"file\": \"%s\", \"bytes\": %zu, \"pcre2\": \"%d.%d\", \"rows\": [", path, n, PCRE2_MAJOR,
			PCRE2_MINOR);
	printf("%s: %zu bytes; best of %d runs; PCRE2 %d.%d with JIT\n", path, n, reps, PCRE2_MAJOR, PCRE2_MINOR);
	printf("%-10s %8s %14s %14s %14s %12s\n", "pre", "pieces", "ours MB/s", "pcre2 MB/s", "encode MB/s",
	       "same split");
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		struct tok *t = byte_vocab(cases[c].pre);
		int errc;
		PCRE2_SIZE erroff;
		pcre2_code *re = pcre2_compile((PCRE2_SPTR)cases[c].regex, PCRE2_ZERO_TERMINATED,
					       PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &errc, &erroff, NULL);
		if (!t || !re || pcre2_jit_compile(re, PCRE2_JIT_COMPLETE)) {
			fprintf(stderr, "pretok_bench: %s: cannot set up (pcre2 error %d at %zu)\n", cases[c].pre, errc,
				(size_t)erroff);
			return 1;
		}
		pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
		double best_ours = 1e9, best_pcre = 1e9, best_enc = 1e9;
		size_t na = 0, nb = 0, nids = 0;
		for (int r = 0; r < reps; r++) {
			double t0 = now_s();
			tok_pretokenize(t, text, n, a, n + 1, &na);
			double t1 = now_s();
			nb = pcre_split(re, md, text, n, b, n + 1);
			double t2 = now_s();
			tok_encode(t, text, n, 0, ids, n + 1, &nids);
			double t3 = now_s();
			best_ours = t1 - t0 < best_ours ? t1 - t0 : best_ours;
			best_pcre = t2 - t1 < best_pcre ? t2 - t1 : best_pcre;
			best_enc = t3 - t2 < best_enc ? t3 - t2 : best_enc;
		}
		size_t same = 0;
		while (same < na && same < nb && a[same] == b[same])
			same++;
		const int agree = na == nb && same == na;
		printf("%-10s %8zu %14.1f %14.1f %14.1f %12s\n", cases[c].pre, na, n / best_ours / 1e6,
		       n / best_pcre / 1e6, n / best_enc / 1e6, agree ? "yes" : "NO");
		if (!agree) {
			const size_t from = same ? a[same - 1] : 0;
			const size_t to = same < na && a[same] > from + 24 ? from + 24 : same < na ? a[same] + 8 : n;
			printf("  first difference at piece %zu (ours %zu pieces, pcre2 %zu): ours ends it at byte %u, "
			       "pcre2 at %u, in \"",
			       same, na, nb, same < na ? a[same] : 0, same < nb ? b[same] : 0);
			for (size_t i = from; i < to && i < n; i++)
				printf((unsigned char)text[i] >= 0x20 && (unsigned char)text[i] < 0x7f ? "%c" : "\\x%02x",
				       (unsigned char)text[i]);
			printf("\"\n");
		}
		if (out)
			fprintf(out, "%s{\"pre\": \"%s\", \"pieces\": %zu, \"ours_mb_s\": %.2f, \"pcre2_mb_s\": %.2f, "
				     "\"encode_mb_s\": %.2f, \"same_split\": %s}",
				c ? ", " : "", cases[c].pre, na, n / best_ours / 1e6, n / best_pcre / 1e6,
				n / best_enc / 1e6, agree ? "true" : "false");
		pcre2_match_data_free(md);
		pcre2_code_free(re);
		tok_destroy(t);
	}
	if (out) {
		fprintf(out, "]}\n");
		fclose(out);
	}
	free(text), free(a), free(b), free(ids);
	return 0;
}
