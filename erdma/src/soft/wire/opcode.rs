//! The RC opcode table: header length, extension headers, position in a message, and what each
//! opcode means to the receiver.
//!
//! Owns the facts of the RC opcode table as Linux rxe defines them (RC class, opcodes 0x00–0x17).
//! Opcodes of other transports, and RC opcodes rxe 6.1 does not know (FLUSH, ATOMIC_WRITE), are
//! [`Opcode::Unknown`].

use core::fmt;
use core::ops::BitOr;

/// A BTH opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Opcode {
    /// 0x00 SEND_FIRST.
    SendFirst,
    /// 0x01 SEND_MIDDLE.
    SendMiddle,
    /// 0x02 SEND_LAST.
    SendLast,
    /// 0x03 SEND_LAST_WITH_IMMEDIATE.
    SendLastImm,
    /// 0x04 SEND_ONLY.
    SendOnly,
    /// 0x05 SEND_ONLY_WITH_IMMEDIATE.
    SendOnlyImm,
    /// 0x06 RDMA_WRITE_FIRST.
    WriteFirst,
    /// 0x07 RDMA_WRITE_MIDDLE.
    WriteMiddle,
    /// 0x08 RDMA_WRITE_LAST.
    WriteLast,
    /// 0x09 RDMA_WRITE_LAST_WITH_IMMEDIATE.
    WriteLastImm,
    /// 0x0A RDMA_WRITE_ONLY.
    WriteOnly,
    /// 0x0B RDMA_WRITE_ONLY_WITH_IMMEDIATE.
    WriteOnlyImm,
    /// 0x0C RDMA_READ_REQUEST.
    ReadRequest,
    /// 0x0D RDMA_READ_RESPONSE_FIRST.
    ReadResponseFirst,
    /// 0x0E RDMA_READ_RESPONSE_MIDDLE.
    ReadResponseMiddle,
    /// 0x0F RDMA_READ_RESPONSE_LAST.
    ReadResponseLast,
    /// 0x10 RDMA_READ_RESPONSE_ONLY.
    ReadResponseOnly,
    /// 0x11 ACKNOWLEDGE.
    Acknowledge,
    /// 0x12 ATOMIC_ACKNOWLEDGE.
    AtomicAcknowledge,
    /// 0x13 COMPARE_SWAP.
    CompareSwap,
    /// 0x14 FETCH_ADD.
    FetchAdd,
    /// 0x16 SEND_LAST_WITH_INVALIDATE.
    SendLastInv,
    /// 0x17 SEND_ONLY_WITH_INVALIDATE.
    SendOnlyInv,
    /// Any other value.
    Unknown(u8),
}

impl From<u8> for Opcode {
    fn from(v: u8) -> Opcode {
        use Opcode::*;
        match v {
            0x00 => SendFirst,
            0x01 => SendMiddle,
            0x02 => SendLast,
            0x03 => SendLastImm,
            0x04 => SendOnly,
            0x05 => SendOnlyImm,
            0x06 => WriteFirst,
            0x07 => WriteMiddle,
            0x08 => WriteLast,
            0x09 => WriteLastImm,
            0x0A => WriteOnly,
            0x0B => WriteOnlyImm,
            0x0C => ReadRequest,
            0x0D => ReadResponseFirst,
            0x0E => ReadResponseMiddle,
            0x0F => ReadResponseLast,
            0x10 => ReadResponseOnly,
            0x11 => Acknowledge,
            0x12 => AtomicAcknowledge,
            0x13 => CompareSwap,
            0x14 => FetchAdd,
            0x16 => SendLastInv,
            0x17 => SendOnlyInv,
            other => Unknown(other),
        }
    }
}

