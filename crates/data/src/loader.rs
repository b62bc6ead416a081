//! Turning records into training batches: decode, augment, resize and normalise each sample
//! (the samples of a batch spread over worker threads, with a bounded prefetch queue), in a
//! globally shuffled order that is a pure function of `(seed, epoch)`, from an exact
//! resumable [`Position`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, sync_channel};
use std::thread::JoinHandle;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use model::preprocess::{normalize_hwc_to_chw, resize_bilinear};
use model::targets::GroundTruth;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::augment::{Annotated, Augmentation, augment};
use crate::error::{DataError, Result};
use crate::tfrecord::RecordIndex;
use crate::validate::read_checked;

/// How batches are made.
#[derive(Debug, Clone, PartialEq)]
pub struct LoaderConfig {
    /// Images per global batch (split across replicas by [`Batch::split`]).
    pub batch_size: usize,
    /// Network input `[height, width]`.
    pub image_size: [usize; 2],
    /// Classes of the model: every record's labels must lie in `1..=num_classes`.
    pub num_classes: usize,
    /// Augmentation steps, in order.
    pub augmentations: Vec<Augmentation>,
    /// Shuffle every epoch (globally, over all records).
    pub shuffle: bool,
    /// Seed of the shuffles and augmentations.
    pub seed: u64,
    /// Worker threads; each batch's samples are spread over all of them.
    pub workers: usize,
    /// Batches prepared ahead.
    pub prefetch: usize,
    /// Which slots of every global batch this loader makes (one machine's share in
    /// multi-node training, in proportion to its replicas); `None` is the whole batch.
    /// Augmentation depends only on the global slot, so the shares together equal the whole
    /// batch.
    pub share: Option<std::ops::Range<usize>>,
}

/// Where the data stream stands: the next sample is number `index` of epoch `epoch`'s order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Position {
    /// Epoch number, from 0.
    pub epoch: u64,
    /// Samples of this epoch already consumed.
    pub index: usize,
}

/// A batch of preprocessed images with their ground truth.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// `[len, 3, height, width]` values in `[-1, 1]`, row-major.
    pub images: Vec<f32>,
    /// `[height, width]` of every image.
    pub image_size: [usize; 2],
    /// Objects of every image.
    pub ground_truth: Vec<Vec<GroundTruth>>,
    /// Index (in the record index) of every image's record.
    pub records: Vec<usize>,
    /// `[height, width]` in pixels of every image before the resize (after augmentation).
    pub sizes: Vec<[u32; 2]>,
    /// The position right after this batch (what a checkpoint stores).
    pub next_position: Position,
}

impl Batch {
    /// Number of images.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// True for a batch without images.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Splits into `parts` consecutive, disjoint, equal slices (one per replica).
    pub fn split(&self, parts: usize) -> Vec<Batch> {
        assert!(
            parts > 0 && self.len().is_multiple_of(parts),
            "batch of {} does not split into {parts}",
            self.len()
        );
        let per = self.len() / parts;
        let pixels = 3 * self.image_size[0] * self.image_size[1];
        (0..parts)
            .map(|p| Batch {
                images: self.images[p * per * pixels..(p + 1) * per * pixels].to_vec(),
                image_size: self.image_size,
                ground_truth: self.ground_truth[p * per..(p + 1) * per].to_vec(),
                records: self.records[p * per..(p + 1) * per].to_vec(),
                sizes: self.sizes[p * per..(p + 1) * per].to_vec(),
                next_position: self.next_position,
            })
            .collect()
    }

    /// The images as a `[len, 3, height, width]` tensor.
    pub fn images_tensor<B: Backend>(&self, device: &B::Device) -> Tensor<B, 4> {
        let [h, w] = self.image_size;
        Tensor::from_data(
            TensorData::new(self.images.clone(), [self.len(), 3, h, w]),
            device,
        )
    }
}

/// `splitmix64`, to derive independent seeds.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The record order of an epoch.
pub fn epoch_order(records: usize, seed: u64, epoch: u64, shuffle: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..records).collect();
    if shuffle {
        order.shuffle(&mut StdRng::seed_from_u64(mix(seed ^ mix(epoch))));
    }
    order
}

/// Decodes and checks record `record` ([`read_checked`]: a bad label, box or image is an
/// error naming the file and the record), augments it with the RNG of `(seed, epoch, slot)`,
/// resizes and normalises it. Boxes left without area are dropped.
pub fn load_sample(
    index: &RecordIndex,
    record: usize,
    config: &LoaderConfig,
    epoch: u64,
    slot: usize,
) -> Result<(Vec<f32>, Vec<GroundTruth>, [u32; 2])> {
    let (example, image) = read_checked(index, record, Some(config.num_classes))?;
    let sample = Annotated {
        image: image.to_rgb8(),
        boxes: example.objects.iter().map(|o| o.bbox).collect(),
        // checked: every label is in 1..=num_classes
        labels: example.objects.iter().map(|o| o.label as usize).collect(),
    };
    let mut rng = StdRng::seed_from_u64(mix(config.seed ^ mix(epoch ^ mix(slot as u64))));
    let out = augment(sample, &config.augmentations, &mut rng);
    let [h, w] = config.image_size;
    let mut pixels = Vec::with_capacity(3 * h * w);
    normalize_hwc_to_chw(&resize_bilinear(&out.image, h, w), h, w, &mut pixels);
    let ground_truth = out
        .boxes
        .iter()
        .zip(&out.labels)
        .filter(|(b, _)| b.height() > 0.0 && b.width() > 0.0)
        .map(|(&bbox, &class_id)| GroundTruth { bbox, class_id })
        .collect();
    Ok((
        pixels,
        ground_truth,
        [out.image.height(), out.image.width()],
    ))
}

