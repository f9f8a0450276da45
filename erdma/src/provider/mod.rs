//! The two providers behind one API, dispatched by enum (no trait objects on the hot path).
//!
//! Each handle of the public API holds one of these enums; each variant's methods live in the
//! provider's own module: [`verbs`] for kernel devices through libibverbs, [`crate::soft`] for the
//! software device. This module only routes calls; it holds no state and no policy.

pub(crate) mod verbs;
mod verbs_events;

use crate::error::{Error, Result};
use crate::event::EventQueue;
use crate::pd::Pd;
use crate::soft;
use crate::vocab::{
    Access, Completion, DeviceAttr, GidEntry, PortAttr, PortCounters, QpAttr, QpCaps, QpState,
    Transport,
};
use crate::wr::{RecvReq, SendReq};

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

/// The result of posting: on failure, how many requests the device accepted before the error.
pub(crate) type PostResult = std::result::Result<(), (usize, Error)>;

/// A context's event queue as the soft device's event sink.
fn sink(
    events: &std::sync::Arc<EventQueue>,
) -> std::sync::Arc<dyn soft::driver::notify::EventSink> {
    events.clone()
}

fn mismatch() -> Error {
    Error::invalid("objects of two different providers cannot be combined")
}

impl CtxImpl {
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
            CtxImpl::Soft(_) => crate::limits::erdma::MAX_INLINE_DATA,
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
        events: &std::sync::Arc<EventQueue>,
    ) -> Result<(CqImpl, u32)> {
        match self {
            CtxImpl::Verbs(c) => c.create_cq(depth, id).map(|(q, d)| (CqImpl::Verbs(q), d)),
            CtxImpl::Soft(c) => c
                .create_cq(depth, id, &sink(events))
                .map(|(q, d)| (CqImpl::Soft(q), d)),
        }
    }

    /// Starts delivering the device's asynchronous events to `events`.
    pub(crate) fn watch_events(&mut self, events: &std::sync::Arc<EventQueue>) -> Result<()> {
        match self {
            CtxImpl::Verbs(c) => c.watch_events(events),
            // A soft device's events come from its completion queues and queue pairs, which
            // are given the queue when they are created.
            CtxImpl::Soft(_) => Ok(()),
        }
    }
}

impl PdImpl {
    pub(crate) fn dealloc(&self, ctx: &crate::Context) {
        match (self, &ctx.inner.imp) {
            (PdImpl::Verbs(p), CtxImpl::Verbs(c)) => p.dealloc(c),
            (PdImpl::Soft(p), CtxImpl::Soft(c)) => p.dealloc(c),
            _ => {}
        }
    }

    pub(crate) fn reg_mr(
        &self,
        pd: &Pd,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<(MrImpl, u32, u32)> {
        match (self, &pd.context().inner.imp) {
            (PdImpl::Verbs(p), CtxImpl::Verbs(c)) => p
                .reg_mr(c, addr, len, access)
                .map(|(m, l, r)| (MrImpl::Verbs(m), l, r)),
            (PdImpl::Soft(p), CtxImpl::Soft(c)) => p
                .reg_mr(c, addr, len, access)
                .map(|(m, l, r)| (MrImpl::Soft(m), l, r)),
            _ => Err(mismatch()),
        }
    }

    pub(crate) fn create_qp(
        &self,
        pd: &Pd,
        send_cq: &CqImpl,
        recv_cq: &CqImpl,
        caps: &QpCaps,
        sig_all: bool,
    ) -> Result<(QpImpl, u32, QpCaps)> {
        match (self, &pd.context().inner.imp, send_cq, recv_cq) {
            (PdImpl::Verbs(p), CtxImpl::Verbs(c), CqImpl::Verbs(s), CqImpl::Verbs(r)) => p
                .create_qp(c, s, r, caps, sig_all)
                .map(|(q, n, caps)| (QpImpl::Verbs(q), n, caps)),
            (PdImpl::Soft(p), CtxImpl::Soft(c), CqImpl::Soft(s), CqImpl::Soft(r)) => p
                .create_qp(c, s, r, caps, sig_all, &sink(&pd.context().inner.events))
                .map(|(q, n, caps)| (QpImpl::Soft(q), n, caps)),
            _ => Err(mismatch()),
        }
    }
}

impl MrImpl {
    pub(crate) fn deregister(&self, pd: &Pd) {
        match (self, &pd.context().inner.imp) {
            (MrImpl::Verbs(m), CtxImpl::Verbs(c)) => m.deregister(c),
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

    pub(crate) fn destroy(&self, ctx: &crate::Context) {
        match (self, &ctx.inner.imp) {
            (CqImpl::Verbs(q), CtxImpl::Verbs(c)) => q.destroy(c),
            (CqImpl::Soft(q), CtxImpl::Soft(c)) => q.destroy(c),
            _ => {}
        }
    }
}

impl QpImpl {
    pub(crate) fn modify(&self, pd: &Pd, attr: &QpAttr) -> Result<()> {
        match (self, &pd.context().inner.imp) {
            (QpImpl::Verbs(q), CtxImpl::Verbs(c)) => q.modify(c, attr),
            (QpImpl::Soft(q), CtxImpl::Soft(c)) => q.modify(c, attr),
            _ => Err(mismatch()),
        }
    }

    pub(crate) fn query_state(&self) -> Result<QpState> {
        match self {
            QpImpl::Verbs(q) => q.query_state(),
            QpImpl::Soft(q) => Ok(q.state()),
        }
    }

    #[inline]
    pub(crate) fn post_send(&self, pd: &Pd, reqs: &[SendReq<'_>]) -> PostResult {
        match (self, &pd.context().inner.imp) {
            (QpImpl::Verbs(q), CtxImpl::Verbs(c)) => q.post_send(c, reqs),
            (QpImpl::Soft(q), CtxImpl::Soft(c)) => q.post_send(c, reqs),
            _ => Err((0, mismatch())),
        }
    }

    #[inline]
    pub(crate) fn post_recv(&self, pd: &Pd, reqs: &[RecvReq<'_>]) -> PostResult {
        match (self, &pd.context().inner.imp) {
            (QpImpl::Verbs(q), CtxImpl::Verbs(c)) => q.post_recv(c, reqs),
            (QpImpl::Soft(q), CtxImpl::Soft(c)) => q.post_recv(c, reqs),
            _ => Err((0, mismatch())),
        }
    }

    pub(crate) fn destroy(&self, pd: &Pd) {
        match (self, &pd.context().inner.imp) {
            (QpImpl::Verbs(q), CtxImpl::Verbs(c)) => q.destroy(c),
            (QpImpl::Soft(q), CtxImpl::Soft(c)) => q.destroy(c),
            _ => {}
        }
    }
}

impl soft::driver::notify::EventSink for EventQueue {
    fn report(&self, ev: crate::vocab::AsyncEvent) {
        self.push(ev);
    }
}
