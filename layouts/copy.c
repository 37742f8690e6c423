/* SPDX-License-Identifier: MIT */
/*
 * copy.c — streaming copies with prefetch (see copy.h). AVX-512 and AVX2
 * variants chosen at run time (the same choice as the conversions); SSE2
 * streaming stores otherwise, which every x86-64 has.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "convert.h"
#include "copy.h"

#define PREFETCH_BLOCK 1024u /* bytes of the next run prefetched per block copied */

/* One step of each ISA's loop: 4 full-width loads, then 4 streaming stores. */
__attribute__((target("avx512f"), always_inline)) static inline void
step_avx512(unsigned char *dst, const unsigned char *src)
{
	const __m512i a = _mm512_load_si512(src), b = _mm512_load_si512(src + 64);
	const __m512i c = _mm512_load_si512(src + 128), d = _mm512_load_si512(src + 192);
	_mm512_stream_si512((__m512i *)dst, a);
	_mm512_stream_si512((__m512i *)(dst + 64), b);
	_mm512_stream_si512((__m512i *)(dst + 128), c);
	_mm512_stream_si512((__m512i *)(dst + 192), d);
}

__attribute__((target("avx2"), always_inline)) static inline void step_avx2(unsigned char *dst,
									    const unsigned char *src)
{
	const __m256i a = _mm256_load_si256((const __m256i *)src);
	const __m256i b = _mm256_load_si256((const __m256i *)(src + 32));
	const __m256i c = _mm256_load_si256((const __m256i *)(src + 64));
	const __m256i d = _mm256_load_si256((const __m256i *)(src + 96));
	_mm256_stream_si256((__m256i *)dst, a);
	_mm256_stream_si256((__m256i *)(dst + 32), b);
	_mm256_stream_si256((__m256i *)(dst + 64), c);
	_mm256_stream_si256((__m256i *)(dst + 96), d);
}

static inline __attribute__((always_inline)) void step_sse2(unsigned char *dst,
							    const unsigned char *src)
{
	for (size_t j = 0; j < 64; j += 16)
		_mm_stream_si128((__m128i *)(dst + j), _mm_load_si128((const __m128i *)(src + j)));
}

/* The copy loop of one ISA: blocks of PREFETCH_BLOCK bytes, each after a
 * prefetch of the same block of the next run. */
#define STREAM_COPY_FN(name, target_attr, step, step_bytes)                                   \
	target_attr static void name(unsigned char *dst, const unsigned char *src, size_t bytes, \
				     const unsigned char *next)                                  \
	{                                                                                        \
		for (size_t off = 0; off < bytes; off += PREFETCH_BLOCK) {                       \
			const size_t end =                                                       \
				off + PREFETCH_BLOCK < bytes ? off + PREFETCH_BLOCK : bytes;     \
			if (next)                                                                \
				for (size_t l = off; l < end; l += 64)                           \
					_mm_prefetch((const char *)next + l, _MM_HINT_T0);       \
			for (size_t i = off; i < end; i += step_bytes)                           \
				step(dst + i, src + i);                                          \
		}                                                                                \
	}
STREAM_COPY_FN(copy_avx512, __attribute__((target("avx512f"))), step_avx512, 256)
STREAM_COPY_FN(copy_avx2, __attribute__((target("avx2"))), step_avx2, 128)
STREAM_COPY_FN(copy_sse2, , step_sse2, 64)
#undef STREAM_COPY_FN

static void copy_one(void *dst, const void *src, size_t bytes, const void *next)
{
	/* The vector loops move 256 bytes (AVX-512) or 128 (AVX2) per step. */
	const int aligned = !(((uintptr_t)dst | (uintptr_t)src) & 63) && !(bytes & 255);
	if (!aligned) {
		memcpy(dst, src, bytes);
		return;
	}
	switch (kvr_convert_isa_active()) {
	case KVR_CONVERT_AVX512_VNNI:
	case KVR_CONVERT_AVX512:
		copy_avx512(dst, src, bytes, next);
		break;
	case KVR_CONVERT_AVX2:
		copy_avx2(dst, src, bytes, next);
		break;
	default:
		copy_sse2(dst, src, bytes, next);
		break;
	}
}

void kvr_copy_stream(void *dst, const void *src, size_t bytes, const void *next)
{
	copy_one(dst, src, bytes, next);
	_mm_sfence(); /* streaming stores are weakly ordered: publish them */
}

void kvr_copy_stream_gather(void *dst, const void *const *srcs, size_t n, size_t bytes)
{
	unsigned char *d = dst;
	for (size_t i = 0; i < n; i++, d += bytes)
		copy_one(d, srcs[i], bytes, i + 1 < n ? srcs[i + 1] : NULL);
	_mm_sfence();
}
