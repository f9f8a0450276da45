//! The RoCEv2 invariant CRC, computed exactly as Linux rxe computes it, and the capability
//! switches that turn its checking and filling on and off.
//!
//! Owns the ICRC: which bytes it covers, which header fields are masked to ones, and where the
//! four bytes go. It does not decide what to do with a bad packet (the caller drops it).
//!
//! # What is covered
//! A standard CRC-32 (the Ethernet/zlib one; `crc32fast` does the bulk with carry-less
//! multiplication) over: 8 bytes of 0xFF standing for the InfiniBand LRH; the IP header (IPv4:
//! 20 bytes with TOS, TTL and header checksum set to ones; IPv6: 40 bytes with traffic class, flow
//! label and hop limit set to ones); the UDP header with its checksum set to ones; the BTH with
//! byte 4 (FECN, BECN, reserved) set to ones; the extension headers, payload and pad as they are.
//! The result goes into the last four bytes of the UDP payload, least significant byte first.
//!
//! The IP and UDP headers are not part of the UDP payload a socket sees, so callers describe them
//! with [`IcrcHeaders`]. The IPv4 header is rebuilt as a RoCEv2 sender writes it: no options,
//! DF set, fragment offset 0, protocol 17, lengths from the payload length, and the given
//! identification.
//!
//! # The IPv4 identification
//! The identification is covered, but a UDP socket never sees the one a received packet carried,
//! and peers such as rxe send non-zero, unpredictable values. [`Ipv4IdSolver`] recovers it from
//! the CRC's linearity: for a fixed packet length, flipping bit *j* of the identification changes
//! the CRC by a constant `v_j`, so `received ⊕ crc(id = 0)` must equal `⊕ v_j` over the set bits
//! of the real identification. The sixteen `v_j` are linearly independent (a CRC-32 detects every
//! burst of 32 bits or fewer), so at most one identification explains a given CRC; the solver
//! computes the `v_j` once per packet length, keeps them in reduced echelon form, and then needs
//! sixteen conditional XORs per packet.
//!
//! **Detection power lost.** Exact checking accepts a corrupted packet with probability 2⁻³²;
//! with the identification unknown, a corrupted packet is accepted whenever its CRC error lands in
//! the 16-dimensional span of the `v_j`, which for random corruption has probability
//! 2¹⁶ / 2³² = **2⁻¹⁶ per corrupted packet**. Corruption confined to the identification field is
//! never detected (it is treated as unknown). Every error pattern that, together with the
//! identification field, spans 32 bits or fewer is still always detected, as is every error the
//! UDP checksum catches when the sender filled one in. On the transmit side nothing is lost: a
//! sender knows its identification (the soft device sends with 0, or `k` for segment `k` of a
//! UDP GSO batch, see [`Ipv4IdSolver::adjust`]).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::ICRC_LEN;
use super::bth;

/// Which directions compute the ICRC (smoltcp's `Checksum` shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Checksum {
    /// Verify on receive and fill on transmit.
    #[default]
    Both,
    /// Verify on receive only (transmit writes zeros).
    Rx,
    /// Fill on transmit only (receive accepts any ICRC).
    Tx,
    /// Neither.
    None,
}

impl Checksum {
    /// Whether received packets are verified.
    ///
    /// # Fuzzing
    /// Under `cfg(fuzzing)` verification is off, so fuzzers reach the protocol.
    pub const fn rx(&self) -> bool {
        if cfg!(fuzzing) {
            return false;
        }
        matches!(self, Checksum::Both | Checksum::Rx)
    }

    /// Whether transmitted packets get a real ICRC.
    pub const fn tx(&self) -> bool {
        matches!(self, Checksum::Both | Checksum::Tx)
    }
}

/// The checksum switches a device runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ChecksumCapabilities {
    /// The ICRC.
    pub icrc: Checksum,
}

impl ChecksumCapabilities {
    /// Checksums neither verified nor filled (fuzzing, tests that corrupt on purpose).
    pub const fn ignored() -> ChecksumCapabilities {
        ChecksumCapabilities {
            icrc: Checksum::None,
        }
    }
}

