#!/usr/bin/env bash
# The figures of the guide's "Quantization-aware training" section: a float run of 1000 steps
# on the synthetic set, then 300 more steps from it in float or with quantization-aware
# training; each run exported in float and int8 (calibrated, or with the learned ranges) and
# compared by LiteRT on the held-out records (scripts/int8_check.py). Uses the release binaries
# and the venv of scripts/python-readers.sh; OUT (default a temporary folder) keeps the runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${CARGO_TARGET_DIR:-target}/release
python=${PYTHON_READERS_VENV:-target/python-readers}/bin/python
out=${OUT:-$(mktemp -d)}
"$bin/xtask" prepare-data --out "$out/data" --train 128 --val 32 --num-shards 1 >/dev/null
common=(--devices cpu --batch-size 8 --train-data "$out/data/train.record-*"
  --eval-data "$out/data/val.record-*")
"$bin/train" "${common[@]}" --config configs/synthetic.json --model-dir "$out/float" \
  --num-steps 1000 >"$out/float.log" 2>&1
"$python" - "$out" <<'PY'
import json, sys
out = sys.argv[1]
c = json.load(open("configs/synthetic.json"))
c["train"]["fine_tune_checkpoint"] = f"{out}/float"
c["train"]["num_steps"] = 300
json.dump(c, open(f"{out}/config-continued.json", "w"), indent=1)
c["model"]["quantization"] = {"delay": 0}
json.dump(c, open(f"{out}/config-qat.json", "w"), indent=1)
PY
for run in continued qat; do
  "$bin/train" "${common[@]}" --config "$out/config-$run.json" --model-dir "$out/$run" \
    >"$out/$run.log" 2>&1
done
for run in float continued qat; do
  "$bin/train" export --model-dir "$out/$run" --format tflite --out "$out/$run.tflite" >/dev/null
  "$bin/train" export --model-dir "$out/$run" --format tflite --quantize int8 \
    --calibration-data "$out/data/train.record-*" --out "$out/$run.int8.tflite" >/dev/null
  echo "== $run"
  "$python" scripts/int8_check.py "$out/$run.tflite" "$out/$run.int8.tflite" --score 0.2 \
    "$out"/data/val.record-*
done
