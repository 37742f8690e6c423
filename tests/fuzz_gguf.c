/* SPDX-License-Identifier: MIT */
/*
 * fuzz_gguf.c — the fuzz harness for GGUF files, the runner's most exposed
 * input: any bytes go to gguf_open_memory, and a file that opens
 * has every accessor of gguf.h called on everything it holds, every byte
 * handed out read (so ASan sees a read out of bounds), and the promises of
 * gguf.h checked against an independent reading; then the two loaders that
 * turn a GGUF into runner state run on it: runner_tokenizer (the
 * tokenizer.ggml.* keys into a struct tok, which then encodes and decodes a
 * little) and model_open_memory (hyperparameters and tensor shapes). Every
 * rejection must come with a message.
 *
 * It also owns the GGUF seeds (built here, so no binary corpus is committed):
 * a file of every value type and tensor type, a tiny Llama model the loader
 * accepts whole with its tokenizer, a byte-level vocabulary, an empty file;
 * and the map of their count, length, type and integer fields, for the
 * mutation driver's boundary values.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "gguf.h"
#include "model.h"
#include "runner.h"
#include "tokenizer.h"

static volatile uint64_t sink; /* keeps the reads of every byte handed out */

/* Bytes of one scalar value of a GGUF value type; 0 for string and array. */
static unsigned value_bytes(uint32_t type)
{
	static const uint8_t sz[] = { 1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8 };
	return type < sizeof(sz) ? sz[type] : 0;
}

static uint64_t le(const uint8_t *p, unsigned width)
{
	uint64_t v = 0;
	for (unsigned i = 0; i < width; i++)
		v |= (uint64_t)p[i] << (8 * i);
	return v;
}

/* ---- checking an opened file -------------------------------------------- */

static bool inside(const void *p, uint64_t len, const uint8_t *base, size_t size)
{
	const uint8_t *q = p;
	return q >= base && q <= base + size && len <= (uint64_t)(base + size - q);
}

