/* SPDX-License-Identifier: MIT */
/*
 * fuzz_tokenizer.c — the fuzz harness for the tokenizer: prompts
 * are untrusted text, and a GGUF's vocabulary is untrusted too, so an input
 * chooses a vocabulary (one of four built here, or one it spells out itself:
 * tokens, types, merges, bos/eos/unk) and a text, which is encoded with and
 * without parse_special (or rendered as a ChatML user turn first), decoded
 * whole, token by token and through a stream, and looked at piece by piece,
 * with ids from the input, in range or not.
 *
 * What is checked is what tokenizer.h promises: counting (ids NULL) and
 * -ENOSPC give the full count and the same ids; ids are in the vocabulary;
 * decoding is the concatenation of the pieces, and so is a stream's output
 * plus its flush, in buffers of tok_max_piece_bytes + 3; pieces of ids
 * outside the vocabulary are -EINVAL; a vocabulary tok_create refuses comes
 * with a message. With the built-in vocabularies, which hold every byte's
 * token and merges that stay inside it, decode(encode(x)) == x for any bytes
 * x, special tokens parsed or not ("so decode(encode(s, parse_special)) ==
 * s"), minus the bytes the vocabulary has no token for (dropped, as
 * llama.cpp drops them).
 *
 * Input layout: byte 0 flags (below), bytes 1-3 bos, eos and unk ids (int8,
 * for a spelled-out vocabulary), then the text; with FL_OWN_VOCAB the text is
 * preceded by "tokens\0merges\0", one per line, each token line's first byte
 * its type (& 7: 6 and 7 are outside enum tok_type).
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "tokenizer.h"

enum {
	FL_SPECIAL = 1 << 0,   /* parse_special */
	FL_GPT2 = 1 << 1,      /* pre-tokenizer gpt2, else smollm */
	FL_HOLES = 1 << 2,     /* built-in vocabulary without some bytes' tokens */
	FL_OWN_VOCAB = 1 << 3, /* the input spells out the vocabulary */
	FL_BYTES = 1 << 4,     /* own vocabulary: every byte's token first */
	FL_TYPES = 1 << 5,     /* own vocabulary: types from the input, else all normal */
	FL_CHAT = 1 << 6,      /* render the text as a ChatML user turn first */
	FL_NO_MODEL = 1 << 7,  /* own vocabulary: model NULL (taken as gpt2) */
};
#define HEADER 4

/* Bytes the FL_HOLES vocabularies have no token for. */
static bool is_hole(unsigned char c)
{
	return c == 0xff || c == 0x00 || c == 'q';
}

/* ---- the built-in vocabularies ------------------------------------------- */

/* Each side is a byte-level character or an earlier merge's result. */
static const char *const builtin_merges[] = {
	"h e", "l l", "he ll", "hell o", "\xc4\xa0 w", "o r", "\xc4\xa0w or", "\xc4\xa0wor l",
	"\xc4\xa0worl d", "o \xc4\xa0", "1 2", "\xc4\xa0 1", "\xc4\xa0 \xc4\xa0",
	"\xc4\xa0\xc4\xa0 \xc4\xa0\xc4\xa0", "' s", "' ll", "a a", "aa a", "b c", "a b", "a bc",
	"t \xc4\xa0", "t h", "\xc4\xa0 t", "\xc4\xa0t he", "i n", "in g", "e r", "\xc4\x8a \xc4\x8a",
	"\xc3\x83 \xc2\xa9", "\xc3\xa6 \xc4\xbe", "\xc3\xa6\xc4\xbe \xc2\xac", "< |", "| >",
	"\xc4\xa0 <", "1 1", "11 1",
};
#define N_BUILTIN_MERGES (sizeof(builtin_merges) / sizeof(builtin_merges[0]))

static const char *const builtin_special[] = {
	"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>", "<unk>",
};
static const int32_t builtin_special_type[] = {
	TOK_TYPE_CONTROL, TOK_TYPE_CONTROL, TOK_TYPE_CONTROL, TOK_TYPE_USER_DEFINED,
	TOK_TYPE_UNKNOWN,
};
#define N_BUILTIN_SPECIAL 5
#define IM_START 1

static struct tok *builtin[4]; /* [holes][gpt2] */

