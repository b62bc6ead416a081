//! One streaming pass over a COCO annotation file. The file of COCO train2017 is 450 MB,
//! most of it segmentation polygons; held as a `serde_json::Value` it would take several
//! gigabytes. So the top-level object is visited key by key, the `images` and `annotations`
//! lists element by element, and of each annotation only what a detection record needs is
//! kept (about 56 bytes); polygons and any other field are skipped unparsed. The keys may come
//! in any order: references between the lists are resolved once the whole file is read.

use std::fmt;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use model::BBox;
use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use crate::error::{DataError, Result};

/// `[x, y, width, height]` in pixels as corners: four numbers, finite, whose sums
/// `x + width` and `y + height` are finite too. A negative width or height is left for the
/// caller (a degenerate box to drop in training data, an error in evaluation input). The
/// error names the field and the value.
pub fn pixel_box(v: &Value) -> std::result::Result<BBox, String> {
    let a: Vec<f32> = v
        .as_array()
        .filter(|a| a.len() == 4)
        .and_then(|a| a.iter().map(|x| x.as_f64().map(|f| f as f32)).collect())
        .ok_or_else(|| format!("`bbox` must be [x, y, width, height], not {v}"))?;
    let (ymax, xmax) = (a[1] + a[3], a[0] + a[2]);
    if [ymax, xmax].iter().chain(&a).any(|x| !x.is_finite()) {
        return Err(format!(
            "`bbox` {v} must be finite (x + width and y + height too)"
        ));
    }
    Ok(BBox::new(a[1], a[0], ymax, xmax))
}

/// COCO's `iscrowd`: absent, 0 or `false` for an object, 1 or `true` for a crowd region
/// (pycocotools takes any true value for one); anything else is an error naming the value.
pub fn crowd_flag(v: &Value) -> std::result::Result<bool, String> {
    match v {
        Value::Null | Value::Bool(false) => Ok(false),
        Value::Bool(true) => Ok(true),
        v => match v.as_u64() {
            Some(0) => Ok(false),
            Some(1) => Ok(true),
            _ => Err(format!("`iscrowd` {v} is not 0, 1, false or true")),
        },
    }
}

/// An entry of `images`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ImageEntry {
    /// Its place in `images`.
    pub index: usize,
    pub id: u64,
    pub file_name: String,
    pub width: u32,
    pub height: u32,
}

impl ImageEntry {
    /// How errors name it: `images[3] (id 42, 000000000042.jpg)`.
    pub fn name(&self) -> String {
        format!(
            "images[{}] (id {}, {})",
            self.index, self.id, self.file_name
        )
    }
}

/// What training needs of an entry of `annotations`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct AnnotationEntry {
    pub id: u64,
    pub image_id: u64,
    pub category_id: i64,
    /// Corners in pixels, as [`pixel_box`] reads them.
    pub bbox: BBox,
    /// Its place in `annotations`.
    pub index: u32,
    /// `iscrowd: 1` (or `true`).
    pub crowd: bool,
    /// `area` in pixels (the mask's, in COCO's own files), where the annotation has one.
    pub area: Option<f32>,
}

impl AnnotationEntry {
    /// How errors name it: `annotations[7] (id 1234)`.
    pub fn name(&self) -> String {
        format!("annotations[{}] (id {})", self.index, self.id)
    }
}

/// An entry that could not be read: what it is, the image it belongs to where known, why.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BadEntry {
    pub what: String,
    pub image_id: Option<u64>,
    pub problem: String,
}

/// The parts of a COCO file that detection records need.
#[derive(Debug, Default)]
pub(crate) struct CocoJson {
    pub images: Vec<ImageEntry>,
    /// Entries of `images`, valid or not.
    pub images_listed: usize,
    pub annotations: Vec<AnnotationEntry>,
    /// The `categories` entries (a few hundred at most), checked by the caller.
    pub categories: Vec<Value>,
    /// Entries skipped as invalid (only with `skip_invalid`; otherwise the first is an
    /// error).
    pub bad: Vec<BadEntry>,
}

#[derive(Deserialize)]
#[serde(expecting = "an image object {\"id\", \"file_name\", \"width\", \"height\", ...}")]
struct RawImage {
    id: Option<Value>,
    file_name: Option<Value>,
    width: Option<Value>,
    height: Option<Value>,
}

/// The fields of an annotation that are read; `segmentation` and any other are skipped by the
/// parser without being built.
#[derive(Deserialize)]
#[serde(expecting = "an annotation object {\"id\", \"image_id\", \"category_id\", \"bbox\", ...}")]
struct RawAnnotation {
    id: Option<Value>,
    image_id: Option<Value>,
    category_id: Option<Value>,
    bbox: Option<Value>,
    iscrowd: Option<Value>,
    area: Option<Value>,
}

