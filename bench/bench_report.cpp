#include "bench_report.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <ctime>

namespace normuon::bench {
namespace {

std::string vformat(const char* fmt, va_list args) {
  va_list copy;
  va_copy(copy, args);
  const int n = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  if (n <= 0) return "";
  std::string out(static_cast<size_t>(n) + 1, '\0');
  std::vsnprintf(out.data(), out.size(), fmt, args);
  out.resize(static_cast<size_t>(n));
  return out;
}

}  // namespace

double ms_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

Summary summarise(std::vector<double> v) {
  Summary s;
  s.n = v.size();
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  s.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  s.min = v.front();
  s.max = v.back();
  return s;
}

std::string ns_algorithms_of(const Layout& layout, const Options& options) {
  std::vector<std::string> names;
  for (const auto& e : layout.entries)
    if (e.algorithm == Algorithm::normuon) names.push_back(to_string(options.groups[e.group].normuon.ns_algorithm));
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  std::string joined;
  for (const auto& n : names) joined += (joined.empty() ? "" : ", ") + n;
  return joined;
}

double other_ms(const PhaseTimes& p) {
  return std::max(0.0, p.total - (p.momentum + p.newton_schulz + p.normalisation + p.update + p.adamw));
}

std::string ms_cell(const Summary& s) {
  if (s.n == 0) return "-";
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.3f [%.3f - %.3f]", s.median, s.min, s.max);
  return buf;
}

std::string ratio_cell(double num, double den) {
  if (!(num > 0) || !(den > 0)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2fx", num / den);
  return buf;
}

std::string with_commas(int64_t x) {
  std::string digits = std::to_string(x < 0 ? -x : x), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return x < 0 ? "-" + out : out;
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::string utc_now(const char* format) {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, format, &tm);
  return buf;
}

std::string format(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::string s = vformat(fmt, args);
  va_end(args);
  return s;
}

void Transcript::say(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  const std::string s = vformat(fmt, args);
  va_end(args);
  if (echo_) {
    std::fputs(s.c_str(), echo_);
    std::fflush(echo_);
  }
  text_ += s;
}

}  // namespace normuon::bench
