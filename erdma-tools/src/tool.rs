//! What every tool shares: turning a parsed command line or a failure into an exit status, and
//! small helpers over the SDK (picking a GID, arming a queue pair from a peer's data).

use std::process::ExitCode;
use std::time::Duration;

use erdma::{AddressVector, Context, Gid, Init, Mtu, Qp, RtrOptions, Rts, RtsOptions};

use crate::cli::CliError;

/// Exit status for a refused command line (as getopt-based tools use).
pub const EXIT_USAGE: u8 = 2;
/// Exit status for a run that failed.
pub const EXIT_FAILURE: u8 = 1;

/// Why a tool stopped early.
#[derive(Debug)]
pub enum ToolError {
    /// The command line was refused (or `--help` asked for).
    Cli(CliError),
    /// The run failed.
    Run(erdma::Error),
}

impl From<CliError> for ToolError {
    fn from(e: CliError) -> Self {
        ToolError::Cli(e)
    }
}

impl From<erdma::Error> for ToolError {
    fn from(e: erdma::Error) -> Self {
        ToolError::Run(e)
    }
}

impl<S: erdma::StateMarker> From<erdma::TransitionError<S>> for ToolError {
    fn from(e: erdma::TransitionError<S>) -> Self {
        ToolError::Run(e.into())
    }
}

/// Shorthand for a refused value.
pub fn bad_value(flag: &str, value: impl ToString, expected: &str) -> ToolError {
    ToolError::Cli(CliError::BadValue {
        flag: flag.to_string(),
        value: value.to_string(),
        expected: expected.to_string(),
    })
}

/// Whether the tool runs both sides in this process (`--loopback`, or no arguments at all), and
/// that the flags agree: loopback has no server address to dial, and `--peer-dev` (the server
/// side's device) means something only there.
///
/// # Errors
/// [`CliError::BadValue`] for `--loopback` with a server address or `--peer-dev` without
/// loopback.
pub fn loopback_mode(
    a: &crate::cli::Args,
    no_arguments: bool,
    server: Option<&str>,
) -> Result<bool, ToolError> {
    let loopback = no_arguments || a.has("loopback");
    if let (true, Some(host)) = (loopback, server) {
        return Err(bad_value(
            "--loopback",
            host,
            "used without a server address",
        ));
    }
    if let (Some(dev), false) = (a.str("peer-dev"), loopback) {
        return Err(bad_value(
            "--peer-dev",
            dev,
            "allowed without --loopback (it names the server side's device there)",
        ));
    }
    Ok(loopback)
}

/// Refuses `--port 0` where the tool dials the port (a client): 0 only lets a server pick one.
///
/// # Errors
/// [`CliError::BadValue`] for `--port 0` on a client.
pub fn check_port(port: u16, dials_it: bool) -> Result<(), ToolError> {
    if port == 0 && dials_it {
        return Err(bad_value(
            "--port",
            0,
            "the server's port (0 only lets a server pick one)",
        ));
    }
    Ok(())
}

