/* SPDX-License-Identifier: MIT */
/*
 * reference.c — the conformance suite's scalar reference (reference.h says
 * what it is and why it is independent of the kernels). Plain loops in the
 * order kernels.h states the semantics, one element at a time; numeric
 * kernels in double with libm's exp and two-pass softmax (max first), which
 * is the textbook definition rather than the kernels' one-pass online form.
 */
#include "reference.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "page.h"

double ref_attention_tol(uint32_t elem_type)
{
	switch (elem_type) {
	case KVR_ELEM_F16:
		return 1e-3;
	case KVR_ELEM_BF16:
		return 5e-3;
	default:
		return 2e-5;
	}
}

/* The value weights' bits of the path under test per value width (index:
 * value bits; reference.h): set per backend by the test, before its
 * checks (one thread). */
static uint32_t value_weight_bits[9] = { 16, 16, 16, 16, 16, 16, 16, 16, 16 };

void ref_set_value_weight_bits(uint32_t value_bits, uint32_t wb)
{
	if (value_bits < 9)
		value_weight_bits[value_bits] = wb >= 1 && wb <= 16 ? wb : 16;
}

double ref_attention_bound(uint32_t elem_type, const struct ref_head_scale *s)
{
	return (ref_attention_tol(elem_type) + REF_LOGIT_ERR * s->logit_mag) * s->v_mag + s->qv_err;
}

double ref_load(const void *base, uint32_t elem_type, uint64_t i)
{
	return (double)kvr_load_f32(base, elem_type, i);
}

void ref_store(void *base, uint32_t elem_type, uint64_t i, double x)
{
	kvr_store_f32(base, elem_type, i, (float)x);
}

