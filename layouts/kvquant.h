/* SPDX-License-Identifier: MIT */
/*
 * kvquant.h — the quantised page formats K8V4 and K4V2 (LeanKV's
 * asymmetric per-vector quantisation, keys at more bits than values) and their
 * per-element math, shared by the cpu backend, the CUDA kernels and cudaemu.
 *
 * Quantisation (LeanKV Eq. 2), one (scale, zero point) pair per token and KV
 * head for its key vector and another for its value vector, both f16:
 *     z = −min(x),  s = (max(x) − min(x)) / (2^b − 1),
 *     Q = clamp(round((x + z) / s), 0, 2^b − 1),   x̂ = s·Q − z.
 * The stored s and z are f16, so the codes are computed against the stored
 * values: z16 = f16(z) (nearest), s16 = the smallest f16 ≥ (max + z16)/(2^b − 1)
 * (rounded up, so the largest element still fits). Then for every finite
 * element |x − x̂| ≤ s16/2 + |z − z16|: half a quantisation step, plus the f16
 * rounding of the zero point (at most 2^-11·|min|), which only the clamp at
 * either end can add. A constant vector gets s16 = 0 and every code 0.
 * Inputs must be finite (a non-finite element makes the vector's s or z
 * non-finite, and its dequantised values NaN or infinite).
 *
 * A quantised page keeps the HND shape of page.h — one contiguous run per KV
 * head, so recall still moves one run per (page, head) — and each run is:
 *     [key codes: p rows of d·kb/8 bytes][value codes: p rows of d·vb/8 bytes]
 *     [key (s, z): p × 2 f16][value (s, z): p × 2 f16]
 * every segment starting 16-byte aligned. Codes are packed little-endian
 * within a byte: element i of a row is bits [(i·b) mod 8, +b) of byte
 * ⌊i·b/8⌋, so 4-bit pairs and 2-bit quads unpack with shifts and masks on
 * whole words (vectorised dequantisation). d must be a multiple of 16.
 *
 * Everything here is `static inline KVR_HD` (hd.h) and allocation-free.
 */
#ifndef KVR_LAYOUTS_KVQUANT_H
#define KVR_LAYOUTS_KVQUANT_H

#include <stdint.h>

#include "half.h"
#include "hd.h"
#include "page.h" /* enum kvr_elem_type */

/* Page formats; f16 and bf16 pages are the element types of page.h. */
enum kvr_kv_format {
	KVR_KV_PLAIN = 0, /* unquantised: the context's dtype */
	KVR_KV_K8V4 = 1,  /* keys 8-bit, values 4-bit */
	KVR_KV_K4V2 = 2,  /* keys 4-bit, values 2-bit */
	/* A pool's (not a page's) format: every page starts K8V4 and may be
	 * demoted to K4V2 in place; runs keep the K8V4 run's size and stride
	 * (unified pages), a K4V2 run using its first part. */
	KVR_KV_MIXED = 3,
	/* Half of a K8V4 page as the device page cache may hold it: a K8V4 run
	 * of page_tokens / 2 tokens (page_tokens even), which fits the room of
	 * one K4V2 run, so that under mixed pages a unit of K4V2 size holds a
	 * whole K4V2 page or half a K8V4 page (LeanKV's unified pages: equal
	 * bytes, more tokens when quantised harder). Never a pool page's
	 * format; kvr_quant_half_piece copies a K8V4 run's half into one. */
	KVR_KV_K8V4_HALF = 4,
	/* Not a page's format: an attention segment of page estimates (plain
	 * rows of mean keys and values, each standing for page_tokens tokens;
	 * gpu/kernels.h). kvr_quant_geometry_init refuses it. */
	KVR_KV_ESTIMATE = 5,
};

struct kvr_quant_geometry {
	uint32_t page_tokens; /* p */
	uint32_t head_dim;    /* d */
	uint32_t n_kv_heads;
	uint32_t format;      /* enum kvr_kv_format, not PLAIN */
	uint32_t key_bits, value_bits;
	uint64_t key_row_bytes, value_row_bytes; /* d·b/8 */
	uint64_t value_codes_offset;             /* from the run's start; 16-byte aligned */
	uint64_t key_meta_offset, value_meta_offset;
	uint64_t head_bytes; /* one KV head's run, a multiple of 16 */
	uint64_t page_bytes; /* n_kv_heads · head_bytes */
};

