/* SPDX-License-Identifier: MIT */
/*
 * sequence.c — sequences and prefill ingestion behind kvrecall.h: the
 * sequence table, each sequence's device-side tail tiles, and the glue to the
 * host pool's page tables (host/pool.c), which own the pages themselves.
 *
 * A sequence's tail tiles hold, per layer, the rows of the page that is not
 * full yet (NHD, as the QKV projection writes them); the pool holds every full
 * page and has already reserved the one the tail will fill. The host writes
 * the tiles directly: on the cpu backend they are device memory, which is host
 * memory; on a separate-memory device (cuda) they are pinned host memory the
 * device reads through unified addressing (gpu/memory.h, kvr_tile_alloc).
 *
 * Threads: the caller's. seq_lock guards the alive flags only; a sequence's
 * data is used by one thread at a time (kvrecall.h).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "../gpu/backend.h"
#include "../layouts/base/fault.h"
#include "../gpu/memory.h"
#include "../host/pool.h"
#include "../layouts/kvquant.h"
#include "../layouts/transpose.h"
#include "../scheduler/scheduler.h"
#include "internal.h"

static unsigned char *tail_keys(const struct kvr_context *ctx, const struct kvr_sequence *s,
				uint32_t layer)
{
	return s->tails + (uint64_t)layer * 2 * ctx->tile_bytes;
}

static unsigned char *tail_values(const struct kvr_context *ctx, const struct kvr_sequence *s,
				  uint32_t layer)
{
	return tail_keys(ctx, s, layer) + ctx->tile_bytes;
}

/* The live sequence `seq`, or NULL with the context's error set. */
static struct kvr_sequence *live(const struct kvr_context *ctx, uint32_t seq, const char *op, int *err)
{
	if (seq >= ctx->config.max_sequences) {
		*err = kvr_fail(ctx, -EINVAL, "%s: sequence id %u out of range (max_sequences %u)", op,
				seq, ctx->config.max_sequences);
		return NULL;
	}
	struct kvr_sequence *s = ctx->seqs[seq].alive ? &ctx->seqs[seq] : NULL;
	if (!s)
		*err = kvr_fail(ctx, -EINVAL, "%s: sequence %u does not exist (freed or never created)",
				op, seq);
	return s;
}

/* live(), for calls that change the sequence's tokens or free it: refused
 * while the open decode step names it (its layers are mid-step). */
static struct kvr_sequence *live_idle(struct kvr_context *ctx, uint32_t seq, const char *op, int *err)
{
	struct kvr_sequence *s = live(ctx, seq, op, err);
	if (s && s->in_step) {
		*err = kvr_fail(ctx, -EBUSY,
				"%s: sequence %u is in the open decode step (call kvr_decode_end first)",
				op, seq);
		return NULL;
	}
	return s;
}

static void seq_release(struct kvr_context *ctx, uint32_t id, int close_tables);

/* Claim a free slot with its tiles allocated; open its (empty) pool tables
 * unless the caller will (a fork opens them from the source). */
