/* SPDX-License-Identifier: MIT */
/*
 * decode.c — the decode step behind kvr_decode_begin/layer/end on the cpu
 * backend: append each sequence's new K/V, decide which pages each KV head
 * attends to (the mode), and run attention.
 *
 * On the cpu backend the pool is host memory the kernels can read directly,
 * so "recall" is zero-copy: attention reads the selected HND pages where they
 * live. Because each KV head may select different pages, attention runs one
 * item per (sequence, KV head) with the shape of one KV head and its G query
 * heads; segments point straight at that head's runs: sink pages, selected
 * pages and window pages in the pool (HND: rows d apart) and the partial tail
 * tile (NHD: rows n_kv·d apart).
 *
 * Modes (kvrecall.h): selection uses the score/select kernels over the page
 * summaries the pool keeps; candidates are the full pages outside the sink and
 * outside the window as it will be when the selection is used, so a page is
 * never both selected and in the window. freekv's correction check uses the
 * similarity kernel; a corrected KV head attends with pages selected now, and
 * that one selection serves every head at the next step.
 *
 * This is the runtime's synchronous core; the controller thread that moves
 * selection and recall off the critical path on a GPU builds on it.
 *
 * Threads: the engine's thread; one step at a time per context.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../gpu/backend.h"
#include "../host/pool.h"
#include "internal.h"

static uint32_t pages_k(const struct kvr_config *c)
{
	return (c->budget_tokens - c->sink_tokens - c->window_tokens) / c->page_tokens;
}

int kvr_decode_state_alloc(struct kvr_context *ctx, struct kvr_sequence *s)
{
	const struct kvr_config *c = &ctx->config;
	const uint32_t k = pages_k(c);
	s->prev_q = malloc((size_t)c->n_layers * c->n_qo_heads * c->head_dim * kvr_dtype_bytes(c->dtype));
	s->selected = malloc((size_t)c->n_layers * c->n_kv_heads * (k ? k : 1) * sizeof(int32_t));
	s->has_prev = calloc(c->n_layers, 1);
	if (!s->prev_q || !s->selected || !s->has_prev) {
		kvr_decode_state_free(s);
		return -ENOMEM;
	}
	return 0;
}

void kvr_decode_state_free(struct kvr_sequence *s)
{
	free(s->prev_q);
	free(s->selected);
	free(s->has_prev);
	s->prev_q = NULL;
	s->selected = NULL;
	s->has_prev = NULL;
}

void kvr_decode_teardown(struct kvr_context *ctx)
{
	free(ctx->step.seqs);
	free(ctx->step.positions);
	free(ctx->step.scratch);
	memset(&ctx->step, 0, sizeof(ctx->step));
}

KVR_API int kvr_decode_begin(struct kvr_context *ctx, const uint32_t *seqs,
			     const uint64_t *positions, uint32_t batch)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "decode_begin: ctx is NULL");
	if (ctx->step.open)
		return kvr_fail(ctx, -EBUSY, "decode_begin: a step is already open (call kvr_decode_end)");
	if (!batch || batch > ctx->config.max_batch)
		return kvr_fail(ctx, -EINVAL, "decode_begin: batch of %u sequences (must be 1..max_batch %u)",
				batch, ctx->config.max_batch);
	if (!seqs || !positions)
		return kvr_fail(ctx, -EINVAL, "decode_begin: seqs or positions is NULL");
	for (uint32_t i = 0; i < batch; i++) {
		if (seqs[i] >= ctx->config.max_sequences || !ctx->seqs[seqs[i]].alive)
			return kvr_fail(ctx, -EINVAL, "decode_begin: sequence %u (batch entry %u) does not exist",
					seqs[i], i);
		for (uint32_t j = 0; j < i; j++)
			if (seqs[j] == seqs[i])
				return kvr_fail(ctx, -EINVAL, "decode_begin: sequence %u appears twice", seqs[i]);
	}
	if (!ctx->step.seqs) {
		ctx->step.seqs = malloc(ctx->config.max_batch * sizeof(*ctx->step.seqs));
		ctx->step.positions = malloc(ctx->config.max_batch * sizeof(*ctx->step.positions));
		if (!ctx->step.seqs || !ctx->step.positions) {
			kvr_decode_teardown(ctx);
			return kvr_fail(ctx, -ENOMEM, "decode_begin: out of memory");
		}
	}
	memcpy(ctx->step.seqs, seqs, batch * sizeof(*seqs));
	memcpy(ctx->step.positions, positions, batch * sizeof(*positions));
	ctx->step.batch = batch;
	ctx->step.open = 1;
	return 0;
}

KVR_API int kvr_decode_end(struct kvr_context *ctx)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "decode_end: ctx is NULL");
	if (!ctx->step.open)
		return kvr_fail(ctx, -EINVAL, "decode_end: no step is open");
	ctx->step.open = 0;
	ctx->stats.steps++;
	return 0;
}

KVR_API int kvr_get_stats(const struct kvr_context *ctx, struct kvr_stats *stats)
{
	if (!ctx || !stats || stats->size < sizeof(*stats))
		return -EINVAL;
	*stats = ctx->stats;
	stats->size = sizeof(*stats);
	return 0;
}

/* ------------------------------------------------------------------ one layer */

