//! A queue pair's shared state: what every handle of it points to. The two request rings
//! (a slot per posted request, whose sequence number is the `wr_id` the device sees), limit
//! checks, posting through the provider line, and translating completions back to the
//! application's `wr_id`s.

#![allow(unsafe_code)] // posts through the provider line; getrandom

use std::sync::{Arc, Mutex};

use smallvec::SmallVec;

use super::QpConfig;
use crate::cq::{Cq, RECV_TAG};
use crate::error::{Error, Result};
use crate::limits;
use crate::pd::Pd;
use crate::provider::{QpImpl, RecvReq, SendReq};
use crate::vocab::Limit;
use crate::vocab::{
    Completion, QpAttr, QpCaps, QpFailure, SendFlags, Sge, WcOpcode, WcStatus, WorkQueue, WrOpcode,
};
use crate::wr::{RecvWr, SendWr};

/// The ring of in-flight requests of one work queue.
struct WrRing {
    /// User `wr_id` and whether the user asked for a completion, per slot.
    slots: Box<[(u64, bool)]>,
    /// Sequence number of the next request.
    head: u64,
    /// Every request below this has completed.
    retired: u64,
    /// Requests posted without a device-level signal since the last signaled one.
    unsignaled_run: u32,
}

impl WrRing {
    fn new(depth: u32) -> WrRing {
        WrRing {
            slots: vec![(0u64, false); depth.max(1) as usize].into_boxed_slice(),
            head: 0,
            retired: 0,
            unsignaled_run: 0,
        }
    }

    fn depth(&self) -> u64 {
        self.slots.len() as u64
    }

    fn outstanding(&self) -> u64 {
        self.head - self.retired
    }

    fn slot(&mut self, seq: u64) -> &mut (u64, bool) {
        let d = self.slots.len();
        &mut self.slots[(seq % d as u64) as usize]
    }
}

/// A queue pair's shared state: what every handle of it points to.
pub(crate) struct QpShared {
    pub(crate) pd: Pd,
    pub(crate) send_cq: Cq,
    pub(crate) recv_cq: Cq,
    pub(crate) imp: QpImpl,
    pub(crate) qp_num: u32,
    pub(crate) caps: QpCaps,
    pub(crate) sig_all: bool,
    pub(crate) initial_psn: u32,
    sq: Mutex<WrRing>,
    rq: Mutex<WrRing>,
    /// Set once the queue pair is known to be in the error state (a completion with an error
    /// status, or a move to ERR): later posts are refused with [`Error::QpInError`], on every
    /// device (they could only be flushed, and on siw not even that).
    failed: std::sync::atomic::AtomicBool,
    /// What put the queue pair in the error state, the first the SDK saw.
    cause: std::sync::OnceLock<QpFailure>,
    /// What the queue pair's connection depends on (rdma_cm's identifier), released only after
    /// the queue pair is destroyed.
    pub(crate) anchor: std::sync::OnceLock<Arc<dyn std::any::Any + Send + Sync>>,
}

impl Drop for QpShared {
    fn drop(&mut self) {
        // Destroy first: once the device has let go, nothing can complete into the rings.
        // SAFETY: Drop runs once and the queue pair is not used after.
        unsafe { self.imp.destroy(self.ctx()) };
        self.send_cq.unregister_qp(self.qp_num);
        self.recv_cq.unregister_qp(self.qp_num);
    }
}

/// The largest number of SGEs a safe request carries without a heap allocation.
const INLINE_SGES: usize = 8;
/// Work requests a post lays out on the stack before spilling to the heap.
const INLINE_WRS: usize = 4;

