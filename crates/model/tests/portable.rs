//! Safetensors export / import with the documented names, and MobileNet-v1 backbone import
//! from the Hugging Face layout.

use std::collections::HashMap;

use burn::backend::Flex;
use burn::tensor::Tensor;
use model::portable::{import_mobilenet_v1, load_safetensors, save_safetensors};
use model::{ModelError, SsdConfig};
use safetensors::tensor::{Dtype, TensorView};

type B = Flex;

fn small() -> SsdConfig {
    SsdConfig {
        num_classes: 3,
        image_size: [96, 96],
        depth_multiplier: 0.25,
        ..Default::default()
    }
}

fn values<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().to_vec().unwrap()
}

/// The header of a safetensors file read by hand as the format defines it (u64 length, JSON),
/// independently of the `safetensors` crate: name -> (dtype, shape).
fn header(bytes: &[u8]) -> HashMap<String, (String, Vec<usize>)> {
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let json: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    json.as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .map(|(k, v)| {
            let shape = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            (k.clone(), (v["dtype"].as_str().unwrap().to_string(), shape))
        })
        .collect()
}

#[test]
fn export_uses_the_documented_names_and_round_trips() {
    let config = small();
    let device = Default::default();
    let net = config.init::<B>(3, &device).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    save_safetensors(&net, &config, &path).unwrap();

    let h = header(&std::fs::read(&path).unwrap());
    // depth 0.25: Conv2d_0 has max(32 * 0.25, 16) = 16 filters over 3 channels, 3x3
    assert_eq!(
        h["FeatureExtractor/MobilenetV1/Conv2d_0/weights"],
        ("F32".into(), vec![16, 3, 3, 3])
    );
    assert_eq!(
        h["FeatureExtractor/MobilenetV1/Conv2d_1_depthwise/depthwise_weights"].1,
        vec![16, 1, 3, 3]
    );
    assert_eq!(
        h["FeatureExtractor/MobilenetV1/Conv2d_13_pointwise/BatchNorm/moving_variance"].1,
        vec![256]
    );
    // extra layer 2: 1x1 to depth(256) = 64, then 3x3 s2 to depth(512) = 128
    assert_eq!(
        h["FeatureExtractor/MobilenetV1/Conv2d_13_pointwise_1_Conv2d_2_1x1_64/weights"].1,
        vec![64, 256, 1, 1]
    );
    assert_eq!(
        h["FeatureExtractor/MobilenetV1/Conv2d_13_pointwise_2_Conv2d_2_3x3_s2_128/weights"].1,
        vec![128, 64, 3, 3]
    );
    // the first feature map has 3 anchors: 3 x 4 box codes, 3 x (3 + 1) class logits
    assert_eq!(h["BoxPredictor_0/BoxEncodingPredictor/biases"].1, vec![12]);
    assert_eq!(
        h["BoxPredictor_5/ClassPredictor/weights"].1,
        vec![24, 32, 1, 1]
    );
    // 35 units (conv0, 13 x 2 separable, 4 x 2 extra) x 5 tensors + 12 heads x 2 tensors
    assert_eq!(h.len(), 35 * 5 + 12 * 2);

    let loaded = load_safetensors::<B>(&config, &path, &device).unwrap();
    let x = Tensor::<B, 4>::random(
        [1, 3, 96, 96],
        burn::tensor::Distribution::Uniform(-1.0, 1.0),
        &device,
    );
    let (a, b) = (net.forward(x.clone()), loaded.forward(x));
    assert_eq!(values(a.class_logits), values(b.class_logits));
    assert_eq!(values(a.box_encodings), values(b.box_encodings));

    // another config's file is an error naming the tensor
    let other = SsdConfig {
        num_classes: 5,
        ..small()
    };
    let err = load_safetensors::<B>(&other, &path, &device).unwrap_err();
    assert!(
        matches!(err, ModelError::IncompatibleWeights { .. }),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("BoxPredictor_0/ClassPredictor/weights"),
        "{err}"
    );
    // garbage is a decode error, not a panic
    std::fs::write(&path, b"not a safetensors file").unwrap();
    assert!(matches!(
        load_safetensors::<B>(&config, &path, &device),
        Err(ModelError::Decode { .. })
    ));
}

