#include "op_counter.h"

#include <ATen/record_function.h>

#include <atomic>
#include <memory>
#include <type_traits>

namespace normuon::bench {
namespace {

static_assert(std::is_same_v<at::CallbackHandle, uint64_t>);

std::atomic<int64_t> g_ops_total{0}, g_ops_top{0};
thread_local int t_op_depth = 0;

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction&) {
  g_ops_total.fetch_add(1, std::memory_order_relaxed);
  if (t_op_depth++ == 0) g_ops_top.fetch_add(1, std::memory_order_relaxed);
  return nullptr;
}

void on_op_end(const at::RecordFunction&, at::ObserverContext*) { --t_op_depth; }

}  // namespace

AtenOpCounter::AtenOpCounter() {
  g_ops_total = 0;
  g_ops_top = 0;
  t_op_depth = 0;
  handle_ = at::addGlobalCallback(
      at::RecordFunctionCallback(on_op_start, on_op_end).scopes({at::RecordScope::FUNCTION}));
}

AtenOpCounter::~AtenOpCounter() { at::removeCallback(handle_); }

int64_t AtenOpCounter::top_level() const { return g_ops_top.load(); }
int64_t AtenOpCounter::dispatched() const { return g_ops_total.load(); }

}  // namespace normuon::bench
