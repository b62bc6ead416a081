#!/usr/bin/env python3
"""Generate the TensorFlow reference fixtures under crates/model/tests/fixtures/tf/.

Runs real TensorFlow (tensorflow-cpu 2.21) and the TF Object Detection API's own
code (PyPI sdist tf-models-research-object-detection 2.8.0.post1, unpacked
outside this repo by setup.sh).  See PROVENANCE.md next to this file.

usage:
  make_fixtures.py                 # every part, each in its own process
  make_fixtures.py --part NAME     # one of: bundle_v1 bundle_tf2 ssd slim step

Each part runs in a fresh Python process because TF1 (graph) mode and TF2
(eager) mode cannot be mixed in one process.
"""
import argparse
import json
import os
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
OUT = os.path.join(REPO, "crates", "model", "tests", "fixtures", "tf")
TF_REF = os.environ.get("TF_REF", "/work/tf-ref")
SRC = os.path.join(TF_REF, "src", "tf_models_research_object_detection-2.8.0.post1")
MAO = os.path.join(TF_REF, "tf115", "tensorflow_core", "contrib", "opt", "python",
                   "training", "moving_average_optimizer.py")
PIPELINE = os.path.join(HERE, "pipeline.config")
PARTS = ["bundle_v1", "bundle_tf2", "slim", "ssd", "step"]


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------

def session_config(tf, cpus=1):
    return tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=1, inter_op_parallelism_threads=1,
        device_count={"CPU": cpus})


def import_tf_v1():
    import tensorflow as tf
    tf.compat.v1.disable_v2_behavior()
    tf.compat.v1.disable_eager_execution()
    return tf


def write_json(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=False)
        fh.write("\n")


def _varint(buf, pos):
    shift = result = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _block_entries(buf):
    """Entries of one LevelDB-style table block (TF's lib/io/table format)."""
    num_restarts = struct.unpack("<I", buf[-4:])[0]
    end = len(buf) - 4 - 4 * num_restarts
    pos, key = 0, b""
    while pos < end:
        shared, pos = _varint(buf, pos)
        non_shared, pos = _varint(buf, pos)
        vlen, pos = _varint(buf, pos)
        key = key[:shared] + buf[pos:pos + non_shared]
        pos += non_shared
        yield key, buf[pos:pos + vlen]
        pos += vlen


def read_bundle_index(path):
    """Parse a V2 checkpoint .index file: {key: BundleEntryProto}, header at ''.

    Used only to record shard ids / offsets / crc32c in the JSON files (the
    tensors themselves are read back with TF's own checkpoint reader)."""
    from tensorflow.core.protobuf import tensor_bundle_pb2
    data = open(path, "rb").read()
    footer = data[-48:]
    assert struct.unpack("<Q", footer[-8:])[0] == 0xDB4775248B80FB57, "bad table magic"
    _, p = _varint(footer, 0)
    _, p = _varint(footer, p)  # metaindex handle (unused)
    index_off, p = _varint(footer, p)
    index_size, p = _varint(footer, p)
    out = {}
    for _, handle in _block_entries(data[index_off:index_off + index_size]):
        off, q = _varint(handle, 0)
        size, q = _varint(handle, q)
        assert data[off + size] == 0, "compressed block"
        for key, value in _block_entries(data[off:off + size]):
            k = key.decode("utf-8")
            if k == "":
                msg = tensor_bundle_pb2.BundleHeaderProto()
            else:
                msg = tensor_bundle_pb2.BundleEntryProto()
            msg.ParseFromString(value)
            out[k] = msg
    return out


def entry_info(e):
    from tensorflow.core.framework import types_pb2
    return {"shard_id": e.shard_id, "offset": e.offset, "size": e.size,
            "crc32c": e.crc32c, "index_dtype": types_pb2.DataType.Name(e.dtype)}


def describe_value(arr, tf_dtype_name):
    """JSON description of a numpy value read back from a checkpoint."""
    import numpy as np
    d = {"dtype": tf_dtype_name, "shape": list(arr.shape)}
    if arr.dtype == object or arr.dtype.kind == "S":
        flat = [x if isinstance(x, bytes) else bytes(x) for x in arr.reshape(-1)]
        d["values"] = [x.decode("utf-8", "backslashreplace") for x in flat]
        d["values_hex"] = [x.hex() for x in flat]
        return d
    if tf_dtype_name == "bfloat16":
        d["values"] = [float(x) for x in arr.astype(np.float32).reshape(-1)]
    elif arr.dtype.kind == "f":
        d["values"] = [float(x) for x in arr.reshape(-1)]
        # shortest decimal that round-trips at the stored precision
        d["values_repr"] = [repr(x.item()) if arr.dtype == np.float64 else str(x)
                            for x in arr.reshape(-1)]
    elif arr.dtype.kind == "b":
        d["values"] = [bool(x) for x in arr.reshape(-1)]
    else:
        d["values"] = [int(x) for x in arr.reshape(-1)]
    d["bytes_le_hex"] = np.ascontiguousarray(arr).tobytes().hex()
    return d


def read_all(prefix):
    """{key: (numpy value, dtype name)} with TF's own checkpoint reader."""
    import tensorflow as tf
    reader = tf.compat.v1.train.NewCheckpointReader(prefix)
    dmap = reader.get_variable_to_dtype_map()
    import numpy as np
    out = {}
    for k in sorted(dmap):
        v = reader.get_tensor(k)
        v = np.array(v, dtype=object) if isinstance(v, bytes) else np.asarray(v)
        out[k] = (v, dmap[k].name)
    return out


def remove_if_exists(*paths):
    for p in paths:
        if os.path.exists(p):
            os.remove(p)


# ----------------------------------------------------------------------------
# bundle: TF1 Saver checkpoints (dtypes, sharded)
# ----------------------------------------------------------------------------

def part_bundle_v1():
    import numpy as np
    import ml_dtypes
    tf = import_tf_v1()
    out = os.path.join(OUT, "bundle")
    os.makedirs(out, exist_ok=True)

    rng = np.random.default_rng(1001)
    specs = [
        ("dtypes/float32", tf.float32,
         np.array([[1.5, -2.25, 1.0 / 3.0], [3.4e38, 1e-45, -0.0]], np.float32)),
        ("dtypes/float64", tf.float64,
         np.array([1.0 / 3.0, -0.0, 1e-310, -1.5e300], np.float64)),
        ("dtypes/int32", tf.int32, np.array([-2147483648, 0, 2147483647], np.int32)),
        ("dtypes/int64", tf.int64, np.array(-9007199254740993, np.int64)),
        ("dtypes/float16", tf.float16,
         np.array([0.5, -65504.0, 6e-8, 1.0 / 3.0, 0.0], np.float16)),
        ("dtypes/bfloat16", tf.bfloat16,
         np.array([1.0 / 3.0, -3.0e38], ml_dtypes.bfloat16)),
        ("dtypes/uint8", tf.uint8, np.array([0, 1, 128, 255], np.uint8)),
        ("dtypes/int8", tf.int8, np.array([-128, -1, 127], np.int8)),
        ("dtypes/int16", tf.int16, np.array([-32768, 12345, 32767], np.int16)),
        ("dtypes/bool", tf.bool, np.array([True, False, True])),
        ("dtypes/string_scalar", tf.string, np.array(b"hello, bundle", object)),
        ("dtypes/string_vector", tf.string,
         np.array([b"", b"a", b"\x00\xff binary \xc3\xa9", b"x" * 200], object)),
        ("dtypes/float32_4d", tf.float32,
         rng.standard_normal((3, 3, 2, 4)).astype(np.float32)),
        ("dtypes/empty_0x3", tf.float32, np.zeros((0, 3), np.float32)),
    ]
    g = tf.Graph()
    with g.as_default():
        variables = []
        for name, dt, val in specs:
            variables.append(tf.compat.v1.Variable(
                tf.constant(val, dtype=dt), name=name, dtype=dt))
        saver = tf.compat.v1.train.Saver(
            variables, write_version=tf.compat.v1.train.SaverDef.V2)
        with tf.compat.v1.Session(graph=g, config=session_config(tf)) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            prefix = os.path.join(out, "dtypes.ckpt")
            saver.save(sess, prefix, write_meta_graph=False, write_state=False)
    index = read_bundle_index(prefix + ".index")
    tensors = []
    for key, (arr, dname) in read_all(prefix).items():
        d = {"name": key}
        d.update(describe_value(arr, dname))
        d.update(entry_info(index[key]))
        tensors.append(d)
    hdr = index[""]
    write_json(os.path.join(out, "dtypes.json"), {
        "prefix": "dtypes.ckpt",
        "writer": "tf.compat.v1.train.Saver (V2), TF " + tf.__version__,
        "header": {"num_shards": hdr.num_shards, "endianness": hdr.endianness,
                   "version_producer": hdr.version.producer},
        "tensors": tensors})

    # ---- sharded: two devices, Saver(sharded=True) -> one data shard each
    rng = np.random.default_rng(1002)
    g = tf.Graph()
    with g.as_default():
        with tf.device("/cpu:0"):
            a = tf.compat.v1.Variable(rng.standard_normal((2, 3)).astype(np.float32),
                                      name="cpu0/weights")
            b = tf.compat.v1.Variable(np.array([7, 8, 9], np.int64), name="cpu0/counts")
        with tf.device("/cpu:1"):
            c = tf.compat.v1.Variable(rng.standard_normal((4,)).astype(np.float32),
                                      name="cpu1/bias")
            d = tf.compat.v1.Variable(rng.standard_normal((2, 2)).astype(np.float64),
                                      name="cpu1/matrix")
        saver = tf.compat.v1.train.Saver([a, b, c, d], sharded=True)
        with tf.compat.v1.Session(graph=g, config=session_config(tf, cpus=2)) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            prefix = os.path.join(out, "sharded.ckpt")
            saver.save(sess, prefix, write_meta_graph=False, write_state=False)
            devices = {v.op.name: v.device for v in [a, b, c, d]}
    index = read_bundle_index(prefix + ".index")
    tensors = []
    for key, (arr, dname) in read_all(prefix).items():
        dd = {"name": key, "device": devices[key]}
        dd.update(describe_value(arr, dname))
        dd.update(entry_info(index[key]))
        tensors.append(dd)
    hdr = index[""]
    write_json(os.path.join(out, "sharded.json"), {
        "prefix": "sharded.ckpt",
        "writer": "tf.compat.v1.train.Saver(sharded=True), session with 2 CPU devices, TF "
                  + tf.__version__,
        "header": {"num_shards": hdr.num_shards, "endianness": hdr.endianness,
                   "version_producer": hdr.version.producer},
        "tensors": tensors})


