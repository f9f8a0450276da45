//! Credit-based channels: one-way message streams over K connected queue pairs, where the
//! receiver grants the room the sender may use.
//!
//! The receiver owns K × S slots of `slot_bytes` in registered memory the sender may write
//! (the "staging" area). A message is an RDMA WRITE WITH IMM, either into the next slot of its
//! queue pair (slots are used round robin, in the same order on both sides) or to any address
//! the receiver granted (for data that goes straight to its final place). Every message costs
//! one credit of its queue pair; the sender starts with S per queue pair and gets them back
//! when the receiver has consumed the messages (a zero-length SEND WITH IMM carrying counts).
//! So at most S messages per queue pair are in flight and no receive queue ever runs dry.
//!
//! Credits of every queue pair travel in one message when their counts fit the immediate
//! (K fields of ⌈log₂(S+1)⌉ bits in 30 bits: K = 8 queue pairs with S ≤ 7 slots, say), else
//! one message per queue pair. A packed message goes on the lowest queue pair it credits, so
//! each queue pair still carries at most S credit messages in flight (each grants it at least
//! one credit) and the S receives the sender keeps posted per queue pair never run dry. On a
//! software device each message is a datagram and its acknowledgement another: packing turns
//! up to 2K of them into two.
//!
//! Immediate layout: bit 31 marks a credit: with bit 30 clear its low 16 bits are the count of
//! the queue pair it arrives on; with bit 30 set, bits `q·w .. (q+1)·w` hold queue pair `q`'s
//! count. A message's low 8 bits name its slot and bits 8..=30 carry 23 bits of the user's own
//! (e.g. which chunk it is).
//! Messages and credits are posted unsignaled: the sender knows its messages have arrived
//! when their credits are back ([`Sender::all_credits_back`]).
//!
//! Requests carry `wr_id = tag | queue pair index`, so a program with several channels on one
//! completion queue routes completions by tag.
//!
//! On a device without immediate data (siw and other iWARP devices but eRDMA:
//! [`crate::Capability::ImmediateData`]) a message is an RDMA WRITE followed by a small
//! SEND on the same queue pair, and a credit is a small SEND: each carries what the immediate
//! would have (and a message its length) as an 8-byte note, received into registered memory of
//! the channel's own. The WRITE's data is placed before the SEND after it completes (RC
//! ordering), so the receiver sees the same completions, in the same order, with the same
//! values, as with immediate data ([`Receiver::take_note`], [`Sender::take_note`]). The receives
//! are posted as before: a SEND never finds none (iWARP has no receiver-not-ready retry).

#![allow(unsafe_code)] // raw posts over registered memory the ring owns

use crate::error::{Error, Result};
use crate::mr::{Mr, RemoteMr};
use crate::qp::Qp;
use crate::vocab::Access;
use crate::vocab::{Completion, SendFlags, Sge, WcOpcode, WrOpcode};
use crate::wr::{RawRecvWr, RawSendWr, RecvWr};

/// Immediate bit marking a credit.
const CREDIT: u32 = 1 << 31;
/// Credit bit marking the counts of every queue pair packed into one immediate.
const PACKED: u32 = 1 << 30;
/// Bits of a packed credit immediate that hold counts.
const PACKED_BITS: u32 = 30;

/// Width of one queue pair's count in a packed credit, when K counts of at most `slots` fit.
fn packed_width(qps: usize, slots: usize) -> Option<u32> {
    let w = usize::BITS - slots.leading_zeros();
    (qps as u32 * w <= PACKED_BITS).then_some(w)
}
/// Largest number of user bits in a message's immediate.
pub const USER_BITS: u32 = 23;
/// Largest number of slots per queue pair (8 bits in the immediate).
pub const MAX_SLOTS: usize = 256;
/// Mask of the queue-pair index in a `wr_id`.
pub const QP_MASK: u64 = 0xffff_ffff;
/// Bytes of a note (the immediate, then the message's length; big-endian).
const NOTE: usize = 8;

/// Where the device has no immediate data: the receive buffers of a channel end's notes, `slots`
/// per queue pair, used round robin (a queue pair's receives complete in the order they were
/// posted, so the n-th completion holds the n-th posted buffer).
#[derive(Debug)]
struct Notes {
    mr: Mr<'static>,
    slots: usize,
    posted: Vec<u64>,
    seen: Vec<u64>,
}

