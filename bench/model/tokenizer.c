/* SPDX-License-Identifier: MIT */
/*
 * tokenizer.c — byte-level BPE encoding and decoding (tokenizer.h).
 *
 * Encoding follows llama.cpp's llm_tokenizer_bpe for the "smollm" and "gpt2"
 * pre-tokenizers step by step, because the ids must be the ones the model was
 * run with there:
 *  1. special tokens: for each control/user-defined token, longest text first,
 *     every occurrence in the still-unsplit text becomes that token
 *     (tokenizer_st_partition);
 *  2. the remaining text is split into code points (an invalid byte is a unit
 *     of class "other", where llama.cpp substitutes U+FFFD of the same class;
 *     we keep the byte itself, so such input still round-trips);
 *  3. "smollm": every \p{N} code point becomes a piece of its own; then, per
 *     piece, the GPT-2 regex 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
 *     ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ (a transcription of llama.cpp's
 *     unicode_regex_split_custom_gpt2, which treats a piece's end as the end of
 *     the text for the lookahead);
 *  4. BPE inside each word: start from one symbol per byte (the token of the
 *     byte's GPT-2 byte-to-unicode character), repeatedly merge the adjacent
 *     pair of lowest merge rank, leftmost first. A min-heap of candidate pairs
 *     keyed by (rank, position) makes a word of m bytes cost O(m log m); pairs
 *     are looked up by token id in a hash table built once from the merges.
 *
 * Everything built at tok_create (the vocabulary hash, the merge table, each
 * token's decoded bytes) is read-only afterwards; encode and decode allocate
 * their scratch per call, so one struct tok serves any number of threads.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat.h"
#include "tokenizer.h"
#include "unicode.h"

enum tok_pre {
	PRE_SMOLLM, /* digits one by one, then the GPT-2 regex */
	PRE_GPT2,   /* the GPT-2 regex alone */
	PRE_LLAMA3, /* Llama 3's regex: digits in runs of up to 3; whole words first */
	PRE_QWEN2,  /* Qwen2's: Llama 3's with every digit alone */
};

/* tokenizer.ggml.pre values and the pre-tokenizer llama.cpp runs for each */
static const struct {
	const char *name;
	enum tok_pre pre;
} pre_names[] = {
	{ "smollm", PRE_SMOLLM },   { "gpt2", PRE_GPT2 },   { "llama-bpe", PRE_LLAMA3 },
	{ "llama3", PRE_LLAMA3 },   { "llama-v3", PRE_LLAMA3 }, { "qwen2", PRE_QWEN2 },
	{ "deepseek-r1-qwen", PRE_QWEN2 },
};

/* Texts of the tokens that end a turn in the families the runner reads,
 * besides the file's eos/eot/eom ids (llama.cpp's end-of-generation set). */
static const char *const eog_texts[] = {
	"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>", "<|end|>", "<end_of_turn>",
	"<\xef\xbd\x9c" "end\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>", /* <｜end▁of▁sentence｜> */
};

struct merge_slot {
	uint64_t key;   /* left id << 32 | right id; MERGE_EMPTY when free */
	uint32_t rank;  /* index in the merge list: lower merges first */
	int32_t merged; /* id of left+right */
};
#define MERGE_EMPTY UINT64_MAX

struct tok {
	size_t n_tokens;
	char *text;          /* every token's text as given, back to back */
	size_t *text_off;    /* token i is text[text_off[i] .. text_off[i+1]) */
	char *piece;         /* every token's decoded bytes, back to back */
	size_t *piece_off;
	uint8_t *type;       /* enum tok_type */
	size_t max_piece;

	uint32_t *vocab_slots; /* open addressing by text: id + 1, 0 when free */
	size_t vocab_mask;
	struct merge_slot *merge_slots;
	size_t merge_mask;
	int32_t byte_id[256]; /* token of each byte's byte-level character, -1 if none */

	int32_t *special;     /* tokens matched in raw text, longest text first */
	size_t n_special;

	enum tok_pre pre;
	const char *pre_name; /* tokenizer.ggml.pre, as pre_names spells it */
	unsigned char byte_level[256][2]; /* each byte's byte-level character, UTF-8 */
	uint8_t byte_level_len[256];
	int32_t bos, eos, unk;
	int32_t eog[16];      /* tokens that end generation */
	size_t n_eog;
	int add_bos;
};

static void set_err(char *err, size_t err_bytes, const char *fmt, ...)
{
	if (!err || !err_bytes)
		return;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(err, err_bytes, fmt, ap);
	va_end(ap);
}

/* ---------------------------------------------------------------------------
 * GPT-2's byte <-> unicode mapping: the printable Latin-1 bytes stand for
 * themselves, the other 68 bytes for U+0100.. in byte order, so that every
 * token is printable text (' ' is 'Ġ' U+0120, '\n' is 'Ċ' U+010A).
 * ------------------------------------------------------------------------- */

static int byte_is_printable(unsigned b)
{
	return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
}

static void byte_to_unicode_table(uint32_t b2u[256])
{
	uint32_t next = 0x100;
	for (unsigned b = 0; b < 256; b++)
		b2u[b] = byte_is_printable(b) ? b : next++;
}

