//! One end of a run, set up: the device opened, the queue pairs created and armed from the
//! peer's keys, one registered buffer; and what both engines do with it (receives, the passive
//! side's wait for the peer).

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use erdma::connect;
use erdma::connect::compat::perftest::{Keys, Role};
use erdma::{
    Access, Completion, Context, Cq, InitOptions, Mr, Mtu, Qp, QpConfig, RawRecvWr, Rts, Sge,
};

use super::oob::{self, Channel};
use super::options::title;
use super::{Options, Test, Verb, bw, cm, lat};
use crate::report;
use crate::tool::{self, Arm};

/// Opens the device, and checks the message size against it before anything is allocated or
/// connected.
pub(super) fn open(o: &Options) -> erdma::Result<Context> {
    let name = o.dev.clone().unwrap_or_else(erdma::default_device_name);
    let ctx = Context::open(&name)?;
    cm::check_transport(o, &ctx)?;
    let max = ctx.limits().max_msg_size;
    if o.max_size() > max {
        return Err(erdma::Error::LimitExceeded {
            limit: erdma::Limit::MaxMsgSize,
            requested: o.max_size(),
            max,
        });
    }
    Ok(ctx)
}

/// Connects to the server the options name (`host`, dialled on `--port`, or `host:port`).
pub(super) fn dial(o: &Options) -> erdma::Result<TcpStream> {
    let host = o.server.as_deref().unwrap_or("127.0.0.1");
    let target = if host.contains(':') && host.parse::<SocketAddr>().is_ok() {
        host.to_string()
    } else {
        format!("{host}:{}", o.tcp_port)
    };
    // Only IPv4, as perftest.
    let addrs: Vec<_> = target
        .to_socket_addrs()
        .map_err(|e| erdma::Error::InvalidArgument(format!("cannot resolve {target}: {e}")))?
        .filter(|a| a.is_ipv4())
        .collect();
    if addrs.is_empty() {
        return Err(erdma::Error::InvalidArgument(format!(
            "{target} has no IPv4 address"
        )));
    }
    connect::dial(&addrs[..], o.step_timeout)
}

/// One side's resources: device, queues, and one registered buffer holding, per queue pair, a
/// target area (what the peer writes, reads or sends into) and a source area.
pub(super) struct Side {
    // Queue pairs first: they are destroyed before the region they use.
    pub(super) qps: Vec<Qp<Rts>>,
    /// `-R`: the rdma_cm connections the queue pairs live on (disconnected when dropped, which
    /// destroys the queue pairs).
    _links: Vec<erdma::connect::cm::Connection>,
    pub(super) cq: Cq,
    pub(super) mr: Mr<'static>,
    pub(super) base: *mut u8,
    pub(super) area: u64,
    pub(super) remotes: Vec<Keys>,
    pub(super) inline_max: u32,
    pub(super) ctx: Context,
    mtu: Mtu,
    gid_index: u8,
}

impl Side {
    /// Start of queue pair `q`'s target area.
    pub(super) fn target(&self, q: usize) -> u64 {
        self.mr.addr() + q as u64 * 2 * self.area
    }

    /// Start of queue pair `q`'s source area.
    pub(super) fn source(&self, q: usize) -> u64 {
        self.target(q) + self.area
    }

    pub(super) fn qp_index(&self, qp_num: u32) -> Option<usize> {
        self.qps.iter().position(|q| q.qp_num() == qp_num)
    }
}

/// The largest cycle buffer a peer may agree on: 64 KiB, the largest common page size.
const MAX_CYCLE_BUFFER: u64 = 1 << 16;

/// Sets up one end over its connected stream and runs the test's phases in `role`.
pub(super) fn run_connected(
    o: &Options,
    ctx: Context,
    stream: TcpStream,
    role: Role,
) -> erdma::Result<()> {
    // The passive side waits for the peer's run without a deadline: a vanished peer host is
    // found by keepalive, a broken path by `await_peer`'s stall rule.
    tool::keepalive(&stream)?;
    let ch = oob::channel(o, stream, role);
    run_channel(o, ctx, ch, role, None)
}

