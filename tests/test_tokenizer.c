/* SPDX-License-Identifier: MIT */
/*
 * test_tokenizer.c — the byte-level BPE tokenizer (bench/model/tokenizer.c)
 * and its Unicode tables.
 *
 * Two halves. Without the model: a small hand-made vocabulary checks the
 * mechanics (merge order, the "smollm" and "gpt2" pre-tokenizers, special
 * tokens, dropped bytes, decoding, streaming, errors) and the ChatML
 * rendering; these always run. With SmolLM2-135M-Instruct's GGUF (where
 * gguf_default_model_path finds it: KVR_MODEL_PATH, else the kvrecall cache
 * under $KVR_MODEL_DIR, $XDG_CACHE_HOME or ~/.cache; skipped with the reason
 * when absent): exact ids against the fixtures in
 * tests/data/tokenizer/cases.txt (llama.cpp's ids, cross-checked with HF
 * tokenizers; README.md there says how they were made), round trips,
 * invalid UTF-8, streaming, threads, and the encode speed on the GPL-3 text.
 *
 * The vocabulary is read with bench/model/gguf.h and handed to the tokenizer
 * as plain arrays, the way the runner does; tokenizer.c itself does not
 * depend on the GGUF reader.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gguf.h"
#include "chat.h"
#include "tokenizer.h"
#include "unicode.h"

/* ---------------------------------------------------------------------------
 * A hand-made vocabulary
 *
 * ids 0-2: <|endoftext|> <|im_start|> <|im_end|> (control), 3: <tool>
 * (user-defined), 4 + b: the byte-level character of byte b for every byte
 * but 0xFF (so 0xFF has no token), then one token per merge below.
 * ------------------------------------------------------------------------- */

static const char *const small_merges[] = {
	"h e", "l l", "he ll", "hell o",          /* hello */
	"Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", /* Ġworld */
	"o Ġ",                                     /* would join "hello" and " " if the split failed */
	"1 2", "Ġ 1",                              /* digits: never merged by "smollm" */
	"Ġ Ġ",                                     /* whitespace runs */
	"' s",                                     /* the 's contraction */
	"a a",                                     /* leftmost first in "aaa" */
	"b c", "a b", "a bc",                      /* lowest rank first in "abc" */
	"t Ġ",                                     /* "it 's": never across words */
};
#define N_SMALL_MERGES (sizeof(small_merges) / sizeof(small_merges[0]))
#define SMALL_BYTES 4 /* id of byte 0 */

struct small_vocab {
	char text[512][16];
	struct tok_str tokens[512];
	int32_t types[512];
	struct tok_str merges[N_SMALL_MERGES];
	struct tok_vocab v;
};

static size_t put_utf8(char *out, uint32_t cp)
{
	if (cp < 0x80) {
		out[0] = (char)cp;
		return 1;
	}
	out[0] = (char)(0xC0 | cp >> 6);
	out[1] = (char)(0x80 | (cp & 0x3F));
	return 2; /* byte-level characters are all below U+0800 */
}

/* GPT-2's byte -> character mapping, written out independently of tokenizer.c. */
static uint32_t byte_char(unsigned b)
{
	static uint32_t map[256];
	static int ready;
	if (!ready) {
		uint32_t next = 256;
		for (unsigned i = 0; i < 256; i++) {
			int printable = (i >= '!' && i <= '~') || (i >= 0xA1 && i <= 0xAC) || i >= 0xAE;
			map[i] = printable ? i : next++;
		}
		ready = 1;
	}
	return map[b];
}

static void small_vocab_init(struct small_vocab *s, const char *pre)
{
	memset(s, 0, sizeof(*s));
	static const char *const specials[] = { "<|endoftext|>", "<|im_start|>", "<|im_end|>",
						"<tool>" };
	size_t n = 0;
	for (size_t i = 0; i < 4; i++, n++) {
		strcpy(s->text[n], specials[i]);
		s->types[n] = i < 3 ? TOK_TYPE_CONTROL : TOK_TYPE_USER_DEFINED;
	}
	for (unsigned b = 0; b < 255; b++, n++) {
		s->text[n][put_utf8(s->text[n], byte_char(b))] = '\0';
		s->types[n] = TOK_TYPE_NORMAL;
	}
	for (size_t m = 0; m < N_SMALL_MERGES; m++, n++) {
		const char *sp = strchr(small_merges[m], ' ');
		size_t l = (size_t)(sp - small_merges[m]);
		memcpy(s->text[n], small_merges[m], l);
		strcpy(s->text[n] + l, sp + 1);
		s->types[n] = TOK_TYPE_NORMAL;
		s->merges[m] = (struct tok_str){ small_merges[m], strlen(small_merges[m]) };
	}
	for (size_t i = 0; i < n; i++)
		s->tokens[i] = (struct tok_str){ s->text[i], strlen(s->text[i]) };
	s->v = (struct tok_vocab){
		.model = "gpt2", .pre = pre, .n_tokens = n, .tokens = s->tokens, .types = s->types,
		.n_merges = N_SMALL_MERGES, .merges = s->merges,
		.bos_id = 1, .eos_id = 2, .unk_id = 0, .add_bos = 0,
	};
}

static struct tok *small_tok(const char *pre)
{
	static struct small_vocab s;
	small_vocab_init(&s, pre);
	struct tok *t;
	char err[256] = "";
	int ret = tok_create(&s.v, &t, err, sizeof(err));
	cr_assert_eq(ret, 0, "tok_create: %d %s", ret, err);
	return t;
}

static int32_t id_of(const struct tok *t, const char *text)
{
	int32_t id = tok_find(t, text, strlen(text));
	cr_assert_geq(id, 0, "\"%s\" is not in the vocabulary", text);
	return id;
}

static size_t encode(const struct tok *t, const char *s, size_t len, int special, int32_t *ids,
		     size_t max)
{
	size_t n;
	int ret = tok_encode(t, s, len, special, ids, max, &n);
	cr_assert_eq(ret, 0, "tok_encode: %d", ret);
	return n;
}

/* Encode s and compare with the tokens whose texts are listed (NULL-ended). */
static void expect_tokens(const struct tok *t, const char *s, int special, const char *const *want)
{
	int32_t ids[64];
	size_t n = encode(t, s, strlen(s), special, ids, 64), k = 0;
	for (; want[k]; k++) {
		cr_assert_lt(k, n, "\"%s\": %zu ids, expected more", s, n);
		cr_expect_eq(ids[k], id_of(t, want[k]), "\"%s\": id %zu is %d, expected \"%s\" (%d)", s,
			     k, ids[k], want[k], id_of(t, want[k]));
	}
	cr_expect_eq(n, k, "\"%s\": %zu ids, expected %zu", s, n, k);
}

