// Built-in model manifests, so every command has a model without any input file.
#pragma once

#include <string>
#include <vector>

#include "normuon/manifest.h"

namespace normuon {

struct PresetInfo {
  std::string name;
  std::string description;
};

// tiny (the CPU default), gpt2-124m, gpt-1.3b, llama-1b (grouped-query attention, SwiGLU, tied embeddings),
// moe-8x64 (1,576 small expert and attention matrices: the launch-bound regime).
std::vector<PresetInfo> list_presets();
// Throws std::invalid_argument listing the known names.
Manifest preset_manifest(const std::string& name);

}  // namespace normuon
