//! The C boundary: the exported tables `ncclNetPlugin_v8` … `ncclNetPlugin_v11` with NCCL's
//! exact layouts (`src/include/plugin/net/net_v8.h` … `net_v11.h`, NCCL 2.20–2.29), and the
//! `extern "C"` functions in them.
//!
//! Every function converts its arguments, calls [`crate::net`] inside `catch_unwind` (no panic
//! crosses into NCCL) and returns an `ncclResult_t`; every error is logged with the operation
//! and its cause. Opaque objects are ids ([`crate::objects`]), so a stale or foreign pointer is
//! an error, not a dereference. NULL is refused where NCCL never passes it.
#![allow(unsafe_code)]
#![allow(non_upper_case_globals)]

use std::ffi::{c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::error::{Code, NetError, NetResult};
use crate::handle::HANDLE_BYTES;
use crate::log::{Logger, warn};
use crate::net;
use crate::proto::MAX_RECVS;

/// NCCL's `ncclResult_t`.
pub type NcclResult = c_int;

/// `ncclNetVDeviceProps_v9_t` … `_v11_t` (`NCCL_NET_MAX_DEVS_PER_NIC` = 4).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct VDeviceProps {
    /// Physical devices fused.
    pub ndevs: c_int,
    /// Their indices.
    pub devs: [c_int; 4],
}

/// `ncclNetProperties_v8_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PropsV8 {
    pub name: *const c_char,
    pub pci_path: *const c_char,
    pub guid: u64,
    pub ptr_support: c_int,
    pub reg_is_global: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    pub net_device_type: c_int,
    pub net_device_version: c_int,
}

/// `ncclNetProperties_v9_t` and `_v10_t` (the same layout).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PropsV9 {
    pub name: *const c_char,
    pub pci_path: *const c_char,
    pub guid: u64,
    pub ptr_support: c_int,
    pub reg_is_global: c_int,
    pub force_flush: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    pub net_device_type: c_int,
    pub net_device_version: c_int,
    pub vprops: VDeviceProps,
    pub max_p2p_bytes: usize,
    pub max_coll_bytes: usize,
}

/// `ncclNetProperties_v11_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PropsV11 {
    pub v9: PropsV9,
    pub max_multi_request_size: c_int,
}

type Ptr = *mut c_void;
type PPtr = *mut *mut c_void;

/// `ncclNet_v8_t`.
#[repr(C)]
#[derive(Debug)]
pub struct NetV8 {
    pub name: *const c_char,
    pub init: Option<unsafe extern "C" fn(Option<Logger>) -> NcclResult>,
    pub devices: Option<unsafe extern "C" fn(*mut c_int) -> NcclResult>,
    pub get_properties: Option<unsafe extern "C" fn(c_int, *mut PropsV8) -> NcclResult>,
    pub listen: Option<unsafe extern "C" fn(c_int, Ptr, PPtr) -> NcclResult>,
    pub connect: Option<unsafe extern "C" fn(c_int, Ptr, PPtr, PPtr) -> NcclResult>,
    pub accept: Option<unsafe extern "C" fn(Ptr, PPtr, PPtr) -> NcclResult>,
    pub reg_mr: Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, PPtr) -> NcclResult>,
    pub reg_mr_dma_buf:
        Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, u64, c_int, PPtr) -> NcclResult>,
    pub dereg_mr: Option<unsafe extern "C" fn(Ptr, Ptr) -> NcclResult>,
    pub isend: Option<unsafe extern "C" fn(Ptr, Ptr, c_int, c_int, Ptr, PPtr) -> NcclResult>,
    pub irecv: Option<
        unsafe extern "C" fn(Ptr, c_int, PPtr, *mut c_int, *mut c_int, PPtr, PPtr) -> NcclResult,
    >,
    pub iflush:
        Option<unsafe extern "C" fn(Ptr, c_int, PPtr, *mut c_int, PPtr, PPtr) -> NcclResult>,
    pub test: Option<unsafe extern "C" fn(Ptr, *mut c_int, *mut c_int) -> NcclResult>,
    pub close_send: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
    pub close_recv: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
    pub close_listen: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
    pub get_device_mr: Option<unsafe extern "C" fn(Ptr, Ptr, PPtr) -> NcclResult>,
    pub irecv_consumed: Option<unsafe extern "C" fn(Ptr, c_int, Ptr) -> NcclResult>,
}

