//! Sharded TFRecord file sets (`name-00000-of-00010`), glob expansion, and an atomic sharded
//! writer: shards are written under temporary names and renamed into place only by
//! [`ClosedShards::commit`], which also removes the shards of an older set of the same name,
//! so a crash never leaves a half-written set that looks complete and a re-run never leaves
//! old shards beside the new ones.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
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
            let hint = nearest_existing(Path::new(pattern));
            return Err(DataError::invalid(
                pattern,
                format!("no file matches{hint}"),
            ));
        }
    }
    files.sort();
    files.dedup();
    Ok(files)
}

/// What exists nearest to a pattern that matched nothing, for its error: the closest names
/// in the deepest folder of the pattern that exists (so `datasets/synthtic/train-*` points at
/// `datasets/synthetic`), or that the folder is empty.
fn nearest_existing(pattern: &Path) -> String {
    let is_glob =
        |c: &std::path::Component| c.as_os_str().to_string_lossy().contains(['*', '?', '[']);
    let mut folder = PathBuf::new();
    let mut wanted = None;
    let components: Vec<_> = pattern.components().collect();
    for (i, component) in components.iter().enumerate() {
        let next = folder.join(component);
        if is_glob(component) || !next.is_dir() {
            let name = component.as_os_str().to_string_lossy().into_owned();
            // a folder is wanted where more of the pattern follows
            wanted = Some((name, i + 1 < components.len()));
            break;
        }
        folder = next;
    }
    let (Some((wanted, a_folder)), Ok(entries)) = (wanted, std::fs::read_dir(shown(&folder)))
    else {
        return String::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| {
            let e = e.ok()?;
            let is_dir = e.file_type().ok()?.is_dir();
            (is_dir || !a_folder).then(|| e.file_name().to_string_lossy().into_owned())
        })
        .filter(|n| !n.starts_with('.'))
        .collect();
    if names.is_empty() {
        return match a_folder {
            true => format!(" (no folder {wanted} in {})", shown(&folder).display()),
            false => format!(" ({} is empty)", shown(&folder).display()),
        };
    }
    let total = names.len();
    names.sort_by_key(|n| (strsim::levenshtein(n, &wanted), n.clone()));
    names.truncate(3);
    let places: Vec<String> = names
        .iter()
        .map(|n| folder.join(n).display().to_string())
        .collect();
    let more = if total > names.len() {
        format!(" and {} more", total - names.len())
    } else {
        String::new()
    };
    format!(" (nearest: {}{more})", places.join(", "))
}

/// `.` for the empty relative path.
fn shown(folder: &Path) -> &Path {
    if folder.as_os_str().is_empty() {
        Path::new(".")
    } else {
        folder
    }
}

/// Shards open at once. More (`--num-shards 2000`) could exceed the limit of open files
/// (`ulimit -n`, often 1024); beyond it the least recently opened shard is closed and
/// reopened for appending when its turn comes round again.
const MAX_OPEN: usize = 64;

type Writer = RecordWriter<BufWriter<File>>;

/// Writes records round-robin into `count` shards (record `i` goes to shard `i % count`, as
/// the API's `open_sharded_output_tfrecords` users do), under temporary names
/// (`.<shard>.partial`) until [`ClosedShards::commit`].
#[derive(Debug)]
pub struct ShardedWriter {
    base_name: String,
    finals: Vec<PathBuf>,
    temps: Vec<PathBuf>,
    open: Vec<Option<Writer>>,
    /// Open shards, the least recently opened first.
    open_order: VecDeque<usize>,
    max_open: usize,
    /// Whether each temporary file was created by this writer (later opens append).
    created: Vec<bool>,
    written: usize,
}

impl ShardedWriter {
    /// Starts a set of `count` shards named after `base`. `count` 0 is an error.
    pub fn create(base: &Path, count: usize) -> Result<Self> {
        Self::with_open_limit(base, count, MAX_OPEN)
    }

