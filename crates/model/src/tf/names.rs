//! The TF Object Detection API's variable names for every tensor of [`Ssd`], and moving
//! tensors in and out of a network by those names.
//!
//! | tensor | name |
//! |---|---|
//! | backbone convolution `i` (0..=13) | `FeatureExtractor/MobilenetV1/Conv2d_0/weights`, `.../Conv2d_<i>_depthwise/depthwise_weights`, `.../Conv2d_<i>_pointwise/weights` |
//! | its BatchNorm | `<layer>/BatchNorm/gamma`, `beta`, `moving_mean`, `moving_variance` |
//! | extra layer `i` (2..=5) | `FeatureExtractor/MobilenetV1/Conv2d_13_pointwise_1_Conv2d_<i>_1x1_<d/2>/...` and `..._2_Conv2d_<i>_3x3_s2_<d>/...` (`d` after the depth multiplier) |
//! | predictor for feature map `i` (0..=5) | `BoxPredictor_<i>/BoxEncodingPredictor/weights`, `biases`; `BoxPredictor_<i>/ClassPredictor/weights`, `biases` |
//!
//! Values are in this crate's layout: convolution kernels `[out, in, kh, kw]`, depthwise
//! kernels `[channels, 1, kh, kw]` (TF stores `[kh, kw, in, out]` and `[kh, kw, in, 1]`).

use burn::module::Param;
use burn::nn::conv::Conv2d;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::config::SsdConfig;
use crate::mobilenet::SEPARABLE_BLOCKS;
use crate::ssd::{EXTRA_LAYER_DEPTHS, Ssd};

/// Scope of the feature extractor's variables.
pub const FEATURE_EXTRACTOR: &str = "FeatureExtractor";
/// Scope of the MobileNet-v1 backbone inside the feature extractor.
pub const BACKBONE: &str = "FeatureExtractor/MobilenetV1";

/// Name prefix of every convolution + BatchNorm unit, in [`Ssd::conv_units_mut`] order.
pub(crate) fn unit_names(config: &SsdConfig) -> Vec<String> {
    let mut names = vec![format!("{BACKBONE}/Conv2d_0")];
    for i in 1..=SEPARABLE_BLOCKS.len() {
        names.push(format!("{BACKBONE}/Conv2d_{i}_depthwise"));
        names.push(format!("{BACKBONE}/Conv2d_{i}_pointwise"));
    }
    let base = format!("{BACKBONE}/Conv2d_13_pointwise");
    for (i, &depth) in EXTRA_LAYER_DEPTHS.iter().enumerate() {
        let index = i + 2;
        let (half, full) = (config.depth(depth / 2), config.depth(depth));
        names.push(format!("{base}_1_Conv2d_{index}_1x1_{half}"));
        names.push(format!("{base}_2_Conv2d_{index}_3x3_s2_{full}"));
    }
    names
}

/// The kernel's name in a unit: `depthwise_weights` for depthwise convolutions.
fn kernel_name(unit: &str) -> String {
    if unit.ends_with("_depthwise") {
        format!("{unit}/depthwise_weights")
    } else {
        format!("{unit}/weights")
    }
}

/// Whether a variable is a BatchNorm moving statistic (not trained by gradients, so without
/// an `ExponentialMovingAverage` shadow in the API's checkpoints).
pub fn is_moving_statistic(name: &str) -> bool {
    name.ends_with("/moving_mean") || name.ends_with("/moving_variance")
}

fn head_names<B: Backend>(model: &mut Ssd<B>) -> Vec<(String, &mut Conv2d<B>)> {
    let (boxes, classes) = model.heads_mut();
    let mut out = Vec::new();
    for (i, (b, c)) in boxes.iter_mut().zip(classes.iter_mut()).enumerate() {
        out.push((format!("BoxPredictor_{i}/BoxEncodingPredictor"), b));
        out.push((format!("BoxPredictor_{i}/ClassPredictor"), c));
    }
    out
}

fn to_tensor<B: Backend, const D: usize>(
    values: Vec<f32>,
    dims: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(values, dims), device)
}

/// A tensor's values as `f32`, flattened.
pub(crate) fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec()
        .expect("a float tensor converts to f32")
}

