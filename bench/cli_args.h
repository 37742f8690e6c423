/* SPDX-License-Identifier: MIT */
/*
 * cli_args.h — command-line parsing shared by the `kvrecall` command, its
 * benchmarks and the model runner: numbers parsed whole and checked against
 * their range, comma-separated lists of them, names from a fixed set, and
 * the one-line usage error that points to --help.
 *
 * A bad value is one line on stderr that names the command, the option, the
 * value and what the option accepts:
 *   kvrecall generate: --tau 'abc': expected a number from -1 to 1
 * An unknown option or a missing value adds where to look:
 *   kvrecall bench decode: unknown option '--foo'
 *   Try 'kvrecall bench decode --help'.
 *
 * The cli_opt_* functions match one option at argv[*i]: 1 when it was that
 * option (its value stored and *i moved onto the value), 0 when it is
 * another option, -1 after an error message. CLI_TAKE turns that into the argument
 * loop's `continue` or `return CLI_EXIT_USAGE`.
 *
 * Header-only, because the runner is a static library of its own
 * (bench/model/) and the command's benchmarks another; main thread.
 */
#ifndef KVR_CLI_ARGS_H
#define KVR_CLI_ARGS_H

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrecall.h"

/* The command's exit statuses (also in `kvrecall --help`). */
enum {
	CLI_EXIT_OK = 0,
	CLI_EXIT_FAILURE = 1, /* the command ran and failed */
	CLI_EXIT_USAGE = 2,   /* the command line is wrong: nothing was run */
};

static inline int cli_is_help(const char *arg)
{
	return !strcmp(arg, "--help") || !strcmp(arg, "-h");
}

/* "<cmd>: <message>" and "Try '<cmd> --help'." on stderr; CLI_EXIT_USAGE. */
static inline int cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static inline int cli_usage_error(const char *cmd, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fprintf(stderr, "%s: ", cmd);
	vfprintf(stderr, fmt, ap);
	fprintf(stderr, "\nTry '%s --help'.\n", cmd);
	va_end(ap);
	return CLI_EXIT_USAGE;
}

