//! One-call connections (`erdma::connect::cm`): the soft device's TCP path on loopback, the
//! typed failures in bounded time, and the two roles that run through rdma_cm on rxe in the
//! test guest (`tests/vm/cm.sh`).
//!
//! Roles (ignored; driven by environment):
//! - `cm_server_role`: `ERDMA_CM_LISTEN=<ip:port>`; accepts one connection and serves it.
//! - `cm_client_role`: `ERDMA_CM_PEER=<ip:port>`; connects (retrying while nobody listens yet),
//!   WRITEs and SENDs, checks the server's WRITE and answer, disconnects.
//! - `cm_refused_role`: `ERDMA_CM_PEER=<ip:port>` where nobody listens: a typed refusal, fast.
//! - `cm_no_device_role`: `ERDMA_CM_ADDR=<ip>` that no RDMA device has: a typed error.
//!
//! `ERDMA_CM_DEVICE` names the device both roles insist on, `ERDMA_CM_SOURCE` the client's
//! source address; `ERDMA_CM_EXPECT` (`rdma_cm` or `soft`) is the path the roles must have taken.

mod common;

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::process::Command;
use std::time::{Duration, Instant};

use erdma::connect::cm::{self, Connection, Options, Setup, Via};
use erdma::{
    Access, Context, Cq, Error, Mr, QpConfig, QpState, RecvWr, SendWr, WcOpcode, WcStatus, scope,
};

const REGION: usize = 1 << 20;
const HALF: usize = REGION / 2;
const WRITE_LEN: usize = 100_000;
const SEND_OFF: usize = 200_000;
const SEND_LEN: usize = 3000;
/// Where, in the client's region, the server writes its answer.
const ANSWER_OFF: usize = HALF + 4096;
/// Where, in the server's region, the server keeps the answer's source.
const ANSWER_SRC: usize = 3 * REGION / 4;
const WAIT: Duration = Duration::from_secs(30);

/// What each side keeps for itself.
struct Side {
    cq: Cq,
    mr: Mr<'static>,
}

fn setup(ctx: &Context, who: &str) -> erdma::Result<Setup<Side>> {
    // ERDMA_CM_OWN_CONTEXT: build on a context of our own for the same device, not the one
    // rdma_cm resolved.
    let own;
    let ctx = if std::env::var_os("ERDMA_CM_OWN_CONTEXT").is_some() {
        own = Context::open(ctx.name())?;
        &own
    } else {
        ctx
    };
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(64)?;
    let mr = pd.alloc(REGION, Access::ALL)?;
    let mut s = Setup::new(&pd, QpConfig::new(&cq))
        .access(Access::ALL)
        .grant(mr.remote())
        .user_data(who.as_bytes().to_vec());
    if who == "server" {
        // The client SENDs as soon as it is connected: the receive must be there first.
        s = s.on_init(common::prepost(&mr, &[(1, HALF, REGION - HALF)]));
    }
    Ok(s.with(Side { cq, mr }))
}

/// The server's half: receive the client's SEND (into the receive `setup` posted), check it and
/// the client's WRITE, WRITE an answer into the client's region and SEND "ok".
fn serve(conn: &mut Connection<Side>) {
    assert_eq!(conn.peer().user, b"client");
    assert_eq!(conn.remote_regions().len(), 1);
    let qp = conn.qp().clone();
    let remote = conn.remote_regions()[0];
    assert_eq!(remote.len, REGION as u64);
    let side = conn.app_mut();
    {
        let c = side.cq.wait_one(WAIT).unwrap();
        assert_eq!(
            (c.status, c.opcode),
            (WcStatus::Success, WcOpcode::Recv),
            "{c:?}"
        );
        assert_eq!(c.byte_len as usize, SEND_LEN);
    }
    let mem = side.mr.to_vec(..);
    assert!(
        mem[..WRITE_LEN] == common::pattern(1, WRITE_LEN)[..],
        "the client's WRITE arrived intact"
    );
    assert!(
        mem[HALF..HALF + SEND_LEN] == common::pattern(2, SEND_LEN)[..],
        "the client's SEND arrived intact"
    );
    side.mr
        .write_at(ANSWER_SRC, &common::pattern(3, WRITE_LEN))
        .unwrap();
    scope(|s| {
        let src = [side.mr.slice(ANSWER_SRC..ANSWER_SRC + WRITE_LEN)];
        let target = remote.slice(ANSWER_OFF as u64, WRITE_LEN as u64).unwrap();
        s.post_send(&qp, SendWr::write(1, &src, target)).unwrap();
        s.post_send(&qp, SendWr::send_inline(2, b"ok")).unwrap();
        for _ in 0..2 {
            let c = side.cq.wait_one(WAIT).unwrap();
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
        }
    });
}

