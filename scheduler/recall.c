/* SPDX-License-Identifier: MIT */
/*
 * recall.c — the device page cache and double-buffered streamed recall.
 *
 * Each sparse lane owns k slot tiles (NHD, p rows of n_kv·d for keys and for
 * values): slot (m, j) is column m of tile j and holds one page of KV head m,
 * as `slot_page[m][j]` records. A recall plan for head m keeps the slots whose
 * page is still selected (hits) and puts each newly selected page (a miss)
 * into a slot whose page is no longer wanted; only misses move.
 *
 * Misses move in chunks of `chunk_pages` HND runs through two staging
 * buffers: the copy stream copies chunk c from the pool into staging buffer
 * c % 2 while the convert stream scatters chunk c − 1 from the other buffer
 * into its slots (HND → NHD). Each buffer has two events: `staged` (copy done,
 * the scatter may read) and `drained` (scatter done, the next copy may
 * overwrite). Before the first scatter of a lane the convert stream waits for
 * the lane's `attn_done`: the attention that last read these slots must have
 * finished, so a deferred recall never writes a slot an attention is reading.
 * After the last scatter it records the lane's `recall_done`, which the next
 * attention of the lane waits for, so no attention reads a partial recall.
 * recall_buffers = 1 keeps one buffer (copy and scatter serialised) for the
 * ablation.
 *
 * Quantised pages (kv_format K8V4, K4V2, mixed) stay quantised in the slots:
 * slot (m, j) is a unit of the device page cache shared by all lanes
 * (units.c), holding one quantised run (kvquant.h), taken the first time a
 * page lands there; attention dequantises on the fly. With no layout to
 * convert, misses are copied from the pool straight into their units on the
 * copy stream (after the lane's attn_done, before its recall_done): no
 * staging buffers.
 *
 * The device plan (step.c) plans the same slot tables on the device, at
 * the engine's step in stream order, and moves its misses itself (one
 * scatter reading the pinned pool), and the engine never posts an urgent
 * recall. The controller's recall for the next step is then a prefetch on
 * its own stream (kvr_recall_prefetch_batch, for the lanes whose
 * selections it runs together): the plan kernel plans the slots of each
 * lane's selection (its segments NULL) and one scatter moves the misses
 * from the pinned pool, after the step's attention (attn_done, waited for
 * before the selection) and before the lanes' sel_done, which the next
 * step's plan waits for on the device. The host reads nothing: the counts
 * are tallied once sel_done is known complete (the lane's next job, or
 * kvr_recall_prefetch_settle).
 *
 * Threads: kvr_recall_issue and kvr_recall_prefetch_batch run on the controller
 * thread (kvr_recall_prefetch_settle on whichever thread holds the lane). Staging-buffer
 * reuse is ordered on the streams by the `drained` events, so the controller
 * does not wait for buffers; it waits only, before rewriting a lane's own
 * scatter items and slot table, for that lane's previous recall when it is
 * still running (rare: an urgent recall right after a deferred one). The
 * streams run the work.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../layouts/base/fault.h"
#include "sched_impl.h"

struct miss {
	uint32_t page_id; /* pool page */
	uint32_t head;
	uint32_t slot;
	uint32_t units;   /* quantised: device page cache units its page takes */
};

uint64_t kvr_sched_seq_device_bytes(const struct kvr_config *c, uint32_t recall)
{
	if (recall != KVR_RECALL_STREAMED)
		return 0;
	if (c->kv_format) /* the units of the shared device page cache (units.c) */
		return kvr_units_seq_count(c) * kvr_units_unit_bytes(c);
	const uint64_t k = (c->budget_tokens - c->sink_tokens - c->window_tokens) / c->page_tokens;
	const uint64_t run = kvr_kv_run_bytes(c->kv_format, c->page_tokens, c->head_dim,
					      kvr_elem_bytes(c->dtype));
	uint32_t sparse_layers = 0;
	for (uint32_t l = 0; l < c->n_layers; l++)
		sparse_layers += !(c->dense_layers[l / 64] >> (l % 64) & 1);
	/* K and V tiles (n_kv runs' worth) and the scatter items */
	return (run + sizeof(struct kvr_scatter_item)) * c->n_kv_heads * k * sparse_layers;
}

uint64_t kvr_sched_fixed_device_bytes(const struct kvr_config *c, uint32_t recall)
{
	if (recall != KVR_RECALL_STREAMED)
		return 0;
	if (c->kv_format) /* no staging (nothing to convert); the units' ring */
		return kvr_units_fixed_bytes(c);
	const uint64_t head = 2ull * c->page_tokens * c->head_dim * kvr_elem_bytes(c->dtype);
	return (uint64_t)c->recall_buffers * c->recall_chunk_pages * head;
}

