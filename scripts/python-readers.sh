#!/usr/bin/env bash
# Reads what a short training run writes with the Python tools users reach for: TensorBoard's
# own event reader on the event file (tags, steps and values against metrics.jsonl, the
# evaluation images) and the `safetensors` package on `train export`. Uses the release binaries
# (build them first); the Python packages go into a venv under target/ (PYTHON_READERS_VENV to
# choose another). Without PyPI access the venv cannot be made: the check then says so and is
# skipped (exit 0) unless PYTHON_READERS_REQUIRED=1.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${PYTHON_READERS_VENV:-target/python-readers}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import tensorboard, safetensors, numpy" 2>/dev/null; then
  if ! { python3 -m venv "$venv" && "$venv/bin/pip" install --quiet tensorboard safetensors numpy; }; then
    echo "python-readers: could not install tensorboard/safetensors into $venv: check skipped" >&2
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
