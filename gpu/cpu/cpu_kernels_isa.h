/* SPDX-License-Identifier: MIT */
/*
 * cpu_kernels_isa.h — the cpu backend's hot kernels (score, attention), written
 * once over 16-float vectors (GCC vector extensions) and compiled three times
 * by cpu_kernels.c: for AVX-512, for AVX2+FMA+F16C, and for baseline x86-64.
 * The including file defines ISA (a name suffix) and the primitives:
 *   LOAD16(row, type, i)  16 elements from element i of a row, as floats
 *   FMA16(a, b, c)        a*b + c with a single rounding per lane
 *   HSUM16(v)             the sum of the 16 lanes (any order: attention only)
 *   HSUM4(a, b, c, d, out) the four lane sums into out[0..3] (attention only)
 *   HMAX16(v)             the largest lane (attention only; NaN lanes ignored)
 *   FOLD16(v)             the sum of the 16 lanes in kmath.h's canonical order
 *                         (halves added lane-wise: 8, then 4, 2, 1)
 *   SPLAT16(x)            x in every lane (a broadcast: building the vector
 *                         from scalars goes through memory and stalls)
 *   MAX16(a, b)           a > b ? a : b per lane (x86 max: b when either is
 *                         NaN or both are zeros): kvr_quest_term's choice
 *   FOLD16X16(v)          of 16 vectors v[0..15], the vector whose lane p is
 *                         FOLD16(v[p]), each in the canonical order
 *   F16TOF32(h)           one f16 (bits) as a float (F16C where the ISA has it)
 *   CODES16(row, bits, c) codes 16c..16c+15 of a packed quantised row as floats
 * and for attention's per-dimension vectors (its softmax works on 16 tokens
 * at a time with the above), a native width that may be narrower:
 *   VA_T, VA_LANES, VA_MAX_CHUNKS  the vector type, its lanes (16, or 8 on
 *                         AVX2, where GCC turns 16-float vectors into poor
 *                         code) and 256 / VA_LANES
 *   VA_V_STRIP            vectors per head in the four-head V pass (its
 *                         4·VA_V_STRIP accumulators stay in registers)
 *   LOADA, FMAA, SPLATA, HSUMA, HSUM4A, MAXA, HMAXA, EXPA  the operations
 *                         above on VA_T (EXPA: kvr_expf's formula)
 *   ANYGTA(a, b)          whether any lane of a exceeds b's (optional)
 *   ATT_EXPA(x)           attention's exp, accurate but not bound to
 *                         kvr_expf's bits (optional; EXPA by default)
 *   VALUE_SZ16(sz, nb, centre, vs, vz)  a block's value scales and zero
 *                         points as floats (optional; a scalar loop)
 *   CODES16A(row, bits, c16, out)  codes 16c16..16c16+15 as 16 / VA_LANES
 *                         vectors into out
 *   QMASK_T, QMASK_MAKE(q), QMASK_GET(masks, i, q), QSELECT(k, a, b)  the
 *                         score's blend by a query vector's sign bits: the
 *                         mask type, a mask made once per query vector, the
 *                         mask of vector i (stored, or made from q itself
 *                         where the blend reads sign bits), and per lane
 *                         "sign bit set ? a : b"
 *                         (the VA_ and QMASK operations left undefined
 *                         are the 16-float ones, so an ISA that defines
 *                         them needs no LOAD16, FMA16, HSUM16, HSUM4,
 *                         HMAX16 or CODES16)
 *   SCORE_PAGE_BLOCK, SCORE_HEAD_BLOCK  the score's register block, required:
 *                         pages and query heads whose accumulators stay in
 *                         registers together (each query vector and mask
 *                         is then loaded once per page block, each bound
 *                         row once per head block)
 * and, before the first inclusion, vf/vi (16 x float/int32) and blend.
 *
 * Scores follow kmath.h's canonical orders exactly (a vector's lane l is the
 * canonical lane l), so every ISA — and the CUDA kernels — produce the same
 * bits and select the same pages. Attention is accurate, not bit-exact.
 *
 * Attention over quantised pages takes the integer key dots (qk_dots_fn, on
 * the query rounded to 8 bits) from the including file (cpu_kernels.c), per
 * ISA; NULL reads the key codes as floats (KVR_QUANT_DOTS=float). Value
 * codes likewise take the including file's value dots (pv_dots_fn: integer
 * sums, or AVX2's float ones for 4-bit codes) where it has them and
 * PV_FITS, summed in its own channel order (PV_CHANNEL); float multiply-adds
 * otherwise.
 */

/* attention's vectors: the 16-float ones unless the including file chose */
#ifndef VA_T
#define KVR_VA_DEFAULT 1
#define VA_T vf
#define VA_LANES 16
#define VA_MAX_CHUNKS 16
#define VA_V_STRIP 4
#define LOADA LOAD16
#define FMAA FMA16
#define SPLATA SPLAT16
#define HSUMA HSUM16
#define HSUM4A HSUM4
#define CODES16A(row, bits, c16, out) ((out)[0] = CODES16(row, bits, c16))
#define MAXA MAX16
#define HMAXA HMAX16
#define EXPA(x) ISA_FN(exp16)(x)
#endif

/* the channel of vacc's element i (pv_flush): the including file's order
 * for its value sums (pv), or pv_dots_avx512vnni's */
#ifndef PV_CHANNEL
#define PV_CHANNEL(i, bits) pv_channel(i, bits)
#endif
/* the value widths and head dimensions the including file's pv takes */
#ifndef PV_FITS
#define PV_FITS(bits, d) pv_fits(bits, d)
#endif
/* the code the value sums (pv) take as zero: attention_impl moves each
 * token's zero point to match (z − c·s); integer sums are centred (pv_dots) */
#ifndef PV_CENTRE
#define PV_CENTRE(bits) ((float)(1u << ((bits) - 1u)))
#endif

#define KVR_ISA_FN2(name, isa) name##_##isa
#define KVR_ISA_FN1(name, isa) KVR_ISA_FN2(name, isa)
#define ISA_FN(name) KVR_ISA_FN1(name, ISA)

#ifdef KVR_VA_DEFAULT /* EXPA; an ISA with its own vectors brings its own */
/* kvr_expf on 16 lanes, bit-identical to the scalar function: the same
 * operations in the same order (rint by the 1.5·2^23 trick, which is exact
 * round-to-nearest-even for |t| < 2^22; out-of-range lanes are clamped for the
 * arithmetic and replaced at the end, as the scalar early returns do). */
static inline __attribute__((always_inline)) vf ISA_FN(exp16)(vf x)
{
	const vi is_nan = x != x;
	const vi big = x > 88.7228317f;
	const vi small = x < -103.972084f;
	const vf xc = blend(big | small | is_nan, SPLAT16(0.0f), x);
	const vf t = xc * KVR_EXP_LOG2E;
	const vf n = (t + 12582912.0f) - 12582912.0f;
	vf r, p;
#define EXP16_FNMA(a, b, c) FMA16(-(a), (b), (c))
	KVR_EXP_POLY(FMA16, EXP16_FNMA, SPLAT16, n, xc, r, p);
#undef EXP16_FNMA
	const vi e = __builtin_convertvector(n, vi);
	const vi lo = e < -126, hi = e > 127;
	const vi e1 = (lo & -126) | (hi & 127) | (~(lo | hi) & e);
	p = p * (vf)((e1 + 127) << 23);
	p = p * (vf)((e - e1 + 127) << 23); /* 2^0 = 1.0 exactly when e fits */
	p = blend(small, SPLAT16(0.0f), p);
	p = blend(big, SPLAT16(INFINITY), p);
	return blend(is_nan, x, p);
}
#endif

/* attention's exp: accurate for arguments up to 88 (attention's are at most
 * ATT_LAZY_MAX), need not be kvr_expf's bits (the score's EXPA must) */
#ifndef ATT_EXPA
#define ATT_EXPA(x) EXPA(x)
#endif

#ifndef KVR_ATT_CONSTANTS /* once for the three inclusions */
#define KVR_ATT_CONSTANTS
/* how far a block's scores may exceed decode attention's running max before
 * it moves (attention_impl; attention_causal's CA_LAZY_MAX likewise) */
#define ATT_LAZY_MAX 8.0f
#endif

#ifndef ANYGTA /* whether any lane of a exceeds b's (NaN: no), without an ISA's mask */
static inline __attribute__((always_inline)) int ISA_FN(any_gt)(VA_T a, VA_T b)
{
	typedef int32_t va_int __attribute__((vector_size(sizeof(VA_T))));
	const va_int m = a > b;
	int32_t lanes[VA_LANES];
	memcpy(lanes, &m, sizeof(lanes));
	int32_t any = 0;
	for (uint32_t l = 0; l < VA_LANES; l++)
		any |= lanes[l];
	return any != 0;
}
#define ANYGTA(a, b) ISA_FN(any_gt)(a, b)
#endif

/* Head g's query row (d floats, already scaled) into qq, rounded to 8 bits
 * (kvr_quant_query_row) in the orders the key dots read. Compiled per ISA:
 * in portable code its loops took about 5% of quantised attention. */
static void ISA_FN(qk8_prepare)(struct kvr_qk8 *qq, uint32_t g, const float *x, uint32_t d)
{
	int32_t sum;
	memset(qq->q8[g], 0, sizeof(qq->q8[g]));
	memset(qq->q8n[g], 0, sizeof(qq->q8n[g]));
	memset(qq->q16[g], 0, sizeof(qq->q16[g]));
	qq->scale[g] = kvr_quant_query_row(x, d, qq->q8[g], &sum);
	qq->code_sum_f[g] = (float)sum;
	for (uint32_t j = 0; j < d / 2; j++) {
		qq->q8n[g][j] = qq->q8[g][2 * j];
		qq->q8n[g][d / 2 + j] = qq->q8[g][2 * j + 1];
	}
	for (uint32_t c = 0; c < d; c++)
		qq->q16[g][c] = qq->q8[g][c];
}

