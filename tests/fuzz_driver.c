/* SPDX-License-Identifier: MIT */
/*
 * fuzz_driver.c — the seeded mutation driver for a fuzz harness (fuzz.h):
 * a plain C program, built by any compiler, that `meson test` runs briefly
 * on every build (so the ASan+UBSan CI stage fuzzes too) and that runs for
 * as long as asked on demand. libFuzzer (fuzz_libfuzzer.c) explores deeper,
 * guided by coverage, but needs clang; this needs nothing.
 *
 * From the harness's seeds (and inputs that went deep, kept as it goes), it
 * derives each input by 1 to 8 stacked mutations: bit flips, byte sets,
 * insertions, deletions, copies, splices with another input, dictionary
 * strings, truncation, and boundary values (0, 1, all ones, 2^31, 2^32, 2^63,
 * the input's size, ±1) written into the integer fields the harness maps —
 * GGUF's counts and lengths. The run is a function of --seed alone, so a
 * failure replays with the same command, or from the input it leaves in a
 * file (the path is printed; pass it as an argument to run it alone).
 *
 * The inputs run in a child process; the parent watches it through shared
 * memory holding the input being run. So whatever ends the child — a broken
 * check (fuzz_fail), a crash, any sanitizer's report (ASan, UBSan with
 * halt_on_error, which is the default here, LeakSanitizer at exit), an
 * allocation larger than --max-alloc-mb made while an input runs (malloc and
 * friends are wrapped at link time with -Wl,--wrap where the linker has it:
 * a small file must not make the reader trust a count) — or keeps it on one
 * input longer than --timeout seconds, the parent saves the input, prints
 * the closing line and exits nonzero. Every run ends with a closing line,
 * PASSED or FAILED.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fuzz.h"
#include "helpers.h"

/* ---- what the parent sees of the child ------------------------------------ */

struct shared {
	volatile uint64_t iter;    /* the input being run, or the last one */
	volatile uint64_t size;    /* its bytes, in data */
	volatile int running;      /* the harness has it */
	volatile int file;         /* it came from the file of this index + 1, or 0 */
	char reason[1024];         /* fuzz_fail's message */
	uint8_t data[];            /* up to sh_max bytes */
};

static struct shared *sh;
static size_t sh_max;
static uint64_t opt_seed = 1;
static size_t alloc_limit = (size_t)256 << 20;

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* In the child: keep the message for the parent's closing line, and end. */
_Noreturn void fuzz_fail(const char *msg)
{
	if (sh) {
		size_t n = strlen(msg);
		if (n >= sizeof(sh->reason))
			n = sizeof(sh->reason) - 1;
		memcpy(sh->reason, msg, n);
		sh->reason[n] = '\0';
	}
	fprintf(stderr, "fuzz %s: check failed: %s\n", fuzz_target.name, msg);
	_exit(1);
}

/* UBSan reports are failures: halt on the first (the environment can still
 * say otherwise). */
const char *__ubsan_default_options(void);
const char *__ubsan_default_options(void)
{
	return "halt_on_error=1:print_stacktrace=1";
}

/* ---- huge allocations ----------------------------------------------------- */

#ifdef KVR_FUZZ_WRAP_ALLOC
/* Linked with -Wl,--wrap=malloc (and the others): every call from the
 * harness and the code under test comes here first. */
void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);
int __real_posix_memalign(void **p, size_t align, size_t n);
void *__real_aligned_alloc(size_t align, size_t n);
void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t n, size_t size);
void *__wrap_realloc(void *p, size_t n);
int __wrap_posix_memalign(void **p, size_t align, size_t n);
void *__wrap_aligned_alloc(size_t align, size_t n);

/* Formatting that allocates nothing: check_alloc runs inside malloc. */
static char *put_u64(char *p, uint64_t v)
{
	char tmp[24];
	int n = 0;
	do
		tmp[n++] = (char)('0' + v % 10);
	while ((v /= 10) != 0);
	while (n)
		*p++ = tmp[--n];
	*p = '\0';
	return p;
}

