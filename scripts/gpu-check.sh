#!/usr/bin/env bash
# The short check for a machine with CUDA GPUs. Builds nothing: run it from the repository root
# next to `train` and `xtask` binaries built elsewhere (cargo build --release -p train -p xtask)
# and the prepared synthetic set (cargo xtask prepare-data), e.g.
#   BIN=./train XTASK=./xtask scripts/gpu-check.sh
# Its two parts stop after 200 s and 360 s, within one 10-minute device call; the bench
# table is printed (and kept in $OUT/bench.txt) case by case, so a cut-off run keeps the
# cases it finished.
set -uo pipefail
BIN=${BIN:-target/release/train}
XTASK=${XTASK:-target/release/xtask}
STEPS=${STEPS:-30}
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
# the synthetic default on GPU 0: it trains and evaluates
echo "== synthetic, device 0" | tee -a "$OUT/train.txt"
timeout 200 "$BIN" --devices 0 --num-steps "$STEPS" --model-dir "$OUT/run-0" 2>&1 | tail -25 | tee -a "$OUT/train.txt"
# the pets model (300x300, 37 classes) on GPU 0: training at batch 8 and 24 (with the data
# loader and with the batch in memory), inference at batch 1 (with and without NMS) and 8
timeout 360 "$XTASK" bench --only="--devices 0" --repeats 5 --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
