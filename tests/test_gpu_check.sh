#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# test_gpu_check.sh — the device check's own logic (bench/gpu_check.sh run),
# on stand-in executables, no build needed: a stage past --time-limit is cut
# with its whole process tree (Criterion's workers leave the process group)
# and the later stages are skipped with the summary still written; a test
# filter that matches nothing fails its stage; a stage the machine cannot run
# is skipped with the reason; bad flags are refused before anything runs;
# and the GPU branch, which only a machine with a GPU runs for real, runs its
# stages with the commands it should (stand-ins for nvidia-smi,
# compute-sanitizer and the bundle's executables). The real stages on cudaemu
# run in .ci/run (`gpu_check.sh run --emu --quick`).
#
#   bash tests/test_gpu_check.sh bench/gpu_check.sh
set -uo pipefail
check=${1:?usage: test_gpu_check.sh PATH/TO/gpu_check.sh}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0
expect() { # expect DESCRIPTION CONDITION...
	local what=$1
	shift
	if "$@"; then
		echo "ok   $what"
	else
		echo "FAIL $what"
		fails=$((fails + 1))
	fi
}

# a stand-in build: test_conformance per $FAKE_CONFORMANCE, test_scheduler
# runs no test, kvrecall stands still
fake="$work/build"
mkdir -p "$fake/tests" "$fake/bench"
cat >"$fake/tests/test_conformance" <<'SH'
#!/usr/bin/env bash
case ${FAKE_CONFORMANCE:-pass} in
pass) echo "[====] Synthesis: Tested: 2 | Passing: 2 | Failing: 0 | Crashing: 0" ;;
hang) # a child in its own process session, as Criterion's workers are, and a grandchild
	setsid bash -c 'sleep 300 & echo $! >"$FAKE_PIDS/grandchild"; echo $$ >"$FAKE_PIDS/child"; wait' &
	sleep 300 ;;
esac
SH
cat >"$fake/tests/test_scheduler" <<'SH'
#!/usr/bin/env bash
echo "[====] Synthesis: Tested: ${FAKE_SCHEDULER_TESTED:-0} | Passing: 0 | Failing: 0 | Crashing: 0"
SH
# kvrecall: its arguments noted, a result row where it is given --json
cat >"$fake/bench/kvrecall" <<'SH'
#!/usr/bin/env bash
echo "$*" >>"$FAKE_PIDS/kvrecall.args"
json="" prev=""
for a in "$@"; do
	[ "$prev" = --json ] && json=$a
	prev=$a
done
[ -n "$json" ] && printf '%s\n' '{"backend": "cuda", "results": [{"batch": 1, "context_tokens": 32768,
 "mode": "freekv", "recall": "streamed", "captured": true, "us_per_layer": 123.4,
 "ratio_to_target_budget": 1.05}]}' >"$json"
