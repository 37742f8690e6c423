/* SPDX-License-Identifier: MIT */
/*
 * gguf.c — the GGUF v3 reader (gguf.h): mapping the file, one validating
 * pass over its header, and the lookups the forward pass and the tokenizer
 * use.
 *
 * It owns the mapping (or borrows the caller's memory), the key and tensor
 * tables, two hash indexes over their names, and one offset index per string
 * array. Invariants once gguf_open_memory returns 0, which every accessor
 * relies on instead of checking again:
 *   - every value, string, array element and tensor's data lies inside the
 *     file, with its length fields already read and checked;
 *   - bool values are 0 or 1; value types are known; arrays are not nested;
 *   - keys and tensor names are unique, NUL-free and copied NUL-terminated;
 *   - tensors have a supported type, 1..4 dimensions of at least one element,
 *     ne[0] a multiple of the type's block, an aligned offset, and data that
 *     neither overlaps another tensor's nor runs past the end of the file.
 * Parsing reads only through the bounds-checked cursor below, and sizes every
 * allocation by what was actually read (tables grow by doubling; indexes are
 * allocated after the walk that proves their count), so a forged count or
 * length is an error message, never a huge allocation or a read past the end.
 *
 * Threads: the reader is immutable after open (see gguf.h); parsing runs on
 * the opening thread only.
 */
#include <byteswap.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gguf.h"

#define GGUF_HEADER_BYTES 24u
/* The smallest a KV can be: u64 key length, 1 key byte, u32 type, 1 value byte. */
#define MIN_KV_BYTES 14u
/* The smallest tensor info: name length + 1 byte, n_dims, one ne, type, offset. */
#define MIN_TENSOR_BYTES 33u
/* Hash indexes hold uint32 slots; no real file comes anywhere near this. */
#define MAX_ENTRIES (UINT32_C(1) << 30)

struct gguf_kv {
	const char *name;	/* NUL-terminated copy (names arena) */
	uint64_t at;		/* file offset of the key's length field */
	uint64_t val;		/* file offset of the value (arrays: 1st element; strings: bytes) */
	uint64_t count;		/* arrays: elements; strings: bytes */
	uint64_t *str_index;	/* string arrays: file offset of each element's length field */
	uint32_t name_len;	/* bytes */
	uint32_t type;		/* enum gguf_value_type */
	uint32_t elem_type;	/* arrays: element type */
};

struct gguf_hash {
	uint32_t *slots;	/* index + 1, 0 = empty; open addressing, linear probing */
	uint32_t mask;		/* capacity - 1, capacity a power of two >= 2 entries */
};

struct gguf {
	const uint8_t *base;	/* the file's bytes */
	uint64_t size;		/* bytes */
	void *map;		/* our mapping (gguf_open), or NULL when borrowed */
	uint32_t alignment;	/* bytes, a power of two */
	uint64_t data_offset;	/* file offset of the data section */
	struct gguf_kv *kv;
	uint64_t n_kv;
	struct gguf_tensor *tensors;
	uint64_t n_tensors;
	char *names;		/* every key and tensor name, NUL-terminated */
	struct gguf_hash kv_hash;
	struct gguf_hash tensor_hash;
};

/* ---- messages ---------------------------------------------------------- */

/* snprintf into an optional buffer; returns rc so callers can `return say(...)`. */
static int __attribute__((format(printf, 4, 5)))
say(char *err, size_t err_bytes, int rc, const char *fmt, ...)
{
	if (err && err_bytes) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(err, err_bytes, fmt, ap);
		va_end(ap);
	}
	return rc;
}

/* Quote a name that may hold any byte (it comes from the file): printable
 * ASCII as is, the rest as \xNN, cut at 80 bytes. */
static const char *quote(char *buf, size_t bytes, const uint8_t *s, uint64_t len)
{
	size_t o = 0;
	for (uint64_t i = 0; i < len && o + 5 < bytes; i++) {
		if (i == 80) {
			o += (size_t)snprintf(buf + o, bytes - o, "...");
			break;
		}
		if (s[i] >= 0x20 && s[i] < 0x7f && s[i] != '\\')
			buf[o++] = (char)s[i];
		else
			o += (size_t)snprintf(buf + o, bytes - o, "\\x%02x", s[i]);
	}
	buf[o < bytes ? o : bytes - 1] = '\0';
	return buf;
}

/* ---- type tables ------------------------------------------------------- */

static const char *const value_type_names[] = {
	"uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
	"bool", "string", "array", "uint64", "int64", "float64",
};

const char *gguf_value_type_name(uint32_t type)
{
	if (type < sizeof(value_type_names) / sizeof(value_type_names[0]))
		return value_type_names[type];
	return "unknown";
}

/* Bytes of one scalar value; 0 for string, array and unknown types. */
static uint32_t value_size(uint32_t type)
{
	switch (type) {
	case GGUF_TYPE_UINT8:
	case GGUF_TYPE_INT8:
	case GGUF_TYPE_BOOL:
		return 1;
	case GGUF_TYPE_UINT16:
	case GGUF_TYPE_INT16:
		return 2;
	case GGUF_TYPE_UINT32:
	case GGUF_TYPE_INT32:
	case GGUF_TYPE_FLOAT32:
		return 4;
	case GGUF_TYPE_UINT64:
	case GGUF_TYPE_INT64:
	case GGUF_TYPE_FLOAT64:
		return 8;
	default:
		return 0;
	}
}

/*
 * ggml's tensor types. block_bytes = 0 marks a type that has a name but is
 * not accepted. The sizes are sizeof(block_*) in ggml-common.h (QK_K = 256),
 * and agree with gguf-py 0.19's GGML_QUANT_SIZES for every accepted type;
 * Q8_1 is where they disagree (36 vs 40), so it is refused.
 */
