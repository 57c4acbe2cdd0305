#!/usr/bin/env bash
# Installs the Debian packages normuon needs, when missing (non-interactive), then configures and builds
# into ./build. Used by both README commands; safe to run again (it only does what is missing).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  cmake ninja-build g++
  libtorch-dev python3-torch      # the reference backend (libtorch 1.13, CPU) and the Python tests
  libopenblas0-pthread            # without it torch and Eigen use the netlib reference BLAS, ~65x slower
  libdnnl-dev                     # oneDNN: the batched (bf16) GEMMs of the fast CPU backend
  libeigen3-dev libboost-test-dev pybind11-dev libcsv-dev nlohmann-json3-dev zlib1g-dev
  python3-dev python3-numpy python3-pytest   # the Python extension module and its tests
  clang libclang-rt-14-dev                   # libFuzzer on the parsers (tests/fuzz)
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# A current torch from PyPI beside Debian's 1.13, for the Python tests (users run torch 2.x). Debian's python3
# and numpy < 2, so the native module built below (Debian's pybind11) imports in both. NORMUON_TORCH2=0 skips it.
torch2_venv=.venv-torch2
torch2_pin="torch==2.11.0"
if [ "${NORMUON_TORCH2:-1}" != 0 ] && ! "$torch2_venv/bin/python" -c "import torch, pytest, wheel" 2>/dev/null; then
  echo "setup: creating $torch2_venv with $torch2_pin from PyPI (about 5 GB with its CUDA libraries)"
  python3 -m venv --clear "$torch2_venv"
  "$torch2_venv/bin/pip" install -q --disable-pip-version-check "$torch2_pin" "numpy<2" pytest setuptools wheel
fi
# transformers, for the tests on real model layouts (tiny models built from their configs: nothing downloaded),
# and accelerate, which its Trainer needs (the Trainer test).
transformers_pin="transformers==5.24.0"
accelerate_pin="accelerate==1.15.0"
if [ "${NORMUON_TORCH2:-1}" != 0 ] && ! "$torch2_venv/bin/python" -c "import transformers, accelerate" 2>/dev/null; then
  echo "setup: installing $transformers_pin and $accelerate_pin into $torch2_venv"
  "$torch2_venv/bin/pip" install -q --disable-pip-version-check "$transformers_pin" "$accelerate_pin"
fi
# expecttest, which torch's own optimizer test helpers import (python/tests/test_torch_conformance.py).
expecttest_pin="expecttest==0.3.0"
if [ "${NORMUON_TORCH2:-1}" != 0 ] && ! "$torch2_venv/bin/python" -c "import expecttest" 2>/dev/null; then
  echo "setup: installing $expecttest_pin into $torch2_venv"
  "$torch2_venv/bin/pip" install -q --disable-pip-version-check "$expecttest_pin"
fi
torch2_python=""
[ "${NORMUON_TORCH2:-1}" != 0 ] && torch2_python="$PWD/$torch2_venv/bin/python"

build_dir=${NORMUON_BUILD_DIR:-build}
if [ ! -f "$build_dir/build.ninja" ]; then
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DNORMUON_TORCH2_PYTHON="$torch2_python" >/dev/null
elif [ -n "$torch2_python" ]; then
  cmake "$build_dir" -DNORMUON_TORCH2_PYTHON="$torch2_python" >/dev/null
fi
cmake --build "$build_dir" -j "$(nproc)"
