# shellcheck shell=bash disable=SC2154
# Shared by scripts/gpu-bench.sh and scripts/gpu-test.sh (sourced, never run): staging the Debian
# packages a GPU machine lacks (--stage-deps), finding nvcc, torch, pybind11 and the staged prefix,
# the CMake arguments both scripts configure with, and the check that a built program starts.
#
# The sourcing script sets `script` (the name its messages start with) and runs from the repository
# root. Functions report through globals (nvcc, cuda_root, torch_dir, deps, onednn_prefix, fast_cpu,
# cuda_arch, cmake_args), in the style of the scripts. They read the sourcing script's settings
# (build_dir, deps, torch_dir, python, fast_cpu, cuda_arch, repo, and invoked_from, the directory a
# relative --stage-deps folder is taken from; every other path is taken from the repository root),
# hence SC2154 off above.

say() { printf '%s: %s\n' "$script" "$*"; }
die() {
  printf '%s: error: %s\n' "$script" "$*" >&2
  exit 1
}
run() {  # prints a command, then runs it
  printf '%s: $' "$script"
  printf ' %q' "$@"
  printf '\n'
  "$@"
}

# ---- --stage-deps: copy what the build needs from this (Debian) machine into a prefix
multiarch() { gcc -print-multiarch 2>/dev/null | grep . || echo x86_64-linux-gnu; }

copy_lib() {  # copy_lib NAME LIBDIR: the real file, its soname link and the NAME.so link
  local name=$1 dest=$2 dev real soname d
  dev=""
  for d in "/usr/lib/$(multiarch)" /usr/lib64 /usr/lib "/lib/$(multiarch)"; do
    if [ -e "$d/$name.so" ]; then dev="$d/$name.so"; break; fi
  done
  [ -n "$dev" ] || die "no $name.so on this machine (install its -dev package)"
  real=$(readlink -f "$dev")
  soname=$(objdump -p "$real" 2>/dev/null | awk '/SONAME/ {print $2}')
  mkdir -p "$dest"
  cp "$real" "$dest/"
  [ -z "$soname" ] || [ "$soname" = "$(basename "$real")" ] || ln -sf "$(basename "$real")" "$dest/$soname"
  ln -sf "${soname:-$(basename "$real")}" "$dest/$name.so"
  say "staged $real (soname ${soname:-none})"
}

