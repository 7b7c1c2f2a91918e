#!/usr/bin/env bash
# The single-GPU latency table of the fused exchange (docs/perf/exchange.md, "Fused engine on
# one H200"): N ranks emulated as threads on ONE GPU, so it measures protocol overhead, not
# NVLink.
#
#   docs/perf/exchange_gpu_run.sh BUNDLE OUT
#
# BUNDLE holds bin/afdep (a GPU-test bundle, `cargo xtask gpu-test --bundle DIR`, or any folder
# with a release `afdep` in bin/) and optionally commit.txt; OUT receives:
#   env.txt         date, GPU, driver, kernel digest, commit
#   rows.jsonl      every row of `afdep exchange-arms` (per repeat, then the summaries)
#   arms-RATIO.md   the runner's table per ratio (median µs, paired change against payload-first)
#   table.md        the table for docs/perf/exchange.md (round, dispatch and combine per arm)
#   RATIO.log       the runner's stderr per ratio
#
# The record's setting: bf16, hidden 2048, top-8 of 128 experts (96 at 1A:3F), capacity 2048,
# 24 transport SMs, tokens 1..2048 per attention rank, ratios 3A:1F, 2A:2F, 1A:3F and EP4. Each
# arm runs in its own process, in rotated orders over REPEATS repeats. Experts are the identity
# on the host (the timed quantity is the dispatch + combine round, device time from CUDA events).
#
# Environment: GRAPH (1: time CUDA-graph replays of device rounds, `afdep exchange --graph`:
# each child captures its arm once (ARMS may add `auto`: one graph of every arm, the arm chosen
# on the device by the token bucket) and times whole replays with CUDA events; the dispatch and
# combine columns then say `–`, per-phase times come from eager runs only; unset: eager rounds),
# ARMS (default the three arms; `auto` too; arms the engine lacks give `unsupported` rows),
# REPEATS (3), ROUNDS (timed rounds per token count and process, 20), WARMUP (3),
# TOKENS (1,8,32,128,512,1024,2048), RATIOS ("3A:1F 2A:2F 1A:3F EP4"), HIDDEN (2048),
# LAUNCH (empty: the ranks of a child are threads of one process; N: N processes per child,
# one per rank, through `afdep launch`: the multi-GPU run, e.g.
#   LAUNCH=4 ENGINE="--backend cuda --transport nvlink --one-gpu-per-rank" RATIOS="3A:1F 2A:2F 1A:3F EP4"
# and NCCL on the same rounds: LAUNCH=4 ARMS=payload-first ENGINE="--backend cpu --transport nccl"),
# ENGINE ("--backend cuda --transport nvlink --device 0": the fused engine, every rank on GPU 0;
# `ENGINE="--backend cpu --transport loopback" HIDDEN=16 TOKENS=1,8 ROUNDS=2` is a dry run of
# this script on a machine without a GPU).
set -euo pipefail
# shellcheck source=docs/perf/bundle_common.sh
. "$(dirname "$0")/bundle_common.sh"
perf_start "$@"
arms=${ARMS:-payload-first,count-first,count-first-source}
repeats=${REPEATS:-3}
rounds=${ROUNDS:-20}
warmup=${WARMUP:-3}
tokens=${TOKENS:-1,8,32,128,512,1024,2048}
ratios=${RATIOS:-"3A:1F 2A:2F 1A:3F EP4"}
hidden=${HIDDEN:-2048}
engine=${ENGINE:-"--backend cuda --transport nvlink --device 0"}
mode=eager
if [ "${GRAPH:-0}" = 1 ]; then
  engine="$engine --graph"
  mode=graph
fi

{
  perf_env
  echo "arms: $arms; repeats $repeats; rounds $rounds (+$warmup warm-up) per token count and process"
  if [ "$mode" = graph ]; then
    echo "mode: graph (CUDA-graph replays of device rounds, device identity experts; round = the slowest rank's whole replay; no per-phase times)"
  else
    echo "mode: eager (host-launched rounds, host identity experts; round = slowest dispatch + slowest combine)"
  fi
  if [ -n "${LAUNCH:-}" ]; then
    echo "engine: $engine (ranks: $LAUNCH processes per child through afdep launch)"
  else
    echo "engine: $engine (ranks: threads of one process; with --device 0 all on GPU 0: single-GPU rank emulation)"
  fi
} | tee "$out/env.txt"

: > "$out/rows.jsonl"
start=$(date +%s)
for ratio in $ratios; do
  experts=128
  [ "$ratio" = "1A:3F" ] && experts=96
  tag=${ratio//:/}
  echo "== $ratio ($experts experts), $(( $(date +%s) - start )) s so far" | tee -a "$out/env.txt"
  "$afdep" exchange-arms ${LAUNCH:+--launch "$LAUNCH"} --arms "$arms" --repeats "$repeats" \
    --json-out "$out/rows.jsonl" --table "$out/arms-$tag.md" -- \
    $engine \
    --topology "$ratio" --hidden "$hidden" --experts "$experts" --top-k 8 --capacity 2048 \
    --payload bf16 --transport-sms 24 --tokens "$tokens" \
    --expert identity --rounds "$rounds" --warmup "$warmup" \
    > /dev/null 2> "$out/$tag.log" || { echo "$ratio failed:"; tail -30 "$out/$tag.log"; exit 1; }
done
echo "total: $(( $(date +%s) - start )) s" | tee -a "$out/env.txt"

# the table for docs/perf/exchange.md: per ratio and token count, every arm's median over the
# repeats of round, dispatch and combine (µs), and the paired change against payload-first
python3 - "$out/rows.jsonl" "$arms" > "$out/table.md" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
arms = sys.argv[2].split(",")
def med(v):
    v = sorted(x for x in v if x is not None)
    return v[len(v) // 2] if v else None
def us(v):
    return "–" if v is None else f"{v:.1f}"
rep = [r for r in rows if r["kind"] == "repeat"]
summ = {(r["topology"], tuple(r["tokens"]), r["arm"]): r for r in rows if r["kind"] == "arms"}
keys = []
for r in rep:
    k = (r["topology"], tuple(r["tokens"]))
    if k not in keys:
        keys.append(k)
print("| ratio | tokens | arm | round µs | dispatch µs | combine µs | host wall µs | change vs payload-first |")
print("|---|---:|---|---:|---:|---:|---:|---:|")
for topo, tokens in keys:
    for arm in arms:
        s = summ.get((topo, tokens, arm))
        if s is None:
            continue
        t = tokens[0]
        if s["status"] == "unsupported":
            print(f"| {topo} | {t} | {arm} | unsupported | | | | |")
            continue
        mine = [r for r in rep if r["topology"] == topo and tuple(r["tokens"]) == tokens and r["arm"] == arm]
        d = med([r["dispatch_us"] for r in mine])
        c = med([r["combine_us"] for r in mine])
        w = med([r["wall_us"] for r in mine])
        ch = "" if arm == "payload-first" or s["change_pct"] is None else f"{s['change_pct']:+.1f} %"
        print(f"| {topo} | {t} | {arm} | {s['median_us']:.1f} | {us(d)} | {us(c)} | {w:.0f} | {ch} |")
EOF
cat "$out/table.md"
