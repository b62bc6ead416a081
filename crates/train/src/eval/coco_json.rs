//! The COCO JSON formats (ground truth and results), for scoring any detector's output.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use data::coco::{crowd_flag, pixel_box};
use serde_json::Value;

use super::metrics::{CocoBox, DetBox, GtBox, ImageResult};

/// `[x, y, width, height]` of `entry` (e.g. "annotations[3]") in f64, as pycocotools reads
/// it: four numbers, finite in f32 as training data reads them (their sums too), the width
/// and height not negative.
fn bbox_from(v: &Value, entry: &str) -> Result<CocoBox> {
    let b = pixel_box(v).map_err(|problem| anyhow!("{entry}: {problem}"))?;
    if b.width() < 0.0 || b.height() < 0.0 {
        bail!("{entry}: `bbox` {v} must be finite with a width and height of at least 0");
    }
    // `pixel_box` read four numbers
    let n = |i: usize| v[i].as_f64().unwrap_or_default();
    Ok(CocoBox {
        x: n(0),
        y: n(1),
        width: n(2),
        height: n(3),
    })
}

/// The categories by id: the class id each has in the class list, and the class names.
#[derive(Debug)]
struct Categories {
    /// Class id by category id.
    class_of: HashMap<u64, usize>,
    /// Class names by class id from 1.
    names: Vec<String>,
}

impl Categories {
    /// The class id of `entry`'s `category_id`, one of the categories.
    fn class_of(&self, v: &Value, entry: &str) -> Result<usize> {
        let id = &v["category_id"];
        id.as_u64()
            .and_then(|c| self.class_of.get(&c).copied())
            .with_context(|| format!("{entry}: `category_id` {id} is not one of the categories"))
    }
}

/// The class names, a class per id from the smallest id (0 or 1) to the largest: COCO's own
/// ids have gaps (80 in 1..=90), and an id without a category is named `class_<id>` (it has
/// no ground truth, so the metrics leave it out). Ids are integers of at least 0, each once;
/// ids from 0 (Roboflow's exports) are categories as any other, as pycocotools has them:
/// class id = category id + 1 then, the order kept.
fn read_categories(gt: &Value) -> Result<Categories> {
    let entries = gt["categories"].as_array().context("no `categories`")?;
    let mut by_id: BTreeMap<u64, String> = BTreeMap::new();
    for (i, c) in entries.iter().enumerate() {
        let id = c["id"]
            .as_u64()
            .filter(|id| *id <= MAX_CATEGORY_ID)
            .with_context(|| {
                format!(
                    "categories[{i}]: `id` {} is not an integer from 0 to {MAX_CATEGORY_ID}",
                    c["id"]
                )
            })?;
        let name = c["name"].as_str().unwrap_or_default().to_string();
        if by_id.insert(id, name).is_some() {
            bail!("categories[{i}]: category id {id} appears twice");
        }
    }
    let largest = by_id
        .keys()
        .next_back()
        .copied()
        .context("`categories` is empty")?;
    let first = u64::from(!by_id.contains_key(&0));
    let names = (first..=largest)
        .map(|id| {
            by_id
                .get(&id)
                .cloned()
                .unwrap_or_else(|| format!("class_{id}"))
        })
        .collect();
    let class_of = by_id
        .keys()
        .map(|&id| (id, (id + 1 - first) as usize))
        .collect();
    Ok(Categories { class_of, names })
}

/// The largest category id accepted: ids index the class list.
const MAX_CATEGORY_ID: u64 = 100_000;

/// Each image id's place: the images sorted by id, as pycocotools visits them (detections of
/// equal score rank in that order); an id may appear once.
fn read_images(gt: &Value) -> Result<HashMap<u64, usize>> {
    let mut ids = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (i, im) in gt["images"]
        .as_array()
        .context("no `images`")?
        .iter()
        .enumerate()
    {
        let id = im["id"]
            .as_u64()
            .with_context(|| format!("images[{i}]: no integer `id`"))?;
        if !seen.insert(id) {
            bail!("images[{i}]: image id {id} appears twice");
        }
        ids.push(id);
    }
    ids.sort_unstable();
    Ok(ids.into_iter().enumerate().map(|(i, id)| (id, i)).collect())
}

