//! Tests of the C tools' exchanges: golden bytes, malformed messages, bounded failures.

use super::perftest::{BwReport, Keys, Role, Session};
use super::rc_pingpong::Dest;
use super::*;
use crate::connect::{Listener, dial};
use crate::vocab::Mtu;
use std::io::Write;

fn gid() -> Gid {
    "::ffff:192.168.1.10".parse().unwrap()
}

#[test]
fn rc_pingpong_message_golden_bytes() {
    let d = Dest {
        lid: 0,
        qpn: 0x11,
        psn: 0xa3f21c,
        gid: gid(),
    };
    let m = d.encode().unwrap();
    assert_eq!(
        &m[..],
        &b"0000:000011:a3f21c:00000000000000000000ffffc0a8010a\0"[..]
    );
    assert_eq!(Dest::decode(&m).unwrap(), d);
    // Uppercase hex (sscanf accepts it) is accepted too.
    let upper = m.to_ascii_uppercase();
    assert_eq!(Dest::decode(&upper).unwrap(), d);
}

#[test]
fn rc_pingpong_malformed_messages() {
    let good = Dest {
        lid: 0,
        qpn: 0x11,
        psn: 0x1,
        gid: gid(),
    }
    .encode()
    .unwrap();
    let err = |m: &[u8]| Dest::decode(m).unwrap_err().to_string();
    for cut in [0, 1, 20, 51] {
        assert!(
            err(&good[..cut]).contains("expected exactly 52"),
            "cut {cut}"
        );
    }
    let mut long = good.to_vec();
    long.push(0);
    assert!(err(&long).contains("53 bytes"));
    let mut bad = good;
    bad[4] = b'-';
    assert!(err(&bad).contains("after `lid`"));
    let mut bad = good;
    bad[7] = b'g';
    assert!(err(&bad).contains("`qpn`"));
    let mut bad = good;
    bad[13] = b' ';
    assert!(err(&bad).contains("`psn`"));
    let mut bad = good;
    bad[40] = b'z';
    assert!(err(&bad).contains("`gid`"));
    let mut bad = good;
    bad[51] = b'0';
    assert!(err(&bad).contains("NUL"));
    assert!(
        Dest {
            lid: 0,
            qpn: 1 << 24,
            psn: 0,
            gid: gid()
        }
        .encode()
        .is_err()
    );
}

fn keys() -> Keys {
    Keys {
        lid: 0,
        out_reads: 1,
        qpn: 0x11,
        psn: 0x5b1d3e,
        rkey: 0x1234,
        vaddr: 0x7f12_a4c0_1000,
        gid: gid(),
        srqn: 0,
    }
}

#[test]
fn perftest_keys_golden_bytes() {
    let m = keys().encode().unwrap();
    let want = b"0000:0001:000011:5b1d3e:00001234:00007f12a4c01000:00:00:00:00:00:00:00:00:00:00:ff:ff:c0:a8:01:0a:00000000:\0";
    assert_eq!(want.len(), perftest::KEYS_LEN);
    assert_eq!(&m[..], &want[..]);
    assert_eq!(Keys::decode(&m).unwrap(), keys());
}

#[test]
fn perftest_struct_keys_golden_bytes() {
    let k = Keys { srqn: 9, ..keys() };
    let b = k.encode_struct();
    // struct pingpong_dest on x86-64, big-endian integers, padding before vaddr.
    assert_eq!(&b[0..4], &u32::from(k.lid).to_be_bytes());
    assert_eq!(&b[8..12], &k.qpn.to_be_bytes());
    assert_eq!(&b[20..24], &[0; 4]);
    assert_eq!(&b[24..32], &k.vaddr.to_be_bytes());
    assert_eq!(&b[32..48], &k.gid.0);
    assert_eq!(&b[48..52], &9u32.to_be_bytes());
    assert_eq!(Keys::decode_struct(&b).unwrap(), Keys { srqn: 0, ..k });
    assert!(Keys::decode_struct(&b[..55]).is_err());
    let mut wide = b;
    wide[0] = 1; // lid of 0x0100_0000
    assert!(Keys::decode_struct(&wide).is_err());
    let mut qpn = b;
    qpn[8] = 1; // QPN past 24 bits
    assert!(Keys::decode_struct(&qpn).is_err());
}

#[test]
fn perftest_malformed_messages() {
    let good = keys().encode().unwrap();
    let err = |m: &[u8]| Keys::decode(m).unwrap_err().to_string();
    for cut in [0, 59, 107] {
        assert!(err(&good[..cut]).contains("expected exactly 108"));
    }
    let mut bad = good;
    bad[9] = b'x';
    assert!(err(&bad).contains("after `out_reads`"), "{}", err(&bad));
    let mut bad = good;
    bad[30] = b'q';
    assert!(err(&bad).contains("`rkey`"));
    let mut bad = good;
    bad[40] = b'-';
    assert!(err(&bad).contains("`vaddr`"));
    let mut bad = good;
    bad[F_GID_PROBE] = b'k';
    assert!(err(&bad).contains("`gid`"));
    let mut bad = good;
    bad[100] = b'!';
    assert!(err(&bad).contains("`srqn`"));
    let mut bad = good;
    bad[107] = b'1';
    assert!(err(&bad).contains("NUL"));

    assert_eq!(
        perftest::decode_version(&perftest::encode_version("6.06")).unwrap(),
        "6.06"
    );
    let old = perftest::decode_version(&perftest::encode_version("5.60")).unwrap_err();
    assert!(old.to_string().contains("older than 5.70"), "{old}");
    let junk = perftest::decode_version(&perftest::encode_version("v6")).unwrap_err();
    assert!(junk.to_string().contains("not a version"), "{junk}");
    assert!(perftest::decode_version(&[b'6'; 16]).is_err());
    assert!(perftest::decode_version(&[0; 15]).is_err());

    assert_eq!(perftest::decode_mtu(b"3\0").unwrap(), Mtu::Mtu1024);
    assert_eq!(perftest::encode_mtu(Mtu::Mtu4096), *b"5\0");
    for bad in [&b"6\0"[..], b"0\0", b"3x", b"3", b"30\0"] {
        assert!(perftest::decode_mtu(bad).is_err(), "{bad:?}");
    }
}
const F_GID_PROBE: usize = 50 + 3 * 7;

