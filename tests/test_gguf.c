/* SPDX-License-Identifier: MIT */
/*
 * test_gguf.c — the GGUF v3 reader (bench/model/gguf.c): a small in-test
 * writer builds valid files whose every value reads back; each validation
 * rule has a hand-made file that breaks it, with the expected errno and a
 * message naming the place; thousands of truncated, bit-flipped and forged
 * variants either load or fail cleanly, and when they load every byte the
 * accessors hand out is read (so ASan sees any read out of bounds); and the
 * real SmolLM2 file, when present, loads with the expected tensors and
 * hyperparameters (printed for the next engineer) and survives mutation of
 * its header. The two loaders that read a GGUF's keys into runner state,
 * model_open_memory and runner_tokenizer, keep the regressions the fuzz
 * harness found (tests/fuzz_gguf.c fuzzes them).
 *
 * The real-file tests skip when the model is absent (see
 * gguf_default_model_path; bench/model/fetch_model.sh fetches it).
 *
 * Cross-check (one-off, not run here, so CI needs no Python): gguf-py 0.19.0,
 * the official reader (`python3 -m venv /tmp/gguf-venv && /tmp/gguf-venv/bin/pip
 * install gguf`), and a 40-line C dump over this reader printed the real
 * file's key count, every key's name, type and array length, and every
 * tensor's name, type, shape, absolute data offset and byte size in the same
 * format; `diff` found no difference (33 keys, 272 tensors, data section at
 * byte 1785664). The same comparison on a file written by gguf-py's
 * GGUFWriter (alignment 64, every value type, F32/F16/Q4_1/Q8_0/Q6_K/Q5_0
 * tensors) also matched, so this file's writer and the reader do not share a
 * misreading of the format. gguf-py's GGML_QUANT_SIZES agrees with
 * ggml-common.h on every type the reader accepts; it differs on Q8_1.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gguf.h"
#include "model.h"
#include "runner.h"
#include "tokenizer.h"

/* ---- a small GGUF writer ------------------------------------------------ */

/* A field whose value a forged file replaces (a length, count or type). */
struct field {
	size_t at;
	int width; /* 4 or 8 bytes */
};

struct wbuf {
	uint8_t *p;
	size_t n, cap;
	struct field fields[512];
	int n_fields;
};

static void put(struct wbuf *b, const void *d, size_t n)
{
	if (b->n + n > b->cap) {
		b->cap = (b->n + n) * 2 + 64;
		b->p = realloc(b->p, b->cap);
		cr_assert_not_null(b->p);
	}
	if (n)
		memcpy(b->p + b->n, d, n);
	b->n += n;
}

static void mark(struct wbuf *b, int width)
{
	if (b->n_fields < (int)(sizeof(b->fields) / sizeof(b->fields[0])))
		b->fields[b->n_fields++] = (struct field){ b->n, width };
}

/* Values are written in host order: the tests assume a little-endian host. */
static void put_u8(struct wbuf *b, uint8_t v) { put(b, &v, 1); }
static void put_u16(struct wbuf *b, uint16_t v) { put(b, &v, 2); }
static void put_u32(struct wbuf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(struct wbuf *b, uint64_t v) { put(b, &v, 8); }
static void put_f32(struct wbuf *b, float v) { put(b, &v, 4); }
static void put_f64(struct wbuf *b, double v) { put(b, &v, 8); }

static void put_len_str(struct wbuf *b, const char *s, size_t len)
{
	mark(b, 8);
	put_u64(b, len);
	put(b, s, len);
}

static void put_str(struct wbuf *b, const char *s)
{
	put_len_str(b, s, strlen(s));
}

static void w_hdr(struct wbuf *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
	put(b, "GGUF", 4);
	put_u32(b, version);
	mark(b, 8);
	put_u64(b, n_tensors);
	mark(b, 8);
	put_u64(b, n_kv);
}

/* A key and its value type; the value follows. */
static void w_key(struct wbuf *b, const char *key, uint32_t type)
{
	put_str(b, key);
	mark(b, 4);
	put_u32(b, type);
}

static void kv_u32(struct wbuf *b, const char *key, uint32_t v)
{
	w_key(b, key, GGUF_TYPE_UINT32);
	put_u32(b, v);
}

static void kv_str(struct wbuf *b, const char *key, const char *s)
{
	w_key(b, key, GGUF_TYPE_STRING);
	put_str(b, s);
}

static void w_arr(struct wbuf *b, const char *key, uint32_t elem_type, uint64_t count)
{
	w_key(b, key, GGUF_TYPE_ARRAY);
	mark(b, 4);
	put_u32(b, elem_type);
	mark(b, 8);
	put_u64(b, count);
}

static void w_tensor(struct wbuf *b, const char *name, uint32_t n_dims, const uint64_t *ne,
		     uint32_t type, uint64_t offset)
{
	put_str(b, name);
	mark(b, 4);
	put_u32(b, n_dims);
	for (uint32_t d = 0; d < n_dims; d++) {
		mark(b, 8);
		put_u64(b, ne[d]);
	}
	mark(b, 4);
	put_u32(b, type);
	mark(b, 8);
	put_u64(b, offset);
}

static void w_pad(struct wbuf *b, size_t align)
{
	static const uint8_t zero[4096];
	while (b->n % align)
		put(b, zero, 1);
}

static void w_zero(struct wbuf *b, size_t n)
{
	uint8_t z[256] = { 0 };
	while (n) {
		size_t k = n < sizeof(z) ? n : sizeof(z);
		put(b, z, k);
		n -= k;
	}
}

static void wfree(struct wbuf *b)
{
	free(b->p);
	memset(b, 0, sizeof(*b));
}

/* ---- the synthetic file --------------------------------------------------- */

#define SYN_ALIGN 64
#define SYN_TENSORS 7

static const char *const syn_tokens[] = { "<unk>", "<|im_start|>", "", "h\xc3\xa9llo", "a b" };
static const int32_t syn_i32[] = { 1, -2, 3, 2147483647, -2147483647 - 1, 0, 42 };
static const float syn_f32[] = { 0.5f, -1.25f, 3.0e-7f };
static const uint8_t syn_bools[] = { 1, 0, 1 };

static const struct {
	const char *name;
	uint32_t n_dims;
	uint64_t ne[4];
	uint32_t type;
	uint64_t bytes;
} syn_t[SYN_TENSORS] = {
	{ "token_embd.weight", 2, { 64, 3 }, GGUF_GGML_Q8_0, 2 * 34 * 3 },
	{ "output_norm.weight", 1, { 8 }, GGUF_GGML_F32, 32 },
	{ "blk.0.attn_q.weight", 2, { 32, 2 }, GGUF_GGML_Q4_1, 40 },
	{ "half", 2, { 4, 2 }, GGUF_GGML_F16, 16 },
	{ "bf16.four_dims", 4, { 2, 2, 2, 2 }, GGUF_GGML_BF16, 32 },
	{ "k6", 1, { 256 }, GGUF_GGML_Q6_K, 210 },
	{ "q4k", 3, { 256, 1, 2 }, GGUF_GGML_Q4_K, 288 },
};

struct synth {
	struct wbuf b;
	uint64_t offset[SYN_TENSORS];	/* data-section offsets, not in info order */
	size_t data_offset;
	uint64_t n_kv;
};

static uint8_t pattern(int t, uint64_t j)
{
	return (uint8_t)(t * 37 + j * 11 + 1);
}

#define SYN_N_KV 24

/* The synthetic file's scalar values, one of every type (in file order). */
struct syn_scalar {
	const char *key;
	uint32_t type;
	uint64_t bits; /* integers and bool, as their two's complement */
	double real;   /* floats */
};
static const struct syn_scalar syn_scalars[] = {
	{ "test.u8", GGUF_TYPE_UINT8, 200, 0 },
	{ "test.i8", GGUF_TYPE_INT8, (uint8_t)-5, 0 },
	{ "test.u16", GGUF_TYPE_UINT16, 60000, 0 },
	{ "test.i16", GGUF_TYPE_INT16, (uint16_t)-30000, 0 },
	{ "test.u32", GGUF_TYPE_UINT32, 4000000000u, 0 },
	{ "test.i32", GGUF_TYPE_INT32, (uint32_t)-2000000000, 0 },
	{ "test.i32_positive", GGUF_TYPE_INT32, 123, 0 },
	{ "test.f32", GGUF_TYPE_FLOAT32, 0, 1.5 },
	{ "test.bool", GGUF_TYPE_BOOL, 1, 0 },
	{ "test.u64", GGUF_TYPE_UINT64, UINT64_C(1) << 40, 0 },
	{ "test.u64_max", GGUF_TYPE_UINT64, UINT64_MAX, 0 },
	{ "test.i64", GGUF_TYPE_INT64, (uint64_t)-(INT64_C(1) << 40), 0 },
	{ "test.i64_small", GGUF_TYPE_INT64, 7, 0 },
	{ "test.f64", GGUF_TYPE_FLOAT64, 0, 2.25 },
	{ "test.f64_big", GGUF_TYPE_FLOAT64, 0, 1e300 },
};

static void kv_scalar(struct wbuf *b, const struct syn_scalar *v)
{
	w_key(b, v->key, v->type);
	switch (v->type) {
	case GGUF_TYPE_UINT8:
	case GGUF_TYPE_INT8:
	case GGUF_TYPE_BOOL:
		put_u8(b, (uint8_t)v->bits);
		break;
	case GGUF_TYPE_UINT16:
	case GGUF_TYPE_INT16:
		put_u16(b, (uint16_t)v->bits);
		break;
	case GGUF_TYPE_UINT32:
	case GGUF_TYPE_INT32:
		put_u32(b, (uint32_t)v->bits);
		break;
	case GGUF_TYPE_FLOAT32:
		put_f32(b, (float)v->real);
		break;
	case GGUF_TYPE_FLOAT64:
		put_f64(b, v->real);
		break;
	default:
		put_u64(b, v->bits);
		break;
	}
}

static void build_synth(struct synth *s)
{
	memset(s, 0, sizeof(*s));
	struct wbuf *b = &s->b;
	/* Data placed in reverse info order, so overlap checks must sort. */
	uint64_t off = 0;
	for (int t = SYN_TENSORS - 1; t >= 0; t--) {
		s->offset[t] = off;
		off += (syn_t[t].bytes + SYN_ALIGN - 1) / SYN_ALIGN * SYN_ALIGN;
	}
	w_hdr(b, 3, SYN_TENSORS, SYN_N_KV);
	kv_str(b, "general.architecture", "llama");
	kv_u32(b, "general.alignment", SYN_ALIGN);
	for (size_t i = 0; i < sizeof(syn_scalars) / sizeof(syn_scalars[0]); i++)
		kv_scalar(b, &syn_scalars[i]);
	kv_str(b, "test.empty_str", "");
	w_arr(b, "test.arr_i32", GGUF_TYPE_INT32, 7);
	put(b, syn_i32, sizeof(syn_i32));
	w_arr(b, "test.arr_f32", GGUF_TYPE_FLOAT32, 3);
	put(b, syn_f32, sizeof(syn_f32));
	w_arr(b, "test.arr_bool", GGUF_TYPE_BOOL, 3);
	put(b, syn_bools, sizeof(syn_bools));
	w_arr(b, "test.arr_empty", GGUF_TYPE_UINT8, 0);
	w_arr(b, "tokenizer.ggml.tokens", GGUF_TYPE_STRING, 5);
	for (int i = 0; i < 5; i++)
		put_str(b, syn_tokens[i]);
	w_arr(b, "test.arr_str_empty", GGUF_TYPE_STRING, 0);
	s->n_kv = SYN_N_KV;
	for (int t = 0; t < SYN_TENSORS; t++)
		w_tensor(b, syn_t[t].name, syn_t[t].n_dims, syn_t[t].ne, syn_t[t].type,
			 s->offset[t]);
	w_pad(b, SYN_ALIGN);
	s->data_offset = b->n;
	w_zero(b, off);
	for (int t = 0; t < SYN_TENSORS; t++)
		for (uint64_t j = 0; j < syn_t[t].bytes; j++)
			b->p[s->data_offset + s->offset[t] + j] = pattern(t, j);
}

/* ---- walking a loaded file --------------------------------------------------- */

static volatile uint64_t sink;

/* One of each getter's outputs. */
struct getter_outs {
	uint32_t u32;
	uint64_t u64;
	int64_t i64;
	float f;
	bool bl;
	const char *p;
	size_t len;
};

/* Read every byte the accessors hand out, and check the reader's invariants;
 * `all_data` reads all tensor data, else its first and last byte. */
static void walk(const struct gguf *g, const uint8_t *base, size_t size, bool all_data)
{
	uint64_t acc = 0;
	char msg[512];
	for (uint64_t i = 0; i < gguf_n_keys(g); i++) {
		const char *key = gguf_key_name(g, i);
		cr_assert_not_null(key);
		acc += strlen(key);
		cr_assert_eq(gguf_find_key(g, key), (int64_t)i, "key %s", key);
		uint32_t type = gguf_key_type(g, key);
		cr_assert_eq(type, gguf_key_type_at(g, i));
		struct getter_outs o;
		int rc = gguf_get_u32(g, key, &o.u32);
		if (rc < 0)
			rc = gguf_key_error(g, key, rc, "uint32", msg, sizeof(msg));
		acc += rc == 0 ? o.u32 : strlen(msg);
		acc += gguf_get_u64(g, key, &o.u64) == 0 ? o.u64 : 1;
		acc += gguf_get_i64(g, key, &o.i64) == 0 ? (uint64_t)o.i64 : 1;
		acc += gguf_get_f32(g, key, &o.f) == 0 ? (uint64_t)isnan(o.f) : 1;
		acc += gguf_get_bool(g, key, &o.bl) == 0 ? o.bl : 1;
		if (gguf_get_str(g, key, &o.p, &o.len) == 0) {
			const uint8_t *q = (const uint8_t *)o.p;
			cr_assert(q >= base && q + o.len <= base + size);
			for (size_t k = 0; k < o.len; k++)
				acc += (uint8_t)o.p[k];
		}
		uint32_t et;
		uint64_t count;
		const void *data;
		if (gguf_get_arr(g, key, &et, &count, &data) == 0) {
			if (et == GGUF_TYPE_STRING) {
				cr_assert_null(data);
				for (uint64_t k = 0; k < count; k++) {
					cr_assert_eq(gguf_get_arr_str(g, key, k, &o.p, &o.len), 0);
					for (size_t m = 0; m < o.len; m++)
						acc += (uint8_t)o.p[m];
				}
				cr_assert_eq(gguf_get_arr_str(g, key, count, &o.p, &o.len), -ERANGE);
			} else {
				static const uint8_t sz[] = { 1, 1, 2, 2, 4, 4, 4,
							      1, 0, 0, 8, 8, 8 };
				cr_assert(et < sizeof(sz) && sz[et] != 0, "element type %u", et);
				const uint8_t *d = data;
				cr_assert(count == 0 ||
					  (d >= base && d + count * sz[et] <= base + size));
				for (uint64_t k = 0; k < count * sz[et]; k++)
					acc += d[k];
			}
		}
	}
	for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
		const struct gguf_tensor *t = gguf_tensor_at(g, i);
		cr_assert_not_null(t);
		cr_assert_eq(strlen(t->name), t->name_len);
		cr_assert_eq(gguf_find_tensor(g, t->name), t);
		cr_assert(t->n_dims >= 1 && t->n_dims <= 4);
		uint64_t rows = t->ne[1] * t->ne[2] * t->ne[3];
		cr_assert_eq(t->bytes, gguf_row_bytes(t->type, t->ne[0]) * rows, "tensor %s",
			     t->name);
		cr_assert_eq(t->offset % gguf_alignment(g), 0);
		const uint8_t *d = t->data;
		cr_assert_eq(d, base + gguf_data_offset(g) + t->offset);
		cr_assert(d >= base && t->bytes <= size && d + t->bytes <= base + size);
		if (all_data) {
			for (uint64_t k = 0; k < t->bytes; k++)
				acc += d[k];
		} else {
			acc += d[0] + d[t->bytes - 1];
		}
	}
	cr_assert_null(gguf_tensor_at(g, gguf_n_tensors(g)));
	cr_assert_null(gguf_key_name(g, gguf_n_keys(g)));
	sink += acc;
}

