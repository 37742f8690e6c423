/* SPDX-License-Identifier: MIT */
/*
 * kernels.h — what each device kernel computes, and its arguments. Shared by
 * the cpu backend (C), the CUDA kernels (nvcc) and cudaemu (host C++): plain
 * structs of fixed-width fields and pointers, checked equal under both
 * compilers by tests/test_layout_abi.c.
 *
 * Every kernel is batched: it takes an array of items (one per sequence, or
 * per page) that lives in device memory, as do all the pointers inside the
 * items (on the cpu backend, device memory is host memory). Element types are
 * enum kvr_elem_type; q, k, v, outputs and summaries share one type per call.
 *
 * Semantics (the conformance suite's reference implements exactly this):
 *
 * scatter      For each item, copy one KV head's HND run (2·p·d elements: p
 *              key rows then p value rows) into column kv_head of an NHD tile
 *              pair (p rows of n_kv·d elements each for K and for V).
 * offload      For each item, NHD rows (row t of keys at k_rows + t·row_stride
 *              elements, holding n_kv heads of d) -> one HND page; with a
 *              quantised format, KV head m's run quantised
 *              (kvr_quant_run_from_nhd, all p tokens) at m · its run bytes:
 *              the bits the host pool writes for the same rows.
 * summarize    For each item, the key summary of those rows: [n_kv][2][d],
 *              element-wise min then max over the p keys; NaN propagates.
 *              With KVR_SHAPE_ESTIMATES also the estimate rows after them,
 *              [n_kv][2][d]: the mean key, then the mean value (v_rows),
 *              each column summed in fp32 in token order from token 0 and
 *              divided by p (layouts/summary.h).
 * score        For each item (a sequence) and KV head m, for each page j of
 *              the softmax domain [dom_begin, dom_end) — every page [0,
 *              norm_end) when norm_end > 0 (FreeKV's P^h: sink, candidates
 *              and the window's complete pages), the candidates [cand_begin,
 *              cand_end) when norm_end = 0; dom_end is at least cand_end —
 *              per query head h of m's group, s_hj = scale · Σ_c
 *              q_hc·(sign bit of q_hc set ? min_jc : max_jc), each term
 *              added by one fused multiply-add (kvr_quest_acc; the sum in
 *              the canonical 16-lane order, kmath.h); softmax over the domain per h (max, kvr_expf,
 *              sum in the canonical 256-lane order counted from dom_begin);
 *              then, for each candidate j only, the mean over the group:
 *              score_mj = (Σ_g e_hj·(1/sum_h)) · (1/G), g in order. Written
 *              to scores[m·n_cand + (j - cand_begin)].
 * select       For each item and KV head m: the min(k, n_cand) candidates
 *              with the highest score, ties to the lower page index, written
 *              in ascending page order to selected[m·k ...]; unused entries
 *              are -1. k = 0 writes nothing. "Highest" is by the key
 *              ordered(score): the float's bits as an unsigned integer with
 *              the sign bit set for positives and all bits flipped for
 *              negatives (monotonic; a NaN ranks by its bits, so +NaN above
 *              +inf and -NaN below -inf), the lower page index winning ties.
 *              Score and select: an item whose gate is not NULL and holds n_kv
 *              zero bytes does nothing (reads nothing else, writes nothing):
 *              the selection of a correction is launched on every check and
 *              runs only where the similarity kernel flagged a head.
 * similarity   For each item and query head h: cosine of q[h] and q_prev[h]
 *              (dot and norms in the canonical 16-lane order; 0 when either
 *              norm is 0); cosine[m] = mean over the group (g in order);
 *              corrected[m] = !(cosine[m] >= tau) (NaN is corrected).
 * attention    For each item (a sequence) and query head h (KV head
 *              m = h / G): softmax(scale · q_h · K^T) · V over the tokens of
 *              the item's segments, in fp32 with one online softmax; out[h]
 *              in the call's element type. A segment lists n_tokens tokens:
 *              head m's key of token t at k + m·head_stride + t·row_stride
 *              elements (same for v). An item with no tokens outputs zeros;
 *              an item whose segment range exceeds the call's segment list
 *              outputs NaN on the cpu backends. NaN in q, k or v, or Inf in
 *              q or v, propagates to the outputs of the affected heads of that
 *              item and nowhere else (kvrecall does not scan inputs on the hot
 *              path). An infinite key is ordinary arithmetic: it may give a
 *              logit of -inf, i.e. weight 0, and a finite output.
 *              A segment whose format is K8V4 or K4V2 holds quantised
 *              tokens instead (layouts/kvquant.h, run geometry from the
 *              shape's page_tokens and head_dim; K8V4_HALF: a K8V4 run of
 *              p/2 tokens, half a page): k points at KV head 0's
 *              run, head m's run at k + m·head_stride bytes, and its tokens
 *              are rows first_row .. first_row + n_tokens − 1 of the run
 *              (within the run's rows, kvr_kv_segment_rows; a K8V4 page
 *              read as two halves in place); v is unused. Each element
 *              enters the arithmetic
 *              as s·Q − z (f16 s and z, fp32 arithmetic), dequantised on
 *              the fly: quantised and plain segments mix in one item.
 *              Within the quantised pages' accuracy contract (docs/api.md,
 *              gpu/reference/reference.h) keys may meet the query rounded to 8
 *              bits, and a 16-token block's value weights p·s may be
 *              rounded to 16 bits against the block's largest (8 bits
 *              for 2-bit values on the cpu's AVX2 path).
 *              With KVR_SHAPE_SEGMENT_LSE, an item whose segment_lse is not
 *              NULL also gets, for query head h and segment s,
 *              segment_lse[h·n_segments + s] = log Σ_t exp(scale · q_h·k_t)
 *              over the segment's tokens (natural log, fp32; −inf for an
 *              empty segment; a segment whose share is below e^-80,
 *              where fp32 weights against the running maximum underflow,
 *              may get −inf or an imprecise value that is still below
 *              e^-70; NaN as the output): the share of attention
 *              segment s received is exp(lse_s − log Σ_s' exp(lse_s')).
 *              Mixed page formats rank pages by it.
 *              A segment whose format is KVR_KV_ESTIMATE holds plain rows
 *              (row_stride, head_stride in elements, as a plain segment)
 *              that each stand for page_tokens tokens: a page's mean key
 *              and mean value (summary.h). Its token t's logit is
 *              scale · q_h·k_t + ln(page_tokens) (fp32, as
 *              kvr_segment_log_weight computes it), so it adds
 *              p·exp(scale · q_h·k̄)·v̄ to the numerator and p·exp(...) to
 *              the denominator: the estimate of an unselected page.
 * dense        Attention over one contiguous run per item: token t of KV head
 *              m at k + t·row_stride + m·d elements (NHD rows). The decode
 *              step does not launch it (dense mode and dense layers attend
 *              through `attention` over all of a sequence's pages); it is
 *              kept as a backend primitive over contiguous rows, checked by
 *              the conformance suite on every backend.
 * plan         For each item (one attention item: a KV head of a sequence):
 *              the pages it attends are corrected_sel when that is not NULL
 *              and (corrected is NULL or *corrected != 0), else selected. The
 *              item's list keeps its n_head leading segments; its k slots
 *              get, in order, a segment for each entry P of the pages with
 *              sel_begin <= P < sel_end (k = page_addr[P] + k_offset, v =
 *              page_addr[P] + v_offset or NULL, and the item's seg_ fields;
 *              a page at or above addr_end, past page_addr, is never taken);
 *              the n_tail segments that followed the k slots move up behind
 *              them, and attention->n_segments = n_head + taken + n_tail.
 *              With slot_page (streamed recall), the pages first get slots
 *              as recall.c's host plan gives them: each slot whose page is
 *              among the pages keeps it (the first such entry not yet
 *              placed: a hit); each page entry >= 0 not placed (a miss), in
 *              order and below addr_end, takes the lowest slot not kept and
 *              gets a scatter item
 *              {page_addr[P] + k_offset, slot_k + slot·tile_bytes, slot_v +
 *              slot·tile_bytes, kv_head} at scatter[misses so far]; slots
 *              not kept become -1; the scatter entries past the misses get
 *              kv_head UINT32_MAX (the scatter kernel skips them);
 *              recall_count = {misses, hits}. Each taken page's segment then
 *              reads its slot: k = slot_k + slot·tile_bytes + slot_col (v
 *              likewise). k <= KVR_PLAN_MAX_K. An item with segments NULL
 *              (and attention NULL) only plans the slots and writes the
 *              scatter items and counts: the controller's recall of the
 *              next step's pages on the device.
 *              The decode step's device path builds the selected pages'
 *              segments (and, streamed, plans and moves the misses) with
 *              it, so the host never reads a selection.
 * freelist     For each item, one round of LeanKV's circular free-page list
 *              (layouts/freelist.h) for n_units units (KV heads × sequences)
 *              at once: offsets = exclusive prefix sum of counts; then, if
 *              the round fits (alloc: Σ counts <= end − start; free:
 *              Σ counts <= capacity − (end − start)), unit u takes ids
 *              [start + offsets[u], +counts[u]) (mod capacity) into
 *              pages[offsets[u] ...] (alloc) or writes pages[offsets[u] ...]
 *              to ids at end + offsets[u] (free), and the counter moves by
 *              Σ counts; status 0. A round that does not fit leaves ids and
 *              counters as they were with status KVR_FREELIST_SHORT; an
 *              item that is malformed (unknown op, end < start, more than
 *              capacity free, Σ counts > pages_capacity) likewise with
 *              KVR_FREELIST_BAD. offsets are written in every case. Takes
 *              no shape. Units run in parallel (cuda: a thread per unit of
 *              one block per item, the scan a block scan).
 */