#[test]
fn perftest_session_both_roles() {
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = Duration::from_secs(5);
    let server = std::thread::spawn(move || {
        let (s, _) = l.accept(t).unwrap();
        let mut s = Session::new(s, Role::Server, t);
        let setup = s.setup(Mtu::Mtu4096).unwrap();
        let mut mine = keys();
        mine.qpn = 0x22;
        let theirs = s.hand_shake(&mine).unwrap();
        let rep = s.xchg_bw_report(&BwReport::default()).unwrap();
        s.close(&mine).unwrap();
        (setup, theirs, rep)
    });
    let c = dial(addr, t).unwrap();
    let mut c = Session::new(c, Role::Client, t);
    let setup = c.setup(Mtu::Mtu1024).unwrap();
    assert_eq!(setup.mtu, Mtu::Mtu1024);
    assert_eq!(setup.remote_version, "6.06");
    assert_eq!(setup.cycle_buffer, 4096);
    let theirs = c.hand_shake(&keys()).unwrap();
    assert_eq!(theirs.qpn, 0x22);
    let rep = BwReport {
        size: 65536,
        iters: 5000,
        bw_peak: 1000.5,
        bw_avg: 900.25,
        msg_rate: 0.0144,
    };
    assert_eq!(c.xchg_bw_report(&rep).unwrap(), BwReport::default());
    c.close(&keys()).unwrap();
    let (s_setup, s_theirs, s_rep) = server.join().unwrap();
    assert_eq!(s_setup.mtu, Mtu::Mtu1024);
    assert_eq!(s_theirs, keys());
    assert_eq!(s_rep, rep);
}

/// A fake peer that sends `bytes` and then closes (or goes silent with `hold`).
fn fake_peer(bytes: Vec<u8>, hold: Duration) -> std::net::SocketAddr {
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        if let Ok((mut s, _)) = l.accept(Duration::from_secs(5)) {
            let _ = s.write_all(&bytes);
            std::thread::sleep(hold);
        }
    });
    addr
}

#[test]
fn bad_peers_fail_in_bounded_time() {
    let t = Duration::from_millis(500);
    // perftest: a peer claiming an old version.
    let addr = fake_peer(perftest::encode_version("5.10").to_vec(), Duration::ZERO);
    let mut c = Session::new(dial(addr, t).unwrap(), Role::Client, t);
    let e = c.setup(Mtu::Mtu1024).unwrap_err();
    assert!(e.to_string().contains("older than"), "{e}");
    // perftest: a peer that stops half-way through its version.
    let addr = fake_peer(b"6.0".to_vec(), Duration::ZERO);
    let mut c = Session::new(dial(addr, t).unwrap(), Role::Client, t);
    let e = c.setup(Mtu::Mtu1024).unwrap_err();
    assert!(matches!(e, Error::Protocol { .. }), "{e}");
    // perftest: an MTU of 7.
    let mut msg = perftest::encode_version("6.06").to_vec();
    msg.extend_from_slice(&4096i32.to_be_bytes());
    msg.extend_from_slice(&64i32.to_be_bytes());
    msg.extend_from_slice(b"7\0");
    let addr = fake_peer(msg, Duration::from_millis(200));
    let mut c = Session::new(dial(addr, t).unwrap(), Role::Client, t);
    let e = c.setup(Mtu::Mtu1024).unwrap_err();
    assert!(e.to_string().contains("MTU"), "{e}");
    // perftest: a silent peer times out.
    let addr = fake_peer(Vec::new(), Duration::from_secs(2));
    let mut c = Session::new(dial(addr, t).unwrap(), Role::Client, t);
    let t0 = std::time::Instant::now();
    let e = c.setup(Mtu::Mtu1024).unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(2));
    // rc_pingpong: a truncated reply, then a wrong closing word.
    let local = Dest {
        lid: 0,
        qpn: 5,
        psn: 6,
        gid: gid(),
    };
    let addr = fake_peer(local.encode().unwrap()[..30].to_vec(), Duration::ZERO);
    let mut s = dial(addr, t).unwrap();
    let e = rc_pingpong::client_exchange(&mut s, &local, t).unwrap_err();
    assert!(e.to_string().contains("30 of 52"), "{e}");
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let client = std::thread::spawn(move || {
        let mut s = dial(addr, t).unwrap();
        s.write_all(&local.encode().unwrap()).unwrap();
        let mut reply = [0u8; 52];
        std::io::Read::read_exact(&mut s, &mut reply).unwrap();
        s.write_all(b"nope\0").unwrap();
    });
    let (mut s, _) = l.accept(t).unwrap();
    let mut armed = false;
    let e = rc_pingpong::server_exchange(&mut s, &local, t, |d| {
        armed = d.qpn == 5;
        Ok(())
    })
    .unwrap_err();
    assert!(armed);
    assert!(e.to_string().contains("done"), "{e}");
    client.join().unwrap();
}