# ----------------------------------------------------------------------------
# bundle: TF2 object-based checkpoint
# ----------------------------------------------------------------------------

def part_bundle_tf2():
    import numpy as np
    import tensorflow as tf
    from google.protobuf import json_format
    from tensorflow.core.protobuf import trackable_object_graph_pb2
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    out = os.path.join(OUT, "bundle")
    rng = np.random.default_rng(1003)

    class Dense(tf.Module):
        def __init__(self, name):
            super().__init__(name=name)
            self.kernel = tf.Variable(rng.standard_normal((3, 2)).astype(np.float32),
                                      name="kernel")
            self.bias = tf.Variable(rng.standard_normal((2,)).astype(np.float32),
                                    name="bias")

    ckpt = tf.train.Checkpoint(
        layer=Dense("layer"),
        step=tf.Variable(np.int64(42), name="step"),
        scale=tf.Variable(np.float32(0.75), name="scale"))
    base = os.path.join(out, "tf2.ckpt")
    for f in os.listdir(out):
        if f.startswith("tf2.ckpt"):
            os.remove(os.path.join(out, f))
    path = ckpt.save(base)  # -> tf2.ckpt-1.{index,data-00000-of-00001}
    remove_if_exists(os.path.join(out, "checkpoint"))  # state file, not needed
    index = read_bundle_index(path + ".index")
    reader = tf.train.load_checkpoint(path)
    dmap = reader.get_variable_to_dtype_map()
    tensors = []
    graph_dict = None
    for key in sorted(dmap):
        arr = reader.get_tensor(key)
        d = {"name": key}
        if key == "_CHECKPOINTABLE_OBJECT_GRAPH":
            g = trackable_object_graph_pb2.TrackableObjectGraph()
            g.ParseFromString(arr if isinstance(arr, bytes) else arr.item())
            graph_dict = json_format.MessageToDict(g, preserving_proto_field_name=True)
            d.update({"dtype": dmap[key].name, "shape": [],
                      "note": "serialized tensorflow.TrackableObjectGraph; parsed in "
                              "'object_graph' below"})
        else:
            d.update(describe_value(np.asarray(arr), dmap[key].name))
        d.update(entry_info(index[key]))
        tensors.append(d)
    write_json(os.path.join(out, "tf2.json"), {
        "prefix": os.path.basename(path),
        "writer": "tf.train.Checkpoint.save (eager), TF " + tf.__version__,
        "tensors": tensors,
        "object_graph": graph_dict})


# ----------------------------------------------------------------------------
# Object Detection API in TF1 (graph) mode under TF 2.21
# ----------------------------------------------------------------------------

def install_contrib_shim():
    """TF 2.x has no tf.contrib; the API's TF1 code path still imports two
    things from it at module level:
      * builders/optimizer_builder.py: tensorflow.contrib.opt.MovingAverageOptimizer
        (used because use_moving_average defaults to true).  Provided by the real
        TF 1.15 source file tensorflow_core/contrib/opt/python/training/
        moving_average_optimizer.py, extracted by setup.sh from the PyPI wheel
        tensorflow-cpu==1.15.0 and loaded here unmodified (its imports are
        internal TF modules that TF 2.21 still has).
      * matchers/bipartite_matcher.py: tensorflow.contrib.image.python.ops.image_ops
        (the bipartite matcher, not used by this config): an empty stub module.
    """
    import importlib.util
    import types
    import tensorflow as tf
    spec = importlib.util.spec_from_file_location("tf115_moving_average_optimizer", MAO)
    mao = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mao)
    names = ["tensorflow.contrib", "tensorflow.contrib.opt", "tensorflow.contrib.image",
             "tensorflow.contrib.image.python", "tensorflow.contrib.image.python.ops",
             "tensorflow.contrib.image.python.ops.image_ops"]
    mods = {n: types.ModuleType(n) for n in names}
    mods["tensorflow.contrib.opt"].MovingAverageOptimizer = mao.MovingAverageOptimizer
    for n, m in mods.items():
        parent, _, child = n.rpartition(".")
        setattr(mods[parent] if parent in mods else tf, child, m)
        sys.modules[n] = m
    return mao


def import_od():
    import numpy as np
    # slim/nets/mobilenet/mobilenet_v3.py (imported by model_builder, unused here)
    # calls np.int at import time; numpy >= 1.24 removed that alias of int.
    if not hasattr(np, "int"):
        np.int = int
    tf = import_tf_v1()
    install_contrib_shim()
    # tensorflow/python/layers/normalization.py (what tf_slim.batch_norm builds on)
    # lazy-loads 'tf_keras.legacy_tf_layers.normalization', but the tf_keras 2.21
    # wheel ships that module as tf_keras.src.legacy_tf_layers: alias the name.
    import importlib
    try:
        importlib.import_module("tf_keras.legacy_tf_layers.normalization")
    except ImportError:
        for n in ["legacy_tf_layers", "legacy_tf_layers.normalization"]:
            sys.modules["tf_keras." + n] = importlib.import_module("tf_keras.src." + n)
    from object_detection.utils import tf_version
    assert tf_version.is_tf1(), "API must see TF1 mode"
    return tf


class Filler:
    """Deterministic random values for every variable, by name."""

    def __init__(self, seed):
        import numpy as np
        self.np = np
        self.rng = np.random.default_rng(seed)

    def value(self, name, shape, dtype, base_values):
        np = self.np
        rng = self.rng
        shape = tuple(shape)
        leaf = name.split("/")[-1]
        if name == "global_step":
            return np.array(1234, dtype)
        if leaf == "ExponentialMovingAverage":
            base = base_values[name[:-len("/ExponentialMovingAverage")]]
            return (base + rng.normal(0.0, 0.05, shape)).astype(dtype)
        if leaf in ("RMSProp", "RMSProp_1"):
            return rng.uniform(0.01, 0.5, shape).astype(dtype)
        if leaf == "weights":  # conv kernel [kh, kw, in, out]
            fan_in = shape[0] * shape[1] * shape[2]
            return rng.normal(0.0, np.sqrt(2.0 / fan_in), shape).astype(dtype)
        if leaf == "depthwise_weights":  # [kh, kw, in, multiplier]
            fan_in = shape[0] * shape[1]
            return rng.normal(0.0, np.sqrt(2.0 / fan_in), shape).astype(dtype)
        if leaf == "gamma":
            return rng.uniform(0.5, 1.5, shape).astype(dtype)
        if leaf == "beta":
            return rng.normal(0.0, 0.2, shape).astype(dtype)
        if leaf == "moving_mean":
            return rng.normal(0.0, 0.2, shape).astype(dtype)
        if leaf == "moving_variance":
            return rng.uniform(0.5, 2.0, shape).astype(dtype)
        if leaf == "biases":
            return rng.normal(0.0, 0.1, shape).astype(dtype)
        raise ValueError("no fill rule for variable " + name)


def assign_all(tf, sess, variables, seed):
    """Assign Filler values to `variables` (EMA shadows after their bases)."""
    import numpy as np
    filler = Filler(seed)
    order = sorted(variables, key=lambda v: (v.op.name.endswith("/ExponentialMovingAverage"),
                                             v.op.name))
    values = {}
    for v in order:
        name = v.op.name
        values[name] = filler.value(name, v.shape.as_list(), v.dtype.base_dtype.as_numpy_dtype,
                                    values)
    phs, ops, feed = [], [], {}
    for v in order:
        ph = tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape)
        ops.append(tf.compat.v1.assign(v, ph))
        feed[ph] = values[v.op.name]
    sess.run(ops, feed_dict=feed)
    return values


