/* SPDX-License-Identifier: MIT */
/*
 * test_spill.c — the spill tier's file (host/spill.h) and its checksum
 * (host/crc32c.h). CRC32C against published vectors and a bitwise reference,
 * hardware and table versions held to each other. Long random sequences of
 * batch writes, frees and run / page reads over several shapes (aligned and
 * unaligned runs, one to eight runs a page, io_uring with and without
 * registered buffers, pread/pwrite, O_DIRECT and the page cache, queue depths
 * 1 to 32, staging buffers of a few slots so every call crosses many staging
 * batches), each call checked against a shadow model: every byte read back is
 * the byte written, bytes around the destinations are untouched, slots come
 * from the LIFO of freed slots over the high-water mark, and the stats count
 * exactly what was done. Bad parameters and bad calls are refused with
 * nothing changed; injected faults (I/O errors, short transfers, flipped bits,
 * a full disk) fail exactly the runs or the batch they hit and nothing else;
 * bytes flipped in the file behind the spill's back are caught by the CRC;
 * max_bytes is a hard, all-or-nothing limit; two threads share one spill.
 * Every test works in a fresh directory and removes it empty at the end,
 * which proves the spill file leaves nothing behind.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "crc32c.h"
#include "spill.h"
#include "helpers.h"

#ifndef KVR_TEST_HAVE_LIBURING
#define KVR_TEST_HAVE_LIBURING 0
#endif

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static uint32_t rnd(uint32_t n)
{
	return (uint32_t)((th_xorshift64(&rng_state) >> 33) % n);
}

static void fill_random(unsigned char *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (unsigned char)rnd(256);
}

/* The byte a destination buffer holds where no read may write. */
static unsigned char sentinel(size_t i)
{
	return (unsigned char)(0xa5u ^ (i * 131u));
}

static void fill_sentinel(unsigned char *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		p[i] = sentinel(i);
}

/* ------------------------------------------------------------------ directories */

TestSuite(spill, .fini = th_test_dir_fini);

static void dir_make(char *path, size_t bytes)
{
	th_dir_make(path, bytes, kvr_spill_default_dir(), "kvr-test-spill-");
}

/* ------------------------------------------------------------------ creating */

static struct kvr_spill_params params_of(const char *dir, uint64_t run_bytes, uint32_t runs_per_page,
					 uint32_t queue_depth, uint64_t staging_bytes, uint64_t max_bytes,
					 uint32_t flags)
{
	return (struct kvr_spill_params){ .dir = dir,
					  .run_bytes = run_bytes,
					  .runs_per_page = runs_per_page,
					  .queue_depth = queue_depth,
					  .staging_bytes = staging_bytes,
					  .max_bytes = max_bytes,
					  .flags = flags };
}

/* The stats a fresh spill must show for its parameters. */
static void check_shape(struct kvr_spill *sp, const struct kvr_spill_params *p)
{
	struct kvr_spill_stats st;
	kvr_spill_get_stats(sp, &st);
	cr_assert_geq(st.dio_align, 512u, "dio_align %u", st.dio_align);
	cr_assert_eq(st.dio_align & (st.dio_align - 1), 0u, "dio_align %u is not a power of two", st.dio_align);
	cr_assert_eq(st.run_stride % st.dio_align, 0, "run_stride %llu, dio_align %u",
		     (unsigned long long)st.run_stride, st.dio_align);
	cr_assert_geq(st.run_stride, p->run_bytes);
	cr_assert_lt(st.run_stride, p->run_bytes + st.dio_align, "run_stride %llu: more than one alignment of padding",
		     (unsigned long long)st.run_stride);
	cr_assert_eq(st.slot_bytes, (uint64_t)p->runs_per_page * st.run_stride);
	cr_assert_eq(st.queue_depth, p->queue_depth ? p->queue_depth : KVR_SPILL_DEFAULT_QUEUE_DEPTH);
	cr_assert_geq(st.staging_slots, 1u);
	const uint64_t staging = p->staging_bytes ? p->staging_bytes : KVR_SPILL_DEFAULT_STAGING_BYTES;
	if (staging >= st.slot_bytes)
		cr_assert_eq(st.staging_slots, staging / st.slot_bytes, "staging_slots %u for %llu bytes",
			     st.staging_slots, (unsigned long long)staging);
	cr_assert_eq(st.slots_used, 0);
	cr_assert_eq(st.slots_high, 0);
	cr_assert_eq(st.pages_written + st.runs_read + st.io_errors + st.checksum_errors, 0);
	if (p->flags & KVR_SPILL_SYNC || !KVR_TEST_HAVE_LIBURING)
		cr_assert_eq(st.io_uring, 0, "io_uring under KVR_SPILL_SYNC (or without liburing)");
	if (p->flags & KVR_SPILL_BUFFERED)
		cr_assert_eq(st.direct_io, 0, "O_DIRECT under KVR_SPILL_BUFFERED");
	if (p->flags & KVR_SPILL_REQUIRE_DIRECT)
		cr_assert_eq(st.direct_io, 1);
	if (p->flags & KVR_SPILL_UNREGISTERED || !st.io_uring)
		cr_assert_eq(st.registered, 0, "registered buffers without a ring or under UNREGISTERED");
	cr_assert_str_empty(kvr_spill_last_error(sp), "a fresh spill has a last error: %s", kvr_spill_last_error(sp));
}

static struct kvr_spill *create_ok(const struct kvr_spill_params *p)
{
	struct kvr_spill *sp = NULL;
	char err[256] = "";
	const int rc = kvr_spill_create(p, &sp, err, sizeof(err));
	cr_assert_eq(rc, 0, "kvr_spill_create (run_bytes %llu, %u runs, flags %#x): %d %s",
		     (unsigned long long)p->run_bytes, p->runs_per_page, p->flags, rc, err);
	cr_assert_not_null(sp);
	check_shape(sp, p);
	return sp;
}

/* A spill whose staging buffers hold exactly `slots` slots (the slot size
 * depends on the file's alignment, so a first spill tells it). */
static struct kvr_spill *create_staged(struct kvr_spill_params *p, uint32_t slots)
{
	p->staging_bytes = 0;
	struct kvr_spill *sp = create_ok(p);
	struct kvr_spill_stats st;
	kvr_spill_get_stats(sp, &st);
	kvr_spill_destroy(sp);
	p->staging_bytes = st.slot_bytes * slots;
	sp = create_ok(p);
	kvr_spill_get_stats(sp, &st);
	cr_assert_eq(st.staging_slots, slots);
	return sp;
}

/* ------------------------------------------------------------------ the shadow model */

#define SH_CAP 4096u /* slot ids the model tracks */

struct shadow {
	struct kvr_spill *sp;
	uint64_t run_bytes, page_bytes, run_stride, slot_bytes;
	uint32_t rpp;
	unsigned char *page[SH_CAP]; /* [slot]: its bytes while it holds a page, else NULL */
	uint32_t live[SH_CAP];       /* live slots, any order */
	uint32_t n_live;
	uint32_t stack[SH_CAP]; /* the freed slots, LIFO */
	uint32_t n_stack;
	uint32_t high;
	int exact; /* 0 once a failed write gave slots back in an order the header leaves open */
	uint64_t pages_written, runs_read, runs_read_bytes;
	unsigned char *scratch; /* source pages, at odd offsets */
};

static struct shadow *sh_new(struct kvr_spill *sp, uint64_t run_bytes, uint32_t rpp)
{
	struct shadow *sh = calloc(1, sizeof(*sh));
	cr_assert_not_null(sh);
	struct kvr_spill_stats st;
	kvr_spill_get_stats(sp, &st);
	sh->sp = sp;
	sh->run_bytes = run_bytes;
	sh->rpp = rpp;
	sh->page_bytes = run_bytes * rpp;
	sh->run_stride = st.run_stride;
	sh->slot_bytes = st.slot_bytes;
	sh->exact = 1;
	sh->scratch = malloc(64 * (sh->page_bytes + 16));
	cr_assert_not_null(sh->scratch);
	return sh;
}

static void sh_delete(struct shadow *sh)
{
	for (uint32_t s = 0; s < SH_CAP; s++)
		free(sh->page[s]);
	free(sh->scratch);
	free(sh);
}

