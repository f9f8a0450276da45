//! The rdma_cm path: event channels with deadlines, identifiers that outlive the queue pairs and
//! contexts that depend on them, queue pairs moved with the attributes rdma_cm computes, and the
//! private data that carries the [`PeerInfo`].

#![allow(unsafe_code)] // librdmacm through FFI

use std::any::Any;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use erdma_sys as sys;

use super::iwarp::{self, ConnectCall, Detach};
use super::private::{decode_private, encode_private, private_limit, reject_reason};
use super::watch::Ended;
use super::{
    Connection, IB_REJECT_PRIVATE_DATA, IWARP_PRIVATE_DATA, Link, Options, REJECT_TAG, RETRY_COUNT,
    RNR_RETRY_COUNT, Setup, remaining,
};
use crate::connect::PeerInfo;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::provider::CtxImpl;
use crate::provider::verbs::VerbsCtx;
use crate::qp::{Init, Qp};
use crate::vocab::Access;
use crate::vocab::PeerLoss;
use crate::vocab::Transport;

/// One event, copied out of librdmacm and already acknowledged.
struct Event {
    kind: sys::rdma_cm_event_type,
    status: c_int,
    id: *mut sys::rdma_cm_id,
    private: Vec<u8>,
    responder_resources: u8,
    initiator_depth: u8,
}

/// An event channel (its fd non-blocking), destroyed on drop.
pub(super) struct Channel {
    cm: &'static sys::RdmaCm,
    raw: *mut sys::rdma_event_channel,
}

impl Channel {
    pub(super) fn new(cm: &'static sys::RdmaCm) -> Result<Channel> {
        // SAFETY: no arguments; returns NULL with errno set on failure.
        let raw = unsafe { (cm.rdma_create_event_channel)() };
        if raw.is_null() {
            return Err(Error::last_os("rdma_create_event_channel"));
        }
        let ch = Channel { cm, raw };
        let fd = ch.fd();
        // SAFETY: fcntl on the channel's open descriptor.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above; a non-blocking fd lets every wait have a deadline.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(Error::last_os(
                "fcntl(O_NONBLOCK) on an rdma_cm event channel",
            ));
        }
        Ok(ch)
    }

    fn fd(&self) -> c_int {
        // SAFETY: the channel is live while `self` is.
        unsafe { (*self.raw).fd }
    }

    /// The next event, waiting until `deadline`.
    fn next(&self, deadline: Instant, what: &str) -> Result<Event> {
        loop {
            let mut ev: *mut sys::rdma_cm_event = std::ptr::null_mut();
            // SAFETY: the channel is live and non-blocking; `ev` is a valid out-parameter.
            let rc = unsafe { (self.cm.rdma_get_cm_event)(self.raw, &mut ev) };
            if rc == 0 && !ev.is_null() {
                // The connection parameters are meaningful for the connection events, whose private
                // data pointer (when not NULL) covers `private_data_len` bytes inside the event.
                // SAFETY: `ev` is a live event until acknowledged below; reads stay inside it.
                let event = unsafe {
                    let e = &*ev;
                    let conn_event = matches!(
                        e.event,
                        sys::RDMA_CM_EVENT_CONNECT_REQUEST
                            | sys::RDMA_CM_EVENT_CONNECT_RESPONSE
                            | sys::RDMA_CM_EVENT_ESTABLISHED
                            | sys::RDMA_CM_EVENT_REJECTED
                    );
                    let conn = e.param.conn;
                    let private = if conn_event
                        && !conn.private_data.is_null()
                        && conn.private_data_len > 0
                    {
                        std::slice::from_raw_parts(
                            conn.private_data.cast::<u8>(),
                            conn.private_data_len as usize,
                        )
                        .to_vec()
                    } else {
                        Vec::new()
                    };
                    Event {
                        kind: e.event,
                        status: e.status,
                        id: e.id,
                        private,
                        responder_resources: if conn_event {
                            conn.responder_resources
                        } else {
                            0
                        },
                        initiator_depth: if conn_event { conn.initiator_depth } else { 0 },
                    }
                };
                // SAFETY: acknowledged once; nothing of it is used afterwards.
                unsafe { (self.cm.rdma_ack_cm_event)(ev) };
                return Ok(event);
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => {}
                _ => {
                    return Err(Error::Verb {
                        verb: "rdma_get_cm_event",
                        source: e,
                    });
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: what.to_string(),
                });
            }
            let mut pfd = libc::pollfd {
                fd: self.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as c_int;
            // SAFETY: one valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut pfd, 1, ms) };
        }
    }

    fn event_name(&self, kind: sys::rdma_cm_event_type) -> String {
        // SAFETY: returns a static string for any value.
        let p = unsafe { (self.cm.rdma_event_str)(kind) };
        if p.is_null() {
            return format!("event {kind}");
        }
        // SAFETY: a NUL-terminated static string.
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // Identifiers' owners hold the channel and destroy their identifier first.
        // SAFETY: no identifier on the channel is left; the channel is destroyed once.
        unsafe { (self.cm.rdma_destroy_event_channel)(self.raw) };
    }
}

