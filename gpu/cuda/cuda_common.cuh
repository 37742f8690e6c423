/* SPDX-License-Identifier: MIT */
/*
 * cuda_common.cuh — what every kernel file shares: the includes, the register
 * and unrolling hints, the launchers' message buffer and checks, the typed
 * launch macros, and the device helpers (raw loads, f16/bf16 decoding, warp
 * reductions, row copies). The kernels live by op family, each beside its
 * launchers: cuda_copy.cu (scatter, offload, summarize, freelist),
 * cuda_score.cu (score, select, similarity), cuda_attention.cu (attention,
 * dense); kernel_launchers.h declares every launcher once.
 *
 * Each file is compiled twice: by nvcc for the cuda backend, and by the host
 * C++ compiler against the cudaemu shim (-DKVR_CUDAEMU, all three in one
 * translation unit, gpu/cudaemu/kernels.cc), so kernel bodies use only what
 * cuda_compat.h lists; the per-element math comes from layouts/ (half.h
 * conversions, summary.h's min/max step, kmath.h's kvr_expf, Quest term and
 * canonical reduction orders), which is what makes score, select and
 * similarity bit-identical to the cpu backend.
 *
 * Threads and streams: a launcher validates the shape on the calling (host)
 * thread, enqueues its kernels on the stream it is given (one; three for
 * score; two for attention and dense when they split an item's tokens over
 * several blocks) and returns; nothing here synchronises. Item arrays and
 * every pointer in them are device memory, read only by the kernels. The
 * split kernels' partial results go to a scratch buffer the caller owns (the
 * cuda backend keeps one per stream; the launchers say how large), used in
 * stream order. A failing launcher leaves its message in a thread-local
 * buffer, read back with KVR_KERNEL_SYMBOL(last_message).
 */
#ifndef KVR_CUDA_COMMON_CUH
#define KVR_CUDA_COMMON_CUH

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_compat.h"
#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif
#include "../kernels.h"
#include "../../layouts/freelist.h"
#include "../../layouts/half.h"
#include "../../layouts/kmath.h"
#include "../../layouts/page.h"
#include "../../layouts/summary.h"
#include "../kernel_launchers.h"

/* Register budget hints exist only for nvcc; cudaemu has no registers. */
#if defined(__CUDACC__)
#define KVR_LAUNCH_BOUNDS(threads, min_blocks) __launch_bounds__(threads, min_blocks)
#else
#define KVR_LAUNCH_BOUNDS(threads, min_blocks)
#endif

#define KVR_DEV static __device__ __forceinline__

/* Full unrolling keeps small fixed-size arrays in registers under nvcc;
 * unrolling a loop of run-time length by 4 lets its loads be issued together. */
#if defined(__CUDACC__)
#define KVR_UNROLL _Pragma("unroll")
#define KVR_UNROLL4 _Pragma("unroll 4")
#define KVR_UNROLL8 _Pragma("unroll 8")
#else
#define KVR_UNROLL
#define KVR_UNROLL4
#define KVR_UNROLL8
#endif

static const unsigned FULL_MASK = 0xffffffffu;

/* ------------------------------------------------------------------ messages */

/* The calling thread's last launcher message, one buffer for every kernel
 * file: a static of an inline function is one object program-wide. */
inline char *kernel_message(void)
{
	static thread_local char message[256];
	return message;
}

static inline int kernel_fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static inline int kernel_fail(int err, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(kernel_message(), 256, fmt, ap);
	va_end(ap);
	return err;
}

/* A launch the runtime refused shows in the next cudaGetLastError (which also
 * clears it); faults inside the kernel surface later, on the stream. A refused
 * configuration is -EINVAL (a geometry validation should have caught), any
 * other error -EIO. */
static inline int launch_status(const char *kernel)
{
	const cudaError_t e = cudaGetLastError();
	if (e == cudaSuccess)
		return 0;
	const int err = (e == cudaErrorInvalidConfiguration || e == cudaErrorInvalidValue) ? -EINVAL
											     : -EIO;
#if defined(KVR_CUDAEMU)
	/* the emulator also says why (a deadlock, a divergent barrier, ...) */
	return kernel_fail(err, "%s: launch failed: %s: %s", kernel, cudaGetErrorName(e),
			   kvr_emu_last_launch_message());
#else
	return kernel_fail(err, "%s: launch failed: %s", kernel, cudaGetErrorName(e));
#endif
}

