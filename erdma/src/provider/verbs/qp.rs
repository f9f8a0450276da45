//! Queue pairs of a kernel device: state changes and posting.

use erdma_sys as sys;

use super::VerbsCtx;
use crate::error::{Error, Result};
use crate::vocab::{QpAttr, QpState};

use super::super::PostResult;
use super::super::req::{Batch, RecvReq, SendReq};
use std::ptr;

// Attribute-mask bits of `ibv_modify_qp` (`enum ibv_qp_attr_mask`).
const IBV_QP_STATE: i32 = 1;
const IBV_QP_ACCESS_FLAGS: i32 = 1 << 3;
const IBV_QP_PKEY_INDEX: i32 = 1 << 4;
const IBV_QP_PORT: i32 = 1 << 5;
const IBV_QP_AV: i32 = 1 << 7;
const IBV_QP_PATH_MTU: i32 = 1 << 8;
const IBV_QP_TIMEOUT: i32 = 1 << 9;
const IBV_QP_RETRY_CNT: i32 = 1 << 10;
const IBV_QP_RNR_RETRY: i32 = 1 << 11;
const IBV_QP_RQ_PSN: i32 = 1 << 12;
const IBV_QP_MAX_QP_RD_ATOMIC: i32 = 1 << 13;
const IBV_QP_MIN_RNR_TIMER: i32 = 1 << 15;
const IBV_QP_SQ_PSN: i32 = 1 << 16;
const IBV_QP_MAX_DEST_RD_ATOMIC: i32 = 1 << 17;
const IBV_QP_DEST_QPN: i32 = 1 << 20;

/// A queue pair.
pub(crate) struct VerbsQp {
    pub(super) lib: &'static sys::IbVerbs,
    pub(super) qp: *mut sys::ibv_qp,
}

// SAFETY: posting and modifying are thread-safe verbs; the pointer is owned by one handle.
unsafe impl Send for VerbsQp {}
// SAFETY: as above.
unsafe impl Sync for VerbsQp {}

impl VerbsQp {
    /// The raw queue pair (for transitions whose attributes rdma_cm computes).
    pub(crate) fn as_raw(&self) -> *mut sys::ibv_qp {
        self.qp
    }

    pub(crate) fn modify(&self, _ctx: &VerbsCtx, m: &QpAttr) -> Result<()> {
        // SAFETY: a zeroed ibv_qp_attr is valid; only the fields named in the mask are read.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        let mut mask = 0i32;
        if let Some(s) = m.state {
            a.qp_state = s.as_raw() as _;
            mask |= IBV_QP_STATE;
        }
        if let Some(p) = m.port {
            a.port_num = p;
            mask |= IBV_QP_PORT;
        }
        if let Some(p) = m.pkey_index {
            a.pkey_index = p;
            mask |= IBV_QP_PKEY_INDEX;
        }
        if let Some(acc) = m.access {
            a.qp_access_flags = acc.bits();
            mask |= IBV_QP_ACCESS_FLAGS;
        }
        if let Some(mtu) = m.path_mtu {
            a.path_mtu = mtu.as_enum() as _;
            mask |= IBV_QP_PATH_MTU;
        }
        if let Some(q) = m.dest_qp_num {
            a.dest_qp_num = q;
            mask |= IBV_QP_DEST_QPN;
        }
        if let Some(p) = m.rq_psn {
            a.rq_psn = p;
            mask |= IBV_QP_RQ_PSN;
        }
        if let Some(v) = m.max_dest_rd_atomic {
            a.max_dest_rd_atomic = v;
            mask |= IBV_QP_MAX_DEST_RD_ATOMIC;
        }
        if let Some(v) = m.min_rnr_timer {
            a.min_rnr_timer = v;
            mask |= IBV_QP_MIN_RNR_TIMER;
        }
        if let Some(av) = m.av {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = av.dgid.0;
            a.ah_attr.grh.sgid_index = av.sgid_index;
            a.ah_attr.grh.hop_limit = av.hop_limit;
            a.ah_attr.grh.traffic_class = av.traffic_class;
            a.ah_attr.grh.flow_label = av.flow_label;
            a.ah_attr.dlid = av.dlid;
            a.ah_attr.sl = av.sl;
            a.ah_attr.port_num = av.port;
            mask |= IBV_QP_AV;
        }
        if let Some(p) = m.sq_psn {
            a.sq_psn = p;
            mask |= IBV_QP_SQ_PSN;
        }
        if let Some(v) = m.timeout {
            a.timeout = v;
            mask |= IBV_QP_TIMEOUT;
        }
        if let Some(v) = m.retry_cnt {
            a.retry_cnt = v;
            mask |= IBV_QP_RETRY_CNT;
        }
        if let Some(v) = m.rnr_retry {
            a.rnr_retry = v;
            mask |= IBV_QP_RNR_RETRY;
        }
        if let Some(v) = m.max_rd_atomic {
            a.max_rd_atomic = v;
            mask |= IBV_QP_MAX_QP_RD_ATOMIC;
        }
        // SAFETY: `qp` is live; `a` is valid for every field the mask names.
        let rc = unsafe { (self.lib.ibv_modify_qp)(self.qp, &mut a, mask) };
        if rc != 0 {
            return Err(Error::errno("ibv_modify_qp", rc));
        }
        Ok(())
    }

