//! Developer and dataset tasks: `cargo xtask prepare-data`, `cargo xtask inspect`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use data::shards::{ShardedWriter, expand_patterns};
use data::synthetic::{CLASSES, generate};
use data::tfrecord::RecordIndex;
use data::voc::{ClassSource, CleanupReport, PetLayout, VocAnnotation, voc_example};
use data::{DetectionExample, LabelMap};
use indicatif::{ProgressBar, ProgressStyle};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use serde_json::json;

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Dataset preparation and developer tasks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Prepare training shards. Without a source: the built-in synthetic cats-and-dogs set.
    PrepareData(PrepareArgs),
    /// Print every record's fields (except the image bytes) as JSON lines, then a summary.
    Inspect {
        /// TFRecord files, globs or `base@N` shard specs.
        #[arg(required = true)]
        records: Vec<String>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Classes {
    /// cat / dog, from the XML `<name>`.
    Species,
    /// The 37 breeds, from the file names.
    Breeds,
}

#[derive(clap::Args)]
struct PrepareArgs {
    /// Output folder (default: datasets/synthetic, datasets/<source folder name>).
    #[arg(long)]
    out: Option<PathBuf>,
    /// An Oxford-IIIT Pet or PASCAL VOC folder (images/, annotations/xmls/, annotations/trainval.txt).
    #[arg(long, conflicts_with = "from_tfrecord")]
    from_voc: Option<PathBuf>,
    /// Class names for --from-voc.
    #[arg(long, value_enum, default_value = "species")]
    classes: Classes,
    /// Existing TFRecord files (globs or `base@N`) to validate and index.
    #[arg(long, num_args = 1..)]
    from_tfrecord: Vec<String>,
    /// Shards of the training split.
    #[arg(long, default_value_t = 4)]
    num_shards: usize,
    /// Synthetic training images.
    #[arg(long, default_value_t = 3000)]
    train: u64,
    /// Synthetic validation images.
    #[arg(long, default_value_t = 300)]
    val: u64,
    /// Seed of the synthetic images and of the train/val split.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::PrepareData(args) => prepare(args),
        Command::Inspect { records } => inspect(&records),
    }
}

fn progress(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {per_sec} eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

fn write_text(path: &Path, text: &str) -> Result<()> {
    model::weights::write_atomic(path, text.as_bytes()).with_context(|| format!("writing {}", path.display()))
}

/// Counts objects per class name.
fn count_objects(examples: &[DetectionExample], counts: &mut BTreeMap<String, usize>) {
    for o in examples.iter().flat_map(|e| &e.objects) {
        *counts.entry(o.class_text.clone()).or_default() += 1;
    }
}

fn prepare(args: PrepareArgs) -> Result<()> {
    if let Some(root) = &args.from_voc {
        return prepare_voc(&args, root);
    }
    if !args.from_tfrecord.is_empty() {
        return validate_tfrecords(&args);
    }
    prepare_synthetic(&args)
}

fn prepare_synthetic(args: &PrepareArgs) -> Result<()> {
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from("datasets/synthetic"));
    let manifest_path = out.join("manifest.json");
    let wanted = json!({"source": "synthetic", "seed": args.seed, "train": args.train, "val": args.val, "num_shards": args.num_shards});
    if let Ok(text) = std::fs::read_to_string(&manifest_path)
        && let Ok(old) = serde_json::from_str::<serde_json::Value>(&text)
        && old.get("request") == Some(&wanted)
    {
        println!("{} is up to date ({} train, {} val)", out.display(), args.train, args.val);
        return Ok(());
    }
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let mut counts = BTreeMap::new();
    let mut splits = serde_json::Map::new();
    // validation images use indices after the training ones, so they never repeat a training image
    for (split, first, count, shards) in [("train", 0, args.train, args.num_shards), ("val", args.train, args.val, 1)] {
        let mut writer = ShardedWriter::create(&out.join(format!("{split}.record")), shards)?;
        let bar = progress(count, split);
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
        let chunk = 64;
        let mut split_counts = BTreeMap::new();
        for start in (first..first + count).step_by(chunk as usize) {
            let end = (start + chunk).min(first + count);
            let examples: Vec<DetectionExample> = std::thread::scope(|s| {
                let per = (end - start).div_ceil(threads);
                let handles: Vec<_> = (0..threads)
                    .map(|t| {
                        let (a, b) = (start + t * per, (start + (t + 1) * per).min(end));
                        s.spawn(move || (a..b).map(|i| generate(args.seed, i).to_example(i)).collect::<Vec<_>>())
                    })
                    .collect();
                handles.into_iter().flat_map(|h| h.join().expect("generator thread")).collect()
            });
            for e in &examples {
                writer.write(&e.encode())?;
            }
            count_objects(&examples, &mut split_counts);
            bar.inc(end - start);
        }
        bar.finish();
        let files = writer.finish()?;
        for (k, v) in &split_counts {
            *counts.entry(k.clone()).or_insert(0) += v;
        }
        splits.insert(
            split.into(),
            json!({"images": count, "objects": split_counts, "files": files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>()}),
        );
    }
    write_text(&out.join("label_map.pbtxt"), &LabelMap::from_names(&CLASSES).to_pbtxt())?;
    let manifest = json!({"request": wanted, "source": "synthetic", "classes": CLASSES, "splits": splits});
    write_text(&manifest_path, &serde_json::to_string_pretty(&manifest)?)?;
    println!("wrote {}: {} train + {} val images, objects {:?}", out.display(), args.train, args.val, counts);
    Ok(())
}

