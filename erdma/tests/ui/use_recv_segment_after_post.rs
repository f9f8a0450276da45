// Posting moves a receive segment into the request: it cannot be used again.
use erdma::{Access, Context, Qp, RecvWr};

fn run(qp: &Qp) -> erdma::Result<()> {
    let ctx = Context::open("soft:127.0.0.1")?;
    let pd = ctx.alloc_pd()?;
    let mut mr = pd.alloc(4096, Access::LOCAL_WRITE)?;
    erdma::scope(|s| -> erdma::Result<()> {
        let mut seg = mr.slice_mut(0..64);
        s.post_recv(qp, RecvWr::new(1, seg))?;
        seg[0] = 7;
        Ok(())
    })?;
    Ok(())
}

fn main() {
    let _ = run;
}
