//! Import of the TF Object Detection API's `pipeline.config` (protobuf text format) into a
//! [`TrainConfig`]. The subset of SSD-MobileNet-v1 configs is read: `model.ssd`,
//! `train_config`, the train and eval input readers and `eval_config`. Absent fields take the
//! API's proto defaults (not ours). A value we cannot honour (another architecture, loss,
//! optimizer, ...) is an error naming the field and its line, all of them at once; fields that
//! only steer TensorFlow's machinery (queues, reader threads, evaluation intervals) are ignored
//! with a note.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use data::augment::{Augmentation, CropOperation};
use data::textproto::{Field, Message, Scalar, Value};
use model::SsdConfig;
use model::config::{HardExampleMinerConfig, MinerLossType};
use model::restore::RestoreScope;

use crate::config::{
    DataSettings, EvalSettings, LearningRate, OptimizerConfig, TrainConfig, TrainSettings,
};

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

#[derive(Default)]
struct Report {
    errors: Vec<String>,
    notes: Vec<String>,
}

/// One message being read: the fields taken are marked; the rest are reported by `finish`.
struct Section<'a> {
    message: &'a Message,
    path: String,
    used: Vec<bool>,
}

impl<'a> Section<'a> {
    fn new(message: &'a Message, path: impl Into<String>) -> Self {
        Self {
            message,
            path: path.into(),
            used: vec![false; message.fields.len()],
        }
    }

    /// The dotted path of field `name` of this message.
    fn join(&self, name: &str) -> String {
        if self.path.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.path)
        }
    }

    fn at(&self, field: &Field) -> String {
        format!("{} (line {})", self.join(&field.name), field.line)
    }

    /// Every field called `name`, marked as read.
    fn take(&mut self, name: &str) -> Vec<&'a Field> {
        let mut out = Vec::new();
        for (i, f) in self.message.fields.iter().enumerate() {
            if f.name == name {
                self.used[i] = true;
                out.push(f);
            }
        }
        out
    }

    /// The last scalar called `name` (protobuf text format: the last one wins).
    fn scalar(&mut self, name: &str, report: &mut Report) -> Option<(&'a Scalar, String)> {
        let field = self.take(name).pop()?;
        match &field.value {
            Value::Scalar(s) => Some((s, self.at(field))),
            Value::Message(_) => {
                report
                    .errors
                    .push(format!("{}: expected a value", self.at(field)));
                None
            }
        }
    }

    fn number<T: std::str::FromStr>(&mut self, name: &str, default: T, report: &mut Report) -> T {
        match self.scalar(name, report) {
            None => default,
            Some((Scalar::Number(n), at)) => n.parse().unwrap_or_else(|_| {
                report
                    .errors
                    .push(format!("{at}: `{n}` is not a valid number here"));
                default
            }),
            Some((other, at)) => {
                report
                    .errors
                    .push(format!("{at}: expected a number, found `{}`", other.text()));
                default
            }
        }
    }

    fn numbers(&mut self, name: &str, report: &mut Report) -> Vec<f32> {
        let fields = self.take(name);
        let mut out = Vec::new();
        for f in fields {
            match &f.value {
                Value::Scalar(Scalar::Number(n)) if n.parse::<f32>().is_ok() => {
                    out.push(n.parse().expect("checked"))
                }
                _ => report
                    .errors
                    .push(format!("{}: expected a number", self.at(f))),
            }
        }
        out
    }

    fn word(&mut self, name: &str, default: &str, report: &mut Report) -> String {
        match self.scalar(name, report) {
            None => default.to_string(),
            Some((s, _)) => s.text().to_string(),
        }
    }

    fn flag(&mut self, name: &str, default: bool, report: &mut Report) -> bool {
        match self.scalar(name, report) {
            None => default,
            Some((s, at)) => match s.text() {
                "true" | "True" | "t" | "1" => true,
                "false" | "False" | "f" | "0" => false,
                other => {
                    report
                        .errors
                        .push(format!("{at}: expected true or false, found `{other}`"));
                    default
                }
            },
        }
    }

    /// Reads number `name`, whose proto default is also the only value we support, and
    /// reports any other value.
    fn only_number<T>(&mut self, name: &str, supported: T, report: &mut Report)
    where
        T: std::str::FromStr + PartialEq + std::fmt::Debug + Copy,
    {
        let v = self.number(name, supported, report);
        require(&self.path, name, v, supported, report);
    }

    /// [`Section::only_number`] for a flag.
    fn only_flag(&mut self, name: &str, supported: bool, report: &mut Report) {
        let v = self.flag(name, supported, report);
        require(&self.path, name, v, supported, report);
    }

    /// The last sub-message called `name`.
    fn child(&mut self, name: &str, report: &mut Report) -> Option<Section<'a>> {
        let field = self.take(name).pop()?;
        match &field.value {
            Value::Message(m) => Some(Section::new(m, self.join(name))),
            Value::Scalar(_) => {
                report
                    .errors
                    .push(format!("{}: expected `{{ ... }}`", self.at(field)));
                None
            }
        }
    }

    /// Every sub-message called `name`.
    fn children(&mut self, name: &str, report: &mut Report) -> Vec<Section<'a>> {
        let path = self.join(name);
        let fields = self.take(name);
        let mut out = Vec::new();
        for f in fields {
            match &f.value {
                Value::Message(m) => out.push(Section::new(m, path.clone())),
                Value::Scalar(_) => report
                    .errors
                    .push(format!("{}: expected `{{ ... }}`", self.at(f))),
            }
        }
        out
    }

    /// The one set member of a `oneof` among `supported`; any other field is reported by
    /// `finish` as unsupported.
    fn one_of(&mut self, supported: &[&str], report: &mut Report) -> Option<(String, Section<'a>)> {
        let present: Vec<&str> = supported
            .iter()
            .copied()
            .filter(|n| self.message.fields.iter().any(|f| f.name == *n))
            .collect();
        match present[..] {
            [one] => self.child(one, report).map(|s| (one.to_string(), s)),
            [] if self.message.fields.is_empty() => {
                report.errors.push(format!(
                    "{}: one of {} is needed",
                    self.path,
                    supported.join(", ")
                ));
                None
            }
            [] => None,
            _ => {
                report.errors.push(format!(
                    "{}: only one of {} may be set",
                    self.path,
                    present.join(", ")
                ));
                None
            }
        }
    }

    /// Marks `names` as read and notes each one present as ignored, with `why`.
    fn ignore(&mut self, names: &[&str], why: &str, report: &mut Report) {
        for name in names {
            if let Some(f) = self.take(name).pop() {
                report
                    .notes
                    .push(format!("{}: ignored ({why})", self.at(f)));
            }
        }
    }

    /// Reports every field not read as unsupported.
    fn finish(self, report: &mut Report) {
        for (f, used) in self.message.fields.iter().zip(&self.used) {
            if !used {
                report.errors.push(format!("{}: not supported", self.at(f)));
            }
        }
    }
}

