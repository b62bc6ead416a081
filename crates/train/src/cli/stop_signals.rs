//! Stop requests from outside the process: SIGINT (Ctrl-C), SIGTERM (what Slurm, Kubernetes
//! and spot-instance reclaimers send before they kill a job) and SIGUSR1 (Slurm's
//! `--signal`). The first sets the run's stop flag: the run finishes its step, writes a
//! checkpoint and exits with [`train::learner::STOPPED_EXIT_STATUS`]. A second ends the
//! process at once.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::{Context, Result};
use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
use signal_hook::flag;
use signal_hook::iterator::Signals;

/// The signals that ask a run to stop, with their names for the message.
const STOP_SIGNALS: [(i32, &str); 3] = [
    (SIGINT, "SIGINT"),
    (SIGTERM, "SIGTERM"),
    (SIGUSR1, "SIGUSR1"),
];

/// A flag that the stop signals set.
pub fn stop_flag() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for (signal, name) in STOP_SIGNALS {
        // registered first, so it sees the flag as it was before this signal: a second
        // request ends the process with the status a shell gives death by the signal
        flag::register_conditional_shutdown(signal, 128 + signal, stop.clone())
            .with_context(|| format!("installing the {name} handler"))?;
        flag::register(signal, stop.clone())
            .with_context(|| format!("installing the {name} handler"))?;
    }
    let mut signals =
        Signals::new(STOP_SIGNALS.map(|(signal, _)| signal)).context("watching stop signals")?;
    // the handlers above only set the flag; the message is printed here, outside them
    std::thread::spawn(move || {
        for signal in signals.forever() {
            let name = STOP_SIGNALS
                .iter()
                .find(|(s, _)| *s == signal)
                .map_or("a stop signal", |(_, name)| name);
            eprintln!(
                "{name}: stopping after this step with a checkpoint (a second signal stops at once, without one)"
            );
        }
    });
    Ok(stop)
}
