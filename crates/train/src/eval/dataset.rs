//! Running a network over an evaluation set: detections paired with the ground truth.

use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Result;
use burn::tensor::{Tensor, TensorData};
use data::DetectionExample;
use data::tfrecord::RecordIndex;
use data::validate::read_checked;
use image::{DynamicImage, RgbImage};
use model::inference::postprocess;
use model::ops::SsdBackend;
use model::preprocess::image_to_input;
use model::{Ssd, SsdConfig};

use super::metrics::{DetBox, GtBox, ImageResult};

/// What a pass over an evaluation set gives.
pub struct DatasetRun {
    /// Each image's detections and ground truth, in pixels of the original image.
    pub results: Vec<ImageResult>,
    /// The first images as decoded (as many as asked for), to draw detections on.
    pub images: Vec<RgbImage>,
}

/// Detects on the first `max_images` records (0: all) and pairs the results with the ground
/// truth, both in pixels of the original images; keeps the first `keep_images` images.
/// `None` when `stop` is set before the last batch.
pub fn run_on_dataset<B: SsdBackend>(
    net: &Ssd<B>,
    config: &SsdConfig,
    index: &RecordIndex,
    (max_images, batch_size): (usize, usize),
    keep_images: usize,
    device: &B::Device,
    stop: &AtomicBool,
) -> Result<Option<DatasetRun>> {
    let anchors = model::ssd::anchors(config);
    let count = match max_images {
        0 => index.len(),
        n => n.min(index.len()),
    };
    let [h, w] = config.image_size;
    let mut run = DatasetRun {
        results: Vec::with_capacity(count),
        images: Vec::new(),
    };
    for start in (0..count).step_by(batch_size.max(1)) {
        if stop.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let end = (start + batch_size.max(1)).min(count);
        let mut input = Vec::with_capacity((end - start) * 3 * h * w);
        let mut truths = Vec::new();
        for i in start..end {
            // a bad label, box or image is an error naming the file and the record
            let (example, image) = read_checked(index, i, Some(config.num_classes))?;
            image_to_input(&image, h, w, &mut input)?;
            truths.push(ground_truth(&example, &image));
            if run.images.len() < keep_images {
                run.images.push(image.to_rgb8());
            }
        }
        let tensor =
            Tensor::<B, 4>::from_data(TensorData::new(input, [end - start, 3, h, w]), device);
        let detections = postprocess(config, &anchors, &net.forward(tensor));
        for (dets, (gts, ih, iw)) in detections.into_iter().zip(truths) {
            run.results.push(ImageResult {
                ground_truth: gts,
                detections: dets
                    .into_iter()
                    .map(|d| DetBox {
                        bbox: d.bbox.to_pixels(ih, iw),
                        class_id: d.class_index + 1,
                        score: d.score,
                    })
                    .collect(),
            });
        }
    }
    Ok(Some(run))
}

/// The ground truth of a record in pixels, with the image's height and width.
fn ground_truth(example: &DetectionExample, image: &DynamicImage) -> (Vec<GtBox>, u32, u32) {
    let (ih, iw) = (image.height(), image.width());
    let gts = example
        .objects
        .iter()
        .map(|o| GtBox {
            bbox: o.bbox.to_pixels(ih, iw),
            class_id: o.label as usize,
            difficult: o.difficult,
            crowd: false,
        })
        .collect();
    (gts, ih, iw)
}