/// Calls `f(name, shape, current)` for every tensor of the network, `current` its values
/// flattened, in a fixed order (the units backbone first, each kernel then its BatchNorm, then
/// the predictor heads); where `f` returns values (of exactly that shape), they replace the
/// tensor.
pub(crate) fn update_tensors<B: Backend>(
    model: &mut Ssd<B>,
    config: &SsdConfig,
    mut f: impl FnMut(&str, &[usize], Tensor<B, 1>) -> Option<Vec<f32>>,
) {
    let names = unit_names(config);
    for (unit, name) in model.conv_units_mut().into_iter().zip(names) {
        let device = unit.conv.weight.device();
        let dims = unit.conv.weight.dims();
        if let Some(v) = f(
            &kernel_name(&name),
            &dims,
            unit.conv.weight.val().flatten(0, 3),
        ) {
            unit.conv.weight = Param::from_tensor(to_tensor(v, dims, &device));
        }
        let c = [dims[0]];
        let part = |p: &str| format!("{name}/BatchNorm/{p}");
        if let Some(v) = f(&part("gamma"), &c, unit.bn.gamma.val()) {
            unit.bn.gamma = Param::from_tensor(to_tensor(v, c, &device));
        }
        if let Some(v) = f(&part("beta"), &c, unit.bn.beta.val()) {
            unit.bn.beta = Param::from_tensor(to_tensor(v, c, &device));
        }
        let (mut mean, mut variance) = unit.bn.moving_stats();
        if let Some(v) = f(&part("moving_mean"), &c, mean.clone()) {
            mean = to_tensor(v, c, &device);
        }
        if let Some(v) = f(&part("moving_variance"), &c, variance.clone()) {
            variance = to_tensor(v, c, &device);
        }
        unit.bn.set_moving_stats(mean, variance);
    }
    for (name, head) in head_names(model) {
        let device = head.weight.device();
        let dims = head.weight.dims();
        if let Some(v) = f(
            &format!("{name}/weights"),
            &dims,
            head.weight.val().flatten(0, 3),
        ) {
            head.weight = Param::from_tensor(to_tensor(v, dims, &device));
        }
        let bias = head.bias.as_ref().map(|b| b.val());
        if let Some(current) = bias
            && let Some(v) = f(&format!("{name}/biases"), &[dims[0]], current)
        {
            head.bias = Some(Param::from_tensor(to_tensor(v, [dims[0]], &device)));
        }
    }
}

/// `(name, shape)` of every tensor of the network, in `update_tensors` order.
pub fn tensor_shapes<B: Backend>(model: &Ssd<B>, config: &SsdConfig) -> Vec<(String, Vec<usize>)> {
    let mut out = Vec::new();
    update_tensors(&mut model.clone(), config, |name, shape, _| {
        out.push((name.to_string(), shape.to_vec()));
        None
    });
    out
}

/// `(name, shape, values)` of every tensor of the network, in `update_tensors` order.
pub fn named_tensors<B: Backend>(
    model: &Ssd<B>,
    config: &SsdConfig,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut out = Vec::new();
    update_tensors(&mut model.clone(), config, |name, shape, current| {
        out.push((name.to_string(), shape.to_vec(), values(current)));
        None
    });
    out
}

/// Converts a TF kernel (`[kh, kw, in, out]`; depthwise `[kh, kw, in, multiplier]`) to this
/// crate's layout (`[out, in, kh, kw]`; depthwise `[in * multiplier, 1, kh, kw]`, output
/// channel `i * multiplier + m` as TF orders them). Returns the new shape and values.
///
/// Panics unless `shape` has 4 dimensions whose product is `values.len()`.
pub fn kernel_from_tf(shape: &[usize], values: &[f32], depthwise: bool) -> (Vec<usize>, Vec<f32>) {
    let &[kh, kw, cin, cout] = shape else {
        panic!("a kernel has 4 dimensions, not {shape:?}");
    };
    assert_eq!(
        kh * kw * cin * cout,
        values.len(),
        "kernel {shape:?} values"
    );
    let (out_channels, in_per_group) = if depthwise {
        (cin * cout, 1)
    } else {
        (cout, cin)
    };
    let mut out = vec![0.0; values.len()];
    for o in 0..out_channels {
        for i in 0..in_per_group {
            // depthwise: output o reads input o / multiplier with filter o % multiplier
            let (tf_in, tf_out) = if depthwise {
                (o / cout, o % cout)
            } else {
                (i, o)
            };
            for y in 0..kh {
                for x in 0..kw {
                    let src = ((y * kw + x) * cin + tf_in) * cout + tf_out;
                    out[((o * in_per_group + i) * kh + y) * kw + x] = values[src];
                }
            }
        }
    }
    (vec![out_channels, in_per_group, kh, kw], out)
}

/// Whether a TF variable holds a depthwise kernel.
pub fn is_depthwise_kernel(name: &str) -> bool {
    name.ends_with("/depthwise_weights")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_move_from_hwio_to_oihw() {
        // [kh=1, kw=2, in=2, out=3]: value = 100 y + 10 x... encoded as x*100 + i*10 + o
        let shape = [1, 2, 2, 3];
        let values: Vec<f32> = (0..12)
            .map(|k| {
                let (x, i, o) = (k / 6, (k / 3) % 2, k % 3);
                (x * 100 + i * 10 + o) as f32
            })
            .collect();
        let (dims, ours) = kernel_from_tf(&shape, &values, false);
        assert_eq!(dims, vec![3, 2, 1, 2]);
        // ours[o][i][0][x]
        for o in 0..3 {
            for i in 0..2 {
                for x in 0..2 {
                    assert_eq!(ours[(o * 2 + i) * 2 + x], (x * 100 + i * 10 + o) as f32);
                }
            }
        }
    }

    #[test]
    fn depthwise_kernels_keep_channel_major_multiplier_order() {
        // [kh=1, kw=1, in=2, multiplier=2]: TF value = 10 i + m
        let (dims, ours) = kernel_from_tf(&[1, 1, 2, 2], &[0.0, 1.0, 10.0, 11.0], true);
        assert_eq!(dims, vec![4, 1, 1, 1]);
        assert_eq!(ours, vec![0.0, 1.0, 10.0, 11.0]);
        let (dims, ours) = kernel_from_tf(&[2, 1, 3, 1], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], true);
        assert_eq!(dims, vec![3, 1, 2, 1]);
        assert_eq!(ours, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    }
}
