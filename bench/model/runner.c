/* SPDX-License-Identifier: MIT */
/*
 * runner.c — `kvrecall generate` (runner.h): options, the tokenizer built from
 * the GGUF's metadata, the prompt (raw text, a chat message, or a document
 * and a question in the model's chat template), prefill and streamed decode
 * through kvrecall, and the statistics a user compares modes by.
 *
 * Threads: the caller's.
 */
#include "runner.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../cli_args.h"
#include "chat.h"
#include "gguf.h"
#include "kvrecall.h"
#include "model.h"
#include "sample.h"
#include "tokenizer.h"

struct opts {
	const char *cmd; /* "kvrecall generate" or "kvrecall eval": what errors name */
	const char *model, *prompt, *chat, *file, *question, *json;
	uint32_t max_tokens, threads, budget, sink, window, mode, kv_format, recall;
	uint32_t estimate; /* config estimate: the pages not retrieved, estimated (sparse modes) */
	float tau, temperature, top_p;
	uint32_t top_k; /* 0: off */
	uint64_t seed;
	int ignore_eos, compare, quiet, have_tau, have_budget, have_sink, have_window;
	int think;               /* -1: the chat template's default, 0 off, 1 on */
	int beyond_context;      /* run past the model's trained context */
	uint32_t modes[4];       /* --compare LIST: the runs, in order */
	uint32_t n_modes;
	uint32_t timeline;       /* tokens per point of the speed-against-position record */
};

#define GENERATE_CMD "kvrecall generate"
#define EVAL_CMD "kvrecall eval"

