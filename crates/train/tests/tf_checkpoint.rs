//! TensorFlow checkpoints against real TensorFlow: a TF-written SSD-MobileNet-v1 training
//! checkpoint (`crates/model/tests/fixtures/tf`, made by `scripts/tf-fixtures`, the API's own
//! code in TF 2.21) restores completely, and our preprocessing, raw predictions and detections
//! equal TF's for its images, with the raw and the moving-average weights; the API's restore
//! rules for fine-tuning, from the imported pipeline.config.

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::tensor::{Tensor, TensorData};
use model::inference::postprocess;
use model::preprocess::image_to_input;
use model::restore::{RestoreScope, TfCheckpointSource, restore};
use model::ssd::anchors;
use model::tf::bundle::Checkpoint;
use model::tf::names::named_tensors;
use model::{Ssd, SsdConfig};
use safetensors::SafeTensors;
use train::config::TrainConfig;
use train::trained::{TrainedModel, Weights, fine_tune};

type B = Flex;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn tf_fixture(path: &str) -> PathBuf {
    root().join("crates/model/tests/fixtures/tf").join(path)
}

/// The fixture's pipeline.config (the pets config at depth 0.125, 150x120), imported.
fn fixture_config() -> TrainConfig {
    TrainConfig::load(&root().join("scripts/tf-fixtures/pipeline.config")).unwrap()
}

struct Outputs(Vec<u8>);

impl Outputs {
    fn load() -> Self {
        Self(std::fs::read(tf_fixture("ssd/outputs.safetensors")).unwrap())
    }