/* ---- helpers -------------------------------------------------------------- */

/* Open `n` bytes from an exact-size heap copy, so ASan flags any read past
 * the end. */
static int open_copy(const uint8_t *p, size_t n, struct gguf **g, char *err, size_t err_bytes,
		     uint8_t **copy)
{
	*copy = malloc(n ? n : 1);
	cr_assert_not_null(*copy);
	if (n)
		memcpy(*copy, p, n);
	return gguf_open_memory(*copy, n, g, err, err_bytes);
}

/* Expect `b` to be rejected with rc and a message holding every substring. */
static void expect_reject_(struct wbuf *b, int rc, const char *const *subs, const char *where)
{
	struct gguf *g = (struct gguf *)1;
	uint8_t *copy;
	char err[512] = "";
	int got = open_copy(b->p, b->n, &g, err, sizeof(err), &copy);
	cr_expect_eq(got, rc, "%s: rc %d (%s), expected %d", where, got, err, rc);
	cr_expect_null(g, "%s: *out not NULL on failure", where);
	for (int i = 0; subs[i]; i++)
		cr_expect(strstr(err, subs[i]) != NULL, "%s: message '%s' lacks '%s'", where, err,
			  subs[i]);
	if (got == 0)
		gguf_close(g);
	free(copy);
	wfree(b);
}
#define expect_reject(b, rc, ...) \
	expect_reject_((b), (rc), (const char *const[]){ __VA_ARGS__, NULL }, __func__)

static struct gguf *open_ok(struct wbuf *b, uint8_t **copy)
{
	struct gguf *g = NULL;
	char err[512] = "";
	int rc = open_copy(b->p, b->n, &g, err, sizeof(err), copy);
	cr_assert_eq(rc, 0, "rc %d: %s", rc, err);
	return g;
}

/* A file with one key (general.alignment = align) and the given tensors,
 * whose data (zeros) ends the file at `data_bytes` past the data section. */
struct tspec {
	const char *name;
	uint32_t n_dims;
	uint64_t ne[4];
	uint32_t type;
	uint64_t offset;
};

static void tensor_file(struct wbuf *b, uint32_t align, const struct tspec *t, int n,
			size_t data_bytes)
{
	w_hdr(b, 3, (uint64_t)n, 1);
	kv_u32(b, "general.alignment", align);
	for (int i = 0; i < n; i++)
		w_tensor(b, t[i].name, t[i].n_dims, t[i].ne, t[i].type, t[i].offset);
	w_pad(b, align);
	w_zero(b, data_bytes);
}

/* ---- round trip ----------------------------------------------------------- */

