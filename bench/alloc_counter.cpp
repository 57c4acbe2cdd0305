// Malloc interposition for allocation counting (see alloc_counter.h). Each function forwards to
// glibc's exported implementation, so memory from here and from glibc's internal paths is one heap and
// glibc's free releases both. The counter is constant-initialised: calls before main are counted safely.
#include "alloc_counter.h"

#include <malloc.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdlib>

extern "C" {
void* __libc_malloc(size_t size);
void* __libc_calloc(size_t count, size_t size);
void* __libc_realloc(void* ptr, size_t size);
void* __libc_memalign(size_t alignment, size_t size);
void* __libc_valloc(size_t size);
void* __libc_pvalloc(size_t size);
}

namespace {

std::atomic<uint64_t> g_allocations{0};

inline void count() { g_allocations.fetch_add(1, std::memory_order_relaxed); }
inline bool power_of_two(size_t x) { return x != 0 && (x & (x - 1)) == 0; }

}  // namespace

extern "C" {

void* malloc(size_t size) noexcept {
  count();
  return __libc_malloc(size);
}

void* calloc(size_t count_, size_t size) noexcept {
  count();
  return __libc_calloc(count_, size);
}

void* realloc(void* ptr, size_t size) noexcept {
  count();
  return __libc_realloc(ptr, size);
}

void* reallocarray(void* ptr, size_t count_, size_t size) noexcept {
  size_t bytes = 0;
  if (__builtin_mul_overflow(count_, size, &bytes)) {
    errno = ENOMEM;
    return nullptr;
  }
  count();
  return __libc_realloc(ptr, bytes);
}

void* memalign(size_t alignment, size_t size) noexcept {
  count();
  return __libc_memalign(alignment, size);
}

void* aligned_alloc(size_t alignment, size_t size) noexcept {
  if (!power_of_two(alignment)) {
    errno = EINVAL;
    return nullptr;
  }
  count();
  return __libc_memalign(alignment, size);
}

int posix_memalign(void** out, size_t alignment, size_t size) noexcept {
  if (!power_of_two(alignment) || alignment % sizeof(void*) != 0) return EINVAL;
  count();
  void* p = __libc_memalign(alignment, size);
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}

void* valloc(size_t size) noexcept {
  count();
  return __libc_valloc(size);
}

void* pvalloc(size_t size) noexcept {
  count();
  return __libc_pvalloc(size);
}

}  // extern "C"

namespace normuon::bench {

uint64_t allocation_count() { return g_allocations.load(std::memory_order_relaxed); }

bool allocation_counting_active() {
  // Through a volatile pointer, so the compiler cannot pair and remove the malloc/free calls.
  void* (*volatile allocate)(size_t) = std::malloc;
  const uint64_t before = allocation_count();
  void* p = allocate(64);
  const uint64_t after = allocation_count();
  std::free(p);
  return after > before;
}

}  // namespace normuon::bench
