/* SPDX-License-Identifier: MIT */
/*
 * model.c — the forward pass of the real-model runner (model.h) for the
 * llama, qwen2 and qwen3 architectures: loading and validating the GGUF's
 * hyperparameters and tensors, and prefill and decode through kvrecall's
 * public API. The architectures share one layer function; what differs (Q/K/V
 * biases, per-head Q/K norms, NEOX or NORM RoPE, frequency factors) is
 * switched by what the loader found, so a new family adds a loader entry, not
 * a copy of the forward pass.
 *
 * Where the numbers come from: activations are quantised per matrix input the
 * way llama.cpp does (Q8_1 for Q4_1 weights, Q8_0 for Q8_0 weights: quant.h),
 * once for the inputs several matrices share (Q/K/V, gate/up); the KV handed
 * to kvrecall and the queries are f16, like llama.cpp's default KV cache.
 *
 * Threads: one driving thread per model; matrix rows are split over the
 * model's kvr_thread_pool, which the runner hands to its kvrecall contexts
 * too (kvr_config.parallel_for): one pool of workers, not two.
 */
#include "model.h"

#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ops.h"
#include "quant.h"

enum { PREFILL_CHUNK = 64 }; /* tokens per layer pass: 4 of kvrecall's prefill query blocks of 16 (G = 3) */

struct layer_w {
	const struct gguf_tensor *attn_norm, *wq, *wk, *wv, *wo, *ffn_norm, *gate, *up, *down;
	const struct gguf_tensor *bq, *bk, *bv;      /* qwen2 (optional elsewhere); NULL: none */
	const struct gguf_tensor *q_norm, *k_norm;   /* qwen3; NULL: none */
};

struct model {
	struct gguf *g;
	struct model_hparams hp;
	struct layer_w *layers;
	const struct gguf_tensor *token_embd, *output_norm, *output;
	const struct gguf_tensor *rope_freqs; /* Llama 3's frequency factors; NULL: none */
	struct kvr_thread_pool *pool;
	/* scratch, one row per token of a chunk ([PREFILL_CHUNK][...]) */
	float *x;             /* residual stream, n_embd */
	float *in;            /* a matrix product's f32 input, widest */
	float *q, *k, *v;     /* projections: qd, kvd, kvd */
	float *hb, *hb2;      /* n_ff */
	float *out;           /* a product's output, n_embd (or n_vocab for one row) */
	void *act;            /* quantised inputs, act_stride bytes per row */
	size_t act_stride, widest;
	uint16_t *q16, *k16, *v16, *o16; /* rows for kvrecall */
	/* kq_matmul's workspaces, one per part of a product (the pool's threads
	 * and the caller), each mm_space_bytes */
	unsigned char *mm_space;
	/* rope angles of the chunk's positions ([PREFILL_CHUNK][n_rot]), valid
	 * for rope_n tokens from rope_pos: every layer rotates at the same ones */
	float *rope_cs;
	uint64_t rope_pos;
	uint32_t rope_n, n_rot;
	size_t mm_space_bytes;
	uint32_t mm_parts;
	uint64_t attn_ns[2];  /* decode, prefill */
};

static int fail(char *err, size_t bytes, int code, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

static int fail(char *err, size_t bytes, int code, const char *fmt, ...)
{
	if (err && bytes) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(err, bytes, fmt, ap);
		va_end(ap);
	}
	return code;
}

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------ loading */

static int get_u32(const struct gguf *g, const char *key, uint32_t def, int required, uint32_t *out,
		   char *err, size_t eb)
{
	const int rc = gguf_get_u32(g, key, out);
	if (rc == -ENOENT && !required) {
		*out = def;
		return 0;
	}
	if (rc)
		return gguf_key_error(g, key, rc, "an unsigned 32-bit integer", err, eb);
	return 0;
}

static int get_f32(const struct gguf *g, const char *key, float def, float *out, char *err,
		   size_t eb)
{
	const int rc = gguf_get_f32(g, key, out);
	if (rc == -ENOENT) {
		*out = def;
		return 0;
	}
	if (rc)
		return gguf_key_error(g, key, rc, "a float", err, eb);
	return 0;
}

/* The tensor `name`, checked against the expected shape (ne1 = 0: a vector)
 * and usable type: F32 for vectors, a type quant.h multiplies for matrices. */
