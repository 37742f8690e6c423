/* SPDX-License-Identifier: MIT */
/*
 * py_tensor.c — the extension's view of a tensor argument: a pointer, an
 * element type, a device and a shape, read in place (never copied) from
 *   1. torch tensors (checked first: the transformers adapter's every call),
 *      through their public attributes (data_ptr, dtype, is_cuda, shape,
 *      is_contiguous), so the binding needs no torch headers;
 *   2. the buffer protocol (numpy arrays, memoryview, array.array);
 *   3. __cuda_array_interface__ (CuPy, Numba, ...);
 *   4. __dlpack__ (JAX, ...), the legacy "dltensor" capsule.
 * Every argument must be C-contiguous; a wrong element type, device or a
 * strided view is an InvalidArgument naming the call and the argument.
 *
 * Threads: Python threads holding the GIL.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "py_internal.h"

/* Names looked up on every torch tensor, interned once. */
static PyObject *str_data_ptr, *str_dtype, *str_is_cuda, *str_is_cpu, *str_shape, *str_is_contiguous,
	*str_requires_grad, *str_get_device, *str_new_empty, *str_cai, *str_dlpack;

/* torch's Tensor type and dtypes, taken from sys.modules once torch has been
 * imported by someone (the extension never imports torch itself). */
static PyObject *torch_tensor_type, *torch_f16, *torch_bf16, *torch_f32;

static int intern_names(void)
{
	if (str_data_ptr)
		return 0;
	str_data_ptr = PyUnicode_InternFromString("data_ptr");
	str_dtype = PyUnicode_InternFromString("dtype");
	str_is_cuda = PyUnicode_InternFromString("is_cuda");
	str_is_cpu = PyUnicode_InternFromString("is_cpu");
	str_shape = PyUnicode_InternFromString("shape");
	str_is_contiguous = PyUnicode_InternFromString("is_contiguous");
	str_requires_grad = PyUnicode_InternFromString("requires_grad");
	str_get_device = PyUnicode_InternFromString("get_device");
	str_new_empty = PyUnicode_InternFromString("new_empty");
	str_cai = PyUnicode_InternFromString("__cuda_array_interface__");
	str_dlpack = PyUnicode_InternFromString("__dlpack__");
	return str_dlpack ? 0 : -1;
}

/* The torch module if it is loaded, borrowed; NULL (no exception) if not. */
static PyObject *loaded_torch(void)
{
	PyObject *modules = PySys_GetObject("modules"); /* borrowed */
	if (!modules)
		return NULL;
	return PyDict_GetItemString(modules, "torch"); /* borrowed, no exception */
}

/* Find torch's Tensor type and dtypes when torch is loaded. 0 when found. */
static int torch_lookup(void)
{
	if (torch_tensor_type)
		return 0;
	PyObject *torch = loaded_torch();
	if (!torch)
		return -1;
	PyObject *tensor = PyObject_GetAttrString(torch, "Tensor");
	PyObject *f16 = PyObject_GetAttrString(torch, "float16");
	PyObject *bf16 = PyObject_GetAttrString(torch, "bfloat16");
	PyObject *f32 = PyObject_GetAttrString(torch, "float32");
	if (!tensor || !f16 || !bf16 || !f32) {
		/* a partly imported torch: try again at a later call */
		PyErr_Clear();
		Py_XDECREF(tensor);
		Py_XDECREF(f16);
		Py_XDECREF(bf16);
		Py_XDECREF(f32);
		return -1;
	}
	torch_f16 = f16;
	torch_bf16 = bf16;
	torch_f32 = f32;
	torch_tensor_type = tensor;
	return 0;
}

static int is_torch_tensor(PyObject *obj)
{
	if (torch_lookup())
		return 0;
	if ((PyObject *)Py_TYPE(obj) == torch_tensor_type)
		return 1;
	const int r = PyObject_IsInstance(obj, torch_tensor_type);
	if (r < 0) {
		PyErr_Clear();
		return 0;
	}
	return r;
}

const char *kvr_py_dtype_display(int dtype)
{
	switch (dtype) {
	case KVR_DTYPE_F16:
		return "float16";
	case KVR_DTYPE_BF16:
		return "bfloat16";
	case KVR_DTYPE_F32:
		return "float32";
	default:
		return "another type";
	}
}

