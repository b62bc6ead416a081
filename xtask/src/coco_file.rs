//! `cargo xtask coco-file`: a COCO annotation file the size of train2017's (118,287 images,
//! 860,001 annotations with segmentation polygons, about 450 MB) over a handful of small
//! pictures, to measure what `prepare-data --from-coco` needs in time and memory at that scale
//! without the 18 GB of real images.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use image::{DynamicImage, Rgb, RgbImage};

/// COCO's 80 categories, with their ids (1..=90 with gaps) and supercategories.
const CATEGORIES: [(u32, &str, &str); 80] = [
    (1, "person", "person"),
    (2, "bicycle", "vehicle"),
    (3, "car", "vehicle"),
    (4, "motorcycle", "vehicle"),
    (5, "airplane", "vehicle"),
    (6, "bus", "vehicle"),
    (7, "train", "vehicle"),
    (8, "truck", "vehicle"),
    (9, "boat", "vehicle"),
    (10, "traffic light", "outdoor"),
    (11, "fire hydrant", "outdoor"),
    (13, "stop sign", "outdoor"),
    (14, "parking meter", "outdoor"),
    (15, "bench", "outdoor"),
    (16, "bird", "animal"),
    (17, "cat", "animal"),
    (18, "dog", "animal"),
    (19, "horse", "animal"),
    (20, "sheep", "animal"),
    (21, "cow", "animal"),
    (22, "elephant", "animal"),
    (23, "bear", "animal"),
    (24, "zebra", "animal"),
    (25, "giraffe", "animal"),
    (27, "backpack", "accessory"),
    (28, "umbrella", "accessory"),
    (31, "handbag", "accessory"),
    (32, "tie", "accessory"),
    (33, "suitcase", "accessory"),
    (34, "frisbee", "sports"),
    (35, "skis", "sports"),
    (36, "snowboard", "sports"),
    (37, "sports ball", "sports"),
    (38, "kite", "sports"),
    (39, "baseball bat", "sports"),
    (40, "baseball glove", "sports"),
    (41, "skateboard", "sports"),
    (42, "surfboard", "sports"),
    (43, "tennis racket", "sports"),
    (44, "bottle", "kitchen"),
    (46, "wine glass", "kitchen"),
    (47, "cup", "kitchen"),
    (48, "fork", "kitchen"),
    (49, "knife", "kitchen"),
    (50, "spoon", "kitchen"),
    (51, "bowl", "kitchen"),
    (52, "banana", "food"),
    (53, "apple", "food"),
    (54, "sandwich", "food"),
    (55, "orange", "food"),
    (56, "broccoli", "food"),
    (57, "carrot", "food"),
    (58, "hot dog", "food"),
    (59, "pizza", "food"),
    (60, "donut", "food"),
    (61, "cake", "food"),
    (62, "chair", "furniture"),
    (63, "couch", "furniture"),
    (64, "potted plant", "furniture"),
    (65, "bed", "furniture"),
    (67, "dining table", "furniture"),
    (70, "toilet", "furniture"),
    (72, "tv", "electronic"),
    (73, "laptop", "electronic"),
    (74, "mouse", "electronic"),
    (75, "remote", "electronic"),
    (76, "keyboard", "electronic"),
    (77, "cell phone", "electronic"),
    (78, "microwave", "appliance"),
    (79, "oven", "appliance"),
    (80, "toaster", "appliance"),
    (81, "sink", "appliance"),
    (82, "refrigerator", "appliance"),
    (84, "book", "indoor"),
    (85, "clock", "indoor"),
    (86, "vase", "indoor"),
    (87, "scissors", "indoor"),
    (88, "teddy bear", "indoor"),
    (89, "hair drier", "indoor"),
    (90, "toothbrush", "indoor"),
];

/// Distinct pictures the image entries point at.
const PICTURES: u32 = 8;
/// One image in this many has no annotation (train2017: 1,021 of 118,287).
const EMPTY_EVERY: u64 = 116;
/// One annotation in this many is a crowd region (train2017: about 1%).
const CROWD_EVERY: u64 = 100;
/// Polygon points per annotation, which makes an annotation about as long as train2017's.
const POLYGON_POINTS: u64 = 28;

/// What was generated.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// The annotation file.
    pub file: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// Image entries.
    pub images: u64,
    /// Image entries without annotations.
    pub empty: u64,
    /// Annotations.
    pub annotations: u64,
    /// Crowd regions among the annotations.
    pub crowd: u64,
}

/// splitmix64: a reproducible stream without a dependency.
struct Stream(u64);

