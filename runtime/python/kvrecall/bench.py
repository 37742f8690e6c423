# SPDX-License-Identifier: MIT
"""Benchmarks of kvrecall from Python (``python -m kvrecall.bench``).

    python -m kvrecall.bench decode   --json decode.json    # transformers on SmolLM2: tokens/s per cache
    python -m kvrecall.bench binding  --json binding.json   # the binding's cost per layer call
    python -m kvrecall.bench accuracy --json accuracy.json  # dense = sdpa tokens; freekv perplexity
    python -m kvrecall.bench plot decode.json --out decode.png

``decode`` loads SmolLM2-135M-Instruct from the demo's GGUF (transformers'
``gguf_file=``, float32), prefills a prompt of each --contexts length (the GPL
texts) into each row's cache, then times greedy decode steps for each row: DynamicCache +
sdpa, KVRecallCache dense, and freekv at each --budgets, in rounds that
alternate between the rows (the shared machine's speed varies). It reports
the median decode tokens/s, the adapter's and the binding's cost per layer, and the bytes of KV
torch holds. ``accuracy`` checks that KVRecallCache dense gives sdpa's greedy
tokens on the demo's prompt, and measures perplexity teacher-forced over the
GPL texts (as ``kvrecall eval``). Needs torch and transformers (and gguf,
accelerate); ``plot`` needs matplotlib. docs/python.md has results.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from typing import Any, Optional

import kvrecall

SCHEMA = "kvrecall-python-bench/1"
GPL = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GPL-2"]
QUESTION = "What does this license require from someone who distributes modified versions of the program?"


def default_model() -> str:
    cache = os.environ.get("KVR_MODEL_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvrecall")
    return os.path.join(cache, "SmolLM2-135M-Instruct.Q4_1.gguf")


def machine() -> dict:
    info = kvrecall.system_info()
    return {"cpu": info["cpu_model"], "cpu_kernels": info["cpu_kernels"], "cores": info["n_cores"],
            "gpu": info["gpu_name"], "python": platform.python_version(), "kvrecall": kvrecall.__version__}


def load(path: str, dtype: Any):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import kvrecall.transformers  # noqa: F401  registers "kvrecall"

    if not os.path.exists(path):
        sys.exit(f"kvrecall.bench: no model at {path}: run bench/model/fetch_model.sh (or give --model)")
    directory, name = os.path.split(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype,
                                                 attn_implementation="sdpa").eval()
    return model, tok


def gpl_ids(tok, n: int) -> list:
    text = "\n\n".join(open(f, encoding="utf-8").read() for f in GPL)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        sys.exit(f"kvrecall.bench: the GPL texts have {len(ids)} tokens; {n} asked")
    return ids[:n]


def make_cache(row: dict, model: Any, threads: int):
    from transformers import DynamicCache
    from kvrecall.transformers import KVRecallCache

    if row["cache"] == "dynamic":
        model.set_attn_implementation("sdpa")
        return DynamicCache(config=model.config)
    extra = {"threads": threads}
    if row.get("sink") is not None:
        extra.update(sink_tokens=row["sink"], window_tokens=row["window"])
    return KVRecallCache.for_model(model, mode=row["mode"], budget=row["budget"], **extra)


def torch_kv_bytes(cache: Any) -> int:
    """Bytes of keys and values the cache holds in torch tensors."""
    import torch

    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class AdapterTimer:
    """Wall time spent in the adapter's decode per layer (KVRecallCache._decode)."""

    def __init__(self, cache: Any) -> None:
        self.ns = 0
        self.calls = 0
        inner = cache._decode

        def timed(*args: Any) -> Any:
            t = time.perf_counter_ns()
            try:
                return inner(*args)
            finally:
                self.ns += time.perf_counter_ns() - t
                self.calls += 1

        cache._decode = timed