static int seq_claim(struct kvr_context *ctx, const char *op, int open_tables, uint32_t *out)
{
	pthread_mutex_lock(&ctx->seq_lock);
	uint32_t id = 0;
	while (id < ctx->config.max_sequences && ctx->seqs[id].alive)
		id++;
	if (id == ctx->config.max_sequences) {
		pthread_mutex_unlock(&ctx->seq_lock);
		return kvr_fail(ctx, -ENOSPC, "%s: all %u sequences are in use (max_sequences)", op,
				ctx->config.max_sequences);
	}
	/* admission against the device budget */
	if (ctx->device_used_bytes + ctx->device_seq_bytes > ctx->config.device_bytes) {
		const uint64_t used = ctx->device_used_bytes;
		pthread_mutex_unlock(&ctx->seq_lock);
		return kvr_fail(ctx, -ENOSPC,
				"%s: device_bytes %llu cannot hold another sequence (%llu used, %llu "
				"per sequence)",
				op, (unsigned long long)ctx->config.device_bytes,
				(unsigned long long)used, (unsigned long long)ctx->device_seq_bytes);
	}
	ctx->device_used_bytes += ctx->device_seq_bytes;
	ctx->seqs[id].alive = 1; /* reserved; undone below on failure */
	pthread_mutex_unlock(&ctx->seq_lock);

	void *tails = NULL;
	int err = kvr_tile_alloc(ctx->dev, (size_t)ctx->config.n_layers * 2 * ctx->tile_bytes,
				       &tails);
	if (err)
		kvr_fail(ctx, err, "%s: device memory for the tail pages: %s", op,
			 kvr_dev_last_error(ctx->dev));
	else if (open_tables && (err = kvr_pool_seq_open(ctx->pool, id)))
		kvr_fail(ctx, err, "%s: %s", op, kvr_pool_last_error(ctx->pool));
	else if ((err = kvr_sched_seq_open(ctx->sched, id, tails))) {
		kvr_fail(ctx, err, "%s: %s", op, kvr_sched_last_error(ctx->sched));
		if (open_tables)
			kvr_pool_seq_close(ctx->pool, id);
	}
	if (err) {
		kvr_tile_free(ctx->dev, tails);
		pthread_mutex_lock(&ctx->seq_lock);
		ctx->seqs[id].alive = 0;
		ctx->device_used_bytes -= ctx->device_seq_bytes;
		pthread_mutex_unlock(&ctx->seq_lock);
		return err;
	}
	ctx->seqs[id].tails = tails;
	*out = id;
	return 0;
}

static void seq_release(struct kvr_context *ctx, uint32_t id, int close_tables)
{
	kvr_sched_seq_close(ctx->sched, id); /* waits for the sequence's controller jobs */
	if (close_tables)
		kvr_pool_seq_close(ctx->pool, id);
	kvr_tile_free(ctx->dev, ctx->seqs[id].tails);
	pthread_mutex_lock(&ctx->seq_lock);
	ctx->seqs[id].tails = NULL;
	ctx->seqs[id].alive = 0;
	ctx->device_used_bytes -= ctx->device_seq_bytes;
	pthread_mutex_unlock(&ctx->seq_lock);
}

KVR_API int kvr_seq_create(struct kvr_context *ctx, uint32_t *seq)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "seq_create: ctx is NULL");
	if (!seq)
		return kvr_fail(ctx, -EINVAL, "seq_create: seq is NULL");
	return seq_claim(ctx, "seq_create", 1, seq);
}

KVR_API int kvr_seq_free(struct kvr_context *ctx, uint32_t seq)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "seq_free: ctx is NULL");
	int err = 0;
	if (!live_idle(ctx, seq, "seq_free", &err))
		return err;
	seq_release(ctx, seq, 1);
	return 0;
}

KVR_API int kvr_seq_fork(struct kvr_context *ctx, uint32_t src, uint32_t *dst)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "seq_fork: ctx is NULL");
	if (!dst)
		return kvr_fail(ctx, -EINVAL, "seq_fork: dst is NULL");
	int err = 0;
	struct kvr_sequence *from = live_idle(ctx, src, "seq_fork", &err);
	if (!from)
		return err;
	uint32_t id = 0;
	kvr_sched_seq_quiesce(ctx->sched, src); /* no job reads src's tables meanwhile */
	if ((err = seq_claim(ctx, "seq_fork", 0, &id)))
		return err;
	if ((err = kvr_pool_seq_fork(ctx->pool, src, id))) { /* leaves id's tables closed */
		kvr_fail(ctx, err, "seq_fork: %s", kvr_pool_last_error(ctx->pool));
		seq_release(ctx, id, 0);
		return err;
	}
	memcpy(ctx->seqs[id].tails, from->tails, (size_t)ctx->config.n_layers * 2 * ctx->tile_bytes);
	/* the fork has no previous query of its own yet: its first step selects afresh */
	*dst = id;
	return 0;
}

KVR_API int kvr_seq_length(const struct kvr_context *ctx, uint32_t seq, uint32_t layer,
			   uint64_t *n_tokens)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "seq_length: ctx is NULL");
	if (!n_tokens)
		return kvr_fail(ctx, -EINVAL, "seq_length: n_tokens is NULL");
	int err = 0;
	if (!live(ctx, seq, "seq_length", &err))
		return err;
	if (layer >= ctx->config.n_layers)
		return kvr_fail(ctx, -EINVAL, "seq_length: layer %u out of range (n_layers %u)", layer,
				ctx->config.n_layers);
	return kvr_pool_n_tokens(ctx->pool, seq, layer, n_tokens);
}

