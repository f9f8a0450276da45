//! Rank bootstrap: who is who in a job, and a TCP star through rank 0 to swap setup data.
//!
//! Every process knows its rank, the world size and where rank 0 listens (the variables
//! `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` that torchrun and mpirun set). Rank 0
//! accepts one connection from every other rank; [`Bootstrap::all_gather`] then gives every rank
//! every rank's bytes, and [`Bootstrap::barrier`] waits for all. Messages are versioned and
//! length-checked; every wait is bounded: a rank that never comes, sends garbage or dies gives
//! a clear [`Error`] in bounded time.
//!
//! Format (big-endian): `"ERBS" | version u16 (=1) | kind u8 | 0 u8 | rank u32 | world u32 |
//! body length u32 (≤ 1 MiB) | body`. Kinds: 1 hello (empty body), 2 contribution (the rank's
//! bytes), 3 table (`count u32`, then `length u32 | bytes` per rank).

#![allow(unsafe_code)] // socket descriptor syscalls (fcntl, dup) for the rank launcher

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::connect::{self, Listener};
use crate::error::{Error, Result};

const MAGIC: [u8; 4] = *b"ERBS";
const VERSION: u16 = 1;
const HEADER_LEN: usize = 20;
/// Largest message body accepted.
pub const MAX_BODY: usize = 1 << 20;
/// Largest job the bootstrap accepts.
pub const MAX_WORLD: usize = 4096;

const HELLO: u8 = 1;
const CONTRIBUTION: u8 = 2;
const TABLE: u8 = 3;

/// This process's place in a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankInfo {
    /// This process's rank, `0..world`.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Where rank 0 listens (`host:port`).
    pub master: String,
}

impl RankInfo {
    /// Reads `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` from the environment.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the variable that is missing or malformed, or a rank
    /// outside the world.
    pub fn from_env() -> Result<RankInfo> {
        RankInfo::from_vars(|name| std::env::var(name).ok())
    }

    /// [`RankInfo::from_env`] over `get`, which looks a variable up.
    fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<RankInfo> {
        let var = |name: &str| {
            get(name)
                .ok_or_else(|| Error::invalid(format!("environment variable {name} is not set")))
        };
        let num = |name: &str| -> Result<usize> {
            let v = var(name)?;
            v.trim()
                .parse()
                .map_err(|_| Error::invalid(format!("{name}={v} is not a number")))
        };
        let port = var("MASTER_PORT")?;
        let port: u16 = port
            .trim()
            .parse()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| {
                Error::invalid(format!("MASTER_PORT={port} is not a port (1..=65535)"))
            })?;
        let info = RankInfo {
            rank: num("RANK")?,
            world: num("WORLD_SIZE")?,
            master: format!("{}:{port}", var("MASTER_ADDR")?),
        };
        info.validate()?;
        Ok(info)
    }

    /// Where rank 0 listens, resolved.
    fn master_addr(&self) -> Result<SocketAddr> {
        self.master
            .to_socket_addrs()
            .map_err(|e| Error::io(format!("resolving the master address {}", self.master), e))?
            .next()
            .ok_or_else(|| Error::invalid(format!("{} resolves to no address", self.master)))
    }

    fn validate(&self) -> Result<()> {
        if self.world == 0 || self.world > MAX_WORLD || self.rank >= self.world {
            return Err(Error::invalid(format!(
                "rank {} of a world of {} (world must be 1..={MAX_WORLD}, rank below it)",
                self.rank, self.world
            )));
        }
        Ok(())
    }
}

/// The connections of a bootstrapped job (rank 0: one per other rank; others: one to rank 0).
#[derive(Debug)]
pub struct Bootstrap {
    info: RankInfo,
    /// Rank 0: the stream of rank `i` at index `i - 1`. Others: the stream to rank 0.
    streams: Vec<TcpStream>,
    timeout: Duration,
}

