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
/* cudaemu-strict (KVR_DEV_CUDAEMU_STRICT): operations it refused so far, over
 * every strict device of the process — enqueues that returned -EFAULT, kernels
 * skipped when a worker stream reached them, frees of memory that is not a
 * device allocation. A refused operation runs nothing. */
unsigned kvr_cudaemu_strict_violations(void);
/* The most recent violation's message (as kvr_dev_last_error() gave it, for
 * one returned by the enqueue). */
void kvr_cudaemu_strict_last_violation(char *buf, size_t bytes);
/* Item pointer fields (gpu/kernels.h, KVR_ITEM_POINTERS_*) that no extent
 * check of a strict device has named so far in this process: their number,
 * and "struct.field" names, space-separated, in `names`. */
uint32_t kvr_cudaemu_strict_unchecked_fields(char *names, size_t bytes);
/* Thread order inside blocks for launches on the calling thread: 0 = natural,
 * any other value a seeded shuffle per barrier phase (gpu/cudaemu/shim.cc). */
void kvr_emu_set_order_seed(uint64_t seed);

#ifdef __cplusplus
}
#endif

#endif
