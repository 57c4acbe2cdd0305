#!/usr/bin/env bash
# scripts/gpu-session.sh's plan fits one device call: with every phase running to its time box, the first
# call ends within 9 minutes and still leaves Megatron its 90 s; what comes back is at most 8 files (the
# device call's limit), however many the phases write; bad options change nothing and exit 2.
# Usage: gpu_session_plan_test.sh REPO
set -euo pipefail
repo=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

for call in first second; do
  out=$("$repo/scripts/gpu-session.sh" --call "$call" --dry-run --out "$work/$call-out" --work "$work/$call-work")
  boxes=$(($(grep -oE 'box [0-9]+ s' <<<"$out" | grep -oE '[0-9]+' | paste -sd+ -)))
  ((boxes <= 540)) || fail "$call call: the boxes add up to $boxes s, over the 540 s budget"
  grep -q "not run" <<<"$out" && fail "$call call: a phase has no time left: $out"
  echo "$call call: boxes add up to $boxes s"
done
megatron=$(grep -oE 'megatron: dry run, box [0-9]+' <<<"$("$repo/scripts/gpu-session.sh" --dry-run --out "$work/o" \
  --work "$work/w")" | grep -oE '[0-9]+$')
((megatron >= 90)) || fail "the first call leaves Megatron $megatron s, under 90"

# Many files written: the archive holds them all, the summaries beside it stay within the 8 files.
mkdir -p "$work/many"
for i in $(seq 20); do echo "$i" >"$work/many/report-$i.md"; done
for f in summary.md gpu-tests.md peers.md peers13b.md ns.md megatron.md fsdp2.md; do echo x >"$work/many/$f"; done
"$repo/scripts/gpu-session.sh" --dry-run --phases tests --out "$work/many-out" --work "$work/many" >/dev/null
n=$(find "$work/many-out" -type f | wc -l)
((n <= 8)) || fail "$n files come back, over 8: $(ls "$work/many-out")"
listing=$(tar -tzf "$work/many-out/session.tar.gz")  # (not piped into grep -q: tar's SIGPIPE fails the pipe)
grep -q report-20.md <<<"$listing" || fail "the archive lacks a phase's file"
echo "$n files come back; the archive holds the rest"

for bad in "--phases build,bogus" "--budget x" "--call third" "--nope"; do
  # shellcheck disable=SC2086  # the options are meant to split
  rc=0; "$repo/scripts/gpu-session.sh" $bad --out "$work/bad" >/dev/null 2>&1 || rc=$?
  ((rc == 2)) || fail "'$bad' exited $rc, not 2"
  [ ! -e "$work/bad" ] || fail "'$bad' wrote $work/bad"
done
echo "bad options: exit 2, nothing written"
