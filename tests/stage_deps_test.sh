#!/usr/bin/env bash
# scripts/gpu-bench.sh --stage-deps with a folder named relative to the caller's directory, as the GPU
# runbook writes it (.gpu-deps): everything the GPU build reads must land inside that folder.
# Usage: stage_deps_test.sh REPO
set -euo pipefail
repo=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
if [ ! -f /usr/include/csv.h ] || [ ! -f /usr/include/boost/test/unit_test.hpp ]; then
  echo "SKIPPED: no Debian packages to stage here (libcsv-dev, libboost-test-dev): a GPU machine?"
  exit 77
fi
cd "$work"
out=$("$repo/scripts/gpu-bench.sh" --stage-deps staged --no-onednn 2>&1) || fail "staging exited with $?: $out"
# A test source the header scan could not read would lose its Boost headers without a word.
if grep "g++ -M .* failed" <<<"$out"; then fail "the scan of the test sources' Boost headers failed"; fi
for f in include/csv.h include/zlib.h include/nlohmann/json.hpp include/boost/test/unit_test.hpp \
  include/boost/config/user.hpp; do
  [ -f "staged/$f" ] || fail "staged/$f missing after staging into a relative folder"
done
compgen -G "staged/lib/*/libboost_unit_test_framework.so*" >/dev/null || fail "no Boost.Test library staged"
echo "staged into a relative folder: ok"
