/* SPDX-License-Identifier: MIT */
/*
 * cuda_backend.cu — the cuda backend: kvr_cuda_dev_init fills backend_impl.h's
 * ops table with CUDA runtime calls. Memory is cudaMalloc'd; host memory is
 * pinned with cudaHostRegister (mapped, so device-side planning and the
 * zero-copy option can read it); streams are non-blocking (never the legacy
 * default stream, which would serialise against the engine's work); events
 * carry no timing; copies are cudaMemcpyAsync, and cudaMemcpyBatchAsync for
 * descriptor lists where the toolkit and driver have it; kernel ops call the
 * launchers of the kernel files (kernel_launchers.h), and select goes through kvr_cuda_select_topk
 * (cuda_topk.cu); host functions are cudaLaunchHostFunc. Device discovery
 * (kvr_gpu_probe) is cuda_device.cu's.
 *
 * score, attention and dense split their work over many blocks and keep
 * partial results between their launches in a scratch buffer: one per stream,
 * allocated on the stream's first such call and grown when a call needs more
 * (stream-ordered allocations, so neither waits for the device), never per
 * call. score's scratch includes a cache of SCORE_CACHE_PAGES page scores per
 * (sequence, query head); longer candidate ranges take a slower path. The
 * splits are sized for the device's SM count; KVR_CUDA_SPLIT_SMS=N in the
 * environment plans for N instead (0: no splits, one block per sequence and
 * KV head), for tuning and A/B measurements.
 *
 * Threads and streams: any thread may call any op (device.c has checked the
 * arguments); each op makes the backend's device current for its duration and
 * restores the caller's current device, so an engine thread working on another
 * GPU is not disturbed. A stream is used by one thread at a time (backend.h),
 * which is what makes its top-k scratch safe without a lock. Enqueueing ops
 * return once the work is queued; only stream_synchronize, event_synchronize
 * and host-to-device copies from pageable memory wait (the last for the
 * stream to drain, see order_pageable_source), and nothing here synchronises
 * the whole device.
 * While a stream is being captured into a CUDA graph only the operations of a
 * captured decode step are accepted on it (enqueue_begin; scheduler/capture.c),
 * and those never allocate or wait: a captured attention or score uses a
 * kernel scratch of the stream's own, allocated by capture_reserve
 * (kvr_decode_reserve) and left alone by every uncaptured op.
 *
 * Errors: allocation failures are -ENOMEM; errors that leave the CUDA context
 * unusable (an illegal address in a kernel, ECC, ...) are -ENOTRECOVERABLE;
 * everything else is -EIO; the message names the call and the CUDA error.
 */
#include <cuda_runtime.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <atomic>
#include <new>

extern "C" {
#include "../backend_impl.h"
#include "../gpu.h"
}
#include "cuda_compat.h"

#ifndef KVR_GPU_ARCHS
#define KVR_GPU_ARCHS ""
#endif

#include "../kernel_launchers.h" /* the kernel files' launchers */

/* cuda_topk.cu */
struct kvr_cuda_topk;
extern "C" {
struct kvr_cuda_topk *kvr_cuda_topk_create(void);
void kvr_cuda_topk_destroy(struct kvr_cuda_topk *t, void *stream);
int kvr_cuda_select_topk(const struct kvr_shape *shape, const struct kvr_score_item *items,
			 const struct kvr_score_item *items_host, uint32_t n,
			 struct kvr_cuda_topk *scratch, void *stream, char *msg, size_t msg_bytes);
}

struct cuda_dev {
	int device = 0;
	uint32_t sm_count = 0; /* multiprocessors: the kernels size their splits by it */
	bool pools = false;    /* stream-ordered allocation (cudaMallocAsync) works */
	/* cleared once cudaMemcpyBatchAsync reports it unsupported (old driver) */
	std::atomic<bool> batch_ok{ true };
};

struct cuda_stream {
	cudaStream_t s;
	bool borrowed;    /* the engine's stream (op_stream_wrap): not ours to destroy */
	cudaEvent_t done; /* stream_synchronize's blocking event */
	struct kvr_cuda_topk *topk;
	void *scratch; /* the split kernels' partial results (see the top) */
	size_t scratch_bytes;
	/* captured attention's own scratch (attention_reserve): a graph keeps
	 * its address, so uncaptured ops never regrow or free it */
	void *graph_scratch;
	size_t graph_scratch_bytes;
	bool capturing; /* the op being enqueued is captured (enqueue_on) */
};

/* Page scores per (sequence, query head) that score's scratch caches: 128K
 * tokens of 32-token pages, 16 KiB per query head of each sequence. */
static const uint32_t SCORE_CACHE_PAGES = 4096;

/* backend.h's handles are opaque: a kvr_stream is a cuda_stream, a kvr_event
 * is the cudaEvent_t itself. */
static struct cuda_stream *as_stream(struct kvr_stream *s)
{
	return reinterpret_cast<struct cuda_stream *>(s);
}

static cudaEvent_t as_event(struct kvr_event *e)
{
	return reinterpret_cast<cudaEvent_t>(e);
}

static struct cuda_dev *impl(struct kvr_dev *dev)
{
	return static_cast<struct cuda_dev *>(dev->impl);
}

/* Waits spin this long on a query before blocking: most waits on the decode
 * path are for work about to finish, and a blocking wake-up costs tens of µs. */
static const uint64_t SPIN_NS = 20000;

/* ------------------------------------------------------------------ errors */

static bool is_sticky(cudaError_t e)
{
	switch (e) {
	case cudaErrorIllegalAddress:
	case cudaErrorLaunchFailure:
	case cudaErrorLaunchTimeout:
	case cudaErrorHardwareStackError:
	case cudaErrorIllegalInstruction:
	case cudaErrorMisalignedAddress:
	case cudaErrorInvalidAddressSpace:
	case cudaErrorInvalidPc:
	case cudaErrorAssert:
	case cudaErrorECCUncorrectable:
	case cudaErrorNvlinkUncorrectable:
	case cudaErrorExternalDevice:
	case cudaErrorMpsClientTerminated:
	case cudaErrorContextIsDestroyed:
#if CUDART_VERSION >= 12080
	case cudaErrorContained:
	case cudaErrorTensorMemoryLeak:
#endif
		return true;
	default:
		return false;
	}
}

