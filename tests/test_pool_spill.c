/* SPDX-License-Identifier: MIT */
/*
 * test_pool_spill.c — the host page pool's spill tier (host/pool.h with
 * ram_bytes > 0): RAM holds at most `frames` pages and the rest of the
 * capacity lives in the pool's spill file (host/spill.h). Long random
 * sequences of appends (ingest and reserve + write_page), rewrites
 * (copy-on-write through forks included), truncations, closes, forks,
 * touches, pins with page reads, read-through of (page, head) runs and
 * whole-pool spills are checked against a shadow model: every byte read back
 * is the byte written (the expected HND page is computed from the NHD rows
 * independently of the pool), summaries never change, the residency the pool
 * reports adds up to its stats, and the counters move exactly as the
 * residency changes say they must — an eviction per page that left RAM, a
 * spill write only for a dirty one (a clean page read back keeps its slot),
 * a fetch per page pinned back, a read-through per run of a spilled page.
 * Pins are all or nothing and bounded by the frames; touched pages are
 * evicted last; injected read faults and bytes flipped in the file fail
 * exactly the runs (or the pin) of the page they hit; write faults leave
 * pages in RAM; a write that cannot get a frame (every frame pinned, or the
 * eviction's write failing) changes nothing, a copy-on-write included; a
 * demoted page is dirty again; quantised pages come back as an all-RAM pool
 * of the same format holds them; a pool holds many times its RAM and gives
 * file space back as pages are freed; bad parameters are refused with a
 * message, and a pool without a spill tier treats the spill calls as
 * no-ops. Every test works in a fresh directory under /var/tmp and removes
 * it empty at the end, which proves the spill file leaves nothing behind.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "half.h"
#include "kvquant.h"
#include "pool.h"
#include "spill.h"
#include "helpers.h"

/* The page shape of every test: 2 KV heads of d = 64, 16 tokens, f16: a
 * 4 KiB run per KV head, 8 KiB pages. */
enum { P = 16, D = 64, NKV = 2, EB = 2 };
#define ROW_ELEMS ((uint64_t)NKV * D)
#define HEAD_BYTES ((uint64_t)2 * P * D * EB)
#define PAGE_BYTES (HEAD_BYTES * NKV)
#define SUMMARY_BYTES ((uint64_t)2 * NKV * D * EB)

static uint64_t rng_state = 0x8f3a1c5be2d47a19ull;
static uint32_t rnd(uint32_t n)
{
	return (uint32_t)((th_xorshift64(&rng_state) >> 33) % n);
}

static void fill_random(void *dst, size_t n)
{
	unsigned char *p = dst;
	for (size_t i = 0; i < n; i++)
		p[i] = (unsigned char)rnd(256);
}

static unsigned char sentinel(size_t i)
{
	return (unsigned char)(0x5au ^ (i * 61u));
}

/* ------------------------------------------------------------------ directories */

TestSuite(pool_spill, .fini = th_test_dir_fini);

static void dir_make(char *path, size_t bytes)
{
	th_dir_make(path, bytes, "/var/tmp", "kvr-test-pool-spill-");
}

/* ------------------------------------------------------------------ pools */

static struct kvr_pool_params params_of(const char *dir, uint64_t capacity_pages, uint64_t ram_pages,
					uint32_t max_seqs, uint32_t n_layers, uint32_t spill_flags)
{
	struct kvr_pool_params pp = {
		.n_layers = n_layers,
		.max_sequences = max_seqs,
		.layout = KVR_POOL_LAYOUT_HND,
		.numa_node = -1,
		.flags = KVR_POOL_NO_LOCK | KVR_POOL_NO_HUGEPAGES,
		.keep_summaries = 1,
		.spill_dir = dir,
		.spill_flags = spill_flags,
	};
	cr_assert_eq(kvr_page_geometry_init(&pp.geometry, P, D, NKV, KVR_ELEM_F16), 0);
	cr_assert_eq(pp.geometry.page_bytes, PAGE_BYTES);
	pp.capacity_bytes = capacity_pages * PAGE_BYTES;
	pp.ram_bytes = ram_pages * PAGE_BYTES;
	return pp;
}

static struct kvr_pool *create_or_die(const struct kvr_pool_params *pp)
{
	struct kvr_pool *pool = NULL;
	char err[512] = "";
	cr_assert_eq(kvr_pool_create(pp, &pool, err, sizeof(err)), 0, "%s", err);
	cr_assert_not_null(pool);
	return pool;
}

static struct kvr_pool *make_pool(const char *dir, uint64_t capacity_pages, uint64_t ram_pages,
				  uint32_t max_seqs, uint32_t n_layers, uint32_t spill_flags)
{
	const struct kvr_pool_params pp = params_of(dir, capacity_pages, ram_pages, max_seqs, n_layers,
						    spill_flags);
	struct kvr_pool *pool = create_or_die(&pp);
	struct kvr_pool_stats st;
	kvr_pool_get_stats(pool, &st);
	cr_assert_eq(st.page_bytes, PAGE_BYTES);
	cr_assert_eq(st.capacity_pages, capacity_pages);
	if (ram_pages && ram_pages < capacity_pages) {
		cr_assert_eq(st.spill_enabled, 1);
		cr_assert_eq(st.frames, ram_pages, "frames %u for %llu pages of RAM", st.frames,
			     (unsigned long long)ram_pages);
		cr_assert_not_null(kvr_pool_spill_file(pool));
	}
	return pool;
}

static struct kvr_pool_stats stats_of(const struct kvr_pool *pool)
{
	struct kvr_pool_stats st;
	kvr_pool_get_stats(pool, &st);
	return st;
}

static struct kvr_spill_stats spill_stats_of(struct kvr_pool *pool)
{
	struct kvr_spill_stats st;
	struct kvr_spill *sp = kvr_pool_spill_file(pool);
	cr_assert_not_null(sp);
	kvr_spill_get_stats(sp, &st);
	return st;
}

static void validate(struct kvr_pool *pool, const char *where)
{
	cr_assert_eq(kvr_pool_validate(pool, NULL), 0, "%s: %s", where, kvr_pool_last_error(pool));
}

/* A one-layer pool spilling into a fresh directory, sequence 0 open: how
 * most tests here start. */
static struct kvr_pool *open_spilling(char dir[PATH_MAX], uint64_t capacity_pages,
				      uint64_t ram_pages, uint32_t max_seqs)
{
	dir_make(dir, PATH_MAX);
	struct kvr_pool *pool = make_pool(dir, capacity_pages, ram_pages, max_seqs, 1, 0);
	cr_assert_eq(kvr_pool_seq_open(pool, 0), 0);
	return pool;
}

/* How they end: the pool still valid, then destroyed, the expected pages
 * freed and the directory removed. */
static void close_spilling(struct kvr_pool *pool, const char *dir, unsigned char **expect,
			   uint32_t n_expect)
{
	validate(pool, "end");
	kvr_pool_destroy(pool);
	for (uint32_t i = 0; i < n_expect; i++)
		free(expect[i]);
	th_dir_remove(dir);
}

/* ------------------------------------------------------------------ pages */

/* The HND page [n_kv][2][p][d] that p NHD rows (row t at t·stride elements)
 * make, computed here, independently of the pool's conversion. */
static void hnd_from_rows(const unsigned char *k, const unsigned char *v, uint64_t stride,
			  unsigned char *page)
{
	for (uint32_t h = 0; h < NKV; h++)
		for (uint32_t half = 0; half < 2; half++)
			for (uint32_t t = 0; t < P; t++)
				memcpy(page + (((uint64_t)h * 2 + half) * P + t) * D * EB,
				       (half ? v : k) + ((uint64_t)t * stride + (uint64_t)h * D) * EB,
				       (size_t)D * EB);
}

/* Random rows for one page (stride elements a row, at least n_kv·d) and
 * the HND page they make. */
struct rows {
	unsigned char *k, *v;
	uint64_t stride;
};

static struct rows rows_random(uint64_t stride, unsigned char *expect_page)
{
	struct rows r = { malloc(P * stride * EB), malloc(P * stride * EB), stride };
	cr_assert(r.k && r.v);
	fill_random(r.k, P * stride * EB);
	fill_random(r.v, P * stride * EB);
	if (expect_page)
		hnd_from_rows(r.k, r.v, stride, expect_page);
	return r;
}

static void rows_free(struct rows *r)
{
	free(r->k), free(r->v);
}

/* Append n fresh pages to (seq, layer) with reserve + write_page; their
 * expected HND pages go to expect[i] (may be NULL), their ids to ids[i]
 * (may be NULL). */
static void append_pages(struct kvr_pool *pool, uint32_t seq, uint32_t layer, uint32_t n,
			 unsigned char **expect, uint32_t *ids)
{
	uint32_t before = 0;
	cr_assert_eq(kvr_pool_n_pages(pool, seq, layer, &before), 0);
	cr_assert_eq(kvr_pool_reserve(pool, seq, layer, n), 0, "reserve %u: %s", n,
		     kvr_pool_last_error(pool));
	for (uint32_t i = 0; i < n; i++) {
		unsigned char *page = malloc(PAGE_BYTES);
		struct rows r = rows_random(ROW_ELEMS, page);
		cr_assert_eq(kvr_pool_write_page(pool, seq, layer, before + i, r.k, r.v, r.stride), 0,
			     "write_page %u: %s", before + i, kvr_pool_last_error(pool));
		rows_free(&r);
		if (expect)
			expect[i] = page;
		else
			free(page);
		if (ids)
			cr_assert_eq(kvr_pool_lookup(pool, seq, layer, before + i, &ids[i]), 0);
	}
}

/* Pin one page, compare its memory (and a gathered head) with `expect`, unpin. */
static void check_page_pinned(struct kvr_pool *pool, uint32_t id, const unsigned char *expect,
			      const char *where)
{
	cr_assert_eq(kvr_pool_pin(pool, &id, 1), 0, "%s: pin %u: %s", where, id, kvr_pool_last_error(pool));
	cr_assert_eq(kvr_pool_page_resident(pool, id), 1, "%s: pinned page %u is not resident", where, id);
	const unsigned char *data = kvr_pool_page_data(pool, id);
	cr_assert_not_null(data);
	cr_assert_eq(memcmp(data, expect, PAGE_BYTES), 0, "%s: page %u differs from what was written",
		     where, id);
	cr_assert_eq(kvr_pool_unpin(pool, &id, 1), 0, "%s: unpin %u: %s", where, id, kvr_pool_last_error(pool));
}

/* Read every run of page `id` through kvr_pool_read_runs and compare. */
static void check_page_runs(struct kvr_pool *pool, uint32_t id, const unsigned char *expect,
			    const char *where)
{
	uint32_t ids[NKV], heads[NKV];
	int32_t results[NKV];
	for (uint32_t h = 0; h < NKV; h++)
		ids[h] = id, heads[h] = NKV - 1 - h, results[h] = 99;
	unsigned char *dst = aligned_alloc(64, PAGE_BYTES);
	cr_assert_eq(kvr_pool_read_runs(pool, ids, heads, NKV, dst, results), 0, "%s: read_runs %u: %s",
		     where, id, kvr_pool_last_error(pool));
	for (uint32_t h = 0; h < NKV; h++) {
		cr_assert_eq(results[h], 0, "%s: results[%u] = %d", where, h, results[h]);
		cr_assert_eq(memcmp(dst + h * HEAD_BYTES, expect + heads[h] * HEAD_BYTES, HEAD_BYTES), 0,
			     "%s: page %u head %u differs", where, id, heads[h]);
	}
	free(dst);
}

/* ================================================================== 1. shadow */

enum { SH_SEQS = 4, SH_LAYERS = 2, SH_MAX_LONG_PINS = 4 };

