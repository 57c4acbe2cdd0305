#!/usr/bin/env bash
# The main job: installs what is missing, builds, then on the built-in tiny preset
#   1. runs 20 optimizer steps on the production (fast) backend, saves and verifies the state file,
#   2. cross-checks the fast backend against the reference, every tensor after every step (50 steps),
#   3. prints the old-vs-new performance table,
#   4. verifies the committed golden trace,
#   5. on a machine with a GPU, cross-checks and benchmarks the CUDA backend (elsewhere it says why not).
# Extra arguments go to `normuon run`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build_dir=${NORMUON_BUILD_DIR:-build}
tool="$build_dir/normuon"
state="$build_dir/tiny-state.safetensors"

echo "== 1. optimizer steps =="
"$tool" run --preset tiny --steps 20 --quiet --save "$state" "$@"
inspected=$("$tool" inspect "$state")  # verifies every checksum
head -8 <<<"$inspected"
echo "== 2. cross-check: fast vs reference =="
"$tool" compare --preset tiny --steps 50 --quiet
echo "== 3. old vs new =="
"$tool" bench --preset tiny
echo "== 4. golden trace =="
"$tool" golden verify
echo "== 5. CUDA backend =="
if probe=$("$tool" run --preset tiny --steps 0 --quiet --device cuda 2>&1); then
  "$tool" compare --preset tiny --steps 20 --quiet --device cuda
  "$tool" bench-cuda --preset tiny --repeats 3 --quiet
else
  echo "skipped: ${probe#*error: }"
fi
