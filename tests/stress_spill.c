/* SPDX-License-Identifier: MIT */
/*
 * stress_spill.c — four threads sharing one spill file (host/spill.h), as
 * the engine's thread (spilling pages) and the controller (recalling runs)
 * will: each writes batches of its own pages, reads runs and whole pages
 * back and checks every byte, and frees slots, while a fifth thread reads
 * the stats and turns a harmless fault on and off. Run on io_uring and on
 * the pread fallback. A plain program, not a Criterion suite, so it also
 * runs under ThreadSanitizer. Exit 0 on success; prints "N passed, N failed".
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "spill.h"

#define N_THREADS 4
#define ROUNDS 1500
#define RUN_BYTES 1000u /* not aligned: runs are padded in the file */
#define RUNS 3u
#define MAX_LIVE 24u

struct worker {
	struct kvr_spill *sp;
	uint32_t id;
	int failures;
};

static atomic_int stop_watcher; /* set by main after the workers join; read by the watcher */

static uint32_t next_rand(uint32_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 17;
	*s ^= *s << 5;
	return *s;
}

/* Page content is a function of (thread, tag): checkable without a copy. */
static void fill(unsigned char *page, uint32_t thread, uint32_t tag)
{
	for (uint32_t i = 0; i < RUN_BYTES * RUNS; i++)
		page[i] = (unsigned char)(i * 31u + thread * 7u + tag * 13u);
}

static void *work(void *arg)
{
	struct worker *w = arg;
	uint32_t state = 0x9e3779b9u * (w->id + 1);
	uint32_t slots[MAX_LIVE], tags[MAX_LIVE], n_live = 0, next_tag = 0;
	static _Thread_local unsigned char pages[4][RUN_BYTES * RUNS], back[RUN_BYTES * RUNS],
		want[RUN_BYTES * RUNS];
	for (int round = 0; round < ROUNDS; round++) {
		const uint32_t op = next_rand(&state) % 3;
		if (op == 0 && n_live + 4 <= MAX_LIVE) {
			const uint32_t n = 1 + next_rand(&state) % 4;
			const void *ptrs[4];
			for (uint32_t i = 0; i < n; i++) {
				fill(pages[i], w->id, next_tag + i);
				ptrs[i] = pages[i];
			}
			if (kvr_spill_write_pages(w->sp, ptrs, n, slots + n_live)) {
				fprintf(stderr, "thread %u: write: %s\n", w->id, kvr_spill_last_error(w->sp));
				w->failures++;
				continue;
			}
			for (uint32_t i = 0; i < n; i++)
				tags[n_live + i] = next_tag + i;
			n_live += n;
			next_tag += n;
		} else if (op == 1 && n_live) {
			const uint32_t k = next_rand(&state) % n_live;
			fill(want, w->id, tags[k]);
			void *dst = back;
			if (next_rand(&state) & 1) {
				if (kvr_spill_read_pages(w->sp, &slots[k], 1, &dst, NULL) || memcmp(back, want, sizeof(back))) {
					fprintf(stderr, "thread %u: page of slot %u read wrong\n", w->id, slots[k]);
					w->failures++;
				}
			} else {
				const uint32_t run = next_rand(&state) % RUNS;
				const struct kvr_spill_run r = { slots[k], run };
				if (kvr_spill_read_runs(w->sp, &r, 1, back, RUN_BYTES, NULL) ||
				    memcmp(back, want + run * RUN_BYTES, RUN_BYTES)) {
					fprintf(stderr, "thread %u: run %u of slot %u read wrong\n", w->id, run, slots[k]);
					w->failures++;
				}
			}
		} else if (n_live) {
			const uint32_t k = next_rand(&state) % n_live;
			if (kvr_spill_free(w->sp, slots[k])) {
				fprintf(stderr, "thread %u: free: %s\n", w->id, kvr_spill_last_error(w->sp));
				w->failures++;
			}
			slots[k] = slots[n_live - 1];
			tags[k] = tags[n_live - 1];
			n_live--;
		}
	}
	while (n_live)
		w->failures += kvr_spill_free(w->sp, slots[--n_live]) != 0;
	return NULL;
}

/* Reads the stats and arms a fault for a slot no one holds: both take the
 * spill's lock, so they race the workers only as far as the lock allows. */
static void *watch(void *arg)
{
	struct kvr_spill *sp = arg;
	struct kvr_spill_stats st;
	const struct kvr_spill_fault never = { KVR_SPILL_FAULT_READ_EIO, KVR_SPILL_NO_SLOT - 1, 0, 0 };
	const struct kvr_spill_fault none = { KVR_SPILL_FAULT_NONE, 0, 0, 0 };
	for (int i = 0; !atomic_load(&stop_watcher); i++) {
		kvr_spill_get_stats(sp, &st);
		kvr_spill_inject(sp, i & 1 ? &never : &none);
		usleep(200);
	}
	kvr_spill_inject(sp, &none);
	return NULL;
}

static int run(uint32_t flags, const char *name)
{
	struct kvr_spill_params p = { .run_bytes = RUN_BYTES, .runs_per_page = RUNS, .queue_depth = 4,
				      .staging_bytes = 2 * 2048 * RUNS, .flags = flags };
	struct kvr_spill *sp = NULL;
	char err[256];
	int e = kvr_spill_create(&p, &sp, err, sizeof(err));
	if (e) {
		fprintf(stderr, "%s: create: %s\n", name, err);
		return 1;
	}
	pthread_t t[N_THREADS], watcher;
	struct worker w[N_THREADS];
	atomic_store(&stop_watcher, 0);
	pthread_create(&watcher, NULL, watch, sp);
	for (uint32_t i = 0; i < N_THREADS; i++) {
		w[i] = (struct worker){ sp, i, 0 };
		pthread_create(&t[i], NULL, work, &w[i]);
	}
	int failures = 0;
	for (uint32_t i = 0; i < N_THREADS; i++) {
		pthread_join(t[i], NULL);
		failures += w[i].failures;
	}
	atomic_store(&stop_watcher, 1);
	pthread_join(watcher, NULL);
	struct kvr_spill_stats st;
	kvr_spill_get_stats(sp, &st);
	if (st.slots_used || st.io_errors || st.checksum_errors) {
		fprintf(stderr, "%s: %llu slots left, %llu I/O errors, %llu checksum errors\n", name,
			(unsigned long long)st.slots_used, (unsigned long long)st.io_errors,
			(unsigned long long)st.checksum_errors);
		failures++;
	}
	kvr_spill_destroy(sp);
	printf("%s: %s\n", name, failures ? "FAILED" : "ok");
	return failures != 0;
}

int main(void)
{
	int failed = 0;
	failed += run(0, "io_uring");
	failed += run(KVR_SPILL_SYNC, "pread");
	printf("%d passed, %d failed\n", 2 - failed, failed);
	return failed ? 1 : 0;
}
