/* SPDX-License-Identifier: MIT */
/*
 * cuda_kernels.cu — every kernel of kernels.h (scatter, offload, summarize,
 * score, select, similarity, attention, dense, freelist) and one C-linkage launcher per
 * kernel. The file is compiled twice: by nvcc for the cuda backend, and by the
 * host C++ compiler against the cudaemu shim (-DKVR_CUDAEMU), so kernel bodies
 * use only what cuda_compat.h lists; the per-element math comes from layouts/
 * (half.h conversions, summary.h's min/max step, kmath.h's kvr_expf, Quest
 * term and canonical reduction orders), which is what makes score, select and
 * similarity bit-identical to the cpu backend. select here is the hand-written
 * top-k; cuda_topk.cu holds its CUB twin behind kvr_cuda_select_topk.
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
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_compat.h"
#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif
#include "kernels.h"
#include "../layouts/freelist.h"
#include "../layouts/half.h"
#include "../layouts/kmath.h"
#include "../layouts/page.h"
#include "../layouts/summary.h"

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
#else
#define KVR_UNROLL
#define KVR_UNROLL4
#endif

static const unsigned FULL_MASK = 0xffffffffu;

/* ------------------------------------------------------------------ messages */

static thread_local char kernel_message[256];

static int kernel_fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int kernel_fail(int err, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(kernel_message, sizeof(kernel_message), fmt, ap);
	va_end(ap);
	return err;
}

extern "C" const char *KVR_KERNEL_SYMBOL(last_message)(void)
{
	return kernel_message;
}

/* A launch the runtime refused shows in the next cudaGetLastError (which also
 * clears it); faults inside the kernel surface later, on the stream. A refused
 * configuration is -EINVAL (a geometry validation should have caught), any
 * other error -EIO. */
static int launch_status(const char *kernel)
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

/* ------------------------------------------------------------------ scatter */

/* One block per item: the run's p key rows and p value rows, each d elements,
 * into column kv_head of the two NHD tiles. An out-of-range kv_head (the host
 * validates items; the device cannot report) writes nothing. */
static const uint32_t COPY_THREADS = 256;

static __global__ void KVR_LAUNCH_BOUNDS(COPY_THREADS, 4)
	scatter_kernel(struct kvr_shape shape, const struct kvr_scatter_item *items)
{
	const struct kvr_scatter_item it = items[blockIdx.x];
	if (it.kv_head >= shape.n_kv_heads)
		return;
	struct kvr_page_geometry g;
	kvr_page_geometry_init(&g, shape.page_tokens, shape.head_dim, shape.n_kv_heads,
			       shape.elem_type);
	const uint32_t row_bytes = g.head_dim * g.elem_bytes;
	const uint64_t tile_row = (uint64_t)g.n_kv_heads * row_bytes;
	const uint64_t col = kvr_nhd_index(&g, 0, it.kv_head, 0) * g.elem_bytes;
	const unsigned char *run = static_cast<const unsigned char *>(it.run);
	copy_rows(static_cast<unsigned char *>(it.k_tile) + col, tile_row,
		  run + kvr_hnd_index(&g, 0, KVR_KEYS, 0, 0) * g.elem_bytes, row_bytes,
		  g.page_tokens, row_bytes);
	copy_rows(static_cast<unsigned char *>(it.v_tile) + col, tile_row,
		  run + kvr_hnd_index(&g, 0, KVR_VALUES, 0, 0) * g.elem_bytes, row_bytes,
		  g.page_tokens, row_bytes);
}

/* ------------------------------------------------------------------ offload */

/* One block per (item, KV head): that head's p key rows and p value rows out of
 * the NHD rows into its contiguous HND run. */
static __global__ void KVR_LAUNCH_BOUNDS(COPY_THREADS, 4)
	offload_kernel(struct kvr_shape shape, const struct kvr_page_item *items)
{
	const uint32_t item = blockIdx.x / shape.n_kv_heads, h = blockIdx.x % shape.n_kv_heads;
	const struct kvr_page_item it = items[item];
	struct kvr_page_geometry g;
	kvr_page_geometry_init(&g, shape.page_tokens, shape.head_dim, shape.n_kv_heads,
			       shape.elem_type);
	const uint32_t row_bytes = g.head_dim * g.elem_bytes;
	const uint64_t src_stride = (uint64_t)it.row_stride * g.elem_bytes;
	const uint64_t col = (uint64_t)h * row_bytes;
	unsigned char *page = static_cast<unsigned char *>(it.hnd_page);
	copy_rows(page + kvr_hnd_index(&g, h, KVR_KEYS, 0, 0) * g.elem_bytes, row_bytes,
		  static_cast<const unsigned char *>(it.k_rows) + col, src_stride, g.page_tokens,
		  row_bytes);
	copy_rows(page + kvr_hnd_index(&g, h, KVR_VALUES, 0, 0) * g.elem_bytes, row_bytes,
		  static_cast<const unsigned char *>(it.v_rows) + col, src_stride, g.page_tokens,
		  row_bytes);
}

/* ---------------------------------------------------------------- summarize */

/* One thread per (KV head, dim) column of an item's p key rows; consecutive
 * threads read consecutive elements of a row (coalesced). The fold is
 * summary.h's, in the cpu backend's order: start from row 0, then rows 1..p-1,
 * so signed zeros and NaN payloads come out identical. */
static const uint32_t SUMMARY_THREADS = 256;

template <uint32_t ET>
static __global__ void KVR_LAUNCH_BOUNDS(SUMMARY_THREADS, 4)
	summarize_kernel(struct kvr_shape shape, uint32_t col_blocks,
			 const struct kvr_page_item *items)
{
	const uint32_t item = blockIdx.x / col_blocks, cb = blockIdx.x % col_blocks;
	const uint32_t d = shape.head_dim, cols = shape.n_kv_heads * d;
	const uint32_t col = cb * SUMMARY_THREADS + threadIdx.x;
	if (col >= cols)
		return;
	const struct kvr_page_item it = items[item];
	struct kvr_page_geometry g;
	kvr_page_geometry_init(&g, shape.page_tokens, d, shape.n_kv_heads, ET);
	float mn = kvr_load_f32(it.k_rows, ET, col), mx = mn;
	for (uint32_t t = 1; t < g.page_tokens; t++)
		kvr_minmax_step(kvr_load_f32(it.k_rows, ET, (uint64_t)t * it.row_stride + col), &mn,
				&mx);
	const uint32_t h = col / d, c = col - h * d;
	kvr_store_f32(it.summary, ET, kvr_summary_index(&g, h, 0, c), mn);
	kvr_store_f32(it.summary, ET, kvr_summary_index(&g, h, 1, c), mx);
}

/* -------------------------------------------------------------------- score */

/*
 * Score, spread over the GPU in three launches (the split is what keeps 132
 * SMs busy: one block per (item, KV head) left most of them idle and walked
 * every candidate serially):
 *
 *  1. score_pages — blocks (item, KV head m, split b), each over a contiguous
 *     chunk of the softmax domain (kernels.h: every complete page when
 *     norm_end is set, else the candidates): the Quest score s_gj of every
 *     page j of the chunk for every query head g of m's group, its per-head
 *     maximum (written per split), and, when the item's domain fits the cache
 *     (n_dom <= plan.cache), s_gj itself;
 *  2. score_sums — one block per (item, query head h): the maximum over the
 *     splits, then Σ_j kvr_expf(s_hj - max_h) over the domain in the
 *     canonical 256-lane order (thread L takes pages L, L+256, ... in order,
 *     counted from dom_begin; the lanes fold by halves), and 1/sum; cached
 *     scores are replaced by their exps on the way;
 *  3. score_final — blocks (item, m, split b) over the candidates only:
 *     score_mj = (Σ_g e_gj·(1/sum_g))·(1/G), g in order.
 * Every value goes through the same float operations, in the same order, as
 * in the cpu backend (and in the one-block kernel this replaces), so the
 * scores stay bit-identical; only where they are computed changed. A page's
 * Quest score is computed once when cached, three times (in passes 1, 2 and
 * 3) when not: items longer than the cache take that path, correct but
 * slower.
 *
 * Quest scores: the threads form 16 groups of KVR_DOT_LANES = 16; a group
 * scores one page at a time, lane l of the group taking dims l, l+16, ... —
 * exactly the canonical 16-lane dot — and the butterfly over the group's lanes
 * (xor 8, 4, 2, 1) is the canonical fold (each step adds the same two partial
 * sums, and + commutes exactly). This keeps the summary loads coalesced (a
 * group reads 16 consecutive elements) and needs one accumulator per head.
 * A lane loads all its elements of the page (raw bits) before it converts
 * any, so a page costs one memory latency, not one per element: the f16
 * conversion used to branch on the loaded bits, which serialised the loads and
 * held the kernel to ~350 GB/s of summaries on an H100. Query heads go 4 at a
 * time in pass 1 when the group has at most 4, SCORE_HEADS otherwise
 * (register accumulators).
 *
 * Scratch (floats, laid out by score_plan_layout): the per-split maxima
 * [n][n_kv][splits][G], per query head (max, 1/sum) [n][n_qo][2], and the
 * cache [n][n_qo][cache].
 */
static const uint32_t SCORE_THREADS = 256;
static const uint32_t SCORE_GROUPS = SCORE_THREADS / KVR_DOT_LANES; /* pages per step */
static const uint32_t SCORE_HEADS = 16;
static const uint32_t SCORE_MAX_DIM = 256;
static const uint32_t SCORE_MAX_SPLITS = 32; /* pass 2 merges the maxima in one warp */
static_assert(SCORE_MAX_SPLITS <= 32, "score_sums_kernel takes the splits' maxima in a warp");

struct score_plan {
	uint32_t splits; /* blocks per (item, KV head) in passes 1 and 3 */
	uint32_t cache;  /* pages per (item, query head) whose scores are kept */
	uint64_t off_stat, off_cache; /* floats into the scratch */
};

/* each(g, s_g) for g = 0 .. gc-1 in order (gc <= NH), s_g = scale · Σ_c
 * max(q_gc·min_c, q_gc·max_c) for the page whose summary (min row then max
 * row) starts at element `row` of `summaries`; all 32 lanes of the warp call
 * it (the fold shuffles), every lane of a group gets the same s_g, and `valid`
 * says whether this lane's group has a page (each is called regardless).
 * Handing each score to `each` as it is folded keeps one array of NH
 * accumulators live, not two. */
