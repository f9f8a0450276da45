//! The devices the plugin offers NCCL: which ones (the selection in [`crate::config`]), how each
//! is opened, what NCCL is told about it, and the per-device choices: connecting through rdma_cm
//! or the out-of-band exchange, notices by immediate data or SEND, GPU memory or host staging.
//!
//! Also the facts the doctor prints: the mode an eRDMA device runs in, its GID index, its
//! network interface.

use std::ffi::CString;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use erdma::{Context, GidEntry, Pd, ProviderKind, Transport};

use crate::config::{Choice, Config, select, soft_address};
use crate::log::{INIT, info, warn};
use crate::proto::NoticeMode;

/// How a device runs, as far as NCCL settings go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// iWARP: eRDMA's standard (default) mode, siw. Queue pairs connect through rdma_cm only;
    /// NCCL's own IB transport cannot use it.
    Iwarp,
    /// eRDMA's compat mode (RoCE-compatible, the out-of-tree driver's `compat_mode`).
    Compat,
    /// RoCE v2 (eRDMA's RoCEv2 mode, rxe, mlx5 on Ethernet).
    RoceV2,
    /// InfiniBand.
    Ib,
    /// The userspace soft device (RoCE v2 over UDP).
    Soft,
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Iwarp => "iWARP (eRDMA standard mode)",
            Mode::Compat => "compat (eRDMA RoCE-compatible mode)",
            Mode::RoceV2 => "RoCEv2",
            Mode::Ib => "InfiniBand",
            Mode::Soft => "RoCEv2 (soft device, userspace)",
        })
    }
}

/// Finds the mode of an open device.
pub fn detect_mode(ctx: &Context) -> Mode {
    if ctx.provider() == ProviderKind::Soft {
        return Mode::Soft;
    }
    if ctx.transport() == Transport::Iwarp {
        return Mode::Iwarp;
    }
    if ctx.driver().as_deref() == Some("erdma") && erdma_compat_mode() {
        return Mode::Compat;
    }
    match ctx.query_port(1) {
        Ok(p) if p.link_layer == erdma::LinkLayer::InfiniBand => Mode::Ib,
        _ => Mode::RoceV2,
    }
}

/// Whether the loaded erdma driver runs in compat mode (its `compat_mode` module parameter).
fn erdma_compat_mode() -> bool {
    std::fs::read_to_string("/sys/module/erdma/parameters/compat_mode")
        .map(|v| matches!(v.trim(), "Y" | "y" | "1"))
        .unwrap_or(false)
}

/// The GID entry RoCE traffic must use (the IPv4-mapped RoCEv2 one), where the device has one.
pub fn roce_gid(ctx: &Context) -> Option<GidEntry> {
    ctx.ipv4_gid(1).ok()
}

/// The network interface of a kernel RDMA device: the RoCE GID's netdev, the PCI function's
/// netdev, or (iWARP, whose one GID is the MAC address) the interface with that MAC address.
pub fn netdev(ctx: &Context) -> Option<String> {
    if ctx.provider() == ProviderKind::Soft {
        return None;
    }
    let base = Path::new("/sys/class/infiniband").join(ctx.name());
    if let Ok(n) = std::fs::read_to_string(base.join("ports/1/gid_attrs/ndevs/0")) {
        let n = n.trim();
        if !n.is_empty() {
            return Some(n.to_string());
        }
    }
    if let Ok(mut dir) = std::fs::read_dir(base.join("device/net")) {
        if let Some(Ok(e)) = dir.next() {
            return Some(e.file_name().to_string_lossy().into_owned());
        }
    }
    let gid = ctx.gid_table(1).ok()?.first()?.gid;
    let mac = gid.0[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":");
    std::fs::read_dir("/sys/class/net")
        .ok()?
        .flatten()
        .find_map(|e| {
            let a = std::fs::read_to_string(e.path().join("address")).ok()?;
            (a.trim() == mac).then(|| e.file_name().to_string_lossy().into_owned())
        })
}

