#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# gpu_check.sh — the device check: the CUDA path's tests, compute-sanitizer
# memcheck, `kvrecall selftest` and `kvrecall bench decode` in one command,
# every log and JSON into one folder, and a one-screen summary at the end.
#
# GPU machines lent for a few minutes are often bare (no Criterion, hwloc,
# liburing or libnuma), so the check runs in two halves:
#
#   bench/gpu_check.sh pack DIR [--build BUILD] [--arch 90]
#       here: build with CUDA (release, the card's arch; or take BUILD as it
#       is) and copy the test and bench executables, stripped, with every
#       shared library they need beyond the C runtime and the driver, into
#       DIR (26 MiB for sm_90).
#   bench/gpu_check.sh run --bundle DIR [--out OUT] [flags]
#       on the GPU machine: run the stages from the bundle.
#   bench/gpu_check.sh run --build BUILD [--out OUT] [flags]
#       anywhere the build is: run the stages from a build folder.
#   bench/gpu_check.sh run --emu --build BUILD --quick
#       without a GPU (what CI runs): the same stages on cudaemu, the CUDA
#       kernels compiled for the host (conformance's cudaemu suites and the
#       scheduler's cudaemu-strict tests); memcheck skipped; selftest and the
#       decode benchmark on the cpu backend as a check of the commands.
#
# Flags for run: --quick (one test per test stage, a short benchmark: under a
# minute on cudaemu), --skip STAGE[,STAGE] (conformance, scheduler, memcheck,
# selftest, decode). Exit status 0 when every stage that ran passed.
# Stages in order (memcheck last, the slowest, so that a run cut short keeps
# the others): conformance, scheduler, selftest, decode, memcheck.
set -uo pipefail

usage() {
	sed -n '4,30p' "$0" | sed 's/^# \{0,1\}//'
	exit 2
}

