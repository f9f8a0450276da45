//! A one-call connection (`erdma::connect::cm`) notices a dead peer: the survivor's posted
//! requests — receives included, which RC never times out — complete with flush errors that name
//! the lost peer, within the bound `Connection`'s docs state.
//!
//! The peer is a child process (this binary, the ignored `liveness_child` entry point, selected by
//! environment) that kills itself with SIGKILL at one point: before the exchange, after it
//! acknowledged a request but before answering, and mid-stream. A silent peer (alive, its
//! connection open, no heartbeats) is played in-process; so is the async form.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use erdma::connect::cm::{self, Connection, Options, Setup};
use erdma::connect::{self as oob, PeerInfo};
use erdma::{
    Access, Completion, Context, Cq, Error, Gid, Mr, Mtu, PeerLoss, QpConfig, QpEndpoint,
    QpFailure, SendWr, WcStatus, WorkQueue,
};

const WAIT: Duration = Duration::from_secs(30);
/// What the docs promise for a peer whose process dies (the close reaches us at once), with
/// room for a loaded machine.
const DEATH_BOUND: Duration = Duration::from_millis(500);
const SLOT: usize = 64;

/// A loopback address pair for soft devices no other test uses: (survivor, peer).
fn pair() -> (String, String) {
    use std::sync::atomic::{AtomicU8, Ordering};
    static NEXT: AtomicU8 = AtomicU8::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let b = 200 + (std::process::id() % 50) as u8;
    (format!("127.{b}.{n}.1"), format!("127.{b}.{n}.2"))
}

fn soft(ip: &str) -> Options {
    Options {
        device: Some(format!("soft:{ip}")),
        ..Options::default()
    }
}

struct Side {
    cq: Cq,
    _mr: Mr<'static>,
}

/// A queue pair with `recvs` receives of [`SLOT`] bytes posted before it connects (ids 100…).
fn setup(ctx: &Context, recvs: usize) -> erdma::Result<Setup<Side>> {
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(256)?;
    let mr = pd.alloc(recvs.max(1) * SLOT, Access::LOCAL_WRITE)?;
    let slots: Vec<(u64, usize, usize)> = (0..recvs)
        .map(|i| (100 + i as u64, i * SLOT, SLOT))
        .collect();
    Ok(Setup::new(&pd, QpConfig::new(&cq))
        .on_init(common::prepost(&mr, &slots))
        .with(Side { cq, _mr: mr }))
}

fn die() -> ! {
    // SAFETY: kill(2) on this process; it does not return for SIGKILL.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    unreachable!("SIGKILL returned");
}

/// The peer's half. `ERDMA_LIVENESS_AT`: where it dies; `ERDMA_LIVENESS_IP`: its address. It
/// prints `LISTEN <addr>` once it listens.
#[test]
#[ignore = "entry point of the child processes spawned by the tests below"]
fn liveness_child() {
    let at = std::env::var("ERDMA_LIVENESS_AT").expect("ERDMA_LIVENESS_AT");
    let ip = std::env::var("ERDMA_LIVENESS_IP").expect("ERDMA_LIVENESS_IP");
    if at == "before-exchange" {
        let l = TcpListener::bind(format!("{ip}:0")).unwrap();
        println!("LISTEN {}", l.local_addr().unwrap());
        let _accepted = l.accept().unwrap();
        die();
    }
    let listener = cm::Listener::bind_with(format!("{ip}:0"), &soft(&ip)).unwrap();
    println!("LISTEN {}", listener.local_addr().unwrap());
    let recvs = if at == "before-answer" { 1 } else { 8 };
    let conn = listener.accept(WAIT, move |ctx| setup(ctx, recvs)).unwrap();
    let cq = &conn.app().cq;
    match at.as_str() {
        // The request arrived; once the survivor says its SEND was acknowledged (a line on our
        // standard input), die without answering. Polling meanwhile lets the device send the
        // acknowledgement.
        "before-answer" => {
            let c = cq.wait_one(WAIT).unwrap();
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                let mut line = String::new();
                let _ = std::io::stdin().read_line(&mut line);
                let _ = tx.send(());
            });
            while rx.try_recv().is_err() {
                assert!(cq.poll_one().unwrap().is_none(), "nothing else completes");
                std::thread::sleep(Duration::from_millis(1));
            }
            die();
        }
        // Echo five requests, each once its SEND completed, then die with the rest unanswered.
        "mid-stream" => {
            let (mut posted, mut echoed) = (0, 0);
            while echoed < 5 {
                let c = cq.wait_one(WAIT).unwrap();
                assert_eq!(c.status, WcStatus::Success, "{c:?}");
                if c.queue() == WorkQueue::Recv && posted < 5 {
                    posted += 1;
                    conn.qp()
                        .post_send(SendWr::send_inline(c.wr_id + 1000, b"echo").signaled())
                        .unwrap();
                } else if c.queue() == WorkQueue::Send {
                    echoed += 1;
                }
            }
            die();
        }
        other => panic!("unknown ERDMA_LIVENESS_AT {other}"),
    }
}

