#!/usr/bin/env bash
# The reference's bits follow from the spec, not from the processor (docs/spec.md section 7): the golden
# traces, made on one machine, are met exactly (--exact: every value and every parameter's bit hash)
# under oneDNN ISA caps, ATen CPU capabilities, 1 and 2 threads, and each instruction set the spec GEMM's
# chains can run on here. Usage: reference_sweep_test.sh PATH/TO/normuon
set -euo pipefail
tool=$1
fail() { echo "FAIL: $*"; exit 1; }
has_flag() { grep -qw "$1" /proc/cpuinfo 2>/dev/null; }

# settings: "ENV=VALUE ... | golden verify arguments"
settings=(
  "OMP_NUM_THREADS=2 |"
  "OMP_NUM_THREADS=1 ONEDNN_MAX_CPU_ISA=AVX512_CORE |"
  "OMP_NUM_THREADS=2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=default |"
  "OMP_NUM_THREADS=2 ONEDNN_MAX_CPU_ISA=AVX2 | --set normuon.ns_algorithm=gram --file golden/tiny-gram.csv"
)
if has_flag avx2 && has_flag fma; then
  settings+=("OMP_NUM_THREADS=2 NORMUON_REFERENCE_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 |")
  settings+=("OMP_NUM_THREADS=1 NORMUON_REFERENCE_ISA=avx2 | --set normuon.ns_algorithm=gram --file golden/tiny-gram.csv")
fi
# The plain-C++ chains (std::fma, no vectors): slow, so two steps.
settings+=("OMP_NUM_THREADS=2 NORMUON_REFERENCE_ISA=scalar | --steps 2")

cd "$(dirname "$0")/.."
start=$SECONDS
for s in "${settings[@]}"; do
  env_part=${s%%|*}
  args_part=${s#*|}
  # shellcheck disable=SC2086
  out=$(env $env_part "$tool" golden verify --exact $args_part 2>&1) || fail "[$env_part]$args_part: $out"
  grep -q "golden check PASSED" <<<"$out" || fail "[$env_part]$args_part: $out"
  echo "ok [${env_part% }]${args_part}: ${out##*match }"
done
echo "reference sweep: ${#settings[@]} settings, identical bits, in $((SECONDS - start)) s"