static struct tok *make_builtin(bool holes, bool gpt2)
{
	static char text[N_BUILTIN_SPECIAL + 256 + N_BUILTIN_MERGES][32];
	static struct tok_str tokens[N_BUILTIN_SPECIAL + 256 + N_BUILTIN_MERGES];
	static int32_t types[N_BUILTIN_SPECIAL + 256 + N_BUILTIN_MERGES];
	static struct tok_str merges[N_BUILTIN_MERGES];
	size_t n = 0;
	for (size_t i = 0; i < N_BUILTIN_SPECIAL; i++, n++) {
		snprintf(text[n], sizeof(text[n]), "%s", builtin_special[i]);
		types[n] = builtin_special_type[i];
		tokens[n] = (struct tok_str){ text[n], strlen(text[n]) };
	}
	for (unsigned c = 0; c < 256; c++) {
		if (holes && is_hole((unsigned char)c))
			continue;
		tokens[n] = (struct tok_str){ text[n], fuzz_byte_char(c, text[n]) };
		types[n++] = TOK_TYPE_NORMAL;
	}
	for (size_t m = 0; m < N_BUILTIN_MERGES; m++, n++) {
		const char *s = builtin_merges[m], *sp = strchr(s, ' ');
		size_t l = (size_t)(sp - s);
		memcpy(text[n], s, l);
		snprintf(text[n] + l, sizeof(text[n]) - l, "%s", sp + 1);
		tokens[n] = (struct tok_str){ text[n], strlen(text[n]) };
		types[n] = TOK_TYPE_NORMAL;
		merges[m] = (struct tok_str){ s, strlen(s) };
	}
	struct tok_vocab v = {
		.model = "gpt2", .pre = gpt2 ? "gpt2" : "smollm", .n_tokens = n, .tokens = tokens,
		.types = types, .n_merges = N_BUILTIN_MERGES, .merges = merges,
		.bos_id = IM_START, .eos_id = 2, .unk_id = 4, .add_bos = 0,
	};
	struct tok *t = NULL;
	char err[256] = "";
	int r = tok_create(&v, &t, err, sizeof(err));
	FUZZ_CHECK(r == 0, "the built-in vocabulary: %d %s", r, err);
	return t;
}

static struct tok *get_builtin(bool holes, bool gpt2)
{
	struct tok **t = &builtin[holes * 2 + gpt2];
	if (!*t)
		*t = make_builtin(holes, gpt2);
	return *t;
}

/* ---- a vocabulary from the input ------------------------------------------ */

struct own_vocab {
	struct tok_str *tokens, *merges;
	int32_t *types;
	char bytes[256][2];
};

/* Split [p, end) at '\n' into out (NULL: count only); returns the count. */
static size_t split_lines(const char *p, const char *end, struct tok_str *out)
{
	size_t n = 0;
	while (p < end) {
		const char *nl = memchr(p, '\n', (size_t)(end - p));
		const char *stop = nl ? nl : end;
		if (out)
			out[n] = (struct tok_str){ p, (size_t)(stop - p) };
		n++;
		p = nl ? nl + 1 : end;
	}
	return n;
}

/* Build the input's vocabulary; *text is moved past it. Returns tok_create's
 * result; on failure the message was checked here. */
static struct tok *make_own(uint8_t flags, const uint8_t *hdr, const char **text, size_t *len)
{
	const char *p = *text, *end = p + *len;
	const char *z1 = memchr(p, '\0', *len);
	const char *z2 = z1 ? memchr(z1 + 1, '\0', (size_t)(end - z1 - 1)) : NULL;
	const char *tok_end = z1 ? z1 : end, *merge_end = z2 ? z2 : end;
	const char *merge_begin = z1 ? z1 + 1 : end;
	*text = z2 ? z2 + 1 : end;
	*len = (size_t)(end - *text);

