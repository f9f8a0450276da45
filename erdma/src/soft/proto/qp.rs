//! One RC queue pair: its attributes and state, the queues, and the three state machines
//! (requester, completer, responder) that share them.
//!
//! Owns the verbs-level surface (post, modify, poll) and the transitions between QP states,
//! including the flush every transition to ERR performs. Packet handling lives in the machines.

use core::fmt;
use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};

use super::completer::Completer;
use super::device::{DropCounters, DropReason};
use super::memory::Memory;
use super::queue::{RecvQueue, SendQueue, SqEntry, WqeState};
use super::requester::Requester;
use super::responder::Responder;
use super::shared::{Attrs, Shared};
use super::timer::{Timer, TimerTable};
use super::wr::{MAX_INLINE, MAX_SGE, PostError, RecvWqe, SendWqe};
use super::{Instant, MAX_RD_ATOMIC};
use crate::soft::wire::{
    ChecksumCapabilities, IcrcHeaders, IpPair, OpFlags, PacketView, Psn, ROCE_PORT,
};
use crate::vocab::{Completion, QpAttr, QpCaps, QpState, WcOpcode, WcStatus};

/// Creation parameters of a queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpParams {
    /// Protection domain: every key the queue pair uses must belong to it.
    pub pd: u32,
    /// The device's address (packets' source; the ICRC covers it).
    pub local_addr: IpAddr,
    /// UDP source port of every packet (default 4791: the driver sends from its port).
    pub src_port: u16,
    /// Queue depths, SGEs per request (≤ [`MAX_SGE`]) and inline bytes (≤ [`MAX_INLINE`]).
    pub caps: QpCaps,
    /// Every send completes with a completion, signaled or not.
    pub sq_sig_all: bool,
    /// ICRC switches.
    pub checksum: ChecksumCapabilities,
}

impl QpParams {
    /// Defaults: 256-deep queues, the eRDMA SGE and inline limits, source port 4791.
    pub fn new(pd: u32, local_addr: IpAddr) -> QpParams {
        QpParams {
            pd,
            local_addr,
            src_port: ROCE_PORT,
            caps: QpCaps {
                max_send_wr: 256,
                max_recv_wr: 256,
                max_send_sge: MAX_SGE as u32,
                max_recv_sge: MAX_SGE as u32,
                max_inline_data: MAX_INLINE as u32,
            },
            sq_sig_all: false,
            checksum: ChecksumCapabilities::default(),
        }
    }
}

/// Why [`Qp::modify`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModifyError {
    /// IBTA does not allow this transition.
    IllegalTransition {
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// `cur_state` was given and is not the current state.
    StateMismatch {
        /// What the caller said.
        expected: QpState,
        /// What it is.
        actual: QpState,
    },
    /// The transition requires this attribute.
    Missing(&'static str),
    /// The transition does not accept this attribute.
    NotAllowed(&'static str),
    /// This attribute's value is out of range.
    Invalid(&'static str),
}

impl fmt::Display for ModifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModifyError::IllegalTransition { from, to } => {
                write!(f, "illegal transition {from} -> {to}")
            }
            ModifyError::StateMismatch { expected, actual } => {
                write!(f, "current state is {actual}, not {expected}")
            }
            ModifyError::Missing(a) => write!(f, "attribute {a} is required for this transition"),
            ModifyError::NotAllowed(a) => {
                write!(f, "attribute {a} is not allowed in this transition")
            }
            ModifyError::Invalid(a) => write!(f, "attribute {a} is out of range"),
        }
    }
}

impl std::error::Error for ModifyError {}

