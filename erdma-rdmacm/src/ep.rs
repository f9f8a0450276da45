//! `rdma_getaddrinfo` and the synchronous `rdma_create_ep` family: identifiers with a channel of
//! their own, whose calls return when their event has come (`rdma_server`/`rdma_client`).

use std::ffi::CStr;
use std::net::{Ipv4Addr, SocketAddrV4, ToSocketAddrs};
use std::os::raw::{c_char, c_int};

use erdma_sys as sys;

use crate::calls::{self, create_qp, destroy_qp};
use crate::channel::Chan;
use crate::id::{Id, sockaddr_in, sockaddr_v4};
use crate::{call, guard};

/// `RAI_PASSIVE`, `RAI_NUMERICHOST` (rdma_cma.h).
const RAI_PASSIVE: c_int = 1;
const RAI_NUMERICHOST: c_int = 2;

/// One `rdma_addrinfo` with its addresses, in one allocation.
#[repr(C)]
struct Info {
    ai: sys::rdma_addrinfo,
    src: libc::sockaddr_in,
    dst: libc::sockaddr_in,
}

/// The IPv4 address of a node name (a literal, or through the resolver unless numeric only).
fn resolve(node: &str, numeric: bool) -> Result<Ipv4Addr, c_int> {
    if let Ok(a) = node.parse() {
        return Ok(a);
    }
    if numeric {
        return Err(libc::EINVAL);
    }
    (node, 0)
        .to_socket_addrs()
        .map_err(|_| libc::EADDRNOTAVAIL)?
        .find_map(|a| match a {
            std::net::SocketAddr::V4(a) => Some(*a.ip()),
            std::net::SocketAddr::V6(_) => None,
        })
        .ok_or(libc::EADDRNOTAVAIL)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const sys::rdma_addrinfo,
    res: *mut *mut sys::rdma_addrinfo,
) -> c_int {
    call(|| {
        // SAFETY: NULL or the program's valid hints / C strings (the C contract).
        let hints = unsafe { hints.as_ref() };
        // With neither node nor service, the hints' own addresses are the answer (libfabric
        // resolves that way); with neither those, there is nothing to resolve.
        let (hint_src, hint_dst) = match hints {
            // SAFETY: the hints' sockaddrs, NULL or valid (the C contract).
            Some(h) => unsafe { (sockaddr_v4(h.ai_src_addr)?, sockaddr_v4(h.ai_dst_addr)?) },
            None => (None, None),
        };
        if res.is_null()
            || (node.is_null() && service.is_null() && hint_src.is_none() && hint_dst.is_none())
        {
            return Err(libc::EINVAL);
        }
        let text = |p: *const c_char| -> Result<Option<String>, c_int> {
            if p.is_null() {
                return Ok(None);
            }
            // SAFETY: a NUL-terminated string (the C contract).
            let s = unsafe { CStr::from_ptr(p) }
                .to_str()
                .map_err(|_| libc::EINVAL)?;
            Ok(Some(s.to_string()))
        };
        let flags = hints.map_or(0, |h| h.ai_flags);
        if let Some(h) = hints {
            if h.ai_family != 0 && h.ai_family != libc::AF_INET && h.ai_family != libc::AF_INET6 {
                return Err(libc::EAFNOSUPPORT);
            }
            let ps = h.ai_port_space as u32;
            if ps != 0 && ps != sys::RDMA_PS_TCP && ps != sys::RDMA_PS_IB {
                return Err(libc::EOPNOTSUPP);
            }
            if h.ai_qp_type != 0 && h.ai_qp_type as u32 != sys::IBV_QPT_RC {
                return Err(libc::EOPNOTSUPP);
            }
        }
        let port: u16 = match text(service)? {
            Some(s) => s.trim().parse().map_err(|_| libc::EINVAL)?,
            None => 0,
        };
        let passive = flags & RAI_PASSIVE != 0;
        let from_hints = node.is_null() && service.is_null();
        let (ip, port) = match (text(node)?, from_hints) {
            (Some(n), _) => (resolve(&n, flags & RAI_NUMERICHOST != 0)?, port),
            // The address the hints give for the side this call resolves.
            (None, true) => {
                let a = if passive { hint_src } else { hint_dst };
                a.map_or((Ipv4Addr::UNSPECIFIED, 0), |a| (*a.ip(), a.port()))
            }
            (None, false) => (Ipv4Addr::UNSPECIFIED, port),
        };
        // SAFETY: `rdma_addrinfo` is integers and pointers: all zeroes is valid.
        let mut ai: sys::rdma_addrinfo = unsafe { std::mem::zeroed() };
        ai.ai_flags = flags;
        ai.ai_family = libc::AF_INET;
        ai.ai_qp_type = sys::IBV_QPT_RC as c_int;
        ai.ai_port_space = sys::RDMA_PS_TCP as c_int;
        let mut b = Box::new(Info {
            ai,
            src: sockaddr_in(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)),
            dst: sockaddr_in(SocketAddrV4::new(ip, port)),
        });
        let len = std::mem::size_of::<libc::sockaddr_in>() as sys::socklen_t;
        if passive {
            b.src = sockaddr_in(SocketAddrV4::new(ip, port));
            b.ai.ai_src_addr = (&raw mut b.src).cast();
            b.ai.ai_src_len = len;
        } else {
            if ip.is_unspecified() {
                return Err(libc::EINVAL);
            }
            b.ai.ai_dst_addr = (&raw mut b.dst).cast();
            b.ai.ai_dst_len = len;
            // A source the hints name.
            if let Some(src) = hint_src {
                b.src = sockaddr_in(src);
                b.ai.ai_src_addr = (&raw mut b.src).cast();
                b.ai.ai_src_len = len;
            }
        }
        // SAFETY: a non-NULL out-parameter; `ai` is the first field of the box.
        unsafe { *res = Box::into_raw(b).cast() };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_freeaddrinfo(res: *mut sys::rdma_addrinfo) {
    guard((), || {
        let mut p = res;
        while !p.is_null() {
            // SAFETY: a list from rdma_getaddrinfo: each entry is an `Info` box.
            let b = unsafe { Box::from_raw(p.cast::<Info>()) };
            p = b.ai.ai_next;
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_create_ep(
    id: *mut *mut sys::rdma_cm_id,
    res: *mut sys::rdma_addrinfo,
    pd: *mut sys::ibv_pd,
    qp_init_attr: *mut sys::ibv_qp_init_attr,
) -> c_int {
    call(|| {
        if id.is_null() || res.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: the program's valid addrinfo (the C contract).
        let ai = unsafe { &*res };
        let ps = if ai.ai_port_space == 0 {
            sys::RDMA_PS_TCP
        } else {
            ai.ai_port_space as u32
        };
        let mut out: *mut sys::rdma_cm_id = std::ptr::null_mut();
        // SAFETY: a synchronous identifier (no channel) into a local out-parameter.
        if unsafe {
            calls::rdma_create_id(std::ptr::null_mut(), &mut out, std::ptr::null_mut(), ps)
        } != 0
        {
            return Err(crate::last_errno());
        }
        let undo = |e: c_int| {
            // SAFETY: the identifier made above, not handed out.
            unsafe { calls::rdma_destroy_id(out) };
            e
        };
        // SAFETY: the identifier made above and the addrinfo's addresses.
        let rc = unsafe {
            if ai.ai_flags & RAI_PASSIVE != 0 {
                calls::rdma_bind_addr(out, ai.ai_src_addr)
            } else {
                match calls::rdma_resolve_addr(out, ai.ai_src_addr, ai.ai_dst_addr, 2000) {
                    0 => calls::rdma_resolve_route(out, 2000),
                    e => e,
                }
            }
        };
        if rc != 0 {
            return Err(undo(crate::last_errno()));
        }
        // SAFETY: the identifier made above.
        let new = unsafe { Id::of(out) }.map_err(undo)?;
        if !pd.is_null() {
            let st = new.lock();
            new.with_c(&st, |c| c.pd = pd);
        }
        if !qp_init_attr.is_null() {
            // SAFETY: the program's valid attributes (the C contract).
            let attr = unsafe { &mut *qp_init_attr };
            // As librdmacm: the identifier's type (RC here) is the queue pair's.
            attr.qp_type = sys::IBV_QPT_RC;
            if ai.ai_flags & RAI_PASSIVE != 0 {
                new.lock().ep_attr = Some(*attr);
            } else if let Err(e) = create_qp(&new, pd, attr) {
                drop(new);
                return Err(undo(e));
            }
        }
        // SAFETY: a non-NULL out-parameter.
        unsafe { *id = out };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_destroy_ep(id: *mut sys::rdma_cm_id) {
    let _ = call(|| {
        // SAFETY: the program's live identifier (the C contract).
        let i = unsafe { Id::of(id)? };
        destroy_qp(&i);
        drop(i);
        // SAFETY: as above; given back once.
        unsafe { calls::rdma_destroy_id(id) };
        Ok(())
    });
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_get_request(
    listen: *mut sys::rdma_cm_id,
    id: *mut *mut sys::rdma_cm_id,
) -> c_int {
    call(|| {
        if id.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: the program's live identifier (the C contract).
        let l = unsafe { Id::of(listen)? };
        let (chan, attr) = {
            let st = l.lock();
            if st.own_chan.is_none() {
                return Err(libc::EINVAL);
            }
            (st.chan.clone(), st.ep_attr)
        };
        let ev = chan.take()?;
        // SAFETY: the event just taken, ours until freed below or kept by the new identifier.
        let (kind, status, child) = unsafe { ((*ev).ev.event, (*ev).ev.status, (*ev).ev.id) };
        if status != 0 || kind != sys::RDMA_CM_EVENT_CONNECT_REQUEST {
            // SAFETY: the event taken above, freed once.
            unsafe { crate::channel::free_event(ev.cast()) };
            return Err(if status != 0 {
                status.abs()
            } else {
                libc::EINVAL
            });
        }
        // SAFETY: the request's identifier is live: the event holds it. The program gets the
        // reference the listener thread made for it.
        let c = unsafe { Id::of(child)? };
        let own = Chan::new()?;
        {
            let mut st = c.lock();
            let p = own.boxed();
            st.chan = own;
            st.own_chan = Some(p as usize);
            c.with_c(&st, |cc| {
                cc.channel = p.cast();
                cc.event = ev.cast();
            });
            // SAFETY: the listener's own struct (see `Id`).
            let pd = unsafe { (*l.c()).pd };
            if !pd.is_null() {
                c.with_c(&st, |cc| cc.pd = pd);
            }
        }
        drop(c);
        if let Some(mut attr) = attr {
            // SAFETY: as above.
            let c = unsafe { Id::of(child)? };
            if let Err(e) = create_qp(&c, std::ptr::null_mut(), &mut attr) {
                // SAFETY: the request's identifier, refused and given back (the program never
                // sees it).
                unsafe {
                    calls::rdma_reject(child, std::ptr::null(), 0);
                    calls::rdma_destroy_id(child);
                }
                return Err(e);
            }
        }
        // SAFETY: a non-NULL out-parameter; the program holds the request's reference.
        unsafe { *id = child };
        Ok(())
    })
}
