// How many threads the fast CPU backend uses when the caller does not say: the processors this process
// may run on (its affinity mask: taskset, numactl, a CPU-pinned container), capped by a cgroup CPU quota
// (docker --cpus, Kubernetes limits). One thread per processor of the machine on a 2-vCPU share or
// inside a 4-CPU quota on a 64-core host oversubscribes, and OpenMP's spinning threads then wait on each
// other for most of a step.
#pragma once

#include <string>

namespace normuon::fast {

int default_threads();

// The pieces, for tests. Threads a cgroup v2 "cpu.max" text allows ("max 100000": no quota, 0;
// "150000 100000": 2, rounded up), or a cgroup v1 quota and period (quota <= 0: no quota, 0).
int quota_threads_v2(const std::string& cpu_max);
int quota_threads_v1(long long quota_us, long long period_us);

}  // namespace normuon::fast