impl Bootstrap {
    /// Joins the job: rank 0 listens on the master's port (all interfaces of the master
    /// address's family) and waits for every other rank; the others dial it. `timeout` bounds
    /// this and every later exchange.
    ///
    /// # Errors
    /// [`Error::Timeout`] when a rank does not come in time, [`Error::Protocol`] for a peer that
    /// speaks another format, claims a rank twice or disagrees on the world size,
    /// [`Error::Io`] for socket failures.
    pub fn join(info: RankInfo, timeout: Duration) -> Result<Bootstrap> {
        info.validate()?;
        let master = info.master_addr()?;
        let deadline = crate::sync::deadline(timeout);
        let streams = if info.rank == 0 {
            // Every interface of the family the others dial (IPv4 or IPv6).
            let any: std::net::IpAddr = if master.is_ipv6() {
                std::net::Ipv6Addr::UNSPECIFIED.into()
            } else {
                std::net::Ipv4Addr::UNSPECIFIED.into()
            };
            let listener = Listener::bind(SocketAddr::new(any, master.port()))?;
            accept_ranks(&listener, &info, deadline)?
        } else {
            let mut s = connect::dial(master, timeout)?;
            write_msg(&mut s, HELLO, &info, &[], deadline)?;
            vec![s]
        };
        Ok(Bootstrap {
            info,
            streams,
            timeout,
        })
    }

    /// Joins the job as rank 0 of `world` on a socket the caller already listens on (bound to
    /// any port, one the system picked included), so that no other program can take the
    /// master's port between choosing it and listening on it. The other ranks dial its port
    /// with [`Bootstrap::join`]. `timeout` bounds this and every later exchange. Once every
    /// rank has joined, the socket stops listening (for every descriptor of it).
    ///
    /// # Errors
    /// As [`Bootstrap::join`]; [`Error::Io`] when the socket has no local address.
    pub fn host(listener: TcpListener, world: usize, timeout: Duration) -> Result<Bootstrap> {
        let listener = Listener::from(listener);
        let info = RankInfo {
            rank: 0,
            world,
            master: listener.local_addr()?.to_string(),
        };
        info.validate()?;
        let streams = accept_ranks(&listener, &info, crate::sync::deadline(timeout))?;
        // Every rank is here: a late or stray connection is refused at once rather than left
        // queued for nobody (a launcher may keep another descriptor of this socket open).
        listener.stop_listening();
        Ok(Bootstrap {
            info,
            streams,
            timeout,
        })
    }

    /// Joins the job described by the environment (see [`RankInfo::from_env`]). Rank 0 takes
    /// the listening socket a launcher handed it ([`MasterSocket::pass_to`]) when
    /// [`MASTER_FD_VAR`] names one, and listens on `MASTER_PORT` itself otherwise.
    ///
    /// # Errors
    /// As [`RankInfo::from_env`], [`Bootstrap::join`] and [`Bootstrap::host`];
    /// [`Error::InvalidArgument`] when [`MASTER_FD_VAR`] does not name a socket listening on
    /// `MASTER_PORT`.
    pub fn from_env(timeout: Duration) -> Result<Bootstrap> {
        let info = RankInfo::from_env()?;
        match std::env::var(MASTER_FD_VAR) {
            Ok(fd) if info.rank == 0 => {
                let listener = inherited_listener(&fd, info.master_addr()?.port())?;
                Bootstrap::host(listener, info.world, timeout)
            }
            _ => Bootstrap::join(info, timeout),
        }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.info.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.info.world
    }

