//! The soft device's UDP socket: batched send and receive, with UDP GSO and GRO.
//!
//! Owns the one socket a soft device binds (`<addr>:4791`), configured so the kernel's IPv4 header
//! is predictable (unconnected + `IP_PMTUDISC_DO`: DF set, identification 0; the ICRC covers
//! both):
//! - sending a [`TxBatch`] (the engine's transmit batch) with one `sendmmsg`, each GSO train as
//!   one message with `UDP_SEGMENT`; the kernel numbers a train's segments with IPv4
//!   identification 0, 1, 2…, which the batch told the engine when it placed each packet;
//! - [`RxBatch`]: `recvmmsg` into large buffers; GRO-coalesced messages (`UDP_GRO`) are split
//!   back into datagrams by the segment size the kernel reports.
//!
//! This module is one of the crate's few unsafe ones: it calls the socket syscalls through libc.

#![allow(unsafe_code)] // the socket syscalls

use std::io;
use std::mem::{self, MaybeUninit};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::soft::engine::batch::{NO_PKT, TxBatch, TxMsg};

/// `SOL_UDP` option: send one buffer as several datagrams of this size.
const UDP_SEGMENT: libc::c_int = 103;
/// `SOL_UDP` option: receive coalesced datagrams with their segment size.
const UDP_GRO: libc::c_int = 104;

/// The UDP port RoCEv2 uses.
pub(crate) const ROCE_PORT: u16 = 4791;

/// A bound, non-blocking UDP socket.
#[derive(Debug)]
pub(crate) struct UdpSock {
    fd: OwnedFd,
    /// The address it is bound to, once it is ([`UdpSock::bind_to`]).
    local: std::sync::OnceLock<SocketAddrV4>,
    /// Cleared for good when the kernel refuses a GSO train (IPsec on the route, checksums off,
    /// an old kernel): sends go one datagram per packet from then on.
    gso: std::sync::atomic::AtomicBool,
    gro: bool,
    /// Messages the kernel refused (each dropped alone, as a network would drop it).
    refused: std::sync::atomic::AtomicU64,
}

/// What the socket should try to use.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SockOptions {
    pub gso: bool,
    pub gro: bool,
    pub buffer_bytes: usize,
    /// Joins the address's `SO_REUSEPORT` group (the device's other engines' sockets).
    pub reuseport: bool,
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

pub(super) fn setsockopt_int(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    v: libc::c_int,
) -> io::Result<()> {
    // SAFETY: `v` is a live c_int and we pass its exact size; the kernel only reads it.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&v as *const libc::c_int).cast(),
            mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    cvt(r).map(|_| ())
}

fn sockaddr(addr: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: addr.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(addr.ip().octets()),
        },
        sin_zero: [0; 8],
    }
}

fn from_sockaddr(sa: &libc::sockaddr_in) -> SocketAddrV4 {
    SocketAddrV4::new(
        Ipv4Addr::from(sa.sin_addr.s_addr.to_ne_bytes()),
        u16::from_be(sa.sin_port),
    )
}

/// The `k`-th message across `batches`, with its batch.
fn message_at<'a>(batches: &'a [&mut TxBatch], mut k: usize) -> Option<(&'a TxBatch, TxMsg)> {
    for b in batches {
        match b.msgs().get(k) {
            Some(m) => return Some((b, *m)),
            None => k -= b.msgs().len(),
        }
    }
    None
}

impl UdpSock {
    /// Binds `addr:port` (port 0 picks one).
    #[cfg(test)]
    pub(crate) fn bind(addr: Ipv4Addr, port: u16, opts: SockOptions) -> io::Result<UdpSock> {
        let sock = UdpSock::unbound(opts)?;
        sock.bind_to(addr, port)?;
        Ok(sock)
    }

