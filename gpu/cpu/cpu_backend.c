/* SPDX-License-Identifier: MIT */
/*
 * cpu_backend.c — the cpu backend's device side: "device" memory is host
 * memory, copies are memcpy (batched lists split across the workers), and
 * streams are FIFOs of operations.
 *
 * Streams come in two kinds. An inline stream (the default) runs each
 * operation on the thread that enqueues it, before the call returns: the
 * critical path stays on the engine's thread with no handoff. A worker stream
 * has its own thread draining a ring of operations, for work that should
 * overlap the caller (the controller's recall copies). Either way the
 * operations of one stream run in order.
 *
 * Events carry two counters: `recorded` counts records enqueued, `completed`
 * the highest record that has run. A wait captures `recorded` at the time of
 * the call (an event never recorded is complete, as in CUDA) and holds its
 * stream until `completed` reaches it — spinning briefly, then sleeping.
 *
 * Capture emulates CUDA graphs, so the scheduler's capturable paths can be
 * checked without a GPU, and holds code to CUDA's rules where a GPU would
 * refuse or race:
 *  - while a stream is being captured its operations are recorded, not run,
 *    into a graph (the same closures with the same arguments);
 *  - a stream that waits on an event recorded inside the capture joins it (a
 *    fork); every joined stream's work must be waited on, directly or
 *    through other joined streams, by the origin before the end (the join),
 *    else the end fails as unjoined;
 *  - on the capturing thread (CUDA's thread-local mode), a synchronize, an
 *    event query or synchronize of an event recorded inside the capture, a
 *    wait on an event recorded outside it, an allocation, a free, a host
 *    registration, and a batched copy (cudaMemcpyBatchAsync cannot be
 *    captured) are refused and invalidate the capture;
 *  - an event record inside a capture is a dependency only, as a plain
 *    cudaEventRecord is there: a launch records nothing;
 *  - a launch runs the origin's nodes in order and a forked stream's nodes
 *    as late as their dependencies allow — just before the node that waits
 *    for them — so work the origin reads without waiting for it runs too
 *    late and the reader sees stale data, as it may on a GPU;
 *  - copies and kernels read memory as it is at the launch.
 *
 * Threads: any thread may enqueue on an inline stream it owns; a worker
 * stream's ring is guarded by its mutex. Kernels use the device's fork-join
 * workers (cpu_threads.c) or the engine's parallel-for. A capture, from its
 * begin to its end, and everything enqueued on its streams meanwhile, is the
 * capturing thread's (CUDA's thread-local capture mode).
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "cpu_threads.h"
#include "../../layouts/base/fault.h"

#define RING_OPS 256         /* operations a worker stream can hold */
#define EVENT_SPINS 4000     /* pauses before an event wait sleeps */

struct cpu_impl {
	struct kvr_workers *workers;
	kvr_parallel_for_fn parallel_for; /* the engine's, or NULL */
	void *parallel_user;
	uint32_t threads;
};

struct cpu_op {
	kvr_cpu_op_fn run;
	_Alignas(16) unsigned char ctx[KVR_CPU_OP_CTX_BYTES];
};

struct cpu_capture;

struct kvr_stream {
	uint32_t flags;
	struct kvr_dev *dev;
	/* being captured (the capturing thread's): the capture, and the
	 * stream's branch of the graph (0: the origin) */
	struct cpu_capture *capture;
	uint32_t cap_branch;
	/* worker streams only */
	pthread_t worker;
	pthread_mutex_t lock; /* guards ring, head, tail, quit */
	pthread_cond_t not_empty, not_full, drained;
	struct cpu_op *ring;
	uint64_t head, tail; /* ops [head, tail) are queued; head is running or next */
	int running;         /* the worker is executing ring[head] */
	int quit;
};

struct kvr_event {
	_Atomic uint64_t recorded;  /* records enqueued; written by the recording thread */
	_Atomic uint64_t completed; /* highest record run; release by the runner, acquire by waiters */
	pthread_mutex_t lock;       /* guards the condvar wait */
	pthread_cond_t cond;
	_Atomic uint32_t sleepers;  /* seq_cst with completed: a completer wakes only when needed */
	/* the latest record was inside the capture `cap_id` (0: outside any),
	 * as its node `cap_node`; written and read by the capturing thread
	 * (an id, not a pointer: an ended capture's events need no cleanup) */
	uint64_t cap_id;
	size_t cap_node;
};

