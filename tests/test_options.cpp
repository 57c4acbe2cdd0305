#define BOOST_TEST_MODULE options
#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "normuon/options.h"

using namespace normuon;

namespace {
bool message_contains(const std::exception& e, const std::string& what) {
  return std::string(e.what()).find(what) != std::string::npos;
}
}  // namespace

BOOST_AUTO_TEST_CASE(defaults_follow_the_official_implementation) {
  const Options o;
  const auto& n = o.group("normuon").normuon;
  BOOST_TEST(n.lr == 0.02);
  BOOST_TEST(n.beta1 == 0.95);
  BOOST_TEST(n.beta2 == 0.95);
  BOOST_TEST(n.nesterov);
  BOOST_TEST(n.ns_steps == 5);
  BOOST_TEST(n.ns_eps == 1e-7);
  BOOST_TEST(n.denom_eps == 1e-10);
  BOOST_TEST((n.ns_precision == NsPrecision::bf16));
  BOOST_TEST((n.reduce_axis == ReduceAxis::rows));
  BOOST_TEST((n.lr_scale == LrScale::official));
  BOOST_TEST((n.weight_decay_mode == WeightDecayMode::decoupled));
  const auto& a = o.group("adamw").adamw;
  BOOST_TEST(a.lr == 3e-4);
  BOOST_TEST(a.beta2 == 0.95);
  BOOST_TEST(a.eps == 1e-10);
  BOOST_TEST((o.nonfinite == NonFinitePolicy::error));
}

BOOST_AUTO_TEST_CASE(set_by_group_and_for_all_groups) {
  Options o;
  o.set("normuon.lr=0.01");
  o.set("weight_decay", "0.1");  // both groups have it
  o.set("eps", "1e-8");          // only AdamW has it
  o.set("normuon.reduce_axis", "longer_dim");
  o.set("nonfinite=skip_step");
  BOOST_TEST(o.group("normuon").normuon.lr == 0.01);
  BOOST_TEST(o.group("adamw").adamw.lr == 3e-4);
  BOOST_TEST(o.group("normuon").normuon.weight_decay == 0.1);
  BOOST_TEST(o.group("adamw").adamw.weight_decay == 0.1);
  BOOST_TEST(o.group("adamw").adamw.eps == 1e-8);
  BOOST_TEST((o.group("normuon").normuon.reduce_axis == ReduceAxis::longer_dim));
  BOOST_TEST((o.nonfinite == NonFinitePolicy::skip_step));
}

BOOST_AUTO_TEST_CASE(bad_keys_and_values_are_clear_errors) {
  Options o;
  BOOST_CHECK_EXCEPTION(o.set("normuon.lrr=1"), std::invalid_argument,
                        [](const auto& e) { return message_contains(e, "no field 'lrr'"); });
  BOOST_CHECK_EXCEPTION(o.set("bogus=1"), std::invalid_argument,
                        [](const auto& e) { return message_contains(e, "unknown option 'bogus'"); });
  BOOST_CHECK_EXCEPTION(o.set("nogroup.lr=1"), std::invalid_argument,
                        [](const auto& e) { return message_contains(e, "unknown hyper-parameter group"); });
  BOOST_CHECK_EXCEPTION(o.set("normuon.reduce_axis=cols"), std::invalid_argument,
                        [](const auto& e) { return message_contains(e, "rows | longer_dim"); });
  BOOST_CHECK_EXCEPTION(o.set("normuon.beta1=1.5"), std::invalid_argument,
                        [](const auto& e) { return message_contains(e, "outside"); });
  // beta = 1, as torch refuses it: AdamW's bias correction 1 - beta^t is 0 and every value became NaN.
  BOOST_CHECK_EXCEPTION(o.set("adamw.beta2=1"), std::invalid_argument,
                        [](const auto& e) { return message_contains(e, "outside [0, 1)"); });
  BOOST_CHECK_EXCEPTION(o.set("normuon.beta1=1"), std::invalid_argument,
                        [](const auto& e) { return message_contains(e, "outside [0, 1)"); });
  o.set("adamw.beta1=0");  // the low end stays closed
  BOOST_CHECK_EXCEPTION(o.set("normuon.lr=abc"), std::invalid_argument,
                        [](const auto& e) { return message_contains(e, "not a finite number"); });
  BOOST_CHECK_EXCEPTION(o.set("normuon.lr=nan"), std::invalid_argument,
                        [](const auto& e) { return message_contains(e, "not a finite number"); });
  BOOST_CHECK_EXCEPTION(o.set("normuon.ns_steps=2.5"), std::invalid_argument,
                        [](const auto& e) { return message_contains(e, "integer"); });
  BOOST_CHECK_EXCEPTION(o.set("adamw.nesterov=true"), std::invalid_argument,
                        [](const auto& e) { return message_contains(e, "no field 'nesterov'"); });
  BOOST_CHECK_THROW(o.set("lr"), std::invalid_argument);
  // A failed set leaves the value alone.
  BOOST_TEST(o.group("normuon").normuon.lr == 0.02);
}