/* The typed getters agree with each other and with the key's type. */
static void check_key(const struct gguf *g, uint64_t i, const uint8_t *base, size_t size)
{
	const char *key = gguf_key_name(g, i);
	FUZZ_CHECK(key != NULL, "key %" PRIu64 " of %" PRIu64 " has no name", i, gguf_n_keys(g));
	size_t key_len = strlen(key);
	FUZZ_CHECK(key_len >= 1 && key_len <= GGUF_MAX_KEY, "key %" PRIu64 " is %zu bytes", i,
		   key_len);
	FUZZ_CHECK(gguf_find_key(g, key) == (int64_t)i, "key '%s' found at %" PRId64
		   ", listed at %" PRIu64, key, gguf_find_key(g, key), i);
	uint32_t type = gguf_key_type(g, key);
	FUZZ_CHECK(type == gguf_key_type_at(g, i), "key '%s': type %u by name, %u by index", key,
		   type, gguf_key_type_at(g, i));
	FUZZ_CHECK(type <= GGUF_TYPE_FLOAT64, "key '%s' has type %u", key, type);
	FUZZ_CHECK(strcmp(gguf_value_type_name(type), "unknown") != 0, "key '%s' type %u", key,
		   type);

	bool is_int = type != GGUF_TYPE_FLOAT32 && type != GGUF_TYPE_BOOL &&
		      type != GGUF_TYPE_STRING && type != GGUF_TYPE_ARRAY &&
		      type != GGUF_TYPE_FLOAT64;
	uint32_t u32 = 7;
	uint64_t u64 = 7;
	int64_t i64 = 7;
	int r32 = gguf_get_u32(g, key, &u32), r64 = gguf_get_u64(g, key, &u64),
	    ri64 = gguf_get_i64(g, key, &i64);
	if (!is_int) {
		FUZZ_CHECK(r32 == -EINVAL && r64 == -EINVAL && ri64 == -EINVAL,
			   "key '%s' of type %s: integer getters gave %d %d %d", key,
			   gguf_value_type_name(type), r32, r64, ri64);
		FUZZ_CHECK(u32 == 7 && u64 == 7 && i64 == 7, "key '%s': a failed getter wrote",
			   key);
	} else {
		/* Exactly one of u64 and i64 can fail, and only by range; u32
		 * succeeds exactly when u64 does with a value below 2^32. */
		FUZZ_CHECK(r64 == 0 || r64 == -ERANGE, "key '%s': u64 gave %d", key, r64);
		FUZZ_CHECK(ri64 == 0 || ri64 == -ERANGE, "key '%s': i64 gave %d", key, ri64);
		FUZZ_CHECK(r64 == 0 || ri64 == 0, "key '%s': neither u64 nor i64 reads it", key);
		if (r64 == 0 && ri64 == 0)
			FUZZ_CHECK((uint64_t)i64 == u64, "key '%s': u64 %" PRIu64 ", i64 %" PRId64,
				   key, u64, i64);
		if (r64 < 0)
			FUZZ_CHECK(i64 < 0, "key '%s': u64 out of range but i64 %" PRId64, key, i64);
		if (ri64 < 0)
			FUZZ_CHECK(u64 > INT64_MAX, "key '%s': i64 out of range but u64 %" PRIu64,
				   key, u64);
		bool fits = r64 == 0 && u64 <= UINT32_MAX;
		FUZZ_CHECK(fits ? r32 == 0 && u32 == u64 : r32 == -ERANGE,
			   "key '%s': u32 gave %d (%u) for u64 %d (%" PRIu64 ")", key, r32, u32, r64,
			   u64);
		if (type == GGUF_TYPE_UINT8 || type == GGUF_TYPE_UINT16 || type == GGUF_TYPE_UINT32)
			FUZZ_CHECK(r32 == 0, "key '%s': an unsigned %s did not fit uint32", key,
				   gguf_value_type_name(type));
	}
	float f = 7.0f;
	int rf = gguf_get_f32(g, key, &f);
	if (type == GGUF_TYPE_FLOAT32)
		FUZZ_CHECK(rf == 0, "key '%s': float32 gave %d", key, rf);
	else if (type == GGUF_TYPE_FLOAT64)
		FUZZ_CHECK(rf == 0 || rf == -ERANGE, "key '%s': float64 gave %d", key, rf);
	else
		FUZZ_CHECK(rf == -EINVAL && f == 7.0f, "key '%s' of type %s: f32 gave %d", key,
			   gguf_value_type_name(type), rf);
	if (rf == 0)
		sink += (uint64_t)isnan(f);
	bool b = false;
	int rb = gguf_get_bool(g, key, &b);
	FUZZ_CHECK(type == GGUF_TYPE_BOOL ? rb == 0 : rb == -EINVAL, "key '%s': bool gave %d", key,
		   rb);
	const char *p = NULL;
	size_t len = 0;
	int rs = gguf_get_str(g, key, &p, &len);
	FUZZ_CHECK(type == GGUF_TYPE_STRING ? rs == 0 : rs == -EINVAL, "key '%s': str gave %d", key,
		   rs);
	if (rs == 0) {
		FUZZ_CHECK(inside(p, len, base, size), "key '%s': string of %zu bytes outside the file",
			   key, len);
		for (size_t k = 0; k < len; k++)
			sink += (uint8_t)p[k];
	}

	uint32_t et = 99;
	uint64_t count = 0;
	const void *data = NULL;
	int ra = gguf_get_arr(g, key, &et, &count, &data);
	FUZZ_CHECK(type == GGUF_TYPE_ARRAY ? ra == 0 : ra == -EINVAL, "key '%s': arr gave %d", key,
		   ra);
	if (ra == 0) {
		FUZZ_CHECK(et <= GGUF_TYPE_FLOAT64 && et != GGUF_TYPE_ARRAY,
			   "key '%s': element type %u", key, et);
		if (et == GGUF_TYPE_STRING) {
			FUZZ_CHECK(data == NULL, "key '%s': string array with a data pointer", key);
			const char *prev = NULL;
			size_t prev_len = 0;
			for (uint64_t k = 0; k < count; k++) {
				int r = gguf_get_arr_str(g, key, k, &p, &len);
				FUZZ_CHECK(r == 0, "key '%s': string %" PRIu64 " of %" PRIu64 " gave %d",
					   key, k, count, r);
				FUZZ_CHECK(inside(p, len, base, size),
					   "key '%s': string %" PRIu64 " (%zu bytes) outside the file",
					   key, k, len);
				/* packed: each string's length field follows the last's bytes */
				FUZZ_CHECK(!prev || prev + prev_len + 8 == p,
					   "key '%s': string %" PRIu64 " is not after string %" PRIu64,
					   key, k, k - 1);
				for (size_t m = 0; m < len; m++)
					sink += (uint8_t)p[m];
				prev = p;
				prev_len = len;
			}
			int r = gguf_get_arr_str(g, key, count, &p, &len);
			FUZZ_CHECK(r == -ERANGE, "key '%s': string %" PRIu64 " past the end gave %d",
				   key, count, r);
		} else {
			unsigned sz = value_bytes(et);
			FUZZ_CHECK(count <= size / sz, "key '%s': %" PRIu64 " elements of %u bytes",
				   key, count, sz);
			FUZZ_CHECK(count == 0 || inside(data, count * sz, base, size),
				   "key '%s': array data outside the file", key);
			const uint8_t *d = data;
			for (uint64_t k = 0; k < count * sz; k++) {
				if (et == GGUF_TYPE_BOOL)
					FUZZ_CHECK(d[k] <= 1, "key '%s': bool element %" PRIu64
						   " is %u", key, k, d[k]);
				sink += d[k];
			}
			int r = gguf_get_arr_str(g, key, 0, &p, &len);
			FUZZ_CHECK(r == -EINVAL, "key '%s': arr_str on a %s array gave %d", key,
				   gguf_value_type_name(et), r);
		}
	} else {
		int r = gguf_get_arr_str(g, key, 0, &p, &len);
		FUZZ_CHECK(r == -EINVAL, "key '%s': arr_str on a %s gave %d", key,
			   gguf_value_type_name(type), r);
	}

	/* Every failure has a message. */
	const int rcs[] = { r32, r64, ri64, rf, rb, rs, ra, -ENOENT, -EIO };
	for (size_t k = 0; k < sizeof(rcs) / sizeof(rcs[0]); k++) {
		if (rcs[k] == 0)
			continue;
		char msg[256] = "";
		int r = gguf_key_error(g, key, rcs[k], k % 2 ? NULL : "a thing", msg, sizeof(msg));
		FUZZ_CHECK(r == rcs[k] && msg[0] != '\0', "key '%s': gguf_key_error(%d) gave %d '%s'",
			   key, rcs[k], r, msg);
	}
}

