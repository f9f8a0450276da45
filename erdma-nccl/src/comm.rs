//! Connections: listening, connecting and accepting without blocking, and what a connection is
//! made of.
//!
//! A connection is one direction of NCCL traffic: `listen` + `accept` on the receiver,
//! `connect` on the sender. Setup, step by step (every step is a non-blocking poll; `connect`
//! and `accept` return no connection until the last one is done, and NCCL calls again):
//!
//! 1. The sender opens the out-of-band TCP link to the handle's address and sends a [`PeerInfo`]:
//!    its queue pairs' endpoints (unless rdma_cm connects them) and its parameters (the handle's
//!    nonce, the queue-pair count, the notice mode both ends can use).
//! 2. The receiver checks them, connects its queue pairs (whose notice receives are posted
//!    already) and answers with its endpoints and its record region (transfer records, and one
//!    "hello" word per queue pair).
//! 3. The sender connects its queue pairs (its clear-to-send receives are posted already) and
//!    RDMA-WRITEs the nonce into every queue pair's hello word. With rdma_cm (iWARP), steps 2–3
//!    connect the queue pairs through rdma_cm instead, in a helper thread per side, and the
//!    hello WRITE is also the first message on each queue pair that iWARP's MPA rules require
//!    of the connecting side.
//! 4. The receiver's `accept` returns once every hello word holds the nonce: the sender's
//!    receives are posted and every queue pair carries traffic, so its first clear-to-send is
//!    safe.
//!
//! The TCP link stays open as the connection's liveness channel ([`crate::link`]).

use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use erdma::connect::PeerInfo;
use erdma::connect::cm::{self, Connection, Setup};
use erdma::{Access, ConnectOptions, Cq, InitOptions, Mr, Qp, QpConfig, RawRecvWr, RemoteMr, Sge};
use erdma::{CanRecv, Init};

use crate::device::Dev;
use crate::error::{NetError, NetResult};
use crate::handle::{HANDLE_BYTES, Handle};
use crate::link::Link;
use crate::log::{INIT, NET, info};
use crate::proto::{
    CTS_BYTES, CTS_RX, MAX_QPS, NOTICE_BYTES, NoticeMode, RECORD_BYTES, RX_PER_QP, SLOTS,
};

pub use crate::recv::RecvComm;
pub use crate::send::SendComm;

/// Transfer states the sender keeps (twice [`SLOTS`]: a transfer the receiver has finished may
/// still wait for NCCL to test its sends while the receiver grants the next ones).
pub const XFERS: usize = 2 * SLOTS;
/// Send-queue depth of a sender's queue pairs: every transfer in flight, each with a record,
/// up to one piece per grouped receive and one more, and a notice.
pub const SEND_WR: u32 = 1024;
/// Send-queue depth of a receiver's queue pairs (clear-to-sends on queue pair 0, the flush).
pub const RECV_SIDE_SEND_WR: u32 = 128;
/// Receive-queue depth of every queue pair.
pub const RECV_WR: u32 = 64;

/// `wr_id` tags.
pub const RX_TAG: u64 = 1 << 62;
/// The signalled last request of a transfer on a queue pair.
pub const XFER_TAG: u64 = 1 << 61;
/// A flush READ.
pub const FLUSH_TAG: u64 = 1 << 60;
/// Requests that report only when they fail (clear-to-sends, hellos, records, data).
pub const QUIET_TAG: u64 = 1 << 59;

/// Sender's control region: clear-to-send receive buffers, transfer records, notice words,
/// the hello word.
pub mod send_ctrl {
    use super::*;
    /// Records at.
    pub const RECORD_AT: usize = CTS_RX * CTS_BYTES;
    /// Notice words at.
    pub const WORD_AT: usize = RECORD_AT + XFERS * RECORD_BYTES;
    /// The hello word at.
    pub const HELLO_AT: usize = WORD_AT + XFERS * 8;
    /// Total.
    pub const LEN: usize = HELLO_AT + 8;
}

/// Receiver's control region: clear-to-send sources, notice receive buffers, the flush target.
pub mod recv_ctrl {
    use super::*;
    /// Notice receive buffers at.
    pub const RX_AT: usize = SLOTS * CTS_BYTES;
    /// The flush READ's target at.
    pub const FLUSH_AT: usize = RX_AT + MAX_QPS * RX_PER_QP * NOTICE_BYTES;
    /// Total.
    pub const LEN: usize = FLUSH_AT + 64;
}