static const struct {
	const char *name;
	uint32_t block_elems;
	uint32_t block_bytes;
} ggml_types[] = {
	[GGUF_GGML_F32] = { "F32", 1, 4 },
	[GGUF_GGML_F16] = { "F16", 1, 2 },
	[GGUF_GGML_Q4_0] = { "Q4_0", 32, 18 },		/* half d; u8 qs[16] */
	[GGUF_GGML_Q4_1] = { "Q4_1", 32, 20 },		/* half d, m; u8 qs[16] */
	[4] = { "Q4_2 (removed from ggml)", 0, 0 },
	[5] = { "Q4_3 (removed from ggml)", 0, 0 },
	[GGUF_GGML_Q5_0] = { "Q5_0", 32, 22 },		/* half d; u8 qh[4]; u8 qs[16] */
	[GGUF_GGML_Q5_1] = { "Q5_1", 32, 24 },		/* half d, m; u8 qh[4]; u8 qs[16] */
	[GGUF_GGML_Q8_0] = { "Q8_0", 32, 34 },		/* half d; i8 qs[32] */
	[GGUF_GGML_Q8_1] = { "Q8_1", 0, 0 },		/* sources disagree: see above */
	[GGUF_GGML_Q2_K] = { "Q2_K", 256, 84 },		/* scales[16]; qs[64]; half d, dmin */
	[GGUF_GGML_Q3_K] = { "Q3_K", 256, 110 },	/* hmask[32]; qs[64]; scales[12]; half d */
	[GGUF_GGML_Q4_K] = { "Q4_K", 256, 144 },	/* half d, dmin; scales[12]; qs[128] */
	[GGUF_GGML_Q5_K] = { "Q5_K", 256, 176 },	/* half d, dmin; scales[12]; qh, qs */
	[GGUF_GGML_Q6_K] = { "Q6_K", 256, 210 },	/* ql[128]; qh[64]; i8 scales[16]; half d */
	[GGUF_GGML_Q8_K] = { "Q8_K", 256, 292 },	/* float d; i8 qs[256]; i16 bsums[16] */
	[GGUF_GGML_IQ2_XXS] = { "IQ2_XXS", 256, 66 },
	[GGUF_GGML_IQ2_XS] = { "IQ2_XS", 256, 74 },
	[GGUF_GGML_IQ3_XXS] = { "IQ3_XXS", 256, 98 },
	[GGUF_GGML_IQ1_S] = { "IQ1_S", 256, 50 },
	[GGUF_GGML_IQ4_NL] = { "IQ4_NL", 32, 18 },
	[GGUF_GGML_IQ3_S] = { "IQ3_S", 256, 110 },
	[GGUF_GGML_IQ2_S] = { "IQ2_S", 256, 82 },
	[GGUF_GGML_IQ4_XS] = { "IQ4_XS", 256, 136 },
	[GGUF_GGML_I8] = { "I8", 1, 1 },
	[GGUF_GGML_I16] = { "I16", 1, 2 },
	[GGUF_GGML_I32] = { "I32", 1, 4 },
	[GGUF_GGML_I64] = { "I64", 1, 8 },
	[GGUF_GGML_F64] = { "F64", 1, 8 },
	[GGUF_GGML_IQ1_M] = { "IQ1_M", 256, 56 },
	[GGUF_GGML_BF16] = { "BF16", 1, 2 },
	[31] = { "Q4_0_4_4 (removed from GGUF files)", 0, 0 },
	[32] = { "Q4_0_4_8 (removed from GGUF files)", 0, 0 },
	[33] = { "Q4_0_8_8 (removed from GGUF files)", 0, 0 },
	[GGUF_GGML_TQ1_0] = { "TQ1_0", 256, 54 },
	[GGUF_GGML_TQ2_0] = { "TQ2_0", 256, 66 },
	[36] = { "IQ4_NL_4_4 (removed from GGUF files)", 0, 0 },
	[37] = { "IQ4_NL_4_8 (removed from GGUF files)", 0, 0 },
	[38] = { "IQ4_NL_8_8 (removed from GGUF files)", 0, 0 },
	[GGUF_GGML_MXFP4] = { "MXFP4", 32, 17 },	/* u8 e (E8M0); u8 qs[16] */
};
#define N_GGML_TYPES (sizeof(ggml_types) / sizeof(ggml_types[0]))

const char *gguf_type_name(uint32_t type)
{
	if (type < N_GGML_TYPES && ggml_types[type].name)
		return ggml_types[type].name;
	return "unknown";
}

int gguf_type_size(uint32_t type, uint32_t *block_elems, uint32_t *block_bytes)
{
	if (type >= N_GGML_TYPES || ggml_types[type].block_bytes == 0)
		return -ENOTSUP;
	if (block_elems)
		*block_elems = ggml_types[type].block_elems;
	if (block_bytes)
		*block_bytes = ggml_types[type].block_bytes;
	return 0;
}

uint64_t gguf_row_bytes(uint32_t type, uint64_t n_elems)
{
	uint32_t be, bb;
	uint64_t bytes;
	if (gguf_type_size(type, &be, &bb) < 0 || n_elems % be != 0)
		return 0;
	if (__builtin_mul_overflow(n_elems / be, (uint64_t)bb, &bytes))
		return 0;
	return bytes;
}

/* ---- the bounds-checked cursor ------------------------------------------ */

struct cursor {
	const uint8_t *base;
	uint64_t size;
	uint64_t pos;		/* next byte to read */
	char *err;
	size_t err_bytes;
};

static uint64_t left(const struct cursor *c)
{
	return c->size - c->pos;
}

/* Fail with a message naming what was being read and where, when fewer than
 * n bytes are left. */
static int need(struct cursor *c, uint64_t n, const char *what)
{
	if (n <= left(c))
		return 0;
	return say(c->err, c->err_bytes, -EINVAL,
		   "truncated: %s at byte %" PRIu64 " needs %" PRIu64
		   " bytes, the file has %" PRIu64 " left (of %" PRIu64 ")",
		   what, c->pos, n, left(c), c->size);
}

static uint32_t peek_u32(const uint8_t *p)
{
	uint32_t v;
	memcpy(&v, p, 4);
	return le32toh(v);
}

static uint64_t peek_u64(const uint8_t *p)
{
	uint64_t v;
	memcpy(&v, p, 8);
	return le64toh(v);
}

static int read_u32(struct cursor *c, uint32_t *v, const char *what)
{
	int rc = need(c, 4, what);
	if (rc < 0)
		return rc;
	*v = peek_u32(c->base + c->pos);
	c->pos += 4;
	return 0;
}

static int read_u64(struct cursor *c, uint64_t *v, const char *what)
{
	int rc = need(c, 8, what);
	if (rc < 0)
		return rc;
	*v = peek_u64(c->base + c->pos);
	c->pos += 8;
	return 0;
}

/* A GGUF string: its length, checked against what is left, and the offset of
 * its bytes; the cursor moves past it. */
static int read_str(struct cursor *c, uint64_t *off, uint64_t *len, const char *what)
{
	uint64_t at = c->pos;
	int rc = read_u64(c, len, what);
	if (rc < 0)
		return rc;
	if (*len > left(c))
		return say(c->err, c->err_bytes, -EINVAL,
			   "%s at byte %" PRIu64 " has length %" PRIu64
			   ", beyond the end of the file (%" PRIu64 " bytes left)",
			   what, at, *len, left(c));
	*off = c->pos;
	c->pos += *len;
	return 0;
}