/// The source and destination address of a datagram, of one family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IpPair {
    /// IPv4.
    V4 {
        /// Source.
        src: Ipv4Addr,
        /// Destination.
        dst: Ipv4Addr,
    },
    /// IPv6.
    V6 {
        /// Source.
        src: Ipv6Addr,
        /// Destination.
        dst: Ipv6Addr,
    },
}

impl IpPair {
    /// A pair from two addresses; `None` when their families differ.
    pub fn new(src: IpAddr, dst: IpAddr) -> Option<IpPair> {
        match (src, dst) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => Some(IpPair::V4 { src, dst }),
            (IpAddr::V6(src), IpAddr::V6(dst)) => Some(IpPair::V6 { src, dst }),
            _ => None,
        }
    }

    /// The source address.
    pub fn src(&self) -> IpAddr {
        match *self {
            IpPair::V4 { src, .. } => IpAddr::V4(src),
            IpPair::V6 { src, .. } => IpAddr::V6(src),
        }
    }

    /// The destination address.
    pub fn dst(&self) -> IpAddr {
        match *self {
            IpPair::V4 { dst, .. } => IpAddr::V4(dst),
            IpPair::V6 { dst, .. } => IpAddr::V6(dst),
        }
    }
}

/// The IP and UDP header fields the ICRC covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IcrcHeaders {
    /// Addresses.
    pub ip: IpPair,
    /// IPv4 identification (ignored for IPv6).
    pub ipv4_id: u16,
    /// UDP source port.
    pub src_port: u16,
    /// UDP destination port (4791).
    pub dst_port: u16,
}

/// The pseudo-LRH, 8 bytes of ones.
const LRH: [u8; 8] = [0xFF; 8];
/// LRH + IPv4 header + UDP header.
const PREFIX_V4: usize = 8 + 20 + 8;
/// LRH + IPv6 header + UDP header.
const PREFIX_V6: usize = 8 + 40 + 8;
/// Room for the longest pseudo-header prefix followed by a BTH.
const PRE_BTH: usize = PREFIX_V6 + bth::HEADER_LEN;
/// Offset of the IPv4 identification in the CRC input.
const ID_OFFSET: usize = 8 + 4;
/// Largest UDP payload an IPv4 datagram can carry.
const MAX_UDP_PAYLOAD_V4: usize = 65_535 - 20 - 8;

/// Writes LRH + masked IP header + masked UDP header for a UDP payload of `udp_payload_len` bytes
/// and returns how many bytes of `out` it used (the rest is room for the BTH that follows).
fn prefix(h: &IcrcHeaders, udp_payload_len: usize, out: &mut [u8; PRE_BTH]) -> usize {
    let udp_len = (8 + udp_payload_len) as u16;
    out[..8].copy_from_slice(&LRH);
    let ip_end = match h.ip {
        IpPair::V4 { src, dst } => {
            let ip = &mut out[8..28];
            ip[0] = 0x45;
            ip[1] = 0xFF; // TOS
            ip[2..4].copy_from_slice(&(udp_len.wrapping_add(20)).to_be_bytes());
            ip[4..6].copy_from_slice(&h.ipv4_id.to_be_bytes());
            ip[6..8].copy_from_slice(&[0x40, 0x00]); // DF, offset 0
            ip[8] = 0xFF; // TTL
            ip[9] = 17;
            ip[10..12].copy_from_slice(&[0xFF, 0xFF]); // header checksum
            ip[12..16].copy_from_slice(&src.octets());
            ip[16..20].copy_from_slice(&dst.octets());
            28
        }
        IpPair::V6 { src, dst } => {
            let ip = &mut out[8..48];
            ip[0..4].copy_from_slice(&[0x6F, 0xFF, 0xFF, 0xFF]); // version, TC, flow label
            ip[4..6].copy_from_slice(&udp_len.to_be_bytes());
            ip[6] = 17;
            ip[7] = 0xFF; // hop limit
            ip[8..24].copy_from_slice(&src.octets());
            ip[24..40].copy_from_slice(&dst.octets());
            48
        }
    };
    let udp = &mut out[ip_end..ip_end + 8];
    udp[0..2].copy_from_slice(&h.src_port.to_be_bytes());
    udp[2..4].copy_from_slice(&h.dst_port.to_be_bytes());
    udp[4..6].copy_from_slice(&udp_len.to_be_bytes());
    udp[6..8].copy_from_slice(&[0xFF, 0xFF]);
    ip_end + 8
}