impl QpShared {
    pub(crate) fn new(
        pd: Pd,
        config: &QpConfig,
        imp: QpImpl,
        qp_num: u32,
        caps: QpCaps,
    ) -> Arc<QpShared> {
        let shared = Arc::new(QpShared {
            pd,
            send_cq: config.send_cq.clone(),
            recv_cq: config.recv_cq.clone(),
            imp,
            qp_num,
            caps,
            sig_all: config.sig_all,
            initial_psn: random_psn(),
            sq: Mutex::new(WrRing::new(caps.max_send_wr)),
            rq: Mutex::new(WrRing::new(caps.max_recv_wr)),
            failed: std::sync::atomic::AtomicBool::new(false),
            cause: std::sync::OnceLock::new(),
            anchor: std::sync::OnceLock::new(),
        });
        shared.send_cq.register_qp(qp_num, Arc::downgrade(&shared));
        if !Arc::ptr_eq(&shared.send_cq.inner, &shared.recv_cq.inner) {
            shared.recv_cq.register_qp(qp_num, Arc::downgrade(&shared));
        }
        shared
    }

    pub(crate) fn modify(&self, attr: &QpAttr) -> Result<()> {
        if attr.state == Some(crate::vocab::QpState::Err) {
            // Recorded first, so the flushes the move causes find it.
            let _ = self.cause.set(QpFailure::Local);
        }
        self.imp.modify(self.ctx(), attr)?;
        if attr.state == Some(crate::vocab::QpState::Err) {
            self.mark_failed();
        }
        Ok(())
    }

    /// Moves the queue pair to the error state for `cause` (unless an earlier cause is known):
    /// every outstanding request completes with a flush error carrying it.
    pub(crate) fn fail(&self, cause: QpFailure) -> Result<()> {
        let _ = self.cause.set(cause);
        self.modify(&QpAttr {
            state: Some(crate::vocab::QpState::Err),
            ..QpAttr::EMPTY
        })
    }

    /// Whether sends posted here still wait for their completions to be reaped (an unsignaled
    /// send counts until a later completion retires it).
    pub(crate) fn sends_outstanding(&self) -> bool {
        self.sq
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .outstanding()
            > 0
    }

    /// What put the queue pair in the error state, when the SDK saw it.
    pub(crate) fn failure(&self) -> Option<QpFailure> {
        self.cause.get().copied()
    }

    fn mark_failed(&self) {
        self.failed
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Refuses a post to a queue pair known to be in the error state: it could only be
    /// flushed (on siw, not even that: it would never complete).
    fn check_postable(&self) -> Result<()> {
        if self.failed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(Error::QpInError {
                qp_num: self.qp_num,
                cause: self.failure(),
            });
        }
        Ok(())
    }

    /// A work request's capacity check: this queue pair's `capacity`, with the device's
    /// maximum named for the error.
    fn check_capacity(&self, limit: Limit, requested: u64, capacity: u32) -> Result<()> {
        if requested <= u64::from(capacity) {
            return Ok(());
        }
        let l = self.pd.context().limits();
        let device_max = match limit {
            Limit::MaxSendSge => l.max_send_sge,
            Limit::MaxRecvSge => l.max_recv_sge,
            _ => l.max_inline_data,
        };
        Err(Error::QpCapacityExceeded {
            limit,
            requested,
            capacity: u64::from(capacity),
            device_max: u64::from(device_max),
        })
    }

    /// The device context's provider object.
    pub(crate) fn ctx(&self) -> &crate::provider::CtxImpl {
        &self.pd.context().inner.imp
    }

