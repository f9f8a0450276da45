//! The provider line: one raw, verbs-shaped interface over the two providers, which the SDK's
//! handles call (and which a C verbs library can call too).
//!
//! Each handle of the public API holds one of these enums; each variant's methods live in the
//! provider's own module: [`verbs`] for kernel devices through libibverbs, [`soft`] for the
//! software device's engine. This module routes calls (an enum, not a trait object, on the hot
//! path); it holds no state and no policy. Nothing outside `provider/` matches on a variant.
//!
//! Raw: requests are addresses, lengths, keys and `wr_id`s ([`SendReq`], [`RecvReq`]); the
//! devices check every key, bound and right. What they cannot check is stated as the `# Safety`
//! of the calls that take memory: [`PdImpl::reg_mr`] and [`QpImpl::post_send`].

#![allow(unsafe_code)] // routes the provider line's unsafe calls

#[cfg(feature = "raw-provider")]
pub mod raw;
mod req;
pub(crate) mod soft;
pub(crate) mod verbs;

use std::net::Ipv4Addr;
use std::sync::Arc;

use crate::error::{Error, PostResult, Result};
use crate::event::EventQueue;
use crate::vocab::{
    Access, Completion, DeviceAttr, DeviceInfo, GidEntry, PortAttr, PortCounters, ProviderKind,
    QpAttr, QpCaps, QpState, Transport,
};
#[cfg(feature = "gpu")]
use crate::vocab::{GpuSpan, RegistrationPath};

pub(crate) use req::{Batch, RecvReq, SendReq};

/// A device context.
pub(crate) enum CtxImpl {
    Verbs(verbs::VerbsCtx),
    Soft(soft::SoftCtx),
}

/// A protection domain.
pub(crate) enum PdImpl {
    Verbs(verbs::VerbsPd),
    Soft(soft::SoftPd),
}

/// A memory region.
pub(crate) enum MrImpl {
    Verbs(verbs::VerbsMr),
    Soft(soft::SoftMr),
}

/// A completion queue.
pub(crate) enum CqImpl {
    Verbs(verbs::VerbsCq),
    Soft(soft::SoftCq),
}

/// A queue pair.
pub(crate) enum QpImpl {
    Verbs(verbs::VerbsQp),
    Soft(soft::SoftQp),
}

fn mismatch() -> Error {
    Error::invalid("objects of two different providers cannot be combined")
}

/// Every device this machine can use: kernel devices first, then the soft devices that can be
/// opened on this host's addresses. A missing libibverbs leaves the kernel part empty.
pub(crate) fn list_devices() -> Vec<DeviceInfo> {
    let mut list = verbs::list_devices().unwrap_or_default();
    list.extend(crate::soft::driver::list_devices());
    list
}

/// The first kernel device's name, or `soft:127.0.0.1` where there is none.
pub(crate) fn first_device_name() -> String {
    match verbs::list_devices() {
        Ok(list) if !list.is_empty() => list[0].name.clone(),
        _ => "soft:127.0.0.1".to_string(),
    }
}

/// `Some(address)` when `name` names a soft device.
fn soft_address(name: &str) -> Result<Option<Ipv4Addr>> {
    let Some(rest) = name.strip_prefix("soft") else {
        return Ok(None);
    };
    let addr = match rest.strip_prefix(':') {
        None if rest.is_empty() => return Ok(Some(Ipv4Addr::LOCALHOST)),
        None => return Ok(None),
        Some(a) => a,
    };
    addr.parse::<Ipv4Addr>().map(Some).map_err(|_| {
        Error::invalid(format!(
            "soft device name `{name}`: expected soft:<IPv4 address>, e.g. soft:127.0.0.2"
        ))
    })
}

