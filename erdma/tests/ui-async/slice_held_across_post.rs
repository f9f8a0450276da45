// A view of an owned buffer's bytes cannot outlive the move of the buffer into a request.
use erdma::AsyncQp;

async fn run(qp: AsyncQp) -> erdma::Result<()> {
    let mut buf = erdma::OwnedBuf::alloc(qp.qp().pd(), 4096, erdma::Access::LOCAL_WRITE)?;
    let view: &mut [u8] = &mut buf;
    let pending = qp.recv(buf);
    view[0] = 1;
    let _got = pending.await?;
    Ok(())
}

fn main() {
    let _ = run;
}
