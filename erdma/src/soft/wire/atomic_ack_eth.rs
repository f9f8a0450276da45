//! Atomic Acknowledge Extended Transport Header (8 bytes): the value the target held before an
//! atomic ran.

use super::be;

mod field {
    use super::super::field::Field;
    pub const ORIG: Field = 0..8;
}

/// Length of an AtomicAckETH.
pub const HEADER_LEN: usize = field::ORIG.end;

fixed_view!("an AtomicAckETH");

impl<T: AsRef<[u8]>> Packet<T> {
    /// The original remote value.
    #[inline]
    pub fn orig(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), field::ORIG.start)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets the original remote value.
    #[inline]
    pub fn set_orig(&mut self, v: u64) {
        be::put_u64(self.buffer.as_mut(), field::ORIG.start, v);
    }
}

/// A parsed AtomicAckETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Repr {
    /// The original remote value.
    pub orig: u64,
}

impl Repr {
    /// Reads an AtomicAckETH.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Packet<&T>) -> Repr {
        Repr {
            orig: packet.orig(),
        }
    }

    /// Bytes [`Repr::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the AtomicAckETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(&self, packet: &mut Packet<&mut T>) {
        packet.set_orig(self.orig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soft::wire::PacketError;

    #[test]
    fn round_trip() {
        let bytes = [1, 2, 3, 4, 5, 6, 7, 8];
        let r = Repr::parse(&Packet::new_checked(&bytes[..]).unwrap());
        assert_eq!(r.orig, 0x0102_0304_0506_0708);
        let mut out = [0u8; 8];
        r.emit(&mut Packet::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
        assert_eq!(
            Packet::new_checked(&bytes[..7]).unwrap_err(),
            PacketError::Truncated
        );
    }
}