KVR_API int kvr_seq_truncate(struct kvr_context *ctx, uint32_t seq, uint64_t n_tokens)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "seq_truncate: ctx is NULL");
	int err = 0;
	struct kvr_sequence *s = live_idle(ctx, seq, "seq_truncate", &err);
	if (!s)
		return err;
	const struct kvr_config *c = &ctx->config;
	kvr_sched_seq_quiesce(ctx->sched, seq);
	/* Check every layer first, so a refusal changes nothing. */
	for (uint32_t l = 0; l < c->n_layers; l++) {
		uint64_t have;
		kvr_pool_n_tokens(ctx->pool, seq, l, &have);
		if (n_tokens > have)
			return kvr_fail(ctx, -EINVAL,
					"seq_truncate: sequence %u layer %u has %llu tokens, cannot keep %llu",
					seq, l, (unsigned long long)have, (unsigned long long)n_tokens);
	}
	struct kvr_page_geometry g;
	kvr_page_geometry_init(&g, c->page_tokens, c->head_dim, c->n_kv_heads, c->dtype);
	const uint64_t p = c->page_tokens;
	/* The pages whose rows go back to the tail tiles, pinned (with a spill
	 * tier, read back from the file) before anything changes: a page that
	 * cannot be read refuses the truncation. */
	uint32_t *tail_page = kvr_calloc(c->n_layers, sizeof(*tail_page));
	/* a plain page's KV head run in HND order, whatever the pool's layout */
	unsigned char *run = kvr_malloc(g.head_bytes);
	if (!tail_page || !run) {
		free(tail_page);
		free(run);
		return kvr_fail(ctx, -ENOMEM, "seq_truncate: out of memory");
	}
	for (uint32_t l = 0; l < c->n_layers && !err; l++) {
		uint64_t have;
		kvr_pool_n_tokens(ctx->pool, seq, l, &have);
		tail_page[l] = UINT32_MAX;
		if (n_tokens % p && n_tokens / p != have / p) {
			uint32_t id = 0;
			err = kvr_pool_lookup(ctx->pool, seq, l, (uint32_t)(n_tokens / p), &id);
			if (!err)
				err = kvr_pool_pin(ctx->pool, &id, 1);
			if (!err)
				tail_page[l] = id;
			else
				kvr_fail(ctx, err, "seq_truncate: sequence %u layer %u: the page to keep: %s", seq,
					 l, kvr_pool_last_error(ctx->pool));
		}
	}
	if (err) {
		for (uint32_t l = 0; l < c->n_layers; l++)
			if (tail_page[l] != UINT32_MAX)
				kvr_pool_unpin(ctx->pool, &tail_page[l], 1);
		free(tail_page);
		free(run);
		return err;
	}
	for (uint32_t l = 0; l < c->n_layers; l++) {
		uint64_t have;
		kvr_pool_n_tokens(ctx->pool, seq, l, &have);
		kvr_pool_truncate(ctx->pool, seq, l, n_tokens);
		/* The new tail page was full and offloaded: bring its rows back to the
		 * tail tiles, where the next tokens will join them. */
		if (n_tokens % p && n_tokens / p != have / p) {
			/* the page exists (n_tokens <= have was checked above), so the
			 * lookup cannot fail; a NULL page is still not dereferenced */
			const uint32_t id = tail_page[l]; /* pinned above */
			const unsigned char *page = kvr_pool_page_data(ctx->pool, id);
			/* a quantised page gives back its dequantised tokens: what
			 * attention read of them, not the rows that were offloaded */
			struct kvr_quant_geometry gq;
			const int quant = page && !kvr_quant_geometry_init(&gq, c->page_tokens, c->head_dim, 1,
									   kvr_pool_page_format(ctx->pool, id));
			const uint64_t stride = kvr_pool_head_bytes(ctx->pool); /* mixed: unified runs */
			for (uint32_t h = 0; page && h < c->n_kv_heads; h++) {
				if (quant)
					kvr_quant_run_to_nhd(&gq, page + h * stride, c->page_tokens,
							     tail_keys(ctx, s, l), tail_values(ctx, s, l),
							     c->n_kv_heads * c->head_dim, c->dtype, h);
				else {
					/* an NHD pool's page interleaves the heads: gather
					 * the head's run as an HND pool would hold it */
					kvr_pool_gather_head(ctx->pool, id, h, run);
					kvr_hnd_run_to_nhd_slot(&g, run, tail_keys(ctx, s, l),
								tail_values(ctx, s, l), h);
				}
			}
			kvr_pool_unpin(ctx->pool, &id, 1);
		}
	}
	free(tail_page);
	free(run);
	/* the previous queries belonged to dropped tokens, and selections and
	 * resident pages may name dropped pages */
	kvr_sched_seq_reset(ctx->sched, seq);
	return 0;
}

