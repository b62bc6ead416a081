//! The learner end to end on the CPU, with tiny networks: replicas stay identical, one or two
//! replicas equal one device averaging the micro-batch gradients (clipped by global norm),
//! kill-and-resume gives the uninterrupted result (weights and EMA), checkpoints resume on
//! another replica count, a diverging run stops naming the step; replicas against a manual
//! step also on the generic operations the GPU backends run.

use crate::common;

use common::{config, filters, losses, max_diff, prepare, run_on, weights};

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use burn::backend::{Autodiff, Flex, NdArray};
use burn::module::{AutodiffModule, Module};
use burn::optim::Optimizer;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::tensor::{ElementConversion, Tensor};
use data::loader::{Loader, LoaderConfig, Position};
use data::shards::expand_patterns;
use data::tfrecord::RecordIndex;
use model::Ssd;
use model::loss::compute_loss;
use model::ops::SsdBackend;
use model::targets::assign_targets;
use model::weights::load_weights;
use prost::Message;
use train::config::{LearningRate, OptimizerConfig, TrainConfig};
use train::eval::{evaluate, run_on_dataset};
use train::learner::{RunOptions, RunSummary, STOPPED_EXIT_STATUS, train};
use train::optim::{TfOptimizer, clip_by_global_norm, squared_global_norm};
use train::report::events::Event;
use train::sync::{Bucketing, flatten_gradients, unflatten_gradients};
use train::trained::{TrainedModel, Weights};

type B = Flex;

fn run(config: &TrainConfig, model_dir: &Path, replicas: usize) -> anyhow::Result<RunSummary> {
    run_on::<B>(config, model_dir, &vec![Default::default(); replicas])
}

#[test]
fn three_replicas_stay_identical_and_evaluate() {
    let data = tempfile::tempdir().unwrap();
    prepare(data.path());
    let runs = tempfile::tempdir().unwrap();
    let mut c = config(data.path(), 3);
    c.train.batch_size = 6;
    c.train.checkpoint_every = 1;
    c.train.moving_average_decay = Some(0.99);
    // every checkpoint compares the replicas' weights byte for byte
    let summary = run(&c, runs.path(), 3).unwrap();
    assert_eq!(summary.step, 3);
    assert!(summary.last_loss.total.is_finite());
    let m = summary.metrics.expect("final evaluation");
    assert!(m.AP >= 0.0 && m.voc_mAP >= 0.0);
    let lines = std::fs::read_to_string(runs.path().join("metrics.jsonl")).unwrap();
    assert!(lines.lines().count() >= 4, "{lines}");
    // each logged step reports the anchors matched and the negatives mined per image (at
    // most 3 per positive with the default miner)
    for line in lines.lines().filter(|l| l.contains("\"loss\"")) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let matched = v["targets"]["matched_per_image"].as_f64().unwrap();
        let mined = v["targets"]["mined_negatives_per_image"].as_f64().unwrap();
        assert!(
            matched > 0.0 && mined > 0.0 && mined <= 3.0 * matched + 1e-6,
            "{line}"
        );
    }
    assert!(runs.path().join("ckpt-00000003/ema.mpk").is_file());
    // the run keeps its whole config, for `eval` and `export` to take its data from
    let (kept_file, kept) = TrainConfig::of_run(runs.path()).unwrap().unwrap();
    assert_eq!(kept_file, runs.path().join(train::config::RUN_CONFIG_FILE));
    assert_eq!(kept, c);
    // the TensorBoard events: the losses of every logged step and the final evaluation
    let events_file = std::fs::read_dir(runs.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("events.out.tfevents.")
        })
        .expect("an event file");
    let events: Vec<Event> = data::tfrecord::read_all(&events_file)
        .unwrap()
        .iter()
        .map(|r| Event::decode(r.as_slice()).unwrap())
        .collect();
    let scalars: Vec<(i64, String, f32)> = events
        .iter()
        .filter_map(|e| e.summary.as_ref().map(|s| (e.step, s)))
        .flat_map(|(step, s)| {
            s.value
                .iter()
                .filter_map(move |v| v.simple_value.map(|x| (step, v.tag.clone(), x)))
        })
        .collect();
    let total: Vec<i64> = scalars
        .iter()
        .filter(|s| s.1 == "loss/total")
        .map(|s| s.0)
        .collect();
    assert_eq!(total, vec![1, 2, 3], "log_every 1");
    assert!(
        scalars
            .iter()
            .any(|s| s.1 == "targets/mined_negatives_per_image" && s.0 == 3)
    );
    let map = scalars
        .iter()
        .find(|s| s.1 == "eval/voc_mAP")
        .expect("eval scalars");
    assert_eq!((map.0, map.2), (3, m.voc_mAP as f32));
    assert!(scalars.iter().any(|s| s.1 == "eval/AP50" && s.0 == 3));
    // and the first evaluation images with their detections drawn
    let images: Vec<&str> = events
        .iter()
        .filter_map(|e| e.summary.as_ref())
        .flat_map(|s| s.value.iter())
        .filter(|v| v.image.is_some())
        .map(|v| v.tag.as_str())
        .collect();
    assert_eq!(images, ["eval/image_0", "eval/image_1", "eval/image_2"]);

    // the evaluation in the run is `eval`'s of the checkpoint's moving averages, not of its
    // raw weights
    let eval_of = |weights: Weights| {
        let dir = runs.path().join("ckpt-00000003");
        let trained = TrainedModel::locate(&dir, None, Some(weights)).unwrap();
        let net = trained.load::<B>(&Default::default()).unwrap();
        let index = RecordIndex::build(&expand_patterns(&c.data.eval).unwrap()).unwrap();
        let sizes = (c.eval.max_images, c.eval.batch_size);
        let stop = AtomicBool::new(false);
        let run = run_on_dataset(&net, &c.model, &index, sizes, 0, &Default::default(), &stop);
        let names: Vec<String> = (1..=2).map(|i| c.model.class_name(i)).collect();
        evaluate(&run.unwrap().unwrap().results, &names)
    };
    let (ema, raw) = (eval_of(Weights::MovingAverage), eval_of(Weights::Raw));
    assert_eq!(m, ema);
    // the moving-average file holds the BatchNorm statistics averaged over the replicas
    // (whose batches differ), as the raw file does
    let stats = |weights: Weights| -> Vec<f32> {
        let dir = runs.path().join("ckpt-00000003");
        let net = TrainedModel::locate(&dir, None, Some(weights))
            .unwrap()
            .load::<B>(&Default::default())
            .unwrap();
        net.batch_norms()
            .iter()
            .flat_map(|bn| {
                let (mean, var) = bn.moving_stats();
                [mean, var]
            })
            .flat_map(|t| t.into_data().to_vec::<f32>().unwrap())
            .collect()
    };
    assert_eq!(stats(Weights::MovingAverage), stats(Weights::Raw));
    assert_ne!(
        m, raw,
        "the raw weights score as the moving averages do: {m:?}"
    );
}

