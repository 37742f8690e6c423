/* SPDX-License-Identifier: MIT */
/*
 * half.h — scalar f16 and bf16 <-> f32 conversions, bit-exact with the
 * hardware's (F16C / AVX-512 and CUDA's __float2half_rn): round to nearest
 * even, subnormals kept, overflow to infinity, NaN stays NaN (quiet bit set,
 * payload truncated). These are the reference the vectorised paths in
 * convert.c are tested against, and the per-element math kernels use.
 */
#ifndef KVR_LAYOUTS_HALF_H
#define KVR_LAYOUTS_HALF_H

#include <stdint.h>
#include <string.h>

#include "hd.h"

static inline KVR_HD float kvr_bits_to_f32(uint32_t u)
{
	float f;
	memcpy(&f, &u, sizeof(f));
	return f;
}

static inline KVR_HD uint32_t kvr_f32_to_bits(float f)
{
	uint32_t u;
	memcpy(&u, &f, sizeof(u));
	return u;
}

static inline KVR_HD float kvr_f16_to_f32(uint16_t h)
{
	const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
	const uint32_t exp = (h >> 10) & 0x1fu;
	uint32_t mant = h & 0x3ffu;
	if (exp == 0x1f) /* inf or NaN; NaN gets its quiet bit, as vcvtph2ps does */
		return kvr_bits_to_f32(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u));
	if (exp == 0) {
		if (mant == 0)
			return kvr_bits_to_f32(sign);
		/* subnormal: normalise */
		int e = -1;
		do {
			mant <<= 1;
			e++;
		} while (!(mant & 0x400u));
		return kvr_bits_to_f32(sign | (uint32_t)(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13);
	}
	return kvr_bits_to_f32(sign | (exp + 112u) << 23 | mant << 13);
}

static inline KVR_HD uint16_t kvr_f32_to_f16(float f)
{
	const uint32_t u = kvr_f32_to_bits(f);
	const uint32_t sign = (u >> 16) & 0x8000u;
	const uint32_t exp = (u >> 23) & 0xffu;
	uint32_t mant = u & 0x7fffffu;
	if (exp == 0xff) /* inf, or NaN: quiet, payload truncated */
		return (uint16_t)(sign | 0x7c00u | (mant ? 0x200u | (mant >> 13) : 0u));
	const int e = (int)exp - 127 + 15;
	if (e >= 0x1f)
		return (uint16_t)(sign | 0x7c00u); /* overflow */
	if (e <= 0) {
		/* subnormal or zero in f16: shift the full significand, round to nearest even */
		if (e < -10)
			return (uint16_t)sign;
		mant |= 0x800000u;
		const uint32_t shift = (uint32_t)(14 - e);
		uint32_t r = mant >> shift;
		const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
		if (rem > half || (rem == half && (r & 1u)))
			r++;
		return (uint16_t)(sign | r);
	}
	uint32_t r = (uint32_t)e << 10 | mant >> 13;
	const uint32_t rem = mant & 0x1fffu;
	if (rem > 0x1000u || (rem == 0x1000u && (r & 1u)))
		r++; /* may carry into the exponent: correct, up to infinity */
	return (uint16_t)(sign | r);
}

static inline KVR_HD float kvr_bf16_to_f32(uint16_t b)
{
	return kvr_bits_to_f32((uint32_t)b << 16);
}

static inline KVR_HD uint16_t kvr_f32_to_bf16(float f)
{
	const uint32_t u = kvr_f32_to_bits(f);
	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((u >> 16) | 0x40u); /* NaN: keep it NaN, quiet */
	return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Load element i of a row of the given element type as f32. */
static inline KVR_HD float kvr_load_f32(const void *row, uint32_t elem_type, uint64_t i)
{
	switch (elem_type) {
	case 0: /* KVR_ELEM_F16 */
		return kvr_f16_to_f32(((const uint16_t *)row)[i]);
	case 1: /* KVR_ELEM_BF16 */
		return kvr_bf16_to_f32(((const uint16_t *)row)[i]);
	default: /* KVR_ELEM_F32 */
		return ((const float *)row)[i];
	}
}

/* Store f32 as element i of a row of the given element type. */
static inline KVR_HD void kvr_store_f32(void *row, uint32_t elem_type, uint64_t i, float x)
{
	switch (elem_type) {
	case 0:
		((uint16_t *)row)[i] = kvr_f32_to_f16(x);
		break;
	case 1:
		((uint16_t *)row)[i] = kvr_f32_to_bf16(x);
		break;
	default:
		((float *)row)[i] = x;
		break;
	}
}

#endif /* KVR_LAYOUTS_HALF_H */
