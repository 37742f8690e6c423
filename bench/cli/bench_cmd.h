/* SPDX-License-Identifier: MIT */
/*
 * bench_cmd.h — `kvrecall bench` (bench_cmd.c): the entry point the command
 * dispatches to, and the parts its benchmarks share (the backend device, the
 * JSON envelope with the machine and build, the progress line). Main thread.
 */
#ifndef KVR_BENCH_CMD_H
#define KVR_BENCH_CMD_H

#include <stdint.h>
#include <stdio.h>

struct kvr_dev;

/* argv[0] names the benchmark; returns the process's exit status. */
int bench_main(int argc, char **argv);
int bench_copy(int argc, char **argv);
int bench_recall(int argc, char **argv); /* bench_recall.c */
int bench_decode(int argc, char **argv); /* bench_decode.c */
int bench_freelist(int argc, char **argv); /* bench_freelist.c */
int bench_cache(int argc, char **argv); /* bench_cache.c */
int bench_spill(int argc, char **argv); /* bench_spill.c */

/* --backend auto|cpu|cuda -> an open device (auto: cuda when a GPU is usable).
 * 0, or a negative errno after a message on stderr that names cmd (e.g.
 * "kvrecall bench copy"). */
int bench_open_device(const char *cmd, const char *backend, struct kvr_dev **dev, const char **name);

/* JSON: a quoted, escaped string; the envelope's opening (schema, benchmark,
 * command, time, machine, build, backend) and its closing brace. */
void bench_json_string(FILE *f, const char *s);
void bench_json_open(FILE *f, const char *benchmark, const char *backend, int argc, char **argv);
void bench_json_close(FILE *f);

/* A progress bar on stderr when it is a terminal; done == total clears it. */
void bench_progress(const char *label, uint32_t done, uint32_t total);
/* Erases a progress bar before a line of results (on a terminal; nothing
 * elsewhere). */
void bench_progress_clear(void);

#endif /* KVR_BENCH_CMD_H */
