/* SPDX-License-Identifier: MIT */
/*
 * py_module.c — the module kvrecall._kvrecall: its exception classes (errno
 * to exception), the module-level functions over kvrecall.h (version,
 * names, config defaults and validation, device sizes, system and spill
 * directory reports), and module initialisation.
 *
 * Threads: Python threads holding the GIL; system_info and spill_dir_info
 * drop it while they probe the machine.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "py_internal.h"

PyObject *kvr_py_Error;
PyObject *kvr_py_InvalidArgument;
PyObject *kvr_py_OutOfMemory;
PyObject *kvr_py_NotSupported;
PyObject *kvr_py_Busy;
PyObject *kvr_py_SequenceError;

PyObject *kvr_py_raise(int err, const char *message)
{
	PyObject *cls = kvr_py_Error;
	if (err == -EINVAL)
		cls = kvr_py_InvalidArgument;
	else if (err == -ENOMEM)
		cls = kvr_py_OutOfMemory;
	else if (err == -ENOTSUP)
		cls = kvr_py_NotSupported;
	else if (err == -EBUSY)
		cls = kvr_py_Busy;
	PyObject *args = Py_BuildValue("(s)", message && message[0] ? message : kvr_strerror(err));
	if (!args)
		return NULL;
	PyObject *exc = PyObject_Call(cls, args, NULL);
	Py_DECREF(args);
	if (!exc)
		return NULL;
	PyObject *code = PyLong_FromLong(err < 0 ? -err : err);
	if (code) {
		PyObject_SetAttrString(exc, "errno", code);
		Py_DECREF(code);
	}
	PyObject *name = PyUnicode_FromString(kvr_strerror(err));
	if (name) {
		PyObject_SetAttrString(exc, "strerror", name);
		Py_DECREF(name);
	}
	PyErr_SetObject(cls, exc);
	Py_DECREF(exc);
	return NULL;
}

PyObject *kvr_py_raisef(int err, const char *fmt, ...)
{
	char msg[768];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	return kvr_py_raise(err, msg);
}

static PyObject *mod_version(PyObject *self, PyObject *unused)
{
	(void)self;
	(void)unused;
	return PyUnicode_FromString(kvr_version_string());
}

static PyObject *mod_version_number(PyObject *self, PyObject *unused)
{
	(void)self;
	(void)unused;
	return PyLong_FromUnsignedLong(kvr_version_number());
}

static PyObject *mod_strerror(PyObject *self, PyObject *arg)
{
	(void)self;
	const long e = PyLong_AsLong(arg);
	if (e == -1 && PyErr_Occurred())
		return NULL;
	return PyUnicode_FromString(kvr_strerror((int)e));
}

/* enum_names(kind) -> list of names, index = the enum's value. */
static PyObject *mod_enum_names(PyObject *self, PyObject *arg)
{
	(void)self;
	Py_ssize_t n;
	const char *kind = PyUnicode_Check(arg) ? PyUnicode_AsUTF8AndSize(arg, &n) : NULL;
	if (!kind) {
		PyErr_SetString(PyExc_TypeError, "enum_names: kind must be a str");
		return NULL;
	}
	const char *(*fn)(uint32_t) = NULL;
	if (!strcmp(kind, "mode"))
		fn = kvr_mode_name;
	else if (!strcmp(kind, "dtype"))
		fn = kvr_dtype_name;
	else if (!strcmp(kind, "backend"))
		fn = kvr_backend_name;
	else if (!strcmp(kind, "recall"))
		fn = kvr_recall_name;
	else if (!strcmp(kind, "controller"))
		fn = kvr_controller_name;
	else if (!strcmp(kind, "kv_format"))
		fn = kvr_kv_format_name;
	if (!fn) {
		PyErr_Format(PyExc_ValueError, "enum_names: unknown kind '%s'", kind);
		return NULL;
	}
	PyObject *list = PyList_New(0);
	for (uint32_t v = 0; list && v < 64; v++) {
		const char *name = fn(v);
		if (!strcmp(name, "?"))
			break;
		PyObject *s = PyUnicode_FromString(name);
		if (!s || PyList_Append(list, s))
			Py_CLEAR(list);
		Py_XDECREF(s);
	}
	return list;
}