/* ------------------------------------------------------------ shared helpers */

/* 16 raw bytes: the unit of vector loads and copies (LDG.128/STG.128 under
 * nvcc when aligned). */
struct alignas(16) chunk16 {
	uint32_t w[4];
};

template <uint32_t ET> struct elem_bytes {
	static const uint32_t value = ET == KVR_ELEM_F32 ? 4u : 2u;
};

/* 16 bytes at p, aligned or not (p is always element-aligned). GPUs and the
 * hosts cudaemu runs on are little-endian, so packing 16-bit elements into
 * words low half first matches the aligned load. */
template <uint32_t ET> KVR_DEV chunk16 load_chunk(const unsigned char *p, bool aligned)
{
	if (aligned)
		return *reinterpret_cast<const chunk16 *>(p);
	chunk16 c;
	if constexpr (ET == KVR_ELEM_F32) {
		const uint32_t *w = reinterpret_cast<const uint32_t *>(p);
		for (int i = 0; i < 4; i++)
			c.w[i] = w[i];
	} else {
		const uint16_t *h = reinterpret_cast<const uint16_t *>(p);
		for (int i = 0; i < 4; i++)
			c.w[i] = (uint32_t)h[2 * i] | (uint32_t)h[2 * i + 1] << 16;
	}
	return c;
}

/*
 * f16 bits (the low 16 of h) as f32: exactly half.h's kvr_f16_to_f32, NaN
 * payloads included. Under nvcc the hardware conversion (exact, one
 * instruction where half.h's takes a dozen and a loop for subnormals), with
 * half.h's NaN, since the hardware returns a canonical one.
 */
KVR_DEV float f16_to_f32(uint32_t h)
{
#if defined(__CUDA_ARCH__)
	/* a select, not a branch: a branch on loaded bits makes the warp wait
	 * for that load before it can issue the next one */
	const uint32_t hw = __float_as_uint(__half2float(__ushort_as_half((unsigned short)h)));
	const uint32_t nan = (h & 0x8000u) << 16 | 0x7fc00000u | (h & 0x3ffu) << 13;
	return __uint_as_float((h & 0x7fffu) > 0x7c00u ? nan : hw);
#else
	return kvr_f16_to_f32((uint16_t)h);
#endif
}

/* Element i of an array of element type ET as raw bits, and bits as f32
 * (kvr_load_f32's values): loading a batch of raw elements before converting
 * any keeps all the loads in flight together. */
template <uint32_t ET> KVR_DEV uint32_t load_bits(const void *p, uint64_t i)
{
	if constexpr (ET == KVR_ELEM_F32)
		return static_cast<const uint32_t *>(p)[i];
	else
		return static_cast<const uint16_t *>(p)[i];
}

template <uint32_t ET> KVR_DEV float bits_to_f32(uint32_t b)
{
	if constexpr (ET == KVR_ELEM_F32)
		return kvr_bits_to_f32(b);
	else if constexpr (ET == KVR_ELEM_F16)
		return f16_to_f32(b);
	else
		return kvr_bf16_to_f32((uint16_t)b);
}

template <uint32_t ET> KVR_DEV float load_elem(const void *p, uint64_t i)
{
	return bits_to_f32<ET>(load_bits<ET>(p, i));
}

/* The 16 / elem_bytes values of a chunk as f32, with half.h's conversions. */
template <uint32_t ET> KVR_DEV void decode_chunk(const chunk16 &c, float *out)
{
	for (int i = 0; i < 4; i++) {
		if constexpr (ET == KVR_ELEM_F32) {
			out[i] = kvr_bits_to_f32(c.w[i]);
		} else if constexpr (ET == KVR_ELEM_F16) {
			out[2 * i] = f16_to_f32(c.w[i] & 0xffffu);
			out[2 * i + 1] = f16_to_f32(c.w[i] >> 16);
		} else {
			out[2 * i] = kvr_bf16_to_f32((uint16_t)(c.w[i] & 0xffffu));
			out[2 * i + 1] = kvr_bf16_to_f32((uint16_t)(c.w[i] >> 16));
		}
	}
}

