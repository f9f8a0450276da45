//! The verbs provider: kernel RDMA devices (erdma, mlx5, rxe, …) through libibverbs.
//!
//! Owns the raw `ibv_*` objects and the conversions between them and the SDK's values. It calls
//! libibverbs through `erdma-sys`'s run-time loaded function table, so a program built with the
//! SDK runs on machines without rdma-core (and says which library is missing when a kernel device
//! is asked for). No policy lives here: limits are checked before these functions run.
//!
//! Every `ibv_*` object here is used through the thread-safe verbs API; the raw pointers are
//! owned by one SDK handle each and freed exactly once, by the `destroy`/`dealloc`/`deregister`
//! method its owner calls from `Drop`.

use std::ptr;

use erdma_sys as sys;

use crate::cq::RawWc;
use crate::device::{
    AtomicCap, DeviceAttr, DeviceInfo, Gid, GidEntry, GidType, LinkLayer, Mtu, PortAttr,
    PortCounters, PortState, ProviderKind, Transport,
};
use crate::error::{Error, Result};
use crate::mr::Access;
use crate::qp::{ModifyAttr, QpCaps, QpState};
use crate::wr::{Batch, RecvReq, SendReq};

use super::PostResult;
use super::verbs_events::{self, CqFault};
use crate::event::EventQueue;

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
/// `IBV_QPT_RC`.
const IBV_QPT_RC: u32 = 2;
/// `IBV_TRANSPORT_IWARP`.
const IBV_TRANSPORT_IWARP: i32 = 1;

fn lib() -> Result<&'static sys::IbVerbs> {
    sys::ibverbs().map_err(|e| Error::Library {
        library: "libibverbs.so.1",
        detail: e.to_string(),
    })
}

fn cstr(bytes: &[std::os::raw::c_char]) -> String {
    let bytes: Vec<u8> = bytes
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Lists the kernel devices.
pub(crate) fn list_devices() -> Result<Vec<DeviceInfo>> {
    let lib = lib()?;
    let mut n: std::os::raw::c_int = 0;
    // SAFETY: `n` is a valid out-parameter; the returned array is freed below.
    let list = unsafe { (lib.ibv_get_device_list)(&mut n) };
    if list.is_null() {
        return no_list();
    }
    let mut out = Vec::with_capacity(n.max(0) as usize);
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers until it is freed.
        let dev = unsafe { *list.add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: `dev` is a valid device of the live list.
        let (name, transport, guid) = unsafe {
            (
                cstr(&(*dev).name),
                (*dev).transport_type,
                u64::from_be((lib.ibv_get_device_guid)(dev)),
            )
        };
        out.push(DeviceInfo {
            name,
            provider: ProviderKind::Verbs,
            transport: transport_of(transport),
            node_guid: guid,
        });
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { (lib.ibv_free_device_list)(list) };
    Ok(out)
}

/// `ibv_get_device_list` returned NULL: a kernel without RDMA support (ENOSYS) simply has no
/// devices; anything else is an error.
fn no_list() -> Result<Vec<DeviceInfo>> {
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENOSYS) | Some(libc::ENODEV) | Some(libc::ENOENT) | Some(0) | None => {
            Ok(Vec::new())
        }
        _ => Err(Error::Verb {
            verb: "ibv_get_device_list",
            source: e,
        }),
    }
}

fn transport_of(raw: i32) -> Transport {
    match raw {
        0 => Transport::Ib,
        IBV_TRANSPORT_IWARP => Transport::Iwarp,
        n => Transport::Unknown(n as u32),
    }
}

/// An open kernel device.
pub(crate) struct VerbsCtx {
    lib: &'static sys::IbVerbs,
    ctx: *mut sys::ibv_context,
    ibdev_path: String,
    /// `None`: this handle opened the context and closes it. `Some`: another owner (rdma_cm)
    /// opened it; the anchor keeps that owner alive, and the context open, while this lives.
    anchor: Option<std::sync::Arc<dyn std::any::Any + Send + Sync>>,
    /// The SDK context's event queue, once the hub reads this context's events.
    events: Option<std::sync::Arc<EventQueue>>,
}

