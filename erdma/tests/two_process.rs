//! Two processes connect through the project's out-of-band exchange and run every opcode.
//!
//! The test spawns its own binary as the server process (the `#[ignore]`d `server_process`
//! entry point, selected by environment), exchanges queue-pair endpoints and regions with
//! `erdma::connect` over TCP, then drives SEND (+imm, inline), WRITE (+imm), READ and atomics
//! across sizes, and checks every byte on both sides. A second test checks that a receiver
//! exiting the moment it has its data still leaves the sender a successful completion.
//!
//! Devices: fresh soft devices by default; `ERDMA_TEST_DEV_A` / `ERDMA_TEST_DEV_B` choose others
//! (both `rxe0` in the test guest: two processes on one kernel device).
//!
//! The two roles also run on their own, on two machines (`scripts/interop-rxe` runs one on the
//! host's soft device and the other on rxe in a guest): `server_process` with
//! `ERDMA_TWO_PROCESS_DEVICE` and `ERDMA_TWO_PROCESS_LISTEN=<ip:port>`, `client_process` with
//! `ERDMA_TWO_PROCESS_DEVICE` and `ERDMA_TWO_PROCESS_PEER=<ip:port>`.

mod common;

use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use erdma::connect::{self, Listener, PeerInfo};
use erdma::{
    Access, ConnectOptions, Context, Cq, InitOptions, Pd, Qp, QpConfig, RecvWr, RemoteMr, SendWr,
    WcOpcode, WcStatus, scope,
};

const SIZES: &[usize] = &[0, 1, 1023, 1024, 1025, 4097, 65536 + 13, 1 << 20];
const REGION: usize = 4 << 20;
const TIMEOUT: Duration = Duration::from_secs(60);

/// The server: receives into its region, answers each message with an acknowledgement SEND,
/// and lets the client WRITE/READ/atomically update its region.
#[test]
#[ignore = "entry point of the child process spawned by `two_processes_run_every_opcode`"]
fn server_process() {
    let (Ok(dev), Ok(listen)) = (
        std::env::var("ERDMA_TWO_PROCESS_DEVICE"),
        std::env::var("ERDMA_TWO_PROCESS_LISTEN"),
    ) else {
        panic!("server_process needs ERDMA_TWO_PROCESS_DEVICE and ERDMA_TWO_PROCESS_LISTEN");
    };
    let ctx = Context::open(&dev).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256).unwrap();
    let mut mr = pd.alloc(REGION, Access::ALL).unwrap();
    let listener = Listener::bind(listen.as_str()).unwrap();
    let (mut stream, _) = listener.accept(TIMEOUT).unwrap();
    let (qp, _) = connected(&pd, &cq, &mut stream, vec![mr.remote()]);
    // Phase 1: receive each size, echo it back.
    for &len in SIZES {
        scope(|s| {
            s.post_recv(&qp, RecvWr::new(len as u64, mr.slice_mut(..REGION / 2)))
                .unwrap();
            let got = cq.wait_one(TIMEOUT).unwrap();
            assert_eq!(got.status, WcStatus::Success, "{got:?}");
            assert_eq!(got.byte_len as usize, len);
        });
        scope(|s| {
            let echo = [mr.slice(..len)];
            s.post_send(&qp, SendWr::send(len as u64, &echo).with_imm(len as u32))
                .unwrap();
            let c = cq.wait_one(TIMEOUT).unwrap();
            assert!(c.status.is_success(), "{c:?}");
        });
    }
    // Phase 2: the client WRITEs/READs/atomics on our region and finishes with a
    // WRITE_WITH_IMM whose immediate is a checksum of what it wrote.
    scope(|s| {
        s.post_recv(&qp, RecvWr::empty(7)).unwrap();
        let c = cq.wait_one(TIMEOUT).unwrap();
        assert_eq!(
            (c.status, c.opcode),
            (WcStatus::Success, WcOpcode::RecvRdmaWithImm)
        );
        let sum = checksum(&mr.to_vec(REGION / 2..REGION / 2 + (1 << 20)));
        assert_eq!(c.imm, Some(sum), "bytes written by the peer");
        // Tell the client we checked.
        s.post_send(&qp, SendWr::send_inline(8, b"ok")).unwrap();
        let c = cq.wait_one(TIMEOUT).unwrap();
        assert!(c.status.is_success(), "{c:?}");
    });
    // Our last request is acknowledged: say so, so the client keeps its queue pair until then
    // (destroyed earlier, a lost acknowledgement of the "ok" would leave this side retrying to
    // nobody). Then wait until the client has closed its end, so nothing is in flight when we
    // tear down.
    connect::write_all_by(
        &mut stream,
        b"d",
        std::time::Instant::now() + TIMEOUT,
        "the last word",
    )
    .unwrap();
    let mut byte = [0u8; 1];
    let _ = connect::read_exact_by(
        &mut stream,
        &mut byte,
        std::time::Instant::now() + TIMEOUT,
        "the close",
    );
    print_reference_counters("server", &ctx);
}

