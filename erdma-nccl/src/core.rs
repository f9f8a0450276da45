//! What the two sides of a connection share: its queue pairs, completion queue and link, the
//! error that ended it, and how completions are reaped and the peer's liveness checked.

use std::time::{Duration, Instant};

use erdma::connect::cm::Connection;
use erdma::{Completion, Cq, Qp};

use crate::error::{NetError, NetResult};
use crate::link::{Link, Peer};

/// How often a waiting request asks the link whether the peer is alive.
pub const LIVENESS_EVERY: Duration = Duration::from_millis(50);
/// How long a failed request waits for the link to say why, once per connection.
const FAILURE_CAUSE_WAIT: Duration = Duration::from_millis(100);

/// A connection's transport.
pub struct Core {
    // Drop order: the rdma_cm connections and the queue pairs go first, so the device has let
    // go of every region of the side that owns this core before the side frees them.
    _conns: Vec<Connection<()>>,
    /// The queue pairs, queue pair 0 first.
    pub qps: Vec<Qp>,
    /// Where every request of the connection completes.
    pub cq: Cq,
    link: Link,
    dead: Option<NetError>,
    last_check: Instant,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("peer", &self.link.peer())
            .field("qps", &self.qps.len())
            .field("dead", &self.dead)
            .finish_non_exhaustive()
    }
}

/// A side of a connection that handles its completions.
pub trait Completions {
    /// Its transport.
    fn core(&mut self) -> &mut Core;
    /// Handles one completion.
    fn on_completion(&mut self, c: &Completion) -> NetResult<()>;
}

/// Reaps every completion there is.
pub fn progress(side: &mut impl Completions) -> NetResult<()> {
    let mut comps = [Completion::default(); 16];
    loop {
        let n = side.core().poll(&mut comps)?;
        for c in &comps[..n] {
            side.on_completion(c)?;
        }
        if n < comps.len() {
            return Ok(());
        }
    }
}

impl Core {
    /// A connected transport.
    pub fn new(qps: Vec<Qp>, conns: Vec<Connection<()>>, cq: Cq, link: Link) -> Core {
        Core {
            _conns: conns,
            qps,
            cq,
            link,
            dead: None,
            last_check: Instant::now(),
        }
    }

    fn poll(&mut self, out: &mut [Completion]) -> NetResult<usize> {
        self.cq.poll(out).map_err(|e| {
            self.fail(NetError::system(format!(
                "polling the completion queue: {e}"
            )))
        })
    }

    /// Ends the connection with `e`: its queue pairs go to the error state (the rest of its
    /// requests flush) and every later call fails with `e`.
    pub fn fail(&mut self, e: NetError) -> NetError {
        if self.dead.is_none() {
            self.dead = Some(e.clone());
            for qp in &self.qps {
                let _ = qp.to_error();
            }
        }
        e
    }

    /// The error that ended the connection, if one did.
    pub fn alive(&self) -> NetResult<()> {
        match &self.dead {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Ends the connection for something the peer sent that breaks the protocol.
    pub fn protocol(&mut self, msg: String) -> NetError {
        let e = NetError::remote(format!(
            "protocol error on the connection with {}: {msg}",
            self.link.peer()
        ));
        self.fail(e)
    }

    /// Handles an unsuccessful completion of `what`: the end of the connection, unless it
    /// already ended (then it is one of the flushed requests).
    pub fn failed(&mut self, c: &Completion, what: &str) -> NetResult<()> {
        if self.dead.is_some() {
            return Ok(());
        }
        // A failed request mostly means the peer went away, and its link then says how. The
        // link's end and the queue pair's failure race (on iWARP the kernel fails the queue pair
        // as the peer's TCP connection closes), so the link gets a moment to tell.
        let deadline = Instant::now() + FAILURE_CAUSE_WAIT;
        let cause = loop {
            match self.link.check() {
                Peer::Dead(why) => break why,
                Peer::Closed => break format!("{} had closed the connection", self.link.peer()),
                Peer::Alive if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Peer::Alive => break "the peer or the network failed".to_string(),
            }
        };
        let e = NetError::remote(format!(
            "{what} on queue pair {:#x} with {} failed: {} (vendor error {:#x}); {cause}",
            c.qp_num,
            self.link.peer(),
            c.status,
            c.vendor_err
        ));
        Err(self.fail(e))
    }

    /// Asks the link, at most every [`LIVENESS_EVERY`], whether the peer is still there. A
    /// peer that closed in order is an error only where `closed_is_error` (a receiver waiting
    /// for data that will never come).
    pub fn check_link(&mut self, closed_is_error: bool) -> NetResult<()> {
        if self.last_check.elapsed() < LIVENESS_EVERY {
            return Ok(());
        }
        self.last_check = Instant::now();
        match self.link.check() {
            Peer::Alive => Ok(()),
            Peer::Closed if !closed_is_error => Ok(()),
            Peer::Closed => {
                let e = NetError::remote(format!(
                    "{} closed the connection while receives were outstanding",
                    self.link.peer()
                ));
                Err(self.fail(e))
            }
            Peer::Dead(why) => Err(self.fail(NetError::remote(why))),
        }
    }

    /// Whether the peer's end of the link has closed.
    pub fn peer_finished(&mut self) -> bool {
        self.link.peer_finished()
    }

    /// Closes this side of the link in order.
    pub fn close_link(&mut self) {
        self.link.close();
    }

    /// The peer's address, for logs.
    pub fn peer(&self) -> &str {
        self.link.peer()
    }
}
