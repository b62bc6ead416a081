//! The in-process all-reduce: replicas of one process deposit their buckets, the sum is formed
//! in replica order on the first replica's device, and in a multi-node run that local sum is
//! summed over the processes, on the device by a [`DeviceExchange`] (NCCL) or through host
//! memory by a [`NodeExchange`] (MPI), before every replica gets the mean.
//! Whatever every replica must agree on (the mean, its norm) is formed once and copied to
//! every replica's device before any replica goes on.

use std::sync::{Arc, Condvar, Mutex};

use burn::tensor::backend::{Backend, BackendTypes};
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
    /// Each replica's copy of the mean, on its own device, taken by that replica.
    result: Option<Vec<Option<Mean<B>>>>,
    taken: usize,
    aborted: Option<String>,
}

/// Moves a tensor to a device: the run's [`Transfer`] path (a recorder in tests).
type CopyTo<B> =
    Arc<dyn Fn(Tensor<B, 1>, &<B as BackendTypes>::Device) -> Tensor<B, 1> + Send + Sync>;

/// Sums values over the machines of a multi-node run.
pub trait NodeExchange: Send + Sync {
    /// Number of machines.
    fn nodes(&self) -> usize;

    /// Called by one thread per machine with that machine's sum (the same length on every
    /// machine); returns the sum over the machines, identical on all of them.
    fn sum_over_nodes(&self, values: Vec<f32>) -> Result<Vec<f32>, String>;
}

/// Sums a flat tensor over the machines of a multi-node run where it lies (NCCL on the GPUs),
/// instead of through host memory.
pub trait DeviceExchange<B: Backend>: Send + Sync {
    /// Called by one thread per machine with that machine's sum (the same length on every
    /// machine, a tensor nothing else holds: it may be summed in place); returns the sum over
    /// the machines, identical on all of them, on the same device.
    fn sum_over_nodes(&self, sum: Tensor<B, 1>) -> Result<Tensor<B, 1>, String>;
}

