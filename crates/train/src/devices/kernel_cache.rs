//! Where the GPU backends keep what they compile and tune, so that only a machine's first run
//! pays for it: cubecl compiles each kernel at its first launch (NVRTC on CUDA, SPIR-V on
//! Vulkan) and keeps nothing unless told where, and the CUDA driver's own cache of the machine
//! code it builds from PTX is lost with a container. Set here from code, before any GPU work:
//! under `$SSD_BURN_KERNEL_CACHE`, else `$XDG_CACHE_HOME/ssd-burn`, else `~/.cache/ssd-burn`.
//!
//! cubecl keys a compiled kernel by its type and launch settings, not by its source nor the
//! GPU it was compiled for: each build of this program (a hash of its executable) and each GPU
//! architecture has a folder of its own, so a changed kernel never loads stale code. The
//! folders of the few builds used last are kept, older ones removed.

use std::hash::Hasher;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use anyhow::{Context, Result};
use burn::cubecl::config::cache::CacheConfig;
use burn::cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

/// The environment variable naming the caches' folder.
pub const CACHE_ENV: &str = "SSD_BURN_KERNEL_CACHE";
/// Folders of other builds (or GPU architectures) kept beside this one's: a developer's
/// debug and release builds and the test binaries each have one.
const OTHER_BUILDS_KEPT: usize = 8;
/// The file whose modification time tells when a build's folder was last used.
const LAST_USED: &str = "last-used";

/// The caches' folder: `$SSD_BURN_KERNEL_CACHE`, else `$XDG_CACHE_HOME/ssd-burn`, else
/// `$HOME/.cache/ssd-burn`; `None` where none is set. `env` reads the environment.
pub fn root(env: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let set = |key: &str| env(key).filter(|v| !v.is_empty()).map(PathBuf::from);
    set(CACHE_ENV)
        .or_else(|| set("XDG_CACHE_HOME").map(|d| d.join("ssd-burn")))
        .or_else(|| set("HOME").map(|d| d.join(".cache").join("ssd-burn")))
}

/// Points the CUDA driver's cache of the machine code it builds from PTX (default
/// `~/.nv/ComputeCache`, 256 MiB) into the caches' folder, at its largest size (4 GiB), where
/// the user has not set `CUDA_CACHE_PATH` / `CUDA_CACHE_MAXSIZE`. The driver reads them once,
/// at its initialisation.
///
/// # Safety
/// Sets environment variables: call it while the process has one thread (first in `main`).
pub unsafe fn point_driver_cache() {
    let Some(root) = root(|k| std::env::var(k).ok()) else {
        return;
    };
    for (key, value) in [
        (
            "CUDA_CACHE_PATH",
            root.join("cuda-driver").display().to_string(),
        ),
        ("CUDA_CACHE_MAXSIZE", (4u64 << 30).to_string()),
    ] {
        if std::env::var_os(key).is_none() {
            // SAFETY: the caller's promise: the process has one thread.
            unsafe { std::env::set_var(key, value) };
        }
    }
}

/// What a run found in its caches at the start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelCaches {
    /// This build's folder for this GPU architecture.
    pub dir: PathBuf,
    /// Compiled kernels found there.
    pub kernels: usize,
    /// Autotune results found there.
    pub tuned: usize,
}

impl KernelCaches {
    /// The caches of this build for the GPUs named `gpus` (e.g. `cuda-sm90-nvrtc12.8`, `wgpu`), under
    /// `root`, with what they hold; removes the folders of all but the last few other builds.
    pub fn open(root: &Path, gpus: &str) -> Result<Self> {
        let builds = root.join("kernels");
        let dir = builds.join(format!("{}-{gpus}", build_id()?));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::write(dir.join(LAST_USED), b"")
            .with_context(|| format!("writing {}", dir.join(LAST_USED).display()))?;
        remove_old_builds(&builds, &dir);
        Ok(Self {
            kernels: kernels_in(&dir),
            tuned: entries_in(&dir.join("autotune")),
            dir,
        })
    }

    /// cubecl's config (a `cubecl.toml` and cubecl's environment variables as cubecl reads
    /// them) with the compilation and autotune caches here, unless that config names its own.
    pub fn runtime_config(&self) -> CubeClRuntimeConfig {
        let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
        if config.compilation.cache.is_none() {
            config.compilation.cache = Some(CacheConfig::File(self.dir.clone()));
        }
        if matches!(config.autotune.cache, CacheConfig::Target) {
            config.autotune.cache = CacheConfig::File(self.dir.clone());
        }
        config
    }

    /// The line that tells the user where the caches are and what they held.
    pub fn describe(&self) -> String {
        format!(
            "GPU kernel cache: {} ({} compiled kernels and {} autotune results from earlier runs; {CACHE_ENV} moves it)",
            self.dir.display(),
            self.kernels,
            self.tuned
        )
    }
}

/// Compiled kernels kept in a build's folder `dir` (cubecl's PTX and SPIR-V caches).
pub fn kernels_in(dir: &Path) -> usize {
    ["cuda", "vulkan"]
        .iter()
        .map(|backend| entries_in(&dir.join(backend)))
        .sum()
}

