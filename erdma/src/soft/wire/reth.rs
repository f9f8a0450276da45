//! RDMA Extended Transport Header (16 bytes): the remote buffer of a WRITE or READ.

use super::be;

mod field {
    use super::super::field::Field;
    pub const VA: Field = 0..8;
    pub const RKEY: Field = 8..12;
    pub const DMA_LEN: Field = 12..16;
}

/// Length of a RETH.
pub const HEADER_LEN: usize = field::DMA_LEN.end;

fixed_view!("a RETH");

impl<T: AsRef<[u8]>> Packet<T> {
    /// Virtual address.
    #[inline]
    pub fn va(&self) -> u64 {
        be::u64_at(self.buffer.as_ref(), field::VA.start)
    }

    /// R_Key.
    #[inline]
    pub fn rkey(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), field::RKEY.start)
    }

    /// DMA length: the bytes of the (remaining) operation.
    #[inline]
    pub fn dma_len(&self) -> u32 {
        be::u32_at(self.buffer.as_ref(), field::DMA_LEN.start)
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

    /// Sets the DMA length.
    #[inline]
    pub fn set_dma_len(&mut self, len: u32) {
        be::put_u32(self.buffer.as_mut(), field::DMA_LEN.start, len);
    }
}

/// A parsed RETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Repr {
    /// Virtual address at the responder.
    pub va: u64,
    /// R_Key granting access to it.
    pub rkey: u32,
    /// Bytes of the (remaining) operation.
    pub dma_len: u32,
}

impl Repr {
    /// Reads a RETH.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Packet<&T>) -> Repr {
        Repr {
            va: packet.va(),
            rkey: packet.rkey(),
            dma_len: packet.dma_len(),
        }
    }

    /// Bytes [`Repr::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the RETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(&self, packet: &mut Packet<&mut T>) {
        packet.set_va(self.va);
        packet.set_rkey(self.rkey);
        packet.set_dma_len(self.dma_len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soft::wire::{PacketError, hex};

    // The RETH of reference vector D.
    const VECTOR_D_RETH: &str = "00 00 7f 00 00 00 10 00 00 00 12 34 00 00 00 08";

    #[test]
    fn parses_and_emits_vector_d() {
        let bytes = hex(VECTOR_D_RETH);
        let r = Repr::parse(&Packet::new_checked(&bytes[..]).unwrap());
        assert_eq!(
            r,
            Repr {
                va: 0x0000_7f00_0000_1000,
                rkey: 0x1234,
                dma_len: 8
            }
        );
        let mut out = [0u8; HEADER_LEN];
        r.emit(&mut Packet::new_unchecked(&mut out[..]));
        assert_eq!(&out[..], &bytes[..]);
        assert_eq!(
            Packet::new_checked(&bytes[..15]).unwrap_err(),
            PacketError::Truncated
        );
    }
}
