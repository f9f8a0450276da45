//! The completer: consumes ACKs, NAKs and read/atomic responses, and completes send work
//! requests.
//!
//! Owns the oldest unacknowledged PSN, the retry and RNR-retry budgets, the retransmit and RNR
//! timers' meaning, and the mapping of NAK codes to completion statuses (rxe's). Differences from
//! rxe, on purpose:
//! - `retry_cnt` follows IBTA: 7 is seven retries, so a vanished peer fails in bounded time
//!   (`timeout · (retry_cnt + 1)`). Both budgets are restored whenever a response makes
//!   progress; an RNR NAK restores the transport budget (the peer answered).
//! - A gap in read responses, or a response past a READ/atomic that lacks its own, starts a retry
//!   at once instead of waiting for the timer (again at the same PSN only after twice the
//!   measured round-trip time, so responses already in flight do not each restart it). Such
//!   retries prove the peer alive and do not spend the retry budget or move the timer; at most
//!   32 of them run between two responses that make progress. A plain ACK
//!   never completes a READ or atomic.
//! - Responses for PSNs never sent are ignored.
//! - Where rxe leaves the status of a protocol violation unset, the request completes with
//!   `BAD_RESP_ERR`.

use super::completion::WcStatus;
use super::device::DropReason;
use super::memory::Memory;
use super::qp::{SgError, Shared, scatter};
use super::queue::WqeState;
use super::requester::Requester;
use super::timer::Timer;
use super::wr::{SendData, WrOpcode};
use super::{Instant, wr::SgeList};
use crate::soft::wire::aeth::rnr_timer;
use crate::soft::wire::{NakCode, OpFlags, Opcode, PacketView, Psn, Syndrome};
use core::time::Duration;

#[derive(Debug)]
pub(super) struct Completer {
    /// The oldest unacknowledged PSN (the next response PSN expected).
    pub psn: Psn,
    /// Opcode of the previous response while a multi-packet read response is in progress.
    opcode: Option<Opcode>,
    retry_left: u8,
    rnr_left: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    /// A retry started and no progress came since (further NAKs do not start another).
    retry_started: bool,
    /// When the last retry started.
    last_retry_at: Option<Instant>,
    /// Gap retries left before the next progress (a safety net: without progress only timeouts,
    /// which spend the retry budget, go on).
    gap_left: u8,
    /// Smoothed round-trip time (request sent → its first response), when measured.
    srtt: Option<Duration>,
}

/// Gap retries allowed between two responses that make progress.
const GAP_RETRIES: u8 = 32;

/// What started a retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RetryCause {
    /// The local ACK timer.
    Timeout,
    /// A PSN sequence NAK.
    Nak,
    /// A gap in read responses, or responses past a READ/atomic that lacks its own.
    Gap,
}

impl Completer {
    pub fn new() -> Completer {
        Completer {
            psn: Psn::ZERO,
            opcode: None,
            retry_left: 0,
            rnr_left: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            retry_started: false,
            last_retry_at: None,
            gap_left: GAP_RETRIES,
            srtt: None,
        }
    }

    /// Entering RTS.
    pub fn start(&mut self, sq_psn: Psn, retry_cnt: u8, rnr_retry: u8) {
        *self = Completer::new();
        self.psn = sq_psn;
        self.set_limits(retry_cnt, rnr_retry);
    }

    /// New retry budgets (RTS entry or SQD → SQD).
    pub fn set_limits(&mut self, retry_cnt: u8, rnr_retry: u8) {
        self.retry_cnt = retry_cnt;
        self.rnr_retry = rnr_retry;
        self.retry_left = retry_cnt;
        self.rnr_left = rnr_retry;
    }

    /// A response made progress: budgets restored, timer re-armed, round trip sampled.
    fn progress(&mut self, s: &mut Shared, req: &mut Requester, now: Instant) {
        if let Some((psn, sent)) = req.rtt_probe {
            if psn.before(self.psn) {
                let sample = now - sent;
                self.srtt = Some(match self.srtt {
                    Some(old) => (old * 7 + sample) / 8,
                    None => sample,
                });
                req.rtt_probe = None;
            }
        }
        self.retry_left = self.retry_cnt;
        self.rnr_left = self.rnr_retry;
        self.retry_started = false;
        self.gap_left = GAP_RETRIES;
        self.rearm(s, req, now);
    }

