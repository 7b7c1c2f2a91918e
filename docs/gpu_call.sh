#!/usr/bin/env bash
# One device call that checks everything at once, for a short device budget: every lane in
# parallel on one GPU (timings under this load are not measurements). The matrix in five
# run.sh lanes (the soak runs alone in docs/gpu_perf_call.sh), four racecheck shards of gpu_layer with RACE=1 (all passed on
# 2026-12-06: a regression check, one process at a time for host memory), Python (bundle/py, crates/afdep-py/gpu/bundle.sh), the ws weight-gradient tests
# (in the matrix since the ws kernel became the default), the trace files of 3A:1F and 2A:2F, and the NCCL EP1 rows.
# Everything goes into $OUT/all.tgz (the device tool returns only a few files), small
# summaries beside it.
#
# Prepare here: `cargo xtask gpu-test --bundle /tmp/b4 && tar cf - -C /tmp b4 | xz -T2 -6 > bundle/bundle.txz`
# (xz: a third of the gzip size, so the bundle, the Python wheel and extra binaries fit the
# 64 MiB carry; bundle/bundle.tgz from `tar czf` still works)
# and `VENV=... bash crates/afdep-py/gpu/bundle.sh`; then, with carry ["bundle"]:
#   LIMIT=SECONDS bash docs/gpu_call.sh
# (LIMIT: the call's own time bound; every lane stops before it.)
set -u
START=$(date +%s); LIMIT=${LIMIT:-290}
left() { echo $(( LIMIT - ($(date +%s) - START) )); }
cap() { local l=$(( $(left) - 12 )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
ROOT=$PWD; W=/tmp/w; mkdir -p $W "$OUT"
B=$(ls "$ROOT"/bundle/bundle.txz "$ROOT"/bundle/bundle.tgz 2>/dev/null | head -1)
cd /tmp && tar xf "$B" && cd /tmp/b4 || exit 3
export AFDEP_REQUIRE_GPU=1 AFDEP_KERNEL_CACHE=/tmp/kc
step() { echo "== $1 $(date -u +%T) left $(left)" | tee -a $W/steps.txt; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $W/gpu.txt 2>&1
cat commit.txt >> $W/gpu.txt; ./bin/afdep kernels --digest >> $W/gpu.txt 2>&1
step lanes
# TO: a lane's per-binary timeout (run.sh --timeout), 200 s unless set
lane() { local name=$1; shift; timeout $(cap 400) ./run.sh "$@" --skip-ignored --timeout "${TO:-200}" --logs $W/$name > $W/$name.txt 2>&1; echo "lane $name rc=$?" >> $W/$name.txt; }
lane a --only gpu_layer &
# gpu_soak is not here: its device-memory check reads the whole GPU's free memory, which the
# other lanes move (it failed that check under this load on 2026-12-06 with 0 mismatches and
# flat host memory); it runs alone in docs/gpu_perf_call.sh (PARTS soak)
lane a2 --only gpu_reference,gpu_process_death,gpu_router,gpu_router_mma &
lane b1 --only gpu_nvlink_count_first,gpu_nvlink_engines,gpu_nvlink_graph,gpu_nvlink_fp8,gpu_nvlink_faults,gpu_nvlink_auto_arm,gpu_nvlink_rejects &
lane b2 --only gpu_pipeline,gpu_nvlink_on_stream,gpu_nvlink_trace,gpu_nvlink,gpu_nccl,gpu_gemm,gpu_fault,gpu_external &
lane b3 --only gpu_context,gpu_fp8,gpu_graph,gpu_layout,gpu_offsets64,gpu_permute,gpu_ucx_device,gpu_validate &
# racecheck shards only with RACE=1: the gpu_layer racecheck is complete (every shard passed on
# 2026-12-05/06), and a shard's 70-110 GB resident set beside the lanes starves the host (the
# likely cause of the 2026-12-06 04:33 on-stream timeout)
[ "${RACE:-0}" = 1 ] || echo "racecheck not run (RACE=1 runs it)" > $W/race.txt
[ "${RACE:-0}" = 1 ] && ( for spec in router_layer_matches_the_oracle:0 given_routes_match_the_oracle:1 router_layer_matches_the_oracle:1 router_layer_matches_the_oracle:3; do
    t=${spec%%:*}; i=${spec##*:}; [ "$(left)" -gt 60 ] || { echo "$t $i/4 not run (time)" >> $W/race.txt; continue; }
    AFDEP_TEST_SHARD=$i/4 AFDEP_TEST_MAX_TOKENS=33 /usr/bin/time -v timeout $(cap 120) compute-sanitizer --tool racecheck \
      --error-exitcode 99 tests/gpu_layer $t --exact --test-threads=1 > $W/race-$t-$i.log 2>&1
    echo "$t shard $i/4 rc=$? at $(( $(date +%s) - START ))s" >> $W/race.txt
  done ) &
( [ -d "$ROOT/bundle/py" ] && cd "$ROOT" && OUT=$W AFDEP_TRAIN_STEPS=${STEPS:-20} timeout $(cap 400) bash bundle/py/go.sh > $W/py.txt 2>&1; echo "py rc=$?" >> $W/py.txt ) &
( for topo in 3A:1F 2A:2F; do for mode in --graph --device-rounds; do
    n=$(echo "$topo$mode" | tr -d ':-')
    timeout $(cap 30) ./bin/afdep exchange --backend cuda --transport nvlink --device 0 --topology $topo \
      $mode --arm auto --tokens 1,128,2048 --rounds 5 --trace $W/trace-$n.json \
      --json-out $W/trace-rows.jsonl > $W/trace-$n.txt 2>&1
    echo "trace $n rc=$?" >> $W/steps.txt
  done; done
  timeout $(cap 30) ./bin/afdep exchange --backend cuda --transport nccl --arm payload-first --expert identity \
    --topology EP1 --tokens 1,128,2048 --rounds 10 --warmup 2 --json-out $W/nccl-ep1.jsonl > $W/nccl-ep1.txt 2>&1
  echo "nccl EP1 rc=$?" >> $W/steps.txt ) &
wait
step done
grep -h -E "^test |RACECHECK SUMMARY|Maximum resident|Exit status" $W/race-*.log > $W/race-summary.txt 2>/dev/null
for l in a a2 b1 b2 b3; do echo "## $l"; cat $W/$l/summary.txt 2>/dev/null || { tail -3 $W/$l.txt; for f in $W/$l/*.log; do echo "$(basename $f): $(./run.sh --count-results $f)"; done; }; done > $W/summary.txt 2>&1
cp $W/steps.txt $W/race.txt $W/gpu.txt $W/summary.txt $W/py.txt "$OUT/" 2>/dev/null
tar czf "$OUT/all.tgz" -C /tmp w
