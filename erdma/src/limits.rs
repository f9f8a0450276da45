//! The eRDMA limit profile and the device's own attributes, and every check made against them.
//!
//! Each builder in the SDK validates its request here and gets a typed error naming the limit, the
//! requested value and the maximum — before the kernel (or the soft device) is called. A device is
//! held to the eRDMA profile when it *is* an eRDMA device (PCI vendor/part `0x1ded`/`0x107f`, or an
//! `erdma` driver) and when it is the soft device, which models eRDMA; other devices are held to
//! their own queried attributes.
//!
//! Sources for the eRDMA numbers: the kernel driver's `erdma_verbs.h` / `erdma_qp_validate_cap`
//! and the rdma-core provider (see the project's reference notes).

use std::fmt;

use crate::error::{Error, Result};
use crate::profile as erdma;
use crate::profile::{ERDMA_VENDOR_ID, SIW_MAX_INLINE_DATA, SIW_VENDOR_ID};
use crate::vocab::{Capability, Limit, QpCaps, WrOpcode};

/// Which rule set a device is held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProfileKind {
    /// The eRDMA profile on top of the device's own attributes.
    Erdma,
    /// The device's own attributes only.
    Device,
}

impl fmt::Display for ProfileKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProfileKind::Erdma => "eRDMA",
            ProfileKind::Device => "device attributes",
        })
    }
}

/// The limits in force on one device: what every builder is checked against.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// The rule set.
    pub profile: ProfileKind,
    /// Maximum send queue depth.
    pub max_send_wr: u32,
    /// Maximum receive queue depth.
    pub max_recv_wr: u32,
    /// Maximum SGEs per send work request.
    pub max_send_sge: u32,
    /// Maximum SGEs per receive work request.
    pub max_recv_sge: u32,
    /// Maximum SGEs of an RDMA READ.
    pub max_sge_rd: u32,
    /// Maximum inline bytes.
    pub max_inline_data: u32,
    /// Maximum completion queue depth.
    pub max_cqe: u32,
    /// Smallest depth a completion queue is rounded up to.
    pub min_cq_depth: u32,
    /// Whether CQ depths are rounded up to a power of two.
    pub cq_depth_pow2: bool,
    /// Maximum outstanding READ/atomics as initiator.
    pub max_rd_atomic: u32,
    /// Maximum outstanding READ/atomics as target.
    pub max_dest_rd_atomic: u32,
    /// Maximum memory region size in bytes.
    pub max_mr_size: u64,
    /// Maximum message size in bytes.
    pub max_msg_size: u64,
    /// Maximum queue pairs.
    pub max_qp: u32,
    /// Maximum completion queues.
    pub max_cq: u32,
    /// Maximum memory regions.
    pub max_mr: u32,
    /// Maximum protection domains.
    pub max_pd: u32,
    /// Whether 8-byte atomics (CAS/FAA) are available.
    pub atomics: bool,
    /// Whether shared receive queues are available.
    pub srq: bool,
    /// Whether memory windows are available.
    pub memory_windows: bool,
    /// Whether queue pairs may be created with a zero-depth queue.
    pub zero_depth_queues: bool,
    /// Whether SEND/WRITE WITH IMM are available ([`Capability::ImmediateData`]).
    pub immediate_data: bool,
    /// Whether a queue pair may be connected with `modify_qp` ([`Capability::ManualConnect`]):
    /// not on iWARP devices.
    pub manual_connect: bool,
    /// Whether the device reports a queue pair's state ([`Capability::QpStateQuery`]): not siw.
    pub qp_state_query: bool,
    /// Whether a request posted to a queue pair already in the error state completes (with a
    /// flush status). Not on siw: its user-space queues are flushed once, when the queue pair
    /// fails, and what is posted later stays there without a completion. Either way the SDK
    /// refuses a post to a queue pair it knows is in the error state ([`Error::QpInError`]).
    pub late_posts_flushed: bool,
    /// Whether registrations count against `RLIMIT_MEMLOCK` whatever the process's privileges
    /// (siw; other drivers let `CAP_IPC_LOCK` past it).
    pub memlock_bound: bool,
}

