#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Turn `kvrecall bench` results (JSON, schema kvrecall-bench/1) into PNG plots.

    kvrecall bench copy   --json copy.json
    kvrecall bench recall --json recall.json
    kvrecall bench decode --json decode.json
    python3 bench/plots/plot_bench.py --out docs/plots copy.json recall.json decode.json

One PNG per input file, named after its benchmark, backend and machine
(e.g. copy-cuda-h100.png, or --name to choose the stem):
  copy    bandwidth against transfer size, one line per direction, host
          memory kind and call kind; the peak pinned host->device rate marked;
  recall  one layer's recall latency against the budget, one line per pool
          layout, buffering and chunk size (and zero-copy), log scale;
  decode  the step time per layer for each mode and context, each bar split
          into the engine's waits (corrections, recall, controller) and the
          rest of its critical path; one panel per batch size;
  freelist  one free-list round's time against the number of units (KV
          heads x sequences x layers), host reference and device kernel, log-log.
Needs matplotlib (Debian: apt install python3-matplotlib).
"""
import argparse
import json
import os
import re
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("plot_bench.py needs matplotlib: apt install python3-matplotlib (or pip install matplotlib)")

MODE_COLORS = {"dense": "#888888", "blocking": "#1f77b4", "speculative": "#2ca02c", "freekv": "#d62728"}


def machine_label(d):
    m = d.get("machine", {})
    gpu = m.get("gpu")
    where = gpu["name"].split(" (")[0] if gpu and d["backend"] != "cpu" else m.get("cpu_model", "cpu")
    return f"{d['backend']} backend, {where}, kvrecall {d['build']['version']} ({d['build']['git_revision']})"


def stem(d):
    m = d.get("machine", {})
    gpu = m.get("gpu")
    where = gpu["name"].split(" (")[0] if gpu and d["backend"] != "cpu" else m.get("cpu_model", "cpu")
    short = re.sub(r"[^a-z0-9]+", "-", where.lower()).strip("-")
    short = re.sub(r"^(nvidia-|amd-|intel-r-)", "", short)[:24].strip("-")
    return f"{d['benchmark']}-{d['backend']}-{short}"


def size_label(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB" if b >= 1024 else f"{b} B"


def plot_copy(d, path):
    fig, ax = plt.subplots(figsize=(8, 5))
    rows = d["results"]
    keys = sorted({(r["direction"], r["host_memory"], r["calls"]) for r in rows})
    styles = {"single": "-", "batched": "--"}
    colors = {("h2d", "pinned"): "#d62728", ("h2d", "pageable"): "#ff9896",
              ("d2h", "pinned"): "#1f77b4", ("d2h", "pageable"): "#aec7e8"}
    for k in keys:
        pts = sorted((r["transfer_bytes"], r["gbps"]) for r in rows if (r["direction"], r["host_memory"], r["calls"]) == k)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[k[2]], marker="o", ms=3,
                color=colors[(k[0], k[1])], label=f"{k[0]} {k[1]}, {k[2]}")
    peak = d["summary"]["peak_h2d_pinned_gbps"]
    ax.axhline(peak, color="#444444", lw=0.8, ls=":")
    ax.annotate(f"peak pinned h2d {peak:.1f} GB/s", (rows[0]["transfer_bytes"], peak), textcoords="offset points",
                xytext=(4, 4), fontsize=8)
    ax.set_xscale("log", base=2)
    sizes = sorted({r["transfer_bytes"] for r in rows})
    ax.set_xticks(sizes, [size_label(s) for s in sizes])
    ax.set_xlabel("transfer size")
    ax.set_ylabel("GB/s")
    ax.set_title(f"kvrecall bench copy — {machine_label(d)}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_recall(d, path):
    fig, ax = plt.subplots(figsize=(8, 5))
    rows = d["results"]
    keys = sorted({(r["pool"], r["buffers"], r["chunk_pages"]) for r in rows})
    for pool, buffers, chunk in keys:
        pts = sorted((r["budget_tokens"], r["us_per_layer"]) for r in rows
                     if (r["pool"], r["buffers"], r["chunk_pages"]) == (pool, buffers, chunk))
        if pool == "zero-copy":
            label = "zero-copy"
        elif pool in ("k8v4", "k4v2"):  # quantised runs straight into their slots
            label = f"{pool.upper()} runs, chunks of {chunk}"
        else:
            label = f"{pool} pool, {buffers} buffer{'s' if buffers > 1 else ''}, chunks of {chunk}"
        color = {"zero-copy": "#2ca02c", "hnd": "#d62728", "k8v4": "#9467bd", "k4v2": "#8c564b"}.get(pool, "#1f77b4")
        ls = "--" if buffers == 1 and pool != "zero-copy" else "-"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, marker="o" if chunk != 8 else "s", ms=4, color=color,
                alpha=1.0 if chunk != 8 else 0.6, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    budgets = sorted({r["budget_tokens"] for r in rows})
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("budget B (tokens per KV head)")
    ax.set_ylabel("µs per layer (one layer's recall)")
    p = d["params"]
    sh = d["shape"]
    ax.set_title(f"kvrecall bench recall — {sh['preset']}, batch {p['batch']}, miss rate {p['miss_rate']:.2f}\n"
                 f"{machine_label(d)}; copy peak {d['summary']['peak_h2d_pinned_gbps']:.1f} GB/s", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_decode(d, path):
    rows = d["results"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(len(batches), 1, figsize=(9, 3.6 * len(batches)), squeeze=False)
    parts = [("correction_wait_share", "waiting for corrected heads' pages", "#ff7f0e"),
             ("recall_wait_share", "waiting for recall", "#9467bd"),
             ("controller_wait_share", "waiting for the controller", "#8c564b")]
    for ax, batch in zip(axes[:, 0], batches):
        sub = [r for r in rows if r["batch"] == batch]
        contexts = sorted({r["context_tokens"] for r in sub})
        modes = [m for m in ("dense", "blocking", "speculative", "freekv") if any(r["mode"] == m for r in sub)]
        width = 0.8 / len(modes)
        for mi, mode in enumerate(modes):
            xs, total, bottoms = [], [], []
            for ci, L in enumerate(contexts):
                r = next((r for r in sub if r["mode"] == mode and r["context_tokens"] == L), None)
                if not r:
                    continue
                x = ci + (mi - (len(modes) - 1) / 2) * width
                t = r["us_per_layer"]
                waits = [t * r[k] for k, _, _ in parts]
                rest = max(t - sum(waits), 0)
                ax.bar(x, rest, width, color=MODE_COLORS[mode], label=mode if ci == 0 else None)
                b = rest
                for (k, lab, col), w in zip(parts, waits):
                    ax.bar(x, w, width, bottom=b, color=col, label=lab if (ci == 0 and mi == 0) else None)
                    b += w
                xs.append(x), total.append(t)
                # --rounds: the rounds' range of the step, as this round's
                # time scaled by their ratios to the budget over its own
                if r.get("rounds", 1) > 1 and r["ratio_to_target_budget"] > 0:
                    k = t / r["ratio_to_target_budget"]
                    ax.vlines(x, k * r["ratio_to_target_budget_min"], k * r["ratio_to_target_budget_max"],
                              color="#222222", lw=0.8)
        # log scale first, then both limits: bars start at 0, which a log
        # axis cannot autoscale to
        ax.set_yscale("log")
        bases = sorted(r["attention_over_budget_us"] for r in sub)
        base = bases[(len(bases) - 1) // 2]  # one per row under --rounds: their median
        ax.set_ylim(bottom=min(min(r["us_per_layer"] for r in sub), base) * 0.5,
                    top=max(r["us_per_layer"] for r in sub) * 1.8)
        ax.axhline(base, color="#444444", lw=0.8, ls=":")
        ax.annotate(f"attention over B alone {base:.0f} µs", (-0.45, base), textcoords="offset points",
                    xytext=(0, 3), fontsize=7)
        ax.set_xticks(range(len(contexts)), [f"{L // 1024}K" for L in contexts])
        ax.set_ylabel("µs per layer (median step)")
        ax.set_title(f"batch {batch}", fontsize=9)
        ax.grid(alpha=0.3, axis="y", which="both")
        ax.legend(fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel("context (tokens)")
    p = d["params"]
    rounds = f", median of {p['rounds']} rounds (bars: their range)" if p.get("rounds", 1) > 1 else ""
    fig.suptitle(f"kvrecall bench decode — {d['shape']['preset']}, B = {p['budget_tokens']}, recall {p['recall']}{rounds}\n"
                 f"{machine_label(d)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_freelist(d, path):
    fig, ax = plt.subplots(figsize=(8, 5))
    rows = sorted(d["results"], key=lambda r: r["units"])
    units = [r["units"] for r in rows]
    for key, label, color, ls in (("alloc_round_us", "host (one thread), allocation", "#1f77b4", "-"),
                                  ("free_round_us", "host (one thread), free", "#1f77b4", "--"),
                                  ("device_alloc_round_us", f"{d['backend']} kernel, allocation", "#d62728", "-"),
                                  ("device_free_round_us", f"{d['backend']} kernel, free", "#d62728", "--")):
        ax.plot(units, [r[key] for r in rows], ls, marker="o", ms=4, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(units, [str(u) for u in units])
    ax.set_xlabel("units asking at once (KV heads x sequences x layers)")
    ax.set_ylabel("µs per round (median)")
    ax.set_title(f"kvrecall bench freelist — 0-2 pages per unit, 8 pages per unit in the list\n{machine_label(d)}",
                 fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_spill(d, path):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    rows = [r for r in d["results"] if r["engine"] == "io_uring"]
    sizes = sorted({r["run_kib"] for r in rows})
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f"]
    for i, s in enumerate(sizes):
        pts = sorted((r for r in rows if r["run_kib"] == s), key=lambda r: r["queue_depth"])
        qd = [r["queue_depth"] for r in pts]
        c = colors[i % len(colors)]
        axes[0].plot(qd, [r["recall_gbs"] for r in pts], "-", marker="o", ms=4, color=c, label=f"{s} KiB runs: recall")
        axes[0].plot(qd, [r["raw_gbs"] for r in pts], "--", marker="x", ms=4, color=c, label=f"{s} KiB runs: raw reads")
        if pts:
            axes[0].axhline(pts[0]["ceiling_gbs"], color=c, lw=0.6, ls=":")
        axes[1].plot(qd, [r["spill_gbs"] for r in pts], "-", marker="o", ms=4, color=c,
                     label=f"pages of {d['params']['runs_per_page']} x {s} KiB")
    for ax, title in ((axes[0], "recall (read, check, copy out) vs bare io_uring reads\n"
                                "dotted: sequential 1 MiB O_DIRECT reads, depth 16"),
                      (axes[1], "spill (pack, checksum, write)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("queue depth")
        ax.set_ylabel("GB/s")
        ax.set_title(title, fontsize=8)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6)
    p = d["params"]
    fig.suptitle(f"kvrecall bench spill — {p['dir']} ({p['fs_type']}, {'O_DIRECT' if p['direct_io'] else 'buffered'}), "
                 f"{p['file_mib']} MiB per point\n{machine_label(d)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="result files of kvrecall bench")
    ap.add_argument("--out", default=".", help="directory for the PNGs")
    ap.add_argument("--name", help="file stem (one input only)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for f in a.json:
        with open(f) as fh:
            d = json.load(fh)
        if d.get("schema") != "kvrecall-bench/1":
            sys.exit(f"{f}: not a kvrecall bench result (schema {d.get('schema')!r})")
        fn = {"copy": plot_copy, "recall": plot_recall, "decode": plot_decode,
              "freelist": plot_freelist, "spill": plot_spill}.get(d["benchmark"])
        if not fn:
            print(f"{f}: nothing to plot for '{d['benchmark']}'", file=sys.stderr)
            continue
        path = os.path.join(a.out, (a.name or stem(d)) + ".png")
        fn(d, path)
        print(path)


if __name__ == "__main__":
    main()
