//! [`Communicator`]: an owned NCCL communicator over cudarc's `nccl::sys` layer.

use std::ffi::{CStr, c_int};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::nccl::sys;
use tessera_core::cuda::{CudaDevice, CudaResultExt};
use tessera_core::{Error, Result};

use super::loader::ensure_available;

/// `NCCL_SPLIT_NOCOLOR` from `nccl.h`: the color of ranks that join no new
/// communicator in `ncclCommSplit`.
pub const NCCL_SPLIT_NOCOLOR: c_int = -1;

/// `NCCL_CONFIG_UNDEF_INT` from `nccl.h` (`INT_MIN`): "let NCCL choose".
const CONFIG_UNDEF_INT: c_int = c_int::MIN;

/// `NCCL_VERSION(2, 28, 3)`: the header version the `nccl-02028` bindings (and so the
/// layout of [`sys::ncclConfig_t`]) correspond to. NCCL reads the config fields this
/// version defines.
const CONFIG_VERSION: u32 = 2 * 10000 + 28 * 100 + 3;

/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;

/// `NCCL_CONFIG_INITIALIZER`, reproduced by hand (cudarc has no initializer):
/// size, magic `0xcafebeef`, version, and every attribute undefined.
fn config_initializer() -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: CONFIG_VERSION,
        blocking: CONFIG_UNDEF_INT,
        cgaClusterSize: CONFIG_UNDEF_INT,
        minCTAs: CONFIG_UNDEF_INT,
        maxCTAs: CONFIG_UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: CONFIG_UNDEF_INT,
        trafficClass: CONFIG_UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: CONFIG_UNDEF_INT,
        CTAPolicy: CONFIG_UNDEF_INT,
        shrinkShare: CONFIG_UNDEF_INT,
        nvlsCTAs: CONFIG_UNDEF_INT,
        nChannelsPerNetPeer: CONFIG_UNDEF_INT,
        nvlinkCentricSched: CONFIG_UNDEF_INT,
    }
}

/// The config of every tessera communicator: NCCL's defaults, non-blocking.
fn nonblocking_config() -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        blocking: 0,
        ..config_initializer()
    }
}

/// The 128 bytes that let ranks find each other when creating a communicator
/// (`ncclUniqueId`). Rank 0 creates it ([`UniqueId::new`]) and sends
/// [`to_bytes`](UniqueId::to_bytes) to the others, e.g. through the
/// [`Store`](crate::Store).
#[derive(Clone, Copy)]
pub struct UniqueId(sys::ncclUniqueId);

impl UniqueId {
    /// A fresh id (`ncclGetUniqueId`; on rank 0 this also starts NCCL's bootstrap
    /// listener). [`Error::CudaUnavailable`] without CUDA or NCCL.
    pub fn new() -> Result<Self> {
        ensure_available()?;
        let mut id = sys::ncclUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        // SAFETY: NCCL is loaded (checked by `ensure_available`), and `id` is a valid,
        // writable `ncclUniqueId`.
        let r = unsafe { sys::ncclGetUniqueId(&mut id) };
        match Code::from(r) {
            Code::Success => Ok(UniqueId(id)),
            other => Err(nccl_error("ncclGetUniqueId", other, std::ptr::null_mut())),
        }
    }

    /// The id's bytes.
    pub fn to_bytes(&self) -> [u8; UNIQUE_ID_BYTES] {
        self.0.internal.map(|c| c as u8)
    }

    /// The id from bytes made by [`to_bytes`](UniqueId::to_bytes).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let b: &[u8; UNIQUE_ID_BYTES] = bytes.try_into().map_err(|_| {
            Error::invalid(
                "UniqueId::from_bytes",
                format!(
                    "an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {}",
                    bytes.len()
                ),
            )
        })?;
        Ok(UniqueId(sys::ncclUniqueId {
            internal: b.map(|c| c as std::ffi::c_char),
        }))
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The bytes hold rank 0's bootstrap address; not useful in logs.
        f.write_str("UniqueId(..)")
    }
}

/// An NCCL result, read as a plain integer so that codes this binding does not know
/// (newer NCCL adds some) are not undefined behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Code {
    Success,
    InProgress,
    Failed(u32),
}

