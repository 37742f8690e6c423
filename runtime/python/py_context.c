/* SPDX-License-Identifier: MIT */
/*
 * py_context.c — the extension's Context, DecodeStep and ThreadPool types:
 * a kvr_context and its calls (sequences, prefill, decode steps, stats,
 * traces) with tensors read in place, errors as exceptions carrying
 * kvr_last_error's message, and the GIL dropped around every kvrecall call.
 *
 * Threads. Any Python thread may use a Context. Each kvrecall call runs
 * without the GIL and under the Context's mutex (`lock`), which is taken only
 * after the GIL is dropped and never while waiting for the GIL, so the two
 * cannot deadlock; the mutex makes close() wait for calls in flight and
 * serialises calls from several Python threads (the C API lets different
 * sequences be used from different threads, but a step and a close must not
 * overlap anything). The library's log callback may run on kvrecall's own
 * threads: it only queues the message (`log_queue`); the Python thread that
 * next returns from a call hands queued messages to the `logging` logger
 * "kvrecall", so no kvrecall thread ever takes the GIL.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "py_internal.h"

PyObject *kvr_py_ContextType;
PyObject *kvr_py_StepType;
PyObject *kvr_py_ThreadPoolType;

/* ---------------------------------------------------------------------------
 * The log queue
 * ------------------------------------------------------------------------- */

#define LOG_QUEUE_CAP 64
#define LOG_TEXT_BYTES 512

struct log_queue {
	pthread_mutex_t lock;
	uint32_t head, count, dropped;
	int level[LOG_QUEUE_CAP];
	char text[LOG_QUEUE_CAP][LOG_TEXT_BYTES];
	/* Set by the callback after queueing (release), read by the Python
	 * thread after each call (acquire) to skip the mutex when empty. */
	atomic_uint pending;
};

/* kvrecall's log callback: any kvrecall thread, no GIL. */
static void log_enqueue(void *user, enum kvr_log_level level, const char *message)
{
	struct log_queue *q = user;
	pthread_mutex_lock(&q->lock);
	if (q->count < LOG_QUEUE_CAP) {
		const uint32_t i = (q->head + q->count) % LOG_QUEUE_CAP;
		q->level[i] = (int)level;
		snprintf(q->text[i], LOG_TEXT_BYTES, "%s", message);
		q->count++;
	} else {
		q->dropped++;
	}
	pthread_mutex_unlock(&q->lock);
	atomic_store_explicit(&q->pending, 1, memory_order_release); /* pairs with log_flush's load */
}

static PyObject *kvrecall_logger;

/* Hand queued messages to logging.getLogger("kvrecall"). Python thread with
 * the GIL. An exception pending on entry is kept. */
static void log_flush(struct log_queue *q)
{
	if (!q || !atomic_load_explicit(&q->pending, memory_order_acquire)) /* pairs with log_enqueue */
		return;
	int levels[LOG_QUEUE_CAP];
	static char texts[LOG_QUEUE_CAP][LOG_TEXT_BYTES]; /* guarded by the GIL */
	uint32_t n, dropped;
	pthread_mutex_lock(&q->lock);
	n = q->count;
	for (uint32_t j = 0; j < n; j++) {
		const uint32_t i = (q->head + j) % LOG_QUEUE_CAP;
		levels[j] = q->level[i];
		memcpy(texts[j], q->text[i], LOG_TEXT_BYTES);
	}
	q->head = (q->head + n) % LOG_QUEUE_CAP;
	q->count = 0;
	dropped = q->dropped;
	q->dropped = 0;
	atomic_store_explicit(&q->pending, 0, memory_order_relaxed); /* under the lock that queues */
	pthread_mutex_unlock(&q->lock);

	PyObject *type, *value, *tb;
	PyErr_Fetch(&type, &value, &tb);
	if (!kvrecall_logger) {
		PyObject *logging = PyImport_ImportModule("logging");
		if (logging) {
			kvrecall_logger = PyObject_CallMethod(logging, "getLogger", "s", "kvrecall");
			Py_DECREF(logging);
		}
	}
	if (kvrecall_logger) {
		/* A kvrecall ERROR message is the message of a failed call, which
		 * the raised exception (or async_error()) already carries: it goes
		 * to DEBUG so it is not printed twice. */
		static const int py_level[] = { 10, 30, 20, 10 }; /* DEBUG, WARNING, INFO, DEBUG */
		for (uint32_t j = 0; j < n; j++) {
			const int lv = levels[j] >= 0 && levels[j] <= 3 ? py_level[levels[j]] : 10;
			PyObject *r = PyObject_CallMethod(kvrecall_logger, "log", "is", lv, texts[j]);
			Py_XDECREF(r);
		}
		if (dropped) {
			PyObject *r = PyObject_CallMethod(kvrecall_logger, "log", "is", 30,
							  "log messages were dropped: more than 64 arrived between two calls");
			Py_XDECREF(r);
		}
	}
	PyErr_Clear();
	PyErr_Restore(type, value, tb);
}

/* ---------------------------------------------------------------------------
 * Context
 * ------------------------------------------------------------------------- */

typedef struct step_object StepObject;

typedef struct {
	PyObject_HEAD
	struct kvr_context *ctx; /* NULL once closed; written under `lock` */
	pthread_mutex_t lock;
	struct kvr_config cfg; /* the resolved configuration */
	uint32_t elem_bytes;
	PyObject *pool;        /* the ThreadPool object the context uses, or NULL */
	StepObject *open_step; /* borrowed: the step holds the context, not the reverse */
	struct log_queue *log;
	/* Time inside kvr_decode_layer as the binding sees it (under `lock`),
	 * so that a benchmark can tell the binding's own cost from kvrecall's. */
	uint64_t layer_calls, layer_call_ns;
} ContextObject;

struct step_object {
	PyObject_HEAD
	ContextObject *owner; /* strong */
	uint32_t batch;
	int open;
	uint32_t layers_done;
	int32_t *status;      /* per sequence: its first failure in this step, or 0 */
	int32_t *layer_status;
	uint32_t *seqs;
};

/* A kvrecall call on c->ctx without the GIL and under c->lock. `rc` receives
 * the result, -EBADF when the context is closed; on failure `msg` receives
 * the context's message (read under the lock, so another thread's failure
 * cannot replace it). */
#define CTX_CALL(c, rc, msg, expr)                                                      \
	do {                                                                            \
		Py_BEGIN_ALLOW_THREADS pthread_mutex_lock(&(c)->lock);                  \
		if (!(c)->ctx) {                                                        \
			(rc) = -EBADF;                                                  \
		} else {                                                                \
			(rc) = (expr);                                                  \
			if ((rc) < 0)                                                   \
				snprintf((msg), sizeof(msg), "%s", kvr_last_error((c)->ctx)); \
		}                                                                       \
		pthread_mutex_unlock(&(c)->lock);                                       \
		Py_END_ALLOW_THREADS                                                    \
	} while (0)

static PyObject *closed_error(const char *call)
{
	return kvr_py_raisef(-EINVAL, "%s: the context is closed", call);
}

/* Raise the error of a CTX_CALL. */
static PyObject *call_error(ContextObject *c, int rc, const char *msg, const char *call)
{
	log_flush(c->log);
	if (rc == -EBADF && !c->ctx)
		return closed_error(call);
	return kvr_py_raise(rc, msg[0] ? msg : kvr_strerror(rc));
}