/* "<cmd>: <opt> '<text>': expected <what>" on stderr; -1. */
static inline int cli_bad_value(const char *cmd, const char *opt, const char *text, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
static inline int cli_bad_value(const char *cmd, const char *opt, const char *text, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fprintf(stderr, "%s: %s '%s': expected ", cmd, opt, text);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
	return -1;
}

/* ------------------------------------------------------------------ values */

/* A whole decimal unsigned integer: digits only (no sign, space or suffix),
 * within 64 bits. 0, or -1 when text is anything else. */
static inline int cli_u64_whole(const char *text, uint64_t *out)
{
	if (!(*text >= '0' && *text <= '9'))
		return -1;
	uint64_t v = 0;
	for (const char *c = text; *c; c++) {
		if (!(*c >= '0' && *c <= '9'))
			return -1;
		const uint64_t digit = (uint64_t)(*c - '0');
		if (v > (UINT64_MAX - digit) / 10)
			return -1;
		v = v * 10 + digit;
	}
	*out = v;
	return 0;
}

/* An integer in [min, max]; 0, or -1 after a message. */
static inline int cli_parse_u64(const char *cmd, const char *opt, const char *text, uint64_t min, uint64_t max,
				uint64_t *out)
{
	uint64_t v = 0;
	if (cli_u64_whole(text, &v) || v < min || v > max)
		return cli_bad_value(cmd, opt, text, "an integer from %llu to %llu", (unsigned long long)min,
				     (unsigned long long)max);
	*out = v;
	return 0;
}

static inline int cli_parse_u32(const char *cmd, const char *opt, const char *text, uint32_t min, uint32_t max,
				uint32_t *out)
{
	uint64_t v = 0;
	if (cli_parse_u64(cmd, opt, text, min, max, &v))
		return -1;
	*out = (uint32_t)v;
	return 0;
}

/* A finite decimal number in [min, max], or in (min, max] when min_excluded;
 * max = INFINITY for no upper bound. Not hexadecimal, inf or nan (which
 * strtod takes). 0, or -1 after a message. */
/* Whether v is finite and within [min, max] (above min when min_excluded). */
static inline int cli_number_in_range(double v, double min, double max, int min_excluded)
{
	return isfinite(v) && (min_excluded ? v > min : v >= min) && v <= max;
}

/* The error of a number outside its range (or not a number); -1. */
static inline int cli_bad_number(const char *cmd, const char *opt, const char *text, double min, double max,
				 int min_excluded)
{
	if (isinf(max))
		return cli_bad_value(cmd, opt, text, "a number %s %g", min_excluded ? "above" : "of at least", min);
	if (min_excluded)
		return cli_bad_value(cmd, opt, text, "a number above %g and at most %g", min, max);
	return cli_bad_value(cmd, opt, text, "a number from %g to %g", min, max);
}

static inline int cli_parse_double(const char *cmd, const char *opt, const char *text, double min, double max,
				   int min_excluded, double *out)
{
	const int decimal = ((*text >= '0' && *text <= '9') || *text == '-' || *text == '.') &&
			    !strpbrk(text, "xXpP");
	char *end = NULL;
	const double v = decimal ? strtod(text, &end) : NAN;
	if (!decimal || *end || !cli_number_in_range(v, min, max, min_excluded))
		return cli_bad_number(cmd, opt, text, min, max, min_excluded);
	*out = v;
	return 0;
}

/* "a, b, c" from a NULL-terminated list of names. */
static inline void cli_print_names(FILE *f, const char *const *names)
{
	for (size_t i = 0; names[i]; i++)
		fprintf(f, "%s%s", i ? ", " : "", names[i]);
}

/* An error for a name outside `names` (NULL-terminated): lists them; -1. */
static inline int cli_bad_choice(const char *cmd, const char *opt, const char *text, const char *const *names)
{
	fprintf(stderr, "%s: %s '%s': expected one of ", cmd, opt, text);
	cli_print_names(stderr, names);
	fputc('\n', stderr);
	return -1;
}

/* The index of text in `names` (NULL-terminated); 0, or -1 after a message
 * that lists them. */
static inline int cli_parse_choice(const char *cmd, const char *opt, const char *text, const char *const *names,
				   uint32_t *index)
{
	for (uint32_t i = 0; names[i]; i++)
		if (!strcmp(text, names[i])) {
			*index = i;
			return 0;
		}
	return cli_bad_choice(cmd, opt, text, names);
}

/* ------------------------------------------------------------------ lists */

/* The elements of a comma-separated list in turn: *at starts at the list;
 * each call copies the next element into item and returns 1, or returns 0
 * after the last one, or -1 for an element longer than item_bytes - 1 (which
 * no valid name or number is). "" and "a,,b" have empty elements. */
static inline int cli_list_next(const char **at, char *item, size_t item_bytes)
{
	if (!*at)
		return 0;
	const char *comma = strchr(*at, ',');
	const size_t len = comma ? (size_t)(comma - *at) : strlen(*at);
	const int fits = len < item_bytes;
	memcpy(item, *at, fits ? len : item_bytes - 1);
	item[fits ? len : item_bytes - 1] = 0;
	*at = comma ? comma + 1 : NULL;
	return fits ? 1 : -1;
}

/* "1,2,4" -> out[0..*n), each an integer in [min, max], at most max_n of
 * them; 0, or -1 after a message. */
static inline int cli_parse_u32_list(const char *cmd, const char *opt, const char *text, uint32_t min, uint32_t max,
				     uint32_t *out, uint32_t max_n, uint32_t *n)
{
	char item[32];
	uint32_t count = 0;
	const char *at = text;
	for (int r; (r = cli_list_next(&at, item, sizeof(item)));) {
		uint64_t v = 0;
		if (r < 0 || cli_u64_whole(item, &v) || v < min || v > max)
			return cli_bad_value(cmd, opt, text, "comma-separated integers from %u to %u (not '%s')", min,
					     max, item);
		if (count == max_n)
			return cli_bad_value(cmd, opt, text, "at most %u values", max_n);
		out[count++] = (uint32_t)v;
	}
	*n = count;
	return 0;
}

/* A comma-separated list of names into out[0..*n) (at most max_n), each
 * turned into its value by `parse` (0 when it knows the name); `names` are
 * the accepted ones, listed in the message. 0, or -1 after a message. */
static inline int cli_parse_name_list(const char *cmd, const char *opt, const char *text,
				      int (*parse)(const char *name, uint32_t *value), const char *const *names,
				      uint32_t *out, uint32_t max_n, uint32_t *n)
{
	char item[32];
	uint32_t count = 0;
	const char *at = text;
	for (int r; (r = cli_list_next(&at, item, sizeof(item)));) {
		uint32_t v = 0;
		if (r < 0 || parse(item, &v)) {
			fprintf(stderr, "%s: %s '%s': expected a comma-separated list of ", cmd, opt, text);
			cli_print_names(stderr, names);
			fprintf(stderr, " (not '%s')\n", item);
			return -1;
		}
		if (count == max_n)
			return cli_bad_value(cmd, opt, text, "at most %u names", max_n);
		out[count++] = v;
	}
	*n = count;
	return 0;
}

/* ------------------------------------------------------------------ options */

/* The value of the option at argv[*i] (and *i moved onto it), or NULL after
 * a usage error when none follows. */
static inline const char *cli_value_of(const char *cmd, int argc, char **argv, int *i)
{
	if (*i + 1 >= argc) {
		cli_usage_error(cmd, "option '%s' needs a value", argv[*i]);
		return NULL;
	}
	return argv[++*i];
}

/* The cli_opt_* matchers: 1 taken, 0 not this option, -1 after a message. */
static inline int cli_opt_str(const char *cmd, int argc, char **argv, int *i, const char *name, const char **out)
{
	if (strcmp(argv[*i], name))
		return 0;
	const char *v = cli_value_of(cmd, argc, argv, i);
	if (!v)
		return -1;
	*out = v;
	return 1;
}

static inline int cli_opt_u32(const char *cmd, int argc, char **argv, int *i, const char *name, uint32_t min,
			      uint32_t max, uint32_t *out)
{
	if (strcmp(argv[*i], name))
		return 0;
	const char *v = cli_value_of(cmd, argc, argv, i);
	return v && !cli_parse_u32(cmd, name, v, min, max, out) ? 1 : -1;
}

static inline int cli_opt_u64(const char *cmd, int argc, char **argv, int *i, const char *name, uint64_t min,
			      uint64_t max, uint64_t *out)
{
	if (strcmp(argv[*i], name))
		return 0;
	const char *v = cli_value_of(cmd, argc, argv, i);
	return v && !cli_parse_u64(cmd, name, v, min, max, out) ? 1 : -1;
}

static inline int cli_opt_double(const char *cmd, int argc, char **argv, int *i, const char *name, double min,
				 double max, int min_excluded, double *out)
{
	if (strcmp(argv[*i], name))
		return 0;
	const char *v = cli_value_of(cmd, argc, argv, i);
	return v && !cli_parse_double(cmd, name, v, min, max, min_excluded, out) ? 1 : -1;
}

/* As cli_opt_double, into a float read with strtof (the value a float
 * literal of the same text would have), whose range is checked too. */
static inline int cli_opt_float(const char *cmd, int argc, char **argv, int *i, const char *name, double min,
				double max, int min_excluded, float *out)
{
	double checked = 0;
	const int r = cli_opt_double(cmd, argc, argv, i, name, min, max, min_excluded, &checked);
	if (r <= 0)
		return r;
	/* the range again on the float: 1e39 overflows to inf, 1e-320 underflows to 0 */
	const float f = strtof(argv[*i], NULL);
	if (!cli_number_in_range(f, min, max, min_excluded))
		return cli_bad_number(cmd, name, argv[*i], min, max, min_excluded);
	*out = f;
	return 1;
}

static inline int cli_opt_u32_list(const char *cmd, int argc, char **argv, int *i, const char *name, uint32_t min,
				   uint32_t max, uint32_t *out, uint32_t max_n, uint32_t *n)
{
	if (strcmp(argv[*i], name))
		return 0;
	const char *v = cli_value_of(cmd, argc, argv, i);
	return v && !cli_parse_u32_list(cmd, name, v, min, max, out, max_n, n) ? 1 : -1;
}

/* *index: the value's position in `names` (NULL-terminated). */
static inline int cli_opt_choice(const char *cmd, int argc, char **argv, int *i, const char *name,
				 const char *const *names, uint32_t *index)
{
	if (strcmp(argv[*i], name))
		return 0;
	const char *v = cli_value_of(cmd, argc, argv, i);
	return v && !cli_parse_choice(cmd, name, v, names, index) ? 1 : -1;
}

/* In an argument loop: an option a cli_opt_* call took ends this turn
 * (continue); one it refused ends the command (return CLI_EXIT_USAGE). */
#define CLI_TAKE(call)                                     \
	{                                                  \
		const int cli_taken_ = (call);             \
		if (cli_taken_ < 0)                        \
			return CLI_EXIT_USAGE;             \
		if (cli_taken_)                            \
			continue;                          \
	}

/* Names the commands accept, shared so that their errors list the same.
 * The backend's and recall's are in the order of their KVR_BACKEND_* and
 * KVR_RECALL_* values; modes and page formats go through the library's
 * parsers (cli_mode_parse, kvr_kv_format_parse), which also take the
 * aliases (plain, bf16, f32 for f16 pages). */
static const char *const cli_backend_names[] = { "auto", "cpu", "cuda", NULL };
static const char *const cli_mode_names[] = { "dense", "blocking", "speculative", "freekv", NULL };
static const char *const cli_kv_format_names[] = { "f16", "k8v4", "k4v2", "mixed", NULL };
static const char *const cli_recall_names[] = { "auto", "zero-copy", "streamed", NULL };
static const char *const cli_off_on_names[] = { "off", "on", NULL };

/* kvr_mode_parse without auto: a command runs the modes it names. */
static inline int cli_mode_parse(const char *name, uint32_t *mode)
{
	return kvr_mode_parse(name, mode) || *mode == KVR_MODE_AUTO ? -1 : 0;
}

#endif /* KVR_CLI_ARGS_H */
