/* SPDX-License-Identifier: MIT */
/*
 * py_config.c — struct kvr_config to and from a dict of its fields, by name.
 * The Python Config class (kvrecall/__init__.py) turns names like
 * mode="freekv" into the enums' integers and back; this file only moves
 * integers, floats and strings in and out of the struct, so it needs no
 * change when the Python side grows conveniences. log_fn, parallel_for and
 * device_alloc are set by the Context, never from the dict.
 *
 * Threads: Python threads holding the GIL.
 */
#include <stddef.h>
#include <string.h>

#include "py_internal.h"

enum field_kind { F_U32, F_I32, F_U64, F_F32, F_STR };

struct field {
	const char *name;
	size_t offset;
	enum field_kind kind;
	size_t bytes; /* F_STR: the array's size */
};

#define U32(f) { #f, offsetof(struct kvr_config, f), F_U32, 0 }
#define U64(f) { #f, offsetof(struct kvr_config, f), F_U64, 0 }

static const struct field fields[] = {
	U32(n_layers),
	U32(n_qo_heads),
	U32(n_kv_heads),
	U32(head_dim),
	U32(dtype),
	U32(page_tokens),
	U32(budget_tokens),
	U32(sink_tokens),
	U32(window_tokens),
	{ "tau", offsetof(struct kvr_config, tau), F_F32, 0 },
	U32(mode),
	U32(backend),
	U32(recall_buffers),
	U32(max_sequences),
	U32(max_batch),
	U64(pool_bytes),
	U64(device_bytes),
	{ "numa_node", offsetof(struct kvr_config, numa_node), F_I32, 0 },
	U32(threads),
	U32(recall_chunk_pages),
	U32(log_level),
	U32(recall),
	U32(pool_layout),
	U32(controller),
	U32(kv_format),
	U32(spill_queue_depth),
	U64(pool_ram_bytes),
	{ "spill_dir", offsetof(struct kvr_config, spill_dir), F_STR, sizeof(((struct kvr_config *)0)->spill_dir) },
	U32(estimate),
};

#undef U32
#undef U64

static const struct field *find_field(const char *name)
{
	for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
		if (!strcmp(fields[i].name, name))
			return &fields[i];
	return NULL;
}

static int set_dense_layers(struct kvr_config *cfg, PyObject *value)
{
	memset(cfg->dense_layers, 0, sizeof cfg->dense_layers);
	PyObject *it = PyObject_GetIter(value);
	if (!it) {
		PyErr_Clear();
		PyErr_SetString(PyExc_TypeError, "Config: dense_layers must be an iterable of layer indices");
		return -1;
	}
	PyObject *item;
	while ((item = PyIter_Next(it))) {
		const long long l = PyLong_AsLongLong(item);
		Py_DECREF(item);
		if (l == -1 && PyErr_Occurred()) {
			Py_DECREF(it);
			return -1;
		}
		if (l < 0 || l >= (long long)KVR_MAX_LAYERS) {
			Py_DECREF(it);
			kvr_py_raisef(-22, "Config: dense_layers: layer %lld is outside 0..%u", l, KVR_MAX_LAYERS - 1);
			return -1;
		}
		cfg->dense_layers[l / 64] |= 1ull << (l % 64);
	}
	Py_DECREF(it);
	return PyErr_Occurred() ? -1 : 0;
}

