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
//! - The immediate carries the step, the chunk and the slot (and the parity of the call, so a
//!   chunk of the next call that arrives early is kept for it); nothing is learnt by polling
//!   memory. A chunk received at step `s` is forwarded at step `s + 1`, so steps overlap.
//! - Chunks and credits are posted unsignaled: a call ends when every chunk has arrived here
//!   and every credit has come back (which proves every chunk sent arrived there, so the
//!   device is done reading the buffer).
//! - What one round of the loop posts on the K queue pairs goes out together
//!   ([`crate::coalesce_sends`]): on a soft device the K chunks' packets then share GSO
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

#![allow(unsafe_code)] // reductions over registered memory the protocol hands over

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::bootstrap::Bootstrap;
use super::buffer::{Overlap, ReduceBuffer};
use super::channel::{self, Message, QP_MASK, Receiver, Sender, Target};
use super::dtype::{DType, ReduceOp, reduce_into};
use super::host::{self, Host, HostShare};
use crate::connect::PeerInfo;
use crate::error::{Error, Result};
use crate::mr::{Mr, RemoteMr};
use crate::qp::{ConnectOptions, InitOptions, QpConfig};
use crate::vocab::Completion;
use crate::vocab::{Access, Sge};

use crate::{Context, Cq, Pd};

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

/// How a ring is built and run.
#[derive(Debug, Clone)]
pub struct RingConfig {
    /// Queue pairs per ring link (`NCCL_IB_QPS_PER_CONNECTION`).
    pub qps_per_connection: usize,
    /// Largest chunk, in bytes (also the size of one staging slot).
    pub chunk_bytes: usize,
    /// Staging slots (credits) per queue pair: the most chunks in flight on one queue pair
    /// (the window may allow fewer).
    pub slots: usize,
    /// Smallest chunk a segment is cut into, in bytes (capped by `chunk_bytes`): a segment
    /// smaller than `qps_per_connection` chunks of this size travels on fewer queue pairs.
    pub min_chunk_bytes: usize,
    /// Most bytes this rank keeps in flight towards its successor (chunks sent and not yet
    /// consumed there), at least one chunk: bounds how much data sits in the device's and the
    /// kernel's buffers at once.
    pub window_bytes: usize,
    /// Capacity of the communicator's buffer: the largest AllReduce, in bytes. The buffer and
    /// the staging slots are allocated, and made resident, when the communicator is created.
    pub max_bytes: usize,
    /// Longest wait for any progress (a chunk, a credit, a completion) before giving up.
    pub timeout: Duration,
    /// How long to poll for a completion (yielding the CPU between polls) before sleeping
    /// until one comes, in calls of at most [`RingConfig::spin_max_bytes`]: their steps are
    /// latency-bound, and polling also lets this thread do the device's receive work (where the
    /// host has fewer than two CPUs per rank: [`Communicator::host_share`]).
    pub spin: Duration,
    /// Largest call that polls before sleeping; larger ones sleep at once (their completions
    /// come at the pace of the data, and a polling thread takes CPU from the device).
    pub spin_max_bytes: usize,
    /// How the queue pairs are connected (transport timeout and retries bound how long a dead
    /// peer takes to be noticed).
    pub connect: ConnectOptions,
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig {
            qps_per_connection: 8,
            // 256 KiB chunks, 4 in flight per queue pair: on the soft device per-chunk costs
            // (a completion, a credit, a wake-up) then stay small against the bytes moved. In
            // three interleaved sweeps (4 ranks, 2 cores, soft devices) busbw at 4-64 MiB was
            // 20-30% above what 64 KiB chunks gave.
            chunk_bytes: 256 << 10,
            slots: 4,
            // Chunks as large as the slots (a 1 MiB call over 4 ranks: one 256 KiB chunk per
            // step, not 8 of 32 KiB), the steps rotating over the queue pairs: in interleaved
            // runs against the previous 4 KiB floor (4 ranks, 2 cores, soft devices) a 128 KiB
            // floor raised busbw 30-50% at 1 MiB and 15-20% at 2 MiB, as per-chunk costs
            // (completions, credits, acknowledgements) fall, and 256 KiB another 3-19% at
            // 1-4 MiB. At most 2 MiB in flight per link: +9% at 4 MiB (10 paired rounds), no
            // change at 8 MiB; less data waiting in the devices' and the kernel's buffers
            // leaves the copies more of the cache.
            min_chunk_bytes: 256 << 10,
            window_bytes: 2 << 20,
            max_bytes: 64 << 20,
            timeout: Duration::from_secs(15),
            spin: Duration::from_millis(1),
            // Polling through larger calls too (soft devices, 4 and 16 MiB, paired rounds): on 2
            // CPUs, 2 ranks 1.47× and 1.29× as fast, 4 ranks 0.97× and 1.01×, 8 ranks 0.92× and
            // 0.97×; on a 16-CPU host about 0.7× at 4 MiB once there are 1.5 CPUs or more per
            // rank (sleeping ranks leave the receiving to the engine threads, on CPUs of their
            // own), and mixed at one (0.93–1.12 in a later run, bench/results/log.md). With
            // two CPUs per rank, polling through every call with the receiving left to the engine
            // threads was 1.2–1.5× as fast at 1 MiB and even or slower at 4–16 MiB: only calls
            // up to this size leave it to them (`Communicator::host_share`), larger ones keep
            // sleeping.
            spin_max_bytes: 2 << 20,
            // A retransmission timer of 4.096 µs × 2^16 ≈ 270 ms, 7 retries: a rank descheduled
            // for a while on a busy host is not taken for dead, a dead one is noticed in ~2 s,
            // and a lost last packet costs one timer period.
            connect: ConnectOptions {
                timeout: 16,
                retry_cnt: 7,
                ..ConnectOptions::default()
            },
        }
    }
}

