#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# llama_side_by_side.sh — kvrecall's decode against llama.cpp's on the same
# GGUF and the same number of threads, back to back.
#
# llama.cpp is the one vendored in the llama-cpp-python sdist the tests'
# fixtures came from (tests/data/model/make_logits.py). The sdist is fetched
# from PyPI into the cache (outside the repository) and only `llama-bench` is
# built, once per ISA:
#   native  GGML_NATIVE=ON (AVX-512 where the CPU has it; AMX off), one build
#           per CPU model and flag set (a build from another machine may stop
#           on an illegal instruction)
#   avx2    AVX2+FMA+F16C, AVX-512 off, to compare with KVR_CPU_ISA=avx2
#
#   bench/model/llama_side_by_side.sh [native|avx2] [CONTEXT ...]
#       default: native 4096 8192; kvrecall must be built in build-run first:
#       meson setup build-run -Dbuildtype=release -Dtests=disabled && ninja -C build-run
#   bench/model/llama_side_by_side.sh --build-only [native|avx2]
#
# For each context L it runs, with 2 threads on each side:
#   llama-bench -m MODEL -p 0 -n 64 -d L -t 2 -fa 0,1 -r 2     (tg64 at depth L)
#   kvrecall eval --context L+64 --prefill L --modes dense,freekv --budget 1024
#       --threads 1                                  (the main thread + 1 worker)
# kvrecall's text is the GPL-3 (and GPL-2 past 4K) from common-licenses.
# Cache: ${XDG_CACHE_HOME:-$HOME/.cache}/kvrecall/llamacpp.
set -euo pipefail

PKG=llama-cpp-python==0.3.36
SDIST=llama_cpp_python-0.3.36
here=$(cd "$(dirname "$0")/../.." && pwd)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/kvrecall/llamacpp
build_only=0
if [ "${1:-}" = --build-only ]; then
	build_only=1
	shift
fi
isa=${1:-native}
[ $# -gt 0 ] && shift
contexts=("$@")
[ ${#contexts[@]} -gt 0 ] || contexts=(4096 8192)
case $isa in
# AMX is left out: where the kernel or the hypervisor does not grant the
# tiles (seen on a Xeon VM that lists amx_tile), ggml's AMX products stop on
# an illegal instruction at the first prompt batch.
native) flags=(-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
	       "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16") ;;
avx2) flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
	     -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF) ;;
*) echo "llama_side_by_side.sh: ISA is native or avx2, not '$isa'" >&2; exit 2 ;;
esac

src=$cache/$SDIST/vendor/llama.cpp
# A native build is only good on the CPU it was built for, and the cache
# outlives machines: key its folder by the CPU's model and flags.
build_dir=build-$isa
if [ "$isa" = native ]; then
	cpu_key=$(grep -E '^(model name|flags)' /proc/cpuinfo 2>/dev/null | sort -u | sha256sum | cut -c1-12) || true
	build_dir=build-native-noamx-${cpu_key:-unknown}
fi
bench=$src/$build_dir/bin/llama-bench
if [ ! -x "$bench" ]; then
	mkdir -p "$cache"
	if [ ! -d "$src" ]; then
		python3 -m pip download --no-binary :all: --no-deps "$PKG" -d "$cache"
		tar -xzf "$cache/$SDIST.tar.gz" -C "$cache"
	fi
	cmake -S "$src" -B "$src/$build_dir" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
		-DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF "${flags[@]}" >/dev/null
	cmake --build "$src/$build_dir" --target llama-bench -j"$(nproc)" >/dev/null
fi
echo "llama-bench: $bench"
[ $build_only = 1 ] && exit 0

model=$("$here/bench/model/fetch_model.sh")
kvrecall=$here/build-run/bench/kvrecall
[ -x "$kvrecall" ] || { echo "llama_side_by_side.sh: build $kvrecall first" >&2; exit 1; }
if [ "$isa" = avx2 ]; then
	export KVR_CPU_ISA=avx2 KQ_ISA=avx2
fi
"$kvrecall" info | grep -E 'cpu |simd'
for L in "${contexts[@]}"; do
	files=(--file /usr/share/common-licenses/GPL-3)
	[ "$L" -gt 4096 ] && files+=(--file /usr/share/common-licenses/GPL-2)
	"$bench" -m "$model" -p 0 -n 64 -d "$L" -t 2 -fa 0,1 -r 2 -o md
	"$kvrecall" eval "${files[@]}" --context $((L + 64)) --prefill "$L" --modes dense,freekv \
		--budget 1024 --threads 1
done
