#!/usr/bin/env bash
# The fast CPU backend on every processor level: under oneDNN ISA caps down to AVX2 (no bf16 matmul there:
# its bf16 GEMMs run staged in fp32) and ATen's default capability, it runs, agrees with the reference
# within the comparator's bounds, and gives the same bits at 1 and 2 threads; the thread-count cases of
# the fast backend's own suites pass under each cap (below AVX-512 oneDNN's sums follow its thread count,
# so a pool of one thread must not hand oneDNN the caller's).
# Usage: fast_isa_sweep_test.sh PATH/TO/normuon PATH/TO/test_fast_cpu PATH/TO/test_newton_schulz
set -euo pipefail
tool=$1 fast_suite=$2 ns_suite=$3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
# The tensors of a state file, without its header (which holds the time it was written).
tensors() { python3 -c 'import struct,sys; b=open(sys.argv[1],"rb").read(); n=struct.unpack("<Q",b[:8])[0]; sys.stdout.buffer.write(b[8+n:])' "$1"; }

start=$SECONDS
for cap in "" AVX512_CORE AVX2; do
  label=${cap:-none}
  out=$(ONEDNN_MAX_CPU_ISA=$cap ATEN_CPU_CAPABILITY=default "$tool" compare --preset tiny --steps 4 2>&1) ||
    fail "compare under ONEDNN_MAX_CPU_ISA=$label: $out"
  grep -q "cross-check PASSED" <<<"$out" || fail "compare under ONEDNN_MAX_CPU_ISA=$label: $out"
  for threads in 1 2; do
    ONEDNN_MAX_CPU_ISA=$cap OMP_NUM_THREADS=$threads "$tool" run --preset tiny --steps 3 --backend fast --quiet \
      --save "$dir/$label-$threads.safetensors" >/dev/null || fail "run under ONEDNN_MAX_CPU_ISA=$label, $threads threads"
  done
  cmp -s <(tensors "$dir/$label-1.safetensors") <(tensors "$dir/$label-2.safetensors") ||
    fail "ONEDNN_MAX_CPU_ISA=$label: 1 and 2 threads give different states"
  for suite in "$fast_suite --run_test=a_step_does_not_depend_on_the_thread_count" \
               "$ns_suite --run_test=gram_does_not_depend_on_the_thread_count_and_runs_bitwise_again"; do
    # shellcheck disable=SC2086  # the suite and its --run_test
    ONEDNN_MAX_CPU_ISA=$cap $suite >"$dir/suite.log" 2>&1 ||
      fail "ONEDNN_MAX_CPU_ISA=$label: ${suite##*/}: $(grep -m3 error "$dir/suite.log")"
  done
  echo "ok ONEDNN_MAX_CPU_ISA=$label: ${out##*cross-check }" | head -c 220; echo
done
echo "fast ISA sweep: 3 caps, compare passed, same bits at 1 and 2 threads, thread-count suites passed, in $((SECONDS - start)) s"
