#!/usr/bin/env bash
# Issue 17 item 2 (the warp-specialised rows GEMMs), one device call:
#   docs/perf/gemm_ws_run.sh BUNDLE_TGZ OUT check   # GPU tests gpu_gemm, gpu_layer, then
#                                                   # classic vs ws timings, same process image
#   docs/perf/gemm_ws_run.sh BUNDLE_TGZ OUT suite [run_suite.sh args..]
#   docs/perf/gemm_ws_run.sh BUNDLE_TGZ OUT one     # everything in one short call (DEADLINE
#       seconds, default 150): the ws tests (gpu_gemm, gpu_fault, gpu_layer's classic-engine test), afdep
#       at mixtral-8x7b 16K with AFDEP_GEMM_ENGINE=ws then =classic (sorted; the ws run writes
#       the inputs), then eager torch._grouped_mm (peers/moe_torch.py) on those inputs; every
#       step under what is left of the deadline.
# A folder bundle/kernel-cache beside BUNDLE_TGZ (NVRTC 13.0 cubins of `cargo xtask kernels
# --sass`) seeds the kernel cache.
# BUNDLE_TGZ: a tar.gz of the folder `cargo xtask gpu-test --bundle gemm-b` made (its top
# folder gemm-b/). OUT gets gpu.txt, logs/, ab.jsonl (mode check) or suite/ (mode suite).
# The timings: `afdep moe --backend cuda` (every row checked against the GPU reference path)
# with AFDEP_GEMM_ENGINE=classic and =ws alternated in separate processes, same binary.
set -u
tgz=$1; out=$2; mode=${3:-check}; shift 3 || shift $#
mkdir -p "$out" /tmp/wsb && tar xzf "$tgz" -C /tmp/wsb || exit 2
B=/tmp/wsb/gemm-b
# The default engine (ops::gemm::DEFAULT_ENGINE, ws) runs wherever a step below does not
# name one (AFDEP_GEMM_ENGINE=classic|ws).
export AFDEP_KERNEL_CACHE=/tmp/wsb/kernel-cache AFDEP_REQUIRE_GPU=1
[ -d "$(dirname "$tgz")/kernel-cache" ] && cp -r "$(dirname "$tgz")/kernel-cache" /tmp/wsb/
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader \
  | tee "$out/gpu.txt"
cat "$B/commit.txt" 2>/dev/null | tee -a "$out/gpu.txt"
if [ "$mode" = one ]; then
  t0=$(date +%s); end=$(( t0 + ${DEADLINE:-150} ))
  left() { local l=$(( end - $(date +%s) )); [ $l -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
  {
    timeout "$(left ${T_GEMM:-35})" "$B/tests/gpu_gemm" --test-threads=1 2>&1 | grep -E "^test |worst|panicked|error|result" | head -40
    echo "gpu_gemm rc ${PIPESTATUS[0]} at $(( $(date +%s) - t0 ))s"
    timeout "$(left ${T_FAULT:-15})" "$B/tests/gpu_fault" 2>&1 | grep -E "^test |panicked|result" | head
    echo "gpu_fault rc ${PIPESTATUS[0]} at $(( $(date +%s) - t0 ))s"
    timeout "$(left ${T_LAYER:-25})" "$B/tests/gpu_layer" classic_engine 2>&1 | grep -E "^test |compared|panicked|failures|result|W=" | head -40
    echo "gpu_layer classic rc ${PIPESTATUS[0]} at $(( $(date +%s) - t0 ))s"
  } > "$out/run.txt" 2>&1
  cat "$out/run.txt"
  W=/tmp/wsb/inputs; mkdir -p $W
  for eng in ws classic; do
    wflag=(); [ $eng = ws ] && wflag=(--write-inputs $W)
    AFDEP_GEMM_ENGINE=$eng timeout "$(left 40)" "$B/bin/afdep" moe --backend cuda \
      --shape mixtral-8x7b --tokens "${AB_TOKENS:-16384}" --dispatch sorted --iters 3 "${wflag[@]}" \
      --json-out "$out/afdep.jsonl" > /tmp/wsb/$eng.log 2>&1
    echo "afdep $eng rc $? at $(( $(date +%s) - t0 ))s"; tail -2 /tmp/wsb/$eng.log
  done
  timeout "$(left 60)" python3 "$B/peers/moe_torch.py" --inputs $W/mixtral-8x7b --tokens "${AB_TOKENS:-16384}" \
    --iters 3 --warmups 2 --no-oracle --impls eager --json-out "$out/torch.jsonl" > /tmp/wsb/torch.log 2>&1
  echo "torch rc $? at $(( $(date +%s) - t0 ))s"; tail -3 /tmp/wsb/torch.log
  python3 - "$out" <<'PY'
import json, sys
for f in ("afdep.jsonl", "torch.jsonl"):
    try:
        for l in open(sys.argv[1] + "/" + f):
            r = json.loads(l)
            print(f, {k: r.get(k) for k in ("impl", "implementation", "dispatch", "fwd_ms", "train_ms", "fwd_tflops", "train_tflops", "status", "out_err", "gx_err", "gw_err", "oracle_out_err", "peak_gib", "digest", "device")})
    except FileNotFoundError:
        print(f, "missing")
PY
elif [ "$mode" = check ]; then
  "$B/run.sh" --only gpu_gemm,gpu_layer,gpu_fault --skip-ignored --timeout 150 --logs "$out/logs"
  tail -5 "$out/logs/summary.txt" 2>/dev/null
  : > "$out/ab.jsonl"
  for st in ${AB_CELLS:-mixtral-8x7b:16384:sorted,fused_gsum gpt-oss-120b:4096:sorted}; do
    set -- ${st//:/ }
    for eng in classic ws; do
      AFDEP_GEMM_ENGINE=$eng timeout 90 "$B/bin/afdep" moe --backend cuda --shape "$1" \
        --tokens "$2" --dispatch "$3" --iters "${AB_ITERS:-5}" \
        --json-out "/tmp/wsb/ab-$eng.jsonl" > "/tmp/wsb/ab-$1-$eng.log" 2>&1 \
        || echo "afdep moe $1 $2 $eng: rc $?"
      tail -2 "/tmp/wsb/ab-$1-$eng.log"
    done
  done
  python3 - "$out/ab.jsonl" <<'PY'
import json, sys
rows = []
for eng in ("classic", "ws"):
    try:
        for l in open(f"/tmp/wsb/ab-{eng}.jsonl"):
            r = json.loads(l); r["engine"] = eng; rows.append(r)
    except FileNotFoundError:
        pass
with open(sys.argv[1], "w") as f:
    for r in rows: f.write(json.dumps(r) + "\n")
print("| shape | tokens | dispatch | engine | fwd ms | train ms | fwd TFLOP/s | train TFLOP/s | status | digest |")
for r in sorted(rows, key=lambda r: (r.get("shape") or "", r["tokens"], r["dispatch"], r["engine"])):
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"
    print(f"| {r.get('shape')} | {r['tokens']} | {r['dispatch']} | {r['engine']} | {f(r['fwd_ms'])} | {f(r['train_ms'])} | {f(r['fwd_tflops'],0)} | {f(r['train_tflops'],0)} | {r['status']} | {r['digest']} |")
PY
else
  "$B/peers/run_suite.sh" "$B" "$out/suite" "$@"
  tail -40 "$out/suite/moe.md" 2>/dev/null | head -60
fi