static int tensor(const struct model *m, const char *name, uint64_t ne0, uint64_t ne1,
		  const struct gguf_tensor **out, char *err, size_t eb)
{
	const struct gguf_tensor *t = gguf_find_tensor(m->g, name);
	if (!t)
		return fail(err, eb, -EINVAL, "model: tensor %s is missing", name);
	const uint64_t got1 = t->n_dims > 1 ? t->ne[1] : 0;
	if (t->ne[0] != ne0 || got1 != ne1 || t->ne[2] != 1 || t->ne[3] != 1)
		return fail(err, eb, -EINVAL,
			    "model: tensor %s is %llu x %llu, the hyperparameters need %llu x %llu", name,
			    (unsigned long long)t->ne[0], (unsigned long long)got1,
			    (unsigned long long)ne0, (unsigned long long)ne1);
	if (!ne1 && t->type != KQ_TYPE_F32)
		return fail(err, eb, -ENOTSUP, "model: tensor %s is %s; vectors (norms, biases) must be F32",
			    name, gguf_type_name(t->type));
	/* Vectors are read as floats in place: a file whose general.alignment
	 * (or a buffer whose address) leaves them off a 4-byte boundary is
	 * refused rather than read with misaligned loads. */
	if (!ne1 && ((uintptr_t)t->data & (sizeof(float) - 1)))
		return fail(err, eb, -EINVAL,
			    "model: tensor %s's data is not 4-byte aligned (general.alignment %u)", name,
			    gguf_alignment(m->g));
	if (ne1 && kq_matvec_act_type(t->type) < 0)
		return fail(err, eb, -ENOTSUP, "model: tensor %s has type %s, which this runner cannot "
					       "multiply",
			    name, gguf_type_name(t->type));
	*out = t;
	return 0;
}

static const struct {
	const char *name;
	enum model_arch arch;
} archs[] = { { "llama", MODEL_ARCH_LLAMA }, { "qwen2", MODEL_ARCH_QWEN2 }, { "qwen3", MODEL_ARCH_QWEN3 } };

/* The key "{arch}.suffix" into buf. */
static const char *arch_key(const struct model *m, const char *suffix, char *buf, size_t bytes)
{
	snprintf(buf, bytes, "%s.%s", m->hp.arch_name, suffix);
	return buf;
}

/* Rope scaling from {arch}.rope.scaling.* (or the older scale_linear): none
 * and linear are applied; the others (yarn, longrope) change the attention
 * itself and are refused by name rather than run wrong. */
static int load_rope_scaling(struct model *m, char *err, size_t eb)
{
	struct model_hparams *hp = &m->hp;
	char key[96], fkey[96];
	const char *type;
	size_t type_len;
	float factor = 1.0f;
	hp->rope_freq_scale = 1.0f;
	int rc = gguf_get_str(m->g, arch_key(m, "rope.scaling.type", key, sizeof(key)), &type, &type_len);
	if (rc == -ENOENT) {
		/* older files: {arch}.rope.scale_linear */
		if ((rc = get_f32(m->g, arch_key(m, "rope.scale_linear", fkey, sizeof(fkey)), 1.0f, &factor, err,
				  eb)))
			return rc;
	} else if (rc) {
		return gguf_key_error(m->g, key, rc, "a string", err, eb);
	} else if (type_len == 4 && !memcmp(type, "none", 4)) {
		factor = 1.0f;
	} else if (type_len == 6 && !memcmp(type, "linear", 6)) {
		if ((rc = get_f32(m->g, arch_key(m, "rope.scaling.factor", fkey, sizeof(fkey)), 1.0f, &factor,
				  err, eb)))
			return rc;
	} else {
		return fail(err, eb, -ENOTSUP,
			    "model: %s is \"%.*s\"; this runner applies rope scaling \"none\" and "
			    "\"linear\" only",
			    key, (int)(type_len > 32 ? 32 : type_len), type);
	}
	if (!(factor >= 1.0f && factor <= 1024.0f) && factor != 0.0f)
		return fail(err, eb, -EINVAL, "model: rope scaling factor %g is out of range [1, 1024]",
			    (double)factor);
	hp->rope_freq_scale = factor > 0.0f ? 1.0f / factor : 1.0f;
	return 0;
}

