//! Event channels and events.
//!
//! A channel's descriptor is an eventfd in semaphore mode: each posted event adds one, each
//! `rdma_get_cm_event` reads one (blocking or not as the program set the descriptor, exactly
//! like the kernel's `rdma_cm` descriptor it replaces) and then takes the event, which was
//! queued before the count was raised. An event keeps its identifiers alive until it is
//! acknowledged, so a program may read `event->id` after destroying nothing too early.

use std::collections::{BTreeMap, VecDeque};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::raw::c_int;
use std::sync::{Arc, Mutex};

use erdma_sys as sys;

use crate::id::Id;
use crate::{call, guard, last_errno, set_errno};

/// Private data an event can carry (`RDMA_MAX_PRIVATE_DATA`).
pub(crate) const MAX_PRIVATE: usize = 256;

/// One event as the program sees it, then what keeps it valid.
#[repr(C)]
pub(crate) struct EventBox {
    pub ev: sys::rdma_cm_event,
    private: [u8; MAX_PRIVATE],
    id: Arc<Id>,
    _listen: Option<Arc<Id>>,
    /// Handed out by `rdma_get_cm_event`: its acknowledgement is counted on `id`.
    counted: bool,
}

/// What an event says, before it is made.
pub(crate) struct Event<'a> {
    pub kind: sys::rdma_cm_event_type,
    pub status: c_int,
    /// Private data, zero-padded to `pad` bytes (as a RoCE CM message carries it).
    pub private: &'a [u8],
    pub pad: usize,
    pub responder_resources: u8,
    pub initiator_depth: u8,
}

impl Event<'_> {
    pub(crate) fn plain(kind: sys::rdma_cm_event_type, status: c_int) -> Event<'static> {
        Event {
            kind,
            status,
            private: &[],
            pad: 0,
            responder_resources: 0,
            initiator_depth: 0,
        }
    }

    /// The event for `id` (and the listener of a connection request).
    pub(crate) fn make(&self, id: &Arc<Id>, listen: Option<&Arc<Id>>) -> Box<EventBox> {
        // SAFETY: `rdma_cm_event` is pointers, integers and a union of those: all zeroes is valid.
        let mut ev: sys::rdma_cm_event = unsafe { std::mem::zeroed() };
        ev.id = id.c();
        ev.listen_id = listen.map_or(std::ptr::null_mut(), |l| l.c());
        ev.event = self.kind;
        ev.status = self.status;
        let mut b = Box::new(EventBox {
            ev,
            private: [0; MAX_PRIVATE],
            id: id.clone(),
            _listen: listen.cloned(),
            counted: false,
        });
        let n = self.private.len().min(MAX_PRIVATE);
        b.private[..n].copy_from_slice(&self.private[..n]);
        let len = n.max(self.pad.min(MAX_PRIVATE));
        // The connection-parameter view of the union: the one the event types made here use.
        let conn = sys::rdma_conn_param {
            private_data: if len > 0 {
                b.private.as_ptr().cast()
            } else {
                std::ptr::null()
            },
            private_data_len: len.min(255) as u8,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: 0,
            retry_count: 0,
            rnr_retry_count: 0,
            srq: 0,
            qp_num: 0,
        };
        b.ev.param.conn = conn;
        b
    }
}

/// A channel's queue and descriptor.
pub(crate) struct Chan {
    fd: OwnedFd,
    queue: Mutex<VecDeque<usize>>,
}

/// The program's `struct rdma_event_channel`. Its channel is found in the table of live ones
/// ([`ChanBox::of`]), which holds it until [`ChanBox::free`].
#[repr(C)]
pub(crate) struct ChanBox {
    pub c: sys::rdma_event_channel,
}