    /// Checks one send request against the limits. `lens`: the local length and the remote
    /// region's length, to compare (safe requests know both).
    pub(crate) fn validate_send(&self, r: &SendReq<'_>, lens: Option<(u64, u64)>) -> Result<()> {
        let limits = self.pd.context().limits();
        limits.check_opcode(r.opcode, self.pd.context().name())?;
        let n = r.sges.len() as u32;
        let total = r.total_len();
        if r.flags.contains(SendFlags::INLINE) {
            if r.opcode.writes_local() {
                return Err(Error::invalid("READ and atomics cannot be inline"));
            }
            self.check_capacity(Limit::MaxInlineData, total, self.caps.max_inline_data)?;
        } else {
            self.check_capacity(Limit::MaxSendSge, u64::from(n), self.caps.max_send_sge)?;
        }
        limits::check_max64(Limit::MaxMsgSize, total, limits.max_msg_size)?;
        match r.opcode {
            WrOpcode::RdmaRead => {
                limits::check_max(Limit::MaxSgeRd, n, limits.max_sge_rd)?;
                if n == 0 {
                    return Err(Error::invalid(
                        "RDMA READ needs one local SGE (use a zero-length one for a zero-byte read)",
                    ));
                }
            }
            WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => {
                if n != 1 {
                    return Err(Error::LimitExceeded {
                        limit: Limit::AtomicSge,
                        requested: n as u64,
                        max: 1,
                    });
                }
                if r.sges[0].length != 8 {
                    return Err(Error::invalid(format!(
                        "an atomic's local buffer must be 8 bytes, not {}",
                        r.sges[0].length
                    )));
                }
                if r.remote_addr % 8 != 0 {
                    return Err(Error::invalid(format!(
                        "atomic target {:#x} is not 8-byte aligned",
                        r.remote_addr
                    )));
                }
            }
            _ => {}
        }
        if let Some((len, remote_len)) = lens {
            if r.opcode.is_remote() {
                let need = if r.opcode.is_atomic() { 8 } else { len };
                if need > remote_len {
                    return Err(Error::OutOfBounds {
                        what: "remote region",
                        offset: 0,
                        len: need,
                        available: remote_len,
                    });
                }
            }
        }
        Ok(())
    }

    /// Checks one receive against the limits: its SGE count and its total length.
    pub(crate) fn validate_recv(&self, sges: &[Sge]) -> Result<()> {
        self.check_capacity(Limit::MaxRecvSge, sges.len() as u64, self.caps.max_recv_sge)?;
        let total: u64 = sges.iter().map(|s| u64::from(s.length)).sum();
        let max_msg = self.pd.context().limits().max_msg_size;
        limits::check_max64(Limit::MaxMsgSize, total, max_msg)
    }

