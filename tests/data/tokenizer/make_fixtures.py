#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
#
# make_fixtures.py — writes tests/data/tokenizer/cases.txt: the token ids that
# two established tokenizers give SmolLM2-135M-Instruct's vocabulary for fixed
# strings, and the ChatML prompts its GGUF chat template renders. test_tokenizer.c
# checks bench/model/tokenizer.c against them. See README.md beside this file.
#
# References (both must agree on every case that both can run, else this
# script fails):
#   - llama.cpp, through llama-cpp-python: Llama(path, vocab_only=True)
#     .tokenize(text, add_bos=False, special=...). This is what the ids must
#     match: the runner is compared with llama.cpp.
#   - Hugging Face `tokenizers`: a byte-level BPE built from the GGUF's own
#     tokens and merges (read with gguf-py), pre-tokenizer
#     Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False,
#     use_regex=True)], the 17 control tokens added as special tokens. It takes
#     only valid Unicode and always matches added tokens, so it checks the
#     cases with parse_special = 1 and valid UTF-8.
# The chat prompts are rendered with jinja2 from the GGUF's
# tokenizer.chat_template (as transformers' apply_chat_template does).
#
#   python3 -m venv /tmp/tokvenv
#   CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" /tmp/tokvenv/bin/pip install \
#       gguf==0.19.0 tokenizers==0.23.3 llama-cpp-python==0.3.36 jinja2==3.1.6
#   /tmp/tokvenv/bin/python tests/data/tokenizer/make_fixtures.py [model.gguf]
#
# Output format (one record per line, fields separated by one space; text in
# hex so that any bytes fit, "-" for the empty string):
#   enc NAME PARSE_SPECIAL TEXT_HEX N ID...
#   chat NAME ADD_GENERATION_PROMPT N_MSGS ROLE_HEX CONTENT_HEX ... RENDERED_HEX
import os
import sys
from importlib.metadata import version

import gguf
import jinja2
import tokenizers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

HERE = os.path.dirname(os.path.abspath(__file__))
GPL3 = "/usr/share/common-licenses/GPL-3"


def model_path():
	if len(sys.argv) > 1:
		return sys.argv[1]
	if os.environ.get("KVR_MODEL_PATH"):
		return os.environ["KVR_MODEL_PATH"]
	cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
	return os.path.join(cache, "kvrecall", "SmolLM2-135M-Instruct.Q4_1.gguf")


def field(reader, name):
	return reader.fields[name].contents()


def cases():
	gpl = open(GPL3, "rb").read()
	# a ~2 KB paragraph: the start of the Preamble, cut at a line end
	start = gpl.index(b"                            Preamble")
	para = gpl[start:start + 2048]
	para = para[:para.rindex(b"\n") + 1]
	c = [
		("empty", 0, b""),
		("ascii", 0, b"Hello world! This is a test of the tokenizer."),
		("sentence", 0, b"The quick brown fox jumps over the lazy dog."),
		("contractions", 0, b"It's what we're doing, they'll see; I've, I'm, he'd, don't."),
		("contractions_upper", 0, b"IT'S WE'RE THEY'LL I'VE I'M HE'D DON'T"),
		("apostrophes", 0, b"'s 'll've a'b '' rock 'n' roll"),
		("digits", 0, b"12345"),
		("pi", 0, b"3.14159"),
		("date", 0, b"2024-11-22"),
		("numbers_mixed", 0, b"abc123def 1,000,000 $5.99 0x1F 42nd v2.0"),
		("spaces_multi", 0, b"a  b   c    d"),
		("spaces_lead", 0, b"   leading"),
		("spaces_trail", 0, b"trailing   "),
		("space_digit", 0, b"x  1 2"),
		("tabs", 0, b"a\tb\t\tc\t"),
		("newlines", 0, b"line one\nline two\n\n\nline five\n"),
		("newlines_only", 0, b"\n\n\n"),
		("crlf", 0, b"one\r\ntwo\r\n"),
		("ws_mix", 0, b" \n \t x \n"),
		("accents", 0, "café naïve résumé Ölçü Ångström".encode()),
		("cjk", 0, "日本語のテキストです。中文测试".encode()),
		("korean", 0, "한국어 텍스트".encode()),
		("cyrillic", 0, "Привет, мир! Как дела?".encode()),
		("arabic", 0, "مرحبا بالعالم".encode()),
		("hebrew_greek", 0, "שלום ελληνικά".encode()),
		("emoji", 0, "I love 🚀 and 👍🏽!".encode()),
		("emoji_zwj", 0, "family: 👨‍👩‍👧".encode()),
		("combining", 0, "e\u0301 a\u0308 n\u0303o".encode()),
		("unicode_numbers", 0, "½ Ⅻ ١٢٣ １２３ ²".encode()),
		("unicode_spaces", 0, "a\u00a0b\u3000c\u2009d\u200be".encode()),
		("control_char", 0, b"a\x04b\x7fc"),
		("code_python", 0, b"def square(x):\n    return x ** 2  # the square\n\nprint(square(12))\n"),
		("code_c", 0, b"int main(void)\n{\n\tprintf(\"%d\\n\", a[i] >> 2);\n\treturn 0;\n}\n"),
		("url", 0, b"See https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct?x=1&y=2."),
		("punct_runs", 0, b"Wait... what?!? (yes) [no] {maybe} <html> --> ==="),
		("special_as_text", 0, b"<|im_start|>user\nHi<|im_end|>"),
		("special_parsed", 1, b"<|im_start|>user\nHi<|im_end|>"),
		("special_chat", 1, b"<|im_start|>system\nYou are nice.<|im_end|>\n<|im_start|>user\n"
					 b"What is 2+2?<|im_end|>\n<|im_start|>assistant\n"),
		("special_adjacent", 1, b"<|im_start|><|im_end|><|endoftext|>"),
		("special_inside_word", 1, b"abc<|endoftext|>def <jupyter_code>print(1)<empty_output>"),
		("special_partial", 1, b"<|im_start <|im_end|x <|im_start|"),
		("special_text_plain", 1, b"Just text, no specials. 123"),
		("gpl3_paragraph", 0, para),
		("gpl3_full", 0, gpl),
	]
	return c