	size_t n_lines = split_lines(p, tok_end, NULL);
	size_t n_bytes = flags & FL_BYTES ? 256 : 0;
	size_t n_tok = n_bytes + n_lines;
	size_t n_merges = split_lines(merge_begin, merge_end, NULL);
	struct own_vocab v = { 0 };
	v.tokens = calloc(n_tok ? n_tok : 1, sizeof(*v.tokens));
	v.types = calloc(n_tok ? n_tok : 1, sizeof(*v.types));
	v.merges = calloc(n_merges ? n_merges : 1, sizeof(*v.merges));
	FUZZ_CHECK(v.tokens && v.types && v.merges, "out of memory for %zu tokens", n_tok);
	for (size_t c = 0; c < n_bytes; c++) {
		v.tokens[c] = (struct tok_str){ v.bytes[c], fuzz_byte_char((unsigned)c, v.bytes[c]) };
		v.types[c] = TOK_TYPE_NORMAL;
	}
	split_lines(p, tok_end, v.tokens + n_bytes);
	for (size_t i = n_bytes; i < n_tok; i++) {
		/* the line's first byte is its type, the rest its text */
		if (v.tokens[i].len) {
			v.types[i] = (unsigned char)v.tokens[i].ptr[0] & 7;
			v.tokens[i].ptr++;
			v.tokens[i].len--;
		}
	}
	split_lines(merge_begin, merge_end, v.merges);
	struct tok_vocab tv = {
		.model = flags & FL_NO_MODEL ? NULL : "gpt2",
		.pre = flags & FL_GPT2 ? "gpt2" : "smollm",
		.n_tokens = n_tok,
		.tokens = v.tokens,
		.types = flags & FL_TYPES ? v.types : NULL,
		.n_merges = n_merges,
		.merges = v.merges,
		.bos_id = (int8_t)hdr[1],
		.eos_id = (int8_t)hdr[2],
		.unk_id = (int8_t)hdr[3],
		.add_bos = hdr[1] & 1,
	};
	struct tok *t = (struct tok *)1;
	char err[256] = "";
	int r = tok_create(&tv, &t, err, sizeof(err));
	free(v.tokens);
	free(v.types);
	free(v.merges);
	if (r != 0) {
		FUZZ_CHECK(r == -EINVAL || r == -ENOTSUP || r == -ENOMEM, "tok_create gave %d (%s)",
			   r, err);
		FUZZ_CHECK(err[0] != '\0', "tok_create refused the vocabulary (%d) without a message",
			   r);
		FUZZ_CHECK(t == NULL, "tok_create failed (%d) but set *out", r);
		return NULL;
	}
	FUZZ_CHECK(t != NULL && tok_n_tokens(t) == n_tok, "tok_create: %zu tokens of %zu",
		   t ? tok_n_tokens(t) : 0, n_tok);
	FUZZ_CHECK(tok_add_bos(t) == (hdr[1] & 1), "add_bos");
	FUZZ_CHECK(tok_bos(t) == (int8_t)hdr[1] && tok_eos(t) == (int8_t)hdr[2],
		   "bos %d eos %d, given %d %d", tok_bos(t), tok_eos(t), (int8_t)hdr[1],
		   (int8_t)hdr[2]);
	return t;
}

/* ---- the checks ----------------------------------------------------------- */

/* Decode ids whole; returns a malloc'd buffer of *len bytes (NUL-terminated). */
static char *decode_all(const struct tok *t, const int32_t *ids, size_t n, size_t *len)
{
	char small[8];
	size_t need = 0;
	int r = tok_decode(t, ids, n, small, sizeof(small), &need);
	FUZZ_CHECK(r == 0 ? need <= sizeof(small) : r == -ENOSPC && need > sizeof(small),
		   "tok_decode into 8 bytes gave %d, %zu bytes", r, need);
	char *out = malloc(need + 1);
	FUZZ_CHECK(out != NULL, "out of memory for %zu bytes", need);
	size_t got = 0;
	if (need) {
		/* exactly the length: fits, without the NUL */
		r = tok_decode(t, ids, n, out, need, &got);
		FUZZ_CHECK(r == 0 && got == need, "tok_decode into %zu bytes gave %d, %zu", need, r,
			   got);
	}
	r = tok_decode(t, ids, n, out, need + 1, &got);
	FUZZ_CHECK(r == 0 && got == need && out[need] == '\0',
		   "tok_decode into %zu bytes gave %d, %zu, terminated %d", need + 1, r, got,
		   out[need] == '\0');
	*len = need;
	return out;
}

