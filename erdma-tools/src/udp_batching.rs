//! How the soft device should move datagrams: a side-by-side measurement of the Linux UDP
//! batching interfaces on loopback, at RoCE packet sizes.
//!
//! One sender thread and one receiver thread, one socket each, for a fixed time per method.
//! Transmit methods (the receiver uses `recvmmsg` with GRO): `sendmsg` one datagram per call,
//! `sendmmsg` with a batch, io_uring with a batch of `SENDMSG` per submission, `sendmmsg` with
//! UDP GSO (super-datagrams of equal segments), and io_uring `SENDMSG` with GSO. Receive
//! methods (the sender uses `sendmmsg` + GSO): `recvmmsg` and io_uring `RECVMSG`, each with and
//! without GRO. Reported: what the receiver got, Gbit/s and Mpackets/s.
//!
//! `cargo run --release --example udp_batching -- [-s BYTES] [-b BATCH] [-D SECS]`

use crate::cli::{Args, CliError, Spec};
use io_uring::{IoUring, opcode, types};
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const SPECS: &[Spec] = &[
    Spec::opt(
        Some('s'),
        "size",
        "BYTES",
        "UDP payload per datagram (default 4112: a RoCE packet at MTU 4096)",
    ),
    Spec::opt(
        Some('b'),
        "batch",
        "N",
        "datagrams per call/submission (default 16)",
    ),
    Spec::opt(
        Some('D'),
        "duration",
        "SECS",
        "seconds per method and round (default 1)",
    ),
    Spec::opt(
        Some('r'),
        "rounds",
        "N",
        "rounds over all methods, in rotating order; the median is reported (default 3)",
    ),
];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Tx {
    SendMsg,
    SendMmsg,
    UringSendMsg,
    SendMmsgGso,
    UringSendMmsgGso,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Rx {
    RecvMmsg { gro: bool },
    UringRecvMsg { gro: bool },
}

#[derive(Clone, Copy, Debug)]
struct Config {
    size: usize,
    batch: usize,
    secs: f64,
    rounds: usize,
}

/// The `udp_batching` tool: parses the command line and measures every method.
pub fn main() {
    let args = match Args::parse(
        "udp_batching",
        "Compares Linux UDP batching interfaces on loopback at RoCE packet sizes.",
        SPECS,
        0,
        std::env::args().skip(1),
    ) {
        Ok(a) => a,
        Err(CliError::Help(h)) => {
            print!("{h}");
            return;
        }
        Err(e) => {
            eprintln!("udp_batching: {e}");
            std::process::exit(2);
        }
    };
    let cfg = match (|| -> Result<Config, CliError> {
        Ok(Config {
            size: args.get("size", 4112usize)?,
            batch: args.get("batch", 16usize)?,
            secs: args.get("duration", 1.0f64)?,
            rounds: args.get("rounds", 3usize)?,
        })
    })() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("udp_batching: {e}");
            std::process::exit(2);
        }
    };
    if cfg.size == 0
        || cfg.size > 8972
        || cfg.batch == 0
        || cfg.batch > 64
        || cfg.secs <= 0.0
        || cfg.rounds == 0
    {
        eprintln!("udp_batching: need 1 <= size <= 8972, 1 <= batch <= 64, duration > 0");
        std::process::exit(2);
    }
    // GSO needs the whole super-datagram under 64 KiB.
    let gso_batch = cfg.batch.min(65_000 / cfg.size).max(1);
    println!(
        "# UDP loopback, {} B datagrams, batch {} (GSO batch {}), {} s per method, median of {} rounds",
        cfg.size, cfg.batch, gso_batch, cfg.secs, cfg.rounds
    );
    println!("{:<28} {:>10} {:>10}", "#method", "Gbit/s", "Mpps");
    let rx_default = Rx::RecvMmsg { gro: true };
    let runs: [(&str, Tx, Rx); 9] = [
        ("tx sendmsg", Tx::SendMsg, rx_default),
        ("tx sendmmsg", Tx::SendMmsg, rx_default),
        ("tx io_uring sendmsg", Tx::UringSendMsg, rx_default),
        ("tx sendmmsg+GSO", Tx::SendMmsgGso, rx_default),
        ("tx io_uring sendmsg+GSO", Tx::UringSendMmsgGso, rx_default),
        ("rx recvmmsg", Tx::SendMmsgGso, Rx::RecvMmsg { gro: false }),
        (
            "rx io_uring recvmsg",
            Tx::SendMmsgGso,
            Rx::UringRecvMsg { gro: false },
        ),
        (
            "rx recvmmsg+GRO",
            Tx::SendMmsgGso,
            Rx::RecvMmsg { gro: true },
        ),
        (
            "rx io_uring recvmsg+GRO",
            Tx::SendMmsgGso,
            Rx::UringRecvMsg { gro: true },
        ),
    ];
    // Rounds rotate the order, so a change in the machine's load does not favour one method.
    let mut results: Vec<Vec<(f64, f64)>> = vec![Vec::new(); runs.len()];
    let mut failed: Vec<Option<io::Error>> = runs.iter().map(|_| None).collect();
    for round in 0..cfg.rounds {
        for k in 0..runs.len() {
            let i = (k + round) % runs.len();
            let (_, tx, rx) = runs[i];
            match measure(cfg, gso_batch, tx, rx) {
                Ok((bytes, packets, secs)) => {
                    results[i].push((bytes as f64 * 8.0 / secs / 1e9, packets as f64 / secs / 1e6))
                }
                Err(e) => failed[i] = Some(e),
            }
        }
    }
    for (i, (name, _, _)) in runs.iter().enumerate() {
        if let Some(e) = &failed[i] {
            println!("{name:<28} failed: {e}");
            continue;
        }
        let r = &mut results[i];
        r.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (gbps, mpps) = r[r.len() / 2];
        println!("{name:<28} {gbps:>10.2} {mpps:>10.3}");
    }
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn setsockopt(fd: RawFd, level: libc::c_int, name: libc::c_int, v: libc::c_int) -> io::Result<()> {
    // SAFETY: `v` is a live c_int and the length passed is its size.
    cvt(unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(drop)
}

fn sockaddr(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// Runs one sender/receiver pair for the configured time; returns what the receiver got.
fn measure(cfg: Config, gso_batch: usize, tx: Tx, rx: Rx) -> io::Result<(u64, u64, f64)> {
    let rsock = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))?;
    let dst = match rsock.local_addr()? {
        std::net::SocketAddr::V4(a) => a,
        std::net::SocketAddr::V6(_) => unreachable!("bound to an IPv4 address"),
    };
    setsockopt(
        rsock.as_raw_fd(),
        libc::SOL_SOCKET,
        libc::SO_RCVBUF,
        8 << 20,
    )?;
    let gro = matches!(
        rx,
        Rx::RecvMmsg { gro: true } | Rx::UringRecvMsg { gro: true }
    );
    if gro {
        setsockopt(rsock.as_raw_fd(), libc::SOL_UDP, libc::UDP_GRO, 1)?;
    }
    rsock.set_read_timeout(Some(Duration::from_millis(50)))?;
    let ssock = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))?;
    setsockopt(
        ssock.as_raw_fd(),
        libc::SOL_SOCKET,
        libc::SO_SNDBUF,
        8 << 20,
    )?;
    let stop = Arc::new(AtomicBool::new(false));
    let sender = {
        let stop = stop.clone();
        std::thread::spawn(move || send_loop(&ssock, dst, cfg, gso_batch, tx, &stop))
    };
    // Warm up briefly, then count.
    let warm = Instant::now() + Duration::from_millis(200);
    let mut rxs = RxLoop::new(&rsock, cfg, rx)?;
    while Instant::now() < warm {
        rxs.once()?;
    }
    let (mut bytes, mut packets) = (0u64, 0u64);
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(cfg.secs);
    while Instant::now() < end {
        let (b, p) = rxs.once()?;
        bytes += b;
        packets += p;
    }
    let secs = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    sender
        .join()
        .map_err(|_| io::Error::other("sender panicked"))??;
    Ok((bytes, packets, secs))
}