/// Sums `items` as a balanced tree in order: `((a + b) + (c + d)) + e`: deterministic, and
/// with two machines of equal power-of-two groups (whose sum over machines is `a + b`) a
/// multi-node run reproduces a single-node run bit for bit.
fn pairwise_sum<T>(mut items: Vec<T>, add: impl Fn(T, T) -> T) -> T {
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

/// `pairwise_sum` of items that lie on several devices: every item but the first is first
/// moved to the first one's device by `to_root` (Burn adds tensors on one device only).
pub fn pairwise_sum_on_first<T>(
    items: Vec<T>,
    to_root: impl Fn(T) -> T,
    add: impl Fn(T, T) -> T,
) -> T {
    let on_root = items
        .into_iter()
        .enumerate()
        .map(|(i, item)| if i == 0 { item } else { to_root(item) })
        .collect();
    pairwise_sum(on_root, add)
}

/// All-reduce between threads of one process: the sum is formed on the first replica's
/// device in replica order (so it is deterministic), divided by the replica count, and copied
/// to every replica's device by the run's [`Transfer`] path. In a multi-node run the local
/// sum is summed over the machines and divided by the replica count of the whole run (the
/// machines may have different numbers of replicas) before the replicas get it.
///
/// The thread that forms the mean also copies it to every replica's device before any
/// replica returns: a replica that went on to queue its update while another still read the
/// mean from its device would have that queue drained at an arbitrary point (under Burn's
/// fusion a read drains the queue of the thread that made the tensor), and where the
/// compiler contracts multiply-adds another cut of the fused kernels can change the last
/// bits of one replica's update.
pub struct InProcessAllReduce<B: Backend> {
    replicas: usize,
    /// The replicas of the whole run: the divisor of the mean.
    total_replicas: usize,
    copy_to: CopyTo<B>,
    nodes: Option<Arc<dyn NodeExchange>>,
    /// Where set, the sum over the machines is formed on the device instead of by `nodes`.
    on_device: Option<Arc<dyn DeviceExchange<B>>>,
    state: Mutex<Round<B>>,
    signal: Condvar,
}

impl<B: Backend> InProcessAllReduce<B> {
    /// A reducer for `replicas` participants whose tensors travel by `transfer`.
    pub fn new(replicas: usize, transfer: Transfer) -> Self {
        Self::with_copy(
            replicas,
            Arc::new(move |tensor, device| transfer.to(tensor, device)),
        )
    }

    fn with_copy(replicas: usize, copy_to: CopyTo<B>) -> Self {
        Self {
            replicas,
            total_replicas: replicas,
            copy_to,
            nodes: None,
            on_device: None,
            state: Mutex::new(Round {
                deposits: vec![None; replicas],
                result: None,
                taken: 0,
                aborted: None,
            }),
            signal: Condvar::new(),
        }
    }

    /// A reducer for `replicas` local participants of `total_replicas` over all machines,
    /// whose sum is summed over the machines by `on_device` where given, else by `nodes`
    /// through host memory.
    pub fn across_nodes(
        (replicas, total_replicas): (usize, usize),
        transfer: Transfer,
        nodes: Arc<dyn NodeExchange>,
        on_device: Option<Arc<dyn DeviceExchange<B>>>,
    ) -> Self {
        Self {
            nodes: Some(nodes),
            on_device,
            total_replicas,
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
    /// The mean over every replica of every machine, from this machine's sum. Between
    /// machines the buckets travel as one flat tensor (one call of the exchange), and the
    /// values that ride at the end of the last bucket (loss parts, stop requests) with them.
    fn finish(&self, sum: Vec<Tensor<B, 1>>) -> Result<Vec<Tensor<B, 1>>, String> {
        let Some(nodes) = &self.nodes else {
            let n = self.replicas as f64;
            return Ok(sum.into_iter().map(|s| s.div_scalar(n)).collect());
        };
        let sizes: Vec<usize> = sum.iter().map(|b| b.dims()[0]).collect();
        // a fresh tensor that nothing else holds (Burn's CUDA backend copies even a lone
        // bucket into a new buffer): the device exchange may sum it in place
        let flat = Tensor::cat(sum, 0);
        let total = match &self.on_device {
            Some(exchange) => exchange.sum_over_nodes(flat)?,
            None => sum_through_host(nodes.as_ref(), flat)?,
        };
        let n = self.total_replicas as f64;
        let mut offset = 0;
        Ok(sizes
            .into_iter()
            .map(|len| {
                let part = total.clone().narrow(0, offset, len);
                offset += len;
                part.div_scalar(n)
            })
            .collect())
    }
}

/// `flat` summed over the machines by `nodes` through host memory, back on its device.
fn sum_through_host<B: Backend>(
    nodes: &dyn NodeExchange,
    flat: Tensor<B, 1>,
) -> Result<Tensor<B, 1>, String> {
    let device = flat.device();
    let values = flat
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| format!("{e:?}"))?;
    let len = values.len();
    let total = nodes.sum_over_nodes(values)?;
    Ok(Tensor::from_data(TensorData::new(total, [len]), &device))
}

impl<B: Backend> InProcessAllReduce<B> {
    /// The mean of every replica's deposit (and its norm when asked for), formed once, on the
    /// first replica's device, by the last replica to arrive, and copied to every replica's
    /// device (in replica order).
    fn reduce(
        &self,
        deposits: Vec<Vec<Tensor<B, 1>>>,
        norm_before_tail: Option<usize>,
    ) -> Result<Vec<Option<Mean<B>>>, String> {
        let devices = deposits
            .iter()
            .map(|d| d.first().map(|b| b.device()))
            .collect::<Option<Vec<_>>>()
            .ok_or("no gradients to exchange")?;
        let root = &devices[0];
        let sum = pairwise_sum_on_first(
            deposits,
            |d| d.into_iter().map(|b| (self.copy_to)(b, root)).collect(),
            |a, b| a.into_iter().zip(b).map(|(a, b)| a + b).collect(),
        );
        let buckets = self.finish(sum)?;
        let squared_norm = norm_before_tail.and_then(|tail| squared_norm(&buckets, tail));
        let mean = Mean {
            buckets,
            squared_norm,
        };
        Ok(devices
            .iter()
            .map(|device| Some(self.copy_mean(&mean, device)))
            .collect())
    }

    /// `mean` on `device`.
    fn copy_mean(&self, mean: &Mean<B>, device: &B::Device) -> Mean<B> {
        let copy = |t: &Tensor<B, 1>| (self.copy_to)(t.clone(), device);
        Mean {
            buckets: mean.buckets.iter().map(copy).collect(),
            squared_norm: mean.squared_norm.as_ref().map(copy),
        }
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
            let mut mine = self.reduce(vec![buckets], norm_before_tail)?;
            return Ok(mine.pop().flatten().expect("one replica's mean"));
        }
        let sizes: Vec<usize> = buckets.iter().map(|b| b.dims()[0]).collect();
        let mut state = self.wait_for_round(replica, &sizes)?;
        state.deposits[replica] = Some(buckets);
        if state.deposits.iter().all(Option::is_some) {
            let all = state.deposits.iter_mut().flat_map(Option::take).collect();
            match self.reduce(all, norm_before_tail) {
                Ok(means) => state.result = Some(means),
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
        let mine = state
            .result
            .as_mut()
            .and_then(|means| means[replica].take())
            .ok_or_else(|| format!("replica {replica} took the mean of this round twice"))?;
        state.taken += 1;
        if state.taken == self.replicas {
            state.result = None;
            state.taken = 0;
            self.signal.notify_all();
        }
        Ok(mine)
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

    /// Four and more devices: the second pair's left operand lies on its own device, so every
    /// item but the first goes to the first one's device before any addition.
    #[test]
    fn a_sum_over_several_devices_adds_on_the_first_device_only() {
        for devices in 2..=8usize {
            // (value, device): adding across devices is refused, as Burn refuses it
            let items: Vec<(f32, usize)> = (0..devices).map(|d| (d as f32, d)).collect();
            let moved = std::sync::Mutex::new(Vec::new());
            let (sum, device) = pairwise_sum_on_first(
                items,
                |(v, d)| {
                    moved.lock().unwrap().push(d);
                    (v, 0)
                },
                |(a, da), (b, db)| {
                    assert_eq!(da, db, "an addition across devices");
                    (a + b, da)
                },
            );
            assert_eq!((sum, device), ((devices * (devices - 1) / 2) as f32, 0));
            assert_eq!(*moved.lock().unwrap(), (1..devices).collect::<Vec<_>>());
        }
    }

    /// No replica returns before every replica's copy of the mean has been made: each copy
    /// takes longer than the one before, and every replica, when it returns, finds every copy
    /// of the round done (deposits to the first device and the mean to each device).
    #[test]
    fn no_replica_goes_on_before_every_replica_holds_the_mean() {
        let replicas = 4;
        let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let copy_to: CopyTo<Flex> = {
            let (done, calls) = (done.clone(), calls.clone());
            Arc::new(move |t, _| {
                let k = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                std::thread::sleep(std::time::Duration::from_millis(10 * k as u64));
                done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                t
            })
        };
        let sync = Arc::new(InProcessAllReduce::<Flex>::with_copy(replicas, copy_to));
        let handles: Vec<_> = (0..replicas)
            .map(|i| {
                let (sync, done) = (sync.clone(), done.clone());
                std::thread::spawn(move || {
                    let mean = sync.all_reduce_mean(i, vec![t(&[i as f32])], None).unwrap();
                    let seen = done.load(std::sync::atomic::Ordering::SeqCst);
                    (seen, mean.buckets[0].clone().into_scalar())
                })
            })
            .collect();
        // three deposits to the first device, the mean to each of the four
        let copies = (replicas - 1) + replicas;
        for handle in handles {
            assert_eq!(handle.join().unwrap(), (copies, 1.5));
        }
    }

    /// A second machine with the same sums: through the host or on the device (its lengths
    /// recorded), the sum over the machines is twice this machine's.
    struct Twin(Mutex<Vec<usize>>);

    impl NodeExchange for Twin {
        fn nodes(&self) -> usize {
            2
        }

        fn sum_over_nodes(&self, values: Vec<f32>) -> Result<Vec<f32>, String> {
            self.0.lock().unwrap().push(values.len());
            Ok(values.iter().map(|v| v * 2.0).collect())
        }
    }

    impl DeviceExchange<Flex> for Twin {
        fn sum_over_nodes(&self, sum: Tensor<Flex, 1>) -> Result<Tensor<Flex, 1>, String> {
            self.0.lock().unwrap().push(sum.dims()[0]);
            Ok(sum.clone() + sum)
        }
    }

    /// Between machines the buckets travel as one flat tensor, by the device exchange where
    /// there is one (the host path then unused), else through the host, with the same mean.
    #[test]
    fn the_sum_over_machines_is_one_call_on_the_device_where_it_can() {
        for on_device in [false, true] {
            let (host, device) = (
                Arc::new(Twin(Mutex::default())),
                Arc::new(Twin(Mutex::default())),
            );
            let device_exchange =
                on_device.then(|| device.clone() as Arc<dyn DeviceExchange<Flex>>);
            let sync = Arc::new(InProcessAllReduce::<Flex>::across_nodes(
                (2, 4),
                Transfer::SameDevice,
                host.clone(),
                device_exchange,
            ));
            let handles: Vec<_> = [1.0f32, 3.0]
                .into_iter()
                .enumerate()
                .map(|(i, v)| {
                    let sync = sync.clone();
                    std::thread::spawn(move || {
                        let mean = sync
                            .all_reduce_mean(i, vec![t(&[v, 1.0]), t(&[2.0 * v])], None)
                            .unwrap();
                        mean.buckets
                            .into_iter()
                            .map(|b| b.into_data().to_vec::<f32>().unwrap())
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            for handle in handles {
                // sums [4, 2], [8] over the replicas, twice that over the machines, over 4
                assert_eq!(handle.join().unwrap(), [vec![2.0, 1.0], vec![4.0]]);
            }
            let calls = |twin: &Twin| twin.0.lock().unwrap().clone();
            let (used, unused) = if on_device {
                (&device, &host)
            } else {
                (&host, &device)
            };
            assert_eq!(
                calls(used),
                [3],
                "one call with both buckets (on_device {on_device})"
            );
            assert!(calls(unused).is_empty(), "on_device {on_device}");
        }
    }

    /// A second machine with one replica, which deposited `peer`.
    struct OneReplicaPeer(f32);

    impl NodeExchange for OneReplicaPeer {
        fn nodes(&self) -> usize {
            2
        }

        fn sum_over_nodes(&self, values: Vec<f32>) -> Result<Vec<f32>, String> {
            Ok(values.iter().map(|v| v + self.0).collect())
        }
    }

    /// Machines with different numbers of replicas (`mpirun -H a:2,b:1`): the mean is over
    /// every replica of the run, the same on every machine, not over this machine's count
    /// times the machines.
    #[test]
    fn the_mean_is_over_the_replicas_of_every_machine() {
        let sync = Arc::new(InProcessAllReduce::<Flex>::across_nodes(
            (2, 3),
            Transfer::SameDevice,
            Arc::new(OneReplicaPeer(5.0)),
            None,
        ));
        let handles: Vec<_> = [1.0f32, 3.0]
            .into_iter()
            .enumerate()
            .map(|(i, v)| {
                let sync = sync.clone();
                std::thread::spawn(move || {
                    let mean = sync.all_reduce_mean(i, vec![t(&[v])], None).unwrap();
                    mean.buckets[0].clone().into_scalar()
                })
            })
            .collect();
        for handle in handles {
            assert_eq!(handle.join().unwrap(), 3.0, "(1 + 3 + 5) / 3");
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
