#!/usr/bin/env bash
# Builds and runs round_floor.cu on the GPU machine (nvcc from /usr/local/cuda): OUT/floor.txt.
set -u
D=$(cd "$(dirname "$0")" && pwd)
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
$NVCC -O3 -std=c++17 -arch=sm_90 -o /tmp/round_floor "$D/round_floor.cu" -lpthread > "${1:-/tmp}/floor-build.txt" 2>&1 \
  || { cat "${1:-/tmp}/floor-build.txt"; exit 2; }
timeout 120 /tmp/round_floor