static int errno_of(cudaError_t e)
{
	if (e == cudaErrorMemoryAllocation)
		return -ENOMEM;
	return is_sticky(e) ? -ENOTRECOVERABLE : -EIO;
}

/* Record a failed CUDA call. A non-sticky error is also cleared from the
 * thread's last-error state, so it cannot be reported again by a later,
 * unrelated launch check. */
static int cuda_fail(struct kvr_dev *dev, cudaError_t e, const char *call)
{
	(void)cudaGetLastError();
	const int err = errno_of(e);
	return kvr_dev_fail(dev, err, "%s: %s (%d)%s", call, cudaGetErrorName(e), (int)e,
			    err == -ENOTRECOVERABLE
				    ? ": the CUDA context is unusable; restart the process to "
				      "use this GPU again"
				    : "");
}

/* ------------------------------------------------------------ device scope */

/*
 * Makes the backend's device current for one op and, if that meant switching,
 * restores the caller's device afterwards. (A thread that never chose a device
 * reads as device 0; restoring it creates device 0's primary context if the
 * process had none — the price of not leaving an engine's thread on the wrong
 * GPU, paid only when kvrecall runs on another device.)
 */
class device_scope {
public:
	explicit device_scope(int device)
	{
		int current = -1;
		if (cudaGetDevice(&current) == cudaSuccess && current == device)
			return;
		err_ = cudaSetDevice(device);
		if (err_ == cudaSuccess)
			restore_ = current;
	}
	~device_scope()
	{
		if (restore_ >= 0)
			(void)cudaSetDevice(restore_);
	}
	cudaError_t error() const { return err_; }
	device_scope(const device_scope &) = delete;
	device_scope &operator=(const device_scope &) = delete;

private:
	int restore_ = -1;
	cudaError_t err_ = cudaSuccess;
};

/* Enter the device; 0 or the failure. */
static int enter(struct kvr_dev *dev, device_scope &scope)
{
	if (scope.error() != cudaSuccess)
		return cuda_fail(dev, scope.error(), "cudaSetDevice");
	return 0;
}

/* The op's device made current for the rest of the op (scope's lifetime),
 * or the op returns enter's error. */
#define ENTER_DEVICE(dev)                                                                   \
	device_scope scope(impl(dev)->device);                                              \
	do {                                                                                \
		const int enter_rc = enter(dev, scope);                                     \
		if (enter_rc)                                                               \
			return enter_rc;                                                    \
	} while (0)

/* Every enqueueing op starts here: the device, then, while the stream is
 * being captured into a CUDA graph, a refusal unless the op is one a
 * captured decode step uses (scheduler/capture.c: event records and waits,
 * copies from pinned memory, the append and attention kernels), so that no
 * other op silently becomes part of someone's graph instead of running.
 * *capturing says whether it is. A context broken by an earlier kernel
 * shows up here too, as the capture query's error. */
static int enqueue_begin(struct kvr_dev *dev, device_scope &scope, cudaStream_t s, const char *op,
			 bool capturable, bool *capturing)
{
	int rc = enter(dev, scope);
	if (rc)
		return rc;
	cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
	const cudaError_t e = cudaStreamIsCapturing(s, &status);
	if (e != cudaSuccess)
		return cuda_fail(dev, e, "cudaStreamIsCapturing");
	*capturing = status != cudaStreamCaptureStatusNone;
	if (status == cudaStreamCaptureStatusInvalidated)
		return kvr_dev_fail(dev, -EINVAL, "%s: the stream's capture was invalidated (end it and capture again)",
				    op);
	if (*capturing && !capturable)
		return kvr_dev_fail(dev, -ENOTSUP,
				    "%s: cannot be captured into a CUDA graph (only a captured decode step's "
				    "operations can: docs/architecture.md, \"Capturing a step in a CUDA graph\")",
				    op);
	return 0;
}

/* An enqueueing op on `stream`: enqueue_begin, then body(cs, cd) with the
 * device current for the whole body. Captured ops say so (`capturable`) and
 * find cs->capturing set while the stream is captured. */
template <typename Body>
static int enqueue_on(struct kvr_dev *dev, struct kvr_stream *stream, const char *op, bool capturable, Body body)
{
	struct cuda_stream *cs = as_stream(stream);
	struct cuda_dev *cd = impl(dev);
	device_scope scope(cd->device);
	bool capturing = false;
	const int rc = enqueue_begin(dev, scope, cs->s, op, capturable, &capturing);
	cs->capturing = capturing; /* the stream's one thread (backend.h) */
	return rc ? rc : body(cs, cd);
}

template <typename Body>
static int enqueue_on(struct kvr_dev *dev, struct kvr_stream *stream, const char *op, Body body)
{
	return enqueue_on(dev, stream, op, false, body);
}

/* ------------------------------------------------------------------ memory */

static int op_alloc(struct kvr_dev *dev, size_t bytes, void **ptr)
{
	ENTER_DEVICE(dev);
	void *p = NULL;
	const cudaError_t e = cudaMalloc(&p, bytes);
	if (e != cudaSuccess)
		return cuda_fail(dev, e, "cudaMalloc");
	*ptr = p;
	return 0;
}

/* cudaFree waits for the device to be idle: frees belong to set-up and
 * teardown, never to the decode path. */
static void op_free(struct kvr_dev *dev, void *ptr)
{
	device_scope scope(impl(dev)->device);
	if (scope.error() != cudaSuccess || cudaFree(ptr) != cudaSuccess)
		(void)cudaGetLastError();
}

