//! The synchronisation primitives shared between application threads and the soft device's
//! engine, behind one facade so `loom` can model them (`RUSTFLAGS="--cfg loom"`); the eventfd
//! that wakes sleeping threads; deadlines.

#![allow(unsafe_code)] // the eventfd syscalls

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

#[cfg(loom)]
pub(crate) use loom::sync::Mutex;
#[cfg(not(loom))]
pub(crate) use std::sync::Mutex;

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{
    AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence,
};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{
    AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence,
};

/// An `UnsafeCell` with loom's closure-based access API, so the same code runs under both.
#[cfg(loom)]
pub(crate) use loom::cell::UnsafeCell;

/// An `UnsafeCell` with loom's closure-based access API, so the same code runs under both.
#[cfg(not(loom))]
#[derive(Debug)]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    pub(crate) const fn new(v: T) -> UnsafeCell<T> {
        UnsafeCell(std::cell::UnsafeCell::new(v))
    }

    /// Runs `f` with a shared raw pointer to the value.
    #[inline]
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }

    /// Runs `f` with an exclusive raw pointer to the value.
    #[inline]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

/// A non-blocking eventfd.
#[derive(Debug)]
pub(crate) struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// A new eventfd with count 0.
    pub(crate) fn new() -> std::io::Result<EventFd> {
        // SAFETY: plain eventfd(2) call.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `raw` is a new descriptor owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(EventFd { fd })
    }

    /// Adds one to the count (wakes a waiter).
    pub(crate) fn signal(&self) {
        let one: u64 = 1;
        // A full counter (EAGAIN) already means "signalled", so the result is not needed.
        // SAFETY: writes 8 bytes from a live u64, as eventfd requires.
        unsafe {
            libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8);
        }
    }

    /// Reads and clears the count; 0 when nothing was signalled.
    pub(crate) fn consume(&self) -> u64 {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64.
        let r = unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        if r == 8 { v } else { 0 }
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// The instant `timeout` after `start`. A timeout too long for the clock (`Duration::MAX`, a
/// common way to say "no limit") gives an instant a century away instead of overflowing.
pub(crate) fn deadline_from(
    start: std::time::Instant,
    timeout: std::time::Duration,
) -> std::time::Instant {
    const CENTURY: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 86_400);
    start.checked_add(timeout).unwrap_or(start + CENTURY)
}

/// The instant `timeout` from now ([`deadline_from`]).
pub(crate) fn deadline(timeout: std::time::Duration) -> std::time::Instant {
    deadline_from(std::time::Instant::now(), timeout)
}
