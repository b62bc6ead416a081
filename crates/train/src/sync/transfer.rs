//! How tensors move between the replicas' devices, chosen once at the start of a run
//! ([`Transfer::between`]) and said in its log.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use model::ops::SsdBackend;

/// Set to `1` to stage every copy between devices through the host even where the backend
/// copies device to device (to compare the two paths on one machine).
pub const HOST_STAGED_ENV: &str = "SSD_BURN_HOST_STAGED";

/// The path a tensor takes from one replica's device to another's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transfer {
    /// Every replica is on one device (replicas on the CPU): nothing moves.
    SameDevice,
    /// `Tensor::to_device`: NCCL point-to-point between CUDA devices.
    DeviceToDevice,
    /// Read back to the host and uploaded to the other device: wgpu (whose device-to-device
    /// copy Burn 0.21 does not implement), and CUDA where libnccl cannot be loaded.
    HostStaged,
}

impl Transfer {
    /// The path between `devices` of backend `B` on this machine.
    pub fn between<B: SsdBackend>(devices: &[B::Device]) -> Self {
        let forced = std::env::var(HOST_STAGED_ENV).is_ok_and(|v| v == "1");
        if devices.windows(2).all(|w| w[0] == w[1]) {
            Self::SameDevice
        } else if B::copies_device_to_device() && !forced {
            Self::DeviceToDevice
        } else {
            Self::HostStaged
        }
    }

    /// A line for the run's log.
    pub fn describe(self) -> &'static str {
        match self {
            Self::SameDevice => "replicas share one device: the exchange moves no data",
            Self::DeviceToDevice => "tensors move device to device (NCCL point-to-point)",
            Self::HostStaged => "tensors move between devices through the host",
        }
    }

    /// `tensor` on `device` by this path.
    pub fn to<B: Backend, const D: usize>(
        self,
        tensor: Tensor<B, D>,
        device: &B::Device,
    ) -> Tensor<B, D> {
        match self {
            Self::HostStaged if tensor.device() != *device => {
                Tensor::from_data(tensor.into_data(), device)
            }
            _ => tensor.to_device(device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn one_device_moves_nothing_and_host_staging_keeps_values() {
        let device = Default::default();
        assert_eq!(
            Transfer::between::<Flex>(&[device, device]),
            Transfer::SameDevice
        );
        let t = Tensor::<Flex, 1>::from_floats([1.5, -2.0, 3.25], &device);
        for path in [Transfer::HostStaged, Transfer::DeviceToDevice] {
            let moved = path.to(t.clone(), &device);
            assert_eq!(
                moved.into_data().to_vec::<f32>().unwrap(),
                vec![1.5, -2.0, 3.25]
            );
        }
    }
}