static char *put_s(char *p, const char *s, const char *end)
{
	while (*s && p < end - 1)
		*p++ = *s++;
	*p = '\0';
	return p;
}

static void check_alloc(const char *fn, size_t n)
{
	if (!sh || !sh->running || n <= alloc_limit)
		return;
	char msg[200], *p = msg, *e = msg + sizeof(msg);
	p = put_s(p, fn, e);
	p = put_s(p, " of ", e);
	p = n == SIZE_MAX ? put_s(p, "more than SIZE_MAX", e) : put_u64(p, n);
	p = put_s(p, " bytes, above the limit of ", e);
	p = put_u64(p, alloc_limit);
	p = put_s(p, " (--max-alloc-mb): is a count from the input trusted?", e);
	fuzz_fail(msg);
}

void *__wrap_malloc(size_t n)
{
	check_alloc("malloc", n);
	return __real_malloc(n);
}

void *__wrap_calloc(size_t n, size_t size)
{
	size_t bytes;
	check_alloc("calloc", __builtin_mul_overflow(n, size, &bytes) ? SIZE_MAX : bytes);
	return __real_calloc(n, size);
}

void *__wrap_realloc(void *p, size_t n)
{
	check_alloc("realloc", n);
	return __real_realloc(p, n);
}

int __wrap_posix_memalign(void **p, size_t align, size_t n)
{
	check_alloc("posix_memalign", n);
	return __real_posix_memalign(p, align, n);
}

void *__wrap_aligned_alloc(size_t align, size_t n)
{
	check_alloc("aligned_alloc", n);
	return __real_aligned_alloc(align, n);
}
#endif

/* ---- random numbers and the corpus ----------------------------------------- */

static uint64_t rng_state;

static uint64_t rnd(void)
{
	return th_splitmix64(&rng_state);
}

static size_t below(size_t n)
{
	return n ? (size_t)(rnd() % n) : 0;
}

struct input {
	uint8_t *p;
	size_t n;
};

struct corpus {
	struct input *v;
	size_t n, cap, n_seeds;
	size_t largest;
};

static void die(const char *what)
{
	fprintf(stderr, "fuzz %s: FAILED: %s\n", fuzz_target.name, what);
	exit(1);
}

static void corpus_add(void *ctx, const uint8_t *p, size_t n)
{
	struct corpus *c = ctx;
	if (c->n == c->cap) {
		c->cap = c->cap ? 2 * c->cap : 64;
		c->v = realloc(c->v, c->cap * sizeof(*c->v));
		if (!c->v)
			die("out of memory for the corpus");
	}
	uint8_t *copy = malloc(n ? n : 1);
	if (!copy)
		die("out of memory for the corpus");
	memcpy(copy, p, n);
	c->v[c->n++] = (struct input){ copy, n };
	if (n > c->largest)
		c->largest = n;
}

#define MAX_KEPT 512

/* Keep an input that went deep as a base for later mutants; once full, it
 * replaces a random kept one (never a seed). */
static void corpus_keep(struct corpus *c, const uint8_t *p, size_t n)
{
	if (c->n - c->n_seeds < MAX_KEPT) {
		corpus_add(c, p, n);
		return;
	}
	struct input *in = &c->v[c->n_seeds + below(MAX_KEPT)];
	uint8_t *copy = realloc(in->p, n ? n : 1);
	if (!copy)
		die("out of memory for the corpus");
	memcpy(copy, p, n);
	*in = (struct input){ copy, n };
}

/* ---- mutations ---------------------------------------------------------------- */

struct buf {
	uint8_t *p;
	size_t n, cap, max;
};

