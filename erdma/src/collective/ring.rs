//! The ring AllReduce: a queue-pair mesh along the ring, credit-based channels, and the
//! chunked, pipelined reduce-scatter + all-gather that runs over them.
//!
//! Each rank holds K queue pairs towards its successor (`tx`: it writes) and K from its
//! predecessor (`rx`: it is written to). A segment is cut into chunks of at least
//! `min_chunk_bytes` (spread over the K queue pairs when it is large enough) and at most
//! `chunk_bytes`; chunk `c` of step `s` travels on queue pair `(f + c + s) mod K`, so a call with
//! fewer chunks per step than queue pairs spreads its steps over several of them, and `f`, where
//! the call starts, is where the previous call's steps ended (call `n` of `S` steps starts at
//! `n × S mod K`), so a run of such calls loads every queue pair alike: a 1 MiB call over 4
//! ranks takes 6 of the 8, the next one the other 2 and 4 more.
//!
//! - Reduce-scatter chunks go by RDMA WRITE WITH IMM into one of the receiver's S staging slots
//!   of that queue pair; the receiver folds the slot into its buffer as soon as the completion
//!   arrives and hands the slot back with a zero-length SEND WITH IMM (a credit; the credits
//!   of one batch of completions travel together). A sender writes only into slots it holds
//!   credits for, so at most S chunks per queue pair are in flight and no receive queue ever
//!   runs dry. Slots are used round robin, in the same order on both sides; the immediate
//!   names the slot, so the receiver checks it.
//! - On top of the credits, a sender keeps at most `window_bytes` (at least one chunk) in
//!   flight on a link, oldest chunks first: data waiting in the peer's device and kernel
//!   buffers stays in cache instead of pushing out what the next copy reads.
//! - All-gather chunks go by WRITE WITH IMM straight to their final place in the receiver's
//!   buffer, under the same credits.
//! - Where the device has no immediate data (siw and other iWARP devices but eRDMA), each
//!   WRITE WITH IMM is a WRITE and a small SEND carrying the immediate's bits, and each credit
//!   a small SEND ([`channel`]); the queue pairs are connected through rdma_cm, each rank
//!   listening on its device's address (`mesh`).
//! - The immediate carries the step, the chunk and the slot (and the parity of the call, so a
//!   chunk of the next call that arrives early is kept for it); nothing is learnt by polling
//!   memory. A chunk received at step `s` is forwarded at step `s + 1`, so steps overlap.
//! - Chunks and credits are posted unsignaled: a call ends when every chunk has arrived here
//!   and every credit has come back (which proves every chunk sent arrived there, so the
//!   device is done reading the buffer).
//! - What one round of the loop posts on the K queue pairs goes out together
//!   ([`crate::soft::coalesce_sends`]): on a soft device the K chunks' packets then share GSO
//!   messages instead of costing up to three per chunk.
//! - Memory the device cannot reach (GPU memory: [`ReduceBuffer::as_gpu_mut`]) moves beside
//!   the ring ([`Overlap`]): at the start of a call it is queued for loading into the
//!   registered buffer in units of `LOAD_CHUNKS` chunks, in the order the ring first touches
//!   the segments; the ring waits for a unit before it first reads it, queues it back once all
//!   its chunks are final, and the call returns after the last copy.
//!
//! - Where the host has two CPUs for each rank of the ring on it, the polls of a call that
//!   polls leave the receive work to the device: a soft device's engine thread then receives
//!   beside the rank, on a CPU of its own. With fewer, a polling rank does that work itself,
//!   sparing the wake-up of another thread. The ranks tell each other their host (its boot id)
//!   and CPU affinity in the setup data ([`Communicator::host_share`]).
//!
//! Every wait is bounded: a peer that dies makes this rank fail with an error naming the peer
//! (an error completion once the transport gives up, or a timeout).
//!
//! The parts, by job: `config` ([`RingConfig`]), `plan` (a call's segments, chunks and
//! schedule), `mesh` (building a rank's part of the ring: [`Communicator::new`]), `run` (one
//! call), and here the communicator's own API.