impl CtxImpl {
    /// Opens the device called `name`; returns it with its provider and canonical name.
    pub(crate) fn open(name: &str) -> Result<(CtxImpl, String)> {
        Ok(match soft_address(name)? {
            Some(addr) => (
                CtxImpl::Soft(soft::SoftCtx::open(addr)?),
                format!("soft:{addr}"),
            ),
            None => (
                CtxImpl::Verbs(verbs::VerbsCtx::open(name)?),
                name.to_string(),
            ),
        })
    }

    /// A kernel device context opened elsewhere (rdma_cm's).
    pub(crate) fn from_verbs(ctx: verbs::VerbsCtx) -> CtxImpl {
        CtxImpl::Verbs(ctx)
    }

    pub(crate) fn query_device(&self) -> Result<DeviceAttr> {
        match self {
            CtxImpl::Verbs(c) => c.query_device(),
            CtxImpl::Soft(c) => Ok(c.query_device()),
        }
    }

    pub(crate) fn query_port(&self, port: u8) -> Result<PortAttr> {
        match self {
            CtxImpl::Verbs(c) => c.query_port(port),
            CtxImpl::Soft(c) => Ok(c.query_port()),
        }
    }

    pub(crate) fn port_counters(&self, port: u8) -> Result<PortCounters> {
        match self {
            CtxImpl::Verbs(c) => c.port_counters(port),
            CtxImpl::Soft(c) => Ok(c.port_counters()),
        }
    }

    pub(crate) fn gid_table(&self, port: u8, len: u32) -> Result<Vec<GidEntry>> {
        match self {
            CtxImpl::Verbs(c) => c.gid_table(port, len),
            CtxImpl::Soft(c) => Ok(c.gid_table()),
        }
    }

    pub(crate) fn transport(&self) -> Transport {
        match self {
            CtxImpl::Verbs(c) => c.transport(),
            CtxImpl::Soft(_) => Transport::Ib,
        }
    }

    /// The kernel driver's name, where there is one.
    /// Which provider this is.
    pub(crate) fn kind(&self) -> ProviderKind {
        match self {
            CtxImpl::Verbs(_) => ProviderKind::Verbs,
            CtxImpl::Soft(_) => ProviderKind::Soft,
        }
    }

    /// Whether the device is an eRDMA device (and gets the eRDMA limit profile by default): the
    /// soft device always is; a kernel device is when its vendor ids or its driver say so.
    pub(crate) fn is_erdma(&self, attr: &DeviceAttr) -> bool {
        match self {
            CtxImpl::Soft(_) => true,
            CtxImpl::Verbs(c) => {
                (attr.vendor_id == crate::profile::ERDMA_VENDOR_ID
                    && attr.vendor_part_id == crate::profile::ERDMA_PART_ID)
                    || c.driver().as_deref() == Some("erdma")
            }
        }
    }

    pub(crate) fn driver(&self) -> Option<String> {
        match self {
            CtxImpl::Verbs(c) => c.driver(),
            CtxImpl::Soft(_) => None,
        }
    }

    /// Inline capacity the device states (0 where it does not say).
    pub(crate) fn max_inline(&self) -> u32 {
        match self {
            CtxImpl::Verbs(_) => 0,
            CtxImpl::Soft(_) => crate::profile::MAX_INLINE_DATA,
        }
    }

    pub(crate) fn alloc_pd(&self) -> Result<PdImpl> {
        match self {
            CtxImpl::Verbs(c) => c.alloc_pd().map(PdImpl::Verbs),
            CtxImpl::Soft(c) => c.alloc_pd().map(PdImpl::Soft),
        }
    }

    /// Creates a CQ; returns it with the depth it really has. `id` names it in the events
    /// delivered to `events`.
    pub(crate) fn create_cq(
        &self,
        depth: u32,
        id: u64,
        events: &Arc<EventQueue>,
    ) -> Result<(CqImpl, u32)> {
        match self {
            CtxImpl::Verbs(c) => c.create_cq(depth, id).map(|(q, d)| (CqImpl::Verbs(q), d)),
            CtxImpl::Soft(c) => c
                .create_cq(depth, id, events.clone())
                .map(|(q, d)| (CqImpl::Soft(q), d)),
        }
    }

