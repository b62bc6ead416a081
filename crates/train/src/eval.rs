//! Running a network over an evaluation set, and the COCO JSON formats for scoring any
//! detector's output.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use burn::tensor::{Tensor, TensorData};
use data::tfrecord::RecordIndex;
use data::validate::read_checked;
use model::inference::postprocess;
use model::ops::SsdBackend;
use model::preprocess::image_to_input;
use model::{BBox, Ssd, SsdConfig};
use serde_json::Value;

use crate::metrics::{DetBox, GtBox, ImageResult};

/// Detects on the first `max_images` records (0: all) and pairs the results with the ground
/// truth, both in pixels of the original images.
pub fn run_on_dataset<B: SsdBackend>(
    net: &Ssd<B>,
    config: &SsdConfig,
    index: &RecordIndex,
    max_images: usize,
    batch_size: usize,
    device: &B::Device,
) -> Result<Vec<ImageResult>> {
    let anchors = model::ssd::anchors(config);
    let count = if max_images == 0 {
        index.len()
    } else {
        max_images.min(index.len())
    };
    let [h, w] = config.image_size;
    let mut results = Vec::with_capacity(count);
    for start in (0..count).step_by(batch_size.max(1)) {
        let end = (start + batch_size.max(1)).min(count);
        let mut input = Vec::with_capacity((end - start) * 3 * h * w);
        let mut truths = Vec::new();
        for i in start..end {
            // a bad label, box or image is an error naming the file and the record
            let (example, image) = read_checked(index, i, Some(config.num_classes))?;
            image_to_input(&image, h, w, &mut input)?;
            let (ih, iw) = (image.height(), image.width());
            let gts = example
                .objects
                .iter()
                .map(|o| GtBox {
                    bbox: o.bbox.to_pixels(ih, iw),
                    class_id: o.label as usize,
                    difficult: o.difficult,
                })
                .collect::<Vec<_>>();
            truths.push((gts, ih, iw));
        }
        let tensor =
            Tensor::<B, 4>::from_data(TensorData::new(input, [end - start, 3, h, w]), device);
        let detections = postprocess(config, &anchors, &net.forward(tensor));
        for (dets, (gts, ih, iw)) in detections.into_iter().zip(truths) {
            results.push(ImageResult {
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
    Ok(results)
}

fn bbox_from(v: &Value, what: &str) -> Result<BBox> {
    let a: Vec<f32> = v
        .as_array()
        .filter(|a| a.len() == 4)
        .and_then(|a| a.iter().map(|x| x.as_f64().map(|f| f as f32)).collect())
        .with_context(|| format!("{what}: `bbox` must be [x, y, width, height]"))?;
    Ok(BBox::new(a[1], a[0], a[1] + a[3], a[0] + a[2]))
}

/// Reads COCO ground truth (`images`, `annotations`, `categories`) and COCO-format results
/// (`[{image_id, category_id, bbox, score}]`). Returns the images and the class names by id
/// (ids must be 1..=N). Crowd annotations are rejected (not supported).
pub fn read_coco(
    ground_truth: &Path,
    detections: &Path,
) -> Result<(Vec<ImageResult>, Vec<String>)> {
    let read = |p: &Path| -> Result<Value> {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", p.display()))
    };
    let gt = read(ground_truth)?;
    let dt = read(detections)?;
    let mut categories: Vec<(u64, String)> = gt["categories"]
        .as_array()
        .with_context(|| format!("{}: no `categories`", ground_truth.display()))?
        .iter()
        .map(|c| {
            Ok((
                c["id"].as_u64().context("category without id")?,
                c["name"].as_str().unwrap_or_default().to_string(),
            ))
        })
        .collect::<Result<_>>()?;
    categories.sort();
    if categories
        .iter()
        .enumerate()
        .any(|(i, (id, _))| *id != i as u64 + 1)
    {
        bail!("{}: category ids must be 1..=N", ground_truth.display());
    }
    let mut slot = HashMap::new();
    let mut images = Vec::new();
    for im in gt["images"]
        .as_array()
        .with_context(|| format!("{}: no `images`", ground_truth.display()))?
    {
        slot.insert(im["id"].as_u64().context("image without id")?, images.len());
        images.push(ImageResult::default());
    }
    for a in gt["annotations"]
        .as_array()
        .with_context(|| format!("{}: no `annotations`", ground_truth.display()))?
    {
        if a["iscrowd"].as_u64() == Some(1) {
            bail!(
                "{}: crowd annotations are not supported",
                ground_truth.display()
            );
        }
        let i = *slot
            .get(
                &a["image_id"]
                    .as_u64()
                    .context("annotation without image_id")?,
            )
            .context("annotation of an unknown image")?;
        images[i].ground_truth.push(GtBox {
            bbox: bbox_from(&a["bbox"], "annotation")?,
            class_id: a["category_id"]
                .as_u64()
                .context("annotation without category_id")? as usize,
            difficult: false,
        });
    }
    for d in dt
        .as_array()
        .with_context(|| format!("{}: expected a list of detections", detections.display()))?
    {
        let i = *slot
            .get(
                &d["image_id"]
                    .as_u64()
                    .context("detection without image_id")?,
            )
            .with_context(|| format!("{}: detection of an unknown image", detections.display()))?;
        images[i].detections.push(DetBox {
            bbox: bbox_from(&d["bbox"], "detection")?,
            class_id: d["category_id"]
                .as_u64()
                .context("detection without category_id")? as usize,
            score: d["score"].as_f64().context("detection without score")? as f32,
        });
    }
    Ok((images, categories.into_iter().map(|(_, n)| n).collect()))
}
