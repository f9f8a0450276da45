//! Work requests as the protocol core takes them: fixed-size values, so posting never allocates.

use core::fmt;

use crate::vocab::{QpState, SendFlags, Sge, WrOpcode};

/// Most scatter/gather entries in one work request (the eRDMA send limit; receives use at most
/// one on eRDMA, the soft device accepts up to this many).
pub const MAX_SGE: usize = 6;

/// Most inline bytes in one work request (the eRDMA limit).
pub const MAX_INLINE: usize = 96;

/// Longest message (2³¹ bytes, so a RETH DMA length and a completion's `byte_len` hold it).
pub const MAX_MESSAGE: u64 = 1 << 31;

/// Up to [`MAX_SGE`] scatter/gather entries, stored inline.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SgeList {
    sges: [Sge; MAX_SGE],
    len: u8,
}

impl SgeList {
    /// No entries.
    pub const fn new() -> SgeList {
        SgeList {
            sges: [Sge::new(0, 0, 0); MAX_SGE],
            len: 0,
        }
    }

    /// A list of the given entries.
    ///
    /// # Errors
    /// [`PostError::TooManySges`] when there are more than [`MAX_SGE`].
    pub fn from_slice(sges: &[Sge]) -> Result<SgeList, PostError> {
        let mut l = SgeList::new();
        for &s in sges {
            l.push(s)?;
        }
        Ok(l)
    }

    /// Appends an entry.
    ///
    /// # Errors
    /// [`PostError::TooManySges`] when the list is full.
    pub fn push(&mut self, sge: Sge) -> Result<(), PostError> {
        let i = usize::from(self.len);
        if i >= MAX_SGE {
            return Err(PostError::TooManySges {
                requested: i + 1,
                max: MAX_SGE,
            });
        }
        self.sges[i] = sge;
        self.len += 1;
        Ok(())
    }

    /// The entries.
    pub fn as_slice(&self) -> &[Sge] {
        &self.sges[..usize::from(self.len)]
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sum of the entries' lengths.
    pub fn total_len(&self) -> u64 {
        self.as_slice().iter().map(|s| u64::from(s.length)).sum()
    }
}

impl fmt::Debug for SgeList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

/// Up to [`MAX_INLINE`] bytes copied into the work request when it is posted.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct InlineData {
    bytes: [u8; MAX_INLINE],
    len: u8,
}

impl InlineData {
    /// A copy of `data`.
    ///
    /// # Errors
    /// [`PostError::InlineTooLong`] when `data` is longer than [`MAX_INLINE`].
    pub fn new(data: &[u8]) -> Result<InlineData, PostError> {
        if data.len() > MAX_INLINE {
            return Err(PostError::InlineTooLong {
                requested: data.len(),
                max: MAX_INLINE,
            });
        }
        let mut bytes = [0u8; MAX_INLINE];
        bytes[..data.len()].copy_from_slice(data);
        Ok(InlineData {
            bytes,
            len: data.len() as u8,
        })
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl fmt::Debug for InlineData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "InlineData({} bytes)", self.len)
    }
}

/// Where a send work request's local bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SendData {
    /// In registered memory (for READ and atomics: where the result goes).
    Sges(SgeList),
    /// Copied into the request (SEND and WRITE only).
    Inline(InlineData),
}

impl SendData {
    /// Total length.
    pub fn len(&self) -> u64 {
        match self {
            SendData::Sges(l) => l.total_len(),
            SendData::Inline(d) => d.as_bytes().len() as u64,
        }
    }

    /// Whether the length is 0.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWqe {
    /// Returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub opcode: WrOpcode,
    /// Local bytes: the source (SEND, WRITE) or destination (READ, atomic result).
    pub data: SendData,
    /// Remote address (WRITE, READ, atomics).
    pub remote_addr: u64,
    /// Remote key (WRITE, READ, atomics).
    pub rkey: u32,
    /// Immediate data, the big-endian value of the four wire bytes (`*_WITH_IMM`).
    pub imm: u32,
    /// The R_Key to invalidate at the receiver (SEND_WITH_INV).
    pub invalidate_rkey: u32,
    /// Compare value (compare-and-swap) or addend (fetch-and-add).
    pub compare_add: u64,
    /// Swap value (compare-and-swap).
    pub swap: u64,
    /// Flags.
    pub flags: SendFlags,
}

