/* SPDX-License-Identifier: MIT */
/*
 * test_context.c — context lifecycle: a valid config round-trips through
 * create/get_config, automatic fields are resolved, machine-dependent rules
 * (NUMA node, backend, device budget) fail cleanly, errors reach the log
 * callback and kvr_last_error, and kvr_strerror names codes.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvrecall.h"

static struct kvr_config base(void)
{
	struct kvr_config c;
	kvr_config_init(&c);
	c.n_layers = 30;
	c.n_qo_heads = 9;
	c.n_kv_heads = 3;
	c.head_dim = 64;
	return c;
}

Test(context, explicit_config_round_trips)
{
	struct kvr_config in = base();
	in.backend = KVR_BACKEND_CPU;
	in.mode = KVR_MODE_BLOCKING;
	in.dtype = KVR_DTYPE_BF16;
	in.page_tokens = 16;
	in.budget_tokens = 1024;
	in.sink_tokens = 128;
	in.window_tokens = 256;
	in.tau = 0.8f;
	in.dense_layers[0] = 0x5;
	in.max_sequences = 8;
	in.max_batch = 4;
	in.pool_bytes = 64ull << 20;
	in.device_bytes = 512ull << 20;
	in.numa_node = 0;
	in.threads = 1;
	in.recall_chunk_pages = 4;
	in.recall_buffers = 1;
	in.log_level = KVR_LOG_ERROR;
	in.recall = KVR_RECALL_STREAMED;
	in.pool_layout = KVR_POOL_HND;
	in.controller = KVR_CONTROLLER_THREAD;

	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(&in, &ctx), 0, "%s", kvr_last_error(NULL));
	cr_assert_not_null(ctx);
	struct kvr_config out;
	kvr_config_init(&out);
	cr_assert_eq(kvr_context_get_config(ctx, &out), 0);
	cr_expect_eq(memcmp(&in, &out, sizeof(in)), 0, "explicit config changed by create");
	cr_expect_str_empty(kvr_last_error(ctx));
	kvr_context_destroy(ctx);
}

Test(context, automatic_fields_resolved)
{
	struct kvr_config in = base();
	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(&in, &ctx), 0, "%s", kvr_last_error(NULL));
	struct kvr_config out;
	kvr_config_init(&out);
	cr_assert_eq(kvr_context_get_config(ctx, &out), 0);
	cr_expect_eq(out.backend, KVR_BACKEND_CPU);
	cr_expect_neq(out.mode, KVR_MODE_AUTO);
	long n = sysconf(_SC_NPROCESSORS_ONLN);
	cr_expect_eq(out.threads, n > 1 ? (uint32_t)(n - 1) : 0);
	cr_expect_geq(out.numa_node, 0);
	cr_expect_gt(out.pool_bytes, 0);
	cr_expect_neq(out.recall, KVR_RECALL_AUTO);
	/* the cpu backend's threads take every core: the jobs run inline */
	cr_expect_eq(out.controller, KVR_CONTROLLER_INLINE, "controller %s",
		     kvr_controller_name(out.controller));
	/* max_sequences (64) sequences of tail tiles: 30 layers x K and V x 32·3·64·2 bytes,
	 * plus, streamed, the page cache of 29 sparse layers x (2048-1024)/32 pages */
	uint64_t fixed = 0, per_seq = 0;
	cr_assert_eq(kvr_device_bytes_needed(&in, &fixed, &per_seq), 0);
	const uint64_t tails = 30ull * 2 * 32 * 3 * 64 * 2;
	const uint64_t cache = out.recall == KVR_RECALL_STREAMED ? 29ull * 32 * 2 * 32 * 3 * 64 * 2 : 0;
	cr_expect_eq(per_seq, tails + cache);
	cr_expect_eq(out.device_bytes, fixed + 64 * per_seq);
	kvr_context_destroy(ctx);
}

Test(context, get_config_respects_caller_size)
{
	struct kvr_config in = base();
	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(&in, &ctx), 0);
	struct kvr_config out;
	memset(&out, 0x5a, sizeof(out));
	out.size = (uint32_t)offsetof(struct kvr_config, head_dim); /* an "older" caller */
	cr_assert_eq(kvr_context_get_config(ctx, &out), 0);
	cr_expect_eq(out.n_kv_heads, 3);
	cr_expect_eq(out.head_dim, 0x5a5a5a5au, "wrote past the caller's size");
	cr_expect_eq(kvr_context_get_config(ctx, NULL), -EINVAL);
	cr_expect_eq(kvr_context_get_config(NULL, &out), -EINVAL);
	kvr_context_destroy(ctx);
}

