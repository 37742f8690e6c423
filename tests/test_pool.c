/* SPDX-License-Identifier: MIT */
/*
 * test_pool.c — the host page pool: layout round trips, the allocator against a
 * shadow model, capacity exhaustion, bad ids, ingestion of partial pages,
 * copy-on-write forks, NUMA placement, the node choice on synthetic
 * topologies, and the unlocked fallback.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <linux/capability.h>
#include <math.h>
#include <numaif.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "convert.h"
#include "half.h"
#include "helpers.h"
#include "kvquant.h"
#include "pool.h"
#include "summary.h"
#include "topology.h"
#include "transpose.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rng(void)
{
	return (uint32_t)(th_xorshift64(&rng_state) >> 11);
}

static void fill_bytes(void *dst, size_t n)
{
	unsigned char *p = dst;
	for (size_t i = 0; i < n; i++)
		p[i] = (unsigned char)rng();
}

static struct kvr_pool *make_pool(uint32_t p, uint32_t d, uint32_t n_kv, uint32_t t,
				  uint64_t capacity_pages, uint32_t layout, uint32_t max_seqs,
				  uint32_t n_layers)
{
	struct kvr_pool_params pp = {
		.n_layers = n_layers,
		.max_sequences = max_seqs,
		.layout = layout,
		.numa_node = -1,
		.keep_summaries = 1,
	};
	cr_assert_eq(kvr_page_geometry_init(&pp.geometry, p, d, n_kv, t), 0);
	pp.capacity_bytes = capacity_pages * pp.geometry.page_bytes;
	struct kvr_pool *pool = NULL;
	char err[256];
	cr_assert_eq(kvr_pool_create(&pp, &pool, err, sizeof(err)), 0, "%s", err);
	return pool;
}

/* ---- NHD -> pool -> HND run -> NHD slot, bit-exact ---- */

Test(pool, round_trip_every_shape)
{
	static const uint32_t ps[] = { 16, 32, 64 }, ds[] = { 64, 128 }, hs[] = { 1, 3, 8 };
	for (uint32_t layout = 0; layout < 2; layout++)
		for (uint32_t t = KVR_ELEM_F16; t <= KVR_ELEM_F32; t++)
			for (size_t a = 0; a < 3; a++)
				for (size_t b = 0; b < 2; b++)
					for (size_t c = 0; c < 3; c++) {
						struct kvr_pool *pool =
							make_pool(ps[a], ds[b], hs[c], t, 4, layout, 1, 1);
						struct kvr_pool_stats st;
						kvr_pool_get_stats(pool, &st);
						const size_t tile = st.page_bytes / 2;
						unsigned char *k = malloc(tile), *v = malloc(tile);
						unsigned char *k2 = calloc(1, tile), *v2 = calloc(1, tile);
						fill_bytes(k, tile); /* any bits, NaN patterns included */
						fill_bytes(v, tile);
						cr_assert_eq(kvr_pool_seq_open(pool, 0), 0);
						cr_assert_eq(kvr_pool_reserve(pool, 0, 0, 1), 0);
						cr_assert_eq(kvr_pool_write_page(pool, 0, 0, 0, k, v,
										 (uint64_t)hs[c] * ds[b]),
							     0, "%s", kvr_pool_last_error(pool));
						uint32_t id;
						cr_assert_eq(kvr_pool_lookup(pool, 0, 0, 0, &id), 0);
						struct kvr_page_geometry g;
						kvr_page_geometry_init(&g, ps[a], ds[b], hs[c], t);
						unsigned char *run = malloc(g.head_bytes);
						for (uint32_t h = 0; h < hs[c]; h++) {
							kvr_pool_gather_head(pool, id, h, run);
							/* the run is HND: element (kv, tok, dim) at kvr_hnd_index - h's base */
							const uint32_t tok = rng() % ps[a], dim = rng() % ds[b];
							const uint64_t at = kvr_hnd_index(&g, 0, 1, tok, dim);
							const uint64_t src = kvr_nhd_index(&g, tok, h, dim);
							cr_assert_eq(memcmp(run + at * g.elem_bytes,
									    v + src * g.elem_bytes, g.elem_bytes),
								     0);
							kvr_hnd_run_to_nhd_slot(&g, run, k2, v2, h);
						}
						/* the list form gives the same runs */
						uint32_t ids[3] = { id, id, id }, heads[3] = { hs[c] - 1, 0, hs[c] / 2 };
						unsigned char *runs = aligned_alloc(64, 3 * g.head_bytes);
						unsigned char *one = aligned_alloc(64, g.head_bytes);
						kvr_pool_gather_runs(pool, ids, heads, 3, runs);
						for (int r = 0; r < 3; r++) {
							kvr_pool_gather_head(pool, id, heads[r], one);
							cr_assert_eq(memcmp(runs + r * g.head_bytes, one, g.head_bytes), 0,
								     "gather_runs run %d", r);
						}
						free(runs), free(one);
						cr_assert_eq(memcmp(k, k2, tile), 0,
							     "K layout %u t=%u p=%u d=%u n_kv=%u", layout, t,
							     ps[a], ds[b], hs[c]);
						cr_assert_eq(memcmp(v, v2, tile), 0, "V");
						free(k), free(v), free(k2), free(v2), free(run);
						kvr_pool_destroy(pool);
					}
}

Test(pool, summaries_written_with_pages)
{
	struct kvr_pool *pool = make_pool(32, 64, 3, KVR_ELEM_BF16, 4, KVR_POOL_LAYOUT_HND, 1, 2);
	struct kvr_page_geometry g;
	kvr_page_geometry_init(&g, 32, 64, 3, KVR_ELEM_BF16);
	const size_t n = 32 * 3 * 64;
	uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
	for (size_t i = 0; i < n; i++)
		k[i] = kvr_f32_to_bf16((float)((int)(rng() % 2001) - 1000) / 100.0f);
	fill_bytes(v, n * 2);
	cr_assert_eq(kvr_pool_seq_open(pool, 0), 0);
	cr_assert_eq(kvr_pool_reserve(pool, 0, 1, 1), 0);
	cr_assert_eq(kvr_pool_write_page(pool, 0, 1, 0, k, v, 3 * 64), 0);
	const uint16_t *s = kvr_pool_summary(pool, 0, 1, 0);
	cr_assert_not_null(s);
	for (uint32_t h = 0; h < 3; h++)
		for (uint32_t d = 0; d < 64; d++) {
			float mn = INFINITY, mx = -INFINITY;
			for (uint32_t t = 0; t < 32; t++) {
				float x = kvr_bf16_to_f32(k[(t * 3 + h) * 64 + d]);
				mn = x < mn ? x : mn;
				mx = x > mx ? x : mx;
			}
			cr_assert_eq(kvr_bf16_to_f32(s[kvr_summary_index(&g, h, 0, d)]), mn);
			cr_assert_eq(kvr_bf16_to_f32(s[kvr_summary_index(&g, h, 1, d)]), mx);
		}
	cr_expect_null(kvr_pool_summary(pool, 0, 0, 0), "layer 0 has no page");
	free(k), free(v);
	kvr_pool_destroy(pool);
}

