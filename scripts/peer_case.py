"""One figure of the PyTorch peer (../shared/bench/peer/torch_ssd_mobilenet_v1.py), in its
default eager configuration or its best one, as one JSON line: images/s and the median ms per
batch. Run by scripts/bench-pairs.sh with the peer's venv; "best" also needs tcmalloc
preloaded (the script does that), as the peer's own "best" figures have it.

    python peer_case.py PEER_DIR FIGURE CONFIG
    FIGURE: train8 | train24 | infer1 | infer8     CONFIG: default | best
"""
import json
import sys

FIGURES = {"train8": ("train", 8), "train24": ("train", 24), "infer1": ("infer", 1),
           "infer8": ("infer", 8)}
peer_dir, figure, config = (sys.argv + [""] * 3)[1:4]
if figure not in FIGURES or config not in ("default", "best"):
    sys.exit(f"usage: peer_case.py PEER_DIR {{{'|'.join(FIGURES)}}} {{default|best}}")
kind, batch = FIGURES[figure]
sys.path.insert(0, peer_dir)
import torch  # noqa: E402
import torch_ssd_mobilenet_v1 as peer  # noqa: E402

torch.set_num_threads(2)
best = config == "best"
anchors = peer.ssd_anchors([(19, 19), (10, 10), (5, 5), (3, 3), (2, 2), (1, 1)])
if kind == "train":
    # the peer's full run: 3 warm-up steps at batch 8, 2 at batch 24
    r = peer.bench_train(batch, 3 if batch == 8 else 2, 10, anchors, channels_last=best)
    ms = 1000 * r["step_s"]["median"]
else:
    torch.manual_seed(0)
    model = peer.SSDMobileNetV1().eval()
    if best:
        model = peer.fold_batchnorm(model).to(memory_format=torch.channels_last)
    r = peer.bench_infer(model, batch, 10 if batch == 1 else 3, 40 if batch == 1 else 10,
                         anchors, False, channels_last=best)
    ms = r["latency_ms"]["median"]
print(json.dumps({"figure": figure, "config": config, "images_per_s": batch * 1000 / ms,
                  "ms_per_batch": ms}))