static int op_host_register(struct kvr_dev *dev, void *ptr, size_t bytes)
{
	ENTER_DEVICE(dev);
	/* Portable: usable by every device of the process; Mapped: device code
	 * can read it (device-side recall planning, zero-copy attention). */
	const cudaError_t e =
		cudaHostRegister(ptr, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
	if (e == cudaErrorHostMemoryAlreadyRegistered) {
		(void)cudaGetLastError();
		return kvr_dev_fail(dev, -EEXIST, "cudaHostRegister(%p, %zu bytes): already registered",
				    ptr, bytes);
	}
	if (e != cudaSuccess)
		return cuda_fail(dev, e, "cudaHostRegister");
	return 0;
}

static int op_host_unregister(struct kvr_dev *dev, void *ptr)
{
	ENTER_DEVICE(dev);
	const cudaError_t e = cudaHostUnregister(ptr);
	if (e == cudaErrorHostMemoryNotRegistered) {
		(void)cudaGetLastError();
		return kvr_dev_fail(dev, -EINVAL, "cudaHostUnregister(%p): not registered", ptr);
	}
	if (e != cudaSuccess)
		return cuda_fail(dev, e, "cudaHostUnregister");
	return 0;
}

/* ------------------------------------------------------- streams and events */

/* A stream wrapper: a new non-blocking CUDA stream (native NULL, owned) or
 * the engine's `native` one (borrowed: destroy frees the wrapper only), with
 * its completion event and top-k scratch. `what` names the caller in errors. */
static int stream_open(struct kvr_dev *dev, const char *what, bool borrowed, cudaStream_t native,
		       struct kvr_stream **out)
{
	ENTER_DEVICE(dev);
	struct cuda_stream *cs =
		static_cast<struct cuda_stream *>(calloc(1, sizeof(struct cuda_stream)));
	if (!cs || !(cs->topk = kvr_cuda_topk_create())) {
		free(cs);
		return kvr_dev_fail(dev, -ENOMEM, "%s: out of host memory", what);
	}
	cs->s = native;
	cs->borrowed = borrowed;
	cudaError_t e = borrowed ? cudaSuccess : cudaStreamCreateWithFlags(&cs->s, cudaStreamNonBlocking);
	const char *failed = "cudaStreamCreateWithFlags";
	if (e == cudaSuccess) {
		e = cudaEventCreateWithFlags(&cs->done, cudaEventDisableTiming | cudaEventBlockingSync);
		failed = "cudaEventCreateWithFlags";
		if (e != cudaSuccess && !borrowed)
			(void)cudaStreamDestroy(cs->s);
	}
	if (e != cudaSuccess) {
		const int rc = cuda_fail(dev, e, failed);
		kvr_cuda_topk_destroy(cs->topk, NULL);
		free(cs);
		return rc;
	}
	*out = reinterpret_cast<struct kvr_stream *>(cs);
	return 0;
}

static int op_stream_create(struct kvr_dev *dev, uint32_t flags, struct kvr_stream **out)
{
	(void)flags; /* KVR_STREAM_WORKER: CUDA streams are always asynchronous */
	return stream_open(dev, "stream_create", false, NULL, out);
}

/* Returns at once; CUDA releases the stream when its queued work is done. */
static void op_stream_destroy(struct kvr_dev *dev, struct kvr_stream *stream)
{
	struct cuda_stream *cs = as_stream(stream);
	device_scope scope(impl(dev)->device);
	kvr_cuda_topk_destroy(cs->topk, cs->s);
	if (cs->scratch)
		(void)(impl(dev)->pools ? cudaFreeAsync(cs->scratch, cs->s) : cudaFree(cs->scratch));
	if (cs->graph_scratch)
		(void)cudaFree(cs->graph_scratch);
	(void)cudaEventDestroy(cs->done);
	if (!cs->borrowed)
		(void)cudaStreamDestroy(cs->s);
	(void)cudaGetLastError();
	free(cs);
}

/* The engine's stream as a kvr_stream: the runtime records and waits events
 * on it; the stream stays the engine's (destroy frees the wrapper only).
 * NULL is the legacy default stream. */
static int op_stream_wrap(struct kvr_dev *dev, void *native, struct kvr_stream **out)
{
	return stream_open(dev, "stream_wrap", true, static_cast<cudaStream_t>(native), out);
}

static void *op_stream_native(struct kvr_dev *, struct kvr_stream *stream)
{
	return as_stream(stream)->s;
}

/* 1 while the stream is being captured into a graph, 0 when not. */
static int op_stream_capturing(struct kvr_dev *dev, struct kvr_stream *stream)
{
	struct cuda_stream *cs = as_stream(stream);
	device_scope scope(impl(dev)->device);
	cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
	const cudaError_t e = cudaStreamIsCapturing(cs->s, &status);
	if (e != cudaSuccess)
		return cuda_fail(dev, e, "cudaStreamIsCapturing");
	return status != cudaStreamCaptureStatusNone;
}

/* Graphs: what a stream captured, instantiated once at the capture's end
 * (the executable graph is what a launch runs). Thread-local capture mode,
 * as the cpu backend emulates it: another thread's CUDA calls (the
 * controller's) neither join nor invalidate the capture. */
struct kvr_graph {
	cudaGraph_t graph;
	cudaGraphExec_t exec;
};

static int op_stream_begin_capture(struct kvr_dev *dev, struct kvr_stream *stream)
{
	ENTER_DEVICE(dev);
	const cudaError_t e = cudaStreamBeginCapture(as_stream(stream)->s, cudaStreamCaptureModeThreadLocal);
	return e == cudaSuccess ? 0 : cuda_fail(dev, e, "cudaStreamBeginCapture");
}

static int op_stream_end_capture(struct kvr_dev *dev, struct kvr_stream *stream, struct kvr_graph **out)
{
	ENTER_DEVICE(dev);
	cudaGraph_t graph = NULL;
	cudaError_t e = cudaStreamEndCapture(as_stream(stream)->s, &graph);
	if (e != cudaSuccess) { /* an invalidated capture (cudaErrorStreamCaptureInvalidated), unjoined work */
		if (graph)
			(void)cudaGraphDestroy(graph);
		const int rc = errno_of(e);
		(void)cudaGetLastError();
		return kvr_dev_fail(dev, rc == -EIO ? -EINVAL : rc, "cudaStreamEndCapture: %s (%d)",
				    cudaGetErrorName(e), (int)e);
	}
	struct kvr_graph *g = new (std::nothrow) kvr_graph{ graph, NULL };
	if (!g) {
		(void)cudaGraphDestroy(graph);
		return kvr_dev_fail(dev, -ENOMEM, "end_capture: out of memory");
	}
	e = cudaGraphInstantiate(&g->exec, graph, 0);
	if (e != cudaSuccess) {
		(void)cudaGraphDestroy(graph);
		delete g;
		return cuda_fail(dev, e, "cudaGraphInstantiate");
	}
	*out = g;
	return 0;
}

static int op_graph_launch(struct kvr_dev *dev, struct kvr_graph *graph, struct kvr_stream *stream)
{
	return enqueue_on(dev, stream, "graph_launch", [&](struct cuda_stream *cs, struct cuda_dev *) {
		const cudaError_t e = cudaGraphLaunch(graph->exec, cs->s);
		return e == cudaSuccess ? 0 : cuda_fail(dev, e, "cudaGraphLaunch");
	});
}

static void op_graph_destroy(struct kvr_dev *dev, struct kvr_graph *graph)
{
	device_scope scope(impl(dev)->device);
	if (graph->exec && cudaGraphExecDestroy(graph->exec) != cudaSuccess)
		(void)cudaGetLastError();
	if (cudaGraphDestroy(graph->graph) != cudaSuccess)
		(void)cudaGetLastError();
	delete graph;
}

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Spin on the event for SPIN_NS, then block in cudaEventSynchronize (which
 * sleeps for events created with cudaEventBlockingSync). */
static cudaError_t wait_event(cudaEvent_t ev)
{
	const uint64_t start = now_ns();
	for (;;) {
		const cudaError_t e = cudaEventQuery(ev);
		if (e != cudaErrorNotReady)
			return e;
		if (now_ns() - start >= SPIN_NS)
			return cudaEventSynchronize(ev);
	}
}

/* Mark the end of the queued work with the stream's blocking event and wait
 * for it: unlike cudaStreamSynchronize, that sleeps whatever the process's
 * device flags are. */
static int op_stream_synchronize(struct kvr_dev *dev, struct kvr_stream *stream)
{
	struct cuda_stream *cs = as_stream(stream);
	device_scope scope(impl(dev)->device);
	int rc = enqueue_begin(dev, scope, cs->s, "stream_synchronize", false, &cs->capturing);
	if (rc)
		return rc;
	cudaError_t e = cudaEventRecord(cs->done, cs->s);
	if (e != cudaSuccess)
		return cuda_fail(dev, e, "cudaEventRecord");
	e = wait_event(cs->done);
	if (e != cudaSuccess)
		return cuda_fail(dev, e, "stream_synchronize");
	return 0;
}

static int op_event_create(struct kvr_dev *dev, struct kvr_event **out)
{
	ENTER_DEVICE(dev);
	cudaEvent_t ev;
	const cudaError_t e =
		cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventBlockingSync);
	if (e != cudaSuccess)
		return cuda_fail(dev, e, "cudaEventCreateWithFlags");
	*out = reinterpret_cast<struct kvr_event *>(ev);
	return 0;
}

