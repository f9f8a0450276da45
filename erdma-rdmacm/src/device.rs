//! Which soft device an address belongs to, and the one context and protection domain per
//! device this library opens (as rdma-core's librdmacm shares one of each among all the
//! identifiers on a device).
//!
//! The devices are the program's libibverbs' own: a soft device of the drop-in `libibverbs.so.1`
//! carries its IPv4 address in its node GUID (`02:1d:ed:ff` then the address), so this library
//! needs nothing beyond the exported verbs. A device is opened (which binds its address's RoCE
//! port) when an identifier first needs it, and stays open for the life of the process.

use std::ffi::CStr;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::raw::c_int;
use std::sync::{Mutex, OnceLock};

use erdma_sys as sys;

use crate::last_errno;

/// The first four bytes of a soft device's node GUID; the address follows.
const GUID_PREFIX: [u8; 4] = [0x02, 0x1d, 0xed, 0xff];

/// The program's libibverbs, or `ENOSYS` when it cannot be loaded.
pub(crate) fn verbs() -> Result<&'static sys::IbVerbs, c_int> {
    sys::ibverbs().map_err(|_| libc::ENOSYS)
}

/// An open device: what identifiers on it share.
#[derive(Clone, Copy)]
pub(crate) struct Opened {
    pub ctx: *mut sys::ibv_context,
    pub pd: *mut sys::ibv_pd,
    /// GID index 1: the IPv4-mapped RoCEv2 GID.
    pub gid: [u8; 16],
    pub active_mtu: sys::ibv_mtu,
    pub max_rd_atom: u8,
    pub max_init_rd_atom: u8,
}

// SAFETY: the pointers are libibverbs objects that live for the rest of the process (never
// closed) and libibverbs' calls on them are thread-safe.
unsafe impl Send for Opened {}
// SAFETY: as above; `Opened` is only read.
unsafe impl Sync for Opened {}

/// A soft device of the verbs library.
pub(crate) struct Dev {
    pub addr: Ipv4Addr,
    ibdev: usize,
    open: Mutex<Option<Opened>>,
}

/// The soft devices the program's libibverbs lists, in its order (empty when it lists none:
/// the system's libibverbs, for one).
pub(crate) fn devices() -> &'static [Dev] {
    static LIST: OnceLock<Vec<Dev>> = OnceLock::new();
    LIST.get_or_init(|| {
        let Ok(lib) = verbs() else {
            return Vec::new();
        };
        let mut n: c_int = 0;
        // SAFETY: a valid out-parameter; the list is kept (never freed): its devices live as
        // long as the process.
        let list = unsafe { (lib.ibv_get_device_list)(&mut n) };
        if list.is_null() {
            return Vec::new();
        }
        (0..n.max(0) as usize)
            .filter_map(|i| {
                // SAFETY: `list` holds `n` device pointers.
                let dev = unsafe { *list.add(i) };
                // SAFETY: a device of the list.
                let guid = unsafe { (lib.ibv_get_device_guid)(dev) }.to_ne_bytes();
                (guid[..4] == GUID_PREFIX).then(|| Dev {
                    addr: Ipv4Addr::new(guid[4], guid[5], guid[6], guid[7]),
                    ibdev: dev as usize,
                    open: Mutex::new(None),
                })
            })
            .collect()
    })
}

/// The listed device of `addr`.
pub(crate) fn by_addr(addr: Ipv4Addr) -> Option<&'static Dev> {
    devices().iter().find(|d| d.addr == addr)
}

impl Dev {
    /// A device outside the process's list, for unit tests of what uses one.
    #[cfg(test)]
    pub(crate) fn for_test(addr: Ipv4Addr) -> Dev {
        Dev {
            addr,
            ibdev: 0,
            open: Mutex::new(None),
        }
    }

    /// The device opened (once; a failure, such as another process holding the address, is
    /// not remembered).
    pub(crate) fn open(&self) -> Result<Opened, c_int> {
        let mut slot = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(o) = *slot {
            return Ok(o);
        }
        let lib = verbs()?;
        // SAFETY: a device of the list.
        let ctx = unsafe { (lib.ibv_open_device)(self.ibdev as *mut sys::ibv_device) };
        if ctx.is_null() {
            return Err(last_errno());
        }
        let close = |e: c_int| {
            // SAFETY: the context opened above, not handed out.
            unsafe { (lib.ibv_close_device)(ctx) };
            e
        };
        // SAFETY: zeroed plain-integer structs as out-parameters of the queries below.
        let mut port: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above (a union of byte arrays).
        let mut gid: sys::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: an open context and valid out-parameters.
        let rc = unsafe {
            match sys::ibv_query_port(lib, ctx, 1, &mut port) {
                0 => match (lib.ibv_query_device)(ctx, &mut attr) {
                    0 => (lib.ibv_query_gid)(ctx, 1, 1, &mut gid),
                    e => e,
                },
                e => e,
            }
        };
        if rc != 0 {
            return Err(close(if rc > 0 { rc } else { last_errno() }));
        }
        // SAFETY: an open context.
        let pd = unsafe { (lib.ibv_alloc_pd)(ctx) };
        if pd.is_null() {
            return Err(close(last_errno()));
        }
        let o = Opened {
            ctx,
            pd,
            // SAFETY: every bit pattern is a valid byte array.
            gid: unsafe { gid.raw },
            active_mtu: port.active_mtu,
            max_rd_atom: attr.max_qp_rd_atom.clamp(0, 255) as u8,
            max_init_rd_atom: attr.max_qp_init_rd_atom.clamp(0, 255) as u8,
        };
        *slot = Some(o);
        Ok(o)
    }
}

