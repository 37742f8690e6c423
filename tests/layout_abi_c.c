/* SPDX-License-Identifier: MIT */
/* layout_abi_c.c — the shared structs' layout as the C11 compiler sees it.
 * Compiled with -std=c11 -pedantic, which is also the check that every
 * layouts/ header is valid pedantic C11. */
#include <stdalign.h>

#include "gpu.h"
#include "kernels.h"
#include "hd.h"
#include "page.h"
#include "kvquant.h"
#include "freelist.h"
#include "layout_abi.h"

#define KVR_ABI_STRUCT(s) { #s, sizeof(struct s), alignof(struct s) },
#define KVR_ABI_FIELD(s, f) { #s "." #f, offsetof(struct s, f), sizeof(((struct s *)0)->f) },
static const struct kvr_abi_row rows[] = {
#include "layout_abi_fields.h"
};

const struct kvr_abi_row *kvr_abi_table_c(size_t *n_rows)
{
	*n_rows = sizeof(rows) / sizeof(rows[0]);
	return rows;
}

/* gpu/kernels.h's item pointer fields, as "struct.field" (a list the ABI
 * table must contain: test_layout_abi.c). */
#define POINTER_NAME(f) #f,
#define POINTER_ROW(T) { #T, (const char *const[]){ KVR_ITEM_POINTERS_##T(POINTER_NAME) NULL } },
static const struct kvr_abi_pointers pointer_rows[] = { KVR_ITEM_STRUCTS(POINTER_ROW) };

const struct kvr_abi_pointers *kvr_abi_item_pointers(size_t *n_structs)
{
	*n_structs = sizeof(pointer_rows) / sizeof(pointer_rows[0]);
	return pointer_rows;
}
