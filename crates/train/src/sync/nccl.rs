//! The exchange between the processes of a multi-node run on CUDA GPUs (the `cuda` and `mpi`
//! features): each process's sum is all-reduced by NCCL where it lies, on its first replica's
//! GPU, instead of being copied to host memory for `MPI_Allreduce`.
//!
//! Every process takes the same decision at the start ([`connect`]): each checks that its
//! devices are CUDA GPUs and that libnccl loads; rank 0 creates NCCL's unique id and
//! broadcasts it over MPI; every process joins the communicator (`ncclCommInitRank`, one rank
//! per process) and all-reduces a small known vector, which must come back as the expected
//! sum within a minute. After each stage a tiny `MPI_Allreduce` of the verdicts makes
//! every process fall back to MPI through host memory if any one failed.
//!
//! NCCL's all-reduce leaves the same bits on every rank: its ring and tree algorithms form
//! each element's sum once and send that value unchanged to every GPU (NVIDIA's maintainers
//! state it in NVIDIA/nccl issue 855; the user guide does not promise it). It is checked
//! anyway: the processes compare a hash of their weights at every checkpoint, and a run whose
//! processes drifted apart stops there.

use std::any::Any;
use std::ffi::{CStr, c_char, c_void};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::backend::Cuda;
use burn::backend::cuda::CudaDevice;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
use burn_cubecl::CubeBackend;
use cubecl_cuda::CudaRuntime;
use cudarc::driver::{CudaContext, CudaStream, sys as driver};
use cudarc::nccl::{result as nccl, sys};
use mpi::collective::{CommunicatorCollectives, Root, SystemOperation};
use mpi::topology::{Communicator, SimpleCommunicator};

use super::watchdog::{CHECK_LIMIT, bounded};
use super::{DeviceExchange, Nodes};

/// The backend beneath Burn's fused CUDA backend: its tensors hold cubecl's buffers.
type CudaInner = CubeBackend<CudaRuntime, f32, i32, u8>;

/// Bytes of an `ncclUniqueId`.
const ID_BYTES: usize = 128;

/// The NCCL exchange between the processes, every one of them with its first replica on
/// `device`, or why MPI through host memory is used instead (the same decision on every
/// process). Collective: every process of the job calls it at the same point of its start.
pub fn connect<B: Backend>(
    device: &B::Device,
    nodes: &Nodes,
) -> Result<Arc<dyn DeviceExchange<B>>, String> {
    let world = SimpleCommunicator::world();
    let agreed = |verdict: Result<(), String>| {
        agree(verdict, nodes.rank, |mine| {
            let mut lowest = 0u64;
            world.all_reduce_into(&mine, &mut lowest, SystemOperation::min());
            lowest
        })
    };
    let ordinal = match (device as &dyn Any).downcast_ref::<CudaDevice>() {
        None => Err("the devices are not CUDA GPUs".to_string()),
        // SAFETY: only probes whether the NCCL library can be loaded.
        Some(_) if !unsafe { sys::is_culib_present() } => {
            tell(nodes.rank, Err("libnccl could not be loaded".into()))
        }
        Some(cuda) => Ok(cuda.index),
    };
    agreed(ordinal.as_ref().map(drop).map_err(Clone::clone))?;
    let ordinal = ordinal?;
    let id = unique_id(&world, nodes.rank)?;
    let (rank, ranks, limit) = (nodes.rank, nodes.count(), nodes.timeout);
    // a check that outlasts its limit is abandoned: told so, its thread launches nothing
    // more, and its communicator is aborted when it ends
    let abandoned = Arc::new(AtomicBool::new(false));
    let told = Arc::clone(&abandoned);
    let checked = bounded("the NCCL check", CHECK_LIMIT, move || {
        check(ordinal, (rank, ranks), id, &told)
    })
    .and_then(|checked| checked)
    .map(|exchange| exchange.waiting_at_most(limit));
    abandoned.store(true, Ordering::Relaxed);
    let checked = tell(rank, checked);
    agreed(checked.as_ref().map(drop).map_err(Clone::clone))?;
    let exchange: Arc<dyn DeviceExchange<Cuda>> = Arc::new(checked?);
    // `B` is `Cuda` here (its device was one): the downcast only names it
    (Box::new(exchange) as Box<dyn Any>)
        .downcast::<Arc<dyn DeviceExchange<B>>>()
        .map(|exchange| *exchange)
        .map_err(|_| "the backend is not Burn's CUDA backend".to_string())
}

