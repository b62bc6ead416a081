"""Runs the Python examples of the deployment guide (docs/src/deploying.md) as written and
compares them with `train detect` on the same image. See scripts/python-readers.sh.

Every ```python block of the guide is taken as it stands. A block whose first line is a comment
naming a file (`# tf_resize.py: ...`) is saved under that name; every other block is run, in
one folder holding the saved files, the exports under the names the guide uses
(`model.tflite`, `model.onnx`, `model.int8.tflite`) and the image as `cat.jpg` (PIL reads a
file by its content, whatever its name). A block that names none of the models is an error:
each example must be checked. Of each example:

- the input it feeds the runtime (`Interpreter.set_tensor`, `InferenceSession.run`, wrapped to
  record it) must be our `Detector`'s input for the image (`input_nhwc` of the reference file
  of `reference_outputs`): float32 within 1e-5; the int8 model's uint8 pixels are those values
  rounded to the nearest integer (`p = (v + 1) * 255 / 2`, within 0.5);
- what it prints (`ID SCORE [ymin xmin ymax xmax]`, boxes in pixels of the image) must be
  `train detect`'s detections (`detections.json`, `--score-threshold 0 --max-detections 100`):
  - the TFLite example: every detection scoring >= --score on either side has its match on the
    other, same class, score within --tol, box within --tol of the image's size (the TFLite
    op's list stops at max_total_detections with boxes that lie outside the image counted:
    where it is full, the comparison stops at its lowest score);
  - the int8 example: the same, with --int8-tol for scores and boxes (8-bit arithmetic);
  - the ONNX example (the five best anchors, no NMS): the five best anchors of the reference's
    raw scores and decoded boxes, within --tol, the first of them `train detect`'s first
    detection.

usage: guide_examples.py GUIDE.md IMAGE DETECTIONS.json REFERENCE.json --tflite F --onnx F
                         --int8 F [--score T] [--tol E] [--int8-tol E]
"""

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
from ai_edge_litert.interpreter import Interpreter
from PIL import Image

BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
SAVED = re.compile(r"#\s*([\w.-]+\.py)\b")
MODELS = ("model.tflite", "model.onnx", "model.int8.tflite")  # as the guide names them
IMAGE = "cat.jpg"
LINE = re.compile(r"^(\d+) (\S+) \[([^\]]*)\]", re.M)


def run_example(code, name, folder):
    """Runs `code` in `folder`; returns (the arrays fed to the runtime, what it printed)."""
    fed = []
    set_tensor, session_run = Interpreter.set_tensor, ort.InferenceSession.run

    def record_set_tensor(self, index, value):
        fed.append(np.array(value))
        return set_tensor(self, index, value)

    def record_run(self, output_names, input_feed, *args, **kwargs):
        fed.extend(np.array(v) for v in input_feed.values())
        return session_run(self, output_names, input_feed, *args, **kwargs)

    printed, cwd = io.StringIO(), os.getcwd()
    Interpreter.set_tensor, ort.InferenceSession.run = record_set_tensor, record_run
    sys.path.insert(0, folder)
    os.chdir(folder)
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(cwd)
        sys.path.remove(folder)
        Interpreter.set_tensor, ort.InferenceSession.run = set_tensor, session_run
    return fed, printed.getvalue()


def parse(printed, h, w):
    """The printed detections as (class id, score, normalised box)."""
    size = np.array([h, w, h, w], np.float64)
    out = [(int(m[1]), float(m[2]), np.array(m[3].split(), np.float64) / size)
           for m in LINE.finditer(printed)]
    assert out, f"no detection lines printed:\n{printed}"
    return out


def match(ours, theirs, tol, what):
    """Matches two lists of (class, score, box) one to one; returns the largest differences."""
    used, ds, db = [False] * len(theirs), 0.0, 0.0
    for cls, score, box in ours:
        for j, (c, s, b) in enumerate(theirs):
            d_s, d_b = abs(s - score), float(np.max(np.abs(b - box)))
            if not used[j] and c == cls and d_s <= tol and d_b <= tol:
                used[j], ds, db = True, max(ds, d_s), max(db, d_b)
                break
        else:
            raise AssertionError(f"{what}: ({cls}, {score:.6f}, {np.round(box, 4)}) has no match "
                                 f"within {tol} among {[(c, round(s, 6)) for c, s, _ in theirs]}")
    return ds, db


def check_postprocessed(detect, printed, score, tol, max_total, what):
    """An example printing the TFLite op's detections against `train detect`'s."""
    # the op's boxes are clipped by the example; those wholly outside the image come out empty
    # and we drop them
    theirs = [d for d in printed if (d[2][2] - d[2][0]) * (d[2][3] - d[2][1]) > 0]
    floor = score
    if len(printed) == max_total:  # the op's list was cut: compare above its last score
        floor = max(floor, min(s for _, s, _ in printed) + tol)
    ours_above = [d for d in detect if d[1] >= floor]
    theirs_above = [d for d in theirs if d[1] >= floor]
    assert ours_above, f"{what}: no detection of train detect scores >= {floor}"
    d1 = match(ours_above, [d for d in theirs if d[1] >= floor - tol], tol, f"{what}, ours")
    d2 = match(theirs_above, [d for d in detect if d[1] >= floor - tol], tol, f"{what}, theirs")
    return len(ours_above), max(d1[0], d2[0]), max(d1[1], d2[1])


