/* SPDX-License-Identifier: MIT */
/* layout_abi_cxx.cu — the shared structs' layout as nvcc sees it (or, in builds
 * without CUDA, the C++ compiler: tests/layout_abi_cxx.cpp includes this file).
 * Including every layouts/ header here is also the check that they compile as
 * CUDA C++. */
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

#define KVR_STR2(x) #x
#define KVR_STR(x) KVR_STR2(x)

extern "C" const struct kvr_abi_row *kvr_abi_table_other(size_t *n_rows)
{
	*n_rows = sizeof(rows) / sizeof(rows[0]);
	return rows;
}

extern "C" const char *kvr_abi_other_compiler(void)
{
#if defined(__CUDACC__)
	return "nvcc " KVR_STR(__CUDACC_VER_MAJOR__) "." KVR_STR(__CUDACC_VER_MINOR__);
#else
	return "c++ " __VERSION__;
#endif
}
