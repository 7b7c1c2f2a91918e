#!/usr/bin/env bash
# The shape suite with its peers, on one GPU machine, in one call:
#   for every (shape, tokens) of `afdep moe --suite SUITE --list`, in table order:
#     1. afdep (`afdep moe --backend cuda --shape NAME --tokens T`: every strategy of
#        --dispatch, errors against the GPU reference path), which writes the inputs it timed;
#     2. peers/moe_torch.py on those inputs, one process: eager `torch._grouped_mm` and
#        `torch.compile` of the same layer (`--impls eager,compile`), each judged against the
#        f32 oracle the script computes itself, with --check-syncs count (host syncs in the
#        timed runs counted into the rows' host_syncs: 0 expected);
#     3. peers/moe_jax.py, one process, for the shapes of --jax-shapes;
#     4. the cell's input file deleted (disk use: one cell's inputs, at most 22.5 GB at
#        deepseek-v3);
#   then `afdep report moe` renders every row of OUTDIR into OUTDIR/moe.md (a copy of
#   docs/perf/moe.md, the block between its marker comments) and OUTDIR/moe.png.
#
#   run_suite.sh BUNDLE OUTDIR [--suite models|record] [--shapes NAME,..] [--dispatch D,..]
#                [--peers torch,jax|none] [--jax-shapes NAME,..|all|none] [--iters N]
#                [--budget SECONDS] [--peer-timeout SECONDS] [--afdep-timeout SECONDS]
#                [--append] [--work DIR] [--python PY] [--tokens T,..] [--backend cuda|cpu]
#                [--torch-impls eager,compile]
#
# Time: --budget (default 420 s) bounds the whole loop: a cell that would start after it is
# not run (its rows say `skipped`), and every process is killed at the latest 60 s after it
# (its missing rows say `timeout`), so the loop ends within budget + 60 s and the report is
# written either way. A peer process is also killed after --peer-timeout (default 150 s),
# afdep's after --afdep-timeout (default 240 s). --append keeps the rows already in OUTDIR (to
# finish a suite over two calls: the second with --shapes of the cells the first skipped).
# --tokens replaces every shape's token counts; --backend cpu (tests: the CPU oracle, peers on
# the CPU) is not a measurement.
# BUNDLE is the folder of `cargo xtask gpu-test --bundle BUNDLE`. OUTDIR gets afdep.jsonl,
# torch.jsonl, jax.jsonl, moe.md, moe.png and run.log.
set -uo pipefail

usage() { sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 2 ] || usage
bundle=$(cd "$1" && pwd) || { echo "no bundle folder $1" >&2; exit 2; }
out=$2; shift 2
suite=models; only=""; dispatch=""; peers=torch,jax; jax_shapes=record; iters=""
budget=420; grace=60; peer_timeout=150; afdep_timeout=240; append=0; work=""
tokens=""; backend=cuda; torch_impls=eager,compile
python=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --suite) suite=$2; shift 2;;
    --shapes) only=$2; shift 2;;
    --dispatch) dispatch=$2; shift 2;;
    --peers) peers=$2; shift 2;;
    --jax-shapes) jax_shapes=$2; shift 2;;
    --iters) iters=$2; shift 2;;
    --budget) budget=$2; shift 2;;
    --peer-timeout) peer_timeout=$2; shift 2;;
    --afdep-timeout) afdep_timeout=$2; shift 2;;
    --append) append=1; shift;;
    --work) work=$2; shift 2;;
    --python) python=$2; shift 2;;
    --tokens) tokens=$2; shift 2;;
    --backend) backend=$2; shift 2;;
    --torch-impls) torch_impls=$2; shift 2;;
    -h|--help) usage;;
    *) echo "unknown argument $1" >&2; usage;;
  esac
done
. "$(dirname "$0")/bundle_setup.sh"
bundle_setup afdep-suite
cleanup() { if [ $made_work -eq 1 ]; then rm -rf "$work"; fi; }
trap cleanup EXIT
log="$out/run.log"
if [ $append -eq 0 ]; then : > "$log"; : > "$out/afdep.jsonl"; : > "$out/torch.jsonl"; : > "$out/jax.jsonl"; fi
touch "$out/afdep.jsonl" "$out/torch.jsonl" "$out/jax.jsonl"
say() { echo "run_suite: $*" | tee -a "$log" >&2; }
export AFDEP_KERNEL_CACHE=${AFDEP_KERNEL_CACHE:-$work/kernel-cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$work/inductor-cache}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# JAX: allocate what it needs (not 75 % of the GPU up front)
export XLA_PYTHON_CLIENT_PREALLOCATE=false
commit=$(cat "$bundle/commit.txt" 2>/dev/null || echo unknown)
has() { [[ ",$1," == *",$2,"* ]]; }

say "$(date -u +%Y-%m-%dT%H:%M:%SZ) bundle $bundle (commit $commit), kernels $("$afdep" kernels --digest 2>/dev/null || echo unknown)"
say "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi not available')"
tflag=(); [ -n "$tokens" ] && tflag=(--tokens "$tokens")
cells=$("$afdep" moe --suite "$suite" "${tflag[@]}" --list) || { say "afdep moe --suite $suite --list failed"; exit 2; }
torch_dev=(); jax_dev=()
[ "$backend" = cpu ] && { torch_dev=(--device cpu); jax_dev=(--platform cpu); }
say "suite $suite, peers $peers (jax on: $jax_shapes), budget ${budget}s, peer timeout ${peer_timeout}s, work $work"

