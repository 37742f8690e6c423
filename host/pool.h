/* SPDX-License-Identifier: MIT */
/*
 * pool.h — the host KV page pool: where the full KV cache lives.
 *
 * Pages are one layer's KV for p tokens, in HND layout ([n_kv][2][p][d], so one
 * KV head's keys and values are one contiguous run) or, for the ablation, NHD
 * ([2][p][n_kv][d]). HND pages may be quantised (K8V4, K4V2: kvquant.h), each
 * KV head still one run, then head_bytes is the quantised run's size. They are carved from large chunks (2 MiB aligned,
 * transparent huge pages through madvise) bound to one NUMA node (mbind) and
 * locked (registered with the GPU when one is usable, else mlock; when locking
 * fails the pool continues unlocked, counts it and warns once).
 *
 * Page ids are dense 32-bit indices; the allocator is a LIFO stack of freed ids
 * over a high-water mark, so allocation and free are O(1). Pages carry
 * reference counts so that forked sequences can share them. Per (sequence,
 * layer) a page table maps logical pages to page ids, next to the pages' key
 * summaries and the number of tokens ingested.
 *
 * A hard capacity (capacity_bytes) bounds the pages: reserving past it fails
 * with -ENOMEM and changes nothing. Every call validates its ids (-EINVAL).
 *
 * The spill tier (ram_bytes > 0, HND pools): RAM then holds at most
 * ram_bytes of pages — frames — and the rest of capacity_bytes lives in a
 * spill file (spill.h). A page id names a frame, a slot of the file, or
 * both (a page read back keeps its slot while it is unchanged, so evicting
 * it again costs no write). A page gets a frame when it is written; when no
 * frame is free, the least recently touched unpinned pages are evicted
 * (CLOCK over the frames, kvr_pool_touch sets the reference bits), a batch
 * at a time, written out unless they are clean. Summaries and page tables
 * never leave RAM. Pages are read back into frames by kvr_pool_pin, or read
 * through without one, run by run, by kvr_pool_read_runs. In a pool with a
 * spill tier, page memory (kvr_pool_page_data, kvr_pool_gather_head,
 * kvr_pool_gather_runs) may be read only for pages the caller has pinned.
 *
 * Threads: calls that change the allocator or page tables take the pool's
 * mutex, so the engine's thread and the controller may both call them. Reading
 * a page's memory (kvr_pool_page_data, kvr_pool_gather_head) takes no lock:
 * the caller must hold a page id it obtained from the pool (which happens-after
 * the chunk holding it was mapped) and must not free it concurrently.
 */
#ifndef KVR_HOST_POOL_H
#define KVR_HOST_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "../layouts/page.h"
#include "../layouts/base/log.h"

enum kvr_pool_layout {
	KVR_POOL_LAYOUT_HND = 0, /* one contiguous run per KV head: one copy per recall */
	KVR_POOL_LAYOUT_NHD = 1, /* token-major rows: 2·p copies per KV head (ablation) */
};

/* What summaries a pool keeps per page (layouts/summary.h). */
enum kvr_pool_summaries {
	KVR_POOL_SUMMARIES_NONE = 0,
	KVR_POOL_SUMMARIES_BOUNDS = 1,    /* the key bounds (min, max) */
	KVR_POOL_SUMMARIES_ESTIMATES = 2, /* the bounds and the estimate rows */
};

enum kvr_pool_flags {
	KVR_POOL_NO_HUGEPAGES = 1u << 0, /* skip madvise(MADV_HUGEPAGE) */
	KVR_POOL_NO_LOCK = 1u << 1,      /* neither register nor mlock the chunks */
};

#define KVR_POOL_NO_PAGE UINT32_MAX
#define KVR_POOL_DEFAULT_CHUNK_BYTES (32ull << 20)

typedef kvr_host_log_fn kvr_pool_log_fn;