struct shadow {
	struct kvr_pool *pool;
	uint32_t cap, frames;
	bool open[SH_SEQS];
	uint32_t n_pages[SH_SEQS][SH_LAYERS];
	/* expected HND page and summary of each logical page; NULL: reserved, not written */
	unsigned char **page[SH_SEQS][SH_LAYERS];
	unsigned char **summary[SH_SEQS][SH_LAYERS];
	/* per page id */
	uint8_t *live, *written, *has_slot, *res;
	uint32_t *long_pins; /* pins this model holds across operations */
	/* counters as last checked */
	struct kvr_pool_stats st;
	/* for the summary of what the run did */
	uint64_t ops, fetch_ops, read_ops, spill_all_ops, nomem_pins, enomem_appends, cows, max_live;
};

/* What one operation did that the residency scan cannot see. */
struct op_effect {
	uint32_t written[64]; /* ids written */
	uint32_t n_written;
	uint64_t runs_through; /* runs of spilled pages read through */
	bool pin_op;           /* fetches must equal pages pinned back */
};

static void sh_record(struct shadow *sh, uint32_t s, uint32_t l, uint32_t logical, unsigned char *page)
{
	free(sh->page[s][l][logical]);
	sh->page[s][l][logical] = page;
	const void *sum = kvr_pool_summary(sh->pool, s, l, logical);
	cr_assert_not_null(sum, "summary of seq %u layer %u page %u", s, l, logical);
	if (!sh->summary[s][l][logical])
		sh->summary[s][l][logical] = malloc(SUMMARY_BYTES);
	memcpy(sh->summary[s][l][logical], sum, SUMMARY_BYTES);
}

static void sh_drop(struct shadow *sh, uint32_t s, uint32_t l, uint32_t keep)
{
	for (uint32_t i = keep; i < sh->n_pages[s][l]; i++) {
		free(sh->page[s][l][i]), sh->page[s][l][i] = NULL;
		free(sh->summary[s][l][i]), sh->summary[s][l][i] = NULL;
	}
	if (sh->n_pages[s][l] > keep)
		sh->n_pages[s][l] = keep;
}

static uint32_t sh_id(struct shadow *sh, uint32_t s, uint32_t l, uint32_t logical)
{
	uint32_t id = KVR_POOL_NO_PAGE;
	cr_assert_eq(kvr_pool_lookup(sh->pool, s, l, logical, &id), 0, "lookup %u/%u/%u: %s", s, l,
		     logical, kvr_pool_last_error(sh->pool));
	cr_assert_lt(id, sh->cap, "page id %u out of range", id);
	return id;
}

static uint32_t sh_live_count(const struct shadow *sh)
{
	uint32_t n = 0;
	for (uint32_t i = 0; i < sh->cap; i++)
		n += sh->live[i];
	return n;
}

/* Scan the tables: live[] and res[] now. */
static void sh_scan(struct shadow *sh, uint8_t *live, uint8_t *res)
{
	memset(live, 0, sh->cap);
	memset(res, 0, sh->cap);
	for (uint32_t s = 0; s < SH_SEQS; s++) {
		if (!sh->open[s])
			continue;
		for (uint32_t l = 0; l < SH_LAYERS; l++) {
			uint32_t n = 0;
			cr_assert_eq(kvr_pool_n_pages(sh->pool, s, l, &n), 0);
			cr_assert_eq(n, sh->n_pages[s][l], "seq %u layer %u: %u pages, model %u", s, l, n,
				     sh->n_pages[s][l]);
			for (uint32_t i = 0; i < n; i++)
				live[sh_id(sh, s, l, i)] = 1;
		}
	}
	for (uint32_t id = 0; id < sh->cap; id++) {
		if (!live[id])
			continue;
		const int r = kvr_pool_page_resident(sh->pool, id);
		cr_assert(r == 0 || r == 1, "page_resident(%u) = %d", id, r);
		res[id] = (uint8_t)r;
	}
}

/* After an operation: residency transitions against the counters, the
 * model's slots, and the stats' totals. */
static void sh_settle(struct shadow *sh, const struct op_effect *e, const char *what)
{
	uint8_t *live = malloc(sh->cap), *res = malloc(sh->cap), *was_written = calloc(sh->cap, 1);
	sh_scan(sh, live, res);
	for (uint32_t i = 0; i < e->n_written; i++)
		was_written[e->written[i]] = 1;

	uint64_t evict = 0, writes = 0, fetch_min = 0, fetch_max = 0;
	for (uint32_t id = 0; id < sh->cap; id++) {
		if (sh->live[id] && !live[id]) {
			/* freed: its frame and its slot are gone */
			cr_assert_eq(sh->long_pins[id], 0, "%s: freed page %u held a pin", what, id);
			sh->written[id] = sh->has_slot[id] = 0;
			continue;
		}
		if (!live[id])
			continue;
		if (was_written[id]) {
			/* written by this op: it had a frame; still there, or
			 * evicted (and so written out) later in the same op */
			if (sh->live[id] && sh->written[id] && !sh->res[id])
				fetch_max++; /* a spilled page rewritten: reading it back first is allowed */
			sh->written[id] = 1;
			if (res[id]) {
				sh->has_slot[id] = 0;
			} else {
				evict++, writes++;
				sh->has_slot[id] = 1;
			}
			continue;
		}
		if (!sh->live[id]) {
			/* newly live, not written (a failed write leaves it so) */
			cr_assert_eq(sh->written[id], 0);
			cr_assert_eq(res[id], 0, "%s: page %u was never written but is resident", what, id);
			continue;
		}
		if (!sh->written[id]) {
			cr_assert_eq(res[id], 0, "%s: page %u was never written but is resident", what, id);
			continue;
		}
		if (sh->res[id] && !res[id]) {
			evict++;
			if (!sh->has_slot[id])
				writes++;
			sh->has_slot[id] = 1;
		} else if (!sh->res[id] && res[id]) {
			cr_assert(sh->has_slot[id], "%s: page %u came back without a slot", what, id);
			fetch_min++;
		}
	}
	fetch_max += fetch_min;
	memcpy(sh->live, live, sh->cap);
	memcpy(sh->res, res, sh->cap);

	uint64_t n_live = 0, n_written = 0, n_res = 0, n_pinned = 0, n_slot = 0;
	for (uint32_t id = 0; id < sh->cap; id++) {
		n_live += live[id];
		if (!live[id] || !sh->written[id])
			continue;
		n_written++;
		n_res += res[id];
		n_slot += sh->has_slot[id];
		/* a slot exactly for the spilled pages and the clean resident ones */
		const uint32_t slot = kvr_pool_page_slot(sh->pool, id);
		cr_assert_eq(slot != KVR_SPILL_NO_SLOT, sh->has_slot[id],
			     "%s: page %u (%s) has slot %u, model: %s", what, id, res[id] ? "resident" : "spilled",
			     slot, sh->has_slot[id] ? "clean, a slot" : "dirty, no slot");
		if (sh->long_pins[id]) {
			n_pinned++;
			cr_assert_eq(res[id], 1, "%s: pinned page %u is not resident", what, id);
		}
	}

	const struct kvr_pool_stats prev = sh->st, st = stats_of(sh->pool);
	sh->st = st;
	cr_assert_eq(st.used_pages, n_live, "%s: used_pages %llu, model %llu", what,
		     (unsigned long long)st.used_pages, (unsigned long long)n_live);
	cr_assert_leq(st.resident_pages, st.frames, "%s: %llu resident pages in %u frames", what,
		      (unsigned long long)st.resident_pages, st.frames);
	cr_assert_eq(st.resident_pages, n_res, "%s: resident_pages %llu, page_resident says %llu", what,
		     (unsigned long long)st.resident_pages, (unsigned long long)n_res);
	cr_assert_eq(st.spilled_pages, n_written - n_res, "%s: spilled_pages %llu, expected %llu", what,
		     (unsigned long long)st.spilled_pages, (unsigned long long)(n_written - n_res));
	cr_assert_eq(st.pinned_pages, n_pinned, "%s: pinned_pages %llu, model %llu", what,
		     (unsigned long long)st.pinned_pages, (unsigned long long)n_pinned);
	cr_assert_eq(st.evictions - prev.evictions, evict, "%s: evictions +%llu, residency says +%llu",
		     what, (unsigned long long)(st.evictions - prev.evictions), (unsigned long long)evict);
	cr_assert_eq(st.spill_writes - prev.spill_writes, writes,
		     "%s: spill_writes +%llu, expected +%llu (dirty pages evicted)", what,
		     (unsigned long long)(st.spill_writes - prev.spill_writes), (unsigned long long)writes);
	cr_assert(st.fetches - prev.fetches >= fetch_min && st.fetches - prev.fetches <= fetch_max,
		  "%s: fetches +%llu, pages read back: %llu..%llu", what,
		  (unsigned long long)(st.fetches - prev.fetches), (unsigned long long)fetch_min,
		  (unsigned long long)fetch_max);
	if (e->pin_op)
		cr_assert_eq(st.fetches - prev.fetches, fetch_min, "%s: fetches", what);
	cr_assert_eq(st.runs_read_through - prev.runs_read_through, e->runs_through,
		     "%s: runs_read_through +%llu, expected +%llu", what,
		     (unsigned long long)(st.runs_read_through - prev.runs_read_through),
		     (unsigned long long)e->runs_through);
	cr_assert_eq(st.spill_errors, 0, "%s: spill_errors %llu", what, (unsigned long long)st.spill_errors);
	cr_assert_eq(st.spill_enabled, 1);
	cr_assert_eq(st.frames, sh->frames);

	/* the file holds a slot for every spilled page, and no more than one a page */
	const struct kvr_spill_stats ss = spill_stats_of(sh->pool);
	cr_assert_geq(ss.slots_used, n_written - n_res, "%s: %llu slots for %llu spilled pages", what,
		      (unsigned long long)ss.slots_used, (unsigned long long)(n_written - n_res));
	cr_assert_eq(ss.slots_used, n_slot, "%s: %llu slots used, %llu pages hold one", what,
		     (unsigned long long)ss.slots_used, (unsigned long long)n_slot);
	cr_assert_geq(st.spill_file_bytes, ss.slots_high * ss.slot_bytes);
	free(live), free(res), free(was_written);
}

static void effect_written(struct op_effect *e, uint32_t id)
{
	cr_assert_lt(e->n_written, 64u);
	e->written[e->n_written++] = id;
}

/* Release the model's long pins on pages of (s, l) from logical `from` on. */
static void sh_release_pins(struct shadow *sh, uint32_t s, uint32_t l, uint32_t from)
{
	for (uint32_t i = from; i < sh->n_pages[s][l]; i++) {
		const uint32_t id = sh_id(sh, s, l, i);
		while (sh->long_pins[id]) {
			cr_assert_eq(kvr_pool_unpin(sh->pool, &id, 1), 0, "unpin %u: %s", id,
				     kvr_pool_last_error(sh->pool));
			sh->long_pins[id]--;
		}
	}
}

static uint32_t sh_distinct_long_pins(const struct shadow *sh)
{
	uint32_t n = 0;
	for (uint32_t id = 0; id < sh->cap; id++)
		n += sh->long_pins[id] > 0;
	return n;
}

/* A random written logical page: returns false when there is none. */
static bool sh_pick(struct shadow *sh, uint32_t *s_out, uint32_t *l_out, uint32_t *i_out)
{
	for (int tries = 0; tries < 32; tries++) {
		const uint32_t s = rnd(SH_SEQS), l = rnd(SH_LAYERS);
		if (!sh->open[s] || !sh->n_pages[s][l])
			continue;
		const uint32_t i = rnd(sh->n_pages[s][l]);
		if (!sh->page[s][l][i])
			continue;
		*s_out = s, *l_out = l, *i_out = i;
		return true;
	}
	return false;
}

/* Appends: layer 0 through ingest (whole pages, so n_tokens = n_pages·p
 * and truncation works), layer 1 through reserve + write_page. Past the
 * capacity both fail with -ENOMEM and change nothing. */