Test(gguf, synthetic_file_round_trips_every_value)
{
	struct synth s;
	build_synth(&s);
	uint8_t *copy;
	struct gguf *g = open_ok(&s.b, &copy);

	cr_expect_eq(gguf_version(g), 3);
	cr_expect_eq(gguf_alignment(g), SYN_ALIGN);
	cr_expect_eq(gguf_data_offset(g), s.data_offset);
	cr_expect_eq(gguf_data_offset(g) % SYN_ALIGN, 0);
	cr_expect_eq(gguf_file_size(g), s.b.n);
	cr_expect_eq(gguf_n_keys(g), s.n_kv);
	cr_expect_str_eq(gguf_key_name(g, 0), "general.architecture");
	cr_expect_eq(gguf_find_key(g, "absent.key"), -1);
	cr_expect_eq(gguf_key_type(g, "absent.key"), GGUF_TYPE_NONE);
	cr_expect_eq(gguf_key_type(g, "test.arr_f32"), GGUF_TYPE_ARRAY);

	const char *p;
	size_t len;
	cr_assert_eq(gguf_get_str(g, "general.architecture", &p, &len), 0);
	cr_expect(len == 5 && memcmp(p, "llama", 5) == 0);
	cr_assert_eq(gguf_get_str(g, "test.empty_str", &p, &len), 0);
	cr_expect_eq(len, 0);

	uint32_t u32;
	uint64_t u64;
	int64_t i64;
	float f;
	bool bl;
	cr_assert_eq(gguf_get_u32(g, "test.u8", &u32), 0);
	cr_expect_eq(u32, 200);
	cr_assert_eq(gguf_get_u32(g, "test.u16", &u32), 0);
	cr_expect_eq(u32, 60000);
	cr_assert_eq(gguf_get_u32(g, "test.u32", &u32), 0);
	cr_expect_eq(u32, 4000000000u);
	cr_assert_eq(gguf_get_u32(g, "test.i32_positive", &u32), 0);
	cr_expect_eq(u32, 123);
	cr_assert_eq(gguf_get_u32(g, "test.i64_small", &u32), 0);
	cr_expect_eq(u32, 7);
	cr_assert_eq(gguf_get_u32(g, "general.alignment", &u32), 0);
	cr_expect_eq(u32, SYN_ALIGN);
	cr_assert_eq(gguf_get_i64(g, "test.i8", &i64), 0);
	cr_expect_eq(i64, -5);
	cr_assert_eq(gguf_get_i64(g, "test.i16", &i64), 0);
	cr_expect_eq(i64, -30000);
	cr_assert_eq(gguf_get_i64(g, "test.i32", &i64), 0);
	cr_expect_eq(i64, -2000000000);
	cr_assert_eq(gguf_get_i64(g, "test.i64", &i64), 0);
	cr_expect_eq(i64, -(INT64_C(1) << 40));
	cr_assert_eq(gguf_get_u64(g, "test.u64", &u64), 0);
	cr_expect_eq(u64, UINT64_C(1) << 40);
	cr_assert_eq(gguf_get_u64(g, "test.u64_max", &u64), 0);
	cr_expect_eq(u64, UINT64_MAX);
	cr_assert_eq(gguf_get_f32(g, "test.f32", &f), 0);
	cr_expect_eq(f, 1.5f);
	cr_assert_eq(gguf_get_f32(g, "test.f64", &f), 0);
	cr_expect_eq(f, 2.25f);
	cr_assert_eq(gguf_get_bool(g, "test.bool", &bl), 0);
	cr_expect(bl);

	uint32_t et;
	uint64_t count;
	const void *data;
	cr_assert_eq(gguf_get_arr(g, "test.arr_i32", &et, &count, &data), 0);
	cr_expect_eq(et, GGUF_TYPE_INT32);
	cr_assert_eq(count, 7);
	for (int i = 0; i < 7; i++) {
		int32_t v;
		memcpy(&v, (const uint8_t *)data + 4 * i, 4);
		cr_expect_eq(v, syn_i32[i]);
	}
	cr_assert_eq(gguf_get_arr(g, "test.arr_f32", &et, &count, &data), 0);
	cr_expect(et == GGUF_TYPE_FLOAT32 && count == 3 && memcmp(data, syn_f32, 12) == 0);
	cr_assert_eq(gguf_get_arr(g, "test.arr_bool", &et, &count, &data), 0);
	cr_expect(et == GGUF_TYPE_BOOL && count == 3 && memcmp(data, syn_bools, 3) == 0);
	cr_assert_eq(gguf_get_arr(g, "test.arr_empty", &et, &count, NULL), 0);
	cr_expect(et == GGUF_TYPE_UINT8 && count == 0);
	cr_assert_eq(gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &count, &data), 0);
	cr_expect(et == GGUF_TYPE_STRING && count == 5 && data == NULL);
	for (uint64_t i = 0; i < 5; i++) {
		cr_assert_eq(gguf_get_arr_str(g, "tokenizer.ggml.tokens", i, &p, &len), 0);
		cr_expect(len == strlen(syn_tokens[i]) && memcmp(p, syn_tokens[i], len) == 0,
			  "token %" PRIu64, i);
	}
	cr_assert_eq(gguf_get_arr(g, "test.arr_str_empty", &et, &count, NULL), 0);
	cr_expect(et == GGUF_TYPE_STRING && count == 0);

	for (int t = 0; t < SYN_TENSORS; t++) {
		const struct gguf_tensor *x = gguf_find_tensor(g, syn_t[t].name);
		cr_assert_not_null(x, "%s", syn_t[t].name);
		cr_expect_eq(x, gguf_tensor_at(g, (uint64_t)t));
		cr_expect_str_eq(x->name, syn_t[t].name);
		cr_expect_eq(x->n_dims, syn_t[t].n_dims);
		for (uint32_t d = 0; d < 4; d++)
			cr_expect_eq(x->ne[d], d < syn_t[t].n_dims ? syn_t[t].ne[d] : 1);
		cr_expect_eq(x->type, syn_t[t].type);
		cr_expect_eq(x->offset, s.offset[t]);
		cr_expect_eq(x->bytes, syn_t[t].bytes, "%s", x->name);
		cr_expect_eq((const uint8_t *)x->data, copy + s.data_offset + s.offset[t]);
		const uint8_t *d = x->data;
		for (uint64_t j = 0; j < x->bytes; j++)
			cr_assert_eq(d[j], pattern(t, j), "%s byte %" PRIu64, x->name, j);
	}
	cr_expect_null(gguf_find_tensor(g, "absent"));
	cr_expect_null(gguf_find_tensor(g, "half.")); /* a prefix match is no match */
	walk(g, copy, s.b.n, true);
	gguf_close(g);
	free(copy);
	wfree(&s.b);
}

Test(gguf, getters_check_type_and_range_with_messages)
{
	struct synth s;
	build_synth(&s);
	uint8_t *copy;
	struct gguf *g = open_ok(&s.b, &copy);
	struct getter_outs o = { .u32 = 77 };
	char msg[256];

	cr_expect_eq(gguf_get_u32(g, "test.i8", &o.u32), -ERANGE);
	cr_expect_eq(o.u32, 77, "output written on failure");
	cr_expect_eq(gguf_key_error(g, "test.i8", -ERANGE, "uint32", msg, sizeof(msg)), -ERANGE);
	cr_expect(strstr(msg, "test.i8") && strstr(msg, "-5") && strstr(msg, "uint32") &&
			  strstr(msg, "byte"),
		  "%s", msg);
	cr_expect_eq(gguf_get_u32(g, "test.u64", &o.u32), -ERANGE);
	cr_expect_eq(gguf_get_u64(g, "test.i64", &o.u64), -ERANGE);
	cr_expect_eq(gguf_get_i64(g, "test.u64_max", &o.i64), -ERANGE);
	cr_expect_eq(gguf_get_f32(g, "test.f64_big", &o.f), -ERANGE);
	cr_expect_eq(gguf_get_u32(g, "test.f32", &o.u32), -EINVAL);
	cr_expect_eq(gguf_get_u32(g, "test.bool", &o.u32), -EINVAL);
	cr_expect_eq(gguf_get_f32(g, "test.u32", &o.f), -EINVAL);
	cr_expect_eq(gguf_get_bool(g, "test.u8", &o.bl), -EINVAL);
	cr_expect_eq(gguf_get_str(g, "test.u32", &o.p, &o.len), -EINVAL);
	cr_expect_eq(gguf_key_error(g, "test.u32", -EINVAL, "a string", msg, sizeof(msg)), -EINVAL);
	cr_expect(strstr(msg, "test.u32") && strstr(msg, "uint32") && strstr(msg, "a string"), "%s",
		  msg);
	cr_expect_eq(gguf_get_arr(g, "test.u32", NULL, NULL, NULL), -EINVAL);
	cr_expect_eq(gguf_get_arr_str(g, "test.arr_i32", 0, &o.p, &o.len), -EINVAL);
	cr_expect_eq(gguf_key_error(g, "test.arr_i32", -EINVAL, "a string array", msg, sizeof(msg)),
		     -EINVAL);
	cr_expect(strstr(msg, "array of 7 int32"), "%s", msg);
	cr_expect_eq(gguf_get_arr_str(g, "tokenizer.ggml.tokens", 5, &o.p, &o.len), -ERANGE);
	cr_expect_eq(gguf_get_arr_str(g, "test.arr_str_empty", 0, &o.p, &o.len), -ERANGE);
	cr_expect_eq(gguf_get_u32(g, "absent", &o.u32), -ENOENT);
	cr_expect_eq(gguf_get_str(g, "absent", &o.p, &o.len), -ENOENT);
	cr_expect_eq(gguf_get_arr(g, "absent", NULL, NULL, NULL), -ENOENT);
	cr_expect_eq(gguf_get_arr_str(g, "absent", 0, &o.p, &o.len), -ENOENT);
	cr_expect_eq(gguf_key_error(g, "absent", -ENOENT, "uint32", msg, sizeof(msg)), -ENOENT);
	cr_expect(strstr(msg, "'absent' is absent"), "%s", msg);
	gguf_close(g);
	free(copy);
	wfree(&s.b);
}

