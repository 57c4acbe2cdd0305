#!/usr/bin/env bash
# Every test: installs what is missing, builds, runs the C++ suites through CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build_dir=${NORMUON_BUILD_DIR:-build}
# Tests run side by side (-j): an OpenMP team that spins while idle (libgomp's default) takes the cores
# from the other test's threads, several times slower on two cores. Idle threads sleep instead.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)"