/* The inverse: the byte each character U+0000..U+0143 stands for, or -1. */
#define N_BYTE_CHARS (0x100 + 68)
static void unicode_to_byte_table(int16_t u2b[N_BYTE_CHARS])
{
	uint32_t b2u[256];
	byte_to_unicode_table(b2u);
	for (size_t i = 0; i < N_BYTE_CHARS; i++)
		u2b[i] = -1;
	for (unsigned b = 0; b < 256; b++)
		u2b[b2u[b]] = (int16_t)b;
}

static size_t utf8_encode(uint32_t cp, unsigned char *out)
{
	if (cp < 0x80) {
		out[0] = (unsigned char)cp;
		return 1;
	}
	if (cp < 0x800) {
		out[0] = (unsigned char)(0xC0 | cp >> 6);
		out[1] = (unsigned char)(0x80 | (cp & 0x3F));
		return 2;
	}
	if (cp < 0x10000) {
		out[0] = (unsigned char)(0xE0 | cp >> 12);
		out[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
		out[2] = (unsigned char)(0x80 | (cp & 0x3F));
		return 3;
	}
	out[0] = (unsigned char)(0xF0 | cp >> 18);
	out[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3F));
	out[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
	out[3] = (unsigned char)(0x80 | (cp & 0x3F));
	return 4;
}

/* ---------------------------------------------------------------------------
 * Hash tables (open addressing, linear probing, power-of-two sizes, at most
 * half full).
 * ------------------------------------------------------------------------- */

static uint64_t hash_bytes(const char *s, size_t n)
{
	uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
	for (size_t i = 0; i < n; i++)
		h = (h ^ (unsigned char)s[i]) * 0x100000001b3ull;
	return h ^ h >> 29;
}

static uint64_t hash_u64(uint64_t x)
{
	x ^= x >> 33; /* murmur3's finalizer */
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ull;
	return x ^ x >> 33;
}

static size_t table_size(size_t n)
{
	size_t s = 16;
	while (s < 2 * n)
		s <<= 1;
	return s;
}

int32_t tok_find(const struct tok *t, const char *text, size_t len)
{
	for (size_t i = hash_bytes(text, len) & t->vocab_mask;; i = (i + 1) & t->vocab_mask) {
		uint32_t v = t->vocab_slots[i];
		if (!v)
			return -1;
		size_t id = v - 1, off = t->text_off[id];
		if (t->text_off[id + 1] - off == len && !memcmp(t->text + off, text, len))
			return (int32_t)id;
	}
}

/* Insert token id by its text; a later token with the same text replaces the
 * earlier one, as in llama.cpp's token_to_id map. */
static void vocab_insert(struct tok *t, size_t id)
{
	const char *s = t->text + t->text_off[id];
	size_t len = t->text_off[id + 1] - t->text_off[id];
	for (size_t i = hash_bytes(s, len) & t->vocab_mask;; i = (i + 1) & t->vocab_mask) {
		uint32_t v = t->vocab_slots[i];
		if (v) {
			size_t o = t->text_off[v - 1];
			if (t->text_off[v] - o != len || memcmp(t->text + o, s, len))
				continue;
		}
		t->vocab_slots[i] = (uint32_t)id + 1;
		return;
	}
}

static const struct merge_slot *merge_find(const struct tok *t, int32_t left, int32_t right)
{
	if (left < 0 || right < 0)
		return NULL;
	uint64_t key = (uint64_t)left << 32 | (uint32_t)right;
	for (size_t i = hash_u64(key) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
		const struct merge_slot *m = &t->merge_slots[i];
		if (m->key == key)
			return m;
		if (m->key == MERGE_EMPTY)
			return NULL;
	}
}

/* The first merge of a pair keeps its rank, as llama.cpp's bpe_ranks.emplace. */
static void merge_insert(struct tok *t, int32_t left, int32_t right, uint32_t rank, int32_t merged)
{
	uint64_t key = (uint64_t)left << 32 | (uint32_t)right;
	for (size_t i = hash_u64(key) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
		struct merge_slot *m = &t->merge_slots[i];
		if (m->key == key)
			return;
		if (m->key == MERGE_EMPTY) {
			*m = (struct merge_slot){ key, rank, merged };
			return;
		}
	}
}

/* ---------------------------------------------------------------------------
 * Creation
 * ------------------------------------------------------------------------- */

static int type_is_special(int type)
{
	return type == TOK_TYPE_CONTROL || type == TOK_TYPE_UNKNOWN || type == TOK_TYPE_USER_DEFINED;
}

/* The decoded bytes of a normal token: each byte-level character is the byte
 * it stands for; a character outside the mapping (not byte-level text) is
 * kept as its UTF-8, which is the best guess for a vocabulary we did not expect. */
static size_t decode_byte_level(const int16_t *u2b, const char *s, size_t n, char *out)
{
	size_t o = 0;
	for (size_t i = 0; i < n;) {
		uint32_t cp;
		size_t k = uni_utf8_decode((const unsigned char *)s + i, n - i, &cp);
		int b = cp < N_BYTE_CHARS ? u2b[cp] : -1;
		if (b >= 0)
			out[o++] = (char)b;
		else {
			memcpy(out + o, s + i, k);
			o += k;
		}
		i += k;
	}
	return o;
}

static int cmp_special(const void *a, const void *b, void *arg)
{
	const struct tok *t = arg;
	int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
	size_t lx = t->text_off[x + 1] - t->text_off[x], ly = t->text_off[y + 1] - t->text_off[y];
	if (lx != ly)
		return lx > ly ? -1 : 1;
	return x < y ? -1 : x > y; /* ties by id, so the order is deterministic */
}

static int check_id(int32_t id, size_t n, const char *what, char *err, size_t err_bytes)
{
	if (id < -1 || (id >= 0 && (size_t)id >= n)) {
		set_err(err, err_bytes, "tokenizer: %s id %d is outside the vocabulary (%zu tokens)", what,
			id, n);
		return -EINVAL;
	}
	return 0;
}

static void add_eog(struct tok *t, int32_t id)
{
	if (id < 0 || t->n_eog == sizeof(t->eog) / sizeof(t->eog[0]))
		return;
	for (size_t i = 0; i < t->n_eog; i++)
		if (t->eog[i] == id)
			return;
	t->eog[t->n_eog++] = id;
}

int tok_create(const struct tok_vocab *v, struct tok **out, char *err, size_t err_bytes)
{
	if (!out) {
		set_err(err, err_bytes, "tokenizer: no place for the result");
		return -EINVAL;
	}
	*out = NULL;
	if (!v || !v->n_tokens || !v->tokens || (v->n_merges && !v->merges)) {
		set_err(err, err_bytes, "tokenizer: no vocabulary");
		return -EINVAL;
	}
	if (v->model && strcmp(v->model, "gpt2")) {
		set_err(err, err_bytes, "tokenizer: model \"%s\" is not supported (only \"gpt2\", "
			"byte-level BPE)", v->model);
		return -ENOTSUP;
	}
	int pre = -1;
	const char *pre_name = NULL;
	for (size_t i = 0; v->pre && i < sizeof(pre_names) / sizeof(pre_names[0]); i++)
		if (!strcmp(v->pre, pre_names[i].name)) {
			pre = (int)pre_names[i].pre;
			pre_name = pre_names[i].name;
		}
	if (pre < 0) {
		set_err(err, err_bytes, "tokenizer: tokenizer.ggml.pre \"%s\" is not supported (smollm, "
			"gpt2, llama-bpe, qwen2 and deepseek-r1-qwen are)", v->pre ? v->pre : "(none)");
		return -ENOTSUP;
	}
	if (v->n_tokens >= INT32_MAX || v->n_merges >= UINT32_MAX) {
		set_err(err, err_bytes, "tokenizer: %zu tokens, %zu merges: too many", v->n_tokens,
			v->n_merges);
		return -EINVAL;
	}
	int ret;
	if ((ret = check_id(v->bos_id, v->n_tokens, "bos", err, err_bytes)) ||
	    (ret = check_id(v->eos_id, v->n_tokens, "eos", err, err_bytes)) ||
	    (ret = check_id(v->unk_id, v->n_tokens, "unk", err, err_bytes)))
		return ret;

	struct tok *t = calloc(1, sizeof(*t));
	if (!t)
		goto nomem;
	t->n_tokens = v->n_tokens;
	t->pre = (enum tok_pre)pre;
	t->pre_name = pre_name;
	t->bos = v->bos_id;
	t->eos = v->eos_id;
	t->unk = v->unk_id;
	t->add_bos = !!v->add_bos;

	size_t n = v->n_tokens, total = 0;
	for (size_t i = 0; i < n; i++) {
		if (!v->tokens[i].ptr && v->tokens[i].len) {
			set_err(err, err_bytes, "tokenizer: token %zu has no text", i);
			tok_destroy(t);
			return -EINVAL;
		}
		total += v->tokens[i].len;
	}
	t->text = malloc(total + 1);
	t->text_off = malloc((n + 1) * sizeof(*t->text_off));
	t->piece = malloc(total + 1); /* a decoded piece is never longer than its text */
	t->piece_off = malloc((n + 1) * sizeof(*t->piece_off));
	t->type = malloc(n);
	t->vocab_mask = table_size(n) - 1;
	t->vocab_slots = calloc(t->vocab_mask + 1, sizeof(*t->vocab_slots));
	t->merge_mask = table_size(v->n_merges) - 1;
	t->merge_slots = malloc((t->merge_mask + 1) * sizeof(*t->merge_slots));
	if (!t->text || !t->text_off || !t->piece || !t->piece_off || !t->type || !t->vocab_slots ||
	    !t->merge_slots)
		goto nomem;
	for (size_t i = 0; i <= t->merge_mask; i++)
		t->merge_slots[i].key = MERGE_EMPTY;

	int16_t u2b[N_BYTE_CHARS];
	unicode_to_byte_table(u2b);
	size_t off = 0, poff = 0;
	for (size_t i = 0; i < n; i++) {
		int type = v->types ? v->types[i] : TOK_TYPE_NORMAL;
		if (type < TOK_TYPE_UNDEFINED || type > TOK_TYPE_BYTE)
			type = TOK_TYPE_UNDEFINED; /* printed as nothing, never produced by BPE text */
		t->type[i] = (uint8_t)type;
		t->text_off[i] = off;
		if (v->tokens[i].len)
			memcpy(t->text + off, v->tokens[i].ptr, v->tokens[i].len);
		t->piece_off[i] = poff;
		if (type == TOK_TYPE_NORMAL || type == TOK_TYPE_BYTE)
			poff += decode_byte_level(u2b, t->text + off, v->tokens[i].len, t->piece + poff);
		else if (type_is_special(type)) {
			memcpy(t->piece + poff, t->text + off, v->tokens[i].len);
			poff += v->tokens[i].len;
		}
		if (t->piece_off[i] + t->max_piece < poff)
			t->max_piece = poff - t->piece_off[i];
		off += v->tokens[i].len;
	}
	t->text_off[n] = off;
	t->piece_off[n] = poff;
	for (size_t i = 0; i < n; i++)
		vocab_insert(t, i);

	uint32_t b2u[256];
	byte_to_unicode_table(b2u);
	for (unsigned b = 0; b < 256; b++) {
		unsigned char u[4];
		size_t k = utf8_encode(b2u[b], u); /* b2u < 0x144: 1 or 2 bytes */
		t->byte_id[b] = tok_find(t, (const char *)u, k);
		memcpy(t->byte_level[b], u, k);
		t->byte_level_len[b] = (uint8_t)k;
	}
	add_eog(t, t->eos);
	for (size_t i = 0; i < v->n_eog_ids && i < 4; i++)
		if (v->eog_ids[i] >= 0 && (size_t)v->eog_ids[i] < n)
			add_eog(t, v->eog_ids[i]);
	for (size_t i = 0; i < sizeof(eog_texts) / sizeof(eog_texts[0]); i++) {
		const int32_t id = tok_find(t, eog_texts[i], strlen(eog_texts[i]));
		if (id >= 0 && type_is_special(t->type[id]))
			add_eog(t, id);
	}

	size_t longest = 0;
	for (size_t r = 0; r < v->n_merges; r++)
		if (v->merges[r].len > longest)
			longest = v->merges[r].len;
	char *joined = malloc(longest + 1);
	if (!joined)
		goto nomem;
	for (size_t r = 0; r < v->n_merges; r++) {
		const char *m = v->merges[r].ptr;
		size_t len = v->merges[r].len;
		/* split at the first space after the first byte, as llama.cpp does */
		const char *sp = len > 1 && m ? memchr(m + 1, ' ', len - 1) : NULL;
		if (!sp) {
			set_err(err, err_bytes, "tokenizer: merge %zu (\"%.*s\") is not \"left right\"", r,
				(int)(len > 64 ? 64 : len), m ? m : "");
			free(joined);
			tok_destroy(t);
			return -EINVAL;
		}
		size_t ll = (size_t)(sp - m), rl = len - ll - 1;
		memcpy(joined, m, ll);
		memcpy(joined + ll, sp + 1, rl);
		int32_t left = tok_find(t, m, ll), right = tok_find(t, sp + 1, rl);
		int32_t merged = tok_find(t, joined, ll + rl);
		if (left < 0 || right < 0 || merged < 0) {
			set_err(err, err_bytes, "tokenizer: merge %zu (\"%.*s\"): \"%.*s\" is not in the "
				"vocabulary", r, (int)(len > 64 ? 64 : len), m,
				(int)(left < 0 ? ll : right < 0 ? rl : ll + rl),
				left < 0 ? m : right < 0 ? sp + 1 : joined);
			free(joined);
			tok_destroy(t);
			return -EINVAL;
		}
		merge_insert(t, left, right, (uint32_t)r, merged);
	}
	free(joined);

	for (size_t i = 0; i < n; i++)
		if (type_is_special(t->type[i]) && t->text_off[i + 1] > t->text_off[i])
			t->n_special++;
	if (t->n_special) {
		t->special = malloc(t->n_special * sizeof(*t->special));
		if (!t->special)
			goto nomem;
		size_t k = 0;
		for (size_t i = 0; i < n; i++)
			if (type_is_special(t->type[i]) && t->text_off[i + 1] > t->text_off[i])
				t->special[k++] = (int32_t)i;
		qsort_r(t->special, t->n_special, sizeof(*t->special), cmp_special, t);
	}
	*out = t;
	return 0;

nomem:
	set_err(err, err_bytes, "tokenizer: out of memory for %zu tokens and %zu merges", v->n_tokens,
		v->n_merges);
	tok_destroy(t);
	return -ENOMEM;
}

void tok_destroy(struct tok *t)
{
	if (!t)
		return;
	free(t->text);
	free(t->text_off);
	free(t->piece);
	free(t->piece_off);
	free(t->type);
	free(t->vocab_slots);
	free(t->merge_slots);
	free(t->special);
	free(t);
}

/* ---------------------------------------------------------------------------
 * Encoding
 * ------------------------------------------------------------------------- */

struct heap_entry {
	uint64_t key; /* rank << 32 | left position: lowest rank, then leftmost */
	int32_t left_id, right_id, merged;
	uint32_t right;
};

/* Per-call scratch. */
struct enc {
	const struct tok *t;
	int32_t *ids;
	size_t max_ids, n_ids;
	/* code points of the fragment being split */
	uint32_t *cps;
	uint32_t *offs; /* byte offset of each unit, plus one past the end */
	uint8_t *cls;
	/* BPE of one word; grown to the longest word seen */
	size_t word_cap;
	int32_t *sym_id, *sym_prev, *sym_next;
	struct heap_entry *heap;
	size_t heap_n;
	/* a word's byte-level form, for the whole-word lookup (ignore_merges) */
	char *word_text;
	size_t word_text_cap;
	/* tok_pretokenize: record piece ends (bytes from base) instead of BPE */
	uint32_t *ends;
	const unsigned char *base;
};

#define SYM_DEAD INT32_MIN /* a symbol merged into its left neighbour */

static void emit(struct enc *e, int32_t id)
{
	if (e->n_ids < e->max_ids)
		e->ids[e->n_ids] = id;
	e->n_ids++;
}

static void heap_push(struct enc *e, struct heap_entry x)
{
	size_t i = e->heap_n++;
	while (i) {
		size_t p = (i - 1) / 2;
		if (e->heap[p].key <= x.key)
			break;
		e->heap[i] = e->heap[p];
		i = p;
	}
	e->heap[i] = x;
}

static struct heap_entry heap_pop(struct enc *e)
{
	struct heap_entry top = e->heap[0], x = e->heap[--e->heap_n];
	size_t i = 0, n = e->heap_n;
	for (;;) {
		size_t c = 2 * i + 1;
		if (c >= n)
			break;
		if (c + 1 < n && e->heap[c + 1].key < e->heap[c].key)
			c++;
		if (x.key <= e->heap[c].key)
			break;
		e->heap[i] = e->heap[c];
		i = c;
	}
	if (n)
		e->heap[i] = x;
	return top;
}

/* Queue the pair (left, right) of symbol positions if the vocabulary merges it. */
static void add_pair(struct enc *e, int32_t left, int32_t right)
{
	if (left < 0 || right < 0)
		return;
	const struct merge_slot *m = merge_find(e->t, e->sym_id[left], e->sym_id[right]);
	if (m)
		heap_push(e, (struct heap_entry){ (uint64_t)m->rank << 32 | (uint32_t)left,
						  e->sym_id[left], e->sym_id[right], m->merged,
						  (uint32_t)right });
}

static int word_reserve(struct enc *e, size_t m)
{
	if (m <= e->word_cap)
		return 0;
	size_t cap = e->word_cap ? e->word_cap : 64;
	while (cap < m)
		cap *= 2;
	/* a word of m symbols queues at most m-1 pairs, then two per merge */
	int32_t *a = realloc(e->sym_id, cap * sizeof(*a));
	if (a)
		e->sym_id = a;
	int32_t *b = realloc(e->sym_prev, cap * sizeof(*b));
	if (b)
		e->sym_prev = b;
	int32_t *c = realloc(e->sym_next, cap * sizeof(*c));
	if (c)
		e->sym_next = c;
	struct heap_entry *h = realloc(e->heap, 3 * cap * sizeof(*h));
	if (h)
		e->heap = h;
	if (!a || !b || !c || !h)
		return -ENOMEM;
	e->word_cap = cap;
	return 0;
}

/* BPE over the bytes of one pre-tokenized word. */
static int bpe_word(struct enc *e, const unsigned char *w, size_t m)
{
	const struct tok *t = e->t;
	if (m == 1) {
		if (t->byte_id[w[0]] >= 0)
			emit(e, t->byte_id[w[0]]);
		return 0;
	}
	int ret = word_reserve(e, m);
	if (ret)
		return ret;
	for (size_t i = 0; i < m; i++) {
		e->sym_id[i] = t->byte_id[w[i]];
		e->sym_prev[i] = (int32_t)i - 1;
		e->sym_next[i] = i + 1 < m ? (int32_t)i + 1 : -1;
	}
	e->heap_n = 0;
	for (size_t i = 0; i + 1 < m; i++)
		add_pair(e, (int32_t)i, (int32_t)i + 1);
	while (e->heap_n) {
		struct heap_entry x = heap_pop(e);
		int32_t left = (int32_t)(x.key & 0xFFFFFFFFu), right = (int32_t)x.right;
		/* stale: either side merged since the pair was queued */
		if (e->sym_id[left] != x.left_id || e->sym_id[right] != x.right_id ||
		    e->sym_next[left] != right)
			continue;
		e->sym_id[left] = x.merged;
		e->sym_id[right] = SYM_DEAD;
		int32_t after = e->sym_next[right];
		e->sym_next[left] = after;
		if (after >= 0)
			e->sym_prev[after] = left;
		add_pair(e, e->sym_prev[left], left);
		add_pair(e, left, after);
	}
	for (int32_t i = 0; i >= 0; i = e->sym_next[i])
		if (e->sym_id[i] >= 0) /* -1: a byte without a token, dropped */
			emit(e, e->sym_id[i]);
	return 0;
}

/* A word that is itself a token becomes that token without BPE: llama.cpp's
 * ignore_merges, which Llama 3's tokenizer sets (its merges do not always
 * rebuild the vocabulary's own words). */
static int whole_word(struct enc *e, const unsigned char *w, size_t m, int32_t *id)
{
	const struct tok *t = e->t;
	*id = -1;
	if (2 * m > e->word_text_cap) {
		size_t cap = e->word_text_cap ? e->word_text_cap : 64;
		while (cap < 2 * m)
			cap *= 2;
		char *p = realloc(e->word_text, cap);
		if (!p)
			return -ENOMEM;
		e->word_text = p;
		e->word_text_cap = cap;
	}
	size_t k = 0;
	for (size_t i = 0; i < m; i++) {
		memcpy(e->word_text + k, t->byte_level[w[i]], t->byte_level_len[w[i]]);
		k += t->byte_level_len[w[i]];
	}
	*id = tok_find(t, e->word_text, k);
	return 0;
}

static int emit_word(struct enc *e, const unsigned char *s, size_t from, size_t to)
{
	if (to <= from)
		return 0;
	const unsigned char *w = s + e->offs[from];
	const size_t m = e->offs[to] - e->offs[from];
	if (e->ends) {
		emit(e, (int32_t)(w + m - e->base));
		return 0;
	}
	if (e->t->pre == PRE_LLAMA3 && m > 1) { /* llama.cpp's ignore_merges */
		int32_t id;
		const int ret = whole_word(e, w, m, &id);
		if (ret)
			return ret;
		if (id >= 0) {
			emit(e, id);
			return 0;
		}
	}
	return bpe_word(e, w, m);
}

/* Where the regexes' whitespace alternatives end a piece that starts with
 * whitespace at unit pos: with `breaks` (Llama 3's and Qwen2's regex) first
 * `\s*[\r\n]+`, up to the run's last line break; then `\s+(?!\S)`, all but
 * the run's last unit when more of the fragment follows (the fragment's end
 * counts as the text's end, as in llama.cpp); else `\s+`, the whole run. */
static size_t whitespace_end(const struct enc *e, size_t pos, size_t end, int breaks)
{
	size_t n_ws = 0, last_break = 0;
	while (pos + n_ws < end && e->cls[pos + n_ws] == UNI_SPACE) {
		if (breaks && (e->cps[pos + n_ws] == '\r' || e->cps[pos + n_ws] == '\n'))
			last_break = pos + n_ws + 1;
		n_ws++;
	}
	if (last_break)
		return last_break;
	if (n_ws > 1 && pos + n_ws < end)
		return pos + n_ws - 1;
	return pos + (n_ws ? n_ws : 1); /* 1: unreachable, every unit has a class */
}

/* The GPT-2 regex over units [ini, end) of the current fragment
 * (llama.cpp's unicode_regex_split_custom_gpt2, transcribed). */
static int split_gpt2(struct enc *e, const unsigned char *s, size_t ini, size_t end)
{
	const uint32_t *cp = e->cps;
	const uint8_t *cls = e->cls;
#define CLS_AT(p) ((p) < end ? (int)cls[p] : -1) /* -1: past the piece's end */
	size_t prev = ini, pos = ini;
	int ret;
	while (pos < end) {
		uint32_t c = cp[pos];
		if (c == '\'' && pos + 1 < end) {
			uint32_t c1 = cp[pos + 1];
			if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
				pos += 2;
				goto word;
			}
			if (pos + 2 < end) {
				uint32_t c2 = cp[pos + 2];
				if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') ||
				    (c1 == 'l' && c2 == 'l')) {
					pos += 3;
					goto word;
				}
			}
		}
		int k = c == ' ' ? CLS_AT(pos + 1) : CLS_AT(pos);
		if (k == UNI_LETTER || k == UNI_NUMBER || k == UNI_OTHER) {
			/* ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+` */
			pos += c == ' ';
			while (CLS_AT(pos) == k)
				pos++;
			goto word;
		}
		pos = whitespace_end(e, pos, end, 0);
word:
		if ((ret = emit_word(e, s, prev, pos)))
			return ret;
		prev = pos;
	}