impl From<sys::ncclResult_t> for Code {
    fn from(r: sys::ncclResult_t) -> Self {
        Code::from_raw(r as u32)
    }
}

impl Code {
    fn from_raw(raw: u32) -> Self {
        match raw {
            0 => Code::Success,
            7 => Code::InProgress,
            other => Code::Failed(other),
        }
    }

    /// The binding's enum value for a code it knows.
    fn known(raw: u32) -> Option<sys::ncclResult_t> {
        use sys::ncclResult_t::*;
        Some(match raw {
            0 => ncclSuccess,
            1 => ncclUnhandledCudaError,
            2 => ncclSystemError,
            3 => ncclInternalError,
            4 => ncclInvalidArgument,
            5 => ncclInvalidUsage,
            6 => ncclRemoteError,
            7 => ncclInProgress,
            _ => return None,
        })
    }

    fn describe(self) -> String {
        let raw = match self {
            Code::Success => 0,
            Code::InProgress => 7,
            Code::Failed(r) => r,
        };
        match Code::known(raw) {
            Some(r) => {
                // SAFETY: NCCL is loaded (every `Code` comes from an NCCL call), and
                // `ncclGetErrorString` returns a static NUL-terminated string for every
                // valid result.
                let s = unsafe { sys::ncclGetErrorString(r) };
                let text = if s.is_null() {
                    String::new()
                } else {
                    // SAFETY: non-null, NUL-terminated, static (see above).
                    unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
                };
                format!("{text} ({r:?})")
            }
            None => format!("NCCL result code {raw}"),
        }
    }
}

/// `Error::Cuda` for a failed NCCL call, with NCCL's own messages: the result's
/// string and `ncclGetLastError`.
fn nccl_error(op: &'static str, code: Code, comm: sys::ncclComm_t) -> Error {
    // SAFETY: NCCL is loaded; `comm` is a live communicator or null, both accepted.
    let last = unsafe { sys::ncclGetLastError(comm) };
    let last = if last.is_null() {
        String::new()
    } else {
        // SAFETY: a NUL-terminated string owned by NCCL, valid until the next call on
        // this thread; copied at once.
        unsafe { CStr::from_ptr(last) }
            .to_string_lossy()
            .trim()
            .to_owned()
    };
    let detail = if last.is_empty() {
        " (run with NCCL_DEBUG=WARN for NCCL's log)".to_owned()
    } else {
        format!(": {last}")
    };
    Error::Cuda {
        op,
        msg: format!("{}{detail}", code.describe()),
    }
}

/// One rank's NCCL communicator, owned: created non-blocking
/// (`ncclCommInitRankConfig` with `blocking = 0`) and polled to completion with a
/// timeout, split with `ncclCommSplit`, finalized and destroyed on drop — or aborted
/// (`ncclCommAbort`) when an error was seen or finalizing times out.
///
/// It is `Send` but not `Sync`: NCCL allows a communicator to be used from one thread
/// at a time. [`NcclGroup`](super::NcclGroup) keeps it behind a mutex.
///
/// After an error (a failed call, an asynchronous error, a timeout) the communicator
/// is aborted and every later call fails with [`Error::State`] naming the first
/// error; NCCL gives no guarantee about a communicator after an error.
pub struct Communicator {
    raw: sys::ncclComm_t,
    rank: usize,
    size: usize,
    device: Arc<CudaDevice>,
    /// The first error seen; the communicator is aborted when this is set.
    failure: Option<String>,
    /// How long dropping waits for `ncclCommFinalize` before aborting.
    finalize_timeout: Duration,
}

// SAFETY: `ncclComm_t` is a pointer to a heap object NCCL owns; NCCL permits using a
// communicator from any host thread as long as calls on it are not concurrent. A
// `Communicator` is its handle's single owner (it is neither `Clone` nor `Sync`, and
// `as_raw` hands the pointer out only for `unsafe` use), so every call on it goes
// through `&mut self` or `&self` of one thread at a time.
unsafe impl Send for Communicator {}

/// Whether a non-blocking operation has finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommState {
    /// Nothing is in progress.
    Ready,
    /// An initialization, split, finalize or group launch is still running.
    InProgress,
}

