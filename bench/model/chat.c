/* SPDX-License-Identifier: MIT */
/*
 * chat.c — chat prompt formats (chat.h): detection from the GGUF and
 * rendering. The templates themselves are Jinja programs; the runner does
 * not interpret them but recognises the family by the markers each one
 * holds and writes the same text. tests/test_tokenizer.c checks SmolLM2's
 * against its real template's renderings (tests/data/tokenizer/cases.txt)
 * and the other families against their published prompt formats.
 *
 * Threads: pure functions.
 */
#include "chat.h"

#include <errno.h>
#include <string.h>

#define THINK_OPEN "<think>"
#define THINK_CLOSE "</think>"
#define R1_USER "<\xef\xbd\x9c" "User\xef\xbd\x9c>"                       /* <｜User｜> */
#define R1_ASSISTANT "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>"             /* <｜Assistant｜> */
#define R1_END "<\xef\xbd\x9c" "end\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>"

static const char smollm_system[] = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";
static const char qwen25_system[] = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

static int has(const char *s, size_t len, const char *needle)
{
	return s && memmem(s, len, needle, strlen(needle)) != NULL;
}

void chat_detect(const char *tmpl, size_t len, const char *arch, const struct tok *t,
		 struct chat_format *f)
{
	memset(f, 0, sizeof(*f));
	if (has(tmpl, len, "<|start_header_id|>")) {
		f->style = CHAT_LLAMA3;
		f->llama31_preamble = has(tmpl, len, "Cutting Knowledge Date");
		return;
	}
	if (has(tmpl, len, R1_ASSISTANT)) {
		f->style = CHAT_DEEPSEEK_R1;
		f->thinking = 1;
		return;
	}
	if (has(tmpl, len, "<|im_start|>")) {
		f->style = CHAT_CHATML;
		f->default_system = has(tmpl, len, smollm_system)   ? smollm_system
				    : has(tmpl, len, qwen25_system) ? qwen25_system
								    : NULL;
		f->thinking = has(tmpl, len, "enable_thinking");
		return;
	}
	/* no template, or one of another family: by what the model is */
	if (arch && !strcmp(arch, "qwen3")) {
		f->style = CHAT_CHATML;
		f->thinking = 1;
	} else if (t && tok_find(t, "<|start_header_id|>", 19) >= 0) {
		f->style = CHAT_LLAMA3;
	} else if (t && tok_find(t, R1_ASSISTANT, strlen(R1_ASSISTANT)) >= 0) {
		f->style = CHAT_DEEPSEEK_R1;
		f->thinking = 1;
	} else {
		f->style = CHAT_CHATML;
	}
}

const char *chat_style_name(enum chat_style style)
{
	switch (style) {
	case CHAT_CHATML:
		return "chatml";
	case CHAT_LLAMA3:
		return "llama3";
	case CHAT_DEEPSEEK_R1:
		return "deepseek-r1";
	}
	return "?";
}

struct writer {
	char *out;
	size_t cap, len;
};

static void put_n(struct writer *w, const char *s, size_t n)
{
	if (w->len < w->cap)
		memcpy(w->out + w->len, s, w->len + n <= w->cap ? n : w->cap - w->len);
	w->len += n;
}

static void put(struct writer *w, const char *s)
{
	put_n(w, s, strlen(s));
}

/* Llama 3's template trims each message's content (Jinja's trim: whitespace
 * at both ends). */
static void put_trimmed(struct writer *w, const char *s)
{
	size_t a = 0, b = strlen(s);
	while (a < b && strchr(" \t\n\r\f\v", s[a]))
		a++;
	while (b > a && strchr(" \t\n\r\f\v", s[b - 1]))
		b--;
	put_n(w, s + a, b - a);
}

/* An earlier answer of a reasoning model: what follows its last
 * "</think>", leading newlines dropped (Qwen3's and R1's templates). */
static void put_answer(struct writer *w, const char *s, int thinking)
{
	const char *answer = s;
	for (const char *p = s; thinking && (p = strstr(p, THINK_CLOSE)); p += strlen(THINK_CLOSE))
		answer = p + strlen(THINK_CLOSE);
	if (answer != s)
		while (*answer == '\n')
			answer++;
	put(w, answer);
}

int chat_render(const struct chat_format *f, const struct tok_message *msgs, size_t n,
		int add_generation_prompt, int think, char *out, size_t out_bytes, size_t *len)
{
	struct writer w = { out, out ? out_bytes : 0, 0 };
	*len = 0;
	for (size_t i = 0; i < n; i++)
		if (!msgs[i].role || !msgs[i].content ||
		    (strcmp(msgs[i].role, "system") && strcmp(msgs[i].role, "user") &&
		     strcmp(msgs[i].role, "assistant")))
			return -EINVAL;
	const int first_system = n && !strcmp(msgs[0].role, "system");
	switch (f->style) {
	case CHAT_CHATML:
		if (n && !first_system && f->default_system) {
			put(&w, "<|im_start|>system\n");
			put(&w, f->default_system);
			put(&w, "<|im_end|>\n");
		}
		for (size_t i = 0; i < n; i++) {
			put(&w, "<|im_start|>");
			put(&w, msgs[i].role);
			put(&w, "\n");
			if (!strcmp(msgs[i].role, "assistant"))
				put_answer(&w, msgs[i].content, f->thinking);
			else
				put(&w, msgs[i].content);
			put(&w, "<|im_end|>\n");
		}
		if (add_generation_prompt) {
			put(&w, "<|im_start|>assistant\n");
			if (f->thinking && think == 0)
				put(&w, THINK_OPEN "\n\n" THINK_CLOSE "\n\n");
		}
		break;
	case CHAT_LLAMA3: {
		size_t i = 0;
		if (f->llama31_preamble) {
			put(&w, "<|start_header_id|>system<|end_header_id|>\n\n"
				"Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n");
			if (first_system)
				put_trimmed(&w, msgs[i++].content);
			put(&w, "<|eot_id|>");
		}
		for (; i < n; i++) {
			put(&w, "<|start_header_id|>");
			put(&w, msgs[i].role);
			put(&w, "<|end_header_id|>\n\n");
			put_trimmed(&w, msgs[i].content);
			put(&w, "<|eot_id|>");
		}
		if (add_generation_prompt)
			put(&w, "<|start_header_id|>assistant<|end_header_id|>\n\n");
		break;
	}
	case CHAT_DEEPSEEK_R1:
		for (size_t i = 0; i < n; i++)
			if (!strcmp(msgs[i].role, "system"))
				put(&w, msgs[i].content);
		for (size_t i = 0; i < n; i++) {
			if (!strcmp(msgs[i].role, "user")) {
				put(&w, R1_USER);
				put(&w, msgs[i].content);
			} else if (!strcmp(msgs[i].role, "assistant")) {
				put(&w, R1_ASSISTANT);
				put_answer(&w, msgs[i].content, 1);
				put(&w, R1_END);
			}
		}
		if (add_generation_prompt) {
			put(&w, R1_ASSISTANT);
			put(&w, think == 0 ? THINK_OPEN "\n\n" THINK_CLOSE "\n\n" : THINK_OPEN "\n");
		}
		break;
	}
	*len = w.len;
	if (out && w.len < out_bytes)
		out[w.len] = '\0';
	return w.len > w.cap ? -ENOSPC : 0;
}