static void buf_reserve(struct buf *b, size_t n)
{
	if (n <= b->cap)
		return;
	size_t cap = b->cap ? b->cap : 4096;
	while (cap < n)
		cap *= 2;
	uint8_t *p = realloc(b->p, cap);
	if (!p)
		die("out of memory for an input");
	b->p = p;
	b->cap = cap;
}

static void buf_set(struct buf *b, const uint8_t *p, size_t n)
{
	buf_reserve(b, n);
	memcpy(b->p, p, n);
	b->n = n;
}

/* Insert n bytes (copied from src, or random when src is NULL) at `at`. */
static void buf_insert(struct buf *b, size_t at, const uint8_t *src, size_t n)
{
	if (b->n + n > b->max)
		return;
	buf_reserve(b, b->n + n);
	memmove(b->p + at + n, b->p + at, b->n - at);
	for (size_t i = 0; i < n; i++)
		b->p[at + i] = src ? src[i] : (uint8_t)rnd();
	b->n += n;
}

static void buf_erase(struct buf *b, size_t at, size_t n)
{
	memmove(b->p + at, b->p + at + n, b->n - at - n);
	b->n -= n;
}

/* A short length, mostly 1-8, sometimes up to 64 or a quarter of the input. */
static size_t some_len(size_t n)
{
	size_t r = below(16);
	size_t len = r < 12 ? 1 + below(8) : r < 15 ? 1 + below(64) : 1 + below(n / 4 + 1);
	return len;
}

static uint64_t boundary(uint64_t cur, size_t size, size_t at, unsigned width)
{
	const uint64_t ones = width == 8 ? UINT64_MAX : (UINT64_C(1) << (8 * width)) - 1;
	switch (below(18)) {
	case 0: return 0;
	case 1: return 1;
	case 2: return ones;
	case 3: return ones - 1;
	case 4: return ones >> 1;		/* INT_MAX of the width */
	case 5: return (ones >> 1) + 1;	/* INT_MIN */
	case 6: return UINT64_C(1) << 16;
	case 7: return UINT64_C(1) << 30;
	case 8: return UINT64_C(1) << 31;
	case 9: return UINT64_C(1) << 32;
	case 10: return UINT64_C(1) << 40;
	case 11: return UINT64_C(1) << 62;
	case 12: return size;
	case 13: return size - at;
	case 14: return size - at + 1;
	case 15: return cur + 1;
	case 16: return cur - 1;
	default: return cur * 2 + below(3);
	}
}

