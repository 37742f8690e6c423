/* SPDX-License-Identifier: MIT */
/*
 * cuda_device.cu — device discovery for the CUDA backend.
 *
 * cudart is linked statically, so this runs on machines without libcudart.so.
 * Without a driver, cudaGetDeviceCount returns cudaErrorInsufficientDriver (35)
 * or cudaErrorStubLibrary (34) and leaves the count unwritten: the count starts
 * at 0 and any error or zero means "no GPU", with the error's name kept as the
 * reason. The probe runs once (the first CUDA call initialises the runtime).
 */
#include <cuda_runtime.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "../gpu.h"

#ifndef KVR_GPU_ARCHS
#define KVR_GPU_ARCHS ""
#endif

static struct kvr_gpu_probe probe_cached;
static pthread_once_t probe_once = PTHREAD_ONCE_INIT;

static void probe_run(void)
{
	struct kvr_gpu_probe *p = &probe_cached;
	memset(p, 0, sizeof(*p));
	p->compiled = 1;
	p->runtime_version = CUDART_VERSION;
	int count = 0;
	cudaError_t err = cudaGetDeviceCount(&count);
	if (err != cudaSuccess) {
		snprintf(p->reason, sizeof(p->reason), "cudaGetDeviceCount: %s (%d): %s",
			 cudaGetErrorName(err), (int)err, cudaGetErrorString(err));
		(void)cudaGetLastError(); /* clear the non-sticky error */
		return;
	}
	if (count <= 0) {
		snprintf(p->reason, sizeof(p->reason), "cudaGetDeviceCount: 0 devices");
		return;
	}
	cudaDeviceProp prop;
	err = cudaGetDeviceProperties(&prop, 0);
	if (err != cudaSuccess) {
		snprintf(p->reason, sizeof(p->reason), "cudaGetDeviceProperties(0): %s",
			 cudaGetErrorName(err));
		(void)cudaGetLastError();
		return;
	}
	p->n_devices = count;
	snprintf(p->name, sizeof(p->name), "%.96s (sm_%d%d, %.1f GiB)", prop.name, prop.major,
		 prop.minor, (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
	if (cudaDeviceGetPCIBusId(p->pci_bus_id, (int)sizeof(p->pci_bus_id), 0) != cudaSuccess) {
		p->pci_bus_id[0] = '\0';
		(void)cudaGetLastError();
	}
}

extern "C" void kvr_gpu_probe(struct kvr_gpu_probe *out)
{
	pthread_once(&probe_once, probe_run);
	*out = probe_cached;
}

extern "C" const char *kvr_gpu_compiled_archs(void)
{
	return KVR_GPU_ARCHS;
}

extern "C" int kvr_gpu_host_register(void *ptr, size_t bytes, char *reason, size_t reason_bytes)
{
	struct kvr_gpu_probe probe;
	kvr_gpu_probe(&probe);
	if (probe.n_devices == 0) {
		snprintf(reason, reason_bytes, "no GPU: %s", probe.reason);
		return -ENODEV;
	}
	cudaError_t err = cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
	if (err != cudaSuccess) {
		snprintf(reason, reason_bytes, "cudaHostRegister(%zu bytes): %s", bytes,
			 cudaGetErrorName(err));
		(void)cudaGetLastError();
		return err == cudaErrorMemoryAllocation ? -ENOMEM : -EIO;
	}
	return 0;
}

extern "C" int kvr_gpu_host_unregister(void *ptr)
{
	if (cudaHostUnregister(ptr) != cudaSuccess) {
		(void)cudaGetLastError();
		return -EIO;
	}
	return 0;
}
