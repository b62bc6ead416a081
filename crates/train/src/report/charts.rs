//! PNG charts of a run without TensorBoard: the loss parts, the learning rate and the
//! evaluation metrics over steps, read from the model dir's `metrics.jsonl` and drawn with
//! `plotters`: labelled axes with ticks, a grid, a legend, each loss part raw (faint) and
//! smoothed (solid), evaluation points marked.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;
use plotters::style::FontStyle;

/// One line of a chart.
struct Series {
    name: &'static str,
    points: Vec<(f64, f64)>,
}

/// What a chart shows and how.
struct ChartSpec<'a> {
    title: &'a str,
    y_label: &'a str,
    series: &'a [Series],
    /// Draw each series raw (faint) under its smoothed curve.
    smoothed: bool,
    /// Mark every point (sparse series such as evaluations).
    marked: bool,
}

const WIDTH: u32 = 720;
const HEIGHT: u32 = 420;
const COLOURS: [RGBColor; 4] = [
    RGBColor(0, 90, 200),
    RGBColor(220, 60, 40),
    RGBColor(40, 160, 60),
    RGBColor(150, 60, 180),
];
/// Weight of the exponential smoothing of the loss curves (TensorBoard's scheme, with its
/// start-up bias removed); 0.9 averages over roughly the last ten logged steps.
const SMOOTHING: f64 = 0.9;
/// How faint the raw curves are under the smoothed ones.
const RAW_OPACITY: f64 = 0.3;
/// The family name the bundled font is registered under.
const FONT: &str = "sans-serif";

/// The largest step or value drawn. No loss, rate or metric worth a chart is larger, and
/// ranges near the limits of `f64` overflow the axis computations.
const PLOTTABLE: f64 = 1e15;

/// Adds `(step, value)` to `series` when both can be drawn; otherwise counts it in `skipped`.
fn add(series: &mut Series, (step, value): (f64, Option<f64>), skipped: &mut usize) {
    match value {
        Some(y) if step.abs() <= PLOTTABLE && y.abs() <= PLOTTABLE => series.points.push((step, y)),
        Some(_) => *skipped += 1,
        None => {}
    }
}

/// Reads `metrics.jsonl` into the chart series (loss parts, learning rate, evaluation), with
/// the count of values left out for being too large to draw.
fn read_series(metrics: &Path) -> Result<([Vec<Series>; 3], usize)> {
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
    let mut skipped = 0;
    for (i, l) in text.lines().enumerate() {
        let v: serde_json::Value = serde_json::from_str(l)
            .with_context(|| format!("{} line {}: not JSON", metrics.display(), i + 1))?;
        let Some(step) = v["step"].as_f64() else {
            continue;
        };
        for s in &mut loss {
            add(s, (step, v["loss"][s.name].as_f64()), &mut skipped);
        }
        add(&mut lr, (step, v["learning_rate"].as_f64()), &mut skipped);
        for (s, key) in eval.iter_mut().zip(["voc_mAP", "AP", "AP50"]) {
            add(s, (step, v["eval"][key].as_f64()), &mut skipped);
        }
    }
    Ok(([loss.into(), vec![lr], eval.into()], skipped))
}

/// `points` smoothed exponentially with `weight`, debiased so the first values are not
/// pulled towards zero: `s_i = m_i / (1 - weight^(i+1))`, `m_i = weight m_(i-1) + (1 - weight) y_i`.
fn smooth(points: &[(f64, f64)], weight: f64) -> Vec<(f64, f64)> {
    let mut moving = 0.0;
    let mut bias = 1.0;
    points
        .iter()
        .map(|&(x, y)| {
            moving = weight * moving + (1.0 - weight) * y;
            bias *= weight;
            (x, moving / (1.0 - bias))
        })
        .collect()
}

/// Room above the highest value, as a share of the values' span: the legend in the upper
/// right corner stays above every line (4 entries take about a quarter of the plot's height).
const LEGEND_HEADROOM: f64 = 0.5;

/// The plotted ranges: every point inside, with a little room (a lone value gets a range of
/// its own) and the legend's room above the highest value.
fn ranges(series: &[Series]) -> (std::ops::Range<f64>, std::ops::Range<f64>) {
    let points = series.iter().flat_map(|s| &s.points);
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in points.filter(|(x, y)| x.is_finite() && y.is_finite()) {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        return (0.0..1.0, 0.0..1.0);
    }
    let pad = |lo: f64, hi: f64, headroom: f64| {
        let span = if hi > lo {
            hi - lo
        } else {
            lo.abs().max(1.0) * 10.0
        };
        (lo - span * 0.05)..(hi + span * (0.05 + headroom))
    };
    (pad(x0, x1, 0.0), pad(y0.min(0.0), y1, LEGEND_HEADROOM))
}

/// Makes the bundled font known to `plotters` (once per process).
fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            plotters::style::register_font(
                FONT,
                FontStyle::Normal,
                epaint_default_fonts::UBUNTU_LIGHT,
            )
            .map_err(|_| "the bundled chart font does not load".to_string())
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