Test(context, destroy_null_is_noop)
{
	kvr_context_destroy(NULL);
	cr_expect_eq(kvr_context_create(NULL, NULL), -EINVAL);
	struct kvr_config c = base();
	cr_expect_eq(kvr_context_create(&c, NULL), -EINVAL);
	cr_expect(strstr(kvr_last_error(NULL), "out") != NULL);
}

Test(context, missing_numa_node_rejected)
{
	struct kvr_config c = base();
	c.numa_node = 4095;
	struct kvr_context *ctx = NULL;
	cr_expect_eq(kvr_context_create(&c, &ctx), -EINVAL);
	cr_expect_null(ctx);
	cr_expect(strstr(kvr_last_error(NULL), "numa_node: node 4095 does not exist") != NULL,
		  "%s", kvr_last_error(NULL));
}

Test(context, cuda_without_gpu_is_enodev)
{
	struct kvr_system_info s = { .size = sizeof(s) };
	kvr_system_query(&s);
	struct kvr_config c = base();
	c.backend = KVR_BACKEND_CUDA;
	struct kvr_context *ctx = NULL;
	int err = kvr_context_create(&c, &ctx);
	if (s.n_gpus == 0) {
		cr_expect_eq(err, -ENODEV);
		cr_expect(strstr(kvr_last_error(NULL), "backend: cuda requested but no GPU") != NULL,
			  "%s", kvr_last_error(NULL));
		cr_expect(strstr(kvr_last_error(NULL), s.gpu_reason) != NULL,
			  "the reason is the probe's: %s", kvr_last_error(NULL));
		cr_expect_null(ctx);
	} else {
		cr_expect_eq(err, 0, "a usable GPU: %s", kvr_last_error(NULL));
		kvr_context_destroy(ctx);
	}
}

/* Backend auto is the cpu backend whether or not a GPU is usable, so an
 * engine's buffers mean host memory and no stream is taken; the device
 * bytes of a config count it as cpu too (they cannot probe the machine). */
Test(context, backend_auto_is_the_cpu_backend)
{
	struct kvr_system_info s = { .size = sizeof(s) };
	cr_assert_geq(kvr_system_query(&s), -EIO);
	struct kvr_config in;
	kvr_config_init(&in);
	in.n_layers = 2, in.n_qo_heads = 4, in.n_kv_heads = 2, in.head_dim = 32;
	in.dtype = KVR_DTYPE_F32, in.threads = 0, in.pool_bytes = 8u << 20;
	in.max_sequences = in.max_batch = 1;
	cr_assert_eq(in.backend, KVR_BACKEND_AUTO);
	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(&in, &ctx), 0, "%u GPUs: %s", s.n_gpus, kvr_last_error(NULL));
	struct kvr_config out;
	kvr_config_init(&out);
	cr_assert_eq(kvr_context_get_config(ctx, &out), 0);
	cr_expect_eq(out.backend, KVR_BACKEND_CPU, "%u GPUs: auto resolved to %s", s.n_gpus,
		     kvr_backend_name(out.backend));
	/* one decode step with host buffers and no stream */
	uint32_t seq;
	cr_assert_eq(kvr_seq_create(ctx, &seq), 0, "%s", kvr_last_error(ctx));
	static float q[4 * 32], k[2 * 32], v[2 * 32], o[4 * 32];
	for (int i = 0; i < 2 * 32; i++)
		q[i] = q[i + 64] = k[i] = v[i] = (float)(i % 7) / 7.0f;
	int32_t status = 1;
	const uint64_t pos = 0;
	cr_assert_eq(kvr_decode_begin(ctx, &seq, &pos, 1), 0, "%s", kvr_last_error(ctx));
	int stream_stand_in;
	cr_expect_eq(kvr_decode_layer(ctx, 0, q, k, v, o, &status, &stream_stand_in), -EINVAL,
		     "the cpu backend takes no stream");
	for (uint32_t l = 0; l < 2; l++) {
		cr_assert_eq(kvr_decode_layer(ctx, l, q, k, v, o, &status, NULL), 0, "%s", kvr_last_error(ctx));
		cr_expect_eq(status, 0);
	}
	cr_assert_eq(kvr_decode_end(ctx), 0, "%s", kvr_last_error(ctx));
	/* one token: each query head's output is its KV head's value */
	for (int h = 0; h < 4; h++)
		for (int c = 0; c < 32; c++)
			cr_expect_float_eq(o[h * 32 + c], v[(h / 2) * 32 + c], 1e-6f, "head %d, channel %d", h, c);
	kvr_context_destroy(ctx);
	/* as a config: auto's device bytes are the cpu backend's */
	uint64_t fixed[3], per_seq[3];
	const uint32_t backends[3] = { KVR_BACKEND_AUTO, KVR_BACKEND_CPU, KVR_BACKEND_CUDA };
	in.mode = KVR_MODE_FREEKV;
	for (int i = 0; i < 3; i++) {
		in.backend = backends[i];
		cr_assert_eq(kvr_device_bytes_needed(&in, &fixed[i], &per_seq[i]), 0, "%s", kvr_last_error(NULL));
	}
	cr_expect(fixed[0] == fixed[1] && per_seq[0] == per_seq[1], "auto counted as cpu");
	cr_expect(per_seq[0] != per_seq[2], "cuda's per-sequence bytes differ (device page cache)");
}

