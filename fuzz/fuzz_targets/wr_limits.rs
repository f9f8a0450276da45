//! Work-request and limit validation: arbitrary work requests posted to a soft queue pair in
//! every state, arbitrary state transitions with arbitrary attributes, and the SDK's limit checks
//! with arbitrary values. Never a panic; a refused post leaves the queue as it was; an accepted
//! one is within every limit; limit checks accept exactly the values in range.

#![no_main]

use std::net::{IpAddr, Ipv4Addr};
use std::sync::OnceLock;

use erdma::soft::proto::{
    InlineData, MAX_INLINE, MAX_MESSAGE, MAX_SGE, Qp, QpParams, RecvWqe, SendData, SendWqe,
    SgeList,
};
use erdma::{Access, Mtu, QpAttr, QpState, Sge, WcStatus, WrOpcode};
use erdma::soft::wire::Psn;
use erdma::{Context, Limits, QpCaps};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

/// The soft device's limit profile (opened once; `None` when its address is taken, in which
/// case only the queue-pair half of the target runs).
fn limits() -> Option<&'static Limits> {
    static L: OnceLock<Option<Limits>> = OnceLock::new();
    L.get_or_init(|| match Context::open("soft:127.0.0.251") {
        Ok(ctx) => Some(ctx.limits().clone()),
        Err(e) => {
            eprintln!("wr_limits: no soft device for the limit checks: {e}");
            None
        }
    })
    .as_ref()
}

fn sges(u: &mut Unstructured<'_>) -> Result<SgeList> {
    let n = u.int_in_range(0..=MAX_SGE + 2)?;
    let mut l = SgeList::from_slice(&[]).unwrap();
    for _ in 0..n {
        let s = Sge::new(u.arbitrary()?, u.arbitrary()?, u.arbitrary()?);
        if l.push(s).is_err() {
            assert_eq!(l.len(), MAX_SGE, "a list refuses entries only when full");
        }
    }
    Ok(l)
}

fn wqe(u: &mut Unstructured<'_>) -> Result<SendWqe> {
    let data = if u.ratio(1, 4)? {
        let len = u.int_in_range(0..=MAX_INLINE + 8)?;
        match InlineData::new(u.bytes(len.min(u.len()))?) {
            Ok(d) => SendData::Inline(d),
            Err(_) => {
                assert!(len > MAX_INLINE);
                SendData::Sges(sges(u)?)
            }
        }
    } else {
        SendData::Sges(sges(u)?)
    };
    let w = match u.int_in_range(0..=5)? {
        0 => SendWqe::send(u.arbitrary()?, data),
        1 => SendWqe::write(u.arbitrary()?, data, u.arbitrary()?, u.arbitrary()?),
        2 => match data {
            SendData::Sges(l) => SendWqe::read(u.arbitrary()?, l, u.arbitrary()?, u.arbitrary()?),
            SendData::Inline(_) => SendWqe::send(0, data).with_opcode(WrOpcode::RdmaRead),
        },
        3 => SendWqe::fetch_add(
            u.arbitrary()?,
            Sge::new(u.arbitrary()?, u.arbitrary()?, u.arbitrary()?),
            u.arbitrary()?,
            u.arbitrary()?,
            u.arbitrary()?,
        ),
        4 => SendWqe::send(u.arbitrary()?, data).with_imm(u.arbitrary()?),
        _ => SendWqe::send(u.arbitrary()?, data).with_invalidate(u.arbitrary()?),
    };
    Ok(w)
}

fn attr(u: &mut Unstructured<'_>) -> Result<QpAttr> {
    let states = [
        QpState::Reset,
        QpState::Init,
        QpState::Rtr,
        QpState::Rts,
        QpState::Sqd,
        QpState::Sqe,
        QpState::Err,
    ];
    let mtus = [Mtu::Mtu256, Mtu::Mtu1024, Mtu::Mtu4096];
    let mut a = match u.int_in_range(0..=3)? {
        0 => QpAttr::init(Access::from_bits_truncate(u.arbitrary()?)),
        1 => QpAttr::rtr(
            IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)),
            u.arbitrary()?,
            Psn::new(u.arbitrary()?),
            *u.choose(&mtus)?,
            u.arbitrary()?,
            u.arbitrary()?,
        ),
        2 => QpAttr::rts(
            Psn::new(u.arbitrary()?),
            u.arbitrary()?,
            u.arbitrary()?,
            u.arbitrary()?,
            u.arbitrary()?,
        ),
        _ => QpAttr::to_state(*u.choose(&states)?),
    };
    if u.ratio(1, 4)? {
        a.cur_state = Some(*u.choose(&states)?);
    }
    if u.ratio(1, 8)? {
        a.pkey_index = Some(u.arbitrary()?);
    }
    if u.ratio(1, 8)? {
        a.port = Some(u.arbitrary()?);
    }
    Ok(a)
}

