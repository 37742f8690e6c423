/* SPDX-License-Identifier: MIT */
/*
 * backend.c — the cudaemu devices: the cpu backend's memory, streams, events
 * and copies, with every kernel replaced by the CUDA kernel bodies of
 * the CUDA kernel files (gpu/cuda/cuda_{copy,score,attention}.cu) compiled for the CPU against the SIMT shim
 * (gpu/cudaemu/kernels.cc). Tests only: it is the way the CUDA kernels execute
 * on machines without a GPU, so the conformance suite can check them.
 *
 * A launch runs synchronously inside the stream operation, on whichever thread
 * runs the operation (the shim keeps its state per OS thread). A launch that
 * fails (a deadlocked barrier, a bad configuration) cannot fail the enqueue
 * that already returned: it is counted and its message kept for
 * kvr_cudaemu_failed_launches() / kvr_cudaemu_last_failure(), and its outputs
 * are whatever the kernel left, which the conformance checks then reject.
 *
 * cudaemu-strict (KVR_DEV_CUDAEMU_STRICT) is the same device holding runtime
 * code to a GPU's memory rules, which plain cudaemu cannot: its device memory
 * is host memory, so a host pointer handed to a kernel just works there and
 * faults on a GPU. The strict device says its memory is not host-visible (so
 * the runtime takes its GPU paths) and keeps a map of every device allocation
 * (its own, and the engine allocator's, which device.c reports through
 * track_alloc/track_free) and every kvr_dev_host_register range (mapped host
 * memory, which a GPU's kernels may read and write). Then:
 *  - a kernel's item array (and attention's segment array) must lie inside
 *    one device allocation, and every pointer in the items inside one device
 *    allocation or one registered host range, over exactly the extent the
 *    CUDA kernel indexes (check_items says how each extent is derived);
 *  - a copy's device side must lie inside one device allocation and its host
 *    side must not touch device memory, as its kind says.
 * A violation fails the call with -EFAULT and a message naming the operation,
 * the item or descriptor, the field and the address, and runs nothing.
 *
 * When the checks run: array placement and copies on the enqueueing thread,
 * before anything is queued. Item *contents* are read on the enqueueing thread
 * for an inline stream, where everything before the kernel has already run;
 * on a worker stream, or in a capture (gpu/cpu/cpu_backend.c: the kernel runs at
 * each launch of the graph), the items may still be on their way (an H2D copy
 * queued just ahead of the kernel fills them, as on a GPU), so reading them at
 * enqueue would judge what was there before the copy. There the contents (and
 * the arrays, again) are checked when the worker reaches the operation: a
 * violation then skips the kernel and is counted, with its message kept, for
 * kvr_cudaemu_strict_violations() / kvr_cudaemu_strict_last_violation(),
 * since the enqueue has already returned.
 *
 * Threads: the map is guarded by a rwlock (allocations, frees and
 * registrations write; every check reads, once per call). The counters are
 * process-wide, as the failed-launch counter is.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../layouts/summary.h"
#include "../cpu/cpu_backend.h"
#include "cudaemu.h"

/* The emulated launchers: the CUDA kernel files built with -DKVR_CUDAEMU
 * (kernels.cc), named kvr_emu_*. */
#define KVR_KERNEL_SYMBOL(name) kvr_emu_##name
#include "../kernel_launchers.h"

enum emu_kernel { EMU_SCATTER, EMU_OFFLOAD, EMU_SUMMARIZE, EMU_SCORE, EMU_SELECT, EMU_SIMILARITY,
		  EMU_ATTENTION, EMU_DENSE, EMU_FREELIST, EMU_PLAN, EMU_APPEND };

static const char *const kernel_names[] = { "scatter", "offload", "summarize", "score",
					    "select", "similarity", "attention", "dense",
					    "freelist", "plan", "append" };

/* What a capturing stream accepts, as on CUDA (kernels.h). */
static const int kernel_capturable[] = {
	KVR_CAPTURABLE_scatter,	   KVR_CAPTURABLE_offload,   KVR_CAPTURABLE_summarize, KVR_CAPTURABLE_score,
	KVR_CAPTURABLE_select,	   KVR_CAPTURABLE_similarity, KVR_CAPTURABLE_attention, KVR_CAPTURABLE_dense,
	KVR_CAPTURABLE_freelist,   KVR_CAPTURABLE_plan,	     KVR_CAPTURABLE_append,
};

static const size_t item_bytes[] = {
	sizeof(struct kvr_scatter_item), sizeof(struct kvr_page_item),
	sizeof(struct kvr_page_item),    sizeof(struct kvr_score_item),
	sizeof(struct kvr_score_item),   sizeof(struct kvr_similarity_item),
	sizeof(struct kvr_attention_item), sizeof(struct kvr_dense_item),
	sizeof(struct kvr_freelist_item), sizeof(struct kvr_plan_item),
	sizeof(struct kvr_append_item),
};

struct emu_op {
	struct kvr_shape shape;
	const void *items;
	uint32_t n;
	enum emu_kernel kernel;
	const struct kvr_kv_segment *segments;
	uint32_t n_segments;
	uint32_t check_when_run; /* cudaemu-strict on a worker stream or in a capture: check
				    before launching */
};

static _Atomic unsigned failed_launches; /* relaxed: statistics read by tests */
static _Atomic unsigned strict_violations;
static pthread_mutex_t message_lock = PTHREAD_MUTEX_INITIALIZER; /* guards both messages */
static char failure_message[256];
static char violation_message[256];

unsigned kvr_cudaemu_failed_launches(void)
{
	return atomic_load_explicit(&failed_launches, memory_order_relaxed);
}

void kvr_cudaemu_last_failure(char *buf, size_t bytes)
{
	pthread_mutex_lock(&message_lock);
	snprintf(buf, bytes, "%s", failure_message);
	pthread_mutex_unlock(&message_lock);
}

unsigned kvr_cudaemu_strict_violations(void)
{
	return atomic_load_explicit(&strict_violations, memory_order_relaxed);
}

void kvr_cudaemu_strict_last_violation(char *buf, size_t bytes)
{
	pthread_mutex_lock(&message_lock);
	snprintf(buf, bytes, "%s", violation_message);
	pthread_mutex_unlock(&message_lock);
}

