//! The responder: executes requests from the peer and answers them.
//!
//! Owns the expected PSN, duplicate detection and replay (ACK with the last executed PSN, READ
//! replay from the duplicate PSN, atomic replay from the saved result), NAK generation (sequence
//! error once until an in-order packet arrives; invalid request, remote access and remote
//! operational errors, each moving the queue pair to ERR), RNR NAKs, the MSN, and every check
//! that keeps a peer inside what it was granted: rkey → region, protection domain, access rights
//! of the queue pair and of the region, bounds, segment sizes, receive-buffer size.
//!
//! Requests execute when they arrive; what goes back is an ordered queue of obligations (ACKs,
//! read replies, atomic replies, NAKs), so responses leave in PSN order (a replay for a duplicate
//! goes ahead of replies for later PSNs). Consecutive ACKs
//! coalesce into one for the newest PSN. A read reply is generated packet by packet inside
//! `poll`, straight from memory into the caller's buffer, so a large READ is never buffered.

use std::collections::VecDeque;

use super::device::DropReason;
use super::memory::{AtomicOp, Memory, Region};
use super::qp::QpAsyncError;
use super::requester::packets;
use super::shared::{Payload, SgError, Shared, scatter};
use super::wr::{MAX_MESSAGE, RecvWqe};
use super::{MAX_READ_PSNS, PEER_REF_SEGMENT};
use crate::soft::wire::peer_ref::PeerRefs;
use crate::soft::wire::{Headers, NakCode, OpFlags, Opcode, PacketView, Psn, Syndrome, aeth};
use crate::vocab::{Access, WcOpcode, WcStatus};

/// A saved READ or atomic, for replies and replays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resource {
    Read {
        first: Psn,
        last: Psn,
        va: u64,
        rkey: u32,
        len: u32,
        msn: u32,
    },
    Atomic {
        psn: Psn,
        orig: u64,
        msn: u32,
    },
}

/// Something to send back, in PSN order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Out {
    /// ACK or NAK (AETH only).
    Ack {
        psn: Psn,
        syndrome: Syndrome,
        msn: u32,
    },
    /// The rest of a read reply, from `cur`.
    Read { res: usize, cur: Psn },
    /// An atomic's reply.
    Atomic { res: usize },
}

/// A SEND being received into a receive work request.
#[derive(Debug, Clone, Copy)]
struct RecvInProgress {
    wqe: RecvWqe,
    /// Bytes placed so far.
    offset: u32,
}

/// The RDMA WRITE in progress.
#[derive(Debug, Clone, Copy, Default)]
struct WriteState {
    rkey: u32,
    va: u64,
    resid: u32,
    /// The RETH length (reported by a WRITE_WITH_IMM's receive completion).
    length: u32,
}

/// The result of executing one request.
enum Exec {
    Done,
    /// Fatal: NAK with this code, complete the receive in progress with this status, to ERR.
    Fatal(NakCode, WcStatus),
}

#[derive(Debug)]
pub(super) struct Responder {
    psn: Psn,
    /// One past the last executed SEND/WRITE/atomic PSN.
    ack_psn: Psn,
    msn: u32,
    /// Opcode of the previous executed request.
    prev: Option<Opcode>,
    nak_sent: bool,
    recv: Option<RecvInProgress>,
    write: WriteState,
    resources: Vec<Option<Resource>>,
    next_res: usize,
    out: VecDeque<Out>,
    out_cap: usize,
    /// A fatal error: send what is queued (ending with the NAK), accept nothing.
    draining: bool,
}

const MSN_MASK: u32 = 0x00FF_FFFF;

impl Responder {
    pub fn new() -> Responder {
        Responder {
            psn: Psn::ZERO,
            ack_psn: Psn::ZERO,
            msn: 0,
            prev: None,
            nak_sent: false,
            recv: None,
            write: WriteState::default(),
            resources: Vec::new(),
            next_res: 0,
            out: VecDeque::new(),
            out_cap: 0,
            draining: false,
        }
    }

