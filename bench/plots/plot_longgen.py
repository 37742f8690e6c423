#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Plot the long-generation record of `kvrecall generate --compare LIST --json`
as an SVG (standard library only): decode tokens/s against position, one line
per mode, with the share of corrected heads of the sparse modes beneath.

    kvrecall generate --prompt "..." --max-tokens 8000 --ignore-eos --quiet \\
        --compare dense,freekv --budget 1024 --json longgen.json
    python3 bench/plots/plot_longgen.py longgen.json docs/plots/longgen-cpu.svg \\
        [--peer "llama.cpp (fa on)=54"]

--peer LABEL=TOKENS_PER_S draws another engine's average over the same run
as a dashed line (llama-bench reports an average, not a curve).
"""
import json
import math
import sys

COLORS = {"dense": "#888888", "blocking": "#1f77b4", "speculative": "#2ca02c", "freekv": "#d62728"}
PEER_COLORS = ["#9467bd", "#8c564b", "#e377c2"]
W, H = 830, 470
LEFT, RIGHT, TOP, BOTTOM = 70, 260, 40, 150
CORR_H = 70  # the corrections panel under the speed panel


def nice_axis(v, divisions=5):
    """The smallest axis top >= v whose `divisions` equal steps are round
    numbers (1, 2, 2.5 or 5 times a power of ten), and that step."""
    if v <= 0:
        return 1.0, 0.2
    raw = v / divisions
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    return step * divisions, step


def main():
    args = sys.argv[1:]
    peers = []
    while "--peer" in args:
        i = args.index("--peer")
        label, _, value = args[i + 1].rpartition("=")
        peers.append((label, float(value)))
        del args[i:i + 2]
    if len(args) != 2:
        sys.exit(__doc__)
    with open(args[0]) as f:
        data = json.load(f)
    runs = data.get("runs") or [data]
    x_max = max(p["position"] for r in runs for p in r["timeline"])
    y_top, _ = nice_axis(max([p["tokens_per_s"] for r in runs for p in r["timeline"]] + [v for _, v in peers]) * 1.05)
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def X(pos):
        return LEFT + pw * pos / x_max

    def Y(v):
        return TOP + ph * (1 - v / y_top)

    def YC(frac):  # corrections panel: 0..100 %
        return H - 40 - CORR_H * frac

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="12"><rect width="{W}" height="{H}" fill="white"/>']
    title = (f"kvrecall generate, {data.get('model', '?')}: decode speed against position "
             f"({data.get('prompt_tokens', '?')}-token prompt)")
    out.append(f'<text x="{LEFT}" y="22" font-size="14">{title}</text>')
    for i in range(6):
        v = y_top * i / 5
        out.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{LEFT - 6}" y="{Y(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
    _, x_step = nice_axis(x_max)  # ticks at round positions within the run
    for i in range(int(x_max // x_step) + 1):
        pos = x_step * i
        out.append(f'<text x="{X(pos):.1f}" y="{TOP + ph + 16}" text-anchor="middle">{pos:,.0f}</text>')
    out.append(f'<text x="{LEFT + pw / 2}" y="{TOP + ph + 32}" text-anchor="middle">position (tokens in the '
               f'context)</text>')
    out.append(f'<text x="18" y="{TOP + ph / 2}" transform="rotate(-90 18 {TOP + ph / 2})" '
               f'text-anchor="middle">decode tokens/s</text>')
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
    legend_y = TOP + 10
    for r in runs:
        color = COLORS.get(r["mode"], "#000")
        pts = " ".join(f"{X(p['position']):.1f},{Y(p['tokens_per_s']):.1f}" for p in r["timeline"])
        out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
        mean = r["generated"] / r["decode_s"] if r["decode_s"] else 0
        out.append(f'<text x="{LEFT + pw + 10}" y="{legend_y}" fill="{color}">{r["mode"]} '
                   f'({mean:.0f} tok/s)</text>')
        legend_y += 18
        if any(p["corrected"] > 0 for p in r["timeline"]):
            cp = " ".join(f"{X(p['position']):.1f},{YC(p['corrected']):.1f}" for p in r["timeline"])
            out.append(f'<polyline points="{cp}" fill="none" stroke="{color}" stroke-dasharray="2 2"/>')
    for k, (label, v) in enumerate(peers):
        color = PEER_COLORS[k % len(PEER_COLORS)]
        out.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" stroke="{color}" '
                   f'stroke-dasharray="6 4" stroke-width="1.5"/>')
        out.append(f'<text x="{LEFT + pw + 10}" y="{legend_y}" fill="{color}">{label} ({v:g}, mean)</text>')
        legend_y += 18
    # corrections panel
    out.append(f'<rect x="{LEFT}" y="{H - 40 - CORR_H}" width="{pw}" height="{CORR_H}" fill="none" '
               f'stroke="#444"/>')
    out.append(f'<text x="{LEFT - 6}" y="{H - 40 + 4}" text-anchor="end">0%</text>')
    out.append(f'<text x="{LEFT - 6}" y="{H - 40 - CORR_H + 4}" text-anchor="end">100%</text>')
    out.append(f'<text x="{LEFT + pw + 10}" y="{H - 40 - CORR_H / 2}">heads corrected</text>')
    out.append(f'<text x="{LEFT + pw + 10}" y="{H - 40 - CORR_H / 2 + 14}">(dotted)</text>')
    out.append("</svg>")
    with open(args[1], "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
