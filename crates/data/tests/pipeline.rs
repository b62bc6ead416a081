//! End-to-end data tests: a small Oxford-IIIT Pet style folder with the real dataset's quirks,
//! and the loader's determinism, exact resume and replica splits.

use std::path::Path;
use std::sync::Arc;

use data::DetectionExample;
use data::augment::Augmentation;
use data::loader::{Loader, LoaderConfig, Position};
use data::prepare::{VocOptions, prepare_synthetic, prepare_voc};
use data::shards::expand_patterns;
use data::tfrecord::{RecordIndex, read_all};
use data::voc::ClassSource;
use image::{DynamicImage, ImageFormat, Rgb, RgbImage};

fn xml(name: &str, w: u32, h: u32, boxes: &[(&str, [i32; 4])]) -> String {
    let objects: String = boxes
        .iter()
        .map(|(n, [x0, y0, x1, y1])| {
            format!("<object><name>{n}</name><pose>Frontal</pose><truncated>0</truncated><difficult>0</difficult><bndbox><xmin>{x0}</xmin><ymin>{y0}</ymin><xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox></object>")
        })
        .collect();
    format!(
        "<annotation><filename>{name}.jpg</filename><size><width>{w}</width><height>{h}</height><depth>3</depth></size>{objects}</annotation>"
    )
}

fn save(img: &DynamicImage, path: &Path, format: ImageFormat) {
    img.save_with_format(path, format).unwrap();
}

/// Builds the fixture folder and returns its root.
fn pet_fixture(root: &Path) {
    let images = root.join("images");
    let xmls = root.join("annotations/xmls");
    std::fs::create_dir_all(&images).unwrap();
    std::fs::create_dir_all(&xmls).unwrap();
    let rgb = DynamicImage::ImageRgb8(RgbImage::from_fn(120, 80, |x, y| {
        Rgb([x as u8, y as u8, 7])
    }));
    let names = [
        "Abyssinian_1", // good RGB JPEG
        "Abyssinian_2", // PNG named .jpg
        "beagle_1",     // GIF named .jpg
        "beagle_2",     // grayscale JPEG
        "Bengal_1",     // corrupt: truncated JPEG
        "Bengal_2",     // no XML
        "boxer_1",      // boxes outside the image / inverted
        "boxer_2",      // malformed XML
        "Birman_1",     // good
        "Birman_2",     // good
    ];
    save(&rgb, &images.join("Abyssinian_1.jpg"), ImageFormat::Jpeg);
    save(&rgb, &images.join("Abyssinian_2.jpg"), ImageFormat::Png);
    save(&rgb, &images.join("beagle_1.jpg"), ImageFormat::Gif);
    save(
        &DynamicImage::ImageLuma8(rgb.to_luma8()),
        &images.join("beagle_2.jpg"),
        ImageFormat::Jpeg,
    );
    let mut jpeg = Vec::new();
    rgb.write_to(&mut std::io::Cursor::new(&mut jpeg), ImageFormat::Jpeg)
        .unwrap();
    std::fs::write(images.join("Bengal_1.jpg"), &jpeg[..jpeg.len() / 3]).unwrap();
    for n in ["Bengal_2", "boxer_1", "boxer_2", "Birman_1", "Birman_2"] {
        save(&rgb, &images.join(format!("{n}.jpg")), ImageFormat::Jpeg);
    }
    for n in names {
        let species = if n.starts_with("beagle") || n.starts_with("boxer") {
            "dog"
        } else {
            "cat"
        };
        let text = match n {
            "Bengal_2" => continue,
            "boxer_1" => xml(
                n,
                120,
                80,
                &[
                    (species, [100, 60, 200, 120]),
                    (species, [50, 10, 40, 30]),
                    (species, [10, 10, 60, 40]),
                ],
            ),
            "boxer_2" => "<annotation><size><width>1".to_string(),
            _ => xml(n, 120, 80, &[(species, [12, 8, 60, 40])]),
        };
        std::fs::write(xmls.join(format!("{n}.xml")), text).unwrap();
    }
    let list: String = names.iter().map(|n| format!("{n} 1 1 1\n")).collect();
    std::fs::write(
        root.join("annotations/trainval.txt"),
        format!("# comment line\n{list}"),
    )
    .unwrap();
}