/// Receiver's record region (peers write it): transfer records, then the hello words.
pub mod record {
    use super::*;
    /// Hello words at.
    pub const HELLO_AT: usize = SLOTS * RECORD_BYTES;
    /// Total.
    pub const LEN: usize = HELLO_AT + MAX_QPS * 8;
}

/// The parameters each side sends in the exchange's user data: `'E' 'N' version role queue-pairs
/// notice-mode 0 0 nonce(u64 BE)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// 1: the sender; 2: the receiver.
    pub role: u8,
    /// Queue pairs.
    pub qps: usize,
    /// Notice mode.
    pub notice: NoticeMode,
    /// The listen's nonce.
    pub nonce: u64,
}

const PARAMS_VERSION: u8 = 1;
/// Role byte of the sender.
pub const ROLE_SENDER: u8 = 1;
/// Role byte of the receiver.
pub const ROLE_RECEIVER: u8 = 2;

impl Params {
    /// Encodes.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![
            b'E',
            b'N',
            PARAMS_VERSION,
            self.role,
            self.qps as u8,
            self.notice.code(),
            0,
            0,
        ];
        v.extend_from_slice(&self.nonce.to_be_bytes());
        v
    }

    /// Decodes and checks against what this side expects.
    ///
    /// # Errors
    /// A message naming the mismatch.
    pub fn decode(b: &[u8], role: u8, nonce: u64, qps: usize) -> Result<Params, String> {
        if b.len() != 16 || &b[..2] != b"EN" {
            return Err("the peer is not this plugin (its exchange parameters are foreign)".into());
        }
        if b[2] != PARAMS_VERSION {
            return Err(format!(
                "the peer's plugin speaks exchange version {} (this one {PARAMS_VERSION})",
                b[2]
            ));
        }
        let mut n = [0u8; 8];
        n.copy_from_slice(&b[8..16]);
        let p = Params {
            role: b[3],
            qps: b[4] as usize,
            notice: NoticeMode::from_code(b[5])
                .ok_or_else(|| format!("the peer names notice mode {}", b[5]))?,
            nonce: u64::from_be_bytes(n),
        };
        if p.role != role {
            return Err(format!(
                "the peer has role {} where {role} was expected",
                p.role
            ));
        }
        if p.nonce != nonce {
            return Err(format!(
                "the peer answers listen {:#x}, not this one ({nonce:#x}): a stale or misrouted \
                 handle",
                p.nonce
            ));
        }
        if p.qps != qps {
            return Err(format!(
                "the peer has {} queue pairs, this side {qps}",
                p.qps
            ));
        }
        Ok(p)
    }
}

/// A queue-pair configuration with the plugin's depths.
pub fn qp_config(cq: &Cq, send_wr: u32) -> QpConfig {
    QpConfig::new(cq)
        .max_send_wr(send_wr)
        .max_recv_wr(RECV_WR)
        .max_send_sge(1)
        .max_recv_sge(1)
        .max_inline_data(0)
}

/// A completion queue deep enough for `k` queue pairs of these depths, within the device's
/// limit.
pub fn create_cq(dev: &Dev, k: usize, send_wr: u32) -> NetResult<Cq> {
    let want = (k as u32 * (send_wr + RECV_WR) + 16).min(dev.ctx.limits().max_cqe.max(256));
    let cq = dev.ctx.create_cq(want).map_err(|e| {
        NetError::system(format!("{}: creating a completion queue: {e}", dev.name()))
    })?;
    if dev.is_soft() {
        cq.set_inline_progress(dev.inline_progress);
    }
    Ok(cq)
}

/// Allocates a registered region.
pub fn alloc(dev: &Dev, len: usize, access: Access) -> NetResult<Mr<'static>> {
    dev.pd
        .alloc(len, access)
        .map_err(|e| NetError::system(format!("{}: allocating {len} bytes: {e}", dev.name())))
}

/// Creates `k` queue pairs in INIT.
pub fn create_qps(dev: &Dev, cq: &Cq, k: usize, send_wr: u32) -> NetResult<Vec<Qp<Init>>> {
    (0..k)
        .map(|_| {
            dev.pd
                .create_qp(&qp_config(cq, send_wr))
                .map_err(|e| format!("creating a queue pair: {e}"))
                .and_then(|qp| {
                    qp.init(&InitOptions {
                        access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
                        ..InitOptions::default()
                    })
                    .map_err(|e| format!("moving a queue pair to INIT: {}", e.error))
                })
                .map_err(|e| NetError::system(format!("{}: {e}", dev.name())))
        })
        .collect()
}