/* Count a violation and keep its message (any thread). */
static void note_violation(const char *msg)
{
	atomic_fetch_add_explicit(&strict_violations, 1, memory_order_relaxed);
	pthread_mutex_lock(&message_lock);
	snprintf(violation_message, sizeof(violation_message), "%s", msg);
	pthread_mutex_unlock(&message_lock);
}

/* ------------------------------------------------------------ the map (strict) */

enum range_kind { RANGE_DEVICE, RANGE_HOST };

struct range {
	uintptr_t lo, hi; /* [lo, hi) */
	uint32_t kind;    /* enum range_kind */
};

/* Device ranges freed lately, only to say "freed" in a message. */
#define FREED_RANGES 64

struct strict_map {
	pthread_rwlock_t lock;
	struct range *r; /* sorted by lo, pairwise disjoint */
	size_t n, cap;
	struct range freed[FREED_RANGES];
	uint32_t freed_next;
};

static struct strict_map *map_of(const struct kvr_dev *dev)
{
	return (struct strict_map *)dev->strict;
}

/* Index of the first range starting above p. Caller holds the lock. */
static size_t map_upper(const struct strict_map *m, uintptr_t p)
{
	size_t lo = 0, hi = m->n;
	while (lo < hi) {
		const size_t mid = lo + (hi - lo) / 2;
		if (m->r[mid].lo <= p)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

/* The range holding address p, or NULL. Caller holds the lock. */
static const struct range *map_find(const struct strict_map *m, uintptr_t p)
{
	const size_t i = map_upper(m, p);
	return i > 0 && p < m->r[i - 1].hi ? &m->r[i - 1] : NULL;
}

/* Add [lo, hi): 0, -ENOMEM, or -EEXIST with *clash the range it overlaps.
 * Caller holds the lock for writing. */
static int map_insert(struct strict_map *m, uintptr_t lo, uintptr_t hi, uint32_t kind,
		      struct range *clash)
{
	const size_t i = map_upper(m, lo);
	if (i > 0 && m->r[i - 1].hi > lo) {
		*clash = m->r[i - 1];
		return -EEXIST;
	}
	if (i < m->n && m->r[i].lo < hi) {
		*clash = m->r[i];
		return -EEXIST;
	}
	if (m->n == m->cap) {
		const size_t cap = m->cap ? 2 * m->cap : 64;
		struct range *r = realloc(m->r, cap * sizeof(*r));
		if (!r)
			return -ENOMEM;
		m->r = r;
		m->cap = cap;
	}
	memmove(&m->r[i + 1], &m->r[i], (m->n - i) * sizeof(*m->r));
	m->r[i] = (struct range){ lo, hi, kind };
	m->n++;
	return 0;
}

/* Remove the range of `kind` starting exactly at lo: 0, or -ENOENT. Caller
 * holds the lock for writing. */
static int map_remove(struct strict_map *m, uintptr_t lo, uint32_t kind)
{
	const size_t i = map_upper(m, lo);
	if (i == 0 || m->r[i - 1].lo != lo || m->r[i - 1].kind != kind)
		return -ENOENT;
	if (kind == RANGE_DEVICE) {
		m->freed[m->freed_next] = m->r[i - 1];
		m->freed_next = (m->freed_next + 1) % FREED_RANGES;
	}
	memmove(&m->r[i - 1], &m->r[i], (m->n - i) * sizeof(*m->r));
	m->n--;
	return 0;
}

/* The most recently freed device range holding p, or NULL (messages only). */
static const struct range *map_freed(const struct strict_map *m, uintptr_t p)
{
	for (uint32_t k = 1; k <= FREED_RANGES; k++) {
		const struct range *f = &m->freed[(m->freed_next + FREED_RANGES - k) % FREED_RANGES];
		if (f->hi > f->lo && p >= f->lo && p < f->hi)
			return f;
	}
	return NULL;
}

static const char *range_name(uint32_t kind)
{
	return kind == RANGE_DEVICE ? "device allocation" : "registered host range";
}

/* ------------------------------------------------------------- checks (strict) */

/* One check in progress: the map (read-locked by the caller), the operation's
 * name for messages, and where a violation's message goes. */
struct check {
	const struct strict_map *map;
	const char *op;
	char msg[224];
	int item_struct; /* ITEM_<struct> of the kernel's items, -1: none */
};

/*
 * gpu/kernels.h declares every item pointer field once; this table, built
 * from that list, records which of them the extent checks below have named
 * (any device, any thread). test_cudaemu_strict runs one legal call of every
 * kernel and asks kvr_cudaemu_strict_unchecked_fields() for the rest: a
 * pointer field added to an item without a check here fails it.
 */
#define ITEM_INDEX(T) ITEM_##T,
enum { KVR_ITEM_STRUCTS(ITEM_INDEX) N_ITEM_STRUCTS };
#undef ITEM_INDEX
#define FIELD_NAME(f) #f,
#define STRUCT_FIELDS(T) { #T, (const char *const[]){ KVR_ITEM_POINTERS_##T(FIELD_NAME) NULL } },
static const struct {
	const char *name;
	const char *const *fields;
} item_pointers[N_ITEM_STRUCTS] = { KVR_ITEM_STRUCTS(STRUCT_FIELDS) };
#undef STRUCT_FIELDS
#undef FIELD_NAME
/* bit f: field f of the struct was named; relaxed (coverage bits only,
 * read by a test after its calls returned) */
static _Atomic uint32_t fields_checked[N_ITEM_STRUCTS];

static void note_checked(int item_struct, const char *field)
{
	if (item_struct < 0)
		return;
	const char *const *f = item_pointers[item_struct].fields;
	for (uint32_t i = 0; f[i]; i++)
		if (!strcmp(f[i], field)) {
			atomic_fetch_or_explicit(&fields_checked[item_struct], 1u << i, memory_order_relaxed);
			return;
		}
}

uint32_t kvr_cudaemu_strict_unchecked_fields(char *names, size_t bytes)
{
	uint32_t n = 0;
	size_t at = 0;
	if (bytes)
		names[0] = 0;
	for (int t = 0; t < N_ITEM_STRUCTS; t++) {
		const uint32_t got = atomic_load_explicit(&fields_checked[t], memory_order_relaxed);
		for (uint32_t i = 0; item_pointers[t].fields[i]; i++)
			if (!(got >> i & 1)) {
				n++;
				if (at < bytes)
					at += (size_t)snprintf(names + at, bytes - at, "%s%s.%s", n > 1 ? " " : "",
							       item_pointers[t].name, item_pointers[t].fields[i]);
			}
	}
	return n;
}

/* "<op>: <label> <index> <field>" or "<op>: <field>" when label is NULL. */
static int where(const struct check *c, char *buf, size_t bytes, const char *label, uint64_t index,
		 const char *field)
{
	if (label)
		return snprintf(buf, bytes, "%s: %s %" PRIu64 " %s", c->op, label, index, field);
	return snprintf(buf, bytes, "%s: %s", c->op, field);
}

/*
 * 0 when [p, p + bytes) lies inside one device allocation or, with
 * host_ok, one registered host range; otherwise -EFAULT with c->msg saying
 * which field, where, and what is wrong with it.
 */
static int check_range(struct check *c, const char *label, uint64_t index, const char *field,
		       uintptr_t p, uint64_t bytes, int host_ok)
{
	const struct range *r = map_find(c->map, p);
	const uintptr_t end = p + (uintptr_t)bytes;
	if (r && (host_ok || r->kind == RANGE_DEVICE) && end >= p && end <= r->hi)
		return 0;
	char at[96];
	where(c, at, sizeof(at), label, index, field);
	if (!r) {
		const struct range *f = map_freed(c->map, p);
		if (f)
			snprintf(c->msg, sizeof(c->msg),
				 "%s 0x%" PRIxPTR " (%" PRIu64 " bytes) points into freed device memory "
				 "(0x%" PRIxPTR ", %" PRIuPTR " bytes)",
				 at, p, bytes, f->lo, f->hi - f->lo);
		else
			snprintf(c->msg, sizeof(c->msg), "%s 0x%" PRIxPTR " (%" PRIu64 " bytes) is %s",
				 at, p, bytes,
				 host_ok ? "neither device memory nor registered host memory"
					 : "not device memory");
	} else if (r->kind != RANGE_DEVICE) {
		snprintf(c->msg, sizeof(c->msg),
			 "%s 0x%" PRIxPTR " (%" PRIu64 " bytes) is registered host memory, not device "
			 "memory",
			 at, p, bytes);
	} else {
		snprintf(c->msg, sizeof(c->msg),
			 "%s 0x%" PRIxPTR " (%" PRIu64 " bytes) runs past the end of its %s "
			 "(0x%" PRIxPTR ", %" PRIuPTR " bytes)",
			 at, p, bytes, range_name(r->kind), r->lo, r->hi - r->lo);
	}
	return -EFAULT;
}

/* 0 when no byte of [p, p + bytes) is device memory (a copy's host side). */
static int check_not_device(struct check *c, const char *label, uint64_t index,
			    const char *field, uintptr_t p, uint64_t bytes)
{
	const struct strict_map *m = c->map;
	const uintptr_t end = p + (uintptr_t)bytes < p ? UINTPTR_MAX : p + (uintptr_t)bytes;
	size_t i = map_upper(m, p);
	if (i > 0 && m->r[i - 1].hi > p)
		i--;
	for (; i < m->n && m->r[i].lo < end; i++) {
		if (m->r[i].kind != RANGE_DEVICE)
			continue;
		char at[96];
		where(c, at, sizeof(at), label, index, field);
		snprintf(c->msg, sizeof(c->msg),
			 "%s 0x%" PRIxPTR " (%" PRIu64 " bytes) is device memory (allocation "
			 "0x%" PRIxPTR ", %" PRIuPTR " bytes), not host memory",
			 at, p, bytes, m->r[i].lo, m->r[i].hi - m->r[i].lo);
		return -EFAULT;
	}
	return 0;
}

/* A kernel's data pointer: device memory or registered host memory, over the
 * `bytes` from `base + offset` the kernel touches (nothing when bytes is 0). */
static int check_data(struct check *c, const char *label, uint32_t index, const char *field,
		      const void *base, uint64_t offset, uint64_t bytes)
{
	note_checked(label && !strcmp(label, "segment") ? ITEM_kvr_kv_segment : c->item_struct, field);
	if (!bytes)
		return 0;
	return check_range(c, label, index, field, (uintptr_t)base + (uintptr_t)offset, bytes, 1);
}

/* The arrays a kernel reads its work from: device memory only. */
static int check_arrays(struct check *c, const struct emu_op *op)
{
	int err = check_range(c, NULL, 0, "items", (uintptr_t)op->items,
			      (uint64_t)op->n * item_bytes[op->kernel], 0);
	if (!err && op->kernel == EMU_ATTENTION && op->n_segments)
		err = check_range(c, NULL, 0, "segments", (uintptr_t)op->segments,
				  (uint64_t)op->n_segments * sizeof(struct kvr_kv_segment), 0);
	return err;
}

/*
 * The pointers inside the items, each over the extent the CUDA kernel
 * (gpu/cuda/cuda_*.cu) indexes, in bytes (eb per element; d, p, n_kv, n_qo
 * from the shape). Fields a kernel does not touch are not looked at, so they
 * may be NULL or anything.
 *  scatter    (an item with kv_head >= n_kv is skipped whole by the kernel)
 *             run 2·p·d; k_tile and v_tile from kv_head·d: p rows n_kv·d
 *             apart, (p-1)·n_kv·d + d.
 *  offload    k_rows and v_rows: p rows row_stride apart of n_kv·d,
 *             (p-1)·row_stride + n_kv·d; hnd_page n_kv·2·p·d, or with a
 *             quantised format n_kv runs of kvr_kv_run_bytes.
 *  summarize  k_rows as offload; summary n_kv·2·d.
 *  append     (an item with row >= p is skipped whole by the kernel)
 *             k_row and v_row n_kv·d; k_tile and v_tile the row written,
 *             to row·row_stride + n_kv·d, and with hnd_page the whole tile
 *             read as offload's k_rows and v_rows, hnd_page as offload's,
 *             summary (when not NULL) as summarize's.
 *  score      nothing when cand_end <= cand_begin; else q n_qo·d; summaries
 *             of the softmax domain (kvr_score_domain), from dom_begin·n_kv·2·d,
 *             n_dom·n_kv·2·d; scores n_kv·n_cand floats.
 *  select     nothing when k = 0; else scores n_kv·n_cand floats (n_cand
 *             may be 0) and selected n_kv·k int32s.
 *             Both: gate n_kv bytes when not NULL.
 *  similarity q and q_prev n_qo·d; cosine n_kv floats; corrected n_kv bytes.
 *  plan       q_from and q_to q_bytes each when q_to is not NULL;
 *             attention one item; segments n_head + k + n_tail segments;
 *             with k > 0, selected k int32s, corrected_sel likewise and
 *             corrected one byte when not NULL, page_addr addr_end uint64s;
 *             with slot_page (k at most KVR_PLAN_MAX_K), recall_count two
 *             uint32s, and with k > 0 slot_page k int32s and scatter k
 *             scatter items in device memory (an item array).
 *  attention  q and out n_qo·d (read and written even with no tokens);
 *             with KVR_SHAPE_SEGMENT_LSE, segment_lse n_qo·n_segments floats; the
 *             item's segments [first_segment, +n_segments) must be in the
 *             call's list (the kernel does not bound them); a segment with
 *             tokens: k and v each (n_kv-1)·head_stride + (n_tokens-1)·
 *             row_stride + d from the pointer; a quantised one: k only,
 *             (n_kv-1)·head_stride + one run's bytes (kvquant.h), exactly.
 *  dense      q and out n_qo·d; with tokens, k and v each (n_tokens-1)·
 *             row_stride + n_kv·d.
 *  freelist   counts n_units uint32s, offsets n_units uint64s, counters two
 *             uint64s, status one int32; ids capacity uint32s and pages
 *             pages_capacity uint32s (the round may touch any of them).
 */
static int check_items(struct check *c, const struct emu_op *op)
{
	const struct kvr_shape *sh = &op->shape;
	const uint64_t eb = kvr_elem_bytes(sh->elem_type), d = sh->head_dim, p = sh->page_tokens;
	const uint64_t n_kv = sh->n_kv_heads, n_qo = sh->n_qo_heads;
	const uint64_t q_bytes = n_qo * d * eb;
	const int estimates = (sh->flags & KVR_SHAPE_ESTIMATES) != 0;
	const uint64_t summary = kvr_summary_page_elems((uint32_t)n_kv, (uint32_t)d, estimates) * eb;
	int err = 0;
	static const int item_struct_of[] = {
		[EMU_SCATTER] = ITEM_kvr_scatter_item,       [EMU_OFFLOAD] = ITEM_kvr_page_item,
		[EMU_SUMMARIZE] = ITEM_kvr_page_item,        [EMU_SCORE] = ITEM_kvr_score_item,
		[EMU_SELECT] = ITEM_kvr_score_item,          [EMU_SIMILARITY] = ITEM_kvr_similarity_item,
		[EMU_ATTENTION] = ITEM_kvr_attention_item,   [EMU_DENSE] = ITEM_kvr_dense_item,
		[EMU_FREELIST] = ITEM_kvr_freelist_item,     [EMU_PLAN] = ITEM_kvr_plan_item,
		[EMU_APPEND] = ITEM_kvr_append_item,
	};
	c->item_struct = item_struct_of[op->kernel];
	switch (op->kernel) {
	case EMU_SCATTER: {
		const struct kvr_scatter_item *it = op->items;
		const uint64_t column = ((p - 1) * n_kv * d + d) * eb;
		for (uint32_t i = 0; i < op->n && !err; i++) {
			if (it[i].kv_head >= n_kv)
				continue;
			const uint64_t col = (uint64_t)it[i].kv_head * d * eb;
			if (!(err = check_data(c, "item", i, "run", it[i].run, 0, 2 * p * d * eb)) &&
			    !(err = check_data(c, "item", i, "k_tile", it[i].k_tile, col, column)))
				err = check_data(c, "item", i, "v_tile", it[i].v_tile, col, column);
		}
		break;
	}
	case EMU_OFFLOAD:
	case EMU_SUMMARIZE: {
		const struct kvr_page_item *it = op->items;
		for (uint32_t i = 0; i < op->n && !err; i++) {
			const uint64_t rows = ((p - 1) * it[i].row_stride + n_kv * d) * eb;
			if ((err = check_data(c, "item", i, "k_rows", it[i].k_rows, 0, rows)))
				break;
			if (op->kernel == EMU_SUMMARIZE) {
				err = check_data(c, "item", i, "summary", it[i].summary, 0, summary);
				if (!err && estimates) /* the estimate rows' values */
					err = check_data(c, "item", i, "v_rows", it[i].v_rows, 0, rows);
			} else if (!(err = check_data(c, "item", i, "v_rows", it[i].v_rows, 0, rows))) {
				/* quantised: n_kv runs (nothing for a format the shape cannot hold) */
				err = check_data(c, "item", i, "hnd_page", it[i].hnd_page, 0,
						 it[i].format ? n_kv * kvr_kv_run_bytes(it[i].format, (uint32_t)p,
											  (uint32_t)d, (uint32_t)eb)
							      : n_kv * 2 * p * d * eb);
			}
		}
		break;
	}
	case EMU_APPEND: {
		const struct kvr_append_item *it = op->items;
		const uint64_t row = n_kv * d * eb;
		for (uint32_t i = 0; i < op->n && !err; i++) {
			if (it[i].row >= p)
				continue;
			const uint64_t tile = it[i].hnd_page ? ((p - 1) * it[i].row_stride) * eb + row
							     : (uint64_t)it[i].row * it[i].row_stride * eb + row;
			if ((err = check_data(c, "item", i, "k_row", it[i].k_row, 0, row)) ||
			    (err = check_data(c, "item", i, "v_row", it[i].v_row, 0, row)) ||
			    (err = check_data(c, "item", i, "k_tile", it[i].k_tile, 0, tile)) ||
			    (err = check_data(c, "item", i, "v_tile", it[i].v_tile, 0, tile)))
				break;
			if (!it[i].hnd_page) {
				check_data(c, "item", i, "hnd_page", NULL, 0, 0);
				check_data(c, "item", i, "summary", NULL, 0, 0);
				continue;
			}
			err = check_data(c, "item", i, "hnd_page", it[i].hnd_page, 0,
					 it[i].format ? n_kv * kvr_kv_run_bytes(it[i].format, (uint32_t)p,
										  (uint32_t)d, (uint32_t)eb)
						      : n_kv * 2 * p * d * eb);
			if (!err)
				err = check_data(c, "item", i, "summary", it[i].summary, 0,
						 it[i].summary ? summary : 0);
		}
		break;
	}
	case EMU_SCORE:
	case EMU_SELECT: {
		const struct kvr_score_item *it = op->items;
		const uint64_t page = summary;
		for (uint32_t i = 0; i < op->n && !err; i++) {
			const uint64_t n_cand =
				it[i].cand_end > it[i].cand_begin ? it[i].cand_end - it[i].cand_begin : 0;
			/* the gate is read first (the rest is checked either way) */
			if (it[i].gate && (err = check_data(c, "item", i, "gate", it[i].gate, 0, n_kv)))
				break;
			if (op->kernel == EMU_SCORE) {
				if (!n_cand)
					continue;
				uint32_t dom_begin, dom_end;
				kvr_score_domain(&it[i], &dom_begin, &dom_end);
				if (!(err = check_data(c, "item", i, "q", it[i].q, 0, q_bytes)) &&
				    !(err = check_data(c, "item", i, "summaries", it[i].summaries,
						       dom_begin * page,
						       (uint64_t)(dom_end - dom_begin) * page)))
					err = check_data(c, "item", i, "scores", it[i].scores, 0,
							 n_kv * n_cand * sizeof(float));
			} else {
				if (!it[i].k)
					continue;
				if (!(err = check_data(c, "item", i, "scores", it[i].scores, 0,
						       n_kv * n_cand * sizeof(float))))
					err = check_data(c, "item", i, "selected", it[i].selected, 0,
							 n_kv * it[i].k * sizeof(int32_t));
			}
		}
		break;
	}
	case EMU_SIMILARITY: {
		const struct kvr_similarity_item *it = op->items;
		for (uint32_t i = 0; i < op->n && !err; i++)
			if (!(err = check_data(c, "item", i, "q", it[i].q, 0, q_bytes)) &&
			    !(err = check_data(c, "item", i, "q_prev", it[i].q_prev, 0, q_bytes)) &&
			    !(err = check_data(c, "item", i, "cosine", it[i].cosine, 0,
					       n_kv * sizeof(float))))
				err = check_data(c, "item", i, "corrected", it[i].corrected, 0, n_kv);
		break;
	}
	case EMU_ATTENTION: {
		const struct kvr_attention_item *it = op->items;
		for (uint32_t i = 0; i < op->n && !err; i++) {
			if ((err = check_data(c, "item", i, "q", it[i].q, 0, q_bytes)) ||
			    (err = check_data(c, "item", i, "out", it[i].out, 0, q_bytes)))
				break;
			if (!it[i].n_segments)
				continue;
			if ((sh->flags & KVR_SHAPE_SEGMENT_LSE) && it[i].segment_lse &&
			    (err = check_data(c, "item", i, "segment_lse", it[i].segment_lse, 0,
					      n_qo * it[i].n_segments * sizeof(float))))
				break;
			const uint64_t first = it[i].first_segment, last = first + it[i].n_segments;
			if (last > op->n_segments) {
				snprintf(c->msg, sizeof(c->msg),
					 "%s: item %" PRIu32 " segments [%" PRIu64 ", %" PRIu64
					 ") run past the call's %" PRIu32 " segments",
					 c->op, i, first, last, op->n_segments);
				err = -EFAULT;
				break;
			}
			for (uint64_t j = first; j < last && !err; j++) {
				const struct kvr_kv_segment *s = &op->segments[j];
				if (!s->n_tokens)
					continue;
				if (kvr_segment_quantised(s->format)) { /* n_kv runs from k, head_stride bytes apart */
					struct kvr_quant_geometry g;
					if (kvr_quant_geometry_init(&g, (uint32_t)p, (uint32_t)d, 1, s->format)) {
						snprintf(c->msg, sizeof(c->msg),
							 "%s: segment %" PRIu64 " has unknown format %" PRIu32,
							 c->op, j, s->format);
						err = -EFAULT;
						break;
					}
					err = check_data(c, "segment", (uint32_t)j, "k", s->k, 0,
							 (n_kv - 1) * s->head_stride + g.head_bytes);
					continue;
				}
				const uint64_t span = ((n_kv - 1) * s->head_stride +
						       (uint64_t)(s->n_tokens - 1) * s->row_stride + d) *
						      eb;
				if (!(err = check_data(c, "segment", (uint32_t)j, "k", s->k, 0, span)))
					err = check_data(c, "segment", (uint32_t)j, "v", s->v, 0, span);
			}
		}
		break;
	}
	case EMU_PLAN: {
		const struct kvr_plan_item *it = op->items;
		for (uint32_t i = 0; i < op->n && !err; i++) {
			/* segments NULL: a prefetch, no attention item either */
			const uint64_t list =
				it[i].segments ? (uint64_t)it[i].n_head + it[i].k + it[i].n_tail : 0;
			const uint64_t kept_q = it[i].q_to ? it[i].q_bytes : 0; /* the previous query's rows */
			if ((err = check_data(c, "item", i, "q_from", it[i].q_from, 0, kept_q)) ||
			    (err = check_data(c, "item", i, "q_to", it[i].q_to, 0, kept_q)) ||
			    (err = check_data(c, "item", i, "attention", it[i].attention, 0,
					      it[i].segments ? sizeof(struct kvr_attention_item) : 0)) ||
			    (err = check_data(c, "item", i, "segments", it[i].segments, 0,
					      list * sizeof(struct kvr_kv_segment))))
				break;
			if (!it[i].segments && !it[i].slot_page) {
				snprintf(c->msg, sizeof(c->msg), "%s: item %" PRIu32 " has neither segments nor slots",
					 c->op, i);
				err = -EFAULT;
				break;
			}
			if (it[i].slot_page && it[i].k > KVR_PLAN_MAX_K) {
				snprintf(c->msg, sizeof(c->msg), "%s: item %" PRIu32 " plans %" PRIu32
					 " slots, more than KVR_PLAN_MAX_K (%u)", c->op, i, it[i].k, KVR_PLAN_MAX_K);
				err = -EFAULT;
				break;
			}
			if (it[i].slot_page &&
			    (err = check_data(c, "item", i, "recall_count", it[i].recall_count, 0, 8)))
				break;
			if (!it[i].k)
				continue;
			if ((err = check_data(c, "item", i, "selected", it[i].selected, 0,
					      (uint64_t)it[i].k * 4)) ||
			    (it[i].corrected_sel &&
			     (err = check_data(c, "item", i, "corrected_sel", it[i].corrected_sel, 0,
					       (uint64_t)it[i].k * 4))) ||
			    (it[i].corrected &&
			     (err = check_data(c, "item", i, "corrected", it[i].corrected, 0, 1))))
				break;
			/* any page below addr_end may be named */
			if ((err = check_data(c, "item", i, "page_addr", it[i].page_addr, 0,
					      (uint64_t)it[i].addr_end * 8)))
				break;
			/* streamed: the slot table, the scatter items (an item array
			 * of the scatter that follows: device memory only), the
			 * counts; slot_k and slot_v are only computed with (the
			 * scatter and the attention check what they point at) */
			check_data(c, "item", i, "slot_k", it[i].slot_k, 0, 0);
			check_data(c, "item", i, "slot_v", it[i].slot_v, 0, 0);
			if (!it[i].slot_page) {
				check_data(c, "item", i, "scatter", NULL, 0, 0);
				check_data(c, "item", i, "recall_count", NULL, 0, 0);
				check_data(c, "item", i, "slot_page", NULL, 0, 0);
				continue;
			}
			if ((err = check_data(c, "item", i, "slot_page", it[i].slot_page, 0, (uint64_t)it[i].k * 4)))
				break;
			note_checked(ITEM_kvr_plan_item, "scatter");
			err = check_range(c, "item", i, "scatter", (uintptr_t)it[i].scatter,
					  (uint64_t)it[i].k * sizeof(struct kvr_scatter_item), 0);
		}
		break;
	}
	case EMU_FREELIST: {
		const struct kvr_freelist_item *it = op->items;
		for (uint32_t i = 0; i < op->n && !err; i++) {
			const uint64_t units = it[i].n_units;
			if (!(err = check_data(c, "item", i, "counts", it[i].counts, 0, units * 4)) &&
			    !(err = check_data(c, "item", i, "offsets", it[i].offsets, 0, units * 8)) &&
			    !(err = check_data(c, "item", i, "counters", it[i].counters, 0, 16)) &&
			    !(err = check_data(c, "item", i, "status", it[i].status, 0, 4)) &&
			    !(err = check_data(c, "item", i, "ids", it[i].ids, 0, (uint64_t)it[i].capacity * 4)))
				err = check_data(c, "item", i, "pages", it[i].pages, 0,
						 (uint64_t)it[i].pages_capacity * 4);
		}
		break;
	}
	case EMU_DENSE: {
		const struct kvr_dense_item *it = op->items;
		for (uint32_t i = 0; i < op->n && !err; i++) {
			if ((err = check_data(c, "item", i, "q", it[i].q, 0, q_bytes)) ||
			    (err = check_data(c, "item", i, "out", it[i].out, 0, q_bytes)))
				break;
			if (!it[i].n_tokens)
				continue;
			const uint64_t span =
				((uint64_t)(it[i].n_tokens - 1) * it[i].row_stride + n_kv * d) * eb;
			if (!(err = check_data(c, "item", i, "k", it[i].k, 0, span)))
				err = check_data(c, "item", i, "v", it[i].v, 0, span);
		}
		break;
	}
	}
	return err;
}

/* ------------------------------------------------------------------ launches */

static void run_emu(struct kvr_dev *dev, void *ctx)
{
	const struct emu_op *op = ctx;
	const struct kvr_shape *sh = &op->shape;
	if (op->check_when_run) {
		/* cudaemu-strict, worker stream: the items are final only now */
		struct check c = { map_of(dev), kernel_names[op->kernel], "", -1 };
		pthread_rwlock_rdlock(&map_of(dev)->lock);
		int err = check_arrays(&c, op);
		if (!err)
			err = check_items(&c, op);
		pthread_rwlock_unlock(&map_of(dev)->lock);
		if (err) {
			char msg[256];
			snprintf(msg, sizeof(msg), "%s (worker stream: not run)", c.msg);
			note_violation(msg);
			return;
		}
	}
	int rc = 0;
	switch (op->kernel) {
#define LAUNCH_ITEMS(id, name)                                                                 \
	case id:                                                                               \
		rc = kvr_emu_launch_##name(sh, op->items, op->n, NULL);                        \
		break;
		LAUNCH_ITEMS(EMU_SCATTER, scatter)
		LAUNCH_ITEMS(EMU_OFFLOAD, offload)
		LAUNCH_ITEMS(EMU_SUMMARIZE, summarize)
		LAUNCH_ITEMS(EMU_SCORE, score)
		LAUNCH_ITEMS(EMU_SELECT, select)
		LAUNCH_ITEMS(EMU_SIMILARITY, similarity)
		LAUNCH_ITEMS(EMU_DENSE, dense)
		LAUNCH_ITEMS(EMU_PLAN, plan)
		LAUNCH_ITEMS(EMU_APPEND, append)
#undef LAUNCH_ITEMS
	case EMU_ATTENTION:
		rc = kvr_emu_launch_attention(sh, op->items, op->n, op->segments, op->n_segments, NULL);
		break;
	case EMU_FREELIST:
		rc = kvr_emu_launch_freelist(op->items, op->n, NULL);
		break;
	}
	if (rc) {
		atomic_fetch_add_explicit(&failed_launches, 1, memory_order_relaxed);
		pthread_mutex_lock(&message_lock);
		snprintf(failure_message, sizeof(failure_message), "kernel %d: %s (%d)", op->kernel,
			 kvr_emu_last_message(), rc);
		pthread_mutex_unlock(&message_lock);
	}
}

/* A refused operation: counted, and the caller's error. */
static int violation(struct kvr_dev *dev, const char *msg)
{
	note_violation(msg);
	return kvr_dev_fail(dev, -EFAULT, "%s", msg);
}

static int enqueue(struct kvr_dev *dev, struct kvr_stream *s, const struct kvr_shape *shape,
		   const void *items, uint32_t n, enum emu_kernel kernel,
		   const struct kvr_kv_segment *segments, uint32_t n_segments)
{
	struct emu_op op = { *shape, items, n, kernel, segments, n_segments, 0 };
	const int refused = kvr_cpu_capture_refuses(dev, s, kernel_names[kernel], kernel_capturable[kernel]);
	if (refused)
		return refused;
	struct strict_map *m = map_of(dev);
	if (m) {
		const int when_run = kvr_cpu_stream_runs_later(s);
		struct check c = { m, kernel_names[kernel], "", -1 };
		pthread_rwlock_rdlock(&m->lock);
		int err = check_arrays(&c, &op);
		if (!err && !when_run)
			err = check_items(&c, &op);
		pthread_rwlock_unlock(&m->lock);
		if (err)
			return violation(dev, c.msg);
		op.check_when_run = (uint32_t)when_run;
	}
	return kvr_cpu_enqueue(dev, s, run_emu, &op, sizeof(op));
}

#define EMU_KERNEL(name, item_type, id)                                                         \
	static int emu_##name(struct kvr_dev *dev, const struct kvr_shape *shape,               \
			      const item_type *items, uint32_t n, struct kvr_stream *s)          \
	{                                                                                       \
		return enqueue(dev, s, shape, items, n, id, NULL, 0);                           \
	}

EMU_KERNEL(scatter, struct kvr_scatter_item, EMU_SCATTER)
EMU_KERNEL(offload, struct kvr_page_item, EMU_OFFLOAD)
EMU_KERNEL(summarize, struct kvr_page_item, EMU_SUMMARIZE)
EMU_KERNEL(score, struct kvr_score_item, EMU_SCORE)
EMU_KERNEL(select, struct kvr_score_item, EMU_SELECT)
EMU_KERNEL(similarity, struct kvr_similarity_item, EMU_SIMILARITY)
EMU_KERNEL(dense, struct kvr_dense_item, EMU_DENSE)
EMU_KERNEL(plan, struct kvr_plan_item, EMU_PLAN)
EMU_KERNEL(append, struct kvr_append_item, EMU_APPEND)

static int emu_freelist(struct kvr_dev *dev, const struct kvr_freelist_item *items, uint32_t n,
			struct kvr_stream *s)
{
	const struct kvr_shape none = { 0 }; /* the kernel takes no shape */
	return enqueue(dev, s, &none, items, n, EMU_FREELIST, NULL, 0);
}

static int emu_attention(struct kvr_dev *dev, const struct kvr_shape *shape,
			 const struct kvr_attention_item *items, uint32_t n,
			 const struct kvr_kv_segment *segments, uint32_t n_segments,
			 struct kvr_stream *s)
{
	return enqueue(dev, s, shape, items, n, EMU_ATTENTION, segments, n_segments);
}

/* ------------------------------------------------------------ memory (strict) */

/* Map [ptr, ptr + bytes) as `kind`; the caller's op names the message. */
static int track(struct kvr_dev *dev, void *ptr, size_t bytes, uint32_t kind, const char *op)
{
	struct strict_map *m = map_of(dev);
	const uintptr_t lo = (uintptr_t)ptr;
	if (lo + bytes < lo)
		return kvr_dev_fail(dev, -EINVAL, "%s: %p + %zu bytes wraps around", op, ptr, bytes);
	struct range clash = { 0, 0, 0 };
	pthread_rwlock_wrlock(&m->lock);
	const int err = map_insert(m, lo, lo + bytes, kind, &clash);
	pthread_rwlock_unlock(&m->lock);
	if (err == -ENOMEM)
		return kvr_dev_fail(dev, -ENOMEM, "%s: out of memory for the strict device's map", op);
	if (!err)
		return 0;
	if (kind == RANGE_HOST)
		/* as cudaHostRegister: twice is "already registered"; device memory
		 * cannot be registered at all */
		return kvr_dev_fail(dev, clash.kind == RANGE_HOST ? -EEXIST : -EINVAL,
				    "%s(%p, %zu bytes): overlaps the %s 0x%" PRIxPTR " (%" PRIuPTR
				    " bytes)",
				    op, ptr, bytes, range_name(clash.kind), clash.lo,
				    clash.hi - clash.lo);
	/* new device memory overlapping a mapped range: that range's memory went
	 * back to the allocator without kvr_dev_free / kvr_dev_host_unregister */
	char msg[256];
	snprintf(msg, sizeof(msg),
		 "%s: new device memory %p (%zu bytes) overlaps the %s 0x%" PRIxPTR " (%" PRIuPTR
		 " bytes), still mapped: freed behind the device's back?",
		 op, ptr, bytes, range_name(clash.kind), clash.lo, clash.hi - clash.lo);
	return violation(dev, msg);
}

/* Unmap the range of `kind` starting at ptr: 0, or -ENOENT. */
static int untrack(struct kvr_dev *dev, void *ptr, uint32_t kind)
{
	struct strict_map *m = map_of(dev);
	pthread_rwlock_wrlock(&m->lock);
	const int err = map_remove(m, (uintptr_t)ptr, kind);
	pthread_rwlock_unlock(&m->lock);
	return err;
}

static int strict_alloc(struct kvr_dev *dev, size_t bytes, void **ptr)
{
	int err = kvr_cpu_ops()->alloc(dev, bytes, ptr);
	if (err)
		return err;
	/* the bytes asked for, not the cpu allocator's rounding: a kernel
	 * reading past them is a bug even where the allocator left room */
	if ((err = track(dev, *ptr, bytes, RANGE_DEVICE, "alloc"))) {
		kvr_cpu_ops()->free(dev, *ptr);
		*ptr = NULL;
	}
	return err;
}

/* A pointer that is not a live device allocation is not freed (a double
 * free would corrupt the heap) but counted. */
static void strict_free(struct kvr_dev *dev, void *ptr)
{
	if (!untrack(dev, ptr, RANGE_DEVICE)) {
		kvr_cpu_ops()->free(dev, ptr);
		return;
	}
	char msg[256];
	snprintf(msg, sizeof(msg), "free: %p is not a device allocation of this device (not freed)",
		 ptr);
	note_violation(msg);
}

static int strict_track_alloc(struct kvr_dev *dev, void *ptr, size_t bytes)
{
	return track(dev, ptr, bytes, RANGE_DEVICE, "alloc (engine allocator)");
}

static void strict_track_free(struct kvr_dev *dev, void *ptr)
{
	if (!untrack(dev, ptr, RANGE_DEVICE))
		return;
	char msg[256];
	snprintf(msg, sizeof(msg),
		 "free (engine allocator): %p is not a device allocation of this device", ptr);
	note_violation(msg);
}

static int strict_host_register(struct kvr_dev *dev, void *ptr, size_t bytes)
{
	return track(dev, ptr, bytes, RANGE_HOST, "host_register");
}

static int strict_host_unregister(struct kvr_dev *dev, void *ptr)
{
	if (untrack(dev, ptr, RANGE_HOST))
		return kvr_dev_fail(dev, -EINVAL, "host_unregister(%p): not registered", ptr);
	return 0;
}

/* ------------------------------------------------------------ copies (strict) */

static const char *const copy_kind_names[] = { "H2D", "D2H", "D2D" };

/* One copy's two sides against its kind; index is the descriptor's (or
 * label NULL for a single copy). */
static int check_copy(struct check *c, const char *label, uint64_t index, uintptr_t dst,
		      uintptr_t src, uint64_t bytes, uint32_t kind)
{
	int err;
	switch (kind) {
	case KVR_COPY_H2D:
		if (!(err = check_range(c, label, index, "dst", dst, bytes, 0)))
			err = check_not_device(c, label, index, "src", src, bytes);
		break;
	case KVR_COPY_D2H:
		if (!(err = check_range(c, label, index, "src", src, bytes, 0)))
			err = check_not_device(c, label, index, "dst", dst, bytes);
		break;
	default:
		if (!(err = check_range(c, label, index, "dst", dst, bytes, 0)))
			err = check_range(c, label, index, "src", src, bytes, 0);
		break;
	}
	return err;
}

static int strict_memcpy_async(struct kvr_dev *dev, void *dst, const void *src, size_t bytes,
			       uint32_t kind, struct kvr_stream *s)
{
	struct strict_map *m = map_of(dev);
	char op[48];
	snprintf(op, sizeof(op), "memcpy_async (%s)", copy_kind_names[kind]);
	struct check c = { m, op, "", -1 };
	/* captured: the host side pinned (registered), as a GPU's graph copy
	 * node wants it; a pageable copy stages through the host when it is
	 * enqueued, which a replay cannot repeat */
	const int captured = kind != KVR_COPY_D2D && kvr_dev_stream_capturing(dev, s) == 1;
	pthread_rwlock_rdlock(&m->lock);
	int err = check_copy(&c, NULL, 0, (uintptr_t)dst, (uintptr_t)src, bytes, kind);
	if (!err && captured)
		err = kind == KVR_COPY_H2D ? check_range(&c, "captured", 0, "src", (uintptr_t)src, bytes, 1)
					   : check_range(&c, "captured", 0, "dst", (uintptr_t)dst, bytes, 1);
	pthread_rwlock_unlock(&m->lock);
	if (err)
		return violation(dev, c.msg);
	return kvr_cpu_ops()->memcpy_async(dev, dst, src, bytes, kind, s);
}

static int strict_memcpy_batch_async(struct kvr_dev *dev, void *dst_base, const void *src_base,
				     const struct kvr_copy_desc *descs, size_t n, uint32_t kind,
				     struct kvr_stream *s)
{
	struct strict_map *m = map_of(dev);
	char op[48];
	snprintf(op, sizeof(op), "memcpy_batch_async (%s)", copy_kind_names[kind]);
	struct check c = { m, op, "", -1 };
	int err = 0;
	pthread_rwlock_rdlock(&m->lock);
	for (size_t i = 0; i < n && !err; i++)
		if (descs[i].bytes) /* an empty copy touches nothing (cuda skips it) */
			err = check_copy(&c, "descriptor", i,
					 (uintptr_t)dst_base + (uintptr_t)descs[i].dst_offset,
					 (uintptr_t)src_base + (uintptr_t)descs[i].src_offset,
					 descs[i].bytes, kind);
	pthread_rwlock_unlock(&m->lock);
	if (err)
		return violation(dev, c.msg);
	return kvr_cpu_ops()->memcpy_batch_async(dev, dst_base, src_base, descs, n, kind, s);
}

/* ------------------------------------------------------------------ devices */

static void strict_destroy(struct kvr_dev *dev)
{
	struct strict_map *m = map_of(dev);
	pthread_rwlock_destroy(&m->lock);
	free(m->r);
	free(m);
	dev->strict = NULL;
	kvr_cpu_ops()->destroy(dev);
}

static struct kvr_dev_ops emu_ops, strict_ops;
static pthread_once_t emu_ops_once = PTHREAD_ONCE_INIT;

static void emu_ops_init(void)
{
	emu_ops = *kvr_cpu_ops();
	emu_ops.name = "cudaemu";
#define SET_KERNEL_OP(name) emu_ops.name = emu_##name;
	KVR_DEV_KERNEL_OPS(SET_KERNEL_OP)
#undef SET_KERNEL_OP

	/* the kernels check themselves when dev->strict is set (enqueue) */
	strict_ops = emu_ops;
	strict_ops.name = "cudaemu-strict";
	strict_ops.destroy = strict_destroy;
#define STRICT_OP(name) strict_ops.name = strict_##name;
	KVR_DEV_MEMORY_OPS(STRICT_OP)
#undef STRICT_OP
	strict_ops.memcpy_async = strict_memcpy_async;
	strict_ops.memcpy_batch_async = strict_memcpy_batch_async;
	strict_ops.track_alloc = strict_track_alloc;
	strict_ops.track_free = strict_track_free;
}

/* Overrides the library's weak constructor when this file is linked; serves
 * both KVR_DEV_CUDAEMU and KVR_DEV_CUDAEMU_STRICT (params->kind). */
int kvr_cudaemu_dev_init(struct kvr_dev *dev, const struct kvr_dev_params *params, char *err,
			 size_t err_bytes)
{
	int ret = kvr_cpu_dev_init(dev, params, err, err_bytes);
	if (ret)
		return ret;
	pthread_once(&emu_ops_once, emu_ops_init);
	if (params->kind != KVR_DEV_CUDAEMU_STRICT) {
		dev->ops = &emu_ops;
		return 0;
	}
	struct strict_map *m = calloc(1, sizeof(*m));
	if (!m || pthread_rwlock_init(&m->lock, NULL)) {
		free(m);
		kvr_cpu_ops()->destroy(dev);
		snprintf(err, err_bytes, "cudaemu-strict: cannot create the memory map");
		return -ENOMEM;
	}
	dev->ops = &strict_ops;
	dev->strict = m;
	dev->host_visible = 0; /* as on a GPU: the runtime must not touch device memory */
	return 0;
}
