//! Identifiers: the program's `struct rdma_cm_id` followed by this library's state, the
//! addresses written into it, and the queue pair attributes of each step of a connection
//! (what `rdma_init_qp_attr` hands out and what this library applies itself).

use std::cell::UnsafeCell;
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::os::raw::c_int;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use erdma::{Gid, Mtu, QpEndpoint};
use erdma_sys as sys;

use crate::channel::{Chan, ChanBox, Event, EventBox};
use crate::device::{Dev, Opened, verbs};

/// Where an identifier is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Idle,
    Bound,
    AddrResolved,
    RouteResolved,
    Listening,
    /// Active: the exchange is under way.
    Connecting,
    /// Passive: a request waits for `rdma_accept` or `rdma_reject`.
    Request,
    /// Passive: accepted, waiting for the peer's ready mark.
    Accepting,
    /// Active, without a queue pair: waiting for `rdma_establish`.
    Responded,
    Connected,
    /// Rejected, refused, failed or disconnected: nothing more happens on it.
    Over,
}

/// The connection parameters this side asked for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Params {
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    /// `conn_param.qp_num`, for an identifier without a queue pair.
    pub qp_num: u32,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            responder_resources: 0,
            initiator_depth: 0,
            retry_count: 7,
            rnr_retry_count: 7,
            qp_num: 0,
        }
    }
}

impl Params {
    /// From a program's `rdma_conn_param`. As librdmacm: NULL, or `RDMA_MAX_RESP_RES` /
    /// `RDMA_MAX_INIT_DEPTH` (255), means the device's most (`max`: responder resources,
    /// initiator depth).
    ///
    /// # Safety
    /// `p` is NULL or valid for reads.
    pub(crate) unsafe fn from_c(p: *const sys::rdma_conn_param, max: (u8, u8)) -> Params {
        if p.is_null() {
            return Params {
                responder_resources: max.0,
                initiator_depth: max.1,
                ..Params::default()
            };
        }
        // SAFETY: the caller's contract.
        let p = unsafe { &*p };
        let or_max = |v: u8, m: u8| if v == u8::MAX { m } else { v };
        Params {
            responder_resources: or_max(p.responder_resources, max.0),
            initiator_depth: or_max(p.initiator_depth, max.1),
            retry_count: p.retry_count.min(7),
            rnr_retry_count: p.rnr_retry_count.min(7),
            qp_num: p.qp_num & 0xff_ffff,
        }
    }
}