/* Everything the stats say, against the model. */
static void sh_check_stats(const struct shadow *sh, const char *when)
{
	struct kvr_spill_stats st;
	kvr_spill_get_stats(sh->sp, &st);
	cr_assert_eq(st.slots_used, sh->n_live, "%s: slots_used %llu, model %u", when,
		     (unsigned long long)st.slots_used, sh->n_live);
	if (sh->exact)
		cr_assert_eq(st.slots_high, sh->high, "%s: slots_high %llu, model %u", when,
			     (unsigned long long)st.slots_high, sh->high);
	else
		cr_assert_geq(st.slots_high, sh->high, "%s", when);
	cr_assert_eq(st.pages_written, sh->pages_written, "%s: pages_written %llu, model %llu", when,
		     (unsigned long long)st.pages_written, (unsigned long long)sh->pages_written);
	cr_assert_eq(st.runs_read, sh->runs_read, "%s: runs_read %llu, model %llu", when,
		     (unsigned long long)st.runs_read, (unsigned long long)sh->runs_read);
	struct stat fst;
	cr_assert_eq(fstat(kvr_spill_fd(sh->sp), &fst), 0);
	cr_assert_geq((uint64_t)fst.st_size, (uint64_t)sh->high * sh->slot_bytes,
		      "%s: the file (%lld bytes) does not hold %u slots", when, (long long)fst.st_size, sh->high);
	if (st.file_bytes) /* 0 only where fallocate is unsupported */
		cr_assert_eq(st.file_bytes, (uint64_t)fst.st_size, "%s: file_bytes %llu, file %lld", when,
			     (unsigned long long)st.file_bytes, (long long)fst.st_size);
}

/* As sh_check_stats, for a model that has seen no failure: the byte counts
 * are exact and no error was counted. */
static void sh_check_stats_clean(const struct shadow *sh, const char *when)
{
	sh_check_stats(sh, when);
	struct kvr_spill_stats st;
	kvr_spill_get_stats(sh->sp, &st);
	cr_assert_eq(st.io_errors, 0, "%s: %llu io_errors", when, (unsigned long long)st.io_errors);
	cr_assert_eq(st.checksum_errors, 0, "%s: %llu checksum_errors", when,
		     (unsigned long long)st.checksum_errors);
	cr_assert_eq(st.bytes_written, sh->pages_written * sh->slot_bytes, "%s: bytes_written %llu", when,
		     (unsigned long long)st.bytes_written);
	cr_assert_eq(st.bytes_read, sh->runs_read_bytes, "%s: bytes_read %llu, model %llu", when,
		     (unsigned long long)st.bytes_read, (unsigned long long)sh->runs_read_bytes);
}

/* n random pages at odd addresses in sh->scratch. */
static void sh_make_pages(struct shadow *sh, uint32_t n, const void **pages)
{
	cr_assert_leq(n, 64u);
	for (uint32_t i = 0; i < n; i++) {
		unsigned char *p = sh->scratch + i * (sh->page_bytes + 16) + 1 + rnd(15);
		fill_random(p, sh->page_bytes);
		pages[i] = p;
	}
}

/* Record page i of a successful write in slot s. */
static void sh_store(struct shadow *sh, uint32_t s, const void *page, const char *when)
{
	cr_assert_lt(s, SH_CAP, "%s: slot %u", when, s);
	cr_assert_null(sh->page[s], "%s: slot %u handed out while it holds a page", when, s);
	sh->page[s] = malloc(sh->page_bytes);
	cr_assert_not_null(sh->page[s]);
	memcpy(sh->page[s], page, sh->page_bytes);
	sh->live[sh->n_live++] = s;
	if (s >= sh->high)
		sh->high = s + 1;
}

/* Write n random pages; the slots must be the model's: the freed ones, most
 * recent first, then fresh ones above the high-water mark. */
static void sh_write(struct shadow *sh, uint32_t n, const char *when)
{
	const void *pages[64];
	uint32_t slots[64], want[64];
	sh_make_pages(sh, n, pages);
	uint32_t from_stack = n < sh->n_stack ? n : sh->n_stack;
	for (uint32_t i = 0; i < n; i++) {
		want[i] = i < from_stack ? sh->stack[sh->n_stack - 1 - i] : sh->high + (i - from_stack);
		slots[i] = 0xdeadbeefu;
	}
	const int rc = kvr_spill_write_pages(sh->sp, pages, n, slots);
	cr_assert_eq(rc, 0, "%s: write of %u pages: %d %s", when, n, rc, kvr_spill_last_error(sh->sp));
	if (sh->exact) {
		for (uint32_t i = 0; i < n; i++)
			cr_assert_eq(slots[i], want[i], "%s: page %u of %u went to slot %u, not %u (LIFO of freed slots, then "
				     "the high-water mark)", when, i, n, slots[i], want[i]);
		sh->n_stack -= from_stack;
	} else {
		for (uint32_t i = 0; i < n; i++)
			for (uint32_t k = 0; k < sh->n_stack; k++)
				if (sh->stack[k] == slots[i]) {
					sh->stack[k] = sh->stack[--sh->n_stack];
					break;
				}
	}
	for (uint32_t i = 0; i < n; i++)
		sh_store(sh, slots[i], pages[i], when);
	sh->pages_written += n;
}

/* Free the live slot at index k of sh->live. */
static void sh_free_at(struct shadow *sh, uint32_t k, const char *when)
{
	const uint32_t s = sh->live[k];
	const int rc = kvr_spill_free(sh->sp, s);
	cr_assert_eq(rc, 0, "%s: free of slot %u: %d %s", when, s, rc, kvr_spill_last_error(sh->sp));
	free(sh->page[s]);
	sh->page[s] = NULL;
	sh->live[k] = sh->live[--sh->n_live];
	sh->stack[sh->n_stack++] = s;
}

/* Read the given runs at a dst_stride past run_bytes, into an unaligned
 * buffer: each run equals the model, the gaps and the tail keep their
 * sentinels, results are all 0. */
static void sh_read_runs_of(struct shadow *sh, const struct kvr_spill_run *runs, uint32_t n, const char *when)
{
	const uint64_t stride = sh->run_bytes + 1 + rnd(64);
	const uint32_t skew = rnd(8);
	const size_t bytes = skew + (size_t)n * stride + 64;
	unsigned char *buf = malloc(bytes);
	int32_t *results = malloc((n ? n : 1) * sizeof(int32_t));
	cr_assert(buf && results);
	fill_sentinel(buf, bytes);
	for (uint32_t i = 0; i < n; i++)
		results[i] = 12345;
	const int rc = kvr_spill_read_runs(sh->sp, runs, n, buf + skew, stride, results);
	cr_assert_eq(rc, 0, "%s: read of %u runs: %d %s", when, n, rc, kvr_spill_last_error(sh->sp));
	for (uint32_t i = 0; i < n; i++) {
		cr_assert_eq(results[i], 0, "%s: results[%u] = %d", when, i, results[i]);
		const unsigned char *want = sh->page[runs[i].slot] + runs[i].run * sh->run_bytes;
		cr_assert(!memcmp(buf + skew + i * stride, want, sh->run_bytes), "%s: run %u (slot %u run %u) differs",
			  when, i, runs[i].slot, runs[i].run);
	}
	for (size_t b = 0; b < bytes; b++) {
		const int64_t at = (int64_t)b - skew;
		if (at >= 0 && (uint64_t)at < (uint64_t)n * stride && (uint64_t)at % stride < sh->run_bytes)
			continue;
		cr_assert_eq(buf[b], sentinel(b), "%s: byte %zu of the destination (outside every run) was written",
			     when, b);
	}
	sh->runs_read += n;
	sh->runs_read_bytes += (uint64_t)n * sh->run_stride;
	free(results);
	free(buf);
}

/* Read n random runs of live slots (repeats allowed). */
static void sh_read_runs(struct shadow *sh, uint32_t n, const char *when)
{
	if (!sh->n_live)
		return;
	struct kvr_spill_run *runs = malloc(n * sizeof(*runs));
	cr_assert_not_null(runs);
	for (uint32_t i = 0; i < n; i++)
		runs[i] = (struct kvr_spill_run){ sh->live[rnd(sh->n_live)], rnd(sh->rpp) };
	sh_read_runs_of(sh, runs, n, when);
	free(runs);
}

/* Read the given slots as whole pages into separate unaligned buffers with
 * guard bytes either side. */
static void sh_read_pages_of(struct shadow *sh, const uint32_t *slots, uint32_t n, const char *when)
{
	const size_t span = sh->page_bytes + 64;
	unsigned char *buf = malloc((size_t)n * span + 8);
	void **pages = malloc((n ? n : 1) * sizeof(void *));
	int32_t *results = malloc((n ? n : 1) * sizeof(int32_t));
	cr_assert(buf && pages && results);
	fill_sentinel(buf, (size_t)n * span + 8);
	for (uint32_t i = 0; i < n; i++) {
		pages[i] = buf + i * span + 32 + (i % 7);
		results[i] = 12345;
	}
	const int rc = kvr_spill_read_pages(sh->sp, slots, n, pages, results);
	cr_assert_eq(rc, 0, "%s: read of %u pages: %d %s", when, n, rc, kvr_spill_last_error(sh->sp));
	for (uint32_t i = 0; i < n; i++) {
		cr_assert_eq(results[i], 0, "%s: results[%u] = %d", when, i, results[i]);
		cr_assert(!memcmp(pages[i], sh->page[slots[i]], sh->page_bytes), "%s: page %u (slot %u) differs", when,
			  i, slots[i]);
	}
	for (size_t b = 0; b < (size_t)n * span + 8; b++) {
		const size_t i = b / span, at = b % span;
		if (i < n && at >= 32 + (i % 7) && at < 32 + (i % 7) + sh->page_bytes)
			continue;
		cr_assert_eq(buf[b], sentinel(b), "%s: byte %zu outside every page was written", when, b);
	}
	sh->runs_read += (uint64_t)n * sh->rpp;
	sh->runs_read_bytes += (uint64_t)n * sh->slot_bytes;
	free(results);
	free(pages);
	free(buf);
}

