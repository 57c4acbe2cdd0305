#!/usr/bin/env bash
# The main job: installs what is missing, builds, then runs the optimizer on the built-in tiny preset
# (20 steps, saving the state) and verifies the committed golden trace. Extra arguments go to `normuon run`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build_dir=${NORMUON_BUILD_DIR:-build}
"$build_dir/normuon" run --preset tiny --steps 20 --save "$build_dir/tiny-state.safetensors" "$@"
inspected=$("$build_dir/normuon" inspect "$build_dir/tiny-state.safetensors")  # verifies every checksum
head -8 <<<"$inspected"
"$build_dir/normuon" golden verify
