#!/usr/bin/env bash
# Builds normuon on a GPU machine that has only the CUDA toolkit, CMake and a pip-installed torch, then
# runs `normuon bench-cuda` (docs/bench-cuda.md) over gpt2-124m, gpt-1.3b and llama-1b, writing
# bench/results/gpu-<preset>-<date>.md and .csv. It prints every step it takes.
#
#   scripts/gpu-bench.sh [options] [-- BENCH-CUDA ARGS...]
#
# The project also needs libcsv, nlohmann_json and zlib (and, for the tests of scripts/gpu-test.sh,
# Boost.Test; oneDNN for the fast CPU backend), which such a machine may lack and cannot fetch. Stage
# them on a Debian build machine that has them (libcsv-dev nlohmann-json3-dev zlib1g-dev libboost-test-dev,
# libdnnl-dev):
#   scripts/gpu-bench.sh --stage-deps .gpu-deps       # copies headers, libraries, CMake config files
# and bring the folder along; the script uses ./.gpu-deps by itself when it exists (or --deps DIR).
set -euo pipefail
invoked_from=$PWD  # a relative --stage-deps folder is the caller's, not the repository's
cd "$(dirname "$0")/.."
repo=$(pwd)
script=gpu-bench
# shellcheck source=scripts/gpu-common.sh
. scripts/gpu-common.sh

usage() {
  cat <<'EOF'
usage: scripts/gpu-bench.sh [options] [-- BENCH-CUDA ARGS...]

Builds the `normuon` tool (Release, -DNORMUON_BUILD_PYTHON=OFF -DNORMUON_BUILD_TESTS=OFF, the fast
CPU backend only with --fast-cpu on) against the pip torch's libtorch, then runs
`normuon bench-cuda` once per preset, writing bench/results/gpu-<preset>-<date>.md and .csv.
Arguments after `--` go to every bench-cuda run (e.g. -- --repeats 20 --no-reference).

options:
  --presets "P..."   presets to run (default: "gpt2-124m gpt-1.3b llama-1b moe-8x64")
  --build-dir DIR    build folder (default: build-gpu)
  --results DIR      where the reports go (default: bench/results)
  --skip-build       use the tool already built in the build folder
  --build-only       build, check that the tool starts, run nothing
  --torch-dir DIR    torch's CMake prefix (default: python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  --python PYTHON    the interpreter with torch (default: python3)
  --deps DIR         a prefix holding libcsv, nlohmann_json and zlib, made by --stage-deps (default:
                     ./.gpu-deps when it exists)
  --cuda-arch LIST   CMAKE_CUDA_ARCHITECTURES (default: the visible GPU's, e.g. 90-real; else the project's list)
  --fast-cpu on|off  build the fast CPU backend (default: off; on needs oneDNN here or staged)
  --jobs N           build jobs (default: nproc)
  --stage-deps DIR   (relative to the current directory) on a Debian machine with libcsv-dev, nlohmann-json3-dev, zlib1g-dev and
                     libboost-test-dev (and libdnnl-dev): copy what the build and the tests need from
                     them into DIR (to carry to the GPU machine), then exit. oneDNN goes in as
                     DIR/onednn.tar.xz (~7 MB), unpacked into the build folder when used
  --no-onednn        with --stage-deps: leave oneDNN out (the GPU build then has no fast CPU backend)
  -h, --help         this text

exit status: 0 when every run finished (bars missed or not), 77 when there is no GPU, 1 otherwise.
EOF
}

presets="gpt2-124m gpt-1.3b llama-1b moe-8x64"
build_dir=build-gpu
results=bench/results
skip_build=0
build_only=0
torch_dir=""
deps=""
cuda_arch=""
fast_cpu=""
jobs=$(nproc 2>/dev/null || echo 4)
stage_dir=""
stage_onednn=1
python=python3
bench_args=()
while (($#)); do
  case "$1" in
    --presets) presets=${2:?--presets needs a value}; shift 2 ;;
    --build-dir) build_dir=${2:?--build-dir needs a value}; shift 2 ;;
    --results) results=${2:?--results needs a value}; shift 2 ;;
    --skip-build) skip_build=1; shift ;;
    --build-only) build_only=1; shift ;;
    --torch-dir) torch_dir=${2:?--torch-dir needs a value}; shift 2 ;;
    --python) python=${2:?--python needs a value}; shift 2 ;;
    --deps) deps=${2:?--deps needs a value}; shift 2 ;;
    --cuda-arch) cuda_arch=${2:?--cuda-arch needs a value}; shift 2 ;;
    --fast-cpu) fast_cpu=${2:?--fast-cpu needs on or off}; shift 2 ;;
    --jobs) jobs=${2:?--jobs needs a value}; shift 2 ;;
    --stage-deps) stage_dir=${2:?--stage-deps needs a folder}; shift 2 ;;
    --no-onednn) stage_onednn=0; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; bench_args=("$@"); break ;;
    *) usage >&2; die "unknown option '$1'" ;;
  esac
done

# ---- --stage-deps: copy libcsv, nlohmann_json, zlib, Boost.Test (and oneDNN) from this (Debian) machine
if [ -n "$stage_dir" ]; then
  stage_deps "$stage_dir" "$stage_onednn"
  exit 0
fi

case "$fast_cpu" in "" | on | off) ;; *) die "--fast-cpu takes on or off" ;; esac
resolve_deps
tool="$build_dir/normuon"

# ---- the machine
print_machine

if ((!skip_build)); then
  command -v cmake >/dev/null 2>&1 || die "cmake not found"
  say "$(cmake --version | head -1)"
  find_nvcc
  find_torch

  # Required libraries: here, or in the staged prefix.
  pick_fast_cpu
  check_required_deps || exit 1
  say "fast CPU backend: $fast_cpu (it needs oneDNN; bench-cuda does not use it)"
  pick_cuda_arch

  base_cmake_args
  cmake_args+=(-DNORMUON_BUILD_PYTHON=OFF -DNORMUON_BUILD_TESTS=OFF)
  if ! run cmake "${cmake_args[@]}"; then
    die "cmake configure failed (see above; $build_dir/CMakeFiles/CMakeError.log / CMakeConfigureLog.yaml)"
  fi
  run cmake --build "$build_dir" -j "$jobs" --target normuon
fi

[ -x "$tool" ] || die "$tool not built"
deps_runtime_env
ensure_starts "$tool" bench-cuda --help || die "$tool does not start"
say "the tool starts: $tool"
((build_only)) && exit 0

# ---- the runs
mkdir -p "$results"
date=$(date -u +%Y-%m-%d)
failed=()
for preset in $presets; do
  md="$results/gpu-$preset-$date.md"
  csv="$results/gpu-$preset-$date.csv"
  say "== $preset =="
  set +e
  run "$tool" bench-cuda --preset "$preset" --markdown "$md" --csv "$csv" ${bench_args[@]+"${bench_args[@]}"}
  rc=$?
  set -e
  case $rc in
    0) say "$preset: wrote $md and $csv" ;;
    77) say "no GPU: nothing measured (exit 77)"; exit 77 ;;
    *) say "$preset: bench-cuda failed (exit $rc)"; failed+=("$preset") ;;
  esac
done
if ((${#failed[@]})); then
  say "failed: ${failed[*]}"
  exit 1
fi
say "done: $(for p in $presets; do printf '%s ' "$results/gpu-$p-$date.md"; done)"
