//! Protection domains, memory regions, completion channels and queues, queue pairs and
//! asynchronous events: each a `#[repr(C)]` struct that starts with the rdma-core struct the
//! program sees.

use std::ffi::c_void;
use std::os::raw::c_int;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use erdma::raw_provider::{self as raw, RawCq, RawMr, RawPd, RawQp};
use erdma::{Access, AddressVector, EventElement, Gid, Mtu, QpAttr, QpCaps, QpState};
use erdma_sys as sys;

use crate::device::{Context, context};
use crate::{errno_ret, guard, minus_one, ptr_or_errno, set_errno};

/// A protection domain.
#[repr(C)]
pub struct Pd {
    pub pd: sys::ibv_pd,
    pub raw: RawPd,
}

/// A memory region.
#[repr(C)]
pub struct Mr {
    pub mr: sys::ibv_mr,
    pub raw: RawMr,
}

/// A completion queue: its events reach its channel through its eventfd, which is in the
/// channel's epoll set.
#[repr(C)]
pub struct Cq {
    pub cq: sys::ibv_cq,
    pub raw: RawCq,
    pub id: u64,
}

/// A queue pair: `ibv_qp_ex` (whose first member is `ibv_qp`), then the library's state.
#[repr(C)]
pub struct Qp {
    pub qpx: sys::ibv_qp_ex,
    pub raw: RawQp,
    pub caps: QpCaps,
    pub sig_all: bool,
    /// The attributes last set (what `ibv_query_qp` reports besides the state).
    pub attr: Mutex<sys::ibv_qp_attr>,
    /// Requests built with the `wr_*` functions, posted by `wr_complete`.
    pub pending: Mutex<crate::datapath::Pending>,
}

/// `&*p`, for the handles of this library.
///
/// # Safety
/// `p` is a live object this library made, of type `T` (the C contract).
pub(crate) unsafe fn obj<'a, T, U>(p: *mut U) -> &'a T {
    // SAFETY: the caller's contract: `p` points at the first field of a live `T`.
    unsafe { &*p.cast::<T>() }
}