impl From<Opcode> for u8 {
    fn from(op: Opcode) -> u8 {
        use Opcode::*;
        match op {
            SendFirst => 0x00,
            SendMiddle => 0x01,
            SendLast => 0x02,
            SendLastImm => 0x03,
            SendOnly => 0x04,
            SendOnlyImm => 0x05,
            WriteFirst => 0x06,
            WriteMiddle => 0x07,
            WriteLast => 0x08,
            WriteLastImm => 0x09,
            WriteOnly => 0x0A,
            WriteOnlyImm => 0x0B,
            ReadRequest => 0x0C,
            ReadResponseFirst => 0x0D,
            ReadResponseMiddle => 0x0E,
            ReadResponseLast => 0x0F,
            ReadResponseOnly => 0x10,
            Acknowledge => 0x11,
            AtomicAcknowledge => 0x12,
            CompareSwap => 0x13,
            FetchAdd => 0x14,
            SendLastInv => 0x16,
            SendOnlyInv => 0x17,
            Unknown(v) => v,
        }
    }
}

/// Properties of an opcode, as a set of bits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct OpFlags(u32);

impl OpFlags {
    /// Carries a RETH.
    pub const RETH: OpFlags = OpFlags(1 << 0);
    /// Carries an AtomicETH.
    pub const ATOMIC_ETH: OpFlags = OpFlags(1 << 1);
    /// Carries an AETH.
    pub const AETH: OpFlags = OpFlags(1 << 2);
    /// Carries an AtomicAckETH.
    pub const ATOMIC_ACK_ETH: OpFlags = OpFlags(1 << 3);
    /// Carries an ImmDt.
    pub const IMMDT: OpFlags = OpFlags(1 << 4);
    /// Carries an IETH.
    pub const IETH: OpFlags = OpFlags(1 << 5);
    /// Carries a payload.
    pub const PAYLOAD: OpFlags = OpFlags(1 << 6);
    /// First packet of a message.
    pub const START: OpFlags = OpFlags(1 << 7);
    /// Neither first nor last packet of a message.
    pub const MIDDLE: OpFlags = OpFlags(1 << 8);
    /// Last packet of a message.
    pub const END: OpFlags = OpFlags(1 << 9);
    /// Consumes a receive WQE at the responder.
    pub const RWR: OpFlags = OpFlags(1 << 10);
    /// Generates a receive completion at the responder.
    pub const COMP: OpFlags = OpFlags(1 << 11);
    /// Travels requester → responder.
    pub const REQUEST: OpFlags = OpFlags(1 << 12);
    /// Travels responder → requester (ACKs and read responses).
    pub const RESPONSE: OpFlags = OpFlags(1 << 13);
    /// Part of a SEND.
    pub const SEND: OpFlags = OpFlags(1 << 14);
    /// Part of an RDMA WRITE.
    pub const WRITE: OpFlags = OpFlags(1 << 15);
    /// Part of an RDMA READ (request or response).
    pub const READ: OpFlags = OpFlags(1 << 16);
    /// Part of an atomic (request or response).
    pub const ATOMIC: OpFlags = OpFlags(1 << 17);

    /// No flags.
    pub const fn empty() -> OpFlags {
        OpFlags(0)
    }

    /// Whether every flag of `other` is set.
    #[inline]
    pub const fn contains(self, other: OpFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether any flag of `other` is set.
    #[inline]
    pub const fn intersects(self, other: OpFlags) -> bool {
        self.0 & other.0 != 0
    }

    /// The raw bits.
    pub const fn bits(self) -> u32 {
        self.0
    }

    const fn or(self, other: OpFlags) -> OpFlags {
        OpFlags(self.0 | other.0)
    }
}

impl BitOr for OpFlags {
    type Output = OpFlags;
    fn bitor(self, rhs: OpFlags) -> OpFlags {
        self.or(rhs)
    }
}

impl fmt::Debug for OpFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const NAMES: [&str; 18] = [
            "RETH",
            "ATOMIC_ETH",
            "AETH",
            "ATOMIC_ACK_ETH",
            "IMMDT",
            "IETH",
            "PAYLOAD",
            "START",
            "MIDDLE",
            "END",
            "RWR",
            "COMP",
            "REQUEST",
            "RESPONSE",
            "SEND",
            "WRITE",
            "READ",
            "ATOMIC",
        ];
        let mut set = f.debug_set();
        for (i, name) in NAMES.iter().enumerate() {
            if self.0 & (1 << i) != 0 {
                set.entry(&format_args!("{name}"));
            }
        }
        set.finish()
    }
}