uint32_t ref_ordered(float x)
{
	uint32_t u;
	memcpy(&u, &x, sizeof(u));
	/* negatives: flipping every bit reverses their order and puts them below
	 * all positives; positives: setting the sign bit lifts them above. */
	return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

static size_t ebytes(uint32_t elem_type)
{
	return elem_type == KVR_ELEM_F32 ? 4 : 2;
}

/* Copy element si of src to element di of dst, bits unchanged. */
static void copy_elem(void *dst, uint64_t di, const void *src, uint64_t si, size_t eb)
{
	memcpy((unsigned char *)dst + di * eb, (const unsigned char *)src + si * eb, eb);
}

/* ------------------------------------------------------------------ copies */

void ref_scatter(const struct kvr_shape *sh, const struct kvr_scatter_item *items, uint32_t n)
{
	const uint64_t p = sh->page_tokens, d = sh->head_dim, n_kv = sh->n_kv_heads;
	const size_t eb = ebytes(sh->elem_type);
	for (uint32_t i = 0; i < n; i++) {
		const struct kvr_scatter_item *it = &items[i];
		/* run: [2][p][d] (keys, then values); tile row t: n_kv heads of d */
		for (uint64_t half = 0; half < 2; half++)
			for (uint64_t t = 0; t < p; t++)
				for (uint64_t c = 0; c < d; c++)
					copy_elem(half ? it->v_tile : it->k_tile,
						  (t * n_kv + it->kv_head) * d + c, it->run,
						  (half * p + t) * d + c, eb);
	}
}

void ref_offload(const struct kvr_shape *sh, const struct kvr_page_item *items, uint32_t n)
{
	const uint64_t p = sh->page_tokens, d = sh->head_dim, n_kv = sh->n_kv_heads;
	const size_t eb = ebytes(sh->elem_type);
	for (uint32_t i = 0; i < n; i++) {
		const struct kvr_page_item *it = &items[i];
		/* page: [n_kv][2][p][d]; row t of the source at t·row_stride */
		for (uint64_t m = 0; m < n_kv; m++)
			for (uint64_t half = 0; half < 2; half++)
				for (uint64_t t = 0; t < p; t++)
					for (uint64_t c = 0; c < d; c++)
						copy_elem(it->hnd_page, ((m * 2 + half) * p + t) * d + c,
							  half ? it->v_rows : it->k_rows,
							  t * it->row_stride + m * d + c, eb);
	}
}

void ref_summarize(const struct kvr_shape *sh, const struct kvr_page_item *items, uint32_t n)
{
	const uint64_t p = sh->page_tokens, d = sh->head_dim, n_kv = sh->n_kv_heads;
	const uint32_t type = sh->elem_type;
	for (uint32_t i = 0; i < n; i++) {
		const struct kvr_page_item *it = &items[i];
		for (uint64_t m = 0; m < n_kv; m++)
			for (uint64_t c = 0; c < d; c++) {
				/* A fold over the tokens in order: strict comparisons, so
				 * of equal values (+0 and -0) the earlier token's is kept;
				 * a NaN replaces both bounds and nothing replaces a NaN
				 * but a later NaN (summary.h's rule). */
				float mn = kvr_load_f32(it->k_rows, type, m * d + c), mx = mn;
				for (uint64_t t = 1; t < p; t++) {
					const float x = kvr_load_f32(it->k_rows, type,
								     t * it->row_stride + m * d + c);
					if (isnan(x)) {
						mn = mx = x;
					} else if (!isnan(mn)) {
						mn = x < mn ? x : mn;
						mx = x > mx ? x : mx;
					}
				}
				kvr_store_f32(it->summary, type, (m * 2 + 0) * d + c, mn);
				kvr_store_f32(it->summary, type, (m * 2 + 1) * d + c, mx);
				if (!(sh->flags & KVR_SHAPE_ESTIMATES))
					continue;
				/* the estimate rows after the bounds block: fp32 sums in
				 * token order from token 0, over p (kernels.h) */
				float sk = kvr_load_f32(it->k_rows, type, m * d + c);
				float sv = kvr_load_f32(it->v_rows, type, m * d + c);
				for (uint64_t t = 1; t < p; t++) {
					sk += kvr_load_f32(it->k_rows, type, t * it->row_stride + m * d + c);
					sv += kvr_load_f32(it->v_rows, type, t * it->row_stride + m * d + c);
				}
				kvr_store_f32(it->summary, type, (n_kv * 2 + m * 2 + 0) * d + c, sk / (float)p);
				kvr_store_f32(it->summary, type, (n_kv * 2 + m * 2 + 1) * d + c, sv / (float)p);
			}
	}
}

/* ------------------------------------------------------------------ selection */

struct ranked {
	uint32_t key; /* ref_ordered(score) */
	uint32_t j;   /* candidate index */
};

/* Highest key first; equal keys: lower page first. */
static int by_rank(const void *a, const void *b)
{
	const struct ranked *x = a, *y = b;
	if (x->key != y->key)
		return x->key > y->key ? -1 : 1;
	return x->j < y->j ? -1 : (x->j > y->j);
}

static int by_page(const void *a, const void *b)
{
	const struct ranked *x = a, *y = b;
	return x->j < y->j ? -1 : (x->j > y->j);
}

/* An item whose gate is all zeros does nothing (kernels.h, score/select). */
static int gated_off(const struct kvr_shape *sh, const struct kvr_score_item *it)
{
	if (!it->gate)
		return 0;
	uint32_t on = 0;
	for (uint32_t m = 0; m < sh->n_kv_heads; m++)
		on += it->gate[m] != 0;
	return on == 0;
}

/* Streamed: recall.c's slot plan, written out with arrays: which slot each
 * page entry ends in (-1: none), the scatter items and counts. */
static void ref_plan_slots(const struct kvr_plan_item *it, const int32_t *pages, int32_t *slot_of)
{
	const uint32_t k = it->k;
	int32_t *slots = it->slot_page;
	uint8_t *kept = calloc(k + 1, 1), *done = calloc(k + 1, 1);
	if (!kept || !done)
		abort();
	uint32_t hits = 0, misses = 0;
	for (uint32_t w = 0; w < k; w++)
		slot_of[w] = -1;
	for (uint32_t j = 0; j < k; j++) /* hits: slot order, the first matching entry */
		for (uint32_t w = 0; slots[j] >= 0 && w < k; w++)
			if (!done[w] && pages[w] == slots[j]) {
				kept[j] = done[w] = 1;
				slot_of[w] = (int32_t)j;
				hits++;
				break;
			}
	for (uint32_t w = 0; w < k; w++) { /* misses: entry order, lowest free slot */
		if (pages[w] < 0 || (uint32_t)pages[w] >= it->addr_end || done[w])
			continue;
		uint32_t j = 0;
		while (kept[j])
			j++;
		kept[j] = 1;
		slots[j] = pages[w];
		slot_of[w] = (int32_t)j;
		struct kvr_scatter_item *sc = &it->scatter[misses++];
		memset(sc, 0, sizeof(*sc));
		sc->run = (const void *)(uintptr_t)(it->page_addr[pages[w]] + it->k_offset);
		sc->k_tile = it->slot_k + (uint64_t)j * it->tile_bytes;
		sc->v_tile = it->slot_v + (uint64_t)j * it->tile_bytes;
		sc->kv_head = it->kv_head;
	}
	for (uint32_t j = 0; j < k; j++)
		if (!kept[j])
			slots[j] = -1;
	for (uint32_t x = misses; x < k; x++) {
		memset(&it->scatter[x], 0, sizeof(it->scatter[x]));
		it->scatter[x].kv_head = UINT32_MAX;
	}
	it->recall_count[0] = misses;
	it->recall_count[1] = hits;
	free(kept), free(done);
}

void ref_plan(const struct kvr_plan_item *items, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++) {
		const struct kvr_plan_item *it = &items[i];
		const int use_now = it->corrected_sel != NULL && (it->corrected == NULL || it->corrected[0] != 0);
		const int32_t *pages = use_now ? it->corrected_sel : it->selected;
		int32_t *slot_of = calloc(it->k + 1, sizeof(*slot_of));
		if (!slot_of)
			abort();
		if (it->slot_page)
			ref_plan_slots(it, pages, slot_of);
		/* the tail first, aside: the list is rewritten in place */
		struct kvr_kv_segment *tail = malloc((it->n_tail + 1) * sizeof(*tail));
		if (!tail)
			abort();
		memcpy(tail, it->segments + it->n_head + it->k, it->n_tail * sizeof(*tail));
		uint32_t at = it->n_head;
		for (uint32_t j = 0; j < it->k; j++) {
			const int64_t page = pages[j];
			if (page < (int64_t)it->sel_begin || page >= (int64_t)it->sel_end || page >= (int64_t)it->addr_end)
				continue;
			struct kvr_kv_segment s;
			memset(&s, 0, sizeof(s));
			if (it->slot_page) {
				const uint64_t off = (uint64_t)slot_of[j] * it->tile_bytes + it->slot_col;
				s.k = it->slot_k + off;
				s.v = it->slot_v + off;
			} else {
				const uint64_t base = it->page_addr[page];
				s.k = (const void *)(uintptr_t)(base + it->k_offset);
				s.v = it->v_offset == UINT64_MAX ? NULL : (const void *)(uintptr_t)(base + it->v_offset);
			}
			s.n_tokens = it->seg_tokens;
			s.row_stride = it->seg_row;
			s.head_stride = it->seg_head_stride;
			s.format = it->seg_format;
			it->segments[at++] = s;
		}
		memcpy(it->segments + at, tail, it->n_tail * sizeof(*tail));
		it->attention->n_segments = at + it->n_tail;
		free(tail);
		free(slot_of);
	}
}