impl Communicator {
    /// Joins rank `rank` of the `size` ranks that use `id`, on `device`; waits up to
    /// `timeout` for every rank to join (NCCL's init is collective), aborting and
    /// failing after that.
    pub fn init_rank(
        id: &UniqueId,
        rank: usize,
        size: usize,
        device: &Arc<CudaDevice>,
        timeout: Duration,
    ) -> Result<Communicator> {
        const OP: &str = "ncclCommInitRankConfig";
        if size == 0 || rank >= size {
            return Err(Error::invalid(
                "Communicator::init_rank",
                format!("rank {rank} is not a rank of a communicator of {size}"),
            ));
        }
        let (n, r) = (to_int(OP, size)?, to_int(OP, rank)?);
        ensure_available()?;
        // NCCL takes its device from the calling thread's current context.
        device
            .context()
            .bind_to_thread()
            .cuda_op("cuCtxSetCurrent")?;
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        let mut config = nonblocking_config();
        // SAFETY: NCCL is loaded; `raw` and `config` are valid for writes and reads
        // for the call (NCCL copies the config); `id` is a 128-byte id made by
        // `ncclGetUniqueId` on rank 0.
        let code =
            Code::from(unsafe { sys::ncclCommInitRankConfig(&mut raw, n, id.0, r, &mut config) });
        let mut comm = Communicator {
            raw,
            rank,
            size,
            device: device.clone(),
            failure: None,
            finalize_timeout: timeout,
        };
        if let Code::Failed(_) = code {
            return Err(comm.fail(OP, code));
        }
        if comm.raw.is_null() {
            return Err(Error::Cuda {
                op: OP,
                msg: "NCCL returned no communicator".into(),
            });
        }
        comm.wait_ready(OP, timeout)?;
        Ok(comm)
    }

    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The device the communicator runs on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// The raw handle (null once aborted). Using it is `unsafe`: do not destroy or
    /// abort it, and do not use it concurrently with this object.
    pub fn as_raw(&self) -> sys::ncclComm_t {
        self.raw
    }

    /// Whether the communicator was aborted (after an error or by
    /// [`abort`](Communicator::abort)).
    pub fn is_aborted(&self) -> bool {
        self.raw.is_null()
    }

    /// The first error this communicator saw, if any.
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    /// Fails when the communicator cannot be used any more.
    pub fn check_usable(&self, op: &'static str) -> Result<()> {
        if self.raw.is_null() {
            return Err(Error::state(
                op,
                format!(
                    "the NCCL communicator (rank {} of {}) was aborted{}",
                    self.rank,
                    self.size,
                    self.failure
                        .as_deref()
                        .map(|f| format!(" after an error: {f}"))
                        .unwrap_or_default()
                ),
            ));
        }
        Ok(())
    }

    /// Polls the asynchronous state (`ncclCommGetAsyncError`) without blocking. An
    /// error aborts the communicator and is returned with NCCL's message.
    pub fn poll(&mut self, op: &'static str) -> Result<CommState> {
        self.check_usable(op)?;
        let mut state: u32 = 0;
        // SAFETY: `raw` is a live communicator (checked above) used by this thread
        // only (`&mut self`). `ncclResult_t` is `repr(u32)`, so a `u32` is a valid
        // place for NCCL to write it, and one that stays sound if a newer NCCL writes
        // a code the binding's enum lacks.
        let call = Code::from(unsafe {
            sys::ncclCommGetAsyncError(self.raw, (&mut state as *mut u32).cast())
        });
        if let Code::Failed(_) = call {
            return Err(self.fail("ncclCommGetAsyncError", call));
        }
        match Code::from_raw(state) {
            Code::Success => Ok(CommState::Ready),
            Code::InProgress => Ok(CommState::InProgress),
            failed => Err(self.fail(op, failed)),
        }
    }

    /// Polls until nothing is in progress; after `timeout` the communicator is
    /// aborted and the error says what timed out.
    pub fn wait_ready(&mut self, op: &'static str, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let mut nap = Duration::from_micros(20);
        loop {
            if self.poll(op)? == CommState::Ready {
                return Ok(());
            }
            if start.elapsed() >= timeout {
                let msg = format!(
                    "rank {} of {}: still in progress after {timeout:?}; aborted the communicator (a peer may have died, never joined, or issued different collectives)",
                    self.rank, self.size
                );
                self.abort_with(&msg);
                return Err(Error::state(op, msg));
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(2));
        }
    }

