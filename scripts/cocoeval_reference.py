"""Writes the COCO evaluation fixtures of `crates/train/src/eval/testdata/` and the numbers
pycocotools' COCOeval gives on them, which the tests of `train eval --ground-truth` compare
with (crates/train/src/eval/coco_json.rs).

Each case is a ground-truth file, a results file and `<case>.expected.json`: the twelve
`COCOeval.stats` of `iouType='bbox'`, written with `repr` (every digit of the float64).

- `ties`: what the COCO numbers of a real file hinge on. Image ids listed out of order;
  scores in steps of 1/256, as an int8 model gives them, so that many tie across images (the
  order of images breaks the ties); annotation `area`s (a mask's) that fall in another range
  than their box's, some on the range limits (1024, 9216, and values that float32 would round
  onto them); crowd regions, as `iscrowd: 1` and as `iscrowd: true`, with detections on them;
  detections inside their object at an IoU of exactly 0.7 or 0.85 (a threshold: float32 IoUs
  or thresholds not computed as numpy's linspace miss them); classes with 20 and 100 objects
  (their recalls land on the 101 recall points); an image with more than 100 detections.
- `zero`: category ids from 0, as Roboflow exports them.

The inputs are written with few digits (two decimals, scores k/256), so that every JSON reader
parses them to the same float64; the expected numbers are written twice, as floats and as
their IEEE-754 bits (`stats_bits`), which the tests compare exactly.

usage: python3 scripts/cocoeval_reference.py   (needs numpy and pycocotools; the numbers in
the repo came from pycocotools 2.0.11 and numpy 2.4.6 under Python 3.11)
"""

import contextlib
import io
import json
import os
import random
import struct

import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "crates", "train", "src", "eval", "testdata")


def q(x, digits=2):
    """A number with few decimals: every reader parses it to the same float64."""
    return round(x, digits)


def ties_case():
    rng = random.Random(20240611)
    categories = [{"id": 1, "name": "person"}, {"id": 5, "name": "bus"},
                  {"id": 7, "name": "train"}]
    image_ids = rng.sample(range(1, 100000), 40)  # out of order
    images = [{"id": i, "file_name": f"{i:012d}.jpg", "width": 640, "height": 480}
              for i in image_ids]
    annotations, detections = [], []
    # objects per class: exactly 20 of class 1 and 100 of class 5 that are not crowds
    plan = [1] * 20 + [5] * 100 + [7] * 60
    rng.shuffle(plan)

    def score():
        return rng.randint(40, 255) / 256

    def add_gt(image, cat, box, area, crowd):
        ann = {"id": len(annotations) + 1, "image_id": image, "category_id": cat,
               "bbox": box, "area": area}
        if crowd is not None:
            ann["iscrowd"] = crowd
        annotations.append(ann)

    def add_dt(image, cat, box, s):
        detections.append({"image_id": image, "category_id": cat, "bbox": box, "score": s})

    for n, cat in enumerate(plan):
        image = image_ids[n % len(image_ids)]
        side = rng.choice([12, 20, 28, 34, 40, 60, 90, 100, 130, 200])
        w = q(side * rng.uniform(0.7, 1.3))
        h = q(side * rng.uniform(0.7, 1.3))
        x = q(rng.uniform(0, 640 - w))
        y = q(rng.uniform(0, 480 - h))
        # a mask covers less than its box: often another range than the box's
        area = q(w * h * rng.uniform(0.45, 1.0), 4)
        kind = n % 13
        if kind == 3:
            area = 1024  # on the limit: small and medium
        elif kind == 5:
            area = 9216  # medium and large
        elif kind == 7:
            area = 1024.00001  # float32 rounds it onto the limit
        elif kind == 9:
            area = 9215.9996
        add_gt(image, cat, [x, y, w, h], area, rng.choice([0, 0, False]))
        r = rng.random()
        if kind in (1, 2) and w >= 20:
            # inside the object, the full height, 70% or 85% of its width: IoU 0.7 / 0.85
            frac = 0.7 if kind == 1 else 0.85
            add_dt(image, cat, [x, y, q(w * frac), h], score())
        elif r < 0.75:
            jx, jy = rng.gauss(0, side * 0.08), rng.gauss(0, side * 0.08)
            add_dt(image, cat, [q(x + jx), q(y + jy), q(w * rng.uniform(0.85, 1.15)),
                                q(h * rng.uniform(0.85, 1.15))], score())
        if rng.random() < 0.3:
            # a duplicate, a false positive at that rank
            add_dt(image, cat, [q(x + 3), q(y + 2), w, h], score())
    # exact IoUs of 0.7 and 0.85: integer boxes, so nothing rounds
    for k, image in enumerate(image_ids[:8]):
        cat = [1, 5, 7][k % 3]
        x, y = 300 + k, 200 + k
        add_gt(image, cat, [x, y, 100, 100], 10000, 0)
        add_dt(image, cat, [x, y, 70 if k % 2 else 85, 100], score())
    # crowd regions, with detections inside them (ignored) and beside them
    for k, image in enumerate(image_ids[::3]):
        cat = [1, 5, 7][k % 3]
        x, y = q(rng.uniform(0, 400)), q(rng.uniform(0, 300))
        w, h = q(rng.uniform(80, 200)), q(rng.uniform(60, 160))
        add_gt(image, cat, [x, y, w, h], q(w * h * 0.6, 4), 1 if k % 2 else True)
        for _ in range(rng.randint(1, 4)):
            dw, dh = q(rng.uniform(10, 50)), q(rng.uniform(10, 50))
            add_dt(image, cat, [q(x + rng.uniform(0, w - dw)), q(y + rng.uniform(0, h - dh)),
                                dw, dh], score())
    # false positives everywhere
    for _ in range(120):
        image = rng.choice(image_ids)
        cat = rng.choice([1, 5, 7])
        w, h = q(rng.uniform(8, 150)), q(rng.uniform(8, 150))
        add_dt(image, cat, [q(rng.uniform(0, 640 - w)), q(rng.uniform(0, 480 - h)), w, h],
               score())
    # more than 100 detections of one class on one image: the 100 best count, ties in order
    crowded = image_ids[-1]
    for _ in range(130):
        w, h = q(rng.uniform(10, 60)), q(rng.uniform(10, 60))
        add_dt(crowded, 7, [q(rng.uniform(0, 500)), q(rng.uniform(0, 400)), w, h],
               rng.randint(100, 110) / 256)
    rng.shuffle(detections)
    gt = {"images": images, "annotations": annotations, "categories": categories}
    return gt, detections


