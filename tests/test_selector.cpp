// Production gets the fast path; anything it can't serve is an error that says why, never the reference.
#define BOOST_TEST_MODULE selector
#include <boost/test/unit_test.hpp>

#include <cstdlib>

#include "normuon/presets.h"
#include "selector.h"

using namespace normuon;

namespace {
bool says(const std::exception& e, const std::string& what) { return std::string(e.what()).find(what) != std::string::npos; }

struct EnvVar {
  explicit EnvVar(const char* value) {
    if (value) setenv(kBackendEnvVar, value, 1);
    else unsetenv(kBackendEnvVar);
  }
  ~EnvVar() { unsetenv(kBackendEnvVar); }
};
}  // namespace

BOOST_AUTO_TEST_CASE(choices_parse_and_bad_ones_are_named) {
  BOOST_TEST((parse_backend_choice("auto") == BackendChoice::automatic));
  BOOST_TEST((parse_backend_choice("fast") == BackendChoice::fast));
  BOOST_TEST((parse_backend_choice("reference") == BackendChoice::reference));
  BOOST_CHECK_EXCEPTION(parse_backend_choice("fastest"), std::invalid_argument,
                        [](const auto& e) { return says(e, "auto | fast | reference"); });
}

BOOST_AUTO_TEST_CASE(explicit_request_beats_environment_beats_default) {
  {
    EnvVar env(nullptr);
    BOOST_TEST((resolve_backend_choice("") == BackendChoice::automatic));
  }
  {
    EnvVar env("reference");
    BOOST_TEST((resolve_backend_choice("") == BackendChoice::reference));
    BOOST_TEST((resolve_backend_choice("fast") == BackendChoice::fast));
  }
  {
    EnvVar env("gpu");
    BOOST_CHECK_EXCEPTION(resolve_backend_choice(""), std::invalid_argument,
                          [](const auto& e) { return says(e, "NORMUON_BACKEND"); });
  }
}

BOOST_AUTO_TEST_CASE(auto_means_fast) {
  const Options o;
  const Layout l = Layout::build(preset_manifest("tiny"), o);
#ifdef NORMUON_TEST_HAVE_FAST_CPU
  BOOST_TEST(make_backend(BackendChoice::automatic, l, o)->name() == "fast-cpu");
  BOOST_TEST(make_backend(BackendChoice::fast, l, o)->name() == "fast-cpu");
#else  // a build without the fast CPU backend says so: never the reference instead
  for (auto choice : {BackendChoice::automatic, BackendChoice::fast})
    BOOST_CHECK_EXCEPTION(make_backend(choice, l, o), std::invalid_argument, [](const auto& e) {
      return says(e, "NORMUON_BUILD_FAST_CPU") && says(e, "no fallback");
    });
#endif
  BOOST_TEST(make_backend(BackendChoice::reference, l, o)->name() == "reference-cpu");
}

BOOST_AUTO_TEST_CASE(unservable_requests_fail_loudly_without_fallback) {
  Options o;
  o.set("normuon.ns_coefficients=polar_express");
  o.set("normuon.ns_steps=7");
  const Layout l = Layout::build(preset_manifest("tiny"), o);
#ifdef NORMUON_TEST_HAVE_FAST_CPU
  for (auto choice : {BackendChoice::automatic, BackendChoice::fast})
    BOOST_CHECK_EXCEPTION(make_backend(choice, l, o), std::invalid_argument, [](const auto& e) {
      return says(e, "Polar Express") && says(e, "no fallback to the reference");
    });
#endif
}
