/* SPDX-License-Identifier: MIT */
/*
 * units.c — the device page cache of quantised pages as LeanKV builds it:
 * equal-size unified physical pages ("units", one KV head's quantised run
 * each; K8V4-sized for mixed pages) shared by every lane of every sequence,
 * handed out and taken back through one circular free-page list
 * (layouts/freelist.h) whose rounds run as the device's `freelist` kernel.
 *
 * A lane's slot (m, j) gets a unit the first time a recall puts a page in it
 * and keeps it until its sequence closes. Rounds are few, as in LeanKV,
 * where memory management runs once per step for every layer and head:
 *  - the first recall of a sequence turning sparse fills every slot of every
 *    sparse lane of the sequence in one allocation round (each (layer, KV
 *    head) a unit of the round, its share of the free region from the
 *    prefix sum over the counts), not one round per layer;
 *  - mixed pages: a slot whose K8V4 page gives way to a K4V2 one gives its
 *    second unit to the lane's spares, which the lane's later fills use
 *    first; what is left goes back in one free round at the step's end, for
 *    every lane at once, when no attention can read it any more. Only a
 *    lane needing more units than its spares (pages promoted back to K8V4
 *    halves) runs an allocation round of its own;
 *  - one free round per closing sequence.
 * Live KV is never moved — only unit ids travel between the ring and the
 * slot tables.
 *
 * Memory comes in chunks of one sequence's worth of units (every sparse
 * layer × n_kv × k), allocated when an allocation round finds too few free
 * units and put into the ring by a free round of their ids; chunks stay
 * until the scheduler is destroyed, so once the cache has grown to the peak
 * demand, opening and closing sequences costs no device allocation
 * (cudaMalloc and cudaFree synchronise the whole device). A sequence holds
 * no unit while it is attended densely (L <= B) and k per KV head per sparse
 * layer from its first sparse step on (L > B leaves at least k candidates,
 * so the first recall fills every slot): device memory follows the sparse
 * sequences, not the open ones. Admission (runtime/sequence.c) still
 * reserves a whole sequence's worth of device bytes, and the cache never
 * holds more chunks than sequences are open, so an admitted sequence always
 * finds its units within device_bytes.
 *
 * Plain pages keep per-lane NHD slot tiles (recall.c): their scatter writes
 * a KV head's column of a tile shared by all heads, so a head's slot is not
 * a unit of its own.
 *
 * The ring (ids, counters) is device memory; the round's counts, offsets,
 * page ids and status are mapped memory the host fills and reads; the item
 * is a mirror (gpu/memory.h). Threads: the engine (open, close, step end,
 * and urgent recalls) and the controller (recall) call in; `lock` serialises
 * the rounds and guards every lane's unit entries, spares and holds_units
 * (a fill writes other lanes' entries). Each round runs on the cache's own
 * stream and is waited for before the lock is released (the host needs the
 * ids to plan the copies).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../layouts/freelist.h"
#include "../layouts/base/fault.h"
#include "sched_impl.h"

struct kvr_units {
	pthread_mutex_t lock;      /* guards everything below and the stream */
	struct kvr_stream *stream; /* the rounds' stream */
	uint64_t unit_bytes;
	uint32_t per_chunk;        /* units of one sequence */
	uint32_t max_chunks, n_chunks;
	unsigned char **chunks;    /* [max_chunks] device memory, per_chunk units each */
	uint32_t capacity;         /* ring size: per_chunk · max_chunks ids */
	uint32_t *ids;             /* device: the ring */
	uint64_t *counters;        /* device: start, end */
	struct kvr_mirror item;    /* one struct kvr_freelist_item */
	uint32_t max_units, max_pages; /* of one round */
	uint32_t *counts;          /* mapped [max_units] */
	uint64_t *offsets;         /* mapped [max_units] */
	uint32_t *pages;           /* mapped [max_pages] */
	int32_t *status;           /* mapped */
	/* a round's entries, host memory: unit x of the round is KV head
	 * unit_head[x] of lane unit_lane[x], its entries in `entry` at the
	 * prefix sum of the counts before it */
	uint32_t *entry;           /* [max_pages] */
	struct kvr_lane **unit_lane; /* [max_units] */
	uint32_t *unit_head;       /* [max_units] */
	uint32_t *unit_count;      /* [max_units]: its entries (counts, once grow has run) */
	uint64_t n_free;           /* ids in the ring (the counters' difference) */
	uint64_t spares;           /* ids in the lanes' spares */
	uint64_t alloc_rounds, free_rounds;
	uint32_t open_seqs;        /* sequences holding a chunk's reservation */
	char message[224];         /* why the last round failed */
};

