//! What rdma-core exports and the soft device has no use for: SRQs, address handles, multicast,
//! ECE, importing objects, dma-buf regions — and rdma-core's private interface for kernel
//! providers (`ibv_cmd_*`, `verbs_*`), which Debian's libmlx5 and libefa bind at load
//! (`BIND_NOW`) and call only for their own kernel devices.
//!
//! Each fails as rdma-core fails for a device without the feature: `EOPNOTSUPP`, returned (the
//! verbs that return an errno) or in `errno` with NULL or -1. The void ones do nothing.
//! Stubs declared without parameters take any: on x86-64 the caller owns its arguments.

use std::ffi::c_void;
use std::os::raw::c_int;

use erdma_sys as sys;

use crate::set_errno;

/// Verbs that return an errno.
macro_rules! returns_eopnotsupp {
    ($($name:ident),* $(,)?) => {$(
        #[unsafe(no_mangle)]
        pub extern "C" fn $name() -> c_int {
            libc::EOPNOTSUPP
        }
    )*};
}

/// Verbs that return NULL with errno set.
macro_rules! returns_null {
    ($($name:ident),* $(,)?) => {$(
        #[unsafe(no_mangle)]
        pub extern "C" fn $name() -> *mut c_void {
            set_errno(libc::EOPNOTSUPP);
            std::ptr::null_mut()
        }
    )*};
}

/// Verbs that return -1 with errno set.
macro_rules! returns_minus_one {
    ($($name:ident),* $(,)?) => {$(
        #[unsafe(no_mangle)]
        pub extern "C" fn $name() -> c_int {
            set_errno(libc::EOPNOTSUPP);
            -1
        }
    )*};
}

/// Void functions.
macro_rules! does_nothing {
    ($($name:ident),* $(,)?) => {$(
        #[unsafe(no_mangle)]
        pub extern "C" fn $name() {}
    )*};
}

returns_eopnotsupp!(
    ibv_attach_mcast,
    ibv_detach_mcast,
    ibv_destroy_ah,
    ibv_init_ah_from_wc,
    ibv_modify_srq,
    ibv_query_srq,
    ibv_destroy_srq,
    ibv_resize_cq,
    ibv_query_ece,
    ibv_set_ece,
    execute_ioctl,
);

returns_null!(
    ibv_create_ah,
    ibv_create_ah_from_wc,
    ibv_create_srq,
    ibv_import_device,
    ibv_import_mr,
    ibv_import_pd,
    ibv_import_dm,
    ibv_reg_dmabuf_mr,
    _verbs_init_and_alloc_context,
    verbs_open_device,
);

returns_minus_one!(ibv_rereg_mr, ibv_resolve_eth_l2_from_gid);

does_nothing!(
    ibv_unimport_mr,
    ibv_unimport_pd,
    ibv_unimport_dm,
    ibv_copy_path_rec_from_kern,
    ibv_copy_path_rec_to_kern,
    ibv_copy_qp_attr_from_kern,
    ibv_copy_ah_attr_from_kern,
    __verbs_log,
    verbs_set_ops,
    verbs_uninit_context,
    verbs_init_cq,
    // Providers' constructors register here (libmlx5, libefa); this library never loads a
    // provider, so the registration is dropped.
    verbs_register_driver_34,
);

// rdma-core's command layer for kernel providers.
returns_eopnotsupp!(
    ibv_cmd_advise_mr,
    ibv_cmd_alloc_dm,
    ibv_cmd_alloc_mw,
    ibv_cmd_alloc_pd,
    ibv_cmd_attach_mcast,
    ibv_cmd_close_xrcd,
    ibv_cmd_create_ah,
    ibv_cmd_create_counters,
    ibv_cmd_create_cq,
    ibv_cmd_create_cq_ex,
    ibv_cmd_create_flow,
    ibv_cmd_create_flow_action_esp,
    ibv_cmd_create_qp,
    ibv_cmd_create_qp_ex,
    ibv_cmd_create_qp_ex2,
    ibv_cmd_create_rwq_ind_table,
    ibv_cmd_create_srq,
    ibv_cmd_create_srq_ex,
    ibv_cmd_create_wq,
    ibv_cmd_dealloc_mw,
    ibv_cmd_dealloc_pd,
    ibv_cmd_dereg_mr,
    ibv_cmd_destroy_ah,
    ibv_cmd_destroy_counters,
    ibv_cmd_destroy_cq,
    ibv_cmd_destroy_flow,
    ibv_cmd_destroy_flow_action,
    ibv_cmd_destroy_qp,
    ibv_cmd_destroy_rwq_ind_table,
    ibv_cmd_destroy_srq,
    ibv_cmd_destroy_wq,
    ibv_cmd_detach_mcast,
    ibv_cmd_free_dm,
    ibv_cmd_get_context,
    ibv_cmd_modify_cq,
    ibv_cmd_modify_flow_action_esp,
    ibv_cmd_modify_qp,
    ibv_cmd_modify_qp_ex,
    ibv_cmd_modify_srq,
    ibv_cmd_modify_wq,
    ibv_cmd_open_qp,
    ibv_cmd_open_xrcd,
    ibv_cmd_poll_cq,
    ibv_cmd_post_recv,
    ibv_cmd_post_send,
    ibv_cmd_post_srq_recv,
    ibv_cmd_query_context,
    ibv_cmd_query_device_any,
    ibv_cmd_query_mr,
    ibv_cmd_query_port,
    ibv_cmd_query_qp,
    ibv_cmd_query_srq,
    ibv_cmd_read_counters,
    ibv_cmd_reg_dm_mr,
    ibv_cmd_reg_dmabuf_mr,
    ibv_cmd_reg_mr,
    ibv_cmd_req_notify_cq,
    ibv_cmd_rereg_mr,
    ibv_cmd_resize_cq,
);

/// `__ioctl_final_num_attrs(num_attrs, id)`: rdma-core's ioctl helper; no ioctls here.
#[unsafe(no_mangle)]
pub extern "C" fn __ioctl_final_num_attrs(num_attrs: u32) -> u32 {
    num_attrs
}

/// Read by libmlx5 (a one-byte data object in rdma-core): whether destroying objects of a
/// disassociated device succeeds. There is no such device here.
#[unsafe(no_mangle)]
pub static verbs_allow_disassociate_destroy: u8 = 0;

/// `ibv_fork_init`: the soft device pins no pages, so fork needs nothing.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_fork_init() -> c_int {
    0
}

#[unsafe(no_mangle)]
pub extern "C" fn ibv_dontfork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

#[unsafe(no_mangle)]
pub extern "C" fn ibv_dofork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

/// `IBV_FORK_UNNEEDED`: the soft device pins no pages.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_is_fork_initialized() -> sys::ibv_fork_status {
    2
}

/// No data-in-order guarantee is claimed beyond the IBTA's.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_query_qp_data_in_order() -> c_int {
    0
}

/// `verbs_context.close_xrcd`, which `ibv_close_xrcd` calls without a presence check.
pub(crate) unsafe extern "C" fn vctx_close_xrcd(_xrcd: *mut sys::ibv_xrcd) -> c_int {
    libc::EOPNOTSUPP
}
