//! Atomic Extended Transport Header (28 bytes): target, key and operands of COMPARE_SWAP and
//! FETCH_ADD.
//!
//! For FETCH_ADD the compare field is unused: rxe leaves it uninitialised, so receivers ignore it
//! and senders write 0.

use super::be;

mod field {
    use super::super::field::Field;
    pub const VA: Field = 0..8;
    pub const RKEY: Field = 8..12;
    pub const SWAP_ADD: Field = 12..20;
    pub const COMPARE: Field = 20..28;
}

/// Length of an AtomicETH.
pub const HEADER_LEN: usize = field::COMPARE.end;

fixed_view!("an AtomicETH");

impl<T: AsRef<[u8]>> Packet<T> {
    /// Virtual address of the 8-byte target.
    #[inline]
    pub fn va(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), field::VA.start)
    }

    /// R_Key.
    #[inline]
    pub fn rkey(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), field::RKEY.start)
    }

    /// Swap value (COMPARE_SWAP) or addend (FETCH_ADD).
    #[inline]
    pub fn swap_add(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), field::SWAP_ADD.start)
    }

    /// Compare value (COMPARE_SWAP only).
    #[inline]
    pub fn compare(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), field::COMPARE.start)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets the virtual address.
    #[inline]
    pub fn set_va(&mut self, va: u64) {
        be::put_u64(self.buffer.as_mut(), field::VA.start, va);
    }

    /// Sets R_Key.
    #[inline]
    pub fn set_rkey(&mut self, rkey: u32) {
        be::put_u32(self.buffer.as_mut(), field::RKEY.start, rkey);
    }

    /// Sets the swap value / addend.
    #[inline]
    pub fn set_swap_add(&mut self, v: u64) {
        be::put_u64(self.buffer.as_mut(), field::SWAP_ADD.start, v);
    }

    /// Sets the compare value.
    #[inline]
    pub fn set_compare(&mut self, v: u64) {
        be::put_u64(self.buffer.as_mut(), field::COMPARE.start, v);
    }
}

/// A parsed AtomicETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Repr {
    /// Virtual address of the 8-byte target.
    pub va: u64,
    /// R_Key.
    pub rkey: u32,
    /// Swap value (COMPARE_SWAP) or addend (FETCH_ADD).
    pub swap_add: u64,
    /// Compare value (COMPARE_SWAP; 0 for FETCH_ADD).
    pub compare: u64,
}

impl Repr {
    /// Reads an AtomicETH.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Packet<&T>) -> Repr {
        Repr {
            va: packet.va(),
            rkey: packet.rkey(),
            swap_add: packet.swap_add(),
            compare: packet.compare(),
        }
    }

    /// Bytes [`Repr::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the AtomicETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(&self, packet: &mut Packet<&mut T>) {
        packet.set_va(self.va);
        packet.set_rkey(self.rkey);
        packet.set_swap_add(self.swap_add);
        packet.set_compare(self.compare);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soft::wire::{PacketError, hex};

    #[test]
    fn round_trip() {
        let bytes = hex(
            "00 00 7f 00 00 00 20 08  00 00 31 00  00 00 00 00 00 00 00 02  \
             ff ff ff ff ff ff ff fe",
        );
        let r = Repr::parse(&Packet::new_checked(&bytes[..]).unwrap());
        assert_eq!(
            r,
            Repr {
                va: 0x7f00_0000_2008,
                rkey: 0x3100,
                swap_add: 2,
                compare: u64::MAX - 1
            }
        );
        let mut out = [0u8; HEADER_LEN];
        r.emit(&mut Packet::new_unchecked(&mut out[..]));
        assert_eq!(&out[..], &bytes[..]);
        assert_eq!(
            Packet::new_checked(&bytes[..27]).unwrap_err(),
            PacketError::Truncated
        );
    }
}
