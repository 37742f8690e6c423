/* SPDX-License-Identifier: MIT */
/*
 * crc32c.c — CRC32C for the spill tier (crc32c.h). The hardware path folds 8
 * bytes per crc32 instruction; the table path is slice-by-8, so a CPU without
 * SSE4.2 still checks runs faster than a disk delivers them. Threads: any (the
 * tables are built once under pthread_once).
 */
#include "crc32c.h"

#include <pthread.h>
#include <string.h>

#define CRC32C_POLY 0x82f63b78u /* reflected Castagnoli polynomial */

static uint32_t crc_table[8][256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void build_tables(void)
{
	for (uint32_t i = 0; i < 256; i++) {
		uint32_t c = i;
		for (int k = 0; k < 8; k++)
			c = (c >> 1) ^ (CRC32C_POLY & (0u - (c & 1u)));
		crc_table[0][i] = c;
	}
	for (uint32_t i = 0; i < 256; i++)
		for (int t = 1; t < 8; t++)
			crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xffu];
}

uint32_t kvr_crc32c_portable(uint32_t crc, const void *data, size_t n)
{
	pthread_once(&table_once, build_tables);
	const unsigned char *p = data;
	uint32_t c = ~crc;
	while (n >= 8) {
		uint64_t w;
		memcpy(&w, p, 8); /* little-endian hosts only, as the rest of the pool */
		uint32_t lo = (uint32_t)w ^ c, hi = (uint32_t)(w >> 32);
		c = crc_table[7][lo & 0xffu] ^ crc_table[6][(lo >> 8) & 0xffu] ^
		    crc_table[5][(lo >> 16) & 0xffu] ^ crc_table[4][lo >> 24] ^
		    crc_table[3][hi & 0xffu] ^ crc_table[2][(hi >> 8) & 0xffu] ^
		    crc_table[1][(hi >> 16) & 0xffu] ^ crc_table[0][hi >> 24];
		p += 8;
		n -= 8;
	}
	while (n--)
		c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xffu];
	return ~c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42(uint32_t crc, const void *data,
							     size_t n)
{
	const unsigned char *p = data;
	uint64_t c = (uint32_t)~crc;
	while (n >= 8) {
		uint64_t w;
		memcpy(&w, p, 8);
		c = __builtin_ia32_crc32di(c, w);
		p += 8;
		n -= 8;
	}
	uint32_t c32 = (uint32_t)c;
	while (n--)
		c32 = __builtin_ia32_crc32qi(c32, *p++);
	return ~c32;
}
#endif

typedef uint32_t (*crc_fn)(uint32_t, const void *, size_t);
static crc_fn chosen;
static pthread_once_t choose_once = PTHREAD_ONCE_INIT;

static void choose(void)
{
	chosen = kvr_crc32c_portable;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
	__builtin_cpu_init();
	if (__builtin_cpu_supports("sse4.2"))
		chosen = crc32c_sse42;
#endif
}

uint32_t kvr_crc32c(uint32_t crc, const void *data, size_t n)
{
	pthread_once(&choose_once, choose); /* publishes `chosen` to every caller */
	return chosen(crc, data, n);
}