/// `verdict`, its failure printed by a process other than rank 0 (only rank 0 logs, and the
/// others learn only which rank failed).
fn tell<T>(rank: usize, verdict: Result<T, String>) -> Result<T, String> {
    if let (Err(why), true) = (&verdict, rank != 0) {
        eprintln!("process {rank}: no NCCL between the processes: {why}");
    }
    verdict
}

/// Every process's verdict combined, so that all take the same decision: `Ok` where every
/// verdict was; else a failing process keeps its own reason and the others name the lowest
/// rank that failed. `lowest` is the minimum over the processes of what each passes it (an
/// `MPI_Allreduce`).
fn agree(
    mine: Result<(), String>,
    rank: usize,
    lowest: impl FnOnce(u64) -> u64,
) -> Result<(), String> {
    let first_failed = lowest(match mine {
        Ok(()) => u64::MAX,
        Err(_) => rank as u64,
    });
    match (mine, first_failed) {
        (_, u64::MAX) => Ok(()),
        (Err(why), _) => Err(why),
        (Ok(()), first) => Err(format!(
            "process {first} failed its NCCL check (its error output says why)"
        )),
    }
}

/// Rank 0's NCCL unique id, broadcast over MPI to every process (an `Err` on every process
/// where rank 0 could not create one).
fn unique_id(world: &SimpleCommunicator, rank: usize) -> Result<sys::ncclUniqueId, String> {
    let mut message = [0u8; 1 + ID_BYTES];
    let created = (rank == 0).then(nccl::get_uniqueid);
    if let Some(Ok(id)) = &created {
        message = id_message(id);
    }
    world.process_at_rank(0).broadcast_into(&mut message[..]);
    match (created, id_from_message(&message)) {
        (Some(Err(e)), _) => Err(format!("ncclGetUniqueId failed: {}", describe(&e, None))),
        (_, Some(id)) => Ok(id),
        (_, None) => Err("process 0 could not create an NCCL id (its log says why)".into()),
    }
}

/// `id` as broadcast: a first byte 1 (rank 0 has an id), then its bytes.
fn id_message(id: &sys::ncclUniqueId) -> [u8; 1 + ID_BYTES] {
    let mut message = [1u8; 1 + ID_BYTES];
    for (byte, c) in message[1..].iter_mut().zip(id.internal) {
        *byte = c as u8;
    }
    message
}

/// The id in a broadcast message; `None` where rank 0 had none (a first byte 0).
fn id_from_message(message: &[u8; 1 + ID_BYTES]) -> Option<sys::ncclUniqueId> {
    let mut internal: [c_char; ID_BYTES] = [0; ID_BYTES];
    for (c, byte) in internal.iter_mut().zip(&message[1..]) {
        *c = *byte as c_char;
    }
    (message[0] == 1).then_some(sys::ncclUniqueId { internal })
}

/// Joins the communicator and all-reduces a small known vector from device `ordinal` through
/// the same path as the gradients, waiting for it no longer than the check's own limit:
/// `Err` unless the expected sum comes back. Once `abandoned` (the caller stopped waiting),
/// it launches nothing: no peer would match it.
fn check(
    ordinal: usize,
    (rank, ranks): (usize, usize),
    id: sys::ncclUniqueId,
    abandoned: &AtomicBool,
) -> Result<NcclExchange, String> {
    let exchange = NcclExchange {
        comm: Mutex::new(NcclComm::join(ordinal, rank, ranks, id, CHECK_LIMIT)?),
    };
    if abandoned.load(Ordering::Relaxed) {
        // dropping the exchange aborts its communicator
        return Err("the check was abandoned while it joined".into());
    }
    // small multiples of powers of two: every sum is exact, whatever NCCL's order
    let values = |r: usize| [1.5, -2.0, 0.25 * (r + 1) as f32, r as f32];
    let expected = (0..ranks).map(values).fold([0.0f32; 4], |mut sum, v| {
        sum.iter_mut().zip(v).for_each(|(s, v)| *s += v);
        sum
    });
    let sent = values(rank);
    let device = CudaDevice::new(ordinal);
    let mine = Tensor::<Cuda, 1>::from_data(TensorData::new(sent.to_vec(), [4]), &device);
    let back = exchange
        .sum_over_nodes(mine)?
        .into_data()
        .to_vec::<f32>()
        .map_err(|e| format!("reading the sum back failed: {e:?}"))?;
    match back == expected {
        true => Ok(exchange),
        false => Err(format!(
            "process {rank} sent {sent:?}, expected the sum {expected:?}, got {back:?}"
        )),
    }
}

