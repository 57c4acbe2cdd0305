#!/usr/bin/env bash
# Cross-builds normuon's CPU library and tests for aarch64 (Arm64 Linux, like NVIDIA GB10's CPU) with
# Debian's cross toolchain and arm64 packages, runs the core, reference and golden tests under qemu-user,
# and writes the outcome to bench/results/aarch64-<date>.md. On demand, not part of CI. Run with --help.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
usage: scripts/cross-aarch64.sh [options]

Cross-builds normuon for aarch64 and runs its CPU tests under qemu-aarch64 (user-mode emulation):
  1. installs what is missing (Debian, as root): the arm64 architecture, g++-aarch64-linux-gnu,
     qemu-user and the arm64 -dev packages that install beside the amd64 ones (multiarch);
  2. unpacks the arm64 packages that cannot be installed beside their amd64 versions (libtorch-dev,
     libdnnl-dev and what they pull in) into a private sysroot, BUILD_DIR/sysroot, without dpkg;
  3. configures BUILD_DIR with scripts/aarch64-toolchain.cmake and Ninja and builds the tests and the
     normuon tool (nice -n 19, one job);
  4. runs the core tests (test_options test_manifest test_layout test_state_file test_grad_gen), the
     reference tests (test_reference_invariants test_spec_gemm) and, with --test-golden, test_golden,
     then `normuon golden verify --exact` against golden/tiny.csv and golden/tiny-gram.csv (the files
     made on x86: the reference's bits must follow from the spec alone), and the fast backend's
     `golden verify --backend fast --cross-platform` against golden/tiny.csv;
  5. prints a summary and writes bench/results/aarch64-YYYY-MM-DD.md.

options:
  --golden-steps N   steps that `golden verify` checks (default 20, the whole file; on a 2-core
                     Xeon a step takes about 60 s under qemu for tiny.csv, 30 s for tiny-gram.csv)
  --test-golden      also run test_golden (17 full reference runs, hours under qemu)
  --no-fast          build without the fast CPU backend (oneDNN); by default it is built and checked
                     against golden/tiny.csv with --cross-platform (about 40 s a step under qemu)
  --no-install       install nothing; fail if something is missing
  --build-dir DIR    build directory (default build-aarch64)
  --results FILE     results file (default bench/results/aarch64-YYYY-MM-DD.md)
  --timeout S        time limit for each test and golden check, in seconds (default 3600)
  --threads N        OMP_NUM_THREADS for the emulated programs (default: the number of cores)
  -h, --help         this text
EOF
}

script_args=("$@")
golden_steps=20
test_golden=0
fast=ON
install=1
build_dir=build-aarch64
results=""
timeout_s=3600
threads=$(nproc)
while (($#)); do
  case "$1" in
    --golden-steps) golden_steps=$2; shift ;;
    --test-golden) test_golden=1 ;;
    --no-fast) fast=OFF ;;
    --no-install) install=0 ;;
    --build-dir) build_dir=$2; shift ;;
    --results) results=$2; shift ;;
    --timeout) timeout_s=$2; shift ;;
    --threads) threads=$2; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "cross-aarch64: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ $golden_steps =~ ^[0-9]+$ && $golden_steps -ge 1 && $golden_steps -le 20 ]] ||
  { echo "cross-aarch64: --golden-steps takes 1 to 20" >&2; exit 2; }

date_iso=$(date -u +%F)
results=${results:-bench/results/aarch64-$date_iso.md}
mkdir -p "$build_dir"
build_abs=$(cd "$build_dir" && pwd)
sysroot=$build_abs/sysroot  # absolute: the toolchain file and qemu get it
logs=$build_abs/logs
mkdir -p "$logs"
log() { echo "cross-aarch64: $*"; }

# ---------------------------------------------------------------------------------------------------
# 1. Packages. Host tools (amd64), then the arm64 packages that are co-installable with the amd64 ones
# (Multi-Arch: same, identical shared files). libdnnl2 installs beside libdnnl2:amd64, but libdnnl-dev
# does not (its dnnl_config.h differs per architecture), and libtorch-dev, libtorch1.13 and several of
# their libraries are not Multi-Arch at all: installing them would remove the host's libtorch. Those go
# to the private sysroot (step 2).
host_packages=(g++-aarch64-linux-gnu qemu-user cmake ninja-build nlohmann-json3-dev)
arm64_packages=(libboost-test-dev:arm64 libcsv-dev:arm64 zlib1g-dev:arm64 libgomp1:arm64 libdnnl2:arm64)
sysroot_packages=(libtorch-dev libdnnl-dev)  # and their dependencies, arm64, unpacked by step 2

