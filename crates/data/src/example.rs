//! `tf.train.Example` messages (protobuf, via prost) and the Object Detection API's keys.

use std::collections::BTreeMap;

use model::BBox;
use prost::Message;
use sha2::{Digest, Sha256};

/// The protobuf messages of `tensorflow/core/example/{example,feature}.proto`.
pub mod proto {
    use std::collections::BTreeMap;

    /// `tf.train.Example`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Example {
        /// The named features.
        #[prost(message, optional, tag = "1")]
        pub features: Option<Features>,
    }

    /// `tf.train.Features`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Features {
        /// Features by name.
        #[prost(btree_map = "string, message", tag = "1")]
        pub feature: BTreeMap<String, Feature>,
    }

    /// `tf.train.Feature`: one of three lists.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Feature {
        /// The list.
        #[prost(oneof = "Kind", tags = "1, 2, 3")]
        pub kind: Option<Kind>,
    }

    /// The three list types of a feature.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Kind {
        /// `bytes_list`.
        #[prost(message, tag = "1")]
        BytesList(BytesList),
        /// `float_list`.
        #[prost(message, tag = "2")]
        FloatList(FloatList),
        /// `int64_list`.
        #[prost(message, tag = "3")]
        Int64List(Int64List),
    }

    /// `tf.train.BytesList`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct BytesList {
        /// Values.
        #[prost(bytes = "vec", repeated, tag = "1")]
        pub value: Vec<Vec<u8>>,
    }

    /// `tf.train.FloatList` (packed).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct FloatList {
        /// Values.
        #[prost(float, repeated, tag = "1")]
        pub value: Vec<f32>,
    }

    /// `tf.train.Int64List` (packed).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Int64List {
        /// Values.
        #[prost(int64, repeated, tag = "1")]
        pub value: Vec<i64>,
    }
}

use proto::{BytesList, Feature, FloatList, Int64List, Kind};

/// One annotated object.
#[derive(Debug, Clone, PartialEq)]
pub struct Object {
    /// Normalised box.
    pub bbox: BBox,
    /// Class name (`image/object/class/text`).
    pub class_text: String,
    /// Label-map id (`image/object/class/label`).
    pub label: i64,
    /// `image/object/difficult`.
    pub difficult: bool,
    /// `image/object/truncated`.
    pub truncated: bool,
    /// `image/object/view` (e.g. "Frontal"; empty when unknown).
    pub view: String,
}

/// An object as evaluation reads it: crowd regions included, with its area where the record
/// has one. The API's `create_coco_tf_record.py` writes both (`image/object/is_crowd`,
/// `image/object/area`), and so does the preparation of COCO files here.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalObject {
    /// The object.
    pub object: Object,
    /// `image/object/is_crowd`: a region of many objects (COCO's `iscrowd`), which the COCO
    /// metric ignores the detections on and training never sees: [`DetectionExample::decode`]
    /// leaves it out of the objects.
    pub crowd: bool,
    /// `image/object/area`: the area in pixels the COCO metric's size ranges read (COCO's
    /// `area`, its mask's), where the record has one.
    pub area: Option<f32>,
}

impl EvalObject {
    /// The objects among `all` that are crowd regions (`crowd`), or those that are not (what
    /// training sees).
    pub fn objects(all: &[EvalObject], crowd: bool) -> Vec<Object> {
        all.iter()
            .filter(|o| o.crowd == crowd)
            .map(|o| o.object.clone())
            .collect()
    }
}

/// A detection training example with the API's keys.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DetectionExample {
    /// Encoded image bytes (`image/encoded`).
    pub encoded: Vec<u8>,
    /// `image/format` ("jpeg" or "png").
    pub format: String,
    /// `image/height`.
    pub height: i64,
    /// `image/width`.
    pub width: i64,
    /// `image/filename`.
    pub filename: String,
    /// `image/source_id`.
    pub source_id: String,
    /// `image/key/sha256`: hex SHA-256 of the encoded image.
    pub sha256: String,
    /// The objects to train on: crowd regions (`image/object/is_crowd`) are not among them.
    pub objects: Vec<Object>,
}

