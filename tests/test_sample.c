/* SPDX-License-Identifier: MIT */
/*
 * test_sample.c — the real-model runner's sampler (bench/model/sample.c):
 * greedy ties and NaN, seeded reproducibility, top-p keeping exactly the
 * nucleus, and temperature sampling following the softmax.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>

#include "sample.h"

Test(sample, argmax_ties_to_lower_id_and_skips_nan)
{
	const float a[5] = { 1.0f, 3.0f, 3.0f, -1.0f, 2.0f };
	cr_expect_eq(sample_argmax(a, 5), 1);
	const float b[4] = { NAN, 0.5f, NAN, 0.7f };
	cr_expect_eq(sample_argmax(b, 4), 3);
	const float c[1] = { -INFINITY };
	cr_expect_eq(sample_argmax(c, 1), 0);
}

Test(sample, bad_arguments)
{
	struct sampler s;
	cr_expect_eq(sampler_init(&s, -1.0f, 1.0f, 1), -EINVAL);
	cr_expect_eq(sampler_init(&s, 1.0f, 0.0f, 1), -EINVAL);
	cr_expect_eq(sampler_init(&s, 1.0f, 1.5f, 1), -EINVAL);
	cr_expect_eq(sampler_init(&s, NAN, 1.0f, 1), -EINVAL);
	cr_assert_eq(sampler_init(&s, 1.0f, 1.0f, 1), 0);
	uint32_t t;
	cr_expect_eq(sample_next(&s, NULL, 0, &t), -EINVAL);
	sampler_free(&s);
}

Test(sample, greedy_when_temperature_zero)
{
	struct sampler s;
	cr_assert_eq(sampler_init(&s, 0.0f, 0.5f, 7), 0);
	const float l[4] = { 0.1f, 0.2f, 5.0f, 0.3f };
	for (int i = 0; i < 10; i++) {
		uint32_t t = 99;
		cr_assert_eq(sample_next(&s, l, 4, &t), 0);
		cr_expect_eq(t, 2);
	}
	sampler_free(&s);
}

Test(sample, same_seed_same_tokens)
{
	float l[300];
	for (int i = 0; i < 300; i++)
		l[i] = sinf((float)i * 0.37f) * 3.0f;
	uint32_t first[50];
	for (int run = 0; run < 2; run++) {
		struct sampler s;
		cr_assert_eq(sampler_init(&s, 0.8f, 0.9f, 1234), 0);
		int differ = 0;
		for (int i = 0; i < 50; i++) {
			uint32_t t;
			cr_assert_eq(sample_next(&s, l, 300, &t), 0);
			if (run == 0)
				first[i] = t;
			else
				cr_expect_eq(t, first[i], "draw %d: %u then %u", i, first[i], t);
			differ |= i && first[i] != first[0];
		}
		cr_expect(run == 1 || differ, "50 draws at T = 0.8 all gave one token");
		sampler_free(&s);
	}
}

/* logits 0, ln 2, ln 4 -> probabilities 1/7, 2/7, 4/7: top_p = 0.5 keeps only
 * the last; top_p = 0.6 keeps the last two, in proportion 1 : 2 */
Test(sample, top_p_keeps_the_nucleus)
{
	const float l[3] = { 0.0f, logf(2.0f), logf(4.0f) };
	struct sampler s;
	cr_assert_eq(sampler_init(&s, 1.0f, 0.5f, 99), 0);
	for (int i = 0; i < 200; i++) {
		uint32_t t;
		cr_assert_eq(sample_next(&s, l, 3, &t), 0);
		cr_assert_eq(t, 2);
	}
	sampler_free(&s);
	cr_assert_eq(sampler_init(&s, 1.0f, 0.6f, 99), 0);
	int count[3] = { 0 };
	for (int i = 0; i < 30000; i++) {
		uint32_t t;
		cr_assert_eq(sample_next(&s, l, 3, &t), 0);
		count[t]++;
	}
	cr_expect_eq(count[0], 0, "token 0 is outside the nucleus");
	const double share = count[2] / 30000.0;
	cr_expect(fabs(share - 2.0 / 3.0) < 0.015, "token 2 drawn %.4f of the time, want 2/3", share);
	sampler_free(&s);
}

Test(sample, temperature_follows_softmax)
{
	const float l[4] = { 1.0f, 2.0f, 0.0f, 1.5f };
	const float T = 0.7f;
	double p[4], z = 0;
	for (int i = 0; i < 4; i++)
		z += (p[i] = exp(l[i] / T));
	struct sampler s;
	cr_assert_eq(sampler_init(&s, T, 1.0f, 5), 0);
	int count[4] = { 0 };
	const int N = 40000;
	for (int i = 0; i < N; i++) {
		uint32_t t;
		cr_assert_eq(sample_next(&s, l, 4, &t), 0);
		count[t]++;
	}
	for (int i = 0; i < 4; i++) {
		const double want = p[i] / z, got = (double)count[i] / N;
		/* 5 standard deviations of a binomial share */
		cr_expect(fabs(got - want) < 5 * sqrt(want * (1 - want) / N), "token %d: %.4f, want %.4f",
			  i, got, want);
	}
	sampler_free(&s);
}

/* probabilities 1/7, 2/7, 4/7 (logits 0, ln 2, ln 4) plus a fourth token of
 * 1/7: top_k = 2 keeps tokens 2 and 1 only, in proportion 2 : 1 */
Test(sample, top_k_keeps_the_most_probable)
{
	const float l[4] = { 0.0f, logf(2.0f), logf(4.0f), 0.0f };
	struct sampler s;
	cr_assert_eq(sampler_init(&s, 1.0f, 1.0f, 3), 0);
	s.top_k = 2;
	int count[4] = { 0 };
	const int N = 30000;
	for (int i = 0; i < N; i++) {
		uint32_t t;
		cr_assert_eq(sample_next(&s, l, 4, &t), 0);
		count[t]++;
	}
	cr_expect_eq(count[0] + count[3], 0, "tokens 0 and 3 are outside the top 2");
	const double share = count[2] / (double)N;
	cr_expect(fabs(share - 2.0 / 3.0) < 0.015, "token 2 drawn %.4f of the time, want 2/3", share);
	s.top_k = 1; /* one token: the argmax at any temperature */
	for (int i = 0; i < 200; i++) {
		uint32_t t;
		cr_assert_eq(sample_next(&s, l, 4, &t), 0);
		cr_assert_eq(t, 2);
	}
	sampler_free(&s);
}

/* top-p after top-k is measured against the top k's mass: of 1/7, 2/7, 4/7,
 * top_k = 2 leaves 6/7, so top_p = 0.6 wants 0.51, which token 2 (4/7 = 0.57)
 * reaches alone; over all tokens the same top_p wants 0.6 and keeps two */
Test(sample, top_p_after_top_k_takes_the_kept_mass)
{
	const float l[3] = { 0.0f, logf(2.0f), logf(4.0f) };
	struct sampler s;
	cr_assert_eq(sampler_init(&s, 1.0f, 0.6f, 11), 0);
	s.top_k = 2;
	for (int i = 0; i < 500; i++) {
		uint32_t t;
		cr_assert_eq(sample_next(&s, l, 3, &t), 0);
		cr_assert_eq(t, 2);
	}
	s.top_k = 0;
	int count[3] = { 0 };
	for (int i = 0; i < 2000; i++) {
		uint32_t t;
		cr_assert_eq(sample_next(&s, l, 3, &t), 0);
		count[t]++;
	}
	cr_expect_gt(count[1], 0, "without top-k the nucleus holds token 1 too");
	sampler_free(&s);
}