/// Extension-header lengths.
pub mod len {
    /// BTH.
    pub const BTH: usize = 12;
    /// RETH.
    pub const RETH: usize = 16;
    /// AtomicETH.
    pub const ATOMIC_ETH: usize = 28;
    /// AETH.
    pub const AETH: usize = 4;
    /// AtomicAckETH.
    pub const ATOMIC_ACK_ETH: usize = 8;
    /// ImmDt.
    pub const IMMDT: usize = 4;
    /// IETH.
    pub const IETH: usize = 4;
}

/// Byte offsets of the extension headers an opcode carries, from the start of the BTH, in the
/// order the headers follow each other (RETH, AtomicETH, AETH, AtomicAckETH, ImmDt, IETH).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Layout {
    /// RETH offset.
    pub reth: Option<usize>,
    /// AtomicETH offset.
    pub atomic_eth: Option<usize>,
    /// AETH offset.
    pub aeth: Option<usize>,
    /// AtomicAckETH offset.
    pub atomic_ack_eth: Option<usize>,
    /// ImmDt offset.
    pub immdt: Option<usize>,
    /// IETH offset.
    pub ieth: Option<usize>,
    /// Total header length (BTH + extension headers): where the payload starts.
    pub header_len: usize,
}

impl Layout {
    /// The layout of the headers `flags` names.
    pub const fn of(flags: OpFlags) -> Layout {
        let mut at = len::BTH;
        let mut l = Layout {
            reth: None,
            atomic_eth: None,
            aeth: None,
            atomic_ack_eth: None,
            immdt: None,
            ieth: None,
            header_len: 0,
        };
        if flags.contains(OpFlags::RETH) {
            l.reth = Some(at);
            at += len::RETH;
        }
        if flags.contains(OpFlags::ATOMIC_ETH) {
            l.atomic_eth = Some(at);
            at += len::ATOMIC_ETH;
        }
        if flags.contains(OpFlags::AETH) {
            l.aeth = Some(at);
            at += len::AETH;
        }
        if flags.contains(OpFlags::ATOMIC_ACK_ETH) {
            l.atomic_ack_eth = Some(at);
            at += len::ATOMIC_ACK_ETH;
        }
        if flags.contains(OpFlags::IMMDT) {
            l.immdt = Some(at);
            at += len::IMMDT;
        }
        if flags.contains(OpFlags::IETH) {
            l.ieth = Some(at);
            at += len::IETH;
        }
        l.header_len = at;
        l
    }
}