/// Why an `Example` could not be read as a detection example.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExampleError {
    /// Not a protobuf `Example`.
    #[error("not a tf.train.Example: {0}")]
    Decode(String),
    /// A feature has the wrong list type.
    #[error("feature `{0}` has the wrong type")]
    WrongType(String),
    /// Required `image/encoded` is missing.
    #[error("missing feature `image/encoded`")]
    MissingImage,
    /// Boxes without `image/object/class/label`.
    #[error(
        "`image/object/class/label` is missing for {boxes} box(es) (records that name classes \
         only by `image/object/class/text` are not supported)"
    )]
    MissingLabels {
        /// The number of boxes.
        boxes: usize,
    },
    /// Per-object lists of different lengths.
    #[error("object feature `{key}` has {got} values for {want} boxes")]
    Ragged {
        /// The feature.
        key: &'static str,
        /// Its length.
        got: usize,
        /// The number of boxes.
        want: usize,
    },
}

fn bytes(values: Vec<Vec<u8>>) -> Feature {
    Feature {
        kind: Some(Kind::BytesList(BytesList { value: values })),
    }
}
fn floats(values: Vec<f32>) -> Feature {
    Feature {
        kind: Some(Kind::FloatList(FloatList { value: values })),
    }
}
fn ints(values: Vec<i64>) -> Feature {
    Feature {
        kind: Some(Kind::Int64List(Int64List { value: values })),
    }
}

