/* SPDX-License-Identifier: MIT */
/*
 * pool_residency.c — the spill tier: frames of RAM for pages, CLOCK
 * eviction into the spill file, pins that keep a page in RAM for readers,
 * read-through of spilled runs, and the calls that report and force
 * residency. The I/O runs under the pool's lock (pool_impl.h says why).
 *
 * Threads: any, under the pool's lock; pinned pages are read outside it.
 */
#include "pool_impl.h"

/* ---- the spill tier: frames, pins, eviction. Lock held throughout. ---- */

void pool_pin_locked(struct kvr_pool *pool, uint32_t id)
{
	if (pool->pins[id]++ == 0)
		pool->pinned_pages++;
	/* in use: once unpinned it is evicted last (sink and window pages are
	 * pinned by every step's attention and so stay in RAM) */
	atomic_store_explicit(&pool->touched[id], 1, memory_order_relaxed);
}

void pool_unpin_locked(struct kvr_pool *pool, uint32_t id)
{
	if (!pool->pins[id]) /* freed while pinned (the pins went with it) */
		return;
	if (--pool->pins[id] == 0)
		pool->pinned_pages--;
}

void pool_frame_release(struct kvr_pool *pool, uint32_t id)
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
		pool_pin_locked(pool, id); /* chosen: the sweep's second pass must skip it */
		if (pool->page_slot[id] == KVR_SPILL_NO_SLOT) {
			data[n_dirty] = frame_address(pool, f);
			dirty[n_dirty++] = id;
		}
	}
	for (uint32_t i = 0; i < n; i++)
		pool_unpin_locked(pool, victims[i]);
	if (!n)
		return pool_fail(pool, -ENOMEM,
			         "pool: RAM budget of %u pages: every resident page is pinned (%llu pinned)",
			         pool->n_frames, (unsigned long long)pool->pinned_pages);
	if (n_dirty) {
		int err = kvr_spill_write_pages(pool->spill, data, n_dirty, slots);
		if (err) {
			char why[200];
			kvr_spill_copy_error(pool->spill, why, sizeof(why));
			pool->spill_errors++;
			return pool_fail(pool, err, "pool: cannot spill %u pages: %s", n_dirty, why);
		}
		for (uint32_t i = 0; i < n_dirty; i++)
			pool->page_slot[dirty[i]] = slots[i];
		pool->spill_writes += n_dirty;
	}
	for (uint32_t i = 0; i < n; i++)
		pool_frame_release(pool, victims[i]);
	pool->spilled_pages += n;
	pool->evictions += n;
	*evicted = n;
	return 0;
}

