#!/usr/bin/env bash
# End-to-end use of the `normuon` tool as a user would: help texts, a run that saves, inspect, a resume,
# and clear failures for bad input. Usage: cli_smoke.sh PATH/TO/normuon
set -euo pipefail
tool=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
expect_output() {  # expect_output "pattern" command...  (output captured whole: no SIGPIPE under pipefail)
  local want=$1; shift
  local out
  out=$("$@" 2>&1) || fail "'$*' exited with $?: $out"
  grep -q -- "$want" <<<"$out" || fail "'$*' said: $out (wanted: $want)"
}
expect_error() {  # expect_error "message part" command...
  local want=$1; shift
  if out=$("$@" 2>&1); then fail "succeeded but should fail: $*"; fi
  grep -q -- "$want" <<<"$out" || fail "'$*' said: $out (wanted: $want)"
}

for cmd in run golden inspect presets manifest layout; do
  expect_output "usage: normuon $cmd" "$tool" "$cmd" --help
done
expect_output "commands:" "$tool" --help

expect_output "3 steps (0 skipped)" "$tool" run --steps 3 --quiet --save "$dir/a.safetensors"
expect_output "group:    normuon at step 3" "$tool" inspect "$dir/a.safetensors"
expect_output "normuon.beta2=0.95$" "$tool" inspect "$dir/a.safetensors"
expect_output "resumed from" "$tool" run --steps 2 --quiet --load "$dir/a.safetensors" --save "$dir/b.safetensors"
expect_output "group:    adamw at step 5" "$tool" inspect "$dir/b.safetensors"
# Gram Newton-Schulz: saved with the state, resumed from it; a bad value is an error that writes nothing.
expect_output "3 steps (0 skipped)" "$tool" run --steps 3 --quiet --set ns_algorithm=gram --save "$dir/g.safetensors"
expect_output "normuon.ns_algorithm=gram$" "$tool" inspect "$dir/g.safetensors"
expect_output "resumed from" "$tool" run --steps 1 --quiet --load "$dir/g.safetensors" --set ns_algorithm=gram
expect_error "'ns_algorithm': unknown value 'foo' (choose standard | gram)" "$tool" run --steps 1 --set ns_algorithm=foo --save "$dir/foo.safetensors"
test ! -e "$dir/foo.safetensors" || { echo "a refused option wrote a state file"; exit 1; }
expect_error "--fast-ns-algorithm: option 'ns_algorithm': unknown value 'fast' (choose standard | gram)" "$tool" bench --fast-ns-algorithm fast --csv "$dir/bench.csv"
test ! -e "$dir/bench.csv" || { echo "a refused bench option wrote its CSV"; exit 1; }
# The golden check for another platform's rounding: the reference passes it, a planted change fails it,
# and it takes no value tolerance beside its own bounds.
expect_output "golden check PASSED (reference-cpu).*cross-platform bounds" "$tool" golden verify --cross-platform
expect_error "golden check FAILED (reference-cpu).*worst error [^ ]* of its bound" "$tool" golden verify --cross-platform --set normuon.nesterov=false
expect_error "--cross-platform has bounds of its own" "$tool" golden verify --cross-platform --rtol 0.1
expect_error "make compares nothing" "$tool" golden make --cross-platform --file "$dir/never.csv"
test ! -e "$dir/never.csv" || fail "a refused golden make wrote its file"
"$tool" manifest --preset tiny --out "$dir/m.csv"
expect_output "on NorMuon in 4 shape buckets" "$tool" layout --manifest "$dir/m.csv"

# Bad input: clear errors, non-zero exit.
expect_error "unknown option '--stepz'" "$tool" run --stepz 3
expect_error "unknown option 'normuon.lrr'\|no field 'lrr'" "$tool" run --set normuon.lrr=1
expect_error "unknown preset\|known presets\|Known presets" "$tool" run --preset nope
expect_error "unknown command" "$tool" frobnicate
printf 'name,shape\nbad,12a\n' >"$dir/bad.csv"
expect_error "bad.csv:2" "$tool" layout --manifest "$dir/bad.csv"
head -c 100 "$dir/a.safetensors" >"$dir/truncated.safetensors"
expect_error "truncated" "$tool" inspect "$dir/truncated.safetensors"
expect_error "fingerprint\|layout" "$tool" run --preset gpt2-124m --steps 0 --load "$dir/a.safetensors"

# --version: the version, the commit (or "unknown") and the backends of this build.
expect_output "^normuon [0-9][0-9.]*$" "$tool" --version
out=$("$tool" --version)
grep -Eq "^commit: ([0-9a-f]{7,}|unknown)$" <<<"$out" || fail "--version said: $out"
grep -Eq "^build: .*; backends: reference" <<<"$out" || fail "--version said: $out"

