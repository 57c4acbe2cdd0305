#!/usr/bin/env bash
# One device call's worth of GPU work, in the order that pays: build, the CUDA tests, the C++ benchmark,
# the peers, a real Megatron-LM run. Each phase has a time box, so a slow one cannot take the others'
# time, and everything lands in one output folder (the device call's $OUT). See --help.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'USAGE'
usage: scripts/gpu-session.sh [options]

Runs on a GPU machine, one phase after another, each bounded by its share of --budget:
  build     scripts/gpu-test.sh --build-only (build-gpu: CUDA backend, reference on pip torch, tests,
            the Python module with a private libstdc++)
  tests     scripts/gpu-test.sh --skip-build (the CUDA CTest suites, test_cuda.py, compare, golden)
  bench     scripts/gpu-bench.sh --skip-build over --bench-presets
  ns        normuon bench-cuda on gpt-1.3b, ns_algorithm standard and gram, each with the backend's
            panels and with full products (--ns-panel-width 1048576): Newton-Schulz's rates against
            the GEMM rate (issue 15's bars) and what the symmetric panels save, side by side
            (not in the default list: --phases build,ns)
  peers     bench/gpu_peers.py over --peer-presets (needs .official/normuon.py and, for the emerging
            peer, .whl/emerging_optimizers-*.whl)
  megatron  bench/megatron_gpt.py --optimizers adam,normuon (needs .whl/megatron_core-*.whl)
Wheels in .whl/ are installed into /tmp/site first. Everything is written under --out; the last lines
printed are a summary. Carry .gpu-deps, .whl and .official in the device call.

options:
  --out DIR              where the reports go (default: $OUT when set, else build-gpu/session)
  --phases LIST          comma list of phases (default: build,tests,bench,peers,megatron)
  --budget S             seconds for the whole run (default: 560)
  --bench-presets "P.."  (default: "gpt-1.3b moe-8x64")
  --peer-presets P,P     (default: moe-8x64,gpt-1.3b)
  -h, --help             this text
exit status: 0 when every phase ran to its end (whatever it measured), 1 otherwise.
USAGE
}

out=${OUT:-build-gpu/session}
phases=build,tests,bench,peers,megatron
budget=560
bench_presets="gpt-1.3b moe-8x64"
peer_presets=moe-8x64,gpt-1.3b
while (($#)); do
  case "$1" in
    --out) out=${2:?--out needs a folder}; shift 2 ;;
    --phases) phases=${2:?--phases needs a list}; shift 2 ;;
    --budget) budget=${2:?--budget needs seconds}; shift 2 ;;
    --bench-presets) bench_presets=${2:?}; shift 2 ;;
    --peer-presets) peer_presets=${2:?}; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; echo "gpu-session: unknown option '$1'" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
log=$out/session.log
summary=()
failed=0
export PYTHONUNBUFFERED=1
say() { echo "gpu-session [$SECONDS s]: $*" | tee -a "$log"; }
wants() { [[ ",$phases," == *",$1,"* ]]; }
left() { echo $((budget - SECONDS)); }
phase() {  # phase NAME SHARE CMD...: runs CMD for at most SHARE seconds (and what is left of the budget)
  local name=$1 share=$2 limit rc
  shift 2
  limit=$(left)
  ((share < limit)) && limit=$share
  if ((limit < 20)); then
    summary+=("$name: not run (budget spent)")
    failed=1
    return
  fi
  say "$name: up to $limit s: $*"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  case $rc in
    0) summary+=("$name: done") ;;
    124 | 137) summary+=("$name: stopped at its $limit s limit"); failed=1 ;;
    *) summary+=("$name: exit $rc"); failed=1 ;;
  esac
  say "$name: exit $rc"
}

if wants build; then
  phase build 150 scripts/gpu-test.sh --build-only --report "$out/gpu-tests.md"
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >>"$log" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
wants tests && phase tests 150 scripts/gpu-test.sh --skip-build --report "$out/gpu-tests.md" --test-timeout 120 \
  --step-timeout 90 --ctest-regex "fast_cuda|reference_cuda|cuda_plan|ns_gemm|simt"
wants bench && phase bench 240 scripts/gpu-bench.sh --skip-build --build-dir build-gpu --presets "$bench_presets" \
  --results "$out"
if wants ns; then  # four runs in one phase, each its own report (gpu-ns-<algorithm>-<panels>.md)
  phase ns 240 bash -c 'for a in standard gram; do for w in 0 1048576; do
      p=$([ "$w" = 0 ] && echo panels || echo full)
      build-gpu/normuon bench-cuda --preset gpt-1.3b --set ns_algorithm=$a --ns-panel-width $w --no-reference \
        --warmup 2 --repeats 5 --markdown "$1/gpu-ns-$a-$p.md" --csv "$1/gpu-ns-$a-$p.csv" || exit 1
    done; done' ns "$out"
fi
wants peers && phase peers 200 env PYTHONPATH="build-gpu/python:${PYTHONPATH:-}" python3 bench/gpu_peers.py \
  --cli build-gpu/normuon --preset "$peer_presets" --profile-steps 1 --markdown "$out/peers.md" --csv "$out/peers.csv"
wants megatron && phase megatron 200 env PYTHONPATH="build-gpu/python:${PYTHONPATH:-}" python3 bench/megatron_gpt.py \
  --optimizers adam,normuon --distributed-optimizer off --time-budget 170 --json "$out/megatron.json" \
  --markdown "$out/megatron.md"

grep -E "^\| " "$out/gpu-tests.md" 2>/dev/null | tail -8
printf '%s\n' "${summary[@]}" | tee -a "$log"
exit "$failed"
