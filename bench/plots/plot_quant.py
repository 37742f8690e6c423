#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Plot quantised pages' dense decode speed over f16 from `kvrecall bench
decode --mode dense` JSON (schema kvrecall-bench/1), per shape, cpu kernels'
path and context.

    for run in 1 2 3; do for isa in avx2 avx512 avx512vnni; do for f in f16 k8v4 k4v2; do
      KVR_CPU_ISA=$isa kvrecall bench decode --mode dense --kv-format $f \\
          --max-context 32768 --json $run-$isa-$f.json
    done; done; done
    python3 bench/plots/plot_quant.py --out docs/plots/quant-dense-zen4.png *.json

Rows of a run that measured several formats in its rounds (`--kv-format
f16,k8v4,k4v2 --rounds N`) bring their own speed over f16, each the median
of the same round's ratio, and the plot takes the median of those over the
files. Otherwise each format's step time is the median over the files (runs)
of the same shape, path, format and context, and the speed over f16 divides
f16's median by it. The
path is the JSON's machine.cpu_kernels, or, in files written before it existed,
the path named in the file name (avx2, avx512, avx512vnni, scalar). Dashed
lines mark f16's speed (1x) and the targets K8V4 1.6x, K4V2 2.2x. Prints the
table it draws. Needs matplotlib.
"""
import argparse
import json
import os
import re
import statistics
import sys

ISAS = ["scalar", "avx2", "avx512", "avx512vnni"]
LABELS = {"scalar": "scalar", "avx2": "AVX2", "avx512": "AVX-512", "avx512vnni": "VNNI"}
FORMATS = {"k8v4": ("#1f77b4", 1.6), "k4v2": ("#2ca02c", 2.2)}


def path_of(d, name):
    isa = d.get("machine", {}).get("cpu_kernels")
    if isa:
        return isa
    # the longest name first: "avx512vnni" also contains "avx512"
    for cand in sorted(ISAS, key=len, reverse=True):
        if re.search(r"(^|[-_./])" + cand + r"($|[-_./])", os.path.basename(name)):
            return cand
    sys.exit(f"{name}: no machine.cpu_kernels and no path in the file name")


def load(files):
    steps = {}  # (preset, path, context) -> format -> [us per layer]
    paired = {}  # the same -> format -> [speed over f16, paired by round]
    machine = None
    for name in files:
        with open(name) as f:
            d = json.load(f)
        if d.get("benchmark") != "decode":
            continue
        machine = machine or d["machine"].get("cpu_model")
        preset = d["shape"].get("preset", "custom")
        first = (d["params"].get("kv_formats") or ["f16"])[0]
        for r in d["results"]:
            if r["mode"] != "dense" or r.get("batch", 1) != 1:
                continue
            fmt = r.get("kv_format") or d["params"].get("kv_format", "f16")
            key = (preset, path_of(d, name), r["context_tokens"])
            steps.setdefault(key, {}).setdefault(fmt, []).append(r["us_per_layer"])
            if first == "f16" and "speed_over_first_kv_format" in r:
                paired.setdefault(key, {}).setdefault(fmt, []).append(r["speed_over_first_kv_format"])
    return steps, paired, machine


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_quant.py needs matplotlib: apt install python3-matplotlib (or pip install matplotlib)")

    steps, paired, machine = load(args.files)
    speed = {}  # (preset, path, context) -> format -> speed over f16
    for key, by_fmt in sorted(steps.items()):
        for fmt in FORMATS:
            if fmt in paired.get(key, {}):
                speed.setdefault(key, {})[fmt] = statistics.median(paired[key][fmt])
            elif fmt in by_fmt and "f16" in by_fmt:
                speed.setdefault(key, {})[fmt] = statistics.median(by_fmt["f16"]) / statistics.median(by_fmt[fmt])
    if not speed:
        sys.exit("no dense rows with f16 and a quantised format to compare")

    presets = sorted({k[0] for k in speed})
    print("shape path context: " + ", ".join(f"{f} over f16" for f in FORMATS) + " (runs)")
    for key in sorted(speed, key=lambda k: (k[0], ISAS.index(k[1]) if k[1] in ISAS else 9, k[2])):
        runs = len(steps[key].get("f16", []))
        cells = ", ".join(f"{speed[key][f]:.2f}x" if f in speed[key] else "-" for f in FORMATS)
        print(f"{key[0]} {key[1]} {key[2]}: {cells} ({runs})")

    fig, axes = plt.subplots(1, len(presets), figsize=(6.5 * len(presets), 4.2), squeeze=False, sharey=True)
    for ax, preset in zip(axes[0], presets):
        keys = sorted((k for k in speed if k[0] == preset),
                      key=lambda k: (ISAS.index(k[1]) if k[1] in ISAS else 9, k[2]))
        width = 0.8 / len(FORMATS)
        for i, (fmt, (color, target)) in enumerate(FORMATS.items()):
            xs = [j + (i - (len(FORMATS) - 1) / 2) * width for j in range(len(keys))]
            ys = [speed[k].get(fmt, 0.0) for k in keys]
            ax.bar(xs, ys, width, color=color, label=f"{fmt.upper()} (target {target}x at 32K)")
            ax.axhline(target, color=color, linestyle="--", linewidth=1)
        ax.axhline(1.0, color="#888888", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([f"{LABELS.get(k[1], k[1])}\n{k[2] // 1024}K" for k in keys], fontsize=8)
        ax.set_title(preset)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("dense decode speed over f16 (x)")
    axes[0][-1].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"Quantised pages, dense decode step, 2 threads ({machine or 'cpu'})", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
