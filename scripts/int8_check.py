"""Runs a `train export --format tflite --quantize int8` file in TFLite (`ai-edge-litert`) next
to the float export of the same model, on held-out images read from TFRecords, and checks:

- the input contract: `uint8` `[1, H, W, 3]` pixels with scale 2/255 and zero point 128;
- every operator before `TFLite_Detection_PostProcess` computes in 8 bits: its tensors are
  int8 (uint8 for the input, int32 for biases), but for the float32 outputs of the
  `DEQUANTIZE`s that feed the post-processing op;
- the file is about a quarter of the float one (at most --max-size-ratio of it: the anchors,
  float32, and the int32 biases keep a small model's ratio higher);
- at least 90% of the float model's confident detections (score >= --score) have an int8
  detection of the same class with IoU >= 0.5, each int8 detection matched once (the float
  detections in order of score, each to its best free int8 one), over at least
  --min-confident of them;
- the VOC mAP@0.5 (all-point interpolated AP per class, averaged over the classes with ground
  truth) of both models on these images, printed with its difference.

Both models get the same pixels: the image decoded and resized to the model's input (bilinear),
as uint8 for the int8 model and `(2 / 255) p - 1` for the float one. See
scripts/python-readers.sh.

usage: int8_check.py FLOAT.tflite INT8.tflite [--score S] [--min-confident N]
                     [--max-size-ratio R] RECORDS...
"""

import argparse
import io
import os
import struct

import numpy as np
from ai_edge_litert.interpreter import Interpreter, OpResolverType
from PIL import Image

POSTPROCESS = "TFLite_Detection_PostProcess"


def varint(buf, i):
    value, shift = 0, 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, i


def fields(buf):
    """The fields of a protobuf message: {number: [value]} (bytes for length-delimited)."""
    out, i = {}, 0
    while i < len(buf):
        key, i = varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 2:
            n, i = varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"wire type {wire}")
        out.setdefault(number, []).append(value)
    return out


def example_features(record):
    """A tf.train.Example as {key: list of bytes, floats or ints}."""
    features = {}
    for entry in fields(fields(record)[1][0]).get(1, []):
        entry = fields(entry)
        key = entry[1][0].decode()
        feature = fields(entry[2][0]) if 2 in entry else {}
        if 1 in feature:  # bytes_list
            features[key] = fields(feature[1][0]).get(1, [])
        elif 2 in feature:  # float_list, packed
            packed = b"".join(fields(feature[2][0]).get(1, []))
            features[key] = list(struct.unpack(f"<{len(packed) // 4}f", packed))
        elif 3 in feature:  # int64_list, packed or not
            values = fields(feature[3][0]).get(1, [])
            ints = [v for v in values if isinstance(v, int)]
            for packed in (v for v in values if isinstance(v, bytes)):
                i = 0
                while i < len(packed):
                    v, i = varint(packed, i)
                    ints.append(v)
            features[key] = ints
    return features


def read_records(path):
    data = open(path, "rb").read()
    i = 0
    while i < len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        yield data[i + 12:i + 12 + n]
        i += 16 + n


def held_out_images(paths, h, w):
    """(uint8 [1, h, w, 3] pixels, ground truth [(class index, box)]) per record."""
    for path in paths:
        for record in read_records(path):
            f = example_features(record)
            image = Image.open(io.BytesIO(f["image/encoded"][0])).convert("RGB")
            pixels = np.asarray(image.resize((w, h), Image.BILINEAR), np.uint8)[None]
            boxes = zip(*(f.get(f"image/object/bbox/{k}", []) for k in ("ymin", "xmin", "ymax", "xmax")))
            labels = f.get("image/object/class/label", [])
            yield pixels, [(label - 1, np.asarray(b)) for label, b in zip(labels, boxes)]


def interpreter(path):
    it = Interpreter(
        model_path=path,
        experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
    )
    it.allocate_tensors()
    return it


def check_int8_graph(it):
    (inp,) = it.get_input_details()
    assert inp["dtype"] == np.uint8, inp
    scale, zero_point = inp["quantization"]
    assert abs(scale - 2 / 255) < 1e-9 and zero_point == 128, inp["quantization"]
    dtypes = {t["index"]: t["dtype"] for t in it.get_tensor_details()}
    ops = it._get_ops_details()
    post = [op for op in ops if op["op_name"] == POSTPROCESS]
    assert len(post) == 1, [op["op_name"] for op in ops]
    feeds = set(post[0]["inputs"])
    allowed = {np.dtype(np.int8), np.dtype(np.uint8), np.dtype(np.int32)}
    for op in ops:
        if op is post[0]:
            continue
        for t in list(op["inputs"]) + list(op["outputs"]):
            float_feed = op["op_name"] == "DEQUANTIZE" and t in op["outputs"] and t in feeds
            assert np.dtype(dtypes[t]) in allowed or float_feed, \
                f"{op['op_name']} computes on {np.dtype(dtypes[t])} (tensor {t})"
    return len(ops)


