/* SPDX-License-Identifier: MIT */
/*
 * log.h — the message callback the host modules (pool.h, spill.h) take from
 * their owner, and the one function that formats a line for it. The owner
 * (runtime/context.c) maps levels onto kvr_log_level.
 *
 * Threads: whichever thread logs; the callback must be safe to call from it.
 */
#ifndef KVR_BASE_LOG_H
#define KVR_BASE_LOG_H

#include <stdarg.h>
#include <stdio.h>

typedef void (*kvr_host_log_fn)(void *user, int level, const char *message);

/* fmt's line (up to 255 bytes) to fn, when there is one. */
static inline void kvr_host_vlog(kvr_host_log_fn fn, void *user, int level, const char *fmt,
				 va_list ap)
{
	if (!fn)
		return;
	char line[256];
	vsnprintf(line, sizeof(line), fmt, ap);
	fn(user, level, line);
}

#endif /* KVR_BASE_LOG_H */