static void sh_read_pages(struct shadow *sh, uint32_t n, const char *when)
{
	if (!sh->n_live)
		return;
	uint32_t *slots = malloc(n * sizeof(uint32_t));
	cr_assert_not_null(slots);
	for (uint32_t i = 0; i < n; i++)
		slots[i] = sh->live[rnd(sh->n_live)];
	sh_read_pages_of(sh, slots, n, when);
	free(slots);
}

/* Every live page, read back whole. */
static void sh_verify_all(struct shadow *sh, const char *when)
{
	for (uint32_t k = 0; k < sh->n_live; k += 32) {
		const uint32_t n = sh->n_live - k < 32 ? sh->n_live - k : 32;
		sh_read_pages_of(sh, sh->live + k, n, when);
	}
}

/* ------------------------------------------------------------------ crc32c */

static uint32_t crc32c_bitwise(uint32_t crc, const unsigned char *p, size_t n)
{
	crc = ~crc;
	while (n--) {
		crc ^= *p++;
		for (int k = 0; k < 8; k++)
			crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1u)));
	}
	return ~crc;
}

Test(spill, crc32c)
{
	cr_assert_eq(kvr_crc32c(0, "123456789", 9), 0xe3069283u);
	cr_assert_eq(kvr_crc32c_portable(0, "123456789", 9), 0xe3069283u);
	cr_assert_eq(kvr_crc32c(0, "", 0), 0u);
	cr_assert_eq(kvr_crc32c_portable(0, "", 0), 0u);
	/* RFC 3720 (iSCSI) B.4 */
	unsigned char v[32];
	const struct {
		int pattern;
		uint32_t crc;
	} rfc[] = { { 0, 0x8a9136aau }, { 1, 0x62a8ab43u }, { 2, 0x46dd794eu }, { 3, 0x113fdb5cu } };
	for (size_t t = 0; t < sizeof(rfc) / sizeof(rfc[0]); t++) {
		for (int i = 0; i < 32; i++)
			v[i] = (unsigned char)(rfc[t].pattern == 0 ? 0 : rfc[t].pattern == 1 ? 0xff : rfc[t].pattern == 2 ? i : 31 - i);
		cr_assert_eq(kvr_crc32c(0, v, 32), rfc[t].crc, "vector %zu: %08x", t, kvr_crc32c(0, v, 32));
		cr_assert_eq(kvr_crc32c_portable(0, v, 32), rfc[t].crc, "vector %zu", t);
	}
	static unsigned char buf[70000];
	fill_random(buf, sizeof(buf));
	for (size_t len = 0; len <= 300; len++)
		for (size_t off = 0; off < 8; off++) {
			const uint32_t seed = len % 3 ? (uint32_t)len * 0x9e3779b9u : 0;
			const uint32_t want = crc32c_bitwise(seed, buf + off, len);
			cr_assert_eq(kvr_crc32c(seed, buf + off, len), want, "len %zu off %zu", len, off);
			cr_assert_eq(kvr_crc32c_portable(seed, buf + off, len), want, "len %zu off %zu", len, off);
		}
	const uint32_t whole = crc32c_bitwise(0, buf, sizeof(buf));
	cr_assert_eq(kvr_crc32c(0, buf, sizeof(buf)), whole);
	cr_assert_eq(kvr_crc32c_portable(0, buf, sizeof(buf)), whole);
	/* continuing: the CRC of a then b is the CRC of a||b */
	for (int t = 0; t < 200; t++) {
		const size_t n = 1 + rnd(2000), split = rnd((uint32_t)n + 1), off = rnd(8);
		const uint32_t ab = kvr_crc32c(0, buf + off, n);
		cr_assert_eq(kvr_crc32c(kvr_crc32c(0, buf + off, split), buf + off + split, n - split), ab,
			     "n %zu split %zu", n, split);
		cr_assert_eq(kvr_crc32c_portable(kvr_crc32c_portable(0, buf + off, split), buf + off + split, n - split),
			     ab, "n %zu split %zu", n, split);
	}
	/* a flipped bit anywhere changes it */
	for (int t = 0; t < 100; t++) {
		const size_t n = 1 + rnd(4096), at = rnd((uint32_t)n);
		const uint32_t before = kvr_crc32c(0, buf, n);
		buf[at] ^= (unsigned char)(1u << rnd(8));
		cr_assert_neq(kvr_crc32c(0, buf, n), before);
		cr_assert_eq(kvr_crc32c(0, buf, n), crc32c_bitwise(0, buf, n));
	}
}

/* ------------------------------------------------------------------ round trips */

struct shape {
	uint64_t run_bytes;
	uint32_t rpp, flags, queue_depth, staging_slots; /* staging_slots 0: the default staging */
};

static const char *flag_names(uint32_t flags, char *out, size_t n)
{
	snprintf(out, n, "%s%s%s%s%s", flags ? "" : "default", flags & KVR_SPILL_BUFFERED ? "BUFFERED " : "",
		 flags & KVR_SPILL_SYNC ? "SYNC " : "", flags & KVR_SPILL_UNREGISTERED ? "UNREGISTERED " : "",
		 flags & KVR_SPILL_REQUIRE_DIRECT ? "REQUIRE_DIRECT " : "");
	return out;
}

static void round_trip(const char *dir, const struct shape *c, uint32_t ops)
{
	char fl[64];
	struct kvr_spill_params p = params_of(dir, c->run_bytes, c->rpp, c->queue_depth, 0, 0, c->flags);
	struct kvr_spill *sp = c->staging_slots ? create_staged(&p, c->staging_slots) : create_ok(&p);
	struct shadow *sh = sh_new(sp, c->run_bytes, c->rpp);
	uint32_t writes = 0, frees = 0, reused = 0;
	for (uint32_t op = 0; op < ops; op++) {
		char when[160];
		snprintf(when, sizeof(when), "run_bytes %llu x %u, %s, qd %u, staging %u slots, op %u",
			 (unsigned long long)c->run_bytes, c->rpp, flag_names(c->flags, fl, sizeof(fl)), c->queue_depth,
			 c->staging_slots, op);
		const uint32_t what = rnd(100);
		if (what < 30 && sh->n_live < 300) {
			const uint32_t had_stack = sh->n_stack;
			sh_write(sh, 1 + rnd(40), when);
			reused += had_stack != sh->n_stack;
			writes++;
		} else if (what < 55 && sh->n_live) {
			uint32_t n = 1 + rnd(sh->n_live < 30 ? sh->n_live : 30);
			while (n--)
				sh_free_at(sh, rnd(sh->n_live), when);
			frees++;
		} else if (what < 80) {
			sh_read_runs(sh, 1 + rnd(60), when);
		} else {
			sh_read_pages(sh, 1 + rnd(20), when);
		}
		sh_check_stats_clean(sh, when);
	}
	sh_verify_all(sh, "at the end");
	sh_check_stats_clean(sh, "at the end");
	cr_assert_gt(writes, 10);
	cr_assert_gt(frees, 10);
	cr_assert_gt(reused, 3, "freed slots were reused only %u times: LIFO reuse untested", reused);
	/* the model's bookkeeping: every slot below the mark is live or free */
	cr_assert_eq(sh->n_live + sh->n_stack, sh->high);
	kvr_spill_destroy(sp);
	sh_delete(sh);
}

Test(spill, round_trip_shadow)
{
	static const struct shape shapes[] = {
		{ 8192, 1, 0, 32, 3 },
		{ 8192, 8, 0, 4, 3 },
		{ 3328, 3, 0, 1, 2 },
		{ 1792, 8, KVR_SPILL_SYNC, 4, 3 },
		{ 3328, 8, KVR_SPILL_BUFFERED, 32, 3 },
		{ 1792, 3, KVR_SPILL_UNREGISTERED, 1, 3 },
		{ 8192, 3, KVR_SPILL_BUFFERED | KVR_SPILL_SYNC, 4, 1 },
		{ 1792, 1, 0, 32, 0 },
	};
	char dir[PATH_MAX];
	dir_make(dir, sizeof(dir));
	for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
		round_trip(dir, &shapes[i], 300);
	th_dir_remove(dir);
}

