/* SPDX-License-Identifier: MIT */
/*
 * sysinfo.c — kvr_system_query(): the facts `kvrecall info` reports, gathered
 * from gpu/ (device probe), host/ (hwloc, libnuma, io_uring) and layouts/ (CPU
 * vector extensions). Threads: any.
 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "../gpu/gpu.h"
#include "../host/spill.h"
#include "../host/topology.h"
#include "../layouts/convert.h"
#include "../layouts/base/isa.h"
#include "internal.h"

KVR_API int kvr_system_query(struct kvr_system_info *info)
{
	if (!info)
		return kvr_fail(NULL, -EINVAL, "info: is NULL");
	/* 0.6's struct ended at io_uring_reason: its callers are still served */
	const size_t size_060 = offsetof(struct kvr_system_info, cpu_kernels);
	if (info->size != sizeof(*info) && info->size != size_060)
		return kvr_fail(NULL, -EINVAL,
				"size: must be sizeof(struct kvr_system_info) = %zu (got %u)",
				sizeof(*info), info->size);
	const int has_kernels = info->size == sizeof(*info);
	memset(info, 0, info->size);
	info->size = has_kernels ? sizeof(*info) : (uint32_t)size_060;
	info->version_number = KVR_VERSION_NUMBER;

	struct kvr_gpu_probe probe;
	kvr_gpu_probe(&probe);
	info->cuda_compiled = (uint32_t)probe.compiled;
	info->cuda_runtime_version = (uint32_t)probe.runtime_version;
	snprintf(info->gpu_archs, sizeof(info->gpu_archs), "%s", kvr_gpu_compiled_archs());
	info->n_gpus = (uint32_t)probe.n_devices;
	snprintf(info->gpu_name, sizeof(info->gpu_name), "%s", probe.name);
	snprintf(info->gpu_pci_bus_id, sizeof(info->gpu_pci_bus_id), "%s", probe.pci_bus_id);
	snprintf(info->gpu_reason, sizeof(info->gpu_reason), "%s", probe.reason);

	const struct kvr_isa *isa = kvr_isa_get();
	kvr_isa_cpu_model(info->cpu_model, sizeof(info->cpu_model));
	info->cpu_avx2 = isa->avx2;
	info->cpu_avx512 = isa->avx512;
	info->cpu_f16c = isa->f16c;
	if (has_kernels) {
		const enum kvr_convert_isa active = kvr_convert_isa_active();
		snprintf(info->cpu_kernels, sizeof(info->cpu_kernels), "%s", kvr_convert_isa_name(active));
		enum kvr_convert_isa asked;
		kvr_convert_isa_request(&asked, info->cpu_kernels_note, sizeof(info->cpu_kernels_note));
	}

#ifdef KVR_HAVE_LIBURING
	info->liburing_compiled = 1;
#endif
	info->io_uring_available =
		(uint32_t)kvr_io_uring_probe(info->io_uring_reason, sizeof(info->io_uring_reason));

	struct kvr_topology_summary topo;
	char reason[256] = "";
	int err = kvr_topology_summarize(&topo, reason, sizeof(reason));
	info->n_numa_nodes = topo.n_numa_nodes;
	info->n_cores = topo.n_cores;
	info->n_pus = topo.n_pus;
	info->memory_bytes = topo.memory_bytes;
	info->l3_bytes = topo.l3_bytes;
	if (err)
		return kvr_fail(NULL, err, "topology: %s", reason);
	return 0;
}

KVR_API int kvr_spill_dir_query(const char *dir, struct kvr_spill_dir_info *info)
{
	if (!info)
		return kvr_fail(NULL, -EINVAL, "info: is NULL");
	if (info->size < sizeof(*info))
		return kvr_fail(NULL, -EINVAL,
				"size: must be sizeof(struct kvr_spill_dir_info) = %zu (got %u)",
				sizeof(*info), info->size);
	memset(info, 0, sizeof(*info));
	info->size = sizeof(*info);
	if (!dir || !*dir)
		dir = kvr_spill_default_dir();
	snprintf(info->dir, sizeof(info->dir), "%s", dir);
	char why[128];
	info->io_uring_available = (uint32_t)kvr_io_uring_probe(why, sizeof(why));
	int err = kvr_spill_probe_dir(dir, &info->direct_io, &info->dio_align, info->fs_type,
				      sizeof(info->fs_type), &info->free_bytes, info->reason,
				      sizeof(info->reason));
	if (err)
		return kvr_fail(NULL, err, "%s", info->reason);
	return 0;
}
