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
 * Threads: `lock` guards the allocator, refcounts, sequence tables and stats.
 * Page memory is read and written without it by whoever holds the page (see
 * pool.h). Lock order: the pool's lock is a leaf (nothing is called with it
 * held that takes another lock, except the log callback on a lock warning).
 */
#include <errno.h>
#include <numaif.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "../gpu/gpu.h"
#include "../layouts/convert.h"
#include "../layouts/copy.h"
#include "../layouts/kvquant.h"
#include "../layouts/summary.h"
#include "../layouts/transpose.h"
#include "pool.h"

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

	uint32_t lock_failures;
	uint32_t hugepage_failures;
	uint32_t bind_failures;
	bool warned_lock;
	bool warned_bind;

	char last_error[256];
};

/* ------------------------------------------------------------------ errors */

static int __attribute__((format(printf, 3, 4))) fail(struct kvr_pool *pool, int err,
						       const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(pool->last_error, sizeof(pool->last_error), fmt, ap);
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
	return pool ? pool->last_error : "";
}

/* ------------------------------------------------------------------ chunks */

/* Map, place and lock chunk c. Called with the lock held. */
static int chunk_map(struct kvr_pool *pool, uint32_t c)
{
	const size_t bytes = pool->chunk_bytes;
	unsigned char *raw = mmap(NULL, bytes + HUGE_PAGE_BYTES, PROT_READ | PROT_WRITE,
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
#undef REJECT

	struct kvr_pool *pool = calloc(1, sizeof(*pool));
	if (!pool)
		return -ENOMEM;
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
	const uint64_t all = capacity_pages * page_bytes;
	const uint64_t all_rounded = (all + HUGE_PAGE_BYTES - 1) & ~(HUGE_PAGE_BYTES - 1);
	if (chunk > all_rounded)
		chunk = all_rounded;
	const uint64_t min_chunk = (page_bytes + HUGE_PAGE_BYTES - 1) & ~(HUGE_PAGE_BYTES - 1);
	if (chunk < min_chunk)
		chunk = min_chunk;
	pool->chunk_bytes = chunk;
	pool->pages_per_chunk = (uint32_t)(chunk / page_bytes);
	pool->max_chunks = (uint32_t)((capacity_pages + pool->pages_per_chunk - 1) /
				      pool->pages_per_chunk);

	pool->chunks = calloc(pool->max_chunks, sizeof(*pool->chunks));
	pool->chunk_state = calloc(pool->max_chunks, 1);
	pool->refcount = calloc(capacity_pages, sizeof(*pool->refcount));
	pool->free_stack = malloc(capacity_pages * sizeof(*pool->free_stack));
	pool->seqs = calloc(params->max_sequences, sizeof(*pool->seqs));
	if (params->kv_format == KVR_KV_MIXED)
		pool->page_format = calloc(capacity_pages, 1);
	if (!pool->chunks || !pool->chunk_state || !pool->refcount || !pool->free_stack ||
	    !pool->seqs || (params->kv_format == KVR_KV_MIXED && !pool->page_format)) {
		kvr_pool_destroy(pool);
		if (err)
			snprintf(err, err_bytes, "pool: out of memory for %llu page entries",
				 (unsigned long long)capacity_pages);
		return -ENOMEM;
	}
	pthread_mutex_init(&pool->lock, NULL);
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
	if (pool->refcount) /* created fully: the mutex exists */
		pthread_mutex_destroy(&pool->lock);
	free(pool->chunks);
	free(pool->chunk_state);
	free(pool->refcount);
	free(pool->free_stack);
	free(pool->seqs);
	free(pool->page_format);
	free(pool);
}

/* ------------------------------------------------------------------ pages */

static inline unsigned char *page_address(const struct kvr_pool *pool, uint32_t id)
{
	unsigned char *chunk = pool->chunks[id / pool->pages_per_chunk];
	return chunk ? chunk + (uint64_t)(id % pool->pages_per_chunk) * pool->page_bytes : NULL;
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
		if (!pool->chunks[c]) {
			int err = chunk_map(pool, c);
			if (err)
				return err;
		}
		pool->high_water++;
	}
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
		struct layer_table *layers = calloc(pool->params.n_layers, sizeof(*layers));
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
			if (!err && from->summaries)
				memcpy(to->summaries, from->summaries,
				       (uint64_t)from->n_pages * pool->summary_bytes);
			to->n_tokens = from->n_tokens;
		}
	}
	if (err) {
		/* Drop the references taken so far; keep the message of the failure. */
		char message[sizeof(pool->last_error)];
		memcpy(message, pool->last_error, sizeof(message));
		pthread_mutex_unlock(&pool->lock);
		kvr_pool_seq_close(pool, dst);
		pthread_mutex_lock(&pool->lock);
		memcpy(pool->last_error, message, sizeof(message));
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
	uint32_t *pages = realloc(t->pages, cap * sizeof(*pages));
	if (!pages)
		return fail(pool, -ENOMEM, "pool: out of memory for a page table");
	t->pages = pages;
	if (pool->summary_bytes && !pool->params.register_fn) {
		unsigned char *s = realloc(t->summaries, cap * pool->summary_bytes);
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
			  unsigned char **page, unsigned char **summary, uint32_t *id_out)
{
	uint32_t id = t->pages[logical];
	if (pool->refcount[id] > 1) {
		uint32_t fresh = 0; /* set by page_alloc_locked on success */
		int err = page_alloc_locked(pool, &fresh);
		if (err)
			return err;
		page_unref_locked(pool, id);
		t->pages[logical] = id = fresh;
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
		err = page_for_write(pool, t, logical, &page, &summary, &id);
	pthread_mutex_unlock(&pool->lock);
	if (err)
		return err;
	page_fill(pool, id, page, summary, k_rows, v_rows, row_stride);
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
	pthread_mutex_unlock(&pool->lock);
	if (err || pool->page_format[page_id] == KVR_KV_K4V2)
		return err;
	/* each head's run: K8V4 codes -> values -> K4V2 codes, in place at the
	 * same unified offset (the K4V2 run is shorter and written after the
	 * K8V4 run is read in full) */
	const struct kvr_page_geometry *g = &pool->g;
	struct kvr_quant_geometry g4;
	kvr_quant_geometry_init(&g4, g->page_tokens, g->head_dim, 1, KVR_KV_K4V2);
	unsigned char *page = page_address(pool, page_id);
	const uint64_t row = (uint64_t)g->head_dim;
	float *k = malloc(2 * row * g->page_tokens * sizeof(float));
	if (!k)
		return fail(pool, -ENOMEM, "pool: demote: out of memory");
	float *v = k + row * g->page_tokens, scratch[256];
	for (uint32_t h = 0; h < g->n_kv_heads; h++) {
		unsigned char *run = page + (uint64_t)h * pool->head_bytes;
		kvr_quant_run_to_nhd(&pool->quant, run, g->page_tokens, k, v, (uint32_t)row, KVR_ELEM_F32, 0);
		kvr_quant_run_from_nhd(&g4, k, v, (uint32_t)row, KVR_ELEM_F32, 0, g->page_tokens, run, scratch);
	}
	free(k);
	pool->page_format[page_id] = KVR_KV_K4V2;
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

/* ------------------------------------------------------------------ ingest */

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
			   "pool: sequence %u layer %u: tokens must arrive in order: expected "
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
		err = reserve_locked(pool, t, (uint32_t)(pages_after - before));
		/* The partial page the tail will complete may be shared with a fork:
		 * give this sequence its own now (its old contents are all in the
		 * tail tile), so nothing below can fail. */
		unsigned char *unused_page, *unused_summary;
		uint32_t unused_id;
		if (!err && len % p) {
			err = page_for_write(pool, t, (uint32_t)(len / p), &unused_page,
					     &unused_summary, &unused_id);
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
				return err;
		}
	}
	/* 2. Whole pages straight from the caller's rows. */
	for (; n_tokens - i >= p; i += p, pos += p) {
		err = kvr_pool_write_page(pool, seq, layer, (uint32_t)(pos / p), k + i * row_bytes,
					  v + i * row_bytes, row_elems);
		if (err)
			return err;
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
	pthread_mutex_unlock(&mpool->lock);
}

int kvr_pool_validate(struct kvr_pool *pool, const uint32_t *external_refs)
{
	int err = 0;
	pthread_mutex_lock(&pool->lock);
	uint32_t *expect = calloc(pool->capacity_pages, sizeof(*expect));
	unsigned char *on_stack = calloc(pool->capacity_pages, 1);
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
	if (live != pool->used_pages || live + pool->n_free != pool->high_water)
		err = fail(pool, -EFAULT,
			   "pool: %llu live + %u free pages != high water %u (used_pages %llu)",
			   (unsigned long long)live, pool->n_free, pool->high_water,
			   (unsigned long long)pool->used_pages);
out:
	free(expect);
	free(on_stack);
	pthread_mutex_unlock(&pool->lock);
	return err;
}
