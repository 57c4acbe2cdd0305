#!/usr/bin/env bash
# The GPU machines' build (scripts/gpu-test.sh): a CUDA build of torch (pip's), the CUDA backend on, the fast
# CPU backend off. Two defects it held, each of which stopped the GPU session's build:
# - with no GPU visible, torch's CMake package gave every CUDA target its own architecture list, which held
#   compute_50, and nvcc 13 refused it ("Unsupported gpu architecture"). Every CUDA object must be built for
#   the project's architectures alone;
# - the CLI did not link without the fast CPU backend (the CPU benchmark called it all the same).
# Usage: cuda_torch_build_test.sh SRC PYTHON (a Python whose torch is a CUDA build)
set -euo pipefail
src=$1
python=${2:-}
skip() { echo "SKIPPED: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
[ -n "$python" ] && [ -x "$python" ] || skip "no Python with a current torch (NORMUON_TORCH2_PYTHON)"
nvcc=${CUDACXX:-/usr/local/cuda/bin/nvcc}
[ -x "$nvcc" ] || skip "no CUDA toolkit ($nvcc)"
torch_cmake=$("$python" -c "import torch, torch.utils
assert torch.version.cuda
print(torch.utils.cmake_prefix_path)" 2>/dev/null) || skip "$python has no CUDA build of torch"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export CUDA_VISIBLE_DEVICES=""  # torch's CMake package looks for a GPU: there is none, wherever this runs
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DNORMUON_BUILD_REFERENCE=ON \
  -DNORMUON_BUILD_CUDA=ON -DNORMUON_BUILD_FAST_CPU=OFF -DCMAKE_CUDA_COMPILER="$nvcc" -DNORMUON_BUILD_PYTHON=OFF \
  -DNORMUON_BUILD_TESTS=OFF -DCMAKE_PREFIX_PATH="$torch_cmake" >"$work/configure.log" 2>&1 ||
  { tail -40 "$work/configure.log"; fail "configure"; }
expected=$(sed -n 's/.*set(CMAKE_CUDA_ARCHITECTURES \([0-9].*\))/\1/p' "$src/CMakeLists.txt" | tr ' ' '\n' |
  sed 's/-.*//' | sort -u | tr '\n' ' ')
[ -n "$expected" ] || fail "no default CMAKE_CUDA_ARCHITECTURES in CMakeLists.txt"
for object in CMakeFiles/normuon_fast_cuda.dir/fast/cuda/fast_cuda_backend.cu.o \
              CMakeFiles/normuon_reference.dir/reference/cuda_ops.cu.o; do
  command=$(ninja -C "$work/build" -t commands "$object" | tail -1)
  archs=$(grep -o 'compute_[0-9]*[a-z]*' <<<"$command" | sed 's/compute_//' | sort -u | tr '\n' ' ')
  [ "$archs" = "$expected" ] ||
    { echo "$command"; fail "$object is built for ($archs), not the project's ($expected)"; }
done
# The CLI, which the GPU session runs first (its kernels compiled for one architecture: the flags are checked).
cmake "$work/build" -DCMAKE_CUDA_ARCHITECTURES=90-real >/dev/null
cmake --build "$work/build" --target normuon -j "$(nproc)" >"$work/build.log" 2>&1 ||
  { grep -E "error|undefined" "$work/build.log" | head -20; fail "no CLI without the fast CPU backend"; }
"$work/build/normuon" --version
echo "PASS: the CUDA objects are built for ${expected% } alone, and the CLI builds without the fast CPU backend"