    /// Splits the communicator (`ncclCommSplit`, collective over all its ranks):
    /// ranks passing the same `color` form a new communicator, ordered by `key` (ties
    /// by rank); `color = None` (NCCL_SPLIT_NOCOLOR) joins none and gets `Ok(None)`.
    /// Waits up to `timeout`.
    pub fn split(
        &mut self,
        color: Option<u32>,
        key: usize,
        timeout: Duration,
    ) -> Result<Option<Communicator>> {
        const OP: &str = "ncclCommSplit";
        self.check_usable(OP)?;
        let color = match color {
            Some(c) => c_int::try_from(c)
                .map_err(|_| Error::invalid(OP, format!("color {c} exceeds i32::MAX")))?,
            None => NCCL_SPLIT_NOCOLOR,
        };
        let key = to_int(OP, key)?;
        self.device
            .context()
            .bind_to_thread()
            .cuda_op("cuCtxSetCurrent")?;
        // NCCL writes the new handle from the split's asynchronous job when the split
        // completes ("*newcomm should be NCCL_COMM_NULL until comm split fully
        // complete", init.cc), so the out-slot lives on the heap, and is leaked when
        // we give up waiting (the job might still write it).
        let slot: *mut sys::ncclComm_t = Box::into_raw(Box::new(std::ptr::null_mut()));
        let mut config = nonblocking_config();
        // SAFETY: `self.raw` is live and used by this thread only; `slot` is a valid,
        // heap-allocated place that outlives the split's job; NCCL copies the config.
        let code =
            Code::from(unsafe { sys::ncclCommSplit(self.raw, color, key, slot, &mut config) });
        if let Code::Failed(_) = code {
            // The split failed before launching its job; a handle it left is aborted.
            // SAFETY: no job is running, so nothing else touches `slot`; it came from
            // `Box::into_raw` above and is freed exactly once here.
            let raw = *unsafe { Box::from_raw(slot) };
            if !raw.is_null() {
                // SAFETY: NCCL handed out this half-made communicator; nobody else has it.
                unsafe { sys::ncclCommAbort(raw) };
            }
            return Err(self.fail(OP, code));
        }
        // The split runs as an asynchronous job of the parent: wait for it.
        self.wait_ready(OP, timeout)?;
        let start = Instant::now();
        let raw = loop {
            // SAFETY: `slot` is valid (leaked on every early return); the volatile read
            // tolerates the job's write, which the parent's ready state orders before.
            let raw = unsafe { std::ptr::read_volatile(slot) };
            if !raw.is_null() || color == NCCL_SPLIT_NOCOLOR {
                break raw;
            }
            if start.elapsed() >= timeout {
                return Err(Error::state(
                    OP,
                    format!(
                        "no communicator arrived within {timeout:?} although the parent is ready"
                    ),
                ));
            }
            std::thread::sleep(Duration::from_micros(100));
        };
        // SAFETY: the handle has arrived (or, for NCCL_SPLIT_NOCOLOR, the job is done),
        // so no one writes `slot` any more; freed exactly once.
        drop(unsafe { Box::from_raw(slot) });
        let mut child = (!raw.is_null()).then(|| Communicator {
            raw,
            rank: 0,
            size: 0,
            device: self.device.clone(),
            failure: None,
            finalize_timeout: self.finalize_timeout,
        });
        if let Some(c) = child.as_mut() {
            c.wait_ready(OP, timeout)?;
            let (mut n, mut r): (c_int, c_int) = (0, 0);
            // SAFETY: `c.raw` is live and ready; `n` is a valid place for the int.
            let counted = Code::from(unsafe { sys::ncclCommCount(c.raw, &mut n) });
            // SAFETY: as above, for `r`.
            let ranked = Code::from(unsafe { sys::ncclCommUserRank(c.raw, &mut r) });
            for code in [counted, ranked] {
                if code != Code::Success {
                    return Err(c.fail(OP, code));
                }
            }
            c.size = usize::try_from(n).unwrap_or(0);
            c.rank = usize::try_from(r).unwrap_or(0);
        }
        Ok(child)
    }

    /// Aborts the communicator (`ncclCommAbort`): pending operations stop, kernels
    /// waiting on peers exit, and every later call fails. Idempotent.
    pub fn abort(&mut self) {
        self.abort_with("aborted by the caller");
    }