impl Notes {
    /// The notes of a channel end over `qps`, or `None` where their device has immediate data.
    fn for_qps(qps: &[Qp], slots: usize) -> Result<Option<Notes>> {
        let Some(first) = qps.first() else {
            return Ok(None);
        };
        if first.pd().context().limits().immediate_data {
            return Ok(None);
        }
        let mr = first
            .pd()
            .alloc(qps.len() * slots * NOTE, Access::LOCAL_WRITE)?;
        Ok(Some(Notes {
            mr,
            slots,
            posted: vec![0; qps.len()],
            seen: vec![0; qps.len()],
        }))
    }

    fn at(&self, q: usize, n: u64) -> usize {
        (q * self.slots + (n % self.slots as u64) as usize) * NOTE
    }

    /// Posts queue pair `q`'s next receive, into its next note buffer.
    fn post_recv(&mut self, qp: &Qp, q: usize, wr_id: u64) -> Result<()> {
        let sge = Sge {
            addr: self.mr.addr() + self.at(q, self.posted[q]) as u64,
            length: NOTE as u32,
            lkey: self.mr.lkey(),
        };
        let wr = RawRecvWr {
            wr_id,
            sges: std::slice::from_ref(&sge),
        };
        // The buffer lies inside `mr`, which the channel end owns and drops after its queue
        // pairs (field order); the CPU reads it only once this receive has completed, and the
        // buffer is posted again only after that read (`take`), `slots` posts later.
        // SAFETY: as above.
        unsafe { qp.post_recv_raw(std::slice::from_ref(&wr))? };
        self.posted[q] += 1;
        Ok(())
    }

    /// Reads the note of queue pair `q`'s next receive completion into `wc`: its immediate,
    /// and for a message its length and kind, as a WRITE WITH IMM would have reported them.
    fn take(&mut self, q: usize, wc: &mut Completion, message: bool) -> Result<()> {
        if !wc.status.is_success() || wc.opcode != WcOpcode::Recv {
            return Ok(());
        }
        let mut note = [0u8; NOTE];
        self.mr.read_at(self.at(q, self.seen[q]), &mut note)?;
        self.seen[q] += 1;
        if wc.byte_len as usize != NOTE {
            return Err(Error::protocol(format!(
                "a note of {} bytes on queue pair {q} (a note is {NOTE})",
                wc.byte_len
            )));
        }
        let [a, b, c, d, e, f, g, h] = note;
        wc.imm = Some(u32::from_be_bytes([a, b, c, d]));
        if message {
            wc.byte_len = u32::from_be_bytes([e, f, g, h]);
            wc.opcode = WcOpcode::RecvRdmaWithImm;
        }
        Ok(())
    }
}

/// A note's bytes: the immediate, then the length.
fn note(imm: u32, len: u32) -> [u8; NOTE] {
    let mut n = [0u8; NOTE];
    n[..4].copy_from_slice(&imm.to_be_bytes());
    n[4..].copy_from_slice(&len.to_be_bytes());
    n
}

/// Posts one receive on queue pair `q`: a note buffer's, or an empty one where the immediate
/// carries everything.
fn post_recv(notes: &mut Option<Notes>, qp: &Qp, q: usize, wr_id: u64) -> Result<()> {
    match notes {
        Some(n) => n.post_recv(qp, q, wr_id),
        None => qp.post_recv(RecvWr::empty(wr_id)),
    }
}

/// Where a message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The next staging slot of its queue pair at the receiver.
    Slot,
    /// A place the receiver granted directly.
    Remote(RemoteMr),
}

/// One message to post.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message {
    /// The local bytes (in a registered region).
    pub local: Sge,
    /// Where they go.
    pub target: Target,
    /// The user's bits of the immediate (at most [`USER_BITS`] bits).
    pub user: u32,
}

/// The sending end of a channel.
#[derive(Debug)]
pub struct Sender {
    qps: Vec<Qp>,
    slots: usize,
    slot_bytes: usize,
    peer_slots: RemoteMr,
    credits: Vec<usize>,
    sent: Vec<u64>,
    tag: u64,
    /// Where the device has no immediate data: the credits' notes (after `qps`: dropped later).
    notes: Option<Notes>,
}

