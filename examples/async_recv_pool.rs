//! A zero-copy receive pool: messages are read where they landed, then the buffer is posted
//! again.
//!
//! The receiver keeps `POOL` receive buffers posted with a `RecvPool`; each `next().await`
//! hands over the oldest message as an `OwnedBuf` (no copy, no `unsafe`), and `repost` gives
//! the buffer back to the device. The sender keeps at most `POOL` SENDs in flight, so it never
//! outruns the posted receives by much (RC would retry one that finds no receive: slower, not
//! wrong).
//!
//! `async_recv_pool` alone runs both ends (the sender as a second process);
//! `async_recv_pool --server [DEV]` and `async_recv_pool --client ADDR [DEV]` run one each.

use std::collections::VecDeque;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use erdma::connect::{self, Listener, PeerInfo};
use erdma::{Access, AsyncCq, AsyncQp, Context, InitOptions, OwnedBuf, QpConfig, RecvPool};

const POOL: usize = 16;
const SIZE: usize = 8192;
const MESSAGES: u32 = 1000;
const END: u32 = u32::MAX;
const TIMEOUT: Duration = Duration::from_secs(30);

/// The bytes of message `seq`: its length and contents follow from its number.
fn message(seq: u32) -> impl Iterator<Item = u8> {
    let len = 1 + (seq as usize * 997) % SIZE;
    (0..len).map(move |k| (seq as usize + k * 31) as u8)
}

/// The connection set-up: a queue pair on `dev` connected through the SDK's out-of-band
/// exchange. Call it inside the runtime. (Isolated so a one-call connect can replace it.)
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

/// Takes each message in place, checks it, and posts its buffer again.
async fn receiver(qp: AsyncQp) -> erdma::Result<()> {
    let mut pool = RecvPool::new(&qp, POOL, SIZE)?;
    let (start, mut count, mut bytes) = (Instant::now(), 0u32, 0usize);
    loop {
        let msg = pool.next().await?;
        let seq = msg.imm.expect("every message carries its number");
        if seq == END {
            break;
        }
        // `msg.buf` derefs to the bytes received, where the device put them.
        assert!(
            msg.buf.iter().copied().eq(message(seq)),
            "message {seq} differs"
        );
        assert_eq!(seq, count, "messages arrive in order");
        bytes += msg.len;
        count += 1;
        pool.repost(msg.buf)?;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "received {count} messages, {bytes} bytes, {:.0} msg/s, zero copies",
        count as f64 / secs
    );
    Ok(())
}

/// Sends the messages with at most `POOL` in flight, then the end mark.
async fn sender(qp: AsyncQp) -> erdma::Result<()> {
    let pd = qp.qp().pd().clone();
    let mut free = OwnedBuf::alloc(&pd, POOL * SIZE, Access::LOCAL_WRITE)?.chunks(SIZE);
    let mut in_flight = VecDeque::new();
    for seq in (0..MESSAGES).chain([END]) {
        let mut buf = match free.pop() {
            Some(b) => b,
            None => in_flight.pop_front().expect("a send in flight").await?,
        };
        buf.set_len(buf.capacity());
        let mut len = 0;
        if seq != END {
            for (dst, b) in buf.iter_mut().zip(message(seq)) {
                *dst = b;
                len += 1;
            }
        }
        buf.set_len(len);
        in_flight.push_back(qp.send_with_imm(buf, seq));
    }
    for sent in in_flight {
        sent.await?;
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    if args.first().map(String::as_str) == Some("--client") {
        let addr = args.get(1).ok_or("--client needs the server's address")?;
        let dev = args.get(2).map_or("soft:127.0.0.1", String::as_str);
        let mut stream = connect::dial(addr.as_str(), TIMEOUT)?;
        return Ok(rt.block_on(async { sender(connect(dev, &mut stream)?).await })?);
    }
    let dev = args.get(1).map_or("soft:127.0.0.2", String::as_str);
    let listener = Listener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    let child = match args.first() {
        None => Some(
            std::process::Command::new(std::env::current_exe()?)
                .args(["--client", &addr])
                .spawn()?,
        ),
        _ => None,
    };
    let (mut stream, _) = listener.accept(TIMEOUT)?;
    rt.block_on(async { receiver(connect(dev, &mut stream)?).await })?;
    if let Some(status) = child.map(|mut c| c.wait()).transpose()? {
        if !status.success() {
            return Err(format!("the sender failed: {status}").into());
        }
    }
    Ok(())
}