    /// Validates and posts safe send requests as one chain. `signal_each` forces a
    /// device-level signal on every request: a scope needs a completion for the last request
    /// the device accepts, whichever that turns out to be.
    ///
    /// Returns the sequence number of the last request the device accepted (none when it
    /// accepted none) with the outcome. A request the SDK refuses posts nothing of the chain.
    pub(crate) fn post_send_wrs<'m: 'i, 'i>(
        &self,
        wrs: impl IntoIterator<Item = SendWr<'m, 'i>>,
        signal_each: bool,
    ) -> (Option<u64>, Result<()>) {
        // A post of a few requests (the usual case) builds its lists on the stack.
        let mut sges: SmallVec<[Sge; INLINE_SGES]> = SmallVec::new();
        let mut meta: SmallVec<[(SendWr<'m, 'i>, usize, usize); INLINE_WRS]> = SmallVec::new();
        for wr in wrs {
            let start = sges.len();
            if let Err(e) = wr.sges(&mut sges) {
                return (None, Err(e));
            }
            meta.push((wr, start, sges.len()));
        }
        let mut reqs: SmallVec<[SendReq<'_>; INLINE_WRS]> = SmallVec::with_capacity(meta.len());
        for (wr, start, end) in &meta {
            let req = SendReq {
                wr_id: wr.wr_id,
                opcode: wr.opcode,
                flags: wr.flags,
                sges: &sges[*start..*end],
                remote_addr: wr.remote.addr,
                rkey: wr.remote.rkey,
                imm: wr.imm,
                invalidate_rkey: wr.invalidate_rkey,
                compare_add: wr.compare_add,
                swap: wr.swap,
            };
            if let Err(e) = self.validate_send(&req, Some((wr.local_len(), wr.remote.len))) {
                return (None, Err(e));
            }
            reqs.push(req);
        }
        // Inline SGEs come from the requests' `&'i [u8]` data, borrowed for this whole call.
        // SAFETY: `post_reqs`'s contract holds (above).
        unsafe { self.post_reqs(&mut reqs, signal_each) }
    }

    /// Posts provider-level send requests as one chain, assigning sequence numbers. Returns the
    /// sequence number of the last request the device accepted, if any, with the outcome.
    ///
    /// # Safety
    /// Inline requests' SGEs name bytes readable for the duration of the call.
    pub(crate) unsafe fn post_reqs(
        &self,
        reqs: &mut [SendReq<'_>],
        signal_each: bool,
    ) -> (Option<u64>, Result<()>) {
        if reqs.is_empty() {
            return (None, Ok(()));
        }
        if let Err(e) = self.check_postable() {
            return (None, Err(e));
        }
        let mut sq = self.sq.lock().unwrap_or_else(|e| e.into_inner());
        let room = sq.depth() - sq.outstanding();
        if (reqs.len() as u64) > room {
            let full = Error::QueueFull {
                queue: WorkQueue::Send,
                depth: sq.depth() as u32,
            };
            return (None, Err(full));
        }
        let first = sq.head;
        let threshold = (sq.depth() / 2).max(1) as u32;
        for (i, r) in reqs.iter_mut().enumerate() {
            let seq = first + i as u64;
            let user_signaled = self.sig_all || r.flags.contains(SendFlags::SIGNALED);
            *sq.slot(seq) = (r.wr_id, user_signaled);
            let mut device_signal = user_signaled || signal_each;
            if !device_signal && sq.unsignaled_run + 1 >= threshold {
                device_signal = true;
            }
            if device_signal {
                sq.unsignaled_run = 0;
                r.flags.insert(SendFlags::SIGNALED);
            } else {
                sq.unsignaled_run += 1;
                r.flags.remove(SendFlags::SIGNALED);
            }
            r.wr_id = seq;
        }
        // SAFETY: the caller's contract is the provider's.
        let (accepted, result) = match unsafe { self.imp.post_send(self.ctx(), reqs) } {
            Ok(()) => (reqs.len(), Ok(())),
            Err((accepted, e)) => (accepted, Err(e)),
        };
        sq.head = first + accepted as u64;
        ((accepted > 0).then(|| sq.head - 1), result)
    }

    /// Validates and posts safe receives; returns as [`QpShared::post_send_wrs`] does.
    pub(crate) fn post_recv_wrs<'m>(
        &self,
        wrs: impl IntoIterator<Item = RecvWr<'m>>,
    ) -> (Option<u64>, Result<()>) {
        let mut sges: SmallVec<[Sge; INLINE_SGES]> = SmallVec::new();
        let mut spans: SmallVec<[(u64, usize, usize); INLINE_WRS]> = SmallVec::new();
        let mut held: SmallVec<[RecvWr<'m>; INLINE_WRS]> = SmallVec::new();
        for wr in wrs {
            let start = sges.len();
            let checked = wr
                .sges(&mut sges)
                .and_then(|()| self.validate_recv(&sges[start..]));
            if let Err(e) = checked {
                return (None, Err(e));
            }
            spans.push((wr.wr_id, start, sges.len()));
            held.push(wr);
        }
        let reqs: SmallVec<[RecvReq<'_>; INLINE_WRS]> = spans
            .iter()
            .map(|&(wr_id, s, e)| RecvReq {
                wr_id,
                sges: &sges[s..e],
            })
            .collect();
        let posted = self.post_recv_reqs(&reqs);
        drop(held);
        posted
    }

    /// Posts provider-level receives; returns as [`QpShared::post_reqs`] does.
    pub(crate) fn post_recv_reqs(&self, reqs: &[RecvReq<'_>]) -> (Option<u64>, Result<()>) {
        if reqs.is_empty() {
            return (None, Ok(()));
        }
        if let Err(e) = self.check_postable() {
            return (None, Err(e));
        }
        let mut rq = self.rq.lock().unwrap_or_else(|e| e.into_inner());
        let room = rq.depth() - rq.outstanding();
        if (reqs.len() as u64) > room {
            let full = Error::QueueFull {
                queue: WorkQueue::Recv,
                depth: rq.depth() as u32,
            };
            return (None, Err(full));
        }
        let first = rq.head;
        let mut tagged: SmallVec<[RecvReq<'_>; INLINE_WRS]> = SmallVec::with_capacity(reqs.len());
        for (i, r) in reqs.iter().enumerate() {
            let seq = first + i as u64;
            *rq.slot(seq) = (r.wr_id, true);
            tagged.push(RecvReq {
                wr_id: seq | RECV_TAG,
                sges: r.sges,
            });
        }
        let (accepted, result) = match self.imp.post_recv(self.ctx(), &tagged) {
            Ok(()) => (reqs.len(), Ok(())),
            Err((accepted, e)) => (accepted, Err(e)),
        };
        rq.head = first + accepted as u64;
        ((accepted > 0).then(|| rq.head - 1), result)
    }

    /// Maps a device completion back to the application's request, retiring every request up
    /// to it. `None` for completions nobody asked for (SDK-forced signals) and stale entries.
    pub(crate) fn translate(&self, wc: &Completion) -> Option<Completion> {
        let recv = wc.wr_id & RECV_TAG != 0;
        let seq = wc.wr_id & !RECV_TAG;
        let (wr_id, wanted) = {
            let mut ring = if recv { &self.rq } else { &self.sq }
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if seq < ring.retired || seq >= ring.head {
                return None;
            }
            let slot = *ring.slot(seq);
            ring.retired = seq + 1;
            slot
        };
        let mut c = *wc;
        if !wc.status.is_success() {
            // Any error completion leaves the queue pair in the error state. The first one that
            // is not a flush is the cause (it names itself), unless the SDK already knew of one
            // (a lost peer, a move to ERR); every later one carries it.
            self.mark_failed();
            if wc.status != WcStatus::WrFlushErr {
                let _ = self.cause.set(QpFailure::Request {
                    wr_id,
                    status: wc.status,
                    opcode: wc.opcode,
                    vendor_err: wc.vendor_err,
                });
            }
            c.cause = self.failure();
        }
        if !wanted && wc.status.is_success() {
            return None;
        }
        c.wr_id = wr_id;
        if recv && !c.status.is_success() {
            c.opcode = WcOpcode::Recv;
        }
        c.qp_num = self.qp_num;
        Some(c)
    }

    /// Retires every outstanding request of both queues without a completion: for a queue pair
    /// the device has reset, which dropped them. Their late completions, if any were queued,
    /// are ignored as stale.
    pub(crate) fn abandon_outstanding(&self) {
        for ring in [&self.sq, &self.rq] {
            let mut ring = ring.lock().unwrap_or_else(|e| e.into_inner());
            ring.retired = ring.head;
            ring.unsignaled_run = 0;
        }
    }

    /// Whether every request up to `sq_hi` / `rq_hi` has completed.
    pub(crate) fn retired_past(&self, sq_hi: Option<u64>, rq_hi: Option<u64>) -> bool {
        let sq_done =
            sq_hi.is_none_or(|hi| self.sq.lock().unwrap_or_else(|e| e.into_inner()).retired > hi);
        let rq_done =
            rq_hi.is_none_or(|hi| self.rq.lock().unwrap_or_else(|e| e.into_inner()).retired > hi);
        sq_done && rq_done
    }
}

/// A random 24-bit PSN (from the kernel's generator).
pub(crate) fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: `b` is a valid, writable 4-byte buffer for the duration of the call.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 4 {
        // Fall back on the clock; PSNs need not be secret, only unlikely to repeat.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0x5a5a5a);
        return t & 0xff_ffff;
    }
    u32::from_ne_bytes(b) & 0xff_ffff
}
