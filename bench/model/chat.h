/* SPDX-License-Identifier: MIT */
/*
 * chat.h — the chat prompts of the model families the runner reads, chosen
 * from the GGUF (tokenizer.chat_template, else the architecture and the
 * vocabulary) and rendered in C, as the families' own templates render them
 * with transformers' apply_chat_template:
 *   - ChatML (SmolLM2, Qwen2.5, Qwen3): "<|im_start|>{role}\n{content}<|im_end|>\n",
 *     with the template's default system turn when the conversation has none
 *     (SmolLM2's and Qwen2.5's), and Qwen3's thinking switch;
 *   - Llama 3 / 3.1: "<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>",
 *     with 3.1's "Cutting Knowledge Date" system preamble;
 *   - DeepSeek-R1 (its Qwen and Llama distills): "<｜User｜>{content}" and
 *     "<｜Assistant｜>{content}<｜end▁of▁sentence｜>", the system text first.
 * The tokenizer adds BOS (tokenizer.ggml.add_bos_token), so no rendering
 * starts with one. Reasoning models' earlier answers lose their
 * "<think>...</think>" part, as their templates do.
 *
 * Threads: pure functions over their arguments.
 */
#ifndef KVR_MODEL_CHAT_H
#define KVR_MODEL_CHAT_H

#include <stddef.h>

#include "tokenizer.h"

enum chat_style {
	CHAT_CHATML = 0,
	CHAT_LLAMA3 = 1,
	CHAT_DEEPSEEK_R1 = 2,
};

struct chat_format {
	enum chat_style style;
	const char *default_system; /* the system turn added when there is none; NULL: none */
	int thinking;               /* 1: a reasoning model with a thinking turn (Qwen3, R1) */
	int llama31_preamble;       /* 1: Llama 3.1's dated system header */
};

/* The format of a model: from its tokenizer.chat_template text (tmpl, len
 * bytes; NULL when the file has none), else from general.architecture and
 * the vocabulary t (Llama 3's header tokens). Never fails: ChatML is the
 * fallback. */
void chat_detect(const char *tmpl, size_t len, const char *arch, const struct tok *t,
		 struct chat_format *f);

/* "chatml", "llama3", "deepseek-r1" */
const char *chat_style_name(enum chat_style style);

/* Render msgs (roles "system", "user", "assistant") in format f, ending
 * with the assistant's turn when add_generation_prompt. think: -1 the
 * template's default (thinking on), 0 off (an empty thinking block opens the
 * answer, as Qwen3's enable_thinking=false does), 1 on (R1's "<think>\n").
 * NUL-terminated when room is left. Returns 0 and the length in *len;
 * -ENOSPC with the needed length in *len; -EINVAL for a NULL role or
 * content or an unknown role. Encode the result with parse_special = 1. */
int chat_render(const struct chat_format *f, const struct tok_message *msgs, size_t n,
		int add_generation_prompt, int think, char *out, size_t out_bytes, size_t *len);

#endif /* KVR_MODEL_CHAT_H */
