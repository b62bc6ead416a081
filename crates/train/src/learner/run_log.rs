//! What the leader of a run records: progress lines on stderr, `metrics.jsonl` (one JSON
//! object per logged step and per evaluation) and the TensorBoard event file. Other nodes of
//! a multi-node run print their lines but write no files.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use image::RgbImage;
use serde_json::json;

use super::replica::LossValues;
use crate::eval::{COCO_NAMES, Metrics};
use crate::report::events::EventWriter;

/// Where a run's lines and records go.
pub(super) struct RunLog {
    verbose: bool,
    /// `metrics.jsonl` and the event file, on the leader only.
    files: Option<(File, PathBuf, EventWriter)>,
}

/// One logged step's figures.
pub(super) struct StepRecord {
    pub step: u64,
    pub num_steps: u64,
    pub loss: LossValues,
    pub learning_rate: f64,
    pub images_per_sec: f64,
    pub eta_seconds: f64,
    /// Seconds since the run started.
    pub seconds: f64,
}

impl RunLog {
    /// Opens the leader's files in `model_dir` (appending to a resumed run's metrics).
    pub fn open(model_dir: &Path, leader: bool, verbose: bool) -> Result<Self> {
        if !leader {
            return Ok(Self {
                verbose,
                files: None,
            });
        }
        let path = model_dir.join("metrics.jsonl");
        let metrics = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        let events = EventWriter::create(model_dir).with_context(|| {
            format!(
                "creating a TensorBoard event file in {}",
                model_dir.display()
            )
        })?;
        Ok(Self {
            verbose,
            files: Some((metrics, path, events)),
        })
    }

    /// Prints a line (when the run is verbose).
    pub fn say(&self, line: impl AsRef<str>) {
        if self.verbose {
            eprintln!("{}", line.as_ref());
        }
    }

    /// The progress line, the metrics record and the scalars of a logged step.
    pub fn step(&mut self, r: &StepRecord) -> Result<()> {
        let loss = &r.loss;
        self.say(format!(
            "step {}/{} | loss {:.4} (cls {:.4}, loc {:.4}, reg {:.4}) | {:.1} matched, {:.1} mined negatives per image | lr {:.6} | {:.1} img/s | eta {:.0}s",
            r.step,
            r.num_steps,
            loss.total,
            loss.classification,
            loss.localization,
            loss.regularization,
            loss.matched_per_image,
            loss.mined_negatives_per_image,
            r.learning_rate,
            r.images_per_sec,
            r.eta_seconds
        ));
        let targets = json!({"matched_per_image": loss.matched_per_image, "mined_negatives_per_image": loss.mined_negatives_per_image});
        self.record(json!({"step": r.step, "loss": loss, "targets": targets, "learning_rate": r.learning_rate, "images_per_sec": r.images_per_sec, "seconds": r.seconds}))?;
        self.scalars(
            r.step,
            &[
                ("loss/total", loss.total as f64),
                ("loss/classification", loss.classification as f64),
                ("loss/localization", loss.localization as f64),
                ("loss/regularization", loss.regularization as f64),
                ("targets/matched_per_image", loss.matched_per_image as f64),
                (
                    "targets/mined_negatives_per_image",
                    loss.mined_negatives_per_image as f64,
                ),
                ("learning_rate", r.learning_rate),
                ("images_per_sec", r.images_per_sec),
            ],
        )
    }

    /// The line, the metrics record, the scalars and the drawn images of an evaluation.
    pub fn evaluation(&mut self, step: u64, m: &Metrics, images: &[RgbImage]) -> Result<()> {
        self.say(format!(
            "eval at step {step}: VOC mAP@0.5 {:.4}, COCO AP {:.4}, AP50 {:.4}",
            m.voc_mAP, m.AP, m.AP50
        ));
        self.record(json!({"step": step, "eval": m}))?;
        let tags: Vec<(String, f64)> = COCO_NAMES
            .iter()
            .zip(m.coco())
            .map(|(n, v)| (format!("eval/{n}"), v))
            .chain(std::iter::once(("eval/voc_mAP".to_string(), m.voc_mAP)))
            .chain(
                m.voc_AP
                    .iter()
                    .map(|(c, v)| (format!("eval/voc_AP/{c}"), *v)),
            )
            .collect();
        let tags: Vec<(&str, f64)> = tags.iter().map(|(t, v)| (t.as_str(), *v)).collect();
        self.scalars(step, &tags)?;
        let Some((_, _, events)) = &mut self.files else {
            return Ok(());
        };
        for (i, image) in images.iter().enumerate() {
            events
                .image(step, &format!("eval/image_{i}"), image)
                .with_context(|| format!("writing {}", events.path().display()))?;
        }
        Ok(())
    }

    /// Whether `metrics.jsonl` records an evaluation at `step`; `true` where this process
    /// keeps no files (the leader evaluates).
    pub fn evaluated_at(&self, step: u64) -> Result<bool> {
        let Some((_, path, _)) = &self.files else {
            return Ok(true);
        };
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Ok(text.lines().any(|line| {
            serde_json::from_str::<serde_json::Value>(line)
                .is_ok_and(|v| v["step"].as_u64() == Some(step) && v.get("eval").is_some())
        }))
    }

    fn record(&mut self, value: serde_json::Value) -> Result<()> {
        match &mut self.files {
            Some((file, path, _)) => {
                writeln!(file, "{value}").with_context(|| format!("writing {}", path.display()))
            }
            None => Ok(()),
        }
    }

    fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()> {
        match &mut self.files {
            Some((_, _, events)) => events
                .scalars(step, values)
                .with_context(|| format!("writing {}", events.path().display())),
            None => Ok(()),
        }
    }
}