/// `require(value == expected)` with the field named.
fn require<T: PartialEq + std::fmt::Debug>(
    path: &str,
    what: &str,
    value: T,
    supported: T,
    report: &mut Report,
) {
    if value != supported {
        report.errors.push(format!(
            "{path}.{what}: {value:?} is not supported (only {supported:?})"
        ));
    }
}

fn convert(root: &Message, report: &mut Report) -> Option<TrainConfig> {
    let mut top = Section::new(root, "");
    let mut model = SsdConfig::default();
    match top.child("model", report) {
        Some(mut m) => {
            match m.one_of(&["ssd"], report) {
                Some((_, ssd)) => read_ssd(ssd, &mut model, report),
                None => report
                    .errors
                    .push("model: only `ssd` models are supported".into()),
            }
            m.finish(report);
        }
        None => report
            .errors
            .push("`model { ssd { ... } }` is missing".into()),
    }
    let mut train = None;
    let mut augmentation = Vec::new();
    match top.child("train_config", report) {
        Some(t) => {
            train = read_train(t, &mut augmentation, report);
        }
        None => report.errors.push("`train_config` is missing".into()),
    }
    let mut data = DataSettings {
        train: Vec::new(),
        eval: Vec::new(),
        augmentation,
        workers: 0,
        prefetch: 4,
        synthetic_if_missing: false,
    };
    let mut label_maps = Vec::new();
    for (name, target) in [("train_input_reader", 0), ("eval_input_reader", 1)] {
        if let Some(r) = top.child(name, report) {
            let (paths, label_map) = read_input(r, report);
            if target == 0 {
                data.train = paths;
            } else {
                data.eval = paths;
            }
            label_maps.extend(label_map);
        }
    }
    if data.train.is_empty() {
        report
            .errors
            .push("train_input_reader.tf_record_input_reader.input_path is missing".into());
    }
    let mut eval = EvalSettings::default();
    if let Some(mut e) = top.child("eval_config", report) {
        eval.max_images = e.number("num_examples", 5000usize, report);
        e.ignore(
            &[
                "batch_size",
                "max_evals",
                "num_visualizations",
                "visualization_export_dir",
                "eval_interval_secs",
                "metrics_set",
                "use_moving_averages",
                "export_path",
                "ignore_groundtruth",
                "min_score_threshold",
                "max_num_boxes_to_visualize",
                "skip_scores",
                "skip_labels",
                "visualize_groundtruth_boxes",
                "groundtruth_box_visualization_color",
                "keep_image_id_for_visualization_export",
                "retain_original_images",
                "include_metrics_per_category",
                "recall_lower_bound",
                "recall_upper_bound",
            ],
            "evaluation runs at `eval.every` steps and at the end of training, with COCO and VOC metrics and EMA weights when kept",
            report,
        );
        e.finish(report);
    }
    if let Some(path) = label_maps.first() {
        match data::LabelMap::load(Path::new(path)) {
            Ok(map) => model.class_names = map.names(),
            Err(e) => report.notes.push(format!(
                "label map {path} not read ({e}); class names stay `class_<id>`"
            )),
        }
    }
    top.ignore(
        &["graph_rewriter", "eval_input_readers"],
        "no graph rewriting (quantisation) here",
        report,
    );
    top.finish(report);
    let train = train?;
    Some(TrainConfig {
        model,
        train,
        data,
        eval,
    })
}