# --progress-every 0 divided by zero (SIGFPE).
expect_error "progress-every must be >= 1" "$tool" run --steps 2 --progress-every 0
expect_error "progress-every must be >= 1" "$tool" run --steps 2 --progress-every -3

# A FIFO given as a state file: refused at once, not waited on (open() blocked for a writer).
mkfifo "$dir/fifo"
expect_error "FIFO" timeout 20 "$tool" inspect "$dir/fifo"
expect_error "FIFO" timeout 20 "$tool" run --steps 1 --quiet --load "$dir/fifo"

# A bad --save path fails before the first step, not after the last.
if out=$("$tool" run --steps 3 --save "$dir/no-such-dir/s.safetensors" 2>&1); then fail "saved into a missing directory"; fi
grep -q "cannot save here" <<<"$out" || fail "bad --save said: $out"
if grep -q "step 1/" <<<"$out"; then fail "steps ran before the bad --save path was found: $out"; fi

# Resuming is bitwise even when a group gets no gradient in some steps: the run's step number is saved
# (run_step), not taken from the largest group counter. With period 2 the matrix misses the even steps
# and the bias the odd ones, so after 4 steps both groups are at step 2.
printf 'name,shape,role\nw,4x4,matrix\nb,4,bias\n' >"$dir/two.csv"
common=(--manifest "$dir/two.csv" --missing-grad-period 2 --quiet)
"$tool" run "${common[@]}" --steps 7 --save "$dir/straight.safetensors" >/dev/null
"$tool" run "${common[@]}" --steps 4 --save "$dir/first.safetensors" >/dev/null
expect_output "resumed from .* at step 4$" "$tool" run "${common[@]}" --steps 3 --load "$dir/first.safetensors" \
  --save "$dir/resumed.safetensors"
tensors() { "$tool" inspect "$1" | grep '^  [0-9a-f]\{8\} '; }
[ "$(tensors "$dir/straight.safetensors")" = "$(tensors "$dir/resumed.safetensors")" ] ||
  fail "7 steps straight and 4 + 3 resumed differ"

# ... and when parameters of one group miss gradients in turn: each keeps its own step count (AdamW's bias
# corrections), saved in the file (format version 2) and carried on by the resumed run. With period 2,
# `a` misses the even steps and `b` the odd ones: after 7 steps the group is at 7, `a` at 4 and `b` at 3.
printf 'name,shape,role\na,4,bias\nb,4,bias\n' >"$dir/pair.csv"
common=(--manifest "$dir/pair.csv" --missing-grad-period 2 --quiet)
"$tool" run "${common[@]}" --steps 7 --save "$dir/pair-straight.safetensors" >/dev/null
"$tool" run "${common[@]}" --steps 4 --save "$dir/pair-first.safetensors" >/dev/null
"$tool" run "${common[@]}" --steps 3 --load "$dir/pair-first.safetensors" --save "$dir/pair-resumed.safetensors" \
  >/dev/null
expect_output "format:   normuon-state version 2" "$tool" inspect "$dir/pair-resumed.safetensors"
expect_output "group:    adamw at step 7" "$tool" inspect "$dir/pair-resumed.safetensors"
expect_output " a  (step 4)$" "$tool" inspect "$dir/pair-resumed.safetensors"
expect_output " b  (step 3)$" "$tool" inspect "$dir/pair-resumed.safetensors"
[ "$(tensors "$dir/pair-straight.safetensors")" = "$(tensors "$dir/pair-resumed.safetensors")" ] ||
  fail "7 steps straight and 4 + 3 resumed differ when the parameters of a group miss gradients in turn"

# A manifest that starts with a UTF-8 byte order mark.
printf '\xef\xbb\xbfname,shape\nw,4x4\n' >"$dir/bom.csv"
expect_output "1 parameters" "$tool" layout --manifest "$dir/bom.csv"

# Out-of-range numbers say so.
expect_error "out of range: it underflows" "$tool" run --set lr=1e-400

# 2^62 elements wrapped a byte count (SIGSEGV); 10^12 was a bare std::bad_alloc.
printf 'name,shape\nbig,4611686018427387904\n' >"$dir/big62.csv"
expect_error '"big".*too large' "$tool" layout --manifest "$dir/big62.csv"
printf 'name,shape\nbig,1000000000000\n' >"$dir/big12.csv"
expect_error "'big'.*1000000000000 elements" "$tool" run --steps 1 --manifest "$dir/big12.csv"
echo "cli smoke test passed"
