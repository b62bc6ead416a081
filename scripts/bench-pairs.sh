#!/usr/bin/env bash
# Interleaved pairs: one figure of ssd-burn, then the same figure of the PyTorch peer on the
# same machine a moment later, round after round, so that both fall in the same phase of a
# drifting VM. Prints each round's two medians and their ratio (ours over PyTorch's, for
# latency PyTorch's over ours: above 1 means we are faster), then the median ratio.
#
#   scripts/bench-pairs.sh PEER_DIR [ROUNDS] [OUT_DIR]
#
# FIGURE (environment, default train8): train8 | train24 (training step, batch in memory,
# images/s) | infer1 (batch-1 latency, model only) | infer8 (batch-8 images/s, model only).
# PEER_CONFIG (default `default`): `default` is PyTorch's default eager configuration, `best`
# its best one here: tcmalloc preloaded, channels_last, and BatchNorm folded for inference.
# PEER_DIR: a copy of ../shared/bench/peer/ with its venv (see its README). Uses
# target/release/xtask (cargo build --release -p xtask) unless XTASK names another build.
# About half a minute to two minutes a round; the machine should be otherwise idle.
set -euo pipefail
PEER=$(cd "${1:?usage: scripts/bench-pairs.sh PEER_DIR [ROUNDS] [OUT_DIR]}" && pwd)
ROUNDS=${2:-4}
OUT=${3:-target/bench-pairs}
XTASK=${XTASK:-target/release/xtask}
FIGURE=${FIGURE:-train8}
PEER_CONFIG=${PEER_CONFIG:-default}
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
case "$FIGURE" in
  train8 | train24)
    CASE="{\"kind\":\"train\",\"devices\":\"cpu\",\"batch\":${FIGURE#train},\"threads\":0,\"in_memory\":true}"
    REPEATS=10 ;;
  infer1 | infer8)
    CASE="{\"kind\":\"infer\",\"batch\":${FIGURE#infer},\"postprocess\":false}"
    REPEATS=20 ;;
  *) echo "FIGURE must be train8, train24, infer1 or infer8" >&2; exit 2 ;;
esac
case "$PEER_CONFIG" in
  default) PRELOAD= ;;
  best)
    [ -e "$TCMALLOC" ] || { echo "best needs $TCMALLOC (apt-get install libtcmalloc-minimal4)" >&2; exit 2; }
    PRELOAD=$TCMALLOC ;;
  *) echo "PEER_CONFIG must be default or best" >&2; exit 2 ;;
esac
SCRIPTS=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
for i in $(seq "$ROUNDS"); do
  "$XTASK" bench-case "$CASE" --scratch "$OUT" --repeats "$REPEATS" | tail -1 > "$OUT/ours_$i.json"
  (cd "$PEER" && LD_PRELOAD=$PRELOAD venv/bin/python "$SCRIPTS/peer_case.py" "$PEER" \
    "$FIGURE" "$PEER_CONFIG" 2> "$OUT/torch_$i.log" | tail -1 > "$OUT/torch_$i.json")
  echo "round $i done"
done
python3 - "$OUT" "$ROUNDS" "$FIGURE" "$PEER_CONFIG" <<'EOF'
import json, statistics, sys
out, rounds, figure, config = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
latency = figure == "infer1"
unit = "ms" if latency else "img/s"
ratios = []
print(f"{figure}, PyTorch {config}")
print(f"round  ssd-burn {unit:5}  PyTorch {unit:5}  ratio")
for i in range(1, rounds + 1):
    ours = json.load(open(f"{out}/ours_{i}.json"))
    torch = json.load(open(f"{out}/torch_{i}.json"))
    if latency:
        a, b = statistics.median(ours["ms_per_batch"]), torch["ms_per_batch"]
        ratio = b / a
    else:
        a, b = statistics.median(ours["images_per_sec"]), torch["images_per_s"]
        ratio = a / b
    ratios.append(ratio)
    print(f"{i:5}  {a:14.2f}  {b:13.2f}  {ratio:5.2f}")
print(f"median ratio over {rounds} rounds: {statistics.median(ratios):.2f}")
EOF
