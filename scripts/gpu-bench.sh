#!/usr/bin/env bash
# Builds normuon on a GPU machine that has only the CUDA toolkit, CMake and a pip-installed torch, then
# runs `normuon bench-cuda` (docs/bench-cuda.md) over gpt2-124m, gpt-1.3b and llama-1b, writing
# bench/results/gpu-<preset>-<date>.md and .csv. It prints every step it takes.
#
#   scripts/gpu-bench.sh [options] [-- BENCH-CUDA ARGS...]
#
# The project also needs libcsv, nlohmann_json and zlib, which such a machine may lack and cannot fetch.
# Stage them on a Debian build machine that has them (libcsv-dev nlohmann-json3-dev zlib1g-dev):
#   scripts/gpu-bench.sh --stage-deps .gpu-deps       # copies headers, libraries, CMake config files
# and bring the folder along; the script uses ./.gpu-deps by itself when it exists (or --deps DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

usage() {
  cat <<'EOF'
usage: scripts/gpu-bench.sh [options] [-- BENCH-CUDA ARGS...]

Builds the `normuon` tool (Release, -DNORMUON_BUILD_PYTHON=OFF -DNORMUON_BUILD_TESTS=OFF, the fast
CPU backend only where oneDNN is found) against the pip torch's libtorch, then runs
`normuon bench-cuda` once per preset, writing bench/results/gpu-<preset>-<date>.md and .csv.
Arguments after `--` go to every bench-cuda run (e.g. -- --repeats 20 --no-reference).

options:
  --presets "P..."   presets to run (default: "gpt2-124m gpt-1.3b llama-1b")
  --build-dir DIR    build folder (default: build-gpu)
  --results DIR      where the reports go (default: bench/results)
  --skip-build       use the tool already built in the build folder
  --build-only       build, check that the tool starts, run nothing
  --torch-dir DIR    torch's CMake prefix (default: python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  --deps DIR         a prefix holding libcsv, nlohmann_json and zlib (default: ./.gpu-deps when it exists)
  --cuda-arch LIST   CMAKE_CUDA_ARCHITECTURES (default: the visible GPU's, e.g. 90-real; else the project's list)
  --fast-cpu on|off  build the fast CPU backend (default: on when oneDNN's dnnl.hpp is found)
  --jobs N           build jobs (default: nproc)
  --stage-deps DIR   on a Debian machine with libcsv-dev, nlohmann-json3-dev and zlib1g-dev: copy what the
                     build needs from them into DIR (to carry to the GPU machine), then exit
  -h, --help         this text

exit status: 0 when every run finished (bars missed or not), 77 when there is no GPU, 1 otherwise.
EOF
}

say() { printf 'gpu-bench: %s\n' "$*"; }
die() {
  printf 'gpu-bench: error: %s\n' "$*" >&2
  exit 1
}
run() {  # prints a command, then runs it
  printf 'gpu-bench: $'
  printf ' %q' "$@"
  printf '\n'
  "$@"
}

presets="gpt2-124m gpt-1.3b llama-1b"
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
bench_args=()
while (($#)); do
  case "$1" in
    --presets) presets=${2:?--presets needs a value}; shift 2 ;;
    --build-dir) build_dir=${2:?--build-dir needs a value}; shift 2 ;;
    --results) results=${2:?--results needs a value}; shift 2 ;;
    --skip-build) skip_build=1; shift ;;
    --build-only) build_only=1; shift ;;
    --torch-dir) torch_dir=${2:?--torch-dir needs a value}; shift 2 ;;
    --deps) deps=${2:?--deps needs a value}; shift 2 ;;
    --cuda-arch) cuda_arch=${2:?--cuda-arch needs a value}; shift 2 ;;
    --fast-cpu) fast_cpu=${2:?--fast-cpu needs on or off}; shift 2 ;;
    --jobs) jobs=${2:?--jobs needs a value}; shift 2 ;;
    --stage-deps) stage_dir=${2:?--stage-deps needs a folder}; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; bench_args=("$@"); break ;;
    *) usage >&2; die "unknown option '$1'" ;;
  esac
done