/// The run over an established channel; `cm_ends` (`-R`): the channel's local and peer
/// addresses, where the queue pairs' rdma_cm connections go.
pub(super) fn run_channel(
    o: &Options,
    ctx: Context,
    mut ch: Box<dyn Channel>,
    role: Role,
    cm_ends: Option<(SocketAddr, SocketAddr)>,
) -> erdma::Result<()> {
    let port = ctx.query_port(o.port)?;
    let local_mtu = o.mtu.unwrap_or(port.active_mtu);
    if local_mtu > port.max_mtu {
        return Err(erdma::Error::InvalidArgument(format!(
            "MTU {local_mtu} exceeds the port's maximum {}",
            port.max_mtu
        )));
    }
    let (mtu, cycle_buffer) = ch.setup(local_mtu)?;
    // A C perftest peer on a host with larger pages agrees on a larger cycle buffer and steps
    // its small messages' addresses through all of it: each area covers it.
    if cycle_buffer > MAX_CYCLE_BUFFER {
        return Err(erdma::Error::Protocol {
            what: format!(
                "the peer's cycle buffer of {cycle_buffer} bytes is above the {MAX_CYCLE_BUFFER} \
                 this tool supports"
            ),
        });
    }
    let (gid_index, gid) = tool::local_gid(&ctx, o.port, o.gid_index)?;

    // Resources.
    let nq = o.qps as usize;
    let area = o.max_size().max(cycle_buffer).div_ceil(64) * 64;
    let len = usize::try_from(area * 2 * nq as u64)
        .map_err(|_| erdma::Error::InvalidArgument("buffer too large".into()))?;
    let pd = ctx.alloc_pd()?;
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let mut mr = if o.small_pages {
        ctx.limits().check_mr_len(len as u64)?;
        pd.register(small_pages(len), access)?
    } else {
        pd.alloc(len, access)?
    };
    let base = mr.as_mut_ptr();
    let rx_depth = if o.verb == Verb::Send { o.rx_depth } else { 1 };
    let cq = ctx.create_cq((o.tx_depth + rx_depth) * o.qps)?;
    let limits = ctx.limits().clone();
    let out_reads: u16 = if o.verb == Verb::Read {
        limits.max_rd_atomic.clamp(1, 16) as u16
    } else {
        1
    };
    let inline = o.inline.min(limits.max_inline_data);
    let config = QpConfig::new(&cq)
        .max_send_wr(o.tx_depth)
        .max_recv_wr(rx_depth)
        .max_inline_data(inline);
    // -R: the queue pairs come connected from rdma_cm.
    let via_cm = cm_ends
        .map(|ends| cm::connect(o, &pd, &config, role, ends, &mut *ch))
        .transpose()?;
    let mut inits = Vec::with_capacity(nq);
    if via_cm.is_none() {
        for _ in 0..nq {
            let qp = pd.create_qp(&config)?;
            inits.push(qp.init(&InitOptions {
                port: o.port,
                // The peer WRITEs and READs the region this side grants.
                access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
                ..InitOptions::default()
            })?);
        }
    }
    let ids: Vec<(u32, u32, u32)> = match &via_cm {
        Some(c) => c
            .qps
            .iter()
            .map(|q| (q.qp_num(), q.initial_psn(), q.caps().max_inline_data))
            .collect(),
        None => inits
            .iter()
            .map(|q| (q.qp_num(), q.initial_psn(), q.caps().max_inline_data))
            .collect(),
    };
    let inline_max = ids.first().map(|i| i.2.min(inline)).unwrap_or(0);
    let mine: Vec<Keys> = ids
        .iter()
        .enumerate()
        .map(|(q, &(qpn, psn, _))| Keys {
            lid: port.lid,
            out_reads,
            qpn,
            psn,
            rkey: mr.rkey(),
            vaddr: mr.addr() + q as u64 * 2 * area,
            gid,
            srqn: 0,
        })
        .collect();
    let mut remotes = Vec::with_capacity(nq);
    for k in &mine {
        remotes.push(ch.keys(k)?);
    }
    if via_cm.is_none() {
        tool::check_peer_gid(&gid, &remotes[0].gid)?;
    }
    // Without -R: each queue pair to RTS with the peer's keys (with -R there are none to arm).
    let mut qps = Vec::with_capacity(nq);
    for (qp, r) in inits.into_iter().zip(&remotes) {
        tool::check_peer_gid(&gid, &r.gid)?;
        qps.push(tool::arm(
            qp,
            &Arm {
                remote_qpn: r.qpn,
                remote_psn: r.psn,
                remote_gid: r.gid,
                remote_lid: r.lid,
                mtu,
                sgid_index: gid_index,
                port: o.port,
                max_dest_rd_atomic: out_reads as u8,
                max_rd_atomic: (r.out_reads as u32).clamp(1, limits.max_rd_atomic.max(1)) as u8,
                hop_limit: 64,
            },
        )?);
    }
    let (qps, links) = match via_cm {
        Some(c) => (c.qps, c.links),
        None => (qps, Vec::new()),
    };
    let side = Side {
        qps,
        _links: links,
        cq,
        mr,
        base,
        area,
        remotes,
        inline_max,
        ctx,
        mtu,
        gid_index,
    };
    if !o.quiet {
        print_banner(o, &side, ch.name(), &mine);
    }
    match o.test {
        Test::Bw => bw::phases(o, &side, ch, role, &mine),
        Test::Lat => lat::phases(o, &side, ch, role, &mine),
    }
}

