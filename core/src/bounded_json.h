// JSON parsing with a bound on nesting, for text read from files (state file headers and the JSON
// stored in their metadata). Private to core/src.
#pragma once

#include <functional>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

namespace normuon::detail {

// Far above anything the project writes (a state file header nests 3 levels, its options 4).
constexpr int kMaxJsonDepth = 64;

class JsonTooDeep : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A SAX pass that only tracks the depth and reports the outermost object's keys.
class DepthScan : public nlohmann::json_sax<nlohmann::json> {
 public:
  using Json = nlohmann::json;
  explicit DepthScan(const std::function<void(const std::string&)>* on_top_key) : on_top_key_(on_top_key) {}
  bool too_deep = false;

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(Json::number_integer_t) override { return true; }
  bool number_unsigned(Json::number_unsigned_t) override { return true; }
  bool number_float(Json::number_float_t, const Json::string_t&) override { return true; }
  bool string(Json::string_t&) override { return true; }
  bool binary(Json::binary_t&) override { return true; }
  bool start_object(std::size_t) override { return enter(); }
  bool key(Json::string_t& k) override {
    if (depth_ == 1 && on_top_key_ && *on_top_key_) (*on_top_key_)(k);
    return true;
  }
  bool end_object() override { return leave(); }
  bool start_array(std::size_t) override { return enter(); }
  bool end_array() override { return leave(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }

 private:
  bool enter() {
    if (++depth_ > kMaxJsonDepth) too_deep = true;
    return !too_deep;
  }
  bool leave() {
    --depth_;
    return true;
  }
  const std::function<void(const std::string&)>* on_top_key_;
  int depth_ = 0;
};

// Parses [begin, end) into a DOM. Throws JsonTooDeep for nesting beyond kMaxJsonDepth (nlohmann's dump,
// copy and comparison recurse once per level, so 10^6 nested arrays overflowed the stack) and
// nlohmann::json::parse_error for invalid JSON. `on_top_key` sees every key of the outermost object in
// text order, duplicates included (the DOM keeps only one). Linear in the text: unlike json::parse with a
// callback, whose end_object rescans the parent object, quadratic in the number of tensors of a header.
inline nlohmann::json parse_bounded_json(const char* begin, const char* end,
                                         const std::function<void(const std::string&)>& on_top_key = {}) {
  DepthScan scan(&on_top_key);
  if (!nlohmann::json::sax_parse(begin, end, &scan)) {
    if (scan.too_deep)
      throw JsonTooDeep("JSON nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    // Invalid JSON: the DOM parser stops at the same place and throws its usual parse_error.
  }
  return nlohmann::json::parse(begin, end);
}

inline nlohmann::json parse_bounded_json(const std::string& text) {
  return parse_bounded_json(text.data(), text.data() + text.size());
}

}  // namespace normuon::detail