#ifndef VALUE_SZ16
/* A block's value (s, z) pairs (nb of them, f16) as vs[b] = s and vz[b] =
 * z − centre·s, zeros from nb to 16; an ISA may bring a vector form that
 * computes the same. */
static inline __attribute__((always_inline)) void ISA_FN(value_sz16)(const uint16_t *sz, uint32_t nb, float centre,
								     float *vs, float *vz)
{
	for (uint32_t b = 0; b < 16; b++) {
		vs[b] = b < nb ? F16TOF32(sz[2 * b]) : 0.0f;
		vz[b] = b < nb ? F16TOF32(sz[2 * b + 1]) - centre * vs[b] : 0.0f;
	}
}
#define VALUE_SZ16(sz, nb, centre, vs, vz) ISA_FN(value_sz16)(sz, nb, centre, vs, vz)
#endif

static inline __attribute__((always_inline)) vi ISA_FN(lane_index)(void)
{
	return (vi){ 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15 };
}

/* ------------------------------------------------------------------ score */

/* The raw canonical accumulators of `n` query heads (q: their rows, each
 * d / VA_LANES vectors; qm: the rows' sign masks, QMASK_GET's first
 * argument) against the min and max rows of `np` pages (`sum`, the next
 * page's rows page_bytes further), parked in park[h * 16 + p]. Lane l of the
 * canonical 16-lane accumulator takes the terms of dimensions l, 16 + l,
 * 32 + l, ... in that order (kmath.h's
 * kvr_quest_acc: one fused multiply-add of q by the bound its sign selects);
 * with 8-lane vectors it is kept as two halves, dimensions 16c..16c+7 and
 * 16c+8..16c+15. */
static inline __attribute__((always_inline)) void
ISA_FN(score_page_heads)(const unsigned char *sum, uint64_t page_bytes, uint32_t t, uint32_t d, const VA_T *q,
			 const QMASK_T *qm, vf *park, const uint32_t n, const uint32_t np)
{
	enum { per16 = 16 / VA_LANES };
	const uint32_t dv = d / VA_LANES;
	VA_T acc[SCORE_PAGE_BLOCK][SCORE_HEAD_BLOCK][per16];
	_Pragma("GCC unroll 4")
	for (uint32_t p = 0; p < np; p++)
		_Pragma("GCC unroll 4")
		for (uint32_t h = 0; h < n; h++)
			for (uint32_t k = 0; k < per16; k++)
				acc[p][h][k] = SPLATA(0.0f);
	for (uint32_t c = 0; c < dv; c += per16) {
		_Pragma("GCC unroll 2")
		for (uint32_t k = 0; k < per16; k++) {
			VA_T mn[SCORE_PAGE_BLOCK], mx[SCORE_PAGE_BLOCK];
			_Pragma("GCC unroll 4")
			for (uint32_t p = 0; p < np; p++) {
				mn[p] = LOADA(sum + p * page_bytes, t, (c + k) * VA_LANES);
				mx[p] = LOADA(sum + p * page_bytes, t, d + (c + k) * VA_LANES);
			}
			_Pragma("GCC unroll 4")
			for (uint32_t h = 0; h < n; h++) {
				const VA_T qv = q[h * dv + c + k];
				const __auto_type mask = QMASK_GET(qm, h * dv + c + k, qv);
				_Pragma("GCC unroll 4")
				for (uint32_t p = 0; p < np; p++)
					acc[p][h][k] = FMAA(qv, QSELECT(mask, mn[p], mx[p]), acc[p][h][k]);
			}
		}
	}
	_Pragma("GCC unroll 4")
	for (uint32_t p = 0; p < np; p++)
		_Pragma("GCC unroll 4")
		for (uint32_t h = 0; h < n; h++)
			memcpy(&park[h * 16 + p], acc[p][h], sizeof(vf));
}

/* score_page_heads with the head count n (1..SCORE_HEAD_BLOCK) made a
 * constant, so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void
ISA_FN(score_block)(const unsigned char *sum, uint64_t page_bytes, uint32_t t, uint32_t d, const VA_T *q,
		    const QMASK_T *qm, vf *park, uint32_t n, const uint32_t np)
{
	enum { two = SCORE_HEAD_BLOCK < 2 ? SCORE_HEAD_BLOCK : 2, three = SCORE_HEAD_BLOCK < 3 ? SCORE_HEAD_BLOCK : 3 };
	switch (n) {
	case 1: ISA_FN(score_page_heads)(sum, page_bytes, t, d, q, qm, park, 1, np); break;
	case 2: ISA_FN(score_page_heads)(sum, page_bytes, t, d, q, qm, park, two, np); break;
	case 3: ISA_FN(score_page_heads)(sum, page_bytes, t, d, q, qm, park, three, np); break;
	default: ISA_FN(score_page_heads)(sum, page_bytes, t, d, q, qm, park, SCORE_HEAD_BLOCK, np); break;
	}
}

/*
 * Scores of one item (kernels.h, "score"), bit for bit as kmath.h's canonical
 * orders give them, in two phases that kvr_cpu_score runs as two parallel
 * loops:
 *  A. raw scores (score_raw), a run of pages at a time, in batches of 16
 *     pages, each batch KV head by KV head: head m's min and max rows of
 *     SCORE_PAGE_BLOCK pages are scored against the query heads of its
 *     group, SCORE_HEAD_BLOCK heads at a time, with every accumulator in
 *     registers (score_page_heads); each query head's 16-lane accumulator is
 *     parked, and the batch's 16 accumulators of a head are folded together
 *     (FOLD16X16: lane-wise adds of shuffled halves, each page's canonical
 *     order, a fifth of the work of 16 single folds). Head by head keeps
 *     what the loop touches in L1 (the group's queries and G x 16 parked
 *     vectors, where page by page it was every query and 16 x n_qo parked
 *     vectors, 48 KiB for Llama-3.1-8B against a 32 KiB L1), and shares a
 *     query vector and its mask among the block's pages. A page's summaries,
 *     all heads, are one contiguous run, and head by head reads one head's
 *     rows of 16 runs, a run apart: a stride that the hardware prefetcher
 *     does not follow across 4 KiB pages, and that from DRAM ran at half
 *     attention's bytes per second. So while a batch is scored the next one
 *     is prefetched into L2, at each step the same head's rows of the next
 *     batch's pages, and the run's first batch before it starts. A page's
 *     raw score does not depend on the run, batch or block it was scored
 *     in, so none of this changes a bit.
 *  B. per KV head (score_finish): for each query head, the max over the
 *     domain, kvr_expf of (score - max) in place, summed in the canonical
 *     256 lanes and folded; then one pass writing the group mean. It runs on
 *     the native vectors (VA_T): lane l of vector i is canonical lane
 *     i·VA_LANES + l, whatever the width.
 *
 * A dimension's term is kvr_quest_acc: a blend of min and max by the query's
 * sign bit (the masks made once per query, QMASK_MAKE), then one FMA into the
 * accumulator, two operations where the larger of two products, added, took
 * four (scoring then costs about what attention costs per byte).
 *
 * The softmax spans the item's domain (kvr_score_domain: every complete page
 * when norm_end is set), so raw holds a score per domain page; only the
 * candidates, a sub-range of the domain, are written out.
 *
 * raw: a row of n_pad (n_dom rounded up to 16) floats per query head, row
 * m·G + g for query head g of KV head m.
 */

/* The item's queries, every head, as floats into qbuf (n_qo·d, 64-byte
 * aligned), and their sign masks into qm (n_qo·d / VA_LANES). */
static void ISA_FN(score_load_q)(const struct kvr_shape *sh, const struct kvr_score_item *it, VA_T *qbuf,
				 QMASK_T *qm)
{
	const uint32_t dv = sh->head_dim / VA_LANES;
	for (uint32_t h = 0; h < sh->n_qo_heads; h++)
		for (uint32_t c = 0; c < dv; c++) {
			qbuf[h * dv + c] = LOADA(it->q, sh->elem_type, (uint64_t)h * sh->head_dim + c * VA_LANES);
			qm[h * dv + c] = QMASK_MAKE(qbuf[h * dv + c]);
		}
}

/* Phase A for one element type `t` (a constant at each call, so the page's
 * loads compile straight): the raw scores of domain pages [j_begin, j_end)
 * (j_begin a multiple of 16) into raw, for every KV head. Lanes past j_end in
 * the last batch of the domain are stored as -inf (no max) and zeroed after
 * the exp. park: G x 16 vectors, a KV head's group at a time. */