#undef CLS_AT
	return 0;
}

/*
 * Llama 3's regex over units [ini, end), and Qwen2's with max_digits 1:
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
 *    ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * (a transcription of llama.cpp's unicode_regex_split_custom_llama3; for
 * Qwen2's \p{N} llama.cpp runs the regex itself, which takes the same
 * alternatives in the same order, so one matcher serves both). The lookahead
 * treats the piece's end as the end of the text, as llama.cpp's does.
 */
static int split_llama3(struct enc *e, const unsigned char *s, size_t ini, size_t end,
			unsigned max_digits)
{
	const uint32_t *cp = e->cps;
	const uint8_t *cls = e->cls;
#define CLS_AT(p) ((p) < end ? (int)cls[p] : -1)
#define CP_AT(p) ((p) < end ? cp[p] : UNI_INVALID)
#define LOWER(c) ((c) >= 'A' && (c) <= 'Z' ? (c) + 32 : (c))
	size_t prev = ini, pos = ini;
	int ret;
	while (pos < end) {
		const uint32_t c = cp[pos];
		const int k = cls[pos];
		if (c == '\'' && pos + 1 < end) {
			const uint32_t c1 = LOWER(cp[pos + 1]);
			if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
				pos += 2;
				goto word;
			}
			if (pos + 2 < end) {
				const uint32_t c2 = LOWER(cp[pos + 2]);
				if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') ||
				    (c1 == 'l' && c2 == 'l')) {
					pos += 3;
					goto word;
				}
			}
		}
		/* [^\r\n\p{L}\p{N}]?\p{L}+ */
		if (c != '\r' && c != '\n' && k != UNI_NUMBER &&
		    (k == UNI_LETTER || CLS_AT(pos + 1) == UNI_LETTER)) {
			pos++;
			while (CLS_AT(pos) == UNI_LETTER)
				pos++;
			goto word;
		}
		/* \p{N}{1,max_digits}: a run cut into pieces of max_digits */
		if (k == UNI_NUMBER) {
			size_t run = 0;
			while (CLS_AT(pos) == UNI_NUMBER && run < max_digits)
				pos++, run++;
			goto word;
		}
		/*  ?[^\s\p{L}\p{N}]+[\r\n]* */
		const int k2 = c == ' ' ? CLS_AT(pos + 1) : k;
		if (k2 == UNI_OTHER) {
			pos += c == ' ';
			while (CLS_AT(pos) == UNI_OTHER)
				pos++;
			while (CP_AT(pos) == '\r' || CP_AT(pos) == '\n')
				pos++;
			goto word;
		}
		pos = whitespace_end(e, pos, end, 1);
