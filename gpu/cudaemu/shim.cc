/* SPDX-License-Identifier: MIT */
/*
 * shim.cc — the cudaemu runtime behind gpu/cudaemu/shim.h: runs a KVR_LAUNCH
 * on the OS thread that calls it, synchronously, and owns that thread's
 * emulation state (one `scheduler`, thread_local; nothing here is shared
 * between OS threads, so launches from several threads run independently).
 *
 * A launch runs the blocks of its grid one after another. Inside a block every
 * CUDA thread is a fiber (ucontext) with a private stack; fiber stacks are
 * mapped once per OS thread and reused by every later block and launch. The
 * scheduler, on the launching thread's own stack, resumes the runnable fibers
 * one at a time in a shuffled order (kvr_emu_set_order_seed); each runs until
 * it reaches __syncthreads, a warp operation, or returns, and switches back.
 * When a round leaves nothing runnable, either the whole block waits at
 * __syncthreads (release it: the next phase gets a new order), every thread
 * has returned (next block), or the block can never finish: the launch fails
 * with cudaErrorLaunchFailure and a message, and its suspended fibers are
 * abandoned (their stacks are simply re-made by the next block).
 *
 * Warp operations exchange 32-bit values through a per-warp slot array: each
 * lane writes its slot and waits; the last lane of the warp to arrive releases
 * the others, and each then reads what it needs. The slots are double-buffered
 * by the parity of the lane's warp-operation count: a lane can write the next
 * operation's bank before slower lanes have read this one, but cannot get two
 * operations ahead, because the next one waits for every lane.
 *
 * Under ThreadSanitizer each fiber is a TSan fiber (made afresh with each
 * block, since an abandoned or finished fiber never pops its frames), and
 * every switch is announced, so TSan keeps one shadow stack per fiber and
 * orders a fiber's work after the scheduler's switch into it.
 */
#include "shim.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <memory>
#include <new>

#ifdef __SANITIZE_THREAD__
#include <sanitizer/tsan_interface.h>
#endif
#ifdef __SANITIZE_ADDRESS__
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

namespace kvr_emu {

namespace {

constexpr unsigned max_block_threads = 1024;
constexpr unsigned warp_lanes = 32;
constexpr unsigned max_warps = max_block_threads / warp_lanes;
constexpr unsigned full_mask = 0xffffffffu;
/* An H100 SM has 228 KiB of shared memory (a block may use 227 KiB of it):
 * a launch asking for more fails as it would on any current GPU. */
constexpr size_t max_dynamic_smem = 228 * 1024;
/* Dynamic shared memory is not initialised on a GPU: a kernel that reads it
 * before writing must see garbage, not zeros or the previous block's data. */
constexpr unsigned char smem_garbage = 0xA5;
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
/* ASan's redzones and TSan's instrumentation make kernel frames several
 * times larger. */
constexpr size_t fiber_stack_bytes = 256 * 1024;
#else
constexpr size_t fiber_stack_bytes = 64 * 1024;
#endif

enum class fiber_state : uint8_t { runnable, at_syncthreads, at_warp_op, exited };

enum class warp_op : uint8_t { syncwarp, shfl_idx, shfl_up, shfl_down, shfl_xor, ballot, any, all };

const char *warp_op_name(warp_op op)
{
	switch (op) {
	case warp_op::syncwarp:
		return "__syncwarp";
	case warp_op::shfl_idx:
		return "__shfl_sync";
	case warp_op::shfl_up:
		return "__shfl_up_sync";
	case warp_op::shfl_down:
		return "__shfl_down_sync";
	case warp_op::shfl_xor:
		return "__shfl_xor_sync";
	case warp_op::ballot:
		return "__ballot_sync";
	case warp_op::any:
		return "__any_sync";
	case warp_op::all:
		return "__all_sync";
	}
	return "a warp operation";
}

struct fiber {
	ucontext_t ctx;
	char *stack; /* lowest usable byte; a PROT_NONE guard page lies below it */
	uint3 thread_idx;
	fiber_state state;
	unsigned warp_ops; /* warp operations done in this block; parity = slot bank */
#ifdef __SANITIZE_THREAD__
	void *tsan_fiber; /* this block's TSan fiber, or NULL */
#endif
#ifdef __SANITIZE_ADDRESS__
	void *asan_fake_stack;
	/* Frames abandoned by a failed launch left ASan redzones on the stack. */
	bool stack_dirty;
#endif
};

struct warp_state {
	uint32_t slots[2][warp_lanes];
	unsigned active;  /* lanes that exist: fewer in a partial last warp */
	unsigned arrived; /* lanes waiting in the current operation */
	warp_op op;	  /* the current operation, set by its first lane */
};

struct warp_view {
	const uint32_t *slots; /* the operation's bank, one value per lane */
	unsigned lane;
	unsigned active;
};

size_t page_bytes()
{
	static const size_t page = (size_t)sysconf(_SC_PAGESIZE);
	return page;
}

class scheduler {
public:
	scheduler() = default;
	scheduler(const scheduler &) = delete;
	scheduler &operator=(const scheduler &) = delete;
	~scheduler()
	{
		for (unsigned i = 0; i < n_stacks_; i++) {
#ifdef __SANITIZE_THREAD__
			if (fibers_[i].tsan_fiber)
				__tsan_destroy_fiber(fibers_[i].tsan_fiber);
#endif
			munmap(fibers_[i].stack - page_bytes(), fiber_stack_bytes + page_bytes());
		}
	}

