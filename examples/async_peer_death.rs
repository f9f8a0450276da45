//! A dead peer, noticed: a connection made in one call (`erdma::connect::cm`) watches its peer,
//! and when the peer's process dies every request still posted — receives included, which RC
//! alone never times out — completes with a flush error that names the lost peer.
//!
//! `async_peer_death` alone listens, starts itself as the peer (`--peer ADDR`), sends it one
//! request and waits for the answer. The peer's device acknowledges the request, then the peer
//! exits without answering and without disconnecting, as a crashed process would. The waiting
//! receives fail within the bound `Connection`'s docs state, and say why.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use erdma::connect::cm::{self, Connection, Options, Setup};
use erdma::{
    Access, AsyncCq, AsyncQp, Context, Cq, Error, OwnedBuf, QpConfig, QpFailure, RecvPool,
};

const TIMEOUT: Duration = Duration::from_secs(30);
/// `Connection`'s docs: a peer whose process dies is noticed as its socket closes (a few
/// milliseconds on loopback); this leaves room for a loaded machine.
const BOUND: Duration = Duration::from_millis(500);

/// Soft devices on loopback: the listener on 127.0.0.1, the peer on 127.0.0.2.
fn on(ip: &str) -> Options {
    Options {
        device: Some(format!("soft:{ip}")),
        ..Options::default()
    }
}

/// Each side: a queue pair on its own completion queue, which the connection hands back.
fn setup(ctx: &Context) -> erdma::Result<Setup<Cq>> {
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(64)?;
    Ok(Setup::new(&pd, QpConfig::new(&cq)).with(cq))
}

/// The connection's queue pair for async code. Keep the connection: it is the liveness watch.
fn async_qp(conn: &Connection<Cq>) -> erdma::Result<AsyncQp> {
    AsyncQp::new(
        conn.qp().clone(),
        Arc::new(AsyncCq::new(conn.app().clone())?),
    )
}

/// The peer: takes one request and dies with it unanswered.
async fn peer(addr: String) -> erdma::Result<()> {
    let conn = cm::connect_async(addr, TIMEOUT, on("127.0.0.2"), setup).await?;
    let qp = async_qp(&conn)?;
    let inbox = OwnedBuf::alloc(qp.qp().pd(), 64, Access::LOCAL_WRITE)?;
    let req = qp.recv(inbox).await?;
    println!("peer: got {:?}, exiting", String::from_utf8_lossy(&req.buf));
    // Work on it a moment (the device acknowledges the request meanwhile), then crash.
    tokio::time::sleep(Duration::from_millis(100)).await;
    std::process::exit(0) // no disconnect, no destructors: as if the process crashed
}

async fn survivor() -> Result<(), Box<dyn std::error::Error>> {
    let listener = cm::Listener::bind_with("127.0.0.1:0", &on("127.0.0.1"))?;
    let addr = listener.local_addr()?.to_string();
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--peer", &addr])
        .spawn()?;
    let conn = listener.accept_async(TIMEOUT, setup).await?;
    let qp = async_qp(&conn)?;

    // Receives for the answers, then the request. Its completion means the peer's device has
    // acknowledged it: from here on only the peer's application could answer.
    let mut answers = RecvPool::new(&qp, 4, 64)?;
    let mut req = OwnedBuf::alloc(qp.qp().pd(), 5, Access::LOCAL_WRITE)?;
    req.copy_from_slice(b"hello");
    qp.send(req).await?;
    println!("request acknowledged; waiting for the answer");

    let died = tokio::task::spawn_blocking(move || child.wait().map(|_| Instant::now()));
    let answer = answers.next().await;
    let failed = Instant::now();
    let died = died.await??;
    match answer {
        Err(e @ Error::Completion(_)) => {
            let Error::Completion(c) = &e else {
                unreachable!()
            };
            let late = failed.saturating_duration_since(died);
            println!("the answer's receive failed {late:?} after the peer died: {e}");
            let Some(QpFailure::PeerLost(how)) = c.cause() else {
                return Err(format!("a flush that does not name the lost peer: {c:?}").into());
            };
            println!("cause: {how}; connection says {:?}", conn.peer_lost());
            if late > BOUND {
                return Err(format!("noticed after {late:?}, over {BOUND:?}").into());
            }
            println!("peer death noticed within {BOUND:?}");
            Ok(())
        }
        Err(e) => Err(format!("the receive failed otherwise: {e}").into()),
        Ok(m) => Err(format!("an answer from a dead peer? {} bytes", m.len).into()),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("--peer") => {
            let addr = args
                .get(1)
                .ok_or("--peer needs the listener's address")?
                .clone();
            rt.block_on(peer(addr))?;
            Ok(())
        }
        None => rt.block_on(survivor()),
        Some(other) => Err(format!("unknown argument {other}").into()),
    }
}