struct span {
	uint64_t begin, end;
};

static int span_cmp(const void *a, const void *b)
{
	const struct span *x = a, *y = b;
	return x->begin < y->begin ? -1 : x->begin > y->begin;
}

static void check_tensors(const struct gguf *g, const uint8_t *base, size_t size)
{
	uint64_t n = gguf_n_tensors(g), data_offset = gguf_data_offset(g);
	uint32_t align = gguf_alignment(g);
	FUZZ_CHECK(n <= size, "%" PRIu64 " tensors in %zu bytes", n, size);
	struct span *s = malloc((n ? n : 1) * sizeof(*s));
	FUZZ_CHECK(s != NULL, "out of memory for %" PRIu64 " spans", n);
	for (uint64_t i = 0; i < n; i++) {
		const struct gguf_tensor *t = gguf_tensor_at(g, i);
		FUZZ_CHECK(t != NULL, "tensor %" PRIu64 " of %" PRIu64 " is NULL", i, n);
		FUZZ_CHECK(t->name && strlen(t->name) == t->name_len && t->name_len >= 1 &&
			   t->name_len <= GGUF_MAX_NAME, "tensor %" PRIu64 ": name of %zu bytes",
			   i, t->name_len);
		FUZZ_CHECK(gguf_find_tensor(g, t->name) == t, "tensor '%s' not found by name",
			   t->name);
		FUZZ_CHECK(t->n_dims >= 1 && t->n_dims <= GGUF_MAX_DIMS, "tensor '%s': %u dims",
			   t->name, t->n_dims);
		uint64_t elems = 1;
		for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) {
			FUZZ_CHECK(t->ne[d] >= 1 && (d < t->n_dims || t->ne[d] == 1),
				   "tensor '%s': ne[%u] = %" PRIu64, t->name, d, t->ne[d]);
			FUZZ_CHECK(!__builtin_mul_overflow(elems, t->ne[d], &elems),
				   "tensor '%s': element count overflows", t->name);
		}
		uint32_t be = 0, bb = 0;
		FUZZ_CHECK(gguf_type_size(t->type, &be, &bb) == 0 && be && bb,
			   "tensor '%s': type %u (%s) accepted but has no size", t->name, t->type,
			   gguf_type_name(t->type));
		uint64_t row = gguf_row_bytes(t->type, t->ne[0]);
		FUZZ_CHECK(row == t->ne[0] / be * bb && t->ne[0] % be == 0,
			   "tensor '%s': row bytes %" PRIu64, t->name, row);
		uint64_t bytes = row;
		for (uint32_t d = 1; d < GGUF_MAX_DIMS; d++)
			FUZZ_CHECK(!__builtin_mul_overflow(bytes, t->ne[d], &bytes),
				   "tensor '%s': byte count overflows", t->name);
		FUZZ_CHECK(bytes == t->bytes, "tensor '%s': %" PRIu64 " bytes, shape says %" PRIu64,
			   t->name, t->bytes, bytes);
		FUZZ_CHECK(t->offset % align == 0, "tensor '%s': offset %" PRIu64 " not aligned to %u",
			   t->name, t->offset, align);
		FUZZ_CHECK((const uint8_t *)t->data == base + data_offset + t->offset,
			   "tensor '%s': data pointer", t->name);
		FUZZ_CHECK(inside(t->data, t->bytes, base, size), "tensor '%s': %" PRIu64
			   " bytes at offset %" PRIu64 " outside the file", t->name, t->bytes,
			   t->offset);
		const uint8_t *d = t->data;
		for (uint64_t k = 0; k < t->bytes; k++)
			sink += d[k];
		s[i] = (struct span){ t->offset, t->offset + t->bytes };
	}
	qsort(s, (size_t)n, sizeof(*s), span_cmp);
	for (uint64_t i = 1; i < n; i++)
		FUZZ_CHECK(s[i].begin >= s[i - 1].end, "tensor data overlaps at %" PRIu64, s[i].begin);
	free(s);
	FUZZ_CHECK(gguf_tensor_at(g, n) == NULL, "a tensor past the end");
	FUZZ_CHECK(gguf_find_tensor(g, "") == NULL, "a tensor with an empty name");
}

/* gguf_type_size and gguf_row_bytes against their definitions, for type
 * numbers and element counts taken from the input. */
static void check_type_tables(uint32_t type, uint64_t n_elems)
{
	const char *name = gguf_type_name(type);
	FUZZ_CHECK(name && name[0], "type %u has no name", type);
	uint32_t be = 0, bb = 0;
	int r = gguf_type_size(type, &be, &bb);
	FUZZ_CHECK(r == 0 || r == -ENOTSUP, "gguf_type_size(%u) gave %d", type, r);
	uint64_t row = gguf_row_bytes(type, n_elems), want = 0;
	if (r == 0) {
		FUZZ_CHECK(be >= 1 && bb >= 1 && strcmp(name, "unknown") != 0,
			   "type %u (%s): %u elements in %u bytes", type, name, be, bb);
		if (n_elems % be == 0 && __builtin_mul_overflow(n_elems / be, (uint64_t)bb, &want))
			want = 0;
	}
	FUZZ_CHECK(row == want, "gguf_row_bytes(%u, %" PRIu64 ") = %" PRIu64 ", expected %" PRIu64,
		   type, n_elems, row, want);
	FUZZ_CHECK(gguf_type_size(type, NULL, NULL) == r, "type %u: outputs change the answer",
		   type);
	(void)gguf_value_type_name(type);
}

