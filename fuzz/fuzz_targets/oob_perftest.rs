//! perftest's default out-of-band exchange (`erdma::connect::compat::perftest`), as
//! `ib_write_bw`, `ib_send_lat` and the rest of the suite speak it.
//!
//! The input is what the peer sends over a whole session, byte for byte (the committed seeds are
//! the streams perftest writes): version (16 B), cycle buffer and cache line (4 B each), MTU
//! (2 B), keys (108 B), the five-part bandwidth report (5 × 8 B), the closing keys (108 B). Each
//! input is:
//! - decoded message by message (every decoder on the whole input and on its slice of the
//!   session): never a panic, only an [`Error::Protocol`]; a keys message that decodes
//!   re-encodes to the same bytes up to the case of the hex digits, a version to its text;
//! - run as a whole [`Session`] (setup, keys, report, close) over loopback TCP in both roles:
//!   every step's result is exactly what decoding the same bytes in the tool's order predicts
//!   (the same values, the same error), and a stream that ends early is a `Protocol` error,
//!   never a hang;
//! - read as arbitrary field values and version text that encode and decode back to themselves
//!   where the format can carry them, and are refused otherwise.

#![no_main]

use std::time::Duration;

use erdma::Error;
use erdma::connect::compat::perftest::{
    self, BwReport, CACHE_LINE, CYCLE_BUFFER, KEYS_LEN, Keys, MIN_VERSION, Role, Session, Setup,
    VERSION_LEN,
};
use erdma::{Gid, Mtu};
use erdma_fuzz::FedStream;
use libfuzzer_sys::arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;

/// Generous: the peer has closed its side, so nothing ever waits on this.
const STEP: Duration = Duration::from_secs(10);

fn local_keys() -> Keys {
    Keys {
        lid: 0,
        out_reads: 16,
        qpn: 0x12,
        psn: 0x34_5678,
        rkey: 0x1000_0001,
        vaddr: 0x7f00_0000_1000,
        gid: Gid([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1]),
        srqn: 0,
    }
}

/// A step of the reference reading: the value, the protocol error's text (`None` when only
/// its kind is specified), or the end of the stream.
#[derive(Debug)]
enum Step<T> {
    Value(T),
    Malformed(Option<String>),
    Closed,
}

fn protocol<T>(r: erdma::Result<T>) -> Result<T, Option<String>> {
    match r {
        Ok(v) => Ok(v),
        Err(e @ Error::Protocol { .. }) => Err(Some(e.to_string())),
        Err(e) => panic!("a decoder failed with a non-protocol error: {e:?}"),
    }
}

fn keys_checked(msg: &[u8]) -> Result<Keys, Option<String>> {
    let k = protocol(Keys::decode(msg))?;
    let again = k.encode().expect("decoded keys re-encode");
    assert_eq!(
        &again[..],
        &msg.to_ascii_lowercase()[..],
        "one spelling per value"
    );
    Ok(k)
}

fn version_checked(msg: &[u8]) -> Result<String, Option<String>> {
    let v = protocol(perftest::decode_version(msg))?;
    assert!(v.len() < VERSION_LEN && v.parse::<f64>().unwrap() >= MIN_VERSION);
    assert_eq!(
        perftest::decode_version(&perftest::encode_version(&v)).unwrap(),
        v
    );
    Ok(v)
}

/// perftest's sys data: a big-endian `int` in 1..=max.
fn sys(msg: &[u8], max: u32) -> Result<u32, Option<String>> {
    let v = i32::from_be_bytes(msg.try_into().unwrap());
    if v <= 0 || v as u32 > max {
        return Err(None);
    }
    Ok(v as u32)
}

/// A report figure: a big-endian `double`, finite and not negative.
fn figure(msg: &[u8]) -> Result<f64, Option<String>> {
    let v = f64::from_be_bytes(msg.try_into().unwrap());
    if !v.is_finite() || v < 0.0 {
        return Err(None);
    }
    Ok(v)
}

/// Reads the peer's stream in the session's order.
struct Reference<'a> {
    rest: &'a [u8],
}

impl Reference<'_> {
    fn take<T>(
        &mut self,
        n: usize,
        decode: impl FnOnce(&[u8]) -> Result<T, Option<String>>,
    ) -> Step<T> {
        if self.rest.len() < n {
            return Step::Closed;
        }
        let (msg, rest) = self.rest.split_at(n);
        self.rest = rest;
        match decode(msg) {
            Ok(v) => Step::Value(v),
            Err(e) => Step::Malformed(e),
        }
    }
}

/// Checks one step of the session against the reference; `Some(v)` when both succeeded.
fn agree<T: PartialEq + std::fmt::Debug>(
    what: &str,
    want: Step<T>,
    got: erdma::Result<T>,
) -> Option<T> {
    match (want, got) {
        (Step::Value(w), Ok(g)) => {
            assert_eq!(g, w, "{what}");
            Some(g)
        }
        (Step::Malformed(text), Err(e)) => {
            assert!(matches!(e, Error::Protocol { .. }), "{what}: {e:?}");
            if let Some(text) = text {
                assert_eq!(e.to_string(), text, "{what}");
            }
            None
        }
        (Step::Closed, Err(e)) => {
            assert!(
                matches!(e, Error::Protocol { .. }) && e.to_string().contains("peer closed"),
                "{what}: a short stream gave {e:?}"
            );
            None
        }
        (want, got) => panic!("{what}: expected {want:?}, got {got:?}"),
    }
}

