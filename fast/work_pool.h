// The fast CPU backend's passes: items shared out among threads that wait for each other without
// spinning. libgomp's threads spin while they wait (GOMP_SPINCOUNT: milliseconds), and libgomp reads its
// wait policy only when it is loaded (in Python, torch has loaded it already): on a machine shared with
// other work a thread spinning at the end of a pass holds the processor that the thread it waits for
// needs, and a step beside one busy process was 3x slower (issue 13).
//
// A pass here is one OpenMP parallel region, so its threads are the process's own OpenMP team (the one
// that torch and oneDNN use too: no second set of threads competing with it, and a team that is still
// spinning from the caller's last region is put to work at once). Inside it, items go out one at a time
// through an atomic counter, so a preempted thread's items are taken by the others; a thread that finds
// none left spins for 20 microseconds, then yields its processor in a loop for up to 10 ms (to whoever
// needs it; it stays runnable for the barrier below), then sleeps (futex) until the last item is done.
// The only spinning waits left are libgomp's barrier at the end of the region, reached when every item
// is done, and its idle threads between regions (bounded by GOMP_SPINCOUNT). A worker that starts a pass
// on the caller's processor moves off it (its affinity is given back at once): two threads of a pass on
// one processor would share it while another runs someone else's work. Starting a pass allocates
// nothing.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <type_traits>

namespace normuon::fast {

class WorkPool {
 public:
  explicit WorkPool(int threads);  // the team size of every pass (at least 1)
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  int threads() const { return threads_; }

  // Calls fn(item, slot) for every item in [0, items) and returns when all have returned. `slot`
  // (0 = the caller, < threads()) names the thread for per-thread scratch; which thread runs an item
  // varies from run to run, so an item's result must not depend on it. Code an item calls runs on its
  // thread alone (OpenMP regions inside are inactive: oneDNN runs single-threaded). The first exception
  // an item throws is rethrown here (items not yet started are skipped). One caller at a time; a run()
  // from inside an item runs its items inline on that thread, with its slot.
  template <typename F>
  void run(int64_t items, F&& fn) {
    using Fn = std::remove_reference_t<F>;
    run_erased(items, [](void* f, int64_t item, int slot) { (*static_cast<Fn*>(f))(item, slot); },
               const_cast<void*>(static_cast<const void*>(&fn)));
  }

 private:
  using Call = void (*)(void*, int64_t, int);
  void run_erased(int64_t items, Call call, void* context);
  void fail(std::exception_ptr error);

  int threads_ = 1;
  alignas(64) std::atomic<int64_t> next_{0};   // next unclaimed item
  alignas(64) std::atomic<uint32_t> done_{0};  // items finished (the futex word of sleeping threads)
  std::atomic<uint32_t> sleepers_{0};
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;
};

}  // namespace normuon::fast
