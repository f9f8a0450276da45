//! The payload of a same-host reference packet: where the sender's bytes lie in its own memory.
//!
//! Two soft devices on one host that proved it to each other (the engine's `same_host`
//! exchange) may send a SEND or WRITE packet whose BTH carries the peer-reference bit and
//! whose payload is this list instead of the bytes; the receiver copies the bytes straight out
//! of the sender's memory into its own (one copy, `process_vm_readv`). Nothing else about the
//! packet changes: opcodes, PSNs and the ICRC are RoCEv2's. rxe never sets the bit and is never
//! sent such a packet.
//!
//! Layout (big-endian): total payload bytes (u32), piece count (u8, 1–[`MAX_PIECES`]), three
//! zero bytes, the token the two devices agreed on (u64: only the sender knows it, so a packet
//! from whoever holds the sender's address later is refused), then per piece its address (u64)
//! and length (u32, non-zero). The pieces' lengths add up to the total.

use super::{PacketError, PacketResult};

/// Most pieces one list holds (a request has at most six scatter/gather entries).
pub const MAX_PIECES: usize = 8;
const HEAD: usize = 16;
const PIECE: usize = 12;

/// Bytes a list of `count` pieces takes.
pub const fn encoded_len(count: usize) -> usize {
    HEAD + PIECE * count
}

/// A run of the sender's bytes: `len` bytes at address `addr` of its process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Piece {
    /// Address in the sender's process.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
}

/// A reference list: the pieces of one packet's payload, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerRefs {
    pieces: [Piece; MAX_PIECES],
    count: u8,
    total: u32,
    token: u64,
}

impl PeerRefs {
    /// An empty list carrying `token`.
    pub const fn new(token: u64) -> PeerRefs {
        PeerRefs {
            pieces: [Piece { addr: 0, len: 0 }; MAX_PIECES],
            count: 0,
            total: 0,
            token,
        }
    }

    /// The token the list carries.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// Appends a piece (a zero-length one is skipped). Returns `false`, leaving the list as it
    /// was, when it is full, the total would overflow, or the piece's end overflows.
    pub fn push(&mut self, addr: u64, len: u32) -> bool {
        if len == 0 {
            return true;
        }
        let count = usize::from(self.count);
        let Some(total) = self.total.checked_add(len) else {
            return false;
        };
        if count == MAX_PIECES || addr.checked_add(u64::from(len)).is_none() {
            return false;
        }
        self.pieces[count] = Piece { addr, len };
        self.count += 1;
        self.total = total;
        true
    }

    /// Payload bytes the list stands for.
    pub fn total(&self) -> u32 {
        self.total
    }

