//! The soft device's provider line, raw, for a C verbs library built on this crate
//! (`erdma-verbs`, the drop-in `libibverbs.so.1`). Behind the `raw-provider` feature and not part
//! of the API this crate promises.
//!
//! Thin newtypes over `provider::soft`'s objects: no state, no policy of their own. Each call
//! takes the context it belongs to, as the provider line does; the caller keeps every object
//! alive until it is destroyed (a C library does, through the handles it hands out). Errors
//! carry the errno rdma-core would give ([`errno`]).

use std::net::Ipv4Addr;
use std::sync::Arc;

use super::soft::{SoftCq, SoftCtx, SoftMr, SoftPd, SoftQp};
use crate::error::{Error, Result};
use crate::event::EventQueue;
use crate::vocab::{
    Access, AsyncEvent, Completion, DeviceAttr, GidEntry, PortAttr, QpAttr, QpCaps, QpState,
};

pub use super::req::{RecvReq, SendReq};

/// The errno rdma-core gives for a failure of this kind.
pub fn errno(e: &Error) -> i32 {
    if let Some(n) = e.raw_os_error() {
        return n;
    }
    match e {
        Error::LimitExceeded { .. } | Error::LimitBelowMinimum { .. } => libc::EINVAL,
        Error::Unsupported { .. } | Error::MissingCapability { .. } => libc::EOPNOTSUPP,
        Error::QueueFull { .. } => libc::ENOMEM,
        Error::OutOfBounds { .. } => libc::EINVAL,
        Error::DeviceNotFound { .. } | Error::NoDeviceForAddress { .. } => libc::ENODEV,
        Error::Io { .. } => libc::EIO,
        _ => libc::EINVAL,
    }
}

/// Which error ended a chain of posted requests: how many went in, and the errno.
pub type PostFailure = (usize, i32);

/// A context's asynchronous events (queue pairs in error, CQ overruns).
#[derive(Default)]
pub struct RawEvents(Arc<EventQueue>);

impl std::fmt::Debug for RawEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RawEvents")
    }
}

impl RawEvents {
    /// The oldest unread event, waiting up to `timeout`.
    pub fn next(&self, timeout: std::time::Duration) -> Option<AsyncEvent> {
        self.0.next(timeout)
    }

    /// A descriptor readable while events wait.
    ///
    /// # Errors
    /// The eventfd cannot be made.
    pub fn fd(&self) -> std::io::Result<std::os::fd::RawFd> {
        self.0.fd()
    }
}

/// An open soft device.
pub struct RawCtx(SoftCtx);

impl std::fmt::Debug for RawCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RawCtx({})", self.0.addr())
    }
}

impl RawCtx {
    /// Opens (or joins, within this process) the soft device on `addr`. Its RoCE port is bound
    /// by its first queue pair to leave INIT ([`RawQp::modify`] fails then if another process
    /// holds it), so opening, querying, registering memory and creating queue pairs to probe
    /// limits take no address: C programs open every device they list, and some make a queue
    /// pair on each.
    ///
    /// # Errors
    /// An engine thread or its sockets cannot start.
    pub fn open(addr: Ipv4Addr) -> Result<RawCtx> {
        SoftCtx::open_unbound(addr).map(RawCtx)
    }

    /// Makes soft devices opened from now on in this process find out how their program waits
    /// (unless `ERDMA_SOFT_POLL_RX` is set): a polling thread takes the receive path, as in the
    /// SDK, until the engine finds a peer's datagrams waiting when a poller's grace runs out,
    /// three times in a row with only a few datagrams between — a C verbs program may wait for a
    /// WRITE by watching memory, with no thread polling a completion queue — and from then on
    /// polling threads and the engine thread share it.
    pub fn adapt_receive_work_by_default() {
        crate::soft::driver::adapt_receive_work_by_default();
    }

    /// Binds the device's RoCE port now rather than with its first queue pair to leave INIT
    /// (the drop-in librdmacm binds the device it picks for a connection, so that it picks one
    /// this process can use).
    ///
    /// # Errors
    /// [`crate::Error::Io`] when the port cannot be bound (`EADDRINUSE`: another process holds
    /// the address).
    pub fn bind(&self) -> Result<()> {
        self.0.bind()
    }

    /// Takes in the datagrams that have arrived and sends the acknowledgements held back, now,
    /// on every lane (the drop-in librdmacm does so before it reports that a peer left).
    pub fn take_in(&self) {
        self.0.take_in();
    }

    /// The device's attributes (the eRDMA profile).
    pub fn query_device(&self) -> DeviceAttr {
        self.0.query_device()
    }

    /// Port 1's attributes.
    pub fn query_port(&self) -> PortAttr {
        self.0.query_port()
    }

    /// The GID table: index 1 is the IPv4-mapped RoCEv2 GID.
    pub fn gid_table(&self) -> Vec<GidEntry> {
        self.0.gid_table()
    }

    /// A protection domain.
    ///
    /// # Errors
    /// Too many.
    pub fn alloc_pd(&self) -> Result<RawPd> {
        self.0.alloc_pd().map(RawPd)
    }

    /// A completion queue of `depth` entries; overruns go to `events`.
    ///
    /// # Errors
    /// Too deep, too many, or no eventfd.
    pub fn create_cq(&self, depth: u32, id: u64, events: &RawEvents) -> Result<RawCq> {
        let sink: Arc<dyn crate::soft::engine::notify::EventSink> = events.0.clone();
        self.0.create_cq(depth, id, sink).map(|(cq, _)| RawCq(cq))
    }
}

