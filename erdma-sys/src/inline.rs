//! The verbs that `infiniband/verbs.h` and `rdma/rdma_cma.h` define as `static inline`
//! functions or macros, ported to Rust. They dispatch through the context's operation tables
//! (`ibv_context::ops`, and the extended `verbs_context` in front of it) exactly as the C inline
//! code does, falling back to the exported functions of [`IbVerbs`] where the C code does.
//!
//! Owns the data-path entry points (`ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq`,
//! `ibv_req_notify_cq`) and the inline queries. Must not: add checks, errors or policy beyond
//! what the C inline code does, except answering "not supported" where the C code would call
//! through a missing (NULL) entry.

use std::mem::{offset_of, size_of};
use std::os::raw::{c_int, c_uint, c_void};
use std::ptr;

use crate::table::IbVerbs;
use crate::types::*;

/// `__VERBS_ABI_IS_EXTENDED`: the `abi_compat` value of a context that sits inside a
/// `verbs_context`.
pub const VERBS_ABI_IS_EXTENDED: usize = usize::MAX;

/// `IBV_ACCESS_OPTIONAL_RANGE`: access flags a library may ignore when the kernel does not know
/// them (they need `ibv_reg_mr_iova2`).
pub const IBV_ACCESS_OPTIONAL_RANGE: c_uint =
    ib_uverbs_access_flags::IB_UVERBS_ACCESS_OPTIONAL_RANGE.0;

/// The extended context around `context` (`verbs_get_ctx`), or null when the context is not an
/// extended one.
///
/// The result may point in front of the library's real allocation when the library is older
/// than these bindings. Read `sz` first and a field `op` only when
/// `sz >= size_of::<verbs_context>() - offset_of!(verbs_context, op)` (what the C macro
/// `verbs_get_ctx_op` checks, and what the functions of this crate do).
///
/// # Safety
///
/// `context` must point to a live `ibv_context` (one opened by libibverbs, or a test double
/// that sits inside a `verbs_context` when its `abi_compat` says so).
#[inline]
pub unsafe fn verbs_get_ctx(context: *mut ibv_context) -> *mut verbs_context {
    // SAFETY: the caller guarantees `context` is live.
    let abi = unsafe { (*context).abi_compat };
    if abi.addr() != VERBS_ABI_IS_EXTENDED {
        return ptr::null_mut();
    }
    // Wrapping arithmetic: with an older library the container starts later than this crate's
    // `verbs_context`, so the computed start may lie outside the allocation; it is only
    // dereferenced after the size check in `ext_op!`.
    context
        .cast::<u8>()
        .wrapping_sub(offset_of!(verbs_context, context))
        .cast::<verbs_context>()
}

/// `verbs_get_ctx_op`: the extended operation `$op` of the context `$ctx` when the library's
/// `verbs_context` is large enough to hold it and it is set, as `Option<fn>`.
///
/// Must be used inside an `unsafe` block whose caller guarantees `$ctx` is live.
macro_rules! ext_op {
    ($ctx:expr, $op:ident) => {{
        let vctx = verbs_get_ctx($ctx);
        if vctx.is_null() {
            None
        } else {
            // `sz` is the size of the library's `verbs_context`; fields grow towards lower
            // addresses, so `$op` exists iff the library's struct reaches back to it.
            let needed = size_of::<verbs_context>() - offset_of!(verbs_context, $op);
            // `sz` sits right in front of `context` and is therefore inside the allocation.
            if (*vctx).sz < needed {
                None
            } else {
                (*vctx).$op
            }
        }
    }};
}

