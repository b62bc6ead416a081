//! Gradient synchronisation between replicas: the in-process all-reduce, which hands its sum
//! to a [`NodeExchange`] (crate::cluster) in multi-node runs. Between devices or machines
//! gradients travel as a few large flat buckets, not one round-trip per tensor; replicas on
//! one device hand over each tensor as it is ([`Bucketing`]).

use std::sync::{Arc, Condvar, Mutex};

use burn::module::{ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use model::Ssd;

/// Averages gradient buckets over replicas.
pub trait GradientSync<B: Backend>: Send + Sync {
    /// Called by every replica once per step with its buckets (same count and sizes on every
    /// replica); returns the element-wise mean over replicas, identical for all of them.
    fn all_reduce_mean(
        &self,
        replica: usize,
        buckets: Vec<Tensor<B, 1>>,
    ) -> Result<Vec<Tensor<B, 1>>, String>;

    /// Whether the caller is the only replica of the whole run: then the mean is its own
    /// gradients, and it need not call [`Self::all_reduce_mean`] at all.
    fn single_replica(&self) -> bool;

    /// Makes every pending and future call fail (a replica died): nobody waits forever.
    fn abort(&self, reason: String);
}

struct Round<B: Backend> {
    deposits: Vec<Option<Vec<Tensor<B, 1>>>>,
    result: Option<Arc<Vec<Tensor<B, 1>>>>,
    taken: usize,
    aborted: Option<String>,
}

/// Sums values over the machines of a multi-node run.
pub trait NodeExchange: Send + Sync {
    /// Number of machines.
    fn nodes(&self) -> usize;

    /// Called by one thread per machine with that machine's sum (the same length on every
    /// machine); returns the sum over the machines, formed by [`pairwise_sum`] in rank order,
    /// identical on all of them.
    fn sum_over_nodes(&self, values: Vec<f32>) -> Result<Vec<f32>, String>;
}

/// Sums `items` as a balanced tree in order: `((a + b) + (c + d)) + e`. Replicas on several
/// machines sum their local group first and then the machines' sums; with this order (and
/// equal power-of-two groups) that is exactly the sum one machine forms over all of them, so
/// a multi-node run reproduces a single-node run bit for bit.
pub fn pairwise_sum<T>(mut items: Vec<T>, add: impl Fn(T, T) -> T) -> T {
    assert!(!items.is_empty(), "nothing to sum");
    while items.len() > 1 {
        let mut next = Vec::with_capacity(items.len().div_ceil(2));
        let mut it = items.into_iter();
        while let Some(a) = it.next() {
            next.push(match it.next() {
                Some(b) => add(a, b),
                None => a,
            });
        }
        items = next;
    }
    items.pop().expect("one left")
}

/// All-reduce between threads of one process: the sum is formed on the first replica's
/// device in replica order (so it is deterministic), divided by the replica count, and copied
/// to every replica's device. In a multi-node run that local mean is then averaged over the
/// machines (every machine has the same number of replicas) before the replicas get it.
pub struct InProcessAllReduce<B: Backend> {
    replicas: usize,
    nodes: Option<Arc<dyn NodeExchange>>,
    state: Mutex<Round<B>>,
    signal: Condvar,
}

impl<B: Backend> InProcessAllReduce<B> {
    /// A reducer for `replicas` participants.
    pub fn new(replicas: usize) -> Self {
        Self {
            replicas,
            nodes: None,
            state: Mutex::new(Round {
                deposits: vec![None; replicas],
                result: None,
                taken: 0,
                aborted: None,
            }),
            signal: Condvar::new(),
        }
    }

    /// A reducer for `replicas` local participants whose mean is averaged over machines by
    /// `nodes`.
    pub fn across_nodes(replicas: usize, nodes: Arc<dyn NodeExchange>) -> Self {
        Self {
            nodes: Some(nodes),
            ..Self::new(replicas)
        }
    }
}

impl<B: Backend> InProcessAllReduce<B> {
    /// The mean over every replica of every machine, from this machine's sum.
    fn finish(&self, sum: Vec<Tensor<B, 1>>) -> Result<Vec<Tensor<B, 1>>, String> {
        let Some(nodes) = &self.nodes else {
            let n = self.replicas as f64;
            return Ok(sum.into_iter().map(|s| s.div_scalar(n)).collect());
        };
        let device = sum
            .first()
            .map(|b| b.device())
            .ok_or("no gradients to exchange")?;
        let sizes: Vec<usize> = sum.iter().map(|b| b.dims()[0]).collect();
        let flat = Tensor::cat(sum, 0)
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| format!("{e:?}"))?;
        let total = nodes.sum_over_nodes(flat)?;
        let n = (self.replicas * nodes.nodes()) as f64;
        let mut offset = 0;
        Ok(sizes
            .into_iter()
            .map(|len| {
                let part = total[offset..offset + len].to_vec();
                offset += len;
                Tensor::<B, 1>::from_data(TensorData::new(part, [len]), &device).div_scalar(n)
            })
            .collect())
    }
}

