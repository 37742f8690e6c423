/* SPDX-License-Identifier: MIT */
/*
 * kernel_launchers.h — the C-linkage launchers of the CUDA kernel files
 * (cuda_copy.cu, cuda_score.cu, cuda_attention.cu), declared once. The kernel
 * files include it, so a definition that drifts from its declaration no
 * longer compiles (extern "C" names carry no signature, so a drift used to
 * link); the cuda backend and cudaemu include it instead of copying the
 * prototypes.
 *
 * KVR_KERNEL_SYMBOL(name) names the entry points: kvr_cuda_<name> in the
 * nvcc build, kvr_emu_<name> in cudaemu's (cuda_compat.h; C callers define
 * it before including this header). Every launcher runs on the calling host
 * thread and enqueues on `stream`; cuda_common.cuh says what they share.
 */
#ifndef KVR_GPU_KERNEL_LAUNCHERS_H
#define KVR_GPU_KERNEL_LAUNCHERS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

#ifndef KVR_KERNEL_SYMBOL
#error "define KVR_KERNEL_SYMBOL (cuda_compat.h) before including kernel_launchers.h"
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* the calling thread's message for the last launcher that failed */
const char *KVR_KERNEL_SYMBOL(last_message)(void);

/* cuda_copy.cu */
int KVR_KERNEL_SYMBOL(launch_scatter)(const struct kvr_shape *shape,
				      const struct kvr_scatter_item *items, uint32_t n, void *stream);
int KVR_KERNEL_SYMBOL(launch_offload)(const struct kvr_shape *shape,
				      const struct kvr_page_item *items, uint32_t n, void *stream);
int KVR_KERNEL_SYMBOL(launch_summarize)(const struct kvr_shape *shape,
					const struct kvr_page_item *items, uint32_t n,
					void *stream);
int KVR_KERNEL_SYMBOL(launch_freelist)(const struct kvr_freelist_item *items, uint32_t n,
				       void *stream);
int KVR_KERNEL_SYMBOL(launch_plan)(const struct kvr_shape *shape, const struct kvr_plan_item *items,
				   uint32_t n, void *stream);
int KVR_KERNEL_SYMBOL(launch_append)(const struct kvr_shape *shape, const struct kvr_append_item *items,
				     uint32_t n, void *stream);

/* cuda_score.cu: score needs scratch_bytes of scratch sized by
 * score_scratch_bytes for sm_count multiprocessors (cache_pages pages per
 * query head kept between its passes) */
size_t KVR_KERNEL_SYMBOL(score_scratch_bytes)(const struct kvr_shape *shape, uint32_t n,
					      uint32_t sm_count, uint32_t cache_pages);
int KVR_KERNEL_SYMBOL(launch_score_scratch)(const struct kvr_shape *shape,
					    const struct kvr_score_item *items, uint32_t n,
					    void *scratch, size_t scratch_bytes, uint32_t sm_count,
					    void *stream);
int KVR_KERNEL_SYMBOL(launch_select)(const struct kvr_shape *shape,
				     const struct kvr_score_item *items, uint32_t n, void *stream);
int KVR_KERNEL_SYMBOL(launch_similarity)(const struct kvr_shape *shape,
					 const struct kvr_similarity_item *items, uint32_t n,
					 void *stream);

/* cuda_attention.cu: the split passes' scratch as for score */
size_t KVR_KERNEL_SYMBOL(attention_scratch_bytes)(const struct kvr_shape *shape, uint32_t n,
						  uint32_t sm_count);
int KVR_KERNEL_SYMBOL(launch_attention_scratch)(const struct kvr_shape *shape,
						const struct kvr_attention_item *items, uint32_t n,
						const struct kvr_kv_segment *segments,
						uint32_t n_segments, void *scratch,
						size_t scratch_bytes, uint32_t sm_count, void *stream);
int KVR_KERNEL_SYMBOL(launch_dense_scratch)(const struct kvr_shape *shape,
					    const struct kvr_dense_item *items, uint32_t n,
					    void *scratch, size_t scratch_bytes, uint32_t sm_count,
					    void *stream);

/* cudaemu only (defined with KVR_CUDAEMU): score, attention and dense with a
 * scratch buffer of the calling thread, planned for an emulated device */
int KVR_KERNEL_SYMBOL(launch_score)(const struct kvr_shape *shape,
				    const struct kvr_score_item *items, uint32_t n, void *stream);
int KVR_KERNEL_SYMBOL(launch_attention)(const struct kvr_shape *shape,
					const struct kvr_attention_item *items, uint32_t n,
					const struct kvr_kv_segment *segments, uint32_t n_segments,
					void *stream);
int KVR_KERNEL_SYMBOL(launch_dense)(const struct kvr_shape *shape,
				    const struct kvr_dense_item *items, uint32_t n, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* KVR_GPU_KERNEL_LAUNCHERS_H */
