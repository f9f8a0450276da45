//! The data path: the `ibv_context.ops` functions the header's inlines call (`ibv_poll_cq`,
//! `ibv_req_notify_cq`, `ibv_post_send`, `ibv_post_recv`), and the extended QP's `wr_*`
//! functions (`ibv_wr_start` … `ibv_wr_complete`), all landing in the soft device.

use std::ffi::c_void;
use std::os::raw::c_int;

use erdma::raw_provider::{RecvReq, SendReq};
use erdma::{Completion, SendFlags, Sge, WrOpcode};
use erdma_sys as sys;

use crate::guard;
use crate::objects::{Cq, Qp, ctx_of, lock, obj};

/// Fills a context's ops table; the slots a device without the feature leaves NULL make the
/// header's inlines fail with `EOPNOTSUPP` (`ibv_alloc_mw`).
pub(crate) fn fill_ops(ops: &mut sys::ibv_context_ops) {
    ops.poll_cq = Some(poll_cq);
    ops.req_notify_cq = Some(req_notify_cq);
    ops.post_send = Some(post_send);
    ops.post_recv = Some(post_recv);
    ops.post_srq_recv = Some(post_srq_recv);
    ops.bind_mw = Some(bind_mw);
    ops.dealloc_mw = Some(dealloc_mw);
    ops._compat_query_device = Some(crate::device::ibv_query_device);
}

/// Completions read per call to the device.
const POLL_CHUNK: usize = 16;

unsafe extern "C" fn poll_cq(cq: *mut sys::ibv_cq, n: c_int, wc: *mut sys::ibv_wc) -> c_int {
    guard(-1, || {
        if n <= 0 {
            return 0;
        }
        if wc.is_null() {
            return -1;
        }
        // SAFETY: `cq` is a live CQ of this library (the C contract).
        let q: &Cq = unsafe { obj(cq) };
        let want = n as usize;
        let mut buf = [Completion::default(); POLL_CHUNK];
        let mut total = 0;
        while total < want {
            let k = (want - total).min(POLL_CHUNK);
            let got = match q.raw.poll(&mut buf[..k]) {
                Ok(g) => g,
                Err(_) if total > 0 => break,
                Err(_) => return -1,
            };
            for (i, c) in buf[..got].iter().enumerate() {
                // SAFETY: `wc` has room for `n` entries (the C contract); total + i < n.
                unsafe { *wc.add(total + i) = to_wc(c) };
            }
            total += got;
            if got < k {
                break;
            }
        }
        total as c_int
    })
}

#[inline]
fn to_wc(c: &Completion) -> sys::ibv_wc {
    let (extra, flags) = match (c.imm, c.invalidated_rkey) {
        (Some(imm), _) => (imm.to_be(), c.wc_flags()),
        (None, Some(rkey)) => (rkey, c.wc_flags()),
        (None, None) => (0, c.wc_flags()),
    };
    sys::ibv_wc {
        wr_id: c.wr_id,
        status: c.status.as_raw(),
        opcode: c.opcode.as_raw(),
        vendor_err: c.vendor_err,
        byte_len: c.byte_len,
        __bindgen_anon_1: sys::ibv_wc__bindgen_ty_1 { imm_data: extra },
        qp_num: c.qp_num,
        src_qp: c.src_qp,
        wc_flags: flags,
        pkey_index: 0,
        slid: 0,
        sl: 0,
        dlid_path_bits: 0,
    }
}

unsafe extern "C" fn req_notify_cq(cq: *mut sys::ibv_cq, solicited_only: c_int) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: `cq` is a live CQ of this library (the C contract).
        let q: &Cq = unsafe { obj(cq) };
        q.raw.arm(solicited_only != 0);
        0
    })
}

/// The send flags the soft device knows: fence, signaled, solicited, inline.
const SEND_FLAGS: u32 = 0xf;