Test(context, device_budget_too_small)
{
	struct kvr_config c = base();
	c.device_bytes = 4096;
	struct kvr_context *ctx = NULL;
	cr_expect_eq(kvr_context_create(&c, &ctx), -ENOMEM);
	cr_expect(strstr(kvr_last_error(NULL), "device_bytes") == kvr_last_error(NULL), "%s",
		  kvr_last_error(NULL));
}

/* ---- log callback ---- */

static int n_logged;
static enum kvr_log_level last_level;
static char last_message[512];
static void *last_user;

static void capture(void *user, enum kvr_log_level level, const char *message)
{
	n_logged++;
	last_level = level;
	last_user = user;
	strncpy(last_message, message, sizeof(last_message) - 1);
}

/* A config creation refuses (tau 2), logging errors to capture(user). */
static struct kvr_config invalid_logged(void *user)
{
	struct kvr_config c = base();
	c.log_fn = capture;
	c.log_user = user;
	c.log_level = KVR_LOG_ERROR;
	c.tau = 2.0f;
	return c;
}

Test(context, errors_reach_log_callback)
{
	int token;
	struct kvr_config c = invalid_logged(&token);
	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(&c, &ctx), -EINVAL);
	cr_expect_eq(n_logged, 1);
	cr_expect_eq(last_level, KVR_LOG_ERROR);
	cr_expect_eq(last_user, &token);
	cr_expect(strstr(last_message, "tau: must be in [-1, 1]") != NULL, "%s", last_message);
	cr_expect_str_eq(last_message, kvr_last_error(NULL));
}

Test(context, log_level_filters)
{
	struct kvr_config c = base();
	c.log_fn = capture;
	c.log_level = KVR_LOG_WARN; /* the create's INFO line is dropped */
	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(&c, &ctx), 0);
	cr_expect_eq(n_logged, 0, "got: %s", last_message);
	kvr_context_destroy(ctx);
	c.log_level = KVR_LOG_INFO;
	cr_assert_eq(kvr_context_create(&c, &ctx), 0);
	cr_expect_geq(n_logged, 1);
	cr_expect_eq(last_level, KVR_LOG_INFO);
	cr_expect(strstr(last_message, "backend cpu") != NULL, "%s", last_message);
	kvr_context_destroy(ctx);
}

Test(errors, strerror_names_codes)
{
	cr_expect_str_eq(kvr_strerror(0), "success");
	cr_expect_str_eq(kvr_strerror(-EINVAL), "invalid argument");
	cr_expect_str_eq(kvr_strerror(EINVAL), "invalid argument");
	cr_expect(strstr(kvr_strerror(-ENOMEM), "out of memory") != NULL);
	cr_expect_str_eq(kvr_strerror(-ENODEV), "no usable device");
	cr_expect_str_eq(kvr_strerror(-EOVERFLOW), "size overflows");
	cr_expect_not_null(kvr_strerror(-ETIMEDOUT));
	cr_expect_str_neq(kvr_strerror(-ETIMEDOUT), "unknown error");
	cr_expect_str_eq(kvr_strerror(-100000), "unknown error");
	cr_expect_str_eq(kvr_strerror(INT32_MIN), "unknown error"); /* -INT32_MIN does not exist */
}