/// Trains one step with `replicas` replicas (the batch split between them) and checks it
/// against the same step done by hand: each part's gradients, their mean, clipped by global
/// norm, one optimizer step; BatchNorm statistics averaged. The clipping norm is `clip` times
/// the mean gradient's own: below 1 it binds (and the step must differ from the unclipped
/// one), above 1 it does not (and the step must differ from one on the summed gradients,
/// which clipping would hide). The filters' change from the initial weights is compared,
/// relative to its size: a missing, doubled or unaveraged replica's gradient, or no step at
/// all, moves it by a large fraction.
fn learner_equals_manual_step<B: SsdBackend>(replicas: usize, clip: f32) {
    let data = tempfile::tempdir().unwrap();
    prepare(data.path());
    let mut c = config(data.path(), 1);
    let device = Default::default();
    let index = Arc::new(RecordIndex::build(&expand_patterns(&c.data.train).unwrap()).unwrap());
    let loader_config = LoaderConfig {
        batch_size: 4,
        image_size: c.model.image_size,
        num_classes: c.model.num_classes,
        augmentations: c.data.augmentation.clone(),
        shuffle: true,
        seed: c.train.seed,
        workers: 1,
        prefetch: 1,
        share: None,
    };
    let batch = Loader::new(index, loader_config, Position::default())
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    let anchors = model::ssd::anchors(&c.model);
    let base = c.model.init::<Autodiff<B>>(c.train.seed, &device).unwrap();
    let mut sum: Option<Vec<Tensor<B, 1>>> = None;
    let mut layout = None;
    let mut stats = Vec::new();
    for part in batch.split(replicas) {
        let net = c
            .model
            .init::<Autodiff<B>>(c.train.seed, &device)
            .unwrap()
            .load_record(base.clone().into_record());
        let targets: Vec<_> = part
            .ground_truth
            .iter()
            .map(|g| assign_targets(&c.model.matcher, &c.model.box_coder(), &anchors, g))
            .collect();
        let loss = compute_loss(
            &net,
            &c.model,
            &anchors,
            part.images_tensor(&device),
            &targets,
        );
        let grads = loss.gradients(&net);
        let (l, buckets) = flatten_gradients(&net, grads, None, Bucketing::Joined);
        layout = Some(l);
        sum = Some(match sum {
            None => buckets,
            Some(s) => s.into_iter().zip(buckets).map(|(a, b)| a + b).collect(),
        });
        stats.push(train::sync::bn_stats_flat(&net.valid()));
    }
    let (layout, n) = (layout.unwrap(), replicas as f64);
    let sum = sum.unwrap();
    let mean: Vec<_> = sum.iter().map(|b| b.clone().div_scalar(n)).collect();
    let stats = stats
        .into_iter()
        .reduce(|a, b| a + b)
        .unwrap()
        .div_scalar(n);
    let norm = |buckets: &[Tensor<B, 1>]| {
        let grads = unflatten_gradients::<Autodiff<B>>(&layout, buckets.to_vec());
        let squared = squared_global_norm(&base, &grads).expect("gradients");
        squared.into_scalar().elem::<f32>().sqrt()
    };
    let limit = clip * norm(&mean);
    let manual = |buckets: &[Tensor<B, 1>], clip: Option<f32>| {
        let mut grads = unflatten_gradients::<Autodiff<B>>(&layout, buckets.to_vec());
        if let Some(clip) = clip {
            let norm = squared_global_norm(&base, &grads).expect("gradients");
            grads = clip_by_global_norm(&base, grads, clip, norm);
        }
        let mut optim: OptimizerAdaptor<TfOptimizer, Ssd<Autodiff<B>>, Autodiff<B>> =
            OptimizerAdaptor::from(TfOptimizer::from(&c.train.optimizer));
        let stepped = optim.step(0.002, base.clone(), grads).valid();
        train::sync::set_bn_stats_flat(&stepped, stats.clone());
        filters(&stepped)
    };
    c.train.gradient_clipping_by_norm = Some(limit);
    let runs = tempfile::tempdir().unwrap();
    run_on::<B>(&c, runs.path(), &vec![Default::default(); replicas]).unwrap();
    let dir = train::checkpoint::latest(runs.path()).unwrap().unwrap();
    let learned: Ssd<B> = load_weights(&c.model, &dir.join("model.mpk"), &device).unwrap();
    let from_learner = filters(&learned);
    let want = manual(&mean, Some(limit));
    let update = max_diff(&want, &filters(&base.valid()));
    let d = max_diff(&from_learner, &want);
    assert!(d <= 1e-3 * update, "difference {d}, update {update}");
    // what a wrong step would give is far from it
    let other = if clip < 1.0 {
        manual(&mean, None)
    } else {
        manual(&sum, Some(limit))
    };
    let wrong = max_diff(&from_learner, &other);
    assert!(wrong > 0.1 * update, "a wrong step differs by only {wrong}");
}

