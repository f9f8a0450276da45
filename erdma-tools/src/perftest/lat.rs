//! The latency engine: one queue pair, one message at a time. SEND and WRITE are ping-pongs timed
//! by the client over round trips; READ is timed by the client alone, the server waiting.

use std::time::{Duration, Instant};

use erdma::connect::compat::perftest::{Keys, Role};
use erdma::{Completion, ProviderKind, RawSendWr, RemoteMr, SendFlags, Sge, WrOpcode};

use super::oob::Channel;
use super::setup::{STALL, Side, await_peer, post_recvs, repost, stalled};
use super::{Options, Verb};
use crate::report::{self, LatSamples};

/// A latency test's phases after the queue pair is armed, in either role.
pub(super) fn phases(
    o: &Options,
    s: &Side,
    mut ch: Box<dyn Channel>,
    role: Role,
    mine: &[Keys],
) -> erdma::Result<()> {
    // perftest (ib_send_lat): one exchange after the transition, then the keys again.
    ch.keys(&mine[0])?;
    for k in mine {
        ch.keys(k)?;
    }
    if o.verb == Verb::Send {
        // Receives of a whole area fit every size; each is reposted as it is consumed.
        post_recvs(s, 0, o.rx_depth.min(s.qps[0].caps().max_recv_wr))?;
    }
    if !o.quiet {
        println!("{}", report::lat_header());
    }
    let sizes = o.sizes();
    for (i, &size) in sizes.iter().enumerate() {
        if o.all && !o.quiet {
            eprintln!("{}: size {size} ({}/{})", o.tool_name(), i + 1, sizes.len());
        }
        if o.verb == Verb::Write {
            // The previous size finished on both sides and the sync below has not run.
            // SAFETY: nothing outstanding touches this byte of queue pair 0's target area now.
            unsafe { s.base.add(size as usize - 1).write_volatile(0) };
        }
        // The read server does nothing but wait for the client's next sync.
        if o.verb == Verb::Read && role == Role::Server {
            await_peer(s, o.port, &*ch, false)?;
        }
        ch.keys(&mine[0])?;
        let spoke = || role == Role::Server && o.duration.is_some() && ch.peer_spoke();
        let samples = match (o.verb, role) {
            (Verb::Send, _) => ping_pong(o, role, &mut SendStep::new(s, size), &spoke)?,
            (Verb::Write, _) => {
                let mut step = WriteStep::new(s, size, o.perftest_loop);
                ping_pong(o, role, &mut step, &spoke)?
            }
            (Verb::Read, Role::Client) => ping_pong(o, role, &mut ReadStep::new(s, size), &spoke)?,
            (Verb::Read, Role::Server) => LatSamples::new(0),
        };
        if let Some(st) = samples.stats(size) {
            if !o.quiet {
                println!("{}", report::lat_line(&st));
            }
        }
    }
    if !o.quiet {
        println!("{}", report::RULE);
    }
    if role == Role::Server {
        // The client writes its closing message first; it may still be running.
        await_peer(s, o.port, &*ch, false)?;
    }
    ch.close(&mine[0])
}

/// Waits for the next receive completion (send completions, signalled or forced, are reaped on
/// the way). `Ok(false)` when `ended` says the peer stopped first (duration runs).
fn wait_recv(
    s: &Side,
    what: &str,
    i: u64,
    iters: u64,
    ended: &dyn Fn() -> bool,
) -> erdma::Result<bool> {
    let mut wcs = [Completion::default(); 16];
    let mut watch = Watchdog::new(what, (i, iters), ended);
    loop {
        let n = s.cq.poll(&mut wcs)?;
        let mut got = false;
        for c in &wcs[..n] {
            let c = c.ok()?;
            if c.opcode.is_recv() {
                got = true;
            }
        }
        if got {
            return Ok(true);
        }
        if n == 0 && !watch.alive()? {
            return Ok(false);
        }
    }
}