/// With `ERDMA_TWO_PROCESS_COUNTERS` set, prints the port's same-host reference counters as
/// `<role> <name>=<value>` lines (read by [`two_processes_move_payloads_by_reference`]).
fn print_reference_counters(role: &str, ctx: &Context) {
    if std::env::var_os("ERDMA_TWO_PROCESS_COUNTERS").is_none() {
        return;
    }
    let c = ctx.port_counters(1).unwrap();
    for name in [
        "peer_ref_sent_pkts",
        "peer_ref_rcvd_pkts",
        "drop_peer_ref_refused",
        "ring_sent_pkts",
        "ring_rcvd_pkts",
    ] {
        println!("{role} {name}={}", c.get(name).unwrap_or(0));
    }
}

/// A queue pair on `cq` (every access), connected to the peer at the other end of `stream`
/// through the out-of-band exchange, offering it `regions`; and what the peer offered.
fn connected(pd: &Pd, cq: &Cq, stream: &mut TcpStream, regions: Vec<RemoteMr>) -> (Qp, PeerInfo) {
    let qp = pd
        .create_qp(&QpConfig::new(cq))
        .unwrap()
        .init(&InitOptions {
            access: Access::ALL,
            ..InitOptions::default()
        })
        .unwrap();
    let local = PeerInfo {
        endpoints: vec![qp.endpoint().unwrap()],
        regions,
        user: Vec::new(),
    };
    let peer = connect::exchange(stream, &local, TIMEOUT).unwrap();
    let qp = qp
        .connect(&peer.endpoints[0], &ConnectOptions::default())
        .unwrap();
    (qp, peer)
}

fn checksum(data: &[u8]) -> u32 {
    data.iter().fold(0x811c_9dc5u32, |h, &b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    })
}

#[test]
#[ignore = "entry point of the client role when the roles run on two machines"]
fn client_process() {
    let (Ok(dev), Ok(peer)) = (
        std::env::var("ERDMA_TWO_PROCESS_DEVICE"),
        std::env::var("ERDMA_TWO_PROCESS_PEER"),
    ) else {
        panic!("client_process needs ERDMA_TWO_PROCESS_DEVICE and ERDMA_TWO_PROCESS_PEER");
    };
    client(&dev, &peer);
}

#[test]
fn two_processes_run_every_opcode() {
    let (dev_a, dev_b) = common::device_pair();
    let addr = format!("127.0.0.1:{}", 20000 + (std::process::id() % 20000) as u16);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "server_process", "--nocapture"])
        .env("ERDMA_TWO_PROCESS_DEVICE", &dev_b)
        .env("ERDMA_TWO_PROCESS_LISTEN", &addr)
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    client(&dev_a, &addr);
    let status = child.wait().unwrap();
    assert!(status.success(), "server process failed: {status}");
}