/// An rdma_cm identifier with its own event channel.
pub(super) struct CmId {
    pub(super) cm: &'static sys::RdmaCm,
    pub(super) raw: *mut sys::rdma_cm_id,
    /// Serialises readers of the channel.
    channel: Mutex<Channel>,
    disconnected: AtomicBool,
}

// SAFETY: librdmacm's calls on an identifier are thread-safe; event reading is serialised by the
// channel's mutex; the raw pointer is owned by this value alone and destroyed once.
unsafe impl Send for CmId {}
// SAFETY: as above.
unsafe impl Sync for CmId {}
// SAFETY: the channel is only used through `CmId`, which serialises it.
unsafe impl Send for Channel {}

impl CmId {
    fn create(cm: &'static sys::RdmaCm) -> Result<Arc<CmId>> {
        let channel = Channel::new(cm)?;
        let mut raw: *mut sys::rdma_cm_id = std::ptr::null_mut();
        // SAFETY: the channel is live; `raw` is a valid out-parameter.
        let rc = unsafe {
            (cm.rdma_create_id)(
                channel.raw,
                &mut raw,
                std::ptr::null_mut(),
                sys::RDMA_PS_TCP,
            )
        };
        if rc != 0 || raw.is_null() {
            return Err(Error::last_os("rdma_create_id"));
        }
        Ok(Arc::new(CmId {
            cm,
            raw,
            channel: Mutex::new(channel),
            disconnected: AtomicBool::new(false),
        }))
    }

    fn next(&self, deadline: Instant, what: &str) -> Result<Event> {
        self.channel
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .next(deadline, what)
    }

    fn event_name(&self, kind: sys::rdma_cm_event_type) -> String {
        self.channel
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .event_name(kind)
    }

    pub(super) fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: the identifier is live; the address lives inside it.
        from_sockaddr(unsafe { sys::rdma_get_local_addr(self.raw) })
    }

    fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as above.
        from_sockaddr(unsafe { sys::rdma_get_peer_addr(self.raw) })
    }

    /// `rdma_disconnect`, once.
    pub(super) fn disconnect_now(&self) {
        if !self.disconnected.swap(true, Ordering::AcqRel) {
            // SAFETY: the identifier is live. Failure (never connected) leaves nothing to undo.
            unsafe { (self.cm.rdma_disconnect)(self.raw) };
        }
    }

    /// Watches a connected identifier until DISCONNECTED (answered at once) or DEVICE_REMOVAL:
    /// a lost peer unless `closing` says this side disconnected first. Stops, as a local end,
    /// once `stopped` says so (checked every 50 ms). The connection's only event reader.
    pub(super) fn watch_disconnect(
        &self,
        stopped: &dyn Fn() -> bool,
        closing: &dyn Fn() -> bool,
    ) -> Ended {
        let end = |closing: &dyn Fn() -> bool| {
            if closing() {
                Ended::Local
            } else {
                Ended::Peer(PeerLoss::Disconnected)
            }
        };
        loop {
            let tick = Instant::now() + std::time::Duration::from_millis(50);
            match self.next(tick, "DISCONNECTED") {
                Ok(ev) => match ev.kind {
                    sys::RDMA_CM_EVENT_DISCONNECTED | sys::RDMA_CM_EVENT_DEVICE_REMOVAL => {
                        self.disconnect_now();
                        return end(closing);
                    }
                    _ => {}
                },
                Err(Error::Timeout { .. }) => {
                    if stopped() {
                        return Ended::Local;
                    }
                }
                // The channel failed: nothing more can be learnt from it.
                Err(_) => return end(closing),
            }
        }
    }

    /// Rejects a connection request (or a response), with `reason` for the peer. Best effort.
    fn reject(&self, transport: Transport, reason: &str) {
        let limit = if transport == Transport::Iwarp {
            IWARP_PRIVATE_DATA
        } else {
            IB_REJECT_PRIVATE_DATA
        };
        let mut data = REJECT_TAG.to_vec();
        data.extend_from_slice(reason.as_bytes());
        data.truncate(limit);
        // SAFETY: the identifier is live; the data outlives the call.
        unsafe {
            (self.cm.rdma_reject)(self.raw, data.as_ptr().cast(), data.len() as u8);
        }
    }

    fn transport(&self) -> Transport {
        // SAFETY: the identifier is live; `verbs` is NULL or a live context with its device.
        unsafe {
            let verbs = (*self.raw).verbs;
            if verbs.is_null() {
                return Transport::Ib;
            }
            match (*(*verbs).device).transport_type {
                1 => Transport::Iwarp,
                _ => Transport::Ib,
            }
        }
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // Every queue pair that depends on the identifier holds it, so none is left, and every
        // event was acknowledged when read.
        // SAFETY: destroyed once, with nothing depending on it, before its channel (a field).
        unsafe { (self.cm.rdma_destroy_id)(self.raw) };
    }
}

