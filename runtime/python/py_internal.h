/* SPDX-License-Identifier: MIT */
/*
 * py_internal.h — what the Python extension's files share: the exception
 * classes, errno -> exception mapping, tensor access (buffer protocol, torch,
 * __cuda_array_interface__, DLPack) and the context and step types.
 *
 * The extension (kvrecall._kvrecall) is built on Python's limited API (3.11)
 * and includes only the public header <kvrecall.h>, like any engine.
 *
 * Threads: every function here runs on a Python thread holding the GIL,
 * unless its comment says it drops the GIL around a kvrecall call.
 */
#ifndef KVR_PY_INTERNAL_H
#define KVR_PY_INTERNAL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>

#include "kvrecall.h"

/* ---- errors (py_module.c) ---- */

/* The exception classes, created at module init. */
extern PyObject *kvr_py_Error;           /* kvrecall.Error (Exception) */
extern PyObject *kvr_py_InvalidArgument; /* (Error, ValueError): -EINVAL */
extern PyObject *kvr_py_OutOfMemory;     /* (Error, MemoryError): -ENOMEM */
extern PyObject *kvr_py_NotSupported;    /* (Error): -ENOTSUP */
extern PyObject *kvr_py_Busy;            /* (Error): -EBUSY */
extern PyObject *kvr_py_SequenceError;   /* (Error): a decode step's sequence failed */

/* Raise the exception of negative errno `err` with `message`: its class by
 * the code, its `errno` attribute the positive code, `code` the negative one.
 * Returns NULL so callers can `return kvr_py_raise(...)`. */
PyObject *kvr_py_raise(int err, const char *message);
/* The same with a printf-style message. */
PyObject *kvr_py_raisef(int err, const char *fmt, ...);

/* ---- tensors (py_tensor.c) ---- */

enum kvr_py_device { KVR_PY_HOST = 0, KVR_PY_CUDA = 1 };

/* One tensor argument, seen as a C-contiguous run of elements. */
struct kvr_py_tensor {
	void *data;
	int dtype;            /* enum kvr_dtype, or -1 for any other element type */
	const char *dtype_name; /* what the caller passed, for messages ("float64") */
	char dtype_buf[40];     /* dtype_name's storage when it is built (torch's names) */
	int device;           /* enum kvr_py_device */
	int device_index;     /* CUDA device ordinal (0 on the host) */
	int ndim;
	int64_t shape[8];     /* the first 8 dims (messages and the last-dim rule) */
	int64_t numel;
	/* what has to be released */
	int has_view;
	Py_buffer view;
	PyObject *keep; /* a DLPack capsule or an interface dict, or NULL */
	int is_torch;
};

/* Read `obj` as a tensor for argument `role` of `call`. writable: the
 * call writes it. On failure raises InvalidArgument ("<call>: <role>: ...")
 * and returns -1; on success the caller releases it with
 * kvr_py_tensor_release. Objects: anything with the buffer protocol (numpy;
 * uint16 stands for bf16's bits), torch tensors (CPU or CUDA), objects with
 * __cuda_array_interface__ or __dlpack__. */
int kvr_py_tensor_get(PyObject *obj, const char *call, const char *role, int writable,
		      struct kvr_py_tensor *t);
void kvr_py_tensor_release(struct kvr_py_tensor *t);
/* "float16", "bfloat16", "float32" */
const char *kvr_py_dtype_display(int dtype);
/* A new array shaped and typed like `like` (seen as `t`): torch's
 * new_empty for a torch tensor (same device), else a numpy array on the
 * host; NULL with an exception on failure (a CUDA array that is not
 * torch's: the caller must pass `out`). */
PyObject *kvr_py_empty_like(PyObject *like, const struct kvr_py_tensor *t);
/* torch's current CUDA stream (a cudaStream_t as an integer) for device
 * `index`, or 0 (the legacy default stream) when torch is not loaded;
 * -1 with an exception on failure. */
int kvr_py_torch_current_stream(int index, uintptr_t *stream);

/* ---- context and step (py_context.c) ---- */

extern PyType_Spec kvr_py_context_spec;
extern PyType_Spec kvr_py_step_spec;
extern PyType_Spec kvr_py_thread_pool_spec;
extern PyObject *kvr_py_ContextType;
extern PyObject *kvr_py_StepType;
extern PyObject *kvr_py_ThreadPoolType;

/* ---- config dicts (py_config.c) ---- */

/* Fill *cfg from kvr_config_init and then from the items of `mapping`
 * (field name -> int, float or str; dense_layers -> iterable of layer
 * indices). Unknown names raise TypeError. 0, or -1 with an exception. */
int kvr_py_config_from_mapping(PyObject *mapping, struct kvr_config *cfg);
/* A new dict of every field of *cfg (enum fields as ints). */
PyObject *kvr_py_config_to_dict(const struct kvr_config *cfg);

/* The thread pool behind a ThreadPool object, or NULL (exception set) when
 * obj is not an open one. */
struct kvr_thread_pool *kvr_py_thread_pool_of(PyObject *obj);
/* Count a context using / no longer using the pool (closing is refused while
 * any does). */
void kvr_py_thread_pool_hold(PyObject *obj, int delta);

#endif /* KVR_PY_INTERNAL_H */