void ref_select(const struct kvr_shape *sh, const struct kvr_score_item *items, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++) {
		const struct kvr_score_item *it = &items[i];
		if (!it->k || gated_off(sh, it))
			continue; /* k = 0 (or a closed gate) writes nothing */
		const uint32_t n_cand =
			it->cand_end > it->cand_begin ? it->cand_end - it->cand_begin : 0;
		const uint32_t take = it->k < n_cand ? it->k : n_cand;
		struct ranked *r = malloc((n_cand ? n_cand : 1) * sizeof(*r));
		if (!r)
			abort(); /* a test program: nothing sensible to fall back to */
		for (uint32_t m = 0; m < sh->n_kv_heads; m++) {
			for (uint32_t j = 0; j < n_cand; j++) {
				r[j].key = ref_ordered(it->scores[(uint64_t)m * n_cand + j]);
				r[j].j = j;
			}
			qsort(r, n_cand, sizeof(*r), by_rank);
			qsort(r, take, sizeof(*r), by_page);
			int32_t *out = it->selected + (uint64_t)m * it->k;
			for (uint32_t w = 0; w < it->k; w++)
				out[w] = w < take ? (int32_t)(it->cand_begin + r[w].j) : -1;
		}
		free(r);
	}
}

/* ------------------------------------------------------------------ score */