static void op_append(struct shadow *sh, uint32_t s, uint32_t l, uint32_t n, struct op_effect *e)
{
	const bool room = sh_live_count(sh) + n <= sh->cap;
	const uint32_t before = sh->n_pages[s][l];
	unsigned char *pages[8];
	if (l == 0) {
		const size_t rows = (size_t)n * P;
		unsigned char *k = malloc(rows * ROW_ELEMS * EB), *v = malloc(rows * ROW_ELEMS * EB);
		fill_random(k, rows * ROW_ELEMS * EB);
		fill_random(v, rows * ROW_ELEMS * EB);
		unsigned char *tk = malloc(P * ROW_ELEMS * EB), *tv = malloc(P * ROW_ELEMS * EB);
		struct kvr_tail_tile tail = { tk, tv };
		const int err = kvr_pool_ingest(sh->pool, s, 0, (uint64_t)before * P, (uint32_t)rows, k, v,
						&tail);
		if (!room) {
			cr_assert_eq(err, -ENOMEM, "ingest past the capacity: %d", err);
			sh->enomem_appends++;
		} else {
			cr_assert_eq(err, 0, "ingest %u pages: %s", n, kvr_pool_last_error(sh->pool));
			sh->n_pages[s][0] = before + n;
			for (uint32_t i = 0; i < n; i++) {
				pages[i] = malloc(PAGE_BYTES);
				hnd_from_rows(k + (size_t)i * P * ROW_ELEMS * EB, v + (size_t)i * P * ROW_ELEMS * EB,
					      ROW_ELEMS, pages[i]);
				sh_record(sh, s, 0, before + i, pages[i]);
				effect_written(e, sh_id(sh, s, 0, before + i));
			}
		}
		free(k), free(v), free(tk), free(tv);
		return;
	}
	const int err = kvr_pool_reserve(sh->pool, s, l, n);
	if (!room) {
		cr_assert_eq(err, -ENOMEM, "reserve past the capacity: %d", err);
		sh->enomem_appends++;
		return;
	}
	cr_assert_eq(err, 0, "reserve %u: %s", n, kvr_pool_last_error(sh->pool));
	sh->n_pages[s][l] = before + n;
	/* reserved, not written: neither resident nor counted */
	const uint32_t first = sh_id(sh, s, l, before);
	cr_assert_eq(kvr_pool_page_resident(sh->pool, first), 0, "a reserved page is resident before it is written");
	for (uint32_t i = 0; i < n; i++) {
		const uint64_t stride = rnd(2) ? ROW_ELEMS : ROW_ELEMS + 8 * rnd(4);
		pages[i] = malloc(PAGE_BYTES);
		struct rows r = rows_random(stride, pages[i]);
		cr_assert_eq(kvr_pool_write_page(sh->pool, s, l, before + i, r.k, r.v, r.stride), 0,
			     "write_page: %s", kvr_pool_last_error(sh->pool));
		rows_free(&r);
		const uint32_t id = sh_id(sh, s, l, before + i);
		cr_assert_eq(kvr_pool_page_resident(sh->pool, id), 1, "a page just written is not resident");
		sh_record(sh, s, l, before + i, pages[i]);
		effect_written(e, id);
	}
}

static void op_rewrite(struct shadow *sh, struct op_effect *e)
{
	uint32_t s, l, i;
	if (!sh_pick(sh, &s, &l, &i))
		return;
	sh_release_pins(sh, s, l, i);
	const uint32_t old = sh_id(sh, s, l, i);
	const int shared = kvr_pool_page_refcount(sh->pool, old) > 1;
	if (shared && sh_live_count(sh) >= sh->cap)
		return; /* copy-on-write needs a page */
	unsigned char *page = malloc(PAGE_BYTES);
	struct rows r = rows_random(ROW_ELEMS + 8 * rnd(3), page);
	cr_assert_eq(kvr_pool_write_page(sh->pool, s, l, i, r.k, r.v, r.stride), 0, "rewrite: %s",
		     kvr_pool_last_error(sh->pool));
	rows_free(&r);
	const uint32_t id = sh_id(sh, s, l, i);
	cr_assert(shared ? id != old : id == old, "copy-on-write: page %u became %u (shared %d)", old, id,
		  shared);
	sh->cows += shared;
	cr_assert_eq(kvr_pool_page_resident(sh->pool, id), 1, "a page just rewritten is not resident");
	sh_record(sh, s, l, i, page);
	effect_written(e, id);
}

static void op_truncate(struct shadow *sh, uint32_t s, uint32_t l)
{
	const uint32_t keep = l == 0 && sh->n_pages[s][l] ? rnd(sh->n_pages[s][l]) : 0;
	sh_release_pins(sh, s, l, keep);
	cr_assert_eq(kvr_pool_truncate(sh->pool, s, l, (uint64_t)keep * P), 0, "truncate: %s",
		     kvr_pool_last_error(sh->pool));
	sh_drop(sh, s, l, keep);
}

static void op_close(struct shadow *sh, uint32_t s)
{
	for (uint32_t l = 0; l < SH_LAYERS; l++)
		sh_release_pins(sh, s, l, 0);
	cr_assert_eq(kvr_pool_seq_close(sh->pool, s), 0, "close: %s", kvr_pool_last_error(sh->pool));
	for (uint32_t l = 0; l < SH_LAYERS; l++)
		sh_drop(sh, s, l, 0);
	sh->open[s] = false;
}

static void op_fork(struct shadow *sh, uint32_t src, uint32_t dst)
{
	cr_assert_eq(kvr_pool_seq_fork(sh->pool, src, dst), 0, "fork: %s", kvr_pool_last_error(sh->pool));
	sh->open[dst] = true;
	for (uint32_t l = 0; l < SH_LAYERS; l++) {
		sh->n_pages[dst][l] = sh->n_pages[src][l];
		for (uint32_t i = 0; i < sh->n_pages[src][l]; i++) {
			sh->page[dst][l][i] = malloc(PAGE_BYTES);
			memcpy(sh->page[dst][l][i], sh->page[src][l][i], PAGE_BYTES);
			sh->summary[dst][l][i] = malloc(SUMMARY_BYTES);
			memcpy(sh->summary[dst][l][i], sh->summary[src][l][i], SUMMARY_BYTES);
			cr_assert_eq(sh_id(sh, dst, l, i), sh_id(sh, src, l, i), "a fork shares its pages");
		}
	}
}

/* Pin n random pages (some listed twice), compare their memory, and unpin
 * them again or keep some pins for later operations. Past the frames the
 * pin fails with -ENOMEM and takes nothing. */
static void op_pin(struct shadow *sh, uint32_t n, struct op_effect *e)
{
	uint32_t ids[32], where[32][3];
	uint32_t m = 0;
	for (uint32_t j = 0; j < n && m < 32; j++) {
		uint32_t s, l, i;
		if (!sh_pick(sh, &s, &l, &i))
			return;
		ids[m] = sh_id(sh, s, l, i);
		where[m][0] = s, where[m][1] = l, where[m][2] = i;
		m++;
		if (m < 32 && rnd(6) == 0) { /* the same page twice */
			ids[m] = ids[m - 1];
			memcpy(where[m], where[m - 1], sizeof(where[m]));
			m++;
		}
	}
	/* distinct pages the frames must hold: these and those pinned already */
	uint8_t *need = calloc(sh->cap, 1);
	uint32_t distinct = 0;
	for (uint32_t id = 0; id < sh->cap; id++)
		if (sh->long_pins[id])
			need[id] = 1, distinct++;
	for (uint32_t j = 0; j < m; j++)
		if (!need[ids[j]])
			need[ids[j]] = 1, distinct++;
	free(need);
	const uint64_t pinned_before = stats_of(sh->pool).pinned_pages;
	const int err = kvr_pool_pin(sh->pool, ids, m);
	e->pin_op = true;
	if (distinct > sh->frames) {
		cr_assert_eq(err, -ENOMEM, "pinning %u distinct pages in %u frames: %d", distinct,
			     sh->frames, err);
		cr_assert_eq(stats_of(sh->pool).pinned_pages, pinned_before, "a failed pin took pins");
		sh->nomem_pins++;
		return;
	}
	cr_assert_eq(err, 0, "pin %u pages (%u distinct with the held ones, %u frames): %s", m, distinct,
		     sh->frames, kvr_pool_last_error(sh->pool));
	sh->fetch_ops++;
	unsigned char *run = aligned_alloc(64, HEAD_BYTES);
	for (uint32_t j = 0; j < m; j++) {
		const unsigned char *expect = sh->page[where[j][0]][where[j][1]][where[j][2]];
		cr_assert_eq(kvr_pool_page_resident(sh->pool, ids[j]), 1);
		const unsigned char *data = kvr_pool_page_data(sh->pool, ids[j]);
		cr_assert_not_null(data);
		cr_assert_eq(memcmp(data, expect, PAGE_BYTES), 0, "pinned page %u (seq %u layer %u page %u) differs",
			     ids[j], where[j][0], where[j][1], where[j][2]);
		const uint32_t h = rnd(NKV);
		kvr_pool_gather_head(sh->pool, ids[j], h, run);
		cr_assert_eq(memcmp(run, expect + h * HEAD_BYTES, HEAD_BYTES), 0, "gather_head of a pinned page");
	}
	free(run);
	/* keep a few, release the rest */
	for (uint32_t j = 0; j < m; j++) {
		if (sh_distinct_long_pins(sh) < SH_MAX_LONG_PINS && rnd(8) == 0) {
			sh->long_pins[ids[j]]++;
			continue;
		}
		cr_assert_eq(kvr_pool_unpin(sh->pool, &ids[j], 1), 0, "unpin %u: %s", ids[j],
			     kvr_pool_last_error(sh->pool));
	}
}

/* Read n random (page, head) runs through the pool; compare each with the
 * model; nothing past the runs is written. */
static void op_read_runs(struct shadow *sh, uint32_t n, struct op_effect *e)
{
	uint32_t ids[64], heads[64];
	const unsigned char *expect[64];
	int32_t results[64];
	uint32_t m = 0;
	for (uint32_t j = 0; j < n && m < 64; j++) {
		uint32_t s, l, i;
		if (!sh_pick(sh, &s, &l, &i))
			break;
		ids[m] = sh_id(sh, s, l, i);
		heads[m] = rnd(NKV);
		expect[m] = sh->page[s][l][i] + heads[m] * HEAD_BYTES;
		results[m] = 77;
		e->runs_through += !sh->res[ids[m]];
		m++;
	}
	if (!m)
		return;
	const size_t bytes = (size_t)(m + 1) * HEAD_BYTES;
	unsigned char *dst = aligned_alloc(64, bytes);
	for (size_t i = 0; i < bytes; i++)
		dst[i] = sentinel(i);
	cr_assert_eq(kvr_pool_read_runs(sh->pool, ids, heads, m, dst, results), 0, "read_runs: %s",
		     kvr_pool_last_error(sh->pool));
	for (uint32_t j = 0; j < m; j++) {
		cr_assert_eq(results[j], 0, "results[%u] = %d", j, results[j]);
		cr_assert_eq(memcmp(dst + (size_t)j * HEAD_BYTES, expect[j], HEAD_BYTES), 0,
			     "run %u of %u (page %u head %u, %s) differs", j, m, ids[j], heads[j],
			     sh->res[ids[j]] ? "resident" : "spilled");
	}
	for (size_t i = (size_t)m * HEAD_BYTES; i < bytes; i++)
		cr_assert_eq(dst[i], sentinel(i), "read_runs wrote past its %u runs", m);
	free(dst);
	sh->read_ops++;
}

static void op_touch(struct shadow *sh, uint32_t n)
{
	uint32_t ids[24];
	uint32_t m = 0;
	for (uint32_t j = 0; j < n && m < 22; j++) {
		uint32_t s, l, i;
		if (sh_pick(sh, &s, &l, &i))
			ids[m++] = sh_id(sh, s, l, i);
	}
	ids[m++] = UINT32_MAX; /* out of range: ignored */
	ids[m++] = sh->cap + 3;
	kvr_pool_touch(sh->pool, ids, m);
}