int kvr_recall_setup(struct kvr_sched *s, char *err, size_t err_bytes)
{
	if (s->recall != KVR_RECALL_STREAMED)
		return 0;
	int ret = kvr_dev_stream_create(s->dev, KVR_STREAM_WORKER, &s->copy);
	if (!ret)
		ret = kvr_dev_stream_create(s->dev, KVR_STREAM_WORKER, &s->convert);
	/* quantised pages are copied straight into their slots: no staging */
	s->rec.n_staging = s->kv_format ? 0 : s->c.recall_buffers;
	s->rec.chunk_pages = s->c.recall_chunk_pages;
	/* mixed pages: a K8V4 page moves as two halves of four pieces each */
	const size_t descs_per_page = s->units_per_slot > 1 ? 8 : 1;
	if (!ret && !(s->rec.recall_descs = kvr_malloc(s->rec.chunk_pages * descs_per_page * sizeof(struct kvr_copy_desc))))
		ret = -ENOMEM;
	for (uint32_t b = 0; !ret && b < s->rec.n_staging; b++) {
		struct staging *st = &s->rec.staging[b];
		ret = kvr_dev_alloc(s->dev, s->rec.chunk_pages * s->head_bytes, (void **)&st->runs);
		if (!ret)
			ret = kvr_dev_event_create(s->dev, &st->staged);
		if (!ret)
			ret = kvr_dev_event_create(s->dev, &st->drained);
	}
	s->spill = kvr_pool_spill_file(s->pool) != NULL;
	/* plain pages on a device that reads host memory are read straight into
	 * the staging buffers; everything else goes through the bounces */
	s->spill_direct = s->spill && !s->kv_format && kvr_dev_host_visible(s->dev);
	for (uint32_t b = 0; !ret && s->spill && !s->spill_direct && b < 2; b++) {
		/* the spill tier's bounces: runs read from RAM or the file land
		 * here, registered so the copy to the device can be asynchronous */
		const size_t bytes = ((size_t)s->rec.chunk_pages * s->head_bytes + 4095) & ~(size_t)4095;
		if (posix_memalign((void **)&s->rec.bounce[b], 4096, bytes)) {
			s->rec.bounce[b] = NULL;
			snprintf(err, err_bytes, "recall: out of memory for the spill tier's bounce");
			return -ENOMEM;
		}
		ret = kvr_dev_host_register(s->dev, s->rec.bounce[b], bytes);
		if (ret == -ENODEV || ret == -ENOTSUP || ret == -EOPNOTSUPP)
			ret = 0; /* host memory the device reads as is */
		if (!ret)
			ret = kvr_dev_event_create(s->dev, &s->rec.bounce_done[b]);
	}
	if (!ret && s->spill) {
		s->rec.bounce_pages = kvr_malloc(s->rec.chunk_pages * sizeof(uint32_t));
		s->rec.bounce_heads = kvr_malloc(s->rec.chunk_pages * sizeof(uint32_t));
		if (!s->rec.bounce_pages || !s->rec.bounce_heads)
			ret = -ENOMEM;
	}
	if (ret) {
		snprintf(err, err_bytes, "recall: %s", kvr_dev_last_error(s->dev));
		return ret;
	}
	const size_t n_miss = (size_t)(s->k ? s->k : 1) * (s->kv_format ? s->c.n_kv_heads : 1);
	s->rec.recall_misses = kvr_malloc(n_miss * sizeof(struct miss));
	if (s->kv_format) {
		s->rec.recall_need = kvr_malloc(s->c.n_kv_heads * sizeof(uint32_t));
		s->rec.recall_unit_slots = kvr_malloc(n_miss * 2 * sizeof(uint32_t));
		s->rec.recall_release = kvr_malloc(s->c.n_kv_heads * sizeof(uint32_t));
		s->rec.recall_release_slots = kvr_malloc(n_miss * sizeof(uint32_t));
		if (!s->rec.recall_need || !s->rec.recall_unit_slots || !s->rec.recall_release || !s->rec.recall_release_slots) {
			snprintf(err, err_bytes, "recall: out of memory");
			return -ENOMEM;
		}
	}
	s->rec.recall_flags = kvr_malloc(2 * (s->k ? s->k : 1));
	if (!s->rec.recall_misses || !s->rec.recall_flags) {
		snprintf(err, err_bytes, "recall: out of memory");
		return -ENOMEM;
	}
	return 0;
}