boost_test_headers() {  # the Boost headers (under /usr/include) that tests/*.cpp pull in, one a line
  local incs=() d f
  local variants=("-DBOOST_TEST_MODULE=staged" "-DBOOST_TEST_NO_MAIN")
  for d in core/include fast fast/cuda reference selector compare golden cli /usr/local/cuda/include; do
    [ -d "$d" ] && incs+=("-I$d")
  done
  {
    # -MG: a header this machine lacks (the CUDA runtime, say) is listed, not an error. Only the sources that
    # include Boost: the others (a pybind11 module) would need headers this scan does not give them.
    for f in $(grep -l '#include <boost/' tests/*.cpp); do
      g++ -std=c++17 -DBOOST_TEST_DYN_LINK -DNORMUON_TEST_HAVE_REFERENCE -DNORMUON_TEST_HAVE_FAST_CPU \
        ${incs[@]+"${incs[@]}"} -M -MG "$f" || printf 'warning: g++ -M %s failed\n' "$f" >&2
    done
    for d in "${variants[@]}"; do  # and unit_test.hpp itself, with and without the test runner's main
      echo '#include <boost/test/unit_test.hpp>' | g++ -std=c++17 -DBOOST_TEST_DYN_LINK "$d" -M -x c++ -
    done
  } | sed 's/\\//g' | tr -s ' ' '\n' | grep '^/usr/include/boost/' | xargs -r realpath -m -s | sort -u
}

stage_boost_test() {  # stage_boost_test DIR: Boost.Test's headers, shared library and CMake packages
  local dir=$1 arch src cfg ver headers=()
  arch=$(multiarch)
  src=/usr/lib/$arch/cmake
  [ -f /usr/include/boost/test/unit_test.hpp ] || die "no Boost.Test headers (apt-get install libboost-test-dev)"
  cfg=$(find "$src" -maxdepth 2 -path "$src/Boost-*/BoostConfig.cmake" 2>/dev/null | sort -V | tail -1)
  [ -n "$cfg" ] || die "no $src/Boost-*/BoostConfig.cmake (apt-get install libboost-test-dev)"
  ver=$(basename "$(dirname "$cfg")")
  ver=${ver#Boost-}
  for f in "boost_headers-$ver/boost_headers-config.cmake" "BoostDetectToolset-$ver.cmake" \
    "boost_unit_test_framework-$ver/libboost_unit_test_framework-variant-shared.cmake"; do
    [ -f "$src/$f" ] || die "no $src/$f"
  done
  # Debian's configs find the headers at <cmake>/../../../include and the library at <cmake>/..: keep
  # the layout lib/<multiarch>/cmake so that both land inside DIR.
  local cm="$dir/lib/$arch/cmake" ut="boost_unit_test_framework-$ver"
  mkdir -p "$cm/$ut"
  run cp -r "$src/Boost-$ver" "$src/boost_headers-$ver" "$src/BoostDetectToolset-$ver.cmake" "$cm/"
  # The shared variant only (no static library is staged, so its variant file would point at nothing).
  run cp "$src/$ut/boost_unit_test_framework-config.cmake" "$src/$ut/boost_unit_test_framework-config-version.cmake" \
    "$src/$ut/libboost_unit_test_framework-variant-shared.cmake" "$cm/$ut/"
  copy_lib libboost_unit_test_framework "$dir/lib/$arch"
  mapfile -t headers < <(boost_test_headers)
  ((${#headers[@]})) || die "found no Boost header in the test sources' include closure (g++ -M)"
  (cd /usr/include && cp --parents "${headers[@]#/usr/include/}" "$dir/include/")
  cp -r /usr/include/boost/config "$dir/include/boost/"  # every compiler's and library's config, for another g++
  say "staged Boost $ver: unit_test_framework, ${#headers[@]} headers (the closure of tests/*.cpp) and boost/config"
}

stage_onednn() {  # stage_onednn DIR: oneDNN (the fast CPU backend) as DIR/onednn.tar.xz
  local dir=$1 arch tmp
  arch=$(multiarch)
  if [ ! -f /usr/include/oneapi/dnnl/dnnl.hpp ] || [ ! -f "/usr/lib/$arch/cmake/dnnl/dnnl-config.cmake" ]; then
    say "no oneDNN here (libdnnl-dev): not staged; the GPU build will leave the fast CPU backend out"
    return 0
  fi
  tmp=$(mktemp -d)
  mkdir -p "$tmp/include/oneapi" "$tmp/lib/$arch/cmake"
  cp /usr/include/dnnl*.h /usr/include/dnnl*.hpp "$tmp/include/"
  cp -r /usr/include/oneapi/dnnl "$tmp/include/oneapi/"
  cp -r "/usr/lib/$arch/cmake/dnnl" "$tmp/lib/$arch/cmake/"
  copy_lib libdnnl "$tmp/lib/$arch"
  if grep -q 'find_package(OpenCL' "/usr/lib/$arch/cmake/dnnl/dnnl-config.cmake"; then
    # Debian's oneDNN has the OpenCL GPU runtime: its config needs CL/cl.h and the ICD loader (kept
    # alone in lib/, which the scripts put on LD_LIBRARY_PATH for libdnnl's own dependency).
    local cl=()
    mapfile -t cl < <(echo '#include <CL/cl.h>' | gcc -M -x c - | sed 's/\\//g' | tr -s ' ' '\n' | grep '^/usr/include/CL/')
    ((${#cl[@]})) || die "oneDNN needs OpenCL, and there is no CL/cl.h (apt-get install opencl-headers)"
    (cd /usr/include && cp --parents "${cl[@]#/usr/include/}" "$tmp/include/")
    copy_lib libOpenCL "$tmp/lib"
  fi
  run tar -C "$tmp" -cJf "$dir/onednn.tar.xz" .
  rm -rf "$tmp"
  say "staged oneDNN as $dir/onednn.tar.xz ($(du -h "$dir/onednn.tar.xz" | cut -f1); unpacked into the build folder)"
}

stage_deps() {  # stage_deps DIR WITH_ONEDNN(0|1)
  local dir=$1 with_onednn=$2 json_cmake="" d
  # Absolute, from the caller's directory: the Boost headers are copied from inside /usr/include.
  case $dir in /*) ;; *) dir=${invoked_from:-$PWD}/$dir ;; esac
  mkdir -p "$dir/include" "$dir/lib" "$dir/share/cmake"
  [ -f /usr/include/csv.h ] || die "no /usr/include/csv.h (apt-get install libcsv-dev)"
  [ -d /usr/include/nlohmann ] || die "no /usr/include/nlohmann (apt-get install nlohmann-json3-dev)"
  [ -f /usr/include/zlib.h ] || die "no /usr/include/zlib.h (apt-get install zlib1g-dev)"
  for d in /usr/share/cmake/nlohmann_json /usr/lib/cmake/nlohmann_json "/usr/lib/$(multiarch)/cmake/nlohmann_json"; do
    if [ -f "$d/nlohmann_jsonConfig.cmake" ]; then json_cmake=$d; break; fi
  done
  [ -n "$json_cmake" ] || die "no nlohmann_jsonConfig.cmake found"
  run cp /usr/include/csv.h /usr/include/zlib.h /usr/include/zconf.h "$dir/include/"
  run cp -r /usr/include/nlohmann "$dir/include/"
  run cp -r "$json_cmake" "$dir/share/cmake/"
  copy_lib libcsv "$dir/lib"
  copy_lib libz "$dir/lib"
  stage_boost_test "$dir"
  if ((with_onednn)); then stage_onednn "$dir"; else rm -f "$dir/onednn.tar.xz"; fi
  say "staged into $dir ($(du -sh "$dir" | cut -f1)); bring it along as .gpu-deps (run's carry) or pass --deps $dir"
}

# ---- on the GPU machine
resolve_deps() {  # deps: --deps DIR, else ./.gpu-deps when it exists; made absolute
  [ -n "$deps" ] || { [ -d .gpu-deps ] && deps=$repo/.gpu-deps; } || true
  if [ -n "$deps" ]; then
    [ -d "$deps" ] || die "--deps $deps: no such folder"
    deps=$(cd "$deps" && pwd)
  fi
}

print_machine() {
  say "repository: $repo"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L || true
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv || true
  else
    say "nvidia-smi not found"
  fi
}

find_nvcc() {  # nvcc: CUDACXX, then PATH, then /usr/local/cuda (the project's CMakeLists looks there too)
  nvcc=${CUDACXX:-$(command -v nvcc || true)}
  [ -n "$nvcc" ] || { [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc; } || true
  [ -n "$nvcc" ] || die "nvcc not found (set CUDACXX or put the CUDA toolkit's bin on PATH)"
  say "nvcc: $nvcc ($("$nvcc" --version | tail -1))"
  cuda_root=$(cd "$(dirname "$nvcc")/.." && pwd)
}

find_torch() {  # torch_dir: --torch-dir, else the pip torch's CMake prefix
  if [ -z "$torch_dir" ]; then
    command -v "$python" >/dev/null 2>&1 || die "$python not found: pass --torch-dir (torch's CMake prefix)"
    torch_dir=$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null) ||
      die "$python cannot import torch: the normuon tool links libtorch (the reference backend); install torch or pass --torch-dir"
    say "torch $("$python" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "GPU visible:", torch.cuda.is_available())' 2>/dev/null || echo '?')"
  fi
  [ -d "$torch_dir/Torch" ] || die "no Torch CMake config under $torch_dir"
  say "torch CMake prefix: $torch_dir"
}

have_header() {  # have_header RELPATH: in the staged prefixes or the system include dirs
  local f=$1 d
  for d in ${deps:+"$deps/include"} ${onednn_prefix:+"$onednn_prefix/include"} /usr/include /usr/local/include; do
    [ -e "$d/$f" ] && return 0
  done
  return 1
}

check_required_deps() {  # returns 1 (after saying what is missing) when libcsv, nlohmann_json or zlib is absent
  local missing=()
  have_header csv.h || missing+=("libcsv (csv.h)")
  have_header nlohmann/json.hpp || missing+=("nlohmann_json (nlohmann/json.hpp)")
  have_header zlib.h || missing+=("zlib (zlib.h)")
  if ((${#missing[@]})); then
    printf '%s: error: missing: %s. On a Debian machine with libcsv-dev nlohmann-json3-dev zlib1g-dev libboost-test-dev run\n  scripts/gpu-bench.sh --stage-deps .gpu-deps\nand bring .gpu-deps along (it is used by itself), or pass --deps DIR\n' \
      "$script" "${missing[*]}" >&2
    return 1
  fi
}

boost_config_dir() {  # the staged Boost CMake package, if any
  local f
  [ -n "$deps" ] || return 0
  f=$(find "$deps/lib" -maxdepth 4 -path '*/cmake/Boost-*/BoostConfig.cmake' 2>/dev/null | sort -V | tail -1)
  [ -z "$f" ] || dirname "$f"
}

unpack_onednn() {  # onednn_prefix: the staged oneDNN, unpacked once per tarball into BUILD_DIR/_deps/onednn
  local tarball dest sum
  onednn_prefix=""
  [ -n "$deps" ] && [ -f "$deps/onednn.tar.xz" ] || return 0
  tarball=$deps/onednn.tar.xz
  mkdir -p "$build_dir/_deps"
  dest=$(cd "$build_dir/_deps" && pwd)/onednn
  sum=$(cksum <"$tarball")
  if [ "$(cat "$dest/.staged" 2>/dev/null)" != "$sum" ]; then
    rm -rf "$dest"
    mkdir -p "$dest"
    say "unpacking $tarball into $dest"
    tar -C "$dest" -xJf "$tarball" 2>/dev/null || "$python" -m tarfile -e "$tarball" "$dest" ||
      die "cannot unpack $tarball (no xz, and $python's tarfile failed)"
    echo "$sum" >"$dest/.staged"
  fi
  onednn_prefix=$dest
}

pick_fast_cpu() {  # fast_cpu: on|off as asked, else off (see below)
  case "$fast_cpu" in "" | on | off) ;; *) die "--fast-cpu takes on or off" ;; esac
  # Off unless asked for: on the H100 machine (2026-11-24) the build with Debian's oneDNN (its libgomp next
  # to pip torch's own) ran its CPU tests past 400 s without finishing, where the build without it ran
  # every CUDA test in 47 s. The CPU backend is tested on the Debian machines.
  [ -n "$fast_cpu" ] || fast_cpu=off
  onednn_prefix=""
  [ "$fast_cpu" = off ] || unpack_onednn
  [ "$fast_cpu" = off ] || have_header dnnl.hpp || die "--fast-cpu on: no oneDNN (dnnl.hpp) here or staged"
}

pick_cuda_arch() {  # cuda_arch: --cuda-arch, else the visible GPU's (e.g. 90-real), else the project's list
  local cc
  if [ -z "$cuda_arch" ] && command -v nvidia-smi >/dev/null 2>&1; then
    cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .' || true)
    [[ "$cc" =~ ^[0-9]+$ ]] && cuda_arch="$cc-real"
  fi
  say "CUDA architectures: ${cuda_arch:-the default list of CMakeLists.txt}"
}

base_cmake_args() {  # cmake_args: what both scripts configure with (the staged prefixes first)
  local prefix_path boost_dir dnnl_config generator=()
  prefix_path="${deps:+$deps;}${onednn_prefix:+$onednn_prefix;}$torch_dir"
  command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
  cmake_args=(-S . -B "$build_dir" ${generator[@]+"${generator[@]}"} -DCMAKE_BUILD_TYPE=Release
    -DNORMUON_BUILD_REFERENCE=ON -DNORMUON_BUILD_CUDA=ON
    "-DNORMUON_BUILD_FAST_CPU=$(tr '[:lower:]' '[:upper:]' <<<"$fast_cpu")"
    "-DCMAKE_PREFIX_PATH=$prefix_path" "-DCMAKE_CUDA_COMPILER=$nvcc" "-DCUDAToolkit_ROOT=$cuda_root")
  [ -z "$cuda_arch" ] || cmake_args+=("-DCMAKE_CUDA_ARCHITECTURES=$cuda_arch")
  boost_dir=$(boost_config_dir)
  [ -z "$boost_dir" ] || cmake_args+=("-DBoost_DIR=$boost_dir")
  if [ "$fast_cpu" = on ] && [ -n "$onednn_prefix" ]; then
    dnnl_config=$(find "$onednn_prefix/lib" -maxdepth 4 -name dnnl-config.cmake 2>/dev/null | head -1)
    [ -z "$dnnl_config" ] || cmake_args+=("-Ddnnl_DIR=$(dirname "$dnnl_config")")
  fi
}

deps_runtime_env() {  # the staged oneDNN's own dependency (the OpenCL loader) for programs that load it
  local d=$build_dir/_deps/onednn/lib
  if [ -d "$d" ] && ls "$d"/libOpenCL.so.* >/dev/null 2>&1; then
    d=$(cd "$d" && pwd)
    case ":${LD_LIBRARY_PATH:-}:" in *":$d:"*) ;; *) export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
  fi
}

ensure_starts() {  # ensure_starts PROGRAM ARGS...: it starts with every symbol bound, else retry with pip's CUDA libraries
  # The tool links the toolkit's libcudart/libcublasLt and pip torch's libtorch_cuda, which was built
  # against pip's CUDA libraries (same sonames, one copy gets loaded). If the toolkit's copies are too old
  # for torch, binding fails; then prefer pip's copies (LD_LIBRARY_PATH wins over the tool's RUNPATH).
  local start_log pip_libs
  if command -v ldd >/dev/null 2>&1; then
    ldd "$1" | grep -E 'libcudart|libcublas|libtorch_cuda|libc10_cuda|libdnnl|libboost|not found' || true
  fi
  start_log=$(mktemp)
  if LD_BIND_NOW=1 "$@" >/dev/null 2>"$start_log"; then
    rm -f "$start_log"
    return 0
  fi
  cat "$start_log" >&2
  rm -f "$start_log"
  pip_libs=$("$python" - 2>/dev/null <<'PY' || true
import glob, os, torch
site = os.path.dirname(os.path.dirname(torch.__file__))
libs = glob.glob(os.path.join(site, "nvidia", "**", "lib", "lib*.so*"), recursive=True)
print(":".join(sorted({os.path.dirname(p) for p in libs})))
PY
  )
  if [ -z "$pip_libs" ]; then
    say "$1 does not start (above) and no pip CUDA libraries were found to try instead"
    return 1
  fi
  export LD_LIBRARY_PATH="$pip_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  say "retrying with pip's CUDA libraries first: LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  LD_BIND_NOW=1 "$@" >/dev/null
}
