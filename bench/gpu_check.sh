#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# gpu_check.sh — the device check: the CUDA path's tests, compute-sanitizer
# memcheck, `kvrecall selftest` and `kvrecall bench decode` in one command,
# every log and JSON into one folder, and a one-screen summary at the end.
#
# A GPU machine often lacks the build's dependencies (Criterion, hwloc,
# liburing, libnuma), so the check runs in two halves:
#
#   bench/gpu_check.sh pack DIR [--build BUILD] [--arch 90]
#       here: build with CUDA (release, the card's arch; or take BUILD as it
#       is) and copy the test and bench executables, stripped, the Python
#       package (its extension is on the limited API: any CPython >= 3.11
#       imports it) and, where CUPTI's headers are, the timeline library
#       (bench/micro/cupti_timeline.c) with CUPTI itself, with every shared library
#       they need beyond the C runtime and the driver, into DIR.
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
# minute on cudaemu), --skip STAGE[,STAGE] (any stage below), --time-limit S
# (the whole run in S seconds: each stage gets what is left, one cut short is
# reported so and the later ones are skipped, the summary is always written).
# Exit status 0 when every stage that ran passed; a stage the machine cannot
# run (no torch for the Python tests, compute-sanitizer refused by the
# device, no CUPTI) is reported skipped with the reason.
# Stages in order (memcheck last, the slowest, so that a run cut short keeps
# the others): conformance, scheduler, python, selftest, decode, timeline,
# memcheck. The timeline (GPU only) is one freekv step at 8K, batch 1,
# streamed, taken apart by bench/plots/timeline_summary.py.
# shellcheck disable=SC2317 # the stages are functions called through stage()
set -uo pipefail