/// The client's half: WRITE then SEND, and check what the server did in return.
fn drive(conn: &mut Connection<Side>) {
    assert_eq!(conn.peer().user, b"server");
    assert_eq!(conn.remote_regions().len(), 1);
    let qp = conn.qp().clone();
    let remote = conn.remote_regions()[0];
    let side = conn.app_mut();
    side.mr.write_at(0, &common::pattern(1, WRITE_LEN)).unwrap();
    side.mr
        .write_at(SEND_OFF, &common::pattern(2, SEND_LEN))
        .unwrap();
    scope(|s| {
        let (lo, hi) = side.mr.slice_mut(..).split_at(HALF);
        let (answer, _) = hi.split_at(64);
        s.post_recv(&qp, RecvWr::new(9, answer)).unwrap();
        let src = lo.into_local();
        let w = [src.get(..WRITE_LEN).unwrap()];
        let target = remote.slice(0, WRITE_LEN as u64).unwrap();
        s.post_send(&qp, SendWr::write(1, &w, target)).unwrap();
        let d = [src.get(SEND_OFF..SEND_OFF + SEND_LEN).unwrap()];
        s.post_send(&qp, SendWr::send(2, &d)).unwrap();
        let mut got = Vec::new();
        for _ in 0..3 {
            got.push(side.cq.wait_one(WAIT).unwrap());
        }
        got.sort_by_key(|c| c.wr_id);
        assert!(got.iter().all(|c| c.status == WcStatus::Success), "{got:?}");
        let opcodes: Vec<_> = got.iter().map(|c| c.opcode).collect();
        assert_eq!(
            opcodes,
            [WcOpcode::RdmaWrite, WcOpcode::Send, WcOpcode::Recv]
        );
        assert_eq!(got[2].byte_len, 2);
    });
    let mem = side.mr.to_vec(..);
    assert_eq!(&mem[HALF..HALF + 2], b"ok");
    assert!(
        mem[ANSWER_OFF..ANSWER_OFF + WRITE_LEN] == common::pattern(3, WRITE_LEN)[..],
        "the server's WRITE arrived intact"
    );
}

fn soft(addr: &str) -> Options {
    Options {
        device: Some(addr.to_string()),
        ..Options::default()
    }
}

/// A loopback address pair for soft devices no other test uses: (client, server). The second
/// octet comes from the process id, so test processes running side by side (other test binaries
/// use 127.0.x.x) rarely meet on one address.
fn pair() -> (String, String) {
    use std::sync::atomic::{AtomicU8, Ordering};
    static NEXT: AtomicU8 = AtomicU8::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let b = 64 + (std::process::id() % 128) as u8;
    (format!("127.{b}.{n}.1"), format!("127.{b}.{n}.2"))
}

#[test]
fn soft_connection_carries_write_and_send() {
    let (client_ip, server_ip) = pair();
    let listener = cm::Listener::bind_with(
        format!("{server_ip}:0"),
        &soft(&format!("soft:{server_ip}")),
    )
    .unwrap();
    assert_eq!(listener.via(), Via::Soft);
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let mut conn = listener.accept(WAIT, |ctx| setup(ctx, "server")).unwrap();
        assert_eq!(conn.via(), Via::Soft);
        assert_eq!(conn.context().name(), format!("soft:{server_ip}"));
        serve(&mut conn);
        // The side that sent last disconnects once its sends completed (see `serve`).
        conn.disconnect(WAIT).unwrap();
    });
    let mut conn = cm::connect_with(addr, WAIT, &soft(&format!("soft:{client_ip}")), |ctx| {
        setup(ctx, "client")
    })
    .unwrap();
    assert_eq!(conn.peer_addr(), addr);
    drive(&mut conn);
    conn.wait_disconnected(WAIT).unwrap();
    server.join().unwrap();
}

#[test]
fn soft_device_follows_the_address() {
    // No device named: the listener's soft device is the address the client reached, the
    // client's is its source address.
    let (client_ip, server_ip) = pair();
    if std::path::Path::new("/dev/infiniband/rdma_cm").exists() {
        // A kernel RDMA stack: rdma_cm decides, and no RDMA device has an address of TEST-NET-2.
        let e = cm::Listener::bind("198.51.100.77:0").unwrap_err();
        assert!(matches!(e, Error::NoDeviceForAddress { .. }), "{e}");
        return;
    }
    let listener = cm::Listener::bind(format!("{server_ip}:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let conn = listener
            .accept(WAIT, |ctx| {
                let pd = ctx.alloc_pd()?;
                let cq = ctx.create_cq(16)?;
                Ok(Setup::new(&pd, QpConfig::new(&cq)).with(cq))
            })
            .unwrap();
        assert_eq!(conn.context().name(), format!("soft:{server_ip}"));
        conn.wait_disconnected(WAIT).unwrap();
    });
    let options = Options {
        source: Some(client_ip.parse::<IpAddr>().unwrap()),
        ..Options::default()
    };
    let conn = cm::connect_with(addr, WAIT, &options, |ctx| {
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq(16)?;
        Ok(Setup::new(&pd, QpConfig::new(&cq)).with(cq))
    })
    .unwrap();
    assert_eq!(conn.via(), Via::Soft);
    assert_eq!(conn.context().name(), format!("soft:{client_ip}"));
    // An empty connection info is fine: nothing granted.
    assert!(conn.remote_regions().is_empty());
    // Dropping the connection disconnects (the server sees it) and puts the queue pair in ERR.
    let qp = conn.qp().clone();
    drop(conn);
    assert_eq!(qp.state().unwrap(), QpState::Err);
    server.join().unwrap();
}