static void generate_usage(FILE *f)
{
	fprintf(f,
		"usage: kvrecall generate [options]\n"
		"  --model PATH        a GGUF of architecture llama (Llama 1-3, SmolLM2), qwen2\n"
		"                      (Qwen2.5, DeepSeek-R1-Distill-Qwen) or qwen3 (default:\n"
		"                      SmolLM2-135M-Instruct Q4_1 in the model cache; fetched on first use)\n"
		"  --prompt TEXT       raw prompt, no chat template\n"
		"  --chat TEXT         one user message in the model's chat template (ChatML,\n"
		"                      Llama 3 or DeepSeek-R1, chosen from the GGUF)\n"
		"  --think on|off      reasoning models (Qwen3, R1 distills): let the answer open\n"
		"                      with its thinking (on, the default) or an empty thinking block\n"
		"  --file PATH         a document as context (with --question: asked about it)\n"
		"  --question TEXT     the question about --file\n"
		"  --max-tokens N      tokens to generate (default 256)\n"
		"  --ignore-eos        keep generating past the end-of-turn token\n"
		"  --beyond-context    let prompt + generation run past the model's trained\n"
		"                      context_length (refused, or generation stopped there, otherwise)\n"
		"  --mode M            dense | blocking | speculative | freekv (default freekv)\n"
		"  --kv-format F       KV pages: f16 | k8v4 | k4v2 | mixed (default f16)\n"
		"  --recall R          auto | zero-copy | streamed (default auto: zero-copy on the\n"
		"                      cpu; streamed keeps a device page cache, as on a GPU)\n"
		"  --budget B --sink S --window W --tau T   kvrecall's selection (defaults: B 2048,\n"
		"                      S = W = 512 or B/4 when smaller, tau 0.9; tau from -1 to 1)\n"
		"  --estimate on|off   add the estimate of the pages not retrieved (their mean key\n"
		"                      and value, p tokens each) to sparse attention (default off)\n"
		"  --temperature T --top-k K --top-p P --seed N   sampling (default greedy: T 0;\n"
		"                      T >= 0; K most probable tokens, 0 for all (default);\n"
		"                      P above 0 and at most 1, of the top K's mass; seed 42)\n"
		"  --threads N         workers besides the main thread, 0 to 1024 (default: cores - 1)\n"
		"  --compare [LIST]    also generate densely (f16 pages) and report where the\n"
		"                      outputs diverge; with a LIST (dense,freekv) run exactly those\n"
		"                      modes in turn, the first streamed, and print tokens/s against\n"
		"                      position for each (the long-generation view)\n"
		"  --timeline N        tokens per point of the speed-against-position record\n"
		"                      (default 256; in --json as each run's \"timeline\")\n"
		"  --quiet             no streamed text; statistics only\n"
		"  --json FILE         statistics as JSON\n");
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A progress line on stderr. On a terminal it is rewritten in place (and
 * progress_end closes it with a newline); on a pipe or a file, where carriage
 * returns and escape codes would land in the log as they are, each update is
 * a plain line of its own, at most one every PROGRESS_FILE_S seconds. */
#define PROGRESS_FILE_S 10.0

struct progress {
	int tty, shown;
	double last;
};

static void progress_init(struct progress *p)
{
	p->tty = isatty(STDERR_FILENO);
	p->shown = 0;
	p->last = -1e30;
}

static void progress_printf(struct progress *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void progress_printf(struct progress *p, const char *fmt, ...)
{
	if (!p->tty) {
		const double now = now_s();
		if (now - p->last < PROGRESS_FILE_S)
			return;
		p->last = now;
	}
	va_list ap;
	va_start(ap, fmt);
	if (p->tty)
		fputs("\r\033[2K", stderr);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	if (!p->tty)
		fputc('\n', stderr);
	fflush(stderr);
	p->shown = 1;
}

static void progress_end(struct progress *p)
{
	if (p->tty && p->shown)
		fputc('\n', stderr);
	p->shown = 0;
}

/* parse_*'s answer when the command is to run; any other is the exit status
 * to stop with (CLI_EXIT_OK after --help). */
#define PARSE_RUN (-1)

static void opts_init(struct opts *o, const char *cmd)
{
	memset(o, 0, sizeof(*o));
	o->cmd = cmd;
	o->max_tokens = 256;
	o->mode = KVR_MODE_FREEKV;
	o->top_p = 1.0f;
	o->seed = 42;
	o->think = -1;
	o->timeline = 256;
	const long cores = sysconf(_SC_NPROCESSORS_ONLN);
	o->threads = cores > 1 ? (uint32_t)(cores - 1) : 0;
}

/* The options generate and eval share: the model, its threads, kvrecall's
 * selection and recall, the JSON file, quiet. The cli_opt_* convention: 1
 * taken, 0 another option, -1 after a message. */
static int shared_option(int argc, char **argv, int *i, struct opts *o)
{
	const char *cmd = o->cmd;
	int r;
	if (!strcmp(argv[*i], "--quiet")) {
		o->quiet = 1;
		return 1;
	}
	if ((r = cli_opt_str(cmd, argc, argv, i, "--model", &o->model)) ||
	    (r = cli_opt_str(cmd, argc, argv, i, "--json", &o->json)) ||
	    (r = cli_opt_u32(cmd, argc, argv, i, "--threads", 0, 1024, &o->threads)) ||
	    /* the names' order is KVR_RECALL_AUTO, _ZERO_COPY, _STREAMED */
	    (r = cli_opt_choice(cmd, argc, argv, i, "--recall", cli_recall_names, &o->recall)))
		return r;
	if ((r = cli_opt_u32(cmd, argc, argv, i, "--budget", 1, UINT32_MAX, &o->budget)))
		o->have_budget = 1;
	else if ((r = cli_opt_u32(cmd, argc, argv, i, "--sink", 0, UINT32_MAX - 1, &o->sink)))
		o->have_sink = 1;
	else if ((r = cli_opt_u32(cmd, argc, argv, i, "--window", 0, UINT32_MAX - 1, &o->window)))
		o->have_window = 1;
	else if ((r = cli_opt_float(cmd, argc, argv, i, "--tau", -1, 1, 0, &o->tau)))
		o->have_tau = 1;
	return r;
}

/* --mode M, or --compare's list: a mode other than auto. */
static int opt_mode(int argc, char **argv, int *i, struct opts *o)
{
	if (strcmp(argv[*i], "--mode"))
		return 0;
	const char *v = cli_value_of(o->cmd, argc, argv, i);
	if (!v)
		return -1;
	if (cli_mode_parse(v, &o->mode))
		return cli_bad_choice(o->cmd, "--mode", v, cli_mode_names);
	return 1;
}

static int opt_kv_format(int argc, char **argv, int *i, struct opts *o)
{
	if (strcmp(argv[*i], "--kv-format"))
		return 0;
	const char *v = cli_value_of(o->cmd, argc, argv, i);
	if (!v)
		return -1;
	if (kvr_kv_format_parse(v, &o->kv_format))
		return cli_bad_choice(o->cmd, "--kv-format", v, cli_kv_format_names);
	return 1;
}

/* --compare [LIST]: a list follows unless the next argument is an option. */
static int opt_compare(int argc, char **argv, int *i, struct opts *o)
{
	if (strcmp(argv[*i], "--compare"))
		return 0;
	o->compare = 1;
	if (*i + 1 >= argc || argv[*i + 1][0] == '-')
		return 1;
	++*i;
	if (cli_parse_name_list(o->cmd, "--compare", argv[*i], cli_mode_parse, cli_mode_names, o->modes, 4,
				&o->n_modes))
		return -1;
	return 1;
}

/* --estimate and --think: off or on. */
static int opt_off_on(int argc, char **argv, int *i, struct opts *o, const char *name, int *out)
{
	uint32_t on;
	const int r = cli_opt_choice(o->cmd, argc, argv, i, name, cli_off_on_names, &on);
	if (r > 0)
		*out = (int)on;
	return r;
}

/* Generate's own options (beside shared_option's), the same convention. */
static int generate_option(int argc, char **argv, int *i, struct opts *o)
{
	const char *cmd = o->cmd, *a = argv[*i];
	int r, estimate;
	if (!strcmp(a, "--ignore-eos")) {
		o->ignore_eos = 1;
		return 1;
	}
	if (!strcmp(a, "--beyond-context")) {
		o->beyond_context = 1;
		return 1;
	}
	if ((r = cli_opt_str(cmd, argc, argv, i, "--prompt", &o->prompt)) ||
	    (r = cli_opt_str(cmd, argc, argv, i, "--chat", &o->chat)) ||
	    (r = cli_opt_str(cmd, argc, argv, i, "--file", &o->file)) ||
	    (r = cli_opt_str(cmd, argc, argv, i, "--question", &o->question)) ||
	    (r = cli_opt_u32(cmd, argc, argv, i, "--max-tokens", 1, UINT32_MAX, &o->max_tokens)) ||
	    (r = cli_opt_u32(cmd, argc, argv, i, "--timeline", 1, UINT32_MAX, &o->timeline)) ||
	    (r = cli_opt_float(cmd, argc, argv, i, "--temperature", 0, INFINITY, 0, &o->temperature)) ||
	    (r = cli_opt_float(cmd, argc, argv, i, "--top-p", 0, 1, 1, &o->top_p)) ||
	    (r = cli_opt_u32(cmd, argc, argv, i, "--top-k", 0, UINT32_MAX, &o->top_k)) ||
	    (r = cli_opt_u64(cmd, argc, argv, i, "--seed", 0, UINT64_MAX, &o->seed)) ||
	    (r = opt_mode(argc, argv, i, o)) || (r = opt_kv_format(argc, argv, i, o)) ||
	    (r = opt_compare(argc, argv, i, o)) || (r = opt_off_on(argc, argv, i, o, "--think", &o->think)))
		return r;
	if ((r = opt_off_on(argc, argv, i, o, "--estimate", &estimate)) > 0)
		o->estimate = (uint32_t)estimate;
	return r;
}

static int parse_generate(int argc, char **argv, struct opts *o)
{
	opts_init(o, GENERATE_CMD);
	for (int i = 0; i < argc; i++) {
		if (cli_is_help(argv[i])) {
			generate_usage(stdout);
			return CLI_EXIT_OK;
		}
		int r = shared_option(argc, argv, &i, o);
		if (!r)
			r = generate_option(argc, argv, &i, o);
		if (r < 0)
			return CLI_EXIT_USAGE;
		if (!r)
			return cli_usage_error(GENERATE_CMD, "unknown option '%s'", argv[i]);
	}
	if (!o->prompt && !o->chat && !o->file)
		return cli_usage_error(GENERATE_CMD, "give --prompt, --chat or --file");
	if (!o->n_modes) { /* --mode, then dense when --compare asks for it */
		o->modes[o->n_modes++] = o->mode;
		if (o->compare && o->mode != KVR_MODE_DENSE)
			o->modes[o->n_modes++] = KVR_MODE_DENSE;
	}
	return PARSE_RUN;
}

/* ------------------------------------------------------------------ model file */

/* The default model, fetched with bench/model/fetch_model.sh when missing. */
static int find_model(const char *cmd, char *path, size_t bytes)
{
	if (!gguf_default_model_path(path, bytes))
		return 0;
	const char *script = getenv("KVR_FETCH_SCRIPT");
#ifdef KVR_FETCH_SCRIPT_DEFAULT
	if (!script)
		script = KVR_FETCH_SCRIPT_DEFAULT;
#endif
	struct stat st;
	if (!script || stat(script, &st)) {
		fprintf(stderr,
			"%s: the model is not in the cache and the fetch script is not "
			"found.\nRun bench/model/fetch_model.sh from the source tree (or pass --model "
			"PATH).\n", cmd);
		return -ENOENT;
	}
	fprintf(stderr, "%s: fetching the model (%s) ...\n", cmd, script);
	char fetch[4200];
	snprintf(fetch, sizeof(fetch), "'%s' >/dev/null", script);
	const int status = system(fetch);
	if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status)) {
		fprintf(stderr, "%s: the fetch failed (see above)\n", cmd);
		return -EIO;
	}
	return gguf_default_model_path(path, bytes) ? -ENOENT : 0;
}

/* ------------------------------------------------------------------ tokenizer */

static char *dup_str(const char *p, size_t len)
{
	char *s = malloc(len + 1);
	if (s) {
		memcpy(s, p, len);
		s[len] = 0;
	}
	return s;
}

/* A tokenizer.ggml key that is absent or of another kind: the message names
 * it, what it holds and where (gguf_key_error). */
static int key_error(const struct gguf *g, const char *key, int rc, const char *wanted, char *err,
		     size_t eb)
{
	char msg[400];
	gguf_key_error(g, key, rc, wanted, msg, sizeof(msg));
	snprintf(err, eb, "tokenizer: %s", msg);
	return rc;
}

/* The strings of a string array, pointing into the file; *out is NULL and
 * *n 0 when the key is absent and optional. The element type is checked
 * before anything is allocated by the count. */
