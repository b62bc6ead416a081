//! Malformed inputs, made on the fly in temporary folders, and the exact outcome of each where
//! it enters: records read by the loader (and evaluation: both use `read_checked`), VOC /
//! Oxford-IIIT Pet folders read by `prepare_voc`, and the shard sets `prepare-data` writes.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use data::augment::Augmentation;
use data::example::{Object, proto};
use data::loader::{Loader, LoaderConfig, Position};
use data::prepare::{PrepareSummary, VocOptions, prepare_synthetic, prepare_voc};
use data::shards::expand_patterns;
use data::tfrecord::{RecordIndex, RecordWriter, read_all};
use data::validate::read_checked;
use data::voc::ClassSource;
use data::{DetectionExample, LabelMap, Result};
use image::{DynamicImage, ImageFormat, Rgb, RgbImage};
use model::BBox;
use prost::Message;

use common::listing;

/// What an error about one example of a dataset being prepared ends with.
const SKIP_HINT: &str =
    "\n(to skip such examples and count them, run prepare-data with --skip-invalid)";

fn encoded(format: ImageFormat) -> Vec<u8> {
    let img = DynamicImage::ImageRgb8(RgbImage::from_fn(96, 64, |x, y| {
        Rgb([(x * 2) as u8, (y * 3) as u8, ((x + y) % 256) as u8])
    }));
    let mut out = Vec::new();
    img.write_to(&mut std::io::Cursor::new(&mut out), format)
        .unwrap();
    out
}

fn example(label: i64, bbox: BBox) -> DetectionExample {
    let jpeg = encoded(ImageFormat::Jpeg);
    DetectionExample {
        sha256: data::example::sha256_hex(&jpeg),
        encoded: jpeg,
        format: "jpeg".into(),
        height: 64,
        width: 96,
        filename: "x.jpg".into(),
        source_id: "x.jpg".into(),
        objects: vec![Object {
            bbox,
            class_text: "cat".into(),
            label,
            difficult: false,
            truncated: false,
            view: String::new(),
        }],
    }
}

fn good() -> Vec<u8> {
    example(1, BBox::new(0.1, 0.2, 0.6, 0.7)).encode()
}

fn write_records(path: &Path, records: &[Vec<u8>]) {
    let mut w = RecordWriter::new(Vec::new());
    for r in records {
        w.write(r).unwrap();
    }
    std::fs::write(path, w.into_inner()).unwrap();
}

fn without_labels() -> Vec<u8> {
    let mut msg = proto::Example::decode(good().as_slice()).unwrap();
    let features = &mut msg.features.as_mut().unwrap().feature;
    features.remove("image/object/class/label");
    msg.encode_to_vec()
}

fn with_image(bytes: Vec<u8>) -> Vec<u8> {
    DetectionExample {
        encoded: bytes,
        ..example(1, BBox::new(0.1, 0.2, 0.6, 0.7))
    }
    .encode()
}

/// Every class of bad record, the record's bytes, and the problem the error must state.
fn bad_records() -> Vec<(&'static str, Vec<u8>, String)> {
    let b = || BBox::new(0.1, 0.2, 0.6, 0.7);
    let jpeg = encoded(ImageFormat::Jpeg);
    let png = encoded(ImageFormat::Png);
    let (half_jpeg, half_png) = (jpeg.len() / 2, png.len() / 2);
    vec![
        ("label_above", example(3, b()).encode(), "object 0: `image/object/class/label` is 3, above num_classes 2".into()),
        ("label_far_above", example(1 << 40, b()).encode(), format!("object 0: `image/object/class/label` is {}, above num_classes 2", 1i64 << 40)),
        ("label_zero", example(0, b()).encode(), "object 0: `image/object/class/label` is 0 (0 is the background); labels run from 1 to num_classes 2".into()),
        ("label_negative", example(-1, b()).encode(), "object 0: `image/object/class/label` is -1; labels run from 1 to num_classes 2".into()),
        ("label_missing", without_labels(), "`image/object/class/label` is missing for 1 box(es) (records that name classes only by `image/object/class/text` are not supported)".into()),
        ("box_nan", example(1, BBox::new(f32::NAN, 0.2, 0.6, 0.7)).encode(), "object 0: `image/object/bbox/ymin` is NaN".into()),
        ("box_inf", example(1, BBox::new(0.1, 0.2, 0.6, f32::INFINITY)).encode(), "object 0: `image/object/bbox/xmax` is inf".into()),
        ("box_inverted", example(1, BBox::new(0.7, 0.2, 0.6, 0.7)).encode(), "object 0: inverted box: `image/object/bbox/ymin` 0.7 is greater than `image/object/bbox/ymax` 0.6".into()),
        ("box_pixels", example(1, BBox::new(10.0, 20.0, 60.0, 70.0)).encode(), "object 0: `image/object/bbox/ymin` is 10, outside [0, 1] (boxes are normalised to the image size)".into()),
        ("jpeg_half", with_image(jpeg[..half_jpeg].to_vec()), format!("`image/encoded` cannot be decoded: truncated JPEG: the data ends after {half_jpeg} bytes, before the end-of-image marker")),
        ("png_half", with_image(png[..half_png].to_vec()), format!("`image/encoded` cannot be decoded: truncated PNG: the data ends after {half_png} bytes, before the end of the IEND chunk")),
    ]
}