void ref_score(const struct kvr_shape *sh, const struct kvr_score_item *it, double *scores)
{
	const uint32_t n_kv = sh->n_kv_heads, G = sh->n_qo_heads / n_kv, d = sh->head_dim;
	const uint32_t type = sh->elem_type;
	const uint32_t n_cand = it->cand_end > it->cand_begin ? it->cand_end - it->cand_begin : 0;
	/* page j's key bounds, at the page stride of summaries with or without estimate rows */
	const uint64_t page_elems = (uint64_t)n_kv * d * (sh->flags & KVR_SHAPE_ESTIMATES ? 4 : 2);
	if (!n_cand)
		return;
	/* the softmax domain (kernels.h): every page [0, norm_end) when set */
	const uint32_t first = it->norm_end ? 0 : it->cand_begin;
	const uint32_t last = it->norm_end > it->cand_end ? it->norm_end : it->cand_end;
	const uint32_t n_dom = last - first, off = it->cand_begin - first;
	double *s = malloc(n_dom * sizeof(*s));
	if (!s)
		abort();
	for (uint32_t m = 0; m < n_kv; m++) {
		double *out = scores + (uint64_t)m * n_cand;
		for (uint32_t j = 0; j < n_cand; j++)
			out[j] = 0.0;
		for (uint32_t g = 0; g < G; g++) {
			const uint64_t h = (uint64_t)m * G + g;
			double smax = -INFINITY;
			for (uint32_t j = 0; j < n_dom; j++) {
				/* summary of page (first + j), KV head m: min row, max row */
				const uint64_t base = (uint64_t)(first + j) * page_elems + (uint64_t)m * 2 * d;
				double acc = 0.0;
				for (uint32_t c = 0; c < d; c++) {
					const double q = ref_load(it->q, type, h * d + c);
					const double lo = q * ref_load(it->summaries, type, base + c);
					const double hi =
						q * ref_load(it->summaries, type, base + d + c);
					acc += lo > hi ? lo : hi;
				}
				s[j] = (double)sh->scale * acc;
				smax = s[j] > smax ? s[j] : smax;
			}
			double sum = 0.0;
			for (uint32_t j = 0; j < n_dom; j++)
				sum += exp(s[j] - smax);
			for (uint32_t j = 0; j < n_cand; j++)
				out[j] += exp(s[off + j] - smax) / sum;
		}
		for (uint32_t j = 0; j < n_cand; j++)
			out[j] /= G;
	}
	free(s);
}

/* ------------------------------------------------------------------ similarity */

void ref_similarity(const struct kvr_shape *sh, const struct kvr_similarity_item *it,
		    double *cosine)
{
	const uint32_t n_kv = sh->n_kv_heads, G = sh->n_qo_heads / n_kv, d = sh->head_dim;
	for (uint32_t m = 0; m < n_kv; m++) {
		double mean = 0.0;
		for (uint32_t g = 0; g < G; g++) {
			const uint64_t base = ((uint64_t)m * G + g) * d;
			double dot = 0.0, na = 0.0, nb = 0.0;
			for (uint32_t c = 0; c < d; c++) {
				const double a = ref_load(it->q, sh->elem_type, base + c);
				const double b = ref_load(it->q_prev, sh->elem_type, base + c);
				dot += a * b;
				na += a * a;
				nb += b * b;
			}
			mean += (na == 0.0 || nb == 0.0) ? 0.0 : dot / sqrt(na * nb);
		}
		cosine[m] = mean / G;
	}
}

/* ------------------------------------------------------------------ attention */

/* KV head m's run of a quantised segment and its geometry (*g); NULL for a
 * format kvquant.h does not know. */
static unsigned char *quant_run(const struct kvr_shape *sh, const struct kvr_kv_segment *seg, uint64_t m,
				struct kvr_quant_geometry *g)
{
	if (kvr_quant_geometry_init(g, sh->page_tokens, sh->head_dim, 1, seg->format))
		return NULL;
	return (unsigned char *)(uintptr_t)seg->k + m * seg->head_stride;
}

/* Element c of token t of KV head m in a segment, keys (half 0) or values:
 * plain rows, or a quantised run dequantised (kernels.h). */
