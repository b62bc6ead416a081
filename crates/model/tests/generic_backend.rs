//! The whole network on the generic operations (burn-ndarray takes every default: the code
//! CUDA and wgpu run) against the CPU kernels (burn-flex), from the same weights: the training
//! loss with hard example mining, every parameter's gradient, and the inference-mode
//! detections.

use std::path::Path;

use burn::backend::{Autodiff, Flex, NdArray};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use model::loss::compute_loss;
use model::ops::SsdBackend;
use model::ssd::anchors;
use model::targets::{GroundTruth, assign_targets};
use model::weights::{weights_from_bytes, weights_to_bytes};
use model::{BBox, Detector, SsdConfig};

fn config() -> SsdConfig {
    SsdConfig {
        num_classes: 3,
        image_size: [96, 80],
        depth_multiplier: 0.25,
        ..Default::default()
    }
}

fn images() -> (Vec<f32>, [usize; 4]) {
    let shape = [2, 3, 96, 80];
    let n: usize = shape.iter().product();
    let pixels = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    (pixels, shape)
}

fn ground_truth() -> Vec<Vec<GroundTruth>> {
    vec![
        vec![
            GroundTruth {
                bbox: BBox::new(0.1, 0.1, 0.6, 0.5),
                class_id: 1,
            },
            GroundTruth {
                bbox: BBox::new(0.5, 0.6, 0.95, 0.9),
                class_id: 3,
            },
        ],
        vec![GroundTruth {
            bbox: BBox::new(0.2, 0.3, 0.9, 0.9),
            class_id: 2,
        }],
    ]
}

/// Every parameter's gradient in module order.
struct Collect<'a> {
    grads: &'a GradientsParams,
    found: Vec<Vec<f32>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            self.found
                .push(g.into_data().convert::<f32>().to_vec().unwrap());
        }
    }
}

/// The loss parts, every gradient in module order, and the detections after loading
/// `weights` on backend `B`.
fn run<B: SsdBackend>(weights: &[u8]) -> Run {
    let config = config();
    let device = Default::default();
    let net = weights_from_bytes::<Autodiff<B>>(&config, weights.to_vec(), Path::new("w"), &device)
        .unwrap();
    let anchors = anchors(&config);
    let targets: Vec<_> = ground_truth()
        .iter()
        .map(|gt| assign_targets(&config.matcher, &config.box_coder(), &anchors, gt))
        .collect();
    let (pixels, shape) = images();
    let input = Tensor::from_data(TensorData::new(pixels.clone(), shape), &device);
    let loss = compute_loss(&net, &config, &anchors, input, &targets);
    let parts = [&loss.classification, &loss.localization, &loss.total]
        .map(|t| {
            t.clone()
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .unwrap()[0]
        })
        .to_vec();
    assert!(loss.num_mined_negatives > 0, "the miner ran");
    let grads = loss.gradients(&net);
    let mut collected = Collect {
        grads: &grads,
        found: Vec::new(),
    };
    net.visit(&mut collected);
    let detector = Detector::new(config, net.valid(), &device).unwrap();
    let input = Tensor::from_data(TensorData::new(pixels, shape), &device);
    let detections = detector
        .detect_tensor(input)
        .unwrap()
        .into_iter()
        .map(|image| {
            image
                .iter()
                .take(20)
                .flat_map(|d| {
                    let b = d.bbox;
                    [
                        d.class_index as f32,
                        d.score,
                        b.ymin,
                        b.xmin,
                        b.ymax,
                        b.xmax,
                    ]
                })
                .collect()
        })
        .collect();
    (parts, collected.found, detections)
}

/// The largest differences between two runs, each relative to the largest magnitude of the
/// tensor it is in: the loss parts, the worst parameter gradient, the detections.
#[derive(Debug)]
struct Differences {
    loss: f32,
    gradients: f32,
    detections: f32,
}

impl Differences {
    fn between(
        (loss, grads, detections): &Run,
        (want_loss, want_grads, want_detections): &Run,
    ) -> Self {
        // every parameter (conv filters, head biases, BatchNorm scales and offsets) has one
        assert_eq!(grads.len(), want_grads.len());
        assert!(grads.len() > 100, "{} gradients", grads.len());
        assert_eq!(detections.len(), want_detections.len());
        let worst = |a: &[Vec<f32>], b: &[Vec<f32>]| {
            a.iter()
                .zip(b)
                .map(|(g, w)| relative_diff(g, w))
                .fold(0.0, f32::max)
        };
        Differences {
            loss: relative_diff(loss, want_loss),
            gradients: worst(grads, want_grads),
            detections: worst(detections, want_detections),
        }
    }
}

/// The largest difference between `got` and `want`, relative to `want`'s largest magnitude.
fn relative_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / scale)
        .fold(0.0, f32::max)
}

type Run = (Vec<f32>, Vec<Vec<f32>>, Vec<Vec<f32>>);

/// `run` agrees with the kernels' `want`: the loss and detections to 1e-4, the gradients to
/// 5e-3 (through 30 BatchNorms over small maps, rounding differences of 1e-7 reach 1e-3 of
/// the largest gradient; each operation alone agrees to 1e-4: `ops::generic_tests`).
fn compare_with(on: &str, run: &Run, want: &Run) {
    let d = Differences::between(run, want);
    eprintln!("{on} against the CPU kernels: {d:?}");
    eprintln!("{on}: loss parts {:?} against {:?}", run.0, want.0);
    assert!(
        d.loss <= 1e-4 && d.detections <= 1e-4 && d.gradients <= 5e-3,
        "{on}: {d:?}"
    );
}

#[test]
fn the_generic_operations_give_the_kernels_loss_gradients_and_detections() {
    let weights = weights_to_bytes(&config().init::<Flex>(7, &Default::default()).unwrap());
    let want = run::<Flex>(&weights);
    compare_with("burn-ndarray", &run::<NdArray>(&weights), &want);
    #[cfg(feature = "wgpu")]
    if std::env::var("WGPU_TESTS_REQUIRED").is_ok_and(|v| v == "1") {
        let fused = run::<burn::backend::Wgpu>(&weights);
        compare_with("wgpu", &fused, &want);
        let unfused = run::<model::ops::WgpuUnfused>(&weights);
        compare_with("wgpu without fusion", &unfused, &want);
        // fusion changes results by rounding at most: far less than backends differ by
        let d = Differences::between(&fused, &unfused);
        eprintln!("wgpu, fusion on against off: {d:?}");
        assert!(
            d.loss <= 1e-5 && d.detections <= 1e-5 && d.gradients <= 1e-4,
            "{d:?}"
        );
    }
}
