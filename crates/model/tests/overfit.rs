//! A small model overfits one synthetic batch on the CPU: the loss falls by more than 90% and
//! the detector then finds the batch's objects. On the CPU kernels (burn-flex) and on the
//! generic operations the GPU backends run (burn-ndarray, which takes every default).

use burn::backend::{Autodiff, Flex, NdArray};
use burn::module::AutodiffModule;
use burn::optim::{AdamConfig, Optimizer};
use burn::tensor::{ElementConversion, Tensor, TensorData};
use model::config::BatchNormConfig;
use model::loss::compute_loss;
use model::ops::SsdBackend;
use model::ssd::anchors;
use model::targets::{GroundTruth, assign_targets};
use model::{BBox, Detector, SsdConfig};

const SIZE: usize = 96;

/// Two images: coloured rectangles (class 1 red, class 2 blue) on a grey background.
fn batch() -> (Vec<f32>, Vec<Vec<GroundTruth>>) {
    let objects = [
        vec![
            (BBox::new(0.1, 0.1, 0.6, 0.5), 1),
            (BBox::new(0.55, 0.6, 0.95, 0.95), 2),
        ],
        vec![(BBox::new(0.2, 0.3, 0.9, 0.9), 2)],
    ];
    let mut pixels = Vec::new();
    for objs in &objects {
        let mut img = vec![0.0f32; 3 * SIZE * SIZE];
        for y in 0..SIZE {
            for x in 0..SIZE {
                let (fy, fx) = (
                    (y as f32 + 0.5) / SIZE as f32,
                    (x as f32 + 0.5) / SIZE as f32,
                );
                let mut rgb = [0.0, 0.0, 0.0];
                for (b, class) in objs {
                    if fy >= b.ymin && fy <= b.ymax && fx >= b.xmin && fx <= b.xmax {
                        rgb = if *class == 1 {
                            [0.9, -0.8, -0.8]
                        } else {
                            [-0.8, -0.8, 0.9]
                        };
                    }
                }
                for c in 0..3 {
                    img[c * SIZE * SIZE + y * SIZE + x] = rgb[c];
                }
            }
        }
        pixels.extend(img);
    }
    let gt = objects
        .iter()
        .map(|objs| {
            objs.iter()
                .map(|&(bbox, class_id)| GroundTruth { bbox, class_id })
                .collect()
        })
        .collect();
    (pixels, gt)
}

#[test]
fn small_model_overfits_one_batch() {
    overfits::<Flex>();
}

#[test]
fn small_model_overfits_one_batch_on_the_generic_operations() {
    overfits::<NdArray>();
}

fn overfits<I: SsdBackend>() {
    let config = SsdConfig {
        num_classes: 2,
        image_size: [SIZE, SIZE],
        depth_multiplier: 0.25,
        // fast moving averages so that inference-mode BatchNorm follows the short run
        batch_norm: BatchNormConfig {
            decay: 0.8,
            ..Default::default()
        },
        ..Default::default()
    };
    let device = Default::default();
    let anchors = anchors(&config);
    let (pixels, gt) = batch();
    let targets: Vec<_> = gt
        .iter()
        .map(|g| assign_targets(&config.matcher, &config.box_coder(), &anchors, g))
        .collect();
    let images =
        Tensor::<Autodiff<I>, 4>::from_data(TensorData::new(pixels, [2, 3, SIZE, SIZE]), &device);
    let mut net = config.init::<Autodiff<I>>(42, &device).unwrap();
    let mut optim = AdamConfig::new().init();
    let mut first = None;
    let mut last = f32::MAX;
    for _ in 0..300 {
        let loss = compute_loss(&net, &config, &anchors, images.clone(), &targets);
        let total: f32 = loss.total.clone().into_scalar().elem();
        first.get_or_insert(total);
        last = total;
        let grads = loss.gradients(&net);
        net = optim.step(2e-3, net, grads);
    }
    let first = first.unwrap();
    assert!(last < 0.1 * first, "loss went from {first} to {last}");

    let detector = Detector::new(config.clone(), net.valid(), &device).unwrap();
    let (pixels, _) = batch();
    let input = Tensor::from_data(TensorData::new(pixels, [2, 3, SIZE, SIZE]), &device);
    let detections = detector.detect_tensor(input).unwrap();
    for (dets, objs) in detections.iter().zip(&gt) {
        for obj in objs {
            let found = dets
                .iter()
                .filter(|d| d.score > 0.5 && d.class_index + 1 == obj.class_id)
                .any(|d| d.bbox.iou(&obj.bbox) > 0.5);
            assert!(
                found,
                "object {obj:?} not found in {:?}",
                &dets[..dets.len().min(5)]
            );
        }
    }
}