fn field<'a>(v: &'a Option<Value>, name: &str) -> std::result::Result<&'a Value, String> {
    v.as_ref().ok_or_else(|| format!("no `{name}`"))
}

fn unsigned(v: &Option<Value>, name: &str) -> std::result::Result<u64, String> {
    let v = field(v, name)?;
    v.as_u64()
        .ok_or_else(|| format!("`{name}` {v} is not an integer of at least 0"))
}

fn side(v: &Option<Value>, name: &str) -> std::result::Result<u32, String> {
    let v = field(v, name)?;
    v.as_u64()
        .filter(|&s| s > 0)
        .and_then(|s| u32::try_from(s).ok())
        .ok_or_else(|| format!("`{name}` {v} is not a size in pixels (an integer of at least 1)"))
}

impl RawImage {
    fn read(self, index: usize) -> std::result::Result<ImageEntry, String> {
        let file_name = match field(&self.file_name, "file_name")? {
            Value::String(s) if !s.is_empty() => s.clone(),
            v => return Err(format!("`file_name` {v} is not a file name")),
        };
        Ok(ImageEntry {
            index,
            id: unsigned(&self.id, "id")?,
            file_name,
            width: side(&self.width, "width")?,
            height: side(&self.height, "height")?,
        })
    }
}

impl RawAnnotation {
    fn read(&self, index: u32) -> std::result::Result<AnnotationEntry, String> {
        let category = field(&self.category_id, "category_id")?;
        let crowd = crowd_flag(self.iscrowd.as_ref().unwrap_or(&Value::Null))?;
        // as the API's records hold it: a float32, a finite number of at least 0
        let area = match &self.area {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_f64()
                    .map(|a| a as f32)
                    .filter(|a| a.is_finite() && *a >= 0.0)
                    .ok_or_else(|| format!("`area` {v} is not a number of at least 0"))?,
            ),
        };
        Ok(AnnotationEntry {
            id: unsigned(&self.id, "id")?,
            image_id: unsigned(&self.image_id, "image_id")?,
            category_id: category
                .as_i64()
                .ok_or_else(|| format!("`category_id` {category} is not an integer"))?,
            bbox: pixel_box(field(&self.bbox, "bbox")?)?,
            index,
            crowd,
            area,
        })
    }
}

/// Which list the parser is in, for the errors of a malformed file.
#[derive(Debug, Clone, Copy)]
enum List {
    Images,
    Annotations,
}

impl List {
    fn key(self) -> &'static str {
        match self {
            List::Images => "images",
            List::Annotations => "annotations",
        }
    }
}

/// The reading in progress.
struct State {
    skip_invalid: bool,
    file: CocoJson,
    seen: [bool; 3],
    /// The list entry being parsed, for the error of a malformed file.
    at: Option<(List, usize)>,
    /// The first invalid entry when they are not skipped: the parse stops there.
    stop: Option<BadEntry>,
}

impl State {
    /// Records an invalid entry; false when reading must stop.
    fn bad(&mut self, entry: BadEntry) -> bool {
        if self.skip_invalid {
            self.file.bad.push(entry);
            true
        } else {
            self.stop = Some(entry);
            false
        }
    }

    fn add_image(&mut self, raw: RawImage, index: usize) -> bool {
        self.file.images_listed += 1;
        let id = raw.id.as_ref().and_then(Value::as_u64);
        match raw.read(index) {
            Ok(image) => {
                self.file.images.push(image);
                true
            }
            Err(problem) => self.bad(BadEntry {
                what: match id {
                    Some(id) => format!("images[{index}] (id {id})"),
                    None => format!("images[{index}]"),
                },
                image_id: id,
                problem,
            }),
        }
    }

    fn add_annotation(&mut self, raw: RawAnnotation, index: usize) -> bool {
        let read = u32::try_from(index)
            .map_err(|_| "more than 4294967295 annotations".to_string())
            .and_then(|i| raw.read(i));
        match read {
            Ok(a) => {
                self.file.annotations.push(a);
                true
            }
            Err(problem) => self.bad(BadEntry {
                what: match raw.id.as_ref().and_then(Value::as_u64) {
                    Some(id) => format!("annotations[{index}] (id {id})"),
                    None => format!("annotations[{index}]"),
                },
                image_id: raw.image_id.as_ref().and_then(Value::as_u64),
                problem,
            }),
        }
    }

    /// Marks a top-level key as read; false the second time.
    fn first(&mut self, slot: usize) -> bool {
        !std::mem::replace(&mut self.seen[slot], true)
    }
}

