#!/usr/bin/env bash
# The overlap-under-load table of the fused exchange (docs/perf/exchange.md, "Overlap under
# load"): CUDA-graph replays of device rounds, each token count's rounds run twice on the same
# engines, alone and while a bf16 GEMM runs back to back on its own stream of every GPU the
# ranks use (`afdep exchange --load gemm`), at several transport SM budgets.
#
#   docs/perf/exchange_load_run.sh BUNDLE OUT
#
# BUNDLE holds bin/afdep (a GPU-test bundle, `cargo xtask gpu-test --bundle DIR`, or any folder
# with a release `afdep` in bin/) and optionally commit.txt; OUT receives:
#   env.txt      date, GPU, driver, kernel digest, commit, settings, time per configuration
#   rows.jsonl   every row (one per ratio, hidden, SM budget and token count; `load` holds the
#                round alone and loaded, the GEMM per launch alone and under the rounds)
#   table.md     the table for docs/perf/exchange.md
#   RATIO-hHIDDEN-smSMS.log   afdep's stderr per configuration
#
# The matrix (estimated at about 2 minutes on one H200 with the defaults; not yet run): ratios 3A:1F and 2A:2F, hidden
# 2048 and 7168, transport SM budgets 7, 23 and 24, tokens 1, 128 and 2,048 per attention rank;
# bf16, top-8 of 128 experts, capacity 2048, identity experts (no expert kernel: the round is
# the exchange alone), arm count-first-source (the fastest graph arm, docs/perf/exchange.md).
# Every row's output is checked against the oracle bit for bit in both passes, and the GEMM's
# output under load against a host reference on a slice (a mismatch fails the run).
#
# Environment: LOAD (gemm:8192,8192,8192), RATIOS ("3A:1F 2A:2F"), HIDDENS ("2048 7168"),
# SMS ("7 23 24"), TOKENS (1,128,2048), ARM (count-first-source), ROUNDS (timed rounds per pass
# and token count, 50), WARMUP (5), MODE (--graph; --device-rounds for eager device rounds),
# ENGINE ("--backend cuda --transport nvlink --device 0": every rank a thread on GPU 0, single-GPU
# rank emulation; "--backend cuda --transport nvlink --one-gpu-per-rank" on a machine with a GPU
# per rank: the load then runs on every GPU).
set -euo pipefail
# shellcheck source=docs/perf/bundle_common.sh
. "$(dirname "$0")/bundle_common.sh"
perf_start "$@"
load=${LOAD:-gemm:8192,8192,8192}
ratios=${RATIOS:-"3A:1F 2A:2F"}
hiddens=${HIDDENS:-"2048 7168"}
sms_list=${SMS:-"7 23 24"}
tokens=${TOKENS:-1,128,2048}
arm=${ARM:-count-first-source}
rounds=${ROUNDS:-50}
warmup=${WARMUP:-5}
mode=${MODE:---graph}
engine=${ENGINE:-"--backend cuda --transport nvlink --device 0"}

perf_begin "load: $load; arm $arm; $mode; rounds $rounds (+$warmup warm-up) per pass and token count" \
  "engine: $engine"
for ratio in $ratios; do
  for hidden in $hiddens; do
    for sms in $sms_list; do
      # shellcheck disable=SC2086 # ENGINE and MODE are lists of flags
      perf_run "${ratio//:/}-h$hidden-sm$sms" "$afdep" exchange $engine $mode --arm "$arm" \
        --load "$load" \
        --topology "$ratio" --hidden "$hidden" --experts 128 --top-k 8 --capacity 2048 \
        --payload bf16 --transport-sms "$sms" --tokens "$tokens" \
        --expert identity --rounds "$rounds" --warmup "$warmup" \
        --json-out "$out/rows.jsonl"
    done
  done
done
perf_total

# the table for docs/perf/exchange.md: per ratio, hidden and token count, the round alone and
# under load and the GEMM alone and under the rounds, per SM budget
python3 - "$out/rows.jsonl" > "$out/table.md" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def f(v, fmt):
    return "–" if v is None else format(v, fmt)
print("| ratio | hidden | transport SMs | tokens | round µs alone | round µs loaded | round slowdown "
      "| GEMM µs alone | GEMM µs loaded | GEMM slowdown | GEMM TFLOP/s alone / loaded | duty | GEMM launches loaded | status |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
for r in rows:
    l = r.get("load")
    if l is None:
        continue
    print(f"| {r['topology']} | {r['hidden']} | {r['transport_sms']} | {max(r['tokens'])} "
          f"| {f(l['round_us_alone'], '.1f')} | {f(l['round_us_loaded'], '.1f')} | {f(l['round_slowdown'], '.2f')}× "
          f"| {f(l['gemm_us_alone'], ',.0f')} | {f(l['gemm_us_loaded'], ',.0f')} | {f(l['gemm_slowdown'], '.2f')}× "
          f"| {f(l['gemm_tflops_alone'], '.0f')} / {f(l['gemm_tflops_loaded'], '.0f')} | {f(l['round_duty'], '.2f')} "
          f"| {l['gemm_launches_loaded']} | {r['status']} |")
EOF
cat "$out/table.md"
perf_end
