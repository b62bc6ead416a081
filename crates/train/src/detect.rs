//! `train detect`: run a detector over image files and write each image with its detections
//! drawn (coloured boxes, class names and scores) as PNG, plus all detections as JSON.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use image::{Rgb, RgbImage};
use model::ops::SsdBackend;
use model::{Detection, Detector};
use serde::Serialize;

use crate::report::draw::{draw_text, fill};

/// File extensions read as images when a folder is given.
const IMAGE_EXTENSIONS: [&str; 4] = ["jpg", "jpeg", "png", "gif"];

/// The image files named by `inputs`: files as given, folders by their images (sorted), and
/// glob patterns.
pub fn image_files(inputs: &[String]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for input in inputs {
        let path = Path::new(input);
        if path.is_dir() {
            let mut found: Vec<PathBuf> = std::fs::read_dir(path)
                .with_context(|| format!("reading folder {input}"))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.extension()
                        .and_then(|e| e.to_str())
                        .is_some_and(|e| IMAGE_EXTENSIONS.contains(&e.to_lowercase().as_str()))
                })
                .collect();
            found.sort();
            files.extend(found);
        } else if path.is_file() {
            files.push(path.to_path_buf());
        } else {
            let matches: Vec<PathBuf> = glob::glob(input)
                .with_context(|| format!("{input}: not a file, folder or valid glob"))?
                .filter_map(|p| p.ok())
                .filter(|p| p.is_file())
                .collect();
            if matches.is_empty() {
                bail!("{input}: no such file, folder or matching image");
            }
            files.extend(matches);
        }
    }
    Ok(files)
}

/// A distinct, saturated colour per class id.
fn class_colour(class_id: usize) -> Rgb<u8> {
    const PALETTE: [[u8; 3]; 10] = [
        [230, 25, 75],
        [60, 180, 75],
        [0, 130, 200],
        [245, 130, 48],
        [145, 30, 180],
        [70, 240, 240],
        [240, 50, 230],
        [210, 245, 60],
        [250, 190, 190],
        [0, 128, 128],
    ];
    Rgb(PALETTE[class_id % PALETTE.len()])
}

/// Draws each detection: a box in its class colour and a label "name 0.87" above it (inside
/// the image).
pub fn draw_detections(image: &mut RgbImage, detections: &[Detection]) {
    let scale = (image.width().min(image.height()) as i64 / 300).max(1);
    let thickness = 2 * scale;
    for d in detections {
        let colour = class_colour(d.class_id);
        let b = d.pixel_bbox;
        let [x0, y0, x1, y1] = [b.xmin, b.ymin, b.xmax, b.ymax].map(|v| v.round() as i64);
        fill(image, [x0, y0, x1, y0 + thickness], colour);
        fill(image, [x0, y1 - thickness, x1, y1], colour);
        fill(image, [x0, y0, x0 + thickness, y1], colour);
        fill(image, [x1 - thickness, y0, x1, y1], colour);
        let label = format!("{} {:.2}", d.class_name, d.score);
        let (lw, lh) = (label.len() as i64 * 8 * scale + 2 * scale, 10 * scale);
        let ly = if y0 >= lh { y0 - lh } else { y0 };
        fill(image, [x0, ly, x0 + lw, ly + lh], colour);
        draw_text(
            image,
            &label,
            x0 + scale,
            ly + scale,
            scale,
            Rgb([255, 255, 255]),
        );
    }
}

/// Evaluation images with their detections scoring at least 0.5 (at most 20 each) drawn,
/// for TensorBoard: `images[i]` is record `i` as decoded and `results[i]` its detections in
/// pixels, as `eval::run_on_dataset` returns them.
pub fn eval_images(
    images: Vec<RgbImage>,
    results: &[crate::eval::metrics::ImageResult],
    config: &model::SsdConfig,
) -> Vec<RgbImage> {
    let mut drawn = Vec::new();
    for (mut image, result) in images.into_iter().zip(results) {
        let (h, w) = (image.height() as f32, image.width() as f32);
        let detections: Vec<Detection> = result
            .detections
            .iter()
            .filter(|d| d.score >= 0.5)
            .take(20)
            .map(|d| Detection {
                class_id: d.class_id,
                class_name: config.class_name(d.class_id),
                score: d.score,
                bbox: model::BBox::new(
                    d.bbox.ymin / h,
                    d.bbox.xmin / w,
                    d.bbox.ymax / h,
                    d.bbox.xmax / w,
                ),
                pixel_bbox: d.bbox,
            })
            .collect();
        draw_detections(&mut image, &detections);
        drawn.push(image);
    }
    drawn
}

/// Detections of one image, as written to `detections.json`.
#[derive(Debug, Serialize)]
pub struct ImageDetections {
    /// The input file.
    pub file: PathBuf,
    /// The PNG written.
    pub output: PathBuf,
    /// Detections above the score threshold, best first.
    pub detections: Vec<Detection>,
}