KVR_API int kvr_prefill(struct kvr_context *ctx, uint32_t seq, uint32_t layer,
			uint64_t first_position, uint32_t n_tokens, const void *k, const void *v)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "prefill: ctx is NULL");
	int err = 0;
	struct kvr_sequence *s = live_idle(ctx, seq, "prefill", &err);
	if (!s)
		return err;
	if (layer >= ctx->config.n_layers)
		return kvr_fail(ctx, -EINVAL, "prefill: layer %u out of range (n_layers %u)", layer,
				ctx->config.n_layers);
	if (n_tokens && (!k || !v))
		return kvr_fail(ctx, -EINVAL, "prefill: k or v is NULL");
	kvr_sched_seq_quiesce(ctx->sched, seq); /* the pool may grow this layer's tables */
	struct kvr_tail_tile tail = { tail_keys(ctx, s, layer), tail_values(ctx, s, layer) };
	err = kvr_pool_ingest(ctx->pool, seq, layer, first_position, n_tokens, k, v, &tail);
	if (err)
		return kvr_fail(ctx, err, "prefill: %s", kvr_pool_last_error(ctx->pool));
	return 0;
}

KVR_API int kvr_prefill_attention(struct kvr_context *ctx, uint32_t seq, uint32_t layer,
				  uint64_t first_position, uint32_t n_tokens, const void *q,
				  void *out)
{
	if (!ctx)
		return kvr_fail(NULL, -EINVAL, "prefill_attention: ctx is NULL");
	int err = 0;
	if (!live(ctx, seq, "prefill_attention", &err))
		return err;
	if (layer >= ctx->config.n_layers)
		return kvr_fail(ctx, -EINVAL, "prefill_attention: layer %u out of range (n_layers %u)",
				layer, ctx->config.n_layers);
	if (ctx->step.open)
		return kvr_fail(ctx, -EBUSY, "prefill_attention: a decode step is open");
	if (!n_tokens)
		return 0;
	if (!q || !out)
		return kvr_fail(ctx, -EINVAL, "prefill_attention: q or out is NULL");
	uint64_t have = 0;
	kvr_pool_n_tokens(ctx->pool, seq, layer, &have);
	if (first_position > have || n_tokens > have - first_position) /* no wrap-around */
		return kvr_fail(ctx, -EINVAL,
				"prefill_attention: positions %llu..%llu of sequence %u layer %u are not "
				"stored yet (%llu tokens: call kvr_prefill first)",
				(unsigned long long)first_position,
				(unsigned long long)first_position + n_tokens - 1, seq, layer,
				(unsigned long long)have);
	kvr_sched_seq_quiesce(ctx->sched, seq);
	err = kvr_sched_prefill_attention(ctx->sched, seq, layer, first_position, n_tokens, q, out);
	if (err)
		return kvr_fail(ctx, err, "prefill_attention: %s", kvr_sched_last_error(ctx->sched));
	return 0;
}

void kvr_sequences_destroy(struct kvr_context *ctx)
{
	for (uint32_t id = 0; id < ctx->config.max_sequences; id++)
		if (ctx->seqs[id].alive)
			seq_release(ctx, id, 1);
}
