"""Checks a run's TensorBoard event file with TensorBoard's reader and an exported model with
the `safetensors` package (see scripts/python-readers.sh).

usage: python_readers.py RUN_DIR MODEL.safetensors CONFIG.json
"""

import glob
import json
import math
import sys

import numpy as np
from safetensors import safe_open
from tensorboard.backend.event_processing import event_accumulator as ea


def check_events(run):
    files = glob.glob(f"{run}/events.out.tfevents.*")
    assert len(files) == 1, f"expected one event file in {run}, found {files}"
    acc = ea.EventAccumulator(files[0], size_guidance={ea.SCALARS: 0, ea.IMAGES: 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = set(tags["scalars"])
    wanted = {
        "loss/total", "loss/classification", "loss/localization", "loss/regularization",
        "learning_rate", "images_per_sec", "eval/AP", "eval/AP50", "eval/AP75", "eval/ARl",
        "eval/voc_mAP", "targets/matched_per_image", "targets/mined_negatives_per_image",
    }
    assert wanted <= scalars, f"missing scalar tags: {sorted(wanted - scalars)}"
    records = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
    compared = 0
    for rec in records:
        pairs = []
        if "loss" in rec:
            pairs += [(f"loss/{k}", v) for k, v in rec["loss"].items()]
            pairs += [(f"targets/{k}", v) for k, v in rec["targets"].items()]
            pairs.append(("learning_rate", rec["learning_rate"]))
        if "eval" in rec:
            pairs += [("eval/AP", rec["eval"]["AP"]), ("eval/voc_mAP", rec["eval"]["voc_mAP"])]
        for tag, value in pairs:
            events = [e for e in acc.Scalars(tag) if e.step == rec["step"]]
            assert len(events) == 1, f"{tag} at step {rec['step']}: {len(events)} events"
            # the event stores float32
            assert math.isclose(events[0].value, value, rel_tol=1e-6, abs_tol=1e-7), (
                f"{tag} at step {rec['step']}: event {events[0].value}, metrics.jsonl {value}"
            )
            compared += 1
    assert compared >= 10, f"only {compared} values compared"
    images = tags["images"]
    assert "eval/image_0" in images, f"no evaluation image among {images}"
    image = acc.Images("eval/image_0")[-1]
    assert image.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert image.width > 0 and image.height > 0
    print(f"events: {len(scalars)} scalar tags, {len(images)} image tags, {compared} values "
          f"equal to metrics.jsonl")


def check_safetensors(path, config_path):
    model = json.load(open(config_path))["model"]
    mult = model.get("depth_multiplier", 1.0)
    min_depth = model.get("min_depth", 16)
    classes = model["num_classes"]

    def depth(d):
        return max(int(d * mult), min_depth)

    with safe_open(path, "np") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    stored = json.loads(meta["config"])
    assert stored["num_classes"] == classes, "the metadata holds another config"
    base = "FeatureExtractor/MobilenetV1"
    convs = [f"{base}/Conv2d_0"]
    for i in range(1, 14):
        convs += [f"{base}/Conv2d_{i}_depthwise", f"{base}/Conv2d_{i}_pointwise"]
    for i, d in zip(range(2, 6), [512, 256, 256, 128]):
        convs += [f"{base}/Conv2d_13_pointwise_1_Conv2d_{i}_1x1_{depth(d // 2)}",
                  f"{base}/Conv2d_13_pointwise_2_Conv2d_{i}_3x3_s2_{depth(d)}"]
    expected = set()
    for c in convs:
        kernel = "depthwise_weights" if c.endswith("_depthwise") else "weights"
        expected.add(f"{c}/{kernel}")
        expected |= {f"{c}/BatchNorm/{p}" for p in ("gamma", "beta", "moving_mean", "moving_variance")}
    for i in range(6):
        for head in ("BoxEncodingPredictor", "ClassPredictor"):
            expected |= {f"BoxPredictor_{i}/{head}/weights", f"BoxPredictor_{i}/{head}/biases"}
    names = set(tensors)
    assert names == expected, (
        f"unexpected: {sorted(names - expected)[:5]}, missing: {sorted(expected - names)[:5]}"
    )
    for name, t in tensors.items():
        assert t.dtype == np.float32 and np.isfinite(t).all(), name
        assert t.ndim == (4 if name.endswith("weights") else 1), f"{name}: shape {t.shape}"
    for i in range(6):
        anchors = 3 if i == 0 else 6
        cls = tensors[f"BoxPredictor_{i}/ClassPredictor/weights"]
        box = tensors[f"BoxPredictor_{i}/BoxEncodingPredictor/weights"]
        assert cls.shape[0] == anchors * (classes + 1) and box.shape[0] == anchors * 4, i
    assert (tensors[f"{base}/Conv2d_0/BatchNorm/moving_variance"] > 0).all()
    assert tensors[f"{base}/Conv2d_0/weights"].shape[1:] == (3, 3, 3)
    print(f"safetensors: {len(tensors)} tensors with the documented names and shapes")


if __name__ == "__main__":
    run_dir, model_file, config_file = sys.argv[1:4]
    check_events(run_dir)
    check_safetensors(model_file, config_file)
