//! Dataset preparation: the synthetic set and PASCAL VOC / Oxford-IIIT Pet folders written as
//! sharded TFRecords plus `label_map.pbtxt` and `manifest.json`, every file written atomically.

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
use crate::shards::ShardedWriter;
use crate::synthetic::{CLASSES, generate};
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
}

fn write_text(path: &Path, text: &str) -> Result<()> {
    model::io::write_atomic(path, text.as_bytes()).map_err(DataError::io("writing", path))
}

fn count_objects(e: &DetectionExample, counts: &mut BTreeMap<String, usize>) {
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

/// Writes the synthetic cats-and-dogs set: `train` images in `num_shards` shards and `val`
/// images (indices after the training ones) in one shard. `progress` gets the images done.
pub fn prepare_synthetic(
    out: &Path,
    seed: u64,
    train: u64,
    val: u64,
    num_shards: usize,
    progress: &(dyn Fn(&str, u64) + Sync),
) -> Result<PrepareSummary> {
    std::fs::create_dir_all(out).map_err(DataError::io("creating", out))?;
    let mut summary = PrepareSummary {
        out: out.to_path_buf(),
        ..Default::default()
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    for (split, first, count, shards) in [("train", 0, train, num_shards), ("val", train, val, 1)] {
        let mut writer = ShardedWriter::create(&out.join(format!("{split}.record")), shards)?;
        let mut split_summary = SplitSummary::default();
        let chunk = 64;
        for start in (first..first + count).step_by(chunk) {
            let end = (start + chunk as u64).min(first + count);
            let per = (end - start).div_ceil(threads);
            let examples: Vec<DetectionExample> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..threads)
                    .map(|t| {
                        let (a, b) = (start + t * per, (start + (t + 1) * per).min(end));
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
            });
            for e in &examples {
                writer.write(&e.encode())?;
                count_objects(e, &mut split_summary.objects);
            }
            progress(split, end - start);
        }
        split_summary.images = writer.len();
        split_summary.files = writer.finish()?;
        summary.splits.insert(split.into(), split_summary);
    }
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

/// Converts an Oxford-IIIT Pet / VOC folder: the listed names shuffled with `seed`, 70% train
/// (in `num_shards` shards) and 30% val. Images without annotation, undecodable images and
/// annotations that do not parse are skipped and reported; odd formats are re-encoded as JPEG;
/// boxes are clipped or dropped (counted).
pub fn prepare_voc(
    root: &Path,
    out: &Path,
    classes: ClassSource,
    seed: u64,
    num_shards: usize,
    progress: &(dyn Fn(&str, u64) + Sync),
) -> Result<PrepareSummary> {
    let layout = PetLayout::open(root)?;
    let label_map = layout.label_map(classes);
    if label_map.items.is_empty() {
        return Err(DataError::invalid(root, "no classes found"));
    }
    std::fs::create_dir_all(out).map_err(DataError::io("creating", out))?;
    let mut names = layout.names.clone();
    names.shuffle(&mut StdRng::seed_from_u64(seed));
    let num_train = (0.7 * names.len() as f64) as usize;
    let mut summary = PrepareSummary {
        out: out.to_path_buf(),
        ..Default::default()
    };
    for (split, list, shards) in [
        ("train", &names[..num_train], num_shards),
        ("val", &names[num_train..], 1),
    ] {
        let mut writer = ShardedWriter::create(&out.join(format!("{split}.record")), shards)?;
        let mut split_summary = SplitSummary::default();
        for n in list {
            progress(split, 1);
            let xml = layout.xml_path(n);
            if !xml.is_file() {
                summary
                    .skipped
                    .push((n.clone(), format!("no annotation {}", xml.display())));
                continue;
            }
            let example = VocAnnotation::load(&xml).and_then(|a| {
                voc_example(
                    &layout.image_path(n),
                    &a,
                    classes,
                    &label_map,
                    &mut summary.cleanup,
                )
            });
            match example {
                Ok(e) => {
                    writer.write(&e.encode())?;
                    count_objects(&e, &mut split_summary.objects);
                }
                Err(e) => summary.skipped.push((n.clone(), e.to_string())),
            }
        }
        split_summary.images = writer.len();
        split_summary.files = writer.finish()?;
        summary.splits.insert(split.into(), split_summary);
    }
    write_text(&out.join("label_map.pbtxt"), &label_map.to_pbtxt())?;
    let request = json!({"source": root.display().to_string(), "classes": format!("{classes:?}"), "seed": seed, "num_shards": num_shards});
    write_manifest(out, request, label_map.names(), &summary)?;
    Ok(summary)
}