BOOST_AUTO_TEST_CASE(a_refused_value_carries_its_key_value_and_problem) {
  // The Megatron adapter names the value under its own key from these parts, instead of parsing what().
  Options o;
  auto parts = [&](const std::vector<std::pair<std::string, FieldValue>>& values) {
    try {
      o.set_group(0, values);
    } catch (const OptionError& e) {
      return std::vector<std::string>{e.key, e.value, e.problem, e.what()};
    }
    return std::vector<std::string>{"accepted"};
  };
  BOOST_TEST((parts({{"beta1", 1.5}}) ==
              std::vector<std::string>{"normuon.beta1", "1.5", "is outside [0, 1)", "option 'normuon.beta1': 1.5 is outside [0, 1)"}));
  BOOST_TEST((parts({{"ns_steps", 0.0}}) ==
              std::vector<std::string>{"normuon.ns_steps", "0", "is not an integer in [1, 100]",
                                       "option 'normuon.ns_steps': 0 is not an integer in [1, 100]"}));
  BOOST_TEST((parts({{"reduce_axis", std::string("cols")}}) ==
              std::vector<std::string>{"normuon.reduce_axis", "", "unknown value 'cols' (choose rows | longer_dim)",
                                       "option 'normuon.reduce_axis': unknown value 'cols' (choose rows | longer_dim)"}));
  BOOST_CHECK_EXCEPTION(o.set("normuon.lr=abc"), OptionError, [](const OptionError& e) {
    return e.key == "normuon.lr" && e.value == "'abc'" && e.problem == "is not a finite number";
  });
  BOOST_TEST(o.group("normuon").normuon.beta1 == 0.95);  // nothing changed
}

BOOST_AUTO_TEST_CASE(json_round_trip_is_lossless) {
  Options o;
  o.set("normuon.lr=0.0123456789012345");
  o.set("normuon.ns_coefficients=polar_express");
  o.set("normuon.nesterov=false");
  o.set("normuon.eps_placement=clamp");
  o.set("adamw.beta2=0.999");
  GroupOptions extra;
  extra.name = "no_decay";
  extra.algorithm = Algorithm::adamw;
  extra.adamw.weight_decay = 0;
  o.groups.push_back(extra);
  const Options back = Options::from_json(o.to_json());
  BOOST_TEST(back.to_json() == o.to_json());
  BOOST_TEST(back.groups.size() == 3u);
  BOOST_TEST(back.group("normuon").normuon.lr == 0.0123456789012345);
  BOOST_TEST(!back.group("normuon").normuon.nesterov);
  BOOST_CHECK_THROW(Options::from_json("{not json"), std::invalid_argument);
  BOOST_CHECK_THROW(Options::from_json("{\"nonfinite\":\"error\"}"), std::invalid_argument);
}

// A hyper-parameter this build does not know (a later version's option, or a damaged file) is refused,
// named, instead of being ignored: a run resumed without it would not be the run that was saved.
BOOST_AUTO_TEST_CASE(from_json_refuses_unknown_fields) {
  for (const char* group : {"normuon", "adamw"}) {
    nlohmann::json j = nlohmann::json::parse(Options().to_json());
    for (auto& g : j["groups"])
      if (g["name"] == group) g["hyper"]["ns_schedule"] = "cubic";
    try {
      Options::from_json(j.dump());
      BOOST_ERROR("an unknown field was accepted");
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      BOOST_TEST(what.find(std::string("option '") + group + ".ns_schedule' is not a field of a " + group +
                           " group") != std::string::npos, what);
      BOOST_TEST(what.find("lr") != std::string::npos, what);
    }
  }
}

BOOST_AUTO_TEST_CASE(describe_lists_every_key) {
  const auto lines = describe(Options());
  BOOST_TEST(lines.size() == 1u + 16u + 5u);
  BOOST_TEST(lines[0] == "nonfinite=error");
}

// 1e-400 is a finite number that no double holds: say that, rather than "not a finite number".
BOOST_AUTO_TEST_CASE(out_of_range_numbers_say_so) {
  Options o;
  BOOST_CHECK_EXCEPTION(o.set("lr=1e-400"), std::invalid_argument, [](const auto& e) {
    return message_contains(e, "'1e-400' is out of range: it underflows to 0") &&
           !message_contains(e, "not a finite number");
  });
  BOOST_CHECK_EXCEPTION(o.set("normuon.lr=-1e-400"), std::invalid_argument,
                        [](const auto& e) { return message_contains(e, "underflows"); });
  BOOST_CHECK_EXCEPTION(o.set("normuon.lr=1e400"), std::invalid_argument,
                        [](const auto& e) { return message_contains(e, "out of range: it overflows"); });
  BOOST_CHECK_EXCEPTION(o.set("normuon.lr=inf"), std::invalid_argument,
                        [](const auto& e) { return message_contains(e, "not a finite number"); });
  BOOST_CHECK_EXCEPTION(o.set("normuon.lr=0.1x"), std::invalid_argument,
                        [](const auto& e) { return message_contains(e, "not a finite number"); });
  BOOST_TEST(o.group("normuon").normuon.lr == 0.02);
  o.set("adamw.eps=1e-310");  // subnormal, but a value
  BOOST_TEST(o.group("adamw").adamw.eps == 1e-310);
  o.set("adamw.eps=0e-400");  // zero written with a large exponent is zero
  BOOST_TEST(o.group("adamw").adamw.eps == 0.0);
}

