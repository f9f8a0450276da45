//! Arrivals on a socket, told to a thread that does not read it.
//!
//! While an application thread polls and the packets of this host's peers come through the
//! shared-memory rings, the polling thread reads the rings on every round but the socket only
//! when told that it has datagrams: a `recvmsg` that finds nothing costs more than the rest of
//! an empty round, and a peer's packet that lands while the thread is inside one waits for it
//! (bench/results/dropin.md). The engine thread, parked for the application meanwhile,
//! watches the socket through an epoll set that holds it edge-triggered: each datagram that
//! arrives makes one edge, whether or not the ones before were read, so the watch never spins
//! on a socket the application has not read yet, and never misses a datagram that arrives
//! after it told the last one.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// An epoll set holding one socket, edge-triggered. Readable (for `poll`) while an edge waits.
pub(super) struct Edges {
    epoll: OwnedFd,
}

impl Edges {
    /// Watches `sock` (a descriptor that outlives the watch).
    pub(super) fn new(sock: RawFd) -> io::Result<Edges> {
        // SAFETY: plain epoll_create1 call.
        let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a new descriptor owned by nobody else.
        let epoll = unsafe { OwnedFd::from_raw_fd(raw) };
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLET) as u32,
            u64: 0,
        };
        // SAFETY: a live epoll descriptor, a live socket and a valid event.
        if unsafe { libc::epoll_ctl(raw, libc::EPOLL_CTL_ADD, sock, &mut ev) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Edges { epoll })
    }

    /// Takes the edges waiting, without blocking: whether there were any.
    pub(super) fn take(&self) -> bool {
        let mut ev = [libc::epoll_event { events: 0, u64: 0 }];
        // SAFETY: one writable event; timeout 0 (never blocks).
        unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), ev.as_mut_ptr(), 1, 0) > 0 }
    }
}

impl AsRawFd for Edges {
    fn as_raw_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::UdpSocket;

    fn readable(e: &Edges) -> bool {
        let mut p = libc::pollfd {
            fd: e.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd; timeout 0.
        unsafe { libc::poll(&mut p, 1, 0) == 1 && p.revents & libc::POLLIN != 0 }
    }

    #[test]
    fn each_arrival_makes_one_edge_whether_or_not_the_socket_was_read() {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let e = Edges::new(rx.as_raw_fd()).unwrap();
        assert!(!readable(&e) && !e.take(), "nothing arrived yet");
        tx.send_to(b"one", rx.local_addr().unwrap()).unwrap();
        // Loopback delivers synchronously within send_to.
        assert!(readable(&e), "the arrival shows");
        assert!(e.take());
        assert!(
            !readable(&e) && !e.take(),
            "told once: the unread datagram makes no more"
        );
        tx.send_to(b"two", rx.local_addr().unwrap()).unwrap();
        assert!(
            readable(&e),
            "a second arrival shows though the first is unread"
        );
        assert!(e.take());
        let mut buf = [0u8; 8];
        rx.set_nonblocking(true).unwrap();
        assert_eq!(rx.recv(&mut buf).unwrap(), 3);
        assert_eq!(rx.recv(&mut buf).unwrap(), 3);
        assert!(!e.take(), "reading makes no edge");
    }
}