void kvr_recall_teardown(struct kvr_sched *s)
{
	if (s->copy)
		kvr_dev_stream_synchronize(s->dev, s->copy);
	if (s->convert)
		kvr_dev_stream_synchronize(s->dev, s->convert);
	for (uint32_t b = 0; b < 2; b++) {
		struct staging *st = &s->rec.staging[b];
		kvr_dev_free(s->dev, st->runs);
		kvr_dev_event_destroy(s->dev, st->staged);
		kvr_dev_event_destroy(s->dev, st->drained);
		memset(st, 0, sizeof(*st));
	}
	for (uint32_t b = 0; b < 2; b++) {
		if (s->rec.bounce[b]) {
			kvr_dev_host_unregister(s->dev, s->rec.bounce[b]);
			free(s->rec.bounce[b]);
		}
		kvr_dev_event_destroy(s->dev, s->rec.bounce_done[b]);
		s->rec.bounce[b] = NULL;
		s->rec.bounce_done[b] = NULL;
	}
	free(s->rec.bounce_pages);
	free(s->rec.bounce_heads);
	s->rec.bounce_pages = s->rec.bounce_heads = NULL;
	kvr_dev_stream_destroy(s->dev, s->copy);
	kvr_dev_stream_destroy(s->dev, s->convert);
	free(s->rec.recall_misses);
	free(s->rec.recall_need);
	free(s->rec.recall_unit_slots);
	free(s->rec.recall_release);
	free(s->rec.recall_release_slots);
	s->rec.recall_need = s->rec.recall_unit_slots = s->rec.recall_release = s->rec.recall_release_slots = NULL;
	free(s->rec.recall_flags);
	free(s->rec.recall_descs);
	s->rec.recall_descs = NULL;
	s->rec.recall_misses = NULL;
	s->rec.recall_flags = NULL;
	s->copy = s->convert = NULL;
}

int kvr_recall_reconfigure(struct kvr_sched *s, uint32_t buffers, uint32_t chunk_pages, char *err,
			   size_t err_bytes)
{
	if (s->recall != KVR_RECALL_STREAMED || buffers < 1 || buffers > 2 || chunk_pages < 1 ||
	    chunk_pages > 4096) {
		snprintf(err, err_bytes, "recall: %u buffers of %u pages: not a streamed-recall setting",
			 buffers, chunk_pages);
		return -EINVAL;
	}
	kvr_recall_teardown(s); /* drains both streams first */
	s->c.recall_buffers = buffers;
	s->c.recall_chunk_pages = chunk_pages;
	return kvr_recall_setup(s, err, err_bytes);
}

int kvr_recall_lane_alloc(struct kvr_sched *s, struct kvr_lane *lane)
{
	int ret = kvr_dev_event_create(s->dev, &lane->recall_done);
	if (!ret)
		ret = kvr_dev_event_create(s->dev, &lane->attn_done);
	if (!ret)
		ret = kvr_dev_event_create(s->dev, &lane->sel_done);
	if (!ret && lane->slot_page && s->k && s->device_plan) /* the prefetch's counts */
		ret = kvr_mapped_alloc(s->dev, (size_t)s->c.n_kv_heads * 2 * sizeof(uint32_t),
				       (void **)&lane->prefetch_counts);
	if (ret || !lane->slot_page || !s->k)
		return ret; /* zero-copy or a dense layer: events only */
	if (s->kv_format) {
		/* quantised runs live in the shared cache's units (units.c),
		 * taken as slots fill; copied without scatter items */
		const size_t n = (size_t)s->c.n_kv_heads * s->k * s->units_per_slot;
		if (!(lane->slot_unit = kvr_malloc(n * sizeof(int32_t))))
			return -ENOMEM;
		for (size_t i = 0; i < n; i++)
			lane->slot_unit[i] = -1;
		/* mixed: the units a lane's slots give back until the step's end
		 * (any format may be given back through kvr_units_release) */
		if (!(lane->spare_unit = kvr_malloc(n * sizeof(int32_t))))
			return -ENOMEM;
		return 0;
	}
	const size_t bytes = (size_t)s->k * s->tile_bytes; /* k NHD tiles for keys, k for values */
	ret = kvr_dev_alloc(s->dev, bytes, (void **)&lane->slot_k);
	if (!ret)
		ret = kvr_dev_alloc(s->dev, bytes, (void **)&lane->slot_v);
	if (!ret)
		ret = kvr_mirror_grow(s->dev, &lane->recall_items,
				      (size_t)s->c.n_kv_heads * s->k * sizeof(struct kvr_scatter_item));
	return ret;
}

void kvr_recall_lane_free(struct kvr_sched *s, struct kvr_lane *lane)
{
	kvr_dev_free(s->dev, lane->slot_k);
	kvr_dev_free(s->dev, lane->slot_v);
	free(lane->slot_unit); /* its units went back with the sequence (kvr_units_seq_close) */
	lane->slot_unit = NULL;
	free(lane->spare_unit); /* and its spares */
	lane->spare_unit = NULL;
	lane->n_spare = lane->holds_units = 0;
	kvr_mirror_free(s->dev, &lane->recall_items);
	kvr_mapped_free(s->dev, lane->prefetch_counts);
	lane->prefetch_counts = NULL;
	lane->prefetch_pending = 0;
	kvr_dev_event_destroy(s->dev, lane->recall_done);
	kvr_dev_event_destroy(s->dev, lane->attn_done);
	kvr_dev_event_destroy(s->dev, lane->sel_done);
	lane->slot_k = lane->slot_v = NULL;
	lane->recall_done = lane->attn_done = lane->sel_done = NULL;
}

/* ------------------------------------------------------------------ hooks and spans */