/* ---- quantised pages (K8V4, K4V2) ---- */

/* A quantised pool stores each KV head as the run kvquant.h's quantiser
 * makes from the same rows (ingest included, partial pages through the
 * tail), keeps the summaries of the unquantised keys, is smaller by the run
 * ratio, and refuses the NHD layout and head dims it cannot pack. */
Test(pool, quantised_pages_hold_the_quantised_runs)
{
	enum { P = 16, D = 64, NKV = 3, PAGES = 3 };
	const uint32_t formats[] = { KVR_KV_K8V4, KVR_KV_K4V2 };
	for (uint32_t fi = 0; fi < 2; fi++)
		for (uint32_t t = KVR_ELEM_F16; t <= KVR_ELEM_F32; t++) {
			struct kvr_pool_params pp = { .n_layers = 1, .max_sequences = 2, .numa_node = -1,
						      .keep_summaries = 1, .kv_format = formats[fi] };
			cr_assert_eq(kvr_page_geometry_init(&pp.geometry, P, D, NKV, t), 0);
			struct kvr_quant_geometry gq;
			cr_assert_eq(kvr_quant_geometry_init(&gq, P, D, NKV, formats[fi]), 0);
			pp.capacity_bytes = 8 * gq.page_bytes;
			struct kvr_pool *pool = NULL, *plain = NULL;
			char err[256];
			cr_assert_eq(kvr_pool_create(&pp, &pool, err, sizeof(err)), 0, "%s", err);
			struct kvr_pool_stats st;
			kvr_pool_get_stats(pool, &st);
			cr_assert_eq(st.page_bytes, gq.page_bytes);
			cr_assert_eq(st.capacity_pages, 8, "capacity counts quantised pages");
			cr_assert_eq(kvr_pool_head_bytes(pool), gq.head_bytes);
			pp.kv_format = KVR_KV_PLAIN;
			pp.capacity_bytes = 8 * pp.geometry.page_bytes;
			cr_assert_eq(kvr_pool_create(&pp, &plain, err, sizeof(err)), 0, "%s", err);

			/* PAGES·P − 5 tokens of values on a grid, ingested in three calls */
			const uint32_t n_tok = PAGES * P - 5, row = NKV * D;
			const size_t eb = kvr_elem_bytes(t);
			unsigned char *k = malloc((size_t)n_tok * row * eb), *v = malloc((size_t)n_tok * row * eb);
			for (size_t i = 0; i < (size_t)n_tok * row; i++) {
				kvr_store_f32(k, t, i, (float)((int)(rng() % 513) - 256) / 128.0f);
				kvr_store_f32(v, t, i, (float)((int)(rng() % 513) - 256) / 64.0f);
			}
			unsigned char *tk = malloc((size_t)P * row * eb), *tv = malloc((size_t)P * row * eb);
			unsigned char *pk = malloc((size_t)P * row * eb), *pv = malloc((size_t)P * row * eb);
			struct kvr_tail_tile tail = { tk, tv }, ptail = { pk, pv };
			const uint32_t cuts[] = { 0, 7, 2 * P + 1, n_tok };
			for (int pl = 0; pl < 2; pl++) {
				struct kvr_pool *pq = pl ? plain : pool;
				cr_assert_eq(kvr_pool_seq_open(pq, 0), 0);
				for (int c = 0; c < 3; c++)
					cr_assert_eq(kvr_pool_ingest(pq, 0, 0, cuts[c], cuts[c + 1] - cuts[c],
								     k + (size_t)cuts[c] * row * eb,
								     v + (size_t)cuts[c] * row * eb,
								     pl ? &ptail : &tail),
						     0, "%s", kvr_pool_last_error(pq));
			}
			cr_assert_eq(memcmp(tk, pk, (size_t)(n_tok % P) * row * eb), 0, "tail rows");
			unsigned char *want = malloc(gq.head_bytes), *got = malloc(gq.head_bytes);
			float scratch[D];
			for (uint32_t pg = 0; pg < n_tok / P; pg++) {
				uint32_t id;
				cr_assert_eq(kvr_pool_lookup(pool, 0, 0, pg, &id), 0);
				for (uint32_t h = 0; h < NKV; h++) {
					kvr_quant_run_from_nhd(&gq, k + (size_t)pg * P * row * eb,
							       v + (size_t)pg * P * row * eb, row, t, h, P, want,
							       scratch);
					kvr_pool_gather_head(pool, id, h, got);
					cr_assert_eq(memcmp(want, got, gq.head_bytes), 0,
						     "%s %s page %u head %u: not the quantised run",
						     formats[fi] == KVR_KV_K8V4 ? "K8V4" : "K4V2",
						     t == KVR_ELEM_F16 ? "f16" : t == KVR_ELEM_BF16 ? "bf16" : "f32", pg, h);
				}
				cr_assert_eq(memcmp(kvr_pool_summary(pool, 0, 0, pg),
						    kvr_pool_summary(plain, 0, 0, pg),
						    2ull * NKV * D * eb),
					     0, "page %u: summaries are not the unquantised keys'", pg);
			}
			free(want), free(got), free(k), free(v), free(tk), free(tv), free(pk), free(pv);
			cr_assert_eq(kvr_pool_validate(pool, NULL), 0, "%s", kvr_pool_last_error(pool));
			kvr_pool_destroy(pool);
			kvr_pool_destroy(plain);

			pp.kv_format = formats[fi];
			pp.layout = KVR_POOL_LAYOUT_NHD;
			cr_assert_eq(kvr_pool_create(&pp, &pool, err, sizeof(err)), -EINVAL);
			cr_assert(strstr(err, "HND"), "%s", err);
			pp.layout = KVR_POOL_LAYOUT_HND;
			pp.kv_format = 9;
			cr_assert_eq(kvr_pool_create(&pp, &pool, err, sizeof(err)), -EINVAL);
			cr_assert(strstr(err, "format"), "%s", err);
		}
}

