/* SPDX-License-Identifier: MIT */
/*
 * ops.c — RMSNorm, RoPE, SwiGLU and half/bfloat16 conversion of the
 * real-model runner (ops.h). (Its matrix products run on kvrecall's public
 * thread pool, shared with the cpu backend: model.c.)
 *
 * Threads: the functions are pure.
 */
#include "ops.h"

#include "../../layouts/half.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void op_rmsnorm(float *out, const float *x, const float *w, size_t n, float eps)
{
	double ss = 0.0;
	for (size_t i = 0; i < n; i++)
		ss += (double)x[i] * x[i];
	const float scale = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
	for (size_t i = 0; i < n; i++)
		out[i] = x[i] * scale * w[i];
}

/* cos and sin of pair i/2's angle at pos: theta = pos * base^(-i/n_rot), in
 * double (positions reach 1e5+) */
static void rope_angle_scaled(uint32_t i, uint32_t n_rot, uint64_t pos, float base, double scale,
			      float *c, float *s)
{
	const double theta = (double)pos * pow((double)base, -(double)i / (double)n_rot) * scale;
	*c = (float)cos(theta);
	*s = (float)sin(theta);
}

static void rope_angle(uint32_t i, uint32_t n_rot, uint64_t pos, float base, float *c, float *s)
{
	rope_angle_scaled(i, n_rot, pos, base, 1.0, c, s);
}

static void rope_pair(float *x, float c, float s)
{
	const float a = x[0], b = x[1];
	x[0] = a * c - b * s;
	x[1] = a * s + b * c;
}


void op_rope_cos_sin_scaled(uint32_t n_rot, uint64_t pos, float base, float freq_scale,
			    const float *factors, float *cs)
{
	for (uint32_t i = 0; i + 1 < n_rot; i += 2) {
		const double scale = (double)freq_scale / (factors ? (double)factors[i / 2] : 1.0);
		rope_angle_scaled(i, n_rot, pos, base, scale, &cs[i], &cs[i + 1]);
	}
}

void op_rope_cos_sin(uint32_t n_rot, uint64_t pos, float base, float *cs)
{
	op_rope_cos_sin_scaled(n_rot, pos, base, 1.0f, NULL, cs); /* the angle times 1.0: the same bits */
}

void op_rope_apply_neox(float *x, uint32_t n_rot, const float *cs)
{
	const uint32_t half = n_rot / 2;
	for (uint32_t i = 0; i < half; i++) {
		const float c = cs[2 * i], s = cs[2 * i + 1], a = x[i], b = x[i + half];
		x[i] = a * c - b * s;
		x[i + half] = a * s + b * c;
	}
}

void op_rope_apply(float *x, uint32_t n_rot, const float *cs)
{
	for (uint32_t i = 0; i + 1 < n_rot; i += 2)
		rope_pair(x + i, cs[i], cs[i + 1]);
}

void op_rope_norm(float *x, uint32_t head_dim, uint32_t n_rot, uint64_t pos, float base)
{
	if (n_rot > head_dim)
		n_rot = head_dim;
	for (uint32_t i = 0; i + 1 < n_rot; i += 2) {
		float c, s;
		rope_angle(i, n_rot, pos, base, &c, &s);
		rope_pair(x + i, c, s);
	}
}

void op_swiglu(float *gate, const float *up, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		const float g = gate[i];
		gate[i] = g / (1.0f + expf(-g)) * up[i];
	}
}

/* The conversions are layouts/half.h's, which the pages use: bit-exact
 * with F16C and CUDA's round-to-nearest-even. */
uint16_t op_f32_to_f16(float f)
{
	return kvr_f32_to_f16(f);
}

float op_f16_to_f32(uint16_t h)
{
	return kvr_f16_to_f32(h);
}

uint16_t op_f32_to_bf16(float f)
{
	return kvr_f32_to_bf16(f);
}

float op_bf16_to_f32(uint16_t h)
{
	return kvr_bf16_to_f32(h);
}