fn read_conv_hyperparams(
    mut h: Section,
    report: &mut Report,
) -> (Option<f32>, Option<f32>, Option<(f64, f64)>) {
    let path = h.path.clone();
    let activation = h.word("activation", "RELU", report);
    require(&path, "activation", activation.as_str(), "RELU_6", report);
    let mut l2 = None;
    if let Some(mut r) = h.child("regularizer", report) {
        if let Some((_, mut l)) = r.one_of(&["l2_regularizer"], report) {
            l2 = Some(l.number("weight", 1.0f32, report));
            l.finish(report);
        }
        r.finish(report);
    }
    let mut stddev = None;
    if let Some(mut i) = h.child("initializer", report) {
        if let Some((_, mut t)) = i.one_of(&["truncated_normal_initializer"], report) {
            let tpath = t.path.clone();
            let mean = t.number("mean", 0.0f32, report);
            require(&tpath, "mean", mean, 0.0, report);
            stddev = Some(t.number("stddev", 1.0f32, report));
            t.finish(report);
        }
        i.finish(report);
    }
    let mut batch_norm = None;
    match h.child("batch_norm", report) {
        Some(mut b) => {
            let bpath = b.path.clone();
            let decay = b.number("decay", 0.999f64, report);
            let epsilon = b.number("epsilon", 0.001f64, report);
            b.only_flag("center", true, report);
            b.only_flag("train", true, report);
            // absent, `scale` is false: no gamma, which our BatchNorm always has
            let scale = b.flag("scale", false, report);
            require(&bpath, "scale", scale, true, report);
            b.finish(report);
            batch_norm = Some((decay, epsilon));
        }
        None => report.errors.push(format!(
            "{path}: layers without `batch_norm` are not supported"
        )),
    }
    let op = h.word("op", "CONV", report);
    require(&path, "op", op.as_str(), "CONV", report);
    h.ignore(
        &["regularize_depthwise"],
        "depthwise kernels are regularised like the others",
        report,
    );
    h.finish(report);
    (l2, stddev, batch_norm)
}

