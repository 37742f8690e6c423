/* SPDX-License-Identifier: MIT */
/*
 * test_cudaemu_shim.cc — the cudaemu SIMT shim (gpu/cudaemu) against CUDA's
 * semantics, with small kernels written the way the gpu/ .cu kernels are: block
 * reductions through __shared__ and __syncthreads over 1-D/2-D/3-D blocks and
 * grids, warp shuffles and votes (partial warps included), atomics, dynamic
 * shared memory, thread-order seeds exposing races, failed launches (stalls,
 * warp misuse, bad configurations) that report instead of hanging, and
 * launches from several OS threads at once.
 *
 * Each Criterion test runs in its own process; every launch in it runs on the
 * test's thread except in `concurrent_launches`, whose worker threads each
 * have their own scheduler and error state and report back by value.
 */
#include <criterion/criterion.h>

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <numeric>
#include <thread>
#include <vector>

#include "cudaemu/shim.h"

namespace {

constexpr unsigned full = 0xffffffffu;

/* The error of the last launch must be cudaSuccess. */
void expect_launch_ok(const char *what)
{
	const cudaError_t err = cudaGetLastError();
	cr_assert_eq(err, cudaSuccess, "%s: %s: %s", what, cudaGetErrorName(err),
		     kvr_emu_last_launch_message());
}

/* The last launch failed with `want`, its message contains `needle`, and the
 * error is cleared by reading it. */
void expect_launch_error(cudaError_t want, const char *needle)
{
	const cudaError_t err = cudaGetLastError();
	cr_assert_eq(err, want, "got %s (%s)", cudaGetErrorName(err),
		     kvr_emu_last_launch_message());
	cr_assert(strstr(kvr_emu_last_launch_message(), needle) != nullptr,
		  "message \"%s\" lacks \"%s\"", kvr_emu_last_launch_message(), needle);
	cr_assert_eq(cudaGetLastError(), cudaSuccess, "the error is reported once");
}

__device__ unsigned linear_thread()
{
	return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

__device__ unsigned linear_block()
{
	return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}

/* Sum of each block's slice of `in`, tree-reduced in shared memory. With
 * `racy`, the barrier between the tree's levels is left out. */
template <bool racy> __global__ void block_sum(const int *in, int *block_sums)
{
	__shared__ int partial[1024];
	const unsigned nt = blockDim.x * blockDim.y * blockDim.z;
	const unsigned t = linear_thread();
	partial[t] = in[linear_block() * nt + t];
	__syncthreads();
	unsigned p2 = 1;
	while (p2 < nt)
		p2 *= 2;
	for (unsigned stride = p2 / 2; stride > 0; stride /= 2) {
		if (t < stride && t + stride < nt)
			partial[t] += partial[t + stride];
		if (!racy)
			__syncthreads();
	}
	if (t == 0)
		block_sums[linear_block()] = partial[0];
}

/* Runs block_sum on deterministic data; true when every block's sum is right. */
template <bool racy> bool run_block_sum(dim3 block, dim3 grid, int salt)
{
	const unsigned nt = block.x * block.y * block.z, nb = grid.x * grid.y * grid.z;
	std::vector<int> in(nt * nb), sums(nb, -1);
	for (size_t i = 0; i < in.size(); i++)
		in[i] = (int)((i * 7919 + (size_t)salt * 104729) % 1000) - 300;
	KVR_LAUNCH(block_sum<racy>, grid, block, 0, nullptr, in.data(), sums.data());
	if (cudaGetLastError() != cudaSuccess)
		return false;
	for (unsigned b = 0; b < nb; b++) {
		const int want = std::accumulate(in.begin() + b * nt, in.begin() + (b + 1) * nt, 0);
		if (sums[b] != want)
			return false;
	}
	return true;
}

} /* namespace */

Test(cudaemu, block_reduction_over_block_and_grid_shapes)
{
	const dim3 blocks[] = { dim3(1),	 dim3(32),	dim3(33),      dim3(100),
				dim3(256),	 dim3(1024),	dim3(8, 4, 2), dim3(5, 3, 7),
				dim3(16, 16, 4), dim3(32, 1, 3) };
	const dim3 grids[] = { dim3(1), dim3(3), dim3(2, 3), dim3(2, 1, 2) };
	for (uint64_t seed : { 0ull, 7ull }) {
		kvr_emu_set_order_seed(seed);
		for (const dim3 &b : blocks)
			for (const dim3 &g : grids) {
				/* 1024-thread blocks skip the larger grids: a fast test. */
				if (b.x * b.y * b.z >= 1024 && g.x * g.y * g.z > 3)
					continue;
				cr_assert(run_block_sum<false>(b, g, 1),
					  "seed %llu block (%u,%u,%u) grid (%u,%u,%u): %s",
					  (unsigned long long)seed, b.x, b.y, b.z, g.x, g.y, g.z,
					  kvr_emu_last_launch_message());
			}
	}
}

namespace {

/* Every thread records its coordinates at its global linear index. */
__global__ void coordinates(unsigned *out)
{
	const unsigned g = linear_block() * blockDim.x * blockDim.y * blockDim.z + linear_thread();
	const unsigned v[] = { threadIdx.x, threadIdx.y, threadIdx.z, blockIdx.x,
			       blockIdx.y,  blockIdx.z,	 blockDim.x,  gridDim.z };
	for (unsigned i = 0; i < 8; i++)
		out[g * 8 + i] = v[i];
}

} /* namespace */

Test(cudaemu, builtin_variables_cover_the_grid)
{
	const dim3 block(3, 4, 5), grid(2, 3, 4);
	const unsigned n = 60 * 24;
	std::vector<unsigned> out(n * 8, ~0u);
	KVR_LAUNCH(coordinates, grid, block, 0, nullptr, out.data());
	expect_launch_ok("coordinates");
	unsigned g = 0;
	for (unsigned bz = 0; bz < 4; bz++)
		for (unsigned by = 0; by < 3; by++)
			for (unsigned bx = 0; bx < 2; bx++)
				for (unsigned tz = 0; tz < 5; tz++)
					for (unsigned ty = 0; ty < 4; ty++)
						for (unsigned tx = 0; tx < 3; tx++, g++) {
							const unsigned want[] = { tx, ty, tz, bx,
										  by, bz, 3,  4 };
							for (unsigned i = 0; i < 8; i++)
								cr_assert_eq(
									out[g * 8 + i], want[i],
									"thread %u field %u", g, i);
						}
	/* dim3 converts like CUDA's: defaults of 1, to and from uint3. */
	const dim3 d(uint3{ 6, 7, 8 });
	const uint3 u = dim3(9);
	cr_assert(d.x == 6 && d.y == 7 && d.z == 8 && u.x == 9 && u.y == 1 && u.z == 1);
	cr_assert_eq(warpSize, 32);
}

namespace {

/* Warp sums two ways: a butterfly (every lane gets the sum) and a tree down
 * to lane 0. */
template <typename T> __global__ void warp_sums(const T *in, T *xor_out, T *down_out)
{
	const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
	T x = in[t], d = in[t];
	for (int m = 16; m > 0; m /= 2)
		x += __shfl_xor_sync(full, x, m);
	for (unsigned o = 16; o > 0; o /= 2)
		d += __shfl_down_sync(full, d, o);
	xor_out[t] = x;
	down_out[t] = d;
}

template <typename T> void check_warp_sums()
{
	const unsigned n = 3 * 96;
	std::vector<T> in(n), x(n), d(n);
	for (unsigned i = 0; i < n; i++)
		in[i] = (T)((i * 37) % 101);
	KVR_LAUNCH(warp_sums<T>, 3, 96, 0, nullptr, in.data(), x.data(), d.data());
	expect_launch_ok("warp_sums");
	for (unsigned w = 0; w < n / 32; w++) {
		T want = 0;
		for (unsigned l = 0; l < 32; l++)
			want += in[w * 32 + l];
		cr_assert_eq(d[w * 32], want, "warp %u: __shfl_down_sync tree", w);
		for (unsigned l = 0; l < 32; l++)
			cr_assert_eq(x[w * 32 + l], want,
				     "warp %u lane %u: __shfl_xor_sync butterfly", w, l);
	}
}

} /* namespace */

Test(cudaemu, warp_reductions)
{
	kvr_emu_set_order_seed(3);
	check_warp_sums<int>();
	check_warp_sums<unsigned>();
	check_warp_sums<float>();
}

namespace {

constexpr int n_modes = 9;

/* Each thread records the results of several shuffles of 1000 + its id. */
__global__ void shuffle_modes(int *out, int width)
{
	const unsigned t = threadIdx.x;
	const int v = 1000 + (int)t;
	int *o = out + t * n_modes;
	o[0] = __shfl_sync(full, v, 3, width);
	o[1] = __shfl_sync(full, v, 37, width); /* source lanes wrap modulo width */
	o[2] = __shfl_up_sync(full, v, 2, width);
	o[3] = __shfl_down_sync(full, v, 5, width);
	o[4] = __shfl_xor_sync(full, v, 9, width);
	o[5] = __shfl_xor_sync(full, v, 3, width);
	o[6] = (int)__shfl_down_sync(full, (unsigned)v, 1, width);
	o[7] = (int)__shfl_up_sync(full, (float)v, 7u, width);
	o[8] = __shfl_sync(full, v, 31); /* width defaults to 32 */
}

/* CUDA's documented shuffle rules, written independently of the shim. */
int shuffle_reference(int mode, unsigned t, unsigned n, int width)
{
	const unsigned warp_first = t / 32 * 32, lane = t % 32;
	const unsigned active = std::min(32u, n - warp_first);
	const unsigned seg = lane / (unsigned)width * (unsigned)width, w = (unsigned)width;
	long src = lane;
	switch (mode) {
	case 0:
		src = seg + 3 % w;
		break;
	case 1:
		src = seg + 37 % w;
		break;
	case 2:
		src = lane - seg >= 2 ? lane - 2 : lane;
		break;
	case 3:
		src = lane - seg + 5 < w ? lane + 5 : lane;
		break;
	case 4:
	case 5: {
		const unsigned x = lane ^ (mode == 4 ? 9u : 3u);
		src = x / w > lane / w ? lane : x; /* later groups return the own value */
		break;
	}
	case 6:
		src = lane - seg + 1 < w ? lane + 1 : lane;
		break;
	case 7:
		src = lane - seg >= 7 ? lane - 7 : lane;
		break;
	case 8:
		src = 31;
		break;
	}
	if ((unsigned)src >= active) /* a lane past the end of a partial warp */
		src = lane;
	return 1000 + (int)(warp_first + (unsigned)src);
}

} /* namespace */

Test(cudaemu, shuffle_semantics_with_widths_and_partial_warps)
{
	kvr_emu_set_order_seed(11);
	for (unsigned n : { 64u, 40u })
		for (int width : { 32, 16, 8, 4, 2, 1 }) {
			std::vector<int> out(n * n_modes, -1);
			KVR_LAUNCH(shuffle_modes, 1, n, 0, nullptr, out.data(), width);
			expect_launch_ok("shuffle_modes");
			for (unsigned t = 0; t < n; t++)
				for (int m = 0; m < n_modes; m++)
					cr_assert_eq(out[t * n_modes + m],
						     shuffle_reference(m, t, n, width),
						     "block %u width %d thread %u mode %d", n,
						     width, t, m);
		}
}

namespace {

__global__ void votes(unsigned *ballots, int *any17, int *all_not5, int *all_not20)
{
	const unsigned t = threadIdx.x, lane = t % 32;
	ballots[t] = __ballot_sync(full, lane % 3 == 0);
	any17[t] = __any_sync(full, t == 17);
	all_not5[t] = __all_sync(full, lane != 5);
	all_not20[t] = __all_sync(full, lane != 20);
}

} /* namespace */

Test(cudaemu, ballot_any_all)
{
	kvr_emu_set_order_seed(5);
	const unsigned n = 40; /* warp 1 has lanes 0..7 only */
	std::vector<unsigned> ballots(n);
	std::vector<int> any17(n), all5(n), all20(n);
	KVR_LAUNCH(votes, 1, n, 0, nullptr, ballots.data(), any17.data(), all5.data(),
		   all20.data());
	expect_launch_ok("votes");
	for (unsigned t = 0; t < n; t++) {
		const bool w0 = t < 32;
		cr_assert_eq(ballots[t], w0 ? 0x49249249u : 0x49u, "thread %u", t);
		cr_assert_eq(any17[t], w0 ? 1 : 0, "thread %u", t);
		cr_assert_eq(all5[t], 0, "thread %u", t);
		cr_assert_eq(all20[t], w0 ? 0 : 1, "thread %u: lane 20 is not in warp 1", t);
	}
}

namespace {

__global__ void histogram(const unsigned *values, unsigned n, unsigned *bins, int *signed_bins)
{
	const unsigned stride = gridDim.x * blockDim.x;
	for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
		atomicAdd(&bins[values[i] % 64], 1u);
		atomicAdd(&signed_bins[values[i] % 8], -1);
	}
}

__global__ void extremes(const unsigned *values, unsigned n, int *max_i, int *min_i,
			 unsigned *max_u, unsigned *min_u)
{
	const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n) {
		atomicMax(max_i, (int)values[i] - 500);
		atomicMin(min_i, (int)values[i] - 500);
		atomicMax(max_u, values[i]);
		atomicMin(min_u, values[i]);
	}
}

