//! One rank's GPU: the driver found (or an error naming what is missing, never a panic from
//! cudarc), a stream of the rank's own on the device's primary context, the kernels of
//! `kernels/cuda/*.cu` compiled by NVRTC for the device's own compute capability (once per
//! process and device), launches, device and pinned host buffers, and the count of every time
//! the host waits for the device (`host_waits`: the step path must never add to it).

use super::emulate::Emulator;
use super::error::CudaError;
use super::host_capture::{HostCapture, HostOp};
use super::launch::{launch_programmatic, Arg, PDL_KERNELS};
use super::sources::{compile_sources, kernel_names, large_shared, tuned, SOURCES};
use cudarc::driver::{result, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DeviceRepr};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// Whether the CUDA driver library can be loaded here (no GPU call is made).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Number of GPUs the driver shows, or why there are none.
pub fn visible_gpus() -> Result<usize, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    guarded(0, "counting GPUs", || {
        result::init()?;
        CudaContext::device_count()
    })
    .map(|n| n.max(0) as usize)
}

/// Runs a driver call, turning its error — or a panic inside cudarc (a missing symbol) — into a
/// [`CudaError`] that names the GPU and what was being done.
fn guarded<T>(gpu: usize, what: &str, f: impl FnOnce() -> Result<T, result::DriverError>) -> Result<T, CudaError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(CudaError::Driver { gpu, what: what.to_string(), message: format!("{e:?}") }),
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "cudarc panicked".to_string());
            Err(CudaError::Driver { gpu, what: what.to_string(), message })
        }
    }
}

/// The compiled kernels of one device, by name.
pub(super) struct Kernels {
    functions: HashMap<String, CudaFunction>,
    arch: String,
}

/// Kernels compiled per device ordinal, once per process.
fn kernels_of(ctx: &Arc<CudaContext>, gpu: usize) -> Result<Arc<Kernels>, CudaError> {
    static COMPILED: OnceLock<Mutex<HashMap<usize, Arc<Kernels>>>> = OnceLock::new();
    let mut compiled = COMPILED.get_or_init(Default::default).lock();
    if let Some(k) = compiled.get(&gpu) {
        return Ok(k.clone());
    }
    let (major, minor) = guarded(gpu, "reading the compute capability", || ctx.compute_capability())?;
    let arch = format!("compute_{major}{minor}");
    let mut functions = HashMap::new();
    for (file, ptx) in compile_sources(&arch)? {
        let source = SOURCES.iter().find(|(f, _)| *f == file).map_or("", |(_, s)| s);
        let module = guarded(gpu, &format!("loading kernels/cuda/{file}"), || ctx.load_module(ptx))?;
        for name in kernel_names(source) {
            let f = guarded(gpu, &format!("loading kernel {name}"), || module.load_function(&name))?;
            if let Some(bytes) = large_shared(&name) {
                let attribute =
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
                guarded(gpu, &format!("raising {name}'s shared memory to {bytes} bytes"), || {
                    f.set_attribute(attribute, bytes as i32)
                })?;
            }
            functions.insert(name, f);
        }
    }
    let k = Arc::new(Kernels { functions, arch });
    compiled.insert(gpu, k.clone());
    Ok(k)
}

/// Where a [`Gpu`]'s work runs.
pub(super) enum Backend {
    Cuda {
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        kernels: Arc<Kernels>,
    },
    /// The kernels on the CPU (`emulate.rs`): synchronous, device memory is host memory.
    Host(Arc<Emulator>),
}

/// One rank's view of its GPU.
pub struct Gpu {
    pub ordinal: usize,
    pub(super) backend: Backend,
    host_waits: AtomicU64,
    /// Bytes copied to the device by [`Gpu::upload`] (weights, at load).
    uploaded: AtomicU64,
    /// Streaming multiprocessors (what a launch's blocks spread over).
    pub sms: usize,
    /// While profiling (benches only): each launch's kernel and its start and end events. The
    /// flag keeps the lock off every other launch.
    profiling: std::sync::atomic::AtomicBool,
    profile: Mutex<Option<Vec<(String, CudaEvent, CudaEvent)>>>,
    /// While a step is captured under emulation (`graph.rs`): what it enqueues, recorded
    /// instead of run.
    pub(super) host_capture: Mutex<Option<HostCapture>>,
    /// Under emulation: launches run so far, per kernel (what the checks see took which kernel).
    emulated_launches: Mutex<std::collections::BTreeMap<String, u64>>,
    /// Zeroed counters a split product's blocks count their arrivals in (kernels/cuda/bf16.cu's
    /// `linear_bf16_split`; each product leaves them zeroed for the next on the stream), made
    /// with the device so that no captured step owns them.
    tile_arrivals: std::sync::OnceLock<DeviceBuf<u32>>,
}

