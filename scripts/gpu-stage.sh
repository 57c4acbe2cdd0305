#!/usr/bin/env bash
# Stages, on this (Debian, networked) machine, what a GPU device call carries because the GPU machine has no
# apt and no network: the build's libraries (.gpu-deps), the Python wheels the peers and Megatron need
# (.whl), and the peers' sources (.official: the official NorMuon, microsoft/dion's NorMuon). Then checks that
# the working tree and the carried folders fit a call's 64 MiB. See --help; docs/fast-cuda.md, "A GPU session".
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'USAGE'
usage: scripts/gpu-stage.sh [--check] [--megatron-core VERSION]

  .gpu-deps   scripts/gpu-test.sh --stage-deps .gpu-deps --no-onednn (libcsv, nlohmann_json, zlib,
              Boost.Test: the GPU build leaves the fast CPU backend out)
  .whl        pip download (Python 3.12, manylinux x86-64, no dependencies) of megatron-core VERSION
              (default 0.19.0) and emerging-optimizers 0.3.0
  .official   normuon.py (github zichongli5/NorMuon) and dion/ (github microsoft/dion: its NorMuon and what
              it imports), copied in by hand from their repositories (this script downloads no source)
  .megatron-lm  pretrain_gpt.py, gpt_builders.py and model_provider.py of Megatron-LM's tag core_vVERSION
              (the wheel's release; the wheel holds megatron.core and megatron.training), copied in by hand

--check: stage nothing, only report what is there and the sizes.
The total of what travels (the tracked and untracked-not-ignored files, plus the carried folders) must stay
under 64 MiB; exit status 1 when it does not, or when something is missing.
USAGE
}

check=0
megatron=0.19.0
while (($#)); do
  case "$1" in
    --check) check=1; shift ;;
    --megatron-core) megatron=${2:?--megatron-core needs a version}; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; echo "gpu-stage: unknown option '$1'" >&2; exit 2 ;;
  esac
done
say() { echo "gpu-stage: $*"; }

if ((!check)); then
  scripts/gpu-test.sh --stage-deps .gpu-deps --no-onednn
  mkdir -p .whl
  for spec in "megatron-core==$megatron" "emerging-optimizers==0.3.0"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d .whl "$spec"
  done
fi

missing=0
for need in .gpu-deps ".whl/megatron_core-$megatron-*.whl" .official/normuon.py .official/dion .megatron-lm/pretrain_gpt.py; do
  # shellcheck disable=SC2086  # the glob is meant
  if compgen -G "$need" >/dev/null; then say "have $(ls -d $need | head -1)"; else say "MISSING: $need"; missing=1; fi
done
# What travels: the files git would list (tracked, and untracked but not ignored), and the carried folders.
tree=$( (git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null || true) |
  tail -1 | cut -f1)
carried=$( (du -cb .gpu-deps .whl .official .megatron-lm 2>/dev/null || true) | tail -1 | cut -f1)
total=$((tree + carried))
say "working tree $((tree / 1024)) KiB + carried $((carried / 1024)) KiB = $((total / 1048576)) MiB of 64"
if ((total >= 64 * 1048576)); then
  say "too large for one call: carry less"
  exit 1
fi
exit "$missing"
