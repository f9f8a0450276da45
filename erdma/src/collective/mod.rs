//! Collective communication: a ring AllReduce over RC queue pairs, and the reusable pieces it
//! is built from.
//!
//! - [`Bootstrap`]: ranks find each other over TCP (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
//!   `MASTER_PORT`, as torchrun and mpirun set them) and swap setup data, with bounded waits;
//!   a launcher can bind rank 0's socket first and hand it over ([`MasterSocket`]).
//! - [`channel`]: credit-based channels over K queue pairs: RDMA WRITE WITH IMM into
//!   pre-registered slots of the receiver (or places it granted), the receiver handing credits
//!   back as it consumes; where the device has no immediate data (iWARP), a WRITE and a small
//!   SEND.
//! - [`Communicator`]: the queue-pair mesh along the ring (K queue pairs per link, as eRDMA
//!   deployments set `NCCL_IB_QPS_PER_CONNECTION=8`; connected through rdma_cm on iWARP
//!   devices), a channel to each neighbour, and the chunked, pipelined ring reduce-scatter +
//!   all-gather.
//! - [`DType`] / [`ReduceOp`]: f32, f16, bf16 (each step computed in f32 and rounded once),
//!   i32; sum and max.
//! - [`ReduceBuffer`]: the seam for memory the ring reaches through a host staging copy.
//!
//! ```no_run
//! use erdma::collective::{Bootstrap, Communicator, DType, ReduceOp, RingConfig};
//! use std::time::Duration;
//! # fn main() -> erdma::Result<()> {
//! let mut boot = Bootstrap::from_env(Duration::from_secs(60))?;
//! let ctx = erdma::Context::open_default()?;
//! let mut comm = Communicator::new(&ctx, &mut boot, RingConfig::default())?;
//! let mut grads = vec![0u8; 4 << 20]; // 1 Mi f32 values
//! comm.all_reduce(&mut grads, DType::F32, ReduceOp::Sum)?;
//! # Ok(()) }
//! ```
//!
//! Nothing here busy-waits on memory: every arrival is a completion.

mod bootstrap;
mod buffer;
pub mod channel;
mod dtype;
mod host;
mod ring;

pub use bootstrap::{Bootstrap, MASTER_FD_VAR, MAX_BODY, MasterSocket, RankInfo};
pub use buffer::ReduceBuffer;
pub use dtype::{DType, ReduceOp, bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16, reduce_into};
pub use host::HostShare;
pub use ring::{Communicator, MAX_RANKS, RingConfig};