word:
		if ((ret = emit_word(e, s, prev, pos)))
			return ret;
		prev = pos;
	}
#undef CLS_AT
#undef CP_AT
#undef LOWER
	return 0;
}

/* Pre-tokenize and encode one fragment of text without special tokens. */
static int encode_text(struct enc *e, const unsigned char *s, size_t n)
{
	size_t nu = 0;
	for (size_t i = 0; i < n; nu++) {
		e->offs[nu] = (uint32_t)i;
		i += uni_utf8_decode(s + i, n - i, &e->cps[nu]);
		e->cls[nu] = (uint8_t)uni_class_of(e->cps[nu]);
	}
	e->offs[nu] = (uint32_t)n;
	if (e->t->pre == PRE_GPT2)
		return split_gpt2(e, s, 0, nu);
	if (e->t->pre == PRE_LLAMA3)
		return split_llama3(e, s, 0, nu, 3);
	if (e->t->pre == PRE_QWEN2)
		return split_llama3(e, s, 0, nu, 1);
	/* smollm: `\p{N}` first — each digit is a piece, and so is each run between */
	size_t start = 0;
	int ret;
	for (size_t i = 0; i < nu; i++) {
		if (e->cls[i] != UNI_NUMBER)
			continue;
		if ((ret = split_gpt2(e, s, start, i)) || (ret = emit_word(e, s, i, i + 1)))
			return ret;
		start = i + 1;
	}
	return split_gpt2(e, s, start, nu);
}

