//! The inference API for embedders: a [`Detector`] built from a config and a weights file,
//! detecting objects in `image::DynamicImage`s.

use std::path::Path;

use burn::tensor::activation::sigmoid;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use image::DynamicImage;
use serde::{Deserialize, Serialize};

use crate::boxes::BBox;
use crate::config::SsdConfig;
use crate::error::{ModelError, Result};
use crate::ops::SsdBackend;
use crate::portable::load_safetensors;
use crate::postprocess::{RawDetection, multiclass_nms};
use crate::preprocess::image_to_input;
use crate::ssd::{Predictions, Ssd, anchors};
use crate::weights::load_weights;

/// One detected object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Detection {
    /// Label-map id of the class (1-based).
    pub class_id: usize,
    /// Display name of the class (from the config's `class_names`).
    pub class_name: String,
    /// Sigmoid score in `(0, 1)`.
    pub score: f32,
    /// Box in coordinates normalised to the image, `[0, 1]`.
    pub bbox: BBox,
    /// The same box in pixels of the image passed in.
    pub pixel_bbox: BBox,
}

/// Post-processes raw predictions: sigmoid scores, background dropped, boxes decoded against
/// `anchors`, multi-class NMS per image.
pub fn postprocess<B: Backend>(
    config: &SsdConfig,
    anchors: &[BBox],
    predictions: &Predictions<B>,
) -> Vec<Vec<RawDetection>> {
    let [batch, num_anchors, classes_bg] = predictions.class_logits.dims();
    let num_classes = classes_bg - 1;
    let scores = sigmoid(predictions.class_logits.clone())
        .slice([0..batch, 0..num_anchors, 1..classes_bg])
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("float tensor");
    let codes = predictions
        .box_encodings
        .clone()
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("float tensor");
    let coder = config.box_coder();
    (0..batch)
        .map(|b| {
            let boxes = coder.decode_all(
                &codes[b * num_anchors * 4..(b + 1) * num_anchors * 4],
                anchors,
            );
            let s = &scores[b * num_anchors * num_classes..(b + 1) * num_anchors * num_classes];
            multiclass_nms(&boxes, s, num_classes, &config.post_processing)
        })
        .collect()
}

/// A ready-to-run detector. Use a backend without autodiff (BatchNorm then uses its moving
/// statistics), e.g. `burn::backend::Flex` on the CPU or `burn::backend::Cuda`.
#[derive(Debug)]
pub struct Detector<B: Backend> {
    config: SsdConfig,
    model: Ssd<B>,
    anchors: Vec<BBox>,
    device: B::Device,
}

/// Checks `config` and that `model` was built from it (its class count), as everything that
/// runs a network on its own config (the detector, the exports) needs.
pub fn check_network<B: Backend>(config: &SsdConfig, model: &Ssd<B>) -> Result<()> {
    config.validate()?;
    if model.num_classes() != config.num_classes {
        return Err(ModelError::InvalidConfig {
            field: "num_classes",
            problem: format!(
                "is {} but the network has {}",
                config.num_classes,
                model.num_classes()
            ),
        });
    }
    Ok(())
}

impl<B: SsdBackend> Detector<B> {
    /// Wraps an existing network (for instance one just trained).
    pub fn new(config: SsdConfig, model: Ssd<B>, device: &B::Device) -> Result<Self> {
        check_network(&config, &model)?;
        let anchors = anchors(&config);
        Ok(Self {
            config,
            model,
            anchors,
            device: device.clone(),
        })
    }

    /// Builds the network from `config` and loads its weights from `weights`: a weights file
    /// (`.mpk`, as checkpoints hold) or a safetensors export (`.safetensors`, `train export`).
    pub fn load(config: SsdConfig, weights: &Path, device: &B::Device) -> Result<Self> {
        config.validate()?;
        let model = if weights.extension().is_some_and(|e| e == "safetensors") {
            load_safetensors(&config, weights, device)?
        } else {
            load_weights(&config, weights, device)?
        };
        Self::new(config, model, device)
    }

    /// The config the detector was built from.
    pub fn config(&self) -> &SsdConfig {
        &self.config
    }

    /// The network.
    pub fn model(&self) -> &Ssd<B> {
        &self.model
    }

    /// Detects objects in one image of any size and colour type.
    pub fn detect(&self, image: &DynamicImage) -> Result<Vec<Detection>> {
        Ok(self.detect_batch(std::slice::from_ref(image))?.remove(0))
    }

    /// Detects objects in several images at once (one forward pass).
    pub fn detect_batch(&self, images: &[DynamicImage]) -> Result<Vec<Vec<Detection>>> {
        if images.is_empty() {
            return Ok(Vec::new());
        }
        let [h, w] = self.config.image_size;
        let mut input = Vec::with_capacity(images.len() * 3 * h * w);
        for image in images {
            image_to_input(image, h, w, &mut input)?;
        }
        let tensor = Tensor::from_data(
            TensorData::new(input, [images.len(), 3, h, w]),
            &self.device,
        );
        let raw = self.detect_tensor(tensor)?;
        Ok(raw
            .into_iter()
            .zip(images)
            .map(|(dets, image)| {
                dets.into_iter()
                    .map(|d| Detection {
                        class_id: d.class_index + 1,
                        class_name: self.config.class_name(d.class_index + 1),
                        score: d.score,
                        bbox: d.bbox,
                        pixel_bbox: d.bbox.to_pixels(image.height(), image.width()),
                    })
                    .collect()
            })
            .collect())
    }

    /// Detects objects in an already preprocessed `[batch, 3, height, width]` tensor.
    pub fn detect_tensor(&self, images: Tensor<B, 4>) -> Result<Vec<Vec<RawDetection>>> {
        let [_, c, h, w] = images.dims();
        if c != 3 || [h, w] != self.config.image_size {
            return Err(ModelError::InvalidImage(format!(
                "expected a [batch, 3, {}, {}] tensor, got [_, {c}, {h}, {w}]",
                self.config.image_size[0], self.config.image_size[1]
            )));
        }
        let predictions = self.model.forward(images);
        Ok(postprocess(&self.config, &self.anchors, &predictions))
    }
}
