"""Writes crates/data/tests/fixtures/tf_augment.json: the deterministic parts of the
Object Detection API's augmentation steps, computed by real TensorFlow, for the data
crate's tests. Run with the venv of setup.sh:

    /work/tf-ref/venv/bin/python scripts/tf-fixtures/augment_fixtures.py

Each step's random draw is fixed here (a delta, a scale, a patch position) and passed
to the TF op the step calls, so the test can apply the same draw to the same input.
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "crates", "data", "tests", "fixtures", "tf_augment.json")

rng = np.random.default_rng(7)
# an 8-bit RGB image, 5 rows x 7 columns, with greys and saturated pixels among the draws
image = rng.integers(0, 256, size=(5, 7, 3)).astype(np.uint8)
image[0, 0] = [128, 128, 128]
image[0, 1] = [255, 0, 0]
image[0, 2] = [0, 0, 0]
image[0, 3] = [10, 200, 10]
flt = tf.constant(image.astype(np.float32))

# random_adjust_hue: tf.image.adjust_hue(image / 255, delta) * 255, clipped to [0, 255]
hue = []
for delta in [-0.2, -0.05, 0.02, 0.13, 0.2, 0.5, -0.9]:
    out = tf.clip_by_value(tf.image.adjust_hue(flt / 255, delta) * 255, 0.0, 255.0)
    hue.append({"delta": delta, "image": out.numpy().reshape(-1).tolist()})

# random_rgb_to_gray: the API's _rgb_to_grayscale (weights 0.2989, 0.5870, 0.1140 on the
# float image), then tf.image.grayscale_to_rgb
sys.path.insert(0, os.environ.get("API_DIR", "/work/tf-ref/src/tf_models_research_object_detection-2.8.0.post1"))
from object_detection.core import preprocessor  # noqa: E402

gray = tf.image.grayscale_to_rgb(preprocessor._rgb_to_grayscale(flt)).numpy().reshape(-1).tolist()

boxes = tf.constant([[0.1, 0.2, 0.5, 0.9], [0.0, 0.0, 1.0, 1.0], [0.3, 0.6, 0.35, 0.7]])
rot = {
    "image": tf.image.rot90(flt).numpy().reshape(-1).tolist(),
    "shape": list(tf.image.rot90(flt).shape),
    "boxes": preprocessor._rot90_boxes(boxes).numpy().tolist(),
}
vflip = {
    "image": tf.image.flip_up_down(flt).numpy().reshape(-1).tolist(),
    "boxes": preprocessor._flip_boxes_up_down(boxes).numpy().tolist(),
}

# random_image_scale: the size int(h * coef), int(w * coef), bilinear with align_corners
scale = []
for coef in [0.5, 0.77, 1.0, 1.6, 2.0]:
    h = int(np.float32(5) * np.float32(coef))
    w = int(np.float32(7) * np.float32(coef))
    out = tf.compat.v1.image.resize_images(flt, [h, w], align_corners=True)
    scale.append({"coef": coef, "shape": [h, w], "image": out.numpy().reshape(-1).tolist()})

json.dump(
    {
        "source": "scripts/tf-fixtures/augment_fixtures.py, tensorflow-cpu " + tf.__version__,
        "height": 5,
        "width": 7,
        "image": image.reshape(-1).tolist(),
        "hue": hue,
        "gray": gray,
        "boxes": boxes.numpy().tolist(),
        "rotation90": rot,
        "vertical_flip": vflip,
        "image_scale": scale,
    },
    open(OUT, "w"),
)
print("wrote", os.path.normpath(OUT))
