//! A bound on the waits of a multi-node run: a process waiting for the others in an exchange
//! (MPI's all-reduce, NCCL's) waits at most `--node-timeout`. A process that died or lost its
//! link never answers, and where the launcher does not end the job on its death (`srun`
//! without `--kill-on-bad-exit`), nothing else would ever end the wait.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What a [`Deadline`] does when a wait outlasts it: told what was waited for and for how
/// long, it ends the process (or, in tests, records the call).
pub type OnExpiry = Box<dyn Fn(&str) + Send + Sync>;

/// A watchdog thread that runs [`OnExpiry`] when a wait armed with [`Deadline::arm`] has not
/// ended within the limit. One wait at a time (the exchanges of a run are serial).
pub struct Deadline {
    limit: Duration,
    shared: Arc<(Mutex<Armed>, Condvar)>,
}

#[derive(Default)]
struct Armed {
    /// The wait under way: when it started and what it waits for.
    wait: Option<(Instant, String)>,
    /// The deadline is dropped: the watchdog thread ends.
    closed: bool,
}

/// A wait under way; its end (drop) disarms the deadline.
pub struct Waiting<'a> {
    deadline: &'a Deadline,
}

impl Deadline {
    /// A deadline of `limit` for every wait, `on_expiry` run (on the watchdog's thread) when
    /// one outlasts it.
    pub fn new(limit: Duration, on_expiry: OnExpiry) -> Self {
        let shared = Arc::new((Mutex::new(Armed::default()), Condvar::new()));
        let watched = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("node-deadline".into())
            .spawn(move || watch(&watched, limit, &on_expiry))
            .expect("starting the node deadline's thread");
        Self { limit, shared }
    }

    /// The limit of each wait.
    pub fn limit(&self) -> Duration {
        self.limit
    }

    /// Starts a wait for `what`; it ends when the returned guard is dropped.
    pub fn arm(&self, what: &str) -> Waiting<'_> {
        let (state, signal) = &*self.shared;
        let mut armed = state.lock().unwrap_or_else(|e| e.into_inner());
        armed.wait = Some((Instant::now(), what.to_string()));
        signal.notify_all();
        Waiting { deadline: self }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let (state, signal) = &*self.deadline.shared;
        state.lock().unwrap_or_else(|e| e.into_inner()).wait = None;
        signal.notify_all();
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        let (state, signal) = &*self.shared;
        state.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        signal.notify_all();
    }
}

/// The watchdog: sleeps until a wait is armed, then until its limit or its end; runs
/// `on_expiry` once for a wait that outlasts the limit.
fn watch(shared: &(Mutex<Armed>, Condvar), limit: Duration, on_expiry: &OnExpiry) {
    let (state, signal) = shared;
    let mut armed = state.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if armed.closed {
            return;
        }
        let Some((since, what)) = armed.wait.clone() else {
            armed = signal.wait(armed).unwrap_or_else(|e| e.into_inner());
            continue;
        };
        let elapsed = since.elapsed();
        if elapsed < limit {
            armed = signal
                .wait_timeout(armed, limit - elapsed)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            continue;
        }
        // this wait has expired: report it once
        armed.wait = None;
        drop(armed);
        on_expiry(&format!(
            "{what}: no answer from the other processes within {} s (--node-timeout): a process died or lost its link",
            limit.as_secs()
        ));
        armed = state.lock().unwrap_or_else(|e| e.into_inner());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recording(limit: Duration) -> (Deadline, Arc<Mutex<Vec<String>>>) {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&calls);
        let deadline = Deadline::new(
            limit,
            Box::new(move |why| seen.lock().unwrap().push(why.to_string())),
        );
        (deadline, calls)
    }

    #[test]
    fn a_wait_past_the_limit_is_reported_once_and_one_within_it_never() {
        // a limit far beyond what a busy machine delays a thread by
        let (deadline, calls) = recording(Duration::from_secs(1));
        // waits that end in time, and time without a wait
        for _ in 0..3 {
            let _wait = deadline.arm("the all-reduce of step 1");
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(1500));
        assert!(calls.lock().unwrap().is_empty());
        // a wait that does not end in time
        let wait = deadline.arm("the all-reduce of step 2");
        std::thread::sleep(Duration::from_millis(2500));
        drop(wait);
        let calls = calls.lock().unwrap().clone();
        assert_eq!(calls.len(), 1, "{calls:?}");
        assert!(
            calls[0].starts_with("the all-reduce of step 2: no answer from the other processes"),
            "{calls:?}"
        );
    }
}
