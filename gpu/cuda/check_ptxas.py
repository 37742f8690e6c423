#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""check_ptxas.py — the resource gate for the CUDA kernels.

Reads what nvcc prints with -Xptxas=-v (or --resource-usage), from the files
named on the command line or from standard input, and prints one line per
kernel and architecture: registers, static shared memory, stack frame, spill
stores and loads. Exits 1 when any kernel spills, uses more than
--max-registers registers (255: a kernel above it cannot be launched at all)
or more static shared memory than --max-static-smem bytes (48 KiB: the limit
without an explicit opt-in). Exits 2 when the input holds no ptxas report at
all (the compile failed, or -Xptxas=-v is missing), so a broken pipeline
cannot pass silently; --allow-empty accepts that for host-only .cu files.

Lines that are not part of a ptxas report (compiler warnings and errors) are
copied to standard error, so piping nvcc through this script hides nothing.
Kernel names are demangled with cu++filt or c++filt when one is on PATH.
Standard library only.
"""

import argparse
import re
import shutil
import subprocess
import sys

ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '([^']+)' for '(sm_\w+)'")
FUNC = re.compile(r"ptxas info\s*: Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"ptxas info\s*: Used (\d+) registers")
SMEM = re.compile(r"(\d+) bytes smem")
PTXAS_NOISE = re.compile(r"ptxas info\s*: (\d+ bytes gmem|Compile time|Function properties)")


class Kernel:
    def __init__(self, name, arch):
        self.name = name
        self.arch = arch
        self.registers = None
        self.smem = 0
        self.stack = 0
        self.spill_stores = 0
        self.spill_loads = 0


def parse(lines):
    """Kernels in input order; every other line is echoed to stderr."""
    kernels = []
    current = None
    in_entry = False  # the frame/usage lines after 'Function properties' belong to current
    for raw in lines:
        line = raw.rstrip("\n")
        m = ENTRY.search(line)
        if m:
            current = Kernel(m.group(1), m.group(2))
            kernels.append(current)
            in_entry = True
            continue
        m = FUNC.search(line)
        if m:
            # properties of the entry just announced, or of a called (non-inlined)
            # device function, which has no register line of its own to gate
            in_entry = current is not None and m.group(1) == current.name
            continue
        m = FRAME.search(line)
        if m:
            if in_entry and current is not None:
                current.stack = int(m.group(1))
                current.spill_stores = int(m.group(2))
                current.spill_loads = int(m.group(3))
            continue
        m = USED.search(line)
        if m:
            if current is not None and current.registers is None:
                current.registers = int(m.group(1))
                s = SMEM.search(line)
                current.smem = int(s.group(1)) if s else 0
            continue
        if PTXAS_NOISE.search(line):
            continue
        if line.strip():
            print(line, file=sys.stderr)
    return kernels


def demangler():
    for tool in ("cu++filt", "c++filt"):
        path = shutil.which(tool)
        if path:
            return path
    return None


def demangle(names):
    tool = demangler()
    if not tool or not names:
        return {n: n for n in names}
    try:
        out = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True,
                             text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}
    if len(out) != len(names):
        return {n: n for n in names}
    return dict(zip(names, out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="nvcc output (default: standard input)")
    ap.add_argument("--max-registers", type=int, default=255)
    ap.add_argument("--max-static-smem", type=int, default=48 * 1024)
    ap.add_argument("--allow-empty", action="store_true",
                    help="exit 0 when the input has no kernels (a host-only .cu file)")
    args = ap.parse_args()

    lines = []
    if args.files:
        for f in args.files:
            with open(f, encoding="utf-8", errors="replace") as fh:
                lines.extend(fh.readlines())
    else:
        lines = sys.stdin.readlines()

    kernels = parse(lines)
    if not kernels:
        if args.allow_empty:
            return 0
        print("check_ptxas: no ptxas report in the input (compile failed, or no -Xptxas=-v?)",
              file=sys.stderr)
        return 2

    names = demangle(sorted({k.name for k in kernels}))
    failures = 0
    print("%-7s %5s %7s %6s %7s %7s  %s" % ("arch", "regs", "smem", "stack", "spill-st",
                                             "spill-ld", "kernel"))
    for k in sorted(kernels, key=lambda k: (k.arch, names[k.name])):
        problems = []
        if k.registers is None:
            problems.append("no register count")
        elif k.registers > args.max_registers:
            problems.append("more than %d registers" % args.max_registers)
        if k.spill_stores or k.spill_loads:
            problems.append("spills")
        if k.smem > args.max_static_smem:
            problems.append("more than %d bytes of static shared memory" % args.max_static_smem)
        print("%-7s %5s %7d %6d %7d %7d  %s%s" % (
            k.arch, "?" if k.registers is None else k.registers, k.smem, k.stack,
            k.spill_stores, k.spill_loads, names[k.name],
            ("   <-- " + "; ".join(problems)) if problems else ""))
        failures += bool(problems)
    if failures:
        print("check_ptxas: %d kernel(s) over budget" % failures, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
