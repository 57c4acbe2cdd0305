#include "simt.h"

#include <ucontext.h>

#include <memory>
#include <string>
#include <vector>

namespace simt {
namespace {

constexpr size_t kStackBytes = 128 * 1024;  // per fiber; kernels keep a few hundred bytes of locals

enum class State { runnable, at_block_barrier, at_warp_barrier, done };

struct Fiber {
  ucontext_t context{};
  std::unique_ptr<char[]> stack;
  State state = State::done;
  Builtins builtins{};
};

// The block that is running: its fibers, barriers and shuffle slots.
struct Block {
  ucontext_t scheduler{};
  std::vector<Fiber> fibers;  // kept between launches (their stacks are reused)
  int threads = 0;
  int running = -1;
  const std::function<void()>* body = nullptr;
  int block_arrived = 0, exited = 0;
  std::vector<int> warp_arrived, warp_exited;
  std::vector<uint64_t> slots;  // one per thread, for shuffles
  std::string error;
};

Block g_block;
Schedule g_schedule = Schedule::forward;
int64_t g_launches = 0;

Fiber& self() { return g_block.fibers[static_cast<size_t>(g_block.running)]; }
int warp_of(int thread) { return thread / 32; }
int lanes_in_warp(int warp) { return std::min(32, g_block.threads - warp * 32); }

// Back to the scheduler; returns when the fiber is made runnable again.
void suspend(State state) {
  Fiber& f = self();
  f.state = state;
  swapcontext(&f.context, &g_block.scheduler);
}

// Stops the launch: the scheduler throws `what` once this fiber is switched out; the fiber never resumes.
[[noreturn]] void fail(const std::string& what) {
  if (g_block.error.empty()) {
    const Builtins& b = self().builtins;
    g_block.error = "block " + std::to_string(b.block_idx.x) + " thread " + std::to_string(b.thread_idx.x) + ": " + what;
  }
  Fiber& f = self();
  f.state = State::done;
  setcontext(&g_block.scheduler);
  std::abort();  // not reached
}

void release(State waiting, int warp) {
  for (int t = 0; t < g_block.threads; ++t) {
    Fiber& f = g_block.fibers[static_cast<size_t>(t)];
    if (f.state == waiting && (warp < 0 || warp_of(t) == warp)) f.state = State::runnable;
  }
}

void sync_warp() {
  const int warp = warp_of(g_block.running);
  if (g_block.warp_exited[static_cast<size_t>(warp)] > 0) fail("a full-mask warp operation after a lane of the warp exited");
  if (++g_block.warp_arrived[static_cast<size_t>(warp)] == lanes_in_warp(warp)) {
    g_block.warp_arrived[static_cast<size_t>(warp)] = 0;
    release(State::at_warp_barrier, warp);
    return;
  }
  suspend(State::at_warp_barrier);
}

void fiber_main() {
  // An exception cannot unwind past the fiber's first frame: it becomes the launch's error.
  try {
    (*g_block.body)();
  } catch (const std::exception& e) {
    fail(e.what());
  }
  // CUDA requires every thread of the block at each __syncthreads() and every lane at a full-mask
  // shuffle: exiting while others wait there is a divergent barrier.
  const int warp = warp_of(g_block.running);
  if (g_block.block_arrived > 0) fail("exited while other threads wait at __syncthreads() (a divergent barrier)");
  if (g_block.warp_arrived[static_cast<size_t>(warp)] > 0) fail("exited while other lanes wait at a warp shuffle");
  ++g_block.exited;
  ++g_block.warp_exited[static_cast<size_t>(warp)];
  self().state = State::done;
  // Returning switches to uc_link, the scheduler.
}

void run_block(int block, int blocks, int threads) {
  Block& b = g_block;
  b.threads = threads;
  b.block_arrived = b.exited = 0;
  const int warps = (threads + 31) / 32;
  b.warp_arrived.assign(static_cast<size_t>(warps), 0);
  b.warp_exited.assign(static_cast<size_t>(warps), 0);
  b.slots.assign(static_cast<size_t>(threads), 0);
  if (b.fibers.size() < static_cast<size_t>(threads)) b.fibers.resize(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    Fiber& f = b.fibers[static_cast<size_t>(t)];
    if (!f.stack) f.stack.reset(new char[kStackBytes]);
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.get();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &b.scheduler;
    makecontext(&f.context, fiber_main, 0);
    f.state = State::runnable;
    f.builtins.thread_idx = {static_cast<unsigned>(t), 0, 0};
    f.builtins.block_idx = {static_cast<unsigned>(block), 0, 0};
    f.builtins.block_dim = dim3(static_cast<unsigned>(threads));
    f.builtins.grid_dim = dim3(static_cast<unsigned>(blocks));
  }
  for (;;) {
    bool ran = false, all_done = true;
    for (int i = 0; i < threads; ++i) {
      const int t = g_schedule == Schedule::forward ? i : threads - 1 - i;
      Fiber& f = b.fibers[static_cast<size_t>(t)];
      if (f.state == State::runnable) {
        b.running = t;
        swapcontext(&b.scheduler, &f.context);
        b.running = -1;
        ran = true;
        if (!b.error.empty()) throw Error(b.error);
      }
      all_done = all_done && f.state == State::done;
    }
    if (all_done) return;
    if (!ran) throw Error("block " + std::to_string(block) + ": every live thread waits at a barrier (deadlock)");
  }
}

}  // namespace

void set_schedule(Schedule schedule) { g_schedule = schedule; }

const Builtins& builtins() {
  if (g_block.running < 0) throw Error("a CUDA builtin read outside a kernel");
  return self().builtins;
}

void sync_block() {
  if (g_block.exited > 0) fail("__syncthreads() after a thread of the block exited (a divergent barrier)");
  if (++g_block.block_arrived == g_block.threads) {
    g_block.block_arrived = 0;
    release(State::at_block_barrier, -1);
    return;
  }
  suspend(State::at_block_barrier);
}

uint64_t exchange_in_warp(uint64_t value, unsigned lane) {
  const int thread = g_block.running;
  const int first = warp_of(thread) * 32;
  if (static_cast<int>(lane) >= lanes_in_warp(warp_of(thread))) fail("shuffle from a lane the warp does not have");
  g_block.slots[static_cast<size_t>(thread)] = value;
  sync_warp();  // every lane has written its value
  const uint64_t got = g_block.slots[static_cast<size_t>(first) + lane];
  sync_warp();  // every lane has read before any slot is written again
  return got;
}

void run(int blocks, int threads, const std::function<void()>& body) {
  if (blocks < 0 || threads < 1 || threads > 1024)
    throw Error("launch of " + std::to_string(blocks) + " blocks of " + std::to_string(threads) + " threads");
  if (g_block.running >= 0) throw Error("a launch from inside a kernel");
  ++g_launches;
  g_block.body = &body;
  g_block.error.clear();
  for (int i = 0; i < blocks; ++i) run_block(g_schedule == Schedule::forward ? i : blocks - 1 - i, blocks, threads);
}

int64_t launches() { return g_launches; }

}  // namespace simt