impl<B: Backend> GradientSync<B> for InProcessAllReduce<B> {
    fn all_reduce_mean(
        &self,
        replica: usize,
        buckets: Vec<Tensor<B, 1>>,
    ) -> Result<Vec<Tensor<B, 1>>, String> {
        if self.single_replica() {
            return Ok(buckets);
        }
        if self.replicas == 1 {
            return self.finish(buckets);
        }
        let device = buckets
            .first()
            .map(|b| b.device())
            .ok_or("no gradients to exchange")?;
        let sizes: Vec<usize> = buckets.iter().map(|b| b.dims()[0]).collect();
        // a panic elsewhere never leaves the exchange unusable: recover the guard
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        // wait until the previous round's result has been taken by everyone
        while state.result.is_some() && state.aborted.is_none() {
            state = self.signal.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        if let Some(why) = &state.aborted {
            return Err(why.clone());
        }
        if let Some(other) = state.deposits.iter().flatten().next() {
            let theirs: Vec<usize> = other.iter().map(|b| b.dims()[0]).collect();
            if theirs != sizes {
                let why = format!(
                    "replica {replica} sent gradient buckets of sizes {sizes:?}, another {theirs:?}"
                );
                state.aborted = Some(why.clone());
                self.signal.notify_all();
                return Err(why);
            }
        }
        state.deposits[replica] = Some(buckets);
        if state.deposits.iter().all(Option::is_some) {
            let all: Vec<Vec<Tensor<B, 1>>> = state
                .deposits
                .iter_mut()
                .map(|d| d.take().expect("all deposited"))
                .collect();
            let root = all[0][0].device();
            let sum = pairwise_sum(all, |a, b| {
                a.into_iter()
                    .zip(b)
                    .map(|(a, b)| a + b.to_device(&root))
                    .collect()
            });
            let mean = match self.finish(sum) {
                Ok(mean) => mean,
                Err(why) => {
                    state.aborted = Some(why.clone());
                    self.signal.notify_all();
                    return Err(why);
                }
            };
            state.result = Some(Arc::new(mean));
            self.signal.notify_all();
        } else {
            while state.result.is_none() && state.aborted.is_none() {
                state = self.signal.wait(state).unwrap_or_else(|e| e.into_inner());
            }
            if let Some(why) = &state.aborted {
                return Err(why.clone());
            }
        }
        let result = state.result.clone().expect("result present");
        state.taken += 1;
        if state.taken == self.replicas {
            state.result = None;
            state.taken = 0;
            self.signal.notify_all();
        }
        drop(state);
        Ok(result
            .iter()
            .map(|t| t.clone().to_device(&device))
            .collect())
    }

    fn single_replica(&self) -> bool {
        self.replicas == 1 && self.nodes.is_none()
    }

    fn abort(&self, reason: String) {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .aborted
            .get_or_insert(reason);
        self.signal.notify_all();
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    fn t(v: &[f32]) -> Tensor<Flex, 1> {
        Tensor::from_data(TensorData::new(v.to_vec(), [v.len()]), &Default::default())
    }

    #[test]
    fn all_reduce_averages_over_threads() {
        let sync = Arc::new(InProcessAllReduce::<Flex>::new(3));
        let handles: Vec<_> = (0..3)
            .map(|i| {
                let sync = sync.clone();
                std::thread::spawn(move || {
                    (0..5)
                        .map(|round| {
                            let v = (i * 10 + round) as f32;
                            let out = sync
                                .all_reduce_mean(i, vec![t(&[v, 1.0]), t(&[2.0 * v])])
                                .unwrap();
                            out.into_iter()
                                .flat_map(|b| b.into_data().to_vec::<f32>().unwrap())
                                .collect::<Vec<_>>()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for round in 0..5 {
            let mean = 10.0 + round as f32;
            for r in &results {
                assert_eq!(r[round], vec![mean, 1.0, 2.0 * mean]);
            }
        }
    }

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

    #[test]
    fn abort_releases_waiting_replicas() {
        let sync = Arc::new(InProcessAllReduce::<Flex>::new(2));
        let waiting = {
            let sync = sync.clone();
            std::thread::spawn(move || sync.all_reduce_mean(0, vec![t(&[1.0])]))
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        sync.abort("replica 1 failed: out of memory".into());
        let err = waiting.join().unwrap().unwrap_err();
        assert!(err.contains("replica 1 failed"), "{err}");
        assert!(sync.all_reduce_mean(1, vec![t(&[1.0])]).is_err());
    }

    #[test]
    fn mismatched_layouts_fail_instead_of_hanging() {
        let sync = Arc::new(InProcessAllReduce::<Flex>::new(2));
        let first = {
            let sync = sync.clone();
            std::thread::spawn(move || sync.all_reduce_mean(0, vec![t(&[1.0, 2.0])]))
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            sync.all_reduce_mean(1, vec![t(&[1.0])])
                .unwrap_err()
                .contains("sizes")
        );
        assert!(first.join().unwrap().is_err());
    }
}