static void hook_delay(void *arg)
{
	struct hook_arg *h = arg;
	h->s->hooks.delay(h->s->hooks.user, h->where);
}

void kvr_sched_hook_on_stream(struct kvr_sched *s, struct kvr_stream *stream, uint32_t where)
{
	/* one argument per site, filled once at creation (stream workers read it) */
	if (!s->hooks.delay || where >= 4)
		return;
	kvr_dev_host_fn(s->dev, stream, hook_delay, &s->hook_args[where]);
}

static void stamp_begin(void *arg)
{
	/* relaxed: read by the exporter after the stream is synchronised */
	atomic_store_explicit(&((struct kvr_trace_span *)arg)->begin_ns, kvr_now_ns(),
			      memory_order_relaxed);
}

static void stamp_end(void *arg)
{
	atomic_store_explicit(&((struct kvr_trace_span *)arg)->end_ns, kvr_now_ns(),
			      memory_order_relaxed);
}

struct kvr_trace_span *kvr_stream_span_begin(struct kvr_sched *s, struct kvr_stream *stream,
					     const char *name, uint32_t track, uint32_t seq,
					     uint32_t layer, uint32_t count)
{
	struct kvr_trace *t = trace_of(s);
	if (!t)
		return NULL;
	struct kvr_trace_span *sp = kvr_trace_reserve(t, name, track, seq, layer, count);
	if (sp && kvr_dev_host_fn(s->dev, stream, stamp_begin, sp))
		return NULL; /* no host functions on this backend: the span stays empty */
	return sp;
}

void kvr_stream_span_end(struct kvr_sched *s, struct kvr_stream *stream, struct kvr_trace_span *sp)
{
	if (sp)
		kvr_dev_host_fn(s->dev, stream, stamp_end, sp);
}

/* ------------------------------------------------------------------ plan and issue */

/* Plan head m: keep the hits, place the misses in freed slots. Appends the
 * misses to `out`; returns how many, and adds the hits to *hits. */
static uint32_t plan_head(struct kvr_sched *s, struct kvr_lane *lane, uint32_t m,
			  struct miss *out, uint64_t *hits)
{
	const uint32_t k = s->k;
	int32_t *slots = lane->slot_page + (uint64_t)m * k;
	const int32_t *want = lane->selected + (uint64_t)m * k;
	uint8_t *keep = s->rec.recall_flags, *placed = s->rec.recall_flags + k;
	memset(keep, 0, k);
	memset(placed, 0, k);
	for (uint32_t j = 0; j < k; j++) {
		if (slots[j] < 0)
			continue;
		for (uint32_t w = 0; w < k; w++)
			if (want[w] == slots[j] && !placed[w]) {
				keep[j] = 1;
				placed[w] = 1;
				(*hits)++;
				break;
			}
	}
	uint32_t n = 0, free_slot = 0;
	for (uint32_t w = 0; w < k; w++) {
		if (want[w] < 0 || placed[w])
			continue;
		while (keep[free_slot])
			free_slot++; /* a free slot exists: at most k wanted pages */
		uint32_t id;
		if (kvr_pool_lookup(s->pool, lane->seq, lane->layer, (uint32_t)want[w], &id))
			continue; /* cannot happen: candidates are full pages of the lane */
		slots[free_slot] = want[w];
		keep[free_slot] = 1;
		out[n++] = (struct miss){ id, m, free_slot, 1 };
	}
	for (uint32_t j = 0; j < k; j++)
		if (!keep[j])
			slots[j] = -1; /* evicted: attention must not read it */
	return n;
}

/* A miss's run in the pool, and the lowest of n misses' runs: the base the
 * batched copy's source offsets count from. */
static const unsigned char *miss_run(struct kvr_sched *s, const struct miss *ms)
{
	return (const unsigned char *)kvr_pool_page_data(s->pool, ms->page_id) + (uint64_t)ms->head * s->head_bytes;
}

static const unsigned char *lowest_run(struct kvr_sched *s, const struct miss *ms, uint32_t n)
{
	const unsigned char *base = NULL;
	for (uint32_t i = 0; i < n; i++) {
		const unsigned char *run = miss_run(s, &ms[i]);
		base = !base || run < base ? run : base;
	}
	return base;
}

/* Spill tier: a chunk's n runs, from RAM or the spill file, into dst (run i
 * at i·head_bytes). A read that failed (-EIO, -EBADMSG) is also left in the
 * lane, whose next attention fails its sequence with it. Controller thread. */
static int read_chunk(struct kvr_sched *s, struct kvr_lane *lane, const struct miss *ms, uint32_t n,
		      unsigned char *dst)
{
	for (uint32_t i = 0; i < n; i++) {
		s->rec.bounce_pages[i] = ms[i].page_id;
		s->rec.bounce_heads[i] = ms[i].head;
	}
	int err = kvr_pool_read_runs(s->pool, s->rec.bounce_pages, s->rec.bounce_heads, n, dst, NULL);
	if (err)
		lane->recall_error = err;
	return err;
}

