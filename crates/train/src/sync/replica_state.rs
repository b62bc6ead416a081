//! What replicas compare and average besides gradients: a hash of the weights (every replica
//! must start from the same point), the BatchNorm moving statistics and the activation ranges
//! of quantization-aware training, each as one flat tensor.

use burn::module::{ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use model::Ssd;

struct Checksum(std::hash::DefaultHasher);

impl<B: Backend> ModuleVisitor<B> for Checksum {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        use std::hash::Hash;
        let data = param.val().into_data();
        match data.as_slice::<f32>() {
            Ok(values) => values.iter().for_each(|v| v.to_bits().hash(&mut self.0)),
            Err(_) => data.as_bytes().hash(&mut self.0),
        }
    }
}

/// A hash of every weight value of `model` in module order (not of the parameter ids, which
/// differ between processes): equal weights give equal checksums on every machine.
pub fn weight_checksum<B: Backend>(model: &Ssd<B>) -> u64 {
    use std::hash::Hasher;
    let mut v = Checksum(std::hash::DefaultHasher::new());
    burn::module::Module::visit(model, &mut v);
    v.0.finish()
}

/// The BatchNorm moving statistics of `model` as one flat tensor: every BatchNorm's mean, then
/// its variance, in module order (what replicas average before a checkpoint).
pub fn bn_stats_flat<B: Backend>(model: &Ssd<B>) -> Tensor<B, 1> {
    let parts: Vec<Tensor<B, 1>> = model
        .batch_norms()
        .into_iter()
        .flat_map(|bn| {
            let (mean, var) = bn.moving_stats();
            [mean, var]
        })
        .collect();
    Tensor::cat(parts, 0)
}

/// Sets the BatchNorm moving statistics of `model` from a tensor laid out by [`bn_stats_flat`].
pub fn set_bn_stats_flat<B: Backend>(model: &Ssd<B>, flat: Tensor<B, 1>) {
    let mut offset = 0;
    for bn in model.batch_norms() {
        let n = bn.moving_stats().0.dims()[0];
        let mean = flat.clone().narrow(0, offset, n);
        let var = flat.clone().narrow(0, offset + n, n);
        offset += 2 * n;
        bn.set_moving_stats(mean, var);
    }
}

/// The activation ranges of quantization-aware training as one flat tensor: each range's
/// `[min, max]` moving averages before debiasing, in [`Ssd::activation_ranges`] order; `None`
/// for a float network.
pub fn ranges_flat<B: Backend>(model: &Ssd<B>) -> Option<Tensor<B, 1>> {
    let parts: Vec<Tensor<B, 1>> = model
        .activation_ranges()
        .into_iter()
        .map(|r| r.biased())
        .collect();
    (!parts.is_empty()).then(|| Tensor::cat(parts, 0))
}

/// Sets the activation ranges of `model` from a tensor laid out by [`ranges_flat`].
pub fn set_ranges_flat<B: Backend>(model: &Ssd<B>, flat: Tensor<B, 1>) {
    for (i, range) in model.activation_ranges().into_iter().enumerate() {
        range.set_biased(flat.clone().narrow(0, 2 * i, 2));
    }
}