/// Posts receives for `count` buffers of `len` bytes starting at `at` in `mr`, with
/// `wr_id = RX_TAG | (q << 16) | index`.
pub fn post_receives<S: CanRecv>(
    qp: &Qp<S>,
    mr: &Mr<'static>,
    q: usize,
    at: usize,
    len: usize,
    indices: std::ops::Range<usize>,
) -> NetResult<()> {
    for b in indices {
        let sge = [Sge {
            addr: mr.addr() + (at + b * len) as u64,
            length: len as u32,
            lkey: mr.lkey(),
        }];
        let wr = RawRecvWr {
            wr_id: RX_TAG | ((q as u64) << 16) | b as u64,
            sges: &sge,
        };
        #[allow(unsafe_code)]
        // SAFETY: the buffer lies inside `mr`, a region owned by the connection, which drops
        // its queue pairs before its regions; the CPU reads a buffer only after its completion
        // and before posting it again.
        unsafe { qp.post_recv_raw(&[wr]) }
            .map_err(|e| NetError::system(format!("posting a receive: {e}")))?;
    }
    Ok(())
}

/// Queue-pair timing: an ACK timeout of 4.096 µs × 2^16 ≈ 268 ms (the SDK's default is 67 ms),
/// 7 retries. A peer that dies is noticed by the connection's link long before; what the longer
/// timeout buys is that a host whose CPUs are overloaded (a soft device's packets are handled by
/// threads that must be scheduled) does not fail transfers that are only late. Lost packets are
/// resent at once on the receiver's sequence NAK; only a lost tail waits for the timeout.
pub fn connect_options() -> ConnectOptions {
    ConnectOptions {
        timeout: 16,
        ..ConnectOptions::default()
    }
}

/// Connects queue pairs in INIT to the peer's endpoints.
pub fn connect_qps(qps: Vec<Qp<Init>>, peer: &PeerInfo, dev: &Dev) -> NetResult<Vec<Qp>> {
    if peer.endpoints.len() != qps.len() {
        return Err(NetError::remote(format!(
            "the peer sent {} queue pairs for {}",
            peer.endpoints.len(),
            qps.len()
        )));
    }
    qps.into_iter()
        .zip(&peer.endpoints)
        .map(|(qp, ep)| {
            qp.connect(ep, &connect_options()).map_err(|e| {
                NetError::system(format!(
                    "{}: connecting a queue pair to {} (QPN {:#x}): {}",
                    dev.name(),
                    ep.gid,
                    ep.qp_num,
                    e.error
                ))
            })
        })
        .collect()
}

fn endpoints(qps: &[Qp<Init>]) -> NetResult<Vec<erdma::QpEndpoint>> {
    qps.iter()
        .map(|q| {
            q.endpoint()
                .map_err(|e| NetError::system(format!("reading a queue pair's endpoint: {e}")))
        })
        .collect()
}

fn cm_options(dev: &Dev) -> cm::Options {
    cm::Options {
        device: Some(dev.name().to_string()),
        source: Some(dev.oob_ip),
        ..cm::Options::default()
    }
}

type CmThread = JoinHandle<Result<Vec<Connection<()>>, String>>;

fn join_cm(t: CmThread) -> NetResult<Vec<Connection<()>>> {
    match t.join() {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(NetError::remote(e)),
        Err(_) => Err(NetError::internal("the rdma_cm helper thread panicked")),
    }
}