static inline __attribute__((always_inline)) void
ISA_FN(score_raw)(const struct kvr_shape *sh, const unsigned char *base, uint32_t j_begin, uint32_t j_end,
		  uint32_t n_pad, const VA_T *qbuf, const QMASK_T *qm, vf *park, float *raw, const uint32_t t,
		  const uint32_t d)
{
	const uint32_t G = sh->n_qo_heads / sh->n_kv_heads, dv = d / VA_LANES;
	const uint32_t n_kv = sh->n_kv_heads;
	const uint64_t page_bytes = kvr_summary_page_elems(n_kv, d, (sh->flags & KVR_SHAPE_ESTIMATES) != 0) *
				    kvr_elem_bytes(t);
	const uint64_t head_bytes = 2ull * d * kvr_elem_bytes(t);
	const vf scale = SPLAT16(sh->scale);
	/* the run's first batch, which no earlier batch prefetches (the score
	 * 8-16% faster at 8K-32K in bench decode) */
	for (uint32_t j = j_begin; j < j_end && j < j_begin + 16; j++)
		for (uint64_t l = 0; l < n_kv * head_bytes; l += 64)
			__builtin_prefetch(base + (uint64_t)j * page_bytes + l, 0, 2);
	for (uint32_t j0 = j_begin; j0 < j_end; j0 += 16) {
		const uint32_t nb = j_end - j0 < 16 ? j_end - j0 : 16;
		const uint32_t nb_next = j0 + 16 < j_end ? (j_end - j0 - 16 < 16 ? j_end - j0 - 16 : 16) : 0;
		for (uint32_t m = 0; m < n_kv; m++) {
			for (uint32_t b = 0; b < nb; b += SCORE_PAGE_BLOCK) {
				const uint32_t np = nb - b < SCORE_PAGE_BLOCK ? nb - b : SCORE_PAGE_BLOCK;
				const unsigned char *sum = base + (uint64_t)(j0 + b) * page_bytes + m * head_bytes;
				/* the next batch's pages b.., head m: the whole next
				 * batch over this one's steps, into L2 */
				for (uint32_t p = 0; p < np && b + p < nb_next; p++)
					for (uint64_t l = 0; l < head_bytes; l += 64)
						__builtin_prefetch(sum + (16 + p) * page_bytes + l, 0, 2);
				for (uint32_t g = 0; g < G; g += SCORE_HEAD_BLOCK) {
					const VA_T *qg = qbuf + (m * G + g) * dv;
					const QMASK_T *mg = qm + (m * G + g) * dv;
					const uint32_t n = G - g < SCORE_HEAD_BLOCK ? G - g : SCORE_HEAD_BLOCK;
					if (np == SCORE_PAGE_BLOCK)
						ISA_FN(score_block)(sum, page_bytes, t, d, qg, mg, park + g * 16 + b, n,
								    SCORE_PAGE_BLOCK);
					else
						for (uint32_t p = 0; p < np; p++)
							ISA_FN(score_block)(sum + p * page_bytes, page_bytes, t, d, qg, mg,
									    park + g * 16 + b + p, n, 1);
				}
			}
			for (uint32_t b = nb; b < 16; b++) /* the last batch: lanes past the run */
				for (uint32_t g = 0; g < G; g++)
					park[g * 16 + b] = SPLAT16(0.0f);
			for (uint32_t g = 0; g < G; g++) {
				const uint32_t h = m * G + g;
				vf s = scale * FOLD16X16(park + g * 16);
				if (nb < 16)
					s = blend(ISA_FN(lane_index)() < (int32_t)nb, s, SPLAT16(-INFINITY));
				memcpy(raw + (uint64_t)h * n_pad + j0, &s, sizeof(s));
			}
		}
	}
}

/* Phase A of one item over domain pages [j_begin, j_end): raw as above;
 * qbuf: n_qo·d floats, park: G x 16 vectors, both 64-byte aligned; qm:
 * n_qo·d / VA_LANES masks (at most n_qo·d bytes). */
static void ISA_FN(score_pages)(const struct kvr_shape *sh, const struct kvr_score_item *it, uint32_t j_begin,
				uint32_t j_end, float *raw, vf *park, VA_T *qbuf, QMASK_T *qm)
{
	const uint32_t t = sh->elem_type;
	uint32_t dom_begin, dom_end;
	kvr_score_domain(it, &dom_begin, &dom_end);
	const uint32_t n_pad = (dom_end - dom_begin + 15u) & ~15u;
	const uint64_t page_elems = kvr_summary_page_elems(sh->n_kv_heads, sh->head_dim,
							   (sh->flags & KVR_SHAPE_ESTIMATES) != 0);
	ISA_FN(score_load_q)(sh, it, qbuf, qm);
	const unsigned char *base = (const unsigned char *)it->summaries +
				    (uint64_t)dom_begin * page_elems * kvr_elem_bytes(t);
	const uint32_t d = sh->head_dim;
	switch (t) { /* the element type as a constant: its loads compile straight */
	case KVR_ELEM_F16:
		/* the common head sizes as constants: the dimension loop unrolls */
		if (d == 128)
			ISA_FN(score_raw)(sh, base, j_begin, j_end, n_pad, qbuf, qm, park, raw, KVR_ELEM_F16, 128);
		else if (d == 64)
			ISA_FN(score_raw)(sh, base, j_begin, j_end, n_pad, qbuf, qm, park, raw, KVR_ELEM_F16, 64);
		else
			ISA_FN(score_raw)(sh, base, j_begin, j_end, n_pad, qbuf, qm, park, raw, KVR_ELEM_F16, d);
		break;
	case KVR_ELEM_BF16: ISA_FN(score_raw)(sh, base, j_begin, j_end, n_pad, qbuf, qm, park, raw, KVR_ELEM_BF16, d); break;
	default: ISA_FN(score_raw)(sh, base, j_begin, j_end, n_pad, qbuf, qm, park, raw, KVR_ELEM_F32, d); break;
	}
}

/* Phase B for KV head m of one item: raw is the item's (every row complete). */
static void ISA_FN(score_finish)(const struct kvr_shape *sh, const struct kvr_score_item *it, uint32_t m,
				 float *raw)
{
	const uint32_t G = sh->n_qo_heads / sh->n_kv_heads;
	uint32_t dom_begin, dom_end;
	kvr_score_domain(it, &dom_begin, &dom_end);
	const uint32_t n_dom = dom_end - dom_begin, n_pad = (n_dom + 15u) & ~15u;
	const uint32_t n_cand = it->cand_end - it->cand_begin, cand_off = it->cand_begin - dom_begin;
	raw += (uint64_t)m * G * n_pad;

	enum { n_lanes = KVR_SUM_LANES / VA_LANES };
	float inv[KVR_MAX_GROUP_CPU];
	for (uint32_t g = 0; g < G; g++) {
		float *s = raw + (uint64_t)g * n_pad;
		/* The max over the domain, NaN passed over (MAXA keeps its second
		 * operand when the first is NaN; the padding is -inf). Only a
		 * zero's sign can depend on the order, and x - (±0) is the same
		 * for x != 0 while kvr_expf(±0) = 1: it does not matter. */
		VA_T vmax = SPLATA(-INFINITY);
		for (uint32_t j = 0; j < n_pad; j += VA_LANES) {
			VA_T x;
			memcpy(&x, s + j, sizeof(x));
			vmax = MAXA(x, vmax);
		}
		float mxs = -INFINITY;
		for (int l = 0; l < VA_LANES; l++)
			mxs = vmax[l] > mxs ? vmax[l] : mxs;
		const VA_T vmxs = SPLATA(mxs);
		VA_T lanes[n_lanes];
		for (uint32_t l = 0; l < n_lanes; l++)
			lanes[l] = SPLATA(0.0f);
		for (uint32_t j = 0; j < n_pad; j += VA_LANES) {
			VA_T x;
			memcpy(&x, s + j, sizeof(x));
			x = EXPA(x - vmxs);
			memcpy(s + j, &x, sizeof(x));
			if (j + VA_LANES > n_dom) { /* lanes past n_dom add +0: no change */
				for (uint32_t l = j < n_dom ? n_dom : j; l < j + VA_LANES; l++)
					s[l] = 0.0f;
				memcpy(&x, s + j, sizeof(x));
			}
			lanes[(j / VA_LANES) % n_lanes] = lanes[(j / VA_LANES) % n_lanes] + x;
		}
		/* kvr_fold_lanes over 256: halves 128, 64, 32, 16 lane-wise, then 16 */
		for (uint32_t w = n_lanes / 2; w >= 16 / VA_LANES; w /= 2)
			for (uint32_t l = 0; l < w; l++)
				lanes[l] = lanes[l] + lanes[l + w];
		vf first16;
		memcpy(&first16, lanes, sizeof(first16));
		inv[g] = 1.0f / FOLD16(first16);
	}

	float *out = it->scores + (uint64_t)m * n_cand;
	const float inv_g = 1.0f / (float)G;
	raw += cand_off; /* the candidates' exps */
	uint32_t j = 0;
	for (; j + VA_LANES <= n_cand; j += VA_LANES) {
		VA_T o = SPLATA(0.0f);
		for (uint32_t g = 0; g < G; g++) {
			VA_T e;
			memcpy(&e, raw + (uint64_t)g * n_pad + j, sizeof(e));
			o = o + e * inv[g];
		}
		o = o * inv_g;
		memcpy(out + j, &o, sizeof(o));
	}
	for (; j < n_cand; j++) {
		float o = 0.0f;
		for (uint32_t g = 0; g < G; g++)
			o = o + raw[(uint64_t)g * n_pad + j] * inv[g];
		out[j] = o * inv_g;
	}
}

/* ------------------------------------------------------------------ attention */

/* What attention prefetches while it reads token `tok` of a segment (see
 * attention_impl): the next segment's row tok (a plain page's K and V rows,
 * or a share of a quantised run) into L2, and this segment's V row (plain
 * pages; vb NULL otherwise) into L1. */
struct ISA_FN(token_prefetch) {
	const unsigned char *nkb, *nvb, *nrun, *vb;
	/* nrun_step: a quantised next run's bytes per token of this segment
	 * (whole lines), so that the run arrives whole, its value codes and
	 * (s, z) too, by the end of this segment */
	uint64_t nrow, nrun_bytes, nrun_step, row, row_bytes;
	uint32_t n_next;
	/* an estimate segment's own rows (a page's summary apart: a stride no
	 * hardware prefetcher follows), fetched a block ahead; NULL otherwise */
	const unsigned char *ekb, *evb;
	uint32_t n_own;
	/* 1: a quantised next run into L2 instead of L1 (kvr_cpu_runs_to_l2) */
	int run_l2;
};

