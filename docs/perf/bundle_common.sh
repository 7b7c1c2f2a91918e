# The start shared by the exchange table scripts (exchange_gpu_run.sh, exchange_load_run.sh,
# exchange_pipeline_run.sh),
# sourced by them, not run; a GPU-test bundle carries it beside them (docs/perf/ of the bundle).
#
# perf_start BUNDLE OUT: checks the two arguments, sets `bundle` and `out` (absolute; OUT is
# made) and `afdep` (BUNDLE/bin/afdep, which must be executable), and points the kernel cache
# into OUT unless AFDEP_KERNEL_CACHE is set.
# perf_env: the lines every env.txt starts with (date, GPU, driver, GPU count, kernel digest,
# the bundle's commit).

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