template <uint32_t ET, uint32_t NH, typename F>
KVR_DEV void quest_scores(const void *summaries, uint64_t row, bool valid, uint32_t d,
			  uint32_t lane16, const float *q_s, uint32_t gc, float scale, F &&each)
{
	/* dims a lane loads per round: 8 (all of them up to d = 128) when there
	 * are few heads, so that the page's loads are all in flight at once (one
	 * memory latency per page rather than one per dim); 4 when registers are
	 * scarcer */
	constexpr uint32_t PF = NH <= 4 ? 8 : 4;
	float acc[NH];
	KVR_UNROLL
	for (uint32_t g = 0; g < NH; g++)
		acc[g] = 0.0f;
	if (valid) {
		for (uint32_t c0 = lane16; c0 < d; c0 += PF * KVR_DOT_LANES) {
			uint32_t mn[PF], mx[PF]; /* raw: every load issued before any is used */
			KVR_UNROLL
			for (uint32_t i = 0; i < PF; i++) {
				const uint32_t c = c0 + i * KVR_DOT_LANES;
				mn[i] = c < d ? load_bits<ET>(summaries, row + c) : 0u;
				mx[i] = c < d ? load_bits<ET>(summaries, row + d + c) : 0u;
			}
			/* each accumulator still takes its dims in ascending order */
			KVR_UNROLL
			for (uint32_t i = 0; i < PF; i++) {
				const uint32_t c = c0 + i * KVR_DOT_LANES;
				if (c < d) {
					const float lo = bits_to_f32<ET>(mn[i]), hi = bits_to_f32<ET>(mx[i]);
					KVR_UNROLL
					for (uint32_t g = 0; g < NH; g++)
						if (g < gc)
							acc[g] = acc[g] + kvr_quest_term(q_s[g * d + c], lo, hi);
				}
			}
		}
	}
	KVR_UNROLL
	for (uint32_t g = 0; g < NH; g++) {
		if (g < gc) { /* gc is uniform: every lane takes the same branches */
			float a = acc[g];
			for (unsigned w = KVR_DOT_LANES / 2; w >= 1; w /= 2)
				a = a + __shfl_xor_sync(FULL_MASK, a, (int)w);
			each(g, scale * a);
		}
	}
}

/* The pages one softmax spans, kvr_score_domain (kernels.h) on the device. */
KVR_DEV void score_domain(const struct kvr_score_item &it, uint32_t *begin, uint32_t *end)
{
	*begin = it.norm_end ? 0u : it.cand_begin;
	*end = it.norm_end > it.cand_end ? it.norm_end : it.cand_end;
}

/* The pages [*r_begin, *r_end) (counted from the first of n) of split b of
 * `splits`: contiguous chunks of a multiple of SCORE_GROUPS pages. */
KVR_DEV void score_chunk(uint32_t n, uint32_t splits, uint32_t b, uint32_t *r_begin,
			 uint32_t *r_end)
{
	uint32_t chunk = (n + splits - 1) / splits;
	chunk = (chunk + SCORE_GROUPS - 1) / SCORE_GROUPS * SCORE_GROUPS;
	const uint64_t lo = (uint64_t)b * chunk, hi = lo + chunk;
	*r_begin = lo < n ? (uint32_t)lo : n;
	*r_end = hi < n ? (uint32_t)hi : n;
}

/* Pass 1. Block (item·n_kv + m)·splits + b; NH query heads at a time (4 when
 * the group has at most 4, for registers and occupancy; SCORE_HEADS else). */
template <uint32_t ET, uint32_t NH>
static __global__ void KVR_LAUNCH_BOUNDS(SCORE_THREADS, NH <= 4 ? 3 : 2)
	score_pages_kernel(struct kvr_shape shape, struct score_plan plan,
			   const struct kvr_score_item *items, float *scratch)
{
	__shared__ float q_s[NH * SCORE_MAX_DIM];
	__shared__ float red_s[NH * SCORE_THREADS];

	const uint32_t n_kv = shape.n_kv_heads, d = shape.head_dim, n_qo = shape.n_qo_heads;
	const uint32_t G = n_qo / n_kv;
	const uint32_t b = blockIdx.x % plan.splits, im = blockIdx.x / plan.splits;
	const uint32_t item = im / n_kv, m = im % n_kv;
	const struct kvr_score_item it = items[item];
	if (it.cand_end <= it.cand_begin)
		return; /* no candidates: nothing to write (whole block) */
	uint32_t dom_begin, dom_end;
	score_domain(it, &dom_begin, &dom_end);
	const uint32_t n_dom = dom_end - dom_begin;
	uint32_t r_begin, r_end;
	score_chunk(n_dom, plan.splits, b, &r_begin, &r_end);
	const uint32_t tid = threadIdx.x, grp = tid / KVR_DOT_LANES, lane16 = tid % KVR_DOT_LANES;
	const uint64_t page_elems = (uint64_t)n_kv * 2u * d;
	const uint64_t head_off = (uint64_t)m * 2u * d;
	const bool cached = n_dom <= plan.cache;
	float *pmax = scratch + ((uint64_t)im * plan.splits + b) * G;
	float *cache = scratch + plan.off_cache + ((uint64_t)item * n_qo + m * G) * plan.cache;

	for (uint32_t g0 = 0; g0 < G; g0 += NH) {
		const uint32_t gc = G - g0 < NH ? G - g0 : NH;
		__syncthreads(); /* the previous chunk is done with q_s and red_s */
		const uint64_t q_base = (uint64_t)(m * G + g0) * d;
		for (uint32_t e = tid; e < gc * d; e += SCORE_THREADS)
			q_s[e] = load_elem<ET>(it.q, q_base + e);
		__syncthreads();

		/* per-head maximum (exact in any order; NaN scores are skipped here
		 * and poison the sum in pass 2 instead) */
		float run_max[NH];
		KVR_UNROLL
		for (uint32_t g = 0; g < NH; g++)
			run_max[g] = -INFINITY;
		for (uint32_t r0 = r_begin; r0 < r_end; r0 += SCORE_GROUPS) {
			const uint32_t r = r0 + grp;
			const bool valid = r < r_end;
			quest_scores<ET, NH>(
				it.summaries, (dom_begin + (uint64_t)r) * page_elems + head_off,
				valid, d, lane16, q_s, gc, shape.scale, [&](uint32_t g, float s) {
					if (!valid)
						return;
					if (s > run_max[g])
						run_max[g] = s;
					if (cached && lane16 == 0)
						cache[(uint64_t)(g0 + g) * plan.cache + r] = s;
				});
		}
		KVR_UNROLL
		for (uint32_t g = 0; g < NH; g++)
			if (g < gc)
				red_s[g * SCORE_THREADS + tid] = run_max[g];
		__syncthreads();
		for (uint32_t w = SCORE_THREADS / 2; w >= 1; w /= 2) {
			if (tid < w)
				for (uint32_t g = 0; g < gc; g++) {
					float *l = red_s + g * SCORE_THREADS;
					if (l[tid + w] > l[tid])
						l[tid] = l[tid + w];
				}
			__syncthreads();
		}
		if (tid < gc)
			pmax[g0 + tid] = red_s[tid * SCORE_THREADS];
	}
}

/* Pass 2. Block item·n_qo + h. */
template <uint32_t ET>
static __global__ void KVR_LAUNCH_BOUNDS(SCORE_THREADS, 4)
	score_sums_kernel(struct kvr_shape shape, struct score_plan plan,
			  const struct kvr_score_item *items, float *scratch)
{
	__shared__ float q_s[SCORE_MAX_DIM];
	__shared__ float lane_s[KVR_SUM_LANES];
	__shared__ float max_sh;

	const uint32_t n_kv = shape.n_kv_heads, d = shape.head_dim, n_qo = shape.n_qo_heads;
	const uint32_t G = n_qo / n_kv;
	const uint32_t item = blockIdx.x / n_qo, h = blockIdx.x % n_qo, m = h / G, g = h % G;
	const struct kvr_score_item it = items[item];
	if (it.cand_end <= it.cand_begin)
		return;
	uint32_t dom_begin, dom_end;
	score_domain(it, &dom_begin, &dom_end);
	const uint32_t n_dom = dom_end - dom_begin;
	const uint32_t tid = threadIdx.x, grp = tid / KVR_DOT_LANES, lane16 = tid % KVR_DOT_LANES;
	const bool cached = n_dom <= plan.cache;
	const uint64_t hq = (uint64_t)item * n_qo + h;

	if (tid < 32) { /* the maximum of the splits' (at most 32; exact in any order) */
		const float *pmax = scratch + (uint64_t)(item * n_kv + m) * plan.splits * G + g;
		float mx = tid < plan.splits ? pmax[(uint64_t)tid * G] : -INFINITY;
		for (unsigned o = 16; o >= 1; o /= 2) {
			const float other = __shfl_xor_sync(FULL_MASK, mx, (int)o);
			if (other > mx)
				mx = other;
		}
		if (tid == 0)
			max_sh = mx;
	}
	if (!cached)
		for (uint32_t e = tid; e < d; e += SCORE_THREADS)
			q_s[e] = load_elem<ET>(it.q, (uint64_t)h * d + e);
	__syncthreads();
	const float mx = max_sh;

	float lane_sum = 0.0f;
	if (cached) {
		float *row = scratch + plan.off_cache + hq * plan.cache;
		KVR_UNROLL4
		for (uint32_t r = tid; r < n_dom; r += KVR_SUM_LANES) {
			const float e = kvr_expf(row[r] - mx);
			row[r] = e;
			lane_sum = lane_sum + e;
		}
	} else {
		const uint64_t page_elems = (uint64_t)n_kv * 2u * d, head_off = (uint64_t)m * 2u * d;
		for (uint32_t b0 = 0; b0 < n_dom; b0 += KVR_SUM_LANES) {
			for (uint32_t r1 = 0; r1 < KVR_SUM_LANES; r1 += SCORE_GROUPS) {
				const uint32_t r = b0 + r1 + grp;
				quest_scores<ET, 1>(
					it.summaries, (dom_begin + (uint64_t)r) * page_elems + head_off,
					r < n_dom, d, lane16, q_s, 1, shape.scale, [&](uint32_t, float s) {
						if (lane16 == 0 && r < n_dom)
							lane_s[r1 + grp] = kvr_expf(s - mx);
					});
			}
			__syncthreads();
			if (b0 + tid < n_dom)
				lane_sum = lane_sum + lane_s[tid];
			__syncthreads();
		}
	}
	lane_s[tid] = lane_sum;
	__syncthreads();
	for (uint32_t w = KVR_SUM_LANES / 2; w >= 1; w /= 2) {
		if (tid < w)
			lane_s[tid] = lane_s[tid] + lane_s[tid + w];
		__syncthreads();
	}
	if (tid == 0) {
		float *stat = scratch + plan.off_stat + 2 * hq;
		stat[0] = mx;
		stat[1] = 1.0f / lane_s[0];
	}
}

