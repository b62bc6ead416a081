//! PNG charts of a run without TensorBoard: the loss parts, the learning rate and the
//! evaluation metrics over steps, read from the model dir's `metrics.jsonl`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use image::{Rgb, RgbImage};

use crate::draw::{draw_text, fill, line};

/// One line of a chart.
struct Series {
    name: &'static str,
    points: Vec<(f64, f64)>,
}

const WIDTH: u32 = 720;
const HEIGHT: u32 = 420;
const MARGIN: [f64; 4] = [70.0, 30.0, 20.0, 50.0]; // left, top, right, bottom
const COLOURS: [[u8; 3]; 4] = [[0, 90, 200], [220, 60, 40], [40, 160, 60], [150, 60, 180]];

/// Reads `metrics.jsonl` into the chart series: loss parts, learning rate, evaluation.
fn read_series(metrics: &Path) -> Result<[Vec<Series>; 3]> {
    let text = std::fs::read_to_string(metrics)
        .with_context(|| format!("reading {}", metrics.display()))?;
    let mut loss =
        ["total", "classification", "localization", "regularization"].map(|name| Series {
            name,
            points: Vec::new(),
        });
    let mut lr = Series {
        name: "learning rate",
        points: Vec::new(),
    };
    let mut eval = [
        ("voc_mAP", "VOC mAP@0.5"),
        ("AP", "COCO AP"),
        ("AP50", "COCO AP50"),
    ]
    .map(|(_, name)| Series {
        name,
        points: Vec::new(),
    });
    for (i, l) in text.lines().enumerate() {
        let v: serde_json::Value = serde_json::from_str(l)
            .with_context(|| format!("{} line {}: not JSON", metrics.display(), i + 1))?;
        let Some(step) = v["step"].as_f64() else {
            continue;
        };
        for s in &mut loss {
            if let Some(x) = v["loss"][s.name].as_f64() {
                s.points.push((step, x));
            }
        }
        if let Some(x) = v["learning_rate"].as_f64() {
            lr.points.push((step, x));
        }
        for (s, key) in eval.iter_mut().zip(["voc_mAP", "AP", "AP50"]) {
            if let Some(x) = v["eval"][key].as_f64() {
                s.points.push((step, x));
            }
        }
    }
    Ok([loss.into(), vec![lr], eval.into()])
}

/// Short decimal form of an axis value.
fn label(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 0.01 {
        format!("{v:.3}")
    } else {
        format!("{v:.1e}")
    }
}

/// Draws `series` as lines over a shared step axis, with min/max labels and a legend.
fn chart(title: &str, series: &[Series]) -> RgbImage {
    let mut image = RgbImage::from_pixel(WIDTH, HEIGHT, Rgb([255, 255, 255]));
    let black = Rgb([0, 0, 0]);
    let all = || series.iter().flat_map(|s| s.points.iter());
    let (x0, x1) = all().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
        (a.min(p.0), b.max(p.0))
    });
    let (y0, y1) = all()
        .filter(|p| p.1.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
            (a.min(p.1), b.max(p.1))
        });
    let [left, top, right, bottom] = MARGIN;
    let (w, h) = (WIDTH as f64 - left - right, HEIGHT as f64 - top - bottom);
    draw_text(&mut image, title, left as i64, 8, 2, black);
    // axes
    line(&mut image, (left, top), (left, top + h), black);
    line(&mut image, (left, top + h), (left + w, top + h), black);
    if !(x0.is_finite() && y0.is_finite()) {
        draw_text(
            &mut image,
            "no data yet",
            (left + 20.0) as i64,
            (top + 20.0) as i64,
            1,
            black,
        );
        return image;
    }
    let (y0, y1) = if y1 > y0 {
        (y0.min(0.0), y1)
    } else {
        (y0 - 1.0, y0 + 1.0)
    };
    let x1 = if x1 > x0 { x1 } else { x0 + 1.0 };
    let at = |(x, y): (f64, f64)| {
        (
            left + (x - x0) / (x1 - x0) * w,
            top + h - (y - y0) / (y1 - y0) * h,
        )
    };
    let grey = Rgb([120, 120, 120]);
    draw_text(&mut image, &label(y1), 4, top as i64, 1, grey);
    draw_text(&mut image, &label(y0), 4, (top + h - 8.0) as i64, 1, grey);
    draw_text(
        &mut image,
        &format!("step {x0:.0}"),
        left as i64,
        (top + h + 8.0) as i64,
        1,
        grey,
    );
    let end = format!("step {x1:.0}");
    let end_x = left + w - 8.0 * end.len() as f64;
    draw_text(
        &mut image,
        &end,
        end_x as i64,
        (top + h + 8.0) as i64,
        1,
        grey,
    );
    for (i, s) in series.iter().enumerate() {
        let colour = Rgb(COLOURS[i % COLOURS.len()]);
        let pts: Vec<_> = s
            .points
            .iter()
            .filter(|p| p.1.is_finite())
            .map(|&p| at(p))
            .collect();
        for pair in pts.windows(2) {
            line(&mut image, pair[0], pair[1], colour);
        }
        if let [only] = pts.as_slice() {
            let (x, y) = (only.0 as i64, only.1 as i64);
            fill(&mut image, [x - 3, y - 3, x + 3, y + 3], colour);
        }
        let ly = (top + h + 26.0) as i64;
        let lx = left as i64 + i as i64 * 160;
        fill(&mut image, [lx, ly + 2, lx + 16, ly + 6], colour);
        draw_text(&mut image, s.name, lx + 20, ly, 1, black);
    }
    image
}