/// Both roles in processes of their own with `ERDMA_SOFT_SAME_HOST=<mode>`: every opcode and
/// size still checks every byte; returns what each process printed of its counters (client,
/// server). `None` where the same-host path does not apply (kernel devices).
fn pair_with(mode: &str) -> Option<(String, String)> {
    if std::env::var_os("ERDMA_TEST_DEV_A").is_some() {
        eprintln!("skipped: the same-host path is the soft device's");
        return None;
    }
    let (dev_a, dev_b) = common::soft_pair();
    let addr = format!(
        "127.0.0.1:{}",
        20000 + (std::process::id() % 20000) as u16 + u16::from(mode == "shm") * 2 + 1
    );
    let spawn = |role: &str, dev: &str, var: &str| {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--ignored", "--exact", role, "--nocapture"])
            .env("ERDMA_SOFT_SAME_HOST", mode)
            .env("ERDMA_TWO_PROCESS_COUNTERS", "1")
            .env("ERDMA_TWO_PROCESS_DEVICE", dev)
            .env(var, &addr)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if mode == "shm" {
            // Rings join devices of one engine (the suite also runs with ERDMA_SOFT_ENGINES=4).
            cmd.env("ERDMA_SOFT_ENGINES", "1")
                .env_remove("ERDMA_SOFT_FAULTS");
        }
        cmd.spawn().unwrap()
    };
    let server = spawn("server_process", &dev_b, "ERDMA_TWO_PROCESS_LISTEN");
    // The client's dial retries until the server listens.
    let client = spawn("client_process", &dev_a, "ERDMA_TWO_PROCESS_PEER");
    let (c, s) = (
        client.wait_with_output().unwrap(),
        server.wait_with_output().unwrap(),
    );
    let (co, so) = (
        String::from_utf8_lossy(&c.stdout).into_owned(),
        String::from_utf8_lossy(&s.stdout).into_owned(),
    );
    assert!(c.status.success(), "client: {}\n{co}", c.status);
    assert!(s.status.success(), "server: {}\n{so}", s.status);
    Some((co, so))
}

