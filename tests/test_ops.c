/* SPDX-License-Identifier: MIT */
/*
 * test_ops.c — the runner's element-wise operations and pool (bench/model/ops.c):
 * half conversions against the compiler's _Float16 on every half and many
 * floats, bfloat16 rounding, RMSNorm and RoPE against formulas, SwiGLU, and
 * the pool's shares.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "helpers.h"
#include "ops.h"

static uint16_t hbits(_Float16 h)
{
	uint16_t u;
	memcpy(&u, &h, 2);
	return u;
}

Test(ops, every_half_round_trips_and_widens_like_the_compiler)
{
	for (uint32_t h = 0; h < 65536; h++) {
		_Float16 ref;
		const uint16_t hh = (uint16_t)h;
		memcpy(&ref, &hh, 2);
		const float want = (float)ref, got = op_f16_to_f32(hh);
		if (isnan(want)) {
			cr_assert(isnan(got), "half 0x%04x", h);
			continue;
		}
		cr_assert_eq(th_f32_bits(got), th_f32_bits(want), "half 0x%04x: %a, want %a", h, got, want);
		cr_assert_eq(op_f32_to_f16(got), hh, "half 0x%04x does not round-trip", h);
	}
}

Test(ops, float_to_half_rounds_like_the_compiler)
{
	uint64_t s = 12345;
	for (int i = 0; i < 2000000; i++) {
		s = s * 6364136223846793005ull + 1442695040888963407ull;
		uint32_t u = (uint32_t)(s >> 32);
		/* bias towards the half range and its edges */
		if (i % 2)
			u = (u & 0x80000000u) | (0x33000000u + (u % 0x14800000u));
		const float f = th_bits_f32(u);
		if (isnan(f))
			continue;
		const uint16_t want = hbits((_Float16)f), got = op_f32_to_f16(f);
		cr_assert_eq(got, want, "%a (0x%08x): 0x%04x, want 0x%04x", f, u, got, want);
	}
	cr_expect_eq(op_f32_to_f16(65519.0f), 0x7bff);
	cr_expect_eq(op_f32_to_f16(65520.0f), 0x7c00);
	cr_expect(isnan(op_f16_to_f32(op_f32_to_f16(NAN))));
}

Test(ops, bfloat16_rounds_to_nearest_even)
{
	cr_expect_eq(op_f32_to_bf16(1.0f), 0x3f80);
	cr_expect_eq(op_f32_to_bf16(th_bits_f32(0x3f808000u)), 0x3f80); /* tie, even stays */
	cr_expect_eq(op_f32_to_bf16(th_bits_f32(0x3f818000u)), 0x3f82); /* tie, odd rounds up */
	cr_expect_eq(op_f32_to_bf16(th_bits_f32(0x3f808001u)), 0x3f81);
	cr_expect(isnan(op_bf16_to_f32(op_f32_to_bf16(NAN))));
	cr_expect_eq(op_bf16_to_f32(0x4049), th_bits_f32(0x40490000u));
}

Test(ops, rmsnorm_matches_the_formula)
{
	float x[576], w[576], out[576];
	double ss = 0;
	for (int i = 0; i < 576; i++) {
		x[i] = sinf((float)i) * (float)(i % 7);
		w[i] = 0.5f + (float)(i % 5) * 0.1f;
		ss += (double)x[i] * x[i];
	}
	op_rmsnorm(out, x, w, 576, 1e-5f);
	const double r = 1.0 / sqrt(ss / 576 + 1e-5);
	for (int i = 0; i < 576; i++)
		cr_assert(fabs(out[i] - x[i] * r * w[i]) <= 1e-5 * fabs(x[i] * r * w[i]) + 1e-7, "%d", i);
	op_rmsnorm(x, x, w, 576, 1e-5f); /* in place */
	cr_expect_eq(memcmp(x, out, sizeof(x)), 0);
}

Test(ops, rope_rotates_adjacent_pairs)
{
	float x[64], y[64];
	for (int i = 0; i < 64; i++)
		x[i] = y[i] = (float)(i + 1) / 10.0f;
	op_rope_norm(y, 64, 64, 0, 100000.0f);
	cr_expect_eq(memcmp(x, y, sizeof(x)), 0, "position 0 is the identity");
	const uint64_t pos = 777;
	op_rope_norm(y, 64, 64, pos, 100000.0f);
	for (int i = 0; i < 64; i += 2) {
		const double th = pos * pow(100000.0, -(double)i / 64);
		const double a = x[i] * cos(th) - x[i + 1] * sin(th), b = x[i] * sin(th) + x[i + 1] * cos(th);
		cr_assert(fabs(y[i] - a) < 1e-5 && fabs(y[i + 1] - b) < 1e-5, "pair %d", i);
		const double n0 = hypot(x[i], x[i + 1]), n1 = hypot(y[i], y[i + 1]);
		cr_assert(fabs(n0 - n1) < 1e-5, "pair %d changed length", i);
	}
	/* partial rotation leaves the tail alone */
	float z[64];
	memcpy(z, x, sizeof(z));
	op_rope_norm(z, 64, 32, pos, 10000.0f);
	cr_expect_eq(memcmp(z + 32, x + 32, 32 * sizeof(float)), 0);
}

Test(ops, swiglu)
{
	float g[3] = { 0.0f, 2.0f, -3.0f };
	const float u[3] = { 5.0f, 0.5f, 2.0f };
	op_swiglu(g, u, 3);
	cr_expect_eq(g[0], 0.0f);
	cr_expect(fabsf(g[1] - 2.0f / (1.0f + expf(-2.0f)) * 0.5f) < 1e-6f);
	cr_expect(fabsf(g[2] - -3.0f / (1.0f + expf(3.0f)) * 2.0f) < 1e-6f);
}