/// A child that dies at `at`: its address, its standard input, and a receiver of the moment its
/// death was seen.
fn spawn_child(at: &str, ip: &str) -> (SocketAddr, ChildStdin, mpsc::Receiver<Instant>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "liveness_child", "--nocapture"])
        .env("ERDMA_LIVENESS_AT", at)
        .env("ERDMA_LIVENESS_IP", ip)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdin = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let addr = loop {
        let mut line = String::new();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the child ended before listening"
        );
        if let Some(a) = line.trim().strip_prefix("LISTEN ") {
            break a.parse().unwrap();
        }
    };
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut rest = Vec::new();
        let _ = out.read_to_end(&mut rest);
        let status = child.wait().unwrap();
        let seen = Instant::now();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL), "the child: {status}");
        let _ = tx.send(seen);
    });
    (addr, stdin, rx)
}

/// Waits for `n` completions.
fn collect(cq: &Cq, n: usize) -> Vec<(Completion, Instant)> {
    (0..n)
        .map(|i| {
            let c = cq
                .wait_one(WAIT)
                .unwrap_or_else(|e| panic!("completion {i} of {n}: {e}"));
            (c, Instant::now())
        })
        .collect()
}

/// Every failed completion is a flush naming the lost peer, the queue pair knows it, and a later
/// post fails at once; returns when the last flush arrived.
fn check_flushed_for_peer(conn: &Connection<Side>, got: &[(Completion, Instant)]) -> Instant {
    let lost = QpFailure::PeerLost(PeerLoss::Closed);
    let mut last = None;
    for (c, at) in got {
        if c.status != WcStatus::Success {
            assert_eq!(c.status, WcStatus::WrFlushErr, "{c:?}");
            assert_eq!(c.cause(), Some(lost), "{c:?}");
            let msg = Error::Completion(*c).to_string();
            assert!(msg.contains("the peer closed the connection"), "{msg}");
            last = Some(*at);
        }
    }
    assert_eq!(conn.qp().failure(), Some(lost));
    assert_eq!(conn.peer_lost(), Some(PeerLoss::Closed));
    match conn.qp().post_send(SendWr::send_inline(9, b"late")) {
        Err(Error::QpInError { cause, .. }) => assert_eq!(cause, Some(lost)),
        other => panic!("expected QpInError, got {other:?}"),
    }
    last.expect("some request was flushed")
}

fn within_bound(what: &str, flushed: Instant, death: &mpsc::Receiver<Instant>) {
    let died = death.recv_timeout(WAIT).expect("the child's death");
    let late = flushed.saturating_duration_since(died);
    eprintln!("{what}: flushed {late:?} after the peer's death was seen");
    assert!(
        late < DEATH_BOUND,
        "{what}: flushed {late:?} after the death"
    );
}

