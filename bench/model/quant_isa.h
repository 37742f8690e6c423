/* SPDX-License-Identifier: MIT */
/*
 * quant_isa.h — the AVX-512 Q4_1·Q8_1 and Q8_0·Q8_0 row products and the
 * Q4_1 / Q8_0 dequantisation, written once and compiled by quant.c twice,
 * under target pragmas: for AVX-512BW (maddubs + madd) and for AVX-512 VNNI
 * (vpdpbusd). The including file defines ISA (a name suffix) and
 *   DOT4(acc, u, s)          acc + the sums of 4 adjacent u8·s8 products per
 *                            int32 lane (exact in both forms: see quant.c)
 *   DOT_LOHI(u1, s1, u2, s2) DOT4(DOT4(0, u1, s1), u2, s2) for Q4_1's nibbles
 *                            (0..15: the BW form adds the two halves in int16)
 * and declares struct kq_act (the prepared activation) and h_f16c.
 *
 * The shape of the work follows what is cheap on the machines we run on
 * (Zen 4): gathers are slow, 512-bit shuffles go through one port, and most
 * of the model's rows are short (576 columns, 18 blocks). The unit is a
 * "quad tile": 4 rows x 4 consecutive blocks, 16 block dots in one register.
 *  - Q4_1: two plain 64-byte loads cover a row's 4 blocks (80 bytes); one
 *    16-bit permute (vpermt2w: every qs starts at an even offset) packs their
 *    4 x 16 quant bytes, and the first load carries the 4 (d, m) dwords.
 *  - Q8_0: 4 blocks (136 bytes) give two registers, their first and last 16
 *    quants, each from two loads and one vpermt2w; |w| and x·sign(w) (AVX-512
 *    has no vpsignb). The scales come from the same loads.
 *  - The activation was laid out to match (quant.c): one register of first
 *    halves and one of last halves per 4 blocks, loaded once for the 4 rows,
 *    so a row's register of 4 blocks x 4 partial sums takes two dots; the 16
 *    sums come out of the 4 rows' registers in 2 levels of shuffles.
 *  - Block values go to 4 accumulators per 4 rows (accumulator j, lane 4g+k:
 *    row g's canonical lane 4j+k), transposed from and back to the rows'
 *    16-lane accumulators once per tile of rows.
 *  - A row's last partial quad, and a last tile of fewer than 4 rows, use
 *    masked loads (which do not fault past the row) and a masked accumulate,
 *    so absent blocks and rows change no lane.
 *
 * The results follow quant.h's numerics bit for bit (exact integer dots; one
 * FMA of exact operands per block; block b of a row in its lane b mod 16, in
 * increasing b), the scalar reference's bits on every path.
 *
 * Threads: pure functions of their arguments; any thread.
 */

#define KQ_ISA_FN2(name, isa) name##_##isa
#define KQ_ISA_FN1(name, isa) KQ_ISA_FN2(name, isa)
#define ISA_FN(name) KQ_ISA_FN1(name, ISA)

/* Rows ahead whose bytes are prefetched (into L2: into L1 they evict what is
 * in use): a tile reads 4 rows side by side, which the hardware's stream
 * prefetchers follow less well than one row; measured on Zen 4, the 30 MB
 * logit matrix streams ~1.5x faster with them. Prefetches past the matrix's
 * end are harmless hints. */
#define KQ_PREFETCH_ROWS 16

/* bytes valid of a 64-byte load -> its byte mask */
static inline __mmask64 ISA_FN(mask_bytes)(int64_t n)
{
	return n >= 64 ? ~(__mmask64)0 : n <= 0 ? 0 : (((__mmask64)1 << n) - 1);
}

/*
 * The 16 sums of a quad tile from its 4 row registers: p[g]'s 128-bit lane k
 * holds (row g, block k)'s four partial sums. Two levels of pairwise adds
 * (integers: the pairing is free) leave lane 4k+g; a permute moves it to
 * lane 4g+k. Converted to f32: exact, every |sum| < 2^24.
 */