/// `role`'s counter `name` as its process printed it.
fn counter(out: &str, role: &str, name: &str) -> u64 {
    let key = format!("{role} {name}=");
    out.lines()
        .find_map(|l| l.strip_prefix(&key)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {key} in:\n{out}"))
}

/// The long SENDs and WRITEs of both sides went by reference (the receiving process copied
/// them out of the sender's memory) with none refused; with `rings`, every packet went through
/// the shared-memory rings between the two processes, else none did.
fn check_same_host(co: &str, so: &str, rings: bool) {
    // The client WRITEs and SENDs long messages to the server, and the server echoes them.
    for (out, role) in [(co, "client"), (so, "server")] {
        assert!(
            counter(out, role, "peer_ref_sent_pkts") > 0,
            "{role}:\n{out}"
        );
        assert!(
            counter(out, role, "peer_ref_rcvd_pkts") > 0,
            "{role}:\n{out}"
        );
        assert_eq!(
            counter(out, role, "drop_peer_ref_refused"),
            0,
            "{role}:\n{out}"
        );
        for name in ["ring_sent_pkts", "ring_rcvd_pkts"] {
            assert_eq!(counter(out, role, name) > 0, rings, "{role} {name}:\n{out}");
        }
    }
}

/// Payloads by reference, packets on the socket (`ERDMA_SOFT_SAME_HOST=cma`).
#[test]
fn two_processes_move_payloads_by_reference() {
    if let Some((co, so)) = pair_with("cma") {
        check_same_host(&co, &so, false);
    }
}

/// The default (`shm`): payloads by reference, and the packets through the shared-memory rings
/// each process took from the other (`pidfd_getfd` across processes).
#[test]
fn two_processes_move_packets_through_shared_memory() {
    if let Some((co, so)) = pair_with("shm") {
        check_same_host(&co, &so, true);
    }
}

/// The client role: everything the server checks, driven from this side.
fn client(dev: &str, peer_addr: &str) {
    let ctx = Context::open(dev).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256).unwrap();
    let mut mr = pd.alloc(REGION, Access::ALL).unwrap();
    let mut stream = connect::dial(peer_addr, TIMEOUT).unwrap();
    let (qp, peer) = connected(&pd, &cq, &mut stream, vec![mr.remote()]);
    let remote = peer.regions[0];
    // Phase 1: SEND each size, get it echoed with an immediate.
    for (i, &len) in SIZES.iter().enumerate() {
        let data = common::pattern(i as u32 + 77, len);
        mr.write_at(0, &data).unwrap();
        scope(|s| {
            let (src, dst) = mr.slice_mut(..).split_at(REGION / 2);
            s.post_recv(&qp, RecvWr::new(1, dst)).unwrap();
            let src = [src.into_local().get(..len).unwrap()];
            s.post_send(&qp, SendWr::send(2, &src)).unwrap();
            let mut got = Vec::new();
            for _ in 0..2 {
                got.push(cq.wait_one(TIMEOUT).unwrap());
            }
            got.sort_by_key(|c| c.wr_id);
            assert_eq!(got[0].status, WcStatus::Success, "{:?}", got[0]);
            assert_eq!(got[0].byte_len as usize, len);
            assert_eq!(got[0].imm, Some(len as u32));
            assert!(got[1].status.is_success(), "{:?}", got[1]);
        });
        assert_eq!(
            &mr.to_vec(REGION / 2..REGION / 2 + len),
            &data[..],
            "echo of {len}"
        );
    }
    // Phase 2: WRITE 1 MiB into the peer's upper half in uneven pieces, READ it back, run
    // atomics, then WRITE_WITH_IMM a checksum for the peer to verify.
    let len = 1usize << 20;
    let data = common::pattern(9, len);
    mr.write_at(0, &data).unwrap();
    scope(|s| {
        let mut off = 0;
        let mut k = 0u64;
        while off < len {
            let piece = (4097 + 1000 * k as usize).min(len - off);
            let src = [mr.slice(off..off + piece)];
            let target = remote
                .slice((REGION / 2 + off) as u64, piece as u64)
                .unwrap();
            let wr = SendWr::write(k, &src, target);
            s.post_send(
                &qp,
                if off + piece < len {
                    wr.unsignaled()
                } else {
                    wr
                },
            )
            .unwrap();
            off += piece;
            k += 1;
        }
        let c = cq.wait_one(TIMEOUT).unwrap();
        assert_eq!(
            (c.status, c.opcode),
            (WcStatus::Success, WcOpcode::RdmaWrite)
        );
    });
    scope(|s| {
        let back = mr.slice_mut(len..2 * len);
        s.post_send(
            &qp,
            SendWr::read(
                1,
                back,
                remote.slice((REGION / 2) as u64, len as u64).unwrap(),
            ),
        )
        .unwrap();
        let c = cq.wait_one(TIMEOUT).unwrap();
        assert_eq!(
            (c.status, c.opcode),
            (WcStatus::Success, WcOpcode::RdmaRead)
        );
    });
    assert_eq!(&mr.to_vec(len..2 * len), &data[..], "READ back");
    if ctx.limits().atomics {
        let word = remote.slice(0, 8).unwrap();
        scope(|s| {
            s.post_send(&qp, SendWr::fetch_add(1, mr.slice_mut(0..8), word, 5))
                .unwrap();
            let c = cq.wait_one(TIMEOUT).unwrap();
            assert!(c.status.is_success(), "{c:?}");
        });
        let before = u64::from_ne_bytes(mr.to_vec(..8).try_into().unwrap());
        scope(|s| {
            s.post_send(
                &qp,
                SendWr::compare_swap(2, mr.slice_mut(8..16), word, before + 5, 42),
            )
            .unwrap();
            let c = cq.wait_one(TIMEOUT).unwrap();
            assert!(c.status.is_success(), "{c:?}");
        });
        assert_eq!(
            u64::from_ne_bytes(mr.to_vec(8..16).try_into().unwrap()),
            before + 5
        );
    }
    scope(|s| {
        s.post_recv(&qp, RecvWr::new(9, mr.slice_mut(3 * len..3 * len + 64)))
            .unwrap();
        let sum = checksum(&data);
        s.post_send(
            &qp,
            SendWr::write_inline(3, b"", remote.slice(0, 0).unwrap()).with_imm(sum),
        )
        .unwrap();
        let mut got = Vec::new();
        for _ in 0..2 {
            got.push(cq.wait_one(TIMEOUT).unwrap());
        }
        assert!(got.iter().all(|c| c.status.is_success()), "{got:?}");
    });
    assert_eq!(&mr.to_vec(3 * len..3 * len + 2), b"ok");
    // Keep the queue pair until the server's "ok" is acknowledged on its side (it says so):
    // the acknowledgement may be lost, and then only this queue pair can answer the retry.
    let mut word = [0u8; 1];
    connect::read_exact_by(
        &mut stream,
        &mut word,
        std::time::Instant::now() + TIMEOUT,
        "the server's last word",
    )
    .unwrap();
    assert_eq!(&word, b"d");
    drop(qp);
    drop(stream);
    print_reference_counters("client", &ctx);
}