#ifndef KVR_GPU_KERNELS_H
#define KVR_GPU_KERNELS_H

#include <math.h>
#include <stdint.h>

#include "../layouts/hd.h"
#include "../layouts/kvquant.h"
#include "../layouts/page.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kvr_scatter_item {
	const void *run; /* HND run: 2·p·d elements */
	void *k_tile;    /* NHD tile, p rows of n_kv·d */
	void *v_tile;
	uint32_t kv_head;
	uint32_t reserved;
};

struct kvr_page_item { /* offload and summarize */
	const void *k_rows;  /* p NHD rows of keys */
	const void *v_rows;  /* p NHD rows of values (offload only) */
	void *hnd_page;      /* offload: output page, page_bytes (quantised: n_kv runs) */
	void *summary;       /* summarize: output [n_kv][2][d] */
	uint32_t row_stride; /* elements between rows, >= n_kv·d */
	uint32_t format;     /* offload: enum kvr_kv_format of the page, K8V4 or K4V2
	                        (quantised as kvr_quant_run_from_nhd), 0 = plain */
};

/* append: one token's keys and values into row `row` of a tail tile and,
 * where the token completes the tile's page (hnd_page not NULL), that page's
 * conversion and key summary: offload and summarize of the tile, in the
 * same kernel. One launch per layer for a batch, where the rows alone took
 * two copies per sequence and a full page two more kernels. */
