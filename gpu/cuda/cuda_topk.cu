/* SPDX-License-Identifier: MIT */
/*
 * cuda_topk.cu — the cuda backend's top-k behind one wrapper,
 * kvr_cuda_select_topk: either CUB (a segmented radix sort of 64-bit keys,
 * then a small kernel that takes the first k of each segment in page order)
 * or the hand-written twin in cuda_score.cu (KVR_KERNEL_SYMBOL(launch_select),
 * the one cudaemu runs). Both compute kernels.h's select bit for bit: rank by
 * ordered(score), ties to the lower page index, output in ascending page
 * order, -1 for unused entries, nothing written when k = 0.
 *
 * CUB is kept in this one file (it costs ~10 s of compile time per
 * architecture) and is compiled by nvcc only. Its device scratch (keys, their
 * sorted copy, segment offsets, CUB's temporary storage) belongs to a
 * kvr_cuda_topk per stream, created by the backend with the stream: it grows,
 * stream-ordered (cudaFreeAsync/cudaMallocAsync), only when a call needs more,
 * and is never allocated per call.
 *
 * Threads and streams: a kvr_cuda_topk is used by the thread that owns its
 * stream, one call at a time; a call enqueues its kernels and CUB's on that
 * stream and returns without synchronising.
 */
#include <cuda_runtime.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "cuda_compat.h"
#include "../kernels.h"

extern "C" {
int KVR_KERNEL_SYMBOL(launch_select)(const struct kvr_shape *shape,
				     const struct kvr_score_item *items, uint32_t n, void *stream);
const char *KVR_KERNEL_SYMBOL(last_message)(void);
}

/* Per-stream device scratch of the CUB path. */
struct kvr_cuda_topk {
	void *buf;
	size_t bytes;
	bool pooled; /* buf came from cudaMallocAsync (else cudaMalloc) */
	/* CUB's temporary-storage size for the last geometry queried */
	int num_items, num_segments, end_bit;
	size_t temp_bytes;
};

static const uint32_t TOPK_THREADS = 256;
static const uint32_t TOPK_WORDS_PER_THREAD = 4; /* bitmap words per thread per round */
/* The finishing kernel marks the chosen candidates in a shared-memory bitmap:
 * 48 KiB of it covers 393216 candidates; larger sets use the twin. */
static const uint32_t TOPK_MAX_CAND = 48u * 1024u * 8u;

static int topk_fail(char *msg, size_t msg_bytes, int err, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

static int topk_fail(char *msg, size_t msg_bytes, int err, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, msg_bytes, fmt, ap);
	va_end(ap);
	return err;
}

/* A failed CUDA call here is the call's failure; the error is cleared so that
 * it does not resurface in an unrelated later call on this thread. */
static int topk_cuda_fail(char *msg, size_t msg_bytes, cudaError_t e, const char *call)
{
	(void)cudaGetLastError();
	return topk_fail(msg, msg_bytes, e == cudaErrorMemoryAllocation ? -ENOMEM : -EIO,
			 "select (CUB): %s: %s", call, cudaGetErrorName(e));
}

extern "C" struct kvr_cuda_topk *kvr_cuda_topk_create(void)
{
	return static_cast<struct kvr_cuda_topk *>(calloc(1, sizeof(struct kvr_cuda_topk)));
}

/* Frees the scratch after the work queued on `stream` (the stream it was used
 * on) has finished. */
extern "C" void kvr_cuda_topk_destroy(struct kvr_cuda_topk *t, void *stream)
{
	if (!t)
		return;
	if (t->buf) {
		if (t->pooled)
			(void)cudaFreeAsync(t->buf, static_cast<cudaStream_t>(stream));
		else
			(void)cudaFree(t->buf);
		(void)cudaGetLastError();
	}
	free(t);
}

/* ------------------------------------------------------------------ kernels */

