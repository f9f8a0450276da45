//! ACK Extended Transport Header (4 bytes): syndrome and MSN of ACKs, NAKs and read responses.

use core::time::Duration;

use super::be;

mod field {
    use super::super::field::Field;
    pub const SYNDROME: usize = 0;
    pub const MSN: Field = 1..4;
}

/// Length of an AETH.
pub const HEADER_LEN: usize = field::MSN.end;

/// The syndrome type bits (7–5).
const TYPE_MASK: u8 = 0xE0;
const TYPE_ACK: u8 = 0x00;
const TYPE_RNR_NAK: u8 = 0x20;
const TYPE_NAK: u8 = 0x60;
const VALUE_MASK: u8 = 0x1F;

/// The credit value meaning "no credit information"; rxe puts it in every ACK.
pub const CREDIT_UNLIMITED: u8 = 0x1F;

/// The NAK code carried in a NAK syndrome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NakCode {
    /// 0: PSN sequence error (the responder expected another PSN).
    PsnSequenceError,
    /// 1: invalid request.
    InvalidRequest,
    /// 2: remote access error (rkey, bounds, rights).
    RemoteAccessError,
    /// 3: remote operational error.
    RemoteOperationalError,
    /// 4: invalid RD request (never sent on RC).
    InvalidRdRequest,
    /// Any other 5-bit value.
    Unknown(u8),
}

impl From<u8> for NakCode {
    fn from(v: u8) -> NakCode {
        match v & VALUE_MASK {
            0 => NakCode::PsnSequenceError,
            1 => NakCode::InvalidRequest,
            2 => NakCode::RemoteAccessError,
            3 => NakCode::RemoteOperationalError,
            4 => NakCode::InvalidRdRequest,
            other => NakCode::Unknown(other),
        }
    }
}

impl From<NakCode> for u8 {
    fn from(c: NakCode) -> u8 {
        match c {
            NakCode::PsnSequenceError => 0,
            NakCode::InvalidRequest => 1,
            NakCode::RemoteAccessError => 2,
            NakCode::RemoteOperationalError => 3,
            NakCode::InvalidRdRequest => 4,
            NakCode::Unknown(v) => v & VALUE_MASK,
        }
    }
}

/// A decoded AETH syndrome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Syndrome {
    /// Positive acknowledgement with a credit count (rxe always sends [`CREDIT_UNLIMITED`]).
    Ack {
        /// 5-bit credit count.
        credit: u8,
    },
    /// Receiver not ready: no receive WQE; retry after the encoded time.
    RnrNak {
        /// 5-bit RNR timer code (see [`rnr_timer`]).
        timer: u8,
    },
    /// Negative acknowledgement.
    Nak(NakCode),
    /// A reserved syndrome type (the raw byte).
    Reserved(u8),
}

impl Syndrome {
    /// The positive ACK rxe sends.
    pub const ACK: Syndrome = Syndrome::Ack {
        credit: CREDIT_UNLIMITED,
    };

    /// Whether this is a positive ACK.
    pub const fn is_ack(self) -> bool {
        matches!(self, Syndrome::Ack { .. })
    }
}

impl From<u8> for Syndrome {
    fn from(b: u8) -> Syndrome {
        match b & TYPE_MASK {
            TYPE_ACK => Syndrome::Ack {
                credit: b & VALUE_MASK,
            },
            TYPE_RNR_NAK => Syndrome::RnrNak {
                timer: b & VALUE_MASK,
            },
            TYPE_NAK => Syndrome::Nak(NakCode::from(b & VALUE_MASK)),
            _ => Syndrome::Reserved(b),
        }
    }
}

impl From<Syndrome> for u8 {
    fn from(s: Syndrome) -> u8 {
        match s {
            Syndrome::Ack { credit } => TYPE_ACK | (credit & VALUE_MASK),
            Syndrome::RnrNak { timer } => TYPE_RNR_NAK | (timer & VALUE_MASK),
            Syndrome::Nak(code) => TYPE_NAK | u8::from(code),
            Syndrome::Reserved(b) => b,
        }
    }
}

/// RNR NAK timer codes in microseconds, as rxe waits them (code 25 keeps rxe's 61410).
const RNR_USECS: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
    5120, 7680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_410, 81_920, 122_880, 163_840, 245_760,
    327_680, 491_520,
];

