/* SPDX-License-Identifier: MIT */
/*
 * ops.h — the element-wise pieces of a Llama forward pass that are neither
 * matrix products (quant.h) nor attention (kvrecall): RMSNorm, rotary position
 * embedding as GGUF's converter expects it, SwiGLU, f32 <-> f16/bf16
 * conversion of the rows handed to kvrecall, and a small fork-join pool that
 * splits a matrix product's rows across threads.
 *
 * Threads: the functions are pure; a pool is driven by one thread at a time.
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

/* gate[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)). */
void op_swiglu(float *gate, const float *up, size_t n);

/* IEEE half and bfloat16 conversions, round to nearest even. */
uint16_t op_f32_to_f16(float f);
float op_f16_to_f32(uint16_t h);
uint16_t op_f32_to_bf16(float f);
float op_bf16_to_f32(uint16_t h);

/* ---- a fork-join pool ---- */

struct op_pool;
typedef void (*op_task_fn)(void *arg, uint32_t index, uint32_t count);

/* threads = workers besides the caller (0: the caller alone). */
int op_pool_create(uint32_t threads, struct op_pool **out);
void op_pool_destroy(struct op_pool *p);
/* Run fn(arg, i, count) for i in [0, count) with count = workers + 1, the
 * caller taking one share; returns when all are done. */
void op_pool_run(struct op_pool *p, op_task_fn fn, void *arg);
uint32_t op_pool_size(const struct op_pool *p);

#endif /* KVR_MODEL_OPS_H */