/// The ICRC of a datagram whose covered part (BTH through pad, without the ICRC) is `covered`.
///
/// The value is the CRC-32 as a number; its little-endian bytes are the wire bytes.
pub fn compute(h: &IcrcHeaders, covered: &[u8]) -> u32 {
    compute_split(h, covered, 0, |_| {}, &[])
}

/// The ICRC of a datagram whose covered part is `head`, then `middle_len` bytes that `middle`
/// feeds to the hasher, then `tail`: for a packet whose payload is not in the same buffer as its
/// headers. `head` holds the whole BTH (only its bytes are masked); `middle` must feed exactly
/// `middle_len` bytes.
pub fn compute_split(
    h: &IcrcHeaders,
    head: &[u8],
    middle_len: usize,
    middle: impl FnOnce(&mut crc32fast::Hasher),
    tail: &[u8],
) -> u32 {
    // The pseudo-headers and the masked BTH go to the hasher as one run: each `update` has a
    // fixed cost that, for small packets, is most of the work.
    let mut pre = [0u8; PRE_BTH];
    let covered_len = head.len() + middle_len + tail.len();
    let n = prefix(h, covered_len + ICRC_LEN, &mut pre);
    let bth_len = head.len().min(bth::HEADER_LEN);
    pre[n..n + bth_len].copy_from_slice(&head[..bth_len]);
    if bth_len > 4 {
        pre[n + 4] = 0xFF;
    }
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&pre[..n + bth_len]);
    if head.len() > bth_len {
        hasher.update(&head[bth_len..]);
    }
    middle(&mut hasher);
    if !tail.is_empty() {
        hasher.update(tail);
    }
    hasher.finalize()
}