struct kvr_append_item {
	const void *k_row;   /* [n_kv][d] the token's keys */
	const void *v_row;   /* [n_kv][d] its values */
	void *k_tile;        /* p NHD rows of keys, row_stride elements apart */
	void *v_tile;        /* ... of values */
	void *hnd_page;      /* the page the token completes (as offload's), or NULL */
	void *summary;       /* with hnd_page: its key summary [n_kv][2][d], or NULL */
	uint32_t row;        /* the token's row in the tile, < p */
	uint32_t row_stride; /* elements between rows, >= n_kv·d */
	uint32_t format;     /* the page's, as kvr_page_item's */
	uint32_t reserved;
};

/* The offload and summarize item of an append item's full tile. */
static inline KVR_HD struct kvr_page_item kvr_append_page_item(const struct kvr_append_item *it)
{
	struct kvr_page_item pi;
	pi.k_rows = it->k_tile;
	pi.v_rows = it->v_tile;
	pi.hnd_page = it->hnd_page;
	pi.summary = it->summary;
	pi.row_stride = it->row_stride;
	pi.format = it->format;
	return pi;
}

struct kvr_score_item {
	const void *q;         /* [n_qo][d] */
	const void *summaries; /* [n_pages] page summaries (summary.h); page j's key bounds
	                          [n_kv][2][d] at j · kvr_summary_page_elems elements */
	float *scores;         /* [n_kv][cand_end - cand_begin] */
	int32_t *selected;     /* [n_kv][k] */
	uint32_t cand_begin;   /* first candidate page */
	uint32_t cand_end;     /* one past the last */
	uint32_t k;            /* pages to select per KV head */
	uint32_t norm_end;     /* softmax over pages [0, norm_end); 0: over the candidates */
	const uint8_t *gate;   /* [n_kv] or NULL: when every byte is 0 the item does
	                          nothing (score and select; a correction's flags) */
};