// SAFETY: an ibv_context may be used from any thread; libibverbs serialises what needs it.
unsafe impl Send for VerbsCtx {}
// SAFETY: as above: every verb taking the context is thread-safe.
unsafe impl Sync for VerbsCtx {}

impl Drop for VerbsCtx {
    fn drop(&mut self) {
        // The hub stops reading this context before it can be closed.
        if let Some(q) = &self.events {
            verbs_events::unwatch(self.ctx, q);
        }
        if self.anchor.is_some() {
            // Not ours to close: the anchor, dropped after this, releases the owner.
            return;
        }
        // Every child object holds the context handle alive: no PD, CQ, MR or QP of it remains.
        // SAFETY: the context was opened once, is closed once, and has no children left.
        unsafe { (self.lib.ibv_close_device)(self.ctx) };
    }
}

impl VerbsCtx {
    /// Opens the device called `name`.
    pub(crate) fn open(name: &str) -> Result<VerbsCtx> {
        let lib = lib()?;
        let mut n: std::os::raw::c_int = 0;
        // SAFETY: as in `list_devices`.
        let list = unsafe { (lib.ibv_get_device_list)(&mut n) };
        if list.is_null() {
            no_list()?;
            return Err(Error::DeviceNotFound {
                name: name.to_string(),
                available: vec!["soft:<ipv4>".to_string()],
            });
        }
        let mut found = None;
        let mut names = Vec::new();
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds `n` valid device pointers until it is freed.
            let dev = unsafe { *list.add(i) };
            if dev.is_null() {
                break;
            }
            // SAFETY: `dev` is a valid device of the live list.
            let dev_name = unsafe { cstr(&(*dev).name) };
            if dev_name == name {
                // SAFETY: as above; ibdev_path is a NUL-terminated array inside the device.
                let path = unsafe { cstr(&(*dev).ibdev_path) };
                found = Some((dev, path));
            }
            names.push(dev_name);
        }
        let result = match found {
            None => Err(Error::DeviceNotFound {
                name: name.to_string(),
                available: names
                    .into_iter()
                    .chain(std::iter::once("soft:<ipv4>".to_string()))
                    .collect(),
            }),
            Some((dev, ibdev_path)) => {
                // SAFETY: `dev` belongs to the live list; the context outlives the list.
                let ctx = unsafe { (lib.ibv_open_device)(dev) };
                if ctx.is_null() {
                    Err(Error::last_os("ibv_open_device"))
                } else {
                    Ok(VerbsCtx {
                        lib,
                        ctx,
                        ibdev_path,
                        anchor: None,
                        events: None,
                    })
                }
            }
        };
        // SAFETY: freed once; an opened context does not depend on the list.
        unsafe { (lib.ibv_free_device_list)(list) };
        result
    }

    /// Wraps a context another library opened (rdma_cm's `id->verbs`), with its device name.
    ///
    /// # Safety
    /// `ctx` must be an open `ibv_context` that stays open for as long as `anchor` lives.
    pub(crate) unsafe fn borrowed(
        ctx: *mut sys::ibv_context,
        anchor: std::sync::Arc<dyn std::any::Any + Send + Sync>,
    ) -> Result<(VerbsCtx, String)> {
        let lib = lib()?;
        // SAFETY: the caller guarantees `ctx` is open; its device outlives it.
        let (name, ibdev_path) = unsafe {
            let dev = (*ctx).device;
            (cstr(&(*dev).name), cstr(&(*dev).ibdev_path))
        };
        Ok((
            VerbsCtx {
                lib,
                ctx,
                ibdev_path,
                anchor: Some(anchor),
                events: None,
            },
            name,
        ))
    }

    /// Starts delivering the device's asynchronous events to `queue` (and the failures they
    /// report to the completion queues created from now on).
    pub(crate) fn watch_events(&mut self, queue: &std::sync::Arc<EventQueue>) -> Result<()> {
        // SAFETY: `ctx` is open, and `Drop` unwatches it before closing it.
        unsafe { verbs_events::watch(self.lib, self.ctx, queue)? };
        self.events = Some(queue.clone());
        Ok(())
    }

    /// The kernel driver behind the device (`erdma`, `mlx5_core`, `rdma_rxe`, …), from sysfs.
    pub(crate) fn driver(&self) -> Option<String> {
        let link = std::fs::read_link(format!("{}/device/driver", self.ibdev_path)).ok()?;
        Some(link.file_name()?.to_string_lossy().into_owned())
    }

    pub(crate) fn transport(&self) -> Transport {
        // SAFETY: `ctx` is open; its device pointer is valid for the context's life.
        transport_of(unsafe { (*(*self.ctx).device).transport_type })
    }

    pub(crate) fn query_device(&self) -> Result<DeviceAttr> {
        // SAFETY: a zeroed ibv_device_attr is a valid out-parameter.
        let mut a: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open and `a` is a valid out-parameter.
        let rc = unsafe { (self.lib.ibv_query_device)(self.ctx, &mut a) };
        if rc != 0 {
            return Err(Error::errno("ibv_query_device", rc));
        }
        Ok(DeviceAttr {
            fw_ver: cstr(&a.fw_ver),
            node_guid: u64::from_be(a.node_guid),
            sys_image_guid: u64::from_be(a.sys_image_guid),
            max_mr_size: a.max_mr_size,
            page_size_cap: a.page_size_cap,
            vendor_id: a.vendor_id,
            vendor_part_id: a.vendor_part_id,
            hw_ver: a.hw_ver,
            max_qp: a.max_qp.max(0) as u32,
            max_qp_wr: a.max_qp_wr.max(0) as u32,
            device_cap_flags: a.device_cap_flags as u64,
            max_sge: a.max_sge.max(0) as u32,
            max_sge_rd: a.max_sge_rd.max(0) as u32,
            max_cq: a.max_cq.max(0) as u32,
            max_cqe: a.max_cqe.max(0) as u32,
            max_mr: a.max_mr.max(0) as u32,
            max_pd: a.max_pd.max(0) as u32,
            max_qp_rd_atom: a.max_qp_rd_atom.max(0) as u32,
            max_qp_init_rd_atom: a.max_qp_init_rd_atom.max(0) as u32,
            atomic_cap: match a.atomic_cap as u32 {
                1 => AtomicCap::Hca,
                2 => AtomicCap::Global,
                _ => AtomicCap::None,
            },
            max_srq: a.max_srq.max(0) as u32,
            max_mw: a.max_mw.max(0) as u32,
            max_ah: a.max_ah.max(0) as u32,
            phys_port_cnt: a.phys_port_cnt,
        })
    }

    pub(crate) fn query_port(&self, port: u8) -> Result<PortAttr> {
        // SAFETY: a zeroed ibv_port_attr is a valid out-parameter.
        let mut p: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open and `p` is a valid out-parameter of the full current size.
        let rc = unsafe { sys::ibv_query_port(self.lib, self.ctx, port, &mut p) };
        if rc != 0 {
            return Err(Error::errno("ibv_query_port", rc));
        }
        Ok(PortAttr {
            state: PortState::from_raw(p.state as u32),
            max_mtu: Mtu::from_enum(p.max_mtu as u32).unwrap_or(Mtu::Mtu1024),
            active_mtu: Mtu::from_enum(p.active_mtu as u32).unwrap_or(Mtu::Mtu1024),
            gid_tbl_len: p.gid_tbl_len.max(0) as u32,
            port_cap_flags: p.port_cap_flags,
            max_msg_sz: p.max_msg_sz,
            lid: p.lid,
            link_layer: LinkLayer::from_raw(p.link_layer),
            active_width: p.active_width,
            active_speed: p.active_speed as u32,
        })
    }

    pub(crate) fn gid_table(&self, port: u8, len: u32) -> Result<Vec<GidEntry>> {
        let mut out = Vec::new();
        for index in 0..len.min(256) {
            // SAFETY: a zeroed ibv_gid is a valid out-parameter.
            let mut gid: sys::ibv_gid = unsafe { std::mem::zeroed() };
            // SAFETY: `ctx` is open, `gid` a valid out-parameter.
            let rc = unsafe { (self.lib.ibv_query_gid)(self.ctx, port, index as i32, &mut gid) };
            if rc != 0 {
                continue;
            }
            // SAFETY: every bit pattern of the union is a valid byte array.
            let raw = Gid(unsafe { gid.raw });
            if raw.is_zero() {
                continue;
            }
            out.push(GidEntry {
                index: index as u8,
                gid: raw,
                gid_type: self.gid_type(port, index),
            });
        }
        Ok(out)
    }

    /// The port's counters, from sysfs: the driver's `hw_counters` (rxe, erdma, mlx5: packets,
    /// retries, RNR and sequence errors) and the port's `counters` (the IB performance
    /// counters, where the driver serves them).
    pub(crate) fn port_counters(&self, port: u8) -> Result<PortCounters> {
        let dir = format!("{}/ports/{port}", self.ibdev_path);
        if !std::path::Path::new(&dir).is_dir() {
            return Err(Error::Verb {
                verb: "port counters",
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("{dir} does not exist (no sysfs, or no such port)"),
                ),
            });
        }
        Ok(read_counter_dirs(&[
            format!("{dir}/hw_counters"),
            format!("{dir}/counters"),
        ]))
    }

    /// A GID's type, from sysfs (`ports/N/gid_attrs/types/I`), which every kernel that has GID
    /// types provides.
    fn gid_type(&self, port: u8, index: u32) -> GidType {
        let path = format!("{}/ports/{port}/gid_attrs/types/{index}", self.ibdev_path);
        // An iWARP port's GID is its MAC address, whatever sysfs calls the type (the core
        // lists it as "IB/RoCE v1").
        if self.transport() == Transport::Iwarp {
            return GidType::Iwarp;
        }
        match std::fs::read_to_string(path) {
            Ok(s) if s.trim() == "RoCE v2" => GidType::RoceV2,
            _ => GidType::IbRoceV1,
        }
    }

    pub(crate) fn alloc_pd(&self) -> Result<VerbsPd> {
        // SAFETY: `ctx` is open.
        let pd = unsafe { (self.lib.ibv_alloc_pd)(self.ctx) };
        if pd.is_null() {
            return Err(Error::last_os("ibv_alloc_pd"));
        }
        Ok(VerbsPd { pd })
    }

    pub(crate) fn create_cq(&self, depth: u32, id: u64) -> Result<(VerbsCq, u32)> {
        let depth = i32::try_from(depth).map_err(|_| Error::invalid("CQ depth too large"))?;
        // Every CQ gets its own completion channel, so any CQ can be waited on through its fd.
        // SAFETY: `ctx` is open.
        let channel = unsafe { (self.lib.ibv_create_comp_channel)(self.ctx) };
        if channel.is_null() {
            return Err(Error::last_os("ibv_create_comp_channel"));
        }
        // Everything that can fail once the channel exists; on failure the channel goes.
        let made = (|| {
            // SAFETY: the channel was just created; its fd is a valid descriptor we only flag.
            let fd = unsafe { (*channel).fd };
            // SAFETY: fcntl on a valid descriptor.
            let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
            // SAFETY: as above; non-blocking reads let a waiter drain every event.
            if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0
            {
                return Err(Error::last_os("fcntl(O_NONBLOCK) on a completion channel"));
            }
            let (fault, epoll) = wait_set(fd)?;
            let create_cq = self.lib.ibv_create_cq;
            // SAFETY: `ctx` and `channel` are live; vector 0 always exists.
            let cq = unsafe { create_cq(self.ctx, depth, ptr::null_mut(), channel, 0) };
            if cq.is_null() {
                return Err(Error::last_os("ibv_create_cq"));
            }
            Ok((cq, fault, epoll))
        })();
        let (cq, fault, epoll) = match made {
            Ok(parts) => parts,
            Err(e) => {
                // SAFETY: destroys the channel created above, once.
                unsafe { (self.lib.ibv_destroy_comp_channel)(channel) };
                return Err(e);
            }
        };
        // SAFETY: `cq` was just created and is valid.
        let actual = unsafe { (*cq).cqe }.max(0) as u32;
        verbs_events::watch_cq(self.ctx, cq, id, &fault);
        Ok((
            VerbsCq {
                lib: self.lib,
                ctx: self.ctx,
                cq,
                channel,
                unacked: std::sync::Mutex::new(0),
                fault,
                epoll,
            },
            actual,
        ))
    }
}