/* read_chunk into the next host bounce, once the copy out of its previous
 * contents is done: the bounce, or NULL with *err set. */
static const unsigned char *bounce_fill(struct kvr_sched *s, struct kvr_lane *lane, const struct miss *ms,
					uint32_t n, int *err)
{
	const uint32_t b = s->rec.next_bounce++ % 2;
	*err = kvr_sched_wait_event(s, s->rec.bounce_done[b], lane->seq, lane->layer, "wait bounce");
	if (!*err)
		*err = read_chunk(s, lane, ms, n, s->rec.bounce[b]);
	return *err ? NULL : s->rec.bounce[b];
}

/* Units slot entry (j, h) of head m: j·units_per_slot + h. */
static int32_t *slot_units(struct kvr_sched *s, struct kvr_lane *lane, uint32_t m, uint32_t j)
{
	return lane->slot_unit + ((uint64_t)m * s->k + j) * s->units_per_slot;
}

/* The format a miss's page has in the pool. */
static uint32_t miss_format(struct kvr_sched *s, const struct miss *ms)
{
	return s->kv_format == KVR_KV_MIXED ? kvr_pool_page_format(s->pool, ms->page_id) : s->kv_format;
}

/* Quantised pages: every head's misses are planned first. Then the slots'
 * units are made to fit their new pages (units.c): slots holding more units
 * than their page needs (mixed: a K8V4 page, two halves, gave way to a K4V2
 * page, one unit) give them to the lane's spares, and those holding fewer
 * take spares, then ids from at most one allocation round (none at all once
 * a sequence's first recall has filled every slot, unless mixed pages grow
 * back to K8V4). Then the misses' runs go from
 * the pool straight into their units, chunk_pages pages per batched copy on
 * the copy stream, after the lane's last attention: a whole run into one
 * unit, or a K8V4 page of a mixed pool as its two halves, four pieces each
 * (kvquant.h). There is no layout to convert, so no staging. */
