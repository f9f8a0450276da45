//! A drop-in `libibverbs.so.1` backed by erdma's soft RoCEv2 device: unmodified verbs programs
//! (rdma-core's tools, perftest, …) run on it with `LD_LIBRARY_PATH`, unprivileged.
//!
//! `scripts/build-dropin` links this crate's static library with `libibverbs.map`, which gives
//! every exported symbol rdma-core 44's version node (`IBVERBS_1.0` … `IBVERBS_1.14`,
//! `IBVERBS_PRIVATE_34`), and names the result `libibverbs.so.1`. Two symbols are the project's
//! own, for the drop-in librdmacm: `erdma_dropin_bind_device` (`ERDMA_DROPIN_1`) and
//! `erdma_dropin_take_in` (`ERDMA_DROPIN_2`).
//!
//! - `device`: the device list (`ERDMA_SOFT_DEVICES`), contexts with their `verbs_context`,
//!   queries.
//! - `objects`: PDs, MRs, completion channels, CQs, QPs, asynchronous events.
//! - `datapath`: the `ibv_context.ops` functions the header's inlines call (`poll_cq`,
//!   `post_send`, …) and the extended QP's `wr_*` functions.
//! - `stubs`: everything else rdma-core exports, inert: failing as rdma-core does where a
//!   device lacks the feature (`EOPNOTSUPP`), so that programs and provider libraries built
//!   with `BIND_NOW` load.
//! - `strings`: the `_str` helpers and rate conversions.
//!
//! Calls go to the soft device's raw provider line (`erdma::raw_provider`), not through the
//! SDK's handles. Each C object is a `#[repr(C)]` struct whose first field is the rdma-core
//! struct the program sees, so a program's pointer is the library's object. A NULL or foreign
//! handle is undefined behaviour, as with rdma-core (it faults there too); every other bad
//! argument fails with rdma-core's errno. No Rust panic crosses the C boundary: every entry
//! point that could panic runs under `guard`; the others (stubs, string tables, flag checks) cannot.

#![allow(unsafe_code)] // the C ABI, entirely
#![allow(clippy::missing_safety_doc)] // every entry point's contract is the C API's (verbs.h)

mod datapath;
mod device;
mod objects;
mod strings;
mod stubs;

use std::os::raw::c_int;

/// Sets the calling thread's `errno`.
pub(crate) fn set_errno(e: c_int) {
    // SAFETY: `__errno_location` returns the calling thread's errno slot, always valid.
    unsafe { *libc::__errno_location() = e };
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

/// `Err(errno)` → sets errno and returns NULL; for the pointer-returning verbs.
pub(crate) fn ptr_or_errno<T>(r: Result<*mut T, c_int>) -> *mut T {
    match r {
        Ok(p) => p,
        Err(e) => {
            set_errno(e);
            std::ptr::null_mut()
        }
    }
}

/// `Err(errno)` → returns the errno (rdma-core's convention for `ibv_modify_qp` and friends).
pub(crate) fn errno_ret(r: Result<(), c_int>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => e,
    }
}

/// `Err(errno)` → sets errno and returns -1 (`ibv_query_gid`, `ibv_get_cq_event` and friends).
pub(crate) fn minus_one(r: Result<(), c_int>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => {
            set_errno(e);
            -1
        }
    }
}