enum { NODE_OP, NODE_RECORD, NODE_WAIT };

struct graph_node {
	uint32_t kind;
	uint32_t branch;          /* the capture's stream it was enqueued on */
	size_t depends_on;        /* NODE_WAIT: the record node waited for */
	kvr_cpu_op_fn run;        /* NODE_OP */
	_Alignas(16) unsigned char ctx[KVR_CPU_OP_CTX_BYTES];
};

struct kvr_graph {
	struct graph_node *nodes;
	size_t n, cap;
};

#define CAPTURE_STREAMS 16 /* streams one capture may join */

struct cpu_capture {
	uint64_t id;
	struct kvr_graph *graph;
	struct kvr_stream *streams[CAPTURE_STREAMS]; /* by branch; [0]: the origin */
	uint32_t n_streams;
	int invalid;               /* an operation it cannot hold: its end fails */
	char why[160];
};

/* The capture the calling thread is running, if any (thread-local mode). */
static _Thread_local struct cpu_capture *thread_capture;
/* Capture ids: relaxed, any unique value will do. */
static _Atomic uint64_t next_capture_id = 1;

static struct cpu_impl *impl_of(const struct kvr_dev *dev)
{
	return (struct cpu_impl *)dev->impl;
}

static int capture_forbids(struct kvr_dev *dev, const char *what);

/* ------------------------------------------------------------------ memory */

/* The memory calls are refused on a capturing thread, as cudaMalloc,
 * cudaFree and cudaHostRegister are in CUDA's thread-local capture (a free
 * still frees: the capture is invalidated either way). */
static int cpu_alloc(struct kvr_dev *dev, size_t bytes, void **ptr)
{
	if (capture_forbids(dev, "alloc"))
		return -EINVAL;
	/* 64-byte alignment for the vector kernels and streaming copies. */
	const size_t rounded = (bytes + 63) & ~(size_t)63;
	void *p = aligned_alloc(64, rounded); /* counted as a device allocation */
	if (!p)
		return kvr_dev_fail(dev, -ENOMEM, "alloc: %zu bytes: out of memory", bytes);
	*ptr = p;
	return 0;
}

static void cpu_free(struct kvr_dev *dev, void *ptr)
{
	if (ptr)
		capture_forbids(dev, "free");
	free(ptr);
}

static int cpu_host_register(struct kvr_dev *dev, void *ptr, size_t bytes)
{
	(void)ptr, (void)bytes;
	/* host memory is already "device" memory */
	return capture_forbids(dev, "host_register");
}

static int cpu_host_unregister(struct kvr_dev *dev, void *ptr)
{
	(void)ptr;
	return capture_forbids(dev, "host_unregister");
}

/* ------------------------------------------------------------------ workers */

void kvr_cpu_parallel_for(struct kvr_dev *dev, kvr_task_fn task, void *arg, uint32_t n)
{
	struct cpu_impl *impl = impl_of(dev);
	if (impl->parallel_for)
		impl->parallel_for(impl->parallel_user, task, arg, n);
	else
		kvr_workers_parallel_for(impl->workers, task, arg, n);
}

uint32_t kvr_cpu_threads(const struct kvr_dev *dev)
{
	return impl_of(dev)->threads;
}

/* ------------------------------------------------------------------ streams */

static void *stream_worker(void *arg)
{
	struct kvr_stream *s = arg;
	pthread_mutex_lock(&s->lock);
	for (;;) {
		while (s->head == s->tail && !s->quit)
			pthread_cond_wait(&s->not_empty, &s->lock);
		if (s->head == s->tail && s->quit)
			break;
		struct cpu_op *op = &s->ring[s->head % RING_OPS];
		s->running = 1;
		pthread_mutex_unlock(&s->lock);
		op->run(s->dev, op->ctx);
		pthread_mutex_lock(&s->lock);
		s->running = 0;
		s->head++;
		pthread_cond_signal(&s->not_full);
		if (s->head == s->tail)
			pthread_cond_broadcast(&s->drained);
	}
	pthread_mutex_unlock(&s->lock);
	return NULL;
}