/// The [`Context`] of the device an identifier resolved to; it keeps the identifier alive.
fn cm_context(id: &Arc<CmId>, options: &Options) -> Result<Context> {
    // SAFETY: the identifier is live; `verbs` is set once the address is bound or resolved.
    let verbs = unsafe { (*id.raw).verbs };
    if verbs.is_null() {
        return Err(Error::protocol("rdma_cm resolved the address to no device"));
    }
    let anchor: Arc<dyn Any + Send + Sync> = id.clone();
    // SAFETY: librdmacm keeps `verbs` open while the identifier (held by the anchor) lives.
    let (imp, name) = unsafe { VerbsCtx::borrowed(verbs, anchor)? };
    if let Some(want) = &options.device {
        if *want != name {
            return Err(Error::invalid(format!(
                "the address resolves to RDMA device {name}, not {want}"
            )));
        }
    }
    Context::from_imp(CtxImpl::from_verbs(imp), name, options.open_options())
}

/// The connection parameters both sides send (in `rdma_connect` and `rdma_accept`): our private
/// data, read depths, the retry counts and the queue pair. `private` must outlive the call that
/// takes the result (librdmacm copies it there); its length fits a `u8` (`encode_private` caps it).
pub(super) fn conn_param(private: &[u8], resp: u8, init: u8, qp_num: u32) -> sys::rdma_conn_param {
    // SAFETY: a zeroed rdma_conn_param (null pointer, zero counts) is a valid value.
    let mut param: sys::rdma_conn_param = unsafe { std::mem::zeroed() };
    param.private_data = private.as_ptr().cast();
    param.private_data_len = private.len() as u8;
    param.responder_resources = resp;
    param.initiator_depth = init;
    param.flow_control = 1;
    param.retry_count = RETRY_COUNT;
    param.rnr_retry_count = RNR_RETRY_COUNT;
    param.qp_num = qp_num;
    param
}

/// READ/atomic depths this side offers: (responder resources, initiator depth), the device's
/// limits up to 16 (as [`crate::ConnectOptions`] defaults), 0 where the device allows none.
fn rd_depths(ctx: &Context) -> (u8, u8) {
    let l = ctx.limits();
    (
        l.max_dest_rd_atomic.min(16) as u8,
        l.max_rd_atomic.min(16) as u8,
    )
}

/// Values that replace what `rdma_init_qp_attr` says.
#[derive(Default, Clone, Copy)]
struct Overrides {
    access: Option<Access>,
    max_dest_rd_atomic: Option<u8>,
    max_rd_atomic: Option<u8>,
}

