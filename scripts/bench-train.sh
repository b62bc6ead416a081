#!/usr/bin/env bash
# Training throughput with 1 and 2 replicas (or the devices given) and the share of the step
# spent in gradient synchronisation. Uses the release binary; builds it when missing.
#
#   scripts/bench-train.sh                 # CPU: --devices cpu and cpu:2
#   scripts/bench-train.sh 0 0,1           # CUDA devices 0, then 0 and 1
#   STEPS=30 CONFIG=configs/ssd_mobilenet_v1_pets.json DATA='datasets/synthetic/train.record-*' scripts/bench-train.sh cpu
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-20}
CONFIG=${CONFIG:-configs/synthetic.json}
BIN=${BIN:-target/release/train}
[ -x "$BIN" ] || cargo build --release -p train
[ $# -gt 0 ] || set -- cpu cpu:2
for devices in "$@"; do
  dir=$(mktemp -d)
  echo "== --devices $devices, $STEPS steps, $CONFIG"
  "$BIN" --devices "$devices" --config "$CONFIG" --num-steps "$STEPS" --model-dir "$dir" --no-eval \
    ${DATA:+--train-data "$DATA"} 2>&1 \
    | grep -E "^(training|done:)" || true
  rm -rf "$dir"
done