/// Runs a tool's body and maps its outcome to an exit status: help goes to stdout with status 0,
/// a refused command line to stderr with status 2, a failed run to stderr with status 1.
pub fn exit_with(tool: &str, result: Result<(), ToolError>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(ToolError::Cli(CliError::Help(text))) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(ToolError::Cli(e)) => {
            eprintln!("{tool}: {e}");
            ExitCode::from(EXIT_USAGE)
        }
        Err(ToolError::Run(e)) => {
            eprintln!("{tool}: error: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// The local GID to advertise and its index: `index` when given, else the IPv4-mapped RoCE v2
/// entry, else the first entry.
///
/// # Errors
/// [`erdma::Error::InvalidArgument`] when `index` names no populated entry.
pub fn local_gid(ctx: &Context, port: u8, index: Option<u8>) -> erdma::Result<(u8, Gid)> {
    let table = ctx.gid_table(port)?;
    match index {
        Some(i) => table
            .iter()
            .find(|e| e.index == i)
            .map(|e| (e.index, e.gid))
            .ok_or_else(|| {
                erdma::Error::InvalidArgument(format!(
                    "GID index {i} is not populated on {} port {port} (populated: {:?})",
                    ctx.name(),
                    table.iter().map(|e| e.index).collect::<Vec<_>>()
                ))
            }),
        None => Ok(ctx
            .ipv4_gid(port)
            .map(|e| (e.index, e.gid))
            .ok()
            .or_else(|| table.first().map(|e| (e.index, e.gid)))
            .unwrap_or((0, Gid::ZERO))),
    }
}

/// Checks that a peer's GID can be routed to from ours (RoCE needs a real GID of the same IP
/// family on both sides).
///
/// # Errors
/// [`erdma::Error::Protocol`] naming the problem.
pub fn check_peer_gid(local: &Gid, remote: &Gid) -> erdma::Result<()> {
    if remote.interface_id() == 0 {
        return Err(erdma::Error::Protocol {
            what: format!(
                "peer sent GID {remote}, which has no interface id (is the C tool started \
                 with -g/-x <gid index>?)"
            ),
        });
    }
    if local.is_ipv4_mapped() != remote.is_ipv4_mapped() {
        return Err(erdma::Error::Protocol {
            what: format!(
                "GID types differ: ours {local} and the peer's {remote} are not both IPv4-mapped"
            ),
        });
    }
    Ok(())
}

/// What arming a queue pair needs from the peer and from this side.
#[derive(Debug, Clone, Copy)]
pub struct Arm {
    /// The peer's queue pair number.
    pub remote_qpn: u32,
    /// The peer's first PSN.
    pub remote_psn: u32,
    /// The peer's GID.
    pub remote_gid: Gid,
    /// The peer's LID.
    pub remote_lid: u16,
    /// Path MTU.
    pub mtu: Mtu,
    /// Local GID index.
    pub sgid_index: u8,
    /// Local port.
    pub port: u8,
    /// READ/atomics the peer may have outstanding at us.
    pub max_dest_rd_atomic: u8,
    /// READ/atomics we may have outstanding.
    pub max_rd_atomic: u8,
    /// Hop limit (IP TTL).
    pub hop_limit: u8,
}

/// INIT → RTR → RTS with the C tools' parameters (min RNR timer 12, timeout 14, 7 retries,
/// infinite RNR retries).
///
/// # Errors
/// The SDK's refusal, with the queue pair dropped.
pub fn arm(qp: Qp<Init>, a: &Arm) -> erdma::Result<Qp<Rts>> {
    let mut av = AddressVector::new(a.remote_gid, a.sgid_index);
    av.port = a.port;
    av.dlid = a.remote_lid;
    av.hop_limit = a.hop_limit;
    let psn = qp.initial_psn();
    let rtr = qp.rtr(&RtrOptions {
        dest_qp_num: a.remote_qpn,
        rq_psn: a.remote_psn,
        path_mtu: a.mtu,
        av,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: 12,
    })?;
    Ok(rtr.rts(&RtsOptions::new(psn, a.max_rd_atomic))?)
}

/// Parses a `-m` value given in bytes (256..4096).
///
/// # Errors
/// A [`ToolError::Cli`] naming the flag.
pub fn parse_mtu(flag: &str, v: Option<u32>) -> Result<Option<Mtu>, ToolError> {
    match v {
        None => Ok(None),
        Some(b) => Mtu::from_bytes(b)
            .map(Some)
            .ok_or_else(|| bad_value(flag, b, "an MTU of 256, 512, 1024, 2048 or 4096")),
    }
}

/// Seconds as a duration, refusing negative, zero and absurd values.
///
/// # Errors
/// A [`ToolError::Cli`] naming the flag.
pub fn parse_secs(flag: &str, v: f64) -> Result<Duration, ToolError> {
    if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
        return Err(bad_value(flag, v, "a number of seconds in (0, 86400]"));
    }
    Ok(Duration::from_secs_f64(v))
}

/// Turns on TCP keepalive for an out-of-band connection: a peer whose host vanishes without
/// closing it (power loss, a broken path) is found within about 25 s, however long the test
/// runs — a side that only waits for the peer's next message needs no fixed deadline.
///
/// # Errors
/// The socket's refusal.
pub fn keepalive(stream: &std::net::TcpStream) -> erdma::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = stream.as_raw_fd();
    for (level, name, value) in [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 10),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 5),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3),
    ] {
        let v: libc::c_int = value;
        let (ptr, len) = (&v as *const libc::c_int, size_of::<libc::c_int>());
        // SAFETY: `fd` is the stream's open socket; `ptr` points at `len` bytes that outlive it.
        let rc = unsafe { libc::setsockopt(fd, level, name, ptr.cast(), len as libc::socklen_t) };
        if rc != 0 {
            return Err(erdma::Error::Io {
                context: "turning on TCP keepalive".into(),
                source: std::io::Error::last_os_error(),
            });
        }
    }
    Ok(())
}
