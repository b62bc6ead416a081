//! How gradients travel through the exchange: between devices or machines as a few large flat
//! buckets, not one round-trip per tensor; replicas on one device hand over each tensor as it
//! is ([`Bucketing`]).

use burn::module::{ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use model::Ssd;

/// Where each trainable parameter sits in the flat buckets.
#[derive(Debug, Clone)]
pub struct BucketLayout {
    /// `(id, shape)` of each parameter, in module order.
    params: Vec<(ParamId, Vec<usize>)>,
    /// Parameters per bucket.
    bucket_sizes: Vec<usize>,
}

/// How [`flatten_gradients`] groups the gradients for the exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bucketing {
    /// Each parameter's gradient is a bucket of its own, as autodiff made it: nothing is
    /// copied on the way in or out. For replicas on one device, where the sum reads every
    /// tensor where it lies.
    PerParameter,
    /// Gradients concatenated into buckets of up to [`BUCKET_ELEMENTS`]: a few large
    /// transfers instead of one per tensor, between devices or machines.
    Joined,
}

impl Bucketing {
    /// [`Bucketing::PerParameter`] when every replica is on one device and no other machine
    /// takes part (the sum then moves no data), else [`Bucketing::Joined`].
    pub fn for_replicas<D: PartialEq>(devices: &[D], multi_node: bool) -> Self {
        let one_device = devices.windows(2).all(|w| w[0] == w[1]);
        if one_device && !multi_node {
            Self::PerParameter
        } else {
            Self::Joined
        }
    }

    /// Elements at which a bucket closes.
    fn bucket_elements(self) -> usize {
        match self {
            Self::PerParameter => 1,
            Self::Joined => BUCKET_ELEMENTS,
        }
    }
}

/// Largest joined bucket, in elements (16 MiB of f32).
pub const BUCKET_ELEMENTS: usize = 4 << 20;

struct Flatten<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    params: Vec<(ParamId, Vec<usize>)>,
    pieces: Vec<Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Flatten<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        // A trainable parameter that received no gradient on this replica (it can happen when
        // a sub-batch leaves a branch unused) contributes zeros, so every replica sends buckets
        // of the same layout.
        let grad = match self.grads.remove::<B::InnerBackend, D>(param.id) {
            Some(g) => g,
            None if param.val().is_require_grad() => param.val().inner().zeros_like(),
            None => return,
        };
        let dims = grad.dims().to_vec();
        let n: usize = dims.iter().product();
        self.params.push((param.id, dims));
        self.pieces.push(grad.reshape([n]));
    }
}

/// One bucket from its pieces: a lone piece as it is, several concatenated.
fn join<B: Backend>(mut pieces: Vec<Tensor<B, 1>>) -> Tensor<B, 1> {
    match pieces.len() {
        1 => pieces.pop().expect("one piece"),
        _ => Tensor::cat(pieces, 0),
    }
}

/// Cuts the gradients of `model` into flat buckets (in module order) as `bucketing` says,
/// with `tail` (values to average along with the gradients) at the end of the last bucket,
/// where [`unflatten_gradients`] ignores it.
pub fn flatten_gradients<B: AutodiffBackend>(
    model: &Ssd<B>,
    mut grads: GradientsParams,
    tail: Option<Tensor<B::InnerBackend, 1>>,
    bucketing: Bucketing,
) -> (BucketLayout, Vec<Tensor<B::InnerBackend, 1>>) {
    let mut v = Flatten::<B> {
        grads: &mut grads,
        params: Vec::new(),
        pieces: Vec::new(),
    };
    burn::module::Module::visit(model, &mut v);
    let (params, pieces) = (v.params, v.pieces);
    let mut buckets = Vec::new();
    let mut bucket_sizes = Vec::new();
    let mut current: Vec<Tensor<B::InnerBackend, 1>> = Vec::new();
    let mut elements = 0;
    for piece in pieces {
        elements += piece.dims()[0];
        current.push(piece);
        if elements >= bucketing.bucket_elements() {
            bucket_sizes.push(current.len());
            buckets.push(join(std::mem::take(&mut current)));
            elements = 0;
        }
    }
    let params_in_last = current.len();
    current.extend(tail);
    if !current.is_empty() {
        bucket_sizes.push(params_in_last);
        buckets.push(join(current));
    }
    (
        BucketLayout {
            params,
            bucket_sizes,
        },
        buckets,
    )
}

/// Rebuilds per-parameter gradients from buckets laid out by [`flatten_gradients`].
pub fn unflatten_gradients<B: AutodiffBackend>(
    layout: &BucketLayout,
    buckets: Vec<Tensor<B::InnerBackend, 1>>,
) -> GradientsParams {
    let mut grads = GradientsParams::new();
    let mut params = layout.params.iter();
    for (bucket, &count) in buckets.into_iter().zip(&layout.bucket_sizes) {
        let mut offset = 0;
        for (id, dims) in params.by_ref().take(count) {
            let n: usize = dims.iter().product();
            let flat = bucket.clone().narrow(0, offset, n);
            offset += n;
            match dims.len() {
                1 => grads.register::<B::InnerBackend, 1>(*id, flat),
                4 => grads.register::<B::InnerBackend, 4>(
                    *id,
                    flat.reshape([dims[0], dims[1], dims[2], dims[3]]),
                ),
                d => unreachable!("SSD parameters are 1-D or 4-D, not {d}-D"),
            }
        }
    }
    grads
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gradients_are_joined_only_where_they_travel() {
        assert_eq!(
            Bucketing::for_replicas(&[0, 0, 0], false),
            Bucketing::PerParameter
        );
        assert_eq!(Bucketing::for_replicas(&[0, 1], false), Bucketing::Joined);
        assert_eq!(Bucketing::for_replicas(&[0, 0], true), Bucketing::Joined);
        assert_eq!(Bucketing::for_replicas(&[0], true), Bucketing::Joined);
    }
}