static double seg_elem(const struct kvr_shape *sh, const struct kvr_kv_segment *seg, uint64_t m,
		       int half, uint64_t t, uint32_t c)
{
	if (seg->format == KVR_KV_PLAIN || seg->format == KVR_KV_ESTIMATE)
		return ref_load(half ? seg->v : seg->k, sh->elem_type,
				m * seg->head_stride + t * seg->row_stride + c);
	struct kvr_quant_geometry g;
	unsigned char *run = quant_run(sh, seg, m, &g);
	if (!run)
		return NAN; /* an unknown format: the kernels must not silently agree */
	t += seg->first_row;
	const uint8_t *row = half ? kvr_quant_value_row(&g, run, (uint32_t)t) : kvr_quant_key_row(&g, run, (uint32_t)t);
	const uint16_t *sz = half ? kvr_quant_value_sz(&g, run, (uint32_t)t) : kvr_quant_key_sz(&g, run, (uint32_t)t);
	const uint32_t bits = half ? g.value_bits : g.key_bits;
	return (double)kvr_f16_to_f32(sz[0]) * kvr_quant_get(row, c, bits) - (double)kvr_f16_to_f32(sz[1]);
}

/* Quantised keys' contract (kvquant.h): the logits of a quantised segment
 * are those of the query row rounded to 8 bits. Written here from the
 * definition, not from kvr_quant_query_row: x_c = q_c·scale in float,
 * s_q = max|x_c| / 127 in float, r_c = x_c / s_q rounded to the nearest
 * even integer (libm's nearbyintf) and clamped to ±127. rounded[c] = s_q·r_c
 * / scale in double (so scale·Σ rounded·k = s_q·Σ r·k exactly), code_mag =
 * s_q·Σ|r_c| and code_sum = s_q·Σ r_c for the magnitude of the kernels'
 * terms; NaN everywhere for a row with a non-finite element. */
struct rounded_query {
	double q[256];
	double s_q, sum; /* s_q, Σ r_c */
};

static void round_query(const struct kvr_shape *sh, const void *q, uint64_t h, struct rounded_query *rq)
{
	const uint32_t d = sh->head_dim;
	float x[256], amax = 0.0f;
	int finite = 1;
	for (uint32_t c = 0; c < d; c++) {
		x[c] = (float)ref_load(q, sh->elem_type, h * d + c) * sh->scale;
		finite &= isfinite(x[c]);
		if (fabsf(x[c]) > amax)
			amax = fabsf(x[c]);
	}
	rq->sum = 0.0;
	rq->s_q = finite ? (double)(amax / 127.0f) : NAN;
	for (uint32_t c = 0; c < d; c++) {
		if (!finite || amax == 0.0f) {
			rq->q[c] = finite ? 0.0 : NAN;
			continue;
		}
		float r = nearbyintf(x[c] / (amax / 127.0f));
		r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
		rq->q[c] = rq->s_q * r / (double)sh->scale;
		rq->sum += r;
	}
}

/* The logit of query head h against token t of a segment, and its
 * magnitude (what the kernels' float rounding scales with): the query as
 * given for plain rows, rounded (rq) for quantised ones, whose kernels also
 * form s_q·(s·Σ r·Q − z·Σ r): those two terms' sizes count as well. */
static double seg_logit(const struct kvr_shape *sh, const struct kvr_kv_segment *seg, const void *q, uint64_t h,
			const struct rounded_query *rq, uint64_t t, double *mag)
{
	const uint32_t d = sh->head_dim, G = sh->n_qo_heads / sh->n_kv_heads;
	const int quantised = seg->format != KVR_KV_PLAIN && seg->format != KVR_KV_ESTIMATE;
	double dot = 0.0, m = 0.0, codes = 0.0;
	for (uint32_t c = 0; c < d; c++) {
		const double k = seg_elem(sh, seg, h / G, 0, t, c);
		const double qc = quantised ? rq->q[c] : ref_load(q, sh->elem_type, h * d + c);
		dot += qc * k;
		m += fabs(qc * k);
		codes += fabs(qc) * 255.0;
	}
	double term = 0.0;
	if (quantised) { /* |s·Σ r·Q| ≤ s·255·Σ|r|; |z·Σ r| */
		struct kvr_quant_geometry g;
		kvr_quant_geometry_init(&g, sh->page_tokens, d, 1, seg->format);
		const unsigned char *run = (const unsigned char *)seg->k + (uint64_t)(h / G) * seg->head_stride;
		const uint16_t *sz = kvr_quant_key_sz(&g, (void *)(uintptr_t)run, (uint32_t)(t + seg->first_row));
		term = fabs((double)kvr_f16_to_f32(sz[0])) * codes +
		       fabs((double)kvr_f16_to_f32(sz[1]) * rq->s_q * rq->sum) / fabs((double)sh->scale);
	}
	*mag = fabs((double)sh->scale) * (m > term ? m : term);
	return (double)sh->scale * dot;
}

