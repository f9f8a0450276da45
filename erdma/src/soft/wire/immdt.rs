//! Immediate Data Extended Transport Header (4 bytes).
//!
//! The value is the big-endian reading of the four wire bytes; verbs keep the same four bytes.

use super::be;

mod field {
    use super::super::field::Field;
    pub const IMM: Field = 0..4;
}

/// Length of an ImmDt.
pub const HEADER_LEN: usize = field::IMM.end;

fixed_view!("an ImmDt");

impl<T: AsRef<[u8]>> Packet<T> {
    /// The immediate data.
    #[inline]
    pub fn imm(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), field::IMM.start)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets the immediate data.
    #[inline]
    pub fn set_imm(&mut self, imm: u32) {
        be::put_u32(self.buffer.as_mut(), field::IMM.start, imm);
    }
}

/// A parsed ImmDt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Repr {
    /// The immediate data (big-endian value of the wire bytes).
    pub imm: u32,
}

impl Repr {
    /// Reads an ImmDt.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Packet<&T>) -> Repr {
        Repr { imm: packet.imm() }
    }

    /// Bytes [`Repr::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the ImmDt.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(&self, packet: &mut Packet<&mut T>) {
        packet.set_imm(self.imm);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soft::wire::PacketError;

    #[test]
    fn big_endian_round_trip() {
        let bytes = [0xDE, 0xAD, 0xBE, 0xEF];
        let r = Repr::parse(&Packet::new_checked(&bytes[..]).unwrap());
        assert_eq!(r.imm, 0xDEAD_BEEF);
        let mut out = [0u8; 4];
        r.emit(&mut Packet::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert_eq!(
            Packet::new_checked(&bytes[..3]).unwrap_err(),
            PacketError::Truncated
        );
    }
}