/* A tokenizer that loaded from the file: encode and decode a little, ids in
 * range, pieces of every id (and a few outside the vocabulary). */
static void check_tokenizer(const struct tok *t)
{
	static const char text[] = "Hello world 123 <|im_start|>user\n\xc3\xa9\xff\xe2\x82 'll";
	size_t n_tok = tok_n_tokens(t);
	FUZZ_CHECK(n_tok >= 1 && n_tok < INT32_MAX, "%zu tokens", n_tok);
	int32_t ids[256];
	for (int special = 0; special < 2; special++) {
		size_t n = 0;
		int r = tok_encode(t, text, sizeof(text) - 1, special, ids, 256, &n);
		FUZZ_CHECK(r == 0 && n <= sizeof(text), "tok_encode gave %d, %zu ids", r, n);
		for (size_t i = 0; i < n; i++)
			FUZZ_CHECK(ids[i] >= 0 && (size_t)ids[i] < n_tok, "id %d of %zu", ids[i],
				   n_tok);
		char out[1024];
		size_t len = 0;
		r = tok_decode(t, ids, n, out, sizeof(out), &len);
		FUZZ_CHECK(r == 0 || r == -ENOSPC, "tok_decode gave %d", r);
	}
	size_t max_piece = tok_max_piece_bytes(t);
	char piece[512];
	for (size_t id = 0; id < n_tok && id < 1024; id++) {
		size_t len = 0;
		int r = tok_piece(t, (int32_t)id, 1, piece, sizeof(piece), &len);
		FUZZ_CHECK((r == 0 || r == -ENOSPC) && len <= max_piece,
			   "piece of %zu: %d, %zu bytes (max %zu)", id, r, len, max_piece);
		FUZZ_CHECK(tok_type(t, (int32_t)id) >= TOK_TYPE_UNDEFINED &&
			   tok_type(t, (int32_t)id) <= TOK_TYPE_BYTE, "type of %zu", id);
	}
	const int32_t bad[] = { -1, INT32_MIN, (int32_t)n_tok, INT32_MAX };
	for (size_t i = 0; i < 4; i++) {
		size_t len = 1;
		FUZZ_CHECK(tok_piece(t, bad[i], 1, piece, sizeof(piece), &len) == -EINVAL && len == 0,
			   "piece of id %d", bad[i]);
	}
	int32_t bos = tok_bos(t), eos = tok_eos(t);
	FUZZ_CHECK(bos >= -1 && bos < (int64_t)n_tok && eos >= -1 && eos < (int64_t)n_tok,
		   "bos %d eos %d of %zu tokens", bos, eos, n_tok);
}

static void check_model(const uint8_t *data, size_t size)
{
	struct model *m = (struct model *)1;
	char err[512] = "";
	int r = model_open_memory(data, size, 0, &m, err, sizeof(err));
	if (r != 0) {
		FUZZ_CHECK(r < 0 && err[0] != '\0', "model_open_memory gave %d without a message", r);
		FUZZ_CHECK(m == NULL, "model_open_memory failed (%d) but left *out set", r);
		return;
	}
	const struct model_hparams *hp = model_hparams(m);
	FUZZ_CHECK(hp->n_layers && hp->n_embd && hp->n_head && hp->n_head_kv && hp->head_dim &&
		   hp->n_ff && hp->n_vocab, "a zero hyperparameter was accepted");
	FUZZ_CHECK(hp->n_head % hp->n_head_kv == 0 && hp->n_rot <= hp->head_dim,
		   "heads %u / %u, rot %u of %u", hp->n_head, hp->n_head_kv, hp->n_rot,
		   hp->head_dim);
	FUZZ_CHECK(hp->rms_eps > 0.0f && hp->rope_base > 1.0f, "eps %g base %g",
		   (double)hp->rms_eps, (double)hp->rope_base);
	FUZZ_CHECK(gguf_file_size(model_gguf(m)) == size, "the model's file size");
	model_close(m);
}