static int load_hparams(struct model *m, char *err, size_t eb)
{
	const struct gguf *g = m->g;
	struct model_hparams *hp = &m->hp;
	const char *arch;
	size_t arch_len;
	int rc = gguf_get_str(g, "general.architecture", &arch, &arch_len);
	if (rc)
		return gguf_key_error(g, "general.architecture", rc, "a string", err, eb);
	hp->arch_name = NULL;
	for (size_t i = 0; i < sizeof(archs) / sizeof(archs[0]); i++)
		if (strlen(archs[i].name) == arch_len && !memcmp(arch, archs[i].name, arch_len)) {
			hp->arch = archs[i].arch;
			hp->arch_name = archs[i].name;
		}
	if (!hp->arch_name)
		return fail(err, eb, -ENOTSUP,
			    "model: general.architecture is \"%.*s\"; this runner reads llama, qwen2 "
			    "and qwen3",
			    (int)(arch_len > 64 ? 64 : arch_len), arch);
	hp->rope_neox = hp->arch != MODEL_ARCH_LLAMA;
	hp->qkv_bias = hp->arch == MODEL_ARCH_QWEN2;
	hp->qk_norm = hp->arch == MODEL_ARCH_QWEN3;
	uint32_t ctx_len = 0;
	char key[96]; /* each getter is done with it before the next call */
	if ((rc = get_u32(g, arch_key(m, "block_count", key, sizeof(key)), 0, 1, &hp->n_layers, err, eb)) ||
	    (rc = get_u32(g, arch_key(m, "embedding_length", key, sizeof(key)), 0, 1, &hp->n_embd, err, eb)) ||
	    (rc = get_u32(g, arch_key(m, "attention.head_count", key, sizeof(key)), 0, 1, &hp->n_head, err, eb)) ||
	    (rc = get_u32(g, arch_key(m, "feed_forward_length", key, sizeof(key)), 0, 1, &hp->n_ff, err, eb)) ||
	    (rc = get_u32(g, arch_key(m, "context_length", key, sizeof(key)), 0, 0, &ctx_len, err, eb)) ||
	    (rc = get_f32(g, arch_key(m, "rope.freq_base", key, sizeof(key)), 10000.0f, &hp->rope_base, err, eb)) ||
	    (rc = get_f32(g, arch_key(m, "attention.layer_norm_rms_epsilon", key, sizeof(key)), 1e-5f, &hp->rms_eps,
			  err, eb)))
		return rc;
	hp->ctx_len = ctx_len;
	if (!hp->n_layers || !hp->n_embd || !hp->n_head || !hp->n_ff)
		return fail(err, eb, -EINVAL, "model: a zero hyperparameter (layers %u, embedding %u, "
					      "heads %u, feed-forward %u)",
			    hp->n_layers, hp->n_embd, hp->n_head, hp->n_ff);
	if ((rc = get_u32(g, arch_key(m, "attention.head_count_kv", key, sizeof(key)), hp->n_head, 0, &hp->n_head_kv,
			  err, eb)))
		return rc;
	if ((rc = get_u32(g, arch_key(m, "attention.key_length", key, sizeof(key)), hp->n_embd / hp->n_head, 0,
			  &hp->head_dim, err, eb)))
		return rc;
	uint32_t v_len = 0;
	if ((rc = get_u32(g, arch_key(m, "attention.value_length", key, sizeof(key)), hp->head_dim, 0, &v_len, err,
			  eb)))
		return rc;
	if (v_len != hp->head_dim)
		return fail(err, eb, -ENOTSUP,
			    "model: %s is %u but the key length is %u; kvrecall pages hold one head size",
			    key, v_len, hp->head_dim);
	if ((rc = get_u32(g, arch_key(m, "rope.dimension_count", key, sizeof(key)), hp->head_dim, 0, &hp->n_rot, err,
			  eb)))
		return rc;
	if (!hp->n_head_kv || hp->n_head % hp->n_head_kv || !hp->head_dim || hp->n_rot > hp->head_dim ||
	    hp->n_rot % 2)
		return fail(err, eb, -EINVAL,
			    "model: %u heads, %u KV heads, head size %u, %u rotated dimensions do not fit",
			    hp->n_head, hp->n_head_kv, hp->head_dim, hp->n_rot);
	if (!(hp->rms_eps > 0.0f) || !(hp->rope_base > 1.0f))
		return fail(err, eb, -EINVAL, "model: rms epsilon %g or rope base %g out of range",
			    (double)hp->rms_eps, (double)hp->rope_base);
	return load_rope_scaling(m, err, eb);
}

/* tensor() for one that may be absent: *out NULL then, unless required. */
static int tensor_opt(const struct model *m, const char *name, uint64_t ne0, uint64_t ne1, int required,
		      const struct gguf_tensor **out, char *err, size_t eb)
{
	*out = NULL;
	if (!required && !gguf_find_tensor(m->g, name))
		return 0;
	return tensor(m, name, ne0, ne1, out, err, eb);
}

