// Sending needs a queue pair in RTS: the types say so.
use erdma::{Context, InitOptions, QpConfig, SendWr};

fn main() -> erdma::Result<()> {
    let ctx = Context::open("soft:127.0.0.1")?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(16)?;
    let qp = pd.create_qp(&QpConfig::new(&cq))?.init(&InitOptions::default())?;
    qp.post_send(SendWr::send_inline(1, b"hi"))?;
    Ok(())
}