/* Index of the highest set bit; x != 0. */
KVR_DEV uint32_t top_bit(uint32_t x)
{
#if defined(__CUDA_ARCH__)
	return 31u - (uint32_t)__clz((int)x);
#else
	return 31u - (uint32_t)__builtin_clz(x);
#endif
}

KVR_DEV float warp_max(float v)
{
	for (unsigned o = 16; o >= 1; o /= 2)
		v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, (int)o));
	return v;
}

KVR_DEV float warp_sum(float v)
{
	for (unsigned o = 16; o >= 1; o /= 2)
		v += __shfl_xor_sync(FULL_MASK, v, (int)o);
	return v;
}

/*
 * Copy `rows` rows of row_bytes bytes between strided places with the whole
 * block, in the widest unit every address and stride allows (16, 4 or 2
 * bytes; elements are at least 2-byte aligned). Byte copies: the element type
 * does not matter.
 */
template <typename U>
KVR_DEV void copy_rows_as(unsigned char *dst, uint64_t dst_stride, const unsigned char *src,
			  uint64_t src_stride, uint32_t rows, uint32_t row_bytes)
{
	const uint32_t per_row = row_bytes / (uint32_t)sizeof(U), total = rows * per_row;
	for (uint32_t i = threadIdx.x; i < total; i += blockDim.x) {
		const uint32_t r = i / per_row, c = i - r * per_row;
		reinterpret_cast<U *>(dst + r * dst_stride)[c] =
			reinterpret_cast<const U *>(src + r * src_stride)[c];
	}
}

KVR_DEV void copy_rows(unsigned char *dst, uint64_t dst_stride, const unsigned char *src,
		       uint64_t src_stride, uint32_t rows, uint32_t row_bytes)
{
	const uint64_t a = (uint64_t)(uintptr_t)dst | (uint64_t)(uintptr_t)src | dst_stride |
			   src_stride | row_bytes;
	if ((a & 15u) == 0)
		copy_rows_as<chunk16>(dst, dst_stride, src, src_stride, rows, row_bytes);
	else if ((a & 3u) == 0)
		copy_rows_as<uint32_t>(dst, dst_stride, src, src_stride, rows, row_bytes);
	else
		copy_rows_as<uint16_t>(dst, dst_stride, src, src_stride, rows, row_bytes);
}

static const uint32_t SCAN_THREADS = 256;
static const uint32_t SCAN_WARPS = SCAN_THREADS / 32;

/* Inclusive prefix sum over the block's threads (in thread order); *total gets
 * the block's sum. Every thread of a SCAN_THREADS block calls it; warp_s holds
 * SCAN_WARPS words. Used by select's passes and attention's segment scan. */
KVR_DEV uint32_t block_scan(uint32_t v, uint32_t *warp_s, uint32_t *total)
{
	const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
	for (uint32_t o = 1; o < 32; o *= 2) {
		const uint32_t y = __shfl_sync(FULL_MASK, v, (int)(lane >= o ? lane - o : lane));
		if (lane >= o)
			v += y;
	}
	if (lane == 31)
		warp_s[warp] = v;
	__syncthreads();
	uint32_t before = 0, sum = 0;
	for (uint32_t w = 0; w < SCAN_WARPS; w++) {
		const uint32_t t = warp_s[w];
		if (w < warp)
			before += t;
		sum += t;
	}
	*total = sum;
	__syncthreads(); /* warp_s is free again */
	return v + before;
}

/* ---------------------------------------------------------------- launchers */

/* Common shape checks; `what` names the kernel in the message. */
static inline int check_shape(const struct kvr_shape *s, const char *what)
{
	if (!s)
		return kernel_fail(-EINVAL, "%s: no shape", what);
	if (s->elem_type > KVR_ELEM_F32)
		return kernel_fail(-EINVAL, "%s: unknown element type %u", what, s->elem_type);
	if (s->n_kv_heads == 0 || s->n_qo_heads == 0 || s->n_qo_heads % s->n_kv_heads != 0)
		return kernel_fail(-EINVAL, "%s: %u query heads do not form groups over %u KV heads",
				   what, s->n_qo_heads, s->n_kv_heads);
	if (s->head_dim == 0)
		return kernel_fail(-EINVAL, "%s: head_dim is 0", what);
	return 0;
}

