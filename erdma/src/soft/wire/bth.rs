//! Base Transport Header (12 bytes, first in every RoCEv2 datagram).

use super::opcode::Opcode;
use super::psn::Psn;
use super::{PacketError, PacketResult, be};

mod field {
    use super::super::field::Field;
    pub const OPCODE: usize = 0;
    /// SE (bit 7), MigReq (bit 6), PadCnt (bits 5–4), TVer (bits 3–0).
    pub const FLAGS: usize = 1;
    pub const PKEY: Field = 2..4;
    /// FECN (bit 7), BECN (bit 6), reserved (bits 5–0).
    pub const RESV8A: usize = 4;
    pub const DEST_QPN: Field = 5..8;
    /// AckReq (bit 7), reserved (bits 6–0; bit 6 marks a same-host reference payload
    /// between soft devices, see `peer_ref`).
    pub const ACK_REQ: usize = 8;
    pub const PSN: Field = 9..12;
}

/// Length of a BTH.
pub const HEADER_LEN: usize = field::PSN.end;

const SE: u8 = 0x80;
const MIG: u8 = 0x40;
const PAD_SHIFT: u8 = 4;
const PAD: u8 = 0x30;
const TVER: u8 = 0x0F;
const FECN: u8 = 0x80;
const BECN: u8 = 0x40;
const ACK_REQ: u8 = 0x80;
/// A reserved bit rxe never sets: the payload is a [`super::peer_ref`] list, not bytes.
const PEER_REF: u8 = 0x40;

fixed_view!("a BTH");

impl<T: AsRef<[u8]>> Packet<T> {
    /// OpCode.
    #[inline]
    pub fn opcode(&self) -> Opcode {
        Opcode::from(self.buffer.as_ref()[field::OPCODE])
    }

    /// SE: the solicited-event bit.
    #[inline]
    pub fn solicited(&self) -> bool {
        self.buffer.as_ref()[field::FLAGS] & SE != 0
    }

    /// M: the migration-request bit.
    #[inline]
    pub fn mig_req(&self) -> bool {
        self.buffer.as_ref()[field::FLAGS] & MIG != 0
    }

    /// PadCnt: pad bytes after the payload (0–3).
    #[inline]
    pub fn pad_count(&self) -> u8 {
        (self.buffer.as_ref()[field::FLAGS] & PAD) >> PAD_SHIFT
    }

    /// TVer: transport header version (must be 0).
    #[inline]
    pub fn tver(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS] & TVER
    }

    /// P_Key.
    #[inline]
    pub fn pkey(&self) -> u16 {
        be::u16_at(self.buffer.as_ref(), field::PKEY.start)
    }

    /// FECN.
    #[inline]
    pub fn fecn(&self) -> bool {
        self.buffer.as_ref()[field::RESV8A] & FECN != 0
    }

    /// BECN.
    #[inline]
    pub fn becn(&self) -> bool {
        self.buffer.as_ref()[field::RESV8A] & BECN != 0
    }

    /// DestQP (24 bits).
    #[inline]
    pub fn dest_qpn(&self) -> u32 {
        be::u24_at(self.buffer.as_ref(), field::DEST_QPN.start)
    }

    /// AckReq.
    #[inline]
    pub fn ack_req(&self) -> bool {
        self.buffer.as_ref()[field::ACK_REQ] & ACK_REQ != 0
    }

    /// Whether the payload is a same-host reference list ([`super::peer_ref`]) instead of
    /// bytes (a reserved bit among rdma-core's and rxe's; only soft devices that agreed on it
    /// set it).
    #[inline]
    pub fn peer_ref(&self) -> bool {
        self.buffer.as_ref()[field::ACK_REQ] & PEER_REF != 0
    }

    /// PSN.
    #[inline]
    pub fn psn(&self) -> Psn {
        Psn::new(be::u24_at(self.buffer.as_ref(), field::PSN.start))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets OpCode.
    #[inline]
    pub fn set_opcode(&mut self, op: Opcode) {
        self.buffer.as_mut()[field::OPCODE] = op.into();
    }

    fn set_flag_bits(&mut self, at: usize, mask: u8, on: bool) {
        let b = &mut self.buffer.as_mut()[at];
        if on {
            *b |= mask;
        } else {
            *b &= !mask;
        }
    }

    /// Sets SE.
    #[inline]
    pub fn set_solicited(&mut self, on: bool) {
        self.set_flag_bits(field::FLAGS, SE, on);
    }

    /// Sets M.
    #[inline]
    pub fn set_mig_req(&mut self, on: bool) {
        self.set_flag_bits(field::FLAGS, MIG, on);
    }

    /// Sets PadCnt (the low two bits of `pad`).
    #[inline]
    pub fn set_pad_count(&mut self, pad: u8) {
        let b = &mut self.buffer.as_mut()[field::FLAGS];
        *b = (*b & !PAD) | ((pad << PAD_SHIFT) & PAD);
    }

    /// Sets TVer (the low four bits of `v`).
    #[inline]
    pub fn set_tver(&mut self, v: u8) {
        let b = &mut self.buffer.as_mut()[field::FLAGS];
        *b = (*b & !TVER) | (v & TVER);
    }

    /// Sets P_Key.
    #[inline]
    pub fn set_pkey(&mut self, pkey: u16) {
        be::put_u16(self.buffer.as_mut(), field::PKEY.start, pkey);
    }

    /// Sets FECN.
    #[inline]
    pub fn set_fecn(&mut self, on: bool) {
        self.set_flag_bits(field::RESV8A, FECN, on);
    }

    /// Sets BECN.
    #[inline]
    pub fn set_becn(&mut self, on: bool) {
        self.set_flag_bits(field::RESV8A, BECN, on);
    }

    /// Sets DestQP (the low 24 bits of `qpn`).
    #[inline]
    pub fn set_dest_qpn(&mut self, qpn: u32) {
        be::put_u24(
            self.buffer.as_mut(),
            field::DEST_QPN.start,
            qpn & 0x00FF_FFFF,
        );
    }

    /// Sets AckReq.
    #[inline]
    pub fn set_ack_req(&mut self, on: bool) {
        self.set_flag_bits(field::ACK_REQ, ACK_REQ, on);
    }

    /// Marks the payload a same-host reference list ([`Packet::peer_ref`]).
    #[inline]
    pub fn set_peer_ref(&mut self, on: bool) {
        self.set_flag_bits(field::ACK_REQ, PEER_REF, on);
    }

    /// Sets PSN.
    #[inline]
    pub fn set_psn(&mut self, psn: Psn) {
        be::put_u24(self.buffer.as_mut(), field::PSN.start, psn.value());
    }
}