uint32_t kvr_units_per_slot(const struct kvr_config *c)
{
	return c->kv_format == KVR_KV_MIXED ? 2u : 1u;
}

uint64_t kvr_units_unit_bytes(const struct kvr_config *c)
{
	const uint32_t eb = kvr_elem_bytes(c->dtype);
	if (c->kv_format != KVR_KV_MIXED)
		return kvr_kv_run_bytes(c->kv_format, c->page_tokens, c->head_dim, eb);
	/* a K4V2 page, or half a K8V4 page (the K4V2 run is the larger) */
	const uint64_t k4 = kvr_kv_run_bytes(KVR_KV_K4V2, c->page_tokens, c->head_dim, eb);
	const uint64_t half = kvr_kv_run_bytes(KVR_KV_K8V4_HALF, c->page_tokens, c->head_dim, eb);
	return k4 > half ? k4 : half;
}

uint64_t kvr_units_seq_count(const struct kvr_config *c)
{
	const uint64_t k = (c->budget_tokens - c->sink_tokens - c->window_tokens) / c->page_tokens;
	uint32_t sparse_layers = 0;
	for (uint32_t l = 0; l < c->n_layers; l++)
		sparse_layers += !(c->dense_layers[l / 64] >> (l % 64) & 1);
	return (uint64_t)sparse_layers * c->n_kv_heads * k * kvr_units_per_slot(c);
}

uint64_t kvr_units_fixed_bytes(const struct kvr_config *c)
{
	/* the ring's ids and counters (the round's buffers are host memory) */
	return kvr_units_seq_count(c) * c->max_sequences * sizeof(uint32_t) + 2 * sizeof(uint64_t) +
	       sizeof(struct kvr_freelist_item);
}

unsigned char *kvr_units_addr(const struct kvr_sched *s, uint32_t id)
{
	const struct kvr_units *u = s->units;
	return u->chunks[id / u->per_chunk] + (uint64_t)(id % u->per_chunk) * u->unit_bytes;
}

/* One round on the device, waited for; lock held. The caller filled counts
 * (and, freeing, pages) and says their sum, `total`. 0, or a negative errno with u->message set (the
 * callers run on different threads: each copies it where its thread
 * reports errors). */
static int run_round(struct kvr_sched *s, struct kvr_units *u, uint32_t op, uint32_t n_units, uint64_t total)
{
	struct kvr_freelist_item *item = u->item.host;
	*item = (struct kvr_freelist_item){ u->ids, u->counters, u->counts, u->offsets, u->pages,
					    u->status, u->capacity, n_units, op, u->max_pages };
	*u->status = KVR_FREELIST_BAD;
	int err = kvr_mirror_to_device(s->dev, &u->item, item, sizeof(*item), u->stream);
	if (!err)
		err = kvr_dev_freelist(s->dev, u->item.dev, 1, u->stream);
	if (!err) /* the host reads the round's status (and ids) */
		err = kvr_sched_wait_stream(s, u->stream, UINT32_MAX, UINT32_MAX, "wait free-list round");
	if (err) {
		snprintf(u->message, sizeof(u->message), "device page cache: free-list round: %s",
			 kvr_dev_last_error(s->dev));
		return err;
	}
	if (*u->status) {
		snprintf(u->message, sizeof(u->message),
			 "device page cache: %s of %llu units refused (%s; %llu of %u free)",
			 op == KVR_FREELIST_ALLOC ? "allocation" : "return", (unsigned long long)total,
			 *u->status == KVR_FREELIST_SHORT ? "too few free" : "malformed round",
			 (unsigned long long)u->n_free, u->capacity);
		return *u->status == KVR_FREELIST_SHORT && op == KVR_FREELIST_ALLOC ? -ENOSPC : -EIO;
	}
	u->n_free = op == KVR_FREELIST_ALLOC ? u->n_free - total : u->n_free + total;
	if (op == KVR_FREELIST_ALLOC)
		u->alloc_rounds++;
	else
		u->free_rounds++;
	return 0;
}

