//! Start-up checks that must not take the run down: the work runs on a thread of its own,
//! so that a panic (NCCL failing inside a device's runner) or a wait that never ends (a
//! peer that never answers) becomes a reason to fall back instead.

use std::panic::AssertUnwindSafe;
use std::time::Duration;

/// How long a start-up check of NCCL waits: NCCL sets up its communicator on first use,
/// which takes a few seconds.
pub(super) const CHECK_LIMIT: Duration = Duration::from_secs(60);

/// Runs `work` on a thread of its own and returns its result, or why there is none: `what`
/// (e.g. "the copy") panicked, or did not finish within `limit`. A thread that does not
/// finish is left behind: nothing can stop it from outside, and the caller goes on.
pub(super) fn bounded<T: Send + 'static>(
    what: &str,
    limit: Duration,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let (send, receive) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = send.send(std::panic::catch_unwind(AssertUnwindSafe(work)));
    });
    match receive.recv_timeout(limit) {
        Ok(Ok(done)) => Ok(done),
        Ok(Err(panic)) => Err(format!(
            "{what} panicked: {}",
            panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or(panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)")
        )),
        Err(_) => Err(format!(
            "{what} did not finish within {} s",
            limit.as_secs_f64()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_a_panic_and_a_hang_are_told_apart() {
        // long for the work that ends (a panic's backtrace, with RUST_BACKTRACE set on a busy
        // machine, can take seconds), short for the work that does not
        let (limit, no_answer) = (Duration::from_secs(30), Duration::from_millis(500));
        assert_eq!(bounded("the sum", limit, || 1 + 2), Ok(3));
        let err = bounded("the sum", limit, || -> u32 {
            panic!("ncclCommInitRank failed")
        })
        .unwrap_err();
        assert_eq!(err, "the sum panicked: ncclCommInitRank failed");
        let err = bounded("the sum", no_answer, || {
            std::thread::sleep(Duration::from_secs(2));
        })
        .unwrap_err();
        assert_eq!(err, "the sum did not finish within 0.5 s");
    }
}