/* A segment's value code width, 0 for plain rows and estimates. */
static uint32_t quant_value_bits(const struct kvr_shape *sh, const struct kvr_kv_segment *seg)
{
	if (seg->format == KVR_KV_PLAIN || seg->format == KVR_KV_ESTIMATE)
		return 0;
	struct kvr_quant_geometry g;
	return kvr_quant_geometry_init(&g, sh->page_tokens, sh->head_dim, 1, seg->format) ? 0 : g.value_bits;
}

/* Token t's value scale s in a quantised segment (KV head m). */
static double value_scale(const struct kvr_shape *sh, const struct kvr_kv_segment *seg, uint64_t m, uint64_t t)
{
	struct kvr_quant_geometry g;
	unsigned char *run = quant_run(sh, seg, m, &g);
	return run ? (double)kvr_f16_to_f32(kvr_quant_value_sz(&g, run, (uint32_t)(t + seg->first_row))[0]) : NAN;
}

/* Attention of every query head over a list of segments: the definition,
 * softmax(scale · q·K^T)·V, with a max-subtracted two-pass softmax; over a
 * quantised segment, q is the rounded query (round_query). */
static void attend(const struct kvr_shape *sh, const void *q, const struct kvr_kv_segment *segs,
		   uint32_t n_segs, double *out, struct ref_head_scale *scale)
{
	const uint32_t n_qo = sh->n_qo_heads, G = n_qo / sh->n_kv_heads, d = sh->head_dim;
	uint64_t n_tok = 0;
	for (uint32_t s = 0; s < n_segs; s++)
		n_tok += segs[s].n_tokens;
	double *logit = malloc((n_tok ? n_tok : 1) * sizeof(*logit));
	if (!logit)
		abort();
	for (uint32_t h = 0; h < n_qo; h++) {
		const uint64_t m = h / G;
		double *o = out + (uint64_t)h * d;
		struct ref_head_scale *hs = &scale[h];
		for (uint32_t c = 0; c < d; c++)
			o[c] = 0.0;
		hs->v_mag = hs->logit_mag = hs->qv_err = 0.0;
		/* KVR_SHAPE_CAUSAL: head h % G is query token (h % G) / hq, which
		 * sees the tokens up to its position, counted over the segments */
		uint64_t visible = n_tok;
		if (sh->flags & KVR_SHAPE_CAUSAL) {
			const uint64_t pos = sh->causal_first_position + (h % G) / sh->causal_heads_per_query;
			visible = pos + 1 < n_tok ? pos + 1 : n_tok;
		}
		if (!visible)
			continue; /* no tokens: zeros */
		double lmax = -INFINITY;
		uint64_t i = 0;
		struct rounded_query rq;
		round_query(sh, q, h, &rq);
		for (uint32_t s = 0; s < n_segs; s++)
			for (uint64_t t = 0; t < segs[s].n_tokens && i < visible; t++, i++) {
				double mag;
				/* an estimate row is a page's p tokens */
				logit[i] = seg_logit(sh, &segs[s], q, h, &rq, t, &mag) +
					   (segs[s].format == KVR_KV_ESTIMATE ? log((double)sh->page_tokens) : 0.0);
				lmax = logit[i] > lmax ? logit[i] : lmax;
				if (isfinite(mag) && mag > hs->logit_mag)
					hs->logit_mag = mag;
			}
		double sum = 0.0, qv = 0.0; /* qv: Σ_blocks (max w / (2·(2^wb − 1)))·(n − 1)·2^(vb − 1) */
		i = 0;
		for (uint32_t s = 0; s < n_segs; s++) {
			const uint32_t vb = quant_value_bits(sh, &segs[s]);
			const double step = vb ? 2.0 * (double)((1u << value_weight_bits[vb]) - 1u) : 1.0;
			double block_max = 0.0;
			uint32_t block_n = 0;
			for (uint64_t t = 0; t < segs[s].n_tokens && i < visible; t++, i++) {
				const double w = exp(logit[i] - lmax);
				sum += w;
				for (uint32_t c = 0; c < d; c++) {
					const double v = seg_elem(sh, &segs[s], m, 1, t, c);
					o[c] += w * v;
					if (isfinite(v) && fabs(v) > hs->v_mag)
						hs->v_mag = fabs(v);
				}
				if (vb) { /* the token's weight as the kernels round it: p·s */
					const double ws = w * value_scale(sh, &segs[s], m, t);
					block_max = isfinite(ws) && ws > block_max ? ws : block_max;
					block_n++;
					if (t % 16 == 15) {
						qv += block_max / step * (block_n - 1u) * (double)(1u << (vb - 1u));
						block_max = 0.0, block_n = 0;
					}
				}
			}
			if (block_n)
				qv += block_max / step * (block_n - 1u) * (double)(1u << (vb - 1u));
		}
		for (uint32_t c = 0; c < d; c++)
			o[c] /= sum;
		hs->qv_err = sum > 0.0 && isfinite(qv / sum) ? qv / sum : 0.0;
	}
	free(logit);
}

