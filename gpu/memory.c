/* SPDX-License-Identifier: MIT */
/*
 * memory.c — the memory model of memory.h: mapped, scratch and tile buffers
 * and mirrors, placed by whether the device addresses host memory.
 *
 * Keeping mapped buffers host memory lets planning code read and write them
 * directly on every backend; the price on a GPU is that the few kernels that
 * read them (attention's tail page, selection's summaries when they are not
 * resident) do so over the bus.
 *
 * Threads: any (each buffer has one owner; see the callers).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "memory.h"

/* The one place that asks: does the device have memory of its own? */
static int apart(const struct kvr_dev *dev)
{
	return !kvr_dev_host_visible(dev);
}

int kvr_mapped_alloc(struct kvr_dev *dev, size_t bytes, void **out)
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
	if (apart(dev)) {
		int err = kvr_dev_host_register(dev, p, rounded);
		if (err) {
			free(p);
			return err;
		}
	}
	*out = p;
	return 0;
}

void kvr_mapped_free(struct kvr_dev *dev, void *p)
{
	if (!p)
		return;
	if (apart(dev))
		kvr_dev_host_unregister(dev, p);
	free(p);
}

int kvr_mapped_grow(struct kvr_dev *dev, void **buf, size_t *bytes, size_t need)
{
	if (need <= *bytes && *buf)
		return 0;
	void *p;
	int err = kvr_mapped_alloc(dev, need, &p);
	if (err)
		return err;
	kvr_mapped_free(dev, *buf);
	*buf = p;
	*bytes = need;
	return 0;
}

int kvr_scratch_grow(struct kvr_dev *dev, void **buf, size_t *bytes, size_t need)
{
	if (need <= *bytes && *buf)
		return 0;
	void *p = NULL;
	int err = apart(dev) ? kvr_dev_alloc(dev, need, &p) : (posix_memalign(&p, 64, need) ? -ENOMEM : 0);
	if (err)
		return err;
	kvr_scratch_free(dev, *buf);
	*buf = p;
	*bytes = need;
	return 0;
}

void kvr_scratch_free(struct kvr_dev *dev, void *p)
{
	if (apart(dev))
		kvr_dev_free(dev, p);
	else
		free(p);
}

int kvr_tile_alloc(struct kvr_dev *dev, size_t bytes, void **out)
{
	return apart(dev) ? kvr_mapped_alloc(dev, bytes, out) : kvr_dev_alloc(dev, bytes, out);
}

void kvr_tile_free(struct kvr_dev *dev, void *p)
{
	if (apart(dev))
		kvr_mapped_free(dev, p);
	else
		kvr_dev_free(dev, p);
}

int kvr_mirror_grow(struct kvr_dev *dev, struct kvr_mirror *m, size_t need)
{
	if (need <= m->bytes && m->host)
		return 0;
	struct kvr_mirror g = { NULL, NULL, need };
	int err = kvr_mapped_alloc(dev, need, &g.host);
	g.dev = g.host;
	if (!err && apart(dev)) {
		g.dev = NULL;
		if ((err = kvr_dev_alloc(dev, need, &g.dev)))
			kvr_mapped_free(dev, g.host);
	}
	if (err)
		return err;
	kvr_mirror_free(dev, m);
	*m = g;
	return 0;
}

void kvr_mirror_free(struct kvr_dev *dev, struct kvr_mirror *m)
{
	if (m->dev != m->host)
		kvr_dev_free(dev, m->dev);
	kvr_mapped_free(dev, m->host);
	*m = (struct kvr_mirror){ NULL, NULL, 0 };
}

int kvr_mirror_to_device(struct kvr_dev *dev, const struct kvr_mirror *m, const void *host_at, size_t bytes,
			 struct kvr_stream *stream)
{
	if (m->dev == m->host || !bytes)
		return 0;
	return kvr_dev_memcpy_async(dev, kvr_mirror_dev_at(m, host_at), host_at, bytes, KVR_COPY_H2D, stream);
}

int kvr_host_view(struct kvr_dev *dev, void *stage, size_t off, const void *src, size_t bytes,
		  struct kvr_stream *stream, const void **view)
{
	if (!apart(dev)) {
		*view = src;
		return 0;
	}
	unsigned char *at = (unsigned char *)stage + off; /* a stage exists only here */
	*view = at;
	return bytes ? kvr_dev_memcpy_async(dev, at, src, bytes, KVR_COPY_D2H, stream) : 0;
}

int kvr_stage_grow(struct kvr_dev *dev, void **stage, size_t *bytes, size_t need)
{
	/* device memory where the device has its own (kernel scratch there) */
	return apart(dev) ? kvr_scratch_grow(dev, stage, bytes, need) : 0;
}

void kvr_stage_free(struct kvr_dev *dev, void *stage)
{
	if (stage)
		kvr_scratch_free(dev, stage);
}

int kvr_host_stage_grow(struct kvr_dev *dev, void **stage, size_t *bytes, size_t need)
{
	return apart(dev) ? kvr_mapped_grow(dev, stage, bytes, need) : 0;
}

int kvr_stage_in(struct kvr_dev *dev, void *stage, const void *src, size_t bytes, struct kvr_stream *stream,
		 const void **view)
{
	if (!apart(dev)) {
		*view = src;
		return 0;
	}
	*view = stage;
	return bytes ? kvr_dev_memcpy_async(dev, stage, src, bytes, KVR_COPY_H2D, stream) : 0;
}

void *kvr_stage_out_view(struct kvr_dev *dev, void *stage, void *dst)
{
	return apart(dev) ? stage : dst;
}

int kvr_stage_out(struct kvr_dev *dev, void *dst, const void *view, size_t bytes, struct kvr_stream *stream)
{
	if (view == dst || !bytes)
		return 0;
	return kvr_dev_memcpy_async(dev, dst, view, bytes, KVR_COPY_D2H, stream);
}
