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
//!   at once instead of waiting for the timer (rxe drops such responses and waits for its timer),
//!   but only one until a response makes progress, the timer expires, or the responder's answer
//!   to that retry shows the expected PSN lost again. A responder such as rxe serves a duplicate
//!   READ only after the reply it is sending and then replays the rest of the message, so every
//!   further retry would queue another full replay ahead of the requests behind it. Such a retry
//!   proves the peer alive and does not spend the retry budget; it has a budget of its own
//!   ([`GAP_RETRIES`] between two responses that make progress), after which gaps are left to
//!   the timer, so a peer that keeps answering past a request it never answers can neither
//!   hold that request open for ever nor make every bogus response cost a go-back-N resend.
//!   A plain ACK never completes a READ or atomic.
//! - The timer is restarted by every response that makes progress, and also (at most once per
//!   half period, [`ALIVE_RESTARTS`] times between two retries) by responses that make none: a
//!   slow responder still sending older replies is working, not lost. rxe restarts its timer
//!   after every batch of responses, without a limit; the limit keeps the failure of a peer that
//!   never makes progress bounded.
//! - Responses for PSNs never sent are ignored.
//! - Where rxe leaves the status of a protocol violation unset, the request completes with
//!   `BAD_RESP_ERR`.

use super::device::DropReason;
use super::memory::Memory;
use super::queue::WqeState;
use super::requester::Requester;
use super::shared::{Payload, SgError, Shared, scatter};
use super::timer::Timer;
use super::wr::SendData;
use super::{Instant, wr::SgeList};
use crate::soft::wire::aeth::rnr_timer;
use crate::soft::wire::{NakCode, OpFlags, Opcode, PacketView, Psn, Syndrome};
use crate::vocab::{WcStatus, WrOpcode};

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
    /// The highest PSN of a response that made no progress since the last progress (after a
    /// gap retry: since that retry, starting at the PSN that started it).
    high: Option<Psn>,
    /// While a retry is under way: a response past the expected PSN at or below this one starts
    /// the responder's answer to that retry (the PSN that started a gap retry; for a timeout,
    /// [`high`](Completer::high) when it fired).
    again_at: Option<Psn>,
    /// Timer restarts left to responses that make no progress, until the next progress or a
    /// retry that spends the retry budget.
    alive_left: u32,
    /// Gap retries left until the next progress.
    gap_left: u8,
    /// When the last response arrived.
    heard_at: Option<Instant>,
}

/// Timer restarts by responses that make no progress, between two retries or progress (each at
/// least half a period after the last): a peer still busy with older replies gets up to 128
/// periods before a retry.
pub(super) const ALIVE_RESTARTS: u32 = 256;