    /// Entering RTR: expect `rq_psn`; size the resource ring.
    pub fn start(&mut self, s: &Shared) {
        *self = Responder::new();
        self.psn = s.attrs.rq_psn;
        // `ack_psn` stays 0, as rxe's does: a duplicate before anything executed is
        // acknowledged at 0xFFFFFF, not at `rq_psn - 1` (`tests/hostile.rs` pins it).
        let ring = usize::from(s.attrs.max_dest_rd_atomic.max(1)).next_power_of_two();
        self.resources = vec![None; ring];
        self.out_cap = 2 * ring + 4;
        self.out = VecDeque::with_capacity(self.out_cap + 1);
    }

    pub fn recv_in_progress(&self) -> bool {
        self.recv.is_some()
    }

    pub fn draining(&self) -> bool {
        self.draining
    }

    pub fn has_output(&self) -> bool {
        !self.out.is_empty()
    }

    /// The queue pair went to ERR: flush the receive in progress; keep only a draining queue.
    pub fn on_error(&mut self, s: &mut Shared) {
        if let Some(r) = self.recv.take() {
            s.complete_recv(r.wqe.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0);
        }
        if !self.draining {
            self.out.clear();
        }
    }

    fn push(&mut self, o: Out) -> bool {
        if self.out.len() >= self.out_cap {
            return false;
        }
        self.out.push_back(o);
        true
    }

    /// Queues a positive ACK for `psn`, merging with an ACK already last in the queue.
    fn ack(&mut self, s: &mut Shared, psn: Psn) {
        if let Some(Out::Ack {
            psn: p,
            syndrome: Syndrome::Ack { .. },
            msn,
        }) = self.out.back_mut()
        {
            *p = p.later(psn);
            *msn = self.msn;
            return;
        }
        let msn = self.msn;
        if !self.push(Out::Ack {
            psn,
            syndrome: Syndrome::ACK,
            msn,
        }) {
            s.counters.drops.count(DropReason::ResponderBusy);
        }
    }

    /// Queues a NAK (not merged with anything but an identical NAK).
    fn nak(&mut self, s: &mut Shared, psn: Psn, syndrome: Syndrome) {
        if let Some(Out::Ack {
            psn: p,
            syndrome: sy,
            ..
        }) = self.out.back()
        {
            if *p == psn && *sy == syndrome {
                return;
            }
        }
        let msn = self.msn;
        if !self.push(Out::Ack { psn, syndrome, msn }) {
            s.counters.drops.count(DropReason::ResponderBusy);
        }
    }

    /// Going to ERR: READ replies still queued stop (an errored queue pair reads no more memory
    /// for its peer); the ACKs and atomic replies queued before go out, then the final NAK.
    fn stop_replies(&mut self, s: &mut Shared) {
        self.out.retain(|o| !matches!(o, Out::Read { .. }));
        self.draining = true;
        s.fatal = true;
    }

    /// A fatal error at `psn`: NAK, complete the receive in progress, then ERR.
    fn fatal(&mut self, s: &mut Shared, psn: Psn, code: NakCode, recv_status: WcStatus) {
        let msn = self.msn;
        // The final NAK always fits: `push` keeps one slot free for it.
        self.out.push_back(Out::Ack {
            psn,
            syndrome: Syndrome::Nak(code),
            msn,
        });
        if let Some(r) = self.recv.take() {
            s.complete_recv(r.wqe.wr_id, recv_status, WcOpcode::Recv, r.offset);
        } else {
            // No receive request to carry the error: the owner hears of it as an event.
            s.async_error = Some(match code {
                NakCode::RemoteAccessError => QpAsyncError::AccessViolation,
                NakCode::RemoteOperationalError => QpAsyncError::Catastrophic,
                _ => QpAsyncError::InvalidRequest,
            });
        }
        self.stop_replies(s);
    }

    /// Looks up `rkey` for `need` over `[va, va+len)`.
    fn remote_region<M: Memory + ?Sized>(
        s: &Shared,
        mem: &M,
        rkey: u32,
        va: u64,
        len: u64,
        need: Access,
    ) -> Option<(Region, u64)> {
        let r = mem.region(rkey)?;
        if r.pd != s.cfg.pd || !r.access.contains(need) {
            return None;
        }
        let off = r.offset_of(va, len)?;
        Some((r, off))
    }