fn read_ssd(mut s: Section, model: &mut SsdConfig, report: &mut Report) {
    let path = s.path.clone();
    for required in [
        "image_resizer",
        "feature_extractor",
        "box_coder",
        "matcher",
        "similarity_calculator",
        "anchor_generator",
        "box_predictor",
        "loss",
    ] {
        if s.message.all(required).next().is_none() {
            report.errors.push(format!("{path}.{required} is missing"));
        }
    }
    model.num_classes = s.number("num_classes", 0usize, report);
    if model.num_classes == 0 {
        report
            .errors
            .push(format!("{path}.num_classes must be set"));
    }
    if let Some(mut r) = s.child("image_resizer", report) {
        if let Some((_, mut f)) = r.one_of(&["fixed_shape_resizer"], report) {
            let h = f.number("height", 300usize, report);
            let w = f.number("width", 300usize, report);
            model.image_size = [h, w];
            let fpath = f.path.clone();
            let method = f.word("resize_method", "BILINEAR", report);
            require(&fpath, "resize_method", method.as_str(), "BILINEAR", report);
            f.only_flag("convert_to_grayscale", false, report);
            f.finish(report);
        }
        r.finish(report);
    }
    let mut l2_weights = Vec::new();
    let mut stddevs = Vec::new();
    if let Some(mut fe) = s.child("feature_extractor", report) {
        let fpath = fe.path.clone();
        let kind = fe.word("type", "", report);
        require(&fpath, "type", kind.as_str(), "ssd_mobilenet_v1", report);
        model.depth_multiplier = fe.number("depth_multiplier", 1.0f32, report);
        model.min_depth = fe.number("min_depth", 16usize, report);
        fe.only_number("pad_to_multiple", 1usize, report);
        for name in [
            "use_explicit_padding",
            "use_depthwise",
            "override_base_feature_extractor_hyperparams",
        ] {
            fe.only_flag(name, false, report);
        }
        if let Some(h) = fe.child("conv_hyperparams", report) {
            let (l2, stddev, bn) = read_conv_hyperparams(h, report);
            l2_weights.extend(l2);
            stddevs.extend(stddev);
            if let Some((decay, epsilon)) = bn {
                model.batch_norm.decay = decay;
                model.batch_norm.epsilon = epsilon;
            }
        }
        fe.finish(report);
    }
    if let Some(mut bp) = s.child("box_predictor", report) {
        if let Some((_, mut c)) = bp.one_of(&["convolutional_box_predictor"], report) {
            for (name, supported) in [
                ("min_depth", 0usize),
                ("max_depth", 0),
                ("num_layers_before_predictor", 0),
                ("box_code_size", 4),
                ("kernel_size", 1),
            ] {
                c.only_number(name, supported, report);
            }
            for name in ["use_dropout", "apply_sigmoid_to_scores", "use_depthwise"] {
                c.only_flag(name, false, report);
            }
            c.only_number("class_prediction_bias_init", 0.0f32, report);
            c.ignore(
                &["dropout_keep_probability"],
                "no dropout (use_dropout is false)",
                report,
            );
            if let Some(h) = c.child("conv_hyperparams", report) {
                // the predictor convolutions have no BatchNorm whatever this says
                // (num_layers_before_predictor is 0)
                let (l2, stddev, _) = read_conv_hyperparams(h, report);
                l2_weights.extend(l2);
                stddevs.extend(stddev);
            }
            c.finish(report);
        }
        bp.finish(report);
    }
    if let Some(&w) = l2_weights.first() {
        model.loss.l2_weight = w;
        if l2_weights.iter().any(|&x| x != w) {
            report.errors.push(format!(
                "{path}: different L2 weights for the feature extractor and the box predictor ({l2_weights:?}) are not supported"
            ));
        }
    } else {
        model.loss.l2_weight = 0.0;
    }
    if let Some(&sd) = stddevs.first() {
        model.init_stddev = sd;
        if stddevs.iter().any(|&x| x != sd) {
            report.errors.push(format!(
                "{path}: different initializer stddevs for the feature extractor and the box predictor ({stddevs:?}) are not supported"
            ));
        }
    }
    if let Some(mut b) = s.child("box_coder", report) {
        if let Some((_, mut f)) = b.one_of(&["faster_rcnn_box_coder"], report) {
            model.box_coder_scales = [
                f.number("y_scale", 10.0f32, report),
                f.number("x_scale", 10.0f32, report),
                f.number("height_scale", 5.0f32, report),
                f.number("width_scale", 5.0f32, report),
            ];
            f.finish(report);
        }
        b.finish(report);
    }
    if let Some(mut m) = s.child("matcher", report) {
        if let Some((_, mut a)) = m.one_of(&["argmax_matcher"], report) {
            let mc = &mut model.matcher;
            mc.matched_threshold = a.number("matched_threshold", 0.5f32, report);
            mc.unmatched_threshold = a.number("unmatched_threshold", 0.5f32, report);
            a.only_flag("ignore_thresholds", false, report);
            mc.negatives_lower_than_unmatched =
                a.flag("negatives_lower_than_unmatched", true, report);
            mc.force_match_for_each_row = a.flag("force_match_for_each_row", false, report);
            a.ignore(
                &["use_matmul_gather"],
                "a TPU implementation detail",
                report,
            );
            a.finish(report);
        }
        m.finish(report);
    }
    if let Some(mut sc) = s.child("similarity_calculator", report) {
        if let Some((_, iou)) = sc.one_of(&["iou_similarity"], report) {
            iou.finish(report);
        }
        sc.finish(report);
    }
    if let Some(mut a) = s.child("anchor_generator", report) {
        if let Some((_, mut g)) = a.one_of(&["ssd_anchor_generator"], report) {
            let ac = &mut model.anchors;
            ac.num_layers = g.number("num_layers", 6usize, report);
            ac.min_scale = g.number("min_scale", 0.2f32, report);
            ac.max_scale = g.number("max_scale", 0.95f32, report);
            ac.aspect_ratios = g.numbers("aspect_ratios", report);
            if ac.aspect_ratios.is_empty() {
                report
                    .errors
                    .push(format!("{}.aspect_ratios must be given", g.path));
            }
            ac.interpolated_scale_aspect_ratio =
                g.number("interpolated_scale_aspect_ratio", 1.0f32, report);
            ac.base_anchor_size = [
                g.number("base_anchor_height", 1.0f32, report),
                g.number("base_anchor_width", 1.0f32, report),
            ];
            ac.reduce_boxes_in_lowest_layer = g.flag("reduce_boxes_in_lowest_layer", true, report);
            g.finish(report);
        }
        a.finish(report);
    }
    if let Some(mut l) = s.child("loss", report) {
        read_loss(&mut l, model, report);
        l.finish(report);
    }
    model.loss.normalize_loss_by_num_matches =
        s.flag("normalize_loss_by_num_matches", true, report);
    model.loss.normalize_loc_loss_by_codesize =
        s.flag("normalize_loc_loss_by_codesize", false, report);
    for (name, supported) in [
        ("encode_background_as_zeros", false),
        ("freeze_batchnorm", false),
        ("add_background_class", true),
    ] {
        s.only_flag(name, supported, report);
    }
    s.only_number("negative_class_weight", 1.0f32, report);
    s.ignore(
        &["inplace_batchnorm_update"],
        "BatchNorm statistics are always updated in the training step",
        report,
    );
    if let Some(mut p) = s.child("post_processing", report) {
        let ppath = p.path.clone();
        // absent, the NMS settings take their proto defaults too
        let defaults = Message::default();
        let nms = p.child("batch_non_max_suppression", report);
        {
            let mut n =
                nms.unwrap_or_else(|| Section::new(&defaults, p.join("batch_non_max_suppression")));
            let pc = &mut model.post_processing;
            pc.score_threshold = n.number("score_threshold", 0.0f32, report);
            pc.iou_threshold = n.number("iou_threshold", 0.6f32, report);
            pc.max_detections_per_class = n.number("max_detections_per_class", 100usize, report);
            pc.max_total_detections = n.number("max_total_detections", 100usize, report);
            for name in ["use_class_agnostic_nms", "use_combined_nms", "combined_nms"] {
                n.only_flag(name, false, report);
            }
            n.only_number("soft_nms_sigma", 0.0f32, report);
            n.ignore(
                &["use_static_shapes"],
                "an XLA/TPU implementation detail",
                report,
            );
            n.finish(report);
        }
        let converter = p.word("score_converter", "IDENTITY", report);
        require(
            &ppath,
            "score_converter",
            converter.as_str(),
            "SIGMOID",
            report,
        );
        p.only_number("logit_scale", 1.0f32, report);
        p.finish(report);
    }
    s.finish(report);
}

