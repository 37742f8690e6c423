/* SPDX-License-Identifier: MIT */
/*
 * test_freelist.c — LeanKV's circular free-page list (layouts/freelist.h)
 * under long random sequences of per-head allocation and free rounds, checked
 * after every round against a shadow model of who owns each page: no page
 * lost or owned twice, the free region ids[start .. end) holds exactly the
 * free pages (it stays contiguous across wrap-around), a round that asks for
 * too much is refused with nothing changed, and many threads taking their
 * heads' slices of one round at once get disjoint pages — the same ones a
 * serial round gives.
 */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "freelist.h"
#include "helpers.h"

#define FREE_PAGE UINT32_MAX

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static uint32_t rnd(uint32_t n)
{
	return (uint32_t)((th_xorshift64(&rng_state) >> 33) % n);
}

struct shadow {
	uint32_t capacity, units;
	uint32_t *owner;   /* [capacity]: unit, or FREE_PAGE */
	uint32_t **pages;  /* [units][capacity]: each unit's page table */
	uint32_t *n_pages; /* [units] */
};

/* Every invariant of the header, against the shadow. */
static void check(const struct kvr_freelist *l, const struct shadow *sh, const char *when)
{
	const uint64_t n_free = kvr_freelist_free_count(l);
	cr_assert_leq(n_free, l->capacity, "%s: %llu free of %u", when, (unsigned long long)n_free, l->capacity);
	uint64_t owned = 0;
	for (uint32_t u = 0; u < sh->units; u++)
		owned += sh->n_pages[u];
	cr_assert_eq(n_free + owned, l->capacity, "%s: %llu free + %llu owned != %u pages", when,
		     (unsigned long long)n_free, (unsigned long long)owned, l->capacity);
	static uint8_t seen[1 << 16];
	memset(seen, 0, l->capacity);
	for (uint64_t i = l->start; i < l->end; i++) {
		const uint32_t id = l->ids[i % l->capacity];
		cr_assert_lt(id, l->capacity, "%s: free region holds a bad id %u", when, id);
		cr_assert_eq(seen[id], 0, "%s: page %u is twice in the free region", when, id);
		cr_assert_eq(sh->owner[id], FREE_PAGE, "%s: page %u is free but owned by unit %u", when, id,
			     sh->owner[id]);
		seen[id] = 1;
	}
	for (uint32_t u = 0; u < sh->units; u++)
		for (uint32_t k = 0; k < sh->n_pages[u]; k++) {
			const uint32_t id = sh->pages[u][k];
			cr_assert_eq(seen[id], 0, "%s: page %u owned twice (or owned and free)", when, id);
			cr_assert_eq(sh->owner[id], u);
			seen[id] = 1;
		}
}

static void shadow_init(struct shadow *sh, uint32_t capacity, uint32_t units)
{
	sh->capacity = capacity, sh->units = units;
	sh->owner = malloc(capacity * sizeof(uint32_t));
	sh->pages = malloc(units * sizeof(uint32_t *));
	sh->n_pages = calloc(units, sizeof(uint32_t));
	for (uint32_t i = 0; i < capacity; i++)
		sh->owner[i] = FREE_PAGE;
	for (uint32_t u = 0; u < units; u++)
		sh->pages[u] = malloc(capacity * sizeof(uint32_t));
}

static void shadow_free(struct shadow *sh)
{
	for (uint32_t u = 0; u < sh->units; u++)
		free(sh->pages[u]);
	free(sh->pages), free(sh->owner), free(sh->n_pages);
}

/* Random rounds: half allocation (each unit 0..max_ask pages), half frees
 * (each unit returns a random part of its pages, from anywhere in its table),
 * over enough rounds that the counters wrap the list many times. */
