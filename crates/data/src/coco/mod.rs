//! COCO annotation files (`instances_train2017.json`, and what torchvision, mmdetection and
//! labelling tools such as CVAT, Label Studio and Roboflow export) prepared as sharded
//! TFRecords with the API's keys, one split per call: `OUT/<split>.record-*`, with
//! `label_map.pbtxt` from the categories and `manifest.json` holding every split prepared
//! into `OUT`.
//!
//! The file is read in one pass keeping a few dozen bytes per annotation ([`json`]); the
//! references are checked once it is read (`plan`); then the images are decoded and written
//! a few at a time on every core, in the file's order (`records`).

mod categories;
mod json;
mod plan;
mod records;

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::error::{DataError, Result};
use crate::prepare::{SplitSummary, check_num_shards, count_objects, replace_set, write_text};
use crate::shards::{ClosedShards, ShardedWriter};
use crate::voc::{CleanupReport, normalised_box};

pub use categories::{Categories, Category};
pub use json::{crowd_flag, pixel_box};

use json::{CocoJson, ImageEntry};
use plan::Plan;
use records::image_record;

/// How a COCO file is prepared.
#[derive(Debug, Clone)]
pub struct CocoOptions {
    /// The folder the images' `file_name`s are relative to.
    pub images: PathBuf,
    /// The split written, `OUT/<split>.record-*`: letters, digits, `_` and `-`.
    pub split: String,
    /// Shards of the split.
    pub num_shards: usize,
    /// Map the category ids to 1..=K in the order of `categories` even when they are valid
    /// label-map ids (ids starting at 0 are always mapped).
    pub contiguous_ids: bool,
    /// Leave out images without any object to train on (no annotation, or only crowd regions
    /// and boxes without area) instead of writing them as negatives.
    pub skip_empty: bool,
    /// Skip (and count) invalid images and annotations instead of stopping at the first.
    pub skip_invalid: bool,
}

/// What the preparation of one split did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CocoSummary {
    /// Images and objects written, and the shard files.
    #[serde(flatten)]
    pub written: SplitSummary,
    /// Images re-encoded, boxes clipped or dropped.
    pub cleanup: CleanupReport,
    /// Crowd regions (`iscrowd: 1`) written: `image/object/is_crowd` marks them, evaluation
    /// ignores the detections on them and training never sees them.
    pub crowd_regions: usize,
    /// Images without any object to train on: no annotation, or only crowd regions and boxes
    /// without area (written as negatives unless skipped).
    pub empty_images: usize,
    /// Of those, left out with `skip_empty`.
    pub empty_skipped: usize,
    /// Images left out as invalid, or for an invalid annotation (with `skip_invalid`).
    pub images_skipped: usize,
    /// Every invalid entry skipped, with the reason.
    pub skipped: Vec<(String, String)>,
}

/// The result of [`prepare_coco`].
#[derive(Debug, Clone)]
pub struct CocoPrepared {
    /// The output folder.
    pub out: PathBuf,
    /// The split written.
    pub split: String,
    /// What was written and skipped.
    pub summary: CocoSummary,
    /// The classes, with the label each category id was written with.
    pub categories: Categories,
}