	void run_launch(const char *name, dim3 grid, dim3 block, size_t smem,
			void (*body)(const void *), const void *closure);
	void syncthreads();
	warp_view warp_collective(warp_op op, unsigned mask, uint32_t value);
	[[noreturn]] void kernel_error(const char *fmt, ...) __attribute__((format(printf, 2, 3)));

	uint64_t seed = 0;
	cudaError_t last_error = cudaSuccess;
	char last_message[512] = "";

private:
	static void fiber_main();
	bool validate(dim3 grid, dim3 block, size_t smem);
	int map_stacks(unsigned n);
	void run_block(unsigned n);
	void make_fiber(fiber &f);
	void resume(fiber &f);
	void switch_to_scheduler(bool last);
	void shuffle(unsigned n);
	void report_stall(unsigned n);
	fiber &current_fiber(const char *what);
	void fail(cudaError_t err, bool in_block, const char *fmt, ...)
		__attribute__((format(printf, 4, 5)));

	std::unique_ptr<fiber[]> fibers_;
	unsigned n_stacks_ = 0; /* fibers whose stack is mapped and context initialised */
	warp_state warps_[max_warps];
	unsigned order_[max_block_threads];
	ucontext_t main_ctx_{};
	fiber *current_ = nullptr;
	uint64_t rng_ = 0;

	/* The launch in progress. */
	const char *name_ = nullptr;
	dim3 grid_, block_;
	size_t smem_ = 0;
	block_builtins builtins_{};
	void (*body_)(const void *) = nullptr;
	const void *closure_ = nullptr;
	unsigned n_at_sync_ = 0, n_exited_ = 0;
	bool failed_ = false;

#ifdef __SANITIZE_THREAD__
	void *tsan_main_ = nullptr; /* the launching thread's TSan fiber */
#endif
#ifdef __SANITIZE_ADDRESS__
	void *main_fake_stack_ = nullptr;
	const void *main_stack_bottom_ = nullptr;
	size_t main_stack_size_ = 0;
#endif
};

thread_local scheduler tls_sched;

/* Records a failed launch: the error for cudaGetLastError() and a message that
 * names the launch (and the block, once blocks run). */
void scheduler::fail(cudaError_t err, bool in_block, const char *fmt, ...)
{
	const size_t size = sizeof(last_message);
	int len = snprintf(last_message, size,
			   "kvr_emu: %s<<<(%u,%u,%u), (%u,%u,%u), %zu>>>: ", name_, grid_.x,
			   grid_.y, grid_.z, block_.x, block_.y, block_.z, smem_);
	if (in_block && len >= 0 && (size_t)len < size)
		len += snprintf(last_message + len, size - (size_t)len,
				"block (%u,%u,%u): ", builtins_.block_idx.x, builtins_.block_idx.y,
				builtins_.block_idx.z);
	if (len >= 0 && (size_t)len < size) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(last_message + len, size - (size_t)len, fmt, ap);
		va_end(ap);
	}
	last_error = err;
	failed_ = true;
}

bool scheduler::validate(dim3 grid, dim3 block, size_t smem)
{
	const uint64_t threads = (uint64_t)block.x * block.y * block.z;
	if (block.x == 0 || block.y == 0 || block.z == 0 || block.x > 1024 || block.y > 1024 ||
	    block.z > 64 || threads > max_block_threads) {
		fail(cudaErrorInvalidConfiguration, false,
		     "invalid block: every dimension >= 1, x and y <= 1024, z <= 64, "
		     "at most %u threads",
		     max_block_threads);
		return false;
	}
	if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
	    grid.z > 65535) {
		fail(cudaErrorInvalidConfiguration, false,
		     "invalid grid: every dimension >= 1, x < 2^31, y and z <= 65535");
		return false;
	}
	if (smem > max_dynamic_smem) {
		fail(cudaErrorInvalidConfiguration, false,
		     "invalid dynamic shared memory: %zu bytes, more than the %zu a block may have",
		     smem, max_dynamic_smem);
		return false;
	}
	return true;
}

