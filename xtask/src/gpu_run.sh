#!/usr/bin/env bash
# The afdep GPU test matrix, self-contained: run every test binary of this bundle, write one
# log per binary under LOGDIR (default: ./logs next to this script) and a summary.
#   run.sh [--logs DIR] [--sanitize memcheck|racecheck] [--filter NAME] [--timeout SECS]
# --timeout bounds each binary's run (default 600 s); a binary stopped by it counts as failed
# (rc 124 in the summary).
set -u
here=$(cd "$(dirname "$0")" && pwd)
logs="$here/logs"; sanitize=""; filter=""; limit=600
while [ $# -gt 0 ]; do
  case "$1" in
    --logs) logs=$2; shift 2;;
    --sanitize) sanitize=$2; shift 2;;
    --filter) filter=$2; shift 2;;
    --timeout) limit=$2; shift 2;;
    *) echo "unknown argument $1" >&2; exit 2;;
  esac
done
mkdir -p "$logs"
export AFDEP_KERNEL_CACHE=${AFDEP_KERNEL_CACHE:-$logs/kernel-cache}
# on the GPU machine a missing GPU is a failure, not a skip
export AFDEP_REQUIRE_GPU=${AFDEP_REQUIRE_GPU:-1}
summary="$logs/summary.txt"; : > "$summary"
json="$logs/summary.json"; echo "[" > "$json"; first=1
tp=0; tf=0; ts=0; bins_failed=0
{
  echo "afdep GPU test matrix, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
  echo "kernel digest: $("$here/bin/afdep" kernels --digest 2>/dev/null || echo unknown)"
  [ -n "$sanitize" ] && echo "compute-sanitizer --tool $sanitize"
} | tee -a "$summary"
for t in "$here"/tests/*; do
  name=$(basename "$t")
  [ -n "$filter" ] && [[ "$name" != *"$filter"* ]] && continue
  log="$logs/$name.log"
  start=$(date +%s)
  if [ -n "$sanitize" ]; then
    timeout -k 10 "$limit" compute-sanitizer --tool "$sanitize" --error-exitcode 99 "$t" --test-threads=1 --nocapture > "$log" 2>&1; rc=$?
  else
    timeout -k 10 "$limit" "$t" --test-threads=1 --nocapture > "$log" 2>&1; rc=$?
  fi
  secs=$(( $(date +%s) - start ))
  # libtest's closing line per binary ("test result: ok. N passed; M failed; ...") is the count;
  # per-test lines can interleave with the tests' own output under --nocapture
  p=$(grep -oE 'test result: [a-zA-Z]+\. [0-9]+ passed' "$log" | awk '{s+=$4} END {print s+0}')
  f=$(grep -oE '; [0-9]+ failed' "$log" | awk '{s+=$2} END {print s+0}')
  # under --nocapture a SKIP line can follow libtest's "test name ... " on the same line
  s=$(grep -oE 'SKIP: .*' "$log" | wc -l)
  # compute-sanitizer exits 255 when a binary made no CUDA call at all (every test skipped by
  # size); that is not an error if libtest passed
  if [ -n "$sanitize" ] && [ $rc -eq 255 ] && grep -q 'terminated before first instrumented API call' "$log" \
     && grep -q '^test result: ok' "$log"; then rc=0; fi
  # a skipped test prints one `SKIP: reason` line and then reports ok to libtest
  p=$((p - s)); [ $p -lt 0 ] && p=0
  tp=$((tp + p)); tf=$((tf + f)); ts=$((ts + s))
  [ $rc -ne 0 ] && bins_failed=$((bins_failed + 1))
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "    stopped by --timeout $limit s" >> "$log"
  line="$name: rc=$rc passed=$p failed=$f skipped=$s (${secs}s)"
  echo "$line" | tee -a "$summary"
  grep -oE 'SKIP: .*' "$log" | sort | uniq -c | sed 's/^/    /' | tee -a "$summary"
  grep -E '\.\.\. FAILED$' "$log" | sed 's/^/    /' | tee -a "$summary"
  [ $first -eq 0 ] && echo "," >> "$json"; first=0
  printf '{"binary":"%s","rc":%d,"passed":%d,"failed":%d,"skipped":%d,"seconds":%d}' "$name" $rc $p $f $s $secs >> "$json"
done
echo "]" >> "$json"
echo "$tp passed, $tf failed, $ts skipped" | tee -a "$summary"
[ $bins_failed -eq 0 ] && [ $tf -eq 0 ]
