//! The launcher a process was started by (mpirun / mpiexec, Slurm's srun), read from the
//! variables it sets, and this process's place in the job.

/// A process of a job of several, as its launcher describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// Who started the process, for messages.
    pub launcher: &'static str,
    /// Processes in the job.
    pub processes: usize,
    /// This process's rank, 0..processes.
    pub rank: usize,
    /// This process's rank among those on its machine, where the launcher says.
    pub local_rank: Option<usize>,
    /// Processes on this machine, where the launcher says.
    pub local_processes: Option<usize>,
}

/// The variables of each launcher: size, rank, local rank, local size. srun's are those of a
/// job step, not of the allocation, which a batch script sees too without being one of
/// several.
const CONVENTIONS: [(&str, [&str; 4]); 3] = [
    (
        "Open MPI's mpirun",
        [
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ],
    ),
    (
        "mpiexec (MPICH / Hydra)",
        ["PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"],
    ),
    (
        "Slurm's srun",
        [
            "SLURM_STEP_NUM_TASKS",
            "SLURM_PROCID",
            "SLURM_LOCALID",
            "SLURM_NTASKS_PER_NODE",
        ],
    ),
];

impl Launch {
    /// This process's place in a job of several processes, from the environment (`var`
    /// reads one variable); `None` when no launcher started it or it is the job's only
    /// process.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, String> {
        for (launcher, [size_var, rank_var, local_var, local_size_var]) in CONVENTIONS {
            let Some(size) = var(size_var) else {
                continue;
            };
            let number = |name: &str, value: &str| {
                value
                    .trim()
                    .parse::<usize>()
                    .map_err(|_| format!("{launcher} set {name}={value:?}, not a number"))
            };
            let processes = number(size_var, &size)?;
            let rank = var(rank_var)
                .ok_or_else(|| format!("{launcher} set {size_var} but not {rank_var}"))
                .and_then(|r| number(rank_var, &r))?;
            let local_rank = var(local_var).map(|r| number(local_var, &r)).transpose()?;
            let local_processes = var(local_size_var)
                .map(|n| number(local_size_var, &n))
                .transpose()?;
            if rank >= processes {
                return Err(format!(
                    "{launcher} set {rank_var}={rank} for a job of {processes} processes"
                ));
            }
            return Ok((processes > 1).then_some(Self {
                launcher,
                processes,
                rank,
                local_rank,
                local_processes,
            }));
        }
        Ok(None)
    }

    /// The one GPU this process trains on when no `--devices` is given, out of the `visible`
    /// CUDA devices: the one of its local rank where several processes share the machine (as
    /// `mpirun -np 8` on an 8-GPU server starts them); `None` for every visible device (one
    /// process per machine, or a launcher that gave each process its own GPU, as
    /// `srun --gpus-per-task=1` does).
    pub fn gpu(&self, visible: usize) -> Option<usize> {
        if visible <= 1 || self.local_processes == Some(1) {
            return None;
        }
        self.local_rank
    }

    /// Why a build without MPI does not take part in this job: every process would train
    /// alone into the same model dir.
    pub fn without_mpi(&self) -> String {
        format!(
            "started by {} as process {} of {}, but this `train` was built without MPI, so each process would train alone into the same model dir. Build it with MPI (an MPI library and libclang, e.g. `apt install libopenmpi-dev libclang-dev`, then `cargo build --release -p train --features mpi`) and launch that binary",
            self.launcher, self.rank, self.processes
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(vars: &[(&str, &str)]) -> Result<Option<Launch>, String> {
        Launch::from_env(|k| {
            vars.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn each_launcher_is_recognised_by_its_variables() {
        let open_mpi = launch(&[
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ]);
        assert_eq!(
            open_mpi,
            Ok(Some(Launch {
                launcher: "Open MPI's mpirun",
                processes: 4,
                rank: 3,
                local_rank: Some(1),
                local_processes: None,
            }))
        );
        let hydra = launch(&[("PMI_SIZE", "2"), ("PMI_RANK", "0")])
            .unwrap()
            .unwrap();
        assert_eq!(
            (hydra.processes, hydra.rank, hydra.local_rank),
            (2, 0, None)
        );
        let srun = launch(&[
            ("SLURM_STEP_NUM_TASKS", "16"),
            ("SLURM_PROCID", "9"),
            ("SLURM_LOCALID", "1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (srun.launcher, srun.rank, srun.local_rank),
            ("Slurm's srun", 9, Some(1))
        );
    }

    #[test]
    fn a_lone_process_or_a_batch_script_is_no_job_of_several() {
        assert_eq!(launch(&[]), Ok(None));
        assert_eq!(
            launch(&[("OMPI_COMM_WORLD_SIZE", "1"), ("OMPI_COMM_WORLD_RANK", "0")]),
            Ok(None)
        );
        // an sbatch script sees its allocation's task count, not a job step's
        assert_eq!(
            launch(&[("SLURM_NTASKS", "8"), ("SLURM_PROCID", "0")]),
            Ok(None)
        );
    }

    #[test]
    fn processes_sharing_a_machine_take_the_gpu_of_their_local_rank() {
        let eight_per_server = launch(&[
            ("OMPI_COMM_WORLD_SIZE", "16"),
            ("OMPI_COMM_WORLD_RANK", "11"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "8"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(eight_per_server.gpu(8), Some(3));
        // srun --gpus-per-task=1: the process sees its own GPU only
        assert_eq!(eight_per_server.gpu(1), None);
        let one_per_server = launch(&[
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NTASKS_PER_NODE", "1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(one_per_server.gpu(8), None);
        let message = one_per_server.without_mpi();
        assert!(
            message.contains("Slurm's srun as process 1 of 2"),
            "{message}"
        );
        assert!(message.contains("--features mpi"), "{message}");
    }

    #[test]
    fn inconsistent_variables_are_errors_naming_them() {
        let err = launch(&[("PMI_SIZE", "two"), ("PMI_RANK", "0")]).unwrap_err();
        assert!(err.contains("PMI_SIZE=\"two\""), "{err}");
        let err = launch(&[("OMPI_COMM_WORLD_SIZE", "2")]).unwrap_err();
        assert!(err.contains("not OMPI_COMM_WORLD_RANK"), "{err}");
        let err = launch(&[("PMI_SIZE", "2"), ("PMI_RANK", "2")]).unwrap_err();
        assert!(err.contains("for a job of 2 processes"), "{err}");
    }
}