/// `ncclNet_v9_t`.
#[repr(C)]
#[derive(Debug)]
pub struct NetV9 {
    pub name: *const c_char,
    pub init: Option<unsafe extern "C" fn(Option<Logger>) -> NcclResult>,
    pub devices: Option<unsafe extern "C" fn(*mut c_int) -> NcclResult>,
    pub get_properties: Option<unsafe extern "C" fn(c_int, *mut PropsV9) -> NcclResult>,
    pub listen: Option<unsafe extern "C" fn(c_int, Ptr, PPtr) -> NcclResult>,
    pub connect: Option<unsafe extern "C" fn(c_int, Ptr, PPtr, PPtr) -> NcclResult>,
    pub accept: Option<unsafe extern "C" fn(Ptr, PPtr, PPtr) -> NcclResult>,
    pub reg_mr: Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, PPtr) -> NcclResult>,
    pub reg_mr_dma_buf:
        Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, u64, c_int, PPtr) -> NcclResult>,
    pub dereg_mr: Option<unsafe extern "C" fn(Ptr, Ptr) -> NcclResult>,
    pub isend: Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, Ptr, PPtr) -> NcclResult>,
    pub irecv: Option<
        unsafe extern "C" fn(Ptr, c_int, PPtr, *mut usize, *mut c_int, PPtr, PPtr) -> NcclResult,
    >,
    pub iflush:
        Option<unsafe extern "C" fn(Ptr, c_int, PPtr, *mut c_int, PPtr, PPtr) -> NcclResult>,
    pub test: Option<unsafe extern "C" fn(Ptr, *mut c_int, *mut c_int) -> NcclResult>,
    pub close_send: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
    pub close_recv: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
    pub close_listen: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
    pub get_device_mr: Option<unsafe extern "C" fn(Ptr, Ptr, PPtr) -> NcclResult>,
    pub irecv_consumed: Option<unsafe extern "C" fn(Ptr, c_int, Ptr) -> NcclResult>,
    pub make_vdevice: Option<unsafe extern "C" fn(*mut c_int, *mut VDeviceProps) -> NcclResult>,
}

/// `ncclNet_v10_t`.
#[repr(C)]
#[derive(Debug)]
pub struct NetV10 {
    pub name: *const c_char,
    pub init: Option<unsafe extern "C" fn(Option<Logger>, Ptr) -> NcclResult>,
    pub devices: Option<unsafe extern "C" fn(*mut c_int) -> NcclResult>,
    pub get_properties: Option<unsafe extern "C" fn(c_int, *mut PropsV9) -> NcclResult>,
    pub listen: Option<unsafe extern "C" fn(c_int, Ptr, PPtr) -> NcclResult>,
    pub connect: Option<unsafe extern "C" fn(c_int, Ptr, Ptr, PPtr, PPtr) -> NcclResult>,
    pub accept: Option<unsafe extern "C" fn(Ptr, PPtr, PPtr) -> NcclResult>,
    pub reg_mr: Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, PPtr) -> NcclResult>,
    pub reg_mr_dma_buf:
        Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, u64, c_int, PPtr) -> NcclResult>,
    pub dereg_mr: Option<unsafe extern "C" fn(Ptr, Ptr) -> NcclResult>,
    pub isend: Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, Ptr, Ptr, PPtr) -> NcclResult>,
    pub irecv: Option<
        unsafe extern "C" fn(
            Ptr,
            c_int,
            PPtr,
            *mut usize,
            *mut c_int,
            PPtr,
            PPtr,
            PPtr,
        ) -> NcclResult,
    >,
    pub iflush:
        Option<unsafe extern "C" fn(Ptr, c_int, PPtr, *mut c_int, PPtr, PPtr) -> NcclResult>,
    pub test: Option<unsafe extern "C" fn(Ptr, *mut c_int, *mut c_int) -> NcclResult>,
    pub close_send: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
    pub close_recv: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
    pub close_listen: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
    pub get_device_mr: Option<unsafe extern "C" fn(Ptr, Ptr, PPtr) -> NcclResult>,
    pub irecv_consumed: Option<unsafe extern "C" fn(Ptr, c_int, Ptr) -> NcclResult>,
    pub make_vdevice: Option<unsafe extern "C" fn(*mut c_int, *mut VDeviceProps) -> NcclResult>,
}