static void op_event_destroy(struct kvr_dev *dev, struct kvr_event *event)
{
	device_scope scope(impl(dev)->device);
	if (cudaEventDestroy(as_event(event)) != cudaSuccess)
		(void)cudaGetLastError();
}

static int op_event_record(struct kvr_dev *dev, struct kvr_event *event, struct kvr_stream *stream)
{
	return enqueue_on(dev, stream, "event_record", true, [&](struct cuda_stream *cs, struct cuda_dev *) {
		const cudaError_t e = cudaEventRecord(as_event(event), cs->s);
		return e == cudaSuccess ? 0 : cuda_fail(dev, e, "cudaEventRecord");
	});
}

static int op_stream_wait_event(struct kvr_dev *dev, struct kvr_stream *stream,
				struct kvr_event *event)
{
	return enqueue_on(dev, stream, "stream_wait_event", true, [&](struct cuda_stream *cs, struct cuda_dev *) {
		const cudaError_t e = cudaStreamWaitEvent(cs->s, as_event(event), cudaEventWaitDefault);
		return e == cudaSuccess ? 0 : cuda_fail(dev, e, "cudaStreamWaitEvent");
	});
}

static int op_event_query(struct kvr_dev *dev, struct kvr_event *event)
{
	ENTER_DEVICE(dev);
	const cudaError_t e = cudaEventQuery(as_event(event));
	if (e == cudaSuccess)
		return 0;
	if (e == cudaErrorNotReady) {
		(void)cudaGetLastError();
		return -EAGAIN; /* not a failure: no message */
	}
	return cuda_fail(dev, e, "cudaEventQuery");
}

static int op_event_synchronize(struct kvr_dev *dev, struct kvr_event *event)
{
	ENTER_DEVICE(dev);
	const cudaError_t e = wait_event(as_event(event));
	return e == cudaSuccess ? 0 : cuda_fail(dev, e, "event_synchronize");
}

/* ------------------------------------------------------------------ copies */

static cudaMemcpyKind copy_kind(uint32_t kind)
{
	switch (kind) {
	case KVR_COPY_H2D:
		return cudaMemcpyHostToDevice;
	case KVR_COPY_D2H:
		return cudaMemcpyDeviceToHost;
	default:
		return cudaMemcpyDeviceToDevice;
	}
}