    pub(crate) fn query_state(&self) -> Result<QpState> {
        // SAFETY: zeroed attribute structs are valid out-parameters.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `qp` is live and both out-parameters are valid.
        let rc = unsafe { (self.lib.ibv_query_qp)(self.qp, &mut a, IBV_QP_STATE, &mut init) };
        if rc != 0 {
            return Err(Error::errno("ibv_query_qp", rc));
        }
        QpState::from_raw(a.qp_state as u32).ok_or_else(|| Error::Verb {
            verb: "ibv_query_qp",
            source: std::io::Error::other(format!(
                "the device reports queue pair state {}, which verbs does not define",
                a.qp_state
            )),
        })
    }

    /// Posts send requests as one chain.
    ///
    /// # Safety
    /// An inline request's SGEs name bytes readable for the duration of the call (libibverbs
    /// copies them); other memory is reached through registered regions by key.
    #[inline]
    pub(crate) unsafe fn post_send(&self, _ctx: &VerbsCtx, reqs: &[SendReq<'_>]) -> PostResult {
        if reqs.is_empty() {
            return Ok(());
        }
        let mut wrs = Batch::of(reqs, send_wr);
        post_chain("ibv_post_send", &mut wrs, |head, bad| {
            // Inline bytes are the caller's to guarantee (the contract above); keyed memory is
            // the device's to check.
            // SAFETY: `qp` is live; the chain and its SGE arrays (laid out as `ibv_sge`) outlive it.
            unsafe { sys::ibv_post_send(self.qp, head, bad) }
        })
    }

    #[inline]
    pub(crate) fn post_recv(&self, _ctx: &VerbsCtx, reqs: &[RecvReq<'_>]) -> PostResult {
        if reqs.is_empty() {
            return Ok(());
        }
        let mut wrs = Batch::of(reqs, |r| {
            // SAFETY: a zeroed ibv_recv_wr is a valid value.
            let mut w: sys::ibv_recv_wr = unsafe { std::mem::zeroed() };
            w.wr_id = r.wr_id;
            w.sg_list = r.sges.as_ptr() as *mut sys::ibv_sge;
            w.num_sge = r.sges.len() as i32;
            w
        });
        post_chain("ibv_post_recv", &mut wrs, |head, bad| {
            // SAFETY: as in `post_send`.
            unsafe { sys::ibv_post_recv(self.qp, head, bad) }
        })
    }

    /// # Safety
    /// Called at most once per object, by its owner's `Drop`; the object is not used after.
    pub(crate) unsafe fn destroy(&self, _ctx: &VerbsCtx) {
        // SAFETY: the caller's contract: the pointer is live and released only here, once.
        unsafe { (self.lib.ibv_destroy_qp)(self.qp) };
    }
}

/// A libibverbs work request, chained to the next through its `next` pointer.
trait Chained {
    fn link(&mut self, next: *mut Self);
}

impl Chained for sys::ibv_send_wr {
    fn link(&mut self, next: *mut Self) {
        self.next = next;
    }
}

impl Chained for sys::ibv_recv_wr {
    fn link(&mut self, next: *mut Self) {
        self.next = next;
    }
}

/// Links `wrs` (not empty) into one chain and posts it with `post(head, &mut bad)`; on failure,
/// how many requests ahead of the one libibverbs names in `bad` were accepted.
#[inline]
fn post_chain<W: Chained>(
    verb: &'static str,
    wrs: &mut [W],
    post: impl FnOnce(*mut W, &mut *mut W) -> i32,
) -> PostResult {
    let head = wrs.as_mut_ptr();
    for i in 0..wrs.len() - 1 {
        // SAFETY: `i + 1 < len`, so both pointers are inside `wrs`, which is not moved again.
        unsafe { (*head.add(i)).link(head.add(i + 1)) };
    }
    let mut bad: *mut W = ptr::null_mut();
    let rc = post(head, &mut bad);
    if rc == 0 {
        return Ok(());
    }
    let accepted = if bad.is_null() {
        0
    } else {
        // SAFETY: `bad` points into `wrs` (libibverbs returns the failing element).
        (unsafe { bad.offset_from(head) }).max(0) as usize
    };
    Err((accepted, Error::errno(verb, rc)))
}

/// The `ibv_send_wr` for one request (its `next` left null).
fn send_wr(r: &SendReq<'_>) -> sys::ibv_send_wr {
    // SAFETY: a zeroed ibv_send_wr is a valid value (null pointers, zero counts).
    let mut w: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
    w.wr_id = r.wr_id;
    w.sg_list = r.sges.as_ptr() as *mut sys::ibv_sge;
    w.num_sge = r.sges.len() as i32;
    w.opcode = r.opcode as u32 as _;
    w.send_flags = r.flags.bits();
    match r.opcode {
        crate::WrOpcode::SendWithInv => w.__bindgen_anon_1.invalidate_rkey = r.invalidate_rkey,
        _ => w.__bindgen_anon_1.imm_data = r.imm.to_be(),
    }
    if r.opcode.is_atomic() {
        w.wr.atomic = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
            remote_addr: r.remote_addr,
            compare_add: r.compare_add,
            swap: r.swap,
            rkey: r.rkey,
        };
    } else if r.opcode == crate::WrOpcode::SendWithInv {
        // The key travels in `wr.rdma.rkey` too, which no provider reads for a SEND: siw's
        // (rdma-core's libsiw) takes the key to invalidate from there, not `invalidate_rkey`.
        w.wr.rdma = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: 0,
            rkey: r.invalidate_rkey,
        };
    } else {
        w.wr.rdma = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: r.remote_addr,
            rkey: r.rkey,
        };
    }
    w
}