static PyObject *mod_config_defaults(PyObject *self, PyObject *unused)
{
	(void)self;
	(void)unused;
	struct kvr_config cfg;
	kvr_config_init(&cfg);
	return kvr_py_config_to_dict(&cfg);
}

static PyObject *mod_config_validate(PyObject *self, PyObject *arg)
{
	(void)self;
	struct kvr_config cfg;
	if (kvr_py_config_from_mapping(arg, &cfg))
		return NULL;
	char msg[512] = "";
	const int rc = kvr_config_validate(&cfg, msg, sizeof msg);
	if (rc)
		return kvr_py_raise(rc, msg);
	Py_RETURN_NONE;
}

static PyObject *mod_device_bytes_needed(PyObject *self, PyObject *arg)
{
	(void)self;
	struct kvr_config cfg;
	if (kvr_py_config_from_mapping(arg, &cfg))
		return NULL;
	uint64_t fixed = 0, per_seq = 0;
	const int rc = kvr_device_bytes_needed(&cfg, &fixed, &per_seq);
	if (rc)
		return kvr_py_raise(rc, kvr_last_error(NULL));
	return Py_BuildValue("(KK)", (unsigned long long)fixed, (unsigned long long)per_seq);
}

static int set_item(PyObject *d, const char *key, PyObject *v)
{
	if (!v)
		return -1;
	const int rc = PyDict_SetItemString(d, key, v);
	Py_DECREF(v);
	return rc;
}

static PyObject *mod_system_info(PyObject *self, PyObject *unused)
{
	(void)self;
	(void)unused;
	struct kvr_system_info in;
	memset(&in, 0, sizeof in);
	in.size = sizeof in;
	int rc;
	Py_BEGIN_ALLOW_THREADS rc = kvr_system_query(&in);
	Py_END_ALLOW_THREADS
	if (rc && rc != -EIO)
		return kvr_py_raise(rc, kvr_last_error(NULL));
	PyObject *d = PyDict_New();
	if (!d)
		return NULL;
	int e = 0;
	e |= set_item(d, "version", PyUnicode_FromString(kvr_version_string()));
	e |= set_item(d, "cuda_compiled", PyBool_FromLong(in.cuda_compiled));
	e |= set_item(d, "cuda_runtime_version", PyLong_FromUnsignedLong(in.cuda_runtime_version));
	e |= set_item(d, "liburing_compiled", PyBool_FromLong(in.liburing_compiled));
	e |= set_item(d, "gpu_archs", PyUnicode_FromString(in.gpu_archs));
	e |= set_item(d, "n_gpus", PyLong_FromUnsignedLong(in.n_gpus));
	e |= set_item(d, "gpu_name", PyUnicode_FromString(in.gpu_name));
	e |= set_item(d, "gpu_pci_bus_id", PyUnicode_FromString(in.gpu_pci_bus_id));
	e |= set_item(d, "gpu_reason", PyUnicode_FromString(in.gpu_reason));
	e |= set_item(d, "cpu_model", PyUnicode_FromString(in.cpu_model));
	e |= set_item(d, "cpu_avx2", PyBool_FromLong(in.cpu_avx2));
	e |= set_item(d, "cpu_avx512", PyBool_FromLong(in.cpu_avx512));
	e |= set_item(d, "cpu_f16c", PyBool_FromLong(in.cpu_f16c));
	e |= set_item(d, "cpu_kernels", PyUnicode_FromString(in.cpu_kernels));
	e |= set_item(d, "cpu_kernels_note", PyUnicode_FromString(in.cpu_kernels_note));
	e |= set_item(d, "n_numa_nodes", PyLong_FromUnsignedLong(in.n_numa_nodes));
	e |= set_item(d, "n_cores", PyLong_FromUnsignedLong(in.n_cores));
	e |= set_item(d, "n_pus", PyLong_FromUnsignedLong(in.n_pus));
	e |= set_item(d, "memory_bytes", PyLong_FromUnsignedLongLong(in.memory_bytes));
	e |= set_item(d, "l3_bytes", PyLong_FromUnsignedLongLong(in.l3_bytes));
	e |= set_item(d, "io_uring_available", PyBool_FromLong(in.io_uring_available));
	e |= set_item(d, "io_uring_reason", PyUnicode_FromString(in.io_uring_reason));
	if (e) {
		Py_DECREF(d);
		return NULL;
	}
	return d;
}