/// One `ibv_send_wr` as a raw request.
///
/// # Safety
/// `wr.sg_list` holds `wr.num_sge` entries (the C contract).
unsafe fn send_req<'a>(q: &Qp, wr: &'a sys::ibv_send_wr) -> Result<SendReq<'a>, c_int> {
    let n = wr.num_sge;
    if n < 0 || n as u32 > q.caps.max_send_sge.max(1) || (n > 0 && wr.sg_list.is_null()) {
        return Err(libc::EINVAL);
    }
    if wr.send_flags & !SEND_FLAGS != 0 {
        return Err(libc::EINVAL);
    }
    let opcode = WrOpcode::from_raw(wr.opcode).ok_or(libc::EINVAL)?;
    let sges: &[Sge] = if n == 0 {
        &[]
    } else {
        // SAFETY: `Sge` has `ibv_sge`'s layout; `sg_list` holds `n` of them (the C contract).
        unsafe { std::slice::from_raw_parts(wr.sg_list.cast::<Sge>(), n as usize) }
    };
    // SAFETY: the unions are read as the opcode says the program filled them; every field is
    // plain integers, so any bits are a valid value.
    let (imm, inv, rdma, atomic) = unsafe {
        (
            wr.__bindgen_anon_1.imm_data,
            wr.__bindgen_anon_1.invalidate_rkey,
            wr.wr.rdma,
            wr.wr.atomic,
        )
    };
    let (remote_addr, rkey) = if opcode.is_atomic() {
        (atomic.remote_addr, atomic.rkey)
    } else {
        (rdma.remote_addr, rdma.rkey)
    };
    Ok(SendReq {
        wr_id: wr.wr_id,
        opcode,
        flags: SendFlags::from_bits_truncate(wr.send_flags),
        sges,
        remote_addr,
        rkey,
        imm: u32::from_be(imm),
        invalidate_rkey: inv,
        compare_add: atomic.compare_add,
        swap: atomic.swap,
    })
}

/// Posts a C chain of requests one by one with `post`; at the first failure, points `*bad` at
/// the request that failed and returns its errno (the requests before it stay posted).
///
/// # Safety
/// Every request of the chain is readable and `bad` is null or writable (the C contract).
unsafe fn post_chain<W>(
    mut wr: *mut W,
    bad: *mut *mut W,
    next: impl Fn(&W) -> *mut W,
    mut post: impl FnMut(&W) -> Result<(), c_int>,
) -> c_int {
    while !wr.is_null() {
        // SAFETY: each request of the list is readable (the caller's contract).
        let w = unsafe { &*wr };
        if let Err(e) = post(w) {
            if !bad.is_null() {
                // SAFETY: `bad` is writable (the caller's contract).
                unsafe { *bad = wr };
            }
            return e;
        }
        wr = next(w);
    }
    0
}

unsafe extern "C" fn post_send(
    qp: *mut sys::ibv_qp,
    wr: *mut sys::ibv_send_wr,
    bad: *mut *mut sys::ibv_send_wr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: `qp` is a live QP of this library (the C contract).
        let q: &Qp = unsafe { obj(qp) };
        // SAFETY: its context is open.
        let c = unsafe { ctx_of(q.qpx.qp_base.context) };
        let post = |w: &sys::ibv_send_wr| {
            // SAFETY: the request's SGE list is readable, and so are its inline bytes during
            // the call (the C contract).
            let r = unsafe { send_req(q, w) }?;
            // SAFETY: memory other than inline bytes is reached by key only, which the device
            // checks; inline bytes are read during this call.
            unsafe { q.raw.post_send(&c.raw, &[r]) }.map_err(|(_, e)| e)
        };
        // SAFETY: the chain and `bad` as the C contract gives them.
        unsafe { post_chain(wr, bad, |w| w.next, post) }
    })
}

unsafe extern "C" fn post_recv(
    qp: *mut sys::ibv_qp,
    wr: *mut sys::ibv_recv_wr,
    bad: *mut *mut sys::ibv_recv_wr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: `qp` is a live QP of this library (the C contract).
        let q: &Qp = unsafe { obj(qp) };
        // SAFETY: its context is open.
        let c = unsafe { ctx_of(q.qpx.qp_base.context) };
        let post = |w: &sys::ibv_recv_wr| {
            let n = w.num_sge;
            if n < 0 || n as u32 > q.caps.max_recv_sge.max(1) || (n > 0 && w.sg_list.is_null()) {
                return Err(libc::EINVAL);
            }
            let sges: &[Sge] = if n == 0 {
                &[]
            } else {
                // SAFETY: `Sge` has `ibv_sge`'s layout; `sg_list` holds `n` entries (the C
                // contract).
                unsafe { std::slice::from_raw_parts(w.sg_list.cast::<Sge>(), n as usize) }
            };
            let req = RecvReq {
                wr_id: w.wr_id,
                sges,
            };
            q.raw.post_recv(&c.raw, &[req]).map_err(|(_, e)| e)
        };
        // SAFETY: the chain and `bad` as the C contract gives them.
        unsafe { post_chain(wr, bad, |w| w.next, post) }
    })
}

unsafe extern "C" fn post_srq_recv(
    _srq: *mut sys::ibv_srq,
    wr: *mut sys::ibv_recv_wr,
    bad: *mut *mut sys::ibv_recv_wr,
) -> c_int {
    if !bad.is_null() {
        // SAFETY: `bad` is writable (the C contract).
        unsafe { *bad = wr };
    }
    libc::EOPNOTSUPP
}

