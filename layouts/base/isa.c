/* SPDX-License-Identifier: MIT */
/*
 * isa.c — CPUID/XGETBV probing behind kvr_isa_get(). A feature counts only when
 * the CPU has it *and* the OS saves its register state (XCR0), otherwise the
 * first AVX-512 instruction would fault.
 *
 * Threads: any. The cached result is published through a pthread_once.
 */
#include <pthread.h>
#include <string.h>

#include "isa.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static unsigned long long read_xcr0(void)
{
	unsigned int lo, hi;
	__asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
	return ((unsigned long long)hi << 32) | lo;
}
#endif

static struct kvr_isa isa_cached;
static pthread_once_t isa_once = PTHREAD_ONCE_INIT;

static void isa_detect(void)
{
#if defined(__x86_64__) || defined(__i386__)
	unsigned int a, b, c, d;
	if (!__get_cpuid(1, &a, &b, &c, &d))
		return;
	const bool osxsave = c & bit_OSXSAVE;
	const bool avx = c & bit_AVX;
	const bool fma = c & bit_FMA;
	const bool f16c = c & bit_F16C;
	if (!osxsave || !avx)
		return;
	const unsigned long long xcr0 = read_xcr0();
	const bool ymm_state = (xcr0 & 0x6) == 0x6;     /* SSE + AVX state */
	const bool zmm_state = (xcr0 & 0xe6) == 0xe6;   /* + opmask, ZMM hi256, hi16 ZMM */
	if (!ymm_state)
		return;
	isa_cached.f16c = f16c;
	if (__get_cpuid_max(0, NULL) >= 7) {
		__cpuid_count(7, 0, a, b, c, d);
		isa_cached.avx2 = (b & bit_AVX2) && fma;
		isa_cached.avx512 = zmm_state && (b & bit_AVX512F) && (b & bit_AVX512BW) &&
				    (b & bit_AVX512VL);
		isa_cached.avx512_vnni = isa_cached.avx512 && (c & bit_AVX512VNNI);
	}
#endif
}

const struct kvr_isa *kvr_isa_get(void)
{
	pthread_once(&isa_once, isa_detect);
	return &isa_cached;
}

void kvr_isa_cpu_model(char *buf, size_t buf_bytes)
{
	if (!buf_bytes)
		return;
	buf[0] = '\0';
#if defined(__x86_64__) || defined(__i386__)
	unsigned int regs[12];
	if (__get_cpuid_max(0x80000000, NULL) < 0x80000004)
		return;
	for (unsigned int i = 0; i < 3; i++)
		__get_cpuid(0x80000002 + i, &regs[4 * i], &regs[4 * i + 1], &regs[4 * i + 2],
			    &regs[4 * i + 3]);
	char brand[49];
	memcpy(brand, regs, 48);
	brand[48] = '\0';
	const char *s = brand;
	while (*s == ' ')
		s++;
	size_t n = strlen(s);
	while (n && s[n - 1] == ' ')
		n--;
	if (n >= buf_bytes)
		n = buf_bytes - 1;
	memcpy(buf, s, n);
	buf[n] = '\0';
#endif
}
