/* SPDX-License-Identifier: MIT */
/*
 * freelist.h — LeanKV's circular free-page list: the index math by
 * which many heads allocate pages from, and return pages to, one list in
 * parallel, each finding its slice from an exclusive prefix sum over the
 * per-head counts. The device page cache's manager runs it in kernels (one
 * thread per head and sequence, the scan a block or device scan); the cpu
 * backend and the tests run the same functions in loops.
 *
 * The list is an array `ids` of all `capacity` page ids and two monotonically
 * increasing 64-bit counters: allocation takes from `start`, freeing appends
 * at `end`, both read modulo capacity. The free pages are exactly
 * ids[start .. end) (mod capacity), one contiguous region, so a prefix sum is
 * enough to hand every head a disjoint slice of it; end − start is the free
 * count, which tells a full list from an empty one.
 *
 * One round of allocation (a round of frees is symmetric, at `end`):
 *   1. each unit u states how many pages it needs, counts[u];
 *   2. offsets = exclusive scan of counts, total = their sum
 *      (kvr_freelist_scan); total > free count refuses the whole round, and
 *      nothing changes;
 *   3. each unit copies ids[start + offsets[u] + k] for k < counts[u]
 *      (kvr_freelist_take) — independently, in any order or in parallel;
 *   4. start += total, once, after every unit's copy.
 * Live pages never move; only ids move between the list and page tables.
 *
 * Everything here is `static inline KVR_HD` (hd.h) and allocation-free.
 */
#ifndef KVR_LAYOUTS_FREELIST_H
#define KVR_LAYOUTS_FREELIST_H

#include <stdint.h>

#include "hd.h"

struct kvr_freelist {
	uint32_t *ids;     /* capacity page ids */
	uint32_t capacity;
	uint32_t reserved;
	uint64_t start;    /* next id to allocate (counter; index = start mod capacity) */
	uint64_t end;      /* where the next freed id goes */
};

/* A full list: every page 0 .. capacity−1 free. */
static inline KVR_HD void kvr_freelist_init(struct kvr_freelist *l, uint32_t *ids, uint32_t capacity)
{
	l->ids = ids;
	l->capacity = capacity;
	l->reserved = 0;
	l->start = 0;
	l->end = capacity;
	for (uint32_t i = 0; i < capacity; i++)
		ids[i] = i;
}

static inline KVR_HD uint64_t kvr_freelist_free_count(const struct kvr_freelist *l)
{
	return l->end - l->start;
}

/* Exclusive prefix sum of n counts into offsets; returns the total (64-bit:
 * many units asking for many pages cannot wrap it). */
static inline KVR_HD uint64_t kvr_freelist_scan(const uint32_t *counts, uint32_t n, uint64_t *offsets)
{
	uint64_t sum = 0;
	for (uint32_t u = 0; u < n; u++) {
		offsets[u] = sum;
		sum += counts[u];
	}
	return sum;
}

/* Step 3 of a round for one unit: its `count` ids from the free region, at
 * `offset` past `start`. Units with disjoint [offset, offset + count) read
 * disjoint entries. */
static inline KVR_HD void kvr_freelist_take(const struct kvr_freelist *l, uint64_t offset, uint32_t count,
					    uint32_t *out)
{
	for (uint32_t k = 0; k < count; k++)
		out[k] = l->ids[(l->start + offset + k) % l->capacity];
}

/* The same for a round of frees: the unit's `count` ids written at `offset`
 * past `end`. */
static inline KVR_HD void kvr_freelist_give(struct kvr_freelist *l, uint64_t offset, uint32_t count,
					    const uint32_t *in)
{
	for (uint32_t k = 0; k < count; k++)
		l->ids[(l->end + offset + k) % l->capacity] = in[k];
}

/* Whole rounds on one thread (the cpu backend; the reference for the
 * kernels). Allocation: out[u] receives counts[u] ids. 0, or -1 when the
 * round asks for more than is free (nothing taken). offsets: n entries. */
static inline KVR_HD int kvr_freelist_alloc_round(struct kvr_freelist *l, const uint32_t *counts, uint32_t n,
						  uint64_t *offsets, uint32_t *const *out)
{
	const uint64_t total = kvr_freelist_scan(counts, n, offsets);
	if (total > kvr_freelist_free_count(l))
		return -1;
	for (uint32_t u = 0; u < n; u++)
		kvr_freelist_take(l, offsets[u], counts[u], out[u]);
	l->start += total;
	return 0;
}

/* Frees: in[u] holds counts[u] ids. -1 when more would be free than the list
 * holds (a page freed twice, or one that was never allocated; nothing
 * written). */
static inline KVR_HD int kvr_freelist_free_round(struct kvr_freelist *l, const uint32_t *counts, uint32_t n,
						 uint64_t *offsets, const uint32_t *const *in)
{
	const uint64_t total = kvr_freelist_scan(counts, n, offsets);
	if (total > l->capacity - kvr_freelist_free_count(l))
		return -1;
	for (uint32_t u = 0; u < n; u++)
		kvr_freelist_give(l, offsets[u], counts[u], in[u]);
	l->end += total;
	return 0;
}

/* The freelist kernel's decision for a round (gpu/kernels.h): op 1 allocates,
 * 2 frees; -2 (KVR_FREELIST_BAD) for an unknown op or counters no list can
 * have; else -1 (KVR_FREELIST_SHORT) when the round asks too much; else -2
 * for a round larger than the caller's page buffer; else 0. Shared by the cpu and CUDA
 * kernels so that both refuse exactly the same rounds. */
static inline KVR_HD int kvr_freelist_verdict(uint32_t op, uint64_t start, uint64_t end, uint32_t capacity,
					      uint64_t total, uint64_t pages_capacity)
{
	if ((op != 1 && op != 2) || !capacity || end < start || end - start > capacity)
		return -2;
	const uint64_t n_free = end - start;
	if (op == 1 ? total > n_free : total > capacity - n_free)
		return -1;
	return total > pages_capacity ? -2 : 0;
}

#endif /* KVR_LAYOUTS_FREELIST_H */