static int parse_u32(PyObject *o, const char *call, const char *what, uint32_t *out)
{
	PyObject *idx = PyNumber_Index(o);
	if (!idx)
		return -1;
	const unsigned long long v = PyLong_AsUnsignedLongLong(idx);
	Py_DECREF(idx);
	if (v == (unsigned long long)-1 && PyErr_Occurred()) {
		PyErr_Clear();
		kvr_py_raisef(-EINVAL, "%s: %s must be a non-negative integer below 2^32", call, what);
		return -1;
	}
	if (v > UINT32_MAX) {
		kvr_py_raisef(-EINVAL, "%s: %s = %llu does not fit 32 bits", call, what, v);
		return -1;
	}
	*out = (uint32_t)v;
	return 0;
}

static int parse_u64(PyObject *o, const char *call, const char *what, uint64_t *out)
{
	PyObject *idx = PyNumber_Index(o);
	if (!idx)
		return -1;
	const unsigned long long v = PyLong_AsUnsignedLongLong(idx);
	Py_DECREF(idx);
	if (v == (unsigned long long)-1 && PyErr_Occurred()) {
		PyErr_Clear();
		kvr_py_raisef(-EINVAL, "%s: %s must be a non-negative integer", call, what);
		return -1;
	}
	*out = v;
	return 0;
}

static int context_init(PyObject *self_obj, PyObject *args, PyObject *kwargs)
{
	ContextObject *self = (ContextObject *)self_obj;
	static char *kwlist[] = { "config", "thread_pool", NULL };
	PyObject *mapping = NULL, *pool = Py_None;
	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!|O", kwlist, &PyDict_Type, &mapping, &pool))
		return -1;
	if (self->ctx || self->log) {
		PyErr_SetString(PyExc_RuntimeError, "Context.__init__ called twice");
		return -1;
	}
	struct kvr_config cfg;
	if (kvr_py_config_from_mapping(mapping, &cfg))
		return -1;
	struct kvr_thread_pool *tp = NULL;
	if (pool != Py_None) {
		tp = kvr_py_thread_pool_of(pool);
		if (!tp)
			return -1;
		PyObject *n = PyObject_GetAttrString(pool, "threads");
		if (!n)
			return -1;
		cfg.threads = (uint32_t)PyLong_AsUnsignedLong(n);
		Py_DECREF(n);
		cfg.parallel_for = kvr_thread_pool_parallel_for;
		cfg.parallel_user = tp;
	}
	self->log = calloc(1, sizeof *self->log);
	if (!self->log) {
		PyErr_NoMemory();
		return -1;
	}
	pthread_mutex_init(&self->log->lock, NULL);
	cfg.log_fn = log_enqueue;
	cfg.log_user = self->log;

	struct kvr_context *ctx = NULL;
	int rc;
	char msg[512] = "";
	Py_BEGIN_ALLOW_THREADS rc = kvr_context_create(&cfg, &ctx);
	if (rc)
		snprintf(msg, sizeof msg, "%s", kvr_last_error(NULL));
	Py_END_ALLOW_THREADS
	log_flush(self->log);
	if (rc) {
		kvr_py_raise(rc, msg);
		return -1;
	}
	self->cfg.size = sizeof self->cfg;
	kvr_context_get_config(ctx, &self->cfg);
	self->elem_bytes = self->cfg.dtype == KVR_DTYPE_F32 ? 4 : 2;
	if (pool != Py_None) {
		Py_INCREF(pool);
		self->pool = pool;
		kvr_py_thread_pool_hold(pool, 1);
	}
	self->ctx = ctx; /* no other thread can see self yet */
	return 0;
}

static void step_cancel(StepObject *s);

/* Close: cancel an open step, destroy the context. Python thread (GIL). */
static void context_close_impl(ContextObject *self)
{
	if (self->open_step)
		step_cancel(self->open_step);
	struct kvr_context *ctx = NULL;
	Py_BEGIN_ALLOW_THREADS pthread_mutex_lock(&self->lock);
	ctx = self->ctx;
	self->ctx = NULL;
	kvr_context_destroy(ctx);
	pthread_mutex_unlock(&self->lock);
	Py_END_ALLOW_THREADS
	log_flush(self->log);
	if (self->pool) {
		kvr_py_thread_pool_hold(self->pool, -1);
		Py_CLEAR(self->pool);
	}
}

static PyObject *context_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
	(void)args;
	(void)kwargs;
	allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
	ContextObject *self = (ContextObject *)alloc(type, 0);
	if (!self)
		return NULL;
	pthread_mutex_init(&self->lock, NULL);
	return (PyObject *)self;
}

static void context_dealloc(PyObject *obj)
{
	ContextObject *self = (ContextObject *)obj;
	PyTypeObject *tp = Py_TYPE(obj);
	context_close_impl(self);
	if (self->log) {
		pthread_mutex_destroy(&self->log->lock);
		free(self->log);
	}
	pthread_mutex_destroy(&self->lock);
	freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
	f(obj);
	Py_DECREF(tp);
}

static PyObject *context_close(PyObject *obj, PyObject *unused)
{
	(void)unused;
	context_close_impl((ContextObject *)obj);
	Py_RETURN_NONE;
}

static PyObject *context_enter(PyObject *obj, PyObject *unused)
{
	(void)unused;
	Py_INCREF(obj);
	return obj;
}

static PyObject *context_exit(PyObject *obj, PyObject *args)
{
	(void)args;
	context_close_impl((ContextObject *)obj);
	Py_RETURN_FALSE;
}

static PyObject *context_get_closed(PyObject *obj, void *closure)
{
	(void)closure;
	return PyBool_FromLong(((ContextObject *)obj)->ctx == NULL);
}

static PyObject *context_config(PyObject *obj, PyObject *unused)
{
	(void)unused;
	ContextObject *self = (ContextObject *)obj;
	if (!self->ctx)
		return closed_error("config");
	return kvr_py_config_to_dict(&self->cfg);
}

static PyObject *context_seq_create(PyObject *obj, PyObject *unused)
{
	(void)unused;
	ContextObject *self = (ContextObject *)obj;
	uint32_t seq = 0;
	int rc;
	char msg[512] = "";
	CTX_CALL(self, rc, msg, kvr_seq_create(self->ctx, &seq));
	if (rc)
		return call_error(self, rc, msg, "seq_create");
	log_flush(self->log);
	return PyLong_FromUnsignedLong(seq);
}

static PyObject *context_seq_free(PyObject *obj, PyObject *arg)
{
	ContextObject *self = (ContextObject *)obj;
	uint32_t seq;
	if (parse_u32(arg, "seq_free", "seq", &seq))
		return NULL;
	int rc;
	char msg[512] = "";
	CTX_CALL(self, rc, msg, kvr_seq_free(self->ctx, seq));
	if (rc)
		return call_error(self, rc, msg, "seq_free");
	log_flush(self->log);
	Py_RETURN_NONE;
}

static PyObject *context_seq_fork(PyObject *obj, PyObject *arg)
{
	ContextObject *self = (ContextObject *)obj;
	uint32_t seq, dst = 0;
	if (parse_u32(arg, "seq_fork", "seq", &seq))
		return NULL;
	int rc;
	char msg[512] = "";
	CTX_CALL(self, rc, msg, kvr_seq_fork(self->ctx, seq, &dst));
	if (rc)
		return call_error(self, rc, msg, "seq_fork");
	log_flush(self->log);
	return PyLong_FromUnsignedLong(dst);
}

