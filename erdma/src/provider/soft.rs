//! The soft device as a provider: the verbs-shaped objects ([`SoftCtx`], [`SoftPd`],
//! [`SoftMr`], [`SoftCq`], [`SoftQp`]) over a soft device's engine.
//!
//! Owns what a verbs caller sees of the soft device and the engine does not: the device and
//! port attributes it reports (the eRDMA profile), its GID table, its port counters by name,
//! and turning raw requests ([`SendReq`], [`RecvReq`]) into the protocol's work requests.
//! Everything below — queues, packets, memory — is the engine's.

#![allow(unsafe_code)] // the raw provider line: inline bytes by address

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::PostResult;
use super::req::{RecvReq, SendReq};
use crate::error::{Error, Result};
use crate::event::EventQueue;
use crate::soft::counter as c;
use crate::soft::driver::{self, Device};
use crate::soft::engine::notify::{CompletionRing, EventSink};
use crate::soft::engine::{Engine, QpCell, caps};
use crate::soft::proto;
use crate::sync::{AtomicBool, EventFd, Ordering};
use crate::vocab::{
    Access, AsyncEvent, AtomicCap, Completion, DeviceAttr, Gid, GidEntry, GidType, LinkLayer, Mtu,
    PortAttr, PortCounters, PortState, QpAttr, QpCaps, QpState, SendFlags, Sge,
};

impl EventSink for EventQueue {
    fn report(&self, ev: AsyncEvent) {
        self.push(ev);
    }
}

/// An open soft device.
pub(crate) struct SoftCtx {
    dev: Arc<Device>,
}

impl SoftCtx {
    /// Opens (or joins, within this process) the soft device on `addr`.
    ///
    /// # Errors
    /// As the driver's open: the address's RoCE port cannot be bound, say.
    pub(crate) fn open(addr: Ipv4Addr) -> Result<SoftCtx> {
        Ok(SoftCtx {
            dev: driver::open_device(addr)?,
        })
    }

    /// [`SoftCtx::open`] that leaves the address's RoCE port unbound until the device's first
    /// queue pair: a program that opens every device it lists (libfabric, NCCL, UCX) takes no
    /// address it does not use.
    ///
    /// # Errors
    /// As the driver's open, less the bind.
    #[cfg(feature = "raw-provider")]
    pub(crate) fn open_unbound(addr: Ipv4Addr) -> Result<SoftCtx> {
        Ok(SoftCtx {
            dev: driver::open_unbound(addr)?,
        })
    }

    fn engine(&self) -> &Arc<Engine> {
        self.dev.engine()
    }

    /// Binds the device's RoCE port (a no-op once bound).
    ///
    /// # Errors
    /// As [`Device::bind`].
    #[cfg(feature = "raw-provider")]
    pub(crate) fn bind(&self) -> Result<()> {
        self.dev.bind()
    }

    /// See [`crate::soft::engine::Engine::take_in`].
    #[cfg(feature = "raw-provider")]
    pub(crate) fn take_in(&self) {
        self.engine().take_in();
    }

    /// The device's address.
    pub(crate) fn addr(&self) -> Ipv4Addr {
        self.engine().addr
    }

    pub(crate) fn query_device(&self) -> DeviceAttr {
        let guid = driver::node_guid(self.addr());
        DeviceAttr {
            fw_ver: format!("soft-{}", env!("CARGO_PKG_VERSION")),
            node_guid: guid,
            sys_image_guid: guid,
            max_mr_size: caps::MAX_MR_SIZE,
            page_size_cap: caps::PAGE_SIZE_CAP,
            vendor_id: crate::profile::ERDMA_VENDOR_ID,
            vendor_part_id: crate::profile::ERDMA_PART_ID,
            hw_ver: 0,
            max_qp: caps::MAX_QP,
            max_qp_wr: caps::MAX_QP_WR,
            device_cap_flags: 0,
            max_sge: proto::MAX_SGE as u32,
            max_sge_rd: 1,
            max_cq: caps::MAX_CQ,
            max_cqe: caps::MAX_CQE,
            max_mr: caps::MAX_MR,
            max_pd: caps::MAX_PD,
            max_qp_rd_atom: u32::from(proto::MAX_RD_ATOMIC),
            max_qp_init_rd_atom: u32::from(proto::MAX_RD_ATOMIC),
            atomic_cap: AtomicCap::Global,
            max_srq: 0,
            max_mw: 0,
            max_ah: 0,
            phys_port_cnt: 1,
        }
    }