    /// The PSN an output entry answers (its next packet's).
    fn out_psn(&self, o: &Out) -> Psn {
        match *o {
            Out::Ack { psn, .. } => psn,
            Out::Read { cur, .. } => cur,
            Out::Atomic { res } => match self.resources.get(res).copied().flatten() {
                Some(Resource::Atomic { psn, .. }) => psn,
                _ => self.psn,
            },
        }
    }

    /// Queues a replay for a duplicate at `psn` ahead of anything answering a later PSN: the
    /// requester went back to `psn` and discards responses beyond it until this one arrives.
    fn push_replay(&mut self, o: Out, psn: Psn) -> bool {
        if self.out.len() >= self.out_cap {
            return false;
        }
        let at = self
            .out
            .iter()
            .position(|q| self.out_psn(q).after(psn))
            .unwrap_or(self.out.len());
        self.out.insert(at, o);
        true
    }

    /// Whether resource slot `i` still has a reply queued.
    fn slot_busy(&self, i: usize) -> bool {
        self.out
            .iter()
            .any(|o| matches!(*o, Out::Read { res, .. } | Out::Atomic { res } if res == i))
    }

    /// Handles a request packet.
    pub fn handle<M: Memory + ?Sized>(
        &mut self,
        s: &mut Shared,
        view: &PacketView<'_>,
        mem: &mut M,
    ) -> Result<(), DropReason> {
        if !s.state.responder_ready() || self.draining {
            return Err(DropReason::QpNotReady);
        }
        let psn = view.psn();
        let d = psn.diff(self.psn);
        if d > 0 {
            if !self.nak_sent {
                // A gap counts once, when it is NAKed (as rxe counts `out_of_seq_request`);
                // every request of it is a drop.
                s.counters.out_of_sequence += 1;
                self.nak_sent = true;
                let expected = self.psn;
                self.nak(s, expected, Syndrome::Nak(NakCode::PsnSequenceError));
            }
            return Err(DropReason::OutOfSequence);
        }
        if d < 0 {
            s.counters.duplicates += 1;
            return self.duplicate(s, view);
        }
        self.nak_sent = false;
        let op = view.opcode();
        let f = view.flags();

        // Opcode sequence.
        let in_sequence = match self.prev {
            Some(Opcode::SendFirst | Opcode::SendMiddle) => {
                matches!(
                    op,
                    Opcode::SendMiddle
                        | Opcode::SendLast
                        | Opcode::SendLastImm
                        | Opcode::SendLastInv
                )
            }
            Some(Opcode::WriteFirst | Opcode::WriteMiddle) => {
                matches!(
                    op,
                    Opcode::WriteMiddle | Opcode::WriteLast | Opcode::WriteLastImm
                )
            }
            _ => f.contains(OpFlags::START),
        };
        if !in_sequence {
            self.fatal(s, psn, NakCode::InvalidRequest, WcStatus::RemInvReqErr);
            return Ok(());
        }
        // The queue pair's rights.
        let need = if f.contains(OpFlags::READ) {
            Access::REMOTE_READ
        } else if f.contains(OpFlags::WRITE) {
            Access::REMOTE_WRITE
        } else if f.contains(OpFlags::ATOMIC) {
            Access::REMOTE_ATOMIC
        } else {
            Access::empty()
        };
        if !s.attrs.access.contains(need) {
            self.fatal(s, psn, NakCode::InvalidRequest, WcStatus::RemInvReqErr);
            return Ok(());
        }
        // Resources.
        if f.intersects(OpFlags::READ | OpFlags::ATOMIC) {
            if s.attrs.max_dest_rd_atomic == 0 {
                self.fatal(s, psn, NakCode::InvalidRequest, WcStatus::RemInvReqErr);
                return Ok(());
            }
            if self.slot_busy(self.next_res) || self.out.len() >= self.out_cap {
                // The peer has more READs/atomics outstanding than it may: it will retry.
                return Err(DropReason::ResponderBusy);
            }
        }
        if f.contains(OpFlags::RWR) && self.recv.is_none() {
            match s.rq.pop_front() {
                Some(wqe) => self.recv = Some(RecvInProgress { wqe, offset: 0 }),
                None => {
                    s.counters.rnr_naks_sent += 1;
                    let timer = s.attrs.min_rnr_timer;
                    self.nak(s, psn, Syndrome::RnrNak { timer });
                    return Err(DropReason::ReceiverNotReady);
                }
            }
        }
        // A reference packet's payload is the sender's memory it names (`validate` checked the
        // list; refused here too rather than trusted).
        let payload = if view.peer_ref() {
            match PeerRefs::parse(view.payload()) {
                Ok(r) => Payload::Peer(r),
                Err(_) => {
                    self.fatal(s, psn, NakCode::InvalidRequest, WcStatus::RemInvReqErr);
                    return Ok(());
                }
            }
        } else {
            Payload::Bytes(view.payload())
        };
        // Segment sizes: FIRST and MIDDLE carry exactly one MTU (a reference packet one
        // PEER_REF_SEGMENT), LAST 1..=MTU, ONLY ≤ MTU.
        let mtu = if view.peer_ref() {
            PEER_REF_SEGMENT
        } else {
            s.mtu()
        };
        let n = payload.len();
        if f.contains(OpFlags::PAYLOAD) {
            let start = f.contains(OpFlags::START);
            let end = f.contains(OpFlags::END);
            let ok = match (start, end) {
                (true, true) => n <= mtu,
                (false, true) => n >= 1 && n <= mtu,
                _ => n == mtu,
            };
            if !ok {
                self.fatal(s, psn, NakCode::InvalidRequest, WcStatus::RemInvReqErr);
                return Ok(());
            }
        }

        let exec = if f.contains(OpFlags::SEND) {
            self.exec_send(s, &payload, mem)
        } else if f.contains(OpFlags::WRITE) {
            self.exec_write(s, view, &payload, mtu, mem)
        } else if op == Opcode::ReadRequest {
            return self.exec_read(s, view, mem);
        } else {
            return self.exec_atomic(s, view, mem);
        };
        match exec {
            Exec::Fatal(code, status) => {
                self.fatal(s, psn, code, status);
                Ok(())
            }
            Exec::Done => {
                if view.peer_ref() {
                    s.counters.peer_ref_received += 1;
                }
                self.psn = psn + 1;
                self.ack_psn = self.psn;
                self.prev = Some(op);
                if f.contains(OpFlags::END) {
                    self.msn = (self.msn + 1) & MSN_MASK;
                }
                let invalidate_failed = if f.contains(OpFlags::COMP) {
                    self.complete_message(s, view, mem)
                } else {
                    false
                };
                if view.ack_req() {
                    self.ack(s, psn);
                }
                if invalidate_failed {
                    // The receive completed with an error after a positive ACK; now to ERR.
                    self.stop_replies(s);
                }
                Ok(())
            }
        }
    }