/* A stretch of the input: raw text, or a special token found in it. */
struct fragment {
	size_t off, len;
	int32_t id; /* -1: raw text */
};

struct fragments {
	struct fragment *v;
	size_t n, cap;
};

static int frag_push(struct fragments *f, size_t off, size_t len, int32_t id)
{
	if (f->n == f->cap) {
		size_t cap = f->cap ? 2 * f->cap : 16;
		struct fragment *v = realloc(f->v, cap * sizeof(*v));
		if (!v)
			return -ENOMEM;
		f->v = v;
		f->cap = cap;
	}
	f->v[f->n++] = (struct fragment){ off, len, id };
	return 0;
}

/* llama.cpp's tokenizer_st_partition: each special token in turn (longest
 * first) cuts every raw fragment at each of its occurrences. */
static int partition_special(const struct tok *t, const char *text, size_t len, int parse_special,
			     struct fragments *cur)
{
	struct fragments next = { 0 };
	int ret = 0;
	if ((ret = frag_push(cur, 0, len, -1)))
		return ret;
	for (size_t k = 0; k < t->n_special; k++) {
		int32_t id = t->special[k];
		if (!parse_special && t->type[id] != TOK_TYPE_USER_DEFINED)
			continue;
		const char *st = t->text + t->text_off[id];
		size_t sl = t->text_off[id + 1] - t->text_off[id];
		next.n = 0;
		for (size_t i = 0; i < cur->n && !ret; i++) {
			struct fragment f = cur->v[i];
			if (f.id >= 0) {
				ret = frag_push(&next, f.off, f.len, f.id);
				continue;
			}
			size_t at = f.off, stop = f.off + f.len;
			while (!ret) {
				const char *hit = stop - at >= sl ? memmem(text + at, stop - at, st, sl) : NULL;
				if (!hit) {
					if (stop > at)
						ret = frag_push(&next, at, stop - at, -1);
					break;
				}
				size_t h = (size_t)(hit - text);
				if (h > at)
					ret = frag_push(&next, at, h - at, -1);
				if (!ret)
					ret = frag_push(&next, h, sl, id);
				at = h + sl;
			}
		}
		struct fragments swap = *cur;
		*cur = next;
		next = swap;
		if (ret)
			break;
	}
	free(next.v);
	return ret;
}