static int string_array(const struct gguf *g, const char *key, int required, struct tok_str **out,
			uint64_t *n, char *err, size_t eb)
{
	uint32_t et;
	const void *data;
	*out = NULL;
	*n = 0;
	int rc = gguf_get_arr(g, key, &et, n, &data);
	if (rc == -ENOENT && !required)
		return 0;
	if (!rc && et != GGUF_TYPE_STRING)
		rc = -EINVAL;
	if (rc)
		return key_error(g, key, rc, "an array of strings", err, eb);
	*out = calloc(*n ? *n : 1, sizeof(**out));
	if (!*out) {
		snprintf(err, eb, "tokenizer: out of memory for the %llu strings of %s",
			 (unsigned long long)*n, key);
		return -ENOMEM;
	}
	for (uint64_t i = 0; i < *n && !rc; i++)
		rc = gguf_get_arr_str(g, key, i, &(*out)[i].ptr, &(*out)[i].len);
	if (rc)
		return key_error(g, key, rc, "an array of strings", err, eb);
	return 0;
}

/* The tokenizer from the GGUF's tokenizer.ggml.* keys: model, tokens
 * (required), pre, merges, token_type, the special ids and add_bos_token. */
int runner_tokenizer(const struct gguf *g, struct tok **out, char *err, size_t eb)
{
	struct tok_vocab v;
	memset(&v, 0, sizeof(v));
	const char *p;
	size_t len;
	char *model = NULL, *pre = NULL;
	struct tok_str *tokens = NULL, *merges = NULL;
	int32_t *types = NULL;
	uint64_t n_tok = 0, n_merge = 0, n_types = 0;
	*out = NULL;
	int rc = gguf_get_str(g, "tokenizer.ggml.model", &p, &len);
	if (rc)
		rc = key_error(g, "tokenizer.ggml.model", rc, "a string", err, eb);
	else if (!(model = dup_str(p, len)))
		rc = -ENOMEM;
	if (!rc && !gguf_get_str(g, "tokenizer.ggml.pre", &p, &len) && !(pre = dup_str(p, len)))
		rc = -ENOMEM;
	if (rc == -ENOMEM)
		snprintf(err, eb, "tokenizer: out of memory");
	if (!rc)
		rc = string_array(g, "tokenizer.ggml.tokens", 1, &tokens, &n_tok, err, eb);
	if (!rc)
		rc = string_array(g, "tokenizer.ggml.merges", 0, &merges, &n_merge, err, eb);
	uint32_t et;
	const void *data;
	/* token types of another kind or count are ignored: all tokens normal */
	if (!rc && !gguf_get_arr(g, "tokenizer.ggml.token_type", &et, &n_types, &data) &&
	    n_types == n_tok && (et == GGUF_TYPE_INT32 || et == GGUF_TYPE_UINT32)) {
		if (!(types = malloc(n_tok * sizeof(*types)))) {
			snprintf(err, eb, "tokenizer: out of memory for %llu token types",
				 (unsigned long long)n_tok);
			rc = -ENOMEM;
		} else {
			memcpy(types, data, n_tok * sizeof(*types));
		}
	}
	if (!rc) {
		uint32_t id;
		bool add_bos = false;
		v.model = model;
		v.pre = pre;
		v.n_tokens = n_tok;
		v.tokens = tokens;
		v.types = types;
		v.n_merges = n_merge;
		v.merges = merges;
		v.bos_id = gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &id) ? -1 : (int32_t)id;
		v.eos_id = gguf_get_u32(g, "tokenizer.ggml.eos_token_id", &id) ? -1 : (int32_t)id;
		v.unk_id = gguf_get_u32(g, "tokenizer.ggml.unknown_token_id", &id) ? -1 : (int32_t)id;
		/* Llama 3 ends a turn with <|eot_id|>, not its eos */
		static const char *const eog_keys[] = { "tokenizer.ggml.eot_token_id",
							"tokenizer.ggml.eom_token_id" };
		for (size_t k = 0; k < 2; k++)
			if (!gguf_get_u32(g, eog_keys[k], &id) && id < n_tok)
				v.eog_ids[v.n_eog_ids++] = (int32_t)id;
		if (!gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &add_bos))
			v.add_bos = add_bos;
		rc = tok_create(&v, out, err, eb);
	}
	free(model), free(pre), free(tokens), free(merges), free(types);
	return rc;
}

/* ------------------------------------------------------------------ prompt */

static char *read_file(const char *path, size_t *len)
{
	FILE *f = fopen(path, "rb");
	if (!f)
		return NULL;
	size_t cap = 1 << 16, n = 0;
	char *buf = malloc(cap + 1);
	while (buf) {
		const size_t got = fread(buf + n, 1, cap - n, f);
		n += got;
		if (n < cap)
			break;
		char *b = realloc(buf, 2 * cap + 1);
		if (!b) {
			free(buf);
			buf = NULL;
			break;
		}
		buf = b;
		cap *= 2;
	}
	fclose(f);
	if (buf) {
		buf[n] = 0;
		*len = n;
	}
	return buf;
}

/* The prompt's token ids (malloc'd into *ids). */
static int encode_prompt(const struct opts *o, const struct tok *t, const struct chat_format *cf,
			 int32_t **ids, size_t *n)
{
	char *text = NULL, *doc = NULL;
	size_t len = 0;
	int special = 0;
	if (o->file) {
		size_t doc_len = 0;
		if (!(doc = read_file(o->file, &doc_len))) {
			fprintf(stderr, "kvrecall generate: cannot read %s: %s\n", o->file, strerror(errno));
			return -errno;
		}
	}
	if (o->prompt && !o->file) {
		text = strdup(o->prompt);
		len = text ? strlen(text) : 0;
	} else {
		/* a chat message: the document, then the question (or --chat) */
		const char *q = o->question ? o->question : o->chat ? o->chat : "Summarise this document.";
		const size_t ml = (doc ? strlen(doc) : 0) + strlen(q) + 4;
		char *msg = malloc(ml);
		if (!msg) {
			free(doc);
			return -ENOMEM;
		}
		snprintf(msg, ml, "%s%s%s", doc ? doc : "", doc ? "\n\n" : "", q);
		const struct tok_message m = { "user", msg };
		size_t need = 0;
		chat_render(cf, &m, 1, 1, o->think, NULL, 0, &need);
		text = malloc(need + 1);
		if (text && chat_render(cf, &m, 1, 1, o->think, text, need + 1, &len))
			len = 0;
		free(msg);
		special = 1;
	}
	free(doc);
	if (!text)
		return -ENOMEM;
	size_t count = 0;
	tok_encode(t, text, len, special, NULL, 0, &count);
	const int bos = tok_add_bos(t) && tok_bos(t) >= 0;
	*ids = malloc((count + 1) * sizeof(**ids));
	if (!*ids) {
		free(text);
		return -ENOMEM;
	}
	if (bos)
		(*ids)[0] = tok_bos(t);
	int rc = tok_encode(t, text, len, special, *ids + bos, count, &count);
	free(text);
	*n = count + (size_t)bos;
	return rc;
}

/* ------------------------------------------------------------------ generation */

/* One point of the speed-against-position record: the tokens generated since
 * the previous point. */
struct timeline_point {
	uint64_t position;     /* the context's length at the point (prompt + generated) */
	double tokens_per_s;   /* decode speed over the interval */
	double attention_ms;   /* kvrecall's attention per token over the interval (all layers) */
	double corrected;      /* corrected heads / checked heads over the interval */
	double hit_rate;       /* pages hit / pages wanted over the interval (streamed recall) */
	double rss_mib;        /* the process's resident memory at the point */
};

