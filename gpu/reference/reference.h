/* SPDX-License-Identifier: MIT */
/*
 * reference.h — the conformance suite's scalar reference for the kernels of
 * gpu/kernels.h, written from that header's semantics and independently of
 * the kernels: it uses no kmath.h (no kvr_expf, no canonical lane orders), no
 * transpose.h and no convert.c. The numeric kernels are computed in double
 * with libm's exp, so what is left of a comparison is the kernel's own float
 * error; copies and selection are exact. Elements are read and written with
 * half.h's scalar conversions (tested on their own by test_convert.c).
 *
 * Items are the kernels' own structs holding host pointers. Copy-like
 * references (scatter, offload, summarize, select) write through the item's
 * output pointers exactly as the kernel would; numeric references (score,
 * similarity, attention, dense) return doubles for a toleranced comparison.
 *
 * The tolerances the suite applies are defined here, in one place, with the
 * reasoning behind each.
 */
#ifndef KVR_GPU_REFERENCE_H
#define KVR_GPU_REFERENCE_H

#include <stdint.h>

#include "kernels.h"

/* ---- tolerances ----
 *
 * score: q and the summaries widen to float exactly, so kernel and reference
 * see the same inputs and the output is f32 whatever the element type. The
 * kernel's float logits carry an absolute error of a few ulp of the partial
 * sums (~1e-6 for |logit| <= 10); exp turns that into a relative error of the
 * same size, and the sum and the group mean add a few ulp. 1e-4 relative is
 * ~100x that, yet far below what any change of formula does (a missing scale,
 * softmax over the wrong axis, a dropped or extra candidate). Scores below
 * REF_SCORE_ABS_TOL are near float's subnormal range, where relative error
 * is meaningless. Identity between backends is checked bit for bit apart
 * from this (selection depends on it).
 */
#define REF_SCORE_REL_TOL 1e-4
#define REF_SCORE_ABS_TOL 1e-30

/* similarity: cosines lie in [-1, 1] and the kernel's float dot products and
 * norms are off by a few ulp of d terms (~1e-6 at d = 256); the corrected
 * flag is checked exactly wherever the reference cosine is more than this
 * from tau (inside the band the float rounding may fall either way). */
#define REF_COSINE_TOL 1e-5

/*
 * attention and dense: per query head, |got - ref| <= bound, with
 *   bound = (tol(dtype) + REF_LOGIT_ERR * logit_mag) * v_mag
 * v_mag: the largest |v| over the tokens the head attends to (the output is a
 * convex combination of those rows, so this is its natural unit and is never
 * near 0 the way the output itself can be). Inputs are exact in both; the
 * error is the kernel's float softmax and the rounding of the output:
 *  - rounding to the element type: half an ulp, 2^-11 of the value for f16,
 *    2^-8 for bf16;
 *  - the float softmax over a few hundred tokens (kvr_expf's 2 ulp, sums):
 *    ~1e-6;
 *  - the logits: a float dot product is good to a few ulp of its largest
 *    partial sums, logit_mag = max over tokens of scale·Σ_c |q_c·k_c|, and an
 *    error δ in a logit moves the output by up to δ·v_mag. REF_LOGIT_ERR =
 *    8 ulp of 2^-24: negligible at ordinary logits (|logit| < 10), and what
 *    keeps logits in the hundreds (seen: 1.4e-5 at logit_mag ~200) inside.
 * So tol(dtype) =
 *   f32  2e-5  (~10x the float error measured on cpu and cudaemu)
 *   f16  1e-3  (2^-11 = 4.9e-4, plus float error, with margin)
 *   bf16 5e-3  (2^-8  = 3.9e-3, plus float error, with margin)
 * A dropped token, a wrong stride, swapped K and V or a missing online-softmax
 * rescale move outputs by 1e-2 .. 1 of v_mag: f32 catches them with three
 * orders of magnitude to spare, f16 and bf16 catch all but the subtlest.
 */
#define REF_LOGIT_ERR (8.0 * 0x1p-24)