static PyObject *context_seq_truncate(PyObject *obj, PyObject *args)
{
	ContextObject *self = (ContextObject *)obj;
	PyObject *so, *no;
	if (!PyArg_ParseTuple(args, "OO:seq_truncate", &so, &no))
		return NULL;
	uint32_t seq;
	uint64_t n;
	if (parse_u32(so, "seq_truncate", "seq", &seq) || parse_u64(no, "seq_truncate", "n_tokens", &n))
		return NULL;
	int rc;
	char msg[512] = "";
	CTX_CALL(self, rc, msg, kvr_seq_truncate(self->ctx, seq, n));
	if (rc)
		return call_error(self, rc, msg, "seq_truncate");
	log_flush(self->log);
	Py_RETURN_NONE;
}

static PyObject *context_seq_length(PyObject *obj, PyObject *args)
{
	ContextObject *self = (ContextObject *)obj;
	PyObject *so, *lo = NULL;
	if (!PyArg_ParseTuple(args, "O|O:seq_length", &so, &lo))
		return NULL;
	uint32_t seq, layer = 0;
	if (parse_u32(so, "seq_length", "seq", &seq) || (lo && parse_u32(lo, "seq_length", "layer", &layer)))
		return NULL;
	uint64_t n = 0;
	int rc;
	char msg[512] = "";
	CTX_CALL(self, rc, msg, kvr_seq_length(self->ctx, seq, layer, &n));
	if (rc)
		return call_error(self, rc, msg, "seq_length");
	return PyLong_FromUnsignedLongLong(n);
}

/* Check a tensor argument's element type, device and size. `rows` is the
 * number of [heads][d] rows expected, or 0 when the tensor's size decides it
 * (then *rows_out receives it). */
static int check_tensor(const ContextObject *c, const struct kvr_py_tensor *t, const char *call, const char *role,
			uint32_t heads, uint64_t rows, uint64_t *rows_out, int device)
{
	const uint32_t d = c->cfg.head_dim;
	if (t->dtype != (int)c->cfg.dtype && !(t->dtype == 100 && c->cfg.dtype == KVR_DTYPE_BF16)) {
		const char *got = t->dtype >= 0 && t->dtype < 100 ? kvr_py_dtype_display(t->dtype)
			: t->dtype == 100 ? "uint16" : t->dtype_name;
		kvr_py_raisef(-EINVAL, "%s: %s: expected %s (the context's dtype %s), got %s", call, role,
			      kvr_py_dtype_display((int)c->cfg.dtype), kvr_dtype_name(c->cfg.dtype), got);
		return -1;
	}
	if (t->device != device) {
		if (device == KVR_PY_HOST)
			kvr_py_raisef(-EINVAL, "%s: %s: a CUDA tensor, but this call reads host memory (%s)", call, role,
				      c->cfg.backend == KVR_BACKEND_CPU ? "the context's backend is cpu" : "move it with .cpu()");
		else
			kvr_py_raisef(-EINVAL,
				      "%s: %s: a host tensor, but the context's backend is cuda: pass CUDA tensors", call,
				      role);
		return -1;
	}
	/* [rows, heads, d], or any shape [rows, ...] whose other dims hold
	 * heads x d elements and end in d or heads x d (transformers' decode
	 * query [batch, heads, 1, d], a projection's [tokens, heads x d]) */
	const uint64_t row = (uint64_t)heads * d;
	const int64_t last = t->ndim >= 2 && t->ndim <= 8 ? t->shape[t->ndim - 1] : -1;
	int64_t inner = 1;
	for (int i = 1; i < t->ndim && i < 8; i++)
		inner *= t->shape[i];
	const int shape_ok = t->ndim >= 2 && t->ndim <= 8 && (last == (int64_t)d || last == (int64_t)row) &&
			     inner == (int64_t)row;
	const uint64_t n = shape_ok ? (uint64_t)t->shape[0] : 0;
	if (!shape_ok || (rows && n != rows)) {
		char shape[160] = "(";
		size_t off = 1;
		for (int i = 0; i < t->ndim && i < 8 && off < sizeof shape - 24; i++)
			off += (size_t)snprintf(shape + off, sizeof shape - off, "%s%lld", i ? ", " : "",
						(long long)t->shape[i]);
		snprintf(shape + off, sizeof shape - off, "%s)", t->ndim == 1 ? "," : "");
		if (rows)
			kvr_py_raisef(-EINVAL,
				      "%s: %s: expected shape (%llu, %u, %u) (%llu x %u heads x head_dim), or "
				      "(%llu, ...) with the same elements per row, ending in %u or %llu; got %s",
				      call, role, (unsigned long long)rows, heads, d, (unsigned long long)rows, heads,
				      (unsigned long long)rows, d, (unsigned long long)row, shape);
		else
			kvr_py_raisef(-EINVAL,
				      "%s: %s: expected shape (n_tokens, %u, %u) (tokens x %u heads x head_dim), or "
				      "(n_tokens, ...) with %llu elements per token, ending in %u or %llu; got %s",
				      call, role, heads, d, heads, (unsigned long long)row, d, (unsigned long long)row,
				      shape);
		return -1;
	}
	if (rows_out)
		*rows_out = n;
	return 0;
}

/* The calls below run under the context's lock without the GIL (CTX_CALL):
 * a default position is read in the same critical section as its use. */
static int prefill_at(struct kvr_context *ctx, uint32_t seq, uint32_t layer, int have_pos, uint64_t pos,
		      uint32_t n, const void *k, const void *v)
{
	int rc = have_pos ? 0 : kvr_seq_length(ctx, seq, layer, &pos);
	return rc ? rc : kvr_prefill(ctx, seq, layer, pos, n, k, v);
}

/* Without a position: the last n tokens stored (those just prefilled). */
static int prefill_attention_at(struct kvr_context *ctx, uint32_t seq, uint32_t layer, int have_pos, uint64_t pos,
				uint32_t n, const void *q, void *out)
{
	if (!have_pos) {
		uint64_t len = 0;
		const int rc = kvr_seq_length(ctx, seq, layer, &len);
		if (rc)
			return rc;
		pos = len >= n ? len - n : 0;
	}
	return kvr_prefill_attention(ctx, seq, layer, pos, n, q, out);
}

/* Without positions: each sequence's length (in layer 0). */
static int decode_begin_at(struct kvr_context *ctx, const uint32_t *seqs, int have_pos, uint64_t *positions,
			   uint32_t n)
{
	for (uint32_t i = 0; !have_pos && i < n; i++) {
		const int rc = kvr_seq_length(ctx, seqs[i], 0, &positions[i]);
		if (rc)
			return rc;
	}
	return kvr_decode_begin(ctx, seqs, positions, n);
}

/* 1 and the message when the context's threads failed, else 0. */
static int async_error_text(struct kvr_context *ctx, char *text, size_t bytes)
{
	const char *m = NULL;
	const int e = kvr_async_error(ctx, &m);
	if (!e)
		return 0;
	snprintf(text, bytes, "%s (%s)", m ? m : "", kvr_strerror(e));
	return 1;
}