impl Sender {
    /// The sending end over `qps` (each connected to the receiver's queue pair of the same
    /// index); `peer_slots` is the receiver's staging area of `qps.len() × slots × slot_bytes`.
    /// Posts the zero-length receives that credits arrive in.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a slot count outside `1..=256`, a tag that overlaps the
    /// queue-pair index, or a staging area of the wrong size; the device's errors.
    pub fn new(
        qps: Vec<Qp>,
        slots: usize,
        slot_bytes: usize,
        peer_slots: RemoteMr,
        tag: u64,
    ) -> Result<Sender> {
        check(slots, tag)?;
        let need = (qps.len() * slots * slot_bytes) as u64;
        if !qps.is_empty() && peer_slots.len != need {
            return Err(Error::invalid(format!(
                "the receiver's staging area is {} bytes, the channel needs {need}",
                peer_slots.len
            )));
        }
        let mut notes = Notes::for_qps(&qps, slots)?;
        for (q, qp) in qps.iter().enumerate() {
            for _ in 0..slots {
                post_recv(&mut notes, qp, q, tag | q as u64)?;
            }
        }
        let k = qps.len();
        Ok(Sender {
            qps,
            slots,
            slot_bytes,
            peer_slots,
            credits: vec![slots; k],
            sent: vec![0; k],
            tag,
            notes,
        })
    }

    /// Where the device has no immediate data, reads a credit's note into its receive
    /// completion `wc` of queue pair `q` (what [`Sender::on_credit`] expects); call it once per
    /// receive completion of this channel, in the order they come. Does nothing otherwise.
    ///
    /// # Errors
    /// [`Error::Protocol`] for a note of the wrong size.
    pub fn take_note(&mut self, q: usize, wc: &mut Completion) -> Result<()> {
        match &mut self.notes {
            Some(n) => n.take(q, wc, false),
            None => Ok(()),
        }
    }

    /// Queue pairs in the channel.
    pub fn queue_pairs(&self) -> usize {
        self.qps.len()
    }

    /// Credits held on queue pair `q`: messages it may post now.
    pub fn credits(&self, q: usize) -> usize {
        self.credits[q]
    }

    /// Messages posted whose credits have not come back yet.
    pub fn in_flight(&self) -> usize {
        self.credits.iter().map(|c| self.slots - c).sum()
    }

    /// Whether every message posted has been consumed by the receiver.
    pub fn all_credits_back(&self) -> bool {
        self.credits.iter().all(|c| *c == self.slots)
    }

    /// Posts the first messages of `msgs` that the credits of queue pair `q` allow, as one
    /// chain; returns how many were posted (none when the send queue is momentarily full:
    /// retry after the next poll of the completion queue).
    ///
    /// # Safety
    /// As [`Qp::post_send_raw`] for every message's local bytes: they must stay allocated,
    /// registered and unwritten until the message has been consumed (its credit is back).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for user bits wider than [`USER_BITS`] or a message larger
    /// than a slot; [`Error::OutOfBounds`] outside the staging area; the device's errors.
    pub unsafe fn post(&mut self, q: usize, msgs: &[Message]) -> Result<usize> {
        let n = msgs.len().min(self.credits[q]);
        let mut remotes = Vec::with_capacity(n);
        for (i, m) in msgs[..n].iter().enumerate() {
            if m.user >> USER_BITS != 0 {
                return Err(Error::invalid(format!(
                    "{:#x} does not fit the {USER_BITS} user bits of an immediate",
                    m.user
                )));
            }
            let slot = ((self.sent[q] + i as u64) % self.slots as u64) as usize;
            let remote = match m.target {
                Target::Slot => {
                    if m.local.length as usize > self.slot_bytes {
                        return Err(Error::invalid(format!(
                            "a {}-byte message into a {}-byte slot",
                            m.local.length, self.slot_bytes
                        )));
                    }
                    let at = (q * self.slots + slot) * self.slot_bytes;
                    self.peer_slots.slice(at as u64, m.local.length as u64)?
                }
                Target::Remote(r) => {
                    // The raw post below skips the SDK's own check of the remote length.
                    if u64::from(m.local.length) > r.len {
                        return Err(Error::OutOfBounds {
                            what: "a message longer than the place the receiver granted",
                            offset: 0,
                            len: u64::from(m.local.length),
                            available: r.len,
                        });
                    }
                    r
                }
            };
            remotes.push((remote, (m.user << 8) | slot as u32));
        }
        let wr_id = self.tag | q as u64;
        // Without immediate data: each message's note, sent inline after its WRITE.
        let notes: Vec<[u8; NOTE]> = match self.notes {
            Some(_) => msgs[..n]
                .iter()
                .zip(&remotes)
                .map(|(m, (_, imm))| note(*imm, m.local.length))
                .collect(),
            None => Vec::new(),
        };
        let note_sges: Vec<Sge> = notes
            .iter()
            .map(|b| Sge {
                addr: b.as_ptr() as u64,
                length: NOTE as u32,
                lkey: 0,
            })
            .collect();
        let mut wrs: Vec<RawSendWr<'_>> = Vec::with_capacity(2 * n);
        for (i, (m, (remote, imm))) in msgs[..n].iter().zip(&remotes).enumerate() {
            // An empty message carries no SGE at all.
            let sges = if m.local.length == 0 {
                &[][..]
            } else {
                std::slice::from_ref(&m.local)
            };
            let Some(sge) = note_sges.get(i) else {
                let mut wr = RawSendWr::new(wr_id, WrOpcode::RdmaWriteWithImm, sges);
                wr.remote = *remote;
                wr.imm = *imm;
                wrs.push(wr);
                continue;
            };
            if !sges.is_empty() {
                let mut wr = RawSendWr::new(wr_id, WrOpcode::RdmaWrite, sges);
                wr.remote = *remote;
                wrs.push(wr);
            }
            let mut wr = RawSendWr::new(wr_id, WrOpcode::Send, std::slice::from_ref(sge));
            wr.flags |= SendFlags::INLINE;
            wrs.push(wr);
        }
        if wrs.is_empty() {
            return Ok(0);
        }
        // Remote bytes are the receiver's, checked by its device against the key and bounds it
        // granted; the notes are copied at post time (inline).
        // SAFETY: the caller's contract covers the local bytes; `notes` outlives the call.
        match unsafe { self.qps[q].post_send_raw(&wrs) } {
            Ok(()) => {
                self.credits[q] -= n;
                self.sent[q] += n as u64;
                Ok(n)
            }
            // The SDK refuses a chain whole when the queue lacks room: nothing was posted.
            Err(Error::QueueFull { .. }) => Ok(0),
            Err(e) => Err(e),
        }
    }