static PyObject *mod_spill_dir_info(PyObject *self, PyObject *args)
{
	(void)self;
	PyObject *dir = Py_None;
	if (!PyArg_ParseTuple(args, "|O:spill_dir_info", &dir))
		return NULL;
	char path[4096] = "";
	if (dir != Py_None) {
		PyObject *bytes = NULL;
		if (!PyUnicode_FSConverter(dir, &bytes))
			return NULL;
		snprintf(path, sizeof path, "%s", PyBytes_AsString(bytes));
		Py_DECREF(bytes);
	}
	struct kvr_spill_dir_info in;
	memset(&in, 0, sizeof in);
	in.size = sizeof in;
	int rc;
	char msg[512] = "";
	Py_BEGIN_ALLOW_THREADS rc = kvr_spill_dir_query(path[0] ? path : NULL, &in);
	if (rc)
		snprintf(msg, sizeof msg, "%s", kvr_last_error(NULL));
	Py_END_ALLOW_THREADS
	if (rc)
		return kvr_py_raise(rc, msg);
	PyObject *d = PyDict_New();
	if (!d)
		return NULL;
	int e = 0;
	e |= set_item(d, "dir", PyUnicode_FromString(in.dir));
	e |= set_item(d, "direct_io", PyBool_FromLong(in.direct_io));
	e |= set_item(d, "dio_align", PyLong_FromUnsignedLong(in.dio_align));
	e |= set_item(d, "io_uring_available", PyBool_FromLong(in.io_uring_available));
	e |= set_item(d, "free_bytes", PyLong_FromUnsignedLongLong(in.free_bytes));
	e |= set_item(d, "fs_type", PyUnicode_FromString(in.fs_type));
	e |= set_item(d, "reason", PyUnicode_FromString(in.reason));
	if (e) {
		Py_DECREF(d);
		return NULL;
	}
	return d;
}

static PyMethodDef module_methods[] = {
	{ "version", mod_version, METH_NOARGS, "The loaded library's version string." },
	{ "version_number", mod_version_number, METH_NOARGS, "major * 10000 + minor * 100 + patch." },
	{ "strerror", mod_strerror, METH_O, "strerror(code): kvrecall's description of an errno." },
	{ "enum_names", mod_enum_names, METH_O,
	  "enum_names(kind) -> list: the names of an enum (mode, dtype, backend, recall, controller, kv_format)." },
	{ "config_defaults", mod_config_defaults, METH_NOARGS, "kvr_config_init's defaults as a dict." },
	{ "config_validate", mod_config_validate, METH_O,
	  "config_validate(dict): raise the error kvr_config_validate finds, naming the field." },
	{ "device_bytes_needed", mod_device_bytes_needed, METH_O,
	  "device_bytes_needed(dict) -> (fixed_bytes, per_sequence_bytes)." },
	{ "system_info", mod_system_info, METH_NOARGS, "What this build and machine offer (kvrecall info)." },
	{ "spill_dir_info", mod_spill_dir_info, METH_VARARGS,
	  "spill_dir_info(dir=None) -> dict: what a directory offers the spill tier." },
	{ NULL, NULL, 0, NULL },
};

static struct PyModuleDef module_def = {
	PyModuleDef_HEAD_INIT,
	.m_name = "kvrecall._kvrecall",
	.m_doc = "kvrecall's C API for Python (use the kvrecall package).",
	.m_size = -1,
	.m_methods = module_methods,
};

