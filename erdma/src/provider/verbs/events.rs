//! Kernel devices' asynchronous events: one thread per process reads them for every open device.
//!
//! Owns the hub: the open contexts it watches (their `async_fd`s, the SDK contexts' event queues,
//! and the completion queues whose failure it must report), and the thread that sleeps on all of
//! them at once. The thread starts with the first watched context and ends with the last.
//!
//! Each event is copied and acknowledged (`ibv_ack_async_event`) at once: libibverbs makes
//! `ibv_destroy_cq`/`ibv_destroy_qp` wait for the acknowledgement of every event naming the
//! object, and `ibv_close_device` must not race a read. So every read happens under the hub's
//! lock, only from a context still watched, and a context is unwatched (under that lock) before
//! it is closed. The CQ and QP an unacknowledged event names cannot be destroyed meanwhile, so
//! reading their fields is sound.

#![allow(unsafe_code)] // libibverbs through FFI, epoll and eventfd

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use erdma_sys as sys;

use crate::error::{Error, Result};
use crate::event::EventQueue;
use crate::sync::EventFd;
use crate::vocab::{AsyncEvent, AsyncEventKind, ElementClass, EventElement};

/// A completion queue's failure, as the hub reports it to the queue's pollers and waiters.
pub(crate) struct CqFault {
    failed: AtomicBool,
    /// Part of the queue's wait descriptor: signalled when the queue fails, so a thread or task
    /// asleep on the queue wakes and polls (and meets the failure).
    kick: EventFd,
}

impl CqFault {
    pub(crate) fn new() -> std::io::Result<CqFault> {
        Ok(CqFault {
            failed: AtomicBool::new(false),
            kick: EventFd::new()?,
        })
    }

    /// Marks the queue failed and wakes whoever sleeps on it.
    pub(crate) fn fail(&self) {
        self.failed.store(true, Ordering::Release);
        self.kick.signal();
    }

    /// Takes the failure: `true` once per [`CqFault::fail`] (as a soft queue's overrun).
    pub(crate) fn take(&self) -> bool {
        self.failed.load(Ordering::Relaxed) && self.failed.swap(false, Ordering::AcqRel)
    }

    /// Clears the wake-up; returns whether there was one.
    pub(crate) fn consume_kick(&self) -> bool {
        self.kick.consume() > 0
    }

    pub(crate) fn kick_fd(&self) -> RawFd {
        self.kick.as_raw_fd()
    }
}

/// One open `ibv_context`.
struct Watched {
    ctx: usize,
    fd: RawFd,
    /// The SDK contexts on it (several when rdma_cm lends one device context to several).
    queues: Vec<Weak<EventQueue>>,
    /// Its completion queues: (`ibv_cq` address, SDK id, failure state).
    cqs: Vec<(usize, u64, Weak<CqFault>)>,
    /// The descriptor reported an error (the device is gone): no longer polled.
    dead: bool,
}

#[derive(Default)]
struct HubState {
    watched: Vec<Watched>,
    running: bool,
}

struct Hub {
    /// Wakes the thread when the watched set changes.
    ctl: EventFd,
    state: Mutex<HubState>,
}

fn hub() -> Result<&'static Hub> {
    static HUB: OnceLock<std::result::Result<Hub, String>> = OnceLock::new();
    HUB.get_or_init(|| {
        EventFd::new()
            .map(|ctl| Hub {
                ctl,
                state: Mutex::new(HubState::default()),
            })
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| {
        Error::io(
            "async events: creating an eventfd",
            std::io::Error::other(e.clone()),
        )
    })
}

fn lock(h: &Hub) -> MutexGuard<'_, HubState> {
    h.state.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts reading the events of `ctx` into `queue`.
///
/// # Safety
/// `ctx` must be an open context that stays open until [`unwatch`] has returned for it.
pub(crate) unsafe fn watch(
    lib: &'static sys::IbVerbs,
    ctx: *mut sys::ibv_context,
    queue: &Arc<EventQueue>,
) -> Result<()> {
    let h = hub()?;
    // SAFETY: the caller guarantees `ctx` is open.
    let fd = unsafe { (*ctx).async_fd };
    let mut st = lock(h);
    if !st.running {
        // Started before the context is added, so a failure leaves nothing behind; the thread
        // waits for this lock, and finds the context added.
        std::thread::Builder::new()
            .name("erdma-events".into())
            .spawn(move || run(h, lib))
            .map_err(|e| Error::io("async events: starting the thread", e))?;
        st.running = true;
    }
    match st.watched.iter_mut().find(|w| w.ctx == ctx as usize) {
        Some(w) => w.queues.push(Arc::downgrade(queue)),
        None => {
            // Non-blocking, so the thread takes every pending event and stops at the last
            // (the documented way to read them from an event loop).
            // SAFETY: fcntl on the context's open descriptor.
            let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
            // SAFETY: as above.
            if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0
            {
                return Err(Error::last_os(
                    "fcntl(O_NONBLOCK) on a device's event descriptor",
                ));
            }
            st.watched.push(Watched {
                ctx: ctx as usize,
                fd,
                queues: vec![Arc::downgrade(queue)],
                cqs: Vec::new(),
                dead: false,
            });
        }
    }
    drop(st);
    h.ctl.signal();
    Ok(())
}