static int load_tensors(struct model *m, char *err, size_t eb)
{
	const struct model_hparams *hp = &m->hp;
	const uint64_t qd = (uint64_t)hp->n_head * hp->head_dim, kvd = (uint64_t)hp->n_head_kv * hp->head_dim;
	const struct gguf_tensor *emb = gguf_find_tensor(m->g, "token_embd.weight");
	if (!emb || emb->n_dims != 2)
		return fail(err, eb, -EINVAL, "model: token_embd.weight is missing or not a matrix");
	/* token ids are int32_t, and n_vocab sizes the logits */
	if (emb->ne[1] > INT32_MAX)
		return fail(err, eb, -EINVAL, "model: token_embd.weight has %llu rows; at most 2^31-1 "
					      "tokens are supported",
			    (unsigned long long)emb->ne[1]);
	m->hp.n_vocab = (uint32_t)emb->ne[1];
	/* Every layer has 9 tensors, so the file bounds the block count: checked
	 * before the count sizes the layer table (4 billion layers from a forged
	 * llama.block_count would ask for 300 GB). */
	const uint64_t need = (uint64_t)hp->n_layers * 9 + 2, have = gguf_n_tensors(m->g);
	if (need > have)
		return fail(err, eb, -EINVAL,
			    "model: llama.block_count is %u, which needs at least %llu tensors; the file "
			    "has %llu",
			    hp->n_layers, (unsigned long long)need, (unsigned long long)have);
	int rc = tensor(m, "token_embd.weight", hp->n_embd, emb->ne[1], &m->token_embd, err, eb);
	if (!rc)
		rc = tensor(m, "output_norm.weight", hp->n_embd, 0, &m->output_norm, err, eb);
	if (rc)
		return rc;
	if (gguf_find_tensor(m->g, "output.weight"))
		rc = tensor(m, "output.weight", hp->n_embd, hp->n_vocab, &m->output, err, eb);
	else
		m->output = m->token_embd; /* tied embeddings */
	if (!rc)
		rc = tensor_opt(m, "rope_freqs.weight", hp->n_rot / 2, 0, 0, &m->rope_freqs, err, eb);
	if (rc)
		return rc;
	if (m->rope_freqs) {
		const float *f = m->rope_freqs->data;
		for (uint32_t i = 0; i < hp->n_rot / 2; i++)
			if (!(f[i] > 0.0f && f[i] < 1e6f))
				return fail(err, eb, -EINVAL, "model: rope_freqs.weight[%u] = %g is not a positive "
							      "frequency factor",
					    i, (double)f[i]);
	}
	m->layers = calloc(hp->n_layers, sizeof(*m->layers));
	if (!m->layers)
		return fail(err, eb, -ENOMEM, "model: out of memory");
	for (uint32_t l = 0; l < hp->n_layers && !rc; l++) {
		struct layer_w *w = &m->layers[l];
		char name[96];
#define T(field, suffix, ne0, ne1)                                                   \
	if (!rc) {                                                                   \
		snprintf(name, sizeof(name), "blk.%u." suffix ".weight", l);         \
		rc = tensor(m, name, ne0, ne1, &w->field, err, eb);                  \
	}
		T(attn_norm, "attn_norm", hp->n_embd, 0)
		T(wq, "attn_q", hp->n_embd, qd)
		T(wk, "attn_k", hp->n_embd, kvd)
		T(wv, "attn_v", hp->n_embd, kvd)
		T(wo, "attn_output", qd, hp->n_embd)
		T(ffn_norm, "ffn_norm", hp->n_embd, 0)
		T(gate, "ffn_gate", hp->n_embd, hp->n_ff)
		T(up, "ffn_up", hp->n_embd, hp->n_ff)
		T(down, "ffn_down", hp->n_ff, hp->n_embd)
#undef T
#define OPT(field, suffix, ne0, required)                                            \
	if (!rc) {                                                                   \
		snprintf(name, sizeof(name), "blk.%u." suffix, l);                   \
		rc = tensor_opt(m, name, ne0, 0, required, &w->field, err, eb);      \
	}
		/* llama.cpp reads Q/K/V biases wherever a llama file has them */
		OPT(bq, "attn_q.bias", qd, hp->qkv_bias)
		OPT(bk, "attn_k.bias", kvd, hp->qkv_bias)
		OPT(bv, "attn_v.bias", kvd, hp->qkv_bias)
		OPT(q_norm, "attn_q_norm.weight", hp->head_dim, hp->qk_norm)
		OPT(k_norm, "attn_k_norm.weight", hp->head_dim, hp->qk_norm)
#undef OPT
		if (!rc && !!w->q_norm != !!w->k_norm)
			rc = fail(err, eb, -EINVAL, "model: layer %u has only one of attn_q_norm and "
						    "attn_k_norm", l);
	}
	return rc;
}

static void *zalloc(size_t bytes, int *failed)
{
	void *p = NULL;
	if (posix_memalign(&p, 64, bytes ? bytes : 64)) {
		*failed = 1;
		return NULL;
	}
	memset(p, 0, bytes ? bytes : 64);
	return p;
}

/* What model_open and model_open_memory share once the GGUF is open (or
 * failed to, rc < 0): validation, the worker pool, scratch. Frees m on failure. */
