/* SPDX-License-Identifier: MIT */
/*
 * sample.c — greedy and temperature/top-p sampling (sample.h).
 *
 * Top-k and top-p sort only what they must: candidates above a probability
 * floor are gathered first (a token below 1e-4 of the maximum can matter only
 * when the nucleus needs almost all of the mass, or when fewer than top_k
 * tokens are above it), then sorted by probability, ties to the lower id, so a
 * seed reproduces the same choice on every machine. Top-k keeps the first
 * top_k candidates; the nucleus is then taken over their mass.
 *
 * Threads: one thread per sampler.
 */
#include "sample.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t splitmix64(uint64_t *state)
{
	uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Uniform in [0, 1) with 53 random bits. */
static double uniform(uint64_t *state)
{
	return (double)(splitmix64(state) >> 11) * 0x1p-53;
}

int sampler_init(struct sampler *s, float temperature, float top_p, uint64_t seed)
{
	memset(s, 0, sizeof(*s));
	if (!(temperature >= 0.0f) || !(top_p > 0.0f && top_p <= 1.0f))
		return -EINVAL;
	s->temperature = temperature;
	s->top_p = top_p;
	s->state = seed;
	return 0;
}

void sampler_free(struct sampler *s)
{
	free(s->probs);
	free(s->cands);
	memset(s, 0, sizeof(*s));
}

uint32_t sample_argmax(const float *logits, size_t n)
{
	uint32_t best = 0;
	float v = logits[0];
	for (size_t i = 1; i < n; i++)
		if (logits[i] > v || (v != v && logits[i] == logits[i])) {
			v = logits[i];
			best = (uint32_t)i;
		}
	return best;
}

static int by_prob_desc(const void *a, const void *b)
{
	const struct sample_cand *x = a, *y = b;
	if (x->p != y->p)
		return x->p < y->p ? 1 : -1;
	return x->id < y->id ? -1 : x->id > y->id;
}

int sample_next(struct sampler *s, const float *logits, size_t n, uint32_t *token)
{
	if (!n)
		return -EINVAL;
	const uint32_t best = sample_argmax(logits, n);
	if (s->temperature == 0.0f || logits[best] != logits[best]) {
		*token = best;
		return 0;
	}
	if (n > s->cap) {
		float *probs = realloc(s->probs, n * sizeof(*probs));
		if (probs)
			s->probs = probs;
		struct sample_cand *cands = realloc(s->cands, n * sizeof(*cands));
		if (cands)
			s->cands = cands;
		if (!probs || !cands)
			return -ENOMEM;
		s->cap = n;
	}
	/* softmax at temperature T, in double for the sum */
	const double inv_t = 1.0 / s->temperature, top = logits[best];
	double sum = 0.0;
	for (size_t i = 0; i < n; i++) {
		const double e = logits[i] == logits[i] ? exp((logits[i] - top) * inv_t) : 0.0;
		s->probs[i] = (float)e;
		sum += e;
	}
	/* candidates: every token when neither filter is on, else those above a floor */
	const int filtered = s->top_p < 1.0f || s->top_k;
	const float floor_p = filtered ? 1e-4f : 0.0f; /* relative to the maximum (1) */
	struct sample_cand *cands = s->cands;
	size_t m = 0;
	for (size_t i = 0; i < n; i++)
		if (s->probs[i] > floor_p || i == best)
			cands[m++] = (struct sample_cand){ s->probs[i], (uint32_t)i };
	if (filtered)
		qsort(cands, m, sizeof(*cands), by_prob_desc);
	/* top-k: the mass the nucleus is measured against becomes theirs */
	double mass = sum;
	if (s->top_k && m > s->top_k) {
		m = s->top_k;
		mass = 0.0;
		for (size_t i = 0; i < m; i++)
			mass += cands[i].p;
	}
	/* the nucleus: the shortest prefix whose mass reaches top_p */
	size_t keep = m;
	double kept = 0.0;
	if (s->top_p < 1.0f) {
		const double want = s->top_p * mass;
		for (size_t i = 0; i < m; i++) {
			kept += cands[i].p;
			if (kept >= want) {
				keep = i + 1;
				break;
			}
		}
	} else {
		kept = mass;
	}
	if (keep == m && filtered) {
		kept = 0.0;
		for (size_t i = 0; i < m; i++)
			kept += cands[i].p;
	}
	double r = uniform(&s->state) * kept;
	uint32_t pick = cands[keep - 1].id;
	for (size_t i = 0; i < keep; i++) {
		r -= cands[i].p;
		if (r < 0.0) {
			pick = cands[i].id;
			break;
		}
	}
	*token = pick;
	return 0;
}
