/* SPDX-License-Identifier: MIT */
/* layout_abi.h — the tables test_layout_abi.c compares: one row per struct
 * (sizeof, alignof) and per field (offsetof, sizeof), as each compiler sees it. */
#ifndef KVR_TESTS_LAYOUT_ABI_H
#define KVR_TESTS_LAYOUT_ABI_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

struct kvr_abi_row {
	const char *name; /* "struct" or "struct.field" */
	size_t a;         /* sizeof(struct) or offsetof(field) */
	size_t b;         /* alignof(struct) or sizeof(field) */
};

/* An item struct and its pointer fields (gpu/kernels.h, KVR_ITEM_POINTERS_*). */
struct kvr_abi_pointers {
	const char *name;
	const char *const *fields; /* NULL-terminated */
};
const struct kvr_abi_pointers *kvr_abi_item_pointers(size_t *n_structs);

/* Rows as the C11 compiler sees them. */
const struct kvr_abi_row *kvr_abi_table_c(size_t *n_rows);
/* Rows as the CUDA (or, without nvcc, C++) compiler sees them. */
const struct kvr_abi_row *kvr_abi_table_other(size_t *n_rows);
/* Which compiler produced kvr_abi_table_other: "nvcc ..." or "c++ ...". */
const char *kvr_abi_other_compiler(void);

#ifdef __cplusplus
}
#endif

#endif