static int open_model(struct model *m, int rc, uint32_t threads, struct model **out, char *err,
		      size_t eb)
{
	if (!rc)
		rc = load_hparams(m, err, eb);
	if (!rc)
		rc = load_tensors(m, err, eb);
	if (!rc && (rc = kvr_thread_pool_create(threads, &m->pool)))
		fail(err, eb, rc, "model: %s", kvr_last_error(NULL));
	if (!rc) {
		const struct model_hparams *hp = &m->hp;
		const size_t qd = (size_t)hp->n_head * hp->head_dim, kvd = (size_t)hp->n_head_kv * hp->head_dim;
		size_t widest = hp->n_embd > hp->n_ff ? hp->n_embd : hp->n_ff;
		widest = widest > qd ? widest : qd;
		int failed = 0;
		const size_t C = PREFILL_CHUNK;
		m->widest = widest;
		/* the larger of Q8_1 (36 bytes per 32) and Q8_K (292 per 256) rows */
		const size_t q8_1 = widest / 32 * 36, q8_k = (widest + 255) / 256 * 292;
		m->act_stride = ((q8_1 > q8_k ? q8_1 : q8_k) + 63) & ~(size_t)63;
		m->x = zalloc(C * hp->n_embd * sizeof(float), &failed);
		m->in = zalloc(C * widest * sizeof(float), &failed);
		m->q = zalloc(C * qd * sizeof(float), &failed);
		m->k = zalloc(C * kvd * sizeof(float), &failed);
		m->v = zalloc(C * kvd * sizeof(float), &failed);
		m->hb = zalloc(C * hp->n_ff * sizeof(float), &failed);
		m->hb2 = zalloc(C * hp->n_ff * sizeof(float), &failed);
		m->out = zalloc((C * hp->n_embd > hp->n_vocab ? C * hp->n_embd : hp->n_vocab) * sizeof(float),
				&failed);
		m->act = zalloc(C * m->act_stride, &failed);
		m->q16 = zalloc(C * qd * 2, &failed);
		m->k16 = zalloc(C * kvd * 2, &failed);
		m->v16 = zalloc(C * kvd * 2, &failed);
		m->o16 = zalloc(C * qd * 2, &failed);
		/* the widest product input (Q4_1 and Q8_0 take the same space) */
		m->mm_parts = kvr_thread_pool_threads(m->pool) + 1;
		m->mm_space_bytes = (kq_matmul_workspace_bytes(KQ_TYPE_Q4_1, widest, PREFILL_CHUNK) + 63) & ~(size_t)63;
		m->mm_space = zalloc(m->mm_parts * m->mm_space_bytes, &failed);
		m->n_rot = hp->n_rot; /* <= head_dim (load_hparams) */
		m->rope_cs = zalloc(C * m->n_rot * sizeof(float), &failed);
		if (failed)
			rc = fail(err, eb, -ENOMEM, "model: out of memory for scratch");
	}
	if (rc) {
		model_close(m);
		return rc;
	}
	*out = m;
	return 0;
}

int model_open(const char *path, uint32_t threads, struct model **out, char *err, size_t eb)
{
	*out = NULL;
	struct model *m = calloc(1, sizeof(*m));
	if (!m)
		return fail(err, eb, -ENOMEM, "model: out of memory");
	return open_model(m, gguf_open(path, &m->g, err, eb), threads, out, err, eb);
}

int model_open_memory(const void *data, size_t size, uint32_t threads, struct model **out,
		      char *err, size_t eb)
{
	*out = NULL;
	struct model *m = calloc(1, sizeof(*m));
	if (!m)
		return fail(err, eb, -ENOMEM, "model: out of memory");
	return open_model(m, gguf_open_memory(data, size, &m->g, err, eb), threads, out, err, eb);
}

void model_close(struct model *m)
{
	if (!m)
		return;
	kvr_thread_pool_destroy(m->pool);
	gguf_close(m->g);
	free(m->layers);
	free(m->x), free(m->in), free(m->q), free(m->k), free(m->v);
	free(m->hb), free(m->hb2), free(m->out), free(m->act);
	free(m->q16), free(m->k16), free(m->v16), free(m->o16), free(m->mm_space), free(m->rope_cs);
	free(m);
}

struct kvr_thread_pool *model_thread_pool(const struct model *m)
{
	return m->pool;
}

const struct model_hparams *model_hparams(const struct model *m)
{
	return &m->hp;
}

const struct gguf *model_gguf(const struct model *m)
{
	return m->g;
}

uint64_t model_attention_ns(const struct model *m, int prefill)
{
	return m->attn_ns[prefill ? 1 : 0];
}

void model_kvr_config(const struct model *m, struct kvr_config *c)
{
	c->n_layers = m->hp.n_layers;
	c->n_qo_heads = m->hp.n_head;
	c->n_kv_heads = m->hp.n_head_kv;
	c->head_dim = m->hp.head_dim;
	c->dtype = KVR_DTYPE_F16;
}

/* ------------------------------------------------------------------ products */

/*
 * Y = W X for a chunk of n rows of X: W's rows are split over the pool, and
 * each thread walks its rows in blocks small enough to stay in cache while
 * every token of the chunk multiplies them — the weights stream from memory
 * once per chunk instead of once per token (prefill), and a decode step
 * (n = 1) is a plain matrix-vector product.
 */