fn read_loss(l: &mut Section, model: &mut SsdConfig, report: &mut Report) {
    match l.child("classification_loss", report) {
        Some(mut c) => {
            if let Some((_, mut w)) = c.one_of(&["weighted_sigmoid"], report) {
                w.ignore(&["anchorwise_output"], "deprecated in the API", report);
                w.finish(report);
            }
            c.finish(report);
        }
        None => report
            .errors
            .push(format!("{}.classification_loss is missing", l.path)),
    }
    match l.child("localization_loss", report) {
        Some(mut c) => {
            if let Some((_, mut w)) = c.one_of(&["weighted_smooth_l1"], report) {
                model.loss.smooth_l1_delta = w.number("delta", 1.0f32, report);
                w.ignore(&["anchorwise_output"], "deprecated in the API", report);
                w.finish(report);
            }
            c.finish(report);
        }
        None => report
            .errors
            .push(format!("{}.localization_loss is missing", l.path)),
    }
    model.loss.hard_example_miner = l.child("hard_example_miner", report).map(|mut h| {
        let loss_type = match h.word("loss_type", "BOTH", report).as_str() {
            "CLASSIFICATION" => MinerLossType::Classification,
            "LOCALIZATION" => MinerLossType::Localization,
            "BOTH" => MinerLossType::Both,
            other => {
                report
                    .errors
                    .push(format!("{}.loss_type: unknown `{other}`", h.path));
                MinerLossType::Both
            }
        };
        let miner = HardExampleMinerConfig {
            num_hard_examples: h.number("num_hard_examples", 64usize, report),
            iou_threshold: h.number("iou_threshold", 0.7f32, report),
            loss_type,
            max_negatives_per_positive: h.number("max_negatives_per_positive", 0usize, report),
            min_negatives_per_image: h.number("min_negatives_per_image", 0usize, report),
        };
        h.finish(report);
        miner
    });
    model.loss.classification_weight = l.number("classification_weight", 1.0f32, report);
    model.loss.localization_weight = l.number("localization_weight", 1.0f32, report);
}

