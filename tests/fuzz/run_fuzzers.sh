#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (a build folder of their own) and runs each for a bounded time
# (NORMUON_FUZZ_SECONDS, default 60; seed NORMUON_FUZZ_SEED, default 1, so that a run repeats) from the
# seed corpus in the repository. New inputs go to a scratch corpus; a crash leaves its input in the build
# folder and fails the test (it then becomes a regression test of its own). Exit 77 (skipped) without
# clang and its libFuzzer runtime.
set -euo pipefail
src=$(cd "$(dirname "$0")" && pwd)
build=${1:?usage: run_fuzzers.sh BUILD_DIR}
seconds=${NORMUON_FUZZ_SECONDS:-60}
if ! command -v clang++ >/dev/null; then echo "SKIPPED: no clang++ (scripts/setup.sh installs it)"; exit 77; fi
mkdir -p "$build"
if [ ! -f "$build/build.ninja" ]; then
  CXX=clang++ cmake -S "$src" -B "$build" -G Ninja >"$build/configure.log" 2>&1 || {
    cat "$build/configure.log"; echo "FAIL: configure"; exit 1; }
fi
cmake --build "$build" >"$build/build.log" 2>&1 || { tail -40 "$build/build.log"; echo "FAIL: build"; exit 1; }
status=0
for target in fuzz_state_file fuzz_manifest_csv; do
  corpus=$src/corpus/${target#fuzz_}
  corpus=${corpus/state_file/state}
  corpus=${corpus/manifest_csv/manifest}
  scratch=$(mktemp -d)
  echo "== $target: ${seconds}s from $(ls "$corpus" | wc -l) seeds"
  if ! (cd "$build" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
        "./$target" -max_total_time="$seconds" -seed="${NORMUON_FUZZ_SEED:-1}" -timeout=10 -rss_limit_mb=2048 \
        -max_len=65536 \
        -print_final_stats=1 "$scratch" "$corpus" 2>"$build/$target.log"); then
    tail -60 "$build/$target.log"
    echo "FAIL: $target found a crash, a leak or a hang (its input: crash-*/timeout-* in $build)"
    status=1
  else
    grep -E "stat::number_of_executed_units|stat::new_units_added" "$build/$target.log" || true
  fi
  rm -rf "$scratch"
done
rm -f /tmp/normuon-fuzz-*.safetensors
[ "$status" = 0 ] && echo "PASS: no crash in ${seconds}s per target"
exit "$status"