/* Pass 3. Block (item·n_kv + m)·splits + b, the chunks of pass 1. */
template <uint32_t ET>
static __global__ void KVR_LAUNCH_BOUNDS(SCORE_THREADS, 2)
	score_final_kernel(struct kvr_shape shape, struct score_plan plan,
			   const struct kvr_score_item *items, const float *scratch)
{
	__shared__ float q_s[SCORE_HEADS * SCORE_MAX_DIM];
	__shared__ float max_s[SCORE_HEADS];
	__shared__ float inv_s[SCORE_HEADS];

	const uint32_t n_kv = shape.n_kv_heads, d = shape.head_dim, n_qo = shape.n_qo_heads;
	const uint32_t G = n_qo / n_kv;
	const uint32_t b = blockIdx.x % plan.splits, im = blockIdx.x / plan.splits;
	const uint32_t item = im / n_kv, m = im % n_kv;
	const struct kvr_score_item it = items[item];
	if (it.cand_end <= it.cand_begin)
		return;
	const uint32_t n_cand = it.cand_end - it.cand_begin;
	uint32_t dom_begin, dom_end;
	score_domain(it, &dom_begin, &dom_end);
	uint32_t r_begin, r_end;
	score_chunk(n_cand, plan.splits, b, &r_begin, &r_end);
	const uint32_t tid = threadIdx.x, grp = tid / KVR_DOT_LANES, lane16 = tid % KVR_DOT_LANES;
	float *scores = it.scores + (uint64_t)m * n_cand;
	const float inv_group = 1.0f / (float)G;
	const uint64_t hq0 = (uint64_t)item * n_qo + m * G;
	const float *stat = scratch + plan.off_stat + 2 * hq0;

	if (dom_end - dom_begin <= plan.cache) { /* the exps are cached: a thread per page */
		/* cached by domain index: candidate r is domain page (cand_begin - dom_begin) + r */
		const float *cache = scratch + plan.off_cache + hq0 * plan.cache +
				     (it.cand_begin - dom_begin);
		for (uint32_t r = r_begin + tid; r < r_end; r += SCORE_THREADS) {
			float acc = 0.0f;
			KVR_UNROLL4
			for (uint32_t g = 0; g < G; g++)
				acc = acc + cache[(uint64_t)g * plan.cache + r] * stat[2 * g + 1];
			scores[r] = acc * inv_group;
		}
		return;
	}

	/* not cached: recompute the Quest scores; with more than SCORE_HEADS
	 * heads, a later chunk continues the group sum in g order through the
	 * scores array itself */
	const uint64_t page_elems = (uint64_t)n_kv * 2u * d, head_off = (uint64_t)m * 2u * d;
	for (uint32_t g0 = 0; g0 < G; g0 += SCORE_HEADS) {
		const uint32_t gc = G - g0 < SCORE_HEADS ? G - g0 : SCORE_HEADS;
		const bool last_chunk = g0 + gc == G;
		__syncthreads(); /* the previous chunk is done with q_s, max_s and inv_s */
		const uint64_t q_base = (uint64_t)(m * G + g0) * d;
		for (uint32_t e = tid; e < gc * d; e += SCORE_THREADS)
			q_s[e] = load_elem<ET>(it.q, q_base + e);
		if (tid < gc) {
			max_s[tid] = stat[2 * (g0 + tid)];
			inv_s[tid] = stat[2 * (g0 + tid) + 1];
		}
		__syncthreads();
		for (uint32_t r0 = r_begin; r0 < r_end; r0 += SCORE_GROUPS) {
			const uint32_t r = r0 + grp;
			const bool mine = lane16 == 0 && r < r_end;
			float acc = mine && g0 != 0 ? scores[r] : 0.0f;
			quest_scores<ET, SCORE_HEADS>(
				it.summaries, (it.cand_begin + (uint64_t)r) * page_elems + head_off,
				r < r_end, d, lane16, q_s, gc, shape.scale, [&](uint32_t g, float s) {
					if (mine)
						acc = acc + kvr_expf(s - max_s[g]) * inv_s[g];
				});
			if (mine)
				scores[r] = last_chunk ? acc * inv_group : acc;
		}
	}
}

/* ------------------------------------------------------------------- select */

/*
 * The hand-written top-k: one block of 256 threads per (item, KV head).
 *
 * Order (kernels.h): a score ranks by ordered(score), its bits as an unsigned
 * integer with the sign bit set for positives and all bits flipped for
 * negatives, so a NaN ranks by its bits; equal keys go to the lower page
 * index. cuda_topk.cu's CUB path and the cpu backend use the same key.
 *
 * Radix select on the key, 8 bits per pass from the highest bit where the
 * candidates differ: each pass histograms the digit of the keys that match
 * the prefix chosen so far (per-warp histograms in shared memory, to spread
 * atomic contention), and a block scan from the top bin finds the digit that
 * holds the k-th largest key. It ends when that bin's keys are all needed or
 * the key is exhausted: then a page is selected when its key's known prefix is
 * greater than the chosen one, or equal and among the first `remaining` such
 * pages in index order. A final ordered pass (a block scan over consecutive
 * runs of candidates) writes the selected pages in ascending order, so no sort
 * is needed. Keys are cached in shared memory when they fit (n_cand <= 8192);
 * otherwise each pass re-reads the scores (from L2).
 */
static const uint32_t SELECT_THREADS = 256;
static const uint32_t SELECT_WARPS = SELECT_THREADS / 32;
static const uint32_t SELECT_CACHE = 8192; /* keys kept in shared memory */
static const uint32_t SELECT_PER_THREAD = 8; /* consecutive candidates per thread, final pass */
static const uint32_t SELECT_BINS = 256;

KVR_DEV uint32_t score_key(float x)
{
	const uint32_t u = __float_as_uint(x);
	return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Inclusive prefix sum over the block's threads (in thread order); *total gets
 * the block's sum. Every thread calls it; warp_s holds SELECT_WARPS words. */
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
	for (uint32_t w = 0; w < SELECT_WARPS; w++) {
		const uint32_t t = warp_s[w];
		if (w < warp)
			before += t;
		sum += t;
	}
	*total = sum;
	__syncthreads(); /* warp_s is free again */
	return v + before;
}

KVR_DEV uint32_t block_or(uint32_t v, uint32_t *warp_s)
{
	for (unsigned o = 16; o >= 1; o /= 2)
		v |= __shfl_xor_sync(FULL_MASK, v, (int)o);
	if (threadIdx.x % 32 == 0)
		warp_s[threadIdx.x / 32] = v;
	__syncthreads();
	uint32_t all = 0;
	for (uint32_t w = 0; w < SELECT_WARPS; w++)
		all |= warp_s[w];
	__syncthreads();
	return all;
}

static __global__ void KVR_LAUNCH_BOUNDS(SELECT_THREADS, 2)
	select_kernel(struct kvr_shape shape, const struct kvr_score_item *items)
{
	__shared__ uint32_t key_s[SELECT_CACHE];
	__shared__ uint32_t hist_s[SELECT_WARPS * SELECT_BINS];
	__shared__ uint32_t warp_s[SELECT_WARPS];
	__shared__ uint32_t pick_s[3]; /* chosen bin, keys still needed, bin count */

	const uint32_t n_kv = shape.n_kv_heads;
	const uint32_t item = blockIdx.x / n_kv, m = blockIdx.x % n_kv;
	const struct kvr_score_item it = items[item];
	const uint32_t k = it.k;
	if (k == 0)
		return;
	const uint32_t tid = threadIdx.x, warp = tid / 32;
	const uint32_t n_cand = it.cand_end > it.cand_begin ? it.cand_end - it.cand_begin : 0u;
	const float *scores = it.scores + (uint64_t)m * n_cand;
	int32_t *out = it.selected + (uint64_t)m * k;
	const uint32_t take = k < n_cand ? k : n_cand;
	const bool cached = n_cand <= SELECT_CACHE;
	if (cached)
		for (uint32_t r = tid; r < n_cand; r += SELECT_THREADS)
			key_s[r] = score_key(scores[r]);
	__syncthreads();

	/* Selected: (key & known) > want, or == want and among the first
	 * `remaining` such candidates. Taking every candidate is known = 0. */
	uint32_t want = 0, known = 0, remaining = take;
	if (take < n_cand) {
		const uint32_t first = cached ? key_s[0] : score_key(scores[0]);
		uint32_t diff = 0;
		for (uint32_t r = tid; r < n_cand; r += SELECT_THREADS)
			diff |= (cached ? key_s[r] : score_key(scores[r])) ^ first;
		diff = block_or(diff, warp_s);
		if (diff == 0) {
			known = ~0u; /* all keys equal: the lowest indices win */
			want = first;
		} else {
			uint32_t hi = top_bit(diff);
			known = hi == 31 ? 0u : ~0u << (hi + 1);
			want = first & known;
			for (;;) {
				const uint32_t lo = hi >= 7 ? hi - 7 : 0u;
				const uint32_t bins = 1u << (hi - lo + 1), digit_mask = bins - 1;
				for (uint32_t i = tid; i < SELECT_WARPS * SELECT_BINS; i += SELECT_THREADS)
					hist_s[i] = 0;
				__syncthreads();
				uint32_t *hist = hist_s + warp * SELECT_BINS;
				for (uint32_t r = tid; r < n_cand; r += SELECT_THREADS) {
					const uint32_t key = cached ? key_s[r] : score_key(scores[r]);
					if ((key & known) == want)
						atomicAdd(&hist[(key >> lo) & digit_mask], 1u);
				}
				__syncthreads();
				/* thread t holds bin bins-1-t: the scan counts from the top */
				uint32_t cnt = 0;
				if (tid < bins)
					for (uint32_t w = 0; w < SELECT_WARPS; w++)
						cnt += hist_s[w * SELECT_BINS + (bins - 1 - tid)];
				uint32_t total;
				const uint32_t incl = block_scan(cnt, warp_s, &total);
				const uint32_t excl = incl - cnt;
				if (tid < bins && excl < remaining && remaining <= incl) {
					pick_s[0] = bins - 1 - tid;
					pick_s[1] = remaining - excl;
					pick_s[2] = cnt;
				}
				__syncthreads();
				want |= pick_s[0] << lo;
				known |= digit_mask << lo;
				remaining = pick_s[1];
				const bool done = remaining == pick_s[2] || lo == 0;
				__syncthreads(); /* pick_s and hist_s are reused by the next pass */
				if (done)
					break;
				hi = lo - 1;
			}
		}
	}

	/* Ordered pass: thread t takes SELECT_PER_THREAD consecutive candidates of
	 * each run; one scan of packed (greater << 16 | tie) counts gives both
	 * prefix counts (a run holds 2048 candidates, so neither field carries). */
	uint32_t gt_done = 0, tie_done = 0;
	for (uint32_t base = 0; base < n_cand; base += SELECT_THREADS * SELECT_PER_THREAD) {
		const uint32_t r0 = base + tid * SELECT_PER_THREAD;
		uint32_t keys[SELECT_PER_THREAD];
		uint32_t gt = 0, tie = 0;
		for (uint32_t e = 0; e < SELECT_PER_THREAD; e++) {
			const uint32_t r = r0 + e;
			keys[e] = 0;
			if (r < n_cand) {
				keys[e] = (cached ? key_s[r] : score_key(scores[r])) & known;
				gt += keys[e] > want;
				tie += keys[e] == want;
			}
		}
		const uint32_t packed = gt << 16 | tie;
		uint32_t total;
		const uint32_t excl = block_scan(packed, warp_s, &total) - packed;
		uint32_t tie_rank = tie_done + (excl & 0xffffu);
		uint32_t pos = gt_done + (excl >> 16) + (tie_rank < remaining ? tie_rank : remaining);
		for (uint32_t e = 0; e < SELECT_PER_THREAD; e++) {
			const uint32_t r = r0 + e;
			if (r >= n_cand)
				break;
			bool sel = keys[e] > want;
			if (keys[e] == want)
				sel = tie_rank++ < remaining;
			if (sel)
				out[pos++] = (int32_t)(it.cand_begin + r);
		}
		gt_done += total >> 16;
		tie_done += total & 0xffffu;
	}
	for (uint32_t i = take + tid; i < k; i += SELECT_THREADS)
		out[i] = -1;
}