static int set_field(struct kvr_config *cfg, const struct field *f, PyObject *value)
{
	char *base = (char *)cfg + f->offset;
	switch (f->kind) {
	case F_U32: {
		const unsigned long long v = PyLong_AsUnsignedLongLong(value);
		if (v == (unsigned long long)-1 && PyErr_Occurred())
			break;
		if (v > UINT32_MAX) {
			kvr_py_raisef(-22, "Config: %s = %llu does not fit 32 bits", f->name, v);
			return -1;
		}
		const uint32_t u = (uint32_t)v;
		memcpy(base, &u, sizeof u);
		return 0;
	}
	case F_I32: {
		const long long v = PyLong_AsLongLong(value);
		if (v == -1 && PyErr_Occurred())
			break;
		if (v < INT32_MIN || v > INT32_MAX) {
			kvr_py_raisef(-22, "Config: %s = %lld does not fit 32 bits", f->name, v);
			return -1;
		}
		const int32_t i = (int32_t)v;
		memcpy(base, &i, sizeof i);
		return 0;
	}
	case F_U64: {
		const unsigned long long v = PyLong_AsUnsignedLongLong(value);
		if (v == (unsigned long long)-1 && PyErr_Occurred())
			break;
		const uint64_t u = v;
		memcpy(base, &u, sizeof u);
		return 0;
	}
	case F_F32: {
		const double d = PyFloat_AsDouble(value);
		if (d == -1.0 && PyErr_Occurred())
			break;
		const float x = (float)d;
		memcpy(base, &x, sizeof x);
		return 0;
	}
	case F_STR: {
		Py_ssize_t n;
		const char *s = PyUnicode_Check(value) ? PyUnicode_AsUTF8AndSize(value, &n) : NULL;
		if (!s) {
			PyErr_Clear();
			PyErr_Format(PyExc_TypeError, "Config: %s must be a str", f->name);
			return -1;
		}
		if ((size_t)n >= f->bytes) {
			kvr_py_raisef(-22, "Config: %s is %zd bytes; at most %zu fit", f->name, n, f->bytes - 1);
			return -1;
		}
		memset(base, 0, f->bytes);
		memcpy(base, s, (size_t)n);
		return 0;
	}
	}
	/* a conversion failed: say which field */
	PyObject *type, *val, *tb;
	PyErr_Fetch(&type, &val, &tb);
	const int overflow = type && PyErr_GivenExceptionMatches(type, PyExc_OverflowError);
	Py_XDECREF(type);
	Py_XDECREF(val);
	Py_XDECREF(tb);
	if (overflow)
		kvr_py_raisef(-22, "Config: %s is out of range for its field", f->name);
	else
		PyErr_Format(PyExc_TypeError, "Config: %s must be %s", f->name,
			     f->kind == F_F32 ? "a number" : "an int");
	return -1;
}

int kvr_py_config_from_mapping(PyObject *mapping, struct kvr_config *cfg)
{
	kvr_config_init(cfg);
	if (!PyDict_Check(mapping)) {
		PyErr_SetString(PyExc_TypeError, "config must be a dict of field names");
		return -1;
	}
	Py_ssize_t pos = 0;
	PyObject *key, *value;
	while (PyDict_Next(mapping, &pos, &key, &value)) {
		Py_ssize_t n;
		const char *name = PyUnicode_Check(key) ? PyUnicode_AsUTF8AndSize(key, &n) : NULL;
		if (!name) {
			PyErr_Clear();
			PyErr_SetString(PyExc_TypeError, "config field names must be str");
			return -1;
		}
		if (!strcmp(name, "dense_layers")) {
			if (set_dense_layers(cfg, value))
				return -1;
			continue;
		}
		const struct field *f = find_field(name);
		if (!f) {
			PyErr_Format(PyExc_TypeError, "Config: unknown field '%s'", name);
			return -1;
		}
		if (set_field(cfg, f, value))
			return -1;
	}
	return 0;
}

PyObject *kvr_py_config_to_dict(const struct kvr_config *cfg)
{
	PyObject *d = PyDict_New();
	if (!d)
		return NULL;
	for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
		const struct field *f = &fields[i];
		const char *base = (const char *)cfg + f->offset;
		PyObject *v = NULL;
		switch (f->kind) {
		case F_U32: {
			uint32_t u;
			memcpy(&u, base, sizeof u);
			v = PyLong_FromUnsignedLong(u);
			break;
		}
		case F_I32: {
			int32_t x;
			memcpy(&x, base, sizeof x);
			v = PyLong_FromLong(x);
			break;
		}
		case F_U64: {
			uint64_t u;
			memcpy(&u, base, sizeof u);
			v = PyLong_FromUnsignedLongLong(u);
			break;
		}
		case F_F32: {
			float x;
			memcpy(&x, base, sizeof x);
			v = PyFloat_FromDouble((double)x);
			break;
		}
		case F_STR:
			v = PyUnicode_FromStringAndSize(base, (Py_ssize_t)strnlen(base, f->bytes));
			break;
		}
		if (!v || PyDict_SetItemString(d, f->name, v)) {
			Py_XDECREF(v);
			Py_DECREF(d);
			return NULL;
		}
		Py_DECREF(v);
	}
	PyObject *layers = PyList_New(0);
	if (!layers) {
		Py_DECREF(d);
		return NULL;
	}
	for (uint32_t l = 0; l < KVR_MAX_LAYERS; l++) {
		if (!(cfg->dense_layers[l / 64] >> (l % 64) & 1))
			continue;
		PyObject *v = PyLong_FromUnsignedLong(l);
		if (!v || PyList_Append(layers, v)) {
			Py_XDECREF(v);
			Py_DECREF(layers);
			Py_DECREF(d);
			return NULL;
		}
		Py_DECREF(v);
	}
	const int rc = PyDict_SetItemString(d, "dense_layers", layers);
	Py_DECREF(layers);
	if (rc) {
		Py_DECREF(d);
		return NULL;
	}
	return d;
}
