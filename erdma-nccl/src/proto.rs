//! The plugin's wire formats: what one side of a connection writes and the other reads. Plain
//! values and byte layouts only (no I/O), so every format is tested here.
//!
//! A connection carries one direction of NCCL traffic. The receiver drives it:
//!
//! 1. `irecv` sends a **clear-to-send** ([`Cts`]) to the sender, a SEND on queue pair 0 into one
//!    of the receive buffers the sender keeps posted: the transfer's sequence number and, per
//!    grouped receive, its address, size, remote key and tag.
//! 2. The sender matches `isend`s to the entries by tag and, once every entry of the group has
//!    its send, RDMA-WRITEs the data straight into the receiver's buffers, striped over the
//!    connection's queue pairs. Where a size does not fit the notification, the sizes first go
//!    as a [`Record`] into the receiver's record slot of the transfer (a WRITE on the first queue
//!    pair used, so it lands before that queue pair's notification).
//! 3. The last request on every queue pair used carries the 32-bit [`Notice`]: as the immediate
//!    of a WRITE_WITH_IMM, or, where the device has no immediate data (siw), as the 4-byte
//!    payload of a SEND that follows the WRITE. Each consumes one of the receives the receiver
//!    keeps posted on every queue pair; the transfer is complete when all its notices arrived.
//!
//! So no SEND ever reaches a queue pair without a posted receive (iWARP has no RNR retry): the
//! receiver keeps [`RX_PER_QP`] receives per queue pair, at most [`SLOTS`] transfers are granted
//! at a time and each sends at most one notice per queue pair; the sender keeps [`CTS_RX`]
//! receives for the at most [`SLOTS`] clear-to-sends in flight.

/// Transfers in flight per connection (NCCL's `NCCL_NET_MAX_REQUESTS`).
pub const SLOTS: usize = 32;
/// Grouped receives per `irecv` (the `maxRecvs` the plugin advertises).
pub const MAX_RECVS: usize = 8;
/// Queue pairs per connection at most (4 bits of the notice).
pub const MAX_QPS: usize = 16;
/// Receives the receiver keeps posted per queue pair for notices.
pub const RX_PER_QP: usize = SLOTS + 8;
/// Receives the sender keeps posted on queue pair 0 for clear-to-sends.
pub const CTS_RX: usize = SLOTS + 8;
/// Bytes of a clear-to-send buffer (the largest message, 8 + 24 × 8 = 200 bytes, rounded up).
pub const CTS_BYTES: usize = 256;
/// Bytes of a record slot in the receiver's record region.
pub const RECORD_BYTES: usize = 128;
/// Bytes of one notice receive buffer (SEND mode carries the 4-byte notice).
pub const NOTICE_BYTES: usize = 8;
/// Largest size a notice carries itself; larger ones (and grouped receives) go as a record.
pub const NOTICE_SIZE_MAX: u64 = (1 << 21) - 1;

/// One grouped receive as the receiver grants it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CtsEntry {
    /// Where the data goes.
    pub addr: u64,
    /// How many bytes it may take.
    pub size: u64,
    /// The remote key of the region holding it.
    pub rkey: u32,
    /// NCCL's tag: which send goes here.
    pub tag: i32,
}

/// A clear-to-send: the receives of one transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cts {
    /// The transfer's sequence number (low 32 bits).
    pub seq: u32,
    /// How many entries are used.
    pub n: usize,
    /// The grouped receives.
    pub entries: [CtsEntry; MAX_RECVS],
}

/// Why a message from the peer is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FormatError(pub String);

impl std::fmt::Display for FormatError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Cts {
    /// Bytes of the encoded message.
    pub fn encoded_len(&self) -> usize {
        8 + 24 * self.n
    }

    /// Writes the message (little-endian): `seq u32 | n u8 | 3 reserved | n × (addr u64 | size
    /// u64 | rkey u32 | tag i32)`. Returns its length.
    ///
    /// # Panics
    /// When `out` is shorter than [`CTS_BYTES`] or `n` exceeds [`MAX_RECVS`] (the caller's
    /// invariants).
    pub fn encode(&self, out: &mut [u8]) -> usize {
        assert!(self.n <= MAX_RECVS && out.len() >= CTS_BYTES);
        out[0..4].copy_from_slice(&self.seq.to_le_bytes());
        out[4] = self.n as u8;
        out[5..8].fill(0);
        for (i, e) in self.entries[..self.n].iter().enumerate() {
            let b = &mut out[8 + 24 * i..8 + 24 * (i + 1)];
            b[0..8].copy_from_slice(&e.addr.to_le_bytes());
            b[8..16].copy_from_slice(&e.size.to_le_bytes());
            b[16..20].copy_from_slice(&e.rkey.to_le_bytes());
            b[20..24].copy_from_slice(&e.tag.to_le_bytes());
        }
        self.encoded_len()
    }