Test(version, header_matches_library)
{
	cr_expect_eq(kvr_version_number(), KVR_VERSION_NUMBER);
	char want[32];
	snprintf(want, sizeof(want), "%d.%d.%d", KVR_VERSION_MAJOR, KVR_VERSION_MINOR,
		 KVR_VERSION_PATCH);
	cr_expect_str_eq(kvr_version_string(), want);
}

/* ---- engine-supplied device allocator ---- */

static int n_allocs, n_frees;
static int counting_alloc(void *user, size_t bytes, void **ptr)
{
	cr_assert_eq(user, (void *)&n_allocs);
	n_allocs++;
	return posix_memalign(ptr, 64, (bytes + 63) & ~(size_t)63) ? -ENOMEM : 0;
}
static void counting_free(void *user, void *ptr)
{
	cr_assert_eq(user, (void *)&n_allocs);
	n_frees++;
	free(ptr);
}

Test(context, engine_allocator_gets_every_device_buffer)
{
	struct kvr_config c = base();
	c.recall = KVR_RECALL_STREAMED;
	c.max_sequences = 2;
	c.max_batch = 2;
	c.pool_bytes = 64ull << 20;
	c.device_alloc = counting_alloc;
	c.device_free = counting_free;
	c.device_alloc_user = &n_allocs;
	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(&c, &ctx), 0, "%s", kvr_last_error(NULL));
	const int after_create = n_allocs; /* staging buffers */
	cr_expect_gt(after_create, 0);
	uint32_t seq;
	cr_assert_eq(kvr_seq_create(ctx, &seq), 0, "%s", kvr_last_error(ctx));
	cr_expect_gt(n_allocs, after_create); /* tail tiles and slots */
	kvr_context_destroy(ctx);
	cr_expect_eq(n_allocs, n_frees);

	/* one without the other is refused */
	c.device_free = NULL;
	cr_expect_eq(kvr_context_create(&c, &ctx), -EINVAL);
	cr_expect(strstr(kvr_last_error(NULL), "device_alloc") != NULL, "%s", kvr_last_error(NULL));
}

/* A 0.2 caller's config ends before `controller`: whatever lies past its size
 * is not read, and the field takes its default. */
Test(context, config_from_0_2_caller_accepted)
{
	struct kvr_config in = base();
	in.size = (uint32_t)offsetof(struct kvr_config, controller);
	in.controller = 99; /* beyond the caller's struct: must be ignored */
	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(&in, &ctx), 0, "%s", kvr_last_error(NULL));
	struct kvr_config out;
	kvr_config_init(&out);
	cr_assert_eq(kvr_context_get_config(ctx, &out), 0);
	cr_expect_eq(out.controller, KVR_CONTROLLER_INLINE);
	kvr_context_destroy(ctx);
}

/* controller = auto: the thread where a core is left over for it (fewer
 * backend threads than cores), inline where the backend's threads take them
 * all. */
Test(context, controller_auto_follows_spare_cores)
{
	const long n = sysconf(_SC_NPROCESSORS_ONLN);
	const uint32_t workers[] = { 0, n > 1 ? (uint32_t)(n - 1) : 0, (uint32_t)n + 3 };
	for (int i = 0; i < 3; i++) {
		struct kvr_config in = base();
		in.backend = KVR_BACKEND_CPU;
		in.threads = workers[i];
		struct kvr_context *ctx = NULL;
		cr_assert_eq(kvr_context_create(&in, &ctx), 0, "%s", kvr_last_error(NULL));
		struct kvr_config out;
		kvr_config_init(&out);
		cr_assert_eq(kvr_context_get_config(ctx, &out), 0);
		const int spare = (long)workers[i] + 1 < n;
		cr_expect_eq(out.controller, spare ? KVR_CONTROLLER_THREAD : KVR_CONTROLLER_INLINE,
			     "%u workers on %ld cores: controller %s", workers[i], n,
			     kvr_controller_name(out.controller));
		kvr_context_destroy(ctx);
	}
}