/*
 * CUDA reads a *pageable* (unregistered) source of a host-to-device
 * cudaMemcpyAsync when the copy is enqueued — it stages it into a pinned
 * buffer at once — not when the stream reaches the copy. backend.h promises
 * stream order, so before such a copy the stream is drained: the caller's
 * thread blocks until earlier work (a host function or a D2H copy that fills
 * that buffer, say) is done. Pinned sources (the pool) take no such wait;
 * pageable destinations of D2H copies need none (CUDA blocks the caller until
 * the copy is done). Found by the conformance suite's host_fn_order test on
 * an H100.
 */
static int order_pageable_source(struct kvr_dev *dev, struct cuda_stream *cs, const void *src,
				 uint32_t kind)
{
	if (kind != KVR_COPY_H2D)
		return 0;
	cudaPointerAttributes attr;
	cudaError_t e = cudaPointerGetAttributes(&attr, src);
	if (e != cudaSuccess)
		(void)cudaGetLastError(); /* treat as pageable */
	else if (attr.type != cudaMemoryTypeUnregistered)
		return 0;
	if (cs->capturing) /* the ordering wait cannot be captured, nor the copy without it */
		return kvr_dev_fail(dev, -ENOTSUP,
				    "memcpy_async: a pageable source cannot be captured into a CUDA graph "
				    "(register it, or copy outside the capture)");
	e = cudaEventRecord(cs->done, cs->s);
	if (e == cudaSuccess)
		e = wait_event(cs->done);
	return e == cudaSuccess ? 0 : cuda_fail(dev, e, "memcpy (ordering a pageable source)");
}

static int op_memcpy_async(struct kvr_dev *dev, void *dst, const void *src, size_t bytes,
			   uint32_t kind, struct kvr_stream *stream)
{
	return enqueue_on(dev, stream, "memcpy_async", true, [&](struct cuda_stream *cs, struct cuda_dev *) {
		const int rc = order_pageable_source(dev, cs, src, kind);
		if (rc)
			return rc;
		const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, copy_kind(kind), cs->s);
		return e == cudaSuccess ? 0 : cuda_fail(dev, e, "cudaMemcpyAsync");
	});
}

/* Descriptors [i, n) one cudaMemcpyAsync each. */
static int copy_loop(struct kvr_dev *dev, unsigned char *dst, const unsigned char *src,
		     const struct kvr_copy_desc *descs, size_t i, size_t n, uint32_t kind,
		     cudaStream_t s)
{
	for (; i < n; i++) {
		if (!descs[i].bytes)
			continue;
		const cudaError_t e = cudaMemcpyAsync(dst + descs[i].dst_offset,
						      src + descs[i].src_offset, descs[i].bytes,
						      copy_kind(kind), s);
		if (e != cudaSuccess)
			return cuda_fail(dev, e, "cudaMemcpyAsync (batch fallback)");
	}
	return 0;
}

#if CUDART_VERSION >= 12080
/* Copies per cudaMemcpyBatchAsync call: the pointer lists live on the stack
 * and are read by the call itself (the copies use them in stream order, so the
 * source is read in stream order too). */
static const size_t BATCH_CHUNK = 128;

/*
 * cudaMemcpyBatchAsync differs between toolkits:
 *   12.8, 12.9: (void **dsts, void **srcs, size_t *sizes, size_t count,
 *                cudaMemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
 *                size_t *failIdx, cudaStream_t stream)
 *   13.0+:      (void *const *dsts, const void *const *srcs, const size_t *sizes,
 *                size_t count, cudaMemcpyAttributes *attrs, size_t *attrsIdxs,
 *                size_t numAttrs, cudaStream_t stream)
 * cudart is linked statically, so the toolkit we compile against is the one
 * that runs: the signature is chosen at compile time. One attribute entry
 * covers every copy (attrsIdxs = {0}).
 */
static cudaError_t batch_call(void **dsts, void **srcs, size_t *sizes, size_t count,
			      cudaStream_t s, size_t *fail_idx)
{
	cudaMemcpyAttributes attr;
	memset(&attr, 0, sizeof(attr));
	attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
	attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
	size_t attr_idx = 0;
	*fail_idx = SIZE_MAX;
#if CUDART_VERSION >= 13000
	return cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attr, &attr_idx, 1, s);
#else
	return cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attr, &attr_idx, 1, fail_idx, s);
#endif
}
#endif

static int op_memcpy_batch_async(struct kvr_dev *dev, void *dst_base, const void *src_base,
				 const struct kvr_copy_desc *descs, size_t n, uint32_t kind,
				 struct kvr_stream *stream)
{
	struct cuda_dev *cd = impl(dev);
	struct cuda_stream *cs = as_stream(stream);
	device_scope scope(cd->device);
	int rc = enqueue_begin(dev, scope, cs->s, "memcpy_batch_async", false, &cs->capturing);
	if (rc)
		return rc;
	/* the descriptors index one source allocation: its base decides */
	if (n && (rc = order_pageable_source(dev, cs, src_base, kind)))
		return rc;
	unsigned char *dst = static_cast<unsigned char *>(dst_base);
	const unsigned char *src = static_cast<const unsigned char *>(src_base);
	size_t i = 0;
#if CUDART_VERSION >= 12080
	/* The batch API infers each copy's direction from the pointers (unified
	 * addressing), so `kind` only matters to the fallback. */
	while (i < n && cd->batch_ok.load(std::memory_order_relaxed)) {
		void *dsts[BATCH_CHUNK];
		void *srcs[BATCH_CHUNK];
		size_t sizes[BATCH_CHUNK];
		size_t count = 0, next = i;
		for (; next < n && count < BATCH_CHUNK; next++) {
			if (!descs[next].bytes)
				continue; /* zero-byte entries are not valid copies */
			dsts[count] = dst + descs[next].dst_offset;
			srcs[count] = const_cast<unsigned char *>(src + descs[next].src_offset);
			sizes[count] = descs[next].bytes;
			count++;
		}
		if (!count)
			return 0;
		size_t fail_idx;
		const cudaError_t e = batch_call(dsts, srcs, sizes, count, cs->s, &fail_idx);
		if (e == cudaErrorNotSupported || e == cudaErrorCallRequiresNewerDriver) {
			/* an older driver: remember, and finish with single copies */
			(void)cudaGetLastError();
			cd->batch_ok.store(false, std::memory_order_relaxed);
			break;
		}
		if (e != cudaSuccess) {
			(void)cudaGetLastError();
			if (fail_idx != SIZE_MAX)
				return kvr_dev_fail(dev, errno_of(e),
						    "cudaMemcpyBatchAsync: %s (copy %zu of the batch "
						    "starting at descriptor %zu)",
						    cudaGetErrorName(e), fail_idx, i);
			return cuda_fail(dev, e, "cudaMemcpyBatchAsync");
		}
		i = next;
	}
#endif
	return copy_loop(dev, dst, src, descs, i, n, kind, cs->s);
}

