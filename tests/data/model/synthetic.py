#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Small synthetic GGUF models of the architectures the runner reads, written
with the `gguf` package, and a varied corpus for their tokenizers.

Nothing here is downloaded: the weights are pseudo-random (PCG64's raw stream,
which numpy keeps stable across versions, through Box-Muller in float64), the
vocabulary is the 256 byte-level characters plus merges drawn from Python's
Mersenne Twister (random.Random.random(), stable since Python 3.2), and the
corpus is drawn the same way. So the same files come out on every machine,
and llama.cpp's answers for them (recorded by make_arch_fixtures.py into
arch_fixtures.txt) hold for the files tests/python/test_arch.py writes.

    python3 synthetic.py OUT_DIR      # writes the models, the vocab-only files
                                      # and corpus.txt; prints one line per file

Each model line carries a SHA-256 of its tensor payloads and metadata values
(`digest`), which the fixtures record: a test refuses to compare against
answers recorded for other weights.
"""
import hashlib
import os
import random
import struct
import sys

import numpy as np

import gguf

# ---------------------------------------------------------------- pseudo-random


class Rng:
	"""Normal and uniform draws from PCG64's raw 64-bit stream."""

	def __init__(self, seed):
		self.bits = np.random.PCG64(seed)

	def uniform(self, n):
		raw = self.bits.random_raw(n)
		return ((raw >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))

	def normal(self, shape):
		n = int(np.prod(shape))
		u1, u2 = self.uniform(n), self.uniform(n)
		z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
		return z.reshape(shape)

	def bytes(self, n):
		return (self.bits.random_raw(n) & np.uint64(0xFF)).astype(np.uint8)


# ---------------------------------------------------------------- quantisation
# Q8_0 is quantised here (the reference rounding, so the bytes do not depend on
# the gguf package's version). The K-quant blocks are drawn directly: random
# quants and sub-block scales under a super-block scale sized for the wanted
# spread. Any bytes are a valid block, and both readers dequantise the same
# bytes, which is all a comparison of two implementations needs.


def f16_bytes(x):
	return np.asarray(x, dtype=np.float16).reshape(-1, 1).view(np.uint8)