static PyObject *context_prefill(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	ContextObject *self = (ContextObject *)obj;
	static char *kwlist[] = { "seq", "layer", "k", "v", "position", NULL };
	PyObject *so, *lo, *ko, *vo, *po = Py_None;
	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO|O:prefill", kwlist, &so, &lo, &ko, &vo, &po))
		return NULL;
	if (!self->ctx)
		return closed_error("prefill");
	uint32_t seq, layer;
	if (parse_u32(so, "prefill", "seq", &seq) || parse_u32(lo, "prefill", "layer", &layer))
		return NULL;
	uint64_t pos = 0;
	int have_pos = po != Py_None;
	if (have_pos && parse_u64(po, "prefill", "position", &pos))
		return NULL;
	struct kvr_py_tensor k, v;
	if (kvr_py_tensor_get(ko, "prefill", "k", 0, &k))
		return NULL;
	if (kvr_py_tensor_get(vo, "prefill", "v", 0, &v)) {
		kvr_py_tensor_release(&k);
		return NULL;
	}
	PyObject *result = NULL;
	uint64_t nk = 0, nv = 0;
	if (check_tensor(self, &k, "prefill", "k", self->cfg.n_kv_heads, 0, &nk, KVR_PY_HOST) ||
	    check_tensor(self, &v, "prefill", "v", self->cfg.n_kv_heads, 0, &nv, KVR_PY_HOST))
		goto out;
	if (nk != nv) {
		kvr_py_raisef(-EINVAL, "prefill: k holds %llu tokens and v %llu: they must match",
			      (unsigned long long)nk, (unsigned long long)nv);
		goto out;
	}
	if (nk > UINT32_MAX) {
		kvr_py_raisef(-EINVAL, "prefill: %llu tokens in one call; at most 2^32 - 1", (unsigned long long)nk);
		goto out;
	}
	int rc;
	char msg[512] = "";
	CTX_CALL(self, rc, msg, prefill_at(self->ctx, seq, layer, have_pos, pos, (uint32_t)nk, k.data, v.data));
	if (rc) {
		call_error(self, rc, msg, "prefill");
		goto out;
	}
	log_flush(self->log);
	result = Py_None;
	Py_INCREF(result);
out:
	kvr_py_tensor_release(&k);
	kvr_py_tensor_release(&v);
	return result;
}

static PyObject *context_prefill_attention(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	ContextObject *self = (ContextObject *)obj;
	static char *kwlist[] = { "seq", "layer", "q", "out", "position", NULL };
	PyObject *so, *lo, *qo, *oo = Py_None, *po = Py_None;
	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|OO:prefill_attention", kwlist, &so, &lo, &qo, &oo,
					 &po))
		return NULL;
	if (!self->ctx)
		return closed_error("prefill_attention");
	uint32_t seq, layer;
	if (parse_u32(so, "prefill_attention", "seq", &seq) || parse_u32(lo, "prefill_attention", "layer", &layer))
		return NULL;
	uint64_t pos = 0;
	const int have_pos = po != Py_None;
	if (have_pos && parse_u64(po, "prefill_attention", "position", &pos))
		return NULL;
	struct kvr_py_tensor q, o;
	if (kvr_py_tensor_get(qo, "prefill_attention", "q", 0, &q))
		return NULL;
	PyObject *out = oo;
	if (out == Py_None) {
		out = kvr_py_empty_like(qo, &q);
		if (!out) {
			kvr_py_tensor_release(&q);
			return NULL;
		}
	} else {
		Py_INCREF(out);
	}
	if (kvr_py_tensor_get(out, "prefill_attention", "out", 1, &o)) {
		kvr_py_tensor_release(&q);
		Py_DECREF(out);
		return NULL;
	}
	PyObject *result = NULL;
	uint64_t n = 0;
	if (check_tensor(self, &q, "prefill_attention", "q", self->cfg.n_qo_heads, 0, &n, KVR_PY_HOST) ||
	    check_tensor(self, &o, "prefill_attention", "out", self->cfg.n_qo_heads, n, NULL, KVR_PY_HOST))
		goto out;
	if (n > UINT32_MAX) {
		kvr_py_raisef(-EINVAL, "prefill_attention: %llu queries in one call; at most 2^32 - 1",
			      (unsigned long long)n);
		goto out;
	}
	int rc;
	char msg[512] = "";
	CTX_CALL(self, rc, msg, prefill_attention_at(self->ctx, seq, layer, have_pos, pos, (uint32_t)n, q.data, o.data));
	if (rc) {
		call_error(self, rc, msg, "prefill_attention");
		goto out;
	}
	log_flush(self->log);
	result = out;
	Py_INCREF(result);
out:
	kvr_py_tensor_release(&q);
	kvr_py_tensor_release(&o);
	Py_DECREF(out);
	return result;
}

/* Read a sequence of integers (ids or positions) into a new array. */
static int read_ints(PyObject *seq, const char *call, const char *what, uint64_t limit, uint64_t **out, uint32_t *n)
{
	PyObject *fast = PySequence_List(seq);
	if (!fast) {
		PyErr_Clear();
		kvr_py_raisef(-EINVAL, "%s: %s must be a sequence of integers", call, what);
		return -1;
	}
	const Py_ssize_t len = PyList_Size(fast);
	uint64_t *a = calloc(len > 0 ? (size_t)len : 1, sizeof *a);
	if (!a) {
		Py_DECREF(fast);
		PyErr_NoMemory();
		return -1;
	}
	for (Py_ssize_t i = 0; i < len; i++) {
		uint64_t v;
		if (parse_u64(PyList_GetItem(fast, i), call, what, &v)) {
			free(a);
			Py_DECREF(fast);
			return -1;
		}
		if (v > limit) {
			kvr_py_raisef(-EINVAL, "%s: %s[%zd] = %llu is out of range", call, what, i, (unsigned long long)v);
			free(a);
			Py_DECREF(fast);
			return -1;
		}
		a[i] = v;
	}
	Py_DECREF(fast);
	*out = a;
	*n = (uint32_t)len;
	return 0;
}

static PyObject *context_decode_begin(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	ContextObject *self = (ContextObject *)obj;
	static char *kwlist[] = { "seqs", "positions", NULL };
	PyObject *so, *po = Py_None;
	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:decode_begin", kwlist, &so, &po))
		return NULL;
	if (!self->ctx)
		return closed_error("decode_begin");
	uint64_t *ids = NULL, *pos = NULL;
	uint32_t n = 0, np = 0;
	if (read_ints(so, "decode_begin", "seqs", UINT32_MAX, &ids, &n))
		return NULL;
	if (po != Py_None && read_ints(po, "decode_begin", "positions", UINT64_MAX, &pos, &np)) {
		free(ids);
		return NULL;
	}
	if (po != Py_None && np != n) {
		free(ids);
		free(pos);
		return kvr_py_raisef(-EINVAL, "decode_begin: %u sequences but %u positions", n, np);
	}
	if (n == 0) {
		free(ids);
		free(pos);
		return kvr_py_raisef(-EINVAL, "decode_begin: the batch is empty");
	}
	StepObject *step = (StepObject *)PyObject_CallNoArgs(kvr_py_StepType);
	uint64_t *positions = pos ? pos : calloc(n, sizeof *positions);
	if (step) {
		step->status = calloc(n, sizeof *step->status);
		step->layer_status = calloc(n, sizeof *step->layer_status);
		step->seqs = calloc(n, sizeof *step->seqs);
	}
	if (!step || !positions || !step->status || !step->layer_status || !step->seqs) {
		const int had_step = step != NULL;
		Py_XDECREF((PyObject *)step);
		free(ids);
		free(positions);
		return had_step ? PyErr_NoMemory() : NULL;
	}
	for (uint32_t i = 0; i < n; i++)
		step->seqs[i] = (uint32_t)ids[i];
	free(ids);
	step->batch = n;
	int rc;
	char msg[512] = "";
	CTX_CALL(self, rc, msg, decode_begin_at(self->ctx, step->seqs, pos != NULL, positions, n));
	free(positions);
	if (rc) {
		Py_DECREF((PyObject *)step);
		return call_error(self, rc, msg, "decode_begin");
	}
	log_flush(self->log);
	Py_INCREF((PyObject *)self);
	step->owner = self;
	step->open = 1;
	self->open_step = step;
	return (PyObject *)step;
}

