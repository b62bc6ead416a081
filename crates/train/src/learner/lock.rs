//! One writer per model dir. The process that writes a run's checkpoints, metrics and events
//! (rank 0) holds an advisory lock on `<model dir>/.lock` for the whole run, so a second run
//! on the same dir is refused at once instead of interleaving its log lines with the first's
//! and pruning its checkpoints. The kernel drops the lock when the holder exits, killed or
//! not, so a dead run is no obstacle and leaves nothing to clean up. Readers (`eval`,
//! `detect`, `export`, `plot`) do not take it.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::Write;
use std::path::Path;
use std::time::SystemTime;

use anyhow::{Context, Result, bail};

/// The lock file, inside the model dir.
pub const LOCK_FILE: &str = ".lock";

/// The lock of a model dir, held until dropped.
#[derive(Debug)]
pub struct ModelDirLock {
    _file: File,
}

impl ModelDirLock {
    /// Takes the lock of `dir` (which must exist) and writes who holds it into the lock
    /// file; a dir locked by another run is an error naming that run's process, machine and
    /// start time.
    pub fn acquire(dir: &Path) -> Result<Self> {
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => bail!(
                "{} is in use by another training run ({}); wait for it to end, or train into another --model-dir",
                dir.display(),
                holder(&path)
            ),
            Err(TryLockError::Error(e)) => return Err(refused(&path, &e)),
        }
        // the holder's details are for people; the lock itself is the kernel's
        file.set_len(0)
            .and_then(|()| writeln!(file, "{}", describe_this_process()))
            .and_then(|()| file.sync_all())
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(Self { _file: file })
    }
}

/// The error of a filesystem that has no locks (Lustre mounted `noflock` answers ENOSYS):
/// what it said, and the two ways on.
fn refused(path: &Path, e: &std::io::Error) -> anyhow::Error {
    anyhow::anyhow!(
        "locking {}: the filesystem refused the lock ({e}). Lustre mounted without `flock` and NFS mounted `nolock` do not lock; train on a filesystem that does, or pass --risk-concurrent-writers to train without the lock (nothing then stops a second run on this dir)",
        path.display()
    )
}

/// "pid P on HOST since TIME" for this process.
fn describe_this_process() -> String {
    format!(
        "pid {} on {} since {}",
        std::process::id(),
        gethostname::gethostname().to_string_lossy(),
        humantime::format_rfc3339_seconds(SystemTime::now())
    )
}

/// What the lock file says of its holder.
fn holder(path: &Path) -> String {
    match std::fs::read_to_string(path) {
        Ok(text) if !text.trim().is_empty() => text.trim().to_string(),
        // between the holder's lock and its writing of the details
        _ => "a process that is just starting".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_naming_the_first_until_it_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let first = ModelDirLock::acquire(dir.path()).unwrap();
        let err = format!("{:#}", ModelDirLock::acquire(dir.path()).unwrap_err());
        let pid = format!("pid {} on ", std::process::id());
        assert!(
            err.contains("in use by another training run") && err.contains(&pid),
            "{err}"
        );
        drop(first);
        let again = ModelDirLock::acquire(dir.path());
        assert!(again.is_ok(), "{again:?}");
    }

    #[test]
    fn a_filesystem_without_locks_is_named_with_the_way_on() {
        // what flock(2) returns on Lustre mounted `noflock`
        let enosys = std::io::Error::from_raw_os_error(38);
        let err = refused(Path::new("run/.lock"), &enosys).to_string();
        assert!(
            err.starts_with(
                "locking run/.lock: the filesystem refused the lock (Function not implemented"
            ),
            "{err}"
        );
        assert!(err.contains("--risk-concurrent-writers"), "{err}");
    }
}
