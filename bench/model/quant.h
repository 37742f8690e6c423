/* SPDX-License-Identifier: MIT */
/*
 * quant.h — ggml's tensor element types as the real-model runner reads them
 * from a GGUF file: their block layouts, dequantisation to f32, llama.cpp's
 * activation quantisation (Q8_0, Q8_1), and the matrix-vector products of
 * the forward pass (y = W·x over a caller-chosen range of rows).
 *
 * Types and layouts are ggml's (ggml/include/ggml.h `enum ggml_type`,
 * ggml/src/ggml-common.h `block_*`), so a tensor's bytes are used as they lie
 * in the file. Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1,
 * Q4_K, Q5_K, Q6_K, Q8_K. Everything else answers -ENOTSUP.
 *
 * Numerics (what the model's comparison with llama.cpp rests on):
 *  - Dequantisation is exact but for one rounding per element: every
 *    product of a block's f16 scale, sub-block scale and quant fits in f32's
 *    24 bits, so y = q·d (Q4_0, Q5_0, Q8_0, Q6_K) is exact and y = q·d + m
 *    (Q4_1, Q5_1), y = (d·sc)·q − dmin·m (Q4_K, Q5_K) round once, as in
 *    ggml's dequantize_row_*.
 *  - Activations are quantised as llama.cpp does on x86 (AVX2 builds), which
 *    is what the comparison runs: per 32 values d = amax/127, q = x·(127/amax)
 *    rounded to nearest, ties to even, s = d·Σq (Q8_1); d and s stored as f16.
 *    (ggml's portable quantize_row_q8_*_ref differs in the last bit: it uses
 *    x·(1/d) and roundf, ties away from zero.)
 *  - Q4_1·Q8_1 and Q8_0·Q8_0 products take llama.cpp's integer route: per
 *    32-element block an exact integer dot P = Σ q_w·q_x, then one float
 *    block value (see kq_matvec for the exact expressions and the fixed
 *    order in which block values are summed). Every instruction-set path
 *    (scalar, AVX2, AVX-512BW, AVX-512 VNNI) gives the same bits. llama.cpp
 *    sums the same block terms in another order (8 float lanes of partial
 *    dots, each scaled per block, and the m·s terms apart), so a product
 *    agrees with llama.cpp's to f32 rounding (~1e-7 of the sum of the
 *    terms' magnitudes), not bit for bit.
 *  - Q4_K, Q5_K and Q6_K take llama.cpp's route too: the activation
 *    quantised to Q8_K (per 256 values d = max/-127 of the value of largest
 *    magnitude, q = nearest(x/d) clamped to 127, the sums of each 16 quants
 *    kept), exact integer dots per 32 (Q4_K, Q5_K) or 16 (Q6_K) elements
 *    times the 6- or 8-bit sub-block scale, and per super-block
 *    y += d_w·d_x·Σ_int − dmin_w·d_x·Σ(min·bsum) in f32 (one path; the order
 *    of llama.cpp's float sums differs, so agreement is to f32 rounding).
 *  - The other types are dequantised and dotted with an f32 activation in
 *    double precision (correct, not fast: no file the runner targets has them
 *    in bulk).
 *
 * Threads: every function is pure over its arguments (any thread, any number
 * at once), except kq_isa_force, which changes the path all threads take
 * next and is meant for tests and benchmarks run before the work starts.
 */
#ifndef KVR_MODEL_QUANT_H
#define KVR_MODEL_QUANT_H

#include <stddef.h>
#include <stdint.h>

/* ggml_type ids (ggml.h), the values stored in a GGUF tensor's info */
enum kq_type {
	KQ_TYPE_F32 = 0,
	KQ_TYPE_F16 = 1,
	KQ_TYPE_Q4_0 = 2,
	KQ_TYPE_Q4_1 = 3,
	KQ_TYPE_Q5_0 = 6,
	KQ_TYPE_Q5_1 = 7,
	KQ_TYPE_Q8_0 = 8,
	KQ_TYPE_Q8_1 = 9,
	KQ_TYPE_Q4_K = 12,
	KQ_TYPE_Q5_K = 13,
	KQ_TYPE_Q6_K = 14,
	KQ_TYPE_Q8_K = 15, /* activations of the K-quants only */
	KQ_TYPE_BF16 = 30,
};

