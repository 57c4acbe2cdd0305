// The command-line arguments every model-running subcommand shares: which model, which options.
#pragma once

#include "args.h"
#include "normuon/manifest.h"
#include "normuon/options.h"

namespace normuon::cli {

// --preset NAME or --manifest FILE (default: the tiny preset).
Manifest model_manifest(const Args& a);

// Applies every --set KEY=VALUE in order. "--set help=1" prints every key with its value instead and
// returns false (the command then stops).
bool apply_sets(const Args& a, Options& options);

}  // namespace normuon::cli
