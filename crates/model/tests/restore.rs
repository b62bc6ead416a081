//! Fine-tune restore rules on weights in memory: which tensors each scope takes, what is
//! skipped and reported, and checkpoints of another network refused.

use burn::backend::Flex;
use model::restore::{MemorySource, RestoreScope, restore, restore_exact};
use model::tf::names::named_tensors;
use model::{ModelError, SsdConfig};
use std::path::Path;

type B = Flex;

fn config(num_classes: usize) -> SsdConfig {
    SsdConfig {
        num_classes,
        image_size: [64, 64],
        depth_multiplier: 0.25,
        ..Default::default()
    }
}

/// The named tensors of a network of `num_classes` initialised from `seed`.
fn tensors(num_classes: usize, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let c = config(num_classes);
    named_tensors(&c.init::<B>(seed, &Default::default()).unwrap(), &c)
}

fn value<'a>(t: &'a [(String, Vec<usize>, Vec<f32>)], name: &str) -> &'a [f32] {
    &t.iter().find(|(n, _, _)| n == name).unwrap().2
}

const CONV0: &str = "FeatureExtractor/MobilenetV1/Conv2d_0/weights";
const EXTRA: &str = "FeatureExtractor/MobilenetV1/Conv2d_13_pointwise_1_Conv2d_2_1x1_64/weights";
const BOX: &str = "BoxPredictor_0/BoxEncodingPredictor/weights";
const CLASS: &str = "BoxPredictor_0/ClassPredictor/weights";

#[test]
fn all_scope_skips_a_class_predictor_made_for_other_classes() {
    let source = MemorySource::new(Path::new("coco"), tensors(37, 1));
    let target = config(2);
    let fresh = tensors(2, 9);
    let net = target.init::<B>(9, &Default::default()).unwrap();
    let (net, report) = restore(net, &target, &source, RestoreScope::All).unwrap();
    let got = named_tensors(&net, &target);
    let theirs = tensors(37, 1);
    for name in [CONV0, EXTRA, BOX] {
        assert_eq!(value(&got, name), value(&theirs, name), "{name}");
    }
    assert_eq!(
        value(&got, CLASS),
        value(&fresh, CLASS),
        "the class predictor keeps its init"
    );
    // 27 + 8 units of 5 tensors, 6 box predictors of 2: all but the 12 class predictor tensors
    assert_eq!(report.restored.len(), 35 * 5 + 12);
    let skipped = &report.skipped["shape differs from this model's"];
    assert_eq!(skipped.len(), 12, "{skipped:?}");
    assert!(skipped[0].contains("ClassPredictor"), "{skipped:?}");
    // they are in the checkpoint, with another shape: skipped, not missing
    assert!(report.missing.is_empty(), "{:?}", report.missing);
    let summary = report.summary(Path::new("coco")).join("\n");
    assert!(
        summary.contains("restored 187 tensors from coco"),
        "{summary}"
    );
    assert!(summary.contains("skipped 12 (shape differs"), "{summary}");
}

#[test]
fn feature_extractor_scope_leaves_the_predictor() {
    let source = MemorySource::new(Path::new("ckpt"), tensors(2, 1));
    let target = config(2);
    let net = target.init::<B>(9, &Default::default()).unwrap();
    let (net, report) = restore(net, &target, &source, RestoreScope::FeatureExtractor).unwrap();
    let got = named_tensors(&net, &target);
    assert_eq!(value(&got, EXTRA), value(&tensors(2, 1), EXTRA));
    assert_eq!(value(&got, BOX), value(&tensors(2, 9), BOX));
    assert_eq!(report.restored.len(), 35 * 5);
    assert_eq!(
        report.skipped["outside the restore scope `feature_extractor`"].len(),
        24
    );
}

#[test]
fn classification_scope_reads_slim_names_and_ignores_the_rest() {
    // a slim classification checkpoint: `MobilenetV1/...`, a classifier, a step counter,
    // moving-average shadows and optimizer slots
    let mut slim: Vec<(String, Vec<usize>, Vec<f32>)> = tensors(2, 1)
        .into_iter()
        .filter(|(n, _, _)| {
            n.starts_with("FeatureExtractor/")
                && !n.contains("pointwise_1_")
                && !n.contains("pointwise_2_")
        })
        .map(|(n, s, v)| (n.trim_start_matches("FeatureExtractor/").to_string(), s, v))
        .collect();
    assert_eq!(slim.len(), 27 * 5);
    for extra in [
        "MobilenetV1/Logits/Conv2d_1c_1x1/weights",
        "global_step",
        "MobilenetV1/Conv2d_0/weights/ExponentialMovingAverage",
        "MobilenetV1/Conv2d_0/weights/RMSProp",
    ] {
        slim.push((extra.to_string(), vec![1], vec![0.5]));
    }
    let source = MemorySource::new(Path::new("slim"), slim);
    let target = config(2);
    let net = target.init::<B>(9, &Default::default()).unwrap();
    let (net, report) = restore(net, &target, &source, RestoreScope::Classification).unwrap();
    let got = named_tensors(&net, &target);
    assert_eq!(value(&got, CONV0), value(&tensors(2, 1), CONV0));
    assert_eq!(
        value(&got, EXTRA),
        value(&tensors(2, 9), EXTRA),
        "extra layers are not in a classification checkpoint"
    );
    assert_eq!(report.restored.len(), 27 * 5);
    assert!(report.missing.is_empty(), "{:?}", report.missing);
    let reasons: Vec<&str> = report.skipped.keys().map(String::as_str).collect();
    assert_eq!(
        reasons,
        [
            "moving-average shadows: not restored when fine-tuning",
            "not part of this network",
            "optimizer slots: not restored when fine-tuning",
            "step counter: training starts at step 0",
        ]
    );
}