/* The pages a score item's per-head softmax spans (see score above); the
 * cpu kernels, the CUDA kernels and cudaemu-strict's checks all call it. */
static inline KVR_HD void kvr_score_domain(const struct kvr_score_item *it, uint32_t *begin,
				    uint32_t *end)
{
	*begin = it->norm_end ? 0 : it->cand_begin;
	*end = it->norm_end > it->cand_end ? it->norm_end : it->cand_end;
}

/* 1 when the item's gate holds n_kv zero bytes: score and select skip it. */
static inline KVR_HD int kvr_score_gated_off(const struct kvr_score_item *it, uint32_t n_kv)
{
	if (!it->gate)
		return 0;
	for (uint32_t m = 0; m < n_kv; m++)
		if (it->gate[m])
			return 0;
	return 1;
}

struct kvr_similarity_item {
	const void *q;      /* [n_qo][d], this step */
	const void *q_prev; /* [n_qo][d], the previous step */
	float *cosine;      /* [n_kv] group-mean cosine */
	uint8_t *corrected; /* [n_kv] 1 when below tau */
};

struct kvr_kv_segment {
	const void *k;
	const void *v;
	uint32_t n_tokens;
	union {
		uint32_t row_stride; /* plain: elements between tokens of one head */
		uint32_t first_row;  /* quantised: the run's row of the first token */
	};
	uint32_t head_stride; /* between KV heads: elements (plain), bytes (quantised) */
	uint32_t format;      /* enum kvr_kv_format (layouts/kvquant.h); 0 = plain;
	                         KVR_KV_ESTIMATE: plain rows of page estimates */
};

/* A segment's format is quantised codes (first_row; head_stride in bytes),
 * not plain rows (plain pages and page estimates). */
static inline KVR_HD int kvr_segment_quantised(uint32_t format)
{
	return format != KVR_KV_PLAIN && format != KVR_KV_ESTIMATE;
}

/* What a segment adds to each of its tokens' logits: ln(p) for estimate
 * rows (each stands for a page of p tokens), 0 for tokens. p is a power of
 * two: log2(p)·ln 2 is one correctly rounded product, the same bits on every
 * backend (a library logf may differ by an ulp between host and device). */
static inline KVR_HD float kvr_segment_log_weight(uint32_t format, uint32_t page_tokens)
{
	if (format != KVR_KV_ESTIMATE)
		return 0.0f;
	uint32_t log2p = 0;
	while (log2p < 31 && (1u << log2p) < page_tokens)
		log2p++;
	return (1u << log2p) == page_tokens ? (float)log2p * 0.693147182f : logf((float)page_tokens);
}

