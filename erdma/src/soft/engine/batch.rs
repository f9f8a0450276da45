//! The transmit batch: packets built in place in one buffer, grouped into messages the socket
//! sends with one system call, equal-size packets to one destination as one UDP GSO train.
//!
//! Owns [`TxBatch`] and the placement policy (which message a packet joins, and so the
//! segment index, that is the IPv4 identification, the kernel will give it). It does no I/O:
//! the driver's socket sends a batch's messages (`sendmmsg`), the simulation takes its
//! datagrams ([`TxBatch::drain_datagrams`]).

#![allow(unsafe_code)] // lent payloads: bytes read by address

use std::net::SocketAddrV4;

/// Most segments the kernel accepts in one GSO send.
pub(crate) const GSO_MAX_SEGMENTS: usize = 64;
/// Most bytes in one GSO send (the IPv4 total length limit, less headers).
pub(crate) const GSO_MAX_BYTES: usize = 65_000;

/// One outgoing message: a single datagram or a GSO train of equal-size segments (the last may
/// be shorter). Its packets need not lie next to each other in the batch's buffer: they are a
/// list through [`TxPkt::next`], sent as one iovec per contiguous run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TxMsg {
    pub(crate) dst: SocketAddrV4,
    pub(crate) len: usize,
    pub(crate) seg: usize,
    pub(crate) segments: usize,
    /// Whether the last segment was shorter than `seg` (then nothing more may join).
    pub(crate) closed: bool,
    /// First and last packet (indices into `TxBatch::pkts`).
    pub(crate) head: u32,
    pub(crate) tail: u32,
    /// Its packets whose payload is lent (each costs two more iovecs).
    pub(crate) lent: usize,
}

/// A packet about to be committed to a [`TxBatch`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Outgoing {
    /// Bytes.
    pub(crate) len: usize,
    pub(crate) dst: SocketAddrV4,
    /// The packet's flow (the queue pair sending it): a flow's packets keep their order.
    pub(crate) flow: u32,
    /// Whether it is a middle packet of a message (more of its size follow).
    pub(crate) middle: bool,
}

/// Where a packet goes in a [`TxBatch`]: the message it joins (`None`: a new one) and its
/// segment index there.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Placement {
    pkt: Outgoing,
    msg: Option<usize>,
    segment: u16,
}

impl Placement {
    /// The packet's GSO segment index: the IPv4 identification the kernel gives it.
    pub(crate) fn segment_index(&self) -> u16 {
        self.segment
    }
}

/// A packet in the batch's buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TxPkt {
    pub(crate) off: u32,
    pub(crate) len: u32,
    /// The next packet of the same message, or [`NO_PKT`].
    pub(crate) next: u32,
    /// Its payload, when lent: the buffer's bytes there are not sent.
    pub(crate) lent: Option<LentBytes>,
}

/// A payload a packet carries from memory outside the batch ([`TxBatch::commit_lent`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LentBytes {
    /// Offset of the payload in the packet.
    pub(crate) at: usize,
    /// Bytes.
    pub(crate) len: usize,
    /// Address of the first byte.
    pub(crate) addr: u64,
}

pub(crate) const NO_PKT: u32 = u32::MAX;
/// How many of the latest messages a packet may look through for one to join.
const JOIN_LOOKBACK: usize = 16;

/// Packets waiting to be sent, built in place.
///
/// Each packet belongs to a flow (the queue pair that sent it): packets of one flow leave in the
/// order they were committed, packets of different flows may be reordered so that equal-size
/// packets to one destination share a GSO message. Several queue pairs streaming to one peer
/// (a WRITE is a FIRST, MIDDLEs and a LAST, three sizes) then cost a few messages per batch
/// instead of a few per WRITE.
#[derive(Debug)]
pub(crate) struct TxBatch {
    /// Packet bytes; its length only grows (zeroed once), `used` marks what is queued.
    buf: Vec<u8>,
    used: usize,
    capacity: usize,
    msgs: Vec<TxMsg>,
    pkts: Vec<TxPkt>,
    /// For each flow with a packet queued: the message its latest packet joined.
    flows: Vec<(u32, usize)>,
    gso: bool,
    max_packet: usize,
    /// Messages handed to the kernel over the batch's life (the number only grows).
    sent: u64,
    /// Packets queued whose payload is lent.
    lent: usize,
}

impl TxBatch {
    /// A batch able to hold `capacity` bytes of packets of at most `max_packet` bytes each.
    pub(crate) fn new(capacity: usize, max_packet: usize, gso: bool) -> TxBatch {
        let capacity = capacity.max(max_packet);
        TxBatch {
            buf: Vec::with_capacity(capacity),
            used: 0,
            capacity,
            // Sized for a typical batch, so that steady traffic never grows them.
            msgs: Vec::with_capacity(64),
            pkts: Vec::with_capacity(256),
            flows: Vec::with_capacity(16),
            gso,
            max_packet,
            sent: 0,
            lent: 0,
        }
    }