    /// Records `reason` (if no earlier failure is recorded) and aborts.
    pub(crate) fn abort_with(&mut self, reason: &str) {
        if self.failure.is_none() {
            self.failure = Some(reason.to_owned());
        }
        if self.raw.is_null() {
            return;
        }
        let _ = self.device.context().bind_to_thread();
        // SAFETY: `raw` is live and owned by this object; after the call it is
        // nulled and never used again.
        let code = Code::from(unsafe { sys::ncclCommAbort(self.raw) });
        if code != Code::Success {
            tracing::warn!(error = %code.describe(), "ncclCommAbort failed");
        }
        self.raw = std::ptr::null_mut();
    }

    /// Builds the error for a failed call, records it, and aborts.
    pub(crate) fn fail(&mut self, op: &'static str, code: Code) -> Error {
        let e = nccl_error(op, code, self.raw);
        self.abort_with(&e.to_string());
        e
    }

    /// Runs `enqueue` between `ncclGroupStart` and `ncclGroupEnd` and waits (up to
    /// `timeout`) until the group is launched. `enqueue` receives the raw handle and
    /// must only make NCCL calls on it, returning each call's result; a failed call
    /// (or a failed group end) aborts the communicator. Returns when the operations
    /// are enqueued on their streams, not when they are complete.
    ///
    /// # Safety
    ///
    /// Every NCCL call `enqueue` makes must be valid: device pointers to live device
    /// memory of at least the bytes the call touches, on this communicator's device,
    /// kept alive until the stream has passed the operations; streams of this device.
    pub unsafe fn group(
        &mut self,
        op: &'static str,
        timeout: Duration,
        enqueue: impl FnOnce(sys::ncclComm_t) -> Vec<sys::ncclResult_t>,
    ) -> Result<()> {
        self.check_usable(op)?;
        self.device
            .context()
            .bind_to_thread()
            .cuda_op("cuCtxSetCurrent")?;
        // SAFETY: NCCL is loaded (a communicator exists); group calls are per thread.
        let started = Code::from(unsafe { sys::ncclGroupStart() });
        if started != Code::Success {
            return Err(self.fail("ncclGroupStart", started));
        }
        let results = enqueue(self.raw);
        // SAFETY: balances the `ncclGroupStart` above on this thread. If a call
        // inside failed, NCCL reports it here and launches none of the group.
        let ended = Code::from(unsafe { sys::ncclGroupEnd() });
        if let Some(bad) = results
            .into_iter()
            .map(Code::from)
            .find(|c| matches!(c, Code::Failed(_)))
        {
            return Err(self.fail(op, bad));
        }
        if let Code::Failed(_) = ended {
            return Err(self.fail("ncclGroupEnd", ended));
        }
        // Non-blocking: the launch may still be running; NCCL asks that nothing else
        // be queued on its streams until the state is ready.
        self.wait_ready(op, timeout)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if self.raw.is_null() {
            return;
        }
        if self.failure.is_some() {
            self.abort_with("dropped after an error");
            return;
        }
        let _ = self.device.context().bind_to_thread();
        // SAFETY: `raw` is live and owned by this object.
        let code = Code::from(unsafe { sys::ncclCommFinalize(self.raw) });
        if let Code::Failed(_) = code {
            let e = self.fail("ncclCommFinalize", code);
            tracing::warn!(error = %e, "finalizing an NCCL communicator failed; aborted it");
            return;
        }
        if let Err(e) = self.wait_ready("ncclCommFinalize", self.finalize_timeout) {
            tracing::warn!(error = %e, "finalizing an NCCL communicator failed; aborted it");
            return;
        }
        // SAFETY: `raw` is live, finalized, and never used after this call.
        let code = Code::from(unsafe { sys::ncclCommDestroy(self.raw) });
        if code != Code::Success {
            tracing::warn!(error = %code.describe(), "ncclCommDestroy failed");
        }
        self.raw = std::ptr::null_mut();
    }
}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.device.ordinal())
            .field("aborted", &self.raw.is_null())
            .field("failure", &self.failure)
            .finish()
    }
}

fn to_int(op: &'static str, v: usize) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| Error::invalid(op, format!("{v} exceeds NCCL's int range")))
}