/// `ibv_post_send`: posts a chain of send work requests through the provider's `post_send`.
///
/// Returns 0, or an error number with `*bad_wr` set to the first request not posted (the
/// convention is a positive errno; some providers, erdma among them, return it negated). A
/// context without a `post_send` entry answers `EOPNOTSUPP` with `*bad_wr = wr`.
///
/// # Safety
///
/// - `qp` points to a live QP whose `context` is a live context opened by libibverbs.
/// - `wr` is null or the head of a well-formed, null-terminated chain; each request's
///   `sg_list` points to `num_sge` valid `ibv_sge`s, and the chain stays valid for the call.
/// - `bad_wr` is valid for a write.
/// - Unless a request is `IBV_SEND_INLINE`, the memory its SGEs name stays registered, alive
///   and not written by anyone else until its completion is polled (the device reads it
///   later); remote addresses and keys are the peer's to enforce.
#[inline]
pub unsafe fn ibv_post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: the caller guarantees `qp` is live.
    let context = unsafe { (*qp).context };
    // SAFETY: the caller guarantees the context is live.
    let op = unsafe { (*context).ops.post_send };
    match op {
        // SAFETY: the provider's entry, called with the caller-guaranteed arguments.
        Some(post) => unsafe { post(qp, wr, bad_wr) },
        None => {
            // SAFETY: the caller guarantees `bad_wr` is writable.
            unsafe { bad_wr.write(wr) };
            libc::EOPNOTSUPP
        }
    }
}

/// `ibv_post_recv`: posts a chain of receive work requests through the provider's `post_recv`.
///
/// Returns as [`ibv_post_send`] does.
///
/// # Safety
///
/// - `qp` points to a live QP whose `context` is a live context opened by libibverbs.
/// - `wr` is null or the head of a well-formed, null-terminated chain whose `sg_list`s point to
///   `num_sge` valid `ibv_sge`s each, valid for the call.
/// - `bad_wr` is valid for a write.
/// - The memory the SGEs name stays registered, alive and untouched by anyone else until the
///   request's completion is polled (the device writes it later).
#[inline]
pub unsafe fn ibv_post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: the caller guarantees `qp` is live.
    let context = unsafe { (*qp).context };
    // SAFETY: the caller guarantees the context is live.
    let op = unsafe { (*context).ops.post_recv };
    match op {
        // SAFETY: the provider's entry, called with the caller-guaranteed arguments.
        Some(post) => unsafe { post(qp, wr, bad_wr) },
        None => {
            // SAFETY: the caller guarantees `bad_wr` is writable.
            unsafe { bad_wr.write(wr) };
            libc::EOPNOTSUPP
        }
    }
}

/// `ibv_poll_cq`: moves up to `num_entries` completions into `wc`.
///
/// Returns the number moved (0 when the CQ is empty) or a negative value on error
/// (`-EOPNOTSUPP` for a context without a `poll_cq` entry).
///
/// # Safety
///
/// - `cq` points to a live CQ whose `context` is a live context opened by libibverbs.
/// - `wc` is valid for writes of `num_entries` `ibv_wc`s.
/// - Calls on one CQ from several threads are serialised by the caller unless the provider
///   documents otherwise (libibverbs providers lock internally).
#[inline]
pub unsafe fn ibv_poll_cq(cq: *mut ibv_cq, num_entries: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: the caller guarantees `cq` is live.
    let context = unsafe { (*cq).context };
    // SAFETY: the caller guarantees the context is live.
    let op = unsafe { (*context).ops.poll_cq };
    match op {
        // SAFETY: the provider's entry, called with the caller-guaranteed arguments.
        Some(poll) => unsafe { poll(cq, num_entries, wc) },
        None => -libc::EOPNOTSUPP,
    }
}

/// `ibv_req_notify_cq`: arms the CQ so that its completion channel gets an event for the next
/// completion (only the next solicited one when `solicited_only` is non-zero).
///
/// Returns 0 or an error number (`EOPNOTSUPP` for a context without a `req_notify_cq` entry).
///
/// # Safety
///
/// `cq` points to a live CQ, created with a completion channel, whose `context` is a live
/// context opened by libibverbs.
#[inline]
pub unsafe fn ibv_req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: the caller guarantees `cq` is live.
    let context = unsafe { (*cq).context };
    // SAFETY: the caller guarantees the context is live.
    let op = unsafe { (*context).ops.req_notify_cq };
    match op {
        // SAFETY: the provider's entry, called with the caller-guaranteed arguments.
        Some(arm) => unsafe { arm(cq, solicited_only) },
        None => libc::EOPNOTSUPP,
    }
}

