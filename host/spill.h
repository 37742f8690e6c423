/* SPDX-License-Identifier: MIT */
/*
 * spill.h — the spill tier's file: where pages go when the pool's RAM budget
 * is exceeded, and how they come back.
 *
 * One file per pool, in a directory the caller names, opened O_DIRECT when the
 * file system allows it and unlinked from the start (O_TMPFILE, else mkstemp
 * then unlink), so it disappears on destroy and on a crash: the file is a
 * cache, not a store. It is cut into slots of one page each. A page keeps its
 * HND shape there — one run per KV head — with each run padded to the file's
 * direct-I/O alignment, so a recall reads only the runs its heads selected
 * rather than whole pages. Slots come from a LIFO stack of freed slots over a
 * high-water mark (O(1) both ways), and the file is extended by fallocate in
 * extents ahead of the high-water mark, so a full disk shows up as -ENOSPC
 * when a slot is taken, not as a failed write later.
 *
 * Integrity, not durability: every run gets a CRC32C when it is written,
 * kept in RAM, checked when it is read. A mismatch fails that run with
 * -EBADMSG, an I/O error or a short transfer with -EIO; the other runs of
 * the call and every other slot are untouched.
 *
 * I/O goes through io_uring (liburing): two staging buffers registered with
 * the ring (fixed-buffer reads and writes), up to queue_depth I/Os in flight,
 * submitted in batches, and double-buffered — while one staging buffer's
 * reads are in flight the other's runs are checked and copied out. Without
 * io_uring (not compiled in, refused by the kernel or a seccomp filter, or
 * KVR_SPILL_SYNC) the same calls use pread/pwrite one I/O at a time and the
 * stats say so; without O_DIRECT (tmpfs on old kernels, KVR_SPILL_BUFFERED)
 * the file goes through the page cache and the stats say that too.
 *
 * Threads: every call takes the spill's mutex (a ring has one issuer at a
 * time), so the engine's thread may spill pages while the controller
 * recalls others. Callers own the memory they pass for the duration of the
 * call; nothing is kept after a call returns.
 */
#ifndef KVR_HOST_SPILL_H
#define KVR_HOST_SPILL_H

#include <stddef.h>
#include <stdint.h>

#include "../layouts/base/log.h"

#define KVR_SPILL_NO_SLOT UINT32_MAX
#define KVR_SPILL_DEFAULT_QUEUE_DEPTH 32u
#define KVR_SPILL_DEFAULT_STAGING_BYTES (4ull << 20)

enum kvr_spill_flags {
	KVR_SPILL_BUFFERED = 1u << 0,       /* no O_DIRECT: through the page cache */
	KVR_SPILL_SYNC = 1u << 1,           /* pread/pwrite, even when io_uring works */
	KVR_SPILL_REQUIRE_DIRECT = 1u << 2, /* fail create when O_DIRECT is refused */
	KVR_SPILL_UNREGISTERED = 1u << 3,   /* io_uring without registered buffers */
};

typedef kvr_host_log_fn kvr_spill_log_fn;

struct kvr_spill_params {
	const char *dir;        /* directory for the file; NULL or "": kvr_spill_default_dir() */
	uint64_t run_bytes;     /* bytes of one KV head's run of a page, > 0 */
	uint32_t runs_per_page; /* KV heads per page, > 0 */
	uint32_t queue_depth;   /* I/Os in flight, 1..4096; 0 = KVR_SPILL_DEFAULT_QUEUE_DEPTH */
	uint64_t staging_bytes; /* each of the two staging buffers; 0 = default; at least a slot */
	uint64_t max_bytes;     /* file size limit (whole slots); 0 = what the file system holds */
	uint32_t flags;         /* enum kvr_spill_flags */
	kvr_spill_log_fn log_fn; /* warnings (fallbacks); NULL = silent */
	void *log_user;
};

struct kvr_spill_stats {
	uint64_t run_stride;      /* bytes of a run in the file (run_bytes, aligned) */
	uint64_t slot_bytes;      /* runs_per_page · run_stride */
	uint64_t slots_used;      /* slots holding a page now */
	uint64_t slots_high;      /* high-water mark: slots ever handed out */
	uint64_t file_bytes;      /* bytes the file has been extended to */
	uint64_t pages_written;   /* pages spilled */
	uint64_t runs_read;       /* runs read back and verified */
	uint64_t bytes_written;   /* bytes of I/O, padding included */
	uint64_t bytes_read;
	uint64_t io_errors;       /* reads or writes that failed or came back short */
	uint64_t checksum_errors; /* runs whose CRC32C did not match */
	uint32_t direct_io;       /* 1: O_DIRECT */
	uint32_t io_uring;        /* 1: io_uring, 0: pread/pwrite */
	uint32_t registered;      /* 1: staging buffers registered with the ring */
	uint32_t queue_depth;
	uint32_t dio_align;       /* alignment of offsets, lengths and buffers */
	uint32_t staging_slots;   /* slots per staging buffer */
};

/* One run to read: KV head `run` of the page in `slot`. */
struct kvr_spill_run {
	uint32_t slot;
	uint32_t run;
};

struct kvr_spill;

/* Where the spill file goes when no directory is named: $TMPDIR if set and
 * not empty, else /var/tmp (disk-backed on most systems, unlike /tmp). */
