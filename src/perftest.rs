//! One engine for the perftest-style tools: RDMA WRITE, SEND and READ, each as a bandwidth or a
//! latency test, as server, client or both in one process (`--loopback`).
//!
//! The phases follow perftest 4.5 (`ib_write_bw` for bandwidth, `ib_send_lat` for latency), so
//! with the perftest out-of-band format (the default) `write_bw` and `send_lat` face the C tools
//! in either role; `--oob erdma` carries the same phases in the project's own format instead,
//! whose setup message also carries `-s -n -q -a -D`, so that two ends started differently are
//! refused by name instead of running out of step.
//!
//! The data path uses the SDK's raw posting (one doorbell per batch, no per-request allocation):
//! the buffers are registered once, owned by the test and never touched by the CPU while a
//! request on them is outstanding, except for the single flag byte of the WRITE latency test.

use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use erdma::connect::compat::perftest::{self as pt, BwReport, Keys, Role};
use erdma::connect::{self, Listener, PeerInfo};
use erdma::{
    Access, Completion, Context, Cq, InitAttr, Mr, Mtu, ProviderKind, Qp, QpConfig, QpEndpoint,
    RawRecvWr, RawSendWr, RemoteMr, Rts, SendFlags, Sge, WrOpcode,
};

use crate::cli::{Args, Spec};
use crate::report::{self, BwRow, BwUnit, LatSamples};
use crate::tool::{self, Arm, ToolError, bad_value};

mod cm;

/// The operation a test measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    /// RDMA WRITE.
    Write,
    /// SEND / RECV.
    Send,
    /// RDMA READ.
    Read,
}

/// What a test measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Test {
    /// Bandwidth and message rate.
    Bw,
    /// Latency.
    Lat,
}

/// Which out-of-band format carries the connection phases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Oob {
    /// perftest 4.5's default exchange: talks to `ib_write_bw`, `ib_send_lat`, ...
    Perftest,
    /// The project's own format ([`erdma::connect`]).
    Erdma,
}

/// Largest message of an `-a` sweep (perftest's 2^23).
pub const SWEEP_MAX: u64 = 1 << 23;

/// A tool's settings, parsed from its command line.
#[derive(Debug, Clone)]
pub struct Options {
    /// Operation.
    pub verb: Verb,
    /// Bandwidth or latency.
    pub test: Test,
    /// Device of this side (the client side with `--loopback`).
    pub dev: Option<String>,
    /// Device of the server side with `--loopback`.
    pub peer_dev: Option<String>,
    /// Port.
    pub port: u8,
    /// GID index (`-x`), automatic when `None`.
    pub gid_index: Option<u8>,
    /// Message size.
    pub size: u64,
    /// Iterations per queue pair (per size).
    pub iters: u64,
    /// `-a`: every power of two from 2 to 2^23.
    pub all: bool,
    /// Queue pairs (bandwidth tests).
    pub qps: u32,
    /// Run for this long instead of `iters`.
    pub duration: Option<Duration>,
    /// Largest message sent inline.
    pub inline: u32,
    /// Path MTU (`-m`), the port's active MTU when `None`.
    pub mtu: Option<Mtu>,
    /// TCP port of the out-of-band exchange.
    pub tcp_port: u16,
    /// Send queue depth.
    pub tx_depth: u32,
    /// Receive queue depth (SEND tests).
    pub rx_depth: u32,
    /// Work requests per post call (bandwidth tests).
    pub post_list: u32,
    /// Bandwidth in Gbit/s instead of MiB/s.
    pub gbits: bool,
    /// The server to connect to (client role).
    pub server: Option<String>,
    /// Both ends in this process.
    pub loopback: bool,
    /// Out-of-band format.
    pub oob: Oob,
    /// Time each connection step may take.
    pub step_timeout: Duration,
    /// Print nothing (the server half of `--loopback`).
    pub quiet: bool,
    /// `-R`: connect the queue pairs through rdma_cm (the only way on iWARP devices).
    pub rdma_cm: bool,
}

impl Options {
    /// The tool's name, as perftest would call it without the `ib_` prefix.
    pub fn tool_name(&self) -> String {
        format!("{}_{}", verb_word(self.verb), test_word(self.test))
    }

    /// The sizes to run.
    pub fn sizes(&self) -> Vec<u64> {
        if self.all {
            (1..24).map(|i| 1u64 << i).collect()
        } else {
            vec![self.size]
        }
    }

    fn max_size(&self) -> u64 {
        if self.all { SWEEP_MAX } else { self.size }
    }
}

fn verb_word(v: Verb) -> &'static str {
    match v {
        Verb::Write => "write",
        Verb::Send => "send",
        Verb::Read => "read",
    }
}

fn test_word(t: Test) -> &'static str {
    match t {
        Test::Bw => "bw",
        Test::Lat => "lat",
    }
}

fn title(o: &Options) -> String {
    let v = match o.verb {
        Verb::Write => "RDMA_Write",
        Verb::Send => "Send",
        Verb::Read => "RDMA_Read",
    };
    let t = match o.test {
        Test::Bw => "BW",
        Test::Lat => "Latency",
    };
    format!("{v} {t} Test")
}

/// The flags every perftest-style tool accepts.
pub const SPECS: &[Spec] = &[
    Spec::opt(
        Some('d'),
        "ib-dev",
        "dev",
        "device (rxe0, erdma_0, soft:10.0.0.1); default: the first device",
    ),
    Spec::opt(
        None,
        "peer-dev",
        "dev",
        "--loopback: the server's device (default soft:127.0.0.2)",
    ),
    Spec::opt(Some('i'), "ib-port", "port", "device port (default 1)"),
    Spec::opt(
        Some('x'),
        "gid-index",
        "index",
        "local GID index (default: the IPv4 RoCE v2 GID)",
    ),
    Spec::opt(
        Some('s'),
        "size",
        "bytes",
        "message size (default 65536 for bw, 2 for lat; K/M/G suffixes)",
    ),
    Spec::opt(
        Some('n'),
        "iters",
        "count",
        "iterations per size and queue pair (default 5000 bw, 1000 lat)",
    ),
    Spec::switch(Some('a'), "all", "every size from 2 to 2^23 bytes"),
    Spec::opt(
        Some('q'),
        "qp",
        "count",
        "queue pairs (bandwidth tests; default 1)",
    ),
    Spec::opt(
        Some('D'),
        "duration",
        "secs",
        "run for this long instead of -n iterations",
    ),
    Spec::opt(
        Some('I'),
        "inline_size",
        "bytes",
        "largest message sent inline (default 0 bw, 64 lat)",
    ),
    Spec::opt(
        Some('m'),
        "mtu",
        "bytes",
        "path MTU 256..4096 (default: the port's active MTU, the smaller of both ends)",
    ),
    Spec::opt(
        Some('p'),
        "port",
        "port",
        "TCP port of the connection exchange (default 18515; a server given 0 takes a free one and prints it)",
    ),
    Spec::opt(
        Some('t'),
        "tx-depth",
        "count",
        "send queue depth (default 128)",
    ),
    Spec::opt(
        Some('l'),
        "post_list",
        "count",
        "bandwidth tests: work requests per post call (default 1, as perftest)",
    ),
    Spec::opt(
        Some('r'),
        "rx-depth",
        "count",
        "receive queue depth, SEND tests (default 512)",
    ),
    Spec::switch(None, "report_gbits", "bandwidth in Gb/s instead of MB/s"),
    Spec::switch(
        None,
        "loopback",
        "server and client in this process on two soft devices (what no arguments does)",
    ),
    Spec::opt(
        None,
        "oob",
        "format",
        "connection exchange: perftest (default; talks to the C ib_* tools) or erdma",
    ),
    Spec::opt(None, "compat", "format", "same as --oob"),
    Spec::opt(
        None,
        "timeout",
        "secs",
        "time each connection step may take (default 15)",
    ),
    Spec::switch(
        Some('F'),
        "CPU-freq",
        "accepted for perftest compatibility (no effect)",
    ),
    Spec::switch(
        Some('R'),
        "rdma_cm",
        "connect the queue pairs through rdma_cm (needed on iWARP devices); both ends",
    ),
];