/// A parsed BTH.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// OpCode.
    pub opcode: Opcode,
    /// SE.
    pub solicited: bool,
    /// M.
    pub mig_req: bool,
    /// PadCnt (0–3).
    pub pad_count: u8,
    /// P_Key.
    pub pkey: u16,
    /// FECN.
    pub fecn: bool,
    /// BECN.
    pub becn: bool,
    /// DestQP (24 bits).
    pub dest_qpn: u32,
    /// AckReq.
    pub ack_req: bool,
    /// PSN.
    pub psn: Psn,
}

impl Repr {
    /// Reads a BTH.
    ///
    /// # Errors
    /// [`PacketError::BadVersion`] when TVer is not 0.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(packet: &Packet<&T>) -> PacketResult<Repr> {
        if packet.tver() != 0 {
            return Err(PacketError::BadVersion(packet.tver()));
        }
        Ok(Repr {
            opcode: packet.opcode(),
            solicited: packet.solicited(),
            mig_req: packet.mig_req(),
            pad_count: packet.pad_count(),
            pkey: packet.pkey(),
            fecn: packet.fecn(),
            becn: packet.becn(),
            dest_qpn: packet.dest_qpn(),
            ack_req: packet.ack_req(),
            psn: packet.psn(),
        })
    }

    /// Bytes [`Repr::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the BTH (TVer 0, reserved bits 0).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]> + ?Sized>(&self, packet: &mut Packet<&mut T>) {
        let b = packet.buffer.as_mut();
        b[..HEADER_LEN].fill(0);
        packet.set_opcode(self.opcode);
        packet.set_solicited(self.solicited);
        packet.set_mig_req(self.mig_req);
        packet.set_pad_count(self.pad_count);
        packet.set_tver(0);
        packet.set_pkey(self.pkey);
        packet.set_fecn(self.fecn);
        packet.set_becn(self.becn);
        packet.set_dest_qpn(self.dest_qpn);
        packet.set_ack_req(self.ack_req);
        packet.set_psn(self.psn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soft::wire::hex;

    // The BTH of reference vector B: SEND_ONLY, pad 3, P_Key 0xFFFF, DestQP 0x11, AckReq,
    // PSN 0x123456.
    const VECTOR_B_BTH: &str = "04 30 ff ff 00 00 00 11 80 12 34 56";

    #[test]
    fn parses_vector_b() {
        let bytes = hex(VECTOR_B_BTH);
        let p = Packet::new_checked(&bytes[..]).unwrap();
        let r = Repr::parse(&p).unwrap();
        assert_eq!(
            r,
            Repr {
                opcode: Opcode::SendOnly,
                solicited: false,
                mig_req: false,
                pad_count: 3,
                pkey: 0xFFFF,
                fecn: false,
                becn: false,
                dest_qpn: 0x11,
                ack_req: true,
                psn: Psn::new(0x12_3456),
            }
        );
    }

    #[test]
    fn emits_vector_b_and_round_trips() {
        let bytes = hex(VECTOR_B_BTH);
        let r = Repr::parse(&Packet::new_checked(&bytes[..]).unwrap()).unwrap();
        let mut out = [0xAAu8; HEADER_LEN];
        r.emit(&mut Packet::new_unchecked(&mut out[..]));
        assert_eq!(&out[..], &bytes[..]);

        let all = Repr {
            opcode: Opcode::WriteLastImm,
            solicited: true,
            mig_req: true,
            pad_count: 2,
            pkey: 0x7FFF,
            fecn: true,
            becn: true,
            dest_qpn: 0xAB_CDEF,
            ack_req: true,
            psn: Psn::new(0xFF_FFFF),
        };
        let mut out = [0u8; HEADER_LEN];
        all.emit(&mut Packet::new_unchecked(&mut out[..]));
        assert_eq!(
            out,
            [
                0x09, 0xE0, 0x7F, 0xFF, 0xC0, 0xAB, 0xCD, 0xEF, 0x80, 0xFF, 0xFF, 0xFF
            ]
        );
        assert_eq!(
            Repr::parse(&Packet::new_checked(&out[..]).unwrap()).unwrap(),
            all
        );
    }

    #[test]
    fn rejects_short_buffers_and_other_versions() {
        assert_eq!(
            Packet::new_checked(&[0u8; 11][..]).unwrap_err(),
            PacketError::Truncated
        );
        let mut bytes = hex(VECTOR_B_BTH);
        bytes[1] |= 0x01;
        let p = Packet::new_checked(&bytes[..]).unwrap();
        assert_eq!(Repr::parse(&p), Err(PacketError::BadVersion(1)));
    }
}