fn loader_config(batch_size: usize) -> LoaderConfig {
    LoaderConfig {
        batch_size,
        image_size: [32, 32],
        num_classes: 2,
        augmentations: vec![Augmentation::RandomHorizontalFlip { probability: 0.5 }],
        shuffle: false,
        seed: 1,
        workers: 1,
        prefetch: 1,
        share: None,
    }
}

/// Each bad record, second of three in its file, is an error naming the file, the record's
/// number and offset, the field and the value: when read for evaluation (`read_checked`) and
/// when the loader makes the batch holding it, long before any loss.
#[test]
fn bad_records_are_errors_naming_file_record_field_and_value() {
    let dir = tempfile::tempdir().unwrap();
    for (name, bad, problem) in bad_records() {
        let path = dir.path().join(format!("{name}.record"));
        write_records(&path, &[good(), bad, good()]);
        let index = Arc::new(RecordIndex::build(std::slice::from_ref(&path)).unwrap());
        let want = format!(
            "{}: record 1 (byte {}): {problem}",
            path.display(),
            index.location(1).offset
        );
        assert!(read_checked(&index, 0, Some(2)).is_ok(), "{name}");
        let err = read_checked(&index, 1, Some(2)).unwrap_err().to_string();
        assert_eq!(err, want, "{name}");
        let mut loader = Loader::new(index.clone(), loader_config(3), Position::default()).unwrap();
        let err = loader.next().unwrap().unwrap_err().to_string();
        assert_eq!(err, want, "{name}: loader");
    }
}

