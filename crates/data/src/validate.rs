//! The checks every record passes where it enters: the training loader, evaluation and
//! `prepare-data` (from VOC / Oxford-IIIT Pet folders and from TFRecords) all use these, so a
//! bad label, box or image is an error naming the file, the record, the field and the value
//! instead of a NaN loss, a one-hot target in another anchor's row, or a grey half-image.
//!
//! Where the API is lenient the checks are stricter on purpose: its input pipeline silently
//! drops boxes with NaN coordinates and objects whose class is unknown, and turns a label
//! outside `1..=num_classes` into an all-zero (background) target; here each is an error.

use image::DynamicImage;

use crate::error::Result;
use crate::example::DetectionExample;
use crate::images::decode_image;
use crate::tfrecord::RecordIndex;

/// How far a normalised coordinate may lie outside `[0, 1]` and still be accepted (1% of the
/// image side: float rounding and the off-by-one-pixel conventions of converters). Such a
/// coordinate is kept as it is, as the API keeps it; a larger excess is an error, as it
/// usually means pixel coordinates were written instead of normalised ones.
pub const BOX_TOLERANCE: f32 = 0.01;

/// Checks the objects of an example: every label in `1..=num_classes` (only `>= 1` when the
/// number of classes is unknown), every box finite, not inverted and within `[0, 1]` (up to
/// [`BOX_TOLERANCE`]). The error names the object, the field and the value.
pub fn check_objects(
    example: &DetectionExample,
    num_classes: Option<usize>,
) -> std::result::Result<(), String> {
    for (i, o) in example.objects.iter().enumerate() {
        check_label(o.label, num_classes).map_err(|e| format!("object {i}: {e}"))?;
        let b = o.bbox;
        let coordinates = [
            ("ymin", b.ymin),
            ("xmin", b.xmin),
            ("ymax", b.ymax),
            ("xmax", b.xmax),
        ];
        for (name, v) in coordinates {
            if !v.is_finite() {
                return Err(format!("object {i}: `image/object/bbox/{name}` is {v}"));
            }
            if !(-BOX_TOLERANCE..=1.0 + BOX_TOLERANCE).contains(&v) {
                return Err(format!(
                    "object {i}: `image/object/bbox/{name}` is {v}, outside [0, 1] \
                     (boxes are normalised to the image size)"
                ));
            }
        }
        for (lo, hi, a, z) in [
            ("ymin", "ymax", b.ymin, b.ymax),
            ("xmin", "xmax", b.xmin, b.xmax),
        ] {
            if a > z {
                return Err(format!(
                    "object {i}: inverted box: `image/object/bbox/{lo}` {a} is greater than \
                     `image/object/bbox/{hi}` {z}"
                ));
            }
        }
    }
    Ok(())
}

fn check_label(label: i64, num_classes: Option<usize>) -> std::result::Result<(), String> {
    let field = "`image/object/class/label`";
    let range = num_classes.map_or("labels start at 1".to_string(), |n| {
        format!("labels run from 1 to num_classes {n}")
    });
    if label < 1 {
        let background = if label == 0 {
            " (0 is the background)"
        } else {
            ""
        };
        return Err(format!("{field} is {label}{background}; {range}"));
    }
    if let Some(n) = num_classes.filter(|&n| label as u64 > n as u64) {
        return Err(format!("{field} is {label}, above num_classes {n}"));
    }
    Ok(())
}

