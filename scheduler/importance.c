/* SPDX-License-Identifier: MIT */
/*
 * importance.c — the mixed page format's policy (kv_format = mixed): which
 * pages become K4V2, judged by the attention they actually received.
 *
 * Every page is written K8V4. While a page is in a sparse lane's window it is
 * attended at every step, so each step's attention tells how much of it the
 * page got: the attention kernel reports each segment's log-sum-exp
 * (KVR_SHAPE_SEGMENT_LSE), and a window page's share of a query head's
 * attention is exp(lse_page − log Σ_segments exp(lse)). The lane sums these
 * shares, averaged over the query heads of every KV head, for each page over
 * its window residence (W steps). At the last step before a page leaves the
 * window — before any selection can name it, so no slot ever holds a copy in
 * the old format — the lane compares its mean share with those of the last
 * RING pages it judged: below their median it is demoted to K4V2 in place
 * (kvr_pool_demote), so about half of the judged pages end up K4V2. Sink
 * pages, prefill's pages (never in a decode window) and pages shared with a
 * fork stay K8V4. A selection score would only rank pages by one step's
 * estimate; retrieval exists to bring back pages that looked unimportant
 * once, so the decision waits for W steps of real attention.
 *
 * Threads: the engine's thread, inside kvr_sched_decode_layer, on lanes it
 * has acquired (no controller job in flight). The lse buffer is mapped
 * memory the attention kernel writes; it is read after the lane's attn_done.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../layouts/base/fault.h"
#include "sched_impl.h"

enum { RING = 64, RING_MIN = 4 }; /* judged pages kept before any is demoted */

struct lane_importance {
	float *lse;       /* mapped: [n_kv][G · stride], item m's segment_lse */
	size_t lse_bytes;
	uint32_t stride;  /* segments an item may have (sparse: B/p + 1; grown for
	                     the dense path of mode dense, every page) */
	uint32_t pending; /* the lane's latest attention wrote lse, not yet summed */
	uint32_t win_page, n_win; /* its window pages: [win_page, +n_win) */
	uint32_t *n_segs, *win_seg; /* [n_kv]: its items' segment counts, first window segment */
	double *mass;     /* [cap]: summed shares per logical page */
	uint32_t *obs;    /* [cap]: steps summed */
	uint32_t cap;
	uint32_t judged;  /* pages below this were judged (or are sinks) */
	float ring[RING]; /* mean shares of the last pages judged */
	uint32_t ring_n, ring_at;
};

int kvr_importance_enabled(const struct kvr_sched *s, uint32_t layer)
{
	/* every layer but the dense layers (whose pages never leave the device);
	 * mode dense too, so that quantisation can be measured without selection */
	return s->kv_format == KVR_KV_MIXED && !(s->c.dense_layers[layer / 64] >> (layer % 64) & 1);
}

int kvr_importance_lane_open(struct kvr_sched *s, struct kvr_lane *lane)
{
	if (!kvr_importance_enabled(s, lane->layer))
		return 0;
	struct lane_importance *im = kvr_calloc(1, sizeof(*im));
	if (!im)
		return -ENOMEM;
	lane->imp = im;
	im->stride = s->c.budget_tokens / s->c.page_tokens + 1;
	im->n_segs = kvr_calloc(s->c.n_kv_heads, sizeof(uint32_t));
	im->win_seg = kvr_calloc(s->c.n_kv_heads, sizeof(uint32_t));
	if (!im->n_segs || !im->win_seg)
		return -ENOMEM;
	return kvr_mapped_grow(s->dev, (void **)&im->lse, &im->lse_bytes,
				     (size_t)s->c.n_kv_heads * s->G * im->stride * sizeof(float));
}

void kvr_importance_lane_free(struct kvr_sched *s, struct kvr_lane *lane)
{
	struct lane_importance *im = lane->imp;
	if (!im)
		return;
	kvr_mapped_free(s->dev, im->lse); /* kvr_mapped_grow's buffer */
	free(im->n_segs), free(im->win_seg), free(im->mass), free(im->obs);
	free(im);
	lane->imp = NULL;
}

void kvr_importance_lane_forget(struct kvr_sched *s, struct kvr_lane *lane)
{
	struct lane_importance *im = lane->imp;
	if (!im)
		return;
	im->pending = 0;
	im->judged = s->c.sink_tokens / s->c.page_tokens;
	im->ring_n = im->ring_at = 0;
	if (im->cap) {
		memset(im->mass, 0, im->cap * sizeof(*im->mass));
		memset(im->obs, 0, im->cap * sizeof(*im->obs));
	}
}

