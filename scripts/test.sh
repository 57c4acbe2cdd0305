#!/usr/bin/env bash
# Every test: installs what is missing, builds, runs the C++ suites through CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build_dir=${NORMUON_BUILD_DIR:-build}
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)"