struct mm_job {
	const struct gguf_tensor *w;
	uint64_t row_bytes;
	uint32_t n;           /* rows of X */
	const void *xq;       /* quantised X, stride xq_stride bytes */
	size_t xq_stride;
	const float *xf;      /* f32 X, stride xf_stride floats */
	size_t xf_stride;
	float *y;             /* Y rows, stride y_stride floats */
	size_t y_stride;
	_Atomic int rc;       /* relaxed: read after the pool's join, which orders it */
	uint32_t parts;       /* row chunks: one per thread of the pool */
	unsigned char *space; /* kq_matmul workspaces, space_bytes per part */
	size_t space_bytes;
};

static void mm_part(struct mm_job *j, uint32_t index, uint32_t count)
{
	const uint64_t rows = j->w->ne[1];
	/* rows in multiples of 16 so no two threads write one cache line of y */
	const uint64_t per = ((rows + count - 1) / count + 15) & ~15ull;
	const uint64_t r0 = (uint64_t)index * per, r1 = r0 + per < rows ? r0 + per : rows;
	if (r0 >= r1)
		return;
	/* kq_matmul unpacks each weight row once for every token of the chunk
	 * (Q4_1, Q8_0) and streams the weights from memory once per chunk */
	const int rc = kq_matmul(j->w->type, j->w->data, j->row_bytes, rows, j->w->ne[0], j->xq, j->xq_stride,
				 j->xf, j->xf_stride, j->n, j->y, j->y_stride, r0, r1,
				 j->space + (size_t)index * j->space_bytes, j->space_bytes);
	if (rc)
		atomic_store_explicit(&j->rc, rc, memory_order_relaxed);
}

/* One chunk of a product's rows (a kvr_task_fn over the pool). */
static void mm_task(void *arg, uint32_t index)
{
	struct mm_job *j = arg;
	mm_part(j, index, j->parts);
}

/* Products streaming fewer weight bytes than this run on the caller alone. */
#define MM_PARALLEL_BYTES (4ull << 20)

/* Quantise rows of m->in (stride m->widest) for weights of `type` into m->act. */
static int quantise_inputs(struct model *m, uint32_t type, uint32_t n, uint64_t cols)
{
	const int act = kq_matvec_act_type(type);
	for (uint32_t t = 0; t < n; t++) {
		const float *x = m->in + (size_t)t * m->widest;
		void *dst = (unsigned char *)m->act + (size_t)t * m->act_stride;
		int rc = 0;
		if (act == KQ_TYPE_Q8_1)
			rc = kq_quantize_row_q8_1(x, dst, cols);
		else if (act == KQ_TYPE_Q8_0)
			rc = kq_quantize_row_q8_0(x, dst, cols);
		else if (act == KQ_TYPE_Q8_K)
			rc = kq_quantize_row_q8_k(x, dst, cols);
		if (rc)
			return rc;
	}
	return 0;
}

/* Y (n rows, stride y_stride) = W · the n rows of m->in, quantised first
 * unless `quantised` says m->act already holds them for W's type. */
static int matmul(struct model *m, const struct gguf_tensor *w, uint32_t n, int quantised, float *y,
		  size_t y_stride)
{
	if (!quantised) {
		int rc = quantise_inputs(m, w->type, n, w->ne[0]);
		if (rc)
			return rc;
	}
	struct mm_job j = { w,     gguf_row_bytes(w->type, w->ne[0]), n, m->act, m->act_stride, m->in,
			    m->widest, y, y_stride, 0, m->mm_parts, m->mm_space, m->mm_space_bytes };
	/* Waking the pool costs tens of µs on a busy machine, more than a decode
	 * step's small products take alone (SmolLM2's 576x1536 Q4_1 matrix, 0.5 MiB:
	 * ~20 µs on one core). Measured on the 2-core CI machine: decode at 2K
	 * tokens ran at 87 tokens/s on one thread and 43 with the pool waking for
	 * every product. So only products that stream at least MM_PARALLEL_BYTES
	 * of weights (the logits, prefill chunks) are split. */
	if ((uint64_t)j.row_bytes * w->ne[1] * n >= MM_PARALLEL_BYTES && j.parts > 1)
		kvr_thread_pool_parallel_for(m->pool, mm_task, &j, j.parts);
	else
		mm_part(&j, 0, 1);
	return atomic_load_explicit(&j.rc, memory_order_relaxed);
}

/* ------------------------------------------------------------------ layers */

