//! The CUDA driver API, loaded at run time from `libcuda.so.1` (no CUDA at build time).
//!
//! Owns the function table ([`Cuda`]), the translation of `CUresult` codes into
//! [`crate::Error::Gpu`], the per-device primary contexts, and [`CudaEngine`]: the staging copy
//! backend the soft device uses for GPU regions (one stream, one event per staging slot, pinned
//! host memory). Must not: hold policy about registration (that is `super::register`) or touch
//! device memory from the CPU.

#![allow(unsafe_code)] // the CUDA driver API through dlopen

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::{Mutex, OnceLock};

use crate::error::{Error, Result};
use crate::vocab::GpuSpan;

use crate::soft::engine::stage::{CopyEngine, CopyError};

/// `CUresult`.
pub(crate) type CuResult = c_int;
/// `CUdevice`.
pub(crate) type CuDevice = c_int;
/// `CUdeviceptr`.
pub(crate) type CuDevicePtr = u64;
/// `CUcontext` and the other opaque handles.
pub(crate) type CuHandle = *mut c_void;

pub(crate) const CUDA_SUCCESS: CuResult = 0;
const CUDA_ERROR_NOT_READY: CuResult = 600;
const CUDA_ERROR_NO_DEVICE: CuResult = 100;

/// `CU_POINTER_ATTRIBUTE_*`.
pub(crate) const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
pub(crate) const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
pub(crate) const CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: c_int = 11;
pub(crate) const CU_POINTER_ATTRIBUTE_RANGE_SIZE: c_int = 12;
/// `CU_MEMORYTYPE_DEVICE`.
pub(crate) const CU_MEMORYTYPE_DEVICE: c_uint = 2;
/// `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`.
pub(crate) const CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD: c_int = 1;
/// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
pub(crate) const CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: c_int = 124;
/// `CU_MEMHOSTALLOC_PORTABLE`: pinned memory usable from every context.
const CU_MEMHOSTALLOC_PORTABLE: c_uint = 1;
/// `CU_MEMHOSTREGISTER_PORTABLE`: registered memory counts as pinned in every context.
const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 1;
/// `CU_STREAM_NON_BLOCKING`: no implicit synchronisation with the legacy default stream.
const CU_STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_STREAM_DEFAULT`: a stream ordered after the legacy default stream's work.
const CU_STREAM_DEFAULT: c_uint = 0;
/// `CU_EVENT_DISABLE_TIMING`: the cheapest event kind.
const CU_EVENT_DISABLE_TIMING: c_uint = 2;

/// The shared library's file name.
pub(crate) const LIBRARY: &str = "libcuda.so.1";

macro_rules! cuda_table {
    ($( $field:ident = $sym:literal : fn($($arg:ident: $ty:ty),*) ; )*) => {
        /// The driver API functions the SDK uses, resolved once per process.
        pub(crate) struct Cuda {
            $( pub(crate) $field: unsafe extern "C" fn($($ty),*) -> CuResult, )*
        }

        impl Cuda {
            /// Resolves every function from an opened library.
            fn resolve(handle: *mut c_void) -> std::result::Result<Cuda, String> {
                Ok(Cuda {
                    $( $field: {
                        let name: &CStr = $sym;
                        // SAFETY: `handle` is an open library; `name` is NUL-terminated.
                        let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
                        if p.is_null() {
                            return Err(format!(
                                "{LIBRARY} lacks {} (driver too old)",
                                name.to_string_lossy()
                            ));
                        }
                        // The symbol is the driver API function of that name, whose C
                        // prototype is the one written in this table (cuda.h).
                        // SAFETY: the pointer's type is the function's own (above).
                        unsafe {
                            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) -> CuResult>(p)
                        }
                    }, )*
                })
            }
        }
    };
}

cuda_table! {
    cu_init = c"cuInit": fn(flags: c_uint);
    cu_driver_get_version = c"cuDriverGetVersion": fn(version: *mut c_int);
    cu_device_get_count = c"cuDeviceGetCount": fn(count: *mut c_int);
    cu_device_get = c"cuDeviceGet": fn(dev: *mut CuDevice, ordinal: c_int);
    cu_device_get_name = c"cuDeviceGetName": fn(name: *mut c_char, len: c_int, dev: CuDevice);
    cu_device_get_attribute = c"cuDeviceGetAttribute": fn(value: *mut c_int, attr: c_int, dev: CuDevice);
    cu_primary_ctx_retain = c"cuDevicePrimaryCtxRetain": fn(ctx: *mut CuHandle, dev: CuDevice);
    cu_ctx_set_current = c"cuCtxSetCurrent": fn(ctx: CuHandle);
    cu_mem_alloc = c"cuMemAlloc_v2": fn(dptr: *mut CuDevicePtr, size: usize);
    cu_mem_free = c"cuMemFree_v2": fn(dptr: CuDevicePtr);
    cu_memset_d8 = c"cuMemsetD8_v2": fn(dptr: CuDevicePtr, value: u8, count: usize);
    cu_memcpy_htod = c"cuMemcpyHtoD_v2": fn(dst: CuDevicePtr, src: *const c_void, len: usize);
    cu_memcpy_dtoh = c"cuMemcpyDtoH_v2": fn(dst: *mut c_void, src: CuDevicePtr, len: usize);
    cu_memcpy_htod_async = c"cuMemcpyHtoDAsync_v2": fn(dst: CuDevicePtr, src: *const c_void, len: usize, stream: CuHandle);
    cu_memcpy_dtoh_async = c"cuMemcpyDtoHAsync_v2": fn(dst: *mut c_void, src: CuDevicePtr, len: usize, stream: CuHandle);
    cu_mem_host_alloc = c"cuMemHostAlloc": fn(pp: *mut *mut c_void, len: usize, flags: c_uint);
    cu_mem_free_host = c"cuMemFreeHost": fn(p: *mut c_void);
    cu_mem_host_register = c"cuMemHostRegister_v2": fn(p: *mut c_void, len: usize, flags: c_uint);
    cu_mem_host_unregister = c"cuMemHostUnregister": fn(p: *mut c_void);
    cu_mem_get_handle_for_address_range = c"cuMemGetHandleForAddressRange": fn(handle: *mut c_void, dptr: CuDevicePtr, size: usize, kind: c_int, flags: u64);
    cu_pointer_get_attribute = c"cuPointerGetAttribute": fn(data: *mut c_void, attr: c_int, ptr: CuDevicePtr);
    cu_stream_create = c"cuStreamCreate": fn(stream: *mut CuHandle, flags: c_uint);
    cu_stream_destroy = c"cuStreamDestroy_v2": fn(stream: CuHandle);
    cu_stream_synchronize = c"cuStreamSynchronize": fn(stream: CuHandle);
    cu_event_create = c"cuEventCreate": fn(event: *mut CuHandle, flags: c_uint);
    cu_event_destroy = c"cuEventDestroy_v2": fn(event: CuHandle);
    cu_event_record = c"cuEventRecord": fn(event: CuHandle, stream: CuHandle);
    cu_event_synchronize = c"cuEventSynchronize": fn(event: CuHandle);
    cu_event_query = c"cuEventQuery": fn(event: CuHandle);
    cu_get_error_name = c"cuGetErrorName": fn(code: CuResult, name: *mut *const c_char);
}

// SAFETY: the table holds plain function pointers into a library that is never closed; the
// driver API is thread-safe.
unsafe impl Send for Cuda {}
// SAFETY: as above.
unsafe impl Sync for Cuda {}

/// The loaded driver, or why it could not be loaded (kept: the answer never changes).
static DRIVER: OnceLock<std::result::Result<Cuda, String>> = OnceLock::new();

/// The CUDA driver, loaded and initialised on first use.
///
/// # Errors
/// [`Error::Gpu`] naming `libcuda.so.1` and what went wrong (not installed, no device, too old).
pub(crate) fn driver() -> Result<&'static Cuda> {
    DRIVER
        .get_or_init(load)
        .as_ref()
        .map_err(|what| Error::Gpu { what: what.clone() })
}

fn load() -> std::result::Result<Cuda, String> {
    let name = std::ffi::CString::new(LIBRARY).map_err(|e| e.to_string())?;
    // SAFETY: a NUL-terminated library name; the driver's initialisers only set up its state.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl* call.
        let msg = unsafe { libc::dlerror() };
        let detail = if msg.is_null() {
            "dlopen failed".to_string()
        } else {
            // SAFETY: see above; copied at once.
            unsafe { CStr::from_ptr(msg) }
                .to_string_lossy()
                .into_owned()
        };
        let detail = if detail.contains(LIBRARY) {
            detail
        } else {
            format!("{LIBRARY}: {detail}")
        };
        return Err(format!(
            "no CUDA driver ({detail}); GPU memory needs an NVIDIA GPU and its driver"
        ));
    }
    // The library stays open for the rest of the process: the table points into it.
    let cuda = Cuda::resolve(handle)?;
    // SAFETY: cuInit takes flags 0.
    let rc = unsafe { (cuda.cu_init)(0) };
    if rc != CUDA_SUCCESS {
        let what = if rc == CUDA_ERROR_NO_DEVICE {
            "no CUDA-capable device is present".to_string()
        } else {
            format!("cuInit failed: {}", cuda.error_name(rc))
        };
        return Err(format!("CUDA driver ({LIBRARY}) unusable: {what}"));
    }
    Ok(cuda)
}

impl Cuda {
    /// The name of a `CUresult` (`CUDA_ERROR_OUT_OF_MEMORY`, …).
    pub(crate) fn error_name(&self, rc: CuResult) -> String {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: `p` is a valid out-parameter; the driver stores a static string.
        let r = unsafe { (self.cu_get_error_name)(rc, &mut p) };
        if r != CUDA_SUCCESS || p.is_null() {
            return format!("CUresult {rc}");
        }
        // SAFETY: a static NUL-terminated string owned by the driver.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// Maps a `CUresult` to `Ok` or [`Error::Gpu`] naming the call.
    pub(crate) fn check(&self, call: &str, rc: CuResult) -> Result<()> {
        if rc == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(Error::Gpu {
                what: format!("{call} failed: {}", self.error_name(rc)),
            })
        }
    }

    /// Number of CUDA devices.
    pub(crate) fn device_count(&self) -> Result<usize> {
        let mut n = 0;
        // SAFETY: `n` is a valid out-parameter.
        self.check("cuDeviceGetCount", unsafe {
            (self.cu_device_get_count)(&mut n)
        })?;
        Ok(n.max(0) as usize)
    }

    /// The driver's CUDA version (`13000` for 13.0).
    pub(crate) fn version(&self) -> Result<i32> {
        let mut v = 0;
        // SAFETY: `v` is a valid out-parameter.
        self.check("cuDriverGetVersion", unsafe {
            (self.cu_driver_get_version)(&mut v)
        })?;
        Ok(v)
    }

    /// The `CUdevice` of an ordinal, checked against the device count.
    pub(crate) fn device(&self, ordinal: usize) -> Result<CuDevice> {
        let count = self.device_count()?;
        if ordinal >= count {
            return Err(Error::Gpu {
                what: format!("no CUDA device {ordinal} (this machine has {count})"),
            });
        }
        let mut dev = 0;
        // SAFETY: `dev` is a valid out-parameter; the ordinal is in range.
        self.check("cuDeviceGet", unsafe {
            (self.cu_device_get)(&mut dev, ordinal as c_int)
        })?;
        Ok(dev)
    }

    /// The device's marketing name.
    pub(crate) fn device_name(&self, ordinal: usize) -> Result<String> {
        let dev = self.device(ordinal)?;
        let mut buf = [0 as c_char; 256];
        // SAFETY: the buffer holds `len` bytes; the driver NUL-terminates within it.
        self.check("cuDeviceGetName", unsafe {
            (self.cu_device_get_name)(buf.as_mut_ptr(), buf.len() as c_int, dev)
        })?;
        // SAFETY: NUL-terminated within `buf` (see above).
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// A device attribute.
    pub(crate) fn attribute(&self, ordinal: usize, attr: c_int) -> Result<i32> {
        let dev = self.device(ordinal)?;
        let mut v = 0;
        // SAFETY: `v` is a valid out-parameter.
        self.check("cuDeviceGetAttribute", unsafe {
            (self.cu_device_get_attribute)(&mut v, attr, dev)
        })?;
        Ok(v)
    }

    /// Makes the device's primary context current on the calling thread (retaining it once per
    /// process and device; it is never released, like the runtime API's own contexts).
    pub(crate) fn bind(&self, ordinal: usize) -> Result<()> {
        let ctx = primary_context(self, ordinal)?;
        // SAFETY: `ctx` is a retained primary context.
        self.check("cuCtxSetCurrent", unsafe {
            (self.cu_ctx_set_current)(ctx as CuHandle)
        })
    }

    /// A new stream (`flags`: `CU_STREAM_*`) in device `ordinal`'s context, made current.
    fn new_stream(&self, ordinal: usize, flags: c_uint) -> Result<CuHandle> {
        self.bind(ordinal)?;
        let mut stream: CuHandle = std::ptr::null_mut();
        // SAFETY: valid out-parameter; the device's context is current.
        self.check("cuStreamCreate", unsafe {
            (self.cu_stream_create)(&mut stream, flags)
        })?;
        Ok(stream)
    }

    /// A new event without timing, in the current context.
    fn new_event(&self) -> Result<CuHandle> {
        let mut event: CuHandle = std::ptr::null_mut();
        // SAFETY: valid out-parameter; the caller made the context current.
        self.check("cuEventCreate", unsafe {
            (self.cu_event_create)(&mut event, CU_EVENT_DISABLE_TIMING)
        })?;
        Ok(event)
    }

    /// A pointer attribute that fits in `T`.
    ///
    /// # Safety
    /// `T` must be the type the driver writes for `attr` (cuda.h).
    pub(crate) unsafe fn pointer_attribute<T: Default>(
        &self,
        ptr: CuDevicePtr,
        attr: c_int,
    ) -> std::result::Result<T, CuResult> {
        let mut v = T::default();
        // SAFETY: `v` is a valid out-parameter of the type the caller vouches for.
        let rc = unsafe { (self.cu_pointer_get_attribute)((&mut v as *mut T).cast(), attr, ptr) };
        if rc == CUDA_SUCCESS { Ok(v) } else { Err(rc) }
    }
}

/// Retained primary contexts by device ordinal (as addresses).
static PRIMARY: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

fn primary_context(cuda: &Cuda, ordinal: usize) -> Result<usize> {
    let mut list = PRIMARY.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, ctx)) = list.iter().find(|(o, _)| *o == ordinal) {
        return Ok(ctx);
    }
    let dev = cuda.device(ordinal)?;
    let mut ctx: CuHandle = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid out-parameter; `dev` a valid device.
    cuda.check("cuDevicePrimaryCtxRetain", unsafe {
        (cuda.cu_primary_ctx_retain)(&mut ctx, dev)
    })?;
    list.push((ordinal, ctx as usize));
    Ok(ctx as usize)
}

/// The staging backend of one GPU region on the soft device: a non-blocking stream, pinned
/// host slots and one event per slot recorded after the slot's last copy.
pub(crate) struct CudaEngine {
    cuda: &'static Cuda,
    ordinal: usize,
    base: CuDevicePtr,
    stream: CuHandle,
    slots: Vec<(*mut u8, CuHandle)>,
    slot_len: usize,
}

// SAFETY: the handles are driver objects usable from any thread once the context is bound (every
// method binds it); the pinned slots are owned by this engine and only reached through it.
unsafe impl Send for CudaEngine {}

impl CudaEngine {
    /// A backend for the device memory at `base` on device `ordinal`: `slots` pinned buffers of
    /// `slot_len` bytes.
    pub(crate) fn new(
        ordinal: usize,
        base: CuDevicePtr,
        slots: usize,
        slot_len: usize,
    ) -> Result<CudaEngine> {
        let cuda = driver()?;
        let stream = cuda.new_stream(ordinal, CU_STREAM_NON_BLOCKING)?;
        let mut engine = CudaEngine {
            cuda,
            ordinal,
            base,
            stream,
            slots: Vec::with_capacity(slots),
            slot_len,
        };
        for _ in 0..slots {
            let mut host: *mut c_void = std::ptr::null_mut();
            // SAFETY: valid out-parameter; the context is current.
            cuda.check("cuMemHostAlloc (pinned staging)", unsafe {
                (cuda.cu_mem_host_alloc)(&mut host, slot_len, CU_MEMHOSTALLOC_PORTABLE)
            })?;
            let event = match cuda.new_event() {
                Ok(event) => event,
                Err(e) => {
                    // SAFETY: `host` was just allocated by cuMemHostAlloc and is not kept.
                    unsafe { (cuda.cu_mem_free_host)(host) };
                    return Err(e);
                }
            };
            // `engine`'s Drop frees what was made so far if a later slot fails.
            engine.slots.push((host.cast(), event));
        }
        Ok(engine)
    }

    fn bind(&self) -> std::result::Result<(), CopyError> {
        self.cuda
            .bind(self.ordinal)
            .map_err(|e| CopyError(e.to_string()))
    }

    fn result(&self, call: &str, rc: CuResult) -> std::result::Result<(), CopyError> {
        if rc == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(CopyError(format!("{call}: {}", self.cuda.error_name(rc))))
        }
    }
}

impl CopyEngine for CudaEngine {
    fn slot_count(&self) -> usize {
        self.slots.len()
    }

    fn slot_len(&self) -> usize {
        self.slot_len
    }

    fn slot_ptr(&self, slot: usize) -> *mut u8 {
        self.slots[slot].0
    }

    fn to_host(
        &mut self,
        slot: usize,
        offset: u64,
        len: usize,
    ) -> std::result::Result<(), CopyError> {
        debug_assert!(len <= self.slot_len);
        self.bind()?;
        let (host, event) = self.slots[slot];
        // `host` is a pinned buffer of `slot_len >= len` bytes owned by this engine, not read by
        // the CPU until `wait(slot)` returns; the device range lies inside the region (the
        // stager checks every range against the region's length).
        // SAFETY: both ranges are live and untouched while the copy runs (above).
        let rc = unsafe {
            (self.cuda.cu_memcpy_dtoh_async)(host.cast(), self.base + offset, len, self.stream)
        };
        self.result("cuMemcpyDtoHAsync", rc)?;
        // SAFETY: a live event and stream of this context.
        let rc = unsafe { (self.cuda.cu_event_record)(event, self.stream) };
        self.result("cuEventRecord", rc)
    }

    fn to_device(
        &mut self,
        slot: usize,
        offset: u64,
        len: usize,
    ) -> std::result::Result<(), CopyError> {
        debug_assert!(len <= self.slot_len);
        self.bind()?;
        let (host, event) = self.slots[slot];
        // SAFETY: as in `to_host`; the CPU does not write the slot again before `wait(slot)`.
        let rc = unsafe {
            (self.cuda.cu_memcpy_htod_async)(self.base + offset, host.cast(), len, self.stream)
        };
        self.result("cuMemcpyHtoDAsync", rc)?;
        // SAFETY: a live event and stream of this context.
        let rc = unsafe { (self.cuda.cu_event_record)(event, self.stream) };
        self.result("cuEventRecord", rc)
    }

    fn wait(&mut self, slot: usize) -> std::result::Result<(), CopyError> {
        let event = self.slots[slot].1;
        // SAFETY: a live event; querying an event never recorded returns success.
        let rc = unsafe { (self.cuda.cu_event_query)(event) };
        if rc == CUDA_SUCCESS {
            return Ok(());
        }
        if rc != CUDA_ERROR_NOT_READY {
            return self.result("cuEventQuery", rc);
        }
        self.bind()?;
        // SAFETY: a live event.
        let rc = unsafe { (self.cuda.cu_event_synchronize)(event) };
        self.result("cuEventSynchronize", rc)
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        if self.bind().is_err() {
            return;
        }
        // SAFETY: the stream is live; waiting makes sure no copy still uses a slot.
        unsafe { (self.cuda.cu_stream_synchronize)(self.stream) };
        for &(host, event) in &self.slots {
            // Allocated by cuMemHostAlloc / cuEventCreate in `new`, freed once here, after the
            // stream finished every copy that used them.
            // SAFETY: each handle is live, idle and freed once (above).
            unsafe {
                (self.cuda.cu_event_destroy)(event);
                (self.cuda.cu_mem_free_host)(host.cast());
            }
        }
        // SAFETY: the stream is idle and destroyed once.
        unsafe { (self.cuda.cu_stream_destroy)(self.stream) };
    }
}

impl std::fmt::Debug for CudaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEngine")
            .field("device", &self.ordinal)
            .field("base", &format_args!("{:#x}", self.base))
            .field("slots", &self.slots.len())
            .field("slot_len", &self.slot_len)
            .finish()
    }
}

/// Host memory page-locked for the driver's copies (`cuMemHostRegister`), in every context:
/// copies between it and device memory go by DMA, instead of through the driver's own pinned
/// bounce buffers. Unregistered on drop.
pub(crate) struct HostPin {
    cuda: &'static Cuda,
    ordinal: usize,
    ptr: *mut c_void,
    len: usize,
}

// SAFETY: only the address is kept, to unregister it; nothing is read or written through it.
unsafe impl Send for HostPin {}
// SAFETY: as above; no method reaches the memory.
unsafe impl Sync for HostPin {}

impl HostPin {
    /// Page-locks `[ptr, ptr+len)` with device `ordinal`'s context current.
    ///
    /// # Safety
    /// The range must be mapped host memory, and stay mapped until the pin is dropped.
    ///
    /// # Errors
    /// [`Error::Gpu`] without a driver, or when the driver refuses the range.
    pub(crate) unsafe fn new(ordinal: usize, ptr: *mut u8, len: usize) -> Result<HostPin> {
        let cuda = driver()?;
        cuda.bind(ordinal)?;
        // SAFETY: the caller keeps the range mapped while this pin lives; the context is current.
        cuda.check("cuMemHostRegister", unsafe {
            (cuda.cu_mem_host_register)(ptr.cast(), len, CU_MEMHOSTREGISTER_PORTABLE)
        })?;
        Ok(HostPin {
            cuda,
            ordinal,
            ptr: ptr.cast(),
            len,
        })
    }
}

impl Drop for HostPin {
    fn drop(&mut self) {
        if self.cuda.bind(self.ordinal).is_err() {
            return;
        }
        // SAFETY: registered by `new` and unregistered once, while still mapped (its contract).
        unsafe { (self.cuda.cu_mem_host_unregister)(self.ptr) };
    }
}

impl std::fmt::Debug for HostPin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPin")
            .field("device", &self.ordinal)
            .field("addr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

/// Asynchronous copies between device memory and page-locked host memory on one stream of
/// their own, with an event after each device-to-host copy ("unit") to wait on. The stream is
/// an ordinary (blocking) one: its copies start after work queued earlier on the legacy
/// default stream, as synchronous copies would.
pub(crate) struct StreamCopies {
    cuda: &'static Cuda,
    ordinal: usize,
    stream: CuHandle,
    /// One event per unit, made as units are first used and kept for later calls.
    events: Vec<CuHandle>,
}

// SAFETY: driver handles work from any thread with their context bound; every method binds it.
unsafe impl Send for StreamCopies {}
// SAFETY: every method that uses the handles takes `&mut self`.
unsafe impl Sync for StreamCopies {}

impl StreamCopies {
    /// A stream on device `ordinal`.
    ///
    /// # Errors
    /// [`Error::Gpu`] without a driver or when the stream cannot be made.
    pub(crate) fn new(ordinal: usize) -> Result<StreamCopies> {
        let cuda = driver()?;
        let stream = cuda.new_stream(ordinal, CU_STREAM_DEFAULT)?;
        Ok(StreamCopies {
            cuda,
            ordinal,
            stream,
            events: Vec::new(),
        })
    }

    /// The device whose context the stream belongs to.
    pub(crate) fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Queues a copy of `len` bytes from device address `src` to `dst`, then records unit
    /// `unit`'s event ([`StreamCopies::wait`] waits for both).
    ///
    /// # Safety
    /// `[dst, dst+len)` must be writable host memory that stays mapped, and that nothing else
    /// reads or writes, until `wait(unit)` or [`StreamCopies::finish`] returns or this value is
    /// dropped; `[src, src+len)` must be device memory of this device, live as long.
    ///
    /// # Errors
    /// [`Error::Gpu`] when the driver refuses the copy or the event.
    pub(crate) unsafe fn queue_to_host(
        &mut self,
        unit: usize,
        dst: *mut u8,
        src: CuDevicePtr,
        len: usize,
    ) -> Result<()> {
        self.cuda.bind(self.ordinal)?;
        while self.events.len() <= unit {
            self.events.push(self.cuda.new_event()?);
        }
        if len > 0 {
            // SAFETY: the ranges are as the caller promises; the stream is live.
            self.cuda.check("cuMemcpyDtoHAsync", unsafe {
                (self.cuda.cu_memcpy_dtoh_async)(dst.cast(), src, len, self.stream)
            })?;
        }
        // SAFETY: a live event and stream of this context.
        self.cuda.check("cuEventRecord", unsafe {
            (self.cuda.cu_event_record)(self.events[unit], self.stream)
        })
    }

    /// Waits until unit `unit`'s copy (and every copy queued before it) is done.
    ///
    /// # Errors
    /// [`Error::Gpu`] when a copy failed; [`Error::InvalidArgument`] for a unit never queued.
    pub(crate) fn wait(&mut self, unit: usize) -> Result<()> {
        let Some(&event) = self.events.get(unit) else {
            return Err(Error::invalid(format!("copy unit {unit} was never queued")));
        };
        self.cuda.bind(self.ordinal)?;
        // SAFETY: a live event.
        self.cuda.check("cuEventSynchronize", unsafe {
            (self.cuda.cu_event_synchronize)(event)
        })
    }

    /// Queues a copy of `len` bytes from `src` to device address `dst`.
    ///
    /// # Safety
    /// `[src, src+len)` must be host memory that stays mapped, and that nothing writes, until
    /// [`StreamCopies::finish`] returns or this value is dropped; `[dst, dst+len)` must be
    /// device memory of this device that nothing else uses meanwhile.
    ///
    /// # Errors
    /// [`Error::Gpu`] when the driver refuses the copy.
    pub(crate) unsafe fn queue_to_device(
        &mut self,
        dst: CuDevicePtr,
        src: *const u8,
        len: usize,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.cuda.bind(self.ordinal)?;
        // SAFETY: the ranges are as the caller promises; the stream is live.
        self.cuda.check("cuMemcpyHtoDAsync", unsafe {
            (self.cuda.cu_memcpy_htod_async)(dst, src.cast(), len, self.stream)
        })
    }

    /// Waits for every queued copy.
    ///
    /// # Errors
    /// [`Error::Gpu`] when a copy failed.
    pub(crate) fn finish(&mut self) -> Result<()> {
        self.cuda.bind(self.ordinal)?;
        // SAFETY: a live stream.
        self.cuda.check("cuStreamSynchronize", unsafe {
            (self.cuda.cu_stream_synchronize)(self.stream)
        })
    }
}

impl Drop for StreamCopies {
    fn drop(&mut self) {
        if self.cuda.bind(self.ordinal).is_err() {
            return;
        }
        // SAFETY: the stream is live; waiting makes sure no copy still runs.
        unsafe { (self.cuda.cu_stream_synchronize)(self.stream) };
        for &event in &self.events {
            // SAFETY: made by cuEventCreate in `queue_to_host`, destroyed once, the stream idle.
            unsafe { (self.cuda.cu_event_destroy)(event) };
        }
        // SAFETY: the stream is idle and destroyed once.
        unsafe { (self.cuda.cu_stream_destroy)(self.stream) };
    }
}

impl std::fmt::Debug for StreamCopies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamCopies")
            .field("device", &self.ordinal)
            .field("events", &self.events.len())
            .finish()
    }
}

/// Exports the pages holding `span` as a dma-buf. Returns the file descriptor and the span's
/// offset inside it (the export starts at the page holding the first byte).
///
/// # Errors
/// [`Error::Gpu`] when the driver refuses (no dma-buf support in this driver or kernel).
pub(crate) fn export_dmabuf(span: GpuSpan) -> Result<(std::os::fd::OwnedFd, u64)> {
    use std::os::fd::FromRawFd;
    let cuda = driver()?;
    cuda.bind(span.device)?;
    const PAGE: u64 = 4096;
    let start = span.addr & !(PAGE - 1);
    let end = (span.addr + span.len as u64).div_ceil(PAGE) * PAGE;
    let mut fd: i32 = -1;
    // SAFETY: `fd` is a valid out-parameter for an int handle; the range is page aligned and
    // covers the span.
    cuda.check("cuMemGetHandleForAddressRange (dma-buf)", unsafe {
        (cuda.cu_mem_get_handle_for_address_range)(
            (&mut fd as *mut i32).cast(),
            start,
            (end - start) as usize,
            CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    })?;
    if fd < 0 {
        return Err(Error::Gpu {
            what: "cuMemGetHandleForAddressRange returned no file descriptor".into(),
        });
    }
    // SAFETY: the driver returned a new descriptor this process owns.
    Ok((
        unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) },
        span.addr - start,
    ))
}
