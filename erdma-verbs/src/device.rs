//! Devices and contexts: the list `ERDMA_SOFT_DEVICES` names (`soft0`, `soft1`, …), opening one
//! (which binds its address), the `verbs_context` the header's `_ex` inlines look up, and the
//! queries.

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_void};
use std::net::Ipv4Addr;
use std::os::raw::c_int;
use std::sync::{Mutex, OnceLock};

use erdma::raw_provider::{self as raw, RawCtx, RawEvents};
use erdma_sys as sys;

use crate::{guard, minus_one, ptr_or_errno, set_errno};

/// Lists the soft devices' addresses: comma-separated IPv4 addresses.
pub const DEVICES_ENV: &str = "ERDMA_SOFT_DEVICES";

/// `IBV_GID_TYPE_ROCE_V2` of `enum ibv_gid_type` (verbs.h).
const GID_TYPE_ROCE_V2: u32 = 2;
/// `IBV_GID_TYPE_SYSFS_ROCE_V2` of `enum ibv_gid_type_sysfs` (driver.h).
const GID_TYPE_SYSFS_ROCE_V2: c_int = 1;

/// One listed device: `struct ibv_device`, then the slot where rdma-core's `verbs_device` keeps
/// its ops (offset 664; providers such as libmlx5 read it, and must find NULL).
#[repr(C)]
pub struct Device {
    pub dev: sys::ibv_device,
    ops: usize,
    pub addr: Ipv4Addr,
    pub index: c_int,
}

/// The addresses `ERDMA_SOFT_DEVICES` names, or the host's (loopback first). A malformed entry
/// is skipped with a warning on stderr.
fn addresses() -> Vec<Ipv4Addr> {
    match std::env::var(DEVICES_ENV) {
        Ok(list) if !list.trim().is_empty() => list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .filter_map(|s| match s.parse() {
                Ok(a) => Some(a),
                Err(_) => {
                    eprintln!("libibverbs (erdma): {DEVICES_ENV}: `{s}` is not an IPv4 address");
                    None
                }
            })
            .collect(),
        _ => {
            let mut v = raw::host_addresses();
            if v.is_empty() {
                v.push(Ipv4Addr::LOCALHOST);
            }
            v
        }
    }
}

fn fill(dst: &mut [c_char], s: &str) {
    let max = dst.len() - 1;
    for (d, b) in dst.iter_mut().zip(s.bytes().take(max)) {
        *d = b as c_char;
    }
}

/// The devices of this process, made once (they live as long as the process, as rdma-core's).
pub fn devices() -> &'static [Device] {
    static LIST: OnceLock<Vec<Device>> = OnceLock::new();
    LIST.get_or_init(|| {
        addresses()
            .into_iter()
            .enumerate()
            .map(|(i, addr)| {
                // SAFETY: `ibv_device` is integers, char arrays and nullable function pointers:
                // all zeroes is a valid value.
                let mut dev: sys::ibv_device = unsafe { std::mem::zeroed() };
                dev.node_type = 1; // IBV_NODE_CA
                dev.transport_type = 0; // IBV_TRANSPORT_IB (RoCE reports IB)
                let name = format!("soft{i}");
                let uverbs = format!("usoft{i}");
                fill(&mut dev.name, &name);
                fill(&mut dev.dev_name, &uverbs);
                fill(
                    &mut dev.dev_path,
                    &format!("/sys/class/infiniband_verbs/{uverbs}"),
                );
                fill(&mut dev.ibdev_path, &format!("{SOFT_SYSFS}{name}"));
                Device {
                    dev,
                    ops: 0,
                    addr,
                    index: i as c_int,
                }
            })
            .collect()
    })
}

/// Where the devices' (made-up) sysfs directories would be.
pub(crate) const SOFT_SYSFS: &str = "/sys/class/infiniband/";

/// The listed device at `p`, or `None` for a pointer this library did not hand out.
pub fn device_of(p: *const sys::ibv_device) -> Option<&'static Device> {
    devices().iter().find(|d| std::ptr::eq(&d.dev, p))
}