static void op_spill_all(struct shadow *sh)
{
	uint32_t resident = 0;
	for (uint32_t id = 0; id < sh->cap; id++)
		resident += sh->live[id] && sh->written[id] && sh->res[id];
	const uint32_t pinned = sh_distinct_long_pins(sh);
	const int n = kvr_pool_spill_all(sh->pool);
	cr_assert_eq(n, (int)(resident - pinned), "spill_all evicted %d of %u resident pages (%u pinned): %s",
		     n, resident, pinned, kvr_pool_last_error(sh->pool));
	const struct kvr_pool_stats st = stats_of(sh->pool);
	cr_assert_eq(st.resident_pages, pinned, "after spill_all: %llu resident, %u pinned",
		     (unsigned long long)st.resident_pages, pinned);
	sh->spill_all_ops++;
}

/* The summaries of every page are those recorded when it was written. */
static void sh_check_summaries(struct shadow *sh)
{
	for (uint32_t s = 0; s < SH_SEQS; s++)
		for (uint32_t l = 0; sh->open[s] && l < SH_LAYERS; l++)
			for (uint32_t i = 0; i < sh->n_pages[s][l]; i++) {
				const void *sum = kvr_pool_summary(sh->pool, s, l, i);
				cr_assert_not_null(sum);
				cr_assert_eq(memcmp(sum, sh->summary[s][l][i], SUMMARY_BYTES), 0,
					     "summary of seq %u layer %u page %u changed", s, l, i);
			}
}

static void run_shadow(uint32_t spill_flags, uint64_t seed, uint32_t n_ops)
{
	enum { CAP = 160, FRAMES = 16 };
	rng_state = seed;
	char dir[PATH_MAX];
	dir_make(dir, sizeof(dir));
	struct shadow sh = { .cap = CAP, .frames = FRAMES };
	sh.pool = make_pool(dir, CAP, FRAMES, SH_SEQS, SH_LAYERS, spill_flags);
	for (uint32_t s = 0; s < SH_SEQS; s++)
		for (uint32_t l = 0; l < SH_LAYERS; l++) {
			sh.page[s][l] = calloc(CAP, sizeof(void *));
			sh.summary[s][l] = calloc(CAP, sizeof(void *));
		}
	sh.live = calloc(CAP, 1), sh.written = calloc(CAP, 1), sh.has_slot = calloc(CAP, 1);
	sh.res = calloc(CAP, 1), sh.long_pins = calloc(CAP, sizeof(uint32_t));
	sh.st = stats_of(sh.pool);
	for (uint32_t s = 0; s < 2; s++) {
		cr_assert_eq(kvr_pool_seq_open(sh.pool, s), 0);
		sh.open[s] = true;
	}

	char what[96];
	for (uint32_t op = 0; op < n_ops; op++) {
		struct op_effect e = { .n_written = 0 };
		const uint32_t s = rnd(SH_SEQS), l = rnd(SH_LAYERS);
		uint32_t dice = rnd(100);
		/* one stretch in four only grows, so the capacity is reached */
		if ((op / 250) % 4 == 3 && dice >= 40 && dice < 48)
			dice = 0;
		const char *name;
		if (!sh.open[s]) {
			/* open it, or fork an open one into it */
			uint32_t src = rnd(SH_SEQS);
			if (rnd(2) && sh.open[src] && sh_live_count(&sh) < CAP) {
				name = "fork";
				op_fork(&sh, src, s);
			} else {
				name = "open";
				cr_assert_eq(kvr_pool_seq_open(sh.pool, s), 0);
				sh.open[s] = true;
			}
		} else if (dice < 30) {
			name = l ? "reserve+write" : "ingest";
			op_append(&sh, s, l, 1 + rnd(3), &e);
		} else if (dice < 40) {
			name = "rewrite";
			op_rewrite(&sh, &e);
		} else if (dice < 45) {
			name = "truncate";
			op_truncate(&sh, s, l);
		} else if (dice < 48) {
			name = "close";
			op_close(&sh, s);
		} else if (dice < 58) {
			name = "touch";
			op_touch(&sh, 1 + rnd(12));
		} else if (dice < 74) {
			name = "pin";
			op_pin(&sh, 1 + (rnd(10) ? rnd(6) : rnd(24)), &e);
		} else if (dice < 96) {
			name = "read_runs";
			op_read_runs(&sh, 1 + rnd(40), &e);
		} else {
			name = "spill_all";
			op_spill_all(&sh);
		}
		snprintf(what, sizeof(what), "op %u (%s)", op, name);
		sh_settle(&sh, &e, what);
		const uint32_t live = sh_live_count(&sh);
		sh.max_live = live > sh.max_live ? live : sh.max_live;
		if (op % 50 == 49) {
			validate(sh.pool, what);
			sh_check_summaries(&sh);
		}
		sh.ops++;
	}

	/* everything, once more: every page by pin and by runs */
	for (uint32_t s = 0; s < SH_SEQS; s++)
		for (uint32_t l = 0; sh.open[s] && l < SH_LAYERS; l++)
			for (uint32_t i = 0; i < sh.n_pages[s][l]; i++) {
				check_page_runs(sh.pool, sh_id(&sh, s, l, i), sh.page[s][l][i], "final runs");
				check_page_pinned(sh.pool, sh_id(&sh, s, l, i), sh.page[s][l][i], "final pin");
			}
	const struct kvr_pool_stats st = stats_of(sh.pool);
	cr_assert_gt(st.evictions, 0);
	cr_assert_gt(st.spill_writes, 0);
	cr_assert_gt(st.fetches, 0);
	cr_assert_gt(st.runs_read_through, 0);
	cr_assert_lt(st.spill_writes, st.evictions, "clean pages were evicted without a write at least once");
	cr_assert_gt(sh.nomem_pins, 0, "the run never pinned past the frames");
	cr_assert_gt(sh.enomem_appends, 0, "the run never reached the capacity (at most %llu pages live)",
		     (unsigned long long)sh.max_live);
	cr_assert_gt(sh.cows, 0, "the run never wrote a shared page");
	cr_assert_gt(sh.spill_all_ops, 0);
	cr_log_info("shadow (flags %#x): %llu ops, %llu evictions, %llu spill writes, %llu fetches, "
		    "%llu runs read through, %llu -ENOMEM pins, %llu -ENOMEM appends, %llu copies on write, "
		    "at most %llu pages live",
		    spill_flags, (unsigned long long)sh.ops, (unsigned long long)st.evictions,
		    (unsigned long long)st.spill_writes, (unsigned long long)st.fetches,
		    (unsigned long long)st.runs_read_through, (unsigned long long)sh.nomem_pins,
		    (unsigned long long)sh.enomem_appends, (unsigned long long)sh.cows,
		    (unsigned long long)sh.max_live);
	validate(sh.pool, "end");

	for (uint32_t id = 0; id < CAP; id++)
		while (sh.long_pins[id]) {
			cr_assert_eq(kvr_pool_unpin(sh.pool, &id, 1), 0);
			sh.long_pins[id]--;
		}
	kvr_pool_destroy(sh.pool);
	for (uint32_t s = 0; s < SH_SEQS; s++)
		for (uint32_t l = 0; l < SH_LAYERS; l++) {
			sh_drop(&sh, s, l, 0);
			free(sh.page[s][l]), free(sh.summary[s][l]);
		}
	free(sh.live), free(sh.written), free(sh.has_slot), free(sh.res), free(sh.long_pins);
	th_dir_remove(dir);
}

Test(pool_spill, shadow_round_trip)
{
	run_shadow(0, 0x8f3a1c5be2d47a19ull, 3000);
}

/* The same on pread/pwrite through the page cache. */
Test(pool_spill, shadow_round_trip_sync_buffered)
{
	run_shadow(KVR_SPILL_SYNC | KVR_SPILL_BUFFERED, 0x1234abcd5678ef01ull, 3000);
}

/* ================================================================== 2. clean pages */

/* A page read back and not changed keeps its slot: evicting it again writes
 * nothing. */
Test(pool_spill, clean_pages_not_rewritten)
{
	enum { CAP = 64, FRAMES = 8, N = 20 };
	char dir[PATH_MAX];
	struct kvr_pool *pool = open_spilling(dir, CAP, FRAMES, 1);
	unsigned char *expect[N];
	uint32_t ids[N];
	append_pages(pool, 0, 0, N, expect, ids);

	struct kvr_pool_stats st = stats_of(pool);
	cr_assert_eq(st.resident_pages + st.spilled_pages, N);
	cr_assert_eq(st.evictions, st.spill_writes, "every page evicted so far was dirty");
	const int evicted = kvr_pool_spill_all(pool);
	cr_assert_eq(evicted, (int)st.resident_pages, "spill_all: %d", evicted);
	st = stats_of(pool);
	cr_assert_eq(st.spill_writes, N, "each page written out once: %llu", (unsigned long long)st.spill_writes);
	cr_assert_eq(st.evictions, N);
	cr_assert_eq(st.spilled_pages, N);
	cr_assert_eq(st.resident_pages, 0);
	cr_assert_eq(st.fetches, 0);
	cr_assert_eq(spill_stats_of(pool).slots_used, N);
	for (uint32_t i = 0; i < N; i++)
		cr_assert_eq(kvr_pool_page_resident(pool, ids[i]), 0);

	/* read each back (pin, compare, unpin): one fetch each, and evicting
	 * the earlier ones to make room writes nothing */
	for (uint32_t i = 0; i < N; i++)
		check_page_pinned(pool, ids[i], expect[i], "read back");
	st = stats_of(pool);
	cr_assert_eq(st.fetches, N, "fetches %llu", (unsigned long long)st.fetches);
	cr_assert_eq(st.spill_writes, N, "clean pages were written again: %llu", (unsigned long long)st.spill_writes);
	cr_assert_leq(st.resident_pages, FRAMES);
	cr_assert_gt(st.resident_pages, 0);
	cr_assert_eq(st.evictions, N + (N - st.resident_pages), "evictions %llu with %llu pages resident",
		     (unsigned long long)st.evictions, (unsigned long long)st.resident_pages);
	cr_assert_eq(spill_stats_of(pool).slots_used, N, "clean resident pages keep their slots");

	const int again = kvr_pool_spill_all(pool);
	cr_assert_eq(again, (int)st.resident_pages);
	st = stats_of(pool);
	cr_assert_eq(st.evictions, 2 * N, "evictions %llu", (unsigned long long)st.evictions);
	cr_assert_eq(st.spill_writes, N, "clean pages were written again: %llu", (unsigned long long)st.spill_writes);
	cr_assert_eq(st.spilled_pages, N);
	cr_assert_eq(spill_stats_of(pool).pages_written, N);

	/* a page changed after it came back is dirty again */
	check_page_pinned(pool, ids[3], expect[3], "before rewrite");
	struct rows r = rows_random(ROW_ELEMS, expect[3]);
	cr_assert_eq(kvr_pool_write_page(pool, 0, 0, 3, r.k, r.v, r.stride), 0);
	rows_free(&r);
	cr_assert_eq(kvr_pool_spill_all(pool), 1);
	st = stats_of(pool);
	cr_assert_eq(st.spill_writes, N + 1, "a rewritten page must be written out: %llu",
		     (unsigned long long)st.spill_writes);
	cr_assert_eq(spill_stats_of(pool).slots_used, N, "the rewritten page's old slot was not freed");
	for (uint32_t i = 0; i < N; i++)
		check_page_runs(pool, ids[i], expect[i], "after rewrite");
	close_spilling(pool, dir, expect, N);
}

/* ================================================================== 3. pins */

