//! Shapes, parameter counts, weights round trip and bad input of the network and detector.

use burn::backend::Flex;
use burn::module::Module;
use burn::tensor::{Tensor, TensorData};
use image::DynamicImage;
use model::ssd::{anchors, feature_map_shapes};
use model::weights::{load_weights, save_weights};
use model::{Detector, ModelError, SsdConfig};

type B = Flex;

fn small(num_classes: usize, image_size: [usize; 2]) -> SsdConfig {
    SsdConfig {
        num_classes,
        image_size,
        depth_multiplier: 0.25,
        ..Default::default()
    }
}

#[test]
fn default_network_shapes_at_300() {
    let config = SsdConfig::default();
    let device = Default::default();
    let net = config.init::<B>(1, &device).unwrap();
    let x = Tensor::<B, 4>::zeros([1, 3, 300, 300], &device);
    let maps = net.feature_maps(x.clone());
    let dims: Vec<[usize; 4]> = maps.iter().map(|m| m.dims()).collect();
    assert_eq!(
        dims,
        vec![
            [1, 512, 19, 19],
            [1, 1024, 10, 10],
            [1, 512, 5, 5],
            [1, 256, 3, 3],
            [1, 256, 2, 2],
            [1, 128, 1, 1]
        ]
    );
    assert_eq!(
        feature_map_shapes(&config),
        vec![(19, 19), (10, 10), (5, 5), (3, 3), (2, 2), (1, 1)]
    );
    let p = net.forward(x);
    assert_eq!(p.box_encodings.dims(), [1, 1917, 4]);
    assert_eq!(p.class_logits.dims(), [1, 1917, 38]);
}

#[test]
fn another_input_size_and_multiplier() {
    let config = small(2, [240, 320]);
    let device = Default::default();
    let net = config.init::<B>(1, &device).unwrap();
    let maps = net.feature_maps(Tensor::<B, 4>::zeros([2, 3, 240, 320], &device));
    let shapes: Vec<(usize, usize)> = maps.iter().map(|m| (m.dims()[2], m.dims()[3])).collect();
    assert_eq!(shapes, feature_map_shapes(&config));
    assert_eq!(
        shapes,
        vec![(15, 20), (8, 10), (4, 5), (2, 3), (1, 2), (1, 1)]
    );
    // depths: max(int(d * 0.25), 16)
    let depths: Vec<usize> = maps.iter().map(|m| m.dims()[1]).collect();
    assert_eq!(depths, vec![128, 256, 128, 64, 64, 32]);
    let p = net.forward(Tensor::<B, 4>::zeros([2, 3, 240, 320], &device));
    let n = anchors(&config).len();
    assert_eq!(n, 15 * 20 * 3 + (80 + 20 + 6 + 2 + 1) * 6);
    assert_eq!(p.box_encodings.dims(), [2, n, 4]);
    assert_eq!(p.class_logits.dims(), [2, n, 3]);
}

/// Trainable parameters as TF counts them: conv kernels without bias plus BatchNorm gamma and
/// beta, and predictor kernels with bias. Worked out layer by layer from the definition:
/// backbone 3,206,976, extra layers 2,223,488, predictor 614,250 (37 classes). The 12,672
/// BatchNorm channels each add a moving mean and variance, which Burn's `num_params` counts.
#[test]
fn parameter_count_matches_the_tf_model() {
    let device = Default::default();
    let count = |num_classes| {
        let config = SsdConfig {
            num_classes,
            ..Default::default()
        };
        let net = config.init::<B>(0, &device).unwrap();
        assert_eq!(net.num_params(), net.num_trainable_params() + 2 * 12_672);
        net.num_trainable_params()
    };
    assert_eq!(count(37), 6_044_714);
    assert_eq!(count(2), 5_532_839);
    assert_eq!(count(90), 6_819_839);
}

#[test]
fn l2_term_is_half_the_sum_of_squared_kernels() {
    let config = small(2, [64, 64]);
    let device = Default::default();
    let net = config.init::<B>(3, &device).unwrap();
    let got: f32 = net.l2_half_sum_of_squares().into_scalar();
    let mut expect = 0.0f64;
    let w = |t: Tensor<B, 4>| {
        t.into_data()
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| (*v as f64).powi(2))
            .sum::<f64>()
    };
    expect += w(net.backbone.conv0.conv.weight.val());
    for b in &net.backbone.blocks {
        expect += w(b.depthwise.conv.weight.val()) + w(b.pointwise.conv.weight.val());
    }
    for e in &net.extras {
        expect += w(e.reduce.conv.weight.val()) + w(e.expand.conv.weight.val());
    }
    for h in net.box_heads.iter().chain(&net.class_heads) {
        expect += w(h.weight.val());
    }
    assert!(
        ((got as f64) - expect / 2.0).abs() / (expect / 2.0) < 1e-4,
        "{got} vs {}",
        expect / 2.0
    );
}

