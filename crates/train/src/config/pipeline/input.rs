//! The input readers (`train_input_reader`, `eval_input_reader`) and `eval_config`.

use data::textproto::{Scalar, Value};

use super::section::{Report, Section};
use crate::config::settings::EvalSettings;

/// `(input paths, label map path)` of an input reader.
pub(super) fn read_input(mut r: Section, report: &mut Report) -> (Vec<String>, Option<String>) {
    let mut paths = Vec::new();
    if let Some((_, mut t)) = r.one_of(&["tf_record_input_reader"], report) {
        for f in t.take("input_path") {
            match &f.value {
                Value::Scalar(Scalar::Str(p)) => paths.push(p.clone()),
                _ => report
                    .errors
                    .push(format!("{}: expected a quoted path", t.at(f))),
            }
        }
        t.finish(report);
    }
    for p in &paths {
        if p.contains("PATH_TO_BE_CONFIGURED") {
            report
                .notes
                .push(format!("{}: {p} still has to be filled in", r.path));
        }
    }
    let label_map = Some(r.word("label_map_path", "", report)).filter(|p| !p.is_empty());
    r.ignore(
        &[
            "shuffle",
            "num_readers",
            "num_epochs",
            "queue_capacity",
            "min_after_dequeue",
            "read_block_length",
            "prefetch_size",
            "num_parallel_map_calls",
            "num_parallel_batches",
            "num_prefetch_batches",
            "filenames_shuffle_buffer_size",
            "shuffle_buffer_size",
            "sample_1_of_n_examples",
            "max_number_of_boxes",
            "num_additional_channels",
            "load_instance_masks",
            "mask_type",
            "use_display_name",
        ],
        "the loader shuffles every epoch with train.seed and reads with data.workers threads",
        report,
    );
    r.finish(report);
    (paths, label_map)
}

/// `eval_config`: how many images are evaluated; the rest steers TF's evaluator.
pub(super) fn read_eval_config(mut e: Section, report: &mut Report) -> EvalSettings {
    let eval = EvalSettings {
        max_images: e.number("num_examples", 5000usize, report),
        ..EvalSettings::default()
    };
    e.ignore(
            &[
                "batch_size",
                "max_evals",
                "num_visualizations",
                "visualization_export_dir",
                "eval_interval_secs",
                "metrics_set",
                "use_moving_averages",
                "export_path",
                "ignore_groundtruth",
                "min_score_threshold",
                "max_num_boxes_to_visualize",
                "skip_scores",
                "skip_labels",
                "visualize_groundtruth_boxes",
                "groundtruth_box_visualization_color",
                "keep_image_id_for_visualization_export",
                "retain_original_images",
                "include_metrics_per_category",
                "recall_lower_bound",
                "recall_upper_bound",
            ],
            "evaluation runs at `eval.every` steps and at the end of training, with COCO and VOC metrics and EMA weights when kept",
            report,
        );
    e.finish(report);
    eval
}