/*
 * Quantised pages (K8V4, K4V2: kvquant.h) have a contract of their own for
 * their keys: the logits are those of the query row rounded to 8 bits
 * (kvr_quant_query_row), which the reference computes too, so what is left
 * is float error as above, its magnitude taken over the kernels' terms
 * s_q·s·Σ r·Q and s_q·z·Σ r as well (they may cancel). Their values may
 * be read with the weights rounded too: in each block of 16 consecutive
 * tokens of a segment (from its first token), a head's weights w = p·s (p
 * the softmax weight, s the token's value scale) may be rounded to wb bits
 * against the block's largest, an error of up to max w / (2·(2^wb − 1)) per
 * token (none for the largest, whose rounded integer is exact: the float
 * error of its scale back is inside tol(dtype)); the codes are
 * summed centred (Q − 2^(vb−1), the zero point moved to match), so a
 * head's outputs may move by up to
 *     qv_err = Σ_blocks (max w / (2·(2^wb − 1)))·(n − 1)·2^(vb − 1) / Σ p
 * (n the block's tokens, vb the value bits) on top of the float bound. wb
 * is the path's, per value width: 16 where the ISA multiplies 16-bit
 * weights into bytes (AVX-512 VNNI; the float paths are inside that too),
 * 8 for 2-bit values on AVX2, whose byte multiply-adds take 8-bit weights
 * (ref_set_value_weight_bits; 16 until set). One code step of a key or a
 * value moves the outputs by more than the bound (the planted-error test
 * checks it at f32).
 */
void ref_set_value_weight_bits(uint32_t value_bits, uint32_t wb);
double ref_attention_tol(uint32_t elem_type);

/* What a head's bound scales with (computed by the reference). */
struct ref_head_scale {
	double v_mag;     /* largest finite |v| attended to; 0 when no token */
	double logit_mag; /* largest scale·Σ_c |q_c·k_c| over the tokens */
	double qv_err;    /* the rounding of quantised values' weights (above); 0 without */
};

/* The allowed absolute error of one output element of a head:
 * (tol(dtype) + REF_LOGIT_ERR·logit_mag)·v_mag + qv_err. */
double ref_attention_bound(uint32_t elem_type, const struct ref_head_scale *s);

/* ---- element access (half.h's scalar conversions) ---- */
double ref_load(const void *base, uint32_t elem_type, uint64_t i);
/* Round x to float, then to the element type (nearest even). */
void ref_store(void *base, uint32_t elem_type, uint64_t i, double x);
/* The selection key of kernels.h: monotonic in the float order, NaN by bits. */
uint32_t ref_ordered(float x);

/* ---- copy-like kernels: write through the items' (host) output pointers ---- */
void ref_scatter(const struct kvr_shape *sh, const struct kvr_scatter_item *items, uint32_t n);
void ref_offload(const struct kvr_shape *sh, const struct kvr_page_item *items, uint32_t n);
void ref_summarize(const struct kvr_shape *sh, const struct kvr_page_item *items, uint32_t n);
/* Reads items[i].scores (floats), writes items[i].selected. Honours gate. */
void ref_select(const struct kvr_shape *sh, const struct kvr_score_item *items, uint32_t n);
/* Writes each item's list (its first n_segments entries) and n_segments. */
void ref_plan(const struct kvr_plan_item *items, uint32_t n);

/* ---- numeric kernels: one item, results in double ---- */
/* scores: [n_kv][cand_end - cand_begin]. */
void ref_score(const struct kvr_shape *sh, const struct kvr_score_item *item, double *scores);
/* cosine: [n_kv] group means (NaN where an input was NaN). */
void ref_similarity(const struct kvr_shape *sh, const struct kvr_similarity_item *item,
		    double *cosine);
/* out: [n_qo][d]; scale: [n_qo], what each head's error bound scales with.
 * segments: the call's whole array. */
void ref_attention(const struct kvr_shape *sh, const struct kvr_attention_item *item,
		   const struct kvr_kv_segment *segments, double *out, struct ref_head_scale *scale);
/* Item i of a call: ref_attention with the item's causal block position
 * (KVR_SHAPE_CAUSAL with causal_items_per_block). */
void ref_attention_at(const struct kvr_shape *sh, const struct kvr_attention_item *items, uint32_t i,
		      const struct kvr_kv_segment *segments, double *out, struct ref_head_scale *scale);
/* Each segment's log-sum-exp of logits per query head, lse[h·n_segments + s]
 * (kernels.h, KVR_SHAPE_SEGMENT_LSE); −inf for an empty segment. */
void ref_attention_lse(const struct kvr_shape *sh, const struct kvr_attention_item *item,
		       const struct kvr_kv_segment *segments, double *lse);
void ref_dense(const struct kvr_shape *sh, const struct kvr_dense_item *item, double *out,
	       struct ref_head_scale *scale);

#endif /* KVR_GPU_REFERENCE_H */