impl RingConfig {
    fn validate(&self) -> Result<()> {
        let bad = |w: String| Err(Error::invalid(w));
        if self.qps_per_connection == 0 || self.qps_per_connection > 64 {
            return bad(format!(
                "{} queue pairs per connection (1..=64)",
                self.qps_per_connection
            ));
        }
        if self.slots == 0 || self.slots > MAX_SLOTS {
            return bad(format!(
                "{} slots per queue pair (1..={MAX_SLOTS})",
                self.slots
            ));
        }
        if self.chunk_bytes < 64 || self.chunk_bytes > (1 << 30) {
            return bad(format!(
                "a chunk of {} bytes (64..=1 GiB)",
                self.chunk_bytes
            ));
        }
        Ok(())
    }

    /// What every rank must agree on, as [`FINGERPRINT_LEN`] bytes.
    fn fingerprint(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(FINGERPRINT_LEN);
        v.extend_from_slice(&(self.qps_per_connection as u32).to_be_bytes());
        v.extend_from_slice(&(self.slots as u32).to_be_bytes());
        v.extend_from_slice(&(self.chunk_bytes as u64).to_be_bytes());
        v.extend_from_slice(&(self.min_chunk_bytes as u64).to_be_bytes());
        v.extend_from_slice(&(self.max_bytes as u64).to_be_bytes());
        debug_assert_eq!(v.len(), FINGERPRINT_LEN);
        v
    }
}

/// Bytes of [`RingConfig::fingerprint`]; a rank's description of its host follows them in the
/// setup data.
const FINGERPRINT_LEN: usize = 32;

