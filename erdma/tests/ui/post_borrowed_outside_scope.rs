// Outside a scope, only memory that lives forever can be posted.
use erdma::{Access, Context, Qp, SendWr};

fn run(qp: &Qp) -> erdma::Result<()> {
    let ctx = Context::open("soft:127.0.0.1")?;
    let pd = ctx.alloc_pd()?;
    let mr = pd.alloc(4096, Access::LOCAL_WRITE)?;
    qp.post_send(SendWr::send(1, &[mr.slice(..)]))?;
    Ok(())
}

fn main() {
    let _ = run;
}
