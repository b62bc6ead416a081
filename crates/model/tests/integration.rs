//! The crate's integration tests, one binary (one link, one set of generic
//! instantiations) with a module per topic; `cargo test --test integration <module>::`
//! runs one topic.

mod export;
mod generic_backend;
mod network;
mod overfit;
mod portable;
mod restore;
mod tf_bundle;
