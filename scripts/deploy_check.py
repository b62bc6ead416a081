"""Runs `train export --format tflite` and `--format onnx` files in their own runtimes (the
TFLite interpreter of `ai-edge-litert`, ONNX Runtime) on the inputs in a reference file written
by our `Detector` (`cargo run --release -p model --example reference_outputs`) and compares:
the raw outputs (box codes, sigmoid scores) and ONNX's decoded boxes within 1e-4, and the
detections of TFLite's `TFLite_Detection_PostProcess` op (regular NMS) with ours (class, score
and box within 1e-4). Prints the largest differences. See scripts/python-readers.sh.

The documented differences of the TFLite op are applied to its detections before comparing:
its boxes are not clipped to the image (ours are: clipped here) and it keeps boxes that lie
wholly outside the image (we drop them, before cutting to max_total_detections: dropped here,
and with that the comparison stops where the op's list was cut). Equal scores may come in
either order (the op merges classes with an unstable sort): detections are matched as sets.

usage: deploy_check.py MODEL.tflite MODEL.onnx REFERENCE.json
"""

import json
import sys

import numpy as np
import onnxruntime as ort
from ai_edge_litert.interpreter import Interpreter, OpResolverType

TOL = 1e-4


def max_diff(a, b, what):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape, f"{what}: shape {a.shape} vs {b.shape}"
    d = float(np.max(np.abs(a - b))) if a.size else 0.0
    assert d <= TOL, f"{what}: max difference {d} > {TOL}"
    return d


def run_tflite(path, x):
    # the kernels TFLite itself ships (no XNNPACK): the intermediate raw outputs stay readable
    it = Interpreter(
        model_path=path,
        experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        experimental_preserve_all_tensors=True,
    )
    it.allocate_tensors()
    (inp,) = it.get_input_details()
    assert inp["name"] == "normalized_input_image_tensor", inp["name"]
    assert tuple(inp["shape"]) == x.shape, (inp["shape"], x.shape)
    it.set_tensor(inp["index"], x)
    it.invoke()
    outs = [it.get_tensor(o["index"]) for o in it.get_output_details()]
    by_name = {t["name"]: t["index"] for t in it.get_tensor_details()}
    raw = [it.get_tensor(by_name[n]) for n in ("raw_outputs/box_encodings",
                                               "raw_outputs/class_predictions")]
    return outs, raw


def tflite_detections(outs):
    """The op's detections with our post-processing's clipping and dropping applied; and
    whether the op's list was cut at max_detections."""
    boxes, classes, scores, count = outs
    n = int(count[0])
    kept = []
    for box, cls, score in zip(boxes[0][:n], classes[0][:n], scores[0][:n]):
        clipped = np.clip(box, 0.0, 1.0)
        if (clipped[2] - clipped[0]) * (clipped[3] - clipped[1]) > 0:
            kept.append((int(cls), float(score), clipped))
    return kept, n == boxes.shape[1]


def compare_detections(ours, theirs, cut):
    """Greedy set matching; returns (matched, max score diff, max box diff)."""
    if cut:
        assert len(ours) >= len(theirs), f"{len(ours)} detections, the op {len(theirs)}"
        ours = ours[: len(theirs)]
    assert len(ours) == len(theirs), f"{len(ours)} detections, the op {len(theirs)}"
    used = [False] * len(theirs)
    ds, db = 0.0, 0.0
    for d in ours:
        box = np.asarray(d["box"], np.float32)
        for j, (cls, score, tbox) in enumerate(theirs):
            s, b = abs(score - d["score"]), float(np.max(np.abs(tbox - box)))
            if not used[j] and cls == d["class_index"] and s <= TOL and b <= TOL:
                used[j] = True
                ds, db = max(ds, s), max(db, b)
                break
        else:
            raise AssertionError(f"our detection {d} has no match among the op's")
    return len(ours), ds, db


def main(tflite_path, onnx_path, reference_path):
    ref = json.load(open(reference_path))
    h, w = ref["image_size"]
    session = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
    worst = {"tflite raw": 0.0, "tflite score": 0.0, "tflite box": 0.0, "onnx": 0.0}
    matched = 0
    for image in ref["images"]:
        x = np.asarray(image["input_nhwc"], np.float32).reshape(1, h, w, 3)
        n = len(image["box_encodings"]) // 4
        codes = np.asarray(image["box_encodings"], np.float32).reshape(1, n, 4)
        scores = np.asarray(image["class_predictions"], np.float32).reshape(1, n, -1)
        outs, raw = run_tflite(tflite_path, x)
        worst["tflite raw"] = max(worst["tflite raw"], max_diff(raw[0], codes, "tflite box codes"),
                                  max_diff(raw[1], scores, "tflite scores"))
        theirs, cut = tflite_detections(outs)
        k, ds, db = compare_detections(image["detections"], theirs, cut)
        matched += k
        worst["tflite score"] = max(worst["tflite score"], ds)
        worst["tflite box"] = max(worst["tflite box"], db)
        o_codes, o_scores, o_boxes = session.run(None, {"normalized_input_image_tensor": x})
        decoded = np.asarray(image["decoded_boxes"], np.float32).reshape(1, n, 4)
        worst["onnx"] = max(worst["onnx"], max_diff(o_codes, codes, "onnx box codes"),
                            max_diff(o_scores, scores, "onnx scores"),
                            max_diff(o_boxes, decoded, "onnx decoded boxes"))
    assert matched > 0, "no detections compared"
    print(f"deploy: {len(ref['images'])} images, {n} anchors, {matched} TFLite detections equal "
          f"ours; max differences: TFLite raw {worst['tflite raw']:.2e}, TFLite detection score "
          f"{worst['tflite score']:.2e} box {worst['tflite box']:.2e}, ONNX {worst['onnx']:.2e}")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
