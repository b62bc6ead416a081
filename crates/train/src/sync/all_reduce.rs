//! The in-process all-reduce: replicas of one process deposit their buckets, the sum is formed
//! in replica order on the first replica's device, and in a multi-node run that local sum is
//! handed to a [`NodeExchange`] (the multi-node transport) before every replica gets the mean.
//! Whatever every replica must agree on (the mean, its norm) is formed once and copied.

use std::sync::{Arc, Condvar, Mutex};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::transfer::Transfer;

/// The outcome of an exchange, the same on every replica: formed once, then copied.
#[derive(Debug, Clone)]
pub struct Mean<B: Backend> {
    /// The element-wise mean of the buckets over replicas.
    pub buckets: Vec<Tensor<B, 1>>,
    /// The squared L2 norm of the mean (the gradients' global norm, squared), when asked for.
    pub squared_norm: Option<Tensor<B, 1>>,
}

/// Averages gradient buckets over replicas.
pub trait GradientSync<B: Backend>: Send + Sync {
    /// Called by every replica once per step with its buckets (same count and sizes on every
    /// replica); returns the element-wise mean over replicas, identical for all of them. With
    /// `norm_before_tail` `Some(tail)`, also the squared norm of the mean, leaving out the
    /// last `tail` elements of the last bucket (values that ride with the gradients).
    fn all_reduce_mean(
        &self,
        replica: usize,
        buckets: Vec<Tensor<B, 1>>,
        norm_before_tail: Option<usize>,
    ) -> Result<Mean<B>, String>;

    /// Whether the caller is the only replica of the whole run: then the mean is its own
    /// gradients, and it need not call [`Self::all_reduce_mean`] at all.
    fn single_replica(&self) -> bool;

    /// Makes every pending and future call fail (a replica died): nobody waits forever.
    fn abort(&self, reason: String);
}

