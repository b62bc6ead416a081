//! `cargo xtask figures`: the figures of a finished training run, written as Markdown that the
//! guide includes (`{{#include figures/default-run.md}}` in the Performance chapter) and that
//! README.md carries between marker comments. Every figure comes from what the run wrote into
//! its model dir: `metrics.jsonl` (the steps' `seconds` since the run started, the
//! evaluations), the TensorBoard event file's name (the second the run started) and
//! `metrics.jsonl`'s modification time (its last evaluation), the training config
//! (`config.json` in the model dir, else `--config`) and the latest checkpoint's
//! `state.json` (replicas). The date, the commit and the command go with them.
//! `cargo xtask check-book` fails when README's copy differs from the file.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::UNIX_EPOCH;

use anyhow::{Context, Result, bail};
use serde_json::Value;
use train::config::TrainConfig;

/// What `cargo xtask figures` is asked to do.
pub struct Request {
    /// The repository's root (README.md, the git work tree).
    pub root: PathBuf,
    /// The finished run.
    pub model_dir: PathBuf,
    /// The run's training config, where the model dir holds no `config.json`.
    pub config: PathBuf,
    /// The Markdown file written (relative to `root` unless absolute).
    pub out: PathBuf,
    /// The command that trained the run, as the figures state it.
    pub run_command: String,
    /// A remark on the measurement (e.g. other work on the machine).
    pub note: Option<String>,
}

/// Reads the run, writes the figures file and README's copy of it, and prints the file.
pub fn run(request: &Request) -> Result<()> {
    let figures = Figures::read(request)?;
    let text = figures.markdown();
    let out = request.root.join(&request.out);
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(&out, &text).with_context(|| format!("writing {}", out.display()))?;
    let readme = request.root.join("README.md");
    let name = request.out.display().to_string();
    let old = std::fs::read_to_string(&readme)
        .with_context(|| format!("reading {}", readme.display()))?;
    match replace_block(&old, &name, &text)? {
        Some(new) => {
            std::fs::write(&readme, new).with_context(|| format!("writing {}", readme.display()))?
        }
        None => eprintln!(
            "README.md has no block for {name} (between `{}` and `{}`): only the file is written",
            begin_marker(&name),
            end_marker(&name)
        ),
    }
    print!("{text}");
    eprintln!("wrote {} and README.md's copy", out.display());
    Ok(())
}

/// The comment that opens README's copy of the generated file `name`.
pub fn begin_marker(name: &str) -> String {
    format!(
        "<!-- begin generated {name}: `cargo xtask figures` writes it, edit nothing up to the end marker -->"
    )
}

/// The comment that closes README's copy of `name`.
pub fn end_marker(name: &str) -> String {
    format!("<!-- end generated {name} -->")
}

/// README's copies of generated files: `(file name, the text between the markers, the line of
/// the begin marker)`, or an error for a block that is not closed.
pub fn readme_blocks(readme: &str) -> Result<Vec<(String, String, usize)>> {
    let mut blocks = Vec::new();
    let mut open: Option<(String, String, usize)> = None;
    for (i, line) in readme.lines().enumerate() {
        if let Some((name, mut text, at)) = open.take() {
            if line.trim() == end_marker(&name) {
                blocks.push((name, text, at));
            } else {
                text.push_str(line);
                text.push('\n');
                open = Some((name, text, at));
            }
            continue;
        }
        let name = line
            .trim()
            .strip_prefix("<!-- begin generated ")
            .and_then(|rest| rest.split(':').next());
        if let Some(name) = name
            && line.trim() == begin_marker(name)
        {
            open = Some((name.to_string(), String::new(), i + 1));
        }
    }
    if let Some((name, _, at)) = open {
        bail!(
            "README.md:{at}: the block of {name} has no end marker `{}`",
            end_marker(&name)
        );
    }
    Ok(blocks)
}

/// `readme` with the block of `name` holding `text`; `None` where it has no such block.
fn replace_block(readme: &str, name: &str, text: &str) -> Result<Option<String>> {
    let (begin, end) = (begin_marker(name), end_marker(name));
    let lines: Vec<&str> = readme.lines().collect();
    let Some(first) = lines.iter().position(|l| l.trim() == begin) else {
        return Ok(None);
    };
    let Some(last) = lines[first..].iter().position(|l| l.trim() == end) else {
        bail!("README.md: the block of {name} has no end marker `{end}`");
    };
    let mut out: Vec<String> = lines[..=first].iter().map(|l| l.to_string()).collect();
    out.extend(text.lines().map(str::to_string));
    out.extend(lines[first + last..].iter().map(|l| l.to_string()));
    let mut joined = out.join("\n");
    if readme.ends_with('\n') {
        joined.push('\n');
    }
    Ok(Some(joined))
}

