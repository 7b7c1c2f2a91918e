#!/usr/bin/env bash
# Issue 17 item 2 (the warp-specialised rows GEMMs), one device call:
#   docs/perf/gemm_ws_run.sh BUNDLE_TGZ OUT check   # GPU tests gpu_gemm, gpu_layer, then
#                                                   # classic vs ws timings, same process image
#   docs/perf/gemm_ws_run.sh BUNDLE_TGZ OUT suite [run_suite.sh args..]
# BUNDLE_TGZ: a tar.gz of the folder `cargo xtask gpu-test --bundle gemm-b` made (its top
# folder gemm-b/). OUT gets gpu.txt, logs/, ab.jsonl (mode check) or suite/ (mode suite).
# The timings: `afdep moe --backend cuda` (every row checked against the GPU reference path)
# with AFDEP_GEMM_ENGINE=classic and =ws alternated in separate processes, same binary.
set -u
tgz=$1; out=$2; mode=${3:-check}; shift 3 || shift $#
mkdir -p "$out" /tmp/wsb && tar xzf "$tgz" -C /tmp/wsb || exit 2
B=/tmp/wsb/gemm-b
export AFDEP_KERNEL_CACHE=/tmp/wsb/kernel-cache AFDEP_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader \
  | tee "$out/gpu.txt"
cat "$B/commit.txt" 2>/dev/null | tee -a "$out/gpu.txt"
if [ "$mode" = check ]; then
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