    /// Parses a message of `len` bytes.
    ///
    /// # Errors
    /// A [`FormatError`] naming what is wrong: a length that does not match the count, a count
    /// of 0 or above [`MAX_RECVS`].
    pub fn decode(msg: &[u8]) -> Result<Cts, FormatError> {
        if msg.len() < 8 {
            return Err(FormatError(format!(
                "a {}-byte clear-to-send is shorter than its header",
                msg.len()
            )));
        }
        let n = msg[4] as usize;
        if n == 0 || n > MAX_RECVS {
            return Err(FormatError(format!(
                "a clear-to-send for {n} receives (1..={MAX_RECVS} allowed)"
            )));
        }
        if msg.len() != 8 + 24 * n {
            return Err(FormatError(format!(
                "a {}-byte clear-to-send for {n} receives (expected {})",
                msg.len(),
                8 + 24 * n
            )));
        }
        let mut cts = Cts {
            seq: u32::from_le_bytes([msg[0], msg[1], msg[2], msg[3]]),
            n,
            entries: [CtsEntry::default(); MAX_RECVS],
        };
        for (i, e) in cts.entries[..n].iter_mut().enumerate() {
            let b = &msg[8 + 24 * i..8 + 24 * (i + 1)];
            let u64_at = |o: usize| {
                u64::from_le_bytes([
                    b[o],
                    b[o + 1],
                    b[o + 2],
                    b[o + 3],
                    b[o + 4],
                    b[o + 5],
                    b[o + 6],
                    b[o + 7],
                ])
            };
            e.addr = u64_at(0);
            e.size = u64_at(8);
            e.rkey = u32::from_le_bytes([b[16], b[17], b[18], b[19]]);
            e.tag = i32::from_le_bytes([b[20], b[21], b[22], b[23]]);
        }
        Ok(cts)
    }
}

/// The sizes of one transfer, written into the receiver's record slot before the notices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Record {
    /// The transfer's sequence number (low 32 bits): the receiver checks it.
    pub seq: u32,
    /// How many sizes are used.
    pub n: usize,
    /// Bytes sent to each grouped receive.
    pub sizes: [u64; MAX_RECVS],
}

impl Record {
    /// Bytes of the encoded record.
    pub fn encoded_len(&self) -> usize {
        8 + 8 * self.n
    }

    /// Writes `seq u32 | n u32 | n × size u64` (little-endian); returns the length.
    ///
    /// # Panics
    /// When `out` is shorter than [`RECORD_BYTES`] or `n` exceeds [`MAX_RECVS`].
    pub fn encode(&self, out: &mut [u8]) -> usize {
        assert!(self.n <= MAX_RECVS && out.len() >= RECORD_BYTES);
        out[0..4].copy_from_slice(&self.seq.to_le_bytes());
        out[4..8].copy_from_slice(&(self.n as u32).to_le_bytes());
        for (i, s) in self.sizes[..self.n].iter().enumerate() {
            out[8 + 8 * i..16 + 8 * i].copy_from_slice(&s.to_le_bytes());
        }
        self.encoded_len()
    }

    /// Parses a record slot, expecting transfer `seq` with `n` sizes.
    ///
    /// # Errors
    /// A [`FormatError`] when the slot holds another transfer's record or another count.
    pub fn decode(slot: &[u8], seq: u32, n: usize) -> Result<Record, FormatError> {
        if slot.len() < 8 + 8 * n || n > MAX_RECVS {
            return Err(FormatError(format!(
                "a record slot too short for {n} sizes"
            )));
        }
        let got_seq = u32::from_le_bytes([slot[0], slot[1], slot[2], slot[3]]);
        let got_n = u32::from_le_bytes([slot[4], slot[5], slot[6], slot[7]]) as usize;
        if got_seq != seq || got_n != n {
            return Err(FormatError(format!(
                "the record of transfer {seq} ({n} receives) holds transfer {got_seq} with \
                 {got_n}"
            )));
        }
        let mut r = Record {
            seq,
            n,
            sizes: [0; MAX_RECVS],
        };
        for (i, s) in r.sizes[..n].iter_mut().enumerate() {
            let mut b = [0u8; 8];
            b.copy_from_slice(&slot[8 + 8 * i..16 + 8 * i]);
            *s = u64::from_le_bytes(b);
        }
        Ok(r)
    }
}