/// One rank's part of a ring: its queue pairs, registered buffers and channel state.
///
/// Reduce in place in [`Communicator::buffer_mut`] with [`Communicator::all_reduce_in_place`],
/// or reduce any [`ReduceBuffer`] (staged through that buffer) with
/// [`Communicator::all_reduce`]. Every rank must make the same calls with the same arguments.
pub struct Communicator {
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

/// The geometry of one call: segments per rank and chunks per step.
struct Plan {
    elem: usize,
    chunk_elems: usize,
    seg_off: Vec<usize>,
    seg_len: Vec<usize>,
    steps: usize,
}

impl Plan {
    fn new(count: usize, dtype: DType, world: usize, cfg: &RingConfig) -> Result<Plan> {
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
    fn send_seg(&self, rank: usize, step: usize) -> usize {
        let n = self.seg_len.len();
        if step < n - 1 {
            (rank + n - step) % n
        } else {
            (rank + 1 + n - (step - (n - 1))) % n
        }
    }

    /// The segment a rank receives at `step`.
    fn recv_seg(&self, rank: usize, step: usize) -> usize {
        let n = self.seg_len.len();
        (self.send_seg(rank, step) + n - 1) % n
    }

    /// Chunks of a segment: an empty segment (fewer elements than ranks) still travels as one
    /// empty chunk, so that every link carries every step of every call. That keeps each rank
    /// within one call of its neighbours (a sender cannot finish a call before its successor
    /// has consumed its chunks), which the call parity in the immediate relies on.
    fn chunks(&self, seg: usize) -> usize {
        self.seg_len[seg].div_ceil(self.chunk_elems).max(1)
    }

    /// Byte offset and length of chunk `c` of segment `seg`.
    fn chunk(&self, seg: usize, c: usize) -> (usize, usize) {
        let start = c * self.chunk_elems;
        let len = self.chunk_elems.min(self.seg_len[seg] - start);
        ((self.seg_off[seg] + start) * self.elem, len * self.elem)
    }

    fn is_reduce(&self, step: usize) -> bool {
        step < self.seg_len.len() - 1
    }
}

/// The queue pair that carries chunk `c` of `step` on a link of `k`, in a call that starts at
/// queue pair `first`: chunks go round robin, starting one queue pair further at each step, so
/// that calls with fewer chunks per step than queue pairs spread their steps over several of
/// them.
fn qp_of(first: usize, step: usize, c: usize, k: usize) -> usize {
    (first + c + step) % k
}

/// The queue pair call number `call` starts at ([`qp_of`]): where the previous call's steps
/// ended, so that a run of small calls spreads over every queue pair, not only the first few.
/// Both ends of a link count the calls alike.
fn first_qp(call: u64, steps: usize, k: usize) -> usize {
    ((call % k as u64) as usize * steps) % k
}

/// How many of its ready chunks (`(step, chunk)`, in order) each queue pair posts now, into
/// `take`: at most its credits, and at most `budget` in all, the oldest chunks (by step, then
/// chunk) first.
fn schedule(
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
fn chunk_id(epoch: bool, step: usize, chunk: usize) -> u32 {
    (if epoch { EPOCH } else { 0 }) | ((step as u32) << 16) | chunk as u32
}

fn parse_chunk_id(user: u32) -> (bool, usize, usize) {
    (
        user & EPOCH != 0,
        ((user >> 16) & 0x3f) as usize,
        (user & 0xffff) as usize,
    )
}

/// Names the neighbour in a channel's protocol errors.
fn blame(rank: usize, peer: usize) -> impl Fn(Error) -> Error {
    move |e| match e {
        Error::Protocol { what } => Error::protocol(format!("rank {rank}: rank {peer}: {what}")),
        e => e,
    }
}

impl Communicator {
    /// Builds this rank's part of the ring on `ctx`: creates and registers its buffers and
    /// queue pairs, swaps them with its neighbours through `boot`, connects, and waits for
    /// every rank to be ready.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad configuration (or one that differs between ranks),
    /// errors of the device when creating resources, and the bootstrap's errors.
    pub fn new(ctx: &Context, boot: &mut Bootstrap, cfg: RingConfig) -> Result<Communicator> {
        cfg.validate()?;
        let (rank, world) = (boot.rank(), boot.world());
        if world > MAX_RANKS {
            return Err(Error::invalid(format!(
                "a ring of {world} ranks (at most {MAX_RANKS})"
            )));
        }
        let k = cfg.qps_per_connection;
        let s = cfg.slots;
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq((2 * k * (4 * s + 16)) as u32)?;
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        let work = pd.alloc(cfg.max_bytes.max(64), access)?;
        let staging = pd.alloc(k * s * cfg.chunk_bytes, access)?;
        let qp_config = QpConfig::new(&cq)
            // Room for S chunks (or credits) plus the unsignaled run the SDK allows before it
            // asks the device for a completion to retire them.
            .max_send_wr(4 * s as u32 + 16)
            .max_recv_wr(2 * s as u32 + 2)
            .max_send_sge(1)
            .max_recv_sge(1);
        // Only the predecessor writes into this rank's memory, through the queue pairs it
        // connects to (`rx`). The successor's queue pairs (`tx`) take credits, which are sends,
        // and grant it nothing.
        let rx_attr = InitOptions {
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            ..InitOptions::default()
        };
        let tx_attr = InitOptions {
            access: Access::LOCAL_WRITE,
            ..InitOptions::default()
        };
        let single = world == 1;
        let (mut tx_init, mut rx_init) = (Vec::new(), Vec::new());
        if !single {
            for _ in 0..k {
                tx_init.push(pd.create_qp(&qp_config)?.init(&tx_attr)?);
                rx_init.push(pd.create_qp(&qp_config)?.init(&rx_attr)?);
            }
        }
        let mut endpoints = Vec::with_capacity(2 * k);
        for qp in tx_init.iter().chain(rx_init.iter()) {
            endpoints.push(qp.endpoint()?);
        }
        let host = Host::this();
        let mut user = cfg.fingerprint();
        host.encode(&mut user);
        let mine = PeerInfo {
            endpoints,
            regions: vec![staging.remote(), work.remote()],
            user,
        };
        let all = boot.all_gather(&mine.encode()?)?;
        let mut infos = Vec::with_capacity(world);
        let mut hosts = Vec::with_capacity(world);
        for (r, bytes) in all.iter().enumerate() {
            let info = PeerInfo::decode(bytes)
                .map_err(|e| Error::protocol(format!("rank {r}'s ring setup: {e}")))?;
            let (fingerprint, their_host) = info
                .user
                .split_at_checked(FINGERPRINT_LEN)
                .unwrap_or((&info.user, &[]));
            if fingerprint != &mine.user[..FINGERPRINT_LEN] {
                return Err(Error::invalid(format!(
                    "rank {r} runs with another ring configuration (queue pairs, slots, chunk \
                     or capacity) than rank {rank}"
                )));
            }
            hosts.push(
                Host::decode(their_host)
                    .map_err(|e| Error::protocol(format!("rank {r}'s ring setup: {e}")))?,
            );
            if !single && (info.endpoints.len() != 2 * k || info.regions.len() != 2) {
                return Err(Error::protocol(format!(
                    "rank {r} announced {} queue pairs and {} regions (expected {} and 2)",
                    info.endpoints.len(),
                    info.regions.len(),
                    2 * k
                )));
            }
            infos.push(info);
        }
        let next = &infos[(rank + 1) % world];
        let prev = &infos[(rank + world - 1) % world];
        let mut tx = Vec::with_capacity(k);
        let mut rx = Vec::with_capacity(k);
        for (i, qp) in tx_init.into_iter().enumerate() {
            tx.push(qp.connect(&next.endpoints[k + i], &cfg.connect)?);
        }
        for (i, qp) in rx_init.into_iter().enumerate() {
            rx.push(qp.connect(&prev.endpoints[i], &cfg.connect)?);
        }
        let (peer_staging, peer_work) = if single {
            (RemoteMr::default(), RemoteMr::default())
        } else {
            (next.regions[0], next.regions[1])
        };
        let tx = Sender::new(tx, s, cfg.chunk_bytes, peer_staging, TX)?;
        let rx = Receiver::new(rx, s, cfg.chunk_bytes, RX)?;
        let host_share = host::share(&host, &hosts);
        // Nobody writes before everybody's queue pairs are connected and receiving.
        boot.barrier()?;
        Ok(Communicator {
            tx,
            rx,
            cq,
            #[cfg(feature = "gpu")]
            host_pin: None,
            #[cfg(feature = "gpu")]
            gpu_copies: None,
            work,
            staging,
            _pd: pd,
            peer_work,
            rank,
            world,
            early: VecDeque::new(),
            calls: 0,
            failed: None,
            cfg,
            host_share,
        })
    }

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

    fn run<'o>(
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
            crate::soft::coalesce_sends(|| -> Result<()> {
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
            crate::soft::coalesce_sends(|| self.rx.flush_credits())?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::bootstrap::tests::{join, master};
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

    /// Staging that loads a unit only when the ring waits for it (until then the host bytes
    /// are poison, so a read before the wait gives a wrong sum) and stores at once (a store of
    /// a chunk before its result is final leaves a wrong value in the memory).
    struct LazyStaging {
        /// The memory being reduced ("device" memory).
        mem: Vec<u8>,
        host: *mut u8,
        host_len: usize,
        loads: Vec<Option<(usize, usize)>>,
        stored: Vec<(usize, usize)>,
    }

    impl Overlap for LazyStaging {
        unsafe fn load(&mut self, unit: usize, off: usize, len: usize) -> Result<()> {
            assert!(off + len <= self.mem.len() && off + len <= self.host_len);
            // SAFETY: in bounds of the host buffer (asserted); the ring leaves it alone.
            unsafe { std::ptr::write_bytes(self.host.add(off), 0xA5, len) };
            if self.loads.len() <= unit {
                self.loads.resize(unit + 1, None);
            }
            assert!(self.loads[unit].is_none(), "unit {unit} loaded twice");
            self.loads[unit] = Some((off, len));
            Ok(())
        }

        fn loaded(&mut self, unit: usize) -> Result<()> {
            let (off, len) = self.loads[unit]
                .take()
                .unwrap_or_else(|| panic!("unit {unit} waited for twice"));
            let src = &self.mem[off..off + len];
            // SAFETY: in bounds (asserted at load); the ring waits here before touching it.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.host.add(off), len) };
            Ok(())
        }

        unsafe fn store(&mut self, off: usize, len: usize) -> Result<()> {
            let dst = &mut self.mem[off..off + len];
            // In bounds of both: the slice above, and the host buffer as the ring's own chunk.
            // SAFETY: both ranges are in bounds (above).
            unsafe { std::ptr::copy_nonoverlapping(self.host.add(off), dst.as_mut_ptr(), len) };
            self.stored.push((off, len));
            Ok(())
        }

        fn finish(&mut self) -> Result<()> {
            Ok(())
        }
    }

    fn input(rank: usize, i: usize, call: usize) -> i32 {
        (i as i32 % 1000) * (rank as i32 + 1) - 37 * call as i32
    }

    /// The queue pairs a rank credits its successor on grant that successor nothing: a WRITE
    /// sent back through them into this rank's buffer is refused and changes no byte, while the
    /// ring itself still runs.
    #[test]
    fn the_successor_cannot_write_through_the_credit_queue_pairs() {
        let (l, port) = master();
        let mut l = Some(l);
        let (wrote, written) = std::sync::mpsc::channel::<()>();
        // Rank 1 tries the WRITE and says so; rank 0 then looks at its buffer.
        let mut wrote = Some(wrote);
        let mut written = Some(written);
        let handles: Vec<_> = (0..2usize)
            .map(|rank| {
                let mine = if rank == 0 { l.take() } else { None };
                let (done_tx, done_rx) = if rank == 1 {
                    (wrote.take(), None)
                } else {
                    (None, written.take())
                };
                std::thread::spawn(move || {
                    let ctx = crate::Context::open(&format!("soft:127.75.9.{}", rank + 1)).unwrap();
                    let mut boot = join(rank, 2, mine, port, Duration::from_secs(30)).unwrap();
                    let cfg = RingConfig {
                        qps_per_connection: 2,
                        chunk_bytes: 4096,
                        min_chunk_bytes: 4096,
                        slots: 2,
                        max_bytes: 1 << 16,
                        ..RingConfig::default()
                    };
                    let mut comm = Communicator::new(&ctx, &mut boot, cfg).unwrap();
                    comm.buffer_mut()[..4096].fill(rank as u8 + 1);
                    comm.all_reduce_in_place(1024, DType::I32, ReduceOp::Sum)
                        .unwrap();
                    let sum = i32::from_ne_bytes([3; 4]);
                    let first = i32::from_ne_bytes(comm.buffer()[..4].try_into().unwrap());
                    assert_eq!(first, sum, "rank {rank}: the ring runs");
                    boot.barrier().unwrap();
                    if rank == 1 {
                        // Rank 1's receiving queue pairs are connected to rank 0's crediting
                        // ones; in a ring of two, rank 0's buffer is `peer_work` here.
                        let target = comm.peer_work.slice(0, 8).unwrap();
                        let wr = crate::SendWr::write_inline(0xbad, &[0xee; 8], target).signaled();
                        comm.rx.qp(0).post_send(wr).unwrap();
                        // The queue pair's receives are flushed as it breaks: look past them.
                        let wc = loop {
                            let wc = comm.cq.wait_one(Duration::from_secs(10)).unwrap();
                            if wc.wr_id == 0xbad {
                                break wc;
                            }
                            assert_eq!(wc.status, crate::WcStatus::WrFlushErr, "{wc:?}");
                        };
                        // The peer refuses an operation its queue pair does not allow with
                        // NAK "invalid request", as rxe does.
                        assert_eq!(wc.status, crate::WcStatus::RemInvReqErr, "{wc:?}");
                        done_tx.unwrap().send(()).unwrap();
                    } else {
                        done_rx.unwrap().recv().unwrap();
                        let head = i32::from_ne_bytes(comm.buffer()[..4].try_into().unwrap());
                        assert_eq!(head, sum, "rank 0's buffer was written by its successor");
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("a rank failed");
        }
    }

    /// Loads and stores beside the ring: every unit is waited for before its bytes are read,
    /// every byte is stored once and only when final, for 2-4 ranks and counts that divide by
    /// nothing (several units per segment with 4 KiB chunks).
    #[test]
    fn staged_loads_precede_reads_and_stores_follow_results() {
        for world in [2usize, 3, 4] {
            let (l, port) = master();
            let mut l = Some(l);
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let mine = if rank == 0 { l.take() } else { None };
                    std::thread::spawn(move || {
                        let dev = format!("soft:127.75.{world}.{}", rank + 1);
                        let ctx = crate::Context::open(&dev).unwrap();
                        let t = Duration::from_secs(30);
                        let mut boot = join(rank, world, mine, port, t).unwrap();
                        let cfg = RingConfig {
                            qps_per_connection: 3,
                            chunk_bytes: 4096,
                            min_chunk_bytes: 4096,
                            slots: 2,
                            window_bytes: 5 * 4096,
                            max_bytes: 1 << 20,
                            ..RingConfig::default()
                        };
                        let mut comm = Communicator::new(&ctx, &mut boot, cfg).unwrap();
                        // Every rank runs on this host: each counts them all.
                        let share = comm.host_share().unwrap();
                        assert_eq!(share.ranks, world);
                        for (call, count) in
                            [1usize, 7, 3001, 65_537, 40_000].into_iter().enumerate()
                        {
                            let mut st = LazyStaging {
                                mem: (0..count)
                                    .flat_map(|i| input(rank, i, call).to_ne_bytes())
                                    .collect(),
                                host: comm.work.as_mut_ptr(),
                                host_len: comm.work.len(),
                                loads: Vec::new(),
                                stored: Vec::new(),
                            };
                            comm.reduce(count, DType::I32, ReduceOp::Sum, Some(&mut st))
                                .unwrap();
                            let what = format!("rank {rank} of {world}, {count} elements");
                            assert!(
                                st.loads.iter().all(Option::is_none),
                                "{what}: a unit was never waited for"
                            );
                            for i in 0..count {
                                let got = i32::from_ne_bytes(
                                    st.mem[i * 4..i * 4 + 4].try_into().unwrap(),
                                );
                                let want: i32 = (0..world).map(|r| input(r, i, call)).sum();
                                assert_eq!(got, want, "{what}: element {i}");
                            }
                            st.stored.sort_unstable();
                            let mut at = 0;
                            for &(off, len) in &st.stored {
                                assert_eq!(off, at, "{what}: stores {:?}", st.stored);
                                at += len;
                            }
                            assert_eq!(at, count * 4, "{what}: every byte stored once");
                        }
                        // Small calls: their polls did the receive work unless there were two
                        // CPUs for each rank.
                        assert_eq!(comm.cq.inline_progress(), !share.two_cpus_per_rank());
                    })
                })
                .collect();
            for h in handles {
                h.join().expect("a rank failed");
            }
        }
    }
}