#[test]
fn two_replicas_equal_gradient_averaging_on_one_device() {
    learner_equals_manual_step::<Flex>(2, 0.5);
    learner_equals_manual_step::<Flex>(2, 2.0);
}

#[test]
fn one_replica_equals_its_own_gradients() {
    learner_equals_manual_step::<Flex>(1, 0.5);
}

/// The same on the generic operations the GPU backends run (burn-ndarray takes every
/// default), the loss gradient and the heads' backward pass included.
#[test]
fn two_replicas_equal_gradient_averaging_on_the_generic_operations() {
    learner_equals_manual_step::<NdArray>(2, 2.0);
}

/// A measurement, not a check (`cargo test --release --workspace --test integration
/// learner::two_cpu_backends -- --ignored`, needs `datasets/synthetic`): configs/synthetic.json for 20 steps on two
/// replicas of burn-flex and of burn-ndarray, each step's loss printed side by side. Two
/// correct CPU backends drift apart by rounding as wgpu and the CPU do (docs/src/performance.md).
#[test]
#[ignore = "a measurement of several minutes"]
fn two_cpu_backends_drift_apart_on_the_synthetic_config() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut c = TrainConfig::load(&root.join("configs/synthetic.json")).unwrap();
    c.train.num_steps = 20;
    c.train.log_every = 1;
    c.data.eval.clear();
    for pattern in &mut c.data.train {
        *pattern = root.join(&*pattern).display().to_string();
    }
    let (flex, ndarray) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    run_on::<Flex>(&c, flex.path(), &[Default::default(); 2]).unwrap();
    run_on::<NdArray>(&c, ndarray.path(), &[Default::default(); 2]).unwrap();
    let (a, b) = (losses(flex.path()), losses(ndarray.path()));
    assert_eq!((a.len(), b.len()), (20, 20));
    println!("step, burn-flex, burn-ndarray, relative difference");
    for (step, (x, y)) in a.iter().zip(&b).enumerate() {
        println!("{}, {x:.4}, {y:.4}, {:.1e}", step + 1, (x - y).abs() / x);
    }
}

/// A run "killed" after step 2 and resumed from its checkpoint ends where the same run
/// without the interruption ends: weights, optimizer slots and data position all come back.
fn interrupted_and_resumed_equals_uninterrupted(replicas: usize) {
    let data = tempfile::tempdir().unwrap();
    prepare(data.path());
    // with the weight EMA, which a resume must restore, not rebuild from the weights
    let steps = |n| {
        let mut c = config(data.path(), n);
        c.train.moving_average_decay = Some(0.9);
        c
    };
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    run(&steps(4), a.path(), replicas).unwrap();
    run(&steps(2), b.path(), replicas).unwrap();
    let resumed = run(&steps(4), b.path(), replicas).unwrap();
    assert_eq!((resumed.step, resumed.steps_this_run), (4, 2));
    let d = max_diff(&weights(&steps(4), a.path()), &weights(&steps(4), b.path()));
    assert!(d < 1e-6, "max difference {d}");
    let [(raw, ema), (_, resumed_ema)] = [a.path(), b.path()].map(|dir| {
        let latest = train::checkpoint::latest(dir).unwrap().unwrap();
        let load = |file: &str| {
            let net: Ssd<B> =
                load_weights(&steps(4).model, &latest.join(file), &Default::default()).unwrap();
            filters(&net)
        };
        (load("model.mpk"), load("ema.mpk"))
    });
    let d = max_diff(&ema, &resumed_ema);
    assert!(d < 1e-6, "moving averages differ by {d}");
    let apart = max_diff(&ema, &raw);
    assert!(
        apart > 1e-5,
        "the moving average is only {apart} from the weights"
    );
    // nothing left to do: a third run resumes at 4 and stops
    assert_eq!(
        run(&steps(4), b.path(), replicas).unwrap().steps_this_run,
        0
    );
}

#[test]
fn interrupted_and_resumed_equals_uninterrupted_on_one_replica() {
    interrupted_and_resumed_equals_uninterrupted(1);
}

#[test]
fn interrupted_and_resumed_equals_uninterrupted_on_two_replicas() {
    interrupted_and_resumed_equals_uninterrupted(2);
}