/// One evaluation of the run.
#[derive(Debug, Clone, PartialEq)]
struct Evaluation {
    step: u64,
    voc_map: f64,
    ap: f64,
    ap50: f64,
    ap75: f64,
}

/// What `metrics.jsonl` says about the run.
#[derive(Debug, Clone, PartialEq)]
struct Record {
    /// The last logged step.
    last_step: u64,
    /// Seconds from each run's start to its last logged step (one entry per run: a resumed
    /// run starts its clock again).
    segments: Vec<f64>,
    evaluations: Vec<Evaluation>,
}

/// Reads `metrics.jsonl`: the logged steps' `seconds` (split where a resumed run starts its
/// clock again) and the evaluations.
fn read_metrics(text: &str) -> Result<Record> {
    let (mut last_step, mut segments, mut evaluations) = (0, Vec::<f64>::new(), Vec::new());
    let mut previous: Option<f64> = None;
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let value: Value = serde_json::from_str(line)
            .with_context(|| format!("metrics.jsonl line {}: not JSON", i + 1))?;
        let step = value["step"]
            .as_u64()
            .with_context(|| format!("metrics.jsonl line {}: no `step`", i + 1))?;
        if let Some(eval) = value.get("eval") {
            let number = |key: &str| {
                eval[key].as_f64().with_context(|| {
                    format!(
                        "metrics.jsonl line {}: the evaluation has no `{key}`",
                        i + 1
                    )
                })
            };
            evaluations.push(Evaluation {
                step,
                voc_map: number("voc_mAP")?,
                ap: number("AP")?,
                ap50: number("AP50")?,
                ap75: number("AP75")?,
            });
            continue;
        }
        let seconds = value["seconds"]
            .as_f64()
            .with_context(|| format!("metrics.jsonl line {}: no `seconds`", i + 1))?;
        match (previous, segments.last_mut()) {
            (Some(p), Some(last)) if seconds >= p => *last = seconds,
            _ => segments.push(seconds),
        }
        previous = Some(seconds);
        last_step = step;
    }
    if segments.is_empty() {
        bail!("metrics.jsonl has no logged step: is the run finished?");
    }
    Ok(Record {
        last_step,
        segments,
        evaluations,
    })
}

/// Everything the figures say.
struct Figures {
    model_dir: String,
    config_name: String,
    config: TrainConfig,
    record: Record,
    /// Wall-clock seconds from the run's start to its last write (one run, not resumed).
    wall_seconds: Option<f64>,
    replicas: Option<usize>,
    date: String,
    commit: String,
    machine: String,
    run_command: String,
    note: Option<String>,
}

impl Figures {
    fn read(request: &Request) -> Result<Self> {
        let dir = request.root.join(&request.model_dir);
        let metrics_path = dir.join("metrics.jsonl");
        let text = std::fs::read_to_string(&metrics_path).with_context(|| {
            format!(
                "reading {} (train first: {})",
                metrics_path.display(),
                request.run_command
            )
        })?;
        let record = read_metrics(&text)?;
        // the config the run kept (overrides included), named after --config where it is that
        let stored = dir.join("config.json");
        let given = request.root.join(&request.config);
        let (config, config_name) = if stored.is_file() {
            let kept = TrainConfig::load(&stored)?;
            let same = given.is_file() && TrainConfig::load(&given).is_ok_and(|c| c == kept);
            let name = match same {
                true => request.config.display().to_string(),
                false => request.model_dir.join("config.json").display().to_string(),
            };
            (kept, name)
        } else {
            (
                TrainConfig::load(&given)?,
                request.config.display().to_string(),
            )
        };
        if record.last_step < config.train.num_steps {
            eprintln!(
                "note: the run stopped at step {} of {}: the figures are of an unfinished run",
                record.last_step, config.train.num_steps
            );
        }
        let finished = std::fs::metadata(&metrics_path)
            .and_then(|m| m.modified())
            .with_context(|| format!("reading the time of {}", metrics_path.display()))?;
        let finished = finished.duration_since(UNIX_EPOCH)?.as_secs_f64();
        // one run from start to end: its event file is the model dir's first (a later `train`
        // that found nothing to do adds one and writes no metrics)
        let first_start = event_file_starts(&dir)?.into_iter().min();
        let wall_seconds = match (record.segments.len(), first_start) {
            (1, Some(start)) => Some(finished - start as f64).filter(|w| *w >= record.segments[0]),
            _ => None,
        };
        let replicas = train::checkpoint::latest(&dir)?
            .map(|c| train::checkpoint::read_state(&c))
            .transpose()?
            .map(|s| s.replicas);
        Ok(Self {
            model_dir: request.model_dir.display().to_string(),
            config_name,
            config,
            record,
            wall_seconds,
            replicas,
            date: date(finished as i64),
            commit: commit(&request.root)?,
            machine: machine(),
            run_command: request.run_command.clone(),
            note: request.note.clone(),
        })
    }