int tok_encode(const struct tok *t, const char *text, size_t len, int parse_special,
	       int32_t *ids, size_t max_ids, size_t *n_ids)
{
	*n_ids = 0;
	if (!text && len)
		return -EINVAL;
	if (len >= UINT32_MAX)
		return -EOVERFLOW; /* unit offsets are 32-bit */
	struct enc e = { .t = t, .ids = ids, .max_ids = ids ? max_ids : 0 };
	struct fragments frags = { 0 };
	int ret = 0;
	if (!len)
		goto out;
	e.cps = malloc(len * sizeof(*e.cps));
	e.offs = malloc((len + 1) * sizeof(*e.offs));
	e.cls = malloc(len);
	if (!e.cps || !e.offs || !e.cls) {
		ret = -ENOMEM;
		goto out;
	}
	if ((ret = partition_special(t, text, len, parse_special, &frags)))
		goto out;
	for (size_t i = 0; i < frags.n && !ret; i++) {
		if (frags.v[i].id >= 0)
			emit(&e, frags.v[i].id);
		else
			ret = encode_text(&e, (const unsigned char *)text + frags.v[i].off,
					  frags.v[i].len);
	}
out:
	free(frags.v);
	free(e.cps);
	free(e.offs);
	free(e.cls);
	free(e.sym_id);
	free(e.sym_prev);
	free(e.sym_next);
	free(e.heap);
	free(e.word_text);
	if (ret)
		return ret;
	*n_ids = e.n_ids;
	return e.n_ids > e.max_ids ? -ENOSPC : 0;
}

