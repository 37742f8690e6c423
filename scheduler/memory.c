/* SPDX-License-Identifier: MIT */
/*
 * memory.c — where the scheduler's buffers live, on devices whose memory the
 * host can address (cpu, cudaemu) and on those it cannot (cuda; cudaemu-strict
 * in tests).
 *
 * Three kinds of buffer:
 *  - device buffers, written and read only by kernels (score buffers, slots,
 *    staging): kvr_dev_alloc;
 *  - mapped buffers, written by the host and read by kernels, or written by
 *    kernels and read by the host after a stream synchronisation (selections,
 *    previous queries, the tail tiles, the step's input mirror, and item
 *    arrays, which on a separate-memory device are copied to a device twin
 *    before each launch — a kernel reading its items over the bus would pay
 *    the bus latency for every descriptor):
 *    on a separate-memory device page-aligned host memory registered with the
 *    device (pinned and mapped: a GPU reads it over the bus through unified
 *    addressing), elsewhere plain host memory;
 *  - host-only bookkeeping: malloc.
 * Keeping the mapped buffers host memory lets the planning code read and write
 * them directly on every backend; the price on a GPU is that attention reads
 * the tail page and the selection reads the summaries over the bus.
 *
 * Threads: any (each buffer has one owner; see the callers).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "sched_impl.h"

int kvr_sched_mapped_alloc(struct kvr_sched *s, size_t bytes, void **out)
{
	*out = NULL;
	if (!bytes)
		bytes = 64;
	/* whole pages: registration pins pages, and two buffers must not share one */
	const size_t rounded = (bytes + 4095) & ~(size_t)4095;
	void *p = NULL;
	if (posix_memalign(&p, 4096, rounded))
		return -ENOMEM;
	memset(p, 0, rounded);
	if (s->separate) {
		int err = kvr_dev_host_register(s->dev, p, rounded);
		if (err) {
			free(p);
			return err;
		}
	}
	*out = p;
	return 0;
}

void kvr_sched_mapped_free(struct kvr_sched *s, void *p)
{
	if (!p)
		return;
	if (s->separate)
		kvr_dev_host_unregister(s->dev, p);
	free(p);
}

/* Grow a buffer to `need` bytes; the old contents are not kept. The caller
 * guarantees no queued work still reads the old buffer. */
int kvr_sched_mapped_grow(struct kvr_sched *s, void **buf, size_t *bytes, size_t need)
{
	if (need <= *bytes && *buf)
		return 0;
	void *p;
	int err = kvr_sched_mapped_alloc(s, need, &p);
	if (err)
		return err;
	kvr_sched_mapped_free(s, *buf);
	*buf = p;
	*bytes = need;
	return 0;
}

/* Device memory on a separate-memory device; host memory elsewhere (kernel
 * scratch the engine's device allocator need not see). */
int kvr_sched_device_grow(struct kvr_sched *s, void **buf, size_t *bytes, size_t need)
{
	if (need <= *bytes && *buf)
		return 0;
	void *p = NULL;
	int err = s->separate ? kvr_dev_alloc(s->dev, need, &p)
			      : (posix_memalign(&p, 64, need) ? -ENOMEM : 0);
	if (err)
		return err;
	kvr_sched_device_free(s, *buf);
	*buf = p;
	*bytes = need;
	return 0;
}

void kvr_sched_device_free(struct kvr_sched *s, void *p)
{
	if (s->separate)
		kvr_dev_free(s->dev, p);
	else
		free(p);
}

int kvr_sched_tile_alloc(struct kvr_sched *s, size_t bytes, void **out)
{
	if (!s->separate)
		return kvr_dev_alloc(s->dev, bytes, out);
	return kvr_sched_mapped_alloc(s, bytes, out);
}

void kvr_sched_tile_free(struct kvr_sched *s, void *p)
{
	if (!s->separate)
		kvr_dev_free(s->dev, p);
	else
		kvr_sched_mapped_free(s, p);
}

int kvr_sched_items_to_device(struct kvr_sched *s, struct kvr_stream *stream, void *dev,
			      const void *host, size_t bytes)
{
	if (!s->separate || !bytes)
		return 0;
	return kvr_dev_memcpy_async(s->dev, dev, host, bytes, KVR_COPY_H2D, stream);
}

int kvr_sched_separate_memory(const struct kvr_sched *s)
{
	return s->separate;
}