fn unused_port(ip: &str) -> SocketAddr {
    let l = TcpListener::bind(format!("{ip}:0")).unwrap();
    l.local_addr().unwrap()
}

fn tiny(ctx: &Context) -> erdma::Result<Setup<Cq>> {
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(16)?;
    Ok(Setup::new(&pd, QpConfig::new(&cq)).with(cq))
}

#[test]
fn refused_peer_is_a_typed_error_in_bounded_time() {
    let (client_ip, server_ip) = pair();
    let addr = unused_port(&server_ip);
    let t0 = Instant::now();
    let e = cm::connect_with(addr, WAIT, &soft(&format!("soft:{client_ip}")), tiny).unwrap_err();
    assert!(matches!(e, Error::Refused { .. }), "{e}");
    assert!(e.to_string().contains(&addr.to_string()), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[test]
fn unreachable_peer_is_a_typed_error_in_bounded_time() {
    let (client_ip, _) = pair();
    // The IPv6 documentation prefix: routed nowhere, or into a void.
    let t0 = Instant::now();
    let e = cm::connect_with(
        "[2001:db8::1]:7471",
        Duration::from_millis(800),
        &soft(&format!("soft:{client_ip}")),
        tiny,
    )
    .unwrap_err();
    assert!(
        matches!(e, Error::Unreachable { .. } | Error::Timeout { .. }),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[test]
fn silent_peer_and_absent_peer_time_out() {
    let (client_ip, server_ip) = pair();
    // Accepts the TCP connection and never says a word.
    let l = TcpListener::bind(format!("{server_ip}:0")).unwrap();
    let addr = l.local_addr().unwrap();
    let hold = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        drop(s);
    });
    let t0 = Instant::now();
    let e = cm::connect_with(
        addr,
        Duration::from_millis(500),
        &soft(&format!("soft:{client_ip}")),
        tiny,
    )
    .unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    hold.join().unwrap();
    // A listener nobody connects to.
    let listener = cm::Listener::bind_with(
        format!("{server_ip}:0"),
        &soft(&format!("soft:{server_ip}")),
    )
    .unwrap();
    let t0 = Instant::now();
    let e = listener
        .accept(Duration::from_millis(300), tiny)
        .unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(3));
}

#[test]
fn hostile_soft_peers_get_protocol_errors() {
    use std::io::Write;
    let (_, server_ip) = pair();
    let listener = cm::Listener::bind_with(
        format!("{server_ip}:0"),
        &soft(&format!("soft:{server_ip}")),
    )
    .unwrap();
    let addr = listener.local_addr().unwrap();
    // One device for all three attempts, rather than one opened and closed per attempt.
    let _device = Context::open(&format!("soft:{server_ip}")).unwrap();
    // Garbage instead of connection info.
    let mut raw = std::net::TcpStream::connect(addr).unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let t0 = Instant::now();
    let e = listener.accept(WAIT, tiny).unwrap_err();
    assert!(matches!(e, Error::Protocol { .. }), "{e}");
    assert!(e.to_string().contains("not speaking"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    drop(raw);
    // A peer that goes away half-way through its connection info.
    let mut raw = std::net::TcpStream::connect(addr).unwrap();
    raw.write_all(b"ERDM\x00\x01").unwrap();
    drop(raw);
    let e = listener.accept(WAIT, tiny).unwrap_err();
    assert!(matches!(e, Error::Protocol { .. }), "{e}");
    // One that connects and says nothing: the accept's own deadline.
    let raw = std::net::TcpStream::connect(addr).unwrap();
    let t0 = Instant::now();
    let e = listener
        .accept(Duration::from_millis(400), tiny)
        .unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(3));
    drop(raw);
}

#[test]
fn a_failing_setup_rejects_with_its_reason() {
    let (client_ip, server_ip) = pair();
    let listener = cm::Listener::bind_with(
        format!("{server_ip}:0"),
        &soft(&format!("soft:{server_ip}")),
    )
    .unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        listener
            .accept(WAIT, |_ctx| -> erdma::Result<Setup<Cq>> {
                Err(Error::Unsupported {
                    feature: "more clients",
                    device: "this server".into(),
                })
            })
            .unwrap_err()
    });
    let e = cm::connect_with(addr, WAIT, &soft(&format!("soft:{client_ip}")), tiny).unwrap_err();
    match &e {
        Error::Refused { reason, .. } => {
            assert!(reason.contains("more clients is not supported"), "{e}")
        }
        other => panic!("expected a refusal, got {other}"),
    }
    let server_error = server.join().unwrap();
    assert!(
        matches!(server_error, Error::Unsupported { .. }),
        "{server_error}"
    );
}