pub(crate) struct State {
    pub chan: Arc<Chan>,
    /// The channel object of a synchronous identifier (made here, freed with it).
    pub own_chan: Option<usize>,
    pub phase: Phase,
    pub dev: Option<(&'static Dev, Opened)>,
    pub local: Option<SocketAddrV4>,
    pub remote: Option<SocketAddrV4>,
    /// A TCP socket bound by `rdma_bind_addr`, not yet listening.
    pub bound: Option<std::os::fd::OwnedFd>,
    /// The listening socket's descriptor (shut down to stop the listener thread).
    pub listen_fd: Option<c_int>,
    pub stream: Option<Arc<TcpStream>>,
    pub peer: Option<QpEndpoint>,
    pub local_psn: u32,
    pub params: Params,
    pub tos: u8,
    pub ack_timeout: u8,
    pub reuseaddr: bool,
    /// `local`'s port is held in this process's table of bound ports.
    pub reserved: bool,
    /// `rdma_create_ep`'s queue pair attributes of a passive identifier, for `rdma_get_request`.
    pub ep_attr: Option<sys::ibv_qp_init_attr>,
    /// The completion queues and channels `rdma_create_qp` made (destroyed with the QP).
    pub own_cqs: bool,
    /// The peer closed before this side answered its request.
    pub peer_gone: bool,
    /// `rdma_disconnect` was called (when).
    pub disconnecting: Option<Instant>,
    pub destroyed: bool,
    /// An ESTABLISHED/DISCONNECTED pair is posted at most once.
    pub disconnected_posted: bool,
}

/// An identifier: the program's struct first, so the program's pointer is this object's.
#[repr(C)]
pub(crate) struct Id {
    c: UnsafeCell<sys::rdma_cm_id>,
    st: Mutex<State>,
    /// Events the program took with `rdma_get_cm_event` and has not acknowledged
    /// ([`Id::wait_acked`]).
    unacked: Mutex<usize>,
    acked: std::sync::Condvar,
}

// SAFETY: the C struct is written by this library only under `st`'s lock, or before the
// identifier is handed out; the program's own writes (`context`, …) are its business, as with
// rdma-core. The raw pointers inside are libibverbs objects usable from any thread.
unsafe impl Send for Id {}
// SAFETY: as above.
unsafe impl Sync for Id {}

impl State {
    /// The device's most responder resources and initiator depth (0 before it has a device).
    pub(crate) fn rd_max(&self) -> (u8, u8) {
        self.dev
            .map_or((0, 0), |(_, o)| (o.max_rd_atom, o.max_init_rd_atom))
    }
}

impl Id {
    /// A new identifier on `chan` (or, with `None`, a synchronous one with a channel of its own).
    pub(crate) fn new(
        chan: Option<(Arc<Chan>, *mut sys::rdma_event_channel)>,
        context: *mut std::ffi::c_void,
        ps: sys::rdma_port_space,
    ) -> Result<Arc<Id>, c_int> {
        let (chan, cptr, own) = match chan {
            Some((c, p)) => (c, p, None),
            None => {
                let c = Chan::new()?;
                let p = c.boxed();
                (c, p.cast(), Some(p as usize))
            }
        };
        // SAFETY: `rdma_cm_id` is pointers, integers and unions of those: all zeroes is valid.
        let mut c: sys::rdma_cm_id = unsafe { std::mem::zeroed() };
        c.channel = cptr;
        c.context = context;
        c.ps = ps;
        c.port_num = 1;
        c.qp_type = sys::IBV_QPT_RC;
        Ok(Arc::new(Id {
            c: UnsafeCell::new(c),
            st: Mutex::new(State {
                chan,
                own_chan: own,
                phase: Phase::Idle,
                dev: None,
                local: None,
                remote: None,
                bound: None,
                listen_fd: None,
                stream: None,
                peer: None,
                local_psn: random_psn(),
                params: Params::default(),
                tos: 0,
                ack_timeout: 14,
                reuseaddr: false,
                reserved: false,
                ep_attr: None,
                own_cqs: false,
                peer_gone: false,
                disconnecting: None,
                destroyed: false,
                disconnected_posted: false,
            }),
            unacked: Mutex::new(0),
            acked: std::sync::Condvar::new(),
        }))
    }

    /// Counts an event of this identifier handed to the program.
    pub(crate) fn event_taken(&self) {
        *self.unacked.lock().unwrap_or_else(|e| e.into_inner()) += 1;
    }

    /// Counts an acknowledgement of an event [`Id::event_taken`] counted.
    pub(crate) fn event_acked(&self) {
        let mut n = self.unacked.lock().unwrap_or_else(|e| e.into_inner());
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.acked.notify_all();
        }
    }

    /// Waits, as rdma-core's `rdma_destroy_id` does, until the program has acknowledged every
    /// event of this identifier it took: an event thread is then back in `rdma_get_cm_event`
    /// (or past the event) before the caller goes on to destroy the channel. Unlike rdma-core,
    /// which waits for good, gives up after `limit`: a program that destroys an identifier
    /// before acknowledging its event goes on (the event keeps the identifier's memory).
    pub(crate) fn wait_acked(&self, limit: Duration) {
        let n = self.unacked.lock().unwrap_or_else(|e| e.into_inner());
        let _ = self
            .acked
            .wait_timeout_while(n, limit, |n| *n > 0)
            .unwrap_or_else(|e| e.into_inner());
    }