/// Draws a chart into an RGB buffer of `WIDTH` x `HEIGHT`.
fn draw(spec: &ChartSpec) -> Result<Vec<u8>> {
    register_font()?;
    let mut pixels = vec![0u8; (WIDTH * HEIGHT * 3) as usize];
    let root = BitMapBackend::with_buffer(&mut pixels, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let (x, y) = ranges(spec.series);
    let mut chart = ChartBuilder::on(&root)
        .caption(spec.title, (FONT, 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(x, y)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(spec.y_label)
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 15))
        .light_line_style(RGBColor(235, 235, 235))
        .bold_line_style(RGBColor(205, 205, 205))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    for (s, colour) in spec.series.iter().zip(COLOURS) {
        draw_series(&mut chart, s, colour, spec)?;
    }
    chart
        .configure_series_labels()
        .label_font((FONT, 13))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(160, 160, 160))
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    drop(chart);
    drop(root);
    Ok(pixels)
}

type Chart<'a, 'b> = ChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// One series: raw and smoothed, or as it is; marked when asked; named in the legend.
fn draw_series(chart: &mut Chart, s: &Series, colour: RGBColor, spec: &ChartSpec) -> Result<()> {
    let solid = if spec.smoothed {
        let raw = colour.mix(RAW_OPACITY);
        chart
            .draw_series(LineSeries::new(s.points.iter().copied(), raw))
            .map_err(|e| anyhow!("{e}"))?;
        smooth(&s.points, SMOOTHING)
    } else {
        s.points.clone()
    };
    chart
        .draw_series(LineSeries::new(solid, colour.stroke_width(2)))
        .map_err(|e| anyhow!("{e}"))?
        .label(s.name)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(2)));
    if spec.marked {
        chart
            .draw_series(s.points.iter().map(|&p| Circle::new(p, 4, colour.filled())))
            .map_err(|e| anyhow!("{e}"))?;
    }
    Ok(())
}

/// The charts written.
#[derive(Debug)]
pub struct Charts {
    /// `loss.png`, `learning_rate.png` and `eval.png`, each where the log has its values.
    pub files: Vec<PathBuf>,
    /// Values of the log left out, being larger than `PLOTTABLE` (a diverging run's).
    pub skipped: usize,
}

impl Charts {
    /// What a user should know beside the files: the values left out, if any.
    pub fn note(&self) -> Option<String> {
        (self.skipped > 0).then(|| {
            format!(
                "{} values of metrics.jsonl are beyond {PLOTTABLE:e} in size and left out of the charts",
                self.skipped
            )
        })
    }
}