#[test]
fn missing_librdmacm_is_named() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "missing_librdmacm_child",
            "--nocapture",
        ])
        .env("ERDMA_RDMACM_LIB", "/nonexistent/librdmacm.so.1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[ignore = "run by `missing_librdmacm_is_named` with ERDMA_RDMACM_LIB pointing nowhere"]
fn missing_librdmacm_child() {
    let options = Options {
        device: Some("rxe0".into()),
        ..Options::default()
    };
    let e = cm::connect_with("127.0.0.1:7471", WAIT, &options, tiny).unwrap_err();
    match &e {
        Error::Library { library, .. } => assert_eq!(*library, "librdmacm.so.1"),
        other => panic!("expected a library error, got {other}"),
    }
    assert!(e.to_string().contains("librdmacm"), "{e}");
    let e = cm::Listener::bind_with("127.0.0.1:0", &options).unwrap_err();
    assert!(matches!(e, Error::Library { .. }), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Roles for two processes (rdma_cm on rxe in the guest).

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("this role needs {name}"))
}

fn role_options() -> Options {
    Options {
        device: std::env::var("ERDMA_CM_DEVICE").ok(),
        source: std::env::var("ERDMA_CM_SOURCE")
            .ok()
            .map(|s| s.parse().expect("ERDMA_CM_SOURCE is an IP address")),
        ..Options::default()
    }
}

fn check_via(via: Via) {
    match std::env::var("ERDMA_CM_EXPECT").as_deref() {
        Ok("rdma_cm") => assert_eq!(via, Via::RdmaCm),
        Ok("soft") => assert_eq!(via, Via::Soft),
        _ => {}
    }
}

#[test]
#[ignore = "server role of tests/vm/cm.sh (ERDMA_CM_LISTEN)"]
fn cm_server_role() {
    let listener = cm::Listener::bind_with(env("ERDMA_CM_LISTEN"), &role_options()).unwrap();
    check_via(listener.via());
    println!("listening on {}", listener.local_addr().unwrap());
    let mut conn = listener
        .accept(Duration::from_secs(60), |ctx| setup(ctx, "server"))
        .unwrap();
    check_via(conn.via());
    println!(
        "server: connected on {} ({:?} profile) (queue pair {:#x}) with {}",
        conn.context().name(),
        conn.context().limits().profile,
        conn.qp().qp_num(),
        conn.peer_addr()
    );
    serve(&mut conn);
    // The server sends last, so it disconnects first, once its sends have completed: the
    // client's queue pair leaves RTS only after it has acknowledged them.
    if std::env::var_os("ERDMA_CM_DROP").is_some() {
        // Disconnect by dropping: the client must see it, and the queue pair goes to ERR.
        let qp = conn.qp().clone();
        drop(conn);
        if iwarp() {
            // siw reports no state: its queue pair in ERR refuses a post instead.
            let r = qp.post_send(SendWr::send_inline(9, b"x"));
            assert!(matches!(r, Err(Error::QpInError { .. })), "{r:?}");
        } else {
            assert_eq!(qp.state().unwrap(), QpState::Err);
        }
    } else {
        conn.disconnect(WAIT).unwrap();
    }
    println!("server: WRITE and SEND verified; disconnected");
}

#[test]
#[ignore = "client role of tests/vm/cm.sh (ERDMA_CM_PEER)"]
fn cm_client_role() {
    let peer = env("ERDMA_CM_PEER");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut conn = loop {
        match cm::connect_with(peer.as_str(), WAIT, &role_options(), |ctx| {
            setup(ctx, "client")
        }) {
            Ok(c) => break c,
            // The server may not listen yet.
            Err(Error::Refused { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(200))
            }
            Err(e) => panic!("connecting to {peer}: {e}"),
        }
    };
    check_via(conn.via());
    println!(
        "client: connected on {} ({:?} profile) (queue pair {:#x}) to {}",
        conn.context().name(),
        conn.context().limits().profile,
        conn.qp().qp_num(),
        conn.peer_addr()
    );
    drive(&mut conn);
    conn.wait_disconnected(WAIT).unwrap();
    println!("client: WRITE, SEND and the answer verified; server disconnected");
}

#[test]
#[ignore = "refusal check of tests/vm/cm.sh (ERDMA_CM_PEER: nobody listens there)"]
fn cm_refused_role() {
    let peer = env("ERDMA_CM_PEER");
    let t0 = Instant::now();
    let e = cm::connect_with(peer.as_str(), WAIT, &role_options(), tiny).unwrap_err();
    println!("refused as expected in {:?}: {e}", t0.elapsed());
    assert!(matches!(e, Error::Refused { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(10));
}

#[test]
#[ignore = "unreachable check of tests/vm/cm.sh (ERDMA_CM_PEER: an address nobody answers)"]
fn cm_unreachable_role() {
    let peer = env("ERDMA_CM_PEER");
    let t0 = Instant::now();
    let e =
        cm::connect_with(peer.as_str(), Duration::from_secs(4), &role_options(), tiny).unwrap_err();
    println!("unreachable as expected in {:?}: {e}", t0.elapsed());
    assert!(
        matches!(e, Error::Unreachable { .. } | Error::Timeout { .. }),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(8));
}

#[test]
#[ignore = "no-device check of tests/vm/cm.sh (ERDMA_CM_ADDR: an address no RDMA device has)"]
fn cm_no_device_role() {
    let addr = env("ERDMA_CM_ADDR");
    let e = cm::Listener::bind(format!("{addr}:0")).unwrap_err();
    println!("bind: {e}");
    assert!(matches!(e, Error::NoDeviceForAddress { .. }), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Roles facing the C tools of rdmacm-utils (`rdma_server`, `rdma_client`): 16-byte messages each
// way, as those tools exchange.

const C_MSG: usize = 16;

fn c_setup(ctx: &Context) -> erdma::Result<Setup<Side>> {
    c_setup_with(ctx, false)
}

/// `prepost`: the receive for the C client's first message is posted before the accept
/// (`rdma_client` sends as soon as it is connected).
fn c_setup_with(ctx: &Context, prepost: bool) -> erdma::Result<Setup<Side>> {
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(16)?;
    let mr = pd.alloc(4096, Access::LOCAL_WRITE)?;
    let mut s = Setup::new(&pd, QpConfig::new(&cq))
        .access(Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ);
    if prepost {
        s = s.on_init(common::prepost(&mr, &[(1, C_MSG, C_MSG)]));
    }
    Ok(s.with(Side { cq, mr }))
}

/// Takes the completion of a SEND that was this side's last message to a C tool that
/// disconnects as soon as the message is in: its acknowledgement can be lost in that teardown
/// (RC promises the sender nothing once the receiver leaves RTS), so when it does not come, the
/// SEND is flushed and the C tool's own check (its exit status, rping's `-V`) says whether the
/// message arrived.
fn last_send_to_c_tool(qp: &erdma::Qp, cq: &Cq, wr_id: u64) {
    let c = match cq.wait_one(Duration::from_secs(5)) {
        Ok(c) => c,
        Err(_) => {
            qp.to_error().unwrap();
            cq.wait_one(WAIT).unwrap()
        }
    };
    assert_eq!(c.wr_id, wr_id, "{c:?}");
}

/// Receives one message and sends one back (`send_first`: the other order; otherwise the
/// receive was posted before the connection, by `c_setup_with`).
fn c_exchange(conn: &mut Connection<Side>, send_first: bool) {
    let qp = conn.qp().clone();
    let side = conn.app_mut();
    side.mr.write_at(0, b"erdma over rdmcm").unwrap();
    scope(|s| {
        let (out, inp) = side.mr.slice_mut(..).split_at(C_MSG);
        let (inp, _) = inp.split_at(C_MSG);
        if send_first {
            s.post_recv(&qp, RecvWr::new(1, inp)).unwrap();
        }
        let src = [out.into_local()];
        if !send_first {
            let c = side.cq.wait_one(WAIT).unwrap();
            assert_eq!(
                (c.status, c.opcode),
                (WcStatus::Success, WcOpcode::Recv),
                "{c:?}"
            );
            assert_eq!(c.byte_len as usize, C_MSG);
        }
        s.post_send(&qp, SendWr::send(2, &src)).unwrap();
        if !send_first {
            // rdma_client disconnects as soon as our answer is in.
            last_send_to_c_tool(&qp, &side.cq, 2);
            return;
        }
        // rdma_server answers once our message is in, then disconnects at once. Its answer
        // proves our SEND arrived; the acknowledgement of our SEND, though, can be lost in the
        // teardown (RC promises the sender nothing once the receiver leaves RTS; seen about once
        // in 40 runs on rxe under emulation), so our SEND's completion is not required.
        let mut answered = false;
        let mut sent = false;
        while !answered {
            let c = side.cq.wait_one(WAIT).unwrap();
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
            match c.opcode {
                WcOpcode::Recv => {
                    assert_eq!(c.byte_len as usize, C_MSG);
                    answered = true;
                }
                _ => sent = true,
            }
        }
        if !sent {
            last_send_to_c_tool(&qp, &side.cq, 2);
        }
    });
}

#[test]
#[ignore = "client role facing the C rdma_server (ERDMA_CM_PEER)"]
fn cm_c_server_peer_role() {
    let peer = env("ERDMA_CM_PEER");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut conn = loop {
        match cm::connect_with(peer.as_str(), WAIT, &role_options(), c_setup) {
            Ok(c) => break c,
            Err(Error::Refused { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(200))
            }
            Err(e) => panic!("connecting to {peer}: {e}"),
        }
    };
    check_via(conn.via());
    // The C server sends no connection info: nothing granted.
    assert!(conn.remote_regions().is_empty());
    c_exchange(&mut conn, true);
    // The C server disconnects once its message is sent.
    conn.wait_disconnected(WAIT).unwrap();
    println!("client: exchanged 16-byte messages with rdma_server; it disconnected");
}

#[test]
#[ignore = "server role facing the C rdma_client (ERDMA_CM_LISTEN)"]
fn cm_c_client_peer_role() {
    let listener = cm::Listener::bind_with(env("ERDMA_CM_LISTEN"), &role_options()).unwrap();
    check_via(listener.via());
    let mut conn = listener
        .accept(Duration::from_secs(60), |ctx| c_setup_with(ctx, true))
        .unwrap();
    check_via(conn.via());
    c_exchange(&mut conn, false);
    conn.wait_disconnected(WAIT).unwrap();
    println!("server: exchanged 16-byte messages with rdma_client; it disconnected");
}

// ---------------------------------------------------------------------------------------------
// Failure roles for rdma_cm.

/// Whether the roles run on an iWARP device (`ERDMA_CM_TRANSPORT=iwarp`): its rejects and
/// private-data limits differ from InfiniBand/RoCE's.
fn iwarp() -> bool {
    std::env::var("ERDMA_CM_TRANSPORT").as_deref() == Ok("iwarp")
}

#[test]
#[ignore = "rdma_cm check: connection info too large for a connection request (ERDMA_CM_PEER)"]
fn cm_oversized_role() {
    let peer = env("ERDMA_CM_PEER");
    // RoCE: three regions, 80 bytes, more than the 56 a connection request carries. iWARP:
    // twelve, 260 bytes, more than its 251.
    let (regions, limit) = if iwarp() {
        (12, cm::IWARP_PRIVATE_DATA)
    } else {
        (3, cm::IB_CONNECT_PRIVATE_DATA)
    };
    let e = cm::connect_with(peer.as_str(), WAIT, &role_options(), |ctx| {
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq(16)?;
        let mr = pd.alloc(4096, Access::ALL)?;
        let mut s = Setup::new(&pd, QpConfig::new(&cq))
            .access(Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ);
        for _ in 0..regions {
            s = s.grant(mr.remote());
        }
        Ok(s.with((cq, mr)))
    })
    .unwrap_err();
    println!("oversized connection info refused as expected: {e}");
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains(&format!("{limit} bytes")), "{e}");
}

#[test]
#[ignore = "rdma_cm server whose setup fails (ERDMA_CM_LISTEN)"]
fn cm_reject_server_role() {
    let listener = cm::Listener::bind_with(env("ERDMA_CM_LISTEN"), &role_options()).unwrap();
    let e = listener
        .accept(
            Duration::from_secs(60),
            |_ctx| -> erdma::Result<Setup<Cq>> {
                Err(Error::Unsupported {
                    feature: "a third client",
                    device: "this server".into(),
                })
            },
        )
        .unwrap_err();
    println!("server: rejected with: {e}");
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
}

#[test]
#[ignore = "rdma_cm client of cm_reject_server_role (ERDMA_CM_PEER)"]
fn cm_rejected_client_role() {
    let peer = env("ERDMA_CM_PEER");
    let deadline = Instant::now() + Duration::from_secs(60);
    let e = loop {
        let e = cm::connect_with(peer.as_str(), WAIT, &role_options(), tiny).unwrap_err();
        match &e {
            // Nobody listening yet: try again.
            Error::Refused { reason, .. }
                if reason.contains("nobody is listening") && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(200))
            }
            _ => break e,
        }
    };
    println!("client: {e}");
    // The reject's kind (InfiniBand CM: consumer-defined; iWARP: an MPA reject) and the
    // server's own words, carried in the reject's private data.
    let kind = if iwarp() {
        "MPA reject"
    } else {
        "consumer-defined"
    };
    match &e {
        Error::Refused { reason, .. } => {
            assert!(reason.contains(kind), "{e}");
            assert!(reason.contains("a third client is not supported"), "{e}");
        }
        other => panic!("expected a refusal, got {other}"),
    }
}

#[test]
#[ignore = "rdma_cm listener nobody connects to (ERDMA_CM_LISTEN)"]
fn cm_accept_timeout_role() {
    let listener = cm::Listener::bind_with(env("ERDMA_CM_LISTEN"), &role_options()).unwrap();
    let t0 = Instant::now();
    let e = listener
        .accept(Duration::from_millis(500), tiny)
        .unwrap_err();
    println!("accept: {e} after {:?}", t0.elapsed());
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(3));
}

#[test]
#[ignore = "rdma_cm listener that never answers (ERDMA_CM_LISTEN, ERDMA_CM_HOLD_MS)"]
fn cm_silent_server_role() {
    let listener = cm::Listener::bind_with(env("ERDMA_CM_LISTEN"), &role_options()).unwrap();
    println!("silent listener on {}", listener.local_addr().unwrap());
    let ms: u64 = env("ERDMA_CM_HOLD_MS").parse().unwrap();
    std::thread::sleep(Duration::from_millis(ms));
    drop(listener);
}

#[test]
#[ignore = "rdma_cm client of cm_silent_server_role (ERDMA_CM_PEER)"]
fn cm_silent_peer_client_role() {
    let peer = env("ERDMA_CM_PEER");
    let t0 = Instant::now();
    let e =
        cm::connect_with(peer.as_str(), Duration::from_secs(2), &role_options(), tiny).unwrap_err();
    println!("client: {e} after {:?}", t0.elapsed());
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5));
}

