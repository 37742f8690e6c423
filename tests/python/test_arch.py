# SPDX-License-Identifier: MIT
"""The runner's architectures (llama with Llama 3's rope factors, qwen2, qwen3;
tied and untied outputs; Q8_0, Q4_K_M and Q5_K_M mixes) and pre-tokenizers
(llama-bpe, qwen2, deepseek-r1-qwen) against llama.cpp, on synthetic GGUFs.

tests/data/model/synthetic.py writes the files here with the `gguf` package;
tests/data/model/arch_fixtures.txt holds llama.cpp's answers for the same files
(make_arch_fixtures.py beside it). model_probe (tests/model_probe.c, path in
$KVR_MODEL_PROBE) runs the runner's model and tokenizer on them.

The bound on logits is the one tests/test_model.c holds the real SmolLM2 file
to: the same top-1 wherever llama.cpp's own top two are 0.25 or more apart, and
every one of llama.cpp's top 8 logits within 8% (relative to max(|logit|, 1)).
"""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "data", "model")
sys.path.insert(0, DATA)

synthetic = pytest.importorskip("synthetic", reason="needs numpy and the gguf package")
PROBE = os.environ.get("KVR_MODEL_PROBE")
NEAR_TIE = 0.25
LOGIT_BOUND = 0.08
GROUP = 10


def load_fixtures():
	fx = {"model": {}, "prompt": {}, "pos": {}, "greedy": {}, "gap": {}, "tok": {}}
	with open(os.path.join(DATA, "arch_fixtures.txt")) as f:
		for line in f:
			if line.startswith("#") or not line.strip():
				continue
			kind, name, *rest = line.split()
			if kind == "model":
				fx["model"][name] = rest[0]
			elif kind == "prompt":
				fx["prompt"][name] = [int(x) for x in rest[1:]]
			elif kind == "pos":
				top = [(int(a), float(b)) for a, b in (x.split(":") for x in rest[1:])]
				fx["pos"].setdefault(name, {})[int(rest[0])] = top
			elif kind == "greedy":
				fx["greedy"][name] = [int(x) for x in rest[1:]]
			elif kind == "gap":
				fx["gap"][name] = [float(x) for x in rest[1:]]
			elif kind == "tok":
				fx["tok"].setdefault(name, []).extend(rest[1:])
	return fx


FIX = load_fixtures()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
	if not PROBE or not os.access(PROBE, os.X_OK):
		pytest.skip("KVR_MODEL_PROBE does not name the model_probe executable (run through meson test)")
	out = tmp_path_factory.mktemp("synthetic")
	return {name: (path, digest) for kind, name, path, digest in synthetic.write_all(str(out))}


def probe(*args):
	r = subprocess.run([PROBE, *map(str, args)], capture_output=True, text=True, timeout=600)
	assert r.returncode == 0, f"model_probe {args[0]} failed: {r.stderr}"
	return r.stdout.splitlines()


def compare_row(logits, top, where):
	"""(top-1 agrees or near tie, max relative difference) of one position."""
	best = max(range(len(logits)), key=logits.__getitem__)
	near_tie = top[0][1] - top[1][1] < NEAR_TIE
	if not near_tie:
		assert best == top[0][0], (f"{where}: our top-1 is {best} ({logits[best]:.4f}), llama.cpp's "
					   f"{top[0][0]} ({top[0][1]:.4f}; ours {logits[top[0][0]]:.4f})")
	rel = max(abs(logits[i] - ref) / max(abs(ref), 1.0) for i, ref in top)
	return rel


@pytest.mark.parametrize("name", [f"{a}-{m}" for a, m in synthetic.MODELS])
def test_logits_match_llama_cpp(files, name):
	path, digest = files[name]
	assert FIX["model"].get(name) == digest, (
		f"{name}: synthetic.py wrote other weights than arch_fixtures.txt was recorded for; "
		"rerun tests/data/model/make_arch_fixtures.py")
	ids = FIX["prompt"][name]
	assert ids == synthetic.prompt_ids(name)
	lines = probe("logits", path, *ids)
	rows = {}
	for line in lines:
		tag, pos, *vals = line.split()
		rows[(tag, int(pos))] = [float(v) for v in vals]
	worst = 0.0
	for p, top in FIX["pos"][name].items():
		worst = max(worst, compare_row(rows[("pos", p)], top, f"{name} position {p}"))
	last = len(ids) - 1
	worst = max(worst, compare_row(rows[("prefill", last)], FIX["pos"][name][last], f"{name} prefill"))
	print(f"{name}: {len(ids)} positions, max relative logit difference {worst:.4f}")
	assert worst < LOGIT_BOUND, f"{name}: logits differ from llama.cpp's by up to {worst:.4f} (relative)"