unsafe extern "C" fn bind_mw(
    _qp: *mut sys::ibv_qp,
    _mw: *mut sys::ibv_mw,
    _bind: *mut sys::ibv_mw_bind,
) -> c_int {
    libc::EOPNOTSUPP
}

unsafe extern "C" fn dealloc_mw(_mw: *mut sys::ibv_mw) -> c_int {
    libc::EOPNOTSUPP
}

/// A request built with the `wr_*` functions, owning its SGEs or inline bytes.
#[derive(Debug)]
struct Built {
    wr_id: u64,
    opcode: WrOpcode,
    flags: SendFlags,
    remote_addr: u64,
    rkey: u32,
    imm: u32,
    inv: u32,
    compare_add: u64,
    swap: u64,
    sges: Vec<Sge>,
    inline: Vec<u8>,
}

/// The requests between `wr_start` and `wr_complete`, and the first error among them. The
/// entries (and their SGE and inline buffers) are kept and reused from one batch to the next:
/// a latency-bound program posting one request at a time allocates nothing.
#[derive(Debug, Default)]
pub struct Pending {
    reqs: Vec<Built>,
    /// How many of `reqs` this batch has built.
    n: usize,
    err: c_int,
}

impl Pending {
    /// Forgets the batch (keeping the buffers).
    fn reset(&mut self) {
        self.n = 0;
        self.err = 0;
    }

    /// The request built last, if any.
    fn last_mut(&mut self) -> Option<&mut Built> {
        let i = self.n.checked_sub(1)?;
        self.reqs.get_mut(i)
    }

    /// A new request, its SGEs and inline bytes empty.
    fn next(&mut self) -> &mut Built {
        if self.n == self.reqs.len() {
            self.reqs.push(Built {
                wr_id: 0,
                opcode: WrOpcode::Send,
                flags: SendFlags::empty(),
                remote_addr: 0,
                rkey: 0,
                imm: 0,
                inv: 0,
                compare_add: 0,
                swap: 0,
                sges: Vec::new(),
                inline: Vec::new(),
            });
        }
        self.n += 1;
        let b = &mut self.reqs[self.n - 1];
        b.sges.clear();
        b.inline.clear();
        b
    }
}

pub(crate) fn fill_qp_ex(x: &mut sys::ibv_qp_ex) {
    x.wr_atomic_cmp_swp = Some(wr_atomic_cmp_swp);
    x.wr_atomic_fetch_add = Some(wr_atomic_fetch_add);
    x.wr_bind_mw = Some(wr_bind_mw);
    x.wr_local_inv = Some(wr_unsupported_u32);
    x.wr_rdma_read = Some(wr_rdma_read);
    x.wr_rdma_write = Some(wr_rdma_write);
    x.wr_rdma_write_imm = Some(wr_rdma_write_imm);
    x.wr_send = Some(wr_send);
    x.wr_send_imm = Some(wr_send_imm);
    x.wr_send_inv = Some(wr_send_inv);
    x.wr_send_tso = Some(wr_send_tso);
    x.wr_set_ud_addr = Some(wr_set_ud_addr);
    x.wr_set_xrc_srqn = Some(wr_unsupported_u32);
    x.wr_set_inline_data = Some(wr_set_inline_data);
    x.wr_set_inline_data_list = Some(wr_set_inline_data_list);
    x.wr_set_sge = Some(wr_set_sge);
    x.wr_set_sge_list = Some(wr_set_sge_list);
    x.wr_start = Some(wr_start);
    x.wr_complete = Some(wr_complete);
    x.wr_abort = Some(wr_abort);
    x.wr_atomic_write = Some(wr_atomic_write);
}

/// Runs `f` on the QP's pending requests; a panic marks the batch failed.
fn with_pending(qpx: *mut sys::ibv_qp_ex, f: impl FnOnce(&mut Pending, &sys::ibv_qp_ex)) {
    guard((), || {
        // SAFETY: `qpx` is the `ibv_qp_ex` that starts a live `Qp` (the C contract).
        let q: &Qp = unsafe { obj(qpx) };
        let mut p = lock(&q.pending);
        f(&mut p, &q.qpx);
    });
}

