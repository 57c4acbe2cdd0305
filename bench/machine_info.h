// What a benchmark's header says about the machine it ran on, and the process CPU clock.
#pragma once

#include <string>

namespace normuon::bench {

// "model name (family F, model M)" of the first processor in /proc/cpuinfo (virtual machines often
// report a bare "AMD EPYC"; the family tells the generation).
std::string cpu_model();

// The 1-, 5- and 15-minute load averages, "unknown" where /proc/loadavg can't be read: other work on
// the machine shows up in every number of a benchmark.
std::string load_average();

// The NVIDIA kernel driver's version, e.g. "580.159.04", from /proc (empty when not there).
std::string nvidia_driver_version();

// CPU time of all the process's threads in ms (CLOCK_PROCESS_CPUTIME_ID).
double process_cpu_ms();

}  // namespace normuon::bench