#[test]
fn oxford_pet_folder_with_quirks() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("pets");
    pet_fixture(&root);
    let out = dir.path().join("out");
    let options = |classes, num_shards| VocOptions {
        classes,
        label_map: None,
        seed: 42,
        num_shards,
        skip_invalid: true,
    };
    let summary = prepare_voc(&root, &out, &options(ClassSource::Species, 2), &|_, _| {}).unwrap();
    let written: usize = summary.splits.values().map(|s| s.images).sum();
    // 10 listed: no XML (Bengal_2), corrupt image (Bengal_1), malformed XML (boxer_2) skipped
    assert_eq!(written, 7, "{summary:?}");
    assert_eq!(summary.skipped.len(), 3);
    assert_eq!(summary.invalid, 2, "the missing XML is not invalid");
    let reasons: Vec<&str> = summary.skipped.iter().map(|(_, r)| r.as_str()).collect();
    assert!(
        reasons.iter().any(|r| r.contains("no annotation")),
        "{reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("Bengal_1.jpg") && r.contains("cannot decode")),
        "{reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("boxer_2.xml") && r.contains("malformed XML")),
        "{reasons:?}"
    );
    // PNG, GIF and grayscale re-encoded as RGB JPEG
    assert_eq!(summary.cleanup.reencoded, 3);
    // boxer_1: one box clipped, the inverted one dropped
    assert_eq!(
        (summary.cleanup.boxes_clipped, summary.cleanup.boxes_dropped),
        (1, 1)
    );
    assert_eq!(summary.splits["train"].files.len(), 2);
    // 70 / 30 split of the ten listed names
    let files = expand_patterns(&[format!("{}/*.record-*", out.display())]).unwrap();
    let records: Vec<DetectionExample> = files
        .iter()
        .flat_map(|f| read_all(f).unwrap())
        .map(|r| DetectionExample::decode(&r).unwrap())
        .collect();
    assert_eq!(records.len(), 7);
    for e in &records {
        let img = image::load_from_memory(&e.encoded).unwrap();
        assert!(matches!(img, DynamicImage::ImageRgb8(_)), "{}", e.filename);
        assert_eq!((e.width, e.height), (120, 80));
        for o in &e.objects {
            assert!(o.bbox.xmax <= 1.0 && o.bbox.ymax <= 1.0 && o.bbox.xmin < o.bbox.xmax);
            assert_eq!(o.label, if o.class_text == "cat" { 1 } else { 2 });
        }
    }
    let good = records
        .iter()
        .find(|e| e.filename == "Abyssinian_1.jpg")
        .unwrap();
    assert_eq!(good.objects[0].bbox, model::BBox::new(0.1, 0.1, 0.5, 0.5));
    assert_eq!(good.objects[0].view, "Frontal");
    // breeds: label map from the file names, sorted case-insensitively
    let summary = prepare_voc(
        &root,
        &dir.path().join("breeds"),
        &options(ClassSource::Breeds, 1),
        &|_, _| {},
    )
    .unwrap();
    assert_eq!(summary.splits.values().map(|s| s.images).sum::<usize>(), 7);
    let map = data::LabelMap::load(&dir.path().join("breeds/label_map.pbtxt")).unwrap();
    assert_eq!(
        map.names(),
        vec!["Abyssinian", "beagle", "Bengal", "Birman", "boxer"]
    );
}

fn loader_config(workers: usize) -> LoaderConfig {
    LoaderConfig {
        batch_size: 4,
        image_size: [64, 64],
        num_classes: 2,
        augmentations: vec![
            Augmentation::RandomHorizontalFlip { probability: 0.5 },
            Augmentation::SsdRandomCrop { operations: vec![] },
        ],
        shuffle: true,
        seed: 7,
        workers,
        prefetch: 2,
        share: None,
    }
}

