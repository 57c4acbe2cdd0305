// What the two benchmarks (`normuon bench`, `normuon bench-cuda`) share to summarise and print their
// measurements: medians with spreads, table cells, CSV fields, dates, the console transcript.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "normuon/backend.h"
#include "normuon/layout.h"
#include "normuon/options.h"

namespace normuon::bench {

double ms_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b);

struct Summary {
  double median = 0, min = 0, max = 0;
  size_t n = 0;  // samples summarised
};
Summary summarise(std::vector<double> v);  // median of an even count: the mean of the middle two

// The Newton-Schulz algorithms the NorMuon matrices of `layout` run under `options`: "standard", "gram",
// or "gram, standard" where the groups differ; "" when no matrix is on NorMuon.
std::string ns_algorithms_of(const Layout& layout, const Options& options);

// A step's time outside the five phases (NaN/Inf check, group bookkeeping, timer overhead), >= 0.
double other_ms(const PhaseTimes& p);

std::string ms_cell(const Summary& s);             // "1.234 [1.200 - 1.300]", "-" without samples
std::string ratio_cell(double num, double den);   // "2.03x", "-" unless both are positive
std::string with_commas(int64_t x);                // 124,439,808
std::string csv_field(const std::string& s);       // quoted where it holds a comma, quote or newline
std::string utc_now(const char* format = "%Y-%m-%d %H:%M UTC");
__attribute__((format(printf, 1, 2))) std::string format(const char* fmt, ...);  // printf into a string

// What a benchmark prints: echoed (stdout by default, nowhere with nullptr) and kept, so that a report
// file can reproduce the console output and a test can read it.
class Transcript {
 public:
  explicit Transcript(std::FILE* echo = stdout) : echo_(echo) {}
  __attribute__((format(printf, 2, 3))) void say(const char* fmt, ...);
  const std::string& text() const { return text_; }

 private:
  std::FILE* echo_;
  std::string text_;
};

}  // namespace normuon::bench
