//! A two-process echo over SEND/RECV with owned buffers on tokio.
//!
//! `async_echo` alone runs both ends: it listens, starts itself as the client, and echoes.
//! `async_echo --server [DEV]` and `async_echo --client ADDR [DEV]` run one end each.
//!
//! Each buffer is an `OwnedBuf`: it moves into the request and comes back with the completion,
//! so there is no `unsafe` and no scope, and a dropped future can never free memory the device
//! still uses. The server echoes without copying: the buffer a message landed in is the buffer
//! it sends back, then it is posted again for the next message.

use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use erdma::connect::{self, Listener, PeerInfo};
use erdma::{Access, AsyncCq, AsyncQp, Context, InitOptions, OwnedBuf, QpConfig, RecvPool};

const MAX_MSG: usize = 64 * 1024;
const MESSAGES: usize = 200;
const TIMEOUT: Duration = Duration::from_secs(30);

/// The connection set-up: one queue pair on `dev`, connected to the peer at the other end of
/// `stream` through the SDK's out-of-band exchange; keep the stream while the queue pair is
/// used. (Isolated so a one-call connect can replace it; call it inside the runtime.)
fn connect(dev: &str, stream: &mut TcpStream) -> erdma::Result<AsyncQp> {
    let ctx = Context::open(dev)?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(256)?;
    let qp = pd.create_qp(&QpConfig::new(&cq))?;
    let qp = qp.init(&InitOptions::default())?;
    let me = PeerInfo {
        endpoints: vec![qp.endpoint()?],
        ..Default::default()
    };
    let peer = connect::exchange(stream, &me, TIMEOUT)?;
    let qp = qp.connect(&peer.endpoints[0], &Default::default())?;
    AsyncQp::new(qp, Arc::new(AsyncCq::new(cq)?))
}

/// Echoes every message back from the buffer it landed in, until an empty one.
async fn server(qp: AsyncQp) -> erdma::Result<()> {
    let mut pool = RecvPool::new(&qp, 8, MAX_MSG)?;
    loop {
        let msg = pool.next().await?;
        if msg.len == 0 {
            return Ok(());
        }
        let buf = qp.send(msg.buf).await?; // zero-copy: the same buffer goes back
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
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    match args.first().map(String::as_str) {
        Some("--client") => {
            let addr = args.get(1).ok_or("--client needs the server's address")?;
            let dev = args.get(2).map_or("soft:127.0.0.1", String::as_str);
            let mut stream = connect::dial(addr.as_str(), TIMEOUT)?;
            rt.block_on(async { client(connect(dev, &mut stream)?).await })?;
        }
        Some("--server") | None => {
            let dev = args.get(1).map_or("soft:127.0.0.2", String::as_str);
            let listener = Listener::bind("127.0.0.1:0")?;
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
            let (mut stream, _) = listener.accept(TIMEOUT)?;
            rt.block_on(async { server(connect(dev, &mut stream)?).await })?;
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
