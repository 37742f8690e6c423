/* SPDX-License-Identifier: MIT */
/*
 * pool_tables.c — the sequences' page tables: per (sequence, layer) the
 * logical page -> page id map and the key summaries; open, close, fork
 * (pages shared by reference), reserve, truncate, and the lookups.
 *
 * Threads: any, under the pool's lock (pool_impl.h); summaries are read by
 * the scheduler outside it once the sequence's lanes are quiesced (pool.h).
 */
#include "pool_impl.h"

/* ------------------------------------------------------------------ tables */

/* Lock held. Resolve (seq, layer) to its table or fail with a message. */
int pool_table_get(struct kvr_pool *pool, uint32_t seq, uint32_t layer, struct layer_table **out)
{
	if (seq >= pool->params.max_sequences)
		return pool_fail(pool, -EINVAL, "pool: sequence id %u out of range (max_sequences %u)", seq,
			         pool->params.max_sequences);
	if (!pool->seqs[seq].open)
		return pool_fail(pool, -EINVAL, "pool: sequence %u is not open", seq);
	if (layer >= pool->params.n_layers)
		return pool_fail(pool, -EINVAL, "pool: layer %u out of range (n_layers %u)", layer,
			         pool->params.n_layers);
	*out = &pool->seqs[seq].layers[layer];
	return 0;
}

/* Lock held. pool_table_get, and `logical` must be one of its reserved pages. */
int pool_table_page_get(struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint32_t logical,
			struct layer_table **out)
{
	int err = pool_table_get(pool, seq, layer, out);
	if (!err && logical >= (*out)->n_pages)
		err = pool_fail(pool, -EINVAL,
			        "pool: logical page %u of sequence %u layer %u is not reserved (%u pages)",
			        logical, seq, layer, (*out)->n_pages);
	return err;
}

int kvr_pool_seq_open(struct kvr_pool *pool, uint32_t seq)
{
	int err = 0;
	pthread_mutex_lock(&pool->lock);
	if (seq >= pool->params.max_sequences) {
		err = pool_fail(pool, -EINVAL, "pool: sequence id %u out of range (max_sequences %u)", seq,
			        pool->params.max_sequences);
	} else if (pool->seqs[seq].open) {
		err = pool_fail(pool, -EEXIST, "pool: sequence %u is already open", seq);
	} else {
		struct layer_table *layers = kvr_calloc(pool->params.n_layers, sizeof(*layers));
		if (!layers) {
			err = pool_fail(pool, -ENOMEM, "pool: out of memory for sequence %u's tables", seq);
		} else {
			pool->seqs[seq].layers = layers;
			pool->seqs[seq].open = true;
		}
	}
	pthread_mutex_unlock(&pool->lock);
	return err;
}

/* Lock held. Drop every page beyond the first `keep` of a table. */
void pool_table_shrink(struct kvr_pool *pool, struct layer_table *t, uint32_t keep)
{
	while (t->n_pages > keep)
		pool_page_unref_locked(pool, t->pages[--t->n_pages]);
}

