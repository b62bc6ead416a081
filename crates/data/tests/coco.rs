//! COCO annotation files prepared as shards: sparse category ids, crowd regions, empty images,
//! degenerate boxes and invalid entries, each with its exact outcome; a second split joining
//! the folder; the loader reading the labels back.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use data::coco::{CocoOptions, CocoPrepared, prepare_coco};
use data::loader::{Loader, LoaderConfig, Position};
use data::shards::expand_patterns;
use data::tfrecord::{RecordIndex, read_all};
use data::{DetectionExample, LabelMap, Result};
use image::{DynamicImage, ImageFormat, Rgb, RgbImage};
use serde_json::{Value, json};

use common::listing;

/// What an error about one entry ends with.
const SKIP_HINT: &str =
    "\n(to skip such examples and count them, run prepare-data with --skip-invalid)";

fn picture(w: u32, h: u32) -> DynamicImage {
    DynamicImage::ImageRgb8(RgbImage::from_fn(w, h, |x, y| {
        Rgb([(x * 3) as u8, (y * 2) as u8, ((x ^ y) % 256) as u8])
    }))
}

fn encoded(img: &DynamicImage, format: ImageFormat) -> Vec<u8> {
    let mut out = Vec::new();
    img.write_to(&mut std::io::Cursor::new(&mut out), format)
        .unwrap();
    out
}

/// The images of [`annotations`]: an RGB JPEG of 200x100, a PNG of 160x120 in a subfolder,
/// an RGB JPEG and a grayscale JPEG of 160x120, and a JPEG cut short.
fn image_folder(root: &Path) -> PathBuf {
    let images = root.join("images");
    std::fs::create_dir_all(images.join("sub")).unwrap();
    let small = picture(160, 120);
    let files = [
        ("a.jpg", encoded(&picture(200, 100), ImageFormat::Jpeg)),
        ("sub/b.png", encoded(&small, ImageFormat::Png)),
        ("c.jpg", encoded(&small, ImageFormat::Jpeg)),
        (
            "d.jpg",
            encoded(
                &DynamicImage::ImageLuma8(small.to_luma8()),
                ImageFormat::Jpeg,
            ),
        ),
    ];
    for (name, bytes) in &files {
        std::fs::write(images.join(name), bytes).unwrap();
    }
    let jpeg = &files[2].1;
    std::fs::write(images.join("cut.jpg"), &jpeg[..jpeg.len() / 2]).unwrap();
    images
}

/// A COCO file over [`image_folder`]: COCO's sparse ids (3, 18, 90), a crowd region, an image
/// without annotations, a box reaching out of its image, and boxes without area. serde_json
/// writes the keys sorted, so `annotations` come before `images`, as they may in any file.
fn annotations() -> Value {
    json!({
        "info": {"description": "test"},
        "images": [
            {"id": 100, "file_name": "a.jpg", "width": 200, "height": 100},
            {"id": 7, "file_name": "sub/b.png", "width": 160, "height": 120},
            {"id": 8, "file_name": "c.jpg", "width": 160, "height": 120},
            {"id": 9, "file_name": "d.jpg", "width": 160, "height": 120},
        ],
        "annotations": [
            {"id": 1, "image_id": 100, "category_id": 3, "bbox": [10, 20, 50, 30],
             "segmentation": [[10, 20, 60, 20, 60, 50]], "area": 1500, "iscrowd": 0},
            // reaches out of the image on the right and at the bottom: clipped
            {"id": 2, "image_id": 100, "category_id": 18, "bbox": [150.5, 50, 80, 80]},
            {"id": 3, "image_id": 100, "category_id": 90, "bbox": [0, 0, 10, 10], "iscrowd": 1,
             "segmentation": {"counts": [0, 100, 19900], "size": [100, 200]}},
            // no width; wholly outside the image; a negative width: all dropped
            {"id": 4, "image_id": 100, "category_id": 3, "bbox": [5, 5, 0, 10]},
            {"id": 5, "image_id": 100, "category_id": 3, "bbox": [250, 10, 20, 20]},
            {"id": 21, "image_id": 9, "category_id": 3, "bbox": [100, 60, -5, 10]},
            {"id": 6, "image_id": 7, "category_id": 90, "bbox": [0, 0, 160, 120]},
            {"id": 20, "image_id": 9, "category_id": 18, "bbox": [16, 12, 32, 24.6]},
        ],
        "categories": [
            {"id": 90, "name": "toothbrush", "supercategory": "indoor"},
            {"id": 3, "name": "car"},
            {"id": 18, "name": "dog"},
        ],
    })
}

