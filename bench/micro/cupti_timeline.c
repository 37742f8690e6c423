/* SPDX-License-Identifier: MIT */
/*
 * cupti_timeline.c — a CUDA injection library that writes the device's
 * timeline of a program run: every kernel, copy and memset with its stream
 * and its start and end on the GPU, every CUDA runtime and driver call with
 * its span on the host thread, and every synchronisation. It is how the
 * decode step's time on an H100 was taken apart (docs/benchmarks.md,
 * "The GPU path"), on machines without Nsight Systems. Not part of
 * the library; built by hand where CUPTI's headers are:
 *
 *   cc -O2 -shared -fPIC -I$CUDA/include bench/micro/cupti_timeline.c \
 *      -L$CUDA/lib -lcupti -o libcupti_timeline.so
 *   CUDA_INJECTION64_PATH=$PWD/libcupti_timeline.so KVR_TIMELINE=out.txt \
 *      LD_LIBRARY_PATH=$CUDA/lib ./kvrecall bench decode --backend cuda ...
 *
 * The CUDA driver loads the library named by CUDA_INJECTION64_PATH when it
 * starts and calls InitializeInjection. Output, one record per line, times
 * in ns on CUPTI's clock (the same for host and device records):
 *   K start end stream name           a kernel
 *   C start end stream bytes kind     a copy (kind: CUPTI's copy kind)
 *   S start end stream bytes          a memset
 *   R start end thread name           a runtime call
 *   D start end thread name           a driver call
 *   Y start end stream type           a synchronisation
 *
 * Threads: CUPTI calls the buffer callbacks on its own thread; records are
 * written under a mutex. Buffers are flushed at exit.
 */
#include <cupti.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#define BUFFER_BYTES (8u << 20)

static FILE *timeline;
static pthread_mutex_t write_lock = PTHREAD_MUTEX_INITIALIZER;

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records)
{
	*buffer = aligned_alloc(8, BUFFER_BYTES);
	*size = *buffer ? BUFFER_BYTES : 0;
	*max_records = 0;
}

static const char *callback_name(CUpti_CallbackDomain domain, uint32_t cbid)
{
	const char *name = NULL;
	if (cuptiGetCallbackName(domain, cbid, &name) != CUPTI_SUCCESS || !name)
		return "?";
	return name;
}

static void write_record(const CUpti_Activity *rec)
{
	switch (rec->kind) {
	case CUPTI_ACTIVITY_KIND_KERNEL:
	case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
		const CUpti_ActivityKernel10 *k = (const void *)rec;
		fprintf(timeline, "K %llu %llu %u %s\n", (unsigned long long)k->start, (unsigned long long)k->end,
			k->streamId, k->name ? k->name : "?");
		break;
	}
	case CUPTI_ACTIVITY_KIND_MEMCPY: {
		const CUpti_ActivityMemcpy6 *m = (const void *)rec;
		fprintf(timeline, "C %llu %llu %u %llu %u\n", (unsigned long long)m->start,
			(unsigned long long)m->end, m->streamId, (unsigned long long)m->bytes, m->copyKind);
		break;
	}
	case CUPTI_ACTIVITY_KIND_MEMSET: {
		const CUpti_ActivityMemset4 *m = (const void *)rec;
		fprintf(timeline, "S %llu %llu %u %llu\n", (unsigned long long)m->start, (unsigned long long)m->end,
			m->streamId, (unsigned long long)m->bytes);
		break;
	}
	case CUPTI_ACTIVITY_KIND_RUNTIME:
	case CUPTI_ACTIVITY_KIND_DRIVER: {
		const CUpti_ActivityAPI *a = (const void *)rec;
		const int runtime = rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
		fprintf(timeline, "%c %llu %llu %u %s\n", runtime ? 'R' : 'D', (unsigned long long)a->start,
			(unsigned long long)a->end, a->threadId,
			callback_name(runtime ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API, a->cbid));
		break;
	}
	case CUPTI_ACTIVITY_KIND_SYNCHRONIZATION: {
		const CUpti_ActivitySynchronization2 *y = (const void *)rec;
		fprintf(timeline, "Y %llu %llu %u %u\n", (unsigned long long)y->start, (unsigned long long)y->end,
			y->streamId, (unsigned)y->type);
		break;
	}
	default:
		break;
	}
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
				      size_t valid)
{
	(void)ctx, (void)stream, (void)size;
	CUpti_Activity *rec = NULL;
	pthread_mutex_lock(&write_lock);
	while (timeline && cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS)
		write_record(rec);
	pthread_mutex_unlock(&write_lock);
	free(buffer);
}

static void flush_at_exit(void)
{
	cuptiActivityFlushAll(1);
	pthread_mutex_lock(&write_lock);
	if (timeline)
		fclose(timeline);
	timeline = NULL;
	pthread_mutex_unlock(&write_lock);
}

int InitializeInjection(void)
{
	const char *path = getenv("KVR_TIMELINE");
	timeline = fopen(path ? path : "timeline.txt", "w");
	if (!timeline)
		return 0;
	const CUpti_ActivityKind kinds[] = { CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
					     CUPTI_ACTIVITY_KIND_MEMSET,	    CUPTI_ACTIVITY_KIND_RUNTIME,
					     CUPTI_ACTIVITY_KIND_DRIVER,	    CUPTI_ACTIVITY_KIND_SYNCHRONIZATION };
	if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS)
		return 0;
	for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
		if (cuptiActivityEnable(kinds[i]) != CUPTI_SUCCESS)
			fprintf(stderr, "cupti_timeline: activity kind %d not enabled\n", (int)kinds[i]);
	atexit(flush_at_exit);
	return 1;
}