def chats():
	return [
		("hello", 1, [("user", "Hello")]),
		("hello_nogen", 0, [("user", "Hello")]),
		("system_given", 1, [("system", "You are terse."), ("user", "Hi"),
					 ("assistant", "Hello."), ("user", "2+2?")]),
		("multi_turn", 1, [("user", "What is the capital of France?"),
				       ("assistant", "Paris."), ("user", "And of Italy?\nThanks")]),
		("empty", 1, []),
	]


def hexs(b):
	return b.hex() if b else "-"


def main():
	path = model_path()
	r = gguf.GGUFReader(path)
	tokens = field(r, "tokenizer.ggml.tokens")
	types = field(r, "tokenizer.ggml.token_type")
	merges = field(r, "tokenizer.ggml.merges")
	template = field(r, "tokenizer.chat_template")
	assert field(r, "tokenizer.ggml.model") == "gpt2" and field(r, "tokenizer.ggml.pre") == "smollm"

	hf = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
				  merges=[tuple(m.split(" ", 1)) for m in merges],
				  unk_token=None, byte_fallback=False, fuse_unk=False))
	hf.pre_tokenizer = pre_tokenizers.Sequence([
		pre_tokenizers.Digits(individual_digits=True),
		pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
	hf.decoder = decoders.ByteLevel()
	hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
			       for i in range(len(tokens)) if types[i] == 3])

	from llama_cpp import Llama
	import llama_cpp
	llm = Llama(model_path=path, vocab_only=True, verbose=False)

	out = []
	out.append("# generated by tests/data/tokenizer/make_fixtures.py; see README.md")
	out.append(f"# model {os.path.basename(path)}")
	out.append(f"# llama-cpp-python {llama_cpp.__version__} (reference ids), "
		   f"tokenizers {tokenizers.__version__} (cross-check), gguf {version('gguf')}, "
		   f"jinja2 {jinja2.__version__}")
	n_hf = 0
	for name, special, text in cases():
		ids = llm.tokenize(text, add_bos=False, special=bool(special)) if text else []
		try:
			u = text.decode("utf-8")
		except UnicodeDecodeError:
			u = None
		if special and u is not None:
			h = hf.encode(u, add_special_tokens=False).ids
			if h != ids:
				sys.exit(f"make_fixtures: {name}: llama.cpp {ids} != tokenizers {h}")
			n_hf += 1
		elif u is not None and not any(tokens[i] in u for i in range(len(tokens))
						 if types[i] == 3):
			# no added token occurs: the HF tokenizer's result holds for either mode
			h = hf.encode(u, add_special_tokens=False).ids
			if h != ids:
				sys.exit(f"make_fixtures: {name}: llama.cpp {ids} != tokenizers {h}")
			n_hf += 1
		out.append(f"enc {name} {special} {hexs(text)} {len(ids)} " + " ".join(map(str, ids)))

	env = jinja2.Environment()
	tmpl = env.from_string(template)
	for name, gen, msgs in chats():
		rendered = tmpl.render(messages=[{"role": a, "content": b} for a, b in msgs],
				       add_generation_prompt=bool(gen)).encode()
		fields = [f"chat {name} {gen} {len(msgs)}"]
		for role, content in msgs:
			fields += [hexs(role.encode()), hexs(content.encode())]
		fields.append(hexs(rendered))
		out.append(" ".join(fields))
		ids = llm.tokenize(rendered, add_bos=False, special=True) if rendered else []
		h = hf.encode(rendered.decode(), add_special_tokens=False).ids
		if h != ids:
			sys.exit(f"make_fixtures: chat {name}: llama.cpp {ids} != tokenizers {h}")
		n_hf += 1
		out.append(f"enc chat_{name} 1 {hexs(rendered)} {len(ids)} " + " ".join(map(str, ids)))

	with open(os.path.join(HERE, "cases.txt"), "w") as f:
		f.write("\n".join(out) + "\n")
	n_enc = sum(1 for line in out if line.startswith("enc "))
	print(f"make_fixtures: {len(out) - 3} records, {n_hf} of {n_enc} enc records "
	      f"cross-checked with tokenizers", file=sys.stderr)
	print(f"make_fixtures: llama-cpp-python {llama_cpp.__version__}",
	      file=sys.stderr)


if __name__ == "__main__":
	main()