/* plan: one attention item's segments of the selected pages (below). */
struct kvr_plan_item {
	struct kvr_attention_item *attention; /* out: its n_segments */
	struct kvr_kv_segment *segments;      /* the item's list: n_head, k slots, n_tail */
	const int32_t *selected;              /* [k] the pages when not corrected */
	const int32_t *corrected_sel;         /* [k] the pages when corrected, or NULL */
	const uint8_t *corrected;             /* the flag, or NULL: corrected_sel if given */
	const uint64_t *page_addr;            /* [sel_end] each logical page's memory */
	uint64_t k_offset;                    /* bytes from a page's memory to the keys */
	uint64_t v_offset;                    /* ... to the values; UINT64_MAX: v NULL */
	uint32_t n_head, n_tail, k;
	uint32_t sel_begin, sel_end;          /* pages [sel_begin, sel_end) are taken */
	uint32_t seg_tokens;                  /* each taken page's segment: n_tokens, */
	uint32_t seg_row;                     /* row_stride (plain) or first_row, */
	uint32_t seg_head_stride;             /* head_stride, */
	uint32_t seg_format;                  /* format */
	uint32_t slot_col;                    /* streamed: bytes from a slot tile to the head's column */
	/* streamed recall (slot_page not NULL): the head's slots */
	int32_t *slot_page;                   /* [k] page in each slot, -1 = empty: planned here */
	struct kvr_scatter_item *scatter;     /* [k] out: the misses' scatter items, then skips */
	uint32_t *recall_count;               /* [2] out: misses, hits */
	unsigned char *slot_k;                /* slot tile 0 of keys (computed with, not read) */
	unsigned char *slot_v;                /* ... of values */
	uint64_t tile_bytes;                  /* between slot tiles */
	uint32_t kv_head;                     /* the head's column, for the scatter items */
	uint32_t addr_end;                    /* page_addr's entries: pages at or above it
	                                         are neither taken nor given a slot */
	/* the device plan: the lane's previous query is rewritten here with
	 * this step's rows of the item's KV head (q_bytes from q_from to q_to;
	 * q_to NULL: nothing), where every reader of the old one has run (the
	 * similarity check before it, the controller's selection, which the
	 * plan waits for): one copy per sequence and layer less to launch */
	const void *q_from;
	void *q_to;
	uint32_t q_bytes;
	uint32_t reserved;
};

/* The most slots a plan item with slot_page plans (its bitmaps' size). */
#define KVR_PLAN_MAX_K 1024u

struct kvr_attention_item {
	const void *q;      /* [n_qo][d] */
	void *out;          /* [n_qo][d] */
	float *segment_lse; /* [n_qo][n_segments] or NULL; read only with
	                       KVR_SHAPE_SEGMENT_LSE (see attention) */
	uint32_t first_segment;
	uint32_t n_segments;
};

/* The pages an item takes: the correction's when it has one and its flag is
 * set (or absent), else the lane's selection. */
static inline KVR_HD const int32_t *kvr_plan_item_pages(const struct kvr_plan_item *it)
{
	return it->corrected_sel && (!it->corrected || *it->corrected) ? it->corrected_sel : it->selected;
}

/* A plan item's pieces, shared by the sequential plan below and the CUDA
 * kernel (cuda_copy.cu), which must write the same bits: the scatter item
 * of a miss placed in `slot` from page memory `mem`, the filler of the
 * scatter list past the misses, and the segment of a taken page (its slot
 * streamed, else its memory `mem`). */
static inline KVR_HD struct kvr_scatter_item kvr_plan_miss(const struct kvr_plan_item *it, uint32_t slot,
							   uint64_t mem)
{
	struct kvr_scatter_item sc;
	sc.run = (const unsigned char *)(uintptr_t)mem + it->k_offset;
	sc.k_tile = it->slot_k + slot * it->tile_bytes;
	sc.v_tile = it->slot_v + slot * it->tile_bytes;
	sc.kv_head = it->kv_head;
	sc.reserved = 0;
	return sc;
}

static inline KVR_HD struct kvr_scatter_item kvr_plan_no_miss(void)
{
	struct kvr_scatter_item none;
	none.run = (const void *)0;
	none.k_tile = none.v_tile = (void *)0;
	none.kv_head = UINT32_MAX;
	none.reserved = 0;
	return none;
}

