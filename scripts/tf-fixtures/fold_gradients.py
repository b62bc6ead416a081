#!/usr/bin/env python3
"""Reference numbers for the gradient of a TF1 quantization-folded conv + BN unit.

What it checks
--------------
TF 1.15's `tensorflow/contrib/quantize/python/fold_batch_norms.py` folds a
training-mode FusedBatchNorm into the preceding convolution
(`_FoldFusedBatchNorms`, `_FindFusedBatchNorms._GetLayerMatch`,
`_ComputeBatchNormCorrections`) and replaces the gradient of the original
FusedBatchNorm op with its own rule registered as `FoldFusedBatchNormGrad`,
so that the loss is back-propagated through the batch mean and the batch
variance that the fold reads from that op.  TF 1.x cannot be installed here,
so this script rebuilds the folded unit in TF 2 graph mode (tf.compat.v1)
and re-implements that gradient rule (own code, registered under the new
name "Tf1FoldFusedBatchNormGradRepro" and attached with
gradient_override_map), then prints:

  * the folded unit (TF1 gradient rule)                          -> "folded"
  * plain batch norm with biased batch moments (tf.nn.moments +
    tf.nn.batch_normalization)                                   -> "plain"
  * the folded unit with tf.stop_gradient on batch mean/variance -> "stopgrad"
  * the folded unit with TF's stock FusedBatchNormV3 gradient
    (what you get without TF1's override)                        -> "stock"

Case: quantization delay NOT reached.  Then quantize.py's
`control_flow_ops.cond(activate_quant, lambda: quant, lambda: inputs)`
(TF 1.15 quantize.py, `_InsertQuantOp`) passes the weights and activations
through unchanged, and `_ComputeBatchNormCorrections` selects
correction_recip = 1/correction_scale and correction_offset = 0.  The
fake-quant ops are therefore left out here.

Unit: x NCHW [2,2,3,3], x[i] = ((i*37 % 23) - 11)/7 (NCHW flat index i,
transposed to NHWC for TF); 1x1 conv, stride 1, no bias, w[o][c] =
[[0.5,-0.3],[0.2,0.8]]; gamma=[1.2,0.7], beta=[0.1,-0.2], moving_mean=[0.1,0.3],
moving_variance=[2.5,3.2], eps=0.001; ReLU6; loss L = sum_i y[i]*((i%5)-1.5)
over the NCHW flat index i.

How to run
----------
Needs only tensorflow-cpu (numpy comes with it); no TF 1.x. The venv that
setup.sh makes (default $TF_REF/venv) has it, as does any other:

    python3 -m venv VENV && VENV/bin/pip install 'tensorflow-cpu==2.21.0'
    TF_CPP_MIN_LOG_LEVEL=2 VENV/bin/python scripts/tf-fixtures/fold_gradients.py

The Rust test `fake_quant::tests::folded_unit_gradients_are_tf1s` holds its
"folded" numbers.
The TF 1.15 source it follows was read from the wheel
tensorflow-1.15.5-cp37-cp37m-manylinux2010_x86_64.whl
(tensorflow_core/contrib/quantize/python/fold_batch_norms.py).
"""
import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1

N, C, H, W = 2, 2, 3, 3
EPS = 0.001
GRAD_NAME = "Tf1FoldFusedBatchNormGradRepro"


# ----------------------------------------------------------------------------
# inputs (NCHW in the spec, NHWC for TF)
# ----------------------------------------------------------------------------
X_NCHW = np.array([((i * 37 % 23) - 11) / 7.0 for i in range(N * C * H * W)],
                  dtype=np.float64).reshape(N, C, H, W)
COEF_NCHW = np.array([(i % 5) - 1.5 for i in range(N * C * H * W)],
                     dtype=np.float64).reshape(N, C, H, W)
W_OC = np.array([[0.5, -0.3], [0.2, 0.8]], dtype=np.float64)   # w[o][c]
GAMMA = np.array([1.2, 0.7])
BETA = np.array([0.1, -0.2])
MOVING_MEAN = np.array([0.1, 0.3])
MOVING_VAR = np.array([2.5, 3.2])


def nchw_to_nhwc(a):
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1))


def nhwc_to_nchw(a):
    return np.ascontiguousarray(a.transpose(0, 3, 1, 2))


def kernel_hwio(w_oc):
    # Conv2D filter [1,1,in,out]: k[0,0,c,o] = w[o][c]
    return np.ascontiguousarray(w_oc.T.reshape(1, 1, C, C))


