/* SPDX-License-Identifier: MIT */
/*
 * pool.c — the host KV page pool (see pool.h for the contract).
 *
 * Memory: chunks of chunk_bytes, 2 MiB aligned so transparent huge pages can
 * back them, mapped on demand when the allocator's high-water mark enters a new
 * chunk. Each chunk is bound to the pool's NUMA node before first touch, then
 * locked. Pages never straddle chunks; page id -> address is one division.
 *
 * Allocator: ids below `high_water` have been handed out before; freed ids go
 * on a LIFO stack (reused first, so a recently freed page is likely still warm
 * and mapped); otherwise the high-water mark advances. Both O(1).
 *
 * The spill tier (ram_bytes > 0): page ids then have no memory of their own.
 * RAM is `n_frames` frames, carved from chunks as pages are without a spill
 * tier (frame -> address is one division); page_frame[id] and
 * frame_page[f] tie a resident page to its frame, page_slot[id] is its copy
 * in the spill file (kept while the page is unchanged: a clean page leaves
 * RAM without a write). A page gets a frame when it is written or pinned;
 * when none is free, evict_locked runs CLOCK over the frames — skipping
 * pinned pages, and touched ones once, clearing their bit — and writes the
 * victims that are dirty in one batch. The I/O runs under the pool's lock:
 * it is what makes an eviction and a reader's pin exclusive; readers copy
 * outside it, holding pins.
 *
 * Threads: `lock` guards the allocator, refcounts, sequence tables and stats.
 * Page memory is read and written without it by whoever holds the page (see
 * pool.h). Lock order: the pool's lock is a leaf (nothing is called with it
 * held that takes another lock, except the log callback on a lock warning).
 */
#include <errno.h>
#include <numaif.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "../gpu/gpu.h"
#include "../gpu/fault.h"
#include "../layouts/convert.h"
#include "../layouts/copy.h"
#include "../layouts/kvquant.h"
#include "../layouts/summary.h"
#include "../layouts/transpose.h"
#include "pool.h"
#include "spill.h"

#define HUGE_PAGE_BYTES (2ull << 20)

enum chunk_lock { CHUNK_UNLOCKED = 0, CHUNK_MLOCKED = 1, CHUNK_REGISTERED = 2 };

struct layer_table {
	uint32_t *pages;          /* logical page -> page id */
	unsigned char *summaries; /* cap x summary_bytes, NULL when not kept */
	uint32_t n_pages;         /* logical pages reserved */
	uint32_t cap;             /* entries allocated in pages/summaries */
	uint64_t n_tokens;        /* tokens ingested (offloaded + tail) */
};

struct seq_entry {
	bool open;
	struct layer_table *layers; /* n_layers */
};

struct kvr_pool {
	struct kvr_pool_params params;
	struct kvr_page_geometry g; /* of the rows written (g.head_bytes is a plain run's) */
	struct kvr_quant_geometry quant; /* quantised pages: the runs offload writes; else zero */
	uint32_t fill_format;       /* the format offload writes (K8V4 for a mixed pool) */
	uint8_t *page_format;       /* mixed pools: [capacity_pages] each page's format, written
	                               by offload and demotion (the page's owner), read by
	                               attention and recall after the owner publishes the page */
	uint64_t head_bytes;        /* one KV head's stored run, in the page format */
	uint64_t page_bytes;        /* n_kv_heads · head_bytes */
	uint64_t chunk_bytes;
	uint64_t summary_bytes; /* one page's summary, all KV heads */
	uint32_t pages_per_chunk;
	uint32_t capacity_pages;
	uint32_t max_chunks;

	pthread_mutex_t lock;
	unsigned char **chunks;     /* max_chunks; NULL until mapped */
	unsigned char *chunk_state; /* enum chunk_lock per chunk */
	uint32_t n_chunks;
	uint32_t *refcount;         /* capacity_pages; 0 = free */
	uint32_t *free_stack;       /* capacity_pages */
	uint32_t n_free;
	uint32_t high_water;
	uint64_t used_pages;
	uint64_t summary_bytes_held;
	struct seq_entry *seqs;     /* max_sequences */

	/* the spill tier; spill == NULL: a page id is its own frame */
	struct kvr_spill *spill;
	uint32_t n_frames;         /* pages RAM may hold */
	uint32_t *page_frame;      /* [capacity_pages] frame, or KVR_POOL_NO_PAGE */
	uint32_t *page_slot;       /* [capacity_pages] clean copy in the file, or KVR_SPILL_NO_SLOT */
	uint32_t *pins;            /* [capacity_pages] */
	_Atomic uint8_t *touched;  /* [capacity_pages] CLOCK reference bits: set by
	                              kvr_pool_touch (any thread, relaxed), cleared by
	                              evict_locked under the lock (relaxed): a bit
	                              lost to the race costs one page an early
	                              eviction, never correctness */
	uint32_t *frame_page;      /* [n_frames] page, or KVR_POOL_NO_PAGE */
	uint32_t *frame_free;      /* [n_frames] stack of free frames */
	uint32_t n_frame_free;
	uint32_t frame_high;       /* frames [0, frame_high) have been handed out */
	uint32_t clock_hand;
	uint32_t evict_batch;      /* pages evicted at a time */
	uint64_t resident_pages, spilled_pages, pinned_pages;
	uint64_t evictions, spill_writes, fetches, runs_read_through, spill_errors;

	uint32_t lock_failures;
	uint32_t hugepage_failures;
	uint32_t bind_failures;
	bool warned_lock;
	bool warned_bind;

};

/* ------------------------------------------------------------------ errors */

/* The calling thread's latest pool failure: the engine and the controller
 * both call into the pool, and each reads the message of its own failed
 * call, which another thread's failure must not rewrite under it. */
static _Thread_local char thread_pool_error[256];

static int __attribute__((format(printf, 3, 4))) fail(struct kvr_pool *pool, int err,
						       const char *fmt, ...)
{
	(void)pool;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(thread_pool_error, sizeof(thread_pool_error), fmt, ap);
	va_end(ap);
	return err;
}

static void __attribute__((format(printf, 2, 3))) warn(struct kvr_pool *pool, const char *fmt, ...)
{
	if (!pool->params.log_fn)
		return;
	char line[256];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	pool->params.log_fn(pool->params.log_user, 1 /* KVR_LOG_WARN */, line);
}

const char *kvr_pool_last_error(const struct kvr_pool *pool)
{
	return pool ? thread_pool_error : "";
}

/* ------------------------------------------------------------------ chunks */