/* Return values: tickets from atomicAdd, a CAS-loop counter, exchanges. */
__global__ void atomic_returns(unsigned *counter, unsigned *tickets, int *cas_counter,
			       unsigned long long *big, float *fsum, int *slot, int *swapped,
			       unsigned long long *cas64, unsigned *cas_u)
{
	const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
	tickets[t] = atomicAdd(counter, 1u);
	int old = *cas_counter, assumed;
	do {
		assumed = old;
		old = atomicCAS(cas_counter, assumed, assumed + 2);
	} while (old != assumed);
	atomicAdd(big, 1ull << 33);
	atomicAdd(fsum, 0.25f);
	swapped[t] = atomicExch(slot, (int)t);
	atomicCAS(cas64, 0ull, 1ull << 40);
	atomicCAS(cas_u, t, 1000u + t); /* only thread *cas_u's CAS matches */
}

} /* namespace */

Test(cudaemu, atomics)
{
	kvr_emu_set_order_seed(9);
	const unsigned n = 5000;
	std::vector<unsigned> values(n);
	for (unsigned i = 0; i < n; i++)
		values[i] = (i * 2654435761u) % 1000;
	std::vector<unsigned> bins(64, 0), want_bins(64, 0);
	std::vector<int> sbins(8, 0), want_sbins(8, 0);
	for (unsigned v : values) {
		want_bins[v % 64]++;
		want_sbins[v % 8]--;
	}
	KVR_LAUNCH(histogram, 4, 96, 0, nullptr, values.data(), n, bins.data(), sbins.data());
	expect_launch_ok("histogram");
	cr_assert(bins == want_bins, "atomicAdd histogram (unsigned)");
	cr_assert(sbins == want_sbins, "atomicAdd histogram (int)");

	int max_i = -1000000, min_i = 1000000;
	unsigned max_u = 0, min_u = ~0u;
	KVR_LAUNCH(extremes, (n + 255) / 256, 256, 0, nullptr, values.data(), n, &max_i, &min_i,
		   &max_u, &min_u);
	expect_launch_ok("extremes");
	const unsigned vmax = *std::max_element(values.begin(), values.end());
	const unsigned vmin = *std::min_element(values.begin(), values.end());
	cr_assert_eq(max_i, (int)vmax - 500);
	cr_assert_eq(min_i, (int)vmin - 500);
	cr_assert_eq(max_u, vmax);
	cr_assert_eq(min_u, vmin);

	const unsigned nt = 3 * 64;
	unsigned counter = 0, cas_u = 17;
	int cas_counter = 0, slot = -1;
	unsigned long long big = 0, cas64 = 0;
	float fsum = 0.0f;
	std::vector<unsigned> tickets(nt);
	std::vector<int> swapped(nt);
	KVR_LAUNCH(atomic_returns, 3, 64, 0, nullptr, &counter, tickets.data(), &cas_counter, &big,
		   &fsum, &slot, swapped.data(), &cas64, &cas_u);
	expect_launch_ok("atomic_returns");
	cr_assert_eq(counter, nt);
	std::sort(tickets.begin(), tickets.end());
	for (unsigned i = 0; i < nt; i++)
		cr_assert_eq(tickets[i], i, "atomicAdd returns each old value once");
	cr_assert_eq(cas_counter, 2 * (int)nt);
	cr_assert_eq(big, (unsigned long long)nt << 33);
	cr_assert_eq(fsum, 0.25f * nt);
	cr_assert_eq(cas64, 1ull << 40);
	cr_assert_eq(cas_u, 1017u);
	/* The exchanges form one chain: -1 and every id but the last one out. */
	std::vector<int> chain(swapped);
	chain.push_back(slot);
	std::sort(chain.begin(), chain.end());
	for (unsigned i = 0; i <= nt; i++)
		cr_assert_eq(chain[i], (int)i - 1, "atomicExch chain");
}