/// The split products' tile counters a device keeps ([`Gpu::tile_arrivals`]).
pub const TILE_ARRIVALS: usize = 4096;

/// Device time per kernel over a profiled stretch: name, launches, milliseconds.
pub type KernelTimes = Vec<(String, usize, f64)>;

/// A point in a stream's work (`None`: emulated work, done when enqueued).
pub struct Event(Option<CudaEvent>);

impl Gpu {
    /// Opens GPU `ordinal` with a stream of its own; compiles the kernels if this process has
    /// not yet for that GPU.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>, CudaError> {
        let visible = visible_gpus()?;
        if ordinal >= visible {
            return Err(CudaError::NoSuchGpu { asked: ordinal, visible });
        }
        let ctx = guarded(ordinal, "creating the context", || CudaContext::new(ordinal))?;
        // One stream per rank and nothing shared across streams without an event the executor
        // records itself: cudarc's per-buffer event tracking would only add work to each launch.
        // SAFETY: called before any buffer of this context is allocated by kvflow.
        unsafe { ctx.disable_event_tracking() };
        let stream = guarded(ordinal, "creating a stream", || ctx.new_stream())?;
        let kernels = kernels_of(&ctx, ordinal)?;
        let sms = guarded(ordinal, "reading the SM count", || {
            ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        })?;
        Arc::new(Gpu {
            ordinal,
            sms: sms.max(1) as usize,
            backend: Backend::Cuda { ctx, stream, kernels },
            host_waits: AtomicU64::new(0),
            uploaded: AtomicU64::new(0),
            profiling: std::sync::atomic::AtomicBool::new(false),
            profile: Mutex::new(None),
            host_capture: Mutex::new(None),
            emulated_launches: Mutex::new(Default::default()),
            tile_arrivals: std::sync::OnceLock::new(),
        })
        .with_tile_arrivals()
    }

    /// The same kernels emulated on the CPU (checks without a GPU; slow).
    pub fn emulated() -> Result<Arc<Gpu>, CudaError> {
        Arc::new(Gpu {
            ordinal: 0,
            // as an H200 has (the tile choices then match a GPU's; the bits do not depend on them)
            sms: 132,
            backend: Backend::Host(Emulator::get()?),
            host_waits: AtomicU64::new(0),
            uploaded: AtomicU64::new(0),
            profiling: std::sync::atomic::AtomicBool::new(false),
            profile: Mutex::new(None),
            host_capture: Mutex::new(None),
            emulated_launches: Mutex::new(Default::default()),
            tile_arrivals: std::sync::OnceLock::new(),
        })
        .with_tile_arrivals()
    }

    /// Whether `other`'s kernels can read this one's memory (the same device, or both emulated
    /// in this process).
    pub fn same_device(&self, other: &Gpu) -> bool {
        self.is_emulated() == other.is_emulated() && self.ordinal == other.ordinal
    }

    pub fn is_emulated(&self) -> bool {
        matches!(self.backend, Backend::Host(_))
    }

    /// The architecture the kernels were compiled for (`compute_90` on an H200).
    pub fn arch(&self) -> &str {
        match &self.backend {
            Backend::Cuda { kernels, .. } => &kernels.arch,
            Backend::Host(_) => "the host CPU (emulated)",
        }
    }

    pub fn name(&self) -> String {
        match &self.backend {
            Backend::Cuda { ctx, .. } => ctx.name().unwrap_or_else(|_| "unknown GPU".into()),
            Backend::Host(_) => "CPU emulation of the CUDA kernels".into(),
        }
    }

    fn err(&self, what: &str) -> impl FnOnce(result::DriverError) -> CudaError + '_ {
        let what = what.to_string();
        move |e| CudaError::Driver { gpu: self.ordinal, what, message: format!("{e:?}") }
    }

    /// Enqueues kernel `name` on the rank's stream.
    pub fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<(), CudaError> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        match &self.backend {
            Backend::Cuda { ctx, stream, kernels } => {
                let f = kernels
                    .functions
                    .get(name)
                    .ok_or_else(|| CudaError::Unsupported(format!("no kernel {name} in kernels/cuda")))?;
                let mut profile = self.profiling.load(Ordering::Relaxed).then(|| self.profile.lock());
                let timed = match profile.as_mut().and_then(|p| p.as_mut()) {
                    Some(launches) => {
                        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
                        let start = ctx.new_event(timing).map_err(self.err("creating an event"))?;
                        let end = ctx.new_event(timing).map_err(self.err("creating an event"))?;
                        start.record(stream).map_err(self.err("recording an event"))?;
                        Some((launches, start, end))
                    }
                    None => None,
                };
                // (griddepcontrol is Hopper's and later: elsewhere the kernels would not wait; the
                // architecture is read only when PDL is asked for, off the ordinary launch's path)
                let hopper = || kernels.arch.strip_prefix("compute_").and_then(|c| c.parse::<u32>().ok()) >= Some(90);
                if tuned("PDL", 0) == 1 && PDL_KERNELS.contains(&name) && hopper() {
                    ctx.bind_to_thread().map_err(self.err("binding the context"))?;
                    // SAFETY: every kernel's arguments are built by this crate against its
                    // signature, and the kernel is one of PDL_KERNELS.
                    unsafe { launch_programmatic(f.cu_function(), stream.cu_stream(), grid, block, smem, args) }
                        .map_err(self.err(&format!("launching {name}")))?;
                } else {
                    let mut b = stream.launch_builder(f);
                    for a in args {
                        match a {
                            Arg::Ptr(p) => b.arg(p),
                            Arg::I32(v) => b.arg(v),
                            Arg::I64(v) => b.arg(v),
                            Arg::F32(v) => b.arg(v),
                        };
                    }
                    let cfg = LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: smem };
                    // SAFETY: every kernel's arguments are built by this crate against its signature.
                    unsafe { b.launch(cfg) }.map(|_| ()).map_err(self.err(&format!("launching {name}")))?;
                }
                if let Some((launches, start, end)) = timed {
                    end.record(stream).map_err(self.err("recording an event"))?;
                    launches.push((name.to_string(), start, end));
                }
                Ok(())
            }
            Backend::Host(emu) => {
                if let Some(capture) = self.host_capture.lock().as_mut() {
                    let (name, args) = (name.to_string(), args.to_vec());
                    capture.ops.push(HostOp::Launch { name, grid, block, smem, args });
                    return Ok(());
                }
                let mut values: Vec<[u8; 8]> = args.iter().map(Arg::bytes).collect();
                let mut ptrs: Vec<*mut std::ffi::c_void> =
                    values.iter_mut().map(|v| v.as_mut_ptr() as *mut std::ffi::c_void).collect();
                *self.emulated_launches.lock().entry(name.to_string()).or_default() += 1;
                emu.launch(name, grid, block, smem, &mut ptrs)
            }
        }
    }

    /// A device buffer of `len` elements, zeroed (stream-ordered: usable by later launches).
    pub fn zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<DeviceBuf<T>, CudaError> {
        match &self.backend {
            Backend::Cuda { stream, .. } => {
                let slice = stream.alloc_zeros::<T>(len.max(1)).map_err(self.err("allocating device memory"))?;
                Ok(DeviceBuf::wrap(slice, len, stream))
            }
            Backend::Host(_) => Ok(self.host_buffer(len, true)),
        }
    }

    /// A device buffer of `len` elements whose contents are unset (every use writes it first).
    pub fn scratch<T: DeviceRepr>(&self, len: usize) -> Result<DeviceBuf<T>, CudaError> {
        match &self.backend {
            Backend::Cuda { stream, .. } => {
                // SAFETY: callers write every element they later read.
                let slice = unsafe { stream.alloc::<T>(len.max(1)) }.map_err(self.err("allocating device memory"))?;
                Ok(DeviceBuf::wrap(slice, len, stream))
            }
            Backend::Host(_) => Ok(self.host_buffer(len, false)),
        }
    }

    /// Emulated device memory; while a step is captured, owned by the capture (as a CUDA
    /// graph's allocations are by the graph), and zeroed again at each replay when `zeroed`.
    fn host_buffer<T>(&self, len: usize, zeroed: bool) -> DeviceBuf<T> {
        let buf = DeviceBuf::host(len);
        match self.host_capture.lock().as_mut() {
            Some(capture) => {
                let bytes = (len * std::mem::size_of::<T>()).max(1);
                if zeroed {
                    capture.ops.push(HostOp::Zero { ptr: buf.ptr, bytes });
                }
                let ptr = buf.ptr;
                let Storage::Host(memory) = buf._storage else { unreachable!("a host buffer") };
                capture.memory.push(memory);
                DeviceBuf { _storage: Storage::Captured, ptr, len }
            }
            None => buf,
        }
    }

    /// A device copy of `data` (at load time: the host copy is staged by the driver).
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<DeviceBuf<T>, CudaError> {
        self.uploaded.fetch_add(std::mem::size_of_val(data) as u64, Ordering::Relaxed);
        match &self.backend {
            Backend::Cuda { stream, .. } => {
                let slice = stream.clone_htod(data).map_err(self.err("copying to the device"))?;
                Ok(DeviceBuf::wrap(slice, data.len(), stream))
            }
            Backend::Host(_) => {
                let buf = DeviceBuf::host(data.len());
                // SAFETY: a fresh allocation of `data.len()` elements.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.ptr as *mut T, data.len()) };
                Ok(buf)
            }
        }
    }

    /// Enqueues a copy of pinned host memory into device memory (never waits).
    pub fn copy_to_device<T>(&self, dst: u64, src: &PinnedBuf<T>, len: usize) -> Result<(), CudaError> {
        let src = &src.as_slice()[..len];
        match &self.backend {
            // SAFETY: `src` is pinned and outlives the copy (the caller keeps it until the step's event).
            Backend::Cuda { stream, .. } => unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }
                .map_err(self.err("copying to the device")),
            Backend::Host(_) => {
                self.refuse_in_capture("a copy between host and device")?;
                // SAFETY: `dst` is a host allocation of at least `len` elements.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut T, len) };
                Ok(())
            }
        }
    }

    /// Enqueues a copy of device memory into pinned host memory (never waits).
    pub fn copy_to_host<T>(&self, dst: &mut PinnedBuf<T>, src: u64, len: usize) -> Result<(), CudaError> {
        let dst = &mut dst.as_mut_slice()[..len];
        match &self.backend {
            // SAFETY: as `copy_to_device`.
            Backend::Cuda { stream, .. } => unsafe { result::memcpy_dtoh_async(dst, src, stream.cu_stream()) }
                .map_err(self.err("copying to the host")),
            Backend::Host(_) => {
                self.refuse_in_capture("a copy between host and device")?;
                // SAFETY: `src` is a host allocation of at least `len` elements.
                unsafe { std::ptr::copy_nonoverlapping(src as *const T, dst.as_mut_ptr(), len) };
                Ok(())
            }
        }
    }

    /// Enqueues a device-to-device copy of `bytes`.
    pub fn copy_on_device(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        match &self.backend {
            // SAFETY: both ranges are device allocations of at least `bytes`.
            Backend::Cuda { stream, .. } => unsafe { result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }
                .map_err(self.err("copying on the device")),
            Backend::Host(_) => {
                if let Some(capture) = self.host_capture.lock().as_mut() {
                    capture.ops.push(HostOp::Copy { dst, src, bytes });
                    return Ok(());
                }
                // SAFETY: both are host allocations of at least `bytes`.
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
                Ok(())
            }
        }
    }

    /// The first `len` elements of `src`, waiting for them (checks and benches only: counted).
    pub fn download<T: Copy + Default>(&self, src: &DeviceBuf<T>, len: usize) -> Result<Vec<T>, CudaError> {
        let mut host = self.pinned::<T>(len)?;
        self.copy_to_host(&mut host, src.ptr(), len)?;
        self.wait()?;
        Ok(host.as_slice()[..len].to_vec())
    }

    /// Pinned host memory of `len` elements.
    pub fn pinned<T: Copy + Default>(&self, len: usize) -> Result<PinnedBuf<T>, CudaError> {
        match &self.backend {
            Backend::Cuda { ctx, .. } => {
                PinnedBuf::new(ctx.clone(), len.max(1)).map_err(self.err("allocating pinned host memory"))
            }
            Backend::Host(_) => Ok(PinnedBuf::host(len.max(1))),
        }
    }

    /// An event recorded on the stream after everything enqueued so far.
    pub fn record(&self) -> Result<Event, CudaError> {
        match &self.backend {
            Backend::Cuda { ctx, stream, .. } => {
                let event = ctx.new_event(None).map_err(self.err("creating an event"))?;
                event.record(stream).map_err(self.err("recording an event"))?;
                Ok(Event(Some(event)))
            }
            Backend::Host(_) => Ok(Event(None)),
        }
    }

    /// Whether the work before `event` has finished (never waits).
    pub fn done(&self, event: &Event) -> Result<bool, CudaError> {
        match &event.0 {
            Some(e) => e.try_is_complete().map_err(self.err("a step on the GPU failed")),
            None => Ok(true),
        }
    }

    /// Has this stream's later work wait on the GPU for the work before `event` (recorded on
    /// another stream of the same device): no host wait.
    pub fn stream_waits_for(&self, event: &Event) -> Result<(), CudaError> {
        match (&self.backend, &event.0) {
            (Backend::Cuda { stream, .. }, Some(e)) => stream.wait(e).map_err(self.err("ordering after an event")),
            _ => Ok(()),
        }
    }

    /// Waits for the work before `event` (a host-device synchronisation, counted).
    pub fn wait_for(&self, event: &Event) -> Result<(), CudaError> {
        self.host_waits.fetch_add(1, Ordering::Relaxed);
        match &event.0 {
            Some(e) => e.synchronize().map_err(self.err("waiting for the GPU")),
            None => Ok(()),
        }
    }

    /// Waits for everything enqueued so far: a host-device synchronisation, counted.
    pub fn wait(&self) -> Result<(), CudaError> {
        self.host_waits.fetch_add(1, Ordering::Relaxed);
        match &self.backend {
            Backend::Cuda { stream, .. } => stream.synchronize().map_err(self.err("waiting for the GPU")),
            Backend::Host(_) => Ok(()),
        }
    }

    /// The device with its tile counters (zeroed in stream order, before any step).
    fn with_tile_arrivals(self: Arc<Self>) -> Result<Arc<Self>, CudaError> {
        let counters = self.zeros::<u32>(TILE_ARRIVALS)?;
        let _ = self.tile_arrivals.set(counters);
        Ok(self)
    }

    /// [`TILE_ARRIVALS`] zeroed counters for a split product's tiles (each product leaves them
    /// zeroed).
    pub(super) fn tile_arrivals(&self) -> Option<u64> {
        self.tile_arrivals.get().map(DeviceBuf::ptr)
    }

    /// Under emulation, how many launches of `kernel` have run (0 on a GPU).
    pub fn emulated_launches(&self, kernel: &str) -> u64 {
        self.emulated_launches.lock().get(kernel).copied().unwrap_or(0)
    }

    /// Whether launches are being timed (a captured step is then launched directly instead).
    pub fn is_profiling(&self) -> bool {
        self.profiling.load(Ordering::Relaxed)
    }

    /// An emulated capture records device work only (a CUDA graph here would hold the copy,
    /// but no captured step makes one).
    fn refuse_in_capture(&self, what: &str) -> Result<(), CudaError> {
        match self.host_capture.lock().is_some() {
            true => Err(CudaError::Unsupported(format!("{what} inside a captured step"))),
            false => Ok(()),
        }
    }

    /// Starts timing every launch on the device (benches only: two events a launch).
    pub fn start_profile(&self) {
        *self.profile.lock() = Some(Vec::new());
        self.profiling.store(true, Ordering::Relaxed);
    }

    /// Stops timing and returns each kernel's launches and device milliseconds since
    /// [`Gpu::start_profile`], most time first (waits for the stream; empty when emulated).
    pub fn take_profile(&self) -> Result<KernelTimes, CudaError> {
        self.profiling.store(false, Ordering::Relaxed);
        let launches = self.profile.lock().take().unwrap_or_default();
        let mut by_name: HashMap<String, (usize, f64)> = HashMap::new();
        for (name, start, end) in launches {
            let ms = start.elapsed_ms(&end).map_err(self.err("timing a kernel"))?;
            let entry = by_name.entry(name).or_default();
            entry.0 += 1;
            entry.1 += ms as f64;
        }
        let mut times: KernelTimes = by_name.into_iter().map(|(n, (c, ms))| (n, c, ms)).collect();
        times.sort_by(|a, b| b.2.total_cmp(&a.2));
        Ok(times)
    }

    /// Bytes [`Gpu::upload`] has copied to the device so far.
    pub fn uploaded_bytes(&self) -> u64 {
        self.uploaded.load(Ordering::Relaxed)
    }

    /// Times the host waited for this rank's stream.
    pub fn host_waits(&self) -> u64 {
        self.host_waits.load(Ordering::Relaxed)
    }

    /// Runs `f` on a driver thread once the stream reaches this point (it must not call CUDA).
    pub fn when_reached(&self, f: Box<dyn FnOnce() + Send>) -> Result<(), CudaError> {
        let Backend::Cuda { stream, .. } = &self.backend else {
            f();
            return Ok(());
        };
        unsafe extern "C" fn call(arg: *mut std::ffi::c_void) {
            // SAFETY: `arg` is the box leaked below, called exactly once.
            let f = unsafe { Box::from_raw(arg as *mut Box<dyn FnOnce() + Send>) };
            f();
        }
        let arg = Box::into_raw(Box::new(f)) as *mut std::ffi::c_void;
        // SAFETY: `call` takes back the box it is given.
        unsafe { result::stream::launch_host_function(stream.cu_stream(), call, arg) }.map_err(|e| {
            // SAFETY: the driver refused it, so the callback will never run: reclaim the box.
            drop(unsafe { Box::from_raw(arg as *mut Box<dyn FnOnce() + Send>) });
            CudaError::Driver { gpu: self.ordinal, what: "enqueuing a wake-up".into(), message: format!("{e:?}") }
        })
    }
}

