#!/usr/bin/env bash
# Makes bundle/py/ (git-ignored) for crates/afdep-py/gpu/go.sh on the GPU machine: the afdep
# wheel (maturin, release, abi3), pytest's wheels for Python 3.12 (py3-none-any, no network
# there), copies of the Python tests and of the training example, and commit.txt. Run from
# the repo root after the last commit that should be tested; VENV names a virtual
# environment with maturin and pip (default target/venv, made as .ci/run makes its venv).
set -euo pipefail
cd "$(dirname "$0")/../../.."
venv="${VENV:-target/venv}"
dst=bundle/py
rm -rf "$dst"
mkdir -p "$dst/deps"
"$venv/bin/maturin" build --release --locked -m crates/afdep-py/Cargo.toml -o "$dst"
"$venv/bin/pip" download -q --only-binary=:all: --python-version 3.12 --no-deps -d "$dst/deps" \
  pytest pluggy iniconfig packaging pygments
cp -r crates/afdep-py/tests "$dst/tests"
rm -rf "$dst/tests/__pycache__"
cp examples/python/train_moe.py "$dst/train_moe.py"
cp crates/afdep-py/gpu/go.sh "$dst/go.sh"
dirty=""
git diff --quiet HEAD -- crates examples Cargo.toml Cargo.lock || dirty=" (with uncommitted changes)"
echo "$(git rev-parse --short HEAD)$dirty" > "$dst/commit.txt"
ls -l "$dst" "$dst/deps"
du -sh "$dst"
