/* SPDX-License-Identifier: MIT */
/*
 * runner.h — the `kvrecall generate` subcommand: a Llama-architecture GGUF
 * model (SmolLM2-135M-Instruct by default) generating text on the CPU with
 * its attention through kvrecall, as an inference engine would run it.
 *
 * Threads: the calling thread drives everything (the model's pool and
 * kvrecall's own threads work beneath it).
 */
#ifndef KVR_MODEL_RUNNER_H
#define KVR_MODEL_RUNNER_H

#include <stddef.h>

/* argv without the subcommand's name; returns the process exit status
 * (0 ok or --help shown on stdout, 1 failure, 2 usage). */
int runner_generate(int argc, char **argv);
/* `kvrecall eval`: teacher-forced perplexity and top-1 agreement with dense. */
int runner_eval(int argc, char **argv);

struct gguf;
struct tok;
/* The tokenizer described by a GGUF's tokenizer.ggml.* keys. */
int runner_tokenizer(const struct gguf *g, struct tok **out, char *err, size_t err_bytes);

#endif /* KVR_MODEL_RUNNER_H */
