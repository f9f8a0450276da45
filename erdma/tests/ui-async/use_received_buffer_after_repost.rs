// Giving a receive buffer back to the pool moves it: the message cannot be read after.
use erdma::RecvPool;

async fn run(pool: &mut RecvPool) -> erdma::Result<()> {
    let got = pool.next().await?;
    pool.repost(got.buf)?;
    let first = got.buf[0];
    let _ = first;
    Ok(())
}

fn main() {
    let _ = run;
}