/// A run that reached `num_steps` without its final evaluation (a stop request came first)
/// ends as stopped, not as finished, and resuming it evaluates the last checkpoint, once.
#[test]
fn a_final_evaluation_cut_short_is_done_on_resume() {
    let data = tempfile::tempdir().unwrap();
    prepare(data.path());
    let runs = tempfile::tempdir().unwrap();
    let mut c = config(data.path(), 2);
    c.eval.every = 0;
    let resume = |stop: bool| {
        let options = RunOptions {
            model_dir: runs.path().to_path_buf(),
            stop: Arc::new(AtomicBool::new(stop)),
            verbose: false,
            nodes: None,
            repeat_first_batch: false,
            without_lock: false,
        };
        train::<B>(&c, &[Default::default()], &options).unwrap()
    };
    // the steps trained, the checkpoint written, the evaluation not yet done
    let mut no_eval = c.clone();
    no_eval.data.eval.clear();
    let trained = run(&no_eval, runs.path(), 1).unwrap();
    assert_eq!((trained.step, trained.metrics.is_none()), (2, true));
    // a stop request before the evaluation: stopped, so that a requeue comes back
    let stopped = resume(true);
    assert!(stopped.stopped && stopped.metrics.is_none());
    let evaluated = resume(false);
    assert!(!evaluated.stopped);
    assert_eq!(evaluated.steps_this_run, 0);
    assert!(evaluated.metrics.is_some(), "the final evaluation");
    let log = std::fs::read_to_string(runs.path().join("metrics.jsonl")).unwrap();
    let evals: Vec<u64> = log
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("eval").is_some())
        .map(|v| v["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evals, [2], "{log}");
    // and once evaluated, nothing is left to do
    let again = resume(false);
    assert!(!again.stopped && again.metrics.is_none());
    assert_eq!(
        std::fs::read_to_string(runs.path().join("metrics.jsonl")).unwrap(),
        log
    );
}

#[test]
fn checkpoints_move_between_replica_counts() {
    let data = tempfile::tempdir().unwrap();
    prepare(data.path());
    let runs = tempfile::tempdir().unwrap();
    run(&config(data.path(), 2), runs.path(), 2).unwrap();
    let state = train::checkpoint::read_state(&runs.path().join("ckpt-00000002")).unwrap();
    assert_eq!((state.replicas, state.position.index), (2, 8));
    let s = run(&config(data.path(), 4), runs.path(), 1).unwrap();
    assert_eq!((s.step, s.steps_this_run), (4, 2));
    let state = train::checkpoint::read_state(&runs.path().join("ckpt-00000004")).unwrap();
    assert_eq!((state.replicas, state.position.index), (1, 16));
    let s = run(&config(data.path(), 6), runs.path(), 2).unwrap();
    assert_eq!(s.step, 6);
}

#[test]
fn faults_are_clear_errors() {
    let data = tempfile::tempdir().unwrap();
    prepare(data.path());
    // a diverging run stops at the step where the loss is no longer finite
    let runs = tempfile::tempdir().unwrap();
    let mut c = config(data.path(), 200);
    c.train.optimizer = OptimizerConfig::Momentum {
        learning_rate: LearningRate::Constant {
            learning_rate: 1e12,
        },
        momentum: 0.9,
    };
    let err = format!("{:#}", run(&c, runs.path(), 1).unwrap_err());
    assert!(
        err.contains("at step") && err.contains("last good checkpoint"),
        "{err}"
    );
    // the checkpoint it names holds finite weights, and none after it was written
    let kept = train::checkpoint::latest(runs.path())
        .unwrap()
        .expect("a checkpoint before the divergence");
    assert!(
        err.contains(&format!("last good checkpoint: {}", kept.display())),
        "{err}"
    );
    let diverged_at: u64 = err
        .split("at step ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(train::checkpoint::read_state(&kept).unwrap().step <= diverged_at);
    for (name, values) in tensor_bits(&c, &kept, "model.mpk") {
        assert!(
            values.iter().all(|v| f32::from_bits(*v).is_finite()),
            "{name} is not finite"
        );
    }
    // a global batch that does not split over the replicas
    let err = format!(
        "{:#}",
        run(&config(data.path(), 1), runs.path(), 3).unwrap_err()
    );
    assert!(err.contains("does not split evenly"), "{err}");
    // missing data names the pattern
    let mut c = config(data.path(), 1);
    c.data.train = vec!["/nonexistent/train-*".into()];
    let err = format!("{:#}", run(&c, runs.path(), 1).unwrap_err());
    assert!(err.contains("/nonexistent/train-*"), "{err}");
}

/// A `--train-data` that matches nothing (a typo of the synthetic set's folder) is an error
/// naming it, and nothing is written: no synthetic set generated in its place, no model dir.
#[test]
fn a_mistyped_data_path_is_an_error_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/synthetic.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .current_dir(dir.path())
        .arg("--config")
        .arg(&config)
        .args(["--devices", "cpu", "--model-dir", "run"])
        .args(["--train-data", "datasets/synthtic/train.record-*"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("datasets/synthtic/train.record-*: no file matches"),
        "{stderr}"
    );
    let written: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(written.is_empty(), "{written:?}");
}

/// `train` as a child process on `config` with extra arguments.
fn train_process(config: &Path, model_dir: &Path, args: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_train"));
    cmd.arg("--config")
        .arg(config)
        .arg("--model-dir")
        .arg(model_dir)
        .arg("--no-eval")
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    cmd
}

/// [`train_process`]'s program and arguments, for mpirun.
#[cfg(feature = "mpi")]
fn train_args(config: &Path, model_dir: &Path, args: &[&str]) -> Vec<String> {
    let mut all: Vec<String> = vec![env!("CARGO_BIN_EXE_train").into(), "--config".into()];
    all.push(config.display().to_string());
    all.push("--model-dir".into());
    all.push(model_dir.display().to_string());
    all.push("--no-eval".into());
    all.extend(args.iter().map(|a| a.to_string()));
    all
}

/// Open MPI's `mpirun` on this machine, as root where the tests run as root, one process per
/// `(count, train arguments)` group (MPMD: `-np 1 A : -np 1 B`), output captured.
#[cfg(feature = "mpi")]
fn mpirun(groups: &[(usize, Vec<String>)]) -> std::process::Command {
    let mut cmd = std::process::Command::new("mpirun");
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
    ]);
    for (i, (count, args)) in groups.iter().enumerate() {
        if i > 0 {
            cmd.arg(":");
        }
        cmd.args(["-np", &count.to_string()]).args(args);
    }
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    cmd
}

