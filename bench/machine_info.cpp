#include "machine_info.h"

#include <ctime>
#include <fstream>

namespace normuon::bench {

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, name, family, model;
  auto value = [&line] {
    const auto colon = line.find(':');
    std::string v = colon == std::string::npos ? "" : line.substr(colon + 1);
    v.erase(0, v.find_first_not_of(" \t"));
    return v;
  };
  while (std::getline(in, line) && line.find_first_not_of(" \t") != std::string::npos) {
    if (line.rfind("model name", 0) == 0) name = value();
    else if (line.rfind("cpu family", 0) == 0) family = value();
    else if (line.rfind("model", 0) == 0) model = value();
  }
  if (name.empty()) return "unknown (no model name in /proc/cpuinfo)";
  return family.empty() ? name : name + " (family " + family + ", model " + model + ")";
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  if (!(in >> one >> five >> fifteen)) return "unknown";
  return one + " " + five + " " + fifteen;
}

std::string nvidia_driver_version() {
  std::ifstream in("/proc/driver/nvidia/version");
  std::string line;
  if (!std::getline(in, line)) return "";
  // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Tue ..."
  const auto at = line.find("Module");
  if (at == std::string::npos) return "";
  std::string rest = line.substr(at + 6);
  rest.erase(0, rest.find_first_not_of(' '));
  return rest.substr(0, rest.find(' '));
}

double process_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

}  // namespace normuon::bench
