//! Gradient synchronisation between replicas: the in-process all-reduce ([`all_reduce`]), the
//! bucketing of gradients for the exchange ([`buckets`]), the launcher of a multi-process job
//! ([`launcher`]) and the exchange between its processes (`mpi`, with the `mpi` feature, and
//! `nccl` on CUDA GPUs, with the `cuda` feature too), the path tensors take between devices
//! ([`transfer`]), start-up checks that must not take the run down (`watchdog`) and the
//! replica state that is compared or averaged ([`replica_state`]).

pub mod all_reduce;
pub mod buckets;
pub mod deadline;
pub mod launcher;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(all(feature = "cuda", feature = "mpi"))]
pub mod nccl;
pub mod replica_state;
pub mod transfer;
mod watchdog;

use std::sync::Arc;

use burn::tensor::backend::Backend;

pub use all_reduce::{DeviceExchange, GradientSync, InProcessAllReduce, Mean, NodeExchange};
pub use buckets::{
    BUCKET_ELEMENTS, BucketLayout, Bucketing, flatten_gradients, unflatten_gradients,
};
pub use launcher::Launch;
pub use replica_state::{
    bn_stats_flat, ranges_flat, set_bn_stats_flat, set_ranges_flat, weight_checksum,
};
pub use transfer::{HOST_STAGED_ENV, Transfer};

/// This process's place in a multi-node run (one process per machine, or per GPU) and the
/// exchange between the processes.
#[derive(Clone)]
pub struct Nodes {
    /// This process's rank; rank 0 writes the model dir and evaluates.
    pub rank: usize,
    /// Sums over the processes.
    pub exchange: Arc<dyn NodeExchange>,
    /// The longest wait for the other processes in an exchange (`--node-timeout`).
    pub timeout: std::time::Duration,
}

impl std::fmt::Debug for Nodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "process {} of {}", self.rank, self.count())
    }
}

impl Nodes {
    /// Processes in the run.
    pub fn count(&self) -> usize {
        self.exchange.nodes()
    }
}

/// The exchange between the processes on the devices themselves (NCCL on CUDA GPUs), or why
/// their sums go through host memory (MPI) instead: the same answer on every process. Every
/// process of the job calls it at the same point, with its first replica's device.
pub fn device_exchange<B: Backend>(
    device: &B::Device,
    nodes: &Nodes,
) -> Result<Arc<dyn DeviceExchange<B>>, String> {
    #[cfg(all(feature = "cuda", feature = "mpi"))]
    return nccl::connect::<B>(device, nodes);
    #[cfg(not(all(feature = "cuda", feature = "mpi")))]
    {
        let _ = (device, nodes);
        Err("NCCL between the processes needs a build with both the cuda and mpi features".into())
    }
}
