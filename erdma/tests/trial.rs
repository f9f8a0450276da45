//! The first hour of a Rust developer, replayed: a tokio echo RPC (1,000 requests of 1 B to
//! 64 KiB) and a random 4 KiB READ loop between two processes on two soft devices, written
//! against the public API only — the README, the rustdoc and the examples — with no `unsafe`
//! (forbidden below). Every byte is checked. The test spawns its own binary as the server (the
//! `#[ignore]`d `trial_server_process`, selected by environment).
//!
//! Devices: two fresh soft devices, or `ERDMA_TEST_DEV_A` / `ERDMA_TEST_DEV_B`.
#![cfg(feature = "tokio")]
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use erdma::connect::{self, Listener, PeerInfo};
use erdma::{
    Access, AsyncCq, AsyncQp, Context, InitOptions, Mr, OwnedBuf, QpConfig, RecvPool, RemoteMr,
};

const REQUESTS: usize = 1000;
const MAX_MSG: usize = 64 * 1024;
const REGION: usize = 4 << 20;
const PIECE: usize = 4096;
const READS: usize = 4000;
const TIMEOUT: Duration = Duration::from_secs(60);

fn devices() -> (String, String) {
    match (
        std::env::var("ERDMA_TEST_DEV_A"),
        std::env::var("ERDMA_TEST_DEV_B"),
    ) {
        (Ok(a), Ok(b)) => (a, b),
        _ => ("soft:127.0.60.1".into(), "soft:127.0.60.2".into()),
    }
}

fn byte(i: usize) -> u8 {
    (i.wrapping_mul(7) % 253) as u8
}

/// A connected queue pair on `dev`, the region it grants (if any) and what the peer granted.
fn connect(
    dev: &str,
    stream: &mut TcpStream,
    grant: bool,
) -> erdma::Result<(AsyncQp, Option<Mr<'static>>, Vec<RemoteMr>)> {
    let ctx = Context::open(dev)?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(512)?;
    let qp = pd.create_qp(&QpConfig::new(&cq).max_send_wr(64).max_recv_wr(64))?;
    let access = if grant {
        Access::LOCAL_WRITE | Access::REMOTE_READ
    } else {
        Access::LOCAL_WRITE
    };
    let qp = qp.init(&InitOptions {
        access,
        ..InitOptions::default()
    })?;
    let region = if grant {
        let mut r = pd.alloc(REGION, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
        let pattern: Vec<u8> = (0..REGION).map(byte).collect();
        r.as_mut_slice().copy_from_slice(&pattern);
        Some(r)
    } else {
        None
    };
    let me = PeerInfo {
        endpoints: vec![qp.endpoint()?],
        regions: region.iter().map(Mr::remote).collect(),
        user: Vec::new(),
    };
    let peer = connect::exchange(stream, &me, TIMEOUT)?;
    let qp = qp.connect(&peer.endpoints[0], &Default::default())?;
    let qp = AsyncQp::new(qp, Arc::new(AsyncCq::new(cq)?))?;
    Ok((qp, region, peer.regions))
}

/// Echoes each request from the buffer it landed in until an empty one; then waits for the
/// client to close the TCP connection (it READs our region meanwhile).
fn server(dev: String, listener: Listener) {
    let (mut stream, _) = listener.accept(TIMEOUT).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (qp, _region, _) = connect(&dev, &mut stream, true).unwrap();
        let mut pool = RecvPool::new(&qp, 16, MAX_MSG).unwrap();
        loop {
            let msg = tokio::time::timeout(TIMEOUT, pool.next())
                .await
                .expect("a request within the timeout")
                .unwrap();
            if msg.len == 0 {
                break;
            }
            let buf = qp.send_with_imm(msg.buf, msg.len as u32).await.unwrap();
            pool.repost(buf).unwrap();
        }
        let mut byte = [0u8; 1];
        let _ = connect::read_exact_by(
            &mut stream,
            &mut byte,
            Instant::now() + TIMEOUT,
            "the client's close",
        );
    });
}

/// The request `i`: its length (1 B .. 64 KiB, the extremes included) and bytes.
fn request(i: usize) -> Vec<u8> {
    let len = match i {
        0 => 1,
        1 => MAX_MSG,
        _ => 1 + (i * 104_729) % MAX_MSG,
    };
    (0..len).map(|k| (i * 31 + k) as u8).collect()
}