struct kvr_pool_params {
	struct kvr_page_geometry geometry; /* of one layer's page */
	uint32_t n_layers;                 /* page tables per sequence */
	uint32_t max_sequences;            /* sequence ids are 0..max_sequences-1 */
	uint32_t layout;                   /* enum kvr_pool_layout */
	int32_t numa_node;                 /* node to bind chunks to; -1: no binding */
	uint64_t capacity_bytes;           /* hard limit on page memory, bytes */
	uint64_t chunk_bytes;              /* bytes per mapping, multiple of 2 MiB; 0 = default */
	uint32_t flags;                    /* enum kvr_pool_flags */
	uint32_t keep_summaries;           /* enum kvr_pool_summaries: what summaries a page
	                                      write computes and keeps (0: none) */
	kvr_pool_log_fn log_fn;            /* warnings (lock failures); NULL = silent */
	void *log_user;
	/* Registration of host memory with the context's device (pinned and
	 * mapped: a GPU reads the pages and summaries through unified
	 * addressing). NULL: chunks are registered with any usable GPU
	 * (kvr_gpu_host_register) or locked, and summaries are plain memory.
	 * Set: chunks and summary arrays are registered through it (a chunk it
	 * refuses is locked instead; a summary array it refuses fails the
	 * reservation with its error). */
	int (*register_fn)(void *user, void *ptr, size_t bytes);
	void (*unregister_fn)(void *user, void *ptr);
	void *register_user;
	/* enum kvr_kv_format (layouts/kvquant.h): KVR_KV_PLAIN keeps pages in
	 * the geometry's element type; K8V4 or K4V2 quantises each page at
	 * offload (HND layout only; summaries still come from the unquantised
	 * keys), and a KV head's run is then the quantised run of kvquant.h.
	 * KVR_KV_MIXED: pages are written K8V4 and may be demoted to K4V2
	 * (kvr_pool_demote), every run keeping the K8V4 run's room. */
	uint32_t kv_format;
	/* The spill tier: 0 keeps every page in RAM. Otherwise bytes of RAM for
	 * pages (at least KVR_POOL_MIN_FRAMES pages; HND layout only); pages
	 * beyond it go to a spill file in spill_dir (NULL: spill.h's default)
	 * with spill_queue_depth I/Os in flight (0: default) and spill_flags
	 * (enum kvr_spill_flags). ram_bytes >= capacity_bytes spills nothing. */
	uint64_t ram_bytes;
	const char *spill_dir;
	uint32_t spill_queue_depth;
	uint32_t spill_flags;
};

#define KVR_POOL_MIN_FRAMES 8u

struct kvr_pool_stats {
	uint64_t page_bytes;        /* bytes per page */
	uint64_t capacity_pages;    /* pages the capacity allows */
	uint64_t used_pages;        /* pages allocated now */
	uint64_t reserved_bytes;    /* bytes of chunks mapped */
	uint64_t used_bytes;        /* used_pages * page_bytes */
	uint64_t summary_bytes;     /* bytes of key summaries held */
	uint32_t n_chunks;          /* chunks mapped */
	uint32_t locked_chunks;     /* chunks mlock()ed */
	uint32_t registered_chunks; /* chunks registered with the GPU */
	uint32_t lock_failures;     /* chunks left unlocked */
	uint32_t hugepage_failures; /* chunks whose MADV_HUGEPAGE was refused */
	int32_t numa_node;          /* node chunks are bound to, -1 if none */
	/* the spill tier (all 0 without one) */
	uint32_t spill_enabled;     /* 1: ram_bytes < capacity_bytes, a spill file exists */
	uint32_t frames;            /* pages RAM may hold */
	uint64_t resident_pages;    /* live pages in a frame */
	uint64_t spilled_pages;     /* live pages only in the spill file */
	uint64_t pinned_pages;      /* live pages with a pin */
	uint64_t evictions;         /* pages that left RAM */
	uint64_t spill_writes;      /* of which written out (the rest were clean) */
	uint64_t fetches;           /* pages read back into a frame (kvr_pool_pin) */
	uint64_t runs_read_through; /* runs read from the file by kvr_pool_read_runs */
	uint64_t spill_file_bytes;  /* the spill file's size */
	uint64_t spill_errors;      /* spill reads or writes that failed */
};