    /// A socket with every option set but no address yet: it receives nothing until
    /// [`UdpSock::bind_to`], and nothing may be sent on it before (the kernel would bind an
    /// ephemeral port).
    pub(crate) fn unbound(opts: SockOptions) -> io::Result<UdpSock> {
        // SAFETY: plain socket(2) call with constant arguments.
        let raw = cvt(unsafe {
            libc::socket(
                libc::AF_INET,
                libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        })?;
        // SAFETY: `raw` is a freshly created descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        setsockopt_int(
            raw,
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_DO,
        )?;
        let buf = opts.buffer_bytes.min(i32::MAX as usize) as libc::c_int;
        // Larger buffers ride out bursts; the kernel caps them at its rmem/wmem maximum.
        let _ = setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_RCVBUF, buf);
        let _ = setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_SNDBUF, buf);
        let gro = opts.gro && setsockopt_int(raw, libc::SOL_UDP, UDP_GRO, 1).is_ok();
        if opts.reuseport {
            setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_REUSEPORT, 1)?;
        }
        Ok(UdpSock {
            fd,
            local: std::sync::OnceLock::new(),
            gso: std::sync::atomic::AtomicBool::new(opts.gso),
            gro,
            refused: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Binds the socket to `addr:port` (port 0 picks one). Binding a socket already bound is
    /// a no-op that succeeds. Its callers serialise it (the device binds under a lock).
    pub(crate) fn bind_to(&self, addr: Ipv4Addr, port: u16) -> io::Result<SocketAddrV4> {
        if let Some(a) = self.local.get() {
            return Ok(*a);
        }
        let raw = self.fd.as_raw_fd();
        let sa = sockaddr(SocketAddrV4::new(addr, port));
        // SAFETY: `sa` is a valid sockaddr_in of the size passed.
        cvt(unsafe {
            libc::bind(
                raw,
                (&sa as *const libc::sockaddr_in).cast(),
                mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        })?;
        let mut bound: libc::sockaddr_in = sockaddr(SocketAddrV4::new(addr, 0));
        let mut len = mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: `bound`/`len` are valid out-parameters of the right size.
        cvt(unsafe {
            libc::getsockname(raw, (&mut bound as *mut libc::sockaddr_in).cast(), &mut len)
        })?;
        Ok(*self.local.get_or_init(|| from_sockaddr(&bound)))
    }

    /// The bound address.
    #[cfg(test)]
    pub(crate) fn local(&self) -> SocketAddrV4 {
        *self.local.get().expect("a bound socket")
    }

    /// Whether GRO is on for receives.
    pub(crate) fn gro(&self) -> bool {
        self.gro
    }

    /// Whether sends may use GSO.
    pub(crate) fn gso(&self) -> bool {
        self.gso.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Messages the kernel refused so far.
    /// Counts `n` more messages dropped on the way out (a full ring, `shm.rs`).
    pub(crate) fn count_refused(&self, n: u64) {
        self.refused
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sends every message of `batch` (waiting for socket buffer space when full), then clears
    /// it. A message the kernel refuses (an unreachable or broadcast destination, a GSO train
    /// it cannot segment) is dropped alone, as a network would drop it, and counted: the
    /// protocol retransmits, and the other messages, other queue pairs' included, still go.
    /// A refused GSO train also turns GSO off for this socket and these batches, so the
    /// retransmission goes one datagram per packet. Only a broken socket is an error.
    #[cfg(test)]
    pub(crate) fn send_batch(&self, batch: &mut TxBatch) -> io::Result<()> {
        self.send_batches(&mut [batch])
    }

    /// [`UdpSock::send_batch`] for several batches, in order, through as few `sendmmsg` calls
    /// as their messages need (one, when they fit): a reply and the acknowledgements held back
    /// behind it cost one system call.
    pub(crate) fn send_batches(&self, batches: &mut [&mut TxBatch]) -> io::Result<()> {
        self.send_batches_but(batches, &[])
    }

    /// [`UdpSock::send_batches`], leaving out the messages whose index across the batches is
    /// `true` in `skip` (others carried them).
    pub(crate) fn send_batches_but(
        &self,
        batches: &mut [&mut TxBatch],
        skip: &[bool],
    ) -> io::Result<()> {
        let mut start = 0;
        let total: usize = batches.iter().map(|b| b.msgs().len()).sum();
        let skipped = |k: usize| skip.get(k).copied().unwrap_or(false);
        while start < total {
            if skipped(start) {
                start += 1;
                continue;
            }
            let mut addrs: [MaybeUninit<libc::sockaddr_in>; MAX_MSGS] =
                [MaybeUninit::uninit(); MAX_MSGS];
            let mut iovs: [MaybeUninit<libc::iovec>; MAX_IOVS] = [MaybeUninit::uninit(); MAX_IOVS];
            let mut cmsgs: [MaybeUninit<CmsgBuf>; MAX_MSGS] = [MaybeUninit::uninit(); MAX_MSGS];
            // Only the first `n` headers are built (a latency-bound send carries one or two):
            // zeroing all of them would cost more than the system call's own work.
            let mut hdrs: [MaybeUninit<libc::mmsghdr>; MAX_MSGS] =
                [MaybeUninit::uninit(); MAX_MSGS];
            let mut n = 0;
            let mut used_iovs = 0;
            while start + n < total && n < MAX_MSGS && !skipped(start + n) {
                let Some((batch, m)) = message_at(batches, start + n) else {
                    break;
                };
                // A message needs at most one iovec per segment, and two more per lent payload.
                if used_iovs + m.segments + 2 * m.lent > MAX_IOVS {
                    break;
                }
                let first = used_iovs;
                // Contiguous bytes of the buffer (one flow's packets, committed in a row) share
                // an iovec; a lent payload is one of its own, between its packet's headers and
                // its pad and ICRC.
                let buf = batch.buf();
                let mut run: Option<(usize, usize)> = None;
                let mut p = m.head;
                while p != NO_PKT {
                    let k = batch.pkt(p);
                    p = k.next;
                    let (off, len) = (k.off as usize, k.len as usize);
                    let bytes = match k.lent {
                        Some(l) => (off, l.at),
                        None => (off, len),
                    };
                    run = match run {
                        Some((o, n)) if o + n == bytes.0 => Some((o, n + bytes.1)),
                        Some((o, n)) => {
                            push_iov(&mut iovs, &mut used_iovs, buf[o..].as_ptr(), n);
                            Some(bytes)
                        }
                        None => Some(bytes),
                    };
                    if let Some(l) = k.lent {
                        if let Some((o, n)) = run.take() {
                            push_iov(&mut iovs, &mut used_iovs, buf[o..].as_ptr(), n);
                        }
                        push_iov(&mut iovs, &mut used_iovs, l.addr as *const u8, l.len);
                        let rest = off + l.at + l.len;
                        run = Some((rest, off + len - rest));
                    }
                }
                if let Some((o, n)) = run {
                    push_iov(&mut iovs, &mut used_iovs, buf[o..].as_ptr(), n);
                }
                addrs[n].write(sockaddr(m.dst));
                // SAFETY: an all-zero mmsghdr is a valid value (null pointers, zero lengths).
                let h = hdrs[n].write(unsafe { mem::zeroed() });
                let h = &mut h.msg_hdr;
                h.msg_name = addrs[n].as_mut_ptr().cast();
                h.msg_namelen = mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
                h.msg_iov = iovs[first].as_mut_ptr();
                h.msg_iovlen = used_iovs - first;
                if m.segments > 1 {
                    let c = cmsgs[n].write(CmsgBuf::ZERO);
                    let len = c.put_u16(libc::SOL_UDP, UDP_SEGMENT, m.seg as u16);
                    h.msg_control = c.bytes.as_mut_ptr().cast();
                    h.msg_controllen = len;
                }
                n += 1;
            }
            // `hdrs[..n]` were initialised above; the kernel reads no header past `n`.
            // The iovecs point into the batches' buffers, which outlive the call, and at lent
            // payloads, which `commit_lent`'s callers keep readable until the batch is sent.
            // SAFETY: the headers name live sockaddrs, iovecs and control buffers of their sizes.
            let r = unsafe {
                libc::sendmmsg(
                    self.fd.as_raw_fd(),
                    hdrs.as_mut_ptr().cast::<libc::mmsghdr>(),
                    n as libc::c_uint,
                    0,
                )
            };
            if r < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EAGAIN) => {
                        self.wait_writable();
                        continue;
                    }
                    Some(libc::EINTR) => continue,
                    Some(libc::EBADF | libc::ENOTSOCK) => {
                        batches.iter_mut().for_each(|b| b.clear());
                        return Err(e);
                    }
                    // The first message was refused: drop it, go on with the rest.
                    code => {
                        let train = message_at(batches, start).is_some_and(|(_, m)| m.segments > 1);
                        if train && matches!(code, Some(libc::EIO | libc::EINVAL)) {
                            self.gso.store(false, std::sync::atomic::Ordering::Relaxed);
                            batches.iter_mut().for_each(|b| b.disable_gso());
                        }
                        self.refused
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        start += 1;
                        continue;
                    }
                }
            }
            start += r as usize;
        }
        for b in batches.iter_mut() {
            b.mark_sent();
        }
        Ok(())
    }

    fn wait_writable(&self) {
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLOUT,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, 10) };
    }

    /// Receives what is queued (never blocks), appending datagrams to `rx`. Returns how many
    /// datagrams were added.
    #[cfg(test)]
    pub(crate) fn recv_batch(&self, rx: &mut RxBatch) -> io::Result<usize> {
        self.recv_batch_up_to(rx, usize::MAX)
    }

    /// [`UdpSock::recv_batch`] taking at most `max` messages (at least one). After it returns
    /// one, `recvmmsg` tries the next slot before returning, a failed receive that costs a
    /// latency-bound caller expecting one datagram a third of an empty call; one message is
    /// therefore taken with `recvmsg`.
    pub(crate) fn recv_batch_up_to(&self, rx: &mut RxBatch, max: usize) -> io::Result<usize> {
        rx.clear();
        rx.reset_headers();
        let n = rx.slots.min(max.max(1));
        // System calls themselves, not libc's wrappers: a wrapper makes every call a thread
        // cancellation point (two extra calls into libc around it, ≈ 8% of an empty poll here),
        // and this crate never cancels threads. One message is asked for with recvmsg, which
        // costs the kernel less than recvmmsg's loop.
        // The headers point into `rx`'s own heap buffers, which live as long as it and never
        // move; each argument goes in a full register, in the system call's order.
        let r = if n == 1 {
            // `rx.hdrs[0].msg_hdr` names live buffers, iovecs, an address and a control buffer.
            // SAFETY: recvmsg(2) on our socket with that header, as above.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_recvmsg,
                    libc::c_long::from(self.fd.as_raw_fd()),
                    &raw mut rx.hdrs[0].msg_hdr,
                    libc::c_long::from(libc::MSG_DONTWAIT),
                )
            };
            if r >= 0 {
                rx.hdrs[0].msg_len = r as libc::c_uint;
                1
            } else {
                r
            }
        } else {
            // `rx.hdrs[..n]` name live buffers, iovecs, addresses and control buffers.
            // SAFETY: recvmmsg(2) on our socket with those headers, as above.
            unsafe {
                libc::syscall(
                    libc::SYS_recvmmsg,
                    libc::c_long::from(self.fd.as_raw_fd()),
                    rx.hdrs.as_mut_ptr(),
                    n as libc::c_long,
                    libc::c_long::from(libc::MSG_DONTWAIT),
                    std::ptr::null_mut::<libc::timespec>(),
                )
            }
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN | libc::EINTR) => Ok(0),
                _ => Err(e),
            };
        }
        rx.filled = r as usize;
        let mut added = 0;
        for i in 0..r as usize {
            let h = &rx.hdrs[i];
            let len = h.msg_len as usize;
            if h.msg_hdr.msg_namelen as usize != mem::size_of::<libc::sockaddr_in>() {
                continue;
            }
            let src = from_sockaddr(&rx.addrs[i]);
            let seg = rx.cmsgs[i]
                .gro_segment(&h.msg_hdr)
                .filter(|&s| s > 0 && s < len);
            let base = i * rx.slot_size;
            match seg {
                Some(seg) => {
                    let mut off = 0;
                    while off < len {
                        let l = seg.min(len - off);
                        rx.datagrams.push(Datagram {
                            src,
                            off: base + off,
                            len: l,
                        });
                        off += l;
                        added += 1;
                    }
                }
                None => {
                    rx.datagrams.push(Datagram {
                        src,
                        off: base,
                        len,
                    });
                    added += 1;
                }
            }
        }
        Ok(added)
    }

    /// The raw descriptor (for poll/epoll).
    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Datagrams the kernel dropped for this socket since it was created (its receive buffer
    /// was full, mostly): the `drops` column of its row in `/proc/net/udp`, found by the
    /// socket's inode. Read on demand, so the receive path pays nothing for it. `None` where
    /// procfs does not say.
    pub(crate) fn kernel_drops(&self) -> Option<u64> {
        let link = std::fs::read_link(format!("/proc/self/fd/{}", self.fd.as_raw_fd())).ok()?;
        let inode = link
            .to_str()?
            .strip_prefix("socket:[")?
            .strip_suffix(']')?
            .to_string();
        let table = std::fs::read_to_string("/proc/net/udp").ok()?;
        udp_table_drops(&table, &inode)
    }
}

