//! TensorBoard event files: TFRecord-framed `tensorflow.Event` protos with scalar summaries,
//! written to `events.out.tfevents.<seconds>.<host>` in the model dir, so
//! `tensorboard --logdir runs/` shows the run's losses, learning rate, throughput and
//! evaluation metrics as it did for the TF Object Detection API's users.

use std::fs::{File, OpenOptions};
use std::io::BufWriter;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use data::tfrecord::RecordWriter;
use prost::Message;

/// `tensorflow.Event` (the fields written here).
#[derive(Clone, PartialEq, Message)]
pub struct Event {
    /// Seconds since the Unix epoch.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// Global step.
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// `brain.Event:2` in the first event of a file.
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    /// Scalar values.
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, Message)]
pub struct Summary {
    /// One entry per tag.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` with a `simple_value`.
#[derive(Clone, PartialEq, Message)]
pub struct SummaryValue {
    /// Name of the chart.
    #[prost(string, tag = "1")]
    pub tag: String,
    /// The scalar.
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
    /// An image.
    #[prost(message, optional, tag = "4")]
    pub image: Option<SummaryImage>,
}

/// `tensorflow.Summary.Image`: an encoded (PNG) image.
#[derive(Clone, PartialEq, Message)]
pub struct SummaryImage {
    /// Height in pixels.
    #[prost(int32, tag = "1")]
    pub height: i32,
    /// Width in pixels.
    #[prost(int32, tag = "2")]
    pub width: i32,
    /// 3 = RGB.
    #[prost(int32, tag = "3")]
    pub colorspace: i32,
    /// The PNG bytes.
    #[prost(bytes = "vec", tag = "4")]
    pub encoded_image_string: Vec<u8>,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Appends events to one new file in a model dir.
pub struct EventWriter {
    records: RecordWriter<BufWriter<File>>,
    path: PathBuf,
}

impl EventWriter {
    /// Creates `events.out.tfevents.<seconds>.<host>` in `dir` and writes the version event.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .ok()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".into());
        let seconds = now() as u64;
        let mut path = dir.join(format!("events.out.tfevents.{seconds}.{host}"));
        // a second writer in the same second (a quick resume) gets its own file
        let mut n = 1;
        while path.exists() {
            path = dir.join(format!("events.out.tfevents.{seconds}.{host}.{n}"));
            n += 1;
        }
        let file = OpenOptions::new()
            .create_new(true)
            .write(true)
            .open(&path)?;
        let mut writer = Self {
            records: RecordWriter::new(BufWriter::new(file)),
            path,
        };
        writer.write(&Event {
            wall_time: now(),
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
        })?;
        Ok(writer)
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write(&mut self, event: &Event) -> std::io::Result<()> {
        self.records.write(&event.encode_to_vec())?;
        self.records.get_mut().flush()
    }

    /// Writes one event with a scalar per `(tag, value)` at `step`, flushed to disk.
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> std::io::Result<()> {
        self.write(&Event {
            wall_time: now(),
            step: step as i64,
            file_version: None,
            summary: Some(Summary {
                value: values
                    .iter()
                    .map(|(tag, v)| SummaryValue {
                        tag: tag.to_string(),
                        simple_value: Some(*v as f32),
                        image: None,
                    })
                    .collect(),
            }),
        })
    }

    /// Writes one event with an RGB image under `tag` at `step` (PNG-encoded), flushed.
    pub fn image(&mut self, step: u64, tag: &str, image: &image::RgbImage) -> std::io::Result<()> {
        let mut png = Vec::new();
        image
            .write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
            .map_err(std::io::Error::other)?;
        self.write(&Event {
            wall_time: now(),
            step: step as i64,
            file_version: None,
            summary: Some(Summary {
                value: vec![SummaryValue {
                    tag: tag.to_string(),
                    simple_value: None,
                    image: Some(SummaryImage {
                        height: image.height() as i32,
                        width: image.width() as i32,
                        colorspace: 3,
                        encoded_image_string: png,
                    }),
                }],
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_framed_records_tensorboard_can_read() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalars(10, &[("loss/total", 2.5), ("learning_rate", 0.004)])
            .unwrap();
        w.scalars(20, &[("eval/voc_mAP", 0.75)]).unwrap();
        let picture = image::RgbImage::from_pixel(4, 3, image::Rgb([200, 10, 10]));
        w.image(20, "eval/image_0", &picture).unwrap();
        let name = w.path().file_name().unwrap().to_str().unwrap().to_string();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        // every record's length and payload CRCs check (data's reader verifies both)
        let records = data::tfrecord::read_all(w.path()).unwrap();
        let events: Vec<Event> = records
            .iter()
            .map(|r| Event::decode(r.as_slice()).unwrap())
            .collect();
        assert_eq!(events.len(), 4);
        let img = events[3].summary.as_ref().unwrap().value[0]
            .image
            .as_ref()
            .unwrap();
        assert_eq!((img.height, img.width, img.colorspace), (3, 4, 3));
        let decoded = image::load_from_memory(&img.encoded_image_string)
            .unwrap()
            .to_rgb8();
        assert_eq!(decoded, picture);
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        let s = events[1].summary.as_ref().unwrap();
        assert_eq!(events[1].step, 10);
        assert_eq!(s.value[0].tag, "loss/total");
        assert_eq!(s.value[0].simple_value, Some(2.5));
        assert_eq!(s.value[1].simple_value, Some(0.004f32));
        assert_eq!(events[2].step, 20);
        // the protobuf bytes as TF's own encoder lays them out: field 1 (double) wall time,
        // field 2 (varint) step 20, field 5 (message) summary
        let bytes = &records[2];
        assert_eq!(bytes[0], 0x09);
        assert_eq!(&bytes[9..11], &[0x10, 20]);
        assert_eq!(bytes[11], 0x2a);
        assert!(events[2].wall_time > 1.7e9);
    }
}