/// A protection domain.
pub struct RawPd(SoftPd);

impl std::fmt::Debug for RawPd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RawPd")
    }
}

impl RawPd {
    /// Frees it.
    pub fn dealloc(&self, ctx: &RawCtx) {
        self.0.dealloc(&ctx.0);
    }

    /// Registers `len` bytes at `addr`; returns the region and its key (lkey = rkey).
    ///
    /// # Safety
    /// `[addr, addr+len)` stays allocated until [`RawMr::deregister`] returns, and the device
    /// may read and write it meanwhile.
    ///
    /// # Errors
    /// Bad access flags, too large, too many.
    pub unsafe fn reg_mr(
        &self,
        ctx: &RawCtx,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<(RawMr, u32)> {
        // SAFETY: the caller's contract is the provider's.
        unsafe { self.0.reg_mr(&ctx.0, addr, len, access) }.map(|(m, l, _)| (RawMr(m), l))
    }

    /// An RC queue pair; returns it with its number and the capacities granted.
    ///
    /// # Errors
    /// Capacities beyond the device's, too many.
    pub fn create_qp(
        &self,
        ctx: &RawCtx,
        send_cq: &RawCq,
        recv_cq: &RawCq,
        caps: &QpCaps,
        sig_all: bool,
        events: &RawEvents,
    ) -> Result<(RawQp, u32, QpCaps)> {
        self.0
            .create_qp(
                &ctx.0,
                &send_cq.0,
                &recv_cq.0,
                caps,
                sig_all,
                events.0.clone(),
            )
            .map(|(q, n, c)| (RawQp(q), n, c))
    }
}

/// A memory region.
pub struct RawMr(SoftMr);

impl std::fmt::Debug for RawMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RawMr")
    }
}

impl RawMr {
    /// Once this returns, the device touches the region no more.
    pub fn deregister(&self, ctx: &RawCtx) {
        self.0.deregister(&ctx.0);
    }
}

/// A completion queue.
pub struct RawCq(SoftCq);

impl std::fmt::Debug for RawCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RawCq")
    }
}

impl RawCq {
    /// Takes up to `out.len()` completions.
    ///
    /// # Errors
    /// The queue overran.
    #[inline]
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        self.0.poll(out)
    }

    /// Arms the queue: the next (solicited) completion signals [`RawCq::event_fd`].
    pub fn arm(&self, solicited_only: bool) {
        self.0.arm(solicited_only);
    }

    /// The eventfd an armed queue signals.
    pub fn event_fd(&self) -> std::os::fd::RawFd {
        self.0.event_fd()
    }

    /// Takes the signals waiting on the eventfd; how many.
    pub fn consume_events(&self) -> u32 {
        self.0.consume_events()
    }

    /// Frees it (its queue pairs are gone).
    pub fn destroy(&self, ctx: &RawCtx) {
        self.0.destroy(&ctx.0);
    }
}

/// A queue pair.
pub struct RawQp(SoftQp);

impl std::fmt::Debug for RawQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RawQp")
    }
}

impl RawQp {
    /// Its state now.
    pub fn state(&self, ctx: &RawCtx) -> QpState {
        self.0.state(&ctx.0)
    }

    /// Modifies it under IBTA's attribute rules. The device's first queue pair to move to RTR
    /// (or beyond) binds its RoCE port.
    ///
    /// # Errors
    /// An illegal transition, a missing or disallowed attribute, a bad value;
    /// [`crate::Error::Io`] when the port cannot be bound (`EADDRINUSE`: another process holds
    /// the address).
    pub fn modify(&self, ctx: &RawCtx, attr: &QpAttr) -> Result<()> {
        self.0.modify(&ctx.0, attr)
    }

    /// Posts send requests in order.
    ///
    /// # Safety
    /// An inline request's SGEs name bytes readable for the duration of the call.
    ///
    /// # Errors
    /// How many went in and the errno of the one that did not.
    #[inline]
    pub unsafe fn post_send(&self, ctx: &RawCtx, reqs: &[SendReq<'_>]) -> Result<(), PostFailure> {
        // SAFETY: the caller's contract is the provider's.
        unsafe { self.0.post_send(&ctx.0, reqs) }.map_err(|(n, e)| (n, errno(&e)))
    }

    /// Posts receive requests in order.
    ///
    /// # Errors
    /// How many went in and the errno of the one that did not.
    #[inline]
    pub fn post_recv(&self, ctx: &RawCtx, reqs: &[RecvReq<'_>]) -> Result<(), PostFailure> {
        self.0
            .post_recv(&ctx.0, reqs)
            .map_err(|(n, e)| (n, errno(&e)))
    }

    /// Frees it.
    pub fn destroy(&self, ctx: &RawCtx) {
        self.0.destroy(&ctx.0);
    }
}

/// The addresses of this host's soft devices, loopback first (what `ERDMA_SOFT_DEVICES` defaults
/// to).
pub fn host_addresses() -> Vec<Ipv4Addr> {
    crate::soft::driver::list_devices()
        .iter()
        .filter_map(|d| d.name.strip_prefix("soft:")?.parse().ok())
        .collect()
}

/// The node GUID of the soft device on `addr` (host order).
pub fn node_guid(addr: Ipv4Addr) -> u64 {
    crate::soft::driver::node_guid(addr)
}
