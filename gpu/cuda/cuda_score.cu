/* SPDX-License-Identifier: MIT */
/*
 * cuda_score.cu — selection's kernels, each beside its launcher: score (Quest
 * bounds, per-head softmax over the item's domain, group mean; three passes),
 * select (the hand-written top-k; cuda_topk.cu holds its CUB twin behind
 * kvr_cuda_select_topk) and similarity (q_i against q_(i-1), the correction
 * check). Threads and streams as cuda_common.cuh says.
 */
#include "cuda_common.cuh"

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

/* Block (item·n_kv + m)·splits + b of passes 1 and 3: split b of KV head m
 * of the item. */
struct split_block {
	uint32_t split, item, kv_head;
};

static __device__ __forceinline__ struct split_block split_block_of(const struct score_plan &plan,
								     uint32_t n_kv)
{
	const uint32_t im = blockIdx.x / plan.splits;
	return { blockIdx.x % plan.splits, im / n_kv, im % n_kv };
}

/* each(g, s_g) for g = 0 .. gc-1 in order (gc <= NH), s_g = scale · Σ_c
 * q_gc·(q_gc's sign bit set ? min_c : max_c) (kvr_quest_acc) for the page whose summary (min row then max
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
							acc[g] = kvr_quest_acc(acc[g], q_s[g * d + c], lo, hi);
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

/* kvr_score_gated_off with the gate's loads issued together: the flags are
 * mapped host memory (the similarity kernel writes them there), so one bus
 * round trip for the group rather than one per flag. */
KVR_DEV int score_gated_off(const struct kvr_score_item *it, uint32_t n_kv)
{
	if (!it->gate)
		return 0;
	uint32_t any = 0;
	KVR_UNROLL8
	for (uint32_t m = 0; m < n_kv; m++)
		any |= it->gate[m];
	return any == 0;
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

	const uint32_t n_kv = shape.n_kv_heads, d = shape.head_dim, n_qo = shape.n_qo_heads, G = n_qo / n_kv;
	const struct split_block blk = split_block_of(plan, n_kv);
	const uint32_t b = blk.split, item = blk.item, m = blk.kv_head;
	const struct kvr_score_item it = items[item];
	if (it.cand_end <= it.cand_begin || score_gated_off(&it, n_kv))
		return; /* no candidates, or gated off: nothing to write (whole block) */
	uint32_t dom_begin, dom_end;
	kvr_score_domain(&it, &dom_begin, &dom_end);
	const uint32_t n_dom = dom_end - dom_begin;
	uint32_t r_begin, r_end;
	score_chunk(n_dom, plan.splits, b, &r_begin, &r_end);
	const uint32_t tid = threadIdx.x, grp = tid / KVR_DOT_LANES, lane16 = tid % KVR_DOT_LANES;
	/* 32 bits (n_kv·4·d fits): a 64-bit stride held across the loop cost
	 * score_pages_kernel<.., 16> a spill on sm_90 */
	const uint32_t page_elems = (uint32_t)kvr_summary_page_elems(n_kv, d, (shape.flags & KVR_SHAPE_ESTIMATES) != 0);
	const uint64_t head_off = (uint64_t)m * 2u * d;
	const bool cached = n_dom <= plan.cache;
	float *pmax = scratch + (((uint64_t)item * n_kv + m) * plan.splits + b) * G;
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
	if (it.cand_end <= it.cand_begin || score_gated_off(&it, n_kv))
		return;
	uint32_t dom_begin, dom_end;
	kvr_score_domain(&it, &dom_begin, &dom_end);
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
		const uint32_t page_elems = (uint32_t)kvr_summary_page_elems(n_kv, d, (shape.flags & KVR_SHAPE_ESTIMATES) != 0);
		const uint64_t head_off = (uint64_t)m * 2u * d;
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

	const uint32_t n_kv = shape.n_kv_heads, d = shape.head_dim, n_qo = shape.n_qo_heads, G = n_qo / n_kv;
	const struct split_block blk = split_block_of(plan, n_kv);
	const uint32_t b = blk.split, item = blk.item, m = blk.kv_head;
	const struct kvr_score_item it = items[item];
	if (it.cand_end <= it.cand_begin || score_gated_off(&it, n_kv))
		return; /* as in pass 1 */
	const uint32_t n_cand = it.cand_end - it.cand_begin;
	uint32_t dom_begin, dom_end;
	kvr_score_domain(&it, &dom_begin, &dom_end);
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
	const uint32_t page_elems = (uint32_t)kvr_summary_page_elems(n_kv, d, (shape.flags & KVR_SHAPE_ESTIMATES) != 0);
	const uint64_t head_off = (uint64_t)m * 2u * d;
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
static const uint32_t SELECT_THREADS = SCAN_THREADS; /* block_scan's block */
static const uint32_t SELECT_WARPS = SCAN_WARPS;
static const uint32_t SELECT_CACHE = 8192; /* keys kept in shared memory */
static const uint32_t SELECT_PER_THREAD = 8; /* consecutive candidates per thread, final pass */
static const uint32_t SELECT_BINS = 256;

KVR_DEV uint32_t score_key(float x)
{
	const uint32_t u = __float_as_uint(x);
	return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
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
	if (k == 0 || score_gated_off(&it, n_kv))
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
			KVR_UNROLL4 /* the loads issued together: q_prev may be mapped host memory */
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

/* ---------------------------------------------------------------- launchers */

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
	uint32_t grid;
	const int rc = items_grid(shape, n, true, false, "select", &grid);
	if (rc || !grid)
		return rc;
	KVR_LAUNCH(select_kernel, grid, SELECT_THREADS, 0, stream, *shape, items);
	return launch_status("select");
}

extern "C" int KVR_KERNEL_SYMBOL(launch_similarity)(const struct kvr_shape *shape,
						    const struct kvr_similarity_item *items,
						    uint32_t n, void *stream)
{
	uint32_t grid;
	const int rc = items_grid(shape, n, true, false, "similarity", &grid);
	if (rc || !grid)
		return rc;
	KVR_LAUNCH_TYPED(similarity_kernel, shape->elem_type, grid, SIM_THREADS, 0, stream, *shape,
			 items);
	return launch_status("similarity");
}

#if defined(KVR_CUDAEMU)
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
#endif
