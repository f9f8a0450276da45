//! An open device: the root of every other handle.
//!
//! Owns [`Context`]: opening a device by name (kernel devices through libibverbs, `soft:<ipv4>` for
//! the software device), its cached attributes and limit profile, port and GID queries, and the
//! factories for protection domains and completion queues.

#![allow(unsafe_code)] // borrows the asynchronous events' descriptor

use std::fmt;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use crate::cq::Cq;
use crate::error::{Error, Result};
use crate::event::EventQueue;
use crate::limits::{Limits, ProfileKind, RawCaps};
use crate::pd::Pd;
use crate::provider::CtxImpl;
use crate::vocab::{
    AsyncEvent, AtomicCap, DeviceAttr, DeviceInfo, GidEntry, PortAttr, PortCounters, ProviderKind,
    Transport, find_ipv4_gid,
};

/// How to open a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OpenOptions {
    /// Force a limit profile (default: eRDMA for eRDMA devices and the soft device, the device's
    /// own attributes otherwise). The environment variable `ERDMA_PROFILE` (`erdma` or `device`)
    /// sets the same thing.
    pub profile: Option<ProfileKind>,
}

/// An open RDMA device. Cheap to clone; every handle made from it keeps it open.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<CtxInner>,
}

pub(crate) struct CtxInner {
    name: String,
    provider: ProviderKind,
    transport: Transport,
    pub(crate) imp: CtxImpl,
    attr: DeviceAttr,
    limits: Limits,
    /// Asynchronous events not yet read ([`Context::next_async_event`]).
    pub(crate) events: Arc<EventQueue>,
}

impl Context {
    /// Opens the device called `name`: a kernel device (`erdma_0`, `mlx5_0`, `rxe0`) or the soft
    /// device on a local IPv4 address (`soft:127.0.0.2`; plain `soft` means `soft:127.0.0.1`).
    ///
    /// # Errors
    /// [`Error::DeviceNotFound`] (listing the devices that exist), [`Error::Library`] when a
    /// kernel device is asked for and libibverbs is missing, [`Error::Verb`] when opening fails.
    pub fn open(name: &str) -> Result<Context> {
        Context::open_with(name, OpenOptions::default())
    }

    /// Opens the default device: `ERDMA_DEVICE` if set, else the first kernel device, else the soft
    /// device on 127.0.0.1.
    ///
    /// # Errors
    /// As [`Context::open`].
    pub fn open_default() -> Result<Context> {
        Context::open(&default_device_name())
    }

    /// [`Context::open`] with options.
    ///
    /// # Errors
    /// As [`Context::open`].
    pub fn open_with(name: &str, options: OpenOptions) -> Result<Context> {
        let (imp, canonical) = CtxImpl::open(name)?;
        Context::from_imp(imp, canonical, options)
    }