/// The `drops` column of the row of socket `inode` in a `/proc/net/udp` table (`sl local rem
/// st tx:rx tr:when retrnsmt uid timeout inode ref pointer drops`).
fn udp_table_drops(table: &str, inode: &str) -> Option<u64> {
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        (f.len() >= 13 && f[9] == inode)
            .then(|| f[12].parse().ok())
            .flatten()
    })
}

/// Appends an iovec for `len` bytes at `base`.
fn push_iov(iovs: &mut [MaybeUninit<libc::iovec>], used: &mut usize, base: *const u8, len: usize) {
    iovs[*used].write(libc::iovec {
        iov_base: base as *mut libc::c_void,
        iov_len: len,
    });
    *used += 1;
}

/// Most messages per `sendmmsg`.
const MAX_MSGS: usize = 64;
/// Most iovecs per `sendmmsg` (one per contiguous run of a message's packets).
const MAX_IOVS: usize = 1024;
/// Control buffer size: one cmsg carrying an int (aligned generously).
const CMSG_SPACE: usize = 64;

#[derive(Clone, Copy)]
#[repr(C, align(8))]
struct CmsgBuf {
    bytes: [u8; CMSG_SPACE],
}

impl CmsgBuf {
    const ZERO: CmsgBuf = CmsgBuf {
        bytes: [0; CMSG_SPACE],
    };