/// Writes `loss.png`, `learning_rate.png` and `eval.png` into `model_dir` from its
/// `metrics.jsonl`; returns their paths.
pub fn write_charts(model_dir: &Path) -> Result<Vec<PathBuf>> {
    let [loss, lr, eval] = read_series(&model_dir.join("metrics.jsonl"))?;
    let mut written = Vec::new();
    for (file, title, series) in [
        ("loss.png", "loss", loss),
        ("learning_rate.png", "learning rate", lr),
        ("eval.png", "evaluation", eval),
    ] {
        let path = model_dir.join(file);
        let mut png = Vec::new();
        chart(title, &series)
            .write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
            .context("encoding a chart")?;
        model::weights::write_atomic(&path, &png)
            .with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_plot_the_metrics_file() {
        let dir = tempfile::tempdir().unwrap();
        let lines = [
            r#"{"step":10,"loss":{"total":4.0,"classification":3.0,"localization":0.9,"regularization":0.1},"learning_rate":0.004}"#,
            r#"{"step":20,"loss":{"total":2.0,"classification":1.5,"localization":0.4,"regularization":0.1},"learning_rate":0.002}"#,
            r#"{"step":20,"eval":{"voc_mAP":0.5,"AP":0.2,"AP50":0.5}}"#,
        ];
        std::fs::write(dir.path().join("metrics.jsonl"), lines.join("\n")).unwrap();
        let files = write_charts(dir.path()).unwrap();
        assert_eq!(files.len(), 3);
        let loss = image::open(&files[0]).unwrap().to_rgb8();
        assert_eq!(loss.dimensions(), (WIDTH, HEIGHT));
        // the total loss line starts at the top-left corner of the plot (step 10, loss 4.0 is
        // the maximum) and ends at the right edge
        let [left, top, right, _] = MARGIN;
        let blue = Rgb(COLOURS[0]);
        let near = |x: f64, y: f64| {
            (-2..=2).any(|dx| {
                (-2..=2).any(|dy| {
                    *loss.get_pixel((x as i64 + dx) as u32, (y as i64 + dy) as u32) == blue
                })
            })
        };
        assert!(near(left + 1.0, top + 1.0));
        assert!(near(
            WIDTH as f64 - right - 1.0,
            top + (HEIGHT as f64 - top - MARGIN[3]) * 0.5
        ));
        // the evaluation chart has its single point drawn
        let eval = image::open(&files[2]).unwrap().to_rgb8();
        assert!(eval.pixels().any(|p| *p == Rgb(COLOURS[0])));
        // a malformed line is an error naming the file and line
        std::fs::write(dir.path().join("metrics.jsonl"), "{\"step\": 1}\nnot json").unwrap();
        let err = write_charts(dir.path()).unwrap_err();
        assert!(format!("{err:#}").contains("line 2"), "{err:#}");
    }
}
