/* SPDX-License-Identifier: MIT */
/*
 * isa.h — run-time detection of the x86 vector extensions the cpu kernels and
 * conversions choose between (AVX2+FMA, AVX-512 F/BW/VL and VNNI, F16C). Host-only.
 */
#ifndef KVR_BASE_ISA_H
#define KVR_BASE_ISA_H

#include <stdbool.h>
#include <stddef.h>

struct kvr_isa {
	bool avx2;   /* AVX2 and FMA, with YMM state enabled by the OS */
	bool avx512; /* AVX-512 F, BW and VL, with ZMM state enabled by the OS */
	bool avx512_vnni; /* and AVX-512 VNNI (vpdpbusd: byte dot products) */
	bool f16c;   /* F16C half-precision conversions */
};

/* Detect once (cached; thread-safe) and return the result. */
const struct kvr_isa *kvr_isa_get(void);

/* Processor brand string into buf (NUL-terminated, "" when unavailable). */
void kvr_isa_cpu_model(char *buf, size_t buf_bytes);

#endif /* KVR_BASE_ISA_H */
