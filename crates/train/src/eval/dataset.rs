//! Running a network over an evaluation set: detections paired with the ground truth.

use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Result;
use burn::tensor::{Tensor, TensorData};
use data::DetectionExample;
use data::example::EvalObject;
use data::tfrecord::RecordIndex;
use data::validate::{check_objects, read_checked};
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
/// The ground truth holds the records' crowd regions (`image/object/is_crowd`, which the COCO
/// metric ignores the detections on) and areas (`image/object/area`, which its size ranges
/// read), as the API's evaluation takes them. The images' ids are the records'
/// `image/source_id`s where all are integers (COCO's image ids: the COCO metric then visits
/// them in pycocotools' order), else their places in the set.
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
    let mut ids = Vec::with_capacity(count);
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
            let objects = eval_objects(index, i, config.num_classes)?;
            image_to_input(&image, h, w, &mut input)?;
            truths.push(ground_truth(&example, &objects, &image));
            if run.images.len() < keep_images {
                run.images.push(image.to_rgb8());
            }
        }
        let tensor =
            Tensor::<B, 4>::from_data(TensorData::new(input, [end - start, 3, h, w]), device);
        let detections = postprocess(config, &anchors, &net.forward(tensor));
        for (dets, (gts, source_id, ih, iw)) in detections.into_iter().zip(truths) {
            ids.push(source_id);
            run.results.push(ImageResult {
                image_id: 0,
                ground_truth: gts,
                detections: dets
                    .into_iter()
                    .map(|d| DetBox::new(d.bbox.to_pixels(ih, iw), d.class_index + 1, d.score))
                    .collect(),
            });
        }
    }
    number_images(&mut run.results, &ids);
    Ok(Some(run))
}

/// The images' ids: their `image/source_id`s where every one is an integer, else their places.
fn number_images(results: &mut [ImageResult], source_ids: &[Option<u64>]) {
    let all: Option<Vec<u64>> = source_ids.iter().copied().collect();
    for (i, r) in results.iter_mut().enumerate() {
        r.image_id = all.as_ref().map_or(i as u64, |ids| ids[i]);
    }
}

/// Every object of record `i` as evaluation reads it, crowd regions included; a crowd
/// region's label and box are checked as an object's are (the error names the file, the
/// record and the region).
fn eval_objects(index: &RecordIndex, i: usize, num_classes: usize) -> Result<Vec<EvalObject>> {
    let at_record = |problem: String| index.record_error(i, problem);
    let (_, objects) =
        DetectionExample::decode_with(&index.read(i)?).map_err(|e| at_record(e.to_string()))?;
    let crowds = DetectionExample {
        objects: EvalObject::objects(&objects, true),
        ..Default::default()
    };
    check_objects(&crowds, Some(num_classes))
        .map_err(|problem| at_record(format!("crowd region: {problem}")))?;
    Ok(objects)
}

/// The ground truth of a record in pixels (crowd regions included, areas as the record gives
/// them), its `image/source_id` as an integer where it is one, and the image's height and
/// width.
fn ground_truth(
    example: &DetectionExample,
    objects: &[EvalObject],
    image: &DynamicImage,
) -> (Vec<GtBox>, Option<u64>, u32, u32) {
    let (ih, iw) = (image.height(), image.width());
    let gts = objects
        .iter()
        .map(|o| {
            // a crowd region is an ignored region for the COCO metric, a difficult box for
            // VOC's
            GtBox::from_corners(
                o.object.bbox.to_pixels(ih, iw),
                o.area,
                o.object.label as usize,
                o.object.difficult || o.crowd,
                o.crowd,
            )
        })
        .collect();
    (gts, example.source_id.parse().ok(), ih, iw)
}

#[cfg(test)]
mod tests {
    use data::Object;
    use model::BBox;

    use super::*;

    /// A record's crowd regions are ignored regions of the COCO metric (difficult boxes of
    /// VOC's), and its areas, not its boxes', set the size ranges; without an area, the box's
    /// (in pixels).
    #[test]
    fn crowd_regions_and_areas_reach_the_ground_truth() {
        let object = |label: i64, bbox: BBox| Object {
            bbox,
            class_text: String::new(),
            label,
            difficult: false,
            truncated: false,
            view: String::new(),
        };
        let objects = vec![
            EvalObject {
                object: object(1, BBox::new(0.1, 0.1, 0.5, 0.3)),
                crowd: false,
                area: Some(900.0),
            },
            EvalObject {
                object: object(2, BBox::new(0.0, 0.0, 1.0, 1.0)),
                crowd: true,
                area: Some(5000.0),
            },
            EvalObject {
                object: object(1, BBox::new(0.5, 0.5, 0.75, 1.0)),
                crowd: false,
                area: None,
            },
        ];
        let example = DetectionExample {
            source_id: "139".into(),
            ..Default::default()
        };
        let image = DynamicImage::ImageRgb8(RgbImage::new(200, 100));
        let (gts, id, ih, iw) = ground_truth(&example, &objects, &image);
        assert_eq!((id, ih, iw), (Some(139), 100, 200));
        let got: Vec<(usize, bool, bool, f64)> = gts
            .iter()
            .map(|g| (g.class_id, g.crowd, g.difficult, g.area))
            .collect();
        assert_eq!(
            got,
            [
                (1, false, false, 900.0),
                (2, true, true, 5000.0),
                (1, false, false, 25.0 * 100.0),
            ]
        );
        assert_eq!(
            gts[0].coco_box.width,
            f64::from(0.3f32 * 200.0 - 0.1f32 * 200.0)
        );
        let mut results = vec![ImageResult::default(); 2];
        number_images(&mut results, &[Some(139), Some(7)]);
        assert_eq!((results[0].image_id, results[1].image_id), (139, 7));
        number_images(&mut results, &[Some(139), None]);
        assert_eq!((results[0].image_id, results[1].image_id), (0, 1));
    }
}
