//! A whole RoCEv2 datagram (the UDP payload: BTH, extension headers, payload, pad, ICRC):
//! [`PacketView`] parses one with every length checked, [`Headers`] + [`PacketWriter`] build one
//! in a caller's buffer.

use super::icrc::{self, ChecksumCapabilities, IcrcHeaders};
use super::opcode::{Layout, OpFlags, Opcode};
use super::psn::Psn;
use super::{ICRC_LEN, PacketError, PacketResult};
use super::{aeth, atomic_ack_eth, atomic_eth, bth, ieth, immdt, reth};

/// A checked view of a received datagram.
///
/// Construction checks that the buffer holds the BTH, every extension header the opcode names,
/// the pad the BTH announces and the ICRC, so every accessor is infallible.
#[derive(Debug, Clone, Copy)]
pub struct PacketView<'a> {
    buf: &'a [u8],
    opcode: Opcode,
    flags: OpFlags,
    layout: Layout,
    pad: u8,
}

impl<'a> PacketView<'a> {
    /// Parses a UDP payload.
    ///
    /// Checks only structure (lengths and a known RC opcode); TVer, P_Key and the ICRC are the
    /// receiver's checks.
    ///
    /// # Errors
    /// - [`PacketError::Truncated`]: shorter than its headers plus the ICRC;
    /// - [`PacketError::UnknownOpcode`]: not an RC opcode in the table;
    /// - [`PacketError::Malformed`]: the pad is longer than the bytes after the headers, or an opcode
    ///   without payload carries bytes after its headers.
    pub fn new_checked(buf: &'a [u8]) -> PacketResult<PacketView<'a>> {
        let b = bth::Packet::new_checked(buf)?;
        let opcode = b.opcode();
        let flags = opcode
            .flags()
            .ok_or(PacketError::UnknownOpcode(opcode.into()))?;
        let layout = Layout::of(flags);
        let body = buf
            .len()
            .checked_sub(layout.header_len + ICRC_LEN)
            .ok_or(PacketError::Truncated)?;
        let pad = b.pad_count();
        if usize::from(pad) > body || (!flags.contains(OpFlags::PAYLOAD) && body != 0) {
            return Err(PacketError::Malformed);
        }
        Ok(PacketView {
            buf,
            opcode,
            flags,
            layout,
            pad,
        })
    }

    /// The whole datagram.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.buf
    }

    /// Length of the datagram (BTH through ICRC).
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Always `false` (a view holds at least a BTH and an ICRC).
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The opcode (always a known one).
    pub fn opcode(&self) -> Opcode {
        self.opcode
    }

    /// The opcode's flags.
    pub fn flags(&self) -> OpFlags {
        self.flags
    }

    /// Whether the opcode has all the flags in `f`.
    pub fn has(&self, f: OpFlags) -> bool {
        self.flags.contains(f)
    }

