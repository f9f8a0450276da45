//! # erdma-nccl — an NCCL network plugin over the erdma SDK
//!
//! NCCL (and so PyTorch's `nccl` backend) on Alibaba Cloud eRDMA in any of its modes — the
//! standard iWARP mode, where NCCL's own IB transport cannot connect, compat and RoCEv2 — on any
//! other verbs device (mlx5, rxe, siw), and on machines with no RDMA NIC at all through the
//! SDK's userspace soft device.
//!
//! The library is `libnccl-net-erdma.so` (`scripts/build-nccl-plugin` builds it), loaded with
//! `NCCL_NET_PLUGIN=erdma` (or its path) and selected with `NCCL_NET=erdma`. It exports the
//! tables NCCL 2.20–2.29 look for: `ncclNetPlugin_v8` to `ncclNetPlugin_v11`.
//!
//! - [`config`]: the environment (`ERDMA_NCCL_*`) and device selection (`NCCL_IB_HCA` syntax).
//! - [`device`]: opening devices, what NCCL is told about them, mode detection.
//! - [`handle`], [`proto`]: the listen handle and the wire formats.
//! - [`link`]: the out-of-band TCP link (exchange, then liveness).
//! - [`comm`], [`send`], [`recv`]: connection setup and the receiver-driven data path.
//! - [`net`]: the operations; `ffi` (private): the exported tables.
//! - [`doctor`]: what `devinfo --nccl` prints.
//!
//! Unsafe code is confined to `ffi`, `sys`, `mem`, the raw posts of [`send`]/[`recv`] and the
//! logger call; each block says why it holds.
#![deny(unsafe_code)]

pub mod comm;
pub mod config;
pub mod core;
pub mod device;
pub mod doctor;
pub mod error;
mod ffi;
pub mod handle;
pub mod link;
pub mod log;
pub mod mem;
pub mod net;
pub mod objects;
pub mod proto;
pub mod recv;
pub mod send;
mod sys;
