//! Writes what our `Detector` computes for some images, the reference the exported TFLite and
//! ONNX models are checked against (`scripts/deploy_check.py`): per image the preprocessed
//! input (NHWC, the exports' input layout, so that both sides run on the same numbers), the
//! raw box codes, the sigmoid scores (background first), the decoded boxes and the detections.
//!
//! `cargo run --release -p model --example reference_outputs -- MODEL.safetensors OUT.json IMAGE...`
//! (the safetensors file of `train export`, which carries its config).

use std::path::Path;

use burn::backend::Flex;
use burn::tensor::activation::sigmoid;
use burn::tensor::{Tensor, TensorData};
use model::Detector;
use model::portable::safetensors_config;
use model::preprocess::image_to_input;
use model::ssd::anchors;
use serde_json::{Value, json};

type Error = Box<dyn std::error::Error>;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 3 {
        eprintln!("usage: reference_outputs MODEL.safetensors OUT.json IMAGE...");
        std::process::exit(2);
    }
    if let Err(e) = run(Path::new(&args[0]), Path::new(&args[1]), &args[2..]) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn values<const D: usize>(t: Tensor<Flex, D>) -> Result<Vec<f32>, Error> {
    t.into_data()
        .to_vec::<f32>()
        .map_err(|e| format!("{e:?}").into())
}

fn run(weights: &Path, out: &Path, images: &[String]) -> Result<(), Error> {
    let config = safetensors_config(weights)?
        .ok_or_else(|| format!("{}: no config in its metadata", weights.display()))?;
    let device = Default::default();
    let detector = Detector::<Flex>::load(config.clone(), weights, &device)?;
    let [h, w] = config.image_size;
    let coder = config.box_coder();
    let anchors = anchors(&config);
    let mut results = Vec::new();
    for path in images {
        let image = image::open(path).map_err(|e| format!("{path}: {e}"))?;
        let mut chw = Vec::new();
        image_to_input(&image, h, w, &mut chw)?;
        let input = Tensor::<Flex, 4>::from_data(TensorData::new(chw, [1, 3, h, w]), &device);
        let predictions = detector.model().forward(input.clone());
        let codes = values(predictions.box_encodings)?;
        let decoded: Vec<[f32; 4]> = coder
            .decode_all(&codes, &anchors)
            .iter()
            .map(|b| b.to_array())
            .collect();
        let detections: Vec<Value> = detector.detect_tensor(input.clone())?[0]
            .iter()
            .map(|d| json!({"class_index": d.class_index, "score": d.score, "box": d.bbox.to_array()}))
            .collect();
        results.push(json!({
            "image": path,
            "input_nhwc": values(input.permute([0, 2, 3, 1]))?,
            "box_encodings": codes,
            "class_predictions": values(sigmoid(predictions.class_logits))?,
            "decoded_boxes": decoded,
            "detections": detections,
        }));
    }
    let doc = json!({"image_size": [h, w], "num_classes": config.num_classes,
        "max_total_detections": config.post_processing.max_total_detections, "images": results});
    model::io::write_atomic(out, serde_json::to_string(&doc)?.as_bytes())?;
    println!("{} images -> {}", images.len(), out.display());
    Ok(())
}
