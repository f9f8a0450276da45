//! The ported inlines against fake contexts, QPs and CQs whose operation tables point at the
//! test functions below: no library and no device are involved.

use std::cell::Cell;
use std::ptr::NonNull;

use super::*;
use crate::load::Symbol;

/// A heap `verbs_context` handed out only as raw pointers, like the one libibverbs builds.
struct FakeCtx(*mut verbs_context);

impl FakeCtx {
    fn new(extended: bool) -> FakeCtx {
        let mut v = Box::<verbs_context>::default();
        v.sz = size_of::<verbs_context>();
        v.context.abi_compat = if extended {
            ptr::without_provenance_mut(VERBS_ABI_IS_EXTENDED)
        } else {
            ptr::null_mut()
        };
        FakeCtx(Box::into_raw(v))
    }

    /// The embedded `ibv_context`, derived from the whole allocation as libibverbs does.
    fn ctx(&self) -> *mut ibv_context {
        // SAFETY: `self.0` is a live box; only a field address is computed.
        unsafe { &raw mut (*self.0).context }
    }

    fn vctx(&mut self) -> &mut verbs_context {
        // SAFETY: `self.0` is a live box owned by `self`, borrowed mutably through it.
        unsafe { &mut *self.0 }
    }
}

impl Drop for FakeCtx {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from `Box::into_raw` and is freed once.
        drop(unsafe { Box::from_raw(self.0) });
    }
}

thread_local! {
    /// What the last fake registration call received: (which, iova, access, length).
    static LAST_REG: Cell<(&'static str, u64, u32, usize)> = const { Cell::new(("", 0, 0, 0)) };
}

unsafe extern "C" fn never_called() {
    std::process::abort();
}

unsafe extern "C" fn fake_post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: the test passes a live WR.
    let wr = unsafe { &*wr };
    // SAFETY: the test passes a live QP.
    let qp = unsafe { &*qp };
    // SAFETY: the test passes a writable out-pointer.
    unsafe { bad.write(wr.next) };
    wr.wr_id as c_int + qp.qp_num as c_int
}

unsafe extern "C" fn fake_post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: the test passes a writable out-pointer.
    unsafe { bad.write(wr) };
    // SAFETY: the test passes a live WR.
    let wr = unsafe { &*wr };
    // SAFETY: the test passes a live QP.
    let qp = unsafe { &*qp };
    -(wr.num_sge + qp.qp_num as c_int)
}

unsafe extern "C" fn fake_poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    let filled = n - 1;
    // SAFETY: the test passes a live CQ.
    let cqe = unsafe { (*cq).cqe };
    // SAFETY: the test passes room for `n` completions.
    let out = unsafe { std::slice::from_raw_parts_mut(wc, filled as usize) };
    for (i, w) in out.iter_mut().enumerate() {
        w.wr_id = 1000 + i as u64;
        w.status = IBV_WC_SUCCESS;
        w.opcode = IBV_WC_RECV;
        w.byte_len = cqe as u32;
    }
    filled
}

unsafe extern "C" fn fake_req_notify(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: the test passes a live CQ.
    unsafe { solicited_only * 100 + (*cq).cqe }
}