static inline __attribute__((always_inline)) void ISA_FN(prefetch_token)(const struct ISA_FN(token_prefetch) *pf,
									 uint32_t tok)
{
	if (tok < pf->n_next && pf->nkb)
		for (uint64_t l = 0; l < pf->row_bytes; l += 64) {
			__builtin_prefetch(pf->nkb + tok * pf->nrow + l, 0, 2);
			__builtin_prefetch(pf->nvb + tok * pf->nrow + l, 0, 2);
		}
	else if (pf->nrun && tok * pf->nrun_step < pf->nrun_bytes) {
		/* into L1 on Intel: a run is 3-7 KiB, and into L2 its lines
		 * were read back 6% slower there (K8V4, pages from DRAM); into
		 * L2 on AMD, where L1 prefetches held the key dots' loads up
		 * (K8V4 from DRAM 1.10-1.14x faster, K4V2 the same) */
		if (pf->run_l2)
			for (uint64_t l = 0; l < pf->nrun_step; l += 64)
				__builtin_prefetch(pf->nrun + tok * pf->nrun_step + l, 0, 2);
		else
			for (uint64_t l = 0; l < pf->nrun_step; l += 64)
				__builtin_prefetch(pf->nrun + tok * pf->nrun_step + l, 0, 3);
	}
	/* This token's V row into L1 now, for the V pass after the block's
	 * softmax: the next-segment prefetch brought it only to L2, and the V
	 * pass's loads waited on it (on SmolLM2's shape a fifth of the kernel's
	 * samples). */
	if (pf->vb)
		for (uint64_t l = 0; l < pf->row_bytes; l += 64)
			__builtin_prefetch(pf->vb + tok * pf->row + l, 0, 3);
	if (pf->ekb && tok + 16u < pf->n_own)
		for (uint64_t l = 0; l < pf->row_bytes; l += 64) {
			__builtin_prefetch(pf->ekb + (tok + 16u) * pf->row + l, 0, 2);
			__builtin_prefetch(pf->evb + (tok + 16u) * pf->row + l, 0, 2);
		}
}

/* Quantised rows are read as codes: attention folds each token's scale s
 * and zero point z in around the dot products (q·(s·Q − z) = s·(q·Q) − z·Σq;
 * Σ_t p·(s·Q − z) = Σ_t (p·s)·Q − Σ_t p·z), so dequantising costs a
 * conversion per code and no arithmetic. Every helper below takes `bits`, 0
 * for a plain row of element type t or the code width, as a constant at each
 * call (ATT_BITS_CASES): each format's loads are compiled straight. */

/* Elements 16·c16 .. 16·c16 + 15 of a row as 16 / VA_LANES vectors. */
static inline __attribute__((always_inline)) void ISA_FN(row16)(const unsigned char *row, uint32_t t,
								const uint32_t bits, uint32_t c16, VA_T *out)
{
	if (bits) {
		CODES16A(row, bits, c16, out);
		return;
	}
	_Pragma("GCC unroll 2")
	for (uint32_t k = 0; k < 16 / VA_LANES; k++)
		out[k] = LOADA(row, t, c16 * 16u + k * VA_LANES);
}

/* The dots of query heads g..g+n−1 (n ≤ 4, a constant) with `n_keys` (1 or
 * 2, a constant) consecutive key rows (krow, krow + stride), into s[g + h][b
 * + key]. Each query vector, read from L1 by the FMAs, serves both keys; the
 * accumulators (2n), the keys' vectors for 16 elements and the query vector
 * stay in registers (13 of AVX2's 16 at n = 4). */
static inline __attribute__((always_inline)) void
ISA_FN(key_heads)(const VA_T (*q)[VA_MAX_CHUNKS], uint32_t g, const uint32_t n, const uint32_t n_keys,
		  const unsigned char *krow, uint64_t stride, uint32_t t, const uint32_t bits, const uint32_t chunks,
		  float (*s)[16], uint32_t b)
{
	enum { per16 = 16 / VA_LANES };
	VA_T d0[4], d1[4];
	_Pragma("GCC unroll 4")
	for (uint32_t h = 0; h < 4; h++)
		d0[h] = d1[h] = SPLATA(0.0f);
	_Pragma("GCC unroll 2")
	for (uint32_t c16 = 0; c16 < chunks / per16; c16++) {
		VA_T k0[per16], k1[per16];
		ISA_FN(row16)(krow, t, bits, c16, k0);
		if (n_keys == 2)
			ISA_FN(row16)(krow + stride, t, bits, c16, k1);
		_Pragma("GCC unroll 2")
		for (uint32_t k = 0; k < per16; k++)
			_Pragma("GCC unroll 4")
			for (uint32_t h = 0; h < n; h++) {
				const VA_T qv = q[g + h][c16 * per16 + k];
				d0[h] = FMAA(qv, k0[k], d0[h]);
				if (n_keys == 2)
					d1[h] = FMAA(qv, k1[k], d1[h]);
			}
	}
	float four[4];
	if (n_keys == 1) {
		if (n == 1) {
			s[g][b] = HSUMA(d0[0]);
			return;
		}
		HSUM4A(d0[0], d0[1], d0[2], d0[3], four);
		_Pragma("GCC unroll 4")
		for (uint32_t h = 0; h < n; h++)
			s[g + h][b] = four[h];
	} else if (n == 1) {
		HSUM4A(d0[0], d1[0], d0[1], d0[1], four);
		s[g][b] = four[0], s[g][b + 1] = four[1];
	} else if (n == 2) {
		HSUM4A(d0[0], d0[1], d1[0], d1[1], four);
		s[g][b] = four[0], s[g + 1][b] = four[1];
		s[g][b + 1] = four[2], s[g + 1][b + 1] = four[3];
	} else {
		HSUM4A(d0[0], d0[1], d0[2], d0[3], four);
		_Pragma("GCC unroll 4")
		for (uint32_t h = 0; h < n; h++)
			s[g + h][b] = four[h];
		HSUM4A(d1[0], d1[1], d1[2], d1[3], four);
		_Pragma("GCC unroll 4")
		for (uint32_t h = 0; h < n; h++)
			s[g + h][b + 1] = four[h];
	}
}

/* The scores of all G query heads with n_keys keys: blocks of four heads,
 * then the one to three left (SmolLM2: G = 3) in one pass. */
static inline __attribute__((always_inline)) void
ISA_FN(key_dots)(const VA_T (*q)[VA_MAX_CHUNKS], uint32_t G, const uint32_t n_keys, const unsigned char *krow,
		 uint64_t stride, uint32_t t, const uint32_t bits, const uint32_t chunks, float (*s)[16], uint32_t b)
{
#define KEY_HEADS(g, n) ISA_FN(key_heads)(q, g, n, n_keys, krow, stride, t, bits, chunks, s, b)
	HEADS_BY_FOUR(G, KEY_HEADS);
#undef KEY_HEADS
}

/* acc[g + h][c0 .. c0 + n_c) += Σ_b p[g + h][b]·V_b for heads g..g+n−1 (n ≤ 4,
 * a constant) over the block's nb value rows (vrow, vrow + stride, ...), n_c
 * (a constant multiple of 16 / VA_LANES) vectors from vector c0: with the
 * heads innermost, each value vector is converted once and feeds n FMAs,
 * and the n·n_c accumulators stay in registers for the block. */
static inline __attribute__((always_inline)) void
ISA_FN(value_strip)(VA_T (*acc)[VA_MAX_CHUNKS], uint32_t g, const uint32_t n, uint32_t c0, const uint32_t n_c,
		    const unsigned char *vrow, uint64_t stride, uint32_t t, const uint32_t bits, const float (*p)[16],
		    uint32_t nb)
{
	enum { per16 = 16 / VA_LANES };
	VA_T a[4][VA_V_STRIP];
	_Pragma("GCC unroll 4")
	for (uint32_t h = 0; h < n; h++)
		_Pragma("GCC unroll 8")
		for (uint32_t c = 0; c < n_c; c++)
			a[h][c] = acc[g + h][c0 + c];
	for (uint32_t b = 0; b < nb; b++) {
		VA_T v[VA_V_STRIP];
		_Pragma("GCC unroll 8")
		for (uint32_t c = 0; c < n_c; c += per16)
			ISA_FN(row16)(vrow + b * stride, t, bits, (c0 + c) / per16, v + c);
		_Pragma("GCC unroll 4")
		for (uint32_t h = 0; h < n; h++) {
			const VA_T ph = SPLATA(p[g + h][b]);
			_Pragma("GCC unroll 8")
			for (uint32_t c = 0; c < n_c; c++)
				a[h][c] = FMAA(ph, v[c], a[h][c]);
		}
	}
	_Pragma("GCC unroll 4")
	for (uint32_t h = 0; h < n; h++)
		_Pragma("GCC unroll 8")
		for (uint32_t c = 0; c < n_c; c++)
			acc[g + h][c0 + c] = a[h][c];
}

/* The value strips of heads g..g+n−1: VA_V_STRIP vectors at a time (4·VA_V_STRIP
 * accumulators: 8 of AVX2's 16 registers, 16 of AVX-512's 32), then the
 * remainder (d = 96, 160, 224 on AVX-512: 2 vectors). */