struct kvr_pool;

/* The NHD rows of a (sequence, layer)'s partial tail page, owned by the caller
 * (device side): p rows of n_kv·d elements for keys and for values. */
struct kvr_tail_tile {
	void *keys;
	void *values;
};

/* Create a pool. Maps no memory yet (chunks are mapped as pages are reserved).
 * Returns 0, -EINVAL (message in err), -ENOMEM. */
int kvr_pool_create(const struct kvr_pool_params *params, struct kvr_pool **out, char *err,
		    size_t err_bytes);
/* Free everything. NULL is a no-op. */
void kvr_pool_destroy(struct kvr_pool *pool);

/* The message of the calling thread's most recent failed pool call ("" if
 * none): per thread, since the engine and the controller each read their own. */
const char *kvr_pool_last_error(const struct kvr_pool *pool);

/* ---- raw pages (refcounted) ---- */

/* Allocate one page (refcount 1). -ENOMEM at capacity or when mapping fails. */
int kvr_pool_page_alloc(struct kvr_pool *pool, uint32_t *page_id);
/* Add a reference to a live page (fork). -EINVAL for a free or unknown id. */
int kvr_pool_page_ref(struct kvr_pool *pool, uint32_t page_id);
/* Drop a reference; the page is freed when it reaches 0. -EINVAL for a free or
 * unknown id (a double free is caught, not obeyed). */
int kvr_pool_page_unref(struct kvr_pool *pool, uint32_t page_id);
/* Reference count of a page (0 = free), or -EINVAL. */
int kvr_pool_page_refcount(const struct kvr_pool *pool, uint32_t page_id);
/* Address of a live page's data (page_bytes), or NULL for a bad id. Lock-free. */
void *kvr_pool_page_data(const struct kvr_pool *pool, uint32_t page_id);

/* ---- sequences and page tables ---- */

/* Open sequence `seq` with empty page tables. -EINVAL (id out of range),
 * -EEXIST (already open), -ENOMEM. */
int kvr_pool_seq_open(struct kvr_pool *pool, uint32_t seq);
/* Close a sequence and drop its page references. -EINVAL if not open. */
int kvr_pool_seq_close(struct kvr_pool *pool, uint32_t seq);

/* Open sequence `dst` as a fork of `src`: same tokens, every page shared (one
 * more reference each). A later write to a shared page copies it first
 * (copy-on-write), so neither sequence sees the other's new tokens. The caller
 * copies src's tail tiles. -EINVAL, -EEXIST, -ENOMEM (nothing changed). */
int kvr_pool_seq_fork(struct kvr_pool *pool, uint32_t src, uint32_t dst);

/* Append n_pages new pages to (seq, layer)'s table, all or nothing: -ENOMEM
 * when the capacity (or memory) runs out, with the table and every stored page
 * unchanged. */
int kvr_pool_reserve(struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint32_t n_pages);
/* Keep the first n_tokens tokens of (seq, layer): pages wholly beyond them are
 * released. The caller's tail tile must be refilled by the caller if the new
 * length ends inside a page that was already offloaded. -EINVAL. */
int kvr_pool_truncate(struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint64_t n_tokens);

/* Pages in (seq, layer)'s table, and tokens ingested. -EINVAL for bad ids. */
int kvr_pool_n_pages(const struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint32_t *n_pages);
int kvr_pool_n_tokens(const struct kvr_pool *pool, uint32_t seq, uint32_t layer,
		      uint64_t *n_tokens);
/* Page id of a logical page. -EINVAL for bad ids or a logical page not reserved. */
int kvr_pool_lookup(const struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint32_t logical,
		    uint32_t *page_id);