/// Per-queue-pair counters (cheap: plain `u64`s).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QpCounters {
    /// Datagrams emitted.
    pub packets_sent: u64,
    /// Datagrams handed to the queue pair.
    pub packets_received: u64,
    /// Request packets sent again (go-back-N).
    pub retransmits: u64,
    /// Go-back-N retries started (timeouts, sequence NAKs, lost read responses).
    pub retries: u64,
    /// Local ACK timeouts that started a retry.
    pub timeouts: u64,
    /// Duplicate requests received (answered from saved state).
    pub duplicates: u64,
    /// Gaps in the request stream: requests ahead of the expected PSN that drew a sequence NAK
    /// (each request of a gap, the first included, is also a drop).
    pub out_of_sequence: u64,
    /// ACKs sent (coalesced ones count once).
    pub acks_sent: u64,
    /// NAKs sent (sequence and fatal; RNR NAKs separately).
    pub naks_sent: u64,
    /// RNR NAKs sent.
    pub rnr_naks_sent: u64,
    /// NAKs received (RNR NAKs separately).
    pub naks_received: u64,
    /// RNR NAKs received.
    pub rnr_naks_received: u64,
    /// Request packets sent whose payload was a same-host reference list.
    pub peer_ref_sent: u64,
    /// Request packets received whose payload was copied out of a same-host peer's memory.
    pub peer_ref_received: u64,
    /// Packets dropped, by reason.
    pub drops: DropCounters,
}

impl QpCounters {
    /// Adds every count of `other` (a device's totals over its queue pairs).
    pub fn add(&mut self, other: &QpCounters) {
        // Destructured, so that a new counter cannot be left out.
        let QpCounters {
            packets_sent,
            packets_received,
            retransmits,
            retries,
            timeouts,
            duplicates,
            out_of_sequence,
            acks_sent,
            naks_sent,
            rnr_naks_sent,
            naks_received,
            rnr_naks_received,
            peer_ref_sent,
            peer_ref_received,
            drops,
        } = other;
        self.packets_sent += packets_sent;
        self.packets_received += packets_received;
        self.retransmits += retransmits;
        self.retries += retries;
        self.timeouts += timeouts;
        self.duplicates += duplicates;
        self.out_of_sequence += out_of_sequence;
        self.acks_sent += acks_sent;
        self.naks_sent += naks_sent;
        self.rnr_naks_sent += rnr_naks_sent;
        self.naks_received += naks_received;
        self.rnr_naks_received += rnr_naks_received;
        self.peer_ref_sent += peer_ref_sent;
        self.peer_ref_received += peer_ref_received;
        self.drops.add(drops);
    }
}

/// A datagram `poll_transmit` wrote: send `buf[..len]` from the device's UDP socket to `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    /// The peer's address and port 4791.
    pub dst: SocketAddr,
    /// The UDP source port the ICRC was computed with.
    pub src_port: u16,
    /// Length of the UDP payload written.
    pub len: usize,
    /// The payload the memory lent instead of a copy ([`Memory::lend`]): the driver puts those
    /// bytes where this says, in place of what the buffer holds there.
    pub lent: Option<Lent>,
}

/// Where a lent payload goes in a datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lent {
    /// Offset of the payload in the UDP payload.
    pub at: usize,
    /// Bytes.
    pub len: usize,
}

/// A responder's error that no receive request can report (IBTA C9-222.1.1: an error tied to
/// the queue pair but to none of its receive requests, as in an RDMA WRITE without immediate,
/// a READ or an atomic, is an affiliated asynchronous error at the responder).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpAsyncError {
    /// An invalid request (NAK Invalid Request): `IBV_EVENT_QP_REQ_ERR`.
    InvalidRequest,
    /// An access violation (NAK Remote Access Error: a bad R_Key, range or right):
    /// `IBV_EVENT_QP_ACCESS_ERR`.
    AccessViolation,
    /// The responder could not go on (NAK Remote Operational Error): `IBV_EVENT_QP_FATAL`.
    Catastrophic,
}

/// An RC queue pair.
#[derive(Debug)]
pub struct Qp {
    s: Shared,
    req: Requester,
    comp: Completer,
    resp: Responder,
    /// Whose turn it is to transmit first (responses and requests alternate).
    resp_turn: bool,
}