/// `ncclNet_v11_t`.
#[repr(C)]
#[derive(Debug)]
pub struct NetV11 {
    pub name: *const c_char,
    pub init: Option<unsafe extern "C" fn(PPtr, u64, Ptr, Option<Logger>, Ptr) -> NcclResult>,
    pub devices: Option<unsafe extern "C" fn(*mut c_int) -> NcclResult>,
    pub get_properties: Option<unsafe extern "C" fn(c_int, *mut PropsV11) -> NcclResult>,
    pub listen: Option<unsafe extern "C" fn(Ptr, c_int, Ptr, PPtr) -> NcclResult>,
    pub connect: Option<unsafe extern "C" fn(Ptr, c_int, Ptr, PPtr, PPtr) -> NcclResult>,
    pub accept: Option<unsafe extern "C" fn(Ptr, PPtr, PPtr) -> NcclResult>,
    pub reg_mr: Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, PPtr) -> NcclResult>,
    pub reg_mr_dma_buf:
        Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, u64, c_int, PPtr) -> NcclResult>,
    pub dereg_mr: Option<unsafe extern "C" fn(Ptr, Ptr) -> NcclResult>,
    pub isend: Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, Ptr, Ptr, PPtr) -> NcclResult>,
    pub irecv: Option<
        unsafe extern "C" fn(
            Ptr,
            c_int,
            PPtr,
            *mut usize,
            *mut c_int,
            PPtr,
            PPtr,
            PPtr,
        ) -> NcclResult,
    >,
    pub iflush:
        Option<unsafe extern "C" fn(Ptr, c_int, PPtr, *mut c_int, PPtr, PPtr) -> NcclResult>,
    pub test: Option<unsafe extern "C" fn(Ptr, *mut c_int, *mut c_int) -> NcclResult>,
    pub close_send: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
    pub close_recv: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
    pub close_listen: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
    pub get_device_mr: Option<unsafe extern "C" fn(Ptr, Ptr, PPtr) -> NcclResult>,
    pub irecv_consumed: Option<unsafe extern "C" fn(Ptr, c_int, Ptr) -> NcclResult>,
    pub make_vdevice: Option<unsafe extern "C" fn(*mut c_int, *mut VDeviceProps) -> NcclResult>,
    pub finalize: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
    pub set_net_attr: Option<unsafe extern "C" fn(Ptr, Ptr) -> NcclResult>,
}

/// A table NCCL reads through a symbol: plain data and function pointers, never written.
#[repr(transparent)]
#[derive(Debug)]
pub struct Table<T>(pub T);

// SAFETY: the tables are immutable; the name pointer is to a static C string and the functions
// are thread-safe (they synchronise internally).
unsafe impl<T> Sync for Table<T> {}

// ---------------------------------------------------------------------------------------------
// Conversions.

fn guard(op: &str, f: impl FnOnce() -> NetResult<()>) -> NcclResult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => Code::Success as NcclResult,
        Ok(Err(e)) => {
            warn!("NET/erdma: {op}: {}", e.msg);
            e.code as NcclResult
        }
        Err(p) => {
            let why = p
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            warn!("NET/erdma: {op}: internal error (a panic, caught): {why}");
            Code::Internal as NcclResult
        }
    }
}

fn null(what: &str) -> NetError {
    NetError::invalid(format!("{what} is NULL"))
}