struct run_stats {
	uint32_t mode;
	double prefill_s, decode_s;
	uint64_t prefill_attn_ns, decode_attn_ns;
	size_t prompt_tokens, generated;
	struct kvr_stats kv;
	struct timeline_point *timeline;
	size_t n_timeline;
};

static double rss_mib(void)
{
	FILE *f = fopen("/proc/self/statm", "r");
	unsigned long long size = 0, resident = 0;
	if (f) {
		if (fscanf(f, "%llu %llu", &size, &resident) != 2)
			resident = 0;
		fclose(f);
	}
	return (double)resident * (double)sysconf(_SC_PAGESIZE) / (1 << 20);
}

static int make_context(const struct model *m, const struct opts *o, uint32_t mode, uint32_t kv_format,
			size_t tokens, struct kvr_context **ctx)
{
	struct kvr_config c;
	kvr_config_init(&c);
	model_kvr_config(m, &c);
	c.mode = mode;
	c.kv_format = kv_format;
	c.recall = o->recall;
	c.estimate = mode == KVR_MODE_DENSE ? 0 : o->estimate;
	c.backend = KVR_BACKEND_CPU;
	c.max_sequences = 1;
	c.max_batch = 1;
	if (o->have_budget)
		c.budget_tokens = o->budget;
	/* unset, the library makes each min(512, B/4) in whole pages */
	if (o->have_sink)
		c.sink_tokens = o->sink;
	if (o->have_window)
		c.window_tokens = o->window;
	if (o->have_tau)
		c.tau = o->tau;
	/* kvrecall's cpu kernels run on the model's workers: one pool, not two */
	c.parallel_for = kvr_thread_pool_parallel_for;
	c.parallel_user = model_thread_pool(m);
	c.threads = kvr_thread_pool_threads(model_thread_pool(m));
	/* the pool holds this run's pages: every layer of every token, twice over */
	const uint64_t page_bytes = 2ull * c.page_tokens * c.head_dim * c.n_kv_heads * 2;
	c.pool_bytes = ((tokens + 2 * c.page_tokens) / c.page_tokens + 4) * c.n_layers * page_bytes * 2;
	if (kvr_context_create(&c, ctx)) {
		fprintf(stderr, "%s: %s\n", o->cmd, kvr_last_error(NULL));
		return -EINVAL;
	}
	return 0;
}

/* Prefill the prompt, then generate up to max_tokens into out (its first
 * token is sampled from the prompt's logits). stream: print as it goes. */
static int generate(struct model *m, const struct tok *t, const struct opts *o, uint32_t mode,
		    uint32_t kv_format, const int32_t *prompt, size_t n_prompt, int stream, int32_t *out, size_t *n_out,
		    struct run_stats *st)
{
	const struct model_hparams *hp = model_hparams(m);
	struct kvr_context *ctx;
	int rc = make_context(m, o, mode, kv_format, n_prompt + o->max_tokens, &ctx);
	if (rc)
		return rc;
	float *logits = malloc(hp->n_vocab * sizeof(float));
	struct sampler smp;
	if (!logits || sampler_init(&smp, o->temperature, o->top_p, o->seed)) {
		free(logits);
		kvr_context_destroy(ctx);
		fprintf(stderr, "%s: bad sampling options or out of memory\n", o->cmd);
		return -EINVAL;
	}
	smp.top_k = o->top_k;
	char err[512] = "";
	uint32_t seq;
	memset(st, 0, sizeof(*st));
	st->prompt_tokens = n_prompt;
	const uint64_t a0 = model_attention_ns(m, 1), d0 = model_attention_ns(m, 0);
	rc = kvr_seq_create(ctx, &seq);
	double t0 = now_s();
	/* prefill in slices, for a progress line */
	const uint32_t slice = 512;
	struct progress prog;
	progress_init(&prog);
	for (size_t at = 0; !rc && at < n_prompt; at += slice) {
		const uint32_t c = n_prompt - at < slice ? (uint32_t)(n_prompt - at) : slice;
		rc = model_prefill(m, ctx, seq, prompt + at, c, at, at + c == n_prompt ? logits : NULL, err,
				   sizeof(err));
		if (!o->quiet)
			progress_printf(&prog, "prefill %zu/%zu tokens, %.0f tokens/s", at + c, n_prompt,
					(double)(at + c) / (now_s() - t0));
	}
	st->prefill_s = now_s() - t0;
	if (!o->quiet) {
		progress_end(&prog);
		if (!prog.tty) /* the last slice's line, if the rate limit held it back */
			fprintf(stderr, "prefill %zu tokens in %.1f s\n", n_prompt, st->prefill_s);
	}
	struct tok_stream ts;
	tok_stream_init(&ts, 0);
	char piece[1024];
	size_t plen;
	/* the speed-against-position record: a point every o->timeline tokens */
	const size_t max_points = o->max_tokens / o->timeline + 2;
	st->timeline = calloc(max_points, sizeof(*st->timeline));
	if (!st->timeline)
		rc = -ENOMEM;
	struct kvr_stats last_kv = { .size = sizeof(last_kv) };
	kvr_get_stats(ctx, &last_kv);
	double last_t = now_s();
	uint64_t last_attn = model_attention_ns(m, 0);
	size_t last_n = 0;
	t0 = now_s();
	size_t n = 0;
	while (!rc && n < o->max_tokens) {
		uint32_t next;
		if ((rc = sample_next(&smp, logits, hp->n_vocab, &next)))
			break;
		out[n++] = (int32_t)next;
		if (stream && !tok_stream_push(t, &ts, (int32_t)next, piece, sizeof(piece), &plen)) {
			fwrite(piece, 1, plen, stdout);
			fflush(stdout);
		}
		if (!o->ignore_eos && tok_is_eog(t, (int32_t)next))
			break;
		if (n == o->max_tokens)
			break;
		rc = model_decode(m, ctx, seq, (int32_t)next, n_prompt + n - 1, logits, err, sizeof(err));
		/* a point every o->timeline tokens, and one for the rest at the end */
		const int last = n + 1 == o->max_tokens && n > last_n;
		if (!rc && (n - last_n == o->timeline || last) && st->n_timeline < max_points) {
			struct kvr_stats kv = { .size = sizeof(kv) };
			kvr_get_stats(ctx, &kv);
			const double now = now_s();
			const uint64_t attn = model_attention_ns(m, 0);
			const uint64_t checked = kv.checked_heads - last_kv.checked_heads;
			const uint64_t wanted = kv.pages_hit + kv.pages_recalled - last_kv.pages_hit - last_kv.pages_recalled;
			st->timeline[st->n_timeline++] = (struct timeline_point){
				.position = n_prompt + n,
				.tokens_per_s = (double)(n - last_n) / (now - last_t),
				.attention_ms = (double)(attn - last_attn) / 1e6 / (double)(n - last_n),
				.corrected = checked ? (double)(kv.corrected_heads - last_kv.corrected_heads) / (double)checked
						     : 0.0,
				.hit_rate = wanted ? (double)(kv.pages_hit - last_kv.pages_hit) / (double)wanted : -1.0,
				.rss_mib = rss_mib(),
			};
			if (!stream && !o->quiet) /* a run that prints no text shows it is alive */
				fprintf(stderr, "%s: %zu tokens generated, %.1f tokens/s at position %llu\n",
					kvr_mode_name(mode), n, st->timeline[st->n_timeline - 1].tokens_per_s,
					(unsigned long long)(n_prompt + n));
			last_kv = kv;
			last_t = now;
			last_attn = attn;
			last_n = n;
		}
		/* on a terminal only: in a file it would land inside the answer */
		if (!o->quiet && stream && n % 32 == 0 && prog.tty)
			fprintf(stderr, "\r\033[2K[%zu tokens, %.1f tokens/s]\r", n, (double)n / (now_s() - t0));
	}
	if (stream && !tok_stream_flush(&ts, piece, sizeof(piece), &plen))
		fwrite(piece, 1, plen, stdout);
	if (stream) { /* ended before the statistics on stderr, in a shared log too */
		fputc('\n', stdout);
		fflush(stdout);
	}
	st->decode_s = now_s() - t0;
	st->generated = n;
	st->prefill_attn_ns = model_attention_ns(m, 1) - a0;
	st->decode_attn_ns = model_attention_ns(m, 0) - d0;
	st->kv.size = sizeof(st->kv);
	kvr_get_stats(ctx, &st->kv);
	st->mode = mode;
	if (rc == -ENOMEM && !st->timeline)
		snprintf(err, sizeof(err), "out of memory");
	if (rc)
		fprintf(stderr, "kvrecall generate: %s\n", err);
	*n_out = n;
	sampler_free(&smp);
	free(logits);
	kvr_context_destroy(ctx);
	return rc;
}