impl Qp {
    /// A queue pair in RESET.
    pub fn new(qpn: u32, cfg: QpParams) -> Qp {
        let c = cfg.caps;
        let cfg = QpParams {
            caps: QpCaps {
                max_send_sge: c.max_send_sge.min(MAX_SGE as u32),
                max_recv_sge: c.max_recv_sge.min(MAX_SGE as u32),
                max_inline_data: c.max_inline_data.min(MAX_INLINE as u32),
                max_send_wr: c.max_send_wr.max(1),
                max_recv_wr: c.max_recv_wr.max(1),
            },
            ..cfg
        };
        let icrc = IcrcHeaders {
            ip: IpPair::new(cfg.local_addr, cfg.local_addr).unwrap_or(IpPair::V4 {
                src: std::net::Ipv4Addr::UNSPECIFIED,
                dst: std::net::Ipv4Addr::UNSPECIFIED,
            }),
            ipv4_id: 0,
            src_port: cfg.src_port,
            dst_port: ROCE_PORT,
        };
        let depth = (cfg.caps.max_send_wr + cfg.caps.max_recv_wr) as usize;
        Qp {
            s: Shared {
                qpn: qpn & Psn::MASK,
                cfg,
                attrs: Attrs::default(),
                state: QpState::Reset,
                sq: SendQueue::new(cfg.caps.max_send_wr),
                rq: RecvQueue::new(cfg.caps.max_recv_wr),
                timers: TimerTable::default(),
                cq: VecDeque::with_capacity(depth),
                counters: QpCounters::default(),
                icrc,
                fatal: false,
                async_error: None,
                lent: None,
                peer_refs: None,
            },
            req: Requester::new(),
            comp: Completer::new(),
            resp: Responder::new(),
            resp_turn: true,
        }
    }

    /// The queue pair number.
    pub fn qpn(&self) -> u32 {
        self.s.qpn
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.s.state
    }

    /// Creation parameters.
    pub fn config(&self) -> &QpParams {
        &self.s.cfg
    }

    /// The current attributes (every field filled; `cur_state` = `state`).
    pub fn attr(&self) -> QpAttr {
        let a = &self.s.attrs;
        QpAttr {
            state: Some(self.s.state),
            cur_state: Some(self.s.state),
            pkey_index: Some(a.pkey_index),
            port: Some(a.port),
            access: Some(a.access),
            path_mtu: Some(a.mtu),
            dest_qp_num: Some(a.dest_qpn),
            rq_psn: Some(a.rq_psn.value()),
            sq_psn: Some(a.sq_psn.value()),
            max_rd_atomic: Some(a.max_rd_atomic),
            max_dest_rd_atomic: Some(a.max_dest_rd_atomic),
            min_rnr_timer: Some(a.min_rnr_timer),
            timeout: Some(a.timeout),
            retry_cnt: Some(a.retry_cnt),
            rnr_retry: Some(a.rnr_retry),
            av: a.av,
        }
    }

    /// Counters.
    pub fn counters(&self) -> &QpCounters {
        &self.s.counters
    }

    /// Whether the peer accepts same-host reference packets ([`crate::soft::wire::peer_ref`]),
    /// and the token they carry: from now on, a SEND or WRITE longer than the MTU whose local
    /// data [`Memory::peer_addr`] can place is sent by reference, in
    /// [`super::PEER_REF_SEGMENT`] segments. A message already started keeps the form it
    /// started in (retransmissions included). The driver sets it only after the peer proved it
    /// shares this host.
    pub fn set_peer_refs(&mut self, token: Option<u64>) {
        self.s.peer_refs = token;
    }

    /// The peer's address, once set.
    pub fn peer_addr(&self) -> Option<IpAddr> {
        self.s.attrs.peer
    }

    /// Send work requests posted and not yet completed.
    pub fn send_queue_len(&self) -> usize {
        self.s.sq.len()
    }

    /// Receive work requests posted and not yet completed.
    pub fn recv_queue_len(&self) -> usize {
        self.s.rq.len() + usize::from(self.resp.recv_in_progress())
    }