    /// The BTH view.
    pub fn bth(&self) -> bth::Packet<&'a [u8]> {
        bth::Packet::new_unchecked(self.buf)
    }

    /// The parsed BTH.
    ///
    /// # Errors
    /// [`PacketError::BadVersion`] when TVer is not 0.
    pub fn bth_repr(&self) -> PacketResult<bth::Repr> {
        bth::Repr::parse(&self.bth())
    }

    /// BTH.PSN.
    pub fn psn(&self) -> Psn {
        self.bth().psn()
    }

    /// BTH.DestQP.
    pub fn dest_qpn(&self) -> u32 {
        self.bth().dest_qpn()
    }

    /// BTH.AckReq.
    pub fn ack_req(&self) -> bool {
        self.bth().ack_req()
    }

    /// BTH.SE.
    pub fn solicited(&self) -> bool {
        self.bth().solicited()
    }

    /// BTH.P_Key.
    pub fn pkey(&self) -> u16 {
        self.bth().pkey()
    }

    /// BTH.TVer.
    pub fn tver(&self) -> u8 {
        self.bth().tver()
    }

    /// BTH.PadCnt.
    pub fn pad_count(&self) -> u8 {
        self.pad
    }

    fn ext(&self, at: Option<usize>) -> Option<&'a [u8]> {
        at.map(|at| &self.buf[at..])
    }

    /// The RETH, if the opcode carries one.
    pub fn reth(&self) -> Option<reth::Repr> {
        self.ext(self.layout.reth)
            .map(|b| reth::Repr::parse(&reth::Packet::new_unchecked(b)))
    }

    /// The AtomicETH, if the opcode carries one.
    pub fn atomic_eth(&self) -> Option<atomic_eth::Repr> {
        self.ext(self.layout.atomic_eth)
            .map(|b| atomic_eth::Repr::parse(&atomic_eth::Packet::new_unchecked(b)))
    }

    /// The AETH, if the opcode carries one.
    pub fn aeth(&self) -> Option<aeth::Repr> {
        self.ext(self.layout.aeth)
            .map(|b| aeth::Repr::parse(&aeth::Packet::new_unchecked(b)))
    }

    /// The AtomicAckETH's original value, if the opcode carries one.
    pub fn atomic_ack_eth(&self) -> Option<u64> {
        self.ext(self.layout.atomic_ack_eth)
            .map(|b| atomic_ack_eth::Packet::new_unchecked(b).orig())
    }

    /// The immediate data (big-endian value of the wire bytes), if the opcode carries one.
    pub fn immdt(&self) -> Option<u32> {
        self.ext(self.layout.immdt)
            .map(|b| immdt::Packet::new_unchecked(b).imm())
    }

    /// The R_Key to invalidate, if the opcode carries an IETH.
    pub fn ieth(&self) -> Option<u32> {
        self.ext(self.layout.ieth)
            .map(|b| ieth::Packet::new_unchecked(b).rkey())
    }

    /// BTH plus extension headers.
    pub fn header_len(&self) -> usize {
        self.layout.header_len
    }

    /// Whether the payload is a same-host reference list ([`super::peer_ref`]).
    pub fn peer_ref(&self) -> bool {
        self.bth().peer_ref()
    }

    /// The payload, pad excluded (for a [`PacketView::peer_ref`] packet, the encoded list).
    pub fn payload(&self) -> &'a [u8] {
        &self.buf[self.layout.header_len..self.buf.len() - ICRC_LEN - usize::from(self.pad)]
    }

    /// The pad bytes.
    pub fn pad(&self) -> &'a [u8] {
        let end = self.buf.len() - ICRC_LEN;
        &self.buf[end - usize::from(self.pad)..end]
    }

    /// The bytes the ICRC covers after the IP/UDP headers (BTH through pad).
    pub fn covered(&self) -> &'a [u8] {
        &self.buf[..self.buf.len() - ICRC_LEN]
    }

    /// The ICRC as carried (its little-endian reading).
    pub fn icrc(&self) -> u32 {
        let b = &self.buf[self.buf.len() - ICRC_LEN..];
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

/// Every header field of a datagram to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Headers {
    /// Opcode.
    pub opcode: Opcode,
    /// BTH.SE.
    pub solicited: bool,
    /// BTH.P_Key (0xFFFF, the default partition).
    pub pkey: u16,
    /// BTH.DestQP.
    pub dest_qpn: u32,
    /// BTH.AckReq.
    pub ack_req: bool,
    /// BTH.PSN.
    pub psn: Psn,
    /// RETH.
    pub reth: Option<reth::Repr>,
    /// AtomicETH.
    pub atomic_eth: Option<atomic_eth::Repr>,
    /// AETH.
    pub aeth: Option<aeth::Repr>,
    /// AtomicAckETH original value.
    pub atomic_ack_eth: Option<u64>,
    /// ImmDt.
    pub immdt: Option<u32>,
    /// IETH R_Key.
    pub ieth: Option<u32>,
    /// The payload is a same-host reference list ([`super::peer_ref`]), not bytes.
    pub peer_ref: bool,
}

/// The default P_Key.
pub const DEFAULT_PKEY: u16 = 0xFFFF;