fn check_limits(l: &Limits, u: &mut Unstructured<'_>) -> Result<()> {
    let caps = QpCaps {
        max_send_wr: u.arbitrary()?,
        max_recv_wr: u.arbitrary()?,
        max_send_sge: u.arbitrary()?,
        max_recv_sge: u.arbitrary()?,
        max_inline_data: u.arbitrary()?,
    };
    let ok = caps.max_send_wr <= l.max_send_wr
        && caps.max_recv_wr <= l.max_recv_wr
        && caps.max_send_sge <= l.max_send_sge
        && caps.max_recv_sge <= l.max_recv_sge
        && caps.max_inline_data <= l.max_inline_data
        && (l.zero_depth_queues || (caps.max_send_wr > 0 && caps.max_recv_wr > 0));
    assert_eq!(l.check_qp_caps(&caps).is_ok(), ok, "{caps:?}");
    let cqe: u32 = u.arbitrary()?;
    match l.cq_depth(cqe) {
        Ok(d) => assert!(cqe >= 1 && cqe <= l.max_cqe && d >= cqe),
        Err(_) => assert!(cqe == 0 || cqe > l.max_cqe),
    }
    let len: u64 = u.arbitrary()?;
    assert_eq!(
        l.check_mr_len(len).is_ok(),
        len >= 1 && len <= l.max_mr_size
    );
    let _ = l.check_rd_atomic(u.arbitrary()?, u.arbitrary()?);
    Ok(())
}

/// An accepted request is queued, or (in SQE/ERR) completed at once with a flush.
fn flushed_or_queued(qp: &mut Qp, len: usize, before: usize) {
    if matches!(qp.state(), QpState::Sqe | QpState::Err) && len == before {
        let c = qp
            .poll_completion()
            .expect("a request accepted in error completes at once");
        assert_eq!(c.status, WcStatus::WrFlushErr);
    } else {
        assert_eq!(len, before + 1, "an accepted request is queued");
    }
}

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    if let Some(l) = limits() {
        check_limits(l, u)?;
    }

    let mut cfg = QpParams::new(1, IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1)));
    cfg.caps.max_send_wr = u.int_in_range(0..=8)?;
    cfg.caps.max_recv_wr = u.int_in_range(0..=8)?;
    let mut qp = Qp::new(0x11, cfg);
    for _ in 0..64 {
        if u.is_empty() {
            break;
        }
        match u.int_in_range(0..=2)? {
            0 => {
                let before = qp.state();
                if qp.modify(&attr(u)?).is_err() {
                    assert_eq!(qp.state(), before, "a refused modify changes nothing");
                }
            }
            1 => {
                let w = wqe(u)?;
                let shape = w.validate(MAX_SGE, MAX_INLINE);
                let before = qp.send_queue_len();
                match qp.post_send(w) {
                    Ok(()) => {
                        let len = shape.expect("an accepted request has a valid shape");
                        assert!(u64::from(len) <= MAX_MESSAGE);
                        let len = qp.send_queue_len();
                        flushed_or_queued(&mut qp, len, before);
                    }
                    Err(_) => assert_eq!(qp.send_queue_len(), before),
                }
            }
            _ => {
                let before = qp.recv_queue_len();
                match qp.post_recv(RecvWqe::new(u.arbitrary()?, sges(u)?)) {
                    Ok(()) => {
                        let len = qp.recv_queue_len();
                        flushed_or_queued(&mut qp, len, before);
                    }
                    Err(_) => assert_eq!(qp.recv_queue_len(), before),
                }
            }
        }
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
