#!/usr/bin/env bash
# Issue 17 item 2, the warp-specialised weight gradients (ws KSUM), one device call:
#   docs/perf/gemm_wgrad_run.sh BUNDLE_DIR OUT
# BUNDLE_DIR: the folder `cargo xtask gpu-test --bundle DIR` made. OUT gets gpu.txt,
# tests.txt and ab.jsonl.
# 1. The GPU tests of the ws KSUM kernel (each forces the engine itself):
#    gpu_gemm ws_wgrad_odd_sizes_match_a_host_gemm (host f64 reference, ~10-30 s),
#    gpu_layer wgrad_engines_odd_shapes_match_the_oracle (both kernels forced), and the classic KSUM test
#    wgrad_matches_a_host_gemm beside them.
# 2. Only if both ws tests passed: `afdep moe --backend cuda` at each SHAPE:TOKENS of
#    AB_SHAPES (default the Mixtral-like shape at 16,384 tokens), dispatch AB_DISPATCH
#    (default sorted,fused_gsum), with AFDEP_GEMM_WGRAD=classic then =ws (separate
#    processes, same binary; the rows GEMMs on their default engine), every row checked
#    against the GPU reference path (`status`). The train-step difference is the weight
#    gradients' (the forward must not move).
# AB_ONLY=1 skips step 1 (when the same bundle's tests have just passed in another call).
set -u
B=$1; out=$2
mkdir -p "$out"
export AFDEP_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader \
  | tee "$out/gpu.txt"
cat "$B/commit.txt" 2>/dev/null | tee -a "$out/gpu.txt"
ok=1
if [ "${AB_ONLY:-0}" = 1 ]; then
  echo "tests not run (AB_ONLY=1); tests ok=1" | tee "$out/tests.txt"
else
{
  timeout 240 "$B/tests/gpu_gemm" wgrad --test-threads=1 --nocapture 2>&1 \
    | grep -E "^test |worst|panicked|error|result"
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "gpu_gemm wgrad: FAILED"; ok=0; }
  # the whole log to a file first: a `| head` on the live output would end the test with
  # SIGPIPE and count it as failed (as it did on 2026-12-06)
  timeout 300 "$B/tests/gpu_layer" wgrad_engines_odd_shapes_match_the_oracle --exact \
    --nocapture > "$out/gpu_layer_ws_wgrad.log" 2>&1
  rc=$?
  grep -E "^test |compared|panicked|failures|result|W=" "$out/gpu_layer_ws_wgrad.log" | head -60
  [ "$rc" = 0 ] || { echo "gpu_layer ws_wgrad: FAILED (rc $rc)"; ok=0; }
  echo "tests ok=$ok"
} 2>&1 | tee "$out/tests.txt"
fi
grep -q "tests ok=1" "$out/tests.txt" || { echo "tests failed: no timing"; exit 1; }
: > "$out/ab.jsonl"
for cell in ${AB_SHAPES:-mixtral-8x7b:16384}; do
  shape=${cell%%:*}; tok=${cell##*:}
  for eng in classic ws; do
    n=$shape-$tok-$eng; rm -f "/tmp/wgrad-$n.jsonl"
    AFDEP_GEMM_WGRAD=$eng timeout 180 "$B/bin/afdep" moe --backend cuda --shape "$shape" \
      --tokens "$tok" --dispatch "${AB_DISPATCH:-sorted,fused_gsum}" --iters "${AB_ITERS:-5}" \
      --json-out "/tmp/wgrad-$n.jsonl" > "/tmp/wgrad-$n.log" 2>&1 || echo "afdep $n: rc $?"
    tail -2 "/tmp/wgrad-$n.log"
    [ -f "/tmp/wgrad-$n.jsonl" ] && sed "s/^{/{\"wgrad_engine\":\"$eng\",/" "/tmp/wgrad-$n.jsonl" >> "$out/ab.jsonl"
  done
done
python3 - "$out/ab.jsonl" <<'PY'
import json, sys
print("| shape | tokens | dispatch | wgrad engine | fwd ms | train ms | train TFLOP/s | status | digest |")
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(f"| {r.get('shape', '?')} | {r.get('tokens', '?')} | {r['dispatch']} | {r['wgrad_engine']} | {r['fwd_ms']:.2f} | {r['train_ms']:.2f} | "
          f"{r['train_tflops']:.0f} | {r['status']} | {r['digest']} |")
PY