static int one(const uint8_t *data, size_t size)
{
	struct gguf *g = (struct gguf *)1;
	char err[512] = "";
	int r = gguf_open_memory(data, size, &g, err, sizeof(err));
	/* The type tables take any numbers; feed them some from the input. */
	if (size >= 12)
		check_type_tables((uint32_t)le(data + size - 12, 4), le(data + size - 8, 8));
	if (r != 0) {
		FUZZ_CHECK(r == -EINVAL || r == -ENOTSUP || r == -ENOMEM,
			   "gguf_open_memory gave %d (%s)", r, err);
		FUZZ_CHECK(err[0] != '\0', "rejected (%d) without a message", r);
		FUZZ_CHECK(g == NULL, "rejected (%d) but *out is set", r);
		return 0;
	}
	FUZZ_CHECK(g != NULL, "opened without a reader");
	FUZZ_CHECK(gguf_version(g) == 3, "version %u", gguf_version(g));
	uint32_t align = gguf_alignment(g);
	FUZZ_CHECK(align && !(align & (align - 1)) && align <= GGUF_MAX_ALIGNMENT, "alignment %u",
		   align);
	uint32_t a = 0;
	if (gguf_get_u32(g, "general.alignment", &a) == 0)
		FUZZ_CHECK(a == align, "general.alignment %u, reader %u", a, align);
	uint64_t off = gguf_data_offset(g);
	FUZZ_CHECK(off <= size && (off % align == 0 || (off == size && gguf_n_tensors(g) == 0)),
		   "data section at %" PRIu64 " of %zu (alignment %u)", off, size, align);
	FUZZ_CHECK(gguf_file_size(g) == size && gguf_file_data(g) == (const void *)data,
		   "file size or data pointer");
	FUZZ_CHECK(gguf_n_keys(g) <= size, "%" PRIu64 " keys in %zu bytes", gguf_n_keys(g), size);
	for (uint64_t i = 0; i < gguf_n_keys(g); i++)
		check_key(g, i, data, size);
	FUZZ_CHECK(gguf_key_name(g, gguf_n_keys(g)) == NULL, "a key past the end");
	FUZZ_CHECK(gguf_key_type_at(g, gguf_n_keys(g)) == GGUF_TYPE_NONE, "a type past the end");
	FUZZ_CHECK(gguf_find_key(g, "") == -1 && gguf_key_type(g, "") == GGUF_TYPE_NONE,
		   "an empty key name");
	FUZZ_CHECK(gguf_get_u32(g, "", &a) == -ENOENT, "an absent key");
	check_tensors(g, data, size);
	for (uint64_t i = 0; i < gguf_n_tensors(g) && i < 8; i++) {
		const struct gguf_tensor *t = gguf_tensor_at(g, i);
		check_type_tables(t->type, t->ne[0] + (i & 1));
	}

	struct tok *t = NULL;
	err[0] = '\0';
	r = runner_tokenizer(g, &t, err, sizeof(err));
	if (r == 0) {
		FUZZ_CHECK(t != NULL, "runner_tokenizer succeeded without a tokenizer");
		check_tokenizer(t);
		tok_destroy(t);
	} else {
		FUZZ_CHECK(r < 0 && err[0] != '\0', "runner_tokenizer gave %d without a message", r);
	}
	gguf_close(g);
	check_model(data, size);
	return 1;
}

/* ---- seeds -------------------------------------------------------------- */

struct wbuf {
	uint8_t *p;
	size_t n, cap;
	bool oom;
};

static void put(struct wbuf *b, const void *d, size_t n)
{
	if (b->oom)
		return;
	if (b->n + n > b->cap) {
		size_t cap = (b->n + n) * 2 + 64;
		uint8_t *p = realloc(b->p, cap);
		if (!p) {
			b->oom = true;
			return;
		}
		b->p = p;
		b->cap = cap;
	}
	if (n)
		memcpy(b->p + b->n, d, n);
	b->n += n;
}

static void put_le(struct wbuf *b, uint64_t v, unsigned width)
{
	uint8_t x[8];
	for (unsigned i = 0; i < width; i++)
		x[i] = (uint8_t)(v >> (8 * i));
	put(b, x, width);
}

static void put_str(struct wbuf *b, const char *s, size_t len)
{
	put_le(b, len, 8);
	put(b, s, len);
}

static void w_hdr(struct wbuf *b, uint64_t n_tensors, uint64_t n_kv)
{
	put(b, "GGUF", 4);
	put_le(b, 3, 4);
	put_le(b, n_tensors, 8);
	put_le(b, n_kv, 8);
}

static void w_key(struct wbuf *b, const char *key, uint32_t type)
{
	put_str(b, key, strlen(key));
	put_le(b, type, 4);
}

static void kv_u32(struct wbuf *b, const char *key, uint32_t v)
{
	w_key(b, key, GGUF_TYPE_UINT32);
	put_le(b, v, 4);
}

static void kv_f32(struct wbuf *b, const char *key, float v)
{
	uint32_t bits;
	memcpy(&bits, &v, 4);
	w_key(b, key, GGUF_TYPE_FLOAT32);
	put_le(b, bits, 4);
}

static void kv_str(struct wbuf *b, const char *key, const char *s)
{
	w_key(b, key, GGUF_TYPE_STRING);
	put_str(b, s, strlen(s));
}

static void w_arr(struct wbuf *b, const char *key, uint32_t elem_type, uint64_t count)
{
	w_key(b, key, GGUF_TYPE_ARRAY);
	put_le(b, elem_type, 4);
	put_le(b, count, 8);
}

struct tensor_spec {
	const char *name;
	uint32_t n_dims;
	uint64_t ne[4];
	uint32_t type;
};

/* Tensor infos for t[0..n), their data laid out in order with `align`, then
 * the padding and the data (a byte pattern). */
static void w_tensors(struct wbuf *b, const struct tensor_spec *t, size_t n, uint32_t align)
{
	uint64_t off = 0;
	for (size_t i = 0; i < n; i++) {
		put_str(b, t[i].name, strlen(t[i].name));
		put_le(b, t[i].n_dims, 4);
		uint64_t rows = 1;
		for (uint32_t d = 0; d < t[i].n_dims; d++) {
			put_le(b, t[i].ne[d], 8);
			rows *= d ? t[i].ne[d] : 1;
		}
		put_le(b, t[i].type, 4);
		put_le(b, off, 8);
		off += (gguf_row_bytes(t[i].type, t[i].ne[0]) * rows + align - 1) / align * align;
	}
	while (b->n % align)
		put_le(b, 0, 1);
	for (uint64_t k = 0; k < off; k++)
		put_le(b, (k * 7 + 3) & 0x3f, 1); /* small values: f32/f16 stay finite */
}