/// The library's context of an object's `context` field.
///
/// # Safety
/// `ctx` is an open context.
pub(crate) unsafe fn ctx_of<'a>(ctx: *mut sys::ibv_context) -> &'a Context {
    // SAFETY: the caller's contract.
    unsafe { context(ctx) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_alloc_pd(ctx: *mut sys::ibv_context) -> *mut sys::ibv_pd {
    guard(std::ptr::null_mut(), || {
        // SAFETY: `ctx` is open (the C contract).
        let c = unsafe { ctx_of(ctx) };
        ptr_or_errno(c.raw.alloc_pd().map_err(|e| raw::errno(&e)).map(|raw| {
            let pd = Box::new(Pd {
                pd: sys::ibv_pd {
                    context: ctx,
                    handle: 0,
                },
                raw,
            });
            Box::into_raw(pd).cast()
        }))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut sys::ibv_pd) -> c_int {
    guard(libc::EIO, || {
        if pd.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: `pd` is a live PD of this library (the C contract), freed once here.
        let p = unsafe { Box::from_raw(pd.cast::<Pd>()) };
        // SAFETY: its context is open.
        p.raw.dealloc(&unsafe { ctx_of(p.pd.context) }.raw);
        0
    })
}

/// The access bits rdma-core lets a caller ask for and drop silently where unsupported
/// (`IBV_ACCESS_OPTIONAL_RANGE`).
const ACCESS_OPTIONAL: u32 = 0x3ff0_0000;

fn mr_access(bits: u32) -> Result<Access, c_int> {
    let a = Access::from_bits(bits & !ACCESS_OPTIONAL | (bits & Access::RELAXED_ORDERING.bits()))
        .ok_or(libc::EINVAL)?;
    // Remote write or atomics need local write (IBTA; the kernel returns EINVAL).
    if a.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)
        && !a.contains(Access::LOCAL_WRITE)
    {
        return Err(libc::EINVAL);
    }
    Ok(a - Access::RELAXED_ORDERING)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut sys::ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: u32,
) -> *mut sys::ibv_mr {
    guard(std::ptr::null_mut(), || {
        ptr_or_errno((|| {
            if pd.is_null() {
                return Err(libc::EINVAL);
            }
            if iova != addr as u64 {
                // The soft device addresses a region by its virtual address.
                return Err(libc::EOPNOTSUPP);
            }
            let access = mr_access(access)?;
            // SAFETY: `pd` is a live PD (the C contract).
            let p: &Pd = unsafe { obj(pd) };
            // SAFETY: its context is open.
            let c = unsafe { ctx_of(p.pd.context) };
            // SAFETY: the C contract of ibv_reg_mr: the memory stays allocated until
            // ibv_dereg_mr, and the device may read and write it meanwhile.
            let (raw, key) = unsafe { p.raw.reg_mr(&c.raw, addr.cast(), len, access) }
                .map_err(|e| raw::errno(&e))?;
            let mr = Box::new(Mr {
                mr: sys::ibv_mr {
                    context: p.pd.context,
                    pd,
                    addr,
                    length: len,
                    handle: key,
                    lkey: key,
                    rkey: key,
                },
                raw,
            });
            Ok(Box::into_raw(mr).cast())
        })())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_reg_mr(
    pd: *mut sys::ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> *mut sys::ibv_mr {
    // SAFETY: the same contract.
    unsafe { ibv_reg_mr_iova2(pd, addr, len, addr as u64, access as u32) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut sys::ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> *mut sys::ibv_mr {
    // SAFETY: the same contract.
    unsafe { ibv_reg_mr_iova2(pd, addr, len, iova, access as u32) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut sys::ibv_mr) -> c_int {
    guard(libc::EIO, || {
        if mr.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: `mr` is a live MR of this library (the C contract), freed once here.
        let m = unsafe { Box::from_raw(mr.cast::<Mr>()) };
        // SAFETY: its context is open.
        m.raw.deregister(&unsafe { ctx_of(m.mr.context) }.raw);
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_create_comp_channel(
    ctx: *mut sys::ibv_context,
) -> *mut sys::ibv_comp_channel {
    guard(std::ptr::null_mut(), || {
        // SAFETY: plain syscall.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return std::ptr::null_mut(); // errno is epoll_create1's
        }
        Box::into_raw(Box::new(sys::ibv_comp_channel {
            context: ctx,
            fd,
            refcnt: 0,
        }))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut sys::ibv_comp_channel) -> c_int {
    guard(libc::EIO, || {
        if ch.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: `ch` is a live channel of this library (the C contract).
        let refs = unsafe { AtomicU32::from_ptr((&raw mut (*ch).refcnt).cast()) };
        if refs.load(Ordering::Acquire) != 0 {
            return libc::EBUSY;
        }
        // SAFETY: as above; freed once here.
        let ch = unsafe { Box::from_raw(ch) };
        // SAFETY: the channel's own epoll descriptor.
        unsafe { libc::close(ch.fd) };
        0
    })
}

fn epoll(ch: &sys::ibv_comp_channel, op: c_int, fd: c_int, cq: *mut Cq) -> Result<(), c_int> {
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: cq as u64,
    };
    // SAFETY: `ev` is a valid event for the call's duration.
    if unsafe { libc::epoll_ctl(ch.fd, op, fd, &mut ev) } < 0 {
        return Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO));
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_create_cq(
    ctx: *mut sys::ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut sys::ibv_comp_channel,
    comp_vector: c_int,
) -> *mut sys::ibv_cq {
    guard(std::ptr::null_mut(), || {
        ptr_or_errno((|| {
            // SAFETY: `ctx` is open (the C contract).
            let c = unsafe { ctx_of(ctx) };
            let max = c.raw.query_device().max_cqe;
            if cqe < 1 || cqe as u32 > max || comp_vector != 0 {
                return Err(libc::EINVAL);
            }
            static NEXT: AtomicU64 = AtomicU64::new(1);
            let id = NEXT.fetch_add(1, Ordering::Relaxed);
            let raw = c
                .raw
                .create_cq(cqe as u32, id, &c.events)
                .map_err(|e| raw::errno(&e))?;
            // SAFETY: `ibv_cq` is pointers, integers, a mutex and a condition variable: all
            // zeroes is valid (their static initializers on glibc).
            let mut cq: sys::ibv_cq = unsafe { std::mem::zeroed() };
            cq.context = ctx;
            cq.channel = channel;
            cq.cq_context = cq_context;
            cq.handle = id as u32;
            cq.cqe = cqe;
            let p = Box::into_raw(Box::new(Cq { cq, raw, id }));
            if !channel.is_null() {
                // SAFETY: `channel` is a live channel (the C contract); `p` is live.
                let ch = unsafe { &*channel };
                // SAFETY: as above.
                if let Err(e) = epoll(ch, libc::EPOLL_CTL_ADD, unsafe { (*p).raw.event_fd() }, p) {
                    // SAFETY: `p` was made above and is not shared yet.
                    let q = unsafe { Box::from_raw(p) };
                    q.raw.destroy(&c.raw);
                    return Err(e);
                }
                // SAFETY: the channel's refcount, touched only atomically by this library.
                unsafe { AtomicU32::from_ptr((&raw mut (*channel).refcnt).cast()) }
                    .fetch_add(1, Ordering::AcqRel);
            }
            lock(&c.cqs).insert(id, p as usize);
            Ok(p.cast())
        })())
    })
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut sys::ibv_cq) -> c_int {
    guard(libc::EIO, || {
        if cq.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: `cq` is a live CQ of this library (the C contract), freed once here.
        let q = unsafe { Box::from_raw(cq.cast::<Cq>()) };
        // SAFETY: its context is open.
        let c = unsafe { ctx_of(q.cq.context) };
        if !q.cq.channel.is_null() {
            // SAFETY: the CQ's channel outlives it (rdma-core refuses to destroy it before).
            let ch = unsafe { &*q.cq.channel };
            let _ = epoll(
                ch,
                libc::EPOLL_CTL_DEL,
                q.raw.event_fd(),
                std::ptr::null_mut(),
            );
            // SAFETY: as in ibv_create_cq.
            unsafe { AtomicU32::from_ptr((&raw mut (*q.cq.channel).refcnt).cast()) }
                .fetch_sub(1, Ordering::AcqRel);
        }
        lock(&c.cqs).remove(&q.id);
        q.raw.destroy(&c.raw);
        0
    })
}

fn nonblocking(fd: c_int) -> bool {
    // SAFETY: plain syscall on a descriptor of this library.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_get_cq_event(
    ch: *mut sys::ibv_comp_channel,
    cq_out: *mut *mut sys::ibv_cq,
    ctx_out: *mut *mut c_void,
) -> c_int {
    guard(-1, || {
        if ch.is_null() || cq_out.is_null() || ctx_out.is_null() {
            return minus_one(Err(libc::EINVAL));
        }
        // SAFETY: `ch` is a live channel (the C contract).
        let fd = unsafe { (*ch).fd };
        let timeout = if nonblocking(fd) { 0 } else { -1 };
        loop {
            let mut ev = libc::epoll_event { events: 0, u64: 0 };
            // SAFETY: `ev` has room for the one event asked for.
            let n = unsafe { libc::epoll_wait(fd, &mut ev, 1, timeout) };
            if n < 0 {
                return -1; // errno is epoll_wait's (EINTR, as rdma-core's read gives)
            }
            if n == 0 {
                return minus_one(Err(libc::EAGAIN));
            }
            let p = ev.u64 as *mut Cq;
            // SAFETY: a CQ stays in the set only while it lives (ibv_destroy_cq removes it).
            let q = unsafe { &*p };
            if q.raw.consume_events() == 0 {
                continue; // another thread took this one
            }
            // SAFETY: the out-parameters are writable (the C contract).
            unsafe {
                *cq_out = p.cast();
                *ctx_out = q.cq.cq_context;
            }
            return 0;
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut sys::ibv_cq, n: u32) {
    if cq.is_null() {
        return;
    }
    // SAFETY: `cq` is live (the C contract); the counter is touched atomically only.
    unsafe { AtomicU32::from_ptr(&raw mut (*cq).comp_events_completed) }
        .fetch_add(n, Ordering::AcqRel);
}

// ibv_qp_init_attr_mask and ibv_qp_create_send_ops_flags (verbs.h).
const INIT_ATTR_PD: u32 = 1;
const INIT_ATTR_SEND_OPS_FLAGS: u32 = 1 << 6;
/// The `wr_*` operations the soft device has: WRITE ±imm, SEND ±imm, READ, CAS, FAA, SEND
/// with invalidate.
const SEND_OPS_SUPPORTED: u64 = 1 | 2 | 4 | 8 | 16 | 32 | 64 | 512;

const QPT_RC: u32 = 2;

fn create_qp(pd: *mut sys::ibv_pd, a: &mut sys::ibv_qp_init_attr) -> Result<*mut Qp, c_int> {
    if pd.is_null() || a.send_cq.is_null() || a.recv_cq.is_null() {
        return Err(libc::EINVAL);
    }
    if a.qp_type != QPT_RC {
        return Err(libc::EOPNOTSUPP);
    }
    if !a.srq.is_null() {
        return Err(libc::EINVAL); // this library makes no SRQ
    }
    // SAFETY: `pd`, `send_cq` and `recv_cq` are live objects of this library (the C contract).
    let (p, scq, rcq): (&Pd, &Cq, &Cq) = unsafe { (obj(pd), obj(a.send_cq), obj(a.recv_cq)) };
    if scq.cq.context != p.pd.context || rcq.cq.context != p.pd.context {
        return Err(libc::EINVAL);
    }
    // SAFETY: their context is open.
    let c = unsafe { ctx_of(p.pd.context) };
    let want = QpCaps {
        max_send_wr: a.cap.max_send_wr,
        max_recv_wr: a.cap.max_recv_wr,
        max_send_sge: a.cap.max_send_sge,
        max_recv_sge: a.cap.max_recv_sge,
        max_inline_data: a.cap.max_inline_data,
    };
    let d = c.raw.query_device();
    if want.max_send_wr > d.max_qp_wr
        || want.max_recv_wr > d.max_qp_wr
        || want.max_send_sge > d.max_sge
        || want.max_recv_sge > d.max_sge
    {
        return Err(libc::EINVAL);
    }
    let sig_all = a.sq_sig_all != 0;
    let (raw, qpn, caps) = p
        .raw
        .create_qp(&c.raw, &scq.raw, &rcq.raw, &want, sig_all, &c.events)
        .map_err(|e| raw::errno(&e))?;
    a.cap = sys::ibv_qp_cap {
        max_send_wr: caps.max_send_wr,
        max_recv_wr: caps.max_recv_wr,
        max_send_sge: caps.max_send_sge,
        max_recv_sge: caps.max_recv_sge,
        max_inline_data: caps.max_inline_data,
    };
    // SAFETY: `ibv_qp_ex` is pointers, integers, nullable function pointers, a mutex and a
    // condition variable: all zeroes is valid.
    let mut qpx: sys::ibv_qp_ex = unsafe { std::mem::zeroed() };
    let q = &mut qpx.qp_base;
    q.context = p.pd.context;
    q.qp_context = a.qp_context;
    q.pd = pd;
    q.send_cq = a.send_cq;
    q.recv_cq = a.recv_cq;
    q.handle = qpn;
    q.qp_num = qpn;
    q.state = QpState::Reset.as_raw();
    q.qp_type = a.qp_type;
    crate::datapath::fill_qp_ex(&mut qpx);
    // SAFETY: `ibv_qp_attr` is integers only.
    let attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
    let b = Box::into_raw(Box::new(Qp {
        qpx,
        raw,
        caps,
        sig_all,
        attr: Mutex::new(attr),
        pending: Mutex::default(),
    }));
    lock(&c.qps).insert(qpn, b as usize);
    Ok(b)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_create_qp(
    pd: *mut sys::ibv_pd,
    attr: *mut sys::ibv_qp_init_attr,
) -> *mut sys::ibv_qp {
    guard(std::ptr::null_mut(), || {
        if attr.is_null() {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        }
        // SAFETY: `attr` is readable and writable (the C contract).
        ptr_or_errno(create_qp(pd, unsafe { &mut *attr }).map(|q| q.cast()))
    })
}

/// `verbs_context.create_qp_ex`: an RC QP with a PD and, optionally, the `wr_*` operations
/// the soft device has; anything else is `EOPNOTSUPP`.
pub(crate) unsafe extern "C" fn vctx_create_qp_ex(
    _ctx: *mut sys::ibv_context,
    a: *mut sys::ibv_qp_init_attr_ex,
) -> *mut sys::ibv_qp {
    guard(std::ptr::null_mut(), || {
        ptr_or_errno((|| {
            if a.is_null() {
                return Err(libc::EINVAL);
            }
            // SAFETY: `a` is readable and writable (the C contract).
            let a = unsafe { &mut *a };
            if a.comp_mask & INIT_ATTR_PD == 0 {
                return Err(libc::EINVAL);
            }
            if a.comp_mask & !(INIT_ATTR_PD | INIT_ATTR_SEND_OPS_FLAGS) != 0 {
                return Err(libc::EOPNOTSUPP);
            }
            if a.comp_mask & INIT_ATTR_SEND_OPS_FLAGS != 0
                && a.send_ops_flags & !SEND_OPS_SUPPORTED != 0
            {
                return Err(libc::EOPNOTSUPP);
            }
            let mut basic = sys::ibv_qp_init_attr {
                qp_context: a.qp_context,
                send_cq: a.send_cq,
                recv_cq: a.recv_cq,
                srq: a.srq,
                cap: a.cap,
                qp_type: a.qp_type,
                sq_sig_all: a.sq_sig_all,
            };
            let q = create_qp(a.pd, &mut basic)?;
            a.cap = basic.cap;
            Ok(q.cast())
        })())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_qp_to_qp_ex(qp: *mut sys::ibv_qp) -> *mut sys::ibv_qp_ex {
    qp.cast()
}

/// A bit of `enum ibv_qp_attr_mask` (verbs.h, through erdma-sys's bindings) as the C `int`
/// `ibv_modify_qp` takes.
const fn mask(m: sys::ibv_qp_attr_mask) -> c_int {
    m.0 as c_int
}
const M_STATE: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_STATE);
const M_CUR_STATE: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_CUR_STATE);
const M_EN_SQD_ASYNC_NOTIFY: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_EN_SQD_ASYNC_NOTIFY);
const M_ACCESS_FLAGS: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS);
const M_PKEY_INDEX: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX);
const M_PORT: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_PORT);
const M_QKEY: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_QKEY);
const M_AV: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_AV);
const M_PATH_MTU: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_PATH_MTU);
const M_TIMEOUT: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_TIMEOUT);
const M_RETRY_CNT: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_RETRY_CNT);
const M_RNR_RETRY: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_RNR_RETRY);
const M_RQ_PSN: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_RQ_PSN);
const M_MAX_QP_RD_ATOMIC: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC);
const M_ALT_PATH: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_ALT_PATH);
const M_MIN_RNR_TIMER: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER);
const M_SQ_PSN: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_SQ_PSN);
const M_MAX_DEST_RD_ATOMIC: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC);
const M_PATH_MIG_STATE: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_PATH_MIG_STATE);
const M_CAP: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_CAP);
const M_DEST_QPN: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_DEST_QPN);
const M_RATE_LIMIT: c_int = mask(sys::ibv_qp_attr_mask::IBV_QP_RATE_LIMIT);
/// What an RC QP of this device cannot take: a Q_Key (UD), SQD notification, an alternate
/// path, resizing, a rate limit; and every bit rdma-core does not define.
const M_UNSUPPORTED: c_int = M_QKEY | M_EN_SQD_ASYNC_NOTIFY | M_ALT_PATH | M_CAP | M_RATE_LIMIT;
const M_KNOWN: c_int = ((1 << 21) - 1) | M_RATE_LIMIT;

