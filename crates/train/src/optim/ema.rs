//! Weight exponential moving average as `tf.train.ExponentialMovingAverage`:
//! `shadow <- shadow - (1 - d) (shadow - w)` over the trainable weights, with the constant
//! `d = decay`, as the API's optimizer builder sets it up (it passes no `num_updates`), or with
//! `warmup`, `d = min(decay, (1 + n) / (10 + n))` after `n` updates (`num_updates` given).
//! BatchNorm moving statistics are taken as they are (TF does not average non-trainable
//! variables).

use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
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

/// One update of the shadow weights, fed the new value of each weight in turn
/// ([`Averaging::add`]): the optimizer feeds each weight right after updating it, so that
/// on a fusion backend the update and the average of one weight, queued one after the
/// other, run as one kernel.
pub struct Averaging<B: Backend> {
    ema: Ema<B>,
    /// The shadow values of the trainable parameters not yet fed.
    before: HashMap<ParamId, FloatTensor<B>>,
    /// The new shadow values. Kept as primitives, of any rank: a reshape of a weight
    /// between its update and its average would keep a fusion backend from joining them.
    after: HashMap<ParamId, FloatTensor<B>>,
    keep: f32,
}

impl<B: SsdBackend> Averaging<B> {
    /// Takes the new value of parameter `id`: a trainable parameter's shadow moves towards
    /// it, any other parameter's shadow becomes a copy of it.
    pub fn add<const D: usize>(&mut self, id: ParamId, value: Tensor<B, D>) {
        let shadow = match self.before.remove(&id) {
            Some(before) => {
                let before = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(before));
                let value = value.to_device(&before.device());
                moving_average(before, value, 1.0, self.keep)
            }
            None => value,
        };
        self.after.insert(id, shadow.into_primitive().tensor());
    }

    /// The average with every value fed; parameters not fed keep their shadow.
    pub fn finish(self) -> Ema<B> {
        let mut ema = self.ema;
        ema.shadow = ema.shadow.map(&mut Replace { after: self.after });
        ema
    }
}

struct Collect<'a, B: Backend> {
    trainable: &'a HashSet<ParamId>,
    values: HashMap<ParamId, FloatTensor<B>>,
}

impl<B: Backend> ModuleVisitor<B> for Collect<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.trainable.contains(&param.id) {
            let value = param.val().into_primitive().tensor();
            self.values.insert(param.id, value);
        }
    }
}

struct Replace<B: Backend> {
    after: HashMap<ParamId, FloatTensor<B>>,
}

impl<B: Backend> ModuleMapper<B> for Replace<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        match self.after.remove(&param.id) {
            Some(after) => param.map(|_| Tensor::from_primitive(TensorPrimitive::Float(after))),
            None => param,
        }
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

    /// The update that follows `num_updates` optimizer steps, to be fed the new weights.
    pub fn averaging(self, num_updates: u64) -> Averaging<B> {
        let mut collect = Collect {
            trainable: &self.trainable,
            values: HashMap::new(),
        };
        self.shadow.visit(&mut collect);
        let before = collect.values;
        Averaging {
            keep: ema_decay(self.decay, self.warmup, num_updates) as f32,
            ema: self,
            before,
            after: HashMap::new(),
        }
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
        // fed in the network's order, as the optimizer feeds it
        struct Feed<'a>(&'a mut Averaging<Flex>);
        impl ModuleVisitor<Flex> for Feed<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<Flex, D>>) {
                self.0.add(p.id, p.val());
            }
        }
        let mut averaging = Ema::new(a, 0.9999, true, trainable).averaging(10);
        b.visit(&mut Feed(&mut averaging));
        let ema = averaging.finish();
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
