#!/usr/bin/env bash
# One device call's worth of GPU work (at most 9 minutes: run's timeout_s 570), in the order that pays:
# build, the CUDA tests, the peers, the Newton-Schulz variants, Megatron. Each phase has a hard time box, so
# a slow one cannot take the later ones' time. Everything is written under a work folder; after every phase
# it is packed into $OUT/session.tar.gz beside at most 7 summary files (a device call returns 8 files), so
# that a call cut short still returns what it did. See --help; docs/fast-cuda.md, "A GPU session".
set -uo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'USAGE'
usage: scripts/gpu-session.sh [options]

The first call (default), each phase bounded by its box and by what is left of --budget:
  build      70 s   scripts/gpu-test.sh --build-only --targets "the tool, _C, _C_cuda, the CUDA test suites"
  tests     120 s   scripts/gpu-test.sh --skip-build: the CUDA CTest suites, pytest test_cuda.py, compare
                    --device cuda, golden verify on CUDA (exact for the reference, --cross-platform for fast)
  peers      90 s   bench/gpu_peers.py --preset moe-8x64: the official NorMuon, NorMuonAdamW (verdict sync and
                    deferred), the C++ step, torch.optim.Muon + fused AdamW, dion's NorMuon
  peers13b   60 s   the same on gpt-1.3b, if the budget has it
  ns         75 s   normuon bench-cuda --no-reference on moe-8x64 and gpt-1.3b: standard and gram, the backend's
                    panels and full products
  megatron  rest    bench/megatron_gpt.py --optimizers normuon: distributed optimizer off and on, each with
                    the bit-for-bit resume check (needs .whl/megatron_core-*.whl)
The second call (--call second), if the first left device time: the machine is still warm for 30 s, so its
build folder is there (else add build):
  diag       ctest -V on the CUDA suites that failed in the first call's report, compute-sanitizer on them
  fsdp2      bench/fsdp2_bench.py --device cuda --world-sizes 1 (issue 27's benchmark on a GPU, NCCL)
  banks      bench/gpu_peers.py --preset moe-8x64 --banks: the experts as 3-D banks (fused-py), as 2-D
             parameters (fused-py-2d) and the official NorMuon on the banks
  ncu        ncu over one bench-cuda step: the update kernel and one Newton-Schulz elementwise kernel
  pretrain   Megatron-LM's own pretrain_gpt.py --use-distributed-optimizer --mock-data
             (bench/megatron_pretrain_gpt.py; needs .megatron-lm/ of the carried wheel's release)

Wheels in .whl/ are installed into /tmp/site first. Carry .gpu-deps, .whl, .official and .megatron-lm in
the call (scripts/gpu-stage.sh makes and checks them).

options:
  --call first|second  which call's phases (default first)
  --phases LIST        comma list of phases instead (e.g. build,tests)
  --out DIR            what comes back: session.tar.gz and the summaries (default: $OUT when set, else
                       build-gpu/session-out)
  --work DIR           where the phases write (default build-gpu/session)
  --build-dir DIR      the build folder (default build-gpu)
  --budget S           seconds for the whole call (default 540)
  --python PYTHON      the interpreter with torch (default python3; here, .venv-torch2/bin/python for a dry run)
  --dry-run            print each phase's box and command as if every phase ran to its box (the worst case),
                       run nothing, pack the (empty) work folder
  -h, --help           this text
exit status: 0 when every phase ran to its end (whatever it measured), 1 otherwise, 2 for bad options.
USAGE
}

out=${OUT:-build-gpu/session-out}
work=build-gpu/session
build_dir=build-gpu
call=first
phases=""
budget=540
python=python3
dry=0
while (($#)); do
  case "$1" in
    --call) call=${2:?--call needs first or second}; shift 2 ;;
    --phases) phases=${2:?--phases needs a list}; shift 2 ;;
    --out) out=${2:?--out needs a folder}; shift 2 ;;
    --work) work=${2:?--work needs a folder}; shift 2 ;;
    --build-dir) build_dir=${2:?--build-dir needs a folder}; shift 2 ;;
    --budget) budget=${2:?--budget needs seconds}; shift 2 ;;
    --python) python=${2:?--python needs an interpreter}; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; echo "gpu-session: unknown option '$1'" >&2; exit 2 ;;
  esac
