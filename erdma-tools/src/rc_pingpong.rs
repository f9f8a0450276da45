//! `rc_pingpong`: rdma-core's `ibv_rc_pingpong` on the SDK, wire- and exchange-compatible with
//! it (`connect::compat::rc_pingpong`), so either end can be the C tool.
//!
//! Strict ping-pong of SENDs: the client sends first; each side sends its next message once its
//! previous send completed and the peer's message arrived; both count `iters` of each.

use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use erdma::connect::compat::{self, rc_pingpong::Dest};
use erdma::connect::{self, Listener};
use erdma::{
    Access, Completion, Context, InitOptions, Mtu, QpConfig, RawRecvWr, RawSendWr, SendFlags, Sge,
    WrOpcode,
};

use crate::cli::{Args, Spec};
use crate::tool::{self, Arm, ToolError, bad_value};

/// The flags `rc_pingpong` accepts (those of `ibv_rc_pingpong` that apply).
pub const SPECS: &[Spec] = &[
    Spec::opt(
        Some('p'),
        "port",
        "port",
        "TCP port of the exchange (default 18515; a server given 0 takes a free one and prints it)",
    ),
    Spec::opt(
        Some('d'),
        "ib-dev",
        "dev",
        "device (default: the first device)",
    ),
    Spec::opt(
        None,
        "peer-dev",
        "dev",
        "with --loopback: the server's device (default soft:127.0.0.2)",
    ),
    Spec::switch(
        None,
        "loopback",
        "server and client in this process on two soft devices (what no arguments does)",
    ),
    Spec::opt(Some('i'), "ib-port", "port", "device port (default 1)"),
    Spec::opt(
        Some('g'),
        "gid-idx",
        "index",
        "local GID index (default: the IPv4 RoCE v2 GID)",
    ),
    Spec::opt(Some('s'), "size", "bytes", "message size (default 4096)"),
    Spec::opt(
        Some('m'),
        "mtu",
        "bytes",
        "path MTU (default 1024; not exchanged: both ends must agree)",
    ),
    Spec::opt(
        Some('r'),
        "rx-depth",
        "count",
        "receives posted ahead (default 500)",
    ),
    Spec::opt(Some('n'), "iters", "count", "exchanges (default 1000)"),
    Spec::opt(
        Some('l'),
        "sl",
        "sl",
        "service level (accepted; RoCE ignores it)",
    ),
    Spec::opt(
        None,
        "timeout",
        "secs",
        "time the exchange and each message may take (default 15)",
    ),
];

const ABOUT: &str = "ping-pong of RC SENDs, like rdma-core's ibv_rc_pingpong, which it talks to.

Usage:
  rc_pingpong                       both ends in this process on soft:127.0.0.1 and soft:127.0.0.2
  rc_pingpong -d DEV [options]      server: waits for a client on TCP port -p
  rc_pingpong -d DEV [options] HOST client: connects to HOST
(Start ibv_rc_pingpong with -g <gid index>: RoCE needs a GID.)";

/// `rc_pingpong`'s settings.
#[derive(Debug, Clone)]
pub struct Options {
    /// Device.
    pub dev: Option<String>,
    /// The server's device in no-argument mode.
    pub peer_dev: Option<String>,
    /// Device port.
    pub port: u8,
    /// Local GID index.
    pub gid_index: Option<u8>,
    /// Message size.
    pub size: u32,
    /// Path MTU.
    pub mtu: Mtu,
    /// Receives posted ahead.
    pub rx_depth: u32,
    /// Exchanges.
    pub iters: u64,
    /// TCP port.
    pub tcp_port: u16,
    /// Server to connect to (client role).
    pub server: Option<String>,
    /// Both ends in this process.
    pub loopback: bool,
    /// Time the exchange and each message may take.
    pub timeout: Duration,
}

/// Parses the command line.
///
/// # Errors
/// A [`ToolError::Cli`] naming the flag.
pub fn parse(argv: &[String]) -> Result<Options, ToolError> {
    let a = Args::parse("rc_pingpong", ABOUT, SPECS, 1, argv.iter().cloned())?;
    let size: u32 = a.get("size", 4096)?;
    if size == 0 {
        return Err(bad_value("--size", size, "at least 1"));
    }
    let rx_depth: u32 = a.get("rx-depth", 500)?;
    if !(1..=8192).contains(&rx_depth) {
        return Err(bad_value("--rx-depth", rx_depth, "a depth in 1..=8192"));
    }
    let iters: u64 = a.get("iters", 1000)?;
    if iters == 0 {
        return Err(bad_value("--iters", iters, "at least 1"));
    }
    let _sl: u8 = a.get("sl", 0)?;
    let tcp_port: u16 = a.get("port", compat::DEFAULT_PORT)?;
    let server = a.positional().first().cloned();
    let loopback = tool::loopback_mode(&a, argv.is_empty(), server.as_deref())?;
    tool::check_port(tcp_port, server.is_some())?;
    Ok(Options {
        dev: a.str("ib-dev").map(str::to_string),
        peer_dev: a.str("peer-dev").map(str::to_string),
        port: a.get("ib-port", 1)?,
        gid_index: a.opt("gid-idx")?,
        size,
        mtu: tool::parse_mtu("--mtu", Some(a.get("mtu", 1024)?))?.unwrap_or(Mtu::Mtu1024),
        rx_depth,
        iters,
        tcp_port,
        server,
        loopback,
        timeout: tool::parse_secs("--timeout", a.get("timeout", 15.0)?)?,
    })
}