/// Hex SHA-256 of `data`, as the API's tools write `image/key/sha256`.
pub fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl DetectionExample {
    /// Encodes as a serialised `tf.train.Example`.
    pub fn encode(&self) -> Vec<u8> {
        let objects: Vec<&Object> = self.objects.iter().collect();
        Self::message(self.features(&objects))
    }

    /// Encodes with `objects` as the object lists in place of [`objects`](Self::objects)
    /// (which should be those of them that are not crowds), in their order, with
    /// `image/object/is_crowd` and, where every object has an area, `image/object/area`: as
    /// the API's `create_coco_tf_record.py` writes COCO's annotations.
    pub fn encode_with(&self, objects: &[EvalObject]) -> Vec<u8> {
        let list: Vec<&Object> = objects.iter().map(|o| &o.object).collect();
        let mut f = self.features(&list);
        f.insert(
            "image/object/is_crowd".into(),
            ints(objects.iter().map(|o| i64::from(o.crowd)).collect()),
        );
        let areas: Option<Vec<f32>> = objects.iter().map(|o| o.area).collect();
        if let Some(areas) = areas {
            f.insert("image/object/area".into(), floats(areas));
        }
        Self::message(f)
    }

    fn message(feature: BTreeMap<String, Feature>) -> Vec<u8> {
        proto::Example {
            features: Some(proto::Features { feature }),
        }
        .encode_to_vec()
    }

    /// The features of the example with `o` as its objects.
    fn features(&self, o: &[&Object]) -> BTreeMap<String, Feature> {
        let text = |s: &str| s.as_bytes().to_vec();
        let mut f = BTreeMap::new();
        f.insert("image/encoded".into(), bytes(vec![self.encoded.clone()]));
        f.insert("image/format".into(), bytes(vec![text(&self.format)]));
        f.insert("image/height".into(), ints(vec![self.height]));
        f.insert("image/width".into(), ints(vec![self.width]));
        f.insert("image/filename".into(), bytes(vec![text(&self.filename)]));
        f.insert("image/source_id".into(), bytes(vec![text(&self.source_id)]));
        f.insert("image/key/sha256".into(), bytes(vec![text(&self.sha256)]));
        f.insert(
            "image/object/bbox/xmin".into(),
            floats(o.iter().map(|x| x.bbox.xmin).collect()),
        );
        f.insert(
            "image/object/bbox/xmax".into(),
            floats(o.iter().map(|x| x.bbox.xmax).collect()),
        );
        f.insert(
            "image/object/bbox/ymin".into(),
            floats(o.iter().map(|x| x.bbox.ymin).collect()),
        );
        f.insert(
            "image/object/bbox/ymax".into(),
            floats(o.iter().map(|x| x.bbox.ymax).collect()),
        );
        f.insert(
            "image/object/class/text".into(),
            bytes(o.iter().map(|x| text(&x.class_text)).collect()),
        );
        f.insert(
            "image/object/class/label".into(),
            ints(o.iter().map(|x| x.label).collect()),
        );
        f.insert(
            "image/object/difficult".into(),
            ints(o.iter().map(|x| i64::from(x.difficult)).collect()),
        );
        f.insert(
            "image/object/truncated".into(),
            ints(o.iter().map(|x| i64::from(x.truncated)).collect()),
        );
        f.insert(
            "image/object/view".into(),
            bytes(o.iter().map(|x| text(&x.view)).collect()),
        );
        f
    }

    /// Decodes a serialised `tf.train.Example`. Missing optional keys get defaults; boxes need
    /// labels; other per-object keys must be absent or have one value per box. Crowd regions
    /// (`image/object/is_crowd` not 0) are left out of the objects: they are never trained
    /// on ([`decode_with`](Self::decode_with) reads them for evaluation).
    pub fn decode(data: &[u8]) -> Result<Self, ExampleError> {
        Self::decode_with(data).map(|(example, _)| example)
    }

    /// Decodes as [`decode`](Self::decode) does, and returns beside the example every object
    /// in the record's order as evaluation reads it: crowd regions included, with
    /// `image/object/area` where the record has it.
    pub fn decode_with(data: &[u8]) -> Result<(Self, Vec<EvalObject>), ExampleError> {
        let example =
            proto::Example::decode(data).map_err(|e| ExampleError::Decode(e.to_string()))?;
        let f = example.features.map(|f| f.feature).unwrap_or_default();
        let get_bytes = |k: &str| -> Result<Vec<Vec<u8>>, ExampleError> {
            match f.get(k).and_then(|x| x.kind.as_ref()) {
                None => Ok(Vec::new()),
                Some(Kind::BytesList(b)) => Ok(b.value.clone()),
                Some(_) => Err(ExampleError::WrongType(k.into())),
            }
        };
        let get_floats = |k: &str| -> Result<Vec<f32>, ExampleError> {
            match f.get(k).and_then(|x| x.kind.as_ref()) {
                None => Ok(Vec::new()),
                Some(Kind::FloatList(v)) => Ok(v.value.clone()),
                Some(_) => Err(ExampleError::WrongType(k.into())),
            }
        };
        let get_ints = |k: &str| -> Result<Vec<i64>, ExampleError> {
            match f.get(k).and_then(|x| x.kind.as_ref()) {
                None => Ok(Vec::new()),
                Some(Kind::Int64List(v)) => Ok(v.value.clone()),
                Some(_) => Err(ExampleError::WrongType(k.into())),
            }
        };
        let string = |k: &str| -> Result<String, ExampleError> {
            Ok(get_bytes(k)?
                .into_iter()
                .next()
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default())
        };
        let encoded = get_bytes("image/encoded")?
            .into_iter()
            .next()
            .ok_or(ExampleError::MissingImage)?;
        let xmin = get_floats("image/object/bbox/xmin")?;
        let n = xmin.len();
        let per_object = |key: &'static str, got: usize| {
            if got == n || got == 0 {
                Ok(())
            } else {
                Err(ExampleError::Ragged { key, got, want: n })
            }
        };
        let xmax = get_floats("image/object/bbox/xmax")?;
        let ymin = get_floats("image/object/bbox/ymin")?;
        let ymax = get_floats("image/object/bbox/ymax")?;
        for (key, v) in [
            ("image/object/bbox/xmax", &xmax),
            ("image/object/bbox/ymin", &ymin),
            ("image/object/bbox/ymax", &ymax),
        ] {
            if v.len() != n {
                return Err(ExampleError::Ragged {
                    key,
                    got: v.len(),
                    want: n,
                });
            }
        }
        let texts = get_bytes("image/object/class/text")?;
        let labels = get_ints("image/object/class/label")?;
        let difficult = get_ints("image/object/difficult")?;
        let truncated = get_ints("image/object/truncated")?;
        let views = get_bytes("image/object/view")?;
        let crowds = get_ints("image/object/is_crowd")?;
        let areas = get_floats("image/object/area")?;
        per_object("image/object/class/text", texts.len())?;
        if n > 0 && labels.is_empty() {
            return Err(ExampleError::MissingLabels { boxes: n });
        }
        per_object("image/object/class/label", labels.len())?;
        per_object("image/object/difficult", difficult.len())?;
        per_object("image/object/truncated", truncated.len())?;
        per_object("image/object/view", views.len())?;
        per_object("image/object/is_crowd", crowds.len())?;
        per_object("image/object/area", areas.len())?;
        let all: Vec<EvalObject> = (0..n)
            .map(|i| EvalObject {
                object: Object {
                    bbox: BBox::new(ymin[i], xmin[i], ymax[i], xmax[i]),
                    class_text: texts
                        .get(i)
                        .map(|t| String::from_utf8_lossy(t).into_owned())
                        .unwrap_or_default(),
                    label: labels[i],
                    difficult: difficult.get(i).is_some_and(|&d| d != 0),
                    truncated: truncated.get(i).is_some_and(|&d| d != 0),
                    view: views
                        .get(i)
                        .map(|t| String::from_utf8_lossy(t).into_owned())
                        .unwrap_or_default(),
                },
                crowd: crowds.get(i).is_some_and(|&c| c != 0),
                area: areas.get(i).copied(),
            })
            .collect();
        let objects = EvalObject::objects(&all, false);
        let example = Self {
            encoded,
            format: string("image/format")?,
            height: get_ints("image/height")?.first().copied().unwrap_or(0),
            width: get_ints("image/width")?.first().copied().unwrap_or(0),
            filename: string("image/filename")?,
            source_id: string("image/source_id")?,
            sha256: string("image/key/sha256")?,
            objects,
        };
        Ok((example, all))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> DetectionExample {
        DetectionExample {
            encoded: vec![0xff, 0xd8, 1, 2, 3],
            format: "jpeg".into(),
            height: 375,
            width: 500,
            filename: "Abyssinian_1.jpg".into(),
            source_id: "Abyssinian_1.jpg".into(),
            sha256: sha256_hex(&[0xff, 0xd8, 1, 2, 3]),
            objects: vec![
                Object {
                    bbox: BBox::new(0.1, 0.2, 0.5, 0.6),
                    class_text: "cat".into(),
                    label: 1,
                    difficult: false,
                    truncated: true,
                    view: "Frontal".into(),
                },
                Object {
                    bbox: BBox::new(0.3, 0.0, 1.0, 0.9),
                    class_text: "dog".into(),
                    label: 2,
                    difficult: true,
                    truncated: false,
                    view: String::new(),
                },
            ],
        }
    }

    #[test]
    fn every_key_round_trips() {
        let e = sample();
        let back = DetectionExample::decode(&e.encode()).unwrap();
        assert_eq!(back, e);
        let empty = DetectionExample {
            objects: vec![],
            ..sample()
        };
        assert_eq!(DetectionExample::decode(&empty.encode()).unwrap(), empty);
    }

    /// Crowd regions and areas under the API's names; decoding leaves the crowds out of the
    /// objects (training never sees them) and gives them, in the record's order, to
    /// evaluation.
    #[test]
    fn crowd_regions_and_areas_round_trip_outside_the_objects() {
        let e = sample();
        let crowd = Object {
            label: 2,
            class_text: "dog".into(),
            ..e.objects[0].clone()
        };
        let all = vec![
            EvalObject {
                object: e.objects[0].clone(),
                crowd: false,
                area: Some(1234.5),
            },
            EvalObject {
                object: crowd,
                crowd: true,
                area: Some(900.0),
            },
            EvalObject {
                object: e.objects[1].clone(),
                crowd: false,
                area: Some(20.25),
            },
        ];
        let bytes = e.encode_with(&all);
        let message = proto::Example::decode(bytes.as_slice()).unwrap();
        let f = message.features.unwrap().feature;
        assert_eq!(
            f["image/object/is_crowd"].kind,
            Some(Kind::Int64List(Int64List {
                value: vec![0, 1, 0]
            }))
        );
        assert_eq!(
            f["image/object/area"].kind,
            Some(Kind::FloatList(FloatList {
                value: vec![1234.5, 900.0, 20.25]
            }))
        );
        assert_eq!(DetectionExample::decode(&bytes).unwrap(), e);
        let (example, back) = DetectionExample::decode_with(&bytes).unwrap();
        assert_eq!((example, back), (e.clone(), all.clone()));
        // without areas: no `image/object/area`
        let no_area: Vec<EvalObject> = all
            .into_iter()
            .map(|o| EvalObject { area: None, ..o })
            .collect();
        let (_, back) = DetectionExample::decode_with(&e.encode_with(&no_area)).unwrap();
        assert_eq!(back, no_area);
        // records without either: nothing is a crowd
        let (_, back) = DetectionExample::decode_with(&e.encode()).unwrap();
        assert!(back.iter().all(|o| !o.crowd && o.area.is_none()));
    }

    #[test]
    fn sha256_of_known_input() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    /// Bytes as TensorFlow writes them: a map entry per feature, float lists packed.
    #[test]
    fn decodes_hand_encoded_tensorflow_bytes() {
        // Example{features{feature{key:"image/encoded" value{bytes_list{value:"\x01"}}}
        //                  feature{key:"image/object/bbox/xmin" value{float_list{value:[0.5]}}} ...}}
        fn entry(key: &str, value: &[u8]) -> Vec<u8> {
            let mut e = vec![0x0a, key.len() as u8];
            e.extend(key.as_bytes());
            e.push(0x12);
            e.push(value.len() as u8);
            e.extend(value);
            let mut out = vec![0x0a, e.len() as u8];
            out.extend(e);
            out
        }
        let half = 0.5f32.to_le_bytes();
        let float_list = |v: [u8; 4]| {
            let mut l = vec![0x12, 6, 0x0a, 4];
            l.extend(v);
            l
        };
        let mut features = entry("image/encoded", &[0x0a, 3, 0x0a, 1, 0x01]);
        for k in ["xmin", "xmax", "ymin", "ymax"] {
            features.extend(entry(&format!("image/object/bbox/{k}"), &float_list(half)));
        }
        features.extend(entry("image/object/class/label", &[0x1a, 3, 0x0a, 1, 7]));
        // field 1, length as a varint (the features exceed 127 bytes)
        let mut example = vec![0x0a];
        let mut n = features.len();
        while n >= 0x80 {
            example.push((n as u8 & 0x7f) | 0x80);
            n >>= 7;
        }
        example.push(n as u8);
        example.extend(features);
        let e = DetectionExample::decode(&example).unwrap();
        assert_eq!(e.encoded, vec![1]);
        assert_eq!(e.objects.len(), 1);
        assert_eq!(e.objects[0].bbox, BBox::new(0.5, 0.5, 0.5, 0.5));
        assert_eq!(e.objects[0].label, 7);
    }

    #[test]
    fn malformed_examples_are_errors() {
        assert!(matches!(
            DetectionExample::decode(&[0xff, 0xff]),
            Err(ExampleError::Decode(_))
        ));
        assert_eq!(
            DetectionExample::decode(&[]),
            Err(ExampleError::MissingImage)
        );
        let mut e = sample();
        e.objects[1].view = "x".into();
        let mut bytes = e.encode();
        // drop one label by re-encoding a ragged list by hand
        let mut msg = proto::Example::decode(bytes.as_slice()).unwrap();
        msg.features
            .as_mut()
            .unwrap()
            .feature
            .insert("image/object/class/label".into(), ints(vec![1]));
        bytes = msg.encode_to_vec();
        assert!(matches!(
            DetectionExample::decode(&bytes),
            Err(ExampleError::Ragged { .. })
        ));
        // boxes without any label: an error, not objects of class 0 (the background)
        msg.features
            .as_mut()
            .unwrap()
            .feature
            .remove("image/object/class/label");
        let err = DetectionExample::decode(&msg.encode_to_vec()).unwrap_err();
        assert_eq!(err, ExampleError::MissingLabels { boxes: 2 });
        assert!(
            err.to_string()
                .starts_with("`image/object/class/label` is missing for 2 box(es)"),
            "{err}"
        );
    }
}
