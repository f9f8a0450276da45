//! What a perftest-style tool is asked to do: the verb and test, the flags it accepts (perftest's
//! where they apply) and the options they parse into.

use std::time::Duration;

use erdma::Mtu;
use erdma::connect;

use crate::cli::{Args, Spec};
use crate::tool::{self, ToolError, bad_value};

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
    /// `--perftest-loop`: the WRITE latency loop is perftest's on every device (on the soft
    /// device the tool otherwise polls its completion queue while it watches memory).
    pub perftest_loop: bool,
    /// `--small-pages`: the buffer is ordinary heap memory of 4 KiB pages, as a C program's
    /// (perftest's `memalign`) is, instead of the huge pages the SDK's buffers ask for from
    /// 2 MiB.
    pub small_pages: bool,
}

impl Options {
    /// The tool's name, as perftest would call it without the `ib_` prefix.
    pub fn tool_name(&self) -> String {
        tool_name(self.verb, self.test)
    }

    /// The sizes to run.
    pub fn sizes(&self) -> Vec<u64> {
        if self.all {
            (1..24).map(|i| 1u64 << i).collect()
        } else {
            vec![self.size]
        }
    }

    /// The largest message of the run (the buffers' size).
    pub(super) fn max_size(&self) -> u64 {
        if self.all { SWEEP_MAX } else { self.size }
    }
}

/// The tool's name (`write_bw`): perftest's without the `ib_` prefix.
pub(super) fn tool_name(verb: Verb, test: Test) -> String {
    format!("{}_{}", verb_word(verb), test_word(test))
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

/// The banner's title, as perftest prints it.
pub(super) fn title(o: &Options) -> String {
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
        None,
        "perftest-loop",
        "WRITE latency: perftest's loop on the soft device too (poll for each WRITE's \
         completion, then watch memory without calling the device)",
    ),
    Spec::switch(
        None,
        "small-pages",
        "register heap memory of 4 KiB pages, as a C program's buffer is, instead of the \
         huge pages the SDK asks for from 2 MiB (a peer's one-copy read walks every page)",
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
    let name = tool_name(verb, test);
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
    let perftest_loop = a.has("perftest-loop");
    if perftest_loop && (verb, test) != (Verb::Write, Test::Lat) {
        return Err(bad_value(
            "--perftest-loop",
            tool_name(verb, test),
            "write_lat (the other tools' loops are perftest's already)",
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
        perftest_loop,
        small_pages: a.has("small-pages"),
    })
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
        let o = parse(Verb::Write, Test::Lat, &args(&["--perftest-loop"])).unwrap();
        assert!(o.perftest_loop && !o.loopback && o.server.is_none());
        let e = parse(Verb::Send, Test::Lat, &args(&["--perftest-loop"])).unwrap_err();
        assert!(
            matches!(&e, ToolError::Cli(crate::cli::CliError::BadValue { flag, .. })
                if flag == "--perftest-loop"),
            "{e:?}"
        );
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
}