/* ------------------------------------------------------------------ kernels */

/* A launcher's failure, with its message (it names the kernel and CUDA error). */
static int kernel_result(struct kvr_dev *dev, int rc)
{
	return rc ? kvr_dev_fail(dev, rc, "%s", KVR_KERNEL_SYMBOL(last_message)()) : 0;
}

#define KERNEL_OP(op, item_type, launcher, capturable)                                      \
	static int op_##op(struct kvr_dev *dev, const struct kvr_shape *shape,               \
			   const struct item_type *items, uint32_t n, struct kvr_stream *stream) \
	{                                                                                   \
		return enqueue_on(dev, stream, #op, capturable, [&](struct cuda_stream *cs, struct cuda_dev *) { \
			return kernel_result(dev, launcher(shape, items, n, cs->s));        \
		});                                                                         \
	}

/* capturable: kernels.h's table (KVR_CAPTURABLE_*), which the cpu backend's
 * capture emulation follows too */
KERNEL_OP(scatter, kvr_scatter_item, KVR_KERNEL_SYMBOL(launch_scatter), KVR_CAPTURABLE_scatter)
KERNEL_OP(offload, kvr_page_item, KVR_KERNEL_SYMBOL(launch_offload), KVR_CAPTURABLE_offload)
KERNEL_OP(summarize, kvr_page_item, KVR_KERNEL_SYMBOL(launch_summarize), KVR_CAPTURABLE_summarize)
KERNEL_OP(similarity, kvr_similarity_item, KVR_KERNEL_SYMBOL(launch_similarity), KVR_CAPTURABLE_similarity)
KERNEL_OP(plan, kvr_plan_item, KVR_KERNEL_SYMBOL(launch_plan), KVR_CAPTURABLE_plan)
KERNEL_OP(append, kvr_append_item, KVR_KERNEL_SYMBOL(launch_append), KVR_CAPTURABLE_append)

static int op_freelist(struct kvr_dev *dev, const struct kvr_freelist_item *items, uint32_t n,
		       struct kvr_stream *stream)
{
	return enqueue_on(dev, stream, "freelist", KVR_CAPTURABLE_freelist, [&](struct cuda_stream *cs, struct cuda_dev *) {
		return kernel_result(dev, KVR_KERNEL_SYMBOL(launch_freelist)(items, n, cs->s));
	});
}

/*
 * The stream's scratch, at least `need` bytes (the stream is the caller's
 * alone, backend.h, so no lock). Growing frees the old buffer and allocates
 * the new one in stream order: kernels queued earlier finish with the old one
 * first, and the host does not wait. Without stream-ordered allocation
 * (cudaDevAttrMemoryPoolsSupported = 0) cudaFree waits for the device: only
 * ever on growth, which a steady decode loop does not do.
 */
static int stream_scratch(struct kvr_dev *dev, struct cuda_stream *cs, size_t need)
{
	if (need <= cs->scratch_bytes)
		return 0;
	const bool pools = impl(dev)->pools;
	size_t bytes = cs->scratch_bytes + cs->scratch_bytes / 4;
	bytes = bytes > need ? bytes : need;
	bytes = (bytes + (1u << 20) - 1) & ~(size_t)((1u << 20) - 1);
	if (cs->scratch) {
		const cudaError_t e = pools ? cudaFreeAsync(cs->scratch, cs->s) : cudaFree(cs->scratch);
		cs->scratch = NULL;
		cs->scratch_bytes = 0;
		if (e != cudaSuccess)
			return cuda_fail(dev, e, pools ? "cudaFreeAsync (kernel scratch)"
						       : "cudaFree (kernel scratch)");
	}
	void *p = NULL;
	const cudaError_t e = pools ? cudaMallocAsync(&p, bytes, cs->s) : cudaMalloc(&p, bytes);
	if (e != cudaSuccess)
		return cuda_fail(dev, e, pools ? "cudaMallocAsync (kernel scratch)"
					       : "cudaMalloc (kernel scratch)");
	cs->scratch = p;
	cs->scratch_bytes = bytes;
	return 0;
}

static int op_score(struct kvr_dev *dev, const struct kvr_shape *shape,
		    const struct kvr_score_item *items, uint32_t n, struct kvr_stream *stream)
{
	struct cuda_stream *cs = as_stream(stream);
	struct cuda_dev *cd = impl(dev);
	device_scope scope(cd->device);
	int rc = enqueue_begin(dev, scope, cs->s, "score", KVR_CAPTURABLE_score, &cs->capturing);
	if (rc)
		return rc;
	if (cs->capturing) /* the scratch only reservations change (capture_reserve) */
		return kernel_result(dev, KVR_KERNEL_SYMBOL(launch_score_scratch)(
						  shape, items, n, cs->graph_scratch, cs->graph_scratch_bytes,
						  cd->sm_count, cs->s));
	/* the page-score cache if it can be had; the minimum (no cache) if not */
	rc = stream_scratch(dev, cs,
			    KVR_KERNEL_SYMBOL(score_scratch_bytes)(shape, n, cd->sm_count,
								   SCORE_CACHE_PAGES));
	if (rc == -ENOMEM)
		rc = stream_scratch(dev, cs,
				    KVR_KERNEL_SYMBOL(score_scratch_bytes)(shape, n, cd->sm_count, 0));
	if (rc)
		return rc;
	return kernel_result(dev, KVR_KERNEL_SYMBOL(launch_score_scratch)(
					  shape, items, n, cs->scratch, cs->scratch_bytes,
					  cd->sm_count, cs->s));
}