    /// The program's pointer.
    pub(crate) fn c(&self) -> *mut sys::rdma_cm_id {
        self.c.get()
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hands an identifier to the program (one reference, given back by [`Id::release`]).
    pub(crate) fn into_c(id: Arc<Id>) -> *mut sys::rdma_cm_id {
        let p = Arc::into_raw(id).cast_mut();
        live().insert(p as usize);
        p.cast()
    }

    /// The identifier behind a program's pointer (a new reference); `EINVAL` for NULL or a
    /// pointer that is not a live identifier (a destroyed one, say: rdma-core would fault).
    ///
    /// # Safety
    /// `p` is NULL or any pointer: only pointers handed out by [`Id::into_c`] and not yet
    /// given back are dereferenced.
    pub(crate) unsafe fn of(p: *mut sys::rdma_cm_id) -> Result<Arc<Id>, c_int> {
        let live = live();
        if !live.contains(&(p as usize)) {
            return Err(libc::EINVAL);
        }
        let p = p.cast_const().cast::<Id>();
        // SAFETY: `p` is a live identifier's pointer (checked above, under the lock that its
        // release takes), whose program reference keeps it alive while this one is made.
        unsafe {
            Arc::increment_strong_count(p);
            Ok(Arc::from_raw(p))
        }
    }

    /// Takes back the program's reference; `EINVAL` as [`Id::of`].
    ///
    /// # Safety
    /// As [`Id::of`].
    pub(crate) unsafe fn release(p: *mut sys::rdma_cm_id) -> Result<Arc<Id>, c_int> {
        if !live().remove(&(p as usize)) {
            return Err(libc::EINVAL);
        }
        // SAFETY: a live identifier's pointer (checked above), whose program reference this is.
        Ok(unsafe { Arc::from_raw(p.cast_const().cast::<Id>()) })
    }

    /// Posts an event for this identifier (unless it is destroyed) on its channel.
    pub(crate) fn post(self: &Arc<Id>, st: &State, ev: &Event<'_>) {
        if !st.destroyed {
            st.chan.post(ev.make(self, None));
        }
    }

    /// The queue pair the program made on this identifier (NULL: none).
    pub(crate) fn qp(&self) -> *mut sys::ibv_qp {
        // SAFETY: a read of the identifier's own struct (see the `Sync` argument).
        unsafe { (*self.c()).qp }
    }

    /// Writes a field of the program's struct.
    pub(crate) fn with_c<R>(&self, _st: &State, f: impl FnOnce(&mut sys::rdma_cm_id) -> R) -> R {
        // SAFETY: holding the state's lock (the witness `_st`) makes this the only writer.
        f(unsafe { &mut *self.c() })
    }

    /// Sets the identifier's device (its `verbs`, `pd`, and the GIDs of its route).
    pub(crate) fn set_device(&self, st: &mut State, dev: &'static Dev, o: Opened) {
        st.dev = Some((dev, o));
        self.with_c(st, |c| {
            c.verbs = o.ctx;
            if c.pd.is_null() {
                c.pd = o.pd;
            }
            c.route.addr.addr.ibaddr.sgid.raw = o.gid;
        });
    }

    /// Writes the route's source and destination addresses.
    pub(crate) fn set_addrs(&self, st: &mut State) {
        let (local, remote) = (st.local, st.remote);
        self.with_c(st, |c| {
            let write = |dst: *mut sys::sockaddr_storage, a: SocketAddrV4| {
                // SAFETY: `dst` is a 128-byte sockaddr_storage inside the identifier; a
                // sockaddr_in (16 bytes) fits at its start.
                unsafe {
                    std::ptr::write_bytes(
                        dst.cast::<u8>(),
                        0,
                        std::mem::size_of::<sys::sockaddr_storage>(),
                    );
                    dst.cast::<libc::sockaddr_in>()
                        .write_unaligned(sockaddr_in(a));
                }
            };
            if let Some(a) = local {
                write(&raw mut c.route.addr.__bindgen_anon_1.src_storage, a);
            }
            if let Some(a) = remote {
                write(&raw mut c.route.addr.__bindgen_anon_2.dst_storage, a);
                let gid = Gid::from_ipv4(*a.ip()).0;
                c.route.addr.addr.ibaddr.dgid.raw = gid;
            }
        });
    }

    /// This side's endpoint for the exchange.
    pub(crate) fn endpoint(&self, st: &State) -> Result<QpEndpoint, c_int> {
        let (_, o) = st.dev.ok_or(libc::EINVAL)?;
        let qp = self.qp();
        let qp_num = if qp.is_null() {
            st.params.qp_num
        } else {
            // SAFETY: the program's live queue pair.
            unsafe { (*qp).qp_num }
        };
        Ok(QpEndpoint {
            qp_num,
            psn: st.local_psn,
            gid: Gid(o.gid),
            lid: 0,
            mtu: Mtu::from_enum(o.active_mtu).unwrap_or(Mtu::Mtu1024),
        })
    }
}

/// The identifiers the program holds.
fn live() -> MutexGuard<'static, std::collections::BTreeSet<usize>> {
    static LIVE: Mutex<std::collections::BTreeSet<usize>> =
        Mutex::new(std::collections::BTreeSet::new());
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// A `struct sockaddr_in` of an IPv4 address and port.
pub(crate) fn sockaddr_in(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// An IPv4 address (and port) out of a program's `struct sockaddr`: NULL → `None`; IPv4 or an
/// IPv4-mapped IPv6 address; anything else `EAFNOSUPPORT` (the soft device is IPv4).
///
/// # Safety
/// `p` is NULL or points to a sockaddr of its family's size.
pub(crate) unsafe fn sockaddr_v4(p: *const sys::sockaddr) -> Result<Option<SocketAddrV4>, c_int> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: every sockaddr starts with its family (the caller's contract).
    let family = unsafe { (*p.cast::<libc::sockaddr>()).sa_family } as c_int;
    match family {
        libc::AF_INET => {
            // SAFETY: an AF_INET sockaddr is a sockaddr_in.
            let s = unsafe { p.cast::<libc::sockaddr_in>().read_unaligned() };
            Ok(Some(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr)),
                u16::from_be(s.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: an AF_INET6 sockaddr is a sockaddr_in6.
            let s = unsafe { p.cast::<libc::sockaddr_in6>().read_unaligned() };
            let ip = std::net::Ipv6Addr::from(s.sin6_addr.s6_addr);
            if ip.is_unspecified() {
                return Ok(Some(SocketAddrV4::new(
                    Ipv4Addr::UNSPECIFIED,
                    u16::from_be(s.sin6_port),
                )));
            }
            ip.to_ipv4_mapped()
                .map(|v4| Some(SocketAddrV4::new(v4, u16::from_be(s.sin6_port))))
                .ok_or(libc::EAFNOSUPPORT)
        }
        _ => Err(libc::EAFNOSUPPORT),
    }
}

/// A random 24-bit packet sequence number.
fn random_psn() -> u32 {
    let mut v = 0u32;
    // SAFETY: fills the 4 bytes of `v`.
    let n = unsafe { libc::getrandom((&raw mut v).cast(), 4, 0) };
    if n != 4 {
        v = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0x5a5a5a, |d| d.subsec_nanos());
    }
    v & 0xff_ffff
}

/// The bits of `enum ibv_qp_attr_mask` as the C `int` `ibv_modify_qp` takes.
const fn mask(m: sys::ibv_qp_attr_mask) -> c_int {
    m.0 as c_int
}

/// The attributes that move an identifier's queue pair to `state` (`rdma_init_qp_attr`).
pub(crate) fn qp_attr(
    st: &State,
    state: sys::ibv_qp_state,
) -> Result<(sys::ibv_qp_attr, c_int), c_int> {
    use sys::ibv_qp_attr_mask as M;
    let (_, o) = st.dev.ok_or(libc::EINVAL)?;
    // SAFETY: `ibv_qp_attr` is integers and nested plain structs: all zeroes is valid.
    let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = state;
    let p = st.params;
    let access = sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
        | if p.responder_resources > 0 {
            sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0
                | sys::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0
        } else {
            0
        };
    let m = match state {
        sys::IBV_QPS_INIT => {
            a.pkey_index = 0;
            a.port_num = 1;
            a.qp_access_flags = access;
            mask(M::IBV_QP_STATE)
                | mask(M::IBV_QP_PKEY_INDEX)
                | mask(M::IBV_QP_PORT)
                | mask(M::IBV_QP_ACCESS_FLAGS)
        }
        sys::IBV_QPS_RTR => {
            let peer = st.peer.ok_or(libc::EINVAL)?;
            a.path_mtu = o.active_mtu.min(peer.mtu.as_enum());
            a.dest_qp_num = peer.qp_num;
            a.rq_psn = peer.psn;
            a.max_dest_rd_atomic = p.responder_resources.min(o.max_rd_atom);
            a.min_rnr_timer = 12;
            a.qp_access_flags = access;
            a.ah_attr.is_global = 1;
            a.ah_attr.port_num = 1;
            a.ah_attr.dlid = peer.lid;
            a.ah_attr.grh.dgid.raw = peer.gid.0;
            a.ah_attr.grh.sgid_index = 1;
            a.ah_attr.grh.hop_limit = 64;
            a.ah_attr.grh.traffic_class = st.tos;
            mask(M::IBV_QP_STATE)
                | mask(M::IBV_QP_AV)
                | mask(M::IBV_QP_PATH_MTU)
                | mask(M::IBV_QP_DEST_QPN)
                | mask(M::IBV_QP_RQ_PSN)
                | mask(M::IBV_QP_MAX_DEST_RD_ATOMIC)
                | mask(M::IBV_QP_MIN_RNR_TIMER)
                | mask(M::IBV_QP_ACCESS_FLAGS)
        }
        sys::IBV_QPS_RTS => {
            a.sq_psn = st.local_psn;
            a.timeout = st.ack_timeout;
            a.retry_cnt = p.retry_count;
            a.rnr_retry = p.rnr_retry_count;
            a.max_rd_atomic = p.initiator_depth.min(o.max_init_rd_atom);
            mask(M::IBV_QP_STATE)
                | mask(M::IBV_QP_SQ_PSN)
                | mask(M::IBV_QP_TIMEOUT)
                | mask(M::IBV_QP_RETRY_CNT)
                | mask(M::IBV_QP_RNR_RETRY)
                | mask(M::IBV_QP_MAX_QP_RD_ATOMIC)
        }
        sys::IBV_QPS_ERR | sys::IBV_QPS_RESET => mask(M::IBV_QP_STATE),
        _ => return Err(libc::EINVAL),
    };
    Ok((a, m))
}

/// Moves the identifier's queue pair (when it has one) through `states`.
pub(crate) fn move_qp(id: &Id, st: &State, states: &[sys::ibv_qp_state]) -> Result<(), c_int> {
    let qp = id.qp();
    if qp.is_null() {
        return Ok(());
    }
    let lib = verbs()?;
    for &s in states {
        let (mut a, m) = qp_attr(st, s)?;
        // SAFETY: the program's live queue pair and a valid attribute struct.
        match unsafe { (lib.ibv_modify_qp)(qp, &mut a, m) } {
            0 => {}
            e => return Err(e),
        }
    }
    Ok(())
}

/// Waits, on a synchronous identifier, for the event that ends the call just made, and keeps it
/// in `id->event` (acknowledging the one before); its status becomes the call's errno.
pub(crate) fn complete(id: &Arc<Id>) -> Result<(), c_int> {
    let chan = {
        let st = id.lock();
        if st.own_chan.is_none() {
            return Ok(());
        }
        st.chan.clone()
    };
    // SAFETY: the identifier's own field; its previous event was handed out by this function.
    let prev = unsafe { std::mem::replace(&mut (*id.c()).event, std::ptr::null_mut()) };
    if !prev.is_null() {
        // SAFETY: an event this function took and kept; freed once.
        unsafe { crate::channel::free_event(prev) };
    }
    let ev: *mut EventBox = chan.take()?;
    // SAFETY: the event just taken; it is kept in the identifier until the next call.
    let (kind, status) = unsafe {
        (*id.c()).event = ev.cast();
        ((*ev).ev.event, (*ev).ev.status)
    };
    if status == 0 {
        Ok(())
    } else if kind == sys::RDMA_CM_EVENT_REJECTED {
        Err(libc::ECONNREFUSED)
    } else {
        Err(status.abs())
    }
}

/// Frees what a synchronous identifier owns: its last event and its channel object.
pub(crate) fn free_sync(id: &Id, st: &mut State) {
    // SAFETY: the identifier's own field, an event `complete` kept (or NULL).
    let ev = unsafe { std::mem::replace(&mut (*id.c()).event, std::ptr::null_mut()) };
    if !ev.is_null() && st.own_chan.is_some() {
        // SAFETY: as above; freed once.
        unsafe { crate::channel::free_event(ev) };
    }
    if let Some(p) = st.own_chan.take() {
        // SAFETY: the channel object made for this identifier, not handed to the program.
        unsafe { ChanBox::free(p as *mut ChanBox) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opened() -> Opened {
        Opened {
            ctx: std::ptr::null_mut(),
            pd: std::ptr::null_mut(),
            gid: Gid::from_ipv4(Ipv4Addr::new(127, 0, 0, 1)).0,
            active_mtu: sys::IBV_MTU_4096,
            max_rd_atom: 16,
            max_init_rd_atom: 8,
        }
    }

    fn state() -> State {
        let id = Id::new(None, std::ptr::null_mut(), sys::RDMA_PS_TCP).unwrap();
        free_sync(&id, &mut id.lock());
        Arc::try_unwrap(id).ok().unwrap().st.into_inner().unwrap()
    }

    #[test]
    fn params_default_to_the_device_most() {
        // SAFETY: NULL is allowed.
        let p = unsafe { Params::from_c(std::ptr::null(), (16, 8)) };
        assert_eq!(
            (p.responder_resources, p.initiator_depth, p.retry_count),
            (16, 8, 7)
        );
        // SAFETY: `rdma_conn_param` is plain data: zeroes are valid.
        let mut c: sys::rdma_conn_param = unsafe { std::mem::zeroed() };
        c.responder_resources = 255;
        c.initiator_depth = 1;
        c.retry_count = 9;
        c.qp_num = 0x1234_5678;
        // SAFETY: a live struct.
        let p = unsafe { Params::from_c(&c, (16, 8)) };
        assert_eq!((p.responder_resources, p.initiator_depth), (16, 1));
        assert_eq!((p.retry_count, p.qp_num), (7, 0x34_5678));
    }

    #[test]
    fn qp_attributes_follow_the_exchange() {
        let mut st = state();
        assert_eq!(qp_attr(&st, sys::IBV_QPS_INIT).err(), Some(libc::EINVAL)); // no device
        // The device table is process-wide; a test device needs no entry in it.
        static DEV: std::sync::OnceLock<Dev> = std::sync::OnceLock::new();
        let dev = DEV.get_or_init(|| Dev::for_test(Ipv4Addr::LOCALHOST));
        st.dev = Some((dev, opened()));
        st.params = Params {
            responder_resources: 4,
            initiator_depth: 32,
            ..Params::default()
        };
        assert_eq!(qp_attr(&st, sys::IBV_QPS_RTR).err(), Some(libc::EINVAL)); // no peer yet
        st.peer = Some(QpEndpoint {
            qp_num: 0x42,
            psn: 0x0a0b0c,
            gid: Gid::from_ipv4(Ipv4Addr::new(127, 0, 0, 2)),
            lid: 0,
            mtu: Mtu::Mtu1024,
        });
        let (init, _) = qp_attr(&st, sys::IBV_QPS_INIT).unwrap();
        let read = sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        assert_ne!(init.qp_access_flags & read, 0);
        let (rtr, m) = qp_attr(&st, sys::IBV_QPS_RTR).unwrap();
        assert_eq!((rtr.dest_qp_num, rtr.rq_psn), (0x42, 0x0a0b0c));
        assert_eq!(rtr.path_mtu, sys::IBV_MTU_1024); // the smaller of the two
        assert_eq!(rtr.max_dest_rd_atomic, 4);
        // SAFETY: reading the raw bytes of a GID union.
        assert_eq!(unsafe { rtr.ah_attr.grh.dgid.raw }[12..], [127, 0, 0, 2]);
        assert_ne!(m & mask(sys::ibv_qp_attr_mask::IBV_QP_DEST_QPN), 0);
        let (rts, _) = qp_attr(&st, sys::IBV_QPS_RTS).unwrap();
        assert_eq!(rts.sq_psn, st.local_psn);
        assert_eq!(rts.max_rd_atomic, 8); // clamped to the device's initiator depth
        st.params.responder_resources = 0;
        let (init, _) = qp_attr(&st, sys::IBV_QPS_INIT).unwrap();
        assert_eq!(
            init.qp_access_flags & read,
            0,
            "no responder resources, no remote read"
        );
        assert_eq!(qp_attr(&st, sys::IBV_QPS_SQD).err(), Some(libc::EINVAL));
    }

    #[test]
    fn sockaddrs() {
        let a = SocketAddrV4::new(Ipv4Addr::new(10, 1, 2, 3), 7471);
        let sin = sockaddr_in(a);
        // SAFETY: a live sockaddr_in.
        let back = unsafe { sockaddr_v4((&raw const sin).cast()) };
        assert_eq!(back, Ok(Some(a)));
        // SAFETY: NULL is allowed.
        assert_eq!(unsafe { sockaddr_v4(std::ptr::null()) }, Ok(None));
        // SAFETY: zeroes are a valid sockaddr_in6.
        let mut v6: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
        v6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
        v6.sin6_addr.s6_addr = std::net::Ipv6Addr::LOCALHOST.octets();
        // SAFETY: a live sockaddr_in6.
        let r = unsafe { sockaddr_v4((&raw const v6).cast()) };
        assert_eq!(r, Err(libc::EAFNOSUPPORT));
        v6.sin6_addr.s6_addr = Ipv4Addr::new(127, 0, 0, 1).to_ipv6_mapped().octets();
        v6.sin6_port = 80u16.to_be();
        // SAFETY: as above.
        let r = unsafe { sockaddr_v4((&raw const v6).cast()) };
        assert_eq!(r, Ok(Some(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 80))));
    }

    #[test]
    fn a_destroyed_identifier_is_refused() {
        let id = Id::new(None, std::ptr::null_mut(), sys::RDMA_PS_TCP).unwrap();
        let p = Id::into_c(id);
        // SAFETY: a live identifier's pointer.
        assert!(unsafe { Id::of(p) }.is_ok());
        // SAFETY: given back once.
        let id = unsafe { Id::release(p) }.unwrap();
        free_sync(&id, &mut id.lock());
        drop(id);
        // SAFETY: any pointer is checked before use.
        assert_eq!(unsafe { Id::of(p) }.err(), Some(libc::EINVAL));
        // SAFETY: as above.
        assert_eq!(unsafe { Id::release(p) }.err(), Some(libc::EINVAL));
        // SAFETY: as above.
        let r = unsafe { Id::of(std::ptr::null_mut()) };
        assert_eq!(r.err(), Some(libc::EINVAL));
    }
}