unsafe extern "C" fn fake_ext_query_port(
    _ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    len: usize,
) -> c_int {
    if len != size_of::<ibv_port_attr>() {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes a writable attribute struct of `len` bytes.
    let attr = unsafe { &mut *attr };
    attr.lid = u16::from(port) * 3;
    attr.port_cap_flags2 = 0x55;
    0
}

unsafe extern "C" fn fake_compat_query_port(
    _ctx: *mut ibv_context,
    port: u8,
    attr: *mut _compat_ibv_port_attr,
) -> c_int {
    // SAFETY: the inline passes the start of a full, zeroed `ibv_port_attr`.
    unsafe { (*attr.cast::<ibv_port_attr>()).max_msg_sz = u32::from(port) + 40 };
    7
}

unsafe extern "C" fn fake_ext_query_device(
    ctx: *mut ibv_context,
    _input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
    len: usize,
) -> c_int {
    if len != size_of::<ibv_device_attr_ex>() {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes a writable attribute struct.
    unsafe { (*attr).max_dm_size = 99 };
    // SAFETY: the caller passes a live context. The fake answers what the test put into
    // `num_comp_vectors`.
    unsafe { (*ctx).num_comp_vectors }
}

unsafe extern "C" fn fake_query_device(
    _ctx: *mut ibv_context,
    attr: *mut ibv_device_attr,
) -> c_int {
    // SAFETY: the inline passes the writable `orig_attr`.
    unsafe { (*attr).max_qp = 1234 };
    0
}

unsafe extern "C" fn fake_gid_ex(
    _ctx: *mut ibv_context,
    port: u32,
    index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    if entry_size != size_of::<ibv_gid_entry>() || flags != 0 {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes a writable entry.
    let entry = unsafe { &mut *entry };
    entry.port_num = port;
    entry.gid_index = index;
    0
}

unsafe extern "C" fn fake_gid_table(
    _ctx: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max: usize,
    _flags: u32,
    entry_size: usize,
) -> isize {
    if entry_size != size_of::<ibv_gid_entry>() {
        return -(libc::EINVAL as isize);
    }
    // SAFETY: the caller passes room for `max` entries.
    let out = unsafe { std::slice::from_raw_parts_mut(entries, max - 1) };
    for (i, e) in out.iter_mut().enumerate() {
        e.gid_index = i as u32 + 10;
    }
    (max - 1) as isize
}

unsafe extern "C" fn fake_reg_mr(
    _pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> *mut ibv_mr {
    LAST_REG.set(("reg_mr", addr as u64, access as u32, len));
    addr.cast()
}

unsafe extern "C" fn fake_reg_mr_iova(
    _pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    LAST_REG.set(("reg_mr_iova", iova, access as u32, len));
    addr.cast()
}

unsafe extern "C" fn fake_reg_mr_iova2(
    _pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    LAST_REG.set(("reg_mr_iova2", iova, access, len));
    addr.cast()
}

/// A table whose functions are the fakes above; `absent` names optional ones left out.
fn fake_lib(absent: &'static [&'static str]) -> IbVerbs {
    let lookup = |s: &Symbol| {
        let name = s.name_str();
        if absent.contains(&name) {
            return Err(format!("{name} absent"));
        }
        let f: *mut c_void = match name {
            "ibv_query_port" => fake_compat_query_port as *mut c_void,
            "ibv_query_device" => fake_query_device as *mut c_void,
            "_ibv_query_gid_ex" => fake_gid_ex as *mut c_void,
            "_ibv_query_gid_table" => fake_gid_table as *mut c_void,
            "ibv_reg_mr" => fake_reg_mr as *mut c_void,
            "ibv_reg_mr_iova" => fake_reg_mr_iova as *mut c_void,
            "ibv_reg_mr_iova2" => fake_reg_mr_iova2 as *mut c_void,
            _ => never_called as *mut c_void,
        };
        NonNull::new(f).ok_or_else(String::new)
    };
    // SAFETY: each named fake has the signature of the field it fills; `never_called` fills
    // fields these tests never call.
    unsafe { IbVerbs::resolve_with("fake", lookup) }.expect("all required symbols present")
}

fn fake_qp(ctx: &FakeCtx, qp_num: u32) -> Box<ibv_qp> {
    let mut qp = Box::<ibv_qp>::default();
    qp.context = ctx.ctx();
    qp.qp_num = qp_num;
    qp
}

fn fake_cq(ctx: &FakeCtx, cqe: c_int) -> Box<ibv_cq> {
    let mut cq = Box::<ibv_cq>::default();
    cq.context = ctx.ctx();
    cq.cqe = cqe;
    cq
}

#[test]
fn post_send_dispatches_through_ops() {
    let mut ctx = FakeCtx::new(true);
    ctx.vctx().context.ops.post_send = Some(fake_post_send);
    let mut qp = fake_qp(&ctx, 7);
    let mut second = ibv_send_wr {
        wr_id: 2,
        ..Default::default()
    };
    let mut first = ibv_send_wr {
        wr_id: 40,
        next: &mut second,
        ..Default::default()
    };
    let mut bad: *mut ibv_send_wr = ptr::null_mut();
    // SAFETY: live fake QP and context; a two-element chain; `bad` is writable.
    let rc = unsafe { ibv_post_send(&mut *qp, &mut first, &mut bad) };
    assert_eq!(rc, 47, "wr_id of the head plus the QP number");
    assert_eq!(
        bad, &raw mut second,
        "the fake reports the second WR as bad"
    );
}

#[test]
fn post_recv_dispatches_through_ops() {
    let mut ctx = FakeCtx::new(false);
    ctx.vctx().context.ops.post_recv = Some(fake_post_recv);
    let mut qp = fake_qp(&ctx, 3);
    let mut wr = ibv_recv_wr {
        num_sge: 1,
        ..Default::default()
    };
    let mut bad: *mut ibv_recv_wr = ptr::null_mut();
    // SAFETY: live fake QP and context; one WR; `bad` is writable.
    let rc = unsafe { ibv_post_recv(&mut *qp, &mut wr, &mut bad) };
    assert_eq!(
        rc, -4,
        "a negative provider code is passed through unchanged"
    );
    assert_eq!(bad, &raw mut wr);
}

#[test]
fn missing_post_entries_answer_eopnotsupp() {
    let ctx = FakeCtx::new(true);
    let mut qp = fake_qp(&ctx, 1);
    let mut wr = ibv_send_wr::default();
    let mut bad: *mut ibv_send_wr = ptr::null_mut();
    // SAFETY: live fake QP and context (no post_send entry); `bad` is writable.
    let rc = unsafe { ibv_post_send(&mut *qp, &mut wr, &mut bad) };
    assert_eq!(rc, libc::EOPNOTSUPP);
    assert_eq!(bad, &raw mut wr);
    let mut rwr = ibv_recv_wr::default();
    let mut rbad: *mut ibv_recv_wr = ptr::null_mut();
    // SAFETY: as above.
    let rc = unsafe { ibv_post_recv(&mut *qp, &mut rwr, &mut rbad) };
    assert_eq!(rc, libc::EOPNOTSUPP);
    assert_eq!(rbad, &raw mut rwr);
    let mut cq = fake_cq(&ctx, 1);
    let mut wc = [ibv_wc::default(); 1];
    // SAFETY: live fake CQ and context without entries; room for one completion.
    let n = unsafe { ibv_poll_cq(&mut *cq, 1, wc.as_mut_ptr()) };
    assert_eq!(n, -libc::EOPNOTSUPP);
    // SAFETY: as above.
    assert_eq!(unsafe { ibv_req_notify_cq(&mut *cq, 0) }, libc::EOPNOTSUPP);
}

#[test]
fn poll_cq_dispatches_through_ops() {
    let mut ctx = FakeCtx::new(true);
    ctx.vctx().context.ops.poll_cq = Some(fake_poll_cq);
    let mut cq = fake_cq(&ctx, 64);
    let mut wc = [ibv_wc::default(); 4];
    // SAFETY: live fake CQ and context; room for 4 completions.
    let n = unsafe { ibv_poll_cq(&mut *cq, 4, wc.as_mut_ptr()) };
    assert_eq!(n, 3);
    for (i, w) in wc[..3].iter().enumerate() {
        assert_eq!(w.wr_id, 1000 + i as u64);
        assert_eq!(w.status, IBV_WC_SUCCESS);
        assert_eq!(w.opcode, IBV_WC_RECV);
        assert_eq!(w.byte_len, 64);
    }
    assert_eq!(wc[3].wr_id, 0, "entries past the count are untouched");
}

#[test]
fn req_notify_cq_dispatches_through_ops() {
    let mut ctx = FakeCtx::new(true);
    ctx.vctx().context.ops.req_notify_cq = Some(fake_req_notify);
    let mut cq = fake_cq(&ctx, 5);
    // SAFETY: live fake CQ and context.
    assert_eq!(unsafe { ibv_req_notify_cq(&mut *cq, 1) }, 105);
    // SAFETY: as above.
    assert_eq!(unsafe { ibv_req_notify_cq(&mut *cq, 0) }, 5);
}

#[test]
fn verbs_get_ctx_finds_the_container() {
    let ext = FakeCtx::new(true);
    // SAFETY: live fake context.
    assert_eq!(unsafe { verbs_get_ctx(ext.ctx()) }, ext.0);
    let legacy = FakeCtx::new(false);
    // SAFETY: live fake context.
    assert!(unsafe { verbs_get_ctx(legacy.ctx()) }.is_null());
}

#[test]
fn query_port_uses_the_extended_op_with_the_full_size() {
    let lib = fake_lib(&[]);
    let mut ctx = FakeCtx::new(true);
    ctx.vctx().query_port = Some(fake_ext_query_port);
    let mut attr = ibv_port_attr::default();
    // SAFETY: live fake context; writable attribute struct.
    let rc = unsafe { ibv_query_port(&lib, ctx.ctx(), 2, &mut attr) };
    assert_eq!(rc, 0);
    assert_eq!(attr.lid, 6);
    assert_eq!(attr.port_cap_flags2, 0x55);
}

/// The exported function fills the old layout; the inline zeroes the struct first.
fn assert_compat_path(lib: &IbVerbs, ctx: &FakeCtx) {
    // SAFETY: all-0xAB is a valid `ibv_port_attr` (plain integers).
    let mut attr: ibv_port_attr = unsafe { std::mem::transmute([0xABu8; 52]) };
    // SAFETY: live fake context; writable attribute struct.
    let rc = unsafe { ibv_query_port(lib, ctx.ctx(), 1, &mut attr) };
    assert_eq!(rc, 7);
    assert_eq!(attr.max_msg_sz, 41);
    assert_eq!(attr.port_cap_flags2, 0, "zeroed before the old-layout call");
    assert_eq!(attr.lid, 0);
}

#[test]
fn query_port_falls_back_to_the_exported_function() {
    let lib = fake_lib(&[]);
    // A context that is not extended.
    assert_compat_path(&lib, &FakeCtx::new(false));
    // An extended context without the op.
    assert_compat_path(&lib, &FakeCtx::new(true));
    // An extended context whose library struct is too small to hold the op, even though
    // the bytes where it would be are set.
    let mut ctx = FakeCtx::new(true);
    ctx.vctx().query_port = Some(fake_ext_query_port);
    ctx.vctx().sz = size_of::<verbs_context>() - offset_of!(verbs_context, query_port) - 1;
    assert_compat_path(&lib, &ctx);
}

#[test]
fn query_device_ex_extended_and_legacy_paths() {
    let lib = fake_lib(&[]);
    let mut ctx = FakeCtx::new(true);
    ctx.vctx().query_device_ex = Some(fake_ext_query_device);
    let mut attr = ibv_device_attr_ex::default();
    attr.orig_attr.max_qp = 5;

    // The extended op answers: its result stands.
    ctx.vctx().context.num_comp_vectors = 0;
    // SAFETY: live fake context; no input; writable attribute struct.
    let rc = unsafe { ibv_query_device_ex(&lib, ctx.ctx(), ptr::null(), &mut attr) };
    assert_eq!((rc, attr.max_dm_size, attr.orig_attr.max_qp), (0, 99, 5));

    // A real error is returned as is, without the legacy call.
    ctx.vctx().context.num_comp_vectors = libc::EIO;
    attr = ibv_device_attr_ex::default();
    // SAFETY: as above.
    let rc = unsafe { ibv_query_device_ex(&lib, ctx.ctx(), ptr::null(), &mut attr) };
    assert_eq!((rc, attr.orig_attr.max_qp), (libc::EIO, 0));

    // EOPNOTSUPP and ENOSYS fall back to ibv_query_device into a zeroed struct.
    for code in [libc::EOPNOTSUPP, libc::ENOSYS] {
        ctx.vctx().context.num_comp_vectors = code;
        attr = ibv_device_attr_ex::default();
        // SAFETY: as above.
        let rc = unsafe { ibv_query_device_ex(&lib, ctx.ctx(), ptr::null(), &mut attr) };
        assert_eq!((rc, attr.max_dm_size, attr.orig_attr.max_qp), (0, 0, 1234));
    }

    // A legacy context goes straight to ibv_query_device.
    let legacy = FakeCtx::new(false);
    attr = ibv_device_attr_ex::default();
    // SAFETY: as above.
    let rc = unsafe { ibv_query_device_ex(&lib, legacy.ctx(), ptr::null(), &mut attr) };
    assert_eq!((rc, attr.orig_attr.max_qp), (0, 1234));

    // Input fields are not supported.
    let input = ibv_query_device_ex_input { comp_mask: 1 };
    // SAFETY: as above, with a readable input.
    let rc = unsafe { ibv_query_device_ex(&lib, ctx.ctx(), &input, &mut attr) };
    assert_eq!(rc, libc::EINVAL);
}

#[test]
fn gid_queries_pass_the_entry_size() {
    let lib = fake_lib(&[]);
    let ctx = FakeCtx::new(true);
    let mut e = ibv_gid_entry::default();
    // SAFETY: the fake reads nothing from the context; `e` is writable.
    let rc = unsafe { ibv_query_gid_ex(&lib, ctx.ctx(), 1, 3, &mut e, 0) };
    assert_eq!((rc, e.port_num, e.gid_index), (0, 1, 3));

    let mut table = [ibv_gid_entry::default(); 4];
    // SAFETY: room for 4 entries.
    let n = unsafe { ibv_query_gid_table(&lib, ctx.ctx(), table.as_mut_ptr(), 4, 0) };
    assert_eq!(n, 3);
    assert_eq!(table[2].gid_index, 12);

    let old = fake_lib(&["_ibv_query_gid_ex", "_ibv_query_gid_table"]);
    // SAFETY: as above; nothing is called.
    let rc = unsafe { ibv_query_gid_ex(&old, ctx.ctx(), 1, 0, &mut e, 0) };
    assert_eq!(rc, libc::EOPNOTSUPP);
    // SAFETY: as above.
    let n = unsafe { ibv_query_gid_table(&old, ctx.ctx(), table.as_mut_ptr(), 4, 0) };
    assert_eq!(n, -(libc::EOPNOTSUPP as isize));
}

#[test]
fn reg_mr_picks_the_entry_by_access_flags() {
    let lib = fake_lib(&[]);
    let mut buf = [0u8; 64];
    let addr = buf.as_mut_ptr().cast::<c_void>();
    let pd = ptr::null_mut();
    let local = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
    let relaxed = ibv_access_flags::IBV_ACCESS_RELAXED_ORDERING.0;
    assert_ne!(relaxed & IBV_ACCESS_OPTIONAL_RANGE, 0);

    // SAFETY: the fakes only record their arguments.
    let mr = unsafe { ibv_reg_mr(&lib, pd, addr, 64, local) };
    assert_eq!(mr.cast::<c_void>(), addr);
    assert_eq!(LAST_REG.get(), ("reg_mr", addr as u64, local, 64));

    // SAFETY: as above.
    unsafe { ibv_reg_mr(&lib, pd, addr, 32, local | relaxed) };
    assert_eq!(
        LAST_REG.get(),
        ("reg_mr_iova2", addr as u64, local | relaxed, 32)
    );

    let old = fake_lib(&["ibv_reg_mr_iova2"]);
    // SAFETY: as above.
    unsafe { ibv_reg_mr(&old, pd, addr, 16, local | relaxed) };
    assert_eq!(
        LAST_REG.get(),
        ("reg_mr", addr as u64, local, 16),
        "optional flag dropped"
    );

    // SAFETY: as above.
    unsafe { ibv_reg_mr_iova(&lib, pd, addr, 8, 0x1000, local) };
    assert_eq!(LAST_REG.get(), ("reg_mr_iova", 0x1000, local, 8));
    // SAFETY: as above.
    unsafe { ibv_reg_mr_iova(&lib, pd, addr, 8, 0x2000, local | relaxed) };
    assert_eq!(LAST_REG.get(), ("reg_mr_iova2", 0x2000, local | relaxed, 8));

    let ancient = fake_lib(&["ibv_reg_mr_iova", "ibv_reg_mr_iova2"]);
    // SAFETY: as above; nothing is called.
    let mr = unsafe { ibv_reg_mr_iova(&ancient, pd, addr, 8, 0x2000, local) };
    assert!(mr.is_null());
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EOPNOTSUPP)
    );
}

#[test]
fn rdma_cm_addresses_point_into_the_route() {
    let mut id = Box::<rdma_cm_id>::default();
    id.route.addr.__bindgen_anon_1.src_sin.sin_family = libc::AF_INET as sa_family_t;
    id.route.addr.__bindgen_anon_2.dst_sin6.sin6_family = libc::AF_INET6 as sa_family_t;
    let idp: *mut rdma_cm_id = &mut *id;
    // SAFETY: `idp` is a live id.
    let local = unsafe { rdma_get_local_addr(idp) };
    // SAFETY: `idp` is a live id.
    let peer = unsafe { rdma_get_peer_addr(idp) };
    // SAFETY: points into the live id.
    let lf = unsafe { (*local).sa_family };
    // SAFETY: points into the live id.
    let pf = unsafe { (*peer).sa_family };
    assert_eq!(lf, libc::AF_INET as sa_family_t);
    assert_eq!(pf, libc::AF_INET6 as sa_family_t);
    assert_eq!(
        peer as usize - local as usize,
        size_of::<sockaddr_storage>()
    );
}
