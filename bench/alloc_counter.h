// Counts malloc-family calls of the whole process (every thread, every library: libtorch, oneDNN,
// libstdc++'s operator new), for `normuon bench`'s allocations per step. alloc_counter.cpp defines
// malloc, calloc, realloc, reallocarray, aligned_alloc, posix_memalign, memalign, valloc and pvalloc
// in the executable, so the dynamic linker binds every library's calls to them; each increments a
// relaxed atomic counter and forwards to glibc's own (__libc_malloc, ...). free is not replaced.
#pragma once

#include <cstdint>

namespace normuon::bench {

// malloc-family calls since the process started. Take the difference around the code to measure.
uint64_t allocation_count();

// True when the interposition is in effect (a malloc call moves the counter): false would mean the
// counter reads 0 allocations for everything, so callers report "not measured" instead.
bool allocation_counting_active();

}  // namespace normuon::bench
