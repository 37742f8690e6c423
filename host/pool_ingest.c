/* SPDX-License-Identifier: MIT */
/*
 * pool_ingest.c — what goes into pages: whole pages written (with their
 * summaries), tokens ingested into a sequence's tail tile and offloaded as
 * pages fill, demotion of mixed pools' pages to K4V2, and gathers of a
 * page's runs for readers.
 *
 * Threads: the writer of a sequence (pool.h); the pool's lock around the
 * table and allocator changes, page memory written by its owner without it.
 */
#include "pool_impl.h"

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
	for (uint32_t h = 0; h < g->n_kv_heads; h++) {
		const uint64_t col = (uint64_t)h * g->head_dim * eb;
		kvr_summarize_keys(g, (const unsigned char *)k_rows + col, row_stride,
				   summary + kvr_summary_index(g, h, KVR_SUMMARY_MIN, 0) * eb,
				   summary + kvr_summary_index(g, h, KVR_SUMMARY_MAX, 0) * eb);
		if (pool->params.keep_summaries == KVR_POOL_SUMMARIES_ESTIMATES)
			kvr_summarize_means(g, (const unsigned char *)k_rows + col,
					    (const unsigned char *)v_rows + col, row_stride,
					    summary + kvr_summary_index(g, h, KVR_SUMMARY_KEY_MEAN, 0) * eb,
					    summary + kvr_summary_index(g, h, KVR_SUMMARY_VALUE_MEAN, 0) * eb);
	}
}

/* Lock held. The page a write to (t, logical) may fill: copy-on-write when it
 * is shared with a fork. Outputs the address and the summary slot. */
