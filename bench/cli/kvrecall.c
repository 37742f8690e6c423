/* SPDX-License-Identifier: MIT */
/*
 * kvrecall.c — the `kvrecall` command: the front door for users. Subcommands:
 *   info      what this build and machine offer (the first thing to run)
 *   version   the library version, git revision and build type (also --version)
 *   generate, eval   the real-model runner (bench/model/runner.c)
 *   bench     benchmarks of this machine (bench_cmd.c)
 *   selftest  does kvrecall work here (selftest.c)
 * info, version and the runner use only the public API (runtime/kvrecall.h),
 * like any engine would; bench measures the device layer below it, so the
 * command links the static library.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "kvrecall.h"
#include "../cli_args.h"
#include "bench_cmd.h"
#include "git_revision.h"
#include "selftest.h"
#ifdef KVR_HAVE_RUNNER
#include "runner.h"
#endif

#ifndef KVR_BUILD_TYPE
#define KVR_BUILD_TYPE "unknown"
#endif

static void usage(FILE *f)
{
	fprintf(f, "usage: kvrecall <command> [options]\n"
		   "       kvrecall <command> --help   a command's options\n"
		   "       kvrecall --version\n"
		   "\n"
		   "commands:\n"
		   "  info [--json] [--spill-dir DIR]   build features, GPU, CPU, NUMA, memory, io_uring\n"
		   "                  and the spill directory's O_DIRECT support on this machine\n"
		   "  version         the library version, git revision and build type\n"
		   "  generate        run a GGUF model with its attention through kvrecall\n"
		   "  eval            perplexity and agreement with dense over a long text, per mode\n"
		   "  bench           benchmarks of this machine: copy, recall, decode, freelist, cache,\n"
		   "                  spill\n"
		   "  selftest [--json FILE]   does kvrecall work here? every backend present, one verdict\n"
		   "  help [COMMAND]  this text, or a command's\n"
		   "\n"
		   "Errors go to stderr. Exit status: 0 success; 1 a failure while running (or a\n"
		   "selftest check that failed); 2 a wrong command line (an unknown command or option,\n"
		   "a missing, malformed or out-of-range value), with nothing run.\n");
}

static void version_line(void)
{
	printf("kvrecall %s (git %s, %s build)\n", kvr_version_string(), KVR_GIT_REVISION, KVR_BUILD_TYPE);
}

static void json_string(FILE *f, const char *key, const char *value, int last)
{
	fprintf(f, "  \"%s\": ", key);
	bench_json_string(f, value);
	fprintf(f, "%s\n", last ? "" : ",");
}

#define INFO_CMD "kvrecall info"

static void info_usage(FILE *f)
{
	fprintf(f, "usage: kvrecall info [--json] [--spill-dir DIR]\n"
		   "  What this build and machine offer: build features, GPU, CPU and its kernels,\n"
		   "  NUMA, memory, io_uring, and the spill directory's O_DIRECT support.\n"
		   "  --json           the same as JSON\n"
		   "  --spill-dir DIR  the spill directory to check (default: the library's)\n");
}

static int cmd_info(int argc, char **argv)
{
	int json = 0;
	const char *spill_dir = NULL;
	for (int i = 0; i < argc; i++) {
		if (cli_is_help(argv[i])) {
			info_usage(stdout);
			return CLI_EXIT_OK;
		}
		if (!strcmp(argv[i], "--json")) {
			json = 1;
			continue;
		}
		CLI_TAKE(cli_opt_str(INFO_CMD, argc, argv, &i, "--spill-dir", &spill_dir))
		return cli_usage_error(INFO_CMD, "unknown option '%s'", argv[i]);
	}
	struct kvr_system_info s = { .size = sizeof(s) };
	int err = kvr_system_query(&s);
	if (err)
		fprintf(stderr, "kvrecall info: %s (%s); continuing with what was found\n",
			kvr_last_error(NULL), kvr_strerror(err));
	struct kvr_spill_dir_info sd = { .size = sizeof(sd) };
	const int spill_err = kvr_spill_dir_query(spill_dir, &sd);

	char gpu_line[512];
	if (!s.cuda_compiled)
		snprintf(gpu_line, sizeof(gpu_line), "CUDA backend not compiled; no GPU: %s",
			 s.gpu_reason);
	else if (s.n_gpus == 0)
		snprintf(gpu_line, sizeof(gpu_line), "CUDA backend compiled; no GPU: %s", s.gpu_reason);
	else
		snprintf(gpu_line, sizeof(gpu_line), "CUDA backend compiled; %u GPU%s: %s at %s",
			 s.n_gpus, s.n_gpus > 1 ? "s" : "", s.gpu_name, s.gpu_pci_bus_id);

	const double gib = 1024.0 * 1024.0 * 1024.0;
	if (json) {
		printf("{\n");
		json_string(stdout, "version", kvr_version_string(), 0);
		printf("  \"cuda_compiled\": %s,\n", s.cuda_compiled ? "true" : "false");
		printf("  \"cuda_runtime_version\": %u,\n", s.cuda_runtime_version);
		json_string(stdout, "gpu_archs", s.gpu_archs, 0);
		printf("  \"n_gpus\": %u,\n", s.n_gpus);
		json_string(stdout, "gpu_name", s.gpu_name, 0);
		json_string(stdout, "gpu_pci_bus_id", s.gpu_pci_bus_id, 0);
		json_string(stdout, "gpu_reason", s.gpu_reason, 0);
		json_string(stdout, "cpu_model", s.cpu_model, 0);
		printf("  \"avx2\": %s,\n  \"avx512\": %s,\n  \"f16c\": %s,\n",
		       s.cpu_avx2 ? "true" : "false", s.cpu_avx512 ? "true" : "false",
		       s.cpu_f16c ? "true" : "false");
		json_string(stdout, "cpu_kernels", s.cpu_kernels, 0);
		json_string(stdout, "cpu_kernels_note", s.cpu_kernels_note, 0);
		printf("  \"numa_nodes\": %u,\n  \"cores\": %u,\n  \"hardware_threads\": %u,\n",
		       s.n_numa_nodes, s.n_cores, s.n_pus);
		printf("  \"memory_bytes\": %llu,\n  \"last_level_cache_bytes\": %llu,\n",
		       (unsigned long long)s.memory_bytes, (unsigned long long)s.l3_bytes);
		printf("  \"liburing_compiled\": %s,\n", s.liburing_compiled ? "true" : "false");
		printf("  \"io_uring_available\": %s,\n", s.io_uring_available ? "true" : "false");
		json_string(stdout, "io_uring_reason", s.io_uring_reason, 0);
		json_string(stdout, "spill_dir", sd.dir, 0);
		printf("  \"spill_dir_usable\": %s,\n", spill_err ? "false" : "true");
		json_string(stdout, "spill_fs_type", sd.fs_type, 0);
		printf("  \"spill_direct_io\": %s,\n", sd.direct_io ? "true" : "false");
		printf("  \"spill_dio_align\": %u,\n", sd.dio_align);
		printf("  \"spill_free_bytes\": %llu,\n", (unsigned long long)sd.free_bytes);
		json_string(stdout, "spill_reason", sd.reason, 1);
		printf("}\n");
		return err ? 1 : 0;
	}
	printf("kvrecall %s\n", kvr_version_string());
	printf("  build     CUDA backend %s", s.cuda_compiled ? "compiled" : "not compiled");
	if (s.cuda_compiled) {
		printf(" (CUDA runtime %u.%u, for", s.cuda_runtime_version / 1000,
		       s.cuda_runtime_version % 1000 / 10);
		char archs[sizeof(s.gpu_archs)];
		snprintf(archs, sizeof(archs), "%s", s.gpu_archs);
		const char *sep = " ";
		for (char *save = NULL, *a = strtok_r(archs, ",", &save); a;
		     a = strtok_r(NULL, ",", &save), sep = ", ")
			printf("%ssm_%s", sep, a);
		printf(")");
	}
	printf("; liburing %s\n", s.liburing_compiled ? "yes" : "no");
	printf("  gpu       %s\n", gpu_line);
	printf("  cpu       %s\n", s.cpu_model[0] ? s.cpu_model : "(unknown model)");
	printf("  simd      AVX2 %s, AVX-512 %s, F16C %s; kernels %s%s%s%s\n", s.cpu_avx2 ? "yes" : "no",
	       s.cpu_avx512 ? "yes" : "no", s.cpu_f16c ? "yes" : "no", s.cpu_kernels,
	       s.cpu_kernels_note[0] ? " (" : "", s.cpu_kernels_note, s.cpu_kernels_note[0] ? ")" : "");
	printf("  topology  %u NUMA node%s, %u cores, %u hardware threads, last-level cache %.0f MiB\n",
	       s.n_numa_nodes, s.n_numa_nodes == 1 ? "" : "s", s.n_cores, s.n_pus,
	       (double)s.l3_bytes / (1024.0 * 1024.0));
	printf("  memory    %.1f GiB\n", (double)s.memory_bytes / gib);
	printf("  io_uring  %s%s%s\n", s.io_uring_available ? "available" : "unavailable",
	       s.io_uring_available ? "" : ": ", s.io_uring_reason);
	if (spill_err)
		printf("  spill     %s: unusable: %s\n", sd.dir, sd.reason);
	else if (sd.direct_io)
		printf("  spill     %s (%s): O_DIRECT, %u-byte alignment, %.1f GiB free\n", sd.dir,
		       sd.fs_type, sd.dio_align, (double)sd.free_bytes / gib);
	else
		printf("  spill     %s (%s): no O_DIRECT (%s), through the page cache; %.1f GiB free\n",
		       sd.dir, sd.fs_type, sd.reason, (double)sd.free_bytes / gib);
	printf("  backend   %s\n", s.n_gpus ? "cuda available; cpu is the default" : "cpu (default)");
	return err ? 1 : 0;
}

static int cmd_version(int argc, char **argv)
{
	if (argc > 0 && cli_is_help(argv[0])) {
		printf("usage: kvrecall version (or kvrecall --version)\n"
		       "  One line: the library version, the git revision built and the build type.\n");
		return CLI_EXIT_OK;
	}
	if (argc > 0)
		return cli_usage_error("kvrecall version", "unknown option '%s'", argv[0]);
	version_line();
	return CLI_EXIT_OK;
}

static int cmd_selftest(int argc, char **argv)
{
	/* selftest runs this executable again (recall, compute-sanitizer) */
	char self[4096];
	const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
	if (n <= 0) {
		fprintf(stderr, "kvrecall selftest: cannot find this executable (/proc/self/exe)\n");
		return CLI_EXIT_FAILURE;
	}
	self[n] = 0;
	return selftest_main(argc, argv, self);
}