/* Offload: write p NHD rows of keys and values (row t at +t·row_stride
 * elements) into the page of (seq, layer, logical), converting to the pool's
 * layout, and compute its key summaries when the pool keeps them. With a
 * spill tier the page needs a frame: -ENOMEM (every frame pinned) or the
 * eviction's -EIO / -ENOSPC leave the table and every page as they were. */
int kvr_pool_write_page(struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint32_t logical,
			const void *k_rows, const void *v_rows, uint64_t row_stride);

/* Key summary of (seq, layer, logical): [n_kv][2][d] elements (min then max).
 * NULL for bad ids or when summaries are not kept. */
const void *kvr_pool_summary(const struct kvr_pool *pool, uint32_t seq, uint32_t layer,
			     uint32_t logical);

/* Bytes of one KV head's stored run (a quantised run for quantised pages;
 * for a mixed pool the K8V4 run's, the stride of every page's runs). */
uint64_t kvr_pool_head_bytes(const struct kvr_pool *pool);

/* The format a live page is stored in: the pool's for a single-format pool,
 * K8V4 or K4V2 for a mixed one. Lock-free; the caller holds the page (its
 * owner demotes it, and publishes that as it publishes the page). */
uint32_t kvr_pool_page_format(const struct kvr_pool *pool, uint32_t page_id);

/* Mixed pools: requantise a K8V4 page to K4V2 in place (its runs keep their
 * offsets; each is quantised again from its dequantised K8V4 values). A
 * K4V2 page is left as it is. -EINVAL for a pool that is not mixed or a page
 * that is not live, -EBUSY for a page shared with a fork (its other
 * readers did not ask) or pinned by a reader, -EAGAIN for a page in the
 * spill file (judged pages there stay K8V4), -ENOMEM. The caller owns the page: no one may read
 * it (attention, a recall copy) while it is rewritten. */
int kvr_pool_demote(struct kvr_pool *pool, uint32_t page_id);

/* Copy one KV head of a page into dst as an HND run (head_bytes): one memcpy
 * for an HND pool, 2·p row copies for an NHD pool. Lock-free. */
void kvr_pool_gather_head(const struct kvr_pool *pool, uint32_t page_id, uint32_t kv_head,
			  void *dst);

/* Gather n KV-head runs (pages[i], heads[i]) into dst + i·head_bytes, as
 * recall's host side does: streaming stores, each run's successor prefetched
 * while it is copied (HND); 2·p row copies per run for an NHD pool. dst should
 * be 64-byte aligned. Lock-free, like kvr_pool_gather_head. */
void kvr_pool_gather_runs(const struct kvr_pool *pool, const uint32_t *pages,
			  const uint32_t *heads, uint32_t n, void *dst);

/* ---- the spill tier (no-ops, returning 0, in a pool without one) ---- */

/* Pin n pages in RAM (a page listed twice is pinned twice): spilled ones are
 * read back into frames, evicting unpinned others. All or nothing: -EINVAL
 * (a page not live), -ENOMEM (the frames cannot hold them beside the pages
 * already pinned), -EIO or -EBADMSG (a read failed or its checksum did not
 * match: that page stays spilled) leave no pin taken and every page's data
 * as it was. */
int kvr_pool_pin(struct kvr_pool *pool, const uint32_t *pages, uint32_t n);
/* Drop one pin of each page. -EINVAL (nothing changed) for a page not live
 * or not pinned. */
int kvr_pool_unpin(struct kvr_pool *pool, const uint32_t *pages, uint32_t n);
/* As kvr_pool_unpin, but a page no longer live or not pinned (freed since
 * it was pinned) is skipped rather than refused: the number skipped. */
uint32_t kvr_pool_unpin_live(struct kvr_pool *pool, const uint32_t *pages, uint32_t n);
/* Mark pages as just used (selected): eviction takes them last. Lock-free;
 * ids out of range are ignored. */
void kvr_pool_touch(struct kvr_pool *pool, const uint32_t *pages, uint32_t n);
/* 1 when a live page is in a frame, 0 when it is only in the spill file (or
 * was never written), -EINVAL for a page not live. Always 1 without a spill
 * tier. */
