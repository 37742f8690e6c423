/* SPDX-License-Identifier: MIT */
/*
 * test_layout_abi.c — structs shared between C and CUDA code have the same size,
 * alignment and field offsets under both compilers. The C table comes from the
 * C11 compiler; the other from nvcc in CUDA builds (the C++ compiler otherwise).
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "layout_abi.h"

Test(layout_abi, c_and_cuda_agree)
{
	size_t n_c = 0, n_other = 0;
	const struct kvr_abi_row *c = kvr_abi_table_c(&n_c);
	const struct kvr_abi_row *o = kvr_abi_table_other(&n_other);
	cr_log_info("comparing C11 against %s over %zu rows", kvr_abi_other_compiler(), n_c);
	cr_assert_gt(n_c, 0);
	cr_assert_eq(n_c, n_other, "row counts differ: %zu vs %zu", n_c, n_other);
	for (size_t i = 0; i < n_c; i++) {
		cr_assert_str_eq(c[i].name, o[i].name);
		cr_expect_eq(c[i].a, o[i].a, "%s: %zu (C) vs %zu (%s)", c[i].name, c[i].a, o[i].a,
			     kvr_abi_other_compiler());
		cr_expect_eq(c[i].b, o[i].b, "%s: %zu (C) vs %zu (%s)", c[i].name, c[i].b, o[i].b,
			     kvr_abi_other_compiler());
	}
}

#ifdef KVR_EXPECT_NVCC
Test(layout_abi, other_compiler_is_nvcc)
{
	cr_expect(strncmp(kvr_abi_other_compiler(), "nvcc", 4) == 0, "%s",
		  kvr_abi_other_compiler());
}
#endif

/* Every field of a shared struct is listed: the fields' sizes add up to the
 * struct's size (the structs carry explicit padding, never implicit). */
Test(layout_abi, fields_cover_structs)
{
	size_t n = 0;
	const struct kvr_abi_row *r = kvr_abi_table_c(&n);
	for (size_t i = 0; i < n;) {
		const struct kvr_abi_row *s = &r[i++];
		size_t covered = 0, name_len = strlen(s->name);
		size_t expect_offset = 0;
		while (i < n && !strncmp(r[i].name, s->name, name_len) && r[i].name[name_len] == '.') {
			cr_expect_eq(r[i].a, expect_offset, "%s at %zu, expected %zu (hole before it)",
				     r[i].name, r[i].a, expect_offset);
			expect_offset = r[i].a + r[i].b;
			covered += r[i].b;
			i++;
		}
		cr_expect_eq(covered, s->a, "%s: fields cover %zu of %zu bytes", s->name, covered,
			     s->a);
	}
}

/* The item pointer fields gpu/kernels.h declares once (the list the
 * conformance translators and cudaemu-strict's checks are generated from)
 * are in the ABI table, each pointer-sized: the lists cannot drift apart. */
Test(layout_abi, item_pointer_list_matches_table)
{
	size_t n = 0, n_structs = 0;
	const struct kvr_abi_row *r = kvr_abi_table_c(&n);
	const struct kvr_abi_pointers *p = kvr_abi_item_pointers(&n_structs);
	cr_assert_gt(n_structs, 0);
	for (size_t t = 0; t < n_structs; t++)
		for (const char *const *f = p[t].fields; *f; f++) {
			char name[128];
			snprintf(name, sizeof(name), "%s.%s", p[t].name, *f);
			size_t i = 0;
			while (i < n && strcmp(r[i].name, name))
				i++;
			cr_expect_lt(i, n, "%s is not in the ABI table (tests/layout_abi_fields.h)", name);
			if (i < n)
				cr_expect_eq(r[i].b, sizeof(void *), "%s is %zu bytes, not a pointer", name, r[i].b);
		}
}