impl Headers {
    /// Headers with the given BTH basics, P_Key 0xFFFF and no extension headers.
    pub const fn new(opcode: Opcode, dest_qpn: u32, psn: Psn) -> Headers {
        Headers {
            opcode,
            solicited: false,
            pkey: DEFAULT_PKEY,
            dest_qpn,
            ack_req: false,
            psn,
            reth: None,
            atomic_eth: None,
            aeth: None,
            atomic_ack_eth: None,
            immdt: None,
            ieth: None,
            peer_ref: false,
        }
    }

    /// The headers of a received datagram.
    ///
    /// # Errors
    /// [`PacketError::BadVersion`] when TVer is not 0.
    pub fn parse(view: &PacketView<'_>) -> PacketResult<Headers> {
        let b = view.bth_repr()?;
        Ok(Headers {
            opcode: b.opcode,
            solicited: b.solicited,
            pkey: b.pkey,
            dest_qpn: b.dest_qpn,
            ack_req: b.ack_req,
            psn: b.psn,
            reth: view.reth(),
            atomic_eth: view.atomic_eth(),
            aeth: view.aeth(),
            atomic_ack_eth: view.atomic_ack_eth(),
            immdt: view.immdt(),
            ieth: view.ieth(),
            peer_ref: view.peer_ref(),
        })
    }

    /// The layout, after checking that the extension headers present are exactly the opcode's.
    fn layout(&self) -> PacketResult<(OpFlags, Layout)> {
        let flags = self
            .opcode
            .flags()
            .ok_or(PacketError::UnknownOpcode(self.opcode.into()))?;
        let present = [
            (OpFlags::RETH, self.reth.is_some()),
            (OpFlags::ATOMIC_ETH, self.atomic_eth.is_some()),
            (OpFlags::AETH, self.aeth.is_some()),
            (OpFlags::ATOMIC_ACK_ETH, self.atomic_ack_eth.is_some()),
            (OpFlags::IMMDT, self.immdt.is_some()),
            (OpFlags::IETH, self.ieth.is_some()),
        ];
        if present.iter().any(|&(f, there)| flags.contains(f) != there) {
            return Err(PacketError::Malformed);
        }
        Ok((flags, Layout::of(flags)))
    }

    /// BTH plus extension headers.
    ///
    /// # Errors
    /// [`PacketError::UnknownOpcode`], or [`PacketError::Malformed`] when the extension headers present do
    /// not match the opcode.
    pub fn header_len(&self) -> PacketResult<usize> {
        Ok(self.layout()?.1.header_len)
    }

    /// Length of the datagram with `payload_len` payload bytes (headers, payload, pad, ICRC).
    ///
    /// # Errors
    /// As [`Headers::header_len`].
    pub fn buffer_len(&self, payload_len: usize) -> PacketResult<usize> {
        Ok(self.header_len()? + payload_len + pad_for(payload_len) + ICRC_LEN)
    }
}

/// Pad bytes after a payload of `len` bytes.
pub const fn pad_for(len: usize) -> usize {
    len.wrapping_neg() & 3
}

/// A datagram being built in place: headers written, payload to fill, then ICRC.
#[derive(Debug)]
pub struct PacketWriter<'b> {
    buf: &'b mut [u8],
    payload_at: usize,
    payload_len: usize,
}

