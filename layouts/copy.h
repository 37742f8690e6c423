/* SPDX-License-Identifier: MIT */
/*
 * copy.h — bulk copies for recall's host side: page runs gathered from the
 * pool into staging. Streaming (non-temporal) stores keep the destination from
 * being read for ownership first — a plain memcpy of a 16 KiB run reads the
 * destination lines it is about to overwrite, 50% more memory traffic than the
 * copy itself — and from evicting the working set; the next run of a known
 * list is prefetched while the current one is copied. Host-only, thread-safe.
 */
#ifndef KVR_LAYOUTS_COPY_H
#define KVR_LAYOUTS_COPY_H

#include <stddef.h>

/*
 * Copy `bytes` from src to dst with streaming stores, prefetching `next`
 * (the source of the following copy, or NULL) in step. dst and src should be
 * 64-byte aligned and bytes a multiple of 64 for the fast path; anything else
 * falls back to memcpy. Ends with a store fence, so the data is visible to
 * other threads (and DMA) once the call returns.
 */
void kvr_copy_stream(void *dst, const void *src, size_t bytes, const void *next);

/* Same, for a list: copy n runs of `bytes` each from srcs[i] to dst + i*bytes,
 * each prefetching the next. */
void kvr_copy_stream_gather(void *dst, const void *const *srcs, size_t n, size_t bytes);

#endif /* KVR_LAYOUTS_COPY_H */