    /// Takes a credit completion of queue pair `q` (a receive on this channel's tag).
    ///
    /// # Errors
    /// [`Error::Protocol`] when it is not a credit, or grants more than was used.
    pub fn on_credit(&mut self, q: usize, wc: &Completion) -> Result<()> {
        let imm = match wc.imm {
            Some(imm) if imm & CREDIT != 0 && wc.opcode == WcOpcode::Recv => imm,
            _ => {
                return Err(Error::protocol(format!(
                    "the receiver sent {:?} where a credit was expected",
                    wc.imm
                )));
            }
        };
        let k = self.qps.len();
        if q >= k {
            return Err(Error::protocol(format!(
                "a credit on queue pair {q} of a {k}-queue-pair channel"
            )));
        }
        let too_many = || Error::protocol("the receiver granted more credits than there are slots");
        if imm & PACKED == 0 {
            let n = (imm & 0xffff) as usize;
            // A receiver sends a credit only for slots it freed; an empty one would count as
            // the peer's progress and keep a stuck call waiting past its timeout.
            if n == 0 {
                return Err(Error::protocol("the receiver sent a credit for no slot"));
            }
            if self.credits[q] + n > self.slots {
                return Err(too_many());
            }
            self.credits[q] += n;
        } else {
            // At most 30 queue pairs fit a packed credit (one bit each, at least).
            let Some(w) = packed_width(k, self.slots) else {
                return Err(Error::protocol(
                    "packed credits on a channel whose counts do not fit one immediate",
                ));
            };
            if (imm & !(CREDIT | PACKED)) >> (k as u32 * w) != 0 {
                return Err(Error::protocol(
                    "packed credits for queue pairs that do not exist",
                ));
            }
            let count = |i: usize| ((imm >> (i as u32 * w)) & ((1 << w) - 1)) as usize;
            // Sent on the lowest queue pair it credits: that is what bounds the credit
            // messages each queue pair's receives must hold.
            if (0..k).position(|i| count(i) > 0) != Some(q) {
                return Err(Error::protocol(format!(
                    "packed credits arrived on queue pair {q}, not the lowest one they credit"
                )));
            }
            if (0..k).any(|i| self.credits[i] + count(i) > self.slots) {
                return Err(too_many());
            }
            for (i, c) in self.credits.iter_mut().enumerate() {
                *c += count(i);
            }
        }
        post_recv(&mut self.notes, &self.qps[q], q, self.tag | q as u64)
    }