void ref_attention(const struct kvr_shape *sh, const struct kvr_attention_item *item,
		   const struct kvr_kv_segment *segments, double *out, struct ref_head_scale *scale)
{
	attend(sh, item->q, segments + item->first_segment, item->n_segments, out, scale);
}

void ref_attention_at(const struct kvr_shape *sh, const struct kvr_attention_item *items, uint32_t i,
		      const struct kvr_kv_segment *segments, double *out, struct ref_head_scale *scale)
{
	struct kvr_shape one = *sh;
	if (sh->flags & KVR_SHAPE_CAUSAL)
		one.causal_first_position = kvr_causal_item_position(sh, i);
	ref_attention(&one, &items[i], segments, out, scale);
}

void ref_attention_lse(const struct kvr_shape *sh, const struct kvr_attention_item *item,
		       const struct kvr_kv_segment *segments, double *lse)
{
	const uint32_t n_qo = sh->n_qo_heads, G = n_qo / sh->n_kv_heads;
	const struct kvr_kv_segment *segs = segments + item->first_segment;
	for (uint32_t h = 0; h < n_qo; h++) {
		/* KVR_SHAPE_CAUSAL: the head's tokens end after its position */
		uint64_t visible = UINT64_MAX, before = 0;
		if (sh->flags & KVR_SHAPE_CAUSAL)
			visible = sh->causal_first_position + (h % G) / sh->causal_heads_per_query + 1;
		for (uint32_t s = 0; s < item->n_segments; before += segs[s].n_tokens, s++) {
			double mx = -INFINITY, sum = 0.0;
			const uint64_t seen = visible <= before ? 0 : visible - before;
			const uint64_t n_t = segs[s].n_tokens < seen ? segs[s].n_tokens : seen;
			double *logit = malloc((n_t ? n_t : 1) * sizeof(*logit));
			if (!logit)
				abort();
			struct rounded_query rq;
			round_query(sh, item->q, h, &rq);
			for (uint64_t t = 0; t < n_t; t++) {
				double mag;
				logit[t] = seg_logit(sh, &segs[s], item->q, h, &rq, t, &mag);
				mx = logit[t] > mx ? logit[t] : mx;
			}
			for (uint64_t t = 0; t < n_t; t++)
				sum += exp(logit[t] - mx);
			lse[(uint64_t)h * item->n_segments + s] = n_t ? mx + log(sum) : -INFINITY;
			free(logit);
		}
	}
}

void ref_dense(const struct kvr_shape *sh, const struct kvr_dense_item *item, double *out,
	       struct ref_head_scale *scale)
{
	/* dense is attention over one segment of NHD rows: head m at m·d */
	const struct kvr_kv_segment seg = { item->k, item->v, item->n_tokens, { item->row_stride },
					    sh->head_dim, 0 };
	attend(sh, item->q, &seg, 1, out, scale);
}