#[test]
fn a_checkpoint_of_another_network_is_refused() {
    let other = vec![(
        "FeatureExtractor/MobilenetV2/Conv/weights".to_string(),
        vec![3],
        vec![0.0; 3],
    )];
    let target = config(2);
    let net = target.init::<B>(9, &Default::default()).unwrap();
    let err = restore(
        net,
        &target,
        &MemorySource::new(Path::new("v2"), other),
        RestoreScope::All,
    )
    .unwrap_err();
    assert!(
        matches!(err, ModelError::IncompatibleWeights { .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("MobilenetV2/Conv/weights"),
        "{err}"
    );
    // another depth multiplier: every backbone tensor has another shape
    let wide = SsdConfig {
        depth_multiplier: 1.0,
        ..config(2)
    };
    let wide_tensors = named_tensors(&wide.init::<B>(0, &Default::default()).unwrap(), &wide);
    let net = target.init::<B>(9, &Default::default()).unwrap();
    let err = restore(
        net,
        &target,
        &MemorySource::new(Path::new("wide"), wide_tensors),
        RestoreScope::All,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("other shapes (another depth multiplier?)"),
        "{err}"
    );
}

#[test]
fn an_exact_restore_names_the_first_missing_tensor() {
    let mut partial = tensors(2, 1);
    partial.retain(|(n, _, _)| !n.starts_with("BoxPredictor_5"));
    let target = config(2);
    let net = target.init::<B>(9, &Default::default()).unwrap();
    let err = restore_exact(net, &target, &MemorySource::new(Path::new("p"), partial)).unwrap_err();
    assert!(
        err.to_string()
            .contains("no tensor named BoxPredictor_5/BoxEncodingPredictor/weights"),
        "{err}"
    );
}

#[test]
fn a_value_that_is_not_finite_is_refused_naming_the_file_tensor_and_element() {
    let target = config(2);
    for bad in [f32::NAN, f32::INFINITY] {
        let mut theirs = tensors(2, 1);
        let conv0 = theirs.iter_mut().find(|(n, _, _)| n == CONV0).unwrap();
        conv0.2[5] = bad;
        let source = MemorySource::new(Path::new("bad.ckpt"), theirs);
        let net = target.init::<B>(9, &Default::default()).unwrap();
        let err = restore(net, &target, &source, RestoreScope::All).unwrap_err();
        let ModelError::NonFinite {
            path,
            tensor,
            index,
            value,
        } = &err
        else {
            panic!("{err}")
        };
        assert_eq!(
            (path.as_path(), tensor.as_str(), *index),
            (Path::new("bad.ckpt"), CONV0, 5)
        );
        assert_eq!(value.to_bits(), bad.to_bits());
        assert!(
            err.to_string().contains("weights file bad.ckpt: tensor `"),
            "{err}"
        );
    }
}

#[test]
fn half_precision_safetensors_restore_as_their_f32_values() {
    use safetensors::tensor::{Dtype, TensorView};
    let target = config(2);
    let theirs = tensors(2, 1);
    let dir = tempfile::tempdir().unwrap();
    // the file's dtype, its encoding of a value, and the value it then holds
    type Encoding = (Dtype, fn(f32) -> [u8; 2], fn(f32) -> f32);
    let encodings: [Encoding; 2] = [
        (
            Dtype::F16,
            |v| half::f16::from_f32(v).to_le_bytes(),
            |v| half::f16::from_f32(v).to_f32(),
        ),
        (
            Dtype::BF16,
            |v| half::bf16::from_f32(v).to_le_bytes(),
            |v| half::bf16::from_f32(v).to_f32(),
        ),
    ];
    for (dtype, encode, rounded) in encodings {
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = theirs
            .iter()
            .map(|(n, s, v)| {
                (
                    n.clone(),
                    s.clone(),
                    v.iter().flat_map(|x| encode(*x)).collect(),
                )
            })
            .collect();
        let views = bytes
            .iter()
            .map(|(n, s, b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap()));
        let file = dir.path().join(format!("{dtype:?}.safetensors"));
        std::fs::write(&file, safetensors::serialize(views, None).unwrap()).unwrap();
        let source = model::restore::SafetensorsSource::open(&file).unwrap();
        let net = target.init::<B>(9, &Default::default()).unwrap();
        let net = restore_exact(net, &target, &source).unwrap();
        let got = named_tensors(&net, &target);
        for name in [CONV0, EXTRA, CLASS] {
            let want: Vec<f32> = value(&theirs, name).iter().map(|v| rounded(*v)).collect();
            assert_eq!(value(&got, name), want, "{dtype:?} {name}");
        }
    }
}