def zero_case():
    rng = random.Random(7)
    categories = [{"id": 0, "name": "cells"}, {"id": 1, "name": "red"},
                  {"id": 2, "name": "white"}]
    images = [{"id": i, "file_name": f"{i}.jpg", "width": 416, "height": 416}
              for i in (3, 1, 2)]
    annotations, detections = [], []
    for n in range(30):
        image = images[n % 3]["id"]
        cat = [0, 1, 2][n % 3] if n % 5 else 1
        w, h = q(rng.uniform(10, 120)), q(rng.uniform(10, 120))
        x, y = q(rng.uniform(0, 416 - w)), q(rng.uniform(0, 416 - h))
        annotations.append({"id": n + 1, "image_id": image, "category_id": cat,
                            "bbox": [x, y, w, h], "area": q(w * h, 4), "iscrowd": 0})
        if rng.random() < 0.8:
            detections.append({"image_id": image, "category_id": cat,
                               "bbox": [q(x + rng.uniform(-4, 4)), q(y + rng.uniform(-4, 4)),
                                        w, h], "score": rng.randint(1, 255) / 256})
        if rng.random() < 0.4:
            detections.append({"image_id": image, "category_id": rng.choice([0, 1, 2]),
                               "bbox": [q(rng.uniform(0, 300)), q(rng.uniform(0, 300)), 40, 40],
                               "score": rng.randint(1, 255) / 256})
    gt = {"images": images, "annotations": annotations, "categories": categories}
    return gt, detections


def stats(gt_path, dt_path):
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO(gt_path)
        coco_dt = coco_gt.loadRes(dt_path)
        e = COCOeval(coco_gt, coco_dt, "bbox")
        e.evaluate()
        e.accumulate()
        e.summarize()
    return [float(s) for s in e.stats]


def main():
    import pycocotools
    os.makedirs(OUT, exist_ok=True)
    for name, make in (("ties", ties_case), ("zero", zero_case)):
        gt, dt = make()
        gt_path = os.path.join(OUT, f"{name}.gt.json")
        dt_path = os.path.join(OUT, f"{name}.dt.json")
        with open(gt_path, "w") as f:
            json.dump(gt, f, indent=None, separators=(",", ":"))
        with open(dt_path, "w") as f:
            json.dump(dt, f, indent=None, separators=(",", ":"))
        numbers = stats(gt_path, dt_path)
        expected = {
            "made_by": "scripts/cocoeval_reference.py",
            "pycocotools": getattr(pycocotools, "__version__", "2.0.11"),
            "numpy": np.__version__,
            "stats": numbers,
            # the same as IEEE-754 bits: compared exactly, whatever a JSON reader's rounding
            "stats_bits": [struct.unpack("<Q", struct.pack("<d", x))[0] for x in numbers],
        }
        with open(os.path.join(OUT, f"{name}.expected.json"), "w") as f:
            f.write(json.dumps(expected, indent=1) + "\n")
        print(name, [round(s, 4) for s in numbers])


if __name__ == "__main__":
    main()
