//! The `rdma_*` entry points of identifiers and connections.

use std::net::{Ipv4Addr, Shutdown, SocketAddrV4};
use std::os::raw::{c_int, c_void};
use std::sync::Arc;
use std::time::Duration;

use erdma_sys as sys;

use crate::channel::{ChanBox, Event};
use crate::device::{self, verbs};
use crate::id::{self, Id, Params, Phase, complete, move_qp, sockaddr_v4};
use crate::link::{self, ACCEPT_PRIVATE, CONNECT_PRIVATE, REJECT_PRIVATE};
use crate::{call, last_errno};

/// The ports `rdma_bind_addr` holds in this process. The TCP sockets behind them are bound with
/// SO_REUSEADDR (a listener must bind again while connections accepted on its port live), so
/// the kernel alone would let two identifiers bind one port: as rdma_cm, the second gets
/// `EADDRINUSE` unless both set `RDMA_OPTION_ID_REUSEADDR`.
mod ports {
    use std::net::SocketAddrV4;
    use std::os::raw::c_int;
    use std::sync::Mutex;

    static HELD: Mutex<Vec<(SocketAddrV4, bool)>> = Mutex::new(Vec::new());

    pub(super) fn reserve(a: SocketAddrV4, reuse: bool) -> Result<(), c_int> {
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        let clash = held.iter().any(|(h, r)| {
            h.port() == a.port()
                && (h.ip() == a.ip() || h.ip().is_unspecified() || a.ip().is_unspecified())
                && !(reuse && *r)
        });
        if clash {
            return Err(libc::EADDRINUSE);
        }
        held.push((a, reuse));
        Ok(())
    }

    pub(super) fn release(a: SocketAddrV4) {
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = held.iter().position(|(h, _)| *h == a) {
            held.swap_remove(i);
        }
    }
}