    /// In SQD: whether every send work request has completed (the send queue is drained).
    pub fn is_drained(&self) -> bool {
        self.s.sq.len() == 0
    }

    /// Posts a send work request.
    ///
    /// Accepted in RTS and SQD (queued; SQD starts it after the next move to RTS). In SQE and
    /// ERR it is accepted and completes at once with `WR_FLUSH_ERR`.
    ///
    /// # Errors
    /// [`PostError::InvalidState`] in RESET, INIT and RTR; [`PostError::QueueFull`]; and the
    /// shape errors of [`SendWqe::validate`].
    pub fn post_send(&mut self, wqe: SendWqe) -> Result<(), PostError> {
        let s = &mut self.s;
        match s.state {
            QpState::Reset | QpState::Init | QpState::Rtr => {
                return Err(PostError::InvalidState(s.state));
            }
            _ => {}
        }
        let len = wqe.validate(
            s.cfg.caps.max_send_sge as usize,
            s.cfg.caps.max_inline_data as usize,
        )?;
        if s.sq.is_full() {
            return Err(PostError::QueueFull {
                depth: s.sq.depth(),
            });
        }
        let entry = SqEntry::new(wqe, len);
        if matches!(s.state, QpState::Sqe | QpState::Err) {
            s.complete_send(&entry, WcStatus::WrFlushErr);
            return Ok(());
        }
        s.sq.push(entry);
        Ok(())
    }

    /// Posts a receive work request.
    ///
    /// Accepted in every state but RESET; in ERR it completes at once with `WR_FLUSH_ERR`.
    ///
    /// # Errors
    /// [`PostError::InvalidState`] in RESET; [`PostError::QueueFull`];
    /// [`PostError::TooManySges`].
    pub fn post_recv(&mut self, wqe: RecvWqe) -> Result<(), PostError> {
        if self.s.state == QpState::Reset {
            return Err(PostError::InvalidState(QpState::Reset));
        }
        if wqe.sges.len() > self.s.cfg.caps.max_recv_sge as usize {
            return Err(PostError::TooManySges {
                requested: wqe.sges.len(),
                max: self.s.cfg.caps.max_recv_sge as usize,
            });
        }
        if wqe.sges.total_len() > super::wr::MAX_MESSAGE {
            return Err(PostError::MessageTooLong {
                requested: wqe.sges.total_len(),
                max: super::wr::MAX_MESSAGE,
            });
        }
        if self.recv_queue_len() >= self.s.rq.depth() as usize {
            return Err(PostError::QueueFull {
                depth: self.s.rq.depth(),
            });
        }
        if self.s.state == QpState::Err {
            self.s
                .complete_recv(wqe.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0);
            return Ok(());
        }
        self.s.rq.push(wqe);
        Ok(())
    }