static int cpu_stream_create(struct kvr_dev *dev, uint32_t flags, struct kvr_stream **out)
{
	struct kvr_stream *s = kvr_calloc(1, sizeof(*s));
	if (!s)
		return kvr_dev_fail(dev, -ENOMEM, "stream_create: out of memory");
	s->flags = flags;
	s->dev = dev;
	if (flags & KVR_STREAM_WORKER) {
		s->ring = kvr_calloc(RING_OPS, sizeof(*s->ring));
		if (!s->ring) {
			free(s);
			return kvr_dev_fail(dev, -ENOMEM, "stream_create: out of memory");
		}
		pthread_mutex_init(&s->lock, NULL);
		pthread_cond_init(&s->not_empty, NULL);
		pthread_cond_init(&s->not_full, NULL);
		pthread_cond_init(&s->drained, NULL);
		int err = kvr_pthread_create(&s->worker, NULL, stream_worker, s);
		if (err) {
			free(s->ring);
			free(s);
			return kvr_dev_fail(dev, -err, "stream_create: pthread_create failed");
		}
	}
	*out = s;
	return 0;
}

static void capture_drop_stream(struct kvr_dev *dev, struct kvr_stream *s);

static void cpu_stream_destroy(struct kvr_dev *dev, struct kvr_stream *s)
{
	if (s->capture)
		capture_drop_stream(dev, s);
	if (s->flags & KVR_STREAM_WORKER) {
		pthread_mutex_lock(&s->lock);
		s->quit = 1; /* the worker drains what is queued, then exits */
		pthread_cond_signal(&s->not_empty);
		pthread_mutex_unlock(&s->lock);
		pthread_join(s->worker, NULL);
		pthread_mutex_destroy(&s->lock);
		pthread_cond_destroy(&s->not_empty);
		pthread_cond_destroy(&s->not_full);
		pthread_cond_destroy(&s->drained);
		free(s->ring);
	}
	free(s);
}

/* ----------------------------------------------------------------- capture */

/* Invalidate the capture (its end will fail with `why`) and fail the call. */
static int capture_refuse(struct kvr_dev *dev, struct cpu_capture *c, const char *why)
{
	if (!c->invalid) {
		c->invalid = 1;
		snprintf(c->why, sizeof(c->why), "%s", why);
	}
	return kvr_dev_fail(dev, -EINVAL, "%s (the capture is invalidated)", why);
}

/* What the capturing thread may not do while it captures: 0, or refused. */
static int capture_forbids(struct kvr_dev *dev, const char *what)
{
	if (!thread_capture)
		return 0;
	char why[160];
	snprintf(why, sizeof(why), "%s: not allowed on a thread capturing a stream", what);
	return capture_refuse(dev, thread_capture, why);
}

static struct graph_node *graph_append(struct kvr_dev *dev, struct kvr_stream *s, uint32_t kind)
{
	struct kvr_graph *g = s->capture->graph;
	if (g->n == g->cap) {
		const size_t cap = g->cap ? 2 * g->cap : 64;
		struct graph_node *nodes = realloc(g->nodes, cap * sizeof(*nodes));
		if (!nodes) {
			capture_refuse(dev, s->capture, "capture: out of memory for the graph");
			return NULL;
		}
		g->nodes = nodes;
		g->cap = cap;
	}
	struct graph_node *node = &g->nodes[g->n++];
	memset(node, 0, sizeof(*node));
	node->kind = kind;
	node->branch = s->cap_branch;
	return node;
}

static int cpu_stream_begin_capture(struct kvr_dev *dev, struct kvr_stream *s)
{
	if (s->capture)
		return kvr_dev_fail(dev, -EINVAL, "begin_capture: the stream is being captured already");
	if (thread_capture)
		return kvr_dev_fail(dev, -EINVAL, "begin_capture: this thread is capturing another stream");
	struct cpu_capture *c = kvr_calloc(1, sizeof(*c));
	if (c && !(c->graph = kvr_calloc(1, sizeof(*c->graph)))) {
		free(c);
		c = NULL;
	}
	if (!c)
		return kvr_dev_fail(dev, -ENOMEM, "begin_capture: out of memory");
	c->id = atomic_fetch_add_explicit(&next_capture_id, 1, memory_order_relaxed);
	c->streams[c->n_streams++] = s;
	s->capture = c;
	s->cap_branch = 0;
	thread_capture = c;
	return 0;
}

