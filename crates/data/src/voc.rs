//! PASCAL VOC XML annotations and the Oxford-IIIT Pet folder layout (`images/`,
//! `annotations/xmls/`, `annotations/trainval.txt`), turned into detection examples the way the
//! API's `create_pet_tf_record.py` / `create_pascal_tf_record.py` do, with the dataset's real
//! mess (missing XML, mislabelled or odd image formats, boxes outside the image) handled and
//! counted.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use image::ImageFormat;
use model::BBox;

use crate::error::{DataError, Result};
use crate::example::{DetectionExample, Object, sha256_hex};
use crate::images::decode_image;
use crate::label_map::LabelMap;

/// One `<object>` of a VOC annotation, box in pixels.
#[derive(Debug, Clone, PartialEq)]
pub struct VocObject {
    /// `<name>`.
    pub name: String,
    /// `<pose>` (empty when absent).
    pub pose: String,
    /// `<truncated>`.
    pub truncated: bool,
    /// `<difficult>`.
    pub difficult: bool,
    /// `(xmin, ymin, xmax, ymax)` in pixels.
    pub bndbox: (f32, f32, f32, f32),
}

/// A VOC annotation file.
#[derive(Debug, Clone, PartialEq)]
pub struct VocAnnotation {
    /// `<filename>`.
    pub filename: String,
    /// `<size><width>`.
    pub width: u32,
    /// `<size><height>`.
    pub height: u32,
    /// The objects.
    pub objects: Vec<VocObject>,
}

/// How classes are named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClassSource {
    /// The `<name>` of each object (cat / dog for the pets).
    Species,
    /// The breed from the file name (`Abyssinian_12.jpg` -> `Abyssinian`), as the API's pet tool.
    Breeds,
}

/// Counters of everything that was fixed or skipped.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct CleanupReport {
    /// Images re-encoded as RGB JPEG (PNG or GIF named `.jpg`, grayscale, CMYK).
    pub reencoded: usize,
    /// Boxes clipped to the image.
    pub boxes_clipped: usize,
    /// Boxes dropped (no area left after clipping, or xmax <= xmin).
    pub boxes_dropped: usize,
}

impl CleanupReport {
    /// Adds the counts of `other`.
    pub(crate) fn add(&mut self, other: &Self) {
        self.reencoded += other.reencoded;
        self.boxes_clipped += other.boxes_clipped;
        self.boxes_dropped += other.boxes_dropped;
    }
}

fn child_text<'a>(node: roxmltree::Node<'a, 'a>, name: &str) -> Option<&'a str> {
    node.children()
        .find(|c| c.has_tag_name(name))
        .and_then(|c| c.text())
        .map(str::trim)
}

fn number(node: roxmltree::Node, name: &str, path: &Path) -> Result<f32> {
    let text = child_text(node, name)
        .ok_or_else(|| DataError::invalid(path, format!("missing <{name}>")))?;
    text.parse::<f32>()
        .ok()
        .filter(|v| v.is_finite())
        .ok_or_else(|| DataError::invalid(path, format!("<{name}> is not a number: {text:?}")))
}

/// The `<name>` of object `index`: present and not empty.
fn object_name(object: roxmltree::Node, index: usize, path: &Path) -> Result<String> {
    child_text(object, "name")
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .ok_or_else(|| DataError::invalid(path, format!("<object> {index} has no <name>")))
}