@pytest.mark.parametrize("name", [f"{a}-{m}" for a, m in synthetic.MODELS])
def test_greedy_tokens_match_llama_cpp(files, name):
	path, _ = files[name]
	want, gaps = FIX["greedy"][name], FIX["gap"][name]
	got = [int(x) for x in probe("greedy", path, len(want), *FIX["prompt"][name])[0].split()[1:]]
	same = 0
	while same < len(want) and got[same] == want[same]:
		same += 1
	if same < len(want):
		# only a near tie of llama.cpp's may go the other way; after it the texts differ
		assert gaps[same] < NEAR_TIE, (f"{name}: greedy token {same} is {got[same]}, llama.cpp's "
					       f"{want[same]} (its top two {gaps[same]:.3f} apart)")
	# then every step, on llama.cpp's own text: the same choice wherever it is clear
	prompt = FIX["prompt"][name]
	rows = {}
	for line in probe("logits", path, *(prompt + want[:-1])):
		tag, pos, *vals = line.split()
		if tag == "pos":
			rows[int(pos)] = [float(v) for v in vals]
	clear = 0
	for g, tok in enumerate(want):
		row = rows[len(prompt) - 1 + g]
		ours = max(range(len(row)), key=row.__getitem__)
		if gaps[g] >= NEAR_TIE:
			clear += 1
			assert ours == tok, f"{name}: step {g} on llama.cpp's text: ours {ours}, llama.cpp's {tok}"
	print(f"{name}: free-running, {same} of {len(want)} greedy tokens as llama.cpp's before a near tie; "
	      f"teacher-forced, all {clear} clear choices of {len(want)} the same")


@pytest.mark.parametrize("pre", list(synthetic.FAMILIES))
def test_pretokenizer_matches_llama_cpp(files, pre):
	path, _ = files[pre]
	corpus_path, _ = files["corpus"]
	items = synthetic.corpus()
	lines = probe("tokenize", path, corpus_path)
	assert len(lines) == len(items)
	ids = [[int(x) for x in line.split()] for line in lines]
	want = FIX["tok"][pre]
	assert len(want) * GROUP >= len(items)
	bad = []
	for g in range(0, len(items), GROUP):
		acc = []
		for row in ids[g:g + GROUP]:
			acc += row + [-1]
		if f"{synthetic.ids_hash(acc):08x}" != want[g // GROUP]:
			bad.append(g)
	detail = "".join(f"\n  group {g}: " + " | ".join(repr(t) for t, _ in items[g:g + GROUP]) for g in bad[:3])
	assert not bad, (f"{pre}: {len(bad)} of {len(want)} groups of {GROUP} strings tokenize unlike llama.cpp "
			 f"(tests/data/tokenizer/compare_llama.py shows the ids):{detail}")
	print(f"{pre}: {len(items)} strings tokenized as llama.cpp does")


def generate(*args):
	exe = os.environ.get("KVR_EXE")
	if not exe or not os.access(exe, os.X_OK):
		pytest.skip("KVR_EXE does not name the kvrecall command (run through meson test)")
	return subprocess.run([exe, "generate", "--threads", "0", *map(str, args)], capture_output=True, text=True, errors="replace",
			      timeout=300)


@pytest.mark.parametrize("name,chat", [("llama-q8_0", "llama3"), ("qwen2-q4_k_m", "deepseek-r1, thinking"),
				       ("qwen3-q5_k_m", "chatml, thinking")])
def test_generate_chat_and_document(files, tmp_path, name, chat):
	"""--chat and --file/--question in each family's chat format, every mode."""
	path, _ = files[name]
	r = generate("--model", path, "--chat", "Hello, who are you?", "--max-tokens", 16, "--mode", "dense")
	assert r.returncode == 0, r.stderr
	assert f"chat {chat}" in r.stderr, r.stderr
	doc = tmp_path / "doc.txt"
	doc.write_text("The quick brown fox jumps over the lazy dog. 1234 5678.\n" * 40)
	for mode in ("dense", "freekv"):
		r = generate("--model", path, "--file", doc, "--question", "What does the fox do?", "--max-tokens", 24,
			     "--mode", mode, "--budget", 256, "--think", "off", "--json", tmp_path / "run.json")
		assert r.returncode == 0, r.stderr
		assert f"{mode}: prompt" in r.stderr


def test_generate_refuses_what_it_cannot_run_well(files, tmp_path):
	path, _ = files["qwen3-q8_0"]
	r = generate("--model", path, "--prompt", "")
	assert r.returncode == 1 and "the prompt is empty" in r.stderr
	# past the trained context (4096): refused before any work, unless asked for
	doc = tmp_path / "long.txt"
	doc.write_text("word " * 6000)
	r = generate("--model", path, "--file", doc, "--max-tokens", 4)
	assert r.returncode == 1
	assert "trained for a context of 4096 (qwen3.context_length)" in r.stderr
	assert "--beyond-context" in r.stderr
	r = generate("--model", path, "--prompt", "hello", "--max-tokens", 5000, "--ignore-eos", "--quiet",
		     "--mode", "dense", "--timeline", 1024, "--json", tmp_path / "lg.json")
	assert r.returncode == 0, r.stderr
	import json
	run = json.loads((tmp_path / "lg.json").read_text())
	n_prompt = run["prompt_tokens"]
	assert f"generating at most {4096 - n_prompt} tokens" in r.stderr
	assert run["generated"] == 4096 - n_prompt and run["runs"][0]["mode"] == "dense"
	assert [p["position"] for p in run["timeline"]][:3] == [n_prompt + 1024, n_prompt + 2048, n_prompt + 3072]
	assert all(p["tokens_per_s"] > 0 and p["rss_mib"] > 0 for p in run["timeline"])
