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
    /// Keep detections scoring at least this.
    #[arg(long, default_value_t = 0.5)]
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