fn deadline_check(deadline: Instant, what: &str, link: &Link) -> NetResult<()> {
    if Instant::now() >= deadline {
        return Err(NetError::remote(format!(
            "{what} with {} did not complete in time (ERDMA_NCCL_TIMEOUT)",
            link.peer()
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The receiver: listen and accept.

/// A listening endpoint (`listen`): one TCP listener for the exchange, and one rdma_cm listener
/// when the device connects queue pairs through rdma_cm.
pub struct ListenComm {
    dev: Arc<Dev>,
    tcp: TcpListener,
    cm: Option<Arc<cm::Listener>>,
    handle: Handle,
    timeout: Duration,
    min_chunk: u64,
    accepting: Option<Accepting>,
    accepted: bool,
}

impl std::fmt::Debug for ListenComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenComm")
            .field("dev", &self.dev.name())
            .field("handle", &self.handle)
            .finish_non_exhaustive()
    }
}

struct Accepting {
    link: Link,
    deadline: Instant,
    cq: Cq,
    ctrl: Mr<'static>,
    record: Mr<'static>,
    stage: AcceptStage,
}

enum AcceptStage {
    Exchange(Vec<Qp<Init>>),
    Cm(CmThread, NoticeMode),
    Hello(Vec<Qp>, Vec<Connection<()>>, NoticeMode),
    /// Between stages (only while a step runs).
    Moving,
}

impl ListenComm {
    /// Listens on `dev`; fills NCCL's handle.
    pub fn listen(
        dev: &Arc<Dev>,
        qps: usize,
        min_chunk: u64,
        timeout: Duration,
        out: &mut [u8; HANDLE_BYTES],
    ) -> NetResult<ListenComm> {
        let tcp = TcpListener::bind(SocketAddr::new(dev.oob_ip, 0)).map_err(|e| {
            NetError::system(format!(
                "{}: listening on {} for the out-of-band exchange: {e}",
                dev.name(),
                dev.oob_ip
            ))
        })?;
        tcp.set_nonblocking(true)
            .map_err(|e| NetError::system(format!("configuring the listener: {e}")))?;
        let addr = tcp
            .local_addr()
            .map_err(|e| NetError::system(format!("reading the listener's address: {e}")))?;
        let cm = if dev.use_cm {
            let l = cm::Listener::bind_with(SocketAddr::new(dev.oob_ip, 0), &cm_options(dev))
                .map_err(|e| {
                    NetError::system(format!(
                        "{}: listening through rdma_cm on {}: {e}",
                        dev.name(),
                        dev.oob_ip
                    ))
                })?;
            Some(Arc::new(l))
        } else {
            None
        };
        let cm_port = match &cm {
            Some(l) => Some(
                l.local_addr()
                    .map_err(|e| NetError::system(format!("rdma_cm listener: {e}")))?
                    .port(),
            ),
            None => None,
        };
        let handle = Handle {
            addr,
            cm_port,
            qps,
            notice: dev.notice,
            nonce: nonce(),
        };
        handle.encode(out);
        Ok(ListenComm {
            dev: dev.clone(),
            tcp,
            cm,
            handle,
            timeout,
            min_chunk,
            accepting: None,
            accepted: false,
        })
    }

    /// One step of accepting the connection: `Some` once it is up.
    pub fn accept(&mut self) -> NetResult<Option<RecvComm>> {
        if self.accepted {
            return Err(NetError::internal(
                "accept called again on a listen object whose connection was already accepted",
            ));
        }
        if self.accepting.is_none() {
            let (stream, peer) = match self.tcp.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) => return Err(NetError::system(format!("accepting a connection: {e}"))),
            };
            let link = Link::accepted(stream, peer)
                .map_err(|e| NetError::system(format!("configuring a connection: {e}")))?;
            self.accepting = Some(self.start_accepting(link)?);
        }
        let a = self.accepting.as_mut().expect("set above");
        a.link.pump().map_err(NetError::remote)?;
        deadline_check(a.deadline, "accepting a connection", &a.link)?;
        let k = self.handle.qps;
        match std::mem::replace(&mut a.stage, AcceptStage::Moving) {
            AcceptStage::Exchange(qps) => {
                let Some(peer) = a.link.take_frame().map_err(NetError::remote)? else {
                    a.stage = AcceptStage::Exchange(qps);
                    return Ok(None);
                };
                let p = Params::decode(&peer.user, ROLE_SENDER, self.handle.nonce, k)
                    .map_err(NetError::remote)?;
                let notice = p.notice.common(self.dev.notice);
                let mut info = PeerInfo {
                    endpoints: Vec::new(),
                    regions: vec![a.record.remote()],
                    user: Params {
                        role: ROLE_RECEIVER,
                        qps: k,
                        notice,
                        nonce: self.handle.nonce,
                    }
                    .encode(),
                };
                if let Some(l) = &self.cm {
                    a.link.queue(&info).map_err(NetError::internal)?;
                    let t = spawn_cm_accept(&self.dev, &self.handle, l.clone(), &a.cq, a.deadline);
                    a.stage = AcceptStage::Cm(t, notice);
                } else {
                    info.endpoints = endpoints(&qps)?;
                    let qps = connect_qps(qps, &peer, &self.dev)?;
                    a.link.queue(&info).map_err(NetError::internal)?;
                    a.stage = AcceptStage::Hello(qps, Vec::new(), notice);
                }
                a.link.pump().map_err(NetError::remote)?;
                Ok(None)
            }
            AcceptStage::Cm(t, notice) => {
                if !t.is_finished() {
                    a.stage = AcceptStage::Cm(t, notice);
                    return Ok(None);
                }
                let conns = join_cm(t)?;
                let qps: Vec<Qp> = conns.iter().map(|c| c.qp().clone()).collect();
                for (q, qp) in qps.iter().enumerate() {
                    post_receives(
                        qp,
                        &a.ctrl,
                        q,
                        recv_ctrl::RX_AT + q * RX_PER_QP * NOTICE_BYTES,
                        NOTICE_BYTES,
                        0..RX_PER_QP,
                    )?;
                }
                a.stage = AcceptStage::Hello(qps, conns, notice);
                Ok(None)
            }
            AcceptStage::Hello(qps, conns, notice) => {
                let mut words = vec![0u8; k * 8];
                a.record
                    .read_at(record::HELLO_AT, &mut words)
                    .map_err(|e| NetError::internal(e.to_string()))?;
                let all = words
                    .chunks(8)
                    .all(|w| w == self.handle.nonce.to_be_bytes().as_slice());
                if !all {
                    a.stage = AcceptStage::Hello(qps, conns, notice);
                    return Ok(None);
                }
                let a = self.accepting.take().expect("present");
                self.accepted = true;
                info!(
                    NET,
                    "NET/erdma: {}: accepted a connection from {} ({k} queue pairs{})",
                    self.dev.name(),
                    a.link.peer(),
                    if conns.is_empty() {
                        ""
                    } else {
                        " through rdma_cm"
                    }
                );
                Ok(Some(RecvComm::new(
                    self.dev.clone(),
                    qps,
                    conns,
                    a.cq,
                    a.ctrl,
                    a.record,
                    a.link,
                    notice,
                    self.min_chunk,
                )))
            }
            AcceptStage::Moving => Err(NetError::internal("accept re-entered mid-step")),
        }
    }

    fn start_accepting(&self, link: Link) -> NetResult<Accepting> {
        let dev = &self.dev;
        let k = self.handle.qps;
        let cq = create_cq(dev, k, RECV_SIDE_SEND_WR)?;
        let ctrl = alloc(dev, recv_ctrl::LEN, Access::LOCAL_WRITE)?;
        let record = alloc(dev, record::LEN, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
        let stage = if self.cm.is_some() {
            AcceptStage::Exchange(Vec::new())
        } else {
            let qps = create_qps(dev, &cq, k, RECV_SIDE_SEND_WR)?;
            for (q, qp) in qps.iter().enumerate() {
                post_receives(
                    qp,
                    &ctrl,
                    q,
                    recv_ctrl::RX_AT + q * RX_PER_QP * NOTICE_BYTES,
                    NOTICE_BYTES,
                    0..RX_PER_QP,
                )?;
            }
            AcceptStage::Exchange(qps)
        };
        Ok(Accepting {
            link,
            deadline: Instant::now() + self.timeout,
            cq,
            ctrl,
            record,
            stage,
        })
    }
}

fn spawn_cm_accept(
    dev: &Dev,
    handle: &Handle,
    l: Arc<cm::Listener>,
    cq: &Cq,
    deadline: Instant,
) -> CmThread {
    let pd = dev.pd.clone();
    let cfg = qp_config(cq, RECV_SIDE_SEND_WR);
    let nonce = handle.nonce;
    let k = handle.qps;
    std::thread::Builder::new()
        .name("erdma-nccl-cm".into())
        .spawn(move || {
            let mut conns = Vec::with_capacity(k);
            for q in 0..k {
                let left = deadline.saturating_duration_since(Instant::now());
                let c = l
                    .accept(left, |_ctx| {
                        Ok(Setup::new(&pd, cfg.clone()).access(
                            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
                        ))
                    })
                    .map_err(|e| format!("rdma_cm accept of queue pair {q}: {e}"))?;
                check_cm_user(c.peer().user.as_slice(), nonce, q)?;
                conns.push(c);
            }
            Ok(conns)
        })
        .expect("spawning a thread")
}

/// What a connecting side puts in each rdma_cm connection's private data: the nonce and the
/// queue pair's index.
fn cm_user(nonce: u64, q: usize) -> Vec<u8> {
    let mut v = nonce.to_be_bytes().to_vec();
    v.push(q as u8);
    v
}

fn check_cm_user(b: &[u8], nonce: u64, q: usize) -> Result<(), String> {
    if b == cm_user(nonce, q).as_slice() {
        Ok(())
    } else {
        Err(format!(
            "an rdma_cm connection for another listen or queue pair arrived (expected queue pair \
             {q} of listen {nonce:#x})"
        ))
    }
}

fn nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish() | 1
}

// ---------------------------------------------------------------------------------------------
// The sender: connect.

/// A connection `connect` is building (its id lives in the sender's copy of the handle).
pub struct Connecting {
    inner: Option<Conn>,
}

impl std::fmt::Debug for Connecting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Some(c) => f
                .debug_struct("Connecting")
                .field("dev", &c.dev.name())
                .field("handle", &c.handle)
                .finish_non_exhaustive(),
            None => f.write_str("Connecting(finished)"),
        }
    }
}