    /// How long a gap retry waits before another at the same PSN.
    fn gap_holdoff(&self, s: &Shared) -> Duration {
        match (self.srtt, s.ack_timeout()) {
            (Some(rtt), _) => rtt * 2,
            (None, Some(t)) => t / 4,
            (None, None) => Duration::from_millis(1),
        }
    }

    fn rearm(&mut self, s: &mut Shared, req: &Requester, now: Instant) {
        match s.ack_timeout() {
            Some(t) if s.sq.has_outstanding() && !req.wait_rnr => {
                s.timers.set(Timer::Retransmit, now + t)
            }
            _ => s.timers.stop(Timer::Retransmit),
        }
    }

    /// Completes the oldest request successfully.
    fn complete_head(&mut self, s: &mut Shared, req: &mut Requester) {
        if let Some(e) = s.sq.pop_front() {
            if e.rd_counted {
                req.rd_outstanding = req.rd_outstanding.saturating_sub(1);
            }
            self.psn = self.psn.later(e.last_psn + 1);
            self.opcode = None;
            s.complete_send(&e, WcStatus::Success);
        }
    }

    /// Completes the oldest request with an error; the queue pair goes to ERR.
    fn fail_head(&mut self, s: &mut Shared, status: WcStatus) {
        if let Some(e) = s.sq.pop_front() {
            s.complete_send(&e, status);
        }
        s.fatal = true;
    }

    /// Starts go-back-N from `self.psn`. Timeouts always retry; NAKs only when no retry is under
    /// way; gaps when none is, or the last one is older than the holdoff.
    fn retry(&mut self, s: &mut Shared, req: &mut Requester, now: Instant, cause: RetryCause) {
        if !s.sq.has_outstanding() || (cause != RetryCause::Timeout && req.wait_rnr) {
            return;
        }
        match cause {
            RetryCause::Timeout => {}
            RetryCause::Nak if self.retry_started => return,
            RetryCause::Gap if self.gap_left == 0 => return,
            RetryCause::Gap if self.retry_started => {
                let holdoff = self.gap_holdoff(s);
                if self.last_retry_at.is_some_and(|t| now < t + holdoff) {
                    return;
                }
            }
            _ => {}
        }
        if cause == RetryCause::Gap {
            self.gap_left -= 1;
        } else if self.retry_left == 0 {
            self.fail_head(s, WcStatus::RetryExcErr);
            return;
        } else {
            self.retry_left -= 1;
        }
        self.retry_started = true;
        self.last_retry_at = Some(now);
        req.need_retry = true;
        req.repeat_on_rewind = true;
        s.counters.retries += 1;
        if cause == RetryCause::Timeout {
            s.counters.timeouts += 1;
        }
        // A gap retry leaves the timer alone: without progress the queue pair still fails
        // within `timeout · (retry_cnt + 1)` of the last progress, whatever the peer sends.
        if cause != RetryCause::Gap {
            if let Some(t) = s.ack_timeout() {
                s.timers.set(Timer::Retransmit, now + t);
            }
        }
    }

    /// The local ACK timer expired.
    pub fn on_retransmit_timeout(&mut self, s: &mut Shared, req: &mut Requester, now: Instant) {
        if !req.wait_rnr {
            self.retry(s, req, now, RetryCause::Timeout);
        }
    }

    /// The RNR wait is over: resend from the oldest unacknowledged PSN.
    pub fn on_rnr_timeout(&mut self, _s: &mut Shared, req: &mut Requester, _now: Instant) {
        if req.wait_rnr {
            req.wait_rnr = false;
            req.need_retry = true;
        }
    }