fn read_learning_rate(lr: Option<Section>, report: &mut Report) -> LearningRate {
    let fallback = LearningRate::Constant {
        learning_rate: 0.002,
    };
    let Some(mut lr) = lr else {
        return fallback;
    };
    let schedules = [
        "constant_learning_rate",
        "exponential_decay_learning_rate",
        "manual_step_learning_rate",
        "cosine_decay_learning_rate",
    ];
    let schedule = match lr.one_of(&schedules, report) {
        Some((name, mut s)) => {
            let out = match name.as_str() {
                "constant_learning_rate" => LearningRate::Constant {
                    learning_rate: s.number("learning_rate", 0.002, report),
                },
                "exponential_decay_learning_rate" => LearningRate::ExponentialDecay {
                    initial_learning_rate: s.number("initial_learning_rate", 0.002, report),
                    decay_steps: s.number("decay_steps", 4_000_000, report),
                    decay_factor: s.number("decay_factor", 0.95, report),
                    staircase: s.flag("staircase", true, report),
                    burnin_learning_rate: s.number("burnin_learning_rate", 0.0, report),
                    burnin_steps: s.number("burnin_steps", 0, report),
                    min_learning_rate: s.number("min_learning_rate", 0.0, report),
                },
                "manual_step_learning_rate" => {
                    let initial = s.number("initial_learning_rate", 0.002, report);
                    let mut schedule = Vec::new();
                    for mut e in s.children("schedule", report) {
                        schedule.push((
                            e.number("step", 0u64, report),
                            e.number("learning_rate", 0.002f64, report),
                        ));
                        e.finish(report);
                    }
                    s.only_flag("warmup", false, report);
                    LearningRate::ManualStep {
                        initial_learning_rate: initial,
                        schedule,
                    }
                }
                _ => LearningRate::CosineDecay {
                    learning_rate_base: s.number("learning_rate_base", 0.002, report),
                    total_steps: s.number("total_steps", 4_000_000, report),
                    warmup_learning_rate: s.number("warmup_learning_rate", 0.0002, report),
                    warmup_steps: s.number("warmup_steps", 10_000, report),
                    hold_base_rate_steps: s.number("hold_base_rate_steps", 0, report),
                },
            };
            s.finish(report);
            out
        }
        None => fallback,
    };
    lr.finish(report);
    schedule
}