    /// Changes attributes and/or state, following IBTA's transition table for RC.
    ///
    /// Moving to ERR flushes every outstanding work request with `WR_FLUSH_ERR`; moving to
    /// RESET discards them without completions.
    ///
    /// # Errors
    /// See [`ModifyError`]; on error nothing changes.
    pub fn modify(&mut self, a: &QpAttr) -> Result<(), ModifyError> {
        use QpState::{Err as Error, Init, Reset, Rtr, Rts, Sqd, Sqe};
        let from = self.s.state;
        if let Some(expected) = a.cur_state {
            if expected != from {
                return Err(ModifyError::StateMismatch {
                    expected,
                    actual: from,
                });
            }
        }
        let to = a.state.unwrap_or(from);
        // Attribute bits, in the order of `NAMES`.
        const PKEY: u32 = 1;
        const PORT: u32 = 1 << 1;
        const ACCESS: u32 = 1 << 2;
        const MTU: u32 = 1 << 3;
        const DEST: u32 = 1 << 4;
        const RQ_PSN: u32 = 1 << 5;
        const SQ_PSN: u32 = 1 << 6;
        const RD: u32 = 1 << 7;
        const DEST_RD: u32 = 1 << 8;
        const RNR_TIMER: u32 = 1 << 9;
        const TIMEOUT: u32 = 1 << 10;
        const RETRY: u32 = 1 << 11;
        const RNR_RETRY: u32 = 1 << 12;
        const PEER: u32 = 1 << 13;
        const NAMES: [&str; 14] = [
            "pkey_index",
            "port",
            "access",
            "path_mtu",
            "dest_qp_num",
            "rq_psn",
            "sq_psn",
            "max_rd_atomic",
            "max_dest_rd_atomic",
            "min_rnr_timer",
            "timeout",
            "retry_cnt",
            "rnr_retry",
            "av",
        ];
        let given = [
            a.pkey_index.is_some(),
            a.port.is_some(),
            a.access.is_some(),
            a.path_mtu.is_some(),
            a.dest_qp_num.is_some(),
            a.rq_psn.is_some(),
            a.sq_psn.is_some(),
            a.max_rd_atomic.is_some(),
            a.max_dest_rd_atomic.is_some(),
            a.min_rnr_timer.is_some(),
            a.timeout.is_some(),
            a.retry_cnt.is_some(),
            a.rnr_retry.is_some(),
            a.av.is_some(),
        ]
        .iter()
        .enumerate()
        .fold(0u32, |m, (i, &g)| if g { m | (1 << i) } else { m });
        let (required, optional) = match (from, to) {
            (_, Reset) | (_, Error) => (0, 0),
            (Reset, Init) => (PKEY | PORT | ACCESS, 0),
            (Init, Init) => (0, PKEY | PORT | ACCESS),
            (Init, Rtr) => (
                PEER | MTU | DEST | RQ_PSN | DEST_RD | RNR_TIMER,
                PKEY | ACCESS,
            ),
            (Rtr, Rts) => (
                SQ_PSN | TIMEOUT | RETRY | RNR_RETRY | RD,
                ACCESS | RNR_TIMER,
            ),
            (Rts, Rts) | (Sqd, Rts) | (Sqe, Rts) => (0, ACCESS | RNR_TIMER),
            (Rts, Sqd) => (0, 0),
            (Sqd, Sqd) => (0, ACCESS | RNR_TIMER | TIMEOUT | RETRY | RNR_RETRY | RD),
            _ => return Err(ModifyError::IllegalTransition { from, to }),
        };
        let missing = required & !given;
        if missing != 0 {
            return Err(ModifyError::Missing(
                NAMES[missing.trailing_zeros() as usize],
            ));
        }
        let extra = given & !(required | optional);
        if extra != 0 {
            return Err(ModifyError::NotAllowed(
                NAMES[extra.trailing_zeros() as usize],
            ));
        }
        // Values.
        if a.pkey_index.is_some_and(|i| i != 0) {
            return Err(ModifyError::Invalid("pkey_index"));
        }
        if a.port.is_some_and(|p| p != 1) {
            return Err(ModifyError::Invalid("port"));
        }
        if a.dest_qp_num.is_some_and(|q| q > Psn::MASK) {
            return Err(ModifyError::Invalid("dest_qp_num"));
        }
        let check = |v: Option<u8>, max: u8, name| match v {
            Some(v) if v > max => Err(ModifyError::Invalid(name)),
            _ => Ok(()),
        };
        check(a.timeout, 31, "timeout")?;
        check(a.min_rnr_timer, 31, "min_rnr_timer")?;
        check(a.retry_cnt, 7, "retry_cnt")?;
        check(a.rnr_retry, 7, "rnr_retry")?;
        check(a.max_rd_atomic, MAX_RD_ATOMIC, "max_rd_atomic")?;
        check(a.max_dest_rd_atomic, MAX_RD_ATOMIC, "max_dest_rd_atomic")?;
        let peer = a.av.map(|av| av.dgid.to_ip());
        let icrc_ip = match peer {
            Some(peer) => {
                Some(IpPair::new(self.s.cfg.local_addr, peer).ok_or(ModifyError::Invalid("av"))?)
            }
            None => None,
        };

        // Apply.
        let at = &mut self.s.attrs;
        if let Some(v) = a.pkey_index {
            at.pkey_index = v;
        }
        if let Some(v) = a.port {
            at.port = v;
        }
        if let Some(v) = a.access {
            at.access = v;
        }
        if let Some(v) = a.path_mtu {
            at.mtu = v;
        }
        if let Some(v) = a.dest_qp_num {
            at.dest_qpn = v;
        }
        if let Some(v) = a.rq_psn {
            at.rq_psn = Psn::new(v);
        }
        if let Some(v) = a.sq_psn {
            at.sq_psn = Psn::new(v);
        }
        if let Some(v) = a.max_rd_atomic {
            at.max_rd_atomic = v;
        }
        if let Some(v) = a.max_dest_rd_atomic {
            at.max_dest_rd_atomic = v;
        }
        if let Some(v) = a.min_rnr_timer {
            at.min_rnr_timer = v;
        }
        if let Some(v) = a.timeout {
            at.timeout = v;
        }
        if let Some(v) = a.retry_cnt {
            at.retry_cnt = v;
        }
        if let Some(v) = a.rnr_retry {
            at.rnr_retry = v;
        }
        if let Some(v) = peer {
            at.peer = Some(v);
            at.av = a.av;
        }
        if let Some(ip) = icrc_ip {
            self.s.icrc.ip = ip;
        }
        let (retry_cnt, rnr_retry) = (at.retry_cnt, at.rnr_retry);
        if a.retry_cnt.is_some() || a.rnr_retry.is_some() {
            self.comp.set_limits(retry_cnt, rnr_retry);
        }

        match (from, to) {
            (_, Reset) => self.reset(),
            (_, Error) => self.enter_error(),
            (Init, Rtr) => {
                self.s.state = Rtr;
                self.resp.start(&self.s);
            }
            (Rtr, Rts) => {
                self.s.state = Rts;
                let psn = self.s.attrs.sq_psn;
                self.req.start(psn, self.s.sq.head_seq());
                self.comp.start(psn, retry_cnt, rnr_retry);
            }
            _ => self.s.state = to,
        }
        Ok(())
    }