struct Conn {
    dev: Arc<Dev>,
    handle: Handle,
    link: Link,
    deadline: Instant,
    cq: Cq,
    ctrl: Mr<'static>,
    notice: NoticeMode,
    min_chunk: u64,
    stage: ConnectStage,
}

enum ConnectStage {
    Exchange(Vec<Qp<Init>>),
    Cm(CmThread, RemoteMr),
    Moving,
}

/// A step's outcome: wait, or connect with these queue pairs to this record region.
enum Step {
    Pending,
    Ready(Vec<Qp>, Vec<Connection<()>>, RemoteMr),
}

impl Connecting {
    /// Starts connecting `dev` to the receiver the handle names.
    pub fn start(
        dev: &Arc<Dev>,
        handle: Handle,
        min_chunk: u64,
        timeout: Duration,
    ) -> NetResult<Connecting> {
        let k = handle.qps;
        let notice = handle.notice.common(dev.notice);
        let cq = create_cq(dev, k, SEND_WR)?;
        let mut ctrl = alloc(dev, send_ctrl::LEN, Access::LOCAL_WRITE)?;
        ctrl.write_at(send_ctrl::HELLO_AT, &handle.nonce.to_be_bytes())
            .map_err(|e| NetError::internal(e.to_string()))?;
        let mut info = PeerInfo {
            user: Params {
                role: ROLE_SENDER,
                qps: k,
                notice,
                nonce: handle.nonce,
            }
            .encode(),
            ..PeerInfo::default()
        };
        let qps = if handle.cm_port.is_some() {
            Vec::new()
        } else {
            let qps = create_qps(dev, &cq, k, SEND_WR)?;
            post_receives(&qps[0], &ctrl, 0, 0, CTS_BYTES, 0..CTS_RX)?;
            info.endpoints = endpoints(&qps)?;
            qps
        };
        let mut link = Link::connect(handle.addr).map_err(|e| {
            NetError::remote(format!(
                "connecting to {} (the receiver's listen): {e}",
                handle.addr
            ))
        })?;
        link.queue(&info).map_err(NetError::internal)?;
        Ok(Connecting {
            inner: Some(Conn {
                dev: dev.clone(),
                handle,
                link,
                deadline: Instant::now() + timeout,
                cq,
                ctrl,
                notice,
                min_chunk,
                stage: ConnectStage::Exchange(qps),
            }),
        })
    }

