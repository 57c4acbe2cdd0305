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
echo "cli smoke test passed"