/* --------------------------------------------------------------- similarity */

/* One block per (item, KV head): 16 groups of 16 lanes, a group per query
 * head (canonical 16-lane dot and norms, butterfly fold as in score); thread 0
 * adds the cosines in g order. cos = dot / sqrt(|q|²·|q_prev|²), the cpu
 * backend's rounding. */
static const uint32_t SIM_THREADS = 256;
static const uint32_t SIM_GROUPS = SIM_THREADS / KVR_DOT_LANES;

template <uint32_t ET>
static __global__ void KVR_LAUNCH_BOUNDS(SIM_THREADS, 4)
	similarity_kernel(struct kvr_shape shape, const struct kvr_similarity_item *items)
{
	__shared__ float cos_s[SIM_GROUPS];
	const uint32_t n_kv = shape.n_kv_heads, d = shape.head_dim;
	const uint32_t G = shape.n_qo_heads / n_kv;
	const uint32_t item = blockIdx.x / n_kv, m = blockIdx.x % n_kv;
	const struct kvr_similarity_item it = items[item];
	const uint32_t tid = threadIdx.x, grp = tid / KVR_DOT_LANES, lane16 = tid % KVR_DOT_LANES;
	float total = 0.0f; /* thread 0's running sum over the group */
	for (uint32_t gb = 0; gb < G; gb += SIM_GROUPS) {
		const uint32_t g = gb + grp;
		float dot = 0.0f, nq = 0.0f, np = 0.0f;
		if (g < G) {
			const uint64_t row = (uint64_t)(m * G + g) * d;
			for (uint32_t c = lane16; c < d; c += KVR_DOT_LANES) {
				const float a = kvr_load_f32(it.q, ET, row + c);
				const float b = kvr_load_f32(it.q_prev, ET, row + c);
				dot = dot + a * b;
				nq = nq + a * a;
				np = np + b * b;
			}
		}
		for (unsigned w = KVR_DOT_LANES / 2; w >= 1; w /= 2) {
			dot = dot + __shfl_xor_sync(FULL_MASK, dot, (int)w);
			nq = nq + __shfl_xor_sync(FULL_MASK, nq, (int)w);
			np = np + __shfl_xor_sync(FULL_MASK, np, (int)w);
		}
		if (lane16 == 0 && g < G)
			cos_s[grp] = (nq == 0.0f || np == 0.0f) ? 0.0f : dot / sqrtf(nq * np);
		__syncthreads();
		if (tid == 0)
			for (uint32_t s = 0; s < SIM_GROUPS && gb + s < G; s++)
				total = total + cos_s[s];
		__syncthreads();
	}
	if (tid == 0) {
		const float c = total * (1.0f / (float)G);
		it.cosine[m] = c;
		it.corrected[m] = !(c >= shape.tau);
	}
}

/* ---------------------------------------------------------------- attention */

/*
 * Decode attention, flash-decoding style, in two launches.
 *
 * 1. attention_kernel: one block of 256 threads per (item, KV head m, head
 *    chunk, split s). The block holds `heads` query heads of m's group (all G
 *    of them unless the group is very large, see att_plan_make), so every K
 *    and V row is read from memory once for all of them, and it takes split
 *    s of the item's tokens: the tokens of its segments, counted in order
 *    across them, cut into `splits` chunks of a multiple of ATT_SPLIT_ALIGN
 *    tokens (the block finds where its chunk starts with a scan of the
 *    segments' lengths; a chunk past the end is empty). Without the split,
 *    one block walked an item's whole context: 64 blocks for a GPU of 132
 *    SMs. Tokens stream through shared memory in tiles of 16 KiB of raw K+V
 *    (tile = 8192 / (d·elem_bytes) tokens, at most 64), converted to f32:
 *    - loads are 16-byte vectors when the segment's pointers and strides
 *      allow, consecutive threads reading consecutive chunks of a row
 *      (coalesced); the next tile's loads are issued into registers before
 *      the current tile is computed, so memory latency overlaps the math;
 *    - QK: warp w owns heads w, w+8, ...; lane l takes tokens l and l+32 and
 *      reads K rows padded to d+4 floats as 16-byte vectors (conflict-free
 *      per quarter warp), q broadcast. The warp then does the online-softmax
 *      update of its heads (max and sum by shuffles) and publishes p and the
 *      rescale factor;
 *    - PV: with side = 256/d heads side by side, thread i owns column i % d
 *      of heads i/d, i/d + side, ... (fp32 accumulators in registers, NACC of
 *      them, a compile-time count chosen per launch), so one V element read
 *      (conflict-free, consecutive lanes take consecutive columns) serves all
 *      of its heads, and p is a broadcast.
 *    With one split the block writes the output; otherwise its online-softmax
 *    state per head (running max m, running sum l, unnormalised Σ p·V) goes
 *    to the scratch.
 * 2. attention_combine_kernel (only with splits > 1): one block per (item,
 *    m, head chunk) merges the splits' states in split order: M = max of the
 *    m_s, w_s = kvr_softmax_rescale(m_s, M), L = Σ l_s·w_s, out = (Σ acc_s·w_s)
 *    / L, 0 when L = 0. Deterministic; the rounding differs from one online
 *    softmax over all tokens within the tolerances attention is held to.
 * One online softmax per query head and split; an empty item gives zeros;
 * NaN/Inf in q, k or v reaches the outputs of the heads that used them and
 * no others (masked lanes never touch stale shared memory, and a split's
 * weight multiplies a NaN state rather than skipping it).
 */
static const uint32_t ATT_THREADS = 256;
static const uint32_t ATT_WARPS = ATT_THREADS / 32;
static const uint32_t ATT_TILE_BYTES = 8192; /* raw bytes of K (and of V) per tile */
static const uint32_t ATT_MAX_TILE = 64;     /* tokens per tile: two per lane in QK */
static const uint32_t ATT_MAX_ACC = 16;      /* output heads per thread */
static const uint32_t ATT_MAX_HEADS = 64;    /* query heads per group */
static const uint32_t ATT_CHUNKS = 2 * ATT_TILE_BYTES / 16 / ATT_THREADS; /* per thread */
static const uint32_t ATT_SMEM_BYTES = 48 * 1024; /* no opt-in above the default limit */
static const uint32_t ATT_K_PAD = 4;         /* floats after each K row in shared memory */
static const uint32_t ATT_MAX_SPLITS = 32;   /* blocks per (item, KV head, head chunk) */
static const uint32_t ATT_SPLIT_ALIGN = 16;  /* tokens: a split's length is a multiple */
static const uint32_t ATT_BLOCKS_PER_SM = 8; /* the split aims at this many blocks per SM */

static_assert(ATT_THREADS == SELECT_THREADS, "attention's segment scan uses block_scan");

/* Launch geometry, computed on the host (att_plan_make). Offsets are floats
 * into the dynamic shared buffer: q [heads][d], K [tile][d+4], V [tile][d],
 * p [heads][tile], then per head the running max, running sum and the tile's
 * rescale factor. A split's state in the scratch: acc [heads][d], then m
 * [heads], then l [heads] (part_stride floats). */
struct att_plan {
	uint32_t tile;        /* tokens per tile */
	uint32_t heads;       /* query heads per block */
	uint32_t head_blocks; /* blocks per KV head */
	uint32_t off_k, off_v, off_p, off_m, off_l, off_alpha;
	uint32_t smem_bytes;
	uint32_t acc;         /* accumulators a thread needs: ceil(heads / (256/d)) */
	uint32_t splits;      /* blocks per (item, KV head, head chunk) */
	uint32_t part_stride; /* floats of one split's state */
};

/* 16 bytes of floats in shared memory (LDS.128/STS.128 under nvcc). */
struct alignas(16) vec4f {
	float v[4];
};

/* Where a thread's ATT_CHUNKS 16-byte chunks of a tile go: the tile's chunk
 * space is [K rows | V rows], each row d·elem_bytes/16 chunks, chunk i of the
 * thread is tid + 256·i. Row (~0u: none) and column element, with bit 31 set
 * for V; the same for every tile, so computed once per block. */
struct att_map {
	uint32_t row[ATT_CHUNKS];
	uint32_t col[ATT_CHUNKS];
};

template <uint32_t ET> KVR_DEV void att_map_init(uint32_t d, uint32_t tile, struct att_map &map)
{
	const uint32_t VEC = 16 / elem_bytes<ET>::value;
	const uint32_t cpr = d / VEC, half = tile * cpr;
	KVR_UNROLL
	for (uint32_t i = 0; i < ATT_CHUNKS; i++) {
		const uint32_t q = threadIdx.x + ATT_THREADS * i;
		const uint32_t which = q >= half, qq = q - which * half;
		const uint32_t r = qq / cpr, cc = qq - r * cpr;
		map.row[i] = q < 2 * half ? r : ~0u;
		map.col[i] = which << 31 | cc * VEC;
	}
}

/* Issue the loads of one tile (rows tokens of segment s from token `off`) into
 * this thread's registers. */
template <uint32_t ET>
KVR_DEV void att_fetch(const struct kvr_kv_segment &s, uint32_t off, uint32_t rows, uint32_t m,
		       const struct att_map &map, chunk16 *pre)
{
	const uint32_t EB = elem_bytes<ET>::value;
	const bool aligned = (((uint64_t)(uintptr_t)s.k | (uint64_t)(uintptr_t)s.v |
			       (uint64_t)s.row_stride * EB | (uint64_t)s.head_stride * EB) &
			      15u) == 0;
	const uint64_t head = (uint64_t)m * s.head_stride;
	KVR_UNROLL
	for (uint32_t i = 0; i < ATT_CHUNKS; i++) {
		const uint32_t r = map.row[i];
		if (r < rows) {
			const unsigned char *base =
				static_cast<const unsigned char *>(map.col[i] >> 31 ? s.v : s.k);
			const uint64_t elem = head + (uint64_t)(off + r) * s.row_stride +
					      (map.col[i] & 0x7fffffffu);
			pre[i] = load_chunk<ET>(base + elem * EB, aligned);
		}
	}
}