static int embed(struct model *m, int32_t token, float *x, char *err, size_t eb)
{
	if (token < 0 || (uint32_t)token >= m->hp.n_vocab)
		return fail(err, eb, -EINVAL, "model: token %d outside the vocabulary (%u)", token,
			    m->hp.n_vocab);
	const struct gguf_tensor *t = m->token_embd;
	const uint64_t rb = gguf_row_bytes(t->type, t->ne[0]);
	const int rc = kq_dequantize_row(t->type, (const unsigned char *)t->data + (uint64_t)token * rb, x,
					 t->ne[0]);
	return rc ? fail(err, eb, rc, "model: embedding lookup: type %s", gguf_type_name(t->type)) : 0;
}

/* m->in rows = RMSNorm(x rows) * w. */
static void norm_rows(struct model *m, const float *w, uint32_t n)
{
	for (uint32_t t = 0; t < n; t++)
		op_rmsnorm(m->in + (size_t)t * m->widest, m->x + (size_t)t * m->hp.n_embd, w, m->hp.n_embd,
			   m->hp.rms_eps);
}

static void add_bias(float *x, const float *b, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++)
		x[i] += b[i];
}

/* One layer for n tokens at positions pos..: `attend` hands q16/k16/v16 to
 * kvrecall and fills o16. */
static int layer(struct model *m, const struct layer_w *w, uint32_t n, uint64_t pos,
		 int (*attend)(void *arg), void *arg)
{
	const struct model_hparams *hp = &m->hp;
	const uint32_t hd = hp->head_dim, qd = hp->n_head * hd, kvd = hp->n_head_kv * hd;
	norm_rows(m, w->attn_norm->data, n);
	/* Q, K and V share their input: quantised once when their types agree */
	int rc = matmul(m, w->wq, n, 0, m->q, qd);
	if (!rc)
		rc = matmul(m, w->wk, n, w->wk->type == w->wq->type, m->k, kvd);
	if (!rc)
		rc = matmul(m, w->wv, n, w->wv->type == w->wk->type, m->v, kvd);
	if (rc)
		return rc;
	if (m->rope_pos != pos || m->rope_n < n) {
		const float *factors = m->rope_freqs ? m->rope_freqs->data : NULL;
		for (uint32_t t = 0; t < n; t++)
			op_rope_cos_sin_scaled(m->n_rot, pos + t, hp->rope_base, hp->rope_freq_scale, factors,
					       m->rope_cs + (size_t)t * m->n_rot);
		m->rope_pos = pos;
		m->rope_n = n;
	}
	void (*rope)(float *, uint32_t, const float *) = hp->rope_neox ? op_rope_apply_neox : op_rope_apply;
	for (uint32_t t = 0; t < n; t++) {
		float *q = m->q + (size_t)t * qd, *k = m->k + (size_t)t * kvd, *v = m->v + (size_t)t * kvd;
		const float *cs = m->rope_cs + (size_t)t * m->n_rot;
		if (w->bq) {
			add_bias(q, w->bq->data, qd);
			add_bias(k, w->bk->data, kvd);
			add_bias(v, w->bv->data, kvd);
		}
		if (w->q_norm) {
			/* Qwen3: RMSNorm of each head's query and key before RoPE */
			for (uint32_t h = 0; h < hp->n_head; h++)
				op_rmsnorm(q + (size_t)h * hd, q + (size_t)h * hd, w->q_norm->data, hd, hp->rms_eps);
			for (uint32_t h = 0; h < hp->n_head_kv; h++)
				op_rmsnorm(k + (size_t)h * hd, k + (size_t)h * hd, w->k_norm->data, hd, hp->rms_eps);
		}
		for (uint32_t h = 0; h < hp->n_head; h++)
			rope(q + (size_t)h * hd, m->n_rot, cs);
		for (uint32_t h = 0; h < hp->n_head_kv; h++)
			rope(k + (size_t)h * hd, m->n_rot, cs);
		uint16_t *q16 = m->q16 + (size_t)t * qd, *k16 = m->k16 + (size_t)t * kvd,
			 *v16 = m->v16 + (size_t)t * kvd;
		for (uint32_t i = 0; i < qd; i++)
			q16[i] = op_f32_to_f16(q[i]);
		for (uint32_t i = 0; i < kvd; i++) {
			k16[i] = op_f32_to_f16(k[i]);
			v16[i] = op_f32_to_f16(v[i]);
		}
	}
	if ((rc = attend(arg)))
		return rc;
	for (uint32_t t = 0; t < n; t++)
		for (uint32_t i = 0; i < qd; i++)
			m->in[(size_t)t * m->widest + i] = op_f16_to_f32(m->o16[(size_t)t * qd + i]);
	if ((rc = matmul(m, w->wo, n, 0, m->out, hp->n_embd)))
		return rc;
	for (size_t i = 0; i < (size_t)n * hp->n_embd; i++)
		m->x[i] += m->out[i];
	norm_rows(m, w->ffn_norm->data, n);
	rc = matmul(m, w->gate, n, 0, m->hb, hp->n_ff);
	if (!rc)
		rc = matmul(m, w->up, n, w->up->type == w->gate->type, m->hb2, hp->n_ff);
	if (rc)
		return rc;
	for (uint32_t t = 0; t < n; t++) {
		op_swiglu(m->hb + (size_t)t * hp->n_ff, m->hb2 + (size_t)t * hp->n_ff, hp->n_ff);
		memcpy(m->in + (size_t)t * m->widest, m->hb + (size_t)t * hp->n_ff, hp->n_ff * sizeof(float));
	}
	if ((rc = matmul(m, w->down, n, 0, m->out, hp->n_embd)))
		return rc;
	for (size_t i = 0; i < (size_t)n * hp->n_embd; i++)
		m->x[i] += m->out[i];
	return 0;
}

