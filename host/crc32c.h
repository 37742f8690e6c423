/* SPDX-License-Identifier: MIT */
/*
 * crc32c.h — CRC32C (Castagnoli), the spill tier's per-run checksum: with
 * the SSE4.2 crc32 instruction where the CPU has it (chosen once, at first
 * use), else a table. Both give the same values (the standard CRC32C: init
 * and final xor 0xffffffff; "123456789" gives 0xe3069283). Threads: any.
 */
#ifndef KVR_HOST_CRC32C_H
#define KVR_HOST_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* CRC32C of n bytes, continuing from `crc` (0 to start). */
uint32_t kvr_crc32c(uint32_t crc, const void *data, size_t n);
/* The table version, whatever the CPU (tests hold the two to each other). */
uint32_t kvr_crc32c_portable(uint32_t crc, const void *data, size_t n);

#endif /* KVR_HOST_CRC32C_H */