    /// The Markdown file.
    fn markdown(&self) -> String {
        let c = &self.config;
        let r = &self.record;
        let images = r.last_step as f64 * c.train.batch_size as f64;
        let to_last: f64 = r.segments.iter().sum();
        let mut rows = Vec::new();
        rows.push((
            "run".to_string(),
            format!(
                "`{}`: `{}`, {} steps of {} images at {}x{}, depth multiplier {}, {} classes",
                self.run_command,
                self.config_name,
                r.last_step,
                c.train.batch_size,
                c.model.image_size[0],
                c.model.image_size[1],
                c.model.depth_multiplier,
                c.model.num_classes
            ),
        ));
        let replicas = match self.replicas {
            Some(1) => ", 1 replica".to_string(),
            Some(n) => format!(", {n} replicas"),
            None => String::new(),
        };
        rows.push(("machine".into(), format!("{}{replicas}", self.machine)));
        let evaluated = r.evaluations.len();
        let time = match self.wall_seconds {
            Some(wall) => format!(
                "{wall:.0} s wall clock from start to end ({evaluated} evaluations and the checkpoints included); {to_last:.0} s to step {}",
                r.last_step
            ),
            None if r.segments.len() == 1 => format!(
                "{to_last:.0} s from start to step {} (evaluations before it included)",
                r.last_step
            ),
            None => format!(
                "{to_last:.0} s from start to step {} over {} runs (resumed; evaluations before it included)",
                r.last_step,
                r.segments.len()
            ),
        };
        rows.push(("time".into(), time));
        let seconds = self.wall_seconds.unwrap_or(to_last);
        rows.push((
            "throughput".into(),
            format!(
                "{:.0} images/s ({images:.0} images over the {seconds:.0} s)",
                images / seconds.max(1e-9)
            ),
        ));
        let weights = match c.train.moving_average_decay {
            Some(_) => "EMA weights",
            None => "raw weights",
        };
        let eval_data = c.data.eval.join(", ");
        let at_most = match c.eval.max_images {
            0 => String::new(),
            n => format!(", at most {n} images"),
        };
        if let Some(last) = r.evaluations.last() {
            let progress: Vec<String> = r
                .evaluations
                .iter()
                .map(|e| format!("{:.4} at step {}", e.voc_map, e.step))
                .collect();
            rows.push((
                "VOC mAP@0.5".into(),
                format!(
                    "{} (`{eval_data}`{at_most}, {weights})",
                    progress.join(", ")
                ),
            ));
            rows.push((
                format!("COCO AP at step {}", last.step),
                format!(
                    "{:.4} (AP50 {:.4}, AP75 {:.4})",
                    last.ap, last.ap50, last.ap75
                ),
            ));
        } else {
            rows.push(("evaluation".into(), "none in the run".into()));
        }
        if let Some(note) = &self.note {
            rows.push(("note".into(), note.clone()));
        }
        rows.push((
            "measured".into(),
            format!(
                "{}, commit {}; figures from `{}` by `cargo xtask figures`",
                self.date, self.commit, self.model_dir
            ),
        ));
        let mut text = format!(
            "<!-- Written by `cargo xtask figures` (xtask/src/figures.rs) from {}: regenerate it, do not edit it. -->\n\n| the default run | |\n|---|---|\n",
            self.model_dir
        );
        for (what, value) in rows {
            text += &format!("| {what} | {value} |\n");
        }
        text
    }
}

