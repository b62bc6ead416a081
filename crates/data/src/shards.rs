//! Sharded TFRecord file sets (`name-00000-of-00010`), glob expansion, and an atomic sharded
//! writer: shards are written under temporary names and renamed into place only by
//! [`ShardedWriter::finish`], so a crash never leaves a half-written set that looks complete.

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use crate::error::{DataError, Result};
use crate::tfrecord::RecordWriter;

/// The path of shard `index` of `count`: `<base>-00003-of-00010`.
pub fn shard_path(base: &Path, index: usize, count: usize) -> PathBuf {
    let name = base.file_name().and_then(|n| n.to_str()).unwrap_or("data");
    base.with_file_name(format!("{name}-{index:05}-of-{count:05}"))
}

/// Expands file patterns: globs (`data/train-*`), plain paths, and the TF shard spec
/// `base@N` (the N shards of `base`). The result is sorted and free of duplicates; a pattern
/// matching nothing is an error naming it.
pub fn expand_patterns<S: AsRef<str>>(patterns: &[S]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for pattern in patterns {
        let pattern = pattern.as_ref();
        let before = files.len();
        if let Some((base, n)) = pattern
            .rsplit_once('@')
            .and_then(|(b, n)| Some((b, n.parse::<usize>().ok()?)))
        {
            files.extend((0..n).map(|i| shard_path(Path::new(base), i, n)));
        } else {
            let paths = glob::glob(pattern)
                .map_err(|e| DataError::invalid(pattern, format!("bad pattern: {e}")))?;
            for p in paths {
                files.push(p.map_err(|e| DataError::invalid(pattern, e.to_string()))?);
            }
        }
        if files.len() == before {
            return Err(DataError::invalid(pattern, "no file matches"));
        }
    }
    files.sort();
    files.dedup();
    Ok(files)
}

/// Writes records round-robin into `count` shards (record `i` goes to shard `i % count`, as
/// the API's `open_sharded_output_tfrecords` users do).
#[derive(Debug)]
pub struct ShardedWriter {
    finals: Vec<PathBuf>,
    temps: Vec<PathBuf>,
    writers: Vec<RecordWriter<BufWriter<File>>>,
    written: usize,
}

impl ShardedWriter {
    /// Starts a set of `count` shards named after `base`.
    pub fn create(base: &Path, count: usize) -> Result<Self> {
        let count = count.max(1);
        if let Some(dir) = base.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(DataError::io("creating", dir))?;
        }
        let finals: Vec<PathBuf> = (0..count).map(|i| shard_path(base, i, count)).collect();
        let temps: Vec<PathBuf> = finals
            .iter()
            .map(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("shard");
                p.with_file_name(format!(".{name}.partial"))
            })
            .collect();
        let mut writers = Vec::with_capacity(count);
        for t in &temps {
            let f = File::create(t).map_err(DataError::io("creating", t))?;
            writers.push(RecordWriter::new(BufWriter::new(f)));
        }
        Ok(Self {
            finals,
            temps,
            writers,
            written: 0,
        })
    }

    /// Appends one record.
    pub fn write(&mut self, record: &[u8]) -> Result<()> {
        let i = self.written % self.writers.len();
        self.writers[i]
            .write(record)
            .map_err(DataError::io("writing", &self.temps[i]))?;
        self.written += 1;
        Ok(())
    }

    /// Records written so far.
    pub fn len(&self) -> usize {
        self.written
    }

    /// True before the first record.
    pub fn is_empty(&self) -> bool {
        self.written == 0
    }

    /// Flushes, fsyncs and renames every shard into place; returns the final paths.
    pub fn finish(mut self) -> Result<Vec<PathBuf>> {
        let writers = std::mem::take(&mut self.writers);
        for (w, t) in writers.into_iter().zip(&self.temps) {
            let file = w.into_inner().into_inner().map_err(|e| DataError::Io {
                action: "writing",
                path: t.clone(),
                source: e.into_error(),
            })?;
            file.sync_all().map_err(DataError::io("syncing", t))?;
        }
        for (t, f) in self.temps.iter().zip(&self.finals) {
            std::fs::rename(t, f).map_err(DataError::io("renaming", t))?;
        }
        if let Some(dir) = self.finals[0]
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
        {
            let _ = File::open(dir).and_then(|d| d.sync_all());
        }
        self.temps.clear();
        Ok(std::mem::take(&mut self.finals))
    }
}

impl Drop for ShardedWriter {
    /// An unfinished set leaves nothing behind.
    fn drop(&mut self) {
        for t in &self.temps {
            let _ = std::fs::remove_file(t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tfrecord::read_all;

    #[test]
    fn shards_round_robin_and_expand() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("train.record");
        let mut w = ShardedWriter::create(&base, 3).unwrap();
        for i in 0..7u8 {
            w.write(&[i]).unwrap();
        }
        let files = w.finish().unwrap();
        assert_eq!(files[1].file_name().unwrap(), "train.record-00001-of-00003");
        assert_eq!(
            read_all(&files[0]).unwrap(),
            vec![vec![0], vec![3], vec![6]]
        );
        let pattern = format!("{}-*", base.display());
        assert_eq!(expand_patterns(&[pattern]).unwrap(), files);
        assert_eq!(
            expand_patterns(&[format!("{}@3", base.display())]).unwrap(),
            files
        );
        assert!(expand_patterns(&[format!("{}/none-*", dir.path().display())]).is_err());
        // only the three shards are in the folder
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 3);
    }

    #[test]
    fn unfinished_sets_leave_nothing() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut w = ShardedWriter::create(&dir.path().join("x"), 2).unwrap();
            w.write(b"a").unwrap();
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
