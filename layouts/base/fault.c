/* SPDX-License-Identifier: MIT */
/*
 * fault.c — the counters behind fault.h's injection points: one per class,
 * and the armed "fail the n-th" of one class.
 *
 * Threads: kvr_fault_hit_slow runs on whichever library thread performs the
 * operation (engine, controller, stream workers); arm/reset/count run on the
 * test's thread between library calls.
 */
#include "fault.h"

_Atomic int kvr_fault_enabled;

static _Atomic uint64_t counts[KVR_FAULT_CLASSES];
static _Atomic uint64_t fired;
/* Written by kvr_fault_arm before it enables the hook, read by hits:
 * relaxed atomics, ordered by the enable flag's release store and the
 * synchronisation that starts or wakes the threads that read them. */
static _Atomic int armed_class;
static _Atomic uint64_t armed_n;

int kvr_fault_hit_slow(enum kvr_fault_class c)
{
	/* relaxed: each operation only needs a distinct index; the order among
	 * threads is whatever the run's scheduling makes it */
	const uint64_t n = atomic_fetch_add_explicit(&counts[c], 1, memory_order_relaxed) + 1;
	if ((int)c != atomic_load_explicit(&armed_class, memory_order_relaxed) ||
	    n != atomic_load_explicit(&armed_n, memory_order_relaxed))
		return 0;
	/* relaxed: read by the test after the library calls have returned (a
	 * thread join or the call's own synchronisation orders it) */
	atomic_fetch_add_explicit(&fired, 1, memory_order_relaxed);
	return 1;
}

void kvr_fault_arm(enum kvr_fault_class c, uint64_t n)
{
	for (int i = 0; i < KVR_FAULT_CLASSES; i++)
		atomic_store_explicit(&counts[i], 0, memory_order_relaxed);
	atomic_store_explicit(&fired, 0, memory_order_relaxed);
	atomic_store_explicit(&armed_class, (int)c, memory_order_relaxed);
	atomic_store_explicit(&armed_n, n, memory_order_relaxed);
	/* release: pairs with no acquire on the hot path (fault.h: arming
	 * happens between library calls); it orders the fields above for a
	 * thread that the next library call starts or wakes, whose own
	 * synchronisation (pthread_create, a mutex) carries them */
	atomic_store_explicit(&kvr_fault_enabled, 1, memory_order_release);
}

void kvr_fault_reset(void)
{
	/* relaxed: as in kvr_fault_arm, no library call runs now */
	atomic_store_explicit(&kvr_fault_enabled, 0, memory_order_relaxed);
	atomic_store_explicit(&armed_n, 0, memory_order_relaxed);
}

uint64_t kvr_fault_count(enum kvr_fault_class c)
{
	/* relaxed: the threads that counted have been joined or synchronised with */
	return c < KVR_FAULT_CLASSES ? atomic_load_explicit(&counts[c], memory_order_relaxed) : 0;
}

uint64_t kvr_fault_fired(void)
{
	/* relaxed: see kvr_fault_hit_slow */
	return atomic_load_explicit(&fired, memory_order_relaxed);
}

const char *kvr_fault_class_name(enum kvr_fault_class c)
{
	static const char *const names[KVR_FAULT_CLASSES] = {
		"host-alloc", "dev-alloc", "copy", "stream/event", "thread", "spill-io",
	};
	return c < KVR_FAULT_CLASSES ? names[c] : "?";
}