static void print_stats(FILE *f, const char *what, const struct run_stats *s)
{
	const double dec = s->generated > 1 ? (double)(s->generated - 1) : 1.0;
	const uint64_t pages = s->kv.pages_recalled + s->kv.pages_hit;
	char hit[32] = "n/a (zero-copy)";
	if (pages)
		snprintf(hit, sizeof(hit), "%.2f", (double)s->kv.pages_hit / (double)pages);
	fprintf(f,
		"%s: prompt %zu tokens, prefill %.2f s (%.0f tokens/s, attention %.2f s); generated %zu tokens, "
		"decode %.2f s (%.1f tokens/s); attention %.2f ms/token (all layers); "
		"corrected %.1f%% of checked heads (%llu correction waits); recall hit rate %s, "
		"%.1f MiB recalled\n",
		what, s->prompt_tokens, s->prefill_s, (double)s->prompt_tokens / s->prefill_s,
		(double)s->prefill_attn_ns / 1e9, s->generated, s->decode_s, dec / (s->decode_s > 0 ? s->decode_s : 1),
		(double)s->decode_attn_ns / dec / 1e6,
		s->kv.checked_heads ? 100.0 * (double)s->kv.corrected_heads / (double)s->kv.checked_heads
				    : 0.0,
		(unsigned long long)s->kv.correction_waits, hit,
		(double)s->kv.bytes_recalled / (1 << 20));
}

/* The run's statistics as one JSON object (no newline). */
static void json_run(FILE *f, const struct run_stats *st)
{
	fprintf(f, "{\"mode\": \"%s\", \"prompt_tokens\": %zu, \"generated\": %zu, "
		   "\"prefill_s\": %.4f, \"decode_s\": %.4f, \"decode_attention_ns\": %llu, "
		   "\"corrected_heads\": %llu, \"checked_heads\": %llu, \"pages_recalled\": %llu, "
		   "\"pages_hit\": %llu, \"bytes_recalled\": %llu, \"pages_judged\": %llu, "
		   "\"pages_demoted\": %llu, \"device_units\": %llu, \"device_units_used\": %llu, "
		   "\"timeline\": [",
		kvr_mode_name(st->mode), st->prompt_tokens, st->generated, st->prefill_s, st->decode_s,
		(unsigned long long)st->decode_attn_ns, (unsigned long long)st->kv.corrected_heads,
		(unsigned long long)st->kv.checked_heads, (unsigned long long)st->kv.pages_recalled,
		(unsigned long long)st->kv.pages_hit, (unsigned long long)st->kv.bytes_recalled,
		(unsigned long long)st->kv.pages_judged, (unsigned long long)st->kv.pages_demoted,
		(unsigned long long)st->kv.device_units, (unsigned long long)st->kv.device_units_used);
	for (size_t i = 0; i < st->n_timeline; i++) {
		const struct timeline_point *p = &st->timeline[i];
		fprintf(f, "%s{\"position\": %llu, \"tokens_per_s\": %.2f, \"attention_ms\": %.4f, "
			   "\"corrected\": %.5f, \"hit_rate\": %.4f, \"rss_mib\": %.1f}",
			i ? ", " : "", (unsigned long long)p->position, p->tokens_per_s, p->attention_ms,
			p->corrected, p->hit_rate, p->rss_mib);
	}
	fprintf(f, "]}");
}

/* Speed against position, one column per run (the long-generation view). */
static void print_timeline(FILE *f, const struct run_stats *runs, size_t n_runs)
{
	size_t rows = 0;
	for (size_t r = 0; r < n_runs; r++)
		rows = runs[r].n_timeline > rows ? runs[r].n_timeline : rows;
	if (!rows)
		return;
	fprintf(f, "\n%10s", "position");
	for (size_t r = 0; r < n_runs; r++)
		fprintf(f, "  %9s tok/s  corr.  RSS MiB", kvr_mode_name(runs[r].mode));
	fprintf(f, "\n");
	for (size_t i = 0; i < rows; i++) {
		const struct timeline_point *first = NULL;
		for (size_t r = 0; r < n_runs && !first; r++)
			if (i < runs[r].n_timeline)
				first = &runs[r].timeline[i];
		fprintf(f, "%10llu", (unsigned long long)first->position);
		for (size_t r = 0; r < n_runs; r++) {
			if (i >= runs[r].n_timeline) {
				fprintf(f, "  %15s  %5s  %7s", "-", "-", "-");
				continue;
			}
			const struct timeline_point *p = &runs[r].timeline[i];
			fprintf(f, "  %15.1f  %4.1f%%  %7.0f", p->tokens_per_s, 100.0 * p->corrected, p->rss_mib);
		}
		fprintf(f, "\n");
	}
}