    fn get(&self, name: &str) -> Vec<f32> {
        let file = SafeTensors::deserialize(&self.0).unwrap();
        let view = file.tensor(name).unwrap();
        view.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The fixture image as our preprocessing makes it, CHW.
fn input(config: &SsdConfig, i: usize) -> Vec<f32> {
    let image = image::open(tf_fixture(&format!("ssd/image_{i}.png"))).unwrap();
    let [h, w] = config.image_size;
    let mut out = Vec::new();
    image_to_input(&image, h, w, &mut out).unwrap();
    out
}

/// HWC (TF) to CHW.
fn to_chw(hwc: &[f32], h: usize, w: usize) -> Vec<f32> {
    let mut out = vec![0.0; hwc.len()];
    for (p, px) in hwc.chunks_exact(3).enumerate() {
        for c in 0..3 {
            out[c * h * w + p] = px[c];
        }
    }
    out
}

#[test]
fn preprocessing_and_anchors_equal_tf() {
    let config = fixture_config().model;
    let tf = Outputs::load();
    let [h, w] = config.image_size;
    for i in 0..3 {
        let ours = input(&config, i);
        let theirs = to_chw(&tf.get(&format!("image_{i}/preprocessed")), h, w);
        let d = max_abs_diff(&ours, &theirs);
        assert!(d < 1e-6, "image {i}: preprocessed inputs differ by {d}");
    }
    let ours: Vec<f32> = anchors(&config)
        .iter()
        .flat_map(|b| [b.ymin, b.xmin, b.ymax, b.xmax])
        .collect();
    let d = max_abs_diff(&ours, &tf.get("anchors"));
    assert!(d < 1e-6, "anchors differ by {d}");
}

fn load(config: &SsdConfig, weights: Weights) -> Ssd<B> {
    let trained = TrainedModel::locate(
        &tf_fixture("ssd/model.ckpt"),
        Some(config.clone()),
        Some(weights),
    )
    .unwrap();
    trained.load::<B>(&Default::default()).unwrap()
}

fn check_against_tf(weights: Weights, tag: &str) {
    let config = fixture_config().model;
    let net = load(&config, weights);
    let tf = Outputs::load();
    let [h, w] = config.image_size;
    let anchors = anchors(&config);
    for i in 0..3 {
        let x = Tensor::<B, 4>::from_data(
            TensorData::new(input(&config, i), [1, 3, h, w]),
            &Default::default(),
        );
        let p = net.forward(x);
        let codes: Vec<f32> = p.box_encodings.clone().into_data().to_vec().unwrap();
        let logits: Vec<f32> = p.class_logits.clone().into_data().to_vec().unwrap();
        let dc = max_abs_diff(&codes, &tf.get(&format!("{tag}/image_{i}/box_encodings")));
        let dl = max_abs_diff(
            &logits,
            &tf.get(&format!(
                "{tag}/image_{i}/class_predictions_with_background"
            )),
        );
        assert!(
            dc < 1e-5 && dl < 1e-5,
            "{tag} image {i}: box codes differ by {dc}, logits by {dl}"
        );

        let ours = &postprocess(&config, &anchors, &p)[0];
        let n = tf.get(&format!("{tag}/image_{i}/num_detections"))[0] as usize;
        let boxes = tf.get(&format!("{tag}/image_{i}/detection_boxes"));
        let scores = tf.get(&format!("{tag}/image_{i}/detection_scores"));
        let classes = tf.get(&format!("{tag}/image_{i}/detection_classes"));
        assert_eq!(ours.len(), n, "{tag} image {i}: detection count");
        for (k, d) in ours.iter().enumerate() {
            let b = [d.bbox.ymin, d.bbox.xmin, d.bbox.ymax, d.bbox.xmax];
            let db = max_abs_diff(&b, &boxes[4 * k..4 * k + 4]);
            assert_eq!(
                d.class_index, classes[k] as usize,
                "{tag} image {i} detection {k}: class"
            );
            assert!(
                (d.score - scores[k]).abs() < 1e-6,
                "{tag} image {i} detection {k}: score {} vs {}",
                d.score,
                scores[k]
            );
            assert!(
                db < 1e-6,
                "{tag} image {i} detection {k}: box differs by {db}"
            );
        }
    }
}

#[test]
fn raw_weights_predict_and_detect_as_tf() {
    check_against_tf(Weights::Raw, "raw");
}

#[test]
fn moving_average_weights_predict_and_detect_as_tf() {
    check_against_tf(Weights::MovingAverage, "ema");
}

/// Every variable of the TF checkpoint by name, in our layout.
fn checkpoint_tensor(name: &str) -> Vec<f32> {
    let source = TfCheckpointSource::open(&tf_fixture("ssd/model.ckpt"), false).unwrap();
    model::restore::TensorSource::values(&source, name).unwrap()
}

#[test]
fn every_tensor_of_the_tf_checkpoint_is_mapped() {
    let config = fixture_config().model;
    let ckpt = Checkpoint::open(&tf_fixture("ssd/model.ckpt")).unwrap();
    assert_eq!(ckpt.names().count(), 587);
    let net = config.init::<B>(0, &Default::default()).unwrap();
    let source = TfCheckpointSource::open(&tf_fixture("ssd/model.ckpt"), false).unwrap();
    let (net, report) = restore(net, &config, &source, RestoreScope::All).unwrap();
    // 129 trained variables and 70 BatchNorm moving statistics; nothing of the model missing
    assert_eq!(report.restored.len(), 199);
    assert!(report.missing.is_empty());
    let skipped: Vec<(&str, usize)> = report
        .skipped
        .iter()
        .map(|(r, n)| (r.as_str(), n.len()))
        .collect();
    assert_eq!(
        skipped,
        [
            ("moving-average shadows: not restored when fine-tuning", 129),
            ("optimizer slots: not restored when fine-tuning", 258),
            ("step counter: training starts at step 0", 1),
        ]
    );
    // the values are the checkpoint's (kernels transposed from HWIO)
    for (name, _, values) in named_tensors(&net, &config) {
        assert_eq!(values, checkpoint_tensor(&name), "{name}");
    }
    // with the moving averages, the shadows stand in for the trained values
    let shadows = TfCheckpointSource::open(&tf_fixture("ssd/model.ckpt"), true).unwrap();
    let fresh = config.init::<B>(0, &Default::default()).unwrap();
    let (_, report) = restore(fresh, &config, &shadows, RestoreScope::All).unwrap();
    assert_eq!(report.restored.len(), 199);
    let skipped: Vec<(&str, usize)> = report
        .skipped
        .iter()
        .map(|(r, n)| (r.as_str(), n.len()))
        .collect();
    assert_eq!(
        skipped,
        [
            ("optimizer slots: not restored when fine-tuning", 258),
            ("step counter: training starts at step 0", 1),
            ("trained values: their moving averages were read", 129),
        ]
    );
}

/// The fixture's pipeline.config with its fine-tune settings replaced by `settings` and
/// `num_classes` by `classes`, imported.
fn pipeline_with(settings: &str, classes: usize) -> TrainConfig {
    let text = std::fs::read_to_string(root().join("scripts/tf-fixtures/pipeline.config")).unwrap();
    let text = text
        .replace("from_detection_checkpoint: true", settings)
        .replace("num_classes: 37", &format!("num_classes: {classes}"));
    assert!(text.contains(settings));
    train::config::pipeline::import_text(&text).unwrap().config
}

fn fine_tuned(config: &TrainConfig) -> (Ssd<B>, model::restore::RestoreReport) {
    let c = &config.model;
    let source = config.train.fine_tune_checkpoint.as_ref().unwrap();
    let fresh = c.init::<B>(config.train.seed, &Default::default()).unwrap();
    fine_tune(
        fresh,
        c,
        source,
        config.train.fine_tune_restore,
        &Default::default(),
    )
    .unwrap()
}

#[test]
fn detection_fine_tune_from_37_to_2_classes_restores_all_but_the_class_predictor() {
    let ckpt = tf_fixture("ssd/model.ckpt");
    let settings = format!(
        "fine_tune_checkpoint: \"{}\" fine_tune_checkpoint_type: \"detection\" load_all_detection_checkpoint_vars: true",
        ckpt.display()
    );
    let config = pipeline_with(&settings, 2);
    assert_eq!(config.train.fine_tune_restore, RestoreScope::All);
    let (net, report) = fine_tuned(&config);
    // 6 class predictors' weights and biases are made for 37 classes
    assert_eq!(report.restored.len(), 199 - 12);
    let skipped = &report.skipped["shape differs from this model's"];
    assert_eq!(skipped.len(), 12);
    assert!(
        skipped
            .iter()
            .all(|s| s.starts_with("BoxPredictor_") && s.contains("/ClassPredictor/")),
        "{skipped:?}"
    );
    let summary = report.summary(&ckpt).join("\n");
    assert!(
        summary.contains("restored 187 tensors") && summary.contains("ClassPredictor"),
        "{summary}"
    );
    let fresh = config
        .model
        .init::<B>(config.train.seed, &Default::default())
        .unwrap();
    let fresh = named_tensors(&fresh, &config.model);
    for ((name, _, values), (_, _, initial)) in
        named_tensors(&net, &config.model).into_iter().zip(fresh)
    {
        if name.contains("ClassPredictor") {
            assert_eq!(values, initial, "{name} keeps its initialisation");
        } else {
            assert_eq!(values, checkpoint_tensor(&name), "{name}");
        }
    }
}

#[test]
fn detection_fine_tune_restores_the_feature_extractor_only() {
    let settings = format!(
        "fine_tune_checkpoint: \"{}\" from_detection_checkpoint: true",
        tf_fixture("ssd/model.ckpt").display()
    );
    let config = pipeline_with(&settings, 37);
    assert_eq!(
        config.train.fine_tune_restore,
        RestoreScope::FeatureExtractor
    );
    let (net, report) = fine_tuned(&config);
    // 35 units of 5 tensors: the backbone's 27 and the extra layers' 8
    assert_eq!(report.restored.len(), 175);
    assert_eq!(
        report.skipped["outside the restore scope `feature_extractor`"].len(),
        24
    );
    for (name, _, values) in named_tensors(&net, &config.model) {
        if name.starts_with("FeatureExtractor/") {
            assert_eq!(values, checkpoint_tensor(&name), "{name}");
        }
    }
}

#[test]
fn classification_fine_tune_restores_the_backbone_from_a_slim_checkpoint() {
    let slim = tf_fixture("slim/mobilenet_v1.ckpt");
    let settings = format!(
        "fine_tune_checkpoint: \"{}\" fine_tune_checkpoint_type: \"classification\"",
        slim.display()
    );
    let config = pipeline_with(&settings, 37);
    assert_eq!(config.train.fine_tune_restore, RestoreScope::Classification);
    let (net, report) = fine_tuned(&config);
    assert_eq!(report.restored.len(), 135);
    assert!(report.missing.is_empty());
    assert_eq!(
        report.skipped["not part of this network"],
        [
            "MobilenetV1/Logits/Conv2d_1c_1x1/biases",
            "MobilenetV1/Logits/Conv2d_1c_1x1/weights"
        ]
    );
    let source = TfCheckpointSource::open(&slim, false).unwrap();
    for (name, _, values) in named_tensors(&net, &config.model) {
        if name.starts_with("FeatureExtractor/MobilenetV1/")
            && !name.contains("pointwise_1_")
            && !name.contains("pointwise_2_")
        {
            let slim_name = name.trim_start_matches("FeatureExtractor/");
            assert_eq!(
                values,
                model::restore::TensorSource::values(&source, slim_name).unwrap(),
                "{name}"
            );
        }
    }
}

#[test]
fn a_missing_fine_tune_checkpoint_stops_the_run() {
    let config = pipeline_with(
        "fine_tune_checkpoint: \"/nowhere/model.ckpt\" from_detection_checkpoint: true",
        37,
    );
    let fresh = config.model.init::<B>(0, &Default::default()).unwrap();
    let err = fine_tune(
        fresh,
        &config.model,
        Path::new("/nowhere/model.ckpt"),
        config.train.fine_tune_restore,
        &Default::default(),
    )
    .unwrap_err();
    assert!(
        format!("{err:#}").contains("/nowhere/model.ckpt does not exist"),
        "{err:#}"
    );
}

/// `--config` with the API's pipeline.config, its paths filled in (a TF-written checkpoint,
/// TFRecords, a 37-class label map), trains from the checkpoint; the checkpoint it writes
/// carries the model config, so it loads without a config.
#[test]
fn a_pipeline_config_with_a_tf_checkpoint_trains_from_it() {
    let data_dir = tempfile::tempdir().unwrap();
    data::prepare::prepare_synthetic(data_dir.path(), 3, 4, 2, 1, &|_, _| {}).unwrap();
    let names: Vec<String> = (1..=37).map(|i| format!("breed_{i}")).collect();
    let label_map = data_dir.path().join("pet_label_map.pbtxt");
    std::fs::write(&label_map, data::LabelMap::from_names(&names).to_pbtxt()).unwrap();
    let text = std::fs::read_to_string(root().join("scripts/tf-fixtures/pipeline.config")).unwrap();
    let d = data_dir.path().display();
    let text = text
        .replace(
            "from_detection_checkpoint: true",
            &format!("fine_tune_checkpoint: \"{}\" from_detection_checkpoint: true load_all_detection_checkpoint_vars: true", tf_fixture("ssd/model.ckpt").display()),
        )
        .replace("batch_size: 24", "batch_size: 2")
        .replace("num_steps: 200000", "num_steps: 1")
        .replace("PATH_TO_BE_CONFIGURED/pet_train.record", &format!("{d}/train.record-*"))
        .replace("PATH_TO_BE_CONFIGURED/pet_val.record", &format!("{d}/val.record-*"))
        .replace("PATH_TO_BE_CONFIGURED/pet_label_map.pbtxt", &label_map.display().to_string());
    let pipeline = data_dir.path().join("pipeline.config");
    std::fs::write(&pipeline, text).unwrap();
    let config = TrainConfig::load(&pipeline).unwrap();
    assert_eq!(config.model.class_names[36], "breed_37");

    let runs = tempfile::tempdir().unwrap();
    let options = train::learner::RunOptions {
        model_dir: runs.path().to_path_buf(),
        stop: std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false)),
        verbose: false,
        nodes: None,
        repeat_first_batch: false,
        without_lock: false,
    };
    let summary = train::learner::train::<B>(&config, &[Default::default()], &options).unwrap();
    assert_eq!(summary.step, 1);
    // the run's own checkpoint loads without a config; one RMSProp step (learning rate
    // 0.004, epsilon 1) and one BatchNorm update (decay 0.9997) stay close to the TF values
    let trained = TrainedModel::locate(runs.path(), None, Some(Weights::Raw)).unwrap();
    assert_eq!(trained.config, config.model);
    let net = trained.load::<B>(&Default::default()).unwrap();
    for (name, _, values) in named_tensors(&net, &config.model) {
        let tf = checkpoint_tensor(&name);
        let tolerance = if name.contains("moving_") { 2e-3 } else { 2e-2 };
        let d = max_abs_diff(&values, &tf);
        assert!(d < tolerance, "{name}: {d} away from the TF checkpoint");
    }
}

