//! The requester: turns send work requests into request packets.
//!
//! Owns segmentation at the path MTU, PSN assignment (a READ takes one PSN per expected response
//! packet), the AckReq placement, the window of unacknowledged PSNs, the READ/atomic initiator
//! depth and the fence, and go-back-N resumption (mid-message, without a RETH unless it restarts
//! at a message's first packet; a READ resumes with its address advanced). It never interprets
//! responses: the completer tells it where to resume.

use super::memory::Memory;
use super::queue::WqeState;
use super::shared::{SgError, Shared, check_local, gather, gather_refs, placeable};
use super::timer::Timer;
use super::{ACK_REQ_EVERY, Instant, MAX_READ_PSNS, MAX_UNACKED_PSNS};
use crate::soft::wire::peer_ref::PeerRefs;
use crate::soft::wire::{Headers, OpFlags, Opcode, Psn, atomic_eth, reth};
use crate::vocab::{SendFlags, WcStatus, WrOpcode};

#[derive(Debug)]
pub(super) struct Requester {
    /// Next PSN to send.
    pub psn: Psn,
    /// One past the highest PSN ever sent (a response for a PSN at or after it is unsolicited).
    pub sent_limit: Psn,
    /// Sequence number of the send work request being sent.
    cursor: u64,
    /// Bytes of that request already covered by packets sent (or, after a resume, acknowledged).
    offset: u32,
    /// The previous packet was a FIRST or MIDDLE of the current request.
    mid: bool,
    /// Packets sent since the last AckReq.
    noack: u32,
    /// READs and atomics sent and not completed.
    pub rd_outstanding: u32,
    /// The completer asked for go-back-N from its PSN.
    pub need_retry: bool,
    /// Waiting for an RNR NAK's timer.
    pub wait_rnr: bool,
    /// The rewind the completer asked for sends its first packet twice.
    pub repeat_on_rewind: bool,
    /// ... even when that packet is a READ request.
    pub repeat_read_on_rewind: bool,
    /// Set AckReq on the next packet (the first after a rewind).
    ack_next: bool,
    /// Send the next packet twice (the first of a retry).
    repeat_next: bool,
    /// ... even a READ request.
    repeat_read_next: bool,
}

/// The opcode of the next packet of a request: `mid` when the previous packet was a FIRST or
/// MIDDLE of the same message, `fits` when the rest of the message fits one packet.
fn next_opcode(op: WrOpcode, mid: bool, fits: bool) -> Opcode {
    use Opcode::*;
    match op {
        WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::SendWithInv => match (mid, fits) {
            (false, false) => SendFirst,
            (true, false) => SendMiddle,
            (false, true) => match op {
                WrOpcode::SendWithImm => SendOnlyImm,
                WrOpcode::SendWithInv => SendOnlyInv,
                _ => SendOnly,
            },
            (true, true) => match op {
                WrOpcode::SendWithImm => SendLastImm,
                WrOpcode::SendWithInv => SendLastInv,
                _ => SendLast,
            },
        },
        WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => match (mid, fits) {
            (false, false) => WriteFirst,
            (true, false) => WriteMiddle,
            (false, true) if op == WrOpcode::RdmaWriteWithImm => WriteOnlyImm,
            (false, true) => WriteOnly,
            (true, true) if op == WrOpcode::RdmaWriteWithImm => WriteLastImm,
            (true, true) => WriteLast,
        },
        WrOpcode::RdmaRead => ReadRequest,
        WrOpcode::AtomicCmpAndSwp => CompareSwap,
        WrOpcode::AtomicFetchAndAdd => FetchAdd,
    }
}

/// Packets a message of `len` bytes takes at `mtu` (at least one).
pub(super) fn packets(len: u32, mtu: u32) -> u32 {
    len.div_ceil(mtu).max(1)
}

impl Requester {
    pub fn new() -> Requester {
        Requester {
            psn: Psn::ZERO,
            sent_limit: Psn::ZERO,
            cursor: 0,
            offset: 0,
            mid: false,
            noack: 0,
            rd_outstanding: 0,
            need_retry: false,
            wait_rnr: false,
            repeat_on_rewind: false,
            repeat_read_on_rewind: false,
            ack_next: false,
            repeat_next: false,
            repeat_read_next: false,
        }
    }

