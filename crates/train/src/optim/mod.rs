//! Optimizers with TensorFlow's update rules (Burn's RMSProp is PyTorch-style), as Burn
//! `SimpleOptimizer`s: their slots are kept in the records of Burn's `OptimizerAdaptor`
//! (checkpoints), and [`network::NetworkOptimizer`] applies them over a network.
//!
//! - RMSProp (`tf.train.RMSPropOptimizer`): `ms <- decay ms + (1 - decay) g^2` with `ms`
//!   starting at 1, `mom <- momentum mom + lr g / sqrt(ms + epsilon)`, `w <- w - mom`.
//! - Momentum (`tf.train.MomentumOptimizer`): `a <- momentum a + g`, `w <- w - lr a`.
//! - Adam (`tf.train.AdamOptimizer`): `lr_t = lr sqrt(1 - b2^t) / (1 - b1^t)`,
//!   `w <- w - lr_t m / (sqrt(v) + epsilon)`.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsParams, SimpleOptimizer};
use burn::record::Record;
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use model::ops::{RmsPropStep, SsdBackend, filled, rmsprop_update};

use crate::config::OptimizerConfig;

pub mod ema;
pub mod network;

/// The update rule and its constants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TfOptimizer {
    /// RMSProp with momentum.
    RmsProp {
        /// Momentum.
        momentum: f32,
        /// Decay of the mean square.
        decay: f32,
        /// Added inside the square root.
        epsilon: f32,
    },
    /// Heavy-ball momentum.
    Momentum {
        /// Momentum.
        momentum: f32,
    },
    /// Adam.
    Adam {
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to the root of the second moment.
        epsilon: f32,
    },
}

impl From<&OptimizerConfig> for TfOptimizer {
    fn from(c: &OptimizerConfig) -> Self {
        match *c {
            OptimizerConfig::RmsProp {
                momentum,
                decay,
                epsilon,
                ..
            } => Self::RmsProp {
                momentum,
                decay,
                epsilon,
            },
            OptimizerConfig::Momentum { momentum, .. } => Self::Momentum { momentum },
            OptimizerConfig::Adam {
                beta1,
                beta2,
                epsilon,
                ..
            } => Self::Adam {
                beta1,
                beta2,
                epsilon,
            },
        }
    }
}

/// Slots of one parameter: RMSProp `(ms, mom)`, Momentum `(accumulator, -)`, Adam `(m, v)`.
#[derive(Record, Clone)]
pub struct Slots<B: Backend, const D: usize> {
    /// First slot.
    pub first: Tensor<B, D>,
    /// Second slot (absent for momentum).
    pub second: Option<Tensor<B, D>>,
    /// Updates applied (Adam's `t`).
    pub time: usize,
}

impl<B: SsdBackend> SimpleOptimizer<B> for TfOptimizer {
    type State<const D: usize> = Slots<B, D>;

