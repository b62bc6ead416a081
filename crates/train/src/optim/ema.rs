//! Weight exponential moving average as `tf.train.ExponentialMovingAverage`:
//! `shadow <- shadow - (1 - d) (shadow - w)` over the trainable weights, with the constant
//! `d = decay`, as the API's optimizer builder sets it up (it passes no `num_updates`), or with
//! `warmup`, `d = min(decay, (1 + n) / (10 + n))` after `n` updates (`num_updates` given).
//! BatchNorm moving statistics are taken as they are (TF does not average non-trainable
//! variables).

use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use model::Ssd;
use model::ops::{SsdBackend, moving_average};

/// The decay of an update after `num_updates` updates.
pub fn ema_decay(decay: f64, warmup: bool, num_updates: u64) -> f64 {
    if warmup {
        decay.min((1.0 + num_updates as f64) / (10.0 + num_updates as f64))
    } else {
        decay
    }
}

/// Shadow weights.
#[derive(Debug, Clone)]
pub struct Ema<B: Backend> {
    decay: f64,
    warmup: bool,
    shadow: Ssd<B>,
    /// The parameters averaged; the others are copied.
    trainable: HashSet<ParamId>,
}

struct Collect<B: Backend> {
    values: HashMap<ParamId, Tensor<B, 1>>,
}

impl<B: Backend> ModuleVisitor<B> for Collect<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        let n = t.shape().num_elements();
        self.values.insert(param.id, t.reshape([n]));
    }
}

struct Blend<'a, B: Backend> {
    current: HashMap<ParamId, Tensor<B, 1>>,
    trainable: &'a HashSet<ParamId>,
    keep: f64,
}

impl<B: SsdBackend> ModuleMapper<B> for Blend<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(current) = self.current.remove(&param.id) else {
            return param;
        };
        let trainable = self.trainable.contains(&param.id);
        let keep = self.keep;
        param.map(|shadow| {
            let current = current.reshape(shadow.dims()).to_device(&shadow.device());
            if trainable {
                moving_average(shadow, current, keep as f32)
            } else {
                current
            }
        })
    }
}

impl<B: SsdBackend> Ema<B> {
    /// Starts the average at `shadow` (the network's weights, or an average restored from a
    /// checkpoint), averaging the parameters in `trainable` ([`trainable_ids`]) and copying
    /// the others; `warmup` as in the module docs.
    pub fn new(shadow: Ssd<B>, decay: f64, warmup: bool, trainable: HashSet<ParamId>) -> Self {
        Self {
            decay,
            warmup,
            shadow,
            trainable,
        }
    }

    /// The average after one update with the weights after `num_updates` optimizer steps
    /// (by value: the shadow weights nobody else holds are updated in place).
    pub fn update(mut self, current: &Ssd<B>, num_updates: u64) -> Self {
        let mut collect = Collect {
            values: HashMap::new(),
        };
        current.visit(&mut collect);
        let mut blend = Blend {
            current: collect.values,
            trainable: &self.trainable,
            keep: ema_decay(self.decay, self.warmup, num_updates),
        };
        self.shadow = self.shadow.map(&mut blend);
        self
    }

    /// The averaged network.
    pub fn shadow(&self) -> &Ssd<B> {
        &self.shadow
    }
}

/// The ids of `model`'s trainable parameters (those that take gradients): the weights the
/// EMA averages.
pub fn trainable_ids<B: Backend, M: Module<B>>(model: &M) -> HashSet<ParamId> {
    struct Trainable(HashSet<ParamId>);
    impl<B: Backend> ModuleVisitor<B> for Trainable {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if param.val().is_require_grad() {
                self.0.insert(param.id);
            }
        }
    }
    let mut ids = Trainable(HashSet::new());
    model.visit(&mut ids);
    ids.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use model::SsdConfig;

    #[test]
    fn decay_is_constant_or_follows_num_updates() {
        assert_eq!(ema_decay(0.9999, false, 0), 0.9999);
        assert!((ema_decay(0.9999, true, 0) - 0.1).abs() < 1e-12);
        assert!((ema_decay(0.9999, true, 10) - 11.0 / 20.0).abs() < 1e-12);
        assert_eq!(ema_decay(0.9999, true, 1_000_000), 0.9999);
    }

    #[test]
    fn shadow_moves_towards_the_weights() {
        let config = SsdConfig {
            num_classes: 1,
            image_size: [64, 64],
            depth_multiplier: 0.25,
            ..Default::default()
        };
        let device = Default::default();
        let a = config.init::<Flex>(1, &device).unwrap();
        // the same parameters (same ids) shifted by one
        struct AddOne;
        impl ModuleMapper<Flex> for AddOne {
            fn map_float<const D: usize>(
                &mut self,
                p: Param<Tensor<Flex, D>>,
            ) -> Param<Tensor<Flex, D>> {
                p.map(|t| t.add_scalar(1.0))
            }
        }
        let b = a.clone().map(&mut AddOne);
        let w0 = a
            .backbone
            .conv0
            .conv
            .weight
            .val()
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        let w1 = b
            .backbone
            .conv0
            .conv
            .weight
            .val()
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        let gamma_id = a.backbone.conv0.bn.gamma.id;
        let trainable: HashSet<ParamId> = [a.backbone.conv0.conv.weight.id].into();
        let ema = Ema::new(a, 0.9999, true, trainable).update(&b, 10);
        // d = 11 / 20: shadow = w0 - 0.45 (w0 - w1)
        let s = ema
            .shadow()
            .backbone
            .conv0
            .conv
            .weight
            .val()
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        for ((s, a), b) in s.iter().zip(&w0).zip(&w1) {
            assert!((s - (a - 0.45 * (a - b))).abs() < 1e-6);
        }
        // a parameter outside the trainable set is copied: gamma 1 -> 2
        assert_eq!(ema.shadow().backbone.conv0.bn.gamma.id, gamma_id);
        let gamma = ema
            .shadow()
            .backbone
            .conv0
            .bn
            .gamma
            .val()
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        assert!(gamma.iter().all(|g| *g == 2.0));
    }
}