/* Map, place and lock chunk c. Called with the lock held. */
static int chunk_map(struct kvr_pool *pool, uint32_t c)
{
	const size_t bytes = pool->chunk_bytes;
	unsigned char *raw = kvr_mmap(NULL, bytes + HUGE_PAGE_BYTES, PROT_READ | PROT_WRITE,
				  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (raw == MAP_FAILED)
		return fail(pool, -ENOMEM, "pool: mmap of a %zu-byte chunk failed: %s", bytes,
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
					warn(pool, "pool: cannot bind memory to NUMA node %u (%s); pages "
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
				warn(pool, "pool: host memory could not be locked (mlock: %s%s%s); "
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
	pool->summary_bytes = params->keep_summaries ? kvr_summary_bytes(g) : 0;
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

static void summaries_free(struct kvr_pool *pool, unsigned char *summaries)
{
	if (summaries && pool->params.unregister_fn)
		pool->params.unregister_fn(pool->params.register_user, summaries);
	free(summaries);
}

static void table_free(struct kvr_pool *pool, struct layer_table *t)
{
	free(t->pages);
	summaries_free(pool, t->summaries);
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
				table_free(pool, &pool->seqs[s].layers[l]);
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

/* ------------------------------------------------------------------ pages */

static inline unsigned char *frame_address(const struct kvr_pool *pool, uint32_t f)
{
	unsigned char *chunk = pool->chunks[f / pool->pages_per_chunk];
	return chunk ? chunk + (uint64_t)(f % pool->pages_per_chunk) * pool->page_bytes : NULL;
}

/* A page's memory: its frame's (NULL when it has none). Without a spill tier
 * a page id is its frame. */
static inline unsigned char *page_address(const struct kvr_pool *pool, uint32_t id)
{
	if (pool->spill) {
		const uint32_t f = pool->page_frame[id];
		return f == KVR_POOL_NO_PAGE ? NULL : frame_address(pool, f);
	}
	return frame_address(pool, id);
}

/* ---- the spill tier: frames, pins, eviction. Lock held throughout. ---- */

static void pin_locked(struct kvr_pool *pool, uint32_t id)
{
	if (pool->pins[id]++ == 0)
		pool->pinned_pages++;
	/* in use: once unpinned it is evicted last (sink and window pages are
	 * pinned by every step's attention and so stay in RAM) */
	atomic_store_explicit(&pool->touched[id], 1, memory_order_relaxed);
}

static void unpin_locked(struct kvr_pool *pool, uint32_t id)
{
	if (!pool->pins[id]) /* freed while pinned (the pins went with it) */
		return;
	if (--pool->pins[id] == 0)
		pool->pinned_pages--;
}

static void frame_release(struct kvr_pool *pool, uint32_t id)
{
	const uint32_t f = pool->page_frame[id];
	pool->frame_page[f] = KVR_POOL_NO_PAGE;
	pool->frame_free[pool->n_frame_free++] = f;
	pool->page_frame[id] = KVR_POOL_NO_PAGE;
	pool->resident_pages--;
}

/* Move up to `want` unpinned resident pages out of RAM: CLOCK over the
 * frames (a touched page is passed over once, its bit cleared; `force`
 * ignores the bits); the dirty ones are written in one batch, the clean ones
 * (a slot still holding their bytes) just give up their frame. All or
 * nothing: a failed write leaves every victim resident. */
static int evict_locked(struct kvr_pool *pool, uint32_t want, bool force, uint32_t *evicted)
{
	enum { MAX_BATCH = 64 };
	uint32_t victims[MAX_BATCH], dirty[MAX_BATCH], slots[MAX_BATCH];
	const void *data[MAX_BATCH];
	uint32_t n = 0, n_dirty = 0;
	if (want > MAX_BATCH)
		want = MAX_BATCH;
	*evicted = 0;
	for (uint64_t step = 0; step < 2ull * pool->frame_high && n < want; step++) {
		const uint32_t f = pool->clock_hand;
		pool->clock_hand = f + 1 < pool->frame_high ? f + 1 : 0;
		const uint32_t id = pool->frame_page[f];
		if (id == KVR_POOL_NO_PAGE || pool->pins[id])
			continue;
		if (!force && atomic_load_explicit(&pool->touched[id], memory_order_relaxed)) {
			atomic_store_explicit(&pool->touched[id], 0, memory_order_relaxed);
			continue;
		}
		victims[n++] = id;
		pin_locked(pool, id); /* chosen: the sweep's second pass must skip it */
		if (pool->page_slot[id] == KVR_SPILL_NO_SLOT) {
			data[n_dirty] = frame_address(pool, f);
			dirty[n_dirty++] = id;
		}
	}
	for (uint32_t i = 0; i < n; i++)
		unpin_locked(pool, victims[i]);
	if (!n)
		return fail(pool, -ENOMEM,
			    "pool: RAM budget of %u pages: every resident page is pinned (%llu pinned)",
			    pool->n_frames, (unsigned long long)pool->pinned_pages);
	if (n_dirty) {
		int err = kvr_spill_write_pages(pool->spill, data, n_dirty, slots);
		if (err) {
			char why[200];
			kvr_spill_copy_error(pool->spill, why, sizeof(why));
			pool->spill_errors++;
			return fail(pool, err, "pool: cannot spill %u pages: %s", n_dirty, why);
		}
		for (uint32_t i = 0; i < n_dirty; i++)
			pool->page_slot[dirty[i]] = slots[i];
		pool->spill_writes += n_dirty;
	}
	for (uint32_t i = 0; i < n; i++)
		frame_release(pool, victims[i]);
	pool->spilled_pages += n;
	pool->evictions += n;
	*evicted = n;
	return 0;
}

/* A frame for page id (which has none), evicting when RAM is full. */
static int frame_take(struct kvr_pool *pool, uint32_t id)
{
	uint32_t f;
	if (pool->n_frame_free) {
		f = pool->frame_free[--pool->n_frame_free];
	} else if (pool->frame_high < pool->n_frames) {
		f = pool->frame_high;
		const uint32_t c = f / pool->pages_per_chunk;
		if (!pool->chunks[c]) {
			int err = chunk_map(pool, c);
			if (err)
				return err;
		}
		pool->frame_high++;
	} else {
		uint32_t evicted;
		int err = evict_locked(pool, pool->evict_batch, false, &evicted);
		if (err)
			return err;
		f = pool->frame_free[--pool->n_frame_free];
	}
	pool->frame_page[f] = id;
	pool->page_frame[id] = f;
	pool->resident_pages++;
	if (pool->page_slot[id] != KVR_SPILL_NO_SLOT)
		pool->spilled_pages--; /* it was only in the file */
	return 0;
}

/* The page's copy in the file is stale from now on (it is being rewritten). */
static void slot_drop(struct kvr_pool *pool, uint32_t id)
{
	if (pool->page_slot[id] == KVR_SPILL_NO_SLOT)
		return;
	kvr_spill_free(pool->spill, pool->page_slot[id]);
	pool->page_slot[id] = KVR_SPILL_NO_SLOT;
}

/* Lock held. */
static int page_alloc_locked(struct kvr_pool *pool, uint32_t *id_out)
{
	uint32_t id;
	if (pool->n_free) {
		id = pool->free_stack[--pool->n_free];
	} else {
		if (pool->high_water >= pool->capacity_pages)
			return fail(pool, -ENOMEM,
				    "pool: capacity of %u pages (%llu bytes) exhausted",
				    pool->capacity_pages,
				    (unsigned long long)pool->capacity_pages * pool->page_bytes);
		id = pool->high_water;
		const uint32_t c = id / pool->pages_per_chunk;
		if (!pool->spill && !pool->chunks[c]) { /* with a spill tier, frames come at write */
			int err = chunk_map(pool, c);
			if (err)
				return err;
		}
		pool->high_water++;
	}
	if (pool->spill)
		atomic_store_explicit(&pool->touched[id], 1, memory_order_relaxed);
	pool->refcount[id] = 1;
	pool->used_pages++;
	*id_out = id;
	return 0;
}

static bool page_live(const struct kvr_pool *pool, uint32_t id)
{
	return id < pool->high_water && pool->refcount[id] > 0;
}

/* Lock held; id must be live. */
static void page_unref_locked(struct kvr_pool *pool, uint32_t id)
{
	if (--pool->refcount[id] == 0) {
		if (pool->spill) {
			if (pool->page_frame[id] != KVR_POOL_NO_PAGE)
				frame_release(pool, id);
			else if (pool->page_slot[id] != KVR_SPILL_NO_SLOT)
				pool->spilled_pages--;
			slot_drop(pool, id);
			if (pool->pins[id]) { /* freed while pinned: the caller broke the contract */
				pool->pins[id] = 0;
				pool->pinned_pages--;
			}
		}
		pool->free_stack[pool->n_free++] = id;
		pool->used_pages--;
	}
}

int kvr_pool_page_alloc(struct kvr_pool *pool, uint32_t *page_id)
{
	if (!page_id)
		return -EINVAL;
	pthread_mutex_lock(&pool->lock);
	int err = page_alloc_locked(pool, page_id);
	pthread_mutex_unlock(&pool->lock);
	return err;
}

int kvr_pool_page_ref(struct kvr_pool *pool, uint32_t page_id)
{
	int err = 0;
	pthread_mutex_lock(&pool->lock);
	if (!page_live(pool, page_id))
		err = fail(pool, -EINVAL, "pool: page %u is not allocated", page_id);
	else if (pool->refcount[page_id] == UINT32_MAX)
		err = fail(pool, -EOVERFLOW, "pool: page %u has too many references", page_id);
	else
		pool->refcount[page_id]++;
	pthread_mutex_unlock(&pool->lock);
	return err;
}

int kvr_pool_page_unref(struct kvr_pool *pool, uint32_t page_id)
{
	int err = 0;
	pthread_mutex_lock(&pool->lock);
	if (!page_live(pool, page_id))
		err = fail(pool, -EINVAL, "pool: page %u is not allocated (double free?)", page_id);
	else
		page_unref_locked(pool, page_id);
	pthread_mutex_unlock(&pool->lock);
	return err;
}

int kvr_pool_page_refcount(const struct kvr_pool *pool, uint32_t page_id)
{
	if (page_id >= pool->capacity_pages)
		return -EINVAL;
	pthread_mutex_lock((pthread_mutex_t *)&pool->lock);
	int n = (int)pool->refcount[page_id];
	pthread_mutex_unlock((pthread_mutex_t *)&pool->lock);
	return n;
}

void *kvr_pool_page_data(const struct kvr_pool *pool, uint32_t page_id)
{
	if (page_id >= pool->capacity_pages)
		return NULL;
	return page_address(pool, page_id);
}

/* ------------------------------------------------------------------ tables */

/* Lock held. Resolve (seq, layer) to its table or fail with a message. */
static int table_get(struct kvr_pool *pool, uint32_t seq, uint32_t layer, struct layer_table **out)
{
	if (seq >= pool->params.max_sequences)
		return fail(pool, -EINVAL, "pool: sequence id %u out of range (max_sequences %u)", seq,
			    pool->params.max_sequences);
	if (!pool->seqs[seq].open)
		return fail(pool, -EINVAL, "pool: sequence %u is not open", seq);
	if (layer >= pool->params.n_layers)
		return fail(pool, -EINVAL, "pool: layer %u out of range (n_layers %u)", layer,
			    pool->params.n_layers);
	*out = &pool->seqs[seq].layers[layer];
	return 0;
}

int kvr_pool_seq_open(struct kvr_pool *pool, uint32_t seq)
{
	int err = 0;
	pthread_mutex_lock(&pool->lock);
	if (seq >= pool->params.max_sequences) {
		err = fail(pool, -EINVAL, "pool: sequence id %u out of range (max_sequences %u)", seq,
			   pool->params.max_sequences);
	} else if (pool->seqs[seq].open) {
		err = fail(pool, -EEXIST, "pool: sequence %u is already open", seq);
	} else {
		struct layer_table *layers = kvr_calloc(pool->params.n_layers, sizeof(*layers));
		if (!layers) {
			err = fail(pool, -ENOMEM, "pool: out of memory for sequence %u's tables", seq);
		} else {
			pool->seqs[seq].layers = layers;
			pool->seqs[seq].open = true;
		}
	}
	pthread_mutex_unlock(&pool->lock);
	return err;
}

/* Lock held. Drop every page beyond the first `keep` of a table. */
static void table_shrink(struct kvr_pool *pool, struct layer_table *t, uint32_t keep)
{
	while (t->n_pages > keep)
		page_unref_locked(pool, t->pages[--t->n_pages]);
}

int kvr_pool_seq_close(struct kvr_pool *pool, uint32_t seq)
{
	int err = 0;
	pthread_mutex_lock(&pool->lock);
	if (seq >= pool->params.max_sequences || !pool->seqs[seq].open) {
		err = fail(pool, -EINVAL, "pool: sequence %u is not open", seq);
	} else {
		for (uint32_t l = 0; l < pool->params.n_layers; l++) {
			struct layer_table *t = &pool->seqs[seq].layers[l];
			table_shrink(pool, t, 0);
			pool->summary_bytes_held -= (uint64_t)t->cap * pool->summary_bytes;
			table_free(pool, t);
		}
		free(pool->seqs[seq].layers);
		pool->seqs[seq].layers = NULL;
		pool->seqs[seq].open = false;
	}
	pthread_mutex_unlock(&pool->lock);
	return err;
}

static int table_grow(struct kvr_pool *pool, struct layer_table *t, uint64_t need);

int kvr_pool_seq_fork(struct kvr_pool *pool, uint32_t src, uint32_t dst)
{
	int err = kvr_pool_seq_open(pool, dst);
	if (err)
		return err;
	pthread_mutex_lock(&pool->lock);
	if (src >= pool->params.max_sequences || !pool->seqs[src].open || src == dst) {
		err = fail(pool, -EINVAL, "pool: fork source %u is not an open sequence", src);
	} else {
		for (uint32_t l = 0; l < pool->params.n_layers && !err; l++) {
			const struct layer_table *from = &pool->seqs[src].layers[l];
			struct layer_table *to = &pool->seqs[dst].layers[l];
			err = table_grow(pool, to, from->n_pages);
			if (err)
				break;
			for (uint32_t i = 0; i < from->n_pages; i++) {
				if (pool->refcount[from->pages[i]] == UINT32_MAX) {
					err = fail(pool, -EOVERFLOW, "pool: page %u has too many references",
						   from->pages[i]);
					break;
				}
				pool->refcount[from->pages[i]]++;
				to->pages[to->n_pages++] = from->pages[i];
			}
			if (!err && from->summaries && from->n_pages) /* an empty table has no array */
				memcpy(to->summaries, from->summaries,
				       (uint64_t)from->n_pages * pool->summary_bytes);
			to->n_tokens = from->n_tokens;
		}
	}
	if (err) {
		/* Drop the references taken so far; keep the message of the failure. */
		char message[sizeof(thread_pool_error)];
		memcpy(message, thread_pool_error, sizeof(message));
		pthread_mutex_unlock(&pool->lock);
		kvr_pool_seq_close(pool, dst);
		pthread_mutex_lock(&pool->lock);
		memcpy(thread_pool_error, message, sizeof(message));
	}
	pthread_mutex_unlock(&pool->lock);
	return err;
}

/* Lock held. Make room for `need` entries. */
static int table_grow(struct kvr_pool *pool, struct layer_table *t, uint64_t need)
{
	if (need <= t->cap)
		return 0;
	if (need > pool->capacity_pages)
		return fail(pool, -ENOMEM,
			    "pool: capacity of %u pages exhausted (a table needs %llu)",
			    pool->capacity_pages, (unsigned long long)need);
	uint64_t cap = t->cap ? t->cap : 16;
	while (cap < need)
		cap *= 2;
	uint32_t *pages = kvr_realloc(t->pages, cap * sizeof(*pages));
	if (!pages)
		return fail(pool, -ENOMEM, "pool: out of memory for a page table");
	t->pages = pages;
	if (pool->summary_bytes && !pool->params.register_fn) {
		unsigned char *s = kvr_realloc(t->summaries, cap * pool->summary_bytes);
		if (!s)
			return fail(pool, -ENOMEM, "pool: out of memory for page summaries");
		memset(s + t->cap * pool->summary_bytes, 0, (cap - t->cap) * pool->summary_bytes);
		t->summaries = s;
		pool->summary_bytes_held += (cap - t->cap) * pool->summary_bytes;
	} else if (pool->summary_bytes) {
		/* registered memory cannot be realloc()ed: a new array, registered,
		 * then the old one released (no kernel reads it: the scheduler's
		 * readers finish before the engine appends) */
		const size_t bytes = ((size_t)cap * pool->summary_bytes + 4095) & ~(size_t)4095;
		unsigned char *s = NULL;
		if (posix_memalign((void **)&s, 4096, bytes))
			return fail(pool, -ENOMEM, "pool: out of memory for page summaries");
		memset(s, 0, bytes);
		int err = pool->params.register_fn(pool->params.register_user, s, bytes);
		if (err) {
			free(s);
			return fail(pool, err, "pool: cannot register %zu bytes of page summaries "
					       "with the device (%d)",
				    bytes, err);
		}
		if (t->summaries)
			memcpy(s, t->summaries, (size_t)t->cap * pool->summary_bytes);
		summaries_free(pool, t->summaries);
		t->summaries = s;
		pool->summary_bytes_held += (cap - t->cap) * pool->summary_bytes;
	}
	t->cap = (uint32_t)cap;
	return 0;
}

/* Lock held. All-or-nothing append. */
static int reserve_locked(struct kvr_pool *pool, struct layer_table *t, uint32_t n_pages)
{
	int err = table_grow(pool, t, (uint64_t)t->n_pages + n_pages);
	if (err)
		return err;
	const uint32_t before = t->n_pages;
	for (uint32_t i = 0; i < n_pages; i++) {
		uint32_t id = 0; /* set by page_alloc_locked on success */
		err = page_alloc_locked(pool, &id);
		if (err) {
			table_shrink(pool, t, before);
			return err;
		}
		t->pages[t->n_pages++] = id;
	}
	return 0;
}

int kvr_pool_reserve(struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint32_t n_pages)
{
	struct layer_table *t = NULL; /* set by table_get on success */
	pthread_mutex_lock(&pool->lock);
	int err = table_get(pool, seq, layer, &t);
	if (!err)
		err = reserve_locked(pool, t, n_pages);
	pthread_mutex_unlock(&pool->lock);
	return err;
}

int kvr_pool_truncate(struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint64_t n_tokens)
{
	struct layer_table *t = NULL; /* set by table_get on success */
	pthread_mutex_lock(&pool->lock);
	int err = table_get(pool, seq, layer, &t);
	if (!err && n_tokens > t->n_tokens)
		err = fail(pool, -EINVAL,
			   "pool: cannot truncate sequence %u layer %u to %llu tokens: it has %llu",
			   seq, layer, (unsigned long long)n_tokens, (unsigned long long)t->n_tokens);
	if (!err) {
		const uint64_t p = pool->g.page_tokens;
		table_shrink(pool, t, (uint32_t)((n_tokens + p - 1) / p));
		t->n_tokens = n_tokens;
	}
	pthread_mutex_unlock(&pool->lock);
	return err;
}

int kvr_pool_n_pages(const struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint32_t *n_pages)
{
	struct kvr_pool *mpool = (struct kvr_pool *)pool; /* lock and message only */
	struct layer_table *t = NULL; /* set by table_get on success */
	pthread_mutex_lock(&mpool->lock);
	int err = table_get(mpool, seq, layer, &t);
	if (!err)
		*n_pages = t->n_pages;
	pthread_mutex_unlock(&mpool->lock);
	return err;
}

int kvr_pool_n_tokens(const struct kvr_pool *pool, uint32_t seq, uint32_t layer,
		      uint64_t *n_tokens)
{
	struct kvr_pool *mpool = (struct kvr_pool *)pool;
	struct layer_table *t = NULL; /* set by table_get on success */
	pthread_mutex_lock(&mpool->lock);
	int err = table_get(mpool, seq, layer, &t);
	if (!err)
		*n_tokens = t->n_tokens;
	pthread_mutex_unlock(&mpool->lock);
	return err;
}

int kvr_pool_lookup(const struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint32_t logical,
		    uint32_t *page_id)
{
	struct kvr_pool *mpool = (struct kvr_pool *)pool;
	struct layer_table *t = NULL; /* set by table_get on success */
	pthread_mutex_lock(&mpool->lock);
	int err = table_get(mpool, seq, layer, &t);
	if (!err && logical >= t->n_pages)
		err = fail(mpool, -EINVAL,
			   "pool: logical page %u of sequence %u layer %u is not reserved (%u pages)",
			   logical, seq, layer, t->n_pages);
	if (!err)
		*page_id = t->pages[logical];
	pthread_mutex_unlock(&mpool->lock);
	return err;
}

const void *kvr_pool_summary(const struct kvr_pool *pool, uint32_t seq, uint32_t layer,
			     uint32_t logical)
{
	struct kvr_pool *mpool = (struct kvr_pool *)pool;
	struct layer_table *t = NULL; /* set by table_get on success */
	const void *s = NULL;
	pthread_mutex_lock(&mpool->lock);
	if (!table_get(mpool, seq, layer, &t) && logical < t->n_pages && t->summaries)
		s = t->summaries + (uint64_t)logical * pool->summary_bytes;
	pthread_mutex_unlock(&mpool->lock);
	return s;
}

/* ------------------------------------------------------------------ data */

/* Convert p NHD rows into a page of the pool's layout and summarise the keys.
 * No lock: the caller owns the page. */
static void page_fill(struct kvr_pool *pool, uint32_t id, unsigned char *page, unsigned char *summary,
		      const void *k_rows, const void *v_rows, uint64_t row_stride)
{
	const struct kvr_page_geometry *g = &pool->g;
	if (pool->page_format)
		pool->page_format[id] = (uint8_t)pool->fill_format;
	if (pool->params.kv_format != KVR_KV_PLAIN) {
		/* quantise at offload, one KV head's run at a time; the summaries
		 * below still come from the unquantised keys */
		float scratch[256];
		for (uint32_t h = 0; h < g->n_kv_heads; h++)
			kvr_quant_run_from_nhd(&pool->quant, k_rows, v_rows, (uint32_t)row_stride,
					       g->elem_type, h, g->page_tokens,
					       page + (uint64_t)h * pool->head_bytes, scratch);
	} else if (pool->params.layout == KVR_POOL_LAYOUT_HND)
		kvr_nhd_rows_to_hnd_page(g, k_rows, v_rows, row_stride, page);
	else
		kvr_nhd_rows_to_nhd_page(g, k_rows, v_rows, row_stride, page);
	if (!summary)
		return;
	const uint64_t eb = g->elem_bytes;
	for (uint32_t h = 0; h < g->n_kv_heads; h++)
		kvr_summarize_keys(g, (const unsigned char *)k_rows + (uint64_t)h * g->head_dim * eb,
				   row_stride, summary + kvr_summary_index(g, h, 0, 0) * eb,
				   summary + kvr_summary_index(g, h, 1, 0) * eb);
}

/* Lock held. The page a write to (t, logical) may fill: copy-on-write when it
 * is shared with a fork. Outputs the address and the summary slot. */
static int page_for_write(struct kvr_pool *pool, struct layer_table *t, uint32_t logical,
			  unsigned char **page, unsigned char **summary, uint32_t *id_out, bool filling)
{
	uint32_t id = t->pages[logical];
	if (pool->refcount[id] > 1) {
		uint32_t fresh = 0; /* set by page_alloc_locked on success */
		int err = page_alloc_locked(pool, &fresh);
		/* with a spill tier the copy needs a frame too, before the table
		 * changes: a failure leaves the shared page where it was */
		if (!err && pool->spill && filling && (err = frame_take(pool, fresh)))
			page_unref_locked(pool, fresh);
		if (err)
			return err;
		page_unref_locked(pool, id);
		t->pages[logical] = id = fresh;
	}
	if (pool->spill && filling) {
		/* the whole page is about to be written: a frame (its old bytes,
		 * in RAM or in the file, are not needed), its file copy stale, and
		 * a pin until the fill is done so eviction leaves it alone */
		if (pool->page_frame[id] == KVR_POOL_NO_PAGE) {
			int err = frame_take(pool, id);
			if (err)
				return err;
		}
		slot_drop(pool, id);
		pin_locked(pool, id);
		atomic_store_explicit(&pool->touched[id], 1, memory_order_relaxed);
	}
	*page = page_address(pool, id);
	*summary = t->summaries ? t->summaries + (uint64_t)logical * pool->summary_bytes : NULL;
	*id_out = id;
	return 0;
}

int kvr_pool_write_page(struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint32_t logical,
			const void *k_rows, const void *v_rows, uint64_t row_stride)
{
	struct layer_table *t = NULL; /* set by table_get on success */
	unsigned char *page = NULL, *summary = NULL;
	uint32_t id = 0;
	pthread_mutex_lock(&pool->lock);
	int err = table_get(pool, seq, layer, &t);
	if (!err && logical >= t->n_pages)
		err = fail(pool, -EINVAL,
			   "pool: logical page %u of sequence %u layer %u is not reserved (%u pages)",
			   logical, seq, layer, t->n_pages);
	if (!err && (!k_rows || !v_rows))
		err = fail(pool, -EINVAL, "pool: keys or values are NULL");
	if (!err && row_stride < (uint64_t)pool->g.n_kv_heads * pool->g.head_dim)
		err = fail(pool, -EINVAL, "pool: row stride %llu is below n_kv x d = %u",
			   (unsigned long long)row_stride, pool->g.n_kv_heads * pool->g.head_dim);
	if (!err && row_stride > UINT32_MAX)
		err = fail(pool, -EINVAL, "pool: row stride %llu exceeds 32 bits",
			   (unsigned long long)row_stride);
	if (!err)
		err = page_for_write(pool, t, logical, &page, &summary, &id, true);
	pthread_mutex_unlock(&pool->lock);
	if (err)
		return err;
	page_fill(pool, id, page, summary, k_rows, v_rows, row_stride);
	if (pool->spill) {
		pthread_mutex_lock(&pool->lock);
		unpin_locked(pool, id);
		pthread_mutex_unlock(&pool->lock);
	}
	return 0;
}

uint64_t kvr_pool_head_bytes(const struct kvr_pool *pool)
{
	return pool->head_bytes;
}

uint32_t kvr_pool_page_format(const struct kvr_pool *pool, uint32_t page_id)
{
	if (pool->page_format && page_id < pool->capacity_pages)
		return pool->page_format[page_id];
	return pool->fill_format;
}

int kvr_pool_demote(struct kvr_pool *pool, uint32_t page_id)
{
	pthread_mutex_lock(&pool->lock);
	int err = 0;
	if (!pool->page_format)
		err = fail(pool, -EINVAL, "pool: demote: pages are not mixed (format %u)",
			   pool->params.kv_format);
	else if (!page_live(pool, page_id))
		err = fail(pool, -EINVAL, "pool: demote: page %u is not live", page_id);
	else if (pool->refcount[page_id] > 1)
		err = fail(pool, -EBUSY, "pool: demote: page %u is shared by %u references", page_id,
			   pool->refcount[page_id]);
	else if (pool->spill && pool->page_frame[page_id] == KVR_POOL_NO_PAGE)
		err = fail(pool, -EAGAIN, "pool: demote: page %u is in the spill file", page_id);
	else if (pool->spill && pool->pins[page_id])
		err = fail(pool, -EBUSY, "pool: demote: page %u is pinned by a reader", page_id);
	const bool k4 = !err && pool->page_format[page_id] == KVR_KV_K4V2;
	if (!err && !k4 && pool->spill)
		pin_locked(pool, page_id); /* no eviction while it is rewritten */
	pthread_mutex_unlock(&pool->lock);
	if (err || k4)
		return err;
	/* each head's run: K8V4 codes -> values -> K4V2 codes, in place at the
	 * same unified offset (the K4V2 run is shorter and written after the
	 * K8V4 run is read in full) */
	const struct kvr_page_geometry *g = &pool->g;
	struct kvr_quant_geometry g4;
	kvr_quant_geometry_init(&g4, g->page_tokens, g->head_dim, 1, KVR_KV_K4V2);
	unsigned char *page = page_address(pool, page_id);
	const uint64_t row = (uint64_t)g->head_dim;
	float *k = kvr_malloc(2 * row * g->page_tokens * sizeof(float));
	if (!k) {
		if (pool->spill) {
			pthread_mutex_lock(&pool->lock);
			unpin_locked(pool, page_id);
			pthread_mutex_unlock(&pool->lock);
		}
		return fail(pool, -ENOMEM, "pool: demote: out of memory");
	}
	float *v = k + row * g->page_tokens, scratch[256];
	for (uint32_t h = 0; h < g->n_kv_heads; h++) {
		unsigned char *run = page + (uint64_t)h * pool->head_bytes;
		kvr_quant_run_to_nhd(&pool->quant, run, g->page_tokens, k, v, (uint32_t)row, KVR_ELEM_F32, 0);
		kvr_quant_run_from_nhd(&g4, k, v, (uint32_t)row, KVR_ELEM_F32, 0, g->page_tokens, run, scratch);
	}
	free(k);
	pool->page_format[page_id] = KVR_KV_K4V2;
	if (pool->spill) {
		pthread_mutex_lock(&pool->lock);
		slot_drop(pool, page_id); /* the file's copy is the K8V4 page */
		unpin_locked(pool, page_id);
		pthread_mutex_unlock(&pool->lock);
	}
	return 0;
}

void kvr_pool_gather_head(const struct kvr_pool *pool, uint32_t page_id, uint32_t kv_head,
			  void *dst)
{
	const unsigned char *page = page_address(pool, page_id);
	if (pool->params.layout == KVR_POOL_LAYOUT_HND)
		kvr_copy_stream(dst, page + (uint64_t)kv_head * pool->head_bytes, pool->head_bytes,
				NULL);
	else
		kvr_nhd_page_head_to_hnd_run(&pool->g, page, kv_head, dst);
}

void kvr_pool_gather_runs(const struct kvr_pool *pool, const uint32_t *pages,
			  const uint32_t *heads, uint32_t n, void *dst)
{
	const uint64_t hb = pool->head_bytes;
	unsigned char *out = dst;
	if (pool->params.layout != KVR_POOL_LAYOUT_HND) {
		for (uint32_t i = 0; i < n; i++)
			kvr_nhd_page_head_to_hnd_run(&pool->g, page_address(pool, pages[i]), heads[i],
						     out + i * hb);
		return;
	}
	/* Resolve addresses in batches so each copy can prefetch its successor. */
	enum { BATCH = 64 };
	const void *srcs[BATCH + 1];
	for (uint32_t first = 0; first < n; first += BATCH) {
		const uint32_t m = n - first < BATCH ? n - first : BATCH;
		for (uint32_t i = 0; i < m; i++)
			srcs[i] = page_address(pool, pages[first + i]) + heads[first + i] * hb;
		kvr_copy_stream_gather(out + (uint64_t)first * hb, srcs, m, hb);
	}
}

/* ------------------------------------------------------------------ spill tier */

/* Lock held: every page live (and its head in range when heads is set). */
static int check_live(struct kvr_pool *pool, const uint32_t *pages, const uint32_t *heads, uint32_t n,
		      const char *what)
{
	for (uint32_t i = 0; i < n; i++) {
		if (!page_live(pool, pages[i]))
			return fail(pool, -EINVAL, "pool: %s: page %u is not allocated", what, pages[i]);
		if (heads && heads[i] >= pool->g.n_kv_heads)
			return fail(pool, -EINVAL, "pool: %s: KV head %u of %u", what, heads[i],
				    pool->g.n_kv_heads);
	}
	return 0;
}

int kvr_pool_pin(struct kvr_pool *pool, const uint32_t *pages, uint32_t n)
{
	if (!pool->spill || !n)
		return 0;
	if (!pages)
		return fail(pool, -EINVAL, "pool: pin: pages is NULL");
	if (n == 1) { /* attention's in-place pages, one at a time: resident, no scratch */
		pthread_mutex_lock(&pool->lock);
		const int resident = page_live(pool, pages[0]) && pool->page_frame[pages[0]] != KVR_POOL_NO_PAGE;
		if (resident)
			pin_locked(pool, pages[0]);
		pthread_mutex_unlock(&pool->lock);
		if (resident)
			return 0;
	}
	uint32_t *fetch = kvr_malloc((size_t)n * sizeof(*fetch));
	uint32_t *slots = kvr_malloc((size_t)n * sizeof(*slots));
	void **addrs = kvr_malloc((size_t)n * sizeof(*addrs));
	unsigned char *mine = kvr_calloc(n, 1); /* pages[i] pinned by this call */
	if (!fetch || !slots || !addrs || !mine) {
		free(fetch), free(slots), free(addrs), free(mine);
		return fail(pool, -ENOMEM, "pool: pin: out of memory");
	}
	pthread_mutex_lock(&pool->lock);
	int err = check_live(pool, pages, NULL, n, "pin");
	/* Resident pages first, so that taking frames for the rest cannot evict
	 * them; a page is pinned as soon as it has its frame. */
	for (uint32_t i = 0; i < n && !err; i++)
		if (pool->page_frame[pages[i]] != KVR_POOL_NO_PAGE)
			pin_locked(pool, pages[i]), mine[i] = 1;
	uint32_t n_fetch = 0;
	for (uint32_t i = 0; i < n && !err; i++) {
		if (mine[i])
			continue;
		const uint32_t id = pages[i];
		if (pool->page_frame[id] == KVR_POOL_NO_PAGE) { /* not fetched earlier in this call */
			err = frame_take(pool, id);
			if (err)
				break;
			fetch[n_fetch++] = id;
		}
		pin_locked(pool, id), mine[i] = 1;
	}
	/* Read what was fetched; a page never written reads as zeros. */
	uint32_t n_read = 0;
	for (uint32_t k = 0; k < n_fetch && !err; k++) {
		unsigned char *at = page_address(pool, fetch[k]);
		if (pool->page_slot[fetch[k]] == KVR_SPILL_NO_SLOT) {
			memset(at, 0, pool->page_bytes);
		} else {
			slots[n_read] = pool->page_slot[fetch[k]];
			addrs[n_read++] = at;
		}
	}
	if (!err && n_read) {
		int e = kvr_spill_read_pages(pool->spill, slots, n_read, addrs, NULL);
		if (e) {
			pool->spill_errors++;
			char why[200];
			kvr_spill_copy_error(pool->spill, why, sizeof(why));
			err = fail(pool, e, "pool: pin: %s", why);
		} else {
			pool->fetches += n_read;
		}
	}
	if (err) {
		/* All or nothing: this call's pins go, and every page it fetched
		 * goes back to the file alone (its slot still holds its bytes; a
		 * frame whose read failed holds garbage). */
		for (uint32_t i = 0; i < n; i++)
			if (mine[i])
				unpin_locked(pool, pages[i]);
		for (uint32_t k = 0; k < n_fetch; k++) {
			frame_release(pool, fetch[k]);
			if (pool->page_slot[fetch[k]] != KVR_SPILL_NO_SLOT)
				pool->spilled_pages++;
		}
	}
	pthread_mutex_unlock(&pool->lock);
	free(fetch), free(slots), free(addrs), free(mine);
	return err;
}

int kvr_pool_unpin(struct kvr_pool *pool, const uint32_t *pages, uint32_t n)
{
	if (!pool->spill || !n)
		return 0;
	if (!pages)
		return fail(pool, -EINVAL, "pool: unpin: pages is NULL");
	pthread_mutex_lock(&pool->lock);
	int err = check_live(pool, pages, NULL, n, "unpin");
	uint32_t done = 0;
	for (; done < n && !err; done++) {
		if (!pool->pins[pages[done]]) {
			err = fail(pool, -EINVAL, "pool: unpin: page %u is not pinned", pages[done]);
			break;
		}
		unpin_locked(pool, pages[done]);
	}
	if (err) /* nothing changed: put back what this call took */
		while (done--)
			pin_locked(pool, pages[done]);
	pthread_mutex_unlock(&pool->lock);
	return err;
}

uint32_t kvr_pool_unpin_live(struct kvr_pool *pool, const uint32_t *pages, uint32_t n)
{
	if (!pool->spill || !n || !pages)
		return 0;
	uint32_t skipped = 0;
	pthread_mutex_lock(&pool->lock);
	for (uint32_t i = 0; i < n; i++) {
		if (page_live(pool, pages[i]) && pool->pins[pages[i]])
			unpin_locked(pool, pages[i]);
		else
			skipped++;
	}
	pthread_mutex_unlock(&pool->lock);
	return skipped;
}

void kvr_pool_touch(struct kvr_pool *pool, const uint32_t *pages, uint32_t n)
{
	if (!pool->spill || !pages)
		return;
	for (uint32_t i = 0; i < n; i++)
		if (pages[i] < pool->capacity_pages)
			atomic_store_explicit(&pool->touched[pages[i]], 1, memory_order_relaxed);
}

int kvr_pool_page_resident(struct kvr_pool *pool, uint32_t page_id)
{
	pthread_mutex_lock(&pool->lock);
	int r = !page_live(pool, page_id)
			? fail(pool, -EINVAL, "pool: page %u is not allocated", page_id)
			: (!pool->spill || pool->page_frame[page_id] != KVR_POOL_NO_PAGE);
	pthread_mutex_unlock(&pool->lock);
	return r;
}

int kvr_pool_read_runs(struct kvr_pool *pool, const uint32_t *pages, const uint32_t *heads, uint32_t n,
		       void *dst, int32_t *results)
{
	if (!n)
		return 0;
	if (!pages || !heads || !dst)
		return fail(pool, -EINVAL, "pool: read_runs: pages, heads or dst is NULL");
	if (pool->params.layout != KVR_POOL_LAYOUT_HND)
		return fail(pool, -EINVAL, "pool: read_runs: needs the HND layout");
	const uint64_t hb = pool->head_bytes;
	unsigned char *out = dst;
	if (results)
		memset(results, 0, (size_t)n * sizeof(*results));
	pthread_mutex_lock(&pool->lock);
	int err = check_live(pool, pages, heads, n, "read_runs");
	if (!pool->spill || err) {
		pthread_mutex_unlock(&pool->lock);
		if (err && results)
			for (uint32_t i = 0; i < n; i++)
				results[i] = err;
		if (!err)
			kvr_pool_gather_runs(pool, pages, heads, n, dst);
		return err;
	}
	enum { NEVER_WRITTEN = KVR_POOL_NO_PAGE - 1 }; /* no frame reaches it */
	/* Every page pinned for the call: a resident one keeps its frame, a
	 * spilled one its slot (demotion and eviction respect pins). */
	uint32_t *where = kvr_malloc((size_t)n * sizeof(*where)); /* frame, or NO_PAGE: the file */
	struct kvr_spill_run *runs = kvr_malloc((size_t)n * sizeof(*runs));
	void **dsts = kvr_malloc((size_t)n * sizeof(*dsts));
	uint32_t *file_index = kvr_malloc((size_t)n * sizeof(*file_index));
	int32_t *file_res = kvr_malloc((size_t)n * sizeof(*file_res));
	if (!where || !runs || !dsts || !file_index || !file_res) {
		pthread_mutex_unlock(&pool->lock);
		free(where), free(runs), free(dsts), free(file_index), free(file_res);
		return fail(pool, -ENOMEM, "pool: read_runs: out of memory");
	}
	uint32_t n_file = 0;
	for (uint32_t i = 0; i < n; i++) {
		const uint32_t id = pages[i];
		pin_locked(pool, id);
		atomic_store_explicit(&pool->touched[id], 1, memory_order_relaxed);
		where[i] = pool->page_frame[id];
		if (where[i] == KVR_POOL_NO_PAGE && pool->page_slot[id] == KVR_SPILL_NO_SLOT)
			where[i] = NEVER_WRITTEN;
		if (where[i] == KVR_POOL_NO_PAGE) {
			runs[n_file] = (struct kvr_spill_run){ pool->page_slot[id], heads[i] };
			dsts[n_file] = out + (uint64_t)i * hb;
			file_index[n_file++] = i;
		}
	}
	pthread_mutex_unlock(&pool->lock);
	/* RAM first (streaming copies, prefetching each run's successor) */
	enum { BATCH = 64 };
	const void *srcs[BATCH + 1];
	void *to[BATCH];
	uint32_t m = 0;
	for (uint32_t i = 0; i <= n; i++) {
		if (i < n && where[i] == NEVER_WRITTEN) {
			memset(out + (uint64_t)i * hb, 0, hb);
		} else if (i < n && where[i] != KVR_POOL_NO_PAGE) {
			srcs[m] = frame_address(pool, where[i]) + (uint64_t)heads[i] * hb;
			to[m++] = out + (uint64_t)i * hb;
		}
		if (m == BATCH || (i == n && m)) {
			for (uint32_t k = 0; k < m; k++)
				kvr_copy_stream(to[k], srcs[k], hb, k + 1 < m ? srcs[k + 1] : NULL);
			m = 0;
		}
	}
	/* then the file, read through */
	int ferr = n_file ? kvr_spill_read_runs_to(pool->spill, runs, n_file, dsts, file_res) : 0;
	char why[200] = "";
	if (ferr) /* before another thread's spill call can rewrite the message */
		kvr_spill_copy_error(pool->spill, why, sizeof(why));
	pthread_mutex_lock(&pool->lock);
	for (uint32_t i = 0; i < n; i++)
		unpin_locked(pool, pages[i]);
	if (ferr) {
		pool->spill_errors++;
		err = fail(pool, ferr, "pool: read_runs: %s", why);
	}
	for (uint32_t k = 0; k < n_file; k++) {
		if (results)
			results[file_index[k]] = file_res[k];
		pool->runs_read_through += file_res[k] == 0;
	}
	pthread_mutex_unlock(&pool->lock);
	free(where), free(runs), free(dsts), free(file_index), free(file_res);
	return err;
}

struct kvr_spill *kvr_pool_spill_file(struct kvr_pool *pool)
{
	return pool->spill;
}

uint32_t kvr_pool_page_slot(struct kvr_pool *pool, uint32_t page_id)
{
	pthread_mutex_lock(&pool->lock);
	const uint32_t slot = pool->spill && page_live(pool, page_id) ? pool->page_slot[page_id]
								  : KVR_SPILL_NO_SLOT;
	pthread_mutex_unlock(&pool->lock);
	return slot;
}

int kvr_pool_spill_all(struct kvr_pool *pool)
{
	if (!pool->spill)
		return 0;
	pthread_mutex_lock(&pool->lock);
	int total = 0, err = 0;
	for (;;) {
		uint32_t evicted = 0;
		bool any = false;
		for (uint32_t f = 0; f < pool->frame_high && !any; f++)
			any = pool->frame_page[f] != KVR_POOL_NO_PAGE && !pool->pins[pool->frame_page[f]];
		if (!any)
			break;
		err = evict_locked(pool, 64, true, &evicted);
		if (err)
			break;
		total += (int)evicted;
	}
	pthread_mutex_unlock(&pool->lock);
	return err ? err : total;
}

/* ------------------------------------------------------------------ ingest */

/* A write of the ingestion failed (spill tier: no frame, or the eviction's
 * write failed): the pages it reserved go, so the table is as before the
 * call (its tail rows past `len` in the caller's tile do not matter). */
static int ingest_undo(struct kvr_pool *pool, struct layer_table *t, uint64_t len, int err)
{
	const uint64_t p = pool->g.page_tokens;
	pthread_mutex_lock(&pool->lock);
	table_shrink(pool, t, (uint32_t)((len + p - 1) / p));
	pthread_mutex_unlock(&pool->lock);
	return err;
}

int kvr_pool_ingest(struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint64_t first_position,
		    uint32_t n_tokens, const void *keys, const void *values,
		    struct kvr_tail_tile *tail)
{
	const struct kvr_page_geometry *g = &pool->g;
	const uint64_t p = g->page_tokens, row_elems = (uint64_t)g->n_kv_heads * g->head_dim;
	const uint64_t row_bytes = row_elems * g->elem_bytes;
	struct layer_table *t = NULL; /* set by table_get on success */

	pthread_mutex_lock(&pool->lock);
	int err = table_get(pool, seq, layer, &t);
	if (!err && first_position != t->n_tokens)
		err = fail(pool, -EINVAL,
			   "sequence %u layer %u: tokens must arrive in order: expected "
			   "position %llu, got %llu",
			   seq, layer, (unsigned long long)t->n_tokens,
			   (unsigned long long)first_position);
	if (!err && n_tokens && (!keys || !values || !tail || !tail->keys || !tail->values))
		err = fail(pool, -EINVAL, "pool: keys, values or the tail tile are NULL");
	const uint64_t len = err ? 0 : t->n_tokens;
	if (!err && n_tokens) {
		/* A page is reserved when a tail page starts: every page the new tokens
		 * open, up front, so -ENOMEM leaves everything as it was. */
		const uint64_t pages_after = (len + n_tokens + p - 1) / p;
		const uint32_t before = t->n_pages;
		err = pages_after < before /* cannot happen: a table holds ceil(len / p) pages */
			      ? fail(pool, -EFAULT, "pool: sequence %u layer %u: %u pages for %llu tokens",
				     seq, layer, before, (unsigned long long)len)
			      : reserve_locked(pool, t, (uint32_t)(pages_after - before));
		/* The partial page the tail will complete may be shared with a fork:
		 * give this sequence its own now (its old contents are all in the
		 * tail tile), so nothing below can fail. */
		unsigned char *unused_page, *unused_summary;
		uint32_t unused_id;
		if (!err && len % p) {
			err = page_for_write(pool, t, (uint32_t)(len / p), &unused_page,
					     &unused_summary, &unused_id, false);
			if (err)
				table_shrink(pool, t, before);
		}
	}
	pthread_mutex_unlock(&pool->lock);
	if (err || !n_tokens)
		return err;

	const unsigned char *k = keys, *v = values;
	uint64_t pos = len, i = 0;
	/* 1. Fill the partial tail the previous call left. */
	if (pos % p) {
		const uint64_t at = pos % p, m = p - at < n_tokens ? p - at : n_tokens;
		memcpy((unsigned char *)tail->keys + at * row_bytes, k, m * row_bytes);
		memcpy((unsigned char *)tail->values + at * row_bytes, v, m * row_bytes);
		i += m;
		pos += m;
		if (pos % p == 0) {
			err = kvr_pool_write_page(pool, seq, layer, (uint32_t)(pos / p - 1), tail->keys,
						  tail->values, row_elems);
			if (err)
				return ingest_undo(pool, t, len, err);
		}
	}
	/* 2. Whole pages straight from the caller's rows. */
	for (; n_tokens - i >= p; i += p, pos += p) {
		err = kvr_pool_write_page(pool, seq, layer, (uint32_t)(pos / p), k + i * row_bytes,
					  v + i * row_bytes, row_elems);
		if (err)
			return ingest_undo(pool, t, len, err);
	}
	/* 3. The rest starts a new tail. */
	if (i < n_tokens) {
		memcpy(tail->keys, k + i * row_bytes, (n_tokens - i) * row_bytes);
		memcpy(tail->values, v + i * row_bytes, (n_tokens - i) * row_bytes);
	}
	pthread_mutex_lock(&pool->lock);
	t->n_tokens = len + n_tokens;
	pthread_mutex_unlock(&pool->lock);
	return 0;
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
		if (!page_live(pool, id)) {
			if (f != KVR_POOL_NO_PAGE || s != KVR_SPILL_NO_SLOT || pool->pins[id])
				return fail(pool, -EFAULT, "pool: free page %u holds frame %u, slot %u or pins %u",
					    id, f, s, pool->pins[id]);
			continue;
		}
		if (f != KVR_POOL_NO_PAGE && (f >= pool->frame_high || pool->frame_page[f] != id))
			return fail(pool, -EFAULT, "pool: page %u claims frame %u, which holds %u", id, f,
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
			return fail(pool, -EFAULT, "pool: frame %u holds page %u, which is elsewhere", f, id);
	}
	struct kvr_spill_stats ss;
	kvr_spill_get_stats(pool->spill, &ss);
	if (held != resident || held + pool->n_frame_free != pool->frame_high ||
	    resident != pool->resident_pages || spilled != pool->spilled_pages ||
	    pinned != pool->pinned_pages || with_slot != ss.slots_used)
		return fail(pool, -EFAULT,
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
		err = fail(pool, -ENOMEM, "pool: validate: out of memory");
		goto out;
	}
	for (uint32_t s = 0; s < pool->params.max_sequences; s++) {
		if (!pool->seqs[s].open)
			continue;
		for (uint32_t l = 0; l < pool->params.n_layers; l++) {
			const struct layer_table *t = &pool->seqs[s].layers[l];
			const uint64_t p = pool->g.page_tokens;
			if (t->n_pages < (t->n_tokens + p - 1) / p) {
				err = fail(pool, -EFAULT, "pool: seq %u layer %u has %llu tokens in %u pages",
					   s, l, (unsigned long long)t->n_tokens, t->n_pages);
				goto out;
			}
			for (uint32_t i = 0; i < t->n_pages; i++) {
				if (t->pages[i] >= pool->high_water) {
					err = fail(pool, -EFAULT, "pool: seq %u layer %u page %u maps to "
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
			err = fail(pool, -EFAULT, "pool: page %u has refcount %u but %u references", id,
				   pool->refcount[id], want);
			goto out;
		}
		live += want > 0;
	}
	for (uint32_t i = 0; i < pool->n_free; i++) {
		const uint32_t id = pool->free_stack[i];
		if (id >= pool->high_water || pool->refcount[id] || on_stack[id]) {
			err = fail(pool, -EFAULT, "pool: free stack entry %u (page %u) is %s", i, id,
				   on_stack[id] ? "a duplicate" : "not a free page");
			goto out;
		}
		on_stack[id] = 1;
	}
	if (live != pool->used_pages || live + pool->n_free != pool->high_water) {
		err = fail(pool, -EFAULT,
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