    /// Moves every queue pair to the error state (nothing more is sent or received).
    pub fn shut_down(&self) {
        for qp in &self.qps {
            let _ = qp.to_error();
        }
    }
}

/// A message that arrived, checked against the channel's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival {
    /// Its queue pair.
    pub q: usize,
    /// Its slot (meaningful for [`Target::Slot`] messages).
    pub slot: usize,
    /// Byte offset of that slot in the staging area.
    pub slot_offset: usize,
    /// The user's bits of its immediate.
    pub user: u32,
    /// Bytes written.
    pub len: usize,
}

/// The receiving end of a channel.
#[derive(Debug)]
pub struct Receiver {
    qps: Vec<Qp>,
    slots: usize,
    slot_bytes: usize,
    received: Vec<u64>,
    owed: Vec<u32>,
    tag: u64,
    /// Where the device has no immediate data: the messages' notes (after `qps`: dropped
    /// later).
    notes: Option<Notes>,
}

impl Receiver {
    /// Queue pair `q` (tests post on it as a misbehaving peer would).
    #[cfg(test)]
    pub(crate) fn qp(&self, q: usize) -> &Qp {
        &self.qps[q]
    }

    /// The receiving end over `qps`, with `slots` staging slots of `slot_bytes` per queue pair
    /// (the staging area the sender was given). Posts the receives messages arrive in.
    ///
    /// # Errors
    /// As [`Sender::new`].
    pub fn new(qps: Vec<Qp>, slots: usize, slot_bytes: usize, tag: u64) -> Result<Receiver> {
        check(slots, tag)?;
        let mut notes = Notes::for_qps(&qps, slots)?;
        for (q, qp) in qps.iter().enumerate() {
            for _ in 0..slots {
                post_recv(&mut notes, qp, q, tag | q as u64)?;
            }
        }
        let k = qps.len();
        Ok(Receiver {
            qps,
            slots,
            slot_bytes,
            received: vec![0; k],
            owed: vec![0; k],
            tag,
            notes,
        })
    }

    /// Where the device has no immediate data, reads a message's note into its receive
    /// completion `wc` of queue pair `q`: then it reports the immediate, the length and the kind
    /// a WRITE WITH IMM would have. Call it once per receive completion of this channel, in the
    /// order they come, before [`Receiver::user_bits`] or [`Receiver::arrival`]. Does nothing
    /// otherwise.
    ///
    /// # Errors
    /// [`Error::Protocol`] for a note of the wrong size.
    pub fn take_note(&mut self, q: usize, wc: &mut Completion) -> Result<()> {
        match &mut self.notes {
            Some(n) => n.take(q, wc, true),
            None => Ok(()),
        }
    }

    /// The user's bits of a message completion, without checking its place in the order (to
    /// decide whether it belongs to now or is to be kept for later).
    ///
    /// # Errors
    /// [`Error::Protocol`] for a completion that is not a message.
    pub fn user_bits(wc: &Completion) -> Result<u32> {
        Ok(message_imm(wc)? >> 8)
    }

    /// Checks a message completion of queue pair `q`: its kind and its slot. Messages of a
    /// queue pair are taken in their order of arrival: [`Receiver::consume`] one before
    /// checking the next.
    ///
    /// # Errors
    /// [`Error::Protocol`] for a completion that is not a message, one in the wrong slot, or a
    /// queue pair the channel lacks.
    pub fn arrival(&self, q: usize, wc: &Completion) -> Result<Arrival> {
        let k = self.qps.len();
        if q >= k {
            return Err(Error::protocol(format!(
                "a message on queue pair {q} of a {k}-queue-pair channel"
            )));
        }
        let imm = message_imm(wc)?;
        let slot = (imm & 0xff) as usize;
        let expect = (self.received[q] % self.slots as u64) as usize;
        if slot != expect {
            return Err(Error::protocol(format!(
                "a message in slot {slot} of queue pair {q}, where slot {expect} was next"
            )));
        }
        Ok(Arrival {
            q,
            slot,
            slot_offset: (q * self.slots + slot) * self.slot_bytes,
            user: imm >> 8,
            len: wc.byte_len as usize,
        })
    }

