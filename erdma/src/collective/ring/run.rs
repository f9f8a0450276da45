//! One call of the ring: the pipelined reduce-scatter and all-gather over the channels.
//!
//! A call loops over four stages until every chunk has come in and every credit has come back:
//! post the ready chunks the credits and the window allow ([`Communicator::post_ready`]), wait
//! for progress ([`Communicator::wait_progress`]), take the completions
//! ([`Communicator::take_completion`]) — credits, and chunks, which the reduce-scatter folds into
//! the buffer ([`Communicator::reduce_scatter_chunk`]) and the all-gather finds in place — and
//! hand the consumed slots back. A chunk received at step `s` is ready for step `s + 1`, so the
//! two phases overlap as the steps do.

#![allow(unsafe_code)] // raw posts and reductions over registered memory the protocol hands over

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::plan::{Plan, blame, chunk_id, first_qp, parse_chunk_id, qp_of, schedule};
use super::{Communicator, LOAD_CHUNKS, RX, TX};
use crate::collective::buffer::Overlap;
use crate::collective::channel::{Arrival, Message, QP_MASK, Receiver, Target};
use crate::collective::dtype::{DType, ReduceOp, reduce_into};
use crate::error::{Error, Result};
use crate::vocab::Completion;
use crate::vocab::Sge;

/// What one call keeps while it runs.
pub(super) struct Call<'p> {
    plan: &'p Plan,
    dtype: DType,
    op: ReduceOp,
    /// The call's parity, carried in every chunk's immediate.
    epoch: bool,
    /// The queue pair the call's chunk 0 of step 0 travels on.
    first: usize,
    /// How long a wait polls before it sleeps.
    spin: Duration,
    /// Chunks in flight towards the successor at most (at least one).
    window: usize,
    /// Chunks ready to send, per queue pair, in order: (step, chunk).
    ready: Vec<VecDeque<(usize, usize)>>,
    /// How many of each queue pair's ready chunks go out in this round.
    take: Vec<usize>,
    /// Which chunks of each step have come in.
    got: Vec<Vec<bool>>,
    to_receive: usize,
    to_send: usize,
    posted: usize,
    /// Completions taken from the queue and not handled yet.
    pending: VecDeque<Completion>,
    comps: Vec<Completion>,
    msgs: Vec<Message>,
    last_progress: Instant,
}

/// Memory staged beside the ring ([`Overlap`]), moved in units of `LOAD_CHUNKS` chunks of a
/// segment, each one copy. The loads start with the call, in the order the ring first touches
/// the segments (its own, sent at step 0, then the one reduced at each step; every segment is
/// touched during the reduce-scatter, so every byte is loaded); the ring waits for a unit once,
/// before its first chunk is touched (`unloaded`), and stores it once all its chunks are final
/// (`final_left` counts down).
struct Staging<'a, 'o> {
    ov: &'a mut (dyn Overlap + 'o),
    unit_base: Vec<usize>,
    final_left: Vec<usize>,
    unloaded: Vec<bool>,
}

/// Byte offset and length of the load unit that holds chunk `c` of segment `seg`.
fn group(plan: &Plan, seg: usize, c: usize) -> (usize, usize) {
    let g = c - c % LOAD_CHUNKS;
    let (off, _) = plan.chunk(seg, g);
    let (last_off, last_len) = plan.chunk(seg, (g + LOAD_CHUNKS).min(plan.chunks(seg)) - 1);
    (off, last_off + last_len - off)
}