int kvr_pool_seq_close(struct kvr_pool *pool, uint32_t seq)
{
	int err = 0;
	pthread_mutex_lock(&pool->lock);
	if (seq >= pool->params.max_sequences || !pool->seqs[seq].open) {
		err = pool_fail(pool, -EINVAL, "pool: sequence %u is not open", seq);
	} else {
		for (uint32_t l = 0; l < pool->params.n_layers; l++) {
			struct layer_table *t = &pool->seqs[seq].layers[l];
			pool_table_shrink(pool, t, 0);
			pool->summary_bytes_held -= (uint64_t)t->cap * pool->summary_bytes;
			pool_table_free(pool, t);
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
		err = pool_fail(pool, -EINVAL, "pool: fork source %u is not an open sequence", src);
	} else {
		for (uint32_t l = 0; l < pool->params.n_layers && !err; l++) {
			const struct layer_table *from = &pool->seqs[src].layers[l];
			struct layer_table *to = &pool->seqs[dst].layers[l];
			err = table_grow(pool, to, from->n_pages);
			if (err)
				break;
			for (uint32_t i = 0; i < from->n_pages; i++) {
				if (pool->refcount[from->pages[i]] == UINT32_MAX) {
					err = pool_fail(pool, -EOVERFLOW, "pool: page %u has too many references",
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
		char message[sizeof(pool_thread_error)];
		memcpy(message, pool_thread_error, sizeof(message));
		pthread_mutex_unlock(&pool->lock);
		kvr_pool_seq_close(pool, dst);
		pthread_mutex_lock(&pool->lock);
		memcpy(pool_thread_error, message, sizeof(message));
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
		return pool_fail(pool, -ENOMEM,
			         "pool: capacity of %u pages exhausted (a table needs %llu)",
			         pool->capacity_pages, (unsigned long long)need);
	uint64_t cap = t->cap ? t->cap : 16;
	while (cap < need)
		cap *= 2;
	uint32_t *pages = kvr_realloc(t->pages, cap * sizeof(*pages));
	if (!pages)
		return pool_fail(pool, -ENOMEM, "pool: out of memory for a page table");
	t->pages = pages;
	if (pool->summary_bytes && !pool->params.register_fn) {
		unsigned char *s = kvr_realloc(t->summaries, cap * pool->summary_bytes);
		if (!s)
			return pool_fail(pool, -ENOMEM, "pool: out of memory for page summaries");
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
			return pool_fail(pool, -ENOMEM, "pool: out of memory for page summaries");
		memset(s, 0, bytes);
		int err = pool->params.register_fn(pool->params.register_user, s, bytes);
		if (err) {
			free(s);
			return pool_fail(pool, err, "pool: cannot register %zu bytes of page summaries "
					            "with the device (%d)",
				         bytes, err);
		}
		if (t->summaries)
			memcpy(s, t->summaries, (size_t)t->cap * pool->summary_bytes);
		pool_summaries_free(pool, t->summaries);
		t->summaries = s;
		pool->summary_bytes_held += (cap - t->cap) * pool->summary_bytes;
	}
	t->cap = (uint32_t)cap;
	return 0;
}

/* Lock held. All-or-nothing append. */
int pool_reserve_locked(struct kvr_pool *pool, struct layer_table *t, uint32_t n_pages)
{
	int err = table_grow(pool, t, (uint64_t)t->n_pages + n_pages);
	if (err)
		return err;
	const uint32_t before = t->n_pages;
	for (uint32_t i = 0; i < n_pages; i++) {
		uint32_t id = 0; /* set by page_alloc_locked on success */
		err = pool_page_alloc_locked(pool, &id);
		if (err) {
			pool_table_shrink(pool, t, before);
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
	int err = pool_table_get(pool, seq, layer, &t);
	if (!err)
		err = pool_reserve_locked(pool, t, n_pages);
	pthread_mutex_unlock(&pool->lock);
	return err;
}

int kvr_pool_truncate(struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint64_t n_tokens)
{
	struct layer_table *t = NULL; /* set by table_get on success */
	pthread_mutex_lock(&pool->lock);
	int err = pool_table_get(pool, seq, layer, &t);
	if (!err && n_tokens > t->n_tokens)
		err = pool_fail(pool, -EINVAL,
			        "pool: cannot truncate sequence %u layer %u to %llu tokens: it has %llu",
			        seq, layer, (unsigned long long)n_tokens, (unsigned long long)t->n_tokens);
	if (!err) {
		const uint64_t p = pool->g.page_tokens;
		pool_table_shrink(pool, t, (uint32_t)((n_tokens + p - 1) / p));
		t->n_tokens = n_tokens;
	}
	pthread_mutex_unlock(&pool->lock);
	return err;
}

/* A layer table's page and token counts, read under the lock (either may be NULL). */
static int table_counts(const struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint32_t *n_pages,
			uint64_t *n_tokens)
{
	struct kvr_pool *mpool = (struct kvr_pool *)pool; /* lock and message only */
	struct layer_table *t = NULL; /* set by table_get on success */
	pthread_mutex_lock(&mpool->lock);
	int err = pool_table_get(mpool, seq, layer, &t);
	if (!err && n_pages)
		*n_pages = t->n_pages;
	if (!err && n_tokens)
		*n_tokens = t->n_tokens;
	pthread_mutex_unlock(&mpool->lock);
	return err;
}

int kvr_pool_n_pages(const struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint32_t *n_pages)
{
	return table_counts(pool, seq, layer, n_pages, NULL);
}

int kvr_pool_n_tokens(const struct kvr_pool *pool, uint32_t seq, uint32_t layer,
		      uint64_t *n_tokens)
{
	return table_counts(pool, seq, layer, NULL, n_tokens);
}

int kvr_pool_lookup(const struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint32_t logical,
		    uint32_t *page_id)
{
	struct kvr_pool *mpool = (struct kvr_pool *)pool;
	struct layer_table *t = NULL; /* set by table_get on success */
	pthread_mutex_lock(&mpool->lock);
	int err = pool_table_page_get(mpool, seq, layer, logical, &t);
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
	if (!pool_table_get(mpool, seq, layer, &t) && logical < t->n_pages && t->summaries)
		s = t->summaries + (uint64_t)logical * pool->summary_bytes;
	pthread_mutex_unlock(&mpool->lock);
	return s;
}