    /// Entering RTS: the first request gets `sq_psn`.
    pub fn start(&mut self, sq_psn: Psn, head_seq: u64) {
        *self = Requester::new();
        self.psn = sq_psn;
        self.sent_limit = sq_psn;
        self.cursor = head_seq;
    }

    /// The send queue was flushed.
    pub fn on_error(&mut self, head_seq: u64) {
        self.cursor = head_seq;
        self.offset = 0;
        self.mid = false;
        self.rd_outstanding = 0;
        self.need_retry = false;
        self.wait_rnr = false;
        self.repeat_on_rewind = false;
        self.repeat_read_on_rewind = false;
    }

    /// Go-back-N: resend from `comp_psn`, the oldest unacknowledged PSN.
    ///
    /// The first packet resent asks for an ACK, so one packet that gets through confirms the
    /// retry. For a retry the completer started it is also sent twice (a READ request only
    /// when the completer says so), so a single loss does not waste a whole retry (after a
    /// sequence NAK the responder answers nothing else until that packet arrives). Responders
    /// answer the second copy as a duplicate: an ACK, a READ reply from the same PSN, or the
    /// saved atomic result.
    fn rewind(&mut self, s: &mut Shared, comp_psn: Psn) {
        self.ack_next = true;
        self.repeat_next = std::mem::take(&mut self.repeat_on_rewind);
        self.repeat_read_next = std::mem::take(&mut self.repeat_read_on_rewind);
        self.cursor = s.sq.head_seq();
        self.offset = 0;
        self.mid = false;
        self.noack = 0;
        self.psn = comp_psn;
        for e in s.sq.iter_mut() {
            e.rd_counted = false;
        }
        self.rd_outstanding = 0;
        let mtu = s.mtu();
        let Some(head) = s.sq.front() else { return };
        if !head.started() {
            return;
        }
        if !comp_psn.within(head.first_psn, head.last_psn) {
            self.psn = head.first_psn;
            return;
        }
        let k = comp_psn.distance_from(head.first_psn);
        let op = head.wqe.opcode;
        if op.is_send() || op.is_write() || op == WrOpcode::RdmaRead {
            // Every packet before `k` carried (or asked for) exactly one segment.
            self.offset = k.saturating_mul(head.segment(mtu)).min(head.len);
            self.mid = k > 0 && op != WrOpcode::RdmaRead;
        } else {
            self.psn = head.first_psn;
        }
    }