def check_top_anchors(detect, printed, reference, num_classes, tol, what):
    """The ONNX example's best anchors against the reference's raw outputs and train detect."""
    scores = np.asarray(reference["class_predictions"], np.float32).reshape(-1, num_classes + 1)
    boxes = np.clip(np.asarray(reference["decoded_boxes"], np.float64), 0, 1)
    best = scores[:, 1:].max(axis=1)
    top = np.argsort(-best, kind="stable")[: len(printed)]
    expected = [(int(scores[a, 1:].argmax()) + 1, float(best[a]), boxes[a]) for a in top]
    ds, db = match(expected, printed, tol, f"{what}, the reference's best anchors")
    first = detect[0]
    c, s, b = printed[0]
    assert c == first[0] and abs(s - first[1]) <= tol and np.max(np.abs(b - first[2])) <= tol, \
        f"{what}: first line {printed[0]} is not train detect's first detection {first}"
    return len(printed), ds, db


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("guide")
    p.add_argument("image")
    p.add_argument("detections", help="detections.json of train detect on IMAGE")
    p.add_argument("reference", help="reference_outputs' file for IMAGE")
    for name in MODELS:  # the exports of the model train detect ran
        p.add_argument("--" + name.split(".")[1], required=True, help=f"run as {name}")
    p.add_argument("--score", type=float, default=0.5, help="compare detections scoring >= this")
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--int8-tol", type=float, default=0.02)
    args = p.parse_args()

    image = Path(args.image).resolve()
    ref = json.load(open(args.reference))
    (reference,) = [r for r in ref["images"] if Path(r["image"]).resolve() == image]
    (result,) = [r for r in json.load(open(args.detections)) if Path(r["file"]).resolve() == image]
    detect = [(d["class_id"], d["score"],
               np.array([d["bbox"][k] for k in ("ymin", "xmin", "ymax", "xmax")], np.float64))
              for d in result["detections"]]
    assert detect, "train detect found nothing to compare with"
    h, w = ref["image_size"]
    v = np.asarray(reference["input_nhwc"], np.float32).reshape(1, h, w, 3)
    with Image.open(args.image) as im:
        ih, iw = im.height, im.width

    text = Path(args.guide).read_text()
    # each block with the guide's line number of its first line
    blocks = [(text.count("\n", 0, m.start(1)) + 1, m[1]) for m in BLOCK.finditer(text)]
    assert blocks, f"{args.guide}: no python blocks"
    with tempfile.TemporaryDirectory() as folder:
        for name in MODELS:
            os.symlink(Path(getattr(args, name.split(".")[1])).resolve(), Path(folder, name))
        os.symlink(image, Path(folder, IMAGE))
        examples = []
        for line, code in blocks:
            saved = SAVED.match(code)
            if saved:
                Path(folder, saved[1]).write_text(code)
            else:
                examples.append((line, code))
        for line, code in examples:
            what = f"{args.guide}:{line}"
            kind = next((m for m in MODELS if f'"{m}"' in code), None)
            assert kind, f"{what}: opens none of {', '.join(MODELS)}"
            assert f'"{IMAGE}"' in code, f"{what}: does not read {IMAGE}"
            # blank lines first: tracebacks give the guide's line numbers
            fed, printed = run_example("\n" * (line - 1) + code, args.guide, folder)
            assert len(fed) == 1, f"{what}: fed {len(fed)} inputs"
            x = fed[0]
            assert x.shape == v.shape, f"{what}: input shape {x.shape}, expected {v.shape}"
            if kind == "model.int8.tflite":
                assert x.dtype == np.uint8, f"{what}: input {x.dtype}, expected uint8"
                d_in = float(np.max(np.abs(x - (v.astype(np.float64) + 1) * 127.5)))
                assert d_in <= 0.5 + 1e-3, f"{what}: pixels differ by {d_in} from ours, rounded"
            else:
                assert x.dtype == np.float32, f"{what}: input {x.dtype}, expected float32"
                d_in = float(np.max(np.abs(x - v)))
                assert d_in <= 1e-5, f"{what}: input differs by {d_in} from our Detector's"
            lines = parse(printed, ih, iw)
            if kind == "model.onnx":
                n, ds, db = check_top_anchors(detect, lines, reference, ref["num_classes"],
                                              args.tol, what)
            else:
                tol = args.int8_tol if kind == "model.int8.tflite" else args.tol
                n, ds, db = check_postprocessed(detect, lines, args.score, tol,
                                                ref["max_total_detections"], what)
            top = lines[0]
            print(f"{what} ({kind}): input within {d_in:.2e} of ours; {n} detections as "
                  f"train detect's, largest differences: score {ds:.2e}, box {db:.2e}; first "
                  f"{top[0]} {top[1]:.4f}, train detect's {detect[0][0]} {detect[0][1]:.4f}")


if __name__ == "__main__":
    main()
