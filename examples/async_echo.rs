//! A two-process echo over SEND/RECV with owned buffers on tokio.
//!
//! `async_echo` alone runs both ends: it listens, starts itself as the client, and echoes.
//! `async_echo --server [IP]` and `async_echo --client ADDR [IP]` run one end each, on the soft
//! device at IP. The connection is made in one call (`erdma::connect::cm`) and watches the peer.
//!
//! Each buffer is an `OwnedBuf`: it moves into the request and comes back with the completion,
//! so there is no `unsafe` and no scope, and a dropped future can never free memory the device
//! still uses. The server echoes without copying: the buffer a message landed in is the buffer
//! it sends back, then it is posted again for the next message.

use std::sync::Arc;
use std::time::{Duration, Instant};

use erdma::connect::cm::{self, Connection, Options, Setup};
use erdma::{Access, AsyncCq, AsyncQp, Context, Cq, OwnedBuf, QpConfig, RecvPool};

const MAX_MSG: usize = 64 * 1024;
const MESSAGES: usize = 200;
const TIMEOUT: Duration = Duration::from_secs(30);

/// A soft device at `ip` for the connection.
fn on(ip: &str) -> Options {
    Options {
        device: Some(format!("soft:{ip}")),
        ..Options::default()
    }
}

/// Each side's queue pair, on a completion queue of its own that the connection hands back.
fn setup(ctx: &Context) -> erdma::Result<Setup<Cq>> {
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(256)?;
    Ok(Setup::new(&pd, QpConfig::new(&cq)).with(cq))
}

/// The connection's queue pair for async code. Keep the connection while it is used: it
/// watches the peer, and fails every posted request if the peer goes away.
fn async_qp(conn: &Connection<Cq>) -> erdma::Result<AsyncQp> {
    AsyncQp::new(
        conn.qp().clone(),
        Arc::new(AsyncCq::new(conn.app().clone())?),
    )
}

/// Echoes every message back from the buffer it landed in, until an empty one (echoed too: the
/// last word is the client's, so neither side leaves with a request unacknowledged).
async fn server(qp: AsyncQp) -> erdma::Result<()> {
    let mut pool = RecvPool::new(&qp, 8, MAX_MSG)?;
    loop {
        let msg = pool.next().await?;
        let last = msg.len == 0;
        let buf = qp.send(msg.buf).await?; // zero-copy: the same buffer goes back
        if last {
            return Ok(());
        }
        pool.repost(buf)?;
    }
}

/// Sends messages of 1 B to 64 KiB and checks each echo byte for byte.
async fn client(qp: AsyncQp) -> erdma::Result<()> {
    let pd = qp.qp().pd().clone();
    let mut pool = RecvPool::new(&qp, 2, MAX_MSG)?;
    let mut out = OwnedBuf::alloc(&pd, MAX_MSG, Access::LOCAL_WRITE)?;
    let start = Instant::now();
    let mut bytes = 0;
    for i in 0..MESSAGES {
        let len = 1 + (i * 7919) % MAX_MSG;
        out.set_len(len);
        out.iter_mut()
            .enumerate()
            .for_each(|(k, b)| *b = (i + k) as u8);
        // Post the send, then wait for the echo; the send's completion gives `out` back.
        let sent = qp.send(out);
        let echo = pool.next().await?;
        out = sent.await?;
        assert_eq!(&echo.buf[..], &out[..], "echo {i} differs");
        pool.repost(echo.buf)?;
        bytes += len;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{MESSAGES} echoes, {bytes} bytes each way, {:.0} echoes/s",
        MESSAGES as f64 / secs
    );
    out.set_len(0);
    qp.send(out).await?; // an empty message ends the server's loop
    pool.next().await?; // and comes back once the server is done
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    match args.first().map(String::as_str) {
        Some("--client") => {
            let addr = args
                .get(1)
                .ok_or("--client needs the server's address")?
                .clone();
            let ip = args.get(2).map_or("127.0.0.1", String::as_str);
            rt.block_on(async {
                let conn = cm::connect_async(addr, TIMEOUT, on(ip), setup).await?;
                client(async_qp(&conn)?).await
            })?;
        }
        Some("--server") | None => {
            let ip = args.get(1).map_or("127.0.0.2", String::as_str);
            let listener = cm::Listener::bind_with(format!("{ip}:0"), &on(ip))?;
            let addr = listener.local_addr()?.to_string();
            println!("listening on {addr}");
            // Alone, start the client as a second process.
            let child = match args.first() {
                None => Some(
                    std::process::Command::new(std::env::current_exe()?)
                        .args(["--client", &addr])
                        .spawn()?,
                ),
                Some(_) => None,
            };
            rt.block_on(async {
                let conn = listener.accept_async(TIMEOUT, setup).await?;
                server(async_qp(&conn)?).await
            })?;
            if let Some(mut child) = child {
                let status = child.wait()?;
                if !status.success() {
                    return Err(format!("the client failed: {status}").into());
                }
            }
            println!("echo server done");
        }
        Some(other) => return Err(format!("unknown argument {other}").into()),
    }
    Ok(())
}
