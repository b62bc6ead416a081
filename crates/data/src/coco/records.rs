//! One image of a COCO file and its annotations as a detection example.

use std::path::Path;

use crate::example::{DetectionExample, EvalObject, Object, sha256_hex};
use crate::validate::check_objects;
use crate::voc::{CleanupReport, load_image_as_jpeg, normalised_box};

use super::categories::Categories;
use super::json::{AnnotationEntry, ImageEntry};

/// An image's example and what was done to write it.
#[derive(Debug)]
pub(crate) struct Record {
    /// The example, its objects those to train on.
    pub example: DetectionExample,
    /// Every object written, crowd regions included, in the file's order.
    pub objects: Vec<EvalObject>,
    pub cleanup: CleanupReport,
    /// Crowd regions written.
    pub crowd: usize,
}

/// The example of `image` (its file under `dir`) with `annotations`: the image decoded
/// completely (re-encoded as an RGB JPEG when it is not one) and its size equal to the one
/// in the file; boxes normalised, clipped or dropped (counted); each object with its `area`
/// (the box's where the annotation has none); crowd regions kept as the API's
/// `create_coco_tf_record.py` keeps them, marked `is_crowd`, for evaluation only (training
/// leaves them out, as torchvision's and mmdetection's COCO readers do). The error says
/// what is wrong with the image.
pub(crate) fn image_record(
    image: &ImageEntry,
    annotations: &[AnnotationEntry],
    dir: &Path,
    categories: &Categories,
) -> Result<Record, String> {
    let path = dir.join(&image.file_name);
    let (encoded, width, height, reencoded) =
        load_image_as_jpeg(&path).map_err(|e| e.to_string())?;
    if (width, height) != (image.width, image.height) {
        return Err(format!(
            "`width` x `height` is {}x{}, but {} is {width}x{height} (boxes would be \
             normalised by the wrong size)",
            image.width,
            image.height,
            path.display()
        ));
    }
    let mut cleanup = CleanupReport {
        reencoded: usize::from(reencoded),
        ..Default::default()
    };
    let mut objects = Vec::with_capacity(annotations.len());
    for a in annotations {
        let Some(bbox) = normalised_box(a.bbox, width, height, &mut cleanup) else {
            continue;
        };
        // the plan keeps only annotations of known categories
        let Some(category) = categories.get(a.category_id) else {
            return Err(format!("{}: unknown `category_id`", a.name()));
        };
        objects.push(EvalObject {
            object: Object {
                bbox,
                class_text: category.name.clone(),
                label: category.label,
                difficult: false,
                truncated: false,
                view: String::new(),
            },
            crowd: a.crowd,
            area: Some(a.area.unwrap_or_else(|| a.bbox.area())),
        });
    }
    let crowd = objects.iter().filter(|o| o.crowd).count();
    let example = DetectionExample {
        sha256: sha256_hex(&encoded),
        encoded,
        format: "jpeg".into(),
        height: i64::from(height),
        width: i64::from(width),
        filename: image.file_name.clone(),
        // as the API's create_coco_tf_record.py writes it
        source_id: image.id.to_string(),
        objects: EvalObject::objects(&objects, false),
    };
    let num_classes = categories.num_classes() as usize;
    check_objects(&example, Some(num_classes))?;
    Ok(Record {
        example,
        objects,
        cleanup,
        crowd,
    })
}
