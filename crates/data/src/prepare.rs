//! Dataset preparation: the synthetic set and PASCAL VOC / Oxford-IIIT Pet folders written as
//! sharded TFRecords plus `label_map.pbtxt` and `manifest.json`, every file written atomically
//! (COCO files: [`crate::coco`], with the helpers here).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use serde::Serialize;
use serde_json::json;

use crate::error::{DataError, Result};
use crate::example::DetectionExample;
use crate::label_map::LabelMap;
use crate::shards::{ClosedShards, ShardedWriter};
use crate::synthetic::{CLASSES, generate};
use crate::validate::check_objects;
use crate::voc::{ClassSource, CleanupReport, PetLayout, VocAnnotation, voc_example};

/// What was written for one split.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SplitSummary {
    /// Images written.
    pub images: usize,
    /// Objects per class name.
    pub objects: BTreeMap<String, usize>,
    /// The shard files.
    pub files: Vec<PathBuf>,
}

/// What a preparation did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PrepareSummary {
    /// The output folder.
    pub out: PathBuf,
    /// `train` and `val`.
    pub splits: BTreeMap<String, SplitSummary>,
    /// Fixes applied to the source data.
    pub cleanup: CleanupReport,
    /// Skipped images with the reason.
    pub skipped: Vec<(String, String)>,
    /// How many of the skipped images were invalid (skipped with `skip_invalid`); the others
    /// had no annotation file.
    pub invalid: usize,
}

pub(crate) fn write_text(path: &Path, text: &str) -> Result<()> {
    model::io::write_atomic(path, text.as_bytes()).map_err(DataError::io("writing", path))
}

pub(crate) fn count_objects(e: &DetectionExample, counts: &mut BTreeMap<String, usize>) {
    for o in &e.objects {
        *counts.entry(o.class_text.clone()).or_default() += 1;
    }
}

fn write_manifest(
    out: &Path,
    request: serde_json::Value,
    classes: Vec<String>,
    summary: &PrepareSummary,
) -> Result<()> {
    let manifest = json!({"request": request, "classes": classes, "summary": summary});
    write_text(
        &out.join("manifest.json"),
        &serde_json::to_string_pretty(&manifest).expect("JSON"),
    )
}

/// True when `out/manifest.json` records the same request (so re-running can be skipped).
pub fn is_prepared(out: &Path, request: &serde_json::Value) -> bool {
    std::fs::read_to_string(out.join("manifest.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|m| m.get("request") == Some(request))
}

/// The request record of a synthetic preparation.
pub fn synthetic_request(seed: u64, train: u64, val: u64, num_shards: usize) -> serde_json::Value {
    json!({"source": "synthetic", "seed": seed, "train": train, "val": val, "num_shards": num_shards})
}

/// A split (`what`: "training") of `records` records in `num_shards` shards: at least one
/// shard, and no more than records (the rest would be empty).
pub(crate) fn check_num_shards(
    num_shards: usize,
    records: usize,
    what: &str,
    source: &Path,
) -> Result<()> {
    if num_shards == 0 {
        return Err(DataError::invalid(
            source,
            format!("num_shards 0: the {what} split needs at least one shard"),
        ));
    }
    if num_shards > records {
        return Err(DataError::invalid(
            source,
            format!(
                "num_shards {num_shards} is more than the {records} {what} records \
                 (shards would be empty)"
            ),
        ));
    }
    Ok(())
}

/// A split written under temporary names, waiting to replace the older set.
pub(crate) type ClosedSplit = (String, SplitSummary, ClosedShards);

/// Replaces the older set of `out` with the closed splits: the old `manifest.json` goes first
/// (so an interruption during the renames leaves a set that reads as not prepared), then
/// every split's shards are renamed into place and older shards of the same names removed.
pub(crate) fn replace_set(
    out: &Path,
    splits: Vec<ClosedSplit>,
) -> Result<BTreeMap<String, SplitSummary>> {
    let manifest = out.join("manifest.json");
    match std::fs::remove_file(&manifest) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(DataError::io("removing", &manifest)(e));
        }
        _ => {}
    }
    let mut summaries = BTreeMap::new();
    for (split, mut summary, shards) in splits {
        summary.files = shards.commit()?;
        summaries.insert(split, summary);
    }
    Ok(summaries)
}

/// Where `cargo xtask prepare-data` writes the synthetic set, and where
/// `configs/synthetic.json` reads it.
pub const SYNTHETIC_DIR: &str = "datasets/synthetic";

/// Writes the synthetic cats-and-dogs set: `train` images in `num_shards` shards and `val`
/// images (indices after the training ones) in one shard. `progress` gets the images done.
/// An older set in `out` is replaced only once the new one is complete.
pub fn prepare_synthetic(
    out: &Path,
    seed: u64,
    train: u64,
    val: u64,
    num_shards: usize,
    progress: &(dyn Fn(&str, u64) + Sync),
) -> Result<PrepareSummary> {
    check_num_shards(num_shards, train as usize, "training", out)?;
    std::fs::create_dir_all(out).map_err(DataError::io("creating", out))?;
    let mut closed = Vec::new();
    for (split, first, count, shards) in [("train", 0, train, num_shards), ("val", train, val, 1)] {
        let mut writer = ShardedWriter::create(&out.join(format!("{split}.record")), shards)?;
        let mut split_summary = SplitSummary::default();
        let chunk = 64;
        for start in (first..first + count).step_by(chunk) {
            let end = (start + chunk as u64).min(first + count);
            for e in &generate_examples(seed, start..end) {
                writer.write(&e.encode())?;
                count_objects(e, &mut split_summary.objects);
            }
            progress(split, end - start);
        }
        split_summary.images = writer.len();
        closed.push((split.to_string(), split_summary, writer.close()?));
    }
    let summary = PrepareSummary {
        out: out.to_path_buf(),
        splits: replace_set(out, closed)?,
        ..Default::default()
    };
    write_text(
        &out.join("label_map.pbtxt"),
        &LabelMap::from_names(&CLASSES).to_pbtxt(),
    )?;
    let classes = CLASSES.iter().map(|c| c.to_string()).collect();
    write_manifest(
        out,
        synthetic_request(seed, train, val, num_shards),
        classes,
        &summary,
    )?;
    Ok(summary)
}