/// A device allocation and its raw address (kernels take raw pointers).
pub struct DeviceBuf<T> {
    _storage: Storage<T>,
    ptr: u64,
    len: usize,
}

enum Storage<T> {
    Cuda(#[allow(dead_code)] CudaSlice<T>),
    /// 16-byte aligned host memory (the emulation's device memory).
    Host(#[allow(dead_code)] Vec<u128>),
    /// Emulated memory a captured step owns (`graph.rs`).
    Captured,
}

impl<T> DeviceBuf<T> {
    fn wrap(slice: CudaSlice<T>, len: usize, stream: &Arc<CudaStream>) -> Self {
        use cudarc::driver::DevicePtr;
        let ptr = {
            let (ptr, _sync) = slice.device_ptr(stream);
            ptr
        };
        DeviceBuf { _storage: Storage::Cuda(slice), ptr, len }
    }

    fn host(len: usize) -> DeviceBuf<T> {
        let words = (len * std::mem::size_of::<T>()).div_ceil(16).max(1);
        let v = vec![0u128; words];
        let ptr = v.as_ptr() as u64;
        DeviceBuf { _storage: Storage::Host(v), ptr, len }
    }

    /// The device address of element `i`.
    pub fn at(&self, i: usize) -> u64 {
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Page-locked host memory the driver copies to and from without staging (plain host memory
/// under emulation).
pub struct PinnedBuf<T> {
    ctx: Option<Arc<CudaContext>>,
    ptr: *mut T,
    len: usize,
    host: Vec<T>,
}

// SAFETY: plain host memory, owned.
unsafe impl<T: Send> Send for PinnedBuf<T> {}
unsafe impl<T: Sync> Sync for PinnedBuf<T> {}

impl<T: Copy + Default> PinnedBuf<T> {
    fn new(ctx: Arc<CudaContext>, len: usize) -> Result<Self, result::DriverError> {
        ctx.bind_to_thread()?;
        // SAFETY: a fresh allocation of `len` elements, initialised below.
        let ptr = unsafe { result::malloc_host(len * std::mem::size_of::<T>(), 0) }? as *mut T;
        let mut buf = PinnedBuf { ctx: Some(ctx), ptr, len, host: Vec::new() };
        buf.as_mut_slice().fill(T::default());
        Ok(buf)
    }

    fn host(len: usize) -> Self {
        let mut host = vec![T::default(); len];
        PinnedBuf { ctx: None, ptr: host.as_mut_ptr(), len, host }
    }
}

impl<T> PinnedBuf<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: `len` initialised elements, owned.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as above, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T> Drop for PinnedBuf<T> {
    fn drop(&mut self) {
        let Some(ctx) = &self.ctx else { return };
        let _ = ctx.bind_to_thread();
        // SAFETY: allocated by `malloc_host`, freed once; nothing enqueued still uses it (its
        // owner drops it only after the step that used it completed).
        let _ = unsafe { result::free_host(self.ptr as *mut std::ffi::c_void) };
        let _ = &self.host;
    }
}