/* Maps stacks for the first n fibers; returns 0 or an errno. */
int scheduler::map_stacks(unsigned n)
{
	if (!fibers_) {
		fibers_.reset(new (std::nothrow) fiber[max_block_threads]());
		if (!fibers_)
			return ENOMEM;
	}
	const size_t page = page_bytes();
	while (n_stacks_ < n) {
		/* A guard page below each stack turns an overflow into a fault
		 * instead of silently corrupting the neighbouring fiber's stack. */
		void *m = mmap(nullptr, fiber_stack_bytes + page, PROT_READ | PROT_WRITE,
			       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
		if (m == MAP_FAILED)
			return errno;
		if (mprotect(m, page, PROT_NONE) != 0) {
			const int err = errno;
			munmap(m, fiber_stack_bytes + page);
			return err;
		}
		fiber &f = fibers_[n_stacks_];
		f.stack = static_cast<char *>(m) + page;
		/* Only once: later blocks re-make the context that the fiber's
		 * last swapcontext saved, which is as valid a base as getcontext's. */
		if (getcontext(&f.ctx) != 0) {
			const int err = errno;
			munmap(m, fiber_stack_bytes + page);
			return err;
		}
		n_stacks_++;
	}
	return 0;
}

void scheduler::run_launch(const char *name, dim3 grid, dim3 block, size_t smem,
			   void (*body)(const void *), const void *closure)
{
	if (current_)
		kernel_error("launches %s: kernels cannot launch kernels (no dynamic parallelism)",
			     name);
	name_ = name;
	grid_ = grid;
	block_ = block;
	smem_ = smem;
	failed_ = false;
	if (!validate(grid, block, smem))
		return;
	const unsigned n = block.x * block.y * block.z;
	const int err = map_stacks(n);
	if (err != 0) {
		fail(cudaErrorLaunchFailure, false, "cannot map fiber stacks: %s", strerror(err));
		return;
	}
	/* Sized exactly, so ASan reports a kernel that overruns its buffer. */
	void *dynamic = ::operator new(smem, std::align_val_t(16), std::nothrow);
	if (!dynamic) {
		fail(cudaErrorLaunchFailure, false,
		     "cannot allocate %zu bytes of dynamic shared memory", smem);
		return;
	}
	for (unsigned i = 0; i < n; i++)
		fibers_[i].thread_idx =
			uint3{ i % block.x, i / block.x % block.y, i / (block.x * block.y) };
	builtins_ = block_builtins{ uint3{ 0, 0, 0 }, block, grid, dynamic };
	body_ = body;
	closure_ = closure;
	rng_ = seed;
	tls_block = &builtins_;
	for (unsigned z = 0; z < grid.z && !failed_; z++)
		for (unsigned y = 0; y < grid.y && !failed_; y++)
			for (unsigned x = 0; x < grid.x && !failed_; x++) {
				builtins_.block_idx = uint3{ x, y, z };
				memset(dynamic, smem_garbage, smem);
				run_block(n);
			}
	tls_block = nullptr;
	::operator delete(dynamic, std::align_val_t(16));
}

void scheduler::make_fiber(fiber &f)
{
	f.state = fiber_state::runnable;
	f.warp_ops = 0;
#ifdef __SANITIZE_THREAD__
	if (f.tsan_fiber)
		__tsan_destroy_fiber(f.tsan_fiber);
	f.tsan_fiber = __tsan_create_fiber(0);
#endif
#ifdef __SANITIZE_ADDRESS__
	if (f.stack_dirty) {
		__asan_unpoison_memory_region(f.stack, fiber_stack_bytes);
		f.stack_dirty = false;
	}
#endif
	f.ctx.uc_link = nullptr; /* fiber_main never returns */
	f.ctx.uc_stack.ss_sp = f.stack;
	f.ctx.uc_stack.ss_size = fiber_stack_bytes;
	makecontext(&f.ctx, fiber_main, 0);
#ifdef __SANITIZE_ADDRESS__
	/* ASan's swapcontext interceptor unpoisons the whole stack named in the
	 * target context on every switch, which would erase the redzones of the
	 * frames a fiber keeps across barriers. makecontext has read the stack;
	 * hiding it from the interceptor keeps those redzones. */
	f.ctx.uc_stack.ss_sp = nullptr;
	f.ctx.uc_stack.ss_size = 0;
#endif
}

void scheduler::fiber_main()
{
	scheduler &s = tls_sched;
#ifdef __SANITIZE_ADDRESS__
	__sanitizer_finish_switch_fiber(nullptr, &s.main_stack_bottom_, &s.main_stack_size_);
#endif
	s.body_(s.closure_);
	s.current_->state = fiber_state::exited;
	s.n_exited_++;
	/* Never resumed: the next block re-makes this context. */
	s.switch_to_scheduler(true);
}

void scheduler::resume(fiber &f)
{
	current_ = &f;
	tls_thread_idx = &f.thread_idx;
#ifdef __SANITIZE_THREAD__
	tsan_main_ = __tsan_get_current_fiber();
	__tsan_switch_to_fiber(f.tsan_fiber, 0);
#endif
#ifdef __SANITIZE_ADDRESS__
	__sanitizer_start_switch_fiber(&main_fake_stack_, f.stack, fiber_stack_bytes);
#endif
	/* swapcontext fails only on an invalid signal mask, which it cannot get. */
	swapcontext(&main_ctx_, &f.ctx);
#ifdef __SANITIZE_ADDRESS__
	__sanitizer_finish_switch_fiber(main_fake_stack_, nullptr, nullptr);
#endif
	current_ = nullptr;
	tls_thread_idx = nullptr;
}

/* From a fiber back to the scheduler. `last`: the fiber will not be resumed,
 * so ASan may free its fake stack. */
void scheduler::switch_to_scheduler(bool last)
{
	fiber &f = *current_;
#ifdef __SANITIZE_ADDRESS__
	__sanitizer_start_switch_fiber(last ? nullptr : &f.asan_fake_stack, main_stack_bottom_,
				       main_stack_size_);
#else
	(void)last;
#endif
#ifdef __SANITIZE_THREAD__
	__tsan_switch_to_fiber(tsan_main_, 0);
#endif
	swapcontext(&f.ctx, &main_ctx_);
#ifdef __SANITIZE_ADDRESS__
	__sanitizer_finish_switch_fiber(f.asan_fake_stack, &main_stack_bottom_, &main_stack_size_);
#endif
}

/* splitmix64: a fixed, well-mixed sequence per seed. */
void scheduler::shuffle(unsigned n)
{
	if (seed == 0)
		return;
	for (unsigned i = n - 1; i > 0; i--) {
		uint64_t z = (rng_ += 0x9e3779b97f4a7c15ull);
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
		z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
		z ^= z >> 31;
		const unsigned j = (unsigned)(((z >> 32) * (uint64_t)(i + 1)) >> 32);
		const unsigned t = order_[i];
		order_[i] = order_[j];
		order_[j] = t;
	}
}

/* Runs one block to completion or failure (failed_). */
void scheduler::run_block(unsigned n)
{
	for (unsigned i = 0; i < n; i++)
		make_fiber(fibers_[i]);
	for (unsigned w = 0; w * warp_lanes < n; w++) {
		warps_[w].active =
			n - w * warp_lanes < warp_lanes ? n - w * warp_lanes : warp_lanes;
		warps_[w].arrived = 0;
	}
	n_at_sync_ = 0;
	n_exited_ = 0;
	for (;;) {
		unsigned n_order = 0;
		for (unsigned i = 0; i < n; i++)
			if (fibers_[i].state == fiber_state::runnable)
				order_[n_order++] = i;
		if (n_order == 0) {
			if (n_exited_ == n)
				return;
			if (n_at_sync_ == n) {
				for (unsigned i = 0; i < n; i++)
					fibers_[i].state = fiber_state::runnable;
				n_at_sync_ = 0;
				continue;
			}
			report_stall(n);
			break;
		}
		shuffle(n_order);
		for (unsigned k = 0; k < n_order && !failed_; k++)
			resume(fibers_[order_[k]]);
		if (failed_)
			break;
	}
#ifdef __SANITIZE_ADDRESS__
	for (unsigned i = 0; i < n; i++)
		if (fibers_[i].state != fiber_state::exited)
			fibers_[i].stack_dirty = true;
#endif
}

/* Nothing can run and the block has not finished: say why. */
void scheduler::report_stall(unsigned n)
{
	for (unsigned i = 0; i < n; i++) {
		const fiber &f = fibers_[i];
		if (f.state != fiber_state::at_warp_op)
			continue;
		const unsigned w = i / warp_lanes;
		for (unsigned l = 0; l < warps_[w].active; l++) {
			const fiber &g = fibers_[w * warp_lanes + l];
			if (g.state == fiber_state::at_warp_op)
				continue;
			fail(cudaErrorLaunchFailure, true,
			     "thread (%u,%u,%u) waits in %s, "
			     "but lane %u of its warp, thread (%u,%u,%u), %s",
			     f.thread_idx.x, f.thread_idx.y, f.thread_idx.z,
			     warp_op_name(warps_[w].op), l, g.thread_idx.x, g.thread_idx.y,
			     g.thread_idx.z,
			     g.state == fiber_state::exited ? "has exited"
							    : "waits at __syncthreads()");
			return;
		}
	}
	unsigned first_exited = 0;
	while (fibers_[first_exited].state != fiber_state::exited)
		first_exited++;
	const uint3 t = fibers_[first_exited].thread_idx;
	fail(cudaErrorLaunchFailure, true,
	     "%u threads wait at __syncthreads(), but %u exited without reaching it (the first: "
	     "thread (%u,%u,%u)); every thread of the block must reach each __syncthreads()",
	     n_at_sync_, n_exited_, t.x, t.y, t.z);
}

fiber &scheduler::current_fiber(const char *what)
{
	if (!current_) {
		fprintf(stderr, "kvr_emu: %s called outside a kernel launched by KVR_LAUNCH\n",
			what);
		abort();
	}
	return *current_;
}

void scheduler::kernel_error(const char *fmt, ...)
{
	fiber &f = current_fiber("a device function");
	char what[320];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(what, sizeof(what), fmt, ap);
	va_end(ap);
	fail(cudaErrorLaunchFailure, true, "thread (%u,%u,%u) %s", f.thread_idx.x, f.thread_idx.y,
	     f.thread_idx.z, what);
	switch_to_scheduler(true);
	/* The scheduler never resumes a fiber of a failed launch. */
	abort();
}

void scheduler::syncthreads()
{
	fiber &f = current_fiber("__syncthreads");
	f.state = fiber_state::at_syncthreads;
	n_at_sync_++;
	switch_to_scheduler(false);
}

warp_view scheduler::warp_collective(warp_op op, unsigned mask, uint32_t value)
{
	fiber &f = current_fiber(warp_op_name(op));
	if (mask != full_mask)
		kernel_error(
			"calls %s with mask 0x%08x; cudaemu supports only the full mask 0xffffffff",
			warp_op_name(op), mask);
	const unsigned linear = (unsigned)(&f - fibers_.get());
	const unsigned lane = linear % warp_lanes;
	warp_state &w = warps_[linear / warp_lanes];
	if (w.arrived == 0)
		w.op = op;
	else if (w.op != op)
		kernel_error("calls %s while other lanes of its warp wait in %s", warp_op_name(op),
			     warp_op_name(w.op));
	const unsigned bank = f.warp_ops++ & 1;
	w.slots[bank][lane] = value;
	f.state = fiber_state::at_warp_op;
	if (++w.arrived == w.active) {
		for (unsigned l = 0; l < w.active; l++)
			fibers_[linear - lane + l].state = fiber_state::runnable;
		w.arrived = 0;
	}
	switch_to_scheduler(false);
	return warp_view{ w.slots[bank], lane, w.active };
}

} /* namespace */

