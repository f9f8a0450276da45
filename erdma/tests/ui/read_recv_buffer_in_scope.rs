// A receive buffer handed to the device cannot be read until the scope has drained.
use erdma::{Access, Context, Qp, RecvWr};

fn run(qp: &Qp) -> erdma::Result<()> {
    let ctx = Context::open("soft:127.0.0.1")?;
    let pd = ctx.alloc_pd()?;
    let mut mr = pd.alloc(4096, Access::LOCAL_WRITE)?;
    let mut buf = mr.slice_mut(0..64);
    erdma::scope(|s| -> erdma::Result<()> {
        s.post_recv(qp, RecvWr::new(1, buf.reborrow()))?;
        let first = buf[0];
        let _ = first;
        Ok(())
    })?;
    Ok(())
}

fn main() {
    let _ = run;
}