    fn with_open_limit(base: &Path, count: usize, max_open: usize) -> Result<Self> {
        if count == 0 {
            return Err(DataError::invalid(
                base,
                "num_shards 0: a set needs at least one shard",
            ));
        }
        if let Some(dir) = base.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(DataError::io("creating", dir))?;
        }
        let finals: Vec<PathBuf> = (0..count).map(|i| shard_path(base, i, count)).collect();
        let temps = finals.iter().map(|p| temp_path(p)).collect();
        Ok(Self {
            base_name: file_name(base).to_string(),
            finals,
            temps,
            open: (0..count).map(|_| None).collect(),
            open_order: VecDeque::new(),
            max_open: max_open.max(1),
            created: vec![false; count],
            written: 0,
        })
    }

    /// Opens shard `i`'s temporary file: created (emptied) the first time, appended to later.
    fn open_temp(&mut self, i: usize) -> Result<File> {
        let t = &self.temps[i];
        let file = if self.created[i] {
            OpenOptions::new().append(true).open(t)
        } else {
            File::create(t)
        };
        self.created[i] = true;
        file.map_err(DataError::io("creating", t))
    }

    /// Shard `i`'s writer, opened (closing the oldest open shard at the limit) if need be.
    fn writer(&mut self, i: usize) -> Result<&mut Writer> {
        if self.open[i].is_none() {
            if self.open_order.len() >= self.max_open
                && let Some(j) = self.open_order.pop_front()
                && let Some(w) = self.open[j].take()
            {
                into_file(w, &self.temps[j])?;
            }
            let file = self.open_temp(i)?;
            self.open[i] = Some(RecordWriter::new(BufWriter::new(file)));
            self.open_order.push_back(i);
        }
        Ok(self.open[i].as_mut().expect("opened above"))
    }

    /// Appends one record.
    pub fn write(&mut self, record: &[u8]) -> Result<()> {
        let i = self.written % self.temps.len();
        self.writer(i)?
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

    /// Flushes and fsyncs every shard (shards without records become empty files); nothing
    /// has replaced any older set yet.
    pub fn close(mut self) -> Result<ClosedShards> {
        for i in 0..self.temps.len() {
            let file = match self.open[i].take() {
                Some(w) => into_file(w, &self.temps[i])?,
                None => self.open_temp(i)?,
            };
            file.sync_all()
                .map_err(DataError::io("syncing", &self.temps[i]))?;
        }
        Ok(ClosedShards {
            base_name: std::mem::take(&mut self.base_name),
            finals: std::mem::take(&mut self.finals),
            temps: std::mem::take(&mut self.temps),
        })
    }

    /// [`close`](Self::close) and [`ClosedShards::commit`]: returns the final paths.
    pub fn finish(self) -> Result<Vec<PathBuf>> {
        self.close()?.commit()
    }
}

impl Drop for ShardedWriter {
    /// An unfinished set leaves nothing behind.
    fn drop(&mut self) {
        remove_all(&self.temps);
    }
}

/// A complete set of shards under temporary names, waiting to replace the set of the same
/// name. Dropped without [`commit`](Self::commit), it leaves nothing behind.
#[derive(Debug)]
pub struct ClosedShards {
    base_name: String,
    finals: Vec<PathBuf>,
    temps: Vec<PathBuf>,
}

impl ClosedShards {
    /// Renames every shard into place, then removes the shards of any older set of the same
    /// name that this one does not replace (an earlier run with more shards) and temporary
    /// files an interrupted run left. Returns the final paths.
    pub fn commit(mut self) -> Result<Vec<PathBuf>> {
        for (t, f) in self.temps.iter().zip(&self.finals) {
            std::fs::rename(t, f).map_err(DataError::io("renaming", t))?;
        }
        self.temps.clear();
        let dir = self.finals[0]
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        for entry in std::fs::read_dir(dir).map_err(DataError::io("listing", dir))? {
            let path = entry.map_err(DataError::io("listing", dir))?.path();
            if is_shard_of(file_name(&path), &self.base_name) && !self.finals.contains(&path) {
                std::fs::remove_file(&path).map_err(DataError::io("removing", &path))?;
            }
        }
        let _ = model::io::sync_dir(dir);
        Ok(std::mem::take(&mut self.finals))
    }
}

impl Drop for ClosedShards {
    fn drop(&mut self) {
        remove_all(&self.temps);
    }
}

fn file_name(path: &Path) -> &str {
    path.file_name().and_then(|n| n.to_str()).unwrap_or("data")
}

fn temp_path(shard: &Path) -> PathBuf {
    shard.with_file_name(format!(".{}.partial", file_name(shard)))
}