/// How long a requester waits after an RNR NAK with timer `code` (the low 5 bits are used).
pub const fn rnr_timer(code: u8) -> Duration {
    Duration::from_micros(RNR_USECS[(code & VALUE_MASK) as usize] as u64)
}

fixed_view!("an AETH");

impl<T: AsRef<[u8]>> Packet<T> {
    /// The raw syndrome byte.
    #[inline]
    pub fn syndrome_raw(&self) -> u8 {
        self.buffer.as_ref()[field::SYNDROME]
    }

    /// The decoded syndrome.
    #[inline]
    pub fn syndrome(&self) -> Syndrome {
        Syndrome::from(self.syndrome_raw())
    }

    /// MSN (24 bits).
    #[inline]
    pub fn msn(&self) -> u32 {
        be::u24_at(self.buffer.as_ref(), field::MSN.start)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets the syndrome.
    #[inline]
    pub fn set_syndrome(&mut self, s: Syndrome) {
        self.buffer.as_mut()[field::SYNDROME] = s.into();
    }

    /// Sets MSN (the low 24 bits of `msn`).
    #[inline]
    pub fn set_msn(&mut self, msn: u32) {
        be::put_u24(self.buffer.as_mut(), field::MSN.start, msn & 0x00FF_FFFF);
    }
}

/// A parsed AETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// The syndrome.
    pub syndrome: Syndrome,
    /// Message sequence number (24 bits).
    pub msn: u32,
}

impl Repr {
    /// Reads an AETH.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Packet<&T>) -> Repr {
        Repr {
            syndrome: packet.syndrome(),
            msn: packet.msn(),
        }
    }

    /// Bytes [`Repr::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the AETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(&self, packet: &mut Packet<&mut T>) {
        packet.set_syndrome(self.syndrome);
        packet.set_msn(self.msn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soft::wire::PacketError;

    #[test]
    fn vector_c_aeth() {
        // The AETH of reference vector C: ACK, credit 0x1F, MSN 1.
        let bytes = [0x1f, 0x00, 0x00, 0x01];
        let r = Repr::parse(&Packet::new_checked(&bytes[..]).unwrap());
        assert_eq!(
            r,
            Repr {
                syndrome: Syndrome::ACK,
                msn: 1
            }
        );
        let mut out = [0u8; 4];
        r.emit(&mut Packet::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert_eq!(
            Packet::new_checked(&bytes[..3]).unwrap_err(),
            PacketError::Truncated
        );
    }

    #[test]
    fn rxe_syndromes_decode() {
        assert_eq!(Syndrome::from(0x1F), Syndrome::ACK);
        assert_eq!(Syndrome::from(0x2C), Syndrome::RnrNak { timer: 12 });
        assert_eq!(
            Syndrome::from(0x60),
            Syndrome::Nak(NakCode::PsnSequenceError)
        );
        assert_eq!(Syndrome::from(0x61), Syndrome::Nak(NakCode::InvalidRequest));
        assert_eq!(
            Syndrome::from(0x62),
            Syndrome::Nak(NakCode::RemoteAccessError)
        );
        assert_eq!(
            Syndrome::from(0x63),
            Syndrome::Nak(NakCode::RemoteOperationalError)
        );
        assert_eq!(
            Syndrome::from(0x64),
            Syndrome::Nak(NakCode::InvalidRdRequest)
        );
        assert_eq!(Syndrome::from(0x7E), Syndrome::Nak(NakCode::Unknown(0x1E)));
        assert_eq!(Syndrome::from(0x40), Syndrome::Reserved(0x40));
        assert_eq!(Syndrome::from(0x9F), Syndrome::Reserved(0x9F));
    }

    #[test]
    fn every_syndrome_byte_round_trips() {
        for b in 0..=255u8 {
            assert_eq!(u8::from(Syndrome::from(b)), b, "{b:#x}");
        }
    }

    #[test]
    fn rnr_table() {
        assert_eq!(rnr_timer(0), Duration::from_micros(655_360));
        assert_eq!(rnr_timer(1), Duration::from_micros(10));
        assert_eq!(rnr_timer(12), Duration::from_micros(640));
        assert_eq!(rnr_timer(25), Duration::from_micros(61_410));
        assert_eq!(rnr_timer(31), Duration::from_micros(491_520));
        assert_eq!(
            rnr_timer(0x20 | 12),
            rnr_timer(12),
            "only the low 5 bits count"
        );
    }
}