/* Scratch of one layer call, carved from ctx->step.scratch. */
struct layer_scratch {
	struct kvr_attention_item *items;   /* batch x n_kv */
	struct kvr_kv_segment *segments;    /* batch x n_kv x max_segments */
	struct kvr_score_item *score_items; /* batch */
	struct kvr_similarity_item *sim_items;
	float *scores;     /* batch x n_kv x max_candidates */
	int32_t *now_sel;  /* batch x n_kv x k: selected with this step's q */
	float *cosine;     /* batch x n_kv */
	uint8_t *corrected;
	uint32_t max_segments;
	uint32_t max_candidates;
};

static int scratch_get(struct kvr_context *ctx, uint32_t batch, uint32_t max_pages,
		       struct layer_scratch *ls)
{
	const struct kvr_config *c = &ctx->config;
	const uint32_t n_kv = c->n_kv_heads, k = pages_k(c);
	ls->max_segments = max_pages + 1; /* every full page + the tail */
	ls->max_candidates = max_pages;
	size_t need = 0, off[8];
	const size_t sizes[8] = {
		(size_t)batch * n_kv * sizeof(struct kvr_attention_item),
		(size_t)batch * n_kv * ls->max_segments * sizeof(struct kvr_kv_segment),
		(size_t)batch * sizeof(struct kvr_score_item),
		(size_t)batch * sizeof(struct kvr_similarity_item),
		(size_t)batch * n_kv * (ls->max_candidates ? ls->max_candidates : 1) * sizeof(float),
		(size_t)batch * n_kv * (k ? k : 1) * sizeof(int32_t),
		(size_t)batch * n_kv * sizeof(float),
		(size_t)batch * n_kv,
	};
	for (int i = 0; i < 8; i++) {
		off[i] = need;
		need += (sizes[i] + 63) & ~(size_t)63;
	}
	if (need > ctx->step.scratch_bytes) {
		void *p = NULL;
		if (posix_memalign(&p, 64, need))
			return -ENOMEM;
		free(ctx->step.scratch);
		ctx->step.scratch = p;
		ctx->step.scratch_bytes = need;
	}
	unsigned char *b = ctx->step.scratch;
	ls->items = (void *)(b + off[0]);
	ls->segments = (void *)(b + off[1]);
	ls->score_items = (void *)(b + off[2]);
	ls->sim_items = (void *)(b + off[3]);
	ls->scores = (void *)(b + off[4]);
	ls->now_sel = (void *)(b + off[5]);
	ls->cosine = (void *)(b + off[6]);
	ls->corrected = (void *)(b + off[7]);
	return 0;
}

static int layer_is_dense(const struct kvr_config *c, uint32_t layer)
{
	return c->mode == KVR_MODE_DENSE || (c->dense_layers[layer / 64] >> (layer % 64) & 1);
}

/* Segments of KV head m of one sequence: sink pages, `sel` (n_sel page ids,
 * -1 skipped), window pages [win_first, n_full), then the tail. Dense:
 * every full page. */