/// A batch of message headers over one contiguous buffer.
struct Msgs {
    buf: Vec<u8>,
    iov: Vec<libc::iovec>,
    hdr: Vec<libc::mmsghdr>,
    cmsg: Vec<[u64; 8]>,
    addr: libc::sockaddr_in,
}

impl Msgs {
    /// `n` messages of `len` bytes each, addressed to `dst` when given.
    fn new(n: usize, len: usize, dst: Option<SocketAddrV4>) -> Box<Msgs> {
        let mut m = Box::new(Msgs {
            buf: vec![0xA5; n * len],
            iov: Vec::with_capacity(n),
            hdr: Vec::with_capacity(n),
            cmsg: vec![[0u64; 8]; n],
            addr: sockaddr(dst.unwrap_or(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))),
        });
        let base = m.buf.as_mut_ptr();
        for i in 0..n {
            m.iov.push(libc::iovec {
                // SAFETY: `i * len` is inside `buf`, which holds `n * len` bytes.
                iov_base: unsafe { base.add(i * len) }.cast(),
                iov_len: len,
            });
        }
        let addr = &mut m.addr as *mut libc::sockaddr_in;
        for i in 0..n {
            // SAFETY: mmsghdr is plain old data; all-zero is a valid empty header.
            let mut h: libc::mmsghdr = unsafe { std::mem::zeroed() };
            h.msg_hdr.msg_iov = &mut m.iov[i];
            h.msg_hdr.msg_iovlen = 1;
            if dst.is_some() {
                h.msg_hdr.msg_name = addr.cast();
                h.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as u32;
            }
            m.hdr.push(h);
        }
        m
    }

    /// Attaches a UDP_SEGMENT control message of `seg` bytes to message `i`.
    fn set_gso(&mut self, i: usize, seg: u16) {
        let c = self.cmsg[i].as_mut_ptr().cast::<libc::cmsghdr>();
        // SAFETY: the control buffer is 64 bytes, 8-aligned, enough for one cmsghdr + u16; the
        // header points at it with its length, as CMSG_FIRSTHDR/CMSG_DATA require.
        unsafe {
            (*c).cmsg_level = libc::SOL_UDP;
            (*c).cmsg_type = libc::UDP_SEGMENT;
            (*c).cmsg_len = libc::CMSG_LEN(2) as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), seg);
        }
        let h = &mut self.hdr[i].msg_hdr;
        h.msg_control = c.cast();
        // SAFETY: CMSG_SPACE is arithmetic on its argument.
        h.msg_controllen = unsafe { libc::CMSG_SPACE(2) } as usize;
    }

    /// Room for a GRO control message on message `i`.
    fn allow_cmsg(&mut self, i: usize) {
        let h = &mut self.hdr[i].msg_hdr;
        h.msg_control = self.cmsg[i].as_mut_ptr().cast();
        h.msg_controllen = std::mem::size_of::<[u64; 8]>();
    }
}

