/* SPDX-License-Identifier: MIT */
/*
 * pool.c — the host KV page pool's memory and life: chunks mapped on demand,
 * bound to the pool's NUMA node and locked or registered; create (the spill
 * tier's file and frames included) and destroy; the pool's message; stats
 * and the validation the tests run. The pool's state and the other files'
 * shares are in pool_impl.h; the contract is pool.h.
 *
 * Threads: create and destroy by the owner with no other caller; the rest
 * under the pool's lock (pool_impl.h).
 */
#include "pool_impl.h"

/* ------------------------------------------------------------------ errors */

/* The calling thread's latest pool failure: the engine and the controller
 * both call into the pool, and each reads the message of its own failed
 * call, which another thread's failure must not rewrite under it. */
_Thread_local char pool_thread_error[256];

int __attribute__((format(printf, 3, 4))) pool_fail(struct kvr_pool *pool, int err,
						       const char *fmt, ...)
{
	(void)pool;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(pool_thread_error, sizeof(pool_thread_error), fmt, ap);
	va_end(ap);
	return err;
}

void __attribute__((format(printf, 2, 3))) pool_warn(struct kvr_pool *pool, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	kvr_host_vlog(pool->params.log_fn, pool->params.log_user, 1 /* KVR_LOG_WARN */, fmt, ap);
	va_end(ap);
}

const char *kvr_pool_last_error(const struct kvr_pool *pool)
{
	return pool ? pool_thread_error : "";
}

/* ------------------------------------------------------------------ chunks */

