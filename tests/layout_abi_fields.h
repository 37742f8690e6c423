/* SPDX-License-Identifier: MIT */
/*
 * layout_abi_fields.h — every struct shared between C and CUDA code, with every
 * field, as an X-macro list. Expanded once by the C compiler (layout_abi_c.c)
 * and once by nvcc or the C++ compiler (layout_abi_cxx.cu), the two tables must
 * be equal (test_layout_abi.c). A struct added to layouts/ or gpu/gpu.h is added
 * here too.
 */
KVR_ABI_STRUCT(kvr_page_geometry)
KVR_ABI_FIELD(kvr_page_geometry, page_tokens)
KVR_ABI_FIELD(kvr_page_geometry, head_dim)
KVR_ABI_FIELD(kvr_page_geometry, n_kv_heads)
KVR_ABI_FIELD(kvr_page_geometry, elem_type)
KVR_ABI_FIELD(kvr_page_geometry, elem_bytes)
KVR_ABI_FIELD(kvr_page_geometry, reserved)
KVR_ABI_FIELD(kvr_page_geometry, head_bytes)
KVR_ABI_FIELD(kvr_page_geometry, page_bytes)

KVR_ABI_STRUCT(kvr_copy_desc)
KVR_ABI_FIELD(kvr_copy_desc, src_offset)
KVR_ABI_FIELD(kvr_copy_desc, dst_offset)
KVR_ABI_FIELD(kvr_copy_desc, bytes)

KVR_ABI_STRUCT(kvr_gpu_probe)
KVR_ABI_FIELD(kvr_gpu_probe, n_devices)
KVR_ABI_FIELD(kvr_gpu_probe, runtime_version)
KVR_ABI_FIELD(kvr_gpu_probe, compiled)
KVR_ABI_FIELD(kvr_gpu_probe, reserved)
KVR_ABI_FIELD(kvr_gpu_probe, name)
KVR_ABI_FIELD(kvr_gpu_probe, pci_bus_id)
KVR_ABI_FIELD(kvr_gpu_probe, reason)
