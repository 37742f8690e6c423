/* SPDX-License-Identifier: MIT */
/*
 * topology.h — what host/ knows about the machine: NUMA nodes, cores, caches,
 * memory (hwloc and libnuma), and whether io_uring works. Host-only; no CUDA.
 */
#ifndef KVR_HOST_TOPOLOGY_H
#define KVR_HOST_TOPOLOGY_H

#include <stddef.h>
#include <stdint.h>

struct kvr_topology_summary {
	uint32_t n_numa_nodes; /* NUMA nodes (at least 1) */
	uint32_t n_cores;      /* physical cores */
	uint32_t n_pus;        /* hardware threads */
	uint64_t l3_bytes;     /* largest last-level (L3, else L2) cache, bytes; 0 if unknown */
	uint64_t memory_bytes; /* physical memory, bytes (sysconf: hwloc undercounts here) */
};

/* Fill *out from hwloc. Returns 0, or -EIO with a reason in err_buf when hwloc
 * cannot load the topology (memory_bytes is still filled). */
int kvr_topology_summarize(struct kvr_topology_summary *out, char *err_buf, size_t err_bytes);

/* Highest NUMA node id with libnuma usable, or 0 when NUMA is unavailable. */
int kvr_numa_max_node(void);

/* NUMA node of the CPU the calling thread runs on (0 when unknown). */
int kvr_numa_current_node(void);

/* 1 when an io_uring instance can be created here; otherwise 0 and the reason
 * ("liburing not compiled", "io_uring_queue_init: Operation not permitted"). */
int kvr_io_uring_probe(char *reason, size_t reason_bytes);

#endif /* KVR_HOST_TOPOLOGY_H */

/*
 * Choose the NUMA node for host page memory:
 *  1. override >= 0: that node, if the topology has it (else -EINVAL);
 *  2. a GPU PCI bus id ("0000:17:00.0") found in the topology: the first NUMA
 *     node local to the GPU's nearest non-I/O ancestor (its PCIe root);
 *  3. otherwise current_node (the calling thread's node).
 * topo_xml: NULL for this machine, or an hwloc XML file (tests use synthetic
 * multi-node topologies). Writes the reason for the choice into why. Returns
 * the node (>= 0) or a negative errno.
 */
int kvr_topology_choose_node(const char *topo_xml, int override, const char *gpu_pci_bus_id,
			     int current_node, char *why, size_t why_bytes);