static void cpu_graph_destroy(struct kvr_dev *dev, struct kvr_graph *g)
{
	(void)dev;
	if (g)
		free(g->nodes);
	free(g);
}

/* Run (or with s NULL only mark) branch b's nodes below `end` not yet run,
 * each wait first running the waited branch up to its record: the origin
 * in order, a forked branch as late as its dependencies allow. */
static int launch_branch(struct kvr_dev *dev, const struct kvr_graph *g, uint8_t *ran, uint32_t b, size_t end,
			 struct kvr_stream *s)
{
	for (size_t i = 0; i < end; i++) {
		const struct graph_node *node = &g->nodes[i];
		if (node->branch != b || ran[i])
			continue;
		ran[i] = 1;
		int err = 0;
		if (node->kind == NODE_WAIT)
			err = launch_branch(dev, g, ran, g->nodes[node->depends_on].branch, node->depends_on + 1, s);
		else if (node->kind == NODE_OP && s)
			err = kvr_cpu_enqueue(dev, s, node->run, node->ctx, KVR_CPU_OP_CTX_BYTES);
		if (err)
			return err;
	}
	return 0;
}

static int cpu_stream_end_capture(struct kvr_dev *dev, struct kvr_stream *s, struct kvr_graph **out)
{
	struct cpu_capture *c = s->capture;
	*out = NULL;
	if (!c || c->streams[0] != s)
		return kvr_dev_fail(dev, -EINVAL, "end_capture: the stream did not begin a capture");
	int err = 0;
	if (c->invalid) {
		err = kvr_dev_fail(dev, -EINVAL, "end_capture: the capture was invalidated: %s", c->why);
	} else if (c->graph->n) {
		/* joined: every operation is reached from the origin's waits */
		uint8_t *ran = kvr_calloc(c->graph->n, 1);
		if (!ran) {
			err = kvr_dev_fail(dev, -ENOMEM, "end_capture: out of memory");
		} else {
			launch_branch(dev, c->graph, ran, 0, c->graph->n, NULL);
			for (size_t i = 0; i < c->graph->n && !err; i++)
				if (!ran[i] && c->graph->nodes[i].kind == NODE_OP)
					err = kvr_dev_fail(dev, -EINVAL,
							   "end_capture: a stream that joined the capture was not waited "
							   "on after its last operation (unjoined work)");
			free(ran);
		}
	}
	for (uint32_t i = 0; i < c->n_streams; i++)
		if (c->streams[i])
			c->streams[i]->capture = NULL;
	if (thread_capture == c)
		thread_capture = NULL;
	if (err)
		cpu_graph_destroy(dev, c->graph);
	else
		*out = c->graph;
	free(c);
	return err;
}

static int cpu_stream_capturing(struct kvr_dev *dev, struct kvr_stream *s)
{
	(void)dev;
	return s->capture != NULL;
}

static int cpu_graph_launch(struct kvr_dev *dev, struct kvr_graph *g, struct kvr_stream *s)
{
	if (!g->n)
		return 0;
	uint8_t *ran = kvr_calloc(g->n, 1);
	if (!ran)
		return kvr_dev_fail(dev, -ENOMEM, "graph_launch: out of memory");
	const int err = launch_branch(dev, g, ran, 0, g->n, s);
	free(ran);
	return err;
}

/* A stream destroyed while captured leaves its capture invalidated; the
 * origin's takes the capture with it. */
static void capture_drop_stream(struct kvr_dev *dev, struct kvr_stream *s)
{
	struct cpu_capture *c = s->capture;
	capture_refuse(dev, c, "stream_destroy: a stream of the capture was destroyed");
	if (s->cap_branch) {
		c->streams[s->cap_branch] = NULL;
		s->capture = NULL;
		return;
	}
	struct kvr_graph *g = NULL;
	cpu_stream_end_capture(dev, s, &g);
}