/* Runs of one and of many staging batches, each run read once: dst order is
 * the runs[] order, whatever order the I/Os complete in. */
Test(spill, read_order_across_batches)
{
	char dir[PATH_MAX];
	dir_make(dir, sizeof(dir));
	struct kvr_spill_params p = params_of(dir, 3328, 4, 8, 0, 0, 0);
	struct kvr_spill *sp = create_staged(&p, 2);
	struct shadow *sh = sh_new(sp, 3328, 4);
	sh_write(sh, 50, "setup");
	struct kvr_spill_run runs[200];
	for (uint32_t i = 0; i < 200; i++) /* every run of every page, reversed */
		runs[i] = (struct kvr_spill_run){ 49 - i / 4, 3 - i % 4 };
	sh_read_runs_of(sh, runs, 200, "all runs reversed");
	for (uint32_t i = 0; i < 200; i++) { /* shuffled */
		const uint32_t j = rnd(i + 1);
		const struct kvr_spill_run t = runs[i];
		runs[i] = runs[j], runs[j] = t;
	}
	sh_read_runs_of(sh, runs, 200, "all runs shuffled");
	sh_read_runs_of(sh, runs, 1, "one run");
	sh_read_runs_of(sh, runs, 0, "no runs");
	sh_read_pages_of(sh, sh->live, 0, "no pages");
	sh_check_stats_clean(sh, "after");
	kvr_spill_destroy(sp);
	sh_delete(sh);
	th_dir_remove(dir);
}

/* ------------------------------------------------------------------ refusals */

static void create_refused(const struct kvr_spill_params *p, int want, const char *what)
{
	struct kvr_spill *sp = (struct kvr_spill *)&sp; /* not NULL: create must clear it */
	char err[256] = "";
	const int rc = kvr_spill_create(p, &sp, err, sizeof(err));
	cr_assert_eq(rc, want, "%s: create returned %d (%s), not %d", what, rc, err, want);
	cr_assert_null(sp, "%s: a refused create handed out a spill", what);
	cr_assert_str_not_empty(err, "%s: no message", what);
}

Test(spill, bad_inputs)
{
	char dir[PATH_MAX], missing[PATH_MAX + 32];
	dir_make(dir, sizeof(dir));
	snprintf(missing, sizeof(missing), "%s/not-there", dir);
	struct kvr_spill_params p;
	p = params_of(dir, 0, 4, 0, 0, 0, 0);
	create_refused(&p, -EINVAL, "run_bytes 0");
	p = params_of(dir, (1ull << 30) + 1, 1, 0, 0, 0, 0);
	create_refused(&p, -EINVAL, "run_bytes past 2^30");
	p = params_of(dir, 4096, 0, 0, 0, 0, 0);
	create_refused(&p, -EINVAL, "runs_per_page 0");
	p = params_of(dir, 4096, 4, 5000, 0, 0, 0);
	create_refused(&p, -EINVAL, "queue_depth 5000");
	p = params_of(dir, 4096, 4, 0, 0, 0, 1u << 4);
	create_refused(&p, -EINVAL, "an unknown flag");
	p = params_of(dir, 4096, 4, 0, 0, 0, 1u << 31);
	create_refused(&p, -EINVAL, "flag bit 31");
	p = params_of(dir, 4096, 4, 0, 0, 0, KVR_SPILL_BUFFERED | KVR_SPILL_REQUIRE_DIRECT);
	create_refused(&p, -EINVAL, "BUFFERED|REQUIRE_DIRECT");
	p = params_of(dir, 4096, 4, 0, 0, 4 * 4096 - 1, 0);
	create_refused(&p, -EINVAL, "max_bytes below a slot");
	p = params_of(dir, 4096, 4, 0, 0, 1, KVR_SPILL_BUFFERED);
	create_refused(&p, -EINVAL, "max_bytes 1");
	p = params_of(missing, 4096, 4, 0, 0, 0, 0);
	create_refused(&p, -ENOENT, "a missing directory");
	cr_assert_eq(kvr_spill_create(&p, NULL, NULL, 0), -EINVAL, "NULL out");
	kvr_spill_destroy(NULL); /* a no-op */

	/* a valid spill: bad calls change nothing */
	p = params_of(dir, 3328, 3, 4, 0, 0, 0);
	struct kvr_spill *sp = create_staged(&p, 2);
	struct shadow *sh = sh_new(sp, 3328, 3);
	sh_write(sh, 5, "setup"); /* slots 0..4 */
	sh_free_at(sh, 2, "setup"); /* frees slot 2: live 0 1 4 3 */
	cr_assert_eq(sh->stack[0], 2u);
	sh_check_stats_clean(sh, "setup");
	struct kvr_spill_stats before, after;
	kvr_spill_get_stats(sp, &before);

	unsigned char dst[4 * 4000];
	int32_t results[4];
	const struct {
		struct kvr_spill_run runs[3];
		uint64_t stride;
		const char *what;
	} bad[] = {
		{ { { 0, 0 }, { 1000, 0 }, { 1, 1 } }, 4000, "a slot never used" },
		{ { { 0, 0 }, { 5, 0 }, { 1, 1 } }, 4000, "the slot just past the high-water mark" },
		{ { { 0, 0 }, { 1, 1 }, { 2, 0 } }, 4000, "a freed slot" },
		{ { { 0, 0 }, { 3, 3 }, { 1, 1 } }, 4000, "run == runs_per_page" },
		{ { { 0, 0 }, { 3, 1000 }, { 1, 1 } }, 4000, "run 1000" },
		{ { { UINT32_MAX, 0 }, { 3, 0 }, { 1, 1 } }, 4000, "KVR_SPILL_NO_SLOT" },
		{ { { 0, 0 }, { 3, 2 }, { 1, 1 } }, 3327, "dst_stride < run_bytes" },
	};
	for (size_t t = 0; t < sizeof(bad) / sizeof(bad[0]); t++) {
		fill_sentinel(dst, sizeof(dst));
		for (int i = 0; i < 4; i++)
			results[i] = 12345;
		const int rc = kvr_spill_read_runs(sp, bad[t].runs, 3, dst, bad[t].stride, results);
		cr_assert_eq(rc, -EINVAL, "%s: read_runs returned %d", bad[t].what, rc);
		cr_assert_str_not_empty(kvr_spill_last_error(sp), "%s: no message", bad[t].what);
		for (size_t b = 0; b < sizeof(dst); b++)
			cr_assert_eq(dst[b], sentinel(b), "%s: a refused read wrote byte %zu", bad[t].what, b);
		for (int i = 0; i < 3; i++)
			cr_assert_neq(results[i], 0, "%s: results[%d] says read", bad[t].what, i);
		cr_assert_eq(results[3], 12345, "%s: results[] written past n", bad[t].what);
	}
	/* read_pages of a freed or unknown slot, or into a NULL page */
	{
		void *pg[3];
		for (int i = 0; i < 3; i++) {
			pg[i] = malloc(sh->page_bytes);
			fill_sentinel(pg[i], sh->page_bytes);
		}
		const uint32_t freed[3] = { 0, 2, 1 }, unknown[3] = { 0, 1, 77 }, ok[3] = { 0, 1, 3 };
		for (int i = 0; i < 4; i++)
			results[i] = 12345;
		cr_assert_eq(kvr_spill_read_pages(sp, freed, 3, pg, results), -EINVAL, "a freed slot");
		cr_assert_str_not_empty(kvr_spill_last_error(sp));
		for (int i = 0; i < 3; i++)
			cr_assert_neq(results[i], 0, "a refused page read: results[%d] says read", i);
		cr_assert_eq(kvr_spill_read_pages(sp, unknown, 3, pg, NULL), -EINVAL, "an unknown slot");
		void *with_null[3] = { pg[0], NULL, pg[2] };
		cr_assert_eq(kvr_spill_read_pages(sp, ok, 3, with_null, results), -EINVAL, "a NULL page");
		for (int i = 0; i < 3; i++)
			for (size_t b = 0; b < sh->page_bytes; b++)
				cr_assert_eq(((unsigned char *)pg[i])[b], sentinel(b),
					     "a refused page read wrote page %d byte %zu", i, b);
		for (int i = 0; i < 3; i++)
			free(pg[i]);
	}
	kvr_spill_get_stats(sp, &after);
	cr_assert(!memcmp(&before, &after, sizeof(before)), "refused reads changed the stats");
	sh_verify_all(sh, "after refused reads");

	/* frees: a double free, a never-used slot, NO_SLOT */
	kvr_spill_get_stats(sp, &before);
	cr_assert_eq(kvr_spill_free(sp, 2), -EINVAL, "double free accepted");
	cr_assert_str_not_empty(kvr_spill_last_error(sp));
	cr_assert_eq(kvr_spill_free(sp, 5), -EINVAL, "free of a never-used slot");
	cr_assert_eq(kvr_spill_free(sp, 4000), -EINVAL);
	cr_assert_eq(kvr_spill_free(sp, KVR_SPILL_NO_SLOT), -EINVAL);
	kvr_spill_get_stats(sp, &after);
	cr_assert(!memcmp(&before, &after, sizeof(before)), "refused frees changed the stats");

	/* a NULL page: nothing taken */
	{
		const void *pages[3];
		sh_make_pages(sh, 3, pages);
		pages[1] = NULL;
		uint32_t slots[4] = { 7, 7, 7, 7 };
		cr_assert_eq(kvr_spill_write_pages(sp, pages, 3, slots), -EINVAL);
		cr_assert_str_not_empty(kvr_spill_last_error(sp));
		for (int i = 0; i < 3; i++)
			cr_assert_eq(slots[i], KVR_SPILL_NO_SLOT, "slots[%d] = %u after a refused write", i, slots[i]);
		cr_assert_eq(slots[3], 7u, "slots[] written past n");
		cr_assert_eq(kvr_spill_write_pages(sp, NULL, 2, slots), -EINVAL);
		cr_assert_eq(kvr_spill_write_pages(sp, pages, 2, NULL), -EINVAL);
		cr_assert_eq(kvr_spill_write_pages(sp, pages, 0, slots), 0, "an empty write");
		kvr_spill_get_stats(sp, &after);
		cr_assert(!memcmp(&before, &after, sizeof(before)), "a refused write changed the stats");
	}
	/* the double free was not obeyed: slot 2 comes back once, then fresh ones */
	sh_write(sh, 3, "after the refusals"); /* 2, 5, 6 */
	cr_assert_eq(sh->live[sh->n_live - 3], 2u);
	sh_verify_all(sh, "at the end");
	sh_check_stats_clean(sh, "at the end");
	kvr_spill_destroy(sp);
	sh_delete(sh);
	th_dir_remove(dir);
}

