//! How tensors move between the replicas' devices, chosen once at the start of a run
//! ([`Transfer::between`]) and said in its log.

use std::time::Duration;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use model::ops::SsdBackend;

use super::watchdog::{CHECK_LIMIT, bounded};

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
    /// The path between `devices` of backend `B` on this machine, and why the device-to-device
    /// path was not taken where the backend has one but it failed its start-up check: a small
    /// known tensor from the first device to each other one and back (`probe_pair`). NCCL
    /// that loads but does not work (a small `/dev/shm` in a container, peer access blocked,
    /// a library built for a newer CUDA than the driver's) fails there, not in the first
    /// exchange.
    pub fn between<B: SsdBackend>(devices: &[B::Device]) -> (Self, Option<String>) {
        let forced = std::env::var(HOST_STAGED_ENV).is_ok_and(|v| v == "1");
        if devices.windows(2).all(|w| w[0] == w[1]) {
            return (Self::SameDevice, None);
        }
        if !B::copies_device_to_device() || forced {
            return (Self::HostStaged, None);
        }
        let failed = devices[1..].iter().enumerate().find_map(|(i, other)| {
            probe_pair::<B>(&devices[0], other, CHECK_LIMIT, |t, d| t.to_device(d))
                .err()
                .map(|why| format!("between replica 0's device and replica {}'s: {why}", i + 1))
        });
        match failed {
            Some(why) => (Self::HostStaged, Some(why)),
            None => (Self::DeviceToDevice, None),
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

/// Sends a small known tensor from `a` to `b` and back by `copy`, within `limit` and
/// without taking the run down ([`bounded`]): a failing NCCL set-up panics inside the
/// device's runner, where the copy can then wait for ever. `Err` says what went wrong unless
/// the values come back unchanged.
fn probe_pair<B: Backend>(
    a: &B::Device,
    b: &B::Device,
    limit: Duration,
    copy: impl Fn(Tensor<B, 1>, &B::Device) -> Tensor<B, 1> + Send + 'static,
) -> Result<(), String> {
    const SENT: [f32; 4] = [1.5, -2.0, 3.25, 1e-3];
    let (a, b) = (a.clone(), b.clone());
    let round_trip = bounded("the copy", limit, move || {
        let there = copy(Tensor::<B, 1>::from_floats(SENT, &a), &b);
        copy(there, &a).into_data().to_vec::<f32>()
    })?;
    match round_trip {
        Ok(back) if back == SENT => Ok(()),
        Ok(back) => Err(format!("sent {SENT:?}, got back {back:?}")),
        Err(e) => Err(format!("reading the copy back failed: {e:?}")),
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
            (Transfer::SameDevice, None)
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

    /// The start-up check passes a working copy and names each way a copy can fail: wrong
    /// values, a panic (NCCL's set-up failing in the runner), no answer.
    #[test]
    fn the_start_up_check_names_what_went_wrong() {
        let device = Default::default();
        // long for the copies that answer (a panic's backtrace, with RUST_BACKTRACE set on a
        // busy machine, can take seconds), short for the one that does not
        let (limit, no_answer) = (Duration::from_secs(30), Duration::from_millis(500));
        probe_pair::<Flex>(&device, &device, limit, |t, d| t.to_device(d)).unwrap();
        let err = probe_pair::<Flex>(&device, &device, limit, |t, _| t * 2.0).unwrap_err();
        assert!(err.contains("got back [6.0, -8.0"), "{err}");
        let err = probe_pair::<Flex>(&device, &device, limit, |_, _| {
            panic!("ncclCommInitAll failed")
        })
        .unwrap_err();
        assert!(err.contains("panicked: ncclCommInitAll failed"), "{err}");
        let err = probe_pair::<Flex>(&device, &device, no_answer, |t, _| {
            std::thread::sleep(Duration::from_secs(2));
            t
        })
        .unwrap_err();
        assert!(
            err.contains("the copy did not finish within 0.5 s"),
            "{err}"
        );
    }
}