int kvr_cpu_enqueue(struct kvr_dev *dev, struct kvr_stream *s, kvr_cpu_op_fn run, const void *ctx,
		    size_t ctx_bytes)
{
	if (ctx_bytes > KVR_CPU_OP_CTX_BYTES)
		return kvr_dev_fail(dev, -EINVAL, "enqueue: operation context of %zu bytes too big",
				    ctx_bytes);
	if (s->capture) { /* recorded, not run */
		struct graph_node *node = graph_append(dev, s, NODE_OP);
		if (!node)
			return -ENOMEM;
		node->run = run;
		memcpy(node->ctx, ctx, ctx_bytes);
		return 0;
	}
	if (!(s->flags & KVR_STREAM_WORKER)) {
		struct cpu_op op;
		memcpy(op.ctx, ctx, ctx_bytes);
		run(dev, op.ctx);
		return 0;
	}
	pthread_mutex_lock(&s->lock);
	while (s->tail - s->head >= RING_OPS)
		pthread_cond_wait(&s->not_full, &s->lock);
	struct cpu_op *op = &s->ring[s->tail % RING_OPS];
	op->run = run;
	memcpy(op->ctx, ctx, ctx_bytes);
	s->tail++;
	pthread_cond_signal(&s->not_empty);
	pthread_mutex_unlock(&s->lock);
	return 0;
}

int kvr_cpu_stream_runs_later(const struct kvr_stream *s)
{
	return (s->flags & KVR_STREAM_WORKER) || s->capture;
}

int kvr_cpu_capture_refuses(struct kvr_dev *dev, struct kvr_stream *s, const char *op, int capturable)
{
	if (!s || !s->capture || capturable)
		return 0;
	/* as the cuda backend: refused before anything is recorded, so the
	 * capture stays valid */
	return kvr_dev_fail(dev, -ENOTSUP,
			    "%s: cannot be captured into a CUDA graph (only a captured decode step's operations "
			    "can: docs/architecture.md, \"Capturing a step in a CUDA graph\")",
			    op);
}

static int cpu_stream_synchronize(struct kvr_dev *dev, struct kvr_stream *s)
{
	if (s->capture)
		return capture_refuse(dev, s->capture, "stream_synchronize: the stream is being captured");
	if (!(s->flags & KVR_STREAM_WORKER))
		return 0; /* everything already ran */
	pthread_mutex_lock(&s->lock);
	const uint64_t target = s->tail;
	while (s->head < target)
		pthread_cond_wait(&s->drained, &s->lock);
	pthread_mutex_unlock(&s->lock);
	return 0;
}

/* ------------------------------------------------------------------ events */

static int cpu_event_create(struct kvr_dev *dev, struct kvr_event **out)
{
	struct kvr_event *e = kvr_calloc(1, sizeof(*e));
	if (!e)
		return kvr_dev_fail(dev, -ENOMEM, "event_create: out of memory");
	pthread_mutex_init(&e->lock, NULL);
	pthread_cond_init(&e->cond, NULL);
	*out = e;
	return 0;
}

static void cpu_event_destroy(struct kvr_dev *dev, struct kvr_event *e)
{
	(void)dev;
	pthread_mutex_destroy(&e->lock);
	pthread_cond_destroy(&e->cond);
	free(e);
}

static void event_complete(struct kvr_event *e, uint64_t value)
{
	uint64_t cur = atomic_load_explicit(&e->completed, memory_order_relaxed);
	while (cur < value && !atomic_compare_exchange_weak_explicit(
				      &e->completed, &cur, value, memory_order_seq_cst,
				      memory_order_relaxed))
		;
	/* seq_cst: either the waiter sees the new value or we see its sleeper count */
	if (atomic_load(&e->sleepers)) {
		pthread_mutex_lock(&e->lock);
		pthread_cond_broadcast(&e->cond);
		pthread_mutex_unlock(&e->lock);
	}
}