struct Round<B: Backend> {
    deposits: Vec<Option<Vec<Tensor<B, 1>>>>,
    result: Option<Arc<Mean<B>>>,
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
/// to every replica's device by the run's [`Transfer`] path. In a multi-node run that local
/// mean is then averaged over the machines (every machine has the same number of replicas)
/// before the replicas get it.
pub struct InProcessAllReduce<B: Backend> {
    replicas: usize,
    transfer: Transfer,
    nodes: Option<Arc<dyn NodeExchange>>,
    state: Mutex<Round<B>>,
    signal: Condvar,
}

impl<B: Backend> InProcessAllReduce<B> {
    /// A reducer for `replicas` participants whose tensors travel by `transfer`.
    pub fn new(replicas: usize, transfer: Transfer) -> Self {
        Self {
            replicas,
            transfer,
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
    pub fn across_nodes(replicas: usize, transfer: Transfer, nodes: Arc<dyn NodeExchange>) -> Self {
        Self {
            nodes: Some(nodes),
            ..Self::new(replicas, transfer)
        }
    }
}

/// The sum of the squares of `buckets`, leaving out the last `tail` elements of the last one.
fn squared_norm<B: Backend>(buckets: &[Tensor<B, 1>], tail: usize) -> Option<Tensor<B, 1>> {
    let last = buckets.len().checked_sub(1)?;
    buckets
        .iter()
        .enumerate()
        .filter_map(|(i, b)| {
            let len = b.dims()[0] - if i == last { tail } else { 0 };
            (len > 0).then(|| b.clone().narrow(0, 0, len).square().sum())
        })
        .reduce(|a, b| a + b)
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

impl<B: Backend> InProcessAllReduce<B> {
    /// The mean of every replica's deposit (and its norm when asked for), formed once, on the
    /// first replica's device, by the last replica to arrive.
    fn reduce(
        &self,
        deposits: Vec<Vec<Tensor<B, 1>>>,
        norm_before_tail: Option<usize>,
    ) -> Result<Mean<B>, String> {
        let root = deposits[0]
            .first()
            .map(|b| b.device())
            .ok_or("no gradients to exchange")?;
        let transfer = self.transfer;
        let sum = pairwise_sum(deposits, |a, b| {
            a.into_iter()
                .zip(b)
                .map(|(a, b)| a + transfer.to(b, &root))
                .collect()
        });
        let buckets = self.finish(sum)?;
        let squared_norm = norm_before_tail.and_then(|tail| squared_norm(&buckets, tail));
        Ok(Mean {
            buckets,
            squared_norm,
        })
    }

    /// Waits until the previous round's result has been taken by everyone, then checks that
    /// `sizes` match the other deposits of this round (a mismatch would never complete).
    fn wait_for_round(
        &self,
        replica: usize,
        sizes: &[usize],
    ) -> Result<std::sync::MutexGuard<'_, Round<B>>, String> {
        // a panic elsewhere never leaves the exchange unusable: recover the guard
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
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
        Ok(state)
    }
}

impl<B: Backend> GradientSync<B> for InProcessAllReduce<B> {
    fn all_reduce_mean(
        &self,
        replica: usize,
        buckets: Vec<Tensor<B, 1>>,
        norm_before_tail: Option<usize>,
    ) -> Result<Mean<B>, String> {
        if self.single_replica() {
            let squared_norm = norm_before_tail.and_then(|tail| squared_norm(&buckets, tail));
            return Ok(Mean {
                buckets,
                squared_norm,
            });
        }
        if self.replicas == 1 {
            return self.reduce(vec![buckets], norm_before_tail);
        }
        let device = buckets
            .first()
            .map(|b| b.device())
            .ok_or("no gradients to exchange")?;
        let sizes: Vec<usize> = buckets.iter().map(|b| b.dims()[0]).collect();
        let mut state = self.wait_for_round(replica, &sizes)?;
        state.deposits[replica] = Some(buckets);
        if state.deposits.iter().all(Option::is_some) {
            let all = state.deposits.iter_mut().flat_map(Option::take).collect();
            match self.reduce(all, norm_before_tail) {
                Ok(mean) => state.result = Some(Arc::new(mean)),
                Err(why) => state.aborted = Some(why),
            }
            self.signal.notify_all();
        }
        while state.result.is_none() && state.aborted.is_none() {
            state = self.signal.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        if let Some(why) = &state.aborted {
            return Err(why.clone());
        }
        let result = state.result.clone().expect("result present");
        state.taken += 1;
        if state.taken == self.replicas {
            state.result = None;
            state.taken = 0;
            self.signal.notify_all();
        }
        drop(state);
        let to_here = |t: &Tensor<B, 1>| self.transfer.to(t.clone(), &device);
        Ok(Mean {
            buckets: result.buckets.iter().map(to_here).collect(),
            squared_norm: result.squared_norm.as_ref().map(to_here),
        })
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
        let sync = Arc::new(InProcessAllReduce::<Flex>::new(3, Transfer::SameDevice));
        let handles: Vec<_> = (0..3)
            .map(|i| {
                let sync = sync.clone();
                std::thread::spawn(move || {
                    (0..5)
                        .map(|round| {
                            let v = (i * 10 + round) as f32;
                            let out = sync
                                .all_reduce_mean(i, vec![t(&[v, 1.0]), t(&[2.0 * v])], None)
                                .unwrap();
                            out.buckets
                                .into_iter()
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

    /// The norm of the mean leaves out the tail, and every replica gets the same value.
    #[test]
    fn the_squared_norm_of_the_mean_leaves_out_the_tail() {
        let sync = Arc::new(InProcessAllReduce::<Flex>::new(2, Transfer::SameDevice));
        let deposits = [[[2.0, 0.0], [8.0, 50.0]], [[4.0, 0.0], [0.0, 150.0]]];
        let handles: Vec<_> = deposits
            .into_iter()
            .enumerate()
            .map(|(i, [a, b])| {
                let sync = sync.clone();
                std::thread::spawn(move || {
                    let mean = sync
                        .all_reduce_mean(i, vec![t(&a), t(&b)], Some(1))
                        .unwrap();
                    let norm = mean.squared_norm.expect("asked for").into_scalar();
                    let last = mean.buckets[1].clone().into_data().to_vec::<f32>().unwrap();
                    (norm, last)
                })
            })
            .collect();
        for handle in handles {
            // mean [3, 0], [4, 100]: 100 is the tail
            assert_eq!(handle.join().unwrap(), (25.0, vec![4.0, 100.0]));
        }
    }

    #[test]
    fn abort_releases_waiting_replicas() {
        let sync = Arc::new(InProcessAllReduce::<Flex>::new(2, Transfer::SameDevice));
        let waiting = {
            let sync = sync.clone();
            std::thread::spawn(move || sync.all_reduce_mean(0, vec![t(&[1.0])], None))
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        sync.abort("replica 1 failed: out of memory".into());
        let err = waiting.join().unwrap().unwrap_err();
        assert!(err.contains("replica 1 failed"), "{err}");
        assert!(sync.all_reduce_mean(1, vec![t(&[1.0])], None).is_err());
    }

    #[test]
    fn mismatched_layouts_fail_instead_of_hanging() {
        let sync = Arc::new(InProcessAllReduce::<Flex>::new(2, Transfer::SameDevice));
        let first = {
            let sync = sync.clone();
            std::thread::spawn(move || sync.all_reduce_mean(0, vec![t(&[1.0, 2.0])], None))
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            sync.all_reduce_mean(1, vec![t(&[1.0])], None)
                .unwrap_err()
                .contains("sizes")
        );
        assert!(first.join().unwrap().is_err());
    }
}
