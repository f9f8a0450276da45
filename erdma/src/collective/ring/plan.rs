//! The geometry of one call and its schedule: segments and chunks per rank and step
//! ([`Plan`]), which queue pair carries a chunk, which ready chunks go out now, and how a chunk
//! names itself in the immediate.

use std::collections::VecDeque;

use super::{EPOCH, MAX_CHUNKS, RingConfig};
use crate::collective::dtype::DType;
use crate::error::{Error, Result};

/// The geometry of one call: segments per rank and chunks per step.
pub(super) struct Plan {
    pub(super) elem: usize,
    pub(super) chunk_elems: usize,
    pub(super) seg_off: Vec<usize>,
    pub(super) seg_len: Vec<usize>,
    pub(super) steps: usize,
}

impl Plan {
    pub(super) fn new(count: usize, dtype: DType, world: usize, cfg: &RingConfig) -> Result<Plan> {
        let elem = dtype.size();
        let (base, rem) = (count / world, count % world);
        let seg_len: Vec<usize> = (0..world).map(|i| base + usize::from(i < rem)).collect();
        let seg_off: Vec<usize> = seg_len
            .iter()
            .scan(0, |acc, l| {
                let o = *acc;
                *acc += l;
                Some(o)
            })
            .collect();
        let max_seg = base + usize::from(rem > 0);
        // Spread a segment over the queue pairs, chunks between the floor and the slot size.
        let cap = (cfg.chunk_bytes / elem).max(1);
        let floor = (cfg.min_chunk_bytes / elem).clamp(1, cap);
        let chunk_elems = max_seg.div_ceil(cfg.qps_per_connection).clamp(floor, cap);
        if max_seg.div_ceil(chunk_elems) > MAX_CHUNKS {
            return Err(Error::invalid(format!(
                "{count} elements over {world} ranks need more than {MAX_CHUNKS} chunks of {} \
                 bytes per step; use larger chunks",
                chunk_elems * elem
            )));
        }
        Ok(Plan {
            elem,
            chunk_elems,
            seg_off,
            seg_len,
            steps: 2 * (world - 1),
        })
    }

    /// The segment a rank sends at `step`.
    pub(super) fn send_seg(&self, rank: usize, step: usize) -> usize {
        let n = self.seg_len.len();
        if step < n - 1 {
            (rank + n - step) % n
        } else {
            (rank + 1 + n - (step - (n - 1))) % n
        }
    }

    /// The segment a rank receives at `step`.
    pub(super) fn recv_seg(&self, rank: usize, step: usize) -> usize {
        let n = self.seg_len.len();
        (self.send_seg(rank, step) + n - 1) % n
    }

    /// Chunks of a segment: an empty segment (fewer elements than ranks) still travels as one
    /// empty chunk, so that every link carries every step of every call. That keeps each rank
    /// within one call of its neighbours (a sender cannot finish a call before its successor
    /// has consumed its chunks), which the call parity in the immediate relies on.
    pub(super) fn chunks(&self, seg: usize) -> usize {
        self.seg_len[seg].div_ceil(self.chunk_elems).max(1)
    }

    /// Byte offset and length of chunk `c` of segment `seg`.
    pub(super) fn chunk(&self, seg: usize, c: usize) -> (usize, usize) {
        let start = c * self.chunk_elems;
        let len = self.chunk_elems.min(self.seg_len[seg] - start);
        ((self.seg_off[seg] + start) * self.elem, len * self.elem)
    }

    pub(super) fn is_reduce(&self, step: usize) -> bool {
        step < self.seg_len.len() - 1
    }
}

/// The queue pair that carries chunk `c` of `step` on a link of `k`, in a call that starts at
/// queue pair `first`: chunks go round robin, starting one queue pair further at each step, so
/// that calls with fewer chunks per step than queue pairs spread their steps over several of
/// them.
pub(super) fn qp_of(first: usize, step: usize, c: usize, k: usize) -> usize {
    (first + c + step) % k
}

/// The queue pair call number `call` starts at ([`qp_of`]): where the previous call's steps
/// ended, so that a run of small calls spreads over every queue pair, not only the first few.
/// Both ends of a link count the calls alike.
pub(super) fn first_qp(call: u64, steps: usize, k: usize) -> usize {
    ((call % k as u64) as usize * steps) % k
}