static int recall_quantised(struct kvr_sched *s, struct kvr_lane *lane, const uint8_t *heads)
{
	struct miss *misses = s->rec.recall_misses;
	struct kvr_copy_desc *descs = s->rec.recall_descs;
	struct kvr_stream *copy = s->copy;
	const uint32_t n_kv = s->c.n_kv_heads, ups = s->units_per_slot;
	uint64_t hits = 0, bytes_moved = 0;
	uint32_t n_miss = 0, n_need = 0, n_release = 0;
	for (uint32_t m = 0; m < n_kv; m++) {
		s->rec.recall_need[m] = s->rec.recall_release[m] = 0;
		if (!heads[m])
			continue;
		const uint32_t first = n_miss;
		n_miss += plan_head(s, lane, m, misses + first, &hits);
		for (uint32_t i = first; i < n_miss; i++)
			misses[i].units = ups > 1 && miss_format(s, &misses[i]) == KVR_KV_K8V4 ? 2 : 1;
	}
	/* the entries under the units' lock: a fill of another lane of the
	 * sequence (its first) may fill this lane's empty entries; the misses
	 * come head by head, as the counts' prefix sum wants them */
	kvr_units_lock(s);
	for (uint32_t i = 0; i < n_miss; i++) {
		const uint32_t m = misses[i].head;
		const int32_t *units = slot_units(s, lane, m, misses[i].slot);
		for (uint32_t h = 0; h < ups; h++) {
			const uint32_t entry = misses[i].slot * ups + h;
			if (h < misses[i].units && units[h] < 0) {
				s->rec.recall_unit_slots[n_need++] = entry;
				s->rec.recall_need[m]++;
			} else if (h >= misses[i].units && units[h] >= 0) {
				s->rec.recall_release_slots[n_release++] = entry;
				s->rec.recall_release[m]++;
			}
		}
	}
	/* admission reserved the units, so a failure here is a device failure
	 * (recorded with its reason); the controller then forgets the lane's
	 * slots, and its next step recalls afresh */
	int err = n_release ? kvr_units_release_locked(s, lane, s->rec.recall_release, s->rec.recall_release_slots)
			    : 0;
	if (!err && n_need)
		err = kvr_units_fill_locked(s, lane, s->rec.recall_need, s->rec.recall_unit_slots);
	kvr_units_unlock(s);
	if (!err)
		err = kvr_dev_stream_wait_event(s->dev, copy, lane->attn_done);
	/* mixed: a K8V4 run and its halves (geometry_init writes both fully) */
	struct kvr_quant_geometry g8, gh;
	kvr_quant_geometry_init(&g8, s->c.page_tokens, s->c.head_dim, 1, KVR_KV_K8V4);
	kvr_quant_geometry_init(&gh, s->c.page_tokens, s->c.head_dim, 1, KVR_KV_K8V4_HALF);
	for (uint32_t at = 0; at < n_miss && !err; at += s->rec.chunk_pages) {
		const uint32_t n = n_miss - at < s->rec.chunk_pages ? n_miss - at : s->rec.chunk_pages;
		/* the runs: in the pool (RAM), or read into a bounce (spill tier) */
		const unsigned char *bounce = s->spill ? bounce_fill(s, lane, misses + at, n, &err) : NULL;
		if (err)
			break;
		const unsigned char *src_base = bounce ? bounce : lowest_run(s, misses + at, n);
		unsigned char *dst_base = NULL;
		for (uint32_t i = 0; i < n; i++) {
			const int32_t *units = slot_units(s, lane, misses[at + i].head, misses[at + i].slot);
			for (uint32_t h = 0; h < ups; h++)
				if (units[h] >= 0) {
					unsigned char *dst = kvr_units_addr(s, (uint32_t)units[h]);
					dst_base = !dst_base || dst < dst_base ? dst : dst_base;
				}
		}
		uint32_t n_descs = 0;
		for (uint32_t i = 0; i < n; i++) {
			const struct miss *ms = &misses[at + i];
			const int32_t *units = slot_units(s, lane, ms->head, ms->slot);
			const uint32_t fmt = miss_format(s, ms);
			const uint64_t src = bounce ? (uint64_t)i * s->head_bytes : (uint64_t)(miss_run(s, ms) - src_base);
			if (lane->slot_fmt)
				lane->slot_fmt[(uint64_t)ms->head * s->k + ms->slot] = (uint8_t)fmt;
			if (ups > 1 && fmt == KVR_KV_K8V4) { /* two halves, four pieces each */
				for (uint32_t h = 0; h < 2; h++) {
					const uint64_t dst = (uint64_t)(kvr_units_addr(s, (uint32_t)units[h]) - dst_base);
					for (uint32_t piece = 0; piece < 4; piece++) {
						uint64_t so, dof, bytes;
						kvr_quant_half_piece(&g8, &gh, h, piece, &so, &dof, &bytes);
						descs[n_descs++] = (struct kvr_copy_desc){ src + so, dst + dof, bytes };
						bytes_moved += bytes;
					}
				}
				continue;
			}
			/* one run into one unit (mixed: a K4V2 page moves only its own bytes) */
			const uint64_t bytes = kvr_kv_run_bytes(fmt, s->c.page_tokens, s->c.head_dim, s->eb);
			descs[n_descs++] = (struct kvr_copy_desc){
				src, (uint64_t)(kvr_units_addr(s, (uint32_t)units[0]) - dst_base), bytes };
			bytes_moved += bytes;
		}
		kvr_sched_hook_on_stream(s, copy, KVR_HOOK_COPY);
		struct kvr_trace_span *sp = kvr_stream_span_begin(s, copy, "copy chunk", KVR_TRACK_COPY,
								  lane->seq, lane->layer, n);
		err = kvr_dev_memcpy_batch_async(s->dev, dst_base, src_base, descs, n_descs, KVR_COPY_H2D, copy);
		kvr_stream_span_end(s, copy, sp);
		if (!err && bounce)
			err = kvr_dev_event_record(s->dev, s->rec.bounce_done[(s->rec.next_bounce - 1) % 2], copy);
	}
	if (!err)
		err = kvr_dev_event_record(s->dev, lane->recall_done, copy);
	count(s, lane->seq, KVR_C_PAGES_RECALLED, n_miss);
	count(s, lane->seq, KVR_C_PAGES_HIT, hits);
	count(s, lane->seq, KVR_C_BYTES_RECALLED, bytes_moved);
	return err;
}