exit 0
SH
chmod +x "$fake"/tests/* "$fake"/bench/*
export FAKE_PIDS="$work/pids"
mkdir -p "$FAKE_PIDS"

# 1. cut at the time limit
out="$work/cut"
start=$SECONDS
FAKE_CONFORMANCE=hang bash "$check" run --emu --build "$fake" --out "$out" --time-limit 12 \
	--skip python,selftest,decode >"$work/cut.txt" 2>&1
rc=$?
took=$((SECONDS - start))
cat "$work/cut.txt"
expect "a run cut short exits 1" [ $rc = 1 ]
expect "it ends within its time limit (took ${took} s)" [ $took -le 14 ]
expect "the stage past its time is reported CUT" grep -q "^conformance  CUT" "$out/summary.txt"
expect "the next stage is skipped for the time limit" \
	grep -q "^scheduler    skipped (--time-limit reached)" "$out/summary.txt"
expect "the summary is written to the end" grep -q "^gpu_check: FAILED" "$out/summary.txt"
sleep 1
for p in child grandchild; do
	pid=$(cat "$FAKE_PIDS/$p" 2>/dev/null || echo "")
	alive=0
	# a zombie counts as dead: its parent was killed too, and who reaps
	# orphans (a container's init) may be slow to
	state=""
	[ -n "$pid" ] && read -r line 2>/dev/null <"/proc/$pid/stat" && state=${line##*) }
	[ -n "$state" ] && [[ $state != Z* ]] && alive=1 && kill -KILL "$pid"
	killed=0
	[ -n "$pid" ] && [ $alive = 0 ] && killed=1
	expect "the cut stage's $p (its own session) is killed" [ $killed = 1 ]
done

# 2. a filter that matches no test fails; what the machine cannot run is skipped
out="$work/plain"
bash "$check" run --emu --build "$fake" --out "$out" --skip selftest,decode >"$work/plain.txt" 2>&1
rc=$?
cat "$work/plain.txt"
expect "a failing stage makes the run exit 1" [ $rc = 1 ]
expect "the conformance stage passes" grep -q "^conformance  ok" "$out/summary.txt"
expect "a filter that ran no test fails its stage" grep -q "^scheduler    FAILED" "$out/summary.txt"
expect "no test matched is said in the stage's log" grep -q "no test matched" "$out/scheduler.log"
expect "no Python package: skipped with the reason" \
	grep -q "^python       skipped (no Python package in" "$out/summary.txt"
expect "no GPU: the timeline is skipped" grep -q "^timeline     skipped (no GPU)" "$out/summary.txt"
expect "no GPU: memcheck is skipped" grep -q "^memcheck     skipped (no GPU" "$out/summary.txt"

# 3. bad flags: refused before anything runs
for bad in "--skip bogus" "--time-limit soon" "--frobnicate"; do
	# shellcheck disable=SC2086
	bash "$check" run --emu --build "$fake" --out "$work/bad" $bad >"$work/bad.txt" 2>&1
	expect "'$bad' is refused (exit 2)" [ $? = 2 ]
done
expect "the refused runs ran no stage" [ ! -e "$work/bad/conformance.log" ]
bash "$check" run --emu --build "$work/nowhere" >/dev/null 2>&1
expect "a missing build folder is refused (exit 2)" [ $? = 2 ]

# 4. the GPU branch, from a bundle, with stand-ins for the machine's tools:
# a GPU that nvidia-smi names, a compute-sanitizer the driver refuses (as on
# the gVisor H200s), no Python package and no timeline library in the bundle
bin="$work/bin"
mkdir -p "$bin"
cat >"$bin/nvidia-smi" <<'SH'
#!/bin/sh
case "$*" in
*-L*) echo "GPU 0: NVIDIA H200 (UUID: GPU-stand-in)" ;;
*) echo "NVIDIA H200, 143771 MiB, 580.159.03, 9.0" ;;
esac
SH
cat >"$bin/compute-sanitizer" <<'SH'
#!/bin/sh
echo "========= COMPUTE-SANITIZER"
echo "========= Error: Device not supported"
exit 1
SH
chmod +x "$bin"/*
rm -f "$FAKE_PIDS/kvrecall.args"
out="$work/gpu"
PATH="$bin:$PATH" FAKE_SCHEDULER_TESTED=3 bash "$check" run --bundle "$fake" --out "$out" >"$work/gpu.txt" 2>&1
rc=$?
cat "$work/gpu.txt"
expect "the GPU run passes (exit 0, got $rc)" [ $rc = 0 ]
expect "the summary names the card" grep -q "^gpu: NVIDIA H200, 143771 MiB" "$out/summary.txt"
expect "conformance runs the cuda suite" grep -q -- "--filter=cuda/\*" "$out/conformance.log"
expect "scheduler runs the _cuda tests" grep -q -- "--filter=scheduler/\*_cuda " "$out/scheduler.log"
expect "no Python package in the bundle: skipped with the reason" \
	grep -q "^python       skipped (no Python package in $fake/python" "$out/summary.txt"
expect "selftest runs on the cuda backend" grep -q "^selftest --backend cuda --json" "$FAKE_PIDS/kvrecall.args"
decodes=$(grep -c "^bench decode --backend cuda --preset llama-3.1-8b --batch 1,8 --max-context 32768" \
	"$FAKE_PIDS/kvrecall.args")
expect "decode runs twice at batch 1 and 8 to 32K (ran $decodes)" [ "$decodes" = 2 ]
expect "zero-copy rows, captured" grep -q -- "--recall zero-copy --capture" "$FAKE_PIDS/kvrecall.args"
expect "streamed rows, captured" grep -q -- "--recall streamed --capture" "$FAKE_PIDS/kvrecall.args"
expect "the decode rows are summarised" grep -q "32768  freekv       streamed   yes          123.4      1.05" \
	"$out/summary.txt"
expect "no timeline library: skipped with the reason" \
	grep -q "^timeline     skipped (no bench/libcupti_timeline.so" "$out/summary.txt"
expect "a refused sanitizer: memcheck skipped, not failed" \
	grep -q "^memcheck     skipped (compute-sanitizer: 'Device not supported'" "$out/summary.txt"

echo "$fails failed"
[ $fails = 0 ]