/// Runs `train` with `args`; its success and its output.
fn run_train(args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn train_cli(args: &[&str]) -> String {
    let (success, text) = run_train(args);
    assert!(success, "train {args:?} failed:\n{text}");
    text
}

/// `export --quantize`: another width, another format, no calibration image and calibration
/// records that are not there are errors naming the flag, and nothing is written.
#[test]
fn quantized_export_errors_name_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = tf_fixture("ssd/model.ckpt").display().to_string();
    let pipeline = root().join("scripts/tf-fixtures/pipeline.config");
    let out = dir.path().join("model.tflite");
    let (pipeline, out_arg) = (pipeline.display().to_string(), out.display().to_string());
    let model = [
        "export",
        "--model-dir",
        &prefix,
        "--config",
        &pipeline,
        "--out",
        &out_arg,
    ];
    let cases: [(&[&str], &str); 4] = [
        (
            &["--format", "tflite", "--quantize", "int4"],
            "'int4' for '--quantize",
        ),
        (
            &["--format", "onnx", "--quantize", "int8"],
            "--quantize int8 needs --format tflite",
        ),
        (
            &[
                "--quantize",
                "int8",
                "--format",
                "tflite",
                "--calibration-images",
                "0",
            ],
            "'0' for '--calibration-images",
        ),
        // the pipeline.config's train input is a placeholder path
        (
            &["--format", "tflite", "--quantize", "int8"],
            "--calibration-data",
        ),
    ];
    for (flags, expected) in cases {
        let args: Vec<&str> = model.iter().chain(flags).copied().collect();
        let (success, text) = run_train(&args);
        assert!(!success && text.contains(expected), "{flags:?}:\n{text}");
        assert!(!out.exists(), "{flags:?} wrote {}", out.display());
    }
}

