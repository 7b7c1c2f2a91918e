#!/usr/bin/env bash
# The same-run comparison of afdep's MoE layer with the PyTorch and JAX peers, on one GPU
# machine, in one call:
#   1. afdep's sweep (`afdep moe --backend cuda`: every dispatch strategy at every token
#      count, errors against the GPU reference path), which also writes the inputs it timed
#      and the outputs of its first strategy;
#   2. peers/moe_torch.py and peers/moe_jax.py on those same inputs, one process per token
#      count (a per-configuration peak; an out-of-memory or a hang costs one row, not the run),
#      their errors against afdep's outputs;
#   3. `afdep report moe`: the markdown table (into a copy of docs/perf/moe.md, between its
#      marker comments) and the chart.
#
#   run_moe_comparison.sh BUNDLE OUTDIR [--tokens 16384,131072,1048576] [--iters 10]
#                         [--work DIR] [--keep-work] [--python PY] [--peer-timeout SECONDS]
#
# BUNDLE is the folder of `cargo xtask gpu-test --bundle BUNDLE` (bin/afdep, peers/,
# docs/perf/moe.md, commit.txt). Everything written goes under OUTDIR: afdep.jsonl,
# torch.jsonl, jax.jsonl, moe.md, moe.png, run.log (six files, all small). The inputs and
# afdep's outputs (about 2.2 GB each per file at 1M tokens) go to a work folder (default: a new
# one under ${TMPDIR:-/tmp}, removed at the end unless --keep-work).
set -uo pipefail

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 2 ] || usage
bundle=$(cd "$1" && pwd) || { echo "no bundle folder $1" >&2; exit 2; }
out=$2; shift 2
tokens=16384,131072,1048576; iters=10; work=""; keep=0
python=${PYTHON:-python3}; peer_timeout=180
while [ $# -gt 0 ]; do
  case "$1" in
    --tokens) tokens=$2; shift 2;;
    --iters) iters=$2; shift 2;;
    --work) work=$2; shift 2;;
    --keep-work) keep=1; shift;;
    --python) python=$2; shift 2;;
    --peer-timeout) peer_timeout=$2; shift 2;;
    -h|--help) usage;;
    *) echo "unknown argument $1" >&2; usage;;
  esac
done
. "$(dirname "$0")/bundle_setup.sh"
bundle_setup afdep-moe-cmp
cleanup() { if [ $keep -eq 0 ] && [ $made_work -eq 1 ]; then rm -rf "$work"; fi; }
trap cleanup EXIT
log="$out/run.log"; : > "$log"
say() { echo "run_moe_comparison: $*" | tee -a "$log" >&2; }
export AFDEP_KERNEL_CACHE=${AFDEP_KERNEL_CACHE:-$work/kernel-cache}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
commit=$(cat "$bundle/commit.txt" 2>/dev/null || echo unknown)

say "$(date -u +%Y-%m-%dT%H:%M:%SZ) bundle $bundle (commit $commit), kernels $("$afdep" kernels --digest 2>/dev/null || echo unknown)"
say "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi not available')"
say "tokens $tokens, iters $iters, work folder $work"

# 1. afdep
: > "$out/afdep.jsonl"
say "afdep moe --backend cuda"
start=$(date +%s)
"$afdep" moe --backend cuda --tokens "$tokens" --iters "$iters" \
  --write-inputs "$work" --write-outputs "$work" --json-out "$out/afdep.jsonl" \
  > /dev/null 2> >(tee -a "$log" >&2)
rc_afdep=$?
say "afdep: rc=$rc_afdep, $(wc -l < "$out/afdep.jsonl") rows, $(( $(date +%s) - start ))s"
if [ ! -s "$out/afdep.jsonl" ]; then say "afdep wrote no rows: stopping"; exit 1; fi

# 2. the peers, one process per token count
peer_rows() { # file impl tokens status note: a row for a peer process that printed none
  printf '{"tokens":%s,"impl":"%s","dispatch":"sorted","fwd_ms":null,"train_ms":null,"status":"%s","note":"%s"}\n' \
    "$3" "$2" "$4" "$5" >> "$1"
}
run_peer() { # name script impl
  local name=$1 script=$2 impl=$3 file="$out/$1.jsonl" t before rc s
  : > "$file"
  for t in ${tokens//,/ }; do
    if [ ! -f "$work/moe-inputs-$t.safetensors" ]; then
      say "$name, $t tokens: no inputs (afdep did not write them)"; continue
    fi
    before=$(wc -l < "$file"); s=$(date +%s)
    timeout --kill-after=10 "$peer_timeout" "$python" "$peerdir/$script" --inputs "$work" \
      --afdep-outputs "$work" --tokens "$t" --iters "$iters" --json-out "$file" \
      > /dev/null 2> >(tee -a "$log" >&2)
    rc=$?
    say "$name, $t tokens: rc=$rc, $(( $(date +%s) - s ))s"
    if [ "$(wc -l < "$file")" -eq "$before" ]; then
      if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        peer_rows "$file" "$impl" "$t" timeout "killed after ${peer_timeout}s"
      else
        peer_rows "$file" "$impl" "$t" error "the process exited with rc=$rc and no row (see run.log)"
      fi
    fi
  done
}
run_peer torch moe_torch.py torch_grouped_mm
run_peer jax moe_jax.py jax_ragged_dot

# 3. the report
if [ -f "$bundle/docs/perf/moe.md" ]; then cp "$bundle/docs/perf/moe.md" "$out/moe.md"; fi
"$afdep" report moe --rows "$out/afdep.jsonl" "$out/torch.jsonl" "$out/jax.jsonl" \
  --md "$out/moe.md" --png "$out/moe.png" --commit "$commit" 2> >(tee -a "$log" >&2)
rc_report=$?
say "report: rc=$rc_report; results in $out"
[ $rc_afdep -eq 0 ] && [ $rc_report -eq 0 ]
