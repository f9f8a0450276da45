//! The drop-in libibverbs' argument validation, through its C entry points: queue pairs created
//! with arbitrary capacities and types, arbitrary `ibv_modify_qp` attributes and masks, and
//! arbitrary send and receive lists (opcodes, flags, SGE counts, keys). Never a crash; every
//! failure is one of rdma-core's errnos, and a refused list names one of its own requests.
//!
//! Memory is the one thing kept valid, as the C contract requires: every SGE lies in the
//! registered buffer (inline requests read it). Destinations are the second soft device's GID.

#![no_main]

use std::os::raw::c_int;
use std::sync::{Mutex, OnceLock};

use erdma_sys as sys;
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

// The drop-in's entry points (linked from the erdma-verbs library).
use erdma_verbs as _;
unsafe extern "C" {
    fn ibv_get_device_list(n: *mut c_int) -> *mut *mut sys::ibv_device;
    fn ibv_open_device(d: *mut sys::ibv_device) -> *mut sys::ibv_context;
    fn ibv_free_device_list(l: *mut *mut sys::ibv_device);
    fn ibv_alloc_pd(c: *mut sys::ibv_context) -> *mut sys::ibv_pd;
    fn ibv_reg_mr(pd: *mut sys::ibv_pd, a: *mut u8, l: usize, acc: c_int) -> *mut sys::ibv_mr;
    fn ibv_create_cq(
        c: *mut sys::ibv_context,
        n: c_int,
        cc: *mut u8,
        ch: *mut u8,
        v: c_int,
    ) -> *mut sys::ibv_cq;
    fn ibv_create_qp(pd: *mut sys::ibv_pd, a: *mut sys::ibv_qp_init_attr) -> *mut sys::ibv_qp;
    fn ibv_modify_qp(qp: *mut sys::ibv_qp, a: *mut sys::ibv_qp_attr, mask: c_int) -> c_int;
    fn ibv_query_qp(
        qp: *mut sys::ibv_qp,
        a: *mut sys::ibv_qp_attr,
        mask: c_int,
        i: *mut sys::ibv_qp_init_attr,
    ) -> c_int;
    fn ibv_destroy_qp(qp: *mut sys::ibv_qp) -> c_int;
}

const BUF: usize = 8192;

struct Env {
    ctx: *mut sys::ibv_context,
    _peer: *mut sys::ibv_context,
    pd: *mut sys::ibv_pd,
    cq: *mut sys::ibv_cq,
    _mr: *mut sys::ibv_mr,
    buf: *mut u8,
    lkey: u32,
}

// SAFETY: the objects are the library's, which are thread-safe; inputs run one at a time.
unsafe impl Send for Env {}
// SAFETY: as above.
unsafe impl Sync for Env {}

/// One soft device pair on addresses of this target's own, a PD, a CQ, a registered buffer
/// (kept for the process's life, as pointers so that the leak checker sees them reachable).
fn env() -> Option<&'static Env> {
    static E: OnceLock<Option<Env>> = OnceLock::new();
    E.get_or_init(|| {
        // SAFETY: set before any thread of this process reads the environment (first input).
        unsafe { std::env::set_var("ERDMA_SOFT_DEVICES", "127.0.0.93,127.0.0.94") };
        // SAFETY: the C API, used as documented; every result is checked.
        unsafe {
            let list = ibv_get_device_list(std::ptr::null_mut());
            let ctx = ibv_open_device(*list);
            let peer = ibv_open_device(*list.add(1));
            ibv_free_device_list(list);
            if ctx.is_null() || peer.is_null() {
                eprintln!("verbs_args: no soft device (address taken?)");
                return None;
            }
            let pd = ibv_alloc_pd(ctx);
            let cq = ibv_create_cq(ctx, 4096, std::ptr::null_mut(), std::ptr::null_mut(), 0);
            let buf = Box::leak(vec![0u8; BUF].into_boxed_slice()).as_mut_ptr();
            let mr = ibv_reg_mr(pd, buf, BUF, 0xf);
            assert!(!pd.is_null() && !cq.is_null() && !mr.is_null());
            Some(Env {
                ctx,
                _peer: peer,
                pd,
                cq,
                _mr: mr,
                buf,
                lkey: (*mr).lkey,
            })
        }
    })
    .as_ref()
}

fn small(u: &mut Unstructured<'_>, max: u32) -> Result<u32> {
    Ok(if u.ratio(1, 8)? {
        u.arbitrary()?
    } else {
        u.int_in_range(0..=max)?
    })
}

/// SGEs inside the buffer, with arbitrary keys now and then.
fn sges(u: &mut Unstructured<'_>, e: &Env, out: &mut [sys::ibv_sge; 8]) -> Result<()> {
    for s in out.iter_mut() {
        let off = u.int_in_range(0..=BUF - 1)?;
        let len = u.int_in_range(0..=(BUF - off) as u32)?;
        let lkey = if u.ratio(1, 8)? {
            u.arbitrary()?
        } else {
            e.lkey
        };
        *s = sys::ibv_sge {
            addr: e.buf as u64 + off as u64,
            length: len,
            lkey,
        };
    }
    Ok(())
}