int kvr_units_setup(struct kvr_sched *s, char *err, size_t err_bytes)
{
	const struct kvr_config *c = &s->c;
	if (s->recall != KVR_RECALL_STREAMED || !s->kv_format || !s->k || !kvr_units_seq_count(c))
		return 0;
	struct kvr_units *u = kvr_calloc(1, sizeof(*u));
	if (!u) {
		snprintf(err, err_bytes, "device page cache: out of memory");
		return -ENOMEM;
	}
	pthread_mutex_init(&u->lock, NULL);
	s->units = u;
	u->unit_bytes = kvr_units_unit_bytes(c);
	u->per_chunk = (uint32_t)kvr_units_seq_count(c);
	u->max_chunks = c->max_sequences;
	u->capacity = u->per_chunk * u->max_chunks; /* config limits keep this far below 2^32 */
	u->max_units = c->n_layers * c->n_kv_heads;
	u->max_pages = u->per_chunk;
	int ret = (u->chunks = kvr_calloc(u->max_chunks, sizeof(*u->chunks))) ? 0 : -ENOMEM;
	if (!ret)
		ret = kvr_dev_stream_create(s->dev, KVR_STREAM_INLINE, &u->stream);
	if (!ret)
		ret = kvr_dev_alloc(s->dev, (size_t)u->capacity * sizeof(uint32_t), (void **)&u->ids);
	if (!ret)
		ret = kvr_dev_alloc(s->dev, 2 * sizeof(uint64_t), (void **)&u->counters);
	if (!ret)
		ret = kvr_mirror_grow(s->dev, &u->item, sizeof(struct kvr_freelist_item));
	if (!ret)
		ret = kvr_mapped_alloc(s->dev, (size_t)u->max_units * sizeof(uint32_t), (void **)&u->counts);
	if (!ret)
		ret = kvr_mapped_alloc(s->dev, (size_t)u->max_units * sizeof(uint64_t), (void **)&u->offsets);
	if (!ret)
		ret = kvr_mapped_alloc(s->dev, (size_t)u->max_pages * sizeof(uint32_t), (void **)&u->pages);
	if (!ret)
		ret = kvr_mapped_alloc(s->dev, sizeof(*u->status), (void **)&u->status);
	if (!ret && (!(u->entry = kvr_calloc(u->max_pages, sizeof(*u->entry))) ||
		     !(u->unit_lane = kvr_calloc(u->max_units, sizeof(*u->unit_lane))) ||
		     !(u->unit_head = kvr_calloc(u->max_units, sizeof(*u->unit_head))) ||
		     !(u->unit_count = kvr_calloc(u->max_units, sizeof(*u->unit_count)))))
		ret = -ENOMEM;
	/* an empty ring: start = end = 0 (ids arrive with the chunks) */
	static const uint64_t empty[2] = { 0, 0 };
	if (!ret)
		ret = kvr_dev_memcpy_async(s->dev, u->counters, empty, sizeof(empty), KVR_COPY_H2D, u->stream);
	if (!ret)
		ret = kvr_dev_stream_synchronize(s->dev, u->stream);
	if (ret)
		snprintf(err, err_bytes, "device page cache: %s",
			 ret == -ENOMEM ? "out of memory" : kvr_dev_last_error(s->dev));
	return ret;
}