/// Writes `loss.png`, `learning_rate.png` and `eval.png` into `model_dir` from its
/// `metrics.jsonl`, each chart where the log has its values (no `eval.png` for a run
/// without evaluations).
pub fn write_charts(model_dir: &Path) -> Result<Charts> {
    let ([loss, lr, eval], skipped) = read_series(&model_dir.join("metrics.jsonl"))?;
    let specs = [
        (
            "loss.png",
            ChartSpec {
                title: "loss (faint: as logged, solid: smoothed)",
                y_label: "loss",
                series: &loss,
                smoothed: true,
                marked: false,
            },
        ),
        (
            "learning_rate.png",
            ChartSpec {
                title: "learning rate",
                y_label: "learning rate",
                series: &lr,
                smoothed: false,
                marked: false,
            },
        ),
        (
            "eval.png",
            ChartSpec {
                title: "evaluation",
                y_label: "metric",
                series: &eval,
                smoothed: false,
                marked: true,
            },
        ),
    ];
    let mut written = Vec::new();
    // a run without evaluations (`--no-eval`) gets no empty evaluation chart
    let drawn = specs
        .into_iter()
        .filter(|(_, spec)| spec.series.iter().any(|s| !s.points.is_empty()));
    for (file, spec) in drawn {
        let path = model_dir.join(file);
        let image = image::RgbImage::from_raw(WIDTH, HEIGHT, draw(&spec)?)
            .context("a chart's pixel buffer")?;
        let mut png = Vec::new();
        image
            .write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
            .context("encoding a chart")?;
        model::io::write_atomic(&path, &png)
            .with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(Charts {
        files: written,
        skipped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::Rgb;

    #[test]
    fn smoothing_is_debiased_exponential_averaging() {
        let s = smooth(&[(1.0, 2.0), (2.0, 2.0), (3.0, 2.0)], 0.9);
        for (_, y) in &s {
            assert!((y - 2.0).abs() < 1e-12, "{s:?}");
        }
        // m = 0.1 * 10 = 1 after a first value of 0, divided by 1 - 0.81
        let s = smooth(&[(1.0, 0.0), (2.0, 10.0)], 0.9);
        assert_eq!(s[0], (1.0, 0.0));
        assert!((s[1].1 - 1.0 / 0.19).abs() < 1e-12, "{s:?}");
    }

    fn has_colour(image: &image::RgbImage, c: RGBColor) -> bool {
        image.pixels().any(|p| *p == Rgb([c.0, c.1, c.2]))
    }

    /// The longest run of the solid colour `c` along one row of `image`.
    fn longest_row_run(image: &image::RgbImage, c: RGBColor) -> u32 {
        let mut best = 0;
        for y in 0..image.height() {
            let mut run = 0;
            for x in 0..image.width() {
                run = if *image.get_pixel(x, y) == Rgb([c.0, c.1, c.2]) {
                    run + 1
                } else {
                    0
                };
                best = best.max(run);
            }
        }
        best
    }

    #[test]
    fn the_legend_covers_no_line() {
        // a loss that stays at its highest value: the line runs along the top of the values,
        // across the whole plot, where an upper-right legend would lie over it
        let dir = tempfile::tempdir().unwrap();
        let lines: Vec<String> = (1..=50)
            .map(|i| {
                format!(
                    r#"{{"step":{i},"loss":{{"total":4.0,"classification":3.0,"localization":0.9,"regularization":0.1}},"learning_rate":0.004}}"#
                )
            })
            .collect();
        std::fs::write(dir.path().join("metrics.jsonl"), lines.join("\n")).unwrap();
        let files = write_charts(dir.path()).unwrap().files;
        let loss = image::open(&files[0]).unwrap().to_rgb8();
        // the plot spans the width less the y labels and margins (632 pixels), the line
        // 1 / 1.1 of it (5% of room on either side): 574 pixels; a legend over it takes 100+
        let run = longest_row_run(&loss, COLOURS[0]);
        assert!(
            run > 540,
            "the total loss line is unbroken for {run} pixels only"
        );
    }

    #[test]
    fn charts_plot_the_metrics_file() {
        let dir = tempfile::tempdir().unwrap();
        let lines = [
            r#"{"step":10,"loss":{"total":4.0,"classification":3.0,"localization":0.9,"regularization":0.1},"learning_rate":0.004}"#,
            r#"{"step":20,"loss":{"total":2.0,"classification":1.5,"localization":0.4,"regularization":0.1},"learning_rate":0.002}"#,
            r#"{"step":30,"loss":{"total":3.0,"classification":2.5,"localization":0.4,"regularization":0.1},"learning_rate":0.001}"#,
            r#"{"step":30,"eval":{"voc_mAP":0.5,"AP":0.2,"AP50":0.5}}"#,
        ];
        std::fs::write(dir.path().join("metrics.jsonl"), lines.join("\n")).unwrap();
        let files = write_charts(dir.path()).unwrap().files;
        let names: Vec<_> = files
            .iter()
            .map(|f| f.file_name().unwrap().to_owned())
            .collect();
        assert_eq!(names, ["loss.png", "learning_rate.png", "eval.png"]);
        let loss = image::open(&files[0]).unwrap().to_rgb8();
        assert_eq!(loss.dimensions(), (WIDTH, HEIGHT));
        // every loss part is drawn solid (smoothed) in its colour
        for c in COLOURS {
            assert!(has_colour(&loss, c), "{c:?} missing");
        }
        // the raw curves lie under the smoothed ones, fainter: pixels that are neither white,
        // grid grey, text black nor a solid series colour
        let solid: Vec<Rgb<u8>> = COLOURS.iter().map(|c| Rgb([c.0, c.1, c.2])).collect();
        let faint_blue = loss.pixels().filter(|p| {
            let [r, g, b] = p.0;
            b > r && b > g && b < 255 && !solid.contains(p) && r > 100
        });
        assert!(faint_blue.count() > 20, "no faint raw curve");
        // the evaluation chart marks its points
        let eval = image::open(&files[2]).unwrap().to_rgb8();
        let marker = eval.pixels().filter(|p| **p == solid[0]).count();
        assert!(marker >= 20, "{marker} marker pixels");
        // values no axis can hold are left out and counted, not drawn for ever
        let mut extreme = lines.to_vec();
        extreme.push(r#"{"step":40,"loss":{"total":1e300,"classification":-1.7e308,"localization":1e16,"regularization":0.1},"learning_rate":1e308}"#);
        extreme.push(r#"{"step":1e300,"loss":{"total":1.0}}"#);
        std::fs::write(dir.path().join("metrics.jsonl"), extreme.join("\n")).unwrap();
        let charts = write_charts(dir.path()).unwrap();
        assert_eq!(charts.skipped, 5);
        assert!(
            charts
                .note()
                .unwrap()
                .starts_with("5 values of metrics.jsonl are beyond 1e15")
        );
        // a log without evaluations draws no evaluation chart
        let other = tempfile::tempdir().unwrap();
        std::fs::write(other.path().join("metrics.jsonl"), lines[..3].join("\n")).unwrap();
        let files = write_charts(other.path()).unwrap().files;
        assert_eq!(files.len(), 2, "{files:?}");
        assert!(!other.path().join("eval.png").exists());
        // a malformed line is an error naming the file and line
        std::fs::write(dir.path().join("metrics.jsonl"), "{\"step\": 1}\nnot json").unwrap();
        let err = write_charts(dir.path()).unwrap_err();
        assert!(format!("{err:#}").contains("line 2"), "{err:#}");
    }
}