fn run(u: &mut Unstructured<'_>, e: &Env) -> Result<()> {
    let cq = e.cq;
    // SAFETY: plain C struct, all-zero valid.
    let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    init.send_cq = cq;
    init.recv_cq = if u.ratio(1, 16)? {
        std::ptr::null_mut()
    } else {
        cq
    };
    init.qp_type = if u.ratio(1, 8)? { u.arbitrary()? } else { 2 };
    init.sq_sig_all = u.arbitrary::<bool>()? as c_int;
    init.cap = sys::ibv_qp_cap {
        max_send_wr: small(u, 64)?,
        max_recv_wr: small(u, 64)?,
        max_send_sge: small(u, 8)?,
        max_recv_sge: small(u, 8)?,
        max_inline_data: small(u, 128)?,
    };
    // SAFETY: the PD is live, `init` valid.
    let qp = unsafe { ibv_create_qp(e.pd, &mut init) };
    if qp.is_null() {
        let err = std::io::Error::last_os_error().raw_os_error();
        assert!(
            matches!(err, Some(libc::EINVAL | libc::EOPNOTSUPP | libc::ENOMEM)),
            "{err:?}"
        );
        return Ok(());
    }
    for _ in 0..u.int_in_range(0..=6)? {
        let mut raw = [0u8; std::mem::size_of::<sys::ibv_qp_attr>()];
        u.fill_buffer(&mut raw)?;
        // SAFETY: `ibv_qp_attr` is integers and byte arrays: any bytes are a value.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::transmute(raw) };
        if u.ratio(3, 4)? {
            a.qp_state = u.int_in_range(0..=6)?;
            a.port_num = 1;
            a.path_mtu = u.int_in_range(1..=5)?;
            a.pkey_index = 0;
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.sgid_index = 1;
        }
        // The destination is always the second device (no datagrams to arbitrary hosts).
        a.ah_attr.grh.dgid.raw = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 94];
        let mask: c_int = if u.ratio(1, 4)? {
            u.arbitrary()?
        } else {
            u.int_in_range(0..=0x1f_ffff)?
        };
        // SAFETY: live QP, valid attributes.
        let r = unsafe { ibv_modify_qp(qp, &mut a, mask) };
        assert!(r == 0 || r == libc::EINVAL, "modify_qp returned {r}");
        if r == 0 && mask & 1 != 0 {
            // SAFETY: live QP.
            assert_eq!(unsafe { (*qp).state }, a.qp_state);
        }
    }
    // Posts, through the ops table as the header's inlines do.
    // SAFETY: live context.
    let ops = unsafe { (*e.ctx).ops };
    let mut lists = [[sys::ibv_sge {
        addr: 0,
        length: 0,
        lkey: 0,
    }; 8]; 4];
    for _ in 0..u.int_in_range(0..=4)? {
        // SAFETY: plain C structs, all-zero valid.
        let mut wrs: [sys::ibv_send_wr; 4] = unsafe { std::mem::zeroed() };
        let n = u.int_in_range(1..=4)?;
        for i in 0..n {
            sges(u, e, &mut lists[i])?;
            let w = &mut wrs[i];
            w.wr_id = i as u64;
            w.sg_list = lists[i].as_mut_ptr();
            w.num_sge = u.int_in_range(-1..=8)?;
            w.opcode = if u.ratio(1, 8)? {
                u.arbitrary()?
            } else {
                u.int_in_range(0..=9)?
            };
            w.send_flags = if u.ratio(1, 8)? {
                u.arbitrary()?
            } else {
                u.int_in_range(0..=15)?
            };
            w.wr.rdma.remote_addr = u.arbitrary()?;
            w.wr.rdma.rkey = u.arbitrary()?;
        }
        for i in 0..n - 1 {
            let next = &mut wrs[i + 1] as *mut sys::ibv_send_wr;
            wrs[i].next = next;
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live QP; every SGE names buffer bytes.
        let r = unsafe { (ops.post_send.unwrap())(qp, wrs.as_mut_ptr(), &mut bad) };
        assert!(
            matches!(r, 0 | libc::EINVAL | libc::ENOMEM),
            "post_send returned {r}"
        );
        if r != 0 {
            assert!(
                wrs[..n].iter().any(|w| std::ptr::eq(w, bad)),
                "bad_wr is one of the list's"
            );
        }
        // SAFETY: plain C struct, all-zero valid.
        let mut rw: sys::ibv_recv_wr = unsafe { std::mem::zeroed() };
        rw.sg_list = lists[0].as_mut_ptr();
        rw.num_sge = u.int_in_range(-1..=8)?;
        let mut rbad = std::ptr::null_mut();
        // SAFETY: as above.
        let r = unsafe { (ops.post_recv.unwrap())(qp, &mut rw, &mut rbad) };
        assert!(
            matches!(r, 0 | libc::EINVAL | libc::ENOMEM),
            "post_recv returned {r}"
        );
    }
    // SAFETY: plain C structs, all-zero valid; live QP.
    unsafe {
        let mut a: sys::ibv_qp_attr = std::mem::zeroed();
        let mut i: sys::ibv_qp_init_attr = std::mem::zeroed();
        assert_eq!(ibv_query_qp(qp, &mut a, 0, &mut i), 0);
        assert_eq!(ibv_destroy_qp(qp), 0);
        let mut wc: [sys::ibv_wc; 64] = std::mem::zeroed();
        while (ops.poll_cq.unwrap())(cq, 64, wc.as_mut_ptr()) > 0 {}
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    static ONE: Mutex<()> = Mutex::new(());
    let Some(e) = env() else { return };
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let _ = run(&mut Unstructured::new(data), e);
});
