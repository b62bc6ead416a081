#!/usr/bin/env bash
# Whether a GPU trains the default run to the CPU's accuracy: `configs/synthetic.json` (3000
# steps, three evaluations) on DEVICES (default `wgpu`; `0` for CUDA) and, at the same time,
# on the CPU; then the VOC mAP@0.5 and the COCO AP of each run's last evaluation, which must
# agree within MAP_TOL (default 0.01). Builds nothing: run it from the repository root next to
# `train` and `xtask` binaries built elsewhere, e.g.
#   BIN=./train XTASK=./xtask DEVICES=wgpu scripts/gpu-map-check.sh
# Each run stops after LIMIT seconds (default 500). The logs and model dirs go to $OUT.
set -euo pipefail
BIN=${BIN:-target/release/train}
XTASK=${XTASK:-target/release/xtask}
DEVICES=${DEVICES:-wgpu}
OUT=${OUT:-gpu-map-check}
MAP_TOL=${MAP_TOL:-0.01}
LIMIT=${LIMIT:-500}
mkdir -p "$OUT"
# the synthetic set once, before two runs that would each generate it into the same files
if ! compgen -G 'datasets/synthetic/train.record-*' >/dev/null; then
  "$XTASK" prepare-data >"$OUT/prepare.log" 2>&1 || {
    tail -n 20 "$OUT/prepare.log"
    echo "gpu-map-check: preparing the synthetic set failed"
    exit 1
  }
fi
rm -rf "$OUT/cpu" "$OUT/gpu"
timeout "$LIMIT" "$BIN" --devices cpu --model-dir "$OUT/cpu" >"$OUT/cpu.log" 2>&1 &
cpu=$!
# the CPU run ends with this script, and at once when the GPU run fails
trap 'kill "$cpu" 2>/dev/null || true' EXIT
status=0
timeout "$LIMIT" "$BIN" --devices "$DEVICES" --model-dir "$OUT/gpu" >"$OUT/gpu.log" 2>&1 ||
  status=$?
[ "$status" = 0 ] || kill "$cpu" 2>/dev/null || true
cpu_status=0
wait "$cpu" || cpu_status=$?
[ "$status" != 0 ] || status=$cpu_status
grep -E "^(first step|done:)" "$OUT/cpu.log" "$OUT/gpu.log" || true
if [ "$status" != 0 ]; then
  tail -n 5 "$OUT/cpu.log" "$OUT/gpu.log"
  echo "gpu-map-check: a run failed (exit $status)"
  exit 1
fi
python3 - "$OUT" "$DEVICES" "$MAP_TOL" <<'PY'
import json, sys
out, devices, tol = sys.argv[1], sys.argv[2], float(sys.argv[3])
def last_eval(run):
    evals = [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl") if '"eval"' in l]
    return evals[-1]
cpu, gpu = last_eval("cpu"), last_eval("gpu")
worst = 0.0
for key, name in [("voc_mAP", "VOC mAP@0.5"), ("AP", "COCO AP")]:
    a, b = gpu["eval"][key], cpu["eval"][key]
    worst = max(worst, abs(a - b))
    print(f"{name} at step {gpu['step']}: {a:.4f} on {devices}, {b:.4f} on the CPU, difference {a - b:+.4f}")
ok = gpu["step"] == cpu["step"] and worst <= tol
print(f"gpu-map-check: {'within' if ok else 'NOT within'} {tol}")
sys.exit(0 if ok else 1)
PY
