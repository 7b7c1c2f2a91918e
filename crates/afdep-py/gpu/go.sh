#!/usr/bin/env bash
# afdep's Python package on the GPU machine (Python 3.12 with a CUDA build of torch, no
# network), from a bundle made by crates/afdep-py/gpu/bundle.sh. From the repo root:
#
#   bash bundle/py/go.sh            (device tool: carry ["bundle/py"])
#
# 1. installs the bundled wheels (pytest and its needs, then afdep) with pip, offline;
# 2. runs the bundled copy of crates/afdep-py/tests with AFDEP_REQUIRE_GPU=1 (a CUDA test
#    that cannot see a GPU fails instead of skipping);
#    AFDEP_PYTEST_ARGS adds pytest arguments (e.g. "test_exchange_fused.py" or "-k fused");
# 3. runs examples/python/train_moe.py on CUDA for AFDEP_TRAIN_STEPS steps (default 60; 0
#    skips it).
# Logs and results go to $OUT/py/ (at most 7 files): env.log, pytest.log, pytest.xml,
# train.log and train/train_moe.{csv,json,png}. Exits non-zero if a step failed.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="$(command -v "${PYTHON:-python3}")" || { echo "go.sh: no ${PYTHON:-python3}"; exit 1; }
case "$py" in /*) ;; *) py="$PWD/$py" ;; esac
out="${OUT:-/tmp/afdep-out}/py"
steps="${AFDEP_TRAIN_STEPS:-60}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  echo "bundle of commit $(cat "$here/commit.txt" 2>/dev/null || echo unknown)"
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$py" -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'
  echo "== pip install (offline)"
  "$py" -m pip install --no-deps --no-index --force-reinstall --no-compile \
    "$here"/deps/*.whl "$here"/afdep-*.whl
} > "$out/env.log" 2>&1
rc_install=$?
tail -n 3 "$out/env.log"
if [ "$rc_install" -ne 0 ]; then
  echo "go.sh: the install failed (rc $rc_install), see $out/env.log"
  exit 1
fi
echo "== pytest (AFDEP_REQUIRE_GPU=1)"
# third-party pytest plugins of the image stay off: the suite needs none
(cd "$here/tests" && AFDEP_REQUIRE_GPU=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 420 \
  "$py" -m pytest -v -rs -p no:cacheprovider --junitxml="$out/pytest.xml" ${AFDEP_PYTEST_ARGS:-}) \
  > "$out/pytest.log" 2>&1
rc_tests=$?
grep -E "^(FAILED|ERROR)|passed|failed" "$out/pytest.log" | tail -n 30
if [ "$steps" -eq 0 ]; then
  echo "go.sh: pytest rc $rc_tests, train_moe skipped (AFDEP_TRAIN_STEPS=0)"
  exit "$rc_tests"
fi
echo "== train_moe.py --device cuda --steps $steps"
timeout 150 "$py" "$here/train_moe.py" --device cuda --steps "$steps" --out "$out/train" \
  > "$out/train.log" 2>&1
rc_train=$?
tail -n 12 "$out/train.log"
echo "go.sh: pytest rc $rc_tests, train_moe rc $rc_train"
[ "$rc_tests" -eq 0 ] && [ "$rc_train" -eq 0 ]