# ----------------------------------------------------------------------------
# TF1's gradient rule for the matched FusedBatchNorm, re-implemented.
#
# fold_batch_norms.py (TF 1.15) sets `_gradient_op_type` of the training
# FusedBatchNorm op to 'FoldFusedBatchNormGrad' (_GetLayerMatch) and registers
# `_FoldFusedBatchNormGrad`: the incoming gradient of output 0 (y) is ignored,
# the gradients of output 1 (batch mean) and output 2 (batch variance, which
# the op returns WITH Bessel's correction, i.e. divided by n-1) are mapped to x
# as d mean/dx = 1/n and d var_unbiased/dx = 2 (x - mean)/(n - 1); scale,
# offset, mean and variance inputs get no gradient.
# ----------------------------------------------------------------------------
@tf.RegisterGradient(GRAD_NAME)
def _tf1_fold_bn_grad(op, *out_grads):
    bn_input = op.inputs[0]                       # conv output, NHWC
    g_mean, g_var = out_grads[1], out_grads[2]    # per-channel, shape [C]
    per_channel = tf.cast(tf.size(bn_input) // tf.size(g_mean), bn_input.dtype)
    centred = bn_input - op.outputs[1]
    grad_x = (g_mean / per_channel
              + g_var * (2.0 / (per_channel - 1.0)) * centred)
    return [grad_x] + [None] * (len(op.inputs) - 1)


def session_config():
    return tf1.ConfigProto(intra_op_parallelism_threads=1,
                           inter_op_parallelism_threads=1)


def build_and_run(variant, dtype=tf.float32):
    """variant: 'folded' | 'stopgrad' | 'stock' | 'plain'. Returns a dict."""
    g = tf.Graph()
    with g.as_default():
        x = tf.constant(nchw_to_nhwc(X_NCHW), dtype)
        k = tf.constant(kernel_hwio(W_OC), dtype)
        gamma = tf.constant(GAMMA, dtype)
        beta = tf.constant(BETA, dtype)
        mv_mean = tf.constant(MOVING_MEAN, dtype)
        mv_var = tf.constant(MOVING_VAR, dtype)
        coef = tf.constant(nchw_to_nhwc(COEF_NCHW), dtype)

        # the original layer; in the folded graph it only feeds the BN op,
        # whose batch mean / variance outputs the fold reads
        z = tf.nn.conv2d(x, k, strides=1, padding="VALID", data_format="NHWC")
        out = {}

        if variant == "plain":
            mean, var = tf.nn.moments(z, axes=[0, 1, 2])   # biased variance
            pre = tf.nn.batch_normalization(z, mean, var, beta, gamma, EPS)
            out["mean"], out["var"] = mean, var
        else:
            if variant == "stock":
                bn = tf1.nn.fused_batch_norm(z, gamma, beta, epsilon=EPS,
                                             is_training=True)
            else:
                with g.gradient_override_map({"FusedBatchNormV3": GRAD_NAME}):
                    bn = tf1.nn.fused_batch_norm(z, gamma, beta, epsilon=EPS,
                                                 is_training=True)
            _, bmean, bvar_unbiased = bn
            bn_op = bmean.op
            assert bn_op.type == "FusedBatchNormV3", bn_op.type
            if variant != "stock":
                assert bn_op.get_attr("_gradient_op_type") == GRAD_NAME.encode()
            if variant == "stopgrad":
                bmean = tf.stop_gradient(bmean)
                bvar_unbiased = tf.stop_gradient(bvar_unbiased)

            # _GetLayerMatch: n = size(layer output)/size(batch mean), and the
            # fold uses the op's variance times (n-1)/n ("Undo_Bessel_Correction")
            n = tf.cast(tf.size(z) / tf.size(bmean), dtype)
            bvar = bvar_unbiased * ((n - 1.0) / n)

            # _FoldFusedBatchNorms: multiplier and folded bias from batch stats
            multiplier = gamma * tf.math.rsqrt(bvar + EPS)
            bias = beta - bmean * multiplier
            # _ComputeBatchNormCorrections, freeze delay not reached:
            # scale = sigma_b/sigma_mv, recip = 1/scale, offset = 0
            inv_sigma_mv = tf.math.rsqrt(mv_var + EPS)
            inv_sigma_b = tf.math.rsqrt(bvar + EPS)
            corr_scale = inv_sigma_mv / inv_sigma_b
            corr_recip = tf.math.reciprocal(corr_scale)
            corr_offset = tf.zeros_like(corr_scale)
            # (gamma*(mu_b/sigma_b - mu_mv/sigma_mv) is only used after freeze)
            # folded weights: (corr_scale * w) * multiplier == w*gamma/sigma_mv;
            # here the weight fake-quant would sit (pass-through before delay)
            w_fold = (corr_scale * k) * multiplier
            conv_fold = tf.nn.conv2d(x, w_fold, strides=1, padding="VALID",
                                     data_format="NHWC")
            pre = conv_fold * corr_recip
            pre = pre + corr_offset
            pre = pre + bias
            out["mean"], out["var"] = bmean, bvar
            out["var_op_output"] = bvar_unbiased
            out["w_fold"] = w_fold
            out["corr_scale"] = corr_scale

        y = tf.nn.relu6(pre)   # activation fake-quant: pass-through
        loss = tf.reduce_sum(y * coef)
        dk, dgamma, dbeta, dx = tf.gradients(loss, [k, gamma, beta, x])
        out.update(y=y, loss=loss, pre=pre, dk=dk, dgamma=dgamma,
                   dbeta=dbeta, dx=dx, z=z)
        with tf1.Session(graph=g, config=session_config()) as sess:
            res = sess.run(out)
    res["y"] = nhwc_to_nchw(res["y"]).reshape(-1)
    res["pre"] = nhwc_to_nchw(res["pre"]).reshape(-1)
    res["dx"] = nhwc_to_nchw(res["dx"]).reshape(-1)
    res["dw"] = res["dk"][0, 0].T            # -> dL/dw[o][c]
    if "w_fold" in res:
        res["w_fold"] = res["w_fold"][0, 0].T
    return res


# ----------------------------------------------------------------------------
# printing
# ----------------------------------------------------------------------------
def lit(v):
    s = "%.6g" % float(v)
    if s in ("-0", "0"):
        s = s + ".0"
    elif not any(ch in s for ch in ".einf"):
        s += ".0"
    return s


def rust(name, a):
    a = np.asarray(a, dtype=np.float64)
    if a.ndim == 2:
        rows = ", ".join("[" + ", ".join(lit(v) for v in r) + "]" for r in a)
        return "const %s: [[f32; %d]; %d] = [%s];" % (name, a.shape[1],
                                                        a.shape[0], rows)
    flat = a.reshape(-1)
    body = ", ".join(lit(v) for v in flat)
    return "const %s: [f32; %d] = [%s];" % (name, flat.size, body)


def maxdiff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64)
                               - np.asarray(b, np.float64))))


