/* SPDX-License-Identifier: MIT */
/*
 * tokenizer.h — the byte-level BPE tokenizer of the real-model runner
 * (GGUF tokenizer.ggml.model = "gpt2"), as llama.cpp runs it: control tokens
 * found in the text first, then the pre-tokenizer named by tokenizer.ggml.pre
 * ("smollm": every digit its own piece, then the GPT-2 regex; "gpt2";
 * "llama-bpe": Llama 3's regex, digits in threes, and a word that is a token
 * kept whole; "qwen2" and "deepseek-r1-qwen": Llama 3's regex with single
 * digits), then BPE merges by rank inside each piece. Also decoding (whole
 * sequences, or token by token for streaming); chat templates are chat.h's.
 *
 * The vocabulary comes in as plain arrays (struct tok_vocab), so this file
 * does not depend on the GGUF reader; tok_create copies what it needs.
 *
 * Errors: 0 or a negative errno. tok_create also writes a message.
 * Threads: a struct tok is immutable after tok_create, so any number of
 * threads may encode and decode with one at once; each call allocates its own
 * scratch. A struct tok_stream belongs to one thread at a time.
 */
#ifndef KVR_MODEL_TOKENIZER_H
#define KVR_MODEL_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

/* GGUF tokenizer.ggml.token_type values (llama.cpp's llama_token_type). */
enum tok_type {
	TOK_TYPE_UNDEFINED = 0,
	TOK_TYPE_NORMAL = 1,
	TOK_TYPE_UNKNOWN = 2,
	TOK_TYPE_CONTROL = 3,      /* <|im_start|>: matched in text only when asked */
	TOK_TYPE_USER_DEFINED = 4, /* always matched in text, always printed */
	TOK_TYPE_UNUSED = 5,
	TOK_TYPE_BYTE = 6,
};

struct tok_str {
	const char *ptr;
	size_t len;
};

/* What a GGUF file says about its tokenizer, as arrays the caller owns. */
struct tok_vocab {
	const char *model;             /* tokenizer.ggml.model; NULL is taken as "gpt2" */
	const char *pre;               /* tokenizer.ggml.pre: "smollm" or "gpt2" */
	size_t n_tokens;
	const struct tok_str *tokens;  /* token text, byte-level form ("Ġthe" for " the") */
	const int32_t *types;          /* enum tok_type per token; NULL: all normal */
	size_t n_merges;
	const struct tok_str *merges;  /* "left right", highest priority first */
	int32_t bos_id, eos_id, unk_id; /* -1 when the file has none */
	int add_bos;                   /* tokenizer.ggml.add_bos_token */
	/* more ids that end generation (tokenizer.ggml.eot_token_id, eom_token_id);
	 * ids out of range are ignored */
	int32_t eog_ids[4];
	size_t n_eog_ids;
};

struct tok;

/* Build a tokenizer from *v (copied; v's arrays may be freed afterwards).
 * Returns 0, or -EINVAL (a malformed vocabulary: a merge naming a token that
 * does not exist, an id out of range), -ENOTSUP (another tokenizer model or
 * pre-tokenizer), -ENOMEM; err says which. */
int tok_create(const struct tok_vocab *v, struct tok **out, char *err, size_t err_bytes);
void tok_destroy(struct tok *t);

/* Encode text[0..len) (any bytes; not NUL-terminated) into token ids.
 * parse_special: control tokens written in the text ("<|im_start|>") become
 * their single id, as llama.cpp's tokenize(..., parse_special = true);
 * otherwise they are ordinary text. No BOS is added (tok_add_bos says whether
 * the model wants one in front of a prompt). Bytes of invalid UTF-8 are
 * encoded as bytes; a byte the vocabulary has no token for (SmolLM2 lacks 21 of
 * 256, e.g. 0xFF) is dropped, as llama.cpp drops it. Returns 0 and the count in
 * *n_ids; -ENOSPC when more than max_ids ids result, with the full count in
 * *n_ids and the first max_ids written (ids may be NULL with max_ids 0 to
 * count); -ENOMEM. */
int tok_encode(const struct tok *t, const char *text, size_t len, int parse_special,
	       int32_t *ids, size_t max_ids, size_t *n_ids);

