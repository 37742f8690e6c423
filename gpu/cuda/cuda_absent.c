/* SPDX-License-Identifier: MIT */
/*
 * cuda_absent.c — device discovery when the CUDA backend is not compiled in
 * (no nvcc at build time, or -Dcuda=disabled): there is never a GPU, and the
 * reason says so.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "../gpu.h"

void kvr_gpu_probe(struct kvr_gpu_probe *out)
{
	memset(out, 0, sizeof(*out));
	snprintf(out->reason, sizeof(out->reason),
		 "CUDA backend not compiled (nvcc not found at build time or -Dcuda=disabled)");
}

const char *kvr_gpu_compiled_archs(void)
{
	return "";
}

int kvr_gpu_host_register(void *ptr, size_t bytes, char *reason, size_t reason_bytes)
{
	(void)ptr;
	(void)bytes;
	snprintf(reason, reason_bytes, "no GPU: CUDA backend not compiled");
	return -ENODEV;
}

int kvr_gpu_host_unregister(void *ptr)
{
	(void)ptr;
	return 0;
}

/* Without CUDA compiled in, the cuda device kind does not exist. */
#include "../backend_impl.h"

int kvr_cuda_dev_init(struct kvr_dev *dev, const struct kvr_dev_params *params, char *err,
		      size_t err_bytes)
{
	(void)dev;
	(void)params;
	snprintf(err, err_bytes, "CUDA backend not compiled (nvcc not found at build time or -Dcuda=disabled)");
	return -ENODEV;
}