fn send_loop(
    sock: &UdpSocket,
    dst: SocketAddrV4,
    cfg: Config,
    gso_batch: usize,
    tx: Tx,
    stop: &AtomicBool,
) -> io::Result<()> {
    let fd = sock.as_raw_fd();
    let n = cfg.batch;
    match tx {
        Tx::SendMsg | Tx::SendMmsg | Tx::UringSendMsg => {
            let mut m = Msgs::new(n, cfg.size, Some(dst));
            let mut ring = if tx == Tx::UringSendMsg {
                Some(IoUring::new(n.next_power_of_two() as u32 * 2)?)
            } else {
                None
            };
            while !stop.load(Ordering::Relaxed) {
                match tx {
                    Tx::SendMsg => {
                        for i in 0..n {
                            // SAFETY: the header and everything it points at live in `m`.
                            let _ = unsafe { libc::sendmsg(fd, &m.hdr[i].msg_hdr, 0) };
                        }
                    }
                    Tx::SendMmsg => {
                        // SAFETY: `n` valid headers in `m`.
                        let _ = unsafe { libc::sendmmsg(fd, m.hdr.as_mut_ptr(), n as u32, 0) };
                    }
                    _ => uring_send(ring.as_mut().expect("ring"), fd, &m.hdr[..n])?,
                }
            }
        }
        Tx::SendMmsgGso | Tx::UringSendMmsgGso => {
            let mut m = Msgs::new(n, cfg.size * gso_batch, Some(dst));
            for i in 0..n {
                m.set_gso(i, cfg.size as u16);
            }
            let mut ring = if tx == Tx::UringSendMmsgGso {
                Some(IoUring::new(n.next_power_of_two() as u32 * 2)?)
            } else {
                None
            };
            // The same number of bytes per call as the plain batch: n / gso_batch messages.
            let per_call = n.div_ceil(gso_batch);
            while !stop.load(Ordering::Relaxed) {
                if let Some(r) = ring.as_mut() {
                    uring_send(r, fd, &m.hdr[..per_call])?;
                } else {
                    // SAFETY: `per_call` valid headers in `m`.
                    let _ = unsafe { libc::sendmmsg(fd, m.hdr.as_mut_ptr(), per_call as u32, 0) };
                }
            }
        }
    }
    Ok(())
}

/// Submits one SENDMSG per header and waits for all of them.
fn uring_send(ring: &mut IoUring, fd: RawFd, hdrs: &[libc::mmsghdr]) -> io::Result<()> {
    for (i, h) in hdrs.iter().enumerate() {
        let e = opcode::SendMsg::new(types::Fd(fd), &h.msg_hdr)
            .build()
            .user_data(i as u64);
        // SAFETY: the header and its buffers outlive the submission: we wait for every
        // completion below before returning.
        unsafe { ring.submission().push(&e) }.map_err(|_| io::Error::other("SQ full"))?;
    }
    ring.submit_and_wait(hdrs.len())?;
    let done = ring.completion().count();
    debug_assert_eq!(done, hdrs.len());
    Ok(())
}