namespace {

/* Dynamic shared memory: its alignment, its garbage before the first write,
 * and a two-array use of it. */
__global__ void dynamic_shared(const float *in, float *out, unsigned *first_word,
			       unsigned *misalignment)
{
	KVR_DYNAMIC_SHARED(float, buf);
	const unsigned t = threadIdx.x, n = blockDim.x, b = blockIdx.x;
	if (t == 0) {
		first_word[b] = __float_as_uint(buf[0]);
		misalignment[b] = (unsigned)((uintptr_t)buf % 16);
	}
	__syncthreads();
	buf[t] = in[b * n + t];
	buf[n + t] = 2.0f * in[b * n + t];
	__syncthreads();
	if (t == 0) {
		float s = 0.0f;
		for (unsigned i = 0; i < 2 * n; i++)
			s += buf[i];
		out[b] = s;
	}
}

} /* namespace */

Test(cudaemu, dynamic_shared_memory)
{
	kvr_emu_set_order_seed(2);
	const unsigned nb = 4, nt = 48;
	std::vector<float> in(nb * nt), out(nb, -1.0f);
	std::vector<unsigned> first(nb, 0), mis(nb, 99);
	for (unsigned i = 0; i < nb * nt; i++)
		in[i] = (float)(i % 17);
	KVR_LAUNCH(dynamic_shared, nb, nt, 2 * nt * sizeof(float), nullptr, in.data(), out.data(),
		   first.data(), mis.data());
	expect_launch_ok("dynamic_shared");
	for (unsigned b = 0; b < nb; b++) {
		float want = 0.0f;
		for (unsigned t = 0; t < nt; t++)
			want += 3.0f * in[b * nt + t];
		cr_assert_eq(out[b], want, "block %u", b);
		cr_assert_eq(first[b], 0xA5A5A5A5u,
			     "block %u sees garbage, not the previous block's data", b);
		cr_assert_eq(mis[b], 0u, "16-byte aligned");
	}
}