/* Encode, checking counting, -ENOSPC and the id range; returns malloc'd ids. */
static int32_t *encode_all(const struct tok *t, const char *text, size_t len, int special,
			   size_t *n_ids)
{
	size_t n = 99;
	int r = tok_encode(t, text, len, special, NULL, 0, &n);
	FUZZ_CHECK(n == 0 ? r == 0 : r == -ENOSPC, "counting gave %d with %zu ids", r, n);
	FUZZ_CHECK(n <= len, "%zu ids from %zu bytes", n, len);
	int32_t *ids = malloc((n + 1) * sizeof(*ids));
	FUZZ_CHECK(ids != NULL, "out of memory for %zu ids", n);
	size_t n2 = 0;
	r = tok_encode(t, text, len, special, ids, n + 1, &n2);
	FUZZ_CHECK(r == 0 && n2 == n, "encoding gave %d with %zu ids, counting %zu", r, n2, n);
	size_t n_tok = tok_n_tokens(t);
	for (size_t i = 0; i < n; i++)
		FUZZ_CHECK(ids[i] >= 0 && (size_t)ids[i] < n_tok, "id %zu is %d of %zu tokens", i,
			   ids[i], n_tok);
	if (n >= 2) {
		int32_t *part = malloc((n - 1) * sizeof(*part));
		FUZZ_CHECK(part != NULL, "out of memory");
		size_t n3 = 0;
		r = tok_encode(t, text, len, special, part, n - 1, &n3);
		FUZZ_CHECK(r == -ENOSPC && n3 == n, "%zu ids into %zu gave %d, %zu", n, n - 1, r,
			   n3);
		FUZZ_CHECK(!memcmp(part, ids, (n - 1) * sizeof(*ids)),
			   "the ids before -ENOSPC differ");
		free(part);
	}
	*n_ids = n;
	return ids;
}

/* The pieces, one by one and through a stream, add up to `whole` (special)
 * or to the pieces without control text (!special). */
static void check_pieces(const struct tok *t, const int32_t *ids, size_t n, const char *whole,
			 size_t whole_len)
{
	size_t max = tok_max_piece_bytes(t), cap = max + 3;
	char *piece = malloc(cap), *cat = malloc(whole_len + 1), *st = malloc(whole_len + 1);
	char *cat0 = malloc(whole_len + 1), *st0 = malloc(whole_len + 1);
	FUZZ_CHECK(piece && cat && st && cat0 && st0, "out of memory");
	for (int special = 1; special >= 0; special--) {
		char *c = special ? cat : cat0, *s = special ? st : st0;
		size_t c_len = 0, s_len = 0, len;
		struct tok_stream stream;
		tok_stream_init(&stream, special);
		for (size_t i = 0; i < n; i++) {
			int r = tok_piece(t, ids[i], special, piece, max, &len);
			FUZZ_CHECK(r == 0 && len <= max, "piece of %d gave %d, %zu bytes (max %zu)",
				   ids[i], r, len, max);
			FUZZ_CHECK(c_len + len <= whole_len, "pieces longer than the decoding");
			memcpy(c + c_len, piece, len);
			c_len += len;
			if (len) {
				r = tok_piece(t, ids[i], special, piece, len - 1, &len);
				FUZZ_CHECK(r == -ENOSPC, "a piece into a short buffer gave %d", r);
			}
			int type = tok_type(t, ids[i]);
			if (!special && (type == TOK_TYPE_CONTROL || type == TOK_TYPE_UNKNOWN))
				FUZZ_CHECK(len == 0, "control token %d printed %zu bytes", ids[i], len);
			r = tok_stream_push(t, &stream, ids[i], piece, cap, &len);
			FUZZ_CHECK(r == 0 && len <= cap, "stream push of %d gave %d, %zu bytes", ids[i],
				   r, len);
			FUZZ_CHECK(s_len + len <= whole_len, "stream longer than the decoding");
			memcpy(s + s_len, piece, len);
			s_len += len;
			FUZZ_CHECK(stream.n_pending <= 3, "%u bytes held back", stream.n_pending);
		}
		int r = tok_stream_flush(&stream, piece, cap, &len);
		FUZZ_CHECK(r == 0 && s_len + len <= whole_len, "flush gave %d, %zu bytes", r, len);
		memcpy(s + s_len, piece, len);
		s_len += len;
		FUZZ_CHECK(s_len == c_len && !memcmp(s, c, c_len),
			   "stream (%zu bytes) differs from the pieces (%zu bytes), special %d", s_len,
			   c_len, special);
		if (special)
			FUZZ_CHECK(c_len == whole_len && !memcmp(c, whole, whole_len),
				   "pieces (%zu bytes) differ from tok_decode (%zu bytes)", c_len,
				   whole_len);
	}
	free(piece), free(cat), free(st), free(cat0), free(st0);
}