/* Logits of residual row t. */
static int logits_of(struct model *m, uint32_t t, float *logits)
{
	op_rmsnorm(m->in, m->x + (size_t)t * m->hp.n_embd, m->output_norm->data, m->hp.n_embd,
		   m->hp.rms_eps);
	return matmul(m, m->output, 1, 0, logits, m->hp.n_vocab);
}

/* ------------------------------------------------------------------ prefill / decode */

struct prefill_arg {
	struct model *m;
	struct kvr_context *ctx;
	uint32_t seq, layer, n;
	uint64_t pos;
};

static int prefill_attend(void *arg)
{
	struct prefill_arg *a = arg;
	const uint64_t t0 = now_ns();
	int rc = kvr_prefill(a->ctx, a->seq, a->layer, a->pos, a->n, a->m->k16, a->m->v16);
	if (!rc)
		rc = kvr_prefill_attention(a->ctx, a->seq, a->layer, a->pos, a->n, a->m->q16, a->m->o16);
	a->m->attn_ns[1] += now_ns() - t0;
	return rc;
}

int model_prefill(struct model *m, struct kvr_context *ctx, uint32_t seq, const int32_t *tokens,
		  uint32_t n, uint64_t pos0, float *logits, char *err, size_t eb)
{
	const struct model_hparams *hp = &m->hp;
	for (uint32_t at = 0; at < n; at += PREFILL_CHUNK) {
		const uint32_t c = n - at < PREFILL_CHUNK ? n - at : PREFILL_CHUNK;
		int rc = 0;
		for (uint32_t t = 0; t < c && !rc; t++)
			rc = embed(m, tokens[at + t], m->x + (size_t)t * hp->n_embd, err, eb);
		if (rc)
			return rc;
		for (uint32_t l = 0; l < hp->n_layers; l++) {
			struct prefill_arg a = { m, ctx, seq, l, c, pos0 + at };
			rc = layer(m, &m->layers[l], c, pos0 + at, prefill_attend, &a);
			if (rc)
				return fail(err, eb, rc, "model: layer %u: %s", l,
					    rc == -ENOTSUP || rc == -EINVAL ? "matrix product failed"
									   : kvr_last_error(ctx));
		}
		if (logits && at + c == n && (rc = logits_of(m, c - 1, logits)))
			return fail(err, eb, rc, "model: output matrix failed (%d)", rc);
	}
	return 0;
}

struct decode_arg {
	struct model *m;
	struct kvr_context *ctx;
	uint32_t layer;
	int32_t status;
};

static int decode_attend(void *arg)
{
	struct decode_arg *a = arg;
	const uint64_t t0 = now_ns();
	int rc = kvr_decode_layer(a->ctx, a->layer, a->m->q16, a->m->k16, a->m->v16, a->m->o16,
				  &a->status, NULL);
	a->m->attn_ns[0] += now_ns() - t0;
	return rc ? rc : a->status;
}

int model_decode(struct model *m, struct kvr_context *ctx, uint32_t seq, int32_t token,
		 uint64_t pos, float *logits, char *err, size_t eb)
{
	const struct model_hparams *hp = &m->hp;
	int rc = embed(m, token, m->x, err, eb);
	if (rc)
		return rc;
	if ((rc = kvr_decode_begin(ctx, &seq, &pos, 1)))
		return fail(err, eb, rc, "model: %s", kvr_last_error(ctx));
	for (uint32_t l = 0; l < hp->n_layers && !rc; l++) {
		struct decode_arg a = { m, ctx, l, 0 };
		rc = layer(m, &m->layers[l], 1, pos, decode_attend, &a);
		if (rc)
			fail(err, eb, rc, "model: layer %u: %s", l, kvr_last_error(ctx));
	}
	const int end = kvr_decode_end(ctx);
	if (rc)
		return rc;
	if (end)
		return fail(err, eb, end, "model: %s", kvr_last_error(ctx));
	if (logits && (rc = logits_of(m, 0, logits)))
		return fail(err, eb, rc, "model: output matrix failed (%d)", rc);
	return 0;
}