/* ---- the API of shim.h ---- */

void launch(const char *kernel_name, dim3 grid, dim3 block, size_t smem,
	    void (*body)(const void *closure), const void *closure)
{
	tls_sched.run_launch(kernel_name, grid, block, smem, body, closure);
}

void __syncthreads()
{
	tls_sched.syncthreads();
}

void __syncwarp(unsigned int mask)
{
	tls_sched.warp_collective(warp_op::syncwarp, mask, 0);
}

uint32_t shfl_bits(shfl_mode mode, unsigned int mask, uint32_t value, unsigned int b, int width)
{
	const warp_op op = mode == shfl_mode::idx    ? warp_op::shfl_idx
			   : mode == shfl_mode::up   ? warp_op::shfl_up
			   : mode == shfl_mode::down ? warp_op::shfl_down
						     : warp_op::shfl_xor;
	if (width < 1 || width > (int)warp_lanes || (width & (width - 1)) != 0)
		tls_sched.kernel_error("calls %s with width %d; it must be a power of two up to 32",
				       warp_op_name(op), width);
	const warp_view v = tls_sched.warp_collective(op, mask, value);
	/* PTX shfl.sync: the lane's segment of `width` lanes starts at
	 * lane & segmask; b is taken modulo 32; a source outside the range the
	 * mode allows yields the caller's own value. */
	const int lane = (int)v.lane;
	const int segmask = (int)warp_lanes - width;
	const int bval = (int)(b & (warp_lanes - 1));
	const int seg_first = lane & segmask;
	const int seg_last = seg_first | ((int)(warp_lanes - 1) & ~segmask);
	int src = lane;
	switch (mode) {
	case shfl_mode::idx:
		src = seg_first | (bval & ~segmask);
		break;
	case shfl_mode::up:
		src = lane - bval >= seg_first ? lane - bval : lane;
		break;
	case shfl_mode::down:
		src = lane + bval <= seg_last ? lane + bval : lane;
		break;
	case shfl_mode::bfly:
		/* Later segments are out of range; earlier ones are not. */
		src = (lane ^ bval) <= seg_last ? lane ^ bval : lane;
		break;
	}
	/* A lane past the end of a partial warp does not exist: own value. */
	return (unsigned)src < v.active ? v.slots[src] : value;
}

