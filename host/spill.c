/* SPDX-License-Identifier: MIT */
/*
 * spill.c — the spill tier's file (spill.h): slots, checksums, and the I/O
 * engine that moves runs between the file and two staging buffers.
 *
 * The engine runs a list of requests (one I/O each: a slot's run, or a whole
 * slot) with at most queue_depth in flight. A caller makes requests eligible
 * in staging-buffer batches (engine_push) and waits for a prefix of them
 * (engine_wait), which is how reads overlap the checking and copying out of
 * the previous batch and writes overlap the packing of the next. Without
 * io_uring, engine_wait performs the eligible requests itself with
 * pread/pwrite.
 *
 * Threads: every public function takes sp->lock for its whole duration; the
 * engine and the slot allocator run under it. Nothing here starts a thread.
 */
#include "spill.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/uio.h>
#include <unistd.h>

#ifdef KVR_HAVE_LIBURING
#include <liburing.h>
#endif

#include "../layouts/base/fault.h"
#include "crc32c.h"

#define SPILL_DEFAULT_ALIGN 4096u     /* when statx does not say */
#define SPILL_BUFFER_ALIGN 4096u      /* staging buffers: page-aligned */
#define SPILL_EXTENT_BYTES (64ull << 20) /* the file grows by this much at a time */
#define SPILL_MAX_QUEUE_DEPTH 4096u

struct io_req {
	uint64_t offset;  /* in the file */
	uint32_t len;     /* bytes */
	uint32_t buffer;  /* staging buffer 0 or 1 */
	uint64_t buf_off; /* in the staging buffer */
	uint32_t slot;    /* for fault matching and messages */
	uint32_t write;   /* 1: write, 0: read */
	int32_t res;      /* bytes moved or a negative errno, once done */
	uint32_t done;
};

/* One read request's destinations: the request reads runs [first, first+n)
 * of `slot`; run first+r goes to dst[r]. */
struct read_extent {
	uint32_t slot, first, n;
	uint32_t out; /* index of its first result / destination */
};

struct kvr_spill {
	pthread_mutex_t lock;
	int fd;
	uint64_t run_bytes, run_stride, slot_bytes;
	uint32_t runs_per_page;
	uint32_t align;
	uint32_t direct;
	uint64_t max_slots;  /* slots max_bytes allows (UINT32_MAX - 1 at most) */
	uint64_t file_slots; /* slots the file has been extended to */
	int grow_by_write;   /* fallocate unsupported: writes extend the file */

	/* slots: a LIFO stack of freed slots over the high-water mark */
	uint32_t high;
	uint32_t *free_stack;
	uint32_t n_free;
	uint8_t *live;      /* [slot] 1 while it holds a page */
	uint32_t *crc;      /* [slot][run] */
	uint64_t slots_cap; /* capacity of free_stack, live and crc */

	unsigned char *staging[2];
	uint64_t staging_bytes; /* each: staging_slots · slot_bytes */
	uint32_t staging_slots;

	uint32_t queue_depth;
	int uring;      /* 1: the ring below is live */
	int registered; /* 1: staging buffers (and the file) are registered */
#ifdef KVR_HAVE_LIBURING
	struct io_uring ring;
#endif
	/* the current call's requests (grow-only scratch) */
	struct io_req *reqs;
	uint32_t reqs_cap;
	uint32_t n_reqs;
	uint32_t eligible;    /* requests [0, eligible) may be submitted */
	uint32_t next_submit; /* first request not yet submitted */
	uint32_t in_flight;
	uint32_t done_prefix; /* requests [0, done_prefix) are done */
	struct read_extent *extents;
	uint32_t extents_cap;

	struct kvr_spill_fault fault;
	uint32_t fault_applied;

	struct kvr_spill_stats st;
	kvr_spill_log_fn log_fn;
	void *log_user;
	char message[256];
};

/* ---- helpers ---- */

