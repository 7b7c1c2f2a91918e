#!/usr/bin/env bash
# The quiet device call that follows docs/gpu_call.sh (nothing else runs on the GPU, so these
# are measurements): the microbatch pipeline table (docs/perf/exchange_pipeline_run.sh), the
# ws weight-gradient A/B at the Mixtral-like shape (docs/perf/gemm_wgrad_run.sh), then the
# record shape's suite rows with the torch peers (peers/run_suite.sh) in the time left.
# Everything goes into $OUT/all.tgz, the summaries beside it.
#
# Prepare as for docs/gpu_call.sh (bundle/bundle.txz or .tgz); then, with carry ["bundle"]:
#   LIMIT=SECONDS bash docs/gpu_perf_call.sh
set -u
START=$(date +%s); LIMIT=${LIMIT:-540}
left() { echo $(( LIMIT - ($(date +%s) - START) )); }
ROOT=$PWD; W=/tmp/perf; mkdir -p $W "$OUT"
[ -d /tmp/b4 ] || { cd /tmp && tar xf "$(ls "$ROOT"/bundle/bundle.txz "$ROOT"/bundle/bundle.tgz 2>/dev/null | head -1)"; }
cd "$ROOT" || exit 3
export AFDEP_REQUIRE_GPU=1 AFDEP_KERNEL_CACHE=/tmp/kc
step() { echo "== $1 $(date -u +%T) left $(left)" | tee -a $W/steps.txt; }
# PARTS: which parts, in this order (default "onstream wgrad pipeline soak suite"; also "load", the
# overlap table of docs/perf/exchange_load_run.sh, "trace", the four trace files of issue 19 on a
# quiet GPU, "ab52", this build's graph round against 52a7948's (issue 20), "fold", a candidate build's
# oracle checks (bundle/afdepfold.gz), "partials", bf16 against f32 combine partials, "skew", this build's 1-token round per arm and barrier spin, and "ncu", per-kernel times of the record
# shape; "probe", the probe points inside the 1- and 2,048-token rounds' kernels (issue 20); "candtests", a candidate's fused test binaries (bundle/cand-NAME-tests.txz, FOLD_CAND=NAME);
# "onstream", gpu_nvlink_on_stream alone twice; "epiab", `afdep moe` against bundle/afdep-pre.gz (EPI_CELLS); "fused", the fused engine's binaries; "soak", gpu_soak alone; "bins", the matrix binaries named in BINS; "gemmsms", the
# overlap and pipeline tables with the GEMMs limited to GEMM_SMS SMs and without); each part gets at most
# 200 s (the suite: the time left). SUITE: run_suite.sh's arguments (default the record shape
# with the torch peers). AB_SHAPES / AB_ONLY / AB_DISPATCH pass to gemm_wgrad_run.sh.
cap200() { echo $(( $(left) > 230 ? 200 : $(left) - 30 )); }
for part in ${PARTS:-onstream wgrad pipeline soak suite}; do
  step "$part"
  case $part in
    pipeline)
      timeout "$(cap200)" bash docs/perf/exchange_pipeline_run.sh /tmp/b4 $W/pipeline \
        > $W/pipeline.txt 2>&1; echo "pipeline rc=$?" >> $W/steps.txt
      # PIPE_VARIANTS="NAME:VAR=VALUE ...": the table again with one environment variable set
      # (e.g. fronts:AFDEP_FUSED_FRONTS=1), RATIOS/HIDDENS as for the default run; tables into
      # steps.txt
      cat $W/pipeline/table.md >> $W/steps.txt 2>/dev/null
      for v in ${PIPE_VARIANTS:-}; do
        n=${v%%:*}; e=${v#*:}
        timeout "$(cap200)" env "$e" bash docs/perf/exchange_pipeline_run.sh /tmp/b4 $W/pipeline-$n \
          > $W/pipeline-$n.txt 2>&1; echo "pipeline $n ($e) rc=$?" >> $W/steps.txt
        cat $W/pipeline-$n/table.md >> $W/steps.txt 2>/dev/null
      done;;
    load)
      timeout "$(cap200)" bash docs/perf/exchange_load_run.sh /tmp/b4 $W/load \
        > $W/load.txt 2>&1; echo "load rc=$?" >> $W/steps.txt;;
    trace)
      # the trace files of 3A:1F and 2A:2F, graph and eager device rounds, on a quiet GPU (the
      # matrix call's traces run beside its lanes); `afdep report trace` draws them here
      for topo in 3A:1F 2A:2F; do for mode in --graph --device-rounds; do
        n=$(echo "$topo$mode" | tr -d ':-')
        timeout "$(( $(left) > 90 ? 40 : 10 ))" /tmp/b4/bin/afdep exchange --backend cuda --transport nvlink \
          --device 0 --topology $topo $mode --arm auto --tokens 1,128,2048 --rounds 5 \
          --trace $W/trace-$n.json --json-out $W/trace-rows.jsonl > $W/trace-$n.txt 2>&1
        echo "trace $n rc=$?" >> $W/steps.txt
      done; done;;
    partials)
      # issue 20 item 3: the combine's bf16 partials beside the exact f32 ones, same engines'
      # settings, quiet GPU: graph rounds, identity experts, the source arm, hidden 2048 and 7168
      for topo in 3A:1F 2A:2F; do for hidden in 2048 7168; do for pk in f32 bf16; do
        timeout "$(( $(left) > 90 ? 40 : 10 ))" /tmp/b4/bin/afdep exchange --backend cuda --transport nvlink \
          --device 0 --topology $topo --graph --arm count-first-source --expert identity \
          --hidden $hidden --experts 128 --top-k 8 --capacity 2048 --payload bf16 --partials $pk \
          --tokens 1,128,2048 --rounds 30 --warmup 5 --json-out $W/partials.jsonl \
          > $W/partials-$topo-$hidden-$pk.txt 2>&1
        echo "partials $topo h$hidden $pk rc=$?" >> $W/steps.txt
      done; done; done;;
    onstream)
      # gpu_nvlink_on_stream alone (it failed once under the matrix's load on 2026-12-06), twice
      for i in 1 2; do
        timeout "$(( $(left) > 90 ? 60 : 20 ))" /tmp/b4/tests/gpu_nvlink_on_stream --test-threads=1 \
          > $W/onstream-$i.log 2>&1; echo "onstream run $i rc=$?" >> $W/steps.txt
      done;;
    ab52)
      # issue 20's comparison: this build's graph round against 52a7948's (bundle/afdep52.gz, a
      # stripped release `afdep` of that commit) and, where the bundle has one, a candidate
      # build's (bundle/afdepfold.gz, bundle/cand-NAME.gz), on the same setting, alternating binaries: 3A:1F, the
      # auto arm (AB_ARM), identity experts, 1 and 2,048 tokens, 30 replays after 5 warm-ups,
      # AB_REPS repeats (2)
      [ -x /tmp/afdep52 ] || { gzip -dc "$ROOT/bundle/afdep52.gz" > /tmp/afdep52 && chmod +x /tmp/afdep52; }
      # candidates: bundle/afdepfold.gz (as "fold") and every bundle/cand-NAME.gz (as NAME)
      whiches="new old"
      declare -A cbin=([new]=/tmp/b4/bin/afdep [old]=/tmp/afdep52)
      for c in "$ROOT"/bundle/afdepfold.gz "$ROOT"/bundle/cand-*.gz; do
        [ -f "$c" ] || continue
        n=$(basename "$c" .gz); n=${n#cand-}; [ "$n" = afdepfold ] && n=fold
        [ -x /tmp/afdep-$n ] || { gzip -dc "$c" > /tmp/afdep-$n && chmod +x /tmp/afdep-$n; }
        cbin[$n]=/tmp/afdep-$n; whiches="$whiches $n"
      done
      # AB_VARIANTS="NAME=CAND:VAR=VALUE ...": candidate CAND's binary run as NAME with VAR=VALUE
      declare -A cenv=()
      for v in ${AB_VARIANTS:-}; do
        n=${v%%=*}; rest=${v#*=}; c=${rest%%:*}
        [ -n "${cbin[$c]:-}" ] || continue
        cbin[$n]=${cbin[$c]}; cenv[$n]=${rest#*:}; whiches="$whiches $n"
      done
      # AB_GATE=1: this build again as "gate", every rank's round behind the start gate
      # (--start-gate: the ranks' rounds start together on the device, rows `start: gate`)
      declare -A cflag=()
      [ "${AB_GATE:-0}" = 1 ] && { cbin[gate]=/tmp/b4/bin/afdep; cflag[gate]=--start-gate; whiches="$whiches gate"; }
      # AB_GATE_CANDS="NAME ...": candidate NAME's binary again as NAME-gate, behind the gate
      for c in ${AB_GATE_CANDS:-}; do
        [ -n "${cbin[$c]:-}" ] || continue
        cbin[$c-gate]=${cbin[$c]}; cflag[$c-gate]=--start-gate; whiches="$whiches $c-gate"
        [ -n "${cenv[$c]:-}" ] && cenv[$c-gate]=${cenv[$c]}
      done
      for rep in $(seq 1 "${AB_REPS:-2}"); do for which in $whiches; do
        bin=${cbin[$which]}
        # shellcheck disable=SC2086 # VAR=VALUE or nothing
        env ${cenv[$which]:-} timeout "$(( $(left) > 90 ? 40 : 10 ))" $bin exchange --backend cuda --transport nvlink \
          --device 0 --topology 3A:1F --graph --arm ${AB_ARM:-auto} --expert identity ${cflag[$which]:-} \
          --tokens 1,2048 --rounds 30 --warmup 5 --json-out $W/ab52-$which.jsonl \
          > $W/ab52-$which-$rep.txt 2>&1
        echo "ab52 $which rep $rep rc=$?" >> $W/steps.txt
      done; done
      # the same setting traced (1 token, 20 replays) with this build and the candidates (the
      # 52a7948 build has no --trace): where the round's time goes, ranks' start skew included
      for which in $whiches; do
        [ "$which" = old ] && continue
        # shellcheck disable=SC2086
        env ${cenv[$which]:-} timeout "$(( $(left) > 60 ? 30 : 5 ))" ${cbin[$which]} exchange --backend cuda --transport nvlink \
          --device 0 --topology 3A:1F --graph --arm ${AB_ARM:-auto} --expert identity ${cflag[$which]:-} \
          --tokens 1 --rounds 20 --warmup 5 --trace $W/ab52-trace-$which.json \
          > $W/ab52-trace-$which.txt 2>&1
        echo "ab52 trace $which rc=$?" >> $W/steps.txt
      done
      cp $W/ab52-trace-*.json "$OUT/" 2>/dev/null
      cp $W/ab52-*.jsonl "$OUT/" 2>/dev/null;;
    epiab)
      # issue 17: this build's `afdep moe` against the previous build's (bundle/afdep-pre.gz, a
      # stripped release `afdep`), alternating binaries, per EPI_CELLS entry SHAPE:TOKENS:DISPATCH
      # (default the four model cells of 2026-12-06 (b) and the record at 131K), EPI_ITERS timed
      # runs (5), EPI_REPS repeats (1), EPI_WHICH the builds and variants (below); every row checked
      # against the GPU reference (`status`)
      [ -x /tmp/afdep-pre ] || { gzip -dc "$ROOT/bundle/afdep-pre.gz" > /tmp/afdep-pre && chmod +x /tmp/afdep-pre; }
      : > $W/epiab.jsonl
      for rep in $(seq 1 "${EPI_REPS:-1}"); do
        for cell in ${EPI_CELLS:-mixtral-8x7b:16384:sorted gpt-oss-120b:4096:sorted record:131072:gather qwen3-30b-a3b:4096:sorted olmoe-1b-7b:32768:sorted}; do
          IFS=: read -r shape tok disp <<< "$cell"
          # EPI_WHICH: the builds in order: pre, new, or NAME=BUILD:VAR=VALUE (BUILD pre or new
          # run with one environment variable set, e.g. pairs=new:AFDEP_GEMM_PAIRS=on)
          for spec in ${EPI_WHICH:-pre new}; do
            which=${spec%%=*}; build=$which; envs=
            if [ "$which" != "$spec" ]; then rest=${spec#*=}; build=${rest%%:*}; envs=${rest#*:}; fi
            bin=/tmp/afdep-pre; [ "$build" = new ] && bin=/tmp/b4/bin/afdep
            [ "$(left)" -gt 40 ] || break 3
            rm -f $W/epi-one.jsonl
            timeout "$(( $(left) > 150 ? 120 : $(left) - 20 ))" env $envs $bin moe --backend cuda --shape "$shape" \
              --tokens "$tok" --dispatch "$disp" --iters "${EPI_ITERS:-5}" --json-out $W/epi-one.jsonl \
              > $W/epi-$shape-$which.log 2>&1
            echo "epiab $shape $tok $disp $which rep $rep rc=$?" >> $W/steps.txt
            [ -f $W/epi-one.jsonl ] && sed "s/^{/{\"build\":\"$which\",\"rep\":$rep,/" $W/epi-one.jsonl >> $W/epiab.jsonl
          done
        done
      done
      python3 - $W/epiab.jsonl >> $W/steps.txt <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print("epiab", r.get("shape"), r.get("tokens"), r.get("dispatch"), r["build"], r.get("rep"),
          "fwd", r.get("fwd_ms"), "train", r.get("train_ms"), "peak_gib", r.get("peak_gib"),
          r.get("status"), r.get("digest"), r.get("device"))
PY
      cp $W/epiab.jsonl "$OUT/" 2>/dev/null;;
    probe)
      # issue 20: the probe points inside the kernels (a build of this bundle's kernels with
      # -DAFDEP_PROBE, compiled into the same cache under their own key): 3A:1F graph replays,
      # auto arm, identity experts, 1 and 2,048 tokens, 30 replays after 5 warm-ups, behind the
      # start gate and host-started; the medians table of each into steps.txt
      # PROBE_RUNS: NAME or NAME:VAR=VALUE each (default "gate host"); a NAME containing
      # "gate" runs behind the start gate
      for spec in ${PROBE_RUNS:-gate host}; do
        st=${spec%%:*}; envs=; [ "$st" != "$spec" ] && envs=${spec#*:}
        fl=; case $st in *gate*) fl=--start-gate;; esac
        # shellcheck disable=SC2086 # a flag or nothing, VAR=VALUE or nothing
        env $envs AFDEP_NVRTC_OPTIONS=-DAFDEP_PROBE timeout "$(( $(left) > 120 ? 90 : 10 ))" /tmp/b4/bin/afdep exchange \
          --backend cuda --transport nvlink --device 0 --topology 3A:1F --graph --arm auto \
          --expert identity $fl --tokens 1,2048 --rounds 30 --warmup 5 --probe $W/probe-$st.json \
          --json-out $W/probe-$st.jsonl > $W/probe-$st.txt 2>&1
        echo "probe $st rc=$?" >> $W/steps.txt
        echo "probe run $st ($envs)" >> $W/steps.txt
        grep -A40 "^probes:" $W/probe-$st.txt >> $W/steps.txt
      done
      cp $W/probe-*.json $W/probe-*.jsonl "$OUT/" 2>/dev/null;;
    fold)
      # the candidate build (bundle/afdepfold.gz) checked against the oracle (every row's status)
      # in every arm, graph replays, eager device rounds and host-expert rounds, 3A:1F with
      # SwiGLU experts, then 2A:2F graph auto and an fp8 graph row; each run at most 25 s
      # FOLD_CAND=NAME checks bundle/cand-NAME.gz instead
      fz="$ROOT/bundle/afdepfold.gz"; [ -n "${FOLD_CAND:-}" ] && fz="$ROOT/bundle/cand-$FOLD_CAND.gz"
      [ -x /tmp/afdepfold ] || { gzip -dc "$fz" > /tmp/afdepfold && chmod +x /tmp/afdepfold; }
      runs=()
      for mode in --graph --device-rounds host; do for arm in auto count-first-source payload-first count-first; do
        runs+=("3A:1F|$mode|$arm|bf16")
      done; done
      runs+=("2A:2F|--graph|auto|bf16" "2A:2F|host|count-first-source|bf16" "3A:1F|--graph|auto|fp8"
        "3A:1F|--device-rounds|auto|fp8" "EP4|--graph|auto|bf16" "EP4|--device-rounds|auto|bf16"
        "1A:3F|--graph|auto|bf16")
      for r in "${runs[@]}"; do
        IFS='|' read -r topo mode arm pay <<< "$r"
        [ "$(left)" -gt 30 ] || { echo "fold $r: not run (time)" >> $W/steps.txt; continue; }
        m=$mode; [ "$m" = host ] && m=""
        # shellcheck disable=SC2086 # an optional flag
        timeout 25 /tmp/afdepfold exchange --backend cuda --transport nvlink --device 0 \
          --topology $topo $m --arm $arm --payload $pay --tokens 1,300,2048 --rounds 3 --warmup 1 \
          --json-out $W/fold.jsonl > $W/fold-$(echo "$r" | tr -c 'A-Za-z0-9\n' _).txt 2>&1
        echo "fold $r rc=$?" >> $W/steps.txt
      done
      cp $W/fold.jsonl "$OUT/" 2>/dev/null;;
    candtests)
      # a candidate build's fused-engine test binaries (bundle/cand-NAME-tests.txz, NAME from
      # FOLD_CAND: a tar of ct/ with stripped binaries), each alone, at most 90 s
      [ -d /tmp/ct ] || ( cd /tmp && tar xf "$ROOT/bundle/cand-${FOLD_CAND:-fold}-tests.txz" )
      for t in /tmp/ct/gpu_*; do
        [ "$(left)" -gt 40 ] || { echo "candtests $(basename $t): not run (time)" >> $W/steps.txt; continue; }
        timeout "$(( $(left) > 130 ? 90 : 30 ))" $t --test-threads=1 > $W/cand-$(basename $t).log 2>&1
        echo "candtests $(basename $t) rc=$? $(grep -h '^test result' $W/cand-$(basename $t).log)" >> $W/steps.txt
      done
      cp $W/cand-*.log "$OUT/" 2>/dev/null;;
    fused)
      # the fused engine's binaries alone (engines in every arm, graphs and device rounds, the
      # pipeline), for a change of the fused kernels or layout checked in the quiet call
      for t in gpu_nvlink_engines gpu_nvlink_graph gpu_pipeline; do
        timeout "$(( $(left) > 120 ? 90 : 20 ))" /tmp/b4/tests/$t --test-threads=1 > $W/fused-$t.log 2>&1
        echo "fused $t rc=$? $(grep -h '^test result' $W/fused-$t.log)" >> $W/steps.txt
      done;;
    gemmsms)
      # the GEMMs' SM share (AFDEP_GEMM_SMS=GEMM_SMS, default 108 = 132 SMs - 24 transport SMs)
      # against the whole GPU, same bundle, same call: the overlap table and the pipeline table
      # at 3A:1F (GEMMSMS_RATIOS), transport SMs 24; the tables into steps.txt
      for lim in all ${GEMM_SMS:-108}; do
        e=; [ "$lim" = all ] || e="AFDEP_GEMM_SMS=$lim"
        # shellcheck disable=SC2086 # VAR=VALUE or nothing
        env $e RATIOS="${GEMMSMS_RATIOS:-3A:1F}" SMS=24 timeout "$(( $(left) > 120 ? 90 : 20 ))" \
          bash docs/perf/exchange_load_run.sh /tmp/b4 $W/load-$lim > $W/load-$lim.txt 2>&1
        echo "gemmsms load $lim rc=$?" >> $W/steps.txt
        # shellcheck disable=SC2086
        env $e RATIOS="${GEMMSMS_RATIOS:-3A:1F}" timeout "$(( $(left) > 150 ? 120 : 20 ))" \
          bash docs/perf/exchange_pipeline_run.sh /tmp/b4 $W/pipe-$lim > $W/pipe-$lim.txt 2>&1
        echo "gemmsms pipeline $lim rc=$?" >> $W/steps.txt
        cat $W/load-$lim/table.md $W/pipe-$lim/table.md >> $W/steps.txt 2>/dev/null
      done;;
    bins)
      # BINS (comma-separated): these matrix binaries alone through the bundle's run.sh (the
      # binaries a matrix call's lanes did not reach), each under a 150 s timeout
      timeout "$(( $(left) - 20 ))" /tmp/b4/run.sh --only "${BINS:-gpu_nvlink_graph}" --skip-ignored \
        --timeout 150 --logs $W/bins > $W/bins.txt 2>&1; echo "bins rc=$?" >> $W/steps.txt
      grep -h "rc=" $W/bins/summary.txt >> $W/steps.txt 2>/dev/null;;
    soak)
      # the soak alone on a quiet GPU (its device-memory check reads the whole GPU's free memory)
      timeout "$(( $(left) - 20 ))" /tmp/b4/tests/gpu_soak --test-threads=1 --nocapture \
        > $W/soak.log 2>&1; echo "soak rc=$?" >> $W/steps.txt
      grep -E "SOAK|^test |panicked|free device" $W/soak.log >> $W/steps.txt;;
    ncu)
      # per-kernel times of the record shape's forward and train step (gather, 131,072 tokens):
      # 3 warm-ups and 1 timed run of each, every launch profiled (NCU_ARGS replaces the
      # bench_layer arguments)
      # NCU_ARGS replaces the bench_layer arguments; several runs separated by `;`
      # (e.g. "--shape 4096,14336,8,2,0 --tokens 16384 --dispatch sorted --iters 1;..."), each
      # into ncu-N.csv (the first also ncu.csv)
      i=0; IFS=';' read -r -a runs <<< "${NCU_ARGS:---tokens 131072 --dispatch gather --iters 1}"
      for args in "${runs[@]}"; do
        i=$((i + 1))
        # shellcheck disable=SC2086 # a list of flags
        timeout "$(cap200)" ncu --clock-control none --metrics gpu__time_duration.sum --csv \
          --log-file $W/ncu-$i.csv /tmp/b4/bin/bench_layer $args > $W/ncu-$i.txt 2>&1
        echo "ncu $i ($args) rc=$?" >> $W/steps.txt
      done
      cp $W/ncu-1.csv $W/ncu.csv 2>/dev/null;;
    wgrad)
      timeout "$(cap200)" bash docs/perf/gemm_wgrad_run.sh /tmp/b4 $W/wgrad \
        > $W/wgrad.txt 2>&1; echo "wgrad rc=$?" >> $W/steps.txt;;
    suite)
      b=$(( $(left) - 90 ))
      if [ "$b" -gt 60 ]; then
        # shellcheck disable=SC2086
        bash peers/run_suite.sh /tmp/b4 $W/suite ${SUITE:---suite record --peers torch --jax-shapes none} \
          --budget $b --peer-timeout $(( b < 150 ? b : 150 )) > $W/suite.txt 2>&1
        echo "suite rc=$?" >> $W/steps.txt
      else
        echo "suite: not run (time)" >> $W/steps.txt
      fi;;
    skew)
      # issue 20: where the 1-token graph round's fixed cost goes, this build only, no rebuild:
      # 3A:1F, identity experts, graph replays, 1 and 2,048 tokens, 30 after 5 warm-ups, each arm
      # (SKEW_ARMS) and, for the auto arm, the loopback barrier's spin raised to 20 ms
      # (AFDEP_LOOPBACK_SPIN: no rank sleeps on the condition variable before the round's start
      # event) and one transport SM budget of 7 (SKEW_SMS); rows into skew.jsonl, a line each
      for rep in $(seq 1 "${SKEW_REPS:-1}"); do
        for v in ${SKEW_ARMS:-payload-first count-first count-first-source auto} auto:spin auto:sms; do
          arm=${v%%:*}; e=; extra=
          case $v in *:spin) e="AFDEP_LOOPBACK_SPIN=20000";; *:sms) extra="--transport-sms ${SKEW_SMS:-7}";; esac
          # shellcheck disable=SC2086 # VAR=VALUE or nothing; a flag or nothing
          env $e timeout "$(( $(left) > 60 ? 40 : 5 ))" /tmp/b4/bin/afdep exchange --backend cuda \
            --transport nvlink --device 0 --topology 3A:1F --graph --arm "$arm" --expert identity \
            --tokens 1,2048 --rounds 30 --warmup 5 $extra --json-out $W/skew-$rep-${v/:/-}.jsonl \
            > $W/skew-$rep-${v/:/-}.txt 2>&1
          echo "skew $v rep $rep rc=$?" >> $W/steps.txt
          python3 -c "import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print('skew', sys.argv[2], r.get('arm'), r.get('tokens'), r.get('round_us'), r.get('status'))" \
            $W/skew-$rep-${v/:/-}.jsonl "$v" >> $W/steps.txt 2>/dev/null
        done
      done;;
    *) echo "unknown part $part" >> $W/steps.txt;;
  esac
done
step done
cp $W/ncu*.csv "$OUT/" 2>/dev/null
cp $W/steps.txt $W/pipeline.txt $W/wgrad.txt $W/suite.txt "$OUT/" 2>/dev/null
cp $W/wgrad/tests.txt "$OUT/wgrad-tests.txt" 2>/dev/null
cp $W/pipeline/table.md "$OUT/pipeline-table.md" 2>/dev/null
cp $W/load/table.md "$OUT/load-table.md" 2>/dev/null
cp $W/wgrad/ab.jsonl "$OUT/wgrad-ab.jsonl" 2>/dev/null
cp $W/suite/moe.md "$OUT/suite-moe.md" 2>/dev/null
tar czf "$OUT/all.tgz" -C /tmp perf