# ---- --stage-deps: copy libcsv, nlohmann_json and zlib from this (Debian) machine into a prefix
copy_lib() {  # copy_lib NAME DEST: the real file, its soname link and the NAME.so link
  local name=$1 dest=$2 dev real soname
  dev=""
  for d in /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib /lib/x86_64-linux-gnu; do
    if [ -e "$d/$name.so" ]; then dev="$d/$name.so"; break; fi
  done
  [ -n "$dev" ] || die "no $name.so on this machine (install its -dev package)"
  real=$(readlink -f "$dev")
  soname=$(objdump -p "$real" 2>/dev/null | awk '/SONAME/ {print $2}')
  cp "$real" "$dest/lib/"
  [ -z "$soname" ] || [ "$soname" = "$(basename "$real")" ] || ln -sf "$(basename "$real")" "$dest/lib/$soname"
  ln -sf "${soname:-$(basename "$real")}" "$dest/lib/$name.so"
  say "staged $real (soname ${soname:-none})"
}
if [ -n "$stage_dir" ]; then
  mkdir -p "$stage_dir/include" "$stage_dir/lib" "$stage_dir/share/cmake"
  [ -f /usr/include/csv.h ] || die "no /usr/include/csv.h (apt-get install libcsv-dev)"
  [ -d /usr/include/nlohmann ] || die "no /usr/include/nlohmann (apt-get install nlohmann-json3-dev)"
  [ -f /usr/include/zlib.h ] || die "no /usr/include/zlib.h (apt-get install zlib1g-dev)"
  json_cmake=""
  for d in /usr/share/cmake/nlohmann_json /usr/lib/cmake/nlohmann_json /usr/lib/x86_64-linux-gnu/cmake/nlohmann_json; do
    if [ -f "$d/nlohmann_jsonConfig.cmake" ]; then json_cmake=$d; break; fi
  done
  [ -n "$json_cmake" ] || die "no nlohmann_jsonConfig.cmake found"
  run cp /usr/include/csv.h /usr/include/zlib.h /usr/include/zconf.h "$stage_dir/include/"
  run cp -r /usr/include/nlohmann "$stage_dir/include/"
  run cp -r "$json_cmake" "$stage_dir/share/cmake/"
  copy_lib libcsv "$stage_dir"
  copy_lib libz "$stage_dir"
  say "staged into $stage_dir ($(du -sh "$stage_dir" | cut -f1)); on the GPU machine: scripts/gpu-bench.sh --deps $stage_dir"
  exit 0
fi

case "$fast_cpu" in "" | on | off) ;; *) die "--fast-cpu takes on or off" ;; esac
[ -n "$deps" ] || { [ -d .gpu-deps ] && deps=$repo/.gpu-deps; } || true
if [ -n "$deps" ]; then
  [ -d "$deps" ] || die "--deps $deps: no such folder"
  deps=$(cd "$deps" && pwd)
fi
tool="$build_dir/normuon"

# ---- the machine
say "repository: $repo"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -L || true
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv || true
else
  say "nvidia-smi not found"
fi