/// Reads record `i` of `index`, decodes the `tf.train.Example` and its image completely and
/// checks its objects ([`check_objects`]). Errors name the file, the record's number in it
/// and its byte offset.
pub fn read_checked(
    index: &RecordIndex,
    i: usize,
    num_classes: Option<usize>,
) -> Result<(DetectionExample, DynamicImage)> {
    let at_record = |problem: String| index.record_error(i, problem);
    let example =
        DetectionExample::decode(&index.read(i)?).map_err(|e| at_record(e.to_string()))?;
    check_objects(&example, num_classes).map_err(at_record)?;
    let (image, _) = decode_image(&example.encoded)
        .map_err(|e| at_record(format!("`image/encoded` cannot be decoded: {e}")))?;
    Ok((example, image))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::example::Object;
    use model::BBox;

    fn with(label: i64, bbox: BBox) -> DetectionExample {
        DetectionExample {
            objects: vec![
                Object {
                    bbox: BBox::new(0.1, 0.1, 0.5, 0.5),
                    class_text: "cat".into(),
                    label: 1,
                    difficult: false,
                    truncated: false,
                    view: String::new(),
                },
                Object {
                    bbox,
                    class_text: "dog".into(),
                    label,
                    difficult: false,
                    truncated: false,
                    view: String::new(),
                },
            ],
            ..Default::default()
        }
    }

    fn good_box() -> BBox {
        BBox::new(0.2, 0.3, 0.6, 0.7)
    }

    #[test]
    fn labels_outside_the_classes_are_named() {
        let check = |label, n| check_objects(&with(label, good_box()), n);
        assert_eq!(check(2, Some(2)), Ok(()));
        assert_eq!(check(7, None), Ok(()));
        let cases = [
            (
                3,
                Some(2),
                "object 1: `image/object/class/label` is 3, above num_classes 2",
            ),
            (
                1000,
                Some(2),
                "object 1: `image/object/class/label` is 1000, above num_classes 2",
            ),
            (
                0,
                Some(2),
                "object 1: `image/object/class/label` is 0 (0 is the background); labels run \
                 from 1 to num_classes 2",
            ),
            (
                -1,
                Some(2),
                "object 1: `image/object/class/label` is -1; labels run from 1 to num_classes 2",
            ),
            (
                0,
                None,
                "object 1: `image/object/class/label` is 0 (0 is the background); labels start at 1",
            ),
        ];
        for (label, n, want) in cases {
            assert_eq!(check(label, n), Err(want.to_string()), "{label}");
        }
    }

    #[test]
    fn bad_boxes_are_named() {
        let check = |b| check_objects(&with(1, b), Some(2));
        // slightly outside [0, 1]: kept, as the API keeps it
        assert_eq!(check(BBox::new(-0.005, 0.0, 1.0, 1.009)), Ok(()));
        // empty boxes are not errors (the loader drops boxes without area)
        assert_eq!(check(BBox::new(0.5, 0.5, 0.5, 0.5)), Ok(()));
        let cases = [
            (
                BBox::new(f32::NAN, 0.1, 0.5, 0.5),
                "object 1: `image/object/bbox/ymin` is NaN",
            ),
            (
                BBox::new(0.1, 0.1, 0.5, f32::INFINITY),
                "object 1: `image/object/bbox/xmax` is inf",
            ),
            (
                BBox::new(0.1, f32::NEG_INFINITY, 0.5, 0.5),
                "object 1: `image/object/bbox/xmin` is -inf",
            ),
            (
                BBox::new(0.1, 0.1, 0.5, 425.0),
                "object 1: `image/object/bbox/xmax` is 425, outside [0, 1] (boxes are \
                 normalised to the image size)",
            ),
            (
                BBox::new(-0.2, 0.1, 0.5, 0.5),
                "object 1: `image/object/bbox/ymin` is -0.2, outside [0, 1] (boxes are \
                 normalised to the image size)",
            ),
            (
                BBox::new(0.6, 0.1, 0.5, 0.5),
                "object 1: inverted box: `image/object/bbox/ymin` 0.6 is greater than \
                 `image/object/bbox/ymax` 0.5",
            ),
            (
                BBox::new(0.1, 0.9, 0.5, 0.2),
                "object 1: inverted box: `image/object/bbox/xmin` 0.9 is greater than \
                 `image/object/bbox/xmax` 0.2",
            ),
        ];
        for (b, want) in cases {
            assert_eq!(check(b), Err(want.to_string()), "{b:?}");
        }
    }
}
