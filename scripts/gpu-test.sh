#!/usr/bin/env bash
# Builds normuon with its tests on a GPU machine that has only the CUDA toolkit, CMake, ninja, a pip
# torch and pip's pybind11 (plus the Debian packages staged by `scripts/gpu-bench.sh --stage-deps`), then
# runs the CUDA tests and the GPU checks of the tool, writing everything it prints, with an outcome
# table, to bench/results/gpu-tests-<device>-<date>.md. A failing step is recorded and the later steps
# still run.
#
#   scripts/gpu-test.sh [options]
set -euo pipefail
invoked_from=$PWD  # a relative --stage-deps folder is the caller's, not the repository's
cd "$(dirname "$0")/.."
repo=$(pwd)
script=gpu-test
# shellcheck source=scripts/gpu-common.sh
. scripts/gpu-common.sh

usage() {
  cat <<'EOF'
usage: scripts/gpu-test.sh [options]

Configures a build folder with the tests, the CUDA backend, the reference (the pip torch's libtorch),
the Python module (with a private libstdc++) and, with --fast-cpu on, the fast CPU backend; builds it; then
  1. ctest --output-on-failure -R "cuda|simt|ns_gemm|python|selector|golden|compare"
  2. pytest python/tests/test_cuda.py (the Python CUDA tests, run again to see that none was skipped)
  3. normuon compare --device cuda --preset tiny --steps 50
  4. normuon compare --device cuda --candidate reference --preset tiny --steps 10
  5. normuon golden verify --device cuda: --exact with --backend reference (the CUDA reference computes the
     CPU reference's bits), --cross-platform with --backend fast (the golden trace within the bounds for
     another platform's GEMM rounding: docs/golden.md)
Everything printed goes to the report, bench/results/gpu-tests-<device>-<date>.md, which ends with a
table of the steps and their outcomes. On a GPU machine a test that skips counts as failed.

Without a GPU it builds and runs the tests that need none (the GPU tests report themselves skipped),
skips steps 3-5 saying why, writes the report into the build folder instead, and exits with 77.
Without the fast CPU backend the Python suite's CPU tests cannot pass, so ctest leaves python_tests out
and only step 2 runs Python.

options:
  --build-dir DIR     build folder (default: build-gpu)
  --deps DIR          the prefix made by --stage-deps (default: ./.gpu-deps when it exists)
  --torch-dir DIR     torch's CMake prefix (default: PYTHON -c 'import torch; print(torch.utils.cmake_prefix_path)')
  --python PYTHON     the interpreter with torch and pytest, built for and tested with (default: python3)
  --cuda-arch LIST    CMAKE_CUDA_ARCHITECTURES (default: the visible GPU's, e.g. 90-real; else the project's list)
  --fast-cpu on|off   build the fast CPU backend (default: off; on needs oneDNN here or staged)
  --jobs N            build jobs (default: nproc)
  --targets "T T.."   build only these targets (default: everything; a device call builds what it runs)
  --ctest-jobs N      tests run at once (default: 4)
  --ctest-regex RE    which CTest tests (default: "cuda|simt|ns_gemm|python|selector|golden|compare"; "." for all)
  --test-timeout S    seconds one CTest test may run before it counts as failed (default: 300)
  --step-timeout S    seconds a step other than the build and ctest may run before it is stopped and counts
                      as failed (default: 600)
  --report FILE       the report (default: bench/results/gpu-tests-<device>-<date>.md; without a GPU
                      BUILD-DIR/gpu-tests-nogpu-<date>.md)
  --build-only        configure and build, run nothing (a later --skip-build run appends to the same report)
  --skip-build        use what the build folder holds; append to the report when it exists
  --stage-deps DIR    as scripts/gpu-bench.sh --stage-deps (on a Debian machine; --no-onednn leaves oneDNN out)
  --no-onednn         with --stage-deps: leave oneDNN out
  -h, --help          this text

exit status: 0 when every step passed on a GPU (with --build-only: when the build passed), 77 when
every step that could run passed but there is no GPU, 1 otherwise (setup failures included).
EOF
}

build_dir=build-gpu
deps=""
torch_dir=""
python=python3
cuda_arch=""
fast_cpu=""
jobs=$(nproc 2>/dev/null || echo 4)
ctest_jobs=4
ctest_regex="cuda|simt|ns_gemm|python|selector|golden|compare"
test_timeout=300
step_timeout=600
report=""
targets=""
build_only=0
skip_build=0
stage_dir=""
stage_onednn=1
args=("$@")
while (($#)); do
  case "$1" in
    --build-dir) build_dir=${2:?--build-dir needs a value}; shift 2 ;;
    --deps) deps=${2:?--deps needs a value}; shift 2 ;;
    --torch-dir) torch_dir=${2:?--torch-dir needs a value}; shift 2 ;;
    --python) python=${2:?--python needs a value}; shift 2 ;;
    --cuda-arch) cuda_arch=${2:?--cuda-arch needs a value}; shift 2 ;;
    --fast-cpu) fast_cpu=${2:?--fast-cpu needs on or off}; shift 2 ;;
    --jobs) jobs=${2:?--jobs needs a value}; shift 2 ;;
    --targets) targets=${2:?--targets needs a list}; shift 2 ;;
    --ctest-jobs) ctest_jobs=${2:?--ctest-jobs needs a value}; shift 2 ;;
    --ctest-regex) ctest_regex=${2:?--ctest-regex needs a value}; shift 2 ;;
    --report) report=${2:?--report needs a file}; shift 2 ;;
    --test-timeout) test_timeout=${2:?--test-timeout needs seconds}; shift 2 ;;
    --step-timeout) step_timeout=${2:?--step-timeout needs seconds}; shift 2 ;;
    --build-only) build_only=1; shift ;;
    --skip-build) skip_build=1; shift ;;
    --stage-deps) stage_dir=${2:?--stage-deps needs a folder}; shift 2 ;;
    --no-onednn) stage_onednn=0; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; die "unknown option '$1'" ;;
  esac