/* Every value type, arrays of each, tensors of many types, alignment 64. */
static void seed_values(struct wbuf *b)
{
	static const struct tensor_spec t[] = {
		{ "f32", 2, { 4, 2 }, GGUF_GGML_F32 },
		{ "f16", 1, { 8 }, GGUF_GGML_F16 },
		{ "q4_0", 2, { 32, 2 }, GGUF_GGML_Q4_0 },
		{ "q8_0", 3, { 32, 1, 2 }, GGUF_GGML_Q8_0 },
		{ "q4_k", 1, { 256 }, GGUF_GGML_Q4_K },
		{ "bf16.4d", 4, { 2, 2, 2, 2 }, GGUF_GGML_BF16 },
		{ "i8", 1, { 3 }, GGUF_GGML_I8 },
		{ "mxfp4", 1, { 32 }, GGUF_GGML_MXFP4 },
	};
	const size_t n_t = sizeof(t) / sizeof(t[0]);
	w_hdr(b, n_t, 19);
	kv_str(b, "general.architecture", "test");
	kv_u32(b, "general.alignment", 64);
	w_key(b, "t.u8", GGUF_TYPE_UINT8);
	put_le(b, 200, 1);
	w_key(b, "t.i8", GGUF_TYPE_INT8);
	put_le(b, 0xfb, 1);
	w_key(b, "t.u16", GGUF_TYPE_UINT16);
	put_le(b, 60000, 2);
	w_key(b, "t.i16", GGUF_TYPE_INT16);
	put_le(b, 0x8ad0, 2);
	w_key(b, "t.i32", GGUF_TYPE_INT32);
	put_le(b, (uint32_t)-7, 4);
	kv_f32(b, "t.f32", 1.5f);
	w_key(b, "t.bool", GGUF_TYPE_BOOL);
	put_le(b, 1, 1);
	w_key(b, "t.u64", GGUF_TYPE_UINT64);
	put_le(b, UINT64_C(1) << 40, 8);
	w_key(b, "t.i64", GGUF_TYPE_INT64);
	put_le(b, (uint64_t)INT64_MIN, 8);
	w_key(b, "t.f64", GGUF_TYPE_FLOAT64);
	put_le(b, UINT64_C(0x7e37e43c8800759c), 8); /* 1e300: out of float's range */
	kv_str(b, "t.empty", "");
	w_arr(b, "t.arr_i32", GGUF_TYPE_INT32, 3);
	put_le(b, 1, 4), put_le(b, (uint32_t)-2, 4), put_le(b, 0x7fffffff, 4);
	w_arr(b, "t.arr_bool", GGUF_TYPE_BOOL, 2);
	put_le(b, 0, 1), put_le(b, 1, 1);
	w_arr(b, "t.arr_f64", GGUF_TYPE_FLOAT64, 1);
	put_le(b, 0, 8);
	w_arr(b, "t.arr_u8_empty", GGUF_TYPE_UINT8, 0);
	w_arr(b, "t.arr_str", GGUF_TYPE_STRING, 3);
	put_str(b, "a", 1), put_str(b, "", 0), put_str(b, "h\xc3\xa9", 3);
	w_arr(b, "t.arr_str_empty", GGUF_TYPE_STRING, 0);
	w_tensors(b, t, n_t, 64);
}

/* A model small enough to fuzz whole (2 layers, 4-wide, F32 and F16
 * weights) with a tokenizer of 14 tokens, of architecture `arch` (llama;
 * qwen2 with Q/K/V biases; qwen3 with per-head Q/K norms) and pre-tokenizer
 * `pre`: model_open_memory and runner_tokenizer both accept it. */