/// The epoch and first slot of global batch `n` counted from `start` (incomplete batches at
/// the end of an epoch are skipped).
fn batch_start(start: Position, n: u64, records: usize, batch: usize) -> Position {
    let per_epoch = (records / batch) as u64;
    let first_epoch_left = (records.saturating_sub(start.index) / batch) as u64;
    if n < first_epoch_left {
        return Position {
            epoch: start.epoch,
            index: start.index + n as usize * batch,
        };
    }
    let n = n - first_epoch_left;
    Position {
        epoch: start.epoch + 1 + n / per_epoch,
        index: (n % per_epoch) as usize * batch,
    }
}

fn make_batch(index: &RecordIndex, config: &LoaderConfig, at: Position) -> Result<Batch> {
    let order = epoch_order(index.len(), config.seed, at.epoch, config.shuffle);
    let [h, w] = config.image_size;
    let slots = config.share.clone().unwrap_or(0..config.batch_size);
    let len = slots.len();
    let mut batch = Batch {
        images: Vec::with_capacity(len * 3 * h * w),
        image_size: config.image_size,
        ground_truth: Vec::with_capacity(len),
        records: Vec::with_capacity(len),
        sizes: Vec::with_capacity(len),
        next_position: Position {
            epoch: at.epoch,
            index: at.index + config.batch_size,
        },
    };
    let slots: Vec<(usize, usize)> = order
        .iter()
        .copied()
        .enumerate()
        .skip(at.index + slots.start)
        .take(len)
        .collect();
    let samples = slots
        .into_par_iter()
        .map(|(slot, record)| {
            load_sample(index, record, config, at.epoch, slot).map(|sample| (record, sample))
        })
        .collect::<Result<Vec<_>>>()?;
    for (record, (pixels, gt, size)) in samples {
        batch.images.extend(pixels);
        batch.sizes.push(size);
        batch.ground_truth.push(gt);
        batch.records.push(record);
    }
    Ok(batch)
}

/// An endless, deterministic stream of batches made by worker threads.
///
/// A producer thread makes one batch after the other, each with its samples spread over the
/// workers: every worker takes a share of every batch, so the decoding comes in short,
/// even bursts on every core instead of one long burst on one (which, beside data-parallel
/// replicas, would hold back one replica and make the others wait for it).
pub struct Loader {
    receiver: Receiver<Result<Batch>>,
    stop: Arc<AtomicBool>,
    producer: Option<JoinHandle<()>>,
}

impl Loader {
    /// Starts the workers at `start`. Fails when the data cannot fill one batch.
    pub fn new(index: Arc<RecordIndex>, config: LoaderConfig, start: Position) -> Result<Self> {
        let first_file = index.files().first().cloned().unwrap_or_default();
        let first_file = || first_file.clone();
        if let Some(share) = &config.share
            && (share.is_empty() || share.end > config.batch_size)
        {
            return Err(DataError::invalid(
                first_file(),
                format!(
                    "slots {share:?} are not a share of a batch of {}",
                    config.batch_size
                ),
            ));
        }
        if config.batch_size == 0 || index.len() < config.batch_size {
            return Err(DataError::invalid(
                first_file(),
                format!(
                    "{} records cannot fill a batch of {}",
                    index.len(),
                    config.batch_size
                ),
            ));
        }
        let workers = rayon::ThreadPoolBuilder::new()
            .num_threads(config.workers.max(1))
            .thread_name(|i| format!("loader-{i}"))
            .build()
            .map_err(|e| {
                DataError::invalid(first_file(), format!("starting the data workers: {e}"))
            })?;
        let (sender, receiver) = sync_channel(config.prefetch.max(1));
        let stop = Arc::new(AtomicBool::new(false));
        let producer = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("loader".into())
                .spawn(move || {
                    let mut n = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let at = batch_start(start, n, index.len(), config.batch_size);
                        let batch = workers.install(|| make_batch(&index, &config, at));
                        if sender.send(batch).is_err() {
                            break;
                        }
                        n += 1;
                    }
                })
                .map_err(|e| {
                    DataError::invalid(first_file(), format!("starting the data loader: {e}"))
                })?
        };
        Ok(Self {
            receiver,
            stop,
            producer: Some(producer),
        })
    }
}

impl Iterator for Loader {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        self.receiver.recv().ok()
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // unblock the producer waiting on a full queue, then wait for it
        if let Some(producer) = self.producer.take() {
            while !producer.is_finished() {
                while self.receiver.try_recv().is_ok() {}
                std::thread::yield_now();
            }
            let _ = producer.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_positions_skip_incomplete_tails() {
        // 10 records, batches of 4: two per epoch, the last 2 records of each epoch skipped
        let p = |e, i| Position { epoch: e, index: i };
        let starts: Vec<Position> = (0..5).map(|n| batch_start(p(0, 0), n, 10, 4)).collect();
        assert_eq!(starts, vec![p(0, 0), p(0, 4), p(1, 0), p(1, 4), p(2, 0)]);
        // resuming mid-epoch continues exactly
        assert_eq!(batch_start(p(1, 4), 0, 10, 4), p(1, 4));
        assert_eq!(batch_start(p(1, 4), 1, 10, 4), p(2, 0));
    }

    #[test]
    fn epoch_orders_are_permutations_that_differ() {
        let a = epoch_order(100, 1, 0, true);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_ne!(a, epoch_order(100, 1, 1, true));
        assert_eq!(a, epoch_order(100, 1, 0, true));
        assert_eq!(epoch_order(5, 1, 3, false), vec![0, 1, 2, 3, 4]);
    }
}