    /// Handles a response packet.
    pub fn handle<M: Memory + ?Sized>(
        &mut self,
        s: &mut Shared,
        req: &mut Requester,
        now: Instant,
        view: &PacketView<'_>,
        mem: &mut M,
    ) -> Result<(), DropReason> {
        if !s.state.requester_ready() {
            return Err(DropReason::QpNotReady);
        }
        let psn = view.psn();
        if !psn.before(req.sent_limit) {
            return Err(DropReason::Unsolicited);
        }
        let is_ack = view.opcode() == Opcode::Acknowledge
            && view.aeth().is_some_and(|a| a.syndrome.is_ack());
        loop {
            let Some(head) = s.sq.front() else {
                return Err(DropReason::Stale);
            };
            if !head.started() {
                return Err(DropReason::Stale);
            }
            let send_write = head.wqe.opcode.is_send() || head.wqe.opcode.is_write();
            let pending = head.state == WqeState::Pending;
            if psn.after(head.last_psn) {
                if send_write && pending {
                    // A later PSN acknowledges this request too (coalesced ACK).
                    self.complete_head(s, req);
                    self.progress(s, req, now);
                    continue;
                }
                if pending {
                    // The peer is past a READ/atomic whose responses we lack: they were lost
                    // (a gap, like one inside a read reply).
                    self.retry(s, req, now, RetryCause::Gap);
                    return Ok(());
                }
                return Err(DropReason::Stale);
            }
            let d = psn.diff(self.psn);
            if d < 0 {
                if send_write && pending && is_ack && psn == head.last_psn {
                    self.complete_head(s, req);
                    self.progress(s, req, now);
                    return Ok(());
                }
                return Err(DropReason::Stale);
            }
            if d > 0 && !send_write {
                // Read responses arrive in order; a gap means a loss.
                self.retry(s, req, now, RetryCause::Gap);
                return Err(DropReason::OutOfSequence);
            }
            return self.check_ack(s, req, now, view, mem);
        }
    }

