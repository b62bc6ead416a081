//! The exchange between the processes of a multi-node run, through MPI (the `mpi` feature).
//! The launcher (mpirun / mpiexec, Slurm's srun) starts every process; each sums its own
//! replicas' gradients and MPI all-reduces that sum over the processes.

use std::sync::Arc;
use std::time::Duration;

use mpi::Threading;
use mpi::collective::{CommunicatorCollectives, SystemOperation};
use mpi::environment::Universe;
use mpi::topology::{Communicator, SimpleCommunicator};

use super::deadline::Deadline;
use super::{NodeExchange, Nodes};

/// MPI for the lifetime of a run. Dropping it finalises MPI, which every process of the job
/// must do before it exits: a launcher takes an exit without it for a failure.
pub struct MpiSession {
    _universe: Universe,
}

impl MpiSession {
    /// Initialises MPI and returns this process's place in the job. The exchange runs on
    /// whichever replica thread completes the local sum, one at a time, so the library must
    /// allow calls from any thread (`MPI_THREAD_SERIALIZED` or more). A wait for the other
    /// processes longer than `timeout` ends the job (`MPI_Abort`, from the deadline's thread:
    /// the library must allow `MPI_THREAD_MULTIPLE` for that call to be safe).
    pub fn start(timeout: Duration) -> Result<(Self, Nodes), String> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or("MPI was initialised twice")?;
        if matches!(threading, Threading::Single | Threading::Funneled) {
            return Err(format!(
                "the MPI library offers only {threading:?} threading; the exchange runs on the replicas' threads and needs Serialized or Multiple"
            ));
        }
        let world = universe.world();
        let rank = world.rank() as usize;
        let deadline = Deadline::new(
            timeout,
            Box::new(move |why| {
                eprintln!("Error: process {rank}: {why}; ending the job");
                SimpleCommunicator::world().abort(1)
            }),
        );
        let nodes = Nodes {
            rank,
            exchange: Arc::new(MpiExchange {
                processes: world.size() as usize,
                deadline,
            }),
            timeout,
        };
        Ok((
            Self {
                _universe: universe,
            },
            nodes,
        ))
    }

    /// Ends every process of the job (`MPI_Abort`) once this one has said why: the others
    /// may be waiting for it in an exchange, and must not wait forever.
    pub fn abort(self, code: i32) -> ! {
        SimpleCommunicator::world().abort(code)
    }
}

/// The sum over the processes by `MPI_Allreduce`, which leaves the same bits on every process:
/// Open MPI's algorithms (recursive doubling for small buffers, ring and Rabenseifner's for
/// large ones) either form each element's sum once and copy it to every process, or form it on
/// each from the same operands with IEEE additions, which commute. Checkpoints check it: every
/// process hashes its weights into the join check (see `learner`), so a library that did
/// otherwise stops the run at the first checkpoint rather than training replicas apart.
struct MpiExchange {
    processes: usize,
    /// Bounds each all-reduce: a peer that died without the launcher ending the job (srun
    /// without `--kill-on-bad-exit`) would leave it waiting for ever.
    deadline: Deadline,
}

impl NodeExchange for MpiExchange {
    fn nodes(&self) -> usize {
        self.processes
    }

    fn sum_over_nodes(&self, values: Vec<f32>) -> Result<Vec<f32>, String> {
        if i32::try_from(values.len()).is_err() {
            return Err(format!(
                "{} values exceed what one MPI call carries",
                values.len()
            ));
        }
        let mut total = vec![0.0f32; values.len()];
        // errors are fatal to the job (MPI's default handler), and a wait longer than the
        // deadline ends it: no process waits on a dead one
        let _waiting = self.deadline.arm("the all-reduce through MPI");
        SimpleCommunicator::world().all_reduce_into(
            &values[..],
            &mut total[..],
            SystemOperation::sum(),
        );
        Ok(total)
    }
}