/// The synthetic examples of `indices`, drawn on every core.
fn generate_examples(seed: u64, indices: std::ops::Range<u64>) -> Vec<DetectionExample> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let per = (indices.end - indices.start).div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let a = indices.start + t * per;
                let b = (a + per).min(indices.end);
                s.spawn(move || {
                    (a..b)
                        .map(|i| generate(seed, i).to_example(i))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("generator thread"))
            .collect()
    })
}

/// How a VOC / Oxford-IIIT Pet folder is prepared.
#[derive(Debug, Clone)]
pub struct VocOptions {
    /// Where class names come from.
    pub classes: ClassSource,
    /// The label map to use instead of one made from the names found; every class name
    /// must be in it.
    pub label_map: Option<LabelMap>,
    /// Seed of the train/val split.
    pub seed: u64,
    /// Shards of the training split.
    pub num_shards: usize,
    /// Skip (and count) invalid images and annotations instead of stopping at the first.
    pub skip_invalid: bool,
}

/// Converts an Oxford-IIIT Pet / VOC folder: the listed names shuffled with `seed`, 70% train
/// (in `num_shards` shards) and 30% val. Listed images without an annotation file are skipped
/// and reported, as the API's `create_pet_tf_record.py` does; an image that does not decode
/// completely, an annotation that does not parse (an object without a name, a coordinate that
/// is not a finite number) or a class outside the label map is an error naming the file, or,
/// with `skip_invalid`, skipped and counted. Odd image formats are re-encoded as JPEG; boxes
/// are clipped or dropped (counted). An older set in `out` is replaced only once the new one
/// is complete.
pub fn prepare_voc(
    root: &Path,
    out: &Path,
    options: &VocOptions,
    progress: &(dyn Fn(&str, u64) + Sync),
) -> Result<PrepareSummary> {
    let layout = PetLayout::open(root)?;
    let label_map = match &options.label_map {
        Some(map) => map.clone(),
        None => layout.label_map(options.classes)?,
    };
    if label_map.items.is_empty() {
        return Err(DataError::invalid(root, "no classes found"));
    }
    let mut names = layout.names.clone();
    names.shuffle(&mut StdRng::seed_from_u64(options.seed));
    let num_train = (0.7 * names.len() as f64) as usize;
    check_num_shards(options.num_shards, num_train, "training", root)?;
    std::fs::create_dir_all(out).map_err(DataError::io("creating", out))?;
    let mut summary = PrepareSummary {
        out: out.to_path_buf(),
        ..Default::default()
    };
    let mut closed = Vec::new();
    for (split, list, shards) in [
        ("train", &names[..num_train], options.num_shards),
        ("val", &names[num_train..], 1),
    ] {
        let mut writer = ShardedWriter::create(&out.join(format!("{split}.record")), shards)?;
        let mut split_summary = SplitSummary::default();
        for name in list {
            progress(split, 1);
            match voc_record(&layout, name, options, &label_map, &mut summary.cleanup) {
                Ok(Some(e)) => {
                    writer.write(&e.encode())?;
                    count_objects(&e, &mut split_summary.objects);
                }
                Ok(None) => summary.skipped.push((
                    name.clone(),
                    format!("no annotation {}", layout.xml_path(name).display()),
                )),
                Err(e) if options.skip_invalid => {
                    summary.invalid += 1;
                    summary.skipped.push((name.clone(), e.to_string()));
                }
                Err(e) => return Err(DataError::InvalidExample(Box::new(e))),
            }
        }
        split_summary.images = writer.len();
        closed.push((split.to_string(), split_summary, writer.close()?));
    }
    if closed[0].1.images == 0 {
        return Err(DataError::invalid(root, "no training image left to write"));
    }
    summary.splits = replace_set(out, closed)?;
    write_text(&out.join("label_map.pbtxt"), &label_map.to_pbtxt())?;
    let request = json!({"source": root.display().to_string(), "classes": format!("{:?}", options.classes), "seed": options.seed, "num_shards": options.num_shards});
    write_manifest(out, request, label_map.names(), &summary)?;
    Ok(summary)
}

/// The checked example of the listed image `name`, or `None` when it has no annotation file.
fn voc_record(
    layout: &PetLayout,
    name: &str,
    options: &VocOptions,
    label_map: &LabelMap,
    cleanup: &mut CleanupReport,
) -> Result<Option<DetectionExample>> {
    let xml = layout.xml_path(name);
    if !xml.is_file() {
        return Ok(None);
    }
    let annotation = VocAnnotation::load(&xml)?;
    let image = layout.image_path(name);
    let example = voc_example(&image, &annotation, options.classes, label_map, cleanup)?;
    let num_classes = label_map.items.iter().map(|it| it.id).max().unwrap_or(0);
    check_objects(&example, Some(num_classes as usize))
        .map_err(|problem| DataError::invalid(&xml, problem))?;
    Ok(Some(example))
}