/* Ids taken from the input: pieces and types in range, -EINVAL outside. */
static void check_ids_from(const struct tok *t, const uint8_t *p, size_t len)
{
	size_t n_tok = tok_n_tokens(t), max = tok_max_piece_bytes(t);
	char piece[64];
	const int32_t fixed[] = { -1, -2, INT32_MIN, INT32_MAX, (int32_t)n_tok, (int32_t)n_tok - 1 };
	for (size_t i = 0; i < 6 + len / 4 && i < 6 + 16; i++) {
		int32_t id = fixed[i < 6 ? i : 0];
		if (i >= 6)
			memcpy(&id, p + 4 * (i - 6), 4);
		bool in = id >= 0 && (size_t)id < n_tok;
		for (int special = 0; special < 2; special++) {
			size_t got = 12345;
			int r = tok_piece(t, id, special, piece, sizeof(piece), &got);
			if (in)
				FUZZ_CHECK((r == 0 || r == -ENOSPC) && got <= max,
					   "piece of %d: %d, %zu bytes", id, r, got);
			else
				FUZZ_CHECK(r == -EINVAL && got == 0, "piece of %d of %zu: %d, %zu", id,
					   n_tok, r, got);
		}
		int type = tok_type(t, id);
		FUZZ_CHECK(in ? type >= TOK_TYPE_UNDEFINED && type <= TOK_TYPE_BYTE : type == -EINVAL,
			   "type of %d: %d", id, type);
		size_t out_len = 1;
		char out[4];
		int r = tok_decode(t, &id, 1, out, sizeof(out), &out_len);
		if (!in)
			FUZZ_CHECK(r == -EINVAL, "decoding id %d of %zu gave %d", id, n_tok, r);
		struct tok_stream s;
		tok_stream_init(&s, 1);
		char buf[8];
		r = tok_stream_push(t, &s, id, buf, sizeof(buf), &out_len);
		if (!in)
			FUZZ_CHECK(r == -EINVAL && s.n_pending == 0, "stream push of %d gave %d", id, r);
	}
	/* tok_find on the text's first bytes finds a token of that text or none */
	int32_t f = tok_find(t, (const char *)p, len < 8 ? len : 8);
	FUZZ_CHECK(f >= -1 && f < (int64_t)n_tok, "tok_find gave %d", f);
}

/* What a vocabulary keeps of text: the bytes it has a token for. */
static size_t keep_known(bool holes, const char *text, size_t len, char *out)
{
	size_t o = 0;
	for (size_t i = 0; i < len; i++)
		if (!holes || !is_hole((unsigned char)text[i]))
			out[o++] = text[i];
	return o;
}

static void run_text(const struct tok *t, const char *text, size_t len, int special,
		     bool builtin_vocab, bool holes)
{
	size_t n = 0, dec_len = 0;
	int32_t *ids = encode_all(t, text, len, special, &n);
	char *dec = decode_all(t, ids, n, &dec_len);
	check_pieces(t, ids, n, dec, dec_len);
	if (builtin_vocab) {
		char *want = malloc(len + 1);
		FUZZ_CHECK(want != NULL, "out of memory");
		size_t want_len = keep_known(holes, text, len, want);
		FUZZ_CHECK(dec_len == want_len && !memcmp(dec, want, want_len),
			   "round trip: %zu bytes in, %zu kept, %zu decoded (special %d, holes %d)",
			   len, want_len, dec_len, special, holes);
		free(want);
		for (size_t i = 0; i < n; i++) {
			int type = tok_type(t, ids[i]);
			FUZZ_CHECK(special || type == TOK_TYPE_NORMAL ||
				   type == TOK_TYPE_USER_DEFINED,
				   "id %d of type %d from text without parse_special", ids[i], type);
		}
	}
	free(dec);
	free(ids);
}

