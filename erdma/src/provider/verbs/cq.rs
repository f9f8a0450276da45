//! Completion queues of a kernel device and what their waiters sleep on.

use erdma_sys as sys;

use super::VerbsCtx;
use crate::error::{Error, Result};
use crate::vocab::{Completion, WcOpcode, WcStatus};

use super::events::{self, CqFault};
use std::ptr;

/// The descriptor a completion queue is waited on through: an epoll set of its completion
/// channel and of its failure's wake-up, so a waiter also wakes when the queue fails (an
/// overrun, reported as an asynchronous event, not through the channel).
pub(super) fn wait_set(
    channel_fd: std::os::fd::RawFd,
) -> Result<(std::sync::Arc<CqFault>, std::os::fd::OwnedFd)> {
    use std::os::fd::FromRawFd;
    let fault = std::sync::Arc::new(
        CqFault::new().map_err(|e| Error::io("a completion queue's wake-up eventfd", e))?,
    );
    // SAFETY: plain epoll_create1 call.
    let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if raw < 0 {
        return Err(Error::last_os("epoll_create1 for a completion queue"));
    }
    // SAFETY: `raw` is a new descriptor owned by nobody else.
    let epoll = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
    for fd in [channel_fd, fault.kick_fd()] {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: fd as u64,
        };
        // SAFETY: both descriptors are open; `ev` is a valid event.
        if unsafe { libc::epoll_ctl(raw, libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
            return Err(Error::last_os("epoll_ctl for a completion queue"));
        }
    }
    Ok((fault, epoll))
}

/// A completion queue.
pub(crate) struct VerbsCq {
    pub(super) lib: &'static sys::IbVerbs,
    pub(super) ctx: *mut sys::ibv_context,
    pub(super) cq: *mut sys::ibv_cq,
    pub(super) channel: *mut sys::ibv_comp_channel,
    /// Events taken from the channel but not yet acknowledged (acknowledged in batches).
    pub(super) unacked: std::sync::Mutex<u32>,
    /// Failure reported by an asynchronous event (overrun, device fatal).
    pub(super) fault: std::sync::Arc<CqFault>,
    /// What waiters sleep on: the channel and the failure's wake-up ([`wait_set`]).
    pub(super) epoll: std::os::fd::OwnedFd,
}

// SAFETY: ibv_poll_cq and friends are thread-safe; the pointer is owned by one handle.
unsafe impl Send for VerbsCq {}
// SAFETY: as above.
unsafe impl Sync for VerbsCq {}

impl VerbsCq {
    #[inline]
    pub(crate) fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        const N: usize = 32;
        // Not zeroed: an empty poll (most of a busy-polling loop) would pay for 1.5 KiB of
        // stores; the provider writes the entries it returns.
        let mut wcs: [std::mem::MaybeUninit<sys::ibv_wc>; N] = [std::mem::MaybeUninit::uninit(); N];
        let want = out.len().min(N) as i32;
        // SAFETY: `cq` is live; `wcs` has room for `want` entries.
        let n = unsafe { sys::ibv_poll_cq(self.cq, want, wcs.as_mut_ptr().cast()) };
        if n < 0 {
            return Err(Error::errno("ibv_poll_cq", -n));
        }
        let n = (n as usize).min(want as usize);
        if n == 0 && self.fault.take() {
            return Err(Error::Verb {
                verb: "ibv_poll_cq",
                source: std::io::Error::other(
                    "completion queue error (the device reported an overrun or a fatal error): \
                     completions were lost and the queue pairs using it are in the error state \
                     (make the CQ deeper)",
                ),
            });
        }
        // SAFETY: ibv_poll_cq initialised the first `n` entries (at most `want`).
        let done = unsafe { std::slice::from_raw_parts(wcs.as_ptr().cast::<sys::ibv_wc>(), n) };
        for (o, w) in out.iter_mut().zip(done) {
            // SAFETY: both union members are u32s; which one is meaningful is told by wc_flags.
            let imm_or_inv = unsafe { w.__bindgen_anon_1.imm_data };
            let mut c = Completion::new(
                w.wr_id,
                WcStatus::from_raw(w.status),
                WcOpcode::from_raw(w.opcode),
                w.qp_num,
            );
            c.vendor_err = w.vendor_err;
            c.byte_len = w.byte_len;
            c.imm = (w.wc_flags & crate::vocab::WC_WITH_IMM != 0).then(|| u32::from_be(imm_or_inv));
            c.invalidated_rkey =
                (w.wc_flags & crate::vocab::WC_WITH_INV != 0).then_some(imm_or_inv);
            c.src_qp = w.src_qp;
            *o = c;
        }
        Ok(n)
    }

    /// Requests an event on the channel for the next (solicited) completion.
    pub(crate) fn arm(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: `cq` is live.
        let rc = unsafe { sys::ibv_req_notify_cq(self.cq, i32::from(solicited_only)) };
        if rc != 0 {
            return Err(Error::errno("ibv_req_notify_cq", rc));
        }
        Ok(())
    }

    /// The descriptor to wait on: readable on a completion event or on the queue's failure.
    pub(crate) fn event_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.epoll.as_raw_fd()
    }

    /// Takes every pending event from the channel (so one readiness never hides another) and
    /// acknowledges them in batches, and clears the failure's wake-up. Returns how many
    /// notifications there were (the wake-up counting as one).
    pub(crate) fn consume_events(&self) -> Result<u32> {
        let kicked = u32::from(self.fault.consume_kick());
        let mut taken = 0u32;
        loop {
            let mut cq: *mut sys::ibv_cq = ptr::null_mut();
            let mut cq_ctx: *mut std::os::raw::c_void = ptr::null_mut();
            // SAFETY: the channel is live and non-blocking; both out-parameters are valid.
            let rc = unsafe { (self.lib.ibv_get_cq_event)(self.channel, &mut cq, &mut cq_ctx) };
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EAGAIN) || taken + kicked > 0 {
                    break;
                }
                return Err(Error::Verb {
                    verb: "ibv_get_cq_event",
                    source: e,
                });
            }
            taken += 1;
        }
        if taken > 0 {
            let mut unacked = self.unacked.lock().unwrap_or_else(|e| e.into_inner());
            *unacked += taken;
            if *unacked >= 64 {
                // SAFETY: acknowledges events taken from this CQ's channel.
                unsafe { (self.lib.ibv_ack_cq_events)(self.cq, *unacked) };
                *unacked = 0;
            }
        }
        Ok(taken + kicked)
    }

    /// # Safety
    /// Called at most once per object, by its owner's `Drop`; the object is not used after.
    pub(crate) unsafe fn destroy(&self, _ctx: &VerbsCtx) {
        events::unwatch_cq(self.ctx, self.cq);
        let unacked = *self.unacked.lock().unwrap_or_else(|e| e.into_inner());
        // Every event taken is acknowledged first, as ibv_destroy_cq requires, then the channel
        // goes.
        // SAFETY: called once by the owner's Drop, after every QP using the CQ is gone.
        unsafe {
            if unacked > 0 {
                (self.lib.ibv_ack_cq_events)(self.cq, unacked);
            }
            (self.lib.ibv_destroy_cq)(self.cq);
            (self.lib.ibv_destroy_comp_channel)(self.channel);
        }
    }
}