    /// Writes the next request packet into `buf`; `None` when nothing may be sent now.
    pub fn poll<M: Memory + ?Sized>(
        &mut self,
        s: &mut Shared,
        comp_psn: Psn,
        now: Instant,
        buf: &mut [u8],
        mem: &mut M,
    ) -> Option<usize> {
        if self.wait_rnr {
            return None;
        }
        if self.need_retry || self.cursor < s.sq.head_seq() || comp_psn.after(self.psn) {
            self.need_retry = false;
            self.rewind(s, comp_psn);
        }
        let seq = self.cursor;
        let mut e = *s.sq.get(seq)?;
        if matches!(e.state, WqeState::Failed(_)) {
            return None;
        }
        if s.state == crate::vocab::QpState::Sqd && e.state == WqeState::Posted {
            return None;
        }
        if self.psn.diff(comp_psn) >= MAX_UNACKED_PSNS as i32 {
            return None;
        }
        let op = e.wqe.opcode;
        let mtu = s.mtu();
        let pd = s.cfg.pd;
        if !self.mid {
            if e.wqe.flags.contains(SendFlags::FENCE) && self.rd_outstanding > 0 {
                return None;
            }
            if op.is_rd_atomic() && !e.rd_counted {
                if s.attrs.max_rd_atomic == 0 {
                    return self.fail(s, seq, WcStatus::LocQpOpErr);
                }
                if self.rd_outstanding >= u32::from(s.attrs.max_rd_atomic) {
                    return None;
                }
            }
            if e.state == WqeState::Posted {
                let writes = op.is_rd_atomic();
                if let Err(status) = check_local(mem, pd, &e.wqe.data, writes) {
                    return self.fail(s, seq, status);
                }
                if op == WrOpcode::RdmaRead && packets(e.len, mtu) > MAX_READ_PSNS {
                    return self.fail(s, seq, WcStatus::LocLenErr);
                }
                // Sent by reference when the peer takes references and every byte can be
                // placed. Decided once, and kept in the queue at once: a packet built twice (a
                // doubled first packet after a retry) or resent after the peer started taking
                // references keeps the form the message started in. Messages of one MTU or
                // less keep their bytes on the wire: one datagram either way, and no copy out
                // of this process on the far side.
                if e.by_ref.is_none() {
                    let by_ref = s.peer_refs.is_some()
                        && (op.is_send() || op.is_write())
                        && e.len > mtu
                        && placeable(mem, pd, &e.wqe.data);
                    e.by_ref = Some(by_ref);
                    if let Some(slot) = s.sq.get_mut(seq) {
                        slot.by_ref = Some(by_ref);
                    }
                }
            }
        }

        let dest = s.attrs.dest_qpn;
        let sent_psn = self.psn;
        // Whether this packet ends the request (the cursor moves on).
        let mut done = true;
        let before = (self.psn, self.offset, self.mid, self.noack, self.cursor);
        // A READ request is doubled only when the completer allows it: each copy makes the
        // responder replay the rest of the reply (rxe serves the copies one after another).
        let repeat = std::mem::take(&mut self.repeat_next)
            && (op != WrOpcode::RdmaRead || std::mem::take(&mut self.repeat_read_next));
        let n;
        if op.is_send() || op.is_write() {
            let seg = e.segment(mtu);
            let resid = e.len - self.offset;
            let fits = resid <= seg;
            let payload = resid.min(seg);
            let opcode = next_opcode(op, self.mid, fits);
            let flags = opcode.flags().unwrap_or_default();
            let end = flags.contains(OpFlags::END);
            let mut h = Headers::new(opcode, dest, self.psn);
            if flags.contains(OpFlags::RETH) {
                h.reth = Some(reth::Repr {
                    va: e.wqe.remote_addr.wrapping_add(u64::from(self.offset)),
                    rkey: e.wqe.rkey,
                    dma_len: resid,
                });
            }
            if flags.contains(OpFlags::IMMDT) {
                h.immdt = Some(e.wqe.imm);
            }
            if flags.contains(OpFlags::IETH) {
                h.ieth = Some(e.wqe.invalidate_rkey);
            }
            h.solicited = end
                && e.wqe.flags.contains(SendFlags::SOLICITED)
                && (op.is_send() || op == WrOpcode::RdmaWriteWithImm);
            h.ack_req = end || self.noack + 1 >= ACK_REQ_EVERY || self.ack_next;
            let gathered = if e.by_ref == Some(true) {
                let mut refs = PeerRefs::new(s.peer_refs.unwrap_or_default());
                h.peer_ref = true;
                gather_refs(mem, pd, &e.wqe.data, self.offset, payload, &mut refs).map(|()| {
                    let mut w = s.writer(buf, &h, refs.buffer_len())?;
                    refs.emit(w.payload_mut());
                    s.counters.peer_ref_sent += 1;
                    Some(s.finish(w))
                })
            } else {
                let mut w = s.writer(buf, &h, payload as usize)?;
                gather(mem, pd, &e.wqe.data, self.offset, w.payload_mut()).map(|lent| {
                    Some(if lent {
                        s.finish_lent(w, mem)
                    } else {
                        s.finish(w)
                    })
                })
            };
            n = match gathered {
                Ok(Some(n)) => n,
                Ok(None) => return None,
                Err(SgError::Protection) => return self.fail(s, seq, WcStatus::LocProtErr),
                Err(SgError::Length) => return self.fail(s, seq, WcStatus::LocLenErr),
            };
            if self.offset == 0 {
                e.first_psn = self.psn;
                e.last_psn = self.psn + (packets(e.len, seg) - 1);
            }
            self.noack = if h.ack_req { 0 } else { self.noack + 1 };
            self.psn += 1;
            self.offset += payload;
            self.mid = !end;
            done = end;
            // A request resent after a rewind stays fully sent: its state never goes back.
            if end || e.state != WqeState::Pending {
                e.state = if end {
                    WqeState::Pending
                } else {
                    WqeState::Sending
                };
            }
        } else if op == WrOpcode::RdmaRead {
            let total = packets(e.len, mtu);
            let first = if self.offset == 0 {
                self.psn
            } else {
                e.first_psn
            };
            let mut h = Headers::new(Opcode::ReadRequest, dest, self.psn);
            h.reth = Some(reth::Repr {
                va: e.wqe.remote_addr.wrapping_add(u64::from(self.offset)),
                rkey: e.wqe.rkey,
                dma_len: e.len - self.offset,
            });
            h.ack_req = true;
            let w = s.writer(buf, &h, 0)?;
            n = s.finish(w);
            e.first_psn = first;
            e.last_psn = first + (total - 1);
            e.state = WqeState::Pending;
            self.psn = e.last_psn + 1;
            self.noack = 0;
        } else {
            let cas = op == WrOpcode::AtomicCmpAndSwp;
            let mut h = Headers::new(
                if cas {
                    Opcode::CompareSwap
                } else {
                    Opcode::FetchAdd
                },
                dest,
                self.psn,
            );
            h.atomic_eth = Some(atomic_eth::Repr {
                va: e.wqe.remote_addr,
                rkey: e.wqe.rkey,
                swap_add: if cas { e.wqe.swap } else { e.wqe.compare_add },
                compare: if cas { e.wqe.compare_add } else { 0 },
            });
            h.ack_req = true;
            let w = s.writer(buf, &h, 0)?;
            n = s.finish(w);
            e.first_psn = self.psn;
            e.last_psn = self.psn;
            e.state = WqeState::Pending;
            self.psn += 1;
            self.noack = 0;
        }
        self.ack_next = false;
        let counted_now = op.is_rd_atomic() && !e.rd_counted;
        if counted_now {
            e.rd_counted = true;
            self.rd_outstanding += 1;
        }
        if done {
            self.cursor += 1;
            self.offset = 0;
            self.mid = false;
        }
        if sent_psn.before(self.sent_limit) {
            s.counters.retransmits += 1;
        }
        self.sent_limit = self.sent_limit.later(self.psn);
        if repeat {
            // Leave every piece of state as it was: the next poll builds the same packet.
            (self.psn, self.offset, self.mid, self.noack, self.cursor) = before;
            self.ack_next = true;
            if counted_now {
                self.rd_outstanding -= 1;
            }
        } else if let Some(slot) = s.sq.get_mut(seq) {
            *slot = e;
        }
        if !s.timers.is_armed(Timer::Retransmit) {
            if let Some(t) = s.ack_timeout() {
                s.timers.set(Timer::Retransmit, now + t);
            }
        }
        Some(n)
    }