/// What a latency loop's wait checks now and then: that it has not waited past [`STALL`], and
/// whether the peer ended a duration run. Looking costs a clock read every 1024 calls and the
/// peer check (three system calls) at most every 10 ms, so the wait stays a tight loop.
struct Watchdog<'a> {
    what: &'a str,
    at: (u64, u64),
    ended: &'a dyn Fn() -> bool,
    start: Instant,
    last_look: Instant,
    calls: u32,
}

impl<'a> Watchdog<'a> {
    fn new(what: &'a str, at: (u64, u64), ended: &'a dyn Fn() -> bool) -> Watchdog<'a> {
        let now = Instant::now();
        Watchdog {
            what,
            at,
            ended,
            start: now,
            last_look: now,
            calls: 0,
        }
    }

    /// `Ok(false)` once the peer has ended; an error past [`STALL`].
    fn alive(&mut self) -> erdma::Result<bool> {
        self.calls = self.calls.wrapping_add(1);
        if self.calls % 1024 != 0 {
            return Ok(true);
        }
        let now = Instant::now();
        if now.duration_since(self.last_look) < Duration::from_millis(10) {
            return Ok(true);
        }
        self.last_look = now;
        if (self.ended)() {
            return Ok(false);
        }
        if now.duration_since(self.start) > STALL {
            return Err(stalled(self.what, self.at.0, self.at.1));
        }
        Ok(true)
    }
}

/// What one verb does in the latency loop ([`ping_pong`]): how message `i` goes out, and how the
/// peer's message (on the client: the answer to its own) is awaited.
trait Step {
    /// A sample is the time between two of the client's stamps divided by this: 2 for the
    /// ping-pongs (perftest's half round trip), 1 for READ, whose round trip is one operation.
    const PER_TRIP: f64;

    /// Posts message `i` of `iters`.
    fn post(&mut self, i: u64, iters: u64) -> erdma::Result<()>;

    /// Waits for message `n` of the other end: on the server the client's, on the client the
    /// answer to its own. `at` is the position a stall names. `Ok(false)` when `ended` says the
    /// peer stopped first (duration runs).
    fn answer(&mut self, n: u64, at: (u64, u64), ended: &dyn Fn() -> bool) -> erdma::Result<bool>;
}

/// The latency loop of every verb: the client stamps the clock, posts and waits for the answer;
/// the server waits for the client's message and answers it. The client's stamps are the
/// samples.
fn ping_pong<S: Step>(
    o: &Options,
    role: Role,
    step: &mut S,
    ended: &dyn Fn() -> bool,
) -> erdma::Result<LatSamples> {
    let iters = if o.duration.is_some() {
        u64::MAX
    } else {
        o.iters
    };
    let end = o.duration.map(|d| Instant::now() + d);
    let mut times = Stamps {
        last: None,
        per_trip: S::PER_TRIP,
        samples: LatSamples::new(o.iters),
    };
    let mut i = 0u64;
    while i < iters {
        if role == Role::Server {
            if !step.answer(i, (i, iters), ended)? {
                break;
            }
        } else {
            times.stamp();
        }
        step.post(i, iters)?;
        i += 1;
        if role == Role::Client {
            step.answer(i - 1, (i, iters), &|| false)?;
            if end.is_some_and(|e| Instant::now() >= e) {
                break;
            }
        }
    }
    times.stamp();
    Ok(times.samples)
}

/// Round trips between consecutive stamps (microseconds), as they come.
struct Stamps {
    last: Option<Instant>,
    per_trip: f64,
    samples: LatSamples,
}

impl Stamps {
    fn stamp(&mut self) {
        let now = Instant::now();
        if let Some(prev) = self.last {
            self.samples
                .push((now - prev).as_secs_f64() * 1e6 / self.per_trip);
        }
        self.last = Some(now);
    }
}

/// One SGE over `size` bytes at `addr` of the side's region.
fn sge(s: &Side, addr: u64, size: u64) -> [Sge; 1] {
    [Sge {
        addr,
        length: size as u32,
        lkey: s.mr.lkey(),
    }]
}

/// The peer's area of queue pair 0, for messages of `size`.
fn remote(s: &Side, size: u64) -> RemoteMr {
    RemoteMr {
        addr: s.remotes[0].vaddr,
        len: size,
        rkey: s.remotes[0].rkey,
    }
}

