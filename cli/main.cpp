// normuon: the command-line tool. `normuon --help` lists the subcommands; `normuon CMD --help` explains one.
#include <cstdio>
#include <exception>
#include <string>

#include "commands.h"

namespace {

constexpr const char* kUsage = R"(normuon: the NorMuon + AdamW optimizer, its reference and its checks.

usage: normuon COMMAND [options]      (normuon COMMAND --help for details)
       normuon --version              (version, commit and build configuration)

commands:
  run        run optimizer steps on a model preset or manifest with deterministic gradients
             (the main job: `normuon run` runs the tiny preset)
  compare    cross-check the fast backend against the reference, step by step, every tensor
  bench      old-vs-new performance: per-phase times of the reference and the fast backend
  bench-cuda GPU benchmark of the CUDA backend: phases, launches, bandwidth, TFLOP/s, lower bound
  golden     make or verify golden traces (determinism and semantics checks)
  inspect    print a state file's header, tensors and checksums, and verify it
  presets    list the built-in model presets
  manifest   write a preset's parameter manifest as CSV
  layout     print the routing table and shape buckets of a preset or manifest
)";

struct Command {
  const char* name;
  int (*fn)(const normuon::cli::Argv&);
};

const Command kCommands[] = {
    {"run", normuon::cli::run_command},           {"golden", normuon::cli::golden_command},
    {"inspect", normuon::cli::inspect_command},   {"presets", normuon::cli::presets_command},
    {"manifest", normuon::cli::manifest_command}, {"layout", normuon::cli::layout_command},
    {"compare", normuon::cli::compare_command},   {"bench", normuon::cli::bench_command},
    {"bench-cuda", normuon::cli::bench_cuda_command},
};

// What this binary is: the version, the commit it was configured from, and what it was built with.
void print_version() {
  std::printf("normuon %s\ncommit: %s\nbuild: %s; backends: %s\n", NORMUON_VERSION, NORMUON_GIT_COMMIT,
              NORMUON_BUILD_TYPE[0] ? NORMUON_BUILD_TYPE : "(no build type)", NORMUON_BUILT_BACKENDS);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && (std::string(argv[1]) == "--version" || std::string(argv[1]) == "version")) {
    print_version();
    return 0;
  }
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h" ||
      std::string(argv[1]) == "help") {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string name = argv[1];
  const normuon::cli::Argv args(argv + 2, argv + argc);
  for (const auto& c : kCommands) {
    if (name != c.name) continue;
    try {
      return c.fn(args);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "normuon %s: error: %s\n", c.name, e.what());
      return 1;
    }
  }
  std::fprintf(stderr, "normuon: unknown command '%s'\n\n%s", name.c_str(), kUsage);
  return 2;
}