/* Map, place and lock chunk c. Called with the lock held. */
int pool_chunk_map(struct kvr_pool *pool, uint32_t c)
{
	const size_t bytes = pool->chunk_bytes;
	unsigned char *raw = kvr_mmap(NULL, bytes + HUGE_PAGE_BYTES, PROT_READ | PROT_WRITE,
				  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (raw == MAP_FAILED)
		return pool_fail(pool, -ENOMEM, "pool: mmap of a %zu-byte chunk failed: %s", bytes,
			         strerror(errno));
	/* Trim to a 2 MiB-aligned window so THP can back it. */
	const uintptr_t start = ((uintptr_t)raw + HUGE_PAGE_BYTES - 1) & ~(uintptr_t)(HUGE_PAGE_BYTES - 1);
	unsigned char *p = (unsigned char *)start;
	if (p > raw)
		munmap(raw, (size_t)(p - raw));
	const size_t tail = (size_t)(raw + bytes + HUGE_PAGE_BYTES - (p + bytes));
	if (tail)
		munmap(p + bytes, tail);

	if (!(pool->params.flags & KVR_POOL_NO_HUGEPAGES) && madvise(p, bytes, MADV_HUGEPAGE))
		pool->hugepage_failures++;

	if (pool->params.numa_node >= 0) {
		unsigned long mask[16] = { 0 };
		const unsigned node = (unsigned)pool->params.numa_node;
		if (node < sizeof(mask) * 8) {
			mask[node / (8 * sizeof(unsigned long))] |= 1ul << (node % (8 * sizeof(unsigned long)));
			if (mbind(p, bytes, MPOL_BIND, mask, sizeof(mask) * 8, 0)) {
				pool->bind_failures++;
				if (!pool->warned_bind) {
					pool->warned_bind = true;
					pool_warn(pool, "pool: cannot bind memory to NUMA node %u (%s); pages "
						        "follow the default policy",
					          node, strerror(errno));
				}
			}
		}
	}

	pool->chunk_state[c] = CHUNK_UNLOCKED;
	if (!(pool->params.flags & KVR_POOL_NO_LOCK)) {
		char reason[160] = "";
		int err = pool->params.register_fn
				  ? pool->params.register_fn(pool->params.register_user, p, bytes)
				  : kvr_gpu_host_register(p, bytes, reason, sizeof(reason));
		if (!err) {
			pool->chunk_state[c] = CHUNK_REGISTERED;
		} else if (!mlock(p, bytes)) {
			pool->chunk_state[c] = CHUNK_MLOCKED;
		} else {
			const int lock_errno = errno;
			pool->lock_failures++;
			if (!pool->warned_lock) {
				pool->warned_lock = true;
				pool_warn(pool, "pool: host memory could not be locked (mlock: %s%s%s); "
					        "continuing unlocked — copies may be slower and pages may "
					        "be swapped. Raise RLIMIT_MEMLOCK or grant CAP_IPC_LOCK.",
				          strerror(lock_errno), err == -ENODEV ? "" : "; ",
				          err == -ENODEV ? "" : reason);
			}
		}
	}
	pool->chunks[c] = p;
	pool->n_chunks++;
	return 0;
}

static void chunk_unmap(struct kvr_pool *pool, uint32_t c)
{
	unsigned char *p = pool->chunks[c];
	if (!p)
		return;
	if (pool->chunk_state[c] == CHUNK_REGISTERED && pool->params.unregister_fn)
		pool->params.unregister_fn(pool->params.register_user, p);
	else if (pool->chunk_state[c] == CHUNK_REGISTERED)
		kvr_gpu_host_unregister(p);
	else if (pool->chunk_state[c] == CHUNK_MLOCKED)
		munlock(p, pool->chunk_bytes);
	munmap(p, pool->chunk_bytes);
	pool->chunks[c] = NULL;
}

/* ------------------------------------------------------------------ create */

/* The spill tier's arrays and file. */
static int spill_init(struct kvr_pool *pool, uint32_t n_frames, char *err, size_t err_bytes)
{
	const uint32_t cap = pool->capacity_pages;
	pool->n_frames = n_frames;
	pool->page_frame = kvr_malloc((size_t)cap * sizeof(uint32_t));
	pool->page_slot = kvr_malloc((size_t)cap * sizeof(uint32_t));
	pool->pins = kvr_calloc(cap, sizeof(uint32_t));
	pool->touched = kvr_calloc(cap, sizeof(*pool->touched));
	pool->frame_page = kvr_malloc((size_t)n_frames * sizeof(uint32_t));
	pool->frame_free = kvr_malloc((size_t)n_frames * sizeof(uint32_t));
	if (!pool->page_frame || !pool->page_slot || !pool->pins || !pool->touched || !pool->frame_page ||
	    !pool->frame_free) {
		if (err)
			snprintf(err, err_bytes, "pool: out of memory for the spill tier's tables");
		return -ENOMEM;
	}
	for (uint32_t i = 0; i < cap; i++)
		pool->page_frame[i] = KVR_POOL_NO_PAGE, pool->page_slot[i] = KVR_SPILL_NO_SLOT;
	for (uint32_t f = 0; f < n_frames; f++)
		pool->frame_page[f] = KVR_POOL_NO_PAGE;
	pool->evict_batch = n_frames / 8 < 1 ? 1 : (n_frames / 8 > 32 ? 32 : n_frames / 8);
	const struct kvr_spill_params sp = { .dir = pool->params.spill_dir,
					     .run_bytes = pool->head_bytes,
					     .runs_per_page = pool->g.n_kv_heads,
					     .queue_depth = pool->params.spill_queue_depth,
					     .flags = pool->params.spill_flags,
					     .log_fn = pool->params.log_fn,
					     .log_user = pool->params.log_user };
	char why[256];
	int e = kvr_spill_create(&sp, &pool->spill, why, sizeof(why));
	if (e && err)
		snprintf(err, err_bytes, "pool: spill tier: %s", why);
	return e;
}

int kvr_pool_create(const struct kvr_pool_params *params, struct kvr_pool **out, char *err,
		    size_t err_bytes)
{
	const struct kvr_page_geometry *g = &params->geometry;
#define REJECT(...)                                      \
	do {                                             \
		if (err)                                 \
			snprintf(err, err_bytes, __VA_ARGS__); \
		return -EINVAL;                          \
	} while (0)
	if (!out)
		REJECT("pool: out is NULL");
	if (!g->page_bytes || !g->head_bytes || g->page_bytes != g->head_bytes * g->n_kv_heads ||
	    !kvr_elem_bytes(g->elem_type))
		REJECT("pool: page geometry not initialised (use kvr_page_geometry_init)");
	if (!params->n_layers || !params->max_sequences)
		REJECT("pool: n_layers and max_sequences must be at least 1");
	if (params->layout > KVR_POOL_LAYOUT_NHD)
		REJECT("pool: unknown layout %u", params->layout);
	if (params->chunk_bytes % HUGE_PAGE_BYTES)
		REJECT("pool: chunk_bytes must be a multiple of 2 MiB (got %llu)",
		       (unsigned long long)params->chunk_bytes);
	if (params->kv_format > KVR_KV_MIXED)
		REJECT("pool: unknown page format %u", params->kv_format);
	if (params->keep_summaries > KVR_POOL_SUMMARIES_ESTIMATES)
		REJECT("pool: keep_summaries must be 0 (none), 1 (key bounds) or 2 (bounds and "
		       "estimates) (got %u)", params->keep_summaries);
	if (params->kv_format != KVR_KV_PLAIN && params->layout != KVR_POOL_LAYOUT_HND)
		REJECT("pool: quantised pages need the HND layout");
	const uint64_t head_bytes =
		kvr_kv_run_bytes(params->kv_format, g->page_tokens, g->head_dim, g->elem_bytes);
	if (!head_bytes)
		REJECT("pool: quantised pages need head_dim a multiple of 16 (got %u)", g->head_dim);
	const uint64_t page_bytes = head_bytes * g->n_kv_heads;
	uint64_t capacity_pages = params->capacity_bytes / page_bytes;
	if (capacity_pages == 0)
		REJECT("pool: capacity of %llu bytes holds no %llu-byte page",
		       (unsigned long long)params->capacity_bytes, (unsigned long long)page_bytes);
	if (capacity_pages >= KVR_POOL_NO_PAGE)
		capacity_pages = KVR_POOL_NO_PAGE - 1;
	/* the spill tier: frames of RAM below the capacity */
	uint64_t n_frames = 0;
	if (params->ram_bytes && params->ram_bytes / page_bytes < capacity_pages) {
		if (params->layout != KVR_POOL_LAYOUT_HND)
			REJECT("pool: the spill tier (ram_bytes) needs the HND layout");
		n_frames = params->ram_bytes / page_bytes;
		if (n_frames < KVR_POOL_MIN_FRAMES)
			REJECT("pool: ram_bytes %llu holds %llu pages of %llu bytes; the spill tier "
			       "needs at least %u",
			       (unsigned long long)params->ram_bytes, (unsigned long long)n_frames,
			       (unsigned long long)page_bytes, KVR_POOL_MIN_FRAMES);
	}
#undef REJECT

	struct kvr_pool *pool = kvr_calloc(1, sizeof(*pool));
	if (!pool) {
		if (err)
			snprintf(err, err_bytes, "pool: out of memory");
		return -ENOMEM;
	}
	pthread_mutex_init(&pool->lock, NULL); /* kvr_pool_destroy takes it down */
	pool->params = *params;
	pool->g = *g;
	pool->fill_format = params->kv_format == KVR_KV_MIXED ? KVR_KV_K8V4 : params->kv_format;
	if (params->kv_format != KVR_KV_PLAIN)
		kvr_quant_geometry_init(&pool->quant, g->page_tokens, g->head_dim, 1, pool->fill_format);
	pool->head_bytes = head_bytes;
	pool->page_bytes = page_bytes;
	pool->summary_bytes = params->keep_summaries
				      ? kvr_summary_bytes(g, params->keep_summaries == KVR_POOL_SUMMARIES_ESTIMATES)
				      : 0;
	pool->capacity_pages = (uint32_t)capacity_pages;

	uint64_t chunk = params->chunk_bytes ? params->chunk_bytes : KVR_POOL_DEFAULT_CHUNK_BYTES;
	/* chunks hold frames: every page without a spill tier */
	const uint64_t frames = n_frames ? n_frames : capacity_pages;
	const uint64_t all = frames * page_bytes;
	const uint64_t all_rounded = (all + HUGE_PAGE_BYTES - 1) & ~(HUGE_PAGE_BYTES - 1);
	if (chunk > all_rounded)
		chunk = all_rounded;
	const uint64_t min_chunk = (page_bytes + HUGE_PAGE_BYTES - 1) & ~(HUGE_PAGE_BYTES - 1);
	if (chunk < min_chunk)
		chunk = min_chunk;
	pool->chunk_bytes = chunk;
	pool->pages_per_chunk = (uint32_t)(chunk / page_bytes);
	pool->max_chunks = (uint32_t)((frames + pool->pages_per_chunk - 1) / pool->pages_per_chunk);

	pool->chunks = kvr_calloc(pool->max_chunks, sizeof(*pool->chunks));
	pool->chunk_state = kvr_calloc(pool->max_chunks, 1);
	pool->refcount = kvr_calloc(capacity_pages, sizeof(*pool->refcount));
	pool->free_stack = kvr_malloc(capacity_pages * sizeof(*pool->free_stack));
	pool->seqs = kvr_calloc(params->max_sequences, sizeof(*pool->seqs));
	if (params->kv_format == KVR_KV_MIXED)
		pool->page_format = kvr_calloc(capacity_pages, 1);
	if (!pool->chunks || !pool->chunk_state || !pool->refcount || !pool->free_stack ||
	    !pool->seqs || (params->kv_format == KVR_KV_MIXED && !pool->page_format)) {
		kvr_pool_destroy(pool);
		if (err)
			snprintf(err, err_bytes, "pool: out of memory for %llu page entries",
				 (unsigned long long)capacity_pages);
		return -ENOMEM;
	}
	if (n_frames) {
		int e = spill_init(pool, (uint32_t)n_frames, err, err_bytes);
		if (e) {
			kvr_pool_destroy(pool);
			return e;
		}
	}
	*out = pool;
	return 0;
}

void pool_summaries_free(struct kvr_pool *pool, unsigned char *summaries)
{
	if (summaries && pool->params.unregister_fn)
		pool->params.unregister_fn(pool->params.register_user, summaries);
	free(summaries);
}

void pool_table_free(struct kvr_pool *pool, struct layer_table *t)
{
	free(t->pages);
	pool_summaries_free(pool, t->summaries);
	memset(t, 0, sizeof(*t));
}

void kvr_pool_destroy(struct kvr_pool *pool)
{
	if (!pool)
		return;
	if (pool->seqs)
		for (uint32_t s = 0; s < pool->params.max_sequences; s++) {
			if (!pool->seqs[s].layers)
				continue;
			for (uint32_t l = 0; l < pool->params.n_layers; l++)
				pool_table_free(pool, &pool->seqs[s].layers[l]);
			free(pool->seqs[s].layers);
		}
	if (pool->chunks)
		for (uint32_t c = 0; c < pool->max_chunks; c++)
			chunk_unmap(pool, c);
	pthread_mutex_destroy(&pool->lock);
	free(pool->chunks);
	free(pool->chunk_state);
	free(pool->refcount);
	free(pool->free_stack);
	free(pool->seqs);
	free(pool->page_format);
	kvr_spill_destroy(pool->spill);
	free(pool->page_frame);
	free(pool->page_slot);
	free(pool->pins);
	free((void *)pool->touched);
	free(pool->frame_page);
	free(pool->frame_free);
	free(pool);
}


/* ------------------------------------------------------------------ stats */

void kvr_pool_get_stats(const struct kvr_pool *pool, struct kvr_pool_stats *out)
{
	struct kvr_pool *mpool = (struct kvr_pool *)pool;
	memset(out, 0, sizeof(*out));
	pthread_mutex_lock(&mpool->lock);
	out->page_bytes = pool->page_bytes;
	out->capacity_pages = pool->capacity_pages;
	out->used_pages = pool->used_pages;
	out->reserved_bytes = (uint64_t)pool->n_chunks * pool->chunk_bytes;
	out->used_bytes = pool->used_pages * pool->page_bytes;
	out->summary_bytes = pool->summary_bytes_held;
	out->n_chunks = pool->n_chunks;
	for (uint32_t c = 0; c < pool->max_chunks; c++) {
		out->locked_chunks += pool->chunk_state[c] == CHUNK_MLOCKED;
		out->registered_chunks += pool->chunk_state[c] == CHUNK_REGISTERED;
	}
	out->lock_failures = pool->lock_failures;
	out->hugepage_failures = pool->hugepage_failures;
	out->numa_node = pool->params.numa_node;
	if (pool->spill) {
		struct kvr_spill_stats ss;
		kvr_spill_get_stats(pool->spill, &ss);
		out->spill_enabled = 1;
		out->frames = pool->n_frames;
		out->resident_pages = pool->resident_pages;
		out->spilled_pages = pool->spilled_pages;
		out->pinned_pages = pool->pinned_pages;
		out->evictions = pool->evictions;
		out->spill_writes = pool->spill_writes;
		out->fetches = pool->fetches;
		out->runs_read_through = pool->runs_read_through;
		out->spill_file_bytes = ss.file_bytes;
		out->spill_errors = pool->spill_errors;
	}
	pthread_mutex_unlock(&mpool->lock);
}

/* Lock held. Frames and pages point at each other, free frames are free,
 * the counters add up, and the file holds exactly the pages' slots. */
static int validate_spill(struct kvr_pool *pool)
{
	uint64_t resident = 0, spilled = 0, with_slot = 0, pinned = 0;
	for (uint32_t id = 0; id < pool->capacity_pages; id++) {
		const uint32_t f = pool->page_frame[id], s = pool->page_slot[id];
		if (!pool_page_live(pool, id)) {
			if (f != KVR_POOL_NO_PAGE || s != KVR_SPILL_NO_SLOT || pool->pins[id])
				return pool_fail(pool, -EFAULT, "pool: free page %u holds frame %u, slot %u or pins %u",
					         id, f, s, pool->pins[id]);
			continue;
		}
		if (f != KVR_POOL_NO_PAGE && (f >= pool->frame_high || pool->frame_page[f] != id))
			return pool_fail(pool, -EFAULT, "pool: page %u claims frame %u, which holds %u", id, f,
				         f < pool->frame_high ? pool->frame_page[f] : KVR_POOL_NO_PAGE);
		resident += f != KVR_POOL_NO_PAGE;
		spilled += f == KVR_POOL_NO_PAGE && s != KVR_SPILL_NO_SLOT;
		with_slot += s != KVR_SPILL_NO_SLOT;
		pinned += pool->pins[id] > 0;
	}
	uint64_t held = 0;
	for (uint32_t f = 0; f < pool->frame_high; f++) {
		const uint32_t id = pool->frame_page[f];
		if (id == KVR_POOL_NO_PAGE)
			continue;
		held++;
		if (id >= pool->capacity_pages || pool->page_frame[id] != f)
			return pool_fail(pool, -EFAULT, "pool: frame %u holds page %u, which is elsewhere", f, id);
	}
	struct kvr_spill_stats ss;
	kvr_spill_get_stats(pool->spill, &ss);
	if (held != resident || held + pool->n_frame_free != pool->frame_high ||
	    resident != pool->resident_pages || spilled != pool->spilled_pages ||
	    pinned != pool->pinned_pages || with_slot != ss.slots_used)
		return pool_fail(pool, -EFAULT,
			         "pool: spill tier: %llu frames held, %u free of %u; counted %llu resident, "
			         "%llu spilled, %llu pinned, %llu slots (kept: %llu, %llu, %llu; file: %llu)",
			         (unsigned long long)held, pool->n_frame_free, pool->frame_high,
			         (unsigned long long)resident, (unsigned long long)spilled,
			         (unsigned long long)pinned, (unsigned long long)with_slot,
			         (unsigned long long)pool->resident_pages, (unsigned long long)pool->spilled_pages,
			         (unsigned long long)pool->pinned_pages, (unsigned long long)ss.slots_used);
	return 0;
}

int kvr_pool_validate(struct kvr_pool *pool, const uint32_t *external_refs)
{
	int err = 0;
	pthread_mutex_lock(&pool->lock);
	uint32_t *expect = kvr_calloc(pool->capacity_pages, sizeof(*expect));
	unsigned char *on_stack = kvr_calloc(pool->capacity_pages, 1);
	if (!expect || !on_stack) {
		err = pool_fail(pool, -ENOMEM, "pool: validate: out of memory");
		goto out;
	}
	for (uint32_t s = 0; s < pool->params.max_sequences; s++) {
		if (!pool->seqs[s].open)
			continue;
		for (uint32_t l = 0; l < pool->params.n_layers; l++) {
			const struct layer_table *t = &pool->seqs[s].layers[l];
			const uint64_t p = pool->g.page_tokens;
			if (t->n_pages < (t->n_tokens + p - 1) / p) {
				err = pool_fail(pool, -EFAULT, "pool: seq %u layer %u has %llu tokens in %u pages",
					        s, l, (unsigned long long)t->n_tokens, t->n_pages);
				goto out;
			}
			for (uint32_t i = 0; i < t->n_pages; i++) {
				if (t->pages[i] >= pool->high_water) {
					err = pool_fail(pool, -EFAULT, "pool: seq %u layer %u page %u maps to "
								       "never-allocated id %u",
						        s, l, i, t->pages[i]);
					goto out;
				}
				expect[t->pages[i]]++;
			}
		}
	}
	uint64_t live = 0;
	for (uint32_t id = 0; id < pool->capacity_pages; id++) {
		const uint32_t want = expect[id] + (external_refs ? external_refs[id] : 0);
		if (pool->refcount[id] != want) {
			err = pool_fail(pool, -EFAULT, "pool: page %u has refcount %u but %u references", id,
				        pool->refcount[id], want);
			goto out;
		}
		live += want > 0;
	}
	for (uint32_t i = 0; i < pool->n_free; i++) {
		const uint32_t id = pool->free_stack[i];
		if (id >= pool->high_water || pool->refcount[id] || on_stack[id]) {
			err = pool_fail(pool, -EFAULT, "pool: free stack entry %u (page %u) is %s", i, id,
				        on_stack[id] ? "a duplicate" : "not a free page");
			goto out;
		}
		on_stack[id] = 1;
	}
	if (live != pool->used_pages || live + pool->n_free != pool->high_water) {
		err = pool_fail(pool, -EFAULT,
			        "pool: %llu live + %u free pages != high water %u (used_pages %llu)",
			        (unsigned long long)live, pool->n_free, pool->high_water,
			        (unsigned long long)pool->used_pages);
		goto out;
	}
	if (pool->spill)
		err = validate_spill(pool);
out:
	free(expect);
	free(on_stack);
	pthread_mutex_unlock(&pool->lock);
	return err;
}