    fn exec_send<M: Memory + ?Sized>(
        &mut self,
        s: &mut Shared,
        payload: &Payload<'_>,
        mem: &mut M,
    ) -> Exec {
        let Some(r) = self.recv.as_mut() else {
            return Exec::Fatal(NakCode::InvalidRequest, WcStatus::RemInvReqErr);
        };
        let room = r.wqe.sges.total_len();
        if u64::from(r.offset) + u64::from(payload.len()) > room {
            return Exec::Fatal(NakCode::InvalidRequest, WcStatus::LocLenErr);
        }
        match scatter(mem, s.cfg.pd, &r.wqe.sges, r.offset, payload) {
            Ok(()) => {}
            Err(SgError::Length) => {
                return Exec::Fatal(NakCode::InvalidRequest, WcStatus::LocLenErr);
            }
            Err(SgError::Protection) => {
                return Exec::Fatal(NakCode::RemoteOperationalError, WcStatus::LocProtErr);
            }
        }
        r.offset += payload.len();
        Exec::Done
    }

    /// `mtu`: the segment size of this packet (the path MTU, or a reference packet's).
    fn exec_write<M: Memory + ?Sized>(
        &mut self,
        s: &mut Shared,
        view: &PacketView<'_>,
        payload: &Payload<'_>,
        mtu: u32,
        mem: &mut M,
    ) -> Exec {
        if let Some(reth) = view.reth() {
            if u64::from(reth.dma_len) > MAX_MESSAGE {
                return Exec::Fatal(NakCode::InvalidRequest, WcStatus::RemInvReqErr);
            }
            if reth.dma_len > 0
                && Self::remote_region(
                    s,
                    mem,
                    reth.rkey,
                    reth.va,
                    u64::from(reth.dma_len),
                    Access::REMOTE_WRITE,
                )
                .is_none()
            {
                return Exec::Fatal(NakCode::RemoteAccessError, WcStatus::RemAccessErr);
            }
            self.write = WriteState {
                rkey: reth.rkey,
                va: reth.va,
                resid: reth.dma_len,
                length: reth.dma_len,
            };
        }
        let n = payload.len();
        let w = self.write;
        let end = view.has(OpFlags::END);
        let pad_ok = usize::from(view.pad_count())
            == crate::soft::wire::packet::pad_for(view.payload().len());
        let size_ok = if end {
            n == w.resid
        } else {
            w.resid > mtu && n == mtu
        };
        if !size_ok || !pad_ok {
            return Exec::Fatal(NakCode::InvalidRequest, WcStatus::RemInvReqErr);
        }
        if n > 0 {
            let Some((region, off)) =
                Self::remote_region(s, mem, w.rkey, w.va, u64::from(n), Access::REMOTE_WRITE)
            else {
                return Exec::Fatal(NakCode::RemoteAccessError, WcStatus::RemAccessErr);
            };
            if payload.copy_into(mem, &region, off, 0, n as usize).is_err() {
                return Exec::Fatal(NakCode::RemoteOperationalError, WcStatus::RemOpErr);
            }
        }
        self.write.va = w.va.wrapping_add(u64::from(n));
        self.write.resid = w.resid - n;
        Exec::Done
    }

