#!/usr/bin/env bash
# The quiet device call that follows docs/gpu_call.sh (nothing else runs on the GPU, so these
# are measurements): the microbatch pipeline table (docs/perf/exchange_pipeline_run.sh), the
# ws weight-gradient A/B at the Mixtral-like shape (docs/perf/gemm_wgrad_run.sh), then the
# record shape's suite rows with the torch peers (peers/run_suite.sh) in the time left.
# Everything goes into $OUT/all.tgz, the summaries beside it.
#
# Prepare as for docs/gpu_call.sh (bundle/bundle.tgz); then, with carry ["bundle"]:
#   LIMIT=SECONDS bash docs/gpu_perf_call.sh
set -u
START=$(date +%s); LIMIT=${LIMIT:-540}
left() { echo $(( LIMIT - ($(date +%s) - START) )); }
ROOT=$PWD; W=/tmp/perf; mkdir -p $W "$OUT"
[ -d /tmp/b4 ] || { cd /tmp && tar xzf "$ROOT/bundle/bundle.tgz"; }
cd "$ROOT" || exit 3
export AFDEP_REQUIRE_GPU=1 AFDEP_KERNEL_CACHE=/tmp/kc
step() { echo "== $1 $(date -u +%T) left $(left)" | tee -a $W/steps.txt; }
step pipeline
timeout $(( $(left) > 230 ? 200 : $(left) - 30 )) bash docs/perf/exchange_pipeline_run.sh /tmp/b4 $W/pipeline \
  > $W/pipeline.txt 2>&1; echo "pipeline rc=$?" >> $W/steps.txt
step wgrad
timeout $(( $(left) > 230 ? 200 : $(left) - 30 )) bash docs/perf/gemm_wgrad_run.sh /tmp/b4 $W/wgrad \
  > $W/wgrad.txt 2>&1; echo "wgrad rc=$?" >> $W/steps.txt
step suite
b=$(( $(left) - 90 ))
if [ "$b" -gt 60 ]; then
  bash peers/run_suite.sh /tmp/b4 $W/suite --suite record --peers torch --jax-shapes none \
    --budget $b --peer-timeout $(( b < 150 ? b : 150 )) > $W/suite.txt 2>&1
  echo "suite rc=$?" >> $W/steps.txt
else
  echo "suite: not run (time)" >> $W/steps.txt
fi
step done
cp $W/steps.txt $W/pipeline.txt $W/wgrad.txt "$OUT/" 2>/dev/null
cp $W/pipeline/table.md "$OUT/pipeline-table.md" 2>/dev/null
cp $W/suite/moe.md "$OUT/suite-moe.md" 2>/dev/null
tar czf "$OUT/all.tgz" -C /tmp perf