#[test]
fn same_seed_same_weights() {
    let config = small(2, [64, 64]);
    let device = Default::default();
    let a = config.init::<B>(5, &device).unwrap();
    let b = config.init::<B>(5, &device).unwrap();
    let c = config.init::<B>(6, &device).unwrap();
    let first = |n: &model::Ssd<B>| n.backbone.conv0.conv.weight.val().into_data();
    assert_eq!(first(&a), first(&b));
    assert_ne!(first(&a), first(&c));
}

#[test]
fn weights_round_trip_exactly() {
    let config = small(3, [64, 64]);
    let device = Default::default();
    let net = config.init::<B>(9, &device).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.mpk");
    save_weights(&net, &path).unwrap();
    let back: model::Ssd<B> = load_weights(&config, &path, &device).unwrap();
    let x = Tensor::<B, 4>::from_data(
        TensorData::new(
            (0..3 * 64 * 64)
                .map(|i| ((i % 17) as f32 / 8.0) - 1.0)
                .collect::<Vec<_>>(),
            [1, 3, 64, 64],
        ),
        &device,
    );
    let (p, q) = (net.forward(x.clone()), back.forward(x));
    assert_eq!(p.class_logits.into_data(), q.class_logits.into_data());
    assert_eq!(p.box_encodings.into_data(), q.box_encodings.into_data());
    // no temporary file is left behind
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn weights_for_another_config_are_a_clear_error() {
    let device = Default::default();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.mpk");
    save_weights(&small(2, [64, 64]).init::<B>(0, &device).unwrap(), &path).unwrap();
    let err = load_weights::<B>(&small(5, [64, 64]), &path, &device).unwrap_err();
    assert!(
        matches!(err, ModelError::IncompatibleWeights { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("class_heads"), "{err}");
    let other_depth = SsdConfig {
        depth_multiplier: 0.5,
        ..small(2, [64, 64])
    };
    assert!(matches!(
        load_weights::<B>(&other_depth, &path, &device),
        Err(ModelError::IncompatibleWeights { .. })
    ));
    std::fs::write(&path, b"not weights").unwrap();
    let err = load_weights::<B>(&small(2, [64, 64]), &path, &device).unwrap_err();
    assert!(err.to_string().contains("w.mpk"), "{err}");
    let missing =
        load_weights::<B>(&small(2, [64, 64]), &dir.path().join("none"), &device).unwrap_err();
    assert!(matches!(missing, ModelError::Io { .. }));
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let device = Default::default();
    assert!(
        SsdConfig {
            num_classes: 0,
            ..Default::default()
        }
        .init::<B>(0, &device)
        .is_err()
    );
    assert!(
        SsdConfig {
            depth_multiplier: 0.0,
            ..Default::default()
        }
        .init::<B>(0, &device)
        .is_err()
    );
    let config = small(2, [64, 64]);
    let det = Detector::new(
        config.clone(),
        config.init::<B>(0, &device).unwrap(),
        &device,
    )
    .unwrap();
    assert!(matches!(
        det.detect(&DynamicImage::new_rgb8(0, 0)),
        Err(ModelError::InvalidImage(_))
    ));
    assert!(matches!(
        det.detect(&DynamicImage::new_rgb8(10, 0)),
        Err(ModelError::InvalidImage(_))
    ));
    let gray = Tensor::<B, 4>::zeros([1, 1, 64, 64], &device);
    assert!(matches!(
        det.detect_tensor(gray),
        Err(ModelError::InvalidImage(_))
    ));
    let wrong_size = Tensor::<B, 4>::zeros([1, 3, 32, 64], &device);
    assert!(det.detect_tensor(wrong_size).is_err());
    // any colour type is converted: grayscale, RGBA and 16-bit images work
    for img in [
        DynamicImage::new_luma8(50, 40),
        DynamicImage::new_rgba8(50, 40),
        DynamicImage::new_rgb16(5, 7),
    ] {
        let dets = det.detect(&img).unwrap();
        assert!(dets.len() <= 100);
        assert!(
            dets.iter()
                .all(|d| d.pixel_bbox.xmax <= img.width() as f32 + 1e-3)
        );
    }
    // a network built for another class count does not fit the config
    let other = small(3, [64, 64]).init::<B>(0, &device).unwrap();
    assert!(Detector::new(config, other, &device).is_err());
}