    /// Builds a context around a provider context that is already open (for example the one
    /// rdma_cm resolved): queries it and picks its limit profile, as [`Context::open_with`].
    pub(crate) fn from_imp(
        mut imp: CtxImpl,
        canonical: String,
        options: OpenOptions,
    ) -> Result<Context> {
        let attr = imp.query_device()?;
        let port = imp.query_port(1)?;
        let transport = imp.transport();
        let raw = RawCaps {
            max_qp_wr: attr.max_qp_wr,
            max_sge: attr.max_sge,
            max_sge_rd: attr.max_sge_rd,
            max_cqe: attr.max_cqe,
            max_qp_rd_atom: attr.max_qp_rd_atom,
            max_qp_init_rd_atom: attr.max_qp_init_rd_atom,
            max_mr_size: attr.max_mr_size,
            max_msg_size: port.max_msg_sz as u64,
            max_qp: attr.max_qp,
            max_cq: attr.max_cq,
            max_mr: attr.max_mr,
            max_pd: attr.max_pd,
            atomics: attr.atomic_cap != AtomicCap::None,
            max_srq: attr.max_srq,
            max_mw: attr.max_mw,
            max_inline: imp.max_inline(),
            vendor_id: attr.vendor_id,
            iwarp: transport == Transport::Iwarp,
        };
        let provider = imp.kind();
        let is_erdma = imp.is_erdma(&attr);
        let profile = options
            .profile
            .or_else(profile_from_env)
            .unwrap_or(if is_erdma {
                ProfileKind::Erdma
            } else {
                ProfileKind::Device
            });
        let limits = match profile {
            ProfileKind::Erdma => Limits::erdma(&raw),
            ProfileKind::Device => Limits::device(&raw),
        };
        let events = Arc::new(EventQueue::default());
        imp.watch_events(&events)?;
        Ok(Context {
            inner: Arc::new(CtxInner {
                name: canonical,
                provider,
                transport,
                imp,
                attr,
                limits,
                events,
            }),
        })
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The kernel driver behind a verbs device (`erdma`, `mlx5_core`, `rdma_rxe`, …), read from
    /// sysfs; `None` for the soft device or where sysfs does not say.
    pub fn driver(&self) -> Option<String> {
        self.inner.imp.driver()
    }

    /// Which provider runs it.
    pub fn provider(&self) -> ProviderKind {
        self.inner.provider
    }

    /// Its transport (eRDMA in its default mode is iWARP and connects through rdma_cm).
    pub fn transport(&self) -> Transport {
        self.inner.transport
    }

    /// The limits every request is checked against.
    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// The device attributes read when it was opened.
    pub fn attr(&self) -> &DeviceAttr {
        &self.inner.attr
    }

    /// Reads the device attributes again.
    ///
    /// # Errors
    /// [`Error::Verb`].
    pub fn query_device(&self) -> Result<DeviceAttr> {
        self.inner.imp.query_device()
    }

    /// Reads a port's attributes (ports are numbered from 1).
    ///
    /// # Errors
    /// [`Error::Verb`], or [`Error::InvalidArgument`] for a port that does not exist.
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        if port == 0 || port > self.inner.attr.phys_port_cnt.max(1) {
            return Err(Error::invalid(format!(
                "port {port}: the device has {} port(s), numbered from 1",
                self.inner.attr.phys_port_cnt.max(1)
            )));
        }
        self.inner.imp.query_port(port)
    }

    /// The port's transport counters ([`PortCounters`]): packets, retransmissions, RNR and
    /// sequence errors, drops, as the device counts them since it came up. Take two and
    /// subtract ([`PortCounters::since`]) to see what a run cost.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a port the device lacks; [`Error::Verb`] when a verbs
    /// device has no sysfs entry for the port.
    pub fn port_counters(&self, port: u8) -> Result<PortCounters> {
        self.query_port(port)?;
        self.inner.imp.port_counters(port)
    }

