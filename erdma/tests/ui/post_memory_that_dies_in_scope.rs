// Memory created inside a scope does not outlive it, so it cannot be posted through it.
use erdma::{Access, Context, Qp, SendWr};

fn run(qp: &Qp) -> erdma::Result<()> {
    let ctx = Context::open("soft:127.0.0.1")?;
    let pd = ctx.alloc_pd()?;
    erdma::scope(|s| -> erdma::Result<()> {
        let mr = pd.alloc(4096, Access::LOCAL_WRITE)?;
        s.post_send(qp, SendWr::send(1, &[mr.slice(..)]))?;
        Ok(())
    })?;
    Ok(())
}

fn main() {
    let _ = run;
}