static inline KVR_HD struct kvr_kv_segment kvr_plan_segment(const struct kvr_plan_item *it, int streamed,
							    uint32_t slot, uint64_t mem)
{
	struct kvr_kv_segment s;
	if (streamed) {
		const uint64_t at = slot * it->tile_bytes + it->slot_col;
		s.k = it->slot_k + at;
		s.v = it->slot_v + at;
	} else {
		const unsigned char *m = (const unsigned char *)(uintptr_t)mem;
		s.k = m + it->k_offset;
		s.v = it->v_offset == UINT64_MAX ? (const void *)0 : (const void *)(m + it->v_offset);
	}
	s.n_tokens = it->seg_tokens;
	s.row_stride = it->seg_row;
	s.head_stride = it->seg_head_stride;
	s.format = it->seg_format;
	return s;
}

/* The plan kernel's work for one item (kernels.h, plan), sequential, given
 * the item's k pages (kvr_plan_item_pages), the memory of each entry's page
 * (addr_of[j] = page_addr[pages[j]] where 0 <= pages[j] < addr_end; NULL:
 * read page_addr) and its slot table (it->slot_page, or a copy). The cpu
 * backend runs it per item; the CUDA kernel (cuda_copy.cu) does the same
 * work in parallel across a block and defers to this on copies in shared
 * memory only when a selection names a page twice. The tail segments move
 * up in ascending order, so a move never overwrites one still to be read. */
static inline KVR_HD void kvr_plan_item_run_with(const struct kvr_plan_item *it, const int32_t *pages,
						 const uint64_t *addr_of, int32_t *slots)
{
	const uint32_t k = it->k < KVR_PLAN_MAX_K ? it->k : KVR_PLAN_MAX_K;
	if (it->q_to)
		for (uint32_t b = 0; b < it->q_bytes; b++)
			((unsigned char *)it->q_to)[b] = ((const unsigned char *)it->q_from)[b];
	/* streamed: plan the slots (recall.c's plan_head), remembering each
	 * page entry's slot */
	uint32_t keep[KVR_PLAN_MAX_K / 32], placed[KVR_PLAN_MAX_K / 32];
	uint16_t slot_of[KVR_PLAN_MAX_K];
	if (slots) {
		for (uint32_t x = 0; x < (k + 31) / 32; x++)
			keep[x] = placed[x] = 0;
		uint32_t hits = 0, misses = 0, free_slot = 0;
		for (uint32_t j = 0; j < k; j++) {
			if (slots[j] < 0)
				continue;
			for (uint32_t w = 0; w < k; w++)
				if (pages[w] == slots[j] && !(placed[w / 32] >> (w % 32) & 1)) {
					keep[j / 32] |= 1u << (j % 32);
					placed[w / 32] |= 1u << (w % 32);
					slot_of[w] = (uint16_t)j;
					hits++;
					break;
				}
		}
		for (uint32_t w = 0; w < k; w++) {
			if (pages[w] < 0 || (uint32_t)pages[w] >= it->addr_end || (placed[w / 32] >> (w % 32) & 1))
				continue;
			while (keep[free_slot / 32] >> (free_slot % 32) & 1)
				free_slot++; /* a free slot exists: at most k pages */
			slots[free_slot] = pages[w];
			keep[free_slot / 32] |= 1u << (free_slot % 32);
			slot_of[w] = (uint16_t)free_slot;
			it->scatter[misses++] =
				kvr_plan_miss(it, free_slot, addr_of ? addr_of[w] : it->page_addr[pages[w]]);
		}
		for (uint32_t j = 0; j < k; j++)
			if (!(keep[j / 32] >> (j % 32) & 1))
				slots[j] = -1;
		for (uint32_t x = misses; x < k; x++)
			it->scatter[x] = kvr_plan_no_miss();
		it->recall_count[0] = misses;
		it->recall_count[1] = hits;
	}
	if (!it->segments)
		return; /* a prefetch: the slots and their scatter only */
	struct kvr_kv_segment *seg = it->segments + it->n_head;
	uint32_t taken = 0;
	for (uint32_t j = 0; j < k; j++) {
		const int32_t page = pages[j];
		if (page < 0 || (uint32_t)page < it->sel_begin || (uint32_t)page >= it->sel_end ||
		    (uint32_t)page >= it->addr_end)
			continue;
		seg[taken++] = slots ? kvr_plan_segment(it, 1, slot_of[j], 0)
				     : kvr_plan_segment(it, 0, 0, addr_of ? addr_of[j] : it->page_addr[page]);
	}
	for (uint32_t j = 0; j < it->n_tail; j++)
		seg[taken + j] = seg[it->k + j];
	it->attention->n_segments = it->n_head + taken + it->n_tail;
}

