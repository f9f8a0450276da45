//! The queue-pair mesh along the ring: a rank's buffers and queue pairs, the swap of their
//! descriptions through the bootstrap, the connections to both neighbours and the channels over
//! them.
//!
//! Queue pairs are connected one of two ways, as the device allows
//! ([`crate::Capability::ManualConnect`]):
//! - by hand (InfiniBand/RoCE, the soft device): every rank creates its 2K queue pairs, the
//!   bootstrap carries their endpoints, and each rank moves its own to RTS;
//! - through rdma_cm (iWARP: eRDMA's default mode, siw): every rank listens on its device's
//!   address ([`crate::connect::cm::device_ipv4`]), the bootstrap carries that address, and each
//!   rank connects K queue pairs to its successor while accepting K from its predecessor. The
//!   connections stay up with the communicator: they are how a vanished neighbour is noticed.

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use super::config::FINGERPRINT_LEN;
use super::{Communicator, MAX_RANKS, RX, RingConfig, TX};
use crate::Context;
use crate::collective::bootstrap::Bootstrap;
use crate::collective::channel::{Receiver, Sender};
use crate::collective::host::{self, Host};
use crate::connect::PeerInfo;
use crate::connect::cm::{self, Connection, Setup};
use crate::error::{Error, Result};
use crate::mr::RemoteMr;
use crate::pd::Pd;
use crate::qp::{Init, InitOptions, Qp, QpConfig};
use crate::vocab::Access;

/// Bytes of the rdma_cm address in the setup data (IPv4 and port; all zero when the queue pairs
/// are connected by hand). It follows the fingerprint; the host's description follows it.
const CM_ADDR_LEN: usize = 6;

/// Only the predecessor writes into this rank's memory, through the queue pairs it connects to
/// (`rx`). The successor's queue pairs (`tx`) take credits, which are sends, and grant it
/// nothing.
const RX_ACCESS: Access = Access::LOCAL_WRITE.union(Access::REMOTE_WRITE);
const TX_ACCESS: Access = Access::LOCAL_WRITE;

/// A rank's queue pairs before they are connected.
enum Unconnected {
    /// Created here, in INIT: `tx` then `rx`.
    Manual(Vec<Qp<Init>>, Vec<Qp<Init>>),
    /// To be created by rdma_cm's connections; the listener the predecessor connects to.
    Cm(cm::Listener),
}

/// What each rank announced: its setup data, decoded.
struct Peer {
    info: PeerInfo,
    cm: Option<SocketAddr>,
}