impl<'a, 'o> Staging<'a, 'o> {
    /// Starts every load of a call.
    fn start(
        ov: &'a mut (dyn Overlap + 'o),
        plan: &Plan,
        rank: usize,
        world: usize,
    ) -> Result<Self> {
        let mut s = Staging {
            ov,
            unit_base: vec![0usize; world],
            final_left: Vec::new(),
            unloaded: Vec::new(),
        };
        let order = std::iter::once(plan.send_seg(rank, 0))
            .chain((0..world - 1).map(|st| plan.recv_seg(rank, st)));
        for seg in order {
            s.unit_base[seg] = s.final_left.len();
            let n = plan.chunks(seg);
            for g in (0..n).step_by(LOAD_CHUNKS) {
                let (off, len) = group(plan, seg, g);
                // The ring first touches a chunk when it posts it at step 0 or reduces into
                // it, and waits for the chunk's unit before either (below). The
                // predecessor's all-gather writes into a segment only after its final
                // value was computed from this rank's contribution, sent after the wait.
                // SAFETY: nothing touches the range before its unit is loaded (above).
                unsafe { s.ov.load(s.final_left.len(), off, len)? };
                s.final_left.push(LOAD_CHUNKS.min(n - g));
                s.unloaded.push(true);
            }
        }
        Ok(s)
    }

    fn unit(&self, seg: usize, c: usize) -> usize {
        self.unit_base[seg] + c / LOAD_CHUNKS
    }

    /// Waits, once, for the unit of chunk `c` of `seg` to be loaded, before it is first touched.
    fn touch(&mut self, seg: usize, c: usize) -> Result<()> {
        let u = self.unit(seg, c);
        if std::mem::take(&mut self.unloaded[u]) {
            self.ov.loaded(u)?;
        }
        Ok(())
    }

    /// Chunk `c` of `seg` is final; its unit is stored once all of its chunks are.
    fn final_chunk(&mut self, plan: &Plan, seg: usize, c: usize) -> Result<()> {
        let u = self.unit(seg, c);
        self.final_left[u] -= 1;
        if self.final_left[u] == 0 {
            let (off, len) = group(plan, seg, c);
            // Nothing writes these final chunks of the work buffer again before
            // the call ends, and the call ends with `Overlap::finish`.
            // SAFETY: the range stays unwritten until `finish` (above).
            unsafe { self.ov.store(off, len)? };
        }
        Ok(())
    }
}

impl Communicator {
    pub(super) fn run<'o>(
        &mut self,
        plan: &Plan,
        dtype: DType,
        op: ReduceOp,
        ov: Option<&mut (dyn Overlap + 'o)>,
    ) -> Result<()> {
        let mut staged = match ov {
            Some(ov) => Some(Staging::start(ov, plan, self.rank, self.world)?),
            None => None,
        };
        let mut call = self.begin(plan, dtype, op);
        loop {
            // Whether a request waits for room in a send queue (poll again soon).
            let mut stalled = self.rx.owes_credits();
            stalled |= self.post_ready(&mut call, staged.as_mut())?;
            // Credits a full send queue refused are owed still: the predecessor waits for them.
            if call.to_receive == 0
                && call.posted == call.to_send
                && self.tx.all_credits_back()
                && !self.rx.owes_credits()
            {
                self.early.extend(call.pending);
                return Ok(());
            }
            if call.pending.is_empty() {
                self.wait_progress(&mut call, stalled)?;
            }
            while let Some(wc) = call.pending.pop_front() {
                self.take_completion(&mut call, staged.as_mut(), wc)?;
            }
            // Hand the consumed slots back, one message per queue pair for the whole batch.
            crate::soft::coalesce_sends(|| self.rx.flush_credits())?;
        }
    }

