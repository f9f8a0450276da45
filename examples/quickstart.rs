//! The README's first program: one queue pair connected to itself on the soft device, a SEND
//! into its own receive buffer, from async code with owned buffers.

use std::sync::Arc;

use erdma::{Access, AsyncCq, AsyncQp, Context, InitOptions, OwnedBuf, QpConfig};

#[tokio::main(flavor = "current_thread")]
async fn main() -> erdma::Result<()> {
    let ctx = Context::open("soft:127.0.0.1")?; // or Context::open_default()
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(256)?;
    let qp = pd
        .create_qp(&QpConfig::new(&cq))?
        .init(&InitOptions::default())?;
    let me = qp.endpoint()?; // exchange with the peer (erdma::connect does it over TCP)
    let peer = me; // (here: a loopback connection to ourselves)
    let qp = qp.connect(&peer, &Default::default())?;
    let qp = AsyncQp::new(qp, Arc::new(AsyncCq::new(cq)?))?;

    // Registered buffers owned by value: each moves into its request and comes back with the
    // completion, so the device never shares them with your code (and no `unsafe`, no scope).
    let inbox = OwnedBuf::alloc(&pd, 4096, Access::LOCAL_WRITE)?;
    let mut hello = OwnedBuf::alloc(&pd, 5, Access::LOCAL_WRITE)?;
    hello.copy_from_slice(b"hello");
    let received = qp.recv(inbox); // posted now; a future of the message
    let _hello = qp.send(hello).await?; // the buffer is back once the device is done
    let msg = received.await?;
    println!(
        "received {:?}",
        std::str::from_utf8(&msg.buf).unwrap_or("?")
    );
    Ok(())
}
