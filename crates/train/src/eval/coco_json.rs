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

/// The `category_id` of `entry`, one of the categories (`known[id]`).
fn category_of(v: &Value, entry: &str, known: &[bool]) -> Result<usize> {
    let id = &v["category_id"];
    match id.as_u64().map(|c| c as usize) {
        Some(c) if known.get(c).copied().unwrap_or(false) => Ok(c),
        _ => bail!("{entry}: `category_id` {id} is not one of the categories"),
    }
}

/// The class names by id, from 1 to the largest id: COCO's own ids have gaps (80 in 1..=90),
/// and an id without a category is named `class_<id>` (it has no ground truth, so the
/// metrics leave it out); also the ids that are categories. An id must be at least 1 and
/// appear once.
fn read_categories(gt: &Value) -> Result<(Vec<String>, Vec<bool>)> {
    let entries = gt["categories"].as_array().context("no `categories`")?;
    let mut by_id: std::collections::BTreeMap<usize, String> = Default::default();
    for (i, c) in entries.iter().enumerate() {
        let id = c["id"]
            .as_u64()
            .filter(|id| (1..=MAX_CATEGORY_ID).contains(id))
            .with_context(|| {
                format!(
                    "categories[{i}]: `id` {} is not an integer from 1 to {MAX_CATEGORY_ID}",
                    c["id"]
                )
            })?;
        let name = c["name"].as_str().unwrap_or_default().to_string();
        if by_id.insert(id as usize, name).is_some() {
            bail!("categories[{i}]: category id {id} appears twice");
        }
    }
    let largest = by_id
        .keys()
        .next_back()
        .copied()
        .context("`categories` is empty")?;
    let names = (1..=largest)
        .map(|id| {
            by_id
                .get(&id)
                .cloned()
                .unwrap_or_else(|| format!("class_{id}"))
        })
        .collect();
    let known = (0..=largest).map(|id| by_id.contains_key(&id)).collect();
    Ok((names, known))
}

/// The largest category id accepted: ids index the class list.
const MAX_CATEGORY_ID: u64 = 100_000;

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
    known: &[bool],
) -> Result<(usize, GtBox)> {
    let image = image_of(a, entry, slot)?;
    // a crowd region is an ignored region for the COCO metric, a difficult box for VOC's
    let crowd = a["iscrowd"].as_u64() == Some(1);
    let truth = GtBox {
        bbox: bbox_from(&a["bbox"], entry)?,
        class_id: category_of(a, entry, known)?,
        difficult: crowd,
        crowd,
    };
    Ok((image, truth))
}

/// The image place and box of detection `d`, its score finite.
fn detection_box(
    d: &Value,
    entry: &str,
    slot: &HashMap<u64, usize>,
    known: &[bool],
) -> Result<(usize, DetBox)> {
    let image = image_of(d, entry, slot)?;
    let score = d["score"]
        .as_f64()
        .map(|s| s as f32)
        .filter(|s| s.is_finite());
    let found = DetBox {
        bbox: bbox_from(&d["bbox"], entry)?,
        class_id: category_of(d, entry, known)?,
        score: score
            .with_context(|| format!("{entry}: `score` {} is not a finite number", d["score"]))?,
    };
    Ok((image, found))
}