// ---------------------------------------------------------------------------------------------
// Roles facing rping (rdmacm-utils): its protocol, per ping, is
//   client SENDs {addr, rkey, size} of its start buffer (16 bytes, big-endian);
//   server READs it, SENDs a go-ahead; client SENDs {addr, rkey, size} of its sink;
//   server WRITEs what it read there, SENDs a go-ahead; the client compares the two buffers.

const RPING_SIZE: usize = 64;
const INFO_OUT: usize = 0;
const INFO_IN: usize = 64;
const START: usize = 1024;
const SINK: usize = 4096;

fn rping_count() -> usize {
    std::env::var("ERDMA_CM_RPING_COUNT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3)
}

fn rping_setup(ctx: &Context) -> erdma::Result<Setup<Side>> {
    rping_setup_with(ctx, false)
}

/// `prepost`: the receive for the client's first message is posted before the accept (rping's
/// client sends its start buffer as soon as it is connected).
fn rping_setup_with(ctx: &Context, prepost: bool) -> erdma::Result<Setup<Side>> {
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(16)?;
    let mr = pd.alloc(8192, Access::ALL)?;
    let mut s = Setup::new(&pd, QpConfig::new(&cq))
        .access(Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ);
    if prepost {
        s = s.on_init(common::prepost(&mr, &[(1, INFO_IN, 16)]));
    }
    Ok(s.with(Side { cq, mr }))
}

fn put_info(mem: &mut [u8], addr: u64, rkey: u32, size: u32) {
    mem[INFO_OUT..INFO_OUT + 8].copy_from_slice(&addr.to_be_bytes());
    mem[INFO_OUT + 8..INFO_OUT + 12].copy_from_slice(&rkey.to_be_bytes());
    mem[INFO_OUT + 12..INFO_OUT + 16].copy_from_slice(&size.to_be_bytes());
}

fn get_info(mem: &[u8]) -> erdma::RemoteMr {
    let b = &mem[INFO_IN..INFO_IN + 16];
    erdma::RemoteMr {
        addr: u64::from_be_bytes(b[0..8].try_into().unwrap()),
        rkey: u32::from_be_bytes(b[8..12].try_into().unwrap()),
        len: u32::from_be_bytes(b[12..16].try_into().unwrap()) as u64,
    }
}

/// Posts a receive for the peer's 16-byte message into INFO_IN, SENDs the 16 bytes at INFO_OUT
/// (unless `send` is false), and waits for both.
fn rping_step(qp: &erdma::Qp, side: &mut Side, recv: bool, send: bool) {
    rping_step_with(qp, side, recv, send, false)
}

/// [`rping_step`]; `last`: the SEND is the final message to an rping client, which disconnects
/// as soon as it is in (see [`last_send_to_c_tool`]).
fn rping_step_with(qp: &erdma::Qp, side: &mut Side, recv: bool, send: bool, last: bool) {
    scope(|s| {
        let (out, rest) = side.mr.slice_mut(..).split_at(INFO_IN);
        let (inp, _) = rest.split_at(16);
        let mut n = 0;
        if recv {
            s.post_recv(qp, RecvWr::new(1, inp)).unwrap();
            n += 1;
        }
        if send {
            let src = [out.into_local().get(INFO_OUT..INFO_OUT + 16).unwrap()];
            s.post_send(qp, SendWr::send(2, &src)).unwrap();
            if last && !recv {
                last_send_to_c_tool(qp, &side.cq, 2);
                return;
            }
            n += 1;
        }
        for _ in 0..n {
            let c = side.cq.wait_one(WAIT).unwrap();
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
            if c.opcode == WcOpcode::Recv {
                assert_eq!(c.byte_len, 16, "rping messages are 16 bytes");
            }
        }
    });
}

#[test]
#[ignore = "client role facing `rping -s` (ERDMA_CM_PEER, ERDMA_CM_RPING_COUNT)"]
fn cm_rping_server_peer_role() {
    let peer = env("ERDMA_CM_PEER");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut conn = loop {
        match cm::connect_with(peer.as_str(), WAIT, &role_options(), rping_setup) {
            Ok(c) => break c,
            Err(Error::Refused { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(200))
            }
            Err(e) => panic!("connecting to {peer}: {e}"),
        }
    };
    check_via(conn.via());
    let qp = conn.qp().clone();
    let side = conn.app_mut();
    let me = side.mr.remote();
    for ping in 0..rping_count() {
        let mut mem = side.mr.to_vec(..);
        let text = format!("rdma-ping-{ping}: ");
        for (i, b) in mem[START..START + RPING_SIZE].iter_mut().enumerate() {
            *b = text
                .as_bytes()
                .get(i)
                .copied()
                .unwrap_or(b'A' + ((i + ping) % 26) as u8);
        }
        mem[START + RPING_SIZE - 1] = 0;
        mem[SINK..SINK + RPING_SIZE].fill(0);
        put_info(&mut mem, me.addr + START as u64, me.rkey, RPING_SIZE as u32);
        side.mr.write_at(0, &mem).unwrap();
        // Start buffer advertised; the go-ahead comes once the server has READ it.
        rping_step(&qp, side, true, true);
        let mut mem = side.mr.to_vec(..);
        put_info(&mut mem, me.addr + SINK as u64, me.rkey, RPING_SIZE as u32);
        side.mr.write_at(0, &mem).unwrap();
        // Sink advertised; the go-ahead comes once the server has WRITTEN it.
        rping_step(&qp, side, true, true);
        let mem = side.mr.to_vec(..);
        assert_eq!(
            mem[SINK..SINK + RPING_SIZE],
            mem[START..START + RPING_SIZE],
            "ping {ping}: what rping READ and WRITE back"
        );
    }
    // rping's server sent the last message and never disconnects on its own. Leaving RTS
    // right after its receive completion could drop the acknowledgement of that message, so
    // give it a moment to go out first.
    std::thread::sleep(Duration::from_millis(100));
    conn.disconnect(WAIT).unwrap();
    println!(
        "client: {} pings through rping's server verified",
        rping_count()
    );
}

#[test]
#[ignore = "server role facing `rping -c` (ERDMA_CM_LISTEN, ERDMA_CM_RPING_COUNT)"]
fn cm_rping_client_peer_role() {
    let listener = cm::Listener::bind_with(env("ERDMA_CM_LISTEN"), &role_options()).unwrap();
    check_via(listener.via());
    let mut conn = listener
        .accept(Duration::from_secs(60), |ctx| rping_setup_with(ctx, true))
        .unwrap();
    check_via(conn.via());
    let qp = conn.qp().clone();
    let side = conn.app_mut();
    let me = side.mr.remote();
    // The client's first start buffer, into the receive posted before the accept; each later
    // one into the receive posted with the go-ahead before it (a SEND must never find no
    // receive: iWARP has no receiver-not-ready retry).
    let c = side.cq.wait_one(WAIT).unwrap();
    assert_eq!(
        (c.status, c.opcode, c.byte_len),
        (WcStatus::Success, WcOpcode::Recv, 16)
    );
    for ping in 0..rping_count() {
        let src = get_info(&side.mr.to_vec(..));
        assert!(src.len as usize <= SINK - START, "ping {ping}: {src:?}");
        let len = src.len as usize;
        scope(|s| {
            s.post_send(
                &qp,
                SendWr::read(3, side.mr.slice_mut(START..START + len), src),
            )
            .unwrap();
            let c = side.cq.wait_one(WAIT).unwrap();
            assert_eq!(
                (c.status, c.opcode),
                (WcStatus::Success, WcOpcode::RdmaRead),
                "{c:?}"
            );
        });
        let text = format!("rdma-ping-{ping}: ");
        assert!(
            side.mr.to_vec(START..).starts_with(text.as_bytes()),
            "ping {ping}: READ brought {:?}",
            String::from_utf8_lossy(&side.mr.to_vec(START..START + len))
        );
        let mut mem = side.mr.to_vec(..);
        put_info(&mut mem, me.addr + START as u64, me.rkey, len as u32);
        side.mr.write_at(0, &mem).unwrap();
        // Go-ahead; then the client's sink.
        rping_step(&qp, side, true, true);
        let sink = get_info(&side.mr.to_vec(..));
        scope(|s| {
            let src = [side.mr.slice(START..START + len)];
            s.post_send(
                &qp,
                SendWr::write(4, &src, sink.slice(0, len as u64).unwrap()),
            )
            .unwrap();
            let c = side.cq.wait_one(WAIT).unwrap();
            assert_eq!(
                (c.status, c.opcode),
                (WcStatus::Success, WcOpcode::RdmaWrite),
                "{c:?}"
            );
        });
        // Go-ahead: the client compares (and after the last ping, disconnects at once, else
        // sends its next start buffer).
        let last = ping + 1 == rping_count();
        rping_step_with(&qp, side, !last, true, last);
    }
    conn.wait_disconnected(WAIT).unwrap();
    println!("server: {} pings from rping's client served", rping_count());
}

/// Least privilege: a queue pair connected without [`Setup::access`] lets its peer SEND, not
/// WRITE, whatever the regions it granted allow.
#[test]
fn a_connection_grants_no_remote_access_unless_asked() {
    let (client_ip, server_ip) = pair();
    let listener = cm::Listener::bind_with(
        format!("{server_ip}:0"),
        &soft(&format!("soft:{server_ip}")),
    )
    .unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let conn = listener
            .accept(WAIT, |ctx| {
                let pd = ctx.alloc_pd()?;
                let cq = ctx.create_cq(8)?;
                let mr = pd.alloc(4096, Access::ALL)?;
                Ok(Setup::new(&pd, QpConfig::new(&cq))
                    .grant(mr.remote())
                    .with((cq, mr)))
            })
            .unwrap();
        conn.wait_disconnected(WAIT).unwrap();
    });
    let conn = cm::connect_with(addr, WAIT, &soft(&format!("soft:{client_ip}")), |ctx| {
        Ok(Setup::new(
            &ctx.alloc_pd()?,
            QpConfig::new(&ctx.create_cq(8)?),
        ))
    })
    .unwrap();
    let target = conn.remote_regions()[0];
    conn.qp()
        .post_send(SendWr::write_inline(1, b"intruder", target).signaled())
        .unwrap();
    let c = conn.qp().send_cq().wait_one(WAIT).unwrap();
    // A WRITE to a queue pair without REMOTE_WRITE is an operation it does not take: rxe (and
    // the soft device) answer with an invalid-request NAK, not an access error.
    assert_eq!((c.wr_id, c.status), (1, WcStatus::RemInvReqErr), "{c:?}");
    drop(conn);
    server.join().unwrap();
}
