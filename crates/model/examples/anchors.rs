//! Prints the anchors of a config as JSON `[[ymin, xmin, ymax, xmax], ...]`, normalised.
//!
//! `cargo run -p model --example anchors [-- CONFIG.json]` (default config without a file).
//! A training config (with a `model` section) is accepted as well as a bare model config.

use model::SsdConfig;
use model::ssd::anchors;

fn main() {
    let config = match std::env::args().nth(1) {
        None => SsdConfig::default(),
        Some(path) => match load(&path) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
        },
    };
    let boxes: Vec<[f32; 4]> = anchors(&config).iter().map(|b| b.to_array()).collect();
    println!(
        "{}",
        serde_json::to_string(&boxes).expect("floats serialise")
    );
}

fn load(path: &str) -> Result<SsdConfig, Box<dyn std::error::Error>> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {path}: {e}"))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
    let model = value.get("model").cloned().unwrap_or(value);
    let config: SsdConfig = serde_json::from_value(model).map_err(|e| format!("{path}: {e}"))?;
    config.validate()?;
    Ok(config)
}
