/* SPDX-License-Identifier: MIT */
/*
 * ops.c — RMSNorm, RoPE, SwiGLU and half/bfloat16 conversion of the
 * real-model runner (ops.h). (Its matrix products run on kvrecall's public
 * thread pool, shared with the cpu backend: model.c.)
 *
 * Threads: the functions are pure.
 */
#include "ops.h"

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

void op_rope_norm(float *x, uint32_t head_dim, uint32_t n_rot, uint64_t pos, float base)
{
	if (n_rot > head_dim)
		n_rot = head_dim;
	for (uint32_t i = 0; i + 1 < n_rot; i += 2) {
		/* theta = pos * base^(-i/n_rot), in double: positions reach 1e5+ */
		const double theta = (double)pos * pow((double)base, -(double)i / (double)n_rot);
		const float c = (float)cos(theta), s = (float)sin(theta);
		const float a = x[i], b = x[i + 1];
		x[i] = a * c - b * s;
		x[i + 1] = a * s + b * c;
	}
}

void op_swiglu(float *gate, const float *up, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		const float g = gate[i];
		gate[i] = g / (1.0f + expf(-g)) * up[i];
	}
}

static uint32_t bits_of(float f)
{
	uint32_t u;
	memcpy(&u, &f, sizeof(u));
	return u;
}

static float float_of(uint32_t u)
{
	float f;
	memcpy(&f, &u, sizeof(f));
	return f;
}

uint16_t op_f32_to_f16(float f)
{
	const uint32_t x = bits_of(f);
	const uint32_t sign = (x >> 16) & 0x8000u;
	const uint32_t abs = x & 0x7fffffffu;
	if (abs >= 0x7f800000u) /* inf or nan (keep nan a nan) */
		return (uint16_t)(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
	if (abs >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
		return (uint16_t)(sign | 0x7c00u);
	if (abs < 0x38800000u) { /* below 2^-14: subnormal half (or zero) */
		/* scale so the half's units land in the integer part, then round
		 * to nearest even in float arithmetic (exact for these ranges) */
		const float v = float_of(abs) * 16777216.0f; /* 2^24: half subnormal unit */
		return (uint16_t)(sign | (uint32_t)nearbyintf(v));
	}
	/* normal: rebias the exponent, round the 13 dropped mantissa bits to even */
	uint32_t m = abs + 0xc8000000u; /* exponent - 112 */
	m += 0x0fffu + ((m >> 13) & 1u);
	return (uint16_t)(sign | (m >> 13));
}

float op_f16_to_f32(uint16_t h)
{
	const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
	const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
	if (exp == 0) /* zero or subnormal: man * 2^-24 */
		return float_of(sign) + (sign ? -1.0f : 1.0f) * (float)man * 0x1p-24f;
	if (exp == 31)
		return float_of(sign | 0x7f800000u | (man << 13));
	return float_of(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t op_f32_to_bf16(float f)
{
	const uint32_t x = bits_of(f);
	if ((x & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((x >> 16) | 0x40u); /* quiet nan */
	return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

float op_bf16_to_f32(uint16_t h)
{
	return float_of((uint32_t)h << 16);
}