    /// The END packet of a message that completes a receive. Returns whether an invalidation
    /// failed (the queue pair then goes to ERR after the ACK).
    fn complete_message<M: Memory + ?Sized>(
        &mut self,
        s: &mut Shared,
        view: &PacketView<'_>,
        mem: &mut M,
    ) -> bool {
        let Some(r) = self.recv.take() else {
            return false;
        };
        let mut status = WcStatus::Success;
        let mut invalidated = None;
        if let Some(rkey) = view.ieth() {
            let ok = match mem.region(rkey) {
                Some(region) if region.pd == s.cfg.pd => mem.invalidate(&region).is_ok(),
                _ => false,
            };
            if ok {
                invalidated = Some(rkey);
            } else {
                status = WcStatus::RemInvReqErr;
            }
        }
        let (opcode, byte_len) = if view.has(OpFlags::WRITE) {
            (WcOpcode::RecvRdmaWithImm, self.write.length)
        } else {
            (WcOpcode::Recv, r.offset)
        };
        let c = s.complete_recv(r.wqe.wr_id, status, opcode, byte_len);
        c.imm = view.immdt();
        c.invalidated_rkey = invalidated;
        c.solicited = view.solicited();
        status != WcStatus::Success
    }

    fn exec_read<M: Memory + ?Sized>(
        &mut self,
        s: &mut Shared,
        view: &PacketView<'_>,
        mem: &M,
    ) -> Result<(), DropReason> {
        let psn = view.psn();
        let Some(reth) = view.reth() else {
            return Err(DropReason::Malformed);
        };
        let npkts = packets(reth.dma_len, s.mtu());
        if u64::from(reth.dma_len) > MAX_MESSAGE || npkts > MAX_READ_PSNS {
            self.fatal(s, psn, NakCode::InvalidRequest, WcStatus::RemInvReqErr);
            return Ok(());
        }
        if reth.dma_len > 0
            && Self::remote_region(
                s,
                mem,
                reth.rkey,
                reth.va,
                u64::from(reth.dma_len),
                Access::REMOTE_READ,
            )
            .is_none()
        {
            self.fatal(s, psn, NakCode::RemoteAccessError, WcStatus::RemAccessErr);
            return Ok(());
        }
        self.msn = (self.msn + 1) & MSN_MASK;
        let res = self.next_res;
        self.next_res = (self.next_res + 1) % self.resources.len().max(1);
        let last = psn + (npkts - 1);
        if let Some(slot) = self.resources.get_mut(res) {
            *slot = Some(Resource::Read {
                first: psn,
                last,
                va: reth.va,
                rkey: reth.rkey,
                len: reth.dma_len,
                msn: self.msn,
            });
        }
        self.push(Out::Read { res, cur: psn });
        self.psn = last + 1;
        self.prev = Some(Opcode::ReadRequest);
        Ok(())
    }

