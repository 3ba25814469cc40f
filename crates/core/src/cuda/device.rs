use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{CUdevice_attribute, CUmemPool_attribute, CUmemoryPool};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream};

use super::CudaResultExt;
use crate::kernels::{self, PtxModule};
use crate::{Error, Result};

/// Whether a CUDA driver and at least one device are present. Never panics.
pub fn is_available() -> bool {
    device_count().is_ok_and(|n| n > 0)
}

/// The number of CUDA devices, or [`Error::CudaUnavailable`] when the driver library
/// cannot be loaded or initialised. Never panics.
pub fn device_count() -> Result<usize> {
    static COUNT: OnceLock<Result<usize>> = OnceLock::new();
    COUNT
        .get_or_init(|| {
            // SAFETY: `is_culib_present` only tries to dlopen the driver library's
            // candidate file names and drops any handle it opens.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err(Error::CudaUnavailable {
                    reason: "the CUDA driver library (libcuda.so) could not be loaded".into(),
                });
            }
            cudarc::driver::result::init().map_err(|e| Error::CudaUnavailable {
                reason: format!("cuInit failed: {e}"),
            })?;
            let n = CudaContext::device_count().map_err(|e| Error::CudaUnavailable {
                reason: format!("cuDeviceGetCount failed: {e}"),
            })?;
            Ok(usize::try_from(n).unwrap_or(0))
        })
        .clone()
}

/// The process-wide handle of CUDA device `ordinal`, created on first use.
///
/// Fails with [`Error::CudaUnavailable`] without a driver and with
/// [`Error::InvalidArgument`] for an ordinal past the device count.
pub fn device(ordinal: usize) -> Result<Arc<CudaDevice>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
    let count = device_count()?;
    if ordinal >= count {
        return Err(Error::invalid(
            "cuda::device",
            format!("CUDA device {ordinal} requested but this machine has {count}"),
        ));
    }
    let mut devices = DEVICES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(d) = devices.get(&ordinal) {
        return Ok(d.clone());
    }
    let d = Arc::new(CudaDevice::open(ordinal)?);
    devices.insert(ordinal, d.clone());
    Ok(d)
}

/// Loaded modules by name (with the code each was loaded from), and the functions
/// already looked up in them.
#[derive(Default)]
struct Modules {
    modules: HashMap<&'static str, (Arc<CudaModule>, ModuleCode)>,
    functions: HashMap<&'static str, HashMap<String, CudaFunction>>,
}

/// What a loaded [`PtxModule`] came from (see [`CudaDevice::loaded_code`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModuleCode {
    /// Its cubin ([`PtxModule::sass`]): the device has the capability it was compiled
    /// for, and the driver took it.
    Sass,
    /// Its PTX, compiled by the driver (or taken from the driver's compute cache).
    Ptx,
}

/// One CUDA device as tessera uses it: its primary context, the tessera stream (see
/// the [module docs](super)), and the PTX modules loaded on it.
pub struct CudaDevice {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    modules: Mutex<Modules>,
    name: String,
    compute_capability: (i32, i32),
    multiprocessors: u32,
    max_threads_per_multiprocessor: u32,
}