/// The IPv4 address of a network interface (the first one).
pub fn netdev_ipv4(ifname: &str) -> Option<Ipv4Addr> {
    crate::sys::ipv4_addresses()
        .into_iter()
        .find(|(n, _)| n == ifname)
        .map(|(_, a)| a)
}

/// The PCI device directory of a kernel RDMA device (what NCCL's `pciPath` wants).
fn pci_path(name: &str) -> Option<PathBuf> {
    let p =
        std::fs::canonicalize(Path::new("/sys/class/infiniband").join(name).join("device")).ok()?;
    p.to_string_lossy().contains("/pci").then_some(p)
}

/// Port speed in Mbit/s from the verbs encodings (as NCCL's IB transport computes it).
pub fn port_speed_mbps(active_speed: u32, active_width: u8) -> i32 {
    let lane = match active_speed {
        1 => 2500,
        2 => 5000,
        4 | 8 => 10000,
        16 => 14000,
        32 => 25000,
        64 => 50000,
        128 => 100000,
        256 => 200000,
        _ => 10000,
    };
    let width = match active_width {
        1 => 1,
        2 => 4,
        4 => 8,
        8 => 12,
        16 => 2,
        _ => 1,
    };
    lane * width
}

/// Strings whose pointers NCCL is given (device names, PCI paths): kept for the life of the
/// process, so a pointer handed out stays valid whatever NCCL keeps.
static STRINGS: Mutex<Vec<CString>> = Mutex::new(Vec::new());

/// A pointer to a NUL-terminated copy of `s` that lives as long as the process.
pub fn lasting_str(s: &str) -> *const std::ffi::c_char {
    let mut all = STRINGS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = all.iter().find(|c| c.to_bytes() == s.as_bytes()) {
        return c.as_ptr();
    }
    let c = CString::new(s.replace('\0', " ")).unwrap_or_default();
    let p = c.as_ptr();
    // The CString's heap buffer does not move when the vector grows.
    all.push(c);
    p
}

/// An open device, with everything NCCL is told about it and the choices made for it.
pub struct Dev {
    /// NCCL's index of it.
    pub index: usize,
    /// The device context.
    pub ctx: Context,
    /// The protection domain every connection and registration of this process uses.
    pub pd: Pd,
    /// How it runs.
    pub mode: Mode,
    /// NCCL's `guid`.
    pub guid: u64,
    /// NCCL's `speed`.
    pub speed_mbps: i32,
    /// NCCL's `pciPath`, where the device has one.
    pub pci_path: Option<String>,
    /// Where receivers listen for the out-of-band exchange.
    pub oob_ip: IpAddr,
    /// Whether GPU memory is offered to NCCL, and why (or why not).
    pub gdr: (bool, String),
    /// How this device wants to be notified.
    pub notice: NoticeMode,
    /// Whether queue pairs connect through rdma_cm.
    pub use_cm: bool,
    /// Soft devices: whether NCCL's progress thread does the receive work.
    pub inline_progress: bool,
    /// The most bytes one work request moves.
    pub max_wr_bytes: u64,
}

impl std::fmt::Debug for Dev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dev")
            .field("index", &self.index)
            .field("name", &self.ctx.name())
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl Dev {
    /// The device's name.
    pub fn name(&self) -> &str {
        self.ctx.name()
    }

    /// Whether this is a soft device.
    pub fn is_soft(&self) -> bool {
        self.ctx.provider() == ProviderKind::Soft
    }
}

/// Opens the devices the configuration selects.
///
/// # Errors
/// A message when the selection is empty or a device cannot be opened.
pub fn open_all(config: &Config) -> Result<Vec<Dev>, String> {
    let kernel: Vec<String> = erdma::devices()
        .map_err(|e| format!("listing RDMA devices: {e}"))?
        .into_iter()
        .filter(|d| d.provider == ProviderKind::Verbs)
        .map(|d| d.name)
        .collect();
    let sel = select(config, &kernel)?;
    info!(INIT, "NET/erdma: devices: {}", sel.why);
    let mut devs = Vec::new();
    for name in &sel.kernel {
        let ctx = Context::open(name).map_err(|e| format!("opening {name}: {e}"))?;
        devs.push(finish(devs.len(), ctx, config)?);
    }
    for soft in &sel.soft {
        let ctx = match soft {
            Some(addr) => {
                Context::open(&format!("soft:{addr}")).map_err(|e| format!("soft:{addr}: {e}"))?
            }
            None => open_auto_soft(config)?,
        };
        devs.push(finish(devs.len(), ctx, config)?);
    }
    if devs.is_empty() {
        return Err("no device selected".into());
    }
    Ok(devs)
}