    fn exec_atomic<M: Memory + ?Sized>(
        &mut self,
        s: &mut Shared,
        view: &PacketView<'_>,
        mem: &mut M,
    ) -> Result<(), DropReason> {
        let psn = view.psn();
        let Some(a) = view.atomic_eth() else {
            return Err(DropReason::Malformed);
        };
        // Key, rights and range first, alignment after, as rxe checks them: an atomic both
        // misaligned and outside what the key grants is a remote access error.
        let Some((region, off)) =
            Self::remote_region(s, mem, a.rkey, a.va, 8, Access::REMOTE_ATOMIC)
        else {
            self.fatal(s, psn, NakCode::RemoteAccessError, WcStatus::RemAccessErr);
            return Ok(());
        };
        if a.va % 8 != 0 {
            self.fatal(s, psn, NakCode::InvalidRequest, WcStatus::RemInvReqErr);
            return Ok(());
        }
        let op = if view.opcode() == Opcode::CompareSwap {
            AtomicOp::CompareSwap {
                compare: a.compare,
                swap: a.swap_add,
            }
        } else {
            AtomicOp::FetchAdd { add: a.swap_add }
        };
        let Ok(orig) = mem.atomic(&region, off, op) else {
            self.fatal(s, psn, NakCode::RemoteOperationalError, WcStatus::RemOpErr);
            return Ok(());
        };
        self.msn = (self.msn + 1) & MSN_MASK;
        let res = self.next_res;
        self.next_res = (self.next_res + 1) % self.resources.len().max(1);
        if let Some(slot) = self.resources.get_mut(res) {
            *slot = Some(Resource::Atomic {
                psn,
                orig,
                msn: self.msn,
            });
        }
        self.push(Out::Atomic { res });
        self.psn = psn + 1;
        self.ack_psn = self.psn;
        self.prev = Some(view.opcode());
        Ok(())
    }

    /// A request behind the expected PSN.
    fn duplicate(&mut self, s: &mut Shared, view: &PacketView<'_>) -> Result<(), DropReason> {
        let psn = view.psn();
        let f = view.flags();
        if f.intersects(OpFlags::SEND | OpFlags::WRITE) {
            let last_done = self.ack_psn - 1;
            self.ack(s, last_done);
            return Ok(());
        }
        if view.opcode() == Opcode::ReadRequest {
            let Some(reth) = view.reth() else {
                return Err(DropReason::Malformed);
            };
            let found = self.resources.iter().position(|r| match *r {
                Some(Resource::Read {
                    first,
                    last,
                    va,
                    rkey,
                    len,
                    ..
                }) => {
                    psn.within(first, last)
                        && rkey == reth.rkey
                        && reth.va >= va
                        && reth
                            .va
                            .checked_add(u64::from(reth.dma_len))
                            .is_some_and(|e| e <= va + u64::from(len))
                }
                _ => false,
            });
            let Some(res) = found else {
                return Err(DropReason::Stale);
            };
            // Replay from the duplicate's PSN: restart a queued reply there, or queue one.
            for o in self.out.iter_mut() {
                if let Out::Read { res: r, cur } = o {
                    if *r == res {
                        if psn.before(*cur) {
                            *cur = psn;
                        }
                        return Ok(());
                    }
                }
            }
            if !self.push_replay(Out::Read { res, cur: psn }, psn) {
                return Err(DropReason::ResponderBusy);
            }
            return Ok(());
        }
        // Atomic: resend the saved result.
        let found = self
            .resources
            .iter()
            .position(|r| matches!(*r, Some(Resource::Atomic { psn: p, .. }) if p == psn));
        let Some(res) = found else {
            return Err(DropReason::Stale);
        };
        if self.slot_busy(res) {
            return Ok(());
        }
        if !self.push_replay(Out::Atomic { res }, psn) {
            return Err(DropReason::ResponderBusy);
        }
        Ok(())
    }