/* Block sizes (ggml-common.h): elements and bytes per block */
#define KQ_QK 32u         /* Q4_0 .. Q8_1 */
#define KQ_QK_K 256u      /* Q4_K, Q5_K, Q6_K super-blocks */
#define KQ_Q4_0_BYTES 18u /* d, qs[16] */
#define KQ_Q4_1_BYTES 20u /* d, m, qs[16] */
#define KQ_Q5_0_BYTES 22u /* d, qh[4], qs[16] */
#define KQ_Q5_1_BYTES 24u /* d, m, qh[4], qs[16] */
#define KQ_Q8_0_BYTES 34u /* d, qs[32] */
#define KQ_Q8_1_BYTES 36u /* d, s, qs[32] */
#define KQ_Q4_K_BYTES 144u /* d, dmin, scales[12], qs[128] */
#define KQ_Q5_K_BYTES 176u /* d, dmin, scales[12], qh[32], qs[128] */
#define KQ_Q6_K_BYTES 210u /* ql[128], qh[64], scales[16], d */
#define KQ_Q8_K_BYTES 292u /* d (f32), qs[256], bsums[16] (int16: sums of 16 quants) */

/* Elements per block (1 for F32/F16/BF16); 0 for an unsupported type. */
uint32_t kq_block_elems(uint32_t type);
/* Bytes per block; 0 for an unsupported type. */
uint32_t kq_block_bytes(uint32_t type);
/* ggml's name of the type ("q4_1"), "?" when unsupported. */
const char *kq_type_name(uint32_t type);

/* Bytes of a row of n elements into *bytes: 0, -ENOTSUP for an unsupported
 * type, -EINVAL when n is not a whole number of blocks or the size overflows. */
int kq_row_bytes(uint32_t type, uint64_t n, uint64_t *bytes);

/* dst[0..n) = the n elements at src. 0, -ENOTSUP, or -EINVAL (n not a whole
 * number of blocks, NULL pointer with n > 0). Q4_1 and Q8_0 take the
 * vectorised path; every path gives the same bits. */
int kq_dequantize_row(uint32_t type, const void *src, float *dst, uint64_t n);

/* llama.cpp's activation quantisation (x86 numerics, above) of x[0..n) into
 * n/32 blocks at dst. n must be a multiple of 32 (else -EINVAL). Quants lie
 * in [-127, 127]; a block holding a NaN or infinity gets unspecified quants
 * (no undefined behaviour). */
int kq_quantize_row_q8_0(const float *x, void *dst, uint64_t n);
int kq_quantize_row_q8_1(const float *x, void *dst, uint64_t n);
/* llama.cpp's Q8_K (quantize_row_q8_K_ref): n a multiple of 256. */
int kq_quantize_row_q8_k(const float *x, void *dst, uint64_t n);

/* The activation a matrix of this weight type multiplies: KQ_TYPE_Q8_1 for
 * Q4_1, KQ_TYPE_Q8_0 for Q8_0, KQ_TYPE_Q8_K for Q4_K/Q5_K/Q6_K, KQ_TYPE_F32
 * for the other supported types; -ENOTSUP otherwise (Q8_1, Q8_K). */
int kq_matvec_act_type(uint32_t type);