Test(gguf, open_maps_a_file_and_names_it_in_errors)
{
	struct synth s;
	build_synth(&s);
	char path[] = "/tmp/kvr_gguf_XXXXXX";
	int fd = mkstemp(path);
	cr_assert_geq(fd, 0);
	cr_assert_eq(write(fd, s.b.p, s.b.n), (ssize_t)s.b.n);
	close(fd);

	struct gguf *g = NULL;
	char err[512];
	cr_assert_eq(gguf_open(path, &g, err, sizeof(err)), 0, "%s", err);
	cr_expect_eq(gguf_n_tensors(g), SYN_TENSORS);
	const struct gguf_tensor *t = gguf_find_tensor(g, "k6");
	cr_assert_not_null(t);
	cr_expect_eq(((const uint8_t *)t->data)[209], pattern(5, 209));
	/* mmap is page-aligned, so tensor data keeps the file's alignment */
	cr_expect_eq((uintptr_t)t->data % SYN_ALIGN, 0);
	gguf_close(g);

	/* a truncated file names itself and the place */
	cr_assert_eq(truncate(path, (off_t)s.data_offset + 10), 0);
	g = (struct gguf *)1;
	cr_expect_eq(gguf_open(path, &g, err, sizeof(err)), -EINVAL);
	cr_expect_null(g);
	cr_expect(strstr(err, path) && strstr(err, "runs past the end"), "%s", err);
	cr_assert_eq(truncate(path, 0), 0);
	cr_expect_eq(gguf_open(path, &g, err, sizeof(err)), -EINVAL);
	cr_expect(strstr(err, "truncated: 0 bytes"), "%s", err);
	unlink(path);

	cr_expect_eq(gguf_open(path, &g, err, sizeof(err)), -ENOENT);
	cr_expect(strstr(err, path) && strstr(err, "cannot open"), "%s", err);
	cr_expect_eq(gguf_open("/tmp", &g, err, sizeof(err)), -EINVAL);
	cr_expect(strstr(err, "not a regular file"), "%s", err);
	cr_expect_eq(gguf_open(NULL, &g, err, sizeof(err)), -EINVAL);
	cr_expect_eq(gguf_open(path, NULL, NULL, 0), -EINVAL);
	cr_expect_eq(gguf_open_memory(NULL, 10, &g, NULL, 0), -EINVAL);
	gguf_close(NULL);
	wfree(&s.b);
}

Test(gguf, type_table)
{
	static const struct {
		uint32_t type, be, bb;
		const char *name;
	} want[] = {
		{ GGUF_GGML_F32, 1, 4, "F32" },	       { GGUF_GGML_F16, 1, 2, "F16" },
		{ GGUF_GGML_BF16, 1, 2, "BF16" },      { GGUF_GGML_Q4_0, 32, 18, "Q4_0" },
		{ GGUF_GGML_Q4_1, 32, 20, "Q4_1" },    { GGUF_GGML_Q5_0, 32, 22, "Q5_0" },
		{ GGUF_GGML_Q5_1, 32, 24, "Q5_1" },    { GGUF_GGML_Q8_0, 32, 34, "Q8_0" },
		{ GGUF_GGML_Q2_K, 256, 84, "Q2_K" },   { GGUF_GGML_Q3_K, 256, 110, "Q3_K" },
		{ GGUF_GGML_Q4_K, 256, 144, "Q4_K" },  { GGUF_GGML_Q5_K, 256, 176, "Q5_K" },
		{ GGUF_GGML_Q6_K, 256, 210, "Q6_K" },  { GGUF_GGML_Q8_K, 256, 292, "Q8_K" },
		{ GGUF_GGML_I32, 1, 4, "I32" },	       { GGUF_GGML_F64, 1, 8, "F64" },
		{ GGUF_GGML_IQ4_NL, 32, 18, "IQ4_NL" }, { GGUF_GGML_MXFP4, 32, 17, "MXFP4" },
	};
	for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
		uint32_t be = 0, bb = 0;
		cr_expect_eq(gguf_type_size(want[i].type, &be, &bb), 0, "%s", want[i].name);
		cr_expect(be == want[i].be && bb == want[i].bb, "%s: %u/%u", want[i].name, be, bb);
		cr_expect_str_eq(gguf_type_name(want[i].type), want[i].name);
	}
	cr_expect_eq(gguf_type_size(GGUF_GGML_Q8_1, NULL, NULL), -ENOTSUP);
	cr_expect_str_eq(gguf_type_name(GGUF_GGML_Q8_1), "Q8_1");
	cr_expect_eq(gguf_type_size(4, NULL, NULL), -ENOTSUP);
	cr_expect_eq(gguf_type_size(1000, NULL, NULL), -ENOTSUP);
	cr_expect_str_eq(gguf_type_name(1000), "unknown");
	cr_expect_str_eq(gguf_value_type_name(GGUF_TYPE_STRING), "string");
	cr_expect_str_eq(gguf_value_type_name(13), "unknown");
	cr_expect_eq(gguf_row_bytes(GGUF_GGML_Q4_1, 576), 360);
	cr_expect_eq(gguf_row_bytes(GGUF_GGML_Q8_0, 576), 612);
	cr_expect_eq(gguf_row_bytes(GGUF_GGML_F32, 576), 2304);
	cr_expect_eq(gguf_row_bytes(GGUF_GGML_Q4_1, 33), 0);
	cr_expect_eq(gguf_row_bytes(GGUF_GGML_F64, UINT64_MAX / 4), 0);
	cr_expect_eq(gguf_row_bytes(GGUF_GGML_Q8_1, 32), 0);
}

Test(gguf, default_model_path_follows_the_environment)
{
	char buf[4096], dir[] = "/tmp/kvr_gguf_dir_XXXXXX";
	cr_assert_not_null(mkdtemp(dir));
	char file[4200];
	snprintf(file, sizeof(file), "%s/kvrecall", dir);
	cr_assert_eq(mkdir(file, 0700), 0);
	snprintf(file, sizeof(file), "%s/kvrecall/%s", dir, GGUF_MODEL_NAME);
	FILE *fp = fopen(file, "w");
	cr_assert_not_null(fp);
	fclose(fp);

	/* Criterion runs each test in its own process: the environment is ours. */
	unsetenv("KVR_MODEL_PATH");
	unsetenv("KVR_MODEL_DIR");
	setenv("XDG_CACHE_HOME", dir, 1);
	setenv("HOME", "/nonexistent", 1);
	cr_expect_eq(gguf_default_model_path(buf, sizeof(buf)), 0);
	cr_expect_str_eq(buf, file);
	cr_expect_eq(gguf_default_model_path(buf, 10), -ENAMETOOLONG);
	cr_expect_eq(gguf_default_model_path(NULL, 10), -EINVAL);

	/* XDG without the file falls back to HOME */
	setenv("XDG_CACHE_HOME", "/nonexistent", 1);
	char home[4200];
	snprintf(home, sizeof(home), "%s/home", dir);
	cr_assert_eq(mkdir(home, 0700), 0);
	setenv("HOME", home, 1);
	cr_expect_eq(gguf_default_model_path(buf, sizeof(buf)), -ENOENT);
	cr_expect(strstr(buf, "/home/.cache/kvrecall/" GGUF_MODEL_NAME), "%s", buf);

	/* KVR_MODEL_PATH is the only candidate when set */
	setenv("XDG_CACHE_HOME", dir, 1);
	setenv("KVR_MODEL_PATH", "/nonexistent/model.gguf", 1);
	cr_expect_eq(gguf_default_model_path(buf, sizeof(buf)), -ENOENT);
	cr_expect_str_eq(buf, "/nonexistent/model.gguf");
	setenv("KVR_MODEL_PATH", file, 1);
	cr_expect_eq(gguf_default_model_path(buf, sizeof(buf)), 0);
	cr_expect_str_eq(buf, file);

	unlink(file);
	snprintf(file, sizeof(file), "%s/kvrecall", dir);
	rmdir(file);
	rmdir(home);
	rmdir(dir);
}

/* ---- validation: one hand-made failing file per rule --------------------- */

Test(gguf, rejects_short_files_and_bad_magic)
{
	struct wbuf b = { 0 };
	put(&b, "GGUF", 4);
	put_u32(&b, 3);
	expect_reject(&b, -EINVAL, "truncated: 8 bytes", "needs 24");

	w_hdr(&b, 3, 0, 0);
	memcpy(b.p, "GGML", 4);
	expect_reject(&b, -EINVAL, "not a GGUF file", "'GGML'");
}

Test(gguf, rejects_other_versions_plainly)
{
	struct wbuf b = { 0 };
	w_hdr(&b, 1, 0, 0);
	expect_reject(&b, -ENOTSUP, "GGUF version 1", "not supported", "version 3 only");
	w_hdr(&b, 2, 0, 0);
	expect_reject(&b, -ENOTSUP, "GGUF version 2", "not supported");
	w_hdr(&b, 4, 0, 0);
	expect_reject(&b, -ENOTSUP, "GGUF version 4");
	w_hdr(&b, 0x03000000u, 0, 0); /* version 3 written big-endian */
	expect_reject(&b, -ENOTSUP, "big-endian");
}

Test(gguf, rejects_counts_the_file_cannot_hold)
{
	struct wbuf b = { 0 };
	w_hdr(&b, 3, 0, UINT64_MAX);
	kv_u32(&b, "a.b", 1);
	expect_reject(&b, -EINVAL, "claims 18446744073709551615 keys", "at byte 16");

	w_hdr(&b, 3, UINT64_C(1) << 62, 1);
	kv_u32(&b, "a.b", 1);
	expect_reject(&b, -EINVAL, "tensors (at byte 8)", "could hold at most");

	/* a count that passes the coarse bound but runs out of keys */
	w_hdr(&b, 3, 0, 3);
	kv_u32(&b, "a.b", 1);
	w_zero(&b, 30);
	expect_reject(&b, -EINVAL, "key 1 at byte 43 is 0 bytes long");
}

Test(gguf, rejects_bad_keys)
{
	struct wbuf b = { 0 };
	w_hdr(&b, 3, 0, 1);
	put_u64(&b, 1000); /* key length past the end */
	put(&b, "abc", 3);
	w_zero(&b, 20);
	expect_reject(&b, -EINVAL, "key 0 at byte 24 has length 1000",
		      "beyond the end of the file");

	w_hdr(&b, 3, 0, 1);
	kv_u32(&b, "", 1);
	expect_reject(&b, -EINVAL, "key 0 at byte 24 is 0 bytes long");

	w_hdr(&b, 3, 0, 1);
	put_len_str(&b, "a\0b", 3);
	put_u32(&b, GGUF_TYPE_UINT32);
	put_u32(&b, 1);
	expect_reject(&b, -EINVAL, "contains a NUL byte", "a\\x00b");

	static char longkey[GGUF_MAX_KEY + 2];
	memset(longkey, 'k', GGUF_MAX_KEY + 1);
	w_hdr(&b, 3, 0, 1);
	kv_u32(&b, longkey, 1);
	expect_reject(&b, -EINVAL, "65536 bytes long; keys have 1 to 65535");

	w_hdr(&b, 3, 0, 2);
	kv_u32(&b, "dup.key", 1);
	kv_str(&b, "dup.key", "x");
	expect_reject(&b, -EINVAL, "duplicate key 'dup.key'", "at bytes 24 and 47");
}