impl CudaDevice {
    fn open(ordinal: usize) -> Result<Self> {
        let ctx = CudaContext::new(ordinal).cuda_op("CudaContext::new")?;
        // SAFETY: this context object is private to tessera and has made no allocation
        // yet. All of tessera's work on it goes to the one stream created below, in
        // program order (the stream invariant of the module docs), so no buffer needs
        // events to order its uses.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().cuda_op("cuStreamCreate")?;
        let pool = default_pool(&ctx)?;
        // Stream-ordered allocations (`alloc_bytes`) come from the device's default pool,
        // which by default hands freed memory back to the driver at every
        // synchronisation: a loop that allocates its outputs then pays for mapping fresh
        // pages on every call. Keep freed memory in the pool instead, as PyTorch's
        // allocators do; `release_cached_memory` hands it back.
        let mut threshold = u64::MAX;
        // SAFETY: `pool` is the device's live default pool, and the release threshold
        // attribute takes a u64, which `threshold` is.
        unsafe {
            cudarc::driver::result::mem_pool::set_attribute(
                pool,
                CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
        }
        .cuda_op("cuMemPoolSetAttribute")?;
        let attr = |a| ctx.attribute(a).cuda_op("cuDeviceGetAttribute");
        let multiprocessors =
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let max_threads_per_multiprocessor =
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)? as u32;
        Ok(CudaDevice {
            ordinal,
            name: ctx.name().cuda_op("cuDeviceGetName")?,
            compute_capability: ctx.compute_capability().cuda_op("cuDeviceGetAttribute")?,
            ctx,
            stream,
            modules: Mutex::new(Modules::default()),
            multiprocessors,
            max_threads_per_multiprocessor,
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The driver context (the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The tessera stream of this device.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's name, e.g. `"NVIDIA H200"`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `(major, minor)` compute capability.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// Number of streaming multiprocessors.
    pub fn multiprocessors(&self) -> u32 {
        self.multiprocessors
    }

    /// Resident threads per multiprocessor.
    pub fn max_threads_per_multiprocessor(&self) -> u32 {
        self.max_threads_per_multiprocessor
    }

    /// Kernel `function` of `module`, loading the module on first use and caching the
    /// function handle, so a launch costs one map lookup.
    pub fn function(&self, module: &PtxModule, function: &str) -> Result<CudaFunction> {
        let mut cache = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = cache
            .functions
            .get(module.name)
            .and_then(|m| m.get(function))
        {
            return Ok(f.clone());
        }
        let m = match cache.modules.get(module.name) {
            Some((m, _)) => m.clone(),
            None => {
                let (m, code) = self.load(module)?;
                cache.modules.insert(module.name, (m.clone(), code));
                m
            }
        };
        let f = m.load_function(function).map_err(|e| Error::Cuda {
            op: "cuModuleGetFunction",
            msg: format!("kernel `{function}` in module `{}`: {e}", module.name),
        })?;
        cache
            .functions
            .entry(module.name)
            .or_default()
            .insert(function.to_owned(), f.clone());
        Ok(f)
    }

    /// What `module` was loaded from on this device, or `None` before its first
    /// [`function`](Self::function) call.
    pub fn loaded_code(&self, module: &PtxModule) -> Option<ModuleCode> {
        let cache = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        cache.modules.get(module.name).map(|(_, code)| *code)
    }

    /// The device's compute capability as unsigned numbers.
    fn capability(&self) -> (u32, u32) {
        let (major, minor) = self.compute_capability;
        (major.max(0) as u32, minor.max(0) as u32)
    }

    /// Loads `module`: its cubin where this device has the capability the cubin was
    /// compiled for and the driver takes it, else its PTX.
    fn load(&self, module: &PtxModule) -> Result<(Arc<CudaModule>, ModuleCode)> {
        // The driver would refuse PTX for a newer architecture with an error that does
        // not say which; say it, with both capabilities.
        if let Some(needs) = kernels::ptx_target(module.ptx) {
            let device = format!("device {} ({})", self.ordinal, self.name);
            kernels::check_device_runs(module.name, &device, self.capability(), needs)?;
        }
        if let Some(sass) = module.sass
            && self.capability() == kernels::PTX_TARGET
        {
            // A driver older than the ptxas that wrote the cubin refuses it; the PTX is
            // the same code, so it is the fallback (whose own error, if any, says what
            // the driver lacks).
            if let Ok(m) = self
                .ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(sass.cubin.to_vec()))
            {
                return Ok((m, ModuleCode::Sass));
            }
        }
        let m = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(module.ptx))
            .map_err(|e| Error::Cuda {
                op: "cuModuleLoadData",
                msg: format!(
                    "loading PTX module `{}`: {e}{}",
                    module.name,
                    isa_hint(module.ptx, driver_cuda_version())
                ),
            })?;
        Ok((m, ModuleCode::Ptx))
    }

    /// Waits for all work queued on the tessera stream.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().cuda_op("cuStreamSynchronize")
    }

    /// Waits for the tessera stream, then hands the memory that freed buffers left
    /// cached in the device's default pool back to the driver (PyTorch's
    /// `torch.cuda.empty_cache`). Freed memory otherwise stays cached for later
    /// allocations, so that steady-state allocation costs no page mapping.
    pub fn release_cached_memory(&self) -> Result<()> {
        self.synchronize()?;
        let pool = default_pool(&self.ctx)?;
        // SAFETY: `pool` is the device's live default pool.
        unsafe { cudarc::driver::result::mem_pool::trim_to(pool, 0) }.cuda_op("cuMemPoolTrimTo")
    }

    /// An allocation of `bytes` bytes on the tessera stream, contents unspecified.
    ///
    /// Zero-byte requests allocate one byte, so a buffer always has a valid address.
    pub fn alloc_bytes(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        // SAFETY: the memory is handed out as plain bytes, for which every bit pattern
        // is a valid value; callers that care about contents write before they read.
        unsafe { self.stream.alloc::<u8>(bytes.max(1)) }.cuda_op("cuMemAllocAsync")
    }
}

/// The CUDA version the loaded driver supports, `(major, minor)`.
fn driver_cuda_version() -> Option<(i32, i32)> {
    let mut v = 0;
    // SAFETY: a context exists (the caller holds a device), so the driver library is
    // loaded and initialised; the call writes one int.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) }
        .result()
        .ok()?;
    Some((v / 1000, v % 1000 / 10))
}

/// What a failed module load adds to the driver's message: the PTX ISA version of the
/// module and the CUDA version of the driver, since a driver refuses PTX of an ISA newer
/// than its own release (ISA 9.0 came with CUDA 13.0).
fn isa_hint(ptx: &str, driver: Option<(i32, i32)>) -> String {
    match (kernels::ptx_isa_version(ptx), driver) {
        (Some((a, b)), Some((c, d))) => format!(
            " (the module is PTX ISA {a}.{b}; the driver supports CUDA {c}.{d}, and a driver \
             refuses an ISA newer than its CUDA release knows, ISA 9.0 being CUDA 13.0's: \
             update the driver)"
        ),
        (Some((a, b)), None) => format!(" (the module is PTX ISA {a}.{b})"),
        _ => String::new(),
    }
}

/// The default memory pool of `ctx`'s device.
fn default_pool(ctx: &CudaContext) -> Result<CUmemoryPool> {
    // SAFETY: `cu_device` is the handle of a device the driver enumerated (the context
    // was created on it).
    unsafe { cudarc::driver::result::device::get_default_mem_pool(ctx.cu_device()) }
        .cuda_op("cuDeviceGetDefaultMemPool")
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("compute_capability", &self.compute_capability)
            .field("multiprocessors", &self.multiprocessors)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_module_load_names_the_isa_and_the_driver() {
        let ptx = ".version 9.0\n.target sm_90\n";
        let hint = isa_hint(ptx, Some((12, 4)));
        assert!(hint.contains("PTX ISA 9.0"), "{hint}");
        assert!(hint.contains("CUDA 12.4"), "{hint}");
        assert_eq!(isa_hint(ptx, None), " (the module is PTX ISA 9.0)");
        assert_eq!(isa_hint("no directives", Some((13, 0))), "");
    }
}