static void event_wait(struct kvr_event *e, uint64_t target)
{
	for (int i = 0; i < EVENT_SPINS; i++) {
		/* acquire pairs with event_complete's seq_cst (release) update */
		if (atomic_load_explicit(&e->completed, memory_order_acquire) >= target)
			return;
#if defined(__x86_64__) || defined(__i386__)
		__builtin_ia32_pause();
#endif
	}
	pthread_mutex_lock(&e->lock);
	atomic_fetch_add(&e->sleepers, 1);
	while (atomic_load(&e->completed) < target)
		pthread_cond_wait(&e->cond, &e->lock);
	atomic_fetch_sub(&e->sleepers, 1);
	pthread_mutex_unlock(&e->lock);
}

struct event_op {
	struct kvr_event *event;
	uint64_t value;
};

static void run_event_complete(struct kvr_dev *dev, void *ctx)
{
	(void)dev;
	const struct event_op *op = ctx;
	event_complete(op->event, op->value);
}

static void run_event_wait(struct kvr_dev *dev, void *ctx)
{
	(void)dev;
	const struct event_op *op = ctx;
	event_wait(op->event, op->value);
}

static int cpu_event_record(struct kvr_dev *dev, struct kvr_event *e, struct kvr_stream *s)
{
	if (s->capture) { /* a dependency inside the graph; a launch records nothing */
		if (!graph_append(dev, s, NODE_RECORD))
			return -ENOMEM;
		e->cap_id = s->capture->id;
		e->cap_node = s->capture->graph->n - 1;
		return 0;
	}
	if (e->cap_id) /* its latest record is this one, outside any capture */
		e->cap_id = 0;
	/* relaxed: the recording thread is the only writer of `recorded` */
	const uint64_t value = atomic_load_explicit(&e->recorded, memory_order_relaxed) + 1;
	atomic_store_explicit(&e->recorded, value, memory_order_release);
	const struct event_op op = { e, value };
	return kvr_cpu_enqueue(dev, s, run_event_complete, &op, sizeof(op));
}

static int cpu_stream_wait_event(struct kvr_dev *dev, struct kvr_stream *s, struct kvr_event *e)
{
	struct cpu_capture *c = thread_capture;
	if (c && e->cap_id == c->id) { /* recorded inside the capture: a dependency */
		if (s->capture && s->capture != c)
			return capture_refuse(dev, c, "stream_wait_event: the stream belongs to another capture");
		if (!s->capture) { /* a fork: the stream joins the capture */
			if (c->n_streams == CAPTURE_STREAMS)
				return capture_refuse(dev, c, "stream_wait_event: too many streams in one capture");
			s->cap_branch = c->n_streams;
			c->streams[c->n_streams++] = s;
			s->capture = c;
		}
		struct graph_node *node = graph_append(dev, s, NODE_WAIT);
		if (!node)
			return -ENOMEM;
		node->depends_on = e->cap_node;
		return 0;
	}
	if (s->capture) /* CUDA: the capture would depend on work outside it */
		return capture_refuse(dev, s->capture,
				      "stream_wait_event: a stream being captured waits on an event recorded outside "
				      "the capture");
	/* acquire pairs with the release store in cpu_event_record */
	const struct event_op op = { e, atomic_load_explicit(&e->recorded, memory_order_acquire) };
	if (!op.value)
		return 0; /* never recorded: complete */
	return kvr_cpu_enqueue(dev, s, run_event_wait, &op, sizeof(op));
}

static int cpu_event_query(struct kvr_dev *dev, struct kvr_event *e)
{
	if (thread_capture && e->cap_id == thread_capture->id)
		return capture_refuse(dev, thread_capture, "event_query: the event was recorded inside the capture");
	const uint64_t target = atomic_load_explicit(&e->recorded, memory_order_acquire);
	return atomic_load_explicit(&e->completed, memory_order_acquire) >= target ? 0 : -EAGAIN;
}

static int cpu_event_synchronize(struct kvr_dev *dev, struct kvr_event *e)
{
	if (thread_capture && e->cap_id == thread_capture->id)
		return capture_refuse(dev, thread_capture,
				      "event_synchronize: the event was recorded inside the capture");
	event_wait(e, atomic_load_explicit(&e->recorded, memory_order_acquire));
	return 0;
}

