//! A drop-in `librdmacm.so.1` for erdma's soft RoCEv2 device: unmodified rdma_cm programs
//! (rping, rdma_server/rdma_client, ucmatose, perftest's `-R`, …) connect queue pairs of the
//! drop-in `libibverbs.so.1` (crate `erdma-verbs`) with `LD_LIBRARY_PATH`, unprivileged.
//!
//! `scripts/build-dropin` links this crate's static library with `librdmacm.map` (rdma-core's
//! version nodes `RDMACM_1.0` … `RDMACM_1.3`) and names the result `librdmacm.so.1`.
//!
//! The kernel's rdma_cm is not involved: identifiers connect over TCP with the SDK's soft
//! rdma_cm exchange (`docs/soft-cm.md`), so a C program on this library and a Rust program on
//! `erdma::connect::cm` connect to each other.
//!
//! - `device`: which soft device an address belongs to (the devices of the verbs library, known
//!   by their GUID), the one context and PD per device this library opens.
//! - `channel`: event channels (an eventfd the program polls) and events.
//! - `id`: identifiers, their state, addresses, and the queue pair attributes of each step.
//! - `link`: the TCP side: listening, the exchange, heartbeats, the end of a connection.
//! - `calls`: the `rdma_*` entry points of identifiers and connections.
//! - `ep`: `rdma_getaddrinfo` and the synchronous `rdma_create_ep` family.
//! - `stubs`: what this library does not offer (multicast, SRQs, rsockets, ECE), failing as
//!   rdma-core does where a device lacks a feature.
//!
//! Verbs calls go through the program's libibverbs (`erdma_sys::ibverbs()`, which finds the
//! library already loaded), never a second copy of the device. No Rust panic crosses the C
//! boundary: every entry point that could panic runs under `call` or `guard`.

#![allow(unsafe_code)] // the C ABI, entirely
#![allow(clippy::missing_safety_doc)] // every entry point's contract is the C API's (rdma_cma.h)

mod calls;
mod channel;
mod device;
mod ep;
mod id;
mod link;
mod stubs;

use std::os::raw::c_int;

/// Sets the calling thread's `errno`.
pub(crate) fn set_errno(e: c_int) {
    // SAFETY: `__errno_location` returns the calling thread's errno slot, always valid.
    unsafe { *libc::__errno_location() = e };
}

/// Runs `f`; `Err(errno)` or a panic (errno `EIO`) → errno set and -1, librdmacm's convention.
pub(crate) fn call(f: impl FnOnce() -> Result<(), c_int>) -> c_int {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            set_errno(e);
            -1
        }
        Err(_) => {
            set_errno(libc::EIO);
            -1
        }
    }
}

/// Runs `f`, turning a panic into `fail` with errno `EIO`: no unwinding crosses into C.
pub(crate) fn guard<T>(fail: T, f: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            set_errno(libc::EIO);
            fail
        }
    }
}

/// The calling thread's `errno` after a failed libc or verbs call.
pub(crate) fn last_errno() -> c_int {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}
