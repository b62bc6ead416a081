#!/usr/bin/env bash
# The short check for a machine with CUDA GPUs (sized for one H200 and 15 minutes). Builds
# nothing: run it from the repository root next to `train` and `xtask` binaries built
# elsewhere (cargo build --release --workspace), e.g.
#   BIN=./train XTASK=./xtask PEER_DIR=peer MPI_BIN=./train-mpi scripts/gpu-check.sh
# Parts: the start-up of the pets config at 24 images (300x300, 37 classes) with an empty
# kernel cache and again with the cache it filled (`xtask launches`: kernels compiled, shapes
# autotuned and seconds of the first training step and of a first inference pass, then the
# launches and seconds of steady steps); a synthetic run on device 0; the same on two wgpu
# devices of the one GPU (`wgpu:0,1`: the multi-device path at GPU speed); with two or more
# CUDA GPUs `--devices 0,1` by the default exchange and through the host; the bench's
# device-0 cases (training with the loader and with the batch in memory, inference, and the
# depthwise filter gradients as trained against Burn's grouped convolution); and, with
# PEER_DIR (a copy of ../shared/bench/peer/) and torch installed, the PyTorch peer's step on
# the same GPU (fp32, TF32 stated, and bfloat16 AMP); with Open MPI's `mpirun` and MPI_BIN (a
# `train` built with MPI: cargo build --release -p train --features mpi) two processes under
# mpirun (see mpi_part). The wgpu part runs last. Every part's output goes to $OUT.
# The kernel cache is $OUT/kernel-cache (SSD_BURN_KERNEL_CACHE), kept between calls where $OUT
# survives; the cold start uses $OUT/cold-cache, emptied first.
# Exits non-zero when a training part fails, or when two runs that must agree do not: the
# exchange paths of `--devices 0,1` give losses within LOSS_RTOL (relative, default 1e-3) of
# each other at every logged step, and so do the two processes under mpirun and the one
# process with both replicas.
set -euo pipefail
BIN=${BIN:-target/release/train}
XTASK=${XTASK:-target/release/xtask}
STEPS=${STEPS:-30}
MPI_BIN=${MPI_BIN:-}
OUT=${OUT:-gpu-check}
LOSS_RTOL=${LOSS_RTOL:-1e-3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export SSD_BURN_KERNEL_CACHE="$OUT/kernel-cache"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)

# one training part: a run that must finish (status 0) within its time limit
train_part() {
  local name=$1 limit=$2
  shift 2
  echo "== $name" | tee -a "$OUT/train.txt"
  if ! timeout "$limit" "$BIN" "$@" --model-dir "$OUT/$name" >"$OUT/$name.log" 2>&1; then
    tail -20 "$OUT/$name.log" | tee -a "$OUT/train.txt"
    echo "gpu-check: $name failed" | tee -a "$OUT/train.txt"
    exit 1
  fi
  grep -E "exchange between|step [0-9]+/|replicas|images/s|mAP" "$OUT/$name.log" | tail -8 |
    tee -a "$OUT/train.txt"
}

# the logged total losses of two runs agree within LOSS_RTOL at every step
same_losses() {
  python3 - "$OUT/$1/metrics.jsonl" "$OUT/$2/metrics.jsonl" "$LOSS_RTOL" <<'PY' | tee -a "$OUT/train.txt"
import json, sys
def losses(path):
    return [json.loads(l)["loss"]["total"] for l in open(path) if '"loss"' in l]
a, b, rtol = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
print(f"{len(a)} and {len(b)} logged losses, largest relative difference {worst:.2e} (limit {rtol:.0e})")
sys.exit(0 if len(a) == len(b) and worst <= rtol else 1)
PY
}

# the start-up, cold (an empty kernel cache) then warm (the cache the cold run filled)
rm -rf "$OUT/cold-cache"
for start in cold warm; do
  echo "== start-up, $start" | tee -a "$OUT/startup.txt"
  SSD_BURN_KERNEL_CACHE="$OUT/cold-cache" timeout 420 "$XTASK" launches --device 0 \
    --configs configs/ssd_mobilenet_v1_pets.json --batch 24 --out "$OUT/launches-$start.json" \
    2>&1 | tee -a "$OUT/startup.txt"
done
train_part synthetic-0 150 --devices 0 --num-steps "$STEPS"
# without the toolkit's headers (as on a driver-only host) the run is refused at once,
# naming what is missing, where cubecl would panic in its runner thread and hang
mkdir -p "$OUT/no-toolkit"
start=$(date +%s%N)
status=0
CUDA_PATH="$OUT/no-toolkit" timeout 60 "$BIN" --devices 0 --num-steps 1 \
  --model-dir "$OUT/no-toolkit-run" >"$OUT/no-toolkit.log" 2>&1 || status=$?