fn about(verb: Verb, test: Test) -> String {
    let what = match (verb, test) {
        (Verb::Write, Test::Bw) => "RDMA WRITE bandwidth",
        (Verb::Write, Test::Lat) => "RDMA WRITE latency (ping-pong)",
        (Verb::Send, Test::Bw) => "SEND bandwidth",
        (Verb::Send, Test::Lat) => "SEND latency (ping-pong)",
        (Verb::Read, Test::Bw) => "RDMA READ bandwidth",
        (Verb::Read, Test::Lat) => "RDMA READ latency",
    };
    format!(
        "{what}, like perftest's ib_{v}_{t}.\n\n\
         Usage:\n  \
         {v}_{t}                        both ends in this process on soft:127.0.0.1 and soft:127.0.0.2\n  \
         {v}_{t} --loopback [-d A --peer-dev B]   the same, on devices of your choice\n  \
         {v}_{t} -d DEV [options]       server: waits for a client on TCP port -p\n  \
         {v}_{t} -d DEV [options] HOST  client: connects to HOST\n\n\
         The connection exchange is perftest's own by default, so either end can be the C\n\
         ib_{v}_{t} (start both with the same -s/-n/-a); --oob erdma uses the project's format.",
        v = verb_word(verb),
        t = test_word(test)
    )
}

/// Parses a perftest-style command line.
///
/// # Errors
/// A [`ToolError::Cli`] naming the flag and what was wrong (`--help` included).
pub fn parse(verb: Verb, test: Test, argv: &[String]) -> Result<Options, ToolError> {
    let name = format!("{}_{}", verb_word(verb), test_word(test));
    let a = Args::parse(&name, &about(verb, test), SPECS, 1, argv.iter().cloned())?;
    let bw = test == Test::Bw;
    let size: u64 = a.get("size", if bw { 65536 } else { 2 })?;
    if size == 0 || size > u32::MAX as u64 {
        return Err(bad_value("--size", size, "a size in 1..=4294967295"));
    }
    let iters: u64 = a.get("iters", if bw { 5000 } else { 1000 })?;
    if iters == 0 {
        return Err(bad_value("--iters", iters, "at least 1"));
    }
    let qps: u32 = a.get("qp", 1)?;
    if qps == 0 || qps > 1024 {
        return Err(bad_value("--qp", qps, "a count in 1..=1024"));
    }
    if qps > 1 && !bw {
        return Err(bad_value(
            "--qp",
            qps,
            "1 (latency tests use one queue pair)",
        ));
    }
    let duration = a
        .opt::<f64>("duration")?
        .map(|d| tool::parse_secs("--duration", d))
        .transpose()?;
    if duration.is_some() && a.has("all") {
        return Err(bad_value("--duration", "with --all", "combined with -a"));
    }
    let tx_depth: u32 = a.get("tx-depth", 128)?;
    if !(1..=8192).contains(&tx_depth) {
        return Err(bad_value("--tx-depth", tx_depth, "a depth in 1..=8192"));
    }
    let rx_depth: u32 = a.get("rx-depth", 512)?;
    if !(1..=8192).contains(&rx_depth) {
        return Err(bad_value("--rx-depth", rx_depth, "a depth in 1..=8192"));
    }
    let post_list: u32 = a.get("post_list", 1)?;
    if post_list == 0 || post_list > tx_depth {
        return Err(bad_value(
            "--post_list",
            post_list,
            "a count in 1..=the send queue depth",
        ));
    }
    let oob = match a.str("oob").or(a.str("compat")) {
        None | Some("perftest") => Oob::Perftest,
        Some("erdma") => Oob::Erdma,
        Some(other) => return Err(bad_value("--oob", other, "`perftest` or `erdma`")),
    };
    let step_timeout = tool::parse_secs("--timeout", a.get("timeout", 15.0)?)?;
    let server = a.positional().first().cloned();
    let loopback = tool::loopback_mode(&a, argv.is_empty(), server.as_deref())?;
    let rdma_cm = a.has("rdma_cm");
    if rdma_cm && (loopback || oob == Oob::Erdma) {
        return Err(bad_value(
            "--rdma_cm",
            "with --loopback or --oob erdma",
            "a server and a client in perftest's exchange (-R carries it over rdma_cm)",
        ));
    }
    let tcp_port: u16 = a.get("port", connect::compat::DEFAULT_PORT)?;
    // A client given `host:port` dials that port, not `--port`.
    let dials_port = server
        .as_deref()
        .is_some_and(|s| s.parse::<std::net::SocketAddr>().is_err());
    tool::check_port(tcp_port, dials_port)?;
    Ok(Options {
        verb,
        test,
        dev: a.str("ib-dev").map(str::to_string),
        peer_dev: a.str("peer-dev").map(str::to_string),
        port: a.get("ib-port", 1)?,
        gid_index: a.opt("gid-index")?,
        size,
        iters,
        all: a.has("all"),
        qps,
        duration,
        inline: a.get("inline_size", if bw { 0 } else { 64 })?,
        mtu: tool::parse_mtu("--mtu", a.opt("mtu")?)?,
        tcp_port,
        tx_depth,
        rx_depth,
        post_list,
        gbits: a.has("report_gbits"),
        server,
        loopback,
        oob,
        step_timeout,
        quiet: false,
        rdma_cm,
    })
}

/// Entry point of a tool: parses `argv` (without the program name), runs, and maps the outcome to
/// an exit status (2 for a refused command line, 1 for a failed run).
pub fn main(verb: Verb, test: Test) -> std::process::ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let name = format!("{}_{}", verb_word(verb), test_word(test));
    let result = parse(verb, test, &argv).and_then(|o| run(&o).map_err(ToolError::Run));
    tool::exit_with(&name, result)
}

