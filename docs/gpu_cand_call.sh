#!/usr/bin/env bash
# One quiet device call for issue 20's and issue 17's candidate branches, from the bundle of
# docs/build_cand_bundle.sh (carry ["bundle"]; this script is copied into it):
#   LIMIT=570 [EPI=1] [AB_WHICH=...] [PROBES=...] bash bundle/gpu_cand_call.sh
# tests: main's gpu_nvlink_graph and never-open gate, beside the same with programmatic
#   edges on (AFDEP_GRAPH_PDL=1, main since 2026-12-08); ab: the gated 1-token and 2,048-token graph rounds (3A:1F,
#   auto, identity experts) of 52a7948 (host-started, as issue 20 measured it), main and each
#   candidate, alternating, two repeats; probe: the probe points of the gated rounds; epiab
#   (EPI=1): `afdep moe` of main against dh-prefetch at the Mixtral- and GPT-OSS-like cells;
#   candtests (CANDTESTS=1): plan-lean's fused test binaries in two lanes; icache: the
#   instruction-fetch micro-measurement (docs/perf/micro/run.sh). TESTS=0 leaves the tests out,
#   ICACHE=0 the micro. Everything into $OUT/e1.tgz.
set -u
START=$(date +%s); LIMIT=${LIMIT:-540}
left() { echo $(( LIMIT - ($(date +%s) - START) )); }
ROOT=$PWD; W=/tmp/e1; mkdir -p $W "$OUT"
cd /tmp && [ -d /tmp/b4 ] || tar xf "$ROOT/bundle/bundle.txz"
for n in 52 plan; do [ -f "$ROOT/bundle/afdep-$n.gz" ] && gzip -dc "$ROOT/bundle/afdep-$n.gz" > /tmp/afdep-$n && chmod +x /tmp/afdep-$n; done
cd "$ROOT"
export AFDEP_REQUIRE_GPU=1 AFDEP_KERNEL_CACHE=/tmp/kc
step() { echo "== $1 $(date -u +%T) left $(left)" | tee -a $W/steps.txt; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader; cat /tmp/b4/commit.txt;
  /tmp/b4/bin/afdep kernels --digest; /tmp/afdep-plan kernels --digest; /tmp/afdep-52 kernels --digest 2>&1 | tail -1; } > $W/env.txt 2>&1
cat $W/env.txt
if [ "${TESTS:-1}" != 0 ]; then
step tests
( cd /tmp/b4 && timeout 170 tests/gpu_nvlink_graph --test-threads=1 > $W/t-graph.log 2>&1; echo "gpu_nvlink_graph rc=$? $(grep '^test result' $W/t-graph.log | tail -1)" >> $W/steps.txt
  timeout 60 tests/gpu_nvlink_faults a_start_gate_that_never_opens --test-threads=1 --nocapture > $W/t-never.log 2>&1; echo "never-open rc=$? $(grep '^test result' $W/t-never.log | tail -1)" >> $W/steps.txt ) &
# main's graph tests again with programmatic edges on (every capture of the binary), beside
( cd /tmp/b4/tests && AFDEP_GRAPH_PDL=1 timeout 170 ./gpu_nvlink_graph --test-threads=1 > $W/t-pdl-graph.log 2>&1; echo "pdl gpu_nvlink_graph rc=$? $(grep '^test result' $W/t-pdl-graph.log | tail -1)" >> $W/steps.txt
  AFDEP_GRAPH_PDL=1 timeout 60 ./gpu_nvlink_faults a_start_gate_that_never_opens --test-threads=1 --nocapture > $W/t-pdl-never.log 2>&1; echo "pdl never-open rc=$? $(grep '^test result' $W/t-pdl-never.log | tail -1)" >> $W/steps.txt ) &
wait
fi
step ab
# names: old (52a7948, host-started), new / newg (main, host-started / gated), pdl / pdlg (main
# with AFDEP_GRAPH_PDL=1), plang (the plan-lean candidate, gated, with PDL), frontsg (main's
# fronts, gated, with PDL)
declare -A cbin=([new]=/tmp/b4/bin/afdep [old]=/tmp/afdep-52 [newg]=/tmp/b4/bin/afdep [pdlg]=/tmp/b4/bin/afdep [pdl]=/tmp/b4/bin/afdep [plang]=/tmp/afdep-plan [frontsg]=/tmp/b4/bin/afdep)
declare -A cenv=([pdlg]=AFDEP_GRAPH_PDL=1 [pdl]=AFDEP_GRAPH_PDL=1 [plang]=AFDEP_GRAPH_PDL=1 [frontsg]="AFDEP_FUSED_FRONTS=1 AFDEP_GRAPH_PDL=1")
declare -A cflag=([newg]=--start-gate [pdlg]=--start-gate [plang]=--start-gate [frontsg]=--start-gate)
for rep in 1 2; do for which in ${AB_WHICH:-old newg pdlg plang new pdl frontsg}; do
  [ "$(left)" -gt ${AB_RESERVE:-200} ] || break 2
  env ${cenv[$which]:-} timeout 60 ${cbin[$which]} exchange --backend cuda --transport nvlink \
    --device 0 --topology 3A:1F --graph --arm auto --expert identity ${cflag[$which]:-} \
    --tokens 1,2048 --rounds 30 --warmup 5 --json-out $W/ab-$which.jsonl > $W/ab-$which-$rep.txt 2>&1
  echo "ab $which rep $rep rc=$?" >> $W/steps.txt