/* ------------------------------------------------------------------ faults */

static void inject(struct kvr_spill *sp, uint32_t kind, uint32_t slot, uint32_t skip, uint32_t count)
{
	const struct kvr_spill_fault f = { .kind = kind, .slot = slot, .skip = skip, .count = count };
	kvr_spill_inject(sp, &f);
}

static struct kvr_spill_stats stats_of(struct kvr_spill *sp)
{
	struct kvr_spill_stats st;
	kvr_spill_get_stats(sp, &st);
	return st;
}

/* Read runs[] where some fail: results must be want[i] (0 or an errno; < -1000:
 * either 0 or -EIO, with exactly `either` of those failing), successful runs
 * must hold the model's bytes; returns what the call returned. */
static int read_runs_expect(struct shadow *sh, const struct kvr_spill_run *runs, uint32_t n, const int32_t *want,
			    int ret_want, const char *when)
{
	const uint64_t stride = sh->run_bytes + 5;
	unsigned char *buf = malloc((size_t)n * stride);
	int32_t *results = malloc(n * sizeof(int32_t));
	cr_assert(buf && results);
	for (uint32_t i = 0; i < n; i++)
		results[i] = 12345;
	const int rc = kvr_spill_read_runs(sh->sp, runs, n, buf, stride, results);
	cr_assert_eq(rc, ret_want, "%s: read_runs returned %d, not %d (%s)", when, rc, ret_want,
		     kvr_spill_last_error(sh->sp));
	uint32_t ok = 0;
	for (uint32_t i = 0; i < n; i++) {
		cr_assert_eq(results[i], want[i], "%s: results[%u] (slot %u run %u) = %d, not %d", when, i, runs[i].slot,
			     runs[i].run, results[i], want[i]);
		if (!results[i]) {
			cr_assert(!memcmp(buf + i * stride, sh->page[runs[i].slot] + runs[i].run * sh->run_bytes,
					  sh->run_bytes),
				  "%s: run %u (slot %u) read as good holds the wrong bytes", when, i, runs[i].slot);
			ok++;
		}
	}
	sh->runs_read += ok;
	free(results);
	free(buf);
	return rc;
}

/* The slot's message: "... slot N ..." names it. */
static void message_names_slot(struct kvr_spill *sp, uint32_t slot, const char *when)
{
	char want[32];
	snprintf(want, sizeof(want), "slot %u", slot);
	cr_assert_not_null(strstr(kvr_spill_last_error(sp), want), "%s: message \"%s\" does not name %s", when,
			   kvr_spill_last_error(sp), want);
}