Test(gguf, rejects_bad_values)
{
	struct wbuf b = { 0 };
	w_hdr(&b, 3, 0, 1);
	w_key(&b, "a.type", 13);
	put_u32(&b, 0);
	expect_reject(&b, -EINVAL, "key 'a.type': unknown value type 13 at byte 38");

	w_hdr(&b, 3, 0, 1);
	w_key(&b, "a.bool", GGUF_TYPE_BOOL);
	put_u8(&b, 2);
	expect_reject(&b, -EINVAL, "key 'a.bool': bool at byte 42 is 2");

	w_hdr(&b, 3, 0, 1);
	w_key(&b, "a.str", GGUF_TYPE_STRING);
	put_u64(&b, 100);
	put(&b, "short", 5);
	expect_reject(&b, -EINVAL, "the string value of key 'a.str' at byte 41 has length 100",
		      "beyond the end");

	w_hdr(&b, 3, 0, 1);
	w_key(&b, "a.u64", GGUF_TYPE_UINT64);
	put_u32(&b, 1); /* 4 of its 8 bytes */
	expect_reject(&b, -EINVAL, "key 'a.u64'", "values of type uint64 at byte 41");
}

Test(gguf, rejects_bad_arrays)
{
	struct wbuf b = { 0 };
	w_hdr(&b, 3, 0, 1);
	w_arr(&b, "a.nums", GGUF_TYPE_UINT32, UINT64_C(1) << 61);
	put_u32(&b, 1);
	expect_reject(&b, -EINVAL, "key 'a.nums': 2305843009213693952 values of type uint32",
		      "past the end");

	w_hdr(&b, 3, 0, 1);
	w_arr(&b, "a.strs", GGUF_TYPE_STRING, UINT64_MAX);
	put_str(&b, "x");
	expect_reject(&b, -EINVAL, "key 'a.strs': array of 18446744073709551615 strings",
		      "cannot fit");

	w_hdr(&b, 3, 0, 1);
	w_arr(&b, "a.strs", GGUF_TYPE_STRING, 2);
	put_str(&b, "ok");
	put_u64(&b, 1u << 20);
	put(&b, "xyz", 3);
	expect_reject(&b, -EINVAL, "key 'a.strs': string 1 at byte 64 has length 1048576");

	w_hdr(&b, 3, 0, 1);
	w_arr(&b, "a.strs", GGUF_TYPE_STRING, 3);
	put_str(&b, "okokokok");
	put_str(&b, "");
	put_u32(&b, 5); /* half of string 2's length */
	expect_reject(&b, -EINVAL, "truncated: the length of string 2 of key 'a.strs' at byte 78",
		      "needs 8 bytes, the file has 4 left");

	w_hdr(&b, 3, 0, 1);
	w_arr(&b, "a.nested", GGUF_TYPE_ARRAY, 1);
	put_u32(&b, GGUF_TYPE_UINT8);
	put_u64(&b, 1);
	put_u8(&b, 1);
	expect_reject(&b, -ENOTSUP, "key 'a.nested': nested arrays (at byte 44)");

	w_hdr(&b, 3, 0, 1);
	w_arr(&b, "a.weird", 99, 1);
	put_u8(&b, 1);
	expect_reject(&b, -EINVAL, "key 'a.weird': unknown array element type 99");

	w_hdr(&b, 3, 0, 1);
	w_arr(&b, "a.bools", GGUF_TYPE_BOOL, 3);
	put_u8(&b, 0);
	put_u8(&b, 1);
	put_u8(&b, 255);
	expect_reject(&b, -EINVAL, "key 'a.bools': bool at byte 57 is 255");
}

Test(gguf, rejects_bad_alignment)
{
	static const uint32_t bad[] = { 0, 48, 3, UINT32_C(1) << 21, 0x80000000u };
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		struct wbuf b = { 0 };
		w_hdr(&b, 3, 0, 1);
		kv_u32(&b, "general.alignment", bad[i]);
		expect_reject(&b, -EINVAL, "general.alignment", "power of two from 1 to 1048576");
	}
	struct wbuf b = { 0 };
	w_hdr(&b, 3, 0, 1);
	w_key(&b, "general.alignment", GGUF_TYPE_UINT64);
	put_u64(&b, 32);
	expect_reject(&b, -EINVAL, "'general.alignment' at byte 24 has type uint64",
		      "must be uint32");
}

Test(gguf, rejects_bad_tensor_shapes)
{
	struct wbuf b = { 0 };
	struct tspec t = { "t.dims0", 0, { 0 }, GGUF_GGML_F32, 0 };
	tensor_file(&b, 32, &t, 1, 64);
	expect_reject(&b, -EINVAL, "tensor 't.dims0'", "0 dimensions; tensors have 1 to 4");

	t = (struct tspec){ "t.dims5", 5, { 1, 1, 1, 1 }, GGUF_GGML_F32, 0 };
	tensor_file(&b, 32, &t, 1, 64);
	expect_reject(&b, -EINVAL, "tensor 't.dims5'", "5 dimensions");

	t = (struct tspec){ "t.zero", 2, { 4, 0 }, GGUF_GGML_F32, 0 };
	tensor_file(&b, 32, &t, 1, 64);
	expect_reject(&b, -EINVAL, "tensor 't.zero': dimension 1 at byte", "is 0");

	t = (struct tspec){ "t.huge_dim", 1, { UINT64_C(1) << 63 }, GGUF_GGML_F32, 0 };
	tensor_file(&b, 32, &t, 1, 64);
	expect_reject(&b, -EINVAL, "tensor 't.huge_dim': dimension 0", "1 to 2^63-1");

	t = (struct tspec){ "t.product", 3, { UINT64_C(1) << 31, UINT64_C(1) << 31, 4 },
			    GGUF_GGML_F32, 0 };
	tensor_file(&b, 32, &t, 1, 64);
	expect_reject(&b, -EINVAL, "tensor 't.product'",
		      "element count overflows 2^63-1 at dimension 2");

	t = (struct tspec){ "t.bytes", 1, { UINT64_C(1) << 62 }, GGUF_GGML_F64, 0 };
	tensor_file(&b, 32, &t, 1, 64);
	expect_reject(&b, -EINVAL, "tensor 't.bytes'", "size in bytes overflows");

	t = (struct tspec){ "t.block", 2, { 48, 2 }, GGUF_GGML_Q4_1, 0 };
	tensor_file(&b, 32, &t, 1, 64);
	expect_reject(&b, -EINVAL, "tensor 't.block'",
		      "ne[0] = 48 is not a multiple of Q4_1's block of 32");
}

Test(gguf, rejects_unsupported_tensor_types_by_name)
{
	static const struct {
		uint32_t type;
		const char *name;
	} bad[] = { { 4, "Q4_2" },
		    { GGUF_GGML_Q8_1, "Q8_1" },
		    { 31, "Q4_0_4_4" },
		    { 1000, "unknown" } };
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		struct wbuf b = { 0 };
		struct tspec t = { "blk.3.ffn_up.weight", 1, { 256 }, bad[i].type, 0 };
		tensor_file(&b, 32, &t, 1, 1024);
		char type[32];
		snprintf(type, sizeof(type), "type %u (", bad[i].type);
		expect_reject(&b, -ENOTSUP, "tensor 'blk.3.ffn_up.weight'", type, bad[i].name,
			      "not supported");
	}
}

Test(gguf, rejects_bad_tensor_names)
{
	struct wbuf b = { 0 };
	struct tspec t[2] = { { "", 1, { 8 }, GGUF_GGML_F32, 0 } };
	tensor_file(&b, 32, t, 1, 64);
	expect_reject(&b, -EINVAL, "tensor 0 at byte 57", "name is 0 bytes");

	char name[GGUF_MAX_NAME + 2];
	memset(name, 'n', GGUF_MAX_NAME + 1);
	name[GGUF_MAX_NAME + 1] = '\0';
	t[0].name = name;
	tensor_file(&b, 32, t, 1, 64);
	expect_reject(&b, -EINVAL, "name is 65 bytes; names have 1 to 64");
	name[GGUF_MAX_NAME] = '\0'; /* exactly 64 is fine */
	tensor_file(&b, 32, t, 1, 64);
	uint8_t *copy;
	struct gguf *g = open_ok(&b, &copy);
	cr_expect_not_null(gguf_find_tensor(g, name));
	gguf_close(g);
	free(copy);
	wfree(&b);

	t[0] = (struct tspec){ "same", 1, { 8 }, GGUF_GGML_F32, 0 };
	t[1] = (struct tspec){ "same", 1, { 8 }, GGUF_GGML_F32, 32 };
	tensor_file(&b, 32, t, 2, 64);
	expect_reject(&b, -EINVAL, "duplicate tensor name 'same' (tensors 0 and 1)");
}