/* The text as a user turn of ChatML, rendered and encoded as the runner does. */
static void run_chat(const struct tok *t, const char *text, size_t len, bool builtin_vocab,
		     bool holes)
{
	char *content = malloc(len + 1);
	FUZZ_CHECK(content != NULL, "out of memory");
	memcpy(content, text, len);
	content[len] = '\0'; /* content is a C string: it ends at the first NUL */
	static const char sys[] = "<|im_start|>system\nYou are a helpful AI assistant named "
				  "SmolLM, trained by Hugging Face<|im_end|>\n";
	const struct tok_message msg = { "user", content };
	char small[16];
	size_t need = 0;
	int r = tok_chat_template(&msg, 1, 1, small, sizeof(small), &need);
	size_t want = strlen(sys) + strlen("<|im_start|>user\n") + strlen(content) +
		      strlen("<|im_end|>\n<|im_start|>assistant\n");
	FUZZ_CHECK(r == -ENOSPC && need == want, "chat template: %d, %zu bytes, expected %zu", r,
		   need, want);
	char *out = malloc(need + 1);
	FUZZ_CHECK(out != NULL, "out of memory");
	r = tok_chat_template(&msg, 1, 1, out, need + 1, &need);
	FUZZ_CHECK(r == 0 && need == want && out[need] == '\0' && !memcmp(out, sys, strlen(sys)),
		   "chat template: %d, %zu bytes", r, need);
	size_t n = 0;
	int32_t *ids = encode_all(t, out, need, 1, &n);
	if (builtin_vocab)
		FUZZ_CHECK(n >= 1 && ids[0] == IM_START, "the prompt starts with id %d, not %d",
			   n ? ids[0] : -1, IM_START);
	free(ids);
	run_text(t, out, need, 1, builtin_vocab, holes);
	free(out);
	free(content);
}

static int one(const uint8_t *data, size_t size)
{
	if (size < HEADER)
		return 0;
	uint8_t flags = data[0];
	const char *text = (const char *)data + HEADER;
	size_t len = size - HEADER;
	struct tok *t;
	bool own = flags & FL_OWN_VOCAB, holes = !own && (flags & FL_HOLES);
	if (own) {
		t = make_own(flags, data, &text, &len);
		if (!t)
			return 0;
	} else {
		t = get_builtin(holes, flags & FL_GPT2);
	}
	if (flags & FL_CHAT)
		run_chat(t, text, len, !own, holes);
	else
		run_text(t, text, len, flags & FL_SPECIAL, !own, holes);
	check_ids_from(t, (const uint8_t *)text, len);
	if (own)
		tok_destroy(t);
	return 1;
}

/* ---- seeds ---------------------------------------------------------------- */

static void add_text(void (*add)(void *, const uint8_t *, size_t), void *ctx, uint8_t flags,
		     const char *text, size_t len)
{
	uint8_t *p = malloc(HEADER + len);
	if (!p)
		return;
	p[0] = flags;
	p[1] = IM_START, p[2] = 2, p[3] = 0xff;
	memcpy(p + HEADER, text, len);
	add(ctx, p, HEADER + len);
	free(p);
}