int runner_generate(int argc, char **argv)
{
	struct opts o;
	int rc = parse_generate(argc, argv, &o);
	if (rc != PARSE_RUN)
		return rc;
	char path[4096];
	if (o.model)
		snprintf(path, sizeof(path), "%s", o.model);
	else if (find_model(GENERATE_CMD, path, sizeof(path)))
		return CLI_EXIT_FAILURE;
	char err[512];
	struct model *m;
	if ((rc = model_open(path, o.threads, &m, err, sizeof(err)))) {
		fprintf(stderr, "kvrecall generate: %s\n", err);
		return 1;
	}
	struct tok *t;
	if ((rc = runner_tokenizer(model_gguf(m), &t, err, sizeof(err)))) {
		fprintf(stderr, "kvrecall generate: %s\n", err);
		model_close(m);
		return 1;
	}
	const struct model_hparams *hp = model_hparams(m);
	struct chat_format cf;
	const char *tmpl = NULL;
	size_t tmpl_len = 0;
	if (gguf_get_str(model_gguf(m), "tokenizer.chat_template", &tmpl, &tmpl_len))
		tmpl = NULL;
	chat_detect(tmpl, tmpl_len, hp->arch_name, t, &cf);
	int32_t *prompt = NULL;
	size_t n_prompt = 0;
	struct run_stats runs[4];
	int32_t *outs[4] = { NULL };
	size_t n_outs[4] = { 0 };
	memset(runs, 0, sizeof(runs));
	rc = encode_prompt(&o, t, &cf, &prompt, &n_prompt);
	if (rc || !n_prompt) {
		if (rc)
			fprintf(stderr, "kvrecall generate: the prompt could not be encoded (%s)\n", strerror(-rc));
		else
			fprintf(stderr, "kvrecall generate: the prompt is empty\n");
		rc = rc ? rc : -EINVAL;
		goto out;
	}
	/* The model's trained context bounds what it can attend to sensibly: a
	 * prompt past it is refused before any work, and generation stops at it,
	 * unless the user asks to go beyond. */
	if (hp->ctx_len && !o.beyond_context) {
		if (n_prompt >= hp->ctx_len) {
			fprintf(stderr,
				"kvrecall generate: the prompt is %zu tokens; the model was trained for a context of "
				"%llu (%s.context_length). Shorten it, or pass --beyond-context to run past the "
				"trained context (the output's quality there is unknown).\n",
				n_prompt, (unsigned long long)hp->ctx_len, hp->arch_name);
			rc = -EINVAL;
			goto out;
		}
		if (n_prompt + o.max_tokens > hp->ctx_len) {
			o.max_tokens = (uint32_t)(hp->ctx_len - n_prompt);
			fprintf(stderr, "kvrecall generate: generating at most %u tokens: the model's context is %llu "
					"(--beyond-context goes on past it)\n",
				o.max_tokens, (unsigned long long)hp->ctx_len);
		}
	} else if (hp->ctx_len && n_prompt + o.max_tokens > hp->ctx_len) {
		fprintf(stderr, "kvrecall generate: warning: running to %zu tokens, past the %llu the model was "
				"trained for; expect its output to degrade there\n",
			n_prompt + o.max_tokens, (unsigned long long)hp->ctx_len);
	}
	if (!o.quiet)
		fprintf(stderr, "model %s: %s, %u layers, %u/%u heads of %u, vocabulary %u (pre-tokenizer %s, chat "
				"%s%s); prompt %zu tokens; mode %s\n",
			path, hp->arch_name, hp->n_layers, hp->n_head, hp->n_head_kv, hp->head_dim, hp->n_vocab,
			tok_pre_name(t), chat_style_name(cf.style), cf.thinking ? ", thinking" : "", n_prompt,
			kvr_mode_name(o.modes[0]));
	size_t done = 0;
	for (; done < o.n_modes && !rc; done++) {
		const uint32_t mode = o.modes[done];
		/* the runs after the first are references: plain f16 pages, not streamed */
		const uint32_t kv_format = done ? KVR_KV_FORMAT_PLAIN : o.kv_format;
		if (!(outs[done] = malloc(o.max_tokens * sizeof(int32_t)))) {
			rc = -ENOMEM;
			break;
		}
		rc = generate(m, t, &o, mode, kv_format, prompt, n_prompt, !o.quiet && !done, outs[done], &n_outs[done],
			      &runs[done]);
		if (!rc)
			print_stats(stderr, kvr_mode_name(mode), &runs[done]);
	}
	for (size_t r = 1; !rc && r < done; r++) {
		size_t same = 0;
		while (same < n_outs[0] && same < n_outs[r] && outs[0][same] == outs[r][same])
			same++;
		if (same == n_outs[0] && same == n_outs[r])
			fprintf(stderr, "compare: %s identical to %s over all %zu tokens\n", kvr_mode_name(o.modes[r]),
				kvr_mode_name(o.modes[0]), n_outs[0]);
		else
			fprintf(stderr, "compare: %s first diverges from %s at generated token %zu (of %zu / %zu)\n",
				kvr_mode_name(o.modes[r]), kvr_mode_name(o.modes[0]), same, n_outs[0], n_outs[r]);
	}
	if (!rc && (done > 1 || o.max_tokens >= 4 * o.timeline))
		print_timeline(stderr, runs, done);
	if (!rc && o.json) {
		FILE *f = fopen(o.json, "w");
		if (!f) {
			fprintf(stderr, "kvrecall generate: cannot write %s: %s\n", o.json, strerror(errno));
			rc = -errno;
		} else {
			/* the first run's fields at the top (the single-run form), every run in "runs" */
			json_run(f, &runs[0]);
			fseek(f, -1, SEEK_CUR); /* reopen the object */
			fprintf(f, ", \"model\": \"%s\", \"threads\": %u, \"timeline_tokens\": %u, \"runs\": [",
				hp->arch_name, o.threads, o.timeline);
			for (size_t r = 0; r < done; r++) {
				if (r)
					fprintf(f, ", ");
				json_run(f, &runs[r]);
			}
			fprintf(f, "]}\n");
			if (fclose(f))
				rc = -EIO;
		}
	}
out:
	for (size_t r = 0; r < 4; r++) {
		free(outs[r]);
		free(runs[r].timeline);
	}
	free(prompt);
	tok_destroy(t);
	model_close(m);
	return rc ? 1 : 0;
}

/* ------------------------------------------------------------------ eval */

static void eval_usage(FILE *f)
{
	fprintf(f,
		"usage: kvrecall eval --file PATH [options]\n"
		"  Teacher-forced over the file's first --context tokens: prefill the first\n"
		"  --prefill tokens (default: the budget), then decode token by token; report\n"
		"  perplexity over the decoded positions and top-1 agreement with dense.\n"
		"  --file PATH         a text; repeat to join several (blank line between)\n"
		"  --model PATH        GGUF (default: the cached SmolLM2-135M-Instruct)\n"
		"  --context N         tokens, 2 to 4294967295 (default 8192)\n"
		"  --prefill N         tokens prefilled before decoding, fewer than --context\n"
		"                      (default: the budget)\n"
		"  --modes LIST        comma-separated, from dense,blocking,speculative,freekv\n"
		"                      (default all four; dense always runs first)\n"
		"  --kv-formats LIST   comma-separated page formats, from f16,k8v4,k4v2,mixed: each\n"
		"                      mode runs with each (default f16); dense with f16 pages\n"
		"                      runs first and is the reference, and dense also runs\n"
		"                      with each other format (quantisation alone)\n"
		"  --budget B --sink S --window W --tau T   as for generate\n"
		"  --recall R          auto | zero-copy | streamed, as for generate\n"
		"  --estimate off|on|both   the sparse modes without (default) or with the estimate\n"
		"                      of the pages not retrieved, or each without then with it,\n"
		"                      side by side (and how much of the gap over dense it closes)\n"
		"  --threads N         workers besides the main thread, 0 to 1024\n"
		"  --quiet             no progress lines\n"
		"  --json FILE         results as JSON\n");
}

struct eval_result {
	uint32_t mode, kv_format, estimate;
	double nll, seconds;
	double decode_seconds;   /* the decode steps alone, prefill excluded */
	uint64_t decode_attn_ns; /* inside kvrecall's decode attention calls */
	uint64_t positions, agree;
	struct kvr_stats kv;
};

/* log-softmax of the target, in double. */
static double nll_of(const float *l, uint32_t n, uint32_t target)
{
	float top = l[0];
	for (uint32_t i = 1; i < n; i++)
		top = l[i] > top ? l[i] : top;
	double sum = 0.0;
	for (uint32_t i = 0; i < n; i++)
		sum += exp((double)l[i] - top);
	return log(sum) - ((double)l[target] - top);
}