#define TOKENS(...) ((const char *const[]){ __VA_ARGS__, NULL })

Test(tokenizer, small_merges_and_smollm_split)
{
	struct tok *t = small_tok("smollm");
	expect_tokens(t, "hello world", 0, TOKENS("hello", "Ġworld"));
	/* "hello", " ", " world": the trap merges "o Ġ" and "Ġ Ġ" stay unused */
	expect_tokens(t, "hello  world", 0, TOKENS("hello", "Ġ", "Ġworld"));
	expect_tokens(t, "hello   ", 0, TOKENS("hello", "ĠĠ", "Ġ"));
	/* every digit alone, and a space before a digit is not joined to it */
	expect_tokens(t, "12 12", 0, TOKENS("1", "2", "Ġ", "1", "2"));
	expect_tokens(t, "it's", 0, TOKENS("i", "t", "'s"));
	expect_tokens(t, "aaa", 0, TOKENS("aa", "a"));
	expect_tokens(t, "abc", 0, TOKENS("abc"));
	expect_tokens(t, "ab", 0, TOKENS("ab"));
	expect_tokens(t, "\n\n", 0, TOKENS("Ċ", "Ċ"));
	tok_destroy(t);
}

Test(tokenizer, small_gpt2_split_keeps_digit_runs)
{
	struct tok *t = small_tok("gpt2");
	/* "12", " 12": "1 2" ranks before "Ġ 1" */
	expect_tokens(t, "12 12", 0, TOKENS("12", "Ġ", "12"));
	expect_tokens(t, "hello world", 0, TOKENS("hello", "Ġworld"));
	tok_destroy(t);
}

Test(tokenizer, small_special_tokens)
{
	struct tok *t = small_tok("smollm");
	expect_tokens(t, "<|im_start|>hello<|im_end|>", 1,
		      TOKENS("<|im_start|>", "hello", "<|im_end|>"));
	expect_tokens(t, "<|im_start|><|im_start|>", 1, TOKENS("<|im_start|>", "<|im_start|>"));
	/* not parsed: plain text, byte by byte ("<", "|", ...) */
	int32_t ids[64];
	size_t n = encode(t, "<|im_start|>", 12, 0, ids, 64);
	cr_expect_eq(n, 12);
	for (size_t i = 0; i < n; i++)
		cr_expect_geq(ids[i], SMALL_BYTES);
	/* a user-defined token is found either way */
	expect_tokens(t, "a<tool>b", 0, TOKENS("a", "<tool>", "b"));
	expect_tokens(t, "a<tool>b", 1, TOKENS("a", "<tool>", "b"));
	tok_destroy(t);
}

Test(tokenizer, small_bytes_without_token_are_dropped)
{
	struct tok *t = small_tok("smollm");
	int32_t ids[8];
	cr_expect_eq(encode(t, "a\xff" "b", 3, 0, ids, 8), 2);
	cr_expect_eq(ids[0], id_of(t, "a"));
	cr_expect_eq(ids[1], id_of(t, "b"));
	cr_expect_eq(encode(t, "\xff", 1, 0, ids, 8), 0);
	tok_destroy(t);
}

Test(tokenizer, small_enospc_counts_everything)
{
	struct tok *t = small_tok("smollm");
	int32_t ids[2] = { -7, -7 };
	size_t n;
	/* "hello", " world", " hello" -> hello Ġworld Ġ hello */
	cr_expect_eq(tok_encode(t, "hello world hello", 17, 0, ids, 1, &n), -ENOSPC);
	cr_expect_eq(n, 4);
	cr_expect_eq(ids[0], id_of(t, "hello"));
	cr_expect_eq(ids[1], -7, "nothing past max_ids is written");
	cr_expect_eq(tok_encode(t, "hello world", 11, 0, NULL, 0, &n), -ENOSPC);
	cr_expect_eq(n, 2);
	cr_expect_eq(tok_encode(t, "", 0, 0, NULL, 0, &n), 0);
	cr_expect_eq(n, 0);
	char out[4];
	size_t len;
	int32_t hw[] = { id_of(t, "hello"), id_of(t, "Ġworld") };
	cr_expect_eq(tok_decode(t, hw, 2, out, sizeof(out), &len), -ENOSPC);
	cr_expect_eq(len, 11);
	tok_destroy(t);
}

Test(tokenizer, small_decode_and_pieces)
{
	struct tok *t = small_tok("smollm");
	int32_t ids[] = { 1, id_of(t, "hello"), id_of(t, "Ġworld"), id_of(t, "Ċ"), 2, 3 };
	char out[64];
	size_t len;
	cr_assert_eq(tok_decode(t, ids, 6, out, sizeof(out), &len), 0);
	cr_expect_eq(len, strlen("<|im_start|>hello world\n<|im_end|><tool>"));
	cr_expect_str_eq(out, "<|im_start|>hello world\n<|im_end|><tool>");
	cr_expect_eq(tok_piece(t, 1, 0, out, sizeof(out), &len), 0);
	cr_expect_eq(len, 0, "control tokens print as nothing unless asked");
	cr_expect_eq(tok_piece(t, 1, 1, out, sizeof(out), &len), 0);
	cr_expect_eq(len, 12);
	cr_expect_eq(tok_piece(t, 3, 0, out, sizeof(out), &len), 0);
	cr_expect_eq(len, 6, "user-defined tokens always print");
	cr_expect_eq(tok_piece(t, (int32_t)tok_n_tokens(t), 1, out, sizeof(out), &len), -EINVAL);
	cr_expect_eq(tok_piece(t, -1, 1, out, sizeof(out), &len), -EINVAL);
	cr_expect_eq(tok_decode(t, (int32_t[]){ 99999 }, 1, out, sizeof(out), &len), -EINVAL);
	cr_expect_eq(tok_type(t, 1), TOK_TYPE_CONTROL);
	cr_expect_eq(tok_type(t, 3), TOK_TYPE_USER_DEFINED);
	cr_expect_eq(tok_type(t, -1), -EINVAL);
	cr_expect_eq(tok_bos(t), 1);
	cr_expect_eq(tok_eos(t), 2);
	cr_expect_eq(tok_add_bos(t), 0);
	cr_expect_eq(tok_max_piece_bytes(t), strlen("<|endoftext|>"));
	tok_destroy(t);
}