static inline __attribute__((always_inline)) __m512 ISA_FN(quad_sums)(const __m512i *p)
{
	const __m512 p0 = _mm512_castsi512_ps(p[0]), p1 = _mm512_castsi512_ps(p[1]);
	const __m512 p2 = _mm512_castsi512_ps(p[2]), p3 = _mm512_castsi512_ps(p[3]);
	const __m512i u01 = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(p0, p1, 0x88)),
					     _mm512_castps_si512(_mm512_shuffle_ps(p0, p1, 0xdd)));
	const __m512i u23 = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(p2, p3, 0x88)),
					     _mm512_castps_si512(_mm512_shuffle_ps(p2, p3, 0xdd)));
	const __m512 v01 = _mm512_castsi512_ps(u01), v23 = _mm512_castsi512_ps(u23);
	const __m512i s = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(v01, v23, 0x88)),
					   _mm512_castps_si512(_mm512_shuffle_ps(v01, v23, 0xdd)));
	const __m512i sidx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
	return _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(sidx, s));
}

/* lanes 4g+k with k < nv, for every g */
static inline __mmask16 ISA_FN(quad_mask)(unsigned nv)
{
	return (__mmask16)(((1u << nv) - 1) * 0x1111u);
}

/* Row g's blocks from b of a quad tile, after a prefetch of `lines` cache
 * lines of the row KQ_PREFETCH_ROWS below (an address that may be past the
 * end: prefetches do not fault). */
static inline __attribute__((always_inline)) const uint8_t *
ISA_FN(quad_row)(const uint8_t *w, uint64_t row_bytes, unsigned g, uint64_t b, unsigned block_bytes,
		 unsigned lines)
{
	const uint8_t *wq = w + g * row_bytes + b * block_bytes;
	const uintptr_t ahead = (uintptr_t)wq + KQ_PREFETCH_ROWS * row_bytes;
	for (unsigned i = 0; i < lines; i++)
		_mm_prefetch((const char *)(ahead + 64 * i), _MM_HINT_T1);
	return wq;
}

/*
 * A quad tile of Q4_1: rows w + g·row_bytes (g < nr), blocks [b, b + nv) of
 * the chunk, against the prepared activation: r = fma(d_w·d_x, P, m_w·s_x)
 * added to acc lane 4g+k for (row g, block b+k).
 */
static inline __attribute__((always_inline)) __m512
ISA_FN(quad_q4_1)(const uint8_t *w, uint64_t row_bytes, const struct kq_act *xa, uint64_t b, unsigned nv,
		  unsigned nr, __m512 acc)
{
	/* block k of the quad: qs at bytes 20k+4.., i.e. words 10k+2..10k+9;
	 * block 3's (bytes 64-79) are words 24-31 of the load at +16 */
	const __m512i qidx = _mm512_setr_epi32(0x00030002, 0x00050004, 0x00070006, 0x00090008,
					       0x000d000c, 0x000f000e, 0x00110010, 0x00130012,
					       0x00170016, 0x00190018, 0x001b001a, 0x001d001c,
					       0x00390038, 0x003b003a, 0x003d003c, 0x003f003e);
	const __m512i nib = _mm512_set1_epi8(0x0f);
	const int8_t *xq = xa->q + b * KQ_QK;
	const __m512i xl = _mm512_load_si512(xq), xh = _mm512_load_si512(xq + 64);
	__m512i p[4], l[4];
	_Pragma("GCC unroll 4")
	for (unsigned g = 0; g < 4; g++) {
		if (g >= nr) {
			p[g] = l[g] = _mm512_setzero_si512();
			continue;
		}
		const uint8_t *wq = ISA_FN(quad_row)(w, row_bytes, g, b, KQ_Q4_1_BYTES, 2);
		__m512i lo, hi;
		if (nv >= 4) {
			lo = _mm512_loadu_si512(wq);
			hi = _mm512_loadu_si512(wq + 16);
		} else {
			const int64_t bytes = (int64_t)nv * KQ_Q4_1_BYTES;
			lo = _mm512_maskz_loadu_epi8(ISA_FN(mask_bytes)(bytes), wq);
			hi = _mm512_maskz_loadu_epi8(ISA_FN(mask_bytes)(bytes - 16), wq + 16);
		}
		l[g] = lo;
		const __m512i q = _mm512_permutex2var_epi16(lo, qidx, hi);
		p[g] = DOT_LOHI(_mm512_and_si512(q, nib), xl, _mm512_and_si512(_mm512_srli_epi16(q, 4), nib), xh);
	}
	const __m512 pf = ISA_FN(quad_sums)(p);
	/* (d, m) dwords: dwords 0, 5, 10, 15 of each row's first load */
	const __m512i didx = _mm512_setr_epi32(0, 5, 10, 15, 16, 21, 26, 31, 0, 5, 10, 15, 16, 21, 26, 31);
	const __m512i dm = _mm512_mask_blend_epi32(0xff00, _mm512_permutex2var_epi32(l[0], didx, l[1]),
						   _mm512_permutex2var_epi32(l[2], didx, l[3]));
	const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
	const __m512 mw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
	const __m512 dx = _mm512_broadcast_f32x4(_mm_load_ps(xa->d + b));
	const __m512 sx = _mm512_broadcast_f32x4(_mm_load_ps(xa->s + b));
	/* d_w·d_x and m_w·s_x are exact (f16 x f16 fits f32) */
	const __m512 r = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), pf, _mm512_mul_ps(mw, sx));
	if (nv >= 4)
		return _mm512_add_ps(acc, r);
	return _mm512_mask_add_ps(acc, ISA_FN(quad_mask)(nv), acc, r);
}

