/* SPDX-License-Identifier: MIT */
/*
 * cuda_copy.cu — the kernels that move pages and lists, each beside its
 * launcher: scatter (staging HND runs into NHD slot tiles), offload (NHD rows
 * of a full tail page into one HND page), summarize (a page's key min/max),
 * freelist (the device free-page list's compaction round) and plan (the
 * selected pages' attention segments); also the launchers' message getter. Threads and streams as cuda_common.cuh says.
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

/* One block per item. The item's inputs are mapped host memory (the lane's
 * selection, the correction flag, the page table, the slot table): the
 * block brings the k pages, their memory and the slots into shared memory
 * in parallel (one bus round trip each, not k one after another), then one
 * thread writes the segments in order (kvr_plan_item_run_with), so the
 * tail's move up never overtakes itself, and the block writes the slots
 * back. */
static const uint32_t PLAN_THREADS = 128;

static __global__ void KVR_LAUNCH_BOUNDS(PLAN_THREADS, 4)
	plan_kernel(const struct kvr_plan_item *items)
{
	__shared__ int32_t pages_s[KVR_PLAN_MAX_K];
	__shared__ uint64_t addr_s[KVR_PLAN_MAX_K];
	__shared__ int32_t slots_s[KVR_PLAN_MAX_K];
	const struct kvr_plan_item *it = &items[blockIdx.x];
	const uint32_t k = it->k < KVR_PLAN_MAX_K ? it->k : KVR_PLAN_MAX_K;
	const int32_t *pages = kvr_plan_item_pages(it);
	int32_t *slots = it->slot_page;
	for (uint32_t j = threadIdx.x; j < k; j += PLAN_THREADS) {
		const int32_t page = pages[j];
		pages_s[j] = page;
		addr_s[j] = page >= 0 && (uint32_t)page < it->addr_end ? it->page_addr[page] : 0;
		if (slots)
			slots_s[j] = slots[j];
	}
	__syncthreads();
	if (threadIdx.x == 0)
		kvr_plan_item_run_with(it, pages_s, addr_s, slots ? slots_s : NULL);
	__syncthreads();
	if (slots)
		for (uint32_t j = threadIdx.x; j < k; j += PLAN_THREADS)
			slots[j] = slots_s[j];
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

/* One block per (item, KV head): that head's p key rows and p value rows out of
 * the NHD rows into its contiguous HND run. */
static __global__ void KVR_LAUNCH_BOUNDS(COPY_THREADS, 4)
	offload_kernel(struct kvr_shape shape, const struct kvr_page_item *items)
{
	const uint32_t item = blockIdx.x / shape.n_kv_heads, h = blockIdx.x % shape.n_kv_heads;
	const struct kvr_page_item it = items[item];
	if (it.format) {
		/* a quantised run: one thread, the host pool's arithmetic (a page
		 * completes once per p steps; the run is a few KiB) */
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