/* The same, reading the item's own arrays (the cpu backend). */
static inline KVR_HD void kvr_plan_item_run(const struct kvr_plan_item *it)
{
	kvr_plan_item_run_with(it, kvr_plan_item_pages(it), (const uint64_t *)0, it->slot_page);
}

struct kvr_dense_item {
	const void *q;
	const void *k; /* token t, KV head m at t·row_stride + m·d */
	const void *v;
	void *out;
	uint32_t n_tokens;
	uint32_t row_stride;
};

enum kvr_freelist_op {
	KVR_FREELIST_ALLOC = 1,
	KVR_FREELIST_FREE = 2,
};

enum kvr_freelist_status {
	KVR_FREELIST_OK = 0,
	KVR_FREELIST_SHORT = -1, /* alloc: too few free pages; free: more than capacity */
	KVR_FREELIST_BAD = -2,   /* malformed item: nothing changed */
};

struct kvr_freelist_item { /* freelist: one list's round */
	uint32_t *ids;          /* the list: capacity page ids */
	uint64_t *counters;     /* [2]: start, end (layouts/freelist.h) */
	const uint32_t *counts; /* [n_units]: pages each unit takes or returns */
	uint64_t *offsets;      /* [n_units], out: exclusive prefix sum of counts */
	uint32_t *pages;        /* alloc: out, free: in; unit u's at pages[offsets[u]] */
	int32_t *status;        /* out: enum kvr_freelist_status */
	uint32_t capacity;      /* ids in the list, >= 1 */
	uint32_t n_units;
	uint32_t op;            /* enum kvr_freelist_op */
	uint32_t pages_capacity; /* entries `pages` holds */
};

/*
 * Every pointer field of every item the kernels take, declared once:
 * KVR_ITEM_POINTERS_<struct>(X) expands X(field) for each, and
 * KVR_ITEM_STRUCTS(S) expands S(struct) for every item struct. Generated from
 * them: the conformance suite's host-to-device item translators
 * (tests/test_conformance.c), cudaemu-strict's table of the pointer fields
 * its extent checks must name (gpu/cudaemu/backend.c; test_cudaemu_strict
 * fails on a field no check covers) and the layout-ABI test's check that
 * each is in its table (tests/layout_abi_c.c). A pointer field added to an
 * item is added here, or all three see it.
 */
#define KVR_ITEM_POINTERS_kvr_scatter_item(X) X(run) X(k_tile) X(v_tile)
#define KVR_ITEM_POINTERS_kvr_page_item(X) X(k_rows) X(v_rows) X(hnd_page) X(summary)
#define KVR_ITEM_POINTERS_kvr_append_item(X) X(k_row) X(v_row) X(k_tile) X(v_tile) X(hnd_page) X(summary)
#define KVR_ITEM_POINTERS_kvr_score_item(X) X(q) X(summaries) X(scores) X(selected) X(gate)
#define KVR_ITEM_POINTERS_kvr_similarity_item(X) X(q) X(q_prev) X(cosine) X(corrected)
#define KVR_ITEM_POINTERS_kvr_kv_segment(X) X(k) X(v)
#define KVR_ITEM_POINTERS_kvr_attention_item(X) X(q) X(out) X(segment_lse)
#define KVR_ITEM_POINTERS_kvr_plan_item(X)                                                          \
	X(attention) X(segments) X(selected) X(corrected_sel) X(corrected) X(page_addr) X(slot_page) \
	X(scatter) X(recall_count) X(slot_k) X(slot_v) X(q_from) X(q_to)
