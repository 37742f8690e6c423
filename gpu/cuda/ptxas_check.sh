#!/bin/sh
# ptxas_check.sh REPORT NVCC ARGS... — compile one CUDA file with ptxas's
# resource report and gate it with check_ptxas.py (no spills, <= 255 registers,
# static shared memory within 48 KiB). Writes the table to REPORT; fails the
# build when a kernel breaks a limit. Used by meson when -Dptxas_check=true.
set -eu
report=$1
shift
here=$(dirname "$0")
log=$report.log
if ! "$@" -Xptxas=-v -o "$report.o" >"$log" 2>&1; then
	cat "$log" >&2
	exit 1
fi
rm -f "$report.o"
python3 "$here/check_ptxas.py" "$log" >"$report"
cat "$report"