    /// Marks an arrival consumed: its receive is posted again and its credit is owed to the
    /// sender (sent by [`Receiver::flush_credits`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a queue pair the channel lacks; the device's errors.
    pub fn consume(&mut self, a: &Arrival) -> Result<()> {
        let Some(qp) = self.qps.get(a.q) else {
            return Err(Error::invalid(format!(
                "an arrival on queue pair {} of a {}-queue-pair channel",
                a.q,
                self.qps.len()
            )));
        };
        post_recv(&mut self.notes, qp, a.q, self.tag | a.q as u64)?;
        self.received[a.q] += 1;
        self.owed[a.q] += 1;
        Ok(())
    }

    /// Whether credits are owed that could not be sent yet.
    pub fn owes_credits(&self) -> bool {
        self.owed.iter().any(|o| *o > 0)
    }

    /// Sends the owed credits: one message for every queue pair when the counts fit one
    /// immediate, else one message per queue pair. Credits a full send queue refused stay owed:
    /// call again after the next poll of the completion queue.
    ///
    /// # Errors
    /// The device's errors.
    pub fn flush_credits(&mut self) -> Result<()> {
        let Some(first) = self.owed.iter().position(|o| *o > 0) else {
            return Ok(());
        };
        if let Some(w) = packed_width(self.qps.len(), self.slots)
            && self.owed.iter().all(|o| *o < 1 << w)
        {
            let counts = self
                .owed
                .iter()
                .enumerate()
                .fold(0, |acc, (q, o)| acc | o << (q as u32 * w));
            if self.send_credit(first, PACKED | counts)? {
                self.owed.fill(0);
            }
            return Ok(());
        }
        for q in 0..self.owed.len() {
            if self.owed[q] > 0 && self.send_credit(q, self.owed[q])? {
                self.owed[q] = 0;
            }
        }
        Ok(())
    }

    /// Posts one credit message on queue pair `q` carrying `counts` (the immediate without the
    /// credit bit); false when its send queue is full (the credits stay owed).
    fn send_credit(&self, q: usize, counts: u32) -> Result<bool> {
        let wr_id = self.tag | q as u64;
        // Without immediate data the credit is a note, sent inline.
        let bytes = note(CREDIT | counts, 0);
        let sge = Sge {
            addr: bytes.as_ptr() as u64,
            length: NOTE as u32,
            lkey: 0,
        };
        let credit = match self.notes {
            Some(_) => {
                let mut wr = RawSendWr::new(wr_id, WrOpcode::Send, std::slice::from_ref(&sge));
                wr.flags |= SendFlags::INLINE;
                wr
            }
            None => {
                let mut wr = RawSendWr::new(wr_id, WrOpcode::SendWithImm, &[]);
                wr.imm = CREDIT | counts;
                wr
            }
        };
        // SAFETY: the request carries no registered memory; an inline note is copied at post
        // time from `bytes`, which outlives the call.
        match unsafe { self.qps[q].post_send_raw(std::slice::from_ref(&credit)) } {
            Ok(()) => Ok(true),
            Err(Error::QueueFull { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Moves every queue pair to the error state (nothing more is sent or received).
    pub fn shut_down(&self) {
        for qp in &self.qps {
            let _ = qp.to_error();
        }
    }
}

fn message_imm(wc: &Completion) -> Result<u32> {
    match wc.imm {
        Some(imm) if imm & CREDIT == 0 && wc.opcode == WcOpcode::RecvRdmaWithImm => Ok(imm),
        _ => Err(Error::protocol(format!(
            "the sender sent {:?} ({:?}) where a message was expected",
            wc.imm, wc.opcode
        ))),
    }
}

fn check(slots: usize, tag: u64) -> Result<()> {
    if slots == 0 || slots > MAX_SLOTS {
        return Err(Error::invalid(format!(
            "{slots} slots per queue pair (1..={MAX_SLOTS})"
        )));
    }
    if tag & QP_MASK != 0 {
        return Err(Error::invalid(format!(
            "channel tag {tag:#x} overlaps the queue-pair index (low 32 bits)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::packed_width;

    #[test]
    fn packed_credits_fit_thirty_bits() {
        // The ring's default: 8 queue pairs, 4 slots (3 bits each).
        assert_eq!(packed_width(8, 4), Some(3));
        assert_eq!(packed_width(10, 7), Some(3));
        assert_eq!(packed_width(11, 7), None);
        assert_eq!(packed_width(7, 8), Some(4));
        assert_eq!(packed_width(2, 256), Some(9));
        assert_eq!(packed_width(4, 256), None);
        assert_eq!(packed_width(30, 1), Some(1));
        assert_eq!(packed_width(31, 1), None);
    }
}
