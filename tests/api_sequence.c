/* SPDX-License-Identifier: MIT */
/*
 * api_sequence.c — seeded random sequences of public API calls, each checked
 * against a reference model this program keeps itself.
 *
 * It owns: random valid and invalid configs; a model of every sequence's
 * stored K/V per layer, of the open decode step and of the counters; and the
 * checks of every call against that model — the return code, a fresh error
 * message for every failure, every layer's length after every failure,
 * attention outputs against a double-precision reference over what the model
 * says is stored, monotone and consistent counters. Misuse (wrong call order,
 * bad ids, NULL pointers, positions that wrap, an exhausted pool, destroying a
 * context with a step open) is mixed into correct use. It includes only
 * kvrecall.h and links the shared library, as an engine does, and it is a
 * plain program rather than a Criterion suite so that it can run for millions
 * of calls and under ASan/UBSan.
 *
 * Usage: api_sequence [--seed S] [--calls N] [--verbose | --verbose-from C]
 *                     [--skip-known[=LIST]]
 * Prints "api_sequence: N calls, E expected errors, 0 failed" and exits 0, or
 * stops at the first mismatch with the seed, the call index and what differed
 * (the same seed replays the same calls). The numbered cases below are the
 * library bugs this program found (all fixed); a mismatch in one of them
 * names it, and --skip-known leaves them out (all, or the comma-separated
 * numbers given) to look past a regression.
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kvrecall.h"

/* ------------------------------------------------------------------ library bugs it found */

/* Each case the program exercises that the library once got wrong (every
 * one is fixed and has a directed test in its suite). The checks
 * assert the correct behaviour; --skip-known keeps the program from issuing
 * a case (some of them corrupted memory, after which nothing else could be
 * trusted). */
enum {
	K_NONE = 0,
	K_CONFIG_SIZE = 1,       /* cfg.size = UINT32_MAX over-reads the caller's struct */
	K_PREFILL_ATTN_WRAP = 2, /* prefill_attention(UINT64_MAX, 2) wraps */
	K_STEP_MEMBER = 3,       /* free/prefill/truncate/fork of a sequence in the open step */
	K_LAYER_TWICE = 4,       /* a layer decoded twice in one step */
	K_LAYER_MISSING = 5,     /* decode_end with a layer not decoded */
	K_GETTER_MESSAGE = 6,    /* get_config/get_stats failures without a message */
	K_STRERROR_MIN = 7,      /* kvr_strerror(INT32_MIN) */
	K_VALIDATE_BUDGETS = 8,  /* validate accepts device_bytes / pool_ram_bytes create refuses */
	K_WINDOW_ZERO = 9,       /* W = 0: the page the current token completes is not attended */
	K_BAD_POSITION = 10,     /* a step position below a layer's length truncates the sequence */
	K_PURE_MESSAGE = 11,     /* config_init/mode_parse/kv_format_parse fail without a message */
	K_NHD_TRUNCATE = 12,     /* truncating into an offloaded page of an NHD pool garbles it */
	K_COUNT
};

static const char *const known_what[K_COUNT] = {
	[K_CONFIG_SIZE] = "config size UINT32_MAX",
	[K_PREFILL_ATTN_WRAP] = "prefill_attention positions wrap",
	[K_STEP_MEMBER] = "sequence of the open step freed/prefilled/truncated/forked",
	[K_LAYER_TWICE] = "layer decoded twice in a step",
	[K_LAYER_MISSING] = "step ended with a layer not decoded",
	[K_GETTER_MESSAGE] = "get_config/get_stats failure without message",
	[K_STRERROR_MIN] = "kvr_strerror(INT32_MIN)",
	[K_VALIDATE_BUDGETS] = "validate vs create on device_bytes/pool_ram_bytes",
	[K_WINDOW_ZERO] = "W = 0 misses the page just completed",
	[K_BAD_POSITION] = "step position below the length truncates the sequence",
	[K_PURE_MESSAGE] = "pure helpers fail without a message",
	[K_NHD_TRUNCATE] = "truncate into an offloaded page of an NHD pool",
};

/* ------------------------------------------------------------------ run state */

#define MAX_D 64
#define MSG 512

static struct {
	uint64_t seed, max_calls, verbose_from;
	int verbose;
	uint64_t calls, ops, expected_errors, contexts, invalid_configs;
	uint64_t dense_checks, exact_sparse_checks, bound_checks, prefill_attention_checks, async_errors;
	uint8_t skip[K_COUNT];
	uint64_t hits[K_COUNT];
	const char *op;
	char tmpdir[200];
	uint32_t files;
} T;

static uint64_t rng_state;

