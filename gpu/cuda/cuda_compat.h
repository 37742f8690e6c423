/* SPDX-License-Identifier: MIT */
/*
 * cuda_compat.h — the only way the .cu files of gpu/ reach the CUDA programming
 * model, so the same kernel bodies compile twice:
 *  - by nvcc for the cuda backend (this header includes cuda_runtime.h);
 *  - by the host C++ compiler for cudaemu (-DKVR_CUDAEMU): the SIMT shim in
 *    gpu/cudaemu/shim.h supplies threadIdx/blockIdx/blockDim/gridDim,
 *    __syncthreads, __shared__, warp shuffles and ballots, atomics, and runs a
 *    launch synchronously on the CPU (blocks one after another, the threads of a
 *    block as fibers whose order between barriers is shuffled).
 *
 * Kernels may use only what the shim provides: __global__/__device__/
 * __host__/__forceinline__, __shared__ arrays of static size or one dynamic
 * KVR_DYNAMIC_SHARED buffer, __syncthreads, __syncwarp, __shfl_sync,
 * __shfl_xor_sync, __shfl_down_sync, __ballot_sync (full mask 0xffffffff),
 * atomicAdd/atomicMax/atomicMin/atomicCAS on int, unsigned and float (Add),
 * __float_as_uint/__uint_as_float/__float_as_int/__int_as_float, math.h
 * functions, and the layouts/ headers. No cooperative groups, inline PTX,
 * textures, warp-synchronous code without __syncwarp, or dynamic parallelism.
 * Every launch goes through KVR_LAUNCH.
 *
 * KVR_KERNEL_SYMBOL(name) gives the C-linkage entry points distinct names in
 * the two builds (kvr_cuda_name / kvr_emu_name), so both can be linked into one
 * test program.
 */
#ifndef KVR_GPU_CUDA_COMPAT_H
#define KVR_GPU_CUDA_COMPAT_H

#define KVR_CAT2(a, b) a##b
#define KVR_CAT(a, b) KVR_CAT2(a, b)

#if defined(KVR_CUDAEMU)
#include "../cudaemu/shim.h"
#define KVR_KERNEL_SYMBOL(name) KVR_CAT(kvr_emu_, name)
#else
#include <cuda_runtime.h>
#define KVR_KERNEL_SYMBOL(name) KVR_CAT(kvr_cuda_, name)
/* Launch `kernel` on grid x block threads with `smem` dynamic shared bytes on
 * an opaque stream handle (a cudaStream_t). */
#define KVR_LAUNCH(kernel, grid, block, smem, stream, ...) \
	kernel<<<(grid), (block), (smem), (cudaStream_t)(stream)>>>(__VA_ARGS__)
/* The one dynamic shared-memory buffer of a kernel, typed. */
#define KVR_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

#endif /* KVR_GPU_CUDA_COMPAT_H */