/// SEND ping-pong: the client sends first; each side sends its next message once the peer's
/// has arrived.
struct SendStep<'s> {
    s: &'s Side,
    sge: [Sge; 1],
    inline: bool,
}

impl<'s> SendStep<'s> {
    fn new(s: &'s Side, size: u64) -> SendStep<'s> {
        SendStep {
            s,
            sge: sge(s, s.source(0), size),
            inline: size <= s.inline_max as u64,
        }
    }
}

impl Step for SendStep<'_> {
    const PER_TRIP: f64 = 2.0;

    fn post(&mut self, i: u64, iters: u64) -> erdma::Result<()> {
        let mut wr = RawSendWr::new(i, WrOpcode::Send, &self.sge);
        if (i + 1) % 100 == 0 || i + 1 == iters {
            wr.flags |= SendFlags::SIGNALED;
        }
        if self.inline {
            wr.flags |= SendFlags::INLINE;
        }
        // SAFETY: the SGE lies in `s.mr`, which outlives the queue pair, and the CPU never
        // writes the source area during the test.
        unsafe { self.s.qps[0].post_send_raw(std::slice::from_ref(&wr)) }
    }

    fn answer(&mut self, _: u64, at: (u64, u64), ended: &dyn Fn() -> bool) -> erdma::Result<bool> {
        if !wait_recv(self.s, "the SEND latency run", at.0, at.1, ended)? {
            return Ok(false);
        }
        repost(self.s, 0)?;
        Ok(true)
    }
}

/// WRITE ping-pong, as perftest's: each side writes a counter into the last byte of the peer's
/// buffer and spins on its own for the peer's answer; every WRITE is signalled, so each asks for
/// its acknowledgement at once (an unacknowledged one would wait for the retransmission timer).
///
/// On the soft device the thread reaps while it waits for the peer's WRITE (`wait_byte`);
/// elsewhere, and with `--perftest-loop`, the loop is perftest's: poll the send queue until
/// this WRITE's completion, then watch memory alone.
struct WriteStep<'s> {
    s: &'s Side,
    sge: [Sge; 1],
    remote: RemoteMr,
    inline: bool,
    /// Whether the thread reaps while it watches memory (the soft device's loop).
    soft: bool,
    /// The last byte of this side's target area, which the peer's WRITEs set.
    poll_byte: *mut u8,
    /// The last byte of this side's source area, which carries the counter out.
    post_byte: *mut u8,
    wcs: [Completion; 16],
}

impl<'s> WriteStep<'s> {
    fn new(s: &'s Side, size: u64, perftest_loop: bool) -> WriteStep<'s> {
        let flag_off = size as usize - 1;
        let post_off = s.area as usize + flag_off;
        // SAFETY: both offsets lie inside queue pair 0's areas of `s.mr` (size <= area).
        let (poll_byte, post_byte) = unsafe { (s.base.add(flag_off), s.base.add(post_off)) };
        WriteStep {
            s,
            sge: sge(s, s.source(0), size),
            remote: remote(s, size),
            inline: size <= s.inline_max as u64,
            soft: s.ctx.provider() == ProviderKind::Soft && !perftest_loop,
            poll_byte,
            post_byte,
            wcs: [Completion::default(); 16],
        }
    }
}

impl Step for WriteStep<'_> {
    const PER_TRIP: f64 = 2.0;

    fn post(&mut self, i: u64, iters: u64) -> erdma::Result<()> {
        // SAFETY: the previous WRITE from this byte has reached the peer (it answered), so the
        // device no longer reads this byte of `s.mr`'s source area.
        unsafe { self.post_byte.write_volatile((i + 1) as u8) };
        let mut wr = RawSendWr::new(i, WrOpcode::RdmaWrite, &self.sge);
        wr.remote = self.remote;
        wr.flags = SendFlags::SIGNALED;
        if self.inline {
            wr.flags |= SendFlags::INLINE;
        }
        // SAFETY: the SGE lies in `s.mr`, which outlives the queue pair.
        unsafe { self.s.qps[0].post_send_raw(std::slice::from_ref(&wr))? };
        if !self.soft {
            wait_send(self.s, "the WRITE latency run", i, iters)?;
        }
        Ok(())
    }