/// Labels above the range are fine where the number of classes is not known (validating
/// TFRecords without a label map), the rest are not.
#[test]
fn without_num_classes_only_labels_below_one_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("labels.record");
    let b = BBox::new(0.1, 0.2, 0.6, 0.7);
    write_records(&path, &[example(9, b).encode(), example(0, b).encode()]);
    let index = RecordIndex::build(std::slice::from_ref(&path)).unwrap();
    assert_eq!(read_checked(&index, 0, None).unwrap().0.objects[0].label, 9);
    let err = read_checked(&index, 1, None).unwrap_err().to_string();
    assert!(
        err.ends_with("`image/object/class/label` is 0 (0 is the background); labels start at 1"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------
// VOC / Oxford-IIIT Pet folders

fn object(name: &str, [x0, y0, x1, y1]: [&str; 4]) -> String {
    format!(
        "<object><name>{name}</name><bndbox><xmin>{x0}</xmin><ymin>{y0}</ymin>\
         <xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox></object>"
    )
}

fn annotation(objects: &str) -> String {
    format!("<annotation><size><width>96</width><height>64</height></size>{objects}</annotation>")
}

/// A folder of `count` good images `Cat_<n>` (one cat each), listed in `trainval.txt`.
fn voc_folder(root: &Path, count: usize) {
    std::fs::create_dir_all(root.join("images")).unwrap();
    std::fs::create_dir_all(root.join("annotations/xmls")).unwrap();
    let names: Vec<String> = (1..=count).map(|i| format!("Cat_{i}")).collect();
    for n in &names {
        write_voc(
            root,
            n,
            encoded(ImageFormat::Jpeg),
            &object("cat", ["10", "8", "50", "40"]),
        );
    }
    let list: String = names.iter().map(|n| format!("{n} 1 1 1\n")).collect();
    std::fs::write(root.join("annotations/trainval.txt"), list).unwrap();
}

fn write_voc(root: &Path, name: &str, image: Vec<u8>, objects: &str) {
    std::fs::write(root.join(format!("images/{name}.jpg")), image).unwrap();
    std::fs::write(
        root.join(format!("annotations/xmls/{name}.xml")),
        annotation(objects),
    )
    .unwrap();
}

fn options(num_shards: usize, skip_invalid: bool) -> VocOptions {
    VocOptions {
        classes: ClassSource::Species,
        label_map: None,
        seed: 1,
        num_shards,
        skip_invalid,
    }
}

fn prepare(root: &Path, out: &Path, options: &VocOptions) -> Result<PrepareSummary> {
    prepare_voc(root, out, options, &|_, _| {})
}

fn all_examples(out: &Path) -> Vec<DetectionExample> {
    expand_patterns(&[format!("{}/*.record-*", out.display())])
        .unwrap()
        .iter()
        .flat_map(|f| read_all(f).unwrap())
        .map(|r| DetectionExample::decode(&r).unwrap())
        .collect()
}

/// Each bad image or annotation in a folder of good ones: without `skip_invalid` an error
/// naming the file (and nothing written); with it, skipped, counted and left out of the shards.
#[test]
fn bad_voc_files_are_errors_or_counted_skips() {
    let jpeg = encoded(ImageFormat::Jpeg);
    let png = encoded(ImageFormat::Png);
    let good_object = object("cat", ["10", "8", "50", "40"]);
    let cases: Vec<(&str, Vec<u8>, String, &str, String)> = vec![
        (
            "jpeg_half",
            jpeg[..jpeg.len() / 2].to_vec(),
            good_object.clone(),
            "images/Bad_1.jpg",
            format!(
                "cannot decode image: truncated JPEG: the data ends after {} bytes, before the end-of-image marker",
                jpeg.len() / 2
            ),
        ),
        (
            "png_half",
            png[..png.len() / 2].to_vec(),
            good_object.clone(),
            "images/Bad_1.jpg",
            format!(
                "cannot decode image: truncated PNG: the data ends after {} bytes, before the end of the IEND chunk",
                png.len() / 2
            ),
        ),
        (
            "nan_box",
            jpeg.clone(),
            object("cat", ["nan", "8", "50", "40"]),
            "annotations/xmls/Bad_1.xml",
            "<xmin> is not a number: \"nan\"".into(),
        ),
        (
            "inf_box",
            jpeg.clone(),
            object("cat", ["10", "8", "inf", "40"]),
            "annotations/xmls/Bad_1.xml",
            "<xmax> is not a number: \"inf\"".into(),
        ),
        (
            "no_name",
            jpeg.clone(),
            format!(
                "{good_object}<object><bndbox><xmin>1</xmin><ymin>1</ymin><xmax>9</xmax><ymax>9</ymax></bndbox></object>"
            ),
            "annotations/xmls/Bad_1.xml",
            "<object> 1 has no <name>".into(),
        ),
        (
            "empty_name",
            jpeg.clone(),
            object("", ["10", "8", "50", "40"]),
            "annotations/xmls/Bad_1.xml",
            "<object> 0 has no <name>".into(),
        ),
    ];
    for (case, image, objects, file, problem) in cases {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("pets");
        voc_folder(&root, 9);
        write_voc(&root, "Bad_1", image, &objects);
        let list = root.join("annotations/trainval.txt");
        let text = std::fs::read_to_string(&list).unwrap();
        std::fs::write(&list, format!("{text}Bad_1 1 1 1\n")).unwrap();
        let out = dir.path().join("out");
        let err = prepare(&root, &out, &options(2, false))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!("{}: {problem}{SKIP_HINT}", root.join(file).display()),
            "{case}"
        );
        assert!(
            !out.exists() || listing(&out).is_empty(),
            "{case}: {:?}",
            listing(&out)
        );
        let summary = prepare(&root, &out, &options(2, true)).unwrap();
        assert_eq!(summary.invalid, 1, "{case}");
        // the skipped example's reason, without the hint to skip it
        let reason = err.trim_end_matches(SKIP_HINT).to_string();
        assert_eq!(
            summary.skipped,
            vec![("Bad_1".to_string(), reason)],
            "{case}"
        );
        let examples = all_examples(&out);
        assert_eq!(examples.len(), 9, "{case}");
        assert!(examples.iter().all(|e| e.filename != "Bad_1.jpg"), "{case}");
        assert!(
            examples
                .iter()
                .flat_map(|e| &e.objects)
                .all(|o| { o.bbox.to_array().iter().all(|v| v.is_finite()) && o.label == 1 }),
            "{case}"
        );
    }
}

/// `Cat` and `cat` in one dataset are an error naming both spellings and a file of each,
/// unless a label map says what they are.
#[test]
fn class_names_differing_in_case_are_an_error_unless_a_label_map_lists_them() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("pets");
    voc_folder(&root, 4);
    write_voc(
        &root,
        "Cat_3",
        encoded(ImageFormat::Jpeg),
        &object("Cat", ["10", "8", "50", "40"]),
    );
    let out = dir.path().join("out");
    let err = prepare(&root, &out, &options(1, true))
        .unwrap_err()
        .to_string();
    let xml = |n: &str| {
        root.join(format!("annotations/xmls/{n}.xml"))
            .display()
            .to_string()
    };
    assert_eq!(
        err,
        format!(
            "{}: class \"cat\" differs from class \"Cat\" (in {}) only in case: correct the \
             spelling, or give a label map that lists both",
            xml("Cat_1"),
            xml("Cat_3")
        )
    );
    // a label map listing both: two classes, as it says
    let both = LabelMap::from_names(&["cat", "Cat"]);
    let opts = VocOptions {
        label_map: Some(both.clone()),
        ..options(1, false)
    };
    let summary = prepare(&root, &out, &opts).unwrap();
    let mut objects = std::collections::BTreeMap::new();
    for (class, n) in summary.splits.values().flat_map(|s| &s.objects) {
        *objects.entry(class.as_str()).or_insert(0) += n;
    }
    assert_eq!(objects, [("Cat", 1), ("cat", 3)].into());
    assert_eq!(LabelMap::load(&out.join("label_map.pbtxt")).unwrap(), both);
    // a label map listing only one: the other is an error naming the image
    let opts = VocOptions {
        label_map: Some(LabelMap::from_names(&["cat"])),
        ..options(1, false)
    };
    let err = prepare(&root, &dir.path().join("out2"), &opts)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        format!(
            "{}: class \"Cat\" is not in the label map{SKIP_HINT}",
            root.join("images/Cat_3.jpg").display()
        )
    );
}

