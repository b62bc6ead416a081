//! Data pipeline throughput: decode + TF augmentation (random_horizontal_flip, ssd_random_crop)
//! and resize to 300x300 and normalise, on 500x375 JPEGs; one core, then the loader with every
//! core.
//!
//! `cargo bench -p data --bench pipeline` (BENCH_IMAGES=N to change the image count).

use std::sync::Arc;
use std::time::Instant;

use data::augment::Augmentation;
use data::loader::{Loader, LoaderConfig, Position, load_sample};
use data::shards::ShardedWriter;
use data::synthetic::generate;
use data::tfrecord::RecordIndex;

fn main() {
    let images: u64 = std::env::var("BENCH_IMAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    let dir = tempfile::tempdir().expect("temp dir");
    let mut writer = ShardedWriter::create(&dir.path().join("bench.record"), 1).expect("writer");
    for i in 0..images {
        let s = generate(0, i);
        let big =
            image::imageops::resize(&s.image, 500, 375, image::imageops::FilterType::Triangle);
        let mut e = data::synthetic::SyntheticImage {
            image: big,
            objects: s.objects,
        }
        .to_example(i);
        e.width = 500;
        e.height = 375;
        writer.write(&e.encode()).expect("write");
    }
    let files = writer.finish().expect("finish");
    let index = Arc::new(RecordIndex::build(&files).expect("index"));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let config = LoaderConfig {
        batch_size: 8,
        image_size: [300, 300],
        augmentations: vec![
            Augmentation::RandomHorizontalFlip,
            Augmentation::SsdRandomCrop { operations: vec![] },
        ],
        shuffle: true,
        seed: 1,
        workers: cores,
        prefetch: 4,
    };
    let mut rates = Vec::new();
    for round in 0..3 {
        let start = Instant::now();
        for r in 0..index.len() {
            load_sample(&index, r, &config, round, r).expect("sample");
        }
        rates.push(index.len() as f64 / start.elapsed().as_secs_f64());
    }
    rates.sort_by(f64::total_cmp);
    println!(
        "one core: decode + flip + ssd_random_crop + resize 300x300, 500x375 JPEG: min {:.0}, median {:.0}, max {:.0} images/s",
        rates[0], rates[1], rates[2]
    );
    let batches = (index.len() / 8) * 3;
    let start = Instant::now();
    let loader = Loader::new(index.clone(), config, Position::default()).expect("loader");
    for b in loader.take(batches) {
        b.expect("batch");
    }
    println!(
        "loader, {cores} workers, batch 8: {:.0} images/s",
        (batches * 8) as f64 / start.elapsed().as_secs_f64()
    );
}
