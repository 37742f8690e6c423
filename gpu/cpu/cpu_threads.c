/* SPDX-License-Identifier: MIT */
/*
 * cpu_threads.c — fork-join workers (see cpu_threads.h).
 *
 * A job is published under `lock`: the caller waits until no worker is still
 * inside the previous job (`active` is 0), writes the job fields, resets the
 * counters and bumps `generation`. Workers spin on `generation` without the
 * lock, but join under it — copying the job fields and registering in
 * `active` — so a worker that wakes late either joins the job it saw (whose
 * fields are still intact: the next publisher waits for it) or the next one,
 * never a mix. Tasks are taken from `next` until it runs out; the caller takes
 * tasks too and returns once `done` reaches n and every joined worker has left,
 * so the task's argument is never used after parallel_for returns.
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
#include "../../layouts/base/fault.h"

/* Pauses before sleeping: a few tens of µs, about one layer of decode, so
 * workers stay awake between the kernels of a step but not across idle time. */
#define SPIN_ITERATIONS 3000

struct kvr_workers {
	uint32_t n_threads;
	pthread_t *threads;

	/* Job fields: written under `lock` by the publisher, copied under it by workers. */
	kvr_task_fn task;
	void *arg;
	uint32_t n_tasks;

	_Atomic uint64_t generation; /* release by the caller; acquire by workers */
	_Atomic uint32_t next;       /* next task index; relaxed fetch_add */
	_Atomic uint32_t done;       /* tasks finished; release by workers, acquire by caller */
	_Atomic uint32_t active;     /* workers inside a job; the publisher waits for 0 */
	_Atomic int busy;            /* a job is running; acquire/release try-lock */
	_Atomic int quit;            /* destroy; seq_cst, read with the generation */

	pthread_mutex_t lock;       /* guards the job fields, sleepers and the condvar wait */
	pthread_cond_t wake;
	uint32_t sleepers;
};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#endif
}

struct job {
	kvr_task_fn task;
	void *arg;
	uint32_t n_tasks;
};

static void run_tasks(struct kvr_workers *w, const struct job *job)
{
	uint32_t i;
	while ((i = atomic_fetch_add_explicit(&w->next, 1, memory_order_relaxed)) < job->n_tasks) {
		job->task(job->arg, i);
		/* pairs with the caller's acquire load of done */
		atomic_fetch_add_explicit(&w->done, 1, memory_order_release);
	}
}

static void *worker_main(void *arg)
{
	struct kvr_workers *w = arg;
	uint64_t seen = atomic_load(&w->generation);
	for (;;) {
		int spins = 0;
		/* pairs with the publisher's seq_cst increment of generation */
		while (atomic_load(&w->generation) == seen && !atomic_load(&w->quit)) {
			if (++spins < SPIN_ITERATIONS) {
				cpu_relax();
				continue;
			}
			pthread_mutex_lock(&w->lock);
			w->sleepers++;
			while (atomic_load(&w->generation) == seen && !atomic_load(&w->quit))
				pthread_cond_wait(&w->wake, &w->lock);
			w->sleepers--;
			pthread_mutex_unlock(&w->lock);
		}
		if (atomic_load(&w->quit))
			return NULL;
		/* Join under the lock: the fields and the generation belong together. */
		pthread_mutex_lock(&w->lock);
		seen = atomic_load(&w->generation);
		const struct job job = { w->task, w->arg, w->n_tasks };
		atomic_fetch_add(&w->active, 1); /* the next publisher waits for it to drop */
		pthread_mutex_unlock(&w->lock);
		run_tasks(w, &job);
		atomic_fetch_sub(&w->active, 1);
	}
}

int kvr_workers_create(uint32_t threads, struct kvr_workers **out)
{
	struct kvr_workers *w = kvr_calloc(1, sizeof(*w));
	if (!w)
		return -ENOMEM;
	pthread_mutex_init(&w->lock, NULL);
	pthread_cond_init(&w->wake, NULL);
	if (threads) {
		w->threads = kvr_calloc(threads, sizeof(*w->threads));
		if (!w->threads) {
			kvr_workers_destroy(w);
			return -ENOMEM;
		}
	}
	for (uint32_t i = 0; i < threads; i++) {
		int err = kvr_pthread_create(&w->threads[i], NULL, worker_main, w);
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
	pthread_mutex_lock(&w->lock);
	pthread_cond_broadcast(&w->wake);
	pthread_mutex_unlock(&w->lock);
	for (uint32_t i = 0; i < w->n_threads; i++)
		pthread_join(w->threads[i], NULL);
	pthread_mutex_destroy(&w->lock);
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
	pthread_mutex_lock(&w->lock);
	/* a worker that joined the previous job may still be leaving it */
	while (atomic_load(&w->active))
		cpu_relax();
	w->task = task;
	w->arg = arg;
	w->n_tasks = n;
	atomic_store_explicit(&w->next, 0, memory_order_relaxed);
	atomic_store_explicit(&w->done, 0, memory_order_relaxed);
	atomic_fetch_add(&w->generation, 1);
	if (w->sleepers)
		pthread_cond_broadcast(&w->wake);
	pthread_mutex_unlock(&w->lock);

	const struct job job = { task, arg, n };
	run_tasks(w, &job);
	while (atomic_load_explicit(&w->done, memory_order_acquire) < n || atomic_load(&w->active))
		cpu_relax();
	atomic_store_explicit(&w->busy, 0, memory_order_release);
}