fn prepare_voc(args: &PrepareArgs, root: &Path) -> Result<()> {
    let layout = PetLayout::open(root)?;
    let classes = match args.classes {
        Classes::Species => ClassSource::Species,
        Classes::Breeds => ClassSource::Breeds,
    };
    let label_map = layout.label_map(classes);
    if label_map.items.is_empty() {
        bail!("{}: no classes found", root.display());
    }
    let name = root.file_name().and_then(|n| n.to_str()).unwrap_or("voc");
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from("datasets").join(name));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let mut names = layout.names.clone();
    names.shuffle(&mut rand::rngs::StdRng::seed_from_u64(args.seed));
    let num_train = (0.7 * names.len() as f64) as usize;
    let mut report = CleanupReport::default();
    let mut skipped: Vec<(String, String)> = Vec::new();
    let mut splits = serde_json::Map::new();
    for (split, list, shards) in [("train", &names[..num_train], args.num_shards), ("val", &names[num_train..], 1)] {
        let mut writer = ShardedWriter::create(&out.join(format!("{split}.record")), shards)?;
        let bar = progress(list.len() as u64, split);
        let mut counts = BTreeMap::new();
        for n in list {
            bar.inc(1);
            let xml = layout.xml_path(n);
            if !xml.is_file() {
                skipped.push((n.clone(), format!("no annotation {}", xml.display())));
                continue;
            }
            let example = VocAnnotation::load(&xml)
                .and_then(|a| voc_example(&layout.image_path(n), &a, classes, &label_map, &mut report));
            match example {
                Ok(e) => {
                    writer.write(&e.encode())?;
                    count_objects(std::slice::from_ref(&e), &mut counts);
                }
                Err(e) => skipped.push((n.clone(), e.to_string())),
            }
        }
        bar.finish();
        let images = writer.len();
        let files = writer.finish()?;
        splits.insert(
            split.into(),
            json!({"images": images, "objects": counts, "files": files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>()}),
        );
    }
    write_text(&out.join("label_map.pbtxt"), &label_map.to_pbtxt())?;
    let manifest = json!({
        "source": root.display().to_string(), "classes": label_map.names(), "splits": splits,
        "cleanup": report, "skipped": skipped.iter().map(|(n, why)| json!({"name": n, "reason": why})).collect::<Vec<_>>(),
    });
    write_text(&out.join("manifest.json"), &serde_json::to_string_pretty(&manifest)?)?;
    println!("{}", serde_json::to_string_pretty(&json!({"out": out.display().to_string(), "splits": splits, "cleanup": report}))?);
    for (n, why) in &skipped {
        println!("skipped {n}: {why}");
    }
    println!("{} images skipped", skipped.len());
    Ok(())
}

fn validate_tfrecords(args: &PrepareArgs) -> Result<()> {
    let files = expand_patterns(&args.from_tfrecord)?;
    let index = RecordIndex::build(&files)?;
    let mut counts = BTreeMap::new();
    for i in 0..index.len() {
        let e = DetectionExample::decode(&index.read(i)?)
            .with_context(|| format!("{} record {i}", files[index.location(i).file].display()))?;
        count_objects(std::slice::from_ref(&e), &mut counts);
    }
    println!("{} records in {} files, all checksums valid; objects {:?}", index.len(), files.len(), counts);
    Ok(())
}

fn inspect(patterns: &[String]) -> Result<()> {
    let files = expand_patterns(patterns)?;
    let index = RecordIndex::build(&files)?;
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    let mut bad_images = 0;
    for i in 0..index.len() {
        let loc = index.location(i);
        let e = DetectionExample::decode(&index.read(i)?)
            .with_context(|| format!("{} record at byte {}", files[loc.file].display(), loc.offset))?;
        let size = image::ImageReader::new(std::io::Cursor::new(&e.encoded))
            .with_guessed_format()
            .ok()
            .and_then(|r| r.into_dimensions().ok());
        bad_images += usize::from(size.is_none());
        count_objects(std::slice::from_ref(&e), &mut counts);
        let line = json!({
            "file": files[loc.file].display().to_string(), "offset": loc.offset,
            "image/format": e.format, "image/height": e.height, "image/width": e.width,
            "image/filename": e.filename, "image/source_id": e.source_id, "image/key/sha256": e.sha256,
            "image/encoded/bytes": e.encoded.len(),
            "decoded_size": size.map(|(w, h)| json!({"width": w, "height": h})),
            "image/object/bbox/ymin": e.objects.iter().map(|o| o.bbox.ymin).collect::<Vec<_>>(),
            "image/object/bbox/xmin": e.objects.iter().map(|o| o.bbox.xmin).collect::<Vec<_>>(),
            "image/object/bbox/ymax": e.objects.iter().map(|o| o.bbox.ymax).collect::<Vec<_>>(),
            "image/object/bbox/xmax": e.objects.iter().map(|o| o.bbox.xmax).collect::<Vec<_>>(),
            "image/object/class/text": e.objects.iter().map(|o| o.class_text.clone()).collect::<Vec<_>>(),
            "image/object/class/label": e.objects.iter().map(|o| o.label).collect::<Vec<_>>(),
            "image/object/difficult": e.objects.iter().map(|o| i64::from(o.difficult)).collect::<Vec<_>>(),
            "image/object/truncated": e.objects.iter().map(|o| i64::from(o.truncated)).collect::<Vec<_>>(),
            "image/object/view": e.objects.iter().map(|o| o.view.clone()).collect::<Vec<_>>(),
        });
        println!("{line}");
    }
    println!(
        "{}",
        json!({"summary": {"files": files.len(), "records": index.len(), "objects_per_class": counts, "undecodable_images": bad_images}})
    );
    Ok(())
}