static PyObject *context_decode_reserve(PyObject *obj, PyObject *args)
{
	ContextObject *self = (ContextObject *)obj;
	PyObject *bo, *mo;
	if (!PyArg_ParseTuple(args, "OO:decode_reserve", &bo, &mo))
		return NULL;
	uint32_t batch;
	uint64_t max_tokens;
	if (parse_u32(bo, "decode_reserve", "batch", &batch) || parse_u64(mo, "decode_reserve", "max_tokens", &max_tokens))
		return NULL;
	int rc;
	char msg[512] = "";
	CTX_CALL(self, rc, msg, kvr_decode_reserve(self->ctx, batch, max_tokens));
	if (rc)
		return call_error(self, rc, msg, "decode_reserve");
	log_flush(self->log);
	Py_RETURN_NONE;
}

static const struct {
	const char *name;
	size_t offset;
} stats_fields[] = {
#define S(f) { #f, offsetof(struct kvr_stats, f) }
	S(steps), S(layer_decodes), S(dense_decodes), S(selections), S(corrected_heads), S(checked_heads),
	S(failed_decodes), S(correction_waits), S(correction_wait_ns), S(controller_waits),
	S(controller_wait_ns), S(recall_waits), S(recall_wait_ns), S(pages_recalled), S(pages_hit),
	S(bytes_recalled), S(critical_ns), S(controller_ns), S(controller_jobs), S(pages_judged),
	S(pages_demoted), S(device_units), S(device_units_used), S(host_waits), S(host_wait_ns),
	S(controller_handoff_ns), S(controller_prepare_ns), S(controller_score_ns), S(controller_topk_ns),
	S(controller_recall_ns),
#undef S
};

static PyObject *context_stats(PyObject *obj, PyObject *args)
{
	ContextObject *self = (ContextObject *)obj;
	PyObject *so = Py_None;
	if (!PyArg_ParseTuple(args, "|O:stats", &so))
		return NULL;
	uint32_t seq = 0;
	if (so != Py_None && parse_u32(so, "stats", "seq", &seq))
		return NULL;
	struct kvr_stats st;
	memset(&st, 0, sizeof st);
	st.size = sizeof st;
	int rc;
	char msg[512] = "";
	CTX_CALL(self, rc, msg, so == Py_None ? kvr_get_stats(self->ctx, &st) : kvr_seq_get_stats(self->ctx, seq, &st));
	if (rc)
		return call_error(self, rc, msg, "stats");
	PyObject *d = PyDict_New();
	for (size_t i = 0; d && i < sizeof stats_fields / sizeof stats_fields[0]; i++) {
		uint64_t v;
		memcpy(&v, (const char *)&st + stats_fields[i].offset, sizeof v);
		PyObject *x = PyLong_FromUnsignedLongLong(v);
		if (!x || PyDict_SetItemString(d, stats_fields[i].name, x)) {
			Py_XDECREF(x);
			Py_CLEAR(d);
			break;
		}
		Py_DECREF(x);
	}
	return d;
}

static PyObject *context_head_corrections(PyObject *obj, PyObject *args)
{
	ContextObject *self = (ContextObject *)obj;
	PyObject *so = Py_None;
	if (!PyArg_ParseTuple(args, "|O:head_corrections", &so))
		return NULL;
	uint32_t seq = UINT32_MAX;
	if (so != Py_None && parse_u32(so, "head_corrections", "seq", &seq))
		return NULL;
	uint64_t counts[KVR_MAX_KV_HEADS];
	const uint32_t n = self->cfg.n_kv_heads;
	int rc;
	char msg[512] = "";
	CTX_CALL(self, rc, msg, kvr_get_head_corrections(self->ctx, seq, counts, n));
	if (rc)
		return call_error(self, rc, msg, "head_corrections");
	PyObject *list = PyList_New(n);
	for (uint32_t m = 0; list && m < n; m++) {
		PyObject *x = PyLong_FromUnsignedLongLong(counts[m]);
		if (!x) {
			Py_CLEAR(list);
			break;
		}
		PyList_SetItem(list, m, x);
	}
	return list;
}

static PyObject *context_async_error(PyObject *obj, PyObject *unused)
{
	(void)unused;
	ContextObject *self = (ContextObject *)obj;
	int rc;
	char msg[512] = "", text[512] = "";
	CTX_CALL(self, rc, msg, async_error_text(self->ctx, text, sizeof text));
	(void)msg;
	if (rc == -EBADF && !self->ctx)
		return closed_error("async_error");
	log_flush(self->log);
	if (rc != 1)
		Py_RETURN_NONE;
	/* build the exception instance without raising it */
	PyObject *type, *value, *tb;
	kvr_py_raise(-EIO, text);
	PyErr_Fetch(&type, &value, &tb);
	PyErr_NormalizeException(&type, &value, &tb);
	Py_XDECREF(type);
	Py_XDECREF(tb);
	return value;
}

static PyObject *context_trace_start(PyObject *obj, PyObject *arg)
{
	ContextObject *self = (ContextObject *)obj;
	uint32_t spans;
	if (parse_u32(arg, "trace_start", "max_spans", &spans))
		return NULL;
	int rc;
	char msg[512] = "";
	CTX_CALL(self, rc, msg, kvr_trace_start(self->ctx, spans));
	if (rc)
		return call_error(self, rc, msg, "trace_start");
	Py_RETURN_NONE;
}

static PyObject *context_trace_write(PyObject *obj, PyObject *arg)
{
	ContextObject *self = (ContextObject *)obj;
	PyObject *bytes = NULL;
	if (!PyUnicode_FSConverter(arg, &bytes))
		return NULL;
	char path[4096];
	snprintf(path, sizeof path, "%s", PyBytes_AsString(bytes));
	Py_DECREF(bytes);
	int rc;
	char msg[512] = "";
	CTX_CALL(self, rc, msg, kvr_trace_write(self->ctx, path));
	if (rc)
		return call_error(self, rc, msg, "trace_write");
	Py_RETURN_NONE;
}

static PyObject *context_last_error(PyObject *obj, PyObject *unused)
{
	(void)unused;
	ContextObject *self = (ContextObject *)obj;
	int rc;
	char msg[512] = "";
	CTX_CALL(self, rc, msg, (snprintf(msg, sizeof msg, "%s", kvr_last_error(self->ctx)), 0));
	if (rc)
		return closed_error("last_error");
	return PyUnicode_FromString(msg);
}

static PyObject *context_binding_stats(PyObject *obj, PyObject *unused)
{
	(void)unused;
	ContextObject *self = (ContextObject *)obj;
	uint64_t calls, ns;
	Py_BEGIN_ALLOW_THREADS pthread_mutex_lock(&self->lock);
	calls = self->layer_calls;
	ns = self->layer_call_ns;
	pthread_mutex_unlock(&self->lock);
	Py_END_ALLOW_THREADS
	return Py_BuildValue("{s:K,s:K}", "layer_calls", (unsigned long long)calls, "layer_call_ns",
			     (unsigned long long)ns);
}