fn state(v: u32) -> Result<QpState, c_int> {
    QpState::from_raw(v).ok_or(libc::EINVAL)
}

/// The attributes `mask` selects, in the SDK's vocabulary.
fn qp_attr(c: &Context, a: &sys::ibv_qp_attr, mask: c_int) -> Result<QpAttr, c_int> {
    if mask & !M_KNOWN != 0 || mask & M_UNSUPPORTED != 0 {
        return Err(libc::EINVAL);
    }
    let has = |m| mask & m != 0;
    let mut q = QpAttr::EMPTY;
    if has(M_STATE) {
        q.state = Some(state(a.qp_state)?);
    }
    if has(M_CUR_STATE) {
        q.cur_state = Some(state(a.cur_qp_state)?);
    }
    if has(M_PKEY_INDEX) {
        if a.pkey_index != 0 {
            return Err(libc::EINVAL);
        }
        q.pkey_index = Some(a.pkey_index);
    }
    if has(M_PORT) {
        if a.port_num != 1 {
            return Err(libc::EINVAL);
        }
        q.port = Some(a.port_num);
    }
    if has(M_ACCESS_FLAGS) {
        // The QP's rights: local write, remote write, read, atomic (MW bind is ignored).
        q.access = Some(Access::from_bits_truncate(a.qp_access_flags & 0xf));
    }
    if has(M_PATH_MTU) {
        q.path_mtu = Some(Mtu::from_enum(a.path_mtu).ok_or(libc::EINVAL)?);
    }
    if has(M_DEST_QPN) {
        q.dest_qp_num = Some(a.dest_qp_num);
    }
    if has(M_RQ_PSN) {
        q.rq_psn = Some(a.rq_psn);
    }
    if has(M_SQ_PSN) {
        q.sq_psn = Some(a.sq_psn);
    }
    if has(M_MAX_QP_RD_ATOMIC) {
        q.max_rd_atomic = Some(a.max_rd_atomic);
    }
    if has(M_MAX_DEST_RD_ATOMIC) {
        q.max_dest_rd_atomic = Some(a.max_dest_rd_atomic);
    }
    if has(M_MIN_RNR_TIMER) {
        q.min_rnr_timer = Some(a.min_rnr_timer);
    }
    if has(M_TIMEOUT) {
        q.timeout = Some(a.timeout);
    }
    if has(M_RETRY_CNT) {
        q.retry_cnt = Some(a.retry_cnt);
    }
    if has(M_RNR_RETRY) {
        q.rnr_retry = Some(a.rnr_retry);
    }
    if has(M_AV) {
        let ah = &a.ah_attr;
        // RoCE needs the GRH: the destination is a GID.
        let len = c.raw.query_port().gid_tbl_len;
        if ah.is_global == 0 || u32::from(ah.grh.sgid_index) >= len {
            return Err(libc::EINVAL);
        }
        // SAFETY: every bit pattern of the GID union is valid bytes.
        let mut av = AddressVector::new(Gid(unsafe { ah.grh.dgid.raw }), ah.grh.sgid_index);
        av.hop_limit = ah.grh.hop_limit;
        av.traffic_class = ah.grh.traffic_class;
        av.flow_label = ah.grh.flow_label;
        av.sl = ah.sl;
        av.dlid = ah.dlid;
        av.port = if ah.port_num == 0 { 1 } else { ah.port_num };
        q.av = Some(av);
    }
    Ok(q)
}