impl Opcode {
    /// The opcode's flags, or `None` for an unknown opcode.
    pub const fn flags(self) -> Option<OpFlags> {
        use OpFlags as F;
        use Opcode::*;
        const SEND_REQ: OpFlags = F::SEND.or(F::REQUEST).or(F::PAYLOAD);
        const WRITE_REQ: OpFlags = F::WRITE.or(F::REQUEST).or(F::PAYLOAD);
        const READ_RESP: OpFlags = F::READ.or(F::RESPONSE).or(F::PAYLOAD);
        Some(match self {
            SendFirst => SEND_REQ.or(F::START).or(F::RWR),
            SendMiddle => SEND_REQ.or(F::MIDDLE),
            SendLast => SEND_REQ.or(F::END).or(F::COMP),
            SendLastImm => SEND_REQ.or(F::END).or(F::COMP).or(F::IMMDT),
            SendOnly => SEND_REQ.or(F::START).or(F::END).or(F::RWR).or(F::COMP),
            SendOnlyImm => SEND_REQ
                .or(F::START)
                .or(F::END)
                .or(F::RWR)
                .or(F::COMP)
                .or(F::IMMDT),
            SendLastInv => SEND_REQ.or(F::END).or(F::COMP).or(F::IETH),
            SendOnlyInv => SEND_REQ
                .or(F::START)
                .or(F::END)
                .or(F::RWR)
                .or(F::COMP)
                .or(F::IETH),
            WriteFirst => WRITE_REQ.or(F::START).or(F::RETH),
            WriteMiddle => WRITE_REQ.or(F::MIDDLE),
            WriteLast => WRITE_REQ.or(F::END),
            WriteLastImm => WRITE_REQ.or(F::END).or(F::IMMDT).or(F::RWR).or(F::COMP),
            WriteOnly => WRITE_REQ.or(F::START).or(F::END).or(F::RETH),
            WriteOnlyImm => WRITE_REQ
                .or(F::START)
                .or(F::END)
                .or(F::RETH)
                .or(F::IMMDT)
                .or(F::RWR)
                .or(F::COMP),
            ReadRequest => F::READ.or(F::REQUEST).or(F::START).or(F::END).or(F::RETH),
            ReadResponseFirst => READ_RESP.or(F::START).or(F::AETH),
            ReadResponseMiddle => READ_RESP.or(F::MIDDLE),
            ReadResponseLast => READ_RESP.or(F::END).or(F::AETH),
            ReadResponseOnly => READ_RESP.or(F::START).or(F::END).or(F::AETH),
            Acknowledge => F::RESPONSE.or(F::START).or(F::END).or(F::AETH),
            AtomicAcknowledge => F::ATOMIC
                .or(F::RESPONSE)
                .or(F::START)
                .or(F::END)
                .or(F::AETH)
                .or(F::ATOMIC_ACK_ETH),
            CompareSwap | FetchAdd => F::ATOMIC
                .or(F::REQUEST)
                .or(F::START)
                .or(F::END)
                .or(F::ATOMIC_ETH),
            Unknown(_) => return None,
        })
    }

    /// Where the opcode's headers lie, or `None` for an unknown opcode.
    pub const fn layout(self) -> Option<Layout> {
        match self.flags() {
            Some(f) => Some(Layout::of(f)),
            None => None,
        }
    }

    /// BTH + extension headers, or `None` for an unknown opcode.
    pub const fn header_len(self) -> Option<usize> {
        match self.layout() {
            Some(l) => Some(l.header_len),
            None => None,
        }
    }

    /// Whether the opcode is a known one with all the flags in `f`.
    #[inline]
    pub const fn has(self, f: OpFlags) -> bool {
        match self.flags() {
            Some(mine) => mine.contains(f),
            None => false,
        }
    }

    /// Whether this is a known opcode.
    pub const fn is_known(self) -> bool {
        self.flags().is_some()
    }

