/* SPDX-License-Identifier: MIT */
/*
 * thread_pool.c — the public thread pool (kvrecall.h, "Thread pool"): the cpu
 * backend's fork-join workers (gpu/cpu/cpu_threads.c) behind the public API, so
 * an engine can run its own work on them and hand them to a context through
 * kvr_config.parallel_for; one pool of cores − 1 threads instead of two.
 *
 * Threads: create and destroy on the owner's thread; parallel_for from any
 * (gpu/cpu/cpu_threads.h: a second concurrent caller runs its tasks alone).
 */
#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "../gpu/cpu/cpu_threads.h"
#include "internal.h"

/* The pool is the workers object itself; the public name only hides it. */
static struct kvr_workers *workers_of(const void *pool)
{
	return (struct kvr_workers *)pool;
}

KVR_API int kvr_thread_pool_create(uint32_t threads, struct kvr_thread_pool **out)
{
	if (!out)
		return kvr_fail(NULL, -EINVAL, "thread_pool_create: out is NULL");
	if (threads == KVR_THREADS_AUTO) {
		const long n = sysconf(_SC_NPROCESSORS_ONLN);
		threads = n > 1 ? (uint32_t)(n - 1) : 0;
	}
	if (threads > 1024)
		return kvr_fail(NULL, -EINVAL,
				"thread_pool_create: threads must be at most 1024 or KVR_THREADS_AUTO (got %u)",
				threads);
	struct kvr_workers *w = NULL;
	const int err = kvr_workers_create(threads, &w);
	if (err)
		return kvr_fail(NULL, err, "thread_pool_create: cannot start %u worker threads: %s", threads,
				strerror(-err));
	*out = (struct kvr_thread_pool *)w;
	return 0;
}

KVR_API void kvr_thread_pool_destroy(struct kvr_thread_pool *pool)
{
	kvr_workers_destroy(workers_of(pool));
}

KVR_API uint32_t kvr_thread_pool_threads(const struct kvr_thread_pool *pool)
{
	return kvr_workers_count(workers_of(pool));
}

KVR_API void kvr_thread_pool_parallel_for(void *pool, kvr_task_fn task, void *arg, uint32_t n)
{
	if (task)
		kvr_workers_parallel_for(workers_of(pool), task, arg, n);
}