/// The 32-bit notice that completes a transfer on one queue pair.
///
/// Layout: bits 0–4 the transfer's slot, 5–8 the number of queue pairs carrying a notice for
/// it minus one, bit 9 "the sizes are in the record", bit 10 "the sender refused the transfer"
/// (a send larger than its receive), bits 11–31 the size of a single receive when no record is
/// used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Notice {
    /// The transfer's slot (sequence number modulo [`SLOTS`]).
    pub slot: usize,
    /// Queue pairs that carry a notice for the transfer (1..=[`MAX_QPS`]).
    pub nq: usize,
    /// The sizes are in the record slot.
    pub record: bool,
    /// The sender refused the transfer.
    pub error: bool,
    /// The size of the single receive (when `record` is false).
    pub size: u64,
}

const RECORD_BIT: u32 = 1 << 9;
const ERROR_BIT: u32 = 1 << 10;

impl Notice {
    /// The 32-bit form.
    ///
    /// # Panics
    /// When a field is out of its range (the caller's invariants).
    pub fn encode(&self) -> u32 {
        assert!(self.slot < SLOTS && (1..=MAX_QPS).contains(&self.nq));
        assert!(self.record || self.size <= NOTICE_SIZE_MAX);
        let mut w = self.slot as u32 | ((self.nq as u32 - 1) << 5);
        if self.record {
            w |= RECORD_BIT;
        } else {
            w |= (self.size as u32) << 11;
        }
        if self.error {
            w |= ERROR_BIT;
        }
        w
    }

    /// Parses the 32-bit form.
    pub fn decode(w: u32) -> Notice {
        let record = w & RECORD_BIT != 0;
        Notice {
            slot: (w & 0x1f) as usize,
            nq: ((w >> 5) & 0xf) as usize + 1,
            record,
            error: w & ERROR_BIT != 0,
            size: if record { 0 } else { u64::from(w >> 11) },
        }
    }
}

/// How the last request on each queue pair notifies the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoticeMode {
    /// RDMA WRITE_WITH_IMM carrying the notice.
    Imm,
    /// RDMA WRITE, then a 4-byte SEND carrying the notice (devices without immediate data).
    Send,
}

impl NoticeMode {
    /// The wire code.
    pub fn code(self) -> u8 {
        match self {
            NoticeMode::Imm => 0,
            NoticeMode::Send => 1,
        }
    }

    /// From the wire code.
    pub fn from_code(c: u8) -> Option<NoticeMode> {
        match c {
            0 => Some(NoticeMode::Imm),
            1 => Some(NoticeMode::Send),
            _ => None,
        }
    }

    /// The mode both ends can use.
    pub fn common(self, other: NoticeMode) -> NoticeMode {
        if self == NoticeMode::Send || other == NoticeMode::Send {
            NoticeMode::Send
        } else {
            NoticeMode::Imm
        }
    }
}

