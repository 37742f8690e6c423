/* SPDX-License-Identifier: MIT */
/*
 * cuda_attention.cu — attention over an item's KV segments and dense
 * attention over a sequence's pages, split over blocks (flash-decoding) with
 * a combine pass, beside their launchers and the tile/split planning. Threads
 * and streams as cuda_common.cuh says.
 */
#include "cuda_common.cuh"

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
 * Causal query blocks (KVR_SHAPE_CAUSAL, the prefill; kernels.h): query
 * head g of the group belongs to query token g / causal_heads_per_query and
 * sees only the item's tokens up to its position, counted over the segments
 * from the first (a split knows where its tokens start); the QK step masks the
 * later ones to −inf, a head that has seen none yet weighs them 0, and a block
 * stops at the first tile past its last query. The splits then divide the
 * prefix evenly, as for decode, and the combine pass merges them unchanged.
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

static_assert(ATT_THREADS == SCAN_THREADS, "attention's segment scan uses block_scan");

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

/* The block's query rows into q_s: as given (plain tiles), or rounded as
 * quantised keys' contract has it (kvquant.h, kvr_quant_query_row: the row
 * times the scale rounded to 8 bits against s_q = max|x|/127), held as
 * s_q·q8/scale so that the tile loop's scale·Σ q̂·k̂ is s_q·Σ q8·k̂ to a few
 * float ulp. A warp a head (its max over the lanes); the same float
 * operations as the host's, NaN for a row with a non-finite element. */
template <uint32_t ET>
KVR_DEV void att_load_q(const void *q, uint64_t qo_base, uint32_t gc, uint32_t d, float scale, bool rounded,
			float *q_s)
{
	const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
	if (!rounded) {
		for (uint32_t e = threadIdx.x; e < gc * d; e += ATT_THREADS)
			q_s[e] = load_elem<ET>(q, qo_base + e);
		return;
	}
	for (uint32_t g = warp; g < gc; g += ATT_WARPS) {
		float amax = 0.0f;
		bool finite = true;
		for (uint32_t c = lane; c < d; c += 32) {
			const float a = fabsf(load_elem<ET>(q, qo_base + (uint64_t)g * d + c) * scale);
			finite &= a <= 3.40282347e38f;
			amax = fmaxf(amax, a);
		}
		amax = warp_max(amax);
		finite = __all_sync(0xffffffffu, finite);
		const float s_q = amax / 127.0f;
		for (uint32_t c = lane; c < d; c += 32) {
			float r = 0.0f;
			if (!finite) {
				r = NAN;
			} else if (amax > 0.0f) {
				const float x = load_elem<ET>(q, qo_base + (uint64_t)g * d + c) * scale;
				const float t = x / s_q + 12582912.0f;
				r = fminf(fmaxf(t - 12582912.0f, -127.0f), 127.0f);
				r = s_q * r / scale;
			}
			q_s[g * d + c] = r;
		}
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
			     uint32_t *off, uint32_t *left, uint64_t *first_token)
{
	*seg = 0;
	*off = 0;
	*first_token = 0;
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
	*first_token = start;
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
	/* PV ownership: `side` = 256/d heads side by side; this thread owns
	 * column c_own of heads g_own, g_own + side, ... (n_mine <= NACC of them) */
	const uint32_t side = ATT_THREADS / d, c_own = tid % d, g_own = tid / d;
	const uint32_t n_mine = g_own < side && g_own < gc ? (gc - g_own + side - 1) / side : 0u;

	uint32_t seg, off, left;
	uint64_t tok; /* the item's tokens before the tile, counted over its segments */
	att_split_range(segs, n_segs, plan.splits, split, scan_s, found_s, &seg, &off, &left, &tok);
	/* KVR_SHAPE_CAUSAL: head g0 + g is query token (g0 + g) / hq at position
	 * pos0 + that, and sees the tokens up to it; the block stops after the
	 * last query's position */
	const bool causal = (shape.flags & KVR_SHAPE_CAUSAL) != 0;
	const uint32_t hq = causal ? shape.causal_heads_per_query : 1u;
	const uint64_t pos0 = shape.causal_first_position, last_pos = pos0 + (g0 + gc - 1) / hq;

	/* q_s holds the rows as given, or rounded while the tiles are quantised */
	bool q_rounded = QUANT && n_segs && seg < n_segs && kvr_segment_quantised(segs[seg].format);
	att_load_q<ET>(q, qo_base, gc, d, shape.scale, q_rounded, q_s);
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
	if (rows && !(QUANT && kvr_segment_quantised(segs[seg].format)))
		att_fetch<ET>(segs[seg], off, rows, m, map, pre);
	while (rows > 0) {
		if (causal && tok > last_pos)
			break; /* uniform: every thread holds the same tok */
		/* every thread is past the last tile's reads of q_s (the barrier
		 * before its PV) */
		if (QUANT && kvr_segment_quantised(segs[seg].format) != q_rounded) {
			q_rounded = !q_rounded;
			att_load_q<ET>(q, qo_base, gc, d, shape.scale, q_rounded, q_s);
		}
		if (QUANT && kvr_segment_quantised(segs[seg].format))
			att_store_quant(segs[seg], off, rows, m, shape.page_tokens, d, k_s, v_s);
		else
			att_store<ET>(pre, rows, d, map, k_s, v_s);
		__syncthreads(); /* K, V (and q and the softmax state, first time) are ready */

		/* the tile closes its segment, or is the block's last (causal: the
		 * tokens after the last query are never read): lse after it */
		const uint32_t tile_seg = seg;
		const uint64_t tile_tok = tok;
		const bool closes = off + rows == segs[seg].n_tokens || (causal && tile_tok + rows > last_pos);
		tok += rows;
		left -= rows;
		att_advance(segs, n_segs, &seg, &off, rows);
		const uint32_t next = att_rows(segs, n_segs, seg, off, tile, left);
		if (next && !(QUANT && kvr_segment_quantised(segs[seg].format)))
			att_fetch<ET>(segs[seg], off, next, m, map, pre);

		/* estimate rows stand for p tokens each: ln(p) on their logits */
		const float log_weight = kvr_segment_log_weight(segs[tile_seg].format, shape.page_tokens);
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
					s[h] = shape.scale * (a0 + a1) + log_weight;
					if (causal && tile_tok + t > pos0 + (g0 + g) / hq)
						s[h] = -INFINITY; /* a later token than the query */
				}
			}
			const float m_old = m_s[g];
			const float m_new = fmaxf(m_old, warp_max(fmaxf(s[0], s[1])));
			/* causal: a head that has seen no token yet (max −inf) weighs its
			 * masked ones exp(−inf − 0) = 0, not NaN */
			const float m_sub = causal && m_new == -INFINITY ? 0.0f : m_new;
			float psum = 0.0f;
			KVR_UNROLL
			for (uint32_t h = 0; h < 2; h++) {
				const uint32_t t = lane + 32 * h;
				if (t < rows) {
					const float p = kvr_expf(s[h] - m_sub);
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
	struct kvr_shape sh = shape; /* a causal item's first position: its block's */
	if (shape.flags & KVR_SHAPE_CAUSAL)
		sh.causal_first_position = kvr_causal_item_position(&shape, item);
	attend<ET, NACC, true>(sh, plan, it.q, it.out, mine, segments + it.first_segment,
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
	/* plain rows only: no quantised tile code, which would cost registers
	 * (and never causal: kvr_dev_dense refuses the flag) */
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