/// Writes through an out-pointer NCCL passes.
///
/// # Safety
/// `p` is NULL or valid for a write of `T`.
unsafe fn put<T>(p: *mut T, v: T, what: &str) -> NetResult<()> {
    if p.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-NULL, and valid for writes by the caller's contract.
    unsafe { p.write(v) };
    Ok(())
}

fn id(p: Ptr) -> u64 {
    p as u64
}

fn ptr(id: u64) -> Ptr {
    id as usize as Ptr
}

/// NCCL's handle buffer.
///
/// # Safety
/// `h` is NULL or points to `NCCL_NET_HANDLE_MAXSIZE` writable bytes.
unsafe fn handle<'a>(h: Ptr) -> NetResult<&'a mut [u8; HANDLE_BYTES]> {
    if h.is_null() {
        return Err(null("the handle"));
    }
    // SAFETY: NCCL's handles are NCCL_NET_HANDLE_MAXSIZE (128) bytes, byte-aligned.
    Ok(unsafe { &mut *(h as *mut [u8; HANDLE_BYTES]) })
}

/// Reads element `i` of an array NCCL passes.
///
/// # Safety
/// `a` is NULL or valid for reads of at least `i + 1` elements.
unsafe fn at<T: Copy>(a: *const T, i: usize, what: &str) -> NetResult<T> {
    if a.is_null() {
        return Err(null(what));
    }
    // SAFETY: within the array by the caller's contract.
    Ok(unsafe { *a.add(i) })
}

fn count(n: c_int) -> NetResult<usize> {
    usize::try_from(n)
        .ok()
        .filter(|&n| (1..=MAX_RECVS).contains(&n))
        .ok_or_else(|| NetError::invalid(format!("{n} grouped requests (1..={MAX_RECVS})")))
}

// ---------------------------------------------------------------------------------------------
// The functions.

unsafe extern "C" fn init_v8(logger: Option<Logger>) -> NcclResult {
    guard("init", || net::init(logger))
}

unsafe extern "C" fn init_v10(logger: Option<Logger>, _profiler: Ptr) -> NcclResult {
    guard("init", || net::init(logger))
}

unsafe extern "C" fn init_v11(
    ctx: PPtr,
    comm_id: u64,
    _config: Ptr,
    logger: Option<Logger>,
    _profiler: Ptr,
) -> NcclResult {
    guard("init", || {
        if ctx.is_null() {
            return Err(null("the context out-pointer"));
        }
        // SAFETY: checked non-NULL; NCCL passes `&comm->netContext`. Cleared first, so that a
        // failed init leaves nothing for `finalize` to misread.
        unsafe { ctx.write(std::ptr::null_mut()) };
        let c = net::init_ctx(comm_id, logger)?;
        // SAFETY: as above.
        unsafe { put(ctx, ptr(c), "the context out-pointer") }
    })
}

unsafe extern "C" fn finalize(ctx: Ptr) -> NcclResult {
    guard("finalize", || net::finalize(id(ctx)))
}

unsafe extern "C" fn devices(n: *mut c_int) -> NcclResult {
    guard("devices", || {
        let d = net::devices()? as c_int;
        // SAFETY: NCCL passes a valid int pointer; NULL is refused.
        unsafe { put(n, d, "the device count pointer") }
    })
}

fn props_v9(p: &net::Props, dev: c_int) -> PropsV9 {
    PropsV9 {
        name: p.name,
        pci_path: p.pci_path,
        guid: p.guid,
        ptr_support: p.ptr_support,
        reg_is_global: 0,
        force_flush: 0,
        speed: p.speed,
        port: p.port,
        latency: p.latency,
        max_comms: p.max_comms,
        max_recvs: p.max_recvs,
        net_device_type: 0,
        net_device_version: 0,
        vprops: VDeviceProps {
            ndevs: 1,
            devs: [dev, 0, 0, 0],
        },
        max_p2p_bytes: p.max_bytes,
        max_coll_bytes: p.max_bytes,
    }
}