#[test]
fn imports_a_hugging_face_mobilenet_v1_backbone() {
    let config = small();
    let device = Default::default();
    let source = config.init::<B>(11, &device).unwrap();
    // the source network's backbone written under the transformers names
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mobilenet.safetensors");
    save_safetensors(&source, &config, &path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let ours = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let rename = |name: &str| -> Option<String> {
        let rest = name.strip_prefix("FeatureExtractor/MobilenetV1/Conv2d_")?;
        let (layer, part) = rest.split_once('/')?;
        let module = if layer == "0" {
            "conv_stem".to_string()
        } else {
            let (i, kind) = layer.split_once('_')?;
            let i: usize = i.parse().ok()?;
            match kind {
                "depthwise" => format!("layer.{}", 2 * (i - 1)),
                "pointwise" => format!("layer.{}", 2 * (i - 1) + 1),
                _ => return None,
            }
        };
        let part = match part {
            "weights" | "depthwise_weights" => "convolution.weight",
            "BatchNorm/gamma" => "normalization.weight",
            "BatchNorm/beta" => "normalization.bias",
            "BatchNorm/moving_mean" => "normalization.running_mean",
            "BatchNorm/moving_variance" => "normalization.running_var",
            _ => return None,
        };
        Some(format!("mobilenet_v1.{module}.{part}"))
    };
    let renamed: Vec<(String, TensorView)> = ours
        .tensors()
        .into_iter()
        .filter_map(|(n, v)| rename(&n).map(|n| (n, v)))
        .collect();
    assert_eq!(renamed.len(), 27 * 5, "the 27 backbone units");
    let hf = dir.path().join("hf.safetensors");
    std::fs::write(&hf, safetensors::serialize(renamed, None).unwrap()).unwrap();

    let target = config.init::<B>(0, &device).unwrap();
    let extra_before = values(target.extras[0].reduce.conv.weight.val());
    let imported = import_mobilenet_v1(target, &config, &hf).unwrap();
    for (a, b) in [
        (&imported.backbone.conv0, &source.backbone.conv0),
        (
            &imported.backbone.blocks[12].pointwise,
            &source.backbone.blocks[12].pointwise,
        ),
        (
            &imported.backbone.blocks[5].depthwise,
            &source.backbone.blocks[5].depthwise,
        ),
    ] {
        assert_eq!(values(a.conv.weight.val()), values(b.conv.weight.val()));
        assert_eq!(values(a.bn.gamma.val()), values(b.bn.gamma.val()));
        let ((m1, v1), (m2, v2)) = (a.bn.moving_stats(), b.bn.moving_stats());
        assert_eq!((values(m1), values(v1)), (values(m2), values(v2)));
    }
    // the extra layers keep their own initialisation
    assert_eq!(
        values(imported.extras[0].reduce.conv.weight.val()),
        extra_before
    );

    // a backbone of another width is an error naming the tensor and both shapes (at depth 0.5
    // Conv2d_0 still has max(16, 16) filters; Conv2d_1_pointwise is the first to differ)
    let wide = SsdConfig {
        depth_multiplier: 0.5,
        ..small()
    };
    let err = import_mobilenet_v1(wide.init::<B>(0, &device).unwrap(), &wide, &hf).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("mobilenet_v1.layer.1.convolution.weight")
            && msg.contains("[16, 16, 1, 1]")
            && msg.contains("[32, 16, 1, 1]"),
        "{msg}"
    );
    // a missing tensor is named
    let partial = dir.path().join("partial.safetensors");
    let data = vec![0u8; 16 * 3 * 3 * 3 * 4];
    let one = vec![(
        "conv_stem.convolution.weight".to_string(),
        TensorView::new(Dtype::F32, vec![16, 3, 3, 3], &data).unwrap(),
    )];
    std::fs::write(&partial, safetensors::serialize(one, None).unwrap()).unwrap();
    let err =
        import_mobilenet_v1(config.init::<B>(0, &device).unwrap(), &config, &partial).unwrap_err();
    assert!(err.to_string().contains("BatchNorm/gamma"), "{err}");
}
