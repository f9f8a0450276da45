//! Asynchronous events: what a device reports outside any completion.
//!
//! Owns the per-context queue that [`crate::Context::next_async_event`] reads (the events
//! themselves are values: [`crate::AsyncEvent`]).

#![allow(unsafe_code)] // reads the events' descriptor

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use crate::vocab::AsyncEvent;

/// Most events a context keeps unread; older ones are dropped (and counted) beyond it.
pub(crate) const QUEUE_CAP: usize = 1024;

/// A context's unread events.
#[derive(Default)]
pub(crate) struct EventQueue {
    events: Mutex<VecDeque<AsyncEvent>>,
    arrived: Condvar,
    dropped: AtomicU64,
    /// Readable while events wait, for reactors of the application's own
    /// ([`crate::Context::async_event_fd`]); made on first request.
    fd: std::sync::OnceLock<crate::sync::EventFd>,
    /// Wakes tasks waiting in [`EventQueue::next_async`].
    #[cfg(feature = "tokio")]
    arrived_async: tokio::sync::Notify,
}

impl EventQueue {
    /// Adds an event, dropping the oldest when the queue is full.
    pub(crate) fn push(&self, ev: AsyncEvent) {
        let mut q = self.events.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= QUEUE_CAP {
            q.pop_front();
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        q.push_back(ev);
        if let Some(fd) = self.fd.get() {
            fd.signal();
        }
        drop(q);
        self.arrived.notify_all();
        #[cfg(feature = "tokio")]
        self.arrived_async.notify_waiters();
    }

    /// The oldest unread event, waiting (without blocking the thread) until there is one.
    /// Cancel-safe: an event is taken only when the future completes.
    #[cfg(feature = "tokio")]
    pub(crate) async fn next_async(&self) -> AsyncEvent {
        loop {
            let arrived = self.arrived_async.notified();
            let mut arrived = std::pin::pin!(arrived);
            // Registered before looking, so a push between the look and the wait wakes it.
            arrived.as_mut().enable();
            if let Some(ev) = self.next(Duration::ZERO) {
                return ev;
            }
            arrived.await;
        }
    }

    /// The oldest unread event, waiting up to `timeout` for one.
    pub(crate) fn next(&self, timeout: Duration) -> Option<AsyncEvent> {
        let deadline = crate::sync::deadline(timeout);
        let mut q = self.events.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(ev) = q.pop_front() {
                if q.is_empty()
                    && let Some(fd) = self.fd.get()
                {
                    fd.consume();
                }
                return Some(ev);
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return None;
            }
            q = self
                .arrived
                .wait_timeout(q, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The descriptor that is readable while events wait (made on the first call).
    pub(crate) fn fd(&self) -> std::io::Result<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        if let Some(fd) = self.fd.get() {
            return Ok(fd.as_raw_fd());
        }
        let made = crate::sync::EventFd::new()?;
        // Under the queue's lock, so that the count agrees with the queue from the start.
        let q = self.events.lock().unwrap_or_else(|e| e.into_inner());
        let fd = self.fd.get_or_init(|| made);
        if !q.is_empty() {
            fd.signal();
        }
        Ok(fd.as_raw_fd())
    }

    /// How many events were dropped unread because the queue was full.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// A process-unique completion-queue id ([`crate::Cq::id`]).
pub(crate) fn next_cq_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::{AsyncEventKind, ElementClass, EventElement};

    /// Whether `fd` is readable now.
    fn readable(fd: std::os::fd::RawFd) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no waiting.
        let r = unsafe { libc::poll(&mut p, 1, 0) };
        r == 1 && p.revents & libc::POLLIN != 0
    }

    /// The descriptor is readable exactly while events wait, including those that came before
    /// it was made.
    #[test]
    fn the_descriptor_is_readable_while_events_wait() {
        let q = EventQueue::default();
        let ev = |n: u8| AsyncEvent {
            kind: AsyncEventKind::PortActive,
            element: EventElement::Port(n),
        };
        q.push(ev(1));
        let fd = q.fd().unwrap();
        assert!(readable(fd), "an event from before the descriptor");
        assert_eq!(q.fd().unwrap(), fd, "one descriptor");
        assert_eq!(q.next(Duration::ZERO), Some(ev(1)));
        assert!(!readable(fd));
        q.push(ev(2));
        q.push(ev(3));
        assert!(readable(fd));
        assert_eq!(q.next(Duration::ZERO), Some(ev(2)));
        assert!(readable(fd), "one still waits");
        assert_eq!(q.next(Duration::ZERO), Some(ev(3)));
        assert!(!readable(fd));
        assert_eq!(q.next(Duration::ZERO), None);
        assert!(!readable(fd));
    }

    #[test]
    fn kinds_round_trip_and_name_their_element() {
        for v in 0..25 {
            assert_eq!(AsyncEventKind::from_raw(v).as_raw(), v);
        }
        assert_eq!(AsyncEventKind::from_raw(0), AsyncEventKind::CqErr);
        assert_eq!(AsyncEventKind::from_raw(99), AsyncEventKind::Other(99));
        assert_eq!(AsyncEventKind::CqErr.element_class(), ElementClass::Cq);
        assert_eq!(AsyncEventKind::QpFatal.element_class(), ElementClass::Qp);
        assert_eq!(AsyncEventKind::PortErr.element_class(), ElementClass::Port);
        assert_eq!(
            AsyncEventKind::DeviceFatal.element_class(),
            ElementClass::Device
        );
    }

    #[test]
    fn a_full_queue_drops_the_oldest_and_counts_it() {
        let q = EventQueue::default();
        for p in 0..QUEUE_CAP + 3 {
            q.push(AsyncEvent {
                kind: AsyncEventKind::PortActive,
                element: EventElement::Port((p % 200) as u8),
            });
        }
        assert_eq!(q.dropped(), 3);
        let first = q.next(Duration::ZERO).unwrap();
        assert_eq!(first.element, EventElement::Port(3));
        let mut n = 1;
        while q.next(Duration::ZERO).is_some() {
            n += 1;
        }
        assert_eq!(n, QUEUE_CAP);
        let t = std::time::Instant::now();
        assert!(q.next(Duration::from_millis(20)).is_none());
        assert!(t.elapsed() >= Duration::from_millis(20));
    }

    #[cfg(feature = "tokio")]
    #[test]
    fn a_task_waiting_for_an_event_wakes_when_one_is_pushed() {
        let q = std::sync::Arc::new(EventQueue::default());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let ev = AsyncEvent {
            kind: AsyncEventKind::PortErr,
            element: EventElement::Port(1),
        };
        let q2 = q.clone();
        let pusher = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            q2.push(ev);
        });
        let got = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), q.next_async()).await
        });
        assert_eq!(got, Ok(ev));
        pusher.join().unwrap();
        // An event already queued is taken at once.
        q.push(ev);
        assert_eq!(rt.block_on(q.next_async()), ev);
    }

    #[test]
    fn a_waiting_reader_gets_an_event_pushed_later() {
        let q = std::sync::Arc::new(EventQueue::default());
        let q2 = q.clone();
        let reader = std::thread::spawn(move || q2.next(Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        let ev = AsyncEvent {
            kind: AsyncEventKind::CqErr,
            element: EventElement::Cq(7),
        };
        q.push(ev);
        assert_eq!(reader.join().unwrap(), Some(ev));
        assert_eq!(ev.to_string(), "CqErr on completion queue 7");
    }
}