int tok_pretokenize(const struct tok *t, const char *text, size_t len, uint32_t *ends,
		    size_t max_ends, size_t *n_ends)
{
	*n_ends = 0;
	if ((!text && len) || (!ends && max_ends))
		return -EINVAL;
	if (len >= UINT32_MAX)
		return -EOVERFLOW;
	if (!len)
		return 0;
	/* emit() stores int32 values: the ends go through the ids array */
	struct enc e = { .t = t, .ids = (int32_t *)ends, .max_ids = max_ends, .ends = ends,
			 .base = (const unsigned char *)text };
	int ret = -ENOMEM;
	e.cps = malloc(len * sizeof(*e.cps));
	e.offs = malloc((len + 1) * sizeof(*e.offs));
	e.cls = malloc(len);
	if (e.cps && e.offs && e.cls)
		ret = encode_text(&e, (const unsigned char *)text, len);
	free(e.cps);
	free(e.offs);
	free(e.cls);
	if (ret)
		return ret;
	*n_ends = e.n_ids;
	return e.n_ids > max_ends ? -ENOSPC : 0;
}

int tok_is_eog(const struct tok *t, int32_t id)
{
	for (size_t i = 0; i < t->n_eog; i++)
		if (t->eog[i] == id)
			return 1;
	return 0;
}