/// The boxes each image should get, `(label, [ymin, xmin, ymax, xmax])`, worked out from
/// [`annotations`] by hand.
fn expected_boxes() -> BTreeMap<String, Vec<(i64, [f32; 4])>> {
    BTreeMap::from([
        (
            "100".to_string(),
            vec![
                (3, [20.0 / 100.0, 10.0 / 200.0, 50.0 / 100.0, 60.0 / 200.0]),
                (18, [50.0 / 100.0, 150.5 / 200.0, 1.0, 1.0]),
            ],
        ),
        ("7".to_string(), vec![(90, [0.0, 0.0, 1.0, 1.0])]),
        ("8".to_string(), vec![]),
        (
            "9".to_string(),
            vec![(18, [12.0 / 120.0, 16.0 / 160.0, 36.6 / 120.0, 48.0 / 160.0])],
        ),
    ])
}

fn options(images: &Path) -> CocoOptions {
    CocoOptions {
        images: images.to_path_buf(),
        split: "train".into(),
        num_shards: 2,
        contiguous_ids: false,
        skip_empty: false,
        skip_invalid: false,
    }
}

fn prepare(json: &Value, out: &Path, options: &CocoOptions) -> Result<CocoPrepared> {
    let file = out.with_extension("json");
    std::fs::write(&file, json.to_string()).unwrap();
    prepare_coco(&file, out, options, &|_, _| {})
}

/// The examples of a split by `image/source_id`.
fn examples(out: &Path, split: &str) -> BTreeMap<String, DetectionExample> {
    let files = expand_patterns(&[format!("{}/{split}.record-*", out.display())]).unwrap();
    files
        .iter()
        .flat_map(|f| read_all(f).unwrap())
        .map(|r| DetectionExample::decode(&r).unwrap())
        .map(|e| (e.source_id.clone(), e))
        .collect()
}

fn manifest(out: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap()
}