class Row:
    """One cache under test: prefilled once, then timed in rounds that
    alternate with the other rows', so that every row sees the shared
    machine's slow and fast moments alike."""

    def __init__(self, model: Any, ids: list, spec: dict, threads: int) -> None:
        import torch

        self.model, self.spec = model, spec
        self.cache = make_cache(spec, model, threads)
        self.samples: list = []
        self.adapter_ns = self.adapter_calls = self.call_ns = self.calls = 0
        self.timer = AdapterTimer(self.cache) if spec["cache"] == "kvrecall" else None
        with torch.no_grad():
            if spec["cache"] == "dynamic":
                model.set_attn_implementation("sdpa")
            t0 = time.perf_counter()
            out = model(torch.tensor([ids]), cache=self.cache, logits_to_keep=1)
            self.prefill_s = time.perf_counter() - t0
            self.next = out.logits[:, -1:].argmax(-1)
            self.steps(2)  # warm-up, not timed
        if self.timer:
            self.timer.ns = self.timer.calls = 0
            self.bind0 = self.cache.context.binding_stats()
            self.stats0 = self.cache.stats()

    def steps(self, n: int) -> float:
        import torch

        if self.spec["cache"] == "dynamic":
            self.model.set_attn_implementation("sdpa")
        elif self.model.config._attn_implementation != "kvrecall":
            self.model.set_attn_implementation("kvrecall")
        with torch.no_grad():
            t0 = time.perf_counter()
            for _ in range(n):
                self.next = self.model(self.next, cache=self.cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
            return time.perf_counter() - t0

    def result(self, context: int, steps: int) -> dict:
        import statistics

        rates = [steps / s for s in self.samples]
        rate = statistics.median(rates)
        r = dict(self.spec, context=context, steps=steps, rounds=len(rates), prefill_s=self.prefill_s,
                 tokens_per_s=rate, tokens_per_s_rounds=rates, ms_per_token=1e3 / rate,
                 torch_kv_bytes=torch_kv_bytes(self.cache))
        if self.timer:
            bind1 = self.cache.context.binding_stats()
            after = self.cache.stats()
            calls = bind1["layer_calls"] - self.bind0["layer_calls"]
            c_ns = bind1["layer_call_ns"] - self.bind0["layer_call_ns"]
            r.update(kvrecall_us_per_layer=c_ns / calls / 1e3,
                     adapter_us_per_layer=(self.timer.ns - c_ns) / self.timer.calls / 1e3,
                     corrected_heads=after["corrected_heads"] - self.stats0["corrected_heads"],
                     checked_heads=after["checked_heads"] - self.stats0["checked_heads"],
                     kvrecall_kv_bytes=_kvrecall_kv_bytes(self.cache, context))
            self.cache.close()
        return r


def _kvrecall_kv_bytes(cache: Any, tokens: int) -> int:
    c = cache.context.config if cache.context else cache._base
    elem = 4 if c.dtype == "f32" else 2
    return tokens * c.n_layers * 2 * c.n_kv_heads * c.head_dim * elem


def cmd_decode(a: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    model, tok = load(a.model, torch.float32)
    rows = [{"name": "DynamicCache + sdpa", "cache": "dynamic", "mode": "sdpa", "budget": None}]
    rows.append({"name": "KVRecallCache dense", "cache": "kvrecall", "mode": "dense", "budget": 2048})
    for b in a.budgets:
        rows.append({"name": f"KVRecallCache freekv B={b}", "cache": "kvrecall", "mode": "freekv", "budget": b,
                     "sink": a.sink, "window": a.window})
    results = []
    for context in a.contexts:
        ids = gpl_ids(tok, context)
        live = [Row(model, ids, spec, a.kvrecall_threads) for spec in rows]
        for _ in range(a.rounds):
            for row in live:
                row.samples.append(row.steps(a.steps))
        for row in live:
            r = row.result(context, a.steps)
            results.append(r)
            print(f"{context:6d}  {r['name']:28s} {r['tokens_per_s']:7.2f} tokens/s  "
                  f"(median of {r['rounds']} rounds: {r['ms_per_token']:.1f} ms/token; torch KV "
                  f"{r['torch_kv_bytes'] / 2**20:.1f} MiB"
                  + (f"; adapter {r['adapter_us_per_layer']:.1f} us/layer beside kvrecall's "
                     f"{r['kvrecall_us_per_layer']:.1f}" if "adapter_us_per_layer" in r else "") + ")",
                  flush=True)
        del live
    for context in a.contexts:
        base = next(r for r in results if r["context"] == context and r["cache"] == "dynamic")
        for r in results:
            if r["context"] == context:
                r["speedup_vs_sdpa"] = r["tokens_per_s"] / base["tokens_per_s"]
    return {"benchmark": "decode", "rows": results, "threads": a.threads}


def cmd_binding(a: argparse.Namespace) -> dict:
    """Time step.layer from Python against the time kvrecall itself measures
    inside kvr_decode_layer (critical_ns): the difference is the binding."""
    import numpy as np

    out = []
    kinds = ["numpy"]
    try:
        import torch
        torch.set_num_threads(1)
        kinds.append("torch")
    except ImportError:
        torch = None
    shape = dict(n_layers=30, n_qo_heads=9, n_kv_heads=3, head_dim=64, dtype="f32")
    for kind, mode, context in [(k, m, c) for k in kinds for c in (a.short, a.context)
                                for m in ("dense", "freekv")]:
        cfg = kvrecall.Config(**shape, mode=mode, budget_tokens=1024, sink_tokens=128, window_tokens=128,
                              threads=a.kvrecall_threads)
        with kvrecall.Context(cfg) as ctx:
            seq = ctx.sequence()
            rng = np.random.default_rng(0)
            kv = rng.standard_normal((context, 3, 64), dtype=np.float32)
            for layer in range(30):
                ctx.prefill(seq, layer, kv, kv)
            q = rng.standard_normal((1, 9, 64), dtype=np.float32)
            k = rng.standard_normal((1, 3, 64), dtype=np.float32)
            o = np.empty_like(q)
            if kind == "torch":
                q, k, o = torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(o)
            for _ in range(3):
                with ctx.decode_step([seq]) as step:
                    for layer in range(30):
                        step.layer(layer, q, k, k, o)
            before = ctx.stats()
            bind0 = ctx.binding_stats()
            wall = 0
            for _ in range(a.steps):
                step = ctx.decode_step([seq])
                layer_call = step.layer
                t = time.perf_counter_ns()
                for layer in range(30):
                    layer_call(layer, q, k, k, o)
                wall += time.perf_counter_ns() - t
                step.end()
            after = ctx.stats()
            bind1 = ctx.binding_stats()
            calls = bind1["layer_calls"] - bind0["layer_calls"]
            c_ns = bind1["layer_call_ns"] - bind0["layer_call_ns"]
            r = {"tensors": kind, "mode": mode, "context": context, "calls": calls,
                 "python_us_per_call": wall / calls / 1e3, "kvrecall_us_per_call": c_ns / calls / 1e3,
                 "kvrecall_critical_us_per_call": (after["critical_ns"] - before["critical_ns"]) / calls / 1e3,
                 "binding_us_per_call": (wall - c_ns) / calls / 1e3}
            out.append(r)
            print(f"{kind:6s} {mode:7s} {context:6d} tokens: {r['python_us_per_call']:7.2f} us per layer call "
                  f"from Python, {r['kvrecall_us_per_call']:7.2f} inside kvr_decode_layer: binding "
                  f"{r['binding_us_per_call']:.2f} us", flush=True)
    return {"benchmark": "binding", "rows": out}


def perplexity(model: Any, ids: list, cache: Any, prefill: int, dense_top: Optional[list]) -> dict:
    import torch

    nll, agree, tops = 0.0, 0, []
    with torch.no_grad():
        out = model(torch.tensor([ids[:prefill]]), cache=cache, logits_to_keep=1)
        logits = out.logits[0, -1]
        t0 = time.perf_counter()
        for pos in range(prefill, len(ids)):
            lp = torch.log_softmax(logits.double(), -1)
            nll -= float(lp[ids[pos]])
            top = int(logits.argmax())
            tops.append(top)
            if dense_top is not None:
                agree += dense_top[pos - prefill] == top
            if pos + 1 < len(ids):
                logits = model(torch.tensor([[ids[pos]]]), cache=cache, logits_to_keep=1).logits[0, -1]
        seconds = time.perf_counter() - t0
    n = len(ids) - prefill
    return {"positions": n, "perplexity": math.exp(nll / n), "top1_agreement": agree / n if dense_top else 1.0,
            "decode_s": seconds, "tops": tops}


def cmd_accuracy(a: argparse.Namespace) -> dict:
    import torch
    from transformers import DynamicCache
    from kvrecall.transformers import KVRecallCache

    torch.set_num_threads(a.threads)
    model, tok = load(a.model, torch.float32)
    result: dict = {"benchmark": "accuracy"}
    if a.tokens:
        doc = open(GPL[0], encoding="utf-8").read()
        ids = tok.apply_chat_template([{"role": "user", "content": doc + "\n\n" + QUESTION}],
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        gen = dict(max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False,
                   attention_mask=torch.ones_like(ids), pad_token_id=tok.eos_token_id or 0)
        with torch.no_grad():
            model.set_attn_implementation("sdpa")
            ref = model.generate(ids, cache=DynamicCache(config=model.config), **gen)[0, ids.shape[1]:]
            cache = KVRecallCache.for_model(model, mode="dense", budget=2048, threads=a.kvrecall_threads)
            got = model.generate(ids, cache=cache, **gen)[0, ids.shape[1]:]
        same = int((ref == got).cumprod(0).sum())
        result["greedy"] = {"prompt_tokens": int(ids.shape[1]), "tokens": a.tokens,
                            "identical_prefix": same, "all_identical": bool(torch.equal(ref, got)),
                            "text": tok.decode(got)}
        print(f"demo prompt ({ids.shape[1]} tokens): KVRecallCache dense and sdpa agree on the first "
              f"{same} of {a.tokens} greedy tokens", flush=True)
        cache.close()
    if a.context:
        ids = gpl_ids(tok, a.context)
        prefill = a.prefill or a.budget
        rows = []
        dense_top = None
        for mode in a.modes:
            cache = KVRecallCache.for_model(model, mode=mode, budget=a.budget, sink_tokens=a.sink,
                                            window_tokens=a.window, tau=a.tau, threads=a.kvrecall_threads)
            r = perplexity(model, ids, cache, prefill, dense_top)
            if mode == "dense":
                dense_top = r["tops"]
            del r["tops"]
            r.update(mode=mode, stats=cache.stats())
            cache.close()
            rows.append(r)
            print(f"{mode:8s} perplexity {r['perplexity']:.4f} over {r['positions']} positions, top-1 agreement "
                  f"with dense {r['top1_agreement']:.4f} ({r['decode_s']:.0f} s)", flush=True)
        result["perplexity"] = {"context": a.context, "prefill": prefill, "budget": a.budget, "sink": a.sink,
                                "window": a.window, "tau": a.tau, "rows": rows}
    return result


def cmd_plot(a: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(a.input))
    rows = data["rows"]
    contexts = sorted({r["context"] for r in rows})
    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ys = [next((r["tokens_per_s"] for r in rows if r["name"] == name and r["context"] == c), 0) for c in contexts]
        xs = [j + i * width for j in range(len(contexts))]
        bars = ax.bar(xs, ys, width, label=name)
        for x, y in zip(xs, ys):
            ax.text(x, y, f"{y:.1f}", ha="center", va="bottom", fontsize=8)
        _ = bars
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(contexts))])
    ax.set_xticklabels([f"{c} tokens" for c in contexts])
    ax.set_ylabel("decode tokens/s")
    m = data.get("machine", {})
    ax.set_title(f"transformers on SmolLM2-135M (float32), {data.get('threads', '?')} threads: {m.get('cpu', '')}",
                 fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvrecall.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(s: argparse.ArgumentParser) -> None:
        s.add_argument("--model", default=default_model(), help="the GGUF (default: the demo's SmolLM2)")
        s.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
        s.add_argument("--kvrecall-threads", type=int, default=1,
                       help="kvrecall's workers besides the caller's thread (default 1)")
        s.add_argument("--json", help="write the results here")

    def ints(text: str) -> list:
        return [int(x) for x in text.split(",")]

    d = sub.add_parser("decode", help="decode tokens/s per cache")
    common(d)
    d.add_argument("--contexts", type=ints, default=[4096, 8192])
    d.add_argument("--budgets", type=ints, default=[1024, 2048])
    d.add_argument("--sink", type=int, default=128)
    d.add_argument("--window", type=int, default=128)
    d.add_argument("--steps", type=int, default=16, help="decode steps per round (default 16)")
    d.add_argument("--rounds", type=int, default=5,
                   help="rounds; each times every row once, in turn (default 5: the median is reported)")

    b = sub.add_parser("binding", help="the binding's cost per layer call")
    common(b)
    b.add_argument("--context", type=int, default=2048, help="tokens per sequence (default 2048)")
    b.add_argument("--short", type=int, default=64,
                   help="also a context this short, where attention leaves the caches to Python (default 64)")
    b.add_argument("--steps", type=int, default=300)

    c = sub.add_parser("accuracy", help="dense = sdpa greedy tokens; perplexity per mode")
    common(c)
    c.add_argument("--tokens", type=int, default=64, help="greedy tokens compared on the demo prompt (0: skip)")
    c.add_argument("--context", type=int, default=4096, help="tokens of GPL text for perplexity (0: skip)")
    c.add_argument("--prefill", type=int, default=0, help="tokens prefilled (default: the budget)")
    c.add_argument("--modes", type=lambda t: t.split(","), default=["dense", "freekv"])
    c.add_argument("--budget", type=int, default=1024)
    c.add_argument("--sink", type=int, default=128)
    c.add_argument("--window", type=int, default=128)
    c.add_argument("--tau", type=float, default=0.9)

    pl = sub.add_parser("plot", help="plot a decode JSON")
    pl.add_argument("input")
    pl.add_argument("--out", required=True)

    a = p.parse_args(argv)
    if a.cmd == "plot":
        cmd_plot(a)
        return 0
    result = {"schema": SCHEMA, "machine": machine(), "command": "python -m kvrecall.bench " + " ".join(
        sys.argv[1:] if argv is None else argv)}
    result.update({"decode": cmd_decode, "binding": cmd_binding, "accuracy": cmd_accuracy}[a.cmd](a))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