def detect(it, x):
    it.set_tensor(it.get_input_details()[0]["index"], x)
    it.invoke()
    boxes, classes, scores, count = (it.get_tensor(o["index"]) for o in it.get_output_details())
    n = int(count[0])
    return [(int(c), float(s), np.clip(b, 0, 1)) for b, c, s in zip(boxes[0][:n], classes[0][:n], scores[0][:n])]


def iou(a, b):
    ih = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iw = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ih * iw
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def voc_map(results):
    """Mean over the classes with ground truth of the all-point interpolated AP at IoU 0.5."""
    classes = {c for _, gts in results for c, _ in gts}
    aps = []
    for cls in sorted(classes):
        dets = sorted(((s, i, b) for i, (ds, _) in enumerate(results) for c, s, b in ds if c == cls),
                      key=lambda d: -d[0])
        gts = [[b for c, b in g if c == cls] for _, g in results]
        used = [[False] * len(g) for g in gts]
        total = sum(len(g) for g in gts)
        tp = []
        for _, i, b in dets:
            best, j = max(((iou(b, g), j) for j, g in enumerate(gts[i])), default=(0.0, -1))
            hit = best >= 0.5 and not used[i][j]
            if hit:
                used[i][j] = True
            tp.append(hit)
        tp = np.asarray(tp, np.float64)
        recall = np.concatenate([[0], np.cumsum(tp) / total, [1]]) if len(tp) else np.array([0, 1])
        precision = np.concatenate([[0], np.cumsum(tp) / np.arange(1, len(tp) + 1), [0]]) \
            if len(tp) else np.array([0, 0])
        precision = np.maximum.accumulate(precision[::-1])[::-1]
        aps.append(float(np.sum((recall[1:] - recall[:-1]) * precision[1:])))
    return float(np.mean(aps)) if aps else 0.0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("float_model")
    p.add_argument("int8_model")
    p.add_argument("records", nargs="+")
    p.add_argument("--score", type=float, default=0.5)
    p.add_argument("--min-confident", type=int, default=10)
    p.add_argument("--max-size-ratio", type=float, default=0.3)
    a = p.parse_args()
    f_it, q_it = interpreter(a.float_model), interpreter(a.int8_model)
    ops = check_int8_graph(q_it)
    sizes = os.path.getsize(a.float_model), os.path.getsize(a.int8_model)
    ratio = sizes[1] / sizes[0]
    assert ratio <= a.max_size_ratio, f"int8 file {sizes[1]} bytes, {ratio:.2f} of the float one"
    _, h, w, _ = f_it.get_input_details()[0]["shape"]
    confident = matched = 0
    float_results, int8_results = [], []
    for pixels, truth in held_out_images(a.records, h, w):
        ours = detect(f_it, (pixels.astype(np.float32) * (2 / 255) - 1).astype(np.float32))
        theirs = detect(q_it, pixels)
        float_results.append((ours, truth))
        int8_results.append((theirs, truth))
        free = [True] * len(theirs)
        for cls, score, box in sorted(ours, key=lambda d: -d[1]):
            if score < a.score:
                continue
            confident += 1
            best, j = max(((iou(box, b), j) for j, (c, _, b) in enumerate(theirs)
                           if c == cls and free[j]), default=(0.0, -1))
            if best >= 0.5:
                free[j] = False
                matched += 1
    assert confident >= a.min_confident, \
        f"{confident} confident float detections, fewer than {a.min_confident}: no evidence"
    rate = matched / confident
    f_map, q_map = voc_map(float_results), voc_map(int8_results)
    print(f"int8: {len(float_results)} held-out images, {ops} operators 8-bit up to {POSTPROCESS}; "
          f"{matched}/{confident} = {rate:.1%} of the float model's detections scoring >= {a.score} "
          f"matched (same class, IoU >= 0.5); VOC mAP@0.5 float {f_map:.4f} int8 {q_map:.4f} "
          f"(difference {100 * (q_map - f_map):+.2f} points); file {sizes[1]} bytes, "
          f"{ratio:.3f} of the float {sizes[0]}")
    assert rate >= 0.9, f"only {rate:.1%} of the float model's confident detections matched"


if __name__ == "__main__":
    main()