/* |w| and x with w's sign, then the dot: exact for x != -128 (quant.h) */
#define KQ_SIGNED_DOT(acc, wv, xv) \
	DOT4(acc, _mm512_abs_epi8(wv), \
	     _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), xv))

/* A quad tile of Q8_0, as quad_q4_1: acc lane 4g+k = fma(d_w·d_x, P, lane). */
static inline __attribute__((always_inline)) __m512
ISA_FN(quad_q8_0)(const uint8_t *w, uint64_t row_bytes, const struct kq_act *xa, uint64_t b, unsigned nv,
		  unsigned nr, __m512 acc)
{
	/* first halves: block k's bytes 34k+2.. = words 17k+1..17k+8 of the quad,
	 * from the loads at +0 (words 0-31) and +64 (32-63); last halves: words
	 * 17k+9..17k+16, from the loads at +8 (words 4-35) and +72 (36-67) */
	const __m512i idx1 = _mm512_setr_epi32(0x00020001, 0x00040003, 0x00060005, 0x00080007,
					       0x00130012, 0x00150014, 0x00170016, 0x00190018,
					       0x00240023, 0x00260025, 0x00280027, 0x002a0029,
					       0x00350034, 0x00370036, 0x00390038, 0x003b003a);
	const __m512i idx2 = _mm512_setr_epi32(0x00060005, 0x00080007, 0x000a0009, 0x000c000b,
					       0x00170016, 0x00190018, 0x001b001a, 0x001d001c,
					       0x00280027, 0x002a0029, 0x002c002b, 0x002e002d,
					       0x00390038, 0x003b003a, 0x003d003c, 0x003f003e);
	/* the scales: words 0, 17 of the load at +0 and 2, 19 of the one at +64 */
	const __m512i didx = _mm512_set1_epi64((int64_t)0x0033002200110000ull);
	const int8_t *xq = xa->q + b * KQ_QK;
	const __m512i xl = _mm512_load_si512(xq), xh = _mm512_load_si512(xq + 64);
	__m512i p[4];
	__m512i d16 = _mm512_setzero_si512();
	_Pragma("GCC unroll 4")
	for (unsigned g = 0; g < 4; g++) {
		if (g >= nr) {
			p[g] = _mm512_setzero_si512();
			continue;
		}
		const uint8_t *wq = ISA_FN(quad_row)(w, row_bytes, g, b, KQ_Q8_0_BYTES, 3);
		__m512i a0, a64, a8, a72;
		if (nv >= 4) {
			a0 = _mm512_loadu_si512(wq);
			a64 = _mm512_loadu_si512(wq + 64);
			a8 = _mm512_loadu_si512(wq + 8);
			a72 = _mm512_loadu_si512(wq + 72);
		} else {
			const int64_t bytes = (int64_t)nv * KQ_Q8_0_BYTES;
			a0 = _mm512_maskz_loadu_epi8(ISA_FN(mask_bytes)(bytes), wq);
			a64 = _mm512_maskz_loadu_epi8(ISA_FN(mask_bytes)(bytes - 64), wq + 64);
			a8 = _mm512_maskz_loadu_epi8(ISA_FN(mask_bytes)(bytes - 8), wq + 8);
			a72 = _mm512_maskz_loadu_epi8(ISA_FN(mask_bytes)(bytes - 72), wq + 72);
		}
		const __m512i w1 = _mm512_permutex2var_epi16(a0, idx1, a64);
		const __m512i w2 = _mm512_permutex2var_epi16(a8, idx2, a72);
		p[g] = KQ_SIGNED_DOT(KQ_SIGNED_DOT(_mm512_setzero_si512(), w1, xl), w2, xh);
		d16 = _mm512_mask_blend_epi16((__mmask32)(0xfu << (4 * g)), d16,
					      _mm512_permutex2var_epi16(a0, didx, a64));
	}
	const __m512 pf = ISA_FN(quad_sums)(p);
	const __m512 dd = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(d16)),
					_mm512_broadcast_f32x4(_mm_load_ps(xa->d + b)));
	if (nv >= 4)
		return _mm512_fmadd_ps(dd, pf, acc);
	return _mm512_mask3_fmadd_ps(dd, pf, acc, ISA_FN(quad_mask)(nv));
}
#undef KQ_SIGNED_DOT