static inline KVR_HD uint64_t kvr_quant_align16(uint64_t x)
{
	return (x + 15u) & ~(uint64_t)15u;
}

/* The largest head_dim the quantising kernels take (their scratch holds one
 * row as floats); the config allows no more. */
#define KVR_QUANT_MAX_DIM 256u

/* Fill *g; 0, or -1 for PLAIN or an unknown format, a zero dimension, or d
 * not a multiple of 16. For K8V4_HALF, page_tokens is the whole page's (even)
 * and g->page_tokens the half's. */
static inline KVR_HD int kvr_quant_geometry_init(struct kvr_quant_geometry *g, uint32_t page_tokens,
						 uint32_t head_dim, uint32_t n_kv_heads, uint32_t format)
{
	const struct kvr_quant_geometry zero = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 };
	*g = zero; /* fully written even on failure */
	const uint32_t kb = format == KVR_KV_K8V4 || format == KVR_KV_K8V4_HALF ? 8u
			    : format == KVR_KV_K4V2				 ? 4u
										 : 0u;
	if (format == KVR_KV_K8V4_HALF) {
		if (page_tokens % 2u)
			return -1;
		page_tokens /= 2u; /* the half's own run: p/2 rows */
	}
	if (!kb || !page_tokens || !head_dim || head_dim % 16u || !n_kv_heads)
		return -1;
	g->page_tokens = page_tokens;
	g->head_dim = head_dim;
	g->n_kv_heads = n_kv_heads;
	g->format = format;
	g->key_bits = kb;
	g->value_bits = kb / 2u;
	g->key_row_bytes = (uint64_t)head_dim * kb / 8u;
	g->value_row_bytes = (uint64_t)head_dim * (kb / 2u) / 8u;
	g->value_codes_offset = kvr_quant_align16(g->key_row_bytes * page_tokens);
	g->key_meta_offset = kvr_quant_align16(g->value_codes_offset + g->value_row_bytes * page_tokens);
	g->value_meta_offset = kvr_quant_align16(g->key_meta_offset + 4ull * page_tokens);
	g->head_bytes = kvr_quant_align16(g->value_meta_offset + 4ull * page_tokens);
	g->page_bytes = g->head_bytes * n_kv_heads;
	return 0;
}

/* The next f16 at or above x (x ≥ 0, finite): f16 rounding, stepped up once
 * when it rounded down. */
static inline KVR_HD uint16_t kvr_f16_round_up(float x)
{
	uint16_t h = kvr_f32_to_f16(x);
	if (kvr_f16_to_f32(h) < x)
		h = (uint16_t)(h + 1u); /* positive: the next representable value */
	return h;
}

/* Scale and zero point for n elements x[i·stride] at `bits` (2, 4 or 8):
 * sz[0] = s16, sz[1] = z16 (see the header comment). */
static inline KVR_HD void kvr_quant_params(const float *x, uint32_t n, uint32_t stride, uint32_t bits,
					   uint16_t *sz)
{
	float lo = x[0], hi = x[0];
	for (uint32_t i = 1; i < n; i++) {
		const float v = x[(uint64_t)i * stride];
		lo = v < lo ? v : lo;
		hi = v > hi ? v : hi;
	}
	const uint16_t z16 = kvr_f32_to_f16(-lo);
	const float z = kvr_f16_to_f32(z16);
	const float levels = (float)((1u << bits) - 1u);
	const float top = hi + z; /* the largest shifted value */
	sz[0] = hi > lo && top > 0.0f ? kvr_f16_round_up(top / levels) : (uint16_t)0u;
	sz[1] = z16;
}

/* The code of one value against (s16, z16). */
static inline KVR_HD uint32_t kvr_quant_code(float x, float s, float z, uint32_t bits)
{
	if (!(s > 0.0f))
		return 0u;
	const float q = (x + z) / s + 0.5f; /* round half up, then clamp */
	const float max_code = (float)((1u << bits) - 1u);
	return q <= 0.0f ? 0u : q >= max_code ? (1u << bits) - 1u : (uint32_t)q;
}