Test(pool_spill, pin_limits)
{
	enum { F = KVR_POOL_MIN_FRAMES, CAP = 64, N = 24 };
	char dir[PATH_MAX];
	struct kvr_pool *pool = open_spilling(dir, CAP, F, 1);
	unsigned char *expect[N];
	uint32_t ids[N];
	append_pages(pool, 0, 0, N, expect, ids);
	cr_assert_leq(stats_of(pool).resident_pages, F);
	cr_assert_gt(kvr_pool_spill_all(pool), 0);

	/* F spilled pages fit */
	uint32_t first[F];
	for (uint32_t i = 0; i < F; i++) {
		first[i] = ids[i];
		cr_assert_eq(kvr_pool_page_resident(pool, first[i]), 0);
	}
	cr_assert_eq(kvr_pool_pin(pool, first, F), 0, "%s", kvr_pool_last_error(pool));
	struct kvr_pool_stats st = stats_of(pool);
	cr_assert_eq(st.pinned_pages, F);
	cr_assert_eq(st.resident_pages, F);
	for (uint32_t i = 0; i < F; i++) {
		cr_assert_eq(kvr_pool_page_resident(pool, first[i]), 1);
		cr_assert_eq(memcmp(kvr_pool_page_data(pool, first[i]), expect[i], PAGE_BYTES), 0);
	}

	/* one more spilled page: -ENOMEM, no pin taken, nothing moved */
	uint32_t more = ids[N - 1];
	cr_assert_eq(kvr_pool_page_resident(pool, more), 0);
	const uint64_t fetches = st.fetches, evictions = st.evictions;
	cr_assert_eq(kvr_pool_pin(pool, &more, 1), -ENOMEM);
	st = stats_of(pool);
	cr_assert_eq(st.pinned_pages, F);
	cr_assert_eq(st.fetches, fetches);
	cr_assert_eq(st.evictions, evictions);
	cr_assert_eq(kvr_pool_page_resident(pool, more), 0);
	cr_assert_eq(kvr_pool_unpin(pool, &more, 1), -EINVAL, "the failed pin left a pin");

	/* a page already pinned pinned again needs no frame */
	cr_assert_eq(kvr_pool_pin(pool, &first[2], 1), 0, "%s", kvr_pool_last_error(pool));
	/* a list of resident pinned pages plus one spilled: all or nothing */
	uint32_t mixed[3] = { first[0], first[1], more };
	cr_assert_eq(kvr_pool_pin(pool, mixed, 3), -ENOMEM);
	cr_assert_eq(kvr_pool_unpin(pool, &first[2], 1), 0, "the second pin of a page");

	/* with every frame pinned nothing can be evicted */
	cr_assert_eq(kvr_pool_spill_all(pool), 0);
	for (uint32_t i = 0; i < F; i++) {
		cr_assert_eq(kvr_pool_page_resident(pool, first[i]), 1, "pinned page %u left RAM", first[i]);
		cr_assert_eq(memcmp(kvr_pool_page_data(pool, first[i]), expect[i], PAGE_BYTES), 0);
	}
	/* read-through of spilled pages still works beside F pins */
	check_page_runs(pool, more, expect[N - 1], "beside full pins");

	/* unpin: one pin each; a second unpin is refused, and a list with an
	 * unpinned page changes nothing */
	cr_assert_eq(kvr_pool_unpin(pool, first, F - 1), 0, "%s", kvr_pool_last_error(pool));
	cr_assert_eq(stats_of(pool).pinned_pages, 1);
	cr_assert_eq(kvr_pool_unpin(pool, &first[0], 1), -EINVAL, "unpin of an unpinned page");
	uint32_t bad_unpin[2] = { first[F - 1], first[0] };
	cr_assert_eq(kvr_pool_unpin(pool, bad_unpin, 2), -EINVAL);
	cr_assert_eq(stats_of(pool).pinned_pages, 1, "a refused unpin dropped a pin");
	cr_assert_eq(kvr_pool_unpin(pool, &first[F - 1], 1), 0);
	cr_assert_eq(stats_of(pool).pinned_pages, 0);
	cr_assert_eq(kvr_pool_unpin(pool, &first[F - 1], 1), -EINVAL);

	/* a page listed twice is pinned twice, and takes one frame */
	uint32_t twice[F + 1];
	for (uint32_t i = 0; i < F; i++)
		twice[i] = ids[F + i];
	twice[F] = ids[F];
	cr_assert_eq(kvr_pool_pin(pool, twice, F + 1), 0, "F distinct pages, one listed twice: %s",
		     kvr_pool_last_error(pool));
	cr_assert_eq(stats_of(pool).pinned_pages, F);
	cr_assert_eq(kvr_pool_unpin(pool, twice, F), 0);
	cr_assert_eq(stats_of(pool).pinned_pages, 1);
	cr_assert_eq(kvr_pool_spill_all(pool), F - 1);
	cr_assert_eq(kvr_pool_page_resident(pool, ids[F]), 1, "the page pinned twice is still pinned");
	cr_assert_eq(kvr_pool_unpin(pool, &ids[F], 1), 0);
	cr_assert_eq(kvr_pool_unpin(pool, &ids[F], 1), -EINVAL);

	/* more distinct pages than frames in one call: -ENOMEM, nothing pinned */
	cr_assert_eq(kvr_pool_pin(pool, ids, F + 1), -ENOMEM);
	cr_assert_eq(stats_of(pool).pinned_pages, 0);

	/* bad ids: a free page, out of range; one bad id pins none */
	cr_assert_eq(kvr_pool_truncate(pool, 0, 0, 0), 0);
	append_pages(pool, 0, 0, 4, NULL, NULL);
	uint32_t live_id = 0;
	cr_assert_eq(kvr_pool_lookup(pool, 0, 0, 0, &live_id), 0);
	uint32_t free_id = CAP;
	for (uint32_t id = 0; id < CAP && free_id == CAP; id++)
		if (kvr_pool_page_refcount(pool, id) == 0)
			free_id = id;
	cr_assert_lt(free_id, CAP);
	cr_assert_eq(kvr_pool_pin(pool, &free_id, 1), -EINVAL);
	uint32_t one_bad[3] = { live_id, free_id, live_id };
	cr_assert_eq(kvr_pool_pin(pool, one_bad, 3), -EINVAL);
	uint32_t out_of_range[2] = { live_id, UINT32_MAX };
	cr_assert_eq(kvr_pool_pin(pool, out_of_range, 2), -EINVAL);
	uint32_t past_cap[2] = { live_id, CAP };
	cr_assert_eq(kvr_pool_pin(pool, past_cap, 2), -EINVAL);
	cr_assert_eq(stats_of(pool).pinned_pages, 0, "a refused pin took pins");
	cr_assert_eq(kvr_pool_unpin(pool, &live_id, 1), -EINVAL, "a refused pin left a pin");
	cr_assert_eq(kvr_pool_unpin(pool, &free_id, 1), -EINVAL);
	cr_assert_eq(kvr_pool_page_resident(pool, free_id), -EINVAL);
	cr_assert_eq(kvr_pool_page_resident(pool, UINT32_MAX), -EINVAL);
	cr_assert_eq(kvr_pool_pin(pool, NULL, 0), 0, "an empty pin");
	cr_assert_eq(kvr_pool_unpin(pool, NULL, 0), 0, "an empty unpin");

	/* read_runs with a free page: -EINVAL, nothing read */
	uint32_t rp[2] = { live_id, free_id }, rh[2] = { 0, 1 };
	unsigned char *dst = aligned_alloc(64, 2 * HEAD_BYTES);
	for (size_t i = 0; i < 2 * HEAD_BYTES; i++)
		dst[i] = sentinel(i);
	const uint64_t through = stats_of(pool).runs_read_through;
	cr_assert_eq(kvr_pool_read_runs(pool, rp, rh, 2, dst, NULL), -EINVAL);
	for (size_t i = 0; i < 2 * HEAD_BYTES; i++)
		cr_assert_eq(dst[i], sentinel(i), "read_runs refused but wrote byte %zu", i);
	cr_assert_eq(stats_of(pool).runs_read_through, through);
	cr_assert_eq(kvr_pool_read_runs(pool, rp, rh, 0, dst, NULL), 0, "no runs");
	free(dst);

	close_spilling(pool, dir, expect, N);
}

/* ================================================================== 4. eviction order */

/* Touched pages go last. The reference bits are first put in a known state:
 * one eviction after the fill has swept them (CLOCK may evict on its second
 * pass when every bit was set), then half the resident pages are touched
 * before each write and the writes evict fewer pages than the others. */
Test(pool_spill, eviction_order)
{
	enum { CAP = 1024, F = 256 };
	char dir[PATH_MAX];
	struct kvr_pool *pool = open_spilling(dir, CAP, F, 1);
	append_pages(pool, 0, 0, F, NULL, NULL);
	cr_assert_eq(stats_of(pool).resident_pages, F);
	cr_assert_eq(stats_of(pool).evictions, 0, "RAM not full yet");
	/* write until the first eviction */
	uint32_t written = F;
	while (stats_of(pool).evictions == 0) {
		cr_assert_lt(written, 2 * F, "no eviction after %u pages in %u frames", written, F);
		append_pages(pool, 0, 0, 1, NULL, NULL);
		written++;
	}
	/* the resident pages of the fill; every other one is touched */
	uint32_t touched[F], untouched[F], n_t = 0, n_u = 0;
	for (uint32_t i = 0; i < F; i++) {
		uint32_t id;
		cr_assert_eq(kvr_pool_lookup(pool, 0, 0, i, &id), 0);
		if (kvr_pool_page_resident(pool, id) != 1)
			continue;
		if ((n_t + n_u) % 2 == 0)
			touched[n_t++] = id;
		else
			untouched[n_u++] = id;
	}
	cr_assert_geq(n_t + n_u, F / 2, "the first eviction took %u of %u pages", F - (n_t + n_u), F);
	const uint64_t ev0 = stats_of(pool).evictions;
	/* write until at least F/8 more evictions, touching before each write */
	uint32_t extra = 0;
	while (stats_of(pool).evictions - ev0 < F / 8) {
		kvr_pool_touch(pool, touched, n_t);
		append_pages(pool, 0, 0, 1, NULL, NULL);
		extra++;
		cr_assert_lt(extra, 2 * F);
	}
	const uint64_t evicted = stats_of(pool).evictions - ev0;
	cr_assert_lt(evicted, n_u, "the batch evicted %llu pages, more than the %u untouched: "
				   "the test needs smaller batches", (unsigned long long)evicted, n_u);
	uint32_t gone_u = 0;
	for (uint32_t i = 0; i < n_t; i++)
		cr_assert_eq(kvr_pool_page_resident(pool, touched[i]), 1,
			     "touched page %u (%u of %u) was evicted while %u untouched pages were in RAM",
			     touched[i], i, n_t, n_u);
	for (uint32_t i = 0; i < n_u; i++)
		gone_u += kvr_pool_page_resident(pool, untouched[i]) == 0;
	cr_assert_gt(gone_u, 0, "no untouched page was evicted");
	cr_log_info("eviction_order: %u touched stayed, %u of %u untouched evicted, %llu evictions",
		    n_t, gone_u, n_u, (unsigned long long)evicted);

	/* read_runs touches the pages it reads: read the untouched ones that
	 * are left, and they outlive the touched pages (not touched since) */
	uint32_t left[F], heads[F], n_left = 0;
	for (uint32_t i = 0; i < n_u; i++)
		if (kvr_pool_page_resident(pool, untouched[i]) == 1)
			left[n_left] = untouched[i], heads[n_left++] = 0;
	if (n_left) {
		unsigned char *dst = aligned_alloc(64, n_left * HEAD_BYTES);
		const uint64_t ev1 = stats_of(pool).evictions;
		uint32_t more = 0;
		while (stats_of(pool).evictions - ev1 < n_t / 2) {
			cr_assert_eq(kvr_pool_read_runs(pool, left, heads, n_left, dst, NULL), 0);
			append_pages(pool, 0, 0, 1, NULL, NULL);
			cr_assert_lt(++more, 2 * F);
		}
		for (uint32_t i = 0; i < n_left; i++)
			cr_assert_eq(kvr_pool_page_resident(pool, left[i]), 1,
				     "page %u read by read_runs before each write was evicted", left[i]);
		free(dst);
	}
	close_spilling(pool, dir, NULL, 0);
}