    pub(crate) fn query_port(&self) -> PortAttr {
        PortAttr {
            state: PortState::Active,
            max_mtu: Mtu::Mtu4096,
            active_mtu: self.engine().active_mtu,
            gid_tbl_len: caps::GID_TABLE_LEN,
            port_cap_flags: 0,
            max_msg_sz: caps::MAX_MSG,
            lid: 0,
            link_layer: LinkLayer::Ethernet,
            active_width: 1,
            active_speed: 0,
        }
    }

    /// Index 0: a link-local GID made from the address (as RoCE devices put `fe80::` first);
    /// index 1: the IPv4-mapped GID every peer uses.
    pub(crate) fn gid_table(&self) -> Vec<GidEntry> {
        let o = self.addr().octets();
        let mut ll = [0u8; 16];
        ll[0] = 0xfe;
        ll[1] = 0x80;
        ll[8..12].copy_from_slice(&[0x02, 0x1d, 0xed, 0xff]);
        ll[12..].copy_from_slice(&o);
        vec![
            GidEntry {
                index: 0,
                gid: Gid(ll),
                gid_type: GidType::RoceV2,
            },
            GidEntry {
                index: 1,
                gid: Gid::from_ipv4(self.addr()),
                gid_type: GidType::RoceV2,
            },
        ]
    }

    /// The port's counters: every queue pair's, destroyed ones included, and the device's own
    /// (datagrams received, drops before routing). See [`crate::soft::counter`].
    pub(crate) fn port_counters(&self) -> PortCounters {
        let engine = self.engine();
        let (total, rcvd) = engine.counters();
        let mut pairs: Vec<(String, u64)> = [
            (c::SENT_PKTS, total.packets_sent),
            (c::RCVD_PKTS, total.packets_received),
            (c::DUPLICATE_REQUEST, total.duplicates),
            (c::OUT_OF_SEQ_REQUEST, total.out_of_sequence),
            (c::RCVD_RNR_ERR, total.rnr_naks_received),
            (c::SEND_RNR_ERR, total.rnr_naks_sent),
            (c::COMPLETER_RETRY_ERR, total.retries),
            (c::RETRIES, total.retries),
            (c::RETRANSMITTED_PKTS, total.retransmits),
            (c::ACK_TIMEOUTS, total.timeouts),
            (c::ACKS_SENT, total.acks_sent),
            (c::NAKS_SENT, total.naks_sent),
            (c::NAKS_RCVD, total.naks_received),
            (c::RCVD_DATAGRAMS, rcvd),
            (c::PEER_REF_SENT_PKTS, total.peer_ref_sent),
            (c::PEER_REF_RCVD_PKTS, total.peer_ref_received),
            (c::DROPS, total.drops.total()),
            (c::SEND_REFUSED, engine.io.refused()),
        ]
        .into_iter()
        .map(|(n, v)| (n.to_string(), v))
        .collect();
        let rings = engine.io.channels().map_or([0; 3], |c| c.counts());
        for (name, n) in [c::RING_SENT_PKTS, c::RING_RCVD_PKTS, c::RING_SPILLED_MSGS]
            .into_iter()
            .zip(rings)
        {
            pairs.push((name.to_string(), n));
        }
        if let Some(n) = engine.io.kernel_drops() {
            pairs.push((c::SOCKET_DROPS.to_string(), n + engine.handoff_drops()));
        }
        pairs.extend(proto::DropReason::ALL.iter().map(|&r| {
            (
                format!("{}{}", c::DROP_PREFIX, r.name()),
                total.drops.get(r),
            )
        }));
        PortCounters::from_pairs(pairs)
    }

    pub(crate) fn alloc_pd(&self) -> Result<SoftPd> {
        Ok(SoftPd {
            pdn: self.engine().alloc_pd()?,
        })
    }

    /// Creates a completion queue with an eventfd; its overruns are reported to `events` as
    /// `CqErr` naming `id`.
    pub(crate) fn create_cq(
        &self,
        depth: u32,
        id: u64,
        events: Arc<dyn EventSink>,
    ) -> Result<(SoftCq, u32)> {
        let event = EventFd::new().map_err(|e| Error::io("soft CQ: creating an eventfd", e))?;
        let ring = self.engine().create_cq(depth, event, events, id)?;
        Ok((
            SoftCq {
                ring,
                engine: self.engine().clone(),
                inline: AtomicBool::new(true),
            },
            depth,
        ))
    }
}

