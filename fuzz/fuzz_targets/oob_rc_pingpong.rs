//! `ibv_rc_pingpong`'s out-of-band exchange (`erdma::connect::compat::rc_pingpong`).
//!
//! The input is what the peer sends, byte for byte (the committed seeds are the streams the C
//! tool writes). Each input is:
//! - decoded as one message (whole input, and its first 52 bytes): never a panic, only a
//!   [`Error::Protocol`]; a message that decodes re-encodes to the same bytes up to the case of
//!   the hex digits (the format has exactly one spelling per value);
//! - fed as the server's reply to [`client_exchange`] and as the client's stream to
//!   [`server_exchange`] over loopback TCP: the outcome is exactly what decoding the same bytes
//!   in the tool's order predicts (the same value or the same error), the server arms its queue
//!   pair only with a valid message, and a short stream is a `Protocol` error, never a hang;
//! - read as arbitrary field values that, where they fit 24 bits, encode and decode back to
//!   themselves (and otherwise are refused by the encoder).

#![no_main]

use std::time::Duration;

use erdma::Error;
use erdma::connect::compat::DONE;
use erdma::connect::compat::rc_pingpong::{Dest, MSG_LEN, client_exchange, server_exchange};
use erdma::Gid;
use erdma_fuzz::FedStream;
use libfuzzer_sys::arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;

/// Generous: the peer has closed its side, so nothing ever waits on this.
const STEP: Duration = Duration::from_secs(10);

fn local() -> Dest {
    Dest {
        lid: 0,
        qpn: 0x12,
        psn: 0x34_5678,
        gid: Gid([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1]),
    }
}

/// Decoding `msg` either fails with a protocol error or yields the value that re-encodes to it.
fn decode_checked(msg: &[u8]) -> Result<Dest, String> {
    match Dest::decode(msg) {
        Ok(d) => {
            let again = d.encode().expect("a decoded message re-encodes");
            assert_eq!(
                &again[..],
                &msg.to_ascii_lowercase()[..],
                "one spelling per value"
            );
            Ok(d)
        }
        Err(e @ Error::Protocol { .. }) => Err(e.to_string()),
        Err(e) => panic!("decode failed with a non-protocol error: {e:?}"),
    }
}

/// A stream that ended early must be reported as the peer closing, as a protocol error.
fn assert_closed_early(e: &Error) {
    assert!(
        matches!(e, Error::Protocol { .. }) && e.to_string().contains("peer closed"),
        "a short stream gave {e:?}"
    );
}

fn client_side(data: &[u8]) {
    let mut fed = FedStream::new(data);
    let got = client_exchange(&mut fed.ours, &local(), STEP);
    match (data.get(..MSG_LEN).map(decode_checked), got) {
        (None, Err(e)) => assert_closed_early(&e),
        (Some(Ok(want)), Ok(d)) => assert_eq!(d, want),
        (Some(Err(want)), Err(e)) => assert_eq!(e.to_string(), want),
        (want, got) => panic!("client: expected {want:?}, got {got:?}"),
    }
}

fn server_side(data: &[u8]) {
    let mut fed = FedStream::new(data);
    let mut armed = None;
    let got = server_exchange(&mut fed.ours, &local(), STEP, |d| {
        armed = Some(*d);
        Ok(())
    });
    let first = data.get(..MSG_LEN).map(decode_checked);
    // The queue pair is armed exactly when the first message is valid, with its contents.
    assert_eq!(armed, first.as_ref().and_then(|r| r.as_ref().ok()).copied());
    match (first, got) {
        (None, Err(e)) => assert_closed_early(&e),
        (Some(Err(want)), Err(e)) => assert_eq!(e.to_string(), want),
        (Some(Ok(want)), got) => match data.get(MSG_LEN..MSG_LEN + DONE.len()) {
            None => assert_closed_early(&got.expect_err("no closing word")),
            Some(word) if word == DONE => assert_eq!(got.expect("a complete exchange"), want),
            Some(_) => {
                let e = got.expect_err("a wrong closing word");
                assert!(
                    matches!(e, Error::Protocol { .. }) && e.to_string().contains("done"),
                    "{e:?}"
                );
            }
        },
        (want, got) => panic!("server: expected {want:?}, got {got:?}"),
    }
}

fn round_trip(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let (Ok(lid), Ok(qpn), Ok(psn), Ok(gid)) = (
        u16::arbitrary(&mut u),
        u32::arbitrary(&mut u),
        u32::arbitrary(&mut u),
        <[u8; 16]>::arbitrary(&mut u),
    ) else {
        return;
    };
    let d = Dest {
        lid,
        qpn,
        psn,
        gid: Gid(gid),
    };
    match d.encode() {
        Ok(msg) => {
            assert!(qpn < 1 << 24 && psn < 1 << 24, "{d:?} encoded");
            assert_eq!(Dest::decode(&msg).expect("own encoding decodes"), d);
        }
        Err(Error::InvalidArgument(_)) => {
            assert!(qpn >= 1 << 24 || psn >= 1 << 24, "{d:?} refused")
        }
        Err(e) => panic!("encode failed with {e:?}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let _ = decode_checked(data);
    client_side(data);
    server_side(data);
    round_trip(data);
});
