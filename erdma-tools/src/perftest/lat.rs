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
        let samples = match o.verb {
            Verb::Send => lat_send(o, s, size, role, &spoke)?,
            Verb::Write => lat_write(o, s, size, role, &spoke)?,
            Verb::Read if role == Role::Client => lat_read(o, s, size)?,
            Verb::Read => LatSamples::new(0),
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

fn lat_iters(o: &Options) -> u64 {
    if o.duration.is_some() {
        u64::MAX
    } else {
        o.iters
    }
}

/// Half round trips between consecutive stamps (microseconds), as they come.
struct HalfTrips {
    last: Option<Instant>,
    samples: LatSamples,
}

impl HalfTrips {
    fn new(o: &Options) -> HalfTrips {
        HalfTrips {
            last: None,
            samples: LatSamples::new(o.iters),
        }
    }

    fn stamp(&mut self) {
        let now = Instant::now();
        if let Some(prev) = self.last {
            self.samples.push((now - prev).as_secs_f64() * 1e6 / 2.0);
        }
        self.last = Some(now);
    }
}

/// SEND ping-pong: the client sends first; each side sends its next message once the peer's
/// has arrived. The client times round trips.
fn lat_send(
    o: &Options,
    s: &Side,
    size: u64,
    role: Role,
    ended: &dyn Fn() -> bool,
) -> erdma::Result<LatSamples> {
    let qp = &s.qps[0];
    let sge = [Sge {
        addr: s.source(0),
        length: size as u32,
        lkey: s.mr.lkey(),
    }];
    let inline = size <= s.inline_max as u64;
    let iters = lat_iters(o);
    let end = o.duration.map(|d| Instant::now() + d);
    let mut times = HalfTrips::new(o);
    let what = "the SEND latency run";
    let mut i = 0u64;
    while i < iters {
        if role == Role::Server {
            if !wait_recv(s, what, i, iters, ended)? {
                break;
            }
            repost(s, 0)?;
        } else {
            times.stamp();
        }
        let mut wr = RawSendWr::new(i, WrOpcode::Send, &sge);
        if (i + 1) % 100 == 0 || i + 1 == iters {
            wr.flags |= SendFlags::SIGNALED;
        }
        if inline {
            wr.flags |= SendFlags::INLINE;
        }
        // The source area is never written during the test.
        // SAFETY: the SGE lies in `s.mr`, which outlives the queue pair.
        unsafe { qp.post_send_raw(std::slice::from_ref(&wr))? };
        i += 1;
        if role == Role::Client {
            wait_recv(s, what, i, iters, &|| false)?;
            repost(s, 0)?;
            if end.is_some_and(|e| Instant::now() >= e) {
                break;
            }
        }
    }
    times.stamp();
    Ok(times.samples)
}

/// WRITE ping-pong, as perftest's: each side writes a counter into the last byte of the peer's
/// buffer and spins on its own for the peer's answer; every WRITE is signalled, so each asks for
/// its acknowledgement at once (an unacknowledged one would wait for the retransmission timer).
fn lat_write(
    o: &Options,
    s: &Side,
    size: u64,
    role: Role,
    ended: &dyn Fn() -> bool,
) -> erdma::Result<LatSamples> {
    let qp = &s.qps[0];
    let sge = [Sge {
        addr: s.source(0),
        length: size as u32,
        lkey: s.mr.lkey(),
    }];
    let inline = size <= s.inline_max as u64;
    let remote = RemoteMr {
        addr: s.remotes[0].vaddr,
        len: size,
        rkey: s.remotes[0].rkey,
    };
    let iters = lat_iters(o);
    let end = o.duration.map(|d| Instant::now() + d);
    let flag_off = size as usize - 1;
    let post_off = s.area as usize + flag_off;
    // SAFETY: both offsets lie inside queue pair 0's areas of `s.mr` (size <= area).
    let (poll_byte, post_byte) = unsafe { (s.base.add(flag_off), s.base.add(post_off)) };
    let mut times = HalfTrips::new(o);
    let mut wcs = [Completion::default(); 16];
    // On the soft device the thread reaps while it waits for the peer's WRITE (`wait_byte`);
    // elsewhere the loop is perftest's: poll the send queue until this WRITE's completion, then
    // watch memory alone.
    let soft = s.ctx.provider() == ProviderKind::Soft;
    let mut reap_soft = || if soft { reap(s, &mut wcs) } else { Ok(()) };
    let mut i = 0u64;
    while i < iters {
        let expect = (i + 1) as u8;
        if role == Role::Server {
            if !wait_byte(poll_byte, expect, (i, iters), ended, &mut reap_soft)? {
                break;
            }
        } else {
            times.stamp();
        }
        // The previous WRITE from this byte has reached the peer (it answered).
        // SAFETY: the device no longer reads this byte of `s.mr`'s source area.
        unsafe { post_byte.write_volatile(expect) };
        let mut wr = RawSendWr::new(i, WrOpcode::RdmaWrite, &sge);
        wr.remote = remote;
        wr.flags = SendFlags::SIGNALED;
        if inline {
            wr.flags |= SendFlags::INLINE;
        }
        // SAFETY: the SGE lies in `s.mr`, which outlives the queue pair.
        unsafe { qp.post_send_raw(std::slice::from_ref(&wr))? };
        if !soft {
            wait_send(s, "the WRITE latency run", i, iters)?;
        }
        i += 1;
        if role == Role::Client {
            wait_byte(poll_byte, expect, (i, iters), &|| false, &mut reap_soft)?;
            if end.is_some_and(|e| Instant::now() >= e) {
                break;
            }
        }
    }
    times.stamp();
    Ok(times.samples)
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

fn lat_read(o: &Options, s: &Side, size: u64) -> erdma::Result<LatSamples> {
    let qp = &s.qps[0];
    let sge = [Sge {
        addr: s.target(0),
        length: size as u32,
        lkey: s.mr.lkey(),
    }];
    let remote = RemoteMr {
        addr: s.remotes[0].vaddr,
        len: size,
        rkey: s.remotes[0].rkey,
    };
    let iters = lat_iters(o);
    let end = o.duration.map(|d| Instant::now() + d);
    let mut samples = LatSamples::new(o.iters);
    let mut i = 0u64;
    while i < iters {
        let mut wr = RawSendWr::new(i, WrOpcode::RdmaRead, &sge);
        wr.remote = remote;
        wr.flags = SendFlags::SIGNALED;
        let t0 = Instant::now();
        // The CPU never reads the target area during the test.
        // SAFETY: the SGE lies in `s.mr`, which outlives the queue pair.
        unsafe { qp.post_send_raw(std::slice::from_ref(&wr))? };
        wait_send(s, "the READ latency run", i, iters)?;
        samples.push(t0.elapsed().as_secs_f64() * 1e6);
        i += 1;
        if end.is_some_and(|e| Instant::now() >= e) {
            break;
        }
    }
    Ok(samples)
}