    /// Starts delivering the device's asynchronous events to `events`.
    pub(crate) fn watch_events(&mut self, events: &Arc<EventQueue>) -> Result<()> {
        match self {
            CtxImpl::Verbs(c) => c.watch_events(events),
            // A soft device's events come from its completion queues and queue pairs, which
            // are given the queue when they are created.
            CtxImpl::Soft(_) => Ok(()),
        }
    }
}

impl PdImpl {
    /// # Safety
    /// Called at most once per object, by its owner's `Drop`; the object is not used after.
    pub(crate) unsafe fn dealloc(&self, ctx: &CtxImpl) {
        match (self, ctx) {
            (PdImpl::Verbs(p), CtxImpl::Verbs(c)) => {
                // SAFETY: this function's own contract, passed on.
                unsafe { p.dealloc(c) }
            }
            (PdImpl::Soft(p), CtxImpl::Soft(c)) => p.dealloc(c),
            _ => {}
        }
    }

    /// Registers `len` bytes at `addr`; returns the region with its lkey and rkey.
    ///
    /// # Safety
    /// `[addr, addr+len)` must stay allocated until the region is deregistered, and the device
    /// may read and write it at any time meanwhile (as requests and peers holding its keys
    /// ask, within the rights `access` grants).
    pub(crate) unsafe fn reg_mr(
        &self,
        ctx: &CtxImpl,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<(MrImpl, u32, u32)> {
        match (self, ctx) {
            (PdImpl::Verbs(p), CtxImpl::Verbs(c)) => {
                // SAFETY: the caller's contract is the provider's.
                let r = unsafe { p.reg_mr(c, addr, len, access) };
                r.map(|(m, l, r)| (MrImpl::Verbs(m), l, r))
            }
            (PdImpl::Soft(p), CtxImpl::Soft(c)) => {
                // SAFETY: the caller's contract is the provider's.
                let r = unsafe { p.reg_mr(c, addr, len, access) };
                r.map(|(m, l, r)| (MrImpl::Soft(m), l, r))
            }
            _ => Err(mismatch()),
        }
    }

    /// Registers GPU memory by the provider's path: dma-buf, then peer memory, on kernel
    /// devices; staging copies on the soft device. Returns the region, its keys, the path, and
    /// why dma-buf was not used when another path was.
    ///
    /// # Safety
    /// `span` is allocated device memory that stays allocated until the region is
    /// deregistered.
    #[cfg(feature = "gpu")]
    pub(crate) unsafe fn reg_gpu(
        &self,
        ctx: &CtxImpl,
        span: GpuSpan,
        access: Access,
    ) -> Result<(MrImpl, u32, u32, RegistrationPath, Option<String>)> {
        match (self, ctx) {
            // SAFETY: this function's own contract, passed on.
            (PdImpl::Verbs(p), CtxImpl::Verbs(c)) => unsafe { p.reg_gpu(c, span, access) }
                .map(|(m, l, r, path, why)| (MrImpl::Verbs(m), l, r, path, why)),
            // SAFETY: as above.
            (PdImpl::Soft(p), CtxImpl::Soft(c)) => unsafe { p.reg_gpu(c, span, access) }
                .map(|(m, l, r, path)| (MrImpl::Soft(m), l, r, path, None)),
            _ => Err(mismatch()),
        }
    }

    /// Registers a soft-device region at `iova` over any staging copy backend (tests).
    #[cfg(all(feature = "gpu", test))]
    pub(crate) fn reg_soft_staged(
        &self,
        ctx: &CtxImpl,
        iova: u64,
        len: usize,
        access: Access,
        engine: Box<dyn crate::soft::engine::stage::CopyEngine>,
    ) -> Result<(MrImpl, u32, u32)> {
        match (self, ctx) {
            (PdImpl::Soft(p), CtxImpl::Soft(c)) => {
                let stager = Arc::new(crate::soft::engine::stage::Stager::new(engine, len as u64));
                p.reg_device_mr(c, iova, len, access, stager)
                    .map(|(m, l, r)| (MrImpl::Soft(m), l, r))
            }
            _ => Err(Error::invalid("a soft device is needed")),
        }
    }

    pub(crate) fn create_qp(
        &self,
        ctx: &CtxImpl,
        send_cq: &CqImpl,
        recv_cq: &CqImpl,
        caps: &QpCaps,
        sig_all: bool,
        events: &Arc<EventQueue>,
    ) -> Result<(QpImpl, u32, QpCaps)> {
        match (self, ctx, send_cq, recv_cq) {
            (PdImpl::Verbs(p), CtxImpl::Verbs(c), CqImpl::Verbs(s), CqImpl::Verbs(r)) => p
                .create_qp(c, s, r, caps, sig_all)
                .map(|(q, n, caps)| (QpImpl::Verbs(q), n, caps)),
            (PdImpl::Soft(p), CtxImpl::Soft(c), CqImpl::Soft(s), CqImpl::Soft(r)) => p
                .create_qp(c, s, r, caps, sig_all, events.clone())
                .map(|(q, n, caps)| (QpImpl::Soft(q), n, caps)),
            _ => Err(mismatch()),
        }
    }
}

impl MrImpl {
    /// # Safety
    /// Called at most once per object, by its owner's `Drop`; the object is not used after.
    pub(crate) unsafe fn deregister(&self, ctx: &CtxImpl) {
        match (self, ctx) {
            (MrImpl::Verbs(m), CtxImpl::Verbs(c)) => {
                // SAFETY: this function's own contract, passed on.
                unsafe { m.deregister(c) }
            }
            (MrImpl::Soft(m), CtxImpl::Soft(c)) => m.deregister(c),
            _ => {}
        }
    }
}

impl CqImpl {
    #[inline]
    pub(crate) fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        match self {
            CqImpl::Verbs(q) => q.poll(out),
            CqImpl::Soft(q) => q.poll(out),
        }
    }