/// A protection domain.
pub(crate) struct SoftPd {
    pdn: u32,
}

impl SoftPd {
    pub(crate) fn dealloc(&self, ctx: &SoftCtx) {
        ctx.engine().dealloc_pd();
    }

    /// Registers `len` bytes at `addr`; returns the region with its lkey and rkey.
    ///
    /// # Safety
    /// `[addr, addr+len)` stays allocated until [`SoftMr::deregister`] returns, and the device
    /// may read and write it meanwhile (as requests and peers with the region's key ask).
    pub(crate) unsafe fn reg_mr(
        &self,
        ctx: &SoftCtx,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<(SoftMr, u32, u32)> {
        // SAFETY: the caller's contract is the engine's.
        let key = unsafe {
            ctx.engine()
                .reg_mr(self.pdn, addr as u64, len as u64, access)
        }?;
        Ok((SoftMr { key }, key, key))
    }

    /// Registers device (GPU) memory at `addr`: the engine reaches it through `stager`.
    #[cfg(feature = "gpu")]
    pub(crate) fn reg_device_mr(
        &self,
        ctx: &SoftCtx,
        addr: u64,
        len: usize,
        access: Access,
        stager: Arc<crate::soft::engine::stage::Stager>,
    ) -> Result<(SoftMr, u32, u32)> {
        let key = ctx
            .engine()
            .reg_device_mr(self.pdn, addr, len as u64, access, stager)?;
        Ok((SoftMr { key }, key, key))
    }

    /// Registers GPU memory: the engine moves its bytes with CUDA copies through pinned
    /// staging slots (a dma-buf from the NVIDIA driver cannot be mapped).
    ///
    /// # Safety
    /// `span` is allocated device memory that stays allocated until the region is
    /// deregistered.
    #[cfg(feature = "gpu")]
    pub(crate) unsafe fn reg_gpu(
        &self,
        ctx: &SoftCtx,
        span: crate::vocab::GpuSpan,
        access: Access,
    ) -> Result<(SoftMr, u32, u32, crate::vocab::RegistrationPath)> {
        use crate::soft::engine::stage::{READ_SLOTS, Stager, WRITE_SLOTS, slot_len_for};
        let (addr, len) = (span.addr, span.len);
        let engine = crate::gpu::cuda::CudaEngine::new(
            span.device,
            addr,
            READ_SLOTS + WRITE_SLOTS,
            slot_len_for(len as u64),
        )?;
        let stager = Arc::new(Stager::new(Box::new(engine), len as u64));
        let (m, l, r) = self.reg_device_mr(ctx, addr, len, access, stager)?;
        Ok((m, l, r, crate::vocab::RegistrationPath::SoftStaging))
    }

    pub(crate) fn create_qp(
        &self,
        ctx: &SoftCtx,
        send_cq: &SoftCq,
        recv_cq: &SoftCq,
        caps: &QpCaps,
        sig_all: bool,
        events: Arc<dyn EventSink>,
    ) -> Result<(SoftQp, u32, QpCaps)> {
        let (cell, granted) = ctx.engine().create_qp(
            self.pdn,
            &send_cq.ring,
            &recv_cq.ring,
            caps,
            sig_all,
            events,
        )?;
        let qpn = cell.qpn;
        Ok((SoftQp { cell }, qpn, granted))
    }
}

/// A memory region.
pub(crate) struct SoftMr {
    key: u32,
}

impl SoftMr {
    /// Once this returns, the device touches the region's memory no more.
    pub(crate) fn deregister(&self, ctx: &SoftCtx) {
        ctx.engine().dereg_mr(self.key);
    }
}

/// A completion queue.
pub(crate) struct SoftCq {
    ring: Arc<CompletionRing>,
    engine: Arc<Engine>,
    /// Whether a poll that finds the queue empty does the device's receive work itself
    /// ([`crate::Cq::set_inline_progress`]).
    inline: AtomicBool,
}

impl SoftCq {
    #[inline]
    pub(crate) fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        self.engine
            .poll_cq(&self.ring, out, self.inline.load(Ordering::Relaxed))
    }

    pub(crate) fn destroy(&self, ctx: &SoftCtx) {
        ctx.engine().destroy_cq();
    }

