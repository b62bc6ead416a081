//! Developer and dataset tasks: `cargo xtask prepare-data`, `cargo xtask inspect`,
//! `cargo xtask bench`, `cargo xtask launches`.

mod bench;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod launches;

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use data::images::decode_image;
use data::prepare::{VocOptions, is_prepared, prepare_synthetic, prepare_voc, synthetic_request};
use data::shards::expand_patterns;
use data::tfrecord::RecordIndex;
use data::validate::read_checked;
use data::voc::{ClassSource, PetLayout};
use data::{DetectionExample, LabelMap};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "Dataset preparation and developer tasks"
)]
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
    /// Training, inference and data-pipeline throughput and peak memory (CPU, and each CUDA
    /// device found): prints a table and writes JSON.
    Bench {
        /// The JSON report.
        #[arg(long, default_value = "target/bench.json")]
        out: PathBuf,
        /// Measured repetitions per case (after warm-up).
        #[arg(long, default_value_t = 5)]
        repeats: usize,
        /// Only the cases whose label contains this text (e.g. "train", "batch 8").
        #[arg(long)]
        only: Option<String>,
        /// Also the cases on the default wgpu adapter (slow on a software driver such as
        /// lavapipe).
        #[arg(long)]
        wgpu: bool,
    },
    /// Kernel launches on a GPU per training step (each config) and per depthwise filter
    /// gradient (as trained and by Burn's grouped convolution), from cubecl's execution log.
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    Launches {
        /// `wgpu` (the default adapter) or a CUDA ordinal.
        #[arg(long, default_value = "wgpu")]
        device: String,
        /// Config files.
        #[arg(long, num_args = 1.., default_values = ["configs/synthetic.json", "configs/ssd_mobilenet_v1_pets.json"])]
        configs: Vec<PathBuf>,
        /// Images per step.
        #[arg(long, default_value_t = 12)]
        batch: usize,
        /// The JSON report.
        #[arg(long, default_value = "target/launches.json")]
        out: PathBuf,
    },
    /// One benchmark case (run by `bench` in a child process).
    #[command(hide = true)]
    BenchCase {
        case: String,
        #[arg(long)]
        scratch: PathBuf,
        #[arg(long)]
        repeats: usize,
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
    /// Existing TFRecord files (globs or `base@N`) to validate: every record's checksums,
    /// fields, labels, boxes and image; each invalid record is listed.
    #[arg(long, num_args = 1..)]
    from_tfrecord: Vec<String>,
    /// A label map (`.pbtxt`): with --from-voc the classes to use (every name must be in it),
    /// with --from-tfrecord the labels allowed (up to its largest id).
    #[arg(long)]
    label_map: Option<PathBuf>,
    /// --from-voc: skip (and count) images that do not decode completely and annotations that
    /// are invalid, instead of stopping at the first.
    #[arg(long, requires = "from_voc")]
    skip_invalid: bool,
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
    train::allocator::keep_freed_memory();
    match Cli::parse().command {
        Command::PrepareData(args) => prepare(args),
        Command::Inspect { records } => inspect(&records),
        Command::Bench {
            out,
            repeats,
            only,
            wgpu,
        } => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let cuda: Vec<usize> = (0..train::devices::cuda_device_count()).collect();
            let cases: Vec<_> = bench::cases(&cuda, wgpu, cores)
                .into_iter()
                .filter(|c| only.as_ref().is_none_or(|o| c.label().contains(o.as_str())))
                .collect();
            if cases.is_empty() {
                bail!(
                    "no case's label contains {:?} (CUDA devices found: {})",
                    only.unwrap_or_default(),
                    cuda.len()
                );
            }
            bench::run_all(&cases, repeats.max(1), &out)
        }
        #[cfg(any(feature = "cuda", feature = "wgpu"))]
        Command::Launches {
            device,
            configs,
            batch,
            out,
        } => launches::run(&launches::Request {
            device,
            configs,
            batch,
            out,
        }),
        Command::BenchCase {
            case,
            scratch,
            repeats,
        } => bench::run_case(&serde_json::from_str(&case)?, &scratch, repeats),
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

/// Counts objects per class name.
fn count_objects(e: &DetectionExample, counts: &mut BTreeMap<String, usize>) {
    for o in &e.objects {
        *counts.entry(o.class_text.clone()).or_default() += 1;
    }
}

fn prepare(args: PrepareArgs) -> Result<()> {
    if !args.from_tfrecord.is_empty() {
        return validate_tfrecords(&args);
    }
    if args.from_voc.is_none() && args.label_map.is_some() {
        bail!("--label-map needs --from-voc or --from-tfrecord (the synthetic set has its own)");
    }
    let bar = progress(0, "preparing");
    let tick = |split: &str, n: u64| {
        bar.set_message(split.to_string());
        bar.inc(n);
    };
    let summary = if let Some(root) = &args.from_voc {
        let classes = match args.classes {
            Classes::Species => ClassSource::Species,
            Classes::Breeds => ClassSource::Breeds,
        };
        let name = root.file_name().and_then(|n| n.to_str()).unwrap_or("voc");
        let out = args
            .out
            .clone()
            .unwrap_or_else(|| PathBuf::from("datasets").join(name));
        let options = VocOptions {
            classes,
            label_map: args.label_map.as_deref().map(LabelMap::load).transpose()?,
            seed: args.seed,
            num_shards: args.num_shards,
            skip_invalid: args.skip_invalid,
        };
        bar.set_length(PetLayout::open(root)?.names.len() as u64);
        prepare_voc(root, &out, &options, &tick)?
    } else {
        let out = args
            .out
            .clone()
            .unwrap_or_else(|| PathBuf::from("datasets/synthetic"));
        if is_prepared(
            &out,
            &synthetic_request(args.seed, args.train, args.val, args.num_shards),
        ) {
            println!(
                "{} is up to date ({} train, {} val images)",
                out.display(),
                args.train,
                args.val
            );
            return Ok(());
        }
        bar.set_length(args.train + args.val);
        prepare_synthetic(
            &out,
            args.seed,
            args.train,
            args.val,
            args.num_shards,
            &tick,
        )?
    };
    bar.finish();
    for (split, s) in &summary.splits {
        println!(
            "{split}: {} images, objects {:?}, {} shards",
            s.images,
            s.objects,
            s.files.len()
        );
    }
    println!(
        "cleanup: {} re-encoded, {} boxes clipped, {} boxes dropped",
        summary.cleanup.reencoded, summary.cleanup.boxes_clipped, summary.cleanup.boxes_dropped
    );
    for (n, why) in &summary.skipped {
        println!("skipped {n}: {why}");
    }
    println!(
        "{} images skipped ({} without annotation, {} invalid); wrote {}",
        summary.skipped.len(),
        summary.skipped.len() - summary.invalid,
        summary.invalid,
        summary.out.display()
    );
    Ok(())
}

/// Checks every record as training and evaluation will, listing each invalid one; fails
/// when any is.
fn validate_tfrecords(args: &PrepareArgs) -> Result<()> {
    let files = expand_patterns(&args.from_tfrecord)?;
    let index = RecordIndex::build(&files)?;
    let num_classes = match &args.label_map {
        Some(path) => {
            let map = LabelMap::load(path)?;
            let max = map.items.iter().map(|it| it.id).max().unwrap_or(0);
            Some(usize::try_from(max).context("label map ids")?)
        }
        None => None,
    };
    let mut counts = BTreeMap::new();
    let (mut invalid, mut max_label) = (0, 0);
    for i in 0..index.len() {
        match read_checked(&index, i, num_classes) {
            Ok((e, _)) => {
                count_objects(&e, &mut counts);
                max_label = e.objects.iter().map(|o| o.label).fold(max_label, i64::max);
            }
            Err(e) => {
                invalid += 1;
                println!("invalid: {e}");
            }
        }
    }
    if invalid > 0 {
        bail!(
            "{invalid} of {} records are invalid (listed above); training and evaluation refuse them",
            index.len()
        );
    }
    println!(
        "{} records in {} files, all valid; labels up to {max_label}; objects {:?}",
        index.len(),
        files.len(),
        counts
    );
    Ok(())
}

fn inspect(patterns: &[String]) -> Result<()> {
    let files = expand_patterns(patterns)?;
    let index = RecordIndex::build(&files)?;
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    let mut bad_images = 0;
    for i in 0..index.len() {
        let loc = index.location(i);
        let e = DetectionExample::decode(&index.read(i)?).with_context(|| {
            format!(
                "{} record at byte {}",
                files[loc.file].display(),
                loc.offset
            )
        })?;
        // decoded completely, as training does: a truncated image or one whose header claims
        // a size over the limits counts as undecodable, and the line says why
        let decoded = decode_image(&e.encoded).map(|(img, _)| (img.width(), img.height()));
        bad_images += usize::from(decoded.is_err());
        count_objects(&e, &mut counts);
        let line = json!({
            "file": files[loc.file].display().to_string(), "offset": loc.offset,
            "image/format": e.format, "image/height": e.height, "image/width": e.width,
            "image/filename": e.filename, "image/source_id": e.source_id, "image/key/sha256": e.sha256,
            "image/encoded/bytes": e.encoded.len(),
            "decoded_size": decoded.as_ref().ok().map(|(w, h)| json!({"width": w, "height": h})),
            "decode_error": decoded.err(),
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
