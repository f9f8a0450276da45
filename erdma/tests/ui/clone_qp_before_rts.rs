// Only a connected queue pair can be shared; earlier states belong to one owner.
use erdma::{Context, QpConfig};

fn main() -> erdma::Result<()> {
    let ctx = Context::open("soft:127.0.0.1")?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(16)?;
    let qp = pd.create_qp(&QpConfig::new(&cq))?;
    let other = qp.clone();
    let _ = (qp, other);
    Ok(())
}