impl<'de> Visitor<'de> for &mut State {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a COCO object with `images`, `annotations` and `categories`")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<(), A::Error> {
        while let Some(key) = map.next_key::<String>()? {
            let slot = match key.as_str() {
                "images" => 0,
                "annotations" => 1,
                "categories" => 2,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            if !self.first(slot) {
                return Err(de::Error::custom(format!("`{key}` appears twice")));
            }
            match slot {
                0 => map.next_value_seed(ListSeed(self, List::Images))?,
                1 => map.next_value_seed(ListSeed(self, List::Annotations))?,
                _ => self.file.categories = map.next_value()?,
            }
        }
        Ok(())
    }
}

/// The `images` or `annotations` list, read entry by entry into the state.
struct ListSeed<'a>(&'a mut State, List);

impl<'de> DeserializeSeed<'de> for ListSeed<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for ListSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "a list of {}", self.1.key())
    }

    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> std::result::Result<(), S::Error> {
        let ListSeed(state, list) = self;
        for index in 0.. {
            state.at = Some((list, index));
            let go_on = match list {
                List::Images => match seq.next_element::<RawImage>()? {
                    Some(raw) => state.add_image(raw, index),
                    None => break,
                },
                List::Annotations => match seq.next_element::<RawAnnotation>()? {
                    Some(raw) => state.add_annotation(raw, index),
                    None => break,
                },
            };
            if !go_on {
                return Err(de::Error::custom("stopped at an invalid entry"));
            }
        }
        state.at = None;
        Ok(())
    }
}

impl CocoJson {
    /// Reads `path` in one pass. An entry of `images` or `annotations` that lacks a field or
    /// holds a bad value (an id that is not an integer, a `bbox` that is not four finite
    /// numbers) is an error naming the file, the entry and the value, or, with
    /// `skip_invalid`, recorded in [`bad`](Self::bad); a file that is not JSON, or an entry
    /// that is not an object, is an error naming the entry being read.
    pub fn read(path: &Path, skip_invalid: bool) -> Result<Self> {
        let file = File::open(path).map_err(DataError::io("opening", path))?;
        let mut state = State {
            skip_invalid,
            file: CocoJson::default(),
            seen: [false; 3],
            at: None,
            stop: None,
        };
        let mut de = serde_json::Deserializer::from_reader(BufReader::with_capacity(1 << 20, file));
        let parsed = de.deserialize_map(&mut state).and_then(|()| de.end());
        if let Some(bad) = state.stop {
            let problem = format!("{}: {}", bad.what, bad.problem);
            return Err(DataError::InvalidExample(Box::new(DataError::invalid(
                path, problem,
            ))));
        }
        if let Err(e) = parsed {
            let at = match state.at {
                Some((list, i)) => format!("{}[{i}]: ", list.key()),
                None => String::new(),
            };
            return Err(DataError::invalid(path, format!("{at}not COCO JSON: {e}")));
        }
        let missing: Vec<&str> = ["images", "annotations", "categories"]
            .iter()
            .zip(state.seen)
            .filter(|(_, seen)| !seen)
            .map(|(k, _)| *k)
            .collect();
        if !missing.is_empty() {
            return Err(DataError::invalid(
                path,
                format!(
                    "no `{}` (a COCO instances file has `images`, `annotations` and \
                     `categories`; a test split's image_info file has no boxes to train on)",
                    missing.join("`, `")
                ),
            ));
        }
        Ok(state.file)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(text: &str, skip_invalid: bool) -> Result<CocoJson> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ann.json");
        std::fs::write(&path, text).unwrap();
        CocoJson::read(&path, skip_invalid)
    }

    #[test]
    fn keys_in_any_order_and_polygons_skipped() {
        // annotations before images, an unknown key, a crowd region with an RLE mask
        let text = json!({
            "annotations": [
                {"id": 5, "image_id": 9, "category_id": 18, "bbox": [10.5, 20, 30, 40.25],
                 "segmentation": [[1, 2, 3, 4, 5, 6]], "area": 1200.0, "iscrowd": 0},
                {"id": 6, "image_id": 9, "category_id": 1, "bbox": [0, 0, 8, 8],
                 "segmentation": {"counts": [1, 2, 3], "size": [4, 4]}, "iscrowd": 1},
            ],
            "info": {"year": 2017, "nested": [[{"a": 1}]]},
            "categories": [{"id": 1, "name": "person"}, {"id": 18, "name": "dog"}],
            "images": [{"id": 9, "file_name": "a.jpg", "width": 640, "height": 480,
                        "license": 3}],
        })
        .to_string();
        let file = read(&text, false).unwrap();
        assert_eq!(
            file.images,
            [ImageEntry {
                index: 0,
                id: 9,
                file_name: "a.jpg".into(),
                width: 640,
                height: 480
            }]
        );
        assert_eq!(
            file.annotations[0],
            AnnotationEntry {
                id: 5,
                image_id: 9,
                category_id: 18,
                bbox: BBox::new(20.0, 10.5, 60.25, 40.5),
                index: 0,
                crowd: false,
                area: Some(1200.0),
            }
        );
        assert!(file.annotations[1].crowd);
        assert_eq!(file.annotations[1].area, None);
        assert_eq!(file.categories.len(), 2);
    }

