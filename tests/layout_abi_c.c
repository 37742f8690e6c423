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