    /// The pieces, in payload order.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces[..usize::from(self.count)]
    }

    /// Bytes [`PeerRefs::emit`] writes.
    pub fn buffer_len(&self) -> usize {
        encoded_len(usize::from(self.count))
    }

    /// Reads a list; `buf` is the packet's payload.
    ///
    /// # Errors
    /// [`PacketError::Malformed`] when the length does not match the count, the count is 0 or
    /// over [`MAX_PIECES`], a reserved byte is set, a piece is empty or wraps the address
    /// space, or the pieces do not add up to the total.
    pub fn parse(buf: &[u8]) -> PacketResult<PeerRefs> {
        let (head, rest) = buf.split_at_checked(HEAD).ok_or(PacketError::Malformed)?;
        let total = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
        let count = usize::from(head[4]);
        if count == 0 || count > MAX_PIECES || head[5..8] != [0; 3] || rest.len() != PIECE * count {
            return Err(PacketError::Malformed);
        }
        let mut token = [0u8; 8];
        token.copy_from_slice(&head[8..HEAD]);
        let mut refs = PeerRefs::new(u64::from_be_bytes(token));
        for p in rest.chunks_exact(PIECE) {
            let mut a = [0u8; 8];
            a.copy_from_slice(&p[..8]);
            let len = u32::from_be_bytes([p[8], p[9], p[10], p[11]]);
            if len == 0 || !refs.push(u64::from_be_bytes(a), len) {
                return Err(PacketError::Malformed);
            }
        }
        if refs.total != total {
            return Err(PacketError::Malformed);
        }
        Ok(refs)
    }

    /// Writes the list into the front of `buf`; returns the bytes written.
    ///
    /// # Panics
    /// When `buf` is shorter than [`PeerRefs::buffer_len`] (callers size it from that).
    pub fn emit(&self, buf: &mut [u8]) -> usize {
        let n = self.buffer_len();
        let out = &mut buf[..n];
        out[..4].copy_from_slice(&self.total.to_be_bytes());
        out[4] = self.count;
        out[5..8].fill(0);
        out[8..HEAD].copy_from_slice(&self.token.to_be_bytes());
        for (p, o) in self
            .pieces()
            .iter()
            .zip(out[HEAD..].chunks_exact_mut(PIECE))
        {
            o[..8].copy_from_slice(&p.addr.to_be_bytes());
            o[8..].copy_from_slice(&p.len.to_be_bytes());
        }
        n
    }

    /// The pieces covering bytes `[offset, offset + len)` of the payload, cut to that range;
    /// `None` when the range leaves the payload.
    pub fn slice(&self, offset: u32, len: u32) -> Option<PeerRefs> {
        let end = offset.checked_add(len)?;
        if end > self.total {
            return None;
        }
        let mut out = PeerRefs::new(self.token);
        let mut at = 0u32;
        for p in self.pieces() {
            let (lo, hi) = (at.max(offset), (at + p.len).min(end));
            if lo < hi && !out.push(p.addr + u64::from(lo - at), hi - lo) {
                return None;
            }
            at += p.len;
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_slices() {
        let mut r = PeerRefs::new(0x1122_3344_5566_7788);
        assert!(r.push(0x1000, 100));
        assert!(r.push(0x9000, 0), "an empty piece is skipped");
        assert!(r.push(0x5000, 50));
        let mut buf = [0u8; 64];
        let n = r.emit(&mut buf);
        assert_eq!(n, encoded_len(2));
        let back = PeerRefs::parse(&buf[..n]).expect("parses");
        assert_eq!(back, r);
        assert_eq!(back.total(), 150);
        assert_eq!(back.token(), 0x1122_3344_5566_7788);
        let s = back.slice(90, 20).expect("inside");
        assert_eq!(s.token(), back.token(), "a slice keeps the token");
        assert_eq!(
            s.pieces(),
            &[
                Piece {
                    addr: 0x1000 + 90,
                    len: 10
                },
                Piece {
                    addr: 0x5000,
                    len: 10
                }
            ]
        );
        assert!(back.slice(140, 11).is_none(), "past the end");
        assert!(back.slice(u32::MAX, 2).is_none(), "overflowing end");
    }

    #[test]
    fn malformed_lists_are_refused() {
        let mut r = PeerRefs::new(5);
        assert!(r.push(0x1000, 8));
        let mut buf = [0u8; 32];
        let n = r.emit(&mut buf);
        let ok = buf;
        assert!(PeerRefs::parse(&ok[..n - 1]).is_err(), "short");
        assert!(PeerRefs::parse(&ok[..4]).is_err(), "no head");
        let mut b = ok;
        b[3] = 9;
        assert!(PeerRefs::parse(&b[..n]).is_err(), "total differs");
        let mut b = ok;
        b[4] = 0;
        assert!(PeerRefs::parse(&b[..HEAD]).is_err(), "no pieces");
        let mut b = ok;
        b[6] = 1;
        assert!(PeerRefs::parse(&b[..n]).is_err(), "reserved byte");
        let mut b = ok;
        b[HEAD..HEAD + 8].copy_from_slice(&u64::MAX.to_be_bytes());
        assert!(PeerRefs::parse(&b[..n]).is_err(), "wrapping piece");
        let mut b = ok;
        b[HEAD + 8..HEAD + 12].fill(0);
        b[..4].fill(0);
        assert!(PeerRefs::parse(&b[..n]).is_err(), "empty piece");
        let mut full = PeerRefs::new(0);
        for i in 0..MAX_PIECES as u64 {
            assert!(full.push(i << 20, 1));
        }
        assert!(!full.push(1 << 40, 1), "full");
        let mut big = PeerRefs::new(0);
        assert!(big.push(0, u32::MAX));
        assert!(!big.push(0, 1), "total overflows");
    }
}