/* Convert the fetched tile into shared memory (same chunk mapping). */
template <uint32_t ET>
KVR_DEV void att_store(const chunk16 *pre, uint32_t rows, uint32_t d, const struct att_map &map,
		       float *k_s, float *v_s)
{
	const uint32_t VEC = 16 / elem_bytes<ET>::value;
	KVR_UNROLL
	for (uint32_t i = 0; i < ATT_CHUNKS; i++) {
		const uint32_t r = map.row[i];
		if (r < rows) {
			float f[8];
			decode_chunk<ET>(pre[i], f);
			const uint32_t c = map.col[i] & 0x7fffffffu;
			float *dst = map.col[i] >> 31 ? v_s + r * d + c : k_s + r * (d + ATT_K_PAD) + c;
			KVR_UNROLL
			for (uint32_t e = 0; e < VEC / 4; e++) {
				vec4f w;
				KVR_UNROLL
				for (uint32_t j = 0; j < 4; j++)
					w.v[j] = f[4 * e + j];
				reinterpret_cast<vec4f *>(dst)[e] = w;
			}
		}
	}
}

/* A tile of a quantised segment (kernels.h): rows tokens from token `off`,
 * dequantised straight into shared memory as f32 (s·Q − z; no register
 * prefetch: the codes are a quarter to an eighth of the plain bytes). An
 * unknown format or rows past the run's tokens (p; p/2 for a K8V4 half)
 * store NaN, which reaches the item's outputs. */
KVR_DEV void att_store_quant(const struct kvr_kv_segment &s, uint32_t off, uint32_t rows, uint32_t m,
			     uint32_t p, uint32_t d, float *k_s, float *v_s)
{
	struct kvr_quant_geometry g;
	const bool ok = !kvr_quant_geometry_init(&g, p, d, 1, s.format) &&
			(uint64_t)s.first_row + off + rows <= g.page_tokens;
	unsigned char *run = (unsigned char *)(uintptr_t)s.k + (uint64_t)m * s.head_stride;
	for (uint32_t e = threadIdx.x; e < rows * d; e += ATT_THREADS) {
		const uint32_t r = e / d, c = e - r * d, t = s.first_row + off + r;
		float k = NAN, v = NAN;
		if (ok) {
			k = kvr_dequant(kvr_quant_get(kvr_quant_key_row(&g, run, t), c, g.key_bits),
					kvr_quant_key_sz(&g, run, t));
			v = kvr_dequant(kvr_quant_get(kvr_quant_value_row(&g, run, t), c, g.value_bits),
					kvr_quant_value_sz(&g, run, t));
		}
		k_s[r * (d + ATT_K_PAD) + c] = k;
		v_s[r * d + c] = v;
	}
}

/* Move (seg, off) past `rows` tokens and any empty segments. */
KVR_DEV void att_advance(const struct kvr_kv_segment *segs, uint32_t n_segs, uint32_t *seg,
			 uint32_t *off, uint32_t rows)
{
	*off += rows;
	if (*seg < n_segs && *off >= segs[*seg].n_tokens) {
		*off = 0;
		++*seg;
	}
	while (*seg < n_segs && segs[*seg].n_tokens == 0)
		++*seg;
}

/* Tokens of the tile starting at (seg, off), at most `left`; 0 past the last
 * segment. */
KVR_DEV uint32_t att_rows(const struct kvr_kv_segment *segs, uint32_t n_segs, uint32_t seg,
			  uint32_t off, uint32_t tile, uint32_t left)
{
	if (seg >= n_segs)
		return 0;
	uint32_t rows = segs[seg].n_tokens - off;
	rows = rows < tile ? rows : tile;
	return rows < left ? rows : left;
}

/*
 * Split s of `splits`: the position (seg, off) of its first token and how
 * many tokens it takes (*left; 0 for a chunk past the end, ~0u for the only
 * split, which takes everything). Every thread calls it and gets the same
 * answer; scan_s holds ATT_WARPS words, found_s two.
 */
KVR_DEV void att_split_range(const struct kvr_kv_segment *segs, uint32_t n_segs, uint32_t splits,
			     uint32_t s, uint32_t *scan_s, uint32_t *found_s, uint32_t *seg,
			     uint32_t *off, uint32_t *left)
{
	*seg = 0;
	*off = 0;
	if (splits == 1) {
		att_advance(segs, n_segs, seg, off, 0);
		*left = ~0u;
		return;
	}
	const uint32_t tid = threadIdx.x;
	uint32_t part = 0, total = 0;
	for (uint32_t i = tid; i < n_segs; i += ATT_THREADS)
		part += segs[i].n_tokens;
	(void)block_scan(part, scan_s, &total);
	uint32_t chunk = total / splits + (total % splits != 0);
	chunk = (chunk + ATT_SPLIT_ALIGN - 1) / ATT_SPLIT_ALIGN * ATT_SPLIT_ALIGN;
	const uint64_t start = (uint64_t)s * chunk;
	if (start >= total) {
		*seg = n_segs;
		*left = 0;
		return;
	}
	*left = total - start < chunk ? (uint32_t)(total - start) : chunk;
	/* the segment holding token `start`: a scan of the lengths, 256 at a time */
	uint32_t before = 0;
	for (uint32_t base = 0; base < n_segs; base += ATT_THREADS) {
		const uint32_t i = base + tid;
		const uint32_t n = i < n_segs ? segs[i].n_tokens : 0u;
		uint32_t sum = 0;
		const uint32_t excl = before + block_scan(n, scan_s, &sum) - n;
		if (n > 0 && excl <= start && start - excl < n) { /* exactly one thread */
			found_s[0] = i;
			found_s[1] = (uint32_t)(start - excl);
		}
		if (before + sum > start)
			break; /* uniform: before and sum are the block's */
		before += sum;
	}
	__syncthreads(); /* found_s is written */
	*seg = found_s[0];
	*off = found_s[1];
}

/*
 * One block's work: heads g0 .. g0+gc-1 of KV head m over split `split` of
 * the item's tokens. part = NULL (one split): write the outputs; otherwise
 * this split's state.
 */
template <uint32_t ET, uint32_t NACC, bool QUANT>
static __device__ void attend(const struct kvr_shape &shape, const struct att_plan &plan,
			      const void *q, void *out, float *part,
			      const struct kvr_kv_segment *segs, uint32_t n_segs, uint32_t m,
			      uint32_t g0, uint32_t gc, uint32_t split, float *smem, float *lse)
{
	__shared__ uint32_t scan_s[ATT_WARPS];
	__shared__ uint32_t found_s[2];
	__shared__ float segl_s[ATT_MAX_HEADS]; /* lse: the segment's sum, like l_s */
	const uint32_t d = shape.head_dim, G = shape.n_qo_heads / shape.n_kv_heads;
	const uint32_t tile = plan.tile, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
	float *q_s = smem, *k_s = smem + plan.off_k, *v_s = smem + plan.off_v;
	float *p_s = smem + plan.off_p, *m_s = smem + plan.off_m, *l_s = smem + plan.off_l;
	float *alpha_s = smem + plan.off_alpha;
	const uint32_t kstride = d + ATT_K_PAD;
	const uint64_t qo_base = (uint64_t)(m * G + g0) * d;
	const uint32_t n_out = gc * d;
	/* PV ownership: `side` = 256/d heads side by side; this thread owns
	 * column c_own of heads g_own, g_own + side, ... (n_mine <= NACC of them) */
	const uint32_t side = ATT_THREADS / d, c_own = tid % d, g_own = tid / d;
	const uint32_t n_mine = g_own < side && g_own < gc ? (gc - g_own + side - 1) / side : 0u;

	uint32_t seg, off, left;
	att_split_range(segs, n_segs, plan.splits, split, scan_s, found_s, &seg, &off, &left);

	for (uint32_t e = tid; e < n_out; e += ATT_THREADS)
		q_s[e] = load_elem<ET>(q, qo_base + e);
	for (uint32_t g = tid; g < gc; g += ATT_THREADS) {
		m_s[g] = -INFINITY;
		l_s[g] = 0.0f;
		segl_s[g] = 0.0f;
	}
	/* lse (one split: the plan guarantees it): empty segments keep −inf;
	 * the others are written by their last tile, after a barrier */
	const uint64_t lse_base = (uint64_t)(m * G + g0) * n_segs;
	for (uint32_t e = tid; lse && e < gc * n_segs; e += ATT_THREADS)
		lse[lse_base + e] = -INFINITY;
	float acc[NACC];
	KVR_UNROLL
	for (uint32_t i = 0; i < NACC; i++)
		acc[i] = 0.0f;

	struct att_map map;
	att_map_init<ET>(d, tile, map);
	chunk16 pre[ATT_CHUNKS];
	uint32_t rows = att_rows(segs, n_segs, seg, off, tile, left);
	if (rows && !(QUANT && segs[seg].format))
		att_fetch<ET>(segs[seg], off, rows, m, map, pre);
	while (rows > 0) {
		if (QUANT && segs[seg].format)
			att_store_quant(segs[seg], off, rows, m, shape.page_tokens, d, k_s, v_s);
		else
			att_store<ET>(pre, rows, d, map, k_s, v_s);
		__syncthreads(); /* K, V (and q and the softmax state, first time) are ready */

		/* the tile closes its segment: lse is written after this tile */
		const uint32_t tile_seg = seg;
		const bool closes = off + rows == segs[seg].n_tokens;
		left -= rows;
		att_advance(segs, n_segs, &seg, &off, rows);
		const uint32_t next = att_rows(segs, n_segs, seg, off, tile, left);
		if (next && !(QUANT && segs[seg].format))
			att_fetch<ET>(segs[seg], off, next, m, map, pre);

		/* QK and the online-softmax update; the head loop is warp-uniform */
		for (uint32_t g = warp; g < gc; g += ATT_WARPS) {
			const float *qg = q_s + g * d;
			float s[2];
			KVR_UNROLL
			for (uint32_t h = 0; h < 2; h++) {
				s[h] = -INFINITY;
				const uint32_t t = lane + 32 * h;
				if (t < rows) {
					const float *kr = k_s + t * kstride;
					float a0 = 0.0f, a1 = 0.0f;
					KVR_UNROLL4
					for (uint32_t c = 0; c < d; c += 4) {
						const vec4f qv = *reinterpret_cast<const vec4f *>(qg + c);
						const vec4f kv = *reinterpret_cast<const vec4f *>(kr + c);
						a0 = fmaf(qv.v[0], kv.v[0], a0);
						a1 = fmaf(qv.v[1], kv.v[1], a1);
						a0 = fmaf(qv.v[2], kv.v[2], a0);
						a1 = fmaf(qv.v[3], kv.v[3], a1);
					}
					s[h] = shape.scale * (a0 + a1);
				}
			}
			const float m_old = m_s[g];
			const float m_new = fmaxf(m_old, warp_max(fmaxf(s[0], s[1])));
			float psum = 0.0f;
			KVR_UNROLL
			for (uint32_t h = 0; h < 2; h++) {
				const uint32_t t = lane + 32 * h;
				if (t < rows) {
					const float p = kvr_expf(s[h] - m_new);
					p_s[g * tile + t] = p;
					psum += p;
				}
			}
			psum = warp_sum(psum);
			__syncwarp(); /* every lane has read m_s[g] before lane 0 updates it */
			if (lane == 0) {
				const float alpha = kvr_softmax_rescale(m_old, m_new);
				alpha_s[g] = alpha;
				l_s[g] = l_s[g] * alpha + psum;
				m_s[g] = m_new;
				if (lse) {
					const float sl = segl_s[g] * alpha + psum;
					segl_s[g] = closes ? 0.0f : sl;
					if (closes)
						lse[lse_base + (uint64_t)g * n_segs + tile_seg] = m_new + logf(sl);
				}
			}
		}
		__syncthreads(); /* p and alpha are published */

		if (n_mine) {
			const float *pg = p_s + g_own * tile;
			KVR_UNROLL
			for (uint32_t i = 0; i < NACC; i++)
				if (i < n_mine)
					acc[i] = acc[i] * alpha_s[g_own + side * i];
			const auto pv = [&](uint32_t t) {
				const float v = v_s[t * d + c_own];
				KVR_UNROLL
				for (uint32_t i = 0; i < NACC; i++)
					if (i < n_mine)
						acc[i] = fmaf(pg[side * tile * i + t], v, acc[i]);
			};
			if constexpr (NACC <= 4) { /* unrolled: the loads go out together */
				KVR_UNROLL4
				for (uint32_t t = 0; t < rows; t++)
					pv(t);
			} else { /* 16 accumulators leave no registers for that */
				for (uint32_t t = 0; t < rows; t++)
					pv(t);
			}
		}
		__syncthreads(); /* the tile's shared memory may be overwritten */
		rows = next;
	}

	__syncthreads(); /* m_s and l_s are final (also when there were no tokens) */
	if (part) {
		KVR_UNROLL
		for (uint32_t i = 0; i < NACC; i++)
			if (i < n_mine)
				part[(uint64_t)(g_own + side * i) * d + c_own] = acc[i];
		for (uint32_t g = tid; g < gc; g += ATT_THREADS) {
			part[(uint64_t)plan.heads * d + g] = m_s[g];
			part[(uint64_t)plan.heads * (d + 1) + g] = l_s[g];
		}
		return;
	}
	KVR_UNROLL
	for (uint32_t i = 0; i < NACC; i++) {
		if (i < n_mine) {
			const uint32_t g = g_own + side * i;
			const float l = l_s[g];
			kvr_store_f32(out, ET, qo_base + (uint64_t)g * d + c_own,
				      l == 0.0f ? 0.0f : acc[i] / l);
		}
	}
}