/* ---- growable tables ---------------------------------------------------- */

/* Make room for one more element of `elem` bytes; capacity doubles. */
static int grow(void **arr, uint64_t *cap, uint64_t n, size_t elem)
{
	if (n < *cap)
		return 0;
	uint64_t ncap = *cap ? *cap * 2 : 16;
	void *p = realloc(*arr, (size_t)ncap * elem);
	if (!p)
		return -ENOMEM;
	*arr = p;
	*cap = ncap;
	return 0;
}

/* ---- hash indexes ------------------------------------------------------- */

static uint64_t fnv1a(const char *s, size_t len)
{
	uint64_t h = 0xcbf29ce484222325ull;
	for (size_t i = 0; i < len; i++) {
		h ^= (uint8_t)s[i];
		h *= 0x100000001b3ull;
	}
	return h;
}

static int hash_init(struct gguf_hash *h, uint64_t n)
{
	uint64_t cap = 16;
	while (cap < 2 * n)
		cap *= 2;
	h->slots = calloc((size_t)cap, sizeof(*h->slots));
	if (!h->slots)
		return -ENOMEM;
	h->mask = (uint32_t)(cap - 1);
	return 0;
}

/* The index of the entry named `name` (name_at(i) gives entry i's name), or
 * -1; *slot is where it is or would go. */
static int64_t hash_find(const struct gguf_hash *h, const char *name, size_t len,
			 const char *(*name_at)(const void *, uint32_t, size_t *), const void *tab,
			 uint32_t *slot)
{
	uint32_t i = (uint32_t)fnv1a(name, len) & h->mask;
	for (;; i = (i + 1) & h->mask) {
		uint32_t s = h->slots[i];
		if (s == 0) {
			if (slot)
				*slot = i;
			return -1;
		}
		size_t l;
		const char *n = name_at(tab, s - 1, &l);
		if (l == len && memcmp(n, name, len) == 0) {
			if (slot)
				*slot = i;
			return s - 1;
		}
	}
}

static const char *kv_name_at(const void *tab, uint32_t i, size_t *len)
{
	const struct gguf_kv *kv = (const struct gguf_kv *)tab + i;
	*len = kv->name_len;
	return kv->name;
}

static const char *tensor_name_at(const void *tab, uint32_t i, size_t *len)
{
	const struct gguf_tensor *t = (const struct gguf_tensor *)tab + i;
	*len = t->name_len;
	return t->name;
}

/* ---- parsing ------------------------------------------------------------ */

/* Check and step over `count` elements of `type` (not an array) starting at
 * the cursor; `key` names the KV in messages. */
static int skip_values(struct cursor *c, const char *key, uint32_t type, uint64_t count)
{
	if (type == GGUF_TYPE_STRING) {
		/* Each string needs at least its 8-byte length. */
		if (count > left(c) / 8)
			return say(c->err, c->err_bytes, -EINVAL,
				   "key '%s': array of %" PRIu64 " strings at byte %" PRIu64
				   " cannot fit in the %" PRIu64 " bytes left",
				   key, count, c->pos, left(c));
		for (uint64_t i = 0; i < count; i++) {
			uint64_t at = c->pos, len;
			/* (no read_u64: its message would be formatted for each of
			 * the ~100k strings of a vocabulary) */
			if (left(c) < 8)
				return say(c->err, c->err_bytes, -EINVAL,
					   "truncated: the length of string %" PRIu64
					   " of key '%s' at byte %" PRIu64
					   " needs 8 bytes, the file has %" PRIu64
					   " left (of %" PRIu64 ")",
					   i, key, at, left(c), c->size);
			len = peek_u64(c->base + c->pos);
			c->pos += 8;
			if (len > left(c))
				return say(c->err, c->err_bytes, -EINVAL,
					   "key '%s': string %" PRIu64 " at byte %" PRIu64
					   " has length %" PRIu64
					   ", beyond the end of the file (%" PRIu64 " bytes left)",
					   key, i, at, len, left(c));
			c->pos += len;
		}
		return 0;
	}
	uint32_t sz = value_size(type);
	if (count > left(c) / sz)
		return say(c->err, c->err_bytes, -EINVAL,
			   "key '%s': %" PRIu64 " values of type %s at byte %" PRIu64
			   " run past the end of the file (%" PRIu64 " bytes left)",
			   key, count, gguf_value_type_name(type), c->pos, left(c));
	if (type == GGUF_TYPE_BOOL) {
		for (uint64_t i = 0; i < count; i++) {
			uint8_t b = c->base[c->pos + i];
			if (b > 1)
				return say(c->err, c->err_bytes, -EINVAL,
					   "key '%s': bool at byte %" PRIu64
					   " is %u; GGUF bools are 0 or 1",
					   key, c->pos + i, b);
		}
	}
	c->pos += count * sz;
	return 0;
}

/* Build the offset index of a string array already checked by skip_values. */
static int index_strings(const struct gguf *g, struct gguf_kv *kv)
{
	if (kv->count == 0)
		return 0;
	kv->str_index = malloc((size_t)kv->count * sizeof(uint64_t));
	if (!kv->str_index)
		return -ENOMEM;
	uint64_t pos = kv->val;
	for (uint64_t i = 0; i < kv->count; i++) {
		kv->str_index[i] = pos;
		pos += 8 + peek_u64(g->base + pos);
	}
	return 0;
}