/// The raw numbers a device reports, as far as the limits are concerned.
#[derive(Debug, Clone, Default)]
pub(crate) struct RawCaps {
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_sge_rd: u32,
    pub max_cqe: u32,
    pub max_qp_rd_atom: u32,
    pub max_qp_init_rd_atom: u32,
    pub max_mr_size: u64,
    pub max_msg_size: u64,
    pub max_qp: u32,
    pub max_cq: u32,
    pub max_mr: u32,
    pub max_pd: u32,
    pub atomics: bool,
    pub max_srq: u32,
    pub max_mw: u32,
    /// Inline capacity, where the device says (verbs does not report it; 0 = unknown).
    pub max_inline: u32,
    /// The device's vendor id (`vendor_id`): picks what verbs does not report.
    pub vendor_id: u32,
    /// Whether the device speaks iWARP (its transport is `IBV_TRANSPORT_IWARP`).
    pub iwarp: bool,
}

impl RawCaps {
    /// The inline capacity: as reported, else what is known of the device (siw), else 0.
    fn inline(&self) -> u32 {
        match (self.max_inline, self.vendor_id) {
            (0, SIW_VENDOR_ID) => SIW_MAX_INLINE_DATA,
            (n, _) => n,
        }
    }

    /// Immediate data: on every InfiniBand/RoCE device; on iWARP only where the device adds it
    /// to both opcodes (eRDMA). RFC 5040's iWARP has none: siw refuses both opcodes; Chelsio's
    /// cxgb4 carries WRITE WITH IMM only with firmware that supports it and Intel's irdma in
    /// iWARP mode only WRITE WITH IMM, neither SEND WITH IMM. Verbs reports none of this, so
    /// another iWARP device counts as having none.
    fn immediate_data(&self) -> bool {
        !self.iwarp || self.vendor_id == ERDMA_VENDOR_ID
    }
}

fn positive_min(a: u32, b: u32) -> u32 {
    match (a, b) {
        (0, b) => b,
        (a, 0) => a,
        (a, b) => a.min(b),
    }
}

impl Limits {
    /// The eRDMA profile applied on top of a device's own attributes: the smaller of the two wins.
    pub(crate) fn erdma(raw: &RawCaps) -> Limits {
        Limits {
            profile: ProfileKind::Erdma,
            max_send_wr: positive_min(raw.max_qp_wr, erdma::MAX_SEND_WR),
            max_recv_wr: raw.max_qp_wr.max(1),
            max_send_sge: positive_min(raw.max_sge, erdma::MAX_SEND_SGE),
            max_recv_sge: erdma::MAX_RECV_SGE,
            max_sge_rd: erdma::MAX_SGE_RD,
            max_inline_data: positive_min(raw.inline(), erdma::MAX_INLINE_DATA),
            max_cqe: raw.max_cqe.max(erdma::MIN_CQ_DEPTH),
            min_cq_depth: erdma::MIN_CQ_DEPTH,
            cq_depth_pow2: true,
            max_rd_atomic: positive_min(raw.max_qp_init_rd_atom, erdma::MAX_RD_ATOMIC),
            max_dest_rd_atomic: positive_min(raw.max_qp_rd_atom, erdma::MAX_RD_ATOMIC),
            max_mr_size: match raw.max_mr_size {
                0 => erdma::MAX_MR_SIZE,
                n => n,
            },
            max_msg_size: match raw.max_msg_size {
                0 => u32::MAX as u64,
                n => n,
            },
            max_qp: raw.max_qp,
            max_cq: raw.max_cq,
            max_mr: raw.max_mr,
            max_pd: positive_min(raw.max_pd, erdma::MAX_PD),
            atomics: raw.atomics,
            srq: false,
            memory_windows: false,
            zero_depth_queues: false,
            immediate_data: raw.immediate_data(),
            manual_connect: !raw.iwarp,
            qp_state_query: raw.vendor_id != SIW_VENDOR_ID,
            late_posts_flushed: raw.vendor_id != SIW_VENDOR_ID,
            memlock_bound: raw.vendor_id == SIW_VENDOR_ID,
        }
    }

