/* SPDX-License-Identifier: MIT */
/*
 * kmath.h — the per-element math every backend shares, so that the cpu
 * backend, the CUDA kernels and cudaemu select the same pages bit for bit.
 *
 * Selection is a discrete decision (top-k) on floating-point scores, so two
 * backends agree only if they compute identical scores. Three things make
 * that possible:
 *  1. kvr_expf: the project's own exp, built from fmaf and exact bit
 *     operations only, instead of the libm/CUDA intrinsic (which differ);
 *  2. canonical reduction orders: a dot product over d is accumulated in 16
 *     lanes (lane l takes elements l, l+16, l+32, ... in order) and the lanes
 *     are folded by halves (l += l+8, then +4, +2, +1); a sum over pages is
 *     accumulated in 256 lanes (lane l takes pages l, l+256, ... in order)
 *     folded the same way. An AVX-512 register is 16 lanes, a CUDA block is
 *     256 threads: both run these orders natively;
 *  3. explicit fmaf where a fused multiply-add is meant, plain * and +
 *     elsewhere (compilers must not contract: the build passes
 *     -ffp-contract=off to C and --fmad=false to nvcc).
 *
 * Attention itself is compared with tolerances, not bit-exactly.
 */
#ifndef KVR_LAYOUTS_KMATH_H
#define KVR_LAYOUTS_KMATH_H

#include <math.h>
#include <stdint.h>

#include "half.h"

#define KVR_DOT_LANES 16u  /* lanes of a canonical dot product over d */
#define KVR_SUM_LANES 256u /* lanes of a canonical sum over pages */

/*
 * kvr_expf's reduction and polynomial, written once for the scalar function
 * and every vector form of it (the cpu kernels' exp16, exp8_avx2 and
 * attention's exps), so that they cannot drift apart: with n = rint(x·log2e),
 * r = x − n·ln2 in two fused steps (the high part's product exact), then
 * p(r) ≈ e^r by Horner's rule.
 * FMA(a, b, c) is a fused a·b + c, FNMA(a, b, c) a fused c − a·b, SPLAT(c) the
 * constant in the vector type; r and p are the caller's variables.
 */
#define KVR_EXP_LOG2E 1.44269502f
#define KVR_EXP_POLY(FMA, FNMA, SPLAT, n, x, r, p)                                        \
	do {                                                                              \
		(r) = FNMA((n), SPLAT(0.693145752f), (x));   /* ln2 high part (exact) */   \
		(r) = FNMA((n), SPLAT(1.42860677e-06f), (r)); /* ln2 low part */           \
		(p) = SPLAT(1.38888894e-03f);                  /* 1/720 */                 \
		(p) = FMA((p), (r), SPLAT(8.33333377e-03f));   /* 1/120 */                 \
		(p) = FMA((p), (r), SPLAT(4.16666679e-02f));   /* 1/24 */                  \
		(p) = FMA((p), (r), SPLAT(1.66666672e-01f));   /* 1/6 */                   \
		(p) = FMA((p), (r), SPLAT(0.5f));                                          \
		(p) = FMA((p), (r), SPLAT(1.0f));                                          \
		(p) = FMA((p), (r), SPLAT(1.0f));                                          \
	} while (0)
#define KVR_EXP_FNMAF(a, b, c) fmaf(-(a), (b), (c)) /* negation is exact */
#define KVR_EXP_SCALAR(c) (c)

/*
 * exp(x) in float, max error ~2 ulp over the range used (softmax arguments
 * are <= 0). Overflow gives +inf, underflow 0, NaN propagates. Cody-Waite
 * reduction x = n·ln2 + r, |r| <= ln2/2, then a degree-6 polynomial.
 */
static inline KVR_HD float kvr_expf(float x)
{
	if (x != x)
		return x;
	if (x > 88.7228317f)
		return INFINITY;
	if (x < -103.972084f)
		return 0.0f;
	const float n = rintf(x * KVR_EXP_LOG2E); /* round to nearest even */
	float r, p;
	KVR_EXP_POLY(fmaf, KVR_EXP_FNMAF, KVR_EXP_SCALAR, n, x, r, p);
	/* scale by 2^n in two steps: n spans [-150, 128], one float exponent
	 * spans [-126, 127] */
	int32_t e = (int32_t)n;
	const int32_t e1 = e < -126 ? -126 : (e > 127 ? 127 : e);
	p *= kvr_bits_to_f32((uint32_t)(e1 + 127) << 23);
	e -= e1;
	if (e != 0)
		p *= kvr_bits_to_f32((uint32_t)(e + 127) << 23);
	return p;
}

/* Fold `lanes` partial sums (a power of two) in the canonical order. */
static inline KVR_HD float kvr_fold_lanes(float *acc, uint32_t lanes)
{
	for (uint32_t w = lanes / 2; w >= 1; w /= 2)
		for (uint32_t l = 0; l < w; l++)
			acc[l] = acc[l] + acc[l + w];
	return acc[0];
}

/* Quest's upper bound on q·k for any key k between kmin and kmax, one
 * dimension, added to acc: q times the bound its sign selects (kmin when q's
 * sign bit is set), in one fused multiply-add. For finite bounds with
 * kmin <= kmax that product is the larger of q·kmin and q·kmax; selecting by
 * the sign bit costs a blend where the larger of two products costs two
 * multiplies and a max, and the FMA saves the add. */
static inline KVR_HD float kvr_quest_acc(float acc, float q, float kmin, float kmax)
{
	return fmaf(q, signbit(q) ? kmin : kmax, acc);
}

/* Online softmax state of one query head: running max m, running sum l, and
 * the weighted sum of values in acc (owned by the caller). Rescale factor
 * when the max moves from m_old to m_new. */
static inline KVR_HD float kvr_softmax_rescale(float m_old, float m_new)
{
	return m_old == -INFINITY ? 0.0f : kvr_expf(m_old - m_new);
}

#endif /* KVR_LAYOUTS_KMATH_H */