static int eval_mode(struct model *m, const struct opts *o, uint32_t mode, uint32_t kv_format,
		     const int32_t *ids, uint32_t n, uint32_t prefill, int32_t *dense_top,
		     struct eval_result *r)
{
	const uint32_t vocab = model_hparams(m)->n_vocab;
	struct kvr_context *ctx;
	int rc = make_context(m, o, mode, kv_format, n, &ctx);
	if (rc)
		return rc;
	float *logits = malloc(vocab * sizeof(float));
	char err[512];
	uint32_t seq;
	memset(r, 0, sizeof(*r));
	r->mode = mode;
	r->kv_format = kv_format;
	r->estimate = mode == KVR_MODE_DENSE ? 0 : o->estimate;
	const double t0 = now_s();
	struct progress prog;
	progress_init(&prog);
	rc = logits ? kvr_seq_create(ctx, &seq) : -ENOMEM;
	if (!rc)
		rc = model_prefill(m, ctx, seq, ids, prefill, 0, logits, err, sizeof(err));
	const double t_decode = now_s();
	const uint64_t attn0 = model_attention_ns(m, 0);
	/* logits now predict ids[prefill]; each decode adds one token */
	for (uint32_t pos = prefill; !rc && pos < n; pos++) {
		r->nll += nll_of(logits, vocab, (uint32_t)ids[pos]);
		uint32_t best = 0;
		for (uint32_t v = 1; v < vocab; v++)
			if (logits[v] > logits[best])
				best = v;
		if (mode == KVR_MODE_DENSE && kv_format == KVR_KV_FORMAT_PLAIN)
			dense_top[pos - prefill] = (int32_t)best;
		r->agree += dense_top[pos - prefill] == (int32_t)best;
		r->positions++;
		if (pos + 1 < n)
			rc = model_decode(m, ctx, seq, ids[pos], pos, logits, err, sizeof(err));
		if (!o->quiet && (pos - prefill) % 64 == 63)
			progress_printf(&prog, "%-11s%s %u/%u positions, ppl %.3f", kvr_mode_name(mode),
					r->estimate ? " +estimate" : "", pos - prefill + 1, n - prefill,
					exp(r->nll / (double)r->positions));
	}
	if (!o->quiet)
		progress_end(&prog);
	r->seconds = now_s() - t0;
	r->decode_seconds = now_s() - t_decode;
	r->decode_attn_ns = model_attention_ns(m, 0) - attn0;
	r->kv.size = sizeof(r->kv);
	kvr_get_stats(ctx, &r->kv);
	if (rc)
		fprintf(stderr, "kvrecall eval: %s\n", err);
	free(logits);
	kvr_context_destroy(ctx);
	return rc;
}

/* Eval's settings beside the shared options. */
struct eval_opts {
	const char **files; /* --file may repeat: the texts are read in order and joined by a
			     * blank line, so that 8K tokens can come from Debian's own shorter texts */
	uint32_t n_files;
	uint32_t context, prefill, modes[4], n_modes, formats[4], n_formats;
	int modes_given;               /* --modes seen: its sparse modes, none when it named dense alone */
	int estimate_off, estimate_on; /* --estimate off|on|both */
};

static int parse_eval(int argc, char **argv, struct opts *o, struct eval_opts *e)
{
	static const char *const estimate_names[] = { "off", "on", "both", NULL };
	opts_init(o, EVAL_CMD);
	for (int i = 0; i < argc; i++) {
		if (cli_is_help(argv[i])) {
			eval_usage(stdout);
			return CLI_EXIT_OK;
		}
		const char *text;
		uint32_t estimate;
		int r = shared_option(argc, argv, &i, o);
		if (!r && (r = cli_opt_str(EVAL_CMD, argc, argv, &i, "--file", &text)) > 0)
			e->files[e->n_files++] = text;
		if (!r)
			r = cli_opt_u32(EVAL_CMD, argc, argv, &i, "--context", 2, UINT32_MAX, &e->context);
		if (!r)
			r = cli_opt_u32(EVAL_CMD, argc, argv, &i, "--prefill", 1, UINT32_MAX - 1, &e->prefill);
		if (!r && (r = cli_opt_choice(EVAL_CMD, argc, argv, &i, "--estimate", estimate_names, &estimate)) > 0)
			e->estimate_off = estimate != 1, e->estimate_on = estimate != 0;
		if (!r && (r = cli_opt_str(EVAL_CMD, argc, argv, &i, "--kv-formats", &text)) > 0 &&
		    cli_parse_name_list(EVAL_CMD, "--kv-formats", text, kvr_kv_format_parse, cli_kv_format_names,
					e->formats, 4, &e->n_formats))
			r = -1;
		if (!r && (r = cli_opt_str(EVAL_CMD, argc, argv, &i, "--modes", &text)) > 0) {
			uint32_t modes[4], n = 0;
			if (cli_parse_name_list(EVAL_CMD, "--modes", text, cli_mode_parse, cli_mode_names, modes, 4, &n))
				r = -1;
			e->n_modes = 0, e->modes_given = 1; /* dense always runs first, as the reference */
			for (uint32_t m = 0; r > 0 && m < n; m++)
				if (modes[m] != KVR_MODE_DENSE)
					e->modes[e->n_modes++] = modes[m];
		}
		if (r < 0)
			return CLI_EXIT_USAGE;
		if (!r)
			return cli_usage_error(EVAL_CMD, "unknown option '%s'", argv[i]);
	}
	if (!e->n_files)
		return cli_usage_error(EVAL_CMD, "--file is required");
	o->file = e->files[0];
	if (!e->n_formats)
		e->formats[e->n_formats++] = KVR_KV_FORMAT_PLAIN;
	if (!e->modes_given) {
		e->modes[e->n_modes++] = KVR_MODE_BLOCKING;
		e->modes[e->n_modes++] = KVR_MODE_SPECULATIVE;
		e->modes[e->n_modes++] = KVR_MODE_FREEKV;
	}
	return PARSE_RUN;
}

