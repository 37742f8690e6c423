/* SPDX-License-Identifier: MIT */
/*
 * pool_pages.c — page ids and refcounts: allocation from the free stack or
 * the high-water mark, references shared by forks, release when the last
 * goes (and, with a spill tier, the page's frame and slot with it).
 *
 * Threads: any, under the pool's lock (pool_impl.h).
 */
#include "pool_impl.h"

/* Lock held. */
int pool_page_alloc_locked(struct kvr_pool *pool, uint32_t *id_out)
{
	uint32_t id;
	if (pool->n_free) {
		id = pool->free_stack[--pool->n_free];
	} else {
		if (pool->high_water >= pool->capacity_pages)
			return pool_fail(pool, -ENOMEM,
				         "pool: capacity of %u pages (%llu bytes) exhausted",
				         pool->capacity_pages,
				         (unsigned long long)pool->capacity_pages * pool->page_bytes);
		id = pool->high_water;
		const uint32_t c = id / pool->pages_per_chunk;
		if (!pool->spill && !pool->chunks[c]) { /* with a spill tier, frames come at write */
			int err = pool_chunk_map(pool, c);
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

bool pool_page_live(const struct kvr_pool *pool, uint32_t id)
{
	return id < pool->high_water && pool->refcount[id] > 0;
}

/* Lock held; id must be live. */
void pool_page_unref_locked(struct kvr_pool *pool, uint32_t id)
{
	if (--pool->refcount[id] == 0) {
		if (pool->spill) {
			if (pool->page_frame[id] != KVR_POOL_NO_PAGE)
				pool_frame_release(pool, id);
			else if (pool->page_slot[id] != KVR_SPILL_NO_SLOT)
				pool->spilled_pages--;
			pool_slot_drop(pool, id);
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
	int err = pool_page_alloc_locked(pool, page_id);
	pthread_mutex_unlock(&pool->lock);
	return err;
}

int kvr_pool_page_ref(struct kvr_pool *pool, uint32_t page_id)
{
	int err = 0;
	pthread_mutex_lock(&pool->lock);
	if (!pool_page_live(pool, page_id))
		err = pool_fail(pool, -EINVAL, "pool: page %u is not allocated", page_id);
	else if (pool->refcount[page_id] == UINT32_MAX)
		err = pool_fail(pool, -EOVERFLOW, "pool: page %u has too many references", page_id);
	else
		pool->refcount[page_id]++;
	pthread_mutex_unlock(&pool->lock);
	return err;
}

int kvr_pool_page_unref(struct kvr_pool *pool, uint32_t page_id)
{
	int err = 0;
	pthread_mutex_lock(&pool->lock);
	if (!pool_page_live(pool, page_id))
		err = pool_fail(pool, -EINVAL, "pool: page %u is not allocated (double free?)", page_id);
	else
		pool_page_unref_locked(pool, page_id);
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