static PyMethodDef context_methods[] = {
	{ "close", context_close, METH_NOARGS,
	  "Cancel an open step, destroy the context and free its memory. Idempotent." },
	{ "__enter__", context_enter, METH_NOARGS, NULL },
	{ "__exit__", context_exit, METH_VARARGS, NULL },
	{ "config", context_config, METH_NOARGS, "The resolved configuration as a dict of fields (enums as ints)." },
	{ "seq_create", context_seq_create, METH_NOARGS, "Create an empty sequence; returns its id." },
	{ "seq_free", context_seq_free, METH_O, "seq_free(seq): free a sequence and the pages only it holds." },
	{ "seq_fork", context_seq_fork, METH_O, "seq_fork(seq) -> int: a new sequence sharing seq's tokens." },
	{ "seq_truncate", context_seq_truncate, METH_VARARGS,
	  "seq_truncate(seq, n_tokens): keep the first n_tokens tokens of every layer." },
	{ "seq_length", context_seq_length, METH_VARARGS, "seq_length(seq, layer=0) -> int: tokens stored." },
	{ "prefill", (PyCFunction)(void (*)(void))context_prefill, METH_VARARGS | METH_KEYWORDS,
	  "prefill(seq, layer, k, v, position=None): store k, v [n_tokens, n_kv_heads, head_dim] at "
	  "position (default: the layer's length)." },
	{ "prefill_attention", (PyCFunction)(void (*)(void))context_prefill_attention, METH_VARARGS | METH_KEYWORDS,
	  "prefill_attention(seq, layer, q, out=None, position=None) -> out: causal attention of q "
	  "[n_tokens, n_qo_heads, head_dim] at position (default: the last n_tokens stored)." },
	{ "decode_begin", (PyCFunction)(void (*)(void))context_decode_begin, METH_VARARGS | METH_KEYWORDS,
	  "decode_begin(seqs, positions=None) -> DecodeStep (positions default to the lengths)." },
	{ "decode_reserve", context_decode_reserve, METH_VARARGS,
	  "decode_reserve(batch, max_tokens): size the buffers a CUDA graph capture needs." },
	{ "stats", context_stats, METH_VARARGS, "stats(seq=None) -> dict of counters (context or one sequence)." },
	{ "head_corrections", context_head_corrections, METH_VARARGS,
	  "head_corrections(seq=None) -> list: corrections per KV head, summed over layers." },
	{ "async_error", context_async_error, METH_NOARGS,
	  "The first failure on the context's own threads since the last call, as an Error instance, or None." },
	{ "trace_start", context_trace_start, METH_O, "trace_start(max_spans): record spans." },
	{ "trace_write", context_trace_write, METH_O, "trace_write(path): write the Chrome trace JSON." },
	{ "last_error", context_last_error, METH_NOARGS, "The message of the context's last failed call." },
	{ "binding_stats", context_binding_stats, METH_NOARGS,
	  "{'layer_calls', 'layer_call_ns'}: decode layer calls and the time inside kvr_decode_layer, as the "
	  "binding measures it (the rest of a call's time is the binding's)." },
	{ NULL, NULL, 0, NULL },
};

static PyGetSetDef context_getset[] = {
	{ "closed", context_get_closed, NULL, "True once closed.", NULL },
	{ NULL, NULL, NULL, NULL, NULL },
};

static PyType_Slot context_slots[] = {
	{ Py_tp_new, context_new },
	{ Py_tp_init, context_init },
	{ Py_tp_dealloc, context_dealloc },
	{ Py_tp_methods, context_methods },
	{ Py_tp_getset, context_getset },
	{ Py_tp_doc, "Context(config: dict, thread_pool=None): a kvrecall context (the low-level face of "
		     "kvrecall.Context)." },
	{ 0, NULL },
};

PyType_Spec kvr_py_context_spec = {
	.name = "kvrecall._kvrecall.Context",
	.basicsize = sizeof(ContextObject),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
	.slots = context_slots,
};

/* ---------------------------------------------------------------------------
 * DecodeStep
 * ------------------------------------------------------------------------- */

/* End the step (commit) or cancel it. Python thread (GIL). Returns the
 * result of kvr_decode_end; msg receives its message. */
static int step_end_impl(StepObject *s, char *msg, size_t msg_bytes)
{
	ContextObject *c = s->owner;
	int rc = 0;
	Py_BEGIN_ALLOW_THREADS pthread_mutex_lock(&c->lock);
	if (c->ctx) {
		rc = kvr_decode_end(c->ctx);
		if (rc < 0)
			snprintf(msg, msg_bytes, "%s", kvr_last_error(c->ctx));
	}
	pthread_mutex_unlock(&c->lock);
	Py_END_ALLOW_THREADS
	s->open = 0;
	if (c->open_step == s)
		c->open_step = NULL;
	log_flush(c->log);
	return rc;
}

/* End an open step that nobody will finish: a partly decoded step is taken
 * back; its message is of no use to anyone. */
static void step_cancel(StepObject *s)
{
	char msg[512] = "";
	if (s->open)
		(void)step_end_impl(s, msg, sizeof msg);
}

static void step_dealloc(PyObject *obj)
{
	StepObject *s = (StepObject *)obj;
	PyTypeObject *tp = Py_TYPE(obj);
	if (s->owner) {
		step_cancel(s);
		Py_CLEAR(s->owner);
	}
	free(s->status);
	free(s->layer_status);
	free(s->seqs);
	freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
	f(obj);
	Py_DECREF(tp);
}

static PyObject *stream_arg(ContextObject *c, PyObject *so, int device_index, void **stream)
{
	*stream = NULL;
	if (c->cfg.backend != KVR_BACKEND_CUDA) {
		if (so != Py_None)
			return kvr_py_raisef(-EINVAL, "decode_layer: stream: the cpu backend takes no stream (pass None)");
		return Py_None;
	}
	uintptr_t h = 0;
	if (so == Py_None) {
		if (kvr_py_torch_current_stream(device_index, &h))
			return NULL;
	} else if (PyLong_Check(so)) {
		h = (uintptr_t)PyLong_AsVoidPtr(so);
	} else {
		PyObject *v = PyObject_GetAttrString(so, "cuda_stream");
		if (!v) {
			PyErr_Clear();
			return kvr_py_raisef(-EINVAL,
					     "decode_layer: stream: expected None, an int (cudaStream_t) or an object "
					     "with .cuda_stream");
		}
		h = (uintptr_t)PyLong_AsVoidPtr(v);
		Py_DECREF(v);
	}
	if (PyErr_Occurred())
		return NULL;
	*stream = (void *)h;
	return Py_None;
}

static uint64_t now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* kvr_decode_layer, timed. Under the context's lock, without the GIL. */
static int timed_decode_layer(ContextObject *c, uint32_t layer, const void *q, const void *k, const void *v,
			      void *out, int32_t *status, void *stream)
{
	const uint64_t t0 = now_ns();
	const int rc = kvr_decode_layer(c->ctx, layer, q, k, v, out, status, stream);
	c->layer_call_ns += now_ns() - t0;
	c->layer_calls++;
	return rc;
}

/* layer(layer, q, k, v, out=None, *, stream=None, check=True) -> out.
 * Fast path of the transformers adapter: METH_FASTCALL, the keywords
 * matched by hand. */