def q8_0(w):
	rows, cols = w.shape
	b = w.reshape(rows, cols // 32, 32)
	amax = np.abs(b).max(axis=2, keepdims=True)
	d = (amax / 127.0).astype(np.float32)
	inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1), 0)
	q = np.clip(np.rint(b * inv), -127, 127).astype(np.int8)
	out = np.concatenate([f16_bytes(d.reshape(-1)).reshape(rows, cols // 32, 2),
			      q.view(np.uint8)], axis=2)
	return out.reshape(rows, cols // 32 * 34)


def k_blocks(rng, rows, cols, qtype, std):
	nb = rows * cols // 256
	if qtype == gguf.GGMLQuantizationType.Q4_K:
		# d, dmin, scales[12] (6-bit scales and mins), qs[128]: x = d*sc*q - dmin*m
		d = np.full(nb, std / 143.0)
		body = rng.bytes(nb * 140).reshape(nb, 140)
		out = np.concatenate([f16_bytes(d).reshape(nb, 2), f16_bytes(d * 7.5).reshape(nb, 2), body], axis=1)
	elif qtype == gguf.GGMLQuantizationType.Q5_K:
		d = np.full(nb, std / 290.0)
		body = rng.bytes(nb * 172).reshape(nb, 172)
		out = np.concatenate([f16_bytes(d).reshape(nb, 2), f16_bytes(d * 15.5).reshape(nb, 2), body], axis=1)
	elif qtype == gguf.GGMLQuantizationType.Q6_K:
		# ql[128], qh[64], scales[16] (int8), d: x = d*scale*(q - 32)
		d = np.full(nb, std / 1332.0)
		body = rng.bytes(nb * 208).reshape(nb, 208)
		out = np.concatenate([body, f16_bytes(d).reshape(nb, 2)], axis=1)
	else:
		raise ValueError(qtype)
	return out.reshape(rows, -1)


# ---------------------------------------------------------------- vocabulary


def byte_level_table():
	keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
	table, extra = {}, 0
	for b in range(256):
		if b in keep:
			table[b] = chr(b)
		else:
			table[b] = chr(0x100 + extra)
			extra += 1
	return table


BYTE_LEVEL = byte_level_table()


def bl(text):
	return "".join(BYTE_LEVEL[b] for b in text.encode())


# Characters whose UTF-8 bytes the merges build whole, so that words of them
# are single tokens and the pre-tokenizer's boundaries decide the ids.
WIDE = list("éüñßçàèöäÅøæ日本中文字한국어ЖдПриветαβγ١٢٣")+ ["😀", "🚀", "👍", "½", "²", "１"]
# What the random merges are drawn over: ASCII-heavy, with whitespace runs,
# digits and contractions, so that merges cross every class boundary.
MERGE_ATOMS = list("etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLC0123456789") + [
	" ", " ", " ", "\n", "\t", "\r", "'", "'s", "'t", "'re", ".", ",", "!", "?", "(", ")", "{", "}",
	"=", "-", "_", ":", ";", "/", "\\", "\"", "<", ">", "|", "#", "*", "+"] + WIDE


def vocabulary(specials, seed=7, n_merges=1500):
	"""tokens (byte-level text), token types, merges ("left right"), with the
	specials (text, type) appended after the merged tokens."""
	rng = random.Random(seed)
	tokens = [BYTE_LEVEL[b] for b in range(256)]
	index = {t: i for i, t in enumerate(tokens)}
	merges = []

	def add_merge(left, right):
		merged = left + right
		if merged in index or left not in index or right not in index:
			return False
		merges.append(f"{left} {right}")
		index[merged] = len(tokens)
		tokens.append(merged)
		return True

	def add_whole(text):
		"""Merges that build text's byte-level form left to right."""
		parts = [BYTE_LEVEL[b] for b in text.encode()]
		acc = parts[0]
		for p in parts[1:]:
			add_merge(acc, p)
			acc += p

	for ch in WIDE:
		add_whole(ch)
	pieces = [bl(a) for a in MERGE_ATOMS]
	for a in MERGE_ATOMS:
		add_whole(a)
	tries = 0
	while len(merges) < n_merges and tries < 50 * n_merges:
		tries += 1
		# grow from what exists: a recent token or an atom, joined to an atom
		if rng.random() < 0.5 and len(tokens) > 300:
			left = tokens[256 + int(rng.random() * (len(tokens) - 256))]
		else:
			left = pieces[int(rng.random() * len(pieces))]
		right = pieces[int(rng.random() * len(pieces))]
		if len(left) + len(right) <= 12:
			add_merge(left, right)
	types = [gguf.TokenType.NORMAL] * len(tokens)
	for text, kind in specials:
		tokens.append(text)
		types.append(kind)
	return tokens, types, merges


CONTROL, USER = gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED
BOS_DS, EOS_DS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

# Per family: special tokens, and which are bos/eos (None: no such token).
FAMILIES = {
	"llama-bpe": dict(specials=[("<|begin_of_text|>", CONTROL), ("<|end_of_text|>", CONTROL),
				    ("<|start_header_id|>", CONTROL), ("<|end_header_id|>", CONTROL),
				    ("<|eot_id|>", CONTROL), ("<|reserved_special_token_0|>", CONTROL)],
			  bos="<|begin_of_text|>", eos="<|end_of_text|>", add_bos=True),
	"deepseek-r1-qwen": dict(specials=[(BOS_DS, CONTROL), (EOS_DS, CONTROL), ("<｜User｜>", CONTROL),
					   ("<｜Assistant｜>", CONTROL), ("<|im_start|>", CONTROL),
					   ("<|im_end|>", CONTROL), ("<think>", USER), ("</think>", USER)],
				 bos=BOS_DS, eos=EOS_DS, add_bos=True),
	"qwen2": dict(specials=[("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL),
				("<think>", USER), ("</think>", USER), ("<tool_call>", USER)],
		      bos=None, eos="<|im_end|>", add_bos=False),
}

TEMPLATES = {
	"llama-bpe": "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
		     "{{ m['content'] | trim }}<|eot_id|>{% endfor %}",
	"deepseek-r1-qwen": "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
			    "{% endif %}<｜User｜>...<｜Assistant｜><think>\\n",
	"qwen2": "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
		 "{%- endfor %}{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>"
		 "{%- endif %}",
}


def add_tokenizer(w, pre):
	fam = FAMILIES[pre]
	tokens, types, merges = vocabulary(fam["specials"])
	w.add_tokenizer_model("gpt2")
	w.add_tokenizer_pre(pre)
	w.add_token_list(tokens)
	w.add_token_types(types)
	w.add_token_merges(merges)
	if fam["bos"]:
		w.add_bos_token_id(tokens.index(fam["bos"]))
	w.add_eos_token_id(tokens.index(fam["eos"]))
	w.add_add_bos_token(fam["add_bos"])
	w.add_chat_template(TEMPLATES[pre])
	return tokens


# ---------------------------------------------------------------- models

# arch -> (pre-tokenizer, tied output, head_dim, rope factors)
ARCHS = {
	"llama": dict(pre="llama-bpe", tied=False, head_dim=64, factors=True, base=500000.0, eps=1e-5),
	"qwen2": dict(pre="deepseek-r1-qwen", tied=True, head_dim=64, factors=False, base=1000000.0, eps=1e-6),
	"qwen3": dict(pre="qwen2", tied=False, head_dim=128, factors=False, base=1000000.0, eps=1e-6),
}
# quantisation mixes: (most matrices, attn_v/ffn_down, token_embd/output), as
# llama.cpp's Q8_0 and Q4_K_M/Q5_K_M files use them
Q = gguf.GGMLQuantizationType
MIXES = {"q8_0": (Q.Q8_0, Q.Q8_0, Q.Q8_0), "q4_k_m": (Q.Q4_K, Q.Q6_K, Q.Q6_K), "q5_k_m": (Q.Q5_K, Q.Q6_K, Q.Q6_K)}
MODELS = [("llama", "q8_0"), ("llama", "q4_k_m"), ("qwen2", "q8_0"), ("qwen2", "q4_k_m"),
	  ("qwen3", "q8_0"), ("qwen3", "q5_k_m")]
N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_LAYER, CTX = 256, 4, 2, 768, 2, 4096


def llama3_factors(n_rot, base, factor=8.0, low=1.0, high=4.0, old_ctx=8192):
	"""rope_freqs.weight as Llama 3.1's converter computes it."""
	out = []
	for i in range(0, n_rot, 2):
		freq = 1.0 / base ** (i / n_rot)
		wavelen = 2 * np.pi / freq
		if wavelen < old_ctx / high:
			out.append(1.0)
		elif wavelen > old_ctx / low:
			out.append(factor)
		else:
			smooth = (old_ctx / wavelen - low) / (high - low)
			out.append(1.0 / ((1 - smooth) / factor + smooth))
	return np.array(out, dtype=np.float32)


def write_model(path, arch, mix, seed):
	cfg = ARCHS[arch]
	hd = cfg["head_dim"]
	qd, kvd = N_HEAD * hd, N_HEAD_KV * hd
	rng = Rng(seed)
	digest = hashlib.sha256()
	w = gguf.GGUFWriter(path, arch)
	w.add_name(f"synthetic-{arch}-{mix}")
	w.add_context_length(CTX)
	w.add_embedding_length(N_EMBD)
	w.add_block_count(N_LAYER)
	w.add_feed_forward_length(N_FF)
	w.add_head_count(N_HEAD)
	w.add_head_count_kv(N_HEAD_KV)
	w.add_key_length(hd)
	w.add_value_length(hd)
	w.add_rope_dimension_count(hd)
	w.add_rope_freq_base(cfg["base"])
	w.add_layer_norm_rms_eps(cfg["eps"])
	w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if mix == "q8_0" else gguf.LlamaFileType.MOSTLY_Q4_K_M)
	tokens = add_tokenizer(w, cfg["pre"])
	n_vocab = len(tokens)
	digest.update(f"{arch} {mix} {n_vocab} {N_EMBD} {N_HEAD} {N_HEAD_KV} {hd} {N_FF} {N_LAYER}".encode())
	most, wide, embd = MIXES[mix]

	def matrix(name, rows, cols, qtype, std):
		if qtype == Q.Q8_0:
			data = q8_0(rng.normal((rows, cols)).astype(np.float32) * np.float32(std))
		else:
			data = k_blocks(rng, rows, cols, qtype, std)
		digest.update(name.encode())
		digest.update(data.tobytes())
		w.add_tensor(name, data, raw_dtype=qtype)

	def vector(name, values):
		values = np.ascontiguousarray(values, dtype=np.float32)
		digest.update(name.encode())
		digest.update(values.tobytes())
		w.add_tensor(name, values)

	matrix("token_embd.weight", n_vocab, N_EMBD, embd, 1.0 / np.sqrt(N_EMBD))
	vector("output_norm.weight", 1.0 + 0.1 * rng.normal((N_EMBD,)))
	if not cfg["tied"]:
		matrix("output.weight", n_vocab, N_EMBD, embd, 1.0 / np.sqrt(N_EMBD))
	if cfg["factors"]:
		vector("rope_freqs.weight", llama3_factors(hd, cfg["base"]))
	for l in range(N_LAYER):
		p = f"blk.{l}."
		vector(p + "attn_norm.weight", 1.0 + 0.1 * rng.normal((N_EMBD,)))
		matrix(p + "attn_q.weight", qd, N_EMBD, most, 1.0 / np.sqrt(N_EMBD))
		matrix(p + "attn_k.weight", kvd, N_EMBD, most, 1.0 / np.sqrt(N_EMBD))
		matrix(p + "attn_v.weight", kvd, N_EMBD, wide, 1.0 / np.sqrt(N_EMBD))
		if arch == "qwen2":
			vector(p + "attn_q.bias", 0.3 * rng.normal((qd,)))
			vector(p + "attn_k.bias", 0.3 * rng.normal((kvd,)))
			vector(p + "attn_v.bias", 0.3 * rng.normal((kvd,)))
		if arch == "qwen3":
			vector(p + "attn_q_norm.weight", 1.0 + 0.2 * rng.normal((hd,)))
			vector(p + "attn_k_norm.weight", 1.0 + 0.2 * rng.normal((hd,)))
		matrix(p + "attn_output.weight", N_EMBD, qd, most, 1.0 / np.sqrt(qd))
		vector(p + "ffn_norm.weight", 1.0 + 0.1 * rng.normal((N_EMBD,)))
		matrix(p + "ffn_gate.weight", N_FF, N_EMBD, most, 1.0 / np.sqrt(N_EMBD))
		matrix(p + "ffn_up.weight", N_FF, N_EMBD, most, 1.0 / np.sqrt(N_EMBD))
		matrix(p + "ffn_down.weight", N_EMBD, N_FF, wide, 1.0 / np.sqrt(N_FF))
	w.write_header_to_file()
	w.write_kv_data_to_file()
	w.write_tensors_to_file()
	w.close()
	return digest.hexdigest()


def write_vocab_only(path, pre):
	"""A GGUF with only the tokenizer (llama.cpp opens it with vocab_only)."""
	w = gguf.GGUFWriter(path, "llama")
	w.add_name(f"synthetic-vocab-{pre}")
	add_tokenizer(w, pre)
	w.write_header_to_file()
	w.write_kv_data_to_file()
	w.write_tensors_to_file()
	w.close()


# ---------------------------------------------------------------- corpus

CORPUS_ATOMS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") + list(
	" \t\n\r'\"!?.,;:-_()[]{}<>|/\\@#$%^&*+=~`") + [
	"'s", "'S", "'re", "'RE", "'ll", "'Ll", "'ve", "'m", "'M", "'d", "'D", "'t", "  ", "   ", "\n\n",
	" \n", "\r\n", "\t\t", " \t\n ", "12345", "3.14159", "1,000,000", "2026-11-27", "0x1F",
	"é", "ü", "ñ", "ß", "ç", "Å", "e\u0301", "日本", "中文字", "한국어", "Привет", "αβγ", "١٢٣", "٣",
	"😀", "🚀", "👍🏽", "👨‍👩‍👧", "\u200d", "\u00a0", "\u3000", "\u2009", "\u200b", "½", "²", "１２",
	"Ⅻ", "\x04", "\x1c", "\x85", "\u2028", "𝔸", "ǅ", "ʰ", "\U0002EBF0",
	"def f(x):\n    return x**2\n", "if (a && b) { c++; }", "http://example.org/a?b=1",
	"don't", "I'M", "we'LL", "it's", "You've", "naïve café", "über", "l'été",
]
SPECIAL_TEXTS = ["<|begin_of_text|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
		 "<｜User｜>", "<｜Assistant｜>", "<|endoftext|>"]


def corpus(n=10000, seed=2026):
	"""n (text, parse_special) pairs mixing every class the regexes tell apart."""
	rng = random.Random(seed)
	out = []
	for i in range(n):
		parts = []
		for _ in range(int(rng.random() * 24)):
			if rng.random() < 0.04:
				parts.append(SPECIAL_TEXTS[int(rng.random() * len(SPECIAL_TEXTS))])
			else:
				parts.append(CORPUS_ATOMS[int(rng.random() * len(CORPUS_ATOMS))])
		out.append(("".join(parts), i % 2))
	return out


def write_corpus(path, items):
	with open(path, "w") as f:
		for text, special in items:
			f.write(f"{special} {text.encode().hex() or '-'}\n")


def ids_hash(ids):
	"""32-bit FNV-1a over the ids as little-endian int32: what the fixtures store."""
	h = 0x811C9DC5
	for b in struct.pack(f"<{len(ids)}i", *ids):
		h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
	return h


def prompt_ids(name, n=48):
	"""The fixed prompt of model `name`: n ids among its normal tokens."""
	arch = name.split("-")[0]
	specials = FAMILIES[ARCHS[arch]["pre"]]["specials"]
	n_normal = len(vocabulary(specials)[0]) - len(specials)
	rng = random.Random(sum((i + 1) * ord(c) for i, c in enumerate(name)))
	return [int(rng.random() * n_normal) for _ in range(n)]


def write_all(out_dir):
	"""Every file; returns [(kind, name, path, digest)]."""
	os.makedirs(out_dir, exist_ok=True)
	files = []
	for i, (arch, mix) in enumerate(MODELS):
		name = f"{arch}-{mix}"
		path = os.path.join(out_dir, name + ".gguf")
		files.append(("model", name, path, write_model(path, arch, mix, seed=100 + i)))
	for pre in FAMILIES:
		path = os.path.join(out_dir, f"vocab-{pre}.gguf")
		write_vocab_only(path, pre)
		files.append(("vocab", pre, path, "-"))
	path = os.path.join(out_dir, "corpus.txt")
	write_corpus(path, corpus())
	files.append(("corpus", "corpus", path, "-"))
	return files


if __name__ == "__main__":
	if len(sys.argv) != 2:
		sys.exit(__doc__)
	for kind, name, path, digest in write_all(sys.argv[1]):
		print(kind, name, path, digest)