float *kvr_importance_item(struct kvr_sched *s, struct kvr_lane *lane, uint32_t m, uint64_t n_tokens,
			   uint32_t n_segs)
{
	struct lane_importance *im = lane->imp;
	if (!im)
		return NULL;
	const uint32_t p = s->c.page_tokens, sink = s->c.sink_tokens / p;
	const uint32_t n_full = (uint32_t)(n_tokens / p), tail = n_tokens % p != 0;
	/* every head's item has at most n_full + 1 segments, and k more when
	 * selected K8V4 pages are read as halves (mixed pages, step.c) */
	const uint32_t max_segs = n_full + 1 + (s->units_per_slot > 1 ? s->k : 0);
	if (m == 0 && max_segs > im->stride) {
		/* grown before head 0's item, so no item of this step points at the
		 * old buffer (the previous step's was harvested before this one's
		 * items) */
		const uint32_t stride = (max_segs + 63) & ~63u;
		if (kvr_mapped_grow(s->dev, (void **)&im->lse, &im->lse_bytes,
					  (size_t)s->c.n_kv_heads * s->G * stride * sizeof(float)))
			return NULL;
		im->stride = stride;
	}
	if (n_segs > im->stride)
		return NULL;
	const uint32_t wf = kvr_window_first(&s->c, n_tokens);
	const uint32_t first = wf > sink ? wf : sink;
	im->win_page = first;
	im->n_win = n_full > first ? n_full - first : 0;
	im->n_segs[m] = n_segs;
	im->win_seg[m] = n_segs - im->n_win - tail; /* window pages, then the tail, end the list */
	im->pending = 1;
	return im->lse + (uint64_t)m * s->G * im->stride;
}

/* Room for logical page `page` in the per-page sums. */
static int ensure_pages(struct lane_importance *im, uint32_t page)
{
	if (page < im->cap)
		return 0;
	uint32_t cap = im->cap ? im->cap : 64;
	while (cap <= page)
		cap *= 2;
	double *mass = kvr_realloc(im->mass, cap * sizeof(*mass));
	if (!mass)
		return -ENOMEM;
	im->mass = mass;
	uint32_t *obs = kvr_realloc(im->obs, cap * sizeof(*obs));
	if (!obs)
		return -ENOMEM;
	im->obs = obs;
	memset(im->mass + im->cap, 0, (cap - im->cap) * sizeof(*mass));
	memset(im->obs + im->cap, 0, (cap - im->cap) * sizeof(*obs));
	im->cap = cap;
	return 0;
}

void kvr_importance_harvest(struct kvr_sched *s, struct kvr_lane *lane)
{
	struct lane_importance *im = lane->imp;
	if (!im || !im->pending)
		return;
	im->pending = 0;
	if (!im->n_win || ensure_pages(im, im->win_page + im->n_win - 1))
		return;
	/* the attention that wrote lse; usually long complete */
	kvr_sched_wait_event(s, lane->attn_done, lane->seq, lane->layer, "wait attention's lse");
	const uint32_t G = s->G, n_kv = s->c.n_kv_heads;
	for (uint32_t m = 0; m < n_kv; m++) {
		const float *base = im->lse + (uint64_t)m * G * im->stride;
		const uint32_t ns = im->n_segs[m];
		for (uint32_t g = 0; g < G; g++) {
			const float *l = base + (uint64_t)g * ns;
			float top = -INFINITY;
			for (uint32_t j = 0; j < ns; j++)
				top = l[j] > top ? l[j] : top;
			if (!isfinite(top))
				continue; /* NaN or nothing attended: no information */
			double total = 0.0;
			for (uint32_t j = 0; j < ns; j++)
				total += exp((double)l[j] - top);
			for (uint32_t w = 0; w < im->n_win; w++)
				im->mass[im->win_page + w] +=
					exp((double)l[im->win_seg[m] + w] - top) / total / (G * n_kv);
		}
	}
	for (uint32_t w = 0; w < im->n_win; w++)
		im->obs[im->win_page + w]++;
}

static int cmp_float(const void *a, const void *b)
{
	const float x = *(const float *)a, y = *(const float *)b;
	return (x > y) - (x < y);
}

void kvr_importance_judge(struct kvr_sched *s, struct kvr_lane *lane, uint64_t n_tokens)
{
	struct lane_importance *im = lane->imp;
	if (!im)
		return;
	/* the window at the next step, one token on: pages below it become
	 * candidates for the selection posted after this step */
	const uint32_t next_first = kvr_window_first(&s->c, n_tokens + 1);
	if (next_first <= im->judged)
		return;
	kvr_importance_harvest(s, lane); /* this step's attention counts too */
	/* nothing may read the pages while they are rewritten: this lane's
	 * attention has run (harvest) and its recalls have landed */
	if (s->recall == KVR_RECALL_STREAMED)
		kvr_sched_wait_event(s, lane->recall_done, lane->seq, lane->layer, "wait recall (demotion)");
	for (uint32_t j = im->judged; j < next_first; j++) {
		if (j >= im->cap || !im->obs[j])
			continue; /* prefill's pages: never observed in a window */
		const float share = (float)(im->mass[j] / im->obs[j]);
		int demote = 0;
		if (im->ring_n >= RING_MIN) {
			float sorted[RING];
			memcpy(sorted, im->ring, im->ring_n * sizeof(float));
			qsort(sorted, im->ring_n, sizeof(float), cmp_float);
			demote = share < sorted[im->ring_n / 2];
		}
		im->ring[im->ring_at] = share;
		im->ring_at = (im->ring_at + 1) % RING;
		im->ring_n += im->ring_n < RING;
		count(s, lane->seq, KVR_C_PAGES_JUDGED, 1);
		uint32_t id;
		if (!demote || kvr_pool_lookup(s->pool, lane->seq, lane->layer, j, &id))
			continue;
		if (!kvr_pool_demote(s->pool, id))
			count(s, lane->seq, KVR_C_PAGES_DEMOTED, 1);
	}
	im->judged = next_first;
}