int kvr_pool_page_resident(struct kvr_pool *pool, uint32_t page_id);

/* Read n KV-head runs (pages[i], heads[i]) into dst + i·head_bytes, as
 * kvr_pool_gather_runs, from RAM or straight from the spill file (read
 * through: a spilled page stays spilled). The resident pages are pinned for
 * the copy, so eviction may run beside it. results[i] (may be NULL): 0, or
 * -EIO / -EBADMSG for a run that could not be read (its dst bytes are then
 * unspecified); the return is 0 or the first failure; -EINVAL (nothing
 * read) for a page not live. Pages read are touched. Any thread; HND. */
int kvr_pool_read_runs(struct kvr_pool *pool, const uint32_t *pages, const uint32_t *heads,
		       uint32_t n, void *dst, int32_t *results);

/* The pool's spill file, NULL without a spill tier (tests inject faults
 * through it, spill.h's kvr_spill_inject). */
struct kvr_spill *kvr_pool_spill_file(struct kvr_pool *pool);

/* The slot of the spill file holding a live page's bytes, or
 * KVR_SPILL_NO_SLOT (none, or no spill tier). Tests. */
uint32_t kvr_pool_page_slot(struct kvr_pool *pool, uint32_t page_id);

/* Evict every unpinned resident page now (tests and benchmarks: a pool
 * fully spilled). Returns the number evicted, or a negative errno. */
int kvr_pool_spill_all(struct kvr_pool *pool);

/*
 * Prefill ingestion: append n_tokens tokens at positions first_position.. to
 * (seq, layer). keys/values hold n_tokens NHD rows (n_kv·d elements each).
 * first_position must equal the tokens already ingested (positions are
 * explicit and in order). Pages are reserved up front for every page the new
 * tokens start (all or nothing: -ENOMEM changes nothing); every page completed
 * is offloaded to the pool; the partial tail is left in `tail` (rows
 * n_tokens % p of it are valid afterwards). With a spill tier a page's write
 * can fail (-ENOMEM, -EIO, -ENOSPC): the pages the call reserved are
 * released and the table is as before (the tail tile's rows past the old
 * length are then unspecified).
 */
int kvr_pool_ingest(struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint64_t first_position,
		    uint32_t n_tokens, const void *keys, const void *values,
		    struct kvr_tail_tile *tail);

/*
 * One decoded token whose rows a device writes (the scheduler's device
 * append): kvr_pool_ingest's bookkeeping for the token at `position`, without
 * its data. The caller writes the token's rows into its tail tile. When the
 * token completes a page, fill->page is that page's memory (plain pages: the
 * pool's layout), fill->summary its key summary slot (NULL when the pool keeps
 * none) and fill->id its id; the caller converts the tail tile into it and
 * summarises it, and with a spill tier the page stays pinned (safe from
 * eviction while the device writes it) until the caller drops the pin
 * (kvr_pool_unpin_live). Otherwise fill->page is NULL. The page's bytes are
 * the pool's format: plain pages in the pool's layout, or K8V4 / K4V2 runs
 * (the caller quantises as kvr_quant_run_from_nhd does); -EINVAL for a mixed
 * pool (its pages' formats are the host's judgement). On failure the table
 * is as before the call.
 */
struct kvr_pool_fill {
	void *page;
	void *summary;
	uint32_t id;
	uint32_t reserved;
};
int kvr_pool_append_token(struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint64_t position,
			  struct kvr_pool_fill *fill);

void kvr_pool_get_stats(const struct kvr_pool *pool, struct kvr_pool_stats *out);

/* Walk every structure and check the invariants (each page's refcount equals
 * its references from page tables plus external ones, the free stack holds
 * each free page once, counts add up). Returns 0 or -EFAULT with the first
 * violation in the pool's last error. external_refs[page] may be NULL. */
int kvr_pool_validate(struct kvr_pool *pool, const uint32_t *external_refs);

#endif /* KVR_HOST_POOL_H */