/*
 * y[r] = W[r,:]·x for r in [row_begin, row_end): W is `rows` rows of `cols`
 * elements of `type`, row r at w + r·row_bytes (row_bytes >= the packed row
 * size, so a row may be padded); y is indexed by absolute row, so threads
 * splitting the rows share one y. x is x_q (the blocks of
 * kq_matvec_act_type(type)) for Q4_1, Q8_0 and the K-quants, x_f32 (cols
 * floats) for the others; the unused one may be NULL. Returns 0, -ENOTSUP (type), or
 * -EINVAL (a needed pointer NULL, cols not whole blocks, row_bytes too small,
 * row_begin > row_end or row_end > rows); y is untouched on error.
 *
 * Numerics, identical on every instruction-set path. Per 32-element block b
 * (f16 fields widened to f32 exactly; P_b the exact integer dot of quants):
 *   Q4_1 · Q8_1: r_b = fmaf(d_w·d_x, (float)P_b, m_w·s_x)   (products exact)
 *                A[b mod 16] += r_b
 *   Q8_0 · Q8_0: A[b mod 16] = fmaf(d_w·d_x, (float)P_b, A[b mod 16])
 * with A[0..16) = +0 at the start and blocks taken in increasing b; then
 * y[r] = the fold of A by halves (A[l] += A[l+8] for l < 8, then +4, +2, +1;
 * kmath.h's canonical order). P_b is exact for every Q4_1 input and for Q8_0
 * activations in [-127, 127] (what kq_quantize_row_q8_0 produces; weights
 * may be -128): the vector paths multiply |q_w| by q_x carrying w's sign,
 * which wraps for q_x = -128, so such an activation gives path-dependent
 * garbage.
 * Other types: y[r] = (float)(Σ_j (double)w_j·(double)x_j), j increasing.
 *
 * Uses about 15 KiB of the caller's stack (the prepared activation and the
 * accumulators of 64 rows); no heap, no locks: threads splitting the rows of
 * one product may call it at once.
 */
int kq_matvec(uint32_t type, const void *w, uint64_t row_bytes, uint64_t rows, uint64_t cols,
	      const void *x_q, const float *x_f32, float *y, uint64_t row_begin,
	      uint64_t row_end);

/*
 * Y = W·X for n activation rows at once (a prefill chunk): row t of X is
 * x_q + t·x_q_stride bytes (Q4_1, Q8_0) or x_f32 + t·x_f32_stride floats (the
 * other types), and y_t[r] = y[t·y_stride + r] for r in [row_begin,
 * row_end). Every y_t is bit for bit what kq_matvec gives for row t alone,
 * on every path. Q4_1 and Q8_0 on the vector paths unpack each weight row
 * once for all n rows (the AVX2 instructions serve the AVX-512 paths too:
 * per token the work is then maddubs-bound either way); other types and the
 * scalar path call kq_matvec per row.
 *
 * workspace: kq_matmul_workspace_bytes(type, cols, n) bytes of the caller's
 * (any alignment; 0 bytes needed, and NULL accepted, for the types that do
 * not use it); threads splitting rows need one each. Returns 0, or
 * kq_matvec's errors, and -EINVAL for a short workspace or y_stride < row_end;
 * on a Q4_1/Q8_0 error nothing is written.
 */
size_t kq_matmul_workspace_bytes(uint32_t type, uint64_t cols, uint32_t n);
int kq_matmul(uint32_t type, const void *w, uint64_t row_bytes, uint64_t rows, uint64_t cols,
	      const void *x_q, size_t x_q_stride, const float *x_f32, size_t x_f32_stride, uint32_t n,
	      float *y, size_t y_stride, uint64_t row_begin, uint64_t row_end, void *workspace,
	      size_t workspace_bytes);

/* Instruction-set paths of the quantised kernels. */
enum kq_isa {
	KQ_ISA_SCALAR = 0,     /* plain C: the reference */
	KQ_ISA_AVX2 = 1,       /* AVX2 + FMA + F16C: maddubs/madd */
	KQ_ISA_AVX512BW = 2,   /* AVX-512 F/BW/VL/DQ + FMA + F16C: maddubs/madd */
	KQ_ISA_AVX512VNNI = 3, /* the above + AVX-512 VNNI: vpdpbusd */
	KQ_ISA_COUNT = 4,
};

/* Whether this CPU (and OS) can run the path. */
int kq_isa_supported(enum kq_isa isa);
/* The path in use: KQ_ISA (scalar | avx2 | avx512 | avx512bw | avx512vnni;
 * "avx512" = the best AVX-512 path) when set and supported, else the best
 * supported one. Decided on first use; kq_isa_force changes it. */
enum kq_isa kq_isa_active(void);
/* Use `isa` from now on (tests, benchmarks): 0, or -ENOTSUP when the CPU
 * lacks it (the path in use is kept). */
int kq_isa_force(enum kq_isa isa);
/* "scalar", "avx2", "avx512bw", "avx512vnni" ("?" out of range) */
const char *kq_isa_name(enum kq_isa isa);

#endif /* KVR_MODEL_QUANT_H */
