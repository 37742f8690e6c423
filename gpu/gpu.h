/* SPDX-License-Identifier: MIT */
/*
 * gpu.h — the C boundary of gpu/: what the rest of kvrecall may ask of a device
 * backend. Valid C11; no CUDA types cross it. Entries implemented in .cu files
 * have C linkage.
 *
 * It holds device discovery and host-memory registration; memory, streams,
 * events, copies and kernels are backend.h's.
 */
#ifndef KVR_GPU_GPU_H
#define KVR_GPU_GPU_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct kvr_gpu_probe {
	int32_t n_devices;          /* usable CUDA devices; 0 when none */
	int32_t runtime_version;    /* CUDART_VERSION compiled against, 0 without CUDA */
	int32_t compiled;           /* 1 when the CUDA backend is compiled in */
	int32_t reserved;
	char name[128];             /* device 0's name */
	char pci_bus_id[32];        /* device 0's PCI bus id, for host/'s NUMA choice */
	char reason[256];           /* why n_devices is 0: the exact CUDA error, or "not compiled" */
};

/* Probe CUDA devices. Never fails: a machine without a GPU or driver gives
 * n_devices = 0 and a reason. Threads: any; the result is computed once. */
void kvr_gpu_probe(struct kvr_gpu_probe *out);

/* Page-lock host memory for fast, asynchronous device copies (cudaHostRegister).
 * Returns 0; -ENODEV when no GPU is usable (or CUDA is not compiled in), so the
 * caller falls back to mlock; -ENOMEM or -EIO with the CUDA error in `reason`.
 * Threads: any. */
int kvr_gpu_host_register(void *ptr, size_t bytes, char *reason, size_t reason_bytes);
/* Undo kvr_gpu_host_register. Returns 0 or -EIO. */
int kvr_gpu_host_unregister(void *ptr);

/* SM architectures the CUDA backend was compiled for ("80,90"), "" without CUDA. */
const char *kvr_gpu_compiled_archs(void);

#ifdef __cplusplus
}
#endif

#endif /* KVR_GPU_GPU_H */