    /// Arms the queue: the next completion (or the next solicited one) makes its fd readable.
    pub(crate) fn arm(&self, solicited_only: bool) -> Result<()> {
        match self {
            CqImpl::Verbs(q) => q.arm(solicited_only),
            CqImpl::Soft(q) => {
                q.arm(solicited_only);
                Ok(())
            }
        }
    }

    /// Soft devices: whether polls do the device's receive work (verbs devices have none).
    pub(crate) fn set_inline_progress(&self, on: bool) {
        if let CqImpl::Soft(q) = self {
            q.set_inline(on);
        }
    }

    pub(crate) fn inline_progress(&self) -> bool {
        match self {
            CqImpl::Verbs(_) => false,
            CqImpl::Soft(q) => q.inline(),
        }
    }

    /// The descriptor that becomes readable when an armed queue gets a completion.
    pub(crate) fn event_fd(&self) -> std::os::fd::RawFd {
        match self {
            CqImpl::Verbs(q) => q.event_fd(),
            CqImpl::Soft(q) => q.event_fd(),
        }
    }

    /// Clears the descriptor's readiness, returning how many notifications it held.
    pub(crate) fn consume_events(&self) -> Result<u32> {
        match self {
            CqImpl::Verbs(q) => q.consume_events(),
            CqImpl::Soft(q) => Ok(q.consume_events()),
        }
    }

    /// # Safety
    /// Called at most once per object, by its owner's `Drop`; the object is not used after.
    pub(crate) unsafe fn destroy(&self, ctx: &CtxImpl) {
        match (self, ctx) {
            (CqImpl::Verbs(q), CtxImpl::Verbs(c)) => {
                // SAFETY: this function's own contract, passed on.
                unsafe { q.destroy(c) }
            }
            (CqImpl::Soft(q), CtxImpl::Soft(c)) => q.destroy(c),
            _ => {}
        }
    }
}

