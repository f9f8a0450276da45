//! Invalidate Extended Transport Header (4 bytes): the R_Key a SEND_WITH_INVALIDATE revokes.

use super::be;

mod field {
    use super::super::field::Field;
    pub const RKEY: Field = 0..4;
}

/// Length of an IETH.
pub const HEADER_LEN: usize = field::RKEY.end;

fixed_view!("an IETH");

impl<T: AsRef<[u8]>> Packet<T> {
    /// The R_Key to invalidate.
    #[inline]
    pub fn rkey(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), field::RKEY.start)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets the R_Key to invalidate.
    #[inline]
    pub fn set_rkey(&mut self, rkey: u32) {
        be::put_u32(self.buffer.as_mut(), field::RKEY.start, rkey);
    }
}

/// A parsed IETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Repr {
    /// The R_Key to invalidate.
    pub rkey: u32,
}

impl Repr {
    /// Reads an IETH.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Packet<&T>) -> Repr {
        Repr {
            rkey: packet.rkey(),
        }
    }

    /// Bytes [`Repr::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the IETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(&self, packet: &mut Packet<&mut T>) {
        packet.set_rkey(self.rkey);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soft::wire::PacketError;

    #[test]
    fn round_trip() {
        let bytes = [0x00, 0x01, 0x23, 0x00];
        let r = Repr::parse(&Packet::new_checked(&bytes[..]).unwrap());
        assert_eq!(r.rkey, 0x0001_2300);
        let mut out = [0xFFu8; 4];
        r.emit(&mut Packet::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert_eq!(
            Packet::new_checked(&[][..]).unwrap_err(),
            PacketError::Truncated
        );
    }
}