    /// Every rank's `mine`, indexed by rank (this rank's own included).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `mine` exceeds [`MAX_BODY`] (or, at rank 0, the table
    /// would); [`Error::Timeout`], [`Error::Protocol`] or [`Error::Io`] when a rank is slow,
    /// malformed or gone.
    pub fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        if mine.len() > MAX_BODY {
            return Err(Error::invalid(format!(
                "a {}-byte contribution exceeds the bootstrap's {MAX_BODY}-byte limit",
                mine.len()
            )));
        }
        let deadline = crate::sync::deadline(self.timeout);
        if self.info.rank == 0 {
            // The table (its count, then a length and the bytes per rank) grows as the
            // contributions come and is checked at each, so no more than the limit is ever held.
            let mut table = (self.info.world as u32).to_be_bytes().to_vec();
            let mut all = Vec::with_capacity(self.info.world);
            let mut add = |rank: usize, body: Vec<u8>| -> Result<()> {
                table.extend_from_slice(&(body.len() as u32).to_be_bytes());
                table.extend_from_slice(&body);
                if table.len() > MAX_BODY {
                    return Err(Error::invalid(format!(
                        "the gathered table would exceed the bootstrap's {MAX_BODY}-byte limit \
                         (at rank {rank}'s contribution)"
                    )));
                }
                all.push(body);
                Ok(())
            };
            add(0, mine.to_vec())?;
            for (i, s) in self.streams.iter_mut().enumerate() {
                let want = i + 1;
                let (kind, rank, _, body) =
                    read_msg(s, deadline, &format!("rank {want}'s contribution"))?;
                if kind != CONTRIBUTION || rank != want {
                    return Err(Error::protocol(format!(
                        "expected rank {want}'s contribution, got kind {kind} from rank {rank}"
                    )));
                }
                add(want, body)?;
            }
            for s in &mut self.streams {
                write_msg(s, TABLE, &self.info, &table, deadline)?;
            }
            Ok(all)
        } else {
            let s = &mut self.streams[0];
            write_msg(s, CONTRIBUTION, &self.info, mine, deadline)?;
            let (kind, _, _, body) = read_msg(s, deadline, "the gathered table from rank 0")?;
            if kind != TABLE {
                return Err(Error::protocol(format!(
                    "expected the gathered table from rank 0, got message kind {kind}"
                )));
            }
            parse_table(&body, self.info.world)
        }
    }

    /// Returns once every rank has called it.
    ///
    /// # Errors
    /// As [`Bootstrap::all_gather`].
    pub fn barrier(&mut self) -> Result<()> {
        self.all_gather(&[]).map(|_| ())
    }
}

/// Rank 0: accepts a hello from every other rank on `listener`, returning their streams in
/// rank order.
fn accept_ranks(listener: &Listener, info: &RankInfo, deadline: Instant) -> Result<Vec<TcpStream>> {
    let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
    let mut slots: Vec<Option<TcpStream>> = (1..info.world).map(|_| None).collect();
    for _ in 1..info.world {
        let left = deadline.saturating_duration_since(Instant::now());
        let (mut s, from) = listener.accept(left).map_err(|e| match e {
            Error::Timeout { .. } => Error::Timeout {
                what: format!(
                    "ranks to join the job at port {port} ({} of {} came)",
                    slots.iter().filter(|s| s.is_some()).count() + 1,
                    info.world
                ),
            },
            e => e,
        })?;
        let (kind, rank, world, body) = read_msg(&mut s, deadline, "a hello")?;
        if kind != HELLO || !body.is_empty() {
            return Err(Error::protocol(format!(
                "{from}: expected a hello, got message kind {kind}"
            )));
        }
        if world != info.world {
            return Err(Error::protocol(format!(
                "rank {rank} at {from} says the world has {world} ranks, rank 0 says {}",
                info.world
            )));
        }
        if rank == 0 || rank >= info.world || slots[rank - 1].is_some() {
            return Err(Error::protocol(format!(
                "{from} claims rank {rank}, which is not free (world of {})",
                info.world
            )));
        }
        slots[rank - 1] = Some(s);
    }
    Ok(slots.into_iter().flatten().collect())
}

/// The environment variable that names the descriptor of rank 0's listening socket, set by
/// [`MasterSocket::pass_to`] and read by [`Bootstrap::from_env`].
pub const MASTER_FD_VAR: &str = "ERDMA_MASTER_FD";

/// Rank 0's listening socket, bound by a launcher before it starts the ranks: the master's
/// port is then never free between choosing it and listening on it, so no other connection or
/// job can take it. Bind it (port 0 lets the system pick), start rank 0 with
/// [`MasterSocket::pass_to`] and every rank with `MASTER_PORT` set to [`MasterSocket::port`];
/// rank 0's [`Bootstrap::from_env`] accepts on the socket it inherited.
#[derive(Debug)]
pub struct MasterSocket {
    listener: Listener,
    port: u16,
}