/* Decode ids to bytes in out, control tokens included as their text (so
 * decode(encode(s, parse_special)) == s). NUL-terminated when room is left.
 * Returns 0 and the length in *out_len; -ENOSPC with the needed length in
 * *out_len (out then holds nothing useful); -EINVAL for an id out of range. */
int tok_decode(const struct tok *t, const int32_t *ids, size_t n, char *out, size_t out_bytes,
	       size_t *out_len);

/* The bytes one token stands for (not NUL-terminated; may be part of a UTF-8
 * sequence). special: print control tokens as their text, else as nothing.
 * Returns 0, -ENOSPC (needed length in *len), -EINVAL (id out of range). */
int tok_piece(const struct tok *t, int32_t id, int special, char *out, size_t out_bytes,
	      size_t *len);

/* Streaming output: feed generated ids one at a time; each call writes the
 * bytes ready for printing. An unfinished UTF-8 sequence at the end of a piece
 * (an emoji split over two tokens) is held back until the next piece completes
 * it; bytes that can never be valid are passed through. All pushes followed by
 * a flush write exactly the bytes tok_decode would (special = 1). out_bytes of
 * tok_max_piece_bytes(t) + 3 always suffice. On -ENOSPC (*len: the needed
 * size) or -EINVAL the stream is unchanged. */
struct tok_stream {
	unsigned char pending[3];
	uint8_t n_pending;
	uint8_t special;
};
void tok_stream_init(struct tok_stream *s, int special);
int tok_stream_push(const struct tok *t, struct tok_stream *s, int32_t id, char *out,
		    size_t out_bytes, size_t *len);
/* Write what is still held back (an unfinished sequence at the end of output). */
int tok_stream_flush(struct tok_stream *s, char *out, size_t out_bytes, size_t *len);

/* A chat turn; role and content are NUL-terminated. */
struct tok_message {
	const char *role; /* "system", "user", "assistant" */
	const char *content;
};

/* Render SmolLM2-Instruct's ChatML prompt (its GGUF tokenizer.chat_template):
 * "<|im_start|>{role}\n{content}<|im_end|>\n" per message, preceded by
 * the default system turn ("You are a helpful AI assistant named SmolLM,
 * trained by Hugging Face") when the first message is not a system message,
 * and followed by "<|im_start|>assistant\n" when add_generation_prompt.
 * Encode the result with parse_special = 1. NUL-terminated when room is left.
 * Returns 0 and the length in *len; -ENOSPC with the needed length in *len;
 * -EINVAL for a NULL role or content. */
int tok_chat_template(const struct tok_message *msgs, size_t n, int add_generation_prompt,
		      char *out, size_t out_bytes, size_t *len);

/* The pre-tokenizer alone over text[0..len) (no special tokens, no BPE): the
 * byte offset where each piece ends, in order. For tests and benchmarks.
 * Returns 0 and the count in *n_ends; -ENOSPC (full count in *n_ends, the
 * first max_ends written), -EINVAL, -EOVERFLOW, -ENOMEM. */
int tok_pretokenize(const struct tok *t, const char *text, size_t len, uint32_t *ends,
		    size_t max_ends, size_t *n_ends);
/* 1 when id ends generation: eos, the vocabulary's eog_ids, and the control
 * tokens that end a turn in the families read (<|eot_id|>, <|im_end|>,
 * <|endoftext|>, <｜end▁of▁sentence｜>, ...), as llama.cpp's set. */
int tok_is_eog(const struct tok *t, int32_t id);
/* The pre-tokenizer's name ("llama-bpe", "qwen2", ...). */
const char *tok_pre_name(const struct tok *t);

size_t tok_n_tokens(const struct tok *t);
int32_t tok_bos(const struct tok *t);  /* -1 if none */
int32_t tok_eos(const struct tok *t);  /* -1 if none; generation stops on it */
int tok_add_bos(const struct tok *t);  /* 1: put tok_bos in front of a prompt */
int tok_type(const struct tok *t, int32_t id); /* enum tok_type, -EINVAL out of range */
/* The id whose text (byte-level form, as in the vocabulary) is text[0..len), or -1. */
int32_t tok_find(const struct tok *t, const char *text, size_t len);
/* The longest piece any token decodes to, in bytes. */
size_t tok_max_piece_bytes(const struct tok *t);

#endif /* KVR_MODEL_TOKENIZER_H */