static inline __attribute__((always_inline)) void
ISA_FN(value_heads)(VA_T (*acc)[VA_MAX_CHUNKS], uint32_t g, const uint32_t n, const unsigned char *vrow,
		    uint64_t stride, uint32_t t, const uint32_t bits, const float (*p)[16], uint32_t nb,
		    const uint32_t chunks)
{
	enum { per16 = 16 / VA_LANES };
	uint32_t c0 = 0;
	for (; c0 + VA_V_STRIP <= chunks; c0 += VA_V_STRIP)
		ISA_FN(value_strip)(acc, g, n, c0, VA_V_STRIP, vrow, stride, t, bits, p, nb);
	if (VA_V_STRIP > 2 * per16 && c0 < chunks) /* chunks is even, and a multiple of per16 */
		ISA_FN(value_strip)(acc, g, n, c0, 2 * per16, vrow, stride, t, bits, p, nb);
}

static inline __attribute__((always_inline)) void
ISA_FN(value_dots)(VA_T (*acc)[VA_MAX_CHUNKS], uint32_t G, const unsigned char *vrow, uint64_t stride, uint32_t t,
		   const uint32_t bits, const float (*p)[16], uint32_t nb, const uint32_t chunks)
{
#define VALUE_HEADS(g, n) ISA_FN(value_heads)(acc, g, n, vrow, stride, t, bits, p, nb, chunks)
	HEADS_BY_FOUR(G, VALUE_HEADS);
#undef VALUE_HEADS
}

/* acc[g] += the value sums vacc[g] of `bits`-bit codes (in
 * PV_CHANNEL's order): at the end of the call, once per value width that
 * had sums. */
static void ISA_FN(pv_flush)(VA_T (*acc)[VA_MAX_CHUNKS], float (*vacc)[256], uint32_t G, uint32_t d,
			     uint32_t chunks, uint32_t bits)
{
	for (uint32_t g = 0; g < G; g++) {
		float row[256];
		for (uint32_t i = 0; i < d; i++)
			row[PV_CHANNEL(i, bits)] = vacc[g][i];
		for (uint32_t c = 0; c < chunks; c++) {
			VA_T v;
			memcpy(&v, row + c * VA_LANES, sizeof(v));
			acc[g][c] = acc[g][c] + v;
		}
	}
}

/* `call` with its `bits` argument a constant: 0 for a plain segment, the
 * key (K) or value (V) code width of each quantised format otherwise (K8V4
 * and its halves: 8 and 4; K4V2: 4 and 2). */
#define ATT_BITS_CASES(fmt, kv, call)                                                   \
	do {                                                                            \
		if (!(fmt)) {                                                           \
			enum { bits = 0 };                                              \
			call;                                                           \
		} else if ((fmt) == KVR_KV_K4V2) {                                      \
			enum { bits = (kv) == 'K' ? 4 : 2 };                            \
			call;                                                           \
		} else {                                                                \
			enum { bits = (kv) == 'K' ? 8 : 4 };                            \
			call;                                                           \
		}                                                                       \
	} while (0)

/* Attention of KV head m of one item over its segments (kernels.h), in
 * blocks of 16 tokens: their scores (key_dots), the block's online softmax,
 * then the weighted values (value_dots). `chunks` = d / VA_LANES is a run-time
 * count: the dot and value helpers keep a fixed set of accumulators in
 * registers whatever d is, and q and acc are read from L1 (acc once per
 * block), so one instantiation serves every head dimension. */