/// Whether `name` is a shard of the set `base` (`base-00001-of-00004`) or the temporary file
/// of one (`.base-00001-of-00004.partial`).
fn is_shard_of(name: &str, base: &str) -> bool {
    let name = name
        .strip_prefix('.')
        .and_then(|n| n.strip_suffix(".partial"))
        .unwrap_or(name);
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    name.strip_prefix(base)
        .and_then(|rest| rest.strip_prefix('-'))
        .and_then(|rest| rest.split_once("-of-"))
        .is_some_and(|(i, n)| digits(i) && digits(n))
}

fn into_file(writer: Writer, path: &Path) -> Result<File> {
    writer.into_inner().into_inner().map_err(|e| DataError::Io {
        action: "writing",
        path: path.to_path_buf(),
        source: e.into_error(),
    })
}

fn remove_all(paths: &[PathBuf]) {
    for p in paths {
        let _ = std::fs::remove_file(p);
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
        // a typo in a folder's name: the error points at the folder meant
        let typo = dir.path().join("synthtic/train.record-*");
        let err = expand_patterns(&[typo.display().to_string()])
            .unwrap_err()
            .to_string();
        assert!(
            err.ends_with(&format!("(no folder synthtic in {})", dir.path().display())),
            "{err}"
        );
        let meant = dir.path().join("synthetic");
        std::fs::create_dir(&meant).unwrap();
        let err_beside = expand_patterns(&[typo.display().to_string()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("synthtic/train.record-*: no file matches"),
            "{err}"
        );
        assert!(
            err_beside.contains(&format!("nearest: {}", meant.display())),
            "{err_beside}"
        );
        // a typo in a file pattern: the files beside it
        let err = expand_patterns(&[format!("{}-0*-of-00004", base.display())])
            .unwrap_err()
            .to_string();
        assert!(err.contains("train.record-00000-of-00003"), "{err}");
        std::fs::remove_dir(&meant).unwrap();
        // only the three shards are in the folder
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 3);
    }

    #[test]
    fn many_shards_with_few_open_files() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("t");
        let mut w = ShardedWriter::with_open_limit(&base, 10, 3).unwrap();
        for i in 0..25u8 {
            w.write(&[i]).unwrap();
            assert!(w.open_order.len() <= 3);
        }
        let files = w.finish().unwrap();
        assert_eq!(files.len(), 10);
        for (s, f) in files.iter().enumerate() {
            let want: Vec<Vec<u8>> = (s as u8..25).step_by(10).map(|r| vec![r]).collect();
            assert_eq!(read_all(f).unwrap(), want, "shard {s}");
        }
        // 2000 shards with the default limit: every one written, nothing else left
        let many = dir.path().join("many");
        std::fs::create_dir(&many).unwrap();
        let mut w = ShardedWriter::create(&many.join("train.record"), 2000).unwrap();
        for i in 0..4000u32 {
            w.write(&i.to_le_bytes()).unwrap();
        }
        let files = w.finish().unwrap();
        assert_eq!(files.len(), 2000);
        assert_eq!(read_all(&files[1999]).unwrap().len(), 2);
        assert_eq!(std::fs::read_dir(&many).unwrap().count(), 2000);
        let err = ShardedWriter::create(&base, 0).unwrap_err().to_string();
        assert!(err.contains("num_shards 0"), "{err}");
    }

    #[test]
    fn a_new_set_replaces_the_old_one_only_when_complete() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("train.record");
        let write = |count: usize, records: u8| {
            let mut w = ShardedWriter::create(&base, count).unwrap();
            for i in 0..records {
                w.write(&[i]).unwrap();
            }
            w
        };
        let old = write(5, 10).finish().unwrap();
        std::fs::write(
            dir.path().join("train.record2-00000-of-00001"),
            b"other set",
        )
        .unwrap();
        std::fs::write(dir.path().join(".train.record-00003-of-00009.partial"), b"").unwrap();
        let names = || {
            let mut n: Vec<String> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            n.sort();
            n
        };
        // closed but not committed, then dropped (a failure later in the run): the old set
        // is intact and no temporary file is left
        drop(write(2, 4).close().unwrap());
        assert_eq!(names().len(), 7);
        assert!(old.iter().all(|f| read_all(f).unwrap().len() == 2));
        let new = write(2, 4).finish().unwrap();
        assert_eq!(
            names(),
            vec![
                "train.record-00000-of-00002",
                "train.record-00001-of-00002",
                "train.record2-00000-of-00001",
            ]
        );
        assert_eq!(
            expand_patterns(&[format!("{}-*", base.display())]).unwrap(),
            new
        );
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