static void random_rounds(uint32_t capacity, uint32_t units, uint32_t max_ask, uint32_t rounds)
{
	uint32_t *ids = malloc(capacity * sizeof(uint32_t));
	struct kvr_freelist l;
	kvr_freelist_init(&l, ids, capacity);
	struct shadow sh;
	shadow_init(&sh, capacity, units);
	uint32_t *counts = malloc(units * sizeof(uint32_t));
	uint64_t *offsets = malloc(units * sizeof(uint64_t));
	uint32_t **bufs = malloc(units * sizeof(uint32_t *));
	for (uint32_t u = 0; u < units; u++)
		bufs[u] = malloc(capacity * sizeof(uint32_t));
	uint32_t *before = malloc(capacity * sizeof(uint32_t));
	uint32_t refused = 0, wraps_seen = 0;
	check(&l, &sh, "initial");
	for (uint32_t r = 0; r < rounds; r++) {
		char when[64];
		snprintf(when, sizeof(when), "round %u", r);
		if (rnd(2)) { /* allocation */
			for (uint32_t u = 0; u < units; u++)
				counts[u] = rnd(max_ask + 1);
			const uint64_t s0 = l.start, e0 = l.end;
			memcpy(before, ids, capacity * sizeof(uint32_t));
			const int rc = kvr_freelist_alloc_round(&l, counts, units, offsets, bufs);
			uint64_t total = 0;
			for (uint32_t u = 0; u < units; u++)
				total += counts[u];
			if (total > e0 - s0) {
				cr_assert_eq(rc, -1, "%s: asked %llu of %llu free, not refused", when,
					     (unsigned long long)total, (unsigned long long)(e0 - s0));
				cr_assert(l.start == s0 && l.end == e0 && !memcmp(before, ids, capacity * 4),
					  "%s: a refused round changed the list", when);
				refused++;
				continue;
			}
			cr_assert_eq(rc, 0, "%s", when);
			for (uint32_t u = 0; u < units; u++)
				for (uint32_t k = 0; k < counts[u]; k++) {
					const uint32_t id = bufs[u][k];
					cr_assert_eq(sh.owner[id], FREE_PAGE, "%s: unit %u got page %u, owned by %u", when,
						     u, id, sh.owner[id]);
					sh.owner[id] = u;
					sh.pages[u][sh.n_pages[u]++] = id;
				}
		} else { /* frees: a random subset of each unit's pages */
			for (uint32_t u = 0; u < units; u++) {
				counts[u] = sh.n_pages[u] ? rnd(sh.n_pages[u] + 1) : 0;
				for (uint32_t k = 0; k < counts[u]; k++) {
					const uint32_t at = rnd(sh.n_pages[u]);
					bufs[u][k] = sh.pages[u][at];
					sh.pages[u][at] = sh.pages[u][--sh.n_pages[u]];
					sh.owner[bufs[u][k]] = FREE_PAGE;
				}
			}
			cr_assert_eq(kvr_freelist_free_round(&l, counts, units, offsets, (const uint32_t *const *)bufs), 0,
				     "%s", when);
		}
		wraps_seen = (uint32_t)(l.start / capacity);
		check(&l, &sh, when);
	}
	cr_expect_gt(refused, 0, "no round was ever refused: exhaustion is untested");
	cr_expect_gt(wraps_seen, 10, "the counters wrapped only %u times", wraps_seen);
	/* a request finishing returns everything: the list is full again */
	for (uint32_t u = 0; u < units; u++) {
		counts[u] = sh.n_pages[u];
		memcpy(bufs[u], sh.pages[u], sh.n_pages[u] * sizeof(uint32_t));
		for (uint32_t k = 0; k < sh.n_pages[u]; k++)
			sh.owner[sh.pages[u][k]] = FREE_PAGE;
		sh.n_pages[u] = 0;
	}
	cr_assert_eq(kvr_freelist_free_round(&l, counts, units, offsets, (const uint32_t *const *)bufs), 0);
	cr_expect_eq(kvr_freelist_free_count(&l), capacity);
	check(&l, &sh, "all returned");
	/* and one more page cannot be returned */
	counts[0] = 1, bufs[0][0] = 0;
	for (uint32_t u = 1; u < units; u++)
		counts[u] = 0;
	cr_expect_eq(kvr_freelist_free_round(&l, counts, units, offsets, (const uint32_t *const *)bufs), -1,
		     "a free beyond capacity was accepted");
	for (uint32_t u = 0; u < units; u++)
		free(bufs[u]);
	free(bufs), free(offsets), free(counts), free(before), free(ids);
	shadow_free(&sh);
}

Test(freelist, random_rounds_many_heads)
{
	random_rounds(1000, 64, 4, 20000); /* 64 heads x sequences, up to 4 pages each per round */
}

Test(freelist, random_rounds_tight)
{
	random_rounds(37, 5, 9, 20000); /* exhaustion and wrap-around all the time */
}

/* ------------------------------------------------------------------ concurrency */

struct taker {
	const struct kvr_freelist *l;
	const uint32_t *counts;
	const uint64_t *offsets;
	uint32_t **out;
	uint32_t first, last; /* units this thread takes */
};

static void *take_units(void *arg)
{
	struct taker *t = arg;
	for (uint32_t u = t->first; u < t->last; u++)
		kvr_freelist_take(t->l, t->offsets[u], t->counts[u], t->out[u]);
	return NULL;
}

/* Step 3 of a round by 8 threads at once, units interleaved among them: the
 * slices are disjoint and equal to the serial round's. */
Test(freelist, concurrent_take_gives_disjoint_slices)
{
	enum { CAP = 4096, UNITS = 512, THREADS = 8 };
	static uint32_t ids[CAP], ids_serial[CAP];
	struct kvr_freelist l, ls;
	kvr_freelist_init(&l, ids, CAP);
	kvr_freelist_init(&ls, ids_serial, CAP);
	/* scramble the list first (allocate and free in another order) */
	for (uint32_t i = 0; i < CAP; i++) {
		const uint32_t j = rnd(i + 1), t = ids[i];
		ids[i] = ids[j], ids[j] = t;
	}
	memcpy(ids_serial, ids, sizeof(ids));
	static uint32_t counts[UNITS];
	static uint64_t offsets[UNITS];
	static uint32_t buf[UNITS][8], buf_serial[UNITS][8];
	uint32_t *out[UNITS], *out_serial[UNITS];
	for (uint32_t u = 0; u < UNITS; u++) {
		counts[u] = rnd(9);
		out[u] = buf[u], out_serial[u] = buf_serial[u];
	}
	const uint64_t total = kvr_freelist_scan(counts, UNITS, offsets);
	cr_assert_leq(total, CAP);
	pthread_t th[THREADS];
	struct taker tk[THREADS];
	for (uint32_t t = 0; t < THREADS; t++) {
		tk[t] = (struct taker){ &l, counts, offsets, out, t * UNITS / THREADS, (t + 1) * UNITS / THREADS };
		cr_assert_eq(pthread_create(&th[t], NULL, take_units, &tk[t]), 0);
	}
	for (uint32_t t = 0; t < THREADS; t++)
		pthread_join(th[t], NULL);
	l.start += total;
	cr_assert_eq(kvr_freelist_alloc_round(&ls, counts, UNITS, offsets, out_serial), 0);
	static uint8_t seen[CAP];
	for (uint32_t u = 0; u < UNITS; u++)
		for (uint32_t k = 0; k < counts[u]; k++) {
			cr_assert_eq(buf[u][k], buf_serial[u][k], "unit %u page %u: threads and serial differ", u, k);
			cr_assert_eq(seen[buf[u][k]], 0, "page %u handed to two units", buf[u][k]);
			seen[buf[u][k]] = 1;
		}
	cr_expect_eq(l.start, ls.start);
}