    /// Back to RESET: queues emptied without completions, every machine reset.
    fn reset(&mut self) {
        self.s.state = QpState::Reset;
        self.s.sq.clear();
        self.s.rq.clear();
        self.s.cq.clear();
        self.s.timers.clear();
        self.s.fatal = false;
        self.s.async_error = None;
        self.s.attrs = Attrs::default();
        self.req = Requester::new();
        self.comp = Completer::new();
        self.resp = Responder::new();
    }

    /// To ERR: every outstanding work request completes with `WR_FLUSH_ERR` (send queue in
    /// order; the receive in progress, then the receive queue), nothing more is sent except the
    /// ACKs, atomic replies and final NAK the responder already queued (READ replies stop).
    fn enter_error(&mut self) {
        self.s.fatal = false;
        if self.s.state == QpState::Err {
            return;
        }
        self.s.state = QpState::Err;
        self.s.timers.clear();
        while let Some(e) = self.s.sq.pop_front() {
            self.s.complete_send(&e, WcStatus::WrFlushErr);
        }
        self.req.on_error(self.s.sq.head_seq());
        self.resp.on_error(&mut self.s);
        while let Some(r) = self.s.rq.pop_front() {
            self.s
                .complete_recv(r.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0);
        }
    }

    /// Completes a send work request that failed locally once it is the oldest, and applies any
    /// error a machine raised.
    fn settle(&mut self) {
        if let Some(e) = self.s.sq.front() {
            if let WqeState::Failed(status) = e.state {
                if let Some(e) = self.s.sq.pop_front() {
                    self.s.complete_send(&e, status);
                }
                self.s.fatal = true;
            }
        }
        if self.s.fatal {
            self.enter_error();
        }
    }

