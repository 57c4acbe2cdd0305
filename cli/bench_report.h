// What the two benchmarks (`normuon bench`, `normuon bench-cuda`) share to summarise and print their
// measurements: medians with spreads, table cells, CSV fields, dates.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace normuon::cli {

double ms_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b);

struct Summary {
  double median = 0, min = 0, max = 0;
  size_t n = 0;  // samples summarised
};
Summary summarise(std::vector<double> v);  // median of an even count: the mean of the middle two

std::string ms_cell(const Summary& s);             // "1.234 [1.200 - 1.300]", "-" without samples
std::string ratio_cell(double num, double den);   // "2.03x", "-" unless both are positive
std::string with_commas(int64_t x);                // 124,439,808
std::string csv_field(const std::string& s);       // quoted where it holds a comma, quote or newline
std::string utc_now(const char* format = "%Y-%m-%d %H:%M UTC");

}  // namespace normuon::cli