done
case "$call" in
  first) : "${phases:=build,tests,peers,peers13b,ns,megatron}" ;;
  second) : "${phases:=diag,banks,fsdp2,ncu,pretrain}" ;;
  *) echo "gpu-session: --call takes first or second, not '$call'" >&2; exit 2 ;;
esac
[[ "$budget" =~ ^[0-9]+$ ]] || { echo "gpu-session: --budget takes seconds, not '$budget'" >&2; exit 2; }
known=",build,tests,peers,peers13b,ns,megatron,diag,banks,fsdp2,ncu,pretrain,"
for p in ${phases//,/ }; do
  [[ "$known" == *",$p,"* ]] || { echo "gpu-session: unknown phase '$p' (${known:1:-1})" >&2; exit 2; }
done
mkdir -p "$out" "$work"
log=$work/session.log
summary=()
failed=0
tool=$build_dir/normuon
export PYTHONUNBUFFERED=1
say() { echo "gpu-session [$SECONDS s]: $*" | tee -a "$log"; }
wants() { [[ ",$phases," == *",$1,"* ]]; }
dry_spent=0  # --dry-run: the boxes taken so far, as if every phase ran to its box
left() { echo $((budget - SECONDS - dry_spent)); }

# What comes back: the whole work folder as one archive, and the summaries a reader looks at first. Written
# after every phase (a temporary name, then renamed), so a cut call returns what was done.
# The summaries of each call's phases (+ session.tar.gz: 8 files at most).
if [ "$call" = first ]; then SUMMARIES=(summary.md gpu-tests.md peers.md peers13b.md ns.md megatron.md)
else SUMMARIES=(summary.md gpu-tests.md banks.md fsdp2.md); fi
pack() {
  printf '# GPU session (%s call), %s\n\n%s\n' "$call" "$(date -u +%FT%TZ)" "$(printf -- '- %s\n' "${summary[@]}")" \
    >"$work/summary.md"
  tar -czf "$out/.session.tar.gz" -C "$work" . && mv "$out/.session.tar.gz" "$out/session.tar.gz"
  for f in "${SUMMARIES[@]}"; do
    [ ! -f "$work/$f" ] || cp "$work/$f" "$out/$f"
  done
}

phase() {  # phase NAME BOX CMD...: CMD for at most BOX seconds and what is left of the budget (BOX 0: all of it)
  local name=$1 box=$2 limit rc t0
  shift 2
  limit=$(left)
  ((box > 0 && box < limit)) && limit=$box
  if ((limit < 20)); then
    summary+=("$name: not run (budget spent)")
    failed=1
    pack
    return
  fi
  say "$name: up to $limit s: $*"
  if ((dry)); then
    summary+=("$name: dry run, box $limit s")
    dry_spent=$((dry_spent + limit))
    pack
    return
  fi
  t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  case $rc in
    0) summary+=("$name: done in $((SECONDS - t0)) s") ;;
    77) summary+=("$name: no GPU here (exit 77) after $((SECONDS - t0)) s") ;;
    124 | 137) summary+=("$name: stopped at its $limit s box"); failed=1 ;;
    *) summary+=("$name: exit $rc after $((SECONDS - t0)) s"); failed=1 ;;
  esac
  say "$name: exit $rc"
  pack
}

if compgen -G ".whl/*.whl" >/dev/null && ((!dry)); then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >>"$log" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
py=(env "PYTHONPATH=$build_dir/python:${PYTHONPATH:-}" "$python")
cuda_tests="test_fast_cuda test_reference_cuda test_cuda_plan test_ns_gemm_plan test_simt"
peers=fused-cpp,fused-py,fused-py-deferred,official,torch-muon,dion-normuon  # dion last: it compiles for minutes

