//! Training configs: JSON files ([`settings`] has the sections and their defaults), or a TF
//! Object Detection API `pipeline.config` imported on the fly ([`pipeline`]); every value is
//! checked before a run starts (`validate`).

pub mod pipeline;
mod schedule;
pub mod settings;
mod validate;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

pub use settings::{
    DataSettings, EvalSettings, LearningRate, OptimizerConfig, TrainConfig, TrainSettings,
};

impl TrainConfig {
    /// Reads and validates a JSON config, or imports a TF Object Detection API
    /// `pipeline.config` (a `.config` file; each note of the import is printed to stderr).
    pub fn load(path: &Path) -> Result<Self> {
        if path.extension().is_some_and(|e| e == "config") {
            let imported = pipeline::import(path)?;
            for note in &imported.notes {
                eprintln!("note: {}: {note}", path.display());
            }
            return Ok(imported.config);
        }
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config {}", path.display()))?;
        let config = parse_json(&text).with_context(|| format!("config {}", path.display()))?;
        config
            .validate()
            .with_context(|| format!("config {}", path.display()))?;
        Ok(config)
    }
}

/// The file of a model dir that keeps the whole config of the run that wrote it (as the API
/// copies `pipeline.config` into its model dir): `eval` and `export` take their data from it.
pub const RUN_CONFIG_FILE: &str = "config.json";

impl TrainConfig {
    /// Keeps this config in `model_dir` as the run's own ([`RUN_CONFIG_FILE`], atomically).
    pub fn keep_in(&self, model_dir: &Path) -> Result<()> {
        let path = model_dir.join(RUN_CONFIG_FILE);
        let json = serde_json::to_string_pretty(self)? + "\n";
        model::io::write_atomic(&path, json.as_bytes())
            .with_context(|| format!("writing {}", path.display()))
    }

    /// The config kept by the run that wrote `path` (a model dir, or a checkpoint folder in
    /// one), with its file; `None` where there is none (an export, a TF checkpoint, a run
    /// that kept none).
    pub fn of_run(path: &Path) -> Result<Option<(PathBuf, Self)>> {
        let candidates = [Some(path), path.parent()];
        let Some(file) = candidates
            .into_iter()
            .flatten()
            .map(|dir| dir.join(RUN_CONFIG_FILE))
            .find(|f| f.is_file())
        else {
            return Ok(None);
        };
        Ok(Some((file.clone(), Self::load(&file)?)))
    }
}

