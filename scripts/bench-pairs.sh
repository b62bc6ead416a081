#!/usr/bin/env bash
# Interleaved pairs: the batch-8 training step (batch in memory) of ssd-burn, then PyTorch's
# on the same machine a moment later, round after round, so that both fall in the same phase
# of a drifting VM. Prints each round's two medians and their ratio, then the median ratio.
#
#   scripts/bench-pairs.sh PEER_DIR [ROUNDS] [OUT_DIR]
#
# PEER_DIR: a copy of ../shared/bench/peer/ with its venv (see its README). Uses
# target/release/xtask (cargo build --release -p xtask) unless XTASK names another build.
# About two minutes a round; the machine should be otherwise idle.
set -euo pipefail
PEER=$(cd "${1:?usage: scripts/bench-pairs.sh PEER_DIR [ROUNDS] [OUT_DIR]}" && pwd)
ROUNDS=${2:-4}
OUT=${3:-target/bench-pairs}
XTASK=${XTASK:-target/release/xtask}
CASE='{"kind":"train","devices":"cpu","batch":8,"threads":0,"in_memory":true}'
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
for i in $(seq "$ROUNDS"); do
  "$XTASK" bench-case "$CASE" --scratch "$OUT" --repeats 10 | tail -1 > "$OUT/ours_$i.json"
  (cd "$PEER" && venv/bin/python torch_ssd_mobilenet_v1.py --no-variants --skip-pipeline \
    --no-tcmalloc-run --out "$OUT/torch_$i.json" > "$OUT/torch_$i.log" 2>&1)
  echo "round $i done"
done
python3 - "$OUT" "$ROUNDS" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
ratios = []
print("round  ssd-burn img/s  PyTorch default img/s  ratio")
for i in range(1, rounds + 1):
    ours = statistics.median(json.load(open(f"{out}/ours_{i}.json"))["images_per_sec"])
    torch = json.load(open(f"{out}/torch_{i}.json"))["train"]["batch8"]["images_per_s"]
    ratios.append(ours / torch)
    print(f"{i:5}  {ours:14.2f}  {torch:21.2f}  {ours / torch:5.2f}")
print(f"median ratio over {rounds} rounds: {statistics.median(ratios):.2f}")
EOF
