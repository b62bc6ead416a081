//! The COCO JSON formats (ground truth and results), for scoring any detector's output.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use data::coco::pixel_box;
use model::BBox;
use serde_json::Value;

use super::metrics::{DetBox, GtBox, ImageResult};

/// `[x, y, width, height]` of `entry` (e.g. "annotations[3]"): four finite numbers, as
/// training data reads them, the width and height not negative.
fn bbox_from(v: &Value, entry: &str) -> Result<BBox> {
    let b = pixel_box(v).map_err(|problem| anyhow!("{entry}: {problem}"))?;
    if b.width() < 0.0 || b.height() < 0.0 {
        bail!("{entry}: `bbox` {v} must be finite with a width and height of at least 0");
    }
    Ok(b)
}

/// The `category_id` of `entry`, one of the `num_classes` categories.
fn category_of(v: &Value, entry: &str, num_classes: usize) -> Result<usize> {
    let id = &v["category_id"];
    match id.as_u64() {
        Some(c) if (1..=num_classes as u64).contains(&c) => Ok(c as usize),
        _ => bail!("{entry}: `category_id` {id} is not one of the categories (1..={num_classes})"),
    }
}

/// The class names by id; the ids must be 1..=N.
fn read_categories(gt: &Value) -> Result<Vec<String>> {
    let mut categories: Vec<(u64, String)> = gt["categories"]
        .as_array()
        .context("no `categories`")?
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let id = c["id"]
                .as_u64()
                .with_context(|| format!("categories[{i}]: no integer `id`"))?;
            Ok((id, c["name"].as_str().unwrap_or_default().to_string()))
        })
        .collect::<Result<_>>()?;
    categories.sort();
    let ids: Vec<u64> = categories.iter().map(|c| c.0).collect();
    if ids.is_empty() || ids.iter().enumerate().any(|(i, id)| *id != i as u64 + 1) {
        bail!("category ids must be 1..=N, found {ids:?}");
    }
    Ok(categories.into_iter().map(|(_, name)| name).collect())
}

/// Each image id's place, in the ground truth's order; an id may appear once.
fn read_images(gt: &Value) -> Result<HashMap<u64, usize>> {
    let mut slot = HashMap::new();
    for (i, im) in gt["images"]
        .as_array()
        .context("no `images`")?
        .iter()
        .enumerate()
    {
        let id = im["id"]
            .as_u64()
            .with_context(|| format!("images[{i}]: no integer `id`"))?;
        if slot.insert(id, slot.len()).is_some() {
            bail!("images[{i}]: image id {id} appears twice");
        }
    }
    Ok(slot)
}

/// The place of `entry`'s image.
fn image_of(v: &Value, entry: &str, slot: &HashMap<u64, usize>) -> Result<usize> {
    let id = &v["image_id"];
    id.as_u64()
        .and_then(|id| slot.get(&id).copied())
        .with_context(|| format!("{entry}: `image_id` {id} is not one of the images"))
}

/// The image place and box of ground-truth annotation `a`.
fn ground_truth_box(
    a: &Value,
    entry: &str,
    slot: &HashMap<u64, usize>,
    num_classes: usize,
) -> Result<(usize, GtBox)> {
    let image = image_of(a, entry, slot)?;
    let truth = GtBox {
        bbox: bbox_from(&a["bbox"], entry)?,
        class_id: category_of(a, entry, num_classes)?,
        difficult: false,
    };
    Ok((image, truth))
}

/// The image place and box of detection `d`, its score finite.
fn detection_box(
    d: &Value,
    entry: &str,
    slot: &HashMap<u64, usize>,
    num_classes: usize,
) -> Result<(usize, DetBox)> {
    let image = image_of(d, entry, slot)?;
    let score = d["score"]
        .as_f64()
        .map(|s| s as f32)
        .filter(|s| s.is_finite());
    let found = DetBox {
        bbox: bbox_from(&d["bbox"], entry)?,
        class_id: category_of(d, entry, num_classes)?,
        score: score
            .with_context(|| format!("{entry}: `score` {} is not a finite number", d["score"]))?,
    };
    Ok((image, found))
}

