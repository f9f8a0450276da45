//! FFI bindings to libibverbs, librdmacm and the erdma provider ABI, loaded at run time.
//!
//! Nothing here links against rdma-core: the libraries are opened with `dlopen` on first use,
//! so a program built with this crate starts on any Linux machine and learns only when it asks
//! for a kernel RDMA device whether rdma-core is installed.
//!
//! - **Types and constants**: every `ibv_*`/`IBV_*`, `rdma_*`/`RDMA_*` and `erdma_*`/`ERDMA_*`
//!   item of `infiniband/verbs.h`, `rdma/rdma_cma.h` and `rdma/erdma-abi.h`, at the crate root
//!   (`erdma_sys::ibv_qp_attr`, `erdma_sys::IBV_QPS_RTS`, `erdma_sys::IBV_WR_SEND`,
//!   `erdma_sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE`). See the `types` module docs for
//!   how enums are represented.
//! - **Exported functions**: the tables [`IbVerbs`] and [`RdmaCm`], reached through
//!   [`ibverbs()`] and [`rdmacm()`]: `unsafe { (lib.ibv_alloc_pd)(ctx) }`.
//! - **Inline functions** of the headers, ported: [`ibv_post_send`], [`ibv_post_recv`],
//!   [`ibv_poll_cq`], [`ibv_req_notify_cq`], [`ibv_query_port`], [`ibv_query_device_ex`],
//!   [`ibv_query_gid_ex`], [`ibv_query_gid_table`], [`ibv_reg_mr`], [`ibv_reg_mr_iova`],
//!   [`rdma_get_local_addr`], [`rdma_get_peer_addr`], [`verbs_get_ctx`].
//!
//! ```no_run
//! let lib = erdma_sys::ibverbs()?;
//! let mut n = 0;
//! // SAFETY: `n` is a valid out-parameter; the list is freed below.
//! let list = unsafe { (lib.ibv_get_device_list)(&mut n) };
//! if !list.is_null() {
//!     // SAFETY: `list` came from ibv_get_device_list and is freed once.
//!     unsafe { (lib.ibv_free_device_list)(list) };
//! }
//! # Ok::<(), erdma_sys::LoadError>(())
//! ```
//!
//! This crate is bindings only: the one error type is [`LoadError`]; what a verb's return value
//! means is left to the caller (the `erdma` crate).
//!
//! The committed bindings are for x86_64 Linux. Other targets build with
//! `--features regenerate` (libclang and the rdma-core headers needed).

#[cfg(not(any(
    feature = "regenerate",
    all(target_arch = "x86_64", target_os = "linux")
)))]
compile_error!(
    "erdma-sys's committed bindings are for x86_64 Linux; build with `--features regenerate` \
     (needs libclang and the rdma-core headers) to generate them for this target"
);

mod inline;
mod load;
mod table;
pub mod types;

pub use inline::{
    IBV_ACCESS_OPTIONAL_RANGE, VERBS_ABI_IS_EXTENDED, ibv_poll_cq, ibv_post_recv, ibv_post_send,
    ibv_query_device_ex, ibv_query_gid_ex, ibv_query_gid_table, ibv_query_port, ibv_reg_mr,
    ibv_reg_mr_iova, ibv_req_notify_cq, rdma_get_local_addr, rdma_get_peer_addr, verbs_get_ctx,
};
pub use load::{LoadError, Symbol};
pub use table::{IbVerbs, RdmaCm, ibverbs, rdmacm};
pub use types::*;
