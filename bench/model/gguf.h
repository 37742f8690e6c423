/* SPDX-License-Identifier: MIT */
/*
 * gguf.h — a read-only reader for GGUF version 3 model files (ggml's
 * docs/gguf.md), as used by the real-model runner.
 *
 * The file is memory-mapped (or handed in as memory) and validated completely
 * at open: every length, count, type, shape and offset is checked against the
 * bytes that are really there, so that no accessor below can read out of
 * bounds, whatever the file holds. A corrupt or truncated file gives an error
 * and a message naming the key or tensor and the byte offset; nothing aborts.
 * Only little-endian files are read (the format's default); v1 and v2 files
 * and big-endian files are refused with -ENOTSUP.
 *
 * Values and tensor data are not copied: strings, arrays and tensor data
 * point into the mapping, so they live until gguf_close. Strings are not
 * NUL-terminated (GGUF stores a length); key and tensor names are, because the
 * reader keeps its own copies of them.
 *
 * Threads: a struct gguf is immutable after gguf_open returns, so every
 * function taking a `const struct gguf *` may be called from any number of
 * threads at once. gguf_close must not race with anything else on the same
 * reader. There is no global state.
 *
 * Errors: functions returning int give 0 on success or a negative errno:
 *   -EINVAL   the file is not valid GGUF (corrupt, truncated, inconsistent),
 *             or a getter's key has another type than the one asked for;
 *   -ENOTSUP  valid GGUF that this reader does not read: version 1 or 2,
 *             a big-endian file, nested arrays, an unsupported tensor type;
 *   -ERANGE   a getter's value does not fit the type asked for, or an array
 *             index is past the end;
 *   -ENOENT   no such key (getters), or no such file;
 *   -ENOMEM, and the errno of open/fstat/mmap for gguf_open.
 */
#ifndef KVR_MODEL_GGUF_H
#define KVR_MODEL_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Metadata value types, numbered as in the file. */
enum gguf_value_type {
	GGUF_TYPE_UINT8 = 0,
	GGUF_TYPE_INT8 = 1,
	GGUF_TYPE_UINT16 = 2,
	GGUF_TYPE_INT16 = 3,
	GGUF_TYPE_UINT32 = 4,
	GGUF_TYPE_INT32 = 5,
	GGUF_TYPE_FLOAT32 = 6,
	GGUF_TYPE_BOOL = 7,	/* one byte, 0 or 1 (anything else is rejected) */
	GGUF_TYPE_STRING = 8,	/* u64 length + bytes, not NUL-terminated */
	GGUF_TYPE_ARRAY = 9,	/* u32 element type + u64 count + elements */
	GGUF_TYPE_UINT64 = 10,
	GGUF_TYPE_INT64 = 11,
	GGUF_TYPE_FLOAT64 = 12,
};
#define GGUF_TYPE_NONE UINT32_C(0xffffffff) /* gguf_key_type of an absent key */

/*
 * Tensor element types, numbered as ggml's enum ggml_type (ggml.h). The
 * reader accepts the types whose block layout was checked against two
 * sources, ggml-common.h's block structs and gguf-py's GGML_QUANT_SIZES
 * (gguf_type_size lists them); 4 and 5 were removed from ggml, and Q8_1 is
 * refused because the two disagree on its size (36 bytes with ggml's half
 * scales, 40 in gguf-py) and no model file stores it anyway.
 */
enum gguf_ggml_type {
	GGUF_GGML_F32 = 0,
	GGUF_GGML_F16 = 1,
	GGUF_GGML_Q4_0 = 2,
	GGUF_GGML_Q4_1 = 3,
	GGUF_GGML_Q5_0 = 6,
	GGUF_GGML_Q5_1 = 7,
	GGUF_GGML_Q8_0 = 8,
	GGUF_GGML_Q8_1 = 9,
	GGUF_GGML_Q2_K = 10,
	GGUF_GGML_Q3_K = 11,
	GGUF_GGML_Q4_K = 12,
	GGUF_GGML_Q5_K = 13,
	GGUF_GGML_Q6_K = 14,
	GGUF_GGML_Q8_K = 15,
	GGUF_GGML_IQ2_XXS = 16,
	GGUF_GGML_IQ2_XS = 17,
	GGUF_GGML_IQ3_XXS = 18,
	GGUF_GGML_IQ1_S = 19,
	GGUF_GGML_IQ4_NL = 20,
	GGUF_GGML_IQ3_S = 21,
	GGUF_GGML_IQ2_S = 22,
	GGUF_GGML_IQ4_XS = 23,
	GGUF_GGML_I8 = 24,
	GGUF_GGML_I16 = 25,
	GGUF_GGML_I32 = 26,
	GGUF_GGML_I64 = 27,
	GGUF_GGML_F64 = 28,
	GGUF_GGML_IQ1_M = 29,
	GGUF_GGML_BF16 = 30,
	GGUF_GGML_TQ1_0 = 34,
	GGUF_GGML_TQ2_0 = 35,
	GGUF_GGML_MXFP4 = 39,
};

