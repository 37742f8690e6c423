#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Plot decode_bench JSON as an SVG (standard library only, so the plot can be
redrawn on any machine that ran the benchmark).

    ./build/bench/decode_bench --json decode.json
    python3 bench/plots/plot_decode.py decode.json docs/decode-step.svg

One panel: microseconds per layer against context length (both axes log2) for
each mode, with the cpu target drawn as a dashed line:
1.1 x (1 + L/(p*B)) x attention over the B tokens alone.
"""
import json
import math
import sys

COLORS = {"dense": "#888888", "blocking": "#1f77b4", "speculative": "#2ca02c", "freekv": "#d62728"}
W, H = 720, 440
LEFT, RIGHT, TOP, BOTTOM = 70, 150, 40, 60


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot_decode.py DECODE.json OUT.svg")
    with open(sys.argv[1]) as f:
        data = json.load(f)
    shape = data["shape"]
    # two layouts: the older decode_bench JSON (budget in shape, one baseline)
    # and schema kvrecall-bench/1 (budget in params, a baseline per row and
    # batch; the first batch is drawn)
    rows = data["results"]
    if "batch" in rows[0]:
        rows = [r for r in rows if r["batch"] == rows[0]["batch"]]
        data = dict(data, results=rows)
    base = data.get("attention_over_budget_us") or rows[0]["attention_over_budget_us"]
    p = shape["page_tokens"]
    budget = shape.get("budget_tokens") or data["params"]["budget_tokens"]
    series = {}
    for r in data["results"]:
        series.setdefault(r["mode"], []).append((r["context_tokens"], r["us_per_layer"]))
    contexts = sorted({r["context_tokens"] for r in data["results"]})
    target = [(L, 1.1 * (1 + L / (p * budget)) * base) for L in contexts]
    ys = [y for pts in series.values() for _, y in pts] + [y for _, y in target] + [base]
    x0, x1 = math.log2(contexts[0]), math.log2(contexts[-1])
    y0, y1 = math.floor(math.log2(min(ys))), math.ceil(math.log2(max(ys)))
    if x1 == x0:
        x1 = x0 + 1

    def px(L):
        return LEFT + (math.log2(L) - x0) / (x1 - x0) * (W - LEFT - RIGHT)

    def py(us):
        return H - BOTTOM - (math.log2(us) - y0) / (y1 - y0) * (H - TOP - BOTTOM)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{LEFT}" y="22" font-size="14">Decode step per layer, cpu backend '
           f'({shape["n_kv_heads"]} KV / {shape["n_qo_heads"]} query heads, d={shape["head_dim"]}, '
           f'B={budget}, p={p}; {data.get("kvrecall_version", "")})</text>']
    # grid and axes
    for e in range(int(y0), int(y1) + 1):
        y = py(2 ** e)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{W - RIGHT}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{2 ** e:g}</text>')
    for L in contexts:
        x = px(L)
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{H - BOTTOM}" stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{L // 1024}K</text>')
    out.append(f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 18}" text-anchor="middle">'
               f'context length (tokens)</text>')
    out.append(f'<text x="16" y="{(TOP + H - BOTTOM) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {(TOP + H - BOTTOM) / 2})">microseconds per layer</text>')

    def polyline(pts, color, dash=""):
        d = " ".join(f"{px(L):.1f},{py(us):.1f}" for L, us in pts)
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="2"{extra}/>')
        if not dash:
            for L, us in pts:
                out.append(f'<circle cx="{px(L):.1f}" cy="{py(us):.1f}" r="3" fill="{color}"/>')

    polyline(target, "#000000", "6,4")
    polyline([(contexts[0], base), (contexts[-1], base)], "#999999", "2,3")
    legend = [("target 1.1(1+L/pB)·attn", "#000000", "6,4"), ("attention over B", "#999999", "2,3")]
    for mode in ("dense", "blocking", "speculative", "freekv"):
        if mode in series:
            polyline(sorted(series[mode]), COLORS[mode])
            legend.append((mode, COLORS[mode], ""))
    for i, (name, color, dash) in enumerate(legend):
        y = TOP + 10 + 18 * i
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<line x1="{W - RIGHT + 10}" y1="{y}" x2="{W - RIGHT + 34}" y2="{y}" '
                   f'stroke="{color}" stroke-width="2"{extra}/>')
        out.append(f'<text x="{W - RIGHT + 38}" y="{y + 4}">{name}</text>')
    out.append("</svg>")
    with open(sys.argv[2], "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
