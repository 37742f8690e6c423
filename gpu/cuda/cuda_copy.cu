/* SPDX-License-Identifier: MIT */
/*
 * cuda_copy.cu — the kernels that move pages and lists, each beside its
 * launcher: scatter (staging HND runs into NHD slot tiles), offload (NHD rows
 * of a full tail page into one HND page), summarize (a page's key min/max),
 * freelist (the device free-page list's compaction round), plan (the
 * selected pages' attention segments) and append (a token's rows into its tail
 * tile, and the page it completes offloaded and summarized); also the
 * launchers' message getter. Threads and streams as cuda_common.cuh says.
 */
#include "cuda_common.cuh"

extern "C" const char *KVR_KERNEL_SYMBOL(last_message)(void)
{
	return kernel_message();
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

/* ------------------------------------------------------------------ plan */

/* One block per item, every step of it in parallel. The item's inputs are
 * mapped host memory (the lane's selection, the correction flag, the page
 * table, the slot table): the block brings the k pages, their memory and
 * the slots into shared memory (one bus round trip each, not k one after
 * another). Then the slots are planned as kvr_plan_item_run_with plans them,
 * with the same result:
 *  - hits: each page entry looks for the first slot holding its page. Where
 *    the selection's pages are distinct (a top-k's are) that is the
 *    sequential matching's answer, which walks the slots and gives each the
 *    first unplaced entry; a selection with a page twice takes the
 *    sequential path (one thread), so any input plans alike;
 *  - misses, in entry order, take the free slots in slot order: the r-th
 *    miss (a rank from a popcount bitmap) the r-th free slot;
 *  - the taken pages' segments go to their rank among the taken, and the
 *    tail's segments move up in chunks of the block, each read before any
 *    is written: a chunk lands below the next one's sources, as the taken
 *    count is at most k.
 * The block writes the slots back. What took one thread O(k²) steps takes
 * each O(k·k/threads): per entry, a scan of the slots and one of the entries
 * before it (the repeated-page check); at k = 64, one scan each. */
static const uint32_t PLAN_THREADS = 128;
#define PLAN_WORDS (KVR_PLAN_MAX_K / 32)

/* Entries before `i` set in `bits`, given each word's count of the set
 * entries before it (`before`). */
KVR_DEV uint32_t plan_rank(const uint32_t *bits, const uint32_t *before, uint32_t i)
{
	return before[i / 32] + (uint32_t)__popc(bits[i / 32] & ((1u << (i % 32)) - 1u));
}

/* Each word's count of set entries before it, by the threads below
 * `words`, and the total of all of them (every thread's return). The
 * caller syncs before and after. */
KVR_DEV void plan_prefix(const uint32_t *bits, uint32_t *before, uint32_t words)
{
	if (threadIdx.x < words) {
		uint32_t n = 0;
		for (uint32_t x = 0; x < threadIdx.x; x++)
			n += (uint32_t)__popc(bits[x]);
		before[threadIdx.x] = n;
	}
}

static __global__ void KVR_LAUNCH_BOUNDS(PLAN_THREADS, 4)
	plan_kernel(const struct kvr_plan_item *items)
{
	__shared__ int32_t pages_s[KVR_PLAN_MAX_K];
	__shared__ uint64_t addr_s[KVR_PLAN_MAX_K];
	__shared__ int32_t slots_s[KVR_PLAN_MAX_K];
	__shared__ int16_t slot_of_s[KVR_PLAN_MAX_K]; /* each entry's slot, -1: none */
	__shared__ uint16_t free_at_s[KVR_PLAN_MAX_K]; /* the r-th free slot */
	__shared__ uint32_t keep_w[PLAN_WORDS], miss_w[PLAN_WORDS], free_w[PLAN_WORDS], taken_w[PLAN_WORDS];
	__shared__ uint32_t miss_before[PLAN_WORDS], free_before[PLAN_WORDS], taken_before[PLAN_WORDS];
	__shared__ int repeated_page;
	const struct kvr_plan_item *it = &items[blockIdx.x];
	const uint32_t tid = threadIdx.x;
	const uint32_t k = it->k < KVR_PLAN_MAX_K ? it->k : KVR_PLAN_MAX_K;
	const uint32_t words = (k + 31) / 32;
	if (it->q_to) /* the lane's previous query (kernels.h), once: the sequential path below gets no q_to */
		copy_rows(static_cast<unsigned char *>(it->q_to), it->q_bytes,
			  static_cast<const unsigned char *>(it->q_from), it->q_bytes, 1, it->q_bytes);
	const int32_t *pages = kvr_plan_item_pages(it);
	int32_t *slots = it->slot_page;
	for (uint32_t j = tid; j < k; j += PLAN_THREADS) {
		const int32_t page = pages[j];
		pages_s[j] = page;
		addr_s[j] = page >= 0 && (uint32_t)page < it->addr_end ? it->page_addr[page] : 0;
		slot_of_s[j] = -1;
		if (slots)
			slots_s[j] = slots[j];
	}
	for (uint32_t x = tid; x < PLAN_WORDS; x += PLAN_THREADS)
		keep_w[x] = miss_w[x] = free_w[x] = taken_w[x] = 0;
	if (tid == 0)
		repeated_page = 0;
	__syncthreads();

	if (slots) {
		for (uint32_t w = tid; w < k; w += PLAN_THREADS) {
			const int32_t page = pages_s[w];
			if (page < 0)
				continue;
			for (uint32_t e = 0; e < w; e++)
				if (pages_s[e] == page)
					repeated_page = 1; /* every writer stores 1; read after the barrier */
			for (uint32_t j = 0; j < k; j++)
				if (slots_s[j] == page) {
					slot_of_s[w] = (int16_t)j;
					atomicOr(&keep_w[j / 32], 1u << (j % 32));
					break;
				}
		}
		__syncthreads();
		if (repeated_page) { /* the same for every thread of the block */
			if (tid == 0) {
				struct kvr_plan_item once = *it;
				once.q_to = NULL; /* copied above */
				kvr_plan_item_run_with(&once, pages_s, addr_s, slots_s);
			}
			__syncthreads();
			for (uint32_t j = tid; j < k; j += PLAN_THREADS)
				slots[j] = slots_s[j];
			return;
		}
		for (uint32_t w = tid; w < k; w += PLAN_THREADS) {
			const int32_t page = pages_s[w];
			if (page >= 0 && (uint32_t)page < it->addr_end && slot_of_s[w] < 0)
				atomicOr(&miss_w[w / 32], 1u << (w % 32));
			if (!(keep_w[w / 32] >> (w % 32) & 1u))
				atomicOr(&free_w[w / 32], 1u << (w % 32));
		}
		__syncthreads();
		plan_prefix(miss_w, miss_before, words);
		plan_prefix(free_w, free_before, words);
		__syncthreads();
		const uint32_t misses = words ? miss_before[words - 1] + (uint32_t)__popc(miss_w[words - 1]) : 0u;
		for (uint32_t j = tid; j < k; j += PLAN_THREADS)
			if (free_w[j / 32] >> (j % 32) & 1u) {
				const uint32_t r = plan_rank(free_w, free_before, j);
				free_at_s[r] = (uint16_t)j;
				if (r >= misses)
					slots_s[j] = -1; /* free and not given: emptied */
			}
		__syncthreads();
		for (uint32_t w = tid; w < k; w += PLAN_THREADS) {
			if (!(miss_w[w / 32] >> (w % 32) & 1u))
				continue;
			const uint32_t r = plan_rank(miss_w, miss_before, w);
			const uint32_t j = free_at_s[r];
			slots_s[j] = pages_s[w];
			slot_of_s[w] = (int16_t)j;
			it->scatter[r] = kvr_plan_miss(it, j, addr_s[w]);
		}
		for (uint32_t x = misses + tid; x < k; x += PLAN_THREADS)
			it->scatter[x] = kvr_plan_no_miss();
		if (tid == 0) {
			const uint32_t frees =
				words ? free_before[words - 1] + (uint32_t)__popc(free_w[words - 1]) : 0u;
			it->recall_count[0] = misses;
			it->recall_count[1] = k - frees; /* the slots kept */
		}
		__syncthreads();
		for (uint32_t j = tid; j < k; j += PLAN_THREADS)
			slots[j] = slots_s[j];
	}
	if (!it->segments)
		return; /* a prefetch: the slots and their scatter only */

	for (uint32_t j = tid; j < k; j += PLAN_THREADS) {
		const int32_t page = pages_s[j];
		if (page >= 0 && (uint32_t)page >= it->sel_begin && (uint32_t)page < it->sel_end &&
		    (uint32_t)page < it->addr_end)
			atomicOr(&taken_w[j / 32], 1u << (j % 32));
	}
	__syncthreads();
	plan_prefix(taken_w, taken_before, words);
	__syncthreads();
	const uint32_t taken = words ? taken_before[words - 1] + (uint32_t)__popc(taken_w[words - 1]) : 0u;
	struct kvr_kv_segment *seg = it->segments + it->n_head;
	for (uint32_t j = tid; j < k; j += PLAN_THREADS) {
		if (!(taken_w[j / 32] >> (j % 32) & 1u))
			continue;
		seg[plan_rank(taken_w, taken_before, j)] =
			kvr_plan_segment(it, slots != NULL, slots ? (uint32_t)slot_of_s[j] : 0u, addr_s[j]);
	}
	if (taken != it->k)
		for (uint32_t c = 0; c < it->n_tail; c += PLAN_THREADS) {
			struct kvr_kv_segment t = {};
			const bool mine = c + tid < it->n_tail;
			if (mine)
				t = seg[it->k + c + tid];
			__syncthreads();
			if (mine)
				seg[taken + c + tid] = t;
			__syncthreads();
		}
	if (tid == 0)
		it->attention->n_segments = it->n_head + taken + it->n_tail;
}

extern "C" int KVR_KERNEL_SYMBOL(launch_plan)(const struct kvr_shape *shape,
					      const struct kvr_plan_item *items, uint32_t n,
					      void *stream)
{
	const int rc = check_shape(shape, "plan");
	if (rc || n == 0)
		return rc;
	KVR_LAUNCH(plan_kernel, n, PLAN_THREADS, 0, stream, items);
	return launch_status("plan");
}

/* ------------------------------------------------------------------ offload */

/* KV head h of one page item: its p key rows and p value rows out of the NHD
 * rows into its contiguous HND run, by the block's threads (a quantised run:
 * by thread 0, the host pool's arithmetic; a page completes once per p
 * steps and the run is a few KiB). */
KVR_DEV void offload_head(const struct kvr_shape &shape, const struct kvr_page_item &it, uint32_t h)
{
	if (it.format) {
		struct kvr_quant_geometry q;
		if (threadIdx.x || shape.head_dim > KVR_QUANT_MAX_DIM ||
		    kvr_quant_geometry_init(&q, shape.page_tokens, shape.head_dim, 1, it.format))
			return;
		float scratch[KVR_QUANT_MAX_DIM];
		kvr_quant_run_from_nhd(&q, it.k_rows, it.v_rows, it.row_stride, shape.elem_type, h,
				       shape.page_tokens, static_cast<unsigned char *>(it.hnd_page) + h * q.head_bytes,
				       scratch);
		return;
	}
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

/* One block per (item, KV head). */
static __global__ void KVR_LAUNCH_BOUNDS(COPY_THREADS, 4)
	offload_kernel(struct kvr_shape shape, const struct kvr_page_item *items)
{
	const uint32_t item = blockIdx.x / shape.n_kv_heads, h = blockIdx.x % shape.n_kv_heads;
	offload_head(shape, items[item], h);
}

/* ---------------------------------------------------------------- summarize */

/* Column col (KV head · d + dim) of an item's key summary: the fold is
 * summary.h's, in the cpu backend's order: start from row 0, then rows
 * 1..p-1, so signed zeros and NaN payloads come out identical. */
template <uint32_t ET>
KVR_DEV void summarize_column(const struct kvr_shape &shape, const struct kvr_page_item &it, uint32_t col)
{
	const uint32_t d = shape.head_dim;
	struct kvr_page_geometry g;
	kvr_page_geometry_init(&g, shape.page_tokens, d, shape.n_kv_heads, ET);
	float mn = kvr_load_f32(it.k_rows, ET, col), mx = mn;
	for (uint32_t t = 1; t < g.page_tokens; t++)
		kvr_minmax_step(kvr_load_f32(it.k_rows, ET, (uint64_t)t * it.row_stride + col), &mn,
				&mx);
	const uint32_t h = col / d, c = col - h * d;
	kvr_store_f32(it.summary, ET, kvr_summary_index(&g, h, KVR_SUMMARY_MIN, c), mn);
	kvr_store_f32(it.summary, ET, kvr_summary_index(&g, h, KVR_SUMMARY_MAX, c), mx);
	if (!(shape.flags & KVR_SHAPE_ESTIMATES))
		return;
	/* the estimate rows: sums in token order from row 0, as the cpu's */
	float sk = kvr_load_f32(it.k_rows, ET, col), sv = kvr_load_f32(it.v_rows, ET, col);
	for (uint32_t t = 1; t < g.page_tokens; t++) {
		sk += kvr_load_f32(it.k_rows, ET, (uint64_t)t * it.row_stride + col);
		sv += kvr_load_f32(it.v_rows, ET, (uint64_t)t * it.row_stride + col);
	}
	kvr_store_f32(it.summary, ET, kvr_summary_index(&g, h, KVR_SUMMARY_KEY_MEAN, c),
		      kvr_summary_mean(sk, g.page_tokens));
	kvr_store_f32(it.summary, ET, kvr_summary_index(&g, h, KVR_SUMMARY_VALUE_MEAN, c),
		      kvr_summary_mean(sv, g.page_tokens));
}

/* One thread per (KV head, dim) column of an item's p key rows; consecutive
 * threads read consecutive elements of a row (coalesced). */
static const uint32_t SUMMARY_THREADS = 256;

template <uint32_t ET>
static __global__ void KVR_LAUNCH_BOUNDS(SUMMARY_THREADS, 4)
	summarize_kernel(struct kvr_shape shape, uint32_t col_blocks,
			 const struct kvr_page_item *items)
{
	const uint32_t item = blockIdx.x / col_blocks, cb = blockIdx.x % col_blocks;
	const uint32_t col = cb * SUMMARY_THREADS + threadIdx.x;
	if (col >= shape.n_kv_heads * shape.head_dim)
		return;
	summarize_column<ET>(shape, items[item], col);
}

/* ------------------------------------------------------------------- append */

/* One block per (item, KV head): the head's d keys and d values of the token
 * into its row of the tile; where the token completes the page, then the
 * head's offload and its d summary columns, as offload and summarize do
 * (the same functions, so the same bits). The block reads back the row it
 * wrote (the tile is pinned host memory on cuda): a system fence, then the
 * barrier. An item whose row is past the page writes nothing (the host
 * validates items; the device cannot report). */
template <uint32_t ET>
static __global__ void KVR_LAUNCH_BOUNDS(COPY_THREADS, 4)
	append_kernel(struct kvr_shape shape, const struct kvr_append_item *items)
{
	const uint32_t item = blockIdx.x / shape.n_kv_heads, h = blockIdx.x % shape.n_kv_heads;
	const struct kvr_append_item it = items[item];
	if (it.row >= shape.page_tokens)
		return;
	const uint32_t d = shape.head_dim, row_bytes = d * kvr_elem_bytes(ET);
	const uint64_t col = (uint64_t)h * row_bytes;
	const uint64_t at = (uint64_t)it.row * it.row_stride * kvr_elem_bytes(ET) + col;
	copy_rows(static_cast<unsigned char *>(it.k_tile) + at, row_bytes,
		  static_cast<const unsigned char *>(it.k_row) + col, row_bytes, 1, row_bytes);
	copy_rows(static_cast<unsigned char *>(it.v_tile) + at, row_bytes,
		  static_cast<const unsigned char *>(it.v_row) + col, row_bytes, 1, row_bytes);
	if (!it.hnd_page)
		return; /* the same for the whole block */
	__threadfence_system();
	__syncthreads();
	const struct kvr_page_item page = kvr_append_page_item(&it);
	offload_head(shape, page, h);
	if (page.summary)
		for (uint32_t c = threadIdx.x; c < d; c += COPY_THREADS)
			summarize_column<ET>(shape, page, h * d + c);
}

/* ---------------------------------------------------------------- launchers */

extern "C" int KVR_KERNEL_SYMBOL(launch_scatter)(const struct kvr_shape *shape,
						 const struct kvr_scatter_item *items, uint32_t n,
						 void *stream)
{
	uint32_t grid;
	const int rc = items_grid(shape, n, false, true, "scatter", &grid);
	if (rc || !grid)
		return rc;
	KVR_LAUNCH(scatter_kernel, grid, COPY_THREADS, 0, stream, *shape, items);
	return launch_status("scatter");
}

extern "C" int KVR_KERNEL_SYMBOL(launch_offload)(const struct kvr_shape *shape,
						 const struct kvr_page_item *items, uint32_t n,
						 void *stream)
{
	uint32_t grid;
	const int rc = items_grid(shape, n, true, true, "offload", &grid);
	if (rc || !grid)
		return rc;
	KVR_LAUNCH(offload_kernel, grid, COPY_THREADS, 0, stream, *shape, items);
	return launch_status("offload");
}

extern "C" int KVR_KERNEL_SYMBOL(launch_summarize)(const struct kvr_shape *shape,
						   const struct kvr_page_item *items, uint32_t n,
						   void *stream)
{
	uint32_t grid;
	int rc = items_grid(shape, n, false, true, "summarize", &grid);
	if (rc || !grid)
		return rc;
	const uint64_t cols = (uint64_t)shape->n_kv_heads * shape->head_dim;
	if (cols > 0xffffffffull)
		return kernel_fail(-EINVAL, "summarize: n_kv·d = %llu is too large",
				   (unsigned long long)cols);
	const uint32_t col_blocks = (uint32_t)((cols + SUMMARY_THREADS - 1) / SUMMARY_THREADS);
	if ((rc = grid_size(n, col_blocks, "summarize", &grid)))
		return rc;
	KVR_LAUNCH_TYPED(summarize_kernel, shape->elem_type, grid, SUMMARY_THREADS, 0, stream,
			 *shape, col_blocks, items);
	return launch_status("summarize");
}

extern "C" int KVR_KERNEL_SYMBOL(launch_append)(const struct kvr_shape *shape,
						const struct kvr_append_item *items, uint32_t n,
						void *stream)
{
	uint32_t grid;
	const int rc = items_grid(shape, n, true, true, "append", &grid);
	if (rc || !grid)
		return rc;
	KVR_LAUNCH_TYPED(append_kernel, shape->elem_type, grid, COPY_THREADS, 0, stream, *shape, items);
	return launch_status("append");
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
