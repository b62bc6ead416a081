#!/usr/bin/env bash
# The short check for a machine with CUDA GPUs. Builds nothing: run it from the repository root
# next to `train` and `xtask` binaries built elsewhere (cargo build --release --workspace)
# and the prepared synthetic set (cargo xtask prepare-data), e.g.
#   BIN=./train XTASK=./xtask scripts/gpu-check.sh
# Its parts stop after 150 s, 2 x 90 s (two or more GPUs) and 300 s: within one 10-minute
# device call. The bench table is printed (and kept in $OUT/bench.txt) case by case, so a
# cut-off run keeps the cases it finished.
set -uo pipefail
BIN=${BIN:-target/release/train}
XTASK=${XTASK:-target/release/xtask}
STEPS=${STEPS:-30}
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
# the synthetic default on GPU 0: it trains and evaluates
echo "== synthetic, device 0" | tee -a "$OUT/train.txt"
timeout 150 "$BIN" --devices 0 --num-steps "$STEPS" --model-dir "$OUT/run-0" 2>&1 | tail -25 | tee -a "$OUT/train.txt"
if [ "$GPUS" -ge 2 ]; then
  # two GPUs, by NCCL where libnccl loads (the log says which path) and through the host:
  # a checkpoint every 10 steps first checks that the replicas hold bit-identical weights
  # (the run stops otherwise); both paths' losses go side by side
  for path in default host; do
    echo "== synthetic, devices 0,1, exchange: $path" | tee -a "$OUT/train.txt"
    env $([ $path = host ] && echo SSD_BURN_HOST_STAGED=1) timeout 90 "$BIN" --devices 0,1 \
      --num-steps "$STEPS" --no-eval --model-dir "$OUT/run-01-$path" 2>&1 |
      grep -E "exchange between|step [0-9]+/|replicas|error|Error" | tail -12 | tee -a "$OUT/train.txt"
  done
  paste <(grep -o '"total":[^,}]*' "$OUT/run-01-default/metrics.jsonl") \
    <(grep -o '"total":[^,}]*' "$OUT/run-01-host/metrics.jsonl") | tee "$OUT/losses-01.txt"
fi
# the pets model (300x300, 37 classes) on GPU 0 and, with two or more GPUs, on all of them
# at 8 images each (scaling against one GPU): training with the data loader and with the
# batch in memory; inference at batch 1 (with and without NMS) and 8 on GPU 0
timeout 300 "$XTASK" bench --only="--devices 0" --repeats 5 --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