async fn echo(qp: &AsyncQp) {
    let pd = qp.qp().pd().clone();
    let window = 4;
    let mut pool = RecvPool::new(qp, window, MAX_MSG).unwrap();
    let mut free = OwnedBuf::alloc(&pd, window * MAX_MSG, Access::LOCAL_WRITE)
        .unwrap()
        .chunks(MAX_MSG);
    let mut sent = VecDeque::new();
    let mut next_reply = 0;
    let start = Instant::now();
    for i in 0..=REQUESTS {
        if free.is_empty() || i == REQUESTS {
            // Replies come in request order; check the oldest, take its send buffer back.
            while next_reply < i && (free.is_empty() || i == REQUESTS) {
                let reply = pool.next().await.unwrap();
                let want = request(next_reply);
                assert_eq!(reply.imm, Some(want.len() as u32));
                assert_eq!(&reply.buf[..], &want[..], "reply {next_reply}");
                pool.repost(reply.buf).unwrap();
                let posted: erdma::Posted<OwnedBuf> = sent.pop_front().unwrap();
                free.push(posted.await.unwrap());
                next_reply += 1;
            }
            if i == REQUESTS {
                break;
            }
        }
        let mut buf = free.pop().unwrap();
        let data = request(i);
        buf.set_len(data.len());
        buf.copy_from_slice(&data);
        sent.push_back(qp.send(buf));
    }
    println!(
        "echo: {REQUESTS} requests of 1 B .. 64 KiB in {:?}",
        start.elapsed()
    );
    let mut end = free.pop().unwrap();
    end.set_len(0);
    qp.send(end).await.unwrap();
}

/// Random 4 KiB READs, `depth` in flight, each a task of its own (the futures are `'static`
/// and `Send`); returns the bytes per second.
async fn read_loop(qp: &AsyncQp, remote: RemoteMr, depth: usize) -> f64 {
    let pd = qp.qp().pd().clone();
    let bufs = OwnedBuf::alloc(&pd, depth * PIECE, Access::LOCAL_WRITE)
        .unwrap()
        .chunks(PIECE);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (t, mut buf) in bufs.into_iter().enumerate() {
        let qp = qp.clone();
        tasks.push(tokio::spawn(async move {
            let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ t as u64;
            for _ in 0..READS / depth {
                seed = seed
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let at = (seed >> 33) as usize % (REGION - PIECE);
                let src = remote.slice(at as u64, PIECE as u64).unwrap();
                buf = qp.read(buf, src).await.unwrap();
                let ok = buf.iter().enumerate().all(|(k, &b)| b == byte(at + k));
                assert!(ok, "READ at {at} differs");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    (READS / depth * depth * PIECE) as f64 / start.elapsed().as_secs_f64()
}

#[test]
#[ignore = "entry point of the server process spawned by the trial"]
fn trial_server_process() {
    let (Ok(dev), Ok(listen)) = (
        std::env::var("ERDMA_TRIAL_DEVICE"),
        std::env::var("ERDMA_TRIAL_LISTEN"),
    ) else {
        panic!("trial_server_process needs ERDMA_TRIAL_DEVICE and ERDMA_TRIAL_LISTEN");
    };
    server(dev, Listener::bind(listen.as_str()).unwrap());
}

#[test]
fn echo_rpc_and_random_reads_with_safe_async_code() {
    let (dev_a, dev_b) = devices();
    let addr = format!("127.0.0.1:{}", 20000 + (std::process::id() % 20000) as u16);
    let mut server = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "trial_server_process",
            "--nocapture",
        ])
        .env("ERDMA_TRIAL_DEVICE", &dev_b)
        .env("ERDMA_TRIAL_LISTEN", &addr)
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut stream = connect::dial(addr.as_str(), TIMEOUT).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (qp, _, peer) = connect(&dev_a, &mut stream, false).unwrap();
        tokio::time::timeout(TIMEOUT, echo(&qp))
            .await
            .expect("the echo within the timeout");
        let bps = tokio::time::timeout(TIMEOUT, read_loop(&qp, peer[0], 8))
            .await
            .expect("the READs within the timeout");
        println!(
            "random {PIECE}-byte READs: {:.1} MB/s ({READS} READs, bytes checked)",
            bps / 1e6
        );
    });
    drop(stream);
    let status = server.wait().unwrap();
    assert!(status.success(), "the server process failed: {status}");
}