/* Blocks = n · per_item, within a 1-D grid. */
static inline int grid_size(uint32_t n, uint64_t per_item, const char *what, uint32_t *grid)
{
	const uint64_t g = (uint64_t)n * per_item;
	if (g > 0x7fffffffull)
		return kernel_fail(-EINVAL, "%s: %llu blocks exceed the grid limit", what,
				   (unsigned long long)g);
	*grid = (uint32_t)g;
	return 0;
}

/* The prologue of a launcher over n items: the shape checked (page_tokens
 * too, for the page kernels), then one block per item or per item and KV
 * head. *grid = 0, with 0 returned, when there is nothing to launch. */
static inline int items_grid(const struct kvr_shape *s, uint32_t n, bool per_kv_head,
			     bool needs_page_tokens, const char *what, uint32_t *grid)
{
	*grid = 0;
	const int rc = check_shape(s, what);
	if (rc)
		return rc;
	if (needs_page_tokens && s->page_tokens == 0)
		return kernel_fail(-EINVAL, "%s: page_tokens is 0", what);
	if (n == 0)
		return 0;
	return grid_size(n, per_kv_head ? s->n_kv_heads : 1, what, grid);
}

#define KVR_LAUNCH_TYPED(kernel, et, grid, block, smem, stream, ...)                       \
	do {                                                                                 \
		switch (et) {                                                                \
		case KVR_ELEM_F16:                                                           \
			KVR_LAUNCH(kernel<KVR_ELEM_F16>, grid, block, smem, stream, __VA_ARGS__);  \
			break;                                                               \
		case KVR_ELEM_BF16:                                                          \
			KVR_LAUNCH(kernel<KVR_ELEM_BF16>, grid, block, smem, stream, __VA_ARGS__); \
			break;                                                               \
		default:                                                                     \
			KVR_LAUNCH(kernel<KVR_ELEM_F32>, grid, block, smem, stream, __VA_ARGS__);  \
			break;                                                               \
		}                                                                            \
	} while (0)

/* The same with a second template argument (a compile-time count). */
#define KVR_TARGS(a, b) a, b
#define KVR_LAUNCH_TYPED2(kernel, et, n, grid, block, smem, stream, ...)                     \
	do {                                                                                 \
		switch (et) {                                                                \
		case KVR_ELEM_F16:                                                           \
			KVR_LAUNCH(kernel<KVR_TARGS(KVR_ELEM_F16, n)>, grid, block, smem, stream,  \
				   __VA_ARGS__);                                             \
			break;                                                               \
		case KVR_ELEM_BF16:                                                          \
			KVR_LAUNCH(kernel<KVR_TARGS(KVR_ELEM_BF16, n)>, grid, block, smem, stream, \
				   __VA_ARGS__);                                             \
			break;                                                               \
		default:                                                                     \
			KVR_LAUNCH(kernel<KVR_TARGS(KVR_ELEM_F32, n)>, grid, block, smem, stream,  \
				   __VA_ARGS__);                                             \
			break;                                                               \
		}                                                                            \
	} while (0)


#if defined(KVR_CUDAEMU)
/*
 * cudaemu's launchers (gpu/cudaemu/backend.c): device memory is host memory
 * and a launch runs to completion before its launcher returns, so the
 * scratch is a buffer of the calling thread. The emulated device plans for
 * EMU_SM_COUNT SMs, which cuts even the conformance suite's short items into
 * several splits, and caches EMU_SCORE_CACHE pages per query head, fewer than
 * the suite's longest candidate range, so both score paths run.
 */
static const uint32_t EMU_SM_COUNT = 16;
static const uint32_t EMU_SCORE_CACHE = KVR_SUM_LANES;

/* one buffer per thread for every kernel file (inline: one object) */
inline void *emu_scratch(size_t bytes, size_t *have)
{
	struct buffer {
		void *p = nullptr;
		size_t bytes = 0;
		~buffer() { free(p); }
	};
	static thread_local buffer buf;
	if (bytes > buf.bytes) {
		free(buf.p);
		buf.p = malloc(bytes);
		buf.bytes = buf.p ? bytes : 0;
	}
	*have = buf.bytes;
	return buf.p;
}
#endif

#endif /* KVR_CUDA_COMMON_CUH */