int kvr_recall_issue(struct kvr_sched *s, struct kvr_lane *lane, const uint8_t *heads)
{
	if (!s->k)
		return 0;
	if (s->kv_format) {
		/* the slot table is rewritten below: the previous recall must have run */
		kvr_sched_wait_event(s, lane->recall_done, lane->seq, lane->layer, "wait previous recall");
		return recall_quantised(s, lane, heads);
	}
	struct miss *misses = s->rec.recall_misses;
	uint64_t hits = 0, n_miss_total = 0;
	struct kvr_stream *copy = s->copy, *convert = s->convert;
	int first_scatter = 1, err = 0;
	uint32_t n_items_used = 0;
	/* The lane's scatter items (and slot table) are rewritten below: its
	 * previous recall must have run. Usually it has — the lane's attention
	 * waited for it — but an urgent recall can follow a deferred one still in
	 * flight (freekv: a correction at the next step), and with asynchronous
	 * compute the engine waits only on the stream. */
	kvr_sched_wait_event(s, lane->recall_done, lane->seq, lane->layer, "wait previous recall");
	/* the device plan rewrites the slot table in its step's stream order:
	 * the host reads it once that step's attention (after the plan) is done */
	if (s->device_plan)
		kvr_sched_wait_event(s, lane->attn_done, lane->seq, lane->layer, "wait the device's slot plan");
	for (uint32_t m = 0; m < s->c.n_kv_heads && !err; m++) {
		if (!heads[m])
			continue;
		const uint32_t n_miss = plan_head(s, lane, m, misses, &hits);
		n_miss_total += n_miss;
		for (uint32_t at = 0; at < n_miss && !err; at += s->rec.chunk_pages) {
			const uint32_t n = n_miss - at < s->rec.chunk_pages ? n_miss - at : s->rec.chunk_pages;
			const uint32_t b = s->rec.next_buffer++ % s->rec.n_staging;
			struct staging *st = &s->rec.staging[b];
			/* this chunk's scatter items: the lane's own array (its previous
			 * recall has run, above); staging-buffer reuse is ordered on the
			 * copy stream by the buffer's `drained` event, not on the host */
			struct kvr_scatter_item *items = (struct kvr_scatter_item *)lane->recall_items.host + n_items_used;
			n_items_used += n;
			/* copies: one HND run per miss, from the pool into the staging buffer */
			struct kvr_copy_desc *descs = s->rec.recall_descs;
			/* spill tier: where the device reads host memory, the runs go
			 * straight into the staging buffer once the scatter of its
			 * previous chunk is done; elsewhere through a bounce */
			const int direct = s->spill_direct;
			if (direct) {
				err = kvr_sched_wait_event(s, st->drained, lane->seq, lane->layer, "wait staging");
				if (!err)
					err = read_chunk(s, lane, misses + at, n, st->runs);
				if (err)
					break;
			}
			const unsigned char *bounce = s->spill && !direct ? bounce_fill(s, lane, misses + at, n, &err)
									  : NULL;
			if (err)
				break;
			const unsigned char *read = direct ? st->runs : bounce; /* runs in order, or NULL */
			const unsigned char *base = read ? read : lowest_run(s, misses + at, n);
			for (uint32_t i = 0; i < n; i++) {
				const unsigned char *run = read ? read + (uint64_t)i * s->head_bytes
								: miss_run(s, &misses[at + i]);
				descs[i] = (struct kvr_copy_desc){ (uint64_t)(run - base),
								   (uint64_t)i * s->head_bytes, s->head_bytes };
				items[i] = (struct kvr_scatter_item){
					st->runs + (uint64_t)i * s->head_bytes,
					lane->slot_k + (uint64_t)misses[at + i].slot * s->tile_bytes,
					lane->slot_v + (uint64_t)misses[at + i].slot * s->tile_bytes,
					misses[at + i].head, 0 };
			}
			kvr_dev_stream_wait_event(s->dev, copy, st->drained);
			kvr_sched_hook_on_stream(s, copy, KVR_HOOK_COPY);
			struct kvr_trace_span *sp =
				kvr_stream_span_begin(s, copy, "copy chunk", KVR_TRACK_COPY, lane->seq,
						      lane->layer, n);
			if (s->pool_layout == KVR_POOL_LAYOUT_NHD) {
				/* ablation: token-major pool pages, 2·p row copies per run */
				err = 0;
				for (uint32_t i = 0; i < n && !err; i++) {
					const unsigned char *page =
						kvr_pool_page_data(s->pool, misses[at + i].page_id);
					const uint64_t row = (uint64_t)s->c.head_dim * s->eb;
					for (uint32_t half = 0; half < 2 && !err; half++)
						for (uint32_t t = 0; t < s->c.page_tokens && !err; t++)
							err = kvr_dev_memcpy_async(
								s->dev,
								st->runs + (uint64_t)i * s->head_bytes +
									((uint64_t)half * s->c.page_tokens + t) * row,
								page + (((uint64_t)half * s->c.page_tokens + t) *
										s->c.n_kv_heads +
									misses[at + i].head) * row,
								row, KVR_COPY_H2D, copy);
				}
			}
			if (!err && s->pool_layout != KVR_POOL_LAYOUT_NHD && !direct)
				err = kvr_dev_memcpy_batch_async(s->dev, st->runs, base, descs, n,
								 KVR_COPY_H2D, copy);
			kvr_stream_span_end(s, copy, sp);
			if (!err && bounce)
				err = kvr_dev_event_record(s->dev, s->rec.bounce_done[(s->rec.next_bounce - 1) % 2], copy);
			if (!err)
				err = kvr_dev_event_record(s->dev, st->staged, copy);
			/* conversion into the slots, after the copy and after the lane's
			 * last attention (deferred recall) */
			if (!err)
				err = kvr_dev_stream_wait_event(s->dev, convert, st->staged);
			if (!err && first_scatter) {
				err = kvr_dev_stream_wait_event(s->dev, convert, lane->attn_done);
				first_scatter = 0;
			}
			kvr_sched_hook_on_stream(s, convert, KVR_HOOK_CONVERT);
			sp = kvr_stream_span_begin(s, convert, "scatter chunk", KVR_TRACK_CONVERT,
						   lane->seq, lane->layer, n);
			if (!err)
				err = kvr_mirror_to_device(s->dev, &lane->recall_items, items, n * sizeof(*items),
							   convert);
			if (!err)
				err = kvr_dev_scatter(s->dev, &s->shape, kvr_mirror_dev_at(&lane->recall_items, items), n,
						      convert);
			kvr_stream_span_end(s, convert, sp);
			if (!err)
				err = kvr_dev_event_record(s->dev, st->drained, convert);
		}
	}
	if (!err)
		err = kvr_dev_event_record(s->dev, lane->recall_done, convert);
	count(s, lane->seq, KVR_C_PAGES_RECALLED, n_miss_total);
	count(s, lane->seq, KVR_C_PAGES_HIT, hits);
	count(s, lane->seq, KVR_C_BYTES_RECALLED, n_miss_total * s->head_bytes);
	return err;
}

