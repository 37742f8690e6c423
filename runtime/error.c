/* SPDX-License-Identifier: MIT */
/*
 * error.c — error codes, last-error messages and the log callback.
 *
 * Messages of failed calls live in the context's error slot (guarded by its
 * mutex, since any thread using the context may fail a call) or, for calls
 * without a context, in a thread-local slot. kvr_last_error hands out a copy
 * in the calling thread's own buffer, so a message being read is never
 * rewritten under the reader. Nothing here writes to stdout or stderr: the
 * log callback is the only way out.
 *
 * Threads: any.
 */
#include <errno.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

static _Thread_local char thread_last_error[KVR_ERROR_MESSAGE_BYTES];
/* kvr_last_error(ctx)'s copy of a context's message, per reading thread */
static _Thread_local char thread_read_error[KVR_ERROR_MESSAGE_BYTES];

KVR_API const char *kvr_strerror(int err)
{
	if (err == INT_MIN)
		return "unknown error"; /* -INT_MIN does not exist */
	if (err < 0)
		err = -err;
	switch (err) {
	case 0:
		return "success";
	case EINVAL:
		return "invalid argument";
	case ENOMEM:
		return "out of memory (or a configured capacity is exhausted)";
	case ENODEV:
		return "no usable device";
	case EOVERFLOW:
		return "size overflows";
	case ENOTSUP:
		return "not supported by this build or backend";
	case ENOENT:
		return "no such object";
	case EIO:
		return "input/output error";
	case EBUSY:
		return "busy";
	case EAGAIN:
		return "try again";
	case ENOTRECOVERABLE:
		return "state not recoverable";
	default: {
		/* strerrordesc_np is thread-safe and returns static storage (glibc >= 2.32). */
		const char *s = strerrordesc_np(err);
		return s ? s : "unknown error";
	}
	}
}

static void deliver(kvr_log_fn fn, void *user, uint32_t max_level, enum kvr_log_level level,
		    const char *fmt, va_list ap)
{
	if (!fn || (uint32_t)level > max_level)
		return;
	char line[KVR_ERROR_MESSAGE_BYTES];
	vsnprintf(line, sizeof(line), fmt, ap);
	fn(user, level, line);
}

void kvr_log(const struct kvr_context *ctx, enum kvr_log_level level, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	deliver(ctx->config.log_fn, ctx->config.log_user, ctx->config.log_level, level, fmt, ap);
	va_end(ap);
}

void kvr_log_config(const struct kvr_config *cfg, enum kvr_log_level level, const char *fmt, ...)
{
	/* Every accepted config version (from 0.1, kvr_config_import) ends after
	 * log_user, so an older caller's callback is read where it put it; a
	 * smaller size is an uninitialised config with no trustworthy callback. */
	if (!cfg || cfg->size < offsetof(struct kvr_config, log_user) + sizeof(cfg->log_user))
		return;
	va_list ap;
	va_start(ap, fmt);
	deliver(cfg->log_fn, cfg->log_user, cfg->log_level, level, fmt, ap);
	va_end(ap);
}

int kvr_fail(const struct kvr_context *ctx, int err, const char *fmt, ...)
{
	char line[KVR_ERROR_MESSAGE_BYTES];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	if (ctx) {
		pthread_mutex_lock(&ctx->error->lock);
		memcpy(ctx->error->message, line, sizeof(line));
		pthread_mutex_unlock(&ctx->error->lock);
		kvr_log(ctx, KVR_LOG_ERROR, "%s", line);
	} else {
		memcpy(thread_last_error, line, sizeof(line));
	}
	return err;
}

int kvr_fail_config(const struct kvr_config *cfg, int err, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(thread_last_error, sizeof(thread_last_error), fmt, ap);
	va_end(ap);
	kvr_log_config(cfg, KVR_LOG_ERROR, "%s", thread_last_error);
	return err;
}

KVR_API const char *kvr_last_error(const struct kvr_context *ctx)
{
	if (!ctx)
		return thread_last_error;
	pthread_mutex_lock(&ctx->error->lock);
	memcpy(thread_read_error, ctx->error->message, sizeof(thread_read_error));
	pthread_mutex_unlock(&ctx->error->lock);
	return thread_read_error;
}

KVR_API uint32_t kvr_version_number(void)
{
	return KVR_VERSION_NUMBER;
}

#define KVR_STR2(x) #x
#define KVR_STR(x) KVR_STR2(x)

KVR_API const char *kvr_version_string(void)
{
	return KVR_STR(KVR_VERSION_MAJOR) "." KVR_STR(KVR_VERSION_MINOR) "." KVR_STR(
		KVR_VERSION_PATCH);
}
