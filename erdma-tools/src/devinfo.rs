//! `devinfo`: what `ibv_devinfo -v` prints, for verbs and soft devices alike, plus the limit
//! profile the SDK holds each device to.

use std::fmt::Write as _;
use std::time::Duration;

use erdma::{Context, Limits};

use crate::cli::{Args, Spec};
use crate::tool::{self, ToolError};

/// The flags `devinfo` accepts.
pub const SPECS: &[Spec] = &[
    Spec::opt(
        Some('d'),
        "ib-dev",
        "dev",
        "only this device (rxe0, erdma_0, soft:10.0.0.1)",
    ),
    Spec::opt(Some('i'), "ib-port", "port", "only this port"),
    Spec::switch(Some('l'), "list", "list the device names only"),
    Spec::switch(
        Some('c'),
        "counters",
        "also print each port's counters (packets, retries, RNR and sequence errors, drops)",
    ),
    Spec::opt(
        Some('w'),
        "watch",
        "secs",
        "then print the devices' asynchronous events (port down/up, queue errors, fatal \
         errors) as they come, for this many seconds",
    ),
    Spec::switch(
        None,
        "nccl",
        "for each device: its mode (iWARP, RoCEv2, compat), GID index and the NCCL / PyTorch \
         settings that fit, with the erdma NCCL plugin and without",
    ),
    Spec::switch(
        Some('v'),
        "verbose",
        "accepted for ibv_devinfo compatibility (output is always verbose)",
    ),
];

const ABOUT: &str = "the RDMA devices this machine can use (kernel verbs devices and soft \
devices), like ibv_devinfo -v, with the limit profile the SDK checks requests against";

/// Entry point: parses the command line, prints, and maps the outcome to an exit status.
pub fn main() -> std::process::ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    tool::exit_with("devinfo", run(&argv))
}

/// Runs `devinfo` with `argv` (without the program name), printing to stdout.
///
/// # Errors
/// A refused command line, an unknown device, or a failed query.
pub fn run(argv: &[String]) -> Result<(), ToolError> {
    let a = Args::parse("devinfo", ABOUT, SPECS, 0, argv.iter().cloned())?;
    let port: Option<u8> = a.opt("ib-port")?;
    if a.has("nccl") {
        print!("{}", erdma_nccl::doctor::report(a.str("ib-dev")));
        return Ok(());
    }
    let list = erdma::devices()?;
    if a.has("list") {
        println!("{} HCAs found:", list.len());
        for d in &list {
            println!("\t{}", d.name);
        }
        return Ok(());
    }
    let names: Vec<String> = match a.str("ib-dev") {
        Some(d) => vec![d.to_string()],
        None => list.iter().map(|d| d.name.clone()).collect(),
    };
    let watch: Option<u64> = a.opt("watch")?;
    if let Some(secs) = watch.filter(|&s| s > MAX_WATCH_SECS) {
        return Err(tool::bad_value(
            "--watch",
            secs,
            &format!("at most {MAX_WATCH_SECS} seconds"),
        ));
    }
    let mut opened = Vec::new();
    for name in names {
        let ctx = Context::open(&name)?;
        print!("{}", describe(&ctx, port)?);
        if a.has("counters") {
            print!("{}", counters_text(&ctx, port)?);
        }
        opened.push(ctx);
    }
    if let Some(secs) = watch {
        watch_events(&opened, Duration::from_secs(secs));
    }
    Ok(())
}

/// Longest `--watch`: a week.
const MAX_WATCH_SECS: u64 = 7 * 86_400;

