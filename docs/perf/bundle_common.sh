# The start shared by the exchange table scripts (exchange_gpu_run.sh, exchange_load_run.sh,
# exchange_pipeline_run.sh),
# sourced by them, not run; a GPU-test bundle carries it beside them (docs/perf/ of the bundle).
#
# perf_start BUNDLE OUT: checks the two arguments, sets `bundle` and `out` (absolute; OUT is
# made) and `afdep` (BUNDLE/bin/afdep, which must be executable), and points the kernel cache
# into OUT unless AFDEP_KERNEL_CACHE is set.
# perf_env: the lines every env.txt starts with (date, GPU, driver, GPU count, kernel digest,
# the bundle's commit).
# perf_begin LINE...: writes OUT/env.txt (perf_env, then each LINE; also shown), empties
# OUT/rows.jsonl and starts the clock of perf_total.
# perf_run TAG COMMAND...: runs COMMAND, its output dropped and its stderr in OUT/TAG.log, then
# adds TAG's time to env.txt; a failure shows the log's last 30 lines, is counted and marked
# FAILED in env.txt, and the script goes on with the next configuration.
# perf_total: adds the time since perf_begin to env.txt.
# perf_end: exits 1 when a configuration failed (call it last, after the table is written).

perf_start() {
  if [ $# -ne 2 ]; then
    echo "usage: $0 BUNDLE OUT" >&2
    exit 2
  fi
  bundle=$(cd "$1" && pwd)
  mkdir -p "$2"
  out=$(cd "$2" && pwd)
  afdep="$bundle/bin/afdep"
  [ -x "$afdep" ] || { echo "no executable $afdep" >&2; exit 2; }
  export AFDEP_KERNEL_CACHE=${AFDEP_KERNEL_CACHE:-$out/kernel-cache}
}

perf_env() {
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1 || echo unknown)"
  echo "gpus: $(nvidia-smi -L 2>/dev/null | wc -l)"
  echo "kernel digest: $("$afdep" kernels --digest)"
  echo "commit: $(cat "$bundle/commit.txt" 2>/dev/null || echo unknown)"
}

perf_begin() {
  {
    perf_env
    printf '%s\n' "$@"
  } | tee "$out/env.txt"
  : > "$out/rows.jsonl"
  start=$(date +%s)
}

perf_run() {
  local tag=$1 t0
  shift
  t0=$(date +%s)
  # a failing configuration is reported and counted, and the others still run (its rows are
  # missing from the table); perf_end fails the script at the end
  if ! "$@" > /dev/null 2> "$out/$tag.log"; then
    echo "$tag FAILED after $(( $(date +%s) - t0 )) s:" | tee -a "$out/env.txt"
    tail -30 "$out/$tag.log"
    perf_failed=$(( ${perf_failed:-0} + 1 ))
    return 0
  fi
  echo "$tag: $(( $(date +%s) - t0 )) s" | tee -a "$out/env.txt"
}

perf_end() {
  if [ "${perf_failed:-0}" -gt 0 ]; then
    echo "${perf_failed} configurations failed (see env.txt and their logs)" | tee -a "$out/env.txt"
    exit 1
  fi
}

perf_total() {
  echo "total: $(( $(date +%s) - start )) s" | tee -a "$out/env.txt"
}