/// `ibv_query_port` as `verbs.h` defines it (an inline over the extended `query_port`, which
/// fills the whole current `ibv_port_attr`), falling back to the exported `ibv_query_port`
/// (old layout, after zeroing the rest) for contexts without it.
///
/// Returns 0 or an error number.
///
/// # Safety
///
/// `context` is a live context opened by `lib`'s library; `port_attr` is valid for a write of
/// one `ibv_port_attr`.
pub unsafe fn ibv_query_port(
    lib: &IbVerbs,
    context: *mut ibv_context,
    port_num: u8,
    port_attr: *mut ibv_port_attr,
) -> c_int {
    // SAFETY: the caller guarantees `context` is live.
    if let Some(query) = unsafe { ext_op!(context, query_port) } {
        // SAFETY: the library's entry, given the size of the struct behind `port_attr`.
        return unsafe { query(context, port_num, port_attr, size_of::<ibv_port_attr>()) };
    }
    // SAFETY: the caller guarantees `port_attr` is writable; all-zero is a valid value.
    unsafe { port_attr.write_bytes(0, 1) };
    // SAFETY: the old layout is a prefix of `ibv_port_attr`, as the C header's cast assumes.
    unsafe { (lib.ibv_query_port)(context, port_num, port_attr.cast()) }
}

/// `ibv_query_device_ex` as `verbs.h` defines it: the extended query, or, when the context has
/// none or it answers `EOPNOTSUPP`/`ENOSYS`, the legacy `ibv_query_device` into
/// `attr.orig_attr` with the rest zeroed.
///
/// Returns 0 or an error number (`EINVAL` when `input` asks for anything: no input fields exist).
///
/// # Safety
///
/// `context` is a live context opened by `lib`'s library; `input` is null or valid for a read;
/// `attr` is valid for a write of one `ibv_device_attr_ex`.
pub unsafe fn ibv_query_device_ex(
    lib: &IbVerbs,
    context: *mut ibv_context,
    input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
) -> c_int {
    // SAFETY: the caller guarantees `input` is null or readable.
    if !input.is_null() && unsafe { (*input).comp_mask } != 0 {
        return libc::EINVAL;
    }
    // SAFETY: the caller guarantees `context` is live.
    if let Some(query) = unsafe { ext_op!(context, query_device_ex) } {
        // SAFETY: the library's entry, given the size of the struct behind `attr`.
        let ret = unsafe { query(context, input, attr, size_of::<ibv_device_attr_ex>()) };
        if ret != libc::EOPNOTSUPP && ret != libc::ENOSYS {
            return ret;
        }
    }
    // SAFETY: the caller guarantees `attr` is writable; all-zero is a valid value.
    unsafe { attr.write_bytes(0, 1) };
    // SAFETY: `attr` is valid (caller); only the field's address is computed.
    let orig = unsafe { &raw mut (*attr).orig_attr };
    // SAFETY: `orig` is the writable legacy part of `*attr`; `context` is live (caller).
    unsafe { (lib.ibv_query_device)(context, orig) }
}

/// `ibv_query_gid_ex`: one GID table entry with its type and netdev.
///
/// Returns 0 or an error number; `EOPNOTSUPP` when the library predates the call
/// (rdma-core < v32).
///
/// # Safety
///
/// `context` is a live context opened by `lib`'s library; `entry` is valid for a write.
pub unsafe fn ibv_query_gid_ex(
    lib: &IbVerbs,
    context: *mut ibv_context,
    port_num: u32,
    gid_index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
) -> c_int {
    match lib._ibv_query_gid_ex {
        // SAFETY: the caller's guarantees, and the size of the struct behind `entry`.
        Some(query) => unsafe {
            query(
                context,
                port_num,
                gid_index,
                entry,
                flags,
                size_of::<ibv_gid_entry>(),
            )
        },
        None => libc::EOPNOTSUPP,
    }
}