/* ================================================================== 5. faults */

/* The slot holding page `expect` (found by reading the file behind the
 * pool's back); KVR_SPILL_NO_SLOT when none does. */
static uint32_t slot_of(struct kvr_pool *pool, const unsigned char *expect)
{
	struct kvr_spill *sp = kvr_pool_spill_file(pool);
	const struct kvr_spill_stats ss = spill_stats_of(pool);
	const int fd = kvr_spill_fd(sp);
	cr_assert_geq(fd, 0);
	const size_t align = ss.dio_align > 64 ? ss.dio_align : 64;
	unsigned char *buf = aligned_alloc(align, (ss.run_stride + align - 1) / align * align);
	uint32_t found = KVR_SPILL_NO_SLOT;
	for (uint32_t s = 0; s < ss.slots_high; s++) {
		const ssize_t got = pread(fd, buf, ss.run_stride, (off_t)kvr_spill_slot_offset(sp, s));
		cr_assert_eq(got, (ssize_t)ss.run_stride, "pread slot %u: %s", s, strerror(errno));
		if (!memcmp(buf, expect, HEAD_BYTES)) {
			cr_assert_eq(found, KVR_SPILL_NO_SLOT, "two slots hold the page");
			found = s;
		}
	}
	free(buf);
	return found;
}

/* Flip one byte of run `run` of `slot` in the file. */
static void flip_in_file(struct kvr_pool *pool, uint32_t slot, uint32_t run, size_t at)
{
	struct kvr_spill *sp = kvr_pool_spill_file(pool);
	const struct kvr_spill_stats ss = spill_stats_of(pool);
	const int fd = kvr_spill_fd(sp);
	const size_t align = ss.dio_align > 64 ? ss.dio_align : 64;
	unsigned char *buf = aligned_alloc(align, (ss.run_stride + align - 1) / align * align);
	const off_t off = (off_t)(kvr_spill_slot_offset(sp, slot) + run * ss.run_stride);
	cr_assert_eq(pread(fd, buf, ss.run_stride, off), (ssize_t)ss.run_stride);
	buf[at] ^= 0x10;
	cr_assert_eq(pwrite(fd, buf, ss.run_stride, off), (ssize_t)ss.run_stride, "pwrite: %s", strerror(errno));
	free(buf);
}

static void inject(struct kvr_pool *pool, uint32_t kind, uint32_t slot, uint32_t count)
{
	const struct kvr_spill_fault f = { .kind = kind, .slot = slot, .skip = 0, .count = count };
	kvr_spill_inject(kvr_pool_spill_file(pool), &f);
}

Test(pool_spill, read_faults)
{
	enum { CAP = 64, F = KVR_POOL_MIN_FRAMES, N = 16 };
	char dir[PATH_MAX];
	struct kvr_pool *pool = open_spilling(dir, CAP, F, 1);
	unsigned char *expect[N];
	uint32_t ids[N];
	append_pages(pool, 0, 0, N, expect, ids);
	cr_assert_geq(kvr_pool_spill_all(pool), 0);
	cr_assert_eq(stats_of(pool).spilled_pages, N);
	/* pages 0 and 1 back in RAM; X = page 5 is the one that fails; Y = 9 is
	 * spilled and must read fine */
	cr_assert_eq(kvr_pool_pin(pool, ids, 2), 0);
	cr_assert_eq(kvr_pool_unpin(pool, ids, 2), 0);
	const uint32_t X = ids[5], Y = ids[9];
	const uint32_t slot = slot_of(pool, expect[5]);
	cr_assert_neq(slot, KVR_SPILL_NO_SLOT, "page X is in no slot of the file");
	cr_assert_eq(kvr_pool_page_slot(pool, X), slot, "kvr_pool_page_slot");

	const uint32_t kinds[3] = { KVR_SPILL_FAULT_READ_EIO, KVR_SPILL_FAULT_READ_SHORT,
				    KVR_SPILL_FAULT_READ_CORRUPT };
	const int errs[3] = { -EIO, -EIO, -EBADMSG };
	enum { M = 7 };
	const uint32_t pages[M] = { ids[0], X, Y, X, ids[1], Y, X };
	const uint32_t heads[M] = { 1, 0, 1, 1, 0, 0, 0 };
	for (int k = 0; k < 4; k++) {
		/* k < 3: an injected fault on X's slot; k == 3: a byte of X's
		 * run 1 flipped in the file, which only run 1 reads */
		const int want = k < 3 ? errs[k] : -EBADMSG;
		if (k < 3)
			inject(pool, kinds[k], slot, 0);
		else
			flip_in_file(pool, slot, 1, 123);
		const uint64_t errors0 = stats_of(pool).spill_errors;
		unsigned char *dst = aligned_alloc(64, M * HEAD_BYTES);
		int32_t results[M];
		for (int j = 0; j < M; j++)
			results[j] = 55;
		const int ret = kvr_pool_read_runs(pool, pages, heads, M, dst, results);
		cr_assert_eq(ret, want, "fault %d: read_runs returned %d", k, ret);
		for (int j = 0; j < M; j++) {
			const bool bad = pages[j] == X && (k < 3 || heads[j] == 1);
			cr_assert_eq(results[j], bad ? want : 0, "fault %d: results[%d] = %d", k, j, results[j]);
			if (bad)
				continue;
			const unsigned char *e = pages[j] == X ? expect[5] : pages[j] == Y ? expect[9]
							 : pages[j] == ids[0] ? expect[0] : expect[1];
			cr_assert_eq(memcmp(dst + j * HEAD_BYTES, e + heads[j] * HEAD_BYTES, HEAD_BYTES), 0,
				     "fault %d: run %d is wrong", k, j);
		}
		free(dst);
		cr_assert_gt(stats_of(pool).spill_errors, errors0, "fault %d: spill_errors did not grow", k);

		/* pin of X (beside a resident page and Y) fails: nothing pinned, X spilled */
		uint32_t list[3] = { ids[0], Y, X };
		const int pin = kvr_pool_pin(pool, list, 3);
		cr_assert_eq(pin, want, "fault %d: pin returned %d", k, pin);
		cr_assert_eq(stats_of(pool).pinned_pages, 0, "fault %d: a failed pin took pins", k);
		cr_assert_eq(kvr_pool_unpin(pool, &ids[0], 1), -EINVAL);
		cr_assert_eq(kvr_pool_page_resident(pool, X), 0, "fault %d: X left the file", k);
		validate(pool, "after a failed pin");

		/* cleared: everything reads back */
		if (k < 3)
			inject(pool, KVR_SPILL_FAULT_NONE, 0, 0);
		else
			flip_in_file(pool, slot, 1, 123);
		check_page_runs(pool, X, expect[5], "fault cleared");
		check_page_runs(pool, Y, expect[9], "fault cleared");
		check_page_pinned(pool, X, expect[5], "fault cleared");
		/* X in a frame again: put it back in the file, clean (same slot) */
		cr_assert_geq(kvr_pool_spill_all(pool), 1);
		cr_assert_eq(slot_of(pool, expect[5]), slot, "X moved slots without being changed");
	}
	for (uint32_t i = 0; i < N; i++)
		check_page_runs(pool, ids[i], expect[i], "end");
	close_spilling(pool, dir, expect, N);
}

/* Writes that fail leave the pages in RAM, whole, and count as errors. */
Test(pool_spill, write_faults_keep_pages)
{
	enum { CAP = 64, F = 12, N = 10 };
	char dir[PATH_MAX];
	struct kvr_pool *pool = open_spilling(dir, CAP, F, 1);
	unsigned char *expect[N];
	uint32_t ids[N];
	append_pages(pool, 0, 0, N, expect, ids);
	const uint32_t kinds[3] = { KVR_SPILL_FAULT_WRITE_EIO, KVR_SPILL_FAULT_WRITE_SHORT,
				    KVR_SPILL_FAULT_NOSPC };
	const int errs[3] = { -EIO, -EIO, -ENOSPC };
	for (int k = 0; k < 3; k++) {
		inject(pool, kinds[k], KVR_SPILL_NO_SLOT, 0);
		const int ret = kvr_pool_spill_all(pool);
		cr_assert_eq(ret, errs[k], "fault %d: spill_all returned %d", k, ret);
		const struct kvr_pool_stats st = stats_of(pool);
		cr_assert_eq(st.resident_pages, N, "fault %d: %llu pages resident", k,
			     (unsigned long long)st.resident_pages);
		cr_assert_eq(st.spilled_pages, 0);
		cr_assert_eq(st.spill_writes, 0);
		cr_assert_gt(st.spill_errors, 0);
		cr_assert_eq(spill_stats_of(pool).slots_used, 0, "a failed spill kept slots");
		inject(pool, KVR_SPILL_FAULT_NONE, 0, 0);
		for (uint32_t i = 0; i < N; i++)
			check_page_pinned(pool, ids[i], expect[i], "after a failed spill");
	}
	cr_assert_eq(kvr_pool_spill_all(pool), N);
	for (uint32_t i = 0; i < N; i++)
		check_page_runs(pool, ids[i], expect[i], "spilled after the faults");
	close_spilling(pool, dir, expect, N);
}

/* ================================================================== 6. parameters */

