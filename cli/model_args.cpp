#include "model_args.h"

#include <cstdio>
#include <stdexcept>

#include "normuon/presets.h"

namespace normuon::cli {

Manifest model_manifest(const Args& a) {
  if (a.has("preset") && a.has("manifest")) throw std::invalid_argument("give --preset or --manifest, not both");
  if (a.has("manifest")) return Manifest::read_csv_file(a.get("manifest", ""));
  return preset_manifest(a.get("preset", "tiny"));
}

bool apply_sets(const Args& a, Options& options) {
  for (const auto& kv : a.all("set")) {
    if (kv.rfind("help=", 0) == 0) {
      for (const auto& line : describe(options)) std::puts(line.c_str());
      return false;
    }
    options.set(kv);
  }
  return true;
}

}  // namespace normuon::cli