/* The attention family's split scratch for n items on the stream; without
 * it (out of device memory) the launcher runs one block per item and KV head,
 * so only a poisoned context is an error. */
static int attention_scratch(struct kvr_dev *dev, struct cuda_stream *cs, const struct kvr_shape *shape,
			     uint32_t n)
{
	const size_t bytes = KVR_KERNEL_SYMBOL(attention_scratch_bytes)(shape, n, impl(dev)->sm_count);
	if (cs->capturing) /* its own, reserved before (op_attention) */
		return 0;
	const int rc = stream_scratch(dev, cs, bytes);
	return rc == -ENOTRECOVERABLE ? rc : 0;
}

static int op_capture_reserve(struct kvr_dev *dev, struct kvr_stream *stream, const struct kvr_shape *att_shape,
			      uint32_t n_att, const struct kvr_shape *score_shape, uint32_t n_score)
{
	return enqueue_on(dev, stream, "capture_reserve", [&](struct cuda_stream *cs, struct cuda_dev *cd) {
		size_t bytes = att_shape && n_att
				       ? KVR_KERNEL_SYMBOL(attention_scratch_bytes)(att_shape, n_att, cd->sm_count)
				       : 0;
		const size_t score = score_shape && n_score ? KVR_KERNEL_SYMBOL(score_scratch_bytes)(
								      score_shape, n_score, cd->sm_count, SCORE_CACHE_PAGES)
							    : 0;
		bytes = score > bytes ? score : bytes;
		if (bytes <= cs->graph_scratch_bytes)
			return 0;
		/* graphs captured with the old one are stale by then (kvrecall.h:
		 * a reservation makes them so); cudaFree waits for their launches */
		if (cs->graph_scratch && cudaFree(cs->graph_scratch) != cudaSuccess)
			(void)cudaGetLastError();
		cs->graph_scratch = NULL;
		cs->graph_scratch_bytes = 0;
		const cudaError_t e = cudaMalloc(&cs->graph_scratch, bytes);
		if (e != cudaSuccess)
			return cuda_fail(dev, e, "cudaMalloc (a captured step's kernel scratch)");
		cs->graph_scratch_bytes = bytes;
		return 0;
	});
}

static int op_dense(struct kvr_dev *dev, const struct kvr_shape *shape,
		    const struct kvr_dense_item *items, uint32_t n, struct kvr_stream *stream)
{
	return enqueue_on(dev, stream, "dense", KVR_CAPTURABLE_dense, [&](struct cuda_stream *cs, struct cuda_dev *cd) {
		const int rc = attention_scratch(dev, cs, shape, n);
		if (rc)
			return rc;
		return kernel_result(dev, KVR_KERNEL_SYMBOL(launch_dense_scratch)(
						  shape, items, n, cs->scratch, cs->scratch_bytes,
						  cd->sm_count, cs->s));
	});
}

/* The ops table passes device items only, so kvr_cuda_select_topk has no
 * host-side sizes and runs the hand-written twin. */
static int select_on(struct kvr_dev *dev, const struct kvr_shape *shape, const struct kvr_score_item *items,
		     const struct kvr_score_item *items_host, uint32_t n, struct kvr_stream *stream,
		     const char *what)
{
	/* the hand-written twin (no host items) is one kernel: capturable */
	return enqueue_on(dev, stream, what, KVR_CAPTURABLE_select && items_host == NULL,
			  [&](struct cuda_stream *cs, struct cuda_dev *) {
		char msg[KVR_DEV_MESSAGE_BYTES];
		const int rc = kvr_cuda_select_topk(shape, items, items_host, n, cs->topk, cs->s, msg,
						    sizeof(msg));
		return rc ? kvr_dev_fail(dev, rc, "%s", msg) : 0;
	});
}

static int op_select(struct kvr_dev *dev, const struct kvr_shape *shape,
		     const struct kvr_score_item *items, uint32_t n, struct kvr_stream *stream)
{
	return select_on(dev, shape, items, NULL, n, stream, "select");
}

/*
 * Test hook (tests/test_conformance.c): select through cuda_topk.cu's CUB
 * path, which the ops table never reaches (it has no host-side copy of the
 * items, so op_select always runs the hand-written twin). items is the device
 * array, items_host the same items in host memory (only their sizes are
 * read). Not part of backend.h.
 */
extern "C" int kvr_cuda_dev_select_cub(struct kvr_dev *dev, const struct kvr_shape *shape,
				       const struct kvr_score_item *items,
				       const struct kvr_score_item *items_host, uint32_t n,
				       struct kvr_stream *stream)
{
	if (!dev || dev->kind != KVR_DEV_CUDA || !shape || !items || !items_host || !stream)
		return -EINVAL;
	return select_on(dev, shape, items, items_host, n, stream, "select (CUB)");
}

static int op_attention(struct kvr_dev *dev, const struct kvr_shape *shape,
			const struct kvr_attention_item *items, uint32_t n,
			const struct kvr_kv_segment *segments, uint32_t n_segments,
			struct kvr_stream *stream)
{
	return enqueue_on(dev, stream, "attention", KVR_CAPTURABLE_attention,
			  [&](struct cuda_stream *cs, struct cuda_dev *cd) {
		const int rc = attention_scratch(dev, cs, shape, n);
		if (rc)
			return rc;
		/* a captured launch uses the scratch only reservations change */
		return kernel_result(dev, KVR_KERNEL_SYMBOL(launch_attention_scratch)(
						  shape, items, n, segments, n_segments,
						  cs->capturing ? cs->graph_scratch : cs->scratch,
						  cs->capturing ? cs->graph_scratch_bytes : cs->scratch_bytes,
						  cd->sm_count, cs->s));
	});
}