done; done
python3 - $W >> $W/steps.txt <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(sys.argv[1] + "/ab-*.jsonl")):
    w = os.path.basename(f)[3:-6]
    for l in open(f):
        r = json.loads(l)
        print("ab", w, r.get("tokens"), "median_us", r.get("median_us", r.get("round_us")), r.get("status"), r.get("start"), r.get("digest"))
PY
step probe
for spec in ${PROBES:-pdlg:/tmp/b4/bin/afdep:AFDEP_GRAPH_PDL=1 plang:/tmp/afdep-plan:AFDEP_GRAPH_PDL=1}; do
  IFS=: read -r n bin envs <<< "$spec"
  [ "$(left)" -gt ${PROBE_RESERVE:-110} ] || break
  env $envs AFDEP_NVRTC_OPTIONS=-DAFDEP_PROBE timeout 90 $bin exchange --backend cuda --transport nvlink --device 0 \
    --topology 3A:1F --graph --arm auto --expert identity --start-gate --tokens 1,2048 --rounds 30 --warmup 5 \
    --probe $W/probe-$n.json --json-out $W/probe-$n.jsonl > $W/probe-$n.txt 2>&1
  echo "probe $n rc=$?" >> $W/steps.txt
  grep -A45 "^probes:" $W/probe-$n.txt >> $W/steps.txt
done
if [ -n "${EPI:-}" ]; then
step epiab
gzip -dc "$ROOT/bundle/afdep-dh.gz" > /tmp/afdep-dh && chmod +x /tmp/afdep-dh
declare -A ebin=([main]=/tmp/b4/bin/afdep [dh]=/tmp/afdep-dh)
for cell in mixtral-8x7b:16384:sorted gpt-oss-120b:4096:sorted; do
  IFS=: read -r shape tok disp <<< "$cell"
  for b in main dh; do
    [ "$(left)" -gt 60 ] || break 2
    rm -f $W/one.jsonl
    timeout $(( $(left) > 120 ? 100 : $(left) - 20 )) ${ebin[$b]} moe --backend cuda --shape $shape --tokens $tok --dispatch $disp --iters 5 \
      --json-out $W/one.jsonl > $W/epi-$shape-$b.log 2>&1
    echo "epiab $shape $b rc=$?" >> $W/steps.txt
    [ -f $W/one.jsonl ] && sed "s/^{/{\"build\":\"$b\",/" $W/one.jsonl >> $W/epiab.jsonl
  done
done
python3 - $W/epiab.jsonl >> $W/steps.txt <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print("epiab", r.get("shape"), r.get("tokens"), r["build"], "fwd", r.get("fwd_ms"), "train", r.get("train_ms"),
          "peak", r.get("peak_gib"), r.get("status"), r.get("digest"), r.get("device"))
PY
fi
if [ -n "${CANDTESTS:-}" ]; then
step candtests
[ -d /tmp/plan-tests ] || tar xf "$ROOT/bundle/plan-tests.txz" -C /tmp
lane() { for t in "$@"; do
  [ "$(left)" -gt 40 ] || break
  timeout "$(( $(left) - 30 ))" /tmp/plan-tests/$t --test-threads=1 > $W/cand-$t.log 2>&1
  echo "candtests $t rc=$? $(grep -h '^test result' $W/cand-$t.log | tail -1)" >> $W/steps.txt
done; }
( lane gpu_nvlink_graph gpu_nvlink_faults gpu_nvlink_rejects gpu_nvlink_on_stream ) &
( lane gpu_nvlink_count_first gpu_nvlink_engines gpu_pipeline gpu_nvlink_fp8 gpu_nvlink_auto_arm ) &
wait
fi
step icache
[ "${ICACHE:-1}" != 0 ] && [ "$(left)" -gt 40 ] && timeout $(( $(left) - 20 )) bash docs/perf/micro/run.sh $W > $W/floor.txt 2>&1; echo "icache rc=$?" >> $W/steps.txt
step end
cp $W/steps.txt $W/env.txt "$OUT/"
tar czf "$OUT/e1.tgz" -C /tmp e1