/* Code i of a packed row. */
static inline KVR_HD uint32_t kvr_quant_get(const uint8_t *row, uint32_t i, uint32_t bits)
{
	const uint32_t bit = i * bits;
	return (uint32_t)(row[bit >> 3] >> (bit & 7u)) & ((1u << bits) - 1u);
}

/* Store code c as element i of a packed row (the other bits of the byte kept). */
static inline KVR_HD void kvr_quant_put(uint8_t *row, uint32_t i, uint32_t bits, uint32_t c)
{
	const uint32_t bit = i * bits, mask = ((1u << bits) - 1u) << (bit & 7u);
	row[bit >> 3] = (uint8_t)((row[bit >> 3] & ~mask) | ((c << (bit & 7u)) & mask));
}

static inline KVR_HD float kvr_dequant(uint32_t code, const uint16_t *sz)
{
	return kvr_f16_to_f32(sz[0]) * (float)code - kvr_f16_to_f32(sz[1]);
}

/* Quantise n elements x[i·stride] into a packed row and its (s, z). */
static inline KVR_HD void kvr_quant_row(const float *x, uint32_t n, uint32_t stride, uint32_t bits, uint8_t *row,
					uint16_t *sz)
{
	kvr_quant_params(x, n, stride, bits, sz);
	const float s = kvr_f16_to_f32(sz[0]), z = kvr_f16_to_f32(sz[1]);
	for (uint32_t i = 0; i < n; i++)
		kvr_quant_put(row, i, bits, kvr_quant_code(x[(uint64_t)i * stride], s, z, bits));
}

static inline KVR_HD void kvr_dequant_row(const uint8_t *row, uint32_t n, uint32_t bits, const uint16_t *sz,
					  float *out)
{
	for (uint32_t i = 0; i < n; i++)
		out[i] = kvr_dequant(kvr_quant_get(row, i, bits), sz);
}

/* Pointers into a run: token t's key or value codes and (s, z). */
static inline KVR_HD uint8_t *kvr_quant_key_row(const struct kvr_quant_geometry *g, void *run, uint32_t t)
{
	return (uint8_t *)run + (uint64_t)t * g->key_row_bytes;
}
static inline KVR_HD uint8_t *kvr_quant_value_row(const struct kvr_quant_geometry *g, void *run, uint32_t t)
{
	return (uint8_t *)run + g->value_codes_offset + (uint64_t)t * g->value_row_bytes;
}
static inline KVR_HD uint16_t *kvr_quant_key_sz(const struct kvr_quant_geometry *g, void *run, uint32_t t)
{
	return (uint16_t *)((uint8_t *)run + g->key_meta_offset) + 2u * t;
}
static inline KVR_HD uint16_t *kvr_quant_value_sz(const struct kvr_quant_geometry *g, void *run, uint32_t t)
{
	return (uint16_t *)((uint8_t *)run + g->value_meta_offset) + 2u * t;
}

/*
 * Quantise KV head m of p tokens given as NHD rows (the layout the QKV
 * projection produces and offload reads: token t's head m at
 * rows + (t·row_stride + m·d) elements of elem_type, see half.h) into its
 * run. Tokens past n_tokens (a partly filled page) get zero codes and
 * (s, z) = (0, 0), so they dequantise to 0.
 */