/// Runs a test as the options say: loopback, server or client.
///
/// # Errors
/// Whatever failed, as an [`erdma::Error`].
pub fn run(o: &Options) -> erdma::Result<()> {
    if o.rdma_cm {
        return cm::run(o);
    }
    if o.loopback {
        let listener = Listener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let mut server = o.clone();
        server.dev = Some(
            o.peer_dev
                .clone()
                .unwrap_or_else(|| "soft:127.0.0.2".to_string()),
        );
        server.quiet = true;
        server.server = None;
        let mut client = o.clone();
        client.dev = Some(
            o.dev
                .clone()
                .unwrap_or_else(|| "soft:127.0.0.1".to_string()),
        );
        client.server = Some(addr.to_string());
        // Both devices open before either side starts: a device that cannot open is the
        // error reported, not the other side's wait for a peer that never comes.
        let server_ctx = open(&server)?;
        let client_ctx = open(&client)?;
        let s = std::thread::spawn(move || {
            let (stream, _) = listener.accept(server.step_timeout)?;
            // Its port is free again for rdma_cm's listener (-R on iWARP listens in TCP).
            drop(listener);
            run_connected(&server, server_ctx, stream, Role::Server)
        });
        let c = dial(&client)
            .and_then(|stream| run_connected(&client, client_ctx, stream, Role::Client));
        if c.is_err() {
            // A server still waiting for the connection takes this one, and fails at once.
            let _ = TcpStream::connect_timeout(&addr, Duration::from_secs(1));
        }
        let s = s.join().unwrap_or_else(|_| {
            Err(erdma::Error::InvalidArgument(
                "server thread panicked".into(),
            ))
        });
        if let (Err(_), Err(e)) = (&c, &s) {
            // Either may be the cause; the client's is returned, the server's said first.
            eprintln!("{}: the server side failed too: {e}", o.tool_name());
        }
        c.and(s)
    } else if o.server.is_some() {
        let ctx = open(o)?;
        let stream = dial(o)?;
        run_connected(o, ctx, stream, Role::Client)
    } else {
        let ctx = open(o)?;
        let listener = Listener::bind(("0.0.0.0", o.tcp_port))?;
        // The port bound: the one asked for, or the one the system picked for 0.
        let port = listener.local_addr()?.port();
        if !o.quiet {
            eprintln!("{}: waiting for a client on TCP port {port}", o.tool_name());
        }
        let (stream, peer) = listener.accept(Duration::from_secs(24 * 3600))?;
        drop(listener);
        if !o.quiet {
            eprintln!("{}: client {peer} connected", o.tool_name());
        }
        run_connected(o, ctx, stream, Role::Server)
    }
}

fn dial(o: &Options) -> erdma::Result<TcpStream> {
    let host = o.server.as_deref().unwrap_or("127.0.0.1");
    let target = if host.contains(':') && host.parse::<std::net::SocketAddr>().is_ok() {
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

/// The connection phases, in either format.
trait Channel {
    /// The setup steps: the path MTU both sides use, and the cycle buffer (the span a
    /// perftest peer moves its remote addresses through for small messages).
    fn setup(&mut self, mtu: Mtu) -> erdma::Result<(Mtu, u64)>;
    fn keys(&mut self, mine: &Keys) -> erdma::Result<Keys>;
    fn report(&mut self, mine: &BwReport) -> erdma::Result<BwReport>;
    fn close(self: Box<Self>, mine: &Keys) -> erdma::Result<()>;
    fn name(&self) -> &'static str;
    /// The TCP stream the phases travel on (none for `-R`'s rdma_cm channel).
    fn stream(&self) -> Option<&TcpStream>;
    /// Whether the peer has sent something not yet read (it ended its run).
    fn peer_spoke(&self) -> bool {
        let Some(s) = self.stream() else {
            return false;
        };
        let mut b = [0u8; 1];
        if s.set_nonblocking(true).is_err() {
            return false;
        }
        let spoke = s.peek(&mut b).is_ok();
        let _ = s.set_nonblocking(false);
        spoke
    }
}

struct PerftestChannel(pt::Session);

impl Channel for PerftestChannel {
    fn setup(&mut self, mtu: Mtu) -> erdma::Result<(Mtu, u64)> {
        let agreed = self.0.setup(mtu)?;
        Ok((agreed.mtu, u64::from(agreed.cycle_buffer)))
    }
    fn keys(&mut self, mine: &Keys) -> erdma::Result<Keys> {
        self.0.hand_shake(mine)
    }
    fn report(&mut self, mine: &BwReport) -> erdma::Result<BwReport> {
        self.0.xchg_bw_report(mine)
    }
    fn close(self: Box<Self>, mine: &Keys) -> erdma::Result<()> {
        self.0.close(mine)
    }
    fn name(&self) -> &'static str {
        "Ethernet (perftest)"
    }
    fn stream(&self) -> Option<&TcpStream> {
        Some(self.0.stream())
    }
}

/// The same phases over [`erdma::connect::exchange`]: the setup carries the tool's name (so two
/// different tools refuse each other) and the MTU; keys travel as an endpoint and a region.
struct ErdmaChannel {
    stream: TcpStream,
    tool: String,
    timeout: Duration,
    /// The flags both ends must agree on, as `-s 65536 -n 5000 ...` words.
    flags: Vec<(&'static str, String)>,
}

/// The flags both ends of a run must agree on (our own format carries them; perftest's cannot).
fn agreed_flags(o: &Options) -> Vec<(&'static str, String)> {
    vec![
        ("-s", o.size.to_string()),
        ("-n", o.iters.to_string()),
        ("-q", o.qps.to_string()),
        ("-a", u8::from(o.all).to_string()),
        (
            "-D",
            o.duration
                .map_or("-".into(), |d| d.as_secs_f64().to_string()),
        ),
    ]
}

const ERDMA_TAG: &str = "erdma-perftest/1";

impl ErdmaChannel {
    fn xchg(&mut self, info: &PeerInfo) -> erdma::Result<PeerInfo> {
        connect::exchange(&mut self.stream, info, self.timeout)
    }
}

fn proto(what: String) -> erdma::Error {
    erdma::Error::Protocol { what }
}

impl Channel for ErdmaChannel {
    fn setup(&mut self, mtu: Mtu) -> erdma::Result<(Mtu, u64)> {
        let mut mine = format!("{ERDMA_TAG} {} {}", self.tool, mtu.as_enum());
        for (flag, value) in &self.flags {
            mine.push_str(&format!(" {flag}={value}"));
        }
        let theirs = self.xchg(&PeerInfo {
            user: mine.into_bytes(),
            ..PeerInfo::default()
        })?;
        let text = String::from_utf8_lossy(&theirs.user).to_string();
        let mut words = text.split(' ');
        if words.next() != Some(ERDMA_TAG) {
            return Err(proto(format!(
                "peer is not an erdma perftest-style tool (it says {text:?})"
            )));
        }
        let tool = words.next().unwrap_or("");
        if tool != self.tool {
            return Err(proto(format!(
                "peer runs {tool}, this side runs {}",
                self.tool
            )));
        }
        let remote = words
            .next()
            .and_then(|m| m.parse::<u32>().ok())
            .and_then(Mtu::from_enum)
            .ok_or_else(|| proto(format!("peer's setup message {text:?} has no valid MTU")))?;
        // Then the flags that must match: a mismatch would run out of step, or report numbers
        // of a run the other side did not make.
        for word in words {
            let Some((flag, value)) = word.split_once('=') else {
                return Err(proto(format!("peer's setup message {text:?} has {word:?}")));
            };
            let ours = self.flags.iter().find(|(f, _)| *f == flag);
            if let Some((_, mine)) = ours.filter(|(_, mine)| mine != value) {
                return Err(proto(format!(
                    "the peer runs with {flag} {value}, this side with {flag} {mine}"
                )));
            }
        }
        Ok((mtu.min(remote), u64::from(pt::CYCLE_BUFFER)))
    }
    fn keys(&mut self, mine: &Keys) -> erdma::Result<Keys> {
        let info = PeerInfo {
            endpoints: vec![QpEndpoint {
                qp_num: mine.qpn,
                psn: mine.psn,
                gid: mine.gid,
                lid: mine.lid,
                mtu: Mtu::Mtu4096,
            }],
            regions: vec![RemoteMr {
                addr: mine.vaddr,
                len: 0,
                rkey: mine.rkey,
            }],
            user: mine.out_reads.to_be_bytes().to_vec(),
        };
        let t = self.xchg(&info)?;
        match (
            t.endpoints.as_slice(),
            t.regions.as_slice(),
            t.user.as_slice(),
        ) {
            ([e], [r], [a, b]) => Ok(Keys {
                lid: e.lid,
                out_reads: u16::from_be_bytes([*a, *b]),
                qpn: e.qp_num,
                psn: e.psn,
                rkey: r.rkey,
                vaddr: r.addr,
                gid: e.gid,
                srqn: 0,
            }),
            _ => Err(proto(format!(
                "peer's keys message has {} endpoints, {} regions and {} user bytes (want 1, 1, 2)",
                t.endpoints.len(),
                t.regions.len(),
                t.user.len()
            ))),
        }
    }
    fn report(&mut self, mine: &BwReport) -> erdma::Result<BwReport> {
        let mut user = Vec::with_capacity(40);
        user.extend_from_slice(&mine.size.to_be_bytes());
        user.extend_from_slice(&mine.iters.to_be_bytes());
        user.extend_from_slice(&mine.bw_peak.to_be_bytes());
        user.extend_from_slice(&mine.bw_avg.to_be_bytes());
        user.extend_from_slice(&mine.msg_rate.to_be_bytes());
        let t = self.xchg(&PeerInfo {
            user,
            ..PeerInfo::default()
        })?;
        if t.user.len() != 40 {
            return Err(proto(format!(
                "peer's report is {} bytes, expected 40",
                t.user.len()
            )));
        }
        let w = |i: usize| -> [u8; 8] { t.user[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]) };
        let f = |i: usize, what: &str| -> erdma::Result<f64> {
            let v = f64::from_be_bytes(w(i));
            if v.is_finite() && v >= 0.0 {
                Ok(v)
            } else {
                Err(proto(format!(
                    "peer's report: {what} {v} is not a non-negative number"
                )))
            }
        };
        Ok(BwReport {
            size: u64::from_be_bytes(w(0)),
            iters: u64::from_be_bytes(w(1)),
            bw_peak: f(2, "peak bandwidth")?,
            bw_avg: f(3, "average bandwidth")?,
            msg_rate: f(4, "message rate")?,
        })
    }
    fn close(mut self: Box<Self>, mine: &Keys) -> erdma::Result<()> {
        self.keys(mine).map(|_| ())
    }
    fn name(&self) -> &'static str {
        "Ethernet (erdma)"
    }
    fn stream(&self) -> Option<&TcpStream> {
        Some(&self.stream)
    }
}