/// A protection domain.
pub(crate) struct VerbsPd {
    pd: *mut sys::ibv_pd,
}

// SAFETY: verbs objects are thread-safe; the pointer is owned by one handle.
unsafe impl Send for VerbsPd {}
// SAFETY: as above.
unsafe impl Sync for VerbsPd {}

impl VerbsPd {
    pub(crate) fn dealloc(&self, ctx: &VerbsCtx) {
        // SAFETY: called once, by the owner's Drop, after every region and QP of the PD is gone.
        unsafe { (ctx.lib.ibv_dealloc_pd)(self.pd) };
    }

    pub(crate) fn reg_mr(
        &self,
        ctx: &VerbsCtx,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<(VerbsMr, u32, u32)> {
        // Owned buffer, exclusive borrow, or the raw path's contract.
        // SAFETY: the caller guarantees `[addr, addr+len)` stays valid while the region lives.
        let mr = unsafe { (ctx.lib.ibv_reg_mr)(self.pd, addr.cast(), len, access.bits() as i32) };
        if mr.is_null() {
            return Err(Error::last_os("ibv_reg_mr"));
        }
        // SAFETY: `mr` was just returned and is valid.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok((VerbsMr { mr }, lkey, rkey))
    }

    /// Registers a dma-buf (`fd`, bytes `[offset, offset+len)` of it) reached at `iova`.
    #[cfg(feature = "gpu")]
    pub(crate) fn reg_dmabuf_mr(
        &self,
        ctx: &VerbsCtx,
        offset: u64,
        len: usize,
        iova: u64,
        fd: i32,
        access: Access,
    ) -> Result<(VerbsMr, u32, u32)> {
        let reg = ctx
            .lib
            .ibv_reg_dmabuf_mr
            .ok_or_else(|| Error::Unsupported {
                feature: "ibv_reg_dmabuf_mr (libibverbs older than rdma-core v34)",
                device: ctx.ibdev_path.clone(),
            })?;
        // The kernel takes its own reference to `fd`; the caller deregisters before freeing the
        // memory behind it.
        // SAFETY: `fd` is an open dma-buf exported for `[offset, offset+len)` that outlives the MR.
        let mr = unsafe { reg(self.pd, offset, len, iova, fd, access.bits() as i32) };
        if mr.is_null() {
            return Err(Error::last_os("ibv_reg_dmabuf_mr"));
        }
        // SAFETY: `mr` was just returned and is valid.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok((VerbsMr { mr }, lkey, rkey))
    }

    pub(crate) fn create_qp(
        &self,
        ctx: &VerbsCtx,
        send_cq: &VerbsCq,
        recv_cq: &VerbsCq,
        caps: &QpCaps,
        sig_all: bool,
    ) -> Result<(VerbsQp, u32, QpCaps)> {
        // SAFETY: a zeroed ibv_qp_init_attr is a valid starting value (null pointers, 0 fields).
        let mut attr: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = send_cq.cq;
        attr.recv_cq = recv_cq.cq;
        attr.cap.max_send_wr = caps.max_send_wr;
        attr.cap.max_recv_wr = caps.max_recv_wr;
        attr.cap.max_send_sge = caps.max_send_sge;
        attr.cap.max_recv_sge = caps.max_recv_sge;
        attr.cap.max_inline_data = caps.max_inline_data;
        attr.qp_type = IBV_QPT_RC as _;
        attr.sq_sig_all = i32::from(sig_all);
        // The call writes the granted capacities back into `attr`.
        // SAFETY: the PD and CQs are live and of this context; `attr` is a valid, live value.
        let qp = unsafe { (ctx.lib.ibv_create_qp)(self.pd, &mut attr) };
        if qp.is_null() {
            return Err(Error::last_os("ibv_create_qp"));
        }
        // SAFETY: `qp` was just created.
        let qp_num = unsafe { (*qp).qp_num };
        // The kernel may grant more than asked; the SDK's rings never exceed what was asked,
        // except where the provider reports less.
        let granted = QpCaps {
            max_send_wr: attr.cap.max_send_wr.min(caps.max_send_wr).max(1),
            max_recv_wr: attr.cap.max_recv_wr.min(caps.max_recv_wr).max(1),
            max_send_sge: attr.cap.max_send_sge.min(caps.max_send_sge),
            max_recv_sge: attr.cap.max_recv_sge.min(caps.max_recv_sge),
            max_inline_data: attr.cap.max_inline_data.min(caps.max_inline_data),
        };
        Ok((VerbsQp { lib: ctx.lib, qp }, qp_num, granted))
    }
}

/// A memory region.
pub(crate) struct VerbsMr {
    mr: *mut sys::ibv_mr,
}

// SAFETY: verbs objects are thread-safe; the pointer is owned by one handle.
unsafe impl Send for VerbsMr {}
// SAFETY: as above.
unsafe impl Sync for VerbsMr {}

impl VerbsMr {
    pub(crate) fn deregister(&self, ctx: &VerbsCtx) {
        // SAFETY: called once by the owning region's Drop.
        unsafe { (ctx.lib.ibv_dereg_mr)(self.mr) };
    }
}

/// The descriptor a completion queue is waited on through: an epoll set of its completion
/// channel and of its failure's wake-up, so a waiter also wakes when the queue fails (an
/// overrun, reported as an asynchronous event, not through the channel).
fn wait_set(
    channel_fd: std::os::fd::RawFd,
) -> Result<(std::sync::Arc<CqFault>, std::os::fd::OwnedFd)> {
    use std::os::fd::FromRawFd;
    let fault = std::sync::Arc::new(
        CqFault::new().map_err(|e| Error::io("a completion queue's wake-up eventfd", e))?,
    );
    // SAFETY: plain epoll_create1 call.
    let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if raw < 0 {
        return Err(Error::last_os("epoll_create1 for a completion queue"));
    }
    // SAFETY: `raw` is a new descriptor owned by nobody else.
    let epoll = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
    for fd in [channel_fd, fault.kick_fd()] {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: fd as u64,
        };
        // SAFETY: both descriptors are open; `ev` is a valid event.
        if unsafe { libc::epoll_ctl(raw, libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
            return Err(Error::last_os("epoll_ctl for a completion queue"));
        }
    }
    Ok((fault, epoll))
}

/// A completion queue.
pub(crate) struct VerbsCq {
    lib: &'static sys::IbVerbs,
    ctx: *mut sys::ibv_context,
    cq: *mut sys::ibv_cq,
    channel: *mut sys::ibv_comp_channel,
    /// Events taken from the channel but not yet acknowledged (acknowledged in batches).
    unacked: std::sync::Mutex<u32>,
    /// Failure reported by an asynchronous event (overrun, device fatal).
    fault: std::sync::Arc<CqFault>,
    /// What waiters sleep on: the channel and the failure's wake-up ([`wait_set`]).
    epoll: std::os::fd::OwnedFd,
}

// SAFETY: ibv_poll_cq and friends are thread-safe; the pointer is owned by one handle.
unsafe impl Send for VerbsCq {}
// SAFETY: as above.
unsafe impl Sync for VerbsCq {}

impl VerbsCq {
    #[inline]
    pub(crate) fn poll(&self, out: &mut [RawWc]) -> Result<usize> {
        const N: usize = 32;
        // Not zeroed: an empty poll (most of a busy-polling loop) would pay for 1.5 KiB of
        // stores; the provider writes the entries it returns.
        let mut wcs: [std::mem::MaybeUninit<sys::ibv_wc>; N] = [std::mem::MaybeUninit::uninit(); N];
        let want = out.len().min(N) as i32;
        // SAFETY: `cq` is live; `wcs` has room for `want` entries.
        let n = unsafe { sys::ibv_poll_cq(self.cq, want, wcs.as_mut_ptr().cast()) };
        if n < 0 {
            return Err(Error::errno("ibv_poll_cq", -n));
        }
        let n = (n as usize).min(want as usize);
        if n == 0 && self.fault.take() {
            return Err(Error::Verb {
                verb: "ibv_poll_cq",
                source: std::io::Error::other(
                    "completion queue error (the device reported an overrun or a fatal error): \
                     completions were lost and the queue pairs using it are in the error state \
                     (make the CQ deeper)",
                ),
            });
        }
        // SAFETY: ibv_poll_cq initialised the first `n` entries (at most `want`).
        let done = unsafe { std::slice::from_raw_parts(wcs.as_ptr().cast::<sys::ibv_wc>(), n) };
        for (o, w) in out.iter_mut().zip(done) {
            // SAFETY: both union members are u32s; which one is meaningful is told by wc_flags.
            let imm_or_inv = unsafe { w.__bindgen_anon_1.imm_data };
            *o = RawWc {
                wr_id: w.wr_id,
                status: w.status,
                opcode: w.opcode,
                vendor_err: w.vendor_err,
                byte_len: w.byte_len,
                imm: u32::from_be(imm_or_inv),
                invalidated_rkey: imm_or_inv,
                wc_flags: w.wc_flags,
                qp_num: w.qp_num,
                src_qp: w.src_qp,
            };
        }
        Ok(n)
    }

