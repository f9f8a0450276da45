//! The tools of the erdma workspace: each program in the workspace's `examples/` is a few lines
//! that call one `main` here.
//!
//! - [`perftest`]: `write_bw`, `write_lat`, `send_bw`, `send_lat`, `read_bw`, `read_lat`;
//! - [`rc_pingpong`]: `ibv_rc_pingpong`'s counterpart;
//! - [`devinfo`]: `ibv_devinfo -v`'s counterpart;
//! - [`allreduce`]: the ring AllReduce in nccl-tests' columns, and its launcher;
//! - [`cq_modes`], [`udp_batching`]: the measurements behind the benchmark report;
//!
//! and what they share: [`cli`] (the command line), [`report`] (perftest's and nccl-tests'
//! tables) and [`tool`] (exit statuses, GIDs, arming a queue pair). The SDK itself is `erdma`;
//! nothing here is part of its API.

pub mod allreduce;
pub mod cli;
pub mod cq_modes;
pub mod devinfo;
pub mod perftest;
pub mod rc_pingpong;
pub mod report;
pub mod tool;
pub mod udp_batching;
