// An owned buffer moves into its request: it cannot be read (or written, or freed) until the
// request's future gives it back.
use erdma::{AsyncQp, RemoteMr};

async fn run(qp: AsyncQp, peer: RemoteMr) -> erdma::Result<()> {
    let buf = erdma::OwnedBuf::alloc(qp.qp().pd(), 4096, erdma::Access::LOCAL_WRITE)?;
    let pending = qp.read(buf, peer);
    let first = buf[0];
    let _back = pending.await?;
    let _ = first;
    Ok(())
}

fn main() {
    let _ = run;
}