#define KVR_ITEM_POINTERS_kvr_dense_item(X) X(q) X(k) X(v) X(out)
#define KVR_ITEM_POINTERS_kvr_freelist_item(X) X(ids) X(counters) X(counts) X(offsets) X(pages) X(status)
#define KVR_ITEM_STRUCTS(S)                                                                        \
	S(kvr_scatter_item) S(kvr_page_item) S(kvr_score_item) S(kvr_similarity_item)            \
	S(kvr_kv_segment) S(kvr_attention_item) S(kvr_dense_item) S(kvr_freelist_item)          \
	S(kvr_plan_item) S(kvr_append_item)

/*
 * The kernels a stream being captured into a CUDA graph accepts: those a
 * captured decode step launches (scheduler/capture.c). The cuda backend
 * refuses the others on a capturing stream, and the cpu backend's capture
 * emulation (so cudaemu) refuses them alike, so a capture that works on
 * cudaemu uses only what CUDA takes.
 */
#define KVR_CAPTURABLE_scatter 1 /* streamed recall's misses, into the slots */
#define KVR_CAPTURABLE_offload 0
#define KVR_CAPTURABLE_summarize 0
#define KVR_CAPTURABLE_score 1
#define KVR_CAPTURABLE_select 1
#define KVR_CAPTURABLE_similarity 1
#define KVR_CAPTURABLE_dense 0
#define KVR_CAPTURABLE_plan 1
#define KVR_CAPTURABLE_append 1
#define KVR_CAPTURABLE_attention 1
#define KVR_CAPTURABLE_freelist 0

/* Shape of a call, common to the kernels. */
struct kvr_shape {
	uint32_t n_qo_heads;
	uint32_t n_kv_heads;
	uint32_t head_dim;
	uint32_t page_tokens;
	uint32_t elem_type;
	float scale; /* attention and score scale, 1/sqrt(d) */
	float tau;   /* similarity threshold */
	uint32_t flags; /* enum kvr_shape_flags */
	/* KVR_SHAPE_CAUSAL (attention): query heads per query token; how many
	 * consecutive items make one query block (0: the call is one block);
	 * and the position of the first block's first query token. Item i's
	 * first query token is causal_first_position + (i / causal_items_per_block)
	 * · (its query heads / causal_heads_per_query), so one call can hold
	 * several consecutive blocks (each block's items: its KV heads). */
	uint32_t causal_heads_per_query;
	uint32_t causal_items_per_block;
	uint64_t causal_first_position;
};

/* KVR_SHAPE_CAUSAL: the position of item i's first query token (its block's,
 * with causal_items_per_block; below). */
static inline KVR_HD uint64_t kvr_causal_item_position(const struct kvr_shape *s, uint32_t item)
{
	if (!s->causal_items_per_block)
		return s->causal_first_position;
	return s->causal_first_position + (uint64_t)(item / s->causal_items_per_block) *
						  (s->n_qo_heads / s->n_kv_heads / s->causal_heads_per_query);
}

enum kvr_shape_flags {
	/* attention: items with a segment_lse array get each segment's
	 * log-sum-exp of logits per query head (cuda then runs one block per
	 * (item, KV head, head chunk): no split of the tokens) */
	KVR_SHAPE_SEGMENT_LSE = 1u << 0,
	/* attention, a block of queries of one sequence (prefill): query head
	 * h of an item belongs to query token h / causal_heads_per_query, at
	 * position causal_first_position + that (plus the item's block's
	 * offset, see causal_items_per_block); it attends only the tokens
	 * whose index, counted over the item's segments in order from 0, is at
	 * most its position (the causal mask of FlashAttention's diagonal
	 * block). Each K and V row is then read once for all the block's
	 * queries instead of once per query. Every backend; with
	 * KVR_SHAPE_SEGMENT_LSE a segment's log-sum-exp is over the tokens the
	 * head sees (−inf when none); not for dense (-EINVAL). */
	KVR_SHAPE_CAUSAL = 1u << 1,
	/* page summaries carry estimate rows (layouts/summary.h): summarize
	 * and append write the mean key and mean value after the key bounds,
	 * and score reads the bounds kvr_summary_page_elems(.., 1) apart */
	KVR_SHAPE_ESTIMATES = 1u << 2,
};

#ifdef __cplusplus
}
#endif

#endif /* KVR_GPU_KERNELS_H */