/// `ibv_query_gid_table`: all valid GID entries of all ports.
///
/// Returns the number of entries written, or a negative error number; `-EOPNOTSUPP` when the
/// library predates the call (rdma-core < v32).
///
/// # Safety
///
/// `context` is a live context opened by `lib`'s library; `entries` is valid for writes of
/// `max_entries` entries.
pub unsafe fn ibv_query_gid_table(
    lib: &IbVerbs,
    context: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
) -> isize {
    match lib._ibv_query_gid_table {
        // SAFETY: the caller's guarantees, and the size of each entry behind `entries`.
        Some(query) => unsafe {
            query(
                context,
                entries,
                max_entries,
                flags,
                size_of::<ibv_gid_entry>(),
            )
        },
        None => -(libc::EOPNOTSUPP as isize),
    }
}

/// `ibv_reg_mr` as `verbs.h` defines it (a macro): the exported `ibv_reg_mr` unless `access`
/// holds optional flags (`IBV_ACCESS_RELAXED_ORDERING`, …), which go through
/// `ibv_reg_mr_iova2` with the IOVA equal to the address. With a library older than
/// `ibv_reg_mr_iova2` the optional flags are dropped, which is what "optional" means.
///
/// Returns the region, or null with `errno` set.
///
/// # Safety
///
/// `pd` is a live PD of `lib`'s library; `[addr, addr + length)` is memory of this process that
/// stays mapped until the region is deregistered (the device may access it whenever the access
/// flags allow).
pub unsafe fn ibv_reg_mr(
    lib: &IbVerbs,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_uint,
) -> *mut ibv_mr {
    if access & IBV_ACCESS_OPTIONAL_RANGE != 0 {
        if let Some(reg) = lib.ibv_reg_mr_iova2 {
            // SAFETY: the caller's guarantees; IOVA = address as in the C macro.
            return unsafe { reg(pd, addr, length, addr as u64, access) };
        }
    }
    let access = (access & !IBV_ACCESS_OPTIONAL_RANGE) as c_int;
    // SAFETY: the caller's guarantees.
    unsafe { (lib.ibv_reg_mr)(pd, addr, length, access) }
}

/// `ibv_reg_mr_iova` as `verbs.h` defines it (a macro): registers memory that the device
/// addresses as `iova`. Needs rdma-core ≥ v24 (`ibv_reg_mr_iova`); optional access flags need
/// `ibv_reg_mr_iova2` and are dropped without it.
///
/// Returns the region, or null with `errno` set (`EOPNOTSUPP` when the library has neither).
///
/// # Safety
///
/// As [`ibv_reg_mr`].
pub unsafe fn ibv_reg_mr_iova(
    lib: &IbVerbs,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    if access & IBV_ACCESS_OPTIONAL_RANGE != 0 {
        if let Some(reg) = lib.ibv_reg_mr_iova2 {
            // SAFETY: the caller's guarantees.
            return unsafe { reg(pd, addr, length, iova, access) };
        }
    }
    let access = (access & !IBV_ACCESS_OPTIONAL_RANGE) as c_int;
    match lib.ibv_reg_mr_iova {
        // SAFETY: the caller's guarantees.
        Some(reg) => unsafe { reg(pd, addr, length, iova, access) },
        None => {
            // SAFETY: takes no arguments; returns this thread's errno location.
            let errno = unsafe { libc::__errno_location() };
            // SAFETY: the location is valid and this thread's to write.
            unsafe { *errno = libc::EOPNOTSUPP };
            ptr::null_mut()
        }
    }
}

/// `rdma_get_local_addr`: the identifier's bound source address.
///
/// # Safety
///
/// `id` points to a live `rdma_cm_id`; the result lives as long as it does.
#[inline]
pub unsafe fn rdma_get_local_addr(id: *mut rdma_cm_id) -> *mut sockaddr {
    // SAFETY: the caller guarantees `id` is live; only a field address is computed.
    unsafe { &raw mut (*id).route.addr.__bindgen_anon_1.src_addr }
}

/// `rdma_get_peer_addr`: the identifier's destination address.
///
/// # Safety
///
/// `id` points to a live `rdma_cm_id`; the result lives as long as it does.
#[inline]
pub unsafe fn rdma_get_peer_addr(id: *mut rdma_cm_id) -> *mut sockaddr {
    // SAFETY: the caller guarantees `id` is live; only a field address is computed.
    unsafe { &raw mut (*id).route.addr.__bindgen_anon_2.dst_addr }
}

#[cfg(test)]
mod tests;