void kvr_units_teardown(struct kvr_sched *s)
{
	struct kvr_units *u = s->units;
	if (!u)
		return;
	if (u->stream)
		kvr_dev_stream_synchronize(s->dev, u->stream);
	for (uint32_t i = 0; u->chunks && i < u->n_chunks; i++)
		kvr_dev_free(s->dev, u->chunks[i]);
	free(u->chunks);
	kvr_dev_free(s->dev, u->ids);
	kvr_dev_free(s->dev, u->counters);
	kvr_mirror_free(s->dev, &u->item);
	kvr_mapped_free(s->dev, u->counts);
	kvr_mapped_free(s->dev, u->offsets);
	kvr_mapped_free(s->dev, u->pages);
	kvr_mapped_free(s->dev, u->status);
	free(u->entry);
	free(u->unit_lane);
	free(u->unit_head);
	free(u->unit_count);
	kvr_dev_stream_destroy(s->dev, u->stream);
	pthread_mutex_destroy(&u->lock);
	free(u);
	s->units = NULL;
}

/* Grow by one chunk: its ids enter the ring as a free round; lock held.
 * 0, or a negative errno with u->message set. */
static int grow(struct kvr_sched *s, struct kvr_units *u)
{
	const uint32_t c = u->n_chunks;
	if (c == u->max_chunks) {
		snprintf(u->message, sizeof(u->message), "device page cache: all %u chunks in use", c);
		return -ENOSPC;
	}
	int err = kvr_dev_alloc(s->dev, (size_t)u->per_chunk * u->unit_bytes, (void **)&u->chunks[c]);
	if (err) {
		snprintf(u->message, sizeof(u->message), "device page cache: %s",
			 err == -ENOMEM ? "out of memory" : kvr_dev_last_error(s->dev));
		return err;
	}
	u->n_chunks++;
	u->counts[0] = u->per_chunk;
	for (uint32_t i = 0; i < u->per_chunk; i++)
		u->pages[i] = c * u->per_chunk + i;
	err = run_round(s, u, KVR_FREELIST_FREE, 1, u->per_chunk);
	if (err) { /* the ring never saw the chunk: give it back */
		kvr_dev_free(s->dev, u->chunks[c]);
		u->chunks[c] = NULL;
		u->n_chunks--;
	}
	return err;
}

int kvr_units_seq_open(struct kvr_sched *s)
{
	struct kvr_units *u = s->units;
	if (!u)
		return 0;
	int err = 0;
	pthread_mutex_lock(&u->lock);
	if (u->open_seqs == u->max_chunks) {
		snprintf(s->last_error, sizeof(s->last_error),
			 "device page cache: %u sequences already hold its units", u->open_seqs);
		err = -ENOSPC;
	} else {
		u->open_seqs++; /* a reservation only: units come with the first recall */
	}
	pthread_mutex_unlock(&u->lock);
	return err;
}

/* Append the lane's spares' ids to the round's pages at `at`: the new end.
 * The caller empties the spares once the round has them. */
static uint32_t spares_to_round(struct kvr_units *u, const struct kvr_lane *lane, uint32_t at)
{
	for (uint32_t i = 0; i < lane->n_spare; i++)
		u->pages[at++] = (uint32_t)lane->spare_unit[i];
	return at;
}

void kvr_units_seq_close(struct kvr_sched *s, uint32_t seq)
{
	struct kvr_units *u = s->units;
	if (!u)
		return;
	pthread_mutex_lock(&u->lock);
	/* every (layer, KV head) of the sequence a unit of one free round */
	uint32_t n_units = 0, at = 0;
	for (uint32_t l = 0; l < s->c.n_layers; l++) {
		struct kvr_lane *lane = lane_of(s, seq, l);
		for (uint32_t m = 0; m < s->c.n_kv_heads; m++) {
			uint32_t n = 0;
			const uint32_t per_head = s->k * s->units_per_slot;
			for (uint32_t j = 0; lane->slot_unit && j < per_head; j++) {
				int32_t *unit = &lane->slot_unit[(uint64_t)m * per_head + j];
				if (*unit < 0)
					continue;
				u->pages[at + n++] = (uint32_t)*unit;
				*unit = -1;
			}
			u->counts[n_units++] = n;
			at += n;
		}
		if (lane->n_spare) { /* with the last (layer, KV head)'s units */
			at = spares_to_round(u, lane, at);
			u->counts[n_units - 1] += lane->n_spare;
			u->spares -= lane->n_spare;
			lane->n_spare = 0;
		}
		lane->holds_units = 0;
	}
	if (at && run_round(s, u, KVR_FREELIST_FREE, n_units, at))
		/* cannot happen for ids the ring handed out; the units are lost to
		 * the cache, not to correctness */
		kvr_sched_record_async_error(s, -EIO, u->message);
	if (u->open_seqs)
		u->open_seqs--;
	pthread_mutex_unlock(&u->lock);
}