impl Communicator {
    /// Builds this rank's part of the ring on `ctx`: creates and registers its buffers and
    /// queue pairs, swaps them with its neighbours through `boot`, connects, and waits for
    /// every rank to be ready.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad configuration (or one that differs between ranks),
    /// errors of the device when creating resources, and the bootstrap's errors; on an iWARP
    /// device, the connections' errors.
    pub fn new(ctx: &Context, boot: &mut Bootstrap, cfg: RingConfig) -> Result<Communicator> {
        cfg.validate()?;
        let (rank, world) = (boot.rank(), boot.world());
        if world > MAX_RANKS {
            return Err(Error::invalid(format!(
                "a ring of {world} ranks (at most {MAX_RANKS})"
            )));
        }
        let k = cfg.qps_per_connection;
        let s = cfg.slots;
        // Without immediate data a message is a WRITE and a SEND: twice the send requests.
        let per_msg = if ctx.limits().immediate_data { 1 } else { 2 };
        let send_depth = 4 * per_msg * s + 16;
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq((2 * k * (send_depth + 4 * s)) as u32)?;
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        let work = pd.alloc(cfg.max_bytes.max(64), access)?;
        let staging = pd.alloc(k * s * cfg.chunk_bytes, access)?;
        let qp_config = QpConfig::new(&cq)
            // Room for S chunks (or credits) plus the unsignaled run the SDK allows before it
            // asks the device for a completion to retire them.
            .max_send_wr(send_depth as u32)
            .max_recv_wr(2 * s as u32 + 2)
            .max_send_sge(1)
            .max_recv_sge(1);
        let single = world == 1;
        let unconnected = unconnected(ctx, &pd, &qp_config, k, single)?;
        let (endpoints, cm_addr) = match &unconnected {
            Unconnected::Manual(tx, rx) => {
                let endpoints = tx
                    .iter()
                    .chain(rx.iter())
                    .map(Qp::endpoint)
                    .collect::<Result<Vec<_>>>()?;
                (endpoints, None)
            }
            Unconnected::Cm(listener) => (Vec::new(), Some(listener.local_addr()?)),
        };
        let host = Host::this();
        let mut user = cfg.fingerprint();
        user.extend_from_slice(&encode_cm_addr(cm_addr)?);
        host.encode(&mut user);
        let mine = PeerInfo {
            endpoints,
            regions: vec![staging.remote(), work.remote()],
            user,
        };
        let all = boot.all_gather(&mine.encode()?)?;
        let mut peers = Vec::with_capacity(world);
        let mut hosts = Vec::with_capacity(world);
        for (r, bytes) in all.iter().enumerate() {
            let (peer, their_host) = decode_peer(r, rank, bytes, &mine.user)?;
            hosts.push(their_host);
            let queue_pairs = if cm_addr.is_some() { 0 } else { 2 * k };
            if !single
                && (peer.info.endpoints.len() != queue_pairs
                    || peer.info.regions.len() != 2
                    || peer.cm.is_some() != cm_addr.is_some())
            {
                return Err(Error::protocol(format!(
                    "rank {r} announced {} queue pairs, {} regions and {} rdma_cm address \
                     (expected {queue_pairs}, 2 and {})",
                    peer.info.endpoints.len(),
                    peer.info.regions.len(),
                    if peer.cm.is_some() { "an" } else { "no" },
                    if cm_addr.is_some() { "one" } else { "none" },
                )));
            }
            peers.push(peer);
        }
        let next = &peers[(rank + 1) % world];
        let prev = &peers[(rank + world - 1) % world];
        let (tx, rx, links) = match unconnected {
            Unconnected::Manual(tx_init, rx_init) => {
                let mut tx = Vec::with_capacity(k);
                let mut rx = Vec::with_capacity(k);
                for (i, qp) in tx_init.into_iter().enumerate() {
                    tx.push(qp.connect(&next.info.endpoints[k + i], &cfg.connect)?);
                }
                for (i, qp) in rx_init.into_iter().enumerate() {
                    rx.push(qp.connect(&prev.info.endpoints[i], &cfg.connect)?);
                }
                (tx, rx, Vec::new())
            }
            Unconnected::Cm(listener) => {
                let successor = next.cm.expect("checked above");
                cm_mesh(&listener, successor, &pd, &qp_config, rank, world, &cfg)?
            }
        };
        let (peer_staging, peer_work) = if single {
            (RemoteMr::default(), RemoteMr::default())
        } else {
            (next.info.regions[0], next.info.regions[1])
        };
        let tx = Sender::new(tx, s, cfg.chunk_bytes, peer_staging, TX)?;
        let rx = Receiver::new(rx, s, cfg.chunk_bytes, RX)?;
        let host_share = host::share(&host, &hosts);
        // Nobody writes before everybody's queue pairs are connected and receiving.
        boot.barrier()?;
        Ok(Communicator {
            _links: links,
            tx,
            rx,
            cq,
            #[cfg(feature = "gpu")]
            host_pin: None,
            #[cfg(feature = "gpu")]
            gpu_copies: None,
            work,
            staging,
            _pd: pd,
            peer_work,
            rank,
            world,
            early: VecDeque::new(),
            calls: 0,
            failed: None,
            cfg,
            host_share,
        })
    }
}

/// This rank's queue pairs in INIT, or the rdma_cm listener its predecessor will connect to
/// (neither for a ring of one).
fn unconnected(
    ctx: &Context,
    pd: &Pd,
    config: &QpConfig,
    k: usize,
    single: bool,
) -> Result<Unconnected> {
    if single {
        return Ok(Unconnected::Manual(Vec::new(), Vec::new()));
    }
    if !ctx.limits().manual_connect {
        let ip = cm::device_ipv4(ctx)?;
        let options = cm::Options {
            device: Some(ctx.name().to_string()),
            backlog: Some(k.min(u16::MAX as usize) as u16),
            ..cm::Options::default()
        };
        return Ok(Unconnected::Cm(cm::Listener::bind_with(
            SocketAddr::new(IpAddr::V4(ip), 0),
            &options,
        )?));
    }
    let (mut tx, mut rx) = (Vec::new(), Vec::new());
    let init = |access| InitOptions {
        access,
        ..InitOptions::default()
    };
    for _ in 0..k {
        tx.push(pd.create_qp(config)?.init(&init(TX_ACCESS))?);
        rx.push(pd.create_qp(config)?.init(&init(RX_ACCESS))?);
    }
    Ok(Unconnected::Manual(tx, rx))
}

fn encode_cm_addr(addr: Option<SocketAddr>) -> Result<[u8; CM_ADDR_LEN]> {
    let mut out = [0u8; CM_ADDR_LEN];
    match addr {
        None => {}
        Some(SocketAddr::V4(a)) => {
            out[..4].copy_from_slice(&a.ip().octets());
            out[4..].copy_from_slice(&a.port().to_be_bytes());
        }
        Some(a) => {
            return Err(Error::invalid(format!(
                "the ring's rdma_cm listener is at {a}: IPv4 only"
            )));
        }
    }
    Ok(out)
}