    /// Requests an event on the channel for the next (solicited) completion.
    pub(crate) fn arm(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: `cq` is live.
        let rc = unsafe { sys::ibv_req_notify_cq(self.cq, i32::from(solicited_only)) };
        if rc != 0 {
            return Err(Error::errno("ibv_req_notify_cq", rc));
        }
        Ok(())
    }

    /// The descriptor to wait on: readable on a completion event or on the queue's failure.
    pub(crate) fn event_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.epoll.as_raw_fd()
    }

    /// Takes every pending event from the channel (so one readiness never hides another) and
    /// acknowledges them in batches, and clears the failure's wake-up. Returns how many
    /// notifications there were (the wake-up counting as one).
    pub(crate) fn consume_events(&self) -> Result<u32> {
        let kicked = u32::from(self.fault.consume_kick());
        let mut taken = 0u32;
        loop {
            let mut cq: *mut sys::ibv_cq = ptr::null_mut();
            let mut cq_ctx: *mut std::os::raw::c_void = ptr::null_mut();
            // SAFETY: the channel is live and non-blocking; both out-parameters are valid.
            let rc = unsafe { (self.lib.ibv_get_cq_event)(self.channel, &mut cq, &mut cq_ctx) };
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EAGAIN) || taken + kicked > 0 {
                    break;
                }
                return Err(Error::Verb {
                    verb: "ibv_get_cq_event",
                    source: e,
                });
            }
            taken += 1;
        }
        if taken > 0 {
            let mut unacked = self.unacked.lock().unwrap_or_else(|e| e.into_inner());
            *unacked += taken;
            if *unacked >= 64 {
                // SAFETY: acknowledges events taken from this CQ's channel.
                unsafe { (self.lib.ibv_ack_cq_events)(self.cq, *unacked) };
                *unacked = 0;
            }
        }
        Ok(taken + kicked)
    }

    pub(crate) fn destroy(&self, _ctx: &VerbsCtx) {
        verbs_events::unwatch_cq(self.ctx, self.cq);
        let unacked = *self.unacked.lock().unwrap_or_else(|e| e.into_inner());
        // Every event taken is acknowledged first, as ibv_destroy_cq requires, then the channel
        // goes.
        // SAFETY: called once by the owner's Drop, after every QP using the CQ is gone.
        unsafe {
            if unacked > 0 {
                (self.lib.ibv_ack_cq_events)(self.cq, unacked);
            }
            (self.lib.ibv_destroy_cq)(self.cq);
            (self.lib.ibv_destroy_comp_channel)(self.channel);
        }
    }
}