    fn step<const D: usize>(
        &self,
        lr: f64,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        match *self {
            Self::RmsProp {
                momentum,
                decay,
                epsilon,
            } => {
                let (ms, mom, time) = match state {
                    Some(s) => (
                        s.first,
                        s.second.unwrap_or_else(|| filled_like(&tensor, 0.0)),
                        s.time,
                    ),
                    None => (filled_like(&tensor, 1.0), filled_like(&tensor, 0.0), 0),
                };
                let step = RmsPropStep {
                    learning_rate: lr as f32,
                    momentum,
                    decay,
                    epsilon,
                };
                let [tensor, ms, mom] = rmsprop_update([tensor, ms, mom], grad, step);
                (
                    tensor,
                    Some(Slots {
                        first: ms,
                        second: Some(mom),
                        time: time + 1,
                    }),
                )
            }
            Self::Momentum { momentum } => {
                let (acc, time) = match state {
                    Some(s) => (s.first.mul_scalar(momentum) + grad, s.time),
                    None => (grad, 0),
                };
                let tensor = tensor - acc.clone().mul_scalar(lr);
                (
                    tensor,
                    Some(Slots {
                        first: acc,
                        second: None,
                        time: time + 1,
                    }),
                )
            }
            Self::Adam {
                beta1,
                beta2,
                epsilon,
            } => {
                let (m, v, time) = match state {
                    Some(s) => (
                        s.first,
                        s.second.unwrap_or_else(|| filled_like(&tensor, 0.0)),
                        s.time,
                    ),
                    None => (filled_like(&tensor, 0.0), filled_like(&tensor, 0.0), 0),
                };
                let t = time as i32 + 1;
                let m = m.mul_scalar(beta1) + grad.clone().mul_scalar(1.0 - beta1);
                let v = v.mul_scalar(beta2) + grad.square().mul_scalar(1.0 - beta2);
                let lr_t =
                    lr * (1.0 - (beta2 as f64).powi(t)).sqrt() / (1.0 - (beta1 as f64).powi(t));
                let tensor =
                    tensor - (m.clone() / v.clone().sqrt().add_scalar(epsilon)).mul_scalar(lr_t);
                (
                    tensor,
                    Some(Slots {
                        first: m,
                        second: Some(v),
                        time: time + 1,
                    }),
                )
            }
        }
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        Slots {
            first: state.first.to_device(device),
            second: state.second.map(|s| s.to_device(device)),
            time: state.time,
        }
    }
}

/// A slot's first value: `like`'s shape, type and device, every value `value`, written from the
/// host ([`filled`]).
fn filled_like<B: Backend, const D: usize>(like: &Tensor<B, D>, value: f32) -> Tensor<B, D> {
    filled(like.shape(), value, (&like.device(), like.dtype()))
}

/// The sum of the squared gradients of a module's parameters, formed on the device (a lone
/// replica's; replicas that exchange gradients get it from the exchange, formed once).
pub fn squared_global_norm<B: AutodiffBackend, M: Module<B>>(
    model: &M,
    grads: &GradientsParams,
) -> Option<Tensor<B::InnerBackend, 1>> {
    let mut squares = SquaredNorm::<B> { grads, sum: None };
    model.visit(&mut squares);
    squares.sum
}

struct SquaredNorm<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    sum: Option<Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SquaredNorm<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            let squares = g.square().sum();
            self.sum = Some(match self.sum.take() {
                Some(sum) => sum + squares,
                None => squares,
            });
        }
    }
}

/// Multiplies every gradient of a module's parameters by a one-element factor.
struct Scale<'a, B: Backend> {
    grads: &'a mut GradientsParams,
    factor: Tensor<B, 1>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let factor = self.factor.clone().reshape([1; D]);
            self.grads.register(param.id, g * factor);
        }
    }
}

