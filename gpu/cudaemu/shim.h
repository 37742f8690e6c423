/* SPDX-License-Identifier: MIT */
/*
 * shim.h — the CUDA programming model for kernels compiled by the host C++
 * compiler (cudaemu). gpu/cuda/cuda_compat.h includes it when KVR_CUDAEMU is
 * defined; the gpu/ .cu files are then built as C++17 and every KVR_LAUNCH runs
 * synchronously on the calling OS thread (gpu/cudaemu/shim.cc): the blocks of
 * the grid one after another, the threads of a block as fibers on that OS
 * thread, in a shuffled order between barriers. Launches from several OS
 * threads may run at once: each has its own scheduler, its own copy of every
 * __shared__ array and its own last-error state, as CUDA's is per host thread.
 *
 * Everything is declared in namespace kvr_emu and brought into the global
 * namespace by using-declarations, so a test program that links the real CUDA
 * objects too sees no clash of cudaError_t, dim3 or cudaGetLastError.
 *
 * Differences from a GPU that a kernel can notice, all deliberate:
 *  - static __shared__ arrays are not poisoned between blocks (they keep the
 *    previous block's values); the KVR_DYNAMIC_SHARED buffer is filled with
 *    0xA5 bytes before each block;
 *  - a thread that exits while others wait at __syncthreads, or while lanes of
 *    its warp wait in a warp operation, fails the launch (undefined on a GPU);
 *  - warp operations accept only the full mask 0xffffffff, as the contract
 *    says; a shuffle reading a lane past the end of a partial last warp
 *    returns the caller's own value.
 */
#ifndef KVR_GPU_CUDAEMU_SHIM_H
#define KVR_GPU_CUDAEMU_SHIM_H

#include <math.h> /* nvcc makes the math library visible to every .cu file */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <utility>

extern "C" {
/* Order of the fibers between barriers on the calling OS thread: 0 runs them in
 * linear thread order; any other value draws a new permutation for every phase
 * from a generator reset to `seed` at the start of each launch, so one seed
 * always gives the same interleaving. Applies to later launches from this
 * thread. */
void kvr_emu_set_order_seed(uint64_t seed);
/* Why the most recent failed launch on the calling OS thread failed; "" when
 * none has. Kept after cudaGetLastError() has cleared the error. */
const char *kvr_emu_last_launch_message(void);
}

#define __global__
#define __device__
#define __host__
#define __forceinline__ __inline__ __attribute__((always_inline))
/* The blocks of a launch run one after another on the launching OS thread, so
 * one per-OS-thread static is exactly one copy per running block. */
#define __shared__ static thread_local

