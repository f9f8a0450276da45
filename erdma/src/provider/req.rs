//! The provider line's raw requests: what the SDK's handles (and any other caller of the
//! provider line) hand a provider to post.

use crate::vocab::{SendFlags, Sge, WrOpcode};

/// A send request as a provider executes it: `ibv_send_wr` without the list link.
///
/// Raw: the SGEs are addresses, lengths and keys, nothing more. What the device does with them
/// is checked by the device (every key, bound and right); what it cannot check is the caller's
/// contract, stated where requests are posted (`QpImpl::post_send`): an inline request's
/// SGEs must name bytes readable during the post, and memory the device reads or writes for a
/// request must not be written (sources) or touched (targets) by the CPU until the request
/// completes.
#[derive(Debug, Clone, Copy)]
pub struct SendReq<'i> {
    /// The caller's id for the request.
    pub wr_id: u64,
    /// What to do.
    pub opcode: WrOpcode,
    /// Signaled, inline, fenced, solicited.
    pub flags: SendFlags,
    /// The local bytes.
    pub sges: &'i [Sge],
    /// The remote address (WRITE, READ, atomics).
    pub remote_addr: u64,
    /// The remote key (WRITE, READ, atomics).
    pub rkey: u32,
    /// Immediate data in host order (providers convert to the wire/verbs byte order).
    pub imm: u32,
    /// The key a SEND with invalidate names.
    pub invalidate_rkey: u32,
    /// Compare (CAS) or add (FAA) operand.
    pub compare_add: u64,
    /// Swap operand (CAS).
    pub swap: u64,
}

impl SendReq<'_> {
    /// The request's local bytes.
    pub(crate) fn total_len(&self) -> u64 {
        self.sges.iter().map(|s| u64::from(s.length)).sum()
    }
}

/// A receive request as a provider executes it.
#[derive(Debug, Clone, Copy)]
pub struct RecvReq<'i> {
    /// The caller's id for the request.
    pub wr_id: u64,
    /// Where the message goes.
    pub sges: &'i [Sge],
}

/// Requests converted for posting: a single one (the latency loops' case) stays on the stack,
/// several go to a vector. Dereferences to the converted slice.
pub(crate) enum Batch<T> {
    One([T; 1]),
    Many(Vec<T>),
}

impl<T> Batch<T> {
    /// `convert` applied to every element of `src`, in order.
    pub(crate) fn of<S>(src: &[S], mut convert: impl FnMut(&S) -> T) -> Batch<T> {
        match src {
            [one] => Batch::One([convert(one)]),
            _ => Batch::Many(src.iter().map(convert).collect()),
        }
    }
}

impl<T> std::ops::Deref for Batch<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Batch::One(a) => a,
            Batch::Many(v) => v,
        }
    }
}

impl<T> std::ops::DerefMut for Batch<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            Batch::One(a) => a,
            Batch::Many(v) => v,
        }
    }
}
