/* SPDX-License-Identifier: MIT */
/*
 * decode_bench.c — `kvrecall bench decode` under its earlier name: the
 * commands beside older results in docs/history.md call it. Main thread.
 */
#include "bench_cmd.h"

int main(int argc, char **argv)
{
	return bench_decode(argc - 1, argv + 1);
}
