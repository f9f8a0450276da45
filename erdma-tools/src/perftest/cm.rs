//! `-R`: perftest's rdma_cm mode. Nothing goes over TCP: the phases (versions, MTU, keys,
//! reports) travel as SEND/RECV messages on a connection of their own that rdma_cm makes at the
//! port (`-p`), and the test's queue pairs are connected through rdma_cm too, at the same port,
//! between two synchronising exchanges. The only way on an iWARP device (eRDMA's default mode,
//! siw), where a queue pair reaches RTS only through the connection manager; works on
//! InfiniBand/RoCE devices as well. Faces perftest's `-R` in either role.
//!
//! The phases' messages are perftest's (the steps of [`pt::setup_over`] and
//! [`pt::bw_report_over`]), except that keys travel as the binary `struct pingpong_dest`
//! ([`Keys::encode_struct`]) and the close has no `done`. One receive is always posted before
//! the peer may send (iWARP has no receiver-not-ready retry): the first before the connection,
//! each next one before this side answers.

use std::cell::Cell;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use erdma::connect::cm::{self, Connection, Setup};
use erdma::connect::compat::perftest::{self as pt, BwReport, Keys, Role};
use erdma::{
    Access, CanRecv, Completion, Context, Cq, Error, Gid, Mr, Mtu, Pd, Qp, QpConfig, RawRecvWr,
    Rts, SendWr, Sge, Transport, WcOpcode,
};

use super::Options;
use super::oob::{Channel, proto};
use super::setup::{open, run_channel};

/// The queue pairs of a `-R` run and the connections they live on.
pub(super) struct CmQps {
    pub qps: Vec<Qp<Rts>>,
    pub links: Vec<Connection>,
}

/// Refuses a run without `-R` on a device whose queue pairs connect only through rdma_cm.
///
/// # Errors
/// [`Error::InvalidArgument`] saying to use `-R`.
pub(super) fn check_transport(o: &Options, ctx: &Context) -> erdma::Result<()> {
    if ctx.transport() == Transport::Iwarp && !o.rdma_cm {
        return Err(Error::InvalidArgument(format!(
            "{} is an iWARP device: its queue pairs connect only through rdma_cm; run both ends \
             with -R",
            ctx.name()
        )));
    }
    Ok(())
}

/// Connects `o.qps` queue pairs made with `config` on `pd` through rdma_cm, between two
/// synchronising exchanges on `ch`: as the server at the port of the channel's `local` address,
/// as the client to its `peer` address.
///
/// # Errors
/// [`Error::Refused`] when the server does not listen within the step timeout, and what the
/// exchanges and the connections fail with.
pub(super) fn connect(
    o: &Options,
    pd: &Pd,
    config: &QpConfig,
    role: Role,
    (local, peer): (SocketAddr, SocketAddr),
    ch: &mut dyn Channel,
) -> erdma::Result<CmQps> {
    // perftest sends its (still empty) keys to synchronise.
    let sync = Keys {
        lid: 0,
        out_reads: 0,
        qpn: 0,
        psn: 0,
        rkey: 0,
        vaddr: 0,
        gid: Gid::ZERO,
        srqn: 0,
    };
    ch.keys(&sync)?;
    let connected = connect_qps(o, pd, config, role, local, peer)?;
    ch.keys(&sync)?;
    Ok(connected)
}

fn connect_qps(
    o: &Options,
    pd: &Pd,
    config: &QpConfig,
    role: Role,
    local: SocketAddr,
    peer: SocketAddr,
) -> erdma::Result<CmQps> {
    let device = pd.context().name().to_string();
    let options = cm::Options {
        device: Some(device.clone()),
        backlog: Some(o.qps.min(u16::MAX as u32) as u16),
        ..cm::Options::default()
    };
    let setup = |_: &Context| {
        Ok(Setup::new(pd, config.clone())
            .access(Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ))
    };
    let mut links = Vec::with_capacity(o.qps as usize);
    match role {
        Role::Server => {
            let listener = cm::Listener::bind_with(("0.0.0.0", local.port()), &options)?;
            for _ in 0..o.qps {
                links.push(listener.accept(o.step_timeout, setup)?);
            }
        }
        Role::Client => {
            for _ in 0..o.qps {
                links.push(connect_retrying(peer, o.step_timeout, &options, setup)?);
            }
        }
    }
    let qps = links.iter().map(|c| c.qp().clone()).collect();
    Ok(CmQps { qps, links })
}