static int parse_kvs(struct gguf *g, struct cursor *c, uint64_t n_kv)
{
	uint64_t cap = 0;
	char q[400];
	for (uint64_t i = 0; i < n_kv; i++) {
		int rc = grow((void **)&g->kv, &cap, g->n_kv, sizeof(*g->kv));
		if (rc < 0)
			return say(c->err, c->err_bytes, rc, "out of memory for %" PRIu64 " keys",
				   i);
		struct gguf_kv *kv = &g->kv[g->n_kv];
		memset(kv, 0, sizeof(*kv));
		kv->at = c->pos;
		uint64_t off, len;
		char what[512];
		snprintf(what, sizeof(what), "key %" PRIu64, i);
		rc = read_str(c, &off, &len, what);
		if (rc < 0)
			return rc;
		const uint8_t *name = c->base + off;
		if (len == 0 || len > GGUF_MAX_KEY)
			return say(c->err, c->err_bytes, -EINVAL,
				   "key %" PRIu64 " at byte %" PRIu64 " is %" PRIu64
				   " bytes long; keys have 1 to %u",
				   i, kv->at, len, GGUF_MAX_KEY);
		if (memchr(name, '\0', len))
			return say(c->err, c->err_bytes, -EINVAL,
				   "key %" PRIu64 " at byte %" PRIu64 " ('%s') contains a NUL byte",
				   i, kv->at, quote(q, sizeof(q), name, len));
		/* Until the names arena exists, name points into the file (it is
		 * not NUL-terminated: only name_len bytes are read). */
		kv->name = (const char *)name;
		kv->name_len = (uint32_t)len;
		g->n_kv++;
		quote(q, sizeof(q), name, len);

		uint64_t type_at = c->pos;
		snprintf(what, sizeof(what), "the value type of key '%s'", q);
		rc = read_u32(c, &kv->type, what);
		if (rc < 0)
			return rc;
		if (kv->type > GGUF_TYPE_FLOAT64)
			return say(c->err, c->err_bytes, -EINVAL,
				   "key '%s': unknown value type %" PRIu32 " at byte %" PRIu64, q,
				   kv->type, type_at);
		if (kv->type == GGUF_TYPE_STRING) {
			snprintf(what, sizeof(what), "the string value of key '%s'", q);
			rc = read_str(c, &kv->val, &kv->count, what);
			if (rc < 0)
				return rc;
		} else if (kv->type == GGUF_TYPE_ARRAY) {
			uint64_t et_at = c->pos;
			snprintf(what, sizeof(what), "the array header of key '%s'", q);
			rc = read_u32(c, &kv->elem_type, what);
			if (rc == 0)
				rc = read_u64(c, &kv->count, what);
			if (rc < 0)
				return rc;
			if (kv->elem_type == GGUF_TYPE_ARRAY)
				return say(c->err, c->err_bytes, -ENOTSUP,
					   "key '%s': nested arrays (at byte %" PRIu64
					   ") are not supported",
					   q, et_at);
			if (kv->elem_type > GGUF_TYPE_FLOAT64)
				return say(c->err, c->err_bytes, -EINVAL,
					   "key '%s': unknown array element type %" PRIu32
					   " at byte %" PRIu64,
					   q, kv->elem_type, et_at);
			kv->val = c->pos;
			rc = skip_values(c, q, kv->elem_type, kv->count);
			if (rc < 0)
				return rc;
			if (kv->elem_type == GGUF_TYPE_STRING && (rc = index_strings(g, kv)) < 0)
				return say(c->err, c->err_bytes, rc,
					   "out of memory indexing the %" PRIu64 " strings of '%s'",
					   kv->count, q);
		} else {
			kv->val = c->pos;
			rc = skip_values(c, q, kv->type, 1);
			if (rc < 0)
				return rc;
		}
	}
	return 0;
}

/* general.alignment, checked: a uint32 power of two up to GGUF_MAX_ALIGNMENT. */
static int read_alignment(struct gguf *g, struct cursor *c)
{
	g->alignment = GGUF_DEFAULT_ALIGNMENT;
	for (uint64_t i = 0; i < g->n_kv; i++) {
		const struct gguf_kv *kv = &g->kv[i];
		if (kv->name_len != 17 || memcmp(kv->name, "general.alignment", 17) != 0)
			continue;
		if (kv->type != GGUF_TYPE_UINT32)
			return say(c->err, c->err_bytes, -EINVAL,
				   "key 'general.alignment' at byte %" PRIu64
				   " has type %s; it must be uint32",
				   kv->at, gguf_value_type_name(kv->type));
		uint32_t a = peek_u32(g->base + kv->val);
		if (a == 0 || (a & (a - 1)) != 0 || a > GGUF_MAX_ALIGNMENT)
			return say(c->err, c->err_bytes, -EINVAL,
				   "key 'general.alignment' at byte %" PRIu64 " is %" PRIu32
				   "; it must be a power of two from 1 to %u",
				   kv->at, a, GGUF_MAX_ALIGNMENT);
		g->alignment = a;
	}
	return 0;
}

static int parse_tensor_infos(struct gguf *g, struct cursor *c, uint64_t n_tensors)
{
	uint64_t cap = 0;
	char q[400];
	for (uint64_t i = 0; i < n_tensors; i++) {
		int rc = grow((void **)&g->tensors, &cap, g->n_tensors, sizeof(*g->tensors));
		if (rc < 0)
			return say(c->err, c->err_bytes, rc,
				   "out of memory for %" PRIu64 " tensors", i);
		struct gguf_tensor *t = &g->tensors[g->n_tensors];
		memset(t, 0, sizeof(*t));
		uint64_t at = c->pos, off, len;
		char what[512];
		snprintf(what, sizeof(what), "the name of tensor %" PRIu64, i);
		rc = read_str(c, &off, &len, what);
		if (rc < 0)
			return rc;
		const uint8_t *name = c->base + off;
		quote(q, sizeof(q), name, len);
		if (len == 0 || len > GGUF_MAX_NAME)
			return say(c->err, c->err_bytes, -EINVAL,
				   "tensor %" PRIu64 " at byte %" PRIu64
				   " ('%s'): its name is %" PRIu64 " bytes; names have 1 to %u",
				   i, at, q, len, GGUF_MAX_NAME);
		if (memchr(name, '\0', len))
			return say(c->err, c->err_bytes, -EINVAL,
				   "tensor %" PRIu64 " at byte %" PRIu64
				   " ('%s'): name contains a NUL byte",
				   i, at, q);
		t->name = (const char *)name; /* into the file until the arena exists */
		t->name_len = (size_t)len;
		g->n_tensors++;

		uint64_t dims_at = c->pos;
		snprintf(what, sizeof(what), "the shape of tensor '%s'", q);
		rc = read_u32(c, &t->n_dims, what);
		if (rc < 0)
			return rc;
		if (t->n_dims < 1 || t->n_dims > GGUF_MAX_DIMS)
			return say(c->err, c->err_bytes, -EINVAL,
				   "tensor '%s' at byte %" PRIu64 ": %" PRIu32
				   " dimensions; tensors have 1 to %d",
				   q, dims_at, t->n_dims, GGUF_MAX_DIMS);
		uint64_t nelem = 1;
		for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) {
			t->ne[d] = 1;
			if (d >= t->n_dims)
				continue;
			uint64_t ne_at = c->pos;
			rc = read_u64(c, &t->ne[d], what);
			if (rc < 0)
				return rc;
			if (t->ne[d] == 0 || t->ne[d] > INT64_MAX)
				return say(c->err, c->err_bytes, -EINVAL,
					   "tensor '%s': dimension %" PRIu32 " at byte %" PRIu64
					   " is %" PRIu64 "; it must be 1 to 2^63-1",
					   q, d, ne_at, t->ne[d]);
			if (__builtin_mul_overflow(nelem, t->ne[d], &nelem) || nelem > INT64_MAX)
				return say(c->err, c->err_bytes, -EINVAL,
					   "tensor '%s' at byte %" PRIu64 ": its element count"
					   " overflows 2^63-1 at dimension %" PRIu32,
					   q, at, d);
		}
		uint64_t type_at = c->pos;
		snprintf(what, sizeof(what), "the type of tensor '%s'", q);
		rc = read_u32(c, &t->type, what);
		if (rc < 0)
			return rc;
		uint32_t be, bb;
		if (gguf_type_size(t->type, &be, &bb) < 0)
			return say(c->err, c->err_bytes, -ENOTSUP,
				   "tensor '%s': type %" PRIu32 " (%s) at byte %" PRIu64
				   " is not supported by this reader",
				   q, t->type, gguf_type_name(t->type), type_at);
		if (t->ne[0] % be != 0)
			return say(c->err, c->err_bytes, -EINVAL,
				   "tensor '%s' at byte %" PRIu64 ": ne[0] = %" PRIu64
				   " is not a multiple of %s's block of %" PRIu32,
				   q, at, t->ne[0], gguf_type_name(t->type), be);
		/* ne[0]/be·bb·ne1·ne2·ne3 = nelem·bb/be may still overflow 64 bits. */
		bool over = __builtin_mul_overflow(t->ne[0] / be, (uint64_t)bb, &t->bytes);
		for (uint32_t d = 1; d < GGUF_MAX_DIMS; d++)
			over = over || __builtin_mul_overflow(t->bytes, t->ne[d], &t->bytes);
		if (over)
			return say(c->err, c->err_bytes, -EINVAL,
				   "tensor '%s' at byte %" PRIu64
				   ": its size in bytes overflows 64 bits",
				   q, at);
		uint64_t off_at = c->pos;
		snprintf(what, sizeof(what), "the offset of tensor '%s'", q);
		rc = read_u64(c, &t->offset, what);
		if (rc < 0)
			return rc;
		if (t->offset % g->alignment != 0)
			return say(c->err, c->err_bytes, -EINVAL,
				   "tensor '%s': offset %" PRIu64 " at byte %" PRIu64
				   " is not a multiple of the alignment %" PRIu32,
				   q, t->offset, off_at, g->alignment);
	}
	return 0;
}