    /// The populated entries of a port's GID table, with their types.
    ///
    /// # Errors
    /// [`Error::Verb`].
    pub fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        let attr = self.query_port(port)?;
        self.inner.imp.gid_table(port, attr.gid_tbl_len)
    }

    /// The port's IPv4-mapped RoCEv2 GID, wherever it is in the table.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the port has none (an IPv6-only or iWARP port).
    pub fn ipv4_gid(&self, port: u8) -> Result<GidEntry> {
        let table = self.gid_table(port)?;
        find_ipv4_gid(&table).ok_or_else(|| {
            Error::invalid(format!(
                "device {} port {port} has no IPv4-mapped RoCEv2 GID ({} entries)",
                self.name(),
                table.len()
            ))
        })
    }

    /// Allocates a protection domain.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] naming `max_pd` when the soft device's profile is exhausted;
    /// [`Error::Verb`] from a kernel device (for example when `max_pd` is reached).
    pub fn alloc_pd(&self) -> Result<Pd> {
        let imp = self.inner.imp.alloc_pd()?;
        Ok(Pd::new(self.clone(), imp))
    }

    /// Creates a completion queue holding at least `depth` entries (the device may round up:
    /// [`Cq::depth`] tells).
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] above `max_cqe` (or `max_cq` queues on the soft device),
    /// [`Error::Verb`].
    pub fn create_cq(&self, depth: u32) -> Result<Cq> {
        let depth = self.inner.limits.cq_depth(depth)?;
        let id = crate::event::next_cq_id();
        let (imp, actual) = self.inner.imp.create_cq(depth, id, &self.inner.events)?;
        Ok(Cq::new(self.clone(), imp, actual, id))
    }

    /// The oldest asynchronous event not yet read, waiting up to `timeout` for one
    /// (`Duration::ZERO`: only look). Events are what the device reports outside completions:
    /// a completion queue's overrun, a queue pair's or the device's failure, a port going down or
    /// up ([`AsyncEvent`] says which, and what the SDK does about each). The context keeps the last 1024 unread; older ones are
    /// dropped and counted ([`Context::async_events_dropped`]).
    ///
    /// Reading them is optional: a completion queue's failure also reaches its own pollers and
    /// waiters ([`Cq::poll`]).
    pub fn next_async_event(&self, timeout: std::time::Duration) -> Option<AsyncEvent> {
        self.inner.events.next(timeout)
    }

    /// [`Context::next_async_event`] for async code: waits, without blocking the thread, until
    /// an event comes. Cancel-safe: an event is taken only when the future completes. Any
    /// executor runs it (it needs no reactor).
    #[cfg(feature = "tokio")]
    pub async fn recv_async_event(&self) -> AsyncEvent {
        self.inner.events.next_async().await
    }

    /// A descriptor that is readable while unread asynchronous events wait, for an event loop
    /// of the application's own (epoll, mio, io_uring `POLL_ADD`): on readiness, read events
    /// with `next_async_event(Duration::ZERO)` until it returns `None`, which also makes the
    /// descriptor unreadable again. Made on the first call (an eventfd), then the same one.
    ///
    /// # Errors
    /// [`Error::Io`] when the eventfd cannot be made.
    pub fn async_event_fd(&self) -> Result<BorrowedFd<'_>> {
        let raw = self
            .inner
            .events
            .fd()
            .map_err(|e| Error::io("making the asynchronous-event descriptor", e))?;
        // The descriptor belongs to this context's event queue, which closes it only when dropped.
        // SAFETY: the queue lives at least as long as `self`, so the descriptor stays open.
        Ok(unsafe { BorrowedFd::borrow_raw(raw) })
    }

    /// How many asynchronous events were dropped unread because 1024 were already waiting.
    pub fn async_events_dropped(&self) -> u64 {
        self.inner.events.dropped()
    }
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("name", &self.inner.name)
            .field("provider", &self.inner.provider)
            .field("profile", &self.inner.limits.profile)
            .finish()
    }
}

fn profile_from_env() -> Option<ProfileKind> {
    match std::env::var("ERDMA_PROFILE")
        .ok()?
        .to_ascii_lowercase()
        .as_str()
    {
        "erdma" => Some(ProfileKind::Erdma),
        "device" => Some(ProfileKind::Device),
        _ => None,
    }
}

/// Lists every device this machine can use: kernel devices first, then the soft devices that
/// can be opened on this host's loopback addresses.
///
/// Without libibverbs (or without kernel devices) the list holds only soft devices; the soft device
/// can always be opened on any local IPv4 address, so the list shows `soft:127.0.0.1` as the
/// default.
///
/// # Errors
/// Never fails for a missing libibverbs (the verbs part of the list is then empty); fails only when
/// libibverbs is present and listing its devices fails.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    Ok(crate::provider::list_devices())
}

/// The name of the device a program gets when it asks for none: the first kernel device, or the
/// soft device on 127.0.0.1 where there is no kernel device.
///
/// The environment variable `ERDMA_DEVICE` overrides the choice.
pub fn default_device_name() -> String {
    if let Ok(name) = std::env::var("ERDMA_DEVICE") {
        if !name.is_empty() {
            return name;
        }
    }
    crate::provider::first_device_name()
}