/* A frame for page id (which has none), evicting when RAM is full. */
int pool_frame_take(struct kvr_pool *pool, uint32_t id)
{
	uint32_t f;
	if (pool->n_frame_free) {
		f = pool->frame_free[--pool->n_frame_free];
	} else if (pool->frame_high < pool->n_frames) {
		f = pool->frame_high;
		const uint32_t c = f / pool->pages_per_chunk;
		if (!pool->chunks[c]) {
			int err = pool_chunk_map(pool, c);
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
void pool_slot_drop(struct kvr_pool *pool, uint32_t id)
{
	if (pool->page_slot[id] == KVR_SPILL_NO_SLOT)
		return;
	kvr_spill_free(pool->spill, pool->page_slot[id]);
	pool->page_slot[id] = KVR_SPILL_NO_SLOT;
}


/* ------------------------------------------------------------------ spill tier */

/* Lock held: every page live (and its head in range when heads is set). */
static int check_live(struct kvr_pool *pool, const uint32_t *pages, const uint32_t *heads, uint32_t n,
		      const char *what)
{
	for (uint32_t i = 0; i < n; i++) {
		if (!pool_page_live(pool, pages[i]))
			return pool_fail(pool, -EINVAL, "pool: %s: page %u is not allocated", what, pages[i]);
		if (heads && heads[i] >= pool->g.n_kv_heads)
			return pool_fail(pool, -EINVAL, "pool: %s: KV head %u of %u", what, heads[i],
				         pool->g.n_kv_heads);
	}
	return 0;
}

int kvr_pool_pin(struct kvr_pool *pool, const uint32_t *pages, uint32_t n)
{
	if (!pool->spill || !n)
		return 0;
	if (!pages)
		return pool_fail(pool, -EINVAL, "pool: pin: pages is NULL");
	if (n == 1) { /* attention's in-place pages, one at a time: resident, no scratch */
		pthread_mutex_lock(&pool->lock);
		const int resident = pool_page_live(pool, pages[0]) && pool->page_frame[pages[0]] != KVR_POOL_NO_PAGE;
		if (resident)
			pool_pin_locked(pool, pages[0]);
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
		return pool_fail(pool, -ENOMEM, "pool: pin: out of memory");
	}
	pthread_mutex_lock(&pool->lock);
	int err = check_live(pool, pages, NULL, n, "pin");
	/* Resident pages first, so that taking frames for the rest cannot evict
	 * them; a page is pinned as soon as it has its frame. */
	for (uint32_t i = 0; i < n && !err; i++)
		if (pool->page_frame[pages[i]] != KVR_POOL_NO_PAGE)
			pool_pin_locked(pool, pages[i]), mine[i] = 1;
	uint32_t n_fetch = 0;
	for (uint32_t i = 0; i < n && !err; i++) {
		if (mine[i])
			continue;
		const uint32_t id = pages[i];
		if (pool->page_frame[id] == KVR_POOL_NO_PAGE) { /* not fetched earlier in this call */
			err = pool_frame_take(pool, id);
			if (err)
				break;
			fetch[n_fetch++] = id;
		}
		pool_pin_locked(pool, id), mine[i] = 1;
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
			err = pool_fail(pool, e, "pool: pin: %s", why);
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
				pool_unpin_locked(pool, pages[i]);
		for (uint32_t k = 0; k < n_fetch; k++) {
			pool_frame_release(pool, fetch[k]);
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
		return pool_fail(pool, -EINVAL, "pool: unpin: pages is NULL");
	pthread_mutex_lock(&pool->lock);
	int err = check_live(pool, pages, NULL, n, "unpin");
	uint32_t done = 0;
	for (; done < n && !err; done++) {
		if (!pool->pins[pages[done]]) {
			err = pool_fail(pool, -EINVAL, "pool: unpin: page %u is not pinned", pages[done]);
			break;
		}
		pool_unpin_locked(pool, pages[done]);
	}
	if (err) /* nothing changed: put back what this call took */
		while (done--)
			pool_pin_locked(pool, pages[done]);
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
		if (pool_page_live(pool, pages[i]) && pool->pins[pages[i]])
			pool_unpin_locked(pool, pages[i]);
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
	int r = !pool_page_live(pool, page_id)
			? pool_fail(pool, -EINVAL, "pool: page %u is not allocated", page_id)
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
		return pool_fail(pool, -EINVAL, "pool: read_runs: pages, heads or dst is NULL");
	if (pool->params.layout != KVR_POOL_LAYOUT_HND)
		return pool_fail(pool, -EINVAL, "pool: read_runs: needs the HND layout");
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
		return pool_fail(pool, -ENOMEM, "pool: read_runs: out of memory");
	}
	uint32_t n_file = 0;
	for (uint32_t i = 0; i < n; i++) {
		const uint32_t id = pages[i];
		pool_pin_locked(pool, id);
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
		pool_unpin_locked(pool, pages[i]);
	if (ferr) {
		pool->spill_errors++;
		err = pool_fail(pool, ferr, "pool: read_runs: %s", why);
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
	const uint32_t slot = pool->spill && pool_page_live(pool, page_id) ? pool->page_slot[page_id]
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