# ---- the first call
wants build && phase build 70 scripts/gpu-test.sh --build-only --build-dir "$build_dir" --python "$python" \
  --report "$work/gpu-tests.md" \
  --targets "normuon _C _C_cuda $cuda_tests"
wants tests && phase tests 120 scripts/gpu-test.sh --skip-build --build-dir "$build_dir" --python "$python" \
  --report "$work/gpu-tests.md" \
  --test-timeout 90 --step-timeout 60 --ctest-regex "fast_cuda|reference_cuda|cuda_plan|ns_gemm|simt"
wants peers && phase peers 90 "${py[@]}" bench/gpu_peers.py --cli "$tool" --preset moe-8x64 --peers "$peers" \
  --profile-steps 1 --markdown "$work/peers.md" --csv "$work/peers.csv"
wants peers13b && phase peers13b 60 "${py[@]}" bench/gpu_peers.py --cli "$tool" --preset gpt-1.3b --peers "$peers" \
  --profile-steps 1 --markdown "$work/peers13b.md" --csv "$work/peers13b.csv"
if wants ns; then  # eight runs, each its own report; ns.md gathers their tables
  phase ns 75 bash -c 'tool=$1 work=$2; for preset in moe-8x64 gpt-1.3b; do for a in standard gram; do
      for w in 0 1048576; do
        p=$([ "$w" = 0 ] && echo panels || echo full)
        "$tool" bench-cuda --preset $preset --set ns_algorithm=$a --ns-panel-width $w --no-reference --warmup 1 \
          --repeats 3 --markdown "$work/ns-$preset-$a-$p.md" --csv "$work/ns-$preset-$a-$p.csv" || exit
        { echo "## $preset, $a, $p"; grep "^|" "$work/ns-$preset-$a-$p.md"; echo; } >>"$work/ns.md"
      done; done; done' ns "$tool" "$work"
fi
wants megatron && phase megatron 0 "${py[@]}" bench/megatron_gpt.py --optimizers normuon --distributed-optimizer both \
  --ckpt-formats torch --time-budget $(($(left) - 20)) --json "$work/megatron.json" --markdown "$work/megatron.md"

# ---- the second call
if wants diag; then  # the CUDA suites that failed, again, verbose, then each under compute-sanitizer
  phase diag 150 bash -c 'build=$1; ctest --test-dir "$build" -V --rerun-failed --timeout 90 && exit 0
      rc=1; for t in $(sed "s/^[0-9]*://" "$build/Testing/Temporary/LastTestsFailed.log"); do
        [ -x "$build/tests/$t" ] && { compute-sanitizer --error-exitcode 9 "$build/tests/$t" || rc=$?; }; done
      exit $rc' diag "$build_dir"
fi
wants banks && phase banks 90 "${py[@]}" bench/gpu_peers.py --cli "$tool" --preset moe-8x64 --banks \
  --peers fused-py,fused-py-2d,official --profile-steps 1 --markdown "$work/banks.md" --csv "$work/banks.csv"
wants fsdp2 && phase fsdp2 90 "${py[@]}" bench/fsdp2_bench.py --device cuda --world-sizes 1 --model gpt \
  --out "$work/fsdp2.md"
wants ncu && phase ncu 90 ncu --clock-control none --launch-skip 200 --launch-count 40 --csv --log-file "$work/ncu.csv" \
  "$tool" bench-cuda --preset gpt-1.3b --no-reference --warmup 1 --repeats 1
if wants pretrain; then  # the stock script's command as bench/megatron_gpt.py prints it, with the distributed optimizer
  phase pretrain 0 bash -c 'cmd=$("$@" bench/megatron_gpt.py --pretrain-gpt | tail -1) &&
      eval "$cmd --use-distributed-optimizer"' pretrain "${py[@]}"
fi

pack
printf '%s\n' "${summary[@]}" | tee -a "$log"
exit "$failed"
