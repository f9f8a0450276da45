//! Per-packet costs of the soft device's wire layer: header emit and parse, the ICRC (against a
//! plain table-driven CRC-32 written here as the anchor), and recovering the IPv4 identification
//! of a received packet.
//!
//! `cargo bench --bench wire`; `-- --quick` for a short run.

use std::hint::black_box;
use std::net::Ipv4Addr;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use erdma::soft::wire::packet::emit;
use erdma::soft::wire::reth;
use erdma::soft::wire::{
    ChecksumCapabilities, Headers, IcrcHeaders, IpPair, Ipv4IdSolver, Opcode, PacketView, Psn,
    ROCE_PORT, icrc,
};

/// Payload sizes of the ICRC comparison: an 8 B message, and full packets at the path MTUs.
const PAYLOADS: &[usize] = &[8, 256, 1024, 4096];

/// The CRC-32 (IEEE 802.3, reflected, polynomial 0xEDB88320) one byte at a time from a
/// 256-entry table: the textbook implementation, as the anchor the ICRC is compared with.
struct TableCrc32 {
    table: [u32; 256],
}

impl TableCrc32 {
    fn new() -> TableCrc32 {
        let mut table = [0u32; 256];
        for (i, slot) in table.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0xEDB8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
            *slot = c;
        }
        TableCrc32 { table }
    }

    fn checksum(&self, data: &[u8]) -> u32 {
        let mut c = !0u32;
        for &b in data {
            c = self.table[((c ^ u32::from(b)) & 0xFF) as usize] ^ (c >> 8);
        }
        !c
    }
}

fn icrc_headers() -> IcrcHeaders {
    IcrcHeaders {
        ip: IpPair::V4 {
            src: Ipv4Addr::new(10, 0, 0, 1),
            dst: Ipv4Addr::new(10, 0, 0, 2),
        },
        ipv4_id: 0,
        src_port: 49_152,
        dst_port: ROCE_PORT,
    }
}

/// The headers of a RDMA WRITE FIRST (BTH + RETH), the largest common request header.
fn write_first() -> Headers {
    let mut h = Headers::new(Opcode::WriteFirst, 0x11, Psn::new(0x00AB_CDEF));
    h.reth = Some(reth::Repr {
        va: 0x7F00_1234_5000,
        rkey: 0x1234,
        dma_len: 65_536,
    });
    h
}

/// A complete datagram (UDP payload) with a correct ICRC.
fn datagram(payload: usize) -> Vec<u8> {
    let h = write_first();
    let mut buf = vec![0u8; h.buffer_len(payload).expect("valid headers")];
    let data = vec![0x5Au8; payload];
    let n = emit(
        &mut buf,
        &h,
        &data,
        &icrc_headers(),
        &ChecksumCapabilities::default(),
    )
    .expect("emit");
    buf.truncate(n);
    buf
}

fn headers(c: &mut Criterion) {
    let mut g = c.benchmark_group("header");
    let h = write_first();
    let mut buf = vec![0u8; h.buffer_len(0).expect("valid headers")];
    let no_icrc = ChecksumCapabilities::ignored();
    let ih = icrc_headers();
    g.bench_function("emit BTH+RETH", |b| {
        b.iter(|| emit(black_box(&mut buf), black_box(&h), &[], &ih, &no_icrc).expect("emit"))
    });
    let pkt = datagram(0);
    g.bench_function("parse BTH+RETH", |b| {
        b.iter(|| {
            let view = PacketView::new_checked(black_box(&pkt[..])).expect("valid");
            Headers::parse(&view).expect("valid")
        })
    });
    g.finish();
}

fn checksums(c: &mut Criterion) {
    let mut g = c.benchmark_group("icrc");
    let table = TableCrc32::new();
    // The anchor is the real CRC-32: the standard check value of CRC-32/ISO-HDLC.
    assert_eq!(table.checksum(b"123456789"), 0xCBF4_3926);
    let ih = icrc_headers();
    let mut solver = Ipv4IdSolver::new();
    for &payload in PAYLOADS {
        let pkt = datagram(payload);
        assert!(
            icrc::verify(&ih, &pkt),
            "the datagram carries a correct ICRC"
        );
        let covered = &pkt[..pkt.len() - 4];
        // The ICRC covers 36 bytes of pseudo headers plus the datagram; the anchor hashes the
        // same number of bytes.
        let anchor_input = vec![0xA5u8; 36 + covered.len()];
        g.throughput(Throughput::Bytes(anchor_input.len() as u64));
        g.bench_with_input(BenchmarkId::new("icrc compute", payload), &pkt, |b, _| {
            b.iter(|| icrc::compute(black_box(&ih), black_box(covered)))
        });
        g.bench_with_input(
            BenchmarkId::new("table CRC-32 (anchor)", payload),
            &anchor_input,
            |b, input| b.iter(|| table.checksum(black_box(input))),
        );
        g.bench_with_input(
            BenchmarkId::new("receive: IPv4 id solve", payload),
            &pkt,
            |b, pkt| {
                b.iter(|| {
                    solver.solve(
                        Ipv4Addr::new(10, 0, 0, 1),
                        Ipv4Addr::new(10, 0, 0, 2),
                        49_152,
                        ROCE_PORT,
                        black_box(pkt),
                    )
                })
            },
        );
    }
    g.finish();
}

criterion_group!(benches, headers, checksums);
criterion_main!(benches);