/* Getters refuse NULL and short structs with a fresh message, not a stale one. */
Test(context, getters_refuse_null_with_a_message)
{
	struct kvr_config c = base();
	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(&c, &ctx), 0, "%s", kvr_last_error(NULL));
	uint32_t seq;
	cr_assert_eq(kvr_seq_free(ctx, 3), -EINVAL); /* a stale message to replace */
	cr_expect_eq(kvr_context_get_config(ctx, NULL), -EINVAL);
	cr_expect(strstr(kvr_last_error(ctx), "context_get_config") != NULL, "%s", kvr_last_error(ctx));
	cr_assert_eq(kvr_seq_free(ctx, 3), -EINVAL);
	cr_expect_eq(kvr_get_stats(ctx, NULL), -EINVAL);
	cr_expect(strstr(kvr_last_error(ctx), "get_stats") != NULL, "%s", kvr_last_error(ctx));
	cr_assert_eq(kvr_seq_free(ctx, 3), -EINVAL);
	struct kvr_stats st = { .size = 0 };
	cr_expect_eq(kvr_get_stats(ctx, &st), -EINVAL);
	cr_expect(strstr(kvr_last_error(ctx), "get_stats") != NULL, "%s", kvr_last_error(ctx));
	cr_assert_eq(kvr_seq_create(ctx, &seq), 0);
	cr_expect_eq(kvr_seq_get_stats(ctx, seq, NULL), -EINVAL);
	cr_expect(strstr(kvr_last_error(ctx), "seq_get_stats") != NULL, "%s", kvr_last_error(ctx));
	kvr_context_destroy(ctx);
}

/* A caller built against 0.1 (the smallest accepted config, ending after
 * log_user) still gets its log callback when creation fails. */
Test(context, old_config_still_logs_its_failure)
{
	int token;
	struct kvr_config c = invalid_logged(&token);
	c.size = (uint32_t)offsetof(struct kvr_config, recall);
	n_logged = 0;
	struct kvr_context *ctx = NULL;
	cr_assert_eq(kvr_context_create(&c, &ctx), -EINVAL);
	cr_expect_eq(n_logged, 1, "the 0.1 caller's callback was not called");
	cr_expect_eq(last_user, &token);
	cr_expect(strstr(last_message, "tau") != NULL, "%s", last_message);
}

/* kvr_last_error(ctx) read while another thread fails calls on the same
 * context gives whole messages, never a torn mix of two. */
static struct kvr_context *race_ctx;
static _Atomic int race_stop;

static void *fail_calls(void *arg)
{
	(void)arg;
	for (uint32_t i = 0; !race_stop; i++) {
		if (i % 2)
			kvr_seq_free(race_ctx, 7);
		else
			kvr_seq_length(race_ctx, 0, 99, NULL);
	}
	return NULL;
}

Test(context, last_error_is_never_torn)
{
	struct kvr_config c = base();
	c.max_sequences = 8;
	c.max_batch = 8;
	cr_assert_eq(kvr_context_create(&c, &race_ctx), 0, "%s", kvr_last_error(NULL));
	kvr_seq_free(race_ctx, 7);
	char free_msg[512], length_msg[512];
	snprintf(free_msg, sizeof(free_msg), "%s", kvr_last_error(race_ctx));
	kvr_seq_length(race_ctx, 0, 99, NULL);
	snprintf(length_msg, sizeof(length_msg), "%s", kvr_last_error(race_ctx));
	cr_assert_str_neq(free_msg, length_msg);
	race_stop = 0;
	pthread_t t;
	cr_assert_eq(pthread_create(&t, NULL, fail_calls, NULL), 0);
	uint32_t bad = 0;
	for (uint32_t i = 0; i < 200000; i++) {
		const char *m = kvr_last_error(race_ctx);
		bad += strcmp(m, free_msg) && strcmp(m, length_msg);
	}
	race_stop = 1;
	pthread_join(t, NULL);
	cr_expect_eq(bad, 0, "%u reads saw a torn message", bad);
	kvr_context_destroy(race_ctx);
}
