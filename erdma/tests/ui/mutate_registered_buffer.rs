// A buffer registered as a memory region can only be reached through the region.
use erdma::{Access, Context};

fn main() -> erdma::Result<()> {
    let ctx = Context::open("soft:127.0.0.1")?;
    let pd = ctx.alloc_pd()?;
    let mut buf = vec![0u8; 4096];
    let mr = pd.register_slice(&mut buf, Access::LOCAL_WRITE)?;
    buf[0] = 1;
    drop(mr);
    Ok(())
}
