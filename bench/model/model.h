/* SPDX-License-Identifier: MIT */
/*
 * model.h — a Llama, Qwen2 or Qwen3 GGUF model run on the CPU with its attention
 * through kvrecall's public API, as an inference engine would call it:
 * kvr_prefill + kvr_prefill_attention for the prompt, kvr_decode_begin /
 * kvr_decode_layer / kvr_decode_end per generated token.
 *
 * Every hyperparameter comes from the file ({arch}.* keys); the forward pass is
 * RMSNorm -> Q, K, V projections (+ biases: qwen2) -> per-head RMSNorm of Q
 * and K (qwen3) -> RoPE (NORM pairing for llama, whose converter permutes Q
 * and K; NEOX for the Qwens; Llama 3's frequency factors) -> attention
 * (kvrecall, f16 KV) -> output projection, residual ->
 * RMSNorm -> SwiGLU feed-forward, residual; then the final RMSNorm and the
 * output matrix (token_embd when the file ties them). Matrix products are
 * quant.h's, split by rows over the model's kvr_thread_pool.
 *
 * Threads: a model is driven by one thread at a time (it owns scratch and a
 * worker pool); the weights are read-only and could be shared.
 */
#ifndef KVR_MODEL_MODEL_H
#define KVR_MODEL_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"
#include "kvrecall.h"

/* The architectures the runner reads (general.architecture). One forward
 * pass serves all three; they differ in steps the loader switches on. */
enum model_arch {
	MODEL_ARCH_LLAMA = 0, /* Llama 1-3, SmolLM2: NORM RoPE (the converter permutes Q/K) */
	MODEL_ARCH_QWEN2 = 1, /* Qwen2/2.5, DeepSeek-R1-Distill-Qwen: Q/K/V biases, NEOX RoPE */
	MODEL_ARCH_QWEN3 = 2, /* Qwen3: per-head RMSNorm of Q and K before RoPE, NEOX RoPE */
};

struct model_hparams {
	enum model_arch arch;
	const char *arch_name; /* "llama", "qwen2", "qwen3" */
	uint32_t n_layers, n_embd, n_head, n_head_kv, head_dim, n_rot, n_ff, n_vocab;
	uint64_t ctx_len;  /* {arch}.context_length: what the model was trained for */
	float rope_base, rms_eps;
	float rope_freq_scale; /* 1/factor of linear rope scaling; 1 without */
	int rope_neox;         /* 1: NEOX pairing (i, i + n_rot/2); 0: NORM (2i, 2i+1) */
	int qkv_bias;          /* 1: the layers must have attn_{q,k,v}.bias */
	int qk_norm;           /* 1: the layers must have attn_{q,k}_norm, per head (Qwen3) */
};

struct model;

/* Open and validate a GGUF model (architecture llama, qwen2 or qwen3; every tensor present
 * with the shape the hyperparameters imply, types quant.h multiplies).
 * threads = workers besides the caller for the matrix products. */
int model_open(const char *path, uint32_t threads, struct model **out, char *err, size_t err_bytes);
/* The same over size bytes at data (gguf_open_memory: not copied; they must
 * outlive the model). */
int model_open_memory(const void *data, size_t size, uint32_t threads, struct model **out,
		      char *err, size_t err_bytes);
void model_close(struct model *m);
const struct model_hparams *model_hparams(const struct model *m);
/* The model's worker pool (its matrix products run there); a kvrecall
 * context of the same run takes it as kvr_config.parallel_for. */
struct kvr_thread_pool *model_thread_pool(const struct model *m);
const struct gguf *model_gguf(const struct model *m);

/* Fill the shape fields of a kvrecall config for this model (n_layers, heads,
 * head_dim, dtype f16); the caller sets the rest (mode, budget, ...). */
void model_kvr_config(const struct model *m, struct kvr_config *c);

/*
 * Run n tokens at positions pos0.. of sequence seq through the model,
 * storing their K/V in kvrecall (kvr_prefill) and attending with
 * kvr_prefill_attention, in chunks. logits (n_vocab floats, may be NULL)
 * receives the last token's logits. Errors: kvrecall's, -EINVAL, -ENOMEM,
 * with a message in err.
 */
int model_prefill(struct model *m, struct kvr_context *ctx, uint32_t seq, const int32_t *tokens,
		  uint32_t n, uint64_t pos0, float *logits, char *err, size_t err_bytes);

/* One decode step of one sequence: token at position pos; logits (n_vocab)
 * of the next token. Attention follows the context's mode. */
int model_decode(struct model *m, struct kvr_context *ctx, uint32_t seq, int32_t token,
		 uint64_t pos, float *logits, char *err, size_t err_bytes);

/* Nanoseconds spent inside kvrecall's attention calls (decode and prefill
 * separately) since the model was opened. */
uint64_t model_attention_ns(const struct model *m, int prefill);

#endif /* KVR_MODEL_MODEL_H */