static inline KVR_HD void kvr_quant_run_from_nhd(const struct kvr_quant_geometry *g, const void *k_rows,
						 const void *v_rows, uint32_t row_stride, uint32_t elem_type,
						 uint32_t m, uint32_t n_tokens, void *run, float *scratch)
{
	const uint32_t d = g->head_dim;
	for (uint32_t t = 0; t < g->page_tokens; t++) {
		for (int half = 0; half < 2; half++) {
			const uint32_t bits = half ? g->value_bits : g->key_bits;
			uint8_t *row = half ? kvr_quant_value_row(g, run, t) : kvr_quant_key_row(g, run, t);
			uint16_t *sz = half ? kvr_quant_value_sz(g, run, t) : kvr_quant_key_sz(g, run, t);
			const uint64_t row_bytes = half ? g->value_row_bytes : g->key_row_bytes;
			if (t >= n_tokens) {
				for (uint64_t b = 0; b < row_bytes; b++)
					row[b] = 0;
				sz[0] = sz[1] = 0;
				continue;
			}
			const void *src = half ? v_rows : k_rows;
			for (uint32_t c = 0; c < d; c++)
				scratch[c] = kvr_load_f32(src, elem_type, (uint64_t)t * row_stride + (uint64_t)m * d + c);
			kvr_quant_row(scratch, d, 1, bits, row, sz);
		}
	}
}

/* Bytes of one KV head's run of p tokens in `format` (plain: 2·p·d elements
 * of elem_bytes), 0 for an unknown format or a shape it cannot hold. */
static inline KVR_HD uint64_t kvr_kv_run_bytes(uint32_t format, uint32_t page_tokens, uint32_t head_dim,
					       uint32_t elem_bytes)
{
	if (format == KVR_KV_PLAIN)
		return 2ull * page_tokens * head_dim * elem_bytes;
	if (format == KVR_KV_MIXED) /* unified: room for the larger run */
		format = KVR_KV_K8V4;
	struct kvr_quant_geometry g;
	return kvr_quant_geometry_init(&g, page_tokens, head_dim, 1, format) ? 0u : g.head_bytes;
}

/* Tokens an attention segment of `format` may hold: a run's rows (p, or p/2
 * for a K8V4 half); 0 for a format no segment may have (MIXED, unknown).
 * Plain segments are not bounded by a page. */
static inline KVR_HD uint32_t kvr_kv_segment_rows(uint32_t format, uint32_t page_tokens)
{
	if (format == KVR_KV_PLAIN || format == KVR_KV_ESTIMATE)
		return UINT32_MAX;
	if (format == KVR_KV_K8V4 || format == KVR_KV_K4V2)
		return page_tokens;
	return format == KVR_KV_K8V4_HALF ? page_tokens / 2u : 0u;
}

/* Piece `piece` (0..3: key codes, value codes, key (s, z), value (s, z)) of
 * copying half h (0: tokens [0, p/2), 1: [p/2, p)) of a K8V4 run of p tokens
 * into a K8V4_HALF run: byte offsets in each run and the length. Four
 * contiguous pieces a half, so recall moves a half with four copies. */
static inline KVR_HD void kvr_quant_half_piece(const struct kvr_quant_geometry *full,
					       const struct kvr_quant_geometry *half, uint32_t h, uint32_t piece,
					       uint64_t *src, uint64_t *dst, uint64_t *bytes)
{
	const uint64_t n = half->page_tokens, first = (uint64_t)h * n;
	switch (piece) {
	case 0:
		*src = first * full->key_row_bytes, *dst = 0, *bytes = n * full->key_row_bytes;
		break;
	case 1:
		*src = full->value_codes_offset + first * full->value_row_bytes;
		*dst = half->value_codes_offset, *bytes = n * full->value_row_bytes;
		break;
	case 2:
		*src = full->key_meta_offset + first * 4u, *dst = half->key_meta_offset, *bytes = n * 4u;
		break;
	default:
		*src = full->value_meta_offset + first * 4u, *dst = half->value_meta_offset, *bytes = n * 4u;
		break;
	}
}

/* The inverse direction: tokens [0, n_tokens) of KV head m's run written as
 * dequantised NHD rows (token t's head m at t·row_stride + m·d elements of
 * elem_type), as a truncation that ends inside a quantised page refills the
 * tail tile. */
