#!/usr/bin/env bash
# The exchange round-trip baseline of docs/perf/exchange.md: loopback (ranks as threads) and UCX
# over tcp and shared memory (one process per rank through `afdep launch`), 2 and 4 ranks,
# 1 to 2,048 tokens per attention rank at hidden 2048 (128 experts, top-8), identity experts
# (the exchange alone), the median of ROUNDS rounds after WARMUP warm-ups.
#   docs/perf/exchange_run.sh AFDEP OUT.jsonl      (AFDEP: a release afdep built --features ucx)
set -euo pipefail
afdep=$1; out=$2
rounds=${ROUNDS:-30}; warmup=${WARMUP:-3}
tokens=1,8,32,128,512,1024,2048
common=(--backend cpu --hidden 2048 --experts 128 --top-k 8 --capacity 2048 --expert identity
        --tokens "$tokens" --rounds "$rounds" --warmup "$warmup" --timeout-ms 120000 --json-out "$out")
: > "$out"
for topo in 1A:1F 3A:1F; do
  "$afdep" exchange --transport loopback --topology "$topo" "${common[@]}" > /dev/null
  n=$([ "$topo" = 1A:1F ] && echo 2 || echo 4)
  for tls in tcp shm; do
    "$afdep" launch -n "$n" --timeout 1200 -- "$afdep" exchange --multi-process --transport ucx \
      --ucx-tls "$tls" --topology "$topo" "${common[@]}" > /dev/null
  done
done