impl SendWqe {
    fn base(wr_id: u64, opcode: WrOpcode, data: SendData) -> SendWqe {
        SendWqe {
            wr_id,
            opcode,
            data,
            remote_addr: 0,
            rkey: 0,
            imm: 0,
            invalidate_rkey: 0,
            compare_add: 0,
            swap: 0,
            flags: SendFlags::SIGNALED,
        }
    }

    /// A signaled SEND of `data`.
    pub fn send(wr_id: u64, data: SendData) -> SendWqe {
        SendWqe::base(wr_id, WrOpcode::Send, data)
    }

    /// A signaled RDMA WRITE of `data` to `remote_addr`/`rkey`.
    pub fn write(wr_id: u64, data: SendData, remote_addr: u64, rkey: u32) -> SendWqe {
        SendWqe {
            remote_addr,
            rkey,
            ..SendWqe::base(wr_id, WrOpcode::RdmaWrite, data)
        }
    }

    /// A signaled RDMA READ from `remote_addr`/`rkey` into `dst`.
    pub fn read(wr_id: u64, dst: SgeList, remote_addr: u64, rkey: u32) -> SendWqe {
        SendWqe {
            remote_addr,
            rkey,
            ..SendWqe::base(wr_id, WrOpcode::RdmaRead, SendData::Sges(dst))
        }
    }

    /// A signaled compare-and-swap of the 8 bytes at `remote_addr`; the old value lands in
    /// `result` (one 8-byte entry).
    pub fn compare_swap(
        wr_id: u64,
        result: Sge,
        remote_addr: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
    ) -> SendWqe {
        let mut l = SgeList::new();
        l.sges[0] = result;
        l.len = 1;
        SendWqe {
            remote_addr,
            rkey,
            compare_add: compare,
            swap,
            ..SendWqe::base(wr_id, WrOpcode::AtomicCmpAndSwp, SendData::Sges(l))
        }
    }

    /// A signaled fetch-and-add on the 8 bytes at `remote_addr`; the old value lands in
    /// `result` (one 8-byte entry).
    pub fn fetch_add(wr_id: u64, result: Sge, remote_addr: u64, rkey: u32, add: u64) -> SendWqe {
        let mut w = SendWqe::compare_swap(wr_id, result, remote_addr, rkey, add, 0);
        w.opcode = WrOpcode::AtomicFetchAndAdd;
        w
    }

    /// The same request with another opcode (e.g. `SendWithImm` after [`SendWqe::send`]).
    pub fn with_opcode(mut self, opcode: WrOpcode) -> SendWqe {
        self.opcode = opcode;
        self
    }

    /// The same request carrying immediate data (turns SEND / WRITE into their `_WITH_IMM`
    /// forms).
    pub fn with_imm(mut self, imm: u32) -> SendWqe {
        self.imm = imm;
        self.opcode = match self.opcode {
            WrOpcode::Send => WrOpcode::SendWithImm,
            WrOpcode::RdmaWrite => WrOpcode::RdmaWriteWithImm,
            other => other,
        };
        self
    }

    /// The same request invalidating `rkey` at the receiver (turns SEND into SEND_WITH_INV).
    pub fn with_invalidate(mut self, rkey: u32) -> SendWqe {
        self.invalidate_rkey = rkey;
        if self.opcode == WrOpcode::Send {
            self.opcode = WrOpcode::SendWithInv;
        }
        self
    }

    /// The same request with these flags.
    pub fn with_flags(mut self, flags: SendFlags) -> SendWqe {
        self.flags = flags;
        self
    }

    /// Checks the request's shape (not memory: keys are checked when it runs) and returns the
    /// message length.
    ///
    /// # Errors
    /// See [`PostError`].
    pub fn validate(&self, max_sge: usize, max_inline: usize) -> Result<u32, PostError> {
        let len = self.data.len();
        match self.data {
            SendData::Sges(l) if l.len() > max_sge => {
                return Err(PostError::TooManySges {
                    requested: l.len(),
                    max: max_sge,
                });
            }
            SendData::Inline(d) if d.as_bytes().len() > max_inline => {
                return Err(PostError::InlineTooLong {
                    requested: d.as_bytes().len(),
                    max: max_inline,
                });
            }
            SendData::Inline(_) if !(self.opcode.is_send() || self.opcode.is_write()) => {
                return Err(PostError::InvalidArgument(
                    "inline data on a READ or atomic",
                ));
            }
            _ => {}
        }
        if self.opcode.is_atomic() {
            match self.data {
                SendData::Sges(l) if l.len() == 1 && l.as_slice()[0].length == 8 => {}
                _ => {
                    return Err(PostError::InvalidArgument(
                        "an atomic needs one 8-byte result entry",
                    ));
                }
            }
        }
        if len > MAX_MESSAGE {
            return Err(PostError::MessageTooLong {
                requested: len,
                max: MAX_MESSAGE,
            });
        }
        Ok(len as u32)
    }
}