    /// A call's starting state: its own segment's chunks ready for step 0.
    fn begin<'p>(&mut self, plan: &'p Plan, dtype: DType, op: ReduceOp) -> Call<'p> {
        let k = self.cfg.qps_per_connection;
        let rank = self.rank;
        let first = first_qp(self.calls, plan.steps, k);
        let polls = plan.seg_len.iter().sum::<usize>() * plan.elem <= self.cfg.spin_max_bytes;
        // Where each rank has a CPU to spare for its device, a polling call's polls leave the
        // receive work to the device; a sleeping call's looks before it sleeps still help.
        // Elsewhere the queue keeps its default (the polls receive).
        if self.host_share.is_some_and(|h| h.two_cpus_per_rank()) {
            self.cq.set_inline_progress(!polls);
        }
        let mut ready: Vec<VecDeque<(usize, usize)>> = vec![VecDeque::new(); k];
        for c in 0..plan.chunks(plan.send_seg(rank, 0)) {
            ready[qp_of(first, 0, c, k)].push_back((0, c));
        }
        let got: Vec<Vec<bool>> = (0..plan.steps)
            .map(|s| vec![false; plan.chunks(plan.recv_seg(rank, s))])
            .collect();
        Call {
            plan,
            dtype,
            op,
            epoch: self.calls & 1 == 1,
            first,
            spin: if polls { self.cfg.spin } else { Duration::ZERO },
            window: (self.cfg.window_bytes / (plan.chunk_elems * plan.elem)).max(1),
            ready,
            take: vec![0usize; k],
            to_receive: got.iter().map(Vec::len).sum(),
            got,
            to_send: (0..plan.steps)
                .map(|s| plan.chunks(plan.send_seg(rank, s)))
                .sum(),
            posted: 0,
            pending: std::mem::take(&mut self.early),
            comps: vec![Completion::default(); 64],
            msgs: Vec::new(),
            last_progress: Instant::now(),
        }
    }

    /// Posts what the credits and the window allow, one chain per queue pair, all in one batch
    /// (their equal-size packets share GSO messages). Returns whether a send queue was too full
    /// for some of it.
    fn post_ready(
        &mut self,
        call: &mut Call<'_>,
        mut staged: Option<&mut Staging<'_, '_>>,
    ) -> Result<bool> {
        let plan = call.plan;
        let rank = self.rank;
        let (work_lkey, work_addr) = (self.work.lkey(), self.work.addr());
        let mut stalled = false;
        crate::soft::coalesce_sends(|| -> Result<()> {
            let budget = call.window.saturating_sub(self.tx.in_flight());
            schedule(&call.ready, |q| self.tx.credits(q), budget, &mut call.take);
            for (q, queue) in call.ready.iter_mut().enumerate() {
                let room = call.take[q];
                if room == 0 {
                    continue;
                }
                call.msgs.clear();
                for &(step, c) in queue.iter().take(room) {
                    if let (0, Some(s)) = (step, staged.as_deref_mut()) {
                        s.touch(plan.send_seg(rank, 0), c)?;
                    }
                    let (off, len) = plan.chunk(plan.send_seg(rank, step), c);
                    let target = if plan.is_reduce(step) {
                        // Reduce-scatter: into the successor's next staging slot, to be folded.
                        Target::Slot
                    } else {
                        // All-gather: the successor receives this segment at the same offset.
                        Target::Remote(self.peer_work.slice(off as u64, len as u64)?)
                    };
                    call.msgs.push(Message {
                        local: Sge {
                            addr: work_addr + off as u64,
                            length: len as u32,
                            lkey: work_lkey,
                        },
                        target,
                        user: chunk_id(call.epoch, step, c),
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
                let n = unsafe { self.tx.post(q, &call.msgs)? };
                stalled |= n < call.msgs.len();
                queue.drain(..n);
                call.posted += n;
            }
            Ok(())
        })?;
        Ok(stalled)
    }

    /// Waits for completions (polling a while for small calls, then sleeping), at most until the
    /// ring's timeout since the last progress; `stalled`: poll again soon.
    fn wait_progress(&mut self, call: &mut Call<'_>, stalled: bool) -> Result<()> {
        let (rank, world) = (self.rank, self.world);
        let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
        let waited = call.last_progress.elapsed();
        if waited >= self.cfg.timeout {
            return Err(Error::Timeout {
                what: format!(
                    "progress of the ring at rank {rank} for {:?} ({} chunks still to \
                     come from rank {prev}, {} chunks unsent or unconsumed at rank \
                     {next}); a neighbour is gone or stuck",
                    self.cfg.timeout,
                    call.to_receive,
                    call.to_send - call.posted + self.tx.in_flight()
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
        while n == 0 && polling.elapsed() < call.spin.min(wait) {
            n = self.cq.poll(&mut call.comps)?;
            if n == 0 {
                std::thread::yield_now();
            }
        }
        if n == 0 {
            n = self.cq.wait(&mut call.comps, wait)?;
        }
        if n > 0 {
            call.last_progress = Instant::now();
        }
        for wc in &mut call.comps[..n] {
            self.take_note(wc)?;
        }
        call.pending.extend(call.comps[..n].iter().copied());
        Ok(())
    }

    /// Where the device has no immediate data, completes a receive completion from its note (in
    /// the order completions come, as the channels need).
    fn take_note(&mut self, wc: &mut Completion) -> Result<()> {
        let (tag, q) = (wc.wr_id & !QP_MASK, (wc.wr_id & QP_MASK) as usize);
        if !wc.opcode.is_recv() || q >= self.cfg.qps_per_connection {
            return Ok(());
        }
        match tag {
            TX => self.tx.take_note(q, wc),
            RX => self.rx.take_note(q, wc),
            _ => Ok(()),
        }
    }

    /// One completion: a failure ends the call; a credit goes to the sender; a chunk from the
    /// predecessor is checked and taken.
    fn take_completion(
        &mut self,
        call: &mut Call<'_>,
        staged: Option<&mut Staging<'_, '_>>,
        wc: Completion,
    ) -> Result<()> {
        let (rank, world) = (self.rank, self.world);
        let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
        let k = self.cfg.qps_per_connection;
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
            return Ok(());
        }
        if tag == TX {
            return self.tx.on_credit(q, &wc).map_err(blame(rank, next));
        }
        // A chunk from the predecessor.
        let user = Receiver::user_bits(&wc).map_err(blame(rank, prev))?;
        let (e, step, c) = parse_chunk_id(user);
        if e != call.epoch {
            if call.to_receive == 0 {
                // The predecessor is already in the next call.
                self.early.push_back(wc);
                return Ok(());
            }
            return Err(Error::protocol(format!(
                "rank {rank}: rank {prev} sent a chunk of another call (do all ranks \
                 make the same calls?)"
            )));
        }
        let a = self.rx.arrival(q, &wc).map_err(blame(rank, prev))?;
        self.take_chunk(call, staged, &a, step, c)
    }

    /// A chunk that came in: checked against the plan, reduced (reduce-scatter) or found in
    /// place (all-gather), stored when final and staged, made ready for the next step, and its
    /// slot consumed.
    fn take_chunk(
        &mut self,
        call: &mut Call<'_>,
        mut staged: Option<&mut Staging<'_, '_>>,
        a: &Arrival,
        step: usize,
        c: usize,
    ) -> Result<()> {
        let (rank, world) = (self.rank, self.world);
        let prev = (rank + world - 1) % world;
        let (plan, k, q) = (call.plan, self.cfg.qps_per_connection, a.q);
        let valid = step < plan.steps
            && c < call.got[step].len()
            && !call.got[step][c]
            && qp_of(call.first, step, c, k) == q;
        if !valid {
            return Err(Error::protocol(format!(
                "rank {rank}: rank {prev} sent chunk {c} of step {step} on queue pair \
                 {q}, which this call does not expect (do all ranks reduce the same \
                 count and type?)"
            )));
        }
        let seg = plan.recv_seg(rank, step);
        let (off, len) = plan.chunk(seg, c);
        if a.len != len {
            return Err(Error::protocol(format!(
                "rank {rank}: rank {prev} wrote {} bytes for chunk {c} of step {step}, \
                 expected {len} (do all ranks reduce the same count and type?)",
                a.len
            )));
        }
        if plan.is_reduce(step) {
            if let Some(s) = staged.as_deref_mut() {
                s.touch(seg, c)?;
            }
            self.reduce_scatter_chunk(call, a, off, len)?;
        }
        // Final here: reduced at the last reduce-scatter step, or arrived by the
        // all-gather. Nothing writes it again in this call: it is only sent on.
        if let (false, Some(s)) = (plan.is_reduce(step + 1), staged) {
            s.final_chunk(plan, seg, c)?;
        }
        call.got[step][c] = true;
        call.to_receive -= 1;
        if step + 1 < plan.steps {
            call.ready[qp_of(call.first, step + 1, c, k)].push_back((step + 1, c));
        }
        self.rx.consume(a)
    }

    /// The reduce-scatter's work on a chunk: fold the staging slot it arrived in into the
    /// buffer at `off`.
    fn reduce_scatter_chunk(
        &mut self,
        call: &Call<'_>,
        a: &Arrival,
        off: usize,
        len: usize,
    ) -> Result<()> {
        let staging_len = self.staging.len();
        if a.slot_offset + len > staging_len {
            return Err(Error::protocol(format!(
                "rank {}: slot {} of queue pair {} lies outside staging",
                self.rank, a.slot, a.q
            )));
        }
        let staging_ptr = self.staging.as_mut_ptr();
        let work_ptr = self.work.as_mut_ptr();
        // `slot_offset + len <= staging_len` (checked) and `off + len <=
        // capacity`; both pointers come from the regions' own slices. The device
        // has finished writing the slot (its completion is here) and will not
        // write it again before its credit is granted; nothing touches this
        // chunk of the work buffer now: it was sent at this rank's previous use of
        // the segment, whose read causally precedes this write arriving, and it is
        // sent again only after this reduction.
        // SAFETY: both ranges are in bounds and nothing else accesses them (above).
        let (src, dst) = unsafe {
            (
                std::slice::from_raw_parts(staging_ptr.add(a.slot_offset), len),
                std::slice::from_raw_parts_mut(work_ptr.add(off), len),
            )
        };
        reduce_into(call.dtype, call.op, dst, src)
    }
}
