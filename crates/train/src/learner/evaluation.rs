//! Evaluating a checkpoint during a run: detections on the evaluation set, their COCO and VOC
//! metrics, and a few evaluation images with their detections drawn (for TensorBoard).

use std::sync::atomic::AtomicBool;

use anyhow::Result;
use data::tfrecord::RecordIndex;
use image::RgbImage;
use model::Ssd;
use model::ops::SsdBackend;

use crate::config::TrainConfig;
use crate::detect::eval_images;
use crate::eval::{Metrics, evaluate, run_on_dataset};

/// Evaluation images drawn for TensorBoard.
const DRAWN_IMAGES: usize = 3;

/// Evaluates `net` on `index` as `config.eval` says; `None` when `stop` was set before the
/// end.
pub(super) fn evaluate_net<B: SsdBackend>(
    net: &Ssd<B>,
    config: &TrainConfig,
    index: &RecordIndex,
    device: &B::Device,
    stop: &AtomicBool,
) -> Result<Option<(Metrics, Vec<RgbImage>)>> {
    let sizes = (config.eval.max_images, config.eval.batch_size);
    let Some(run) = run_on_dataset(net, &config.model, index, sizes, DRAWN_IMAGES, device, stop)?
    else {
        return Ok(None);
    };
    let class_names: Vec<String> = (1..=config.model.num_classes)
        .map(|i| config.model.class_name(i))
        .collect();
    let metrics = evaluate(&run.results, &class_names);
    let drawn = eval_images(run.images, &run.results, &config.model);
    Ok(Some((metrics, drawn)))
}