static void seed_model_of(struct wbuf *b, const char *arch, const char *pre)
{
	enum { E = 4, FF = 8, V = 14, HEADS = 2, KV_HEADS = 1, HD = 2, L = 2 };
	static const char *const tokens[] = {
		"<|endoftext|>", "<|im_start|>", "<|im_end|>", "h", "e", "l", "o", "\xc4\xa0",
		"he", "ll", "hell", "hello", "\xc4\xa0h", "1",
	};
	static const char *const merges[] = { "h e", "l l", "he ll", "hell o", "\xc4\xa0 h" };
	struct tensor_spec t[2 + 12 * L + 1];
	const bool qwen2 = !strcmp(arch, "qwen2"), qwen3 = !strcmp(arch, "qwen3");
	size_t n = 0;
	t[n++] = (struct tensor_spec){ "token_embd.weight", 2, { E, V }, GGUF_GGML_F32 };
	t[n++] = (struct tensor_spec){ "output_norm.weight", 1, { E }, GGUF_GGML_F32 };
	static char names[L][9][40];
	static const char *const suffix[9] = { "attn_norm", "attn_q", "attn_k", "attn_v",
					       "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
					       "ffn_down" };
	const uint64_t shape[9][2] = { { E, 0 }, { E, HEADS * HD }, { E, KV_HEADS * HD },
				       { E, KV_HEADS * HD }, { HEADS * HD, E }, { E, 0 },
				       { E, FF }, { E, FF }, { FF, E } };
	for (int l = 0; l < L; l++)
		for (int k = 0; k < 9; k++) {
			snprintf(names[l][k], sizeof(names[l][k]), "blk.%d.%s.weight", l, suffix[k]);
			bool vec = shape[k][1] == 0;
			t[n++] = (struct tensor_spec){ names[l][k], vec ? 1 : 2,
						       { shape[k][0], vec ? 1 : shape[k][1] },
						       vec || k % 2 ? GGUF_GGML_F32 : GGUF_GGML_F16 };
		}
	static char extra[L][3][40];
	static const char *const bias[3] = { "attn_q.bias", "attn_k.bias", "attn_v.bias" };
	static const char *const norm[2] = { "attn_q_norm.weight", "attn_k_norm.weight" };
	for (int l = 0; l < L && (qwen2 || qwen3); l++)
		for (int k = 0; k < (qwen2 ? 3 : 2); k++) {
			snprintf(extra[l][k], sizeof(extra[l][k]), "blk.%d.%s", l, qwen2 ? bias[k] : norm[k]);
			t[n++] = (struct tensor_spec){ extra[l][k], 1,
						       { qwen3 ? HD : k ? KV_HEADS * HD : HEADS * HD }, GGUF_GGML_F32 };
		}
	t[n++] = (struct tensor_spec){ "output.weight", 2, { E, V }, GGUF_GGML_F32 };
	w_hdr(b, n, 21);
	char key[64];
#define KEY(suffix) (snprintf(key, sizeof(key), "%s." suffix, arch), key)
	kv_str(b, "general.architecture", arch);
	kv_u32(b, KEY("block_count"), L);
	kv_u32(b, KEY("embedding_length"), E);
	kv_u32(b, KEY("attention.head_count"), HEADS);
	kv_u32(b, KEY("attention.head_count_kv"), KV_HEADS);
	kv_u32(b, KEY("feed_forward_length"), FF);
	kv_u32(b, KEY("context_length"), 2048);
	kv_u32(b, KEY("attention.key_length"), HD);
	kv_u32(b, KEY("rope.dimension_count"), HD);
	kv_f32(b, KEY("rope.freq_base"), 10000.0f);
	kv_f32(b, KEY("attention.layer_norm_rms_epsilon"), 1e-5f);
#undef KEY
	kv_str(b, "tokenizer.ggml.model", "gpt2");
	kv_str(b, "tokenizer.ggml.pre", pre);
	w_arr(b, "tokenizer.ggml.tokens", GGUF_TYPE_STRING, V);
	for (int i = 0; i < V; i++)
		put_str(b, tokens[i], strlen(tokens[i]));
	w_arr(b, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, V);
	for (int i = 0; i < V; i++)
		put_le(b, i < 3 ? TOK_TYPE_CONTROL : TOK_TYPE_NORMAL, 4);
	w_arr(b, "tokenizer.ggml.merges", GGUF_TYPE_STRING, 5);
	for (int i = 0; i < 5; i++)
		put_str(b, merges[i], strlen(merges[i]));
	kv_u32(b, "tokenizer.ggml.bos_token_id", 1);
	kv_u32(b, "tokenizer.ggml.eos_token_id", 2);
	kv_u32(b, "tokenizer.ggml.unknown_token_id", 0);
	w_key(b, "tokenizer.ggml.add_bos_token", GGUF_TYPE_BOOL);
	put_le(b, 0, 1);
	kv_u32(b, "general.alignment", 32);
	w_tensors(b, t, n, 32);
}

static void seed_model(struct wbuf *b)
{
	seed_model_of(b, "llama", "smollm");
}

static void seed_model_qwen2(struct wbuf *b)
{
	seed_model_of(b, "qwen2", "deepseek-r1-qwen");
}

static void seed_model_qwen3(struct wbuf *b)
{
	seed_model_of(b, "qwen3", "qwen2");
}

/* A byte-level vocabulary: every byte's character, control tokens and a few
 * merges, gpt2 pre-tokenizer, uint32 token types; no tensors. */
static void seed_vocab(struct wbuf *b)
{
	static const char *const merges[] = { "t h", "th e", "\xc4\xa0 t", "\xc4\xa0t h",
					      "\xc4\xa0th e", "i n", "a n", "an d" };
	const size_t n_merges = sizeof(merges) / sizeof(merges[0]), n_tok = 2 + 256 + n_merges;
	w_hdr(b, 0, 6);
	kv_str(b, "tokenizer.ggml.model", "gpt2");
	kv_str(b, "tokenizer.ggml.pre", "gpt2");
	w_arr(b, "tokenizer.ggml.tokens", GGUF_TYPE_STRING, n_tok);
	put_str(b, "<s>", 3), put_str(b, "<tool>", 6);
	for (unsigned c = 0; c < 256; c++) {
		char s[2];
		put_str(b, s, fuzz_byte_char(c, s));
	}
	for (size_t m = 0; m < n_merges; m++) {
		char s[16];
		size_t k = 0;
		for (const char *p = merges[m]; *p; p++)
			if (*p != ' ')
				s[k++] = *p;
		put_str(b, s, k);
	}
	w_arr(b, "tokenizer.ggml.token_type", GGUF_TYPE_UINT32, n_tok);
	for (size_t i = 0; i < n_tok; i++)
		put_le(b, i == 0 ? TOK_TYPE_CONTROL : i == 1 ? TOK_TYPE_USER_DEFINED : TOK_TYPE_NORMAL,
		       4);
	w_arr(b, "tokenizer.ggml.merges", GGUF_TYPE_STRING, n_merges);
	for (size_t m = 0; m < n_merges; m++)
		put_str(b, merges[m], strlen(merges[m]));
	kv_u32(b, "tokenizer.ggml.bos_token_id", 0);
}