/* ------------------------------------------------------------------ copies */

struct copy_op {
	void *dst;
	const void *src;
	size_t bytes;
};

static void run_copy(struct kvr_dev *dev, void *ctx)
{
	(void)dev;
	const struct copy_op *op = ctx;
	memcpy(op->dst, op->src, op->bytes);
}

static int cpu_memcpy_async(struct kvr_dev *dev, void *dst, const void *src, size_t bytes,
			    uint32_t kind, struct kvr_stream *s)
{
	(void)kind; /* all memory is host memory */
	const struct copy_op op = { dst, src, bytes };
	return kvr_cpu_enqueue(dev, s, run_copy, &op, sizeof(op));
}

struct batch_op {
	unsigned char *dst_base;
	const unsigned char *src_base;
	struct kvr_copy_desc *descs; /* owned: freed when run */
	size_t n;
	size_t per_task;
};

static void batch_task(void *arg, uint32_t index)
{
	const struct batch_op *op = arg;
	const size_t first = (size_t)index * op->per_task;
	const size_t last = first + op->per_task < op->n ? first + op->per_task : op->n;
	for (size_t i = first; i < last; i++)
		memcpy(op->dst_base + op->descs[i].dst_offset, op->src_base + op->descs[i].src_offset,
		       op->descs[i].bytes);
}

static void run_batch(struct kvr_dev *dev, void *ctx)
{
	struct batch_op *op = ctx;
	const uint32_t tasks = (uint32_t)((op->n + op->per_task - 1) / op->per_task);
	kvr_cpu_parallel_for(dev, batch_task, op, tasks);
	free(op->descs);
}

static int cpu_memcpy_batch_async(struct kvr_dev *dev, void *dst_base, const void *src_base,
				  const struct kvr_copy_desc *descs, size_t n, uint32_t kind,
				  struct kvr_stream *s)
{
	(void)kind;
	if (s->capture) /* as on a GPU: cudaMemcpyBatchAsync cannot be captured */
		return capture_refuse(dev, s->capture, "memcpy_batch_async: a batched copy cannot be captured");
	/* The list is read when the copy runs, which may be after the caller
	 * reuses its array (as cudaMemcpyBatchAsync allows): keep a copy. */
	struct batch_op op = { dst_base, src_base, kvr_malloc(n * sizeof(*descs)), n, 0 };
	if (!op.descs)
		return kvr_dev_fail(dev, -ENOMEM, "memcpy_batch_async: out of memory for %zu copies", n);
	memcpy(op.descs, descs, n * sizeof(*descs));
	const size_t parts = (size_t)kvr_cpu_threads(dev) + 1;
	op.per_task = (n + parts - 1) / parts;
	int err = kvr_cpu_enqueue(dev, s, run_batch, &op, sizeof(op));
	if (err)
		free(op.descs);
	return err;
}

/* ------------------------------------------------------------------ kernels */

struct kernel_op {
	struct kvr_shape shape;
	const void *items;
	uint32_t n;
	const struct kvr_kv_segment *segments;
	uint32_t n_segments;
};