impl MasterSocket {
    /// Listens on `addr` (`0.0.0.0:0`: every interface, a port the system picks).
    ///
    /// # Errors
    /// [`Error::Io`] naming the address.
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<MasterSocket> {
        let listener = Listener::bind(addr)?;
        let port = listener.local_addr()?.port();
        Ok(MasterSocket { listener, port })
    }

    /// The port it listens on: every rank's `MASTER_PORT`.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Makes the process `cmd` starts inherit the socket, named by [`MASTER_FD_VAR`]: start
    /// rank 0 with it. `cmd` keeps a descriptor of its own for the socket (closed when `cmd`
    /// is dropped), so this value may be dropped at any time.
    ///
    /// # Errors
    /// [`Error::Io`] when the descriptor cannot be copied (the process has too many open).
    pub fn pass_to<'c>(&self, cmd: &'c mut Command) -> Result<&'c mut Command> {
        let copy = self
            .listener
            .try_clone_fd()
            .map_err(|e| Error::io("copying the master socket's descriptor", e))?;
        cmd.env(MASTER_FD_VAR, copy.as_raw_fd().to_string());
        let keep = move || {
            // The child's copy of the descriptor loses close-on-exec, so it survives exec.
            // SAFETY: fcntl(2) on a descriptor number, async-signal-safe as a pre-exec hook must be.
            match unsafe { libc::fcntl(copy.as_raw_fd(), libc::F_SETFD, 0) } {
                -1 => Err(std::io::Error::last_os_error()),
                _ => Ok(()),
            }
        };
        // The hook owns `copy`, so the descriptor is open in the parent at fork and in the child
        // after it; the hook allocates nothing and takes no lock.
        // SAFETY: the hook only calls fcntl(2), which is async-signal-safe.
        Ok(unsafe { cmd.pre_exec(keep) })
    }
}

/// The listening socket named by `value` (a descriptor number from [`MASTER_FD_VAR`]), checked
/// to listen on `port`. The result is a copy of it; both close on exec.
fn inherited_listener(value: &str, port: u16) -> Result<TcpListener> {
    let bad = |why: String| Error::invalid(format!("{MASTER_FD_VAR}={value}: {why}"));
    let fd: RawFd = value
        .trim()
        .parse()
        .ok()
        .filter(|fd| *fd >= 0)
        .ok_or_else(|| bad("not a descriptor number".into()))?;
    // SAFETY: fcntl(2) F_DUPFD_CLOEXEC reads only the number; an unopened one gives EBADF.
    let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    if copy < 0 {
        let e = std::io::Error::last_os_error();
        return Err(bad(format!("not an open descriptor ({e})")));
    }
    // SAFETY: fcntl just created `copy`, and nothing else in the process knows of it.
    let copy = unsafe { OwnedFd::from_raw_fd(copy) };
    let mut listening: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt(2) on our own descriptor into an int of the length given.
    let r = unsafe {
        libc::getsockopt(
            copy.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ACCEPTCONN,
            (&raw mut listening).cast(),
            &mut len,
        )
    };
    if r != 0 || listening == 0 {
        return Err(bad("not a listening socket".into()));
    }
    let listener = TcpListener::from(copy);
    match listener.local_addr() {
        Ok(a) if a.port() == port => {}
        Ok(a) => return Err(bad(format!("listens on {a}, not on MASTER_PORT={port}"))),
        Err(e) => return Err(bad(format!("not a TCP socket ({e})"))),
    }
    // The inherited number is the launcher's socket for this rank alone (checked above): it
    // stays open, but closes on exec, so no process this one starts keeps the port.
    // SAFETY: fcntl(2) F_SETFD changes only the flags of that descriptor.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    Ok(listener)
}

