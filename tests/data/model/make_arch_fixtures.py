#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Record llama.cpp's answers for the synthetic GGUFs of synthetic.py, as the
independent reference tests/python/test_arch.py compares the runner with.

    python3 -m venv /tmp/llvenv
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" /tmp/llvenv/bin/pip install \\
        numpy gguf==0.19.0 llama-cpp-python==0.3.36
    /tmp/llvenv/bin/python tests/data/model/make_arch_fixtures.py > tests/data/model/arch_fixtures.txt

(llama-cpp-python compiles llama.cpp: 5 to 25 minutes on 2 cores.)

For every model (llama.cpp: f16 KV cache, 1 thread, logits of every position):
    model NAME DIGEST                    synthetic.py's digest of the weights
    prompt NAME N ID...                  the prompt's token ids
    pos NAME P ID:LOGIT x8               top-8 next-token logits after position P
    greedy NAME N ID...                  N greedy tokens after the prompt
    gap NAME N GAP...                    llama.cpp's top-1 minus top-2 logit at each
                                         greedy step (a near tie may flip)
For every vocabulary (pre-tokenizer) and the corpus (corpus.txt's lines, in
groups of GROUP strings; hash: synthetic.ids_hash of the group's ids, each
string's ids followed by -1):
    tok PRE FIRST_GROUP HASH...          50 groups per line
"""
import os
import sys
import tempfile

import numpy as np

import llama_cpp
from llama_cpp import Llama

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import synthetic  # noqa: E402

GROUP = 10
N_GREEDY = 64


def top8(row):
	top = np.argsort(-row, kind="stable")[:8]
	return " ".join(f"{t}:{row[t]:.6f}" for t in top)


def main():
	print(f"# llama-cpp-python {llama_cpp.__version__}; synthetic.py models and corpus")
	with tempfile.TemporaryDirectory() as tmp:
		files = synthetic.write_all(tmp)
		for kind, name, path, digest in files:
			if kind != "model":
				continue
			llm = Llama(path, n_ctx=512, logits_all=True, n_threads=1, verbose=False, seed=0, flash_attn=False)
			ids = synthetic.prompt_ids(name)
			print("model", name, digest)
			print("prompt", name, len(ids), *ids)
			llm.reset()
			llm.eval(ids)
			scores = np.array(llm.scores[: llm.n_tokens])
			for p in range(len(ids)):
				print("pos", name, p, top8(scores[p]))
			out, gaps = [], []
			row = scores[len(ids) - 1]
			for _ in range(N_GREEDY):
				s = np.sort(row)
				gaps.append(float(s[-1] - s[-2]))
				nxt = int(np.argmax(row))
				out.append(nxt)
				llm.eval([nxt])
				row = np.array(llm.scores[llm.n_tokens - 1])
			print("greedy", name, len(out), *out)
			print("gap", name, len(gaps), *(f"{g:.4f}" for g in gaps))
		items = synthetic.corpus()
		for kind, name, path, _ in files:
			if kind != "vocab":
				continue
			llm = Llama(path, vocab_only=True, verbose=False)
			hashes = []
			for g in range(0, len(items), GROUP):
				acc = []
				for text, special in items[g:g + GROUP]:
					b = text.encode()
					acc += (llm.tokenize(b, add_bos=False, special=bool(special)) if b else []) + [-1]
				hashes.append(f"{synthetic.ids_hash(acc):08x}")
			for i in range(0, len(hashes), 50):
				print("tok", name, i, *hashes[i:i + 50])


if __name__ == "__main__":
	main()