/// Opens the automatic soft device: the base address plus the local rank, or the next free
/// address when that one is taken (another process of this host holds it).
fn open_auto_soft(config: &Config) -> Result<Context, String> {
    let mut last = String::new();
    for attempt in 0..64 {
        let Some(addr) = soft_address(config.soft_base, config.local_rank, attempt) else {
            break;
        };
        match Context::open(&format!("soft:{addr}")) {
            Ok(ctx) => {
                let rank = match config.local_rank {
                    Some(r) => format!("local rank {r}"),
                    None => "no local rank in the environment".into(),
                };
                info!(
                    INIT,
                    "NET/erdma: automatic soft device soft:{addr} ({rank}; base {})",
                    config.soft_base
                );
                return Ok(ctx);
            }
            Err(e) => {
                last = format!("soft:{addr}: {e}");
                // Only a taken address is worth another try; anything else fails the same way.
                if !last.contains("in use") && !last.contains("EADDRINUSE") {
                    break;
                }
            }
        }
    }
    Err(format!("no automatic soft device could be opened ({last})"))
}

fn cpus_per_local_rank(config: &Config) -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    cpus / config.local_size.unwrap_or(1).max(1)
}

fn gdr_choice(ctx: &Context, mode: Mode, config: &Config) -> (bool, String) {
    match config.gdr {
        Choice::Off => return (false, "ERDMA_NCCL_GDR=0: host staging".into()),
        Choice::On => return (true, "ERDMA_NCCL_GDR=1".into()),
        Choice::Auto => {}
    }
    if mode == Mode::Soft {
        return (
            false,
            "soft device: NCCL stages GPU data through host memory (ERDMA_NCCL_GDR=1 would use \
             the soft device's own CUDA staging)"
                .into(),
        );
    }
    if mode == Mode::Iwarp {
        return (
            false,
            "iWARP: flushing GPU writes needs a loopback queue pair, which iWARP connects only \
             through rdma_cm; NCCL stages through host memory"
                .into(),
        );
    }
    match erdma::gpu::device_count() {
        Ok(n) if n > 0 => {}
        Ok(_) => return (false, "no CUDA device: host memory only".into()),
        Err(e) => return (false, format!("no CUDA ({e}): host memory only")),
    }
    for m in ["nvidia_peermem", "nv_peer_mem"] {
        if Path::new("/sys/module").join(m).exists() {
            return (
                true,
                format!("GPU memory registered through {m} (peer memory)"),
            );
        }
    }
    if ctx.driver().as_deref() != Some("erdma") && erdma::gpu::dmabuf_supported(0).unwrap_or(false)
    {
        return (true, "GPU memory registered through dma-buf".into());
    }
    (
        false,
        "GPU memory cannot be registered (no nvidia_peermem module, and no dma-buf path for \
         this device): NCCL stages through host memory"
            .into(),
    )
}