/// Starts a request of `opcode` with the QP's current `wr_id` and `wr_flags`.
fn begin(qpx: *mut sys::ibv_qp_ex, opcode: WrOpcode, remote: (u64, u32), imm: u32, inv: u32) {
    with_pending(qpx, |p, x| {
        if x.wr_flags & !SEND_FLAGS != 0 && p.err == 0 {
            p.err = libc::EINVAL;
        }
        let b = p.next();
        b.wr_id = x.wr_id;
        b.opcode = opcode;
        b.flags = SendFlags::from_bits_truncate(x.wr_flags);
        b.remote_addr = remote.0;
        b.rkey = remote.1;
        b.imm = imm;
        b.inv = inv;
        b.compare_add = 0;
        b.swap = 0;
    });
}

fn fail(qpx: *mut sys::ibv_qp_ex, e: c_int) {
    with_pending(qpx, |p, _| {
        if p.err == 0 {
            p.err = e;
        }
    });
}

unsafe extern "C" fn wr_start(qpx: *mut sys::ibv_qp_ex) {
    with_pending(qpx, |p, _| p.reset());
}

unsafe extern "C" fn wr_abort(qpx: *mut sys::ibv_qp_ex) {
    with_pending(qpx, |p, _| p.reset());
}

unsafe extern "C" fn wr_complete(qpx: *mut sys::ibv_qp_ex) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: `qpx` starts a live `Qp` (the C contract).
        let q: &Qp = unsafe { obj(qpx) };
        // SAFETY: its context is open.
        let c = unsafe { ctx_of(q.qpx.qp_base.context) };
        // Held while the batch posts: the `wr_*` calls of one queue pair are the caller's to
        // serialise, and the buffers are reused by the next batch.
        let mut p = lock(&q.pending);
        let err = std::mem::take(&mut p.err);
        let n = std::mem::take(&mut p.n);
        if err != 0 {
            return err;
        }
        for b in &p.reqs[..n] {
            let isge = [Sge::new(b.inline.as_ptr() as u64, b.inline.len() as u32, 0)];
            let sges: &[Sge] = if b.flags.contains(SendFlags::INLINE) {
                &isge
            } else {
                &b.sges
            };
            if sges.len() as u32 > q.caps.max_send_sge.max(1) {
                return libc::EINVAL;
            }
            let r = SendReq {
                wr_id: b.wr_id,
                opcode: b.opcode,
                flags: b.flags,
                sges,
                remote_addr: b.remote_addr,
                rkey: b.rkey,
                imm: b.imm,
                invalidate_rkey: b.inv,
                compare_add: b.compare_add,
                swap: b.swap,
            };
            // SAFETY: inline bytes are this batch's own copy, alive during the call; other
            // memory is reached by key only.
            if let Err((_, e)) = unsafe { q.raw.post_send(&c.raw, &[r]) } {
                return e;
            }
        }
        0
    })
}

unsafe extern "C" fn wr_rdma_write(qpx: *mut sys::ibv_qp_ex, rkey: u32, addr: u64) {
    begin(qpx, WrOpcode::RdmaWrite, (addr, rkey), 0, 0);
}

unsafe extern "C" fn wr_rdma_write_imm(qpx: *mut sys::ibv_qp_ex, rkey: u32, addr: u64, imm: u32) {
    begin(
        qpx,
        WrOpcode::RdmaWriteWithImm,
        (addr, rkey),
        u32::from_be(imm),
        0,
    );
}

unsafe extern "C" fn wr_rdma_read(qpx: *mut sys::ibv_qp_ex, rkey: u32, addr: u64) {
    begin(qpx, WrOpcode::RdmaRead, (addr, rkey), 0, 0);
}

unsafe extern "C" fn wr_send(qpx: *mut sys::ibv_qp_ex) {
    begin(qpx, WrOpcode::Send, (0, 0), 0, 0);
}

unsafe extern "C" fn wr_send_imm(qpx: *mut sys::ibv_qp_ex, imm: u32) {
    begin(qpx, WrOpcode::SendWithImm, (0, 0), u32::from_be(imm), 0);
}

unsafe extern "C" fn wr_send_inv(qpx: *mut sys::ibv_qp_ex, rkey: u32) {
    begin(qpx, WrOpcode::SendWithInv, (0, 0), 0, rkey);
}

unsafe extern "C" fn wr_atomic_cmp_swp(
    qpx: *mut sys::ibv_qp_ex,
    rkey: u32,
    addr: u64,
    compare: u64,
    swap: u64,
) {
    begin(qpx, WrOpcode::AtomicCmpAndSwp, (addr, rkey), 0, 0);
    with_pending(qpx, |p, _| {
        if let Some(b) = p.last_mut() {
            b.compare_add = compare;
            b.swap = swap;
        }
    });
}