    /// A device held to its own attributes.
    pub(crate) fn device(raw: &RawCaps) -> Limits {
        Limits {
            profile: ProfileKind::Device,
            max_send_wr: raw.max_qp_wr.max(1),
            max_recv_wr: raw.max_qp_wr.max(1),
            max_send_sge: raw.max_sge.max(1),
            max_recv_sge: raw.max_sge.max(1),
            max_sge_rd: raw.max_sge_rd.max(1),
            // Verbs does not report the inline capacity; the kernel rejects a QP whose request
            // is too large, and the QP reports what it granted.
            max_inline_data: match raw.inline() {
                0 => u32::MAX,
                n => n,
            },
            max_cqe: raw.max_cqe.max(1),
            min_cq_depth: 1,
            cq_depth_pow2: false,
            max_rd_atomic: raw.max_qp_init_rd_atom,
            max_dest_rd_atomic: raw.max_qp_rd_atom,
            max_mr_size: if raw.max_mr_size == 0 {
                u64::MAX
            } else {
                raw.max_mr_size
            },
            max_msg_size: if raw.max_msg_size == 0 {
                u32::MAX as u64
            } else {
                raw.max_msg_size
            },
            max_qp: raw.max_qp,
            max_cq: raw.max_cq,
            max_mr: raw.max_mr,
            max_pd: raw.max_pd,
            atomics: raw.atomics,
            srq: raw.max_srq > 0,
            memory_windows: raw.max_mw > 0,
            zero_depth_queues: true,
            immediate_data: raw.immediate_data(),
            manual_connect: !raw.iwarp,
            qp_state_query: raw.vendor_id != SIW_VENDOR_ID,
            late_posts_flushed: raw.vendor_id != SIW_VENDOR_ID,
            memlock_bound: raw.vendor_id == SIW_VENDOR_ID,
        }
    }

    /// Checks the capacities asked of a new queue pair.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] or [`Error::LimitBelowMinimum`] naming the first capacity out of
    /// range.
    pub fn check_qp_caps(&self, caps: &QpCaps) -> Result<()> {
        let min_wr = if self.zero_depth_queues { 0 } else { 1 };
        check_range(Limit::MaxSendWr, caps.max_send_wr, min_wr, self.max_send_wr)?;
        check_range(Limit::MaxRecvWr, caps.max_recv_wr, min_wr, self.max_recv_wr)?;
        check_max(Limit::MaxSendSge, caps.max_send_sge, self.max_send_sge)?;
        check_max(Limit::MaxRecvSge, caps.max_recv_sge, self.max_recv_sge)?;
        check_max(
            Limit::MaxInlineData,
            caps.max_inline_data,
            self.max_inline_data,
        )?;
        Ok(())
    }

    /// The depth a completion queue asked to hold `requested` entries really gets.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] above `max_cqe`, [`Error::LimitBelowMinimum`] for zero.
    pub fn cq_depth(&self, requested: u32) -> Result<u32> {
        check_range(Limit::MaxCqe, requested, 1, self.max_cqe)?;
        let mut depth = requested.max(self.min_cq_depth);
        if self.cq_depth_pow2 {
            depth = depth.next_power_of_two();
        }
        Ok(depth)
    }

    /// Checks the length of a new memory region.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] above `max_mr_size`, [`Error::LimitBelowMinimum`] for zero.
    pub fn check_mr_len(&self, len: u64) -> Result<()> {
        if len == 0 {
            return Err(Error::LimitBelowMinimum {
                limit: Limit::MaxMrSize,
                requested: 0,
                min: 1,
            });
        }
        check_max64(Limit::MaxMrSize, len, self.max_mr_size)?;
        if self.memlock_bound {
            // One region larger than the whole allowance can never be registered; regions that
            // fit it one by one may still exceed it together (the kernel says ENOMEM then).
            check_max64(Limit::LockedMemory, len, memlock_limit())?;
        }
        Ok(())
    }