fn parse_table(body: &[u8], world: usize) -> Result<Vec<Vec<u8>>> {
    let bad = |what: &str| Error::protocol(format!("malformed table from rank 0: {what}"));
    let take = |at: &mut usize, n: usize| -> Result<&[u8]> {
        let end = at.checked_add(n).filter(|e| *e <= body.len());
        let end = end.ok_or_else(|| bad("truncated"))?;
        let s = &body[*at..end];
        *at = end;
        Ok(s)
    };
    let mut at = 0;
    let count = u32::from_be_bytes(take(&mut at, 4)?.try_into().map_err(|_| bad("count"))?);
    if count as usize != world {
        return Err(bad(&format!("{count} entries for a world of {world}")));
    }
    let mut out = Vec::with_capacity(world);
    for _ in 0..world {
        let len = u32::from_be_bytes(take(&mut at, 4)?.try_into().map_err(|_| bad("length"))?);
        out.push(take(&mut at, len as usize)?.to_vec());
    }
    if at != body.len() {
        return Err(bad("trailing bytes"));
    }
    Ok(out)
}

fn write_msg(
    s: &mut TcpStream,
    kind: u8,
    info: &RankInfo,
    body: &[u8],
    deadline: Instant,
) -> Result<()> {
    let mut msg = Vec::with_capacity(HEADER_LEN + body.len());
    msg.extend_from_slice(&MAGIC);
    msg.extend_from_slice(&VERSION.to_be_bytes());
    msg.push(kind);
    msg.push(0);
    msg.extend_from_slice(&(info.rank as u32).to_be_bytes());
    msg.extend_from_slice(&(info.world as u32).to_be_bytes());
    msg.extend_from_slice(&(body.len() as u32).to_be_bytes());
    msg.extend_from_slice(body);
    connect::write_all_by(s, &msg, deadline, "a bootstrap message")
}

/// Reads one message: (kind, rank, world, body).
fn read_msg(
    s: &mut TcpStream,
    deadline: Instant,
    what: &str,
) -> Result<(u8, usize, usize, Vec<u8>)> {
    let mut h = [0u8; HEADER_LEN];
    connect::read_exact_by(s, &mut h, deadline, what)?;
    let (kind, rank, world, len) = parse_header(&h)?;
    let mut body = vec![0u8; len];
    connect::read_exact_by(s, &mut body, deadline, what)?;
    Ok((kind, rank, world, body))
}