struct span {
	uint64_t begin, end;	/* data-section offsets */
	uint64_t i;		/* tensor index */
};

static int span_cmp(const void *a, const void *b)
{
	const struct span *x = a, *y = b;
	if (x->begin != y->begin)
		return x->begin < y->begin ? -1 : 1;
	return x->i < y->i ? -1 : x->i > y->i;
}

/* Every tensor's data inside the file, and no two overlapping. */
static int check_data(struct gguf *g, struct cursor *c)
{
	uint64_t room = g->size - g->data_offset;
	char q[400], q2[400];
	for (uint64_t i = 0; i < g->n_tensors; i++) {
		struct gguf_tensor *t = &g->tensors[i];
		if (t->offset > room || t->bytes > room - t->offset)
			return say(c->err, c->err_bytes, -EINVAL,
				   "tensor '%s': data at byte %" PRIu64 " + %" PRIu64 " (%" PRIu64
				   " bytes) runs past the end of the file (%" PRIu64 " bytes)",
				   quote(q, sizeof(q), (const uint8_t *)t->name, t->name_len),
				   g->data_offset, t->offset, t->bytes, g->size);
		t->data = g->base + g->data_offset + t->offset;
	}
	if (g->n_tensors < 2)
		return 0;
	struct span *s = malloc((size_t)g->n_tensors * sizeof(*s));
	if (!s)
		return say(c->err, c->err_bytes, -ENOMEM, "out of memory checking tensor overlaps");
	for (uint64_t i = 0; i < g->n_tensors; i++)
		s[i] = (struct span){ g->tensors[i].offset,
				      g->tensors[i].offset + g->tensors[i].bytes, i };
	qsort(s, (size_t)g->n_tensors, sizeof(*s), span_cmp);
	int rc = 0;
	for (uint64_t k = 1; k < g->n_tensors; k++) {
		if (s[k].begin < s[k - 1].end) {
			const struct gguf_tensor *a = &g->tensors[s[k - 1].i];
			const struct gguf_tensor *b = &g->tensors[s[k].i];
			quote(q, sizeof(q), (const uint8_t *)b->name, b->name_len);
			quote(q2, sizeof(q2), (const uint8_t *)a->name, a->name_len);
			rc = say(c->err, c->err_bytes, -EINVAL,
				 "tensor '%s' (data bytes %" PRIu64 "..%" PRIu64
				 ") overlaps tensor '%s' (bytes %" PRIu64 "..%" PRIu64
				 ") in the data section at byte %" PRIu64,
				 q, s[k].begin, s[k].end, q2, s[k - 1].begin, s[k - 1].end,
				 g->data_offset);
			break;
		}
	}
	free(s);
	return rc;
}

/* Copy every name NUL-terminated into one arena and index them; duplicates
 * are errors. */
static int build_names(struct gguf *g, struct cursor *c)
{
	uint64_t total = 0;
	for (uint64_t i = 0; i < g->n_kv; i++)
		total += g->kv[i].name_len + 1;
	for (uint64_t i = 0; i < g->n_tensors; i++)
		total += g->tensors[i].name_len + 1;
	g->names = malloc((size_t)total + 1);
	if (!g->names)
		return say(c->err, c->err_bytes, -ENOMEM, "out of memory for names");
	char *p = g->names;
	for (uint64_t i = 0; i < g->n_kv; i++) {
		memcpy(p, g->kv[i].name, g->kv[i].name_len);
		p[g->kv[i].name_len] = '\0';
		g->kv[i].name = p;
		p += g->kv[i].name_len + 1;
	}
	for (uint64_t i = 0; i < g->n_tensors; i++) {
		memcpy(p, g->tensors[i].name, g->tensors[i].name_len);
		p[g->tensors[i].name_len] = '\0';
		g->tensors[i].name = p;
		p += g->tensors[i].name_len + 1;
	}
	char q[400];
	if (hash_init(&g->kv_hash, g->n_kv) < 0 || hash_init(&g->tensor_hash, g->n_tensors) < 0)
		return say(c->err, c->err_bytes, -ENOMEM, "out of memory for the name indexes");
	for (uint64_t i = 0; i < g->n_kv; i++) {
		uint32_t slot;
		const struct gguf_kv *kv = &g->kv[i];
		int64_t j =
			hash_find(&g->kv_hash, kv->name, kv->name_len, kv_name_at, g->kv, &slot);
		if (j >= 0)
			return say(c->err, c->err_bytes, -EINVAL,
				   "duplicate key '%s' at bytes %" PRIu64 " and %" PRIu64,
				   quote(q, sizeof(q), (const uint8_t *)kv->name, kv->name_len),
				   g->kv[j].at, kv->at);
		g->kv_hash.slots[slot] = (uint32_t)i + 1;
	}
	for (uint64_t i = 0; i < g->n_tensors; i++) {
		const struct gguf_tensor *t = &g->tensors[i];
		uint32_t slot;
		int64_t j = hash_find(&g->tensor_hash, t->name, t->name_len, tensor_name_at,
				      g->tensors, &slot);
		if (j >= 0)
			return say(c->err, c->err_bytes, -EINVAL,
				   "duplicate tensor name '%s' (tensors %" PRId64 " and %" PRIu64
				   ")",
				   quote(q, sizeof(q), (const uint8_t *)t->name, t->name_len), j,
				   i);
		g->tensor_hash.slots[slot] = (uint32_t)i + 1;
	}
	return 0;
}