static int spill_fail(struct kvr_spill *sp, int err, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static int spill_fail(struct kvr_spill *sp, int err, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(sp->message, sizeof(sp->message), fmt, ap);
	va_end(ap);
	return err;
}

static void spill_log(struct kvr_spill *sp, int level, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static void spill_log(struct kvr_spill *sp, int level, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	kvr_host_vlog(sp->log_fn, sp->log_user, level, fmt, ap);
	va_end(ap);
}

static uint64_t round_up(uint64_t x, uint64_t a)
{
	return (x + a - 1) / a * a;
}

const char *kvr_spill_default_dir(void)
{
	const char *t = getenv("TMPDIR");
	return t && *t ? t : "/var/tmp";
}

/* An unlinked file in dir: O_TMPFILE where the file system has it, else a
 * named file removed at once. Returns the fd or a negative errno. */
static int open_unlinked(const char *dir, char *why, size_t why_bytes)
{
	int fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
	if (fd >= 0)
		return fd;
	int e = errno;
	if (e != EOPNOTSUPP && e != EISDIR && e != EINVAL) {
		snprintf(why, why_bytes, "spill directory %s: %s", dir, strerror(e));
		return -e;
	}
	char path[PATH_MAX];
	if (snprintf(path, sizeof(path), "%s/kvrecall-spill-XXXXXX", dir) >= (int)sizeof(path)) {
		snprintf(why, why_bytes, "spill directory %s: path too long", dir);
		return -ENAMETOOLONG;
	}
	fd = mkostemp(path, O_CLOEXEC);
	if (fd < 0) {
		e = errno;
		snprintf(why, why_bytes, "spill directory %s: %s", dir, strerror(e));
		return -e;
	}
	unlink(path);
	return fd;
}

/* The file system's direct-I/O alignment for fd (statx, Linux 6.1+), else
 * SPILL_DEFAULT_ALIGN. */
static uint32_t dio_alignment(int fd)
{
	uint32_t align = SPILL_DEFAULT_ALIGN;
#ifdef STATX_DIOALIGN
	struct statx sx;
	if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
	    sx.stx_dio_offset_align) {
		align = sx.stx_dio_offset_align;
		if (sx.stx_dio_mem_align > align)
			align = sx.stx_dio_mem_align;
	}
#else
	(void)fd;
#endif
	return align < 512 ? 512 : align;
}

/* Turn O_DIRECT on for fd and prove it with one aligned write and read at
 * offset 0 (some file systems accept the flag and refuse the I/O). 1 when it
 * works (the flag stays on), else 0 with the reason and the flag off. */
static int try_direct(int fd, uint32_t align, char *why, size_t why_bytes)
{
	int flags = fcntl(fd, F_GETFL);
	if (flags < 0 || fcntl(fd, F_SETFL, flags | O_DIRECT) < 0) {
		snprintf(why, why_bytes, "O_DIRECT refused: %s", strerror(errno));
		return 0;
	}
	void *block = NULL;
	if (posix_memalign(&block, align < SPILL_BUFFER_ALIGN ? SPILL_BUFFER_ALIGN : align, align)) {
		fcntl(fd, F_SETFL, flags);
		snprintf(why, why_bytes, "out of memory");
		return 0;
	}
	memset(block, 0, align);
	ssize_t w = pwrite(fd, block, align, 0);
	int e = errno;
	ssize_t r = w == (ssize_t)align ? pread(fd, block, align, 0) : -1;
	if (w != (ssize_t)align)
		snprintf(why, why_bytes, "O_DIRECT write of %u bytes: %s", align,
			 w < 0 ? strerror(e) : "short");
	else if (r != (ssize_t)align)
		snprintf(why, why_bytes, "O_DIRECT read of %u bytes: %s", align,
			 r < 0 ? strerror(errno) : "short");
	free(block);
	if (ftruncate(fd, 0) != 0) { /* the probe's block is not a slot */
	}
	if (w == (ssize_t)align && r == (ssize_t)align) {
		if (why_bytes)
			why[0] = '\0';
		return 1;
	}
	fcntl(fd, F_SETFL, flags);
	return 0;
}

static const char *fs_name(long type)
{
	switch ((unsigned long)type & 0xffffffffu) {
	case 0xef53: return "ext4";
	case 0x58465342: return "xfs";
	case 0x9123683e: return "btrfs";
	case 0x01021994: return "tmpfs";
	case 0x794c7630: return "overlay";
	case 0x6969: return "nfs";
	case 0x2fc12fc1: return "zfs";
	case 0xf2f52010: return "f2fs";
	case 0x65735546: return "fuse";
	default: return "other";
	}
}

int kvr_spill_probe_dir(const char *dir, uint32_t *direct_io, uint32_t *dio_align, char *fs_type,
			size_t fs_type_bytes, uint64_t *free_bytes, char *reason, size_t reason_bytes)
{
	if (!dir || !*dir)
		dir = kvr_spill_default_dir();
	*direct_io = 0;
	*dio_align = 0;
	*free_bytes = 0;
	if (fs_type_bytes)
		fs_type[0] = '\0';
	struct statfs sfs;
	if (statfs(dir, &sfs) != 0) {
		int e = errno;
		snprintf(reason, reason_bytes, "spill directory %s: %s", dir, strerror(e));
		return -e;
	}
	snprintf(fs_type, fs_type_bytes, "%s", fs_name((long)sfs.f_type));
	*free_bytes = (uint64_t)sfs.f_bavail * (uint64_t)sfs.f_bsize;
	int fd = open_unlinked(dir, reason, reason_bytes);
	if (fd < 0)
		return fd;
	uint32_t align = dio_alignment(fd);
	*direct_io = (uint32_t)try_direct(fd, align, reason, reason_bytes);
	*dio_align = *direct_io ? align : 0;
	close(fd);
	return 0;
}

/* ---- slots ---- */

/* Make room for slot ids below `need` in the per-slot arrays. */
static int reserve_slot_arrays(struct kvr_spill *sp, uint64_t need)
{
	if (need <= sp->slots_cap)
		return 0;
	uint64_t cap = sp->slots_cap ? sp->slots_cap : 1024;
	while (cap < need)
		cap *= 2;
	uint32_t *fs = realloc(sp->free_stack, cap * sizeof(*fs));
	if (!fs)
		return -ENOMEM;
	sp->free_stack = fs;
	uint8_t *live = realloc(sp->live, cap);
	if (!live)
		return -ENOMEM;
	memset(live + sp->slots_cap, 0, cap - sp->slots_cap);
	sp->live = live;
	uint32_t *crc = realloc(sp->crc, cap * sp->runs_per_page * sizeof(*crc));
	if (!crc)
		return -ENOMEM;
	sp->crc = crc;
	sp->slots_cap = cap;
	return 0;
}

/* Extend the file so that slots below `need` lie inside it. */
static int extend_file(struct kvr_spill *sp, uint64_t need)
{
	if (need <= sp->file_slots || sp->grow_by_write)
		return 0;
	const uint64_t extent = SPILL_EXTENT_BYTES / sp->slot_bytes ? SPILL_EXTENT_BYTES / sp->slot_bytes : 1;
	uint64_t target = round_up(need, extent);
	if (target > sp->max_slots)
		target = sp->max_slots;
	for (;;) {
		const off_t from = (off_t)(sp->file_slots * sp->slot_bytes);
		const off_t len = (off_t)((target - sp->file_slots) * sp->slot_bytes);
		if (fallocate(sp->fd, 0, from, len) == 0) {
			sp->file_slots = target;
			sp->st.file_bytes = target * sp->slot_bytes;
			return 0;
		}
		int e = errno;
		if (e == EOPNOTSUPP || e == ENOSYS) {
			sp->grow_by_write = 1; /* writes past the end extend the file */
			return 0;
		}
		if (e == EINTR)
			continue;
		if (e == ENOSPC && target > need) {
			target = need; /* not a whole extent: maybe just what this call needs */
			continue;
		}
		return spill_fail(sp, -e, "spill file: cannot grow to %llu bytes: %s",
				  (unsigned long long)(target * sp->slot_bytes), strerror(e));
	}
}

/* Does the fault apply to this I/O (or slot allocation)? Counts it if so. */
static int fault_hits(struct kvr_spill *sp, uint32_t kind_a, uint32_t kind_b, uint32_t slot)
{
	struct kvr_spill_fault *f = &sp->fault;
	if (f->kind == KVR_SPILL_FAULT_NONE || (f->kind != kind_a && f->kind != kind_b))
		return 0;
	if (f->slot != KVR_SPILL_NO_SLOT && f->slot != slot)
		return 0;
	if (f->skip) {
		f->skip--;
		return 0;
	}
	if (f->count && ++sp->fault_applied >= f->count)
		f->kind = KVR_SPILL_FAULT_NONE; /* this was the last one */
	return 1;
}

/* Take n slots into out[], all or nothing. */
static int take_slots(struct kvr_spill *sp, uint32_t n, uint32_t *out)
{
	const uint32_t from_stack = n < sp->n_free ? n : sp->n_free;
	const uint64_t fresh = n - from_stack;
	if ((uint64_t)sp->high + fresh > sp->max_slots)
		return spill_fail(sp, -ENOSPC,
				  "spill file full: %u slots wanted, %u free and %llu of %llu never used "
				  "(max_bytes)",
				  n, sp->n_free, (unsigned long long)(sp->max_slots - sp->high),
				  (unsigned long long)sp->max_slots);
	if (fault_hits(sp, KVR_SPILL_FAULT_NOSPC, KVR_SPILL_FAULT_NOSPC, KVR_SPILL_NO_SLOT))
		return spill_fail(sp, -ENOSPC, "spill file: no space left on device (injected)");
	int err = reserve_slot_arrays(sp, sp->high + fresh);
	if (err)
		return spill_fail(sp, err, "spill: out of memory for %llu slots",
				  (unsigned long long)(sp->high + fresh));
	err = extend_file(sp, sp->high + fresh);
	if (err)
		return err;
	for (uint32_t i = 0; i < from_stack; i++)
		out[i] = sp->free_stack[--sp->n_free];
	for (uint32_t i = from_stack; i < n; i++)
		out[i] = sp->high++;
	for (uint32_t i = 0; i < n; i++)
		sp->live[out[i]] = 1;
	sp->st.slots_used += n;
	if (sp->high > sp->st.slots_high)
		sp->st.slots_high = sp->high;
	return 0;
}

static void give_back(struct kvr_spill *sp, uint32_t slot)
{
	sp->live[slot] = 0;
	sp->free_stack[sp->n_free++] = slot;
	sp->st.slots_used--;
}

/* ---- the I/O engine ---- */

/* Grow-only scratch: `array`, or a larger copy of it, with room for n
 * elements of `elem` bytes; when memory runs out, `array` as it was and *cap
 * unchanged (so below n). */
static void *grow_scratch(void *array, uint32_t *cap, uint32_t n, size_t elem)
{
	if (n <= *cap && array)
		return array;
	uint64_t want = *cap ? *cap : 64;
	while (want < n)
		want *= 2;
	void *grown = realloc(array, (size_t)want * elem);
	if (!grown)
		return array;
	*cap = (uint32_t)(want > UINT32_MAX ? UINT32_MAX : want);
	return grown;
}

/* sp->reqs and sp->extents with room for n: 0, or -ENOMEM */
#define RESERVE_SCRATCH(sp, field, n)                                                       \
	((sp)->field = grow_scratch((sp)->field, &(sp)->field##_cap, (n), sizeof(*(sp)->field)), \
	 (sp)->field && (sp)->field##_cap >= (n) ? 0 : -ENOMEM)
#define reserve_reqs(sp, n) RESERVE_SCRATCH(sp, reqs, n)
#define reserve_extents(sp, n) RESERVE_SCRATCH(sp, extents, n)

static void engine_reset(struct kvr_spill *sp)
{
	sp->n_reqs = sp->eligible = sp->next_submit = sp->in_flight = sp->done_prefix = 0;
}

/* A request finished with `res`: apply an injected fault, count, record. */
static void engine_complete(struct kvr_spill *sp, struct io_req *q, int32_t res)
{
	unsigned char *buf = sp->staging[q->buffer] + q->buf_off;
	const uint32_t kind = sp->fault.kind; /* fault_hits may clear it */
	if (kvr_fault_hit(KVR_FAULT_SPILL_IO)) {
		res = -EIO; /* the process-wide hook (layouts/base/fault.h): any read or write */
	} else if (q->write) {
		if (fault_hits(sp, KVR_SPILL_FAULT_WRITE_EIO, KVR_SPILL_FAULT_WRITE_SHORT, q->slot))
			res = kind == KVR_SPILL_FAULT_WRITE_EIO || res < 0 ? -EIO : (int32_t)(q->len / 2);
	} else {
		if (fault_hits(sp, KVR_SPILL_FAULT_READ_EIO, KVR_SPILL_FAULT_READ_SHORT, q->slot))
			res = kind == KVR_SPILL_FAULT_READ_EIO ? -EIO : (int32_t)(q->len / 2);
		else if (res == (int32_t)q->len &&
			 fault_hits(sp, KVR_SPILL_FAULT_READ_CORRUPT, KVR_SPILL_FAULT_READ_CORRUPT, q->slot))
			/* a byte of a run's data (not its padding, which no CRC covers) */
			buf[(uint64_t)(q->len / sp->run_stride / 2) * sp->run_stride + sp->run_bytes / 3] ^= 0x10;
	}
	if (res >= 0) {
		if (q->write)
			sp->st.bytes_written += (uint64_t)res;
		else
			sp->st.bytes_read += (uint64_t)res;
	}
	if (res != (int32_t)q->len)
		sp->st.io_errors++;
	q->res = res;
	q->done = 1;
}

#ifdef KVR_HAVE_LIBURING
/* Fill the submission queue from the eligible requests; submit. */
static int uring_submit(struct kvr_spill *sp)
{
	while (sp->next_submit < sp->eligible && sp->in_flight < sp->queue_depth) {
		struct io_uring_sqe *sqe = io_uring_get_sqe(&sp->ring);
		if (!sqe)
			break;
		struct io_req *q = &sp->reqs[sp->next_submit];
		unsigned char *buf = sp->staging[q->buffer] + q->buf_off;
		const int fd = sp->registered ? 0 : sp->fd;
		if (sp->registered && q->write)
			io_uring_prep_write_fixed(sqe, fd, buf, q->len, q->offset, (int)q->buffer);
		else if (sp->registered)
			io_uring_prep_read_fixed(sqe, fd, buf, q->len, q->offset, (int)q->buffer);
		else if (q->write)
			io_uring_prep_write(sqe, fd, buf, q->len, q->offset);
		else
			io_uring_prep_read(sqe, fd, buf, q->len, q->offset);
		if (sp->registered)
			sqe->flags |= IOSQE_FIXED_FILE;
		io_uring_sqe_set_data64(sqe, sp->next_submit);
		sp->next_submit++;
		sp->in_flight++;
	}
	/* also entries queued earlier (a retried request, a refused submit) */
	for (int tries = 0;; tries++) {
		const unsigned ready = io_uring_sq_ready(&sp->ring);
		if (!ready)
			break;
		int ret = io_uring_submit(&sp->ring);
		if (ret > 0)
			continue; /* until nothing is left queued */
		if (ret == -EINTR)
			continue;
		/* out of kernel resources for now: what is already submitted will
		 * complete, and the next submit sends the queued entries */
		if (ret == 0 || ret == -EAGAIN || ret == -EBUSY) {
			if (sp->in_flight > ready)
				break;
			if (tries < 1000)
				continue;
		}
		return ret ? ret : -EAGAIN;
	}
	return 0;
}

/* Reap until requests [0, upto) are done, keeping the queue full. */
static int uring_wait(struct kvr_spill *sp, uint32_t upto)
{
	for (;;) {
		int err = uring_submit(sp);
		if (err)
			return err;
		/* only submitted requests can be done: entries past next_submit
		 * may still hold an earlier call's state */
		while (sp->done_prefix < sp->next_submit && sp->reqs[sp->done_prefix].done)
			sp->done_prefix++;
		if (sp->done_prefix >= upto)
			return 0;
		struct io_uring_cqe *cqe;
		int ret = io_uring_wait_cqe(&sp->ring, &cqe);
		if (ret == -EINTR)
			continue;
		if (ret < 0)
			return ret;
		unsigned head, seen = 0;
		io_uring_for_each_cqe(&sp->ring, head, cqe) {
			struct io_req *q = &sp->reqs[io_uring_cqe_get_data64(cqe)];
			const int32_t res = cqe->res;
			seen++;
			sp->in_flight--;
			if (res == -EAGAIN || res == -EINTR) { /* not done: go again */
				uint32_t idx = (uint32_t)(q - sp->reqs);
				struct io_uring_sqe *sqe = io_uring_get_sqe(&sp->ring);
				if (!sqe) {
					engine_complete(sp, q, -EIO);
					continue;
				}
				unsigned char *buf = sp->staging[q->buffer] + q->buf_off;
				const int fd = sp->registered ? 0 : sp->fd;
				if (q->write)
					io_uring_prep_write(sqe, fd, buf, q->len, q->offset);
				else
					io_uring_prep_read(sqe, fd, buf, q->len, q->offset);
				if (sp->registered)
					sqe->flags |= IOSQE_FIXED_FILE;
				io_uring_sqe_set_data64(sqe, idx);
				sp->in_flight++;
				continue;
			}
			engine_complete(sp, q, res);
		}
		io_uring_cq_advance(&sp->ring, seen);
	}
}
#endif

/* Perform requests [next_submit, upto) one by one with pread/pwrite. */
static void sync_run(struct kvr_spill *sp, uint32_t upto)
{
	for (; sp->next_submit < upto; sp->next_submit++) {
		struct io_req *q = &sp->reqs[sp->next_submit];
		unsigned char *buf = sp->staging[q->buffer] + q->buf_off;
		uint64_t moved = 0;
		int32_t res = 0;
		while (moved < q->len) { /* a short transfer is retried until it moves nothing */
			ssize_t r = q->write ? pwrite(sp->fd, buf + moved, q->len - moved, (off_t)(q->offset + moved))
					     : pread(sp->fd, buf + moved, q->len - moved, (off_t)(q->offset + moved));
			if (r < 0 && errno == EINTR)
				continue;
			if (r < 0) {
				res = -errno;
				break;
			}
			if (r == 0)
				break;
			moved += (uint64_t)r;
		}
		engine_complete(sp, q, res < 0 ? res : (int32_t)moved);
	}
}

/* Requests [0, upto) may go out. */
static int engine_push(struct kvr_spill *sp, uint32_t upto)
{
	if (upto > sp->eligible)
		sp->eligible = upto;
#ifdef KVR_HAVE_LIBURING
	if (sp->uring)
		return uring_submit(sp);
#endif
	return 0;
}

/* Wait until requests [0, upto) are done (performing them without io_uring).
 * A ring failure (not an I/O's) is returned; requests still in flight then
 * are drained first, so no completion can land in a buffer reused later. */
static int engine_wait(struct kvr_spill *sp, uint32_t upto)
{
#ifdef KVR_HAVE_LIBURING
	if (sp->uring) {
		int err = uring_wait(sp, upto);
		if (err) {
			/* The ring itself failed: drain what is in flight (no completion
			 * may land in a buffer reused later), fail every request not
			 * done, and fall back to pread/pwrite from now on. */
			while (sp->in_flight) {
				struct io_uring_cqe *cqe;
				int ret = io_uring_wait_cqe(&sp->ring, &cqe);
				if (ret == -EINTR)
					continue;
				if (ret < 0)
					break;
				io_uring_cqe_seen(&sp->ring, cqe);
				sp->in_flight--;
			}
			io_uring_queue_exit(&sp->ring);
			sp->uring = sp->registered = 0;
			sp->st.io_uring = sp->st.registered = 0;
			for (uint32_t i = 0; i < sp->n_reqs; i++)
				if (!sp->reqs[i].done)
					engine_complete(sp, &sp->reqs[i], -EIO);
			sp->next_submit = sp->eligible = sp->n_reqs;
			sp->in_flight = 0;
			spill_log(sp, 1, "spill: io_uring failed (%s); using pread/pwrite", strerror(-err));
			return spill_fail(sp, err, "spill: io_uring: %s", strerror(-err));
		}
		return 0;
	}
#endif
	sync_run(sp, upto);
	return 0;
}

/* ---- create / destroy ---- */

int kvr_spill_create(const struct kvr_spill_params *p, struct kvr_spill **out, char *err,
		     size_t err_bytes)
{
	if (!out)
		return -EINVAL;
	*out = NULL;
	if (!p || !p->run_bytes || !p->runs_per_page || p->queue_depth > SPILL_MAX_QUEUE_DEPTH ||
	    p->run_bytes > (1ull << 30) ||
	    (p->flags & ~(uint32_t)(KVR_SPILL_BUFFERED | KVR_SPILL_SYNC | KVR_SPILL_REQUIRE_DIRECT |
				    KVR_SPILL_UNREGISTERED))) {
		snprintf(err, err_bytes,
			 "spill params: run_bytes (1..2^30) and runs_per_page must be set, queue_depth "
			 "at most %u, flags known",
			 SPILL_MAX_QUEUE_DEPTH);
		return -EINVAL;
	}
	if ((p->flags & KVR_SPILL_BUFFERED) && (p->flags & KVR_SPILL_REQUIRE_DIRECT)) {
		snprintf(err, err_bytes, "spill params: BUFFERED and REQUIRE_DIRECT contradict");
		return -EINVAL;
	}
	struct kvr_spill *sp = calloc(1, sizeof(*sp));
	if (!sp) {
		snprintf(err, err_bytes, "spill: out of memory");
		return -ENOMEM;
	}
	pthread_mutex_init(&sp->lock, NULL);
	sp->log_fn = p->log_fn;
	sp->log_user = p->log_user;
	const char *dir = p->dir && *p->dir ? p->dir : kvr_spill_default_dir();
	char why[200] = "";
	int ret = open_unlinked(dir, why, sizeof(why));
	if (ret < 0) {
		snprintf(err, err_bytes, "%s", why);
		free(sp);
		return ret;
	}
	sp->fd = ret;
	sp->align = 512;
	if (!(p->flags & KVR_SPILL_BUFFERED)) {
		const uint32_t align = dio_alignment(sp->fd);
		if (try_direct(sp->fd, align, why, sizeof(why))) {
			sp->direct = 1;
			sp->align = align;
		} else if (p->flags & KVR_SPILL_REQUIRE_DIRECT) {
			snprintf(err, err_bytes, "spill directory %s: %s", dir, why);
			close(sp->fd);
			free(sp);
			return -EOPNOTSUPP;
		} else {
			spill_log(sp, 1, "spill directory %s: %s; spilling through the page cache", dir, why);
		}
	}
	sp->run_bytes = p->run_bytes;
	sp->runs_per_page = p->runs_per_page;
	sp->run_stride = round_up(p->run_bytes, sp->align);
	sp->slot_bytes = sp->run_stride * p->runs_per_page;
	if (sp->slot_bytes > INT32_MAX) { /* one I/O moves a slot; its result is an int32 */
		snprintf(err, err_bytes, "spill params: a page of %u runs of %llu bytes exceeds 2 GiB",
			 p->runs_per_page, (unsigned long long)p->run_bytes);
		kvr_spill_destroy(sp);
		return -EINVAL;
	}
	if (p->max_bytes && p->max_bytes < sp->slot_bytes) {
		snprintf(err, err_bytes, "spill params: max_bytes %llu is less than one slot (%llu bytes)",
			 (unsigned long long)p->max_bytes, (unsigned long long)sp->slot_bytes);
		kvr_spill_destroy(sp);
		return -EINVAL;
	}
	uint64_t max_slots = p->max_bytes ? p->max_bytes / sp->slot_bytes : UINT32_MAX - 1ull;
	sp->max_slots = max_slots > UINT32_MAX - 1ull ? UINT32_MAX - 1ull : max_slots;
	uint64_t staging = p->staging_bytes ? p->staging_bytes : KVR_SPILL_DEFAULT_STAGING_BYTES;
	sp->staging_slots = (uint32_t)(staging / sp->slot_bytes ? (staging / sp->slot_bytes > UINT32_MAX / 2 ? UINT32_MAX / 2 : staging / sp->slot_bytes) : 1);
	sp->staging_bytes = (uint64_t)sp->staging_slots * sp->slot_bytes;
	sp->queue_depth = p->queue_depth ? p->queue_depth : KVR_SPILL_DEFAULT_QUEUE_DEPTH;
	for (int b = 0; b < 2; b++) {
		void *m = NULL;
		if (posix_memalign(&m, SPILL_BUFFER_ALIGN, sp->staging_bytes)) {
			snprintf(err, err_bytes, "spill: out of memory for %llu bytes of staging",
				 (unsigned long long)sp->staging_bytes);
			kvr_spill_destroy(sp);
			return -ENOMEM;
		}
		memset(m, 0, sp->staging_bytes);
		sp->staging[b] = m;
	}
#ifdef KVR_HAVE_LIBURING
	if (!(p->flags & KVR_SPILL_SYNC)) {
		ret = io_uring_queue_init(sp->queue_depth, &sp->ring, 0);
		if (ret < 0) {
			spill_log(sp, 1, "spill: io_uring_queue_init: %s; using pread/pwrite", strerror(-ret));
		} else {
			sp->uring = 1;
			struct iovec iov[2] = { { sp->staging[0], sp->staging_bytes },
						{ sp->staging[1], sp->staging_bytes } };
			if (!(p->flags & KVR_SPILL_UNREGISTERED)) {
				ret = io_uring_register_buffers(&sp->ring, iov, 2);
				if (ret == 0) {
					ret = io_uring_register_files(&sp->ring, &sp->fd, 1);
					if (ret == 0)
						sp->registered = 1;
					else
						io_uring_unregister_buffers(&sp->ring);
				}
				if (!sp->registered) /* RLIMIT_MEMLOCK, most often */
					spill_log(sp, 1, "spill: registering staging buffers: %s; unregistered I/O",
						  strerror(-ret));
			}
		}
	}
#endif
	sp->st.run_stride = sp->run_stride;
	sp->st.slot_bytes = sp->slot_bytes;
	sp->st.direct_io = sp->direct;
	sp->st.io_uring = (uint32_t)sp->uring;
	sp->st.registered = (uint32_t)sp->registered;
	sp->st.queue_depth = sp->queue_depth;
	sp->st.dio_align = sp->align;
	sp->st.staging_slots = sp->staging_slots;
	*out = sp;
	return 0;
}

void kvr_spill_destroy(struct kvr_spill *sp)
{
	if (!sp)
		return;
#ifdef KVR_HAVE_LIBURING
	if (sp->uring)
		io_uring_queue_exit(&sp->ring);
#endif
	if (sp->fd >= 0)
		close(sp->fd); /* the file was never linked (or already unlinked): this deletes it */
	free(sp->staging[0]);
	free(sp->staging[1]);
	free(sp->free_stack);
	free(sp->live);
	free(sp->crc);
	free(sp->reqs);
	free(sp->extents);
	pthread_mutex_destroy(&sp->lock);
	free(sp);
}

const char *kvr_spill_last_error(const struct kvr_spill *sp)
{
	return sp ? sp->message : "spill: NULL";
}

void kvr_spill_copy_error(struct kvr_spill *sp, char *buf, size_t bytes)
{
	if (!bytes)
		return;
	if (!sp) {
		snprintf(buf, bytes, "spill: NULL");
		return;
	}
	pthread_mutex_lock(&sp->lock);
	snprintf(buf, bytes, "%s", sp->message);
	pthread_mutex_unlock(&sp->lock);
}

/* ---- writes ---- */

static void pack_page(struct kvr_spill *sp, const unsigned char *page, uint32_t slot, unsigned char *dst)
{
	for (uint32_t r = 0; r < sp->runs_per_page; r++) {
		unsigned char *d = dst + r * sp->run_stride;
		memcpy(d, page + r * sp->run_bytes, sp->run_bytes);
		memset(d + sp->run_bytes, 0, sp->run_stride - sp->run_bytes);
		sp->crc[(uint64_t)slot * sp->runs_per_page + r] = kvr_crc32c(0, d, sp->run_bytes);
	}
}

int kvr_spill_write_pages(struct kvr_spill *sp, const void *const *pages, uint32_t n, uint32_t *slots)
{
	if (!sp || (n && (!pages || !slots)))
		return -EINVAL;
	pthread_mutex_lock(&sp->lock);
	for (uint32_t i = 0; i < n; i++)
		slots[i] = KVR_SPILL_NO_SLOT;
	int err = 0;
	for (uint32_t i = 0; i < n && !err; i++)
		if (!pages[i])
			err = spill_fail(sp, -EINVAL, "spill write: page %u is NULL", i);
	if (!err && n)
		err = reserve_reqs(sp, n) ? spill_fail(sp, -ENOMEM, "spill: out of memory") : 0;
	if (!err && n)
		err = take_slots(sp, n, slots);
	if (err || !n) {
		if (err)
			for (uint32_t i = 0; i < n; i++)
				slots[i] = KVR_SPILL_NO_SLOT;
		pthread_mutex_unlock(&sp->lock);
		return err;
	}
	engine_reset(sp);
	sp->n_reqs = n;
	const uint32_t per = sp->staging_slots;
	const uint32_t n_batches = (n + per - 1) / per;
	for (uint32_t b = 0; b < n_batches && !err; b++) {
		const uint32_t first = b * per, last = first + per < n ? first + per : n;
		if (b >= 2) /* the buffer's previous batch must have left it */
			err = engine_wait(sp, first - per);
		for (uint32_t i = first; i < last && !err; i++) {
			struct io_req *q = &sp->reqs[i];
			*q = (struct io_req){ .offset = (uint64_t)slots[i] * sp->slot_bytes,
					      .len = (uint32_t)sp->slot_bytes,
					      .buffer = b & 1u,
					      .buf_off = (uint64_t)(i - first) * sp->slot_bytes,
					      .slot = slots[i],
					      .write = 1 };
			pack_page(sp, pages[i], slots[i], sp->staging[q->buffer] + q->buf_off);
		}
		if (!err)
			err = engine_push(sp, last);
	}
	if (!err)
		err = engine_wait(sp, n);
	else
		engine_wait(sp, sp->next_submit); /* let what went out come back first */
	for (uint32_t i = 0; i < n && !err; i++)
		if (sp->reqs[i].res != (int32_t)sp->reqs[i].len)
			err = spill_fail(sp, sp->reqs[i].res < 0 ? sp->reqs[i].res : -EIO,
					 "spill write of slot %u (%u bytes at %llu): %s", slots[i],
					 sp->reqs[i].len, (unsigned long long)sp->reqs[i].offset,
					 sp->reqs[i].res < 0 ? strerror(-sp->reqs[i].res) : "short write");
	if (err) {
		for (uint32_t i = 0; i < n; i++) {
			give_back(sp, slots[i]);
			slots[i] = KVR_SPILL_NO_SLOT;
		}
	} else {
		sp->st.pages_written += n;
	}
	pthread_mutex_unlock(&sp->lock);
	return err;
}

/* ---- reads ---- */

static int check_slot(struct kvr_spill *sp, uint32_t slot, uint32_t run)
{
	if (slot >= sp->high || !sp->live[slot])
		return spill_fail(sp, -EINVAL, "spill read: slot %u is not in use", slot);
	if (run >= sp->runs_per_page)
		return spill_fail(sp, -EINVAL, "spill read: run %u of slot %u (a page has %u)", run, slot,
				  sp->runs_per_page);
	return 0;
}

/* Read the extents (already in sp->extents, n_ext of them): run r of extent
 * e goes to dst_of(out + r). Verifies every run's CRC. */
static int read_extents(struct kvr_spill *sp, uint32_t n_ext, unsigned char *const *dsts,
			int32_t *results, uint32_t n_out)
{
	if (results)
		for (uint32_t i = 0; i < n_out; i++)
			results[i] = 0;
	engine_reset(sp);
	if (reserve_reqs(sp, n_ext))
		return spill_fail(sp, -ENOMEM, "spill: out of memory");
	/* Lay the requests out in staging batches: a batch is what fits one buffer. */
	uint32_t n_batches = 0;
	uint32_t *batch_end = NULL; /* request index after each batch */
	{
		uint64_t used = 0;
		uint32_t buffer = 0;
		for (uint32_t e = 0; e < n_ext; e++) {
			const uint64_t len = (uint64_t)sp->extents[e].n * sp->run_stride;
			if (used + len > sp->staging_bytes) {
				used = 0;
				buffer ^= 1u;
				n_batches++;
			}
			sp->reqs[e] = (struct io_req){ .offset = (uint64_t)sp->extents[e].slot * sp->slot_bytes +
								 (uint64_t)sp->extents[e].first * sp->run_stride,
						       .len = (uint32_t)len,
						       .buffer = buffer,
						       .buf_off = used,
						       .slot = sp->extents[e].slot };
			used += len;
		}
		n_batches += n_ext ? 1 : 0;
		batch_end = malloc((n_batches ? n_batches : 1) * sizeof(*batch_end));
		if (!batch_end)
			return spill_fail(sp, -ENOMEM, "spill: out of memory");
		uint32_t b = 0;
		for (uint32_t e = 1; e <= n_ext; e++)
			if (e == n_ext || sp->reqs[e].buffer != sp->reqs[e - 1].buffer)
				batch_end[b++] = e;
	}
	sp->n_reqs = n_ext;
	int err = 0, first_fail = 0;
	uint32_t set_upto = 0; /* outputs [0, set_upto) have their results */
	/* two batches in flight, one per buffer; each one checked and copied
	 * out while the next is read */
	err = engine_push(sp, n_batches > 1 ? batch_end[1] : (n_batches ? batch_end[0] : 0));
	for (uint32_t b = 0; b < n_batches && !err; b++) {
		const uint32_t from = b ? batch_end[b - 1] : 0;
		/* each request is checked and copied out as soon as it (and those
		 * before it) are in, while the rest of the batch and the next one
		 * are still being read */
		for (uint32_t e = from; e < batch_end[b] && !err; e++) {
			err = engine_wait(sp, e + 1);
			if (err)
				break;
			const struct io_req *q = &sp->reqs[e];
			const struct read_extent *x = &sp->extents[e];
			const unsigned char *buf = sp->staging[q->buffer] + q->buf_off;
			for (uint32_t r = 0; r < x->n; r++) {
				int32_t res = 0;
				if (q->res != (int32_t)q->len) {
					res = q->res < 0 ? q->res : -EIO;
					if (!first_fail)
						spill_fail(sp, res, "spill read of slot %u (%u bytes at %llu): %s",
							   x->slot, q->len, (unsigned long long)q->offset,
							   q->res < 0 ? strerror(-q->res) : "short read");
				} else {
					const unsigned char *run = buf + (uint64_t)r * sp->run_stride;
					const uint32_t want = sp->crc[(uint64_t)x->slot * sp->runs_per_page + x->first + r];
					const uint32_t got = kvr_crc32c(0, run, sp->run_bytes);
					if (got != want) {
						res = -EBADMSG;
						sp->st.checksum_errors++;
						if (!first_fail)
							spill_fail(sp, res,
								   "spill read of slot %u run %u: checksum mismatch "
								   "(crc32c %08x, written %08x)",
								   x->slot, x->first + r, got, want);
					} else {
						memcpy(dsts[x->out + r], run, sp->run_bytes);
						sp->st.runs_read++;
					}
				}
				if (res && !first_fail)
					first_fail = res;
				if (results)
					results[x->out + r] = res;
			}
			set_upto = x->out + x->n;
		}
		if (!err && b + 2 < n_batches) /* buffer b & 1 is free again */
			err = engine_push(sp, batch_end[b + 2]);
	}
	if (err && results) /* the ring itself failed: what was not checked is not read */
		for (uint32_t i = set_upto; i < n_out; i++)
			results[i] = err;
	free(batch_end);
	return err ? err : first_fail;
}

/* The end of a read call, under sp->lock: a refusal before any read is
 * every result; the lock released, the destinations array freed. */
static int read_end(struct kvr_spill *sp, int refused, int err, unsigned char **dsts,
		    int32_t *results, uint32_t n)
{
	for (uint32_t i = 0; refused && results && i < n; i++)
		results[i] = refused;
	free(dsts);
	pthread_mutex_unlock(&sp->lock);
	return err;
}

/* Read runs[i] into dsts[i] (or dst + i·dst_stride when dsts is NULL). */
static int read_runs(struct kvr_spill *sp, const struct kvr_spill_run *runs, uint32_t n,
		     void *const *dsts_in, unsigned char *dst, uint64_t dst_stride, int32_t *results)
{
	pthread_mutex_lock(&sp->lock);
	int err = 0;
	for (uint32_t i = 0; i < n && !err; i++) {
		err = check_slot(sp, runs[i].slot, runs[i].run);
		if (!err && dsts_in && !dsts_in[i])
			err = spill_fail(sp, -EINVAL, "spill read: destination %u is NULL", i);
	}
	if (!err && n && !dsts_in && dst_stride < sp->run_bytes)
		err = spill_fail(sp, -EINVAL, "spill read: dst_stride %llu < run_bytes %llu",
				 (unsigned long long)dst_stride, (unsigned long long)sp->run_bytes);
	unsigned char **dsts = NULL;
	if (!err && n) {
		dsts = malloc((size_t)n * sizeof(*dsts));
		if (!dsts || reserve_extents(sp, n))
			err = spill_fail(sp, -ENOMEM, "spill: out of memory");
	}
	const int refused = err; /* before any read */
	if (!err && n) {
		for (uint32_t i = 0; i < n; i++) {
			sp->extents[i] = (struct read_extent){ runs[i].slot, runs[i].run, 1, i };
			dsts[i] = dsts_in ? (unsigned char *)dsts_in[i] : dst + (uint64_t)i * dst_stride;
		}
		err = read_extents(sp, n, dsts, results, n);
	}
	return read_end(sp, refused, err, dsts, results, n);
}

int kvr_spill_read_runs(struct kvr_spill *sp, const struct kvr_spill_run *runs, uint32_t n, void *dst,
			uint64_t dst_stride, int32_t *results)
{
	if (!sp || (n && (!runs || !dst)))
		return -EINVAL;
	return read_runs(sp, runs, n, NULL, dst, dst_stride, results);
}

int kvr_spill_read_runs_to(struct kvr_spill *sp, const struct kvr_spill_run *runs, uint32_t n,
			   void *const *dsts, int32_t *results)
{
	if (!sp || (n && (!runs || !dsts)))
		return -EINVAL;
	return read_runs(sp, runs, n, dsts, NULL, 0, results);
}

int kvr_spill_read_pages(struct kvr_spill *sp, const uint32_t *slots, uint32_t n, void *const *pages,
			 int32_t *results)
{
	if (!sp || (n && (!slots || !pages)))
		return -EINVAL;
	pthread_mutex_lock(&sp->lock);
	int err = 0;
	const uint32_t rpp = sp->runs_per_page;
	for (uint32_t i = 0; i < n && !err; i++) {
		err = check_slot(sp, slots[i], 0);
		if (!err && !pages[i])
			err = spill_fail(sp, -EINVAL, "spill read: page %u is NULL", i);
	}
	unsigned char **dsts = NULL;
	if (!err && n) {
		dsts = malloc((size_t)n * rpp * sizeof(*dsts));
		if (!dsts || reserve_extents(sp, n))
			err = spill_fail(sp, -ENOMEM, "spill: out of memory");
	}
	const int refused = err; /* before any read */
	if (!err && n) {
		for (uint32_t i = 0; i < n; i++) {
			sp->extents[i] = (struct read_extent){ slots[i], 0, rpp, i * rpp };
			for (uint32_t r = 0; r < rpp; r++)
				dsts[(uint64_t)i * rpp + r] = (unsigned char *)pages[i] + (uint64_t)r * sp->run_bytes;
		}
		int32_t *run_res = results ? malloc((size_t)n * rpp * sizeof(*run_res)) : NULL;
		if (results && !run_res) {
			err = spill_fail(sp, -ENOMEM, "spill: out of memory");
		} else {
			err = read_extents(sp, n, dsts, run_res, n * rpp);
			for (uint32_t i = 0; results && i < n; i++) {
				results[i] = 0;
				for (uint32_t r = 0; r < rpp && !results[i]; r++)
					results[i] = run_res[(uint64_t)i * rpp + r];
			}
		}
		free(run_res);
	}
	return read_end(sp, refused, err, dsts, results, n);
}

int kvr_spill_free(struct kvr_spill *sp, uint32_t slot)
{
	if (!sp)
		return -EINVAL;
	pthread_mutex_lock(&sp->lock);
	int err = slot < sp->high && sp->live[slot]
			  ? 0
			  : spill_fail(sp, -EINVAL, "spill free: slot %u is not in use", slot);
	if (!err)
		give_back(sp, slot);
	pthread_mutex_unlock(&sp->lock);
	return err;
}

void kvr_spill_get_stats(struct kvr_spill *sp, struct kvr_spill_stats *out)
{
	if (!sp) {
		memset(out, 0, sizeof(*out));
		return;
	}
	pthread_mutex_lock(&sp->lock);
	*out = sp->st;
	pthread_mutex_unlock(&sp->lock);
}

void kvr_spill_inject(struct kvr_spill *sp, const struct kvr_spill_fault *fault)
{
	pthread_mutex_lock(&sp->lock);
	sp->fault = *fault;
	sp->fault_applied = 0;
	pthread_mutex_unlock(&sp->lock);
}

int kvr_spill_fd(const struct kvr_spill *sp)
{
	return sp->fd;
}

uint64_t kvr_spill_slot_offset(const struct kvr_spill *sp, uint32_t slot)
{
	return (uint64_t)slot * sp->slot_bytes;
}