fn read_train(
    mut t: Section,
    augmentation: &mut Vec<Augmentation>,
    report: &mut Report,
) -> Option<TrainSettings> {
    let path = t.path.clone();
    let batch_size = t.number("batch_size", 32usize, report);
    let num_steps = t.number("num_steps", 0u64, report);
    if num_steps == 0 {
        report.errors.push(format!(
            "{path}.num_steps: 0 (train forever) is not supported: set a step count"
        ));
    }
    let mut optimizer = None;
    let mut moving_average_decay = None;
    match t.child("optimizer", report) {
        Some(mut o) => {
            let kinds = ["rms_prop_optimizer", "momentum_optimizer", "adam_optimizer"];
            if let Some((kind, mut k)) = o.one_of(&kinds, report) {
                let learning_rate = read_learning_rate(k.child("learning_rate", report), report);
                optimizer = Some(match kind.as_str() {
                    "rms_prop_optimizer" => OptimizerConfig::RmsProp {
                        learning_rate,
                        momentum: k.number("momentum_optimizer_value", 0.9, report),
                        decay: k.number("decay", 0.9, report),
                        epsilon: k.number("epsilon", 1.0, report),
                    },
                    "momentum_optimizer" => OptimizerConfig::Momentum {
                        learning_rate,
                        momentum: k.number("momentum_optimizer_value", 0.9, report),
                    },
                    _ => OptimizerConfig::Adam {
                        learning_rate,
                        beta1: 0.9,
                        beta2: 0.999,
                        epsilon: k.number("epsilon", 1e-8, report),
                    },
                });
                k.finish(report);
            }
            if o.flag("use_moving_average", true, report) {
                moving_average_decay = Some(o.number("moving_average_decay", 0.9999f64, report));
            } else {
                o.ignore(
                    &["moving_average_decay"],
                    "use_moving_average is false",
                    report,
                );
            }
            o.finish(report);
        }
        None => report.errors.push(format!("{path}.optimizer is missing")),
    }
    let fine_tune = t.word("fine_tune_checkpoint", "", report);
    let from_detection = t.flag("from_detection_checkpoint", false, report);
    let checkpoint_type = t.word(
        "fine_tune_checkpoint_type",
        if from_detection {
            "detection"
        } else {
            "classification"
        },
        report,
    );
    let load_all = t.flag("load_all_detection_checkpoint_vars", false, report);
    let fine_tune_restore = match (checkpoint_type.as_str(), load_all) {
        ("detection", true) => RestoreScope::All,
        ("detection", false) => RestoreScope::FeatureExtractor,
        ("classification", _) => RestoreScope::Classification,
        (other, _) => {
            report.errors.push(format!(
                "{path}.fine_tune_checkpoint_type: `{other}` is not supported (detection or classification)"
            ));
            RestoreScope::All
        }
    };
    let fine_tune_checkpoint = (!fine_tune.is_empty()).then(|| PathBuf::from(&fine_tune));
    if fine_tune.contains("PATH_TO_BE_CONFIGURED") {
        report.notes.push(format!(
            "{path}.fine_tune_checkpoint: {fine_tune} still has to be filled in (training stops at its start until it names a checkpoint)"
        ));
    } else if let Some(f) = &fine_tune_checkpoint
        && !model::tf::bundle::is_checkpoint(f)
        && !f.exists()
    {
        report.notes.push(format!(
            "{path}.fine_tune_checkpoint: {} does not exist (yet): training stops at its start unless it does",
            f.display()
        ));
    }
    let clip = t.number("gradient_clipping_by_norm", 0.0f32, report);
    for mut step in t.children("data_augmentation_options", report) {
        if let Some(a) = read_augmentation(&mut step, report) {
            augmentation.push(a);
        }
        step.finish(report);
    }
    for (name, supported) in [
        ("merge_multiple_label_boxes", false),
        ("add_regularization_loss", true),
        ("use_bfloat16", false),
    ] {
        t.only_flag(name, supported, report);
    }
    t.only_number("bias_grad_multiplier", 0.0f32, report);
    if !t.take("freeze_variables").is_empty() || !t.take("update_trainable_variables").is_empty() {
        report
            .errors
            .push(format!("{path}: freezing variables is not supported"));
    }
    t.ignore(
        &[
            "sync_replicas",
            "replicas_to_aggregate",
            "worker_replicas",
            "startup_delay_steps",
        ],
        "replicas are synchronous, set with --devices and --nodes",
        report,
    );
    t.ignore(
        &[
            "batch_queue_capacity",
            "num_batch_queue_threads",
            "prefetch_queue_capacity",
            "max_number_of_boxes",
            "unpad_groundtruth_tensors",
            "retain_original_images",
        ],
        "the loader is set with data.workers and data.prefetch",
        report,
    );
    t.ignore(
        &["keep_checkpoint_every_n_hours"],
        "train.keep_checkpoints sets how many are kept",
        report,
    );
    t.finish(report);
    Some(TrainSettings {
        batch_size,
        num_steps,
        optimizer: optimizer?,
        moving_average_decay,
        moving_average_warmup: false,
        gradient_clipping_by_norm: (clip > 0.0).then_some(clip),
        fine_tune_checkpoint,
        fine_tune_restore,
        seed: 0,
        checkpoint_every: 1000,
        keep_checkpoints: 5,
        log_every: 20,
    })
}