    /// The name the specification gives the opcode.
    pub const fn name(self) -> &'static str {
        use Opcode::*;
        match self {
            SendFirst => "SEND_FIRST",
            SendMiddle => "SEND_MIDDLE",
            SendLast => "SEND_LAST",
            SendLastImm => "SEND_LAST_WITH_IMMEDIATE",
            SendOnly => "SEND_ONLY",
            SendOnlyImm => "SEND_ONLY_WITH_IMMEDIATE",
            WriteFirst => "RDMA_WRITE_FIRST",
            WriteMiddle => "RDMA_WRITE_MIDDLE",
            WriteLast => "RDMA_WRITE_LAST",
            WriteLastImm => "RDMA_WRITE_LAST_WITH_IMMEDIATE",
            WriteOnly => "RDMA_WRITE_ONLY",
            WriteOnlyImm => "RDMA_WRITE_ONLY_WITH_IMMEDIATE",
            ReadRequest => "RDMA_READ_REQUEST",
            ReadResponseFirst => "RDMA_READ_RESPONSE_FIRST",
            ReadResponseMiddle => "RDMA_READ_RESPONSE_MIDDLE",
            ReadResponseLast => "RDMA_READ_RESPONSE_LAST",
            ReadResponseOnly => "RDMA_READ_RESPONSE_ONLY",
            Acknowledge => "ACKNOWLEDGE",
            AtomicAcknowledge => "ATOMIC_ACKNOWLEDGE",
            CompareSwap => "COMPARE_SWAP",
            FetchAdd => "FETCH_ADD",
            SendLastInv => "SEND_LAST_WITH_INVALIDATE",
            SendOnlyInv => "SEND_ONLY_WITH_INVALIDATE",
            Unknown(_) => "UNKNOWN",
        }
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Opcode::Unknown(v) => write!(f, "UNKNOWN({v:#04x})"),
            op => f.write_str(op.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header lengths of the rxe opcode table, by raw opcode.
    const TABLE: [(u8, usize); 23] = [
        (0x00, 12),
        (0x01, 12),
        (0x02, 12),
        (0x03, 16),
        (0x04, 12),
        (0x05, 16),
        (0x06, 28),
        (0x07, 12),
        (0x08, 12),
        (0x09, 16),
        (0x0A, 28),
        (0x0B, 32),
        (0x0C, 28),
        (0x0D, 16),
        (0x0E, 12),
        (0x0F, 16),
        (0x10, 16),
        (0x11, 16),
        (0x12, 24),
        (0x13, 40),
        (0x14, 40),
        (0x16, 16),
        (0x17, 16),
    ];

    #[test]
    fn header_lengths_match_the_table() {
        for (raw, hlen) in TABLE {
            let op = Opcode::from(raw);
            assert!(op.is_known(), "{raw:#x}");
            assert_eq!(op.header_len(), Some(hlen), "{op}");
            assert_eq!(u8::from(op), raw);
        }
    }

    #[test]
    fn every_byte_round_trips_and_unknowns_stay_unknown() {
        let mut known = 0;
        for raw in 0..=255u8 {
            let op = Opcode::from(raw);
            assert_eq!(u8::from(op), raw);
            if op.is_known() {
                known += 1;
                assert!(raw < 0x20, "only RC opcodes are known");
            } else {
                assert_eq!(op.header_len(), None);
                assert!(!op.has(OpFlags::REQUEST));
            }
        }
        assert_eq!(known, TABLE.len());
        for raw in [0x15u8, 0x18, 0x1C, 0x1D, 0x24, 0x64, 0x81] {
            assert_eq!(Opcode::from(raw), Opcode::Unknown(raw));
        }
    }

    #[test]
    fn receive_consumption_and_completion_flags() {
        use Opcode::*;
        let rwr: Vec<Opcode> = (0..=0x17u8)
            .map(Opcode::from)
            .filter(|o| o.has(OpFlags::RWR))
            .collect();
        assert_eq!(
            rwr,
            [
                SendFirst,
                SendOnly,
                SendOnlyImm,
                WriteLastImm,
                WriteOnlyImm,
                SendOnlyInv
            ]
        );
        let comp: Vec<Opcode> = (0..=0x17u8)
            .map(Opcode::from)
            .filter(|o| o.has(OpFlags::COMP))
            .collect();
        assert_eq!(
            comp,
            [
                SendLast,
                SendLastImm,
                SendOnly,
                SendOnlyImm,
                WriteLastImm,
                WriteOnlyImm,
                SendLastInv,
                SendOnlyInv
            ]
        );
        for raw in 0..=0x17u8 {
            let op = Opcode::from(raw);
            if let Some(f) = op.flags() {
                assert!(
                    f.contains(OpFlags::REQUEST) != f.contains(OpFlags::RESPONSE),
                    "{op} is exactly one of request/response"
                );
                let pos = [OpFlags::START, OpFlags::MIDDLE, OpFlags::END]
                    .iter()
                    .filter(|p| f.contains(**p))
                    .count();
                assert!(pos >= 1, "{op} has a position");
                assert!(!(f.contains(OpFlags::MIDDLE) && pos > 1));
            }
        }
        assert_eq!(WriteOnlyImm.layout().unwrap().immdt, Some(28));
        assert_eq!(AtomicAcknowledge.layout().unwrap().atomic_ack_eth, Some(16));
        assert_eq!(format!("{}", Opcode::Unknown(0x64)), "UNKNOWN(0x64)");
        assert_eq!(format!("{}", ReadRequest), "RDMA_READ_REQUEST");
    }
}