/// Entry point: parses, runs, maps the outcome to an exit status.
pub fn main() -> std::process::ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let r = parse(&argv).and_then(|o| run(&o).map_err(ToolError::Run));
    tool::exit_with("rc_pingpong", r)
}

/// What one side measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    /// Bytes moved both ways.
    pub bytes: u64,
    /// Exchanges.
    pub iters: u64,
    /// Elapsed time.
    pub elapsed: Duration,
}

impl Outcome {
    /// `ibv_rc_pingpong`'s two result lines.
    pub fn lines(&self) -> String {
        let usec = self.elapsed.as_secs_f64() * 1e6;
        format!(
            "{} bytes in {:.2} seconds = {:.2} Mbit/sec\n{} iters in {:.2} seconds = {:.2} usec/iter",
            self.bytes,
            usec / 1e6,
            self.bytes as f64 * 8.0 / usec,
            self.iters,
            usec / 1e6,
            usec / self.iters as f64
        )
    }
}

/// Runs as the options say: both ends, server or client.
///
/// # Errors
/// Whatever failed.
pub fn run(o: &Options) -> erdma::Result<()> {
    if o.loopback {
        let l = Listener::bind("127.0.0.1:0")?;
        let addr = l.local_addr()?;
        let mut server = o.clone();
        server.dev = Some(
            o.peer_dev
                .clone()
                .unwrap_or_else(|| "soft:127.0.0.2".into()),
        );
        let mut client = o.clone();
        client.dev = Some(o.dev.clone().unwrap_or_else(|| "soft:127.0.0.1".into()));
        let t = o.timeout;
        // Both devices open first: one that cannot open is the error reported.
        let server_ctx = open(&server)?;
        let client_ctx = open(&client)?;
        let s = std::thread::spawn(move || {
            let (stream, _) = l.accept(t)?;
            side(&server, server_ctx, stream, false)
        });
        let c = connect::dial(addr, t).and_then(|stream| side(&client, client_ctx, stream, true));
        if c.is_err() {
            // A server still waiting for the connection takes this one, and fails at once.
            let _ = TcpStream::connect_timeout(&addr, Duration::from_secs(1));
        }
        let s = s
            .join()
            .unwrap_or_else(|_| Err(erdma::Error::InvalidArgument("server panicked".into())));
        let (c, s) = (c?, s?);
        println!("{}", c.lines());
        println!("server: {}", s.lines().replace('\n', "\nserver: "));
        Ok(())
    } else if let Some(host) = &o.server {
        let target = format!("{host}:{}", o.tcp_port);
        let addrs: Vec<_> = target
            .to_socket_addrs()
            .map_err(|e| erdma::Error::InvalidArgument(format!("cannot resolve {target}: {e}")))?
            .collect();
        let ctx = open(o)?;
        let stream = connect::dial(&addrs[..], o.timeout)?;
        println!("{}", side(o, ctx, stream, true)?.lines());
        Ok(())
    } else {
        let ctx = open(o)?;
        let l = Listener::bind(("0.0.0.0", o.tcp_port))?;
        eprintln!(
            "rc_pingpong: waiting for a client on TCP port {}",
            l.local_addr()?.port()
        );
        let (stream, _) = l.accept(Duration::from_secs(24 * 3600))?;
        println!("{}", side(o, ctx, stream, false)?.lines());
        Ok(())
    }
}

const RECV_WRID: u64 = 1;
const SEND_WRID: u64 = 2;

/// Opens the device, and checks the message size against it before anything is allocated or
/// connected.
fn open(o: &Options) -> erdma::Result<Context> {
    let ctx = Context::open(&o.dev.clone().unwrap_or_else(erdma::default_device_name))?;
    let max = ctx.limits().max_msg_size;
    if u64::from(o.size) > max {
        return Err(erdma::Error::LimitExceeded {
            limit: erdma::Limit::MaxMsgSize,
            requested: u64::from(o.size),
            max,
        });
    }
    Ok(ctx)
}

