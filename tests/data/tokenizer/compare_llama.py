#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
#
# compare_llama.py — differential test of bench/model/tokenizer.c against
# llama.cpp on random strings (not run by CI: it needs llama-cpp-python; see
# README.md for the venv). Builds tokenizer.c + unicode.c into a temporary
# shared library, loads SmolLM2's vocabulary with gguf-py, and compares
# tok_encode with Llama.tokenize for N random strings drawn from ASCII,
# contractions, whitespace of every kind, digits of several scripts, letters
# of several scripts, emoji, combining marks, bytes without a token and the
# special tokens, with parse_special on or off at random.
#
#   /tmp/tokvenv/bin/python tests/data/tokenizer/compare_llama.py [N] [SEED]
import ctypes as C
import os
import random
import subprocess
import sys
import tempfile

import gguf
from llama_cpp import Llama

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))


class Str(C.Structure):
	_fields_ = [("ptr", C.c_char_p), ("len", C.c_size_t)]


class Vocab(C.Structure):
	_fields_ = [("model", C.c_char_p), ("pre", C.c_char_p), ("n_tokens", C.c_size_t),
		    ("tokens", C.POINTER(Str)), ("types", C.POINTER(C.c_int32)),
		    ("n_merges", C.c_size_t), ("merges", C.POINTER(Str)),
		    ("bos_id", C.c_int32), ("eos_id", C.c_int32), ("unk_id", C.c_int32),
		    ("add_bos", C.c_int), ("eog_ids", C.c_int32 * 4), ("n_eog_ids", C.c_size_t)]


ALPHABET = list("abcdefgxyzABCXYZ0123456789 \t\n\r'\"!?.,;:-_()[]{}<>|/\\@#$%^&*+=~`") + [
	"'s", "'re", "'ll", "'ve", "'m", "'d", "'S", "  ", "\n\n", "é", "ü", "ñ", "ß", "日", "本",
	"中", "한", "Ж", "д", "ا", "ל", "α", "😀", "🚀", "👍🏽", "\u200d", "\u0301", "\u00a0",
	"\u3000", "\u2009", "\u200b", "½", "²", "١", "１", "Ⅻ", "\x04", "\x00", "\x1c", "\x85",
	"\u2028", "𝔸", "ǅ", "ʰ", "\U0002EBF0", "\U00031350", "<|im_start|>", "<|im_end|>",
	"<|endoftext|>", "<file_sep>",
]


def main():
	n = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
	rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
	cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
	path = os.environ.get("KVR_MODEL_PATH") or os.path.join(
		cache, "kvrecall", "SmolLM2-135M-Instruct.Q4_1.gguf")

	with tempfile.TemporaryDirectory() as tmp:
		so = os.path.join(tmp, "libtok.so")
		model = os.path.join(ROOT, "bench", "model")
		subprocess.run(["cc", "-std=c11", "-D_GNU_SOURCE", "-O2", "-fPIC", "-shared", "-I", model,
				os.path.join(model, "tokenizer.c"), os.path.join(model, "unicode.c"),
				"-o", so], check=True)
		lib = C.CDLL(so)

	r = gguf.GGUFReader(path)
	field = lambda k: r.fields[k].contents()
	tb = [t.encode() for t in field("tokenizer.ggml.tokens")]
	mb = [m.encode() for m in field("tokenizer.ggml.merges")]
	types = field("tokenizer.ggml.token_type")
	toks = (Str * len(tb))(*[Str(b, len(b)) for b in tb])
	merges = (Str * len(mb))(*[Str(b, len(b)) for b in mb])
	tys = (C.c_int32 * len(types))(*types)
	v = Vocab(b"gpt2", b"smollm", len(tb), toks, tys, len(mb), merges, 1, 2, 0, 0)
	tok = C.c_void_p()
	err = C.create_string_buffer(256)
	rc = lib.tok_create(C.byref(v), C.byref(tok), err, C.c_size_t(256))
	if rc:
		sys.exit(f"tok_create: {rc} {err.value.decode()}")

	def ours(b, special):
		cap = len(b) + 8
		ids, got = (C.c_int32 * cap)(), C.c_size_t()
		rc = lib.tok_encode(tok, b, C.c_size_t(len(b)), special, ids, C.c_size_t(cap),
				    C.byref(got))
		assert rc == 0, rc
		return list(ids[:got.value])

	llm = Llama(model_path=path, vocab_only=True, verbose=False)
	bad = 0
	for _ in range(n):
		b = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40))).encode()
		special = rng.randint(0, 1)
		a = ours(b, special)
		t = llm.tokenize(b, add_bos=False, special=bool(special)) if b else []
		if a != t:
			bad += 1
			if bad <= 10:
				print(f"differs: {b!r} special={special}\n  ours  {a}\n  llama {t}")
	lib.tok_destroy(tok)
	print(f"compare_llama: {bad} of {n} strings differ")
	sys.exit(1 if bad else 0)


if __name__ == "__main__":
	main()