fn print_banner(o: &Options, s: &Side, oob: &str, mine: &[Keys]) {
    let fields = [
        ("Dual-port", "OFF".to_string()),
        ("Device", s.ctx.name().to_string()),
        ("Number of qps", o.qps.to_string()),
        ("Transport type", s.ctx.transport().to_string()),
        ("Connection type", "RC".to_string()),
        ("Using SRQ", "OFF".to_string()),
        ("TX depth", o.tx_depth.to_string()),
        ("Mtu", format!("{}[B]", s.mtu.bytes())),
        ("Link type", "Ethernet".to_string()),
        ("GID index", s.gid_index.to_string()),
        ("Max inline data", format!("{}[B]", s.inline_max)),
        (
            "rdma_cm QPs",
            if o.rdma_cm { "ON" } else { "OFF" }.to_string(),
        ),
        ("Data ex. method", oob.to_string()),
    ];
    println!("{}", report::banner(&title(o), &fields));
    for (side, k) in [("local", &mine[0]), ("remote", &s.remotes[0])] {
        println!(
            " {side} address: LID {:#06x} QPN {:#08x} PSN {:#08x} RKey {:#010x} VAddr {:#018x}",
            k.lid, k.qpn, k.psn, k.rkey, k.vaddr
        );
        println!(" GID: {}", k.gid);
    }
    println!("{}", report::RULE);
}

/// Posts `depth` receives of a whole area on queue pair `q` (every size of a sweep fits).
pub(super) fn post_recvs(s: &Side, q: usize, depth: u32) -> erdma::Result<()> {
    let sge = [recv_sge(s, q)];
    let wrs: Vec<RawRecvWr<'_>> = (0..depth)
        .map(|i| RawRecvWr {
            wr_id: i as u64,
            sges: &sge,
        })
        .collect();
    // `Side` drops the queue pairs first; the CPU leaves the target areas alone meanwhile.
    // SAFETY: the SGE lies in `s.mr`, which outlives the queue pairs.
    unsafe { s.qps[q].post_recv_raw(&wrs) }
}

fn recv_sge(s: &Side, q: usize) -> Sge {
    Sge {
        addr: s.target(q),
        length: s.area as u32,
        lkey: s.mr.lkey(),
    }
}

/// Reposts one receive on queue pair `q`.
pub(super) fn repost(s: &Side, q: usize) -> erdma::Result<()> {
    let sge = [recv_sge(s, q)];
    let wr = [RawRecvWr {
        wr_id: 0,
        sges: &sge,
    }];
    // SAFETY: as in `post_recvs`.
    unsafe { s.qps[q].post_recv_raw(&wr) }
}

/// Waits, as the side that does not drive the run, until the peer ends it (its next message is
/// waiting on the channel); with `serve`, keeps receives posted on every queue pair meanwhile
/// (SEND bandwidth, server side) and returns how many completed.
///
/// There is no deadline: a run lasts what the peer's flags make it. A peer whose traffic stops
/// for [`STALL`] before it speaks has gone (a stopped process, a broken path) — traffic is
/// what completes here, or, where the device counts them, the packets its port receives. A peer
/// host that vanishes without a word is found by the connection's keepalive.
pub(super) fn await_peer(s: &Side, port: u8, ch: &dyn Channel, serve: bool) -> erdma::Result<u64> {
    let rx_packets = || {
        s.ctx
            .port_counters(port)
            .ok()
            .and_then(|c| c.get(erdma::soft::counter::RCVD_PKTS))
    };
    let mut wcs = [Completion::default(); 64];
    let mut received = 0u64;
    let mut seen = rx_packets();
    let mut last_traffic = Instant::now();
    let mut next_look = last_traffic;
    loop {
        let n = if serve {
            s.cq.poll_wait(&mut wcs, Duration::from_millis(5))?
        } else {
            std::thread::sleep(Duration::from_millis(5));
            0
        };
        for c in &wcs[..n] {
            let c = c.ok()?;
            if let Some(q) = s.qp_index(c.qp_num) {
                repost(s, q)?;
            }
        }
        received += n as u64;
        if n > 0 {
            last_traffic = Instant::now();
            continue;
        }
        if ch.peer_spoke() {
            return Ok(received);
        }
        let now = Instant::now();
        if now < next_look {
            continue;
        }
        next_look = now + Duration::from_millis(250);
        let counted = rx_packets();
        if counted != seen {
            seen = counted;
            last_traffic = now;
        } else if (serve || seen.is_some()) && now.duration_since(last_traffic) > STALL {
            return Err(erdma::Error::Timeout {
                what: format!(
                    "the client's run: no traffic for {} s and no word from the client",
                    STALL.as_secs()
                ),
            });
        }
    }
}

/// Fails when nothing has completed for this long: the peer is gone or the path is broken.
pub(super) const STALL: Duration = Duration::from_secs(10);

pub(super) fn stalled(what: &str, done: u64, want: u64) -> erdma::Error {
    erdma::Error::Timeout {
        what: format!(
            "{what}: stalled at {done} of {want}, nothing completed for {} s",
            STALL.as_secs()
        ),
    }
}

/// `len` zeroed bytes of heap memory, every 4 KiB page written once (a C program's buffer after
/// its `memset`), with no advice for huge pages.
fn small_pages(len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    // `vec!` of zeroes maps fresh pages that read as zero without existing yet: write each
    // (a value the compiler cannot see is the zero already there).
    for b in v.iter_mut().step_by(4096) {
        *b = std::hint::black_box(0);
    }
    v
}