static PyObject *step_layer(PyObject *obj, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	StepObject *s = (StepObject *)obj;
	PyObject *a[5] = { NULL, NULL, NULL, NULL, Py_None };
	PyObject *so = Py_None;
	int check = 1;
	if (nargs < 4 || nargs > 5) {
		PyErr_Format(PyExc_TypeError, "layer() takes 4 or 5 positional arguments (layer, q, k, v, out) (%zd given)",
			     nargs);
		return NULL;
	}
	for (Py_ssize_t i = 0; i < nargs; i++)
		a[i] = args[i];
	const Py_ssize_t nk = kwnames ? PyTuple_Size(kwnames) : 0;
	for (Py_ssize_t i = 0; i < nk; i++) {
		PyObject *name = PyTuple_GetItem(kwnames, i);
		PyObject *val = args[nargs + i];
		if (!PyUnicode_CompareWithASCIIString(name, "stream"))
			so = val;
		else if (!PyUnicode_CompareWithASCIIString(name, "check"))
			check = PyObject_IsTrue(val);
		else if (!PyUnicode_CompareWithASCIIString(name, "out") && nargs < 5)
			a[4] = val;
		else {
			PyErr_Format(PyExc_TypeError, "layer() got an unexpected keyword argument '%U'", name);
			return NULL;
		}
	}
	if (!s->open || !s->owner)
		return kvr_py_raisef(-EINVAL, "decode_layer: the step is not open (it was ended or cancelled)");
	ContextObject *c = s->owner;
	if (!c->ctx)
		return closed_error("decode_layer");
	uint32_t layer;
	if (parse_u32(a[0], "decode_layer", "layer", &layer))
		return NULL;
	const int dev = c->cfg.backend == KVR_BACKEND_CUDA ? KVR_PY_CUDA : KVR_PY_HOST;
	struct kvr_py_tensor q, k, v, o;
	int got = 0;
	PyObject *out = a[4], *result = NULL;
	if (kvr_py_tensor_get(a[1], "decode_layer", "q", 0, &q))
		return NULL;
	got = 1;
	if (kvr_py_tensor_get(a[2], "decode_layer", "k", 0, &k))
		goto out;
	got = 2;
	if (kvr_py_tensor_get(a[3], "decode_layer", "v", 0, &v))
		goto out;
	got = 3;
	if (out == Py_None) {
		out = kvr_py_empty_like(a[1], &q);
		if (!out)
			goto out;
	} else {
		Py_INCREF(out);
	}
	if (kvr_py_tensor_get(out, "decode_layer", "out", 1, &o))
		goto out;
	got = 4;
	const uint32_t b = s->batch;
	if (check_tensor(c, &q, "decode_layer", "q", c->cfg.n_qo_heads, b, NULL, dev) ||
	    check_tensor(c, &k, "decode_layer", "k", c->cfg.n_kv_heads, b, NULL, dev) ||
	    check_tensor(c, &v, "decode_layer", "v", c->cfg.n_kv_heads, b, NULL, dev) ||
	    check_tensor(c, &o, "decode_layer", "out", c->cfg.n_qo_heads, b, NULL, dev))
		goto out;
	void *stream = NULL;
	if (!stream_arg(c, so, q.device_index, &stream))
		goto out;
	int rc;
	char msg[512] = "";
	CTX_CALL(c, rc, msg, timed_decode_layer(c, layer, q.data, k.data, v.data, o.data, s->layer_status, stream));
	if (rc) {
		call_error(c, rc, msg, "decode_layer");
		goto out;
	}
	int failed = 0;
	for (uint32_t i = 0; i < b; i++) {
		if (s->layer_status[i]) {
			if (!s->status[i])
				s->status[i] = s->layer_status[i];
			failed++;
		}
	}
	log_flush(c->log);
	if (failed && check) {
		/* the message of the context names the first failure */
		char text[700];
		uint32_t first = 0;
		while (!s->layer_status[first])
			first++;
		snprintf(text, sizeof text,
			 "decode_layer: layer %u: %d of %u sequences failed (sequence %u: %s); the others' outputs are "
			 "valid; step.status has each one's code",
			 layer, failed, b, s->seqs[first], kvr_strerror(s->layer_status[first]));
		PyObject *exc_args = Py_BuildValue("(s)", text);
		PyObject *exc = exc_args ? PyObject_Call(kvr_py_SequenceError, exc_args, NULL) : NULL;
		Py_XDECREF(exc_args);
		if (exc) {
			PyObject *code = PyLong_FromLong(-s->layer_status[first]);
			PyObject_SetAttrString(exc, "errno", code);
			Py_XDECREF(code);
			PyErr_SetObject(kvr_py_SequenceError, exc);
			Py_DECREF(exc);
		}
		goto out;
	}
	result = out;
	Py_INCREF(result);
out:
	if (got >= 1)
		kvr_py_tensor_release(&q);
	if (got >= 2)
		kvr_py_tensor_release(&k);
	if (got >= 3) {
		kvr_py_tensor_release(&v);
		Py_XDECREF(out);
	}
	if (got >= 4)
		kvr_py_tensor_release(&o);
	return result;
}

static PyObject *step_end(PyObject *obj, PyObject *unused)
{
	(void)unused;
	StepObject *s = (StepObject *)obj;
	if (!s->open)
		return kvr_py_raisef(-EINVAL, "decode_end: the step is not open (it was ended or cancelled)");
	char msg[512] = "";
	ContextObject *c = s->owner;
	if (!c->ctx) {
		s->open = 0;
		return closed_error("decode_end");
	}
	const int rc = step_end_impl(s, msg, sizeof msg);
	if (rc)
		return kvr_py_raise(rc, msg);
	Py_RETURN_NONE;
}

static PyObject *step_replay(PyObject *obj, PyObject *args)
{
	StepObject *s = (StepObject *)obj;
	PyObject *so = Py_None;
	if (!PyArg_ParseTuple(args, "|O:replay", &so))
		return NULL;
	if (!s->open)
		return kvr_py_raisef(-EINVAL, "decode_replay: the step is not open");
	ContextObject *c = s->owner;
	void *stream = NULL;
	if (!stream_arg(c, so, 0, &stream))
		return NULL;
	int rc;
	char msg[512] = "";
	CTX_CALL(c, rc, msg, kvr_decode_replay(c->ctx, s->layer_status, stream));
	if (rc)
		return call_error(c, rc, msg, "decode_replay");
	for (uint32_t i = 0; i < s->batch; i++)
		if (s->layer_status[i] && !s->status[i])
			s->status[i] = s->layer_status[i];
	Py_RETURN_NONE;
}

static PyObject *return_self(PyObject *obj, PyObject *unused)
{
	(void)unused;
	Py_INCREF(obj);
	return obj;
}

/* Leaving the with-block ends the step; after an exception it cancels it
 * (kvr_decode_end takes back a partly decoded step) and lets the exception
 * through. */
static PyObject *step_exit(PyObject *obj, PyObject *args)
{
	StepObject *s = (StepObject *)obj;
	PyObject *et = PyTuple_Size(args) > 0 ? PyTuple_GetItem(args, 0) : Py_None;
	if (!s->open)
		Py_RETURN_FALSE;
	char msg[512] = "";
	if (!s->owner->ctx) {
		s->open = 0;
		Py_RETURN_FALSE;
	}
	const int rc = step_end_impl(s, msg, sizeof msg);
	if (rc && et == Py_None)
		return kvr_py_raise(rc, msg);
	Py_RETURN_FALSE;
}

static PyObject *step_get_status(PyObject *obj, void *closure)
{
	(void)closure;
	StepObject *s = (StepObject *)obj;
	PyObject *t = PyTuple_New(s->batch);
	for (uint32_t i = 0; t && i < s->batch; i++) {
		PyObject *x = PyLong_FromLong(s->status ? s->status[i] : 0);
		if (!x) {
			Py_CLEAR(t);
			break;
		}
		PyTuple_SetItem(t, i, x);
	}
	return t;
}

static PyObject *step_get_seqs(PyObject *obj, void *closure)
{
	(void)closure;
	StepObject *s = (StepObject *)obj;
	PyObject *t = PyTuple_New(s->batch);
	for (uint32_t i = 0; t && i < s->batch; i++) {
		PyObject *x = PyLong_FromUnsignedLong(s->seqs[i]);
		if (!x) {
			Py_CLEAR(t);
			break;
		}
		PyTuple_SetItem(t, i, x);
	}
	return t;
}

