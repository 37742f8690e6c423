#!/usr/bin/env python3
"""Summarise a CUDA timeline written by bench/micro/cupti_timeline.c for `kvrecall
bench decode` runs: per decode step (steps are found by the bench's upload of
q, one host-to-device copy of --q-bytes), the engine thread's time in CUDA
calls by call, the GPU's time by kernel and copy kind, how much of the step
the GPU was busy, and (with --ops) each GPU operation of the step in order
with the idle gap before it.

    python3 bench/plots/timeline_summary.py timeline.txt --q-bytes 8192 [--ops] [--steps 2]

q bytes = batch x query heads x head_dim x 2 (f16): 8192 for Llama-3.1-8B at
batch 1. The last --steps complete steps are shown.
"""
import argparse
import collections


def read(path):
    recs = []
    with open(path) as f:
        for line in f:
            p = line.split(None, 4)
            if len(p) < 4:
                continue
            recs.append((p[0], int(p[1]), int(p[2]), p[3], p[4].strip() if len(p) > 4 else ""))
    return recs


def gpu_name(r):
    if r[0] == "K":
        return r[4].split("(")[0][:48]
    if r[0] == "C":
        nbytes, kind = r[4].split()[:2]
        return "copy " + {"1": "HtoD", "2": "DtoH", "8": "DtoD"}.get(kind, "kind " + kind)
    return "memset"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("timeline")
    ap.add_argument("--q-bytes", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--ops", action="store_true")
    a = ap.parse_args()
    recs = read(a.timeline)
    calls = [r for r in recs if r[0] == "R"]
    engine = collections.Counter(r[3] for r in calls).most_common(1)[0][0]
    calls = sorted((r for r in calls if r[3] == engine), key=lambda r: r[1])
    gpu = sorted((r for r in recs if r[0] in "KCS"), key=lambda r: r[1])
    starts = [r[1] for r in gpu if r[0] == "C" and r[4].split()[:2] == [str(a.q_bytes), "1"]]
    for i in range(max(0, len(starts) - 1 - a.steps), len(starts) - 1):
        t0, t1 = starts[i], starts[i + 1]
        print("step %d: %.1f us" % (i, (t1 - t0) / 1e3))
        mine = [r for r in calls if t0 <= r[1] < t1]
        by = collections.defaultdict(lambda: [0, 0])
        for r in mine:
            n = r[4].rsplit("_v", 1)[0]
            by[n][0] += 1
            by[n][1] += r[2] - r[1]
        print("  engine thread: %d CUDA calls, %.1f us in them" % (len(mine), sum(r[2] - r[1] for r in mine) / 1e3))
        for n, (k, d) in sorted(by.items(), key=lambda x: -x[1][1]):
            print("    %-30s %5d %9.1f us" % (n, k, d / 1e3))
        ops = [r for r in gpu if t0 <= r[1] < t1]
        byg = collections.defaultdict(lambda: [0, 0])
        for r in ops:
            byg[gpu_name(r)][0] += 1
            byg[gpu_name(r)][1] += r[2] - r[1]
        busy, cur = 0, None
        for s, e in sorted((r[1], r[2]) for r in ops):
            if cur is None or s > cur[1]:
                busy += cur[1] - cur[0] if cur else 0
                cur = [s, e]
            else:
                cur[1] = max(cur[1], e)
        busy += cur[1] - cur[0] if cur else 0
        print("  GPU: %d operations, busy %.1f us of the step" % (len(ops), busy / 1e3))
        for n, (k, d) in sorted(byg.items(), key=lambda x: -x[1][1]):
            print("    %-50s %5d %9.1f us" % (n, k, d / 1e3))
        if a.ops:
            end = None
            for r in ops:
                gap = (r[1] - end) / 1e3 if end is not None else 0.0
                print("    %8.1f  gap %6.1f  %6.1f us  stream %-4s %s" % ((r[1] - t0) / 1e3, gap, (r[2] - r[1]) / 1e3, r[3], gpu_name(r)))
                end = max(end or 0, r[2])


if __name__ == "__main__":
    main()
