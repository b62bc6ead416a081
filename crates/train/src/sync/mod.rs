//! Gradient synchronisation between replicas: the in-process all-reduce ([`all_reduce`]), the
//! bucketing of gradients for the exchange ([`buckets`]), the multi-node transport
//! ([`cluster`]), the path tensors take between devices ([`transfer`]) and the replica state
//! that is compared or averaged ([`replica_state`]).

pub mod all_reduce;
pub mod buckets;
pub mod cluster;
pub mod replica_state;
pub mod transfer;

pub use all_reduce::{GradientSync, InProcessAllReduce, Mean, NodeExchange, pairwise_sum};
pub use buckets::{
    BUCKET_ELEMENTS, BucketLayout, Bucketing, flatten_gradients, unflatten_gradients,
};
pub use cluster::{Cluster, TOKEN_ENV, TcpExchange};
pub use replica_state::{bn_stats_flat, set_bn_stats_flat, weight_checksum};
pub use transfer::{HOST_STAGED_ENV, Transfer};
