//! A whole datagram: the checked view and header parse of arbitrary bytes never panic; a parsed
//! datagram re-emits to the same headers and payload; the ICRC that `emit` fills verifies, and a
//! changed covered byte fails it; the device-level receive checks never panic.

#![no_main]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use erdma::soft::proto::{RxMeta, validate};
use erdma::soft::wire::{
    ChecksumCapabilities, Headers, IcrcHeaders, IpPair, Ipv4IdSolver, PacketView, icrc, packet,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    if input.len() < 14 {
        return;
    }
    let (hdr, datagram) = input.split_at(14);
    let v6 = hdr[0] & 1 == 1;
    let src4 = Ipv4Addr::new(hdr[1], hdr[2], hdr[3], hdr[4]);
    let dst4 = Ipv4Addr::new(hdr[5], hdr[6], hdr[7], hdr[8]);
    let ip = if v6 {
        IpPair::V6 {
            src: src4.to_ipv6_mapped(),
            dst: Ipv6Addr::from(u128::from(u32::from(dst4)) << 64 | 1),
        }
    } else {
        IpPair::V4 {
            src: src4,
            dst: dst4,
        }
    };
    let ih = IcrcHeaders {
        ip,
        ipv4_id: u16::from_be_bytes([hdr[9], hdr[10]]),
        src_port: u16::from_be_bytes([hdr[11], hdr[12]]),
        dst_port: 4791,
    };

    // ICRC arithmetic on arbitrary bytes: never panics, and agrees with itself.
    if let Some(carried) = icrc::read(datagram) {
        let covered = &datagram[..datagram.len() - 4];
        assert_eq!(
            icrc::verify(&ih, datagram),
            icrc::compute(&ih, covered) == carried
        );
    }

    // Device-level checks, with and without a known IPv4 identification.
    let meta = RxMeta {
        src: ip.src(),
        src_port: ih.src_port,
        dst: ip.dst(),
        dst_port: 4791,
        ipv4_id: (hdr[13] & 1 == 1).then_some(ih.ipv4_id),
    };
    let mut solver = Ipv4IdSolver::new();
    let _ = validate(
        datagram,
        &meta,
        &ChecksumCapabilities::default(),
        &mut solver,
    );
    let _ = validate(
        datagram,
        &RxMeta {
            src: IpAddr::V4(src4),
            dst: IpAddr::V6(Ipv6Addr::LOCALHOST),
            ..meta
        },
        &ChecksumCapabilities::default(),
        &mut solver,
    );

    let Ok(view) = PacketView::new_checked(datagram) else {
        return;
    };
    assert_eq!(view.len(), datagram.len());
    assert!(view.header_len() + view.payload().len() + view.pad().len() + 4 == view.len());
    let Ok(h) = Headers::parse(&view) else {
        assert_ne!(view.tver(), 0);
        return;
    };
    // Re-emit: same headers and payload; the pad is recomputed from the payload length, so the
    // lengths agree exactly when the sender padded as the standard says.
    let payload = view.payload();
    let mut buf = vec![
        0u8;
        h.buffer_len(payload.len())
            .expect("parsed headers re-layout")
    ];
    let n = packet::emit(&mut buf, &h, payload, &ih, &ChecksumCapabilities::default())
        .expect("parsed headers re-emit");
    assert_eq!(n, buf.len());
    let again = PacketView::new_checked(&buf[..n]).expect("emitted datagram parses");
    assert_eq!(Headers::parse(&again), Ok(h));
    assert_eq!(again.payload(), payload);
    if usize::from(view.pad_count()) == packet::pad_for(payload.len()) {
        assert_eq!(n, datagram.len());
    }
    assert!(icrc::verify(&ih, &buf[..n]), "a filled ICRC verifies");
    // Flip a bit of the last covered byte (never BTH byte 4, which the ICRC masks: a datagram
    // is at least BTH + ICRC = 16 bytes, so n - 5 >= 11).
    let at = n - 5;
    buf[at] ^= 0x01;
    assert!(
        !icrc::verify(&ih, &buf[..n]),
        "a changed byte fails the ICRC"
    );
});