/* ------------------------------------------------------------------ the device plan's prefetch */

void kvr_recall_prefetch_settle(struct kvr_sched *s, struct kvr_lane *lane)
{
	if (!lane->prefetch_pending)
		return;
	/* a step old: complete, unless the device is that far behind */
	kvr_dev_event_synchronize(s->dev, lane->sel_done);
	uint64_t misses = 0, hits = 0;
	for (uint32_t m = 0; m < s->c.n_kv_heads; m++) {
		misses += lane->prefetch_counts[2 * m];
		hits += lane->prefetch_counts[2 * m + 1];
	}
	count(s, lane->seq, KVR_C_PAGES_RECALLED, misses);
	count(s, lane->seq, KVR_C_PAGES_HIT, hits);
	count(s, lane->seq, KVR_C_BYTES_RECALLED, misses * s->head_bytes);
	lane->prefetch_pending = 0;
}

struct kvr_plan_item kvr_recall_prefetch_item(const struct kvr_sched *s, const struct kvr_lane *lane, uint32_t m,
					      struct kvr_scatter_item *scatter, uint32_t *counts)
{
	const uint32_t kk = s->k;
	/* the pages the selection may name (the next step's candidates),
	 * as far as this step's plan looked them up */
	uint32_t n_addrs = kvr_window_first(&s->c, lane->job_n_tokens + 1);
	if (n_addrs > lane->addr_valid)
		n_addrs = lane->addr_valid;
	return (struct kvr_plan_item){
		.selected = lane->selected + (uint64_t)m * kk,
		.page_addr = lane->page_addr,
		.addr_end = lane->page_addr ? n_addrs : 0,
		.k_offset = (uint64_t)m * s->head_bytes,
		.v_offset = UINT64_MAX, /* the run's keys and values: the scatter's */
		.k = kk,
		.slot_page = lane->slot_page + (uint64_t)m * kk,
		.scatter = scatter,
		.recall_count = counts,
		.slot_k = lane->slot_k,
		.slot_v = lane->slot_v,
		.tile_bytes = s->tile_bytes,
		.kv_head = m,
	};
}

int kvr_recall_prefetch_batch(struct kvr_sched *s, struct kvr_lane *const *lanes, uint32_t n,
			      struct kvr_selector *sel, uint32_t slot)
{
	const uint32_t n_kv = s->c.n_kv_heads, kk = s->k;
	struct kvr_stream *stream = sel->stream;
	struct kvr_plan_item *items = (struct kvr_plan_item *)sel->prefetch.host + (size_t)slot * sel->batch_cap * n_kv;
	for (uint32_t i = 0; i < n; i++)
		for (uint32_t m = 0; m < n_kv; m++)
			items[(size_t)i * n_kv + m] = kvr_recall_prefetch_item(
				s, lanes[i], m, sel->prefetch_scatter + ((size_t)i * n_kv + m) * kk,
				lanes[i]->prefetch_counts + 2 * m);
	const uint64_t t0 = kvr_now_ns();
	/* the plan decides the copies and the scatter converts: the hook sites
	 * of the staged path's copy and conversion, on the controller's stream */
	kvr_sched_hook_on_stream(s, stream, KVR_HOOK_COPY);
	int err = kvr_mirror_to_device(s->dev, &sel->prefetch, items, (size_t)n * n_kv * sizeof(*items), stream);
	if (!err)
		err = kvr_dev_plan(s->dev, &s->shape, kvr_mirror_dev_at(&sel->prefetch, items), n * n_kv, stream);
	kvr_sched_hook_on_stream(s, stream, KVR_HOOK_CONVERT);
	if (!err)
		err = kvr_dev_scatter(s->dev, &s->shape, sel->prefetch_scatter, n * n_kv * kk, stream);
	if (!err)
		for (uint32_t i = 0; i < n; i++)
			lanes[i]->prefetch_pending = 1;
	struct kvr_trace *tr = trace_of(s);
	if (tr)
		kvr_trace_span(tr, "plan + scatter recall (device, batch)", KVR_TRACK_CONTROLLER, lanes[0]->seq,
			       lanes[0]->layer, n * n_kv, t0, kvr_now_ns());
	return err;
}