/* Block b = ((item · n_kv + m) · head_blocks + chunk) · splits + split.
 * With 16 accumulators a thread (large query groups only) the quantised tile
 * code does not fit 128 registers: one block per SM is guaranteed instead
 * of two, rather than spilling. */
template <uint32_t ET, uint32_t NACC>
static __global__ void KVR_LAUNCH_BOUNDS(ATT_THREADS, NACC >= 16 ? 1 : 2)
	attention_kernel(struct kvr_shape shape, struct att_plan plan,
			 const struct kvr_attention_item *items, const struct kvr_kv_segment *segments,
			 float *part)
{
	KVR_DYNAMIC_SHARED(float, att_smem);
	const uint32_t G = shape.n_qo_heads / shape.n_kv_heads;
	const uint32_t split = blockIdx.x % plan.splits, u = blockIdx.x / plan.splits;
	const uint32_t hb = u % plan.head_blocks, im = u / plan.head_blocks;
	const uint32_t item = im / shape.n_kv_heads, m = im % shape.n_kv_heads;
	const struct kvr_attention_item it = items[item];
	const uint32_t g0 = hb * plan.heads;
	const uint32_t gc = G - g0 < plan.heads ? G - g0 : plan.heads;
	float *mine = plan.splits > 1 ? part + (uint64_t)blockIdx.x * plan.part_stride : nullptr;
	float *lse = shape.flags & KVR_SHAPE_SEGMENT_LSE ? it.segment_lse : nullptr;
	attend<ET, NACC, true>(shape, plan, it.q, it.out, mine, segments + it.first_segment,
			 it.n_segments, m, g0, gc, split, att_smem, lse);
}

/* dense: the item's one contiguous run is a segment with head_stride d. */
template <uint32_t ET, uint32_t NACC>
static __global__ void KVR_LAUNCH_BOUNDS(ATT_THREADS, 2)
	dense_kernel(struct kvr_shape shape, struct att_plan plan, const struct kvr_dense_item *items,
		     float *part)
{
	KVR_DYNAMIC_SHARED(float, att_smem);
	__shared__ struct kvr_kv_segment run;
	const uint32_t G = shape.n_qo_heads / shape.n_kv_heads;
	const uint32_t split = blockIdx.x % plan.splits, u = blockIdx.x / plan.splits;
	const uint32_t hb = u % plan.head_blocks, im = u / plan.head_blocks;
	const uint32_t item = im / shape.n_kv_heads, m = im % shape.n_kv_heads;
	const struct kvr_dense_item it = items[item];
	if (threadIdx.x == 0) {
		run.k = it.k;
		run.v = it.v;
		run.n_tokens = it.n_tokens;
		run.row_stride = it.row_stride;
		run.head_stride = shape.head_dim;
		run.format = KVR_KV_PLAIN;
	}
	__syncthreads();
	const uint32_t g0 = hb * plan.heads;
	const uint32_t gc = G - g0 < plan.heads ? G - g0 : plan.heads;
	float *mine = plan.splits > 1 ? part + (uint64_t)blockIdx.x * plan.part_stride : nullptr;
	/* plain rows only: no quantised tile code, which would cost registers */
	attend<ET, NACC, false>(shape, plan, it.q, it.out, mine, &run, 1, m, g0, gc, split, att_smem, nullptr);
}

/* Pass 2: block (item · n_kv + m) · head_blocks + chunk merges its splits'
 * states, in split order, into the outputs. ITEM is the attention or the
 * dense item (both have `out`). */
template <uint32_t ET, typename ITEM>
static __global__ void KVR_LAUNCH_BOUNDS(ATT_THREADS, 4)
	attention_combine_kernel(struct kvr_shape shape, struct att_plan plan, const ITEM *items,
				 const float *part)
{
	__shared__ float w_s[ATT_MAX_HEADS * ATT_MAX_SPLITS];
	__shared__ float l_s[ATT_MAX_HEADS];
	const uint32_t d = shape.head_dim, G = shape.n_qo_heads / shape.n_kv_heads;
	const uint32_t u = blockIdx.x, hb = u % plan.head_blocks, im = u / plan.head_blocks;
	const uint32_t item = im / shape.n_kv_heads, m = im % shape.n_kv_heads;
	const uint32_t g0 = hb * plan.heads;
	const uint32_t gc = G - g0 < plan.heads ? G - g0 : plan.heads;
	const uint32_t S = plan.splits, stride = plan.part_stride, tid = threadIdx.x;
	const float *base = part + (uint64_t)u * S * stride;
	const uint64_t m_at = (uint64_t)plan.heads * d, l_at = m_at + plan.heads;
	for (uint32_t g = tid; g < gc; g += ATT_THREADS) {
		float mx = -INFINITY;
		for (uint32_t s = 0; s < S; s++)
			mx = fmaxf(mx, base[(uint64_t)s * stride + m_at + g]);
		float l = 0.0f;
		for (uint32_t s = 0; s < S; s++) {
			/* 0 for an empty split (m = -inf); NaN states still poison l */
			const float w = kvr_softmax_rescale(base[(uint64_t)s * stride + m_at + g], mx);
			w_s[g * S + s] = w;
			l = l + base[(uint64_t)s * stride + l_at + g] * w;
		}
		l_s[g] = l;
	}
	__syncthreads();
	void *out = items[item].out;
	const uint64_t qo_base = (uint64_t)(m * G + g0) * d;
	for (uint32_t e = tid; e < gc * d; e += ATT_THREADS) {
		const uint32_t g = e / d;
		float a = 0.0f;
		for (uint32_t s = 0; s < S; s++)
			a = a + base[(uint64_t)s * stride + e] * w_s[g * S + s];
		const float l = l_s[g];
		kvr_store_f32(out, ET, qo_base + e, l == 0.0f ? 0.0f : a / l);
	}
}

/* ---------------------------------------------------------------- launchers */