#[test]
fn boxes_equal_the_annotations_and_labels_name_the_categories() {
    let dir = tempfile::tempdir().unwrap();
    let images = image_folder(dir.path());
    let out = dir.path().join("coco");
    let json = annotations();
    let prepared = prepare(&json, &out, &options(&images)).unwrap();
    let s = &prepared.summary;
    assert_eq!(s.written.images, 4, "{s:?}");
    assert_eq!(
        (s.crowd_regions, s.empty_images, s.empty_skipped),
        (1, 1, 0)
    );
    // the PNG and the grayscale JPEG
    assert_eq!(s.cleanup.reencoded, 2);
    assert_eq!((s.cleanup.boxes_clipped, s.cleanup.boxes_dropped), (1, 3));
    assert!(s.skipped.is_empty() && s.images_skipped == 0);
    assert_eq!(
        listing(&out),
        [
            "label_map.pbtxt",
            "manifest.json",
            "train.record-00000-of-00002",
            "train.record-00001-of-00002"
        ]
    );
    let written = examples(&out, "train");
    let map = LabelMap::load(&out.join("label_map.pbtxt")).unwrap();
    let name_of = |coco_id: i64| {
        json["categories"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == coco_id)
            .map(|c| c["name"].as_str().unwrap().to_string())
    };
    let want = expected_boxes();
    assert_eq!(
        written.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (id, e) in &written {
        assert_eq!(e.format, "jpeg");
        let img = image::load_from_memory(&e.encoded).unwrap();
        assert!(matches!(img, DynamicImage::ImageRgb8(_)), "{id}");
        assert_eq!(
            (img.width() as i64, img.height() as i64),
            (e.width, e.height)
        );
        assert_eq!(e.objects.len(), want[id].len(), "{id}: {:?}", e.objects);
        for (o, (label, corners)) in e.objects.iter().zip(&want[id]) {
            // COCO's ids are the labels, and the label map names each as its category
            assert_eq!(o.label, *label, "{id}");
            assert_eq!(Some(o.class_text.clone()), name_of(*label));
            let in_map = map.items.iter().find(|it| it.id == o.label).unwrap();
            assert_eq!(in_map.name, o.class_text);
            let got = o.bbox.to_array();
            for (g, w) in got.iter().zip(corners) {
                assert!((g - w).abs() < 1e-4, "{id}: {got:?} != {corners:?}");
            }
        }
    }
    assert_eq!(written["100"].filename, "a.jpg");
    assert_eq!(map.names(), ["car", "dog", "toothbrush"]);
    let m = manifest(&out);
    assert_eq!(m["label_ids"], json!({"3": 3, "18": 18, "90": 90}));
    assert_eq!(m["num_classes"], 90);
    assert_eq!(m["summary"]["splits"]["train"]["crowd_regions"], 1);
    assert_eq!(m["request"]["splits"]["train"]["num_shards"], 2);

    // --skip-empty leaves the image without annotations out
    let skip_empty = CocoOptions {
        skip_empty: true,
        ..options(&images)
    };
    let s = prepare(&json, &dir.path().join("no_empty"), &skip_empty)
        .unwrap()
        .summary;
    assert_eq!(
        (s.written.images, s.empty_images, s.empty_skipped),
        (3, 1, 1)
    );
    assert!(!examples(&dir.path().join("no_empty"), "train").contains_key("8"));
}

/// `annotations()` changed by `change`, and what preparing it should say and skip.
struct Case {
    change: fn(&mut Value),
    error: &'static str,
    /// The entry skipped with `--skip-invalid`.
    skipped: &'static str,
    /// Images written then, and images left out.
    written: usize,
    images_skipped: usize,
}

fn push(json: &mut Value, list: &str, entry: Value) {
    json[list].as_array_mut().unwrap().push(entry);
}

#[test]
fn invalid_entries_are_errors_naming_them_or_counted_skips() {
    let dir = tempfile::tempdir().unwrap();
    let images = image_folder(dir.path());
    let cases = [
        Case {
            change: |j| {
                push(
                    j,
                    "annotations",
                    json!({"id": 30, "image_id": 9, "category_id": 91, "bbox": [1, 1, 5, 5]}),
                )
            },
            error: "annotations[8] (id 30): `category_id` 91 is not one of the categories (ids 3, 18, 90)",
            skipped: "annotations[8] (id 30)",
            // its image goes with it: its object would be trained as background
            written: 3,
            images_skipped: 1,
        },
        Case {
            change: |j| {
                push(
                    j,
                    "annotations",
                    json!({"id": 31, "image_id": 555, "category_id": 3, "bbox": [1, 1, 5, 5]}),
                )
            },
            error: "annotations[8] (id 31): `image_id` 555 is not one of the images",
            skipped: "annotations[8] (id 31)",
            written: 4,
            images_skipped: 0,
        },
        Case {
            change: |j| {
                push(
                    j,
                    "annotations",
                    json!({"id": 1, "image_id": 9, "category_id": 3, "bbox": [1, 1, 5, 5]}),
                )
            },
            error: "annotations[8] (id 1): annotation id 1 appears twice (also annotations[0])",
            skipped: "annotations[8] (id 1)",
            written: 3,
            images_skipped: 1,
        },
        Case {
            change: |j| {
                push(
                    j,
                    "annotations",
                    json!({"id": 32, "image_id": 9, "category_id": 3, "bbox": [1, 2, 3]}),
                )
            },
            error: "annotations[8] (id 32): `bbox` must be [x, y, width, height], not [1,2,3]",
            skipped: "annotations[8] (id 32)",
            written: 3,
            images_skipped: 1,
        },
        Case {
            change: |j| {
                push(
                    j,
                    "images",
                    json!({"id": 7, "file_name": "c.jpg", "width": 160, "height": 120}),
                )
            },
            error: "images[4] (id 7, c.jpg): image id 7 appears twice (also images[1])",
            skipped: "images[4] (id 7, c.jpg)",
            written: 4,
            images_skipped: 1,
        },
        Case {
            change: |j| {
                push(
                    j,
                    "images",
                    json!({"id": 11, "file_name": "missing.jpg", "width": 160, "height": 120}),
                )
            },
            error: "images[4] (id 11, missing.jpg): reading",
            skipped: "images[4] (id 11, missing.jpg)",
            written: 4,
            images_skipped: 1,
        },
        Case {
            change: |j| {
                push(
                    j,
                    "images",
                    json!({"id": 12, "file_name": "c.jpg", "width": 100, "height": 120}),
                )
            },
            error: "images[4] (id 12, c.jpg): `width` x `height` is 100x120, but",
            skipped: "images[4] (id 12, c.jpg)",
            written: 4,
            images_skipped: 1,
        },
        Case {
            change: |j| {
                push(
                    j,
                    "images",
                    json!({"id": 13, "file_name": "cut.jpg", "width": 160, "height": 120}),
                )
            },
            error: "images[4] (id 13, cut.jpg): ",
            skipped: "images[4] (id 13, cut.jpg)",
            written: 4,
            images_skipped: 1,
        },
        Case {
            change: |j| {
                push(
                    j,
                    "images",
                    json!({"id": 14, "file_name": "c.jpg", "width": 160}),
                )
            },
            error: "images[4] (id 14): no `height`",
            skipped: "images[4] (id 14)",
            written: 4,
            images_skipped: 1,
        },
    ];
    for (n, case) in cases.iter().enumerate() {
        let mut json = annotations();
        (case.change)(&mut json);
        let out = dir.path().join(format!("case{n}"));
        let err = prepare(&json, &out, &options(&images))
            .unwrap_err()
            .to_string();
        let file = out.with_extension("json");
        assert!(
            err.starts_with(&format!("{}: {}", file.display(), case.error))
                && err.ends_with(SKIP_HINT),
            "{}\n{err}",
            case.error
        );
        assert!(!out.exists() || listing(&out).is_empty(), "nothing written");
        let skip = CocoOptions {
            skip_invalid: true,
            ..options(&images)
        };
        let s = prepare(&json, &out, &skip).unwrap().summary;
        assert_eq!(
            (s.written.images, s.images_skipped),
            (case.written, case.images_skipped),
            "{}",
            case.error
        );
        assert_eq!(s.skipped.len(), 1, "{:?}", s.skipped);
        assert_eq!(s.skipped[0].0, case.skipped);
        // the reason skipped is the error's
        let (what, why) = &s.skipped[0];
        assert!(
            format!("{what}: {why}").starts_with(case.error),
            "{what}: {why}"
        );
        assert_eq!(
            manifest(&out)["summary"]["splits"]["train"]["skipped"][0][0],
            case.skipped
        );
    }
    // the cut JPEG and the missing file, in full
    let mut json = annotations();
    push(
        &mut json,
        "images",
        json!({"id": 13, "file_name": "cut.jpg", "width": 160, "height": 120}),
    );
    let err = prepare(&json, &dir.path().join("cut"), &options(&images))
        .unwrap_err()
        .to_string();
    let cut = images.join("cut.jpg");
    assert!(
        err.contains(&format!(
            "{}: cannot decode image: truncated JPEG",
            cut.display()
        )),
        "{err}"
    );
}

#[test]
fn a_val_split_joins_the_folder_unless_its_categories_differ() {
    let dir = tempfile::tempdir().unwrap();
    let images = image_folder(dir.path());
    let out = dir.path().join("coco");
    prepare(&annotations(), &out, &options(&images)).unwrap();
    let mut val = annotations();
    val["images"].as_array_mut().unwrap().truncate(2);
    val["annotations"]
        .as_array_mut()
        .unwrap()
        .retain(|a| a["image_id"] == 100 || a["image_id"] == 7);
    let val_options = CocoOptions {
        split: "val".into(),
        num_shards: 1,
        ..options(&images)
    };
    let s = prepare(&val, &out, &val_options).unwrap().summary;
    assert_eq!((s.written.images, s.crowd_regions), (2, 1));
    let names = listing(&out);
    assert_eq!(
        names,
        [
            "label_map.pbtxt",
            "manifest.json",
            "train.record-00000-of-00002",
            "train.record-00001-of-00002",
            "val.record-00000-of-00001",
        ]
    );
    let m = manifest(&out);
    let splits: Vec<&String> = m["request"]["splits"].as_object().unwrap().keys().collect();
    assert_eq!(splits, ["train", "val"]);
    assert_eq!(m["summary"]["splits"]["train"]["images"], 4);
    assert_eq!(m["summary"]["splits"]["val"]["images"], 2);
    assert_eq!(examples(&out, "val").len(), 2);
    // a val file whose categories differ: refused, the folder unchanged
    let before: Vec<Vec<u8>> = names
        .iter()
        .map(|n| std::fs::read(out.join(n)).unwrap())
        .collect();
    val["categories"][1]["name"] = json!("automobile");
    let err = prepare(&val, &out, &val_options).unwrap_err().to_string();
    assert!(
        err.contains("manifest.json: split(s) [\"train\"] were prepared from other categories"),
        "{err}"
    );
    let after: Vec<Vec<u8>> = names
        .iter()
        .map(|n| std::fs::read(out.join(n)).unwrap())
        .collect();
    assert!(before == after && listing(&out) == names);
}

#[test]
fn ids_from_zero_or_on_request_become_one_to_k_in_file_order() {
    let dir = tempfile::tempdir().unwrap();
    let images = image_folder(dir.path());
    // --contiguous-ids: toothbrush, car, dog as listed
    let out = dir.path().join("contiguous");
    let contiguous = CocoOptions {
        contiguous_ids: true,
        ..options(&images)
    };
    let prepared = prepare(&annotations(), &out, &contiguous).unwrap();
    assert!(prepared.categories.contiguous);
    let labels: Vec<(i64, i64)> = prepared
        .categories
        .items
        .iter()
        .map(|c| (c.coco_id, c.label))
        .collect();
    assert_eq!(labels, [(90, 1), (3, 2), (18, 3)]);
    let e = examples(&out, "train");
    let got: Vec<(i64, &str)> = e["100"]
        .objects
        .iter()
        .map(|o| (o.label, o.class_text.as_str()))
        .collect();
    assert_eq!(got, [(2, "car"), (3, "dog")]);
    assert_eq!(e["7"].objects[0].label, 1);
    assert_eq!(
        LabelMap::load(&out.join("label_map.pbtxt"))
            .unwrap()
            .names(),
        ["toothbrush", "car", "dog"]
    );
    assert_eq!(
        manifest(&out)["label_ids"],
        json!({"90": 1, "3": 2, "18": 3})
    );
    // ids from 0, as Roboflow exports them: mapped without being asked
    let mut zero = annotations();
    zero["categories"] = json!([{"id": 0, "name": "red"}, {"id": 1, "name": "blue"}]);
    for a in zero["annotations"].as_array_mut().unwrap() {
        a["category_id"] = json!(if a["category_id"] == 3 { 0 } else { 1 });
    }
    let out = dir.path().join("zero");
    prepare(&zero, &out, &options(&images)).unwrap();
    assert_eq!(manifest(&out)["label_ids"], json!({"0": 1, "1": 2}));
    let got: Vec<(i64, String)> = examples(&out, "train")["100"]
        .objects
        .iter()
        .map(|o| (o.label, o.class_text.clone()))
        .collect();
    assert_eq!(got, [(1, "red".to_string()), (2, "blue".to_string())]);
}

#[test]
fn the_loader_reads_the_coco_labels_back() {
    let dir = tempfile::tempdir().unwrap();
    let images = image_folder(dir.path());
    let out = dir.path().join("coco");
    prepare(&annotations(), &out, &options(&images)).unwrap();
    let files = expand_patterns(&[format!("{}/train.record-*", out.display())]).unwrap();
    let index = Arc::new(RecordIndex::build(&files).unwrap());
    let config = LoaderConfig {
        batch_size: 4,
        image_size: [32, 32],
        // COCO's ids run to 90
        num_classes: 90,
        augmentations: vec![],
        shuffle: false,
        seed: 1,
        workers: 1,
        prefetch: 1,
        share: None,
    };
    let batch = Loader::new(index.clone(), config, Position::default())
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    let want = expected_boxes();
    for (record, truth) in batch.records.iter().zip(&batch.ground_truth) {
        let e = DetectionExample::decode(&index.read(*record).unwrap()).unwrap();
        let got: Vec<(i64, [f32; 4])> = truth
            .iter()
            .map(|g| (g.class_id as i64, g.bbox.to_array()))
            .collect();
        assert_eq!(got.len(), want[&e.source_id].len());
        for ((label, corners), (want_label, want_corners)) in got.iter().zip(&want[&e.source_id]) {
            assert_eq!(label, want_label);
            for (g, w) in corners.iter().zip(want_corners) {
                assert!((g - w).abs() < 1e-4, "{corners:?} {want_corners:?}");
            }
        }
    }
    assert_eq!(batch.records.len(), 4);
}

/// Crowd regions and areas are written under the API's names (`image/object/is_crowd`,
/// `image/object/area`), in the file's order, for evaluation; the objects to train on leave
/// the crowds out.
#[test]
fn crowd_regions_and_areas_are_kept_for_evaluation_only() {
    use data::example::proto;
    use prost::Message;

    let dir = tempfile::tempdir().unwrap();
    let images = image_folder(dir.path());
    let out = dir.path().join("coco");
    prepare(&annotations(), &out, &options(&images)).unwrap();
    let files = expand_patterns(&[format!("{}/train.record-*", out.display())]).unwrap();
    let records: Vec<Vec<u8>> = files.iter().flat_map(|f| read_all(f).unwrap()).collect();
    let record = records
        .iter()
        .find(|r| DetectionExample::decode(r).unwrap().source_id == "100")
        .unwrap();
    // image 100: the car (area 1500), the clipped dog (no `area`: its box's, 80 x 80) and the
    // crowd region (10 x 10); the boxes without area are dropped
    let (example, all) = DetectionExample::decode_with(record).unwrap();
    let got: Vec<(i64, bool, Option<f32>)> = all
        .iter()
        .map(|o| (o.object.label, o.crowd, o.area))
        .collect();
    assert_eq!(
        got,
        [
            (3, false, Some(1500.0)),
            (18, false, Some(6400.0)),
            (90, true, Some(100.0))
        ]
    );
    let labels: Vec<i64> = example.objects.iter().map(|o| o.label).collect();
    assert_eq!(labels, [3, 18]);
    let message = proto::Example::decode(record.as_slice()).unwrap();
    let features = message.features.unwrap().feature;
    for key in ["image/object/is_crowd", "image/object/area"] {
        assert!(features.contains_key(key), "{key}");
    }
}

/// `--skip-empty` leaves out the images with nothing to train on: no annotation, or only
/// crowd regions and boxes without area.
#[test]
fn skip_empty_leaves_out_images_with_nothing_to_train_on() {
    let dir = tempfile::tempdir().unwrap();
    let images = image_folder(dir.path());
    let mut json = annotations();
    push(
        &mut json,
        "images",
        json!({"id": 50, "file_name": "c.jpg", "width": 160, "height": 120}),
    );
    push(
        &mut json,
        "annotations",
        json!({"id": 40, "image_id": 50, "category_id": 3, "bbox": [5, 5, 40, 40], "iscrowd": 1}),
    );
    push(
        &mut json,
        "annotations",
        json!({"id": 41, "image_id": 50, "category_id": 3, "bbox": [200, 5, 10, 10]}),
    );
    let skip_empty = CocoOptions {
        skip_empty: true,
        ..options(&images)
    };
    let out = dir.path().join("no_empty");
    let s = prepare(&json, &out, &skip_empty).unwrap().summary;
    // images 8 (no annotation) and 50 (a crowd region and a box outside the image)
    assert_eq!(
        (s.written.images, s.empty_images, s.empty_skipped),
        (3, 2, 2)
    );
    let written = examples(&out, "train");
    assert!(!written.contains_key("8") && !written.contains_key("50"));
    // without --skip-empty both are written, as negatives
    let s = prepare(&json, &dir.path().join("all"), &options(&images))
        .unwrap()
        .summary;
    assert_eq!(
        (s.written.images, s.empty_images, s.crowd_regions),
        (5, 2, 2)
    );
}
