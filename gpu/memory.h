/* SPDX-License-Identifier: MIT */
/*
 * memory.h — the memory model the runtime builds on: where a buffer lives on
 * a device whose memory the host addresses (cpu, cudaemu) and on one whose
 * memory it cannot (cuda; cudaemu-strict in tests), and how data crosses
 * between the two. Callers say what a buffer is for; these functions decide
 * where it goes, so no code above gpu/ asks whether memory is separate.
 *
 * Five kinds of buffer:
 *  - mapped: written by the host and read by kernels, or written by kernels
 *    and read by the host after a stream synchronisation (selections,
 *    previous queries, importance sums). Page-aligned host memory, registered
 *    with a separate-memory device (pinned and mapped: a GPU reads it over
 *    the bus through unified addressing), plain host memory elsewhere.
 *  - scratch: read and written by kernels only (score buffers, the prefill's
 *    row buffers): device memory on a separate-memory device, host memory
 *    elsewhere (so the engine's device allocator need not see it).
 *  - tiles: both the host (appending tokens) and kernels address them:
 *    device memory where the host addresses it, mapped memory elsewhere.
 *  - mirrors (struct kvr_mirror): item lists and the like, which the host
 *    writes and kernels read many times. A kernel reading its items over the
 *    bus would pay the bus latency per descriptor, so on a separate-memory
 *    device a mirror has a device twin that kvr_mirror_to_device fills on
 *    the stream of the kernel that reads it; elsewhere the two views are one
 *    buffer and the copy is nothing.
 *  - stages: device copies of host arrays kernels read or write
 *    (kvr_stage_*), nothing where the device addresses host memory.
 * kvr_host_view carries data the other way: a kernel's input the host must
 * read too (the step's q, k, v).
 *
 * Threads: any; each buffer has one owner (see the callers). Copies are
 * queued on the stream the caller names and ordered like any work there.
 */
#ifndef KVR_GPU_MEMORY_H
#define KVR_GPU_MEMORY_H

#include <stddef.h>

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Mapped memory (zeroed). 0, -ENOMEM, or the device's registration error. */
int kvr_mapped_alloc(struct kvr_dev *dev, size_t bytes, void **out);
void kvr_mapped_free(struct kvr_dev *dev, void *p); /* NULL-safe */
/* Grow *buf to `need` bytes; the old contents are not kept. The caller
 * guarantees no queued work still reads the old buffer. */
int kvr_mapped_grow(struct kvr_dev *dev, void **buf, size_t *bytes, size_t need);

/* Kernel scratch, grown like kvr_mapped_grow (contents not kept). */
int kvr_scratch_grow(struct kvr_dev *dev, void **buf, size_t *bytes, size_t need);
/* The size to regrow a `have`-byte buffer to for `need` bytes: at least
 * double, so a buffer that follows a growing context (a page at a time)
 * regrows a logarithmic number of times; on a GPU each regrowth is a
 * cudaMalloc and a cudaFree, which waits for the whole device. */
static inline size_t kvr_grown_bytes(size_t have, size_t need)
{
	return 2 * have > need ? 2 * have : need;
}
void kvr_scratch_free(struct kvr_dev *dev, void *p); /* NULL-safe */

/* Tail tiles: the host appends into them and kernels read them. */
int kvr_tile_alloc(struct kvr_dev *dev, size_t bytes, void **out);
void kvr_tile_free(struct kvr_dev *dev, void *p); /* NULL-safe */

/* A mirrored buffer: the host's view and the kernels' view of the same
 * bytes, one buffer where the device addresses host memory. */
struct kvr_mirror {
	void *host;   /* mapped memory: the host writes (or reads) here */
	void *dev;    /* what kernels are given: `host` itself, or its device twin */
	size_t bytes; /* of each view */
};

/* Grow both views to `need` bytes (contents not kept; no queued work may
 * read the old ones). 0, -ENOMEM, or the device's error. */
int kvr_mirror_grow(struct kvr_dev *dev, struct kvr_mirror *m, size_t need);
void kvr_mirror_free(struct kvr_dev *dev, struct kvr_mirror *m); /* zeroes *m */

/* The kernels' view of `host_at`, an address inside m's host view. */
static inline void *kvr_mirror_dev_at(const struct kvr_mirror *m, const void *host_at)
{
	return (unsigned char *)m->dev + ((const unsigned char *)host_at - (const unsigned char *)m->host);
}

/* Make `bytes` of the host view at `host_at` what kernels queued next on
 * `stream` read in the device view: a copy on a separate-memory device,
 * nothing elsewhere. */
int kvr_mirror_to_device(struct kvr_dev *dev, const struct kvr_mirror *m, const void *host_at, size_t bytes,
			 struct kvr_stream *stream);

/* The host's view of `bytes` of kernel memory at `src` (a kernel's input the
 * host must also read): `src` itself where the host addresses device memory;
 * else `stage` + `off` (mapped memory from kvr_host_stage_grow, which
 * allocates nothing elsewhere; freed with kvr_mapped_free), filled by a copy
 * queued on `stream` that the caller synchronises before reading. */
int kvr_host_stage_grow(struct kvr_dev *dev, void **stage, size_t *bytes, size_t need);
int kvr_host_view(struct kvr_dev *dev, void *stage, size_t off, const void *src, size_t bytes,
		  struct kvr_stream *stream, const void **view);

/* Host arrays kernels read or write (prefill's query and output rows):
 * where the device addresses host memory the kernels take the host array
 * itself; elsewhere they go through a device stage. kvr_stage_grow grows the
 * stage (device memory; nothing where none is needed; contents not kept). */
int kvr_stage_grow(struct kvr_dev *dev, void **stage, size_t *bytes, size_t need);
void kvr_stage_free(struct kvr_dev *dev, void *stage); /* NULL-safe */
/* The kernels' view of `bytes` of host memory at `src`: `src`, or the stage
 * filled by a copy queued on `stream`. */
int kvr_stage_in(struct kvr_dev *dev, void *stage, const void *src, size_t bytes, struct kvr_stream *stream,
		 const void **view);
/* Where kernels write host memory `dst`: `dst`, or the stage, which
 * kvr_stage_out then copies to `dst` on `stream` (nothing when they are one). */
void *kvr_stage_out_view(struct kvr_dev *dev, void *stage, void *dst);
int kvr_stage_out(struct kvr_dev *dev, void *dst, const void *view, size_t bytes, struct kvr_stream *stream);

#ifdef __cplusplus
}
#endif

#endif