/// Waits until rank 0 has logged `steps` steps in `model_dir`.
fn wait_for_steps(model_dir: &Path, steps: usize) {
    let metrics = model_dir.join("metrics.jsonl");
    let started = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(true, |m| m.lines().count() < steps) {
        assert!(started.elapsed().as_secs() < 300, "the run never trained");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

fn finish(child: std::process::Child) -> (bool, String) {
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The exit status and standard error of a finished job.
#[cfg(feature = "mpi")]
fn finish_job(child: std::process::Child) -> (Option<i32>, String) {
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The processes whose parent is `parent` (mpirun's ranks), from /proc.
#[cfg(feature = "mpi")]
fn children(parent: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // "pid (name) state ppid ...": the name may hold spaces, so read after the ')'
            let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
            after.split_whitespace().nth(1) == Some(&parent.to_string())
        })
        .collect()
}

/// Processes launched by mpirun train as one run: two processes of two CPU replicas equal one
/// process of four bit for bit (the sum over two processes is `a + b`, the single process's
/// balanced sum of its two halves), resumed too; four processes of one replica resume the
/// two-process run within float tolerance; only rank 0 writes the model dir; a process that
/// starts elsewhere ends the job on every rank; SIGUSR1 to mpirun (which passes it on) stops
/// every rank after the same step with rank 0's checkpoint; `kill -9` of one rank ends the job.
/// Without the `mpi` feature (README's test command, which needs no Open MPI) the multi-node
/// test is not built: it shows as ignored, with the reason, and fails if run anyway. CI runs
/// the real one with `--features train/mpi`.
#[cfg(not(feature = "mpi"))]
#[test]
#[ignore = "skipped: needs `--features train/mpi` (Open MPI and libclang)"]
fn processes_under_mpirun_train_as_one_run_and_fail_as_one_job() {
    panic!("built without `--features train/mpi`: the multi-node test cannot run");
}

#[cfg(feature = "mpi")]
#[test]
fn processes_under_mpirun_train_as_one_run_and_fail_as_one_job() {
    let data = tempfile::tempdir().unwrap();
    prepare(data.path());
    let runs = tempfile::tempdir().unwrap();
    let mut c = config(data.path(), 2);
    c.train.moving_average_decay = Some(0.9);
    let config_file = runs.path().join("tiny.json");
    std::fs::write(&config_file, serde_json::to_string(&c).unwrap()).unwrap();
    let (one, two) = (runs.path().join("one"), runs.path().join("two"));
    let rank1_dir = runs.path().join("rank1");
    let args = |dir: &Path, extra: &[&str]| train_args(&config_file, dir, extra);

    for steps in ["2", "4"] {
        let single = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
            .args(&args(&one, &["--devices", "cpu:4", "--num-steps", steps])[1..])
            .output()
            .unwrap();
        assert!(
            single.status.success(),
            "{}",
            String::from_utf8_lossy(&single.stderr)
        );
        // the first time rank 1 is given a model dir of its own: it must write nothing
        // there (resuming, it reads the checkpoint from the dir rank 0 writes)
        let extra = ["--devices", "cpu:2", "--num-steps", steps];
        let rank1 = if steps == "2" { &rank1_dir } else { &two };
        let mut job = mpirun(&[(1, args(&two, &extra)), (1, args(rank1, &extra))]);
        let (status, log) = finish_job(job.spawn().unwrap());
        assert_eq!(status, Some(0), "{log}");
        assert!(
            log.contains("process 0 of 2; exchange between processes: MPI through host memory ("),
            "{log}"
        );
        if steps == "4" {
            assert!(log.contains("resuming from"), "{log}");
        }
        let state =
            train::checkpoint::read_state(&train::checkpoint::latest(&two).unwrap().unwrap())
                .unwrap();
        assert_eq!(state.step.to_string(), steps);
        assert_eq!(weights(&c, &one), weights(&c, &two), "after {steps} steps");
        assert_eq!(losses(&one), losses(&two));
        let written: Vec<_> = std::fs::read_dir(&rank1_dir).unwrap().collect();
        assert!(written.is_empty(), "rank 1 wrote {written:?}");
    }

    // another process count resumes the run: four processes of one replica each, two more
    // steps, against the single process of four replicas (the sum over four processes is
    // formed in MPI's order, not the balanced one: close, not equal)
    let single = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args(&args(&one, &["--devices", "cpu:4", "--num-steps", "6"])[1..])
        .output()
        .unwrap();
    assert!(single.status.success());
    let extra = ["--devices", "cpu", "--num-steps", "6"];
    let (status, log) = finish_job(mpirun(&[(4, args(&two, &extra))]).spawn().unwrap());
    assert_eq!(status, Some(0), "{log}");
    let (w1, w4) = (weights(&c, &one), weights(&c, &two));
    let largest = w1.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = max_diff(&w1, &w4);
    eprintln!(
        "4 processes against 1 of 4 replicas after 6 steps: weights differ by {diff:e} (largest {largest})"
    );
    assert!(diff <= 1e-5 * largest.max(1.0), "weights differ by {diff}");
    for (a, b) in losses(&one).iter().zip(losses(&two)) {
        assert!((a - b).abs() <= 1e-4 * a.abs(), "losses {a} and {b}");
    }

    // a process that starts elsewhere (rank 1's dir holds the step-6 checkpoint, rank 0's
    // nothing) ends the job before the first step, the error printed, nothing written
    let fresh = runs.path().join("fresh");
    let extra = ["--devices", "cpu:2", "--num-steps", "8"];
    let mut job = mpirun(&[(1, args(&fresh, &extra)), (1, args(&one, &extra))]);
    let (status, log) = finish_job(job.spawn().unwrap());
    assert_ne!(status, Some(0), "{log}");
    assert!(
        log.contains("the replicas are not at the same point"),
        "{log}"
    );
    assert!(train::checkpoint::latest(&fresh).unwrap().is_none());

    // SIGUSR1 to mpirun, which passes it on to every rank: all stop after the same step,
    // rank 0 checkpoints there, and every rank exits with the stopped status
    let stopped = runs.path().join("stopped");
    let extra = ["--devices", "cpu", "--num-steps", "100000"];
    let job = mpirun(&[(2, args(&stopped, &extra))]).spawn().unwrap();
    wait_for_steps(&stopped, 2);
    let signal = |name: &str, pid: u32| {
        let sent = std::process::Command::new("kill")
            .args([name, &pid.to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
    };
    signal("-USR1", job.id());
    let (status, log) = finish_job(job);
    assert_eq!(status, Some(STOPPED_EXIT_STATUS.into()), "{log}");
    let state =
        train::checkpoint::read_state(&train::checkpoint::latest(&stopped).unwrap().unwrap())
            .unwrap();
    assert!(
        log.contains(&format!("stopped on request at step {} of", state.step)),
        "{log}"
    );

    // kill -9 of rank 1: mpirun ends the job, non-zero, within a minute
    let lost = runs.path().join("lost");
    let job = mpirun(&[(2, args(&lost, &extra))]).spawn().unwrap();
    wait_for_steps(&lost, 2);
    let ranks = children(job.id());
    assert_eq!(ranks.len(), 2, "mpirun's children: {ranks:?}");
    signal("-KILL", ranks[1]);
    let killed = std::time::Instant::now();
    let (status, log) = finish_job(job);
    let waited = killed.elapsed().as_secs_f64();
    eprintln!("kill -9 of a rank: mpirun ended {waited:.2} s later with {status:?}");
    assert_ne!(status, Some(0), "{log}");
    assert!(waited < 60.0, "the job took {waited:.0} s to end");

    // a rank that stops answering while alive (SIGSTOP: no launcher sees a death, as with a
    // lost link or srun without --kill-on-bad-exit): the others end the job after
    // --node-timeout, saying why
    let hung = runs.path().join("hung");
    let extra = [
        "--devices",
        "cpu",
        "--num-steps",
        "100000",
        "--node-timeout",
        "5",
    ];
    let job = mpirun(&[(2, args(&hung, &extra))]).spawn().unwrap();
    wait_for_steps(&hung, 2);
    let ranks = children(job.id());
    signal("-STOP", ranks[1]);
    let stopped_at = std::time::Instant::now();
    let (status, log) = finish_job(job);
    let waited = stopped_at.elapsed().as_secs_f64();
    eprintln!("a rank stopped: the job ended {waited:.2} s later with {status:?}");
    assert_ne!(status, Some(0), "{log}");
    assert!(
        log.contains("no answer from the other processes within 5 s (--node-timeout)"),
        "{log}"
    );
    assert!(waited < 60.0, "the job took {waited:.0} s to end");

    // processes with different numbers of replicas (2 and 1) train as one process of three
    let mut c3 = config(data.path(), 2);
    c3.train.batch_size = 6;
    c3.train.moving_average_decay = Some(0.9);
    let config3 = runs.path().join("three.json");
    std::fs::write(&config3, serde_json::to_string(&c3).unwrap()).unwrap();
    let (alone, apart) = (runs.path().join("alone"), runs.path().join("apart"));
    let single = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args(&train_args(&config3, &alone, &["--devices", "cpu:3"])[1..])
        .output()
        .unwrap();
    assert!(
        single.status.success(),
        "{}",
        String::from_utf8_lossy(&single.stderr)
    );
    let mut job = mpirun(&[
        (1, train_args(&config3, &apart, &["--devices", "cpu:2"])),
        (1, train_args(&config3, &apart, &["--devices", "cpu"])),
    ]);
    let (status, log) = finish_job(job.spawn().unwrap());
    assert_eq!(status, Some(0), "{log}");
    assert!(
        log.contains(
            "global batch 6 = 3 replica(s) over 2 processes (process 0: 2, process 1: 1) x 2"
        ),
        "{log}"
    );
    // the sum over the processes is formed in another order than one process's balanced
    // sum: close, not equal (a mean over 2 x 2 replicas would be a third off)
    let (w1, w3) = (weights(&c3, &alone), weights(&c3, &apart));
    let largest = w1.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = max_diff(&w1, &w3);
    eprintln!("2 + 1 replicas against 1 process of 3 after 2 steps: weights differ by {diff:e}");
    assert!(diff <= 1e-5 * largest.max(1.0), "weights differ by {diff}");
    for (a, b) in losses(&alone).iter().zip(losses(&apart)) {
        assert!((a - b).abs() <= 1e-4 * a.abs(), "losses {a} and {b}");
    }
}

#[test]
fn repeating_the_first_batch_reads_one_batch() {
    let data = tempfile::tempdir().unwrap();
    prepare(data.path());
    let runs = tempfile::tempdir().unwrap();
    let options = RunOptions {
        model_dir: runs.path().to_path_buf(),
        stop: Arc::new(AtomicBool::new(false)),
        verbose: false,
        nodes: None,
        repeat_first_batch: true,
        without_lock: false,
    };
    let s = train::<B>(&config(data.path(), 4), &[Default::default()], &options).unwrap();
    assert_eq!((s.step, s.steps_this_run), (4, 4));
    assert!(s.last_loss.total.is_finite());
    // four steps of batch 4, and the data read stopped after the first batch
    for step in [2, 4] {
        let dir = runs.path().join(format!("ckpt-{step:08}"));
        let state = train::checkpoint::read_state(&dir).unwrap();
        assert_eq!((state.step, state.position.index), (step, 4));
    }
}

/// Every tensor of a checkpoint's weights file (`model.mpk` or `ema.mpk`), as bits.
fn tensor_bits(config: &TrainConfig, checkpoint: &Path, file: &str) -> Vec<(String, Vec<u32>)> {
    let net: Ssd<B> =
        load_weights(&config.model, &checkpoint.join(file), &Default::default()).unwrap();
    model::tf::names::named_tensors(&net, &config.model)
        .into_iter()
        .map(|(name, _, values)| (name, values.iter().map(|v| v.to_bits()).collect()))
        .collect()
}

/// SIGTERM, as Slurm and Kubernetes send it before a kill: the run finishes its step, writes a
/// checkpoint there and exits with the stopped status within seconds. A second run on the
/// model dir meanwhile is refused at once, naming the first, which goes on undisturbed.
/// Resumed, the run ends with the weights of a run never stopped, bit for bit (raw and
/// moving average).
#[test]
fn sigterm_checkpoints_and_resumes_exactly_and_a_second_run_on_the_dir_is_refused() {
    let data = tempfile::tempdir().unwrap();
    prepare(data.path());
    let runs = tempfile::tempdir().unwrap();
    let mut c = config(data.path(), 100_000);
    c.train.moving_average_decay = Some(0.9);
    // no periodic checkpoint near the stop: the resume starts from the stop's own
    c.train.checkpoint_every = 100_000;
    let config_file = runs.path().join("tiny.json");
    std::fs::write(&config_file, serde_json::to_string(&c).unwrap()).unwrap();
    let (stopped, whole) = (runs.path().join("stopped"), runs.path().join("whole"));
    let cpu = ["--devices", "cpu"];
    let first = train_process(&config_file, &stopped, &cpu).spawn().unwrap();
    wait_for_steps(&stopped, 15);

    let asked = std::time::Instant::now();
    let second = train_process(&config_file, &stopped, &cpu)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&second.stderr);
    let holder = format!("in use by another training run (pid {} on ", first.id());
    assert!(!second.status.success() && log.contains(&holder), "{log}");
    assert!(
        asked.elapsed().as_secs() < 30,
        "refused after {:?}",
        asked.elapsed()
    );

    let signalled = std::time::Instant::now();
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &first.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let out = first.wait_with_output().unwrap();
    let waited = signalled.elapsed();
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(STOPPED_EXIT_STATUS.into()), "{log}");
    assert!(waited.as_secs() < 30, "exit {waited:?} after SIGTERM");
    assert!(
        log.contains("SIGTERM: stopping at the end of the step"),
        "{log}"
    );
    let checkpoint = train::checkpoint::latest(&stopped).unwrap().unwrap();
    let step = train::checkpoint::read_state(&checkpoint).unwrap().step;
    assert!(step >= 15 && log.contains(&format!("stopped on request at step {step} of ")));
    // the first run's log is its own: steps 1 to the stop, once each
    let logged: Vec<u64> = std::fs::read_to_string(stopped.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64())
        .collect();
    assert_eq!(logged, (1..=step).collect::<Vec<_>>());

    let end = (step + 3).to_string();
    for dir in [&stopped, &whole] {
        let args = ["--devices", "cpu", "--num-steps", &end];
        let (ok, log) = finish(train_process(&config_file, dir, &args).spawn().unwrap());
        assert!(ok, "{log}");
    }
    let [resumed, uninterrupted] =
        [&stopped, &whole].map(|dir| train::checkpoint::latest(dir).unwrap().unwrap());
    for file in ["model.mpk", "ema.mpk"] {
        assert!(
            tensor_bits(&c, &resumed, file) == tensor_bits(&c, &uninterrupted, file),
            "{file} after the resume differs from the uninterrupted run's"
        );
    }
}

/// Shards prepared from a COCO file (sparse category ids, a crowd region, an image without
/// annotations) train and evaluate.
#[test]
fn trains_on_shards_prepared_from_a_coco_file() {
    use data::coco::{CocoOptions, prepare_coco};
    use serde_json::json;

    let data = tempfile::tempdir().unwrap();
    let images = data.path().join("images");
    std::fs::create_dir_all(&images).unwrap();
    for i in 0..4u32 {
        let img = image::RgbImage::from_fn(80, 64, |x, y| {
            image::Rgb([(x * 3) as u8, (y * 4) as u8, (i * 60) as u8])
        });
        img.save(images.join(format!("{i}.jpg"))).unwrap();
    }
    let image = |id: u32| json!({"id": id, "file_name": format!("{}.jpg", id % 4), "width": 80, "height": 64});
    let boxes = |id: u32| {
        let category = if id.is_multiple_of(2) { 7 } else { 2 };
        json!([
            {"id": 10 * id, "image_id": id, "category_id": category, "bbox": [8, 6, 40, 30]},
            {"id": 10 * id + 1, "image_id": id, "category_id": 2, "bbox": [50, 30, 30, 34],
             "iscrowd": u32::from(id == 3)},
        ])
    };
    let file = |name: &str, ids: std::ops::Range<u32>| {
        let annotations: Vec<serde_json::Value> = ids
            .clone()
            .filter(|&id| id != 5)
            .flat_map(|id| boxes(id).as_array().unwrap().clone())
            .collect();
        let coco = json!({
            "images": ids.map(image).collect::<Vec<_>>(),
            "annotations": annotations,
            "categories": [{"id": 7, "name": "dog"}, {"id": 2, "name": "cat"}],
        });
        let path = data.path().join(name);
        std::fs::write(&path, coco.to_string()).unwrap();
        path
    };
    for (split, ids, shards) in [("train", 0..8, 2), ("val", 8..11, 1)] {
        let options = CocoOptions {
            images: images.clone(),
            split: split.into(),
            num_shards: shards,
            contiguous_ids: false,
            skip_empty: false,
            skip_invalid: false,
        };
        let json = file(&format!("{split}.json"), ids);
        prepare_coco(&json, data.path(), &options, &|_, _| {}).unwrap();
    }
    let runs = tempfile::tempdir().unwrap();
    let mut c = config(data.path(), 2);
    // the label-map ids are COCO's: 2 and 7
    c.model.num_classes = 7;
    c.eval.max_images = 3;
    let summary = run(&c, runs.path(), 1).unwrap();
    assert_eq!(summary.step, 2);
    assert!(summary.last_loss.total.is_finite());
    assert!(summary.metrics.expect("final evaluation").AP >= 0.0);
}

/// Quantization-aware training on two replicas, the quantization in effect from step 1: the
/// run's checkpoints (each compares the replicas' weights and states byte for byte) hold one
/// learned range per unit and per kind of head, updated once a step, and `train export --quantize int8`
/// takes them without calibration records.
#[test]
fn quantization_aware_training_shares_its_ranges_and_exports_them() {
    let data = tempfile::tempdir().unwrap();
    prepare(data.path());
    let runs = tempfile::tempdir().unwrap();
    let mut c = config(data.path(), 3);
    c.train.checkpoint_every = 1;
    c.model.quantization = Some(model::config::QuantizationConfig {
        delay: 1,
        ..Default::default()
    });
    let summary = run(&c, runs.path(), 2).unwrap();
    assert!(summary.last_loss.total.is_finite());
    let ckpt = runs.path().join("ckpt-00000003/model.mpk");
    let net: Ssd<B> = load_weights(&c.model, &ckpt, &Default::default()).unwrap();
    let ranges = net.activation_ranges();
    // 35 convolution units, the box-code heads' and the class-logit heads'
    assert_eq!(ranges.len(), 37);
    for range in &ranges {
        let updates: f32 = range.updates.value().into_scalar().elem();
        let [min, max] = range.learned().expect("learned");
        assert!(
            updates == 3.0 && min <= 0.0 && max > 0.0,
            "{updates} {min} {max}"
        );
    }
    // a float config cannot load them by mistake
    let float = model::SsdConfig {
        quantization: None,
        ..c.model.clone()
    };
    let float_net: Ssd<B> = load_weights(&float, &ckpt, &Default::default()).unwrap();
    assert!(float_net.activation_ranges().is_empty());
    let out = runs.path().join("int8.tflite");
    let export = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args([
            "export",
            "--format",
            "tflite",
            "--quantize",
            "int8",
            "--model-dir",
        ])
        .arg(runs.path())
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&export.stderr);
    assert!(export.status.success(), "{text}");
    assert!(
        text.contains("learned in quantization-aware training"),
        "{text}"
    );
    assert!(out.is_file());
}