def make_images(tf, out_dir):
    """Three RGB PNGs (w x h): 200x160, 97x131, 120x150."""
    import numpy as np
    rng = np.random.default_rng(2024)
    sizes = [(200, 160), (97, 131), (120, 150)]
    paths = []
    for i, (w, h) in enumerate(sizes):
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
        img = np.zeros((h, w, 3))
        img[..., 0] = 255.0 * xx / (w - 1)
        img[..., 1] = 255.0 * yy / (h - 1)
        img[..., 2] = 127.5 + 127.5 * np.sin(2 * np.pi * (xx + 2 * yy) / (37.0 + 11 * i))
        for _ in range(4):  # rectangles
            x0, y0 = rng.integers(0, w - 10), rng.integers(0, h - 10)
            x1, y1 = x0 + rng.integers(5, w // 2), y0 + rng.integers(5, h // 2)
            img[y0:y1, x0:x1] = rng.uniform(0, 255, 3)
        for _ in range(3):  # discs
            cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(5, min(w, h) / 4)
            img[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
        img += rng.normal(0, 12.0, img.shape)
        img = np.clip(np.round(img), 0, 255).astype(np.uint8)
        g = tf.Graph()
        with g.as_default():
            png = tf.io.encode_png(tf.constant(img))
            with tf.compat.v1.Session(graph=g, config=session_config(tf)) as sess:
                data = sess.run(png)
        path = os.path.join(out_dir, "image_%d.png" % i)
        with open(path, "wb") as fh:
            fh.write(data)
        paths.append(path)
    return paths


def load_configs():
    from object_detection.utils import config_util
    return config_util.get_configs_from_pipeline_file(PIPELINE)


def build_training_graph(tf, configs):
    """Like legacy/trainer.py train() with one clone: model_fn (_create_losses),
    optimizer_builder.build, model_deploy.optimize_clones (compute_gradients on
    the summed losses + regularization), apply_gradients(global_step), update_ops."""
    import numpy as np
    import tf_slim as slim
    from object_detection.builders import model_builder
    from object_detection.builders import optimizer_builder
    from object_detection.core import standard_fields as fields  # noqa: F401

    train_config = configs["train_config"]
    global_step = slim.create_global_step()
    model = model_builder.build(configs["model"], is_training=True)
    rng = np.random.default_rng(7)
    num_classes = configs["model"].ssd.num_classes
    images, gt_boxes, gt_classes = [], [], []
    for b in range(2):
        images.append(tf.constant(rng.uniform(0, 255, (1, 150, 120, 3)).astype(np.float32)))
        gt_boxes.append(tf.constant([[0.1, 0.2, 0.6, 0.7], [0.3, 0.1, 0.9, 0.5]], tf.float32))
        gt_classes.append(tf.one_hot([3 + b, 10], num_classes, dtype=tf.float32))
    preprocessed, shapes = [], []
    for im in images:
        p, s = model.preprocess(im)
        preprocessed.append(p)
        shapes.append(s)
    model.provide_groundtruth(gt_boxes, gt_classes)
    prediction_dict = model.predict(tf.concat(preprocessed, 0), tf.concat(shapes, 0))
    losses_dict = model.loss(prediction_dict, tf.concat(shapes, 0))
    for loss_tensor in losses_dict.values():
        tf.compat.v1.losses.add_loss(loss_tensor)
    update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
    training_optimizer, _ = optimizer_builder.build(train_config.optimizer)
    total_loss = tf.compat.v1.losses.get_total_loss()  # losses + regularization
    grads_and_vars = training_optimizer.compute_gradients(total_loss)
    grad_updates = training_optimizer.apply_gradients(grads_and_vars, global_step=global_step)
    update_ops.append(grad_updates)
    update_op = tf.group(*update_ops, name="update_barrier")
    with tf.control_dependencies([update_op]):
        train_tensor = tf.identity(total_loss, name="train_op")
    return model, training_optimizer, train_tensor


def var_list_json(tf, variables, values=None):
    out = []
    for v in sorted(variables, key=lambda v: v.op.name):
        d = {"name": v.op.name, "shape": v.shape.as_list(),
             "dtype": v.dtype.base_dtype.name, "trainable": v in set(
                 tf.compat.v1.trainable_variables())}
        if values is not None:
            a = values[v.op.name]
            d["min"] = float(a.min()) if a.size else None
            d["max"] = float(a.max()) if a.size else None
        out.append(d)
    return out


def part_ssd():
    import numpy as np
    from safetensors.numpy import save_file
    tf = import_od()
    from object_detection.builders import model_builder
    out = os.path.join(OUT, "ssd")
    os.makedirs(out, exist_ok=True)
    configs = load_configs()
    opt_cfg = configs["train_config"].optimizer
    facts = {"optimizer": {
        "type": opt_cfg.WhichOneof("optimizer"),
        "use_moving_average": opt_cfg.use_moving_average,
        "moving_average_decay": opt_cfg.moving_average_decay}}

    # ---------------- training graph -> checkpoint
    prefix = os.path.join(out, "model.ckpt")
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(1)
        model, training_optimizer, _ = build_training_graph(tf, configs)
        facts["optimizer"]["wrapper_class"] = type(training_optimizer).__module__ + "." + \
            type(training_optimizer).__name__
        ema = getattr(training_optimizer, "_ema", None)
        if ema is not None:
            facts["optimizer"]["ema"] = {
                "decay": float(ema._decay) if not hasattr(ema._decay, "op") else str(ema._decay),
                "num_updates": None if ema._num_updates is None else str(ema._num_updates),
                "zero_debias": bool(ema._zero_debias)}
            facts["optimizer"]["inner_class"] = type(training_optimizer._optimizer).__name__
            facts["optimizer"]["swapped_variable_name_map_size"] = len(
                training_optimizer._swapped_variable_name_map)
        all_vars = tf.compat.v1.global_variables()
        trainable = set(tf.compat.v1.trainable_variables())
        mav = tf.compat.v1.moving_average_variables()
        facts["ema_shadowed"] = sorted(
            v.op.name for v in all_vars if v.op.name + "/ExponentialMovingAverage" in
            {w.op.name for w in all_vars})
        facts["ema_shadowed_are_exactly_trainable"] = (
            set(facts["ema_shadowed"]) == {v.op.name for v in trainable})
        facts["moving_average_variables_collection_size"] = len(mav)
        # restore maps as the legacy trainer computes them (after the optimizer)
        from object_detection.utils import variables_helper
        restore = {}
        avail = {}
        for ftype, load_all in [("detection", False), ("detection", True),
                                ("classification", False)]:
            m = model.restore_map(fine_tune_checkpoint_type=ftype,
                                  load_all_detection_checkpoint_vars=load_all)
            key = ftype + ("_load_all" if load_all else "")
            if all(k == v.op.name for k, v in m.items()):
                restore[key] = {"identity": True, "names": sorted(m)}
            else:
                restore[key] = {"identity": False,
                                "map": {k: v.op.name for k, v in sorted(m.items())}}
            restore[key]["count"] = len(m)
            avail[key] = m
        saver = tf.compat.v1.train.Saver()  # as legacy trainer: all global variables
        with tf.compat.v1.Session(graph=g, config=session_config(tf)) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            values = assign_all(tf, sess, all_vars, seed=3141)
            saver.save(sess, prefix, write_meta_graph=False, write_state=False)
        variables = var_list_json(tf, all_vars, values)
        # which of those the API would actually load (legacy trainer: include_global_step=False)
        slim_prefix = os.path.join(OUT, "slim", "mobilenet_v1.ckpt")
        checks = [("detection", prefix, "ssd/model.ckpt"),
                  ("detection_load_all", prefix, "ssd/model.ckpt")]
        if os.path.exists(slim_prefix + ".index"):
            checks.append(("classification", slim_prefix, "slim/mobilenet_v1.ckpt"))
        for key, ck, label in checks:
            got = variables_helper.get_variables_available_in_checkpoint(
                avail[key], ck, include_global_step=False)
            restore[key]["available_in"] = {
                "checkpoint": label, "count": len(got),
                "not_available": sorted(set(avail[key]) - set(got))}
    write_json(os.path.join(out, "variables.json"), {
        "checkpoint": "model.ckpt", "count": len(variables), "variables": variables})
    write_json(os.path.join(out, "restore_map.json"), {
        "note": "SSDMetaArch.restore_map(...) on the training graph after the optimizer "
                "was built (legacy/trainer.py order): checkpoint name -> model variable",
        "maps": restore})

    # ---------------- images
    image_paths = make_images(tf, out)

    # ---------------- inference graph
    tensors = {}
    meta = {"images": []}
    g = tf.Graph()
    with g.as_default():
        model = model_builder.build(configs["model"], is_training=False)
        png = tf.compat.v1.placeholder(tf.string, [])
        image = tf.io.decode_png(png, channels=3)
        inputs = tf.expand_dims(tf.cast(image, tf.float32), 0)
        preprocessed, true_shapes = model.preprocess(inputs)
        pred = model.predict(preprocessed, true_shapes)
        det = model.postprocess(pred, true_shapes)
        resize_ops = [{"name": op.name, "type": op.type,
                       "align_corners": op.get_attr("align_corners"),
                       "half_pixel_centers": op.get_attr("half_pixel_centers")}
                      for op in g.get_operations() if op.type.startswith("Resize")]
        fetch = {"preprocessed": preprocessed, "true_image_shape": true_shapes,
                 "box_encodings": pred["box_encodings"],
                 "class_predictions_with_background": pred["class_predictions_with_background"],
                 "anchors": pred["anchors"]}
        for k, fm in enumerate(pred["feature_maps"]):
            fetch["feature_map_%d" % k] = fm
        for k, v in det.items():
            fetch["det/" + k] = v
        raw_saver = tf.compat.v1.train.Saver()
        ema_map = tf.compat.v1.train.ExponentialMovingAverage(0.0).variables_to_restore()
        ema_saver = tf.compat.v1.train.Saver(ema_map)
        meta["ema_variables_to_restore"] = {
            "count": len(ema_map),
            "shadow_keys": sum(1 for k in ema_map if k.endswith("/ExponentialMovingAverage"))}
        meta["inference_variable_count"] = len(tf.compat.v1.global_variables())
        meta["resize_ops"] = resize_ops
        results = {}
        with tf.compat.v1.Session(graph=g, config=session_config(tf)) as sess:
            for w, sv in [("raw", raw_saver), ("ema", ema_saver)]:
                sv.restore(sess, prefix)
                for i, path in enumerate(image_paths):
                    data = open(path, "rb").read()
                    results[(w, i)] = sess.run(fetch, feed_dict={png: data})
    A = int(results[("raw", 0)]["anchors"].shape[0])
    anchors = results[("raw", 0)]["anchors"]
    for (w, i), r in results.items():
        assert np.array_equal(r["anchors"], anchors)
        if w == "raw":
            tensors["image_%d/preprocessed" % i] = r["preprocessed"].astype(np.float32)
        else:
            assert np.array_equal(r["preprocessed"], results[("raw", i)]["preprocessed"])
        pre = "%s/image_%d/" % (w, i)
        tensors[pre + "box_encodings"] = r["box_encodings"]
        tensors[pre + "class_predictions_with_background"] = r["class_predictions_with_background"]
        for k in sorted(r):
            if k in ("det/raw_detection_scores", "det/detection_multiclass_scores"):
                continue  # = sigmoid(class logits): derivable, left out for size
            if k.startswith("det/"):
                tensors[pre + k[4:]] = np.asarray(r[k]).astype(np.float32)
            elif k.startswith("feature_map_"):
                tensors[pre + k] = r[k]
    tensors["anchors"] = anchors
    tensors = {k: np.ascontiguousarray(v.astype(np.float32)) for k, v in tensors.items()}
    save_file(tensors, os.path.join(out, "outputs.safetensors"))
    for i, path in enumerate(image_paths):
        r = results[("raw", i)]
        meta["images"].append({
            "file": os.path.basename(path),
            "true_image_shape": [int(x) for x in r["true_image_shape"].reshape(-1)],
            "num_detections": {ww: float(results[(ww, i)]["det/num_detections"][0])
                               for ww in ("raw", "ema")},
            "feature_map_ranges": {ww: [[float(results[(ww, i)]["feature_map_%d" % k].min()),
                                         float(results[(ww, i)]["feature_map_%d" % k].max()),
                                         float((results[(ww, i)]["feature_map_%d" % k] == 0).mean())]
                                        for k in range(len(pred["feature_maps"]))]
                                   for ww in ("raw", "ema")}})
    meta["num_anchors"] = A
    meta["feature_map_shapes"] = [list(results[("raw", 0)]["feature_map_%d" % k].shape)
                                  for k in range(len(pred["feature_maps"]))]
    meta["num_anchors_per_location"] = model._anchor_generator.num_anchors_per_location()
    meta["tensors"] = {k: {"shape": list(v.shape), "dtype": "float32"}
                       for k, v in sorted(tensors.items())}
    meta["postprocess_keys"] = sorted(k[4:] for k in results[("raw", 0)] if k.startswith("det/"))
    meta["facts"] = facts
    write_json(os.path.join(out, "outputs.json"), meta)


# ----------------------------------------------------------------------------
# slim MobileNet-v1 classification checkpoint
# ----------------------------------------------------------------------------

def part_slim():
    """Like slim/nets/mobilenet_v1_train.py build_model(): mobilenet_v1 under
    mobilenet_v1_arg_scope(is_training=True), softmax loss, GradientDescent
    create_train_op (no slot variables), global_step; Saver over all globals
    (what slim.learning.train saves)."""
    import numpy as np
    import tf_slim as slim
    tf = import_od()  # same shims (tf_keras alias) for slim.batch_norm
    from nets import mobilenet_v1
    out = os.path.join(OUT, "slim")
    os.makedirs(out, exist_ok=True)
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(2)
        rng = np.random.default_rng(11)
        images = tf.constant(rng.uniform(-1, 1, (2, 224, 224, 3)).astype(np.float32))
        labels = tf.one_hot([1, 5], 11)
        with slim.arg_scope(mobilenet_v1.mobilenet_v1_arg_scope(is_training=True)):
            logits, end_points = mobilenet_v1.mobilenet_v1(
                images, num_classes=11, depth_multiplier=0.125, min_depth=16,
                is_training=True)
        tf.compat.v1.losses.softmax_cross_entropy(labels, logits)
        total_loss = tf.compat.v1.losses.get_total_loss(name="total_loss")
        global_step = tf.compat.v1.train.get_or_create_global_step()
        lr = tf.compat.v1.train.exponential_decay(0.045, global_step, 1000, 0.94, staircase=True)
        opt = tf.compat.v1.train.GradientDescentOptimizer(lr)
        slim.learning.create_train_op(total_loss, optimizer=opt)
        all_vars = tf.compat.v1.global_variables()
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(graph=g, config=session_config(tf)) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            values = assign_all(tf, sess, all_vars, seed=2718)
            saver.save(sess, os.path.join(out, "mobilenet_v1.ckpt"),
                       write_meta_graph=False, write_state=False)
        variables = var_list_json(tf, all_vars, values)
        endpoints = {k: v.shape.as_list() for k, v in sorted(end_points.items())}
    write_json(os.path.join(out, "variables.json"), {
        "checkpoint": "mobilenet_v1.ckpt",
        "built_with": "nets.mobilenet_v1.mobilenet_v1(images[2,224,224,3], num_classes=11, "
                      "depth_multiplier=0.125, min_depth=16, is_training=True) under "
                      "mobilenet_v1_arg_scope(is_training=True); GradientDescent train op",
        "count": len(variables), "variables": variables,
        "end_points_at_224": endpoints})


# ----------------------------------------------------------------------------
# step: one training step of the API (model_lib.create_model_fn TRAIN path)
# ----------------------------------------------------------------------------

STEP_VARS = [
    "FeatureExtractor/MobilenetV1/Conv2d_0/weights",
    "FeatureExtractor/MobilenetV1/Conv2d_0/BatchNorm/gamma",
    "FeatureExtractor/MobilenetV1/Conv2d_0/BatchNorm/beta",
    "FeatureExtractor/MobilenetV1/Conv2d_1_depthwise/depthwise_weights",
    "FeatureExtractor/MobilenetV1/Conv2d_13_pointwise/weights",
    "FeatureExtractor/MobilenetV1/Conv2d_13_pointwise_2_Conv2d_2_3x3_s2_64/weights",
    "BoxPredictor_0/ClassPredictor/weights",
    "BoxPredictor_0/ClassPredictor/biases",
    "BoxPredictor_0/BoxEncodingPredictor/weights",
    "BoxPredictor_3/BoxEncodingPredictor/biases",
    "BoxPredictor_5/ClassPredictor/weights",
]

# (w, h), boxes [ymin, xmin, ymax, xmax] normalised, 1-based labels, texts
STEP_IMAGES = [
    ((120, 150), [[0.0, 0.55, 0.4, 1.0],            # touches top and right border
                  [0.6, 0.1, 0.6 + 8 / 150.0, 0.1 + 8 / 120.0],  # 8x8 px at 120x150
                  [0.3, 0.05, 0.95, 0.8]],          # large
     [3, 17, 37], [b"cls03", b"cls17", b"cls37"]),
    ((180, 140), [[0.1, 0.2, 0.5, 0.6], [0.45, 0.5, 0.95, 0.9]],
     [5, 17], [b"cls05", b"cls17"]),
]


def install_estimator_shim():
    """TF 2.16+ has no tf.compat.v1.estimator; model_lib.py and inputs.py import it
    at module level.  The TRAIN path of model_fn only uses ModeKeys and the
    EstimatorSpec constructor: a stub module with those two (EstimatorSpec just
    keeps its keyword arguments).  No Estimator is run; the session loop below
    does what Estimator.train does for one step."""
    import types
    import tensorflow as tf

    class ModeKeys:
        TRAIN = "train"
        EVAL = "eval"
        PREDICT = "infer"

    class EstimatorSpec:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    # eval_util (imported by model_lib) imports the LVIS metrics, which import
    # the 'lvis' package (needs OpenCV) at module level; LVIS evaluation is never
    # used in training: empty stub modules.
    if "lvis" not in sys.modules:
        lvis = types.ModuleType("lvis")
        for sub in ("results", "eval", "lvis"):
            m = types.ModuleType("lvis." + sub)
            setattr(lvis, sub, m)
            sys.modules["lvis." + sub] = m
        lvis.lvis.LVIS = type("LVIS", (), {})  # lvis_tools subclasses it at import
        lvis.eval.LVISEval = type("LVISEval", (), {})
        sys.modules["lvis"] = lvis
    # tf_slim 1.1.0 tfexample_decoder (the API's TfExampleDecoder image handler)
    # calls control_flow_ops.case and control_flow_ops.cond; TF 2.21 moved those
    # same functions to tensorflow/python/ops/control_flow_case.py and cond.py:
    # alias them back.
    from tensorflow.python.ops import cond, control_flow_case, control_flow_ops
    if not hasattr(control_flow_ops, "case"):
        control_flow_ops.case = control_flow_case.case
    if not hasattr(control_flow_ops, "cond"):
        control_flow_ops.cond = cond.cond
    # tf_slim 1.1.0 optimize_loss (model_lib's train op) tests
    # isinstance(g, ops.IndexedSlices); TF 2.21 keeps that class in
    # tensorflow/python/framework/indexed_slices.py only: alias it back.
    from tensorflow.python.framework import indexed_slices, ops as tf_ops
    if not hasattr(tf_ops, "IndexedSlices"):
        tf_ops.IndexedSlices = indexed_slices.IndexedSlices
    mod = types.ModuleType("tensorflow.compat.v1.estimator")
    mod.ModeKeys = ModeKeys
    mod.EstimatorSpec = EstimatorSpec
    mod.export = types.ModuleType("tensorflow.compat.v1.estimator.export")
    sys.modules["tensorflow.compat.v1.estimator"] = mod
    tf.compat.v1.estimator = mod
    return mod


def step_make_record(tf, path):
    """train.record: 2 tf.train.Example in the API's format (PNG)."""
    import numpy as np
    rng = np.random.default_rng(4242)
    pngs = []
    with tf.io.TFRecordWriter(path) as w:
        for i, ((wd, ht), boxes, labels, texts) in enumerate(STEP_IMAGES):
            yy, xx = np.mgrid[0:ht, 0:wd].astype(np.float64)
            img = np.zeros((ht, wd, 3))
            img[..., 0] = 200.0 * xx / (wd - 1)
            img[..., 1] = 200.0 * yy / (ht - 1)
            img[..., 2] = 100 + 60 * np.sin(2 * np.pi * (xx - yy) / 23.0)
            for (y0, x0, y1, x1), lab in zip(boxes, labels):
                py0, py1 = int(round(y0 * ht)), int(round(y1 * ht))
                px0, px1 = int(round(x0 * wd)), int(round(x1 * wd))
                col = np.array([(37 * lab) % 256, (91 * lab + 40) % 256, (53 * lab + 120) % 256])
                img[py0:py1, px0:px1] = col
                cy, cx = (py0 + py1) / 2.0, (px0 + px1) / 2.0
                r = max(1.0, min(py1 - py0, px1 - px0) / 4.0)
                img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = 255 - col
            img += rng.normal(0, 4.0, img.shape)
            img = np.clip(np.round(img), 0, 255).astype(np.uint8)
            g = tf.Graph()
            with g.as_default():
                enc = tf.io.encode_png(tf.constant(img))
                with tf.compat.v1.Session(graph=g, config=session_config(tf)) as sess:
                    data = sess.run(enc)
            pngs.append(data)
            b = np.array(boxes, np.float64)
            feat = {
                "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[data])),
                "image/format": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"png"])),
                "image/height": tf.train.Feature(int64_list=tf.train.Int64List(value=[ht])),
                "image/width": tf.train.Feature(int64_list=tf.train.Int64List(value=[wd])),
                "image/filename": tf.train.Feature(bytes_list=tf.train.BytesList(
                    value=[b"step_%d.png" % i])),
                "image/source_id": tf.train.Feature(bytes_list=tf.train.BytesList(
                    value=[b"%d" % (i + 1)])),
                "image/object/bbox/ymin": tf.train.Feature(float_list=tf.train.FloatList(value=b[:, 0])),
                "image/object/bbox/xmin": tf.train.Feature(float_list=tf.train.FloatList(value=b[:, 1])),
                "image/object/bbox/ymax": tf.train.Feature(float_list=tf.train.FloatList(value=b[:, 2])),
                "image/object/bbox/xmax": tf.train.Feature(float_list=tf.train.FloatList(value=b[:, 3])),
                "image/object/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=labels)),
                "image/object/class/text": tf.train.Feature(bytes_list=tf.train.BytesList(value=texts)),
            }
            ex = tf.train.Example(features=tf.train.Features(feature=feat))
            w.write(ex.SerializeToString(deterministic=True))  # sorted map keys
    return pngs