/// Prints each context's asynchronous events as they come, one line each, until `dur` has
/// passed.
fn watch_events(ctxs: &[Context], dur: Duration) {
    use std::io::Write as _;
    let end = std::time::Instant::now() + dur;
    println!("watching asynchronous events for {} s", dur.as_secs());
    let _ = std::io::stdout().flush();
    // Each context is looked at in turn, sleeping on one at a time for a short slice.
    let slice = Duration::from_millis(if ctxs.len() > 1 { 20 } else { 200 });
    let mut dropped = vec![0u64; ctxs.len()];
    while std::time::Instant::now() < end {
        for (i, ctx) in ctxs.iter().enumerate() {
            let left = end.saturating_duration_since(std::time::Instant::now());
            if let Some(ev) = ctx.next_async_event(slice.min(left)) {
                println!("{}: event: {ev}", ctx.name());
            }
            let d = ctx.async_events_dropped();
            if d > dropped[i] {
                println!("{}: {} events dropped unread", ctx.name(), d - dropped[i]);
                dropped[i] = d;
            }
            let _ = std::io::stdout().flush();
        }
        if ctxs.is_empty() {
            std::thread::sleep(end.saturating_duration_since(std::time::Instant::now()));
        }
    }
}

/// Every port's counters (or only `only_port`'s), one `name: value` per line.
///
/// # Errors
/// A port the device does not have, or counters the device cannot report.
pub fn counters_text(ctx: &Context, only_port: Option<u8>) -> erdma::Result<String> {
    let ports: Vec<u8> = match only_port {
        Some(p) => vec![p],
        None => (1..=ctx.attr().phys_port_cnt.max(1)).collect(),
    };
    let mut o = String::new();
    for p in ports {
        let c = ctx.port_counters(p)?;
        let _ = writeln!(
            o,
            "\tport {p} counters:{}",
            if c.is_empty() { " none" } else { "" }
        );
        for (name, v) in c.iter() {
            let _ = writeln!(o, "\t\t{:<28}{v}", format!("{name}:"));
        }
    }
    Ok(o)
}

/// The text `devinfo` prints for one device (all ports, or only `only_port`).
///
/// # Errors
/// A failed port or GID query, or a port the device does not have.
pub fn describe(ctx: &Context, only_port: Option<u8>) -> erdma::Result<String> {
    let a = ctx.attr();
    let mut o = String::new();
    let _ = writeln!(o, "hca_id:\t{}", ctx.name());
    let kv = |o: &mut String, k: &str, v: String| {
        let _ = writeln!(o, "\t{:<24}{v}", format!("{k}:"));
    };
    kv(&mut o, "provider", ctx.provider().to_string());
    kv(&mut o, "transport", ctx.transport().to_string());
    if let Some(d) = ctx.driver() {
        kv(&mut o, "driver", d);
    }
    kv(&mut o, "fw_ver", a.fw_ver.clone());
    kv(&mut o, "node_guid", guid(a.node_guid));
    kv(&mut o, "sys_image_guid", guid(a.sys_image_guid));
    kv(&mut o, "vendor_id", format!("{:#06x}", a.vendor_id));
    kv(&mut o, "vendor_part_id", a.vendor_part_id.to_string());
    kv(&mut o, "hw_ver", format!("{:#x}", a.hw_ver));
    kv(&mut o, "phys_port_cnt", a.phys_port_cnt.to_string());
    kv(&mut o, "max_mr_size", format!("{:#x}", a.max_mr_size));
    kv(&mut o, "page_size_cap", format!("{:#x}", a.page_size_cap));
    kv(&mut o, "max_qp", a.max_qp.to_string());
    kv(&mut o, "max_qp_wr", a.max_qp_wr.to_string());
    kv(
        &mut o,
        "device_cap_flags",
        format!("{:#010x}", a.device_cap_flags),
    );
    kv(&mut o, "max_sge", a.max_sge.to_string());
    kv(&mut o, "max_sge_rd", a.max_sge_rd.to_string());
    kv(&mut o, "max_cq", a.max_cq.to_string());
    kv(&mut o, "max_cqe", a.max_cqe.to_string());
    kv(&mut o, "max_mr", a.max_mr.to_string());
    kv(&mut o, "max_pd", a.max_pd.to_string());
    kv(&mut o, "max_qp_rd_atom", a.max_qp_rd_atom.to_string());
    kv(
        &mut o,
        "max_qp_init_rd_atom",
        a.max_qp_init_rd_atom.to_string(),
    );
    kv(&mut o, "atomic_cap", a.atomic_cap.to_string());
    kv(&mut o, "max_srq", a.max_srq.to_string());
    kv(&mut o, "max_mw", a.max_mw.to_string());
    kv(&mut o, "max_ah", a.max_ah.to_string());
    let ports: Vec<u8> = match only_port {
        Some(p) if p == 0 || p > a.phys_port_cnt.max(1) => {
            return Err(erdma::Error::InvalidArgument(format!(
                "{} has no port {p} (ports 1..={})",
                ctx.name(),
                a.phys_port_cnt.max(1)
            )));
        }
        Some(p) => vec![p],
        None => (1..=a.phys_port_cnt.max(1)).collect(),
    };
    for p in ports {
        let pa = ctx.query_port(p)?;
        let _ = writeln!(o, "\t\tport:\t{p}");
        let pkv = |o: &mut String, k: &str, v: String| {
            let _ = writeln!(o, "\t\t\t{:<20}{v}", format!("{k}:"));
        };
        pkv(&mut o, "state", pa.state.to_string());
        pkv(
            &mut o,
            "max_mtu",
            format!("{} ({})", pa.max_mtu.bytes(), pa.max_mtu.as_enum()),
        );
        pkv(
            &mut o,
            "active_mtu",
            format!("{} ({})", pa.active_mtu.bytes(), pa.active_mtu.as_enum()),
        );
        pkv(&mut o, "port_lid", pa.lid.to_string());
        pkv(
            &mut o,
            "port_cap_flags",
            format!("{:#010x}", pa.port_cap_flags),
        );
        pkv(&mut o, "max_msg_sz", format!("{:#x}", pa.max_msg_sz));
        pkv(&mut o, "gid_tbl_len", pa.gid_tbl_len.to_string());
        pkv(&mut o, "active_width", pa.active_width.to_string());
        pkv(&mut o, "active_speed", pa.active_speed.to_string());
        pkv(&mut o, "link_layer", pa.link_layer.to_string());
        for g in ctx.gid_table(p)? {
            let _ = writeln!(
                o,
                "\t\t\tGID[{:>3}]:\t\t{}, {}",
                g.index,
                g.gid.to_ip(),
                g.gid_type
            );
        }
    }
    o.push_str(&limits_text(ctx.limits()));
    Ok(o)
}