/// The sum over the processes by NCCL, in place on the tensor's own buffer.
struct NcclExchange {
    /// One call at a time (NCCL calls on one communicator must not overlap).
    comm: Mutex<NcclComm>,
}

impl NcclExchange {
    /// The exchange with `limit` as its longest wait for the peers.
    fn waiting_at_most(self, limit: Duration) -> Self {
        self.comm.lock().unwrap_or_else(|e| e.into_inner()).limit = limit;
        self
    }
}

impl DeviceExchange<Cuda> for NcclExchange {
    /// The ordering with cubecl's streams, correctness before speed: the buffer is made ready
    /// (`ready_buffer`: every operation that writes it finished) before NCCL reads it; NCCL
    /// runs on a stream of its own, which is waited for before the tensor is handed back, so
    /// every later kernel, on any stream, is queued after NCCL has written. Both waits block
    /// this thread (nothing overlaps the exchange); cubecl's own in-process all-reduce orders
    /// the two streams with events instead, which would let the host run ahead.
    fn sum_over_nodes(&self, sum: Tensor<Cuda, 1>) -> Result<Tensor<Cuda, 1>, String> {
        let device = sum.device();
        let kept = sum.into_primitive().tensor();
        let (pointer, count, _allocated) = ready_buffer(&kept, &device)?;
        self.comm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .sum_in_place(pointer, count)?;
        // `_allocated` kept the buffer allocated until NCCL was done with it
        Ok(Tensor::from_primitive(TensorPrimitive::Float(kept)))
    }
}

/// The device address and length (in f32) of `tensor`'s buffer once every operation that
/// writes it has finished, and a guard that keeps the buffer allocated while it is held.
/// The tensor's pending operations are flushed from Burn's fusion layer into cubecl's stream
/// of this thread (resolving it), and that stream is waited for (`Backend::sync`).
fn ready_buffer(
    tensor: &FloatTensor<Cuda>,
    device: &CudaDevice,
) -> Result<(u64, usize, impl Sized + use<>), String> {
    // resolving a second reference leaves `tensor` registered with the fusion layer
    let other = tensor.clone();
    let buffer = other
        .client
        .clone()
        .resolve_tensor_float::<CudaInner>(other);
    let count = buffer.meta.shape().num_elements();
    if buffer.dtype != DType::F32 || !buffer.is_contiguous() {
        return Err(format!(
            "the sum to exchange is not a contiguous f32 buffer ({:?})",
            buffer.dtype
        ));
    }
    let resource = buffer
        .client
        .get_resource(buffer.handle.clone())
        .map_err(|e| format!("cubecl could not give the sum's buffer: {e:?}"))?;
    let (pointer, bytes) = (resource.resource().ptr, resource.resource().size);
    if bytes < (count * size_of::<f32>()) as u64 {
        return Err(format!(
            "the sum's buffer holds {bytes} bytes, not {count} f32"
        ));
    }
    <Cuda as Backend>::sync(device).map_err(|e| format!("waiting for the sum failed: {e:?}"))?;
    Ok((pointer, count, (resource, buffer)))
}