impl VocAnnotation {
    /// Parses VOC XML text; `path` is used in errors.
    pub fn parse(xml: &str, path: &Path) -> Result<Self> {
        let doc = roxmltree::Document::parse(xml)
            .map_err(|e| DataError::invalid(path, format!("malformed XML: {e}")))?;
        let root = doc.root_element();
        let size = root
            .children()
            .find(|c| c.has_tag_name("size"))
            .ok_or_else(|| DataError::invalid(path, "missing <size>"))?;
        let objects = root
            .children()
            .filter(|c| c.has_tag_name("object"))
            .enumerate()
            .map(|(index, o)| {
                let b = o
                    .children()
                    .find(|c| c.has_tag_name("bndbox"))
                    .ok_or_else(|| DataError::invalid(path, "<object> without <bndbox>"))?;
                Ok(VocObject {
                    name: object_name(o, index, path)?,
                    pose: child_text(o, "pose").unwrap_or_default().to_string(),
                    truncated: child_text(o, "truncated").is_some_and(|t| t == "1"),
                    difficult: child_text(o, "difficult").is_some_and(|t| t == "1"),
                    bndbox: (
                        number(b, "xmin", path)?,
                        number(b, "ymin", path)?,
                        number(b, "xmax", path)?,
                        number(b, "ymax", path)?,
                    ),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            filename: child_text(root, "filename").unwrap_or_default().to_string(),
            width: number(size, "width", path)? as u32,
            height: number(size, "height", path)? as u32,
            objects,
        })
    }

    /// Reads and parses an annotation file.
    pub fn load(path: &Path) -> Result<Self> {
        let xml = std::fs::read_to_string(path).map_err(DataError::io("reading", path))?;
        Self::parse(&xml, path)
    }
}

/// The breed of an Oxford-IIIT Pet file name: everything before the last `_<digits>`.
pub fn breed_from_filename(filename: &str) -> Option<&str> {
    let stem = filename.rsplit_once('.').map_or(filename, |(s, _)| s);
    let (breed, number) = stem.rsplit_once('_')?;
    (!breed.is_empty() && !number.is_empty() && number.chars().all(|c| c.is_ascii_digit()))
        .then_some(breed)
}

/// A box of pixel corners normalised by the image size and clipped to the image; `None` when
/// no area is left (outside the image, or a maximum not above its minimum). Clipped and
/// dropped boxes are counted in `report`.
pub(crate) fn normalised_box(
    pixels: BBox,
    width: u32,
    height: u32,
    report: &mut CleanupReport,
) -> Option<BBox> {
    let (w, h) = (width as f32, height as f32);
    let raw = BBox::new(
        pixels.ymin / h,
        pixels.xmin / w,
        pixels.ymax / h,
        pixels.xmax / w,
    );
    let bbox = raw.clip_to(&BBox::new(0.0, 0.0, 1.0, 1.0));
    if bbox.height() <= 0.0 || bbox.width() <= 0.0 {
        report.boxes_dropped += 1;
        return None;
    }
    report.boxes_clipped += usize::from(bbox != raw);
    Some(bbox)
}

/// Reads an image file, returning JPEG bytes (the original ones when they already are an RGB
/// JPEG) with its size, and whether it had to be re-encoded. A file that does not decode
/// completely (a JPEG or PNG cut short) is an error, as TensorFlow's decoders reject it.
pub fn load_image_as_jpeg(path: &Path) -> Result<(Vec<u8>, u32, u32, bool)> {
    let bytes = std::fs::read(path).map_err(DataError::io("reading", path))?;
    let bad = |problem: String| DataError::Image {
        path: path.to_path_buf(),
        problem,
    };
    let (img, format) = decode_image(&bytes).map_err(bad)?;
    let (w, h) = (img.width(), img.height());
    let is_rgb_jpeg =
        format == ImageFormat::Jpeg && matches!(img, image::DynamicImage::ImageRgb8(_));
    if is_rgb_jpeg {
        return Ok((bytes, w, h, false));
    }
    let mut out = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 95)
        .encode_image(&img.to_rgb8())
        .map_err(|e| bad(e.to_string()))?;
    Ok((out, w, h, true))
}

/// Builds the detection example of one image and its annotation.
pub fn voc_example(
    image_path: &Path,
    annotation: &VocAnnotation,
    classes: ClassSource,
    label_map: &LabelMap,
    report: &mut CleanupReport,
) -> Result<DetectionExample> {
    let (encoded, w, h, reencoded) = load_image_as_jpeg(image_path)?;
    report.reencoded += usize::from(reencoded);
    let filename = image_path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_string();
    let mut objects = Vec::new();
    for o in &annotation.objects {
        let class = match classes {
            ClassSource::Species => o.name.clone(),
            ClassSource::Breeds => breed_from_filename(&filename)
                .ok_or_else(|| {
                    DataError::invalid(
                        image_path,
                        "file name has no breed (expected <breed>_<n>.jpg)",
                    )
                })?
                .to_string(),
        };
        let label = label_map.id_of(&class).ok_or_else(|| {
            DataError::invalid(
                image_path,
                format!("class {class:?} is not in the label map"),
            )
        })?;
        let (x0, y0, x1, y1) = o.bndbox;
        let Some(bbox) = normalised_box(BBox::new(y0, x0, y1, x1), w, h, report) else {
            continue;
        };
        objects.push(Object {
            bbox,
            class_text: class,
            label,
            difficult: o.difficult,
            truncated: o.truncated,
            view: o.pose.clone(),
        });
    }
    Ok(DetectionExample {
        sha256: sha256_hex(&encoded),
        encoded,
        format: "jpeg".into(),
        height: h as i64,
        width: w as i64,
        source_id: filename.clone(),
        filename,
        objects,
    })
}

/// An Oxford-IIIT Pet (or VOC) folder: which images it lists and where their files are.
#[derive(Debug, Clone)]
pub struct PetLayout {
    /// The dataset root.
    pub root: PathBuf,
    /// Image stems listed in `annotations/trainval.txt` (or `list.txt`).
    pub names: Vec<String>,
}

impl PetLayout {
    /// Reads the list of a dataset root: `annotations/trainval.txt`, else `annotations/list.txt`
    /// (comment lines starting with `#` skipped; the first word of each line is the stem).
    pub fn open(root: &Path) -> Result<Self> {
        let ann = root.join("annotations");
        let list = [ann.join("trainval.txt"), ann.join("list.txt")]
            .into_iter()
            .find(|p| p.is_file())
            .ok_or_else(|| {
                DataError::invalid(root, "no annotations/trainval.txt or annotations/list.txt")
            })?;
        let text = std::fs::read_to_string(&list).map_err(DataError::io("reading", &list))?;
        let names = text
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .filter_map(|l| l.split_whitespace().next())
            .map(str::to_string)
            .collect();
        Ok(Self {
            root: root.to_path_buf(),
            names,
        })
    }