/* Raise InvalidArgument "<call>: <role>: <what>" and return -1. */
static int bad(const char *call, const char *role, const char *fmt, ...)
{
	char what[320], msg[448];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(what, sizeof what, fmt, ap);
	va_end(ap);
	snprintf(msg, sizeof msg, "%s: %s: %s", call, role, what);
	kvr_py_raise(-22 /* EINVAL */, msg);
	return -1;
}

/* The pending exception's text, for a message that wraps it; clears it. */
static void take_exception_text(char *buf, size_t bytes)
{
	PyObject *type, *value, *tb;
	PyErr_Fetch(&type, &value, &tb);
	buf[0] = '\0';
	if (value) {
		PyObject *s = PyObject_Str(value);
		if (s) {
			Py_ssize_t n;
			const char *u = PyUnicode_AsUTF8AndSize(s, &n);
			if (u)
				snprintf(buf, bytes, "%s", u);
			Py_DECREF(s);
		}
	}
	PyErr_Clear();
	Py_XDECREF(type);
	Py_XDECREF(value);
	Py_XDECREF(tb);
}

static int shape_from_sequence(PyObject *seq, struct kvr_py_tensor *t)
{
	const Py_ssize_t n = PyTuple_Check(seq) ? PyTuple_Size(seq) : PySequence_Size(seq);
	if (n < 0)
		return -1;
	t->ndim = (int)n;
	t->numel = 1;
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *item = PyTuple_Check(seq) ? PyTuple_GetItem(seq, i) : PySequence_GetItem(seq, i);
		if (!item)
			return -1;
		const long long v = PyLong_AsLongLong(item);
		if (!PyTuple_Check(seq))
			Py_DECREF(item);
		if (v < 0 && PyErr_Occurred())
			return -1;
		if (i < 8)
			t->shape[i] = v;
		t->numel *= v;
	}
	return 0;
}

static int from_torch(PyObject *obj, const char *call, const char *role, int writable, struct kvr_py_tensor *t)
{
	t->is_torch = 1;
	PyObject *dtype = PyObject_GetAttr(obj, str_dtype);
	if (!dtype)
		return -1;
	if (dtype == torch_f16)
		t->dtype = KVR_DTYPE_F16;
	else if (dtype == torch_bf16)
		t->dtype = KVR_DTYPE_BF16;
	else if (dtype == torch_f32)
		t->dtype = KVR_DTYPE_F32;
	else {
		/* "torch.float64" -> "float64" */
		PyObject *s = PyObject_Str(dtype);
		Py_ssize_t n = 0;
		const char *u = s ? PyUnicode_AsUTF8AndSize(s, &n) : NULL;
		if (u) {
			const char *dot = strrchr(u, '.');
			snprintf(t->dtype_buf, sizeof t->dtype_buf, "%s", dot ? dot + 1 : u);
			t->dtype_name = t->dtype_buf;
		}
		Py_XDECREF(s);
		PyErr_Clear();
	}
	Py_DECREF(dtype);

	/* is_cpu first: one attribute for the cpu backend's tensors */
	PyObject *flag = PyObject_GetAttr(obj, str_is_cpu);
	if (!flag)
		return -1;
	const int cpu = flag == Py_True;
	Py_DECREF(flag);
	if (!cpu) {
		flag = PyObject_GetAttr(obj, str_is_cuda);
		if (!flag)
			return -1;
		const int cuda = flag == Py_True;
		Py_DECREF(flag);
		if (!cuda) {
			PyObject *dev = PyObject_GetAttrString(obj, "device");
			PyObject *s = dev ? PyObject_Str(dev) : NULL;
			Py_ssize_t n = 0;
			const char *u = s ? PyUnicode_AsUTF8AndSize(s, &n) : NULL;
			char name[64];
			snprintf(name, sizeof name, "%s", u ? u : "?");
			Py_XDECREF(s);
			Py_XDECREF(dev);
			PyErr_Clear();
			return bad(call, role, "a tensor on device '%s': kvrecall reads CPU or CUDA memory", name);
		}
		t->device = KVR_PY_CUDA;
		PyObject *idx = PyObject_CallMethodObjArgs(obj, str_get_device, NULL);
		if (!idx)
			return -1;
		t->device_index = (int)PyLong_AsLong(idx);
		Py_DECREF(idx);
	}

	PyObject *shape = PyObject_GetAttr(obj, str_shape);
	if (!shape)
		return -1;
	const int rc = shape_from_sequence(shape, t);
	Py_DECREF(shape);
	if (rc)
		return -1;

	PyObject *contig = PyObject_CallMethodObjArgs(obj, str_is_contiguous, NULL);
	if (!contig)
		return -1;
	const int is_contig = contig == Py_True;
	Py_DECREF(contig);
	if (!is_contig)
		return bad(call, role, "the tensor is not contiguous (call .contiguous() first)");

	if (writable) {
		PyObject *rg = PyObject_GetAttr(obj, str_requires_grad);
		if (!rg)
			return -1;
		const int grad = rg == Py_True;
		Py_DECREF(rg);
		if (grad)
			return bad(call, role,
				   "the tensor requires grad: kvrecall writes outputs in place and computes no gradients");
	}

	PyObject *ptr = PyObject_CallMethodObjArgs(obj, str_data_ptr, NULL);
	if (!ptr)
		return -1;
	t->data = PyLong_AsVoidPtr(ptr);
	Py_DECREF(ptr);
	if (PyErr_Occurred())
		return -1;
	return 0;
}