namespace kvr_emu {

struct uint3 {
	unsigned int x, y, z;
};

struct dim3 {
	unsigned int x, y, z;
	constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
	    : x(vx), y(vy), z(vz)
	{}
	constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
	constexpr operator uint3() const { return uint3{ x, y, z }; }
};

/* The built-in variables of the running block (one per launching OS thread). */
struct block_builtins {
	uint3 block_idx;
	dim3 block_dim;
	dim3 grid_dim;
	void *dynamic_shared; /* 16-byte aligned, `smem` bytes of the launch */
};

/* Set by the scheduler before it resumes a fiber; read only by kernel code.
 * Defined here, constant-initialised, so that every access is a plain TLS
 * load: an extern thread_local goes through a TLS wrapper call instead, and
 * g++ 12's UBSan null check on that path misfires. */
inline thread_local const uint3 *tls_thread_idx = nullptr;
inline thread_local const block_builtins *tls_block = nullptr;

constexpr int warpSize = 32;

/* CUDA's values. The shim reports only the configuration and launch
 * failures; cudaErrorInvalidValue exists for launchers that classify errors. */
enum cudaError_t {
	cudaSuccess = 0,
	cudaErrorInvalidValue = 1,
	cudaErrorInvalidConfiguration = 9,
	cudaErrorLaunchFailure = 719,
};

struct emu_stream; /* never defined: streams only order work, and launches are synchronous */
typedef emu_stream *cudaStream_t;

/* As CUDA's, per host thread: the error of the last failed launch on the
 * calling OS thread, reset to cudaSuccess by reading it (a later successful
 * launch does not clear it). */
cudaError_t cudaGetLastError();
const char *cudaGetErrorName(cudaError_t err);
const char *cudaGetErrorString(cudaError_t err);

/* ---- block and warp synchronisation (shim.cc) ---- */

void __syncthreads();
void __syncwarp(unsigned int mask = 0xffffffffu);

enum class shfl_mode { idx, up, down, bfly };
/* One shuffle of a 32-bit value, with PTX shfl.sync semantics for `b` (source
 * lane, delta or lane mask) and `width` (a power of two up to 32). */
uint32_t shfl_bits(shfl_mode mode, unsigned int mask, uint32_t value, unsigned int b, int width);
unsigned int __ballot_sync(unsigned int mask, int predicate);
int __any_sync(unsigned int mask, int predicate);
int __all_sync(unsigned int mask, int predicate);

template <typename T>
inline T shfl_typed(shfl_mode mode, unsigned int mask, T var, unsigned int b, int width)
{
	static_assert(sizeof(T) == sizeof(uint32_t), "shuffles move 32-bit values");
	uint32_t bits;
	memcpy(&bits, &var, sizeof(bits));
	bits = shfl_bits(mode, mask, bits, b, width);
	memcpy(&var, &bits, sizeof(bits));
	return var;
}

/* CUDA's overloads: int, unsigned int and float. */
#define KVR_EMU_SHFL(name, mode, btype)                                                \
	inline int name(unsigned int mask, int var, btype b, int width = warpSize)     \
	{                                                                              \
		return shfl_typed(mode, mask, var, (unsigned int)b, width);            \
	}                                                                              \
	inline unsigned int name(unsigned int mask, unsigned int var, btype b,         \
				 int width = warpSize)                                 \
	{                                                                              \
		return shfl_typed(mode, mask, var, (unsigned int)b, width);            \
	}                                                                              \
	inline float name(unsigned int mask, float var, btype b, int width = warpSize) \
	{                                                                              \
		return shfl_typed(mode, mask, var, (unsigned int)b, width);            \
	}
KVR_EMU_SHFL(__shfl_sync, shfl_mode::idx, int)
KVR_EMU_SHFL(__shfl_up_sync, shfl_mode::up, unsigned int)
KVR_EMU_SHFL(__shfl_down_sync, shfl_mode::down, unsigned int)
KVR_EMU_SHFL(__shfl_xor_sync, shfl_mode::bfly, int)
#undef KVR_EMU_SHFL

/* The device's memory fences order a GPU's concurrent threads; the fibers of
 * a launch run one at a time on one OS thread, so there is nothing to order. */
inline void __threadfence() {}
inline void __threadfence_system() {}

/* ---- atomics ----
 * A fiber is never switched out inside an atomic, so the fibers of one launch
 * need no more than a read-modify-write; the __atomic builtins also keep
 * kernels running from different OS threads on shared memory correct. */

template <typename T> inline T atomic_add(T *address, T val)
{
	return __atomic_fetch_add(address, val, __ATOMIC_RELAXED);
}

template <typename T, typename Better> inline T atomic_update(T *address, T val, Better better)
{
	T old = __atomic_load_n(address, __ATOMIC_RELAXED);
	while (better(val, old) &&
	       !__atomic_compare_exchange_n(address, &old, val, true, __ATOMIC_RELAXED,
					    __ATOMIC_RELAXED)) {
	}
	return old;
}

template <typename T> inline T atomic_cas(T *address, T compare, T val)
{
	__atomic_compare_exchange_n(address, &compare, val, false, __ATOMIC_RELAXED,
				    __ATOMIC_RELAXED);
	return compare; /* the old value, whether or not it was replaced */
}

inline int atomicAdd(int *address, int val)
{
	return atomic_add(address, val);
}
inline unsigned int atomicAdd(unsigned int *address, unsigned int val)
{
	return atomic_add(address, val);
}
inline unsigned long long atomicAdd(unsigned long long *address, unsigned long long val)
{
	return atomic_add(address, val);
}
inline float atomicAdd(float *address, float val)
{
	float old;
	__atomic_load(address, &old, __ATOMIC_RELAXED);
	float sum = old + val;
	while (!__atomic_compare_exchange(address, &old, &sum, true, __ATOMIC_RELAXED,
					  __ATOMIC_RELAXED))
		sum = old + val;
	return old;
}

inline int atomicOr(int *address, int val)
{
	return __atomic_fetch_or(address, val, __ATOMIC_RELAXED);
}
inline unsigned int atomicOr(unsigned int *address, unsigned int val)
{
	return __atomic_fetch_or(address, val, __ATOMIC_RELAXED);
}

inline int atomicMax(int *address, int val)
{
	return atomic_update(address, val, [](int v, int old) { return v > old; });
}
inline unsigned int atomicMax(unsigned int *address, unsigned int val)
{
	return atomic_update(address, val,
			     [](unsigned int v, unsigned int old) { return v > old; });
}
inline int atomicMin(int *address, int val)
{
	return atomic_update(address, val, [](int v, int old) { return v < old; });
}
inline unsigned int atomicMin(unsigned int *address, unsigned int val)
{
	return atomic_update(address, val,
			     [](unsigned int v, unsigned int old) { return v < old; });
}

inline int atomicCAS(int *address, int compare, int val)
{
	return atomic_cas(address, compare, val);
}
inline unsigned int atomicCAS(unsigned int *address, unsigned int compare, unsigned int val)
{
	return atomic_cas(address, compare, val);
}
inline unsigned long long atomicCAS(unsigned long long *address, unsigned long long compare,
				    unsigned long long val)
{
	return atomic_cas(address, compare, val);
}

inline int atomicExch(int *address, int val)
{
	return __atomic_exchange_n(address, val, __ATOMIC_RELAXED);
}
inline unsigned int atomicExch(unsigned int *address, unsigned int val)
{
	return __atomic_exchange_n(address, val, __ATOMIC_RELAXED);
}
inline unsigned long long atomicExch(unsigned long long *address, unsigned long long val)
{
	return __atomic_exchange_n(address, val, __ATOMIC_RELAXED);
}
inline float atomicExch(float *address, float val)
{
	float old;
	__atomic_exchange(address, &val, &old, __ATOMIC_RELAXED);
	return old;
}

/* ---- bit casts ---- */

inline unsigned int __float_as_uint(float x)
{
	unsigned int u;
	memcpy(&u, &x, sizeof(u));
	return u;
}
inline float __uint_as_float(unsigned int u)
{
	float x;
	memcpy(&x, &u, sizeof(x));
	return x;
}
/* Bits set in x (CUDA's __popc). */
inline int __popc(unsigned int x)
{
	return __builtin_popcount(x);
}

inline int __float_as_int(float x)
{
	int i;
	memcpy(&i, &x, sizeof(i));
	return i;
}
inline float __int_as_float(int i)
{
	float x;
	memcpy(&x, &i, sizeof(x));
	return x;
}

/* ---- launches ---- */

/* Runs body(closure) as every thread of every block of the grid, or records
 * why it cannot (cudaGetLastError, kvr_emu_last_launch_message). */
void launch(const char *kernel_name, dim3 grid, dim3 block, size_t smem,
	    void (*body)(const void *closure), const void *closure);

/* One prepared KVR_LAUNCH; its call operator takes the kernel's arguments. */
template <typename... P> class launch_call {
public:
	launch_call(const char *name, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem)
	    : name_(name), kernel_(kernel), grid_(grid), block_(block), smem_(smem)
	{}

	template <typename... A> void operator()(A &&...args) const
	{
		static_assert(
			sizeof...(A) == sizeof...(P),
			"KVR_LAUNCH: the number of arguments differs from the kernel's parameters");
		/* The arguments are evaluated and converted once, as the host does
		 * for <<<>>>; each thread then gets its own copy of the parameters,
		 * which it may modify, as on the device. */
		const frame f{ kernel_, std::tuple<P...>(std::forward<A>(args)...) };
		launch(
			name_, grid_, block_, smem_,
			[](const void *closure) {
				const frame *fr = static_cast<const frame *>(closure);
				std::apply(fr->kernel, fr->params);
			},
			&f);
	}

private:
	struct frame {
		void (*kernel)(P...);
		std::tuple<P...> params;
	};
	const char *name_;
	void (*kernel_)(P...);
	dim3 grid_, block_;
	size_t smem_;
};

/* The stream is evaluated and type-checked like the CUDA build's cast, then
 * ignored: a launch completes before KVR_LAUNCH returns. */
template <typename... P>
inline launch_call<P...> prepare_launch(const char *name, void (*kernel)(P...), dim3 grid,
					dim3 block, size_t smem, cudaStream_t)
{
	return launch_call<P...>(name, kernel, grid, block, smem);
}

} /* namespace kvr_emu */

