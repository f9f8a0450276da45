// Owned requests need a connected queue pair (RTS), like every other send.
use std::sync::Arc;

use erdma::{AsyncCq, AsyncQp, Init, Qp};

fn run(qp: Qp<Init>, cq: Arc<AsyncCq>) -> erdma::Result<AsyncQp> {
    AsyncQp::new(qp, cq)
}

fn main() {
    let _ = run;
}