static uint32_t build_segments(struct kvr_context *ctx, uint32_t seq, uint32_t layer, uint32_t m,
			       uint64_t n_tokens, int dense, const int32_t *sel, uint32_t n_sel,
			       struct kvr_kv_segment *out)
{
	const struct kvr_config *c = &ctx->config;
	const uint32_t p = c->page_tokens, d = c->head_dim, eb = kvr_dtype_bytes(c->dtype);
	const uint32_t n_full = (uint32_t)(n_tokens / p), tail = (uint32_t)(n_tokens % p);
	const uint64_t head_bytes = 2ull * p * d * eb;
	uint32_t n = 0;
#define ADD_PAGE(logical)                                                                        \
	do {                                                                                     \
		uint32_t id_;                                                                    \
		kvr_pool_lookup(ctx->pool, seq, layer, (logical), &id_);                         \
		const unsigned char *run_ =                                                      \
			(const unsigned char *)kvr_pool_page_data(ctx->pool, id_) + m * head_bytes; \
		out[n++] = (struct kvr_kv_segment){ run_, run_ + (uint64_t)p * d * eb, p, d, 0, 0 }; \
	} while (0)
	if (dense) {
		for (uint32_t j = 0; j < n_full; j++)
			ADD_PAGE(j);
	} else {
		const uint32_t sink = c->sink_tokens / p, window = c->window_tokens / p;
		const uint32_t win_first = n_full > window ? n_full - window : 0;
		for (uint32_t j = 0; j < sink && j < win_first; j++)
			ADD_PAGE(j);
		for (uint32_t i = 0; i < n_sel; i++)
			if (sel[i] >= 0 && (uint32_t)sel[i] >= sink && (uint32_t)sel[i] < win_first)
				ADD_PAGE((uint32_t)sel[i]);
		for (uint32_t j = win_first > sink ? win_first : sink; j < n_full; j++)
			ADD_PAGE(j);
	}
#undef ADD_PAGE
	if (tail) {
		const struct kvr_sequence *s = &ctx->seqs[seq];
		const unsigned char *kt = s->tails + (uint64_t)layer * 2 * ctx->tile_bytes +
					  (uint64_t)m * d * eb;
		out[n++] = (struct kvr_kv_segment){ kt, kt + ctx->tile_bytes, tail,
						    c->n_kv_heads * d, 0, 0 };
	}
	return n;
}