impl Stream {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi)`.
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The size of picture `i`.
fn picture_size(i: u64) -> (u32, u32) {
    let i = (i % u64::from(PICTURES)) as u32;
    (96 + 16 * i, 72 + 8 * i)
}

fn write_pictures(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for i in 0..u64::from(PICTURES) {
        let (w, h) = picture_size(i);
        let img = RgbImage::from_fn(w, h, |x, y| {
            Rgb([(x * 2) as u8, (y * 3) as u8, (i * 30) as u8])
        });
        let path = dir.join(format!("{i:03}.jpg"));
        DynamicImage::ImageRgb8(img)
            .save(&path)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Writes `out/images/` (the pictures) and `out/instances.json` with `images` image entries
/// and `annotations` annotations, reproducibly.
pub fn generate(out: &Path, images: u64, annotations: u64) -> Result<Generated> {
    write_pictures(&out.join("images"))?;
    let file = out.join("instances.json");
    let mut w = BufWriter::new(
        File::create(&file).with_context(|| format!("creating {}", file.display()))?,
    );
    let write = |w: &mut BufWriter<File>| -> std::io::Result<(u64, u64)> {
        write!(
            w,
            r#"{{"info": {{"description": "generated by cargo xtask coco-file", "year": 2026}}, "licenses": [{{"id": 1, "name": "none"}}], "images": ["#
        )?;
        let mut empty = 0;
        for i in 0..images {
            let (width, height) = picture_size(i);
            empty += u64::from(i.is_multiple_of(EMPTY_EVERY));
            let comma = if i == 0 { "" } else { ", " };
            write!(
                w,
                r#"{comma}{{"license": 1, "file_name": "{:03}.jpg", "coco_url": "http://images.example/train/{i:012}.jpg", "height": {height}, "width": {width}, "date_captured": "2013-11-14 11:18:45", "id": {}}}"#,
                i % u64::from(PICTURES),
                image_id(i)
            )?;
        }
        write!(w, r#"], "annotations": ["#)?;
        let crowd = write_annotations(w, images, annotations)?;
        write!(w, r#"], "categories": ["#)?;
        for (i, (id, name, supercategory)) in CATEGORIES.iter().enumerate() {
            let comma = if i == 0 { "" } else { ", " };
            write!(
                w,
                r#"{comma}{{"supercategory": "{supercategory}", "id": {id}, "name": "{name}"}}"#
            )?;
        }
        writeln!(w, "]}}")?;
        w.flush()?;
        Ok((empty, crowd))
    };
    let (empty, crowd) = write(&mut w).with_context(|| format!("writing {}", file.display()))?;
    let bytes = std::fs::metadata(&file)
        .with_context(|| format!("reading {}", file.display()))?
        .len();
    Ok(Generated {
        file,
        bytes,
        images,
        empty,
        annotations,
        crowd,
    })
}

/// The id of image entry `i`: sparse, as COCO's are.
fn image_id(i: u64) -> u64 {
    9 + 7 * i
}

/// The annotations, spread over the images that have any; returns the crowd regions.
fn write_annotations(
    w: &mut BufWriter<File>,
    images: u64,
    annotations: u64,
) -> std::io::Result<u64> {
    let mut rng = Stream(2017);
    let with_boxes: Vec<u64> = (0..images)
        .filter(|i| !i.is_multiple_of(EMPTY_EVERY))
        .collect();
    let mut crowd = 0;
    for k in 0..annotations {
        let i = with_boxes[(k % with_boxes.len() as u64) as usize];
        let (width, height) = picture_size(i);
        let (width, height) = (f64::from(width), f64::from(height));
        let (x, y) = (
            rng.uniform(0.0, width - 4.0),
            rng.uniform(0.0, height - 4.0),
        );
        // one box in 200 reaches past the right edge (clipped when prepared)
        let reach = if k % 200 == 7 { 20.0 } else { 0.0 };
        let (bw, bh) = (
            rng.uniform(2.0, width - x + reach),
            rng.uniform(2.0, height - y),
        );
        let (category, _, _) = CATEGORIES[(rng.next() % 80) as usize];
        let is_crowd = k % CROWD_EVERY == 3;
        crowd += u64::from(is_crowd);
        let comma = if k == 0 { "" } else { ", " };
        write!(w, r#"{comma}{{"segmentation": "#)?;
        if is_crowd {
            // run-length counts, as COCO stores crowd masks
            let counts: Vec<String> = (0..POLYGON_POINTS)
                .map(|_| (rng.next() % 5000).to_string())
                .collect();
            write!(
                w,
                r#"{{"counts": [{}], "size": [{height}, {width}]}}"#,
                counts.join(",")
            )?;
        } else {
            write!(w, "[[")?;
            for p in 0..POLYGON_POINTS {
                let sep = if p == 0 { "" } else { "," };
                let (px, py) = (rng.uniform(x, x + bw), rng.uniform(y, y + bh));
                write!(w, "{sep}{px:.2},{py:.2}")?;
            }
            write!(w, "]]")?;
        }
        write!(
            w,
            r#", "area": {:.4}, "iscrowd": {}, "image_id": {}, "bbox": [{x:.2},{y:.2},{bw:.2},{bh:.2}], "category_id": {category}, "id": {}}}"#,
            bw * bh,
            u8::from(is_crowd),
            image_id(i),
            900_000 + k
        )?;
    }
    Ok(crowd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use data::coco::{CocoOptions, prepare_coco};

    #[test]
    fn a_small_generated_file_prepares_with_every_image_and_crowd_region_counted() {
        let dir = tempfile::tempdir().unwrap();
        let g = generate(dir.path(), 240, 1500).unwrap();
        // images 0, 116 and 232 have no annotation; annotations 3, 103, ... are crowds
        assert_eq!((g.empty, g.crowd), (3, 15));
        let text = std::fs::read_to_string(&g.file).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(json["annotations"].as_array().unwrap().len(), 1500);
        assert_eq!(g.bytes, text.len() as u64);
        let options = CocoOptions {
            images: dir.path().join("images"),
            split: "train".into(),
            num_shards: 2,
            contiguous_ids: false,
            skip_empty: false,
            skip_invalid: false,
        };
        let out = dir.path().join("out");
        let s = prepare_coco(&g.file, &out, &options, &|_, _| {})
            .unwrap()
            .summary;
        assert_eq!((s.written.images, s.empty_images), (240, 3));
        assert_eq!(s.crowd_regions, 15);
        // every box has an area of at least 2x2 pixels inside its image: none is dropped
        let objects: usize = s.written.objects.values().sum();
        assert_eq!((objects, s.cleanup.boxes_dropped), (1500 - 15, 0));
        // some of the eight boxes allowed past the right edge (k = 7, 207, ...) reach it
        assert!((1..=8).contains(&s.cleanup.boxes_clipped), "{s:?}");
    }
}