/// The place of `entry`'s image.
fn image_of(v: &Value, entry: &str, slot: &HashMap<u64, usize>) -> Result<usize> {
    let id = &v["image_id"];
    id.as_u64()
        .and_then(|id| slot.get(&id).copied())
        .with_context(|| format!("{entry}: `image_id` {id} is not one of the images"))
}

/// The image place and box of ground-truth annotation `a`. Its `area` (in COCO's own files
/// the mask's, often in another size range than the box) is what the COCO metric's ranges
/// read, as pycocotools reads it; without one, the box's. `iscrowd` is 0, 1, `false` or
/// `true` (pycocotools takes `true` for a crowd as well).
fn ground_truth_box(
    a: &Value,
    entry: &str,
    slot: &HashMap<u64, usize>,
    categories: &Categories,
) -> Result<(usize, GtBox)> {
    let image = image_of(a, entry, slot)?;
    // a crowd region is an ignored region for the COCO metric, a difficult box for VOC's
    let crowd = crowd_flag(&a["iscrowd"]).map_err(|problem| anyhow!("{entry}: {problem}"))?;
    let coco_box = bbox_from(&a["bbox"], entry)?;
    let area = match &a["area"] {
        Value::Null => coco_box.area(),
        v => v
            .as_f64()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .with_context(|| format!("{entry}: `area` {v} is not a number of at least 0"))?,
    };
    let truth = GtBox {
        bbox: coco_box.corners(),
        coco_box,
        area,
        class_id: categories.class_of(a, entry)?,
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
    categories: &Categories,
) -> Result<(usize, DetBox)> {
    let image = image_of(d, entry, slot)?;
    let score = d["score"]
        .as_f64()
        .filter(|s| s.is_finite())
        .with_context(|| format!("{entry}: `score` {} is not a finite number", d["score"]))?;
    let coco_box = bbox_from(&d["bbox"], entry)?;
    let found = DetBox {
        bbox: coco_box.corners(),
        class_id: categories.class_of(d, entry)?,
        score: score as f32,
        coco_box,
        coco_score: score,
    };
    Ok((image, found))
}

/// Reads COCO ground truth (`images`, `annotations`, `categories`) and COCO-format results
/// (`[{image_id, category_id, bbox, score}]`). Returns the images, sorted by id as
/// pycocotools visits them, and the class names by class id (COCO's ids with gaps kept in
/// place; ids from 0 shifted by one). Boxes, areas and scores are read in f64, as pycocotools
/// reads them; a ground truth's `area` gives its size range. Every entry is checked as
/// training data is: a known image and category, a box with finite coordinates and no
/// negative side, a finite score; the error names the file, the entry and the value. Crowd
/// regions (`iscrowd: 1` or `true`) are ignored regions, as pycocotools has them.
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
    let categories = read_categories(&gt).with_context(in_gt)?;
    let slot = read_images(&gt).with_context(in_gt)?;
    let mut images = vec![ImageResult::default(); slot.len()];
    for (&id, &place) in &slot {
        images[place].image_id = id;
    }
    let annotations = gt["annotations"]
        .as_array()
        .context("no `annotations`")
        .with_context(in_gt)?;
    for (i, a) in annotations.iter().enumerate() {
        let entry = format!("annotations[{i}]");
        let (image, truth) = ground_truth_box(a, &entry, &slot, &categories).with_context(in_gt)?;
        images[image].ground_truth.push(truth);
    }
    let in_dt = || detections.display().to_string();
    let list = dt
        .as_array()
        .context("expected a list of detections")
        .with_context(in_dt)?;
    for (i, d) in list.iter().enumerate() {
        let entry = format!("detections[{i}]");
        let (image, found) = detection_box(d, &entry, &slot, &categories).with_context(in_dt)?;
        images[image].detections.push(found);
    }
    Ok((images, categories.names))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::eval::{COCO_NAMES, evaluate};

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
    fn a_category_id_twice_or_below_0_is_an_error() {
        let twice = json!({"categories": [{"id": 3, "name": "a"}, {"id": 3, "name": "b"}]});
        let err = read_categories(&twice).unwrap_err().to_string();
        assert_eq!(err, "categories[1]: category id 3 appears twice");
        let negative = json!({"categories": [{"id": -1, "name": "a"}]});
        let err = read_categories(&negative).unwrap_err().to_string();
        assert!(err.contains("`id` -1 is not an integer from 0"), "{err}");
    }

    /// Ids from 0 (Roboflow's exports) are categories as any other, as for pycocotools and
    /// for preparation (which makes them labels 1..=K): class id = category id + 1.
    #[test]
    fn category_ids_from_0_are_categories() {
        let zero = json!({"categories": [{"id": 2, "name": "b"}, {"id": 0, "name": "cells"}]});
        let c = read_categories(&zero).unwrap();
        assert_eq!(c.names, ["cells", "class_1", "b"]);
        assert_eq!((c.class_of[&0], c.class_of[&2]), (1, 3));
    }

    /// The numbers pycocotools' COCOeval gives on the generated files of `testdata/`, to the
    /// last bit: `scripts/cocoeval_reference.py` wrote the files and ran pycocotools 2.0.11
    /// (numpy 2.4.6) on them. `ties`: image ids out of order, scores in steps of 1/256 tying
    /// across images, annotation areas in other ranges than their boxes' (some on the
    /// limits), crowd regions as `iscrowd: 1` and `true` with detections on them, IoUs of
    /// exactly 0.7 and 0.85, classes of 20 and 100 objects, an image of 130 detections;
    /// `zero`: category ids from 0.
    #[test]
    fn equals_pycocotools_on_generated_files() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/eval/testdata");
        for case in ["ties", "zero"] {
            let file = |kind: &str| dir.join(format!("{case}.{kind}.json"));
            let (images, names) = read_coco(&file("gt"), &file("dt")).unwrap();
            let ours = evaluate(&images, &names).coco();
            let expected: Value =
                serde_json::from_str(&std::fs::read_to_string(file("expected")).unwrap()).unwrap();
            let want: Vec<f64> = expected["stats_bits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| f64::from_bits(b.as_u64().unwrap()))
                .collect();
            let show = |v: &[f64]| {
                v.iter()
                    .zip(COCO_NAMES)
                    .map(|(x, n)| format!("{n} {x:.4}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            assert_eq!(
                ours.to_vec(),
                want,
                "{case}:\n ours        {}\n pycocotools {}",
                show(&ours),
                show(&want)
            );
        }
    }

    /// `iscrowd: true` is a crowd, as pycocotools takes it; the `area` sets the size range.
    #[test]
    fn crowds_as_booleans_and_areas_are_read() {
        let annotation = |crowd: Value, area: Value| {
            let a = json!({"id": 9, "image_id": 20, "category_id": 1, "bbox": [0, 0, 40, 40],
                           "iscrowd": crowd, "area": area});
            let (_dir, images) = files(Some(a), json!([]));
            images.map(|im| im[1].ground_truth[2])
        };
        let g = annotation(json!(true), json!(900)).unwrap();
        assert!(g.crowd && g.difficult);
        assert_eq!((g.area, g.coco_box.area()), (900.0, 1600.0));
        assert!(!annotation(json!(false), json!(900.5)).unwrap().crowd);
        for (crowd, area, want) in [
            (
                json!(2),
                json!(1),
                "annotations[3]: `iscrowd` 2 is not 0, 1, false or true",
            ),
            (
                json!(0),
                json!(-1),
                "annotations[3]: `area` -1 is not a number of at least 0",
            ),
            (
                json!(0),
                json!("big"),
                "annotations[3]: `area` \"big\" is not a number",
            ),
        ] {
            let err = format!("{:#}", annotation(crowd, area).unwrap_err());
            assert!(err.contains(want), "{want}\n{err}");
        }
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
                with("score", json!("0.5")),
                "dt.json: detections[0]: `score` \"0.5\" is not a finite number",
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
