//! The crate's integration tests, one binary (one link, one set of generic
//! instantiations) with a module per topic; `cargo test --test integration <module>::`
//! runs one topic.

mod common;
mod learner;
mod pipeline_config;
mod tf_checkpoint;
mod tf_step;
mod wgpu;