/// Rank `r`'s setup data: checked against this rank's (`mine`, whose fingerprint all must
/// share), split into its description, its rdma_cm address and its host.
fn decode_peer(r: usize, rank: usize, bytes: &[u8], mine: &[u8]) -> Result<(Peer, Host)> {
    let bad = |e: &dyn std::fmt::Display| Error::protocol(format!("rank {r}'s ring setup: {e}"));
    let info = PeerInfo::decode(bytes).map_err(|e| bad(&e))?;
    let (fingerprint, rest) = info
        .user
        .split_at_checked(FINGERPRINT_LEN)
        .unwrap_or((&info.user, &[]));
    if fingerprint != &mine[..FINGERPRINT_LEN] {
        return Err(Error::invalid(format!(
            "rank {r} runs with another ring configuration (queue pairs, slots, chunk \
             or capacity) than rank {rank}"
        )));
    }
    let (addr, their_host) = rest
        .split_at_checked(CM_ADDR_LEN)
        .ok_or_else(|| bad(&"no rdma_cm address"))?;
    let host = Host::decode(their_host).map_err(|e| bad(&e))?;
    let ip = Ipv4Addr::new(addr[0], addr[1], addr[2], addr[3]);
    let port = u16::from_be_bytes([addr[4], addr[5]]);
    let cm = (port != 0).then_some(SocketAddr::new(IpAddr::V4(ip), port));
    Ok((Peer { info, cm }, host))
}

/// The rdma_cm mesh: K connections to the successor at `successor` (this rank's `tx`), K
/// accepted from the predecessor on `listener` (`rx`), made at the same time (every rank does
/// both). A connection request carries the sender's rank and the queue pair's index.
fn cm_mesh(
    listener: &cm::Listener,
    successor: SocketAddr,
    pd: &Pd,
    config: &QpConfig,
    rank: usize,
    world: usize,
    cfg: &RingConfig,
) -> Result<(Vec<Qp>, Vec<Qp>, Vec<Connection>)> {
    let k = cfg.qps_per_connection;
    let prev = (rank + world - 1) % world;
    let options = cm::Options {
        device: Some(pd.context().name().to_string()),
        ..cm::Options::default()
    };
    let setup = |access: Access, tag: &[u8]| -> Result<Setup> {
        Ok(Setup::new(pd, config.clone())
            .access(access)
            .user_data(tag.to_vec()))
    };
    let (accepted, connected) = std::thread::scope(|scope| {
        let accepting = scope.spawn(|| -> Result<Vec<Option<Connection>>> {
            let mut rx: Vec<Option<Connection>> = (0..k).map(|_| None).collect();
            for _ in 0..k {
                let conn = listener.accept(cfg.timeout, |_| setup(RX_ACCESS, &[]))?;
                let i = match conn.peer().user.as_slice() {
                    [r0, r1, i0, i1] if usize::from(u16::from_be_bytes([*r0, *r1])) == prev => {
                        usize::from(u16::from_be_bytes([*i0, *i1]))
                    }
                    other => {
                        return Err(Error::protocol(format!(
                            "rank {rank}: a ring connection from {} with the tag {other:?} \
                             (rank {prev}'s were expected)",
                            conn.peer_addr()
                        )));
                    }
                };
                match rx.get_mut(i) {
                    Some(slot @ None) => *slot = Some(conn),
                    _ => {
                        return Err(Error::protocol(format!(
                            "rank {rank}: rank {prev} connected queue pair {i} twice or past {k}"
                        )));
                    }
                }
            }
            Ok(rx)
        });
        let mut tx = Vec::with_capacity(k);
        let connecting = (0..k).try_for_each(|i| {
            let mut tag = (rank as u16).to_be_bytes().to_vec();
            tag.extend_from_slice(&(i as u16).to_be_bytes());
            tx.push(cm::connect_with(successor, cfg.timeout, &options, |_| {
                setup(TX_ACCESS, &tag)
            })?);
            Ok::<(), Error>(())
        });
        let accepted = accepting
            .join()
            .unwrap_or_else(|_| Err(Error::protocol("the ring's accepting thread panicked")));
        (accepted, connecting.map(|()| tx))
    });
    let (rx, tx) = (accepted?, connected?);
    let rx: Vec<Connection> = rx.into_iter().flatten().collect();
    let qps = |c: &[Connection]| c.iter().map(|c| c.qp().clone()).collect::<Vec<_>>();
    let (tx_qps, rx_qps) = (qps(&tx), qps(&rx));
    let mut links = tx;
    links.extend(rx);
    Ok((tx_qps, rx_qps, links))
}