static void faults_with(const char *dir, uint32_t flags)
{
	char fl[64], when[160];
	flag_names(flags, fl, sizeof(fl));
	struct kvr_spill_params p = params_of(dir, 3328, 4, 8, 0, 0, flags);
	struct kvr_spill *sp = create_staged(&p, 3);
	struct shadow *sh = sh_new(sp, 3328, 4);
	sh_write(sh, 6, "setup"); /* slots 0..5 */
	struct kvr_spill_stats st0, st1;

	/* READ_EIO on slot 2 for its two I/Os in a call of 7 runs over 6 slots */
	const struct kvr_spill_run runs7[7] = { { 0, 0 }, { 1, 1 }, { 2, 2 }, { 3, 3 }, { 2, 0 }, { 4, 0 }, { 5, 1 } };
	const int32_t want7[7] = { 0, 0, -EIO, 0, -EIO, 0, 0 };
	snprintf(when, sizeof(when), "%s: READ_EIO on slot 2, count 2", fl);
	st0 = stats_of(sp);
	inject(sp, KVR_SPILL_FAULT_READ_EIO, 2, 0, 2);
	read_runs_expect(sh, runs7, 7, want7, -EIO, when);
	message_names_slot(sp, 2, when);
	st1 = stats_of(sp);
	cr_assert_eq(st1.io_errors, st0.io_errors + 2, "%s: io_errors %llu -> %llu", when,
		     (unsigned long long)st0.io_errors, (unsigned long long)st1.io_errors);
	cr_assert_eq(st1.checksum_errors, 0);
	sh_check_stats(sh, when);
	/* exhausted: the same call now reads everything, nothing was corrupted */
	sh_read_runs_of(sh, runs7, 7, "after READ_EIO");
	sh_check_stats(sh, "after READ_EIO");

	/* count 1: exactly one of slot 2's two I/Os fails (completion order is the ring's) */
	snprintf(when, sizeof(when), "%s: READ_EIO on slot 2, count 1", fl);
	inject(sp, KVR_SPILL_FAULT_READ_EIO, 2, 0, 1);
	{
		unsigned char buf[7 * 3328];
		int32_t res[7];
		cr_assert_eq(kvr_spill_read_runs(sp, runs7, 7, buf, 3328, res), -EIO, "%s", when);
		cr_assert_eq((res[2] == -EIO) + (res[4] == -EIO), 1, "%s: results %d %d", when, res[2], res[4]);
		for (int i = 0; i < 7; i++) {
			cr_assert(res[i] == 0 || res[i] == -EIO, "%s", when);
			if (!res[i]) {
				cr_assert(!memcmp(buf + i * 3328, sh->page[runs7[i].slot] + runs7[i].run * 3328, 3328), "%s: run %d",
					  when, i);
				sh->runs_read++;
			}
		}
		cr_assert(res[0] == 0 && res[1] == 0 && res[3] == 0 && res[5] == 0 && res[6] == 0, "%s", when);
	}
	sh_check_stats(sh, when);

	/* READ_SHORT on slot 3 in a read of every page */
	snprintf(when, sizeof(when), "%s: READ_SHORT on slot 3", fl);
	st0 = stats_of(sp);
	inject(sp, KVR_SPILL_FAULT_READ_SHORT, 3, 0, 1);
	{
		uint32_t slots[6] = { 5, 4, 3, 2, 1, 0 };
		void *pages[6];
		int32_t res[6];
		for (int i = 0; i < 6; i++)
			pages[i] = malloc(sh->page_bytes);
		cr_assert_eq(kvr_spill_read_pages(sp, slots, 6, pages, res), -EIO, "%s", when);
		message_names_slot(sp, 3, when);
		for (int i = 0; i < 6; i++) {
			cr_assert_eq(res[i], slots[i] == 3 ? -EIO : 0, "%s: results[%d] = %d", when, i, res[i]);
			if (slots[i] != 3)
				cr_assert(!memcmp(pages[i], sh->page[slots[i]], sh->page_bytes), "%s: page %d", when, i);
			free(pages[i]);
		}
		sh->runs_read += 5 * 4;
	}
	st1 = stats_of(sp);
	cr_assert_eq(st1.io_errors, st0.io_errors + 1, "%s", when);
	sh_check_stats(sh, when);
	sh_verify_all(sh, "after READ_SHORT");

	/* READ_SHORT on run reads */
	snprintf(when, sizeof(when), "%s: READ_SHORT on slot 5 runs", fl);
	inject(sp, KVR_SPILL_FAULT_READ_SHORT, 5, 0, 1);
	{
		const struct kvr_spill_run r[3] = { { 4, 3 }, { 5, 3 }, { 0, 2 } };
		const int32_t w[3] = { 0, -EIO, 0 };
		read_runs_expect(sh, r, 3, w, -EIO, when);
	}
	sh_check_stats(sh, when);

	/* READ_CORRUPT: one flipped bit, caught by the CRC */
	snprintf(when, sizeof(when), "%s: READ_CORRUPT on slot 4", fl);
	st0 = stats_of(sp);
	inject(sp, KVR_SPILL_FAULT_READ_CORRUPT, 4, 0, 1);
	{
		const struct kvr_spill_run r[3] = { { 0, 0 }, { 4, 1 }, { 1, 1 } };
		const int32_t w[3] = { 0, -EBADMSG, 0 };
		read_runs_expect(sh, r, 3, w, -EBADMSG, when);
		message_names_slot(sp, 4, when);
		sh_read_runs_of(sh, r, 3, "re-read after READ_CORRUPT");
	}
	st1 = stats_of(sp);
	cr_assert_eq(st1.checksum_errors, st0.checksum_errors + 1, "%s: checksum_errors %llu -> %llu", when,
		     (unsigned long long)st0.checksum_errors, (unsigned long long)st1.checksum_errors);
	cr_assert_eq(st1.io_errors, st0.io_errors, "%s: a flipped bit counted as an I/O error", when);
	sh_check_stats(sh, when);
	snprintf(when, sizeof(when), "%s: READ_CORRUPT on a page read", fl);
	inject(sp, KVR_SPILL_FAULT_READ_CORRUPT, 4, 0, 1);
	{
		uint32_t slots[2] = { 4, 1 };
		void *pages[2] = { malloc(sh->page_bytes), malloc(sh->page_bytes) };
		int32_t res[2];
		cr_assert_eq(kvr_spill_read_pages(sp, slots, 2, pages, res), -EBADMSG, "%s", when);
		cr_assert_eq(res[0], -EBADMSG, "%s", when);
		cr_assert_eq(res[1], 0, "%s", when);
		cr_assert(!memcmp(pages[1], sh->page[1], sh->page_bytes), "%s", when);
		sh->runs_read += 4 + 3; /* page 1, and the three unflipped runs of page 4 */
		free(pages[0]), free(pages[1]);
	}
	cr_assert_eq(stats_of(sp).checksum_errors, st0.checksum_errors + 2, "%s", when);
	sh_check_stats(sh, when);
	sh_verify_all(sh, "after READ_CORRUPT");

	/* skip 2: the third matching I/O only (one I/O per call, so the order is known) */
	snprintf(when, sizeof(when), "%s: READ_EIO, any slot, skip 2", fl);
	inject(sp, KVR_SPILL_FAULT_READ_EIO, KVR_SPILL_NO_SLOT, 2, 1);
	for (uint32_t i = 0; i < 5; i++) {
		const struct kvr_spill_run r = { i, i % 4 };
		const int32_t w = i == 2 ? -EIO : 0;
		read_runs_expect(sh, &r, 1, &w, w, when);
	}
	/* skip counts only matching I/Os: reads of other slots do not use it up */
	snprintf(when, sizeof(when), "%s: READ_EIO on slot 5, skip 1", fl);
	inject(sp, KVR_SPILL_FAULT_READ_EIO, 5, 1, 1);
	for (uint32_t i = 0; i < 6; i++) {
		const struct kvr_spill_run r = { i < 3 ? i : 5, 0 };
		const int32_t w = i == 4 ? -EIO : 0;
		read_runs_expect(sh, &r, 1, &w, w, when);
	}
	sh_check_stats(sh, when);

	/* count 0: until cleared */
	snprintf(when, sizeof(when), "%s: READ_EIO on slot 1 until cleared", fl);
	inject(sp, KVR_SPILL_FAULT_READ_EIO, 1, 0, 0);
	for (int k = 0; k < 3; k++) {
		const struct kvr_spill_run r[2] = { { 1, (uint32_t)k }, { 0, (uint32_t)k } };
		const int32_t w[2] = { -EIO, 0 };
		read_runs_expect(sh, r, 2, w, -EIO, when);
	}
	inject(sp, KVR_SPILL_FAULT_NONE, 0, 0, 0);
	sh_verify_all(sh, "after clearing the fault");
	sh_check_stats(sh, when);

	/* NOSPC: nothing taken, the next write goes through (the model stays exact) */
	snprintf(when, sizeof(when), "%s: NOSPC", fl);
	sh_free_at(sh, 0, when); /* slot 0 on the free stack */
	{
		st0 = stats_of(sp);
		inject(sp, KVR_SPILL_FAULT_NOSPC, KVR_SPILL_NO_SLOT, 0, 1);
		const void *pages[2];
		uint32_t slots[2] = { 1, 1 };
		sh_make_pages(sh, 2, pages);
		cr_assert_eq(kvr_spill_write_pages(sp, pages, 2, slots), -ENOSPC, "%s", when);
		cr_assert_str_not_empty(kvr_spill_last_error(sp));
		cr_assert(slots[0] == KVR_SPILL_NO_SLOT && slots[1] == KVR_SPILL_NO_SLOT, "%s: slots %u %u", when,
			  slots[0], slots[1]);
		st1 = stats_of(sp);
		cr_assert_eq(st1.slots_used, st0.slots_used, "%s", when);
		cr_assert_eq(st1.slots_high, st0.slots_high, "%s", when);
		cr_assert_eq(st1.pages_written, st0.pages_written, "%s", when);
		cr_assert_eq(st1.io_errors, st0.io_errors, "%s", when);
	}
	sh_write(sh, 2, "after NOSPC"); /* exact: slot 0 again, then 6 */
	sh_check_stats(sh, "after NOSPC");
	sh_verify_all(sh, "after NOSPC");

	/* failed batch writes (5 pages: two staging batches): all or nothing */
	static const struct {
		uint32_t kind, skip;
		const char *what;
	} wf[] = {
		{ KVR_SPILL_FAULT_WRITE_EIO, 0, "WRITE_EIO, first I/O" },
		{ KVR_SPILL_FAULT_WRITE_EIO, 3, "WRITE_EIO, in the second staging batch" },
		{ KVR_SPILL_FAULT_WRITE_SHORT, 1, "WRITE_SHORT, second I/O" },
		{ KVR_SPILL_FAULT_WRITE_SHORT, 4, "WRITE_SHORT, last I/O" },
	};
	for (size_t t = 0; t < sizeof(wf) / sizeof(wf[0]); t++) {
		snprintf(when, sizeof(when), "%s: %s", fl, wf[t].what);
		if (t == 1)
			sh_free_at(sh, 3, when); /* a freed slot among those taken */
		st0 = stats_of(sp);
		inject(sp, wf[t].kind, KVR_SPILL_NO_SLOT, wf[t].skip, 1);
		const void *pages[5];
		uint32_t slots[5];
		sh_make_pages(sh, 5, pages);
		cr_assert_eq(kvr_spill_write_pages(sp, pages, 5, slots), -EIO, "%s", when);
		cr_assert_str_not_empty(kvr_spill_last_error(sp));
		for (int i = 0; i < 5; i++)
			cr_assert_eq(slots[i], KVR_SPILL_NO_SLOT, "%s: slots[%d] = %u", when, i, slots[i]);
		st1 = stats_of(sp);
		cr_assert_eq(st1.slots_used, st0.slots_used, "%s: slots_used %llu -> %llu", when,
			     (unsigned long long)st0.slots_used, (unsigned long long)st1.slots_used);
		cr_assert_eq(st1.pages_written, st0.pages_written, "%s", when);
		cr_assert_eq(st1.io_errors, st0.io_errors + 1, "%s", when);
		/* the slots it took are free again: no read of them is allowed */
		for (uint32_t s = 0; s < st1.slots_high; s++)
			if (!sh->page[s]) {
				const struct kvr_spill_run r = { s, 0 };
				unsigned char b[3328];
				cr_assert_eq(kvr_spill_read_runs(sp, &r, 1, b, 3328, NULL), -EINVAL,
					     "%s: slot %u readable after the failed write", when, s);
			}
		sh->exact = 0;
		sh_check_stats(sh, when);
		sh_verify_all(sh, when);
	}
	sh_write(sh, 5, "after the failed writes");
	sh_write(sh, 7, "after the failed writes");
	sh_verify_all(sh, "after the failed writes");
	sh_check_stats(sh, "after the failed writes");
	cr_assert_eq(stats_of(sp).slots_used, sh->n_live);
	kvr_spill_destroy(sp);
	sh_delete(sh);
}

