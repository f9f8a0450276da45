// Memory a posted SEND reads cannot be mutated until the scope has drained.
use erdma::{Access, Context, Qp, QpConfig, SendWr};

fn run(qp: &Qp) -> erdma::Result<()> {
    let ctx = Context::open("soft:127.0.0.1")?;
    let pd = ctx.alloc_pd()?;
    let mut mr = pd.alloc(4096, Access::LOCAL_WRITE)?;
    erdma::scope(|s| -> erdma::Result<()> {
        s.post_send(qp, SendWr::send(1, &[mr.slice(0..64)]))?;
        mr.as_mut_slice()[0] = 1;
        Ok(())
    })?;
    let _ = QpConfig::new;
    Ok(())
}

fn main() {
    let _ = run;
}