    /// One step: `Some` once the connection is up.
    pub fn step(&mut self) -> NetResult<Option<SendComm>> {
        let c = self.inner.as_mut().ok_or_else(|| {
            NetError::internal("connect called again after it returned the connection")
        })?;
        match c.step()? {
            Step::Pending => Ok(None),
            Step::Ready(qps, conns, region) => {
                let c = self.inner.take().expect("present");
                c.finish(qps, conns, region).map(Some)
            }
        }
    }
}

impl Conn {
    fn step(&mut self) -> NetResult<Step> {
        self.link.pump().map_err(NetError::remote)?;
        deadline_check(self.deadline, "connecting", &self.link)?;
        let k = self.handle.qps;
        match std::mem::replace(&mut self.stage, ConnectStage::Moving) {
            ConnectStage::Exchange(qps) => {
                let Some(peer) = self.link.take_frame().map_err(NetError::remote)? else {
                    self.stage = ConnectStage::Exchange(qps);
                    return Ok(Step::Pending);
                };
                let p = Params::decode(&peer.user, ROLE_RECEIVER, self.handle.nonce, k)
                    .map_err(NetError::remote)?;
                if p.notice != self.notice {
                    return Err(NetError::remote(format!(
                        "the receiver chose notice mode {:?}, this side {:?}",
                        p.notice, self.notice
                    )));
                }
                let region = match peer.regions.first() {
                    Some(r) if r.len >= record::LEN as u64 => *r,
                    _ => {
                        return Err(NetError::remote(
                            "the receiver granted no record region of the right size",
                        ));
                    }
                };
                if let Some(port) = self.handle.cm_port {
                    let t = self.spawn_cm_connect(SocketAddr::new(self.handle.addr.ip(), port));
                    self.stage = ConnectStage::Cm(t, region);
                    return Ok(Step::Pending);
                }
                let qps = connect_qps(qps, &peer, &self.dev)?;
                Ok(Step::Ready(qps, Vec::new(), region))
            }
            ConnectStage::Cm(t, region) => {
                if !t.is_finished() {
                    self.stage = ConnectStage::Cm(t, region);
                    return Ok(Step::Pending);
                }
                let conns = join_cm(t)?;
                let qps: Vec<Qp> = conns.iter().map(|c| c.qp().clone()).collect();
                post_receives(&qps[0], &self.ctrl, 0, 0, CTS_BYTES, 0..CTS_RX)?;
                Ok(Step::Ready(qps, conns, region))
            }
            ConnectStage::Moving => Err(NetError::internal("connect re-entered mid-step")),
        }
    }

