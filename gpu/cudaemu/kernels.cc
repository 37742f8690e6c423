// SPDX-License-Identifier: MIT
// kernels.cc — gpu/cuda_kernels.cu compiled by the host C++ compiler against the
// SIMT shim, giving the kvr_emu_launch_* entry points cudaemu runs. Nothing
// here but the switch: the kernel bodies are the CUDA backend's own.
#define KVR_CUDAEMU 1
#include "../cuda_kernels.cu"