usage() {
	sed -n '4,40p' "$0" | sed 's/^# \{0,1\}//'
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
		build="build-gpu-check"
		if [ ! -f "$build/build.ninja" ]; then
			meson setup "$build" --buildtype=release -Dcuda=enabled -Dgpu_archs="$arch" \
				-Dtests=enabled -Dbench=true -Dpython=enabled || exit 1
		fi
		ninja -C "$build" tests/test_conformance tests/test_scheduler bench/kvrecall || exit 1
		# the Python package: the extension and its modules' copies (none
		# where the build found no Python headers: then it is left out)
		py_targets=$(meson introspect "$build" --targets | python3 -c '
import json, os, sys
build = sys.argv[1]
print(" ".join(os.path.relpath(f, build) for t in json.load(sys.stdin) for f in t["filename"]
               if os.sep + "runtime" + os.sep + "python" + os.sep in f))' "$(cd "$build" && pwd)") || exit 1
		if [ -n "$py_targets" ]; then
			# shellcheck disable=SC2086
			ninja -C "$build" $py_targets || exit 1
		fi
	fi
	rm -rf "$dest"
	mkdir -p "$dest/tests" "$dest/bench" "$dest/lib" || exit 1
	for exe in tests/test_conformance tests/test_scheduler bench/kvrecall; do
		[ -x "$build/$exe" ] || { echo "gpu_check: $build/$exe is missing" >&2; exit 1; }
		cp "$build/$exe" "$dest/$exe" && strip --strip-debug "$dest/$exe"
	done
	pkg="$build/runtime/python/kvrecall"
	if ls "$pkg"/_kvrecall*.so >/dev/null 2>&1; then
		mkdir -p "$dest/python/kvrecall" || exit 1
		cp "$pkg"/*.py "$pkg"/*.pyi "$pkg"/py.typed "$dest/python/kvrecall/" 2>/dev/null
		# named .abi3.so, which every CPython >= 3.11 imports: it is built
		# on the limited API (runtime/python/kvrecall/meson.build), but a
		# meson older than 1.3 names it for the building interpreter only
		ext=$(find "$pkg" -maxdepth 1 -name "_kvrecall*.so" | head -n1)
		cp "$ext" "$dest/python/kvrecall/_kvrecall.abi3.so" &&
			strip --strip-debug "$dest/python/kvrecall/_kvrecall.abi3.so" || exit 1
	else
		echo "gpu_check: $build has no Python package (Python's headers?): the python stage will skip"
	fi
	# the timeline library, where CUPTI is (the toolkit's include and lib)
	cuda_root=$(dirname "$(dirname "$(command -v nvcc)")")
	cupti_inc="" cupti_lib=""
	for d in "$cuda_root/include" "$cuda_root/extras/CUPTI/include"; do
		[ -f "$d/cupti.h" ] && { cupti_inc=$d; break; }
	done
	for d in "$cuda_root/lib64" "$cuda_root/lib" "$cuda_root/extras/CUPTI/lib64"; do
		[ -e "$d/libcupti.so" ] && { cupti_lib=$d; break; }
	done
	if [ -n "$cupti_inc" ] && [ -n "$cupti_lib" ]; then
		cc -O2 -shared -fPIC -I"$cupti_inc" bench/micro/cupti_timeline.c -L"$cupti_lib" -lcupti -lpthread \
			-o "$dest/bench/libcupti_timeline.so" || exit 1
	else
		echo "gpu_check: no CUPTI beside nvcc: the timeline stage will skip"
	fi
	# libraries the machine may lack: all but the C and C++ runtimes, the
	# loader and the driver's (the driver's come from the GPU machine);
	# CUPTI found through the toolkit's lib folder
	for exe in "$dest"/tests/* "$dest"/bench/* "$dest"/python/kvrecall/*.so; do
		[ -e "$exe" ] || continue
		LD_LIBRARY_PATH="${cupti_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
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
bundle="" build="" out="${OUT:-gpu-check-out}" emu=0 quick=0 skip="" time_limit=0
while [ $# -gt 0 ]; do
	case $1 in
	--bundle) bundle=$2; shift 2 ;;
	--build) build=$2; shift 2 ;;
	--out) out=$2; shift 2 ;;
	--emu) emu=1; shift ;;
	--quick) quick=1; shift ;;
	--skip) skip=",$2,"; shift 2 ;;
	--time-limit) time_limit=$2; shift 2 ;;
	*) usage ;;
	esac
done
[[ $time_limit =~ ^[0-9]+$ ]] || { echo "gpu_check: --time-limit takes whole seconds, not '$time_limit'" >&2; exit 2; }
for name in ${skip//,/ }; do
	case $name in
	conformance | scheduler | python | selftest | decode | timeline | memcheck) ;;
	*) echo "gpu_check: --skip: no stage is named '$name'" >&2; exit 2 ;;
	esac
done
root=${bundle:-$build}
[ -n "$root" ] || { echo "gpu_check: run needs --bundle DIR or --build DIR" >&2; exit 2; }
[ -d "$root" ] || { echo "gpu_check: $root: no such folder" >&2; exit 2; }
root=$(cd "$root" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "$bundle" ]; then
	export LD_LIBRARY_PATH="$root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
	py_package="$root/python"
else
	py_package="$root/runtime/python"
fi
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
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

# the run's end (--time-limit): a few seconds kept for the summary
deadline=0
[ "$time_limit" -gt 0 ] && deadline=$((SECONDS + time_limit - 5))
failed=0 out_of_time=0
# children_of PID: the processes whose parent is PID, read from /proc (no
# procps on a minimal machine). The fields after the last ')' of a stat
# line are: state, ppid, ...
children_of() {
	local f line rest
	for f in /proc/[0-9]*/stat; do
		read -r line 2>/dev/null <"$f" || continue
		rest=${line##*) }
		rest=${rest#* }
		[ "${rest%% *}" = "$1" ] && { f=${f#/proc/}; echo "${f%/stat}"; }
	done
}
# kill_tree PID: stop the process and every descendant (top down, so none
# forks past the walk), then kill them all
kill_tree() {
	local pids=("$1") i=0 child
	while [ $i -lt ${#pids[@]} ]; do
		kill -STOP "${pids[$i]}" 2>/dev/null
		for child in $(children_of "${pids[$i]}"); do
			pids+=("$child")
		done
		i=$((i + 1))
	done
	kill -KILL "${pids[@]}" 2>/dev/null
}
# stage NAME COMMAND...: run it with its output in OUT/NAME.log, timed. A
# command that exits 77 could not run here: skipped, its last line the reason.
stage() {
	local name=$1
	shift
	if [[ $skip == *",$name,"* ]]; then
		printf '%-12s skipped (--skip)\n' "$name" | tee -a "$summary"
		return 0
	fi
	local left=0
	if [ $deadline -gt 0 ]; then
		left=$((deadline - SECONDS))
		if [ $out_of_time = 1 ] || [ $left -lt 5 ]; then
			printf '%-12s skipped (--time-limit reached)\n' "$name" | tee -a "$summary"
			out_of_time=1
			return 0
		fi
	fi
	local t0=$SECONDS rc
	echo "== $name: $*" >"$out/$name.log"
	if [ $left -gt 0 ]; then
		# in the background, watched: past its time the stage's whole
		# process tree is stopped and killed (Criterion's workers leave
		# the process group, so a group signal would miss them)
		"$@" >>"$out/$name.log" 2>&1 &
		local pid=$! cut=0
		while kill -0 "$pid" 2>/dev/null; do
			if [ $((SECONDS - t0)) -ge "$left" ]; then
				kill_tree "$pid"
				cut=1
				break
			fi
			sleep 0.5
		done
		{ wait "$pid"; } 2>/dev/null # no "Killed" notice: the summary says CUT
		rc=$?
		[ $cut = 1 ] && rc=124
	else
		"$@" >>"$out/$name.log" 2>&1
		rc=$?
	fi
	local took=$((SECONDS - t0))
	if [ $rc -eq 0 ]; then
		printf '%-12s ok      %4d s\n' "$name" "$took" | tee -a "$summary"
	elif [ $rc -eq 77 ]; then
		printf '%-12s skipped (%s)\n' "$name" "$(tail -n 1 "$out/$name.log")" | tee -a "$summary"
	elif [ $left -gt 0 ] && [ $rc -eq 124 ]; then
		printf '%-12s CUT     %4d s  (--time-limit; %s)\n' "$name" "$took" "$out/$name.log" | tee -a "$summary"
		failed=1 out_of_time=1
	else
		printf '%-12s FAILED  %4d s  (exit %d; %s)\n' "$name" "$took" "$rc" "$out/$name.log" | tee -a "$summary"
		tail -n 15 "$out/$name.log" | sed 's/^/    /'
		failed=1
	fi
}

echo "gpu_check: $(date -u +%FT%TZ), revision $(cat "$root/REVISION" 2>/dev/null || git -C "$repo" rev-parse --short HEAD 2>/dev/null)" | tee -a "$summary"
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

# The Python package's tests against the package in the bundle or build. On
# a GPU: both files, and the CUDA test must have passed (torch's CUDA build
# is what makes CUDA tensors; the GPU machines' python3 has it). On cudaemu:
# test_package.py, which needs only numpy and pytest.
python_tests() {
	[ -d "$py_package/kvrecall" ] || { echo "no Python package in $py_package (built without Python's headers)"; return 77; }
	local need="numpy, pytest" files=("$repo/tests/python/test_package.py") select=() py=
	if [ "$emu" = 0 ]; then
		need="numpy, pytest, torch, transformers"
		files+=("$repo/tests/python/test_transformers.py")
		[ "$quick" = 1 ] && select=(-k "cuda or dense_decode_matches_reference")
	elif [ "$quick" = 1 ]; then
		select=(-k "dense_decode_matches_reference or device_and_protocols")
	fi
	# the first interpreter that has them ($PYTHON to choose): a PATH's
	# python3 may be another than the one the build's tests use
	local cand
	for cand in ${PYTHON:-} python3 /usr/bin/python3; do
		if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import ${need//, /, }" 2>/dev/null; then
			py=$cand
			break
		fi
	done
	[ -n "$py" ] || { echo "no python3 here has all of: $need"; return 77; }
	local log rc
	log=$(mktemp)
	echo "python: $(command -v "$py") ($("$py" -c 'import sys; print(sys.version.split()[0])'))"
	PYTHONPATH="$py_package" PYTHONDONTWRITEBYTECODE=1 "$py" -m pytest -q -rA -p no:cacheprovider \
		"${select[@]}" "${files[@]}" 2>&1 | tee "$log"
	rc=${PIPESTATUS[0]}
	if [ "$rc" = 0 ] && [ "$emu" = 0 ] && ! grep -q "^PASSED .*test_cuda_" "$log"; then
		echo "gpu_check: the CUDA tests did not pass here (skipped?): see the short summary above"
		rc=1
	fi
	rm -f "$log"
	return "$rc"
}
stage python python_tests

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
				--max-context 32768 --recall streamed --capture --json "$out/decode-streamed.json"
	}
fi
stage decode decode

# One freekv step at 8K, batch 1, streamed, under the CUPTI injection
# library: every kernel, copy and launch of the last steps, and the summary
# of where the step's time goes (q bytes: 32 query heads x 128 x 2).
timeline() {
	[ "$emu" = 0 ] || { echo "no GPU"; return 77; }
	[ -f "$root/bench/libcupti_timeline.so" ] ||
		{ echo "no bench/libcupti_timeline.so in $root (pack builds it where CUPTI's headers are)"; return 77; }
	rm -f "$out/timeline.txt"
	CUDA_INJECTION64_PATH="$root/bench/libcupti_timeline.so" KVR_TIMELINE="$out/timeline.txt" \
		"$root/bench/kvrecall" bench decode --backend cuda --preset llama-3.1-8b --max-context 8192 \
		--steps 12 --mode freekv --batch 1 --recall streamed --json "$out/timeline-decode.json" || return 1
	[ -s "$out/timeline.txt" ] || { echo "CUPTI wrote no records (the injection library did not load?)"; return 77; }
	python3 "$repo/bench/plots/timeline_summary.py" "$out/timeline.txt" --q-bytes 8192 --ops --steps 1
}
stage timeline timeline

# memcheck last: the slowest stage, so a run cut short keeps the others
memcheck() {
	[ "$emu" = 0 ] || { echo "no GPU: cudaemu has no device memory to check"; return 77; }
	command -v compute-sanitizer >/dev/null 2>&1 || { echo "compute-sanitizer is not installed"; return 77; }
	local rc=0 log
	log=$(mktemp)
	for run in "tests/test_conformance --filter=$conf_filter" "tests/test_scheduler --filter=$sched_filter"; do
		# shellcheck disable=SC2086
		compute-sanitizer --tool memcheck --target-processes all --error-exitcode 99 \
			"$root"/$run --jobs=1 2>&1 | tee "$log"
		[ "${PIPESTATUS[0]}" = 0 ] || rc=1
		# some virtualised machines' drivers refuse the sanitizer outright
		if grep -q "Device not supported" "$log"; then
			rm -f "$log"
			echo "compute-sanitizer: 'Device not supported' on this machine"
			return 77
		fi
	done
	rm -f "$log"
	return "$rc"
}
stage memcheck memcheck

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