#![allow(unsafe_code)] // the work buffer over registered memory the protocol hands over; GPU pinning

use std::collections::VecDeque;

use super::buffer::{Overlap, ReduceBuffer};
use super::channel::{self, Receiver, Sender};
use super::dtype::{DType, ReduceOp};
use super::host::HostShare;
use crate::error::{Error, Result};
use crate::mr::{Mr, RemoteMr};
use crate::vocab::Completion;
use crate::{Cq, Pd};

mod config;
mod mesh;
mod plan;
mod run;
#[cfg(test)]
mod tests;

pub use config::RingConfig;
use plan::Plan;

/// Largest number of ranks in a ring (the step number has 6 bits in the immediate).
pub const MAX_RANKS: usize = 32;
/// Largest number of staging slots per queue pair.
pub const MAX_SLOTS: usize = channel::MAX_SLOTS;
/// Largest number of chunks per step (16 bits in the immediate).
pub const MAX_CHUNKS: usize = 1 << 16;

/// Chunks per load unit when the data is staged beside the ring ([`Overlap`]): a unit is one
/// asynchronous copy and one event to wait on.
const LOAD_CHUNKS: usize = 4;

/// Bit of the channel's user bits that carries the parity of the call.
const EPOCH: u32 = 1 << 22;
/// `wr_id` tag of requests on the queue pairs towards the successor.
const TX: u64 = 1 << 32;
/// `wr_id` tag of requests on the queue pairs from the predecessor.
const RX: u64 = 2 << 32;

/// One rank's part of a ring: its queue pairs, registered buffers and channel state.
///
/// Reduce in place in [`Communicator::buffer_mut`] with [`Communicator::all_reduce_in_place`],
/// or reduce any [`ReduceBuffer`] (staged through that buffer) with
/// [`Communicator::all_reduce`]. Every rank must make the same calls with the same arguments.
pub struct Communicator {
    /// On iWARP devices, the rdma_cm connections the queue pairs live on: they go first (each
    /// moves its queue pair to the error state), then the channels.
    _links: Vec<crate::connect::cm::Connection>,
    // The channels (queue pairs) first: they are destroyed before the memory they may still
    // reference.
    tx: Sender,
    rx: Receiver,
    cq: Cq,
    /// `work`, page-locked for GPU copies once a call staged GPU memory (`Err`: the driver
    /// refused, and copies go through its bounce buffers). Declared before `work`, so it is
    /// dropped, and the memory unregistered, while the memory is still there.
    #[cfg(feature = "gpu")]
    host_pin: Option<Result<crate::gpu::HostPin>>,
    /// The stream of GPU copies beside the ring, kept from call to call. Before `work`: its
    /// drop waits for any copy into that memory.
    #[cfg(feature = "gpu")]
    gpu_copies: Option<crate::gpu::StreamCopies>,
    work: Mr<'static>,
    staging: Mr<'static>,
    _pd: Pd,
    peer_work: RemoteMr,
    rank: usize,
    world: usize,
    cfg: RingConfig,
    /// This rank's share of its host (`None`: not known).
    host_share: Option<HostShare>,
    /// Data completions of the next call that arrived before this one ended.
    early: VecDeque<Completion>,
    /// Calls completed (its parity travels in the immediate).
    calls: u64,
    failed: Option<String>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Communicator");
        d.field("rank", &self.rank)
            .field("world", &self.world)
            .field("qps_per_connection", &self.cfg.qps_per_connection)
            .field("chunk_bytes", &self.cfg.chunk_bytes)
            .field("slots", &self.cfg.slots)
            .field("capacity", &self.cfg.max_bytes)
            .field("host_share", &self.host_share)
            .field("failed", &self.failed);
        #[cfg(feature = "gpu")]
        d.field("host_pin", &self.host_pin);
        d.finish()
    }
}