static int parse(struct gguf *g, char *err, size_t err_bytes)
{
	struct cursor c = { g->base, g->size, 0, err, err_bytes };
	if (g->size < GGUF_HEADER_BYTES)
		return say(err, err_bytes, -EINVAL,
			   "truncated: %" PRIu64 " bytes; a GGUF header needs %u", g->size,
			   GGUF_HEADER_BYTES);
	if (memcmp(g->base, "GGUF", 4) != 0) {
		char q[64];
		return say(err, err_bytes, -EINVAL,
			   "not a GGUF file: the magic at byte 0 is '%s', not 'GGUF'",
			   quote(q, sizeof(q), g->base, 4));
	}
	c.pos = 4;
	uint32_t version;
	uint64_t n_tensors, n_kv;
	(void)read_u32(&c, &version, "the version");
	if (version != 3) {
		if (version == 1 || version == 2)
			return say(err, err_bytes, -ENOTSUP,
				   "GGUF version %" PRIu32 " (at byte 4) is not supported: this"
				   " reader reads version 3 only; convert the model again with a"
				   " current llama.cpp",
				   version);
		if (version != 0 && bswap_32(version) <= 3)
			return say(err, err_bytes, -ENOTSUP,
				   "big-endian GGUF files are not supported (the version at"
				   " byte 4 reads %" PRIu32 " byte-swapped)",
				   bswap_32(version));
		return say(err, err_bytes, -ENOTSUP,
			   "GGUF version %" PRIu32 " (at byte 4) is not supported: this reader "
			   "reads version 3 only",
			   version);
	}
	(void)read_u64(&c, &n_tensors, "the tensor count");
	(void)read_u64(&c, &n_kv, "the key count");
	/* Each entry takes some bytes, so the counts are bounded by the file;
	 * this stops a forged count early, with a message saying so. */
	uint64_t room = left(&c);
	if (n_kv > room / MIN_KV_BYTES || n_kv > MAX_ENTRIES)
		return say(err, err_bytes, -EINVAL,
			   "the header claims %" PRIu64 " keys (at byte 16); the %" PRIu64
			   " bytes after it could hold at most %" PRIu64,
			   n_kv, room, room / MIN_KV_BYTES);
	if (n_tensors > (room - n_kv * MIN_KV_BYTES) / MIN_TENSOR_BYTES || n_tensors > MAX_ENTRIES)
		return say(err, err_bytes, -EINVAL,
			   "the header claims %" PRIu64 " tensors (at byte 8) and %" PRIu64
			   " keys; the %" PRIu64 " bytes after it could hold at most %" PRIu64
			   " tensors besides the keys",
			   n_tensors, n_kv, room, (room - n_kv * MIN_KV_BYTES) / MIN_TENSOR_BYTES);
	int rc = parse_kvs(g, &c, n_kv);
	if (rc == 0)
		rc = read_alignment(g, &c);
	if (rc == 0)
		rc = parse_tensor_infos(g, &c, n_tensors);
	if (rc < 0)
		return rc;
	/* The data section starts at the next multiple of the alignment; a
	 * file without tensors may end before it. */
	uint64_t end_infos = c.pos;
	g->data_offset = (end_infos + g->alignment - 1) / g->alignment * g->alignment;
	if (g->data_offset > g->size) {
		if (g->n_tensors > 0)
			return say(err, err_bytes, -EINVAL,
				   "truncated: the tensor infos end at byte %" PRIu64
				   " and the data section would start at byte %" PRIu64
				   ", past the end of the file (%" PRIu64 " bytes)",
				   end_infos, g->data_offset, g->size);
		g->data_offset = g->size;
	}
	rc = build_names(g, &c);
	if (rc == 0)
		rc = check_data(g, &c);
	return rc;
}

/* ---- open / close ------------------------------------------------------- */

static void destroy(struct gguf *g)
{
	if (!g)
		return;
	for (uint64_t i = 0; i < g->n_kv; i++)
		free(g->kv[i].str_index);
	free(g->kv);
	free(g->tensors);
	free(g->names);
	free(g->kv_hash.slots);
	free(g->tensor_hash.slots);
	if (g->map)
		munmap(g->map, (size_t)g->size);
	free(g);
}

int gguf_open_memory(const void *data, size_t size, struct gguf **out, char *err,
		     size_t err_bytes)
{
	if (err && err_bytes)
		err[0] = '\0';
	if (!out)
		return say(err, err_bytes, -EINVAL, "gguf_open_memory: out is NULL");
	*out = NULL;
	if (!data && size)
		return say(err, err_bytes, -EINVAL, "gguf_open_memory: data is NULL");
	struct gguf *g = calloc(1, sizeof(*g));
	if (!g)
		return say(err, err_bytes, -ENOMEM, "out of memory");
	g->base = data;
	g->size = size;
	int rc = parse(g, err, err_bytes);
	if (rc < 0) {
		destroy(g);
		return rc;
	}
	*out = g;
	return 0;
}

