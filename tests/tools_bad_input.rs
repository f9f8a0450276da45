//! The tools given bad input: unknown devices, unreachable peers, bad soft-device settings, and
//! hostile peers in each out-of-band format; each ends in a clear error and a non-zero exit within
//! a bounded time.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use erdma::connect::compat::{perftest, rc_pingpong};

mod tools_support;
use tools_support::*;

#[test]
fn unknown_device_and_unreachable_peer() {
    let _serial = serial();
    for tool in ["write_bw", "rc_pingpong", "devinfo"] {
        let out = run(tool, &["-d", "mlx9_nope"], Duration::from_secs(20));
        assert_eq!(out.status.code(), Some(1), "{tool}");
        assert!(
            text(&out.stderr).contains("no RDMA device named `mlx9_nope`"),
            "{tool}: {}",
            text(&out.stderr)
        );
    }
    // Loopback opens both devices before either side waits for the other: the device that
    // cannot open is what fails, at once. A message above the device's largest fails before
    // anything is allocated.
    let t0 = Instant::now();
    for (tool, args, why) in [
        (
            "write_bw",
            &["--loopback", "--peer-dev", "mlx9_nope"][..],
            "mlx9_nope",
        ),
        (
            "rc_pingpong",
            &["--loopback", "--peer-dev", "mlx9_nope"][..],
            "mlx9_nope",
        ),
        (
            "write_bw",
            &["--loopback", "-s", "2147483649"][..],
            "max_msg_sz",
        ),
        (
            "rc_pingpong",
            &["--loopback", "-s", "2147483649"][..],
            "max_msg_sz",
        ),
    ] {
        let out = run(tool, args, Duration::from_secs(20));
        assert_eq!(out.status.code(), Some(1), "{tool} {args:?}");
        assert!(
            text(&out.stderr).contains(why),
            "{tool}: {}",
            text(&out.stderr)
        );
    }
    assert!(t0.elapsed() < Duration::from_secs(10));
    let port = unused_port().to_string();
    let t0 = Instant::now();
    let out = run(
        "send_lat",
        &["-d", DEV_A, "-p", &port, "--timeout", "2", "127.0.0.1"],
        Duration::from_secs(20),
    );
    assert_eq!(out.status.code(), Some(1));
    let e = text(&out.stderr);
    assert!(e.contains("timed out") && e.contains(&port), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(10));
}

/// A bad engine count or transmit mode fails the device's opening with a message naming the
/// variable and the value; the tool exits 1, at once.
#[test]
fn bad_soft_engine_settings_name_the_variable() {
    let _serial = serial();
    for (var, value, expect) in [
        (
            "ERDMA_SOFT_ENGINES",
            "0",
            "expected a number of engines from 1 to 64",
        ),
        (
            "ERDMA_SOFT_ENGINES",
            "lots",
            "expected a number of engines from 1 to 64",
        ),
        ("ERDMA_SOFT_TX", "sideways", "expected `lane` or `inline`"),
        (
            "ERDMA_SOFT_SAME_HOST",
            "pipe",
            "expected `cma`, `shm` or `off`",
        ),
    ] {
        let child = Command::new(tool_path("write_bw"))
            .args(["--loopback", "-n", "10"])
            .env(var, value)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting write_bw");
        let out = finish("write_bw", child, Duration::from_secs(20));
        let e = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{var}={value}: {e}");
        assert!(
            e.contains(var) && e.contains(value) && e.contains(expect),
            "{var}={value}: {e}"
        );
    }
}

/// A fake server: accepts one client, then runs `script` on the connection.
fn fake_server(script: impl FnOnce(TcpStream) + Send + 'static) -> String {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        if let Ok((s, _)) = l.accept() {
            s.set_read_timeout(Some(Duration::from_secs(10))).ok();
            script(s);
        }
    });
    port.to_string()
}

fn read_n(s: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    let _ = s.read_exact(&mut b);
    b
}

/// Runs `tool` as a client of a fake server and returns its stderr, checking it failed in
/// bounded time.
fn client_against(tool: &str, extra: &[&str], port: &str) -> String {
    let mut args = vec!["-d", DEV_A, "-p", port, "--timeout", "3"];
    args.extend_from_slice(extra);
    args.push("127.0.0.1");
    let t0 = Instant::now();
    let out = run(tool, &args, Duration::from_secs(30));
    assert_eq!(
        out.status.code(),
        Some(1),
        "{tool} {extra:?}: {}",
        text(&out.stderr)
    );
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "{tool} took {:?}",
        t0.elapsed()
    );
    text(&out.stderr)
}

/// A valid perftest setup from the server's side (reads first), returning the stream.
fn perftest_setup(s: &mut TcpStream, mtu: &[u8; 2]) {
    perftest_setup_cycle(s, 4096, mtu);
}

/// As [`perftest_setup`], claiming a cycle buffer of `cycle` bytes.
fn perftest_setup_cycle(s: &mut TcpStream, cycle: i32, mtu: &[u8; 2]) {
    read_n(s, 16);
    s.write_all(&perftest::encode_version("6.06")).ok();
    read_n(s, 4);
    s.write_all(&cycle.to_be_bytes()).ok();
    read_n(s, 4);
    s.write_all(&64i32.to_be_bytes()).ok();
    read_n(s, 2);
    s.write_all(mtu).ok();
}