/// Runs `detector` over `files`, writing `<out>/<name>.png` per image and
/// `<out>/detections.json`. Unreadable images are reported (file and reason) and skipped; the
/// result is an error naming them after every other image is done.
pub fn detect_files<B: SsdBackend>(
    detector: &Detector<B>,
    files: &[PathBuf],
    out: &Path,
    score_threshold: f32,
    max_detections: usize,
) -> Result<Vec<ImageDetections>> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut results = Vec::new();
    let mut failed = Vec::new();
    for (i, file) in files.iter().enumerate() {
        let outcome = (|| -> Result<ImageDetections> {
            let bytes =
                std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
            // as training decodes: whole files only, sizes within the limits
            let (image, _) = data::images::decode_image(&bytes)
                .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
            let mut detections = detector.detect(&image)?;
            detections.retain(|d| d.score >= score_threshold);
            detections.truncate(max_detections);
            let mut canvas = image.to_rgb8();
            draw_detections(&mut canvas, &detections);
            let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("image");
            // the index keeps two inputs with the same name apart
            let output = out.join(format!("{i:04}_{stem}.png"));
            canvas
                .save(&output)
                .with_context(|| format!("writing {}", output.display()))?;
            Ok(ImageDetections {
                file: file.clone(),
                output,
                detections,
            })
        })();
        match outcome {
            Ok(r) => results.push(r),
            Err(e) => {
                eprintln!("skipped: {e:#}");
                failed.push(file.display().to_string());
            }
        }
    }
    let json = out.join("detections.json");
    model::io::write_atomic(&json, serde_json::to_string_pretty(&results)?.as_bytes())
        .with_context(|| format!("writing {}", json.display()))?;
    if !failed.is_empty() {
        bail!(
            "{} of {} images could not be processed: {}",
            failed.len(),
            files.len(),
            failed.join(", ")
        );
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use model::{BBox, SsdConfig};

    fn detection(class_id: usize, pixel_bbox: BBox) -> Detection {
        Detection {
            class_id,
            class_name: "cat".into(),
            score: 0.87,
            bbox: pixel_bbox,
            pixel_bbox,
        }
    }

    #[test]
    fn boxes_are_drawn_on_their_border_only() {
        let mut image = RgbImage::from_pixel(100, 80, Rgb([0, 0, 0]));
        draw_detections(
            &mut image,
            &[detection(1, BBox::new(30.0, 20.0, 70.0, 60.0))],
        );
        let colour = class_colour(1);
        // box edges (2 px thick): top row 30, left column 20, bottom row 69, right column 59
        for (x, y) in [(40, 30), (40, 31), (20, 50), (21, 50), (40, 69), (59, 50)] {
            assert_eq!(*image.get_pixel(x, y), colour, "({x}, {y})");
        }
        // inside and outside stay black
        for (x, y) in [(40, 50), (22, 40), (10, 50), (80, 50), (40, 75)] {
            assert_eq!(*image.get_pixel(x, y), Rgb([0, 0, 0]), "({x}, {y})");
        }
        // the label sits above the box: its background in the class colour, with white text
        let label: Vec<_> = (20..100)
            .flat_map(|x| (20..30).map(move |y| (x, y)))
            .map(|(x, y)| *image.get_pixel(x, y))
            .collect();
        assert!(label.contains(&Rgb([255, 255, 255])) && label.contains(&colour));
    }

    #[test]
    fn detect_writes_pngs_and_json_and_names_bad_files() {
        let config = SsdConfig {
            num_classes: 2,
            image_size: [96, 96],
            depth_multiplier: 0.25,
            ..Default::default()
        };
        let device = Default::default();
        let net = config.init::<Flex>(1, &device).unwrap();
        let detector = Detector::new(config, net, &device).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("a.png");
        RgbImage::from_pixel(120, 90, Rgb([90, 120, 200]))
            .save(&good)
            .unwrap();
        let bad = dir.path().join("broken.jpg");
        std::fs::write(&bad, b"\xff\xd8 not really a jpeg").unwrap();
        let files = image_files(&[dir.path().display().to_string()]).unwrap();
        assert_eq!(files, vec![good.clone(), bad.clone()]);
        let out = dir.path().join("out");
        // an untrained network scores everything near 0.5: threshold 0 keeps the top 5
        let err = detect_files(&detector, &files, &out, 0.0, 5).unwrap_err();
        assert!(err.to_string().contains("broken.jpg"), "{err}");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("detections.json")).unwrap())
                .unwrap();
        assert_eq!(json.as_array().unwrap().len(), 1);
        assert_eq!(json[0]["detections"].as_array().unwrap().len(), 5);
        let png = image::open(out.join("0000_a.png")).unwrap().to_rgb8();
        assert_eq!(png.dimensions(), (120, 90));
        // something was drawn over the flat input
        assert!(png.pixels().any(|p| *p != Rgb([90, 120, 200])));
    }
}
