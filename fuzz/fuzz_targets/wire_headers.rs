//! Every fixed RoCEv2 header view: a checked view of arbitrary bytes never panics, and
//! parse → emit → parse is the identity on the fields the header carries.

#![no_main]

use erdma::soft::wire::{aeth, atomic_ack_eth, atomic_eth, bth, ieth, immdt, reth};
use libfuzzer_sys::fuzz_target;

/// Parses `data` as one header, re-emits it into a fresh buffer and checks the round trip.
macro_rules! round_trip {
    ($m:ident, $data:expr) => {{
        let data: &[u8] = $data;
        match $m::Packet::new_checked(data) {
            Ok(view) => {
                assert!(data.len() >= $m::HEADER_LEN);
                let repr = $m::Repr::parse(&view);
                let mut out = [0u8; $m::HEADER_LEN];
                repr.emit(&mut $m::Packet::new_unchecked(&mut out[..]));
                let again = $m::Repr::parse(&$m::Packet::new_checked(&out[..]).unwrap());
                assert_eq!(repr, again, concat!(stringify!($m), " round trip"));
            }
            Err(_) => assert!(data.len() < $m::HEADER_LEN),
        }
    }};
}

fuzz_target!(|data: &[u8]| {
    round_trip!(reth, data);
    round_trip!(aeth, data);
    round_trip!(atomic_eth, data);
    round_trip!(atomic_ack_eth, data);
    round_trip!(immdt, data);
    round_trip!(ieth, data);

    // The BTH refuses TVer != 0 at parse; everything else round-trips, including the raw
    // opcode byte (unknown values are values, not errors).
    if let Ok(view) = bth::Packet::new_checked(data) {
        match bth::Repr::parse(&view) {
            Ok(repr) => {
                let mut out = [0u8; bth::HEADER_LEN];
                repr.emit(&mut bth::Packet::new_unchecked(&mut out[..]));
                let again = bth::Repr::parse(&bth::Packet::new_checked(&out[..]).unwrap());
                assert_eq!(Ok(repr), again, "bth round trip");
                assert_eq!(out[0], data[0], "opcode byte kept");
                assert_eq!(out[5..8], data[5..8], "destination QPN kept");
            }
            Err(_) => assert_ne!(view.tver(), 0),
        }
    } else {
        assert!(data.len() < bth::HEADER_LEN);
    }
});