/// Copies the fields `mask` selects from `a` into the attributes `ibv_query_qp` reports.
fn remember(dst: &mut sys::ibv_qp_attr, a: &sys::ibv_qp_attr, mask: c_int) {
    let has = |m| mask & m != 0;
    if has(M_ACCESS_FLAGS) {
        dst.qp_access_flags = a.qp_access_flags;
    }
    if has(M_PKEY_INDEX) {
        dst.pkey_index = a.pkey_index;
    }
    if has(M_PORT) {
        dst.port_num = a.port_num;
    }
    if has(M_AV) {
        dst.ah_attr = a.ah_attr;
    }
    if has(M_PATH_MTU) {
        dst.path_mtu = a.path_mtu;
    }
    if has(M_DEST_QPN) {
        dst.dest_qp_num = a.dest_qp_num;
    }
    if has(M_RQ_PSN) {
        dst.rq_psn = a.rq_psn;
    }
    if has(M_SQ_PSN) {
        dst.sq_psn = a.sq_psn;
    }
    if has(M_MAX_QP_RD_ATOMIC) {
        dst.max_rd_atomic = a.max_rd_atomic;
    }
    if has(M_MAX_DEST_RD_ATOMIC) {
        dst.max_dest_rd_atomic = a.max_dest_rd_atomic;
    }
    if has(M_MIN_RNR_TIMER) {
        dst.min_rnr_timer = a.min_rnr_timer;
    }
    if has(M_TIMEOUT) {
        dst.timeout = a.timeout;
    }
    if has(M_RETRY_CNT) {
        dst.retry_cnt = a.retry_cnt;
    }
    if has(M_RNR_RETRY) {
        dst.rnr_retry = a.rnr_retry;
    }
    if has(M_PATH_MIG_STATE) {
        dst.path_mig_state = a.path_mig_state;
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_modify_qp(
    qp: *mut sys::ibv_qp,
    attr: *mut sys::ibv_qp_attr,
    mask: c_int,
) -> c_int {
    guard(libc::EIO, || {
        errno_ret((|| {
            if qp.is_null() || attr.is_null() {
                return Err(libc::EINVAL);
            }
            // SAFETY: `qp` is a live QP and `attr` readable (the C contract).
            let (q, a): (&Qp, _) = unsafe { (obj(qp), &*attr) };
            // SAFETY: its context is open.
            let c = unsafe { ctx_of(q.qpx.qp_base.context) };
            let want = qp_attr(c, a, mask)?;
            let mut cache = lock(&q.attr);
            q.raw.modify(&c.raw, &want).map_err(|e| {
                let n = raw::errno(&e);
                if n == libc::EADDRINUSE {
                    // The device's first queue pair to leave INIT binds its address: say what
                    // holds it, as a program prints only "Failed to modify QP".
                    eprintln!("libibverbs (erdma): {e}");
                }
                n
            })?;
            remember(&mut cache, a, mask);
            if let Some(s) = want.state {
                // SAFETY: `qp->state` is the library's to write (rdma-core writes it here).
                unsafe { (*qp).state = s.as_raw() };
            }
            Ok(())
        })())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut sys::ibv_qp,
    attr: *mut sys::ibv_qp_attr,
    _mask: c_int,
    init: *mut sys::ibv_qp_init_attr,
) -> c_int {
    guard(libc::EIO, || {
        if qp.is_null() || attr.is_null() || init.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: `qp` is a live QP (the C contract).
        let q: &Qp = unsafe { obj(qp) };
        // SAFETY: its context is open.
        let c = unsafe { ctx_of(q.qpx.qp_base.context) };
        let mut a = *lock(&q.attr);
        let s = q.raw.state(&c.raw).as_raw();
        a.qp_state = s;
        a.cur_qp_state = s;
        a.cap = sys::ibv_qp_cap {
            max_send_wr: q.caps.max_send_wr,
            max_recv_wr: q.caps.max_recv_wr,
            max_send_sge: q.caps.max_send_sge,
            max_recv_sge: q.caps.max_recv_sge,
            max_inline_data: q.caps.max_inline_data,
        };
        let b = &q.qpx.qp_base;
        // SAFETY: both out-parameters are writable (the C contract).
        unsafe {
            *attr = a;
            *init = sys::ibv_qp_init_attr {
                qp_context: b.qp_context,
                send_cq: b.send_cq,
                recv_cq: b.recv_cq,
                srq: std::ptr::null_mut(),
                cap: a.cap,
                qp_type: b.qp_type,
                sq_sig_all: c_int::from(q.sig_all),
            };
        }
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut sys::ibv_qp) -> c_int {
    guard(libc::EIO, || {
        if qp.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: `qp` is a live QP of this library (the C contract), freed once here.
        let q = unsafe { Box::from_raw(qp.cast::<Qp>()) };
        // SAFETY: its context is open.
        let c = unsafe { ctx_of(q.qpx.qp_base.context) };
        lock(&c.qps).remove(&q.qpx.qp_base.qp_num);
        q.raw.destroy(&c.raw);
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_get_async_event(
    ctx: *mut sys::ibv_context,
    out: *mut sys::ibv_async_event,
) -> c_int {
    guard(-1, || {
        if out.is_null() {
            return minus_one(Err(libc::EINVAL));
        }
        // SAFETY: `ctx` is open (the C contract).
        let c = unsafe { ctx_of(ctx) };
        // SAFETY: as above.
        let nonblock = nonblocking(unsafe { (*ctx).async_fd });
        loop {
            let wait = if nonblock {
                Duration::ZERO
            } else {
                Duration::from_secs(1)
            };
            let Some(ev) = c.events.next(wait) else {
                if nonblock {
                    return minus_one(Err(libc::EAGAIN));
                }
                continue;
            };
            // SAFETY: `ibv_async_event` is a union of pointers and an int, then an int.
            let mut e: sys::ibv_async_event = unsafe { std::mem::zeroed() };
            e.event_type = ev.kind.as_raw();
            match ev.element {
                EventElement::Qp(n) => match lock(&c.qps).get(&n) {
                    Some(&p) => e.element.qp = p as *mut sys::ibv_qp,
                    None => continue, // destroyed since
                },
                EventElement::Cq(id) => match lock(&c.cqs).get(&id) {
                    Some(&p) => e.element.cq = p as *mut sys::ibv_cq,
                    None => continue,
                },
                EventElement::Port(p) => e.element.port_num = c_int::from(p),
                _ => {}
            }
            // SAFETY: `out` is writable (the C contract).
            unsafe { *out = e };
            return 0;
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_ack_async_event(_ev: *mut sys::ibv_async_event) {}