Test(gguf, rejects_bad_tensor_placement)
{
	struct wbuf b = { 0 };
	struct tspec t[2] = { { "t.misaligned", 1, { 8 }, GGUF_GGML_F32, 16 } };
	tensor_file(&b, 32, t, 1, 64);
	expect_reject(&b, -EINVAL, "tensor 't.misaligned': offset 16 at byte",
		      "not a multiple of the alignment 32");

	t[0] = (struct tspec){ "t.past_end", 1, { 16 }, GGUF_GGML_F32, 32 };
	tensor_file(&b, 32, t, 1, 64);
	expect_reject(&b, -EINVAL, "tensor 't.past_end': data at byte 128 + 32 (64 bytes)",
		      "runs past the end of the file (192 bytes)");

	t[0] = (struct tspec){ "t.far", 1, { 8 }, GGUF_GGML_F32, UINT64_MAX - 31 };
	tensor_file(&b, 32, t, 1, 64);
	expect_reject(&b, -EINVAL, "tensor 't.far'", "runs past the end");

	t[0] = (struct tspec){ "t.a", 1, { 16 }, GGUF_GGML_F32, 0 };
	t[1] = (struct tspec){ "t.b", 1, { 8 }, GGUF_GGML_F32, 32 };
	tensor_file(&b, 32, t, 2, 128);
	expect_reject(&b, -EINVAL,
		      "tensor 't.b' (data bytes 32..64) overlaps tensor 't.a' (bytes 0..64)");

	/* overlap found whatever the info order */
	t[0] = (struct tspec){ "t.b", 1, { 8 }, GGUF_GGML_F32, 32 };
	t[1] = (struct tspec){ "t.a", 1, { 16 }, GGUF_GGML_F32, 0 };
	tensor_file(&b, 32, t, 2, 128);
	expect_reject(&b, -EINVAL, "overlaps");

	/* the tensor infos end, the data section would start past the end */
	t[0] = (struct tspec){ "t.a", 1, { 8 }, GGUF_GGML_F32, 0 };
	tensor_file(&b, 32, t, 1, 0);
	b.n -= 1; /* drop one padding byte */
	expect_reject(&b, -EINVAL, "truncated: the tensor infos end at byte 92",
		      "data section would start at byte 96");

	/* truncated inside a tensor info: the message names the tensor */
	tensor_file(&b, 32, t, 1, 0);
	/* the header, the key, the name, n_dims, ne[0], half the type */
	b.n = 24 + 33 + 8 + 3 + 4 + 8 + 2;
	expect_reject(&b, -EINVAL, "truncated: the type of tensor 't.a' at byte 80 needs 4 bytes",
		      "2 left (of 82)");
}

Test(gguf, accepts_edge_cases)
{
	/* no tensors, no padding: the data section is the end of the file */
	struct wbuf b = { 0 };
	w_hdr(&b, 3, 0, 1);
	kv_str(&b, "general.architecture", "llama");
	uint8_t *copy;
	struct gguf *g = open_ok(&b, &copy);
	cr_expect_eq(gguf_data_offset(g), b.n);
	cr_expect_eq(gguf_alignment(g), GGUF_DEFAULT_ALIGNMENT);
	gguf_close(g);
	free(copy);
	wfree(&b);

	/* nothing at all after the header */
	w_hdr(&b, 3, 0, 0);
	g = open_ok(&b, &copy);
	cr_expect_eq(gguf_n_keys(g) + gguf_n_tensors(g), 0);
	cr_expect_eq(gguf_find_key(g, "x"), -1);
	cr_expect_null(gguf_find_tensor(g, "x"));
	gguf_close(g);
	free(copy);
	wfree(&b);

	/* alignment 1, adjacent tensors, a tensor ending exactly at the end */
	struct tspec t[2] = { { "a", 1, { 3 }, GGUF_GGML_I8, 0 },
			      { "b", 1, { 1 }, GGUF_GGML_I8, 3 } };
	tensor_file(&b, 1, t, 2, 4);
	g = open_ok(&b, &copy);
	cr_expect_eq(gguf_find_tensor(g, "b")->bytes, 1);
	cr_expect_eq((const uint8_t *)gguf_find_tensor(g, "b")->data, copy + b.n - 1);
	walk(g, copy, b.n, true);
	gguf_close(g);
	free(copy);
	wfree(&b);
}

/* ---- the loaders over a GGUF ------------------------------------------------
 * model_open_memory and runner_tokenizer read hyperparameters and the
 * vocabulary from the keys; the fuzz harness (tests/fuzz_gguf.c) drives them
 * with every file it makes. Regressions for what it found. */

/* A Llama header with the given block count and the two tensors every model
 * has (a 4-wide embedding of 2 tokens, the output norm), no layer tensors. */
static void llama_file(struct wbuf *b, uint32_t block_count)
{
	w_hdr(b, 3, 2, 5);
	kv_str(b, "general.architecture", "llama");
	kv_u32(b, "llama.block_count", block_count);
	kv_u32(b, "llama.embedding_length", 4);
	kv_u32(b, "llama.attention.head_count", 1);
	kv_u32(b, "llama.feed_forward_length", 4);
	w_tensor(b, "token_embd.weight", 2, (const uint64_t[]){ 4, 2 }, GGUF_GGML_F32, 0);
	w_tensor(b, "output_norm.weight", 1, (const uint64_t[]){ 4 }, GGUF_GGML_F32, 32);
	w_pad(b, GGUF_DEFAULT_ALIGNMENT);
	w_zero(b, 48);
}

/* Found by fuzzing: llama.block_count sized the layer table before any layer
 * tensor was looked for, so 0xfffffffe in a file of a few hundred bytes asked
 * calloc for 309 GB. The count is now checked against the tensors the file
 * holds. */
Test(gguf, model_refuses_a_block_count_the_file_cannot_hold)
{
	static const uint32_t counts[] = { 0xfffffffeu, 10000000u, 1u };
	for (size_t i = 0; i < sizeof(counts) / sizeof(counts[0]); i++) {
		struct wbuf b = { 0 };
		llama_file(&b, counts[i]);
		uint8_t *copy = malloc(b.n);
		cr_assert_not_null(copy);
		memcpy(copy, b.p, b.n);
		struct model *m = (struct model *)1;
		char err[512] = "", want[128];
		int rc = model_open_memory(copy, b.n, 0, &m, err, sizeof(err));
		snprintf(want, sizeof(want), "llama.block_count is %u, which needs at least %llu "
			 "tensors; the file has 2", counts[i], (unsigned long long)counts[i] * 9 + 2);
		cr_expect_eq(rc, -EINVAL, "block count %u: rc %d (%s)", counts[i], rc, err);
		cr_expect_null(m);
		cr_expect(strstr(err, want) != NULL, "block count %u: '%s' lacks '%s'", counts[i],
			  err, want);
		free(copy);
		wfree(&b);
	}
}

/* A llama file with general.alignment = 1 whose output norm starts at
 * norm_off bytes into the data section (9 one-byte filler tensors make the
 * count a one-layer model needs). */
static void misaligned_file(struct wbuf *b, uint64_t norm_off)
{
	w_hdr(b, 3, 11, 6);
	kv_str(b, "general.architecture", "llama");
	kv_u32(b, "general.alignment", 1);
	kv_u32(b, "llama.block_count", 1);
	kv_u32(b, "llama.embedding_length", 4);
	kv_u32(b, "llama.attention.head_count", 1);
	kv_u32(b, "llama.feed_forward_length", 4);
	w_tensor(b, "token_embd.weight", 2, (const uint64_t[]){ 4, 2 }, GGUF_GGML_F32, 0);
	w_tensor(b, "output_norm.weight", 1, (const uint64_t[]){ 4 }, GGUF_GGML_F32, norm_off);
	for (int i = 0; i < 9; i++) {
		char name[8];
		snprintf(name, sizeof(name), "x%d", i);
		w_tensor(b, name, 1, (const uint64_t[]){ 1 }, GGUF_GGML_I8, 56 + (uint64_t)i);
	}
	w_zero(b, 72);
}

/* Found by a probe under UBSan: general.alignment = 1 let an F32 norm start
 * at an odd address, and RMSNorm loaded it as floats. The model loader now
 * refuses vectors it would read in place off a 4-byte boundary. */
Test(gguf, model_refuses_misaligned_vectors)
{
	struct wbuf b = { 0 };
	misaligned_file(&b, 33);
	const size_t header = b.n - 72;
	wfree(&b);
	/* an offset that lands off a 4-byte boundary in a 64-byte-aligned copy */
	uint64_t off = 33;
	while ((header + off) % 4 == 0)
		off++;
	misaligned_file(&b, off);
	uint8_t *copy = aligned_alloc(64, (b.n + 63) / 64 * 64);
	cr_assert_not_null(copy);
	memcpy(copy, b.p, b.n);
	struct model *m = (struct model *)1;
	char err[512] = "";
	const int rc = model_open_memory(copy, b.n, 0, &m, err, sizeof(err));
	cr_expect_eq(rc, -EINVAL, "rc %d (%s)", rc, err);
	cr_expect_null(m);
	cr_expect(strstr(err, "output_norm.weight's data is not 4-byte aligned (general.alignment 1)"), "%s",
		  err);
	free(copy);
	wfree(&b);
}

/* Open b (an exact-size copy, kept in *copy) and build its tokenizer. */
static int tokenizer_of(struct wbuf *b, uint8_t **copy, struct tok **t, char *err, size_t n)
{
	struct gguf *g = open_ok(b, copy);
	*t = (struct tok *)1;
	int rc = runner_tokenizer(g, t, err, n);
	gguf_close(g);
	return rc;
}

/* Found by reviewing the fuzz harness's rejections: a missing or mistyped
 * tokenizer key was reported as "missing or malformed (-22)" without saying
 * which key; and the arrays were allocated by their count before their
 * element type was checked. */