KEYS = ["y", "dw", "dgamma", "dbeta", "dx"]


def main():
    print("TensorFlow", tf.__version__)
    folded = build_and_run("folded")
    plain = build_and_run("plain")
    stop = build_and_run("stopgrad")
    stock = build_and_run("stock")
    plain64 = build_and_run("plain", tf.float64)

    z = folded["z"].astype(np.float64)
    n = z.shape[0] * z.shape[1] * z.shape[2]
    print("\n# n per channel =", n)
    print("# FusedBatchNormV3 batch_variance output (unbiased, /(n-1)):",
          [lit(v) for v in folded["var_op_output"]],
          " numpy ddof=1:", [lit(v) for v in z.var(axis=(0, 1, 2), ddof=1)])
    print("# variance used by the fold (after *(n-1)/n, biased):",
          [lit(v) for v in folded["var"]],
          " numpy ddof=0:", [lit(v) for v in z.var(axis=(0, 1, 2), ddof=0)])
    print("# correction_scale sigma_b/sigma_mv:",
          [lit(v) for v in folded["corr_scale"]])
    print("# folded weights w*gamma/sigma_mv as [o][c]:",
          [[lit(v) for v in r] for r in folded["w_fold"]])

    sections = [
        ("folded unit, TF1 FoldFusedBatchNormGrad rule (float32)", "FOLD", folded,
         [("BATCH_MEAN", "mean"), ("BATCH_VAR_BIASED", "var")]),
        ("(a) plain BN, biased batch moments (float32)", "PLAIN", plain, []),
        ("(a') plain BN in float64 (the exact math, for tolerances)", "PLAIN64",
         plain64, [("MEAN", "mean"), ("VAR_BIASED", "var")]),
        ("(b) folded unit, stop_gradient on batch mean/var (float32)", "STOPGRAD",
         stop, []),
    ]
    for title, prefix, run, stats in sections:
        print(f"\n// ---- {title} ----")
        print("// loss =", lit(run["loss"]))
        for name, key in stats + [(k.upper(), k) for k in
                                  ("y", "dw", "dgamma", "dbeta", "dx")]:
            print(rust(f"{prefix}_{name}", run[key]))

    print("\n# ---- comparisons (max abs difference) ----")
    for a_name, a, b_name, b in [("folded", folded, "plain", plain),
                                 ("folded", folded, "plain_f64", plain64),
                                 ("plain", plain, "plain_f64", plain64),
                                 ("stopgrad", stop, "plain", plain),
                                 ("stock", stock, "stopgrad", stop)]:
        print("# %-8s vs %-9s: " % (a_name, b_name)
              + ", ".join("%s %.3g" % (key, maxdiff(a[key], b[key]))
                          for key in KEYS))
    print("# folded batch mean vs plain mean: %.3g, folded var vs plain var: %.3g"
          % (maxdiff(folded["mean"], plain["mean"]),
             maxdiff(folded["var"], plain["var"])))
    print("# ReLU6-clipped pre-activations (folded): %d of %d"
          % (int(np.sum((folded["pre"] <= 0) | (folded["pre"] >= 6))),
             folded["pre"].size))


if __name__ == "__main__":
    main()