impl Chan {
    /// A channel, its descriptor blocking.
    pub(crate) fn new() -> Result<Arc<Chan>, c_int> {
        // SAFETY: plain syscall.
        let fd = unsafe { libc::eventfd(0, libc::EFD_SEMAPHORE | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(last_errno());
        }
        Ok(Arc::new(Chan {
            // SAFETY: the descriptor just made, owned here alone.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            queue: Mutex::default(),
        }))
    }

    /// The program's channel object for this channel (freed with [`ChanBox::free`]).
    pub(crate) fn boxed(self: &Arc<Chan>) -> *mut ChanBox {
        let p = Box::into_raw(Box::new(ChanBox {
            c: sys::rdma_event_channel {
                fd: self.fd.as_raw_fd(),
            },
        }));
        live().insert(p as usize, self.clone());
        p
    }

    /// Queues an event and counts it on the descriptor.
    pub(crate) fn post(&self, ev: Box<EventBox>) {
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(Box::into_raw(ev) as usize);
        let one = 1u64;
        // SAFETY: an 8-byte write from a live u64 to the channel's eventfd.
        unsafe { libc::write(self.fd.as_raw_fd(), (&raw const one).cast(), 8) };
    }

    /// The next event, waiting (or not) as the descriptor is set.
    pub(crate) fn take(&self) -> Result<*mut EventBox, c_int> {
        let mut v = 0u64;
        loop {
            // SAFETY: an 8-byte read into a live u64 from the channel's eventfd.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), (&raw mut v).cast(), 8) };
            if n == 8 {
                // The count is raised only after the event is queued, so a count has its event
                // unless `purge` took it away: then wait for the next, as if it never came.
                let p = self
                    .queue
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .pop_front();
                match p {
                    Some(p) => return Ok(p as *mut EventBox),
                    None => continue,
                }
            }
            let e = last_errno();
            if n < 0 && e == libc::EINTR {
                continue;
            }
            return Err(if n < 0 { e } else { libc::EIO });
        }
    }

    /// Drops the events queued for identifier `id` that nobody has taken, as the kernel drops a
    /// destroyed identifier's unread events: a thread waiting on the channel never wakes for
    /// one (rping's event thread would otherwise take a DISCONNECTED its main thread has
    /// already torn everything down after). Their counts stay on the descriptor; [`Chan::take`]
    /// passes over them.
    pub(crate) fn purge(&self, id: *mut sys::rdma_cm_id) {
        let gone: VecDeque<usize> = {
            let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            let (gone, kept) = q.drain(..).partition(|&p| {
                // SAFETY: queued events are live boxes this channel owns until taken.
                unsafe { (*(p as *const EventBox)).ev.id == id }
            });
            *q = kept;
            gone
        };
        for p in gone {
            // SAFETY: removed from the queue above, so owned here alone.
            drop(unsafe { Box::from_raw(p as *mut EventBox) });
        }
    }
}

impl Drop for Chan {
    fn drop(&mut self) {
        for p in self
            .queue
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            // SAFETY: queued events are boxes this channel owns until taken.
            drop(unsafe { Box::from_raw(p as *mut EventBox) });
        }
    }
}

/// The channel objects handed out and not yet freed, by address. A program's channel pointer is
/// looked up here, never read: a call on a channel the program has already destroyed (rping's
/// event thread makes one as its main thread exits) fails with `EBADF`, as rdma-core's read of
/// the closed descriptor does, instead of reading freed memory.
static LIVE: Mutex<BTreeMap<usize, Arc<Chan>>> = Mutex::new(BTreeMap::new());

fn live() -> std::sync::MutexGuard<'static, BTreeMap<usize, Arc<Chan>>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

impl ChanBox {
    /// The channel of a program's pointer: `None` for NULL, `EBADF` for a pointer that is not a
    /// live channel object of this library.
    pub(crate) fn of(p: *mut sys::rdma_event_channel) -> Result<Option<Arc<Chan>>, c_int> {
        if p.is_null() {
            return Ok(None);
        }
        live()
            .get(&(p as usize))
            .map(|c| Some(c.clone()))
            .ok_or(libc::EBADF)
    }