fn parse_header(h: &[u8; HEADER_LEN]) -> Result<(u8, usize, usize, usize)> {
    if h[..4] != MAGIC {
        return Err(Error::protocol(format!(
            "peer is not speaking the erdma bootstrap format (first bytes {:02x?})",
            &h[..4]
        )));
    }
    let version = u16::from_be_bytes([h[4], h[5]]);
    if version != VERSION {
        return Err(Error::protocol(format!(
            "peer speaks bootstrap version {version}, this side speaks {VERSION}"
        )));
    }
    let kind = h[6];
    if !(HELLO..=TABLE).contains(&kind) {
        return Err(Error::protocol(format!(
            "unknown bootstrap message kind {kind}"
        )));
    }
    let word = |i: usize| u32::from_be_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]) as usize;
    let len = word(16);
    if len > MAX_BODY {
        return Err(Error::protocol(format!(
            "peer announced a {len}-byte bootstrap message (limit {MAX_BODY})"
        )));
    }
    Ok((kind, word(8), word(12), len))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::Write;

    /// Rank 0's socket on a port the system picks, and that port.
    pub(crate) fn master() -> (TcpListener, u16) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        (l, port)
    }

    /// Rank `rank` of `world` joins: rank 0 hosts on `listener` (given to rank 0 only), the
    /// others dial `port`.
    pub(crate) fn join(
        rank: usize,
        world: usize,
        listener: Option<TcpListener>,
        port: u16,
        timeout: Duration,
    ) -> Result<Bootstrap> {
        match listener {
            Some(l) => Bootstrap::host(l, world, timeout),
            None => Bootstrap::join(info(rank, world, port), timeout),
        }
    }

    fn info(rank: usize, world: usize, port: u16) -> RankInfo {
        RankInfo {
            rank,
            world,
            master: format!("127.0.0.1:{port}"),
        }
    }

    #[test]
    fn ranks_gather_each_others_bytes() {
        let (l, port) = master();
        let mut l = Some(l);
        let world = 4;
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let mine = if r == 0 { l.take() } else { None };
                std::thread::spawn(move || {
                    let mut b = join(r, world, mine, port, Duration::from_secs(10))?;
                    let all = b.all_gather(&vec![r as u8; r * 3])?;
                    b.barrier()?;
                    Ok::<_, Error>(all)
                })
            })
            .collect();
        for h in handles {
            let all = h.join().unwrap().unwrap();
            for (r, v) in all.iter().enumerate() {
                assert_eq!(*v, vec![r as u8; r * 3]);
            }
        }
    }

    #[test]
    fn a_missing_rank_times_out() {
        let (l, port) = master();
        let t = std::thread::spawn(move || {
            Bootstrap::host(l, 3, Duration::from_millis(500)).map(|_| ())
        });
        let _b = Bootstrap::join(info(1, 3, port), Duration::from_secs(5)).unwrap();
        let e = t.join().unwrap().unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("2 of 3"), "{e}");
    }

    #[test]
    fn garbage_and_duplicate_ranks_are_refused() {
        let (l, port) = master();
        let t =
            std::thread::spawn(move || Bootstrap::host(l, 3, Duration::from_secs(5)).map(|_| ()));
        let mut s = connect::dial(("127.0.0.1", port), Duration::from_secs(5)).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\n\r\n  ").unwrap();
        let e = t.join().unwrap().unwrap_err();
        assert!(matches!(e, Error::Protocol { .. }), "{e}");

        let (l, port) = master();
        let t =
            std::thread::spawn(move || Bootstrap::host(l, 3, Duration::from_secs(5)).map(|_| ()));
        let _a = Bootstrap::join(info(1, 3, port), Duration::from_secs(5)).unwrap();
        let _b = Bootstrap::join(info(1, 3, port), Duration::from_secs(5)).unwrap();
        let e = t.join().unwrap().unwrap_err();
        assert!(e.to_string().contains("claims rank 1"), "{e}");
    }

    #[test]
    fn tables_and_environment_are_checked() {
        assert_eq!(
            parse_table(&[0, 0, 0, 1, 0, 0, 0, 1, 7], 1).unwrap(),
            [vec![7]]
        );
        assert!(parse_table(&[0, 0, 0, 1, 0, 0, 0, 9, 7], 1).is_err());
        assert!(parse_table(&[0, 0, 0, 2, 0, 0, 0, 0], 1).is_err());
        assert!(parse_table(&[0, 0, 0, 1, 0, 0, 0, 0, 1], 1).is_err());
        assert!(info(3, 3, 1).validate().is_err());
        assert!(info(0, 0, 1).validate().is_err());
        let vars = |port: &'static str| {
            move |name: &str| {
                let v = match name {
                    "RANK" => "1",
                    "WORLD_SIZE" => "2",
                    "MASTER_ADDR" => "127.0.0.1",
                    "MASTER_PORT" => port,
                    _ => return None,
                };
                Some(v.to_string())
            }
        };
        let ok = RankInfo::from_vars(vars(" 29500 ")).unwrap();
        assert_eq!(
            (ok.rank, ok.world, ok.master.as_str()),
            (1, 2, "127.0.0.1:29500")
        );
        // Port 0 would have rank 0 listen where nobody dials; a port past 65535 does not exist.
        for port in ["0", "65536", "-1", "x"] {
            let e = RankInfo::from_vars(vars(port)).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{port}: {e:?}");
            assert!(e.to_string().contains("MASTER_PORT"), "{port}: {e}");
        }
        let e = RankInfo::from_vars(|_| None).unwrap_err();
        assert!(e.to_string().contains("is not set"), "{e}");
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(&MAGIC);
        h[5] = 1;
        h[6] = 2;
        h[16..20].copy_from_slice(&((MAX_BODY + 1) as u32).to_be_bytes());
        assert!(parse_header(&h).is_err());
        h[16..20].copy_from_slice(&4u32.to_be_bytes());
        assert_eq!(parse_header(&h).unwrap(), (2, 0, 0, 4));
        h[5] = 2;
        assert!(
            parse_header(&h)
                .unwrap_err()
                .to_string()
                .contains("version 2")
        );
    }

    /// The socket a launcher hands rank 0: accepted only when it is a socket listening on
    /// `MASTER_PORT`, and then rank 0 hosts the job on it.
    #[test]
    fn an_inherited_socket_is_checked_then_hosts() {
        let (l, port) = master();
        let fd = l.as_raw_fd().to_string();
        for (value, says) in [
            ("x", "not a descriptor number"),
            ("-3", "not a descriptor number"),
            ("987654", "not an open descriptor"),
        ] {
            let e = inherited_listener(value, port).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
            assert!(e.to_string().contains(says), "{value}: {e}");
        }
        let file = std::fs::File::open("/dev/null").unwrap();
        let e = inherited_listener(&file.as_raw_fd().to_string(), port).unwrap_err();
        assert!(e.to_string().contains("not a listening socket"), "{e}");
        let unbound = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let e = inherited_listener(&unbound.as_raw_fd().to_string(), port).unwrap_err();
        assert!(e.to_string().contains("not a listening socket"), "{e}");
        let e = inherited_listener(&fd, port.wrapping_add(1)).unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("not on MASTER_PORT={}", port.wrapping_add(1))),
            "{e}"
        );

        // SAFETY: fcntl(2) F_SETFD on our own listener's descriptor.
        unsafe { libc::fcntl(l.as_raw_fd(), libc::F_SETFD, 0) };
        let taken = inherited_listener(&fd, port).unwrap();
        // A copy: the original stays open, and no longer passes to processes started later.
        assert_ne!(taken.as_raw_fd(), l.as_raw_fd());
        // SAFETY: fcntl(2) F_GETFD on our own listener's descriptor.
        let flags = unsafe { libc::fcntl(l.as_raw_fd(), libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
        let t = std::thread::spawn(move || {
            let mut b = Bootstrap::host(taken, 2, Duration::from_secs(10))?;
            b.all_gather(b"zero")
        });
        let mut b = Bootstrap::join(info(1, 2, port), Duration::from_secs(10)).unwrap();
        let all = b.all_gather(b"one").unwrap();
        assert_eq!(all, [b"zero".to_vec(), b"one".to_vec()]);
        assert_eq!(t.join().unwrap().unwrap(), all);
        // Every rank came: the socket takes no more connections, through any descriptor of it
        // (the one this test still holds included), so a stray rank is refused at once.
        assert!(
            TcpStream::connect(("127.0.0.1", port)).is_err(),
            "a late connection was queued where nobody accepts"
        );
        assert_eq!(info(0, 1, 7).master_addr().unwrap().port(), 7);
        drop(l);
    }

    /// The command a launcher starts rank 0 with holds its own descriptor of the socket: the
    /// socket passes even when the launcher has dropped its `MasterSocket` and reused the
    /// number meanwhile.
    #[test]
    fn a_passed_socket_outlives_the_master_socket() {
        let m = MasterSocket::bind("127.0.0.1:0").unwrap();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", &format!("readlink /proc/self/fd/${MASTER_FD_VAR}")]);
        m.pass_to(&mut cmd).unwrap();
        drop(m);
        let _reuse = std::fs::File::open("/dev/null").unwrap();
        let out = cmd.output().unwrap();
        let link = String::from_utf8_lossy(&out.stdout);
        assert!(link.starts_with("socket:"), "{link:?}");
    }

    /// Rank 0 refuses a table that would pass the limit as soon as the contribution that
    /// passes it arrives, naming it.
    #[test]
    fn a_table_past_the_limit_is_refused_at_its_contribution() {
        let (l, port) = master();
        let t = std::thread::spawn(move || {
            let mut b = Bootstrap::host(l, 2, Duration::from_secs(10))?;
            b.all_gather(b"zero")
        });
        let mut b = Bootstrap::join(info(1, 2, port), Duration::from_secs(10)).unwrap();
        // Rank 0 gives up after reading it, so rank 1's wait for the table fails too.
        let _ = b.all_gather(&vec![1u8; MAX_BODY]);
        let e = t.join().unwrap().unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        assert!(e.to_string().contains("rank 1's contribution"), "{e}");
    }
}
