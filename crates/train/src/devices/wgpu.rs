//! wgpu devices (Vulkan on Linux and Windows, Metal on macOS): `wgpu:i` is the `i`-th Burn
//! device opened on the default adapter (`CUBECL_WGPU_DEFAULT_DEVICE` picks another), each
//! with a wgpu device, queue and memory of its own. Two indices are two distinct devices even
//! on one GPU, so two replicas on it take the real multi-device path (separate memory,
//! transfers between devices).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, OnceLock};

use anyhow::{Context, Result, anyhow};
use burn::backend::wgpu::graphics::AutoGraphicsApi;
use burn::backend::wgpu::{RuntimeOptions, WgpuDevice, WgpuSetup, init_device, init_setup};

/// The first device's setup (its instance and adapter open the others).
static FIRST: OnceLock<WgpuSetup> = OnceLock::new();
/// The devices opened so far, by index: each index opens once per process.
static OPENED: Mutex<Vec<WgpuDevice>> = Mutex::new(Vec::new());

/// The Burn devices of wgpu indices `ids`, opening those not opened yet.
pub fn devices(ids: &[usize]) -> Result<Vec<WgpuDevice>> {
    let mut opened = OPENED.lock().unwrap_or_else(|e| e.into_inner());
    let needed = ids.iter().max().map_or(0, |&i| i + 1);
    while opened.len() < needed {
        let device = match FIRST.get() {
            None => open_first()?,
            Some(first) => open_another(first, opened.len())?,
        };
        opened.push(device);
    }
    Ok(ids.iter().map(|&i| opened[i].clone()).collect())
}

/// Device 0: Burn's default device, opened the way Burn opens it.
fn open_first() -> Result<WgpuDevice> {
    let device = WgpuDevice::DefaultDevice;
    // cubecl panics where no adapter exists: say what to install instead, without the panic's
    // own report (the hook is silenced while the adapter is looked for, on this thread alone
    // at start-up)
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let setup = catch_unwind(AssertUnwindSafe(|| {
        init_setup::<AutoGraphicsApi>(&device, RuntimeOptions::default())
    }));
    std::panic::set_hook(hook);
    let setup = setup.map_err(|panic| {
        let why = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("no reason given");
        anyhow!(
            "--devices wgpu: no GPU adapter found (on Linux install a Vulkan driver, e.g. Debian's `mesa-vulkan-drivers`; wgpu said: {})",
            why.lines().next().unwrap_or(why)
        )
    })?;
    let info = setup.adapter.get_info();
    println!(
        "wgpu adapter: {} ({:?}, {:?})",
        info.name, info.device_type, info.backend
    );
    // set once, under the OPENED lock
    let _ = FIRST.set(setup);
    Ok(device)
}

/// Device `index` > 0: a new wgpu device on the first one's adapter, with the same features
/// and limits, registered with Burn as a device of its own.
fn open_another(first: &WgpuSetup, index: usize) -> Result<WgpuDevice> {
    let info = first.adapter.get_info();
    // an adapter opens one device: ask the instance for the same adapter again
    let adapter = pollster::block_on(first.instance.enumerate_adapters(first.backend.into()))
        .into_iter()
        .find(|a| {
            let other = a.get_info();
            (other.name.as_str(), other.device, other.backend)
                == (info.name.as_str(), info.device, info.backend)
        })
        .with_context(|| format!("wgpu device {index}: adapter {} not found again", info.name))?;
    let descriptor = wgpu::DeviceDescriptor {
        label: Some("ssd-burn replica"),
        required_features: first.device.features(),
        required_limits: first.device.limits(),
        // SAFETY: the features are those cubecl enabled on the first device of this adapter
        experimental_features: unsafe { wgpu::ExperimentalFeatures::enabled() },
        memory_hints: wgpu::MemoryHints::MemoryUsage,
        trace: wgpu::Trace::Off,
    };
    let (device, queue) = if info.backend == wgpu::Backend::Vulkan {
        // as cubecl opens device 0: with the Vulkan features its SPIR-V is compiled for
        pollster::block_on(burn::cubecl::wgpu::vulkan::request_vulkan_device(&adapter))
            .with_context(|| format!("wgpu device {index}: Vulkan device on {}", info.name))?
    } else {
        pollster::block_on(adapter.request_device(&descriptor))
            .with_context(|| format!("wgpu device {index} on {}", info.name))?
    };
    let setup = WgpuSetup {
        instance: first.instance.clone(),
        adapter,
        device,
        queue,
        backend: first.backend,
    };
    Ok(init_device(setup, RuntimeOptions::default()))
}