#define GGUF_MAX_DIMS 4
#define GGUF_MAX_NAME 64		/* bytes in a tensor name (spec) */
#define GGUF_MAX_KEY 65535		/* bytes in a key (spec) */
#define GGUF_DEFAULT_ALIGNMENT 32	/* when general.alignment is absent */
#define GGUF_MAX_ALIGNMENT (1u << 20)	/* larger ones are refused as corrupt */
#define GGUF_MODEL_NAME "SmolLM2-135M-Instruct.Q4_1.gguf"

struct gguf; /* opaque; immutable after open */

/* One tensor, as described by the file; owned by the reader. */
struct gguf_tensor {
	const char *name;	/* NUL-terminated copy */
	size_t name_len;	/* bytes, 1..GGUF_MAX_NAME */
	uint32_t n_dims;	/* 1..GGUF_MAX_DIMS */
	uint64_t ne[GGUF_MAX_DIMS]; /* elements per dimension, ne[0] contiguous; unused: 1 */
	uint32_t type;		/* enum gguf_ggml_type, one gguf_type_size accepts */
	uint64_t offset;	/* bytes from the data section's start; a multiple of alignment */
	uint64_t bytes;		/* ne[1]·ne[2]·ne[3] rows of gguf_row_bytes(type, ne[0]) bytes */
	const void *data;	/* in the mapping, at file offset gguf_data_offset() + offset */
};

/*
 * gguf_open — map `path` read-only and validate it. On success *out is a
 * reader to free with gguf_close. On failure *out is NULL and, when err is not
 * NULL, err holds a message starting with the path (err_bytes, truncated with
 * a NUL). Returns 0, -EINVAL, -ENOTSUP, -ENOMEM or the errno of open, fstat or
 * mmap (-ENOENT for a missing file). Blocks on the file system.
 */
int gguf_open(const char *path, struct gguf **out, char *err, size_t err_bytes);

/*
 * gguf_open_memory — the same over `size` bytes at `data`, which are not
 * copied: the caller keeps them alive and unchanged until gguf_close. Tensor
 * data is as aligned as `data` is (page-aligned memory gives the file's own
 * alignment).
 */
int gguf_open_memory(const void *data, size_t size, struct gguf **out, char *err,
		     size_t err_bytes);

/* gguf_close — unmap and free; NULL is accepted. */
void gguf_close(struct gguf *g);

uint32_t gguf_version(const struct gguf *g);	/* always 3 */
uint32_t gguf_alignment(const struct gguf *g);	/* general.alignment or 32 */
uint64_t gguf_data_offset(const struct gguf *g); /* file offset of the data section */
uint64_t gguf_file_size(const struct gguf *g);	/* bytes */
const void *gguf_file_data(const struct gguf *g); /* the file's first byte */

/* ---- metadata -------------------------------------------------------- */

uint64_t gguf_n_keys(const struct gguf *g);
/* The i-th key in file order (NUL-terminated copy), or NULL past the end. */
const char *gguf_key_name(const struct gguf *g, uint64_t i);
/* The index of `key`, or -1 when absent. O(1) (hashed). */
int64_t gguf_find_key(const struct gguf *g, const char *key);
/* The value type of `key` (enum gguf_value_type), or GGUF_TYPE_NONE. */
uint32_t gguf_key_type(const struct gguf *g, const char *key);
/* The same by index; GGUF_TYPE_NONE past the end. */
uint32_t gguf_key_type_at(const struct gguf *g, uint64_t i);
/* "uint32", "string", "array", ...; "unknown" for other numbers. */
const char *gguf_value_type_name(uint32_t type);