    /// Writes the next response packet into `buf`.
    pub fn poll<M: Memory + ?Sized>(
        &mut self,
        s: &mut Shared,
        buf: &mut [u8],
        mem: &mut M,
    ) -> Option<usize> {
        let dest = s.attrs.dest_qpn;
        match *self.out.front()? {
            Out::Ack { psn, syndrome, msn } => {
                let mut h = Headers::new(Opcode::Acknowledge, dest, psn);
                h.aeth = Some(aeth::Repr { syndrome, msn });
                let w = s.writer(buf, &h, 0)?;
                let n = s.finish(w);
                self.out.pop_front();
                match syndrome {
                    Syndrome::Ack { .. } => s.counters.acks_sent += 1,
                    Syndrome::RnrNak { .. } => {}
                    _ => s.counters.naks_sent += 1,
                }
                Some(n)
            }
            Out::Atomic { res } => {
                let Some(Resource::Atomic { psn, orig, msn }) =
                    self.resources.get(res).copied().flatten()
                else {
                    self.out.pop_front();
                    return None;
                };
                let mut h = Headers::new(Opcode::AtomicAcknowledge, dest, psn);
                h.aeth = Some(aeth::Repr {
                    syndrome: Syndrome::ACK,
                    msn,
                });
                h.atomic_ack_eth = Some(orig);
                let w = s.writer(buf, &h, 0)?;
                let n = s.finish(w);
                self.out.pop_front();
                Some(n)
            }
            Out::Read { res, cur } => {
                let Some(Resource::Read {
                    first,
                    last,
                    va,
                    rkey,
                    len,
                    msn,
                }) = self.resources.get(res).copied().flatten()
                else {
                    self.out.pop_front();
                    return None;
                };
                let mtu = s.mtu();
                let offset = cur.distance_from(first).saturating_mul(mtu).min(len);
                let remaining = len - offset;
                let payload = remaining.min(mtu);
                let opcode = if cur == first {
                    if len <= mtu {
                        Opcode::ReadResponseOnly
                    } else {
                        Opcode::ReadResponseFirst
                    }
                } else if remaining > mtu {
                    Opcode::ReadResponseMiddle
                } else {
                    Opcode::ReadResponseLast
                };
                let mut h = Headers::new(opcode, dest, cur);
                if opcode != Opcode::ReadResponseMiddle {
                    h.aeth = Some(aeth::Repr {
                        syndrome: Syndrome::ACK,
                        msn,
                    });
                }
                // Re-validate the key for every packet: the region may have gone meanwhile.
                let src = if payload > 0 {
                    let addr = va.wrapping_add(u64::from(offset));
                    match Self::remote_region(
                        s,
                        mem,
                        rkey,
                        addr,
                        u64::from(payload),
                        Access::REMOTE_READ,
                    ) {
                        Some(x) => Some(x),
                        None => {
                            self.out.pop_front();
                            self.fatal_now(s, cur, NakCode::RemoteAccessError);
                            return self.poll(s, buf, mem);
                        }
                    }
                } else {
                    None
                };
                let mut w = s.writer(buf, &h, payload as usize)?;
                if let Some((region, off)) = src {
                    if mem.read(&region, off, w.payload_mut()).is_err() {
                        self.out.pop_front();
                        self.fatal_now(s, cur, NakCode::RemoteOperationalError);
                        return self.poll(s, buf, mem);
                    }
                }
                let n = s.finish(w);
                let next = cur + 1;
                if next.after(last) {
                    self.out.pop_front();
                } else if let Some(Out::Read { cur: c, .. }) = self.out.front_mut() {
                    *c = next;
                }
                Some(n)
            }
        }
    }

    /// A read reply cannot go on: NAK it at once (ahead of anything queued) and go to ERR.
    fn fatal_now(&mut self, s: &mut Shared, psn: Psn, code: NakCode) {
        self.out.clear();
        self.fatal(s, psn, code, WcStatus::RemOpErr);
    }
}