    fn spawn_cm_connect(&self, addr: SocketAddr) -> CmThread {
        let pd = self.dev.pd.clone();
        let cfg = qp_config(&self.cq, SEND_WR);
        let opts = cm_options(&self.dev);
        let nonce = self.handle.nonce;
        let k = self.handle.qps;
        let deadline = self.deadline;
        std::thread::Builder::new()
            .name("erdma-nccl-cm".into())
            .spawn(move || {
                let mut conns = Vec::with_capacity(k);
                for q in 0..k {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let c = cm::connect_with(addr, left, &opts, |_ctx| {
                        Ok(Setup::new(&pd, cfg.clone())
                            .access(
                                Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
                            )
                            .user_data(cm_user(nonce, q)))
                    })
                    .map_err(|e| format!("rdma_cm connect of queue pair {q} to {addr}: {e}"))?;
                    conns.push(c);
                }
                Ok(conns)
            })
            .expect("spawning a thread")
    }

    fn finish(
        self,
        qps: Vec<Qp>,
        conns: Vec<Connection<()>>,
        region: RemoteMr,
    ) -> NetResult<SendComm> {
        // The first message on every queue pair: the hello word the receiver waits for.
        for (q, qp) in qps.iter().enumerate() {
            let target = RemoteMr {
                addr: region.addr + (record::HELLO_AT + q * 8) as u64,
                len: 8,
                rkey: region.rkey,
            };
            crate::send::write_quiet(qp, &self.ctrl, send_ctrl::HELLO_AT, 8, target)?;
        }
        info!(
            NET,
            "NET/erdma: {}: connected to {} ({} queue pairs{})",
            self.dev.name(),
            self.link.peer(),
            qps.len(),
            if conns.is_empty() {
                ""
            } else {
                " through rdma_cm"
            }
        );
        Ok(SendComm::new(
            self.dev,
            qps,
            conns,
            self.cq,
            self.ctrl,
            self.link,
            self.notice,
            region,
            self.min_chunk,
        ))
    }
}

/// Shared handles NCCL sees.
pub type Shared<T> = Arc<Mutex<T>>;

/// Logs the start of a listen (for `NCCL_DEBUG=INFO`).
pub fn log_listen(l: &ListenComm) {
    info!(
        INIT | NET,
        "NET/erdma: {}: listening on {}{}",
        l.dev.name(),
        l.handle.addr,
        match l.handle.cm_port {
            Some(p) => format!(" (rdma_cm port {p})"),
            None => String::new(),
        }
    );
}

#[cfg(test)]
mod tests;