Test(spill, faults)
{
	char dir[PATH_MAX];
	dir_make(dir, sizeof(dir));
	faults_with(dir, 0);
	faults_with(dir, KVR_SPILL_SYNC);
	th_dir_remove(dir);
}

/* A flipped bit in a run much smaller than its padded stride is still in the
 * run's data, so the CRC catches it. */
Test(spill, read_corrupt_small_run)
{
	char dir[PATH_MAX];
	dir_make(dir, sizeof(dir));
	static const uint64_t sizes[] = { 64, 100, 600, 1000 };
	for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
		struct kvr_spill_params p = params_of(dir, sizes[k], 2, 4, 0, 0, 0);
		struct kvr_spill *sp = create_ok(&p);
		struct shadow *sh = sh_new(sp, sizes[k], 2);
		sh_write(sh, 2, "setup");
		char when[96];
		snprintf(when, sizeof(when), "run_bytes %llu (stride %llu): READ_CORRUPT", (unsigned long long)sizes[k],
			 (unsigned long long)sh->run_stride);
		inject(sp, KVR_SPILL_FAULT_READ_CORRUPT, 1, 0, 1);
		const struct kvr_spill_run r[2] = { { 1, 1 }, { 0, 1 } };
		const int32_t w[2] = { -EBADMSG, 0 };
		read_runs_expect(sh, r, 2, w, -EBADMSG, when);
		cr_assert_eq(stats_of(sp).checksum_errors, 1, "%s", when);
		kvr_spill_destroy(sp);
		sh_delete(sh);
	}
	th_dir_remove(dir);
}

/* ------------------------------------------------------------------ max_bytes */

Test(spill, max_bytes_full)
{
	char dir[PATH_MAX];
	dir_make(dir, sizeof(dir));
	struct kvr_spill_params p = params_of(dir, 3328, 3, 4, 0, 0, 0);
	struct kvr_spill *sp = create_ok(&p);
	const uint64_t sb = stats_of(sp).slot_bytes;
	kvr_spill_destroy(sp);
	const uint64_t limits[] = { 10 * sb, 11 * sb - 1 }; /* whole slots: both hold 10 */
	for (int l = 0; l < 2; l++) {
		p.max_bytes = limits[l];
		sp = create_ok(&p);
		struct shadow *sh = sh_new(sp, 3328, 3);
		for (int i = 0; i < 10; i++)
			sh_write(sh, 1, "filling");
		const void *pages[3];
		uint32_t slots[3] = { 0, 0, 0 };
		sh_make_pages(sh, 3, pages);
		cr_assert_eq(kvr_spill_write_pages(sp, pages, 1, slots), -ENOSPC, "an 11th slot under max_bytes %llu",
			     (unsigned long long)limits[l]);
		cr_assert_eq(slots[0], KVR_SPILL_NO_SLOT);
		cr_assert_not_null(strstr(kvr_spill_last_error(sp), "max_bytes"), "message: %s", kvr_spill_last_error(sp));
		sh_check_stats_clean(sh, "full");
		sh_free_at(sh, 3, "making room");
		sh_free_at(sh, 7, "making room");
		cr_assert_eq(kvr_spill_write_pages(sp, pages, 3, slots), -ENOSPC, "3 pages into 2 free slots");
		for (int i = 0; i < 3; i++)
			cr_assert_eq(slots[i], KVR_SPILL_NO_SLOT);
		cr_assert_eq(stats_of(sp).slots_used, 8, "a refused batch took slots");
		sh_check_stats_clean(sh, "refused batch");
		sh_write(sh, 2, "two into two free slots");
		cr_assert_eq(kvr_spill_write_pages(sp, pages, 1, slots), -ENOSPC, "full again");
		sh_verify_all(sh, "full");
		sh_check_stats_clean(sh, "at the end");
		struct stat fst;
		cr_assert_eq(fstat(kvr_spill_fd(sp), &fst), 0);
		cr_assert_leq((uint64_t)fst.st_size, limits[l], "the file grew to %lld bytes past max_bytes %llu",
			      (long long)fst.st_size, (unsigned long long)limits[l]);
		cr_assert_leq(stats_of(sp).file_bytes, limits[l]);
		kvr_spill_destroy(sp);
		sh_delete(sh);
	}
	th_dir_remove(dir);
}

/* ------------------------------------------------------------------ the file behind the spill's back */

/* Flip one byte at `at` in the file: a read-modify-write of the aligned block
 * around it, with an aligned buffer (the fd may be O_DIRECT). */
static void flip_on_disk(struct kvr_spill *sp, uint64_t at)
{
	const uint32_t align = stats_of(sp).dio_align;
	const uint64_t blk = align > 4096 ? align : 4096;
	void *b = NULL;
	cr_assert_eq(posix_memalign(&b, 4096, blk), 0);
	const uint64_t from = at / blk * blk;
	const int fd = kvr_spill_fd(sp);
	cr_assert_eq(pread(fd, b, blk, (off_t)from), (ssize_t)blk, "pread: %s", strerror(errno));
	((unsigned char *)b)[at - from] ^= 0x40;
	cr_assert_eq(pwrite(fd, b, blk, (off_t)from), (ssize_t)blk, "pwrite: %s", strerror(errno));
	free(b);
}

static void on_disk_with(const char *dir, uint32_t flags)
{
	struct kvr_spill_params p = params_of(dir, 3328, 3, 8, 0, 0, flags);
	struct kvr_spill *sp = create_staged(&p, 2);
	struct shadow *sh = sh_new(sp, 3328, 3);
	sh_write(sh, 5, "setup");
	const uint64_t stride = sh->run_stride;
	cr_assert_eq(kvr_spill_slot_offset(sp, 3), 3 * sh->slot_bytes);
	/* slot 2, run 1: a data byte; slot 3, run 0: a padding byte (not checked) */
	flip_on_disk(sp, kvr_spill_slot_offset(sp, 2) + stride + 100);
	flip_on_disk(sp, kvr_spill_slot_offset(sp, 3) + 3328 + 5);
	const struct kvr_spill_stats st0 = stats_of(sp);
	const struct kvr_spill_run r[5] = { { 2, 0 }, { 2, 1 }, { 2, 2 }, { 1, 1 }, { 3, 0 } };
	const int32_t w[5] = { 0, -EBADMSG, 0, 0, 0 };
	read_runs_expect(sh, r, 5, w, -EBADMSG, "a byte flipped on disk");
	message_names_slot(sp, 2, "a byte flipped on disk");
	cr_assert_eq(stats_of(sp).checksum_errors, st0.checksum_errors + 1);
	/* it stays bad: the file, not the read, is wrong */
	read_runs_expect(sh, r, 5, w, -EBADMSG, "read again");
	{
		uint32_t slots[3] = { 1, 2, 3 };
		void *pages[3] = { malloc(sh->page_bytes), malloc(sh->page_bytes), malloc(sh->page_bytes) };
		int32_t res[3];
		cr_assert_eq(kvr_spill_read_pages(sp, slots, 3, pages, res), -EBADMSG);
		cr_assert(res[0] == 0 && res[1] == -EBADMSG && res[2] == 0, "results %d %d %d", res[0], res[1], res[2]);
		cr_assert(!memcmp(pages[0], sh->page[1], sh->page_bytes));
		cr_assert(!memcmp(pages[2], sh->page[3], sh->page_bytes));
		/* the good runs of the bad page were copied out */
		cr_assert(!memcmp(pages[1], sh->page[2], 3328));
		cr_assert(!memcmp((char *)pages[1] + 2 * 3328, sh->page[2] + 2 * 3328, 3328));
		for (int i = 0; i < 3; i++)
			free(pages[i]);
		sh->runs_read += 3 + 2 + 3;
	}
	cr_assert_eq(stats_of(sp).checksum_errors, st0.checksum_errors + 3);
	cr_assert_eq(stats_of(sp).io_errors, 0);
	/* rewriting the slot heals it */
	const uint32_t k = sh->live[2] == 2 ? 2 : 0;
	cr_assert_eq(sh->live[k], 2u);
	sh_free_at(sh, k, "rewrite");
	sh_write(sh, 1, "rewrite");
	cr_assert_eq(sh->live[sh->n_live - 1], 2u);
	sh_verify_all(sh, "after the rewrite");
	sh_check_stats(sh, "at the end");
	kvr_spill_destroy(sp);
	sh_delete(sh);
}

Test(spill, on_disk_corruption)
{
	char dir[PATH_MAX];
	dir_make(dir, sizeof(dir));
	on_disk_with(dir, 0);
	on_disk_with(dir, KVR_SPILL_SYNC | KVR_SPILL_BUFFERED);
	th_dir_remove(dir);
}

/* ------------------------------------------------------------------ threads */

#define TH_MAX_LIVE 48u
static _Atomic int32_t slot_owner[SH_CAP];