#[test]
fn a_peer_killed_before_the_exchange_fails_the_connect_at_once() {
    let (me, peer) = pair();
    let (addr, _stdin, death) = spawn_child("before-exchange", &peer);
    let t0 = Instant::now();
    let e = cm::connect_with(addr, WAIT, &soft(&me), |ctx| setup(ctx, 1)).unwrap_err();
    // Not a timeout (30 s): the close of the connection, named.
    assert!(matches!(e, Error::Protocol { .. }), "{e}");
    assert!(e.to_string().contains("peer"), "{e}");
    let took = t0.elapsed();
    eprintln!("killed before the exchange: connect failed after {took:?}: {e}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    death.recv_timeout(WAIT).unwrap();
}

#[test]
fn a_peer_killed_before_answering_flushes_the_posted_receive() {
    let (me, peer) = pair();
    let (addr, mut stdin, death) = spawn_child("before-answer", &peer);
    let conn = cm::connect_with(addr, WAIT, &soft(&me), |ctx| setup(ctx, 1)).unwrap();
    conn.qp()
        .post_send(SendWr::send_inline(1, b"request").signaled())
        .unwrap();
    // The request is acknowledged; then the peer dies, and the answer's receive waits on it.
    let send = conn.app().cq.wait_one(WAIT).unwrap();
    assert_eq!(
        (send.wr_id, send.status),
        (1, WcStatus::Success),
        "{send:?}"
    );
    writeln!(stdin, "die").unwrap();
    let got = collect(&conn.app().cq, 1);
    assert_eq!(got[0].0.wr_id, 100, "{:?}", got[0].0);
    assert_eq!(got[0].0.status, WcStatus::WrFlushErr, "{:?}", got[0].0);
    let flushed = check_flushed_for_peer(&conn, &got);
    within_bound("killed before answering", flushed, &death);
}

#[test]
fn a_peer_killed_mid_stream_flushes_everything_outstanding() {
    let (me, peer) = pair();
    let (addr, _stdin, death) = spawn_child("mid-stream", &peer);
    let conn = cm::connect_with(addr, WAIT, &soft(&me), |ctx| setup(ctx, 16)).unwrap();
    for i in 0..16u64 {
        conn.qp()
            .post_send(SendWr::send_inline(i, b"request").signaled())
            .unwrap();
    }
    let got = collect(&conn.app().cq, 32);
    let echoes = got
        .iter()
        .filter(|(c, _)| c.queue() == WorkQueue::Recv && c.status == WcStatus::Success)
        .count();
    assert_eq!(echoes, 5, "the peer echoed five requests before it died");
    let sent = got
        .iter()
        .filter(|(c, _)| c.queue() == WorkQueue::Send && c.status == WcStatus::Success)
        .count();
    // The peer had eight receives: at most eight requests got in (the acknowledgements of
    // those that did may die with it).
    assert!(sent <= 8, "{sent} requests acknowledged");
    let flushed = check_flushed_for_peer(&conn, &got);
    within_bound("killed mid-stream", flushed, &death);
}

/// A peer that stays connected and says nothing (its host froze, the network dropped everything
/// without a reset): lost after `peer_timeout` without a heartbeat.
#[test]
fn a_silent_peer_is_lost_after_the_peer_timeout() {
    let (me, peer) = pair();
    let l = TcpListener::bind(format!("{peer}:0")).unwrap();
    let addr = l.local_addr().unwrap();
    let gid: Gid = format!("::ffff:{peer}").parse().unwrap();
    let silent = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let info = PeerInfo {
            endpoints: vec![QpEndpoint {
                qp_num: 0x77,
                psn: 0,
                gid,
                lid: 0,
                mtu: Mtu::Mtu1024,
            }],
            ..PeerInfo::default()
        };
        oob::exchange(&mut s, &info, WAIT).unwrap();
        let mut r = [0u8; 1];
        s.read_exact(&mut r).unwrap();
        s.write_all(b"R").unwrap();
        // Alive, connected, silent: read (the survivor's heartbeats) until it gives up on us.
        let mut buf = [0u8; 64];
        while matches!(s.read(&mut buf), Ok(1..)) {}
    });
    let options = Options {
        heartbeat: Some(Duration::from_millis(50)),
        peer_timeout: Some(Duration::from_millis(500)),
        ..soft(&me)
    };
    let conn = cm::connect_with(addr, WAIT, &options, |ctx| setup(ctx, 1)).unwrap();
    let t0 = Instant::now();
    let c = conn.app().cq.wait_one(WAIT).unwrap();
    let took = t0.elapsed();
    eprintln!("silent peer: receive flushed after {took:?}");
    assert_eq!(c.status, WcStatus::WrFlushErr, "{c:?}");
    let Some(QpFailure::PeerLost(PeerLoss::Silent(quiet))) = c.cause() else {
        panic!("expected a silent peer, got {:?}", c.cause());
    };
    assert!(quiet >= Duration::from_millis(500), "{quiet:?}");
    assert!(
        took >= Duration::from_millis(450),
        "lost too early: {took:?}"
    );
    assert!(
        took < Duration::from_millis(500 + 50) + DEATH_BOUND,
        "{took:?}"
    );
    assert_eq!(conn.peer_lost(), Some(PeerLoss::Silent(quiet)));
    silent.join().unwrap();
}

/// The async form: the same connection, the same liveness.
#[cfg(feature = "tokio")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_connect_and_accept_notice_a_peer_that_leaves() {
    let (me, peer) = pair();
    let listener = cm::Listener::bind_with(format!("{peer}:0"), &soft(&peer)).unwrap();
    let addr = listener.local_addr().unwrap();
    let server = listener.accept_async(WAIT, |ctx| setup(ctx, 1));
    let client = cm::connect_async(addr, WAIT, soft(&me), |ctx| setup(ctx, 1));
    let (server, client) = tokio::join!(server, client);
    let (server, client) = (server.unwrap(), client.unwrap());
    assert_eq!(client.peer_addr(), addr);
    // The server leaves; the client's posted receive is flushed for it.
    let t0 = Instant::now();
    drop(server);
    let cq = client.app().cq.clone();
    let c = tokio::task::spawn_blocking(move || cq.wait_one(WAIT))
        .await
        .unwrap()
        .unwrap();
    let took = t0.elapsed();
    eprintln!("async: the peer left, receive flushed after {took:?}");
    assert_eq!(c.status, WcStatus::WrFlushErr, "{c:?}");
    assert_eq!(c.cause(), Some(QpFailure::PeerLost(PeerLoss::Closed)));
    assert!(took < DEATH_BOUND, "{took:?}");
    client.wait_disconnected(WAIT).unwrap();
}