static inline KVR_HD void kvr_quant_run_to_nhd(const struct kvr_quant_geometry *g, const void *run,
					       uint32_t n_tokens, void *k_rows, void *v_rows,
					       uint32_t row_stride, uint32_t elem_type, uint32_t m)
{
	unsigned char *r = (unsigned char *)(uintptr_t)run;
	const uint32_t d = g->head_dim;
	for (uint32_t t = 0; t < n_tokens; t++)
		for (uint32_t c = 0; c < d; c++) {
			const uint64_t at = (uint64_t)t * row_stride + (uint64_t)m * d + c;
			kvr_store_f32(k_rows, elem_type, at,
				      kvr_dequant(kvr_quant_get(kvr_quant_key_row(g, r, t), c, g->key_bits),
						  kvr_quant_key_sz(g, r, t)));
			kvr_store_f32(v_rows, elem_type, at,
				      kvr_dequant(kvr_quant_get(kvr_quant_value_row(g, r, t), c, g->value_bits),
						  kvr_quant_value_sz(g, r, t)));
		}
}

/*
 * Attention reads quantised rows without dequantising them to memory
 * (LeanKV: on the fly, in registers). A key's logit against q is
 *     Σ_c q_c·(s·Q_c − z) = s·Σ_c q_c·Q_c − z·Σ_c q_c,
 * so with Σ_c q_c computed once per query the dequantisation costs two
 * multiplies per key, not one per element. A value row adds w·(s·Q_c − z)
 * to an accumulator.
 */
static inline KVR_HD float kvr_quant_dot(const uint8_t *row, uint32_t n, uint32_t bits, const uint16_t *sz,
					 const float *q, float q_sum)
{
	float acc = 0.0f;
	for (uint32_t c = 0; c < n; c++)
		acc += q[c] * (float)kvr_quant_get(row, c, bits);
	return kvr_f16_to_f32(sz[0]) * acc - kvr_f16_to_f32(sz[1]) * q_sum;
}

static inline KVR_HD void kvr_quant_axpy(const uint8_t *row, uint32_t n, uint32_t bits, const uint16_t *sz,
					 float w, float *acc)
{
	const float ws = w * kvr_f16_to_f32(sz[0]), wz = w * kvr_f16_to_f32(sz[1]);
	for (uint32_t c = 0; c < n; c++)
		acc[c] += ws * (float)kvr_quant_get(row, c, bits) - wz;
}

/*
 * The query side of integer dot products on quantised keys (the accuracy
 * contract of K8V4 and K4V2 pages, kernels.h): each query row, already
 * multiplied by the attention scale, is rounded to 8 bits, symmetric,
 *     s_q = max_c |x_c| / 127,   q8_c = rint(x_c / s_q) clamped to ±127,
 * every operation in float (rint: nearest even). A key's logit is then
 *     s_q·(s·Σ_c q8_c·Q_c − z·Σ_c q8_c),
 * the exact logit of the rounded query s_q·q8 against the dequantised key,
 * its dot an exact integer (|Σ| ≤ 256·127·255 < 2^24, so exact as a float
 * too). An all-zero row gets s_q = 0 and zero codes; a row with a
 * non-finite element gets s_q = NaN and zero codes, so its logits are NaN
 * as float dots would make them. Returns s_q; *code_sum = Σ_c q8_c.
 */
static inline KVR_HD float kvr_quant_query_row(const float *x, uint32_t d, int8_t *q8, int32_t *code_sum)
{
	float amax = 0.0f;
	int finite = 1;
	for (uint32_t c = 0; c < d; c++) {
		const float a = x[c] < 0.0f ? -x[c] : x[c];
		finite &= a <= 3.40282347e38f; /* false for inf and NaN */
		amax = a > amax ? a : amax;
	}
	*code_sum = 0;
	if (!finite || amax == 0.0f) {
		for (uint32_t c = 0; c < d; c++)
			q8[c] = 0;
		return finite ? 0.0f : kvr_bits_to_f32(0x7fc00000u);
	}
	const float s = amax / 127.0f;
	int32_t sum = 0;
	for (uint32_t c = 0; c < d; c++) {
		/* nearest even by the 1.5·2^23 trick (exact for |t| < 2^22; here
		 * |t| ≤ 127 and a bit) */
		const float t = x[c] / s + 12582912.0f;
		float r = t - 12582912.0f;
		r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
		q8[c] = (int8_t)r;
		sum += (int32_t)r;
	}
	*code_sum = sum;
	return s;
}

#endif /* KVR_LAYOUTS_KVQUANT_H */