static void seeds(void (*add)(void *ctx, const uint8_t *p, size_t n), void *ctx)
{
	void (*const build[])(struct wbuf *) = { seed_values, seed_model, seed_model_qwen2, seed_model_qwen3,
						 seed_vocab };
	for (size_t i = 0; i < sizeof(build) / sizeof(build[0]); i++) {
		struct wbuf b = { 0 };
		build[i](&b);
		if (!b.oom)
			add(ctx, b.p, b.n);
		free(b.p);
	}
	struct wbuf b = { 0 };
	w_hdr(&b, 0, 0);
	if (!b.oom)
		add(ctx, b.p, b.n);
	free(b.p);
}

/* ---- the field map -------------------------------------------------------- */

struct walker {
	const uint8_t *p;
	size_t n, pos;
	struct fuzz_field *out;
	size_t max, k;
};

/* Record a field of `width` bytes at the cursor and step over it; false when
 * the input ends first. */
static bool field(struct walker *w, unsigned width, uint64_t *v)
{
	if (w->n - w->pos < width)
		return false;
	if (w->k < w->max)
		w->out[w->k++] = (struct fuzz_field){ w->pos, (uint8_t)width };
	*v = le(w->p + w->pos, width);
	w->pos += width;
	return true;
}

static bool skip(struct walker *w, uint64_t bytes)
{
	if (bytes > w->n - w->pos)
		return false;
	w->pos += (size_t)bytes;
	return true;
}

/* Walk the header as far as it holds together, recording the version, the
 * counts, every length, type and count field, integer values and the tensor
 * shapes and offsets: where a forged number does the most harm. */
static size_t fields(const uint8_t *p, size_t n, struct fuzz_field *out, size_t max)
{
	struct walker w = { p, n, 4, out, max, 0 };
	uint64_t version, n_tensors, n_kv, v;
	if (n < 4 || !field(&w, 4, &version) || !field(&w, 8, &n_tensors) || !field(&w, 8, &n_kv))
		return w.k;
	for (uint64_t i = 0; i < n_kv && w.k < max; i++) {
		uint64_t type;
		if (!field(&w, 8, &v) || !skip(&w, v) || !field(&w, 4, &type))
			return w.k;
		if (type == GGUF_TYPE_STRING) {
			if (!field(&w, 8, &v) || !skip(&w, v))
				return w.k;
		} else if (type == GGUF_TYPE_ARRAY) {
			uint64_t et, count;
			if (!field(&w, 4, &et) || !field(&w, 8, &count))
				return w.k;
			if (et == GGUF_TYPE_STRING) {
				for (uint64_t j = 0; j < count; j++) {
					/* past a few strings, only step over them */
					size_t keep = w.max;
					if (j >= 4)
						w.max = w.k;
					bool ok = field(&w, 8, &v) && skip(&w, v);
					w.max = keep;
					if (!ok)
						return w.k;
				}
			} else if (!value_bytes((uint32_t)et) ||
				   count > (n - w.pos) / value_bytes((uint32_t)et) ||
				   !skip(&w, count * value_bytes((uint32_t)et))) {
				return w.k;
			}
		} else {
			unsigned sz = value_bytes((uint32_t)type);
			if (!sz)
				return w.k;
			if (type == GGUF_TYPE_FLOAT32 || type == GGUF_TYPE_FLOAT64 ||
			    type == GGUF_TYPE_BOOL) {
				if (!skip(&w, sz))
					return w.k;
			} else if (!field(&w, sz, &v)) {
				return w.k;
			}
		}
	}
	for (uint64_t i = 0; i < n_tensors && w.k < max; i++) {
		uint64_t n_dims, type, offset;
		if (!field(&w, 8, &v) || !skip(&w, v) || !field(&w, 4, &n_dims))
			return w.k;
		for (uint64_t d = 0; d < n_dims && d < GGUF_MAX_DIMS; d++)
			if (!field(&w, 8, &v))
				return w.k;
		if (!field(&w, 4, &type) || !field(&w, 8, &offset))
			return w.k;
	}
	return w.k;
}

static const char *const dict[] = {
	"GGUF",
	"general.alignment",
	"general.architecture",
	"llama",
	"llama.block_count",
	"llama.embedding_length",
	"llama.attention.head_count",
	"llama.attention.head_count_kv",
	"llama.attention.key_length",
	"llama.rope.dimension_count",
	"llama.feed_forward_length",
	"tokenizer.ggml.model",
	"tokenizer.ggml.pre",
	"tokenizer.ggml.tokens",
	"tokenizer.ggml.token_type",
	"tokenizer.ggml.merges",
	"tokenizer.ggml.bos_token_id",
	"token_embd.weight",
	"output.weight",
	"blk.0.attn_q.weight",
	"gpt2",
	"smollm",
	"qwen2",
	"qwen3",
	"llama-bpe",
	"deepseek-r1-qwen",
	"rope_freqs.weight",
	"blk.0.attn_q.bias",
	"blk.0.attn_q_norm.weight",
	"llama.rope.scaling.type",
	"llama.rope.scaling.factor",
	"linear",
	"yarn",
	"tokenizer.ggml.eot_token_id",
	"tokenizer.chat_template",
	NULL,
};

const struct fuzz_target fuzz_target = { "gguf", one, seeds, fields, dict };