static void write_le(uint8_t *p, uint64_t v, unsigned width)
{
	for (unsigned i = 0; i < width; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t read_le(const uint8_t *p, unsigned width)
{
	uint64_t v = 0;
	for (unsigned i = 0; i < width; i++)
		v |= (uint64_t)p[i] << (8 * i);
	return v;
}

#define MAX_FIELDS 4096
static struct fuzz_field field_map[MAX_FIELDS];

static void mutate_once(struct buf *b, const struct corpus *c)
{
	static const uint8_t interesting[] = { 0, 1, 0x7f, 0x80, 0xff, 0xfe, 0x20, 0x0a,
					       '0', 'a', 0xc3, 0xe2, 0xf0, 0xed, 0x9f, 0xbf };
	size_t n = b->n;
	switch (below(12)) {
	case 0: /* flip a bit */
		if (n)
			b->p[below(n)] ^= (uint8_t)(1u << below(8));
		break;
	case 1: /* set a byte */
		if (n)
			b->p[below(n)] = below(2) ? (uint8_t)rnd()
						  : interesting[below(sizeof(interesting))];
		break;
	case 2: { /* insert random bytes, or one byte repeated */
		size_t k = some_len(n), at = below(n + 1);
		buf_insert(b, at, NULL, k);
		if (below(2) && b->n > n)
			memset(b->p + at, b->p[at], k);
		break;
	}
	case 3: { /* delete a run */
		if (!n)
			break;
		size_t at = below(n), k = some_len(n);
		buf_erase(b, at, k < n - at ? k : n - at);
		break;
	}
	case 4: { /* copy a run over another place, or insert the copy */
		if (n < 2)
			break;
		size_t from = below(n), k = some_len(n);
		if (k > n - from)
			k = n - from;
		uint8_t tmp[4096];
		if (k > sizeof(tmp))
			k = sizeof(tmp);
		memcpy(tmp, b->p + from, k);
		if (below(2)) {
			size_t to = below(n - k + 1);
			memcpy(b->p + to, tmp, k);
		} else {
			buf_insert(b, below(n + 1), tmp, k);
		}
		break;
	}
	case 5: { /* splice: our prefix, another input's suffix */
		const struct input *o = &c->v[below(c->n)];
		size_t keep = below(n + 1), from = below(o->n + 1);
		if (keep + (o->n - from) > b->max)
			break;
		b->n = keep;
		buf_insert(b, keep, o->p + from, o->n - from);
		break;
	}
	case 6:
	case 7:
	case 8: { /* a boundary value in an integer field */
		size_t nf = fuzz_target.fields ? fuzz_target.fields(b->p, n, field_map, MAX_FIELDS)
					       : 0;
		size_t at;
		unsigned width;
		if (nf && below(8)) {
			const struct fuzz_field *f = &field_map[below(nf)];
			at = f->at;
			width = f->width;
		} else {
			width = below(2) ? 4 : 8;
			if (n < width)
				break;
			at = below(n - width + 1);
		}
		if (at + width > n)
			break;
		uint64_t v = boundary(read_le(b->p + at, width), n, at, width);
		write_le(b->p + at, v, width);
		break;
	}
	case 9: { /* a dictionary string, inserted or written over */
		const char *const *d = fuzz_target.dict;
		size_t nd = 0;
		while (d && d[nd])
			nd++;
		if (!nd)
			break;
		const char *s = d[below(nd)];
		size_t k = strlen(s), at = below(n + 1);
		if (below(2) && at + k <= n)
			memcpy(b->p + at, s, k);
		else
			buf_insert(b, at, (const uint8_t *)s, k);
		break;
	}
	case 10: /* truncate */
		if (n)
			b->n = below(n);
		break;
	default: { /* small arithmetic on a byte */
		if (n)
			b->p[below(n)] += (uint8_t)(below(33) - 16);
		break;
	}
	}
}

static void mutate(struct buf *b, const struct corpus *c)
{
	size_t k = below(8) ? 1 + below(3) : 1 + below(8);
	for (size_t i = 0; i < k; i++)
		mutate_once(b, c);
}

/* ---- running ---------------------------------------------------------------- */

/* Run one input, in the child: published in shared memory for the parent,
 * then run from an exact-size heap copy, so a read one past the end is an
 * ASan report. */
static int run_one(const uint8_t *p, size_t n, uint64_t iter, int file)
{
	if (n > sh_max)
		die("an input is larger than the shared buffer");
	uint8_t *copy = malloc(n ? n : 1);
	if (!copy)
		die("out of memory for an input");
	memcpy(copy, p, n);
	memcpy(sh->data, p, n);
	sh->size = n;
	sh->iter = iter;
	sh->file = file;
	__atomic_store_n(&sh->running, 1, __ATOMIC_SEQ_CST);
	int deep = fuzz_target.one(copy, n);
	__atomic_store_n(&sh->running, 0, __ATOMIC_SEQ_CST);
	free(copy);
	return deep;
}

static int write_file(const char *path, const uint8_t *p, size_t n)
{
	FILE *f = fopen(path, "wb");
	if (!f)
		return -errno;
	size_t w = fwrite(p, 1, n, f);
	int rc = fclose(f);
	return w == n && rc == 0 ? 0 : -EIO;
}

static uint8_t *read_file(const char *path, size_t *n)
{
	FILE *f = fopen(path, "rb");
	if (!f)
		return NULL;
	size_t cap = 4096, len = 0;
	uint8_t *p = malloc(cap);
	while (p) {
		size_t k = fread(p + len, 1, cap - len, f);
		len += k;
		if (len < cap)
			break;
		uint8_t *q = realloc(p, cap *= 2);
		if (!q)
			free(p);
		p = q;
	}
	fclose(f);
	*n = len;
	return p;
}

/* libFuzzer's dictionary format: one quoted string per line, \xNN escapes. */
static int write_dict(const char *path)
{
	FILE *f = fopen(path, "w");
	if (!f)
		return -errno;
	for (const char *const *d = fuzz_target.dict; d && *d; d++) {
		fputc('"', f);
		for (const unsigned char *s = (const unsigned char *)*d; *s; s++) {
			if (*s >= 0x20 && *s < 0x7f && *s != '"' && *s != '\\')
				fputc(*s, f);
			else
				fprintf(f, "\\x%02x", *s);
		}
		fputs("\"\n", f);
	}
	return fclose(f) == 0 ? 0 : -EIO;
}

static int write_seeds(const struct corpus *c, const char *dir)
{
	if (mkdir(dir, 0755) < 0 && errno != EEXIST) {
		fprintf(stderr, "fuzz %s: %s: %s\n", fuzz_target.name, dir, strerror(errno));
		return -1;
	}
	for (size_t i = 0; i < c->n; i++) {
		char path[4096];
		snprintf(path, sizeof(path), "%s/seed-%03zu", dir, i);
		if (write_file(path, c->v[i].p, c->v[i].n) < 0) {
			fprintf(stderr, "fuzz %s: cannot write %s\n", fuzz_target.name, path);
			return -1;
		}
	}
	printf("fuzz %s: %zu seeds written to %s\n", fuzz_target.name, c->n, dir);
	return 0;
}

struct opts {
	uint64_t iterations, timeout;
	bool iterations_given;
	const char *artifacts;
	char **files;
	int n_files;
};

/* The child's work: the files given, then the seeds and mutants. Returns
 * the exit status (0); failures end the process on their own. */
static int child(struct corpus *c, const struct opts *o)
{
	double t0 = now_s();
	for (int i = 0; i < o->n_files; i++) {
		size_t n;
		uint8_t *p = read_file(o->files[i], &n);
		if (!p) {
			fprintf(stderr, "fuzz %s: cannot read %s\n", fuzz_target.name, o->files[i]);
			return 1;
		}
		int deep = run_one(p, n, (uint64_t)i, i + 1);
		printf("fuzz %s: %s: %zu bytes, ran clean%s\n", fuzz_target.name, o->files[i], n,
		       deep ? " (went deep)" : "");
		free(p);
	}
	if (o->n_files && !o->iterations_given) {
		printf("fuzz %s: PASSED %d file(s)\n", fuzz_target.name, o->n_files);
		return 0;
	}

	rng_state = opt_seed;
	struct buf b = { 0 };
	b.max = sh_max;
	uint64_t deep = 0, iter = 0;
	for (size_t i = 0; i < c->n_seeds && iter < o->iterations; i++, iter++)
		deep += (uint64_t)run_one(c->v[i].p, c->v[i].n, iter, 0);
	double last_report = t0;
	for (; iter < o->iterations; iter++) {
		/* a seed or, as often, an input kept for going deep */
		size_t kept = c->n - c->n_seeds;
		const struct input *base =
			kept && below(2) ? &c->v[c->n_seeds + below(kept)] : &c->v[below(c->n_seeds)];
		buf_set(&b, base->p, base->n);
		mutate(&b, c);
		int d = run_one(b.p, b.n, iter, 0);
		deep += (uint64_t)d;
		if (d && below(16) == 0)
			corpus_keep(c, b.p, b.n);
		if ((iter & 1023) == 0) {
			double t = now_s();
			if (t - last_report >= 30) {
				printf("fuzz %s: %" PRIu64 " inputs, %.0f/s, %" PRIu64 " went deep\n",
				       fuzz_target.name, iter, (double)iter / (t - t0), deep);
				last_report = t;
			}
		}
	}
	double t = now_s() - t0;
	printf("fuzz %s: PASSED %" PRIu64 " inputs (seed %" PRIu64 ", %zu seeds, %" PRIu64
	       " went deep, %zu kept) in %.1f s, %.0f inputs/s\n",
	       fuzz_target.name, iter, opt_seed, c->n_seeds, deep, c->n - c->n_seeds, t,
	       t > 0 ? (double)iter / t : 0.0);
	free(b.p);
	return 0;
}

/* The parent's closing line for a child that failed: why, the input, and
 * where it was saved. */
static int report_failure(int status, bool hung, const struct opts *o)
{
	char why[1200];
	if (hung)
		snprintf(why, sizeof(why), "timeout: one input ran longer than %" PRIu64 " s",
			 o->timeout);
	else if (WIFSIGNALED(status))
		snprintf(why, sizeof(why), "killed by signal %d (%s)", WTERMSIG(status),
			 strsignal(WTERMSIG(status)));
	else if (sh->reason[0])
		snprintf(why, sizeof(why), "check failed: %.1000s", sh->reason);
	else
		snprintf(why, sizeof(why), "exit status %d: see the report above",
			 WIFEXITED(status) ? WEXITSTATUS(status) : -1);
	if (!sh->running) {
		printf("fuzz %s: FAILED (%s) after input %" PRIu64 " of seed %" PRIu64
		       ", outside the harness (a leak report at exit?)\n",
		       fuzz_target.name, why, sh->iter, opt_seed);
		return 1;
	}
	if (sh->file) {
		printf("fuzz %s: FAILED (%s) on %s\n", fuzz_target.name, why, o->files[sh->file - 1]);
		return 1;
	}
	char path[4096];
	snprintf(path, sizeof(path), "%s/fuzz-%s-%" PRIu64 "-%" PRIu64 ".bin", o->artifacts,
		 fuzz_target.name, opt_seed, sh->iter);
	bool saved = write_file(path, sh->data, (size_t)sh->size) == 0;
	printf("fuzz %s: FAILED (%s) at input %" PRIu64 " of seed %" PRIu64 ", %" PRIu64
	       " bytes; %s %s%s\n",
	       fuzz_target.name, why, sh->iter, opt_seed, sh->size,
	       saved ? "input saved to" : "the input could not be saved to", path,
	       saved ? " (run it alone: pass the path to this program)" : "");
	return 1;
}

static void usage(const char *prog)
{
	fprintf(stderr,
		"usage: %s [--seed N] [--iterations N] [--max-alloc-mb N] [--timeout S]\n"
		"          [--artifacts DIR] [--write-seeds DIR] [--write-dict FILE] [FILE...]\n"
		"Fuzz the %s harness with N mutated inputs derived from its seeds (default\n"
		"10000); with FILEs, run each file as one input instead (a saved failure).\n"
		"--write-seeds/--write-dict write the seed corpus and dictionary for libFuzzer.\n",
		prog, fuzz_target.name);
}

static bool parse_u64(const char *s, uint64_t *v)
{
	char *end;
	errno = 0;
	unsigned long long x = strtoull(s, &end, 0);
	if (errno || end == s || *end || s[0] == '-')
		return false;
	*v = x;
	return true;
}

static void corpus_free(struct corpus *c)
{
	for (size_t i = 0; i < c->n; i++)
		free(c->v[i].p);
	free(c->v);
}

int main(int argc, char **argv)
{
	struct opts o = { .iterations = 10000, .timeout = 20, .artifacts = "." };
	uint64_t max_alloc_mb = alloc_limit >> 20;
	const char *seeds_dir = NULL, *dict_path = NULL;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		uint64_t *num = !strcmp(a, "--seed")	       ? &opt_seed
				: !strcmp(a, "--iterations")   ? &o.iterations
				: !strcmp(a, "--max-alloc-mb") ? &max_alloc_mb
				: !strcmp(a, "--timeout")      ? &o.timeout
							       : NULL;
		if (num) {
			if (i + 1 >= argc || !parse_u64(argv[i + 1], num)) {
				usage(argv[0]);
				return 2;
			}
			o.iterations_given |= num == &o.iterations;
			i++;
		} else if (!strcmp(a, "--artifacts") && i + 1 < argc) {
			o.artifacts = argv[++i];
		} else if (!strcmp(a, "--write-seeds") && i + 1 < argc) {
			seeds_dir = argv[++i];
		} else if (!strcmp(a, "--write-dict") && i + 1 < argc) {
			dict_path = argv[++i];
		} else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
			usage(argv[0]);
			return 0;
		} else if (a[0] == '-') {
			usage(argv[0]);
			return 2;
		} else {
			o.files = argv + i;
			o.n_files = argc - i;
			break;
		}
	}
	alloc_limit = max_alloc_mb > SIZE_MAX >> 20 ? SIZE_MAX : (size_t)max_alloc_mb << 20;
	if (!o.timeout)
		o.timeout = 1;
	setvbuf(stdout, NULL, _IOLBF, 0);

	struct corpus c = { 0 };
	fuzz_target.seeds(corpus_add, &c);
	c.n_seeds = c.n;
	if (!c.n)
		die("the harness has no seeds");
	if (seeds_dir || dict_path) {
		int rc = seeds_dir ? write_seeds(&c, seeds_dir) : 0;
		if (!rc && dict_path) {
			rc = write_dict(dict_path);
			if (rc < 0)
				fprintf(stderr, "fuzz %s: cannot write %s\n", fuzz_target.name,
					dict_path);
			else
				printf("fuzz %s: dictionary written to %s\n", fuzz_target.name,
				       dict_path);
		}
		corpus_free(&c);
		return rc < 0 ? 1 : 0;
	}

	/* The shared buffer holds the largest input: a mutant (at most twice
	 * the largest seed, and 64 KB) or a file. */
	sh_max = c.largest * 2 > 65536 ? c.largest * 2 : 65536;
	for (int i = 0; i < o.n_files; i++) {
		struct stat st;
		if (stat(o.files[i], &st) == 0 && (size_t)st.st_size > sh_max)
			sh_max = (size_t)st.st_size;
	}
	sh = mmap(NULL, sizeof(*sh) + sh_max, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
		  -1, 0);
	if (sh == MAP_FAILED)
		die("cannot map the shared buffer");

	pid_t pid = fork();
	if (pid < 0)
		die("fork failed");
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL); /* a killed test takes its child along */
		int rc = child(&c, &o);
		corpus_free(&c);
		exit(rc);
	}

	/* The parent: wait, and call an input that stays running too long a hang. */
	int status = 0;
	bool hung = false;
	uint64_t watched = UINT64_MAX;
	double since = now_s();
	for (;;) {
		pid_t r = waitpid(pid, &status, WNOHANG);
		if (r == pid)
			break;
		if (r < 0 && errno != EINTR)
			die("waitpid failed");
		struct timespec ts = { 0, 50 * 1000 * 1000 };
		nanosleep(&ts, NULL);
		uint64_t it = sh->iter;
		if (!sh->running || it != watched) {
			watched = sh->running ? it : UINT64_MAX;
			since = now_s();
		} else if (now_s() - since > (double)o.timeout) {
			hung = true;
			kill(pid, SIGKILL);
			waitpid(pid, &status, 0);
			break;
		}
	}
	corpus_free(&c);
	int rc = hung || !WIFEXITED(status) || WEXITSTATUS(status) != 0 ? report_failure(status, hung, &o)
									 : 0;
	munmap(sh, sizeof(*sh) + sh_max);
	return rc;
}