/// A receive work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWqe {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Where incoming SEND payload goes.
    pub sges: SgeList,
}

impl RecvWqe {
    /// A receive into `sges`.
    pub fn new(wr_id: u64, sges: SgeList) -> RecvWqe {
        RecvWqe { wr_id, sges }
    }
}

/// Why a work request was refused at posting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostError {
    /// The queue holds as many requests as it was created for.
    QueueFull {
        /// The queue's depth.
        depth: u32,
    },
    /// The queue pair's state does not accept this kind of request.
    InvalidState(QpState),
    /// More scatter/gather entries than allowed.
    TooManySges {
        /// Entries given.
        requested: usize,
        /// The limit.
        max: usize,
    },
    /// More inline bytes than allowed.
    InlineTooLong {
        /// Bytes given.
        requested: usize,
        /// The limit.
        max: usize,
    },
    /// The message is longer than the device allows.
    MessageTooLong {
        /// Bytes given.
        requested: u64,
        /// The limit.
        max: u64,
    },
    /// The request is inconsistent (what is wrong).
    InvalidArgument(&'static str),
}

impl fmt::Display for PostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PostError::QueueFull { depth } => write!(f, "work queue full ({depth} requests)"),
            PostError::InvalidState(s) => {
                write!(f, "queue pair in state {s} does not accept this request")
            }
            PostError::TooManySges { requested, max } => {
                write!(f, "{requested} scatter/gather entries (at most {max})")
            }
            PostError::InlineTooLong { requested, max } => {
                write!(f, "{requested} inline bytes (at most {max})")
            }
            PostError::MessageTooLong { requested, max } => {
                write!(f, "message of {requested} bytes (at most {max})")
            }
            PostError::InvalidArgument(what) => write!(f, "invalid work request: {what}"),
        }
    }
}

impl std::error::Error for PostError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_checked() {
        let sges =
            SgeList::from_slice(&[Sge::new(0x1000, 100, 1), Sge::new(0x2000, 28, 1)]).unwrap();
        let w = SendWqe::send(7, SendData::Sges(sges));
        assert_eq!(w.validate(6, 96), Ok(128));
        assert_eq!(
            w.validate(1, 96),
            Err(PostError::TooManySges {
                requested: 2,
                max: 1
            })
        );
        let too_many = [Sge::default(); MAX_SGE + 1];
        assert!(matches!(
            SgeList::from_slice(&too_many),
            Err(PostError::TooManySges { .. })
        ));
        assert!(matches!(
            InlineData::new(&[0; MAX_INLINE + 1]),
            Err(PostError::InlineTooLong { .. })
        ));
        let inline = SendData::Inline(InlineData::new(b"abc").unwrap());
        assert_eq!(
            SendWqe::send(1, inline).validate(6, 2),
            Err(PostError::InlineTooLong {
                requested: 3,
                max: 2
            })
        );
        let r = SendWqe::read(1, sges, 0x10, 5);
        assert_eq!(r.validate(6, 96), Ok(128));
        let mut bad_read = r;
        bad_read.data = inline;
        assert!(matches!(
            bad_read.validate(6, 96),
            Err(PostError::InvalidArgument(_))
        ));
        let cas = SendWqe::compare_swap(1, Sge::new(0x1000, 8, 1), 0x10, 5, 1, 2);
        assert_eq!(cas.validate(6, 96), Ok(8));
        let short = SendWqe::fetch_add(1, Sge::new(0x1000, 4, 1), 0x10, 5, 1);
        assert!(matches!(
            short.validate(6, 96),
            Err(PostError::InvalidArgument(_))
        ));
        let huge = SendWqe::send(
            1,
            SendData::Sges(
                SgeList::from_slice(&[Sge::new(0, u32::MAX, 1), Sge::new(0, 2, 1)]).unwrap(),
            ),
        );
        assert!(matches!(
            huge.validate(6, 96),
            Err(PostError::MessageTooLong { .. })
        ));
        assert_eq!(
            SendWqe::send(1, inline).with_imm(5).opcode,
            WrOpcode::SendWithImm
        );
        assert_eq!(
            SendWqe::send(1, inline).with_invalidate(5).opcode,
            WrOpcode::SendWithInv
        );
        assert_eq!(WrOpcode::SendWithInv as u32, 9);
    }
}