/// Prepares the split `options.split` of `out` from the COCO file `annotations`. Boxes
/// `[x, y, w, h]` become normalised corners, clipped to the image or dropped when no area is
/// left (counted); every object keeps its `area` (`image/object/area`, the box's where the
/// annotation has none); crowd regions are written for evaluation only
/// (`image/object/is_crowd`: never trained on), counted; images without any object to train
/// on are written as negatives (or left out with `skip_empty`), counted. An image or annotation
/// whose fields are missing or malformed, an id seen twice, an annotation of an unknown image
/// or category, an image file missing, not decoding completely or of another size than the
/// file says is an error naming the entry, or with `skip_invalid` skipped and counted (an
/// invalid annotation takes its image with it). Other splits already prepared into `out` stay,
/// if their categories are the same. The split's older shards are replaced only once the new
/// ones are complete.
pub fn prepare_coco(
    annotations: &Path,
    out: &Path,
    options: &CocoOptions,
    progress: &(dyn Fn(&str, u64) + Sync),
) -> Result<CocoPrepared> {
    check_split_name(&options.split, out)?;
    let file = CocoJson::read(annotations, options.skip_invalid)?;
    let categories = Categories::parse(&file.categories, options.contiguous_ids)
        .map_err(|problem| DataError::invalid(annotations, problem))?;
    let plan = Plan::build(file, &categories, options.skip_invalid)
        .map_err(|bad| invalid_entry(annotations, &bad.what, bad.problem))?;
    let classes = class_record(&categories);
    let mut manifest = Manifest::open(out, &options.split, &classes)?;
    // no object to train on: no annotation, or crowd regions and boxes dropped only
    let is_empty = |im: &&ImageEntry| {
        !plan.annotations_of(im.id).iter().any(|a| {
            let mut counted = CleanupReport::default();
            !a.crowd && normalised_box(a.bbox, im.width, im.height, &mut counted).is_some()
        })
    };
    let empty_images = plan.images.iter().filter(is_empty).count();
    let work: Vec<&ImageEntry> = plan
        .images
        .iter()
        .filter(|im| !(options.skip_empty && is_empty(im)))
        .collect();
    check_num_shards(options.num_shards, work.len(), &options.split, annotations)?;
    std::fs::create_dir_all(out).map_err(DataError::io("creating", out))?;
    let base = out.join(format!("{}.record", options.split));
    let (mut summary, shards) = write_images(&plan, &work, &categories, options, &base, progress)
        .map_err(|e| match e {
        WriteError::Entry(what, problem) => invalid_entry(annotations, &what, problem),
        WriteError::Data(e) => e,
    })?;
    if summary.written.images == 0 {
        return Err(DataError::invalid(annotations, "no image left to write"));
    }
    summary.empty_images = empty_images;
    summary.empty_skipped = plan.images.len() - work.len();
    summary.images_skipped += plan.images_skipped;
    summary.skipped.splice(0..0, plan.skipped);
    let written = summary.written.clone();
    let mut committed = replace_set(out, vec![(options.split.clone(), written, shards)])?;
    summary.written = committed.remove(&options.split).unwrap_or_default();
    write_text(
        &out.join("label_map.pbtxt"),
        &categories.label_map().to_pbtxt(),
    )?;
    let request = json!({
        "annotations": annotations.display().to_string(),
        "images": options.images.display().to_string(),
        "num_shards": options.num_shards,
        "contiguous_ids": options.contiguous_ids,
        "skip_empty": options.skip_empty,
        "skip_invalid": options.skip_invalid,
    });
    manifest.add(&options.split, request, &summary);
    manifest.write(out, classes)?;
    Ok(CocoPrepared {
        out: out.to_path_buf(),
        split: options.split.clone(),
        summary,
        categories,
    })
}

/// An invalid entry as the error that `--skip-invalid` would skip.
fn invalid_entry(annotations: &Path, what: &str, problem: String) -> DataError {
    DataError::InvalidExample(Box::new(DataError::invalid(
        annotations,
        format!("{what}: {problem}"),
    )))
}

fn check_split_name(split: &str, out: &Path) -> Result<()> {
    let ok = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if split.is_empty() || !split.chars().all(ok) {
        return Err(DataError::invalid(
            out,
            format!(
                "split name {split:?}: letters, digits, `_` and `-` only (it names the shard files)"
            ),
        ));
    }
    Ok(())
}

/// Why writing stopped: an invalid image (the error names it) or a file that could not be
/// written.
enum WriteError {
    Entry(String, String),
    Data(DataError),
}

impl From<DataError> for WriteError {
    fn from(e: DataError) -> Self {
        Self::Data(e)
    }
}