    /// Whether polls that find the queue empty do the device's receive work (see
    /// [`crate::Cq::set_inline_progress`]). Turning it off hands the receive path back to the
    /// engine thread at once, as arming does (once: while it stays off, polls never take it).
    pub(crate) fn set_inline(&self, on: bool) {
        if self.inline.swap(on, Ordering::Relaxed) && !on {
            self.engine.flush_held();
            self.engine.app_sleeps(self.ring.lanes());
        }
    }

    pub(crate) fn inline(&self) -> bool {
        self.inline.load(Ordering::Relaxed)
    }

    pub(crate) fn arm(&self, solicited_only: bool) {
        self.engine.arm_cq(&self.ring, solicited_only);
    }

    /// The eventfd an armed queue signals.
    pub(crate) fn event_fd(&self) -> std::os::fd::RawFd {
        self.ring.event().as_raw_fd()
    }

    pub(crate) fn consume_events(&self) -> u32 {
        self.ring.event().consume() as u32
    }
}

/// A queue pair.
pub(crate) struct SoftQp {
    cell: Arc<QpCell>,
}

impl SoftQp {
    pub(crate) fn state(&self, ctx: &SoftCtx) -> QpState {
        ctx.engine().qp_state(&self.cell)
    }

    pub(crate) fn modify(&self, ctx: &SoftCtx, a: &QpAttr) -> Result<()> {
        if let Some(av) = a.av
            && !av.dgid.is_ipv4_mapped()
        {
            return Err(Error::invalid(format!(
                "the soft device reaches peers over IPv4: GID {} is not IPv4-mapped",
                av.dgid
            )));
        }
        if matches!(a.state, Some(QpState::Rtr | QpState::Rts | QpState::Sqd)) {
            // A queue pair that may receive or send needs the device's address: the first binds
            // it (a device opened by the SDK is bound already). Queue pairs made and destroyed
            // to probe a device's limits, as libfabric's are, take no address.
            ctx.dev.bind()?;
        }
        ctx.engine()
            .modify_qp(&self.cell, a)
            .map_err(|e| Error::Verb {
                verb: "ibv_modify_qp",
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()),
            })
    }

    /// Posts send requests, in order.
    ///
    /// # Safety
    /// An inline request's SGEs name bytes readable for the duration of the call (they are
    /// copied into the request; the lkey is not looked at). Other requests reach memory only
    /// through registered regions, by key, with the device checking bounds and rights.
    pub(crate) unsafe fn post_send(&self, ctx: &SoftCtx, reqs: &[SendReq<'_>]) -> PostResult {
        ctx.engine().post_send(
            &self.cell,
            reqs.iter().map(|r| {
                // SAFETY: the caller's contract covers every request's inline bytes.
                unsafe { send_wqe(r) }
            }),
        )
    }

    pub(crate) fn post_recv(&self, ctx: &SoftCtx, reqs: &[RecvReq<'_>]) -> PostResult {
        ctx.engine().post_recv(
            &self.cell,
            reqs.iter()
                .map(|r| sge_list(r.sges).map(|s| proto::RecvWqe::new(r.wr_id, s))),
        )
    }

    pub(crate) fn destroy(&self, ctx: &SoftCtx) {
        ctx.engine().destroy_qp(&self.cell);
    }
}

fn sge_list(sges: &[Sge]) -> Result<proto::SgeList> {
    proto::SgeList::from_slice(sges).map_err(|e| Error::Verb {
        verb: "post",
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()),
    })
}

