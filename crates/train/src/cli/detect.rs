//! `train detect`: detections on image files, drawn and as JSON.

use std::path::PathBuf;

use anyhow::Result;
use model::Detector;
use model::ops::SsdBackend;
use train::detect::{detect_files, image_files};
use train::devices::{BackendJob, parse_device};
use train::trained::TrainedModel;

use super::CheckpointArgs;

/// Detect objects in images (files, folders or globs) with a checkpoint: each image is
/// written as PNG with coloured, labelled boxes and scores, and every detection goes to
/// `OUT/detections.json`.
#[derive(clap::Args)]
pub struct DetectArgs {
    #[command(flatten)]
    checkpoint: CheckpointArgs,
    /// Output folder.
    #[arg(long)]
    out: PathBuf,
    /// Keep detections scoring at least this (0 to 1).
    #[arg(long, default_value_t = 0.5, value_parser = score)]
    score_threshold: f32,
    /// At most this many detections per image.
    #[arg(long, default_value_t = 20)]
    max_detections: usize,
    /// Device: `cpu`, `wgpu` (`wgpu:i`: the i-th wgpu device) or a CUDA ordinal.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Image files, folders or glob patterns.
    #[arg(required = true)]
    images: Vec<String>,
}

/// Detects as `args` say and prints where the results went.
pub fn run(args: DetectArgs) -> Result<()> {
    let trained = args.checkpoint.locate()?;
    let files = image_files(&args.images)?;
    let found = parse_device(&args.device)?.run(Detection {
        trained: &trained,
        files: &files,
        args: &args,
    })?;
    println!(
        "{found} detections in {} images; drawn images and detections.json in {}",
        files.len(),
        args.out.display()
    );
    Ok(())
}

/// Detection on the files, as a [`BackendJob`]; returns the number of detections.
struct Detection<'a> {
    trained: &'a TrainedModel,
    files: &'a [PathBuf],
    args: &'a DetectArgs,
}

impl BackendJob for Detection<'_> {
    type Output = usize;
    fn run<B: SsdBackend>(self, devices: Vec<B::Device>) -> Result<usize> {
        let device = &devices[0];
        let net = self.trained.load::<B>(device)?;
        let detector = Detector::new(self.trained.config.clone(), net, device)?;
        let a = self.args;
        let results = detect_files(
            &detector,
            self.files,
            &a.out,
            a.score_threshold,
            a.max_detections,
        )?;
        Ok(results.iter().map(|r| r.detections.len()).sum())
    }
}

/// A score threshold: a number from 0 to 1 (NaN would drop every detection).
fn score(text: &str) -> Result<f32, String> {
    match text.parse::<f32>() {
        Ok(t) if (0.0..=1.0).contains(&t) => Ok(t),
        _ => Err(format!("{text} is not a score from 0 to 1")),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn score_thresholds_are_numbers_from_0_to_1() {
        assert_eq!(super::score("0.3"), Ok(0.3));
        assert_eq!(super::score("1"), Ok(1.0));
        for bad in ["nan", "-0.1", "1.5", "inf", "high"] {
            let err = super::score(bad).unwrap_err();
            assert_eq!(err, format!("{bad} is not a score from 0 to 1"));
        }
    }
}
