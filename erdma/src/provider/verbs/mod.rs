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

#![allow(unsafe_code)] // libibverbs through FFI

mod cq;
mod events;
mod pd;
mod qp;

pub(crate) use cq::VerbsCq;
use cq::wait_set;
pub(crate) use pd::{VerbsMr, VerbsPd};
pub(crate) use qp::VerbsQp;

use std::ptr;

use erdma_sys as sys;

use crate::error::{Error, Result};
use crate::vocab::{
    AtomicCap, DeviceAttr, DeviceInfo, Gid, GidEntry, GidType, LinkLayer, Mtu, PortAttr,
    PortCounters, PortState, ProviderKind, Transport,
};

use crate::event::EventQueue;

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

/// Runs `f` over the kernel's device list (`None` when libibverbs could list nothing), then
/// frees the list. The devices are valid only inside `f`.
fn with_devices<R>(
    lib: &'static sys::IbVerbs,
    f: impl FnOnce(Option<&[*mut sys::ibv_device]>) -> R,
) -> R {
    let mut n: std::os::raw::c_int = 0;
    // SAFETY: `n` is a valid out-parameter; the returned array is freed below.
    let list = unsafe { (lib.ibv_get_device_list)(&mut n) };
    if list.is_null() {
        return f(None);
    }
    // The array holds `n` device pointers (NULL-terminated after them) until it is freed.
    // SAFETY: `list` points at `n` initialised pointers, alive until `ibv_free_device_list`.
    let devs = unsafe { std::slice::from_raw_parts(list, n.max(0) as usize) };
    let len = devs.iter().position(|d| d.is_null()).unwrap_or(devs.len());
    let out = f(Some(&devs[..len]));
    // SAFETY: `list` came from ibv_get_device_list and is freed once, after its last use.
    unsafe { (lib.ibv_free_device_list)(list) };
    out
}

/// Lists the kernel devices.
pub(crate) fn list_devices() -> Result<Vec<DeviceInfo>> {
    let lib = lib()?;
    with_devices(lib, |devs| {
        let Some(devs) = devs else {
            return no_list();
        };
        Ok(devs
            .iter()
            .map(|&dev| {
                // SAFETY: `dev` is a valid device of the live list.
                let (name, transport, guid) = unsafe {
                    (
                        cstr(&(*dev).name),
                        (*dev).transport_type,
                        u64::from_be((lib.ibv_get_device_guid)(dev)),
                    )
                };
                DeviceInfo {
                    name,
                    provider: ProviderKind::Verbs,
                    transport: transport_of(transport),
                    node_guid: guid,
                }
            })
            .collect())
    })
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
            events::unwatch(self.ctx, q);
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
        with_devices(lib, |devs| {
            let Some(devs) = devs else {
                no_list()?;
                return Err(Error::DeviceNotFound {
                    name: name.to_string(),
                    available: vec!["soft:<ipv4>".to_string()],
                });
            };
            // SAFETY: every pointer is a valid device of the live list.
            let names: Vec<String> = devs.iter().map(|&d| unsafe { cstr(&(*d).name) }).collect();
            let Some(i) = names.iter().position(|n| n == name) else {
                return Err(Error::DeviceNotFound {
                    name: name.to_string(),
                    available: names
                        .into_iter()
                        .chain(std::iter::once("soft:<ipv4>".to_string()))
                        .collect(),
                });
            };
            let dev = devs[i];
            // SAFETY: `dev` is a valid device; ibdev_path is a NUL-terminated array inside it.
            let ibdev_path = unsafe { cstr(&(*dev).ibdev_path) };
            // SAFETY: `dev` belongs to the live list; the context outlives the list.
            let ctx = unsafe { (lib.ibv_open_device)(dev) };
            if ctx.is_null() {
                return Err(Error::last_os("ibv_open_device"));
            }
            Ok(VerbsCtx {
                lib,
                ctx,
                ibdev_path,
                anchor: None,
                events: None,
            })
        })
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
        unsafe { events::watch(self.lib, self.ctx, queue)? };
        self.events = Some(queue.clone());
        Ok(())
    }

    /// The device's name (`rxe0`, `erdma_0`): the last part of its sysfs path.
    #[cfg(feature = "gpu")]
    pub(crate) fn name(&self) -> &str {
        self.ibdev_path
            .rsplit('/')
            .next()
            .unwrap_or(&self.ibdev_path)
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
        events::watch_cq(self.ctx, cq, id, &fault);
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
            std::mem::size_of::<crate::vocab::Sge>(),
            std::mem::size_of::<sys::ibv_sge>()
        );
        assert_eq!(
            std::mem::align_of::<crate::vocab::Sge>(),
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