def step_pipeline_text(ckpt, record):
    """The step config: pipeline.config + the train settings of this part."""
    from google.protobuf import text_format
    from object_detection.protos import pipeline_pb2
    cfg = pipeline_pb2.TrainEvalPipelineConfig()
    text_format.Merge(open(PIPELINE).read(), cfg)
    tc = cfg.train_config
    tc.batch_size = 2
    tc.fine_tune_checkpoint = ckpt
    tc.fine_tune_checkpoint_type = "detection"
    tc.load_all_detection_checkpoint_vars = True
    del tc.data_augmentation_options[:]
    ti = cfg.train_input_reader
    del ti.tf_record_input_reader.input_path[:]
    ti.tf_record_input_reader.input_path.append(record)
    ti.ClearField("label_map_path")  # labels come from image/object/class/label
    ti.shuffle = False
    ti.num_readers = 1
    return text_format.MessageToString(cfg)


def step_instrument(model, cap):
    """Record (without changing anything) what the loss computes inside: the
    target assignment and the hard example miner's selections."""
    orig_assign = model._assign_targets

    def assign(*a, **k):
        out = orig_assign(*a, **k)
        cap["targets"] = out  # cls_targets, cls_weights, reg_targets, reg_weights, match
        return out
    model._assign_targets = assign
    miner = model._hard_example_miner
    orig_sub = miner._subsample_selection_to_desired_neg_pos_ratio

    def sub(indices, match, *a, **k):
        out = orig_sub(indices, match, *a, **k)
        cap.setdefault("mined", []).append({"nms_selected": indices, "selected": out[0],
                                            "num_positives": out[1], "num_negatives": out[2]})
        return out
    miner._subsample_selection_to_desired_neg_pos_ratio = sub
    miner_cls = type(miner)

    class RecordingMiner(miner_cls):  # keeps the per-anchor losses the miner ranks by
        def __call__(self, location_losses, cls_losses, *a, **k):
            cap["miner_cls_losses"] = cls_losses
            return miner_cls.__call__(self, location_losses, cls_losses, *a, **k)
    miner.__class__ = RecordingMiner
    orig_loss = model.loss

    def loss(*a, **k):
        out = orig_loss(*a, **k)
        cap["loss_dict"] = dict(out)
        return out
    model.loss = loss
    orig_predict = model.predict

    def predict(*a, **k):
        out = orig_predict(*a, **k)
        cap["prediction_dict"] = out
        return out
    model.predict = predict
    cap["model"] = model
    return model