struct worker {
	struct kvr_spill *sp;
	int id;
	uint64_t rng;
	uint64_t run_bytes;
	uint32_t rpp;
	uint32_t slots[TH_MAX_LIVE];
	unsigned char *data[TH_MAX_LIVE];
	uint32_t n;
	uint32_t writes, reads, frees;
	int failures;
	char first_failure[200];
};

static uint32_t wrnd(struct worker *w, uint32_t n)
{
	w->rng ^= w->rng << 13;
	w->rng ^= w->rng >> 7;
	w->rng ^= w->rng << 17;
	return (uint32_t)((w->rng >> 33) % n);
}

static void wfail(struct worker *w, const char *what, int rc)
{
	if (!w->failures++)
		snprintf(w->first_failure, sizeof(w->first_failure), "thread %d: %s (%d)", w->id, what, rc);
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	const uint64_t page_bytes = w->run_bytes * w->rpp;
	unsigned char *in = malloc(4 * page_bytes), *out = malloc(8 * page_bytes + 64);
	for (int it = 0; it < 200; it++) {
		const uint32_t what = wrnd(w, 3);
		if ((what == 0 && w->n + 4 <= TH_MAX_LIVE) || w->n == 0) {
			const uint32_t n = 1 + wrnd(w, 4);
			const void *pages[4];
			uint32_t slots[4];
			for (uint32_t i = 0; i < n; i++) {
				for (uint64_t b = 0; b < page_bytes; b++)
					in[i * page_bytes + b] = (unsigned char)wrnd(w, 256);
				pages[i] = in + i * page_bytes;
			}
			int rc = kvr_spill_write_pages(w->sp, pages, n, slots);
			if (rc) {
				wfail(w, "write", rc);
				continue;
			}
			for (uint32_t i = 0; i < n; i++) {
				int32_t none = -1;
				if (slots[i] >= SH_CAP || !atomic_compare_exchange_strong(&slot_owner[slots[i]], &none, w->id)) {
					wfail(w, "a slot handed to two threads", (int)slots[i]);
					continue;
				}
				w->slots[w->n] = slots[i];
				w->data[w->n] = malloc(page_bytes);
				memcpy(w->data[w->n], pages[i], page_bytes);
				w->n++;
			}
			w->writes++;
		} else if (what == 1) {
			/* runs of up to 8 of its own pages, then whole pages */
			const uint32_t n = 1 + wrnd(w, 8);
			struct kvr_spill_run runs[8];
			uint32_t idx[8], slots[8];
			void *pages[8];
			for (uint32_t i = 0; i < n; i++) {
				idx[i] = wrnd(w, w->n);
				runs[i] = (struct kvr_spill_run){ w->slots[idx[i]], wrnd(w, w->rpp) };
				slots[i] = w->slots[idx[i]];
				pages[i] = out + i * page_bytes;
			}
			int rc = kvr_spill_read_runs(w->sp, runs, n, out, w->run_bytes + 7, NULL);
			if (rc)
				wfail(w, "read_runs", rc);
			for (uint32_t i = 0; i < n && !rc; i++)
				if (memcmp(out + i * (w->run_bytes + 7), w->data[idx[i]] + runs[i].run * w->run_bytes,
					   w->run_bytes))
					wfail(w, "a run read back wrong", (int)runs[i].slot);
			rc = kvr_spill_read_pages(w->sp, slots, n, pages, NULL);
			if (rc)
				wfail(w, "read_pages", rc);
			for (uint32_t i = 0; i < n && !rc; i++)
				if (memcmp(pages[i], w->data[idx[i]], page_bytes))
					wfail(w, "a page read back wrong", (int)slots[i]);
			w->reads++;
		} else {
			const uint32_t k = wrnd(w, w->n);
			const uint32_t s = w->slots[k];
			atomic_store(&slot_owner[s], -1); /* before the free: another thread may get it at once */
			const int rc = kvr_spill_free(w->sp, s);
			if (rc)
				wfail(w, "free", rc);
			free(w->data[k]);
			w->slots[k] = w->slots[--w->n];
			w->data[k] = w->data[w->n];
			w->frees++;
		}
	}
	while (w->n) {
		w->n--;
		atomic_store(&slot_owner[w->slots[w->n]], -1);
		const int rc = kvr_spill_free(w->sp, w->slots[w->n]);
		if (rc)
			wfail(w, "free at the end", rc);
		free(w->data[w->n]);
	}
	free(in);
	free(out);
	return NULL;
}

Test(spill, concurrent)
{
	char dir[PATH_MAX];
	dir_make(dir, sizeof(dir));
	static const uint32_t flags[] = { 0, KVR_SPILL_SYNC };
	for (int f = 0; f < 2; f++) {
		struct kvr_spill_params p = params_of(dir, 3328, 3, 8, 0, 0, flags[f]);
		struct kvr_spill *sp = create_staged(&p, 2);
		for (uint32_t s = 0; s < SH_CAP; s++)
			atomic_store(&slot_owner[s], -1);
		struct worker w[2];
		pthread_t t[2];
		for (int i = 0; i < 2; i++) {
			memset(&w[i], 0, sizeof(w[i]));
			w[i].sp = sp, w[i].id = i, w[i].rng = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1) + (uint64_t)f;
			w[i].run_bytes = 3328, w[i].rpp = 3;
			cr_assert_eq(pthread_create(&t[i], NULL, worker_main, &w[i]), 0);
		}
		for (int i = 0; i < 2; i++)
			pthread_join(t[i], NULL);
		for (int i = 0; i < 2; i++) {
			cr_assert_eq(w[i].failures, 0, "flags %#x: %d failures, first: %s", flags[f], w[i].failures,
				     w[i].first_failure);
			cr_assert_gt(w[i].writes, 20);
			cr_assert_gt(w[i].reads, 20);
			cr_assert_gt(w[i].frees, 20);
		}
		const struct kvr_spill_stats st = stats_of(sp);
		cr_assert_eq(st.slots_used, 0, "flags %#x: %llu slots still used", flags[f],
			     (unsigned long long)st.slots_used);
		cr_assert_eq(st.io_errors + st.checksum_errors, 0);
		kvr_spill_destroy(sp);
	}
	th_dir_remove(dir);
}

/* ------------------------------------------------------------------ probing */

Test(spill, probe_dir)
{
	uint32_t direct = 7, align = 7;
	uint64_t free_bytes = 0;
	char fs[32] = "", reason[256] = "";
	int rc = kvr_spill_probe_dir(NULL, &direct, &align, fs, sizeof(fs), &free_bytes, reason, sizeof(reason));
	cr_assert_eq(rc, 0, "probe of the default directory %s: %d %s", kvr_spill_default_dir(), rc, reason);
	cr_assert_str_not_empty(fs);
	cr_assert_gt(free_bytes, 0);
	cr_assert(direct == 0 || direct == 1);
	if (direct)
		cr_assert(align >= 512 && !(align & (align - 1)), "dio_align %u", align);
	else
		cr_assert_str_not_empty(reason, "no O_DIRECT and no reason");

	/* a fresh directory: the probe leaves nothing there, and a spill there
	 * sees what the probe saw */
	char dir[PATH_MAX];
	dir_make(dir, sizeof(dir));
	rc = kvr_spill_probe_dir(dir, &direct, &align, fs, sizeof(fs), &free_bytes, reason, sizeof(reason));
	cr_assert_eq(rc, 0, "%s: %s", dir, reason);
	cr_assert_str_not_empty(fs);
	struct kvr_spill_params p = params_of(dir, 4096, 2, 0, 0, 0, 0);
	struct kvr_spill *sp = create_ok(&p);
	const struct kvr_spill_stats st = stats_of(sp);
	cr_assert_eq(st.direct_io, direct, "probe says O_DIRECT %u, the spill %u", direct, st.direct_io);
	if (direct)
		cr_assert_eq(st.dio_align, align);
	kvr_spill_destroy(sp);
	p.flags = KVR_SPILL_REQUIRE_DIRECT;
	if (direct) {
		sp = create_ok(&p);
		kvr_spill_destroy(sp);
	} else {
		create_refused(&p, -EOPNOTSUPP, "REQUIRE_DIRECT where O_DIRECT is refused");
	}
	p.flags = KVR_SPILL_BUFFERED;
	sp = create_ok(&p);
	cr_assert_eq(stats_of(sp).direct_io, 0);
	kvr_spill_destroy(sp);

	/* a missing directory */
	char missing[PATH_MAX + 32];
	snprintf(missing, sizeof(missing), "%s/not-there", dir);
	reason[0] = '\0';
	rc = kvr_spill_probe_dir(missing, &direct, &align, fs, sizeof(fs), &free_bytes, reason, sizeof(reason));
	cr_assert_eq(rc, -ENOENT, "probe of a missing directory: %d", rc);
	cr_assert_str_not_empty(reason);
	cr_assert_eq(direct, 0);
	th_dir_remove(dir);
}