/* Element type of a buffer-protocol format string. */
static int dtype_of_format(const char *fmt, Py_ssize_t itemsize, const char **name)
{
	if (!fmt)
		fmt = "B";
	if (*fmt == '<' || *fmt == '=' || *fmt == '@')
		fmt++;
	if (fmt[0] && !fmt[1]) {
		switch (fmt[0]) {
		case 'e':
			if (itemsize == 2)
				return KVR_DTYPE_F16;
			break;
		case 'f':
			if (itemsize == 4)
				return KVR_DTYPE_F32;
			break;
		case 'H':
			if (itemsize == 2) {
				*name = "uint16";
				return 100; /* bf16's bits, accepted where bf16 is expected */
			}
			break;
		case 'd':
			*name = "float64";
			return -1;
		default:
			break;
		}
	}
	*name = "a buffer of another element type";
	return -1;
}

static int from_buffer(PyObject *obj, const char *call, const char *role, int writable, struct kvr_py_tensor *t)
{
	int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT;
	if (writable)
		flags |= PyBUF_WRITABLE;
	if (PyObject_GetBuffer(obj, &t->view, flags) != 0) {
		char why[200];
		take_exception_text(why, sizeof why);
		return bad(call, role, "%s%s", why[0] ? why : "the buffer cannot be read",
			   writable ? " (it must be writable and C-contiguous)" : " (it must be C-contiguous)");
	}
	t->has_view = 1;
	t->data = t->view.buf;
	t->dtype = dtype_of_format(t->view.format, t->view.itemsize, &t->dtype_name);
	t->ndim = t->view.ndim;
	t->numel = t->view.itemsize ? (int64_t)(t->view.len / t->view.itemsize) : 0;
	for (int i = 0; i < t->ndim && i < 8; i++)
		t->shape[i] = t->view.shape ? (int64_t)t->view.shape[i] : t->numel;
	if (t->ndim == 0) {
		t->ndim = 1;
		t->shape[0] = t->numel;
	}
	return 0;
}

