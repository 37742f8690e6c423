/* SPDX-License-Identifier: MIT */
/*
 * sample.h — choosing the next token from a row of logits: greedy (argmax,
 * ties to the lower id), or temperature softmax restricted to the top_k most
 * probable tokens and then to the smallest set of those whose probability
 * reaches top_p of their mass (nucleus), as llama.cpp and transformers order
 * them, drawn with a seeded generator so a run can be repeated exactly.
 *
 * Threads: a sampler is used by one thread at a time; distinct samplers are
 * independent.
 */
#ifndef KVR_MODEL_SAMPLE_H
#define KVR_MODEL_SAMPLE_H

#include <stddef.h>
#include <stdint.h>

struct sample_cand {
	float p;
	uint32_t id;
};

struct sampler {
	float temperature; /* 0: greedy */
	float top_p;       /* (0, 1]; 1 keeps every token */
	uint32_t top_k;    /* 0 keeps every token */
	uint64_t state;    /* splitmix64 state, from the seed */
	/* scratch, grown on demand: per-token weights and the candidates */
	float *probs;
	struct sample_cand *cands;
	size_t cap;
};

/* temperature >= 0, top_p in (0, 1]: -EINVAL otherwise. top_k starts at 0
 * (off); set it in the struct after init. */
int sampler_init(struct sampler *s, float temperature, float top_p, uint64_t seed);
void sampler_free(struct sampler *s);

/* The index of the largest logit (the lowest index among equals; NaN never
 * wins). n >= 1. */
uint32_t sample_argmax(const float *logits, size_t n);

/* The next token from n logits. -EINVAL for n = 0, -ENOMEM. */
int sample_next(struct sampler *s, const float *logits, size_t n, uint32_t *token);

#endif /* KVR_MODEL_SAMPLE_H */
