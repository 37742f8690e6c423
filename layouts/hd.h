/* SPDX-License-Identifier: MIT */
/*
 * hd.h — the one macro that lets layouts/ headers compile as C11 and as CUDA C++.
 *
 * Every function in layouts/ is `static inline KVR_HD`: under nvcc that adds
 * __host__ __device__, so the cpu backend, the CUDA kernels and the cudaemu
 * build (host C++ compiler, no __CUDACC__) all run the same per-element math.
 */
#ifndef KVR_LAYOUTS_HD_H
#define KVR_LAYOUTS_HD_H

#if defined(__CUDACC__)
#define KVR_HD __host__ __device__
#else
#define KVR_HD
#endif

/* Compile-time checks usable from both languages. */
#if defined(__cplusplus)
#define KVR_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define KVR_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif

#endif /* KVR_LAYOUTS_HD_H */