fn guid(g: u64) -> String {
    let b = g.to_be_bytes();
    format!(
        "{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}",
        b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]
    )
}

/// The limit profile, one line per limit.
pub fn limits_text(l: &Limits) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "\tlimit profile:\t\t{}", l.profile);
    let rows: [(&str, String); 21] = [
        ("max_send_wr", l.max_send_wr.to_string()),
        ("max_recv_wr", l.max_recv_wr.to_string()),
        ("max_send_sge", l.max_send_sge.to_string()),
        ("max_recv_sge", l.max_recv_sge.to_string()),
        ("max_sge_rd", l.max_sge_rd.to_string()),
        ("max_inline_data", l.max_inline_data.to_string()),
        ("max_cqe", l.max_cqe.to_string()),
        ("min_cq_depth", l.min_cq_depth.to_string()),
        ("cq_depth_pow2", l.cq_depth_pow2.to_string()),
        ("max_rd_atomic", l.max_rd_atomic.to_string()),
        ("max_dest_rd_atomic", l.max_dest_rd_atomic.to_string()),
        ("max_mr_size", format!("{:#x}", l.max_mr_size)),
        ("max_msg_size", format!("{:#x}", l.max_msg_size)),
        ("max_qp", l.max_qp.to_string()),
        ("max_cq", l.max_cq.to_string()),
        ("max_mr", l.max_mr.to_string()),
        ("max_pd", l.max_pd.to_string()),
        ("atomics", l.atomics.to_string()),
        ("srq", l.srq.to_string()),
        ("memory_windows", l.memory_windows.to_string()),
        ("zero_depth_queues", l.zero_depth_queues.to_string()),
    ];
    for (k, v) in rows {
        let _ = writeln!(o, "\t\t{:<24}{v}", format!("{k}:"));
    }
    o
}