unsafe extern "C" fn get_properties_v8(dev: c_int, out: *mut PropsV8) -> NcclResult {
    guard("getProperties", || {
        let p = net::properties(dev)?;
        let v = PropsV8 {
            name: p.name,
            pci_path: p.pci_path,
            guid: p.guid,
            ptr_support: p.ptr_support,
            reg_is_global: 0,
            speed: p.speed,
            port: p.port,
            latency: p.latency,
            max_comms: p.max_comms,
            max_recvs: p.max_recvs,
            net_device_type: 0,
            net_device_version: 0,
        };
        // SAFETY: NCCL passes a properties struct of this version; NULL is refused.
        unsafe { put(out, v, "the properties pointer") }
    })
}

unsafe extern "C" fn get_properties_v9(dev: c_int, out: *mut PropsV9) -> NcclResult {
    guard("getProperties", || {
        let p = net::properties(dev)?;
        // SAFETY: NCCL passes a properties struct of this version; NULL is refused.
        unsafe { put(out, props_v9(&p, dev), "the properties pointer") }
    })
}

unsafe extern "C" fn get_properties_v11(dev: c_int, out: *mut PropsV11) -> NcclResult {
    guard("getProperties", || {
        let p = net::properties(dev)?;
        let v = PropsV11 {
            v9: props_v9(&p, dev),
            max_multi_request_size: 1,
        };
        // SAFETY: NCCL passes a properties struct of this version; NULL is refused.
        unsafe { put(out, v, "the properties pointer") }
    })
}

unsafe extern "C" fn listen(dev: c_int, h: Ptr, listen_comm: PPtr) -> NcclResult {
    guard("listen", || {
        // SAFETY: NCCL's handle buffer (NULL refused).
        let h = unsafe { handle(h) }?;
        if listen_comm.is_null() {
            return Err(null("the listen out-pointer"));
        }
        let l = net::listen(dev, h)?;
        // SAFETY: checked non-NULL.
        unsafe { put(listen_comm, ptr(l), "the listen out-pointer") }
    })
}

unsafe extern "C" fn listen_v11(ctx: Ptr, dev: c_int, h: Ptr, listen_comm: PPtr) -> NcclResult {
    let rc = guard("listen", || net::check_ctx(id(ctx)));
    if rc != 0 {
        return rc;
    }
    // SAFETY: forwarded as NCCL passed them.
    unsafe { listen(dev, h, listen_comm) }
}

unsafe extern "C" fn connect(dev: c_int, h: Ptr, send_comm: PPtr, _dev_comm: PPtr) -> NcclResult {
    guard("connect", || {
        // SAFETY: NCCL's handle buffer (NULL refused).
        let h = unsafe { handle(h) }?;
        if send_comm.is_null() {
            return Err(null("the send-connection out-pointer"));
        }
        // SAFETY: checked non-NULL: NULL until the connection is up, as NCCL expects.
        unsafe { send_comm.write(std::ptr::null_mut()) };
        if let Some(c) = net::connect(dev, h)? {
            // SAFETY: checked non-NULL.
            unsafe { send_comm.write(ptr(c)) };
        }
        Ok(())
    })
}

unsafe extern "C" fn connect_v10(
    dev: c_int,
    _config: Ptr,
    h: Ptr,
    send_comm: PPtr,
    dev_comm: PPtr,
) -> NcclResult {
    // SAFETY: forwarded as NCCL passed them.
    unsafe { connect(dev, h, send_comm, dev_comm) }
}

unsafe extern "C" fn connect_v11(
    ctx: Ptr,
    dev: c_int,
    h: Ptr,
    send_comm: PPtr,
    dev_comm: PPtr,
) -> NcclResult {
    let rc = guard("connect", || net::check_ctx(id(ctx)));
    if rc != 0 {
        return rc;
    }
    // SAFETY: forwarded as NCCL passed them.
    unsafe { connect(dev, h, send_comm, dev_comm) }
}

unsafe extern "C" fn accept(listen_comm: Ptr, recv_comm: PPtr, _dev_comm: PPtr) -> NcclResult {
    guard("accept", || {
        if recv_comm.is_null() {
            return Err(null("the receive-connection out-pointer"));
        }
        // SAFETY: checked non-NULL.
        unsafe { recv_comm.write(std::ptr::null_mut()) };
        if let Some(c) = net::accept(id(listen_comm))? {
            // SAFETY: checked non-NULL.
            unsafe { recv_comm.write(ptr(c)) };
        }
        Ok(())
    })
}