[ $# -ge 1 ] || usage
verb=$1
shift

# ------------------------------------------------------------------ pack
if [ "$verb" = pack ]; then
	[ $# -ge 1 ] || usage
	dest=$1
	shift
	build="" arch=90
	while [ $# -gt 0 ]; do
		case $1 in
		--build) build=$2; shift 2 ;;
		--arch) arch=$2; shift 2 ;;
		*) usage ;;
		esac
	done
	cd "$(dirname "$0")/.." || exit 1
	if [ -z "$build" ]; then
		build=build-gpu-check
		if [ ! -f "$build/build.ninja" ]; then
			meson setup "$build" --buildtype=release -Dcuda=enabled -Dgpu_archs="$arch" \
				-Dtests=enabled -Dbench=true -Dpython=disabled || exit 1
		fi
		ninja -C "$build" tests/test_conformance tests/test_scheduler bench/kvrecall || exit 1
	fi
	rm -rf "$dest"
	mkdir -p "$dest/tests" "$dest/bench" "$dest/lib" || exit 1
	for exe in tests/test_conformance tests/test_scheduler bench/kvrecall; do
		[ -x "$build/$exe" ] || { echo "gpu_check: $build/$exe is missing" >&2; exit 1; }
		cp "$build/$exe" "$dest/$exe" && strip --strip-debug "$dest/$exe"
	done
	# libraries the machine may lack: all but the C and C++ runtimes, the
	# loader and the driver's (the driver's come from the GPU machine)
	for exe in "$dest"/tests/* "$dest"/bench/*; do
		ldd "$exe" | awk '$3 ~ /^\// { print $3 }'
	done | sort -u | while read -r lib; do
		case $(basename "$lib") in
		libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | libresolv.so* | ld-linux* | libstdc++.so* | libgcc_s.so* | \
			libcuda.so* | libnvidia*) ;;
		*) cp -L "$lib" "$dest/lib/" ;;
		esac
	done
	git rev-parse --short HEAD >"$dest/REVISION" 2>/dev/null || true
	du -sh "$dest"
	exit 0
fi

[ "$verb" = run ] || usage

# ------------------------------------------------------------------ run
bundle="" build="" out="${OUT:-gpu-check-out}" emu=0 quick=0 skip=""
while [ $# -gt 0 ]; do
	case $1 in
	--bundle) bundle=$2; shift 2 ;;
	--build) build=$2; shift 2 ;;
	--out) out=$2; shift 2 ;;
	--emu) emu=1; shift ;;
	--quick) quick=1; shift ;;
	--skip) skip=",$2,"; shift 2 ;;
	*) usage ;;
	esac
done
root=${bundle:-$build}
[ -n "$root" ] || { echo "gpu_check: run needs --bundle DIR or --build DIR" >&2; exit 2; }
[ -d "$root" ] || { echo "gpu_check: $root: no such folder" >&2; exit 2; }
if [ -n "$bundle" ]; then
	export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
mkdir -p "$out" || exit 2
summary="$out/summary.txt"
: >"$summary"

if [ $emu = 0 ] && ! nvidia-smi -L >/dev/null 2>&1; then
	echo "gpu_check: no GPU answers nvidia-smi: run with --emu for the cudaemu check" >&2
	exit 2
fi
if [ $emu = 0 ]; then
	gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader | head -n1)
	conf_suite=cuda sched_suffix=cuda backend=cuda
else
	gpu="none (cudaemu: the CUDA kernels compiled for the host)"
	conf_suite=cudaemu_order0 sched_suffix=cudaemu_strict backend=cpu
fi

failed=0
# stage NAME COMMAND...: run it with its output in OUT/NAME.log, timed
stage() {
	local name=$1
	shift
	if [[ $skip == *",$name,"* ]]; then
		printf '%-12s skipped (--skip)\n' "$name" | tee -a "$summary"
		return 0
	fi
	local t0=$SECONDS rc
	echo "== $name: $*" >"$out/$name.log"
	"$@" >>"$out/$name.log" 2>&1
	rc=$?
	local took=$((SECONDS - t0))
	if [ $rc -eq 0 ]; then
		printf '%-12s ok      %4d s\n' "$name" "$took" | tee -a "$summary"
	else
		printf '%-12s FAILED  %4d s  (exit %d; %s)\n' "$name" "$took" "$rc" "$out/$name.log" | tee -a "$summary"
		tail -n 15 "$out/$name.log" | sed 's/^/    /'
		failed=1
	fi
}

echo "gpu_check: $(date -u +%FT%TZ), revision $(cat "$root/REVISION" 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)" | tee -a "$summary"
echo "gpu: $gpu" | tee -a "$summary"

conf_filter="$conf_suite/*" sched_filter="scheduler/*_$sched_suffix"
if [ $quick = 1 ]; then
	conf_filter="$conf_suite/attention_quant_planted"
	sched_filter="scheduler/ordering_under_random_delays_$sched_suffix"
fi
# a Criterion executable over a filter: a filter that matches no test fails
criterion() {
	local log
	log=$(mktemp)
	"$@" 2>&1 | tee "$log"
	local rc=${PIPESTATUS[0]}
	if ! grep -q "Tested: [1-9]" "$log"; then
		echo "gpu_check: no test matched: $*"
		rc=1
	fi
	rm -f "$log"
	return "$rc"
}
stage conformance criterion "$root/tests/test_conformance" --filter="$conf_filter" --jobs=1
stage scheduler criterion "$root/tests/test_scheduler" --filter="$sched_filter" --jobs=1

selftest_args=(--backend "$backend" --json "$out/selftest.json")
[ $emu = 1 ] && selftest_args+=(--no-sanitizer)
stage selftest "$root/bench/kvrecall" selftest "${selftest_args[@]}"

if [ $emu = 1 ] || [ $quick = 1 ]; then
	decode() {
		"$root/bench/kvrecall" bench decode --backend "$backend" --preset llama-3.1-8b --batch 1 \
			--max-context 8192 --steps 4 --json "$out/decode.json"
	}
else
	decode() {
		"$root/bench/kvrecall" bench decode --backend cuda --preset llama-3.1-8b --batch 1,8 \
			--max-context 32768 --recall zero-copy --capture --json "$out/decode.json" &&
			"$root/bench/kvrecall" bench decode --backend cuda --preset llama-3.1-8b --batch 1,8 \
				--max-context 32768 --recall streamed --json "$out/decode-streamed.json"
	}
fi
stage decode decode

# memcheck last: the slowest stage, so a run cut short keeps the others
if [ $emu = 1 ]; then
	printf '%-12s skipped (no GPU: cudaemu has no device memory to check)\n' memcheck | tee -a "$summary"
elif ! command -v compute-sanitizer >/dev/null 2>&1; then
	printf '%-12s skipped (compute-sanitizer is not installed)\n' memcheck | tee -a "$summary"
else
	memcheck() {
		local rc=0
		for run in "tests/test_conformance --filter=$conf_filter" "tests/test_scheduler --filter=$sched_filter"; do
			# shellcheck disable=SC2086
			compute-sanitizer --tool memcheck --target-processes all --error-exitcode 99 \
				"$root"/$run --jobs=1 || rc=1
		done
		return $rc
	}
	stage memcheck memcheck
fi

# the decode rows, one line each (python3 where there is one)
if command -v python3 >/dev/null 2>&1; then
	for f in "$out"/decode*.json; do
		[ -s "$f" ] || continue
		python3 - "$f" <<'PY' | tee -a "$summary"
import json, sys
j = json.load(open(sys.argv[1]))
print("%s (%s):" % (sys.argv[1].rsplit("/", 1)[-1], j.get("backend")))
print("  batch  context  mode         recall     captured  us/layer  x budget")
for r in j["results"]:
    print("  %5d  %7d  %-11s  %-9s  %-8s  %8.1f  %8.2f" % (r["batch"], r["context_tokens"], r["mode"], r["recall"],
          "yes" if r.get("captured") else "no", r["us_per_layer"], r.get("ratio_to_target_budget", 0)))
PY
	done
fi

if [ $failed = 0 ]; then
	echo "gpu_check: every stage that ran passed; logs and JSON in $out" | tee -a "$summary"
else
	echo "gpu_check: FAILED; logs and JSON in $out" | tee -a "$summary"
fi
exit $failed