void kvr_units_lock(struct kvr_sched *s)
{
	pthread_mutex_lock(&s->units->lock);
}

void kvr_units_unlock(struct kvr_sched *s)
{
	pthread_mutex_unlock(&s->units->lock);
}

/* Entries of a round waiting for their ids (never a unit id). */
#define PENDING (-2)

/* List head m of `lane` as the round's next unit; its entries follow. */
static void round_unit(struct kvr_units *u, uint32_t *n_units, struct kvr_lane *lane, uint32_t m)
{
	u->unit_lane[*n_units] = lane;
	u->unit_head[*n_units] = m;
	u->unit_count[(*n_units)++] = 0;
}

/* Add entry e of head m to the round's last unit unless it holds a unit or
 * is listed already. */
static void round_entry(struct kvr_sched *s, struct kvr_units *u, uint32_t n_units, uint64_t *at, uint32_t e)
{
	struct kvr_lane *lane = u->unit_lane[n_units - 1];
	int32_t *unit = &lane->slot_unit[(uint64_t)u->unit_head[n_units - 1] * s->k * s->units_per_slot + e];
	if (*unit != -1)
		return;
	if (lane->n_spare) { /* the lane's own: its copies wait for its attention */
		*unit = lane->spare_unit[--lane->n_spare];
		u->spares--;
		return;
	}
	*unit = PENDING;
	u->entry[(*at)++] = e;
	u->unit_count[n_units - 1]++;
}

int kvr_units_fill_locked(struct kvr_sched *s, struct kvr_lane *lane, const uint32_t *need,
			  const uint32_t *slots)
{
	struct kvr_units *u = s->units;
	const uint32_t n_kv = s->c.n_kv_heads, ups = s->units_per_slot;
	const uint64_t per_head = (uint64_t)s->k * ups;
	const int first = !lane->holds_units;
	uint32_t n_units = 0;
	uint64_t at = 0, in = 0;
	for (uint32_t m = 0; m < n_kv; m++) {
		round_unit(u, &n_units, lane, m);
		for (uint32_t i = 0; i < need[m]; i++)
			round_entry(s, u, n_units, &at, slots[in++]);
		/* a sequence turning sparse: unit 0 of every slot now, the
		 * other sparse lanes' below, so their recalls run no round */
		for (uint32_t j = 0; first && j < s->k; j++)
			round_entry(s, u, n_units, &at, j * ups);
	}
	for (uint32_t l = 0; first && l < s->c.n_layers; l++) {
		struct kvr_lane *other = lane_of(s, lane->seq, l);
		if (other == lane || !other->slot_unit || other->holds_units)
			continue;
		for (uint32_t m = 0; m < n_kv; m++) {
			round_unit(u, &n_units, other, m);
			for (uint32_t j = 0; j < s->k; j++)
				round_entry(s, u, n_units, &at, j * ups);
		}
	}
	if (!at) {
		lane->holds_units = 1;
		return 0;
	}
	int err = 0;
	/* grow on demand: the open sequences' reservations bound the chunks */
	while (!err && u->n_free < at)
		err = grow(s, u); /* a round of its own: counts are set after it */
	memcpy(u->counts, u->unit_count, n_units * sizeof(*u->counts));
	if (!err)
		err = run_round(s, u, KVR_FREELIST_ALLOC, n_units, at);
	/* unit x's ids are at its prefix-sum offset, as are its entries */
	uint64_t from = 0;
	for (uint32_t x = 0; x < n_units; x++) {
		struct kvr_lane *owner = u->unit_lane[x];
		int32_t *units = owner->slot_unit + u->unit_head[x] * per_head;
		for (uint32_t i = 0; i < u->unit_count[x]; i++)
			units[u->entry[from + i]] = err ? -1 : (int32_t)u->pages[u->offsets[x] + i];
		from += u->unit_count[x];
		if (!err && (u->unit_count[x] || owner == lane))
			owner->holds_units = 1; /* a failed first fill may batch again */
	}
	if (err)
		kvr_sched_record_async_error(s, err, u->message);
	else
		count(s, lane->seq, KVR_C_UNITS_TAKEN, at);
	return err;
}