static inline __attribute__((always_inline)) void
ISA_FN(attention_impl)(const struct kvr_shape *sh, const void *q_rows, void *out_rows,
		       const struct kvr_kv_segment *segs, uint32_t n_segs, uint32_t m, float *lse,
		       const uint32_t chunks, qk_dots_fn qk, pv_dots_fn pv)
{
	enum { BLOCK = 16 };
	const uint32_t G = sh->n_qo_heads / sh->n_kv_heads, d = sh->head_dim, t = sh->elem_type;
	const uint64_t eb = kvr_elem_bytes(t);
	VA_T q[KVR_MAX_GROUP_CPU][VA_MAX_CHUNKS], acc[KVR_MAX_GROUP_CPU][VA_MAX_CHUNKS];
	/* run_sum: the softmax's running sums, per lane until the end */
	float run_max[KVR_MAX_GROUP_CPU];
	VA_T run_sum[KVR_MAX_GROUP_CPU];
	for (uint32_t g = 0; g < G; g++) {
		_Pragma("GCC unroll 32")
		for (uint32_t c = 0; c < chunks; c++) {
			q[g][c] = LOADA(q_rows, t, (uint64_t)(m * G + g) * d + c * VA_LANES) * sh->scale;
			acc[g][c] = SPLATA(0.0f);
		}
		run_max[g] = -INFINITY;
		run_sum[g] = SPLATA(0.0f);
	}
	/* quantised segments: Σ_c q_c per head (keys), and Σ_t p_t·z_t per
	 * head, per lane, rescaled with acc (values; subtracted at the end) */
	float q_sum[KVR_MAX_GROUP_CPU];
	VA_T z_acc[KVR_MAX_GROUP_CPU];
	for (uint32_t g = 0; g < G; g++) {
		VA_T t16 = q[g][0];
		for (uint32_t c = 1; c < chunks; c++)
			t16 = t16 + q[g][c];
		q_sum[g] = HSUMA(t16);
		z_acc[g] = SPLATA(0.0f);
	}
	/* quantised keys with integer dots (qk): the queries rounded to 8 bits
	 * (kvquant.h, kvr_quant_query_row), once per call */
	const int any_quantised = segments_quantised(segs, n_segs);
	/* where a quantised next run is prefetched to (kvr_cpu_runs_to_l2):
	 * once per call, not per segment */
	const int run_l2 = any_quantised && kvr_cpu_runs_to_l2();
	const uint32_t Gq = qk && any_quantised ? G : 1u; /* rows the arrays hold */
	/* quantised values by the ISA's value dots (pv): their sums in pv's channel
	 * order, one set per value width (vacc[0]: 4-bit codes, vacc[1]: 2-bit),
	 * rescaled with acc and added into acc at the end, so that a mixed
	 * run's alternating K8V4 and K4V2 pages never flush between them */
	const int pv_on = pv && any_quantised && (PV_FITS(4, d) || PV_FITS(2, d));
	float vacc[pv_on ? 2u : 1u][pv_on ? G : 1u][256];
	uint32_t pv_used = 0; /* bit w: vacc[w] holds sums */
	/* both sets zeroed up front: zeroing a set at its first page put a test
	 * in the block loop and measured 1-2% slower (AVX2, K8V4) */
	if (pv_on)
		memset(vacc, 0, sizeof(vacc));
	int8_t q8_rows[Gq][256], q8n_rows[Gq][256];
	int16_t q16_rows[Gq][256];
	float q_scale[Gq], q_code_sum[Gq];
	struct kvr_qk8 qq = { q8_rows, q8n_rows, q16_rows, q_scale, q_code_sum };
	if (qk && any_quantised)
		for (uint32_t g = 0; g < G; g++) {
			float row[256];
			memcpy(row, q[g], (size_t)d * sizeof(float));
			ISA_FN(qk8_prepare)(&qq, g, row, d);
		}

	const uint64_t row_bytes = (uint64_t)d * eb;
	/* quantised segments' run geometry, per format (kvquant.h); the caller
	 * (attention_task) has rejected unknown formats */
	struct kvr_quant_geometry gq[KVR_KV_K8V4_HALF + 1];
	kvr_quant_geometry_init(&gq[KVR_KV_K8V4], sh->page_tokens, d, 1, KVR_KV_K8V4);
	kvr_quant_geometry_init(&gq[KVR_KV_K4V2], sh->page_tokens, d, 1, KVR_KV_K4V2);
	kvr_quant_geometry_init(&gq[KVR_KV_K8V4_HALF], sh->page_tokens, d, 1, KVR_KV_K8V4_HALF);
	/* KVR_SHAPE_CAUSAL: head g is query token g / hq at position pos0 + that,
	 * and sees tokens 0 .. its position, counted over the segments (tok0) */
	const int causal = (sh->flags & KVR_SHAPE_CAUSAL) != 0;
	const uint32_t hq = causal ? sh->causal_heads_per_query : 1;
	const uint64_t pos0 = sh->causal_first_position, last_pos = pos0 + G / hq - 1;
	uint64_t seg_first_token = 0;
	/* lse: each segment's sum of exp(logit − run_max), rescaled with run_sum */
	VA_T seg_sum[KVR_MAX_GROUP_CPU];
	for (uint32_t si = 0; si < n_segs; si++) {
		const struct kvr_kv_segment *seg = &segs[si];
		/* quantised codes (their format), or plain rows (0): tokens, or
		 * page estimates whose logits get ln(p) (kernels.h) */
		const uint32_t fmt = kvr_segment_quantised(seg->format) ? seg->format : 0u;
		/* this segment's values by pv, their codes centred by PV_CENTRE */
		const int pv_seg = fmt && pv_on && PV_FITS(gq[fmt].value_bits, d);
		const float log_weight = kvr_segment_log_weight(seg->format, sh->page_tokens);
		const uint64_t seg_tok0 = seg_first_token;
		seg_first_token += seg->n_tokens;
		if (causal && seg_tok0 > last_pos) { /* after every query of the block */
			for (uint32_t g = 0; lse && g < G; g++)
				lse[(uint64_t)(m * G + g) * n_segs + si] = -INFINITY;
			continue;
		}
		for (uint32_t g = 0; g < G; g++)
			seg_sum[g] = SPLATA(0.0f);
		/* plain: element offsets; quantised: the head's run, byte offsets */
		const uint64_t head_off = (uint64_t)m * seg->head_stride * (fmt ? 1u : eb);
		const unsigned char *kb = (const unsigned char *)seg->k + head_off;
		const unsigned char *vb = (const unsigned char *)seg->v + head_off;
		const uint64_t row = fmt ? 0 : (uint64_t)seg->row_stride * eb;
		const uint32_t first = fmt ? seg->first_row : 0; /* quantised: rows from here */
		/* the first K and V rows and their strides: NHD rows of a plain page,
		 * the key and value code rows of a quantised run */
		unsigned char *run = (unsigned char *)(uintptr_t)kb;
		const unsigned char *krow0 = fmt ? kvr_quant_key_row(&gq[fmt], run, first) : kb;
		const unsigned char *vrow0 = fmt ? kvr_quant_value_row(&gq[fmt], run, first) : vb;
		const uint64_t kstride = fmt ? gq[fmt].key_row_bytes : row;
		const uint64_t vstride = fmt ? gq[fmt].value_row_bytes : row;
		/* Segments are scattered pages: no hardware prefetcher follows the jump
		 * to the next one. Prefetch its row t while using our row t (a
		 * quantised run: two lines per token), keeping one segment of loads
		 * in flight. */
		const struct kvr_kv_segment *next = si + 1 < n_segs ? &segs[si + 1] : NULL;
		const int next_plain = next && !kvr_segment_quantised(next->format);
		const unsigned char *nkb = next_plain ? (const unsigned char *)next->k + (uint64_t)m * next->head_stride * eb : NULL;
		const unsigned char *nvb = next_plain ? (const unsigned char *)next->v + (uint64_t)m * next->head_stride * eb : NULL;
		const uint64_t nrow = next_plain ? (uint64_t)next->row_stride * eb : 0;
		const unsigned char *nrun = next && !next_plain ? (const unsigned char *)next->k + (uint64_t)m * next->head_stride : NULL;
		const uint64_t nrun_bytes = nrun ? gq[next->format].head_bytes : 0;
		const uint64_t nrun_step = seg->n_tokens ? ((nrun_bytes + seg->n_tokens - 1) / seg->n_tokens + 63) & ~63ull : 0;
		const uint32_t n_next = next ? next->n_tokens : 0;
		const struct ISA_FN(token_prefetch) pf = {
			.nkb = nkb, .nvb = nvb, .nrow = nrow, .nrun = nrun, .nrun_bytes = nrun_bytes, .nrun_step = nrun_step,
			.vb = fmt ? NULL : vb, .row = row, .row_bytes = row_bytes, .n_next = n_next,
			.ekb = log_weight != 0.0f ? kb : NULL, .evb = vb, .n_own = seg->n_tokens,
			.run_l2 = run_l2,
		};
		for (uint32_t t0 = 0; t0 < seg->n_tokens; t0 += BLOCK) {
			const uint32_t nb = seg->n_tokens - t0 < BLOCK ? seg->n_tokens - t0 : BLOCK;
			const uint64_t tok0 = seg_tok0 + t0;
			if (causal && tok0 > last_pos)
				break;
			float s[KVR_MAX_GROUP_CPU][BLOCK];
			/* The next run's share for this block (quantised segments) is
			 * prefetched in three parts, a quarter before the integer key
			 * dots, a quarter after them and half before the values: all of
			 * it at once filled the line fill buffers and stalled the key
			 * dots' loads behind it (K8V4 from DRAM 15% slower, K4V2 5%:
			 * docs/history.md). */
			const uint32_t pf_qk = nb / 4u, pf_mid = nb / 2u;
			if (fmt && qk) { /* integer dots on the key codes */
				for (uint32_t b = 0; b < pf_qk; b++)
					ISA_FN(prefetch_token)(&pf, t0 + b);
				qk(&qq, G, d, krow0 + t0 * kstride, kstride, gq[fmt].key_bits, nb,
				   kvr_quant_key_sz(&gq[fmt], run, first + t0), s);
			} else {
				/* K, two tokens at a time (prefetching the next segment's
				 * rows as we go): each query vector read serves two keys */
				const VA_T (*kq)[VA_MAX_CHUNKS] = (const VA_T (*)[VA_MAX_CHUNKS])q;
				uint32_t b = 0;
				for (; b + 2 <= nb; b += 2) {
					ISA_FN(prefetch_token)(&pf, t0 + b);
					ISA_FN(prefetch_token)(&pf, t0 + b + 1);
					ATT_BITS_CASES(fmt, 'K', ISA_FN(key_dots)(kq, G, 2, krow0 + (t0 + b) * kstride,
										   kstride, t, bits, chunks, s, b));
				}
				if (b < nb) {
					ISA_FN(prefetch_token)(&pf, t0 + b);
					ATT_BITS_CASES(fmt, 'K', ISA_FN(key_dots)(kq, G, 1, krow0 + (t0 + b) * kstride,
										   kstride, t, bits, chunks, s, b));
				}
			}
			if (fmt && qk)
				for (uint32_t b = pf_qk; b < pf_mid; b++)
					ISA_FN(prefetch_token)(&pf, t0 + b);
			if (fmt && !qk) /* float dots over codes: s·(q·Q) − z·Σq */
				for (uint32_t b = 0; b < nb; b++) {
					const uint16_t *sz = kvr_quant_key_sz(&gq[fmt], run, first + t0 + b);
					const float ks = F16TOF32(sz[0]), kz = F16TOF32(sz[1]);
					for (uint32_t g = 0; g < G; g++)
						s[g][b] = ks * s[g][b] - kz * q_sum[g];
				}
			if (log_weight != 0.0f) /* estimate rows: each is a page's p tokens */
				for (uint32_t g = 0; g < G; g++)
					for (uint32_t b = 0; b < nb; b++)
						s[g][b] += log_weight;
			if (causal && tok0 + nb - 1 > pos0) /* the diagonal: no query sees a later token */
				for (uint32_t g = 0; g < G; g++) {
					const uint64_t lim = pos0 + g / hq;
					for (uint32_t b = 0; b < nb; b++)
						if (tok0 + b > lim)
							s[g][b] = -INFINITY;
				}
			for (uint32_t g = 0; g < G; g++) {
				/* the block's BLOCK scores as VA_T parts, past nb at -inf */
				for (uint32_t b = nb; b < BLOCK; b++)
					s[g][b] = -INFINITY;
				VA_T x[BLOCK / VA_LANES];
				_Pragma("GCC unroll 2")
				for (uint32_t h = 0; h < BLOCK / VA_LANES; h++)
					memcpy(&x[h], s[g] + h * VA_LANES, sizeof(x[h]));
				/* The running max moves only when a score of the block exceeds
				 * it by more than ATT_LAZY_MAX (or nothing was seen yet), as in
				 * attention_causal: weights then stay below e^8 ≈ 3000, and most
				 * blocks skip the block max (a horizontal reduction), the
				 * rescale factor (a scalar exp) and the rescale of the outputs,
				 * which on the decode path had cost about a third of the
				 * quantised kernels' time. The softmax is the same: every weight
				 * and sum is relative to one max. A NaN score compares false
				 * here and propagates through its weight. */
				int raise = run_max[g] == -INFINITY;
				if (!raise) {
					const VA_T lim = SPLATA(run_max[g] + ATT_LAZY_MAX);
					_Pragma("GCC unroll 2")
					for (uint32_t h = 0; h < BLOCK / VA_LANES; h++)
						raise |= ANYGTA(x[h], lim);
				}
				float alpha = 1.0f;
				if (raise) {
					VA_T vmx = SPLATA(-INFINITY);
					_Pragma("GCC unroll 2")
					for (uint32_t h = 0; h < BLOCK / VA_LANES; h++)
						vmx = MAXA(x[h], vmx); /* a NaN score is passed over */
					const float bmax = HMAXA(vmx);
					const float new_max = bmax > run_max[g] ? bmax : run_max[g];
					if (new_max == -INFINITY) {
						/* Nothing with weight yet (masked, or keys whose
						 * logits are −inf, as may open a part of a split
						 * item): weight 0, not exp(−inf + inf) = NaN. A NaN
						 * score still propagates (MAXA passed over it). */
						int nan = 0;
						for (uint32_t b = 0; !causal && b < nb; b++)
							nan |= s[g][b] != s[g][b];
						if (!nan) {
							for (uint32_t b = 0; b < BLOCK; b++)
								s[g][b] = 0.0f;
							continue;
						}
					}
					alpha = kvr_softmax_rescale(run_max[g], new_max);
					run_max[g] = new_max;
				}
				const VA_T mx = SPLATA(run_max[g]);
				VA_T vsum = SPLATA(0.0f);
				_Pragma("GCC unroll 2")
				for (uint32_t h = 0; h < BLOCK / VA_LANES; h++) {
					/* padded lanes are exp(-inf) = 0; a NaN score stays NaN here */
					x[h] = ATT_EXPA(x[h] - mx);
					memcpy(s[g] + h * VA_LANES, &x[h], sizeof(x[h]));
					vsum = vsum + x[h];
				}
				if (alpha != 1.0f) {
					_Pragma("GCC unroll 32")
					for (uint32_t c = 0; c < chunks; c++)
						acc[g][c] = acc[g][c] * alpha;
					z_acc[g] = z_acc[g] * alpha;
					for (uint32_t w = 0; w < 2; w++)
						if (pv_used >> w & 1u)
							for (uint32_t c = 0; c < d; c++)
								vacc[w][g][c] *= alpha;
					run_sum[g] = run_sum[g] * alpha;
					seg_sum[g] = seg_sum[g] * alpha;
				}
				run_sum[g] = run_sum[g] + vsum;
				seg_sum[g] = seg_sum[g] + vsum;
			}
			if (fmt) { /* Σ p·(s·Q − z): p·s per token on the codes, p·z apart */
				float vsb[BLOCK] __attribute__((aligned(64))), vzb[BLOCK] __attribute__((aligned(64)));
				const uint16_t *sz = kvr_quant_value_sz(&gq[fmt], run, first + t0);
				/* the value sums (pv) take the codes centred (Q − c, c =
				 * PV_CENTRE: half the code range for integer sums, 0 for
				 * AVX2's float 4-bit ones), so their zero point is z − c·s
				 * here */
				const float centre = pv_seg ? PV_CENTRE(gq[fmt].value_bits) : 0.0f;
				VALUE_SZ16(sz, nb, centre, vsb, vzb);
				for (uint32_t g = 0; g < G; g++) {
					VA_T zsum = z_acc[g];
					_Pragma("GCC unroll 2")
					for (uint32_t h = 0; h < BLOCK / VA_LANES; h++) {
						VA_T x, vs, vz;
						memcpy(&x, s[g] + h * VA_LANES, sizeof(x));
						memcpy(&vs, vsb + h * VA_LANES, sizeof(vs));
						memcpy(&vz, vzb + h * VA_LANES, sizeof(vz));
						zsum = FMAA(x, vz, zsum);
						x = x * vs;
						memcpy(s[g] + h * VA_LANES, &x, sizeof(x));
					}
					z_acc[g] = zsum;
				}
			}
			/* V: each value vector read once and used by every head of a
			 * block of four (or integer dots on the codes: pv) */
			if (fmt && qk)
				for (uint32_t b = pf_mid; b < nb; b++)
					ISA_FN(prefetch_token)(&pf, t0 + b);
			if (pv_seg) {
				const uint32_t w = gq[fmt].value_bits == 4 ? 0u : 1u;
				pv_used |= 1u << w;
				pv(G, d, gq[fmt].value_bits, vrow0 + t0 * vstride, vstride, nb, (const float (*)[16])s,
				   vacc[w]);
			} else
				ATT_BITS_CASES(fmt, 'V', ISA_FN(value_dots)(acc, G, vrow0 + t0 * vstride, vstride, t,
									      bits, (const float (*)[16])s, nb, chunks));
		}
		if (lse) /* log(0) = −inf for an empty segment */
			for (uint32_t g = 0; g < G; g++)
				lse[(uint64_t)(m * G + g) * n_segs + si] =
					seg->n_tokens ? run_max[g] + logf(HSUMA(seg_sum[g])) : -INFINITY;
	}

	for (uint32_t w = 0; w < 2; w++)
		if (pv_used >> w & 1u)
			ISA_FN(pv_flush)(acc, vacc[w], G, d, chunks, w ? 2u : 4u);
	for (uint32_t g = 0; g < G; g++) {
		/* No tokens: zeros. A NaN anywhere made run_sum NaN: it propagates. */
		float row[256];
		const float sum = HSUMA(run_sum[g]);
		const float inv = sum == 0.0f ? 0.0f : 1.0f / sum;
		const VA_T zv = SPLATA(HSUMA(z_acc[g]));
		_Pragma("GCC unroll 32")
		for (uint32_t c = 0; c < chunks; c++) {
			VA_T o = acc[g][c] - zv;
			o = o * inv;
			memcpy(row + c * VA_LANES, &o, sizeof(o));
		}
		if (sh->flags & KVR_CPU_SHAPE_PART) {
			/* a part of the item's tokens (kvr_cpu_attention): head g's
			 * row in f32 and its log-sum-exp, −inf for no weight (NaN
			 * stays NaN), for attention_merge */
			float *part = (float *)out_rows + (uint64_t)g * (d + 1u);
			memcpy(part, row, (size_t)d * sizeof(float));
			part[d] = sum == 0.0f ? -INFINITY : run_max[g] + logf(sum);
			continue;
		}
		kvr_convert_from_f32((unsigned char *)out_rows + (uint64_t)(m * G + g) * d * eb, row, t, d);
	}
}