/*
 * Typed getters: 0 and *out, or -ENOENT (absent), -EINVAL (another type),
 * -ERANGE (does not fit), leaving *out untouched on failure. For a message,
 * pass the return value to gguf_key_error.
 *   gguf_get_u32/u64/i64: any integer type whose value fits;
 *   gguf_get_f32: float32, or float64 within float's range (NaN passes);
 *   gguf_get_str: *ptr into the file, *len bytes, not NUL-terminated.
 */
int gguf_get_u32(const struct gguf *g, const char *key, uint32_t *out);
int gguf_get_u64(const struct gguf *g, const char *key, uint64_t *out);
int gguf_get_i64(const struct gguf *g, const char *key, int64_t *out);
int gguf_get_f32(const struct gguf *g, const char *key, float *out);
int gguf_get_bool(const struct gguf *g, const char *key, bool *out);
int gguf_get_str(const struct gguf *g, const char *key, const char **ptr, size_t *len);

/*
 * gguf_get_arr — an array's element type, element count and, for numeric and
 * bool elements, *data pointing at the count packed little-endian elements in
 * the file. They need not be aligned: read them with memcpy. For string
 * arrays *data is NULL; use gguf_get_arr_str. Any output may be NULL.
 * -EINVAL when the key is not an array.
 */
int gguf_get_arr(const struct gguf *g, const char *key, uint32_t *elem_type, uint64_t *count,
		 const void **data);

/*
 * gguf_get_arr_str — element `index` of a string array, O(1) (an offset index
 * is built at open). -EINVAL when not an array of strings, -ERANGE when index
 * is not below the count.
 */
int gguf_get_arr_str(const struct gguf *g, const char *key, uint64_t index, const char **ptr,
		     size_t *len);

/*
 * gguf_key_error — write the message for a getter's failure `rc` on `key`
 * into err (optional): what the key holds, at which byte, and what was
 * `wanted` (free text such as "uint32" or "a string array"). Returns rc, so a
 * caller can `return gguf_key_error(g, key, rc, "uint32", err, n);`.
 */
int gguf_key_error(const struct gguf *g, const char *key, int rc, const char *wanted, char *err,
		   size_t err_bytes);

/* ---- tensors --------------------------------------------------------- */

uint64_t gguf_n_tensors(const struct gguf *g);
/* The i-th tensor in file order, or NULL past the end. */
const struct gguf_tensor *gguf_tensor_at(const struct gguf *g, uint64_t i);
/* The tensor called `name`, or NULL. O(1) (hashed). */
const struct gguf_tensor *gguf_find_tensor(const struct gguf *g, const char *name);

/* ---- tensor types ---------------------------------------------------- */

/* "F32", "Q4_1", ...; "unknown" for numbers ggml never assigned. */
const char *gguf_type_name(uint32_t type);
/*
 * gguf_type_size — elements per block and bytes per block of a type this
 * reader accepts (outputs optional); -ENOTSUP for any other.
 */
int gguf_type_size(uint32_t type, uint32_t *block_elems, uint32_t *block_bytes);
/*
 * gguf_row_bytes — bytes of n_elems elements of `type`; 0 when the type is
 * not accepted, n_elems is not a multiple of its block, or it overflows.
 */
uint64_t gguf_row_bytes(uint32_t type, uint64_t n_elems);

/* ---- the model file -------------------------------------------------- */

/*
 * gguf_default_model_path — where SmolLM2-135M-Instruct.Q4_1.gguf is, as
 * bench/model/fetch_model.sh puts it: $KVR_MODEL_PATH when set (then only
 * there), else the first existing one of $KVR_MODEL_DIR/NAME,
 * $XDG_CACHE_HOME/kvrecall/NAME and $HOME/.cache/kvrecall/NAME. Returns 0 with
 * the path in buf; -ENOENT with the last path tried in buf (empty when no
 * variable is set); -ENAMETOOLONG when a path does not fit in `bytes`;
 * -EINVAL for a NULL buf. Reads the environment: do not call it while another
 * thread calls setenv.
 */
int gguf_default_model_path(char *buf, size_t bytes);

#ifdef __cplusplus
}
#endif

#endif /* KVR_MODEL_GGUF_H */