def step_apply_ops(g):
    """{variable name: ApplyRMSProp op} (inputs: var, ms, mom, lr, rho, momentum, epsilon, grad)."""
    ops = {}
    for op in g.get_operations():
        if op.type in ("ApplyRMSProp", "ResourceApplyRMSProp"):
            ops[op.inputs[0].op.name] = op
    return ops


def step_summaries(before, n_images):
    """JSON summary of targets / miner results for n_images images."""
    import numpy as np
    out = []
    for i in range(n_images):
        match = before["match"][i]
        pos = np.nonzero(match >= 0)[0]
        mined = before["mined"][i]
        sel = np.asarray(mined["selected"]).reshape(-1)
        neg_kept = [int(a) for a in sel if match[a] < 0]
        # the negatives in the miner's order (NMS order) and the loss it ranks by
        nms = np.asarray(mined["nms_selected"]).reshape(-1)
        neg_all = [int(a) for a in nms if match[a] < 0]
        losses = before["miner_cls_losses"][i]
        assert neg_all[:len(neg_kept)] == neg_kept
        dropped = neg_all[len(neg_kept):]
        last_kept = float(losses[neg_kept[-1]]) if neg_kept else None
        first_dropped = float(losses[dropped[0]]) if dropped else None
        pos_kept = [int(a) for a in sel if match[a] >= 0]
        out.append({
            "num_matched": int(pos.size),
            "matched_anchors": [int(a) for a in pos],
            "matched_gt": [int(match[a]) for a in pos],
            "num_ignored": int((match == -2).sum()),
            "num_reg_weight_sum": float(before["reg_weights"][i].sum()),
            "nms_selected_count": int(np.asarray(mined["nms_selected"]).size),
            "miner_num_positives": int(mined["num_positives"]),
            "miner_num_negatives": int(mined["num_negatives"]),
            "miner_positive_indices": sorted(pos_kept),
            "miner_negative_indices": neg_kept,  # in the miner's order (NMS order, by loss)
            "miner_negative_indices_sorted": sorted(neg_kept),
            "miner_last_kept_negative_loss": last_kept,
            "miner_first_dropped_negative_loss": first_dropped,
            "miner_kept_dropped_gap": (None if last_kept is None or first_dropped is None
                                       else last_kept - first_dropped),
            "miner_kept_negative_min_consecutive_gap": (float(np.min(-np.diff(
                losses[neg_kept]))) if len(neg_kept) > 1 else None),
        })
    return out


def step_fetch_after(tf, sess, g, bn_names):
    vals = {}
    gv = {v.op.name: v for v in tf.compat.v1.global_variables()}
    names = []
    for v in STEP_VARS:
        names += [v, v + "/RMSProp", v + "/RMSProp_1", v + "/ExponentialMovingAverage"]
    names += bn_names + ["global_step"]
    got = sess.run({n: gv[n] for n in names})
    return got


def step_check_restore(tf, sess, ckpt, trainable, bn_names):
    """What the fine-tune restore left in the session before the step."""
    import numpy as np
    reader = tf.compat.v1.train.NewCheckpointReader(ckpt)
    gv = {v.op.name: v for v in tf.compat.v1.global_variables()}
    vals = sess.run(gv)
    keys = set(reader.get_variable_to_shape_map())
    res = {"weights_equal_checkpoint": True, "bn_stats_equal_checkpoint": True,
           "ema_equal_restored_weights": True,
           "rms_all_ones": True, "momentum_all_zeros": True,
           "checkpoint_has_ema_shadows": any(k.endswith("/ExponentialMovingAverage") for k in keys),
           "checkpoint_has_rmsprop_slots": any(k.endswith(("/RMSProp", "/RMSProp_1")) for k in keys),
           "checkpoint_tensor_count": len(keys)}
    for n in trainable:
        w = vals[n]
        res["weights_equal_checkpoint"] &= bool(np.array_equal(w, reader.get_tensor(n)))
        res["ema_equal_restored_weights"] &= bool(np.array_equal(vals[n + "/ExponentialMovingAverage"], w))
        res["rms_all_ones"] &= bool(np.all(vals[n + "/RMSProp"] == 1.0))
        res["momentum_all_zeros"] &= bool(np.all(vals[n + "/RMSProp_1"] == 0.0))
    for n in bn_names:
        res["bn_stats_equal_checkpoint"] &= bool(np.array_equal(vals[n], reader.get_tensor(n)))
    res["global_step"] = int(vals["global_step"])
    res["checkpoint_global_step"] = int(reader.get_tensor("global_step"))
    return res



def step_bn_check(before, before_vals, after, decay=0.9997):
    """Which batch variance feeds moving_variance (checked on Conv2d_0)."""
    import numpy as np
    x = before["conv0_pre_bn"].astype(np.float64)
    n = x.shape[0] * x.shape[1] * x.shape[2]
    mean = x.mean(axis=(0, 1, 2))
    var_b = x.var(axis=(0, 1, 2))
    var_u = var_b * n / (n - 1.0)
    pre = "FeatureExtractor/MobilenetV1/Conv2d_0/BatchNorm/"
    mm0, mv0 = before_vals[pre + "moving_mean"].astype(np.float64), before_vals[pre + "moving_variance"].astype(np.float64)
    mm1, mv1 = after[pre + "moving_mean"].astype(np.float64), after[pre + "moving_variance"].astype(np.float64)
    d = 1.0 - decay
    fed = before["conv0_bn_update_values"]
    fed_mean = fed["moving_mean"].astype(np.float64)
    fed_var = fed["moving_variance"].astype(np.float64)
    return {
        "value_fed_to_moving_variance_update_rel_err_vs_biased_var":
            float((np.abs(fed_var - var_b) / var_b).max()),
        "value_fed_to_moving_variance_update_rel_err_vs_unbiased_var_n_over_n_minus_1":
            float((np.abs(fed_var - var_u) / var_u).max()),
        "value_fed_to_moving_mean_update_max_abs_err_vs_batch_mean":
            float(np.abs(fed_mean - mean).max()),
        "layer": "FeatureExtractor/MobilenetV1/Conv2d_0 (input of BatchNorm = Conv2D output)",
        "elements_per_channel": int(n),
        "moving_mean_max_abs_err_vs_mean": float(np.abs(mm1 - (mm0 - (mm0 - mean) * d)).max()),
        "moving_variance_max_abs_err_vs_biased_var": float(np.abs(mv1 - (mv0 - (mv0 - var_b) * d)).max()),
        "moving_variance_max_abs_err_vs_unbiased_var": float(np.abs(mv1 - (mv0 - (mv0 - var_u) * d)).max()),
        "moving_stat_step_size_typical": float(np.abs(mv1 - mv0).mean()),
    }


def step_record(m, tensors, prefix, before, before_vals, after, bn_names, losses_key=None):
    """Checks of the update formulas + JSON fields + safetensors entries."""
    import numpy as np
    grads = before["grads"]
    lr_vals = sorted({float(v) for v in before["lr"].values()})
    assert len(lr_vals) == 1
    lr = lr_vals[0]
    rho, mom_c, eps = 0.9, 0.9, 1.0
    err_rms = err_mom = err_w = 0.0
    ema_err = {"constant_0.9999": 0.0, "num_updates_min(0.9999,(1+0)/(10+0))=0.1": 0.0}
    for n, gr in grads.items():
        gr64 = gr.astype(np.float64)
        w0 = before_vals[n].astype(np.float64)
        ms = rho * before_vals[n + "/RMSProp"] + (1 - rho) * gr64 ** 2
        mo = mom_c * before_vals[n + "/RMSProp_1"] + lr * gr64 / np.sqrt(ms + eps)
        w1 = w0 - mo
        if n in after:
            def rel(a, b):
                return float((np.abs(a - b) / np.maximum(np.abs(b), 1e-3)).max())
            err_rms = max(err_rms, rel(after[n + "/RMSProp"], ms))
            err_mom = max(err_mom, rel(after[n + "/RMSProp_1"], mo))
            err_w = max(err_w, float(np.abs(after[n] - w1).max()))
            s0 = before_vals[n + "/ExponentialMovingAverage"].astype(np.float64)
            wa = after[n].astype(np.float64)
            for k, dcy in [("constant_0.9999", 0.9999),
                           ("num_updates_min(0.9999,(1+0)/(10+0))=0.1", 0.1)]:
                ema_err[k] = max(ema_err[k], float(np.abs(
                    after[n + "/ExponentialMovingAverage"] - (s0 - (s0 - wa) * (1 - dcy))).max()))
    gnorm_np = float(np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values())))
    m["learning_rate"] = lr
    m["global_norm_tf"] = float(before["global_norm"])
    m["global_norm_numpy_f64"] = gnorm_np
    m["global_step_after"] = int(after["global_step"])
    m["update_checks_max_err"] = {
        "RMSProp(rms) = 0.9*1 + 0.1*g^2": err_rms,
        "RMSProp_1(mom) = 0.9*0 + lr*g/sqrt(rms+1.0)": err_mom,
        "var = var - mom": err_w,
        "EMA shadow with decay": ema_err,
        "note": "over the %d recorded variables, float64 recomputation from the fetched "
                "gradients and pre-step values; RMSProp and RMSProp_1: max relative error "
                "(|a-b|/max(|b|,1e-3)); var and EMA: max absolute error" % len(STEP_VARS)}
    for n in STEP_VARS:
        tensors["%s/grad/%s" % (prefix, n)] = grads[n]
        tensors["%s/after/%s" % (prefix, n)] = after[n]
        for suf in ("/RMSProp", "/RMSProp_1", "/ExponentialMovingAverage"):
            tensors["%s/after/%s%s" % (prefix, n, suf)] = after[n + suf]
    for n in bn_names:
        tensors["%s/after/%s" % (prefix, n)] = after[n]