const char *tok_pre_name(const struct tok *t)
{
	return t->pre_name;
}

/* ---------------------------------------------------------------------------
 * Decoding
 * ------------------------------------------------------------------------- */

static int piece_of(const struct tok *t, int32_t id, int special, const char **p, size_t *n)
{
	if (id < 0 || (size_t)id >= t->n_tokens)
		return -EINVAL;
	int type = t->type[id];
	if (!special && (type == TOK_TYPE_CONTROL || type == TOK_TYPE_UNKNOWN)) {
		*p = "";
		*n = 0;
		return 0;
	}
	*p = t->piece + t->piece_off[id];
	*n = t->piece_off[id + 1] - t->piece_off[id];
	return 0;
}

int tok_piece(const struct tok *t, int32_t id, int special, char *out, size_t out_bytes,
	      size_t *len)
{
	const char *p;
	size_t n;
	int ret = piece_of(t, id, special, &p, &n);
	*len = ret ? 0 : n;
	if (ret)
		return ret;
	if (n > out_bytes)
		return -ENOSPC;
	memcpy(out, p, n);
	return 0;
}

int tok_decode(const struct tok *t, const int32_t *ids, size_t n, char *out, size_t out_bytes,
	       size_t *out_len)
{
	size_t o = 0;
	*out_len = 0;
	for (size_t i = 0; i < n; i++) {
		const char *p;
		size_t k;
		int ret = piece_of(t, ids[i], 1, &p, &k);
		if (ret)
			return ret;
		if (o + k <= out_bytes)
			memcpy(out + o, p, k);
		o += k;
	}
	*out_len = o;
	if (o < out_bytes)
		out[o] = '\0';
	return o > out_bytes ? -ENOSPC : 0;
}

void tok_stream_init(struct tok_stream *s, int special)
{
	memset(s, 0, sizeof(*s));
	s->special = special ? 1 : 0;
}

int tok_stream_push(const struct tok *t, struct tok_stream *s, int32_t id, char *out,
		    size_t out_bytes, size_t *len)
{
	const char *p;
	size_t n;
	int ret = piece_of(t, id, s->special, &p, &n);
	*len = 0;
	if (ret)
		return ret;
	size_t total = s->n_pending + n;
	if (total > out_bytes) {
		*len = total;
		return -ENOSPC;
	}
	memcpy(out, s->pending, s->n_pending);
	memcpy(out + s->n_pending, p, n);
	size_t hold = uni_utf8_incomplete_tail((const unsigned char *)out, total);
	memcpy(s->pending, out + total - hold, hold);
	s->n_pending = (uint8_t)hold;
	*len = total - hold;
	return 0;
}

int tok_stream_flush(struct tok_stream *s, char *out, size_t out_bytes, size_t *len)
{
	*len = s->n_pending;
	if (s->n_pending > out_bytes)
		return -ENOSPC;
	memcpy(out, s->pending, s->n_pending);
	s->n_pending = 0;
	return 0;
}

/* ---------------------------------------------------------------------------
 * Chat template and accessors
 * ------------------------------------------------------------------------- */

int tok_chat_template(const struct tok_message *msgs, size_t n, int add_generation_prompt,
		      char *out, size_t out_bytes, size_t *len)
{
	/* SmolLM2-Instruct's template: ChatML with its default system turn */
	static const char marks[] = "<|im_start|> You are a helpful AI assistant named SmolLM, trained by "
				    "Hugging Face";
	struct chat_format f;
	chat_detect(marks, sizeof(marks) - 1, NULL, NULL, &f);
	return chat_render(&f, msgs, n, add_generation_prompt, -1, out, out_bytes, len);
}

size_t tok_n_tokens(const struct tok *t)
{
	return t->n_tokens;
}

int32_t tok_bos(const struct tok *t)
{
	return t->bos;
}

int32_t tok_eos(const struct tok *t)
{
	return t->eos;
}

int tok_add_bos(const struct tok *t)
{
	return t->add_bos;
}

int tok_type(const struct tok *t, int32_t id)
{
	if (id < 0 || (size_t)id >= t->n_tokens)
		return -EINVAL;
	return t->type[id];
}

size_t tok_max_piece_bytes(const struct tok *t)
{
	return t->max_piece;
}