// from_json (state files) applies the checks of set(), naming the group and field.
BOOST_AUTO_TEST_CASE(from_json_checks_ranges_and_types) {
  const std::string good = Options().to_json();
  const auto with = [&](const std::string& from, const std::string& to) {
    const size_t at = good.find(from);
    BOOST_REQUIRE(at != std::string::npos);
    return std::string(good).replace(at, from.size(), to);
  };
  const auto rejected = [](const std::string& text, const std::vector<std::string>& words) {
    try {
      Options::from_json(text);
      BOOST_ERROR("accepted " << text);
    } catch (const std::invalid_argument& e) {
      for (const auto& w : words) BOOST_TEST(message_contains(e, w), e.what() << " lacks " << w);
    }
  };
  rejected(with("\"ns_steps\":5", "\"ns_steps\":1000000000"), {"normuon.ns_steps", "[1, 100]"});
  rejected(with("\"ns_steps\":5", "\"ns_steps\":0"), {"normuon.ns_steps", "[1, 100]"});
  rejected(with("\"lr\":0.02", "\"lr\":-0.02"), {"normuon.lr", "outside [0, 1e+06]"});
  rejected(with("\"beta1\":0.9,", "\"beta1\":5,"), {"adamw.beta1", "outside [0, 1)"});
  rejected(with("\"beta2\":0.95,\"eps\"", "\"beta2\":1,\"eps\""), {"adamw.beta2", "outside [0, 1)"});
  rejected(with("\"eps\":1e-10", "\"eps\":\"1e-10\""), {"adamw.eps", "not a number"});
  rejected(with("\"nesterov\":true", "\"nesterov\":\"true\""), {"normuon.nesterov", "boolean"});
  rejected(with("\"ns_precision\":\"bf16\"", "\"ns_precision\":\"fp8\""), {"normuon.ns_precision", "fp32 | bf16"});
  rejected(with("\"ns_algorithm\":\"standard\"", "\"ns_algorithm\":\"fast\""), {"normuon.ns_algorithm", "standard | gram"});
  rejected(with("\"ns_algorithm\":\"standard\"", "\"ns_algorithm\":1"), {"normuon.ns_algorithm", "not a string"});
  rejected(with("\"nonfinite\":\"error\"", "\"nonfinite\":\"ignore\""), {"nonfinite", "skip_step"});
  rejected(with("\"lr\":0.02,", ""), {"'normuon.lr' is missing"});
  rejected(with("\"name\":\"adamw\"", "\"name\":\"normuon\""), {"'normuon' is defined twice"});
  rejected("{\"nonfinite\":\"error\",\"groups\":" + std::string(100, '[') + std::string(100, ']') + "}",
           {"nests deeper than 64 levels"});
  BOOST_TEST(Options::from_json(good).to_json() == good);
}

// ns_algorithm (issue 15): set, printed, saved and read like the other Newton-Schulz knobs; state files
// from before it existed carry no such key and mean the standard iteration they ran.
BOOST_AUTO_TEST_CASE(ns_algorithm_is_a_knob_and_old_files_mean_standard) {
  Options o;
  BOOST_TEST((o.group("normuon").normuon.ns_algorithm == NsAlgorithm::standard));
  o.set("ns_algorithm=gram");  // only NorMuon groups have it
  BOOST_TEST((o.group("normuon").normuon.ns_algorithm == NsAlgorithm::gram));
  const std::string saved = o.to_json();
  BOOST_TEST(saved.find("\"ns_algorithm\":\"gram\"") != std::string::npos);
  BOOST_TEST((Options::from_json(saved).group("normuon").normuon.ns_algorithm == NsAlgorithm::gram));
  const auto lines = describe(o);
  BOOST_TEST((std::find(lines.begin(), lines.end(), "normuon.ns_algorithm=gram") != lines.end()));
  // A bad value is a clear error and changes nothing.
  BOOST_CHECK_EXCEPTION(o.set("normuon.ns_algorithm=foo"), std::invalid_argument, [](const auto& e) {
    return message_contains(e, "normuon.ns_algorithm") && message_contains(e, "'foo'") &&
           message_contains(e, "standard | gram");
  });
  BOOST_TEST((o.group("normuon").normuon.ns_algorithm == NsAlgorithm::gram));
  BOOST_CHECK_THROW(o.set("adamw.ns_algorithm=gram"), std::invalid_argument);
  // A file written before the key existed.
  std::string old = Options().to_json();
  const std::string key = ",\"ns_algorithm\":\"standard\"";
  const size_t at = old.find(key);
  BOOST_REQUIRE(at != std::string::npos);
  old.erase(at, key.size());
  BOOST_TEST((Options::from_json(old).group("normuon").normuon.ns_algorithm == NsAlgorithm::standard));
  BOOST_TEST(Options::from_json(old).to_json() == Options().to_json());
}