/// The start times (seconds since the epoch) in the names of the model dir's TensorBoard
/// event files (`events.out.tfevents.<seconds>.<host>`), one per run.
fn event_file_starts(dir: &Path) -> Result<Vec<u64>> {
    let mut starts = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if let Some(rest) = name.strip_prefix("events.out.tfevents.")
            && let Some(seconds) = rest.split('.').next().and_then(|s| s.parse().ok())
        {
            starts.push(seconds);
        }
    }
    Ok(starts)
}

/// `git rev-parse --short HEAD`, and whether the code (not the guide) has uncommitted changes.
fn commit(root: &Path) -> Result<String> {
    let git = |args: &[&str]| -> Result<String> {
        let out = Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .context("running git")?;
        if !out.status.success() {
            bail!(
                "git {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let head = git(&["rev-parse", "--short", "HEAD"])?;
    let code = [
        "crates",
        "xtask",
        "configs",
        "Cargo.toml",
        "Cargo.lock",
        ".cargo",
    ];
    let mut args = vec!["status", "--porcelain", "--"];
    args.extend(code);
    let dirty = !git(&args)?.is_empty();
    Ok(match dirty {
        true => format!("`{head}` with uncommitted changes to the code"),
        false => format!("`{head}`"),
    })
}

/// This machine: the CPU's model name and the cores this process may use.
fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, name)| name.split_whitespace().collect::<Vec<_>>().join(" "))
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    format!("{cpu}, {cores} cores")
}

/// `YYYY-MM-DD` (UTC) of a time in seconds since the epoch.
fn date(seconds: i64) -> String {
    // days to the civil date, by Howard Hinnant's `civil_from_days`
    let z = seconds.div_euclid(86_400) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_civil_utc_days() {
        assert_eq!(date(0), "1970-01-01");
        assert_eq!(date(951_782_400), "2000-02-29");
        assert_eq!(date(1_798_761_599), "2026-12-31");
        assert_eq!(date(1_798_761_600), "2027-01-01");
    }

    #[test]
    fn metrics_give_the_last_step_the_runs_times_and_the_evaluations() {
        let eval = |step: u64, map: f64| {
            format!(
                r#"{{"step": {step}, "eval": {{"AP": 0.5, "AP50": 0.9, "AP75": 0.6, "voc_mAP": {map}, "voc_AP": {{}}}}}}"#
            )
        };
        let step = |step: u64, seconds: f64| {
            format!(
                r#"{{"step": {step}, "loss": {{}}, "images_per_sec": 10.0, "seconds": {seconds}}}"#
            )
        };
        let one = [step(10, 1.0), step(20, 2.5), eval(20, 0.25), step(30, 4.0)].join("\n");
        let record = read_metrics(&one).unwrap();
        assert_eq!(record.last_step, 30);
        assert_eq!(record.segments, [4.0]);
        assert_eq!(record.evaluations.len(), 1);
        assert_eq!(record.evaluations[0].voc_map, 0.25);
        // a resumed run starts its clock again: two runs, their times summed by the figures
        let resumed = [step(10, 1.0), step(20, 2.0), step(30, 0.5), step(40, 1.5)].join("\n");
        assert_eq!(read_metrics(&resumed).unwrap().segments, [2.0, 1.5]);
        assert!(read_metrics(&eval(20, 0.5)).is_err());
    }

    #[test]
    fn readme_blocks_are_found_and_replaced() {
        let name = "docs/src/figures/x.md";
        let readme = format!(
            "# R\n\ntext\n{}\nold line\n{}\nafter\n",
            begin_marker(name),
            end_marker(name)
        );
        let blocks = readme_blocks(&readme).unwrap();
        assert_eq!(blocks, [(name.to_string(), "old line\n".to_string(), 4)]);
        let new = replace_block(&readme, name, "new 1\nnew 2\n")
            .unwrap()
            .unwrap();
        assert_eq!(readme_blocks(&new).unwrap()[0].1, "new 1\nnew 2\n");
        assert!(new.ends_with("-->\nafter\n"));
        assert!(replace_block(&readme, "other.md", "x").unwrap().is_none());
        let open = format!("{}\nline\n", begin_marker(name));
        assert!(readme_blocks(&open).is_err());
    }
}
