//! TensorFlow's side: its checkpoint format and the API's variable names of this network.

pub mod bundle;
pub mod names;