unsafe extern "C" fn reg_mr(comm: Ptr, data: Ptr, size: usize, ty: c_int, mh: PPtr) -> NcclResult {
    guard("regMr", || {
        if mh.is_null() {
            return Err(null("the memory-handle out-pointer"));
        }
        // SAFETY: NCCL keeps registered memory allocated until deregMr, after the requests
        // that use it have completed.
        let m = unsafe { net::reg_mr(id(comm), data as u64, size as u64, ty) }?;
        // SAFETY: checked non-NULL.
        unsafe { put(mh, ptr(m), "the memory-handle out-pointer") }
    })
}

unsafe extern "C" fn reg_mr_dma_buf(
    comm: Ptr,
    data: Ptr,
    size: usize,
    ty: c_int,
    _offset: u64,
    _fd: c_int,
    mh: PPtr,
) -> NcclResult {
    // The plugin does not offer NCCL_PTR_DMABUF; the SDK finds its own dma-buf for GPU memory.
    // SAFETY: forwarded as NCCL passed them.
    unsafe { reg_mr(comm, data, size, ty, mh) }
}

unsafe extern "C" fn dereg_mr(comm: Ptr, mh: Ptr) -> NcclResult {
    guard("deregMr", || net::dereg_mr(id(comm), id(mh)))
}

fn isend_any(comm: Ptr, data: Ptr, size: u64, tag: c_int, mh: Ptr, req: PPtr) -> NcclResult {
    guard("isend", || {
        if req.is_null() {
            return Err(null("the request out-pointer"));
        }
        let r = net::isend(id(comm), data as u64, size, tag, id(mh))?;
        // SAFETY: checked non-NULL; NULL means "try again", as NCCL expects.
        unsafe { req.write(r.map_or(std::ptr::null_mut(), ptr)) };
        Ok(())
    })
}

unsafe extern "C" fn isend_v8(
    comm: Ptr,
    data: Ptr,
    size: c_int,
    tag: c_int,
    mh: Ptr,
    req: PPtr,
) -> NcclResult {
    if size < 0 {
        return guard("isend", || {
            Err(NetError::invalid(format!("a size of {size}")))
        });
    }
    isend_any(comm, data, size as u64, tag, mh, req)
}

unsafe extern "C" fn isend_v9(
    comm: Ptr,
    data: Ptr,
    size: usize,
    tag: c_int,
    mh: Ptr,
    req: PPtr,
) -> NcclResult {
    isend_any(comm, data, size as u64, tag, mh, req)
}

unsafe extern "C" fn isend_v10(
    comm: Ptr,
    data: Ptr,
    size: usize,
    tag: c_int,
    mh: Ptr,
    _phandle: Ptr,
    req: PPtr,
) -> NcclResult {
    isend_any(comm, data, size as u64, tag, mh, req)
}

/// `irecv` of any version; `size(i)` reads NCCL's size array.
///
/// # Safety
/// The arrays hold `n` elements each (NULL refused); `req` is NULL or writable.
unsafe fn irecv_any(
    comm: Ptr,
    n: c_int,
    data: PPtr,
    size: impl Fn(usize) -> NetResult<u64>,
    tags: *mut c_int,
    mhs: PPtr,
    req: PPtr,
) -> NcclResult {
    guard("irecv", || {
        if req.is_null() {
            return Err(null("the request out-pointer"));
        }
        let n = count(n)?;
        let mut bufs = [(0u64, 0u64, 0i32, 0u64); MAX_RECVS];
        for (i, b) in bufs.iter_mut().enumerate().take(n) {
            // SAFETY: NCCL's arrays hold `n` elements (NULL refused).
            *b = unsafe {
                (
                    at(data, i, "the data array")? as u64,
                    size(i)?,
                    at(tags, i, "the tag array")?,
                    at(mhs, i, "the memory-handle array")? as u64,
                )
            };
        }
        let r = net::irecv(id(comm), &bufs[..n])?;
        // SAFETY: checked non-NULL; it may hold NCCL's optional-completion marker on entry,
        // which is overwritten: every receive completes in full here.
        unsafe { req.write(r.map_or(std::ptr::null_mut(), ptr)) };
        Ok(())
    })
}