Test(gguf, runner_tokenizer_names_the_key_it_refuses)
{
	struct wbuf b = { 0 };
	uint8_t *copy;
	struct tok *t;
	char err[512] = "";

	w_hdr(&b, 3, 0, 1);
	kv_str(&b, "general.architecture", "llama");
	cr_expect_eq(tokenizer_of(&b, &copy, &t, err, sizeof(err)), -ENOENT, "%s", err);
	cr_expect_null(t);
	cr_expect(strstr(err, "key 'tokenizer.ggml.model' is absent (wanted a string)"), "%s", err);
	free(copy);
	wfree(&b);

	w_hdr(&b, 3, 0, 2);
	kv_str(&b, "tokenizer.ggml.model", "gpt2");
	w_arr(&b, "tokenizer.ggml.tokens", GGUF_TYPE_UINT8, 3);
	put(&b, "abc", 3);
	cr_expect_eq(tokenizer_of(&b, &copy, &t, err, sizeof(err)), -EINVAL, "%s", err);
	cr_expect(strstr(err, "key 'tokenizer.ggml.tokens' at byte 68 has type array of 3 uint8; "
			      "wanted an array of strings"), "%s", err);
	free(copy);
	wfree(&b);

	static const char *const tokens[] = { "a", "b", "ab" };
	for (int merges_ok = 0; merges_ok < 2; merges_ok++) {
		w_hdr(&b, 3, 0, 4);
		kv_str(&b, "tokenizer.ggml.model", "gpt2");
		kv_str(&b, "tokenizer.ggml.pre", "gpt2");
		w_arr(&b, "tokenizer.ggml.tokens", GGUF_TYPE_STRING, 3);
		for (int i = 0; i < 3; i++)
			put_str(&b, tokens[i]);
		if (merges_ok) {
			w_arr(&b, "tokenizer.ggml.merges", GGUF_TYPE_STRING, 1);
			put_str(&b, "a b");
		} else {
			kv_str(&b, "tokenizer.ggml.merges", "a b"); /* a string, not an array */
		}
		int rc = tokenizer_of(&b, &copy, &t, err, sizeof(err));
		if (merges_ok) {
			cr_assert_eq(rc, 0, "%s", err);
			int32_t ids[4];
			size_t n;
			cr_expect_eq(tok_encode(t, "ab", 2, 0, ids, 4, &n), 0);
			cr_expect(n == 1 && ids[0] == 2, "\"ab\": %zu ids, first %d", n, ids[0]);
			tok_destroy(t);
		} else {
			cr_expect_eq(rc, -EINVAL, "%s", err);
			cr_expect(strstr(err, "key 'tokenizer.ggml.merges'") &&
				  strstr(err, "has type string; wanted an array of strings"), "%s", err);
		}
		free(copy);
		wfree(&b);
	}
}

/* ---- output ---------------------------------------------------------------- */

/* Lines for the test log, printed to stderr in one write when flushed, so
 * that suites running in parallel do not interleave them. (cr_log_info
 * would hide them: Criterion prints info only with --verbose.) */
struct note {
	char buf[8192];
	size_t len;
};

static void __attribute__((format(printf, 2, 3))) note(struct note *n, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int k = vsnprintf(n->buf + n->len, sizeof(n->buf) - n->len, fmt, ap);
	va_end(ap);
	size_t room = sizeof(n->buf) - n->len;
	if (k > 0)
		n->len += (size_t)k < room ? (size_t)k : room - 1;
}

static void note_flush(struct note *n)
{
	fputs(n->buf, stderr);
	fflush(stderr);
	n->len = 0;
	n->buf[0] = '\0';
}

/* ---- fuzz ----------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s)
{
	/* splitmix64: deterministic, no global state */
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

struct fuzz_stats {
	uint64_t loaded, rejected, by_rc[3]; /* EINVAL, ENOTSUP, other */
};

/* Open `n` bytes (heap copy of exactly n); on success walk everything, on
 * failure demand a message and an expected errno. */
static void fuzz_one(const uint8_t *p, size_t n, struct fuzz_stats *st, bool all_data,
		     const char *what, uint64_t iter)
{
	struct gguf *g = NULL;
	uint8_t *copy;
	char err[512] = "";
	int rc = open_copy(p, n, &g, err, sizeof(err), &copy);
	if (rc == 0) {
		walk(g, copy, n, all_data);
		gguf_close(g);
		st->loaded++;
	} else {
		cr_assert(rc == -EINVAL || rc == -ENOTSUP, "%s %" PRIu64 ": rc %d (%s)", what, iter,
			  rc, err);
		cr_assert(err[0] != '\0', "%s %" PRIu64 ": rc %d without a message", what, iter,
			  rc);
		cr_assert_null(g);
		st->rejected++;
		st->by_rc[rc == -EINVAL ? 0 : 1]++;
	}
	free(copy);
}

static const uint64_t forged_u64[] = {
	0, 1, 2, 7, 0xff, 0x7fffffff, 0xffffffff, UINT64_C(1) << 32, UINT64_C(1) << 40,
	(UINT64_C(1) << 62) + 1, INT64_MAX, UINT64_C(1) << 63, UINT64_MAX - 1, UINT64_MAX,
};

Test(gguf, fuzz_synthetic_file)
{
	struct synth s;
	build_synth(&s);
	const uint8_t *orig = s.b.p;
	size_t n = s.b.n;
	uint8_t *m = malloc(n);
	cr_assert_not_null(m);
	uint64_t seed = 0x6767756621ull, iters = 0;
	struct fuzz_stats trunc = { 0 }, flips = { 0 }, forged = { 0 };

	/* every truncation point of the header region, and some of the data */
	for (size_t len = 0; len <= s.data_offset; len++, iters++)
		fuzz_one(orig, len, &trunc, true, "truncation", len);
	for (int i = 0; i < 64; i++, iters++)
		fuzz_one(orig, s.data_offset + rng_next(&seed) % (n - s.data_offset), &trunc, true,
			 "truncation", iters);

	/* random byte changes: mostly in the header, where they matter */
	for (int i = 0; i < 2000; i++, iters++) {
		memcpy(m, orig, n);
		int k = 1 + (int)(rng_next(&seed) % 4);
		for (int j = 0; j < k; j++) {
			uint64_t r = rng_next(&seed);
			size_t at = (size_t)(r >> 8) % ((r & 3) ? s.data_offset : n);
			if ((r >> 2) & 1)
				m[at] ^= (uint8_t)(1u << ((r >> 4) & 7));
			else
				m[at] = (uint8_t)(r >> 56);
		}
		size_t len = (rng_next(&seed) % 8 == 0) ? (size_t)(rng_next(&seed) % n) : n;
		fuzz_one(m, len, &flips, true, "flip", (uint64_t)i);
	}

	/* forged values in every length, count, type and offset field */
	for (int f = 0; f < s.b.n_fields; f++) {
		const struct field *fd = &s.b.fields[f];
		uint64_t here = fd->at;
		const uint64_t extra[] = { n, n - here, n - here - 1, here, s.data_offset };
		for (size_t v = 0; v < sizeof(forged_u64) / 8 + sizeof(extra) / 8; v++, iters++) {
			const size_t nf = sizeof(forged_u64) / 8;
			uint64_t val = v < nf ? forged_u64[v] : extra[v - nf];
			memcpy(m, orig, n);
			if (fd->width == 8) {
				memcpy(m + fd->at, &val, 8);
			} else {
				uint32_t v32 = (uint32_t)val;
				memcpy(m + fd->at, &v32, 4);
			}
			fuzz_one(m, n, &forged, true, "forged", (uint64_t)f);
		}
	}
	uint64_t total = trunc.loaded + trunc.rejected + flips.loaded + flips.rejected +
			 forged.loaded + forged.rejected;
	cr_expect_geq(total, 1000);
	struct note out = { .len = 0 };
	note(&out,
	     "[gguf] fuzz, synthetic file (%zu bytes, %d forgeable fields): %" PRIu64
	     " files, loaded / rejected: truncations %" PRIu64 " / %" PRIu64
	     ", byte changes %" PRIu64 " / %" PRIu64 ", forged fields %" PRIu64 " / %" PRIu64
	     " (rejections: -EINVAL %" PRIu64 ", -ENOTSUP %" PRIu64 ")\n",
	     n, s.b.n_fields, total, trunc.loaded, trunc.rejected, flips.loaded, flips.rejected,
	     forged.loaded, forged.rejected, trunc.by_rc[0] + flips.by_rc[0] + forged.by_rc[0],
	     trunc.by_rc[1] + flips.by_rc[1] + forged.by_rc[1]);
	note_flush(&out);
	/* a fuzzer that rejects or accepts everything is not testing much */
	cr_expect_gt(flips.loaded, 0);
	cr_expect_gt(flips.rejected, 0);
	free(m);
	wfree(&s.b);
}

/* ---- the real model ------------------------------------------------------- */

struct real {
	char path[4096];
	int fd;
	const uint8_t *map;
	size_t size;
};

static bool real_open(struct real *r)
{
	int rc = gguf_default_model_path(r->path, sizeof(r->path));
	if (rc < 0)
		return false;
	r->fd = open(r->path, O_RDONLY | O_CLOEXEC);
	cr_assert_geq(r->fd, 0, "%s", r->path);
	struct stat st;
	cr_assert_eq(fstat(r->fd, &st), 0);
	r->size = (size_t)st.st_size;
	r->map = mmap(NULL, r->size, PROT_READ, MAP_PRIVATE, r->fd, 0);
	cr_assert_neq(r->map, MAP_FAILED);
	return true;
}

static void real_close(struct real *r)
{
	munmap((void *)r->map, r->size);
	close(r->fd);
}

#define SKIP_NO_MODEL                                                                          \
	cr_skip_test("model file absent (KVR_MODEL_PATH, $XDG_CACHE_HOME or ~/.cache/kvrecall/" \
		     GGUF_MODEL_NAME "): run bench/model/fetch_model.sh")

static void print_key(struct note *n, const struct gguf *g, const char *key)
{
	char line[512];
	uint32_t type = gguf_key_type(g, key);
	const char *p;
	size_t len;
	uint32_t et;
	uint64_t count;
	switch (type) {
	case GGUF_TYPE_NONE:
		snprintf(line, sizeof(line), "(absent)");
		break;
	case GGUF_TYPE_FLOAT32:
	case GGUF_TYPE_FLOAT64: {
		float f = 0;
		gguf_get_f32(g, key, &f);
		snprintf(line, sizeof(line), "%s %.9g", gguf_value_type_name(type), f);
		break;
	}
	case GGUF_TYPE_BOOL: {
		bool b = false;
		gguf_get_bool(g, key, &b);
		snprintf(line, sizeof(line), "bool %s", b ? "true" : "false");
		break;
	}
	case GGUF_TYPE_STRING:
		gguf_get_str(g, key, &p, &len);
		snprintf(line, sizeof(line), "string \"%.*s\"%s", len > 60 ? 60 : (int)len, p,
			 len > 60 ? "..." : "");
		break;
	case GGUF_TYPE_ARRAY:
		gguf_get_arr(g, key, &et, &count, NULL);
		snprintf(line, sizeof(line), "array of %" PRIu64 " %s", count,
			 gguf_value_type_name(et));
		break;
	default: {
		int64_t v = 0;
		gguf_get_i64(g, key, &v);
		snprintf(line, sizeof(line), "%s %" PRId64, gguf_value_type_name(type), v);
	}
	}
	note(n, "[gguf]   %-42s %s\n", key, line);
}

