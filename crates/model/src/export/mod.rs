//! Deployment formats: the inference network (BatchNorm folded into the convolutions, the
//! moving statistics of the weights given) written for the runtimes SSD-MobileNet-v1 is
//! deployed with.
//!
//! - [`tflite`]: a `.tflite` flatbuffer in the layout of the API's TFLite export, with the
//!   `TFLite_Detection_PostProcess` op, as the TFLite object detection apps read it: float32,
//!   or int8 with the activation ranges [`quantize`] calibrates.
//! - [`onnx`]: an ONNX model (opset 13) giving the raw outputs and the decoded boxes.
//!
//! Both take the input `[batch, height, width, 3]`, RGB, already scaled to `[-1, 1]` as
//! `(2 / 255) x - 1` (the resizing and scaling of [`crate::preprocess`] left to the caller).

mod network;
pub mod onnx;
pub mod onnx_proto;
pub mod quantize;
pub mod tflite;

pub use onnx::{to_onnx, write_onnx};
pub use quantize::Calibration;
pub use tflite::{InputType, PostProcessOptions, Precision, to_tflite, write_tflite};