static PyObject *new_exception(PyObject *module, const char *name, const char *doc, PyObject *bases)
{
	char full[96];
	snprintf(full, sizeof full, "kvrecall.%s", name);
	PyObject *cls = PyErr_NewExceptionWithDoc(full, doc, bases, NULL);
	Py_XDECREF(bases);
	if (!cls)
		return NULL;
	Py_INCREF(cls); /* one for the global, one for the module */
	if (PyModule_AddObject(module, name, cls)) {
		Py_DECREF(cls);
		Py_DECREF(cls);
		return NULL;
	}
	return cls;
}

PyMODINIT_FUNC PyInit__kvrecall(void);

PyMODINIT_FUNC PyInit__kvrecall(void)
{
	PyObject *m = PyModule_Create(&module_def);
	if (!m)
		return NULL;
	kvr_py_Error = new_exception(m, "Error",
				     "A kvrecall call failed. errno: the positive errno; strerror: its name; "
				     "str(e): kvr_last_error's message.",
				     NULL);
	if (!kvr_py_Error)
		goto fail;
	Py_INCREF(kvr_py_Error);
	kvr_py_InvalidArgument = new_exception(m, "InvalidArgument", "An argument outside its rule (EINVAL).",
					       PyTuple_Pack(2, kvr_py_Error, PyExc_ValueError));
	Py_DECREF(kvr_py_Error);
	kvr_py_OutOfMemory = new_exception(m, "OutOfMemory",
					   "Host memory, the pool's capacity or the device budget is exhausted (ENOMEM).",
					   PyTuple_Pack(2, kvr_py_Error, PyExc_MemoryError));
	kvr_py_NotSupported = new_exception(m, "NotSupported", "A valid request this build or backend does not "
							      "support (ENOTSUP).",
					    PyTuple_Pack(1, kvr_py_Error));
	kvr_py_Busy = new_exception(m, "Busy", "The object is in use, e.g. by an open decode step (EBUSY).",
				    PyTuple_Pack(1, kvr_py_Error));
	kvr_py_SequenceError = new_exception(m, "SequenceError",
					     "Sequences of a decode step failed; the step's other sequences are "
					     "valid (DecodeStep.status).",
					     PyTuple_Pack(1, kvr_py_Error));
	if (!kvr_py_InvalidArgument || !kvr_py_OutOfMemory || !kvr_py_NotSupported || !kvr_py_Busy ||
	    !kvr_py_SequenceError)
		goto fail;

	kvr_py_ContextType = PyType_FromSpec(&kvr_py_context_spec);
	kvr_py_StepType = PyType_FromSpec(&kvr_py_step_spec);
	kvr_py_ThreadPoolType = PyType_FromSpec(&kvr_py_thread_pool_spec);
	if (!kvr_py_ContextType || !kvr_py_StepType || !kvr_py_ThreadPoolType)
		goto fail;
	Py_INCREF(kvr_py_ContextType);
	Py_INCREF(kvr_py_StepType);
	Py_INCREF(kvr_py_ThreadPoolType);
	if (PyModule_AddObject(m, "Context", kvr_py_ContextType) ||
	    PyModule_AddObject(m, "DecodeStep", kvr_py_StepType) ||
	    PyModule_AddObject(m, "ThreadPool", kvr_py_ThreadPoolType))
		goto fail;
	if (PyModule_AddIntConstant(m, "VERSION_NUMBER", KVR_VERSION_NUMBER) ||
	    PyModule_AddIntConstant(m, "MAX_LAYERS", KVR_MAX_LAYERS) ||
	    PyModule_AddIntConstant(m, "THREADS_AUTO", (long)KVR_THREADS_AUTO) ||
	    PyModule_AddIntConstant(m, "TOKENS_AUTO", (long)KVR_TOKENS_AUTO) ||
	    PyModule_AddIntConstant(m, "NUMA_NODE_AUTO", KVR_NUMA_NODE_AUTO))
		goto fail;
	return m;
fail:
	Py_DECREF(m);
	return NULL;
}