Test(gguf, real_model_loads_with_expected_shapes)
{
	char path[4096];
	if (gguf_default_model_path(path, sizeof(path)) < 0)
		SKIP_NO_MODEL;
	struct gguf *g = NULL;
	char err[512];
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	cr_assert_eq(gguf_open(path, &g, err, sizeof(err)), 0, "%s", err);
	clock_gettime(CLOCK_MONOTONIC, &t1);

	const char *p;
	size_t len;
	cr_assert_eq(gguf_get_str(g, "general.architecture", &p, &len), 0);
	cr_expect(len == 5 && memcmp(p, "llama", 5) == 0);
	cr_expect_eq(gguf_n_tensors(g), 272);
	cr_expect_eq(gguf_n_keys(g), 33);
	cr_expect_eq(gguf_alignment(g), 32);

	const struct gguf_tensor *t = gguf_find_tensor(g, "token_embd.weight");
	cr_assert_not_null(t);
	cr_expect(t->type == GGUF_GGML_Q8_0 && t->n_dims == 2 && t->ne[0] == 576 &&
		  t->ne[1] == 49152);
	cr_expect_eq(t->bytes, 30081024);
	t = gguf_find_tensor(g, "blk.0.attn_q.weight");
	cr_assert_not_null(t);
	cr_expect(t->type == GGUF_GGML_Q4_1 && t->n_dims == 2 && t->ne[0] == 576 &&
		  t->ne[1] == 576);
	t = gguf_find_tensor(g, "output_norm.weight");
	cr_assert_not_null(t);
	cr_expect(t->type == GGUF_GGML_F32 && t->n_dims == 1 && t->ne[0] == 576);
	cr_expect_null(gguf_find_tensor(g, "output.weight"), "tied embeddings: no output.weight");
	/* every layer's tensors, as the forward pass will look them up */
	static const char *const per_layer[] = { "attn_norm", "attn_q", "attn_k", "attn_v",
						 "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
						 "ffn_down" };
	for (int l = 0; l < 30; l++)
		for (size_t k = 0; k < sizeof(per_layer) / sizeof(per_layer[0]); k++) {
			char name[64];
			snprintf(name, sizeof(name), "blk.%d.%s.weight", l, per_layer[k]);
			cr_expect_not_null(gguf_find_tensor(g, name), "%s", name);
		}

	uint64_t count;
	uint32_t et;
	cr_assert_eq(gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &count, NULL), 0);
	cr_expect(et == GGUF_TYPE_STRING && count == 49152);
	cr_assert_eq(gguf_get_arr_str(g, "tokenizer.ggml.tokens", 1, &p, &len), 0);
	cr_expect(len == 12 && memcmp(p, "<|im_start|>", 12) == 0, "%.*s", (int)len, p);
	cr_assert_eq(gguf_get_arr(g, "tokenizer.ggml.merges", &et, &count, NULL), 0);
	cr_expect(et == GGUF_TYPE_STRING && count == 48900);

	/* what the Llama forward pass and the tokenizer read */
	static const char *const needed[] = {
		"llama.block_count", "llama.context_length", "llama.embedding_length",
		"llama.feed_forward_length", "llama.attention.head_count",
		"llama.attention.head_count_kv", "llama.rope.freq_base",
		"llama.attention.layer_norm_rms_epsilon", "llama.rope.dimension_count",
		"llama.vocab_size", "general.file_type", "general.quantization_version",
		"tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
		"tokenizer.ggml.token_type", "tokenizer.ggml.merges",
		"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
		"tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
		"tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix",
		"tokenizer.chat_template",
	};
	struct note n = { .len = 0 };
	double ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
	note(&n, "[gguf] %s: %" PRIu64 " keys, %" PRIu64 " tensors, data at byte %" PRIu64
		 ", opened in %.1f ms; the keys the forward pass and tokenizer read:\n",
	     path, gguf_n_keys(g), gguf_n_tensors(g), gguf_data_offset(g), ms);
	for (size_t i = 0; i < sizeof(needed) / sizeof(needed[0]); i++) {
		print_key(&n, g, needed[i]);
		cr_expect_neq(gguf_key_type(g, needed[i]), GGUF_TYPE_NONE, "%s absent", needed[i]);
	}
	uint32_t v;
	cr_expect(gguf_get_u32(g, "llama.block_count", &v) == 0 && v == 30);
	cr_expect(gguf_get_u32(g, "llama.embedding_length", &v) == 0 && v == 576);
	cr_expect(gguf_get_u32(g, "llama.attention.head_count", &v) == 0 && v == 9);
	cr_expect(gguf_get_u32(g, "llama.attention.head_count_kv", &v) == 0 && v == 3);
	cr_expect(gguf_get_u32(g, "llama.feed_forward_length", &v) == 0 && v == 1536);
	cr_expect(gguf_get_u32(g, "llama.context_length", &v) == 0 && v == 8192);
	cr_expect(gguf_get_u32(g, "llama.rope.dimension_count", &v) == 0 && v == 64);
	cr_expect(gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &v) == 0 && v == 1);
	cr_expect(gguf_get_u32(g, "tokenizer.ggml.eos_token_id", &v) == 0 && v == 2);
	float f;
	cr_expect(gguf_get_f32(g, "llama.rope.freq_base", &f) == 0 && f == 100000.0f);
	cr_expect(gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &f) == 0 && f == 1e-5f);

	/* tensor types, counted */
	uint64_t by_type[64] = { 0 };
	for (uint64_t i = 0; i < gguf_n_tensors(g); i++)
		by_type[gguf_tensor_at(g, i)->type & 63]++;
	cr_expect_eq(by_type[GGUF_GGML_Q4_1], 210);
	cr_expect_eq(by_type[GGUF_GGML_F32], 61);
	cr_expect_eq(by_type[GGUF_GGML_Q8_0], 1);
	note(&n, "[gguf] tensor types: %" PRIu64 " Q4_1, %" PRIu64 " F32, %" PRIu64 " Q8_0\n",
	     by_type[GGUF_GGML_Q4_1], by_type[GGUF_GGML_F32], by_type[GGUF_GGML_Q8_0]);
	note_flush(&n);
	/* the tensors fill the data section to the last byte */
	uint64_t sum = 0;
	for (uint64_t i = 0; i < gguf_n_tensors(g); i++)
		sum += gguf_tensor_at(g, i)->bytes;
	cr_expect_eq(sum, 96576768);
	cr_expect_eq(gguf_data_offset(g) + sum, gguf_file_size(g));
	walk(g, gguf_file_data(g), gguf_file_size(g), false);
	gguf_close(g);
}

Test(gguf, fuzz_real_model_header)
{
	struct real r;
	if (!real_open(&r))
		SKIP_NO_MODEL;
	size_t prefix = r.size < (2u << 20) ? r.size : (2u << 20);
	uint8_t *m = malloc(prefix);
	cr_assert_not_null(m);
	uint64_t seed = 0x736d6f6cull;
	struct fuzz_stats pre = { 0 }, trunc = { 0 }, whole = { 0 };

	/* 200 mutations of the first 2 MiB (the header is 1.7 MiB of it) */
	for (int i = 0; i < 200; i++) {
		memcpy(m, r.map, prefix);
		int k = 1 + (int)(rng_next(&seed) % 8);
		for (int j = 0; j < k; j++) {
			uint64_t x = rng_next(&seed);
			/* half near the front, where counts and the first keys are */
			size_t at = (x & 1) ? (size_t)(x >> 8) % 4096 : (size_t)(x >> 8) % prefix;
			m[at] = (x >> 1) & 1 ? (uint8_t)(m[at] ^ (1u << ((x >> 2) & 7)))
					     : (uint8_t)(x >> 56);
		}
		fuzz_one(m, prefix, &pre, false, "real prefix", (uint64_t)i);
	}
	/* truncations of the header region */
	for (int i = 0; i < 50; i++) {
		size_t len = (size_t)(rng_next(&seed) % prefix);
		fuzz_one(r.map, len, &trunc, false, "real truncation", len);
	}
	/* the whole file, header bytes changed in a private copy-on-write
	 * mapping (only the touched pages are copied); these can load */
	for (int i = 0; i < 30; i++) {
		uint8_t *w = mmap(NULL, r.size, PROT_READ | PROT_WRITE, MAP_PRIVATE, r.fd, 0);
		cr_assert_neq(w, MAP_FAILED);
		uint64_t x = rng_next(&seed);
		size_t at = (size_t)(x >> 8) % 1785664;
		w[at] ^= (uint8_t)(1u << (x & 7));
		struct gguf *g = NULL;
		char err[512];
		int rc = gguf_open_memory(w, r.size, &g, err, sizeof(err));
		if (rc == 0) {
			walk(g, w, r.size, false);
			gguf_close(g);
			whole.loaded++;
		} else {
			cr_assert(rc == -EINVAL || rc == -ENOTSUP, "rc %d: %s", rc, err);
			whole.rejected++;
		}
		munmap(w, r.size);
	}
	struct note out = { .len = 0 };
	note(&out,
	     "[gguf] fuzz, real file, loaded / rejected: 2 MiB prefix mutations %" PRIu64
	     " / %" PRIu64 ", truncations %" PRIu64 " / %" PRIu64
	     ", whole-file bit flips %" PRIu64 " / %" PRIu64 "\n",
	     pre.loaded, pre.rejected, trunc.loaded, trunc.rejected, whole.loaded, whole.rejected);
	note_flush(&out);
	free(m);
	real_close(&r);
}