/* Push ids through a stream; each chunk must hold only whole UTF-8 sequences
 * when valid is set; the chunks together must equal `want`. */
static void stream_check(const struct tok *t, const int32_t *ids, size_t n, int special,
			 const char *want, size_t want_len, const size_t *chunk_lens)
{
	struct tok_stream s;
	tok_stream_init(&s, special);
	char all[4096], out[256];
	size_t at = 0, len;
	for (size_t i = 0; i < n; i++) {
		cr_assert_eq(tok_stream_push(t, &s, ids[i], out, sizeof(out), &len), 0);
		if (chunk_lens)
			cr_expect_eq(len, chunk_lens[i], "chunk %zu: %zu bytes, expected %zu", i, len,
				     chunk_lens[i]);
		memcpy(all + at, out, len);
		at += len;
	}
	cr_assert_eq(tok_stream_flush(&s, out, sizeof(out), &len), 0);
	memcpy(all + at, out, len);
	at += len;
	cr_expect_eq(at, want_len);
	cr_expect(!memcmp(all, want, want_len), "streamed bytes differ");
}

Test(tokenizer, small_stream_holds_split_utf8)
{
	struct tok *t = small_tok("smollm");
	/* 🚀 is F0 9F 9A 80: four byte tokens here */
	const char *rocket = "a\xf0\x9f\x9a\x80" "b";
	int32_t ids[8];
	size_t n = encode(t, rocket, 6, 0, ids, 8);
	cr_assert_eq(n, 6);
	stream_check(t, ids, n, 1, rocket, 6, (const size_t[]){ 1, 0, 0, 0, 4, 1 });
	/* a sequence that cannot complete is passed on as soon as that is clear */
	const char *bad = "\xe2\x82" "A\x80";
	n = encode(t, bad, 4, 0, ids, 8);
	cr_assert_eq(n, 4);
	stream_check(t, ids, n, 1, bad, 4, (const size_t[]){ 0, 0, 3, 1 });
	/* an unfinished sequence at the very end comes out at the flush */
	n = encode(t, "\xf0\x9f", 2, 0, ids, 8);
	stream_check(t, ids, n, 1, "\xf0\x9f", 2, (const size_t[]){ 0, 0 });
	/* special = 0: control tokens vanish from the stream */
	int32_t chat[] = { 1, id_of(t, "hello"), 2 };
	stream_check(t, chat, 3, 0, "hello", 5, (const size_t[]){ 0, 5, 0 });
	/* too small a buffer: -ENOSPC, the stream unchanged */
	struct tok_stream s;
	tok_stream_init(&s, 1);
	char out[16];
	size_t len;
	cr_expect_eq(tok_stream_push(t, &s, ids[0], out, sizeof(out), &len), 0);
	cr_expect_eq(tok_stream_push(t, &s, 1, out, 4, &len), -ENOSPC);
	cr_expect_eq(len, 13);
	cr_expect_eq(s.n_pending, 1);
	tok_destroy(t);
}

Test(tokenizer, small_invalid_utf8_round_trips)
{
	struct tok *t = small_tok("smollm");
	static const char *const cases[] = {
		"\x80", "abc\xc3", "\xc3(", "\xe2\x82", "\xed\xa0\x80", "\xc0\x80",
		"\xf4\x90\x80\x80", "x \xf0\x9f\x98 y", "\xe0\x80\xaf", "ok\x80\x80\x80 12",
	};
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		int32_t ids[64];
		size_t n = encode(t, cases[c], strlen(cases[c]), 0, ids, 64);
		char out[64];
		size_t len;
		cr_assert_eq(tok_decode(t, ids, n, out, sizeof(out), &len), 0);
		cr_expect_eq(len, strlen(cases[c]), "case %zu", c);
		cr_expect(!memcmp(out, cases[c], len), "case %zu does not round-trip", c);
	}
	tok_destroy(t);
}

Test(tokenizer, create_errors)
{
	static struct small_vocab s;
	struct tok *t = (struct tok *)&s;
	char err[256];

	small_vocab_init(&s, "falcon");
	cr_expect_eq(tok_create(&s.v, &t, err, sizeof(err)), -ENOTSUP);
	cr_expect_null(t);
	cr_expect(strstr(err, "falcon"), "%s", err);
	small_vocab_init(&s, NULL);
	cr_expect_eq(tok_create(&s.v, &t, err, sizeof(err)), -ENOTSUP);

	small_vocab_init(&s, "smollm");
	s.v.model = "llama";
	cr_expect_eq(tok_create(&s.v, &t, err, sizeof(err)), -ENOTSUP);
	cr_expect(strstr(err, "llama"), "%s", err);

	small_vocab_init(&s, "smollm");
	s.merges[3] = (struct tok_str){ "hell q", 6 }; /* "hellq" is no token */
	cr_expect_eq(tok_create(&s.v, &t, err, sizeof(err)), -EINVAL);
	cr_expect(strstr(err, "merge 3"), "%s", err);
	s.merges[3] = (struct tok_str){ "hello", 5 };
	cr_expect_eq(tok_create(&s.v, &t, err, sizeof(err)), -EINVAL);

	small_vocab_init(&s, "smollm");
	s.v.eos_id = (int32_t)s.v.n_tokens;
	cr_expect_eq(tok_create(&s.v, &t, err, sizeof(err)), -EINVAL);
	cr_expect(strstr(err, "eos"), "%s", err);

	small_vocab_init(&s, "smollm");
	s.v.n_tokens = 0;
	cr_expect_eq(tok_create(&s.v, &t, err, sizeof(err)), -EINVAL);
	cr_expect_eq(tok_create(NULL, &t, NULL, 0), -EINVAL);
}

/* ---------------------------------------------------------------------------
 * Unicode
 * ------------------------------------------------------------------------- */

