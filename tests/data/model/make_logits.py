#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Record llama.cpp's logits for fixed prompts on SmolLM2-135M-Instruct, as the
independent reference tests/test_model.c compares kvrecall's forward pass with.

    python3 -m venv /tmp/llvenv && /tmp/llvenv/bin/pip install llama-cpp-python numpy
    /tmp/llvenv/bin/python tests/data/model/make_logits.py MODEL.gguf > tests/data/model/llama_cpp_logits.txt

For every prompt (its token ids as llama.cpp tokenizes it, parse_special on) and
every position, the line gives the top-8 next-token ids with their logits
(llama.cpp, f16 KV cache, flash attention as the build chooses, 1 thread).
Format, one record per line:
    prompt <index> <n_tokens> <id> <id> ...
    pos <index> <position> <id>:<logit> x8
"""
import sys

import numpy as np
from llama_cpp import Llama

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is the boiling point of water at sea level?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "In 1969, Neil Armstrong became the first person to walk on the",
]


def main():
    llm = Llama(sys.argv[1], n_ctx=512, logits_all=True, n_threads=1, verbose=False, seed=0)
    import llama_cpp
    print(f"# llama-cpp-python {llama_cpp.__version__}; model {sys.argv[1].split('/')[-1]}")
    for i, text in enumerate(PROMPTS):
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        scores = np.array(llm.scores[: llm.n_tokens])
        print("prompt", i, len(ids), *ids)
        for pos in range(len(ids)):
            row = scores[pos]
            top = np.argsort(-row, kind="stable")[:8]
            print("pos", i, pos, *(f"{t}:{row[t]:.6f}" for t in top))


if __name__ == "__main__":
    main()