/// The type of the drop-in libibverbs' own functions (`erdma_dropin_bind_device`,
/// `erdma_dropin_take_in`).
type DeviceFn = unsafe extern "C" fn(*mut sys::ibv_context) -> c_int;

/// The drop-in libibverbs' function `name` of version `version`, when the program's libibverbs
/// is it.
fn dropin_fn(name: &CStr, version: &CStr) -> Option<DeviceFn> {
    // SAFETY: finds the libibverbs.so.1 already loaded (RTLD_NOLOAD loads nothing; the handle
    // is kept for the life of the process), then a symbol by name and version, which
    // erdma-verbs defines with exactly this type.
    unsafe {
        let h = libc::dlopen(
            c"libibverbs.so.1".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_NOLOAD,
        );
        if h.is_null() {
            return None;
        }
        let p = libc::dlvsym(h, name.as_ptr(), version.as_ptr());
        (!p.is_null()).then(|| std::mem::transmute::<*mut libc::c_void, DeviceFn>(p))
    }
}

/// `erdma_dropin_bind_device`.
fn bind_device() -> Option<DeviceFn> {
    static F: OnceLock<Option<DeviceFn>> = OnceLock::new();
    *F.get_or_init(|| dropin_fn(c"erdma_dropin_bind_device", c"ERDMA_DROPIN_1"))
}

/// Has the soft device of `ctx` take in the datagrams that have arrived, when the program's
/// libibverbs is the drop-in: before DISCONNECTED is reported, so that the program's completion
/// queues already show what the peer sent before it left (as a NIC's would; libfabric's rxm
/// reposts a receive buffer to an endpoint it closed on DISCONNECTED when that completion comes
/// later).
pub(crate) fn take_in(ctx: *mut sys::ibv_context) {
    static F: OnceLock<Option<DeviceFn>> = OnceLock::new();
    if let Some(f) = *F.get_or_init(|| dropin_fn(c"erdma_dropin_take_in", c"ERDMA_DROPIN_2")) {
        // SAFETY: a context this library opened ([`Dev::open`]); it stays open for the life of
        // the process.
        unsafe { f(ctx) };
    }
}

impl Dev {
    /// [`Dev::open`], then the device's address bound. A device takes its address with its
    /// first queue pair to leave INIT; where this library picks a device for a connection, it
    /// needs one this process can use, so it binds as it picks (`EADDRINUSE`: another process
    /// holds it, and [`for_destination`] tries the next). Only there: an identifier bound to an
    /// address (libfabric binds one to each address it finds, to learn their devices) takes no
    /// address until its queue pair needs it.
    fn open_bound(&self) -> Result<Opened, c_int> {
        let o = self.open()?;
        if let Some(bind) = bind_device() {
            // SAFETY: an open context of the library that defines the function.
            let e = unsafe { bind(o.ctx) };
            if e != 0 {
                return Err(e);
            }
        }
        Ok(o)
    }
}

/// The kernel's source address towards `dst` (a route lookup; nothing is sent).
fn route_source(dst: Ipv4Addr) -> Result<Ipv4Addr, c_int> {
    let errno = |e: std::io::Error| e.raw_os_error().unwrap_or(libc::EHOSTUNREACH);
    let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).map_err(errno)?;
    s.connect(SocketAddrV4::new(dst, 4791)).map_err(errno)?;
    match s.local_addr().map_err(errno)? {
        std::net::SocketAddr::V4(a) => Ok(*a.ip()),
        std::net::SocketAddr::V6(_) => Err(libc::EAFNOSUPPORT),
    }
}

/// The device an active identifier uses towards `dst`, opened: `src`'s when given (a loopback
/// source that is no device's counts as none given, as the kernel's rdma_cm picks a device for
/// it); else, for a destination on this host, the first listed device this process can use,
/// the destination's own last (its address is where the peer is likely to live; two processes
/// on one host need two devices); else the device of the route's source address.
pub(crate) fn for_destination(
    dst: Ipv4Addr,
    src: Option<Ipv4Addr>,
) -> Result<(&'static Dev, Opened), c_int> {
    if let Some(src) = src {
        match by_addr(src) {
            Some(d) => return Ok((d, d.open()?)),
            None if src.is_loopback() => {}
            None => return Err(libc::ENODEV),
        }
    }
    let source = route_source(dst)?;
    let local = dst.is_loopback() || source == dst || by_addr(dst).is_some();
    if !local {
        let d = by_addr(source).ok_or(libc::ENODEV)?;
        return Ok((d, d.open()?));
    }
    let mut last = libc::ENODEV;
    let others = devices().iter().filter(|d| d.addr != dst);
    for d in others.chain(devices().iter().filter(|d| d.addr == dst)) {
        match d.open_bound() {
            Ok(o) => return Ok((d, o)),
            Err(e) => last = e,
        }
    }
    Err(last)
}