/// Steps the reference through the setup messages, giving what `Session::setup` must return.
fn expected_setup(r: &mut Reference<'_>, local_mtu: Mtu) -> Step<Setup> {
    macro_rules! step {
        ($s:expr) => {
            match $s {
                Step::Value(v) => v,
                Step::Malformed(e) => return Step::Malformed(e),
                Step::Closed => return Step::Closed,
            }
        };
    }
    let remote_version = step!(r.take(VERSION_LEN, version_checked));
    let cycle_buffer = step!(r.take(4, |m| sys(m, 1 << 30))).max(CYCLE_BUFFER);
    let cache_line = step!(r.take(4, |m| sys(m, 1 << 16))).max(CACHE_LINE);
    let mtu = step!(r.take(2, |m| protocol(perftest::decode_mtu(m)))).min(local_mtu);
    Step::Value(Setup {
        remote_version,
        cycle_buffer,
        cache_line,
        mtu,
    })
}

fn expected_report(r: &mut Reference<'_>) -> Step<BwReport> {
    let mut raw = [0u64; 2];
    for v in &mut raw {
        match r.take(8, |m| Ok(u64::from_be_bytes(m.try_into().unwrap()))) {
            Step::Value(x) => *v = x,
            Step::Malformed(e) => return Step::Malformed(e),
            Step::Closed => return Step::Closed,
        }
    }
    // The session reads all five parts before it judges the three figures.
    if r.rest.len() < 24 {
        return Step::Closed;
    }
    let mut figures = [0f64; 3];
    for f in &mut figures {
        match r.take(8, figure) {
            Step::Value(x) => *f = x,
            Step::Malformed(e) => return Step::Malformed(e),
            Step::Closed => unreachable!("length checked"),
        }
    }
    Step::Value(BwReport {
        size: raw[0],
        iters: raw[1],
        bw_peak: figures[0],
        bw_avg: figures[1],
        msg_rate: figures[2],
    })
}

fn session(data: &[u8], role: Role, local_mtu: Mtu) {
    let fed = FedStream::new(data);
    // Dropped before `fed`, whose reset then closes the connection.
    let mut s = Session::new(fed.ours.try_clone().expect("clone"), role, STEP);
    let mut r = Reference { rest: data };
    let mine = local_keys();
    if agree(
        "setup",
        expected_setup(&mut r, local_mtu),
        s.setup(local_mtu),
    )
    .is_none()
    {
        return;
    }
    if agree("keys", r.take(KEYS_LEN, keys_checked), s.hand_shake(&mine)).is_none() {
        return;
    }
    let report = BwReport {
        size: 65536,
        iters: 5000,
        bw_peak: 1.5,
        bw_avg: 1.25,
        msg_rate: 0.002,
    };
    if agree("report", expected_report(&mut r), s.xchg_bw_report(&report)).is_none() {
        return;
    }
    let want = match r.take(KEYS_LEN, keys_checked) {
        Step::Value(_) => Step::Value(()),
        Step::Malformed(e) => Step::Malformed(e),
        Step::Closed => Step::Closed,
    };
    agree("close", want, s.close(&mine));
}

fn round_trip(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok((lid, out_reads, qpn, psn, rkey, vaddr, gid, srqn)) =
        <(u16, u16, u32, u32, u32, u64, [u8; 16], u32)>::arbitrary(&mut u)
    else {
        return;
    };
    let k = Keys {
        lid,
        out_reads,
        qpn,
        psn,
        rkey,
        vaddr,
        gid: Gid(gid),
        srqn,
    };
    match k.encode() {
        Ok(msg) => {
            assert!(qpn < 1 << 24 && psn < 1 << 24, "{k:?} encoded");
            assert_eq!(Keys::decode(&msg).expect("own encoding decodes"), k);
        }
        Err(Error::InvalidArgument(_)) => {
            assert!(qpn >= 1 << 24 || psn >= 1 << 24, "{k:?} refused")
        }
        Err(e) => panic!("encode failed with {e:?}"),
    }
    if let Ok(text) = <&str>::arbitrary(&mut u) {
        // Whatever is encoded decodes to the text itself (cut at 15 bytes) or is refused, and
        // a version number perftest accepts is never refused.
        let got = perftest::decode_version(&perftest::encode_version(text));
        if let Ok(v) = &got {
            assert!(text.starts_with(v.as_str()), "{text:?} came back as {v:?}");
        }
        let acceptable = !text.is_empty()
            && text.len() < VERSION_LEN
            && text.bytes().all(|b| b.is_ascii_digit() || b == b'.')
            && text.parse::<f64>().is_ok_and(|v| v >= MIN_VERSION);
        if acceptable {
            assert_eq!(got.expect("an acceptable version"), text);
        }
    }
    for m in Mtu::ALL {
        assert_eq!(perftest::decode_mtu(&perftest::encode_mtu(m)).unwrap(), m);
    }
}

fuzz_target!(|data: &[u8]| {
    // Each decoder on the whole input (the length check included).
    let _ = keys_checked(data);
    let _ = version_checked(data);
    let _ = protocol(perftest::decode_mtu(data));
    // Both roles, with the smaller MTU on either side.
    session(data, Role::Client, Mtu::Mtu4096);
    session(data, Role::Server, Mtu::Mtu1024);
    round_trip(data);
});
