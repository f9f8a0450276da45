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
//!
//! With `-R` (perftest's rdma_cm mode, the only way on iWARP devices) the phases travel over an
//! rdma_cm connection instead of TCP and the queue pairs come connected from rdma_cm.
//!
//! The code by role: `options` (the command line), `oob` (the connection phases, in perftest's
//! format and the project's), `cm` (`-R`: the phases over rdma_cm and the queue pairs'
//! connections), `setup` (device, queue pairs and the peer's keys: one `Side` per end), `bw` and
//! `lat` (the two engines); the result tables are [`crate::report`]'s.

mod bw;
mod cm;
mod lat;
mod oob;
mod options;
mod setup;

use std::net::TcpStream;
use std::time::Duration;

use erdma::connect::Listener;
use erdma::connect::compat::perftest::Role;

pub use options::{Oob, Options, SPECS, SWEEP_MAX, Test, Verb, parse};
use setup::{dial, open, run_connected};

use crate::tool::{self, ToolError};

/// Entry point of a tool: parses `argv` (without the program name), runs, and maps the outcome to
/// an exit status (2 for a refused command line, 1 for a failed run).
pub fn main(verb: Verb, test: Test) -> std::process::ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let name = options::tool_name(verb, test);
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