static int page_for_write(struct kvr_pool *pool, struct layer_table *t, uint32_t logical,
			  unsigned char **page, unsigned char **summary, uint32_t *id_out, bool filling)
{
	uint32_t id = t->pages[logical];
	if (pool->refcount[id] > 1) {
		uint32_t fresh = 0; /* set by page_alloc_locked on success */
		int err = pool_page_alloc_locked(pool, &fresh);
		/* with a spill tier the copy needs a frame too, before the table
		 * changes: a failure leaves the shared page where it was */
		if (!err && pool->spill && filling && (err = pool_frame_take(pool, fresh)))
			pool_page_unref_locked(pool, fresh);
		if (err)
			return err;
		pool_page_unref_locked(pool, id);
		t->pages[logical] = id = fresh;
	}
	if (pool->spill && filling) {
		/* the whole page is about to be written: a frame (its old bytes,
		 * in RAM or in the file, are not needed), its file copy stale, and
		 * a pin until the fill is done so eviction leaves it alone */
		if (pool->page_frame[id] == KVR_POOL_NO_PAGE) {
			int err = pool_frame_take(pool, id);
			if (err)
				return err;
		}
		pool_slot_drop(pool, id);
		pool_pin_locked(pool, id);
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
	int err = pool_table_page_get(pool, seq, layer, logical, &t);
	if (!err && (!k_rows || !v_rows))
		err = pool_fail(pool, -EINVAL, "pool: keys or values are NULL");
	if (!err && row_stride < (uint64_t)pool->g.n_kv_heads * pool->g.head_dim)
		err = pool_fail(pool, -EINVAL, "pool: row stride %llu is below n_kv x d = %u",
			        (unsigned long long)row_stride, pool->g.n_kv_heads * pool->g.head_dim);
	if (!err && row_stride > UINT32_MAX)
		err = pool_fail(pool, -EINVAL, "pool: row stride %llu exceeds 32 bits",
			        (unsigned long long)row_stride);
	if (!err)
		err = page_for_write(pool, t, logical, &page, &summary, &id, true);
	pthread_mutex_unlock(&pool->lock);
	if (err)
		return err;
	page_fill(pool, id, page, summary, k_rows, v_rows, row_stride);
	if (pool->spill) {
		pthread_mutex_lock(&pool->lock);
		pool_unpin_locked(pool, id);
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
		err = pool_fail(pool, -EINVAL, "pool: demote: pages are not mixed (format %u)",
			        pool->params.kv_format);
	else if (!pool_page_live(pool, page_id))
		err = pool_fail(pool, -EINVAL, "pool: demote: page %u is not live", page_id);
	else if (pool->refcount[page_id] > 1)
		err = pool_fail(pool, -EBUSY, "pool: demote: page %u is shared by %u references", page_id,
			        pool->refcount[page_id]);
	else if (pool->spill && pool->page_frame[page_id] == KVR_POOL_NO_PAGE)
		err = pool_fail(pool, -EAGAIN, "pool: demote: page %u is in the spill file", page_id);
	else if (pool->spill && pool->pins[page_id])
		err = pool_fail(pool, -EBUSY, "pool: demote: page %u is pinned by a reader", page_id);
	const bool k4 = !err && pool->page_format[page_id] == KVR_KV_K4V2;
	if (!err && !k4 && pool->spill)
		pool_pin_locked(pool, page_id); /* no eviction while it is rewritten */
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
			pool_unpin_locked(pool, page_id);
			pthread_mutex_unlock(&pool->lock);
		}
		return pool_fail(pool, -ENOMEM, "pool: demote: out of memory");
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
		pool_slot_drop(pool, page_id); /* the file's copy is the K8V4 page */
		pool_unpin_locked(pool, page_id);
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


/* ------------------------------------------------------------------ ingest */

/* A write of the ingestion failed (spill tier: no frame, or the eviction's
 * write failed): the pages it reserved go, so the table is as before the
 * call (its tail rows past `len` in the caller's tile do not matter). */
static int ingest_undo(struct kvr_pool *pool, struct layer_table *t, uint64_t len, int err)
{
	const uint64_t p = pool->g.page_tokens;
	pthread_mutex_lock(&pool->lock);
	pool_table_shrink(pool, t, (uint32_t)((len + p - 1) / p));
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
	int err = pool_table_get(pool, seq, layer, &t);
	if (!err && first_position != t->n_tokens)
		err = pool_fail(pool, -EINVAL,
			        "sequence %u layer %u: tokens must arrive in order: expected "
			        "position %llu, got %llu",
			        seq, layer, (unsigned long long)t->n_tokens,
			        (unsigned long long)first_position);
	if (!err && n_tokens && (!keys || !values || !tail || !tail->keys || !tail->values))
		err = pool_fail(pool, -EINVAL, "pool: keys, values or the tail tile are NULL");
	const uint64_t len = err ? 0 : t->n_tokens;
	if (!err && n_tokens) {
		/* A page is reserved when a tail page starts: every page the new tokens
		 * open, up front, so -ENOMEM leaves everything as it was. */
		const uint64_t pages_after = (len + n_tokens + p - 1) / p;
		const uint32_t before = t->n_pages;
		err = pages_after < before /* cannot happen: a table holds ceil(len / p) pages */
			      ? pool_fail(pool, -EFAULT, "pool: sequence %u layer %u: %u pages for %llu tokens",
				          seq, layer, before, (unsigned long long)len)
			      : pool_reserve_locked(pool, t, (uint32_t)(pages_after - before));
		/* The partial page the tail will complete may be shared with a fork:
		 * give this sequence its own now (its old contents are all in the
		 * tail tile), so nothing below can fail. */
		unsigned char *unused_page, *unused_summary;
		uint32_t unused_id;
		if (!err && len % p) {
			err = page_for_write(pool, t, (uint32_t)(len / p), &unused_page,
					     &unused_summary, &unused_id, false);
			if (err)
				pool_table_shrink(pool, t, before);
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

int kvr_pool_append_token(struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint64_t position,
			  struct kvr_pool_fill *fill)
{
	const uint64_t p = pool->g.page_tokens;
	struct layer_table *t = NULL; /* set by table_get on success */
	*fill = (struct kvr_pool_fill){ NULL, NULL, 0, 0 };
	pthread_mutex_lock(&pool->lock);
	int err = pool_table_get(pool, seq, layer, &t);
	if (!err && pool->params.kv_format == KVR_KV_MIXED)
		err = pool_fail(pool, -EINVAL, "pool: append_token: mixed pages are judged and demoted on the host");
	if (!err && position != t->n_tokens)
		err = pool_fail(pool, -EINVAL,
			        "sequence %u layer %u: tokens must arrive in order: expected "
			        "position %llu, got %llu",
			        seq, layer, (unsigned long long)t->n_tokens, (unsigned long long)position);
	if (err) {
		pthread_mutex_unlock(&pool->lock);
		return err;
	}
	const uint64_t len = t->n_tokens;
	const uint32_t before = t->n_pages;
	/* the page this token starts, reserved up front (kvr_pool_ingest) */
	err = len % p ? 0 : pool_reserve_locked(pool, t, 1);
	unsigned char *page = NULL, *summary = NULL;
	uint32_t id = 0;
	if (!err && len % p && (len + 1) % p) /* a shared partial page: this sequence's own */
		err = page_for_write(pool, t, (uint32_t)(len / p), &page, &summary, &id, false);
	if (!err && (len + 1) % p == 0) { /* the token completes the page: its fill */
		err = page_for_write(pool, t, (uint32_t)(len / p), &page, &summary, &id, true);
		if (!err)
			*fill = (struct kvr_pool_fill){ page, summary, id, 0 };
	}
	if (err)
		pool_table_shrink(pool, t, before);
	else
		t->n_tokens = len + 1;
	pthread_mutex_unlock(&pool->lock);
	return err;
}