namespace {

/* Each thread reads its left neighbour's value without a barrier. */
__global__ void shift_racy(const int *in, int *out)
{
	__shared__ int s[1024];
	const unsigned t = threadIdx.x;
	s[t] = in[t];
	out[t] = t > 0 ? s[t - 1] : 0;
}

/* The threads whose read of the left neighbour missed its store; `salt` makes
 * this launch's values differ from the stale shared data of an earlier one. */
std::vector<unsigned> run_shift(int salt)
{
	const unsigned n = 256;
	std::vector<int> in(n), out(n, -1);
	for (unsigned i = 0; i < n; i++)
		in[i] = salt * 10000 + (int)i;
	KVR_LAUNCH(shift_racy, 1, n, 0, nullptr, in.data(), out.data());
	cr_assert_eq(cudaGetLastError(), cudaSuccess);
	std::vector<unsigned> missed;
	for (unsigned i = 1; i < n; i++)
		if (out[i] != in[i - 1])
			missed.push_back(i);
	return missed;
}

} /* namespace */

Test(cudaemu, order_seeds_expose_races)
{
	/* The reduction without its inner barrier is wrong under some order. */
	kvr_emu_set_order_seed(0);
	(void)run_block_sum<true>(dim3(256), dim3(2), 3); /* natural order: right or wrong */
	unsigned wrong = 0;
	for (uint64_t seed = 1; seed <= 4; seed++) {
		kvr_emu_set_order_seed(seed);
		wrong += !run_block_sum<true>(dim3(256), dim3(2), 3 + (int)seed);
	}
	cr_assert_gt(wrong, 0u, "a missing __syncthreads goes unnoticed under every seed");

	/* A read of a neighbour's store: right in natural order, wrong when
	 * shuffled, and one seed always gives the same interleaving. */
	kvr_emu_set_order_seed(0);
	cr_assert(run_shift(1).empty(), "natural order runs thread t-1 before thread t");
	kvr_emu_set_order_seed(42);
	const std::vector<unsigned> missed = run_shift(2);
	cr_assert(!missed.empty(), "a shuffled order exposes the race");
	cr_assert(run_shift(3) == missed, "the same seed gives the same interleaving");
}