int gguf_open(const char *path, struct gguf **out, char *err, size_t err_bytes)
{
	if (err && err_bytes)
		err[0] = '\0';
	if (!out || !path)
		return say(err, err_bytes, -EINVAL, "gguf_open: %s is NULL", out ? "path" : "out");
	*out = NULL;
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		int e = errno;
		return say(err, err_bytes, -e, "%s: cannot open: %s", path, strerror(e));
	}
	struct stat st;
	if (fstat(fd, &st) < 0) {
		int e = errno;
		close(fd);
		return say(err, err_bytes, -e, "%s: cannot stat: %s", path, strerror(e));
	}
	if (!S_ISREG(st.st_mode)) {
		close(fd);
		return say(err, err_bytes, -EINVAL, "%s: not a regular file", path);
	}
	size_t size = (size_t)st.st_size;
	void *map = NULL;
	if (size > 0) {
		/* Read-only and private: nothing we do can reach the file. */
		map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
		if (map == MAP_FAILED) {
			int e = errno;
			close(fd);
			return say(err, err_bytes, -e, "%s: cannot map %zu bytes: %s", path, size,
				   strerror(e));
		}
		/* The forward pass streams every weight each token: start reading
		 * the whole file now rather than page by page. Advice only. */
		(void)madvise(map, size, MADV_WILLNEED);
	}
	close(fd);
	char msg[512];
	struct gguf *g = NULL;
	int rc = gguf_open_memory(map ? map : "", size, &g, msg, sizeof(msg));
	if (rc < 0) {
		if (map)
			munmap(map, size);
		return say(err, err_bytes, rc, "%s: %s", path, msg);
	}
	g->map = map;
	*out = g;
	return 0;
}

void gguf_close(struct gguf *g)
{
	destroy(g);
}

uint32_t gguf_version(const struct gguf *g)
{
	(void)g;
	return 3;
}

uint32_t gguf_alignment(const struct gguf *g)
{
	return g->alignment;
}

uint64_t gguf_data_offset(const struct gguf *g)
{
	return g->data_offset;
}

uint64_t gguf_file_size(const struct gguf *g)
{
	return g->size;
}

const void *gguf_file_data(const struct gguf *g)
{
	return g->base;
}

/* ---- metadata ----------------------------------------------------------- */

uint64_t gguf_n_keys(const struct gguf *g)
{
	return g->n_kv;
}

const char *gguf_key_name(const struct gguf *g, uint64_t i)
{
	return i < g->n_kv ? g->kv[i].name : NULL;
}

int64_t gguf_find_key(const struct gguf *g, const char *key)
{
	if (!g || !key)
		return -1;
	return hash_find(&g->kv_hash, key, strlen(key), kv_name_at, g->kv, NULL);
}

static const struct gguf_kv *lookup(const struct gguf *g, const char *key)
{
	int64_t i = gguf_find_key(g, key);
	return i < 0 ? NULL : &g->kv[i];
}

uint32_t gguf_key_type(const struct gguf *g, const char *key)
{
	const struct gguf_kv *kv = lookup(g, key);
	return kv ? kv->type : GGUF_TYPE_NONE;
}

uint32_t gguf_key_type_at(const struct gguf *g, uint64_t i)
{
	return i < g->n_kv ? g->kv[i].type : GGUF_TYPE_NONE;
}

/* An integer value widened to sign + magnitude; -EINVAL when not an integer. */
static int integer(const struct gguf *g, const struct gguf_kv *kv, bool *neg, uint64_t *mag)
{
	const uint8_t *p = g->base + kv->val;
	int64_t s;
	*neg = false;
	switch (kv->type) {
	case GGUF_TYPE_UINT8:
		*mag = p[0];
		return 0;
	case GGUF_TYPE_UINT16: {
		uint16_t v;
		memcpy(&v, p, 2);
		*mag = le16toh(v);
		return 0;
	}
	case GGUF_TYPE_UINT32:
		*mag = peek_u32(p);
		return 0;
	case GGUF_TYPE_UINT64:
		*mag = peek_u64(p);
		return 0;
	case GGUF_TYPE_INT8:
		s = (int8_t)p[0];
		break;
	case GGUF_TYPE_INT16: {
		uint16_t v;
		memcpy(&v, p, 2);
		s = (int16_t)le16toh(v);
		break;
	}
	case GGUF_TYPE_INT32:
		s = (int32_t)peek_u32(p);
		break;
	case GGUF_TYPE_INT64:
		s = (int64_t)peek_u64(p);
		break;
	default:
		return -EINVAL;
	}
	*neg = s < 0;
	/* The magnitude of INT64_MIN does not fit int64_t: negate unsigned. */
	*mag = s < 0 ? -(uint64_t)s : (uint64_t)s;
	return 0;
}

/* The integer under `key` as a sign and magnitude: 0, -ENOENT (no key) or
 * -EINVAL (not an integer). */
static int integer_of(const struct gguf *g, const char *key, bool *neg, uint64_t *mag)
{
	const struct gguf_kv *kv = lookup(g, key);
	if (!kv)
		return -ENOENT;
	return integer(g, kv, neg, mag) < 0 ? -EINVAL : 0;
}

/* The integer at key when it lies in [-neg_limit, pos_limit] (as sign and
 * magnitude): 0, -ENOENT, -EINVAL (not an integer) or -ERANGE. */
static int integer_within(const struct gguf *g, const char *key, uint64_t neg_limit,
			  uint64_t pos_limit, bool *neg, uint64_t *mag)
{
	const int rc = integer_of(g, key, neg, mag);
	if (!rc && *mag > (*neg ? neg_limit : pos_limit))
		return -ERANGE;
	return rc;
}

int gguf_get_u32(const struct gguf *g, const char *key, uint32_t *out)
{
	bool neg;
	uint64_t mag;
	const int rc = integer_within(g, key, 0, UINT32_MAX, &neg, &mag);
	if (!rc && out)
		*out = (uint32_t)mag;
	return rc;
}

int gguf_get_u64(const struct gguf *g, const char *key, uint64_t *out)
{
	bool neg;
	uint64_t mag;
	const int rc = integer_within(g, key, 0, UINT64_MAX, &neg, &mag);
	if (!rc && out)
		*out = mag;
	return rc;
}

int gguf_get_i64(const struct gguf *g, const char *key, int64_t *out)
{
	bool neg;
	uint64_t mag;
	/* a negative value came from an int64, so it fits */
	const int rc = integer_within(g, key, UINT64_MAX, INT64_MAX, &neg, &mag);
	if (!rc && out)
		*out = neg ? (int64_t)(0 - mag) : (int64_t)mag;
	return rc;
}