    /// `images/<name>.jpg`.
    pub fn image_path(&self, name: &str) -> PathBuf {
        self.root.join("images").join(format!("{name}.jpg"))
    }

    /// `annotations/xmls/<name>.xml`.
    pub fn xml_path(&self, name: &str) -> PathBuf {
        self.root
            .join("annotations")
            .join("xmls")
            .join(format!("{name}.xml"))
    }

    /// The label map for `classes`: the species found in the XMLs, or the breeds of the listed
    /// names, sorted case-insensitively as the API's `pet_label_map.pbtxt`. Names that differ
    /// only in case (`Cat`, `cat`) are an error naming both and a file of each: they would
    /// silently become two classes. Annotations that do not load are left out here (preparing
    /// their images reports them).
    pub fn label_map(&self, classes: ClassSource) -> Result<LabelMap> {
        // every class name with the first file it appears in
        let mut found: BTreeMap<String, PathBuf> = BTreeMap::new();
        for n in &self.names {
            match classes {
                ClassSource::Breeds => {
                    if let Some(breed) = breed_from_filename(n) {
                        found
                            .entry(breed.to_string())
                            .or_insert_with(|| self.image_path(n));
                    }
                }
                ClassSource::Species => {
                    let xml = self.xml_path(n);
                    for o in VocAnnotation::load(&xml).map_or(Vec::new(), |a| a.objects) {
                        found.entry(o.name).or_insert_with(|| xml.clone());
                    }
                }
            }
        }
        let mut by_lowercase: BTreeMap<String, (String, PathBuf)> = BTreeMap::new();
        for (name, file) in found {
            if let Some((other, other_file)) = by_lowercase.get(&name.to_lowercase()) {
                return Err(DataError::invalid(
                    &file,
                    format!(
                        "class {name:?} differs from class {other:?} (in {}) only in case: \
                         correct the spelling, or give a label map that lists both",
                        other_file.display()
                    ),
                ));
            }
            by_lowercase.insert(name.to_lowercase(), (name, file));
        }
        let names: Vec<String> = by_lowercase.into_values().map(|(n, _)| n).collect();
        Ok(LabelMap::from_names(&names))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const XML: &str = r#"<annotation>
  <folder>OXIIIT</folder><filename>Abyssinian_1.jpg</filename>
  <size><width>600</width><height>400</height><depth>3</depth></size>
  <object><name>cat</name><pose>Frontal</pose><truncated>0</truncated><occluded>0</occluded>
    <bndbox><xmin>333</xmin><ymin>72</ymin><xmax>425</xmax><ymax>158</ymax></bndbox><difficult>0</difficult></object>
  <object><name>cat</name><truncated>1</truncated><difficult>1</difficult>
    <bndbox><xmin>500</xmin><ymin>300</ymin><xmax>700</xmax><ymax>450</ymax></bndbox></object>
  <object><name>cat</name><bndbox><xmin>50</xmin><ymin>10</ymin><xmax>40</xmax><ymax>20</ymax></bndbox></object>
</annotation>"#;

    #[test]
    fn parses_voc_xml() {
        let a = VocAnnotation::parse(XML, Path::new("a.xml")).unwrap();
        assert_eq!((a.width, a.height, a.objects.len()), (600, 400, 3));
        assert_eq!(a.objects[0].bndbox, (333.0, 72.0, 425.0, 158.0));
        assert_eq!(a.objects[0].pose, "Frontal");
        assert!(a.objects[1].truncated && a.objects[1].difficult);
        let err = VocAnnotation::parse("<annotation><size>", Path::new("bad.xml"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("bad.xml") && err.contains("malformed XML"),
            "{err}"
        );
        let err = VocAnnotation::parse(
            "<annotation><size><width>x</width></size></annotation>",
            Path::new("b.xml"),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("<width>"), "{err}");
    }

    #[test]
    fn breeds_from_file_names() {
        assert_eq!(breed_from_filename("Abyssinian_12.jpg"), Some("Abyssinian"));
        assert_eq!(
            breed_from_filename("american_pit_bull_terrier_101.jpg"),
            Some("american_pit_bull_terrier")
        );
        assert_eq!(breed_from_filename("noisy.jpg"), None);
    }
}