installed() { [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]; }
apt_updated=0
apt_update() { ((apt_updated)) || { log "apt-get update"; nice -n 19 apt-get update -qq; apt_updated=1; }; }

if ! dpkg --print-foreign-architectures | grep -x arm64 >/dev/null; then
  ((install)) || { echo "cross-aarch64: the arm64 architecture is not enabled (dpkg --add-architecture arm64)" >&2; exit 1; }
  log "dpkg --add-architecture arm64"
  dpkg --add-architecture arm64
  apt_update
fi
# The arm64 package lists (apt-get update after the architecture was added).
if ! apt-cache policy libc6:arm64 2>/dev/null | grep 'Candidate: [0-9]' >/dev/null; then
  ((install)) || { echo "cross-aarch64: no arm64 package lists (apt-get update)" >&2; exit 1; }
  apt_update
fi
missing=()
for p in "${host_packages[@]}" "${arm64_packages[@]}"; do installed "$p" || missing+=("$p"); done
if ((${#missing[@]})); then
  ((install)) || { echo "cross-aarch64: missing packages: ${missing[*]}" >&2; exit 1; }
  apt_update
  log "installing ${missing[*]}"
  # (grep without -q in pipelines: -q stops reading, and pipefail then sees the writer's SIGPIPE.)
  # Refuse anything that would remove a package (the host's amd64 libtorch-dev, libdnnl-dev...).
  if apt-get install -s --no-install-recommends "${missing[@]}" | grep '^Remv ' >/dev/null; then
    echo "cross-aarch64: installing ${missing[*]} would remove packages; not doing it:" >&2
    apt-get install -s --no-install-recommends "${missing[@]}" | grep '^Remv ' >&2
    exit 1
  fi
  DEBIAN_FRONTEND=noninteractive nice -n 19 apt-get install -y -qq --no-install-recommends "${missing[@]}" >"$logs/apt-install.log"
fi

# ---------------------------------------------------------------------------------------------------
# 2. The private sysroot. apt, with an empty package status and arm64 as its only architecture, lists
# every package that sysroot_packages need; those not already installed as arm64 packages are downloaded
# and unpacked (dpkg-deb -x) into BUILD_DIR/sysroot. Nothing is registered with dpkg. A stamp with the
# packages' versions makes it run once per set of versions.
apt_arm64=(-q -o "Dir::State::status=$build_dir/apt-empty-status" -o APT::Architecture=arm64
  -o APT::Architectures::=arm64 -o APT::Install-Recommends=false -o APT::Sandbox::User=root)
: >"$build_dir/apt-empty-status"
closure=$(apt-get -s "${apt_arm64[@]}" install "${sysroot_packages[@]}" | awk '/^Inst /{print $2 "=" substr($3, 2)}')
[ -n "$closure" ] || { echo "cross-aarch64: apt found no arm64 packages for ${sysroot_packages[*]}" >&2; exit 1; }
unpack=()
for pv in $closure; do
  # Those installed as arm64 packages are not unpacked again (libc6 and libstdc++6 must not be: their
  # headers would shadow the toolchain's), except libdnnl2, whose file libdnnl-dev's CMake config names.
  if [ "${pv%%=*}" = libdnnl2 ] || ! installed "${pv%%=*}:arm64"; then unpack+=("$pv"); fi
done
stamp=$(printf '%s\n' "${unpack[@]}" | sort)
if [ "$(cat "$sysroot/.unpacked" 2>/dev/null)" != "$stamp" ]; then
  ((install)) || { echo "cross-aarch64: the sysroot $sysroot is missing or out of date" >&2; exit 1; }
  log "downloading ${#unpack[@]} arm64 packages for the sysroot (${sysroot_packages[*]} and their dependencies)"
  mkdir -p "$build_dir/debs"
  (cd "$build_dir/debs" && rm -f ./*.deb && nice -n 19 apt-get download "${apt_arm64[@]}" "${unpack[@]}" >"$logs/apt-download.log")
  log "unpacking them into $sysroot"
  rm -rf "$sysroot"
  mkdir -p "$sysroot"
  for deb in "$build_dir"/debs/*.deb; do nice -n 19 dpkg-deb -x "$deb" "$sysroot"; done
  libdir=$sysroot/usr/lib/aarch64-linux-gnu
  # Absolute links point into the sysroot, not the host (libexpat.so -> /lib/aarch64-linux-gnu/libexpat.so.1).
  while read -r link; do
    target=$(readlink "$link")
    if [[ $target == /* && -e $sysroot$target ]]; then ln -sf "$sysroot$target" "$link"; fi
  done < <(find "$libdir" -maxdepth 1 -xtype l)
  # libblas.so.3 and liblapack.so.3 are alternatives (update-alternatives, which dpkg-deb -x does not run).
  [ -e "$libdir/libblas.so.3" ] || ln -s blas/libblas.so.3 "$libdir/libblas.so.3"
  [ -e "$libdir/liblapack.so.3" ] || ln -s lapack/liblapack.so.3 "$libdir/liblapack.so.3"
  echo "$stamp" >"$sysroot/.unpacked"
fi

# ---------------------------------------------------------------------------------------------------
# 3. Configure and build (one job, lowest priority: the machine is shared).
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)  # what is built: now, not after the run
dirty=""
[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && dirty=" (with uncommitted changes in the working tree)"
targets=(test_options test_manifest test_layout test_state_file test_grad_gen
  test_reference_invariants test_spec_gemm test_golden normuon)
cmake_cmd=(cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release
  -DCMAKE_TOOLCHAIN_FILE=scripts/aarch64-toolchain.cmake -DNORMUON_AARCH64_SYSROOT="$sysroot"
  -DNORMUON_BUILD_REFERENCE=ON -DNORMUON_BUILD_TESTS=ON -DNORMUON_BUILD_FAST_CPU=$fast
  -DNORMUON_BUILD_PYTHON=OFF -DNORMUON_BUILD_CUDA=OFF)
build_cmd=(nice -n 19 cmake --build "$build_dir" -j1 --target "${targets[@]}")
log "configuring $build_dir"
# The toolchain file's settings reach only a new cache (CMAKE_*_LINKER_FLAGS_INIT): start one when it changed.
if [ scripts/aarch64-toolchain.cmake -nt "$build_dir/CMakeCache.txt" ]; then rm -f "$build_dir/CMakeCache.txt"; fi
"${cmake_cmd[@]}" >"$logs/configure.log" 2>&1 || { tail -30 "$logs/configure.log" >&2; exit 1; }
log "building ${targets[*]} (-j1; see $logs/build.log)"
build_t0=$(date +%s)
"${build_cmd[@]}" >"$logs/build.log" 2>&1 || { tail -40 "$logs/build.log" >&2; exit 1; }
build_s=$(($(date +%s) - build_t0))
file "$build_dir/normuon" | grep 'ARM aarch64' >/dev/null || { echo "cross-aarch64: $build_dir/normuon is not an aarch64 executable" >&2; exit 1; }

# ---------------------------------------------------------------------------------------------------
# 4. Run under qemu-aarch64: the cross toolchain's loader (QEMU_LD_PREFIX), and for the guest only a
# library path with the cross toolchain's libc/libstdc++ first, then the private sysroot's libraries.
export QEMU_LD_PREFIX=/usr/aarch64-linux-gnu
guest_ld_path=/usr/aarch64-linux-gnu/lib:$sysroot/usr/lib/aarch64-linux-gnu:$sysroot/lib/aarch64-linux-gnu:$sysroot/usr/lib
qemu=(qemu-aarch64 -L "$QEMU_LD_PREFIX" -E "LD_LIBRARY_PATH=$guest_ld_path" -E "OMP_NUM_THREADS=$threads")

declare -a run_names run_status run_secs run_cmds
# run NAME DIR COMMAND...: runs one emulated program in DIR with the time limit, its output in logs/NAME.log.
run() {
  local name=$1 dir=$2 t0 rc=0
  shift 2
  log "running $name"
  t0=$(date +%s.%N)
  (cd "$dir" && timeout "$timeout_s" nice -n 19 "${qemu[@]}" "$@") >"$logs/$name.log" 2>&1 || rc=$?
  run_names+=("$name")
  run_secs+=("$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b - a}')")
  run_cmds+=("(cd $dir && $(printf '%q ' timeout "$timeout_s" nice -n 19 "${qemu[@]}" "$@"))")
  case $rc in
    0) run_status+=(passed) ;;
    124) run_status+=("timed out after ${timeout_s} s") ;;
    *) run_status+=("FAILED (exit $rc)") ;;
  esac
  log "  $name: ${run_status[-1]} in ${run_secs[-1]} s"
}

tests=(test_options test_manifest test_layout test_state_file test_grad_gen test_reference_invariants test_spec_gemm)
((test_golden)) && tests+=(test_golden)
for t in "${tests[@]}"; do
  # In BUILD_DIR/tests, as CTest runs them (test_golden writes a scratch file there); they find the
  # repository's files by NORMUON_SOURCE_DIR.
  run "$t" "$build_abs/tests" "$build_abs/tests/$t" --report_level=short --color_output=no
done
golden_args=(--exact)
((golden_steps < 20)) && golden_args+=(--steps "$golden_steps")
run golden-tiny . "$build_abs/normuon" golden verify "${golden_args[@]}" --file golden/tiny.csv
run golden-tiny-gram . "$build_abs/normuon" golden verify "${golden_args[@]}" --set normuon.ns_algorithm=gram \
  --file golden/tiny-gram.csv
golden_checks=(golden-tiny golden-tiny-gram)
if [ "$fast" = ON ]; then
  # The fast backend's bf16 GEMMs sum in another order than the spec's chains: not the same bits by design,
  # so the check for it is --cross-platform (docs/golden.md), the one a GPU's kernels take.
  fast_args=(--backend fast --cross-platform)
  ((golden_steps < 20)) && fast_args+=(--steps "$golden_steps")
  run golden-tiny-fast . "$build_abs/normuon" golden verify "${fast_args[@]}" --file golden/tiny.csv
  golden_checks+=(golden-tiny-fast)
fi

# ---------------------------------------------------------------------------------------------------
# 5. Summary and the results file.
passed=0 failed=0
for s in "${run_status[@]}"; do [ "$s" = passed ] && passed=$((passed + 1)) || failed=$((failed + 1)); done
not_run=()
((test_golden)) || not_run+=("test_golden: 17 full 20-step reference runs (and 14 of the fast backend where it is built); hours under qemu on this machine. Run with --test-golden.")
((golden_steps < 20)) && not_run+=("golden verify checked only the first $golden_steps of the 20 steps (--golden-steps $golden_steps).")

pkg_row() {  # | package | arm64 candidate | Multi-Arch | how it got here |
  local p=$1 how=$2 cand ma
  cand=$(apt-cache policy "$p" 2>/dev/null | awk '/Candidate:/{print $2}')
  ma=$(apt-cache show "$p" 2>/dev/null | awk -F': ' '/^Multi-Arch:/{print $2; exit}')
  echo "| $p | ${cand:-none} | ${ma:-no (not co-installable)} | $how |"
}
mkdir -p "$(dirname "$results")"
{
  echo "# aarch64 cross-build under qemu-user, $date_iso"
  echo
  echo "Made by \`scripts/cross-aarch64.sh\`: normuon cross-compiled for aarch64 with Debian's cross toolchain and"
  echo "arm64 packages, its CPU tests run under qemu-aarch64 (user-mode emulation of an Arm64 Linux process)."
  echo
  echo "- date: $(date -u '+%F %T') UTC"
  echo "- host: $(lscpu | awk -F': *' '/^Model name/{print $2; exit}'), $(nproc) cores, $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "- commit: $commit$dirty"
  echo "- compiler: $(aarch64-linux-gnu-g++ --version | head -1)"
  echo "- emulator: $(qemu-aarch64 --version | head -1), its default aarch64 CPU model (no -cpu), OMP_NUM_THREADS=$threads"
  echo "- fast CPU backend (oneDNN): $([ "$fast" = ON ] && echo "built; run by golden-tiny-fast" || echo "not built (--no-fast)")"
  echo "- build: ${build_s} s (-j1, nice 19)"
  echo "- result: $passed passed, $failed failed"
  echo
  echo "## Outcomes"
  echo
  echo "| check | outcome | time (s) |"
  echo "| --- | --- | --- |"
  for i in "${!run_names[@]}"; do echo "| ${run_names[$i]} | ${run_status[$i]} | ${run_secs[$i]} |"; done
  echo
  if ((${#not_run[@]})); then
    echo "Not run:"
    echo
    for n in "${not_run[@]}"; do echo "- $n"; done
    echo
  fi
  echo "## Golden checks (aarch64 against the traces made on x86: the reference exactly, the fast backend within bounds)"
  echo
  echo '```'
  for name in "${golden_checks[@]}"; do
    grep -h -e 'golden check' -e '^  first:' "$logs/$name.log" || tail -3 "$logs/$name.log"
  done
  echo '```'
  echo
  echo "## Test output (Boost.Test summaries and errors; whole logs in $(basename "$build_dir")/logs/)"
  echo
  echo '```'
  for t in "${tests[@]}"; do
    echo "$t: $(sed -n '/^Test module/,/^$/p' "$logs/$t.log" | sed '1d; /^$/d; s/^ *//' | paste -sd ';' | sed 's/;/; /g')"
    grep -h 'error: in' "$logs/$t.log" | sed "s|^$PWD/||; s/^/  /" | head -10 || true
  done
  echo '```'
  echo
  echo "## Packages (Debian bookworm, arm64)"
  echo
  echo "| package | arm64 version | Multi-Arch | here |"
  echo "| --- | --- | --- | --- |"
  for p in "${arm64_packages[@]}"; do pkg_row "$p" "installed (apt, multiarch)"; done
  pkg_row nlohmann-json3-dev "installed (apt; architecture all)"
  pkg_row libdnnl-dev:arm64 "private sysroot: its dnnl_config.h differs from the amd64 one, dpkg refuses both"
  pkg_row libtorch-dev:arm64 "private sysroot: installing it would remove the host's libtorch-dev (amd64)"
  pkg_row libtorch1.13:arm64 "private sysroot: its libraries libpthreadpool0, libxnnpack0, libtensorpipe0, libgloo0, libgflags2.2, libgoogle-glog0v6 (and opencv's libgdal32, libarmadillo11...) are not Multi-Arch"
  echo
  echo "The private sysroot ($(basename "$build_dir")/sysroot): ${#unpack[@]} arm64 packages unpacked with \`dpkg-deb -x\`, not"
  echo "registered with dpkg; the list is $(basename "$build_dir")/sysroot/.unpacked."
  echo
  echo "The emulated programs run with the cross toolchain's loader (QEMU_LD_PREFIX=$QEMU_LD_PREFIX) and a"
  echo "guest LD_LIBRARY_PATH with /usr/aarch64-linux-gnu/lib first: libc, libstdc++ and libgomp are the ones they"
  echo "were linked against, not libc6:arm64's; then the private sysroot's libraries. The times are qemu's (TCG"
  echo "translation on the host), no measure of an Arm processor."
  echo
  echo "## Commands"
  echo
  echo '```'
  echo "scripts/cross-aarch64.sh${script_args[*]:+ ${script_args[*]}}"
  echo "${cmake_cmd[*]}"
  echo "${build_cmd[*]}"
  echo "export QEMU_LD_PREFIX=$QEMU_LD_PREFIX"
  for c in "${run_cmds[@]}"; do echo "$c"; done
  echo '```'
} >"$results"

echo
echo "aarch64 under qemu: $passed passed, $failed failed"
for i in "${!run_names[@]}"; do printf '  %-26s %-24s %8s s\n' "${run_names[$i]}" "${run_status[$i]}" "${run_secs[$i]}"; done
for name in "${golden_checks[@]}"; do grep -h 'golden check' "$logs/$name.log" | sed 's/^/  /' || true; done
echo "results: $results"
((failed == 0))