/// Gap retries between two responses that make progress (the most a `retry_cnt` of 7 allows
/// timeouts, plus one).
pub(super) const GAP_RETRIES: u8 = 8;

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
            high: None,
            again_at: None,
            alive_left: ALIVE_RESTARTS,
            gap_left: GAP_RETRIES,
            heard_at: None,
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

    /// A response made progress: budgets restored, timer re-armed.
    fn progress(&mut self, s: &mut Shared, req: &mut Requester, now: Instant) {
        self.retry_left = self.retry_cnt;
        self.rnr_left = self.rnr_retry;
        self.retry_started = false;
        self.high = None;
        self.again_at = None;
        self.alive_left = ALIVE_RESTARTS;
        self.gap_left = GAP_RETRIES;
        self.rearm(s, req, now);
    }

    /// A response at `psn` that made no progress: the peer is still sending (an older reply, or
    /// the rest of one past a gap), so the timer starts again if half of its period has run and
    /// restarts are left.
    fn alive(&mut self, s: &mut Shared, req: &Requester, now: Instant, psn: Psn) {
        if self.high.is_none_or(|h| psn.after(h)) {
            self.high = Some(psn);
        }
        let (Some(t), Some(deadline)) = (s.ack_timeout(), s.timers.get(Timer::Retransmit)) else {
            return;
        };
        // At most once per half period: a peer that never makes progress holds a retry off for
        // at most `ALIVE_RESTARTS / 2` periods.
        if self.alive_left == 0 || req.wait_rnr || deadline > now + t / 2 {
            return;
        }
        self.alive_left -= 1;
        s.timers.set(Timer::Retransmit, now + t);
    }

    /// A response past the expected PSN where the oldest request needs its own (a READ's or an
    /// atomic's): the expected one was lost.
    ///
    /// While a retry is under way, only a response at or below [`again_at`] counts: the
    /// responder serves requests one after another, so that is its answer to the retry starting
    /// again, and the expected PSN is missing from it too: lost again. Anything above it is the
    /// rest of a reply that was already on its way (or one that a reordering network delayed).
    ///
    /// [`again_at`]: Completer::again_at
    fn gap(&mut self, s: &mut Shared, req: &mut Requester, now: Instant, psn: Psn) {
        let started = self.retry_started;
        if self.again_at.is_some_and(|a| !psn.after(a)) {
            self.retry_started = false;
        }
        let before = s.counters.retries;
        self.retry(s, req, now, RetryCause::Gap);
        if s.counters.retries == before {
            self.retry_started = started;
        } else {
            // Responses after this one climb from here.
            self.again_at = Some(psn);
            self.high = Some(psn);
        }
        self.alive(s, req, now, psn);
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

    /// Starts go-back-N from `self.psn`. Timeouts always retry; NAKs and gaps only when no retry
    /// was started since the last progress (the responder is already answering that one: another
    /// would make it send the same replies again).
    fn retry(&mut self, s: &mut Shared, req: &mut Requester, now: Instant, cause: RetryCause) {
        if !s.sq.has_outstanding() || (cause != RetryCause::Timeout && req.wait_rnr) {
            return;
        }
        if cause != RetryCause::Timeout && self.retry_started {
            return;
        }
        if cause == RetryCause::Gap {
            // Past its budget, a gap waits for the timer, which gap retries never restart.
            if self.gap_left == 0 {
                return;
            }
            self.gap_left -= 1;
        } else {
            if self.retry_left == 0 {
                self.fail_head(s, WcStatus::RetryExcErr);
                return;
            }
            self.retry_left -= 1;
            self.alive_left = ALIVE_RESTARTS;
        }
        self.retry_started = true;
        req.need_retry = true;
        req.repeat_on_rewind = true;
        // A READ request is doubled only after half a period of silence: the responder is idle
        // (or the last request was lost), so the copy does not queue behind a reply it is still
        // sending.
        let silent = match (s.ack_timeout(), self.heard_at) {
            (Some(t), Some(h)) => now >= h + t / 2,
            _ => true,
        };
        req.repeat_read_on_rewind = cause == RetryCause::Timeout && silent;
        s.counters.retries += 1;
        if cause == RetryCause::Timeout {
            s.counters.timeouts += 1;
            self.again_at = self.high;
        }
        // A gap retry leaves the timer alone: it still runs from the last progress (or the last
        // response still streaming), so a lost retry request costs one timeout, not more.
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
        self.heard_at = Some(now);
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
                    self.gap(s, req, now, psn);
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
                // A duplicate: the peer replays what it was asked for earlier.
                self.alive(s, req, now, psn);
                return Err(DropReason::Stale);
            }
            if d > 0 && !send_write {
                // Read responses arrive in order; a gap means a loss.
                self.gap(s, req, now, psn);
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
                if let Err(e) = scatter(
                    mem,
                    s.cfg.pd,
                    &sges,
                    head.received,
                    &Payload::Bytes(payload),
                ) {
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
                if let Err(e) = scatter(
                    mem,
                    s.cfg.pd,
                    &sges,
                    0,
                    &Payload::Bytes(&orig.to_ne_bytes()),
                ) {
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