    /// Whether the device has `capability`.
    pub fn has(&self, capability: Capability) -> bool {
        match capability {
            Capability::ImmediateData => self.immediate_data,
            Capability::Atomics => self.atomics,
            Capability::ManualConnect => self.manual_connect,
            Capability::QpStateQuery => self.qp_state_query,
        }
    }

    /// Checks that `device` (whose limits these are) has `capability`.
    ///
    /// # Errors
    /// [`Error::MissingCapability`] naming it and the device.
    pub fn require(&self, capability: Capability, device: &str) -> Result<()> {
        if self.has(capability) {
            Ok(())
        } else {
            Err(Error::MissingCapability {
                capability,
                device: device.to_string(),
            })
        }
    }

    /// Checks that `device` can carry a send request of this opcode: immediate data and atomics
    /// are refused here where it lacks them, instead of by the provider's `EINVAL`.
    ///
    /// # Errors
    /// [`Error::MissingCapability`].
    pub fn check_opcode(&self, opcode: WrOpcode, device: &str) -> Result<()> {
        match opcode {
            WrOpcode::RdmaWriteWithImm | WrOpcode::SendWithImm => {
                self.require(Capability::ImmediateData, device)
            }
            WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => {
                self.require(Capability::Atomics, device)
            }
            _ => Ok(()),
        }
    }

    /// Checks initiator and target depths for READ/atomics.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] naming `max_rd_atomic` or `max_dest_rd_atomic`.
    pub fn check_rd_atomic(&self, ord: Option<u8>, ird: Option<u8>) -> Result<()> {
        if let Some(ord) = ord {
            check_max(Limit::MaxRdAtomic, ord as u32, self.max_rd_atomic.max(1))?;
        }
        if let Some(ird) = ird {
            check_max(
                Limit::MaxDestRdAtomic,
                ird as u32,
                self.max_dest_rd_atomic.max(1),
            )?;
        }
        Ok(())
    }
}

/// The process's `RLIMIT_MEMLOCK` in bytes (`u64::MAX` when unlimited or unknown).
#[allow(unsafe_code)] // getrlimit
fn memlock_limit() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid out-parameter for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0
        || r.rlim_cur == libc::RLIM_INFINITY
    {
        return u64::MAX;
    }
    r.rlim_cur
}

pub(crate) fn check_max(limit: Limit, requested: u32, max: u32) -> Result<()> {
    check_max64(limit, requested as u64, max as u64)
}

pub(crate) fn check_max64(limit: Limit, requested: u64, max: u64) -> Result<()> {
    if requested > max {
        Err(Error::LimitExceeded {
            limit,
            requested,
            max,
        })
    } else {
        Ok(())
    }
}