unsigned int __ballot_sync(unsigned int mask, int predicate)
{
	const warp_view v = tls_sched.warp_collective(warp_op::ballot, mask, predicate != 0);
	unsigned int bits = 0;
	for (unsigned l = 0; l < v.active; l++)
		bits |= (unsigned int)(v.slots[l] != 0u) << l;
	return bits;
}

int __any_sync(unsigned int mask, int predicate)
{
	const warp_view v = tls_sched.warp_collective(warp_op::any, mask, predicate != 0);
	for (unsigned l = 0; l < v.active; l++)
		if (v.slots[l])
			return 1;
	return 0;
}

int __all_sync(unsigned int mask, int predicate)
{
	const warp_view v = tls_sched.warp_collective(warp_op::all, mask, predicate != 0);
	for (unsigned l = 0; l < v.active; l++)
		if (!v.slots[l])
			return 0;
	return 1;
}

cudaError_t cudaGetLastError()
{
	const cudaError_t err = tls_sched.last_error;
	tls_sched.last_error = cudaSuccess;
	return err;
}

const char *cudaGetErrorName(cudaError_t err)
{
	switch (err) {
	case cudaSuccess:
		return "cudaSuccess";
	case cudaErrorInvalidValue:
		return "cudaErrorInvalidValue";
	case cudaErrorInvalidConfiguration:
		return "cudaErrorInvalidConfiguration";
	case cudaErrorLaunchFailure:
		return "cudaErrorLaunchFailure";
	}
	return "cudaErrorUnknown";
}

/* The descriptions are CUDA's own. */
const char *cudaGetErrorString(cudaError_t err)
{
	switch (err) {
	case cudaSuccess:
		return "no error";
	case cudaErrorInvalidValue:
		return "invalid argument";
	case cudaErrorInvalidConfiguration:
		return "invalid configuration argument";
	case cudaErrorLaunchFailure:
		return "unspecified launch failure";
	}
	return "unrecognized error code";
}

} /* namespace kvr_emu */

extern "C" void kvr_emu_set_order_seed(uint64_t seed)
{
	kvr_emu::tls_sched.seed = seed;
}

extern "C" const char *kvr_emu_last_launch_message(void)
{
	return kvr_emu::tls_sched.last_message;
}
