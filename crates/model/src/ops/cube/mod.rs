//! The GPU backends' own kernels, written once in CubeCL for CUDA and wgpu, each compiled once
//! per float type whatever the layer's shape: the depthwise convolution and its gradients
//! ([`depthwise`]), which Burn without autotuning runs as grouped direct convolutions compiled
//! per layer geometry (and, for the gradients, as transposed and dilated ones); training-mode
//! BatchNorm + ReLU6 and its backward pass ([`batch_norm`]), two launches each way where
//! Burn's operations take separate reductions and fused element-wise kernels around them;
//! the optimizer's per-parameter arithmetic ([`updates`]), which fusion would join into a
//! different kernel for every group of parameters. The 3x3 dense layers' input gradients
//! take Burn's transposed convolution as a matrix product and `col2im`, the variant its
//! autotuning picks, instead of the direct kernel Burn takes without. Burn's fusion wrapper
//! hands them to the backend underneath as custom operations (`fusion`).

pub mod batch_norm;
pub mod depthwise;
mod fusion;
mod sums;
pub mod updates;

use burn::tensor::TensorMetadata;
use burn::tensor::ops::FloatTensor;
use burn_cubecl::kernel::conv::{ConvTranspose2dStrategy, conv_transpose2d};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::{BatchNormGrads, BatchNormOutput, RmsPropState, RmsPropStep, SsdBackend, reference};

impl<R, F, I, BT> SsdBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn depthwise_conv(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        stride: usize,
    ) -> FloatTensor<Self> {
        depthwise::forward(x, weight, stride)
    }

    fn conv_input_grad(
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        size: [usize; 2],
        stride: usize,
        padding: [usize; 2],
    ) -> FloatTensor<Self> {
        let options = reference::input_grad_options(&weight, &grad, size, stride, padding);
        // a product and col2im: Burn's direct transposed kernel (its choice without
        // autotuning) took 1.2 s of a 12 s pets step on lavapipe for the four 3x3 layers
        conv_transpose2d(
            grad.clone(),
            weight.clone(),
            None,
            options.clone(),
            ConvTranspose2dStrategy::Gemm,
        )
        .or_else(|_| conv_transpose2d(grad, weight, None, options, ConvTranspose2dStrategy::Direct))
        .expect("Burn's direct transposed convolution takes any shape")
    }

    fn depthwise_conv_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        stride: usize,
        want_x: bool,
    ) -> (Option<FloatTensor<Self>>, FloatTensor<Self>) {
        let kernel = weight.shape().dims::<4>()[2];
        let dx = want_x.then(|| depthwise::input_grad(x.shape(), weight, grad.clone(), stride));
        (dx, depthwise::filter_grad(x, grad, kernel, stride))
    }

    fn batch_norm_relu6(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> BatchNormOutput<Self> {
        let [y, mean, variance] = batch_norm::forward(x, gamma, beta, epsilon);
        BatchNormOutput { y, mean, variance }
    }

    fn batch_norm_relu6_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        variance: FloatTensor<Self>,
        epsilon: f64,
    ) -> BatchNormGrads<Self> {
        let [x, gamma, beta] =
            batch_norm::backward([x, grad], [gamma, beta, mean, variance], epsilon);
        BatchNormGrads { x, gamma, beta }
    }

    fn half_squared_norm(x: FloatTensor<Self>) -> FloatTensor<Self> {
        updates::half_squared_norm(x)
    }

    fn add_scaled(x: FloatTensor<Self>, y: FloatTensor<Self>, alpha: f32) -> FloatTensor<Self> {
        if x.shape() != y.shape() {
            return reference::add_scaled::<Self>(x, y, alpha);
        }
        updates::add_scaled(x, y, alpha)
    }

    fn rmsprop_update(
        state: RmsPropState<Self>,
        grad: FloatTensor<Self>,
        step: RmsPropStep,
    ) -> RmsPropState<Self> {
        RmsPropState::from_array(updates::rmsprop(state.into_array(), grad, step))
    }

    fn moving_average(
        average: FloatTensor<Self>,
        value: FloatTensor<Self>,
        scale: f32,
        keep: f32,
    ) -> FloatTensor<Self> {
        updates::moving_average(average, value, scale, keep)
    }

    fn copies_device_to_device() -> bool {
        is_cuda::<R>()
    }
}

/// Whether `R` is CUDA, whose devices Burn 0.21 copies between with NCCL point-to-point
/// (so it needs libnccl at run time, which this probes); other runtimes' copies panic.
fn is_cuda<R: 'static>() -> bool {
    #[cfg(feature = "cuda")]
    if std::any::TypeId::of::<R>() == std::any::TypeId::of::<cubecl::cuda::CudaRuntime>() {
        // SAFETY: only probes whether the NCCL library can be loaded.
        return unsafe { cudarc::nccl::sys::is_culib_present() };
    }
    false
}