/// The private data of a call, checked against its limit (`EINVAL` beyond, as rdma_cm).
///
/// # Safety
/// `data` is NULL or valid for `len` bytes.
unsafe fn private(data: *const c_void, len: u8, limit: usize) -> Result<Vec<u8>, c_int> {
    if len as usize > limit {
        return Err(libc::EINVAL);
    }
    if data.is_null() || len == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len as usize) }.to_vec())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_create_id(
    channel: *mut sys::rdma_event_channel,
    id: *mut *mut sys::rdma_cm_id,
    context: *mut c_void,
    ps: sys::rdma_port_space,
) -> c_int {
    call(|| {
        if id.is_null() {
            return Err(libc::EINVAL);
        }
        if ps != sys::RDMA_PS_TCP && ps != sys::RDMA_PS_IB {
            // UD through rdma_cm (RDMA_PS_UDP, RDMA_PS_IPOIB): the soft device is RC only.
            return Err(libc::EOPNOTSUPP);
        }
        // The program's live channel, or NULL for a synchronous identifier.
        let chan = ChanBox::of(channel)?.map(|c| (c, channel));
        let new = Id::new(chan, context, ps)?;
        // SAFETY: a non-NULL out-parameter.
        unsafe { *id = Id::into_c(new) };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_destroy_id(id: *mut sys::rdma_cm_id) -> c_int {
    call(|| {
        // SAFETY: the program gives its identifier back (checked to be one).
        let id = unsafe { Id::release(id)? };
        let mut st = id.lock();
        st.destroyed = true;
        // Its events nobody has taken go with it (`destroyed` stops new ones).
        st.chan.purge(id.c());
        if let Some(s) = st.stream.take() {
            let _ = s.shutdown(Shutdown::Both);
        }
        if let Some(fd) = st.listen_fd.take() {
            // SAFETY: the listener's descriptor, still open (its thread closes it when it
            // returns); shutting it down wakes that thread's accept.
            unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
        }
        st.bound = None;
        if std::mem::take(&mut st.reserved) {
            if let Some(a) = st.local {
                ports::release(a);
            }
        }
        id::free_sync(&id, &mut st);
        drop(st);
        id.wait_acked(ACK_WAIT);
        Ok(())
    })
}

/// How long `rdma_destroy_id` waits for the program to acknowledge the identifier's events.
const ACK_WAIT: Duration = Duration::from_secs(2);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_bind_addr(
    id: *mut sys::rdma_cm_id,
    addr: *mut sys::sockaddr,
) -> c_int {
    call(|| {
        // SAFETY: the program's live identifier and sockaddr (the C contract).
        let (id, addr) = unsafe { (Id::of(id)?, sockaddr_v4(addr)?) };
        let addr = addr.ok_or(libc::EINVAL)?;
        let mut st = id.lock();
        if st.phase != Phase::Idle {
            return Err(libc::EINVAL);
        }
        if !addr.ip().is_unspecified() {
            let (dev, o) = match device::by_addr(*addr.ip()) {
                Some(dev) => (dev, dev.open()?),
                // As the kernel's rdma_cm gives an identifier bound to a loopback address a
                // device of its choosing (libfabric binds "localhost" to learn one): the first
                // this process can use, bound so (another process takes the next).
                None if addr.ip().is_loopback() => device::for_destination(*addr.ip(), None)?,
                // As rdma_cm: an address of this host without a device, or none of this host's.
                None if std::net::UdpSocket::bind((*addr.ip(), 0)).is_ok() => {
                    return Err(libc::ENODEV);
                }
                None => return Err(libc::EADDRNOTAVAIL),
            };
            id.set_device(&mut st, dev, o);
        }
        let (fd, local) = link::bind_tcp(addr)?;
        ports::reserve(local, st.reuseaddr)?;
        st.bound = Some(fd);
        st.local = Some(local);
        st.reserved = true;
        st.phase = Phase::Bound;
        id.set_addrs(&mut st);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_resolve_addr(
    id: *mut sys::rdma_cm_id,
    src_addr: *mut sys::sockaddr,
    dst_addr: *mut sys::sockaddr,
    _timeout_ms: c_int,
) -> c_int {
    call(|| {
        // SAFETY: the program's live identifier and sockaddrs (the C contract).
        let (id, src, dst) =
            unsafe { (Id::of(id)?, sockaddr_v4(src_addr)?, sockaddr_v4(dst_addr)?) };
        let dst = dst.ok_or(libc::EINVAL)?;
        {
            let mut st = id.lock();
            if !matches!(st.phase, Phase::Idle | Phase::Bound) {
                return Err(libc::EINVAL);
            }
            let src = src.map(|a| *a.ip()).filter(|a| !a.is_unspecified());
            let src = src.or(st.local.map(|a| *a.ip()).filter(|a| !a.is_unspecified()));
            match device::for_destination(*dst.ip(), src) {
                Ok((dev, o)) => {
                    id.set_device(&mut st, dev, o);
                    // A loopback source that is no device's stays the identifier's address, as
                    // in the kernel's rdma_cm: the peer sees it (libfabric's rxm matches
                    // connection requests to peers by it).
                    let ip = src.filter(|s| s.is_loopback() && device::by_addr(*s).is_none());
                    st.local = Some(SocketAddrV4::new(
                        ip.unwrap_or(dev.addr),
                        st.local.map_or(0, |a| a.port()),
                    ));
                    st.remote = Some(dst);
                    st.phase = Phase::AddrResolved;
                    id.set_addrs(&mut st);
                    id.post(&st, &Event::plain(sys::RDMA_CM_EVENT_ADDR_RESOLVED, 0));
                }
                Err(e) => id.post(&st, &Event::plain(sys::RDMA_CM_EVENT_ADDR_ERROR, -e)),
            }
        }
        complete(&id)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_resolve_route(id: *mut sys::rdma_cm_id, _timeout_ms: c_int) -> c_int {
    call(|| {
        // SAFETY: the program's live identifier (the C contract).
        let id = unsafe { Id::of(id)? };
        {
            let mut st = id.lock();
            if st.phase != Phase::AddrResolved {
                return Err(libc::EINVAL);
            }
            st.phase = Phase::RouteResolved;
            id.post(&st, &Event::plain(sys::RDMA_CM_EVENT_ROUTE_RESOLVED, 0));
        }
        complete(&id)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_listen(id: *mut sys::rdma_cm_id, backlog: c_int) -> c_int {
    call(|| {
        // SAFETY: the program's live identifier (the C contract).
        let id = unsafe { Id::of(id)? };
        let mut st = id.lock();
        if st.phase == Phase::Idle {
            // As rdma_cm: an unbound identifier listens on every address, at a free port.
            let (fd, local) = link::bind_tcp(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))?;
            st.bound = Some(fd);
            st.local = Some(local);
            id.set_addrs(&mut st);
        } else if st.phase != Phase::Bound {
            return Err(libc::EINVAL);
        }
        let fd = st.bound.take().ok_or(libc::EINVAL)?;
        let raw = link::listen(&id, fd, backlog)?;
        st.listen_fd = Some(raw);
        st.phase = Phase::Listening;
        Ok(())
    })
}

/// The arguments of `rdma_connect` / `rdma_accept`: the identifier, its parameters, and the
/// private data (at most `limit` bytes). A connection needs a queue pair, or the number of one
/// the program moves itself (`conn_param.qp_num`).
///
/// # Safety
/// `conn_param` is NULL or valid, its private data valid for its length.
unsafe fn conn_args(
    id: *mut sys::rdma_cm_id,
    conn_param: *const sys::rdma_conn_param,
    limit: usize,
) -> Result<(Arc<Id>, Params, Vec<u8>), c_int> {
    // SAFETY: any pointer is checked to be a live identifier.
    let id = unsafe { Id::of(id)? };
    let max = id.lock().rd_max();
    // SAFETY: the caller's contract.
    let params = unsafe { Params::from_c(conn_param, max) };
    // SAFETY: as above.
    let data = match unsafe { conn_param.as_ref() } {
        // SAFETY: the program's private data of the length it gives (the caller's contract).
        Some(p) => unsafe { private(p.private_data, p.private_data_len, limit)? },
        None => Vec::new(),
    };
    if id.qp().is_null() && params.qp_num == 0 {
        return Err(libc::EINVAL);
    }
    Ok((id, params, data))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_connect(
    id: *mut sys::rdma_cm_id,
    conn_param: *mut sys::rdma_conn_param,
) -> c_int {
    call(|| {
        // SAFETY: the program's identifier and parameters (the C contract).
        let (id, params, data) = unsafe { conn_args(id, conn_param, CONNECT_PRIVATE)? };
        {
            let mut st = id.lock();
            if st.phase != Phase::RouteResolved {
                return Err(libc::EINVAL);
            }
            // From the identifier's own address: its device's, or a loopback one it was given.
            let dev = st.dev.ok_or(libc::EINVAL)?.0.addr;
            let (dst, src) = (
                st.remote.ok_or(libc::EINVAL)?,
                st.local.map_or(dev, |a| *a.ip()),
            );
            st.params = params;
            st.phase = Phase::Connecting;
            link::spawn_active(id.clone(), dst, src, data);
        }
        complete(&id)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_accept(
    id: *mut sys::rdma_cm_id,
    conn_param: *mut sys::rdma_conn_param,
) -> c_int {
    call(|| {
        // SAFETY: the program's identifier and parameters (the C contract).
        let (id, params, data) = unsafe { conn_args(id, conn_param, ACCEPT_PRIVATE)? };
        {
            let mut st = id.lock();
            if st.phase != Phase::Request {
                return Err(libc::EINVAL);
            }
            st.params = params;
            if st.peer_gone {
                st.phase = Phase::Over;
                id.post(
                    &st,
                    &Event::plain(sys::RDMA_CM_EVENT_CONNECT_ERROR, -libc::ECONNRESET),
                );
            } else {
                move_qp(&id, &st, &[sys::IBV_QPS_RTR, sys::IBV_QPS_RTS])?;
                let info = erdma::connect::PeerInfo {
                    endpoints: vec![id.endpoint(&st)?],
                    regions: Vec::new(),
                    user: data,
                };
                let s = st.stream.clone().ok_or(libc::ENOTCONN)?;
                st.phase = Phase::Accepting;
                // The ready mark goes with the answer: a program without a queue pair of ours
                // has moved its own to RTS (rdma_init_qp_attr) before accepting, as rdma_cm
                // requires; the active side's mark then makes it ESTABLISHED.
                if let Err(e) = link::write_info(&s, &info).and_then(|()| link::write_ready(&s)) {
                    st.phase = Phase::Over;
                    id.post(&st, &Event::plain(sys::RDMA_CM_EVENT_CONNECT_ERROR, -e));
                }
            }
        }
        complete(&id)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_reject(
    id: *mut sys::rdma_cm_id,
    private_data: *const c_void,
    private_data_len: u8,
) -> c_int {
    call(|| {
        // SAFETY: the program's live identifier and private data (the C contract).
        let (id, data) = unsafe {
            (
                Id::of(id)?,
                private(private_data, private_data_len, REJECT_PRIVATE)?,
            )
        };
        let mut st = id.lock();
        if st.phase != Phase::Request {
            return Err(libc::EINVAL);
        }
        st.phase = Phase::Over;
        if let Some(s) = st.stream.take() {
            let refusal = erdma::connect::PeerInfo {
                user: data,
                ..Default::default()
            };
            let _ = link::write_info(&s, &refusal);
            let _ = s.shutdown(Shutdown::Both);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_establish(id: *mut sys::rdma_cm_id) -> c_int {
    call(|| {
        // SAFETY: the program's live identifier (the C contract).
        let id = unsafe { Id::of(id)? };
        let mut st = id.lock();
        match st.phase {
            // The active side without a queue pair of ours, its own now in RTS: ready.
            Phase::Responded => {
                let s = st.stream.clone().ok_or(libc::ENOTCONN)?;
                link::write_ready(&s)?;
                st.phase = Phase::Connected;
                Ok(())
            }
            // The passive side said ready when it accepted.
            Phase::Accepting | Phase::Connected => Ok(()),
            _ => Err(libc::EINVAL),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_disconnect(id: *mut sys::rdma_cm_id) -> c_int {
    call(|| {
        // SAFETY: the program's live identifier (the C contract).
        let id = unsafe { Id::of(id)? };
        {
            let mut st = id.lock();
            let s = match (st.phase, st.stream.clone()) {
                (Phase::Connected | Phase::Accepting | Phase::Responded, Some(s)) => s,
                // The peer left first (DISCONNECTED is posted): as rdma_cm, the queue pair
                // still goes to the error state, and the call succeeds.
                (Phase::Over, _) if st.disconnected_posted => {
                    let _ = move_qp(&id, &st, &[sys::IBV_QPS_ERR]);
                    return Ok(());
                }
                _ => return Err(libc::EINVAL),
            };
            // As librdmacm: the queue pair goes to the error state first (its work flushes).
            let _ = move_qp(&id, &st, &[sys::IBV_QPS_ERR]);
            if st.disconnecting.is_none() {
                st.disconnecting = Some(std::time::Instant::now());
                let _ = s.shutdown(Shutdown::Write);
            }
        }
        complete(&id)
    })
}

/// Creates completion channels and queues for an identifier whose program gave none.
fn own_cqs(id: &Id, attr: &mut sys::ibv_qp_init_attr) -> Result<bool, c_int> {
    if !attr.send_cq.is_null() && !attr.recv_cq.is_null() {
        return Ok(false);
    }
    let lib = verbs()?;
    // SAFETY: reads of the identifier's struct (see `Id`).
    let ctx = unsafe { (*id.c()).verbs };
    let make = |depth: u32| -> Result<(*mut sys::ibv_comp_channel, *mut sys::ibv_cq), c_int> {
        // SAFETY: an open context.
        let ch = unsafe { (lib.ibv_create_comp_channel)(ctx) };
        if ch.is_null() {
            return Err(last_errno());
        }
        // SAFETY: as above; the identifier is the CQ's context, as rdma_get_*_comp expect.
        let cq = unsafe { (lib.ibv_create_cq)(ctx, depth.max(1) as c_int, id.c().cast(), ch, 0) };
        if cq.is_null() {
            let e = last_errno();
            // SAFETY: the channel made above, unused.
            unsafe { (lib.ibv_destroy_comp_channel)(ch) };
            return Err(e);
        }
        Ok((ch, cq))
    };
    let (rch, rcq) = make(attr.cap.max_recv_wr)?;
    let (sch, scq) = match make(attr.cap.max_send_wr) {
        Ok(v) => v,
        Err(e) => {
            // SAFETY: the queue and channel made above, unused.
            unsafe {
                (lib.ibv_destroy_cq)(rcq);
                (lib.ibv_destroy_comp_channel)(rch);
            }
            return Err(e);
        }
    };
    // SAFETY: writes of the identifier's struct by its creator (see `Id`).
    unsafe {
        let c = &mut *id.c();
        c.recv_cq_channel = rch;
        c.recv_cq = rcq;
        c.send_cq_channel = sch;
        c.send_cq = scq;
    }
    attr.send_cq = scq;
    attr.recv_cq = rcq;
    Ok(true)
}

/// Destroys the completion queues and channels [`own_cqs`] made.
fn free_own_cqs(id: &Id) {
    let Ok(lib) = verbs() else { return };
    // SAFETY: the identifier's own struct; the objects were made by `own_cqs`, destroyed once.
    unsafe {
        let c = &mut *id.c();
        for cq in [
            std::mem::take(&mut c.send_cq),
            std::mem::take(&mut c.recv_cq),
        ] {
            if !cq.is_null() {
                (lib.ibv_destroy_cq)(cq);
            }
        }
        for ch in [
            std::mem::take(&mut c.send_cq_channel),
            std::mem::take(&mut c.recv_cq_channel),
        ] {
            if !ch.is_null() {
                (lib.ibv_destroy_comp_channel)(ch);
            }
        }
    }
}

/// `rdma_create_qp` on a live identifier.
pub(crate) fn create_qp(
    id: &Arc<Id>,
    pd: *mut sys::ibv_pd,
    attr: &mut sys::ibv_qp_init_attr,
) -> Result<(), c_int> {
    let lib = verbs()?;
    let mut st = id.lock();
    // SAFETY: reads of the identifier's struct (see `Id`).
    let (ctx, id_pd) = unsafe { ((*id.c()).verbs, (*id.c()).pd) };
    if ctx.is_null() || !id.qp().is_null() {
        return Err(libc::EINVAL);
    }
    let pd = if pd.is_null() { id_pd } else { pd };
    // SAFETY: a program's PD is live (the C contract).
    if pd.is_null() || unsafe { (*pd).context } != ctx {
        return Err(libc::EINVAL);
    }
    if attr.qp_type != sys::IBV_QPT_RC {
        return Err(libc::EOPNOTSUPP);
    }
    let own = own_cqs(id, attr)?;
    // SAFETY: a live PD and a valid attribute struct.
    let qp = unsafe { (lib.ibv_create_qp)(pd, attr) };
    if qp.is_null() {
        let e = last_errno();
        if own {
            free_own_cqs(id);
        }
        return Err(e);
    }
    id.with_c(&st, |c| c.qp = qp);
    st.own_cqs = own;
    if let Err(e) = move_qp(id, &st, &[sys::IBV_QPS_INIT]) {
        id.with_c(&st, |c| c.qp = std::ptr::null_mut());
        // SAFETY: the queue pair made above, not yet the program's.
        unsafe { (lib.ibv_destroy_qp)(qp) };
        if own {
            free_own_cqs(id);
        }
        return Err(e);
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_create_qp(
    id: *mut sys::rdma_cm_id,
    pd: *mut sys::ibv_pd,
    qp_init_attr: *mut sys::ibv_qp_init_attr,
) -> c_int {
    call(|| {
        if qp_init_attr.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: the program's live identifier and attributes (the C contract).
        let (id, attr) = unsafe { (Id::of(id)?, &mut *qp_init_attr) };
        create_qp(&id, pd, attr)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_create_qp_ex(
    id: *mut sys::rdma_cm_id,
    attr: *mut sys::ibv_qp_init_attr_ex,
) -> c_int {
    call(|| {
        if attr.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: the program's live identifier and attributes (the C contract).
        let (id, a) = unsafe { (Id::of(id)?, &mut *attr) };
        let pd_bit = sys::ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0;
        if a.comp_mask & !pd_bit != 0 {
            return Err(libc::EOPNOTSUPP);
        }
        let mut basic = sys::ibv_qp_init_attr {
            qp_context: a.qp_context,
            send_cq: a.send_cq,
            recv_cq: a.recv_cq,
            srq: a.srq,
            cap: a.cap,
            qp_type: a.qp_type,
            sq_sig_all: a.sq_sig_all,
        };
        let pd = if a.comp_mask & pd_bit != 0 {
            a.pd
        } else {
            std::ptr::null_mut()
        };
        create_qp(&id, pd, &mut basic)?;
        a.cap = basic.cap;
        Ok(())
    })
}

/// `rdma_destroy_qp` on a live identifier.
pub(crate) fn destroy_qp(id: &Id) {
    let mut st = id.lock();
    let qp = id.with_c(&st, |c| std::mem::replace(&mut c.qp, std::ptr::null_mut()));
    if !qp.is_null() {
        if let Ok(lib) = verbs() {
            // SAFETY: the identifier's queue pair, destroyed once.
            unsafe { (lib.ibv_destroy_qp)(qp) };
        }
    }
    if std::mem::take(&mut st.own_cqs) {
        free_own_cqs(id);
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_destroy_qp(id: *mut sys::rdma_cm_id) {
    let _ = call(|| {
        // SAFETY: the program's live identifier (the C contract).
        let id = unsafe { Id::of(id)? };
        destroy_qp(&id);
        Ok(())
    });
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_init_qp_attr(
    id: *mut sys::rdma_cm_id,
    qp_attr: *mut sys::ibv_qp_attr,
    qp_attr_mask: *mut c_int,
) -> c_int {
    call(|| {
        if qp_attr.is_null() || qp_attr_mask.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: the program's live identifier and out-parameters (the C contract).
        let (id, want) = unsafe { (Id::of(id)?, (*qp_attr).qp_state) };
        let st = id.lock();
        let (a, m) = id::qp_attr(&st, want)?;
        // SAFETY: valid out-parameters.
        unsafe {
            *qp_attr = a;
            *qp_attr_mask = m;
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_set_option(
    id: *mut sys::rdma_cm_id,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: usize,
) -> c_int {
    call(|| {
        // SAFETY: the program's live identifier (the C contract).
        let id = unsafe { Id::of(id)? };
        if optval.is_null() {
            return Err(libc::EINVAL);
        }
        let mut st = id.lock();
        match (level as u32, optname as u32) {
            (sys::RDMA_OPTION_ID, sys::RDMA_OPTION_ID_TOS) if optlen == 1 => {
                // SAFETY: one readable byte (the length the program gives).
                st.tos = unsafe { *optval.cast::<u8>() };
            }
            (sys::RDMA_OPTION_ID, sys::RDMA_OPTION_ID_REUSEADDR | sys::RDMA_OPTION_ID_AFONLY)
                if optlen == 4 =>
            {
                // SAFETY: a readable int.
                let v = unsafe { *optval.cast::<c_int>() };
                if optname as u32 == sys::RDMA_OPTION_ID_REUSEADDR {
                    st.reuseaddr = v != 0;
                }
            }
            (sys::RDMA_OPTION_ID, sys::RDMA_OPTION_ID_ACK_TIMEOUT) if optlen == 1 => {
                // SAFETY: one readable byte.
                st.ack_timeout = unsafe { *optval.cast::<u8>() }.min(31);
            }
            (sys::RDMA_OPTION_ID, _) => return Err(libc::EINVAL),
            // Path records are InfiniBand's: a RoCE soft device has none to set.
            (sys::RDMA_OPTION_IB, sys::RDMA_OPTION_IB_PATH) => return Err(libc::EOPNOTSUPP),
            _ => return Err(libc::EINVAL),
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_migrate_id(
    id: *mut sys::rdma_cm_id,
    channel: *mut sys::rdma_event_channel,
) -> c_int {
    call(|| {
        // SAFETY: the program's live identifier (the C contract).
        let id = unsafe { Id::of(id)? };
        let chan = ChanBox::of(channel)?;
        let mut st = id.lock();
        let (chan, cptr) = match chan {
            Some(c) => (c, channel),
            None => {
                let c = crate::channel::Chan::new()?;
                let p = c.boxed();
                (c, p.cast())
            }
        };
        id::free_sync(&id, &mut st);
        if channel.is_null() {
            st.own_chan = Some(cptr as usize);
        }
        st.chan = chan;
        id.with_c(&st, |c| c.channel = cptr);
        Ok(())
    })
}

fn port_of(id: *mut sys::rdma_cm_id, local: bool) -> u16 {
    // SAFETY: the program's live identifier (the C contract).
    match unsafe { Id::of(id) } {
        Ok(id) => {
            let st = id.lock();
            let a = if local { st.local } else { st.remote };
            a.map_or(0, |a| a.port().to_be())
        }
        Err(_) => 0,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_get_src_port(id: *mut sys::rdma_cm_id) -> u16 {
    crate::guard(0, || port_of(id, true))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_get_dst_port(id: *mut sys::rdma_cm_id) -> u16 {
    crate::guard(0, || port_of(id, false))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_notify(
    id: *mut sys::rdma_cm_id,
    _event: sys::ibv_event_type,
) -> c_int {
    // The soft device's connections need no notice of a first receive: nothing to do.
    call(|| {
        // SAFETY: the program's live identifier (the C contract).
        unsafe { Id::of(id) }.map(|_| ())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_get_devices(num_devices: *mut c_int) -> *mut *mut sys::ibv_context {
    crate::guard(std::ptr::null_mut(), || {
        let ctxs: Vec<_> = device::devices()
            .iter()
            .filter_map(|d| d.open().ok())
            .map(|o| o.ctx)
            .collect();
        // SAFETY: calloc of n+1 pointers, checked for NULL.
        let arr = unsafe { libc::calloc(ctxs.len() + 1, std::mem::size_of::<usize>()) }
            .cast::<*mut sys::ibv_context>();
        if arr.is_null() {
            crate::set_errno(libc::ENOMEM);
            return std::ptr::null_mut();
        }
        for (i, c) in ctxs.iter().enumerate() {
            // SAFETY: `arr` holds `ctxs.len() + 1` pointers.
            unsafe { *arr.add(i) = *c };
        }
        if !num_devices.is_null() {
            // SAFETY: a non-NULL out-parameter.
            unsafe { *num_devices = ctxs.len() as c_int };
        }
        arr
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_free_devices(list: *mut *mut sys::ibv_context) {
    // SAFETY: a list from rdma_get_devices (or NULL); the contexts stay open, as rdma-core's.
    unsafe { libc::free(list.cast()) };
}