/// The pieces a transfer's data is cut into: `(member, offset, len, queue pair)`, each member's
/// bytes cut into chunks of at least `min_chunk` bytes (so a transfer of `total` bytes uses up to
/// `qps` queue pairs), chunks handed to queue pairs round robin from `first`. Returns the
/// number of queue pairs used (at least 1: a transfer with no bytes still sends one notice).
pub fn plan_pieces(
    sizes: &[u64],
    qps: usize,
    first: usize,
    min_chunk: u64,
    out: &mut Vec<(usize, u64, u64, usize)>,
) -> usize {
    out.clear();
    let total: u64 = sizes.iter().sum();
    let per_qp = total.div_ceil(qps as u64);
    let chunk = per_qp.max(min_chunk).max(1).next_multiple_of(4096);
    let mut i = 0usize;
    for (m, &size) in sizes.iter().enumerate() {
        let mut off = 0;
        while off < size {
            let len = chunk.min(size - off);
            out.push((m, off, len, (first + i) % qps));
            i += 1;
            off += len;
        }
    }
    i.clamp(1, qps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cts_round_trip_and_golden_bytes() {
        let mut cts = Cts {
            seq: 0x0102_0304,
            n: 2,
            ..Cts::default()
        };
        cts.entries[0] = CtsEntry {
            addr: 0x1122_3344_5566_7788,
            size: 4096,
            rkey: 0xaabb_ccdd,
            tag: -1,
        };
        cts.entries[1] = CtsEntry {
            addr: 8,
            size: 0,
            rkey: 1,
            tag: 7,
        };
        let mut buf = [0u8; CTS_BYTES];
        let len = cts.encode(&mut buf);
        assert_eq!(len, 56);
        assert_eq!(&buf[..8], &[4, 3, 2, 1, 2, 0, 0, 0]);
        assert_eq!(
            &buf[8..16],
            &[0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11]
        );
        assert_eq!(&buf[16..24], &[0, 0x10, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            &buf[24..32],
            &[0xdd, 0xcc, 0xbb, 0xaa, 0xff, 0xff, 0xff, 0xff]
        );
        assert_eq!(Cts::decode(&buf[..len]).unwrap(), cts);
    }

    #[test]
    fn malformed_cts_is_refused() {
        let mut buf = [0u8; CTS_BYTES];
        let cts = Cts {
            seq: 1,
            n: 1,
            ..Cts::default()
        };
        let len = cts.encode(&mut buf);
        assert!(
            Cts::decode(&buf[..len - 1])
                .unwrap_err()
                .0
                .contains("expected 32")
        );
        assert!(Cts::decode(&buf[..4]).unwrap_err().0.contains("shorter"));
        buf[4] = 0;
        assert!(Cts::decode(&buf[..8]).unwrap_err().0.contains("0 receives"));
        buf[4] = 9;
        assert!(
            Cts::decode(&buf[..224])
                .unwrap_err()
                .0
                .contains("9 receives")
        );
    }

    #[test]
    fn record_round_trip_and_checks() {
        let mut r = Record {
            seq: 77,
            n: 3,
            ..Record::default()
        };
        r.sizes[..3].copy_from_slice(&[1, 1 << 40, 0]);
        let mut slot = [0u8; RECORD_BYTES];
        assert_eq!(r.encode(&mut slot), 32);
        assert_eq!(&slot[..8], &[77, 0, 0, 0, 3, 0, 0, 0]);
        assert_eq!(Record::decode(&slot, 77, 3).unwrap(), r);
        assert!(
            Record::decode(&slot, 78, 3)
                .unwrap_err()
                .0
                .contains("holds transfer 77")
        );
        assert!(Record::decode(&slot, 77, 2).is_err());
    }

    #[test]
    fn notice_round_trip_and_layout() {
        let n = Notice {
            slot: 31,
            nq: 16,
            record: false,
            error: false,
            size: NOTICE_SIZE_MAX,
        };
        let w = n.encode();
        assert_eq!(w, 0x1f | (15 << 5) | (((1u32 << 21) - 1) << 11));
        assert_eq!(Notice::decode(w), n);
        let r = Notice {
            slot: 3,
            nq: 1,
            record: true,
            error: true,
            size: 0,
        };
        assert_eq!(r.encode(), 3 | (1 << 9) | (1 << 10));
        assert_eq!(Notice::decode(r.encode()), r);
    }

    #[test]
    fn pieces_spread_large_transfers_and_keep_small_ones_whole() {
        let mut out = Vec::new();
        // 1 MiB over 8 queue pairs with 128 KiB minimum chunks: 8 pieces, one per queue pair.
        assert_eq!(plan_pieces(&[1 << 20], 8, 3, 128 << 10, &mut out), 8);
        assert_eq!(out.len(), 8);
        assert_eq!(out[0], (0, 0, 128 << 10, 3));
        assert_eq!(out[7].3, 2);
        assert_eq!(out.iter().map(|p| p.2).sum::<u64>(), 1 << 20);
        // A small transfer stays on one queue pair.
        assert_eq!(plan_pieces(&[1000], 8, 5, 128 << 10, &mut out), 1);
        assert_eq!(out, vec![(0, 0, 1000, 5)]);
        // Nothing to send: one notice, no piece.
        assert_eq!(plan_pieces(&[0, 0], 4, 1, 4096, &mut out), 1);
        assert!(out.is_empty());
        // Odd sizes: every byte lands in exactly one piece, in order.
        let sizes = [3 * 4096 + 17, 0, 5];
        let used = plan_pieces(&sizes, 2, 0, 4096, &mut out);
        assert_eq!(used, 2);
        for (m, &s) in sizes.iter().enumerate() {
            let mut next = 0;
            for p in out.iter().filter(|p| p.0 == m) {
                assert_eq!(p.1, next);
                next += p.2;
            }
            assert_eq!(next, s);
        }
    }

    #[test]
    fn notice_modes_meet_at_the_weaker() {
        assert_eq!(NoticeMode::Imm.common(NoticeMode::Imm), NoticeMode::Imm);
        assert_eq!(NoticeMode::Imm.common(NoticeMode::Send), NoticeMode::Send);
        assert_eq!(NoticeMode::from_code(1), Some(NoticeMode::Send));
        assert_eq!(NoticeMode::from_code(2), None);
    }
}