/// TF's `clip_by_global_norm` (what `gradient_clipping_by_norm` selects in the API's
/// `model_main.py`), given the squared global norm of `model`'s gradients: every gradient is
/// multiplied by `max_norm / max(norm, max_norm)`, which is exactly 1 at or under the limit.
/// The factor stays on the device: no read to the host.
pub fn clip_by_global_norm<B: AutodiffBackend, M: Module<B>>(
    model: &M,
    mut grads: GradientsParams,
    max_norm: f32,
    squared_norm: Tensor<B::InnerBackend, 1>,
) -> GradientsParams {
    let limit = Tensor::full([1], max_norm, &squared_norm.device());
    let factor = limit / squared_norm.sqrt().clamp_min(max_norm);
    model.visit(&mut Scale::<B::InnerBackend> {
        grads: &mut grads,
        factor,
    });
    grads
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    type B = Flex;

    fn run(opt: TfOptimizer, lr: f64, grads: &[f32]) -> Vec<f32> {
        let device = Default::default();
        let mut w = Tensor::<B, 1>::from_data(TensorData::new(vec![1.0f32], [1]), &device);
        let mut state = None;
        let mut out = Vec::new();
        for &g in grads {
            let grad = Tensor::<B, 1>::from_data(TensorData::new(vec![g], [1]), &device);
            let (nw, ns) = SimpleOptimizer::<B>::step(&opt, lr, w, grad, state);
            w = nw;
            state = ns;
            out.push(w.clone().into_scalar());
        }
        out
    }

    #[test]
    fn rmsprop_matches_tf_by_hand() {
        // ms0 = 1; g = 2: ms1 = 0.9 + 0.1 * 4 = 1.3, mom1 = 0.01 * 2 / sqrt(1.3 + 1) ,
        // g = 1: ms2 = 1.17 + 0.1 = 1.27, mom2 = 0.9 mom1 + 0.01 / sqrt(2.27)
        let opt = TfOptimizer::RmsProp {
            momentum: 0.9,
            decay: 0.9,
            epsilon: 1.0,
        };
        let w = run(opt, 0.01, &[2.0, 1.0]);
        let mom1 = 0.02 / 2.3f64.sqrt();
        let mom2 = 0.9 * mom1 + 0.01 / 2.27f64.sqrt();
        assert!((w[0] as f64 - (1.0 - mom1)).abs() < 1e-6, "{w:?}");
        assert!((w[1] as f64 - (1.0 - mom1 - mom2)).abs() < 1e-6, "{w:?}");
    }

    #[test]
    fn momentum_and_adam_match_tf_by_hand() {
        let w = run(TfOptimizer::Momentum { momentum: 0.5 }, 0.1, &[1.0, 1.0]);
        // a1 = 1, w = 0.9; a2 = 1.5, w = 0.75
        assert!(
            (w[0] - 0.9).abs() < 1e-6 && (w[1] - 0.75).abs() < 1e-6,
            "{w:?}"
        );
        let w = run(
            TfOptimizer::Adam {
                beta1: 0.9,
                beta2: 0.999,
                epsilon: 1e-8,
            },
            0.1,
            &[0.5],
        );
        // t = 1: m = 0.05, v = 0.00025, lr_t = 0.1 sqrt(0.001) / 0.1; step = lr_t m / sqrt(v) = 0.1
        assert!((w[0] - 0.9).abs() < 1e-5, "{w:?}");
    }

    #[test]
    fn clipping_scales_every_gradient_by_the_global_norm() {
        use burn::backend::Autodiff;
        use burn::nn::{Linear, LinearConfig};
        type A = Autodiff<Flex>;
        let device = Default::default();
        let linear: Linear<A> = LinearConfig::new(2, 1).init(&device);
        let bias_id = linear.bias.as_ref().expect("a bias").id;
        let grads = |w: [f32; 2], b: f32| {
            let mut g = GradientsParams::new();
            let weight = TensorData::new(w.to_vec(), [2, 1]);
            g.register::<B, 2>(linear.weight.id, Tensor::from_data(weight, &device));
            g.register::<B, 1>(
                bias_id,
                Tensor::from_data(TensorData::new(vec![b], [1]), &device),
            );
            g
        };
        let values = |g: &GradientsParams| {
            let w = g.get::<B, 2>(linear.weight.id).expect("weight gradient");
            let b = g.get::<B, 1>(bias_id).expect("bias gradient");
            let mut v = w.into_data().to_vec::<f32>().expect("f32");
            v.extend(b.into_data().to_vec::<f32>().expect("f32"));
            v
        };
        // global norm sqrt(3^2 + 0^2 + 4^2) = 5: clipped to 1, each gradient is scaled by 0.2
        let clip = |g: GradientsParams, limit: f32| {
            let norm = squared_global_norm(&linear, &g).expect("gradients");
            clip_by_global_norm(&linear, g, limit, norm)
        };
        let clipped = clip(grads([3.0, 0.0], 4.0), 1.0);
        let v = values(&clipped);
        for (got, want) in v.iter().zip([0.6, 0.0, 0.8]) {
            assert!((got - want).abs() < 1e-6, "{v:?}");
        }
        // at or under the limit nothing changes
        for limit in [5.0, 10.0] {
            let same = clip(grads([3.0, 0.0], 4.0), limit);
            assert_eq!(values(&same), vec![3.0, 0.0, 4.0]);
        }
    }
}