/// Moves `qp` to `state` with the attributes rdma_cm computes for the identifier.
fn cm_modify(
    id: &CmId,
    qp: *mut sys::ibv_qp,
    state: sys::ibv_qp_state,
    o: Overrides,
) -> Result<()> {
    let init_qp_attr = id.cm.rdma_init_qp_attr.ok_or(Error::Library {
        library: "librdmacm.so.1",
        detail: "it lacks rdma_init_qp_attr (RDMACM_1.2; rdma-core too old)".into(),
    })?;
    let verbs = sys::ibverbs().map_err(|e| Error::Library {
        library: "libibverbs.so.1",
        detail: e.to_string(),
    })?;
    // SAFETY: a zeroed ibv_qp_attr is a valid value.
    let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
    attr.qp_state = state;
    let mut mask: c_int = 0;
    // SAFETY: the identifier is live; both out-parameters are valid.
    if unsafe { init_qp_attr(id.raw, &mut attr, &mut mask) } != 0 {
        return Err(Error::last_os("rdma_init_qp_attr"));
    }
    if let Some(a) = o.access {
        attr.qp_access_flags = a.bits();
        mask |= sys::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0 as c_int;
    }
    if let Some(v) = o.max_dest_rd_atomic {
        if mask & sys::ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC.0 as c_int != 0 {
            attr.max_dest_rd_atomic = v;
        }
    }
    if let Some(v) = o.max_rd_atomic {
        if mask & sys::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC.0 as c_int != 0 {
            attr.max_rd_atomic = v;
        }
    }
    // SAFETY: `qp` is live (its SDK handle is held by the caller); `attr` is valid for `mask`.
    let rc = unsafe { (verbs.ibv_modify_qp)(qp, &mut attr, mask) };
    if rc != 0 {
        return Err(Error::errno("ibv_modify_qp", rc));
    }
    Ok(())
}

/// Creates the queue pair of `s` and moves it to INIT for the identifier.
fn cm_qp<T>(
    id: &Arc<CmId>,
    ctx: &Context,
    s: &mut Setup<T>,
) -> Result<(crate::qp::Qp<crate::qp::Reset>, *mut sys::ibv_qp)> {
    let pd_ctx = s.pd.context();
    // `ctx` is the kernel device rdma_cm resolved the address to.
    if pd_ctx.provider() != ctx.provider() || pd_ctx.name() != ctx.name() {
        return Err(Error::invalid(format!(
            "the protection domain belongs to device {}, and the connection runs on {}",
            pd_ctx.name(),
            ctx.name()
        )));
    }
    crate::mr::check_access(s.access)?;
    let qp = s.pd.create_qp(&s.config)?;
    let _ = qp.shared.anchor.set(id.clone());
    let raw = qp
        .shared
        .imp
        .verbs_raw()
        .ok_or_else(|| Error::invalid("a soft queue pair cannot use rdma_cm"))?;
    cm_modify(
        id,
        raw,
        sys::IBV_QPS_INIT,
        Overrides {
            access: Some(s.access),
            ..Overrides::default()
        },
    )?;
    s.run_on_init(&Qp::<Init>::from_shared(qp.shared.clone()))?;
    Ok((qp, raw))
}

fn os_status(status: c_int) -> String {
    std::io::Error::from_raw_os_error(status.saturating_abs()).to_string()
}

fn kernel_devices() -> Vec<String> {
    crate::provider::verbs::list_devices()
        .map(|l| l.into_iter().map(|d| d.name).collect())
        .unwrap_or_default()
}

fn address_error(addr: SocketAddr, errno: i32, step: &str) -> Error {
    match errno {
        libc::ENODEV | libc::EADDRNOTAVAIL | libc::ENOENT => Error::NoDeviceForAddress {
            addr: addr.ip().to_string(),
            available: kernel_devices(),
        },
        libc::ETIMEDOUT | libc::ENODATA => Error::Unreachable {
            peer: addr.to_string(),
            detail: format!("rdma_cm {step} got no answer (no neighbour answered, or no path)"),
        },
        _ => Error::Unreachable {
            peer: addr.to_string(),
            detail: format!("rdma_cm {step} failed: {}", os_status(errno)),
        },
    }
}

/// The time rdma_cm gets for a resolution step: most of what is left, so that its own error
/// (which says what failed) comes before the caller's deadline.
fn ms_until(deadline: Instant) -> c_int {
    (remaining(deadline).as_millis() * 3 / 4).clamp(1, i32::MAX as u128) as c_int
}