KVR_API int kvr_decode_layer(struct kvr_context *ctx, uint32_t layer, const void *q,
			     const void *k, const void *v, void *out, int32_t *status, void *stream)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "decode_layer: ctx is NULL");
	const struct kvr_config *c = &ctx->config;
	if (!ctx->step.open)
		return kvr_fail(ctx, -EINVAL, "decode_layer: no step is open (call kvr_decode_begin)");
	if (layer >= c->n_layers)
		return kvr_fail(ctx, -EINVAL, "decode_layer: layer %u out of range (n_layers %u)", layer,
				c->n_layers);
	if (!q || !k || !v || !out || !status)
		return kvr_fail(ctx, -EINVAL, "decode_layer: q, k, v, out or status is NULL");
	if (stream)
		return kvr_fail(ctx, -EINVAL, "decode_layer: the cpu backend takes no stream (pass NULL)");

	const uint32_t batch = ctx->step.batch, n_kv = c->n_kv_heads, n_qo = c->n_qo_heads;
	const uint32_t d = c->head_dim, eb = kvr_dtype_bytes(c->dtype), p = c->page_tokens;
	const uint32_t G = n_qo / n_kv, kk = pages_k(c);
	const uint64_t q_row = (uint64_t)n_qo * d * eb, kv_row = (uint64_t)n_kv * d * eb;

	/* 1. Append each sequence's token (reserving a page when a tail page starts). */
	uint32_t max_pages = 0;
	for (uint32_t i = 0; i < batch; i++) {
		const uint32_t seq = ctx->step.seqs[i];
		struct kvr_tail_tile tail = { ctx->seqs[seq].tails + (uint64_t)layer * 2 * ctx->tile_bytes,
					      ctx->seqs[seq].tails + ((uint64_t)layer * 2 + 1) * ctx->tile_bytes };
		status[i] = kvr_pool_ingest(ctx->pool, seq, layer, ctx->step.positions[i], 1,
					    (const unsigned char *)k + i * kv_row,
					    (const unsigned char *)v + i * kv_row, &tail);
		if (status[i]) {
			kvr_fail(ctx, status[i], "decode_layer: sequence %u layer %u: %s", seq, layer,
				 kvr_pool_last_error(ctx->pool));
			memset((unsigned char *)out + i * q_row, 0, q_row);
			ctx->stats.failed_decodes++;
			continue;
		}
		const uint32_t pages = (uint32_t)((ctx->step.positions[i] + 1) / p);
		max_pages = pages > max_pages ? pages : max_pages;
	}

	struct layer_scratch ls;
	if (scratch_get(ctx, batch, max_pages, &ls))
		return kvr_fail(ctx, -ENOMEM, "decode_layer: out of memory for the step's scratch");
	const struct kvr_shape shape = { n_qo, n_kv, d, p, c->dtype, 1.0f / sqrtf((float)d), c->tau, 0 };
	struct kvr_stream *s_inline = ctx->inline_stream;

	/* 2. Per sequence: dense or sparse, and for sparse, which selection. */
	uint32_t n_items = 0, n_segs = 0;
	for (uint32_t i = 0; i < batch; i++) {
		if (status[i])
			continue;
		const uint32_t seq = ctx->step.seqs[i];
		struct kvr_sequence *s = &ctx->seqs[seq];
		const uint64_t n_tokens = ctx->step.positions[i] + 1;
		const unsigned char *qi = (const unsigned char *)q + i * q_row;
		const int dense = layer_is_dense(c, layer) || n_tokens <= c->budget_tokens;
		int32_t *use_sel = s->selected + (uint64_t)layer * n_kv * (kk ? kk : 1);
		int32_t *now_sel = ls.now_sel + (uint64_t)i * n_kv * (kk ? kk : 1);
		const uint32_t n_full = (uint32_t)(n_tokens / p);
		const uint32_t sink = c->sink_tokens / p, window = c->window_tokens / p;
		uint8_t corrected_any = 0;
		uint8_t *corrected = ls.corrected + (uint64_t)i * n_kv;
		memset(corrected, 0, n_kv);

		if (!dense && kk) {
			int select_now = c->mode == KVR_MODE_BLOCKING || !s->has_prev[layer];
			if (c->mode == KVR_MODE_FREEKV && s->has_prev[layer]) {
				struct kvr_similarity_item si = { qi, s->prev_q + (uint64_t)layer * q_row,
								  ls.cosine + (uint64_t)i * n_kv, corrected };
				kvr_dev_similarity(ctx->dev, &shape, &si, 1, s_inline);
				for (uint32_t m = 0; m < n_kv; m++)
					corrected_any |= corrected[m];
				ctx->stats.checked_heads += n_kv;
				for (uint32_t m = 0; m < n_kv; m++)
					ctx->stats.corrected_heads += corrected[m];
				select_now = corrected_any;
			}
			if (select_now) {
				/* select with this step's query against today's window */
				const uint32_t win_first = n_full > window ? n_full - window : 0;
				struct kvr_score_item it = { qi, kvr_pool_summary(ctx->pool, seq, layer, 0),
							     ls.scores, now_sel, sink,
							     win_first > sink ? win_first : sink, kk, 0 };
				kvr_dev_score(ctx->dev, &shape, &it, 1, s_inline);
				kvr_dev_select(ctx->dev, &shape, &it, 1, s_inline);
				ctx->stats.selections++;
				if (!s->has_prev[layer] || c->mode == KVR_MODE_BLOCKING) {
					for (uint32_t m = 0; m < n_kv; m++)
						corrected[m] = 1; /* every head uses it now */
				}
			}
		}

		/* 3. Attention items: one per KV head. */
		for (uint32_t m = 0; m < n_kv; m++) {
			const int32_t *sel = corrected[m] ? now_sel + (uint64_t)m * kk
							  : use_sel + (uint64_t)m * kk;
			const uint32_t n = build_segments(ctx, seq, layer, m, n_tokens, dense, sel,
							  dense ? 0 : kk, ls.segments + n_segs);
			ls.items[n_items++] = (struct kvr_attention_item){
				qi + (uint64_t)m * G * d * eb,
				(unsigned char *)out + i * q_row + (uint64_t)m * G * d * eb, n_segs, n };
			n_segs += n;
		}
		ctx->stats.layer_decodes++;
		ctx->stats.dense_decodes += dense;

		/* 4. Keep this step's query and the selection the next step will use. */
		if (!dense && kk) {
			const int speculative = c->mode == KVR_MODE_SPECULATIVE || c->mode == KVR_MODE_FREEKV;
			if (speculative && corrected_any) {
				/* one selection per step: the corrected one serves next step too */
				memcpy(use_sel, now_sel, (size_t)n_kv * kk * sizeof(int32_t));
			} else if (speculative) {
				/* select with q_i against the window as it will be at step i+1 */
				const uint32_t next_full = (uint32_t)((n_tokens + 1) / p);
				uint32_t win_first = next_full > window ? next_full - window : 0;
				if (win_first > n_full) /* W = 0: the page being filled has no summary yet */
					win_first = n_full;
				struct kvr_score_item it = { qi, kvr_pool_summary(ctx->pool, seq, layer, 0),
							     ls.scores, use_sel, sink,
							     win_first > sink ? win_first : sink, kk, 0 };
				kvr_dev_score(ctx->dev, &shape, &it, 1, s_inline);
				kvr_dev_select(ctx->dev, &shape, &it, 1, s_inline);
				ctx->stats.selections++;
			}
			memcpy(s->prev_q + (uint64_t)layer * q_row, qi, q_row);
			s->has_prev[layer] = 1;
		}
	}

	/* Attention for every (sequence, KV head) at once, with one KV head's shape. */
	const struct kvr_shape head_shape = { G, 1, d, p, c->dtype, shape.scale, c->tau, 0 };
	if (n_items)
		kvr_dev_attention(ctx->dev, &head_shape, ls.items, n_items, ls.segments, n_segs, s_inline);
	return 0;
}