const char *kvr_spill_default_dir(void);

/* What a directory offers the spill tier: whether a file there opens with
 * O_DIRECT (1/0), its direct-I/O alignment (statx's, else 4096), its file
 * system's type name and the bytes free. Returns 0, or a negative errno with
 * the reason (a missing or unwritable directory) in `reason`; with direct_io
 * 0 `reason` says why. */
int kvr_spill_probe_dir(const char *dir, uint32_t *direct_io, uint32_t *dio_align,
			char *fs_type, size_t fs_type_bytes, uint64_t *free_bytes, char *reason,
			size_t reason_bytes);

/* Create the spill file. Returns 0, -EINVAL (bad params, message in err),
 * -ENOENT/-EACCES (directory), -EOPNOTSUPP (O_DIRECT refused under
 * KVR_SPILL_REQUIRE_DIRECT), -ENOMEM. */
int kvr_spill_create(const struct kvr_spill_params *params, struct kvr_spill **out, char *err,
		     size_t err_bytes);
/* Close (and so delete) the file; free everything. NULL is a no-op. */
void kvr_spill_destroy(struct kvr_spill *sp);

/* The message of the spill's most recent failed call ("" if none). The
 * buffer is the spill's: another thread's failing call may rewrite it. */
const char *kvr_spill_last_error(const struct kvr_spill *sp);
/* The same message copied into buf under the spill's lock: what a caller
 * sharing the spill with other threads uses. */
void kvr_spill_copy_error(struct kvr_spill *sp, char *buf, size_t bytes);

/* Spill n pages: page i's runs (run h at pages[i] + h·run_bytes) go to a new
 * slot, returned in slots[i]. All or nothing: when a slot cannot be had
 * (-ENOSPC: max_bytes reached or the disk is full) or a write fails (-EIO),
 * every slot this call took is freed, slots[] are all KVR_SPILL_NO_SLOT, and
 * the pages stay the caller's to keep in RAM. */
int kvr_spill_write_pages(struct kvr_spill *sp, const void *const *pages, uint32_t n,
			  uint32_t *slots);

/* Read n runs: runs[i] into dst + i·dst_stride (run_bytes each; dst needs
 * no alignment). results[i] (may be NULL) gets 0, -EIO or -EBADMSG for each;
 * a run that failed leaves its dst bytes unspecified, the others are valid.
 * Returns 0 when every run was read and verified, else the first failure's
 * error with a message naming its slot; -EINVAL (nothing read) for a free or
 * unknown slot or a run past runs_per_page. */
int kvr_spill_read_runs(struct kvr_spill *sp, const struct kvr_spill_run *runs, uint32_t n,
			void *dst, uint64_t dst_stride, int32_t *results);

/* As kvr_spill_read_runs, run i going to dsts[i] (-EINVAL for a NULL one). */
int kvr_spill_read_runs_to(struct kvr_spill *sp, const struct kvr_spill_run *runs, uint32_t n,
			   void *const *dsts, int32_t *results);

/* Read n whole pages back: slot slots[i] into pages[i] (runs_per_page runs at
 * run_bytes stride), one I/O per page. Results and errors as
 * kvr_spill_read_runs. The slots stay allocated. */
int kvr_spill_read_pages(struct kvr_spill *sp, const uint32_t *slots, uint32_t n,
			 void *const *pages, int32_t *results);

/* Give a slot back. -EINVAL for a free or unknown slot (a double free is
 * caught, not obeyed). */
int kvr_spill_free(struct kvr_spill *sp, uint32_t slot);

void kvr_spill_get_stats(struct kvr_spill *sp, struct kvr_spill_stats *out);

/* ---- tests and benchmarks ---- */

/* Fault injection: the next matching I/Os complete as if the device had
 * done it. A fault matches reads or writes (by kind) of `slot`
 * (KVR_SPILL_NO_SLOT: any), after `skip` matching I/Os have gone through, for
 * `count` I/Os (0: until cleared). KVR_SPILL_FAULT_NONE clears. */
enum kvr_spill_fault_kind {
	KVR_SPILL_FAULT_NONE = 0,
	KVR_SPILL_FAULT_READ_EIO,     /* the read fails with -EIO */
	KVR_SPILL_FAULT_READ_SHORT,   /* the read returns half its bytes */
	KVR_SPILL_FAULT_READ_CORRUPT, /* the read succeeds; one bit of its data flips */
	KVR_SPILL_FAULT_WRITE_EIO,    /* the write fails with -EIO */
	KVR_SPILL_FAULT_WRITE_SHORT,  /* the write stores half its bytes */
	KVR_SPILL_FAULT_NOSPC,        /* taking a slot fails with -ENOSPC (disk full) */
};
struct kvr_spill_fault {
	uint32_t kind; /* enum kvr_spill_fault_kind */
	uint32_t slot;
	uint32_t skip;
	uint32_t count;
};
void kvr_spill_inject(struct kvr_spill *sp, const struct kvr_spill_fault *fault);

/* The file's descriptor (tests corrupt it behind the spill's back) and a
 * slot's byte offset in it. */
int kvr_spill_fd(const struct kvr_spill *sp);
uint64_t kvr_spill_slot_offset(const struct kvr_spill *sp, uint32_t slot);

#endif /* KVR_HOST_SPILL_H */