/* The host function runs on a CUDA runtime thread in stream order; work
 * enqueued after it waits for it to return (cudaLaunchHostFunc's contract is
 * backend.h's: fn must not call CUDA). */
static int op_host_fn(struct kvr_dev *dev, struct kvr_stream *stream, void (*fn)(void *arg),
		      void *arg)
{
	return enqueue_on(dev, stream, "host_fn", [&](struct cuda_stream *cs, struct cuda_dev *) {
		const cudaError_t e = cudaLaunchHostFunc(cs->s, fn, arg);
		return e == cudaSuccess ? 0 : cuda_fail(dev, e, "cudaLaunchHostFunc");
	});
}

/* ------------------------------------------------------------------ device */

static void op_destroy(struct kvr_dev *dev)
{
	delete impl(dev);
	dev->impl = NULL;
}

/* Filled field by field, so an optional op added to kvr_dev_ops later stays
 * NULL (device.c answers -ENOTSUP for it) until it is written here. */
static struct kvr_dev_ops make_cuda_ops(void)
{
	struct kvr_dev_ops o;
	memset(&o, 0, sizeof(o));
	o.name = "cuda";
	o.destroy = op_destroy;
#define SET_OP(name) o.name = op_##name;
	KVR_DEV_MEMORY_OPS(SET_OP)
	KVR_DEV_STREAM_OPS(SET_OP)
	KVR_DEV_KERNEL_OPS(SET_OP)
#undef SET_OP
	o.stream_wrap = op_stream_wrap;
	o.stream_native = op_stream_native;
	o.capture_reserve = op_capture_reserve;
	/* capture: the ops a captured decode step enqueues accept a capturing
	 * stream (enqueue_begin); the others refuse it */
	o.stream_capturing = op_stream_capturing;
	o.stream_begin_capture = op_stream_begin_capture;
	o.stream_end_capture = op_stream_end_capture;
	o.graph_launch = op_graph_launch;
	o.graph_destroy = op_graph_destroy;
	return o;
}

static const struct kvr_dev_ops cuda_ops = make_cuda_ops();

/*
 * Whether the kernels compiled for KVR_GPU_ARCHS ("80,90": SASS for each, PTX
 * of the last) can run on a device of compute capability major.minor: SASS
 * for sm_XY runs on X.Y' with Y' >= Y, PTX is JIT-compiled for any newer
 * device. An empty or unparsable list is not checked (the first launch would
 * report a missing kernel image).
 */
static bool archs_cover(const char *archs, int major, int minor)
{
	const int cc = major * 10 + minor;
	int last = -1;
	bool sass = false;
	for (const char *p = archs; *p;) {
		char *end;
		const long a = strtol(p, &end, 10);
		if (end == p || a <= 0)
			return true;
		if (a / 10 == major && a % 10 <= minor)
			sass = true;
		last = (int)a;
		p = *end == ',' ? end + 1 : end;
		if (*end && *end != ',')
			return true;
	}
	return last < 0 || sass || cc >= last;
}

extern "C" int kvr_cuda_dev_init(struct kvr_dev *dev, const struct kvr_dev_params *params,
				 char *err, size_t err_bytes)
{
	struct kvr_gpu_probe probe;
	kvr_gpu_probe(&probe);
	if (probe.n_devices <= 0) {
		snprintf(err, err_bytes, "no usable CUDA device: %s", probe.reason);
		return -ENODEV;
	}
	const int device = params->device;
	if (device < 0 || device >= probe.n_devices) {
		snprintf(err, err_bytes, "CUDA device %d does not exist (%d present)", device,
			 probe.n_devices);
		return -ENODEV;
	}
	cudaDeviceProp prop;
	cudaError_t e = cudaGetDeviceProperties(&prop, device);
	if (e != cudaSuccess) {
		(void)cudaGetLastError();
		snprintf(err, err_bytes, "cudaGetDeviceProperties(%d): %s", device,
			 cudaGetErrorName(e));
		return -ENODEV;
	}
	if (!archs_cover(KVR_GPU_ARCHS, prop.major, prop.minor)) {
		snprintf(err, err_bytes,
			 "CUDA device %d (%.64s) is sm_%d%d; the kernels are built for sm_{%s} "
			 "(reconfigure with -Dgpu_archs)",
			 device, prop.name, prop.major, prop.minor, KVR_GPU_ARCHS);
		return -ENODEV;
	}
	{
		/* create the primary context now, so a device that cannot be used
		 * (exclusive mode, out of memory) fails here and not mid-decode */
		device_scope scope(device);
		if (scope.error() != cudaSuccess) {
			(void)cudaGetLastError();
			snprintf(err, err_bytes, "cudaSetDevice(%d): %s", device,
				 cudaGetErrorName(scope.error()));
			return -ENODEV;
		}
		e = cudaFree(NULL);
		if (e != cudaSuccess) {
			(void)cudaGetLastError();
			snprintf(err, err_bytes, "initialising CUDA device %d: %s", device,
				 cudaGetErrorName(e));
			return -ENODEV;
		}
	}
	struct cuda_dev *cd = new (std::nothrow) cuda_dev;
	if (!cd) {
		snprintf(err, err_bytes, "cuda backend: out of host memory");
		return -ENOMEM;
	}
	cd->device = device;
	cd->sm_count = prop.multiProcessorCount > 0 ? (uint32_t)prop.multiProcessorCount : 0;
	const char *split_sms = getenv("KVR_CUDA_SPLIT_SMS");
	if (split_sms && *split_sms) {
		char *end;
		const long v = strtol(split_sms, &end, 10);
		if (*end == '\0' && v >= 0 && v <= 1 << 16)
			cd->sm_count = (uint32_t)v;
	}
	int pools = 0;
	if (cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device) != cudaSuccess)
		(void)cudaGetLastError();
	cd->pools = pools != 0;
	dev->ops = &cuda_ops;
	dev->kind = KVR_DEV_CUDA;
	dev->host_visible = 0;
	dev->impl = cd;
	return 0;
}
