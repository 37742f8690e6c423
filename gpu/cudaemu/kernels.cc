// SPDX-License-Identifier: MIT
// kernels.cc — the CUDA kernel files compiled by the host C++ compiler against the
// SIMT shim, giving the kvr_emu_launch_* entry points cudaemu runs. Nothing
// here but the switch: the kernel bodies are the CUDA backend's own.
#define KVR_CUDAEMU 1
#include "../cuda/cuda_copy.cu"
#include "../cuda/cuda_score.cu"
#include "../cuda/cuda_attention.cu"