impl QpImpl {
    pub(crate) fn modify(&self, ctx: &CtxImpl, attr: &QpAttr) -> Result<()> {
        match (self, ctx) {
            (QpImpl::Verbs(q), CtxImpl::Verbs(c)) => q.modify(c, attr),
            (QpImpl::Soft(q), CtxImpl::Soft(c)) => q.modify(c, attr),
            _ => Err(mismatch()),
        }
    }

    pub(crate) fn query_state(&self, ctx: &CtxImpl) -> Result<QpState> {
        match (self, ctx) {
            (QpImpl::Verbs(q), _) => q.query_state(),
            (QpImpl::Soft(q), CtxImpl::Soft(c)) => Ok(q.state(c)),
            _ => Err(mismatch()),
        }
    }

    /// The kernel queue pair, for rdma_cm (`None` on the soft device).
    pub(crate) fn verbs_raw(&self) -> Option<*mut erdma_sys::ibv_qp> {
        match self {
            QpImpl::Verbs(q) => Some(q.as_raw()),
            QpImpl::Soft(_) => None,
        }
    }

    /// Posts send requests as one chain.
    ///
    /// # Safety
    /// An inline request's SGEs name bytes readable for the duration of the call: they are
    /// copied, and no key covers them. Every other byte a request moves is reached through a
    /// registered region, by key, bounds and rights checked by the device; the region's
    /// registration carries the contract for that memory ([`PdImpl::reg_mr`]).
    ///
    /// # Errors
    /// How many requests the device took before the one it refused, and why.
    #[inline]
    pub(crate) unsafe fn post_send(&self, ctx: &CtxImpl, reqs: &[SendReq<'_>]) -> PostResult {
        match (self, ctx) {
            // SAFETY: the caller's contract, which is the provider's.
            (QpImpl::Verbs(q), CtxImpl::Verbs(c)) => unsafe { q.post_send(c, reqs) },
            // SAFETY: as above.
            (QpImpl::Soft(q), CtxImpl::Soft(c)) => unsafe { q.post_send(c, reqs) },
            _ => Err((0, mismatch())),
        }
    }

    /// Posts receive requests as one chain. The device writes only memory of registered
    /// regions the SGEs name by key ([`PdImpl::reg_mr`] carries the contract for it).
    ///
    /// # Errors
    /// As [`QpImpl::post_send`].
    #[inline]
    pub(crate) fn post_recv(&self, ctx: &CtxImpl, reqs: &[RecvReq<'_>]) -> PostResult {
        match (self, ctx) {
            (QpImpl::Verbs(q), CtxImpl::Verbs(c)) => q.post_recv(c, reqs),
            (QpImpl::Soft(q), CtxImpl::Soft(c)) => q.post_recv(c, reqs),
            _ => Err((0, mismatch())),
        }
    }

    /// # Safety
    /// Called at most once per object, by its owner's `Drop`; the object is not used after.
    pub(crate) unsafe fn destroy(&self, ctx: &CtxImpl) {
        match (self, ctx) {
            (QpImpl::Verbs(q), CtxImpl::Verbs(c)) => {
                // SAFETY: this function's own contract, passed on.
                unsafe { q.destroy(c) }
            }
            (QpImpl::Soft(q), CtxImpl::Soft(c)) => q.destroy(c),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn soft_names() {
        assert_eq!(soft_address("soft").unwrap(), Some(Ipv4Addr::LOCALHOST));
        assert_eq!(
            soft_address("soft:127.0.0.2").unwrap(),
            Some(Ipv4Addr::new(127, 0, 0, 2))
        );
        assert_eq!(soft_address("rxe0").unwrap(), None);
        assert_eq!(soft_address("softroce0").unwrap(), None);
        assert!(soft_address("soft:nonsense").is_err());
    }
}