/* The command's argv without its name; returns the exit status. */
static int dispatch(const char *cmd, int argc, char **argv)
{
#ifdef KVR_HAVE_RUNNER
	if (!strcmp(cmd, "generate"))
		return runner_generate(argc, argv);
	if (!strcmp(cmd, "eval"))
		return runner_eval(argc, argv);
#endif
	if (!strcmp(cmd, "info"))
		return cmd_info(argc, argv);
	if (!strcmp(cmd, "bench"))
		return bench_main(argc, argv);
	if (!strcmp(cmd, "selftest"))
		return cmd_selftest(argc, argv);
	if (!strcmp(cmd, "version") || !strcmp(cmd, "--version") || !strcmp(cmd, "-V"))
		return cmd_version(argc, argv);
	if (!strcmp(cmd, "help") && argc > 0) { /* help COMMAND: that command's --help */
		char help[] = "--help";
		char *help_argv[] = { help, NULL };
		return dispatch(argv[0], 1, help_argv);
	}
	if (!strcmp(cmd, "help") || cli_is_help(cmd)) {
		usage(stdout);
		return CLI_EXIT_OK;
	}
	if (cmd[0] == '-')
		return cli_usage_error("kvrecall", "unknown option '%s'", cmd);
	return cli_usage_error("kvrecall", "unknown command '%s'", cmd);
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		usage(stderr);
		return CLI_EXIT_USAGE;
	}
	return dispatch(argv[1], argc - 2, argv + 2);
}