static int hexval(char c)
{
	return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* The texts of tests/data/tokenizer/cases.txt (its `enc` records), where the
 * build says it is; each up to 4 KB. */
static void seeds_from_cases(void (*add)(void *, const uint8_t *, size_t), void *ctx)
{
	const char *dir = getenv("KVR_TOKENIZER_DATA");
#ifdef KVR_FUZZ_TOKENIZER_DATA
	if (!dir || !*dir)
		dir = KVR_FUZZ_TOKENIZER_DATA;
#endif
	if (!dir || !*dir)
		return;
	char path[4096];
	snprintf(path, sizeof(path), "%s/cases.txt", dir);
	FILE *f = fopen(path, "r");
	if (!f)
		return;
	char *line = NULL, *text = malloc(4096);
	size_t cap = 0;
	unsigned k = 0;
	while (text && getline(&line, &cap, f) > 0) {
		char name[64], hex[16];
		int special;
		if (sscanf(line, "enc %63s %d %15s", name, &special, hex) < 3)
			continue;
		const char *h = strstr(line + 4 + strlen(name), " ");
		h = h ? strchr(h + 1, ' ') : NULL; /* past the special flag */
		if (!h)
			continue;
		h++;
		size_t n = 0;
		for (; n < 4096 && hexval(h[0]) >= 0 && hexval(h[1]) >= 0; h += 2)
			text[n++] = (char)(hexval(h[0]) << 4 | hexval(h[1]));
		/* rotate through the vocabularies and modes */
		static const uint8_t modes[] = { 0, FL_GPT2, FL_HOLES, FL_CHAT, FL_GPT2 | FL_HOLES };
		add_text(add, ctx, (uint8_t)(modes[k++ % 5] | (special ? FL_SPECIAL : 0)), text, n);
	}
	free(line);
	free(text);
	fclose(f);
}

static void seeds(void (*add)(void *ctx, const uint8_t *p, size_t n), void *ctx)
{
#define S(flags, text) { flags, text, sizeof(text) - 1 }
	static const struct {
		uint8_t flags;
		const char *text;
		size_t len;
	} s[] = {
		S(0, "Hello world! It's 12345, they'll see."),
		S(FL_SPECIAL, "<|im_start|>user\nhi<|im_end|>\n<tool><unk>"),
		S(FL_GPT2, "  leading\tand\r\ntrailing   \n\n"),
		S(FL_HOLES | FL_SPECIAL, "q\xff\x00quiet<|endoftext|>\xff"),
		S(FL_CHAT, "What is 2+2?"),
		S(0, "h\xc3\xa9llo \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x91\x8d\xf0\x9f\x8f"
		     "\xbd \xe2\x80\x8d\xd9\xa3 \xc2\xa0 \xe3\x80\x80"),
		S(FL_GPT2 | FL_SPECIAL, "\xff\xfe\xc3\x28\xe2\x82\xf0\x9f\x98\xed\xa0\x80\xc0\xaf"),
	};
#undef S
	for (size_t i = 0; i < sizeof(s) / sizeof(s[0]); i++)
		add_text(add, ctx, s[i].flags, s[i].text, s[i].len);
	/* spelled-out vocabularies: specials, a few byte tokens and merges */
	static const char own1[] = "3<s>\n4<tool>\n1h\n1e\n1l\n1o\n1he\n1ll\n1hell\n1hello\n"
				   "1\xc4\xa0\n1\xc4\xa0h\n5unused\n7weird"
				   "\0h e\nl l\nhe ll\nhell o\n\xc4\xa0 h\0hello <s> hell<tool>";
	add_text(add, ctx, FL_OWN_VOCAB | FL_TYPES | FL_SPECIAL, own1, sizeof(own1) - 1);
	static const char own2[] = "1th\n1the\n6\xc4\xa0the\0t h\nth e\n\xc4\xa0 the\0the theme";
	add_text(add, ctx, FL_OWN_VOCAB | FL_BYTES | FL_TYPES | FL_GPT2, own2, sizeof(own2) - 1);
	static const char own3[] = "1a\n1b\0a b\0ab";
	add_text(add, ctx, FL_OWN_VOCAB | FL_NO_MODEL, own3, sizeof(own3) - 1);
	seeds_from_cases(add, ctx);
}

static size_t fields(const uint8_t *p, size_t n, struct fuzz_field *out, size_t max)
{
	(void)p;
	size_t k = 0;
	for (size_t i = 1; i < HEADER && i < n && k < max; i++)
		out[k++] = (struct fuzz_field){ i, 1 };
	return k;
}

static const char *const dict[] = {
	"<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool>", "<unk>", "'s", "'ll", "'re",
	"  ", "\r\n", "\n\n", "\t", "\xc4\xa0", "\xc4\x8a", "\xf0\x9f", "\xe2\x80\x8d",
	"\xc3\xa9", "\xe6\x97\xa5", "12", " 1", "hello", " world", "\xc2\xa0", "\xef\xbf\xbd",
	NULL,
};

const struct fuzz_target fuzz_target = { "tokenizer", one, seeds, fields, dict };