/// `train import-checkpoint` writes the moving-average weights; `detect` and `export` take
/// the file (or the TF checkpoint itself) without a separate config.
#[test]
fn import_checkpoint_then_detect_and_export() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = tf_fixture("ssd/model.ckpt");
    let pipeline = root().join("scripts/tf-fixtures/pipeline.config");
    let ema = dir.path().join("ema.safetensors");
    let s = |p: &Path| p.display().to_string();
    train_cli(&[
        "import-checkpoint",
        &s(&prefix),
        "--config",
        &s(&pipeline),
        "--out",
        &s(&ema),
        "--moving-average",
    ]);
    assert!(dir.path().join("ema.json").is_file());
    let trained = TrainedModel::locate(&ema, None, None).unwrap();
    assert_eq!(trained.config, fixture_config().model);
    let net = trained.load::<B>(&Default::default()).unwrap();
    let shadows = TfCheckpointSource::open(&prefix, true).unwrap();
    for (name, _, values) in named_tensors(&net, &trained.config) {
        assert_eq!(
            values,
            model::restore::TensorSource::values(&shadows, &name).unwrap(),
            "{name}"
        );
    }
    let raw = dir.path().join("raw.safetensors");
    let out = train_cli(&[
        "export",
        "--model-dir",
        &s(&prefix),
        "--config",
        &s(&pipeline),
        "--weights",
        "raw",
        "--out",
        &s(&raw),
    ]);
    assert!(out.contains("(raw weights)"), "{out}");
    let raw_net = TrainedModel::locate(&raw, None, None)
        .unwrap()
        .load::<B>(&Default::default())
        .unwrap();
    assert_eq!(
        named_tensors(&raw_net, &trained.config)[0].2,
        checkpoint_tensor("FeatureExtractor/MobilenetV1/Conv2d_0/weights")
    );

    let det = dir.path().join("det");
    let image = tf_fixture("ssd/image_0.png");
    let out = train_cli(&[
        "detect",
        "--model-dir",
        &s(&ema),
        "--out",
        &s(&det),
        "--score-threshold",
        "0.0",
        &s(&image),
    ]);
    assert!(out.contains("20 detections in 1 images"), "{out}");
    assert!(det.join("detections.json").is_file());
}