int kvr_units_fill(struct kvr_sched *s, struct kvr_lane *lane, const uint32_t *need, const uint32_t *slots)
{
	kvr_units_lock(s);
	const int err = kvr_units_fill_locked(s, lane, need, slots);
	kvr_units_unlock(s);
	return err;
}

int kvr_units_release_locked(struct kvr_sched *s, struct kvr_lane *lane, const uint32_t *release,
			     const uint32_t *slots)
{
	struct kvr_units *u = s->units;
	const uint64_t per_head = (uint64_t)s->k * s->units_per_slot;
	uint64_t at = 0;
	/* The lane's latest attention may still read these units (an
	 * asynchronous compute stream), so they stay with the lane: its own
	 * fills' copies wait for that attention, another lane's would not.
	 * The step's end returns them once the compute stream is idle. */
	for (uint32_t m = 0; m < s->c.n_kv_heads; m++)
		for (uint32_t i = 0; i < release[m]; i++, at++) {
			int32_t *unit = &lane->slot_unit[m * per_head + slots[at]];
			if (*unit < 0)
				continue;
			/* bounded: a lane never holds more units than entries */
			lane->spare_unit[lane->n_spare++] = *unit;
			u->spares++;
			*unit = -1;
		}
	return 0;
}

int kvr_units_release(struct kvr_sched *s, struct kvr_lane *lane, const uint32_t *release,
		      const uint32_t *slots)
{
	kvr_units_lock(s);
	const int err = kvr_units_release_locked(s, lane, release, slots);
	kvr_units_unlock(s);
	return err;
}

void kvr_units_step_end(struct kvr_sched *s)
{
	struct kvr_units *u = s->units;
	if (!u)
		return;
	pthread_mutex_lock(&u->lock);
	const uint64_t n_lanes = (uint64_t)s->c.max_sequences * s->c.n_layers;
	for (uint64_t x = 0; x < n_lanes && u->spares;) {
		/* as many lanes' spares as one round takes (a sequence's worth) */
		uint32_t at = 0;
		uint64_t first = x;
		for (; x < n_lanes && at + s->lanes[x].n_spare <= u->max_pages; x++)
			at = spares_to_round(u, &s->lanes[x], at);
		if (!at) /* cannot happen: a lane holds at most a sequence's worth */
			break;
		u->counts[0] = at;
		const int err = run_round(s, u, KVR_FREELIST_FREE, 1, at);
		if (err) /* cannot happen for ids the ring handed out; lost to the cache only */
			kvr_sched_record_async_error(s, err, u->message);
		for (; first < x; first++) {
			struct kvr_lane *lane = &s->lanes[first];
			if (!err && lane->n_spare)
				count(s, lane->seq, KVR_C_UNITS_RELEASED, lane->n_spare);
			u->spares -= lane->n_spare;
			lane->n_spare = 0;
		}
	}
	pthread_mutex_unlock(&u->lock);
}

void kvr_units_rounds(const struct kvr_sched *s, uint64_t *alloc_rounds, uint64_t *free_rounds)
{
	struct kvr_units *u = s->units;
	*alloc_rounds = *free_rounds = 0;
	if (!u)
		return;
	pthread_mutex_lock(&u->lock);
	*alloc_rounds = u->alloc_rounds;
	*free_rounds = u->free_rounds;
	pthread_mutex_unlock(&u->lock);
}

void kvr_sched_units(const struct kvr_sched *s, uint64_t *held, uint64_t *free_units, uint64_t *per_seq)
{
	struct kvr_units *u = s->units;
	*held = *free_units = *per_seq = 0;
	if (!u)
		return;
	pthread_mutex_lock(&u->lock);
	*held = (uint64_t)u->n_chunks * u->per_chunk;
	*free_units = u->n_free;
	*per_seq = u->per_chunk;
	pthread_mutex_unlock(&u->lock);
}
