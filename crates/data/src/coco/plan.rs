//! The checks that need the whole file: image and annotation ids seen twice, annotations
//! whose image or category does not exist. What passes is grouped by image for writing.

use std::collections::{HashMap, HashSet};

use super::categories::Categories;
use super::json::{AnnotationEntry, BadEntry, CocoJson, ImageEntry};

/// The images to write and their annotations.
#[derive(Debug)]
pub(crate) struct Plan {
    /// The images, in the file's order.
    pub images: Vec<ImageEntry>,
    /// Their annotations, sorted by image id and then by place in the file.
    annotations: Vec<AnnotationEntry>,
    /// Invalid entries skipped (with `skip_invalid`), with the reason.
    pub skipped: Vec<(String, String)>,
    /// Images left out because they, or an annotation on them, are invalid.
    pub images_skipped: usize,
}

/// Collects the invalid entries: all of them with `skip_invalid`, else the first (the caller
/// stops there).
struct Problems {
    skip_invalid: bool,
    list: Vec<BadEntry>,
}

impl Problems {
    fn add(&mut self, what: String, image_id: Option<u64>, problem: String) {
        if self.skip_invalid || self.list.is_empty() {
            self.list.push(BadEntry {
                what,
                image_id,
                problem,
            });
        }
    }

    /// The first problem as an error, when they are not skipped.
    fn stop(&self) -> Result<(), BadEntry> {
        match self.list.first() {
            Some(first) if !self.skip_invalid => Err(first.clone()),
            _ => Ok(()),
        }
    }
}

impl Plan {
    /// Checks the references of `file` against each other and `categories`. An image id
    /// twice keeps the first entry; an annotation id twice keeps the first annotation; an
    /// annotation that is invalid (read so, seen twice, of an unknown category) leaves its
    /// image out, since its object would otherwise be trained as background. Without
    /// `skip_invalid` the first invalid entry is the error.
    pub fn build(
        file: CocoJson,
        categories: &Categories,
        skip_invalid: bool,
    ) -> Result<Self, BadEntry> {
        let mut problems = Problems {
            skip_invalid,
            list: file.bad,
        };
        problems.stop()?;
        let images = unique_images(file.images, &mut problems);
        problems.stop()?;
        let known: HashSet<u64> = images.iter().map(|im| im.id).collect();
        let mut annotations = file.annotations;
        check_annotations(&mut annotations, &known, categories, &mut problems);
        problems.stop()?;
        // an invalid image entry or annotation takes its image with it
        let left_out: HashSet<u64> = problems.list.iter().filter_map(|b| b.image_id).collect();
        annotations.retain(|a| !left_out.contains(&a.image_id));
        annotations.sort_unstable_by_key(|a| (a.image_id, a.index));
        let images: Vec<ImageEntry> = images
            .into_iter()
            .filter(|im| !left_out.contains(&im.id))
            .collect();
        Ok(Self {
            images_skipped: file.images_listed - images.len(),
            images,
            annotations,
            skipped: problems
                .list
                .into_iter()
                .map(|b| (b.what, b.problem))
                .collect(),
        })
    }

    /// The annotations of image `id`, in the file's order.
    pub fn annotations_of(&self, id: u64) -> &[AnnotationEntry] {
        let start = self.annotations.partition_point(|a| a.image_id < id);
        let end = self.annotations.partition_point(|a| a.image_id <= id);
        &self.annotations[start..end]
    }
}

/// The images whose id has not been seen before in the list.
fn unique_images(images: Vec<ImageEntry>, problems: &mut Problems) -> Vec<ImageEntry> {
    let mut first: HashMap<u64, usize> = HashMap::with_capacity(images.len());
    let mut unique = Vec::with_capacity(images.len());
    for im in images {
        match first.get(&im.id) {
            Some(j) => problems.add(
                im.name(),
                None,
                format!("image id {} appears twice (also images[{j}])", im.id),
            ),
            None => {
                first.insert(im.id, im.index);
                unique.push(im);
            }
        }
    }
    unique
}

/// Removes the annotations whose id was seen before, whose image is not one of `known` or
/// whose category is unknown, recording each.
fn check_annotations(
    annotations: &mut Vec<AnnotationEntry>,
    known: &HashSet<u64>,
    categories: &Categories,
    problems: &mut Problems,
) {
    // sorted by id, a repeated id follows its first use
    annotations.sort_unstable_by_key(|a| (a.id, a.index));
    let mut previous: Option<AnnotationEntry> = None;
    annotations.retain(|a| {
        let repeated = previous.filter(|p| p.id == a.id);
        if repeated.is_none() {
            previous = Some(*a);
        }
        let (image, problem) = if let Some(p) = repeated {
            let also = p.index;
            let problem = format!(
                "annotation id {} appears twice (also annotations[{also}])",
                a.id
            );
            (Some(a.image_id), problem)
        } else if !known.contains(&a.image_id) {
            let problem = format!("`image_id` {} is not one of the images", a.image_id);
            (None, problem)
        } else if categories.get(a.category_id).is_none() {
            let problem = format!(
                "`category_id` {} is not one of the categories (ids {})",
                a.category_id,
                id_list(categories)
            );
            (Some(a.image_id), problem)
        } else {
            return true;
        };
        problems.add(a.name(), image, problem);
        false
    });
}

/// The category ids, shortened when there are many.
fn id_list(categories: &Categories) -> String {
    let mut ids: Vec<i64> = categories.items.iter().map(|c| c.coco_id).collect();
    ids.sort_unstable();
    let shown: Vec<String> = ids.iter().take(12).map(i64::to_string).collect();
    let more = ids.len().saturating_sub(shown.len());
    if more > 0 {
        format!("{}, ... {more} more", shown.join(", "))
    } else {
        shown.join(", ")
    }
}