Test(pool_spill, bad_params)
{
	char dir[PATH_MAX];
	dir_make(dir, sizeof(dir));
	struct kvr_pool *pool = NULL;
	char err[512];

	/* fewer frames than the minimum */
	struct kvr_pool_params pp = params_of(dir, 64, KVR_POOL_MIN_FRAMES - 1, 1, 1, 0);
	err[0] = '\0';
	cr_assert_eq(kvr_pool_create(&pp, &pool, err, sizeof(err)), -EINVAL);
	cr_assert_null(pool);
	cr_assert_neq(err[0], '\0', "no message for ram_bytes below the minimum");
	/* a byte short of the minimum is short too */
	pp.ram_bytes = KVR_POOL_MIN_FRAMES * PAGE_BYTES - 1;
	cr_assert_eq(kvr_pool_create(&pp, &pool, err, sizeof(err)), -EINVAL, "ram_bytes of 7.99 pages");
	/* exactly the minimum works */
	pp.ram_bytes = KVR_POOL_MIN_FRAMES * PAGE_BYTES;
	pool = create_or_die(&pp);
	cr_assert_eq(stats_of(pool).frames, KVR_POOL_MIN_FRAMES);
	kvr_pool_destroy(pool);
	pool = NULL;

	/* the spill tier needs HND */
	pp = params_of(dir, 64, 16, 1, 1, 0);
	pp.layout = KVR_POOL_LAYOUT_NHD;
	err[0] = '\0';
	cr_assert_eq(kvr_pool_create(&pp, &pool, err, sizeof(err)), -EINVAL);
	cr_assert_null(pool);
	cr_assert_neq(err[0], '\0', "no message for NHD with ram_bytes");

	/* a directory that does not exist */
	char missing[PATH_MAX + 32];
	snprintf(missing, sizeof(missing), "%s/no-such-dir", dir);
	pp = params_of(missing, 64, 16, 1, 1, 0);
	err[0] = '\0';
	const int r = kvr_pool_create(&pp, &pool, err, sizeof(err));
	cr_assert_lt(r, 0, "a pool spilling into a missing directory was created");
	cr_assert_null(pool);
	cr_assert_not_null(strstr(err, missing), "message \"%s\" does not name %s", err, missing);
	cr_log_info("missing directory: %d, \"%s\"", r, err);

	/* RAM for the whole capacity: no spill tier */
	const uint64_t rams[2] = { 64, 100 };
	for (int i = 0; i < 2; i++) {
		pp = params_of(dir, 64, rams[i], 1, 1, 0);
		pool = create_or_die(&pp);
		struct kvr_pool_stats st = stats_of(pool);
		cr_assert_eq(st.spill_enabled, 0, "ram_bytes %llu pages >= capacity spills",
			     (unsigned long long)rams[i]);
		cr_assert_null(kvr_pool_spill_file(pool));
		cr_assert_eq(kvr_pool_seq_open(pool, 0), 0);
		unsigned char *expect[3];
		uint32_t ids[3];
		append_pages(pool, 0, 0, 3, expect, ids);
		/* the spill calls are no-ops */
		cr_assert_eq(kvr_pool_pin(pool, ids, 3), 0);
		cr_assert_eq(kvr_pool_unpin(pool, ids, 3), 0);
		cr_assert_eq(kvr_pool_unpin(pool, ids, 3), 0, "unpin without a spill tier is a no-op");
		kvr_pool_touch(pool, ids, 3);
		for (int j = 0; j < 3; j++) {
			cr_assert_eq(kvr_pool_page_resident(pool, ids[j]), 1);
			cr_assert_eq(kvr_pool_page_slot(pool, ids[j]), KVR_SPILL_NO_SLOT);
			cr_assert_eq(memcmp(kvr_pool_page_data(pool, ids[j]), expect[j], PAGE_BYTES), 0);
			check_page_runs(pool, ids[j], expect[j], "no spill tier");
		}
		cr_assert_eq(kvr_pool_spill_all(pool), 0);
		st = stats_of(pool);
		cr_assert_eq(st.spill_enabled, 0);
		cr_assert_eq(st.evictions, 0);
		cr_assert_eq(st.spilled_pages, 0);
		cr_assert_eq(st.pinned_pages, 0);
		cr_assert_eq(st.spill_file_bytes, 0);
		for (int j = 0; j < 3; j++)
			free(expect[j]);
		validate(pool, "no spill tier");
		kvr_pool_destroy(pool);
	}

	/* and ram_bytes 0, in the NHD layout too */
	for (uint32_t layout = 0; layout < 2; layout++) {
		pp = params_of(dir, 64, 0, 1, 1, 0);
		pp.layout = layout;
		pool = create_or_die(&pp);
		cr_assert_eq(stats_of(pool).spill_enabled, 0);
		cr_assert_null(kvr_pool_spill_file(pool));
		cr_assert_eq(kvr_pool_seq_open(pool, 0), 0);
		uint32_t id;
		append_pages(pool, 0, 0, 1, NULL, &id);
		cr_assert_eq(kvr_pool_pin(pool, &id, 1), 0);
		cr_assert_eq(kvr_pool_unpin(pool, &id, 1), 0);
		cr_assert_eq(kvr_pool_page_resident(pool, id), 1);
		kvr_pool_destroy(pool);
	}
	th_dir_remove(dir);
}

/* ================================================================== 7. capacity */

/* A pool holds many times its RAM; pages freed while spilled give their
 * slots back, and churn reuses the file instead of growing it. */
Test(pool_spill, capacity_beyond_ram)
{
	enum { F = 16, N = 8 * F, CAP = N + 16, SEQS = 4 };
	char dir[PATH_MAX];
	dir_make(dir, sizeof(dir));
	struct kvr_pool *pool = make_pool(dir, CAP, F, SEQS, 1, 0);
	unsigned char *expect[SEQS][N / SEQS];
	uint32_t ids[SEQS][N / SEQS];
	for (uint32_t s = 0; s < SEQS; s++) {
		cr_assert_eq(kvr_pool_seq_open(pool, s), 0);
		append_pages(pool, s, 0, N / SEQS, expect[s], ids[s]);
	}
	struct kvr_pool_stats st = stats_of(pool);
	cr_assert_eq(st.used_pages, N);
	cr_assert_leq(st.resident_pages, F);
	cr_assert_eq(st.resident_pages + st.spilled_pages, N);
	cr_assert_eq(st.evictions, st.spilled_pages, "only evicted pages are in the file");
	cr_assert_eq(st.spill_writes, st.spilled_pages, "every page evicted once, dirty");
	cr_assert_eq(spill_stats_of(pool).slots_used, st.spilled_pages);
	/* all exact: read through, then by pin */
	for (uint32_t s = 0; s < SEQS; s++)
		for (uint32_t i = 0; i < N / SEQS; i++)
			check_page_runs(pool, ids[s][i], expect[s][i], "read through");
	for (uint32_t s = 0; s < SEQS; s++)
		for (uint32_t i = 0; i < N / SEQS; i++)
			check_page_pinned(pool, ids[s][i], expect[s][i], "pinned");
	st = stats_of(pool);
	cr_assert_leq(st.resident_pages, F);
	cr_assert_eq(st.resident_pages + st.spilled_pages, N);

	/* closing a sequence frees its spilled pages' slots */
	uint32_t spilled = 0;
	for (uint32_t i = 0; i < N / SEQS; i++)
		spilled += kvr_pool_page_resident(pool, ids[0][i]) == 0;
	cr_assert_gt(spilled, 0);
	cr_assert_eq(kvr_pool_spill_all(pool), (int)st.resident_pages);
	spilled = N / SEQS;
	struct kvr_spill_stats ss = spill_stats_of(pool);
	cr_assert_eq(ss.slots_used, N);
	const uint64_t spilled0 = stats_of(pool).spilled_pages;
	cr_assert_eq(kvr_pool_seq_close(pool, 0), 0);
	st = stats_of(pool);
	cr_assert_eq(st.spilled_pages, spilled0 - spilled, "spilled_pages %llu after freeing %u spilled pages",
		     (unsigned long long)st.spilled_pages, spilled);
	cr_assert_eq(spill_stats_of(pool).slots_used, N - spilled, "the freed pages' slots were kept");
	for (uint32_t i = 0; i < N / SEQS; i++)
		free(expect[0][i]);

	/* churn: open, fill, spill, close; the file's slots are reused */
	const uint64_t high = spill_stats_of(pool).slots_high;
	const uint64_t file_bytes = stats_of(pool).spill_file_bytes;
	for (int round = 0; round < 12; round++) {
		cr_assert_eq(kvr_pool_seq_open(pool, 0), 0);
		unsigned char *e[N / SEQS];
		uint32_t id[N / SEQS];
		append_pages(pool, 0, 0, N / SEQS, e, id);
		cr_assert_geq(kvr_pool_spill_all(pool), 0);
		for (uint32_t i = 0; i < N / SEQS; i += 5)
			check_page_runs(pool, id[i], e[i], "churn");
		ss = spill_stats_of(pool);
		cr_assert_leq(ss.slots_high, high, "round %d: the file grew to %llu slots (was %llu)", round,
			      (unsigned long long)ss.slots_high, (unsigned long long)high);
		cr_assert_leq(stats_of(pool).spill_file_bytes, file_bytes, "round %d: the file grew", round);
		cr_assert_eq(kvr_pool_seq_close(pool, 0), 0);
		for (uint32_t i = 0; i < N / SEQS; i++)
			free(e[i]);
	}
	for (uint32_t s = 1; s < SEQS; s++)
		for (uint32_t i = 0; i < N / SEQS; i++)
			check_page_runs(pool, ids[s][i], expect[s][i], "after churn");
	validate(pool, "end");
	kvr_pool_destroy(pool);
	for (uint32_t s = 1; s < SEQS; s++)
		for (uint32_t i = 0; i < N / SEQS; i++)
			free(expect[s][i]);
	th_dir_remove(dir);
}

/* ================================================================== quantised pages */

/* Quantised pages spill as their quantised runs: a spilled K8V4 or K4V2
 * pool reads back exactly what an all-RAM pool of the same format holds. */
Test(pool_spill, quantised_pages_spill)
{
	enum { CAP = 48, F = 8, N = 24 };
	const uint32_t formats[2] = { KVR_KV_K8V4, KVR_KV_K4V2 };
	for (int fi = 0; fi < 2; fi++) {
		char dir[PATH_MAX];
		dir_make(dir, sizeof(dir));
		struct kvr_pool_params pp = params_of(dir, CAP, F, 1, 1, 0);
		pp.kv_format = formats[fi];
		const uint64_t hb = kvr_kv_run_bytes(formats[fi], P, D, EB);
		cr_assert_gt(hb, 0);
		pp.capacity_bytes = CAP * hb * NKV;
		pp.ram_bytes = F * hb * NKV;
		struct kvr_pool *pool = create_or_die(&pp);
		pp.ram_bytes = 0;
		struct kvr_pool *ref = create_or_die(&pp);
		cr_assert_eq(kvr_pool_head_bytes(pool), hb);
		struct kvr_pool_stats st = stats_of(pool);
		cr_assert_eq(st.spill_enabled, 1);
		cr_assert_eq(st.frames, F);
		cr_assert_eq(kvr_pool_seq_open(pool, 0), 0);
		cr_assert_eq(kvr_pool_seq_open(ref, 0), 0);
		cr_assert_eq(kvr_pool_reserve(pool, 0, 0, N), 0);
		cr_assert_eq(kvr_pool_reserve(ref, 0, 0, N), 0);
		for (uint32_t i = 0; i < N; i++) {
			/* values on a grid, as a model's K and V would be */
			unsigned char *k = malloc(P * ROW_ELEMS * EB), *v = malloc(P * ROW_ELEMS * EB);
			for (uint64_t j = 0; j < P * ROW_ELEMS; j++) {
				kvr_store_f32(k, KVR_ELEM_F16, j, (float)((int)rnd(513) - 256) / 128.0f);
				kvr_store_f32(v, KVR_ELEM_F16, j, (float)((int)rnd(513) - 256) / 64.0f);
			}
			cr_assert_eq(kvr_pool_write_page(pool, 0, 0, i, k, v, ROW_ELEMS), 0, "%s",
				     kvr_pool_last_error(pool));
			cr_assert_eq(kvr_pool_write_page(ref, 0, 0, i, k, v, ROW_ELEMS), 0);
			free(k), free(v);
		}
		cr_assert_geq(kvr_pool_spill_all(pool), 0);
		st = stats_of(pool);
		cr_assert_eq(st.spilled_pages, N);
		unsigned char *a = aligned_alloc(64, NKV * hb + 64), *b = aligned_alloc(64, NKV * hb + 64);
		for (uint32_t i = 0; i < N; i++) {
			uint32_t id, rid, heads[NKV], pages[NKV], rpages[NKV];
			cr_assert_eq(kvr_pool_lookup(pool, 0, 0, i, &id), 0);
			cr_assert_eq(kvr_pool_lookup(ref, 0, 0, i, &rid), 0);
			for (uint32_t h = 0; h < NKV; h++)
				heads[h] = h, pages[h] = id, rpages[h] = rid;
			cr_assert_eq(kvr_pool_read_runs(pool, pages, heads, NKV, a, NULL), 0, "%s",
				     kvr_pool_last_error(pool));
			kvr_pool_gather_runs(ref, rpages, heads, NKV, b);
			cr_assert_eq(memcmp(a, b, NKV * hb), 0, "format %u page %u: spilled runs differ",
				     formats[fi], i);
			cr_assert_eq(kvr_pool_pin(pool, &id, 1), 0);
			cr_assert_eq(memcmp(kvr_pool_page_data(pool, id), kvr_pool_page_data(ref, rid), NKV * hb), 0,
				     "format %u page %u: pinned page differs", formats[fi], i);
			cr_assert_eq(kvr_pool_unpin(pool, &id, 1), 0);
			cr_assert_eq(memcmp(kvr_pool_summary(pool, 0, 0, i), kvr_pool_summary(ref, 0, 0, i),
					    SUMMARY_BYTES),
				     0, "summaries");
		}
		free(a), free(b);
		validate(pool, "quantised");
		kvr_pool_destroy(pool);
		kvr_pool_destroy(ref);
		th_dir_remove(dir);
	}
}

/* ================================================================== failed writes */