/// One side's resources: device, queues, and one registered buffer holding, per queue pair, a
/// target area (what the peer writes, reads or sends into) and a source area.
struct Side {
    // Queue pairs first: they are destroyed before the region they use.
    qps: Vec<Qp<Rts>>,
    cq: Cq,
    mr: Mr<'static>,
    base: *mut u8,
    area: u64,
    remotes: Vec<Keys>,
    inline_max: u32,
    ctx: Context,
    mtu: Mtu,
    gid_index: u8,
    /// `-R`: the rdma_cm connections the queue pairs live on (disconnected when dropped).
    _links: Vec<erdma::connect::cm::Connection>,
}

impl Side {
    /// Start of queue pair `q`'s target area.
    fn target(&self, q: usize) -> u64 {
        self.mr.addr() + q as u64 * 2 * self.area
    }

    /// Start of queue pair `q`'s source area.
    fn source(&self, q: usize) -> u64 {
        self.target(q) + self.area
    }

    fn qp_index(&self, qp_num: u32) -> Option<usize> {
        self.qps.iter().position(|q| q.qp_num() == qp_num)
    }
}

/// Opens the device, and checks the message size against it before anything is allocated or
/// connected.
fn open(o: &Options) -> erdma::Result<Context> {
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

fn run_connected(o: &Options, ctx: Context, stream: TcpStream, role: Role) -> erdma::Result<()> {
    // The passive side waits for the peer's run without a deadline: a vanished peer host is
    // found by keepalive, a broken path by `await_peer`'s stall rule.
    tool::keepalive(&stream)?;
    let ch: Box<dyn Channel> = match o.oob {
        Oob::Perftest => Box::new(PerftestChannel(pt::Session::new(
            stream,
            role,
            o.step_timeout,
        ))),
        Oob::Erdma => Box::new(ErdmaChannel {
            stream,
            tool: o.tool_name(),
            timeout: o.step_timeout,
            flags: agreed_flags(o),
        }),
    };
    run_channel(o, ctx, ch, role, None)
}

/// The run over an established channel; `cm_ends` (`-R`): the channel's local and peer
/// addresses, where the queue pairs' rdma_cm connections go.
fn run_channel(
    o: &Options,
    ctx: Context,
    mut ch: Box<dyn Channel>,
    role: Role,
    cm_ends: Option<(std::net::SocketAddr, std::net::SocketAddr)>,
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
    let mut mr = pd.alloc(
        len,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    )?;
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
            inits.push(qp.init(&InitAttr {
                port: o.port,
                ..InitAttr::default()
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
        cq,
        mr,
        base,
        area,
        remotes,
        inline_max,
        ctx,
        mtu,
        gid_index,
        _links: links,
    };
    if !o.quiet {
        print_banner(o, &side, ch.name(), &mine);
    }
    match o.test {
        Test::Bw => bw_phases(o, &side, ch, role, &mine),
        Test::Lat => lat_phases(o, &side, ch, role, &mine),
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

fn unit(o: &Options) -> BwUnit {
    if o.gbits { BwUnit::Gbps } else { BwUnit::MiBps }
}

fn bw_phases(
    o: &Options,
    s: &Side,
    mut ch: Box<dyn Channel>,
    role: Role,
    mine: &[Keys],
) -> erdma::Result<()> {
    let receiver = o.verb == Verb::Send && role == Role::Server;
    if receiver {
        // Before the client can send: it starts right after the exchanges below.
        for q in 0..s.qps.len() {
            post_recvs(s, q, s.qps[q].caps().max_recv_wr)?;
        }
    }
    // perftest: the keys again per queue pair, then one more exchange after the transition.
    for k in mine {
        ch.keys(k)?;
    }
    ch.keys(&mine[0])?;
    let u = unit(o);
    if !o.quiet {
        println!("{}", report::bw_header(u));
    }
    match role {
        Role::Server => {
            // The peer runs now; its end is the next exchange.
            let received = await_peer(s, o.port, &*ch, receiver)?;
            if receiver && received == 0 {
                return Err(erdma::Error::Protocol {
                    what: "the client ended its run without a single SEND: is it running a \
                           SEND bandwidth test?"
                        .into(),
                });
            }
            ch.keys(&mine[0])?;
            let theirs = ch.report(&BwReport::default())?;
            if !o.sizes().contains(&theirs.size) {
                return Err(erdma::Error::Protocol {
                    what: format!(
                        "the client measured {} B messages; this server was started for {}",
                        theirs.size,
                        size_list(o)
                    ),
                });
            }
            if !o.quiet {
                // The client measured; its numbers are in its unit, printed as perftest does.
                println!(
                    " {:<10} {:<10}       {:>10.2}         {:>10.2}\t\t   {:.6}",
                    theirs.size, theirs.iters, theirs.bw_peak, theirs.bw_avg, theirs.msg_rate
                );
                println!("{}", report::RULE);
            }
            ch.close(&mine[0])
        }
        Role::Client => {
            let sizes = o.sizes();
            let mut last = None;
            for (i, &size) in sizes.iter().enumerate() {
                if o.all && !o.quiet {
                    eprintln!("{}: size {size} ({}/{})", o.tool_name(), i + 1, sizes.len());
                }
                if o.verb != Verb::Send {
                    // perftest warms up before it measures WRITE and READ: one queue's worth.
                    let depth = s.qps[0].caps().max_send_wr.max(1) as u64;
                    bw_run(o, s, size, Some(depth.min(o.iters)))?;
                }
                let row = bw_run(o, s, size, None)?;
                if !o.quiet {
                    println!("{}", report::bw_line(&row, u));
                }
                last = Some(row);
            }
            if !o.quiet {
                println!("{}", report::RULE);
            }
            ch.keys(&mine[0])?;
            let row = last.unwrap_or(BwRow {
                bytes: o.size,
                iters: 0,
                peak: 0.0,
                avg: 0.0,
                msg_rate: 0.0,
            });
            ch.report(&BwReport {
                size: row.bytes,
                iters: row.iters,
                bw_peak: u.convert(row.peak),
                bw_avg: u.convert(row.avg),
                msg_rate: row.msg_rate / 1e6,
            })?;
            ch.close(&mine[0])
        }
    }
}

/// Posts `depth` receives of a whole area on queue pair `q` (every size of a sweep fits).
fn post_recvs(s: &Side, q: usize, depth: u32) -> erdma::Result<()> {
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
fn repost(s: &Side, q: usize) -> erdma::Result<()> {
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
fn await_peer(s: &Side, port: u8, ch: &dyn Channel, serve: bool) -> erdma::Result<u64> {
    let rx_packets = || {
        s.ctx
            .port_counters(port)
            .ok()
            .and_then(|c| c.get(erdma::counter::RCVD_PKTS))
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

/// The largest cycle buffer a peer may agree on: 64 KiB, the largest common page size.
const MAX_CYCLE_BUFFER: u64 = 1 << 16;

/// The sizes a run was started for, in words.
fn size_list(o: &Options) -> String {
    match o.sizes().as_slice() {
        [one] => format!("{one} B"),
        [first, .., last] => format!("{first}..={last} B"),
        [] => "no size".into(),
    }
}

/// Fails when nothing has completed for this long: the peer is gone or the path is broken.
const STALL: Duration = Duration::from_secs(10);

fn stalled(what: &str, done: u64, want: u64) -> erdma::Error {
    erdma::Error::Timeout {
        what: format!(
            "{what}: stalled at {done} of {want}, nothing completed for {} s",
            STALL.as_secs()
        ),
    }
}

/// One bandwidth run at one size on every queue pair; the client side. `warm_up` replaces the
/// iteration count and duration (and quiets progress).
fn bw_run(o: &Options, s: &Side, size: u64, warm_up: Option<u64>) -> erdma::Result<BwRow> {
    let nq = s.qps.len();
    let depth = s.qps[0].caps().max_send_wr.max(1) as u64;
    let cq_mod = depth.min(100);
    let opcode = match o.verb {
        Verb::Write => WrOpcode::RdmaWrite,
        Verb::Send => WrOpcode::Send,
        Verb::Read => WrOpcode::RdmaRead,
    };
    let inline = opcode != WrOpcode::RdmaRead && size <= s.inline_max as u64;
    let sges: Vec<Sge> = (0..nq)
        .map(|q| Sge {
            addr: if opcode == WrOpcode::RdmaRead {
                s.target(q)
            } else {
                s.source(q)
            },
            length: size as u32,
            lkey: s.mr.lkey(),
        })
        .collect();
    let mut posted = vec![0u64; nq];
    let mut done = vec![0u64; nq];
    // With -D the target is fixed when time is up (rounded to the signalling interval).
    let duration = if warm_up.is_some() { None } else { o.duration };
    let iters = warm_up.unwrap_or(o.iters);
    let mut target: Vec<Option<u64>> = vec![duration.map_or(Some(iters), |_| None); nq];
    let start = Instant::now();
    let end = duration.map(|d| start + d);
    let mut idle = 0u32;
    // (when, messages completed so far) at each poll that completed some, and (when, messages
    // posted so far) at each post: the peak's windows run from a message's post to a later
    // one's completion. Both stop growing at `SAMPLES` entries (long `-D` runs).
    let mut samples: Vec<(Instant, u64)> = vec![(start, 0)];
    let mut posts: Vec<(Instant, u64)> = Vec::new();
    let mut last_done = start;
    let mut wcs = [Completion::default(); 64];
    let mut batch: Vec<RawSendWr<'_>> = Vec::with_capacity(cq_mod as usize);
    let mut last_progress = start;
    let mut next_report = start + Duration::from_secs(2);
    loop {
        if let Some(end) = end {
            if target[0].is_none() && Instant::now() >= end {
                for (q, t) in target.iter_mut().enumerate() {
                    if t.is_none() {
                        *t = Some(posted[q].div_ceil(cq_mod).max(1) * cq_mod);
                    }
                }
            }
        }
        for q in 0..nq {
            let outstanding = posted[q] - done[q];
            let limit = target[q].unwrap_or(u64::MAX);
            let room = (depth - outstanding).min(limit - posted[q]).min(cq_mod);
            if room == 0 {
                continue;
            }
            let room = room.min(o.post_list as u64);
            batch.clear();
            for i in 0..room {
                let seq = posted[q] + i;
                let mut flags = SendFlags::empty();
                if (seq + 1) % cq_mod == 0 || Some(seq + 1) == target[q] {
                    flags |= SendFlags::SIGNALED;
                }
                if inline {
                    flags |= SendFlags::INLINE;
                }
                let mut wr = RawSendWr::new(seq, opcode, std::slice::from_ref(&sges[q]));
                wr.flags = flags;
                wr.remote = RemoteMr {
                    addr: s.remotes[q].vaddr,
                    len: size,
                    rkey: s.remotes[q].rkey,
                };
                batch.push(wr);
            }
            // Sources are never written and READ targets never read by the CPU during the test.
            // SAFETY: the SGEs lie in `s.mr`, which outlives the queue pairs.
            unsafe { s.qps[q].post_send_raw(&batch)? };
            posted[q] += room;
            if posts.len() < SAMPLES {
                posts.push((Instant::now(), posted.iter().sum()));
            }
        }
        let n = s.cq.poll(&mut wcs)?;
        if n > 0 {
            let now = Instant::now();
            for c in &wcs[..n] {
                let c = c.ok()?;
                if let Some(q) = s.qp_index(c.qp_num) {
                    done[q] = done[q].max(c.wr_id + 1);
                }
            }
            last_progress = now;
            last_done = now;
            if samples.len() < SAMPLES {
                samples.push((now, done.iter().sum()));
            }
            if (duration.is_some() || o.all) && warm_up.is_none() && now >= next_report && !o.quiet
            {
                let total: u64 = done.iter().sum();
                let secs = now.duration_since(start).as_secs_f64();
                eprintln!(
                    "{}: {:.1} s, {} messages, {:.2} {}",
                    o.tool_name(),
                    secs,
                    total,
                    unit(o).convert(total as f64 * size as f64 / secs),
                    unit(o).label()
                );
                next_report = now + Duration::from_secs(2);
            }
        } else if {
            idle = idle.wrapping_add(1);
            idle % 1024 == 0
        } && last_progress.elapsed() > STALL
        {
            return Err(stalled(
                "the bandwidth run",
                done.iter().sum(),
                posted.iter().sum(),
            ));
        }
        let finished = (0..nq).all(|q| target[q].is_some_and(|t| done[q] >= t));
        if finished {
            break;
        }
    }
    let elapsed = last_done - start;
    let total: u64 = done.iter().sum();
    let secs = elapsed.as_secs_f64().max(1e-9);
    let avg = total as f64 * size as f64 / secs;
    let window = (total / 20).max(cq_mod);
    Ok(BwRow {
        bytes: size,
        iters: total,
        peak: peak_rate(&samples, &posts, size, window).max(avg),
        avg,
        msg_rate: total as f64 / secs,
    })
}

/// Entries a bandwidth run keeps of its posts and completions, each (16 bytes an entry).
const SAMPLES: usize = 1 << 20;

/// The best bandwidth over windows of at least `window` messages, each timed from the post of
/// its first message to the completion of its last, as perftest times them.
///
/// `done` holds (when, messages completed so far) per completing poll; `posts` (when, messages
/// posted so far) per post. Timing a window from the completion before it instead counted the
/// messages of several queue pairs completing together as if they had taken microseconds.
fn peak_rate(done: &[(Instant, u64)], posts: &[(Instant, u64)], size: u64, window: u64) -> f64 {
    // When message number `n` (0-based, in posting order) was posted.
    let posted_at = |n: u64| -> Option<Instant> {
        let i = posts.partition_point(|p| p.1 <= n);
        posts.get(i).map(|p| p.0)
    };
    let mut best = 0.0f64;
    let mut from = 0;
    for to in 1..done.len() {
        while from + 1 < to && done[to].1 - done[from + 1].1 >= window {
            from += 1;
        }
        let msgs = done[to].1 - done[from].1;
        let Some(first_posted) = posted_at(done[from].1) else {
            continue;
        };
        let dt = done[to]
            .0
            .saturating_duration_since(first_posted)
            .as_secs_f64();
        if msgs >= window && dt > 0.0 {
            best = best.max(msgs as f64 * size as f64 / dt);
        }
    }
    best
}

fn lat_phases(
    o: &Options,
    s: &Side,
    mut ch: Box<dyn Channel>,
    role: Role,
    mine: &[Keys],
) -> erdma::Result<()> {
    // perftest (ib_send_lat): one exchange after the transition, then the keys again.
    ch.keys(&mine[0])?;
    for k in mine {
        ch.keys(k)?;
    }
    if o.verb == Verb::Send {
        // Receives of a whole area fit every size; each is reposted as it is consumed.
        post_recvs(s, 0, o.rx_depth.min(s.qps[0].caps().max_recv_wr))?;
    }
    if !o.quiet {
        println!("{}", report::lat_header());
    }
    let sizes = o.sizes();
    for (i, &size) in sizes.iter().enumerate() {
        if o.all && !o.quiet {
            eprintln!("{}: size {size} ({}/{})", o.tool_name(), i + 1, sizes.len());
        }
        if o.verb == Verb::Write {
            // The previous size finished on both sides and the sync below has not run.
            // SAFETY: nothing outstanding touches this byte of queue pair 0's target area now.
            unsafe { s.base.add(size as usize - 1).write_volatile(0) };
        }
        // The read server does nothing but wait for the client's next sync.
        if o.verb == Verb::Read && role == Role::Server {
            await_peer(s, o.port, &*ch, false)?;
        }
        ch.keys(&mine[0])?;
        let spoke = || role == Role::Server && o.duration.is_some() && ch.peer_spoke();
        let samples = match o.verb {
            Verb::Send => lat_send(o, s, size, role, &spoke)?,
            Verb::Write => lat_write(o, s, size, role, &spoke)?,
            Verb::Read if role == Role::Client => lat_read(o, s, size)?,
            Verb::Read => LatSamples::new(0),
        };
        if let Some(st) = samples.stats(size) {
            if !o.quiet {
                println!("{}", report::lat_line(&st));
            }
        }
    }
    if !o.quiet {
        println!("{}", report::RULE);
    }
    if role == Role::Server {
        // The client writes its closing message first; it may still be running.
        await_peer(s, o.port, &*ch, false)?;
    }
    ch.close(&mine[0])
}

/// Waits for the next receive completion (send completions, signalled or forced, are reaped on
/// the way). `Ok(false)` when `ended` says the peer stopped first (duration runs).
fn wait_recv(
    s: &Side,
    what: &str,
    i: u64,
    iters: u64,
    ended: &dyn Fn() -> bool,
) -> erdma::Result<bool> {
    let mut wcs = [Completion::default(); 16];
    let mut watch = Watchdog::new(what, (i, iters), ended);
    loop {
        let n = s.cq.poll(&mut wcs)?;
        let mut got = false;
        for c in &wcs[..n] {
            let c = c.ok()?;
            if c.opcode.is_recv() {
                got = true;
            }
        }
        if got {
            return Ok(true);
        }
        if n == 0 && !watch.alive()? {
            return Ok(false);
        }
    }
}

/// What a latency loop's wait checks now and then: that it has not waited past [`STALL`], and
/// whether the peer ended a duration run. Looking costs a clock read every 1024 calls and the
/// peer check (three system calls) at most every 10 ms, so the wait stays a tight loop.
struct Watchdog<'a> {
    what: &'a str,
    at: (u64, u64),
    ended: &'a dyn Fn() -> bool,
    start: Instant,
    last_look: Instant,
    calls: u32,
}

impl<'a> Watchdog<'a> {
    fn new(what: &'a str, at: (u64, u64), ended: &'a dyn Fn() -> bool) -> Watchdog<'a> {
        let now = Instant::now();
        Watchdog {
            what,
            at,
            ended,
            start: now,
            last_look: now,
            calls: 0,
        }
    }

    /// `Ok(false)` once the peer has ended; an error past [`STALL`].
    fn alive(&mut self) -> erdma::Result<bool> {
        self.calls = self.calls.wrapping_add(1);
        if self.calls % 1024 != 0 {
            return Ok(true);
        }
        let now = Instant::now();
        if now.duration_since(self.last_look) < Duration::from_millis(10) {
            return Ok(true);
        }
        self.last_look = now;
        if (self.ended)() {
            return Ok(false);
        }
        if now.duration_since(self.start) > STALL {
            return Err(stalled(self.what, self.at.0, self.at.1));
        }
        Ok(true)
    }
}

fn lat_iters(o: &Options) -> u64 {
    if o.duration.is_some() {
        u64::MAX
    } else {
        o.iters
    }
}

/// Half round trips between consecutive stamps (microseconds), as they come.
struct HalfTrips {
    last: Option<Instant>,
    samples: LatSamples,
}

impl HalfTrips {
    fn new(o: &Options) -> HalfTrips {
        HalfTrips {
            last: None,
            samples: LatSamples::new(o.iters),
        }
    }

    fn stamp(&mut self) {
        let now = Instant::now();
        if let Some(prev) = self.last {
            self.samples.push((now - prev).as_secs_f64() * 1e6 / 2.0);
        }
        self.last = Some(now);
    }
}

/// SEND ping-pong: the client sends first; each side sends its next message once the peer's
/// has arrived. The client times round trips.
fn lat_send(
    o: &Options,
    s: &Side,
    size: u64,
    role: Role,
    ended: &dyn Fn() -> bool,
) -> erdma::Result<LatSamples> {
    let qp = &s.qps[0];
    let sge = [Sge {
        addr: s.source(0),
        length: size as u32,
        lkey: s.mr.lkey(),
    }];
    let inline = size <= s.inline_max as u64;
    let iters = lat_iters(o);
    let end = o.duration.map(|d| Instant::now() + d);
    let mut times = HalfTrips::new(o);
    let what = "the SEND latency run";
    let mut i = 0u64;
    while i < iters {
        if role == Role::Server {
            if !wait_recv(s, what, i, iters, ended)? {
                break;
            }
            repost(s, 0)?;
        } else {
            times.stamp();
        }
        let mut wr = RawSendWr::new(i, WrOpcode::Send, &sge);
        if (i + 1) % 100 == 0 || i + 1 == iters {
            wr.flags |= SendFlags::SIGNALED;
        }
        if inline {
            wr.flags |= SendFlags::INLINE;
        }
        // The source area is never written during the test.
        // SAFETY: the SGE lies in `s.mr`, which outlives the queue pair.
        unsafe { qp.post_send_raw(std::slice::from_ref(&wr))? };
        i += 1;
        if role == Role::Client {
            wait_recv(s, what, i, iters, &|| false)?;
            repost(s, 0)?;
            if end.is_some_and(|e| Instant::now() >= e) {
                break;
            }
        }
    }
    times.stamp();
    Ok(times.samples)
}

/// WRITE ping-pong, as perftest's: each side writes a counter into the last byte of the peer's
/// buffer and spins on its own for the peer's answer; every WRITE is signalled, so each asks for
/// its acknowledgement at once (an unacknowledged one would wait for the retransmission timer).
fn lat_write(
    o: &Options,
    s: &Side,
    size: u64,
    role: Role,
    ended: &dyn Fn() -> bool,
) -> erdma::Result<LatSamples> {
    let qp = &s.qps[0];
    let sge = [Sge {
        addr: s.source(0),
        length: size as u32,
        lkey: s.mr.lkey(),
    }];
    let inline = size <= s.inline_max as u64;
    let remote = RemoteMr {
        addr: s.remotes[0].vaddr,
        len: size,
        rkey: s.remotes[0].rkey,
    };
    let iters = lat_iters(o);
    let end = o.duration.map(|d| Instant::now() + d);
    let flag_off = size as usize - 1;
    let post_off = s.area as usize + flag_off;
    // SAFETY: both offsets lie inside queue pair 0's areas of `s.mr` (size <= area).
    let (poll_byte, post_byte) = unsafe { (s.base.add(flag_off), s.base.add(post_off)) };
    let mut times = HalfTrips::new(o);
    let mut wcs = [Completion::default(); 16];
    // On the soft device the thread reaps while it waits for the peer's WRITE (`wait_byte`);
    // elsewhere the loop is perftest's: poll the send queue until this WRITE's completion, then
    // watch memory alone.
    let soft = s.ctx.provider() == ProviderKind::Soft;
    let mut reap_soft = || if soft { reap(s, &mut wcs) } else { Ok(()) };
    let mut i = 0u64;
    while i < iters {
        let expect = (i + 1) as u8;
        if role == Role::Server {
            if !wait_byte(poll_byte, expect, (i, iters), ended, &mut reap_soft)? {
                break;
            }
        } else {
            times.stamp();
        }
        // The previous WRITE from this byte has reached the peer (it answered).
        // SAFETY: the device no longer reads this byte of `s.mr`'s source area.
        unsafe { post_byte.write_volatile(expect) };
        let mut wr = RawSendWr::new(i, WrOpcode::RdmaWrite, &sge);
        wr.remote = remote;
        wr.flags = SendFlags::SIGNALED;
        if inline {
            wr.flags |= SendFlags::INLINE;
        }
        // SAFETY: the SGE lies in `s.mr`, which outlives the queue pair.
        unsafe { qp.post_send_raw(std::slice::from_ref(&wr))? };
        if !soft {
            wait_send(s, "the WRITE latency run", i, iters)?;
        }
        i += 1;
        if role == Role::Client {
            wait_byte(poll_byte, expect, (i, iters), &|| false, &mut reap_soft)?;
            if end.is_some_and(|e| Instant::now() >= e) {
                break;
            }
        }
    }
    times.stamp();
    Ok(times.samples)
}

/// Polls until the request numbered `i` has completed, failing on an error status.
fn wait_send(s: &Side, what: &str, i: u64, iters: u64) -> erdma::Result<()> {
    let mut wcs = [Completion::default(); 16];
    let start = Instant::now();
    loop {
        let n = s.cq.poll(&mut wcs)?;
        if wcs[..n]
            .iter()
            .try_fold(false, |got, c| c.ok().map(|c| got || c.wr_id == i))?
        {
            return Ok(());
        }
        if n == 0 && start.elapsed() > STALL {
            return Err(stalled(what, i, iters));
        }
    }
}

/// Takes every finished send completion off the queue, failing on an error status.
fn reap(s: &Side, wcs: &mut [Completion]) -> erdma::Result<()> {
    loop {
        let n = s.cq.poll(wcs)?;
        for c in &wcs[..n] {
            c.ok()?;
        }
        if n < wcs.len() {
            return Ok(());
        }
    }
}

/// Spins until the peer's WRITE sets `byte` to `want`, calling `reap` between looks.
/// `Ok(false)` when `ended` says the peer stopped first.
///
/// On the soft device `reap` polls the completion queue: that is what lets a polling thread
/// place the peer's WRITE without waking the device's engine thread. Elsewhere it does nothing
/// and the loop is perftest's (its caller waited for the send completion before).
fn wait_byte(
    byte: *mut u8,
    want: u8,
    (i, iters): (u64, u64),
    ended: &dyn Fn() -> bool,
    reap: &mut dyn FnMut() -> erdma::Result<()>,
) -> erdma::Result<bool> {
    let mut watch = Watchdog::new("the WRITE latency run", (i, iters), ended);
    loop {
        // A volatile byte read of memory a device may write concurrently sees either value.
        // SAFETY: `byte` lies in `s.mr`'s target area, which only the peer's WRITEs change.
        if unsafe { byte.read_volatile() } == want {
            return Ok(true);
        }
        reap()?;
        if !watch.alive()? {
            return Ok(false);
        }
        std::hint::spin_loop();
    }
}

fn lat_read(o: &Options, s: &Side, size: u64) -> erdma::Result<LatSamples> {
    let qp = &s.qps[0];
    let sge = [Sge {
        addr: s.target(0),
        length: size as u32,
        lkey: s.mr.lkey(),
    }];
    let remote = RemoteMr {
        addr: s.remotes[0].vaddr,
        len: size,
        rkey: s.remotes[0].rkey,
    };
    let iters = lat_iters(o);
    let end = o.duration.map(|d| Instant::now() + d);
    let mut samples = LatSamples::new(o.iters);
    let mut i = 0u64;
    while i < iters {
        let mut wr = RawSendWr::new(i, WrOpcode::RdmaRead, &sge);
        wr.remote = remote;
        wr.flags = SendFlags::SIGNALED;
        let t0 = Instant::now();
        // The CPU never reads the target area during the test.
        // SAFETY: the SGE lies in `s.mr`, which outlives the queue pair.
        unsafe { qp.post_send_raw(std::slice::from_ref(&wr))? };
        wait_send(s, "the READ latency run", i, iters)?;
        samples.push(t0.elapsed().as_secs_f64() * 1e6);
        i += 1;
        if end.is_some_and(|e| Instant::now() >= e) {
            break;
        }
    }
    Ok(samples)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn roles_from_the_command_line() {
        let o = parse(Verb::Write, Test::Bw, &[]).unwrap();
        assert!(o.loopback && o.size == 65536 && o.iters == 5000);
        let o = parse(Verb::Send, Test::Lat, &args(&["-d", "rxe0"])).unwrap();
        assert!(!o.loopback && o.server.is_none() && o.size == 2 && o.inline == 64);
        let o = parse(
            Verb::Write,
            Test::Bw,
            &args(&["-d", "rxe0", "10.0.0.1", "-a"]),
        )
        .unwrap();
        assert_eq!(o.server.as_deref(), Some("10.0.0.1"));
        assert_eq!(o.sizes().len(), 23);
        assert_eq!(o.sizes()[22], SWEEP_MAX);
        let o = parse(Verb::Read, Test::Bw, &args(&["--oob", "erdma", "-q", "4"])).unwrap();
        assert_eq!((o.oob, o.qps), (Oob::Erdma, 4));
        let o = parse(
            Verb::Write,
            Test::Bw,
            &args(&["-d", "siw0", "-R", "10.0.3.15"]),
        )
        .unwrap();
        assert!(o.rdma_cm && !o.loopback && o.oob == Oob::Perftest);
    }

    #[test]
    fn bad_flags_are_refused() {
        for bad in [
            &["-z"][..],
            &["-s", "0"],
            &["-n", "0"],
            &["-q", "2"],
            &["--oob", "x"],
            &["-m", "1500"],
            &["-D", "-1"],
            &["--loopback", "host"],
            &["a", "b"],
            // -R carries perftest's exchange between a server and a client.
            &["-R", "--loopback"],
            &["-R", "--oob", "erdma"],
        ] {
            assert!(
                matches!(
                    parse(Verb::Send, Test::Lat, &args(bad)),
                    Err(ToolError::Cli(_))
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn peak_over_windows() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let done = [(t0, 0), (ms(10), 100), (ms(15), 200), (ms(40), 300)];
        // Each 100 posted 4 ms before the previous hundred completed.
        let posts = [(t0, 100), (ms(6), 200), (ms(11), 300)];
        // Messages 100..200: posted at 6 ms, all complete at 15 ms: 100 of 1000 B in 9 ms is
        // the best window of >= 100 messages.
        let p = peak_rate(&done, &posts, 1000, 100);
        assert!((p - 100.0 * 1000.0 / 0.009).abs() < 1.0, "{p}");
    }

    /// Several queue pairs' completions land microseconds apart; timed from the completion
    /// before them, 200 messages looked like they took 2 µs. Timed from their posts, they took
    /// what the link needed.
    #[test]
    fn a_burst_of_completions_is_not_a_peak() {
        let t0 = Instant::now();
        let us = |n| t0 + Duration::from_micros(n);
        // 400 messages posted at once; 200 complete at 3.998 ms, the other 200 in a burst 2 µs
        // later.
        let posts = [(t0, 400)];
        let done = [(t0, 0), (us(3998), 200), (us(4000), 400)];
        let p = peak_rate(&done, &posts, 1000, 200);
        // No window beats 400 messages in 4 ms; the burst alone would say 200 in 2 µs.
        assert!(p <= 400.0 * 1000.0 / 0.004 + 1.0, "{p}");
        assert!(p >= 200.0 * 1000.0 / 0.004 - 1.0, "{p}");
    }
}