namespace {

__global__ void tickets_kernel(unsigned *counter, unsigned *tickets)
{
	tickets[threadIdx.x] = atomicAdd(counter, 1u);
}

std::vector<unsigned> run_order(uint64_t seed)
{
	kvr_emu_set_order_seed(seed);
	unsigned counter = 0;
	std::vector<unsigned> tickets(128);
	KVR_LAUNCH(tickets_kernel, 1, 128, 0, nullptr, &counter, tickets.data());
	cr_assert_eq(cudaGetLastError(), cudaSuccess);
	return tickets;
}

} /* namespace */

Test(cudaemu, order_seed_zero_is_natural_order)
{
	std::vector<unsigned> natural = run_order(0), s1 = run_order(1), s1_again = run_order(1),
			      s2 = run_order(2);
	for (unsigned i = 0; i < natural.size(); i++)
		cr_assert_eq(natural[i], i);
	cr_assert(s1 != natural && s2 != natural && s1 != s2);
	cr_assert(s1 == s1_again);
	std::sort(s1.begin(), s1.end());
	cr_assert(s1 == natural, "a permutation");
}

namespace {

__global__ void divergent_barrier(int *out)
{
	if (threadIdx.x < 16)
		__syncthreads();
	out[threadIdx.x] = 1;
}

__global__ void barrier_against_warp_op(int *out)
{
	if (threadIdx.x < 16)
		__syncthreads();
	else
		__syncwarp();
	out[threadIdx.x] = 1;
}

__global__ void mismatched_warp_ops(int *out)
{
	if (threadIdx.x % 2)
		out[threadIdx.x] = __shfl_xor_sync(full, 1, 1);
	else
		out[threadIdx.x] = (int)__ballot_sync(full, 1);
}

__global__ void exited_lane(int *out)
{
	if (threadIdx.x == 5)
		return;
	out[threadIdx.x] = __shfl_xor_sync(full, (int)threadIdx.x, 1);
}

__global__ void partial_mask(int *out)
{
	out[threadIdx.x] = __shfl_sync(0x0000ffffu, (int)threadIdx.x, 0);
}

__global__ void bad_width(int *out)
{
	out[threadIdx.x] = __shfl_down_sync(full, (int)threadIdx.x, 1, 12);
}

/* Fails in block 1 only: later blocks must not run. */
__global__ void fails_in_block_one(int *ran)
{
	if (threadIdx.x == 0)
		ran[blockIdx.x] = 1;
	if (blockIdx.x == 1 && threadIdx.x < 3)
		return;
	__syncthreads();
}

__global__ void child(int *out)
{
	*out = 1;
}

__global__ void launches_a_kernel(int *out)
{
	KVR_LAUNCH(child, 1, 1, 0, nullptr, out);
}

} /* namespace */