// ---------------------------------------------------------------------------------------
// Shard sets

/// A re-run replaces the whole set (an older run's extra shards go); a failing run leaves the
/// older set as it was and no temporary files.
#[test]
fn reruns_replace_the_whole_set_and_failures_keep_the_old_one() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("pets");
    voc_folder(&root, 10);
    let out = dir.path().join("out");
    prepare(&root, &out, &options(5, false)).unwrap();
    let five = listing(&out);
    assert_eq!(five.len(), 5 + 1 + 2, "{five:?}");
    prepare(&root, &out, &options(2, false)).unwrap();
    assert_eq!(
        listing(&out),
        vec![
            "label_map.pbtxt",
            "manifest.json",
            "train.record-00000-of-00002",
            "train.record-00001-of-00002",
            "val.record-00000-of-00001",
        ]
    );
    assert_eq!(all_examples(&out).len(), 10, "every image once");
    // a broken image makes the next run fail: the two-shard set stays, nothing else appears
    let before: Vec<Vec<u8>> = listing(&out)
        .iter()
        .map(|n| std::fs::read(out.join(n)).unwrap())
        .collect();
    let jpeg = encoded(ImageFormat::Jpeg);
    std::fs::write(root.join("images/Cat_4.jpg"), &jpeg[..jpeg.len() - 2]).unwrap();
    let err = prepare(&root, &out, &options(3, false))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("Cat_4.jpg: cannot decode image: truncated JPEG")
            && err.contains("run prepare-data with --skip-invalid"),
        "{err}"
    );
    let after: Vec<Vec<u8>> = listing(&out)
        .iter()
        .map(|n| std::fs::read(out.join(n)).unwrap())
        .collect();
    assert_eq!(listing(&out).len(), 5);
    assert!(before == after, "the older set is unchanged");
}

#[test]
fn absurd_shard_counts_are_refused_naming_the_value() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("pets");
    voc_folder(&root, 10);
    let out = dir.path().join("out");
    for (shards, want) in [
        (
            0,
            "num_shards 0: the training split needs at least one shard".to_string(),
        ),
        (
            8,
            "num_shards 8 is more than the 7 training records (shards would be empty)".into(),
        ),
    ] {
        let err = prepare(&root, &out, &options(shards, false))
            .unwrap_err()
            .to_string();
        assert_eq!(err, format!("{}: {want}", root.display()));
        let err = prepare_synthetic(&out, 1, 7, 1, shards, &|_, _| {})
            .unwrap_err()
            .to_string();
        assert_eq!(err, format!("{}: {want}", out.display()));
    }
    assert!(!out.exists());
    // synthetic re-runs replace the set too
    prepare_synthetic(&out, 1, 6, 1, 3, &|_, _| {}).unwrap();
    let summary = prepare_synthetic(&out, 1, 6, 1, 2, &|_, _| {}).unwrap();
    let files: Vec<PathBuf> =
        expand_patterns(&[format!("{}/train.record-*", out.display())]).unwrap();
    assert_eq!(files, summary.splits["train"].files);
    assert_eq!(files.len(), 2);
}
