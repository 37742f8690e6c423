/* SPDX-License-Identifier: MIT */
/*
 * resident.c — on a device with memory of its own (cuda), device copies of the pages
 * every step attends: each sparse lane's sink and window pages, and every page
 * of a dense layer (docs/design.md, "Glossary": dense layers). Without them
 * attention would read those pages from the pinned pool over the bus at every
 * step — S + W tokens per KV head and layer, the largest share of the step.
 *
 * A lane's resident pages are HND pages (the pool's bytes, copied whole), in
 * device chunks of RES_CHUNK_PAGES pages. Slot of logical page j: a dense
 * layer, j; a sparse layer, j for a sink page and S/p + j mod (W/p) for a
 * window page (a ring: the page entering the window takes the slot of the one
 * leaving it). A page is copied the first time a step attends it — so the
 * pages prefill wrote, a fork's pages and the pages after a truncate all come
 * in lazily, one full page per p decode steps afterwards. The copy is queued
 * on the compute stream before the attention that reads it, after every
 * earlier attention that read the slot's previous page.
 *
 * Pool layout NHD (an ablation) keeps reading the pool in place.
 *
 * Key summaries likewise (docs/design.md, "Glossary": summary): a lane's
 * selection scores every candidate page's summary, L/p of them, so reading
 * them over the bus would cost more than the attention. Each lane keeps a
 * device copy of its leading pages' summaries, extended before a selection by
 * one copy of the pages completed since the last one (grown by doubling;
 * summaries are written once, when a page completes, and a truncate
 * invalidates them).
 *
 * Threads: whoever holds the lane — the engine, or the controller while it
 * runs the lane's job (scheduler.h, lane ownership).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "../layouts/base/fault.h"
#include "sched_impl.h"

enum { RES_CHUNK_PAGES = 16 };

/* The one question resident.c asks the device. It is a policy (which pages
 * to keep near the kernels), not where a buffer may live (gpu/memory.h):
 * where the device addresses host memory at host speed, a copy buys
 * nothing. */
static int device_has_own_memory(const struct kvr_sched *s)
{
	return !kvr_dev_host_visible(s->dev);
}

static int lane_is_dense(const struct kvr_sched *s, uint32_t layer)
{
	return s->c.mode == KVR_MODE_DENSE || (s->c.dense_layers[layer / 64] >> (layer % 64) & 1);
}

int kvr_resident_enabled(const struct kvr_sched *s)
{
	return device_has_own_memory(s) && s->pool_layout == KVR_POOL_LAYOUT_HND;
}

uint64_t kvr_resident_lane_bytes(const struct kvr_config *c)
{
	const uint64_t page = kvr_kv_run_bytes(c->kv_format, c->page_tokens, c->head_dim,
					       kvr_elem_bytes(c->dtype)) * c->n_kv_heads;
	const uint64_t slots = (c->sink_tokens + c->window_tokens) / c->page_tokens;
	const uint64_t chunks = (slots + RES_CHUNK_PAGES - 1) / RES_CHUNK_PAGES;
	return chunks * RES_CHUNK_PAGES * page;
}

/* Make room for slot `slot`: chunks up to it and the held table. */
static int ensure_slot(struct kvr_sched *s, struct kvr_lane *lane, uint32_t slot)
{
	const uint32_t chunk = slot / RES_CHUNK_PAGES;
	if (chunk < lane->res_n_chunks)
		return 0;
	const uint32_t want = chunk + 1;
	if (want > lane->res_cap_chunks) {
		uint32_t cap = lane->res_cap_chunks ? lane->res_cap_chunks : 4;
		while (cap < want)
			cap *= 2;
		unsigned char **chunks = kvr_realloc(lane->res_chunks, cap * sizeof(*chunks));
		if (!chunks)
			return -ENOMEM;
		lane->res_chunks = chunks;
		int32_t *held = kvr_realloc(lane->res_held, (size_t)cap * RES_CHUNK_PAGES * sizeof(*held));
		if (!held)
			return -ENOMEM;
		for (size_t i = (size_t)lane->res_cap_chunks * RES_CHUNK_PAGES;
		     i < (size_t)cap * RES_CHUNK_PAGES; i++)
			held[i] = -1;
		lane->res_held = held;
		lane->res_cap_chunks = cap;
	}
	const uint64_t page_bytes = s->head_bytes * s->c.n_kv_heads;
	while (lane->res_n_chunks < want) {
		void *p = NULL;
		int err = kvr_dev_alloc(s->dev, RES_CHUNK_PAGES * page_bytes, &p);
		if (err)
			return err;
		lane->res_chunks[lane->res_n_chunks++] = p;
	}
	return 0;
}

int kvr_resident_lane_open(struct kvr_sched *s, struct kvr_lane *lane)
{
	if (!kvr_resident_enabled(s) || lane_is_dense(s, lane->layer))
		return 0; /* a dense layer's chunks come as it grows */
	const uint32_t slots = (s->c.sink_tokens + s->c.window_tokens) / s->c.page_tokens;
	return slots ? ensure_slot(s, lane, slots - 1) : 0;
}

void kvr_resident_lane_free(struct kvr_sched *s, struct kvr_lane *lane)
{
	for (uint32_t i = 0; i < lane->res_n_chunks; i++)
		kvr_dev_free(s->dev, lane->res_chunks[i]);
	free(lane->res_chunks);
	free(lane->res_held);
	kvr_dev_free(s->dev, lane->sum_dev);
	lane->sum_dev = NULL;
	lane->sum_valid = lane->sum_cap = 0;
	kvr_mapped_free(s->dev, lane->page_addr);
	lane->page_addr = NULL;
	lane->addr_valid = lane->addr_cap = 0;
	lane->res_chunks = NULL;
	lane->res_held = NULL;
	lane->res_n_chunks = lane->res_cap_chunks = 0;
}