pub(super) fn cm_connect<T>(
    cm: &'static sys::RdmaCm,
    dst: SocketAddr,
    deadline: Instant,
    options: &Options,
    setup: impl FnOnce(&Context) -> Result<Setup<T>>,
) -> Result<Connection<T>> {
    // Declared first, so dropped last: after the queue pair that anchors it.
    let mut held = Detach::new(CmId::create(cm)?);
    let id = held.id().clone();
    let (mut dst_sa, _) = to_sockaddr(dst);
    let mut src_sa = options
        .source
        .map(|ip| to_sockaddr(SocketAddr::new(ip, 0)).0);
    let src_ptr = src_sa.as_mut().map_or(std::ptr::null_mut(), |s| {
        (s as *mut libc::sockaddr_storage).cast()
    });
    // SAFETY: the identifier is live; both addresses are valid sockaddr_storage values.
    let rc = unsafe {
        (cm.rdma_resolve_addr)(
            id.raw,
            src_ptr,
            (&mut dst_sa as *mut libc::sockaddr_storage).cast(),
            ms_until(deadline),
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(address_error(
            dst,
            e.raw_os_error().unwrap_or(0),
            "address resolution",
        ));
    }
    let ev = id.next(deadline, &format!("rdma_cm address resolution of {dst}"))?;
    match ev.kind {
        sys::RDMA_CM_EVENT_ADDR_RESOLVED => {}
        sys::RDMA_CM_EVENT_ADDR_ERROR => {
            return Err(address_error(dst, -ev.status, "address resolution"));
        }
        k => return Err(unexpected(&id, k, "address resolution")),
    }
    // SAFETY: the identifier is live.
    if unsafe { (cm.rdma_resolve_route)(id.raw, ms_until(deadline)) } != 0 {
        return Err(Error::last_os("rdma_resolve_route"));
    }
    let ev = id.next(deadline, &format!("rdma_cm route resolution to {dst}"))?;
    match ev.kind {
        sys::RDMA_CM_EVENT_ROUTE_RESOLVED => {}
        sys::RDMA_CM_EVENT_ROUTE_ERROR => {
            return Err(Error::Unreachable {
                peer: dst.to_string(),
                detail: format!("rdma_cm route resolution failed: {}", os_status(ev.status)),
            });
        }
        k => return Err(unexpected(&id, k, "route resolution")),
    }
    let ctx = cm_context(&id, options)?;
    let transport = ctx.transport();
    let mut s = setup(&ctx)?;
    let (qp, raw_qp) = cm_qp(&id, &ctx, &mut s)?;
    let private = encode_private(
        &s.info(),
        private_limit(transport, false),
        "a connection request",
    )?;
    let (resp, init) = rd_depths(&ctx);
    // From here on a failure may leave the kernel an attempt to finish, holding the queue pair.
    held.arm(transport, Qp::<Init>::from_shared(qp.shared.clone()));
    if transport == Transport::Iwarp {
        let call = ConnectCall {
            private,
            resp,
            init,
            qp_num: qp.qp_num(),
        };
        iwarp::connect(&id, call, dst, deadline)?;
    } else {
        let mut param = conn_param(&private, resp, init, qp.qp_num());
        // librdmacm copies `param` and its private data during the call.
        // SAFETY: the identifier is live and route-resolved; `param` and its data outlive the
        // call.
        if unsafe { (cm.rdma_connect)(id.raw, &mut param) } != 0 {
            return Err(Error::last_os("rdma_connect"));
        }
    }
    let ev = id.next(
        deadline,
        &format!("{dst} to answer the rdma_cm connection request"),
    )?;
    let peer = match ev.kind {
        sys::RDMA_CM_EVENT_CONNECT_RESPONSE => {
            // InfiniBand/RoCE with a queue pair of our own: move it, then complete.
            let done = (|| -> Result<PeerInfo> {
                let peer = decode_private(&ev.private)?;
                cm_modify(&id, raw_qp, sys::IBV_QPS_RTR, Overrides::default())?;
                cm_modify(&id, raw_qp, sys::IBV_QPS_RTS, Overrides::default())?;
                let establish = cm.rdma_establish.ok_or(Error::Library {
                    library: "librdmacm.so.1",
                    detail: "it lacks rdma_establish (RDMACM_1.2; rdma-core too old)".into(),
                })?;
                // SAFETY: the identifier is live and has just had its connect response.
                if unsafe { establish(id.raw) } != 0 {
                    return Err(Error::last_os("rdma_establish"));
                }
                Ok(peer)
            })();
            match done {
                Ok(p) => p,
                Err(e) => {
                    id.reject(transport, &e.to_string());
                    return Err(e);
                }
            }
        }
        // iWARP: the kernel moved the queue pair; the connection is up.
        sys::RDMA_CM_EVENT_ESTABLISHED => match decode_private(&ev.private) {
            Ok(p) => p,
            Err(e) => {
                id.disconnect_now();
                return Err(e);
            }
        },
        sys::RDMA_CM_EVENT_REJECTED => {
            return Err(Error::Refused {
                peer: dst.to_string(),
                reason: reject_reason(transport, ev.status, &ev.private),
            });
        }
        sys::RDMA_CM_EVENT_UNREACHABLE => {
            return Err(Error::Unreachable {
                peer: dst.to_string(),
                detail: format!(
                    "no answer to the connection request ({})",
                    os_status(ev.status)
                ),
            });
        }
        sys::RDMA_CM_EVENT_CONNECT_ERROR => {
            return Err(Error::Unreachable {
                peer: dst.to_string(),
                detail: format!("the connection failed ({})", os_status(ev.status)),
            });
        }
        k => return Err(unexpected(&id, k, "the connection request")),
    };
    let local = id.local_addr();
    drop(id);
    Connection::start(
        Qp::from_shared(qp.shared.clone()),
        peer,
        s.app,
        Link::Cm(held.into_inner()),
        local,
        dst,
        options,
    )
}

fn unexpected(id: &CmId, kind: sys::rdma_cm_event_type, step: &str) -> Error {
    Error::protocol(format!(
        "rdma_cm reported {} during {step}",
        id.event_name(kind)
    ))
}

pub(super) fn cm_listen(
    cm: &'static sys::RdmaCm,
    local: SocketAddr,
    options: &Options,
) -> Result<Arc<CmId>> {
    let id = CmId::create(cm)?;
    let (mut sa, _) = to_sockaddr(local);
    // SAFETY: the identifier is live; `sa` is a valid address.
    if unsafe { (cm.rdma_bind_addr)(id.raw, (&mut sa as *mut libc::sockaddr_storage).cast()) } != 0
    {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENODEV) | Some(libc::EADDRNOTAVAIL) => Error::NoDeviceForAddress {
                addr: local.ip().to_string(),
                available: kernel_devices(),
            },
            _ => Error::Verb {
                verb: "rdma_bind_addr",
                source: e,
            },
        });
    }
    if let Some(want) = &options.device {
        // SAFETY: the identifier is live; `verbs` is NULL (wildcard address) or a live context.
        let verbs = unsafe { (*id.raw).verbs };
        if !verbs.is_null() {
            // SAFETY: a live context's device and its name.
            let name = unsafe {
                std::ffi::CStr::from_ptr((*(*verbs).device).name.as_ptr())
                    .to_string_lossy()
                    .into_owned()
            };
            if *want != name {
                return Err(Error::invalid(format!(
                    "{} belongs to RDMA device {name}, not {want}",
                    local.ip()
                )));
            }
        }
    }
    let backlog = options.backlog.unwrap_or(16) as c_int;
    // SAFETY: the identifier is live and bound.
    if unsafe { (cm.rdma_listen)(id.raw, backlog) } != 0 {
        return Err(Error::last_os("rdma_listen"));
    }
    Ok(id)
}

