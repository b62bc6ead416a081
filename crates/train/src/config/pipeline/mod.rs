//! Import of the TF Object Detection API's `pipeline.config` (protobuf text format) into a
//! [`TrainConfig`]. The subset of SSD-MobileNet-v1 configs is read: `model.ssd`,
//! `train_config`, the train and eval input readers and `eval_config`. Absent fields take the
//! API's proto defaults (not ours). A value we cannot honour (another architecture, loss,
//! optimizer, ...) is an error naming the field and its line, all of them at once; fields that
//! only steer TensorFlow's machinery (queues, reader threads, evaluation intervals) are ignored
//! with a note.

//!
//! One module per part: `section` reads a message and reports what is left unread;
//! `ssd` (with `hyperparams`, `targets`, `loss` and `post_processing`) the model,
//! `train` the `train_config`, `input` the input readers and `eval_config`.

mod hyperparams;
mod input;
mod loss;
mod post_processing;
mod section;
mod ssd;
mod targets;
mod train;

use std::path::Path;

use anyhow::{Context, Result, bail};
use data::textproto::Message;
use model::SsdConfig;
use model::config::QuantizationConfig;

use self::section::{Report, Section, require};
use super::settings::{DEFAULT_PREFETCH, DataSettings, TrainConfig};

/// A converted config and what the conversion left out.
#[derive(Debug, Clone)]
pub struct Imported {
    /// The config.
    pub config: TrainConfig,
    /// Fields ignored, and values the user still has to fill in.
    pub notes: Vec<String>,
}

/// Reads `path` (a `pipeline.config`) and converts it.
pub fn import(path: &Path) -> Result<Imported> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    import_text(&text).with_context(|| format!("importing {}", path.display()))
}

/// Converts `pipeline.config` text.
pub fn import_text(text: &str) -> Result<Imported> {
    let root = Message::parse(text).map_err(|e| anyhow::anyhow!(e))?;
    let mut report = Report::default();
    let config = convert(&root, &mut report);
    if !report.errors.is_empty() {
        bail!(
            "{} unsupported setting(s):\n  {}",
            report.errors.len(),
            report.errors.join("\n  ")
        );
    }
    let config = config.context("incomplete config")?;
    config.validate()?;
    Ok(Imported {
        config,
        notes: report.notes,
    })
}

fn convert(root: &Message, report: &mut Report) -> Option<TrainConfig> {
    let mut top = Section::new(root, "");
    let mut model = SsdConfig::default();
    read_model(&mut top, &mut model, report);
    let mut augmentation = Vec::new();
    let train = match top.child("train_config", report) {
        Some(t) => train::read_train(t, &mut augmentation, report),
        None => {
            report.errors.push("`train_config` is missing".into());
            None
        }
    };
    let (data, label_map) = read_inputs(&mut top, augmentation, report);
    let eval = top
        .child("eval_config", report)
        .map(|e| input::read_eval_config(e, report))
        .unwrap_or_default();
    if let Some(path) = label_map {
        read_class_names(&path, &mut model, report);
    }
    read_graph_rewriter(&mut top, &mut model, report);
    top.ignore(
        &["eval_input_readers"],
        "evaluation reads the eval input reader",
        report,
    );
    top.finish(report);
    Some(TrainConfig {
        model,
        train: train?,
        data,
        eval,
    })
}

/// `graph_rewriter { quantization { ... } }`: quantization-aware training, 8 bits only (as
/// the API's `graph_rewriter_builder` demands).
fn read_graph_rewriter(top: &mut Section, model: &mut SsdConfig, report: &mut Report) {
    let Some(mut rewriter) = top.child("graph_rewriter", report) else {
        return;
    };
    if let Some(mut q) = rewriter.child("quantization", report) {
        let proto = QuantizationConfig::default();
        let mut bits = |name: &str| {
            let bits = q.number(name, 8u32, report);
            require(&q.path, name, bits, 8, report);
            bits
        };
        let (weight_bits, activation_bits) = (bits("weight_bits"), bits("activation_bits"));
        let quantization = QuantizationConfig {
            delay: q.number("delay", proto.delay, report),
            weight_bits,
            activation_bits,
            symmetric: q.flag("symmetric", proto.symmetric, report),
        };
        report.notes.push(format!(
            "{}: quantization-aware training, fake quantization from step {}",
            q.path,
            quantization.delay.max(1)
        ));
        q.finish(report);
        model.quantization = Some(quantization);
    }
    rewriter.finish(report);
}

/// `model`: only `ssd` models.
fn read_model(top: &mut Section, model: &mut SsdConfig, report: &mut Report) {
    let Some(mut m) = top.child("model", report) else {
        report
            .errors
            .push("`model { ssd { ... } }` is missing".into());
        return;
    };
    match m.one_of(&["ssd"], report) {
        Some((_, s)) => ssd::read_ssd(s, model, report),
        None => report
            .errors
            .push("model: only `ssd` models are supported".into()),
    }
    m.finish(report);
}

/// The data settings from both input readers, and the first label map they name.
fn read_inputs(
    top: &mut Section,
    augmentation: Vec<data::augment::Augmentation>,
    report: &mut Report,
) -> (DataSettings, Option<String>) {
    let mut data = DataSettings {
        train: Vec::new(),
        eval: Vec::new(),
        augmentation,
        workers: 0,
        prefetch: DEFAULT_PREFETCH,
        synthetic_if_missing: false,
    };
    let mut label_maps = Vec::new();
    if let Some(r) = top.child("train_input_reader", report) {
        let (paths, label_map) = input::read_input(r, report);
        data.train = paths;
        label_maps.extend(label_map);
    }
    if let Some(r) = top.child("eval_input_reader", report) {
        let (paths, label_map) = input::read_input(r, report);
        data.eval = paths;
        label_maps.extend(label_map);
    }
    if data.train.is_empty() {
        report
            .errors
            .push("train_input_reader.tf_record_input_reader.input_path is missing".into());
    }
    (data, label_maps.into_iter().next())
}

/// Class names from the label map, each id in its own place, with a note for ids without an
/// item; a note saying why they stay `class_<id>` when the file cannot be read (a template's
/// placeholder path). A label map that is there but wrong is an error.
fn read_class_names(path: &str, model: &mut SsdConfig, report: &mut Report) {
    let map = match data::LabelMap::load(Path::new(path)) {
        Ok(map) => map,
        Err(e @ data::DataError::Io { .. }) => {
            let note = format!("label map {path} not read ({e}); class names stay `class_<id>`");
            return report.notes.push(note);
        }
        Err(e) => return report.errors.push(format!("label map: {e}")),
    };
    match map.names_by_id(model.num_classes) {
        Ok((names, missing)) => {
            model.class_names = names;
            if !missing.is_empty() {
                report.notes.push(format!(
                    "label map {path} has no item for ids {missing:?}: those classes keep their places (class id = label-map id, as in the Object Detection API) and are named `class_<id>`"
                ));
            }
        }
        Err(e) => report.errors.push(format!("label map {path}: {e}")),
    }
}
