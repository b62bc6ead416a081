//! The crate's integration tests, one binary (one link, one set of generic
//! instantiations) with a module per topic; `cargo test --test integration <module>::`
//! runs one topic.

mod bad_inputs;
mod coco;
mod common;
mod pipeline;