pub(crate) fn check_range(limit: Limit, requested: u32, min: u32, max: u32) -> Result<()> {
    if requested < min {
        return Err(Error::LimitBelowMinimum {
            limit,
            requested: requested as u64,
            min: min as u64,
        });
    }
    check_max(limit, requested, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn erdma_like() -> Limits {
        Limits::erdma(&RawCaps {
            max_qp_wr: 8192,
            max_sge: 6,
            max_sge_rd: 1,
            max_cqe: 1 << 20,
            max_qp_rd_atom: 128,
            max_qp_init_rd_atom: 128,
            max_mr_size: 64 << 30,
            max_msg_size: u32::MAX as u64,
            max_qp: 1023,
            max_cq: 2045,
            max_mr: 2046,
            max_pd: 131072,
            atomics: true,
            max_srq: 0,
            max_mw: 0,
            max_inline: 0,
            vendor_id: ERDMA_VENDOR_ID,
            iwarp: false,
        })
    }

    #[test]
    fn erdma_profile_caps_a_generous_device() {
        let generous = RawCaps {
            max_qp_wr: 32768,
            max_sge: 30,
            max_sge_rd: 30,
            max_cqe: 4 << 20,
            max_qp_rd_atom: 255,
            max_qp_init_rd_atom: 255,
            max_inline: 512,
            ..RawCaps::default()
        };
        let l = Limits::erdma(&generous);
        assert_eq!(l.max_send_wr, 8192);
        assert_eq!(l.max_send_sge, 6);
        assert_eq!(l.max_recv_sge, 1);
        assert_eq!(l.max_sge_rd, 1);
        assert_eq!(l.max_inline_data, 96);
        assert_eq!(l.max_rd_atomic, 128);
        assert_eq!(l.max_dest_rd_atomic, 128);
        assert!(!l.srq && !l.memory_windows && !l.zero_depth_queues);
    }

    #[test]
    fn qp_caps_errors_name_limit_requested_and_max() {
        let l = erdma_like();
        let ok = QpCaps {
            max_send_wr: 8192,
            max_recv_wr: 16,
            max_send_sge: 6,
            max_recv_sge: 1,
            max_inline_data: 96,
        };
        l.check_qp_caps(&ok).unwrap();
        let cases = [
            (
                QpCaps {
                    max_send_sge: 7,
                    ..ok
                },
                Limit::MaxSendSge,
                7,
                6,
            ),
            (
                QpCaps {
                    max_recv_sge: 2,
                    ..ok
                },
                Limit::MaxRecvSge,
                2,
                1,
            ),
            (
                QpCaps {
                    max_inline_data: 97,
                    ..ok
                },
                Limit::MaxInlineData,
                97,
                96,
            ),
            (
                QpCaps {
                    max_send_wr: 8193,
                    ..ok
                },
                Limit::MaxSendWr,
                8193,
                8192,
            ),
        ];
        for (caps, limit, req, max) in cases {
            match l.check_qp_caps(&caps) {
                Err(Error::LimitExceeded {
                    limit: got,
                    requested,
                    max: m,
                }) => {
                    assert_eq!((got, requested, m), (limit, req, max));
                    let text = l.check_qp_caps(&caps).unwrap_err().to_string();
                    assert!(text.contains(&limit.to_string()) && text.contains(&max.to_string()));
                }
                other => panic!("{limit}: expected LimitExceeded, got {other:?}"),
            }
        }
        // eRDMA rejects zero-depth queues.
        let zero = QpCaps {
            max_recv_wr: 0,
            ..ok
        };
        assert!(matches!(
            l.check_qp_caps(&zero),
            Err(Error::LimitBelowMinimum {
                limit: Limit::MaxRecvWr,
                requested: 0,
                min: 1
            })
        ));
    }

    #[test]
    fn cq_depth_follows_erdma_rounding() {
        let l = erdma_like();
        assert_eq!(l.cq_depth(1).unwrap(), 64);
        assert_eq!(l.cq_depth(64).unwrap(), 64);
        assert_eq!(l.cq_depth(65).unwrap(), 128);
        assert_eq!(l.cq_depth(1000).unwrap(), 1024);
        assert!(matches!(
            l.cq_depth(0),
            Err(Error::LimitBelowMinimum {
                limit: Limit::MaxCqe,
                ..
            })
        ));
        assert!(matches!(
            l.cq_depth((1 << 20) + 1),
            Err(Error::LimitExceeded {
                limit: Limit::MaxCqe,
                ..
            })
        ));
    }

    #[test]
    fn mr_length_is_checked() {
        let l = erdma_like();
        l.check_mr_len(1).unwrap();
        l.check_mr_len(64 << 30).unwrap();
        assert!(matches!(
            l.check_mr_len(0),
            Err(Error::LimitBelowMinimum {
                limit: Limit::MaxMrSize,
                ..
            })
        ));
        assert!(matches!(
            l.check_mr_len((64 << 30) + 1),
            Err(Error::LimitExceeded {
                limit: Limit::MaxMrSize,
                requested,
                max
            }) if requested == (64 << 30) + 1 && max == 64 << 30
        ));
    }

    /// What siw reports (`ibv_devinfo -v` on the guest's siw0).
    fn siw_like() -> RawCaps {
        RawCaps {
            max_qp_wr: 32768,
            max_sge: 6,
            max_sge_rd: 1,
            max_cqe: 3_276_800,
            max_qp_rd_atom: 128,
            max_qp_init_rd_atom: 128,
            max_mr_size: u64::MAX,
            max_msg_size: u32::MAX as u64,
            max_qp: 102_400,
            max_cq: 102_400,
            max_mr: 1_024_000,
            max_pd: 102_400,
            atomics: false,
            max_srq: 102_400,
            max_mw: 0,
            max_inline: 0,
            vendor_id: SIW_VENDOR_ID,
            iwarp: true,
        }
    }

    #[test]
    fn siw_lacks_immediate_data_atomics_and_manual_connect() {
        for l in [Limits::device(&siw_like()), Limits::erdma(&siw_like())] {
            assert!(
                !l.immediate_data && !l.atomics && !l.manual_connect,
                "{l:?}"
            );
            assert_eq!(l.max_inline_data, SIW_MAX_INLINE_DATA);
            for (op, cap) in [
                (WrOpcode::RdmaWriteWithImm, Capability::ImmediateData),
                (WrOpcode::SendWithImm, Capability::ImmediateData),
                (WrOpcode::AtomicCmpAndSwp, Capability::Atomics),
                (WrOpcode::AtomicFetchAndAdd, Capability::Atomics),
            ] {
                let e = l.check_opcode(op, "siw0").unwrap_err();
                match &e {
                    Error::MissingCapability { capability, device } => {
                        assert_eq!((*capability, device.as_str()), (cap, "siw0"))
                    }
                    other => panic!("{op:?}: expected MissingCapability, got {other:?}"),
                }
                assert!(e.to_string().starts_with("device siw0 lacks"), "{e}");
            }
            for op in [
                WrOpcode::RdmaWrite,
                WrOpcode::RdmaRead,
                WrOpcode::Send,
                WrOpcode::SendWithInv,
            ] {
                l.check_opcode(op, "siw0").unwrap();
            }
            let e = l
                .require(Capability::ManualConnect, "siw0")
                .unwrap_err()
                .to_string();
            assert!(e.contains("rdma_cm") && e.contains("iWARP"), "{e}");
        }
    }

    #[test]
    fn iwarp_erdma_keeps_immediate_data_and_roce_keeps_everything() {
        let erdma_iwarp = RawCaps {
            vendor_id: ERDMA_VENDOR_ID,
            atomics: true,
            ..siw_like()
        };
        let l = Limits::erdma(&erdma_iwarp);
        assert!(l.immediate_data && l.atomics && !l.manual_connect && l.qp_state_query);
        // An unknown iWARP device: RFC 5040 has no immediate data.
        let other = RawCaps {
            vendor_id: 0x1425,
            ..siw_like()
        };
        assert!(!Limits::device(&other).immediate_data);
        // Inline capacity of devices other than siw stays unknown to verbs.
        assert_eq!(Limits::device(&other).max_inline_data, u32::MAX);
        let roce = Limits::erdma(&RawCaps {
            iwarp: false,
            vendor_id: 0,
            atomics: true,
            ..siw_like()
        });
        assert!(roce.immediate_data && roce.atomics && roce.manual_connect);
        for c in [
            Capability::ImmediateData,
            Capability::Atomics,
            Capability::ManualConnect,
            Capability::QpStateQuery,
        ] {
            roce.require(c, "rxe0").unwrap();
        }
    }

    #[test]
    fn rd_atomic_depths_are_checked() {
        let l = erdma_like();
        l.check_rd_atomic(Some(128), Some(128)).unwrap();
        assert!(matches!(
            l.check_rd_atomic(Some(129), None),
            Err(Error::LimitExceeded {
                limit: Limit::MaxRdAtomic,
                requested: 129,
                max: 128
            })
        ));
        assert!(matches!(
            l.check_rd_atomic(None, Some(200)),
            Err(Error::LimitExceeded {
                limit: Limit::MaxDestRdAtomic,
                ..
            })
        ));
    }
}