/// One end: resources, the exchange, the ping-pong.
fn side(o: &Options, ctx: Context, mut stream: TcpStream, client: bool) -> erdma::Result<Outcome> {
    let port = ctx.query_port(o.port)?;
    if o.mtu > port.max_mtu {
        return Err(erdma::Error::InvalidArgument(format!(
            "MTU {} exceeds {}'s maximum {}",
            o.mtu,
            ctx.name(),
            port.max_mtu
        )));
    }
    let (gid_index, gid) = tool::local_gid(&ctx, o.port, o.gid_index)?;
    let pd = ctx.alloc_pd()?;
    let size = o.size as usize;
    let mut mr = pd.alloc(2 * size, Access::LOCAL_WRITE)?;
    for (i, b) in mr.as_mut_slice()[size..].iter_mut().enumerate() {
        *b = i as u8;
    }
    let cq = ctx.create_cq(o.rx_depth + 1)?;
    let qp = pd
        .create_qp(&QpConfig::new(&cq).max_send_wr(1).max_recv_wr(o.rx_depth))?
        .init(&InitOptions {
            port: o.port,
            pkey_index: 0,
            access: Access::empty(),
        })?;
    let recv_sge = [Sge {
        addr: mr.addr(),
        length: o.size,
        lkey: mr.lkey(),
    }];
    let send_sge = [Sge {
        addr: mr.addr() + size as u64,
        length: o.size,
        lkey: mr.lkey(),
    }];
    let recv = [RawRecvWr {
        wr_id: RECV_WRID,
        sges: &recv_sge,
    }];
    let depth = qp.caps().max_recv_wr.min(o.rx_depth);
    for _ in 0..depth {
        // The SGE lies in `mr`, which is declared before the queue pair and so outlives it; the
        // CPU does not touch the receive half while the queue pair lives.
        // SAFETY: the SGE's memory outlives the queue pair and is left to the device (above).
        unsafe { qp.post_recv_raw(&recv)? };
    }
    let local = Dest {
        lid: port.lid,
        qpn: qp.qp_num(),
        psn: qp.initial_psn(),
        gid,
    };
    let arm_with = |qp, remote: &Dest| {
        tool::check_peer_gid(&gid, &remote.gid)?;
        tool::arm(
            qp,
            &Arm {
                remote_qpn: remote.qpn,
                remote_psn: remote.psn,
                remote_gid: remote.gid,
                remote_lid: remote.lid,
                mtu: o.mtu,
                sgid_index: gid_index,
                port: o.port,
                max_dest_rd_atomic: 1,
                max_rd_atomic: 1,
                hop_limit: 64,
            },
        )
    };
    let qp = if client {
        let remote = compat::rc_pingpong::client_exchange(&mut stream, &local, o.timeout)?;
        arm_with(qp, &remote)?
    } else {
        let mut init = Some(qp);
        let mut armed = None;
        compat::rc_pingpong::server_exchange(&mut stream, &local, o.timeout, |remote| {
            let qp = init
                .take()
                .ok_or_else(|| erdma::Error::InvalidArgument("armed twice".into()))?;
            armed = Some(arm_with(qp, remote)?);
            Ok(())
        })?;
        armed.ok_or_else(|| erdma::Error::InvalidArgument("never armed".into()))?
    };
    drop(stream);

    let send = || -> erdma::Result<()> {
        let mut wr = RawSendWr::new(SEND_WRID, WrOpcode::Send, &send_sge);
        wr.flags = SendFlags::SIGNALED;
        // The SGE lies in `mr`, which outlives the queue pair; the send half is not written
        // while the queue pair lives.
        // SAFETY: the SGE's memory outlives the queue pair and is not written (above).
        unsafe { qp.post_send_raw(std::slice::from_ref(&wr)) }
    };
    let start = Instant::now();
    let (mut scnt, mut rcnt) = (0u64, 0u64);
    let mut pending = RECV_WRID;
    if client {
        send()?;
        pending |= SEND_WRID;
    }
    let mut wcs = [Completion::default(); 16];
    let mut last = Instant::now();
    while scnt < o.iters || rcnt < o.iters {
        let n = cq.poll(&mut wcs)?;
        if n == 0 {
            if last.elapsed() > o.timeout {
                return Err(erdma::Error::Timeout {
                    what: format!(
                        "the peer's next message ({rcnt} of {} received, {scnt} sent)",
                        o.iters
                    ),
                });
            }
            std::hint::spin_loop();
            continue;
        }
        last = Instant::now();
        for c in &wcs[..n] {
            let c = c.ok()?;
            match c.wr_id {
                SEND_WRID => scnt += 1,
                RECV_WRID => {
                    // SAFETY: as for the first receives.
                    unsafe { qp.post_recv_raw(&recv)? };
                    rcnt += 1;
                }
                other => {
                    return Err(erdma::Error::InvalidArgument(format!(
                        "completion for unknown work request {other}"
                    )));
                }
            }
            pending &= !c.wr_id;
            if scnt < o.iters && pending == 0 {
                send()?;
                pending = RECV_WRID | SEND_WRID;
            }
        }
    }
    let elapsed = start.elapsed();
    drop(qp);
    drop(mr);
    Ok(Outcome {
        bytes: o.size as u64 * o.iters * 2,
        iters: o.iters,
        elapsed,
    })
}