/* Read one logical page through read_runs and compare. */
static void check_logical(struct kvr_pool *pool, uint32_t seq, uint32_t logical, const unsigned char *expect,
			  const char *where)
{
	uint32_t id;
	cr_assert_eq(kvr_pool_lookup(pool, seq, 0, logical, &id), 0);
	check_page_runs(pool, id, expect, where);
}

/* A write that cannot get a frame (every frame pinned: -ENOMEM; the
 * eviction's write failing: -EIO) changes nothing: the table keeps its page
 * (a shared one too: no copy-on-write is left behind), the page keeps its
 * bytes, and the counts add up. */
Test(pool_spill, failed_writes_change_nothing)
{
	enum { F = KVR_POOL_MIN_FRAMES, CAP = 64, N = 16, M = 4 };
	char dir[PATH_MAX];
	struct kvr_pool *pool = open_spilling(dir, CAP, F, 3);
	cr_assert_eq(kvr_pool_seq_open(pool, 2), 0);
	unsigned char *expect[N], *own[M];
	uint32_t ids[N], own_ids[M];
	append_pages(pool, 0, 0, N, expect, ids);
	append_pages(pool, 2, 0, M, own, own_ids);
	cr_assert_geq(kvr_pool_spill_all(pool), 0);
	cr_assert_eq(kvr_pool_seq_fork(pool, 0, 1), 0, "%s", kvr_pool_last_error(pool));
	cr_assert_eq(kvr_pool_page_refcount(pool, ids[0]), 2);

	/* every frame pinned */
	cr_assert_eq(kvr_pool_pin(pool, &ids[N - F], F), 0, "%s", kvr_pool_last_error(pool));
	struct rows r = rows_random(ROW_ELEMS, NULL);
	struct kvr_pool_stats st0 = stats_of(pool);

	/* a page of its own, spilled */
	int err = kvr_pool_write_page(pool, 2, 0, 1, r.k, r.v, r.stride);
	cr_assert_eq(err, -ENOMEM, "rewrite of a spilled page with every frame pinned: %d", err);
	uint32_t id;
	cr_assert_eq(kvr_pool_lookup(pool, 2, 0, 1, &id), 0);
	cr_assert_eq(id, own_ids[1]);
	cr_assert_eq(kvr_pool_page_resident(pool, id), 0);
	check_logical(pool, 2, 1, own[1], "own page after a failed rewrite");

	/* a shared page, spilled: no copy is left in the table */
	err = kvr_pool_write_page(pool, 0, 0, 0, r.k, r.v, r.stride);
	cr_assert_eq(err, -ENOMEM, "rewrite of a shared page with every frame pinned: %d", err);
	cr_assert_eq(kvr_pool_lookup(pool, 0, 0, 0, &id), 0);
	cr_assert_eq(id, ids[0], "a failed copy-on-write left page %u in the table (was %u)", id, ids[0]);
	cr_assert_eq(kvr_pool_page_refcount(pool, ids[0]), 2, "a failed copy-on-write dropped a reference");
	check_logical(pool, 0, 0, expect[0], "shared page after a failed rewrite (seq 0)");
	check_logical(pool, 1, 0, expect[0], "shared page after a failed rewrite (seq 1)");

	/* a fresh page: reserved, the write refused, still unwritten */
	cr_assert_eq(kvr_pool_reserve(pool, 2, 0, 1), 0);
	err = kvr_pool_write_page(pool, 2, 0, M, r.k, r.v, r.stride);
	cr_assert_eq(err, -ENOMEM, "write of a fresh page with every frame pinned: %d", err);
	cr_assert_eq(kvr_pool_lookup(pool, 2, 0, M, &id), 0);
	cr_assert_eq(kvr_pool_page_resident(pool, id), 0);
	struct kvr_pool_stats st = stats_of(pool);
	cr_assert_eq(st.used_pages, st0.used_pages + 1);
	cr_assert_eq(st.resident_pages, F);
	cr_assert_eq(st.spilled_pages, st0.spilled_pages);
	cr_assert_eq(st.pinned_pages, F);
	validate(pool, "after writes refused for want of a frame");
	cr_assert_eq(kvr_pool_truncate(pool, 2, 0, 0), 0);
	cr_assert_eq(kvr_pool_unpin(pool, &ids[N - F], F), 0);

	/* RAM full of dirty pages, and their writes fail */
	cr_assert_eq(kvr_pool_seq_close(pool, 2), 0);
	cr_assert_eq(kvr_pool_seq_open(pool, 2), 0);
	unsigned char *fresh[F];
	append_pages(pool, 2, 0, F, fresh, NULL);
	st0 = stats_of(pool);
	cr_assert_eq(st0.resident_pages, F);
	inject(pool, KVR_SPILL_FAULT_WRITE_EIO, KVR_SPILL_NO_SLOT, 0);
	err = kvr_pool_write_page(pool, 0, 0, 1, r.k, r.v, r.stride);
	cr_assert_eq(err, -EIO, "rewrite of a shared page whose eviction fails: %d", err);
	cr_assert_eq(kvr_pool_lookup(pool, 0, 0, 1, &id), 0);
	cr_assert_eq(id, ids[1], "a failed copy-on-write left page %u in the table (was %u)", id, ids[1]);
	cr_assert_eq(kvr_pool_page_refcount(pool, ids[1]), 2, "a failed copy-on-write dropped a reference");
	err = kvr_pool_write_page(pool, 0, 0, 2, r.k, r.v, r.stride);
	cr_assert_eq(err, -EIO, "rewrite of a shared page whose eviction fails: %d", err);
	st = stats_of(pool);
	cr_assert_eq(st.used_pages, st0.used_pages, "a failed copy-on-write kept its page");
	cr_assert_eq(st.resident_pages, F);
	cr_assert_eq(st.spill_writes, st0.spill_writes);
	cr_assert_gt(st.spill_errors, st0.spill_errors);
	inject(pool, KVR_SPILL_FAULT_NONE, 0, 0);
	validate(pool, "after writes whose eviction failed");
	for (uint32_t i = 0; i < N; i++) {
		check_logical(pool, 0, i, expect[i], "seq 0 at the end");
		check_logical(pool, 1, i, expect[i], "seq 1 at the end");
	}
	for (uint32_t i = 0; i < F; i++)
		check_logical(pool, 2, i, fresh[i], "seq 2 at the end");
	/* and the writes go through now */
	unsigned char *page = malloc(PAGE_BYTES);
	hnd_from_rows(r.k, r.v, r.stride, page);
	cr_assert_eq(kvr_pool_write_page(pool, 0, 0, 1, r.k, r.v, r.stride), 0, "%s", kvr_pool_last_error(pool));
	check_logical(pool, 0, 1, page, "rewritten");
	check_logical(pool, 1, 1, expect[1], "the fork keeps its page");
	validate(pool, "end");
	rows_free(&r);
	free(page);
	kvr_pool_destroy(pool);
	for (uint32_t i = 0; i < N; i++)
		free(expect[i]);
	for (uint32_t i = 0; i < M; i++)
		free(own[i]);
	for (uint32_t i = 0; i < F; i++)
		free(fresh[i]);
	th_dir_remove(dir);
}

/* ================================================================== mixed pages */

/* Demoting (K8V4 -> K4V2 in place) a page that came back from the file
 * makes it dirty: evicted again it is written again, and reads back
 * demoted. A spilled page is either demoted or left as it was. */
Test(pool_spill, demote_dirties_a_clean_page)
{
	enum { CAP = 32, F = 8, N = 12 };
	char dir[PATH_MAX];
	dir_make(dir, sizeof(dir));
	struct kvr_pool_params pp = params_of(dir, CAP, F, 1, 1, 0);
	pp.kv_format = KVR_KV_MIXED;
	const uint64_t hb = kvr_kv_run_bytes(KVR_KV_MIXED, P, D, EB);
	cr_assert_gt(hb, 0);
	pp.capacity_bytes = CAP * hb * NKV;
	pp.ram_bytes = F * hb * NKV;
	struct kvr_pool *pool = create_or_die(&pp);
	pp.ram_bytes = 0;
	struct kvr_pool *ref = create_or_die(&pp);
	cr_assert_eq(stats_of(pool).frames, F);
	cr_assert_eq(kvr_pool_seq_open(pool, 0), 0);
	cr_assert_eq(kvr_pool_seq_open(ref, 0), 0);
	cr_assert_eq(kvr_pool_reserve(pool, 0, 0, N), 0);
	cr_assert_eq(kvr_pool_reserve(ref, 0, 0, N), 0);
	uint32_t ids[N], rids[N];
	for (uint32_t i = 0; i < N; i++) {
		unsigned char *k = malloc(P * ROW_ELEMS * EB), *v = malloc(P * ROW_ELEMS * EB);
		for (uint64_t j = 0; j < P * ROW_ELEMS; j++) {
			kvr_store_f32(k, KVR_ELEM_F16, j, (float)((int)rnd(513) - 256) / 128.0f);
			kvr_store_f32(v, KVR_ELEM_F16, j, (float)((int)rnd(513) - 256) / 64.0f);
		}
		cr_assert_eq(kvr_pool_write_page(pool, 0, 0, i, k, v, ROW_ELEMS), 0, "%s", kvr_pool_last_error(pool));
		cr_assert_eq(kvr_pool_write_page(ref, 0, 0, i, k, v, ROW_ELEMS), 0);
		free(k), free(v);
		cr_assert_eq(kvr_pool_lookup(pool, 0, 0, i, &ids[i]), 0);
		cr_assert_eq(kvr_pool_lookup(ref, 0, 0, i, &rids[i]), 0);
	}
	cr_assert_geq(kvr_pool_spill_all(pool), 0);
	unsigned char *a = aligned_alloc(64, NKV * hb), *b = aligned_alloc(64, NKV * hb);
	uint32_t heads[NKV], pages[NKV], rpages[NKV];

	/* a spilled page: demoted (then as the reference demoted), or refused and unchanged */
	const int spilled_ret = kvr_pool_demote(pool, ids[0]);
	if (spilled_ret == 0)
		cr_assert_eq(kvr_pool_demote(ref, rids[0]), 0);
	else
		cr_assert_eq(kvr_pool_page_format(pool, ids[0]), KVR_KV_K8V4, "a refused demote changed the format");
	cr_log_info("demote of a spilled page: %d", spilled_ret);

	/* a clean page back in RAM, demoted: dirty */
	cr_assert_eq(kvr_pool_pin(pool, &ids[1], 1), 0);
	cr_assert_eq(kvr_pool_unpin(pool, &ids[1], 1), 0);
	cr_assert_eq(kvr_pool_page_resident(pool, ids[1]), 1);
	cr_assert_eq(kvr_pool_demote(pool, ids[1]), 0, "%s", kvr_pool_last_error(pool));
	cr_assert_eq(kvr_pool_demote(ref, rids[1]), 0);
	cr_assert_eq(kvr_pool_page_format(pool, ids[1]), KVR_KV_K4V2);
	const uint64_t writes0 = stats_of(pool).spill_writes;
	cr_assert_eq(kvr_pool_spill_all(pool), 1);
	cr_assert_eq(stats_of(pool).spill_writes, writes0 + 1, "a demoted page was evicted without a write");
	for (uint32_t i = 0; i < N; i++) {
		for (uint32_t h = 0; h < NKV; h++)
			heads[h] = h, pages[h] = ids[i], rpages[h] = rids[i];
		cr_assert_eq(kvr_pool_read_runs(pool, pages, heads, NKV, a, NULL), 0, "%s", kvr_pool_last_error(pool));
		kvr_pool_gather_runs(ref, rpages, heads, NKV, b);
		cr_assert_eq(memcmp(a, b, NKV * hb), 0, "page %u read back differs from the reference", i);
		cr_assert_eq(kvr_pool_page_format(pool, ids[i]), kvr_pool_page_format(ref, rids[i]), "page %u format", i);
	}
	free(a), free(b);
	validate(pool, "end");
	kvr_pool_destroy(pool);
	kvr_pool_destroy(ref);
	th_dir_remove(dir);
}
