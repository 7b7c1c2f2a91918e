#!/usr/bin/env bash
# The afdep GPU test matrix, self-contained: run every test binary of this bundle, write one
# log per binary under LOGDIR (default: ./logs next to this script) and a summary.
#   run.sh [--logs DIR] [--sanitize memcheck|racecheck] [--filter NAME] [--only A,B,..]
#          [--except A,B,..] [--timeout SECS] [--skip-ignored]
# --filter keeps the binaries whose name contains NAME; --only keeps, --except leaves out,
# the binaries named exactly (comma-separated).
# --timeout bounds each binary's run (default 600 s); a binary stopped by it counts as failed
# (rc 124 in the summary). The #[ignore]d tests (the long ones, e.g. the 1M-token reference
# test) run too (`--include-ignored`) unless --skip-ignored, and then the summary says how many
# were left out. Counts come from the binary's own closing `test result:` line (the last one in
# its log: tests that start child processes put the children's lines before it), so every test
# is counted once; a SKIP line counts as skipped instead of passed.
set -u
here=$(cd "$(dirname "$0")" && pwd)
# "passed failed ignored" of a binary's log: its own closing line, the last `test result:` one
# (child processes that are test binaries print theirs earlier); a log without one (the binary
# crashed or was killed) counts nothing passed and one failure.
count_results() {
  local last
  last=$(grep -E '^test result: ' "$1" | tail -n 1)
  if [ -z "$last" ]; then echo "0 1 0"; return; fi
  echo "$(sed -nE 's/.* ([0-9]+) passed.*/\1/p' <<< "$last") $(sed -nE 's/.* ([0-9]+) failed.*/\1/p' <<< "$last") $(sed -nE 's/.* ([0-9]+) ignored.*/\1/p' <<< "$last")"
}
# The binary's own `SKIP: reason` lines: test binaries that start copies of themselves as child
# processes (one per rank) relay the children's output into the log, each child between its own
# `running N tests` and `test result:` lines, and a child's SKIP is not one of this binary's
# tests. So only the lines at nesting depth 1 count (under --nocapture a SKIP can follow
# libtest's `test name ... ` on the same line).
skip_lines() {
  awk '/^running [0-9]+ tests?$/ { depth++ }
       depth <= 1 && /SKIP: / { sub(/.*SKIP: /, "SKIP: "); print }
       /^test result: / { depth-- }' "$1"
}
[ "${1:-}" = "--count-results" ] && { count_results "$2"; exit 0; }
[ "${1:-}" = "--skip-lines" ] && { skip_lines "$2"; exit 0; }
logs="$here/logs"; sanitize=""; filter=""; only=""; except=""; limit=600; ignored=--include-ignored
while [ $# -gt 0 ]; do
  case "$1" in
    --logs) logs=$2; shift 2;;
    --sanitize) sanitize=$2; shift 2;;
    --filter) filter=$2; shift 2;;
    --only) only=$2; shift 2;;
    --except) except=$2; shift 2;;
    --timeout) limit=$2; shift 2;;
    --skip-ignored) ignored=""; shift;;
    *) echo "unknown argument $1" >&2; exit 2;;
  esac
done
mkdir -p "$logs"
export AFDEP_KERNEL_CACHE=${AFDEP_KERNEL_CACHE:-$logs/kernel-cache}
# on the GPU machine a missing GPU is a failure, not a skip
export AFDEP_REQUIRE_GPU=${AFDEP_REQUIRE_GPU:-1}
summary="$logs/summary.txt"; : > "$summary"
json="$logs/summary.json"; echo "[" > "$json"; first=1
tp=0; tf=0; ts=0; ti=0; bins_failed=0
{
  echo "afdep GPU test matrix, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
  echo "kernel digest: $("$here/bin/afdep" kernels --digest 2>/dev/null || echo unknown)"
  [ -n "$sanitize" ] && echo "compute-sanitizer --tool $sanitize"
  [ -z "$ignored" ] && echo "--skip-ignored: the #[ignore]d tests are left out (counted as ignored below)"
} | tee -a "$summary"
for t in "$here"/tests/*; do
  name=$(basename "$t")
  [ -n "$filter" ] && [[ "$name" != *"$filter"* ]] && continue
  [ -n "$only" ] && [[ ",$only," != *",$name,"* ]] && continue
  [ -n "$except" ] && [[ ",$except," == *",$name,"* ]] && continue
  log="$logs/$name.log"
  start=$(date +%s)
  if [ -n "$sanitize" ]; then
    timeout -k 10 "$limit" compute-sanitizer --tool "$sanitize" --error-exitcode 99 "$t" --test-threads=1 --nocapture $ignored > "$log" 2>&1; rc=$?
  else
    timeout -k 10 "$limit" "$t" --test-threads=1 --nocapture $ignored > "$log" 2>&1; rc=$?
  fi
  secs=$(( $(date +%s) - start ))
  read -r p f i <<< "$(count_results "$log")"
  s=$(skip_lines "$log" | wc -l)
  # compute-sanitizer exits 255 when a binary made no CUDA call at all (every test skipped by
  # size); that is not an error if libtest passed
  if [ -n "$sanitize" ] && [ $rc -eq 255 ] && grep -q 'terminated before first instrumented API call' "$log" \
     && grep -q '^test result: ok' "$log"; then rc=0; fi
  # a skipped test prints one `SKIP: reason` line and then reports ok to libtest
  [ $s -gt $p ] && s=$p
  p=$((p - s))
  tp=$((tp + p)); tf=$((tf + f)); ts=$((ts + s)); ti=$((ti + i))
  [ $rc -ne 0 ] && bins_failed=$((bins_failed + 1))
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "    stopped by --timeout $limit s" >> "$log"
  line="$name: rc=$rc passed=$p failed=$f skipped=$s ignored=$i (${secs}s)"
  echo "$line" | tee -a "$summary"
  skip_lines "$log" | sort | uniq -c | sed 's/^/    /' | tee -a "$summary"
  grep -E '\.\.\. FAILED$' "$log" | sed 's/^/    /' | tee -a "$summary"
  [ $first -eq 0 ] && echo "," >> "$json"; first=0
  printf '{"binary":"%s","rc":%d,"passed":%d,"failed":%d,"skipped":%d,"ignored":%d,"seconds":%d}' "$name" $rc $p $f $s $i $secs >> "$json"
done
echo "]" >> "$json"
[ $ti -gt 0 ] && echo "$ti ignored tests were left out (run without --skip-ignored to include them)" | tee -a "$summary"
echo "$tp passed, $tf failed, $ts skipped" | tee -a "$summary"
[ $bins_failed -eq 0 ] && [ $tf -eq 0 ]