unsafe extern "C" fn irecv_v8(
    comm: Ptr,
    n: c_int,
    data: PPtr,
    sizes: *mut c_int,
    tags: *mut c_int,
    mhs: PPtr,
    req: PPtr,
) -> NcclResult {
    let size = |i| {
        // SAFETY: NCCL's size array holds `n` elements; `i < n` (NULL refused).
        let s = unsafe { at(sizes, i, "the size array") }?;
        u64::try_from(s).map_err(|_| NetError::invalid(format!("a receive size of {s}")))
    };
    // SAFETY: forwarded as NCCL passed them.
    unsafe { irecv_any(comm, n, data, size, tags, mhs, req) }
}

unsafe extern "C" fn irecv_v9(
    comm: Ptr,
    n: c_int,
    data: PPtr,
    sizes: *mut usize,
    tags: *mut c_int,
    mhs: PPtr,
    req: PPtr,
) -> NcclResult {
    // SAFETY: NCCL's size array holds `n` elements; `i < n` (NULL refused).
    let size = |i| unsafe { at(sizes, i, "the size array") }.map(|s| s as u64);
    // SAFETY: forwarded as NCCL passed them.
    unsafe { irecv_any(comm, n, data, size, tags, mhs, req) }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn irecv_v10(
    comm: Ptr,
    n: c_int,
    data: PPtr,
    sizes: *mut usize,
    tags: *mut c_int,
    mhs: PPtr,
    _phandles: PPtr,
    req: PPtr,
) -> NcclResult {
    // SAFETY: forwarded as NCCL passed them.
    unsafe { irecv_v9(comm, n, data, sizes, tags, mhs, req) }
}

unsafe extern "C" fn iflush(
    comm: Ptr,
    n: c_int,
    data: PPtr,
    sizes: *mut c_int,
    mhs: PPtr,
    req: PPtr,
) -> NcclResult {
    guard("iflush", || {
        if req.is_null() {
            return Err(null("the request out-pointer"));
        }
        let n = count(n)?;
        let mut bufs = [(0u64, 0u64, 0u64); MAX_RECVS];
        for (i, b) in bufs.iter_mut().enumerate().take(n) {
            // SAFETY: NCCL's arrays hold `n` elements (NULL refused).
            *b = unsafe {
                (
                    at(data, i, "the data array")? as u64,
                    at(sizes, i, "the size array")?.max(0) as u64,
                    at(mhs, i, "the memory-handle array")? as u64,
                )
            };
        }
        let r = net::iflush(id(comm), &bufs[..n])?;
        // SAFETY: checked non-NULL; NULL means nothing to wait for.
        unsafe { req.write(r.map_or(std::ptr::null_mut(), ptr)) };
        Ok(())
    })
}

unsafe extern "C" fn test(req: Ptr, done: *mut c_int, sizes: *mut c_int) -> NcclResult {
    guard("test", || {
        if req.is_null() {
            return Err(null("the request"));
        }
        if done.is_null() {
            return Err(null("the done pointer"));
        }
        match net::test(id(req))? {
            None => {
                // SAFETY: checked non-NULL.
                unsafe { done.write(0) };
            }
            Some((got, n)) => {
                if !sizes.is_null() {
                    for (i, &s) in got.iter().enumerate().take(n) {
                        // SAFETY: NCCL's size array holds an entry per grouped receive of the
                        // request (one for a send).
                        unsafe { sizes.add(i).write(s.min(c_int::MAX as u64) as c_int) };
                    }
                }
                // SAFETY: checked non-NULL.
                unsafe { done.write(1) };
            }
        }
        Ok(())
    })
}

unsafe extern "C" fn close_send(comm: Ptr) -> NcclResult {
    guard("closeSend", || net::close_send(id(comm)))
}

unsafe extern "C" fn close_recv(comm: Ptr) -> NcclResult {
    guard("closeRecv", || net::close_recv(id(comm)))
}

unsafe extern "C" fn close_listen(comm: Ptr) -> NcclResult {
    guard("closeListen", || net::close_listen(id(comm)))
}

// ---------------------------------------------------------------------------------------------
// The tables.

/// NCCL 2.20–2.23 load this one (newer ones too, through their compatibility layer).
#[unsafe(no_mangle)]
pub static ncclNetPlugin_v8: Table<NetV8> = Table(NetV8 {
    name: net::NAME.as_ptr(),
    init: Some(init_v8),
    devices: Some(devices),
    get_properties: Some(get_properties_v8),
    listen: Some(listen),
    connect: Some(connect),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: Some(reg_mr_dma_buf),
    dereg_mr: Some(dereg_mr),
    isend: Some(isend_v8),
    irecv: Some(irecv_v8),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
});

/// NCCL 2.24–2.25.
#[unsafe(no_mangle)]
pub static ncclNetPlugin_v9: Table<NetV9> = Table(NetV9 {
    name: net::NAME.as_ptr(),
    init: Some(init_v8),
    devices: Some(devices),
    get_properties: Some(get_properties_v9),
    listen: Some(listen),
    connect: Some(connect),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: Some(reg_mr_dma_buf),
    dereg_mr: Some(dereg_mr),
    isend: Some(isend_v9),
    irecv: Some(irecv_v9),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_vdevice: None,
});

/// NCCL 2.26–2.27.
#[unsafe(no_mangle)]
pub static ncclNetPlugin_v10: Table<NetV10> = Table(NetV10 {
    name: net::NAME.as_ptr(),
    init: Some(init_v10),
    devices: Some(devices),
    get_properties: Some(get_properties_v9),
    listen: Some(listen),
    connect: Some(connect_v10),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: Some(reg_mr_dma_buf),
    dereg_mr: Some(dereg_mr),
    isend: Some(isend_v10),
    irecv: Some(irecv_v10),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_vdevice: None,
});

/// NCCL 2.28–2.29 (per-communicator contexts).
#[unsafe(no_mangle)]
pub static ncclNetPlugin_v11: Table<NetV11> = Table(NetV11 {
    name: net::NAME.as_ptr(),
    init: Some(init_v11),
    devices: Some(devices),
    get_properties: Some(get_properties_v11),
    listen: Some(listen_v11),
    connect: Some(connect_v11),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: Some(reg_mr_dma_buf),
    dereg_mr: Some(dereg_mr),
    isend: Some(isend_v10),
    irecv: Some(irecv_v10),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_vdevice: None,
    finalize: Some(finalize),
    set_net_attr: None,
});

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    // The offsets NCCL's headers give on x86_64 and aarch64 (LP64).
    #[test]
    fn layouts_match_nccl() {
        assert_eq!(size_of::<PropsV8>(), 64);
        assert_eq!(offset_of!(PropsV8, latency), 40);
        assert_eq!(offset_of!(PropsV8, net_device_version), 56);
        assert_eq!(offset_of!(PropsV9, force_flush), 32);
        assert_eq!(offset_of!(PropsV9, latency), 44);
        assert_eq!(offset_of!(PropsV9, vprops), 64);
        assert_eq!(offset_of!(PropsV9, max_p2p_bytes), 88);
        assert_eq!(size_of::<PropsV9>(), 104);
        assert_eq!(offset_of!(PropsV11, max_multi_request_size), 104);
        assert_eq!(size_of::<PropsV11>(), 112);
        let p = size_of::<usize>();
        assert_eq!(size_of::<NetV8>(), 19 * p);
        assert_eq!(size_of::<NetV9>(), 20 * p);
        assert_eq!(size_of::<NetV10>(), 20 * p);
        assert_eq!(size_of::<NetV11>(), 22 * p);
        assert_eq!(offset_of!(NetV11, finalize), 20 * p);
    }
}
