//! One call of the ring: the pipelined reduce-scatter and all-gather over the channels.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::plan::{Plan, blame, chunk_id, first_qp, parse_chunk_id, qp_of, schedule};
use super::{Communicator, LOAD_CHUNKS, RX, TX};
use crate::collective::buffer::Overlap;
use crate::collective::channel::{Message, QP_MASK, Receiver, Target};
use crate::collective::dtype::{DType, ReduceOp, reduce_into};
use crate::cq::Completion;
use crate::error::{Error, Result};
use crate::wr::Sge;

impl Communicator {
    pub(super) fn run<'o>(
        &mut self,
        plan: &Plan,
        dtype: DType,
        op: ReduceOp,
        mut ov: Option<&mut (dyn Overlap + 'o)>,
    ) -> Result<()> {
        let k = self.cfg.qps_per_connection;
        let epoch = self.calls & 1 == 1;
        let first = first_qp(self.calls, plan.steps, k);
        let polls = plan.seg_len.iter().sum::<usize>() * plan.elem <= self.cfg.spin_max_bytes;
        let spin = if polls { self.cfg.spin } else { Duration::ZERO };
        // Where each rank has a CPU to spare for its device, a polling call's polls leave the
        // receive work to the device; a sleeping call's looks before it sleeps still help.
        // Elsewhere the queue keeps its default (the polls receive).
        if self.host_share.is_some_and(|h| h.two_cpus_per_rank()) {
            self.cq.set_inline_progress(!polls);
        }
        let (rank, world) = (self.rank, self.world);
        let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
        let work_ptr = self.work.as_mut_ptr();
        let staging_ptr = self.staging.as_mut_ptr();
        let staging_len = self.staging.len();
        let (work_lkey, work_addr) = (self.work.lkey(), self.work.addr());

        // Staged data moves in units of `LOAD_CHUNKS` chunks of a segment, each one copy: the
        // loads start now, in the order the ring first touches the segments (its own, sent at
        // step 0, then the one reduced at each step; every segment is touched during the
        // reduce-scatter, so every byte is loaded); the ring waits for a unit once, before its
        // first chunk is touched (`unloaded`), and stores it once all its chunks are final
        // (`final_left` counts down).
        let group = |seg: usize, c: usize| {
            let g = c - c % LOAD_CHUNKS;
            let (off, _) = plan.chunk(seg, g);
            let (last_off, last_len) = plan.chunk(seg, (g + LOAD_CHUNKS).min(plan.chunks(seg)) - 1);
            (off, last_off + last_len - off)
        };
        let mut unit_base = vec![0usize; world];
        let mut final_left = Vec::new();
        let mut unloaded = Vec::new();
        if let Some(ov) = ov.as_deref_mut() {
            let order = std::iter::once(plan.send_seg(rank, 0))
                .chain((0..world - 1).map(|s| plan.recv_seg(rank, s)));
            for seg in order {
                unit_base[seg] = final_left.len();
                let n = plan.chunks(seg);
                for g in (0..n).step_by(LOAD_CHUNKS) {
                    let (off, len) = group(seg, g);
                    // The ring first touches a chunk when it posts it at step 0 or reduces into
                    // it, and waits for the chunk's unit before either (below). The
                    // predecessor's all-gather writes into a segment only after its final
                    // value was computed from this rank's contribution, sent after the wait.
                    // SAFETY: nothing touches the range before its unit is loaded (above).
                    unsafe { ov.load(final_left.len(), off, len)? };
                    final_left.push(LOAD_CHUNKS.min(n - g));
                    unloaded.push(true);
                }
            }
        }
        let unit_of = |seg: usize, c: usize| unit_base[seg] + c / LOAD_CHUNKS;

        // Chunks ready to send, per queue pair, in order: (step, chunk).
        let mut ready: Vec<VecDeque<(usize, usize)>> = vec![VecDeque::new(); k];
        for c in 0..plan.chunks(plan.send_seg(rank, 0)) {
            ready[qp_of(first, 0, c, k)].push_back((0, c));
        }
        // Chunks in flight towards the successor at most (the window, at least one chunk).
        let window = (self.cfg.window_bytes / (plan.chunk_elems * plan.elem)).max(1);
        let mut take = vec![0usize; k];
        let mut got: Vec<Vec<bool>> = (0..plan.steps)
            .map(|s| vec![false; plan.chunks(plan.recv_seg(rank, s))])
            .collect();
        let mut to_receive: usize = got.iter().map(Vec::len).sum();
        let to_send: usize = (0..plan.steps)
            .map(|s| plan.chunks(plan.send_seg(rank, s)))
            .sum();
        let mut posted = 0usize;
        let mut pending: VecDeque<Completion> = std::mem::take(&mut self.early);
        let mut comps = vec![Completion::default(); 64];
        let mut msgs: Vec<Message> = Vec::new();
        let mut last_progress = Instant::now();
        loop {
            // Whether a request waits for room in a send queue (poll again soon).
            let mut stalled = self.rx.owes_credits();
            // Post what credits allow, one chain per queue pair.
            // One batch for all queue pairs: their equal-size packets share GSO messages.
            crate::coalesce_sends(|| -> Result<()> {
                let budget = window.saturating_sub(self.tx.in_flight());
                schedule(&ready, |q| self.tx.credits(q), budget, &mut take);
                for (q, queue) in ready.iter_mut().enumerate() {
                    let room = take[q];
                    if room == 0 {
                        continue;
                    }
                    msgs.clear();
                    for &(step, c) in queue.iter().take(room) {
                        if let (0, Some(ov)) = (step, ov.as_deref_mut()) {
                            let u = unit_of(plan.send_seg(rank, 0), c);
                            if std::mem::take(&mut unloaded[u]) {
                                ov.loaded(u)?;
                            }
                        }
                        let (off, len) = plan.chunk(plan.send_seg(rank, step), c);
                        let target = if plan.is_reduce(step) {
                            Target::Slot
                        } else {
                            // The successor receives this segment at the same offset.
                            Target::Remote(self.peer_work.slice(off as u64, len as u64)?)
                        };
                        msgs.push(Message {
                            local: Sge {
                                addr: work_addr + off as u64,
                                length: len as u32,
                                lkey: work_lkey,
                            },
                            target,
                            user: chunk_id(epoch, step, c),
                        });
                    }
                    // Every SGE lies inside `self.work` (the plan's offsets are within
                    // `count * size <= capacity`), a region this communicator owns and keeps
                    // alive past its queue pairs (field order). The device only reads it, and
                    // the CPU does not write these bytes until the run ends: a chunk is sent
                    // after its last reduction and is only written again by the predecessor's
                    // all-gather write, which causally follows this read; `run` returns only
                    // after the successor has handed back the credit of every chunk, i.e. after
                    // every chunk has arrived there.
                    // SAFETY: the SGEs stay live and unwritten until the device is done (above).
                    let n = unsafe { self.tx.post(q, &msgs)? };
                    stalled |= n < msgs.len();
                    queue.drain(..n);
                    posted += n;
                }
                Ok(())
            })?;
            // Credits a full send queue refused are owed still: the predecessor waits for them.
            if to_receive == 0
                && posted == to_send
                && self.tx.all_credits_back()
                && !self.rx.owes_credits()
            {
                self.early.extend(pending);
                return Ok(());
            }
            if pending.is_empty() {
                let waited = last_progress.elapsed();
                if waited >= self.cfg.timeout {
                    return Err(Error::Timeout {
                        what: format!(
                            "progress of the ring at rank {rank} for {:?} ({} chunks still to \
                             come from rank {prev}, {} chunks unsent or unconsumed at rank \
                             {next}); a neighbour is gone or stuck",
                            self.cfg.timeout,
                            to_receive,
                            to_send - posted + self.tx.in_flight()
                        ),
                    });
                }
                let mut wait = self.cfg.timeout - waited;
                if stalled {
                    wait = wait.min(Duration::from_millis(1));
                }
                // Poll, yielding the CPU between polls, for a while (small calls), then sleep
                // until a completion comes.
                let mut n = 0;
                let polling = Instant::now();
                while n == 0 && polling.elapsed() < spin.min(wait) {
                    n = self.cq.poll(&mut comps)?;
                    if n == 0 {
                        std::thread::yield_now();
                    }
                }
                if n == 0 {
                    n = self.cq.wait(&mut comps, wait)?;
                }
                if n > 0 {
                    last_progress = Instant::now();
                }
                pending.extend(comps[..n].iter().copied());
            }
            while let Some(wc) = pending.pop_front() {
                let (tag, q) = (wc.wr_id & !QP_MASK, (wc.wr_id & QP_MASK) as usize);
                let peer = if tag == TX { next } else { prev };
                if !wc.status.is_success() {
                    return Err(Error::protocol(format!(
                        "rank {rank}: a transfer with rank {peer} failed ({}, queue pair {}); \
                         rank {peer} is gone or its queue pair broke",
                        wc.status, wc.qp_num
                    )));
                }
                if (tag != TX && tag != RX) || q >= k {
                    return Err(Error::protocol(format!(
                        "rank {rank}: completion with an unknown id {:#x}",
                        wc.wr_id
                    )));
                }
                if !wc.opcode.is_recv() {
                    continue;
                }
                if tag == TX {
                    self.tx.on_credit(q, &wc).map_err(blame(rank, next))?;
                    continue;
                }
                // A chunk from the predecessor.
                let user = Receiver::user_bits(&wc).map_err(blame(rank, prev))?;
                let (e, step, c) = parse_chunk_id(user);
                if e != epoch {
                    if to_receive == 0 {
                        // The predecessor is already in the next call.
                        self.early.push_back(wc);
                        continue;
                    }
                    return Err(Error::protocol(format!(
                        "rank {rank}: rank {prev} sent a chunk of another call (do all ranks \
                         make the same calls?)"
                    )));
                }
                let a = self.rx.arrival(q, &wc).map_err(blame(rank, prev))?;
                let valid = step < plan.steps
                    && c < got[step].len()
                    && !got[step][c]
                    && qp_of(first, step, c, k) == q;
                if !valid {
                    return Err(Error::protocol(format!(
                        "rank {rank}: rank {prev} sent chunk {c} of step {step} on queue pair \
                         {q}, which this call does not expect (do all ranks reduce the same \
                         count and type?)"
                    )));
                }
                let (off, len) = plan.chunk(plan.recv_seg(rank, step), c);
                if a.len != len {
                    return Err(Error::protocol(format!(
                        "rank {rank}: rank {prev} wrote {} bytes for chunk {c} of step {step}, \
                         expected {len} (do all ranks reduce the same count and type?)",
                        a.len
                    )));
                }
                if plan.is_reduce(step) {
                    if a.slot_offset + len > staging_len {
                        return Err(Error::protocol(format!(
                            "rank {rank}: slot {} of queue pair {q} lies outside staging",
                            a.slot
                        )));
                    }
                    // `slot_offset + len <= staging_len` (checked) and `off + len <=
                    // capacity`; both pointers come from the regions' own slices. The device
                    // has finished writing the slot (its completion is here) and will not
                    // write it again before its credit is granted below; nothing touches this
                    // chunk of the work buffer now: it was sent at this rank's previous use of
                    // the segment, whose read causally precedes this write arriving, and it is
                    // sent again only after this reduction.
                    if let Some(ov) = ov.as_deref_mut() {
                        let u = unit_of(plan.recv_seg(rank, step), c);
                        if std::mem::take(&mut unloaded[u]) {
                            ov.loaded(u)?;
                        }
                    }
                    // SAFETY: both ranges are in bounds and nothing else accesses them (above).
                    let (src, dst) = unsafe {
                        (
                            std::slice::from_raw_parts(staging_ptr.add(a.slot_offset), len),
                            std::slice::from_raw_parts_mut(work_ptr.add(off), len),
                        )
                    };
                    reduce_into(dtype, op, dst, src)?;
                }
                // Final here: reduced at the last reduce-scatter step, or arrived by the
                // all-gather. Nothing writes it again in this call: it is only sent on.
                if let (false, Some(ov)) = (plan.is_reduce(step + 1), ov.as_deref_mut()) {
                    let seg = plan.recv_seg(rank, step);
                    let u = unit_of(seg, c);
                    final_left[u] -= 1;
                    if final_left[u] == 0 {
                        let (off, len) = group(seg, c);
                        // Nothing writes these final chunks of the work buffer again before
                        // the call ends, and the call ends with `Overlap::finish`.
                        // SAFETY: the range stays unwritten until `finish` (above).
                        unsafe { ov.store(off, len)? };
                    }
                }
                got[step][c] = true;
                to_receive -= 1;
                if step + 1 < plan.steps {
                    ready[qp_of(first, step + 1, c, k)].push_back((step + 1, c));
                }
                self.rx.consume(&a)?;
            }
            // Hand the consumed slots back, one message per queue pair for the whole batch.
            crate::coalesce_sends(|| self.rx.flush_credits())?;
        }
    }
}