/// A JSON config, its errors naming the field by its path (`train.batch_size`) and what the
/// field takes in words a config's writer knows, besides serde's line and column.
fn parse_json(text: &str) -> Result<TrainConfig> {
    let mut json = serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(&mut json).map_err(|e| {
        let plain = e
            .inner()
            .to_string()
            .replace("expected usize", "expected a whole number of at least 0")
            .replace("expected u64", "expected a whole number of at least 0")
            .replace("expected u32", "expected a whole number of at least 0")
            .replace("expected f32", "expected a number")
            .replace("expected f64", "expected a number");
        match e.path().to_string().as_str() {
            "." => anyhow::anyhow!("{plain}"),
            field => anyhow::anyhow!("`{field}`: {plain}"),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponential_decay_staircase() {
        let lr = LearningRate::ExponentialDecay {
            initial_learning_rate: 0.004,
            decay_steps: 800_720,
            decay_factor: 0.95,
            staircase: true,
            burnin_learning_rate: 0.0,
            burnin_steps: 0,
            min_learning_rate: 0.0,
        };
        assert_eq!(lr.at(0), 0.004);
        assert_eq!(lr.at(800_719), 0.004);
        assert!((lr.at(800_720) - 0.0038).abs() < 1e-12);
        assert!((lr.at(2 * 800_720 + 5) - 0.004 * 0.9025).abs() < 1e-12);
        let smooth = LearningRate::ExponentialDecay {
            initial_learning_rate: 1.0,
            decay_steps: 10,
            decay_factor: 0.5,
            staircase: false,
            burnin_learning_rate: 0.1,
            burnin_steps: 5,
            min_learning_rate: 0.3,
        };
        assert_eq!(smooth.at(4), 0.1); // burn-in
        assert!((smooth.at(10) - 0.5f64.powf(0.5)).abs() < 1e-12); // (10 - 5) / 10
        assert_eq!(smooth.at(1000), 0.3); // floor at min_learning_rate
    }

    #[test]
    fn cosine_decay_with_warmup_and_hold() {
        let lr = LearningRate::CosineDecay {
            learning_rate_base: 1.0,
            total_steps: 120,
            warmup_learning_rate: 0.1,
            warmup_steps: 10,
            hold_base_rate_steps: 10,
        };
        assert!((lr.at(0) - 0.1).abs() < 1e-12);
        assert!((lr.at(5) - (0.09 * 5.0 + 0.1)).abs() < 1e-12);
        assert_eq!(lr.at(15), 1.0); // hold
        assert_eq!(lr.at(20), 1.0);
        // halfway through the cosine part: 0.5 * (1 + cos(pi / 2)) = 0.5
        assert!((lr.at(70) - 0.5).abs() < 1e-12);
        assert!(lr.at(120).abs() < 1e-12);
        assert_eq!(lr.at(121), 0.0);
    }

    #[test]
    fn manual_step_and_constant() {
        let lr = LearningRate::ManualStep {
            initial_learning_rate: 0.01,
            schedule: vec![(100, 0.001), (200, 0.0001)],
        };
        assert_eq!(lr.at(99), 0.01);
        assert_eq!(lr.at(100), 0.001);
        assert_eq!(lr.at(250), 0.0001);
        assert_eq!(LearningRate::Constant { learning_rate: 0.2 }.at(7), 0.2);
    }

    #[test]
    fn shipped_configs_are_valid_and_unknown_fields_rejected() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        for name in [
            "synthetic.json",
            "ssd_mobilenet_v1_pets.json",
            "ssd_mobilenet_v1_catdog.json",
        ] {
            TrainConfig::load(&dir.join(name)).unwrap();
        }
        let text = std::fs::read_to_string(dir.join("synthetic.json")).unwrap();
        let bad = text.replacen("\"batch_size\"", "\"batch_sise\"", 1);
        let err = parse_json(&bad).unwrap_err().to_string();
        assert!(
            err.contains(
                "`train.batch_sise`: unknown field `batch_sise`, expected one of `batch_size`"
            ),
            "{err}"
        );
    }

    #[test]
    fn a_run_keeps_its_config_and_its_checkpoints_find_it() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let mut c = TrainConfig::load(&dir.join("synthetic.json")).unwrap();
        c.data.eval = vec!["elsewhere/val-*".into()];
        let run = tempfile::tempdir().unwrap();
        let ckpt = run.path().join("ckpt-000010");
        std::fs::create_dir(&ckpt).unwrap();
        assert!(TrainConfig::of_run(&ckpt).unwrap().is_none());
        c.keep_in(run.path()).unwrap();
        for place in [run.path(), &ckpt] {
            let (file, kept) = TrainConfig::of_run(place).unwrap().unwrap();
            assert_eq!(file, run.path().join(RUN_CONFIG_FILE));
            assert_eq!(kept, c);
        }
    }

    #[test]
    fn type_errors_name_the_field_the_value_and_what_it_takes() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let text = std::fs::read_to_string(dir.join("synthetic.json")).unwrap();
        for (from, to, message) in [
            (
                "\"batch_size\": 16",
                "\"batch_size\": \"16\"",
                "`train.batch_size`: invalid type: string \"16\", expected a whole number of at least 0",
            ),
            (
                "\"num_steps\": 3000",
                "\"num_steps\": -5",
                "`train.num_steps`: invalid value: integer `-5`, expected a whole number of at least 0",
            ),
            (
                "\"decay\": 0.99",
                "\"decay\": \"high\"",
                "`model.batch_norm.decay`: invalid type: string \"high\", expected a number",
            ),
        ] {
            let bad = text.replacen(from, to, 1);
            assert_ne!(bad, text, "{from}");
            let err = parse_json(&bad).unwrap_err().to_string();
            assert!(err.contains(message), "{err}");
            assert!(err.contains(" at line "), "{err}");
        }
    }

    #[test]
    fn zero_steps_zero_log_interval_and_negative_rates_are_refused() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let good = TrainConfig::load(&dir.join("synthetic.json")).unwrap();
        let refused = |edit: &dyn Fn(&mut TrainConfig), field: &str| {
            let mut c = good.clone();
            edit(&mut c);
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{err}");
        };
        refused(
            &|c| c.train.num_steps = 0,
            "`train.num_steps` must be at least 1, got 0",
        );
        refused(
            &|c| c.train.log_every = 0,
            "`train.log_every` must be at least 1, got 0",
        );
        let exponential = |burnin: f64, min: f64| LearningRate::ExponentialDecay {
            initial_learning_rate: 0.004,
            decay_steps: 1000,
            decay_factor: 0.95,
            staircase: true,
            burnin_learning_rate: burnin,
            burnin_steps: 10,
            min_learning_rate: min,
        };
        let cosine = |base: f64, warmup: f64| LearningRate::CosineDecay {
            learning_rate_base: base,
            total_steps: 100,
            warmup_learning_rate: warmup,
            warmup_steps: 10,
            hold_base_rate_steps: 0,
        };
        let rates = [
            (
                LearningRate::Constant {
                    learning_rate: -0.1,
                },
                "learning_rate` must be a finite rate of at least 0, got -0.1",
            ),
            (
                LearningRate::Constant {
                    learning_rate: f64::NAN,
                },
                "learning_rate` must be a finite rate of at least 0, got NaN",
            ),
            (
                LearningRate::Constant {
                    learning_rate: f64::INFINITY,
                },
                "learning_rate` must be a finite rate of at least 0, got inf",
            ),
            (
                LearningRate::ManualStep {
                    initial_learning_rate: 0.1,
                    schedule: vec![(10, -0.01)],
                },
                "learning_rate.schedule` must be a finite rate of at least 0, got -0.01",
            ),
            // gradient ascent during the burn-in or the warm-up
            (
                exponential(-0.001, 0.0),
                "learning_rate.burnin_learning_rate` must be a finite rate of at least 0, got -0.001",
            ),
            (
                exponential(0.0, f64::NAN),
                "learning_rate.min_learning_rate` must be a finite rate of at least 0, got NaN",
            ),
            (
                cosine(0.04, -0.01),
                "learning_rate.warmup_learning_rate` must be a finite rate of at least 0, got -0.01",
            ),
            (
                cosine(f64::INFINITY, 0.01),
                "learning_rate.learning_rate_base` must be a finite rate of at least 0, got inf",
            ),
            (
                cosine(0.04, 0.05),
                "`train.optimizer.learning_rate` is invalid",
            ),
        ];
        for (rate, message) in rates {
            let rate = &rate;
            refused(
                &|c| {
                    c.train.optimizer = OptimizerConfig::Momentum {
                        learning_rate: rate.clone(),
                        momentum: 0.9,
                    }
                },
                message,
            );
        }
        refused(
            &|c| {
                c.train.optimizer = OptimizerConfig::RmsProp {
                    learning_rate: exponential(0.0, 0.0),
                    momentum: 0.9,
                    decay: 0.9,
                    epsilon: f32::INFINITY,
                }
            },
            "epsilon finite and positive",
        );
    }

    #[test]
    fn empty_or_inverted_augmentation_ranges_are_refused_with_the_step() {
        use data::augment::{Augmentation, default_ssd_crop_operations};
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let mut c = TrainConfig::load(&dir.join("synthetic.json")).unwrap();
        c.data.augmentation = vec![
            Augmentation::RandomHorizontalFlip { probability: 0.5 },
            Augmentation::SsdRandomCrop {
                operations: default_ssd_crop_operations(),
            },
        ];
        c.validate().unwrap();
        let cases = [
            (
                Augmentation::RandomAdjustContrast {
                    min_delta: 1.25,
                    max_delta: 0.8,
                },
                "`data.augmentation[2].min_delta..max_delta`: [1.25, 0.8]",
            ),
            (
                Augmentation::RandomAdjustBrightness {
                    max_delta: f32::NAN,
                },
                "`data.augmentation[2].max_delta`: [0, NaN]",
            ),
            (
                Augmentation::RandomPadImage { max_scale: 0.5 },
                "`data.augmentation[2].max_scale`: [1, 0.5]",
            ),
            (
                Augmentation::RandomRgbToGray { probability: 1.5 },
                "`data.augmentation[2].probability`: [0, 1.5] is not a range within [0, 1]",
            ),
            // a canvas no memory holds, refused before a loader thread allocates it
            (
                Augmentation::RandomPadImage { max_scale: 1e9 },
                "`data.augmentation[2].max_scale`: [1, 1000000000] is not a range within [1, 8]",
            ),
        ];
        let scale = Augmentation::RandomImageScale {
            min_scale_ratio: 0.5,
            max_scale_ratio: 4.0,
        };
        let mut grown = c.clone();
        grown.data.augmentation.push(scale.clone());
        grown.validate().unwrap();
        // two steps each within the bound whose canvases together are not
        grown.data.augmentation.push(scale);
        let err = grown.validate().unwrap_err().to_string();
        assert!(
            err.contains("`data.augmentation[3]`: with the steps before it an image's side may grow 16 times, beyond 8"),
            "{err}"
        );
        for (step, message) in cases {
            let mut bad = c.clone();
            bad.data.augmentation.push(step);
            let err = bad.validate().unwrap_err().to_string();
            assert!(err.contains(message), "{err}");
        }
        let mut ops = default_ssd_crop_operations();
        ops[1].area_range = [0.5, 0.1];
        c.data.augmentation[1] = Augmentation::SsdRandomCrop { operations: ops };
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("`data.augmentation[1].operations[1].area_range`: [0.5, 0.1]"),
            "{err}"
        );
    }
}