Test(cudaemu, stalls_and_warp_misuse_fail_the_launch)
{
	for (uint64_t seed : { 0ull, 13ull }) {
		kvr_emu_set_order_seed(seed);
		std::vector<int> out(64, 0);
		KVR_LAUNCH(divergent_barrier, 1, 64, 0, nullptr, out.data());
		expect_launch_error(cudaErrorLaunchFailure, "__syncthreads");
		cr_assert(run_block_sum<false>(dim3(64), dim3(2), 5), "a later launch works: %s",
			  kvr_emu_last_launch_message());

		KVR_LAUNCH(barrier_against_warp_op, 1, 32, 0, nullptr, out.data());
		expect_launch_error(cudaErrorLaunchFailure, "waits in __syncwarp");
		KVR_LAUNCH(mismatched_warp_ops, 1, 64, 0, nullptr, out.data());
		expect_launch_error(cudaErrorLaunchFailure, "other lanes of its warp wait in");
		KVR_LAUNCH(exited_lane, 1, 64, 0, nullptr, out.data());
		expect_launch_error(cudaErrorLaunchFailure, "has exited");
		KVR_LAUNCH(partial_mask, 1, 32, 0, nullptr, out.data());
		expect_launch_error(cudaErrorLaunchFailure, "full mask");
		KVR_LAUNCH(bad_width, 1, 32, 0, nullptr, out.data());
		expect_launch_error(cudaErrorLaunchFailure, "width 12");

		std::vector<int> ran(4, 0);
		KVR_LAUNCH(fails_in_block_one, 4, 32, 0, nullptr, ran.data());
		expect_launch_error(cudaErrorLaunchFailure, "block (1,0,0)");
		cr_assert(ran[0] == 1 && ran[1] == 1 && ran[2] == 0 && ran[3] == 0,
			  "a failed block ends the launch");

		int flag = 0;
		KVR_LAUNCH(launches_a_kernel, 1, 2, 0, nullptr, &flag);
		expect_launch_error(cudaErrorLaunchFailure, "cannot launch kernels");
		cr_assert_eq(flag, 0);

		cr_assert(run_block_sum<false>(dim3(1024), dim3(2), 6), "a later launch works: %s",
			  kvr_emu_last_launch_message());
	}
}