def step_bn_update_values(g, prefix):
    """The batch statistic each BN moving-average update moves towards:
    update op AssignSub(v, (v - value) * decay) -> value."""
    import tensorflow as tf
    out = {}
    for op in g.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS):
        name = op.inputs[0].op.name
        if not name.startswith(prefix):
            continue
        todo, seen, value = [op.inputs[1].op], 0, None
        while todo and value is None and seen < 20:
            o = todo.pop(0)
            seen += 1
            if o.type == "Sub":
                value = o.inputs[1]
            todo += [t.op for t in o.inputs]
        assert value is not None, name
        out[name.split("/")[-1]] = value
    return out


def step_conv0(g):
    """The forward Conv2D output of FeatureExtractor/MobilenetV1/Conv2d_0."""
    ops = [op for op in g.get_operations() if op.type == "Conv2D" and
           op.inputs[1].op.name.startswith("FeatureExtractor/MobilenetV1/Conv2d_0/weights")
           and "gradients" not in op.name]
    assert len(ops) == 1, [o.name for o in ops]
    return ops[0].outputs[0]


def step_losses(fetched):
    return {k: float(fetched[k]) for k in
            ("localization_loss", "classification_loss", "regularization_loss", "total_loss")}


def step_write(meta, tensors, out):
    import numpy as np
    from safetensors.numpy import save_file
    tensors = {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in tensors.items()}
    save_file(tensors, os.path.join(out, "step.safetensors"))
    meta["tensors"] = {k: list(v.shape) for k, v in sorted(tensors.items())}
    write_json(os.path.join(out, "step.json"), meta)


def step_tower_fetches(g, cap, fields):
    model = cap["model"]
    cls_t, cls_w, reg_t, reg_w, match = cap["targets"]
    return {
        "localization_loss": cap["loss_dict"]["Loss/localization_loss"],
        "classification_loss": cap["loss_dict"]["Loss/classification_loss"],
        "match": match, "reg_weights": reg_w, "mined": cap["mined"],
        "miner_cls_losses": cap["miner_cls_losses"],
        "gt_boxes": model.groundtruth_lists(fields.BoxListFields.boxes),
        "gt_classes": model.groundtruth_lists(fields.BoxListFields.classes),
    }


# The step's own starting checkpoint (step/model.ckpt): the 199 model variables
# of ssd/model.ckpt plus global_step, no optimizer slots, no EMA shadows, with
# values chosen so that the TRAINING-mode step (BN on batch statistics) is well
# conditioned: ReLU6 inputs mostly inside (0, 6), unit-gain kernels.
STEP_CKPT_SEED = 5150
# Extra layers whose output map is 2x1 or 1x1 (feature maps 3..5): their BN sees
# 2 or 4 values per channel at batch 2 (1 or 2 per replica in two/).  With a
# batch spread >> sqrt(BN epsilon 0.001) such a BN is saturated (x_hat = +-1 for
# 2 values) and its backward pass is a near-total cancellation
# (1 - x_hat^2 ~ eps/var) that amplifies float32 rounding in every gradient
# upstream of it; a 20x smaller kernel puts the batch variance at about eps.
STEP_SMALL_BN_LAYERS = ("Conv2d_13_pointwise_2_Conv2d_3_3x3_s2_32",
                        "Conv2d_13_pointwise_1_Conv2d_4_1x1_16",
                        "Conv2d_13_pointwise_2_Conv2d_4_3x3_s2_32",
                        "Conv2d_13_pointwise_1_Conv2d_5_1x1_16",
                        "Conv2d_13_pointwise_2_Conv2d_5_3x3_s2_16")
STEP_CKPT_RECIPE = {
    "weights [kh,kw,in,out] (feature extractor)": "N(0, sqrt(1/(kh*kw*in)))",
    "weights of " + ", ".join(STEP_SMALL_BN_LAYERS) + " (2x1 and 1x1 maps)":
        "N(0, 0.05*sqrt(1/(kh*kw*in)))",
    "depthwise_weights [kh,kw,in,1]": "N(0, sqrt(1/(kh*kw)))",
    "BatchNorm/gamma": "U(0.4, 0.8)",
    "BatchNorm/beta": "U(2.0, 3.5)",
    "BatchNorm/moving_mean": "N(0, 0.2)",
    "BatchNorm/moving_variance": "U(0.5, 2.0)",
    "BoxPredictor_*/{BoxEncoding,Class}Predictor/weights": "N(0, 0.05)",
    "BoxPredictor_*/*/biases": "N(0, 0.1)",
    "global_step": "1234 (not restored: include_global_step=False)",
    "seed": STEP_CKPT_SEED,
    "order": "variables sorted by name, one numpy default_rng draw each",
}


def step_ckpt_value(np, rng, name, shape, dtype):
    shape = tuple(shape)
    leaf = name.split("/")[-1]
    if name == "global_step":
        return np.array(1234, dtype)
    if name.startswith("BoxPredictor_"):
        if leaf == "weights":
            return rng.normal(0.0, 0.05, shape).astype(dtype)
        if leaf == "biases":
            return rng.normal(0.0, 0.1, shape).astype(dtype)
    elif leaf == "weights":
        std = np.sqrt(1.0 / (shape[0] * shape[1] * shape[2]))
        if name.split("/")[-2] in STEP_SMALL_BN_LAYERS:
            std *= 0.05
        return rng.normal(0.0, std, shape).astype(dtype)
    elif leaf == "depthwise_weights":
        return rng.normal(0.0, np.sqrt(1.0 / (shape[0] * shape[1])), shape).astype(dtype)
    elif leaf == "gamma":
        return rng.uniform(0.4, 0.8, shape).astype(dtype)
    elif leaf == "beta":
        return rng.uniform(2.0, 3.5, shape).astype(dtype)
    elif leaf == "moving_mean":
        return rng.normal(0.0, 0.2, shape).astype(dtype)
    elif leaf == "moving_variance":
        return rng.uniform(0.5, 2.0, shape).astype(dtype)
    raise ValueError("no step checkpoint rule for " + name)


def step_make_checkpoint(tf, model_config, prefix, ssd_prefix):
    """Build the API's model (model_builder.build, training mode, one predict on a
    [2,150,120,3] input so that every variable exists), assign the
    STEP_CKPT_RECIPE values and save the model variables + global_step with
    tf.compat.v1.train.Saver(var_list)."""
    import numpy as np
    from object_detection.builders import model_builder
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.train.get_or_create_global_step()
        model = model_builder.build(model_config=model_config, is_training=True)
        images = tf.compat.v1.placeholder(tf.float32, [2, 150, 120, 3])
        pre, shapes = model.preprocess(images)
        model.predict(pre, shapes)
        var_list = sorted(tf.compat.v1.global_variables(), key=lambda v: v.op.name)
        # same names and shapes as ssd/model.ckpt without its slots and shadows
        reader = tf.compat.v1.train.NewCheckpointReader(ssd_prefix)
        ssd = {k: v for k, v in reader.get_variable_to_shape_map().items()
               if not k.endswith(("/ExponentialMovingAverage", "/RMSProp", "/RMSProp_1"))}
        mine = {v.op.name: v.shape.as_list() for v in var_list}
        assert mine == ssd, (sorted(set(mine) ^ set(ssd)))
        assert len(var_list) == 200, len(var_list)
        assert sum(n.endswith("/weights") and n.split("/")[-2] in STEP_SMALL_BN_LAYERS
                   for n in mine) == len(STEP_SMALL_BN_LAYERS)
        rng = np.random.default_rng(STEP_CKPT_SEED)
        values = {v.op.name: step_ckpt_value(np, rng, v.op.name, v.shape.as_list(),
                                             v.dtype.base_dtype.as_numpy_dtype)
                  for v in var_list}
        phs = {v.op.name: tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape) for v in var_list}
        assigns = [tf.compat.v1.assign(v, phs[v.op.name]) for v in var_list]
        saver = tf.compat.v1.train.Saver(var_list)
        with tf.compat.v1.Session(graph=g, config=session_config(tf)) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(assigns, feed_dict={phs[n]: values[n] for n in phs})
            saver.save(sess, prefix, write_meta_graph=False, write_state=False)
    back = read_all(prefix)
    assert sorted(back) == sorted(values)
    for n, (arr, _) in back.items():
        assert np.array_equal(arr, values[n]), n
    return {"file": "model.ckpt", "tensor_count": len(back),
            "model_variables": len(back) - 1, "recipe": STEP_CKPT_RECIPE,
            "same_names_and_shapes_as_ssd_model_ckpt_model_variables": True}


def step_probe(tf, configs, batch, ckpt, fields, scales):
    """The training-mode forward + backward of the step batch (batch of 2, BN on
    batch statistics, the loss of model_fn: loss parts + regularization) from
    `ckpt`, with the preprocessed input multiplied by each of `scales`.
    Returns per scale: losses, all gradients, the Conv2d_11/13 pointwise
    activations, the ReLU6 clamp fractions, the miner's selections."""
    import numpy as np
    from object_detection import model_lib
    from object_detection.builders import model_builder
    model_config = configs["model"]
    train_config = configs["train_config"]
    features, labels = batch
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.train.get_or_create_global_step()
        cap = {}
        model = step_instrument(model_builder.build(
            model_config=model_config, is_training=True, add_summaries=False), cap)
        scale = tf.compat.v1.placeholder(tf.float32, [])
        labs = model_lib.unstack_batch({k: tf.constant(v) for k, v in labels.items()},
                                       unpad_groundtruth_tensors=train_config.unpad_groundtruth_tensors)
        model_lib.provide_groundtruth(model, labs)
        shape = tf.constant(features[fields.InputDataFields.true_image_shape])
        pred = model.predict(tf.constant(features[fields.InputDataFields.image]) * scale, shape)
        losses_dict = model.loss(pred, shape)
        reg = tf.add_n(model.regularization_losses())
        total = tf.add_n(list(losses_dict.values()) + [reg])
        trainable = tf.compat.v1.trainable_variables()
        grads = tf.gradients(total, trainable)
        relus = [op for op in g.get_operations()
                 if op.type == "Relu6" and "gradients" not in op.name]
        acts = {}
        for layer in ("Conv2d_11_pointwise", "Conv2d_13_pointwise"):
            ops = [op for op in relus if ("/%s/" % layer) in op.name]
            assert len(ops) == 1, [o.name for o in ops]
            acts[layer] = ops[0].outputs[0]
        clamp = {}
        for op in relus:
            x = op.inputs[0]
            layer = op.name.split("/")[-2]
            n = tf.cast(tf.size(x), tf.float32)
            clamp[layer] = {"below_0": tf.reduce_sum(tf.cast(x <= 0.0, tf.float32)) / n,
                            "above_6": tf.reduce_sum(tf.cast(x >= 6.0, tf.float32)) / n}
        fetch = {
            "losses": {"localization_loss": losses_dict["Loss/localization_loss"],
                       "classification_loss": losses_dict["Loss/classification_loss"],
                       "regularization_loss": reg, "total_loss": total},
            "grads": {v.op.name: gr for v, gr in zip(trainable, grads)},
            "acts": acts, "clamp": clamp,
            "mined": [{"selected": m["selected"], "num_positives": m["num_positives"],
                       "num_negatives": m["num_negatives"]} for m in cap["mined"]],
        }
        restore = tf.compat.v1.train.Saver(
            [v for v in tf.compat.v1.global_variables() if v.op.name != "global_step"])
        with tf.compat.v1.Session(graph=g, config=session_config(tf)) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            restore.restore(sess, ckpt)
            return [sess.run(fetch, feed_dict={scale: np.float32(s)}) for s in scales]


