#!/usr/bin/env bash
# The microbatch pipeline table (docs/perf/exchange.md, "The microbatch pipeline"): a layer
# step's exchange with the real SwiGLU experts (the grouped GEMM) as M microbatches over two
# fused engines per rank (microbatch i+1's dispatch overlapping microbatch i's experts) against
# the same M rounds back to back on one engine (`afdep exchange --pipeline`).
#
#   docs/perf/exchange_pipeline_run.sh BUNDLE OUT
#
# BUNDLE holds bin/afdep (a GPU-test bundle, `cargo xtask gpu-test --bundle DIR`, or any folder
# with a release `afdep` in bin/) and optionally commit.txt; OUT receives:
#   env.txt      date, GPU, driver, kernel digest, commit, settings, time per configuration
#   rows.jsonl   every row (one per ratio, hidden, token count and M; `mode: pipeline`)
#   table.md     the table for docs/perf/exchange.md
#   RATIO-hHIDDEN.log   afdep's stderr per configuration
#
# The matrix (not yet run; estimated at a few minutes on one H200, most of it kernel
# compilation and the host oracle of the sampled tokens): ratios 3A:1F and 2A:2F, hidden 2048
# (expert width 768, a Qwen3-30B-A3B layer) and 7168 (width 2048, a DeepSeek-V3 layer's
# experts), 2,048 tokens per attention rank, M = 1, 2, 4; bf16, top-8 of 128 experts, capacity
# 2048, arm count-first-source. Each row: pipelined and sequential outputs compared bit for
# bit, 8 tokens per source against the oracle (within the bf16 tolerance), then the layer time
# of both (CUDA events, median of ROUNDS after WARMUP, alternating) and the FFN ranks' busy
# fraction from 3 traced runs of each. A mismatch fails the run.
#
# Environment: RATIOS ("3A:1F 2A:2F"), HIDDENS ("2048:768 7168:2048": hidden:width pairs),
# TOKENS (2048), MS (1,2,4), ARM (count-first-source), ROUNDS (20), WARMUP (3), ENGINE
# ("--backend cuda --transport nvlink --device 0": every rank a thread on GPU 0, single-GPU rank
# emulation, rows say `emulated: true`; "--backend cuda --transport nvlink --one-gpu-per-rank"
# on a machine with a GPU per rank).
set -euo pipefail
# shellcheck source=docs/perf/bundle_common.sh
. "$(dirname "$0")/bundle_common.sh"
perf_start "$@"
ratios=${RATIOS:-"3A:1F 2A:2F"}
hiddens=${HIDDENS:-"2048:768 7168:2048"}
tokens=${TOKENS:-2048}
ms=${MS:-1,2,4}
arm=${ARM:-count-first-source}
rounds=${ROUNDS:-20}
warmup=${WARMUP:-3}
engine=${ENGINE:-"--backend cuda --transport nvlink --device 0"}

perf_begin "pipeline: M $ms over 2 slots; arm $arm; tokens $tokens; rounds $rounds (+$warmup warm-up) each" \
  "engine: $engine"
for ratio in $ratios; do
  for hw in $hiddens; do
    hidden=${hw%%:*}
    width=${hw##*:}
    # shellcheck disable=SC2086 # ENGINE is a list of flags
    perf_run "${ratio//:/}-h$hidden" "$afdep" exchange $engine --pipeline "$ms" --arm "$arm" \
      --topology "$ratio" --hidden "$hidden" --width "$width" --experts 128 --top-k 8 \
      --capacity 2048 --payload bf16 --tokens "$tokens" --expert swiglu \
      --rounds "$rounds" --warmup "$warmup" \
      --json-out "$out/rows.jsonl"
  done
done
perf_total

python3 - "$out/rows.jsonl" > "$out/table.md" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| ratio | hidden | width | tokens | M | layer ms (pipelined) | sequential ms | speed-up "
      "| FFN busy (pipelined) | FFN busy (sequential) | emulated | status |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
for r in rows:
    if r.get("mode") != "pipeline":
        continue
    print(f"| {r['topology']} | {r['hidden']} | {r['width']} | {r['tokens']} | {r['microbatches']} "
          f"| {r['layer_ms']:.3f} | {r['sequential_ms']:.3f} | {r['speedup']:.2f}× "
          f"| {r['ffn_busy']:.2f} | {r['ffn_busy_sequential']:.2f} "
          f"| {'yes' if r['emulated'] else 'no'} | {r['status']} |")
PY
cat "$out/table.md"
perf_end