#[test]
fn hostile_peers_in_every_format() {
    let _serial = serial();
    // perftest: an old version.
    let port = fake_server(|mut s| {
        read_n(&mut s, 16);
        s.write_all(&perftest::encode_version("5.10")).ok();
    });
    let e = client_against("write_bw", &[], &port);
    assert!(e.contains("older than 5.70"), "{e}");
    // perftest: disconnects half-way through its version.
    let port = fake_server(|mut s| {
        read_n(&mut s, 16);
        s.write_all(b"6.0").ok();
    });
    let e = client_against("send_lat", &[], &port);
    assert!(e.contains("peer closed") && e.contains("3 of 16"), "{e}");
    // perftest: a cycle buffer of 1 MiB, above the 64 KiB a page can be (each queue pair's
    // areas would have to span it).
    let port = fake_server(|mut s| perftest_setup_cycle(&mut s, 1 << 20, b"3\0"));
    let e = client_against("write_bw", &[], &port);
    assert!(e.contains("cycle buffer of 1048576 bytes"), "{e}");
    // perftest: an MTU code that does not exist.
    let port = fake_server(|mut s| perftest_setup(&mut s, b"9\0"));
    let e = client_against("write_bw", &[], &port);
    assert!(e.contains("MTU message"), "{e}");
    // perftest: malformed keys (a bad rkey field), then truncated keys.
    let port = fake_server(|mut s| {
        perftest_setup(&mut s, b"3\0");
        read_n(&mut s, 108);
        let mut k = [b'0'; 108];
        k[107] = 0;
        for at in [4, 9, 16, 23, 32, 49, 97, 106] {
            k[at] = b':';
        }
        for g in 0..16 {
            k[50 + 3 * g + 2] = b':';
        }
        k[26] = b'z';
        s.write_all(&k).ok();
    });
    let e = client_against("write_bw", &[], &port);
    assert!(e.contains("field `rkey`"), "{e}");
    let port = fake_server(|mut s| {
        perftest_setup(&mut s, b"3\0");
        read_n(&mut s, 108);
        s.write_all(&[b'0'; 50]).ok();
    });
    let e = client_against("send_lat", &[], &port);
    assert!(e.contains("50 of 108"), "{e}");
    // perftest: a peer that connects and never speaks.
    let port = fake_server(|s| {
        std::thread::sleep(Duration::from_secs(8));
        drop(s);
    });
    let e = client_against("write_bw", &[], &port);
    assert!(e.contains("timed out"), "{e}");

    // The project's format: garbage, and a different tool.
    let port = fake_server(|mut s| {
        s.write_all(b"HELLO, THIS IS NOT IT").ok();
        read_n(&mut s, 64);
    });
    let e = client_against("write_bw", &["--oob", "erdma"], &port);
    assert!(
        e.contains("not speaking the erdma connection format"),
        "{e}"
    );
    let server = serve(
        "send_lat",
        &["-d", DEV_B, "--oob", "erdma", "--timeout", "3"],
    );
    let e = client_against("write_bw", &["--oob", "erdma"], &server.port);
    assert!(e.contains("peer runs send_lat"), "{e}");
    let server = server.finish(Duration::from_secs(30));
    assert_eq!(server.status.code(), Some(1));
    assert!(text(&server.stderr).contains("peer runs write_bw"));

    // rc_pingpong: a malformed reply, a truncated one, and a reply with no GID.
    let port = fake_server(|mut s| {
        read_n(&mut s, 52);
        let mut m = *b"0000:000011:a3f21c:00000000000000000000ffffc0a8010a\0";
        m[11] = b'/';
        s.write_all(&m).ok();
    });
    let e = client_against("rc_pingpong", &[], &port);
    assert!(e.contains("after `qpn`"), "{e}");
    let port = fake_server(|mut s| {
        read_n(&mut s, 52);
        s.write_all(b"0000:000011:a3f2").ok();
    });
    let e = client_against("rc_pingpong", &[], &port);
    assert!(e.contains("16 of 52"), "{e}");
    let port = fake_server(|mut s| {
        read_n(&mut s, 52);
        let m = rc_pingpong::Dest {
            lid: 0,
            qpn: 0x11,
            psn: 1,
            gid: erdma::Gid::ZERO,
        };
        s.write_all(&m.encode().expect("encode")).ok();
        read_n(&mut s, 5);
    });
    let e = client_against("rc_pingpong", &[], &port);
    assert!(e.contains("-g/-x <gid index>"), "{e}");

    // A hostile client against a server: garbage instead of rc_pingpong's message.
    let server = serve("rc_pingpong", &["-d", DEV_B, "--timeout", "3"]);
    let port = server.port.parse::<u16>().expect("port");
    let mut c = TcpStream::connect(("127.0.0.1", port)).expect("the server listens");
    c.write_all(&[b'x'; 52]).ok();
    let server = server.finish(Duration::from_secs(20));
    assert_eq!(server.status.code(), Some(1));
    assert!(
        text(&server.stderr).contains("rc_pingpong message"),
        "{}",
        text(&server.stderr)
    );
}