/*
 * A causal query block over plain segments (the prefill: KVR_SHAPE_CAUSAL,
 * tens of query heads per KV head) as two small matrix products per block
 * of 16 tokens, FlashAttention-2's structure with the heads in the vector
 * lanes: Q is held transposed (qt[c][g], scaled), so a block's scores are
 * S[b][g] = Σ_c K[b][c]·qt[c][g] — a broadcast of one key element times a
 * vector of heads, no horizontal sums — and the output is kept transposed
 * too, ot[c][g] += Σ_b V[b][c]·P[b][g], so the online softmax's running
 * maxima, sums and rescales are lane-wise over heads. The block's K and V
 * rows are widened to f32 once for all the heads. Register tiles: 4 tokens
 * (or 4 dimensions) by 2 head vectors, or 8 by the one vector left, 8
 * accumulators either way. Heads are padded to whole vectors with zero
 * queries, whose lanes are computed and never written out.
 */
#ifndef KVR_CA_CONSTANTS /* once for the three inclusions */
#define KVR_CA_CONSTANTS
enum { CA_BLOCK = 16, CA_TILE = 4 };
#define CA_LAZY_MAX 8.0f
#endif

/* An f32 array's vector at ptr (64-byte aligned rows, see attention_causal) */
typedef VA_T ISA_FN(ca_vec) __attribute__((may_alias));
#define CA_V(ptr) (*(ISA_FN(ca_vec) *)(ptr))

/* Scores st[b][heads] for tokens b0..b0+NT−1 and head vectors j..j+NVT−1:
 * Σ_c kf[b][c]·qt[c][heads], NT·NVT (8) accumulators; NT, NVT constants. */
static inline __attribute__((always_inline)) void ISA_FN(ca_scores)(const float *qt, const float *kf, float *st,
								    uint32_t d, uint32_t GP, uint32_t j, uint32_t b0,
								    const uint32_t NT, const uint32_t NVT)
{
	VA_T a[2 * CA_TILE][2];
	_Pragma("GCC unroll 8")
	for (uint32_t i = 0; i < NT; i++)
		a[i][0] = a[i][1] = SPLATA(0.0f);
	for (uint32_t c = 0; c < d; c++) {
		VA_T q[2];
		_Pragma("GCC unroll 2")
		for (uint32_t v = 0; v < NVT; v++)
			q[v] = CA_V(qt + c * GP + (j + v) * VA_LANES);
		_Pragma("GCC unroll 8")
		for (uint32_t i = 0; i < NT; i++) {
			const VA_T k = SPLATA(kf[(b0 + i) * d + c]);
			_Pragma("GCC unroll 2")
			for (uint32_t v = 0; v < NVT; v++)
				a[i][v] = FMAA(k, q[v], a[i][v]);
		}
	}
	_Pragma("GCC unroll 8")
	for (uint32_t i = 0; i < NT; i++)
		_Pragma("GCC unroll 2")
		for (uint32_t v = 0; v < NVT; v++)
			CA_V(st + (b0 + i) * GP + (j + v) * VA_LANES) = a[i][v];
}

/* ot[c][heads] += Σ_b vv[b][c]·st[b][heads] for dimensions c0..c0+NC−1 and
 * head vectors j..j+NVT−1 over the block's nb tokens; NC·NVT (8)
 * accumulators; NC, NVT constants. */
static inline __attribute__((always_inline)) void ISA_FN(ca_values)(float *ot, const float *st, const float *vv,
								    uint32_t d, uint32_t GP, uint32_t j, uint32_t c0,
								    uint32_t nb, const uint32_t NC, const uint32_t NVT)
{
	VA_T a[2 * CA_TILE][2];
	_Pragma("GCC unroll 8")
	for (uint32_t i = 0; i < NC; i++)
		_Pragma("GCC unroll 2")
		for (uint32_t v = 0; v < NVT; v++)
			a[i][v] = CA_V(ot + (c0 + i) * GP + (j + v) * VA_LANES);
	for (uint32_t b = 0; b < nb; b++) {
		VA_T p[2];
		_Pragma("GCC unroll 2")
		for (uint32_t v = 0; v < NVT; v++)
			p[v] = CA_V(st + b * GP + (j + v) * VA_LANES);
		_Pragma("GCC unroll 8")
		for (uint32_t i = 0; i < NC; i++) {
			const VA_T x = SPLATA(vv[b * d + c0 + i]);
			_Pragma("GCC unroll 2")
			for (uint32_t v = 0; v < NVT; v++)
				a[i][v] = FMAA(x, p[v], a[i][v]);
		}
	}
	_Pragma("GCC unroll 8")
	for (uint32_t i = 0; i < NC; i++)
		_Pragma("GCC unroll 2")
		for (uint32_t v = 0; v < NVT; v++)
			CA_V(ot + (c0 + i) * GP + (j + v) * VA_LANES) = a[i][v];
}