    /// Writes one cmsg carrying a u16; returns the control length.
    fn put_u16(&mut self, level: libc::c_int, ty: libc::c_int, v: u16) -> usize {
        // SAFETY: CMSG_LEN/CMSG_SPACE are pure arithmetic.
        let (len, space) = unsafe {
            (
                libc::CMSG_LEN(mem::size_of::<u16>() as u32) as usize,
                libc::CMSG_SPACE(mem::size_of::<u16>() as u32) as usize,
            )
        };
        let hdr = libc::cmsghdr {
            cmsg_len: len,
            cmsg_level: level,
            cmsg_type: ty,
        };
        let hlen = mem::size_of::<libc::cmsghdr>();
        // The assertion below checks the sizes at compile time; only plain old data is written.
        // SAFETY: `bytes` is 8-byte aligned and large enough for a cmsghdr plus a u16.
        unsafe {
            std::ptr::write_unaligned(self.bytes.as_mut_ptr().cast::<libc::cmsghdr>(), hdr);
        }
        self.bytes[hlen..hlen + 2].copy_from_slice(&v.to_ne_bytes());
        debug_assert!(space <= CMSG_SPACE);
        space
    }

    /// The GRO segment size in a received control buffer, if present.
    fn gro_segment(&self, msg: &libc::msghdr) -> Option<usize> {
        let clen = msg.msg_controllen.min(CMSG_SPACE);
        let hlen = mem::size_of::<libc::cmsghdr>();
        let mut off = 0;
        while off + hlen <= clen {
            let at = self.bytes[off..].as_ptr().cast();
            // SAFETY: `off + hlen <= clen <= CMSG_SPACE`, so the header lies inside `bytes`.
            let hdr: libc::cmsghdr = unsafe { std::ptr::read_unaligned(at) };
            if hdr.cmsg_len < hlen || off + hdr.cmsg_len > clen {
                return None;
            }
            if hdr.cmsg_level == libc::SOL_UDP && hdr.cmsg_type == UDP_GRO {
                let data = &self.bytes[off + hlen..off + hdr.cmsg_len];
                return match data.len() {
                    n if n >= 4 => Some(i32::from_ne_bytes(data[..4].try_into().ok()?) as usize),
                    n if n >= 2 => Some(u16::from_ne_bytes(data[..2].try_into().ok()?) as usize),
                    _ => None,
                };
            }
            off += (hdr.cmsg_len + 7) & !7;
        }
        None
    }
}

