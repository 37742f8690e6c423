/* SPDX-License-Identifier: MIT */
/*
 * ops.h — the element-wise pieces of a Llama forward pass that are neither
 * matrix products (quant.h) nor attention (kvrecall): RMSNorm, rotary position
 * embedding as GGUF's converter expects it, SwiGLU, f32 <-> f16/bf16
 * conversion of the rows handed to kvrecall.
 *
 * Threads: the functions are pure.
 */
#ifndef KVR_MODEL_OPS_H
#define KVR_MODEL_OPS_H

#include <stddef.h>
#include <stdint.h>

/* out[i] = x[i] / sqrt(mean(x^2) + eps) * w[i] (sum in double). out may be x. */
void op_rmsnorm(float *out, const float *x, const float *w, size_t n, float eps);

/*
 * Rotary embedding of one head vector of head_dim elements at position pos,
 * "NORM" style: dimensions (2i, 2i+1) rotate together by pos * base^(-2i/d).
 * GGUF's Llama converter permutes the Q and K projection rows so that this
 * pairing reproduces the original model's rotate-half RoPE (see
 * reference/smollm2.md). n_rot <= head_dim dimensions rotate; the rest pass.
 */
void op_rope_norm(float *x, uint32_t head_dim, uint32_t n_rot, uint64_t pos, float base);
/* The same rotation in two steps, for callers that rotate many heads (and
 * layers) at one position: cs[i], cs[i+1] = cos, sin of pair i/2's angle
 * (n_rot floats, n_rot <= head_dim), then applied to one head; the bits are
 * op_rope_norm's. */
void op_rope_cos_sin(uint32_t n_rot, uint64_t pos, float base, float *cs);
void op_rope_apply(float *x, uint32_t n_rot, const float *cs);
/*
 * The general form, as llama.cpp's rope with frequency factors computes it:
 * pair i's angle is pos * freq_scale * base^(-2i/n_rot) / factors[i] (factors
 * NULL: all 1; n_rot/2 of them otherwise: Llama 3's rope_freqs.weight, which
 * its converter writes for the "llama3" scaling; freq_scale is 1/factor of
 * linear scaling). With freq_scale 1 and no factors the bits are
 * op_rope_cos_sin's.
 */
void op_rope_cos_sin_scaled(uint32_t n_rot, uint64_t pos, float base, float freq_scale,
			    const float *factors, float *cs);
/* NEOX pairing (Qwen2, Qwen3 and every GGUF whose converter does not permute
 * Q and K): dimension i rotates with i + n_rot/2, by pair i's angle in cs. */
void op_rope_apply_neox(float *x, uint32_t n_rot, const float *cs);

/* gate[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)). */
void op_swiglu(float *gate, const float *up, size_t n);

/* IEEE half and bfloat16 conversions, round to nearest even. */
uint16_t op_f32_to_f16(float f);
float op_f16_to_f32(uint16_t h);
uint16_t op_f32_to_bf16(float f);
float op_bf16_to_f32(uint16_t h);

#endif /* KVR_MODEL_OPS_H */
