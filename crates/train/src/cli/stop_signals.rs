//! Stop requests from outside the process: SIGINT (Ctrl-C), SIGTERM (what Slurm, Kubernetes
//! and spot-instance reclaimers send before they kill a job) and SIGUSR1 (Slurm's
//! `--signal`). The first sets the run's stop flag: the run stops at the end of the step that
//! carries the request, writes a checkpoint there and exits with
//! [`train::learner::STOPPED_EXIT_STATUS`]. Another, a second or more later, ends the process
//! at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
use signal_hook::iterator::Signals;

/// The signals that ask a run to stop, with their names for the messages.
const STOP_SIGNALS: [(i32, &str); 3] = [
    (SIGINT, "SIGINT"),
    (SIGTERM, "SIGTERM"),
    (SIGUSR1, "SIGUSR1"),
];

/// A repeat this soon after the first request is the same request delivered twice (a
/// launcher may forward a signal its tasks also received), not a person insisting.
const REPEAT_WINDOW: Duration = Duration::from_secs(1);

/// A flag that the stop signals set.
pub fn stop_flag() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for (signal, name) in STOP_SIGNALS {
        // set within the handler itself: nothing can delay the request
        signal_hook::flag::register(signal, stop.clone())
            .with_context(|| format!("installing the {name} handler"))?;
    }
    let mut signals =
        Signals::new(STOP_SIGNALS.map(|(signal, _)| signal)).context("watching stop signals")?;
    let flag = stop.clone();
    std::thread::spawn(move || {
        let mut first: Option<Instant> = None;
        for signal in signals.forever() {
            let name = STOP_SIGNALS
                .iter()
                .find(|(s, _)| *s == signal)
                .map_or("a stop signal", |(_, name)| name);
            match first {
                None => {
                    first = Some(Instant::now());
                    flag.store(true, Ordering::Relaxed);
                    eprintln!(
                        "{name}: stopping at the end of the step under way or the next, with a checkpoint (a second signal stops at once, without one)"
                    );
                }
                Some(at) if at.elapsed() >= REPEAT_WINDOW => {
                    eprintln!("{name} again: stopping at once, without a checkpoint");
                    // the shell's status for death by the signal
                    std::process::exit(128 + signal);
                }
                Some(_) => {}
            }
        }
    });
    Ok(stop)
}