pub(super) fn cm_accept<T>(
    listener: &Arc<CmId>,
    deadline: Instant,
    options: &Options,
    setup: impl FnOnce(&Context) -> Result<Setup<T>>,
) -> Result<Connection<T>> {
    let cm = listener.cm;
    let what = format!(
        "a connection request on {}",
        listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default()
    );
    let ev = loop {
        let ev = listener.next(deadline, &what)?;
        if ev.kind == sys::RDMA_CM_EVENT_CONNECT_REQUEST && !ev.id.is_null() {
            break ev;
        }
    };
    // The request's identifier gets a channel of its own, so its events never mix with the
    // listener's.
    let adopt = (|| -> Result<Channel> {
        let channel = Channel::new(cm)?;
        // The request was acknowledged when read.
        // SAFETY: both live; the identifier has no unacknowledged event.
        if unsafe { (cm.rdma_migrate_id)(ev.id, channel.raw) } != 0 {
            return Err(Error::last_os("rdma_migrate_id"));
        }
        Ok(channel)
    })();
    let channel = match adopt {
        Ok(c) => c,
        Err(e) => {
            // SAFETY: the request's identifier is live and ours to reject and destroy, once.
            unsafe {
                (cm.rdma_reject)(ev.id, std::ptr::null(), 0);
                (cm.rdma_destroy_id)(ev.id);
            }
            return Err(e);
        }
    };
    let id = Arc::new(CmId {
        cm,
        raw: ev.id,
        channel: Mutex::new(channel),
        disconnected: AtomicBool::new(false),
    });
    let transport = id.transport();
    let remote = id
        .peer_addr()
        .unwrap_or(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0));
    let prepared = (|| -> Result<_> {
        let peer = decode_private(&ev.private)?;
        let ctx = cm_context(&id, options)?;
        let mut s = setup(&ctx)?;
        let (qp, raw_qp) = cm_qp(&id, &ctx, &mut s)?;
        let (mine_resp, mine_init) = rd_depths(&ctx);
        // The peer's initiator depth is what it may have outstanding at us, and the other way.
        let resp = mine_resp.min(ev.initiator_depth);
        let init = mine_init.min(ev.responder_resources);
        if transport != Transport::Iwarp {
            cm_modify(
                &id,
                raw_qp,
                sys::IBV_QPS_RTR,
                Overrides {
                    max_dest_rd_atomic: Some(resp),
                    ..Overrides::default()
                },
            )?;
            cm_modify(
                &id,
                raw_qp,
                sys::IBV_QPS_RTS,
                Overrides {
                    max_rd_atomic: Some(init),
                    ..Overrides::default()
                },
            )?;
        }
        let private = encode_private(&s.info(), private_limit(transport, true), "an accept")?;
        let mut param = conn_param(&private, resp, init, qp.qp_num());
        // SAFETY: the identifier is live with a pending request; `param` and data outlive it.
        if unsafe { (cm.rdma_accept)(id.raw, &mut param) } != 0 {
            return Err(Error::last_os("rdma_accept"));
        }
        Ok((peer, s, qp))
    })();
    let (peer, s, qp) = match prepared {
        Ok(v) => v,
        Err(e) => {
            id.reject(transport, &e.to_string());
            return Err(e);
        }
    };
    let ev = id.next(
        deadline,
        &format!("{remote} to complete the rdma_cm connection"),
    )?;
    match ev.kind {
        sys::RDMA_CM_EVENT_ESTABLISHED => {}
        sys::RDMA_CM_EVENT_REJECTED => {
            return Err(Error::Refused {
                peer: remote.to_string(),
                reason: reject_reason(transport, ev.status, &ev.private),
            });
        }
        sys::RDMA_CM_EVENT_CONNECT_ERROR | sys::RDMA_CM_EVENT_UNREACHABLE => {
            return Err(Error::Unreachable {
                peer: remote.to_string(),
                detail: format!(
                    "the peer did not complete the connection ({})",
                    os_status(ev.status)
                ),
            });
        }
        k => return Err(unexpected(&id, k, "the accept")),
    }
    let local = id.local_addr();
    Connection::start(
        Qp::from_shared(qp.shared.clone()),
        peer,
        s.app,
        Link::Cm(id),
        local,
        remote,
        options,
    )
}

// ---------------------------------------------------------------------------------------------
// Socket addresses.

fn to_sockaddr(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: an all-zero sockaddr_storage is a valid (AF_UNSPEC) value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

fn from_sockaddr(p: *const libc::sockaddr) -> Option<SocketAddr> {
    if p.is_null() {
        return None;
    }
    // The identifier's storage is a union of sockaddr_in/in6/ib/storage.
    // SAFETY: `p` points into a live identifier, large enough for the family it states.
    unsafe {
        match (*p).sa_family as c_int {
            libc::AF_INET => {
                let sin = &*(p.cast::<libc::sockaddr_in>());
                Some(SocketAddr::new(
                    IpAddr::V4(Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes())),
                    u16::from_be(sin.sin_port),
                ))
            }
            libc::AF_INET6 => {
                let sin6 = &*(p.cast::<libc::sockaddr_in6>());
                Some(SocketAddr::new(
                    IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)),
                    u16::from_be(sin6.sin6_port),
                ))
            }
            _ => None,
        }
    }
}
#[cfg(test)]
mod tests;