echo "== no-toolkit: exit $status after $(( ($(date +%s%N) - start) / 1000000 )) ms" |
  tee -a "$OUT/train.txt"
grep -m1 "cuda_runtime.h does not exist" "$OUT/no-toolkit.log" | tee -a "$OUT/train.txt"
if [ "$status" = 0 ] || [ "$status" = 124 ]; then
  echo "gpu-check: a run without the CUDA headers was not refused" | tee -a "$OUT/train.txt"
  exit 1
fi
if [ "$GPUS" -ge 2 ]; then
  # a checkpoint every 10 steps first checks that the replicas hold bit-identical weights
  train_part synthetic-01-default 90 --devices 0,1 --num-steps "$STEPS" --no-eval
  SSD_BURN_HOST_STAGED=1 train_part synthetic-01-host 90 --devices 0,1 --num-steps "$STEPS" --no-eval
  same_losses synthetic-01-default synthetic-01-host
fi
# Two processes under mpirun, one replica each, against one process with both replicas (the
# same global batch; the sum of two operands is the same in either order, so the losses
# should agree to the last bit). With two GPUs each process takes the GPU of its local rank
# and the sums go between them by NCCL (where libnccl is installed, else by the fallback); on
# one GPU both processes share it, which NCCL refuses ("Duplicate GPU detected"), so the
# start-up check must fail on both and the run fall back to MPI through host memory, saying
# why.
mpi_part() {
  if ! command -v mpirun >/dev/null || [ -z "$MPI_BIN" ] || [ ! -x "$MPI_BIN" ]; then
    echo "== mpi: skipped (needs Open MPI's mpirun and MPI_BIN, a train built with --features mpi)" |
      tee -a "$OUT/train.txt"
    return 0
  fi
  local reference=synthetic-01-default devices=() expect="NCCL on the GPUs"
  # grep reads all of ldconfig's output: with -q, an early exit fails the pipe (pipefail)
  if ! ldconfig -p 2>/dev/null | grep "libnccl\.so" >/dev/null; then
    expect="MPI through host memory"
  fi
  if [ "$GPUS" -lt 2 ]; then
    reference=synthetic-00
    devices=(--devices 0)
    expect="MPI through host memory"
    train_part synthetic-00 90 --devices 0,0 --num-steps "$STEPS" --no-eval
  fi
  echo "== mpi-2 (expecting: $expect)" | tee -a "$OUT/train.txt"
  if ! timeout 240 mpirun --allow-run-as-root --oversubscribe -np 2 -x SSD_BURN_KERNEL_CACHE \
    "$MPI_BIN" ${devices[@]+"${devices[@]}"} --num-steps "$STEPS" --no-eval --model-dir "$OUT/mpi-2" \
    >"$OUT/mpi-2.log" 2>&1; then
    tail -20 "$OUT/mpi-2.log" | tee -a "$OUT/train.txt"
    echo "gpu-check: mpi-2 failed" | tee -a "$OUT/train.txt"
    exit 1
  fi
  { grep -E "exchange between processes|no NCCL" "$OUT/mpi-2.log" || true; } |
    tee -a "$OUT/train.txt"
  if ! grep -q "exchange between processes: $expect" "$OUT/mpi-2.log"; then
    echo "gpu-check: mpi-2 did not exchange by $expect" | tee -a "$OUT/train.txt"
    exit 1
  fi
  same_losses mpi-2 "$reference"
}
mpi_part
# the pets model (300x300, 37 classes) on GPU 0: training with the data loader and with the
# batch in memory, inference at batch 1 (with and without NMS) and 8
timeout 240 "$XTASK" bench --only="--devices 0" --repeats 5 --out "$OUT/bench.json" 2>&1 |
  tee "$OUT/bench.txt"
if [ -n "${PEER_DIR:-}" ] && python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  for precision in "--tf32 default" "--tf32 off" "--amp"; do
    # shellcheck disable=SC2086 # two words on purpose
    timeout 120 python3 scripts/torch_gpu_step.py "$PEER_DIR" --batch 12 24 $precision |
      tee -a "$OUT/torch.txt"
  done
fi
# the multi-device path at GPU speed, last: it needs a Vulkan loader and driver
train_part synthetic-wgpu01 150 --devices wgpu:0,1 --num-steps "$STEPS" --no-eval
echo "gpu-check: every part passed"