/// The child of [`a_receiver_that_exits_at_once_leaves_its_peer_a_success`]: busy-polls until
/// one SEND arrives, then exits at once, without closing anything.
#[test]
#[ignore = "entry point of the child process spawned by `a_receiver_that_exits_at_once_leaves_its_peer_a_success`"]
fn exiting_receiver_process() {
    let (Ok(dev), Ok(listen)) = (
        std::env::var("ERDMA_EXIT_RECEIVER_DEVICE"),
        std::env::var("ERDMA_EXIT_RECEIVER_LISTEN"),
    ) else {
        panic!("exiting_receiver_process needs its device and listen address");
    };
    let ctx = Context::open(&dev).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let listener = Listener::bind(listen.as_str()).unwrap();
    let (mut stream, _) = listener.accept(TIMEOUT).unwrap();
    // The sender waits before sending: this receive is posted by then.
    let (qp, _) = connected(&pd, &cq, &mut stream, Vec::new());
    qp.post_recv(RecvWr::empty(1)).unwrap();
    let deadline = std::time::Instant::now() + TIMEOUT;
    while std::time::Instant::now() < deadline {
        if let Some(c) = cq.poll_one().unwrap() {
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
            eprintln!("exiting receiver: received");
            // No drop, no close: only what runs at process exit.
            std::process::exit(0);
        }
    }
    panic!("nothing arrived");
}

/// A receiver that exits the moment its poll returns the completion still leaves the sender a
/// successful send completion, as with a kernel device (the guest runs this on rxe): the
/// acknowledgements a polling thread's receive round holds back on the soft device go out at
/// process exit (and on every other path a process can stop by).
#[test]
fn a_receiver_that_exits_at_once_leaves_its_peer_a_success() {
    let (dev_a, dev_b) = common::device_pair();
    let addr = format!("127.0.0.1:{}", 40000 + (std::process::id() % 20000) as u16);
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "exiting_receiver_process",
            "--nocapture",
        ])
        .env("ERDMA_EXIT_RECEIVER_DEVICE", &dev_b)
        .env("ERDMA_EXIT_RECEIVER_LISTEN", &addr)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let ctx = Context::open(&dev_a).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let mut stream = connect::dial(&addr, TIMEOUT).unwrap();
    let (qp, _) = connected(&pd, &cq, &mut stream, Vec::new());
    // Let the child post its receive and its polling thread take the receive path first.
    std::thread::sleep(Duration::from_millis(50));
    qp.post_send(SendWr::send_inline(9, b"")).unwrap();
    let c = cq.wait_one(TIMEOUT).unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.contains("exiting receiver: received"),
        "receiver: {}\n{stderr}",
        out.status
    );
    assert_eq!((c.wr_id, c.status), (9, WcStatus::Success), "{c:?}");
}