/* kernels.h's ordered(score); the twin's score_key. */
static __device__ __forceinline__ uint32_t ordered_key(float x)
{
	const uint32_t u = __float_as_uint(x);
	return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* True when (item, head) needs the sort: k > 0 and fewer than all candidates. */
static __device__ __forceinline__ bool needs_sort(const struct kvr_score_item &it)
{
	const uint32_t n_cand = it.cand_end > it.cand_begin ? it.cand_end - it.cand_begin : 0u;
	return it.k != 0 && it.k < n_cand;
}

/*
 * One block per segment s = item · n_kv + m, laid out at s · stride in the key
 * array: key = ordered(score) << index_bits | (index_mask - r), so a
 * descending sort puts higher scores first and, among equal scores, lower
 * candidate indices first. Segments that need no sort are given no keys.
 */
static __global__ void topk_keys_kernel(struct kvr_shape shape, const struct kvr_score_item *items,
					uint32_t stride, uint32_t index_bits, uint64_t *keys,
					int *begin, int *end)
{
	const uint32_t s = blockIdx.x, m = s % shape.n_kv_heads;
	const struct kvr_score_item it = items[s / shape.n_kv_heads];
	const bool sort = needs_sort(it) && !kvr_score_gated_off(&it, shape.n_kv_heads);
	const uint32_t n_cand = sort ? it.cand_end - it.cand_begin : 0u;
	const uint64_t first = (uint64_t)s * stride;
	if (threadIdx.x == 0) {
		begin[s] = (int)first;
		end[s] = (int)(first + n_cand);
	}
	const float *scores = it.scores + (uint64_t)m * n_cand;
	const uint64_t index_mask = (1ull << index_bits) - 1;
	for (uint32_t r = threadIdx.x; r < n_cand; r += blockDim.x)
		keys[first + r] = (uint64_t)ordered_key(scores[r]) << index_bits | (index_mask - r);
}

/*
 * One block per segment: mark the first take = min(k, n_cand) sorted keys'
 * candidates in a shared bitmap, then walk the bitmap in order (a block scan
 * of per-thread popcounts gives each thread its output position), so the
 * pages come out ascending. Segments that needed no sort take every candidate.
 */
static __global__ void topk_finish_kernel(struct kvr_shape shape,
					  const struct kvr_score_item *items, uint32_t stride,
					  uint32_t index_bits, const uint64_t *sorted)
{
	typedef cub::BlockScan<uint32_t, TOPK_THREADS> block_scan;
	__shared__ typename block_scan::TempStorage scan_tmp;
	KVR_DYNAMIC_SHARED(uint32_t, bitmap);

	const uint32_t s = blockIdx.x, m = s % shape.n_kv_heads;
	const struct kvr_score_item it = items[s / shape.n_kv_heads];
	const uint32_t k = it.k;
	if (k == 0 || kvr_score_gated_off(&it, shape.n_kv_heads))
		return;
	const uint32_t n_cand = it.cand_end > it.cand_begin ? it.cand_end - it.cand_begin : 0u;
	const uint32_t take = k < n_cand ? k : n_cand;
	int32_t *out = it.selected + (uint64_t)m * k;
	const uint32_t tid = threadIdx.x;
	if (take == n_cand) {
		for (uint32_t r = tid; r < n_cand; r += TOPK_THREADS)
			out[r] = (int32_t)(it.cand_begin + r);
	} else {
		const uint32_t words = (n_cand + 31) / 32;
		for (uint32_t w = tid; w < words; w += TOPK_THREADS)
			bitmap[w] = 0;
		__syncthreads();
		const uint64_t index_mask = (1ull << index_bits) - 1;
		const uint64_t *keys = sorted + (uint64_t)s * stride;
		for (uint32_t i = tid; i < take; i += TOPK_THREADS) {
			const uint32_t r = (uint32_t)(index_mask - (keys[i] & index_mask));
			atomicOr(&bitmap[r / 32], 1u << (r % 32));
		}
		__syncthreads();
		uint32_t done = 0;
		for (uint32_t base = 0; base < words; base += TOPK_THREADS * TOPK_WORDS_PER_THREAD) {
			const uint32_t w0 = base + tid * TOPK_WORDS_PER_THREAD;
			uint32_t bits[TOPK_WORDS_PER_THREAD], count = 0;
#pragma unroll
			for (uint32_t e = 0; e < TOPK_WORDS_PER_THREAD; e++) {
				bits[e] = w0 + e < words ? bitmap[w0 + e] : 0u;
				count += (uint32_t)__popc(bits[e]);
			}
			uint32_t pos, total;
			block_scan(scan_tmp).ExclusiveSum(count, pos, total);
			pos += done;
#pragma unroll
			for (uint32_t e = 0; e < TOPK_WORDS_PER_THREAD; e++)
				for (uint32_t b = bits[e]; b; b &= b - 1)
					out[pos++] = (int32_t)(it.cand_begin + (w0 + e) * 32 +
							       (uint32_t)(__ffs((int)b) - 1));
			done += total;
			__syncthreads(); /* scan_tmp is reused */
		}
	}
	for (uint32_t i = take + tid; i < k; i += TOPK_THREADS)
		out[i] = -1;
}

/* ------------------------------------------------------------------- wrapper */

static size_t align_up(size_t x)
{
	return (x + 255) & ~(size_t)255;
}

/* Make t->buf at least `bytes`, stream-ordered after earlier work on s. */
static int topk_reserve(struct kvr_cuda_topk *t, size_t bytes, cudaStream_t s, char *msg,
			size_t msg_bytes)
{
	if (t->bytes >= bytes)
		return 0;
	const size_t want = bytes + bytes / 2; /* grow geometrically */
	if (t->buf) {
		const cudaError_t e = t->pooled ? cudaFreeAsync(t->buf, s) : cudaFree(t->buf);
		t->buf = NULL;
		t->bytes = 0;
		if (e != cudaSuccess)
			return topk_cuda_fail(msg, msg_bytes, e, "freeing the scratch");
	}
	cudaError_t e = cudaMallocAsync(&t->buf, want, s);
	t->pooled = e == cudaSuccess;
	if (e == cudaErrorNotSupported) { /* a device without memory pools */
		(void)cudaGetLastError();
		e = cudaMalloc(&t->buf, want);
	}
	if (e != cudaSuccess) {
		t->buf = NULL;
		return topk_cuda_fail(msg, msg_bytes, e, "allocating the scratch");
	}
	t->bytes = want;
	return 0;
}

static int twin(const struct kvr_shape *shape, const struct kvr_score_item *items, uint32_t n,
		void *stream, char *msg, size_t msg_bytes)
{
	const int rc = KVR_KERNEL_SYMBOL(launch_select)(shape, items, n, stream);
	if (rc)
		snprintf(msg, msg_bytes, "%s", KVR_KERNEL_SYMBOL(last_message)());
	return rc;
}

/*
 * items: the item array in device memory (what the kernels read).
 * items_host: the same items in host memory, or NULL. CUB needs host-side
 * sizes (its launch geometry and the scratch are sized on the host), so
 * without them, or when a segment is too large for the finishing kernel's
 * bitmap, or the key array would pass CUB's int range, the twin runs.
 * scratch: the stream's kvr_cuda_topk (NULL also selects the twin).
 * Returns 0 or a negative errno with a message in msg.
 */
extern "C" int kvr_cuda_select_topk(const struct kvr_shape *shape,
				    const struct kvr_score_item *items,
				    const struct kvr_score_item *items_host, uint32_t n,
				    struct kvr_cuda_topk *scratch, void *stream, char *msg,
				    size_t msg_bytes)
{
	if (!items_host || !scratch || !shape || n == 0)
		return twin(shape, items, n, stream, msg, msg_bytes);
	if (shape->n_kv_heads == 0)
		return topk_fail(msg, msg_bytes, -EINVAL, "select (CUB): no KV heads");
	uint32_t max_cand = 0;
	for (uint32_t i = 0; i < n; i++) {
		const struct kvr_score_item *it = &items_host[i];
		const uint32_t n_cand = it->cand_end > it->cand_begin ? it->cand_end - it->cand_begin
								      : 0u;
		if (it->k != 0 && it->k < n_cand && n_cand > max_cand)
			max_cand = n_cand;
	}
	const uint64_t segments = (uint64_t)n * shape->n_kv_heads;
	const uint64_t total = segments * max_cand;
	if (max_cand > TOPK_MAX_CAND || total > 0x7fffffffull || segments > 0x7fffffffull)
		return twin(shape, items, n, stream, msg, msg_bytes);

	const cudaStream_t s = static_cast<cudaStream_t>(stream);
	const uint32_t grid = (uint32_t)segments;
	if (max_cand == 0) { /* every segment takes all of its candidates, or none */
		KVR_LAUNCH(topk_finish_kernel, grid, TOPK_THREADS, 0, stream, *shape, items, 0u, 1u,
			   (const uint64_t *)NULL);
		const cudaError_t e = cudaGetLastError();
		return e == cudaSuccess ? 0 : topk_cuda_fail(msg, msg_bytes, e, "finish kernel launch");
	}

	uint32_t index_bits = 1;
	while (index_bits < 32 && (1ull << index_bits) < max_cand)
		index_bits++;
	const int end_bit = 32 + (int)index_bits;
	const int num_items = (int)total, num_segments = (int)segments;

	/* CUB's temporary storage: a host-side size computation, redone only
	 * when the geometry changes */
	if (scratch->num_items != num_items || scratch->num_segments != num_segments ||
	    scratch->end_bit != end_bit) {
		cub::DoubleBuffer<uint64_t> none(NULL, NULL);
		size_t temp_bytes = 0;
		const cudaError_t e = cub::DeviceSegmentedRadixSort::SortKeysDescending(
			NULL, temp_bytes, none, num_items, num_segments, (const int *)NULL,
			(const int *)NULL, 0, end_bit, s);
		if (e != cudaSuccess)
			return topk_cuda_fail(msg, msg_bytes, e, "CUB temporary-storage query");
		scratch->num_items = num_items;
		scratch->num_segments = num_segments;
		scratch->end_bit = end_bit;
		scratch->temp_bytes = temp_bytes;
	}
	const size_t keys_bytes = align_up((size_t)total * sizeof(uint64_t));
	const size_t offs_bytes = align_up((size_t)segments * sizeof(int));
	int rc = topk_reserve(scratch, 2 * keys_bytes + 2 * offs_bytes + scratch->temp_bytes, s, msg,
			      msg_bytes);
	if (rc)
		return rc;
	unsigned char *p = static_cast<unsigned char *>(scratch->buf);
	uint64_t *keys = reinterpret_cast<uint64_t *>(p);
	uint64_t *keys_alt = reinterpret_cast<uint64_t *>(p + keys_bytes);
	int *begin = reinterpret_cast<int *>(p + 2 * keys_bytes);
	int *end = reinterpret_cast<int *>(p + 2 * keys_bytes + offs_bytes);
	void *temp = p + 2 * keys_bytes + 2 * offs_bytes;

	KVR_LAUNCH(topk_keys_kernel, grid, TOPK_THREADS, 0, stream, *shape, items, max_cand,
		   index_bits, keys, begin, end);
	cudaError_t e = cudaGetLastError();
	if (e != cudaSuccess)
		return topk_cuda_fail(msg, msg_bytes, e, "key kernel launch");
	cub::DoubleBuffer<uint64_t> db(keys, keys_alt);
	size_t temp_bytes = scratch->temp_bytes;
	e = cub::DeviceSegmentedRadixSort::SortKeysDescending(
		temp, temp_bytes, db, num_items, num_segments, (const int *)begin, (const int *)end, 0,
		end_bit, s);
	if (e != cudaSuccess)
		return topk_cuda_fail(msg, msg_bytes, e, "cub::DeviceSegmentedRadixSort");
	const size_t bitmap_bytes = (size_t)(max_cand + 31) / 32 * sizeof(uint32_t);
	KVR_LAUNCH(topk_finish_kernel, grid, TOPK_THREADS, bitmap_bytes, stream, *shape, items,
		   max_cand, index_bits, (const uint64_t *)db.Current());
	e = cudaGetLastError();
	return e == cudaSuccess ? 0 : topk_cuda_fail(msg, msg_bytes, e, "finish kernel launch");
}