int runner_eval(int argc, char **argv)
{
	struct opts o;
	struct eval_opts eo = { .context = 8192, .estimate_off = 1, .files = calloc((size_t)argc + 1, sizeof(char *)) };
	if (!eo.files) {
		fprintf(stderr, "%s: out of memory\n", EVAL_CMD);
		return CLI_EXIT_FAILURE;
	}
	int rc = parse_eval(argc, argv, &o, &eo);
	if (rc != PARSE_RUN) {
		free(eo.files);
		return rc;
	}
	const uint32_t context = eo.context, n_files = eo.n_files, n_formats = eo.n_formats, n_modes = eo.n_modes;
	const uint32_t *formats = eo.formats, *modes = eo.modes;
	const int estimate_off = eo.estimate_off, estimate_on = eo.estimate_on;
	const char **files = eo.files;
	uint32_t prefill = eo.prefill;
	char path[4096], err[512];
	if (o.model)
		snprintf(path, sizeof(path), "%s", o.model);
	else if (find_model(EVAL_CMD, path, sizeof(path))) {
		free(files);
		return CLI_EXIT_FAILURE;
	}
	struct model *m;
	if ((rc = model_open(path, o.threads, &m, err, sizeof(err)))) {
		fprintf(stderr, "%s: %s\n", EVAL_CMD, err);
		free(files);
		return CLI_EXIT_FAILURE;
	}
	struct tok *t = NULL;
	size_t len = 0, n_ids = 0;
	char *text = NULL;
	int32_t *ids = NULL, *dense_top = NULL;
	if ((rc = runner_tokenizer(model_gguf(m), &t, err, sizeof(err))))
		fprintf(stderr, "kvrecall eval: %s\n", err);
	for (uint32_t f = 0; !rc && f < n_files; f++) {
		size_t part_len = 0;
		char *part = read_file(files[f], &part_len), *joined = NULL;
		if (part)
			joined = realloc(text, len + 2 + part_len + 1);
		if (!joined) {
			fprintf(stderr, "kvrecall eval: cannot read %s\n", files[f]);
			free(part);
			rc = -EIO;
			break;
		}
		text = joined;
		if (f) /* a blank line between texts */
			text[len++] = '\n', text[len++] = '\n';
		memcpy(text + len, part, part_len);
		len += part_len;
		text[len] = 0;
		free(part);
	}
	if (!rc) {
		tok_encode(t, text, len, 0, NULL, 0, &n_ids);
		ids = malloc((n_ids + 1) * sizeof(*ids));
		rc = ids ? tok_encode(t, text, len, 0, ids, n_ids, &n_ids) : -ENOMEM;
	}
	const uint32_t budget = o.have_budget ? o.budget : 2048;
	if (!prefill)
		prefill = budget;
	if (!rc && (n_ids < context || prefill >= context)) {
		fprintf(stderr,
			"kvrecall eval: %s%s has %zu tokens; need --context %u > --prefill %u "
			"(--file may repeat: the texts are joined)\n",
			o.file, n_files > 1 ? " and the other files" : "", n_ids, context, prefill);
		rc = -EINVAL;
	}
	struct eval_result res[1 + 4 * 9];
	uint32_t n_res = 0;
	if (!rc && !(dense_top = malloc((context - prefill) * sizeof(*dense_top))))
		rc = -ENOMEM;
	if (!rc) /* the reference: dense over f16 pages */
		rc = eval_mode(m, &o, KVR_MODE_DENSE, KVR_KV_FORMAT_PLAIN, ids, context, prefill, dense_top,
			       &res[n_res++]);
	for (uint32_t f = 0; !rc && f < n_formats; f++) {
		if (formats[f] != KVR_KV_FORMAT_PLAIN)
			rc = eval_mode(m, &o, KVR_MODE_DENSE, formats[f], ids, context, prefill, dense_top,
				       &res[n_res++]);
		for (uint32_t i = 0; !rc && i < n_modes; i++)
			for (uint32_t e = 0; !rc && e < 2; e++) {
				if (e ? !estimate_on : !estimate_off)
					continue;
				o.estimate = e;
				rc = eval_mode(m, &o, modes[i], formats[f], ids, context, prefill, dense_top,
					       &res[n_res++]);
			}
	}
	if (!rc) {
		const double dense_ppl = exp(res[0].nll / (double)res[0].positions);
		printf("context %u tokens (%s%s), prefill %u, decoded %u; B = %u, tau = %.2f\n", context,
		       o.file, n_files > 1 ? " and more" : "", prefill, context - prefill, budget,
		       (double)(o.have_tau ? o.tau : 0.9f));
		printf("| mode | pages | estimate | perplexity | gap over dense | top-1 agreement with dense | "
		       "corrected heads | decode tokens/s | attention ms/token | seconds |\n"
		       "|---|---|---|---|---|---|---|---|---|---|\n");
		for (uint32_t i = 0; i < n_res; i++) {
			const double ppl = exp(res[i].nll / (double)res[i].positions);
			/* the last position is scored without a decode after it */
			const double steps = res[i].positions > 1 ? (double)(res[i].positions - 1) : 1.0;
			printf("| %s | %s | %s | %.4f | %+.4f | %.4f | %.1f%% | %.1f | %.3f | %.0f |\n",
			       kvr_mode_name(res[i].mode),
			       res[i].kv_format ? kvr_kv_format_name(res[i].kv_format) : "f16",
			       res[i].mode == KVR_MODE_DENSE ? "-" : res[i].estimate ? "on" : "off", ppl,
			       ppl - dense_ppl,
			       (double)res[i].agree / (double)res[i].positions,
			       res[i].kv.checked_heads ? 100.0 * (double)res[i].kv.corrected_heads /
							       (double)res[i].kv.checked_heads
						       : 0.0,
			       steps / res[i].decode_seconds, (double)res[i].decode_attn_ns / steps / 1e6,
			       res[i].seconds);
		}
		/* --estimate both: how much of each sparse row's gap the estimate closes */
		for (uint32_t i = 1; i < n_res; i++) {
			if (!res[i].estimate || res[i - 1].estimate || res[i - 1].mode != res[i].mode)
				continue;
			const double off = exp(res[i - 1].nll / (double)res[i - 1].positions) - dense_ppl;
			const double on = exp(res[i].nll / (double)res[i].positions) - dense_ppl;
			printf("%s %s: perplexity gap over dense %+.4f without the estimate, %+.4f with it "
			       "(%.2f of it); top-1 agreement %.4f -> %.4f\n",
			       kvr_mode_name(res[i].mode), res[i].kv_format ? kvr_kv_format_name(res[i].kv_format) : "f16",
			       off, on, off != 0.0 ? on / off : 0.0, (double)res[i - 1].agree / (double)res[i - 1].positions,
			       (double)res[i].agree / (double)res[i].positions);
		}
		if (o.json) {
			FILE *f = fopen(o.json, "w");
			if (f) {
				fprintf(f, "{\"context\": %u, \"prefill\": %u, \"budget\": %u, \"tau\": %.3f, "
					   "\"results\": [",
					context, prefill, budget, (double)(o.have_tau ? o.tau : 0.9f));
				for (uint32_t i = 0; i < n_res; i++)
					fprintf(f, "%s{\"mode\": \"%s\", \"kv_format\": \"%s\", \"perplexity\": %.6f, \"top1_agreement\": "
						   "%.6f, \"positions\": %llu, \"corrected_heads\": %llu, "
						   "\"checked_heads\": %llu, \"seconds\": %.2f, "
						   "\"decode_seconds\": %.3f, \"decode_steps\": %llu, "
						   "\"decode_attention_ns\": %llu, \"bytes_recalled\": %llu, "
						   "\"pages_judged\": %llu, \"pages_demoted\": %llu, "
						   "\"device_units\": %llu, \"device_units_used\": %llu, \"estimate\": %s}",
						i ? ", " : "", kvr_mode_name(res[i].mode),
						res[i].kv_format ? kvr_kv_format_name(res[i].kv_format) : "f16",
						exp(res[i].nll / (double)res[i].positions),
						(double)res[i].agree / (double)res[i].positions,
						(unsigned long long)res[i].positions,
						(unsigned long long)res[i].kv.corrected_heads,
						(unsigned long long)res[i].kv.checked_heads, res[i].seconds,
						res[i].decode_seconds,
						(unsigned long long)(res[i].positions ? res[i].positions - 1 : 0),
						(unsigned long long)res[i].decode_attn_ns,
						(unsigned long long)res[i].kv.bytes_recalled,
						(unsigned long long)res[i].kv.pages_judged,
						(unsigned long long)res[i].kv.pages_demoted,
						(unsigned long long)res[i].kv.device_units,
						(unsigned long long)res[i].kv.device_units_used,
						res[i].estimate ? "true" : "false");
				fprintf(f, "]}\n");
				fclose(f);
			}
		}
	}
	free(text), free(ids), free(dense_top), free(files);
	tok_destroy(t);
	model_close(m);
	return rc ? 1 : 0;
}
