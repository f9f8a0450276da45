//! One-sided READ and WRITE from async code with owned buffers.
//!
//! The server grants a region (REMOTE_READ | REMOTE_WRITE) and does nothing more until the
//! client says it is done: it never sees the READs. The client READs scattered 4 KiB pieces of
//! the region, several in flight at once, checks them, WRITEs a block back, and rings the
//! server with a WRITE_WITH_IMM; the server then checks what was written.
//!
//! `async_rdma` alone runs both ends (the client as a second process);
//! `async_rdma --server [DEV]` and `async_rdma --client ADDR [DEV]` run one each.

use std::collections::VecDeque;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use erdma::connect::{self, Listener, PeerInfo};
use erdma::{Access, AsyncCq, AsyncQp, Context, InitOptions, Mr, OwnedBuf, QpConfig, RecvPool};
use erdma::{RemoteMr, Result};

const REGION: usize = 1 << 20;
const PIECE: usize = 4096;
const READS: usize = 256;
const IN_FLIGHT: usize = 8;
const TIMEOUT: Duration = Duration::from_secs(30);

/// What byte `i` of the granted region holds.
fn byte(i: usize) -> u8 {
    (i % 251) as u8
}

/// The connection set-up: a queue pair on `dev` connected through the SDK's out-of-band
/// exchange, offering `grant` to the peer; returns what the peer offered. Call it inside the
/// runtime. (Isolated so a one-call connect can replace it.)
fn connect(dev: &str, stream: &mut TcpStream, grant: Option<Access>) -> Result<Side> {
    let ctx = Context::open(dev)?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(256)?;
    let qp = pd.create_qp(&QpConfig::new(&cq))?;
    let access = grant.unwrap_or(Access::LOCAL_WRITE);
    let qp = qp.init(&InitOptions {
        access,
        ..Default::default()
    })?;
    let mut region = grant.map(|a| pd.alloc(REGION, a)).transpose()?;
    if let Some(r) = &mut region {
        // Filled before the exchange: once the peer has the key, it may read at once.
        r.write_at(0, &(0..REGION).map(byte).collect::<Vec<u8>>())?;
    }
    let me = PeerInfo {
        endpoints: vec![qp.endpoint()?],
        regions: region.iter().map(Mr::remote).collect(),
        ..Default::default()
    };
    let peer = connect::exchange(stream, &me, TIMEOUT)?;
    let qp = qp.connect(&peer.endpoints[0], &Default::default())?;
    let qp = AsyncQp::new(qp, Arc::new(AsyncCq::new(cq)?))?;
    Ok(Side(qp, region, peer.regions))
}

/// A queue pair, the region this side grants, and the regions the peer granted.
struct Side(AsyncQp, Option<Mr<'static>>, Vec<RemoteMr>);

async fn server(side: Side) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let Side(qp, region, _) = side;
    let region = region.expect("the server grants a region");
    // One receive, for the client's WRITE_WITH_IMM: its immediate is the block's offset.
    let mut pool = RecvPool::new(&qp, 1, 64)?;
    // (Bounded: until the SDK notices a dead peer by itself, a lost client would hang us.)
    let done = tokio::time::timeout(TIMEOUT, pool.next())
        .await
        .map_err(|_| "no bell")??;
    let at = done.imm.expect("WRITE_WITH_IMM carries an immediate") as usize;
    // Peers may write this region at any time, so it gives copies, never references.
    let written = region.to_vec(at..at + PIECE);
    assert!(written.iter().all(|&b| b == 0xAB), "no block at {at}");
    println!("server: the client's WRITE landed at offset {at}");
    Ok(())
}

async fn client(side: Side) -> Result<()> {
    let Side(qp, _, peer) = side;
    let remote = peer[0];
    let pd = qp.qp().pd().clone();
    // IN_FLIGHT buffers; each READ moves one in, its completion gives it back.
    let mut free = OwnedBuf::alloc(&pd, PIECE * IN_FLIGHT, Access::LOCAL_WRITE)?.chunks(PIECE);
    let mut pending = VecDeque::new();
    for i in 0..READS {
        if free.is_empty() {
            let (at, done) = pending.pop_front().expect("a READ is in flight");
            free.push(check(at, done).await?);
        }
        let at = i * 7919 % (REGION / PIECE) * PIECE; // scattered over the region
        let src = remote.slice(at as u64, PIECE as u64)?;
        let buf = free.pop().expect("a free buffer");
        pending.push_back((at, qp.read(buf, src)));
    }
    while let Some((at, done)) = pending.pop_front() {
        free.push(check(at, done).await?);
    }
    println!("client: {READS} scattered {PIECE}-byte READs checked");
    // WRITE a block, then tell the server where (the immediate) with a WRITE_WITH_IMM.
    let mut block = free.pop().expect("a free buffer");
    block.fill(0xAB);
    let at = 3 * PIECE;
    let mut block = qp
        .write(block, remote.slice(at as u64, PIECE as u64)?)
        .await?;
    block.set_len(0); // the bell carries no bytes, only its immediate
    qp.write_with_imm(block, remote.slice(at as u64, 0)?, at as u32)
        .await?;
    Ok(())
}

/// Waits for a READ of the piece at `at` and checks its bytes.
async fn check(at: usize, done: erdma::Posted<OwnedBuf>) -> Result<OwnedBuf> {
    let buf = done.await?;
    let ok = buf.iter().enumerate().all(|(k, &b)| b == byte(at + k));
    assert!(ok, "the piece at {at} differs");
    Ok(buf)
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    if args.first().map(String::as_str) == Some("--client") {
        let addr = args.get(1).ok_or("--client needs the server's address")?;
        let dev = args.get(2).map_or("soft:127.0.0.1", String::as_str);
        let mut stream = connect::dial(addr.as_str(), TIMEOUT)?;
        return Ok(rt.block_on(async { client(connect(dev, &mut stream, None)?).await })?);
    }
    let dev = args.get(1).map_or("soft:127.0.0.2", String::as_str);
    let listener = Listener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    let me = std::env::current_exe()?; // alone: the client is a second process
    let spawn = || {
        std::process::Command::new(&me)
            .args(["--client", &addr])
            .spawn()
    };
    let child = args.is_empty().then(spawn).transpose()?;
    let (mut stream, _) = listener.accept(TIMEOUT)?;
    let grant = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    rt.block_on(async { server(connect(dev, &mut stream, Some(grant))?).await })?;
    match child.map(|mut c| c.wait()).transpose()? {
        Some(status) if !status.success() => Err(format!("the client failed: {status}").into()),
        _ => Ok(()),
    }
}