    /// Frees a channel object; one that is not live (freed already, or never made here) is
    /// left alone.
    ///
    /// # Safety
    /// `p` is not used as a channel afterwards.
    pub(crate) unsafe fn free(p: *mut ChanBox) {
        if live().remove(&(p as usize)).is_some() {
            // SAFETY: a live entry is a box made by `Chan::boxed` and not yet freed.
            drop(unsafe { Box::from_raw(p) });
        }
    }
}

/// Frees an event the program got.
///
/// # Safety
/// `ev` came from [`Chan::take`] and is not freed.
pub(crate) unsafe fn free_event(ev: *mut sys::rdma_cm_event) {
    // SAFETY: the caller's contract; `ev` is the first field of an `EventBox`.
    let b = unsafe { Box::from_raw(ev.cast::<EventBox>()) };
    if b.counted {
        b.id.event_acked();
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_create_event_channel() -> *mut sys::rdma_event_channel {
    guard(std::ptr::null_mut(), || match Chan::new() {
        Ok(c) => c.boxed().cast(),
        Err(e) => {
            set_errno(e);
            std::ptr::null_mut()
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_destroy_event_channel(channel: *mut sys::rdma_event_channel) {
    // SAFETY: the program's channel from rdma_create_event_channel (or NULL).
    guard((), || unsafe { ChanBox::free(channel.cast()) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_get_cm_event(
    channel: *mut sys::rdma_event_channel,
    event: *mut *mut sys::rdma_cm_event,
) -> c_int {
    call(|| {
        if event.is_null() {
            return Err(libc::EINVAL);
        }
        let chan = ChanBox::of(channel)?.ok_or(libc::EINVAL)?;
        let ev = chan.take()?;
        // SAFETY: an event just taken: owned by this call until handed out below.
        unsafe {
            (*ev).counted = true;
            (*ev).id.event_taken();
        }
        // SAFETY: a non-NULL out-parameter.
        unsafe { *event = ev.cast() };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_ack_cm_event(event: *mut sys::rdma_cm_event) -> c_int {
    call(|| {
        if event.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: an event from rdma_get_cm_event, acknowledged once (the C contract).
        unsafe { free_event(event) };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn rdma_event_str(event: sys::rdma_cm_event_type) -> *const std::os::raw::c_char {
    let s: &'static [u8] = match event {
        sys::RDMA_CM_EVENT_ADDR_RESOLVED => b"RDMA_CM_EVENT_ADDR_RESOLVED\0",
        sys::RDMA_CM_EVENT_ADDR_ERROR => b"RDMA_CM_EVENT_ADDR_ERROR\0",
        sys::RDMA_CM_EVENT_ROUTE_RESOLVED => b"RDMA_CM_EVENT_ROUTE_RESOLVED\0",
        sys::RDMA_CM_EVENT_ROUTE_ERROR => b"RDMA_CM_EVENT_ROUTE_ERROR\0",
        sys::RDMA_CM_EVENT_CONNECT_REQUEST => b"RDMA_CM_EVENT_CONNECT_REQUEST\0",
        sys::RDMA_CM_EVENT_CONNECT_RESPONSE => b"RDMA_CM_EVENT_CONNECT_RESPONSE\0",
        sys::RDMA_CM_EVENT_CONNECT_ERROR => b"RDMA_CM_EVENT_CONNECT_ERROR\0",
        sys::RDMA_CM_EVENT_UNREACHABLE => b"RDMA_CM_EVENT_UNREACHABLE\0",
        sys::RDMA_CM_EVENT_REJECTED => b"RDMA_CM_EVENT_REJECTED\0",
        sys::RDMA_CM_EVENT_ESTABLISHED => b"RDMA_CM_EVENT_ESTABLISHED\0",
        sys::RDMA_CM_EVENT_DISCONNECTED => b"RDMA_CM_EVENT_DISCONNECTED\0",
        sys::RDMA_CM_EVENT_DEVICE_REMOVAL => b"RDMA_CM_EVENT_DEVICE_REMOVAL\0",
        sys::RDMA_CM_EVENT_MULTICAST_JOIN => b"RDMA_CM_EVENT_MULTICAST_JOIN\0",
        sys::RDMA_CM_EVENT_MULTICAST_ERROR => b"RDMA_CM_EVENT_MULTICAST_ERROR\0",
        sys::RDMA_CM_EVENT_ADDR_CHANGE => b"RDMA_CM_EVENT_ADDR_CHANGE\0",
        sys::RDMA_CM_EVENT_TIMEWAIT_EXIT => b"RDMA_CM_EVENT_TIMEWAIT_EXIT\0",
        _ => b"UNKNOWN EVENT\0",
    };
    s.as_ptr().cast()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_carry_padded_private_data_in_order() {
        let chan = Chan::new().unwrap();
        let id = Id::new(None, std::ptr::null_mut(), sys::RDMA_PS_TCP).unwrap();
        let ev = Event {
            kind: sys::RDMA_CM_EVENT_CONNECT_REQUEST,
            status: 0,
            private: b"hello",
            pad: 56,
            responder_resources: 3,
            initiator_depth: 2,
        };
        chan.post(ev.make(&id, None));
        chan.post(Event::plain(sys::RDMA_CM_EVENT_DISCONNECTED, 0).make(&id, None));
        let first = chan.take().unwrap();
        // SAFETY: the event just taken; read, then freed once.
        unsafe {
            let e = &(*first).ev;
            assert_eq!(e.event, sys::RDMA_CM_EVENT_CONNECT_REQUEST);
            assert_eq!(e.id, id.c());
            let conn = e.param.conn;
            assert_eq!(conn.private_data_len, 56);
            let data = std::slice::from_raw_parts(conn.private_data.cast::<u8>(), 56);
            assert_eq!(&data[..5], b"hello");
            assert!(data[5..].iter().all(|&b| b == 0));
            assert_eq!((conn.responder_resources, conn.initiator_depth), (3, 2));
            free_event(first.cast());
        }
        let second = chan.take().unwrap();
        // SAFETY: as above.
        unsafe {
            assert_eq!((*second).ev.event, sys::RDMA_CM_EVENT_DISCONNECTED);
            assert!((*second).ev.param.conn.private_data.is_null());
            free_event(second.cast());
        }
        // Nothing more: a non-blocking descriptor says so.
        let fd = chan.fd.as_raw_fd();
        // SAFETY: fcntl on the channel's descriptor.
        unsafe { libc::fcntl(fd, libc::F_SETFL, libc::O_NONBLOCK) };
        assert_eq!(chan.take().err(), Some(libc::EAGAIN));
        crate::id::free_sync(&id, &mut id.lock());
    }

    /// A destroyed identifier's untaken events are gone: the channel hands out the others and
    /// then has nothing, its descriptor's counts for the purged ones passed over.
    #[test]
    fn purged_events_are_never_handed_out() {
        let chan = Chan::new().unwrap();
        let gone = Id::new(None, std::ptr::null_mut(), sys::RDMA_PS_TCP).unwrap();
        let kept = Id::new(None, std::ptr::null_mut(), sys::RDMA_PS_TCP).unwrap();
        let ev = |id| Event::plain(sys::RDMA_CM_EVENT_DISCONNECTED, 0).make(id, None);
        chan.post(ev(&gone));
        chan.post(ev(&kept));
        chan.post(ev(&gone));
        chan.purge(gone.c());
        // SAFETY: fcntl on the channel's descriptor.
        unsafe { libc::fcntl(chan.fd.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
        let e = chan.take().unwrap();
        // SAFETY: the event just taken; read, then freed once.
        unsafe {
            assert_eq!((*e).ev.id, kept.c());
            free_event(e.cast());
        }
        assert_eq!(chan.take().err(), Some(libc::EAGAIN));
        for id in [gone, kept] {
            crate::id::free_sync(&id, &mut id.lock());
        }
    }
}