/// Writes the examples of `images` in their order, decoding a few images per core at a time
/// so that memory holds only those.
fn write_images(
    plan: &Plan,
    images: &[&ImageEntry],
    categories: &Categories,
    options: &CocoOptions,
    base: &Path,
    progress: &(dyn Fn(&str, u64) + Sync),
) -> std::result::Result<(CocoSummary, ClosedShards), WriteError> {
    let mut writer = ShardedWriter::create(base, options.num_shards)?;
    let mut summary = CocoSummary::default();
    for chunk in images.chunks(8 * rayon::current_num_threads()) {
        let records: Vec<_> = chunk
            .par_iter()
            .map(|im| image_record(im, plan.annotations_of(im.id), &options.images, categories))
            .collect();
        for (image, record) in chunk.iter().zip(records) {
            match record {
                Ok(r) => {
                    writer.write(&r.example.encode_with(&r.objects))?;
                    count_objects(&r.example, &mut summary.written.objects);
                    summary.cleanup.add(&r.cleanup);
                    summary.crowd_regions += r.crowd;
                }
                Err(problem) if options.skip_invalid => {
                    summary.images_skipped += 1;
                    summary.skipped.push((image.name(), problem));
                }
                Err(problem) => return Err(WriteError::Entry(image.name(), problem)),
            }
        }
        progress(&options.split, chunk.len() as u64);
    }
    summary.written.images = writer.len();
    Ok((summary, writer.close()?))
}

/// The classes as the manifest records them: the names in label order, the label of each
/// category id, the largest label.
fn class_record(categories: &Categories) -> Map<String, Value> {
    let label_ids: Map<String, Value> = categories
        .items
        .iter()
        .map(|c| (c.coco_id.to_string(), json!(c.label)))
        .collect();
    let mut record = Map::new();
    record.insert("classes".into(), json!(categories.label_map().names()));
    record.insert("label_ids".into(), Value::Object(label_ids));
    record.insert("num_classes".into(), json!(categories.num_classes()));
    record
}

/// `manifest.json` of a folder of COCO splits: each split's request and summary, and the
/// classes they share.
struct Manifest {
    requests: Map<String, Value>,
    summaries: Map<String, Value>,
}

impl Manifest {
    /// The splits other than `split` that `out` holds. A manifest of another source, or of
    /// splits with other classes, is an error: their shards would not match the label map.
    fn open(out: &Path, split: &str, classes: &Map<String, Value>) -> Result<Self> {
        let path = out.join("manifest.json");
        let mut manifest = Self {
            requests: Map::new(),
            summaries: Map::new(),
        };
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(manifest),
            Err(e) => return Err(DataError::io("reading", &path)(e)),
        };
        let old: Value = serde_json::from_str(&text).map_err(|e| {
            DataError::invalid(
                &path,
                format!("not JSON ({e}); remove it or use another --out"),
            )
        })?;
        if old["request"]["source"] != "coco" {
            return Err(DataError::invalid(
                &path,
                "the folder holds a set prepared from another source: prepare COCO files into \
                 another --out",
            ));
        }
        let take = |key: &str| match &old[key]["splits"] {
            Value::Object(m) => m.clone(),
            _ => Map::new(),
        };
        manifest.requests = take("request");
        manifest.summaries = take("summary");
        manifest.requests.remove(split);
        manifest.summaries.remove(split);
        let same = classes.iter().all(|(key, value)| old[key] == *value);
        if !manifest.requests.is_empty() && !same {
            let others: Vec<&String> = manifest.requests.keys().collect();
            return Err(DataError::invalid(
                &path,
                format!(
                    "split(s) {others:?} were prepared from other categories than these \
                     (labels and names as in label_ids and classes): prepare every split of a \
                     folder from files with the same categories, or use another --out"
                ),
            ));
        }
        Ok(manifest)
    }

    fn add(&mut self, split: &str, request: Value, summary: &CocoSummary) {
        self.requests.insert(split.to_string(), request);
        self.summaries.insert(split.to_string(), json!(summary));
    }

    fn write(self, out: &Path, classes: Map<String, Value>) -> Result<()> {
        let mut manifest = classes;
        manifest.insert(
            "request".into(),
            json!({"source": "coco", "splits": self.requests}),
        );
        manifest.insert("summary".into(), json!({"splits": self.summaries}));
        write_text(
            &out.join("manifest.json"),
            &serde_json::to_string_pretty(&manifest).expect("JSON"),
        )
    }
}