/// An open device: `struct verbs_context` (which ends with the program's `struct
/// ibv_context`), then the library's state.
#[repr(C)]
pub struct Context {
    pub vctx: sys::verbs_context,
    pub raw: RawCtx,
    pub events: RawEvents,
    pub dev: &'static Device,
    /// Queue pairs by number and completion queues by id, for asynchronous events.
    pub qps: Mutex<HashMap<u32, usize>>,
    pub cqs: Mutex<HashMap<u64, usize>>,
}

const CTX_OFFSET: usize = std::mem::offset_of!(sys::verbs_context, context);

/// The library's context of a program's `ibv_context`.
///
/// # Safety
/// `ctx` came from [`ibv_open_device`] and is not closed.
pub unsafe fn context<'a>(ctx: *mut sys::ibv_context) -> &'a Context {
    // SAFETY: `ctx` is the `context` field of the `verbs_context` that starts a live `Context`
    // (the caller's contract), so stepping back `CTX_OFFSET` bytes stays in that allocation.
    unsafe { &*(ctx.cast::<u8>().sub(CTX_OFFSET).cast::<Context>()) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_get_device_list(num: *mut c_int) -> *mut *mut sys::ibv_device {
    guard(std::ptr::null_mut(), || {
        let list = devices();
        // SAFETY: calloc of n+1 pointers; checked for NULL below.
        let arr = unsafe { libc::calloc(list.len() + 1, std::mem::size_of::<usize>()) }
            .cast::<*mut sys::ibv_device>();
        if arr.is_null() {
            set_errno(libc::ENOMEM);
            return std::ptr::null_mut();
        }
        for (i, d) in list.iter().enumerate() {
            // SAFETY: `arr` has room for `list.len() + 1` pointers.
            unsafe { *arr.add(i) = (&d.dev as *const sys::ibv_device).cast_mut() };
        }
        if !num.is_null() {
            // SAFETY: a non-NULL `num` is the caller's out-parameter.
            unsafe { *num = list.len() as c_int };
        }
        arr
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_free_device_list(list: *mut *mut sys::ibv_device) {
    // SAFETY: `list` came from ibv_get_device_list's calloc (or is NULL, which free ignores).
    unsafe { libc::free(list.cast()) };
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_get_device_name(dev: *mut sys::ibv_device) -> *const c_char {
    guard(std::ptr::null(), || match device_of(dev) {
        Some(d) => d.dev.name.as_ptr(),
        None => {
            set_errno(libc::EINVAL);
            std::ptr::null()
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_get_device_guid(dev: *mut sys::ibv_device) -> u64 {
    guard(0, || {
        device_of(dev).map_or(0, |d| raw::node_guid(d.addr).to_be())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_get_device_index(dev: *mut sys::ibv_device) -> c_int {
    guard(-1, || device_of(dev).map_or(-1, |d| d.index))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_open_device(dev: *mut sys::ibv_device) -> *mut sys::ibv_context {
    guard(std::ptr::null_mut(), || {
        ptr_or_errno((|| {
            let d = device_of(dev).ok_or(libc::ENODEV)?;
            // Programs that poll get the polling receive path; those that wait by watching
            // memory (perftest's latency tests) are found out and get the engine's too.
            RawCtx::adapt_receive_work_by_default();
            let raw = RawCtx::open(d.addr).map_err(|e| raw::errno(&e))?;
            let events = RawEvents::default();
            let async_fd = async_fd(&events)?;
            // SAFETY: `verbs_context` is integers, pointers, nullable function pointers and a
            // pthread mutex: all zeroes is valid (and is PTHREAD_MUTEX_INITIALIZER on glibc).
            let mut vctx: sys::verbs_context = unsafe { std::mem::zeroed() };
            vctx.sz = std::mem::size_of::<sys::verbs_context>();
            vctx.query_port = Some(vctx_query_port);
            vctx.query_device_ex = Some(vctx_query_device_ex);
            vctx.create_qp_ex = Some(crate::objects::vctx_create_qp_ex);
            vctx.close_xrcd = Some(crate::stubs::vctx_close_xrcd);
            let c = &mut vctx.context;
            c.device = dev;
            c.cmd_fd = -1;
            c.async_fd = async_fd;
            c.num_comp_vectors = 1;
            c.abi_compat = usize::MAX as *mut c_void; // __VERBS_ABI_IS_EXTENDED
            crate::datapath::fill_ops(&mut c.ops);
            let ctx = Box::new(Context {
                vctx,
                raw,
                events,
                dev: d,
                qps: Mutex::default(),
                cqs: Mutex::default(),
            });
            let p = Box::into_raw(ctx);
            // SAFETY: `p` is the live allocation just made.
            Ok(unsafe { &raw mut (*p).vctx.context })
        })())
    })
}

/// The program's `async_fd`: an epoll descriptor watching the events' eventfd, so that it is
/// blocking until the program makes it non-blocking, as rdma-core's is (the eventfd itself is
/// non-blocking).
fn async_fd(events: &RawEvents) -> Result<c_int, c_int> {
    let os = || {
        std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EMFILE)
    };
    let efd = events
        .fd()
        .map_err(|e| e.raw_os_error().unwrap_or(libc::EMFILE))?;
    // SAFETY: plain syscall.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if ep < 0 {
        return Err(os());
    }
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: 0,
    };
    // SAFETY: `ev` is valid for the call; both descriptors are open.
    if unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, efd, &mut ev) } < 0 {
        let e = os();
        // SAFETY: the descriptor made above, not handed out.
        unsafe { libc::close(ep) };
        return Err(e);
    }
    Ok(ep)
}

/// The drop-in's own functions on a context (for the drop-in librdmacm): `EINVAL` for a NULL
/// one, else what `f` returns for its device (0 or an errno), `EIO` for a panic.
///
/// # Safety
/// A non-NULL `ctx` is open.
unsafe fn on_device(ctx: *mut sys::ibv_context, f: impl FnOnce(&raw::RawCtx) -> c_int) -> c_int {
    guard(libc::EIO, || {
        if ctx.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: `ctx` is open (the caller's contract).
        f(&unsafe { crate::objects::ctx_of(ctx) }.raw)
    })
}

/// Not rdma-core's: binds the soft device of `ctx` to its address now. A device takes its
/// address when its first queue pair leaves INIT, so that programs opening every device they
/// list take none they do not use; the drop-in librdmacm calls this for the device it picks
/// for a connection, to pick one this process can use. 0, or an errno (`EADDRINUSE`: another
/// process holds the address).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn erdma_dropin_bind_device(ctx: *mut sys::ibv_context) -> c_int {
    // SAFETY: the caller's contract is `on_device`'s.
    unsafe { on_device(ctx, |d| d.bind().map_or_else(|e| raw::errno(&e), |()| 0)) }
}

/// Not rdma-core's: the soft device of `ctx` takes in the datagrams that have arrived (and
/// sends the acknowledgements it holds back) now. The drop-in librdmacm calls this before it
/// reports that a peer left, so that the program's completion queues already show what the peer
/// sent before it went, as a NIC's would. 0, or `EINVAL` for a NULL context.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn erdma_dropin_take_in(ctx: *mut sys::ibv_context) -> c_int {
    // SAFETY: the caller's contract is `on_device`'s.
    unsafe {
        on_device(ctx, |d| {
            d.take_in();
            0
        })
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_close_device(ctx: *mut sys::ibv_context) -> c_int {
    guard(-1, || {
        // SAFETY: `ctx` came from ibv_open_device (the caller's contract); closing it ends it,
        // so the Box is taken back once.
        let c = unsafe { context(ctx) };
        // SAFETY: as above: the Box made by ibv_open_device.
        let c = unsafe { Box::from_raw((c as *const Context).cast_mut()) };
        // SAFETY: the context's own epoll descriptor (`async_fd`), closed once.
        unsafe { libc::close(c.vctx.context.async_fd) };
        0
    })
}

fn port_attr(c: &Context) -> sys::ibv_port_attr {
    let p = c.raw.query_port();
    // SAFETY: `ibv_port_attr` is integers only.
    let mut a: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
    a.state = 4; // IBV_PORT_ACTIVE
    a.max_mtu = p.max_mtu.as_enum();
    a.active_mtu = p.active_mtu.as_enum();
    a.gid_tbl_len = p.gid_tbl_len as c_int;
    a.port_cap_flags = p.port_cap_flags;
    a.max_msg_sz = p.max_msg_sz;
    a.pkey_tbl_len = 1;
    a.lid = p.lid;
    a.max_vl_num = 1;
    a.active_width = p.active_width;
    a.active_speed = 1; // SDR: the soft device has no link speed
    a.phys_state = 5; // LinkUp
    a.link_layer = 2; // IBV_LINK_LAYER_ETHERNET
    a
}

/// Copies `len` bytes of `src` to `dst`, zero-filling past the end of `src` (rdma-core's rule
/// for attribute structs of another header's size).
///
/// # Safety
/// `dst` is writable for `len` bytes.
unsafe fn copy_sized<T>(src: &T, dst: *mut u8, len: usize) {
    let n = len.min(std::mem::size_of::<T>());
    // SAFETY: `dst` is writable for `len >= n` bytes (the caller's contract); `src` is a
    // distinct local value of at least `n` bytes.
    unsafe {
        std::ptr::write_bytes(dst, 0, len);
        std::ptr::copy_nonoverlapping((src as *const T).cast::<u8>(), dst, n);
    }
}

unsafe extern "C" fn vctx_query_port(
    ctx: *mut sys::ibv_context,
    port: u8,
    attr: *mut sys::ibv_port_attr,
    len: usize,
) -> c_int {
    guard(libc::EIO, || {
        if attr.is_null() {
            return libc::EINVAL;
        }
        if port != 1 {
            return libc::EINVAL;
        }
        // SAFETY: `ctx` is an open context and `attr` holds `len` bytes (the C contract).
        unsafe { copy_sized(&port_attr(context(ctx)), attr.cast(), len) };
        0
    })
}

/// `ibv_query_port@IBVERBS_1.1`: the 48-byte struct of programs built before `port_cap_flags2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_port(
    ctx: *mut sys::ibv_context,
    port: u8,
    attr: *mut sys::ibv_port_attr,
) -> c_int {
    // SAFETY: the exported function's struct is at least the compat one's 48 bytes.
    unsafe { vctx_query_port(ctx, port, attr, 48) }
}

fn device_attr(c: &Context) -> sys::ibv_device_attr {
    let d = c.raw.query_device();
    // SAFETY: `ibv_device_attr` is integers and a char array.
    let mut a: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
    fill(&mut a.fw_ver, &d.fw_ver);
    a.node_guid = d.node_guid.to_be();
    a.sys_image_guid = d.sys_image_guid.to_be();
    a.max_mr_size = d.max_mr_size;
    a.page_size_cap = d.page_size_cap;
    a.vendor_id = d.vendor_id;
    a.vendor_part_id = d.vendor_part_id;
    a.hw_ver = d.hw_ver;
    a.max_qp = d.max_qp as c_int;
    a.max_qp_wr = d.max_qp_wr as c_int;
    a.device_cap_flags = d.device_cap_flags as u32;
    a.max_sge = d.max_sge as c_int;
    a.max_sge_rd = d.max_sge_rd as c_int;
    a.max_cq = d.max_cq as c_int;
    a.max_cqe = d.max_cqe as c_int;
    a.max_mr = d.max_mr as c_int;
    a.max_pd = d.max_pd as c_int;
    a.max_qp_rd_atom = d.max_qp_rd_atom as c_int;
    a.max_res_rd_atom = (d.max_qp_rd_atom as c_int).saturating_mul(d.max_qp as c_int);
    a.max_qp_init_rd_atom = d.max_qp_init_rd_atom as c_int;
    a.atomic_cap = match d.atomic_cap {
        erdma::AtomicCap::None => 0,
        erdma::AtomicCap::Hca => 1,
        erdma::AtomicCap::Global => 2,
    };
    a.max_pkeys = 1;
    a.local_ca_ack_delay = 15;
    a.phys_port_cnt = d.phys_port_cnt;
    a
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_device(
    ctx: *mut sys::ibv_context,
    attr: *mut sys::ibv_device_attr,
) -> c_int {
    guard(libc::EIO, || {
        if attr.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: `ctx` is open and `attr` writable (the C contract).
        unsafe { *attr = device_attr(context(ctx)) };
        0
    })
}

unsafe extern "C" fn vctx_query_device_ex(
    ctx: *mut sys::ibv_context,
    input: *const sys::ibv_query_device_ex_input,
    attr: *mut sys::ibv_device_attr_ex,
    len: usize,
) -> c_int {
    guard(libc::EIO, || {
        if attr.is_null() || len < std::mem::size_of::<sys::ibv_device_attr>() {
            return libc::EINVAL;
        }
        // SAFETY: a non-NULL `input` is readable (the C contract).
        if !input.is_null() && unsafe { (*input).comp_mask } != 0 {
            return libc::EINVAL;
        }
        // SAFETY: `ibv_device_attr_ex` is integers and structs of them.
        let mut ex: sys::ibv_device_attr_ex = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open (the C contract).
        ex.orig_attr = device_attr(unsafe { context(ctx) });
        // SAFETY: `attr` holds `len` bytes (the C contract).
        unsafe { copy_sized(&ex, attr.cast(), len) };
        0
    })
}

/// The GID at `index`: index 0 link-local, 1 the IPv4-mapped RoCEv2 GID; the rest of the table
/// is empty (zero).
fn gid(c: &Context, port: u8, index: c_int) -> Result<[u8; 16], c_int> {
    let len = c.raw.query_port().gid_tbl_len as c_int;
    if port != 1 || index < 0 || index >= len {
        return Err(libc::EINVAL);
    }
    Ok(c.raw
        .gid_table()
        .iter()
        .find(|e| e.index as c_int == index)
        .map_or([0; 16], |e| e.gid.0))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_gid(
    ctx: *mut sys::ibv_context,
    port: u8,
    index: c_int,
    out: *mut sys::ibv_gid,
) -> c_int {
    guard(-1, || {
        if out.is_null() {
            return minus_one(Err(libc::EINVAL));
        }
        // SAFETY: `ctx` is open (the C contract).
        let g = gid(unsafe { context(ctx) }, port, index);
        minus_one(g.map(|g| {
            // SAFETY: `out` is writable (the C contract).
            unsafe { (*out).raw = g }
        }))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn _ibv_query_gid_ex(
    ctx: *mut sys::ibv_context,
    port: u32,
    index: u32,
    entry: *mut sys::ibv_gid_entry,
    flags: u32,
    len: usize,
) -> c_int {
    guard(libc::EIO, || {
        if entry.is_null() || flags != 0 || port > 255 || index > c_int::MAX as u32 {
            return libc::EINVAL;
        }
        // SAFETY: `ctx` is open (the C contract).
        let g = match gid(unsafe { context(ctx) }, port as u8, index as c_int) {
            Ok(g) => g,
            Err(e) => return e,
        };
        if g == [0; 16] {
            return libc::ENODATA;
        }
        // SAFETY: `ibv_gid_entry` is integers.
        let mut e: sys::ibv_gid_entry = unsafe { std::mem::zeroed() };
        e.gid.raw = g;
        e.gid_index = index;
        e.port_num = port;
        e.gid_type = GID_TYPE_ROCE_V2;
        // SAFETY: `entry` holds `len` bytes (the C contract).
        unsafe { copy_sized(&e, entry.cast(), len) };
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn _ibv_query_gid_table(
    ctx: *mut sys::ibv_context,
    entries: *mut sys::ibv_gid_entry,
    max: usize,
    flags: u32,
    len: usize,
) -> isize {
    guard(-(libc::EIO as isize), || {
        if entries.is_null() || flags != 0 || len < std::mem::size_of::<sys::ibv_gid_entry>() {
            return -(libc::EINVAL as isize);
        }
        // SAFETY: `ctx` is open (the C contract).
        let c = unsafe { context(ctx) };
        let mut n = 0;
        for g in c.raw.gid_table() {
            if n == max {
                return -(libc::EINVAL as isize);
            }
            // SAFETY: as above, for each slot below `max`.
            let slot = unsafe {
                entries
                    .cast::<u8>()
                    .add(n * len)
                    .cast::<sys::ibv_gid_entry>()
            };
            // SAFETY: `entries` holds `max` entries of `len` bytes (the C contract).
            let r = unsafe { _ibv_query_gid_ex(ctx, 1, u32::from(g.index), slot, 0, len) };
            if r == 0 {
                n += 1;
            }
        }
        n as isize
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_gid_type(
    ctx: *mut sys::ibv_context,
    port: u8,
    index: u32,
    ty: *mut c_int,
) -> c_int {
    guard(-1, || {
        if ty.is_null() || index > c_int::MAX as u32 {
            return minus_one(Err(libc::EINVAL));
        }
        // SAFETY: `ctx` is open (the C contract).
        let r = gid(unsafe { context(ctx) }, port, index as c_int);
        minus_one(r.map(|_| {
            // SAFETY: `ty` is writable (the C contract).
            unsafe { *ty = GID_TYPE_SYSFS_ROCE_V2 }
        }))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_pkey(
    _ctx: *mut sys::ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    if port != 1 || index != 0 || pkey.is_null() {
        return minus_one(Err(libc::EINVAL));
    }
    // SAFETY: `pkey` is writable (the C contract).
    unsafe { *pkey = 0xffff };
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_get_pkey_index(
    _ctx: *mut sys::ibv_context,
    port: u8,
    pkey: u16,
) -> c_int {
    if port == 1 && (pkey | 0x8000) == 0xffff {
        0
    } else {
        set_errno(libc::ENOENT);
        -1
    }
}

/// `ibv_read_sysfs_file(dir, file, buf, size)`: the soft devices' few sysfs files are made up
/// here (`board_id`, `node_type`, …); other paths are read from the real sysfs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_read_sysfs_file(
    dir: *const c_char,
    file: *const c_char,
    buf: *mut c_char,
    size: usize,
) -> c_int {
    guard(-1, || {
        if dir.is_null() || file.is_null() || buf.is_null() || size == 0 {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: both are NUL-terminated strings (the C contract).
        let (dir, file) = unsafe { (CStr::from_ptr(dir), CStr::from_ptr(file)) };
        let (dir, file) = (dir.to_string_lossy(), file.to_string_lossy());
        let made_up = devices()
            .iter()
            .any(|d| dir.trim_end_matches('/').ends_with(&*cstr(&d.dev.name)))
            && dir.starts_with(SOFT_SYSFS);
        let text = if made_up {
            match file.as_ref() {
                "board_id" => "erdma-soft".to_string(),
                "node_type" => "1: CA".to_string(),
                "fw_ver" => format!("soft-{}", env!("CARGO_PKG_VERSION")),
                _ => {
                    set_errno(libc::ENOENT);
                    return -1;
                }
            }
        } else {
            match std::fs::read_to_string(format!("{dir}/{file}")) {
                Ok(t) => t,
                Err(e) => {
                    set_errno(e.raw_os_error().unwrap_or(libc::EIO));
                    return -1;
                }
            }
        };
        let text = text.trim_end_matches('\n').as_bytes();
        let n = text.len().min(size - 1);
        // SAFETY: `buf` holds `size > n` bytes (the C contract).
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
        n as c_int
    })
}

fn cstr(s: &[c_char]) -> String {
    s.iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8 as char)
        .collect()
}

/// `ibv_get_sysfs_path`: rdma-core's default, `/sys`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_get_sysfs_path() -> *const c_char {
    c"/sys".as_ptr()
}

/// `ibv_read_ibdev_sysfs_file(buf, size, dev, fmt, ...)`: the soft devices have no sysfs.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_read_ibdev_sysfs_file() -> c_int {
    set_errno(libc::ENOENT);
    -1
}
