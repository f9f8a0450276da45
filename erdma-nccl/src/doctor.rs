//! `devinfo --nccl`: for each device, the mode it runs in, the GID index RoCE traffic must use,
//! and the NCCL and PyTorch settings that fit, with this plugin and (where it can work) with
//! NCCL's own IB transport.

use std::fmt::Write as _;
use std::path::PathBuf;

use erdma::{Context, ProviderKind};

use crate::device::{Mode, detect_mode, netdev, netdev_ipv4, roce_gid};

/// Where the plugin library probably is: next to the running program, in `target/release`
/// of the current directory, or a placeholder.
fn plugin_path() -> String {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            candidates.push(dir.join("libnccl-net-erdma.so"));
            if let Some(up) = dir.parent() {
                candidates.push(up.join("libnccl-net-erdma.so"));
            }
        }
    }
    if let Ok(cwd) = std::env::current_dir() {
        candidates.push(cwd.join("target/release/libnccl-net-erdma.so"));
    }
    candidates
        .into_iter()
        .find(|p| p.exists())
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "/path/to/libnccl-net-erdma.so".into())
}

/// The report for `device` (one name), or for every kernel device and the automatic soft
/// device.
pub fn report(device: Option<&str>) -> String {
    let mut out = String::new();
    let plugin = plugin_path();
    let names: Vec<String> = match device {
        Some(d) => vec![d.to_string()],
        None => {
            let mut v: Vec<String> = erdma::devices()
                .unwrap_or_default()
                .into_iter()
                .filter(|d| d.provider == ProviderKind::Verbs)
                .map(|d| d.name)
                .collect();
            if v.is_empty() {
                v.push("soft".into());
            }
            v
        }
    };
    let _ = writeln!(
        out,
        "NCCL on this machine (plugin: {plugin}; build it with scripts/build-nccl-plugin)"
    );
    for name in &names {
        if name == "soft" {
            soft_section(&mut out, &plugin, None);
            continue;
        }
        match Context::open(name) {
            Ok(ctx) if ctx.provider() == ProviderKind::Soft => {
                soft_section(&mut out, &plugin, Some(ctx.name()));
            }
            Ok(ctx) => kernel_section(&mut out, &plugin, &ctx),
            Err(e) => {
                let _ = writeln!(out, "\n{name}: cannot be opened: {e}");
            }
        }
    }
    out
}

fn soft_section(out: &mut String, plugin: &str, name: Option<&str>) {
    let _ = writeln!(
        out,
        "\n{}: {}",
        name.unwrap_or("soft (no RDMA NIC)"),
        Mode::Soft
    );
    let _ = writeln!(
        out,
        "  GID index: 1 (::ffff:<address>; the plugin finds it, nothing to set)"
    );
    let _ = writeln!(
        out,
        "  NCCL's own IB transport: no kernel RDMA device, so only NCCL's socket transport or \
         this plugin"
    );
    let _ = writeln!(
        out,
        "  with the plugin (each local rank gets its own soft device, 127.0.0.<2 + LOCAL_RANK>):"
    );
    let _ = writeln!(out, "    export NCCL_NET_PLUGIN={plugin}");
    let _ = writeln!(out, "    export NCCL_NET=erdma");
    match name {
        Some(n) => {
            let _ = writeln!(
                out,
                "    export ERDMA_NCCL_DEVICES={n}   # one rank per address"
            );
        }
        None => {
            let _ = writeln!(
                out,
                "    # across hosts: ERDMA_NCCL_DEVICES=soft:<this host's address>, one rank per \
                 address"
            );
        }
    }
    let _ = writeln!(
        out,
        "  PyTorch: the same variables, then torchrun --nproc-per-node=<GPUs> train.py \
         (backend \"nccl\")"
    );
}

fn kernel_section(out: &mut String, plugin: &str, ctx: &Context) {
    let name = ctx.name();
    let mode = detect_mode(ctx);
    let ifname = netdev(ctx);
    let ip = ifname.as_deref().and_then(netdev_ipv4);
    let _ = writeln!(out, "\n{name}: {mode}");
    let _ = writeln!(
        out,
        "  driver {}, transport {}, interface {}{}",
        ctx.driver().unwrap_or_else(|| "?".into()),
        ctx.transport(),
        ifname.as_deref().unwrap_or("?"),
        ip.map(|a| format!(" ({a})")).unwrap_or_default()
    );
    let gid = roce_gid(ctx);
    match (mode, gid) {
        (Mode::Iwarp, _) => {
            let _ = writeln!(
                out,
                "  GID index: none to choose (iWARP: connections go through rdma_cm)"
            );
        }
        (_, Some(g)) => {
            let _ = writeln!(out, "  GID index: {} ({}, {})", g.index, g.gid, g.gid_type);
        }
        (_, None) => {
            let _ = writeln!(
                out,
                "  GID index: no IPv4-mapped RoCE v2 GID on port 1 (is the interface up with an \
                 IPv4 address?)"
            );
        }
    }
    let ifset = ifname
        .as_deref()
        .map(|i| format!(" NCCL_SOCKET_IFNAME={i}"))
        .unwrap_or_default();
    if mode == Mode::Iwarp {
        let _ = writeln!(
            out,
            "  NCCL's own IB transport: cannot connect in this mode (its queue pairs need \
             rdma_cm); use the plugin, or switch the driver to compat mode"
        );
    } else {
        let gidset = gid
            .map(|g| format!(" NCCL_IB_GID_INDEX={}", g.index))
            .unwrap_or_default();
        let _ = writeln!(out, "  without the plugin (NCCL's own IB transport):");
        let _ = writeln!(
            out,
            "    export NCCL_IB_HCA={name}{gidset} NCCL_IB_QPS_PER_CONNECTION=8{ifset}"
        );
    }
    let _ = writeln!(out, "  with the plugin:");
    let _ = writeln!(out, "    export NCCL_NET_PLUGIN={plugin}");
    let _ = writeln!(
        out,
        "    export NCCL_NET=erdma ERDMA_NCCL_DEVICES={name} ERDMA_NCCL_QPS=8{ifset}"
    );
    let _ = writeln!(
        out,
        "  PyTorch: the same variables, then torchrun --nproc-per-node=<GPUs> train.py \
         (backend \"nccl\")"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_report_names_the_plugin_and_the_variables() {
        let r = report(Some("soft"));
        assert!(r.contains("RoCEv2 (soft device, userspace)"), "{r}");
        assert!(r.contains("export NCCL_NET=erdma"), "{r}");
        assert!(r.contains("NCCL_NET_PLUGIN="), "{r}");
        assert!(r.contains("torchrun"), "{r}");
        let r = report(Some("no_such_device_0"));
        assert!(r.contains("no_such_device_0: cannot be opened"), "{r}");
    }
}