    /// Handles a datagram that passed [`validate`](super::validate) and is addressed to this
    /// queue pair. `src` is the datagram's source address.
    ///
    /// # Errors
    /// The reason the packet was dropped (already counted in [`Qp::counters`]): not from the
    /// peer, the queue pair not ready for it, out of sequence, stale, …
    pub fn handle_packet<M: Memory + ?Sized>(
        &mut self,
        now: Instant,
        src: IpAddr,
        view: &PacketView<'_>,
        mem: &mut M,
    ) -> Result<(), DropReason> {
        self.s.counters.packets_received += 1;
        if self.s.attrs.peer != Some(src) {
            return Err(self.s.drop_packet(DropReason::WrongSource));
        }
        let r = if view.has(OpFlags::REQUEST) {
            self.resp.handle(&mut self.s, view, mem)
        } else {
            self.comp.handle(&mut self.s, &mut self.req, now, view, mem)
        };
        self.settle();
        r.map_err(|why| self.s.drop_packet(why))
    }

    /// Writes the next datagram to send into `buf` (which should hold [`MAX_DATAGRAM`] bytes;
    /// a smaller buffer only carries packets that fit).
    ///
    /// [`MAX_DATAGRAM`]: super::MAX_DATAGRAM
    pub fn poll_transmit<M: Memory + ?Sized>(
        &mut self,
        now: Instant,
        buf: &mut [u8],
        mem: &mut M,
    ) -> Option<Transmit> {
        let peer = self.s.attrs.peer?;
        let req_ok = self.s.state.requester_ready();
        let resp_ok = self.s.state.responder_ready() || self.resp.draining();
        let mut by_resp = false;
        let mut n = None;
        for turn in [self.resp_turn, !self.resp_turn] {
            n = if turn {
                if resp_ok {
                    self.resp.poll(&mut self.s, buf, mem)
                } else {
                    None
                }
            } else if req_ok {
                self.req.poll(&mut self.s, self.comp.psn, now, buf, mem)
            } else {
                None
            };
            if n.is_some() {
                by_resp = turn;
                break;
            }
        }
        self.settle();
        let lent = self.s.lent.take();
        let len = n?;
        self.resp_turn = !by_resp;
        self.s.counters.packets_sent += 1;
        Some(Transmit {
            dst: SocketAddr::new(peer, ROCE_PORT),
            src_port: self.s.cfg.src_port,
            len,
            lent,
        })
    }

    /// The earliest deadline at which [`Qp::handle_timeout`] has work.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.s.timers.next_timeout()
    }

    /// Runs the timers due at `now` (an early or repeated call does nothing).
    pub fn handle_timeout(&mut self, now: Instant) {
        for t in Timer::VALUES {
            if self.s.timers.is_expired(t, now) {
                self.s.timers.stop(t);
                match t {
                    Timer::Retransmit => {
                        self.comp
                            .on_retransmit_timeout(&mut self.s, &mut self.req, now)
                    }
                    Timer::RnrRetry => self.comp.on_rnr_timeout(&mut self.s, &mut self.req, now),
                }
            }
        }
        self.settle();
    }

    /// The next work completion, oldest first.
    pub fn poll_completion(&mut self) -> Option<Completion> {
        self.s.cq.pop_front()
    }

    /// The error that moved the queue pair to ERR when no work request could carry it (a
    /// responder's error during an RDMA WRITE without immediate, a READ or an atomic), once:
    /// the owner reports it as an affiliated asynchronous event.
    pub fn take_async_error(&mut self) -> Option<QpAsyncError> {
        self.s.async_error.take()
    }

    /// Whether `poll_transmit` may have something to send (a cheap hint for drivers; `false`
    /// is exact, `true` may be spurious).
    pub fn wants_transmit(&self) -> bool {
        (self.s.state.responder_ready() || self.resp.draining()) && self.resp.has_output()
            || self.s.state.requester_ready() && self.s.sq.len() > 0
    }
}
