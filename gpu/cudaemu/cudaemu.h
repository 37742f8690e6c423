/* SPDX-License-Identifier: MIT */
/* cudaemu.h — what tests may ask of the cudaemu device besides backend.h. */
#ifndef KVR_GPU_CUDAEMU_H
#define KVR_GPU_CUDAEMU_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Launches that failed in the shim (deadlock, bad configuration) so far. */
unsigned kvr_cudaemu_failed_launches(void);
/* The most recent failure's message. */
void kvr_cudaemu_last_failure(char *buf, size_t bytes);
/* Thread order inside blocks for launches on the calling thread: 0 = natural,
 * any other value a seeded shuffle per barrier phase (gpu/cudaemu/shim.cc). */
void kvr_emu_set_order_seed(uint64_t seed);

#ifdef __cplusplus
}
#endif

#endif