#[test]
fn loader_is_deterministic_resumable_and_splits_disjointly() {
    let dir = tempfile::tempdir().unwrap();
    prepare_synthetic(dir.path(), 1, 18, 2, 3, &|_, _| {}).unwrap();
    let files = expand_patterns(&[format!("{}/train.record-*", dir.path().display())]).unwrap();
    let index = Arc::new(RecordIndex::build(&files).unwrap());
    assert_eq!(index.len(), 18);
    let run = |workers, start, n| -> Vec<data::loader::Batch> {
        Loader::new(index.clone(), loader_config(workers), start)
            .unwrap()
            .take(n)
            .map(|b| b.unwrap())
            .collect()
    };
    let a = run(1, Position::default(), 10);
    let b = run(3, Position::default(), 10);
    assert_eq!(a, b, "worker count changes nothing");
    // 18 records, batches of 4: 4 batches per epoch, 2 records skipped per epoch
    assert_eq!(
        a[3].next_position,
        Position {
            epoch: 0,
            index: 16
        }
    );
    assert_eq!(a[4].next_position, Position { epoch: 1, index: 4 });
    let mut epoch0: Vec<usize> = a[..4].iter().flat_map(|b| b.records.clone()).collect();
    epoch0.sort();
    epoch0.dedup();
    assert_eq!(epoch0.len(), 16, "no record twice within an epoch");
    assert_ne!(a[0].records, a[4].records, "epochs are reshuffled");
    // resume exactly after batch 5
    let resumed = run(2, a[5].next_position, 4);
    assert_eq!(resumed, a[6..10].to_vec());
    // a machine's share of every global batch is the same slice of the whole batch
    for part in 0..2 {
        let share = Loader::new(
            index.clone(),
            LoaderConfig {
                share: Some(2 * part..2 * part + 2),
                ..loader_config(2)
            },
            Position::default(),
        )
        .unwrap()
        .take(10)
        .map(|b| b.unwrap());
        for (whole, mine) in a.iter().zip(share) {
            assert_eq!(mine, whole.split(2)[part]);
        }
    }
    // an empty share, one past the batch's end
    for bad in [2..2, 3..5] {
        let config = LoaderConfig {
            share: Some(bad),
            ..loader_config(1)
        };
        assert!(Loader::new(index.clone(), config, Position::default()).is_err());
    }
    // replica splits: disjoint and complete
    for batch in &a {
        let parts = batch.split(2);
        assert_eq!(parts.len(), 2);
        let mut all: Vec<usize> = parts.iter().flat_map(|p| p.records.clone()).collect();
        assert_eq!(all, batch.records);
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 4);
        let joined: Vec<f32> = parts.iter().flat_map(|p| p.images.clone()).collect();
        assert_eq!(joined, batch.images);
        assert!(batch.images.iter().all(|v| (-1.0..=1.0).contains(v)));
        for gt in batch.ground_truth.iter().flatten() {
            assert!(gt.bbox.xmin >= 0.0 && gt.bbox.xmax <= 1.0 && gt.bbox.height() > 0.0);
        }
    }
}

#[test]
fn loader_reports_corrupt_records_with_file_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    prepare_synthetic(dir.path(), 1, 4, 1, 1, &|_, _| {}).unwrap();
    let file = dir.path().join("train.record-00000-of-00001");
    let index = Arc::new(RecordIndex::build(std::slice::from_ref(&file)).unwrap());
    // corrupt the file after indexing: the next read of a record sees the bad checksum
    let mut bytes = std::fs::read(&file).unwrap();
    let n = bytes.len();
    bytes[n - 100] ^= 0xff;
    std::fs::write(&file, &bytes).unwrap();
    let mut loader = Loader::new(
        index.clone(),
        LoaderConfig {
            shuffle: false,
            ..loader_config(1)
        },
        Position::default(),
    )
    .unwrap();
    let err = loader.next().unwrap().unwrap_err().to_string();
    assert!(
        err.contains("train.record-00000-of-00001") && err.contains("checksum"),
        "{err}"
    );
    assert!(
        Loader::new(
            index,
            LoaderConfig {
                batch_size: 5,
                ..loader_config(1)
            },
            Position::default()
        )
        .is_err()
    );
}
