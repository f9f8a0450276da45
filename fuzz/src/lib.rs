//! Shared pieces of the fuzz targets: a memory wrapper that turns every access the protocol
//! should never make into a panic (which libFuzzer reports as a crash), and packet builders.

use std::collections::HashMap;

use erdma::soft::proto::{AtomicOp, Memory, MemoryError, Region};

/// What the protocol may do to one region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allowed {
    /// Copy bytes out of it.
    pub read: bool,
    /// Copy bytes into it, or run atomics on it.
    pub write: bool,
}

impl Allowed {
    /// Nothing at all.
    pub const NONE: Allowed = Allowed {
        read: false,
        write: false,
    };
    /// Reads only.
    pub const READ: Allowed = Allowed {
        read: true,
        write: false,
    };
    /// Reads and writes.
    pub const ALL: Allowed = Allowed {
        read: true,
        write: true,
    };
}

/// A [`Memory`] that checks every access against a per-key policy and against the region's own
/// bounds before passing it on, and panics on a violation: the protocol must do every check
/// itself, so the implementation's second line of defence is never needed.
#[derive(Debug)]
pub struct Guarded<'m, M: Memory> {
    /// The memory accesses go to.
    pub inner: &'m mut M,
    /// Allowed accesses by key; a key not listed allows nothing.
    pub policy: &'m HashMap<u32, Allowed>,
}

impl<M: Memory> Guarded<'_, M> {
    fn check(&self, region: &Region, offset: u64, len: u64, write: bool) {
        let live = self
            .inner
            .region(region.key)
            .unwrap_or_else(|| panic!("access to a dead key {:#x}", region.key));
        assert_eq!(&live, region, "the protocol passed a stale region record");
        let end = offset.checked_add(len).expect("offset + len overflows");
        assert!(
            end <= region.len,
            "access [{offset}, {end}) outside a {}-byte region",
            region.len
        );
        let allowed = self
            .policy
            .get(&region.key)
            .copied()
            .unwrap_or(Allowed::NONE);
        if write {
            assert!(allowed.write, "write to protected region {:#x}", region.key);
        } else {
            assert!(allowed.read, "read of protected region {:#x}", region.key);
        }
    }
}

impl<M: Memory> Memory for Guarded<'_, M> {
    fn region(&self, key: u32) -> Option<Region> {
        self.inner.region(key)
    }

    fn read(&mut self, region: &Region, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError> {
        self.check(region, offset, dst.len() as u64, false);
        self.inner.read(region, offset, dst)
    }

    fn write(&mut self, region: &Region, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        self.check(region, offset, src.len() as u64, true);
        self.inner.write(region, offset, src)
    }

    fn atomic(&mut self, region: &Region, offset: u64, op: AtomicOp) -> Result<u64, MemoryError> {
        self.check(region, offset, 8, true);
        assert_eq!(
            region.iova.wrapping_add(offset) % 8,
            0,
            "atomic on an unaligned address"
        );
        self.inner.atomic(region, offset, op)
    }

    fn invalidate(&mut self, region: &Region) -> Result<(), MemoryError> {
        self.inner.invalidate(region)
    }
}

/// A connected loopback TCP pair for the out-of-band targets: the side under test, and a peer
/// that has already sent `bytes` and shut its write half (so the side under test reads exactly
/// `bytes` and then end-of-stream, never waiting on a timer). The peer stays open, so writes of
/// the side under test succeed; drop the [`FedStream`] to reset both ends.
#[derive(Debug)]
pub struct FedStream {
    // Declared first, so dropped first: its reset closes both ends without TIME_WAIT.
    _peer: std::net::TcpStream,
    /// The side under test.
    pub ours: std::net::TcpStream,
}

impl FedStream {
    /// Connects a fresh pair through a listener shared by every input of the process.
    ///
    /// # Panics
    /// When loopback TCP fails (the machine, not the input, is at fault).
    pub fn new(bytes: &[u8]) -> FedStream {
        use std::io::Write;
        use std::net::{Shutdown, TcpListener, TcpStream};
        use std::sync::OnceLock;

        static LISTENER: OnceLock<TcpListener> = OnceLock::new();
        let listener =
            LISTENER.get_or_init(|| TcpListener::bind("127.0.0.1:0").expect("loopback listener"));
        let ours = TcpStream::connect(listener.local_addr().expect("listener address"))
            .expect("loopback connect");
        let (mut peer, _) = listener.accept().expect("loopback accept");
        // A few KiB at most: the socket buffers take it all without a reader.
        peer.write_all(bytes).expect("loopback write");
        peer.shutdown(Shutdown::Write).expect("loopback shutdown");
        // Linger 0: closing resets the connection instead of leaving TIME_WAIT behind, so
        // millions of inputs do not run out of ephemeral ports.
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: `peer` owns a valid socket descriptor for the whole call, and the option value
        // points at a live `libc::linger` whose size is passed with it.
        let rc = unsafe {
            libc::setsockopt(
                std::os::fd::AsRawFd::as_raw_fd(&peer),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0, "SO_LINGER on a loopback socket");
        FedStream { _peer: peer, ours }
    }
}
