//! Developer and dataset tasks: `cargo xtask prepare-data`, `cargo xtask inspect`,
//! `cargo xtask bench`, `cargo xtask launches`, `cargo xtask coco-file`, `cargo xtask
//! check-book`, `cargo xtask figures`.

mod bench;
mod book;
mod coco_file;
mod figures;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod launches;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use data::coco::{CocoOptions, CocoPrepared, prepare_coco};
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
    /// Check the guide (docs/src) and README.md: chapters, links and anchors, and every
    /// `train` / `cargo xtask` command against the built binaries' --help.
    CheckBook {
        /// The repository's root.
        #[arg(long, default_value = ".")]
        root: PathBuf,
    },
    /// The figures of a finished training run (time, images/s, VOC mAP@0.5 and COCO AP, with
    /// the date, commit and machine) as Markdown for the guide, and README.md's copy of them.
    Figures {
        /// The finished run's model dir.
        #[arg(long, default_value = "runs/synthetic")]
        model_dir: PathBuf,
        /// The run's training config, where the model dir holds no config.json.
        #[arg(long, default_value = "configs/synthetic.json")]
        config: PathBuf,
        /// The Markdown file written (README.md's block of the same name is replaced too).
        #[arg(long, default_value = "docs/src/figures/default-run.md")]
        out: PathBuf,
        /// The command that trained the run, as the figures state it.
        #[arg(long, default_value = "cargo run --release -p train -- --devices cpu")]
        run_command: String,
        /// A remark on the measurement, e.g. other work running on the machine.
        #[arg(long)]
        note: Option<String>,
        /// The repository's root.
        #[arg(long, default_value = ".")]
        root: PathBuf,
    },
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
    /// What a GPU compiles, tunes and launches: for each config the kernels compiled and the
    /// shapes autotuned by the first training step and a first inference pass (against the
    /// kernel cache in use: point SSD_BURN_KERNEL_CACHE at an empty folder for a cold start,
    /// at the same folder again for a warm one), the launches per training step, and per
    /// depthwise layer's backward pass (input and filter gradients), from cubecl's logs.
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
        /// The JSON report; cubecl's logs go beside it (`.log`: each launch in order,
        /// `.compile.log`, `.autotune.log`).
        #[arg(long, default_value = "target/launches.json")]
        out: PathBuf,
    },
    /// Write a COCO annotation file the size of train2017's over a few small pictures (to
    /// measure `prepare-data --from-coco` at that scale): `OUT/instances.json`, `OUT/images/`.
    CocoFile {
        /// The output folder.
        #[arg(long, default_value = "target/coco-file")]
        out: PathBuf,
        /// Image entries (train2017: 118,287).
        #[arg(long, default_value_t = 118_287)]
        images: u64,
        /// Annotations (train2017: 860,001).
        #[arg(long, default_value_t = 860_001)]
        annotations: u64,
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
    /// Output folder (default: datasets/synthetic, datasets/<source folder name>,
    /// datasets/coco).
    #[arg(long)]
    out: Option<PathBuf>,
    /// An Oxford-IIIT Pet or PASCAL VOC folder (images/, annotations/xmls/, annotations/trainval.txt).
    #[arg(long, conflicts_with = "from_tfrecord")]
    from_voc: Option<PathBuf>,
    /// A COCO annotation file (instances_train2017.json, or a torchvision, mmdetection, CVAT,
    /// Label Studio or Roboflow export), with --images: writes OUT/SPLIT.record-*.
    #[arg(long, conflicts_with_all = ["from_voc", "from_tfrecord", "label_map"], requires = "images")]
    from_coco: Option<PathBuf>,
    /// --from-coco: the folder the images' `file_name`s are relative to.
    #[arg(long, requires = "from_coco")]
    images: Option<PathBuf>,
    /// --from-coco: the split written; another call with `--split val` adds it to the same
    /// folder and manifest.
    #[arg(long, default_value = "train", requires = "from_coco")]
    split: String,
    /// --from-coco: map the category ids to 1..K in the order of `categories` (ids starting
    /// at 0 always are; otherwise COCO's ids are kept as label-map ids).
    #[arg(long, requires = "from_coco")]
    contiguous_ids: bool,
    /// --from-coco: leave out images without any object to train on: no annotation, or only
    /// crowd regions and boxes without area (written as negatives otherwise).
    #[arg(long, requires = "from_coco")]
    skip_empty: bool,
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
    /// --from-voc, --from-coco: skip (and count) images that do not decode completely and
    /// annotations that are invalid, instead of stopping at the first.
    #[arg(long)]
    skip_invalid: bool,
    /// Shards of the training split (--from-coco: of the split written).
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
    // SAFETY: the first thing `main` does: the process has one thread
    #[cfg(feature = "cuda")]
    unsafe {
        train::devices::kernel_cache::point_driver_cache()
    };
    train::allocator::keep_freed_memory();
    match Cli::parse().command {
        Command::PrepareData(args) => prepare(args),
        Command::Inspect { records } => inspect(&records),
        Command::CheckBook { root } => {
            let exe = std::env::current_exe().context("finding this program")?;
            book::check(&root, exe.parent().unwrap_or(Path::new(".")))
        }
        Command::Figures {
            model_dir,
            config,
            out,
            run_command,
            note,
            root,
        } => figures::run(&figures::Request {
            root,
            model_dir,
            config,
            out,
            run_command,
            note,
        }),
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
        Command::CocoFile {
            out,
            images,
            annotations,
        } => {
            let g = coco_file::generate(&out, images, annotations)?;
            println!(
                "{}: {} bytes, {} images ({} without annotations), {} annotations ({} crowd \
                 regions), pictures in {}",
                g.file.display(),
                g.bytes,
                g.images,
                g.empty,
                g.annotations,
                g.crowd,
                out.join("images").display()
            );
            Ok(())
        }
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
    if let Some(file) = &args.from_coco {
        return prepare_from_coco(&args, file);
    }
    if args.from_voc.is_none() && args.label_map.is_some() {
        bail!("--label-map needs --from-voc or --from-tfrecord (the synthetic set has its own)");
    }
    if args.from_voc.is_none() && args.skip_invalid {
        bail!("--skip-invalid needs --from-voc or --from-coco");
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
            .unwrap_or_else(|| PathBuf::from(data::prepare::SYNTHETIC_DIR));
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

/// Prepares one split from a COCO file and prints what was written, mapped and skipped.
fn prepare_from_coco(args: &PrepareArgs, file: &Path) -> Result<()> {
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("datasets/coco"));
    let options = CocoOptions {
        images: args.images.clone().context("--from-coco needs --images")?,
        split: args.split.clone(),
        num_shards: args.num_shards,
        contiguous_ids: args.contiguous_ids,
        skip_empty: args.skip_empty,
        skip_invalid: args.skip_invalid,
    };
    println!("reading {}", file.display());
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{msg}: {pos} images {per_sec} {elapsed}")
            .expect("valid template"),
    );
    let tick = |split: &str, n: u64| {
        bar.set_message(split.to_string());
        bar.inc(n);
    };
    let prepared = prepare_coco(file, &out, &options, &tick)?;
    bar.finish();
    print_coco(&prepared);
    Ok(())
}

fn print_coco(p: &CocoPrepared) {
    let s = &p.summary;
    println!(
        "{}: {} images, objects {:?}, {} shards",
        p.split,
        s.written.images,
        s.written.objects,
        s.written.files.len()
    );
    let c = &p.categories;
    if c.contiguous {
        let mapped: Vec<String> = c
            .items
            .iter()
            .map(|it| format!("{} ({}) -> {}", it.coco_id, it.name, it.label))
            .collect();
        println!("category ids mapped to labels: {}", mapped.join(", "));
    } else {
        println!(
            "{} categories, their ids kept as labels (the largest, {}, is the least \
             num_classes of a config)",
            c.items.len(),
            c.num_classes()
        );
    }
    println!(
        "cleanup: {} re-encoded, {} boxes clipped, {} boxes dropped, {} crowd regions (kept \
         for evaluation, never trained on)",
        s.cleanup.reencoded, s.cleanup.boxes_clipped, s.cleanup.boxes_dropped, s.crowd_regions
    );
    let empty = if s.empty_skipped > 0 {
        "left out (--skip-empty)"
    } else {
        "written as negatives"
    };
    println!(
        "{} images without any object to train on, {empty}",
        s.empty_images
    );
    for (what, why) in &s.skipped {
        println!("skipped {what}: {why}");
    }
    println!(
        "{} invalid entries skipped ({} images left out); wrote {}",
        s.skipped.len(),
        s.images_skipped,
        p.out.display()
    );
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