Test(tokenizer, unicode_classes)
{
	cr_expect_str_eq(uni_version(), "15.1.0");
	static const struct {
		uint32_t cp;
		enum uni_class c;
	} cases[] = {
		{ 'a', UNI_LETTER }, { 'Z', UNI_LETTER }, { '5', UNI_NUMBER }, { ' ', UNI_SPACE },
		{ '\t', UNI_SPACE }, { '\r', UNI_SPACE }, { '_', UNI_OTHER }, { '\'', UNI_OTHER },
		{ 0x00, UNI_OTHER }, { 0x1C, UNI_OTHER }, /* not \s, though Python's isspace says so */
		{ 0x85, UNI_SPACE }, { 0xA0, UNI_SPACE }, { 0x3000, UNI_SPACE }, { 0x2029, UNI_SPACE },
		{ 0x200B, UNI_OTHER }, /* zero width space is Cf */
		{ 0xE9, UNI_LETTER }, { 0x4E2D, UNI_LETTER }, { 0x0416, UNI_LETTER },
		{ 0x02B0, UNI_LETTER }, /* Lm */
		{ 0x0301, UNI_OTHER },  /* combining acute: Mn */
		{ 0x0661, UNI_NUMBER }, { 0xBD, UNI_NUMBER }, { 0x216B, UNI_NUMBER }, { 0xFF11, UNI_NUMBER },
		{ 0x1F680, UNI_OTHER }, { 0x2EBF0, UNI_LETTER }, /* CJK Ext. I: new in 15.1 */
		{ 0x10FFFF, UNI_OTHER }, { UNI_INVALID, UNI_OTHER },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		cr_expect_eq(uni_class_of(cases[i].cp), cases[i].c, "U+%04X: %d, expected %d",
			     cases[i].cp, uni_class_of(cases[i].cp), cases[i].c);
}

Test(tokenizer, unicode_utf8_decode)
{
	static const struct {
		const char *s;
		size_t len;
		uint32_t cp;
	} cases[] = {
		{ "A", 1, 'A' }, { "\xc3\xa9", 2, 0xE9 }, { "\xe2\x82\xac", 3, 0x20AC },
		{ "\xf0\x9f\x9a\x80", 4, 0x1F680 }, { "\xf4\x8f\xbf\xbf", 4, 0x10FFFF },
		{ "\x80", 1, UNI_INVALID }, { "\xc0\x80", 1, UNI_INVALID },
		{ "\xc1\xbf", 1, UNI_INVALID }, { "\xe0\x9f\xbf", 1, UNI_INVALID },
		{ "\xed\xa0\x80", 1, UNI_INVALID }, { "\xf0\x8f\xbf\xbf", 1, UNI_INVALID },
		{ "\xf4\x90\x80\x80", 1, UNI_INVALID }, { "\xf5\x80\x80\x80", 1, UNI_INVALID },
		{ "\xff", 1, UNI_INVALID }, { "\xc3(", 1, UNI_INVALID }, { "\xe2\x82", 1, UNI_INVALID },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		uint32_t cp;
		size_t k = uni_utf8_decode((const unsigned char *)cases[i].s, strlen(cases[i].s), &cp);
		cr_expect_eq(k, cases[i].len, "case %zu: length %zu", i, k);
		cr_expect_eq(cp, cases[i].cp, "case %zu: U+%04X", i, cp);
	}
	static const struct {
		const char *s;
		size_t tail;
	} tails[] = {
		{ "", 0 }, { "a", 0 }, { "a\xf0", 1 }, { "a\xf0\x9f", 2 }, { "\xf0\x9f\x9a", 3 },
		{ "\xf0\x9f\x9a\x80", 0 }, { "\xe2\x82", 2 }, { "\xe2\x82\xac", 0 }, { "\x80", 0 },
		{ "\xe0\x80", 0 }, /* overlong: cannot complete */ { "\xed\xa0", 0 }, { "\xff", 0 },
		{ "\xc3", 1 }, { "\x80\x80\x80", 0 }, { "\xf4\x90", 0 },
	};
	for (size_t i = 0; i < sizeof(tails) / sizeof(tails[0]); i++)
		cr_expect_eq(uni_utf8_incomplete_tail((const unsigned char *)tails[i].s, strlen(tails[i].s)),
			     tails[i].tail, "tail case %zu", i);
}

/* ---------------------------------------------------------------------------
 * ChatML
 * ------------------------------------------------------------------------- */

static const char *render(const struct tok_message *m, size_t n, int gen, char *out, size_t cap)
{
	size_t len;
	cr_assert_eq(tok_chat_template(m, n, gen, out, cap, &len), 0);
	cr_assert_eq(len, strlen(out));
	return out;
}

Test(tokenizer, chat_template_chatml)
{
	char out[1024];
	/* docs: shared/reference/smollm2.md, llama-server /apply-template */
	struct tok_message hello[] = { { "user", "Hello" } };
	cr_expect_str_eq(render(hello, 1, 1, out, sizeof(out)),
			 "<|im_start|>system\n"
			 "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
			 "<|im_start|>user\n"
			 "Hello<|im_end|>\n"
			 "<|im_start|>assistant\n");
	struct tok_message sys[] = { { "system", "Be brief." }, { "user", "Hi" },
				     { "assistant", "Hello." } };
	cr_expect_str_eq(render(sys, 3, 0, out, sizeof(out)),
			 "<|im_start|>system\nBe brief.<|im_end|>\n"
			 "<|im_start|>user\nHi<|im_end|>\n"
			 "<|im_start|>assistant\nHello.<|im_end|>\n");
	cr_expect_str_eq(render(NULL, 0, 1, out, sizeof(out)), "<|im_start|>assistant\n");
	size_t len;
	cr_expect_eq(tok_chat_template(hello, 1, 1, out, 10, &len), -ENOSPC);
	cr_expect_eq(len, 153);
	struct tok_message bad[] = { { "user", NULL } };
	cr_expect_eq(tok_chat_template(bad, 1, 1, out, sizeof(out), &len), -EINVAL);
}

/* ---------------------------------------------------------------------------
 * The other families' prompt formats (bench/model/chat.h), as their published
 * templates render them (transformers' apply_chat_template)
 * ------------------------------------------------------------------------- */

#define R1_USER "<\xef\xbd\x9c" "User\xef\xbd\x9c>"
#define R1_ASSISTANT "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>"
#define R1_END "<\xef\xbd\x9c" "end\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>"

static const char *render_as(const char *tmpl, const char *arch, const struct tok_message *m, size_t n,
			     int think, char *out, size_t cap)
{
	struct chat_format f;
	chat_detect(tmpl, tmpl ? strlen(tmpl) : 0, arch, NULL, &f);
	size_t len;
	cr_assert_eq(chat_render(&f, m, n, 1, think, out, cap, &len), 0);
	cr_assert_eq(len, strlen(out));
	return out;
}

Test(chat, detects_the_family)
{
	struct chat_format f;
	chat_detect("{{ bos_token }}<|start_header_id|>", 34, "llama", NULL, &f);
	cr_expect_eq(f.style, CHAT_LLAMA3);
	cr_expect_eq(f.llama31_preamble, 0);
	const char *r1 = "{{ bos_token }}{{ ns.system_prompt }}" R1_USER R1_ASSISTANT "<think>\\n";
	chat_detect(r1, strlen(r1), "qwen2", NULL, &f);
	cr_expect_eq(f.style, CHAT_DEEPSEEK_R1);
	cr_expect_eq(f.thinking, 1);
	const char *qwen3 = "<|im_start|>{%- if enable_thinking is defined and enable_thinking is false %}";
	chat_detect(qwen3, strlen(qwen3), "qwen3", NULL, &f);
	cr_expect_eq(f.style, CHAT_CHATML);
	cr_expect_eq(f.thinking, 1);
	cr_expect_null(f.default_system);
	const char *qwen25 = "<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
			     "assistant.<|im_end|>";
	chat_detect(qwen25, strlen(qwen25), "qwen2", NULL, &f);
	cr_expect_str_eq(f.default_system, "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
	cr_expect_eq(f.thinking, 0);
	/* no template: by architecture */
	chat_detect(NULL, 0, "qwen3", NULL, &f);
	cr_expect(f.style == CHAT_CHATML && f.thinking);
	chat_detect(NULL, 0, "llama", NULL, &f);
	cr_expect(f.style == CHAT_CHATML && !f.thinking);
	cr_expect_str_eq(chat_style_name(CHAT_DEEPSEEK_R1), "deepseek-r1");
}

Test(chat, llama3)
{
	char out[1024];
	struct tok_message m[] = { { "system", "Be brief." }, { "user", " Hi \n" } };
	cr_expect_str_eq(render_as("<|start_header_id|>", "llama", m, 2, -1, out, sizeof(out)),
			 "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
			 "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
			 "<|start_header_id|>assistant<|end_header_id|>\n\n");
	/* 3.1: the dated system header, holding the system message */
	cr_expect_str_eq(render_as("<|start_header_id|> Cutting Knowledge Date", "llama", m, 2, -1, out, sizeof(out)),
			 "<|start_header_id|>system<|end_header_id|>\n\n"
			 "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
			 "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
			 "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

Test(chat, deepseek_r1_thinking)
{
	char out[1024];
	struct tok_message m[] = { { "system", "S." }, { "user", "Q1" },
				   { "assistant", "<think>\nlet me see\n</think>\n\nA1" }, { "user", "Q2" } };
	const char *tmpl = R1_USER R1_ASSISTANT;
	cr_expect_str_eq(render_as(tmpl, "qwen2", m, 4, -1, out, sizeof(out)),
			 "S." R1_USER "Q1" R1_ASSISTANT "A1" R1_END R1_USER "Q2" R1_ASSISTANT "<think>\n");
	cr_expect_str_eq(render_as(tmpl, "qwen2", m + 3, 1, 0, out, sizeof(out)),
			 R1_USER "Q2" R1_ASSISTANT "<think>\n\n</think>\n\n");
}

Test(chat, qwen3_thinking_switch)
{
	char out[1024];
	struct tok_message m[] = { { "user", "Hi" }, { "assistant", "<think>\nhm\n</think>\n\nHello" },
				   { "user", "More" } };
	const char *tmpl = "<|im_start|> enable_thinking";
	const char *turns = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
			    "<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n";
	char want[512];
	cr_expect_str_eq(render_as(tmpl, "qwen3", m, 3, -1, out, sizeof(out)), turns);
	snprintf(want, sizeof(want), "%s<think>\n\n</think>\n\n", turns);
	cr_expect_str_eq(render_as(tmpl, "qwen3", m, 3, 0, out, sizeof(out)), want);
	/* Qwen2.5: its default system turn, no thinking */
	const char *q25 = "<|im_start|> You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";
	cr_expect_str_eq(render_as(q25, "qwen2", m, 1, 0, out, sizeof(out)),
			 "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
			 "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
	struct tok_message bad[] = { { "tool", "x" } };
	struct chat_format f;
	chat_detect(tmpl, strlen(tmpl), "qwen3", NULL, &f);
	size_t len;
	cr_expect_eq(chat_render(&f, bad, 1, 1, -1, out, sizeof(out), &len), -EINVAL);
	cr_expect_eq(chat_render(&f, m, 3, 1, -1, out, 8, &len), -ENOSPC);
	cr_expect_eq(len, strlen(turns));
}

/* ---------------------------------------------------------------------------
 * The real vocabulary, read with bench/model/gguf.h
 * ------------------------------------------------------------------------- */

struct model_vocab {
	struct gguf *g;
	struct tok_vocab v;
	struct tok_str *tokens, *merges;
	int32_t *types;
	char model[32], pre[32];
	char *template; /* tokenizer.chat_template, NUL-terminated */
};

static void model_vocab_free(struct model_vocab *m)
{
	free(m->tokens);
	free(m->merges);
	free(m->types);
	free(m->template);
	gguf_close(m->g);
	memset(m, 0, sizeof(*m));
}

/* A string array as tok_str pointing into the mapping. */
static struct tok_str *load_strs(const struct gguf *g, const char *key, size_t *n)
{
	uint32_t et;
	uint64_t count;
	cr_assert_eq(gguf_get_arr(g, key, &et, &count, NULL), 0, "%s", key);
	cr_assert_eq(et, GGUF_TYPE_STRING, "%s", key);
	struct tok_str *v = calloc(count ? count : 1, sizeof(*v));
	cr_assert_not_null(v);
	for (uint64_t i = 0; i < count; i++)
		cr_assert_eq(gguf_get_arr_str(g, key, i, &v[i].ptr, &v[i].len), 0, "%s[%lu]", key,
			     (unsigned long)i);
	*n = (size_t)count;
	return v;
}

static void load_cstr(const struct gguf *g, const char *key, char *out, size_t cap)
{
	const char *p;
	size_t len;
	cr_assert_eq(gguf_get_str(g, key, &p, &len), 0, "%s", key);
	cr_assert_lt(len, cap, "%s", key);
	memcpy(out, p, len);
	out[len] = '\0';
}

static int32_t load_id(const struct gguf *g, const char *key)
{
	uint32_t x;
	return gguf_get_u32(g, key, &x) ? -1 : (int32_t)x;
}

static void model_vocab_load(struct model_vocab *m, const char *path)
{
	memset(m, 0, sizeof(*m));
	char err[512];
	int ret = gguf_open(path, &m->g, err, sizeof(err));
	cr_assert_eq(ret, 0, "gguf_open: %d %s", ret, err);
	const struct gguf *g = m->g;
	load_cstr(g, "tokenizer.ggml.model", m->model, sizeof(m->model));
	load_cstr(g, "tokenizer.ggml.pre", m->pre, sizeof(m->pre));
	m->tokens = load_strs(g, "tokenizer.ggml.tokens", &m->v.n_tokens);
	m->merges = load_strs(g, "tokenizer.ggml.merges", &m->v.n_merges);
	uint32_t et;
	uint64_t count;
	const void *data;
	cr_assert_eq(gguf_get_arr(g, "tokenizer.ggml.token_type", &et, &count, &data), 0);
	cr_assert_eq(et, GGUF_TYPE_INT32);
	cr_assert_eq(count, m->v.n_tokens);
	m->types = malloc(count * sizeof(*m->types));
	cr_assert_not_null(m->types);
	memcpy(m->types, data, count * sizeof(*m->types)); /* little-endian, maybe unaligned */
	m->v.bos_id = load_id(g, "tokenizer.ggml.bos_token_id");
	m->v.eos_id = load_id(g, "tokenizer.ggml.eos_token_id");
	m->v.unk_id = load_id(g, "tokenizer.ggml.unknown_token_id");
	bool add_bos = false;
	gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &add_bos);
	m->v.add_bos = add_bos;
	const char *tp;
	size_t tl;
	if (!gguf_get_str(g, "tokenizer.chat_template", &tp, &tl)) {
		m->template = strndup(tp, tl);
		cr_assert_not_null(m->template);
	}
	m->v.model = m->model;
	m->v.pre = m->pre;
	m->v.tokens = m->tokens;
	m->v.merges = m->merges;
	m->v.types = m->types;
}

/* The SmolLM2 tokenizer, or skip the test when the model is absent. */
static struct tok *model_tok(struct model_vocab *keep)
{
	char path[PATH_MAX];
	int ret = gguf_default_model_path(path, sizeof(path));
	if (ret)
		cr_skip_test("model not available: %s%s%s (bench/model/fetch_model.sh fetches it)",
			     path[0] ? path : "no KVR_MODEL_PATH, XDG_CACHE_HOME or HOME",
			     path[0] ? ": " : "", path[0] ? strerror(-ret) : "");
	struct model_vocab m;
	model_vocab_load(&m, path);
	struct tok *t;
	char err[256] = "";
	ret = tok_create(&m.v, &t, err, sizeof(err));
	cr_assert_eq(ret, 0, "tok_create: %d %s", ret, err);
	if (keep)
		*keep = m;
	else
		model_vocab_free(&m);
	return t;
}

/* ---------------------------------------------------------------------------
 * Fixtures (tests/data/tokenizer/cases.txt)
 * ------------------------------------------------------------------------- */

struct enc_case {
	char name[64];
	int special;
	char *text;
	size_t len;
	int32_t *ids;
	size_t n_ids;
};

struct chat_case {
	char name[64];
	int gen;
	size_t n;
	struct tok_message msgs[8];
	char *rendered;
	size_t rendered_len;
};

struct fixtures {
	struct enc_case enc[96];
	size_t n_enc;
	struct chat_case chat[16];
	size_t n_chat;
	char *line;
};

/* The directory of the fixtures: $KVR_TOKENIZER_DATA, or tests/data/tokenizer
 * found from this source file's path as the compiler saw it (relative to the
 * build directory, which is the test program's parent directory). */
static void data_dir(char *out, size_t cap)
{
	const char *env = getenv("KVR_TOKENIZER_DATA");
	if (env && *env) {
		snprintf(out, cap, "%s", env);
		return;
	}
	char src[PATH_MAX];
	snprintf(src, sizeof(src), "%s", __FILE__);
	char *dir = dirname(src);
	if (dir[0] == '/') {
		snprintf(out, cap, "%s/data/tokenizer", dir);
		return;
	}
	char exe[PATH_MAX];
	ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	cr_assert_gt(n, 0, "readlink /proc/self/exe: %s", strerror(errno));
	exe[n] = '\0';
	char *bin = dirname(exe); /* <build>/tests */
	snprintf(out, cap, "%s/../%s/data/tokenizer", bin, dir);
}

static char *hex_decode(const char *h, size_t *len)
{
	if (!strcmp(h, "-")) {
		*len = 0;
		return calloc(1, 1);
	}
	size_t n = strlen(h) / 2;
	char *out = malloc(n + 1);
	cr_assert_not_null(out);
	for (size_t i = 0; i < n; i++) {
		unsigned x;
		cr_assert_eq(sscanf(h + 2 * i, "%2x", &x), 1, "bad hex");
		out[i] = (char)x;
	}
	out[n] = '\0';
	*len = n;
	return out;
}

static void fixtures_load(struct fixtures *f)
{
	memset(f, 0, sizeof(*f));
	char dir[PATH_MAX], path[PATH_MAX + 16];
	data_dir(dir, sizeof(dir));
	snprintf(path, sizeof(path), "%s/cases.txt", dir);
	FILE *fp = fopen(path, "r");
	cr_assert_not_null(fp, "%s: %s (set KVR_TOKENIZER_DATA)", path, strerror(errno));
	size_t cap = 0;
	while (getline(&f->line, &cap, fp) > 0) {
		char *save, *kind = strtok_r(f->line, " \n", &save);
		if (!kind || kind[0] == '#')
			continue;
		if (!strcmp(kind, "enc")) {
			cr_assert_lt(f->n_enc, sizeof(f->enc) / sizeof(f->enc[0]));
			struct enc_case *e = &f->enc[f->n_enc++];
			snprintf(e->name, sizeof(e->name), "%s", strtok_r(NULL, " \n", &save));
			e->special = atoi(strtok_r(NULL, " \n", &save));
			e->text = hex_decode(strtok_r(NULL, " \n", &save), &e->len);
			e->n_ids = strtoul(strtok_r(NULL, " \n", &save), NULL, 10);
			e->ids = malloc((e->n_ids + 1) * sizeof(*e->ids));
			cr_assert_not_null(e->ids);
			for (size_t i = 0; i < e->n_ids; i++) {
				char *tokn = strtok_r(NULL, " \n", &save);
				cr_assert_not_null(tokn, "%s: short id list", e->name);
				e->ids[i] = (int32_t)strtol(tokn, NULL, 10);
			}
		} else if (!strcmp(kind, "chat")) {
			cr_assert_lt(f->n_chat, sizeof(f->chat) / sizeof(f->chat[0]));
			struct chat_case *c = &f->chat[f->n_chat++];
			snprintf(c->name, sizeof(c->name), "%s", strtok_r(NULL, " \n", &save));
			c->gen = atoi(strtok_r(NULL, " \n", &save));
			c->n = strtoul(strtok_r(NULL, " \n", &save), NULL, 10);
			cr_assert_leq(c->n, 8);
			for (size_t i = 0; i < c->n; i++) {
				size_t l;
				c->msgs[i].role = hex_decode(strtok_r(NULL, " \n", &save), &l);
				c->msgs[i].content = hex_decode(strtok_r(NULL, " \n", &save), &l);
			}
			c->rendered = hex_decode(strtok_r(NULL, " \n", &save), &c->rendered_len);
		}
	}
	fclose(fp);
	cr_assert_gt(f->n_enc, 0, "%s has no cases", path);
}

static void fixtures_free(struct fixtures *f)
{
	for (size_t i = 0; i < f->n_enc; i++) {
		free(f->enc[i].text);
		free(f->enc[i].ids);
	}
	for (size_t i = 0; i < f->n_chat; i++) {
		for (size_t k = 0; k < f->chat[i].n; k++) {
			free((char *)f->chat[i].msgs[k].role);
			free((char *)f->chat[i].msgs[k].content);
		}
		free(f->chat[i].rendered);
	}
	free(f->line);
}

static const struct enc_case *find_case(const struct fixtures *f, const char *name)
{
	for (size_t i = 0; i < f->n_enc; i++)
		if (!strcmp(f->enc[i].name, name))
			return &f->enc[i];
	cr_assert_fail("no fixture \"%s\"", name);
	return NULL;
}

Test(tokenizer, fixtures_chat_template)
{
	/* needs no model: the expected prompts are in the fixtures */
	struct fixtures f;
	fixtures_load(&f);
	cr_assert_gt(f.n_chat, 0);
	for (size_t i = 0; i < f.n_chat; i++) {
		const struct chat_case *c = &f.chat[i];
		char out[4096];
		size_t len;
		cr_assert_eq(tok_chat_template(c->msgs, c->n, c->gen, out, sizeof(out), &len), 0);
		cr_expect_eq(len, c->rendered_len, "%s: %zu bytes, expected %zu", c->name, len,
			     c->rendered_len);
		cr_expect(!memcmp(out, c->rendered, c->rendered_len), "%s: rendered\n%s\nexpected\n%s",
			  c->name, out, c->rendered);
	}
	fixtures_free(&f);
}

/* ---------------------------------------------------------------------------
 * The real vocabulary
 * ------------------------------------------------------------------------- */

Test(tokenizer, model_vocabulary_shape)
{
	struct model_vocab m;
	struct tok *t = model_tok(&m);
	cr_expect_str_eq(m.model, "gpt2");
	cr_expect_str_eq(m.pre, "smollm");
	cr_expect_eq(tok_n_tokens(t), 49152);
	cr_expect_eq(m.v.n_merges, 48900);
	cr_expect_eq(tok_bos(t), 1);
	cr_expect_eq(tok_eos(t), 2);
	cr_expect_eq(tok_add_bos(t), 0, "SmolLM2's GGUF says add_bos_token = false");
	cr_expect_eq(tok_find(t, "<|im_start|>", 12), 1);
	cr_expect_eq(tok_find(t, "<|im_end|>", 10), 2);
	cr_expect_eq(tok_find(t, "<|endoftext|>", 13), 0);
	for (int32_t id = 0; id <= 16; id++)
		cr_expect_eq(tok_type(t, id), TOK_TYPE_CONTROL, "id %d", id);
	cr_expect_eq(tok_type(t, 17), TOK_TYPE_NORMAL);
	/* the template this file renders is the one the GGUF carries */
	cr_assert_not_null(m.template);
	cr_expect(strstr(m.template, "You are a helpful AI assistant named SmolLM, trained by "
				     "Hugging Face<|im_end|>"));
	cr_expect(strstr(m.template, "'<|im_start|>' + message['role'] + '\n' + "
				     "message['content'] + '<|im_end|>' + '\n'"));
	cr_expect(strstr(m.template, "{{ '<|im_start|>assistant\n' }}"));
	model_vocab_free(&m);
	tok_destroy(t);
}

Test(tokenizer, model_fixture_ids)
{
	struct tok *t = model_tok(NULL);
	struct fixtures f;
	fixtures_load(&f);
	size_t checked = 0;
	for (size_t i = 0; i < f.n_enc; i++) {
		const struct enc_case *e = &f.enc[i];
		size_t cap = e->n_ids + 16, n;
		int32_t *ids = malloc(cap * sizeof(*ids));
		cr_assert_not_null(ids);
		int ret = tok_encode(t, e->text, e->len, e->special, ids, cap, &n);
		cr_expect_eq(ret, 0, "%s: %d", e->name, ret);
		cr_expect_eq(n, e->n_ids, "%s: %zu ids, expected %zu", e->name, n, e->n_ids);
		size_t k = n < e->n_ids ? n : e->n_ids;
		for (size_t j = 0; j < k; j++)
			if (ids[j] != e->ids[j]) {
				cr_expect_fail("%s: id %zu is %d, expected %d", e->name, j, ids[j],
					       e->ids[j]);
				break;
			}
		checked++;
		free(ids);
	}
	cr_log_info("%zu fixture strings encoded to llama.cpp's ids", checked);
	fixtures_free(&f);
	tok_destroy(t);
}

/* decode(encode(s)) must give s back, less the bytes the vocabulary has no
 * token for (the reference drops those too). */
static void expect_round_trip(const struct tok *t, const char *name, const char *s, size_t len,
			      int special)
{
	size_t n;
	int ret = tok_encode(t, s, len, special, NULL, 0, &n);
	cr_assert(ret == 0 || ret == -ENOSPC);
	int32_t *ids = malloc((n + 1) * sizeof(*ids));
	char *out = malloc(len + 1), *want = malloc(len + 1);
	cr_assert(ids && out && want);
	cr_assert_eq(tok_encode(t, s, len, special, ids, n, &n), 0);
	size_t wl = 0;
	for (size_t i = 0; i < len; i++) {
		char u[4];
		if (tok_find(t, u, put_utf8(u, byte_char((unsigned char)s[i]))) >= 0)
			want[wl++] = s[i];
	}
	size_t out_len;
	cr_assert_eq(tok_decode(t, ids, n, out, len + 1, &out_len), 0, "%s", name);
	cr_expect_eq(out_len, wl, "%s: %zu bytes back, expected %zu", name, out_len, wl);
	cr_expect(!memcmp(out, want, wl < out_len ? wl : out_len), "%s: bytes differ", name);
	free(ids);
	free(out);
	free(want);
}

Test(tokenizer, model_round_trips)
{
	struct tok *t = model_tok(NULL);
	struct fixtures f;
	fixtures_load(&f);
	for (size_t i = 0; i < f.n_enc; i++)
		expect_round_trip(t, f.enc[i].name, f.enc[i].text, f.enc[i].len, f.enc[i].special);
	fixtures_free(&f);
	tok_destroy(t);
}

Test(tokenizer, model_invalid_utf8)
{
	struct tok *t = model_tok(NULL);
	static const char *const cases[] = {
		"\x80", "abc\xc3", "\xc3(", "caf\xe9 au lait", "\xe2\x82", "\xed\xa0\x80 x",
		"\xc0\x80", "\xf4\x90\x80\x80", "emoji \xf0\x9f\x98 cut", "\xe0\x80\xaf",
		"ok\x80\x80\x80 12", "\xfe\xff mixed \xff", "\x01\x02\x03\x04\x05",
	};
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++)
		expect_round_trip(t, cases[c], cases[c], strlen(cases[c]), 0);
	/* random bytes: no crash, and the same round trip */
	uint64_t x = 0x9e3779b97f4a7c15ull;
	for (int r = 0; r < 300; r++) {
		char buf[200];
		size_t len = (size_t)(r % 200);
		for (size_t i = 0; i < len; i++) {
			x ^= x << 13;
			x ^= x >> 7;
			x ^= x << 17;
			/* skew towards UTF-8 lead and continuation bytes and spaces */
			unsigned v = (unsigned)(x >> 24) & 0xFF;
			buf[i] = (char)(v < 64 ? 0x80 + (v & 0x3F) : v < 96 ? ' ' : v < 128 ? '7' : v);
		}
		expect_round_trip(t, "random", buf, len, r & 1);
	}
	tok_destroy(t);
}

Test(tokenizer, model_stream_split_utf8)
{
	struct tok *t = model_tok(NULL);
	struct fixtures f;
	fixtures_load(&f);
	static const char *const names[] = { "emoji", "emoji_zwj", "cjk", "korean", "combining",
					     "special_chat", "gpl3_paragraph" };
	size_t split = 0;
	for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++) {
		const struct enc_case *e = find_case(&f, names[k]);
		struct tok_stream s;
		tok_stream_init(&s, 1);
		size_t cap = tok_max_piece_bytes(t) + 3, at = 0, len;
		char *out = malloc(cap), *all = malloc(e->len + 1);
		cr_assert(out && all);
		for (size_t i = 0; i < e->n_ids; i++) {
			char piece[256];
			size_t pl;
			cr_assert_eq(tok_piece(t, e->ids[i], 1, piece, sizeof(piece), &pl), 0);
			if (uni_utf8_incomplete_tail((const unsigned char *)piece, pl))
				split++; /* this token ends inside a character */
			cr_assert_eq(tok_stream_push(t, &s, e->ids[i], out, cap, &len), 0);
			/* what comes out is always whole characters */
			for (size_t o = 0; o < len;) {
				uint32_t cp;
				size_t step = uni_utf8_decode((unsigned char *)out + o, len - o, &cp);
				cr_expect_neq(cp, UNI_INVALID, "%s: chunk %zu splits a character",
					      e->name, i);
				o += step;
			}
			cr_assert_leq(at + len, e->len);
			memcpy(all + at, out, len);
			at += len;
		}
		cr_assert_eq(tok_stream_flush(&s, out, cap, &len), 0);
		cr_expect_eq(len, 0);
		cr_expect_eq(at, e->len, "%s", e->name);
		cr_expect(!memcmp(all, e->text, e->len), "%s: streamed text differs", e->name);
		free(out);
		free(all);
	}
	cr_expect_gt(split, 0, "the cases include a character split over two tokens");
	fixtures_free(&f);
	tok_destroy(t);
}

struct thread_job {
	const struct tok *t;
	const struct enc_case *e;
	int ok;
};

static void *encode_thread(void *arg)
{
	struct thread_job *j = arg;
	size_t cap = j->e->n_ids + 1, n;
	int32_t *ids = malloc(cap * sizeof(*ids));
	j->ok = ids != NULL;
	for (int r = 0; r < 3 && j->ok; r++)
		j->ok = !tok_encode(j->t, j->e->text, j->e->len, 0, ids, cap, &n) &&
			n == j->e->n_ids && !memcmp(ids, j->e->ids, n * sizeof(*ids));
	free(ids);
	return NULL;
}

Test(tokenizer, model_threads_share_one_tokenizer)
{
	struct tok *t = model_tok(NULL);
	struct fixtures f;
	fixtures_load(&f);
	pthread_t th[4];
	struct thread_job jobs[4];
	for (int i = 0; i < 4; i++) {
		jobs[i] = (struct thread_job){ t, find_case(&f, i & 1 ? "gpl3_full" : "gpl3_paragraph"), 0 };
		cr_assert_eq(pthread_create(&th[i], NULL, encode_thread, &jobs[i]), 0);
	}
	for (int i = 0; i < 4; i++) {
		pthread_join(th[i], NULL);
		cr_expect(jobs[i].ok, "thread %d", i);
	}
	fixtures_free(&f);
	tok_destroy(t);
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

Test(tokenizer, model_encode_speed_gpl3)
{
	struct model_vocab m;
	double t0 = now_s();
	struct tok *t = model_tok(&m);
	double t_create = now_s() - t0;
	struct fixtures f;
	fixtures_load(&f);
	const struct enc_case *e = find_case(&f, "gpl3_full");
	int32_t *ids = malloc((e->n_ids + 1) * sizeof(*ids));
	cr_assert_not_null(ids);
	size_t n = 0;
	int reps = 0;
	t0 = now_s();
	double el;
	do {
		cr_assert_eq(tok_encode(t, e->text, e->len, 0, ids, e->n_ids + 1, &n), 0);
		reps++;
		el = now_s() - t0;
	} while (el < 0.5 && reps < 1000);
	cr_expect_eq(n, e->n_ids);
	/* printed, not asserted: the number depends on the machine and sanitizers */
	fprintf(stderr, "tokenizer: GPL-3 (%zu bytes) -> %zu tokens in %.2f ms: %.0f tokens/s, "
		"%.1f MB/s; tok_create %.1f ms (%zu tokens, %zu merges)\n", e->len, n,
		1e3 * el / reps, (double)n * reps / el, (double)e->len * reps / el / 1e6,
		1e3 * t_create, tok_n_tokens(t), m.v.n_merges);
	free(ids);
	model_vocab_free(&m);
	fixtures_free(&f);
	tok_destroy(t);
}