namespace {

__device__ __attribute__((noinline)) int sum_of(const int *a, unsigned n)
{
	int s = 0;
	for (unsigned i = 0; i < n; i++)
		s += a[i];
	return s;
}

/* Stalls with a local array live in every suspended thread's frame. */
__global__ void stall_with_locals(int *out)
{
	int big[64];
	for (unsigned i = 0; i < 64; i++)
		big[i] = (int)(i + threadIdx.x);
	if (threadIdx.x < 16)
		__syncthreads();
	out[threadIdx.x] = sum_of(big, 64);
}

/* A larger frame over the same stack bytes, live across a barrier. */
__global__ void wide_locals(int *out)
{
	int wide[256];
	for (unsigned i = 0; i < 256; i++)
		wide[i] = (int)(i % 4);
	__syncthreads();
	out[threadIdx.x] = sum_of(wide, 256) + (int)threadIdx.x;
}

} /* namespace */

/* A failed launch abandons suspended frames; the next launch on the same
 * stacks must not trip over them (under ASan: their stale redzones). */
Test(cudaemu, launch_after_a_stall_reuses_clean_stacks)
{
	std::vector<int> out(64, 0);
	KVR_LAUNCH(stall_with_locals, 1, 64, 0, nullptr, out.data());
	expect_launch_error(cudaErrorLaunchFailure, "__syncthreads");
	KVR_LAUNCH(wide_locals, 1, 64, 0, nullptr, out.data());
	expect_launch_ok("wide_locals");
	for (unsigned t = 0; t < 64; t++)
		cr_assert_eq(out[t], 384 + (int)t, "thread %u", t);
}

namespace {

__global__ void set_flag(int *flag)
{
	*flag = 1;
}

__global__ void fill_dynamic_shared(unsigned *out)
{
	KVR_DYNAMIC_SHARED(unsigned char, bytes);
	const unsigned n = 228 * 1024;
	for (unsigned i = threadIdx.x; i < n; i += blockDim.x)
		bytes[i] = (unsigned char)i;
	__syncthreads();
	if (threadIdx.x == 0)
		*out = bytes[n - 1];
}

/* Parameters are converted once on the host; each thread modifies its own. */
__global__ void own_parameters(int *out, int base)
{
	base += (int)threadIdx.x;
	out[threadIdx.x] = base;
}

unsigned long long no_parameter_runs;

__global__ void no_parameters()
{
	atomicAdd(&no_parameter_runs, 1ull);
}

} /* namespace */