/// Puts the caches in place for this process's GPU work on `gpus` (see
/// [`KernelCaches::open`]; `None`: GPUs no one folder fits) and says where they are, once per
/// process; left as it is where cubecl's config was set before (by a tool that logs, say).
pub fn use_kernel_caches(gpus: Option<&str>) {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        if CubeClRuntimeConfig::storage().lock().is_some() {
            return;
        }
        let Some(gpus) = gpus else {
            eprintln!(
                "GPU kernel cache: none (the CUDA devices are of several architectures, or the driver does not tell): every run compiles its kernels anew"
            );
            return;
        };
        let Some(root) = root(|k| std::env::var(k).ok()) else {
            eprintln!(
                "GPU kernel cache: none (neither {CACHE_ENV}, XDG_CACHE_HOME nor HOME is set): every run compiles its kernels anew"
            );
            return;
        };
        match KernelCaches::open(&root, gpus) {
            Ok(caches) => {
                let config = caches.runtime_config();
                let line = match &config.compilation.cache {
                    Some(CacheConfig::File(dir)) if *dir == caches.dir => caches.describe(),
                    other => format!("GPU kernel cache: as cubecl.toml says ({other:?})"),
                };
                let mut state = CubeClRuntimeConfig::storage().lock();
                // GPU work on another thread may have read cubecl's config meanwhile
                if state.is_none() {
                    *state = Some(Arc::new(config));
                    eprintln!("{line}");
                }
            }
            // a run without caches is slower at its start, not wrong
            Err(e) => eprintln!(
                "GPU kernel cache: none ({e:#}): every run compiles its kernels anew ({CACHE_ENV} names another folder)"
            ),
        }
    });
}

/// A hash of this program's executable: the kernels it compiles are those of this build.
fn build_id() -> Result<String> {
    let exe = std::env::current_exe().context("locating this program's executable")?;
    let mut file =
        std::fs::File::open(&exe).with_context(|| format!("reading {}", exe.display()))?;
    let mut hasher = std::hash::DefaultHasher::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buffer)
            .with_context(|| format!("reading {}", exe.display()))?;
        if n == 0 {
            break;
        }
        hasher.write(&buffer[..n]);
    }
    Ok(format!("{:016x}", hasher.finish()))
}

/// Removes the build folders under `builds` (those with a [`LAST_USED`] file: nothing else
/// is touched) other than `current` and the last few used.
fn remove_old_builds(builds: &Path, current: &Path) {
    let Ok(entries) = std::fs::read_dir(builds) else {
        return;
    };
    let mut others: Vec<(std::time::SystemTime, PathBuf)> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p != current)
        .filter_map(|p| {
            let used = std::fs::metadata(p.join(LAST_USED)).and_then(|m| m.modified());
            Some((used.ok()?, p))
        })
        .collect();
    others.sort_by_key(|other| std::cmp::Reverse(other.0));
    for (_, old) in others.into_iter().skip(OTHER_BUILDS_KEPT) {
        // another run may be using it still; a folder left behind is only disk space
        let _ = std::fs::remove_dir_all(old);
    }
}

/// Entries of cubecl's cache files under `dir` (`*.json.log`, one JSON entry a line).
fn entries_in(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .map(|p| {
            if p.is_dir() {
                entries_in(&p)
            } else if p.to_string_lossy().ends_with(".json.log") {
                std::fs::read(&p).map_or(0, |b| b.iter().filter(|&&c| c == b'\n').count())
            } else {
                0
            }
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_folder_follows_the_environment() {
        fn env<'a>(vars: &'a [(&str, &str)]) -> impl Fn(&str) -> Option<String> + 'a {
            move |k| {
                vars.iter()
                    .find(|(key, _)| *key == k)
                    .map(|(_, v)| v.to_string())
            }
        }
        let all = [
            (CACHE_ENV, "/big/disk"),
            ("XDG_CACHE_HOME", "/xdg"),
            ("HOME", "/home/u"),
        ];
        assert_eq!(root(env(&all)), Some(PathBuf::from("/big/disk")));
        assert_eq!(root(env(&all[1..])), Some(PathBuf::from("/xdg/ssd-burn")));
        assert_eq!(
            root(env(&[(CACHE_ENV, ""), ("HOME", "/home/u")])),
            Some(PathBuf::from("/home/u/.cache/ssd-burn"))
        );
        assert_eq!(root(env(&[])), None);
    }

    #[test]
    fn a_build_keeps_its_own_folder_and_the_last_few_others() {
        let root = tempfile::tempdir().unwrap();
        let builds = root.path().join("kernels");
        // a folder that is not a build's (no `last-used`): never removed
        std::fs::create_dir_all(builds.join("not-a-build")).unwrap();
        // ten older builds, used one after the other
        for i in 0..10 {
            let old = builds.join(format!("old{i}-wgpu"));
            std::fs::create_dir_all(&old).unwrap();
            let used = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1000 * (i + 1));
            std::fs::File::create(old.join(LAST_USED))
                .unwrap()
                .set_modified(used)
                .unwrap();
        }
        let caches = KernelCaches::open(root.path(), "wgpu").unwrap();
        let mut left: Vec<String> = std::fs::read_dir(&builds)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        let own = caches
            .dir
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(own.ends_with("-wgpu"), "{own}");
        let mut want: Vec<String> = (2..10).map(|i| format!("old{i}-wgpu")).collect();
        want.extend([own, "not-a-build".into()]);
        want.sort();
        assert_eq!(left, want);
        // the same build opens the same folder, and counts what cubecl's caches hold
        let ptx = caches.dir.join("cuda/0.10.0/ptx.json.log");
        std::fs::create_dir_all(ptx.parent().unwrap()).unwrap();
        std::fs::write(&ptx, "{\"key\":1}\n{\"key\":2}\n").unwrap();
        let tuned = caches.dir.join("autotune/0.10.0/device/matmul.json.log");
        std::fs::create_dir_all(tuned.parent().unwrap()).unwrap();
        std::fs::write(&tuned, "{\"key\":1}\n").unwrap();
        let again = KernelCaches::open(root.path(), "wgpu").unwrap();
        assert_eq!(
            (again.dir.clone(), again.kernels, again.tuned),
            (caches.dir, 2, 1)
        );
        assert!(
            again
                .describe()
                .contains("2 compiled kernels and 1 autotune results")
        );
    }
}
