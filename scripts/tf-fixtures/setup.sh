#!/usr/bin/env bash
# Creates the Python environment and the TF Object Detection API sources that
# make_fixtures.py needs, all OUTSIDE this repository (default /work/tf-ref,
# override with TF_REF=...). Idempotent: re-running only redoes missing steps.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TF_REF="${TF_REF:-/work/tf-ref}"
PY="${PYTHON:-python3}"
VENV="$TF_REF/venv"
SRC="$TF_REF/src"
API_VER=2.8.0.post1
API_DIR="$SRC/tf_models_research_object_detection-$API_VER"
mkdir -p "$TF_REF" "$SRC" "$TF_REF/tf115"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/pip"
if ! "$VENV/bin/python" -c 'import tensorflow, tf_slim, tf_keras, safetensors, scipy, matplotlib, grpc_tools, pycocotools' 2>/dev/null; then
  "$PIP" install -q --upgrade pip
  # TF 2.21 (CPU) and its own dependencies (numpy, protobuf, ml_dtypes, ...)
  "$PIP" install -q 'tensorflow-cpu==2.21.0'
  # TF-slim and the Keras-2 package that TF 2.21's legacy tf.layers load, without
  # letting them change TF's pins
  "$PIP" install -q --no-deps 'tf-slim==1.1.0' 'tf-keras==2.21.0'
  # safetensors for the output file; modules the API imports at module level
  # (scipy: core/densepose_ops, matplotlib/pillow: utils/visualization_utils,
  # contextlib2); grpcio-tools for protoc (regenerating the API's *_pb2.py)
  "$PIP" install -q 'safetensors==0.8.0' scipy pillow matplotlib contextlib2 \
    'grpcio-tools==1.85.1'
  # pycocotools: imported at module level by eval_util (model_lib, part 'step')
  "$PIP" install -q 'pycocotools==2.0.11'
fi

# The API sdist from PyPI (holds object_detection/ and slim/).
if [ ! -f "$API_DIR/.protos-regenerated" ]; then
  rm -rf "$API_DIR"
  if [ ! -f "$SRC/tf_models_research_object_detection-$API_VER.tar.gz" ]; then
    "$PIP" download -q --no-deps --no-binary :all: \
      "tf-models-research-object-detection==$API_VER" -d "$SRC"
  fi
  tar -xzf "$SRC/tf_models_research_object_detection-$API_VER.tar.gz" -C "$SRC"
  # It ships protoc-3.x generated *_pb2.py only (no .proto): regenerate them from
  # their own embedded descriptors with the venv's protoc.
  "$VENV/bin/python" "$HERE/regen_protos.py" "$API_DIR"
  touch "$API_DIR/.protos-regenerated"
fi

# TF 2.x has no tf.contrib; the API's TF1 optimizer builder wraps the optimizer in
# tf.contrib.opt.MovingAverageOptimizer. Take that one source file from the real
# TF 1.15 wheel on PyPI (the wheel itself is never installed).
MAO="$TF_REF/tf115/tensorflow_core/contrib/opt/python/training/moving_average_optimizer.py"
if [ ! -f "$MAO" ]; then
  if ! ls "$TF_REF"/tf115/tensorflow_cpu-1.15.0-*.whl >/dev/null 2>&1; then
    "$PIP" download -q --no-deps --only-binary :all: --python-version 37 \
      --platform manylinux2010_x86_64 'tensorflow-cpu==1.15.0' -d "$TF_REF/tf115"
  fi
  "$VENV/bin/python" - "$TF_REF/tf115" <<'PYEOF'
import glob, sys, zipfile
d = sys.argv[1]
z = zipfile.ZipFile(glob.glob(d + "/tensorflow_cpu-1.15.0-*.whl")[0])
z.extract("tensorflow_core/contrib/opt/python/training/moving_average_optimizer.py", d)
PYEOF
fi
echo "tf-ref ready: $VENV, $API_DIR"