/// An NCCL communicator of this process's GPU, the stream its operations run on, and the
/// longest wait for the peers (`--node-timeout`).
struct NcclComm {
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    limit: Duration,
    /// Aborted after a failure: nothing more may be called on it.
    aborted: AtomicBool,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time, which the
// `Mutex` around it in `NcclExchange` ensures; the stream is cudarc's, itself `Send`.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Joins the communicator of `ranks` processes as `rank`, on CUDA device `ordinal`
    /// (the primary context, which cubecl uses too: its buffers are valid here). Blocks until
    /// every rank has joined.
    fn join(
        ordinal: usize,
        rank: usize,
        ranks: usize,
        id: sys::ncclUniqueId,
        limit: Duration,
    ) -> Result<Self, String> {
        let cuda = |e: cudarc::driver::DriverError| format!("CUDA device {ordinal}: {e:?}");
        let context = CudaContext::new(ordinal).map_err(cuda)?;
        let stream = context.new_stream().map_err(cuda)?;
        // NCCL takes the device current on the calling thread
        context.bind_to_thread().map_err(cuda)?;
        let (rank, ranks) = (as_int(rank)?, as_int(ranks)?);
        let mut comm = MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL before it is read (only on success); `id` is the
        // id every rank received from rank 0, and `rank` < `ranks` (MPI's rank and size).
        unsafe { nccl::comm_init_rank(comm.as_mut_ptr(), ranks, id, rank) }
            .map_err(|e| format!("ncclCommInitRank failed: {}", describe(&e, None)))?;
        Ok(Self {
            // SAFETY: `comm_init_rank` succeeded, so it wrote the communicator.
            comm: unsafe { comm.assume_init() },
            stream,
            limit,
            aborted: AtomicBool::new(false),
        })
    }