impl Communicator {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the ring.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The configuration the ring runs with.
    pub fn config(&self) -> &RingConfig {
        &self.cfg
    }

    /// How many ranks of the ring share this rank's host, and the CPUs they may run on (`None`
    /// when that cannot be told). Where there are two CPUs per rank
    /// ([`HostShare::two_cpus_per_rank`]), the polls of calls of at most
    /// [`RingConfig::spin_max_bytes`] leave the receive work to the device
    /// ([`Cq::set_inline_progress`]): a soft device's engine thread receives beside the rank.
    /// Otherwise, and in larger calls (which sleep), the polls do their part of it.
    pub fn host_share(&self) -> Option<HostShare> {
        self.host_share
    }

    /// Capacity in bytes: the largest AllReduce.
    pub fn capacity(&self) -> usize {
        self.cfg.max_bytes
    }

    /// Page-locks the host buffer for the copies of CUDA device `device`'s memory, so that
    /// [`Communicator::all_reduce`] of a [`GpuBuffer`](crate::gpu::GpuBuffer) copies by DMA
    /// instead of through the driver's pageable bounce buffers. That call does it itself the
    /// first time; calling it first tells whether it works. Once done it holds for every
    /// device; a refusal is kept and reported again, and the copies still work, slower.
    ///
    /// # Errors
    /// [`Error::Gpu`] without a driver, or with the driver's refusal.
    #[cfg(feature = "gpu")]
    pub fn pin_for_gpu(&mut self, device: usize) -> Result<()> {
        if self.host_pin.is_none() {
            let (host, len) = (self.work.as_mut_ptr(), self.work.len());
            // `work` owns this memory and is dropped after `host_pin` (field order), so the
            // range stays mapped while it is pinned.
            // SAFETY: the range stays mapped for as long as the pin (above).
            let pin = unsafe { crate::gpu::HostPin::new(device, host, len) };
            self.host_pin = Some(pin);
        }
        match &self.host_pin {
            Some(Err(e)) => Err(Error::Gpu {
                what: format!("the ring's host buffer could not be page-locked: {e}"),
            }),
            _ => Ok(()),
        }
    }

    /// The registered buffer that [`Communicator::all_reduce_in_place`] reduces.
    ///
    /// The predecessor may write this buffer, so it is a region no reference of an [`Mr`]
    /// reaches (see [`Mr::peer_writable`]). The ring hands one out all the same: the queue pair
    /// that reaches it and the key it needs are the ring's own, unreachable from this process's
    /// code, and the predecessor writes only inside a call that holds `&mut self`. A member
    /// process that writes outside the ring's protocol breaks that, as a process writing
    /// memory it shares with this one would.
    pub fn buffer(&self) -> &[u8] {
        // Nothing writes `work` through its remote key outside a call on `&mut self` (above),
        // and `&self` excludes those calls for as long as the slice lives.
        // SAFETY: `as_slice_unchecked`'s contract holds (above).
        unsafe { &self.work.as_slice_unchecked()[..self.cfg.max_bytes] }
    }

    /// The registered buffer, to fill before [`Communicator::all_reduce_in_place`] (see
    /// [`Communicator::buffer`]).
    pub fn buffer_mut(&mut self) -> &mut [u8] {
        let n = self.cfg.max_bytes;
        // SAFETY: as in `buffer`: the predecessor writes only inside calls on `&mut self`.
        unsafe { &mut self.work.as_mut_slice_unchecked()[..n] }
    }

