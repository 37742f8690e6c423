/* SPDX-License-Identifier: MIT */
/*
 * cpu_threads.c — fork-join workers (see cpu_threads.h).
 *
 * A job is published by bumping `generation`; workers that see a new
 * generation register in `active`, recheck the generation (so a worker that
 * woke late never joins the next job with the previous job's view), then take
 * task indices from `next` until they run out. The caller takes tasks too and
 * returns once `done` reaches n and no worker is still registered, which is
 * what makes it safe to overwrite the job fields for the next call.
 *
 * Threads: workers are owned by the pool; parallel_for may be called from any
 * thread, one job at a time (`busy` is a try-lock; a second caller runs its
 * job inline).
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "cpu_threads.h"

/* Pauses before sleeping: a few tens of µs, about one layer of decode, so
 * workers stay awake between the kernels of a step but not across idle time. */
#define SPIN_ITERATIONS 3000

struct kvr_workers {
	uint32_t n_threads;
	pthread_t *threads;

	/* Job fields: written by the caller before publishing the generation. */
	kvr_task_fn task;
	void *arg;
	uint32_t n_tasks;

	_Atomic uint64_t generation; /* release by the caller; acquire by workers */
	_Atomic uint32_t next;       /* next task index; relaxed fetch_add */
	_Atomic uint32_t done;       /* tasks finished; release by workers, acquire by caller */
	_Atomic uint32_t active;     /* workers inside the current job; seq_cst with generation */
	_Atomic int busy;            /* a job is running; acquire/release try-lock */
	_Atomic int quit;            /* destroy; seq_cst, read with the generation */

	pthread_mutex_t sleep_lock; /* guards sleepers and the condvar wait */
	pthread_cond_t wake;
	uint32_t sleepers;
};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#endif
}

static void run_tasks(struct kvr_workers *w)
{
	const uint32_t n = w->n_tasks;
	uint32_t i;
	while ((i = atomic_fetch_add_explicit(&w->next, 1, memory_order_relaxed)) < n) {
		w->task(w->arg, i);
		/* pairs with the caller's acquire load of done */
		atomic_fetch_add_explicit(&w->done, 1, memory_order_release);
	}
}

static void *worker_main(void *arg)
{
	struct kvr_workers *w = arg;
	uint64_t seen = atomic_load(&w->generation);
	for (;;) {
		uint64_t gen;
		int spins = 0;
		/* pairs with the caller's seq_cst store of generation */
		while ((gen = atomic_load(&w->generation)) == seen && !atomic_load(&w->quit)) {
			if (++spins < SPIN_ITERATIONS) {
				cpu_relax();
				continue;
			}
			pthread_mutex_lock(&w->sleep_lock);
			w->sleepers++;
			while (atomic_load(&w->generation) == seen && !atomic_load(&w->quit))
				pthread_cond_wait(&w->wake, &w->sleep_lock);
			w->sleepers--;
			pthread_mutex_unlock(&w->sleep_lock);
		}
		if (atomic_load(&w->quit))
			return NULL;
		seen = gen;
		atomic_fetch_add(&w->active, 1);
		/* The caller may already have finished this job and published the
		 * next one; only join the generation we registered under. */
		if (atomic_load(&w->generation) == gen)
			run_tasks(w);
		atomic_fetch_sub(&w->active, 1);
	}
}

int kvr_workers_create(uint32_t threads, struct kvr_workers **out)
{
	struct kvr_workers *w = calloc(1, sizeof(*w));
	if (!w)
		return -ENOMEM;
	pthread_mutex_init(&w->sleep_lock, NULL);
	pthread_cond_init(&w->wake, NULL);
	if (threads) {
		w->threads = calloc(threads, sizeof(*w->threads));
		if (!w->threads) {
			kvr_workers_destroy(w);
			return -ENOMEM;
		}
	}
	for (uint32_t i = 0; i < threads; i++) {
		int err = pthread_create(&w->threads[i], NULL, worker_main, w);
		if (err) {
			kvr_workers_destroy(w);
			return -err;
		}
		w->n_threads++;
	}
	*out = w;
	return 0;
}

void kvr_workers_destroy(struct kvr_workers *w)
{
	if (!w)
		return;
	atomic_store(&w->quit, 1);
	pthread_mutex_lock(&w->sleep_lock);
	pthread_cond_broadcast(&w->wake);
	pthread_mutex_unlock(&w->sleep_lock);
	for (uint32_t i = 0; i < w->n_threads; i++)
		pthread_join(w->threads[i], NULL);
	pthread_mutex_destroy(&w->sleep_lock);
	pthread_cond_destroy(&w->wake);
	free(w->threads);
	free(w);
}

uint32_t kvr_workers_count(const struct kvr_workers *w)
{
	return w ? w->n_threads : 0;
}

void kvr_workers_parallel_for(struct kvr_workers *w, kvr_task_fn task, void *arg, uint32_t n)
{
	if (!n)
		return;
	int expected = 0;
	/* acquire pairs with the release that ended the previous job */
	if (!w || !w->n_threads || n == 1 ||
	    !atomic_compare_exchange_strong_explicit(&w->busy, &expected, 1, memory_order_acquire,
						     memory_order_relaxed)) {
		for (uint32_t i = 0; i < n; i++)
			task(arg, i);
		return;
	}
	w->task = task;
	w->arg = arg;
	w->n_tasks = n;
	atomic_store_explicit(&w->next, 0, memory_order_relaxed);
	atomic_store_explicit(&w->done, 0, memory_order_relaxed);
	atomic_fetch_add(&w->generation, 1); /* publishes the fields above */
	pthread_mutex_lock(&w->sleep_lock);
	if (w->sleepers)
		pthread_cond_broadcast(&w->wake);
	pthread_mutex_unlock(&w->sleep_lock);

	run_tasks(w);
	while (atomic_load_explicit(&w->done, memory_order_acquire) < n || atomic_load(&w->active))
		cpu_relax();
	atomic_store_explicit(&w->busy, 0, memory_order_release);
}