    /// Sums `count` f32 at device address `pointer` over the ranks, in place, and waits until
    /// NCCL is done ([`Self::wait`]).
    fn sum_in_place(&self, pointer: u64, count: usize) -> Result<(), String> {
        if self.aborted.load(Ordering::Relaxed) {
            return Err("NCCL's communicator was aborted after a failure".into());
        }
        let cuda = |e: cudarc::driver::DriverError| format!("NCCL's stream: {e:?}");
        self.stream.context().bind_to_thread().map_err(cuda)?;
        // SAFETY: `pointer` addresses `count` f32 on this communicator's device, kept
        // allocated by the caller until this returns; in place (send = receive buffer) is
        // allowed by NCCL; the communicator and the stream live as long as `self`.
        unsafe {
            nccl::all_reduce(
                pointer as *const c_void,
                pointer as *mut c_void,
                count,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| format!("ncclAllReduce failed: {}", describe(&e, Some(self.comm))))?;
        self.wait()
    }

    /// Waits for the stream, polling it and the communicator's asynchronous error instead
    /// of blocking in a synchronize that never returns when a peer died or lost its link:
    /// an error, or no end within the limit, aborts the communicator (which ends NCCL's
    /// kernels on this GPU) and is returned.
    fn wait(&self) -> Result<(), String> {
        let started = Instant::now();
        loop {
            // SAFETY: the stream is alive as long as `self`.
            match unsafe { driver::cuStreamQuery(self.stream.cu_stream()) } {
                driver::CUresult::CUDA_SUCCESS => return Ok(()),
                driver::CUresult::CUDA_ERROR_NOT_READY => {}
                other => return Err(self.abort(format!("NCCL's stream failed: {other:?}"))),
            }
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: `comm` is a live communicator; NCCL writes `state`.
            let asked = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
            let failed = [asked, state].into_iter().find(|r| {
                !matches!(
                    r,
                    sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
                )
            });
            if let Some(error) = failed {
                let why = describe(&nccl::NcclError(error), Some(self.comm));
                return Err(self.abort(format!("NCCL's all-reduce failed: {why}")));
            }
            if started.elapsed() > self.limit {
                return Err(self.abort(format!(
                    "NCCL's all-reduce: no answer from the other processes within {} s (--node-timeout): a process died or lost its link",
                    self.limit.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Aborts the communicator after `why` (its kernels end, it takes no more calls: the
    /// run ends with `why`).
    fn abort(&self, why: String) -> String {
        // SAFETY: `comm` is a live communicator; after an abort NCCL frees it, and the run
        // ends with the error returned (Drop's second abort of a freed communicator is
        // avoided by `aborted`).
        let _ = unsafe { nccl::comm_abort(self.comm) };
        self.aborted.store(true, Ordering::Relaxed);
        why
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.aborted.load(Ordering::Relaxed) {
            return;
        }
        // abort, not destroy: destroy waits for the peers' pending operations, which a peer
        // that failed never completes; at the end of a run there is nothing left to report
        // SAFETY: `comm` is a communicator from `comm_init_rank`, used no more after this.
        let _ = unsafe { nccl::comm_abort(self.comm) };
    }
}

/// `value` as the C int NCCL takes.
fn as_int(value: usize) -> Result<i32, String> {
    i32::try_from(value).map_err(|_| format!("{value} ranks are more than NCCL takes"))
}

/// An NCCL error with NCCL's own words for it, and its last error (of `comm`, or of any
/// communicator) where the library has `ncclGetLastError` (2.13 and later).
fn describe(error: &nccl::NcclError, comm: Option<sys::ncclComm_t>) -> String {
    /// `ncclGetLastError` appeared in NCCL 2.13 (`NCCL_VERSION_CODE` 21300).
    const LAST_ERROR_SINCE: i32 = 21300;
    // SAFETY: NCCL returns static, NUL-terminated strings (or null, checked) for any result
    // and for its last error.
    let text = |p: *const c_char| unsafe {
        (!p.is_null()).then(|| CStr::from_ptr(p).to_string_lossy().into_owned())
    };
    // SAFETY: takes any result code.
    let name = text(unsafe { sys::ncclGetErrorString(error.0) });
    let last = match nccl::get_nccl_version() {
        // SAFETY: the symbol exists in this version; a null communicator is allowed.
        Ok(v) if v >= LAST_ERROR_SINCE => {
            text(unsafe { sys::ncclGetLastError(comm.unwrap_or(std::ptr::null_mut())) })
        }
        _ => None,
    };
    match (name, last.filter(|l| !l.is_empty())) {
        (Some(name), Some(last)) => format!("{:?}: {name} ({last})", error.0),
        (Some(name), None) => format!("{:?}: {name}", error.0),
        (None, _) => format!("{:?}", error.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each rank's verdict, combined as `MPI_Allreduce` with MIN would: the ranks' decisions.
    fn decisions(verdicts: &[Result<(), String>]) -> Vec<Result<(), String>> {
        let contributed: Vec<u64> = verdicts
            .iter()
            .enumerate()
            .map(|(rank, v)| if v.is_ok() { u64::MAX } else { rank as u64 })
            .collect();
        let lowest = contributed.iter().copied().min().unwrap_or(u64::MAX);
        verdicts
            .iter()
            .enumerate()
            .map(|(rank, v)| {
                agree(v.clone(), rank, |mine| {
                    assert_eq!(mine, contributed[rank]);
                    lowest
                })
            })
            .collect()
    }

    #[test]
    fn every_rank_takes_the_same_decision() {
        assert_eq!(
            decisions(&[Ok(()), Ok(()), Ok(())]),
            [Ok(()), Ok(()), Ok(())]
        );
        let failed = decisions(&[
            Ok(()),
            Err("Duplicate GPU detected".into()),
            Err("libnccl could not be loaded".into()),
        ]);
        assert_eq!(
            failed,
            [
                Err("process 1 failed its NCCL check (its error output says why)".into()),
                Err("Duplicate GPU detected".into()),
                Err("libnccl could not be loaded".into()),
            ]
        );
        // rank 0's own reason is the one its log gives
        let first = decisions(&[Err("no answer".into()), Ok(())]);
        assert_eq!(first[0], Err("no answer".into()));
        assert!(
            first[1]
                .as_ref()
                .unwrap_err()
                .starts_with("process 0 failed")
        );
    }

    #[test]
    fn the_unique_id_survives_the_broadcast_message() {
        let mut internal: [c_char; ID_BYTES] = [0; ID_BYTES];
        for (i, c) in internal.iter_mut().enumerate() {
            // bytes of 128 and more among them: negative as C chars
            *c = (i as u8).wrapping_mul(37).wrapping_add(200) as c_char;
        }
        let message = id_message(&sys::ncclUniqueId { internal });
        let back = id_from_message(&message).expect("an id");
        assert_eq!(back.internal, internal);
        let mut none = message;
        none[0] = 0;
        assert!(id_from_message(&none).is_none());
    }
}