static void ISA_FN(attention_causal)(const struct kvr_shape *sh, const void *q_rows, void *out_rows,
				     const struct kvr_kv_segment *segs, uint32_t n_segs, uint32_t m)
{
	const uint32_t G = sh->n_qo_heads / sh->n_kv_heads, d = sh->head_dim, t = sh->elem_type;
	const uint64_t eb = kvr_elem_bytes(t);
	const uint32_t NV = (G + VA_LANES - 1) / VA_LANES; /* head vectors */
	const uint32_t GP = NV * VA_LANES;                 /* padded heads */
	const uint32_t hq = sh->causal_heads_per_query;
	const uint64_t pos0 = sh->causal_first_position, last_pos = pos0 + G / hq - 1;
	/* sized by d and G (at most 164 KiB at d = 256, G = 64; 20 KiB for
	 * SmolLM2) and aligned, so every vector access is one aligned load or
	 * store (unaligned 256-bit ones are split in two under generic tuning,
	 * and a split store read back whole stalls store forwarding) */
	float qt[d * GP] __attribute__((aligned(64))), ot[d * GP] __attribute__((aligned(64)));
	float st[CA_BLOCK * GP] __attribute__((aligned(64)));
	float kf[CA_BLOCK * d] __attribute__((aligned(64))), vv[CA_BLOCK * d] __attribute__((aligned(64)));
	VA_T run_max[KVR_MAX_GROUP_CPU / VA_LANES + 1], run_sum[KVR_MAX_GROUP_CPU / VA_LANES + 1];
	memset(qt, 0, sizeof(qt));
	memset(ot, 0, sizeof(ot));
	for (uint32_t g = 0; g < G; g++)
		for (uint32_t c = 0; c < d; c += VA_LANES) {
			float x[VA_LANES];
			const VA_T v = LOADA(q_rows, t, (uint64_t)(m * G + g) * d + c) * sh->scale;
			memcpy(x, &v, sizeof(v));
			for (uint32_t l = 0; l < VA_LANES; l++)
				qt[(c + l) * GP + g] = x[l];
		}
	for (uint32_t j = 0; j < NV; j++) {
		run_max[j] = SPLATA(-INFINITY);
		run_sum[j] = SPLATA(0.0f);
	}
	uint64_t seg_first_token = 0;
	for (uint32_t si = 0; si < n_segs; si++) {
		const struct kvr_kv_segment *seg = &segs[si];
		const uint64_t seg_tok0 = seg_first_token;
		seg_first_token += seg->n_tokens;
		if (seg_tok0 > last_pos) /* after every query of the block */
			break;
		const uint64_t head_off = (uint64_t)m * seg->head_stride * eb;
		const unsigned char *kb = (const unsigned char *)seg->k + head_off;
		const unsigned char *vb = (const unsigned char *)seg->v + head_off;
		const uint64_t row = (uint64_t)seg->row_stride * eb;
		for (uint32_t t0 = 0; t0 < seg->n_tokens; t0 += CA_BLOCK) {
			const uint32_t nb = seg->n_tokens - t0 < CA_BLOCK ? seg->n_tokens - t0 : CA_BLOCK;
			const uint64_t tok0 = seg_tok0 + t0;
			if (tok0 > last_pos)
				break;
			const uint32_t nbt = (nb + CA_TILE - 1) / CA_TILE * CA_TILE; /* whole token tiles */
			/* the block's rows in f32; a last partial tile's extra rows zero */
			for (uint32_t b = 0; b < nbt; b++)
				for (uint32_t c = 0; c < d; c += VA_LANES) {
					const VA_T k = b < nb ? LOADA(kb + (t0 + b) * row, t, c) : SPLATA(0.0f);
					const VA_T v = b < nb ? LOADA(vb + (t0 + b) * row, t, c) : SPLATA(0.0f);
					CA_V(kf + b * d + c) = k;
					CA_V(vv + b * d + c) = v;
				}
			/* S = K·Q^T, 4 tokens by 2 head vectors at a time (an odd last
			 * vector: 8 tokens of it, or the 4 left) */
			for (uint32_t j = 0; j + 2 <= NV; j += 2)
				for (uint32_t b0 = 0; b0 < nbt; b0 += CA_TILE)
					ISA_FN(ca_scores)(qt, kf, st, d, GP, j, b0, CA_TILE, 2);
			for (uint32_t b0 = 0; NV % 2 && b0 < nbt; b0 += 2 * CA_TILE) {
				if (nbt - b0 >= 2 * CA_TILE)
					ISA_FN(ca_scores)(qt, kf, st, d, GP, NV - 1, b0, 2 * CA_TILE, 1);
				else
					ISA_FN(ca_scores)(qt, kf, st, d, GP, NV - 1, b0, CA_TILE, 1);
			}
			if (tok0 + nb - 1 > pos0) /* the diagonal: no query sees a later token */
				for (uint32_t b = 0; b < nb; b++)
					for (uint32_t g = 0; g < G; g++)
						if (tok0 + b > pos0 + g / hq)
							st[b * GP + g] = -INFINITY;
			/* the online softmax, lane-wise over heads */
			for (uint32_t j = 0; j < NV; j++) {
				VA_T x[CA_BLOCK], bmax = SPLATA(-INFINITY);
				for (uint32_t b = 0; b < nb; b++) {
					x[b] = CA_V(st + b * GP + j * VA_LANES);
					bmax = MAXA(x[b], bmax); /* a NaN score is passed over */
				}
				/* The running max moves only where the block's exceeds it by
				 * more than CA_LAZY_MAX: weights then stay below e^8 ≈ 3000
				 * (no overflow; sums in f32 lose nothing that matters), and
				 * most blocks skip rescaling their outputs. The result is the
				 * same softmax: every weight and sum is relative to one max. */
				typedef int32_t va_int __attribute__((vector_size(sizeof(VA_T))));
				const va_int raise = bmax > run_max[j] + SPLATA(CA_LAZY_MAX);
				const VA_T new_max = (VA_T)(((va_int)bmax & raise) | ((va_int)run_max[j] & ~raise));
				/* a head that has seen nothing yet (max −inf): its weights are
				 * exp(−inf − 0) = 0, not NaN */
				const va_int none = new_max == SPLATA(-INFINITY);
				const VA_T e = (VA_T)((va_int)new_max & ~none);
				int32_t raised[VA_LANES];
				memcpy(raised, &raise, sizeof(raised));
				int rescale = 0;
				for (uint32_t l = 0; l < VA_LANES; l++)
					rescale |= raised[l];
				VA_T psum = SPLATA(0.0f);
				for (uint32_t b = 0; b < nb; b++) {
					x[b] = ATT_EXPA(x[b] - e);
					CA_V(st + b * GP + j * VA_LANES) = x[b];
					psum = psum + x[b];
				}
				if (rescale) {
					/* kvr_softmax_rescale: exp(old − new), 0 when old is −inf;
					 * 1 in the lanes whose max stays */
					const VA_T alpha = ATT_EXPA(run_max[j] - e);
					for (uint32_t c = 0; c < d; c++)
						CA_V(ot + c * GP + j * VA_LANES) = CA_V(ot + c * GP + j * VA_LANES) * alpha;
					run_sum[j] = run_sum[j] * alpha;
				}
				run_sum[j] = run_sum[j] + psum;
				run_max[j] = new_max;
			}
			/* O^T += V^T·P, 4 dimensions by 2 head vectors at a time (an odd
			 * last vector: 8 dimensions of it; d is a multiple of 32) */
			for (uint32_t c0 = 0; c0 < d; c0 += CA_TILE)
				for (uint32_t j = 0; j + 2 <= NV; j += 2)
					ISA_FN(ca_values)(ot, st, vv, d, GP, j, c0, nb, CA_TILE, 2);
			for (uint32_t c0 = 0; NV % 2 && c0 < d; c0 += 2 * CA_TILE)
				ISA_FN(ca_values)(ot, st, vv, d, GP, NV - 1, c0, nb, 2 * CA_TILE, 1);
		}
	}
	float sums[KVR_MAX_GROUP_CPU + VA_LANES];
	for (uint32_t j = 0; j < NV; j++)
		memcpy(sums + j * VA_LANES, &run_sum[j], sizeof(run_sum[j]));
	for (uint32_t g = 0; g < G; g++) {
		/* No tokens: zeros. A NaN anywhere made run_sum NaN: it propagates. */
		float out[256];
		const float inv = sums[g] == 0.0f ? 0.0f : 1.0f / sums[g];
		for (uint32_t c = 0; c < d; c++)
			out[c] = ot[c * GP + g] * inv;
		kvr_convert_from_f32((unsigned char *)out_rows + (uint64_t)(m * G + g) * d * eb, out, t, d);
	}
}
#undef CA_V

static void ISA_FN(attention_head)(const struct kvr_shape *sh, const void *q_rows, void *out_rows,
				   const struct kvr_kv_segment *segs, uint32_t n_segs, uint32_t m, float *lse,
				   qk_dots_fn qk, pv_dots_fn pv)
{
	/* head_dim: a multiple of 32 up to 256 (value_heads relies on it) */
	if ((sh->flags & KVR_SHAPE_CAUSAL) && !lse) {
		int plain = 1;
		for (uint32_t si = 0; si < n_segs; si++)
			plain &= !segs[si].format;
		if (plain) {
			ISA_FN(attention_causal)(sh, q_rows, out_rows, segs, n_segs, m);
			return;
		}
	}
	ISA_FN(attention_impl)(sh, q_rows, out_rows, segs, n_segs, m, lse, sh->head_dim / VA_LANES, qk, pv);
}

#undef ISA_FN
#undef KVR_ISA_FN1
#undef KVR_ISA_FN2
/* the including file's parameters, so the next inclusion defines its own */
#undef ISA
#undef F16TOF32
#undef CODES16
#undef LOAD16
#undef FMA16
#undef HSUM16
#undef SPLAT16
#undef FOLD16
#undef HSUM4
#undef HMAX16
#undef MAX16
#undef FOLD16X16
#undef VA_T
#undef KVR_VA_DEFAULT
#undef VA_LANES
#undef VA_MAX_CHUNKS
#undef VA_V_STRIP
#undef SCORE_PAGE_BLOCK
#undef SCORE_HEAD_BLOCK
#undef LOADA
#undef FMAA
#undef SPLATA
#undef HSUMA
#undef HSUM4A
#undef CODES16A
#undef MAXA
#undef HMAXA
#undef EXPA
#undef ANYGTA
#undef ATT_EXPA
#undef VALUE_SZ16
#undef QMASK_T
#undef QMASK_MAKE
#undef QMASK_GET
#undef QSELECT
#undef PV_CHANNEL
#undef PV_FITS
#undef PV_CENTRE