static int from_cuda_array_interface(PyObject *cai, const char *call, const char *role, int writable,
				     struct kvr_py_tensor *t)
{
	if (!PyDict_Check(cai))
		return bad(call, role, "__cuda_array_interface__ is not a dict");
	t->device = KVR_PY_CUDA;
	PyObject *shape = PyDict_GetItemString(cai, "shape");
	PyObject *typestr = PyDict_GetItemString(cai, "typestr");
	PyObject *data = PyDict_GetItemString(cai, "data");
	PyObject *strides = PyDict_GetItemString(cai, "strides");
	if (!shape || !typestr || !data || !PyTuple_Check(data) || PyTuple_Size(data) != 2)
		return bad(call, role, "__cuda_array_interface__ lacks shape, typestr or data");
	if (shape_from_sequence(shape, t))
		return -1;
	Py_ssize_t n;
	const char *ts = PyUnicode_AsUTF8AndSize(typestr, &n);
	if (!ts)
		return -1;
	if (!strcmp(ts, "<f2"))
		t->dtype = KVR_DTYPE_F16;
	else if (!strcmp(ts, "<f4"))
		t->dtype = KVR_DTYPE_F32;
	else if (!strcmp(ts, "<u2"))
		t->dtype = 100;
	else
		t->dtype_name = "another element type (typestr)";
	if (strides && strides != Py_None) {
		/* C-contiguous strides are allowed spelled out */
		int64_t expect = t->dtype == KVR_DTYPE_F32 ? 4 : 2;
		const Py_ssize_t nd = PySequence_Size(strides);
		for (Py_ssize_t i = nd - 1; i >= 0; i--) {
			PyObject *s = PySequence_GetItem(strides, i);
			const long long v = s ? PyLong_AsLongLong(s) : -1;
			Py_XDECREF(s);
			if (PyErr_Occurred())
				return -1;
			const int64_t dim = i < 8 ? t->shape[i] : 1;
			if (dim > 1 && v != expect)
				return bad(call, role, "the array is not C-contiguous");
			expect *= dim;
		}
	}
	PyObject *ro = PyTuple_GetItem(data, 1);
	if (writable && ro == Py_True)
		return bad(call, role, "the array is read-only");
	t->data = PyLong_AsVoidPtr(PyTuple_GetItem(data, 0));
	if (PyErr_Occurred())
		return -1;
	return 0;
}

/* DLPack's C ABI (dlpack.h v0.8, the capsule "dltensor"), spelled out
 * here from the specification. */
struct dl_device {
	int32_t device_type; /* 1 CPU, 2 CUDA, 3 CUDA host (pinned), 13 CUDA managed */
	int32_t device_id;
};
struct dl_data_type {
	uint8_t code; /* 0 int, 1 uint, 2 float, 4 bfloat */
	uint8_t bits;
	uint16_t lanes;
};
struct dl_tensor {
	void *data;
	struct dl_device device;
	int32_t ndim;
	struct dl_data_type dtype;
	int64_t *shape;
	int64_t *strides;
	uint64_t byte_offset;
};
struct dl_managed_tensor {
	struct dl_tensor dl_tensor;
	void *manager_ctx;
	void (*deleter)(struct dl_managed_tensor *self);
};

static int from_dlpack(PyObject *obj, const char *call, const char *role, struct kvr_py_tensor *t)
{
	PyObject *capsule = PyObject_CallMethodObjArgs(obj, str_dlpack, NULL);
	if (!capsule) {
		char why[200];
		take_exception_text(why, sizeof why);
		return bad(call, role, "__dlpack__() failed: %s", why);
	}
	t->keep = capsule; /* its destructor frees the managed tensor: we never rename it */
	struct dl_managed_tensor *m = PyCapsule_GetPointer(capsule, "dltensor");
	if (!m) {
		PyErr_Clear();
		return bad(call, role, "__dlpack__() did not return a 'dltensor' capsule");
	}
	const struct dl_tensor *d = &m->dl_tensor;
	switch (d->device.device_type) {
	case 1:
	case 3:
		t->device = KVR_PY_HOST;
		break;
	case 2:
	case 13:
		t->device = KVR_PY_CUDA;
		t->device_index = d->device.device_id;
		break;
	default:
		return bad(call, role, "a DLPack tensor on device type %d: kvrecall reads CPU or CUDA memory",
			   (int)d->device.device_type);
	}
	if (d->dtype.lanes == 1 && d->dtype.code == 2 && d->dtype.bits == 16)
		t->dtype = KVR_DTYPE_F16;
	else if (d->dtype.lanes == 1 && d->dtype.code == 2 && d->dtype.bits == 32)
		t->dtype = KVR_DTYPE_F32;
	else if (d->dtype.lanes == 1 && d->dtype.code == 4 && d->dtype.bits == 16)
		t->dtype = KVR_DTYPE_BF16;
	else
		t->dtype_name = "a DLPack element type other than float16, bfloat16 and float32";
	t->ndim = d->ndim;
	t->numel = 1;
	for (int i = 0; i < d->ndim; i++) {
		if (i < 8)
			t->shape[i] = d->shape[i];
		t->numel *= d->shape[i];
	}
	if (d->strides) {
		int64_t expect = 1;
		for (int i = d->ndim - 1; i >= 0; i--) {
			if (d->shape[i] > 1 && d->strides[i] != expect)
				return bad(call, role, "the tensor is not C-contiguous");
			expect *= d->shape[i];
		}
	}
	t->data = (char *)d->data + d->byte_offset;
	return 0;
}

