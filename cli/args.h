// A small command-line parser: "--name value", "--name=value", boolean "--flag", repeated "--set K=V",
// and positionals. Every command declares its flags, so an unknown or misspelt flag is an error.
#pragma once

#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace normuon::cli {

class Args {
 public:
  // value_flags take a value; bool_flags do not. "--help"/"-h" is always accepted.
  Args(const std::vector<std::string>& argv, const std::set<std::string>& value_flags,
       const std::set<std::string>& bool_flags) {
    for (size_t i = 0; i < argv.size(); ++i) {
      const std::string& a = argv[i];
      if (a == "-h" || a == "--help") {
        help_ = true;
        continue;
      }
      if (a.rfind("--", 0) != 0) {
        positionals_.push_back(a);
        continue;
      }
      std::string name = a.substr(2), value;
      const auto eq = name.find('=');
      const bool inline_value = eq != std::string::npos;
      if (inline_value) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
      }
      if (bool_flags.count(name)) {
        if (inline_value) throw std::invalid_argument("--" + name + " takes no value");
        flags_.insert(name);
      } else if (value_flags.count(name)) {
        if (!inline_value) {
          if (i + 1 >= argv.size()) throw std::invalid_argument("--" + name + " needs a value");
          value = argv[++i];
        }
        values_[name].push_back(value);
      } else {
        throw std::invalid_argument("unknown option '" + a + "' (see --help)");
      }
    }
  }

  bool help() const { return help_; }
  bool flag(const std::string& name) const { return flags_.count(name) > 0; }
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  std::string get(const std::string& name, const std::string& fallback) const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second.back();
  }
  long long get_int(const std::string& name, long long fallback) const {
    if (!has(name)) return fallback;
    const std::string v = get(name, "");
    size_t used = 0;
    long long x = 0;
    try {
      x = std::stoll(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != v.size()) throw std::invalid_argument("--" + name + ": '" + v + "' is not an integer");
    return x;
  }
  double get_double(const std::string& name, double fallback) const {
    if (!has(name)) return fallback;
    const std::string v = get(name, "");
    size_t used = 0;
    double x = 0;
    try {
      x = std::stod(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != v.size()) throw std::invalid_argument("--" + name + ": '" + v + "' is not a number");
    return x;
  }
  std::vector<std::string> all(const std::string& name) const {
    auto it = values_.find(name);
    return it == values_.end() ? std::vector<std::string>{} : it->second;
  }
  const std::vector<std::string>& positionals() const { return positionals_; }

 private:
  bool help_ = false;
  std::set<std::string> flags_;
  std::map<std::string, std::vector<std::string>> values_;
  std::vector<std::string> positionals_;
};

}  // namespace normuon::cli