/// The protocol's work request for a raw one: the SGEs as they are, or the inline bytes copied.
///
/// # Safety
/// For an inline request, each SGE's `[addr, addr+length)` is readable for the duration of the
/// call.
unsafe fn send_wqe(r: &SendReq<'_>) -> Result<proto::SendWqe> {
    let data = if r.flags.contains(SendFlags::INLINE) {
        let total: u64 = r.sges.iter().map(|s| u64::from(s.length)).sum();
        if total > proto::MAX_INLINE as u64 {
            return Err(Error::Verb {
                verb: "post_send",
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    proto::PostError::InlineTooLong {
                        requested: total as usize,
                        max: proto::MAX_INLINE,
                    }
                    .to_string(),
                ),
            });
        }
        let mut bytes = [0u8; proto::MAX_INLINE];
        let mut at = 0;
        for s in r.sges {
            let n = s.length as usize;
            if n == 0 {
                continue;
            }
            // The bytes are copied, never borrowed: on the safe path they may lie in a region a
            // peer writes, where a reference would claim they hold still. `at + n <= total <=
            // MAX_INLINE` keeps the destination in `bytes`.
            // SAFETY: `n` readable bytes at `s.addr` (the caller's contract), copied into a
            // distinct local buffer with room for them (above).
            unsafe {
                std::ptr::copy_nonoverlapping(s.addr as *const u8, bytes[at..].as_mut_ptr(), n);
            }
            at += n;
        }
        proto::SendData::Inline(
            proto::InlineData::new(&bytes[..at]).map_err(|e| Error::Verb {
                verb: "post_send",
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()),
            })?,
        )
    } else {
        proto::SendData::Sges(sge_list(r.sges)?)
    };
    Ok(proto::SendWqe {
        wr_id: r.wr_id,
        opcode: r.opcode,
        data,
        remote_addr: r.remote_addr,
        rkey: r.rkey,
        imm: r.imm,
        invalidate_rkey: r.invalidate_rkey,
        compare_add: r.compare_add,
        swap: r.swap,
        flags: r.flags,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn soft_cq(cq: &crate::Cq) -> &SoftCq {
        match &cq.inner.imp {
            crate::provider::CqImpl::Soft(q) => q,
            crate::provider::CqImpl::Verbs(_) => panic!("not a soft completion queue"),
        }
    }

    /// Whether an application thread's polls have the receive path.
    fn app_has_path(soft: &SoftCq) -> bool {
        let now = soft.engine.now().as_nanos();
        (0..soft.engine.lanes().len()).any(|lane| soft.engine.app_polling(lane, now).is_some())
    }

    /// Polls an empty queue until the poll takes the receive path (it does only when the engine
    /// is not in a round of its own: `try_lock`); whether it did within two seconds.
    fn poll_until_taken(soft: &SoftCq, out: &mut [Completion]) -> bool {
        for _ in 0..2000 {
            assert_eq!(soft.poll(out).unwrap(), 0);
            if app_has_path(soft) {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        false
    }

    /// A thread that polls keeps the engine off the receive path; arming its completion queue
    /// to sleep hands the path back at once (else datagrams wait for the engine's next look,
    /// up to `APP_POLL_GRACE_NS`), and the last poll before sleeping does not take it again.
    #[test]
    fn arming_a_completion_queue_hands_the_receive_path_back_to_the_engine() {
        let ctx = crate::Context::open("soft:127.0.97.1").unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let (soft, mut out) = (soft_cq(&cq), [Completion::default(); 4]);
        if !soft.engine.polls_receive() {
            // Several engines: the lanes keep the receive work, polls only read the queue.
            assert!(!poll_until_taken(soft, &mut out), "a poll took the path");
            return;
        }
        assert!(
            poll_until_taken(soft, &mut out),
            "a polling thread has the receive path"
        );
        soft.arm(false);
        assert!(!app_has_path(soft), "arming hands it back");
        assert_eq!(soft.poll(&mut out).unwrap(), 0);
        assert!(
            !app_has_path(soft),
            "the look before sleeping keeps it with the engine"
        );
        // Woken by a completion, the thread polls again and takes the path back.
        soft.ring.push(Completion::default());
        assert_eq!(soft.poll(&mut out).unwrap(), 1);
        assert!(
            poll_until_taken(soft, &mut out),
            "polling again takes it back"
        );
    }

    /// With inline progress off, polls leave the receive path to the engine, and turning it
    /// off hands the path back at once (`erdma/tests/datapath.rs` checks that data still
    /// arrives).
    #[test]
    fn without_inline_progress_polls_leave_receiving_to_the_engine() {
        let ctx = crate::Context::open("soft:127.0.97.2").unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let (soft, mut out) = (soft_cq(&cq), [Completion::default(); 4]);
        assert!(cq.inline_progress());
        if !soft.engine.polls_receive() {
            // Several engines: the lanes keep the receive work, polls only read the queue.
            assert!(!poll_until_taken(soft, &mut out), "a poll took the path");
            return;
        }
        assert!(
            poll_until_taken(soft, &mut out),
            "with it, a poll takes the path"
        );
        cq.set_inline_progress(false);
        assert!(!cq.inline_progress());
        assert!(!app_has_path(soft), "turning it off hands the path back");
        for _ in 0..200 {
            assert_eq!(soft.poll(&mut out).unwrap(), 0);
        }
        assert!(!app_has_path(soft), "polls without it leave the path alone");
        cq.set_inline_progress(true);
        assert!(
            poll_until_taken(soft, &mut out),
            "with it again, they take it"
        );
    }
}