/* Common shape checks; `what` names the kernel in the message. */
static int check_shape(const struct kvr_shape *s, const char *what)
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
static int grid_size(uint32_t n, uint64_t per_item, const char *what, uint32_t *grid)
{
	const uint64_t g = (uint64_t)n * per_item;
	if (g > 0x7fffffffull)
		return kernel_fail(-EINVAL, "%s: %llu blocks exceed the grid limit", what,
				   (unsigned long long)g);
	*grid = (uint32_t)g;
	return 0;
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

extern "C" int KVR_KERNEL_SYMBOL(launch_scatter)(const struct kvr_shape *shape,
						 const struct kvr_scatter_item *items, uint32_t n,
						 void *stream)
{
	int rc = check_shape(shape, "scatter");
	if (rc)
		return rc;
	if (shape->page_tokens == 0)
		return kernel_fail(-EINVAL, "scatter: page_tokens is 0");
	if (n == 0)
		return 0;
	uint32_t grid = 0;
	if ((rc = grid_size(n, 1, "scatter", &grid)))
		return rc;
	KVR_LAUNCH(scatter_kernel, grid, COPY_THREADS, 0, stream, *shape, items);
	return launch_status("scatter");
}

extern "C" int KVR_KERNEL_SYMBOL(launch_offload)(const struct kvr_shape *shape,
						 const struct kvr_page_item *items, uint32_t n,
						 void *stream)
{
	int rc = check_shape(shape, "offload");
	if (rc)
		return rc;
	if (shape->page_tokens == 0)
		return kernel_fail(-EINVAL, "offload: page_tokens is 0");
	if (n == 0)
		return 0;
	uint32_t grid = 0;
	if ((rc = grid_size(n, shape->n_kv_heads, "offload", &grid)))
		return rc;
	KVR_LAUNCH(offload_kernel, grid, COPY_THREADS, 0, stream, *shape, items);
	return launch_status("offload");
}

extern "C" int KVR_KERNEL_SYMBOL(launch_summarize)(const struct kvr_shape *shape,
						   const struct kvr_page_item *items, uint32_t n,
						   void *stream)
{
	int rc = check_shape(shape, "summarize");
	if (rc)
		return rc;
	if (shape->page_tokens == 0)
		return kernel_fail(-EINVAL, "summarize: page_tokens is 0");
	if (n == 0)
		return 0;
	const uint64_t cols = (uint64_t)shape->n_kv_heads * shape->head_dim;
	if (cols > 0xffffffffull)
		return kernel_fail(-EINVAL, "summarize: n_kv·d = %llu is too large",
				   (unsigned long long)cols);
	const uint32_t col_blocks = (uint32_t)((cols + SUMMARY_THREADS - 1) / SUMMARY_THREADS);
	uint32_t grid = 0;
	if ((rc = grid_size(n, col_blocks, "summarize", &grid)))
		return rc;
	KVR_LAUNCH_TYPED(summarize_kernel, shape->elem_type, grid, SUMMARY_THREADS, 0, stream,
			 *shape, col_blocks, items);
	return launch_status("summarize");
}

/*
 * Score: splits per (item, KV head) aimed at SCORE_BLOCKS_PER_SM blocks per
 * SM for the page passes (sm_count = 0: one split), and the scratch's layout.
 * The cache holds as many pages per (item, query head) as the scratch has
 * room for.
 */
static const uint32_t SCORE_BLOCKS_PER_SM = 8;

static void score_plan_layout(const struct kvr_shape *s, uint32_t n, uint32_t sm_count,
			      struct score_plan *p)
{
	const uint64_t base = (uint64_t)n * s->n_kv_heads;
	uint64_t splits = (uint64_t)sm_count * SCORE_BLOCKS_PER_SM / base;
	splits = splits < 1 ? 1 : (splits > SCORE_MAX_SPLITS ? SCORE_MAX_SPLITS : splits);
	p->splits = (uint32_t)splits;
	p->cache = 0;
	p->off_stat = base * splits * (s->n_qo_heads / s->n_kv_heads);
	p->off_cache = p->off_stat + 2ull * n * s->n_qo_heads;
}

extern "C" size_t KVR_KERNEL_SYMBOL(score_scratch_bytes)(const struct kvr_shape *shape, uint32_t n,
							 uint32_t sm_count, uint32_t cache_pages)
{
	if (n == 0 || check_shape(shape, "score"))
		return 0;
	struct score_plan p;
	score_plan_layout(shape, n, sm_count, &p);
	return (size_t)((p.off_cache + (uint64_t)n * shape->n_qo_heads * cache_pages) *
			sizeof(float));
}

extern "C" int KVR_KERNEL_SYMBOL(launch_score_scratch)(const struct kvr_shape *shape,
						       const struct kvr_score_item *items,
						       uint32_t n, void *scratch,
						       size_t scratch_bytes, uint32_t sm_count,
						       void *stream)
{
	int rc = check_shape(shape, "score");
	if (rc)
		return rc;
	if (shape->head_dim > SCORE_MAX_DIM)
		return kernel_fail(-EINVAL, "score: head_dim %u > %u", shape->head_dim,
				   SCORE_MAX_DIM);
	if (n == 0)
		return 0;
	struct score_plan plan;
	score_plan_layout(shape, n, sm_count, &plan);
	const uint64_t have = scratch ? scratch_bytes / sizeof(float) : 0;
	if (have < plan.off_cache)
		return kernel_fail(-EINVAL, "score: %zu bytes of scratch, at least %llu needed",
				   scratch ? scratch_bytes : 0,
				   (unsigned long long)(plan.off_cache * sizeof(float)));
	const uint64_t cache = (have - plan.off_cache) / ((uint64_t)n * shape->n_qo_heads);
	plan.cache = cache > 0xffffffffull ? 0xffffffffu : (uint32_t)cache;
	uint32_t pages_grid = 0, heads_grid = 0;
	if ((rc = grid_size(n, (uint64_t)shape->n_kv_heads * plan.splits, "score", &pages_grid)) ||
	    (rc = grid_size(n, shape->n_qo_heads, "score", &heads_grid)))
		return rc;
	float *f = static_cast<float *>(scratch);
	if (shape->n_qo_heads / shape->n_kv_heads <= 4)
		KVR_LAUNCH_TYPED2(score_pages_kernel, shape->elem_type, 4, pages_grid, SCORE_THREADS,
				  0, stream, *shape, plan, items, f);
	else
		KVR_LAUNCH_TYPED2(score_pages_kernel, shape->elem_type, SCORE_HEADS, pages_grid,
				  SCORE_THREADS, 0, stream, *shape, plan, items, f);
	if ((rc = launch_status("score (pages)")))
		return rc;
	KVR_LAUNCH_TYPED(score_sums_kernel, shape->elem_type, heads_grid, SCORE_THREADS, 0, stream,
			 *shape, plan, items, f);
	if ((rc = launch_status("score (sums)")))
		return rc;
	KVR_LAUNCH_TYPED(score_final_kernel, shape->elem_type, pages_grid, SCORE_THREADS, 0,
			 stream, *shape, plan, items, static_cast<const float *>(f));
	return launch_status("score (final)");
}

extern "C" int KVR_KERNEL_SYMBOL(launch_select)(const struct kvr_shape *shape,
						const struct kvr_score_item *items, uint32_t n,
						void *stream)
{
	int rc = check_shape(shape, "select");
	if (rc)
		return rc;
	if (n == 0)
		return 0;
	uint32_t grid = 0;
	if ((rc = grid_size(n, shape->n_kv_heads, "select", &grid)))
		return rc;
	KVR_LAUNCH(select_kernel, grid, SELECT_THREADS, 0, stream, *shape, items);
	return launch_status("select");
}

extern "C" int KVR_KERNEL_SYMBOL(launch_similarity)(const struct kvr_shape *shape,
						    const struct kvr_similarity_item *items,
						    uint32_t n, void *stream)
{
	int rc = check_shape(shape, "similarity");
	if (rc)
		return rc;
	if (n == 0)
		return 0;
	uint32_t grid = 0;
	if ((rc = grid_size(n, shape->n_kv_heads, "similarity", &grid)))
		return rc;
	KVR_LAUNCH_TYPED(similarity_kernel, shape->elem_type, grid, SIM_THREADS, 0, stream, *shape,
			 items);
	return launch_status("similarity");
}

/* ----------------------------------------------------------------- freelist */

/*
 * One block per list (item), a thread per unit in strides of the block: the
 * exclusive scan of the units' counts runs block-wide, FREELIST_THREADS
 * units at a time with a carry (a Hillis–Steele scan in shared memory: 8
 * steps, 64-bit sums so no count total can wrap); thread 0 decides the round
 * with layouts/freelist.h's verdict, every thread copies its own units'
 * slices, and thread 0 moves the counter after a barrier. Thread t writes
 * offsets[u] for its own units u and later reads only those, so the only
 * cross-thread data are the scan array, the verdict and the counters, each
 * behind a barrier. Rounds of tens of thousands of units are a few µs of one
 * SM; a list is one block because its counter update must follow every
 * unit's copy.
 */
static const uint32_t FREELIST_THREADS = 256;

static __global__ void KVR_LAUNCH_BOUNDS(FREELIST_THREADS, 4)
	freelist_kernel(const struct kvr_freelist_item *items)
{
	const struct kvr_freelist_item it = items[blockIdx.x];
	__shared__ uint64_t scan_s[FREELIST_THREADS];
	__shared__ int verdict_s;
	const uint32_t t = threadIdx.x;
	uint64_t total = 0; /* the same in every thread after each chunk */
	for (uint32_t base = 0; base < it.n_units; base += FREELIST_THREADS) {
		const uint32_t u = base + t;
		const uint64_t c = u < it.n_units ? it.counts[u] : 0;
		scan_s[t] = c;
		__syncthreads();
		for (uint32_t step = 1; step < FREELIST_THREADS; step <<= 1) {
			const uint64_t add = t >= step ? scan_s[t - step] : 0;
			__syncthreads();
			scan_s[t] += add;
			__syncthreads();
		}
		if (u < it.n_units)
			it.offsets[u] = total + scan_s[t] - c;
		total += scan_s[FREELIST_THREADS - 1];
		__syncthreads(); /* everyone read the chunk's sum before the next overwrites it */
	}
	if (t == 0) {
		verdict_s = kvr_freelist_verdict(it.op, it.counters[0], it.counters[1], it.capacity, total,
						 it.pages_capacity);
		*it.status = verdict_s;
	}
	__syncthreads();
	if (verdict_s)
		return; /* every thread alike: nobody waits at a later barrier */
	struct kvr_freelist l = { it.ids, it.capacity, 0, it.counters[0], it.counters[1] };
	for (uint32_t u = t; u < it.n_units; u += FREELIST_THREADS) {
		const uint64_t off = it.offsets[u];
		if (it.op == KVR_FREELIST_ALLOC)
			kvr_freelist_take(&l, off, it.counts[u], it.pages + off);
		else
			kvr_freelist_give(&l, off, it.counts[u], it.pages + off);
	}
	__syncthreads(); /* every thread read the counters and finished its copies */
	if (t == 0)
		it.counters[it.op == KVR_FREELIST_ALLOC ? 0 : 1] += total;
}

extern "C" int KVR_KERNEL_SYMBOL(launch_freelist)(const struct kvr_freelist_item *items, uint32_t n,
						  void *stream)
{
	if (n == 0)
		return 0;
	uint32_t grid = 0;
	int rc = grid_size(n, 1, "freelist", &grid);
	if (rc)
		return rc;
	KVR_LAUNCH(freelist_kernel, grid, FREELIST_THREADS, 0, stream, items);
	return launch_status("freelist");
}

/*
 * Tile and head chunking for attention and dense: the tile holds 8 KiB of raw
 * K (and of V), at most 64 tokens; then as many query heads per block as the
 * accumulators (16 heads per thread, 256/d heads side by side) and 48 KiB of
 * shared memory allow, spread evenly over the fewest blocks. Groups of up to
 * 14 heads take one block at every head_dim (24 at d = 128 in 16-bit types).
 * Then the splits: as many per (item, KV head, head chunk) as bring the grid
 * to ATT_BLOCKS_PER_SM blocks per SM, at most ATT_MAX_SPLITS (sm_count = 0:
 * one split, no scratch).
 */
static int att_plan_make(const struct kvr_shape *s, const char *what, uint32_t n,
			 uint32_t sm_count, struct att_plan *p)
{
	int rc = check_shape(s, what);
	if (rc)
		return rc;
	const uint32_t d = s->head_dim, G = s->n_qo_heads / s->n_kv_heads;
	if (d % 32 != 0 || d > 256)
		return kernel_fail(-EINVAL, "%s: head_dim %u is not a multiple of 32 up to 256",
				   what, d);
	if (G > ATT_MAX_HEADS)
		return kernel_fail(-EINVAL, "%s: group of %u query heads per KV head > %u", what, G,
				   ATT_MAX_HEADS);
	const uint32_t eb = kvr_elem_bytes(s->elem_type);
	uint32_t tile = ATT_TILE_BYTES / (d * eb);
	if (tile > ATT_MAX_TILE)
		tile = ATT_MAX_TILE;
	const uint32_t fixed = tile * (d + ATT_K_PAD) + tile * d; /* K and V, floats */
	const uint32_t budget = ATT_SMEM_BYTES / 4;
	const uint32_t side = ATT_THREADS / d;
	uint32_t heads = G;
	for (uint32_t blocks = 1; blocks <= G; blocks++) {
		heads = (G + blocks - 1) / blocks;
		if (heads <= side * ATT_MAX_ACC && fixed + heads * (d + tile + 3) <= budget)
			break;
	}
	/* one head always fits: K+V take at most 8448 of the 12288 floats */
	p->tile = tile;
	p->heads = heads;
	p->head_blocks = (G + heads - 1) / heads;
	p->off_k = heads * d;
	p->off_v = p->off_k + tile * (d + ATT_K_PAD);
	p->off_p = p->off_v + tile * d;
	p->off_m = p->off_p + heads * tile;
	p->off_l = p->off_m + heads;
	p->off_alpha = p->off_l + heads;
	p->smem_bytes = (p->off_alpha + heads) * 4u;
	p->acc = (heads + side - 1) / side;
	p->part_stride = heads * (d + 2);
	const uint64_t base = (uint64_t)n * s->n_kv_heads * p->head_blocks;
	uint64_t splits = base ? (uint64_t)sm_count * ATT_BLOCKS_PER_SM / base : 1;
	p->splits = (uint32_t)(splits < 1 ? 1 : (splits > ATT_MAX_SPLITS ? ATT_MAX_SPLITS : splits));
	if (s->flags & KVR_SHAPE_SEGMENT_LSE)
		p->splits = 1; /* a segment's sum must not straddle two blocks */
	return 0;
}

/* Scratch bytes the plan's split states take (0 with one split). */
static uint64_t att_scratch_need(const struct att_plan *p, uint32_t n, uint32_t n_kv)
{
	if (p->splits == 1)
		return 0;
	return (uint64_t)n * n_kv * p->head_blocks * p->splits * p->part_stride * sizeof(float);
}

/* A plan whose states do not fit the scratch runs as one split. */
static void att_fit_scratch(struct att_plan *p, uint32_t n, uint32_t n_kv, const void *scratch,
			    size_t scratch_bytes)
{
	if (p->splits > 1 && (!scratch || scratch_bytes < att_scratch_need(p, n, n_kv)))
		p->splits = 1;
}

extern "C" size_t KVR_KERNEL_SYMBOL(attention_scratch_bytes)(const struct kvr_shape *shape,
							     uint32_t n, uint32_t sm_count)
{
	struct att_plan plan;
	if (n == 0 || att_plan_make(shape, "attention", n, sm_count, &plan))
		return 0;
	return (size_t)att_scratch_need(&plan, n, shape->n_kv_heads);
}

/* The accumulator counts attend is compiled for: the fewest that hold plan.acc. */
static uint32_t att_nacc(uint32_t acc)
{
	return acc <= 2 ? 2u : (acc <= 4 ? 4u : ATT_MAX_ACC);
}

template <uint32_t ET>
static void launch_attention_et(uint32_t grid, const struct kvr_shape &shape,
				const struct att_plan &plan, const struct kvr_attention_item *items,
				const struct kvr_kv_segment *segments, float *part, void *stream)
{
	const uint32_t nacc = att_nacc(plan.acc);
	if (nacc == 2)
		KVR_LAUNCH(attention_kernel<KVR_TARGS(ET, 2)>, grid, ATT_THREADS, plan.smem_bytes,
			   stream, shape, plan, items, segments, part);
	else if (nacc == 4)
		KVR_LAUNCH(attention_kernel<KVR_TARGS(ET, 4)>, grid, ATT_THREADS, plan.smem_bytes,
			   stream, shape, plan, items, segments, part);
	else
		KVR_LAUNCH(attention_kernel<KVR_TARGS(ET, ATT_MAX_ACC)>, grid, ATT_THREADS,
			   plan.smem_bytes, stream, shape, plan, items, segments, part);
}

template <uint32_t ET>
static void launch_dense_et(uint32_t grid, const struct kvr_shape &shape,
			    const struct att_plan &plan, const struct kvr_dense_item *items,
			    float *part, void *stream)
{
	const uint32_t nacc = att_nacc(plan.acc);
	if (nacc == 2)
		KVR_LAUNCH(dense_kernel<KVR_TARGS(ET, 2)>, grid, ATT_THREADS, plan.smem_bytes,
			   stream, shape, plan, items, part);
	else if (nacc == 4)
		KVR_LAUNCH(dense_kernel<KVR_TARGS(ET, 4)>, grid, ATT_THREADS, plan.smem_bytes,
			   stream, shape, plan, items, part);
	else
		KVR_LAUNCH(dense_kernel<KVR_TARGS(ET, ATT_MAX_ACC)>, grid, ATT_THREADS,
			   plan.smem_bytes, stream, shape, plan, items, part);
}

/* Pass 2 of a split attention or dense call: grid = blocks of pass 1 / splits. */
template <typename ITEM>
static int launch_combine(const char *what, uint32_t grid, const struct kvr_shape &shape,
			  const struct att_plan &plan, const ITEM *items, const float *part,
			  void *stream)
{
	switch (shape.elem_type) {
	case KVR_ELEM_F16:
		KVR_LAUNCH(attention_combine_kernel<KVR_TARGS(KVR_ELEM_F16, ITEM)>, grid,
			   ATT_THREADS, 0, stream, shape, plan, items, part);
		break;
	case KVR_ELEM_BF16:
		KVR_LAUNCH(attention_combine_kernel<KVR_TARGS(KVR_ELEM_BF16, ITEM)>, grid,
			   ATT_THREADS, 0, stream, shape, plan, items, part);
		break;
	default:
		KVR_LAUNCH(attention_combine_kernel<KVR_TARGS(KVR_ELEM_F32, ITEM)>, grid,
			   ATT_THREADS, 0, stream, shape, plan, items, part);
		break;
	}
	return launch_status(what);
}

extern "C" int KVR_KERNEL_SYMBOL(launch_attention_scratch)(
	const struct kvr_shape *shape, const struct kvr_attention_item *items, uint32_t n,
	const struct kvr_kv_segment *segments, uint32_t n_segments, void *scratch,
	size_t scratch_bytes, uint32_t sm_count, void *stream)
{
	struct att_plan plan;
	int rc = att_plan_make(shape, "attention", n, sm_count, &plan);
	if (rc)
		return rc;
	if (n == 0)
		return 0;
	if (!segments && n_segments)
		return kernel_fail(-EINVAL, "attention: %u segments but no segment array",
				   n_segments);
	att_fit_scratch(&plan, n, shape->n_kv_heads, scratch, scratch_bytes);
	uint32_t grid = 0;
	if ((rc = grid_size(n, (uint64_t)shape->n_kv_heads * plan.head_blocks * plan.splits,
			    "attention", &grid)))
		return rc;
	float *part = static_cast<float *>(scratch);
	switch (shape->elem_type) {
	case KVR_ELEM_F16:
		launch_attention_et<KVR_ELEM_F16>(grid, *shape, plan, items, segments, part, stream);
		break;
	case KVR_ELEM_BF16:
		launch_attention_et<KVR_ELEM_BF16>(grid, *shape, plan, items, segments, part, stream);
		break;
	default:
		launch_attention_et<KVR_ELEM_F32>(grid, *shape, plan, items, segments, part, stream);
		break;
	}
	if ((rc = launch_status("attention")) || plan.splits == 1)
		return rc;
	return launch_combine("attention (combine)", grid / plan.splits, *shape, plan, items, part,
			      stream);
}

extern "C" int KVR_KERNEL_SYMBOL(launch_dense_scratch)(const struct kvr_shape *shape,
						       const struct kvr_dense_item *items,
						       uint32_t n, void *scratch,
						       size_t scratch_bytes, uint32_t sm_count,
						       void *stream)
{
	struct att_plan plan;
	int rc = att_plan_make(shape, "dense", n, sm_count, &plan);
	if (rc)
		return rc;
	if (n == 0)
		return 0;
	att_fit_scratch(&plan, n, shape->n_kv_heads, scratch, scratch_bytes);
	uint32_t grid = 0;
	if ((rc = grid_size(n, (uint64_t)shape->n_kv_heads * plan.head_blocks * plan.splits,
			    "dense", &grid)))
		return rc;
	float *part = static_cast<float *>(scratch);
	switch (shape->elem_type) {
	case KVR_ELEM_F16:
		launch_dense_et<KVR_ELEM_F16>(grid, *shape, plan, items, part, stream);
		break;
	case KVR_ELEM_BF16:
		launch_dense_et<KVR_ELEM_BF16>(grid, *shape, plan, items, part, stream);
		break;
	default:
		launch_dense_et<KVR_ELEM_F32>(grid, *shape, plan, items, part, stream);
		break;
	}
	if ((rc = launch_status("dense")) || plan.splits == 1)
		return rc;
	return launch_combine("dense (combine)", grid / plan.splits, *shape, plan, items, part,
			      stream);
}

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

static void *emu_scratch(size_t bytes, size_t *have)
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

extern "C" int KVR_KERNEL_SYMBOL(launch_score)(const struct kvr_shape *shape,
					       const struct kvr_score_item *items, uint32_t n,
					       void *stream)
{
	size_t have = 0;
	void *scratch = emu_scratch(
		KVR_KERNEL_SYMBOL(score_scratch_bytes)(shape, n, EMU_SM_COUNT, EMU_SCORE_CACHE),
		&have);
	return KVR_KERNEL_SYMBOL(launch_score_scratch)(shape, items, n, scratch, have,
						       EMU_SM_COUNT, stream);
}

extern "C" int KVR_KERNEL_SYMBOL(launch_attention)(const struct kvr_shape *shape,
						   const struct kvr_attention_item *items,
						   uint32_t n, const struct kvr_kv_segment *segments,
						   uint32_t n_segments, void *stream)
{
	size_t have = 0;
	void *scratch = emu_scratch(
		KVR_KERNEL_SYMBOL(attention_scratch_bytes)(shape, n, EMU_SM_COUNT), &have);
	return KVR_KERNEL_SYMBOL(launch_attention_scratch)(shape, items, n, segments, n_segments,
							   scratch, have, EMU_SM_COUNT, stream);
}

extern "C" int KVR_KERNEL_SYMBOL(launch_dense)(const struct kvr_shape *shape,
					       const struct kvr_dense_item *items, uint32_t n,
					       void *stream)
{
	size_t have = 0;
	void *scratch = emu_scratch(
		KVR_KERNEL_SYMBOL(attention_scratch_bytes)(shape, n, EMU_SM_COUNT), &have);
	return KVR_KERNEL_SYMBOL(launch_dense_scratch)(shape, items, n, scratch, have,
						       EMU_SM_COUNT, stream);
}
#endif
