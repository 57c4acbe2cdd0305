// The fast CPU backend's work pool: every item runs once, on one thread at a time per slot; the items of
// a stalled thread are taken by the others; a thread waiting for another sleeps instead of spinning; an
// item's exception reaches the caller; a pass allocates nothing.
#define BOOST_TEST_MODULE work_pool
#include <boost/test/unit_test.hpp>

#include <time.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include <omp.h>

#include "work_pool.h"

// Every malloc of the process is counted (operator new goes through malloc too).
static std::atomic<long> g_mallocs{0};
extern "C" {
void* __libc_malloc(size_t);
void* malloc(size_t n) {
  g_mallocs.fetch_add(1, std::memory_order_relaxed);
  return __libc_malloc(n);
}
}

using normuon::fast::WorkPool;

namespace {

double process_cpu_ms() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) / 1e6;
}

}  // namespace

BOOST_AUTO_TEST_CASE(every_item_runs_once_and_slots_are_not_shared) {
  for (int threads : {1, 2, 3, 8}) {
    WorkPool pool(threads);
    BOOST_TEST(pool.threads() == threads);
    std::vector<std::atomic<int>> runs(1000);
    std::vector<std::atomic<int>> busy(static_cast<size_t>(threads));
    std::atomic<int> bad_slot{0}, shared_slot{0};
    // Many small passes of varying size.
    for (int pass = 0; pass < 1000; ++pass) {
      const int64_t items = (pass * 7919) % 1000;
      for (int64_t i = 0; i < items; ++i) runs[i].store(0);
      pool.run(items, [&](int64_t item, int slot) {
        if (slot < 0 || slot >= threads) ++bad_slot;
        if (busy[slot].exchange(1) != 0) ++shared_slot;
        runs[item].fetch_add(1);
        busy[slot].store(0);
      });
      for (int64_t i = 0; i < items; ++i) BOOST_REQUIRE_MESSAGE(runs[i].load() == 1, "pass " << pass << " item " << i);
    }
    BOOST_TEST(bad_slot.load() == 0);
    BOOST_TEST(shared_slot.load() == 0);
  }
}

BOOST_AUTO_TEST_CASE(the_items_of_a_stalled_thread_are_taken_by_the_others) {
  // A preempted worker holds the item it is running, and no other: the rest go to whoever is running.
  WorkPool pool(2);
  std::atomic<bool> stalled{false};
  std::atomic<int> on_caller{0};
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  pool.run(200, [&](int64_t, int slot) {
    if (slot == 0) {
      while (!stalled.load() && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
      ++on_caller;
    } else if (!stalled.exchange(true)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  });
  BOOST_TEST(stalled.load());           // the worker took an item and stalled in it...
  BOOST_TEST(on_caller.load() >= 190);  // ...and the caller ran (nearly) all the others meanwhile
}

BOOST_AUTO_TEST_CASE(a_thread_that_waits_for_another_sleeps) {
  // libgomp's threads spin for milliseconds at the end of a region; a thread with no item left here
  // yields its processor, then sleeps, while another runs a long item.
  WorkPool pool(2);
  pool.run(2, [](int64_t, int) {});  // the team exists
  std::atomic<bool> stalled{false};
  const double cpu0 = process_cpu_ms();
  const auto t0 = std::chrono::steady_clock::now();
  pool.run(2, [&](int64_t, int) {
    if (!stalled.exchange(true)) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  });
  const double wall = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  BOOST_TEST(wall >= 300.0);
  BOOST_TEST(process_cpu_ms() - cpu0 < 30.0);  // not 300 ms of a spinning thread
}

BOOST_AUTO_TEST_CASE(an_items_exception_reaches_the_caller) {
  WorkPool pool(3);
  std::atomic<int> ran{0};
  BOOST_CHECK_THROW(pool.run(100,
                             [&](int64_t item, int) {
                               ++ran;
                               if (item == 17) throw std::runtime_error("item 17");
                             }),
                    std::runtime_error);
  BOOST_TEST(ran.load() <= 100);
  ran = 0;
  pool.run(100, [&](int64_t, int) { ++ran; });  // still usable, the failure forgotten
  BOOST_TEST(ran.load() == 100);
}

BOOST_AUTO_TEST_CASE(a_nested_run_is_inline_and_openmp_in_an_item_is_one_thread) {
  WorkPool pool(2);
  std::atomic<int> inner{0}, wide_team{0};
  pool.run(8, [&](int64_t, int slot) {
    int team = 0;
#pragma omp parallel
    {
#pragma omp atomic
      ++team;
    }
    if (team != 1) ++wide_team;
    pool.run(5, [&](int64_t, int inner_slot) {
      if (inner_slot != slot) ++wide_team;
      ++inner;
    });
  });
  BOOST_TEST(inner.load() == 40);
  BOOST_TEST(wide_team.load() == 0);
}

BOOST_AUTO_TEST_CASE(a_pass_allocates_nothing) {
  WorkPool pool(2);
  std::vector<double> out(4096);
  auto pass = [&](int64_t item, int) { out[item] = static_cast<double>(item) * 0.5; };
  pool.run(4096, pass);  // the team started
  const long before = g_mallocs.load();
  for (int i = 0; i < 100; ++i) pool.run(4096, pass);
  const long allocations = g_mallocs.load() - before;
  BOOST_TEST(allocations == 0);
}