if ((!skip_build)); then
  command -v cmake >/dev/null 2>&1 || die "cmake not found"
  say "$(cmake --version | head -1)"
  # nvcc: CUDACXX, then PATH, then /usr/local/cuda (the project's CMakeLists looks there too)
  nvcc=${CUDACXX:-$(command -v nvcc || true)}
  [ -n "$nvcc" ] || { [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc; } || true
  [ -n "$nvcc" ] || die "nvcc not found (set CUDACXX or put the CUDA toolkit's bin on PATH)"
  say "nvcc: $nvcc ($("$nvcc" --version | tail -1))"
  cuda_root=$(cd "$(dirname "$nvcc")/.." && pwd)

  if [ -z "$torch_dir" ]; then
    command -v python3 >/dev/null 2>&1 || die "python3 not found: pass --torch-dir (torch's CMake prefix)"
    torch_dir=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null) ||
      die "python3 cannot import torch: the normuon tool links libtorch (the reference backend); install torch or pass --torch-dir"
    say "torch $(python3 -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "GPU visible:", torch.cuda.is_available())' 2>/dev/null || echo '?')"
  fi
  [ -d "$torch_dir/Torch" ] || die "no Torch CMake config under $torch_dir"
  say "torch CMake prefix: $torch_dir"

  # Required libraries: here, or in the staged prefix.
  have_header() {  # have_header RELPATH: in the system include dirs or the staged prefix
    local f=$1 d
    for d in ${deps:+"$deps/include"} /usr/include /usr/local/include; do [ -e "$d/$f" ] && return 0; done
    return 1
  }
  missing=()
  have_header csv.h || missing+=("libcsv (csv.h)")
  have_header nlohmann/json.hpp || missing+=("nlohmann_json (nlohmann/json.hpp)")
  have_header zlib.h || missing+=("zlib (zlib.h)")
  if ((${#missing[@]})); then
    die "missing: ${missing[*]}. On a Debian machine with libcsv-dev nlohmann-json3-dev zlib1g-dev run
  scripts/gpu-bench.sh --stage-deps .gpu-deps
and bring .gpu-deps along (it is used by itself), or pass --deps DIR"
  fi
  if [ -z "$fast_cpu" ]; then
    fast_cpu=off
    have_header dnnl.hpp && fast_cpu=on
  fi
  say "fast CPU backend: $fast_cpu (it needs oneDNN; bench-cuda does not use it)"

  if [ -z "$cuda_arch" ] && command -v nvidia-smi >/dev/null 2>&1; then
    cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .' || true)
    [[ "$cc" =~ ^[0-9]+$ ]] && cuda_arch="$cc-real"
  fi
  say "CUDA architectures: ${cuda_arch:-the default list of CMakeLists.txt}"

  prefix_path="$torch_dir${deps:+;$deps}"
  generator=()
  command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
  cmake_args=(-S . -B "$build_dir" ${generator[@]+"${generator[@]}"} -DCMAKE_BUILD_TYPE=Release
    -DNORMUON_BUILD_PYTHON=OFF -DNORMUON_BUILD_TESTS=OFF -DNORMUON_BUILD_REFERENCE=ON -DNORMUON_BUILD_CUDA=ON
    "-DNORMUON_BUILD_FAST_CPU=$(tr '[:lower:]' '[:upper:]' <<<"$fast_cpu")"
    "-DCMAKE_PREFIX_PATH=$prefix_path" "-DCMAKE_CUDA_COMPILER=$nvcc" "-DCUDAToolkit_ROOT=$cuda_root")
  [ -z "$cuda_arch" ] || cmake_args+=("-DCMAKE_CUDA_ARCHITECTURES=$cuda_arch")
  if ! run cmake "${cmake_args[@]}"; then
    die "cmake configure failed (see above; $build_dir/CMakeFiles/CMakeError.log / CMakeConfigureLog.yaml)"
  fi
  run cmake --build "$build_dir" -j "$jobs" --target normuon
fi

[ -x "$tool" ] || die "$tool not built"
# The tool links the toolkit's libcudart/libcublasLt and pip torch's libtorch_cuda, which was built
# against pip's CUDA libraries (same sonames, one copy gets loaded). If the toolkit's copies are too old
# for torch, binding fails; then prefer pip's copies (LD_LIBRARY_PATH wins over the tool's RUNPATH).
if command -v ldd >/dev/null 2>&1; then
  ldd "$tool" | grep -E 'libcudart|libcublas|libtorch_cuda|libc10_cuda' || true
fi
start_log=$(mktemp)
trap 'rm -f "$start_log"' EXIT
if ! LD_BIND_NOW=1 "$tool" bench-cuda --help >/dev/null 2>"$start_log"; then
  cat "$start_log" >&2
  pip_libs=$(python3 - 2>/dev/null <<'PY' || true
import glob, os, torch
site = os.path.dirname(os.path.dirname(torch.__file__))
libs = glob.glob(os.path.join(site, "nvidia", "**", "lib", "lib*.so*"), recursive=True)
print(":".join(sorted({os.path.dirname(p) for p in libs})))
PY
  )
  [ -n "$pip_libs" ] || die "$tool does not start (above) and no pip CUDA libraries were found to try instead"
  export LD_LIBRARY_PATH="$pip_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  say "retrying with pip's CUDA libraries first: LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  LD_BIND_NOW=1 "$tool" bench-cuda --help >/dev/null || die "$tool does not start"
fi
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