static uint64_t rnd64(void)
{
	uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static uint32_t rnd(uint32_t n)
{
	return n ? (uint32_t)(rnd64() % n) : 0;
}

static int chance(uint32_t percent)
{
	return rnd(100) < percent;
}

/* A known case about to be exercised: counted, and 0 when it is skipped. */
static int known_case(int k)
{
	T.hits[k]++;
	return !T.skip[k];
}

static _Noreturn void fail(int known, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static _Noreturn void fail(int known, const char *fmt, ...)
{
	va_list ap;
	fflush(stdout);
	fprintf(stderr, "api_sequence: MISMATCH seed %" PRIu64 " call %" PRIu64 " (%s): ", T.seed,
		T.calls, T.op ? T.op : "-");
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	if (known)
		fprintf(stderr, "\n  known case %d (%s): --skip-known=%d leaves it out", known,
			known_what[known], known);
	fprintf(stderr,
		"\n  replay: api_sequence --seed %" PRIu64 " --calls %" PRIu64 " --verbose-from %" PRIu64
		"\napi_sequence: %" PRIu64 " calls, %" PRIu64 " expected errors, 1 failed\n",
		T.seed, T.calls, T.calls > 50 ? T.calls - 50 : 0, T.calls, T.expected_errors);
	fflush(stderr);
	_exit(1); /* no exit handlers: the context under test may be in any state */
}

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* One API call about to be issued (counted), printed when verbose. */
static void say(const char *fmt, ...)
{
	T.calls++;
	if (!T.verbose && (!T.verbose_from || T.calls < T.verbose_from))
		return;
	va_list ap;
	va_start(ap, fmt);
	printf("[%" PRIu64 "] ", T.calls);
	vprintf(fmt, ap);
	printf("\n");
	va_end(ap);
}

/* ------------------------------------------------------------------ error checks */

static atomic_uint_fast64_t log_errors, log_empty;

static void log_cb(void *user, enum kvr_log_level level, const char *message)
{
	(void)user;
	if (level == KVR_LOG_ERROR)
		atomic_fetch_add(&log_errors, 1);
	if (!message || !message[0])
		atomic_fetch_add(&log_empty, 1);
}

static char sentinel[MSG];
static uint64_t log_armed;
static uint32_t sentinel_n;

/* Before a call that may fail: make the message slot (the context's, or the
 * thread's for ctx == NULL) hold a message of a failure of our own, so that
 * the real call's message can be told from an older one. `op` is the call
 * about to be checked: the sentinel comes from a different call. */
static void arm(const struct kvr_context *ctx, const char *op)
{
	uint64_t n;
	if (ctx)
		kvr_seq_length(ctx, 0x80000000u + (sentinel_n++ & 0x7fffffffu), 0, &n);
	else if (strcmp(op, "seq_length"))
		kvr_seq_length(NULL, 0, 0, &n);
	else
		kvr_seq_free(NULL, 0);
	snprintf(sentinel, sizeof(sentinel), "%s", kvr_last_error(ctx));
	log_armed = atomic_load(&log_errors);
}

/* A failure the model expects: `rc` must be `want` (0: any negative errno),
 * and the call must have left a message of its own naming `needle`; with
 * `logged`, an ERROR must have reached the log callback. */
static void expect_fail(int rc, int want, const struct kvr_context *ctx, const char *needle,
			int logged, int known)
{
	if (rc >= 0 || (want && rc != want))
		fail(known, "returned %d (%s), expected %d (%s)", rc, kvr_strerror(rc), want,
		     want ? kvr_strerror(want) : "any negative errno");
	char m[MSG];
	snprintf(m, sizeof(m), "%s", kvr_last_error(ctx));
	if (!m[0])
		fail(known, "failed with %d but kvr_last_error(%s) is empty", rc, ctx ? "ctx" : "NULL");
	if (!strcmp(m, sentinel))
		fail(known, "failed with %d but kvr_last_error(%s) still holds an older message: \"%s\"",
		     rc, ctx ? "ctx" : "NULL", m);
	if (needle && !strstr(m, needle))
		fail(known, "failed with %d; its message \"%s\" does not name \"%s\"", rc, m, needle);
	if (logged && atomic_load(&log_errors) == log_armed)
		fail(known, "failed with %d (\"%s\") but nothing reached the log callback", rc, m);
	T.expected_errors++;
}

static void expect_ok(int rc, const struct kvr_context *ctx)
{
	if (rc)
		fail(0, "returned %d (%s), expected 0; message \"%s\"", rc, kvr_strerror(rc),
		     kvr_last_error(ctx));
}

/* ------------------------------------------------------------------ element types */

static uint16_t f32_to_f16(float f)
{
	uint32_t x;
	memcpy(&x, &f, 4);
	const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
	if (ax >= 0x7f800000u)
		return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
	if (ax >= 0x477ff000u)
		return (uint16_t)(sign | 0x7c00u);
	if (ax < 0x38800000u) { /* below 2^-14: subnormal, in units of 2^-24 */
		float a;
		memcpy(&a, &ax, 4);
		return (uint16_t)(sign | (uint32_t)nearbyintf(a * 16777216.0f));
	}
	uint32_t h = ((((ax >> 23) - 127 + 15) << 10) | ((ax & 0x7fffffu) >> 13));
	const uint32_t rem = ax & 0x1fffu;
	if (rem > 0x1000u || (rem == 0x1000u && (h & 1)))
		h++;
	return (uint16_t)(sign | h);
}

static float f16_to_f32(uint16_t h)
{
	const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
	if (e == 0)
		return (sign ? -1.0f : 1.0f) * ldexpf((float)m, -24);
	if (e == 31)
		return m ? NAN : (sign ? -INFINITY : INFINITY);
	const uint32_t x = sign | ((e - 15 + 127) << 23) | (m << 13);
	float f;
	memcpy(&f, &x, 4);
	return f;
}

static uint32_t dtype_bytes(uint32_t dtype)
{
	return dtype == KVR_DTYPE_F32 ? 4 : 2;
}

static void put(uint32_t dtype, void *buf, size_t i, float f)
{
	if (dtype == KVR_DTYPE_F32) {
		((float *)buf)[i] = f;
	} else if (dtype == KVR_DTYPE_F16) {
		((uint16_t *)buf)[i] = f32_to_f16(f);
	} else {
		uint32_t x;
		memcpy(&x, &f, 4);
		((uint16_t *)buf)[i] = (uint16_t)((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
	}
}

static float get(uint32_t dtype, const void *buf, size_t i)
{
	if (dtype == KVR_DTYPE_F32)
		return ((const float *)buf)[i];
	if (dtype == KVR_DTYPE_F16)
		return f16_to_f32(((const uint16_t *)buf)[i]);
	const uint32_t x = (uint32_t)((const uint16_t *)buf)[i] << 16;
	float f;
	memcpy(&f, &x, 4);
	return f;
}

/* Values exact in every dtype (at most 8 significant bits), so the model's
 * floats are exactly what the library was handed. */
static float kv_value(void)
{
	return (float)((int)rnd(257) - 128) / 128.0f;
}

/* ------------------------------------------------------------------ the model */

struct lkv { /* one layer of one sequence: rows of n_kv x d floats */
	uint64_t n, cap;
	float *k, *v;
};

struct mseq {
	int alive, in_step;
	struct lkv *l;        /* n_layers */
	float *prev_q;        /* n_layers x n_qo x d: the last query decoded per layer */
	uint64_t ok, dense, failed; /* layer decodes since creation */
};

static struct {
	struct kvr_context *ctx;
	struct kvr_config cfg; /* as handed in */
	uint32_t nl, nkv, nqo, d, G, p, S, W, B, k, dtype, fmt, mode, recall, max_seq, max_batch;
	int spill, log_on;
	uint64_t dev_fixed, dev_per_seq, dev_bytes, kv_row, q_row, plain_page, pool_pages_max;
	struct mseq *seq;
	uint32_t n_alive;
	/* the open step */
	int step_open;
	uint32_t batch;
	uint32_t *bseq;
	uint64_t *bpos;
	int32_t *bfail;  /* per batch entry: the error of its first failed layer */
	uint32_t *bfail_layer; /* and that layer */
	uint8_t *ldone;  /* per layer */
	uint64_t *pre;   /* per batch entry and layer: the length before the step */
	int bad_below;   /* a position below a layer's length (K_BAD_POSITION) */
	int nhd_truncated; /* K_NHD_TRUNCATE was exercised: outputs may show it */
	/* counters the library must agree with */
	uint64_t ok, dense, failed, ends_ok, ends;
	struct kvr_stats last;
	int trace; /* 1 recording, 0 not */
	/* scratch */
	float *qf, *kf, *vf;
	void *q, *kb, *vb, *out;
	int32_t *status;
} M;

static uint64_t min_len(const struct mseq *s)
{
	uint64_t n = UINT64_MAX;
	for (uint32_t l = 0; l < M.nl; l++)
		n = s->l[l].n < n ? s->l[l].n : n;
	return n;
}

static int even(const struct mseq *s)
{
	for (uint32_t l = 1; l < M.nl; l++)
		if (s->l[l].n != s->l[0].n)
			return 0;
	return 1;
}

static void lkv_append(struct lkv *L, const float *k, const float *v, uint64_t n)
{
	if (!n)
		return; /* a fork of an empty layer: nothing to copy, and L->k may be NULL */
	if (L->n + n > L->cap) {
		uint64_t cap = L->cap ? L->cap : 64;
		while (cap < L->n + n)
			cap *= 2;
		L->k = realloc(L->k, cap * M.kv_row * sizeof(float));
		L->v = realloc(L->v, cap * M.kv_row * sizeof(float));
		if (!L->k || !L->v)
			fail(0, "out of memory in the model");
		L->cap = cap;
	}
	memcpy(L->k + L->n * M.kv_row, k, n * M.kv_row * sizeof(float));
	memcpy(L->v + L->n * M.kv_row, v, n * M.kv_row * sizeof(float));
	L->n += n;
}

static void mseq_open(uint32_t id)
{
	struct mseq *s = &M.seq[id];
	if (s->alive)
		fail(0, "the library handed out sequence id %u, which is alive", id);
	s->alive = 1;
	s->in_step = 0;
	s->ok = s->dense = s->failed = 0;
	for (uint32_t l = 0; l < M.nl; l++)
		s->l[l].n = 0;
	memset(s->prev_q, 0, (size_t)M.nl * M.q_row * sizeof(float));
	M.n_alive++;
}

static void mseq_close(uint32_t id)
{
	M.seq[id].alive = 0;
	M.n_alive--;
}

/* A live sequence at random, preferring (when asked) one whose layers are
 * even; UINT32_MAX when none. */
static uint32_t pick_seq(int prefer_even, int allow_in_step)
{
	uint32_t ids[256], n = 0;
	for (uint32_t i = 0; i < M.max_seq; i++)
		if (M.seq[i].alive && (allow_in_step || !M.seq[i].in_step) &&
		    (!prefer_even || even(&M.seq[i])))
			ids[n++] = i;
	if (!n && prefer_even)
		return pick_seq(0, allow_in_step);
	return n ? ids[rnd(n)] : UINT32_MAX;
}

/* An id that names no live sequence (never UINT32_MAX, which some calls
 * read as "every sequence"). */
static uint32_t dead_id(void)
{
	for (int tries = 0; tries < 4; tries++) {
		const uint32_t id = rnd(M.max_seq);
		if (!M.seq[id].alive)
			return id;
	}
	switch (rnd(3)) {
	case 0:
		return M.max_seq;
	case 1:
		return M.max_seq + 1 + rnd(1000);
	default:
		return UINT32_MAX - 1 - rnd(2);
	}
}

/* Every layer's length of every live sequence as the library reports it. */
static void check_lengths(const char *after)
{
	for (uint32_t i = 0; i < M.max_seq; i++) {
		if (!M.seq[i].alive)
			continue;
		for (uint32_t l = 0; l < M.nl; l++) {
			uint64_t n = UINT64_MAX;
			say("seq_length(%u, %u)", i, l);
			const int rc = kvr_seq_length(M.ctx, i, l, &n);
			if (rc)
				fail(0, "after %s: seq_length(%u, %u) = %d: %s", after, i, l, rc,
				     kvr_last_error(M.ctx));
			/* a sequence that failed after its token was appended (the
			 * spill tier's pins) holds it until decode_end takes it back */
			int pending = 0;
			for (uint32_t b = 0; M.step_open && M.seq[i].in_step && b < M.batch; b++)
				pending |= M.bseq[b] == i && M.bfail[b] && M.bfail_layer[b] == l;
			if (n != M.seq[i].l[l].n && !(pending && n == M.seq[i].l[l].n + 1))
				fail(M.bad_below ? K_BAD_POSITION : 0,
				     "after %s: sequence %u layer %u holds %" PRIu64 " tokens, the model %" PRIu64,
				     after, i, l, n, M.seq[i].l[l].n);
		}
	}
}

/* ------------------------------------------------------------------ the reference */

/* Online softmax of one query head over some tokens, in double. */
struct part {
	double mx, sum, acc[MAX_D];
};

static void part_reset(struct part *pt)
{
	pt->mx = -INFINITY;
	pt->sum = 0;
	memset(pt->acc, 0, sizeof(pt->acc));
}

static void part_fold(struct part *pt, const float *qh, const struct lkv *L, uint32_t m, uint64_t t0,
		      uint64_t t1)
{
	const uint32_t d = M.d;
	const double scale = 1.0 / sqrt((double)d);
	for (uint64_t t = t0; t < t1; t++) {
		const float *k = L->k + t * M.kv_row + (uint64_t)m * d;
		const float *v = L->v + t * M.kv_row + (uint64_t)m * d;
		double s = 0;
		for (uint32_t c = 0; c < d; c++)
			s += (double)qh[c] * k[c];
		s *= scale;
		if (s > pt->mx) {
			const double r = exp(pt->mx - s);
			pt->sum *= r;
			for (uint32_t c = 0; c < d; c++)
				pt->acc[c] *= r;
			pt->mx = s;
		}
		const double w = exp(s - pt->mx);
		pt->sum += w;
		for (uint32_t c = 0; c < d; c++)
			pt->acc[c] += w * v[c];
	}
}

static void part_merge(struct part *a, const struct part *b)
{
	if (b->sum == 0)
		return;
	if (a->sum == 0) {
		*a = *b;
		return;
	}
	const double mx = a->mx > b->mx ? a->mx : b->mx;
	const double ra = exp(a->mx - mx), rb = exp(b->mx - mx);
	a->sum = a->sum * ra + b->sum * rb;
	for (uint32_t c = 0; c < M.d; c++)
		a->acc[c] = a->acc[c] * ra + b->acc[c] * rb;
	a->mx = mx;
}

/* Plain pages: the dtype's rounding of the output and the kernels' float
 * arithmetic. */
static double base_tol(void)
{
	return M.dtype == KVR_DTYPE_F32 ? 2e-5 : M.dtype == KVR_DTYPE_F16 ? 2e-3 : 1.6e-2;
}

/* Quantised pages are not compared bit for bit: a full page's keys and
 * values went through per-token asymmetric min/max quantisation (K8V4: keys
 * 8-bit, values 4-bit; K4V2 and mixed's demoted pages: 4 and 2), so each
 * element may be off by up to one step (range / (2^bits - 1)), plus the f16
 * rounding of scale and zero point. From that the bound on the output: the
 * values' error, plus the scores' error e^(2Δ) - 1 times half the values'
 * spread (Δ = the largest key error times |q|_1 / sqrt(d)). */
static double quant_bound(const struct lkv *L, uint32_t m, const float *qh, uint64_t t0, uint64_t t1,
			  double *verr_max)
{
	const uint32_t d = M.d, kbits = M.fmt == KVR_KV_FORMAT_K8V4 ? 8 : 4;
	const uint32_t vbits = M.fmt == KVR_KV_FORMAT_K8V4 ? 4 : 2;
	double q1 = 0, kerr = 0, verr = 0, spread = 0;
	for (uint32_t c = 0; c < d; c++)
		q1 += fabs(qh[c]);
	double vmin[MAX_D], vmax[MAX_D];
	for (uint32_t c = 0; c < d; c++)
		vmin[c] = INFINITY, vmax[c] = -INFINITY;
	for (uint64_t t = t0; t < t1; t++) {
		const float *k = L->k + t * M.kv_row + (uint64_t)m * d;
		const float *v = L->v + t * M.kv_row + (uint64_t)m * d;
		double kmn = INFINITY, kmx = -INFINITY, vmn = INFINITY, vmx = -INFINITY;
		for (uint32_t c = 0; c < d; c++) {
			kmn = fmin(kmn, k[c]), kmx = fmax(kmx, k[c]);
			vmn = fmin(vmn, v[c]), vmx = fmax(vmx, v[c]);
			vmin[c] = fmin(vmin[c], v[c]), vmax[c] = fmax(vmax[c], v[c]);
		}
		const double ke = (kmx - kmn) / ((1u << kbits) - 1) + 2e-3 * fmax(fabs(kmn), fabs(kmx)) + 1e-3;
		const double ve = (vmx - vmn) / ((1u << vbits) - 1) + 2e-3 * fmax(fabs(vmn), fabs(vmx)) + 1e-3;
		kerr = fmax(kerr, ke);
		verr = fmax(verr, ve);
	}
	for (uint32_t c = 0; c < d; c++)
		if (vmax[c] >= vmin[c])
			spread = fmax(spread, (vmax[c] - vmin[c]) / 2);
	if (verr_max)
		*verr_max = verr;
	const double delta = kerr * q1 / sqrt((double)d);
	return verr + (exp(2 * delta) - 1) * spread + base_tol();
}

static double tolerance(double want)
{
	return base_tol() * (1 + fabs(want));
}

/* Outputs of the G query heads of KV head m (rows of `out`, the dtype)
 * against parts `ref`; the largest excess over `tol` (<= 0: a match). */
static double excess(const struct part *ref, const void *out, uint32_t m, double tol_fixed)
{
	double worst = -INFINITY;
	for (uint32_t g = 0; g < M.G; g++) {
		const uint32_t h = m * M.G + g;
		for (uint32_t c = 0; c < M.d; c++) {
			const double want = ref[g].acc[c] / ref[g].sum;
			const double got = get(M.dtype, out, (size_t)h * M.d + c);
			const double tol = tol_fixed > 0 ? tol_fixed : tolerance(want);
			const double e = isfinite(got) ? fabs(got - want) - tol : INFINITY;
			worst = e > worst ? e : worst;
		}
	}
	return worst;
}

/* The sparse path's attended pages (docs/design.md, "The decode step": the
 * invariant): sink pages, the window — W/p newest full pages, and with
 * W = 0 the page the newest token just completed, which no selection could
 * have named — and the tail; candidates are the pages between sink and
 * window. */
static uint32_t window_first(uint64_t n)
{
	const uint32_t full = (uint32_t)(n / M.p), w = M.W / M.p;
	if (!w)
		return n && n % M.p == 0 ? full - 1 : full;
	return full > w ? full - w : 0;
}

/* One output row (query heads of one sequence at one layer) against what
 * the model stores, `n` tokens (the new one included). */
static void check_output(const struct lkv *L, uint64_t n, const float *q, const void *out,
			 int dense, uint32_t seq, uint32_t layer)
{
	struct part ref[KVR_MAX_GROUP];
	const uint32_t d = M.d, p = M.p;
	for (uint32_t m = 0; m < M.nkv; m++) {
		if (dense) {
			double tol = 0;
			for (uint32_t g = 0; g < M.G; g++) {
				const float *qh = q + (uint64_t)(m * M.G + g) * d;
				part_reset(&ref[g]);
				part_fold(&ref[g], qh, L, m, 0, n);
				if (M.fmt != KVR_KV_FORMAT_PLAIN)
					tol = fmax(tol, quant_bound(L, m, qh, 0, n, NULL));
			}
			const double e = excess(ref, out, m, tol);
			if (e > 0)
				fail(M.nhd_truncated ? K_NHD_TRUNCATE : 0, "sequence %u layer %u KV head %u: dense output off the reference over %" PRIu64
				     " tokens by %.3g beyond the tolerance (mode %s, %s, %s)",
				     seq, layer, m, n, e, kvr_mode_name(M.mode), kvr_dtype_name(M.dtype),
				     kvr_kv_format_name(M.fmt));
			T.dense_checks++;
			continue;
		}
		const uint32_t sink = M.S / p;
		const uint32_t wf = window_first(n);
		const int w0 = M.W == 0 && n % p == 0;
		/* Exact checks need plain pages; W = 0 at a page boundary is known case 9. */
		int exact = M.fmt == KVR_KV_FORMAT_PLAIN && (!w0 || known_case(K_WINDOW_ZERO));
		const uint32_t c0 = sink, c1 = wf > sink ? wf : sink, n_cand = c1 - c0;
		const uint32_t kk = M.k < n_cand ? M.k : n_cand;
		/* subsets of at most k candidates, while few enough to try them all */
		double combos = 0, term = 1;
		for (uint32_t i = 0; i <= kk; i++) {
			combos += term;
			term = term * (n_cand - i) / (i + 1);
		}
		if (exact && combos <= 6000) {
			struct part fixed[KVR_MAX_GROUP];
			struct part *cand = malloc((size_t)M.G * (n_cand ? n_cand : 1) * sizeof(*cand));
			if (!cand)
				fail(0, "out of memory in the reference");
			for (uint32_t g = 0; g < M.G; g++) {
				const float *qh = q + (uint64_t)(m * M.G + g) * d;
				part_reset(&fixed[g]);
				part_fold(&fixed[g], qh, L, m, 0, (uint64_t)(sink < wf ? sink : wf) * p);
				part_fold(&fixed[g], qh, L, m, (uint64_t)(wf > sink ? wf : sink) * p, n);
				for (uint32_t j = 0; j < n_cand; j++) {
					part_reset(&cand[g * n_cand + j]);
					part_fold(&cand[g * n_cand + j], qh, L, m, (uint64_t)(c0 + j) * p,
						  (uint64_t)(c0 + j + 1) * p);
				}
			}
			uint32_t idx[64];
			int found = 0;
			double best = INFINITY;
			for (uint32_t size = 0; size <= kk && !found; size++) {
				for (uint32_t i = 0; i < size; i++)
					idx[i] = i;
				for (;;) {
					for (uint32_t g = 0; g < M.G; g++) {
						ref[g] = fixed[g];
						for (uint32_t i = 0; i < size; i++)
							part_merge(&ref[g], &cand[g * n_cand + idx[i]]);
					}
					const double e = excess(ref, out, m, 0);
					best = e < best ? e : best;
					if (e <= 0) {
						found = 1;
						break;
					}
					/* next combination of `size` out of n_cand */
					int i = (int)size - 1;
					while (i >= 0 && idx[i] == n_cand - size + (uint32_t)i)
						i--;
					if (i < 0)
						break;
					idx[i]++;
					for (uint32_t j = (uint32_t)i + 1; j < size; j++)
						idx[j] = idx[j - 1] + 1;
				}
			}
			free(cand);
			if (!found)
				fail(w0 ? K_WINDOW_ZERO : M.nhd_truncated ? K_NHD_TRUNCATE : 0,
				     "sequence %u layer %u KV head %u (%" PRIu64 " tokens, mode %s, %s recall, S %u W %u B %u"
				     " k %u): the sparse output is attention over no set of sink + window + at most %u of "
				     "the %u candidate pages (closest misses the tolerance by %.3g)",
				     seq, layer, m, n, kvr_mode_name(M.mode), kvr_recall_name(M.recall), M.S, M.W,
				     M.B, M.k, kk, n_cand, best);
			T.exact_sparse_checks++;
			continue;
		}
		/* Otherwise: finite and within the stored values' range per dimension. */
		double verr = 0;
		if (M.fmt != KVR_KV_FORMAT_PLAIN)
			quant_bound(L, m, q, 0, n, &verr);
		for (uint32_t c = 0; c < d; c++) {
			double lo = INFINITY, hi = -INFINITY;
			for (uint64_t t = 0; t < n; t++) {
				const double v = L->v[t * M.kv_row + (uint64_t)m * d + c];
				lo = fmin(lo, v), hi = fmax(hi, v);
			}
			const double slack = verr + base_tol() * (1 + fmax(fabs(lo), fabs(hi)));
			for (uint32_t g = 0; g < M.G; g++) {
				const double got = get(M.dtype, out, (size_t)(m * M.G + g) * d + c);
				if (!isfinite(got) || got < lo - slack || got > hi + slack)
					fail(0, "sequence %u layer %u query head %u dim %u: sparse output %g outside the "
					     "stored values' range [%g, %g] (%" PRIu64 " tokens, mode %s, %s)",
					     seq, layer, m * M.G + g, c, got, lo, hi, n, kvr_mode_name(M.mode),
					     kvr_kv_format_name(M.fmt));
			}
		}
		T.bound_checks++;
	}
}

/* ------------------------------------------------------------------ configs */

static void base_config(struct kvr_config *c)
{
	kvr_config_init(c);
	c->n_layers = 1 + rnd(3);
	c->n_kv_heads = 1 + rnd(4);
	c->n_qo_heads = c->n_kv_heads * (1 + rnd(4));
	c->head_dim = chance(50) ? 32 : 64;
	c->dtype = rnd(3);
	c->page_tokens = 8u << rnd(3);
	const uint32_t p = c->page_tokens;
	c->sink_tokens = p * rnd(chance(50) ? 2 : 3);
	c->window_tokens = p * (chance(25) ? 0 : rnd(3));
	uint32_t k = rnd(4);
	if (!c->sink_tokens && !c->window_tokens && !k)
		k = 1;
	c->budget_tokens = c->sink_tokens + c->window_tokens + k * p;
	static const float taus[] = { 0.9f, 1.0f, -1.0f, 0.5f, 0.99f };
	c->tau = taus[rnd(5)];
	static const uint32_t modes[10] = { KVR_MODE_AUTO, KVR_MODE_AUTO, KVR_MODE_DENSE, KVR_MODE_BLOCKING,
					    KVR_MODE_BLOCKING, KVR_MODE_SPECULATIVE, KVR_MODE_SPECULATIVE,
					    KVR_MODE_SPECULATIVE, KVR_MODE_FREEKV, KVR_MODE_FREEKV };
	c->mode = modes[rnd(10)]; /* dense seldom: the sparse paths have more to get wrong */
	c->recall = rnd(3);
	c->kv_format = chance(50) ? KVR_KV_FORMAT_PLAIN : 1 + rnd(3);
	c->controller = rnd(3);
	c->threads = chance(85) ? 0 : 1;
	c->backend = chance(80) ? KVR_BACKEND_AUTO : KVR_BACKEND_CPU;
	const uint32_t dl = rnd(10);
	c->dense_layers[0] = dl < 3 ? 1 : dl < 8 ? 0 : rnd(1u << c->n_layers);
	c->max_sequences = 1 + rnd(6);
	c->max_batch = 1 + rnd(c->max_sequences);
	c->recall_buffers = 1 + rnd(2);
	c->recall_chunk_pages = 1 + rnd(8);
	c->spill_queue_depth = chance(50) ? 0 : 1 + rnd(64);
	if (c->kv_format == KVR_KV_FORMAT_PLAIN && chance(15))
		c->pool_layout = KVR_POOL_NHD;
	const uint64_t page = 2ull * p * c->head_dim * dtype_bytes(c->dtype) * c->n_kv_heads;
	/* a small pool, so that prefills exhaust it; quantised pages are smaller */
	const uint64_t pages = c->n_layers * (4 + rnd(40));
	/* quantised pages are 0.1-0.4x a plain one: fewer bytes for about as many */
	const uint64_t shrink = c->kv_format == KVR_KV_FORMAT_PLAIN ? 1 : c->dtype == KVR_DTYPE_F32 ? 8 : 4;
	c->pool_bytes = page * pages / shrink + rnd((uint32_t)page);
	if (c->pool_bytes < page * c->n_layers)
		c->pool_bytes = page * c->n_layers;
	if (c->pool_layout == KVR_POOL_HND && c->recall != KVR_RECALL_ZERO_COPY && chance(20) &&
	    pages > 10) {
		c->pool_ram_bytes = page * (8 + rnd((uint32_t)pages - 9));
		snprintf(c->spill_dir, sizeof(c->spill_dir), "%s", T.tmpdir);
	}
	if (chance(30)) {
		c->log_fn = log_cb;
		c->log_level = rnd(4);
	}
}

/* An invalid config: one field broken. Sets the expected error (0: any
 * negative) and the field its message must name; returns the known case
 * involved, or -1 when the case is skipped. */
static int broken_config(struct kvr_config *c, int *want, const char **field, int *size_case)
{
	base_config(c);
	c->log_fn = chance(50) ? log_cb : NULL;
	const uint32_t p = c->page_tokens;
	*want = -EINVAL;
	*size_case = 0;
	switch (rnd(49)) {
	case 0: c->n_layers = chance(50) ? 0 : KVR_MAX_LAYERS + 1 + rnd(1000); *field = "n_layers"; break;
	case 1: c->n_kv_heads = 0; *field = "n_kv_heads"; break;
	case 2: c->n_kv_heads = KVR_MAX_KV_HEADS + 1; c->n_qo_heads = c->n_kv_heads; *field = "n_kv_heads"; break;
	case 3: c->n_qo_heads = 0; *field = "n_qo_heads"; break;
	case 4: c->n_kv_heads = 2 + rnd(3); c->n_qo_heads = c->n_kv_heads * (1 + rnd(3)) + 1; *field = "n_qo_heads"; break;
	case 5: c->n_kv_heads = 1; c->n_qo_heads = KVR_MAX_GROUP + 1 + rnd(100); *field = "n_qo_heads"; *want = -ENOTSUP; break;
	case 6: c->head_dim = 0; *field = "head_dim"; break;
	case 7: c->head_dim = chance(50) ? 48 : 288; *field = "head_dim"; *want = -ENOTSUP; break;
	case 8: c->dtype = 3 + rnd(100); *field = "dtype"; *want = -ENOTSUP; break;
	case 9: { static const uint32_t bad[] = { 0, 4, 12, 24, 512 }; c->page_tokens = bad[rnd(5)]; *field = "page_tokens"; break; }
	case 10: c->sink_tokens += 1 + rnd(p - 1); *field = "sink_tokens"; break;
	case 11: c->window_tokens += 1 + rnd(p - 1); *field = "window_tokens"; break;
	case 12: c->budget_tokens = 0; *field = "budget_tokens"; break;
	case 13: c->budget_tokens += 1 + rnd(p - 1); *field = "budget_tokens"; break;
	case 14: c->sink_tokens = p; c->window_tokens = p; c->budget_tokens = p; *field = "budget_tokens"; break;
	case 15: { static const float bad[] = { 1.5f, -1.01f, INFINITY, -INFINITY }; c->tau = chance(25) ? NAN : bad[rnd(4)]; *field = "tau"; break; }
	case 16: c->mode = KVR_MODE_FREEKV + 1 + rnd(1000); *field = "mode"; break;
	case 17: c->backend = KVR_BACKEND_CUDA + 1 + rnd(1000); *field = "backend"; break;
	case 18: c->recall_buffers = chance(50) ? 0 : 3 + rnd(10); *field = "recall_buffers"; break;
	case 19: { const uint32_t l = c->n_layers + rnd(KVR_MAX_LAYERS - c->n_layers); c->dense_layers[l / 64] |= 1ull << (l % 64); *field = "dense_layers"; break; }
	case 20: c->max_sequences = 0; *field = "max_sequences"; break;
	case 21: c->max_batch = 0; *field = "max_batch"; break;
	case 22: c->max_batch = c->max_sequences + 1 + rnd(10); *field = "max_batch"; break;
	case 23: c->recall_chunk_pages = chance(50) ? 0 : 4097 + rnd(10000); *field = "recall_chunk_pages"; break;
	case 24: c->numa_node = chance(50) ? -2 : INT32_MIN; *field = "numa_node"; break;
	case 25: c->threads = 1025 + rnd(100000); *field = "threads"; break;
	case 26: c->recall = KVR_RECALL_STREAMED + 1 + rnd(100); *field = "recall"; break;
	case 27: c->controller = KVR_CONTROLLER_INLINE + 1 + rnd(100); *field = "controller"; break;
	case 28: c->pool_layout = KVR_POOL_NHD + 1 + rnd(100); *field = "pool_layout"; break;
	case 29: c->kv_format = KVR_KV_FORMAT_MIXED + 1 + rnd(100); *field = "kv_format"; break;
	case 30: c->kv_format = 1 + rnd(3); c->pool_layout = KVR_POOL_NHD; c->pool_ram_bytes = 0; *field = "kv_format"; break;
	case 31: c->spill_queue_depth = 4097 + rnd(100000); *field = "spill_queue_depth"; break;
	case 32: c->spill_reserved = 1 + rnd(100); *field = "spill_reserved"; break;
	case 33: memset(c->spill_dir, 'x', sizeof(c->spill_dir)); *field = "spill_dir"; break;
	case 34: c->kv_format = KVR_KV_FORMAT_PLAIN; c->pool_layout = KVR_POOL_NHD; c->pool_ram_bytes = c->pool_bytes / 2; *field = "pool_ram_bytes"; break;
	case 35: c->pool_layout = KVR_POOL_HND; c->recall = KVR_RECALL_ZERO_COPY; c->pool_ram_bytes = c->pool_bytes / 2; *field = "pool_ram_bytes"; break;
	case 36: c->device_free = NULL; c->device_alloc = (kvr_device_alloc_fn)(uintptr_t)1; if (chance(50)) { c->device_alloc = NULL; c->device_free = (kvr_device_free_fn)(uintptr_t)1; } *field = "device_"; break;
	case 37: c->log_level = KVR_LOG_DEBUG + 1 + rnd(100); *field = "log_level"; break;
	case 38: c->pool_bytes = 1 + rnd((uint32_t)(2ull * p * c->head_dim * dtype_bytes(c->dtype) * c->n_kv_heads * c->n_layers - 1)); c->pool_ram_bytes = 0; *field = "pool_bytes"; break;
	case 39: c->pool_bytes = UINT64_MAX - rnd(1000); c->pool_ram_bytes = 0; *field = "pool_bytes"; *want = -EOVERFLOW; break;
	case 40: c->device_bytes = UINT64_MAX - rnd(1000); *field = "device_bytes"; *want = -EOVERFLOW; break;
	case 41: /* kvr_device_bytes_needed says what one sequence needs: 1 byte is not it */
		if (!known_case(K_VALIDATE_BUDGETS))
			return -1;
		c->device_bytes = 1 + rnd(64); *field = "device_bytes"; *want = 0; return K_VALIDATE_BUDGETS;
	case 42: /* the spill tier needs RAM for 8 pages (docs/api.md) */
		if (!known_case(K_VALIDATE_BUDGETS))
			return -1;
		c->pool_layout = KVR_POOL_HND; c->recall = KVR_RECALL_STREAMED;
		c->pool_ram_bytes = 1 + rnd(1023); *field = "pool_ram_bytes"; return K_VALIDATE_BUDGETS;
	case 43: c->size = rnd(offsetof(struct kvr_config, recall)); *field = "size"; *size_case = 1; break;
	case 44:
		if (!known_case(K_CONFIG_SIZE))
			return -1;
		c->size = UINT32_MAX - rnd(3); *field = "size"; *size_case = 1; return K_CONFIG_SIZE;
	case 45: *size_case = 2; *field = "size"; break; /* a "newer" config setting a field we lack */
	case 46: /* every size overflows: 256 layers of 256 heads x 256 x f32, B near 2^32 */
		c->n_layers = KVR_MAX_LAYERS; c->n_kv_heads = c->n_qo_heads = KVR_MAX_KV_HEADS;
		c->head_dim = 256; c->dtype = KVR_DTYPE_F32; c->page_tokens = 256;
		c->sink_tokens = c->window_tokens = 0; c->budget_tokens = UINT32_MAX / 256 * 256;
		c->max_sequences = c->max_batch = 64; c->pool_bytes = 0; c->pool_ram_bytes = 0;
		*field = "budget_tokens"; *want = -EOVERFLOW; break;
	case 47: c->recall_buffers = 0; c->n_layers = 0; *field = "n_layers"; break; /* the first at fault */
	default: /* between one and two groups */
		if (c->n_kv_heads == 1)
			c->n_kv_heads = 2;
		c->n_qo_heads = c->n_kv_heads + 1 + rnd(c->n_kv_heads - 1);
		*field = "n_qo_heads";
		break;
	}
	return 0;
}

/* Config checks: validate, device_bytes_needed and create agree, and each
 * failure has a message naming the field. Creates a context only for
 * configs that validate (machine facts may still refuse them). */
static void op_config_trial(void)
{
	T.op = "config";
	/* room past the struct: a "newer" config of up to 64 more bytes */
	static unsigned char buf[sizeof(struct kvr_config) + 64];
	struct kvr_config *c = (struct kvr_config *)buf;
	memset(buf, 0, sizeof(buf));
	int want = 0, size_case = 0, known = 0;
	const char *field = NULL;
	int valid = 0;
	if (chance(25)) {
		/* valid but unusual: an old (0.1) or a newer size, machine facts */
		base_config(c);
		switch (rnd(4)) {
		case 0: c->size = (uint32_t)offsetof(struct kvr_config, recall); break;
		case 1: c->size = (uint32_t)sizeof(struct kvr_config) + 8 * (1 + rnd(8)); break;
		case 2: c->numa_node = 64 + rnd(1000); break; /* may not exist here */
		default: c->backend = KVR_BACKEND_CUDA; break;  /* -ENODEV without a GPU */
		}
		valid = 1;
	} else {
		known = broken_config(c, &want, &field, &size_case);
		if (known < 0)
			return;
		if (size_case == 2) {
			c->size = (uint32_t)sizeof(struct kvr_config) + 8 * (1 + rnd(8));
			buf[sizeof(struct kvr_config) + rnd(c->size - (uint32_t)sizeof(struct kvr_config))] = 1 + rnd(255);
		}
		T.invalid_configs++;
	}
	const int logged = c->log_fn && !size_case;

	char msg[MSG + 16];
	memset(msg, 0x5a, sizeof(msg));
	say("config_validate(case %s)", field ? field : "valid");
	const int v = kvr_config_validate(c, msg, MSG);
	if (!valid) {
		if (v >= 0 || (want && v != want))
			fail(known, "config_validate(%s broken) = %d, expected %d", field, v, want);
		if (!memchr(msg, 0, MSG) || !strstr(msg, field))
			fail(known, "config_validate(%s broken) = %d: message \"%.*s\" does not name the field",
			     field, v, MSG, msg);
		T.expected_errors++;
	} else if (v) {
		fail(0, "config_validate refused a valid config: %d \"%s\"", v, msg);
	}
	for (int i = 0; i < 16; i++)
		if ((unsigned char)msg[MSG + i] != 0x5a)
			fail(known, "config_validate wrote past message_bytes");
	/* no message buffer, and a short one: the same verdict, NUL-terminated */
	say("config_validate(NULL message)");
	if (kvr_config_validate(c, NULL, 0) != v)
		fail(known, "config_validate without a message buffer disagrees (%d)", v);
	const size_t small = 1 + rnd(8);
	memset(msg, 0x5a, sizeof(msg));
	say("config_validate(message of %zu bytes)", small);
	if (kvr_config_validate(c, msg, small) != v || (v && !memchr(msg, 0, small)) ||
	    (unsigned char)msg[small] != 0x5a)
		fail(known, "config_validate with a %zu-byte message buffer misbehaves", small);
	const uint64_t unset = 0xdeadbeefdeadbeefull;
	uint64_t fixed = unset, per = unset;
	say("device_bytes_needed");
	const int dn = kvr_device_bytes_needed(c, &fixed, &per);
	if (dn != v)
		fail(known, "device_bytes_needed = %d but config_validate = %d", dn, v);
	/* (0 is possible: on cuda, zero-copy dense layers are not budgeted) */
	if (!dn && (fixed == unset || per == unset))
		fail(0, "device_bytes_needed succeeded without writing both sizes (%" PRIu64 ", %" PRIu64 ")", fixed, per);

	struct kvr_context *ctx = (struct kvr_context *)(uintptr_t)0x1;
	arm(NULL, "context_create");
	say("context_create(%s)", field ? field : "valid");
	const int rc = kvr_context_create(c, &ctx);
	if (!valid) {
		if (rc != v)
			fail(known, "config_validate = %d but context_create = %d (%s broken): they must agree "
			     "on everything the config alone decides", v, rc, field);
		expect_fail(rc, v, NULL, field, 0, known);
		if (logged && atomic_load(&log_errors) == log_armed)
			fail(known, "context_create failed (%s) without telling the config's log callback", field);
		if (ctx != (struct kvr_context *)(uintptr_t)0x1)
			fail(known, "context_create failed but wrote *out");
		return;
	}
	if (rc == 0) {
		say("context_destroy");
		kvr_context_destroy(ctx);
		return;
	}
	/* a valid config may still need what this machine lacks */
	const int machine = c->backend == KVR_BACKEND_CUDA || c->numa_node >= 64;
	if (!machine)
		fail(0, "context_create refused a config that validates: %d \"%s\"", rc, kvr_last_error(NULL));
	expect_fail(rc, c->backend == KVR_BACKEND_CUDA ? -ENODEV : 0, NULL, NULL, 0, 0);
}

/* ------------------------------------------------------------------ context life */

static void model_free(void)
{
	for (uint32_t i = 0; M.seq && i < M.max_seq; i++) {
		for (uint32_t l = 0; l < M.nl; l++) {
			free(M.seq[i].l[l].k);
			free(M.seq[i].l[l].v);
		}
		free(M.seq[i].l);
		free(M.seq[i].prev_q);
	}
	free(M.seq);
	free(M.bseq), free(M.bpos), free(M.bfail), free(M.bfail_layer), free(M.ldone), free(M.pre);
	free(M.qf), free(M.kf), free(M.vf), free(M.q), free(M.kb), free(M.vb), free(M.out), free(M.status);
	memset(&M, 0, sizeof(M));
}

static int context_open(void)
{
	struct kvr_config c;
	base_config(&c);
	uint64_t fixed = 0, per = 0;
	say("device_bytes_needed");
	expect_ok(kvr_device_bytes_needed(&c, &fixed, &per), NULL);
	if (chance(20)) /* a device budget that admits fewer sequences than max_sequences */
		c.device_bytes = fixed + per * (1 + rnd(c.max_sequences)) + rnd((uint32_t)per);
	say("config_validate");
	char msg[MSG];
	if (kvr_config_validate(&c, msg, sizeof(msg)))
		fail(0, "a valid config does not validate: %s", msg);
	say("context_create");
	struct kvr_context *ctx = NULL;
	int rc = kvr_context_create(&c, &ctx);
	if (rc)
		fail(0, "context_create refused a valid config: %d \"%s\"", rc, kvr_last_error(NULL));
	T.contexts++;
	memset(&M, 0, sizeof(M));
	M.ctx = ctx;
	M.cfg = c;
	struct kvr_config r;
	kvr_config_init(&r);
	say("context_get_config");
	expect_ok(kvr_context_get_config(ctx, &r), ctx);
	if (r.n_layers != c.n_layers || r.n_qo_heads != c.n_qo_heads || r.n_kv_heads != c.n_kv_heads ||
	    r.head_dim != c.head_dim || r.dtype != c.dtype || r.page_tokens != c.page_tokens ||
	    r.budget_tokens != c.budget_tokens || r.sink_tokens != c.sink_tokens ||
	    r.window_tokens != c.window_tokens || r.kv_format != c.kv_format ||
	    r.max_sequences != c.max_sequences || r.max_batch != c.max_batch ||
	    memcmp(r.dense_layers, c.dense_layers, sizeof(r.dense_layers)) ||
	    (c.mode && r.mode != c.mode) || (c.recall && r.recall != c.recall) ||
	    (c.pool_bytes && r.pool_bytes != c.pool_bytes) || !r.mode || !r.recall ||
	    r.backend != KVR_BACKEND_CPU || !r.controller || r.size != sizeof(r))
		fail(0, "context_get_config differs from the config handed in (or left an automatic field)");
	M.nl = c.n_layers, M.nkv = c.n_kv_heads, M.nqo = c.n_qo_heads, M.d = c.head_dim;
	M.G = M.nqo / M.nkv, M.p = c.page_tokens, M.S = c.sink_tokens, M.W = c.window_tokens;
	M.B = c.budget_tokens, M.k = (M.B - M.S - M.W) / M.p, M.dtype = c.dtype, M.fmt = c.kv_format;
	M.mode = r.mode, M.recall = r.recall, M.max_seq = c.max_sequences, M.max_batch = c.max_batch;
	M.spill = c.pool_ram_bytes && c.pool_ram_bytes < c.pool_bytes;
	M.log_on = c.log_fn != NULL;
	M.dev_fixed = fixed, M.dev_per_seq = per, M.dev_bytes = r.device_bytes;
	M.kv_row = (uint64_t)M.nkv * M.d, M.q_row = (uint64_t)M.nqo * M.d;
	M.plain_page = 2ull * M.p * M.d * dtype_bytes(M.dtype) * M.nkv;
	/* the most pages the pool can hold: its bytes over the smallest page a
	 * format can have (K4V2: 6 bits per key/value pair, scales not counted) */
	M.pool_pages_max = c.pool_bytes / (M.fmt == KVR_KV_FORMAT_PLAIN ? M.plain_page
								    : (uint64_t)M.p * M.d * 6 / 8 * M.nkv);
	M.seq = calloc(M.max_seq, sizeof(*M.seq));
	for (uint32_t i = 0; i < M.max_seq; i++) {
		M.seq[i].l = calloc(M.nl, sizeof(struct lkv));
		M.seq[i].prev_q = calloc((size_t)M.nl * M.q_row, sizeof(float));
	}
	M.bseq = calloc(M.max_batch + 1, sizeof(*M.bseq));
	M.bpos = calloc(M.max_batch + 1, sizeof(*M.bpos));
	M.bfail = calloc(M.max_batch, sizeof(*M.bfail));
	M.bfail_layer = calloc(M.max_batch, sizeof(*M.bfail_layer));
	M.ldone = calloc(M.nl, 1);
	M.pre = calloc((size_t)M.max_batch * M.nl, sizeof(*M.pre));
	const size_t rows = M.max_batch > 4 * 32 ? M.max_batch : 4 * 32; /* prefill chunks too */
	M.qf = malloc(rows * M.q_row * sizeof(float));
	M.kf = malloc(rows * M.kv_row * sizeof(float));
	M.vf = malloc(rows * M.kv_row * sizeof(float));
	M.q = malloc(rows * M.q_row * 4);
	M.kb = malloc(rows * M.kv_row * 4);
	M.vb = malloc(rows * M.kv_row * 4);
	M.out = malloc(rows * M.q_row * 4);
	M.status = malloc((M.max_batch + 1) * sizeof(int32_t));
	if (!M.seq || !M.bseq || !M.pre || !M.qf || !M.out || !M.status)
		fail(0, "out of memory in the model");
	M.trace = 0;
	M.last.size = sizeof(M.last);
	if (T.verbose || (T.verbose_from && T.calls >= T.verbose_from))
		printf("  context: %u layers %u/%u heads d %u %s p %u S %u W %u B %u (k %u) mode %s recall %s %s "
		       "pool %" PRIu64 " ram %" PRIu64 " max_seq %u max_batch %u dense_layers %#" PRIx64
		       " layout %u controller %u threads %u buffers %u chunk %u device_bytes %" PRIu64 " tau %g\n",
		       M.nl, M.nqo, M.nkv, M.d, kvr_dtype_name(M.dtype), M.p, M.S, M.W, M.B, M.k,
		       kvr_mode_name(M.mode), kvr_recall_name(M.recall), kvr_kv_format_name(M.fmt),
		       c.pool_bytes, c.pool_ram_bytes, M.max_seq, M.max_batch, c.dense_layers[0], c.pool_layout,
		       c.controller, c.threads, c.recall_buffers, c.recall_chunk_pages, c.device_bytes, (double)c.tau);
	return 0;
}

/* ------------------------------------------------------------------ sequences */

static int admits_one_more(void)
{
	return M.n_alive < M.max_seq && M.dev_fixed + (M.n_alive + 1) * M.dev_per_seq <= M.dev_bytes;
}

static void op_seq_create(void)
{
	T.op = "seq_create";
	uint32_t id = UINT32_MAX;
	if (chance(4)) {
		arm(NULL, "seq_create");
		say("seq_create(NULL ctx)");
		expect_fail(kvr_seq_create(NULL, &id), -EINVAL, NULL, "seq_create", 0, 0);
		return;
	}
	if (chance(4)) {
		arm(M.ctx, "seq_create");
		say("seq_create(NULL id)");
		expect_fail(kvr_seq_create(M.ctx, NULL), -EINVAL, M.ctx, "seq_create", M.log_on, 0);
		return;
	}
	arm(M.ctx, "seq_create");
	say("seq_create");
	const int rc = kvr_seq_create(M.ctx, &id);
	if (!admits_one_more()) {
		expect_fail(rc, -ENOSPC, M.ctx, "seq_create", M.log_on, 0);
		return;
	}
	expect_ok(rc, M.ctx);
	if (id >= M.max_seq)
		fail(0, "seq_create gave id %u, max_sequences is %u", id, M.max_seq);
	mseq_open(id);
}

static int busy(uint32_t seq)
{
	return M.step_open && M.seq[seq].in_step;
}

/* A call on a dead id, with a NULL context null_percent % of the time: refused
 * with -EINVAL, logged when the context is there. */
static void refuse_dead_id(const char *op, uint32_t null_percent,
			   int (*call)(struct kvr_context *, uint32_t))
{
	const uint32_t id = dead_id();
	const int nul = chance(null_percent);
	struct kvr_context *ctx = nul ? NULL : M.ctx;
	arm(ctx, op);
	say("%s(%s%u)", op, nul ? "NULL ctx, " : "", id);
	expect_fail(call(ctx, id), -EINVAL, ctx, op, !nul && M.log_on, 0);
}

static int truncate_to_zero(struct kvr_context *ctx, uint32_t id)
{
	return kvr_seq_truncate(ctx, id, 0);
}

/* A live sequence to free or truncate: one in the open step only while that
 * case is still to be seen; UINT32_MAX when there is none. */
static uint32_t pick_seq_to_change(void)
{
	const uint32_t id = pick_seq(0, 1);
	if (busy(id) && !known_case(K_STEP_MEMBER))
		return pick_seq(0, 0);
	return id;
}

static void op_seq_free(void)
{
	T.op = "seq_free";
	if (chance(10) || !M.n_alive) {
		refuse_dead_id("seq_free", 20, kvr_seq_free);
		return;
	}
	const uint32_t id = pick_seq_to_change();
	if (id == UINT32_MAX)
		return;
	arm(M.ctx, "seq_free");
	say("seq_free(%u)%s", id, busy(id) ? " in the open step" : "");
	const int rc = kvr_seq_free(M.ctx, id);
	if (busy(id)) {
		expect_fail(rc, -EBUSY, M.ctx, "seq_free", M.log_on, K_STEP_MEMBER);
		check_lengths("seq_free refused");
		return;
	}
	expect_ok(rc, M.ctx);
	mseq_close(id);
}

static void op_seq_fork(void)
{
	T.op = "seq_fork";
	uint32_t dst = UINT32_MAX;
	if (chance(8) || !M.n_alive) {
		const int v = rnd(3);
		const uint32_t src = v == 0 ? dead_id() : pick_seq(0, 0);
		if (src == UINT32_MAX)
			return;
		struct kvr_context *ctx = v == 2 ? NULL : M.ctx;
		arm(ctx, "seq_fork");
		say("seq_fork(%s, %u, %s)", ctx ? "ctx" : "NULL", src, v == 1 ? "NULL dst" : "dst");
		expect_fail(kvr_seq_fork(ctx, src, v == 1 ? NULL : &dst), -EINVAL, ctx, "seq_fork",
			    ctx && M.log_on, 0);
		return;
	}
	uint32_t src = pick_seq(0, 1);
	if (busy(src) && (!admits_one_more() || !known_case(K_STEP_MEMBER)))
		src = pick_seq(0, 0);
	if (src == UINT32_MAX)
		return;
	arm(M.ctx, "seq_fork");
	say("seq_fork(%u)%s", src, busy(src) ? " in the open step" : "");
	const int rc = kvr_seq_fork(M.ctx, src, &dst);
	if (busy(src)) {
		expect_fail(rc, -EBUSY, M.ctx, "seq_fork", M.log_on, K_STEP_MEMBER);
		check_lengths("seq_fork refused");
		return;
	}
	if (!admits_one_more()) {
		expect_fail(rc, -ENOSPC, M.ctx, "seq_fork", M.log_on, 0);
		check_lengths("seq_fork refused");
		return;
	}
	if (rc == -ENOMEM) { /* the partial tail's page may not fit */
		expect_fail(rc, -ENOMEM, M.ctx, "seq_fork", M.log_on, 0);
		check_lengths("seq_fork out of pool pages");
		return;
	}
	expect_ok(rc, M.ctx);
	if (dst >= M.max_seq)
		fail(0, "seq_fork gave id %u, max_sequences is %u", dst, M.max_seq);
	mseq_open(dst);
	for (uint32_t l = 0; l < M.nl; l++) {
		const struct lkv *from = &M.seq[src].l[l];
		lkv_append(&M.seq[dst].l[l], from->k, from->v, from->n);
	}
	if (chance(30))
		check_lengths("seq_fork");
}

static void op_seq_truncate(void)
{
	T.op = "seq_truncate";
	if (chance(8) || !M.n_alive) {
		refuse_dead_id("seq_truncate", 25, truncate_to_zero);
		return;
	}
	const uint32_t id = pick_seq_to_change();
	if (id == UINT32_MAX)
		return;
	const uint64_t have = min_len(&M.seq[id]);
	uint64_t n;
	int bad = 0;
	if (chance(12)) { /* beyond some layer's length */
		uint64_t most = 0;
		for (uint32_t l = 0; l < M.nl; l++)
			most = M.seq[id].l[l].n > most ? M.seq[id].l[l].n : most;
		static const uint64_t far[] = { 1, 2, 1000, UINT64_MAX };
		n = chance(50) ? have + 1 + rnd((uint32_t)(most - have + 1)) : far[rnd(4)] + most;
		if (n < most)
			n = UINT64_MAX;
		bad = 1;
	} else {
		n = chance(30) ? have : have - rnd((uint32_t)(have < 3 * M.p ? have + 1 : 3 * M.p));
	}
	/* keeping part of an offloaded page of an NHD pool is known case 12 */
	int nhd_page = 0;
	for (uint32_t l = 0; l < M.nl && !bad; l++)
		nhd_page |= M.cfg.pool_layout == KVR_POOL_NHD && n % M.p && n / M.p != M.seq[id].l[l].n / M.p;
	if (nhd_page && !known_case(K_NHD_TRUNCATE))
		n -= n % M.p;
	M.nhd_truncated |= nhd_page && !T.skip[K_NHD_TRUNCATE];
	arm(M.ctx, "seq_truncate");
	say("seq_truncate(%u, %" PRIu64 ")%s", id, n, busy(id) ? " in the open step" : "");
	const int rc = kvr_seq_truncate(M.ctx, id, n);
	if (busy(id)) {
		expect_fail(rc, bad ? 0 : -EBUSY, M.ctx, "seq_truncate", M.log_on, K_STEP_MEMBER);
		check_lengths("seq_truncate refused");
		return;
	}
	if (bad) {
		expect_fail(rc, -EINVAL, M.ctx, "seq_truncate", M.log_on, 0);
		check_lengths("seq_truncate refused");
		return;
	}
	if (rc && M.spill) { /* a page to keep could not be read back into RAM */
		expect_fail(rc, 0, M.ctx, "seq_truncate", M.log_on, 0);
		check_lengths("seq_truncate refused");
		return;
	}
	expect_ok(rc, M.ctx);
	for (uint32_t l = 0; l < M.nl; l++)
		M.seq[id].l[l].n = n;
	if (chance(30))
		check_lengths("seq_truncate");
}

/* ------------------------------------------------------------------ prefill */

/* Rows of new K/V for `n` tokens: the model's floats and the dtype buffers. */
static void gen_kv(uint32_t n)
{
	for (uint64_t i = 0; i < n * M.kv_row; i++) {
		M.kf[i] = kv_value();
		M.vf[i] = kv_value();
		put(M.dtype, M.kb, i, M.kf[i]);
		put(M.dtype, M.vb, i, M.vf[i]);
	}
}

/* One kvr_prefill the model expects to succeed (or run out of pool pages). */
static int prefill_one(uint32_t id, uint32_t layer, uint32_t n)
{
	struct lkv *L = &M.seq[id].l[layer];
	gen_kv(n);
	arm(M.ctx, "prefill");
	say("prefill(%u, layer %u, at %" PRIu64 ", %u tokens)", id, layer, L->n, n);
	const int rc = kvr_prefill(M.ctx, id, layer, L->n, n, M.kb, M.vb);
	if (busy(id)) {
		expect_fail(rc, -EBUSY, M.ctx, "prefill", M.log_on, K_STEP_MEMBER);
		check_lengths("prefill refused");
		return rc;
	}
	if (rc == -ENOMEM || (M.spill && rc == -ENOSPC)) {
		expect_fail(rc, rc, M.ctx, "prefill", M.log_on, 0);
		check_lengths("prefill out of pool pages");
		return rc;
	}
	expect_ok(rc, M.ctx);
	lkv_append(L, M.kf, M.vf, n);
	return 0;
}

static void op_prefill(void)
{
	T.op = "prefill";
	uint32_t id = pick_seq(0, 1);
	if (id != UINT32_MAX && busy(id) && !known_case(K_STEP_MEMBER))
		id = pick_seq(0, 0);
	if (chance(12) || id == UINT32_MAX) {
		/* one fault: an id, a layer, a position, NULL data, a size */
		const int v = id == UINT32_MAX ? 0 : (int)rnd(7);
		uint32_t layer = rnd(M.nl), n = 1 + rnd(2 * M.p);
		uint64_t pos = id == UINT32_MAX ? 0 : M.seq[id].l[layer].n;
		const void *k = M.kb, *vv = M.vb;
		struct kvr_context *ctx = M.ctx;
		int want = -EINVAL;
		if (v == 0)
			id = dead_id();
		else if (v == 1)
			layer = M.nl + rnd(3) * (chance(50) ? 1 : UINT32_MAX / 4);
		else if (v == 2) { /* out of order, or wrapping */
			static const uint64_t bad[] = { 1, 2, UINT64_MAX };
			pos = chance(60) ? pos + bad[rnd(3)] : pos ? pos - 1 : UINT64_MAX - 1;
		} else if (v == 3 && chance(50))
			k = NULL;
		else if (v == 3)
			vv = NULL;
		else if (v == 4)
			ctx = NULL;
		else if (v == 5) { /* more tokens than any pool here holds: refused before reading */
			n = UINT32_MAX - rnd(16);
			want = -ENOMEM;
		} else {
			if (busy(id))
				return;
			/* no tokens: nothing to store, and NULL data is fine */
			arm(M.ctx, "prefill");
			say("prefill(%u, layer %u, 0 tokens, NULL data)", id, layer);
			expect_ok(kvr_prefill(M.ctx, id, layer, pos, 0, NULL, NULL), M.ctx);
			return;
		}
		if (id < M.max_seq && busy(id) && v != 0)
			return; /* one fault at a time */
		gen_kv(n < 4 * 32 ? n : 1);
		arm(ctx, "prefill");
		say("prefill(%s, %u, layer %u, at %" PRIu64 ", %u tokens, %s) [fault %d]", ctx ? "ctx" : "NULL", id,
		    layer, pos, n, k && vv ? "data" : "NULL data", v);
		expect_fail(kvr_prefill(ctx, id, layer, pos, n, k, vv), want, ctx, "prefill",
			    ctx && M.log_on, 0);
		check_lengths("prefill refused");
		return;
	}
	const uint32_t max_chunk = 3 * M.p < 4 * 32 ? 3 * M.p : 4 * 32;
	if (chance(70)) { /* the same chunk size in every layer, as an engine does */
		const uint32_t n = 1 + rnd(max_chunk);
		for (uint32_t l = 0; l < M.nl; l++)
			if (prefill_one(id, l, n))
				return;
	} else {
		prefill_one(id, rnd(M.nl), 1 + rnd(max_chunk));
	}
}

/* Prefill one layer until the pool says no: it must, within its capacity. */
static void op_prefill_fill(void)
{
	T.op = "prefill(fill)";
	const uint32_t id = pick_seq(0, 0);
	if (id == UINT32_MAX)
		return;
	const uint32_t layer = rnd(M.nl), chunk = 4 * 32 < 4 * M.p ? 4 * 32 : 4 * M.p;
	for (uint32_t i = 0; i < 1000; i++) {
		if (prefill_one(id, layer, chunk))
			return;
		uint64_t total = 0;
		for (uint32_t s = 0; s < M.max_seq; s++)
			for (uint32_t l = 0; M.seq[s].alive && l < M.nl; l++)
				total += M.seq[s].l[l].n;
		/* forks share pages, so only a sequence's own tokens bound it */
		uint64_t own = 0;
		for (uint32_t l = 0; l < M.nl; l++)
			own += (M.seq[id].l[l].n + M.p - 1) / M.p;
		if (own > M.pool_pages_max + M.nl)
			fail(0, "the pool took %" PRIu64 " pages for one sequence; pool_bytes holds at most %" PRIu64,
			     own, M.pool_pages_max);
		(void)total;
	}
	fail(0, "1000 prefills of %u tokens never exhausted a pool of %" PRIu64 " bytes", chunk,
	     M.cfg.pool_bytes);
}

/* Causal attention of queries at positions first..first+n-1 against the model. */
static void op_prefill_attention(void)
{
	T.op = "prefill_attention";
	const uint32_t id = pick_seq(0, 1);
	const uint32_t layer = rnd(M.nl);
	const uint64_t have = id == UINT32_MAX ? 0 : M.seq[id].l[layer].n;
	if (chance(12) || !have) {
		const int v = id == UINT32_MAX ? 0 : (int)rnd(6);
		uint32_t sid = id, lay = layer, n = 1 + rnd(4);
		uint64_t first = 0;
		struct kvr_context *ctx = M.ctx;
		const void *q = M.q;
		void *out = M.out;
		int want = -EINVAL, known = 0;
		if (v == 0)
			sid = dead_id();
		else if (v == 1)
			lay = M.nl + rnd(5);
		else if (v == 2)
			first = have + rnd(3), n = 1 + rnd(3); /* not stored yet */
		else if (v == 3 && chance(50))
			q = NULL;
		else if (v == 3)
			out = NULL;
		else if (v == 4)
			ctx = NULL;
		else { /* positions that wrap around 2^64 */
			if (!known_case(K_PREFILL_ATTN_WRAP))
				return;
			first = UINT64_MAX - rnd(2), n = 2 + rnd(3), known = K_PREFILL_ATTN_WRAP;
			want = 0;
		}
		if (M.step_open)
			want = 0; /* -EBUSY or the fault's own code, as the checks' order has it */
		arm(ctx, "prefill_attention");
		say("prefill_attention(%s, %u, layer %u, at %" PRIu64 ", %u) [fault %d]", ctx ? "ctx" : "NULL", sid,
		    lay, first, n, v);
		expect_fail(kvr_prefill_attention(ctx, sid, lay, first, n, q, out), want, ctx,
			    "prefill_attention", ctx && M.log_on, known);
		check_lengths("prefill_attention refused");
		return;
	}
	const uint64_t first = rnd((uint32_t)have);
	const uint32_t room = (uint32_t)(have - first), n = 1 + rnd(room < 40 ? room : 40);
	for (uint64_t i = 0; i < n * M.q_row; i++) {
		M.qf[i] = kv_value() * (M.fmt ? 0.5f : 2.0f);
		put(M.dtype, M.q, i, M.qf[i]);
	}
	memset(M.out, 0xff, n * M.q_row * dtype_bytes(M.dtype)); /* NaN: unwritten rows show */
	arm(M.ctx, "prefill_attention");
	say("prefill_attention(%u, layer %u, at %" PRIu64 ", %u)", id, layer, first, n);
	const int rc = kvr_prefill_attention(M.ctx, id, layer, first, n, M.q, M.out);
	if (M.step_open) {
		expect_fail(rc, -EBUSY, M.ctx, "prefill_attention", M.log_on, 0);
		return;
	}
	if (rc && M.spill) { /* the pages up to the last query must fit in RAM together */
		expect_fail(rc, 0, M.ctx, "prefill_attention", M.log_on, 0);
		return;
	}
	expect_ok(rc, M.ctx);
	const struct lkv *L = &M.seq[id].l[layer];
	for (uint32_t t = 0; t < n; t++) {
		const float *q = M.qf + t * M.q_row;
		const unsigned char *out = (const unsigned char *)M.out + t * M.q_row * dtype_bytes(M.dtype);
		struct part ref[KVR_MAX_GROUP];
		for (uint32_t m = 0; m < M.nkv; m++) {
			double tol = 0;
			for (uint32_t g = 0; g < M.G; g++) {
				const float *qh = q + (uint64_t)(m * M.G + g) * M.d;
				part_reset(&ref[g]);
				part_fold(&ref[g], qh, L, m, 0, first + t + 1);
				if (M.fmt != KVR_KV_FORMAT_PLAIN)
					tol = fmax(tol, quant_bound(L, m, qh, 0, first + t + 1, NULL));
			}
			const double e = excess(ref, out, m, tol);
			if (e > 0)
				fail(M.nhd_truncated ? K_NHD_TRUNCATE : 0, "prefill_attention of sequence %u layer %u position %" PRIu64 " KV head %u: off "
				     "the causal reference by %.3g beyond the tolerance (%s, %s)",
				     id, layer, first + t, m, e, kvr_dtype_name(M.dtype), kvr_kv_format_name(M.fmt));
		}
		T.prefill_attention_checks++;
	}
}

/* ------------------------------------------------------------------ decode */

static void op_decode_begin(void)
{
	T.op = "decode_begin";
	uint32_t cand[256], nc = 0;
	const int prefer_even = chance(90);
	for (uint32_t i = 0; i < M.max_seq; i++) {
		if (!M.seq[i].alive || (prefer_even && !even(&M.seq[i])))
			continue;
		/* its position (layer 0's length) below another layer's length is
		 * known case 10 */
		uint64_t most = 0;
		for (uint32_t l = 0; l < M.nl; l++)
			most = M.seq[i].l[l].n > most ? M.seq[i].l[l].n : most;
		if (most > M.seq[i].l[0].n && !known_case(K_BAD_POSITION))
			continue;
		cand[nc++] = i;
	}
	for (uint32_t i = 0; i + 1 < nc; i++) { /* shuffle */
		const uint32_t j = i + rnd(nc - i), t = cand[i];
		cand[i] = cand[j], cand[j] = t;
	}
	uint32_t b = nc ? 1 + rnd(nc < M.max_batch ? nc : M.max_batch) : 0;
	int fault = -1;
	if (M.step_open)
		fault = 6;
	else if (!b || chance(6))
		fault = (int)rnd(6);
	if (fault >= 0) {
		/* one fault, in arrays of its own (an open step's batch stays) */
		uint32_t fs[8];
		uint64_t fp[8];
		uint32_t fb = b ? b : 1;
		for (uint32_t i = 0; i < 8; i++)
			fs[i] = i % M.max_seq, fp[i] = 0;
		for (uint32_t i = 0; i < b; i++)
			fs[i] = cand[i], fp[i] = M.seq[cand[i]].l[0].n;
		const uint32_t *ps = fs;
		const uint64_t *pp = fp;
		struct kvr_context *ctx = M.ctx;
		int want = -EINVAL;
		switch (fault) {
		case 0: fb = 0; break;
		case 1: fb = M.max_batch + 1; break; /* refused on its size alone */
		case 2: fs[rnd(fb)] = dead_id(); break;
		case 3: if (chance(50)) ps = NULL; else pp = NULL; break;
		case 4: if (fb >= 2) fs[1] = fs[0]; else fs[0] = dead_id(); break;
		case 5: ctx = NULL; break;
		default: want = -EBUSY; break;
		}
		arm(ctx, "decode_begin");
		say("decode_begin(batch %u) [fault %d]", fb, fault);
		expect_fail(kvr_decode_begin(ctx, ps, pp, fb), want, ctx, "decode_begin", ctx && M.log_on, 0);
		return;
	}
	for (uint32_t i = 0; i < b; i++) {
		M.bseq[i] = cand[i];
		M.bpos[i] = M.seq[cand[i]].l[0].n;
	}
	M.bad_below = 0;
	for (uint32_t i = 0; i < b; i++) { /* now and then a position the sequence is not at */
		if (!chance(4))
			continue;
		const uint64_t len = M.bpos[i];
		if (len && chance(40)) {
			if (!known_case(K_BAD_POSITION))
				continue;
			M.bpos[i] = len - 1 - rnd((uint32_t)(len < 4 ? len : 4));
		} else {
			M.bpos[i] = chance(70) ? len + 1 + rnd(2) : UINT64_MAX - rnd(2);
		}
	}
	for (uint32_t i = 0; i < b; i++)
		for (uint32_t l = 0; l < M.nl; l++)
			if (M.bpos[i] < M.seq[M.bseq[i]].l[l].n)
				M.bad_below = 1;
	char list[256];
	size_t at = 0;
	for (uint32_t i = 0; i < b && at < sizeof(list); i++)
		at += (size_t)snprintf(list + at, sizeof(list) - at, "%s%u at %" PRIu64, i ? ", " : "", M.bseq[i],
				       M.bpos[i]);
	arm(M.ctx, "decode_begin");
	say("decode_begin(%s)", list);
	expect_ok(kvr_decode_begin(M.ctx, M.bseq, M.bpos, b), M.ctx);
	M.step_open = 1;
	M.batch = b;
	memset(M.ldone, 0, M.nl);
	for (uint32_t i = 0; i < b; i++) {
		M.bfail[i] = 0;
		M.seq[M.bseq[i]].in_step = 1;
		for (uint32_t l = 0; l < M.nl; l++)
			M.pre[i * M.nl + l] = M.seq[M.bseq[i]].l[l].n;
	}
}

static uint32_t layers_done(void)
{
	uint32_t n = 0;
	for (uint32_t l = 0; l < M.nl; l++)
		n += M.ldone[l];
	return n;
}

static int dense_layer(uint32_t layer)
{
	return M.mode == KVR_MODE_DENSE || (M.cfg.dense_layers[layer / 64] >> (layer % 64) & 1);
}

static void op_decode_layer(void)
{
	T.op = "decode_layer";
	if (!M.step_open || chance(4)) {
		/* one fault: no step, layer out of range, NULL buffers, a stream, no ctx */
		const int v = !M.step_open ? 0 : 1 + (int)rnd(4);
		uint32_t layer = v == 1 ? M.nl + rnd(3) * (chance(50) ? 1 : 1000000) : rnd(M.nl);
		const void *q = M.q, *k = M.kb, *vv = M.vb;
		void *out = M.out, *stream = NULL;
		int32_t *status = M.status;
		struct kvr_context *ctx = v == 4 ? NULL : M.ctx;
		if (v == 2) {
			switch (rnd(5)) {
			case 0: q = NULL; break;
			case 1: k = NULL; break;
			case 2: vv = NULL; break;
			case 3: out = NULL; break;
			default: status = NULL; break;
			}
		} else if (v == 3) {
			stream = &stream; /* the cpu backend takes none */
		}
		arm(ctx, "decode_layer");
		say("decode_layer(layer %u) [fault %d]", layer, v);
		expect_fail(kvr_decode_layer(ctx, layer, q, k, vv, out, status, stream), -EINVAL, ctx,
			    "decode_layer", ctx && M.log_on, 0);
		check_lengths("decode_layer refused");
		return;
	}
	/* the next layer, a later one, or (known case 4) one already decoded */
	uint32_t layer = M.nl;
	if (chance(3) && layers_done() && known_case(K_LAYER_TWICE)) {
		do
			layer = rnd(M.nl);
		while (!M.ldone[layer]);
	} else if (layers_done() < M.nl) {
		const int in_order = chance(90);
		for (uint32_t l = 0; l < M.nl && in_order; l++)
			if (!M.ldone[l]) {
				layer = l;
				break;
			}
		while (layer == M.nl || M.ldone[layer])
			layer = rnd(M.nl);
	} else {
		return;
	}
	const uint32_t b = M.batch, eb = dtype_bytes(M.dtype);
	for (uint32_t i = 0; i < b; i++) {
		/* half the time the previous query again (slightly moved): freekv
		 * corrects some heads and not others */
		const float *prev = M.seq[M.bseq[i]].prev_q + (uint64_t)layer * M.q_row;
		const int keep = chance(50);
		const float qs = M.fmt ? 0.5f : 2.0f;
		for (uint64_t c = 0; c < M.q_row; c++) {
			float x = kv_value() * qs;
			if (keep && prev[c] != 0)
				x = chance(90) ? prev[c] : -prev[c];
			M.qf[i * M.q_row + c] = x;
			put(M.dtype, M.q, i * M.q_row + c, x);
		}
	}
	gen_kv(b);
	memset(M.out, 0xff, (size_t)b * M.q_row * eb);
	for (uint32_t i = 0; i < b; i++)
		M.status[i] = 0x5a5a5a5a;
	arm(M.ctx, "decode_layer");
	say("decode_layer(layer %u, batch %u)%s", layer, b, M.ldone[layer] ? " again" : "");
	const int rc = kvr_decode_layer(M.ctx, layer, M.q, M.kb, M.vb, M.out, M.status, NULL);
	if (M.ldone[layer]) {
		expect_fail(rc, -EINVAL, M.ctx, "decode_layer", M.log_on, K_LAYER_TWICE);
		check_lengths("a layer decoded twice");
		return;
	}
	expect_ok(rc, M.ctx);
	M.ldone[layer] = 1;
	int new_failure = 0;
	for (uint32_t i = 0; i < b; i++) {
		const uint32_t id = M.bseq[i];
		struct mseq *s = &M.seq[id];
		struct lkv *L = &s->l[layer];
		const int32_t st = M.status[i];
		const unsigned char *out = (const unsigned char *)M.out + (uint64_t)i * M.q_row * eb;
		int expect;
		if (M.bfail[i])
			expect = M.bfail[i]; /* failed in an earlier layer: fails here too */
		else if (M.bpos[i] != L->n)
			expect = -EINVAL;
		else
			expect = 1; /* 0, or out of pool pages */
		if (expect == 1 && (st == -ENOMEM || (M.spill && st == -ENOSPC))) {
			expect = st;
		}
		if ((expect == 1 && st != 0) || (expect != 1 && st != expect))
			fail(expect == -EINVAL && M.bpos[i] < L->n ? K_BAD_POSITION : 0,
			     "decode_layer(layer %u): sequence %u at %" PRIu64 " (holds %" PRIu64 ") got status %d, "
			     "expected %d", layer, id, M.bpos[i], L->n, st, expect == 1 ? 0 : expect);
		if (st) {
			for (uint64_t c = 0; c < M.q_row; c++)
				if (get(M.dtype, out, c) != 0)
					fail(0, "decode_layer: failed sequence %u's output is not zeros", id);
			if (!M.bfail[i]) {
				new_failure = 1;
				M.bfail_layer[i] = layer;
			}
			M.bfail[i] = st;
			s->failed++;
			M.failed++;
			continue;
		}
		lkv_append(L, M.kf + i * M.kv_row, M.vf + i * M.kv_row, 1);
		memcpy(s->prev_q + (uint64_t)layer * M.q_row, M.qf + i * M.q_row, M.q_row * sizeof(float));
		const int dense = dense_layer(layer) || L->n <= M.B;
		if (getenv("DBGC")) { static uint64_t a, b2, c2; if (dense_layer(layer)) a++; else if (dense) b2++; else c2++; if ((a + b2 + c2) % 500 == 0) fprintf(stderr, "dense layer %llu short %llu sparse %llu\n", (unsigned long long)a, (unsigned long long)b2, (unsigned long long)c2); }
		s->ok++, M.ok++;
		s->dense += (uint64_t)dense, M.dense += (uint64_t)dense;
		check_output(L, L->n, M.qf + i * M.q_row, out, dense, id, layer);
	}
	if (new_failure) {
		/* the call succeeded, the sequence's failure has its own message */
		char m[MSG];
		snprintf(m, sizeof(m), "%s", kvr_last_error(M.ctx));
		if (!m[0] || !strcmp(m, sentinel) || !strstr(m, "decode_layer"))
			fail(0, "a sequence failed in decode_layer without a message of its own (\"%s\")", m);
		if (M.log_on && atomic_load(&log_errors) == log_armed)
			fail(0, "a sequence failed in decode_layer and nothing reached the log callback");
		T.expected_errors++;
	}
}

/* The model after a step closes: failed sequences (every sequence, when
 * the step is taken back) hold what they held before it. */
static void step_close(int take_back)
{
	for (uint32_t i = 0; i < M.batch; i++) {
		struct mseq *s = &M.seq[M.bseq[i]];
		s->in_step = 0;
		if (take_back || M.bfail[i])
			for (uint32_t l = 0; l < M.nl; l++)
				s->l[l].n = M.pre[i * M.nl + l];
	}
	M.step_open = 0;
}

static void op_decode_end(void)
{
	T.op = "decode_end";
	if (!M.step_open || chance(3)) {
		struct kvr_context *ctx = M.step_open ? NULL : chance(20) ? NULL : M.ctx;
		arm(ctx, "decode_end");
		say("decode_end(%s) [no step]", ctx ? "ctx" : "NULL");
		expect_fail(kvr_decode_end(ctx), -EINVAL, ctx, "decode_end", ctx && M.log_on, 0);
		return;
	}
	const uint32_t done = layers_done();
	const int partial = done && done < M.nl;
	if (partial && !known_case(K_LAYER_MISSING))
		return;
	M.ends++;
	arm(M.ctx, "decode_end");
	say("decode_end (%u of %u layers decoded)", done, M.nl);
	const int rc = kvr_decode_end(M.ctx);
	const int bad_below = M.bad_below;
	if (partial) {
		expect_fail(rc, -EINVAL, M.ctx, "layer", M.log_on, K_LAYER_MISSING);
		step_close(1);
		check_lengths("a step ended with a layer not decoded");
		M.bad_below = 0;
		return;
	}
	expect_ok(rc, M.ctx);
	M.ends_ok++;
	int any_failed = 0;
	for (uint32_t i = 0; i < M.batch; i++)
		any_failed |= M.bfail[i] != 0;
	step_close(0);
	if (any_failed || bad_below || chance(20))
		check_lengths("decode_end");
	M.bad_below = 0;
}

/* ------------------------------------------------------------------ counters */

static void check_counters(const struct kvr_stats *s, const char *who)
{
	if (s->dense_decodes > s->layer_decodes || s->corrected_heads > s->checked_heads ||
	    s->correction_waits > s->layer_decodes || s->pages_demoted > s->pages_judged)
		fail(0, "%s: inconsistent counters (dense %" PRIu64 " of %" PRIu64 " decodes, corrected %" PRIu64
		     " of %" PRIu64 " heads, %" PRIu64 " correction waits, demoted %" PRIu64 " of %" PRIu64 ")",
		     who, s->dense_decodes, s->layer_decodes, s->corrected_heads, s->checked_heads,
		     s->correction_waits, s->pages_demoted, s->pages_judged);
	if (M.mode != KVR_MODE_FREEKV && (s->checked_heads || s->corrected_heads))
		fail(0, "%s: heads checked for correction in mode %s", who, kvr_mode_name(M.mode));
	if (s->checked_heads % M.nkv)
		fail(0, "%s: %" PRIu64 " heads checked, not a multiple of n_kv_heads", who, s->checked_heads);
	if (M.mode == KVR_MODE_DENSE && (s->selections || s->dense_decodes != s->layer_decodes))
		fail(0, "%s: dense mode selected pages or attended sparsely", who);
	if (M.recall != KVR_RECALL_STREAMED && (s->pages_recalled || s->bytes_recalled || s->pages_hit))
		fail(0, "%s: zero-copy recall moved pages", who);
	if (M.fmt == KVR_KV_FORMAT_PLAIN && (s->device_units || s->device_units_used))
		fail(0, "%s: plain pages with quantised device units", who);
	if (M.fmt != KVR_KV_FORMAT_MIXED && s->pages_judged)
		fail(0, "%s: pages judged without mixed pages", who);
	if (s->device_units_used > s->device_units)
		fail(0, "%s: %" PRIu64 " device units used of %" PRIu64, who, s->device_units_used, s->device_units);
}

static void op_stats(void)
{
	T.op = "get_stats";
	struct kvr_stats st;
	memset(&st, 0xab, sizeof(st));
	const int v = chance(85) ? 0 : 1 + (int)rnd(4);
	if (v >= 1 && v <= 3 && known_case(K_GETTER_MESSAGE)) {
		struct kvr_context *ctx = v == 1 ? NULL : M.ctx;
		st.size = v == 3 ? rnd(16) : (uint32_t)sizeof(st);
		arm(ctx, "get_stats");
		say("get_stats [fault %d]", v);
		expect_fail(kvr_get_stats(ctx, v == 2 ? NULL : &st), -EINVAL, ctx, "get_stats",
			    ctx && M.log_on, K_GETTER_MESSAGE);
		return;
	}
	if (v == 4) { /* an older caller's smaller struct: only its bytes are written */
		st.size = (uint32_t)offsetof(struct kvr_stats, correction_waits);
		say("get_stats(size %u)", st.size);
		expect_ok(kvr_get_stats(M.ctx, &st), M.ctx);
		const unsigned char *tail = (const unsigned char *)&st + st.size;
		for (size_t i = 0; i < sizeof(st) - st.size; i++)
			if (tail[i] != 0xab)
				fail(0, "get_stats wrote past the caller's size %u", st.size);
		return;
	}
	if (v >= 1 && v <= 3)
		return;
	st.size = sizeof(st);
	say("get_stats");
	expect_ok(kvr_get_stats(M.ctx, &st), M.ctx);
	check_counters(&st, "get_stats");
	const uint64_t *now = &st.steps, *was = &M.last.steps;
	const size_t n = (offsetof(struct kvr_stats, device_units) - offsetof(struct kvr_stats, steps)) / 8;
	for (size_t i = 0; i < n; i++)
		if (now[i] < was[i])
			fail(0, "get_stats: counter %zu went down from %" PRIu64 " to %" PRIu64, i, was[i], now[i]);
	if (st.layer_decodes != M.ok || st.dense_decodes != M.dense || st.failed_decodes < M.failed)
		fail(0, "get_stats: %" PRIu64 " layer decodes (%" PRIu64 " dense, %" PRIu64 " failed); the calls "
		     "returned %" PRIu64 " (%" PRIu64 " dense, %" PRIu64 " failed statuses)",
		     st.layer_decodes, st.dense_decodes, st.failed_decodes, M.ok, M.dense, M.failed);
	if (st.steps < M.ends_ok || st.steps > M.ends)
		fail(0, "get_stats: %" PRIu64 " steps; %" PRIu64 " decode_end calls succeeded of %" PRIu64,
		     st.steps, M.ends_ok, M.ends);
	M.last = st;
}

static void op_seq_stats(void)
{
	T.op = "seq_get_stats";
	struct kvr_stats st;
	memset(&st, 0, sizeof(st));
	st.size = sizeof(st);
	const uint32_t id = pick_seq(0, 1);
	if (chance(12) || id == UINT32_MAX) {
		const int v = (int)rnd(4);
		struct kvr_context *ctx = v == 0 ? NULL : M.ctx;
		const uint32_t sid = v == 1 || id == UINT32_MAX ? dead_id() : id;
		if (v == 3)
			st.size = rnd(16);
		arm(ctx, "seq_get_stats");
		say("seq_get_stats(%u) [fault %d]", sid, v);
		expect_fail(kvr_seq_get_stats(ctx, sid, v == 2 ? NULL : &st), -EINVAL, ctx, "seq_get_stats",
			    ctx && M.log_on, 0);
		return;
	}
	say("seq_get_stats(%u)", id);
	expect_ok(kvr_seq_get_stats(M.ctx, id, &st), M.ctx);
	check_counters(&st, "seq_get_stats");
	const struct mseq *s = &M.seq[id];
	if (st.steps || st.layer_decodes != s->ok || st.dense_decodes != s->dense || st.failed_decodes < s->failed)
		fail(0, "seq_get_stats(%u): steps %" PRIu64 ", %" PRIu64 " layer decodes (%" PRIu64 " dense, %" PRIu64
		     " failed); the sequence had %" PRIu64 " (%" PRIu64 " dense, %" PRIu64 " failed)",
		     id, st.steps, st.layer_decodes, st.dense_decodes, st.failed_decodes, s->ok, s->dense, s->failed);
	/* its corrections per KV head add up to its corrected heads */
	uint64_t counts[KVR_MAX_KV_HEADS], sum = 0;
	say("get_head_corrections(%u)", id);
	expect_ok(kvr_get_head_corrections(M.ctx, id, counts, M.nkv), M.ctx);
	for (uint32_t m = 0; m < M.nkv; m++)
		sum += counts[m];
	if (sum != st.corrected_heads)
		fail(0, "get_head_corrections(%u) sums to %" PRIu64 ", seq_get_stats says %" PRIu64 " corrected heads",
		     id, sum, st.corrected_heads);
}

static void op_head_corrections(void)
{
	T.op = "get_head_corrections";
	uint64_t counts[KVR_MAX_KV_HEADS + 4];
	if (chance(30)) {
		const int v = (int)rnd(4);
		struct kvr_context *ctx = v == 0 ? NULL : M.ctx;
		const uint32_t n = v == 1 ? (chance(50) ? 0 : M.nkv + 1 + rnd(3)) : M.nkv;
		const uint32_t seq = v == 3 ? dead_id() : UINT32_MAX;
		if (seq == UINT32_MAX && v == 3)
			return;
		arm(ctx, "get_head_corrections");
		say("get_head_corrections(%u, n %u) [fault %d]", seq, n, v);
		expect_fail(kvr_get_head_corrections(ctx, seq, v == 2 ? NULL : counts, n), -EINVAL, ctx,
			    "get_head_corrections", ctx && M.log_on, 0);
		return;
	}
	const uint32_t n = 1 + rnd(M.nkv);
	counts[n] = 0xfeedu;
	say("get_head_corrections(all, n %u)", n);
	expect_ok(kvr_get_head_corrections(M.ctx, UINT32_MAX, counts, n), M.ctx);
	if (counts[n] != 0xfeedu)
		fail(0, "get_head_corrections wrote past n = %u", n);
	uint64_t sum = 0;
	for (uint32_t m = 0; m < n; m++)
		sum += counts[m];
	if (M.mode != KVR_MODE_FREEKV && sum)
		fail(0, "get_head_corrections: %" PRIu64 " corrections in mode %s", sum, kvr_mode_name(M.mode));
}

static void op_seq_length(void)
{
	T.op = "seq_length";
	uint64_t n = 77;
	const uint32_t id = pick_seq(0, 1);
	if (chance(50) || id == UINT32_MAX) {
		const int v = (int)rnd(4);
		struct kvr_context *ctx = v == 0 ? NULL : M.ctx;
		const uint32_t sid = v == 1 || id == UINT32_MAX ? dead_id() : id;
		const uint32_t layer = v == 2 ? M.nl + rnd(3) * (chance(50) ? 1 : UINT32_MAX / 3) : 0;
		arm(ctx, "seq_length");
		say("seq_length(%u, %u) [fault %d]", sid, layer, v);
		expect_fail(kvr_seq_length(ctx, sid, layer, v == 3 ? NULL : &n), -EINVAL, ctx, "seq_length",
			    ctx && M.log_on, 0);
		if (n != 77)
			fail(0, "seq_length failed but wrote its out-parameter");
		return;
	}
	check_lengths("seq_length");
}

static void op_trace(void)
{
	T.op = "trace";
	char path[300];
	if (chance(50)) {
		const uint32_t spans = chance(10) ? 0 : 1 + rnd(chance(50) ? 16 : 50000);
		arm(M.ctx, "trace_start");
		say("trace_start(%u)", spans);
		const int rc = kvr_trace_start(M.ctx, spans);
		if (M.step_open)
			expect_fail(rc, spans ? -EBUSY : 0, M.ctx, "trace_start", M.log_on, 0);
		else if (!spans)
			expect_fail(rc, -EINVAL, M.ctx, "trace_start", M.log_on, 0);
		else
			expect_ok(rc, M.ctx), M.trace = 1;
		return;
	}
	const int v = chance(80) ? 0 : 1 + (int)rnd(2);
	if (v == 1)
		snprintf(path, sizeof(path), "%s/no-such-dir/trace.json", T.tmpdir);
	else
		snprintf(path, sizeof(path), "%s/trace-%u.json", T.tmpdir, T.files++);
	arm(M.ctx, "trace_write");
	say("trace_write(%s) [%d]", v == 2 ? "NULL" : path, v);
	const int rc = kvr_trace_write(M.ctx, v == 2 ? NULL : path);
	if (M.trace == 0 && !M.step_open) {
		expect_fail(rc, -EINVAL, M.ctx, "trace_write", M.log_on, 0);
		return;
	}
	if (M.step_open) {
		expect_fail(rc, M.trace == 1 ? -EBUSY : 0, M.ctx, "trace_write", M.log_on, 0);
		return;
	}
	if (v) { /* refused or unwritable: the trace is kept */
		expect_fail(rc, v == 1 ? -ENOENT : -EINVAL, M.ctx, "trace_write", M.log_on, 0);
		return;
	}
	expect_ok(rc, M.ctx);
	M.trace = 0;
	FILE *f = fopen(path, "r");
	int ch = f ? fgetc(f) : EOF;
	while (ch == ' ' || ch == '\n')
		ch = fgetc(f);
	if (f)
		fclose(f);
	if (ch != '{' && ch != '[')
		fail(0, "trace_write succeeded but %s is no JSON trace", path);
	unlink(path);
}

static void op_async_error(void)
{
	T.op = "async_error";
	if (chance(10)) {
		arm(NULL, "async_error");
		say("async_error(NULL)");
		expect_fail(kvr_async_error(NULL, NULL), -EINVAL, NULL, "async_error", 0, 0);
		return;
	}
	const char *m = NULL;
	say("async_error");
	const int rc = kvr_async_error(M.ctx, chance(50) ? &m : NULL);
	if (rc > 0)
		fail(0, "async_error returned %d", rc);
	if (rc < 0) {
		/* a controller failure: the next steps recall afresh, outputs stay
		 * correct (checked); only an empty report is wrong */
		T.async_errors++;
		if (m && !m[0])
			fail(0, "async_error %d without a description", rc);
	}
}

static void op_get_config(void)
{
	T.op = "context_get_config";
	static unsigned char buf[sizeof(struct kvr_config) + 32];
	struct kvr_config *c = (struct kvr_config *)buf;
	memset(buf, 0xab, sizeof(buf));
	const int v = chance(70) ? 0 : 1 + (int)rnd(4);
	if (v >= 1 && v <= 3 && known_case(K_GETTER_MESSAGE)) {
		struct kvr_context *ctx = v == 1 ? NULL : M.ctx;
		c->size = v == 3 ? rnd(4) : (uint32_t)sizeof(*c);
		arm(ctx, "context_get_config");
		say("context_get_config [fault %d]", v);
		expect_fail(kvr_context_get_config(ctx, v == 2 ? NULL : c), -EINVAL, ctx, "get_config",
			    ctx && M.log_on, K_GETTER_MESSAGE);
		return;
	}
	if (v >= 1 && v <= 3)
		return;
	/* an older caller's size writes that much; a newer one's, ours */
	const uint32_t size = v == 4 ? (uint32_t)offsetof(struct kvr_config, recall) : (uint32_t)sizeof(*c) + 16 * (uint32_t)chance(30);
	c->size = size;
	say("context_get_config(size %u)", size);
	expect_ok(kvr_context_get_config(M.ctx, c), M.ctx);
	const uint32_t wrote = size < sizeof(*c) ? size : (uint32_t)sizeof(*c);
	if (c->size != wrote || c->n_layers != M.nl || c->page_tokens != M.p)
		fail(0, "context_get_config(size %u) gave size %u, %u layers", size, c->size, c->n_layers);
	for (size_t i = wrote; i < sizeof(buf); i++)
		if (buf[i] != 0xab)
			fail(0, "context_get_config(size %u) wrote byte %zu", size, i);
}

/* Calls without a context: names, parsing, errors, versions. */
static void op_pure(void)
{
	T.op = "pure";
	switch (rnd(6)) {
	case 0: {
		static const int codes[] = { 0, -EINVAL, -ENOMEM, -ENOSPC, -EBUSY, -EOVERFLOW, -ENOTSUP,
					     EINVAL, -4096, 4096, INT32_MAX, -INT32_MAX, INT32_MIN };
		int e = codes[rnd(13)];
		if (e == INT32_MIN && !known_case(K_STRERROR_MIN))
			e = -1;
		say("strerror(%d)", e);
		const char *s = kvr_strerror(e);
		if (!s || !s[0])
			fail(e == INT32_MIN ? K_STRERROR_MIN : 0, "kvr_strerror(%d) is empty", e);
		break;
	}
	case 1: {
		const uint32_t x = chance(50) ? rnd(6) : UINT32_MAX - rnd(3);
		say("*_name(%u)", x);
		const char *names[] = { kvr_mode_name(x), kvr_dtype_name(x), kvr_backend_name(x), kvr_recall_name(x),
					kvr_controller_name(x), kvr_kv_format_name(x) };
		const uint32_t known_n[] = { 5, 3, 3, 3, 3, 4 };
		T.calls += 5;
		for (int i = 0; i < 6; i++)
			if (!names[i] || (x >= known_n[i]) != !strcmp(names[i], "?"))
				fail(0, "name %d of %u is \"%s\"", i, x, names[i] ? names[i] : "(null)");
		break;
	}
	case 2: {
		uint32_t out = 99;
		const uint32_t mode = rnd(5);
		say("mode_parse(%s)", kvr_mode_name(mode));
		if (kvr_mode_parse(kvr_mode_name(mode), &out) || out != mode)
			fail(0, "mode_parse(\"%s\") does not give %u back", kvr_mode_name(mode), mode);
		const uint32_t fmt = rnd(4);
		say("kv_format_parse(%s)", kvr_kv_format_name(fmt));
		if (kvr_kv_format_parse(kvr_kv_format_name(fmt), &out) || out != fmt)
			fail(0, "kv_format_parse(\"%s\") does not give %u back", kvr_kv_format_name(fmt), fmt);
		/* bad input: -EINVAL, out untouched, and (known case 11) a message */
		const int v = (int)rnd(3);
		const char *name = v == 0 ? NULL : "no-such-name";
		out = 99;
		const int pure_msg = known_case(K_PURE_MESSAGE);
		arm(NULL, "parse");
		say("%s(%s)", v == 2 ? "kv_format_parse" : "mode_parse", name ? name : "NULL");
		const int rc = v == 2 ? kvr_kv_format_parse(name, &out) : kvr_mode_parse(name, v ? &out : NULL);
		if (rc != -EINVAL || out != 99)
			fail(0, "parsing %s gave %d (out %u)", name ? name : "NULL", rc, out);
		if (pure_msg)
			expect_fail(rc, -EINVAL, NULL, "parse", 0, K_PURE_MESSAGE);
		break;
	}
	case 3: {
		say("version");
		T.calls++;
		char want[32];
		snprintf(want, sizeof(want), "%d.%d.%d", KVR_VERSION_MAJOR, KVR_VERSION_MINOR, KVR_VERSION_PATCH);
		if (kvr_version_number() != KVR_VERSION_NUMBER || strcmp(kvr_version_string(), want))
			fail(0, "version %u \"%s\", header %d", kvr_version_number(), kvr_version_string(),
			     KVR_VERSION_NUMBER);
		say("context_destroy(NULL)");
		kvr_context_destroy(NULL);
		break;
	}
	case 4: {
		if (!known_case(K_PURE_MESSAGE)) {
			say("config_init(NULL)");
			if (kvr_config_init(NULL) != -EINVAL)
				fail(0, "config_init(NULL) is not -EINVAL");
			break;
		}
		arm(NULL, "config_init");
		say("config_init(NULL)");
		expect_fail(kvr_config_init(NULL), -EINVAL, NULL, "config", 0, K_PURE_MESSAGE);
		break;
	}
	default: {
		if (!chance(20))
			break; /* probes a file system: now and then */
		struct kvr_spill_dir_info info;
		memset(&info, 0, sizeof(info));
		const int v = (int)rnd(3);
		char dir[300];
		snprintf(dir, sizeof(dir), "%s%s", T.tmpdir, v == 1 ? "/no-such-dir" : "");
		info.size = v == 2 ? rnd(8) : (uint32_t)sizeof(info);
		arm(NULL, "spill_dir_query");
		say("spill_dir_query(%s) [%d]", dir, v);
		const int rc = kvr_spill_dir_query(dir, &info);
		if (v == 0)
			expect_ok(rc, NULL);
		else
			expect_fail(rc, v == 1 ? -ENOENT : -EINVAL, NULL, v == 1 ? "no-such-dir" : NULL, 0, 0);
		break;
	}
	}
}

/* ------------------------------------------------------------------ the driver */

static void run_op(void)
{
	T.ops++;
	if (M.step_open) {
		const uint32_t r = rnd(100);
		const int all = layers_done() == M.nl;
		if (all ? r < 70 : r < 10) {
			op_decode_end();
			return;
		}
		if (!all && r < 85) {
			op_decode_layer();
			return;
		}
	}
	static const struct {
		void (*fn)(void);
		uint32_t weight;
	} ops[] = {
		{ op_seq_create, 8 }, { op_seq_free, 4 },  { op_seq_fork, 5 },       { op_seq_truncate, 5 },
		{ op_prefill, 22 },   { op_prefill_fill, 1 }, { op_prefill_attention, 6 },
		{ op_decode_begin, 22 }, { op_decode_layer, 1 }, { op_decode_end, 1 }, { op_stats, 4 },
		{ op_seq_stats, 3 },  { op_head_corrections, 2 }, { op_seq_length, 3 }, { op_trace, 2 },
		{ op_async_error, 2 }, { op_get_config, 2 }, { op_pure, 3 },      { op_config_trial, 2 },
	};
	uint32_t total = 0;
	for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++)
		total += ops[i].weight;
	uint32_t r = rnd(total);
	for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++) {
		if (r < ops[i].weight) {
			ops[i].fn();
			return;
		}
		r -= ops[i].weight;
	}
}

static void episode(void)
{
	context_open();
	const uint32_t n_ops = 20 + rnd(400);
	for (uint32_t i = 0; i < n_ops && T.calls < T.max_calls; i++)
		run_op();
	T.op = "context_destroy";
	if (M.step_open && chance(50)) {
		/* finish the step, or (below) destroy the context with it open */
		while (M.step_open && layers_done() < M.nl)
			op_decode_layer();
		if (M.step_open)
			op_decode_end();
	}
	if (!M.step_open)
		check_lengths("the episode");
	say("context_destroy%s", M.step_open ? " with a step open" : "");
	kvr_context_destroy(M.ctx);
	if (atomic_load(&log_empty))
		fail(0, "the log callback received an empty message");
	model_free();
}

static int parse_skip(const char *list)
{
	if (!list) {
		for (int k = 1; k < K_COUNT; k++)
			T.skip[k] = 1;
		return 0;
	}
	while (*list) {
		char *end;
		const long k = strtol(list, &end, 10);
		if (end == list || k < 1 || k >= K_COUNT)
			return -1;
		T.skip[k] = 1;
		list = *end == ',' ? end + 1 : end;
		if (*end && *end != ',')
			return -1;
	}
	return 0;
}

int main(int argc, char **argv)
{
	T.seed = 1;
	T.max_calls = 10000;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--seed") && i + 1 < argc)
			T.seed = strtoull(argv[++i], NULL, 0);
		else if (!strcmp(argv[i], "--calls") && i + 1 < argc)
			T.max_calls = strtoull(argv[++i], NULL, 0);
		else if (!strcmp(argv[i], "--verbose"))
			T.verbose = 1;
		else if (!strcmp(argv[i], "--verbose-from") && i + 1 < argc)
			T.verbose_from = strtoull(argv[++i], NULL, 0);
		else if (!strcmp(argv[i], "--skip-known"))
			parse_skip(NULL);
		else if (strncmp(argv[i], "--skip-known=", 13) || parse_skip(argv[i] + 13)) {
			fprintf(stderr,
				"usage: %s [--seed S] [--calls N] [--verbose | --verbose-from C] "
				"[--skip-known[=1,2,...]]\n",
				argv[0]);
			return 2;
		}
	}
	rng_state = T.seed * 0x2545f4914f6cdd1dull + 1;
	const char *tmp = getenv("TMPDIR");
	snprintf(T.tmpdir, sizeof(T.tmpdir), "%s/kvr-apiseq-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
	if (!mkdtemp(T.tmpdir)) {
		perror("api_sequence: mkdtemp");
		return 2;
	}
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	while (T.calls < T.max_calls) {
		if (chance(30))
			op_config_trial();
		episode();
	}
	clock_gettime(CLOCK_MONOTONIC, &t1);
	rmdir(T.tmpdir);
	const double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
	printf("api_sequence: seed %" PRIu64 ": %" PRIu64 " ops over %" PRIu64 " contexts (%" PRIu64
	       " invalid configs); decode outputs (per KV head) checked: %" PRIu64 " dense, %" PRIu64
	       " sparse exactly, %" PRIu64 " sparse within bounds; %" PRIu64 " prefill-attention rows; %" PRIu64
	       " async errors; %.1f s (%.0f calls/s)\n",
	       T.seed, T.ops, T.contexts, T.invalid_configs, T.dense_checks, T.exact_sparse_checks,
	       T.bound_checks, T.prefill_attention_checks, T.async_errors, s, (double)T.calls / s);
	for (int k = 1; k < K_COUNT; k++)
		if (T.hits[k])
			printf("api_sequence: known case %d (%s): %s %" PRIu64 " times\n", k, known_what[k],
			       T.skip[k] ? "skipped" : "exercised", T.hits[k]);
	printf("api_sequence: %" PRIu64 " calls, %" PRIu64 " expected errors, 0 failed\n", T.calls,
	       T.expected_errors);
	return 0;
}