int kvr_py_tensor_get(PyObject *obj, const char *call, const char *role, int writable, struct kvr_py_tensor *t)
{
	memset(t, 0, sizeof *t);
	t->dtype = -1;
	t->dtype_name = "another element type";
	if (intern_names())
		return -1;
	if (obj == Py_None)
		return bad(call, role, "None is not a tensor");
	int rc;
	if (is_torch_tensor(obj)) {
		rc = from_torch(obj, call, role, writable, t);
	} else if (PyObject_CheckBuffer(obj)) {
		rc = from_buffer(obj, call, role, writable, t);
	} else {
		PyObject *cai = PyObject_GetAttr(obj, str_cai);
		if (cai) {
			t->keep = cai;
			rc = from_cuda_array_interface(cai, call, role, writable, t);
		} else {
			PyErr_Clear();
			PyObject *has = PyObject_GetAttr(obj, str_dlpack);
			if (has) {
				Py_DECREF(has);
				rc = from_dlpack(obj, call, role, t);
			} else {
				PyErr_Clear();
				PyObject *tn = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__name__");
				Py_ssize_t n = 0;
				const char *u = tn ? PyUnicode_AsUTF8AndSize(tn, &n) : NULL;
				char name[80];
				snprintf(name, sizeof name, "%s", u ? u : "?");
				Py_XDECREF(tn);
				PyErr_Clear();
				rc = bad(call, role,
					 "a '%s' is not a tensor: pass a numpy array, a torch tensor, or an object "
					 "with the buffer protocol, __cuda_array_interface__ or __dlpack__",
					 name);
			}
		}
	}
	if (rc)
		kvr_py_tensor_release(t);
	return rc;
}

void kvr_py_tensor_release(struct kvr_py_tensor *t)
{
	if (t->has_view) {
		PyBuffer_Release(&t->view);
		t->has_view = 0;
	}
	Py_CLEAR(t->keep);
}

PyObject *kvr_py_empty_like(PyObject *like, const struct kvr_py_tensor *t)
{
	if (intern_names())
		return NULL;
	if (t->is_torch) {
		PyObject *shape = PyObject_GetAttr(like, str_shape);
		if (!shape)
			return NULL;
		PyObject *out = PyObject_CallMethodObjArgs(like, str_new_empty, shape, NULL);
		Py_DECREF(shape);
		return out;
	}
	if (t->device != KVR_PY_HOST) {
		kvr_py_raise(-22, "out: pass an output array: only torch tensors and host arrays can be allocated here");
		return NULL;
	}
	const char *dtype = t->dtype == KVR_DTYPE_F16 ? "float16" : t->dtype == KVR_DTYPE_F32 ? "float32" : "uint16";
	PyObject *shape = PyTuple_New(t->ndim);
	for (int i = 0; shape && i < t->ndim && i < 8; i++)
		PyTuple_SetItem(shape, i, PyLong_FromLongLong(t->shape[i]));
	PyObject *np = shape ? PyImport_ImportModule("numpy") : NULL;
	PyObject *out = np ? PyObject_CallMethod(np, "empty", "Os", shape, dtype) : NULL;
	Py_XDECREF(np);
	Py_XDECREF(shape);
	return out;
}

int kvr_py_torch_current_stream(int index, uintptr_t *stream)
{
	*stream = 0;
	PyObject *torch = loaded_torch();
	if (!torch)
		return 0;
	PyObject *cuda = PyObject_GetAttrString(torch, "cuda");
	if (!cuda)
		return -1;
	PyObject *cur = PyObject_CallMethod(cuda, "current_stream", "i", index);
	Py_DECREF(cuda);
	if (!cur)
		return -1;
	PyObject *h = PyObject_GetAttrString(cur, "cuda_stream");
	Py_DECREF(cur);
	if (!h)
		return -1;
	*stream = (uintptr_t)PyLong_AsVoidPtr(h);
	Py_DECREF(h);
	return PyErr_Occurred() ? -1 : 0;
}