# a row for a cell that produced none: file impl shape tokens status note [dispatch]
missing_row() {
  printf '{"shape":"%s","tokens":%s,"impl":"%s","dispatch":"%s","fwd_ms":null,"train_ms":null,"status":"%s","note":"%s"}\n' \
    "$3" "$4" "$2" "${7:-sorted}" "$5" "$6" >> "$1"
}
# whether FILE has a row of IMPL at (shape, tokens)
has_row() { grep -F "\"impl\": \"$2\"" "$1" 2>/dev/null | grep -F "\"shape\": \"$3\"" | grep -qF "\"tokens\": $4,"; }
has_afdep_row() { grep -F '"impl":"afdep"' "$1" 2>/dev/null | grep -F "\"shape\":\"$2\"" | grep -qF "\"tokens\":$3,"; }

start=$(date +%s)
rc_all=0
# the time limit of a process: its own, or what is left until budget + grace, if less
limit() { local left=$(( start + budget + grace - $(date +%s) )); if [ $left -lt "$1" ]; then echo $(( left > 1 ? left : 1 )); else echo "$1"; fi; }
while read -r name t cell_iters; do
  [ -z "$name" ] && continue
  if [ -n "$only" ] && ! has "$only" "$name"; then continue; fi
  it=${iters:-$cell_iters}
  elapsed=$(( $(date +%s) - start ))
  if [ $elapsed -ge "$budget" ]; then
    say "$name, $t tokens: not run (budget of ${budget}s spent)"
    missing_row "$out/afdep.jsonl" afdep "$name" "$t" skipped "not run: the suite's --budget of ${budget}s was spent" sorted
    continue
  fi
  say "$name, $t tokens: afdep (${elapsed}s into the suite)"
  s=$(date +%s)
  dflag=(); [ -n "$dispatch" ] && dflag=(--dispatch "$dispatch")
  lim=$(limit "$afdep_timeout")
  timeout --kill-after=10 "$lim" "$afdep" moe --backend "$backend" --shape "$name" --tokens "$t" \
    --iters "$it" "${dflag[@]}" --write-inputs "$work" --json-out "$out/afdep.jsonl" \
    > /dev/null 2> >(tee -a "$log" >&2)
  rc=$?
  say "$name, $t tokens: afdep rc=$rc, $(( $(date +%s) - s ))s"
  [ $rc -ne 0 ] && rc_all=1
  if ! has_afdep_row "$out/afdep.jsonl" "$name" "$t"; then
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then st=timeout; why="killed after ${lim}s"; else st=error; why="afdep exited with rc=$rc and no row (see run.log)"; fi
    missing_row "$out/afdep.jsonl" afdep "$name" "$t" "$st" "$why" sorted
  fi
  inputs="$work/$name/moe-inputs-$t.safetensors"
  if [ ! -f "$inputs" ]; then
    say "$name, $t tokens: no input file (afdep did not write it): no peers"
    continue
  fi
  if has "$peers" torch; then
    s=$(date +%s); lim=$(limit "$peer_timeout")
    timeout --kill-after=10 "$lim" "$python" "$peerdir/moe_torch.py" --inputs "$work/$name" \
      --tokens "$t" --iters "$it" --impls "$torch_impls" --check-syncs count --json-out "$out/torch.jsonl" \
      "${torch_dev[@]}" > /dev/null 2> >(tee -a "$log" >&2)
    rc=$?
    say "$name, $t tokens: torch rc=$rc, $(( $(date +%s) - s ))s"
    want=(); has "$torch_impls" eager && want+=(torch_grouped_mm); has "$torch_impls" compile && want+=(torch_compile)
    for impl in "${want[@]}"; do
      if ! has_row "$out/torch.jsonl" "$impl" "$name" "$t"; then
        if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then st=timeout; why="killed after ${lim}s"; else st=error; why="the process exited with rc=$rc and no row (see run.log)"; fi
        missing_row "$out/torch.jsonl" "$impl" "$name" "$t" "$st" "$why"
      fi
    done
  fi
  if has "$peers" jax && { [ "$jax_shapes" = all ] || has "$jax_shapes" "$name"; }; then
    s=$(date +%s); lim=$(limit "$peer_timeout")
    timeout --kill-after=10 "$lim" "$python" "$peerdir/moe_jax.py" --inputs "$work/$name" \
      --tokens "$t" --iters "$it" --json-out "$out/jax.jsonl" "${jax_dev[@]}" \
      > /dev/null 2> >(tee -a "$log" >&2)
    rc=$?
    say "$name, $t tokens: jax rc=$rc, $(( $(date +%s) - s ))s"
    if ! has_row "$out/jax.jsonl" jax_ragged_dot "$name" "$t"; then
      if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then st=timeout; why="killed after ${lim}s"; else st=error; why="the process exited with rc=$rc and no row (see run.log)"; fi
      missing_row "$out/jax.jsonl" jax_ragged_dot "$name" "$t" "$st" "$why"
    fi
  fi
  rm -f "$inputs"
done <<< "$cells"
say "suite done in $(( $(date +%s) - start ))s"

if [ $append -eq 0 ] || [ ! -f "$out/moe.md" ]; then
  if [ -f "$bundle/docs/perf/moe.md" ]; then cp "$bundle/docs/perf/moe.md" "$out/moe.md"; fi
fi
"$afdep" report moe --rows "$out/afdep.jsonl" "$out/torch.jsonl" "$out/jax.jsonl" \
  --md "$out/moe.md" --png "$out/moe.png" --commit "$commit" > /dev/null 2> >(tee -a "$log" >&2)
rc_report=$?
say "report: rc=$rc_report; results in $out"
[ $rc_all -eq 0 ] && [ $rc_report -eq 0 ]
