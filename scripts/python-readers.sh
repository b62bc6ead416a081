#!/usr/bin/env bash
# Reads what a short training run writes with the Python tools users reach for: TensorBoard's
# own event reader on the event file (tags, steps and values against metrics.jsonl, the
# evaluation images) and the `safetensors` package on `train export`; and runs the TFLite and
# ONNX exports of that run and of the TF-written 37-class pets-config fixture in TFLite
# (`ai-edge-litert`) and ONNX Runtime against our Detector (scripts/deploy_check.py), and the
# run's int8 TFLite export next to its float one on held-out images (scripts/int8_check.py), also
# after a few steps of quantization-aware training; and runs the Python examples of
# docs/src/deploying.md as written against `train detect` (scripts/guide_examples.py). Uses the
# release binaries and the `reference_outputs` example (build them first: `cargo build
# --release --workspace --all-targets`); the Python packages go into a venv under target/
# (PYTHON_READERS_VENV to choose another). Without PyPI access the venv cannot be made: the
# check then says so and is skipped (exit 0) unless PYTHON_READERS_REQUIRED=1.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${PYTHON_READERS_VENV:-target/python-readers}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import tensorboard, safetensors, numpy, onnxruntime, ai_edge_litert, PIL" 2>/dev/null; then
  if ! { python3 -m venv "$venv" && "$venv/bin/pip" install --quiet tensorboard safetensors numpy onnxruntime ai-edge-litert pillow; }; then
    echo "python-readers: could not install tensorboard/safetensors/onnxruntime/ai-edge-litert/pillow into $venv: check skipped" >&2
    [ "${PYTHON_READERS_REQUIRED:-0}" = 1 ] && exit 1
    exit 0
  fi
fi
bin=${CARGO_TARGET_DIR:-target}/release
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$bin/xtask" prepare-data --out "$work/data" --train 32 --val 8 --num-shards 1 >/dev/null
"$bin/train" --devices cpu --config configs/synthetic.json --model-dir "$work/run" \
  --num-steps 20 --batch-size 4 --train-data "$work/data/train.record-*" \
  --eval-data "$work/data/val.record-*" 2>"$work/train.log" || { cat "$work/train.log" >&2; exit 1; }
"$bin/train" export --model-dir "$work/run" --config configs/synthetic.json \
  --out "$work/model.safetensors" 2>>"$work/train.log"
"$venv/bin/python" scripts/python_readers.py "$work/run" "$work/model.safetensors" configs/synthetic.json
# the deployment formats in their runtimes, on the same preprocessed images as our Detector
images=(crates/model/tests/fixtures/tf/ssd/image_{0,1,2}.png)
deploy_check() { # NAME, then the model arguments of `train export`
  local name=$1
  shift
  for format in safetensors tflite onnx; do
    "$bin/train" export "$@" --format "$format" --out "$work/$name.$format" \
      >/dev/null 2>>"$work/train.log" || { cat "$work/train.log" >&2; exit 1; }
  done
  "$bin/examples/reference_outputs" "$work/$name.safetensors" "$work/$name.reference.json" \
    "${images[@]}" >/dev/null
  "$venv/bin/python" scripts/deploy_check.py "$work/$name.tflite" "$work/$name.onnx" \
    "$work/$name.reference.json"
}
deploy_check synthetic --model-dir "$work/run" --config configs/synthetic.json
deploy_check pets --model-dir crates/model/tests/fixtures/tf/ssd/model.ckpt \
  --config scripts/tf-fixtures/pipeline.config
# the int8 exports, calibrated on the run's training records (the pets config's own input is a
# placeholder), against their float exports on the held-out records; the pets fixture's small
# network keeps more of its size in the float32 anchors and the int32 biases
int8_check() { # NAME, MAX_SIZE_RATIO, then the model arguments of `train export`
  local name=$1 ratio=$2
  shift 2
  "$bin/train" export "$@" --format tflite --quantize int8 \
    --calibration-data "$work/data/train.record-*" --out "$work/$name.int8.tflite" \
    >/dev/null 2>>"$work/train.log" || { cat "$work/train.log" >&2; exit 1; }
  "$venv/bin/python" scripts/int8_check.py "$work/$name.tflite" "$work/$name.int8.tflite" \
    --max-size-ratio "$ratio" "$work"/data/val.record-*
}
int8_check synthetic 0.3 --model-dir "$work/run" --config configs/synthetic.json
# quantization-aware training: 10 more steps of the run with fake quantization from the first;
# its int8 export takes the learned ranges (the calibration records int8_check passes are unused)
"$venv/bin/python" -c 'import json, sys
c = json.load(open("configs/synthetic.json"))
c["model"]["quantization"] = {"delay": 0}
c["train"]["fine_tune_checkpoint"] = sys.argv[1]
json.dump(c, open(sys.argv[2], "w"))' "$work/run" "$work/qat-config.json"
"$bin/train" --devices cpu --config "$work/qat-config.json" --model-dir "$work/qat" --num-steps 10 \
  --batch-size 4 --train-data "$work/data/train.record-*" --no-eval 2>>"$work/train.log" ||
  { cat "$work/train.log" >&2; exit 1; }
deploy_check qat --model-dir "$work/qat" --config "$work/qat-config.json"
int8_check qat 0.3 --model-dir "$work/qat" --config "$work/qat-config.json"
grep -q "learned in quantization-aware training" "$work/train.log" ||
  { echo "the QAT run's int8 export calibrated instead of taking its learned ranges" >&2; exit 1; }
int8_check pets 0.45 --model-dir crates/model/tests/fixtures/tf/ssd/model.ckpt \
  --config scripts/tf-fixtures/pipeline.config
# the guide's Python examples as written, against `train detect` on the same weights and image:
# on the pets fixture, whose scores move by about 1e-3 when the input is resized otherwise (the
# CI run's 20-step model scores every input within 1e-7 the same)
guide_image=${images[0]}
"$bin/train" detect --model-dir "$work/pets.safetensors" --out "$work/guide-detect" \
  --score-threshold 0 --max-detections 100 "$guide_image" >/dev/null 2>>"$work/train.log" ||
  { cat "$work/train.log" >&2; exit 1; }
"$venv/bin/python" scripts/guide_examples.py docs/src/deploying.md "$guide_image" \
  "$work/guide-detect/detections.json" "$work/pets.reference.json" --tflite "$work/pets.tflite" \
  --onnx "$work/pets.onnx" --int8 "$work/pets.int8.tflite" --score 0.8