Test(cudaemu, launch_configuration_and_arguments)
{
	int flag = 0;
	const struct {
		dim3 grid, block;
		size_t smem;
	} bad[] = {
		{ dim3(1), dim3(1025), 0 },
		{ dim3(1), dim3(32, 32, 2), 0 },
		{ dim3(1), dim3(1, 1, 65), 0 },
		{ dim3(1), dim3(0, 1, 1), 0 },
		{ dim3(0), dim3(32), 0 },
		{ dim3(1, 65536), dim3(32), 0 },
		{ dim3(1), dim3(32), 228 * 1024 + 1 },
	};
	for (const auto &c : bad) {
		KVR_LAUNCH(set_flag, c.grid, c.block, c.smem, nullptr, &flag);
		expect_launch_error(cudaErrorInvalidConfiguration, "invalid");
		cr_assert_eq(flag, 0, "an invalid launch runs nothing");
	}
	cr_assert_str_eq(cudaGetErrorName(cudaErrorInvalidConfiguration),
			 "cudaErrorInvalidConfiguration");
	cr_assert_str_eq(cudaGetErrorString(cudaErrorLaunchFailure), "unspecified launch failure");
	cr_assert_str_eq(cudaGetErrorString(cudaSuccess), "no error");

	unsigned last = 0;
	KVR_LAUNCH(fill_dynamic_shared, 1, 256, 228 * 1024, nullptr, &last);
	expect_launch_ok("228 KiB of dynamic shared memory");
	cr_assert_eq(last, (228u * 1024 - 1) & 0xff);

	int calls = 0;
	std::vector<int> out(8, -1);
	KVR_LAUNCH(own_parameters, 1u, dim3(8), 0, nullptr, out.data(), 100 + calls++);
	expect_launch_ok("own_parameters");
	cr_assert_eq(calls, 1, "arguments are evaluated once");
	for (int t = 0; t < 8; t++)
		cr_assert_eq(out[t], 100 + t);

	KVR_LAUNCH(no_parameters, dim3(2, 2), dim3(4, 2), 0, nullptr);
	expect_launch_ok("no_parameters");
	cr_assert_eq(no_parameter_runs, 32ull);
}

Test(cudaemu, concurrent_launches)
{
	struct report {
		unsigned good = 0, bad = 0;
		bool errors_isolated = true;
	};
	std::vector<report> reports(4);
	std::vector<std::thread> threads;
	for (unsigned i = 0; i < 4; i++)
		threads.emplace_back([i, &reports] {
			report &r = reports[i];
			/* Thread 0 runs in natural order, the others shuffled. */
			kvr_emu_set_order_seed(i);
			const dim3 blocks[] = { dim3(64), dim3(100), dim3(8, 8, 4), dim3(512) };
			for (unsigned k = 0; k < 12; k++) {
				if (i == 3 && k % 4 == 0) {
					/* Its error must not leak into other threads. */
					std::vector<int> out(64);
					KVR_LAUNCH(divergent_barrier, 1, 64, 0, nullptr,
						   out.data());
					r.errors_isolated &=
						cudaGetLastError() == cudaErrorLaunchFailure;
				}
				if (run_block_sum<false>(blocks[k % 4], dim3(1 + k % 3),
							 (int)(i * 100 + k)))
					r.good++;
				else
					r.bad++;
				r.errors_isolated &= cudaGetLastError() == cudaSuccess;
			}
		});
	for (std::thread &t : threads)
		t.join();
	for (unsigned i = 0; i < 4; i++) {
		cr_assert_eq(reports[i].good, 12u, "thread %u: %u wrong sums", i, reports[i].bad);
		cr_assert(reports[i].errors_isolated, "thread %u saw another thread's error", i);
	}
}