/// A queue pair.
pub(crate) struct VerbsQp {
    lib: &'static sys::IbVerbs,
    qp: *mut sys::ibv_qp,
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

    pub(crate) fn modify(&self, _ctx: &VerbsCtx, m: &ModifyAttr) -> Result<()> {
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
        Ok(QpState::from_raw(a.qp_state as u32))
    }

    #[inline]
    pub(crate) fn post_send(&self, _ctx: &VerbsCtx, reqs: &[SendReq<'_>]) -> PostResult {
        if reqs.is_empty() {
            return Ok(());
        }
        let mut wrs = Batch::of(reqs, send_wr);
        post_chain("ibv_post_send", &mut wrs, |head, bad| {
            // The memory the SGEs name is the caller's to guarantee.
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

    pub(crate) fn destroy(&self, _ctx: &VerbsCtx) {
        // SAFETY: called once by the owner's Drop.
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
            remote_addr: r.remote.addr,
            compare_add: r.compare_add,
            swap: r.swap,
            rkey: r.remote.rkey,
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
            remote_addr: r.remote.addr,
            rkey: r.remote.rkey,
        };
    }
    w
}

/// Counters from sysfs directories of one-number files (`hw_counters`, `counters`). A file that
/// cannot be read (some `counters/` files refuse reads on RoCE ports) or holds no number is
/// left out, and so is `lifespan` (how long `hw_counters` caches its values: a setting).
fn read_counter_dirs(dirs: &[String]) -> PortCounters {
    let mut pairs = Vec::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name == "lifespan" {
                continue;
            }
            if let Ok(v) = std::fs::read_to_string(e.path())
                && let Ok(v) = v.trim().parse::<u64>()
            {
                pairs.push((name, v));
            }
        }
    }
    PortCounters::from_pairs(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_read_from_sysfs_style_directories() {
        let root = std::env::temp_dir().join(format!("erdma-counters-{}", std::process::id()));
        let hw = root.join("hw_counters");
        let ib = root.join("counters");
        std::fs::create_dir_all(&hw).unwrap();
        std::fs::create_dir_all(&ib).unwrap();
        std::fs::write(hw.join("sent_pkts"), "42\n").unwrap();
        std::fs::write(hw.join("rcvd_pkts"), "7\n").unwrap();
        std::fs::write(hw.join("lifespan"), "10\n").unwrap();
        std::fs::write(ib.join("port_xmit_data"), "1000\n").unwrap();
        std::fs::write(ib.join("garbage"), "N/A\n").unwrap();
        let c = read_counter_dirs(&[
            hw.to_string_lossy().into_owned(),
            ib.to_string_lossy().into_owned(),
            root.join("missing").to_string_lossy().into_owned(),
        ]);
        let _ = std::fs::remove_dir_all(&root);
        assert_eq!(c.get("sent_pkts"), Some(42));
        assert_eq!(c.get("rcvd_pkts"), Some(7));
        assert_eq!(c.get("port_xmit_data"), Some(1000));
        assert_eq!(c.get("lifespan"), None, "a setting, not a counter");
        assert_eq!(c.get("garbage"), None);
        assert_eq!(c.len(), 3);
    }

    #[test]
    fn sge_layout_matches_ibv_sge() {
        assert_eq!(
            std::mem::size_of::<crate::wr::Sge>(),
            std::mem::size_of::<sys::ibv_sge>()
        );
        assert_eq!(
            std::mem::align_of::<crate::wr::Sge>(),
            std::mem::align_of::<sys::ibv_sge>()
        );
        assert_eq!(std::mem::offset_of!(sys::ibv_sge, addr), 0);
        assert_eq!(std::mem::offset_of!(sys::ibv_sge, length), 8);
        assert_eq!(std::mem::offset_of!(sys::ibv_sge, lkey), 12);
    }

    #[test]
    fn cstr_stops_at_nul() {
        let raw: [std::os::raw::c_char; 6] =
            [b'r' as _, b'x' as _, b'e' as _, b'0' as _, 0, b'z' as _];
        assert_eq!(cstr(&raw), "rxe0");
    }
}