/// Stops delivering `ctx`'s events to `queue`; once no queue is left, stops reading `ctx`. After
/// this returns the hub does not touch `ctx` again (unless it is watched anew).
pub(crate) fn unwatch(ctx: *mut sys::ibv_context, queue: &Arc<EventQueue>) {
    let Ok(h) = hub() else { return };
    let mut st = lock(h);
    if let Some(i) = st.watched.iter().position(|w| w.ctx == ctx as usize) {
        let w = &mut st.watched[i];
        w.queues
            .retain(|q| q.strong_count() > 0 && !std::ptr::eq(q.as_ptr(), Arc::as_ptr(queue)));
        if w.queues.is_empty() {
            st.watched.swap_remove(i);
        }
    }
    drop(st);
    h.ctl.signal();
}

/// Reports `cq`'s failures to `fault` (and names it `id` in events).
pub(crate) fn watch_cq(
    ctx: *mut sys::ibv_context,
    cq: *mut sys::ibv_cq,
    id: u64,
    fault: &Arc<CqFault>,
) {
    let Ok(h) = hub() else { return };
    let mut st = lock(h);
    if let Some(w) = st.watched.iter_mut().find(|w| w.ctx == ctx as usize) {
        w.cqs.retain(|(_, _, f)| f.strong_count() > 0);
        w.cqs.push((cq as usize, id, Arc::downgrade(fault)));
    }
}

/// Forgets `cq` (before it is destroyed: its address may be reused).
pub(crate) fn unwatch_cq(ctx: *mut sys::ibv_context, cq: *mut sys::ibv_cq) {
    let Ok(h) = hub() else { return };
    let mut st = lock(h);
    if let Some(w) = st.watched.iter_mut().find(|w| w.ctx == ctx as usize) {
        w.cqs.retain(|(c, _, _)| *c != cq as usize);
    }
}

fn run(h: &'static Hub, lib: &'static sys::IbVerbs) {
    let mut fds: Vec<libc::pollfd> = Vec::new();
    let mut ctxs: Vec<usize> = Vec::new();
    loop {
        {
            let mut st = lock(h);
            if st.watched.is_empty() {
                st.running = false;
                return;
            }
            fds.clear();
            ctxs.clear();
            fds.push(pollfd(h.ctl.as_raw_fd()));
            for w in st.watched.iter().filter(|w| !w.dead) {
                fds.push(pollfd(w.fd));
                ctxs.push(w.ctx);
            }
        }
        // SAFETY: `fds` is a live array of `fds.len()` pollfds.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if r < 0 {
            // EINTR: look again. Anything else cannot be cured by retrying at once.
            if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            continue;
        }
        h.ctl.consume();
        let mut st = lock(h);
        let mut ready = 0;
        let mut read = 0;
        for (p, &ctx) in fds[1..].iter().zip(&ctxs) {
            if p.revents == 0 {
                continue;
            }
            // Read only from a context still watched (so still open) with this descriptor.
            if let Some(w) = st.watched.iter_mut().find(|w| w.ctx == ctx && w.fd == p.fd) {
                ready += 1;
                read += drain(lib, w);
                if p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
                    // A descriptor in error (a device gone) stays ready for ever: stop
                    // watching it rather than spin on it.
                    w.dead = true;
                }
            }
        }
        drop(st);
        if ready > 0 && read == 0 {
            // Ready yet nothing to read: do not spin on such a descriptor.
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

fn pollfd(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// Reads, acknowledges and dispatches every pending event of `w`; returns how many. The hub's
/// lock is held.
fn drain(lib: &'static sys::IbVerbs, w: &mut Watched) -> usize {
    let ctx = w.ctx as *mut sys::ibv_context;
    let mut read = 0;
    loop {
        let mut raw = std::mem::MaybeUninit::<sys::ibv_async_event>::uninit();
        // `ctx` is watched, hence open (see `watch`), and its descriptor is non-blocking.
        // SAFETY: an open context; `raw` is a valid out-parameter.
        if unsafe { (lib.ibv_get_async_event)(ctx, raw.as_mut_ptr()) } != 0 {
            return read;
        }
        read += 1;
        // SAFETY: ibv_get_async_event filled the event.
        let mut raw = unsafe { raw.assume_init() };
        let kind = AsyncEventKind::from_raw(raw.event_type);
        let element = match kind.element_class() {
            ElementClass::Cq => {
                // SAFETY: a CQ event carries the CQ; only its address is used.
                let cq = unsafe { raw.element.cq } as usize;
                let known = w.cqs.iter().find(|(c, _, _)| *c == cq);
                if let Some((_, _, fault)) = known
                    && kind == AsyncEventKind::CqErr
                    && let Some(f) = fault.upgrade()
                {
                    f.fail();
                }
                EventElement::Cq(known.map_or(0, |(_, id, _)| *id))
            }
            ElementClass::Qp => {
                // The QP cannot be destroyed before the event is acknowledged (below).
                // SAFETY: a QP event carries a live QP.
                EventElement::Qp(unsafe { (*raw.element.qp).qp_num })
            }
            ElementClass::Srq => EventElement::Srq,
            ElementClass::Wq => EventElement::Wq,
            ElementClass::Port => {
                // SAFETY: a port event carries the port number.
                EventElement::Port(unsafe { raw.element.port_num }.clamp(0, 255) as u8)
            }
            ElementClass::Device => EventElement::Device,
        };
        // SAFETY: acknowledges the event just read, once.
        unsafe { (lib.ibv_ack_async_event)(&mut raw) };
        if kind == AsyncEventKind::DeviceFatal {
            // Nothing of the device completes any more: every waiter must hear it.
            for f in w.cqs.iter().filter_map(|(_, _, f)| f.upgrade()) {
                f.fail();
            }
        }
        let ev = AsyncEvent { kind, element };
        w.queues.retain(|q| q.strong_count() > 0);
        for q in w.queues.iter().filter_map(Weak::upgrade) {
            q.push(ev);
        }
    }
}
