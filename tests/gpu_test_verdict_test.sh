#!/usr/bin/env bash
# scripts/gpu-test.sh stopped from outside in the middle of a step must end at once and must not call the
# run a pass. On the GPU machine, `timeout 470 scripts/gpu-test.sh` once left a report saying "PASSED".
# Two ways in: a time limit's SIGTERM to the whole process group, and a SIGTERM to the script alone.
# Usage: gpu_test_verdict_test.sh REPO
set -euo pipefail
repo=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
mkdir -p "$work/build" "$work/bin"
echo "NORMUON_BUILD_FAST_CPU:BOOL=ON" >"$work/build/CMakeCache.txt"
printf '#!/bin/sh\nexit 0\n' >"$work/build/normuon"
# A ctest that says it started, then hangs: the signal arrives while it runs.
printf '#!/bin/sh\ntouch "%s/started"\nsleep 60\n' "$work" >"$work/bin/ctest"
chmod +x "$work/build/normuon" "$work/bin/ctest"

check() {  # check HOW RC SECONDS REPORT
  ((${2} != 0 && ${2} != 77)) || fail "$1: gpu-test.sh exited $2 (0 = passed, 77 = passed without a GPU)"
  (($3 < 20)) || fail "$1: gpu-test.sh took $3 s to stop (its step hangs for 60 s)"
  grep -q "stopped early" "$4" || fail "$1: the report does not say the run stopped early: $(tail -5 "$4")"
  ! grep -q "PASSED" "$4" || fail "$1: the report says PASSED"
  echo "$1: exit $2 after $3 s, reported as stopped early"
}
started() {  # waits up to 10 s for the fake ctest
  for _ in $(seq 100); do [ -e "$work/started" ] && return 0; sleep 0.1; done
  cat "$work/out.log"
  fail "the fake ctest never started"
}
export PATH="$work/bin:$PATH"
args=(--skip-build --build-dir "$work/build")

# 1. the process group, as `timeout` signals it
t0=$SECONDS
rc=0
timeout -s TERM 3 "$repo/scripts/gpu-test.sh" "${args[@]}" --report "$work/group.md" >"$work/out.log" 2>&1 || rc=$?
started
check "SIGTERM to the process group" "$rc" $((SECONDS - t0)) "$work/group.md"

# 2. the script alone
rm -f "$work/started"
t0=$SECONDS
"$repo/scripts/gpu-test.sh" "${args[@]}" --report "$work/script.md" >"$work/out.log" 2>&1 &
pid=$!
started
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
check "SIGTERM to the script" "$rc" $((SECONDS - t0)) "$work/script.md"

# 3. a step that fails, and one that outlives its --step-timeout: each recorded with why (the step's exit
# status was lost under the script's errexit, and a timed-out step read "failed (exit )")
rm -f "$work/started"
printf '#!/bin/sh\nexit 0\n' >"$work/bin/ctest"
# (answers the script's own "python -c" questions; the step itself fails)
printf '#!/bin/sh\n[ "$1" = -c ] && { echo "$0"; exit 0; }\necho "no pytest here" >&2\nexit 3\n' >"$work/bin/python3"
chmod +x "$work/bin/ctest" "$work/bin/python3"
mkdir -p "$work/build/python/normuon"
touch "$work/build/python/normuon/__init__.py" "$work/build/python/normuon/_C.so"
rc=0
"$repo/scripts/gpu-test.sh" "${args[@]}" --report "$work/failed.md" --python "$work/bin/python3" >"$work/out.log" 2>&1 || rc=$?
((rc == 1)) || fail "a failed step: gpu-test.sh exited $rc, not 1"
grep -q "| python CUDA tests | failed (exit 3) |" "$work/failed.md" ||
  fail "a failed step is not recorded with its exit status: $(grep 'python CUDA tests |' "$work/failed.md")"
printf '#!/bin/sh\n[ "$1" = -c ] && { echo "$0"; exit 0; }\nsleep 30\n' >"$work/bin/python3"
rc=0
"$repo/scripts/gpu-test.sh" "${args[@]}" --report "$work/slow.md" --python "$work/bin/python3" --step-timeout 2 \
  >"$work/out.log" 2>&1 || rc=$?
grep -q "| python CUDA tests | failed (timed out after 2 s) |" "$work/slow.md" ||
  fail "a timed-out step is not recorded as such: $(grep 'python CUDA tests |' "$work/slow.md")"
echo "a failed step and a timed-out one: recorded with why"