    /// The queued messages, in order.
    pub(crate) fn msgs(&self) -> &[TxMsg] {
        &self.msgs
    }

    /// Packet `i` of a message's list ([`TxMsg::head`], [`TxPkt::next`]).
    pub(crate) fn pkt(&self, i: u32) -> TxPkt {
        self.pkts[i as usize]
    }

    /// The packets' bytes (a lent payload's place in its packet holds stale bytes).
    pub(crate) fn buf(&self) -> &[u8] {
        &self.buf[..self.used]
    }

    /// Whether packets may share messages as GSO trains.
    #[cfg(test)]
    pub(crate) fn gso(&self) -> bool {
        self.gso
    }

    /// Turns GSO off for this batch from now on (the kernel refused a train).
    pub(crate) fn disable_gso(&mut self) {
        self.gso = false;
    }

    /// Every queued message was handed over: counts them and empties the batch.
    pub(crate) fn mark_sent(&mut self) {
        self.sent += self.msgs.len() as u64;
        self.clear();
    }

    /// Hands every queued packet to `f` as the datagram the network carries (destination,
    /// bytes, GSO segment index) in the order a GSO send puts them on the wire, then counts
    /// the messages sent and empties the batch: what a socket does, for a network model.
    #[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))] // the simulation's
    pub(crate) fn drain_datagrams(&mut self, mut f: impl FnMut(SocketAddrV4, &[u8], u16)) {
        self.own_lent();
        for m in &self.msgs {
            let mut p = m.head;
            let mut k = 0u16;
            while p != NO_PKT {
                let pk = self.pkts[p as usize];
                let at = pk.off as usize;
                f(m.dst, &self.buf[at..at + pk.len as usize], k);
                k = k.wrapping_add(1);
                p = pk.next;
            }
        }
        self.mark_sent();
    }

    /// Whether a queued packet's payload is lent ([`TxBatch::commit_lent`]).
    pub(crate) fn has_lent(&self) -> bool {
        self.lent > 0
    }

