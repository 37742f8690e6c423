/* SPDX-License-Identifier: MIT */
/*
 * fault.h — test-only fault injection: make the n-th operation of a class
 * fail (host allocation, device allocation, copies, stream and event
 * creation, thread start, spill-file I/O), so that tests can walk every
 * error path of a workload (tests/test_faults.c). It lives in layouts/base/,
 * the lowest folder, because gpu/, host/, scheduler/ and runtime/ all call it
 * (docs/design.md, "Components").
 *
 * Compiled into the library but inert until a test arms it through
 * kvr_fault_arm(), which the shared library does not export (tests reach it by
 * linking the static library). Disarmed, an injection point costs one relaxed
 * atomic load; armed, one relaxed increment of its class's counter more. An
 * operation that the hook fails returns what the real failure returns
 * (NULL/MAP_FAILED with errno ENOMEM, EAGAIN from pthread_create, -ENOMEM
 * from a device call, -EIO from a spill I/O) and takes the caller's ordinary
 * error path, so the message the caller writes is the one a user would see.
 *
 * Threads: any; the counters are process-wide. Tests arm and read them while
 * no library call runs.
 */
#ifndef KVR_BASE_FAULT_H
#define KVR_BASE_FAULT_H

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

#ifdef __cplusplus
extern "C" {
#endif

enum kvr_fault_class {
	KVR_FAULT_HOST_ALLOC = 0, /* the library's malloc/calloc/realloc/aligned_alloc, pool chunk mmap */
	KVR_FAULT_DEV_ALLOC = 1,  /* kvr_dev_alloc (the backend's or the engine's allocator) */
	KVR_FAULT_COPY = 2,       /* kvr_dev_memcpy_async, kvr_dev_memcpy_batch_async */
	KVR_FAULT_STREAM = 3,     /* kvr_dev_stream_create, kvr_dev_event_create */
	KVR_FAULT_THREAD = 4,     /* pthread_create: the controller, stream workers, worker pool */
	KVR_FAULT_SPILL_IO = 5,   /* a spill-file read or write completes with -EIO */
	KVR_FAULT_CLASSES = 6,
};

/* Nonzero while a test has armed the hook (counting or failing). Relaxed
 * loads: tests arm and disarm between library calls, never during one, so
 * there is no concurrent store to order against. */
extern _Atomic int kvr_fault_enabled;

/* The armed path: count the operation, 1 when it is the one to fail. */
int kvr_fault_hit_slow(enum kvr_fault_class c);

/* 1 when this operation of class c must fail. Any thread. */
static inline int kvr_fault_hit(enum kvr_fault_class c)
{
	/* relaxed: pairs with kvr_fault_arm/kvr_fault_reset, which tests call
	 * with no library call running (see above) */
	if (__builtin_expect(!atomic_load_explicit(&kvr_fault_enabled, memory_order_relaxed), 1))
		return 0;
	return kvr_fault_hit_slow(c);
}

/* Start counting every class from zero; fail the n-th operation of class c
 * (n = 0: count only). Tests only, between library calls. */
void kvr_fault_arm(enum kvr_fault_class c, uint64_t n);
/* Stop counting and failing; counts are kept for kvr_fault_count. */
void kvr_fault_reset(void);
/* Operations of class c seen since kvr_fault_arm. */
uint64_t kvr_fault_count(enum kvr_fault_class c);
/* Failures injected since kvr_fault_arm (0 or 1). */
uint64_t kvr_fault_fired(void);
/* Name of a class ("host-alloc", ...), for messages. */
const char *kvr_fault_class_name(enum kvr_fault_class c);

/* The library's host allocation entry points (host/pool.c, scheduler/,
 * runtime/, gpu/cpu/): the libc call unless the hook fails it. */
static inline void *kvr_malloc(size_t bytes)
{
	if (kvr_fault_hit(KVR_FAULT_HOST_ALLOC)) {
		errno = ENOMEM;
		return NULL;
	}
	return malloc(bytes);
}

static inline void *kvr_calloc(size_t n, size_t size)
{
	if (kvr_fault_hit(KVR_FAULT_HOST_ALLOC)) {
		errno = ENOMEM;
		return NULL;
	}
	return calloc(n, size);
}

/* As realloc: on failure the old block is left as it was. */
static inline void *kvr_realloc(void *ptr, size_t bytes)
{
	if (kvr_fault_hit(KVR_FAULT_HOST_ALLOC)) {
		errno = ENOMEM;
		return NULL;
	}
	return realloc(ptr, bytes);
}

static inline void *kvr_aligned_alloc(size_t align, size_t bytes)
{
	if (kvr_fault_hit(KVR_FAULT_HOST_ALLOC)) {
		errno = ENOMEM;
		return NULL;
	}
	return aligned_alloc(align, bytes);
}

static inline void *kvr_mmap(void *addr, size_t bytes, int prot, int flags, int fd, off_t off)
{
	if (kvr_fault_hit(KVR_FAULT_HOST_ALLOC)) {
		errno = ENOMEM;
		return MAP_FAILED;
	}
	return mmap(addr, bytes, prot, flags, fd, off);
}

/* pthread_create, failing as it does when the system is out of threads. */
static inline int kvr_pthread_create(pthread_t *thread, const pthread_attr_t *attr,
				     void *(*start)(void *), void *arg)
{
	if (kvr_fault_hit(KVR_FAULT_THREAD))
		return EAGAIN;
	return pthread_create(thread, attr, start, arg);
}

#ifdef __cplusplus
}
#endif

#endif /* KVR_BASE_FAULT_H */