/* The 4x4 transpose of 128-bit lanes: a row tile's 4 row accumulators
 * (canonical lanes 4j+k in lane j) <-> the quad accumulators (acc j, lane
 * 4g+k); its own inverse. */
static inline __attribute__((always_inline)) void ISA_FN(transpose4)(__m512 *v)
{
	const __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_f32x4(v[0], v[1], 0xee);
	const __m512 t2 = _mm512_shuffle_f32x4(v[2], v[3], 0x44), t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xee);
	v[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
	v[1] = _mm512_shuffle_f32x4(t0, t2, 0xdd);
	v[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
	v[3] = _mm512_shuffle_f32x4(t1, t3, 0xdd);
}

/*
 * y[g] = the canonical fold of row g's 16 lanes, from the quad accumulators
 * (acc j, lane 4g+k: canonical lane 4j+k): lane l += lane l+8 is a[0] + a[2]
 * and a[1] + a[3], l += l+4 their sum, then l += l+2 and l += l+1 within each
 * 128-bit lane; the same additions as kvr_fold_lanes, in the same order.
 */
static inline __attribute__((always_inline)) void ISA_FN(fold4)(const __m512 *a, float *y, unsigned nr)
{
	__m512 s = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
	s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xee));
	s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x55));
	const __m128 r = _mm512_castps512_ps128(
		_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), s));
	_mm_mask_storeu_ps(y, (__mmask8)((1u << nr) - 1), r);
}

/*
 * Rows [0, nr) (nr <= 4) at w over the chunk's nb blocks: their 16-lane
 * accumulators start at +0 (first) or continue from acc (row g at acc + 16g);
 * at the end they are folded into y[0..nr) (y not NULL: the last chunk) or
 * stored back to acc. QUAD is quad_q4_1 or quad_q8_0.
 */
#define KQ_TILE_BODY(QUAD)                                                                      \
	__m512 a[4];                                                                              \
	_Pragma("GCC unroll 4")                                                                   \
	for (unsigned g = 0; g < 4; g++)                                                          \
		a[g] = !first && g < nr ? _mm512_loadu_ps(acc + 16 * g) : _mm512_setzero_ps();    \
	if (!first)                                                                               \
		ISA_FN(transpose4)(a);                                                            \
	uint64_t b = 0;                                                                           \
	for (; b + 16 <= nb; b += 16) {                                                           \
		a[0] = QUAD(w, row_bytes, xa, b, 4, nr, a[0]);                                    \
		a[1] = QUAD(w, row_bytes, xa, b + 4, 4, nr, a[1]);                                \
		a[2] = QUAD(w, row_bytes, xa, b + 8, 4, nr, a[2]);                                \
		a[3] = QUAD(w, row_bytes, xa, b + 12, 4, nr, a[3]);                               \
	}                                                                                         \
	const uint64_t rem = nb - b; /* < 16: quads of the last partial group */                \
	if (rem > 0)                                                                              \
		a[0] = QUAD(w, row_bytes, xa, b, rem < 4 ? (unsigned)rem : 4, nr, a[0]);          \
	if (rem > 4)                                                                              \
		a[1] = QUAD(w, row_bytes, xa, b + 4, rem < 8 ? (unsigned)rem - 4 : 4, nr, a[1]);  \
	if (rem > 8)                                                                              \
		a[2] = QUAD(w, row_bytes, xa, b + 8, rem < 12 ? (unsigned)rem - 8 : 4, nr, a[2]); \
	if (rem > 12)                                                                             \
		a[3] = QUAD(w, row_bytes, xa, b + 12, (unsigned)rem - 12, nr, a[3]);              \
	if (y) {                                                                                  \
		ISA_FN(fold4)(a, y, nr);                                                          \
	} else {                                                                                  \
		ISA_FN(transpose4)(a);                                                            \
		_Pragma("GCC unroll 4")                                                           \
		for (unsigned g = 0; g < nr; g++)                                                 \
			_mm512_storeu_ps(acc + 16 * g, a[g]);                                     \
	}