unsafe extern "C" fn wr_atomic_fetch_add(qpx: *mut sys::ibv_qp_ex, rkey: u32, addr: u64, add: u64) {
    begin(qpx, WrOpcode::AtomicFetchAndAdd, (addr, rkey), 0, 0);
    with_pending(qpx, |p, _| {
        if let Some(b) = p.last_mut() {
            b.compare_add = add;
        }
    });
}

unsafe extern "C" fn wr_bind_mw(
    qpx: *mut sys::ibv_qp_ex,
    _mw: *mut sys::ibv_mw,
    _rkey: u32,
    _info: *const sys::ibv_mw_bind_info,
) {
    fail(qpx, libc::EOPNOTSUPP);
}

unsafe extern "C" fn wr_unsupported_u32(qpx: *mut sys::ibv_qp_ex, _v: u32) {
    fail(qpx, libc::EOPNOTSUPP);
}

unsafe extern "C" fn wr_send_tso(qpx: *mut sys::ibv_qp_ex, _h: *mut c_void, _s: u16, _m: u16) {
    fail(qpx, libc::EOPNOTSUPP);
}

unsafe extern "C" fn wr_set_ud_addr(
    qpx: *mut sys::ibv_qp_ex,
    _ah: *mut sys::ibv_ah,
    _qpn: u32,
    _qkey: u32,
) {
    fail(qpx, libc::EOPNOTSUPP);
}

unsafe extern "C" fn wr_atomic_write(
    qpx: *mut sys::ibv_qp_ex,
    _rkey: u32,
    _addr: u64,
    _wr: *const c_void,
) {
    fail(qpx, libc::EOPNOTSUPP);
}

/// Sets the last request's SGEs to `sges` (or fails the batch when there is none).
fn set_sges(qpx: *mut sys::ibv_qp_ex, sges: &[Sge]) {
    with_pending(qpx, |p, _| {
        let err = p.err;
        match p.last_mut() {
            Some(b) => {
                b.sges.clear();
                b.sges.extend_from_slice(sges);
            }
            None if err == 0 => p.err = libc::EINVAL,
            None => {}
        }
    });
}

unsafe extern "C" fn wr_set_sge(qpx: *mut sys::ibv_qp_ex, lkey: u32, addr: u64, len: u32) {
    set_sges(qpx, &[Sge::new(addr, len, lkey)]);
}

unsafe extern "C" fn wr_set_sge_list(
    qpx: *mut sys::ibv_qp_ex,
    n: usize,
    list: *const sys::ibv_sge,
) {
    if n > 0 && list.is_null() {
        return fail(qpx, libc::EINVAL);
    }
    if n == 0 {
        return set_sges(qpx, &[]);
    }
    // SAFETY: `list` holds `n` entries of `ibv_sge`'s layout, which `Sge` has (the C
    // contract); they are copied now.
    set_sges(qpx, unsafe {
        std::slice::from_raw_parts(list.cast::<Sge>(), n)
    });
}

/// Appends inline bytes to the last request and marks it inline.
fn add_inline(qpx: *mut sys::ibv_qp_ex, bufs: &[(*const u8, usize)]) {
    with_pending(qpx, |p, _| {
        let err = p.err;
        let Some(b) = p.last_mut() else {
            if err == 0 {
                p.err = libc::EINVAL;
            }
            return;
        };
        b.flags |= SendFlags::INLINE;
        for &(addr, len) in bufs {
            if len > 0 {
                // SAFETY: `addr` holds `len` readable bytes (the C contract of
                // ibv_wr_set_inline_data*); they are copied now.
                b.inline
                    .extend_from_slice(unsafe { std::slice::from_raw_parts(addr, len) });
            }
        }
    });
}

unsafe extern "C" fn wr_set_inline_data(qpx: *mut sys::ibv_qp_ex, addr: *mut c_void, len: usize) {
    if len > 0 && addr.is_null() {
        return fail(qpx, libc::EINVAL);
    }
    add_inline(qpx, &[(addr.cast_const().cast(), len)]);
}

unsafe extern "C" fn wr_set_inline_data_list(
    qpx: *mut sys::ibv_qp_ex,
    n: usize,
    list: *const sys::ibv_data_buf,
) {
    if n > 0 && list.is_null() {
        return fail(qpx, libc::EINVAL);
    }
    let bufs: Vec<(*const u8, usize)> = (0..n)
        .map(|i| {
            // SAFETY: `list` holds `n` entries (the C contract).
            let b = unsafe { &*list.add(i) };
            (b.addr.cast_const().cast(), b.length)
        })
        .collect();
    if bufs.iter().any(|&(a, l)| l > 0 && a.is_null()) {
        return fail(qpx, libc::EINVAL);
    }
    add_inline(qpx, &bufs);
}
