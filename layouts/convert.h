/* SPDX-License-Identifier: MIT */
/*
 * convert.h — bulk element conversions and page summaries on the host, with
 * the instruction set chosen at run time (AVX-512, F16C/AVX2, scalar). Results
 * are bit-identical to the scalar reference in half.h and summary.h whatever
 * path runs. Host-only; thread-safe (no state beyond the cached dispatch).
 */
#ifndef KVR_LAYOUTS_CONVERT_H
#define KVR_LAYOUTS_CONVERT_H

#include <stddef.h>
#include <stdint.h>

#include "page.h"

/* Which implementation the dispatch picked. */
enum kvr_convert_isa {
	KVR_CONVERT_SCALAR = 0,
	KVR_CONVERT_AVX2 = 1,   /* F16C + AVX2 */
	KVR_CONVERT_AVX512 = 2, /* AVX-512 F/BW/VL */
	/* AVX-512 with VNNI: the conversions are AVX-512's; the cpu kernels'
	 * integer dot products on quantised pages use vpdpbusd */
	KVR_CONVERT_AVX512_VNNI = 3,
};

/* n elements of elem_type -> f32. */
void kvr_convert_to_f32(float *dst, const void *src, uint32_t elem_type, size_t n);
/* n f32 -> elem_type, round to nearest even. */
void kvr_convert_from_f32(void *dst, const float *src, uint32_t elem_type, size_t n);

/* The ISA the conversions and the cpu backend's kernels use now: the best
 * the CPU has, or the environment's KVR_CPU_ISA=scalar|avx2|avx512|avx512vnni (clamped
 * to what the CPU has), read at first use. */
enum kvr_convert_isa kvr_convert_isa_active(void);
/* KVR_CPU_ISA as read: 1 and *isa when it names a path, 0 when unset, -1
 * when it names none; why (may be NULL) says so in words for reports. */
int kvr_convert_isa_request(enum kvr_convert_isa *isa, char *why, size_t why_bytes);
/* Force an ISA (tests compare every path); the request is clamped to what the
 * CPU supports. Returns the ISA actually set. Not thread-safe w.r.t. running
 * conversions: call it before starting work. */
enum kvr_convert_isa kvr_convert_isa_force(enum kvr_convert_isa isa);
const char *kvr_convert_isa_name(enum kvr_convert_isa isa);
/* The ISA kvr_convert_isa_name calls `name` ("scalar", "avx2", "avx512",
 * "avx512vnni"):
 * 0 and *isa, or -EINVAL when it names none. */
int kvr_convert_isa_parse(const char *name, enum kvr_convert_isa *isa);

/* Summary of one KV head of one page: element-wise min and max over the page's
 * p keys. keys: p rows of d elements, row i at keys + i * key_stride elements
 * (stride d for an HND run, n_kv·d for an NHD tile). min_out/max_out: d elements
 * each, same element type. NaN propagates. */
void kvr_summarize_keys(const struct kvr_page_geometry *g, const void *keys, uint64_t key_stride,
			void *min_out, void *max_out);

/* Estimate rows of one KV head of one page (summary.h): the mean of its p
 * keys and the mean of its p values, each column summed in fp32 in token
 * order from token 0 and divided by p. keys/values: p rows of d elements,
 * row i at + i * stride elements. key_mean_out/value_mean_out: d elements
 * each, same element type. NaN propagates. */
void kvr_summarize_means(const struct kvr_page_geometry *g, const void *keys, const void *values,
			 uint64_t stride, void *key_mean_out, void *value_mean_out);

#endif /* KVR_LAYOUTS_CONVERT_H */