static inline __attribute__((always_inline)) void
ISA_FN(tile_q4_1)(const uint8_t *w, uint64_t row_bytes, const struct kq_act *xa, uint64_t nb, float *acc,
		  unsigned nr, bool first, float *y)
{
	KQ_TILE_BODY(ISA_FN(quad_q4_1))
}

static inline __attribute__((always_inline)) void
ISA_FN(tile_q8_0)(const uint8_t *w, uint64_t row_bytes, const struct kq_act *xa, uint64_t nb, float *acc,
		  unsigned nr, bool first, float *y)
{
	KQ_TILE_BODY(ISA_FN(quad_q8_0))
}
#undef KQ_TILE_BODY

/* Rows [0, nrows) of the chunk (quant.c's matvec_int: the row functions'
 * contract) in tiles of 4. */
static void ISA_FN(rows_q4_1)(const uint8_t *w, uint64_t row_bytes, const struct kq_act *xa, uint64_t nb,
			      float *acc, uint64_t nrows, bool first, float *y)
{
	uint64_t r = 0;
	for (; r + 4 <= nrows; r += 4)
		ISA_FN(tile_q4_1)(w + r * row_bytes, row_bytes, xa, nb, acc + 16 * r, 4, first, y ? y + r : NULL);
	if (r < nrows)
		ISA_FN(tile_q4_1)(w + r * row_bytes, row_bytes, xa, nb, acc + 16 * r, (unsigned)(nrows - r), first,
				  y ? y + r : NULL);
}

static void ISA_FN(rows_q8_0)(const uint8_t *w, uint64_t row_bytes, const struct kq_act *xa, uint64_t nb,
			      float *acc, uint64_t nrows, bool first, float *y)
{
	uint64_t r = 0;
	for (; r + 4 <= nrows; r += 4)
		ISA_FN(tile_q8_0)(w + r * row_bytes, row_bytes, xa, nb, acc + 16 * r, 4, first, y ? y + r : NULL);
	if (r < nrows)
		ISA_FN(tile_q8_0)(w + r * row_bytes, row_bytes, xa, nb, acc + 16 * r, (unsigned)(nrows - r), first,
				  y ? y + r : NULL);
}

static void ISA_FN(dequant_q4_1)(const uint8_t *s, float *y, uint64_t nb)
{
	for (uint64_t b = 0; b < nb; b++, s += KQ_Q4_1_BYTES, y += KQ_QK) {
		const __m512 d = _mm512_set1_ps(h_f16c(s)), m = _mm512_set1_ps(h_f16c(s + 2));
		const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(s + 4)));
		const __m512i lo = _mm512_and_si512(q, _mm512_set1_epi32(0x0f)), hi = _mm512_srli_epi32(q, 4);
		/* q·d is exact, so the fused and the unfused forms agree */
		_mm512_storeu_ps(y, _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d, m));
		_mm512_storeu_ps(y + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d, m));
	}
}

static void ISA_FN(dequant_q8_0)(const uint8_t *s, float *y, uint64_t nb)
{
	for (uint64_t b = 0; b < nb; b++, s += KQ_Q8_0_BYTES, y += KQ_QK) {
		const __m512 d = _mm512_set1_ps(h_f16c(s));
		for (int k = 0; k < 2; k++) {
			const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(s + 2 + 16 * k)));
			_mm512_storeu_ps(y + 16 * k, _mm512_mul_ps(_mm512_cvtepi32_ps(v), d));
		}
	}
}

#undef ISA_FN
#undef KQ_ISA_FN1
#undef KQ_ISA_FN2