    #[test]
    fn bad_entries_are_named_or_recorded() {
        let text = json!({
            "images": [{"id": 1, "file_name": "a.jpg", "width": 4, "height": 0},
                       {"id": 2, "file_name": "b.jpg", "width": 4, "height": 4}],
            "annotations": [
                {"id": 7, "image_id": 2, "category_id": 1, "bbox": [1, 2, 3]},
                {"id": 8, "image_id": 2, "category_id": "cat", "bbox": [1, 2, 3, 4]},
                {"image_id": 2, "category_id": 1, "bbox": [1, 2, 3, 4]},
                {"id": 9, "image_id": 2, "category_id": 1, "bbox": [1, 2, 3, 4], "iscrowd": 2},
                {"id": 10, "image_id": 2, "category_id": 1, "bbox": [3e38, 2, 3e38, 4]},
                {"id": 11, "image_id": 2, "category_id": 1, "bbox": [1, 2, 3, 4], "area": -3},
            ],
            "categories": [],
        })
        .to_string();
        let err = read(&text, false).unwrap_err().to_string();
        // serde_json writes keys sorted: `annotations` come first
        assert!(
            err.contains(
                "ann.json: annotations[0] (id 7): `bbox` must be [x, y, width, height], not [1,2,3]"
            ) && err.contains("--skip-invalid"),
            "{err}"
        );
        let file = read(&text, true).unwrap();
        let bad: Vec<(&str, Option<u64>, &str)> = file
            .bad
            .iter()
            .map(|b| (b.what.as_str(), b.image_id, b.problem.as_str()))
            .collect();
        assert_eq!(
            bad,
            [
                (
                    "annotations[0] (id 7)",
                    Some(2),
                    "`bbox` must be [x, y, width, height], not [1,2,3]"
                ),
                (
                    "annotations[1] (id 8)",
                    Some(2),
                    "`category_id` \"cat\" is not an integer"
                ),
                ("annotations[2]", Some(2), "no `id`"),
                (
                    "annotations[3] (id 9)",
                    Some(2),
                    "`iscrowd` 2 is not 0, 1, false or true"
                ),
                (
                    "annotations[4] (id 10)",
                    Some(2),
                    "`bbox` [3e+38,2,3e+38,4] must be finite (x + width and y + height too)"
                ),
                (
                    "annotations[5] (id 11)",
                    Some(2),
                    "`area` -3 is not a number of at least 0"
                ),
                (
                    "images[0] (id 1)",
                    Some(1),
                    "`height` 0 is not a size in pixels (an integer of at least 1)"
                ),
            ]
        );
        assert_eq!(file.images.len(), 1);
    }

    /// `iscrowd` as pycocotools reads it: `true` is a crowd as 1 is, `false` none.
    #[test]
    fn crowds_may_be_booleans() {
        let text = json!({
            "images": [],
            "annotations": [
                {"id": 1, "image_id": 2, "category_id": 1, "bbox": [1, 2, 3, 4], "iscrowd": true},
                {"id": 2, "image_id": 2, "category_id": 1, "bbox": [1, 2, 3, 4], "iscrowd": false},
                {"id": 3, "image_id": 2, "category_id": 1, "bbox": [1, 2, 3, 4], "iscrowd": 1},
            ],
            "categories": [],
        })
        .to_string();
        let crowds: Vec<bool> = read(&text, false)
            .unwrap()
            .annotations
            .iter()
            .map(|a| a.crowd)
            .collect();
        assert_eq!(crowds, [true, false, true]);
    }

    #[test]
    fn malformed_files_name_the_entry() {
        for (text, want) in [
            (
                r#"{"images": [{"id": 1, "file_name": "a.jpg", "width": 4, "height": 4}, 7]"#,
                "ann.json: images[1]: not COCO JSON: invalid type: integer `7`, expected an image object",
            ),
            (
                r#"{"annotations": [{"id": 1, "bbox": [1, 2"#,
                "ann.json: annotations[0]: not COCO JSON: EOF while parsing",
            ),
            (
                "[1, 2]",
                "ann.json: not COCO JSON: invalid type: sequence, expected a COCO object",
            ),
            (
                r#"{"images": [], "images": []}"#,
                "ann.json: not COCO JSON: `images` appears twice",
            ),
            (
                r#"{"images": [], "categories": []}"#,
                "ann.json: no `annotations` (a COCO instances file",
            ),
            (r#"{"images": []} x"#, "not COCO JSON: trailing characters"),
        ] {
            let err = read(text, true).unwrap_err().to_string();
            assert!(err.contains(want), "{text}\n{err}");
        }
    }
}