fn read_augmentation(step: &mut Section, report: &mut Report) -> Option<Augmentation> {
    let kinds = [
        "random_horizontal_flip",
        "ssd_random_crop",
        "random_adjust_brightness",
        "random_adjust_contrast",
        "random_adjust_saturation",
        "random_pad_image",
    ];
    let (kind, mut a) = step.one_of(&kinds, report)?;
    let out = match kind.as_str() {
        "random_horizontal_flip" => Augmentation::RandomHorizontalFlip,
        "ssd_random_crop" => {
            let mut operations = Vec::new();
            for mut op in a.children("operations", report) {
                operations.push(CropOperation {
                    min_object_covered: op.number("min_object_covered", 0.0, report),
                    aspect_ratio_range: [
                        op.number("min_aspect_ratio", 0.0, report),
                        op.number("max_aspect_ratio", 0.0, report),
                    ],
                    area_range: [
                        op.number("min_area", 0.0, report),
                        op.number("max_area", 0.0, report),
                    ],
                    overlap_thresh: op.number("overlap_thresh", 0.0, report),
                    clip_boxes: op.flag("clip_boxes", true, report),
                    random_coef: op.number("random_coef", 0.0, report),
                });
                op.finish(report);
            }
            Augmentation::SsdRandomCrop { operations }
        }
        "random_adjust_brightness" => Augmentation::RandomAdjustBrightness {
            max_delta: a.number("max_delta", 0.2, report),
        },
        "random_adjust_contrast" => Augmentation::RandomAdjustContrast {
            min_delta: a.number("min_delta", 0.8, report),
            max_delta: a.number("max_delta", 1.25, report),
        },
        "random_adjust_saturation" => Augmentation::RandomAdjustSaturation {
            min_delta: a.number("min_delta", 0.8, report),
            max_delta: a.number("max_delta", 1.25, report),
        },
        // the API's defaults: a canvas up to twice the image size, its mean colour
        _ => Augmentation::RandomPadImage { max_scale: 2.0 },
    };
    a.finish(report);
    Some(out)
}

/// `(input paths, label map path)` of an input reader.
fn read_input(mut r: Section, report: &mut Report) -> (Vec<String>, Option<String>) {
    let mut paths = Vec::new();
    if let Some((_, mut t)) = r.one_of(&["tf_record_input_reader"], report) {
        for f in t.take("input_path") {
            match &f.value {
                Value::Scalar(Scalar::Str(p)) => paths.push(p.clone()),
                _ => report
                    .errors
                    .push(format!("{}: expected a quoted path", t.at(f))),
            }
        }
        t.finish(report);
    }
    for p in &paths {
        if p.contains("PATH_TO_BE_CONFIGURED") {
            report
                .notes
                .push(format!("{}: {p} still has to be filled in", r.path));
        }
    }
    let label_map = Some(r.word("label_map_path", "", report)).filter(|p| !p.is_empty());
    r.ignore(
        &[
            "shuffle",
            "num_readers",
            "num_epochs",
            "queue_capacity",
            "min_after_dequeue",
            "read_block_length",
            "prefetch_size",
            "num_parallel_map_calls",
            "num_parallel_batches",
            "num_prefetch_batches",
            "filenames_shuffle_buffer_size",
            "shuffle_buffer_size",
            "sample_1_of_n_examples",
            "max_number_of_boxes",
            "num_additional_channels",
            "load_instance_masks",
            "mask_type",
            "use_display_name",
        ],
        "the loader shuffles every epoch with train.seed and reads with data.workers threads",
        report,
    );
    r.finish(report);
    (paths, label_map)
}