/// How many of its ready chunks (`(step, chunk)`, in order) each queue pair posts now, into
/// `take`: at most its credits, and at most `budget` in all, the oldest chunks (by step, then
/// chunk) first.
pub(super) fn schedule(
    ready: &[VecDeque<(usize, usize)>],
    credits: impl Fn(usize) -> usize,
    mut budget: usize,
    take: &mut [usize],
) {
    let mut room_all = 0;
    for (q, queue) in ready.iter().enumerate() {
        take[q] = credits(q).min(queue.len());
        room_all += take[q];
    }
    if room_all <= budget {
        return;
    }
    take.fill(0);
    while budget > 0 {
        let next = (0..ready.len())
            .filter(|&q| take[q] < credits(q).min(ready[q].len()))
            .min_by_key(|&q| ready[q][take[q]]);
        let Some(q) = next else { break };
        take[q] += 1;
        budget -= 1;
    }
}

/// A chunk's identity in the channel's 23 user bits: call parity, step (6 bits), chunk (16).
pub(super) fn chunk_id(epoch: bool, step: usize, chunk: usize) -> u32 {
    (if epoch { EPOCH } else { 0 }) | ((step as u32) << 16) | chunk as u32
}

pub(super) fn parse_chunk_id(user: u32) -> (bool, usize, usize) {
    (
        user & EPOCH != 0,
        ((user >> 16) & 0x3f) as usize,
        (user & 0xffff) as usize,
    )
}

/// Names the neighbour in a channel's protocol errors.
pub(super) fn blame(rank: usize, peer: usize) -> impl Fn(Error) -> Error {
    move |e| match e {
        Error::Protocol { what } => Error::protocol(format!("rank {rank}: rank {peer}: {what}")),
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queues(v: &[&[(usize, usize)]]) -> Vec<VecDeque<(usize, usize)>> {
        v.iter().map(|q| q.iter().copied().collect()).collect()
    }

    #[test]
    fn schedule_keeps_credits_window_and_age() {
        let ready = queues(&[&[(0, 0), (1, 3)], &[(0, 1)], &[(0, 2), (1, 5), (2, 8)]]);
        let credits = [2, 0, 3];
        let mut take = [9; 3];
        // Room for everything the credits allow.
        schedule(&ready, |q| credits[q], 5, &mut take);
        assert_eq!(take, [2, 0, 3]);
        // A window of 3: the oldest three of those, queue pair 1 having no credit.
        schedule(&ready, |q| credits[q], 3, &mut take);
        assert_eq!(take, [2, 0, 1]);
        schedule(&ready, |q| credits[q], 1, &mut take);
        assert_eq!(take, [1, 0, 0]);
        schedule(&ready, |q| credits[q], 0, &mut take);
        assert_eq!(take, [0, 0, 0]);
    }

    #[test]
    fn plan_floor_and_rotation() {
        let cfg = RingConfig {
            min_chunk_bytes: 128 << 10,
            ..RingConfig::default()
        };
        // 1 MiB of f32 over 4 ranks: 256 KiB segments in two 128 KiB chunks, not eight.
        let p = Plan::new(1 << 18, DType::F32, 4, &cfg).unwrap();
        assert_eq!((p.chunk_elems * p.elem, p.chunks(0)), (128 << 10, 2));
        // 64 MiB: 16 MiB segments in chunks of the slot size.
        let p = Plan::new(16 << 20, DType::F32, 4, &cfg).unwrap();
        assert_eq!(p.chunk_elems * p.elem, 256 << 10);
        // A floor above the slot size is capped by it.
        let big = RingConfig {
            min_chunk_bytes: 1 << 30,
            ..cfg
        };
        let p = Plan::new(1 << 18, DType::F32, 4, &big).unwrap();
        assert_eq!(p.chunk_elems * p.elem, 256 << 10);
        // The defaults: chunks as large as the slots.
        let p = Plan::new(1 << 18, DType::F32, 4, &RingConfig::default()).unwrap();
        assert_eq!((p.chunk_elems * p.elem, p.chunks(0)), (256 << 10, 1));
        // Two chunks a step on 8 queue pairs: each step one queue pair further.
        let used: Vec<usize> = (0..6)
            .flat_map(|s| (0..2).map(move |c| qp_of(0, s, c, 8)))
            .collect();
        assert_eq!(used, [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]);
        // One chunk a step, 6 steps (4 ranks), 8 queue pairs: each call starts where the last
        // one's steps ended, so four calls put three chunks on every queue pair.
        let mut per_qp = [0; 8];
        for call in 0..4 {
            let first = first_qp(call, 6, 8);
            for s in 0..6 {
                per_qp[qp_of(first, s, 0, 8)] += 1;
            }
        }
        assert_eq!(per_qp, [3; 8]);
        assert_eq!(first_qp(1, 6, 8), 6);
        assert_eq!(first_qp(9, 6, 8), 6, "calls count modulo the queue pairs");
    }
}
