//! The send and receive queues: bounded rings of posted work requests with their progress.

use std::collections::VecDeque;

use super::wr::{RecvWqe, SendWqe};
use crate::soft::wire::Psn;
use crate::vocab::WcStatus;

/// Where a send work request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WqeState {
    /// Not sent yet.
    Posted,
    /// Some packets sent.
    Sending,
    /// Every packet sent; waiting for the responses.
    Pending,
    /// Failed locally before it could be sent; completes with this status when it reaches the
    /// head of the queue.
    Failed(WcStatus),
}

/// A posted send work request and its progress.
#[derive(Debug, Clone, Copy)]
pub(super) struct SqEntry {
    pub wqe: SendWqe,
    /// Message length.
    pub len: u32,
    pub state: WqeState,
    /// PSN of the first packet (valid once started).
    pub first_psn: Psn,
    /// PSN of the last packet; for a READ, of the last expected response (valid once started).
    pub last_psn: Psn,
    /// Counted in the requester's outstanding READ/atomic total.
    pub rd_counted: bool,
    /// READ: bytes of response received, in order.
    pub received: u32,
    /// SEND/WRITE: whether it is sent by reference ([`crate::soft::wire::peer_ref`]), in
    /// [`super::PEER_REF_SEGMENT`] segments; `None` until its first packet is built, then fixed
    /// (every copy of every packet of a message has one form).
    pub by_ref: Option<bool>,
}

impl SqEntry {
    pub fn new(wqe: SendWqe, len: u32) -> SqEntry {
        SqEntry {
            wqe,
            len,
            state: WqeState::Posted,
            first_psn: Psn::ZERO,
            last_psn: Psn::ZERO,
            rd_counted: false,
            received: 0,
            by_ref: None,
        }
    }

    /// The bytes one packet of this request carries at path MTU `mtu`.
    pub fn segment(&self, mtu: u32) -> u32 {
        if self.by_ref == Some(true) {
            super::PEER_REF_SEGMENT
        } else {
            mtu
        }
    }

    /// At least one packet went out.
    pub fn started(&self) -> bool {
        matches!(self.state, WqeState::Sending | WqeState::Pending)
    }
}

/// The send queue. Entries are addressed by a sequence number that only grows, so the requester
/// can keep a cursor while the completer pops from the front.
#[derive(Debug)]
pub(super) struct SendQueue {
    entries: VecDeque<SqEntry>,
    head_seq: u64,
    depth: u32,
}

impl SendQueue {
    pub fn new(depth: u32) -> SendQueue {
        SendQueue {
            entries: VecDeque::with_capacity(depth as usize),
            head_seq: 0,
            depth,
        }
    }

    pub fn depth(&self) -> u32 {
        self.depth
    }

    pub fn is_full(&self) -> bool {
        self.entries.len() >= self.depth as usize
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn push(&mut self, e: SqEntry) {
        self.entries.push_back(e);
    }

    /// Sequence number of the oldest entry.
    pub fn head_seq(&self) -> u64 {
        self.head_seq
    }

    /// The entry with sequence number `seq`.
    pub fn get(&self, seq: u64) -> Option<&SqEntry> {
        let i = usize::try_from(seq.checked_sub(self.head_seq)?).ok()?;
        self.entries.get(i)
    }

    /// The entry with sequence number `seq`, mutably.
    pub fn get_mut(&mut self, seq: u64) -> Option<&mut SqEntry> {
        let i = usize::try_from(seq.checked_sub(self.head_seq)?).ok()?;
        self.entries.get_mut(i)
    }

    pub fn front(&self) -> Option<&SqEntry> {
        self.entries.front()
    }

    pub fn front_mut(&mut self) -> Option<&mut SqEntry> {
        self.entries.front_mut()
    }

    pub fn pop_front(&mut self) -> Option<SqEntry> {
        let e = self.entries.pop_front()?;
        self.head_seq += 1;
        Some(e)
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut SqEntry> {
        self.entries.iter_mut()
    }

    /// Whether any entry has a packet on the wire without its response.
    pub fn has_outstanding(&self) -> bool {
        self.entries.front().is_some_and(SqEntry::started)
    }

    /// Drops every entry without completing it (transition to RESET).
    pub fn clear(&mut self) {
        self.head_seq += self.entries.len() as u64;
        self.entries.clear();
    }
}

/// The receive queue.
#[derive(Debug)]
pub(super) struct RecvQueue {
    entries: VecDeque<RecvWqe>,
    depth: u32,
}

impl RecvQueue {
    pub fn new(depth: u32) -> RecvQueue {
        RecvQueue {
            entries: VecDeque::with_capacity(depth as usize),
            depth,
        }
    }

    pub fn depth(&self) -> u32 {
        self.depth
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn push(&mut self, w: RecvWqe) {
        self.entries.push_back(w);
    }

    pub fn pop_front(&mut self) -> Option<RecvWqe> {
        self.entries.pop_front()
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }
}