    fn answer(&mut self, n: u64, at: (u64, u64), ended: &dyn Fn() -> bool) -> erdma::Result<bool> {
        let (s, soft, wcs) = (self.s, self.soft, &mut self.wcs);
        let mut reap_soft = || if soft { reap(s, wcs) } else { Ok(()) };
        wait_byte(self.poll_byte, (n + 1) as u8, at, ended, &mut reap_soft)
    }
}

/// READ, timed by the client alone: each READ of the peer's area, posted once the previous one
/// has completed.
struct ReadStep<'s> {
    s: &'s Side,
    sge: [Sge; 1],
    remote: RemoteMr,
}

impl<'s> ReadStep<'s> {
    fn new(s: &'s Side, size: u64) -> ReadStep<'s> {
        ReadStep {
            s,
            sge: sge(s, s.target(0), size),
            remote: remote(s, size),
        }
    }
}

impl Step for ReadStep<'_> {
    const PER_TRIP: f64 = 1.0;

    fn post(&mut self, i: u64, _: u64) -> erdma::Result<()> {
        let mut wr = RawSendWr::new(i, WrOpcode::RdmaRead, &self.sge);
        wr.remote = self.remote;
        wr.flags = SendFlags::SIGNALED;
        // SAFETY: the SGE lies in `s.mr`, which outlives the queue pair, and the CPU never
        // reads the target area during the test.
        unsafe { self.s.qps[0].post_send_raw(std::slice::from_ref(&wr)) }
    }

    fn answer(&mut self, n: u64, at: (u64, u64), _: &dyn Fn() -> bool) -> erdma::Result<bool> {
        wait_send(self.s, "the READ latency run", n, at.1)?;
        Ok(true)
    }
}

/// Polls until the request numbered `i` has completed, failing on an error status.
fn wait_send(s: &Side, what: &str, i: u64, iters: u64) -> erdma::Result<()> {
    let mut wcs = [Completion::default(); 16];
    let start = Instant::now();
    loop {
        let n = s.cq.poll(&mut wcs)?;
        if wcs[..n]
            .iter()
            .try_fold(false, |got, c| c.ok().map(|c| got || c.wr_id == i))?
        {
            return Ok(());
        }
        if n == 0 && start.elapsed() > STALL {
            return Err(stalled(what, i, iters));
        }
    }
}

/// Takes every finished send completion off the queue, failing on an error status.
fn reap(s: &Side, wcs: &mut [Completion]) -> erdma::Result<()> {
    loop {
        let n = s.cq.poll(wcs)?;
        for c in &wcs[..n] {
            c.ok()?;
        }
        if n < wcs.len() {
            return Ok(());
        }
    }
}

/// Spins until the peer's WRITE sets `byte` to `want`, calling `reap` between looks.
/// `Ok(false)` when `ended` says the peer stopped first.
///
/// On the soft device `reap` polls the completion queue: that is what lets a polling thread
/// place the peer's WRITE without waking the device's engine thread. Elsewhere it does nothing
/// and the loop is perftest's (its caller waited for the send completion before).
fn wait_byte(
    byte: *mut u8,
    want: u8,
    (i, iters): (u64, u64),
    ended: &dyn Fn() -> bool,
    reap: &mut dyn FnMut() -> erdma::Result<()>,
) -> erdma::Result<bool> {
    let mut watch = Watchdog::new("the WRITE latency run", (i, iters), ended);
    loop {
        // A volatile byte read of memory a device may write concurrently sees either value.
        // SAFETY: `byte` lies in `s.mr`'s target area, which only the peer's WRITEs change.
        if unsafe { byte.read_volatile() } == want {
            return Ok(true);
        }
        reap()?;
        if !watch.alive()? {
            return Ok(false);
        }
        std::hint::spin_loop();
    }
}