/// One received datagram inside an [`RxBatch`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Datagram {
    pub src: SocketAddrV4,
    off: usize,
    pub len: usize,
}

/// Receive buffers and the datagrams found in them.
pub(crate) struct RxBatch {
    buf: Vec<u8>,
    cmsgs: Vec<CmsgBuf>,
    /// Source addresses the kernel fills, one per slot.
    addrs: Vec<libc::sockaddr_in>,
    /// One iovec per slot, into `buf`.
    iovs: Vec<libc::iovec>,
    /// The `recvmmsg` headers, built once: they point into the vectors above.
    hdrs: Vec<libc::mmsghdr>,
    /// Headers the last call filled (their lengths need resetting before the next).
    filled: usize,
    slots: usize,
    slot_size: usize,
    datagrams: Vec<Datagram>,
}

// The raw pointers in `iovs` and `hdrs` refer only to this batch's own heap buffers.
// SAFETY: those buffers move with the batch between threads; nothing else shares them.
unsafe impl Send for RxBatch {}

impl std::fmt::Debug for RxBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RxBatch")
            .field("slots", &self.slots)
            .field("slot_size", &self.slot_size)
            .field("datagrams", &self.datagrams.len())
            .finish()
    }
}

impl RxBatch {
    /// `slots` receive buffers of `slot_size` bytes (64 KiB with GRO).
    pub(crate) fn new(slots: usize, slot_size: usize) -> RxBatch {
        let mut rx = RxBatch {
            buf: vec![0; slots * slot_size],
            cmsgs: vec![CmsgBuf::ZERO; slots],
            // SAFETY: an all-zero sockaddr_in is a valid value.
            addrs: vec![unsafe { mem::zeroed() }; slots],
            iovs: Vec::with_capacity(slots),
            hdrs: Vec::with_capacity(slots),
            filled: slots,
            slots,
            slot_size,
            datagrams: Vec::with_capacity(slots * 4),
        };
        // Both vectors have their capacity reserved: a push never moves the entries the
        // headers already point at.
        for i in 0..slots {
            rx.iovs.push(libc::iovec {
                iov_base: rx.buf[i * slot_size..].as_mut_ptr().cast(),
                iov_len: slot_size,
            });
            // SAFETY: an all-zero mmsghdr is a valid value (null pointers, zero lengths).
            let mut m: libc::mmsghdr = unsafe { mem::zeroed() };
            m.msg_hdr.msg_name = (&mut rx.addrs[i] as *mut libc::sockaddr_in).cast();
            m.msg_hdr.msg_iov = &mut rx.iovs[i];
            m.msg_hdr.msg_iovlen = 1;
            m.msg_hdr.msg_control = rx.cmsgs[i].bytes.as_mut_ptr().cast();
            rx.hdrs.push(m);
        }
        rx.reset_headers();
        rx
    }

    /// Restores the lengths the kernel overwrote in the headers the last call filled.
    fn reset_headers(&mut self) {
        for h in &mut self.hdrs[..self.filled] {
            h.msg_hdr.msg_namelen = mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            h.msg_hdr.msg_controllen = CMSG_SPACE;
            h.msg_hdr.msg_flags = 0;
            h.msg_len = 0;
        }
        self.filled = 0;
    }

    fn clear(&mut self) {
        self.datagrams.clear();
    }

    /// Messages the last receive took (a GRO message counts once).
    pub(crate) fn messages(&self) -> usize {
        self.filled
    }

    /// Number of receive buffers (messages per `recvmmsg`).
    pub(crate) fn slots(&self) -> usize {
        self.slots
    }

    /// The datagrams received, in order.
    pub(crate) fn datagrams(&self) -> &[Datagram] {
        &self.datagrams
    }

    /// A datagram's bytes.
    pub(crate) fn data(&self, d: &Datagram) -> &[u8] {
        &self.buf[d.off..d.off + d.len]
    }
}

#[cfg(test)]
mod tests;