#define KERNEL_OP(name, item_type)                                                      \
	static void run_##name(struct kvr_dev *dev, void *ctx)                         \
	{                                                                              \
		const struct kernel_op *op = ctx;                                      \
		kvr_cpu_##name(dev, &op->shape, (const item_type *)op->items, op->n);  \
	}                                                                              \
	static int cpu_##name(struct kvr_dev *dev, const struct kvr_shape *shape,      \
			      const item_type *items, uint32_t n, struct kvr_stream *s) \
	{                                                                              \
		const struct kernel_op op = { *shape, items, n, NULL, 0 };             \
		const int refused = kvr_cpu_capture_refuses(dev, s, #name, KVR_CAPTURABLE_##name); \
		return refused ? refused : kvr_cpu_enqueue(dev, s, run_##name, &op, sizeof(op)); \
	}

KERNEL_OP(scatter, struct kvr_scatter_item)
KERNEL_OP(offload, struct kvr_page_item)
KERNEL_OP(summarize, struct kvr_page_item)
KERNEL_OP(score, struct kvr_score_item)
KERNEL_OP(select, struct kvr_score_item)
KERNEL_OP(similarity, struct kvr_similarity_item)
KERNEL_OP(dense, struct kvr_dense_item)
KERNEL_OP(plan, struct kvr_plan_item)
KERNEL_OP(append, struct kvr_append_item)

static void run_attention(struct kvr_dev *dev, void *ctx)
{
	const struct kernel_op *op = ctx;
	kvr_cpu_attention(dev, &op->shape, op->items, op->n, op->segments, op->n_segments);
}

static int cpu_attention(struct kvr_dev *dev, const struct kvr_shape *shape,
			 const struct kvr_attention_item *items, uint32_t n,
			 const struct kvr_kv_segment *segments, uint32_t n_segments,
			 struct kvr_stream *s)
{
	const struct kernel_op op = { *shape, items, n, segments, n_segments };
	const int refused = kvr_cpu_capture_refuses(dev, s, "attention", KVR_CAPTURABLE_attention);
	return refused ? refused : kvr_cpu_enqueue(dev, s, run_attention, &op, sizeof(op));
}

struct freelist_op {
	const struct kvr_freelist_item *items;
	uint32_t n;
};

static void run_freelist(struct kvr_dev *dev, void *ctx)
{
	const struct freelist_op *op = ctx;
	kvr_cpu_freelist(dev, op->items, op->n);
}

static int cpu_freelist(struct kvr_dev *dev, const struct kvr_freelist_item *items, uint32_t n,
			struct kvr_stream *s)
{
	const struct freelist_op op = { items, n };
	const int refused = kvr_cpu_capture_refuses(dev, s, "freelist", KVR_CAPTURABLE_freelist);
	return refused ? refused : kvr_cpu_enqueue(dev, s, run_freelist, &op, sizeof(op));
}

/* ------------------------------------------------------------------ host functions */

struct host_fn_op {
	void (*fn)(void *arg);
	void *arg;
};

static void run_host_fn(struct kvr_dev *dev, void *ctx)
{
	(void)dev;
	const struct host_fn_op *op = ctx;
	op->fn(op->arg);
}

static int cpu_host_fn(struct kvr_dev *dev, struct kvr_stream *s, void (*fn)(void *arg), void *arg)
{
	const struct host_fn_op op = { fn, arg };
	return kvr_cpu_enqueue(dev, s, run_host_fn, &op, sizeof(op));
}

/* ------------------------------------------------------------------ device */

static void cpu_destroy(struct kvr_dev *dev)
{
	struct cpu_impl *impl = impl_of(dev);
	kvr_workers_destroy(impl->workers);
	free(impl);
}

static const struct kvr_dev_ops cpu_ops = {
	.name = "cpu",
	.destroy = cpu_destroy,
#define CPU_OP(name) .name = cpu_##name,
	KVR_DEV_MEMORY_OPS(CPU_OP)
	KVR_DEV_STREAM_OPS(CPU_OP)
	KVR_DEV_KERNEL_OPS(CPU_OP)
	KVR_DEV_GRAPH_OPS(CPU_OP)
#undef CPU_OP
};

const struct kvr_dev_ops *kvr_cpu_ops(void)
{
	return &cpu_ops;
}

int kvr_cpu_dev_init(struct kvr_dev *dev, const struct kvr_dev_params *params, char *err,
		     size_t err_bytes)
{
	struct cpu_impl *impl = kvr_calloc(1, sizeof(*impl));
	if (!impl) {
		snprintf(err, err_bytes, "cpu: out of memory");
		return -ENOMEM;
	}
	impl->parallel_for = params->parallel_for;
	impl->parallel_user = params->parallel_user;
	impl->threads = params->threads;
	if (!impl->parallel_for) {
		int ret = kvr_workers_create(params->threads, &impl->workers);
		if (ret) {
			free(impl);
			snprintf(err, err_bytes, "cpu: cannot start %u worker threads: %s",
				 params->threads, strerror(-ret));
			return ret;
		}
	}
	dev->ops = &cpu_ops;
	dev->impl = impl;
	dev->host_visible = 1;
	return 0;
}