int gguf_get_f32(const struct gguf *g, const char *key, float *out)
{
	const struct gguf_kv *kv = lookup(g, key);
	if (!kv)
		return -ENOENT;
	const uint8_t *p = g->base + kv->val;
	if (kv->type == GGUF_TYPE_FLOAT32) {
		uint32_t bits = peek_u32(p);
		float f;
		memcpy(&f, &bits, 4);
		if (out)
			*out = f;
		return 0;
	}
	if (kv->type == GGUF_TYPE_FLOAT64) {
		uint64_t bits = peek_u64(p);
		double d;
		memcpy(&d, &bits, 8);
		if (isfinite(d) && fabs(d) > FLT_MAX)
			return -ERANGE;
		if (out)
			*out = (float)d;
		return 0;
	}
	return -EINVAL;
}

int gguf_get_bool(const struct gguf *g, const char *key, bool *out)
{
	const struct gguf_kv *kv = lookup(g, key);
	if (!kv)
		return -ENOENT;
	if (kv->type != GGUF_TYPE_BOOL)
		return -EINVAL;
	if (out)
		*out = g->base[kv->val] != 0;
	return 0;
}

int gguf_get_str(const struct gguf *g, const char *key, const char **ptr, size_t *len)
{
	const struct gguf_kv *kv = lookup(g, key);
	if (!kv)
		return -ENOENT;
	if (kv->type != GGUF_TYPE_STRING)
		return -EINVAL;
	if (ptr)
		*ptr = (const char *)g->base + kv->val;
	if (len)
		*len = (size_t)kv->count;
	return 0;
}

int gguf_get_arr(const struct gguf *g, const char *key, uint32_t *elem_type, uint64_t *count,
		 const void **data)
{
	const struct gguf_kv *kv = lookup(g, key);
	if (!kv)
		return -ENOENT;
	if (kv->type != GGUF_TYPE_ARRAY)
		return -EINVAL;
	if (elem_type)
		*elem_type = kv->elem_type;
	if (count)
		*count = kv->count;
	if (data)
		*data = kv->elem_type == GGUF_TYPE_STRING ? NULL : g->base + kv->val;
	return 0;
}

int gguf_get_arr_str(const struct gguf *g, const char *key, uint64_t index, const char **ptr,
		     size_t *len)
{
	const struct gguf_kv *kv = lookup(g, key);
	if (!kv)
		return -ENOENT;
	if (kv->type != GGUF_TYPE_ARRAY || kv->elem_type != GGUF_TYPE_STRING)
		return -EINVAL;
	if (index >= kv->count)
		return -ERANGE;
	uint64_t at = kv->str_index[index];
	if (ptr)
		*ptr = (const char *)g->base + at + 8;
	if (len)
		*len = (size_t)peek_u64(g->base + at);
	return 0;
}

int gguf_key_error(const struct gguf *g, const char *key, int rc, const char *wanted, char *err,
		   size_t err_bytes)
{
	if (!wanted)
		wanted = "another type";
	const struct gguf_kv *kv = g && key ? lookup(g, key) : NULL;
	if (!kv)
		return say(err, err_bytes, rc, "key '%s' is absent (wanted %s)",
			   key ? key : "(null)", wanted);
	char type[64];
	if (kv->type == GGUF_TYPE_ARRAY)
		snprintf(type, sizeof(type), "array of %" PRIu64 " %s", kv->count,
			 gguf_value_type_name(kv->elem_type));
	else
		snprintf(type, sizeof(type), "%s", gguf_value_type_name(kv->type));
	if (rc == -ERANGE) {
		bool neg;
		uint64_t mag;
		if (integer(g, kv, &neg, &mag) == 0)
			return say(err, err_bytes, rc,
				   "key '%s' at byte %" PRIu64 ": %s value %s%" PRIu64
				   " is out of range for %s",
				   key, kv->at, type, neg ? "-" : "", mag, wanted);
		return say(err, err_bytes, rc,
			   "key '%s' at byte %" PRIu64 ": %s is out of range for %s", key, kv->at,
			   type, wanted);
	}
	if (rc == -EINVAL)
		return say(err, err_bytes, rc,
			   "key '%s' at byte %" PRIu64 " has type %s; wanted %s", key, kv->at, type,
			   wanted);
	return say(err, err_bytes, rc, "key '%s' at byte %" PRIu64 " (%s): %s (wanted %s)", key,
		   kv->at, type, strerror(rc < 0 ? -rc : rc), wanted);
}

/* ---- tensors ------------------------------------------------------------ */

uint64_t gguf_n_tensors(const struct gguf *g)
{
	return g->n_tensors;
}

const struct gguf_tensor *gguf_tensor_at(const struct gguf *g, uint64_t i)
{
	return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const struct gguf_tensor *gguf_find_tensor(const struct gguf *g, const char *name)
{
	if (!g || !name)
		return NULL;
	int64_t i = hash_find(&g->tensor_hash, name, strlen(name), tensor_name_at, g->tensors,
			      NULL);
	return i < 0 ? NULL : &g->tensors[i];
}

/* ---- the model file ----------------------------------------------------- */

/* buf = a + b (b may be NULL); 0, or -ENAMETOOLONG. */
static int join(char *buf, size_t bytes, const char *a, const char *b)
{
	int n = snprintf(buf, bytes, "%s%s", a, b ? b : "");
	if (n < 0 || (size_t)n >= bytes) {
		buf[0] = '\0';
		return -ENAMETOOLONG;
	}
	return 0;
}

static bool is_file(const char *path)
{
	struct stat st;
	return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

int gguf_default_model_path(char *buf, size_t bytes)
{
	if (!buf || bytes == 0)
		return -EINVAL;
	buf[0] = '\0';
	const char *env = getenv("KVR_MODEL_PATH");
	if (env && env[0]) {
		/* An explicit file is the only candidate: a silent fallback to
		 * another copy would hide a typo. */
		int rc = join(buf, bytes, env, NULL);
		if (rc < 0)
			return rc;
		return is_file(buf) ? 0 : -ENOENT;
	}
	static const struct {
		const char *var, *suffix;
	} dirs[] = {
		{ "KVR_MODEL_DIR", "/" GGUF_MODEL_NAME },
		{ "XDG_CACHE_HOME", "/kvrecall/" GGUF_MODEL_NAME },
		{ "HOME", "/.cache/kvrecall/" GGUF_MODEL_NAME },
	};
	int rc = -ENOENT;
	for (size_t i = 0; i < sizeof(dirs) / sizeof(dirs[0]); i++) {
		env = getenv(dirs[i].var);
		if (!env || !env[0])
			continue;
		rc = join(buf, bytes, env, dirs[i].suffix);
		if (rc == 0 && is_file(buf))
			return 0;
		if (rc == 0)
			rc = -ENOENT;
	}
	return rc;
}
