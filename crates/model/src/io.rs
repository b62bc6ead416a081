//! Durable file writes: every file that matters (weights, checkpoints, configs, shards,
//! exports) is written so that a crash leaves either the old file or the new one.

use std::fs::File;
use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` so that a crash leaves either the old file or the new one:
/// a temporary file beside it is written and fsynced, then renamed over `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = write_synced(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, path))
        .and_then(|()| sync_dir(dir));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Creates `path` with `bytes` and waits until they are on disk (for files inside a folder
/// that is itself renamed into place once complete, as a checkpoint is).
pub fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut file = File::create(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

/// Persists the entries of `dir` (a rename into it, a file created in it). File systems
/// that cannot open a folder for syncing are left as they are.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).or(Ok(()))
}