/// Reads COCO ground truth (`images`, `annotations`, `categories`) and COCO-format results
/// (`[{image_id, category_id, bbox, score}]`). Returns the images and the class names by id
/// (COCO's ids with gaps kept in place). Every entry is checked as training data is: a known
/// image and category, a box with finite coordinates and no negative side, a finite score;
/// the error names the file, the entry and the value. Crowd regions (`iscrowd: 1`) are
/// ignored regions, as pycocotools has them.
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
    let (names, known) = read_categories(&gt).with_context(in_gt)?;
    let slot = read_images(&gt).with_context(in_gt)?;
    let mut images = vec![ImageResult::default(); slot.len()];
    let annotations = gt["annotations"]
        .as_array()
        .context("no `annotations`")
        .with_context(in_gt)?;
    for (i, a) in annotations.iter().enumerate() {
        let entry = format!("annotations[{i}]");
        let (image, truth) = ground_truth_box(a, &entry, &slot, &known).with_context(in_gt)?;
        images[image].ground_truth.push(truth);
    }
    let in_dt = || detections.display().to_string();
    let list = dt
        .as_array()
        .context("expected a list of detections")
        .with_context(in_dt)?;
    for (i, d) in list.iter().enumerate() {
        let entry = format!("detections[{i}]");
        let (image, found) = detection_box(d, &entry, &slot, &known).with_context(in_dt)?;
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

    /// COCO's own files: category ids with gaps (the class list keeps them in place, the gap
    /// has no ground truth and is left out of the means) and crowd regions, whose detections
    /// pycocotools ignores (any number of them, by their overlap with the region over their
    /// own area) and VOC's metric takes for difficult boxes (ignoring a detection only where
    /// it overlaps one by an IoU of 0.5 or more).
    #[test]
    fn sparse_category_ids_are_kept_and_crowd_regions_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let gt = json!({
            "images": [{"id": 10}, {"id": 20}],
            "annotations": [
                {"id": 1, "image_id": 10, "category_id": 1, "bbox": [10, 20, 100, 80]},
                {"id": 2, "image_id": 20, "category_id": 3, "bbox": [200, 10, 90, 120]},
                {"id": 3, "image_id": 20, "category_id": 1, "bbox": [0, 150, 100, 100], "iscrowd": 1},
            ],
            "categories": [{"id": 3, "name": "dog"}, {"id": 1, "name": "cat"}],
        });
        // two cats inside the crowd region, ranked above the true one: false positives
        // but for the crowd, which would make the cat's AP (1 + 100/3) / 101
        let detections = json!([
            {"image_id": 20, "category_id": 1, "bbox": [10, 160, 40, 40], "score": 0.95},
            {"image_id": 20, "category_id": 1, "bbox": [60, 200, 30, 30], "score": 0.93},
            {"image_id": 10, "category_id": 1, "bbox": [10, 20, 100, 80], "score": 0.9},
            {"image_id": 20, "category_id": 3, "bbox": [200, 10, 90, 120], "score": 0.6},
        ]);
        let (g, d) = (dir.path().join("gt.json"), dir.path().join("dt.json"));
        std::fs::write(&g, gt.to_string()).unwrap();
        std::fs::write(&d, detections.to_string()).unwrap();
        let (images, names) = read_coco(&g, &d).unwrap();
        assert_eq!(names, ["cat", "class_2", "dog"]);
        let m = evaluate(&images, &names);
        // recall counts the true cat and dog only: a crowd is no object to find
        for ap in [m.AP, m.AP50, m.AP75, m.AR100] {
            assert!((ap - 1.0).abs() < 1e-12, "{m:?}");
        }
        // VOC: the crowd's IoU with each of the two small boxes is below 0.5, so they are
        // false positives there: the cat's precision is 1/3 at its only recall point
        assert!((m.voc_AP["cat"] - 1.0 / 3.0).abs() < 1e-12, "{m:?}");
        assert!((m.voc_AP["dog"] - 1.0).abs() < 1e-12, "{m:?}");
        // the gap is no category
        std::fs::write(
            &d,
            json!([{"image_id": 10, "category_id": 2, "bbox": [0, 0, 5, 5], "score": 0.5}])
                .to_string(),
        )
        .unwrap();
        let err = format!("{:#}", read_coco(&g, &d).unwrap_err());
        assert!(
            err.contains("`category_id` 2 is not one of the categories"),
            "{err}"
        );
    }

    #[test]
    fn a_category_id_twice_or_below_1_is_an_error() {
        let twice = json!({"categories": [{"id": 3, "name": "a"}, {"id": 3, "name": "b"}]});
        let err = read_categories(&twice).unwrap_err().to_string();
        assert_eq!(err, "categories[1]: category id 3 appears twice");
        let zero = json!({"categories": [{"id": 0, "name": "background"}]});
        let err = read_categories(&zero).unwrap_err().to_string();
        assert!(err.contains("`id` 0 is not an integer from 1"), "{err}");
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
                "dt.json: detections[0]: `category_id` 3 is not one of the categories",
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