struct RxLoop<'a> {
    sock: &'a UdpSocket,
    rx: Rx,
    ring: Option<IoUring>,
    /// Receives posted to `ring` and not yet completed: they write into `m`.
    outstanding: usize,
    m: Box<Msgs>,
    size: usize,
}

/// Posts a receive into slot `i` of `m`.
fn post_recv(ring: &mut IoUring, fd: RawFd, m: &mut Msgs, i: usize) -> io::Result<()> {
    m.allow_cmsg(i);
    let e = opcode::RecvMsg::new(types::Fd(fd), &mut m.hdr[i].msg_hdr)
        .build()
        .user_data(i as u64);
    // SAFETY: the header and its buffers live in the boxed `m`, which is neither moved nor
    // touched until this receive completes (`RxLoop` reaps every outstanding receive, by
    // cancelling them, before `m` is dropped).
    unsafe { ring.submission().push(&e) }.map_err(|_| io::Error::other("SQ full"))
}

impl Drop for RxLoop<'_> {
    fn drop(&mut self) {
        let Some(ring) = self.ring.as_mut() else {
            return;
        };
        if self.outstanding == 0 {
            return;
        }
        let e = opcode::AsyncCancel2::new(types::CancelBuilder::any().all())
            .build()
            .user_data(u64::MAX);
        // SAFETY: a cancel request carries no buffers.
        if unsafe { ring.submission().push(&e) }.is_err() {
            std::process::abort(); // cannot make the buffers safe to free
        }
        let mut pending = self.outstanding + 1;
        while pending > 0 {
            if ring.submit_and_wait(1).is_err() {
                std::process::abort();
            }
            pending -= ring.completion().count();
        }
    }
}

impl<'a> RxLoop<'a> {
    fn new(sock: &'a UdpSocket, cfg: Config, rx: Rx) -> io::Result<RxLoop<'a>> {
        let slots = cfg.batch;
        let slot_len = match rx {
            Rx::RecvMmsg { gro: true } | Rx::UringRecvMsg { gro: true } => 65_536,
            _ => cfg.size.max(2048),
        };
        let mut m = Msgs::new(slots, slot_len, None);
        for i in 0..slots {
            m.allow_cmsg(i);
        }
        let ring = match rx {
            Rx::UringRecvMsg { .. } => Some(IoUring::new(slots.next_power_of_two() as u32 * 2)?),
            Rx::RecvMmsg { .. } => None,
        };
        Ok(RxLoop {
            sock,
            rx,
            ring,
            outstanding: 0,
            m,
            size: cfg.size,
        })
    }

    /// One receive call or submission; returns (bytes, datagrams of `size`) received.
    fn once(&mut self) -> io::Result<(u64, u64)> {
        let fd = self.sock.as_raw_fd();
        let n = self.m.hdr.len();
        let mut bytes = 0u64;
        match self.rx {
            Rx::RecvMmsg { .. } => {
                for i in 0..n {
                    self.m.allow_cmsg(i);
                }
                let mut ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 50_000_000,
                };
                // SAFETY: `n` valid headers over buffers owned by `self.m`.
                let got = unsafe {
                    libc::recvmmsg(
                        fd,
                        self.m.hdr.as_mut_ptr(),
                        n as u32,
                        libc::MSG_WAITFORONE,
                        &mut ts,
                    )
                };
                if got < 0 {
                    let e = io::Error::last_os_error();
                    return match e.kind() {
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok((0, 0)),
                        _ => Err(e),
                    };
                }
                for h in &self.m.hdr[..got as usize] {
                    bytes += u64::from(h.msg_len);
                }
            }
            Rx::UringRecvMsg { .. } => {
                // Every slot always has a receive posted; each round reaps what completed and
                // posts those slots again.
                let ring = self.ring.as_mut().expect("ring");
                if self.outstanding == 0 {
                    for i in 0..n {
                        post_recv(ring, fd, &mut self.m, i)?;
                    }
                    self.outstanding = n;
                }
                ring.submit_and_wait(1)?;
                let done: Vec<(u64, i32)> = ring
                    .completion()
                    .map(|c| (c.user_data(), c.result()))
                    .collect();
                for (slot, r) in done {
                    self.outstanding -= 1;
                    if r > 0 {
                        bytes += r as u64;
                    }
                    post_recv(ring, fd, &mut self.m, slot as usize)?;
                    self.outstanding += 1;
                }
            }
        }
        Ok((bytes, bytes / self.size as u64))
    }
}
