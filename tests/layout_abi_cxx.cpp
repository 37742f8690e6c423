/* SPDX-License-Identifier: MIT */
/* Builds without CUDA compare C against the host C++ compiler instead of nvcc. */
#include "layout_abi_cxx.cu"