/// One connection, retried while nobody listens at `peer` yet (the server starts listening
/// after the synchronising exchange, as perftest's does), for at most `timeout`.
fn connect_retrying<T>(
    peer: SocketAddr,
    timeout: Duration,
    options: &cm::Options,
    setup: impl Fn(&Context) -> erdma::Result<Setup<T>>,
) -> erdma::Result<Connection<T>> {
    let deadline = Instant::now() + timeout;
    loop {
        match cm::connect_with(peer, timeout, options, &setup) {
            Err(Error::Refused { reason, .. })
                if reason.contains("nobody is listening") && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(100))
            }
            r => return r,
        }
    }
}

/// Runs a `-R` test: the rdma_cm channel (server: listens at `-p` and accepts one connection;
/// client: connects there, retrying while the server does not listen yet), then the test as
/// without `-R`.
///
/// # Errors
/// What opening the device, the channel or the test fails with.
pub(super) fn run(o: &Options) -> erdma::Result<()> {
    let ctx = open(o)?;
    let pd = ctx.alloc_pd()?;
    let options = cm::Options {
        device: Some(ctx.name().to_string()),
        ..cm::Options::default()
    };
    let (link, role) = match &o.server {
        Some(host) => {
            let peer = server_addr(host, o.tcp_port)?;
            let link = connect_retrying(peer, o.step_timeout, &options, |_| link_setup(&pd))?;
            (link, Role::Client)
        }
        None => {
            let listener = cm::Listener::bind_with(("0.0.0.0", o.tcp_port), &options)?;
            if !o.quiet {
                eprintln!(
                    "{}: waiting for an rdma_cm client on port {}",
                    o.tool_name(),
                    listener.local_addr()?.port()
                );
            }
            let link = listener.accept(Duration::from_secs(24 * 3600), |_| link_setup(&pd))?;
            // The port is the test's queue pairs' next (on iWARP it is a TCP listener).
            drop(listener);
            if !o.quiet {
                eprintln!("{}: client {} connected", o.tool_name(), link.peer_addr());
            }
            (link, Role::Server)
        }
    };
    let local = link
        .local_addr()
        .ok_or_else(|| proto("the rdma_cm channel has no local address".into()))?;
    let ends = (local, link.peer_addr());
    let ch = Box::new(CmChannel {
        link,
        role,
        timeout: o.step_timeout,
        early: Cell::new(None),
    });
    run_channel(o, ctx, ch, role, Some(ends))
}

/// The host's IPv4 address at `port` (`host:port` as given wins).
fn server_addr(host: &str, port: u16) -> erdma::Result<SocketAddr> {
    let target = if host.parse::<SocketAddr>().is_ok() {
        host.to_string()
    } else {
        format!("{host}:{port}")
    };
    target
        .to_socket_addrs()
        .map_err(|e| Error::InvalidArgument(format!("cannot resolve {target}: {e}")))?
        .find(SocketAddr::is_ipv4)
        .ok_or_else(|| Error::InvalidArgument(format!("{target} has no IPv4 address")))
}

/// Bytes of the channel's receive buffer: perftest receives its messages into one
/// `struct pingpong_dest`, the largest of them.
const MSG: usize = pt::KEYS_STRUCT_LEN;

/// The channel's queue and its receive buffer.
struct Link {
    cq: Cq,
    mr: Mr<'static>,
}

/// The channel connection's setup: one receive posted before the connection exists (the
/// client sends first, as soon as it is connected).
fn link_setup(pd: &Pd) -> erdma::Result<Setup<Link>> {
    let cq = pd.context().create_cq(8)?;
    let mr = pd.alloc(MSG, Access::LOCAL_WRITE)?;
    let recv = recv_wr_sge(&mr);
    let config = QpConfig::new(&cq).max_send_wr(4).max_recv_wr(2);
    Ok(Setup::new(pd, config)
        .on_init(move |qp| post_recv(qp, &recv))
        .with(Link { cq, mr }))
}

fn recv_wr_sge(mr: &Mr<'static>) -> Sge {
    Sge {
        addr: mr.addr(),
        length: MSG as u32,
        lkey: mr.lkey(),
    }
}

/// Posts the channel's one receive.
fn post_recv<S: CanRecv>(qp: &Qp<S>, sge: &Sge) -> erdma::Result<()> {
    let wr = RawRecvWr {
        wr_id: 0,
        sges: std::slice::from_ref(sge),
    };
    // The buffer is the channel's region, which lives in the connection's application value as
    // long as its queue pair, and the CPU reads it only after this receive has completed.
    // SAFETY: as above.
    unsafe { qp.post_recv_raw(std::slice::from_ref(&wr)) }
}