    /// Marks request `seq` as failed locally; it completes with `status` once it is the oldest.
    fn fail(&mut self, s: &mut Shared, seq: u64, status: WcStatus) -> Option<usize> {
        if let Some(e) = s.sq.get_mut(seq) {
            e.state = WqeState::Failed(status);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opcode_sequences() {
        use Opcode::*;
        let seq = |op, len: u32, mtu: u32| {
            let mut out = Vec::new();
            let mut off = 0;
            let mut mid = false;
            loop {
                let resid = len - off;
                let o = next_opcode(op, mid, resid <= mtu);
                out.push(o);
                off += resid.min(mtu);
                if o.has(OpFlags::END) {
                    return out;
                }
                mid = true;
            }
        };
        assert_eq!(seq(WrOpcode::Send, 0, 256), [SendOnly]);
        assert_eq!(seq(WrOpcode::Send, 256, 256), [SendOnly]);
        assert_eq!(seq(WrOpcode::Send, 257, 256), [SendFirst, SendLast]);
        assert_eq!(
            seq(WrOpcode::SendWithImm, 1000, 256),
            [SendFirst, SendMiddle, SendMiddle, SendLastImm]
        );
        assert_eq!(seq(WrOpcode::SendWithInv, 10, 256), [SendOnlyInv]);
        assert_eq!(
            seq(WrOpcode::SendWithInv, 300, 256),
            [SendFirst, SendLastInv]
        );
        assert_eq!(seq(WrOpcode::RdmaWrite, 1024, 512), [WriteFirst, WriteLast]);
        assert_eq!(seq(WrOpcode::RdmaWriteWithImm, 0, 512), [WriteOnlyImm]);
        assert_eq!(
            seq(WrOpcode::RdmaWriteWithImm, 1025, 512),
            [WriteFirst, WriteMiddle, WriteLastImm]
        );
        assert_eq!(packets(0, 256), 1);
        assert_eq!(packets(256, 256), 1);
        assert_eq!(packets(257, 256), 2);
        assert_eq!(packets(1 << 20, 256), 4096);
    }
}