using kvr_emu::__all_sync;
using kvr_emu::__any_sync;
using kvr_emu::__ballot_sync;
using kvr_emu::__float_as_int;
using kvr_emu::__popc;
using kvr_emu::__float_as_uint;
using kvr_emu::__int_as_float;
using kvr_emu::__shfl_down_sync;
using kvr_emu::__shfl_sync;
using kvr_emu::__shfl_up_sync;
using kvr_emu::__shfl_xor_sync;
using kvr_emu::__syncthreads;
using kvr_emu::__syncwarp;
using kvr_emu::__threadfence;
using kvr_emu::__threadfence_system;
using kvr_emu::__uint_as_float;
using kvr_emu::atomicAdd;
using kvr_emu::atomicCAS;
using kvr_emu::atomicExch;
using kvr_emu::atomicMax;
using kvr_emu::atomicMin;
using kvr_emu::atomicOr;
using kvr_emu::cudaError_t;
using kvr_emu::cudaErrorInvalidConfiguration;
using kvr_emu::cudaErrorInvalidValue;
using kvr_emu::cudaErrorLaunchFailure;
using kvr_emu::cudaGetErrorName;
using kvr_emu::cudaGetErrorString;
using kvr_emu::cudaGetLastError;
using kvr_emu::cudaStream_t;
using kvr_emu::cudaSuccess;
using kvr_emu::dim3;
using kvr_emu::uint3;
using kvr_emu::warpSize;

#define threadIdx (*::kvr_emu::tls_thread_idx)
#define blockIdx (::kvr_emu::tls_block->block_idx)
#define blockDim (::kvr_emu::tls_block->block_dim)
#define gridDim (::kvr_emu::tls_block->grid_dim)

/* Launch `kernel` on grid x block threads (each a dim3 or an integer) with
 * `smem` bytes of dynamic shared memory; the launch runs to completion on the
 * calling thread before this returns (the stream is not used). */
#define KVR_LAUNCH(kernel, grid, block, smem, stream, ...)                    \
	::kvr_emu::prepare_launch(#kernel, (kernel), (grid), (block), (smem), \
				  (::kvr_emu::cudaStream_t)(stream))(__VA_ARGS__)
/* The launch's dynamic shared buffer, typed; only inside a kernel. */
#define KVR_DYNAMIC_SHARED(type, name) \
	type *const name = static_cast<type *>(::kvr_emu::tls_block->dynamic_shared)

#endif /* KVR_GPU_CUDAEMU_SHIM_H */