void kvr_resident_lane_forget(struct kvr_lane *lane)
{
	lane->sum_valid = 0;
	lane->addr_valid = 0; /* a truncated page's logical index may get a new page */
	for (size_t i = 0; i < (size_t)lane->res_cap_chunks * RES_CHUNK_PAGES; i++)
		lane->res_held[i] = -1;
}

const unsigned char *kvr_resident_page(struct kvr_sched *s, struct kvr_lane *lane, uint32_t logical,
				       uint32_t page_id)
{
	if (!kvr_resident_enabled(s))
		return NULL;
	const uint32_t sink = s->c.sink_tokens / s->c.page_tokens;
	const uint32_t window = s->c.window_tokens / s->c.page_tokens;
	uint32_t slot;
	if (lane_is_dense(s, lane->layer))
		slot = logical;
	else if (logical < sink)
		slot = logical;
	else if (window)
		slot = sink + logical % window;
	else
		return NULL;
	/* a replay's page the graph writes later: only a copy already held */
	const int no_copy = logical >= s->eng.fixed.unwritten_from;
	if (no_copy ? slot / RES_CHUNK_PAGES >= lane->res_n_chunks : ensure_slot(s, lane, slot) != 0)
		return NULL; /* no slot (out of device memory): the pool page, over the bus */
	const uint64_t page_bytes = s->head_bytes * s->c.n_kv_heads;
	unsigned char *dst = lane->res_chunks[slot / RES_CHUNK_PAGES] +
			     (uint64_t)(slot % RES_CHUNK_PAGES) * page_bytes;
	if (lane->res_held[slot] != (int32_t)logical) {
		if (no_copy)
			return NULL;
		const void *src = kvr_pool_page_data(s->pool, page_id);
		if (!src || kvr_dev_memcpy_async(s->dev, dst, src, page_bytes, KVR_COPY_H2D, s->compute))
			return NULL;
		lane->res_held[slot] = (int32_t)logical;
	}
	return dst;
}

const void *kvr_resident_summaries(struct kvr_sched *s, struct kvr_lane *lane, uint32_t n_pages,
				   struct kvr_stream *stream)
{
	const void *host = kvr_pool_summary(s->pool, lane->seq, lane->layer, 0);
	if (!device_has_own_memory(s) || !host || !n_pages)
		return host;
	const uint64_t one = kvr_summary_page_elems(s->c.n_kv_heads, s->c.head_dim, s->estimates) * s->eb;
	if (n_pages > lane->sum_cap) {
		/* grow: the engine, inside a layer, frees the old copy at the
		 * step's end (a kernel it queued may still read it); the
		 * controller waits for its selection stream and frees it now */
		uint32_t cap = lane->sum_cap ? lane->sum_cap : 64;
		while (cap < n_pages)
			cap *= 2;
		void *p = NULL;
		if (kvr_dev_alloc(s->dev, cap * one, &p))
			return NULL;
		if (lane->sum_valid &&
		    kvr_dev_memcpy_async(s->dev, p, lane->sum_dev, lane->sum_valid * one, KVR_COPY_D2D,
					 stream)) {
			kvr_dev_free(s->dev, p);
			return NULL;
		}
		if (kvr_sched_in_layer(s)) {
			kvr_sched_defer_free(s, lane->sum_dev, 0);
		} else {
			kvr_sched_wait_stream(s, stream, lane->seq, lane->layer, "wait summaries' copy (grown)");
			kvr_dev_free(s->dev, lane->sum_dev);
		}
		lane->sum_dev = p;
		lane->sum_cap = cap;
	}
	if (n_pages > lane->sum_valid) {
		if (kvr_dev_memcpy_async(s->dev, (unsigned char *)lane->sum_dev + lane->sum_valid * one,
					 (const unsigned char *)host + lane->sum_valid * one,
					 (n_pages - lane->sum_valid) * one, KVR_COPY_H2D, stream))
			return NULL;
		lane->sum_valid = n_pages;
	}
	return lane->sum_dev;
}

const uint64_t *kvr_resident_page_addrs(struct kvr_sched *s, struct kvr_lane *lane, uint32_t n_pages)
{
	if (n_pages > lane->addr_cap) {
		/* grow by doubling; a plan kernel queued this step may still read
		 * the old table, freed at the step's end */
		uint32_t cap = lane->addr_cap ? lane->addr_cap : 256;
		while (cap < n_pages)
			cap *= 2;
		uint64_t *p = NULL;
		if (kvr_mapped_alloc(s->dev, (size_t)cap * sizeof(*p), (void **)&p))
			return NULL;
		if (lane->addr_valid)
			memcpy(p, lane->page_addr, (size_t)lane->addr_valid * sizeof(*p));
		if (lane->page_addr)
			kvr_sched_defer_free(s, lane->page_addr, 1);
		lane->page_addr = p;
		lane->addr_cap = cap;
	}
	/* full pages keep their page until a truncate (which resets
	 * addr_valid): only the pages completed since are looked up */
	for (uint32_t j = lane->addr_valid; j < n_pages; j++) {
		uint32_t id = 0;
		if (kvr_pool_lookup(s->pool, lane->seq, lane->layer, j, &id)) {
			lane->addr_valid = j; /* cannot happen: the caller asks for reserved pages */
			return NULL;
		}
		lane->page_addr[j] = (uint64_t)(uintptr_t)kvr_pool_page_data(s->pool, id);
	}
	if (n_pages > lane->addr_valid)
		lane->addr_valid = n_pages;
	return lane->page_addr;
}