    /// A response at the expected PSN (or a cumulative ACK inside a SEND/WRITE) for the oldest
    /// request.
    fn check_ack<M: Memory + ?Sized>(
        &mut self,
        s: &mut Shared,
        req: &mut Requester,
        now: Instant,
        view: &PacketView<'_>,
        mem: &mut M,
    ) -> Result<(), DropReason> {
        let Some(head) = s.sq.front().copied() else {
            return Err(DropReason::Stale);
        };
        let op = view.opcode();
        let psn = view.psn();
        let syndrome = view.aeth().map(|a| a.syndrome);
        let nak_like = matches!(syndrome, Some(sy) if !sy.is_ack());

        let in_sequence = match self.opcode {
            Some(Opcode::ReadResponseFirst | Opcode::ReadResponseMiddle) => {
                matches!(op, Opcode::ReadResponseMiddle | Opcode::ReadResponseLast)
                    || (op == Opcode::ReadResponseFirst && psn == head.first_psn)
                    || (op == Opcode::ReadResponseOnly && head.first_psn == head.last_psn)
                    || (op == Opcode::Acknowledge && nak_like)
            }
            _ => view.has(OpFlags::START),
        };
        if !in_sequence {
            self.fail_head(s, WcStatus::BadRespErr);
            return Ok(());
        }

        match op {
            Opcode::ReadResponseFirst
            | Opcode::ReadResponseMiddle
            | Opcode::ReadResponseLast
            | Opcode::ReadResponseOnly => {
                if op != Opcode::ReadResponseMiddle && nak_like {
                    self.fail_head(s, WcStatus::BadRespErr);
                    return Ok(());
                }
                if head.wqe.opcode != WrOpcode::RdmaRead {
                    self.fail_head(s, WcStatus::FatalErr);
                    return Ok(());
                }
                let payload = view.payload();
                let n = payload.len() as u32;
                let remaining = head.len - head.received;
                let end = view.has(OpFlags::END);
                let mtu = s.mtu();
                let fits = if end {
                    n == remaining
                } else {
                    n == mtu && remaining > mtu
                };
                if !fits {
                    self.fail_head(s, WcStatus::BadRespErr);
                    return Ok(());
                }
                let SendData::Sges(sges) = head.wqe.data else {
                    self.fail_head(s, WcStatus::LocQpOpErr);
                    return Ok(());
                };
                if let Err(e) = scatter(mem, s.cfg.pd, &sges, head.received, payload) {
                    self.fail_head(s, sg_status(e));
                    return Ok(());
                }
                if let Some(h) = s.sq.front_mut() {
                    h.received += n;
                }
                self.opcode = if end { None } else { Some(op) };
                self.psn = psn + 1;
                if end {
                    self.complete_head(s, req);
                }
                self.progress(s, req, now);
                Ok(())
            }
            Opcode::AtomicAcknowledge => {
                if nak_like {
                    self.fail_head(s, WcStatus::BadRespErr);
                    return Ok(());
                }
                if !head.wqe.opcode.is_atomic() {
                    self.fail_head(s, WcStatus::FatalErr);
                    return Ok(());
                }
                let orig = view.atomic_ack_eth().unwrap_or(0);
                let sges = match head.wqe.data {
                    SendData::Sges(l) => l,
                    SendData::Inline(_) => SgeList::new(),
                };
                if let Err(e) = scatter(mem, s.cfg.pd, &sges, 0, &orig.to_ne_bytes()) {
                    self.fail_head(s, sg_status(e));
                    return Ok(());
                }
                self.complete_head(s, req);
                self.progress(s, req, now);
                Ok(())
            }
            Opcode::Acknowledge => match syndrome {
                Some(Syndrome::Ack { .. }) => {
                    let send_write = head.wqe.opcode.is_send() || head.wqe.opcode.is_write();
                    if !send_write {
                        // A plain ACK says nothing about a READ's data or an atomic's value.
                        return Err(DropReason::Stale);
                    }
                    if head.state == WqeState::Pending && psn == head.last_psn {
                        self.complete_head(s, req);
                    } else {
                        self.psn = self.psn.later(psn + 1);
                    }
                    self.progress(s, req, now);
                    Ok(())
                }
                Some(Syndrome::RnrNak { timer }) => {
                    s.counters.rnr_naks_received += 1;
                    if psn.after(self.psn) {
                        // Everything before the refused packet was accepted.
                        self.psn = psn;
                    }
                    // The peer answered: timeouts lost so far do not count against it (the RNR
                    // budget is separate and only progress restores it).
                    self.retry_left = self.retry_cnt;
                    if self.rnr_left == 0 {
                        self.fail_head(s, WcStatus::RnrRetryExcErr);
                        return Ok(());
                    }
                    if self.rnr_retry != 7 {
                        self.rnr_left -= 1;
                    }
                    req.wait_rnr = true;
                    req.need_retry = false;
                    s.timers.stop(Timer::Retransmit);
                    s.timers.set(Timer::RnrRetry, now + rnr_timer(timer));
                    Ok(())
                }
                Some(Syndrome::Nak(NakCode::PsnSequenceError)) => {
                    s.counters.naks_received += 1;
                    if psn.after(self.psn) {
                        // The NAK acknowledges everything before the PSN it expects.
                        self.psn = psn;
                        self.progress(s, req, now);
                    }
                    self.retry(s, req, now, RetryCause::Nak);
                    Ok(())
                }
                Some(Syndrome::Nak(code)) => {
                    s.counters.naks_received += 1;
                    self.fail_head(s, nak_status(code));
                    Ok(())
                }
                Some(Syndrome::Reserved(_)) | None => {
                    self.fail_head(s, WcStatus::BadRespErr);
                    Ok(())
                }
            },
            _ => Err(DropReason::Malformed),
        }
    }
}

/// The completion status a NAK code gives the request (rxe's mapping).
fn nak_status(code: NakCode) -> WcStatus {
    match code {
        NakCode::InvalidRequest => WcStatus::RemInvReqErr,
        NakCode::RemoteAccessError => WcStatus::RemAccessErr,
        _ => WcStatus::RemOpErr,
    }
}

fn sg_status(e: SgError) -> WcStatus {
    match e {
        SgError::Protection => WcStatus::LocProtErr,
        SgError::Length => WcStatus::LocLenErr,
    }
}