    /// Copies every lent payload into its packet: afterwards the batch no longer reads the
    /// memory they were lent from.
    pub(crate) fn own_lent(&mut self) {
        if self.lent == 0 {
            return;
        }
        for p in &mut self.pkts {
            if let Some(l) = p.lent.take() {
                let at = p.off as usize + l.at;
                // `commit_lent`'s caller keeps `[addr, addr+len)` readable until the batch is
                // sent or cleared or this copies it; the destination is the packet's own payload
                // area inside `buf` (checked by the slice index), which `addr` does not overlap
                // (it is outside the batch).
                // SAFETY: a readable source and a distinct, in-bounds destination (above).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        l.addr as *const u8,
                        self.buf[at..at + l.len].as_mut_ptr(),
                        l.len,
                    );
                }
            }
        }
        for m in &mut self.msgs {
            m.lent = 0;
        }
        self.lent = 0;
    }

    /// Messages handed to the kernel over the batch's life, dropped ones included.
    pub(crate) fn sent(&self) -> u64 {
        self.sent
    }

    /// Whether another packet of `max_packet` bytes may not fit.
    pub(crate) fn is_full(&self) -> bool {
        self.used + self.max_packet > self.capacity || self.pkts.len() >= 1024
    }

    /// Whether there is nothing to send.
    pub(crate) fn is_empty(&self) -> bool {
        self.msgs.is_empty()
    }

    /// Number of packets queued.
    #[cfg(test)]
    pub(crate) fn packets(&self) -> usize {
        self.pkts.len()
    }

    /// Number of messages (datagrams or GSO trains) queued.
    #[cfg(test)]
    pub(crate) fn messages(&self) -> usize {
        self.msgs.len()
    }

    /// Room for the next packet (`max_packet` bytes). Write it, then [`TxBatch::commit`].
    ///
    /// The space holds whatever an earlier packet left there: writers fill every byte of the
    /// packet they commit (headers, payload, pad and ICRC).
    pub(crate) fn space(&mut self) -> &mut [u8] {
        let end = self.used + self.max_packet;
        if self.buf.len() < end {
            self.buf.resize(end, 0);
        }
        &mut self.buf[self.used..end]
    }

    /// Where the packet just written in [`TxBatch::space`] goes; [`Placement::segment_index`]
    /// tells its GSO segment index (the IPv4 identification the kernel will give it) before
    /// [`TxBatch::commit`] puts it there.
    pub(crate) fn place(&self, pkt: Outgoing) -> Placement {
        let pkt = Outgoing {
            len: pkt.len.min(self.max_packet),
            ..pkt
        };
        let msg = self.joinable(pkt);
        Placement {
            pkt,
            msg,
            segment: msg.map_or(0, |i| self.msgs[i].segments as u16),
        }
    }

    /// The message a packet may join: one of the latest messages, to its destination, not
    /// before its flow's previous packet, with room and segments of exactly its length; failing
    /// that, the last message when the packet may end it (shorter than its segments; a middle
    /// packet ends trains only, never a lone packet, which a later message's first packet may
    /// still join).
    fn joinable(&self, pkt: Outgoing) -> Option<usize> {
        let Outgoing {
            len,
            dst,
            flow,
            middle,
        } = pkt;
        if !self.gso || self.msgs.is_empty() {
            return None;
        }
        let floor = self
            .flows
            .iter()
            .find(|(f, _)| *f == flow)
            .map_or(0, |&(_, m)| m);
        let lowest = floor.max(self.msgs.len().saturating_sub(JOIN_LOOKBACK));
        let fits = |m: &TxMsg| {
            m.dst == dst
                && !m.closed
                && m.segments < GSO_MAX_SEGMENTS
                && m.len + len <= GSO_MAX_BYTES
        };
        if let Some(i) = (lowest..self.msgs.len())
            .rev()
            .find(|&i| fits(&self.msgs[i]) && self.msgs[i].seg == len)
        {
            return Some(i);
        }
        let last = self.msgs.len() - 1;
        let m = &self.msgs[last];
        (last >= floor && fits(m) && len < m.seg && (m.segments > 1 || !middle)).then_some(last)
    }

    /// The space handed out by the last [`TxBatch::space`], to edit a packet before committing.
    pub(crate) fn pending_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.used..self.used + self.max_packet]
    }

    /// Keeps the first `len` bytes of the space as a packet, where [`TxBatch::place`] said (the
    /// batch must not have changed in between).
    pub(crate) fn commit(&mut self, placement: Placement) {
        self.push(placement, None);
    }

    /// [`TxBatch::commit`] for a packet whose payload is sent from `lent.addr` instead of the
    /// space's bytes at `lent.at`.
    ///
    /// # Safety
    /// `[lent.addr, lent.addr + lent.len)` must be readable, outside the batch, and stay so
    /// until the batch has been sent or cleared or [`TxBatch::own_lent`] has copied it.
    pub(crate) unsafe fn commit_lent(&mut self, placement: Placement, lent: LentBytes) {
        assert!(
            lent.at > 0 && lent.at + lent.len <= placement.pkt.len,
            "a lent payload lies inside its packet, after the headers"
        );
        self.push(placement, Some(lent));
    }

    fn push(&mut self, placement: Placement, lent: Option<LentBytes>) {
        let Placement { pkt, msg, .. } = placement;
        let Outgoing { len, dst, flow, .. } = pkt;
        let start = self.used;
        self.used = start + len;
        let p = self.pkts.len() as u32;
        self.pkts.push(TxPkt {
            off: start as u32,
            len: len as u32,
            next: NO_PKT,
            lent,
        });
        let lent = usize::from(lent.is_some());
        self.lent += lent;
        let at = match msg {
            Some(i) => {
                let m = &mut self.msgs[i];
                self.pkts[m.tail as usize].next = p;
                m.tail = p;
                m.len += len;
                m.segments += 1;
                m.closed = len < m.seg;
                m.lent += lent;
                i
            }
            None => {
                self.msgs.push(TxMsg {
                    dst,
                    len,
                    seg: len,
                    segments: 1,
                    closed: false,
                    head: p,
                    tail: p,
                    lent,
                });
                self.msgs.len() - 1
            }
        };
        match self.flows.iter_mut().find(|(f, _)| *f == flow) {
            Some(e) => e.1 = at,
            None => self.flows.push((flow, at)),
        }
    }

    /// Empties the batch if it still holds lent payloads where it may hold none: outside the
    /// region-table lock. Only a call that unwound midway (a panic between `commit_lent` and
    /// the send or `own_lent` that must follow) leaves them, and their regions may be gone by
    /// now. The packets are dropped, as a network would drop them: the protocol retransmits.
    /// Returns whether it emptied the batch.
    pub(crate) fn discard_stale_lent(&mut self) -> bool {
        if self.lent == 0 {
            return false;
        }
        self.clear();
        true
    }

    /// Empties the batch.
    pub(crate) fn clear(&mut self) {
        self.used = 0;
        self.msgs.clear();
        self.pkts.clear();
        self.flows.clear();
        self.lent = 0;
    }
}