static PyObject *step_get_open(PyObject *obj, void *closure)
{
	(void)closure;
	return PyBool_FromLong(((StepObject *)obj)->open);
}

static PyObject *step_get_batch(PyObject *obj, void *closure)
{
	(void)closure;
	return PyLong_FromUnsignedLong(((StepObject *)obj)->batch);
}

static PyMethodDef step_methods[] = {
	{ "layer", (PyCFunction)(void (*)(void))step_layer, METH_FASTCALL | METH_KEYWORDS,
	  "layer(layer, q, k, v, out=None, *, stream=None, check=True) -> out\n\n"
	  "Decode one layer of the step: store k, v [batch, n_kv_heads, head_dim] and write attention of q\n"
	  "[batch, n_qo_heads, head_dim] into out (allocated like q when None). With check=True a sequence\n"
	  "that failed raises SequenceError (the others' outputs are valid); status has each one's code." },
	{ "end", step_end, METH_NOARGS, "Close the step (every layer must have been decoded)." },
	{ "replay", step_replay, METH_VARARGS, "replay(stream=None): the host part of a captured step's replay." },
	{ "__enter__", return_self, METH_NOARGS, NULL },
	{ "__exit__", step_exit, METH_VARARGS, NULL },
	{ NULL, NULL, 0, NULL },
};

static PyGetSetDef step_getset[] = {
	{ "status", step_get_status, NULL, "Per sequence: 0, or the negative errno of its first failure.", NULL },
	{ "seqs", step_get_seqs, NULL, "The step's sequence ids.", NULL },
	{ "open", step_get_open, NULL, "True until the step is ended or cancelled.", NULL },
	{ "batch", step_get_batch, NULL, "Sequences in the step.", NULL },
	{ NULL, NULL, NULL, NULL, NULL },
};

static PyObject *generic_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
	(void)args;
	(void)kwargs;
	allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
	return alloc(type, 0);
}

static PyType_Slot step_slots[] = {
	{ Py_tp_new, generic_new },
	{ Py_tp_dealloc, step_dealloc },
	{ Py_tp_methods, step_methods },
	{ Py_tp_getset, step_getset },
	{ Py_tp_doc, "An open decode step (Context.decode_begin). Use as a context manager: leaving the block "
		     "ends the step, or cancels it after an exception." },
	{ 0, NULL },
};

PyType_Spec kvr_py_step_spec = {
	.name = "kvrecall.DecodeStep",
	.basicsize = sizeof(StepObject),
	.flags = Py_TPFLAGS_DEFAULT,
	.slots = step_slots,
};

/* ---------------------------------------------------------------------------
 * ThreadPool
 * ------------------------------------------------------------------------- */

typedef struct {
	PyObject_HEAD
	struct kvr_thread_pool *pool;
	uint32_t threads;
	int users; /* contexts created with it and not yet closed */
} PoolObject;

struct kvr_thread_pool *kvr_py_thread_pool_of(PyObject *obj)
{
	if (!PyObject_TypeCheck(obj, (PyTypeObject *)kvr_py_ThreadPoolType)) {
		PyErr_SetString(PyExc_TypeError, "thread_pool must be a kvrecall.ThreadPool");
		return NULL;
	}
	PoolObject *p = (PoolObject *)obj;
	if (!p->pool) {
		kvr_py_raisef(-EINVAL, "thread_pool: the pool is closed");
		return NULL;
	}
	return p->pool;
}

void kvr_py_thread_pool_hold(PyObject *obj, int delta)
{
	((PoolObject *)obj)->users += delta;
}

static int pool_init(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	PoolObject *p = (PoolObject *)obj;
	static char *kwlist[] = { "threads", NULL };
	PyObject *to = Py_None;
	if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O:ThreadPool", kwlist, &to))
		return -1;
	uint32_t threads = KVR_THREADS_AUTO;
	if (to != Py_None && parse_u32(to, "thread_pool_create", "threads", &threads))
		return -1;
	if (p->pool) {
		PyErr_SetString(PyExc_RuntimeError, "ThreadPool.__init__ called twice");
		return -1;
	}
	int rc;
	char msg[512] = "";
	struct kvr_thread_pool *pool = NULL;
	Py_BEGIN_ALLOW_THREADS rc = kvr_thread_pool_create(threads, &pool);
	if (rc)
		snprintf(msg, sizeof msg, "%s", kvr_last_error(NULL));
	Py_END_ALLOW_THREADS
	if (rc) {
		kvr_py_raise(rc, msg);
		return -1;
	}
	p->pool = pool;
	p->threads = kvr_thread_pool_threads(pool);
	return 0;
}

static void pool_destroy(PoolObject *p)
{
	struct kvr_thread_pool *pool = p->pool;
	p->pool = NULL;
	Py_BEGIN_ALLOW_THREADS kvr_thread_pool_destroy(pool);
	Py_END_ALLOW_THREADS
}

static PyObject *pool_close(PyObject *obj, PyObject *unused)
{
	(void)unused;
	PoolObject *p = (PoolObject *)obj;
	if (p->users > 0)
		return kvr_py_raisef(-EBUSY, "thread_pool_destroy: %d open context(s) use this pool: close them first",
				     p->users);
	pool_destroy(p);
	Py_RETURN_NONE;
}

static PyObject *pool_exit(PyObject *obj, PyObject *args)
{
	(void)args;
	PyObject *r = pool_close(obj, NULL);
	if (!r)
		return NULL;
	Py_DECREF(r);
	Py_RETURN_FALSE;
}

static void pool_dealloc(PyObject *obj)
{
	PyTypeObject *tp = Py_TYPE(obj);
	pool_destroy((PoolObject *)obj); /* no context holds it: each holds a reference */
	freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
	f(obj);
	Py_DECREF(tp);
}

static PyObject *pool_get_threads(PyObject *obj, void *closure)
{
	(void)closure;
	return PyLong_FromUnsignedLong(((PoolObject *)obj)->threads);
}

static PyObject *pool_get_closed(PyObject *obj, void *closure)
{
	(void)closure;
	return PyBool_FromLong(((PoolObject *)obj)->pool == NULL);
}

static PyMethodDef pool_methods[] = {
	{ "close", pool_close, METH_NOARGS, "Stop the workers (refused while a context uses the pool)." },
	{ "__enter__", return_self, METH_NOARGS, NULL },
	{ "__exit__", pool_exit, METH_VARARGS, NULL },
	{ NULL, NULL, 0, NULL },
};

static PyGetSetDef pool_getset[] = {
	{ "threads", pool_get_threads, NULL, "Worker threads besides the caller's.", NULL },
	{ "closed", pool_get_closed, NULL, "True once closed.", NULL },
	{ NULL, NULL, NULL, NULL, NULL },
};

static PyType_Slot pool_slots[] = {
	{ Py_tp_new, generic_new },
	{ Py_tp_init, pool_init },
	{ Py_tp_dealloc, pool_dealloc },
	{ Py_tp_methods, pool_methods },
	{ Py_tp_getset, pool_getset },
	{ Py_tp_doc, "ThreadPool(threads=None): kvrecall's fork-join workers (None: one per core - 1), to share "
		     "between contexts: Config(thread_pool=pool)." },
	{ 0, NULL },
};

PyType_Spec kvr_py_thread_pool_spec = {
	.name = "kvrecall.ThreadPool",
	.basicsize = sizeof(PoolObject),
	.flags = Py_TPFLAGS_DEFAULT,
	.slots = pool_slots,
};
