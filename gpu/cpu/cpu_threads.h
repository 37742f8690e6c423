/* SPDX-License-Identifier: MIT */
/*
 * cpu_threads.h — the cpu backend's fork-join workers: parallel_for runs a
 * task over [0, n) on the calling thread plus `threads` workers, returning
 * when all are done. Workers spin briefly for the next job, then sleep: on a
 * 2-core machine a condvar handoff costs ~50 µs, as much as a layer's sparse
 * attention, so back-to-back jobs must find them awake.
 */
#ifndef KVR_GPU_CPU_THREADS_H
#define KVR_GPU_CPU_THREADS_H

#include <stdint.h>

#include "../backend.h"

struct kvr_workers;

/* threads = 0 creates no thread: parallel_for then runs on the caller alone. */
int kvr_workers_create(uint32_t threads, struct kvr_workers **out);
void kvr_workers_destroy(struct kvr_workers *w);
uint32_t kvr_workers_count(const struct kvr_workers *w);

/* Run task(arg, i) for every i in [0, n). Any thread may call it; when another
 * call is in progress, this one runs its tasks on the caller alone (no
 * nesting, no waiting). */
void kvr_workers_parallel_for(struct kvr_workers *w, kvr_task_fn task, void *arg, uint32_t n);

#endif /* KVR_GPU_CPU_THREADS_H */