def step_compare(a, b, names=None):
    """How far probe result b is from a (relative changes)."""
    import numpy as np

    def relmax(x, y):  # max |x-y| relative to the largest |x|
        x = np.asarray(x, np.float64)
        y = np.asarray(y, np.float64)
        return float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-30))
    gn = lambda r: float(np.sqrt(sum((np.asarray(v, np.float64) ** 2).sum()
                                     for v in r["grads"].values())))
    names = sorted(a["grads"]) if names is None else names
    per_var = {n: relmax(a["grads"][n], b["grads"][n]) for n in names}
    all_vars = {n: relmax(a["grads"][n], b["grads"][n]) for n in a["grads"]}
    worst = max(all_vars, key=all_vars.get)
    return {
        "losses_rel_change": {k: abs(float(b["losses"][k]) - float(v)) / abs(float(v))
                              for k, v in a["losses"].items()},
        "global_norm": [gn(a), gn(b)],
        "global_norm_rel_change": abs(gn(b) - gn(a)) / gn(a),
        "activations_rel_change": {k: relmax(v, b["acts"][k]) for k, v in a["acts"].items()},
        "recorded_grads_max_rel_change": max(per_var.values()),
        "recorded_grads_rel_change": per_var,
        "all_grads_max_rel_change": all_vars[worst],
        "all_grads_worst_variable": worst,
        "mined_selection_identical": all(
            np.array_equal(np.asarray(x["selected"]), np.asarray(y["selected"]))
            for x, y in zip(a["mined"], b["mined"])),
        "note": "rel change of a tensor = max|b-a| / max|a|; gradients of the total loss "
                "(model_fn's, regularization included) w.r.t. every trainable variable",
    }


def step_conditioning(tf, configs, batch, ckpt, fields, eps=1e-6):
    """Sensitivity of the training-mode step to a relative input change eps."""
    import numpy as np
    r0, r1 = step_probe(tf, configs, batch, ckpt, fields, [1.0, 1.0 + eps])
    out = step_compare(r0, r1, STEP_VARS)
    out["input_scale"] = 1.0 + eps
    cl = r0["clamp"]
    out["relu6_clamped_fraction"] = {k: round(float(v["below_0"] + v["above_6"]), 6)
                                     for k, v in sorted(cl.items())}
    out["relu6_clamped_fraction_max"] = max(out["relu6_clamped_fraction"].values())
    out["relu6_clamped_fraction_mean"] = float(np.mean(list(out["relu6_clamped_fraction"].values())))
    out["relu6_fraction_above_6_max"] = max(float(v["above_6"]) for v in cl.values())
    out["losses_at_scale_1"] = {k: float(v) for k, v in r0["losses"].items()}
    out["grad_max_abs_by_recorded_variable"] = {n: float(np.abs(r0["grads"][n]).max())
                                                for n in STEP_VARS}
    return out, r0


def part_step_probe():
    """Helper part (run by part_step in a subprocess, e.g. with oneDNN off):
    argv: --probe-in batch.npz ckpt --probe-out result.npz"""
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import numpy as np
    import pickle
    tf = import_od()
    install_estimator_shim()
    from object_detection.core import standard_fields as fields
    from object_detection.utils import config_util
    src, ckpt, dst = PROBE_ARGS
    with open(src, "rb") as fh:
        batch, cfg_text = pickle.load(fh)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "pipeline.config")
        open(p, "w").write(cfg_text)
        configs = config_util.get_configs_from_pipeline_file(p)
    res = step_probe(tf, configs, batch, ckpt, fields, [1.0])[0]
    with open(dst, "wb") as fh:
        pickle.dump(res, fh)


PROBE_ARGS = None


def step_probe_other_build(configs_text, batch, ckpt, env_extra):
    """step_probe at scale 1 in a fresh process with env_extra (another TF
    float32 kernel set, e.g. TF_ENABLE_ONEDNN_OPTS=0)."""
    import pickle
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "in.pkl"), os.path.join(d, "out.pkl")
        with open(src, "wb") as fh:
            pickle.dump((batch, configs_text), fh)
        env = dict(os.environ)
        env.update(env_extra)
        subprocess.check_call([sys.executable, os.path.abspath(__file__), "--part", "step_probe",
                               "--probe", src, ckpt, dst], env=env)
        with open(dst, "rb") as fh:
            return pickle.load(fh)


def part_step():
    # tf.keras must be Keras 2 (tf_keras): model_fn calls
    # tf.keras.backend.set_learning_phase, which Keras 3 does not have.
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import shutil
    import tempfile
    import numpy as np
    tf = import_od()
    tf_estimator = install_estimator_shim()
    from object_detection import model_lib
    from object_detection import inputs
    from object_detection.builders import model_builder
    from object_detection.utils import config_util
    from object_detection.core import standard_fields as fields

    out = os.path.join(OUT, "step")
    os.makedirs(out, exist_ok=True)
    ckpt = os.path.join(out, "model.ckpt")
    ssd_ckpt = os.path.join(OUT, "ssd", "model.ckpt")
    record = os.path.join(out, "train.record")
    step_make_record(tf, record)
    with open(os.path.join(out, "pipeline.config"), "w") as fh:
        fh.write("# Written by scripts/tf-fixtures/make_fixtures.py --part step.\n"
                 "# Replace CHECKPOINT_PREFIX with the path prefix of "
                 "crates/model/tests/fixtures/tf/step/model.ckpt\n"
                 "# and TRAIN_RECORD with the path of "
                 "crates/model/tests/fixtures/tf/step/train.record.\n")
        fh.write(step_pipeline_text("CHECKPOINT_PREFIX", "TRAIN_RECORD"))
    tmpdir = tempfile.mkdtemp(prefix="step_cfg_")
    real_cfg = os.path.join(tmpdir, "pipeline.config")
    with open(real_cfg, "w") as fh:
        fh.write(step_pipeline_text(ckpt, record))
    configs = config_util.get_configs_from_pipeline_file(real_cfg)
    shutil.rmtree(tmpdir)
    model_config = configs["model"]
    train_config = configs["train_config"]
    meta = {"note": "see scripts/tf-fixtures/PROVENANCE.md, section step/",
            "variables": STEP_VARS, "facts": {}, "one": {}, "two": {}}
    meta["checkpoint"] = step_make_checkpoint(tf, model_config, ckpt, ssd_ckpt)
    tensors = {}

    # =============== one: the batch-of-2 step through model_lib's own model_fn
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(1)
        # Estimator.train creates the global step before input_fn and model_fn.
        global_step = tf.compat.v1.train.get_or_create_global_step()
        # as create_estimator_and_inputs builds them
        train_input_fn = inputs.create_train_input_fn(
            train_config=train_config, train_input_config=configs["train_input_config"],
            model_config=model_config)
        dataset = train_input_fn(params={})  # Estimator passes params={} off-TPU
        iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
        features, labels = iterator.get_next()
        cap = {}

        def detection_model_fn(**kw):  # functools.partial(model_builder.build, model_config=...)
            return step_instrument(model_builder.build(model_config=model_config, **kw), cap)

        class HParams:  # model_hparams.create_hparams() default
            load_pretrained = True
        model_fn = model_lib.create_model_fn(detection_model_fn, configs, HParams())
        spec = model_fn(features, labels, tf_estimator.ModeKeys.TRAIN, params={})
        train_op = spec.train_op
        apply_ops = step_apply_ops(g)
        trainable = sorted(v.op.name for v in tf.compat.v1.trainable_variables())
        assert sorted(apply_ops) == trainable, "one ApplyRMSProp per trainable variable"
        bn_names = sorted(v.op.name for v in tf.compat.v1.global_variables()
                          if v.op.name.endswith(("moving_mean", "moving_variance")))
        assert len(bn_names) == 70, len(bn_names)
        gnorm_ops = [op for op in g.get_operations()
                     if op.name.endswith("global_norm/global_norm")]
        assert len(gnorm_ops) == 1, [o.name for o in gnorm_ops]
        ema_ops = [op for op in g.get_operations()
                   if op.inputs and op.inputs[0].op.name.endswith("/ExponentialMovingAverage")
                   and op.type.startswith("Assign")]
        bn_update_types = sorted({op.type for op in spec.train_op.graph.get_collection(
            tf.compat.v1.GraphKeys.UPDATE_OPS)})
        bn_op_types = sorted({op.type for op in g.get_operations() if "BatchNorm" in op.type})
        fetch = step_tower_fetches(g, cap, fields)
        fetch.update({
            "regularization_loss": g.get_tensor_by_name("regularization_loss:0"),
            "total_loss": g.get_tensor_by_name("total_loss:0"),
            "grads": {n: op.inputs[7] for n, op in apply_ops.items()},
            "lr": {n: op.inputs[3] for n, op in apply_ops.items()},
            "rms_hparams": {k: apply_ops[trainable[0]].inputs[j] for k, j in
                            [("rho", 4), ("momentum", 5), ("epsilon", 6)]},
            "global_norm": gnorm_ops[0].outputs[0],
            "preprocessed": features[fields.InputDataFields.image],
            "true_image_shape": features[fields.InputDataFields.true_image_shape],
            "conv0_pre_bn": step_conv0(g),
            "conv0_bn_update_values": step_bn_update_values(
                g, "FeatureExtractor/MobilenetV1/Conv2d_0/BatchNorm/"),
        })
        init = [tf.compat.v1.global_variables_initializer(),
                tf.compat.v1.local_variables_initializer(),
                tf.compat.v1.tables_initializer()]
        with tf.compat.v1.Session(graph=g, config=session_config(tf)) as sess:
            sess.run(init)
            sess.run(iterator.initializer)
            batch = sess.run((features, labels))
            # Feed that batch back for both runs below, so the fetched
            # quantities and the step see the same inputs.
            feed = {t: v for t, v in zip(tf.nest.flatten((features, labels)),
                                         tf.nest.flatten(batch))}
            restore_check = step_check_restore(tf, sess, ckpt, trainable, bn_names)
            before_vals = sess.run({v.op.name: v for v in tf.compat.v1.global_variables()})
            before = sess.run(fetch, feed_dict=feed)
            loss_in_step = sess.run(train_op, feed_dict=feed)
            after = step_fetch_after(tf, sess, g, bn_names)
    one = meta["one"]
    one["losses"] = step_losses(before)
    one["train_op_value"] = float(loss_in_step)
    one["images"] = step_summaries(before, 2)
    one["restore_check"] = restore_check
    one["ema_assign_op_types"] = sorted({op.type for op in ema_ops})
    step_record(one, tensors, "one", before, before_vals, after, bn_names)
    tensors["one/preprocessed"] = before["preprocessed"]
    for i in range(2):
        tensors["one/groundtruth/boxes_%d" % i] = before["gt_boxes"][i]
        tensors["one/groundtruth/classes_%d" % i] = before["gt_classes"][i]
    one["true_image_shape"] = before["true_image_shape"].tolist()
    meta["facts"]["rmsprop_hparams_fed"] = {k: float(v) for k, v in before["rms_hparams"].items()}
    meta["facts"]["bn_variance_check"] = step_bn_check(before, before_vals, after)
    meta["facts"]["bn_update_op_types"] = bn_update_types
    meta["facts"]["bn_op_types"] = bn_op_types
    step_write(meta, tensors, out)
    part_step_two(tf, configs, batch, meta, tensors, ckpt, bn_names, fields)
    step_write(meta, tensors, out)
    # conditioning of the training-mode step: input x (1 + 1e-6), from this
    # checkpoint and (for comparison) from ssd/model.ckpt
    cond = {}
    cond["step_model_ckpt"], r_step = step_conditioning(tf, configs, batch, ckpt, fields)
    cond["ssd_model_ckpt"], _ = step_conditioning(tf, configs, batch, ssd_ckpt, fields)
    for r in range(2):  # two/: replica r alone (batch 1, its own BN statistics)
        sl = tuple({k: v[r:r + 1] for k, v in d.items()} for d in batch)
        cond["step_model_ckpt_replica_%d" % r], _ = step_conditioning(tf, configs, sl, ckpt, fields)
    for k, v in r_step["losses"].items():  # the probe graph is the one/ forward
        assert abs(float(v) - one["losses"][k]) <= 1e-5 * abs(one["losses"][k]), (k, v)
    cond["probe_vs_one_total_loss"] = [float(r_step["losses"]["total_loss"]),
                                       one["losses"]["total_loss"]]
    # TF's own float32 error, estimated with a second float32 kernel set:
    # the same probe in a process with oneDNN off (TF_ENABLE_ONEDNN_OPTS=0)
    cfg_text = open(os.path.join(out, "pipeline.config")).read()
    cfg_text = cfg_text.replace("CHECKPOINT_PREFIX", ckpt).replace("TRAIN_RECORD", record)
    r_plain = step_probe_other_build(cfg_text, batch, ckpt, {"TF_ENABLE_ONEDNN_OPTS": "0"})
    c = step_compare(r_step, r_plain, STEP_VARS)
    c["note"] = ("step/model.ckpt, scale 1: TF with oneDNN (the fixture) vs TF with "
                 "TF_ENABLE_ONEDNN_OPTS=0 (Eigen kernels); " + c["note"])
    cond["onednn_vs_eigen_float32"] = c
    cond["float64"] = ("not run: the API builds float32 anchors, box coder, target "
                       "assigner and FusedBatchNorm (no float64 kernel)")
    meta["conditioning"] = cond
    step_write(meta, tensors, out)