done
if [ -n "$stage_dir" ]; then
  stage_deps "$stage_dir" "$stage_onednn"
  exit 0
fi
((!(build_only && skip_build))) || die "--build-only and --skip-build exclude each other"
case "$fast_cpu" in "" | on | off) ;; *) die "--fast-cpu takes on or off" ;; esac

# ---- the GPU, the report
gpu_reason=""
gpu_name=""
if ! command -v nvidia-smi >/dev/null 2>&1; then
  gpu_reason="nvidia-smi not found"
elif ! gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) || [ -z "$gpu_name" ]; then
  gpu_reason="nvidia-smi lists no GPU"
  gpu_name=""
fi
date=$(date -u +%Y-%m-%d)
mkdir -p "$build_dir"
build_dir=$(cd "$build_dir" && pwd)
tool=$build_dir/normuon
if [ -z "$report" ]; then
  if [ -n "$gpu_name" ]; then
    slug=$(tr '[:upper:]' '[:lower:]' <<<"$gpu_name" | sed -E 's/[^a-z0-9]+/-/g; s/^-//; s/-$//')
    report=bench/results/gpu-tests-$slug-$date.md
  else
    report=$build_dir/gpu-tests-nogpu-$date.md
  fi
fi
mkdir -p "$(dirname "$report")"
append=0
if ((skip_build)) && [ -f "$report" ]; then append=1; fi
((append)) || : >"$report"
command_line=scripts/gpu-test.sh
((${#args[@]} == 0)) || command_line+=$(printf ' %q' "${args[@]}")
{
  if ((append)); then
    printf '\n## Run of %s\n\n' "$(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  else
    printf '# GPU tests: %s, %s\n\n' "${gpu_name:-no GPU ($gpu_reason)}" "$date"
    printf 'Written by scripts/gpu-test.sh: the transcript of every command, then the outcome table.\n\n'
    printf '## Run of %s\n\n' "$(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  fi
  printf -- '- command: %s\n' "$command_line"
  printf -- '- machine: %s, %s CPUs\n' "$(uname -srm)" "$(nproc 2>/dev/null || echo '?')"
  if [ -n "$gpu_name" ]; then
    printf -- '- GPU: %s\n' "$(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>/dev/null | head -1)"
  else
    printf -- '- GPU: none (%s)\n' "$gpu_reason"
  fi
  printf '\n```text\n'
} >>"$report"
# From here on everything printed also goes to the report.
exec 3>&1 4>&2
# The writer ignores the signals that stop the script, so the verdict still reaches the report.
exec > >(trap '' TERM INT HUP; exec tee -a "$report") 2>&1
tee_pid=$!

step_names=()
step_outcomes=()
step_seconds=()
step_commands=()
failures=0
step_log=$(mktemp)
finished=0
record() {  # record NAME OUTCOME SECONDS COMMAND
  step_names+=("$1")
  step_outcomes+=("$2")
  step_seconds+=("$3")
  step_commands+=("$4")
  case "$2" in passed* | skipped*) ;; *) failures=$((failures + 1)) ;; esac
  say "<== $1: $2 (${3} s)"
}
step_pidfile=""
step() {  # [STEP_LIMIT=S] step NAME CMD...: shows and runs CMD, keeps its output in $step_log, sets step_rc
  # and step_limit; never stops the script. STEP_LIMIT (default --step-timeout; 0 = none) bounds the step.
  local name=$1 t0 rc_file
  shift
  step_limit=${STEP_LIMIT:-$step_timeout}
  printf '\n'
  say "==> $name"
  printf '$'
  printf ' %q' "$@"
  printf '\n'
  t0=$SECONDS
  rc_file=$(mktemp)
  # A hung step (a deadlocked test, a wedged GPU) is stopped and recorded instead of stalling the run. The
  # step runs in the background: a signal to the script interrupts `wait` at once (a foreground step
  # would hold the trap until it ended), and the trap stops the step through the pid in step_pidfile
  # (timeout puts the step in a process group of its own, which a signal to the script's group misses).
  step_pidfile=$(mktemp)
  # (The status is taken with `||`: under the script's errexit a bare failing `wait` ended the group before
  # the status was written, and every failed step read "failed (exit )", a timed-out one too.)
  { timeout --kill-after=10 "$step_limit" "$@" 2>&1 & echo $! >"$step_pidfile"; rc=0; wait $! || rc=$?
    echo "$rc" >"$rc_file"; } | tee "$step_log" &
  wait $! || true
  step_rc=$(cat "$rc_file" 2>/dev/null || true)
  step_rc=${step_rc:-1}  # (no status written: the step was ended by a signal)
  rm -f "$rc_file" "$step_pidfile"
  step_pidfile=""
  step_time=$((SECONDS - t0))
}
outcome() {  # outcome RC: passed | failed (exit RC) | failed (timed out ...), for the last step
  if (($1 == 0)); then
    echo passed
  elif (($1 == 124 || $1 == 137)) && ((step_limit > 0 && step_time >= step_limit)); then
    echo "failed (timed out after $step_limit s)"
  else
    echo "failed (exit $1)"
  fi
}
finish() {
  local rc=$? i verdict
  if ((finished)); then return; fi
  finished=1
  trap - EXIT
  ((rc == 0)) || ((failures)) || { record "script" "failed (stopped early, exit $rc)" 0 "scripts/gpu-test.sh"; }
  if ((failures)); then
    rc=1
    verdict="FAILED: $failures step(s) failed"
  elif ((build_only)); then
    rc=0
    verdict="built"
  elif [ -n "$gpu_reason" ]; then
    rc=77
    verdict="no GPU ($gpu_reason): every step that could run passed, the GPU steps were skipped"
  else
    rc=0
    verdict="PASSED: every step passed on $gpu_name"
  fi
  exec 1>&3 2>&4 3>&- 4>&-
  wait "$tee_pid" 2>/dev/null || sleep 1
  {
    printf '```\n\n### Outcome\n\n| step | outcome | seconds | command |\n|---|---|---|---|\n'
    for i in "${!step_names[@]}"; do
      # shellcheck disable=SC2016  # markdown code spans, not expansions
      printf '| %s | %s | %s | `%s` |\n' "${step_names[$i]}" "${step_outcomes[$i]}" "${step_seconds[$i]}" \
        "${step_commands[$i]//|/\\|}"
    done
    printf '\n**%s** (exit status %s)\n' "$verdict" "$rc"
  } | tee -a "$report"
  say "report: $report"
  rm -f "$step_log"
  exit "$rc"
}
trap finish EXIT
# Killed from outside (a time limit's SIGTERM): the verdict must say so, not report the steps so far as a pass.
stop() {  # the TERM/INT/HUP trap: end the running step's process group, then finish
  local pid
  pid=$(cat "$step_pidfile" 2>/dev/null || true)
  # timeout leads a process group of its own: end all of it, grandchildren too.
  [ -z "$pid" ] || kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  exit "$1"
}
trap 'stop 143' TERM
trap 'stop 130' INT
trap 'stop 129' HUP

# ---- the machine and what the build needs
print_machine
[ -z "$gpu_reason" ] || say "no GPU: $gpu_reason (the GPU steps will be skipped)"
resolve_deps
say "staged prefix: ${deps:-none}"
python_exe=$("$python" -c 'import sys; print(sys.executable)' 2>/dev/null) || die "$python does not run (--python PYTHON)"
say "python: $python_exe ($("$python_exe" --version 2>&1))"

if ((!skip_build)); then
  command -v cmake >/dev/null 2>&1 || die "cmake not found"
  say "$(cmake --version | head -1)"
  find_nvcc
  find_torch
  pick_fast_cpu
  check_required_deps || die "the build's required libraries are missing (above)"
  [ -n "$(boost_config_dir)" ] || have_header boost/test/unit_test.hpp ||
    die "no Boost.Test (boost/test/unit_test.hpp) here or staged: stage it with scripts/gpu-bench.sh --stage-deps on a Debian machine with libboost-test-dev"
  say "fast CPU backend: $fast_cpu (oneDNN${onednn_prefix:+, staged: $onednn_prefix})"
  pick_cuda_arch

  # The Python module: pip's pybind11 and the interpreter's headers.
  python_build=ON
  python_why=""
  pybind11_dir=$("$python_exe" -m pybind11 --cmakedir 2>/dev/null) || pybind11_dir=""
  if [ -z "$pybind11_dir" ]; then
    for d in /usr/lib/cmake/pybind11 /usr/share/cmake/pybind11 /usr/local/lib/cmake/pybind11 /usr/local/share/cmake/pybind11; do
      [ -f "$d/pybind11Config.cmake" ] && pybind11_dir=$d && break
    done
  fi
  [ -n "$pybind11_dir" ] || python_why="no pybind11 ($python_exe -m pybind11 fails, no pybind11Config.cmake)"
  py_include=$("$python_exe" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null || true)
  [ -f "$py_include/Python.h" ] || python_why="${python_why:+$python_why; }no Python.h for $python_exe (looked in ${py_include:-?})"
  if [ -n "$python_why" ]; then
    python_build=OFF
    record "python module" "failed ($python_why)" 0 "-DNORMUON_BUILD_PYTHON=OFF"
  else
    say "pybind11: $pybind11_dir"
  fi

  base_cmake_args
  cmake_args+=(-DNORMUON_BUILD_TESTS=ON "-DNORMUON_BUILD_PYTHON=$python_build" "-DPYTHON_EXECUTABLE=$python_exe"
    -DNORMUON_PYTHON_PRIVATE_LIBSTDCXX=ON)  # else normuon._C crashes beside pip torch (python/CMakeLists.txt)
  [ -z "$pybind11_dir" ] || cmake_args+=("-Dpybind11_DIR=$pybind11_dir")
  step configure cmake "${cmake_args[@]}"
  record configure "$(outcome "$step_rc")" "$step_time" "cmake ${cmake_args[*]}"
  if ((step_rc == 0)); then
    keep_going=()
    [ ! -f "$build_dir/build.ninja" ] || keep_going=(-- -k 0)  # build all it can; the failures are in the log
    target_args=()
    # shellcheck disable=SC2206  # a space-separated list of target names
    [ -z "$targets" ] || target_args=(--target $targets)
    STEP_LIMIT=0 step build cmake --build "$build_dir" -j "$jobs" ${target_args[@]+"${target_args[@]}"} \
      ${keep_going[@]+"${keep_going[@]}"}
    record build "$(outcome "$step_rc")" "$step_time" "cmake --build $build_dir -j $jobs${targets:+ --target $targets}"
  else
    record build "failed (not run: configure failed)" 0 "cmake --build $build_dir"
  fi
fi
((!build_only)) || exit 0

# ---- the tests
[ -f "$build_dir/CMakeCache.txt" ] || die "$build_dir is not configured (run without --skip-build)"
fast_cpu_built=$(sed -n 's/^NORMUON_BUILD_FAST_CPU:BOOL=//p' "$build_dir/CMakeCache.txt")
deps_runtime_env
if [ -x "$tool" ]; then
  t0=$SECONDS
  if ensure_starts "$tool" bench-cuda --help; then
    record "tool starts" passed $((SECONDS - t0)) "LD_BIND_NOW=1 $tool bench-cuda --help"
  else
    record "tool starts" "failed" $((SECONDS - t0)) "LD_BIND_NOW=1 $tool bench-cuda --help"
  fi
else
  record "tool starts" "failed (not built)" 0 "$tool"
fi

ctest_args=(ctest --test-dir "$build_dir" --output-on-failure --no-tests=error -j "$ctest_jobs" --timeout "$test_timeout"
  -R "$ctest_regex")
if [ "$fast_cpu_built" != ON ]; then
  say "no fast CPU backend in this build: the Python suite's CPU tests cannot pass, so python_tests is left out (step 'python CUDA tests' runs test_cuda.py)"
  ctest_args+=(-E '^python_tests$')
fi
STEP_LIMIT=0 step ctest "${ctest_args[@]}"  # each test has --test-timeout
result=$(outcome "$step_rc")
if ((step_rc == 0)) && [ -z "$gpu_reason" ] && grep -q '\*\*\*Skipped' "$step_log"; then
  result="failed (a test skipped on a GPU machine: $(grep '\*\*\*Skipped' "$step_log" | awk '{print $4}' | paste -sd' ' -))"
fi
record ctest "$result" "$step_time" "${ctest_args[*]}"

if [ -f "$build_dir/python/normuon/__init__.py" ] && compgen -G "$build_dir/python/normuon/_C*.so" >/dev/null; then
  step "python CUDA tests" env PYTHONPATH="$build_dir/python" PYTHONDONTWRITEBYTECODE=1 NORMUON_PY_REQUIRE_NATIVE=1 \
    NORMUON_CLI="$tool" "$python_exe" -m pytest -q -p no:cacheprovider -rs python/tests/test_cuda.py
  result=$(outcome "$step_rc")
  if ((step_rc == 0)) && [ -z "$gpu_reason" ] && grep -Eq '[0-9]+ skipped' "$step_log"; then
    result="failed (tests skipped on a GPU machine, see the SKIPPED lines)"
  fi
  record "python CUDA tests" "$result" "$step_time" "pytest python/tests/test_cuda.py"
else
  record "python CUDA tests" "failed (no Python module built)" 0 "pytest python/tests/test_cuda.py"
fi

gpu_step() {  # gpu_step NAME ARGS...: a step of the tool that needs the GPU
  local name=$1
  shift
  if [ -n "$gpu_reason" ]; then
    say "skipped: $name (no GPU: $gpu_reason)"
    record "$name" "skipped (no GPU)" 0 "normuon $*"
  elif [ ! -x "$tool" ]; then
    record "$name" "failed (no tool)" 0 "normuon $*"
  else
    step "$name" "$tool" "$@"
    record "$name" "$(outcome "$step_rc")" "$step_time" "normuon $*"
  fi
}
gpu_step "compare fast-cuda" compare --device cuda --preset tiny --steps 50
gpu_step "compare reference-cuda" compare --device cuda --candidate reference --preset tiny --steps 10
gpu_step "golden reference-cuda" golden verify --exact --backend reference --device cuda
gpu_step "golden reference-cuda gram" golden verify --exact --backend reference --device cuda \
  --set normuon.ns_algorithm=gram --file golden/tiny-gram.csv
gpu_step "golden fast-cuda" golden verify --cross-platform --backend fast --device cuda
