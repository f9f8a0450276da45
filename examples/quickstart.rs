//! The README's first program: one queue pair connected to itself on the soft device, a SEND
//! into its own receive buffer.

use erdma::{Access, Context, InitOptions, QpConfig, RecvWr, SendWr};
use std::time::Duration;

fn main() -> erdma::Result<()> {
    let ctx = Context::open("soft:127.0.0.1")?; // or Context::open_default()
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(256)?;
    let mut mr = pd.alloc(4096, Access::LOCAL_WRITE)?;
    mr.as_mut_slice()[2048..2053].copy_from_slice(b"hello");
    let qp = pd
        .create_qp(&QpConfig::new(&cq))?
        .init(&InitOptions::default())?;
    let me = qp.endpoint()?; // exchange with the peer (erdma::connect does it over TCP)
    let peer = me; // (here: a loopback connection to ourselves)
    let qp = qp.connect(&peer, &Default::default())?;
    erdma::scope(|s| -> erdma::Result<()> {
        let (recv_buf, send_buf) = mr.slice_mut(..).split_at(2048);
        s.post_recv(&qp, RecvWr::new(1, recv_buf))?;
        s.post_send(&qp, SendWr::send(2, &[send_buf.into_local().get(..5)?]))?;
        for _ in 0..2 {
            cq.wait_one(Duration::from_secs(5))?.ok()?;
        }
        Ok(())
    })?; // the device is done with `mr` here
    println!(
        "received {:?}",
        std::str::from_utf8(&mr.as_slice()[..5]).unwrap_or("?")
    );
    Ok(())
}
