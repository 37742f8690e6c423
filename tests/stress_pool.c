/* SPDX-License-Identifier: MIT */
/*
 * stress_pool.c — several threads hammering one pool (sequences opened,
 * reserved, closed; raw pages allocated, written, freed; forks taken), then
 * the invariant checker. A plain program rather than a Criterion suite so it
 * also runs under ThreadSanitizer, which Criterion's forking runner cannot
 * host. Exit 0 on success; prints "N passed, N failed".
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "pool.h"

#define N_THREADS 4
#define SEQS_PER_THREAD 4

struct worker {
	struct kvr_pool *pool;
	uint32_t seq_base;
	int failures;
};

static void *work(void *arg)
{
	struct worker *w = arg;
	uint32_t state = 0x9e3779b9u * (w->seq_base + 1);
	unsigned char rows[2 * 16 * 2 * 64 * 2];
	memset(rows, (int)w->seq_base, sizeof(rows));
	for (int i = 0; i < 20000; i++) {
		state = state * 1103515245u + 12345u;
		const uint32_t r = state >> 8;
		const uint32_t seq = w->seq_base + r % SEQS_PER_THREAD, layer = (r >> 4) % 2;
		int err;
		switch ((r >> 8) % 6) {
		case 0:
			err = kvr_pool_seq_open(w->pool, seq);
			w->failures += err && err != -EEXIST;
			break;
		case 1:
			err = kvr_pool_seq_close(w->pool, seq);
			w->failures += err && err != -EINVAL;
			break;
		case 2:
		case 3: {
			uint32_t n_pages = 0;
			if (kvr_pool_n_pages(w->pool, seq, layer, &n_pages))
				break;
			err = kvr_pool_reserve(w->pool, seq, layer, 1);
			w->failures += err && err != -ENOMEM;
			if (!err)
				w->failures += kvr_pool_write_page(w->pool, seq, layer, n_pages, rows,
								   rows + sizeof(rows) / 2, 2 * 64) != 0;
			break;
		}
		case 4: { /* a fork into the neighbour slot, then its close */
			const uint32_t dst = w->seq_base + (seq - w->seq_base + 1) % SEQS_PER_THREAD;
			err = kvr_pool_seq_fork(w->pool, seq, dst);
			w->failures += err && err != -EEXIST && err != -EINVAL && err != -ENOMEM;
			break;
		}
		default: {
			uint32_t id;
			if (kvr_pool_page_alloc(w->pool, &id) == 0) {
				memset(kvr_pool_page_data(w->pool, id), (int)r, 256);
				w->failures += kvr_pool_page_unref(w->pool, id) != 0;
			}
			break;
		}
		}
	}
	return NULL;
}

int main(void)
{
	struct kvr_pool_params pp = {
		.n_layers = 2, .max_sequences = N_THREADS * SEQS_PER_THREAD, .numa_node = -1,
		.keep_summaries = 1, .flags = KVR_POOL_NO_LOCK,
	};
	kvr_page_geometry_init(&pp.geometry, 16, 64, 2, KVR_ELEM_F16);
	pp.capacity_bytes = 300 * pp.geometry.page_bytes;
	struct kvr_pool *pool;
	char err[256];
	if (kvr_pool_create(&pp, &pool, err, sizeof(err))) {
		fprintf(stderr, "stress_pool: %s\n", err);
		return 1;
	}
	struct worker w[N_THREADS];
	pthread_t t[N_THREADS];
	for (uint32_t i = 0; i < N_THREADS; i++) {
		w[i] = (struct worker){ pool, i * SEQS_PER_THREAD, 0 };
		pthread_create(&t[i], NULL, work, &w[i]);
	}
	int failures = 0;
	for (uint32_t i = 0; i < N_THREADS; i++) {
		pthread_join(t[i], NULL);
		failures += w[i].failures;
	}
	int bad = kvr_pool_validate(pool, NULL);
	if (bad)
		fprintf(stderr, "stress_pool: %s\n", kvr_pool_last_error(pool));
	if (failures)
		fprintf(stderr, "stress_pool: %d unexpected errors\n", failures);
	kvr_pool_destroy(pool);
	const int failed = (bad != 0) + (failures != 0);
	printf("%d passed, %d failed\n", 2 - failed, failed);
	return failed ? 1 : 0;
}