    /// Reduces `buf` across all ranks: its contents go into the registered buffer, the ring
    /// runs, and the result comes back into `buf` (the seam for memory the device cannot reach
    /// directly, such as GPU memory staged through the host). GPU memory
    /// (`ReduceBuffer::as_gpu_mut`, feature `gpu`) moves piece by piece beside the ring.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_in_place`], and the buffer's own errors.
    pub fn all_reduce(
        &mut self,
        buf: &mut dyn ReduceBuffer,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let bytes = buf.len_bytes();
        if bytes % dtype.size() != 0 || bytes > self.cfg.max_bytes {
            return Err(Error::invalid(format!(
                "a buffer of {bytes} bytes: must be whole {dtype} elements and at most the \
                 communicator's capacity of {} bytes",
                self.cfg.max_bytes
            )));
        }
        #[cfg(feature = "gpu")]
        if let Some(gpu) = buf.as_gpu_mut() {
            return self.all_reduce_gpu(gpu, bytes / dtype.size(), dtype, op);
        }
        buf.copy_to_host(&mut self.buffer_mut()[..bytes])?;
        self.all_reduce_in_place(bytes / dtype.size(), dtype, op)?;
        buf.copy_from_host(&self.buffer()[..bytes])
    }

    /// [`Communicator::all_reduce`] of GPU memory: loads and stores on a stream of their own,
    /// beside the ring, into the page-locked host buffer.
    #[cfg(feature = "gpu")]
    fn all_reduce_gpu(
        &mut self,
        gpu: &mut crate::gpu::GpuBuffer,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let device = gpu.device();
        // Unpinned, the copies still work (the driver stages them itself, synchronously).
        let _ = self.pin_for_gpu(device);
        let mut copies = match self.gpu_copies.take() {
            Some(c) if c.ordinal() == device => c,
            _ => crate::gpu::StreamCopies::new(device)?,
        };
        let mut ov = super::buffer::GpuOverlap {
            copies: &mut copies,
            dev: gpu.device_ptr(),
            dev_len: gpu.len(),
            host: self.work.as_mut_ptr(),
            host_len: self.work.len(),
        };
        let ran = self.reduce(count, dtype, op, Some(&mut ov));
        self.gpu_copies = Some(copies);
        ran
    }

    /// Reduces the first `count` elements of the registered buffer across all ranks, in place:
    /// afterwards every rank's buffer holds `op` over every rank's input.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `count` elements exceed the capacity;
    /// [`Error::Timeout`] or [`Error::Protocol`] naming the neighbour when the ring breaks (a
    /// transfer that fails, with its completion status, is a protocol error naming the
    /// neighbour it went to or came from). After an error the communicator is unusable: every
    /// later call fails.
    pub fn all_reduce_in_place(&mut self, count: usize, dtype: DType, op: ReduceOp) -> Result<()> {
        self.reduce(count, dtype, op, None)
    }

    /// One call: in place, or with the data loaded and stored by `ov` beside the ring (every
    /// copy it started has ended when this returns).
    pub(crate) fn reduce<'o>(
        &mut self,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        mut ov: Option<&mut (dyn Overlap + 'o)>,
    ) -> Result<()> {
        if let Some(why) = &self.failed {
            return Err(Error::protocol(format!(
                "the ring failed earlier and cannot be used: {why}"
            )));
        }
        let bytes = count
            .checked_mul(dtype.size())
            .filter(|b| *b <= self.cfg.max_bytes)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "{count} {dtype} elements exceed the communicator's capacity of {} bytes",
                    self.cfg.max_bytes
                ))
            })?;
        if self.world == 1 || bytes == 0 {
            return Ok(());
        }
        let plan = Plan::new(count, dtype, self.world, &self.cfg)?;
        let ran = match self.run(&plan, dtype, op, ov.as_deref_mut()) {
            Ok(()) => {
                self.calls += 1;
                Ok(())
            }
            Err(e) => {
                self.failed = Some(e.to_string());
                // Stop the device from touching the buffers on our behalf.
                self.tx.shut_down();
                self.rx.shut_down();
                Err(e)
            }
        };
        // Every staged copy ends with the call, failed or not: none may outlive its buffers.
        match ov {
            Some(ov) => ran.and(ov.finish()),
            None => ran,
        }
    }
}
