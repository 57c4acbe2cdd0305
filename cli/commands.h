// The subcommands of the `normuon` tool. Each takes its arguments (after the subcommand name) and
// returns the process exit code; errors are thrown as exceptions and reported by main().
#pragma once

#include <string>
#include <vector>

namespace normuon::cli {

using Argv = std::vector<std::string>;

int run_command(const Argv& args);
int golden_command(const Argv& args);
int inspect_command(const Argv& args);
int presets_command(const Argv& args);
int manifest_command(const Argv& args);
int layout_command(const Argv& args);
int compare_command(const Argv& args);  // cli/compare_command.cpp
int bench_command(const Argv& args);    // cli/bench_command.cpp
int bench_cuda_command(const Argv& args);  // cli/bench_cuda_command.cpp

}  // namespace normuon::cli
