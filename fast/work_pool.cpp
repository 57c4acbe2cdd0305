#include "work_pool.h"

#include <linux/futex.h>
#include <omp.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <stdexcept>

namespace normuon::fast {
namespace {

// How a thread that found no item left waits for the items still running: it spins briefly (a pass of
// small items ends within microseconds), then yields its processor in a loop for a while (it stays
// runnable, so it reaches libgomp's barrier as soon as the pass ends, instead of waiting to be scheduled
// after a wake-up; meanwhile whoever else needs the processor, the preempted holder of the last item
// included, gets it), then sleeps until the last item is done (a long tail: a big matrix).
constexpr auto kSpin = std::chrono::microseconds(20);
constexpr auto kYieldFor = std::chrono::milliseconds(10);

void futex_wait(std::atomic<uint32_t>& word, uint32_t expected) {
  // Returns at once if the word no longer holds `expected`, on a wake, or spuriously: callers re-check.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins, then yields, until done() or both phases have passed; true when done() held.
template <typename Done>
bool wait_briefly(Done done) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 1;; ++i) {
    if (done()) return true;
    cpu_relax();
    if (i % 64 == 0 && std::chrono::steady_clock::now() - start >= kSpin) break;
  }
  while (!done()) {
    if (std::chrono::steady_clock::now() - start >= kSpin + kYieldFor) return done();
    sched_yield();
  }
  return true;
}

// Moves this thread off processor `cpu` to another one it may use, and gives it its affinity back (it
// stays where it was moved until the scheduler moves it). For a worker that starts a pass on the caller's
// processor: woken by the caller, the scheduler often puts it there when every processor is busy, and two
// threads of a pass then share one processor while another runs someone else's work (on 2 vCPUs beside
// one busy process, the contended step was the one-thread step's instead of 0.7x of it).
void leave_processor(int cpu) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || !CPU_ISSET(cpu, &allowed) || CPU_COUNT(&allowed) < 2) return;
  cpu_set_t elsewhere = allowed;
  CPU_CLR(cpu, &elsewhere);
  if (sched_setaffinity(0, sizeof elsewhere, &elsewhere) == 0) sched_setaffinity(0, sizeof allowed, &allowed);
}

thread_local const WorkPool* tl_pool = nullptr;  // the pool whose item this thread is running
thread_local int tl_slot = 0;

}  // namespace

WorkPool::WorkPool(int threads) : threads_(threads < 1 ? 1 : threads) {}

void WorkPool::fail(std::exception_ptr error) {
  if (!failed_.exchange(true)) error_ = std::move(error);
}

void WorkPool::run_erased(int64_t items, Call call, void* context) {
  if (items <= 0) return;
  if (threads_ == 1 || items == 1 || tl_pool == this) {  // nothing to share, or nested: inline
    const int slot = tl_pool == this ? tl_slot : 0;
    // An item runs on one thread, as it does in the team: a oneDNN call inside it would otherwise take
    // this thread's OpenMP count, and below AVX-512 its sums follow the thread count (gemm:jit splits the
    // inner dimension), so a step's bits would depend on the pool's size.
    const int outer = omp_get_max_threads();
    omp_set_num_threads(1);
    try {
      for (int64_t i = 0; i < items; ++i) call(context, i, slot);
    } catch (...) {
      omp_set_num_threads(outer);
      throw;
    }
    omp_set_num_threads(outer);
    return;
  }
  if (items > INT32_MAX) throw std::length_error("WorkPool::run: more than 2^31 - 1 items");
  const uint32_t all = static_cast<uint32_t>(items);
  next_.store(0);
  done_.store(0);
  sleepers_.store(0);
  const int caller_cpu = sched_getcpu();
#pragma omp parallel num_threads(threads_)
  {
    const int slot = omp_get_thread_num();
    if (slot != 0 && caller_cpu >= 0 && sched_getcpu() == caller_cpu) leave_processor(caller_cpu);
    const WorkPool* const outer = tl_pool;
    const int outer_slot = tl_slot;
    tl_pool = this;
    tl_slot = slot;
    for (int64_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < items;) {
      if (!failed_.load(std::memory_order_relaxed)) {
        try {
          call(context, i, slot);
        } catch (...) {
          fail(std::current_exception());
        }
      }
      // Dekker with the sleepers below: either the last finisher sees a sleeper, or the sleeper sees all done.
      if (done_.fetch_add(1) + 1 == all && sleepers_.load() > 0) futex_wake_all(done_);
    }
    tl_pool = outer;
    tl_slot = outer_slot;
    // Wait here, not in libgomp's spinning barrier, for the items still running on other threads.
    if (!wait_briefly([&] { return done_.load(std::memory_order_acquire) == all; })) {
      sleepers_.fetch_add(1);
      for (uint32_t d; (d = done_.load()) != all;) futex_wait(done_, d);
    }
  }
  if (failed_.load()) {
    std::exception_ptr error = std::move(error_);
    error_ = nullptr;
    failed_.store(false);
    std::rethrow_exception(error);
  }
}

}  // namespace normuon::fast
