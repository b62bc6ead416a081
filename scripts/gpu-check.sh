#!/usr/bin/env bash
# The short check for a machine with CUDA GPUs. Builds nothing: run it next to a `train`
# binary built elsewhere (cargo build --release -p train) and the prepared synthetic set
# (cargo xtask prepare-data), e.g. BIN=./train DATA=./datasets scripts/gpu-check.sh.
set -uo pipefail
BIN=${BIN:-target/release/train}
STEPS=${STEPS:-30}
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
for devices in 0 cpu; do
  echo "== $devices" | tee -a "$OUT/train.txt"
  timeout 300 "$BIN" --devices "$devices" --num-steps "$STEPS" --model-dir "$OUT/run-$devices" 2>&1 | tail -25 | tee -a "$OUT/train.txt"
done
# the pets model (300x300, 37 classes) at batch 24: throughput only
STEPS=$STEPS CONFIG=configs/ssd_mobilenet_v1_pets.json DATA='datasets/synthetic/train.record-*' BIN=$BIN bash "$(dirname "$0")/bench-train.sh" 0 2>&1 | tee -a "$OUT/train.txt"