/// Reads COCO ground truth (`images`, `annotations`, `categories`) and COCO-format results
/// (`[{image_id, category_id, bbox, score}]`). Returns the images and the class names by id
/// (ids must be 1..=N). Every entry is checked as training data is: a known image and
/// category, a box with finite coordinates and no negative side, a finite score; the error
/// names the file, the entry and the value. Crowd annotations are rejected (not supported).
pub fn read_coco(
    ground_truth: &Path,
    detections: &Path,
) -> Result<(Vec<ImageResult>, Vec<String>)> {
    let read = |p: &Path| -> Result<Value> {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", p.display()))
    };
    let (gt, dt) = (read(ground_truth)?, read(detections)?);
    let in_gt = || ground_truth.display().to_string();
    let names = read_categories(&gt).with_context(in_gt)?;
    let slot = read_images(&gt).with_context(in_gt)?;
    let mut images = vec![ImageResult::default(); slot.len()];
    let annotations = gt["annotations"]
        .as_array()
        .context("no `annotations`")
        .with_context(in_gt)?;
    for (i, a) in annotations.iter().enumerate() {
        let entry = format!("annotations[{i}]");
        if a["iscrowd"].as_u64() == Some(1) {
            bail!("{}: {entry}: crowd annotations are not supported", in_gt());
        }
        let (image, truth) = ground_truth_box(a, &entry, &slot, names.len()).with_context(in_gt)?;
        images[image].ground_truth.push(truth);
    }
    let in_dt = || detections.display().to_string();
    let list = dt
        .as_array()
        .context("expected a list of detections")
        .with_context(in_dt)?;
    for (i, d) in list.iter().enumerate() {
        let entry = format!("detections[{i}]");
        let (image, found) = detection_box(d, &entry, &slot, names.len()).with_context(in_dt)?;
        images[image].detections.push(found);
    }
    Ok((images, names))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::eval::evaluate;

    /// Ground truth of two images, a cat in each and a dog in the second, with `annotation`
    /// added; the detections as given.
    fn files(
        annotation: Option<Value>,
        detections: Value,
    ) -> (tempfile::TempDir, Result<Vec<ImageResult>>) {
        let dir = tempfile::tempdir().unwrap();
        let mut annotations = vec![
            json!({"id": 1, "image_id": 10, "category_id": 1, "bbox": [10, 20, 100, 80]}),
            json!({"id": 2, "image_id": 20, "category_id": 1, "bbox": [50, 50, 60, 60]}),
            json!({"id": 3, "image_id": 20, "category_id": 2, "bbox": [200, 10, 90, 120]}),
        ];
        annotations.extend(annotation);
        let gt = json!({
            "images": [{"id": 10, "width": 400, "height": 300}, {"id": 20, "width": 400, "height": 300}],
            "annotations": annotations,
            "categories": [{"id": 2, "name": "dog"}, {"id": 1, "name": "cat"}],
        });
        let (g, d) = (dir.path().join("gt.json"), dir.path().join("dt.json"));
        std::fs::write(&g, gt.to_string()).unwrap();
        std::fs::write(&d, detections.to_string()).unwrap();
        let read = read_coco(&g, &d).map(|(images, names)| {
            assert_eq!(names, ["cat", "dog"]);
            images
        });
        (dir, read)
    }

    #[test]
    fn an_image_id_twice_is_an_error() {
        let gt = json!({"images": [{"id": 4}, {"id": 5}, {"id": 4}]});
        let err = read_images(&gt).unwrap_err().to_string();
        assert_eq!(err, "images[2]: image id 4 appears twice");
    }

    #[test]
    fn scores_coco_files_as_worked_out_by_hand() {
        let detections = json!([
            {"image_id": 10, "category_id": 1, "bbox": [10, 20, 100, 80], "score": 0.9},
            // far from any cat: a false positive ranked between the two true ones
            {"image_id": 20, "category_id": 1, "bbox": [300, 200, 50, 50], "score": 0.8},
            {"image_id": 20, "category_id": 1, "bbox": [50, 50, 60, 60], "score": 0.7},
            {"image_id": 20, "category_id": 2, "bbox": [200, 10, 90, 120], "score": 0.6},
        ]);
        let (_dir, images) = files(None, detections);
        let m = evaluate(&images.unwrap(), &["cat".into(), "dog".into()]);
        // cat: precision 1 up to recall 0.5, then 2/3 up to recall 1 (the boxes match
        // exactly, so at every IoU threshold): 51 of COCO's 101 recall points at 1, 50 at
        // 2/3; dog: 1
        let cat = (51.0 + 50.0 * 2.0 / 3.0) / 101.0;
        let want = (cat + 1.0) / 2.0;
        assert!(
            (m.AP - want).abs() < 1e-9 && (m.AP50 - want).abs() < 1e-9,
            "{m:?}"
        );
    }

    #[test]
    fn bad_entries_are_errors_naming_the_file_entry_and_value() {
        let det = |v: Value| json!([v]);
        let ok = json!({"image_id": 10, "category_id": 1, "bbox": [0, 0, 5, 5], "score": 0.5});
        let with = |key: &str, value: Value| {
            let mut d = ok.clone();
            d[key] = value;
            d
        };
        for (annotation, detection, want) in [
            (
                None,
                with("category_id", json!(3)),
                "dt.json: detections[0]: `category_id` 3 is not one of the categories (1..=2)",
            ),
            (
                None,
                with("bbox", json!([0, 0, -4, 5])),
                "dt.json: detections[0]: `bbox` [0,0,-4,5] must be finite",
            ),
            // finite corners whose sum is not
            (
                None,
                with("bbox", json!([3e38, 0, 3e38, 5])),
                "dt.json: detections[0]: `bbox` [3e+38,0,3e+38,5] must be finite",
            ),
            (
                None,
                with("image_id", json!(30)),
                "dt.json: detections[0]: `image_id` 30 is not one of the images",
            ),
            (
                None,
                with("score", json!(1e300)),
                "dt.json: detections[0]: `score` 1e+300 is not a finite number",
            ),
            (
                Some(with("category_id", json!(0))),
                ok.clone(),
                "gt.json: annotations[3]: `category_id` 0 is not one",
            ),
            (
                Some(with("bbox", json!([1, 2, 3, -1]))),
                ok.clone(),
                "gt.json: annotations[3]: `bbox` [1,2,3,-1] must be finite",
            ),
        ] {
            let (_dir, read) = files(annotation, det(detection));
            let err = format!("{:#}", read.unwrap_err());
            assert!(err.contains(want), "{want}\n{err}");
        }
    }
}
