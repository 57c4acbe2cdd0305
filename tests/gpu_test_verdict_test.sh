#!/usr/bin/env bash
# scripts/gpu-test.sh stopped from outside (a time limit's SIGTERM) in the middle of a step must not call
# the run a pass. It once reported "PASSED" after being killed in its ctest step on the GPU machine.
# Usage: gpu_test_verdict_test.sh REPO
set -euo pipefail
repo=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
mkdir -p "$work/build" "$work/bin"
echo "NORMUON_BUILD_FAST_CPU:BOOL=ON" >"$work/build/CMakeCache.txt"
printf '#!/bin/sh\nexit 0\n' >"$work/build/normuon"
# A ctest that says it started, then takes its time: the signal arrives while it runs.
printf '#!/bin/sh\ntouch "%s/started"\nsleep 3\n' "$work" >"$work/bin/ctest"
chmod +x "$work/build/normuon" "$work/bin/ctest"
PATH="$work/bin:$PATH" "$repo/scripts/gpu-test.sh" --skip-build --build-dir "$work/build" \
  --report "$work/report.md" >"$work/out.log" 2>&1 &
pid=$!
for _ in $(seq 100); do [ -e "$work/started" ] && break; sleep 0.2; done
[ -e "$work/started" ] || { cat "$work/out.log"; fail "the fake ctest never started"; }
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
((rc != 0 && rc != 77)) || fail "killed mid-run, gpu-test.sh exited $rc (0 = passed, 77 = passed without a GPU)"
grep -q "stopped early" "$work/report.md" || fail "the report does not say the run stopped early: $(tail -5 "$work/report.md")"
! grep -q "PASSED" "$work/report.md" || fail "the report says PASSED"
echo "killed mid-step: exit $rc, reported as stopped early"