/* A mixed pool writes K8V4 into unified room; demotion requantises a page
 * to K4V2 in place from its dequantised K8V4 values, leaves other pages and
 * the summaries alone, and refuses shared pages and single-format pools. */
Test(pool, mixed_pages_demote_in_place)
{
	enum { P = 16, D = 32, NKV = 2 };
	struct kvr_pool_params pp = { .n_layers = 1, .max_sequences = 2, .numa_node = -1,
				      .keep_summaries = 1, .kv_format = KVR_KV_MIXED };
	cr_assert_eq(kvr_page_geometry_init(&pp.geometry, P, D, NKV, KVR_ELEM_F16), 0);
	struct kvr_quant_geometry g8, g4;
	kvr_quant_geometry_init(&g8, P, D, 1, KVR_KV_K8V4);
	kvr_quant_geometry_init(&g4, P, D, 1, KVR_KV_K4V2);
	pp.capacity_bytes = 4 * NKV * g8.head_bytes;
	struct kvr_pool *pool = NULL;
	char err[256];
	cr_assert_eq(kvr_pool_create(&pp, &pool, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(kvr_pool_head_bytes(pool), g8.head_bytes, "runs keep the K8V4 room");
	const uint32_t row = NKV * D;
	uint16_t k[2 * P * NKV * D], v[2 * P * NKV * D];
	for (uint32_t i = 0; i < 2 * P * row; i++) {
		k[i] = kvr_f32_to_f16((float)((int)(rng() % 257) - 128) / 64.0f);
		v[i] = kvr_f32_to_f16((float)((int)(rng() % 257) - 128) / 32.0f);
	}
	cr_assert_eq(kvr_pool_seq_open(pool, 0), 0);
	cr_assert_eq(kvr_pool_reserve(pool, 0, 0, 2), 0);
	uint32_t id[2];
	for (uint32_t pg = 0; pg < 2; pg++) {
		cr_assert_eq(kvr_pool_write_page(pool, 0, 0, pg, k + pg * P * row, v + pg * P * row, row), 0);
		cr_assert_eq(kvr_pool_lookup(pool, 0, 0, pg, &id[pg]), 0);
		cr_assert_eq(kvr_pool_page_format(pool, id[pg]), KVR_KV_K8V4);
	}
	unsigned char before[2][NKV][1024], after[1024], want[1024];
	cr_assert_leq(g8.head_bytes, sizeof(after));
	for (uint32_t pg = 0; pg < 2; pg++)
		for (uint32_t h = 0; h < NKV; h++)
			kvr_pool_gather_head(pool, id[pg], h, before[pg][h]);
	unsigned char summary[2 * NKV * D * 2];
	memcpy(summary, kvr_pool_summary(pool, 0, 0, 1), sizeof(summary));
	cr_assert_eq(kvr_pool_demote(pool, id[1]), 0, "%s", kvr_pool_last_error(pool));
	cr_assert_eq(kvr_pool_page_format(pool, id[1]), KVR_KV_K4V2);
	cr_assert_eq(kvr_pool_page_format(pool, id[0]), KVR_KV_K8V4);
	float fk[P * D], fv[P * D], scratch[D];
	for (uint32_t h = 0; h < NKV; h++) {
		kvr_quant_run_to_nhd(&g8, before[1][h], P, fk, fv, D, KVR_ELEM_F32, 0);
		kvr_quant_run_from_nhd(&g4, fk, fv, D, KVR_ELEM_F32, 0, P, want, scratch);
		kvr_pool_gather_head(pool, id[1], h, after);
		cr_assert_eq(memcmp(after, want, g4.head_bytes), 0, "head %u: not the K4V2 requantisation", h);
		kvr_pool_gather_head(pool, id[0], h, after);
		cr_assert_eq(memcmp(after, before[0][h], g8.head_bytes), 0, "page 0 changed");
	}
	cr_assert_eq(memcmp(summary, kvr_pool_summary(pool, 0, 0, 1), sizeof(summary)), 0);
	cr_assert_eq(kvr_pool_demote(pool, id[1]), 0, "a K4V2 page stays as it is");
	cr_assert_eq(kvr_pool_page_ref(pool, id[0]), 0);
	cr_assert_eq(kvr_pool_demote(pool, id[0]), -EBUSY);
	cr_assert_eq(kvr_pool_page_format(pool, id[0]), KVR_KV_K8V4);
	cr_assert_eq(kvr_pool_page_unref(pool, id[0]), 0);
	cr_assert_eq(kvr_pool_demote(pool, 999), -EINVAL);
	kvr_pool_destroy(pool);
	struct kvr_pool *plain = make_pool(P, D, NKV, KVR_ELEM_F16, 4, KVR_POOL_LAYOUT_HND, 1, 1);
	cr_assert_eq(kvr_pool_seq_open(plain, 0), 0);
	cr_assert_eq(kvr_pool_reserve(plain, 0, 0, 1), 0);
	cr_assert_eq(kvr_pool_lookup(plain, 0, 0, 0, &id[0]), 0);
	cr_assert_eq(kvr_pool_demote(plain, id[0]), -EINVAL);
	kvr_pool_destroy(plain);
}

/* ---- allocator stress against a shadow model ---- */

#define STRESS_SEQS 24
#define STRESS_LAYERS 2
#define STRESS_CAP 400

struct shadow {
	int open[STRESS_SEQS];
	uint32_t pages[STRESS_SEQS][STRESS_LAYERS][STRESS_CAP];
	uint32_t n[STRESS_SEQS][STRESS_LAYERS];
	uint32_t external[STRESS_CAP]; /* references held outside tables */
};

/* Each page carries a tag naming its owner; a page handed out twice would be
 * overwritten and the tag check would fail. */
static void tag(struct kvr_pool *pool, uint32_t id, uint32_t value)
{
	memcpy(kvr_pool_page_data(pool, id), &value, sizeof(value));
}
static uint32_t tag_of(struct kvr_pool *pool, uint32_t id)
{
	uint32_t v;
	memcpy(&v, kvr_pool_page_data(pool, id), sizeof(v));
	return v;
}

static uint32_t refs_of(const struct shadow *sh, uint32_t id)
{
	uint32_t r = sh->external[id];
	for (int s = 0; s < STRESS_SEQS; s++)
		for (int l = 0; l < STRESS_LAYERS; l++)
			for (uint32_t i = 0; i < sh->n[s][l]; i++)
				r += sh->pages[s][l][i] == id;
	return r;
}

Test(pool, allocator_stress_matches_shadow)
{
	struct kvr_pool *pool = make_pool(16, 64, 1, KVR_ELEM_F16, STRESS_CAP, KVR_POOL_LAYOUT_HND,
					  STRESS_SEQS, STRESS_LAYERS);
	struct shadow *sh = calloc(1, sizeof(*sh));
	uint64_t used = 0, enomem = 0;
	for (int step = 0; step < 30000; step++) {
		const uint32_t s = rng() % STRESS_SEQS, l = rng() % STRESS_LAYERS;
		switch (rng() % 8) {
		case 0: /* open or close */
			if (!sh->open[s]) {
				cr_assert_eq(kvr_pool_seq_open(pool, s), 0);
				sh->open[s] = 1;
			} else if (rng() % 8 == 0) {
				cr_assert_eq(kvr_pool_seq_close(pool, s), 0);
				for (int ll = 0; ll < STRESS_LAYERS; ll++) {
					used -= sh->n[s][ll];
					sh->n[s][ll] = 0;
				}
				sh->open[s] = 0;
			}
			break;
		case 1:
		case 2:
		case 3: { /* reserve 1..6 pages */
			const uint32_t k = 1 + rng() % 6;
			int err = kvr_pool_reserve(pool, s, l, k);
			if (!sh->open[s]) {
				cr_assert_eq(err, -EINVAL);
				break;
			}
			if (err == -ENOMEM) {
				enomem++;
				uint32_t n;
				kvr_pool_n_pages(pool, s, l, &n);
				cr_assert_eq(n, sh->n[s][l], "failed reserve changed the table");
				break;
			}
			cr_assert_eq(err, 0, "%s", kvr_pool_last_error(pool));
			for (uint32_t i = 0; i < k; i++) {
				uint32_t id;
				cr_assert_eq(kvr_pool_lookup(pool, s, l, sh->n[s][l], &id), 0);
				tag(pool, id, s << 16 | l << 12 | (sh->n[s][l] & 0xfff));
				sh->pages[s][l][sh->n[s][l]++] = id;
				used++;
			}
			break;
		}
		case 4: /* truncate to zero tokens drops every page (reserve adds no tokens) */
			if (sh->open[s] && sh->n[s][l] && rng() % 4 == 0) {
				cr_assert_eq(kvr_pool_truncate(pool, s, l, 0), 0);
				used -= sh->n[s][l];
				sh->n[s][l] = 0;
			}
			break;
		case 5: { /* take an external reference to a random live page (a fork) */
			if (!sh->open[s] || !sh->n[s][l])
				break;
			const uint32_t id = sh->pages[s][l][rng() % sh->n[s][l]];
			cr_assert_eq(kvr_pool_page_ref(pool, id), 0);
			sh->external[id]++;
			break;
		}
		case 6: { /* drop an external reference; unref of a free page is refused */
			const uint32_t id = rng() % STRESS_CAP;
			if (sh->external[id]) {
				cr_assert_eq(kvr_pool_page_unref(pool, id), 0);
				sh->external[id]--;
			} else if (refs_of(sh, id) == 0) {
				cr_assert_eq(kvr_pool_page_unref(pool, id), -EINVAL,
					     "unref of free page %u accepted", id);
			}
			break;
		}
		case 7: /* bad ids never change anything */
			cr_assert_eq(kvr_pool_reserve(pool, STRESS_SEQS + s, l, 1), -EINVAL);
			cr_assert_eq(kvr_pool_reserve(pool, s, STRESS_LAYERS + l, 1), -EINVAL);
			break;
		}
		if (step % 500 == 0) {
			cr_assert_eq(kvr_pool_validate(pool, sh->external), 0, "step %d: %s", step,
				     kvr_pool_last_error(pool));
			for (int ss = 0; ss < STRESS_SEQS; ss++)
				for (int ll = 0; ll < STRESS_LAYERS; ll++)
					for (uint32_t i = 0; i < sh->n[ss][ll]; i++)
						cr_assert_eq(tag_of(pool, sh->pages[ss][ll][i]),
							     (uint32_t)(ss << 16 | ll << 12 | (i & 0xfff)),
							     "page owned twice");
		}
	}
	cr_assert_gt(enomem, 0, "the stress never reached capacity");
	(void)used;
	/* Release everything: nothing leaks, every page is reusable. */
	for (uint32_t s = 0; s < STRESS_SEQS; s++)
		if (sh->open[s])
			cr_assert_eq(kvr_pool_seq_close(pool, s), 0);
	for (uint32_t id = 0; id < STRESS_CAP; id++)
		while (sh->external[id]--)
			cr_assert_eq(kvr_pool_page_unref(pool, id), 0);
	struct kvr_pool_stats st;
	kvr_pool_get_stats(pool, &st);
	cr_assert_eq(st.used_pages, 0, "%llu pages leaked", (unsigned long long)st.used_pages);
	cr_assert_eq(kvr_pool_validate(pool, NULL), 0, "%s", kvr_pool_last_error(pool));
	unsigned char *seen = calloc(STRESS_CAP, 1);
	for (uint32_t i = 0; i < STRESS_CAP; i++) {
		uint32_t id;
		cr_assert_eq(kvr_pool_page_alloc(pool, &id), 0, "page %u of %u not reusable", i,
			     STRESS_CAP);
		cr_assert_lt(id, STRESS_CAP);
		cr_assert_eq(seen[id], 0, "page %u handed out twice", id);
		seen[id] = 1;
	}
	uint32_t extra;
	cr_assert_eq(kvr_pool_page_alloc(pool, &extra), -ENOMEM);
	free(seen);
	free(sh);
	kvr_pool_destroy(pool);
}

/* ---- ingestion ---- */

struct ingest_fixture {
	struct kvr_page_geometry g;
	uint64_t row_bytes;
	unsigned char *k, *v; /* all tokens' rows */
	struct kvr_tail_tile tail;
};

static void fixture_init(struct ingest_fixture *f, uint32_t p, uint32_t d, uint32_t n_kv,
			 uint32_t t, uint32_t n_tokens)
{
	kvr_page_geometry_init(&f->g, p, d, n_kv, t);
	f->row_bytes = (uint64_t)n_kv * d * f->g.elem_bytes;
	f->k = malloc(n_tokens * f->row_bytes);
	f->v = malloc(n_tokens * f->row_bytes);
	fill_bytes(f->k, n_tokens * f->row_bytes);
	fill_bytes(f->v, n_tokens * f->row_bytes);
	f->tail.keys = calloc(p, f->row_bytes);
	f->tail.values = calloc(p, f->row_bytes);
}

static void fixture_free(struct ingest_fixture *f)
{
	free(f->k), free(f->v), free(f->tail.keys), free(f->tail.values);
}

/* The pool page of (seq, layer, logical) holds tokens [logical*p, +p) of f. */
static void expect_page(struct kvr_pool *pool, struct ingest_fixture *f, uint32_t seq,
			uint32_t layer, uint32_t logical)
{
	uint32_t id;
	cr_assert_eq(kvr_pool_lookup(pool, seq, layer, logical, &id), 0);
	const uint64_t p = f->g.page_tokens;
	unsigned char *run = malloc(f->g.head_bytes);
	for (uint32_t h = 0; h < f->g.n_kv_heads; h++) {
		kvr_pool_gather_head(pool, id, h, run);
		const uint64_t hb = (uint64_t)f->g.head_dim * f->g.elem_bytes;
		for (uint64_t t = 0; t < p; t++) {
			const uint64_t tok = logical * p + t;
			cr_assert_eq(memcmp(run + t * hb, f->k + tok * f->row_bytes + h * hb, hb), 0,
				     "K of token %llu head %u", (unsigned long long)tok, h);
			cr_assert_eq(memcmp(run + (p + t) * hb, f->v + tok * f->row_bytes + h * hb, hb),
				     0, "V of token %llu head %u", (unsigned long long)tok, h);
		}
	}
	free(run);
}

Test(pool, ingest_partial_pages_in_chunks)
{
	const uint32_t p = 32, total = 5 + 27 + 64 + 1 + 100 + 3;
	struct ingest_fixture f;
	fixture_init(&f, p, 64, 3, KVR_ELEM_F16, total);
	struct kvr_pool *pool = make_pool(p, 64, 3, KVR_ELEM_F16, 64, KVR_POOL_LAYOUT_HND, 2, 2);
	cr_assert_eq(kvr_pool_seq_open(pool, 1), 0);
	static const uint32_t chunks[] = { 5, 27, 64, 1, 100, 3 };
	uint64_t pos = 0;
	for (size_t c = 0; c < 6; c++) {
		cr_assert_eq(kvr_pool_ingest(pool, 1, 1, pos, chunks[c], f.k + pos * f.row_bytes,
					     f.v + pos * f.row_bytes, &f.tail),
			     0, "%s", kvr_pool_last_error(pool));
		pos += chunks[c];
		uint32_t n_pages;
		uint64_t n_tokens;
		kvr_pool_n_pages(pool, 1, 1, &n_pages);
		kvr_pool_n_tokens(pool, 1, 1, &n_tokens);
		cr_expect_eq(n_tokens, pos);
		/* a page is reserved as soon as a token starts it */
		cr_expect_eq(n_pages, (pos + p - 1) / p, "after %llu tokens", (unsigned long long)pos);
		for (uint32_t lp = 0; lp < pos / p; lp++)
			expect_page(pool, &f, 1, 1, lp);
		/* the tail holds the rows past the last full page */
		const uint64_t in_tail = pos % p;
		cr_expect_eq(memcmp(f.tail.keys, f.k + (pos - in_tail) * f.row_bytes,
				    in_tail * f.row_bytes),
			     0, "tail keys after %llu tokens", (unsigned long long)pos);
		cr_expect_eq(memcmp(f.tail.values, f.v + (pos - in_tail) * f.row_bytes,
				    in_tail * f.row_bytes),
			     0);
	}
	/* out of order, repeated and gapped positions are refused */
	cr_expect_eq(kvr_pool_ingest(pool, 1, 1, pos - 1, 1, f.k, f.v, &f.tail), -EINVAL);
	cr_expect(strstr(kvr_pool_last_error(pool), "expected position 200, got 199") != NULL, "%s",
		  kvr_pool_last_error(pool));
	cr_expect_eq(kvr_pool_ingest(pool, 1, 1, pos + 5, 1, f.k, f.v, &f.tail), -EINVAL);
	cr_expect_eq(kvr_pool_ingest(pool, 1, 1, pos, 1, NULL, f.v, &f.tail), -EINVAL);
	cr_expect_eq(kvr_pool_ingest(pool, 1, 0, 0, 0, NULL, NULL, NULL), 0, "empty ingest is a no-op");
	cr_assert_eq(kvr_pool_validate(pool, NULL), 0, "%s", kvr_pool_last_error(pool));
	fixture_free(&f);
	kvr_pool_destroy(pool);
}

/* ---- capacity ---- */

struct snapshot {
	unsigned char *bytes;
	size_t n;
};

static struct snapshot snap_pages(struct kvr_pool *pool, uint32_t seq, uint32_t layer)
{
	uint32_t n_pages;
	kvr_pool_n_pages(pool, seq, layer, &n_pages);
	struct kvr_pool_stats st;
	kvr_pool_get_stats(pool, &st);
	struct snapshot s = { malloc(n_pages * (st.page_bytes + 4096) + 1), 0 };
	for (uint32_t i = 0; i < n_pages; i++) {
		uint32_t id;
		kvr_pool_lookup(pool, seq, layer, i, &id);
		memcpy(s.bytes + s.n, kvr_pool_page_data(pool, id), st.page_bytes);
		s.n += st.page_bytes;
		const void *sum = kvr_pool_summary(pool, seq, layer, i);
		memcpy(s.bytes + s.n, sum, 2 * 3 * 64 * 2);
		s.n += 2 * 3 * 64 * 2;
	}
	return s;
}

Test(pool, capacity_exhaustion_changes_nothing)
{
	const uint32_t p = 16, cap = 10;
	struct ingest_fixture f;
	fixture_init(&f, p, 64, 3, KVR_ELEM_F16, 400);
	struct kvr_pool *pool = make_pool(p, 64, 3, KVR_ELEM_F16, cap, KVR_POOL_LAYOUT_HND, 2, 1);
	cr_assert_eq(kvr_pool_seq_open(pool, 0), 0);
	cr_assert_eq(kvr_pool_ingest(pool, 0, 0, 0, 150, f.k, f.v, &f.tail), 0); /* 10 pages */
	struct snapshot before = snap_pages(pool, 0, 0);
	unsigned char *tail_before = malloc(p * f.row_bytes);
	memcpy(tail_before, f.tail.keys, p * f.row_bytes);

	/* 150 -> 170 needs an 11th page */
	cr_expect_eq(kvr_pool_ingest(pool, 0, 0, 150, 20, f.k + 150 * f.row_bytes,
				     f.v + 150 * f.row_bytes, &f.tail),
		     -ENOMEM);
	cr_expect(strstr(kvr_pool_last_error(pool), "capacity of 10 pages") != NULL, "%s",
		  kvr_pool_last_error(pool));
	cr_expect_eq(kvr_pool_reserve(pool, 0, 0, 1), -ENOMEM);
	cr_assert_eq(kvr_pool_seq_open(pool, 1), 0);
	cr_expect_eq(kvr_pool_ingest(pool, 1, 0, 0, 1, f.k, f.v, &f.tail), -ENOMEM);

	uint64_t n_tokens;
	kvr_pool_n_tokens(pool, 0, 0, &n_tokens);
	cr_expect_eq(n_tokens, 150);
	struct snapshot after = snap_pages(pool, 0, 0);
	cr_assert_eq(before.n, after.n);
	cr_expect_eq(memcmp(before.bytes, after.bytes, before.n), 0, "stored pages changed");
	cr_expect_eq(memcmp(tail_before, f.tail.keys, p * f.row_bytes), 0, "tail changed");
	cr_assert_eq(kvr_pool_validate(pool, NULL), 0, "%s", kvr_pool_last_error(pool));

	/* 10 more tokens fit in the partial page: still accepted */
	cr_expect_eq(kvr_pool_ingest(pool, 0, 0, 150, 10, f.k + 150 * f.row_bytes,
				     f.v + 150 * f.row_bytes, &f.tail),
		     0);
	for (uint32_t lp = 0; lp < 10; lp++)
		expect_page(pool, &f, 0, 0, lp);
	/* freeing a sequence makes room again */
	cr_assert_eq(kvr_pool_seq_close(pool, 0), 0);
	cr_expect_eq(kvr_pool_ingest(pool, 1, 0, 0, 1, f.k, f.v, &f.tail), 0);
	free(before.bytes), free(after.bytes), free(tail_before);
	fixture_free(&f);
	kvr_pool_destroy(pool);
}

/* ---- bad ids ---- */

Test(pool, invalid_ids_rejected)
{
	struct kvr_pool *pool = make_pool(16, 64, 1, KVR_ELEM_F16, 8, KVR_POOL_LAYOUT_HND, 4, 2);
	uint32_t id, n;
	uint64_t tok;
	cr_expect_eq(kvr_pool_seq_open(pool, 4), -EINVAL);
	cr_expect(strstr(kvr_pool_last_error(pool), "sequence id 4 out of range") != NULL);
	cr_expect_eq(kvr_pool_seq_close(pool, 0), -EINVAL);
	cr_expect_eq(kvr_pool_reserve(pool, 0, 0, 1), -EINVAL);
	cr_expect(strstr(kvr_pool_last_error(pool), "sequence 0 is not open") != NULL);
	cr_assert_eq(kvr_pool_seq_open(pool, 0), 0);
	cr_expect_eq(kvr_pool_seq_open(pool, 0), -EEXIST);
	cr_expect_eq(kvr_pool_reserve(pool, 0, 2, 1), -EINVAL);
	cr_expect(strstr(kvr_pool_last_error(pool), "layer 2 out of range") != NULL);
	cr_expect_eq(kvr_pool_n_pages(pool, 0, 2, &n), -EINVAL);
	cr_expect_eq(kvr_pool_n_tokens(pool, 9, 0, &tok), -EINVAL);
	cr_assert_eq(kvr_pool_reserve(pool, 0, 1, 2), 0);
	cr_expect_eq(kvr_pool_lookup(pool, 0, 1, 2, &id), -EINVAL);
	cr_expect(strstr(kvr_pool_last_error(pool), "logical page 2") != NULL);
	cr_expect_eq(kvr_pool_write_page(pool, 0, 1, 5, &id, &id, 64), -EINVAL);
	cr_expect_eq(kvr_pool_truncate(pool, 0, 1, 1), -EINVAL, "beyond the tokens ingested");
	cr_expect_eq(kvr_pool_page_unref(pool, 7), -EINVAL, "never allocated");
	cr_expect_eq(kvr_pool_page_ref(pool, 123456), -EINVAL);
	cr_expect_null(kvr_pool_page_data(pool, 123456));
	cr_expect_eq(kvr_pool_page_refcount(pool, 123456), -EINVAL);
	cr_assert_eq(kvr_pool_lookup(pool, 0, 1, 1, &id), 0);
	cr_expect_eq(kvr_pool_page_refcount(pool, id), 1);
	cr_expect_eq(kvr_pool_seq_fork(pool, 3, 2), -EINVAL, "fork from a closed sequence");
	cr_expect_eq(kvr_pool_seq_open(pool, 2), 0, "the failed fork left sequence 2 closed");
	/* the pool is intact after all of it */
	cr_assert_eq(kvr_pool_validate(pool, NULL), 0, "%s", kvr_pool_last_error(pool));
	char err[128];
	struct kvr_pool_params bad = { 0 };
	struct kvr_pool *none = NULL;
	cr_expect_eq(kvr_pool_create(&bad, &none, err, sizeof(err)), -EINVAL);
	cr_expect_null(none);
	kvr_pool_destroy(pool);
	kvr_pool_destroy(NULL);
}

/* ---- fork and copy-on-write ---- */

Test(pool, fork_shares_pages_and_copies_on_write)
{
	const uint32_t p = 32;
	struct ingest_fixture f, g2;
	fixture_init(&f, p, 64, 2, KVR_ELEM_F16, 64);
	fixture_init(&g2, p, 64, 2, KVR_ELEM_F16, 64);
	struct kvr_pool *pool = make_pool(p, 64, 2, KVR_ELEM_F16, 16, KVR_POOL_LAYOUT_HND, 2, 1);
	cr_assert_eq(kvr_pool_seq_open(pool, 0), 0);
	cr_assert_eq(kvr_pool_ingest(pool, 0, 0, 0, 40, f.k, f.v, &f.tail), 0); /* 1 page + 8 */
	cr_assert_eq(kvr_pool_seq_fork(pool, 0, 1), 0, "%s", kvr_pool_last_error(pool));
	uint32_t a0, a1, b0, b1;
	kvr_pool_lookup(pool, 0, 0, 0, &a0);
	kvr_pool_lookup(pool, 0, 0, 1, &a1);
	kvr_pool_lookup(pool, 1, 0, 0, &b0);
	kvr_pool_lookup(pool, 1, 0, 1, &b1);
	cr_expect_eq(a0, b0);
	cr_expect_eq(a1, b1);
	cr_expect_eq(kvr_pool_page_refcount(pool, a0), 2);
	/* the fork continues with other tokens: it gets its own partial page */
	memcpy(g2.tail.keys, f.tail.keys, p * f.row_bytes);
	memcpy(g2.tail.values, f.tail.values, p * f.row_bytes);
	memcpy(g2.k, f.k, 40 * f.row_bytes);
	memcpy(g2.v, f.v, 40 * f.row_bytes);
	cr_assert_eq(kvr_pool_ingest(pool, 1, 0, 40, 24, g2.k + 40 * g2.row_bytes,
				     g2.v + 40 * g2.row_bytes, &g2.tail),
		     0);
	kvr_pool_lookup(pool, 1, 0, 1, &b1);
	cr_expect_neq(a1, b1, "write to a shared page did not copy");
	cr_expect_eq(kvr_pool_page_refcount(pool, a1), 1);
	expect_page(pool, &g2, 1, 0, 1);
	/* the original goes on with its own tokens into its own page */
	cr_assert_eq(kvr_pool_ingest(pool, 0, 0, 40, 24, f.k + 40 * f.row_bytes,
				     f.v + 40 * f.row_bytes, &f.tail),
		     0);
	expect_page(pool, &f, 0, 0, 1);
	expect_page(pool, &g2, 1, 0, 1);
	expect_page(pool, &f, 1, 0, 0); /* still shared */
	cr_assert_eq(kvr_pool_validate(pool, NULL), 0, "%s", kvr_pool_last_error(pool));
	cr_assert_eq(kvr_pool_seq_close(pool, 0), 0);
	cr_expect_eq(kvr_pool_page_refcount(pool, a0), 1);
	cr_assert_eq(kvr_pool_seq_close(pool, 1), 0);
	struct kvr_pool_stats st;
	kvr_pool_get_stats(pool, &st);
	cr_expect_eq(st.used_pages, 0);
	fixture_free(&f), fixture_free(&g2);
	kvr_pool_destroy(pool);
}

/* ---- placement ---- */

Test(pool, pages_live_on_the_chosen_node)
{
	const int node = kvr_numa_current_node();
	struct kvr_pool_params pp = {
		.n_layers = 1, .max_sequences = 1, .numa_node = node, .keep_summaries = 0,
	};
	kvr_page_geometry_init(&pp.geometry, 32, 128, 8, KVR_ELEM_F16);
	pp.capacity_bytes = 64 * pp.geometry.page_bytes;
	struct kvr_pool *pool;
	char err[128];
	cr_assert_eq(kvr_pool_create(&pp, &pool, err, sizeof(err)), 0, "%s", err);
	uint32_t id;
	cr_assert_eq(kvr_pool_page_alloc(pool, &id), 0);
	unsigned char *data = kvr_pool_page_data(pool, id);
	memset(data, 1, pp.geometry.page_bytes);
	void *pages[1] = { data };
	int status[1] = { -1 };
	cr_assert_eq(move_pages(0, 1, pages, NULL, status, 0), 0);
	cr_expect_eq(status[0], node, "page on node %d, wanted %d", status[0], node);
	int mode = -1;
	unsigned long mask[16] = { 0 };
	cr_assert_eq(get_mempolicy(&mode, mask, sizeof(mask) * 8, data, MPOL_F_ADDR), 0);
	cr_expect_eq(mode, MPOL_BIND);
	cr_expect(mask[0] & (1ul << node), "policy mask 0x%lx lacks node %d", mask[0], node);
	struct kvr_pool_stats st;
	kvr_pool_get_stats(pool, &st);
	cr_expect_eq(st.numa_node, node);
	cr_expect_eq(st.n_chunks, 1);
	cr_expect_eq(st.hugepage_failures, 0);
	kvr_pool_destroy(pool);
}

Test(pool, chunks_are_huge_page_eligible)
{
	FILE *thp = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
	char mode[128] = "";
	if (thp) {
		if (!fgets(mode, sizeof(mode), thp))
			mode[0] = '\0';
		fclose(thp);
	}
	if (!strstr(mode, "[madvise]") && !strstr(mode, "[always]"))
		cr_skip_test("transparent huge pages are off on this kernel (%s)", mode);
	struct kvr_pool *pool = make_pool(32, 128, 8, KVR_ELEM_F16, 64, KVR_POOL_LAYOUT_HND, 1, 1);
	uint32_t id;
	cr_assert_eq(kvr_pool_page_alloc(pool, &id), 0);
	const uintptr_t addr = (uintptr_t)kvr_pool_page_data(pool, id);
	cr_expect_eq(addr % (2u << 20), 0, "chunk not 2 MiB aligned");
	FILE *smaps = fopen("/proc/self/smaps", "r");
	cr_assert_not_null(smaps);
	char line[512];
	int in_vma = 0, eligible = -1;
	while (fgets(line, sizeof(line), smaps)) {
		unsigned long lo, hi;
		if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2)
			in_vma = addr >= lo && addr < hi;
		else if (in_vma && sscanf(line, "THPeligible: %d", &eligible) == 1)
			break;
	}
	fclose(smaps);
	cr_expect_eq(eligible, 1, "pool chunk not THP-eligible");
	kvr_pool_destroy(pool);
}

/* ---- node choice on synthetic topologies ---- */

#define TOPO(name) KVR_TEST_DATA_DIR "/" name

Test(topology, node_choice_on_synthetic_topologies)
{
	char why[256];
	cr_expect_eq(kvr_topology_choose_node(TOPO("two_nodes_gpu_on_node1.xml"), -1, "0000:81:00.0",
					      0, why, sizeof(why)),
		     1, "%s", why);
	cr_expect(strstr(why, "nearest the GPU") != NULL, "%s", why);
	cr_expect_eq(kvr_topology_choose_node(TOPO("two_nodes_gpu_on_node1.xml"), -1, "81:00.0", 0,
					      why, sizeof(why)),
		     1, "short bus id: %s", why);
	cr_expect_eq(kvr_topology_choose_node(TOPO("four_nodes_gpu_on_node3.xml"), -1,
					      "0000:c1:00.0", 0, why, sizeof(why)),
		     3, "%s", why);
	/* no GPU: the calling thread's node */
	cr_expect_eq(kvr_topology_choose_node(TOPO("four_nodes_gpu_on_node3.xml"), -1, "", 2, why,
					      sizeof(why)),
		     2, "%s", why);
	/* a GPU the topology does not know: the caller's node, and say so */
	cr_expect_eq(kvr_topology_choose_node(TOPO("two_nodes_gpu_on_node1.xml"), -1,
					      "0000:05:00.0", 0, why, sizeof(why)),
		     0);
	cr_expect(strstr(why, "not found") != NULL, "%s", why);
	/* an override wins, if it exists */
	cr_expect_eq(kvr_topology_choose_node(TOPO("four_nodes_gpu_on_node3.xml"), 1, "0000:c1:00.0",
					      0, why, sizeof(why)),
		     1);
	cr_expect_eq(kvr_topology_choose_node(TOPO("two_nodes_gpu_on_node1.xml"), 2, NULL, 0, why,
					      sizeof(why)),
		     -EINVAL);
	cr_expect(strstr(why, "node 2 does not exist") != NULL, "%s", why);
	cr_expect_eq(kvr_topology_choose_node(TOPO("missing.xml"), -1, NULL, 0, why, sizeof(why)),
		     -EINVAL);
	/* this machine */
	cr_expect_geq(kvr_topology_choose_node(NULL, -1, NULL, kvr_numa_current_node(), why,
					       sizeof(why)),
		      0, "%s", why);
}

/* ---- locking fails: continue unlocked, count it, say it once ---- */

static int n_warnings;
static char warning[256];
static void capture(void *user, int level, const char *message)
{
	(void)user;
	cr_expect_eq(level, 1);
	n_warnings++;
	strncpy(warning, message, sizeof(warning) - 1);
}

Test(pool, lock_failure_counted_and_reported_once)
{
#if defined(__SANITIZE_ADDRESS__)
	cr_skip_test("ASan replaces mlock with a no-op that succeeds");
#endif
	/* Make mlock fail even as root: no CAP_IPC_LOCK, RLIMIT_MEMLOCK 0. The test
	 * runs in its own process, so this does not leak into other tests. */
	struct __user_cap_header_struct hdr = { _LINUX_CAPABILITY_VERSION_3, 0 };
	struct __user_cap_data_struct data[2];
	if (syscall(SYS_capget, &hdr, data) == 0) {
		data[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
		syscall(SYS_capset, &hdr, data);
	}
	struct rlimit zero = { 0, 0 };
	cr_assert_eq(setrlimit(RLIMIT_MEMLOCK, &zero), 0);

	struct kvr_pool_params pp = {
		.n_layers = 1, .max_sequences = 1, .numa_node = -1, .chunk_bytes = 2u << 20,
		.log_fn = capture,
	};
	kvr_page_geometry_init(&pp.geometry, 32, 128, 8, KVR_ELEM_F16); /* 128 KiB pages */
	pp.capacity_bytes = 64 * pp.geometry.page_bytes;              /* 4 chunks */
	struct kvr_pool *pool;
	char err[128];
	cr_assert_eq(kvr_pool_create(&pp, &pool, err, sizeof(err)), 0, "%s", err);
	for (int i = 0; i < 64; i++) {
		uint32_t id;
		cr_assert_eq(kvr_pool_page_alloc(pool, &id), 0);
		memset(kvr_pool_page_data(pool, id), i, pp.geometry.page_bytes); /* usable */
	}
	struct kvr_pool_stats st;
	kvr_pool_get_stats(pool, &st);
	cr_expect_eq(st.n_chunks, 4);
	cr_expect_eq(st.lock_failures, 4);
	cr_expect_eq(st.locked_chunks, 0);
	cr_expect_eq(n_warnings, 1, "warned %d times", n_warnings);
	cr_expect(strstr(warning, "could not be locked") != NULL, "%s", warning);
	kvr_pool_destroy(pool);
}

Test(pool, chunks_locked_when_allowed)
{
	struct rlimit rl;
	getrlimit(RLIMIT_MEMLOCK, &rl);
	if (geteuid() != 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < (8u << 20))
		cr_skip_test("RLIMIT_MEMLOCK %llu is too small to lock a chunk",
			     (unsigned long long)rl.rlim_cur);
	struct kvr_pool *pool = make_pool(32, 128, 1, KVR_ELEM_F16, 64, KVR_POOL_LAYOUT_HND, 1, 1);
	uint32_t id;
	cr_assert_eq(kvr_pool_page_alloc(pool, &id), 0);
	struct kvr_pool_stats st;
	kvr_pool_get_stats(pool, &st);
	cr_expect_eq(st.locked_chunks + st.registered_chunks, 1);
	cr_expect_eq(st.lock_failures, 0);
	cr_expect_eq(st.used_bytes, st.page_bytes);
	cr_expect_geq(st.reserved_bytes, st.page_bytes);
	kvr_pool_destroy(pool);
}

/* ---- concurrency: the engine's thread and the controller both use the pool ---- */

#include <pthread.h>

struct hammer {
	struct kvr_pool *pool;
	uint32_t seq_base;
	int failures;
};

static void *hammer_main(void *arg)
{
	struct hammer *h = arg;
	uint32_t state = 7 + h->seq_base;
	for (int i = 0; i < 3000; i++) {
		state = state * 1103515245u + 12345u;
		const uint32_t seq = h->seq_base + (state >> 16) % 4;
		if (kvr_pool_seq_open(h->pool, seq) == -EEXIST) {
			if ((state >> 8) % 3 == 0)
				h->failures += kvr_pool_seq_close(h->pool, seq) != 0;
			else {
				int err = kvr_pool_reserve(h->pool, seq, (state >> 4) % 2, 1 + (state >> 12) % 3);
				h->failures += err != 0 && err != -ENOMEM;
			}
		}
		uint32_t id;
		if (kvr_pool_page_alloc(h->pool, &id) == 0) {
			memset(kvr_pool_page_data(h->pool, id), (int)seq, 64);
			h->failures += kvr_pool_page_unref(h->pool, id) != 0;
		}
	}
	return NULL;
}

Test(pool, concurrent_callers_keep_invariants)
{
	struct kvr_pool *pool = make_pool(16, 64, 2, KVR_ELEM_F16, 200, KVR_POOL_LAYOUT_HND, 8, 2);
	struct hammer h[2] = { { pool, 0, 0 }, { pool, 4, 0 } };
	pthread_t t[2];
	for (int i = 0; i < 2; i++)
		pthread_create(&t[i], NULL, hammer_main, &h[i]);
	for (int i = 0; i < 2; i++)
		pthread_join(t[i], NULL);
	cr_expect_eq(h[0].failures + h[1].failures, 0);
	cr_assert_eq(kvr_pool_validate(pool, NULL), 0, "%s", kvr_pool_last_error(pool));
	kvr_pool_destroy(pool);
}
