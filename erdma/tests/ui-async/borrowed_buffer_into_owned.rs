// Only a region over memory that lives as long as it does can become an owned buffer: borrowed
// memory would be freed while a request (or its parked buffer) still uses it.
use erdma::{Access, OwnedBuf, Pd};

fn run(pd: &Pd) -> erdma::Result<OwnedBuf> {
    let mut mem = vec![0u8; 4096];
    let mr = pd.register_slice(&mut mem, Access::LOCAL_WRITE)?;
    Ok(OwnedBuf::from_mr(mr))
}

fn main() {
    let _ = run;
}
