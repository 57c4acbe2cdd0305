#include "thread_budget.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

namespace normuon::fast {
namespace {

int affinity_processors() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return in ? text.str() : std::string();
}

// The cgroup v2 directory of this process ("0::/some/path" in /proc/self/cgroup).
std::string cgroup_v2_dir() {
  std::istringstream lines(read_text("/proc/self/cgroup"));
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("0::", 0) == 0) return "/sys/fs/cgroup" + line.substr(3);
  return "/sys/fs/cgroup";
}

int quota_threads() {
  // v2: the process's own cgroup, then the root of the mount (inside a container it is the container's).
  for (const std::string& dir : {cgroup_v2_dir(), std::string("/sys/fs/cgroup")}) {
    const std::string text = read_text(dir + "/cpu.max");
    if (!text.empty()) return quota_threads_v2(text);
  }
  const std::string quota = read_text("/sys/fs/cgroup/cpu/cpu.cfs_quota_us");
  const std::string period = read_text("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
  if (quota.empty() || period.empty()) return 0;
  try {
    return quota_threads_v1(std::stoll(quota), std::stoll(period));
  } catch (const std::exception&) {
    return 0;
  }
}

}  // namespace

int quota_threads_v2(const std::string& cpu_max) {
  std::istringstream in(cpu_max);
  std::string quota;
  long long period = 0;
  if (!(in >> quota >> period) || quota == "max") return 0;
  try {
    return quota_threads_v1(std::stoll(quota), period);
  } catch (const std::exception&) {
    return 0;
  }
}

int quota_threads_v1(long long quota_us, long long period_us) {
  if (quota_us <= 0 || period_us <= 0) return 0;
  return std::max(1, static_cast<int>(std::ceil(static_cast<double>(quota_us) / static_cast<double>(period_us))));
}

int default_threads() {
  const int processors = affinity_processors();
  const int quota = quota_threads();
  return quota > 0 ? std::min(processors, quota) : processors;
}

}  // namespace normuon::fast