/// The ICRC carried in the last four bytes of a UDP payload.
pub fn read(udp_payload: &[u8]) -> Option<u32> {
    let at = udp_payload.len().checked_sub(ICRC_LEN)?;
    let b = &udp_payload[at..];
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Whether a UDP payload (BTH through ICRC) carries the right ICRC.
pub fn verify(h: &IcrcHeaders, udp_payload: &[u8]) -> bool {
    match udp_payload.len().checked_sub(ICRC_LEN) {
        Some(at) => read(udp_payload) == Some(compute(h, &udp_payload[..at])),
        None => false,
    }
}

/// Writes the ICRC into the last four bytes of a UDP payload (BTH through ICRC). A buffer shorter
/// than four bytes is left alone.
pub fn fill(h: &IcrcHeaders, udp_payload: &mut [u8]) {
    if let Some(at) = udp_payload.len().checked_sub(ICRC_LEN) {
        let icrc = compute(h, &udp_payload[..at]);
        udp_payload[at..].copy_from_slice(&icrc.to_le_bytes());
    }
}

/// Solves for the IPv4 identification of received packets (see the module docs) and adjusts an
/// ICRC computed with identification 0 to another identification.
///
/// Keeps one small basis per UDP payload length it has seen (computed on first use).
#[derive(Debug, Default, Clone)]
pub struct Ipv4IdSolver {
    bases: Vec<Option<Box<Basis>>>,
}

/// The identification's contribution for one packet length.
#[derive(Debug, Clone)]
struct Basis {
    /// `v[j]`: the CRC change when bit `j` of the identification is set.
    v: [u32; 16],
    /// Echelon rows `(vector, combination of identification bits)`, highest pivot first.
    rows: [(u32, u16); 16],
    /// Number of rows in use (16: the vectors are independent).
    rank: usize,
}

/// Zeros to feed the CRC.
static ZEROS: [u8; 512] = [0; 512];

impl Basis {
    /// The basis for a UDP payload of `udp_payload_len` bytes.
    fn new(udp_payload_len: usize) -> Basis {
        // CRC input: LRH + IPv4 + UDP + (payload without the ICRC).
        let n = PREFIX_V4 + udp_payload_len - ICRC_LEN;
        let crc_with_id = |id: u16| {
            let mut head = [0u8; ID_OFFSET + 2];
            head[ID_OFFSET..].copy_from_slice(&id.to_be_bytes());
            let mut h = crc32fast::Hasher::new();
            h.update(&head);
            let mut left = n - head.len();
            while left > 0 {
                let k = left.min(ZEROS.len());
                h.update(&ZEROS[..k]);
                left -= k;
            }
            h.finalize()
        };
        let base = crc_with_id(0);
        let mut v = [0u32; 16];
        for (j, vj) in v.iter_mut().enumerate() {
            *vj = crc_with_id(1 << j) ^ base;
        }
        let mut rows = [(0u32, 0u16); 16];
        let mut rank = 0;
        for (j, &vj) in v.iter().enumerate() {
            let (mut vec, mut comb) = (vj, 1u16 << j);
            for &(r, c) in &rows[..rank] {
                if vec & (1 << (31 - r.leading_zeros())) != 0 {
                    vec ^= r;
                    comb ^= c;
                }
            }
            if vec != 0 {
                // Insert keeping pivots (highest set bits) in decreasing order.
                let pivot = 31 - vec.leading_zeros();
                let at = rows[..rank]
                    .iter()
                    .position(|&(r, _)| 31 - r.leading_zeros() < pivot)
                    .unwrap_or(rank);
                rows.copy_within(at..rank, at + 1);
                rows[at] = (vec, comb);
                rank += 1;
                // Keep earlier rows free of the new pivot so greedy reduction stays exact.
                for row in &mut rows[..at] {
                    if row.0 & (1 << pivot) != 0 {
                        row.0 ^= vec;
                        row.1 ^= comb;
                    }
                }
            }
        }
        Basis { v, rows, rank }
    }

    /// The identification whose contribution is `syndrome`, if there is one.
    fn solve(&self, mut syndrome: u32) -> Option<u16> {
        let mut id = 0u16;
        for &(r, c) in &self.rows[..self.rank] {
            if syndrome & (1 << (31 - r.leading_zeros())) != 0 {
                syndrome ^= r;
                id ^= c;
            }
        }
        (syndrome == 0).then_some(id)
    }

    /// The contribution of identification `id`.
    fn contribution(&self, id: u16) -> u32 {
        let mut acc = 0;
        for (j, &vj) in self.v.iter().enumerate() {
            if id & (1 << j) != 0 {
                acc ^= vj;
            }
        }
        acc
    }
}

impl Ipv4IdSolver {
    /// An empty solver.
    pub fn new() -> Ipv4IdSolver {
        Ipv4IdSolver::default()
    }

    fn basis(&mut self, udp_payload_len: usize) -> Option<&Basis> {
        if !(ICRC_LEN..=MAX_UDP_PAYLOAD_V4).contains(&udp_payload_len) {
            return None;
        }
        if self.bases.len() <= udp_payload_len {
            self.bases.resize(udp_payload_len + 1, None);
        }
        let slot = &mut self.bases[udp_payload_len];
        Some(slot.get_or_insert_with(|| Box::new(Basis::new(udp_payload_len))))
    }

    /// The IPv4 identification under which `udp_payload` (BTH through ICRC, sent from
    /// `src:src_port` to `dst:dst_port`) carries a correct ICRC, or `None` when no
    /// identification does (the packet is corrupt and must be dropped).
    pub fn solve(
        &mut self,
        src: Ipv4Addr,
        dst: Ipv4Addr,
        src_port: u16,
        dst_port: u16,
        udp_payload: &[u8],
    ) -> Option<u16> {
        let received = read(udp_payload)?;
        let h = IcrcHeaders {
            ip: IpPair::V4 { src, dst },
            ipv4_id: 0,
            src_port,
            dst_port,
        };
        let at = udp_payload.len() - ICRC_LEN;
        let syndrome = received ^ compute(&h, &udp_payload[..at]);
        self.basis(udp_payload.len())?.solve(syndrome)
    }

    /// Turns the ICRC of an IPv4 packet computed with identification 0 into the ICRC for
    /// identification `id` (UDP GSO numbers segment *k* with identification *k*).
    /// `udp_payload_len` counts BTH through ICRC. Returns `None` for a length no IPv4 datagram
    /// can have.
    pub fn adjust(&mut self, icrc_id0: u32, id: u16, udp_payload_len: usize) -> Option<u32> {
        Some(icrc_id0 ^ self.basis(udp_payload_len)?.contribution(id))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::soft::wire::{hex, hexdump};

    /// Splits an IPv4 packet (20-byte header) into its ICRC headers and UDP payload.
    fn split_v4(pkt: &[u8]) -> (IcrcHeaders, &[u8]) {
        let ip = &pkt[..20];
        let udp = &pkt[20..28];
        let h = IcrcHeaders {
            ip: IpPair::V4 {
                src: Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]),
                dst: Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]),
            },
            ipv4_id: u16::from_be_bytes([ip[4], ip[5]]),
            src_port: u16::from_be_bytes([udp[0], udp[1]]),
            dst_port: u16::from_be_bytes([udp[2], udp[3]]),
        };
        assert_eq!(
            u16::from_be_bytes([ip[2], ip[3]]) as usize,
            pkt.len(),
            "total length"
        );
        assert_eq!(
            u16::from_be_bytes([udp[4], udp[5]]) as usize,
            pkt.len() - 20
        );
        (h, &pkt[28..])
    }

    // Reference vector A: a ConnectX-4 Lx CNP (IPv4 id 0x718c, TOS 0xC2, BECN set).
    const VECTOR_A: &str = "45c2003c718c4000401191610a0011010a001201000012b700280000\
                            8100ffff40000118 00000000 00000000000000000000000000000000 82fd002a";
    const VECTOR_B: &str = "
        0000  45 00 00 34 00 00 40 00 40 11 b7 4a c0 a8 01 0a
        0010  c0 a8 01 14 c0 01 12 b7 00 20 00 00 04 30 ff ff
        0020  00 00 00 11 80 12 34 56 68 65 6c 6c 6f 00 00 00
        0030  06 a9 fd 0e";
    const VECTOR_C: &str = "
        0000  45 00 00 30 12 34 40 00 01 11 e4 1a c0 a8 01 14
        0010  c0 a8 01 0a d2 f1 12 b7 00 1c 00 00 11 00 ff ff
        0020  00 00 00 12 00 12 34 56 1f 00 00 01 a8 f7 62 13";
    const VECTOR_D: &str = "
        0000  45 00 00 44 00 00 40 00 40 11 b7 3a c0 a8 01 0a
        0010  c0 a8 01 14 c0 01 12 b7 00 30 00 00 0a 00 ff ff
        0020  00 00 00 11 80 00 01 00 00 00 7f 00 00 00 10 00
        0030  00 00 12 34 00 00 00 08 00 01 02 03 04 05 06 07
        0040  4f 42 0f 0a";

    #[test]
    fn hardware_cnp_vector_a() {
        let pkt = hex(VECTOR_A);
        let (h, udp_payload) = split_v4(&pkt);
        assert_eq!(udp_payload.len(), 32);
        assert_eq!(
            read(udp_payload),
            Some(u32::from_le_bytes([0x82, 0xfd, 0x00, 0x2a]))
        );
        assert!(verify(&h, udp_payload));
    }

    #[test]
    fn reference_vectors_b_c_d() {
        for (name, dump) in [("B", VECTOR_B), ("C", VECTOR_C), ("D", VECTOR_D)] {
            let pkt = hexdump(dump);
            let (h, udp_payload) = split_v4(&pkt);
            assert!(verify(&h, udp_payload), "vector {name}");
            let mut copy = udp_payload.to_vec();
            let n = copy.len();
            copy[n - 4..].fill(0);
            fill(&h, &mut copy);
            assert_eq!(
                copy, udp_payload,
                "vector {name}: fill writes the same bytes"
            );
            // Any flipped bit is caught.
            for bit in [0usize, 7 * 8 + 3, (n - 5) * 8 + 1] {
                let mut bad = udp_payload.to_vec();
                bad[bit / 8] ^= 1 << (bit % 8);
                assert!(!verify(&h, &bad), "vector {name} bit {bit}");
            }
        }
    }

    #[test]
    fn split_computation_matches_the_whole_one_at_every_cut() {
        for dump in [VECTOR_B, VECTOR_D] {
            let pkt = hexdump(dump);
            let (h, udp_payload) = split_v4(&pkt);
            let covered = &udp_payload[..udp_payload.len() - ICRC_LEN];
            let want = compute(&h, covered);
            assert_eq!(Some(want), read(udp_payload));
            for a in bth::HEADER_LEN..=covered.len() {
                for b in a..=covered.len() {
                    let got = compute_split(
                        &h,
                        &covered[..a],
                        b - a,
                        |x| x.update(&covered[a..b]),
                        &covered[b..],
                    );
                    assert_eq!(got, want, "head {a}, middle {}", b - a);
                }
            }
        }
    }

    #[test]
    fn masked_fields_do_not_matter() {
        let pkt = hexdump(VECTOR_B);
        let (h, udp_payload) = split_v4(&pkt);
        let mut p = udp_payload.to_vec();
        p[4] = 0xC0; // FECN + BECN
        assert!(verify(&h, &p), "BTH byte 4 is masked");
        p[1] ^= 0x80; // SE is covered
        assert!(!verify(&h, &p));
        let other_id = IcrcHeaders { ipv4_id: 1, ..h };
        assert!(
            !verify(&other_id, udp_payload),
            "the identification is covered"
        );
        let other_port = IcrcHeaders {
            src_port: 0xC002,
            ..h
        };
        assert!(
            !verify(&other_port, udp_payload),
            "the source port is covered"
        );
    }

    #[test]
    fn ipv6_vector_from_the_reference_model() {
        // icrc_ref.py's icrc_v6 over a WRITE_ONLY from fd00::a to fd00::14 with traffic class
        // 0x12 and flow label 0xabcde (both masked).
        let ip6 =
            hex("612abcde00301140fd00000000000000000000000000000afd000000000000000000000000000014");
        let udp = hex("c00112b700300000");
        let covered =
            hex("0a00ffff000000118000010000007f000000100000001234000000080001020304050607");
        let h = IcrcHeaders {
            ip: IpPair::V6 {
                src: Ipv6Addr::from(<[u8; 16]>::try_from(&ip6[8..24]).unwrap()),
                dst: Ipv6Addr::from(<[u8; 16]>::try_from(&ip6[24..40]).unwrap()),
            },
            ipv4_id: 0x5555, // ignored for IPv6
            src_port: u16::from_be_bytes([udp[0], udp[1]]),
            dst_port: u16::from_be_bytes([udp[2], udp[3]]),
        };
        assert_eq!(
            compute(&h, &covered).to_le_bytes(),
            [0xe0, 0xba, 0x1c, 0xe6]
        );
    }

    /// The first four packets of `captures/rxe61-send4096-mtu1024.pcap` (and their
    /// retransmissions): 10.77.0.2:0xd353 → 10.77.0.1:4791, 1024 bytes of 0x7b each.
    pub(crate) const PCAP: [(u16, &str, [u8; 4]); 8] = [
        (0x9a01, "0000ffff00000123008671cd", [0x43, 0x43, 0x08, 0x2c]),
        (0x9a02, "0100ffff00000123008671ce", [0x36, 0x5a, 0x47, 0x7d]),
        (0x9a03, "0100ffff00000123008671cf", [0x5a, 0xe8, 0x16, 0xf4]),
        (0x9a04, "0200ffff00000123808671d0", [0x16, 0xc6, 0x11, 0xac]),
        (0x9a15, "0000ffff00000123008671cd", [0xd5, 0xde, 0xfa, 0xef]),
        (0x9a16, "0100ffff00000123008671ce", [0xa0, 0xc7, 0xb5, 0xbe]),
        (0x9a17, "0100ffff00000123008671cf", [0xcc, 0x75, 0xe4, 0x37]),
        (0x9a18, "0200ffff00000123808671d0", [0xe3, 0xab, 0x52, 0xa7]),
    ];

    /// One capture packet as (headers, UDP payload).
    pub(crate) fn pcap_packet(i: usize) -> (IcrcHeaders, Vec<u8>) {
        let (id, bth, icrc) = PCAP[i];
        let mut p = hex(bth);
        p.extend_from_slice(&[0x7b; 1024]);
        p.extend_from_slice(&icrc);
        let h = IcrcHeaders {
            ip: IpPair::V4 {
                src: Ipv4Addr::new(10, 77, 0, 2),
                dst: Ipv4Addr::new(10, 77, 0, 1),
            },
            ipv4_id: id,
            src_port: 0xd353,
            dst_port: 4791,
        };
        (h, p)
    }

    #[test]
    fn rxe_capture_checks_and_its_identification_is_recovered() {
        let mut solver = Ipv4IdSolver::new();
        for i in 0..PCAP.len() {
            let (h, p) = pcap_packet(i);
            assert_eq!(p.len(), 1040);
            assert!(verify(&h, &p), "packet {i}");
            let IpPair::V4 { src, dst } = h.ip else {
                unreachable!()
            };
            assert_eq!(
                solver.solve(src, dst, h.src_port, h.dst_port, &p),
                Some(h.ipv4_id)
            );
            let mut bad = p.clone();
            bad[500] ^= 0x10;
            assert_eq!(
                solver.solve(src, dst, h.src_port, h.dst_port, &bad),
                None,
                "packet {i}"
            );
        }
    }

    #[test]
    fn adjust_matches_a_full_computation() {
        let mut solver = Ipv4IdSolver::new();
        let (h, p) = pcap_packet(0);
        let covered = &p[..p.len() - 4];
        let zero = compute(&IcrcHeaders { ipv4_id: 0, ..h }, covered);
        for id in [0u16, 1, 2, 0x8000, 0x9a01, 0xFFFF, 12345] {
            let want = compute(&IcrcHeaders { ipv4_id: id, ..h }, covered);
            assert_eq!(solver.adjust(zero, id, p.len()), Some(want), "id {id:#x}");
        }
        assert_eq!(solver.adjust(0, 1, 3), None, "shorter than an ICRC");
        assert_eq!(solver.adjust(0, 1, 70_000), None, "longer than IPv4 allows");
    }

    #[test]
    fn basis_has_full_rank_for_every_small_length() {
        for len in 4..300 {
            let b = Basis::new(len);
            assert_eq!(b.rank, 16, "length {len}");
            for id in [1u16, 0x00FF, 0xA5A5, 0xFFFF] {
                assert_eq!(b.solve(b.contribution(id)), Some(id));
            }
        }
    }

    #[test]
    fn solver_recovers_random_identifications_and_false_accepts_rarely() {
        // splitmix64, so the test is deterministic.
        let mut s = 0x5eed_u64;
        let mut next = move || {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let mut solver = Ipv4IdSolver::new();
        let src = Ipv4Addr::new(127, 0, 0, 1);
        let dst = Ipv4Addr::new(127, 0, 0, 2);
        let mut accepted_corrupt = 0;
        let trials = 200_000;
        for t in 0..trials {
            let len = 16 + (next() % 64) as usize;
            let mut p: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            let id = next() as u16;
            let h = IcrcHeaders {
                ip: IpPair::V4 { src, dst },
                ipv4_id: id,
                src_port: 4791,
                dst_port: 4791,
            };
            fill(&h, &mut p);
            if t % 16 == 0 {
                assert_eq!(solver.solve(src, dst, 4791, 4791, &p), Some(id));
            }
            // Corrupt a few random bits anywhere (ICRC included) except BTH byte 4, which the
            // ICRC masks on purpose.
            let original = p.clone();
            for _ in 0..1 + next() % 4 {
                let bit = (next() % (len as u64 * 8)) as usize;
                if bit / 8 != 4 {
                    p[bit / 8] ^= 1 << (bit % 8);
                }
            }
            if p != original && solver.solve(src, dst, 4791, 4791, &p).is_some() {
                accepted_corrupt += 1;
            }
        }
        // Expected about trials / 65536 ≈ 3; a 2^-32 checker would accept none, a broken solver
        // thousands.
        assert!(
            accepted_corrupt <= 15,
            "{accepted_corrupt} corrupt packets accepted"
        );
    }
}
