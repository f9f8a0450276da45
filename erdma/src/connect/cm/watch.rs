//! A connection's liveness: one thread per [`super::Connection`] watches the link the connection
//! was made over, and when the peer goes away it moves the queue pair to the error state, so
//! every request still outstanding — receives included, which RC never times out — completes
//! with a flush error naming the lost peer ([`QpFailure::PeerLost`]).
//!
//! - **soft** (the TCP link): both sides send a one-byte heartbeat every
//!   [`super::Options::heartbeat`]. The link ends when the peer closes or resets it (its process
//!   exited or was killed: the kernel closes its sockets) or when nothing arrives for
//!   [`super::Options::peer_timeout`] (its host or the network is gone).
//! - **rdma_cm**: the identifier's DISCONNECTED event (or DEVICE_REMOVAL).
//!
//! Must not: touch the queue pair beyond moving it to ERROR, or read the link's events once the
//! connection is handed back (it is the only reader after that).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::rdma::CmId;
use crate::connect::is_retry;
use crate::error::{Error, Result};
use crate::qp::{Qp, QpShared, Rts};
use crate::vocab::{PeerLoss, QpFailure};

/// The default of [`super::Options::heartbeat`].
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_millis(500);
/// The default of [`super::Options::peer_timeout`].
pub const DEFAULT_PEER_TIMEOUT: Duration = Duration::from_secs(5);

/// How the watch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ended {
    /// The peer went away (or disconnected first).
    Peer(PeerLoss),
    /// This side closed the connection.
    Local,
}

#[derive(Default)]
struct State {
    /// This side is closing: an end of the link is expected, not a lost peer.
    closing: bool,
    /// Stop watching (the connection is finished).
    stop: bool,
    ended: Option<Ended>,
}

/// What the watcher and the connection share.
#[derive(Default)]
pub(super) struct Watch {
    state: Mutex<State>,
    changed: Condvar,
}

impl Watch {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This side is closing the connection: what ends the link now is not a lost peer.
    pub(super) fn set_closing(&self) {
        self.lock().closing = true;
    }

    /// The watcher should stop (after [`Watch::set_closing`]).
    pub(super) fn stop(&self) {
        let mut s = self.lock();
        s.closing = true;
        s.stop = true;
    }

    fn closing(&self) -> bool {
        self.lock().closing
    }

    fn stopped(&self) -> bool {
        self.lock().stop
    }

    fn end(&self, how: Ended) {
        let mut s = self.lock();
        if s.ended.is_none() {
            s.ended = Some(how);
        }
        self.changed.notify_all();
    }

    /// Waits until the link ends, or `deadline`.
    pub(super) fn wait_end(&self, deadline: Instant, what: &str) -> Result<Ended> {
        let mut s = self.lock();
        loop {
            if let Some(e) = s.ended {
                return Ok(e);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: what.to_string(),
                });
            }
            s = self
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// How long a peer that closed or disconnected gets for its last acknowledgements: they left it
/// before its end of the link did, but this side's device may not have taken them in when the
/// watcher sees the end (both arrive together on loopback). Only while sends are outstanding.
const LAST_ACKS: Duration = Duration::from_millis(100);

/// Records the end and, for a lost peer, moves the queue pair to the error state (when it still
/// exists).
fn conclude(watch: &Watch, qp: Option<&QpShared>, how: Ended) {
    if let (Ended::Peer(loss), Some(qp)) = (how, qp) {
        if matches!(loss, PeerLoss::Closed | PeerLoss::Disconnected) {
            // Without this, a peer that takes its last message and leaves at once can fail the
            // send that carried it, whose acknowledgement was on the way.
            let until = Instant::now() + LAST_ACKS;
            while qp.sends_outstanding() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // The queue pair may already be in ERROR: nothing else to do.
        let _ = qp.fail(QpFailure::PeerLost(loss));
    }
    watch.end(how);
}

/// Starts watching a soft connection's TCP link (`stream`, a descriptor of its own).
pub(super) fn spawn_soft(
    stream: TcpStream,
    qp: Qp<Rts>,
    watch: Arc<Watch>,
    heartbeat: Duration,
    peer_timeout: Duration,
) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("erdma-liveness".into())
        .spawn(move || {
            let how = watch_soft(&stream, &watch, heartbeat, peer_timeout);
            conclude(&watch, Some(&qp.shared), how);
            // Close the link for the peer too, so a peer that is disconnecting sees the end.
            let _ = stream.shutdown(Shutdown::Both);
        })
        .map_err(|e| Error::io("starting a connection's liveness thread", e))
}

fn watch_soft(
    mut s: &TcpStream,
    watch: &Watch,
    heartbeat: Duration,
    peer_timeout: Duration,
) -> Ended {
    let heartbeat = heartbeat.max(Duration::from_millis(1));
    let lost = |watch: &Watch| {
        if watch.closing() {
            Ended::Local
        } else {
            Ended::Peer(PeerLoss::Closed)
        }
    };
    let _ = s.set_write_timeout(Some(heartbeat));
    let mut heard = Instant::now();
    let mut sent = Instant::now();
    let mut buf = [0u8; 64];
    loop {
        let now = Instant::now();
        if now >= sent + heartbeat && !watch.closing() {
            match s.write(b"H") {
                // A full socket buffer means the peer reads nothing: its silence decides.
                Ok(_) => sent = now,
                Err(e) if is_retry(&e) => sent = now,
                Err(_) => return lost(watch),
            }
        }
        let silent = now.saturating_duration_since(heard);
        if silent >= peer_timeout {
            return if watch.closing() {
                Ended::Local
            } else {
                Ended::Peer(PeerLoss::Silent(silent))
            };
        }
        let wait = (sent + heartbeat)
            .saturating_duration_since(now)
            .min(peer_timeout - silent)
            .max(Duration::from_millis(1));
        if s.set_read_timeout(Some(wait)).is_err() {
            return lost(watch);
        }
        match s.read(&mut buf) {
            Ok(0) => return lost(watch),
            Ok(_) => heard = Instant::now(),
            Err(e) if is_retry(&e) => {}
            Err(_) => return lost(watch),
        }
    }
}

/// Starts watching an rdma_cm connection's identifier for DISCONNECTED. The watcher is not
/// waited for when the connection is dropped (it notices within its tick), so it keeps the queue
/// pair only weakly: a dropped queue pair is destroyed at once, as without it.
pub(super) fn spawn_cm(id: Arc<CmId>, qp: &Qp<Rts>, watch: Arc<Watch>) -> Result<JoinHandle<()>> {
    let qp: Weak<QpShared> = Arc::downgrade(&qp.shared);
    std::thread::Builder::new()
        .name("erdma-liveness".into())
        .spawn(move || {
            let how = id.watch_disconnect(&|| watch.stopped(), &|| watch.closing());
            conclude(&watch, qp.upgrade().as_deref(), how);
        })
        .map_err(|e| Error::io("starting a connection's liveness thread", e))
}