fn finish(index: usize, ctx: Context, config: &Config) -> Result<Dev, String> {
    let name = ctx.name().to_string();
    let pd = ctx
        .alloc_pd()
        .map_err(|e| format!("{name}: allocating a protection domain: {e}"))?;
    let mode = detect_mode(&ctx);
    let soft = mode == Mode::Soft;
    let port = ctx
        .query_port(1)
        .map_err(|e| format!("{name}: querying port 1: {e}"))?;
    let speed_mbps = config.speed_mbps.unwrap_or(if soft {
        10000
    } else {
        port_speed_mbps(port.active_speed, port.active_width)
    });
    let oob_ip = match config.oob_addr {
        Some(a) => a,
        None => oob_address(&ctx)?,
    };
    // The SDK's limits know which devices lack immediate data (siw, other iWARP devices but
    // eRDMA); siw has no parent device in sysfs, so its driver name cannot tell.
    let notice = config.notice.unwrap_or(if ctx.limits().immediate_data {
        NoticeMode::Imm
    } else {
        NoticeMode::Send
    });
    let use_cm = match config.cm {
        Choice::On => true,
        Choice::Off => false,
        Choice::Auto => mode == Mode::Iwarp,
    };
    let inline_progress = match config.inline_progress {
        Choice::On => true,
        Choice::Off => false,
        Choice::Auto => cpus_per_local_rank(config) < 4,
    };
    let gdr = gdr_choice(&ctx, mode, config);
    let max_wr_bytes = ctx.limits().max_msg_size.clamp(4096, 1 << 30);
    let dev = Dev {
        index,
        guid: ctx.attr().node_guid,
        pci_path: if soft {
            None
        } else {
            pci_path(&name).map(|p| p.to_string_lossy().into_owned())
        },
        ctx,
        pd,
        mode,
        speed_mbps,
        oob_ip,
        gdr,
        notice,
        use_cm,
        inline_progress,
        max_wr_bytes,
    };
    info!(
        INIT,
        "NET/erdma: [{index}] {name}: {mode}, {} Mbit/s, connections through {}, notices by {}, \
         {} queue pairs per connection, out-of-band address {}, {}{}",
        dev.speed_mbps,
        if use_cm {
            "rdma_cm"
        } else {
            "the out-of-band exchange"
        },
        match notice {
            NoticeMode::Imm => "WRITE_WITH_IMM",
            NoticeMode::Send => "WRITE + SEND",
        },
        config.qps,
        oob_ip,
        if dev.gdr.0 {
            "GPU memory (NCCL_PTR_CUDA): "
        } else {
            "host memory (NCCL_PTR_HOST): "
        },
        dev.gdr.1,
    );
    if soft {
        info!(
            INIT,
            "NET/erdma: [{index}] {name}: the receive work runs {}",
            if inline_progress {
                "in NCCL's progress thread (inline progress)"
            } else {
                "in the soft device's engine thread"
            }
        );
    }
    if mode == Mode::Iwarp && !use_cm {
        warn!(
            "NET/erdma: {name} is iWARP but ERDMA_NCCL_CM=0: its queue pairs cannot connect \
             without rdma_cm"
        );
    }
    Ok(dev)
}

/// The address receivers of `ctx` listen on: the soft device's own, the RoCE GID's, the
/// device's interface's, or any non-loopback IPv4 address of the host.
fn oob_address(ctx: &Context) -> Result<IpAddr, String> {
    if let Some(g) = roce_gid(ctx).and_then(|e| e.gid.to_ipv4()) {
        return Ok(IpAddr::V4(g));
    }
    if let Some(a) = netdev(ctx).and_then(|n| netdev_ipv4(&n)) {
        return Ok(IpAddr::V4(a));
    }
    crate::sys::ipv4_addresses()
        .into_iter()
        .map(|(_, a)| a)
        .find(|a| !a.is_loopback())
        .map(IpAddr::V4)
        .ok_or_else(|| {
            format!(
                "{}: no IPv4 address for the out-of-band exchange (set ERDMA_NCCL_OOB_ADDR)",
                ctx.name()
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speeds_follow_the_verbs_encodings() {
        assert_eq!(port_speed_mbps(32, 2), 100000);
        assert_eq!(port_speed_mbps(128, 2), 400000);
        assert_eq!(port_speed_mbps(0, 0), 10000);
    }

    #[test]
    fn lasting_strings_are_shared_and_stay() {
        let a = lasting_str("soft:127.0.0.9");
        for i in 0..100 {
            lasting_str(&format!("x{i}"));
        }
        assert_eq!(lasting_str("soft:127.0.0.9"), a);
        let all = STRINGS.lock().unwrap();
        let kept = all.iter().find(|c| c.as_ptr() == a).unwrap();
        assert_eq!(kept.to_str().unwrap(), "soft:127.0.0.9");
    }
}
