/* SPDX-License-Identifier: MIT */
/*
 * pool_impl.h — the host KV page pool's state, shared by its files (pool.h
 * is the contract): pool.c owns the memory (chunks, NUMA binding, locking or
 * registration), the pool's life and its statistics and validation;
 * pool_pages.c page ids and refcounts; pool_tables.c the sequences' page
 * tables (open, fork, truncate, reserve); pool_residency.c the spill tier
 * (frames, CLOCK eviction, pins, read-through); pool_ingest.c what is written
 * into pages (write, fill, demote, ingest, gather).
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
 * victims that are dirty in one batch. Eviction's writes and a pin's
 * read-back run under the pool's lock: it is what makes an eviction and a
 * reader's pin exclusive (docs/architecture.md, "Spill I/O and the pool's
 * lock", says why this stays); recall's reads (kvr_pool_read_runs) pin under
 * it and read outside it, and readers copy outside it, holding pins.
 *
 * Threads: `lock` guards the allocator, refcounts, sequence tables, the
 * spill tier's maps and the stats; every function declared here expects it
 * held ("_locked") or is called where it is (the files say). Page memory is
 * read and written without it by whoever holds the page (see pool.h). Lock
 * order: the pool's lock is a leaf (nothing is called with it held that takes
 * another lock, except the log callback on a lock warning).
 */
#ifndef KVR_HOST_POOL_IMPL_H
#define KVR_HOST_POOL_IMPL_H

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
#include "../layouts/base/fault.h"
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

/* pool.c: the calling thread's latest pool failure (the engine and the
 * controller both call into the pool, and each reads the message of its own
 * failed call); pool_fail writes it and returns err, pool_warn logs. */
extern _Thread_local char pool_thread_error[256];
/* pool.c: the pool's message (returns err), a warning through the log */
int __attribute__((format(printf, 3, 4))) pool_fail(struct kvr_pool *pool, int err, const char *fmt,
						   ...);
void __attribute__((format(printf, 2, 3))) pool_warn(struct kvr_pool *pool, const char *fmt, ...);
int pool_chunk_map(struct kvr_pool *pool, uint32_t c);
void pool_summaries_free(struct kvr_pool *pool, unsigned char *summaries);
void pool_table_free(struct kvr_pool *pool, struct layer_table *t);

/* pool_pages.c (lock held) */
int pool_page_alloc_locked(struct kvr_pool *pool, uint32_t *id_out);
bool pool_page_live(const struct kvr_pool *pool, uint32_t id);
void pool_page_unref_locked(struct kvr_pool *pool, uint32_t id);

/* pool_tables.c (lock held) */
int pool_table_get(struct kvr_pool *pool, uint32_t seq, uint32_t layer, struct layer_table **out);
int pool_table_page_get(struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint32_t logical,
			struct layer_table **out);
void pool_table_shrink(struct kvr_pool *pool, struct layer_table *t, uint32_t keep);
int pool_reserve_locked(struct kvr_pool *pool, struct layer_table *t, uint32_t n_pages);

/* pool_residency.c (lock held) */
void pool_pin_locked(struct kvr_pool *pool, uint32_t id);
void pool_unpin_locked(struct kvr_pool *pool, uint32_t id);
void pool_frame_release(struct kvr_pool *pool, uint32_t id);
int pool_frame_take(struct kvr_pool *pool, uint32_t id);
void pool_slot_drop(struct kvr_pool *pool, uint32_t id);

#endif /* KVR_HOST_POOL_IMPL_H */
