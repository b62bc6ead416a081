//! Checkpoints: `ckpt-<step>/` folders holding the weights, the optimizer state, the EMA
//! weights, the model config (`model.json`) and `state.json` (step, data position, seed,
//! learning rate). A folder is written
//! under a temporary name, fsynced, renamed into place, and only then named in the model dir's
//! `checkpoint.json`; so a failed or interrupted write leaves the previous checkpoint intact.
//! The last `keep` checkpoints are kept.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use data::loader::Position;
use serde::{Deserialize, Serialize};

/// The config stored beside a checkpoint's weights (`model.json`).
pub const MODEL_CONFIG_FILE: &str = "model.json";

/// What a checkpoint records besides tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointState {
    /// Optimizer steps taken.
    pub step: u64,
    /// Where the training data continues.
    pub position: Position,
    /// Seed of the run.
    pub seed: u64,
    /// Learning rate of the last step.
    pub learning_rate: f64,
    /// Replicas of the run that wrote it (any count can resume).
    pub replicas: usize,
    /// Whether `ema.mpk` is present.
    pub has_ema: bool,
}

/// The tensors of a checkpoint, already encoded.
pub struct CheckpointFiles {
    /// Network weights (with averaged BatchNorm statistics).
    pub weights: Vec<u8>,
    /// Optimizer state.
    pub optimizer: Vec<u8>,
    /// EMA weights.
    pub ema: Option<Vec<u8>>,
    /// The model config as JSON (`model.json`), so the checkpoint can be used without its
    /// training config.
    pub model_config: Vec<u8>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Index {
    latest: Option<String>,
    all: Vec<String>,
}

fn read_index(model_dir: &Path) -> Result<Index> {
    let path = model_dir.join("checkpoint.json");
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            serde_json::from_str(&text).with_context(|| format!("{} is damaged", path.display()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Index::default()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    model::io::write_synced(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// Reads a checkpoint just written back and compares it with what was meant to be there.
fn verify(dir: &Path, files: &CheckpointFiles) -> Result<()> {
    let expected = [
        ("model.mpk", Some(&files.weights)),
        ("optimizer.mpk", Some(&files.optimizer)),
        ("ema.mpk", files.ema.as_ref()),
        (MODEL_CONFIG_FILE, Some(&files.model_config)),
    ];
    for (name, bytes) in expected {
        let Some(bytes) = bytes else { continue };
        let path = dir.join(name);
        let read =
            std::fs::read(&path).with_context(|| format!("reading back {}", path.display()))?;
        if &read != bytes {
            anyhow::bail!(
                "{} does not read back as written ({} bytes instead of {}): the disk may be failing; older checkpoints are kept",
                path.display(),
                read.len(),
                bytes.len()
            );
        }
    }
    Ok(())
}

/// Writes checkpoint `state.step` into `model_dir` and prunes old ones.
pub fn save(
    model_dir: &Path,
    state: &CheckpointState,
    files: &CheckpointFiles,
    keep: usize,
) -> Result<PathBuf> {
    std::fs::create_dir_all(model_dir)
        .with_context(|| format!("creating {}", model_dir.display()))?;
    let name = format!("ckpt-{:08}", state.step);
    let tmp = model_dir.join(format!(".{name}.partial"));
    let dir = model_dir.join(&name);
    let _ = std::fs::remove_dir_all(&tmp);
    let result = (|| {
        std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        write_file(&tmp.join("model.mpk"), &files.weights)?;
        write_file(&tmp.join("optimizer.mpk"), &files.optimizer)?;
        if let Some(ema) = &files.ema {
            write_file(&tmp.join("ema.mpk"), ema)?;
        }
        write_file(&tmp.join(MODEL_CONFIG_FILE), &files.model_config)?;
        write_file(
            &tmp.join("state.json"),
            serde_json::to_string_pretty(state)?.as_bytes(),
        )?;
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&tmp, &dir)
            .and_then(|()| model::io::sync_dir(model_dir))
            .with_context(|| format!("renaming {} to {}", tmp.display(), dir.display()))?;
        // old checkpoints go only once this one reads back as written
        verify(&dir, files)?;
        let mut index = read_index(model_dir)?;
        index.all.retain(|n| n != &name);
        index.all.push(name.clone());
        index.latest = Some(name.clone());
        let excess = index.all.len().saturating_sub(keep);
        let old: Vec<String> = index.all.drain(..excess).collect();
        model::io::write_atomic(
            &model_dir.join("checkpoint.json"),
            serde_json::to_string_pretty(&index)?.as_bytes(),
        )
        .with_context(|| format!("writing {}", model_dir.join("checkpoint.json").display()))?;
        for o in old {
            let _ = std::fs::remove_dir_all(model_dir.join(o));
        }
        Ok(dir.clone())
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

/// The latest checkpoint of `model_dir`, `None` when it has none. A `checkpoint.json` naming
/// a checkpoint folder that is missing or incomplete is an error (resuming from an older one,
/// or from scratch, would silently lose the steps since): the message says what to do.
pub fn latest(model_dir: &Path) -> Result<Option<PathBuf>> {
    let index = read_index(model_dir)?;
    let Some(name) = index.latest else {
        return Ok(None);
    };
    let dir = model_dir.join(&name);
    if dir.join("state.json").is_file() {
        return Ok(Some(dir));
    }
    let older: Vec<&str> = index
        .all
        .iter()
        .filter(|n| **n != name && model_dir.join(n).join("state.json").is_file())
        .map(String::as_str)
        .collect();
    let options = match older.last() {
        Some(o) => format!(
            "restore it, or set `latest` in {} to an older checkpoint ({}) to resume from there",
            model_dir.join("checkpoint.json").display(),
            o
        ),
        None => format!(
            "restore it, or remove {} to start over from step 0",
            model_dir.join("checkpoint.json").display()
        ),
    };
    anyhow::bail!(
        "{} names the latest checkpoint {}, which is missing or incomplete (no state.json): {options}",
        model_dir.join("checkpoint.json").display(),
        dir.display()
    )
}

/// Reads `state.json` of a checkpoint folder.
pub fn read_state(dir: &Path) -> Result<CheckpointState> {
    let path = dir.join("state.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is damaged", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(step: u64) -> CheckpointState {
        CheckpointState {
            step,
            position: Position::default(),
            seed: 0,
            learning_rate: 0.1,
            replicas: 1,
            has_ema: false,
        }
    }

    fn files() -> CheckpointFiles {
        CheckpointFiles {
            weights: vec![1, 2],
            optimizer: vec![3],
            ema: None,
            model_config: b"{}".to_vec(),
        }
    }

    #[test]
    fn keeps_the_last_k_and_points_to_the_latest() {
        let dir = tempfile::tempdir().unwrap();
        for step in [10, 20, 30, 40] {
            save(dir.path(), &state(step), &files(), 2).unwrap();
        }
        assert_eq!(
            latest(dir.path()).unwrap().unwrap(),
            dir.path().join("ckpt-00000040")
        );
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            vec!["checkpoint.json", "ckpt-00000030", "ckpt-00000040"]
        );
        assert_eq!(
            read_state(&dir.path().join("ckpt-00000030")).unwrap().step,
            30
        );
    }

    #[test]
    fn a_dangling_index_is_an_error_saying_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &state(10), &files(), 3).unwrap();
        save(dir.path(), &state(20), &files(), 3).unwrap();
        std::fs::remove_dir_all(dir.path().join("ckpt-00000020")).unwrap();
        let err = format!("{:#}", latest(dir.path()).unwrap_err());
        assert!(
            err.contains("ckpt-00000020, which is missing")
                && err.contains("older checkpoint (ckpt-00000010)"),
            "{err}"
        );
        std::fs::remove_dir_all(dir.path().join("ckpt-00000010")).unwrap();
        let err = format!("{:#}", latest(dir.path()).unwrap_err());
        assert!(err.contains("to start over from step 0"), "{err}");
        // a model dir without an index has no checkpoint
        assert!(latest(&dir.path().join("fresh")).unwrap().is_none());
    }

    #[test]
    fn a_checkpoint_that_reads_back_otherwise_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let saved = save(dir.path(), &state(10), &files(), 3).unwrap();
        verify(&saved, &files()).unwrap();
        // what a failing disk returns: other bytes than were written
        std::fs::write(saved.join("optimizer.mpk"), [3, 0]).unwrap();
        let err = format!("{:#}", verify(&saved, &files()).unwrap_err());
        assert!(
            err.contains("optimizer.mpk does not read back as written (2 bytes instead of 1)")
                && err.contains("older checkpoints are kept"),
            "{err}"
        );
    }

    #[test]
    fn a_failed_write_leaves_the_previous_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &state(10), &files(), 3).unwrap();
        // a file where the next checkpoint's temporary folder goes makes its write fail
        std::fs::write(dir.path().join(".ckpt-00000020.partial"), b"in the way").unwrap();
        let err = save(dir.path(), &state(20), &files(), 3).unwrap_err();
        assert!(
            format!("{err:#}").contains(".ckpt-00000020.partial"),
            "{err:#}"
        );
        assert_eq!(
            latest(dir.path()).unwrap().unwrap(),
            dir.path().join("ckpt-00000010")
        );
        assert_eq!(
            std::fs::read(dir.path().join("ckpt-00000010/model.mpk")).unwrap(),
            vec![1, 2]
        );
    }
}