impl<'b> PacketWriter<'b> {
    /// Writes the headers and zero pad of a datagram with a `payload_len`-byte payload into the
    /// front of `buf`.
    ///
    /// # Errors
    /// - [`PacketError::UnknownOpcode`] / [`PacketError::Malformed`]: the headers do not match the opcode,
    ///   or a payload is given to an opcode that carries none;
    /// - [`PacketError::Truncated`]: `buf` is shorter than the datagram.
    pub fn new(
        buf: &'b mut [u8],
        h: &Headers,
        payload_len: usize,
    ) -> PacketResult<PacketWriter<'b>> {
        let (flags, layout) = h.layout()?;
        if payload_len != 0 && !flags.contains(OpFlags::PAYLOAD) {
            return Err(PacketError::Malformed);
        }
        let pad = pad_for(payload_len);
        let total = layout.header_len + payload_len + pad + ICRC_LEN;
        if buf.len() < total {
            return Err(PacketError::Truncated);
        }
        let buf = &mut buf[..total];
        bth::Repr {
            opcode: h.opcode,
            solicited: h.solicited,
            mig_req: false,
            pad_count: pad as u8,
            pkey: h.pkey,
            fecn: false,
            becn: false,
            dest_qpn: h.dest_qpn,
            ack_req: h.ack_req,
            psn: h.psn,
        }
        .emit(&mut bth::Packet::new_unchecked(&mut buf[..]));
        if h.peer_ref {
            bth::Packet::new_unchecked(&mut buf[..]).set_peer_ref(true);
        }
        if let (Some(r), Some(at)) = (h.reth, layout.reth) {
            r.emit(&mut reth::Packet::new_unchecked(&mut buf[at..]));
        }
        if let (Some(r), Some(at)) = (h.atomic_eth, layout.atomic_eth) {
            r.emit(&mut atomic_eth::Packet::new_unchecked(&mut buf[at..]));
        }
        if let (Some(r), Some(at)) = (h.aeth, layout.aeth) {
            r.emit(&mut aeth::Packet::new_unchecked(&mut buf[at..]));
        }
        if let (Some(v), Some(at)) = (h.atomic_ack_eth, layout.atomic_ack_eth) {
            atomic_ack_eth::Packet::new_unchecked(&mut buf[at..]).set_orig(v);
        }
        if let (Some(v), Some(at)) = (h.immdt, layout.immdt) {
            immdt::Packet::new_unchecked(&mut buf[at..]).set_imm(v);
        }
        if let (Some(v), Some(at)) = (h.ieth, layout.ieth) {
            ieth::Packet::new_unchecked(&mut buf[at..]).set_rkey(v);
        }
        let pad_at = layout.header_len + payload_len;
        buf[pad_at..pad_at + pad].fill(0);
        Ok(PacketWriter {
            buf,
            payload_at: layout.header_len,
            payload_len,
        })
    }

    /// The payload area, to fill before [`PacketWriter::finish`].
    pub fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.payload_at..self.payload_at + self.payload_len]
    }

    /// Where the payload area starts in the datagram, and its length.
    pub fn payload_range(&self) -> (usize, usize) {
        (self.payload_at, self.payload_len)
    }

    /// Length of the datagram.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether the datagram is empty (never).
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Writes the ICRC (or zeros, when the capabilities turn ICRC filling off) and returns the
    /// datagram's length.
    pub fn finish(self, icrc_headers: &IcrcHeaders, caps: &ChecksumCapabilities) -> usize {
        let n = self.buf.len();
        if caps.icrc.tx() {
            icrc::fill(icrc_headers, self.buf);
        } else {
            self.buf[n - ICRC_LEN..].fill(0);
        }
        n
    }

    /// [`PacketWriter::finish`] for a datagram whose payload is not written into the buffer but
    /// sent from elsewhere: `payload` feeds those bytes to the ICRC, and the payload area is left
    /// as it is (the caller must put the same bytes on the wire there).
    pub fn finish_lent(
        self,
        icrc_headers: &IcrcHeaders,
        caps: &ChecksumCapabilities,
        payload: impl FnOnce(&mut crc32fast::Hasher),
    ) -> usize {
        let n = self.buf.len();
        let value = if caps.icrc.tx() {
            let tail_at = self.payload_at + self.payload_len;
            icrc::compute_split(
                icrc_headers,
                &self.buf[..self.payload_at],
                self.payload_len,
                payload,
                &self.buf[tail_at..n - ICRC_LEN],
            )
        } else {
            0
        };
        self.buf[n - ICRC_LEN..].copy_from_slice(&value.to_le_bytes());
        n
    }
}

