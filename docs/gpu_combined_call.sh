#!/usr/bin/env bash
# The matrix call (docs/gpu_call.sh) and the quiet parts of docs/gpu_perf_call.sh in one device
# call, for a session whose device budget allows one start: OUT/m and OUT/p, then a
# Mixtral-like bench_layer row (time, peak_gib) in the time left. TOTAL: the whole bound (s);
# MLIMIT: the matrix part's; PARTS: the perf parts (default "trace load"; see docs/gpu_perf_call.sh).
T0=$(date +%s); TOTAL=${TOTAL:-500}
mkdir -p $OUT/m $OUT/p
OUT=$OUT/m LIMIT=${MLIMIT:-280} bash docs/gpu_call.sh > /dev/null 2>&1
grep -v "^afdep GPU\|^--skip\|kernel digest" $OUT/m/summary.txt | grep -v "^$"; cat $OUT/m/steps.txt; tail -1 $OUT/m/py.txt; cat $OUT/m/gpu.txt
rest=$(( TOTAL - ($(date +%s) - T0) ))
echo "== perf with $rest s"
OUT=$OUT/p PARTS="${PARTS:-trace load}" LIMIT=$(( rest - 45 )) bash docs/gpu_perf_call.sh > /dev/null 2>&1
cat $OUT/p/steps.txt; cat $OUT/p/load-table.md 2>/dev/null | head -40
[ -f $OUT/p/fold.jsonl ] && python3 -c "import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print('fold', r.get('topology'), r.get('mode'), r.get('arm'), r.get('payload'), r.get('tokens'), r.get('status'), r.get('round_us'))" $OUT/p/fold.jsonl | sort | uniq -c | sort -rn | head -60
for f in $OUT/p/ab52-*.jsonl; do [ -f "$f" ] && python3 -c "import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print(sys.argv[1].split('/')[-1], r.get('arm'), r.get('tokens'), r.get('round_us'), r.get('status'), r.get('kernel_digest'))" "$f"; done
rest=$(( TOTAL - ($(date +%s) - T0) ))
[ $rest -gt 40 ] && timeout $(( rest - 10 )) /tmp/b4/bin/bench_layer --shape 4096,14336,8,2,0 --tokens 16384 --dispatch sorted --iters 3 > $OUT/p/bench.jsonl 2>&1; cat $OUT/p/bench.jsonl