def part_step_two(tf, configs, batch, meta, tensors, ckpt, bn_names, fields):
    """The same step as two replicas of one image each, with shared variables:
    per replica the model on its own image (own BN batch statistics) and its
    own loss normalisation; gradients averaged over the replicas; one RMSProp +
    EMA update; BN moving statistics moved by the mean of the replicas' updates
    (what MirroredStrategy does: assign_moving_average reduces the value with
    ReduceOp.MEAN across replicas; v1 optimizers scale each replica's loss by
    1/num_replicas and sum the gradients)."""
    import numpy as np
    from object_detection import model_lib
    from object_detection.builders import model_builder
    from object_detection.builders import optimizer_builder
    from object_detection.utils import variables_helper
    model_config = configs["model"]
    train_config = configs["train_config"]
    features, labels = batch
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(1)
        global_step = tf.compat.v1.train.get_or_create_global_step()
        caps, totals, regs, tower_updates = [], [], [], []
        for r in range(2):
            cap = {}
            n_vars = len(tf.compat.v1.global_variables())
            n_upd = len(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS))
            with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(),
                                             reuse=True if r else None):
                with tf.name_scope("replica_%d" % r):
                    model = step_instrument(model_builder.build(
                        model_config=model_config, is_training=True, add_summaries=True), cap)
                    feats = {k: tf.constant(v[r:r + 1]) for k, v in features.items()}
                    labs = model_lib.unstack_batch(
                        {k: tf.constant(v[r:r + 1]) for k, v in labels.items()},
                        unpad_groundtruth_tensors=train_config.unpad_groundtruth_tensors)
                    model_lib.provide_groundtruth(model, labs)
                    pred = model.predict(feats[fields.InputDataFields.image],
                                         feats[fields.InputDataFields.true_image_shape])
                    if r == 0:
                        # model_lib: fine-tune restore before the optimizer exists
                        asg_map = model.restore_map(
                            fine_tune_checkpoint_type=train_config.fine_tune_checkpoint_type,
                            load_all_detection_checkpoint_vars=(
                                train_config.load_all_detection_checkpoint_vars))
                        available = variables_helper.get_variables_available_in_checkpoint(
                            asg_map, train_config.fine_tune_checkpoint, include_global_step=False)
                        tf.compat.v1.train.init_from_checkpoint(
                            train_config.fine_tune_checkpoint, available)
                    losses_dict = model.loss(pred, feats[fields.InputDataFields.true_image_shape])
                    reg = tf.add_n(model.regularization_losses(), name="regularization_loss")
                    total = tf.add_n(list(losses_dict.values()) + [reg], name="total_loss")
            if r:
                assert len(tf.compat.v1.global_variables()) == n_vars, "replica 1 must share variables"
            tower_updates.append(tf.compat.v1.get_collection(
                tf.compat.v1.GraphKeys.UPDATE_OPS)[n_upd:])
            caps.append(cap)
            totals.append(total)
            regs.append(reg)
        trainable = tf.compat.v1.trainable_variables()
        training_optimizer, _ = optimizer_builder.build(train_config.optimizer)
        tower_gv = [training_optimizer.compute_gradients(t, trainable) for t in totals]
        avg_gv = []
        for (g0, v0), (g1, v1) in zip(*tower_gv):
            assert v0 is v1
            avg_gv.append(((g0 + g1) * 0.5, v0))
        # BN: the replicas' moving-average deltas, averaged, applied once
        deltas = {}
        for ups in tower_updates:
            for op in ups:
                assert op.type == "AssignSub", op.type
                deltas.setdefault(op.inputs[0].op.name, []).append((op.inputs[0], op.inputs[1]))
        assert sorted(deltas) == bn_names and all(len(d) == 2 for d in deltas.values())
        bn_updates = []
        for name, ((ref, d0), (_, d1)) in sorted(deltas.items()):
            bn_updates.append(tf.compat.v1.assign_sub(ref, (d0 + d1) * 0.5))
        apply_op = training_optimizer.apply_gradients(avg_gv, global_step=global_step)
        train_op = tf.group(apply_op, *bn_updates)
        apply_ops = step_apply_ops(g)
        names = sorted(apply_ops)
        fetch = {
            "replicas": [dict(step_tower_fetches(g, c, fields), regularization_loss=rg,
                              total_loss=t,
                              grads_norm=tf.linalg.global_norm([x for x, _ in gv]))
                         for c, rg, t, gv in zip(caps, regs, totals, tower_gv)],
            "grads": {n: apply_ops[n].inputs[7] for n in names},
            "lr": {n: apply_ops[n].inputs[3] for n in names},
            "global_norm": tf.linalg.global_norm([x for x, _ in avg_gv]),
        }
        init = [tf.compat.v1.global_variables_initializer(),
                tf.compat.v1.local_variables_initializer()]
        with tf.compat.v1.Session(graph=g, config=session_config(tf)) as sess:
            sess.run(init)
            before_vals = sess.run({v.op.name: v for v in tf.compat.v1.global_variables()})
            before = sess.run(fetch)
            sess.run(train_op)
            after = step_fetch_after(tf, sess, g, bn_names)
    two = meta["two"]
    two["replicas"] = []
    for r, rep in enumerate(before["replicas"]):
        d = {"losses": step_losses(rep), "global_norm_of_replica_gradients": float(rep["grads_norm"])}
        d.update(step_summaries(rep, 1)[0])
        two["replicas"].append(d)
    step_record(two, tensors, "two", before, before_vals, after, bn_names)
    two["global_norm_note"] = ("global norm of the averaged gradients (what RMSProp gets); "
                               "per replica: global_norm_of_replica_gradients")
    # the inputs are one/preprocessed[r] and one/groundtruth/*_r: check
    for r, rep in enumerate(before["replicas"]):
        assert np.array_equal(rep["gt_boxes"][0], tensors["one/groundtruth/boxes_%d" % r])
        assert np.array_equal(rep["gt_classes"][0], tensors["one/groundtruth/classes_%d" % r])


# ----------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------

def run_all():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [SRC, os.path.join(SRC, "slim")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONHASHSEED"] = "0"
    for part in PARTS:
        print("== part", part, flush=True)
        subprocess.check_call([sys.executable, os.path.abspath(__file__), "--part", part],
                              env=env)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=PARTS + ["step_probe"])
    ap.add_argument("--probe", nargs=3, help=argparse.SUPPRESS)  # part step_probe only
    args = ap.parse_args()
    global PROBE_ARGS
    PROBE_ARGS = args.probe
    if args.part is None:
        run_all()
        return
    sys.path[:0] = [SRC, os.path.join(SRC, "slim")]
    globals()["part_" + args.part]()


if __name__ == "__main__":
    main()