/// Builds a whole datagram with `payload` into `buf` and returns its length.
///
/// # Errors
/// As [`PacketWriter::new`].
pub fn emit(
    buf: &mut [u8],
    h: &Headers,
    payload: &[u8],
    icrc_headers: &IcrcHeaders,
    caps: &ChecksumCapabilities,
) -> PacketResult<usize> {
    let mut w = PacketWriter::new(buf, h, payload.len())?;
    w.payload_mut().copy_from_slice(payload);
    Ok(w.finish(icrc_headers, caps))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soft::wire::icrc::IpPair;
    use crate::soft::wire::{NakCode, Syndrome, hexdump};
    use std::net::Ipv4Addr;

    fn v4(src: [u8; 4], dst: [u8; 4], id: u16, sport: u16) -> IcrcHeaders {
        IcrcHeaders {
            ip: IpPair::V4 {
                src: Ipv4Addr::from(src),
                dst: Ipv4Addr::from(dst),
            },
            ipv4_id: id,
            src_port: sport,
            dst_port: 4791,
        }
    }

    #[test]
    fn builds_reference_vector_b() {
        let want = hexdump(
            "0000  45 00 00 34 00 00 40 00 40 11 b7 4a c0 a8 01 0a
             0010  c0 a8 01 14 c0 01 12 b7 00 20 00 00 04 30 ff ff
             0020  00 00 00 11 80 12 34 56 68 65 6c 6c 6f 00 00 00
             0030  06 a9 fd 0e",
        );
        let mut h = Headers::new(Opcode::SendOnly, 0x11, Psn::new(0x12_3456));
        h.ack_req = true;
        let ih = v4([192, 168, 1, 10], [192, 168, 1, 20], 0, 0xC001);
        let mut buf = [0xEEu8; 64];
        let n = emit(
            &mut buf,
            &h,
            b"hello",
            &ih,
            &ChecksumCapabilities::default(),
        )
        .unwrap();
        assert_eq!(&buf[..n], &want[28..]);

        let view = PacketView::new_checked(&want[28..]).unwrap();
        assert_eq!(view.opcode(), Opcode::SendOnly);
        assert_eq!(view.payload(), b"hello");
        assert_eq!(view.pad(), &[0, 0, 0]);
        assert_eq!(view.pad_count(), 3);
        assert_eq!(Headers::parse(&view).unwrap(), h);
        assert!(icrc::verify(&ih, view.as_bytes()));
    }

    #[test]
    fn a_lent_payload_gets_the_icrc_of_the_whole_datagram() {
        let mut h = Headers::new(Opcode::WriteFirst, 0x11, Psn::new(7));
        h.reth = Some(crate::soft::wire::reth::Repr {
            va: 0x1000,
            rkey: 0x55,
            dma_len: 4096,
        });
        let ih = v4([192, 168, 1, 10], [192, 168, 1, 20], 0, 0xC001);
        let payload: Vec<u8> = (0..1027u32).map(|i| (i * 31) as u8).collect();
        let mut whole = [0u8; 1200];
        let n = emit(
            &mut whole,
            &h,
            &payload,
            &ih,
            &ChecksumCapabilities::default(),
        )
        .unwrap();
        let mut lent = [0xEEu8; 1200];
        let w = PacketWriter::new(&mut lent, &h, payload.len()).unwrap();
        let (at, _) = w.payload_range();
        let m = w.finish_lent(&ih, &ChecksumCapabilities::default(), |x| {
            x.update(&payload)
        });
        assert_eq!(m, n);
        // Everything but the payload area is written, ICRC included.
        assert_eq!(&lent[..at], &whole[..at]);
        assert!(lent[at..at + payload.len()].iter().all(|&b| b == 0xEE));
        assert_eq!(&lent[at + payload.len()..n], &whole[at + payload.len()..n]);
    }

    #[test]
    fn builds_reference_vectors_c_and_d() {
        let c = hexdump(
            "0000  45 00 00 30 12 34 40 00 01 11 e4 1a c0 a8 01 14
             0010  c0 a8 01 0a d2 f1 12 b7 00 1c 00 00 11 00 ff ff
             0020  00 00 00 12 00 12 34 56 1f 00 00 01 a8 f7 62 13",
        );
        let mut h = Headers::new(Opcode::Acknowledge, 0x12, Psn::new(0x12_3456));
        h.aeth = Some(aeth::Repr {
            syndrome: Syndrome::ACK,
            msn: 1,
        });
        let ih = v4([192, 168, 1, 20], [192, 168, 1, 10], 0x1234, 0xd2f1);
        let mut buf = [0u8; 64];
        let n = emit(&mut buf, &h, &[], &ih, &ChecksumCapabilities::default()).unwrap();
        assert_eq!(&buf[..n], &c[28..]);

        let d = hexdump(
            "0000  45 00 00 44 00 00 40 00 40 11 b7 3a c0 a8 01 0a
             0010  c0 a8 01 14 c0 01 12 b7 00 30 00 00 0a 00 ff ff
             0020  00 00 00 11 80 00 01 00 00 00 7f 00 00 00 10 00
             0030  00 00 12 34 00 00 00 08 00 01 02 03 04 05 06 07
             0040  4f 42 0f 0a",
        );
        let mut h = Headers::new(Opcode::WriteOnly, 0x11, Psn::new(0x100));
        h.ack_req = true;
        h.reth = Some(reth::Repr {
            va: 0x7f00_0000_1000,
            rkey: 0x1234,
            dma_len: 8,
        });
        let ih = v4([192, 168, 1, 10], [192, 168, 1, 20], 0, 0xC001);
        let n = emit(
            &mut buf,
            &h,
            &[0, 1, 2, 3, 4, 5, 6, 7],
            &ih,
            &ChecksumCapabilities::default(),
        )
        .unwrap();
        assert_eq!(&buf[..n], &d[28..]);
        let view = PacketView::new_checked(&d[28..]).unwrap();
        assert_eq!(view.reth(), h.reth);
        assert_eq!(view.payload(), &[0, 1, 2, 3, 4, 5, 6, 7]);
    }

    #[test]
    fn parses_the_rxe_capture() {
        use crate::soft::wire::icrc::tests::{PCAP, pcap_packet};
        let want = [
            Opcode::SendFirst,
            Opcode::SendMiddle,
            Opcode::SendMiddle,
            Opcode::SendLast,
        ];
        for i in 0..PCAP.len() {
            let (ih, p) = pcap_packet(i);
            let v = PacketView::new_checked(&p).unwrap();
            assert_eq!(v.opcode(), want[i % 4]);
            assert_eq!(v.dest_qpn(), 0x123);
            assert_eq!(v.psn(), Psn::new(0x8671cd + (i % 4) as u32));
            assert_eq!(v.ack_req(), i % 4 == 3, "AckReq only on SEND_LAST");
            assert_eq!((v.pkey(), v.tver(), v.pad_count()), (0xFFFF, 0, 0));
            assert_eq!(v.payload().len(), 1024);
            assert!(v.payload().iter().all(|&b| b == 0x7b));
            assert!(icrc::verify(&ih, v.as_bytes()));
            // Rebuilding from the parsed headers gives the captured bytes.
            let h = Headers::parse(&v).unwrap();
            let mut out = vec![0u8; 1100];
            let n = emit(
                &mut out,
                &h,
                v.payload(),
                &ih,
                &ChecksumCapabilities::default(),
            )
            .unwrap();
            assert_eq!(&out[..n], &p[..]);
        }
    }

    #[test]
    fn every_opcode_round_trips() {
        let ih = v4([127, 0, 0, 1], [127, 0, 0, 2], 0, 4791);
        for raw in 0..=0x17u8 {
            let op = Opcode::from(raw);
            let Some(flags) = op.flags() else { continue };
            let mut h = Headers::new(op, 0xAB_CDEF, Psn::new(0xFF_FFFE));
            h.solicited = flags.contains(OpFlags::END);
            h.ack_req = raw % 2 == 0;
            if flags.contains(OpFlags::RETH) {
                h.reth = Some(reth::Repr {
                    va: 0x1122_3344_5566_7788,
                    rkey: 0x99,
                    dma_len: 77,
                });
            }
            if flags.contains(OpFlags::ATOMIC_ETH) {
                h.atomic_eth = Some(atomic_eth::Repr {
                    va: 0x1000,
                    rkey: 0x42,
                    swap_add: 3,
                    compare: 4,
                });
            }
            if flags.contains(OpFlags::AETH) {
                h.aeth = Some(aeth::Repr {
                    syndrome: Syndrome::Nak(NakCode::InvalidRequest),
                    msn: 9,
                });
            }
            if flags.contains(OpFlags::ATOMIC_ACK_ETH) {
                h.atomic_ack_eth = Some(0xDEAD_BEEF_0000_0001);
            }
            if flags.contains(OpFlags::IMMDT) {
                h.immdt = Some(0x0102_0304);
            }
            if flags.contains(OpFlags::IETH) {
                h.ieth = Some(0x0000_1200);
            }
            for len in [0usize, 1, 2, 3, 4, 5, 255, 256] {
                if len > 0 && !flags.contains(OpFlags::PAYLOAD) {
                    continue;
                }
                let payload: Vec<u8> = (0..len).map(|i| i as u8).collect();
                let mut buf = vec![0xEEu8; 400];
                let n = emit(
                    &mut buf,
                    &h,
                    &payload,
                    &ih,
                    &ChecksumCapabilities::default(),
                )
                .unwrap();
                assert_eq!(n, h.buffer_len(len).unwrap());
                assert_eq!(n % 4, 0, "{op}: the datagram is 4-byte aligned");
                let v = PacketView::new_checked(&buf[..n]).unwrap();
                assert_eq!(Headers::parse(&v).unwrap(), h, "{op} len {len}");
                assert_eq!(v.payload(), &payload[..]);
                assert!(v.pad().iter().all(|&b| b == 0));
                assert!(icrc::verify(&ih, v.as_bytes()));
                // Every truncation is refused.
                for cut in 0..n {
                    assert!(
                        PacketView::new_checked(&buf[..cut]).is_err() || cut >= v.header_len() + 4
                    );
                }
            }
        }
    }

    #[test]
    fn refuses_bad_lengths_and_mismatched_headers() {
        let ih = v4([127, 0, 0, 1], [127, 0, 0, 2], 0, 4791);
        // An ACK with a payload byte.
        let mut h = Headers::new(Opcode::Acknowledge, 1, Psn::ZERO);
        h.aeth = Some(aeth::Repr {
            syndrome: Syndrome::ACK,
            msn: 0,
        });
        let mut buf = [0u8; 64];
        assert_eq!(
            emit(&mut buf, &h, &[1], &ih, &Default::default()),
            Err(PacketError::Malformed)
        );
        let n = emit(&mut buf, &h, &[], &ih, &Default::default()).unwrap();
        let mut longer = buf[..n].to_vec();
        longer.insert(16, 0);
        assert_eq!(
            PacketView::new_checked(&longer).unwrap_err(),
            PacketError::Malformed
        );
        // An ACK without its AETH, a SEND with a RETH.
        h.aeth = None;
        assert_eq!(h.header_len(), Err(PacketError::Malformed));
        let mut s = Headers::new(Opcode::SendOnly, 1, Psn::ZERO);
        s.reth = Some(reth::Repr::default());
        assert_eq!(s.header_len(), Err(PacketError::Malformed));
        // A pad longer than the payload.
        let s = Headers::new(Opcode::SendOnly, 1, Psn::ZERO);
        let n = emit(&mut buf, &s, &[], &ih, &Default::default()).unwrap();
        buf[1] |= 0x30;
        assert_eq!(
            PacketView::new_checked(&buf[..n]).unwrap_err(),
            PacketError::Malformed
        );
        // Unknown opcodes and short buffers.
        let mut u = [0u8; 32];
        u[0] = 0x64;
        assert_eq!(
            PacketView::new_checked(&u).unwrap_err(),
            PacketError::UnknownOpcode(0x64)
        );
        assert_eq!(
            PacketView::new_checked(&u[..11]).unwrap_err(),
            PacketError::Truncated
        );
        u[0] = 0x13;
        assert_eq!(
            PacketView::new_checked(&u).unwrap_err(),
            PacketError::Truncated,
            "no room for AtomicETH + ICRC"
        );
        // A buffer too small to emit into.
        let s = Headers::new(Opcode::SendOnly, 1, Psn::ZERO);
        assert_eq!(
            emit(&mut buf[..19], &s, &[1, 2], &ih, &Default::default()),
            Err(PacketError::Truncated)
        );
        // Zeroed ICRC when filling is off.
        let n = emit(&mut buf, &s, &[1, 2], &ih, &ChecksumCapabilities::ignored()).unwrap();
        assert_eq!(&buf[n - 4..n], &[0, 0, 0, 0]);
    }
}