/// perftest's phases as SEND/RECV messages on the rdma_cm channel.
struct CmChannel {
    link: Connection<Link>,
    role: Role,
    timeout: Duration,
    /// A receive completion [`Channel::peer_spoke`] took before its exchange did.
    early: Cell<Option<Completion>>,
}

impl CmChannel {
    /// The next receive completion, within the step timeout.
    fn recv(&mut self, theirs: &mut [u8], what: &str) -> erdma::Result<()> {
        let c = match self.early.take() {
            Some(c) => c,
            None => self.next_recv(what)?,
        };
        if c.byte_len as usize != theirs.len() {
            return Err(proto(format!(
                "{what}: the peer sent {} bytes, {} were due",
                c.byte_len,
                theirs.len()
            )));
        }
        let link = self.link.app();
        theirs.copy_from_slice(&link.mr.to_vec(..theirs.len()));
        // The next receive, before this side answers (the peer's next message follows that).
        post_recv(self.link.qp(), &recv_wr_sge(&link.mr))
    }

    /// Waits for the receive's completion; the SENDs' own come and go on the way.
    fn next_recv(&self, what: &str) -> erdma::Result<Completion> {
        let deadline = Instant::now() + self.timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let c = self.link.app().cq.wait_one(left).map_err(|e| match e {
                Error::Timeout { .. } => Error::Timeout {
                    what: format!("{what} over rdma_cm"),
                },
                e => e,
            })?;
            let c = c.ok()?;
            if c.opcode == WcOpcode::Recv {
                return Ok(c);
            }
        }
    }

    fn send(&self, mine: &[u8], what: &str) -> erdma::Result<()> {
        // Signalled, so the queue never fills with unreaped requests; reaped by `next_recv`.
        self.link
            .qp()
            .post_send(SendWr::send_inline(1, mine).signaled())
            .map_err(|e| proto(format!("{what}: {e}")))
    }

    /// One lock-step exchange: the client sends first.
    fn xchg(&mut self, mine: &[u8], theirs: &mut [u8], what: &str) -> erdma::Result<()> {
        match self.role {
            Role::Client => {
                self.send(mine, what)?;
                self.recv(theirs, what)
            }
            Role::Server => {
                self.recv(theirs, what)?;
                self.send(mine, what)
            }
        }
    }
}

impl Channel for CmChannel {
    fn setup(&mut self, mtu: Mtu) -> erdma::Result<(Mtu, u64)> {
        let agreed = pt::setup_over(&mut |m, t, w| self.xchg(m, t, w), mtu)?;
        Ok((agreed.mtu, u64::from(agreed.cycle_buffer)))
    }
    fn keys(&mut self, mine: &Keys) -> erdma::Result<Keys> {
        let mut theirs = [0u8; pt::KEYS_STRUCT_LEN];
        self.xchg(
            &mine.encode_struct(),
            &mut theirs,
            "the perftest keys message",
        )?;
        Keys::decode_struct(&theirs)
    }
    fn report(&mut self, mine: &BwReport) -> erdma::Result<BwReport> {
        pt::bw_report_over(&mut |m, t, w| self.xchg(m, t, w), mine)
    }
    fn close(mut self: Box<Self>, mine: &Keys) -> erdma::Result<()> {
        self.keys(mine)?;
        // Leave only once the peer has: on siw a SEND completes at the sender some time after
        // its data is delivered, and a connection torn down in between turns that completion
        // into an error at the peer (perftest then fails its close). The server waits for the
        // client to go; the client gives the server a second to go first, then goes itself
        // (dropping the link disconnects).
        let grace = match self.role {
            Role::Server => self.timeout,
            Role::Client => Duration::from_secs(1),
        };
        let _ = self.link.wait_disconnected(grace);
        Ok(())
    }
    fn name(&self) -> &'static str {
        "rdma_cm (perftest)"
    }
    fn stream(&self) -> Option<&std::net::TcpStream> {
        None
    }
    fn peer_spoke(&self) -> bool {
        if self.early.get().is_some() {
            return true;
        }
        let mut wcs = [Completion::default(); 1];
        match self.link.app().cq.poll(&mut wcs) {
            Ok(1) if wcs[0].opcode == WcOpcode::Recv || !wcs[0].status.is_success() => {
                self.early.set(Some(wcs[0]));
                true
            }
            _ => false,
        }
    }
}
