/* SPDX-License-Identifier: MIT */
/*
 * topology.c — machine facts for placement and for `kvrecall info`.
 *
 * hwloc returns -1 and sets errno; everything here turns that into a negative
 * errno with a reason at once. Threads: any (each call loads its own topology).
 */
#include <errno.h>
#include <numa.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <hwloc.h>

#ifdef KVR_HAVE_LIBURING
#include <liburing.h>
#endif

#include "topology.h"

int kvr_topology_summarize(struct kvr_topology_summary *out, char *err_buf, size_t err_bytes)
{
	memset(out, 0, sizeof(*out));
	long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
	if (pages > 0 && page > 0)
		out->memory_bytes = (uint64_t)pages * (uint64_t)page;
	out->n_numa_nodes = 1;

	hwloc_topology_t topo;
	if (hwloc_topology_init(&topo) < 0) {
		snprintf(err_buf, err_bytes, "hwloc_topology_init: %s", strerror(errno));
		return -EIO;
	}
	if (hwloc_topology_load(topo) < 0) {
		snprintf(err_buf, err_bytes, "hwloc_topology_load: %s", strerror(errno));
		hwloc_topology_destroy(topo);
		return -EIO;
	}
	int n = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
	out->n_numa_nodes = n > 0 ? (uint32_t)n : 1;
	n = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
	out->n_cores = n > 0 ? (uint32_t)n : 0;
	n = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU);
	out->n_pus = n > 0 ? (uint32_t)n : 0;
	static const hwloc_obj_type_t last_levels[] = { HWLOC_OBJ_L3CACHE, HWLOC_OBJ_L2CACHE };
	for (size_t t = 0; t < 2 && !out->l3_bytes; t++) {
		int count = hwloc_get_nbobjs_by_type(topo, last_levels[t]);
		for (int i = 0; i < count; i++) {
			hwloc_obj_t o = hwloc_get_obj_by_type(topo, last_levels[t], (unsigned)i);
			if (o && o->attr && o->attr->cache.size > out->l3_bytes)
				out->l3_bytes = o->attr->cache.size;
		}
	}
	hwloc_topology_destroy(topo);
	return 0;
}

int kvr_numa_max_node(void)
{
	return numa_available() < 0 ? 0 : numa_max_node();
}

int kvr_numa_current_node(void)
{
	if (numa_available() < 0)
		return 0;
	int cpu = sched_getcpu();
	int node = cpu < 0 ? -1 : numa_node_of_cpu(cpu);
	return node < 0 ? 0 : node;
}

int kvr_io_uring_probe(char *reason, size_t reason_bytes)
{
#ifdef KVR_HAVE_LIBURING
	struct io_uring ring;
	int ret = io_uring_queue_init(2, &ring, 0);
	if (ret < 0) {
		snprintf(reason, reason_bytes, "io_uring_queue_init: %s", strerror(-ret));
		return 0;
	}
	io_uring_queue_exit(&ring);
	if (reason_bytes)
		reason[0] = '\0';
	return 1;
#else
	snprintf(reason, reason_bytes, "liburing not compiled in (liburing-dev missing at build time)");
	return 0;
#endif
}

static int topology_load(hwloc_topology_t *out, const char *xml, int with_io, char *why,
			 size_t why_bytes)
{
	hwloc_topology_t topo;
	if (hwloc_topology_init(&topo) < 0) {
		snprintf(why, why_bytes, "hwloc_topology_init: %s", strerror(errno));
		return -EIO;
	}
	/* Keep PCI devices when a GPU's position is to decide the node. Only then:
	 * PCI discovery is slow, and its plugin leaks a little memory per load. */
	if (with_io)
		hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
	if (xml && hwloc_topology_set_xml(topo, xml) < 0) {
		snprintf(why, why_bytes, "hwloc: cannot use topology file %s: %s", xml, strerror(errno));
		hwloc_topology_destroy(topo);
		return -EINVAL;
	}
	if (hwloc_topology_load(topo) < 0) {
		snprintf(why, why_bytes, "hwloc_topology_load%s%s: %s", xml ? " " : "", xml ? xml : "",
			 strerror(errno));
		hwloc_topology_destroy(topo);
		return -EIO;
	}
	*out = topo;
	return 0;
}

static int node_exists(hwloc_topology_t topo, int node)
{
	hwloc_obj_t o = NULL;
	while ((o = hwloc_get_next_obj_by_type(topo, HWLOC_OBJ_NUMANODE, o)))
		if ((int)o->os_index == node)
			return 1;
	return 0;
}

int kvr_topology_choose_node(const char *topo_xml, int override, const char *gpu_pci_bus_id,
			     int current_node, char *why, size_t why_bytes)
{
	hwloc_topology_t topo;
	const int want_gpu = override < 0 && gpu_pci_bus_id && *gpu_pci_bus_id;
	int err = topology_load(&topo, topo_xml, want_gpu, why, why_bytes);
	if (err)
		return err;
	int node = -1;
	if (override >= 0) {
		if (!node_exists(topo, override)) {
			snprintf(why, why_bytes, "numa_node: node %d does not exist", override);
			node = -EINVAL;
		} else {
			snprintf(why, why_bytes, "node %d as configured", override);
			node = override;
		}
		goto out;
	}
	if (gpu_pci_bus_id && *gpu_pci_bus_id) {
		hwloc_obj_t dev = hwloc_get_pcidev_by_busidstring(topo, gpu_pci_bus_id);
		hwloc_obj_t anc = dev ? hwloc_get_non_io_ancestor_obj(topo, dev) : NULL;
		int first = anc && anc->nodeset ? hwloc_bitmap_first(anc->nodeset) : -1;
		if (first >= 0) {
			snprintf(why, why_bytes, "node %d, nearest the GPU at %s", first, gpu_pci_bus_id);
			node = first;
			goto out;
		}
		snprintf(why, why_bytes, "GPU %s not found in the topology; ", gpu_pci_bus_id);
	} else if (why_bytes) {
		why[0] = '\0';
	}
	node = node_exists(topo, current_node) ? current_node : 0;
	const size_t used = strlen(why);
	snprintf(why + used, why_bytes > used ? why_bytes - used : 0, "node %d, the calling thread's",
		 node);
out:
	hwloc_topology_destroy(topo);
	return node;
}
